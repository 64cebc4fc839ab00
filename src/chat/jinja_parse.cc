// Lexer and parser: jinja2's (lexer.py, parser.py) rules for the default delimiters — whitespace
// control, trim_blocks and lstrip_blocks as its lexer applies them, and its grammar and operator
// precedence.
#include <cstring>

#include "combs/base/utf8.h"
#include "jinja_internal.h"

namespace combs::jinja {
namespace {

// Python's str.isspace for the code point at s[i] (its byte length in *len).
bool py_space_at(std::string_view s, size_t i, size_t* len) { return py_space(decode_utf8(s, i, len)); }

std::string_view rstrip(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xc0) == 0x80) --start;
    size_t len;
    if (!py_space_at(s, start, &len) || start + len != end) break;
    end = start;
  }
  return s.substr(0, end);
}

size_t skip_space(std::string_view s, size_t i) {
  size_t len;
  while (i < s.size() && py_space_at(s, i, &len)) i += len;
  return i;
}

bool all_space(std::string_view s) { return skip_space(s, 0) == s.size(); }

enum class Tok : uint8_t { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;  // text, name, operator, string value
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// Python's unicode-escape decoding of a string literal's body, as jinja2 applies it.
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k] != '\\' || k + 1 >= s.size()) {
      out += s[k];
      continue;
    }
    const char c = s[++k];
    auto hex = [&](size_t digits) -> uint32_t {
      uint32_t v = 0;
      for (size_t d = 1; d <= digits; ++d) {
        const char h = k + d < s.size() ? s[k + d] : 'g';
        const int x = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (x < 0) fail("line " + std::to_string(line) + ": malformed \\x, \\u or \\U escape in a string");
        v = v * 16 + static_cast<uint32_t>(x);
      }
      k += digits;
      return v;
    };
    uint32_t cp;
    switch (c) {
      case '\n': continue;  // a backslash before a newline joins the lines
      case '\\': out += '\\'; continue;
      case '\'': out += '\''; continue;
      case '"': out += '"'; continue;
      case 'a': out += '\a'; continue;
      case 'b': out += '\b'; continue;
      case 'f': out += '\f'; continue;
      case 'n': out += '\n'; continue;
      case 'r': out += '\r'; continue;
      case 't': out += '\t'; continue;
      case 'v': out += '\v'; continue;
      case 'x': cp = hex(2); break;
      case 'u': cp = hex(4); break;
      case 'U': cp = hex(8); break;
      default:
        if (c >= '0' && c <= '7') {
          cp = static_cast<uint32_t>(c - '0');
          for (int d = 0; d < 2 && k + 1 < s.size() && s[k + 1] >= '0' && s[k + 1] <= '7'; ++d) cp = cp * 8 + (s[++k] - '0');
          break;
        }
        out += '\\';
        out += c;
        continue;
    }
    if (cp > 0x10ffff) fail("line " + std::to_string(line) + ": escape beyond U+10FFFF in a string");
    append_utf8(cp, out);
  }
  return out;
}

class Lexer {
 public:
  Lexer(std::string_view source, const Options& o) : o_(o) {
    // Newlines become \n, and one at the very end goes (keep_trailing_newline off).
    src_.reserve(source.size());
    for (size_t k = 0; k < source.size(); ++k) {
      if (source[k] == '\r') {
        src_ += '\n';
        if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
      } else {
        src_ += source[k];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    const std::string_view s = src_;
    while (pos < s.size()) {
      size_t start = pos;
      char kind = 0;
      for (; start + 1 < s.size(); ++start) {
        if (s[start] == '{' && (s[start + 1] == '{' || s[start + 1] == '%' || s[start + 1] == '#')) {
          kind = s[start + 1];
          break;
        }
      }
      if (kind == 0) {
        text(s.substr(pos));
        break;
      }
      const char sign = start + 2 < s.size() && (s[start + 2] == '-' || s[start + 2] == '+') ? s[start + 2] : 0;
      std::string_view data = s.substr(pos, start - pos);
      if (sign == '-') {
        data = rstrip(data);
      } else if (sign != '+' && o_.lstrip_blocks && kind != '{') {
        const size_t l = data.rfind('\n') + 1;  // npos + 1 == 0
        if ((l > 0 || line_starting) && all_space(data.substr(l))) data = data.substr(0, l);
      }
      text(data);
      line_ += count_lines(s.substr(pos, start - pos));
      size_t p = start + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        const size_t q = s.find("#}", p);
        if (q == std::string_view::npos) fail("line " + std::to_string(line_) + ": missing end of comment tag");
        const char esign = q > p && (s[q - 1] == '-' || s[q - 1] == '+') ? s[q - 1] : 0;
        line_ += count_lines(s.substr(p, q - p));
        pos = after_end(q + 2, esign, /*block=*/true, &line_starting);
        continue;
      }
      if (kind == '%' && is_raw(p)) {
        pos = raw(p, &line_starting);
        continue;
      }
      out_.push_back({kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", 0, 0, line_});
      pos = tag(p, kind == '{', &line_starting);
    }
    out_.push_back({Tok::kEof, "", 0, 0, line_});
    return std::move(out_);
  }

 private:
  static int count_lines(std::string_view s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
  }
  void text(std::string_view t) {
    if (!t.empty()) out_.push_back({Tok::kText, std::string(t), 0, 0, line_});
  }
  // After an end delimiter at `p` (its sign before it): '-' eats the whitespace after, trim_blocks
  // one newline after a block or comment unless '+'.
  size_t after_end(size_t p, char sign, bool block, bool* line_starting) {
    const std::string_view s = src_;
    size_t e = p;
    if (sign == '-') e = skip_space(s, p);
    else if (block && sign != '+' && o_.trim_blocks && e < s.size() && s[e] == '\n') ++e;
    line_ += count_lines(s.substr(p, e - p));
    *line_starting = e > 0 && s[e - 1] == '\n';
    return e;
  }
  bool is_raw(size_t p) const {
    const std::string_view s = src_;
    size_t q = skip_space(s, p);
    if (s.compare(q, 3, "raw") != 0) return false;
    q = skip_space(s, q + 3);
    return s.compare(q, 2, "%}") == 0 || s.compare(q, 3, "-%}") == 0;
  }
  size_t raw(size_t p, bool* line_starting) {
    const std::string_view s = src_;
    size_t q = skip_space(s, skip_space(s, p) + 3);
    q = s[q] == '-' ? skip_space(s, q + 3) : q + 2;  // the raw tag's end: no trim_blocks
    line_ += count_lines(s.substr(p, q - p));
    for (size_t k = q; (k = s.find("{%", k)) != std::string_view::npos; k += 2) {
      size_t r = k + 2;
      const char sign = r < s.size() && (s[r] == '-' || s[r] == '+') ? s[r++] : 0;
      r = skip_space(s, r);
      if (s.compare(r, 6, "endraw") != 0) continue;
      r = skip_space(s, r + 6);
      char esign = 0;
      if (r < s.size() && (s[r] == '-' || s[r] == '+')) esign = s[r++];
      if (s.compare(r, 2, "%}") != 0) continue;
      std::string_view body = s.substr(q, k - q);
      if (sign == '-') {
        body = rstrip(body);
      } else if (sign != '+' && o_.lstrip_blocks) {
        const size_t l = body.rfind('\n') + 1;
        if (l > 0 && all_space(body.substr(l))) body = body.substr(0, l);
      }
      text(body);
      line_ += count_lines(s.substr(q, r - q));
      return after_end(r + 2, esign, true, line_starting);
    }
    fail("line " + std::to_string(line_) + ": missing end of raw directive");
  }
  // The tokens of a {{ }} or {% %} tag from p; returns where the text after it starts.
  size_t tag(size_t p, bool var, bool* line_starting) {
    const std::string_view s = src_;
    std::vector<char> balance;
    static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/", "*", "%", "~", "<", ">", "=", ".",
                                 ":", ",", "|", "(", ")", "[", "]", "{", "}", ";", "!"};
    while (true) {
      const size_t q = skip_space(s, p);
      line_ += count_lines(s.substr(p, q - p));
      p = q;
      if (p >= s.size()) fail("line " + std::to_string(line_) + ": unexpected end of template (an unclosed tag)");
      if (balance.empty()) {
        const char* end = var ? "}}" : "%}";
        char sign = 0;
        size_t e = p;
        if ((s[p] == '-' || (s[p] == '+' && !var)) && s.compare(p + 1, 2, end) == 0) sign = s[p], e = p + 1;
        if (s.compare(e, 2, end) == 0) {
          out_.push_back({var ? Tok::kVarEnd : Tok::kBlockEnd, "", 0, 0, line_});
          return after_end(e + 2, sign, !var, line_starting);
        }
      }
      const char c = s[p];
      if (c == '\'' || c == '"') {
        size_t k = p + 1;
        while (k < s.size() && s[k] != c) k += s[k] == '\\' ? 2 : 1;
        if (k >= s.size()) fail("line " + std::to_string(line_) + ": unexpected end of string");
        out_.push_back({Tok::kString, unescape(s.substr(p + 1, k - p - 1), line_), 0, 0, line_});
        line_ += count_lines(s.substr(p, k - p));
        p = k + 1;
        continue;
      }
      if (c >= '0' && c <= '9') {
        size_t k = p;
        auto digits = [&] {
          while (k < s.size() && ((s[k] >= '0' && s[k] <= '9') || (s[k] == '_' && k + 1 < s.size() && isdigit(static_cast<unsigned char>(s[k + 1])))))
            ++k;
        };
        digits();
        bool is_float = false;
        if (k + 1 < s.size() && s[k] == '.' && isdigit(static_cast<unsigned char>(s[k + 1]))) {
          ++k;
          digits();
          is_float = true;
        }
        if (k < s.size() && (s[k] == 'e' || s[k] == 'E')) {
          size_t m = k + 1;
          if (m < s.size() && (s[m] == '+' || s[m] == '-')) ++m;
          if (m < s.size() && isdigit(static_cast<unsigned char>(s[m]))) {
            k = m;
            digits();
            is_float = true;
          }
        }
        std::string num;
        for (size_t m = p; m < k; ++m)
          if (s[m] != '_') num += s[m];
        Token t{is_float ? Tok::kFloat : Tok::kInt, num, 0, 0, line_};
        try {
          if (is_float) t.f = std::stod(num);
          else t.i = std::stoll(num);
        } catch (const std::exception&) {
          fail("line " + std::to_string(line_) + ": number out of range: " + num);
        }
        out_.push_back(t);
        p = k;
        continue;
      }
      if (c == '_' || isalpha(static_cast<unsigned char>(c))) {
        size_t k = p;
        while (k < s.size() && (s[k] == '_' || isalnum(static_cast<unsigned char>(s[k])))) ++k;
        out_.push_back({Tok::kName, std::string(s.substr(p, k - p)), 0, 0, line_});
        p = k;
        continue;
      }
      const char* op = nullptr;
      for (const char* o : kOps) {
        if (s.compare(p, std::strlen(o), o) == 0) {
          op = o;
          break;
        }
      }
      if (op == nullptr) fail("line " + std::to_string(line_) + ": unexpected char '" + std::string(1, c) + "'");
      if (*op == '(' || *op == '[' || *op == '{') balance.push_back(*op == '(' ? ')' : *op == '[' ? ']' : '}');
      if ((*op == ')' || *op == ']' || *op == '}') && op[1] == 0) {
        if (balance.empty()) fail("line " + std::to_string(line_) + ": unexpected '" + std::string(op) + "'");
        if (balance.back() != *op) {
          fail("line " + std::to_string(line_) + ": unexpected '" + std::string(op) + "', expected '" + balance.back() + "'");
        }
        balance.pop_back();
      }
      out_.push_back({Tok::kOp, op, 0, 0, line_});
      p += std::strlen(op);
    }
  }

  const Options& o_;
  std::string src_;
  std::vector<Token> out_;
  int line_ = 1;
};

class Parser {
 public:
  Parser(std::vector<Token> tokens, const Options& o) : t_(std::move(tokens)), o_(o) {}

  std::shared_ptr<Program> program() {
    const char base = 0;
    stack_base_ = &base;
    auto p = std::make_shared<Program>();
    p->body = body({});
    if (cur().type != Tok::kEof) fail(at("unexpected tag"));
    return p;
  }

 private:
  struct Depth {
    Parser* p;
    explicit Depth(Parser* parser) : p(parser) {
      if (++p->depth_ > p->o_.limits.max_depth) fail(p->at("the template nests deeper than " + std::to_string(p->o_.limits.max_depth)));
      check_stack(p->stack_base_);
    }
    ~Depth() { --p->depth_; }
  };

  const Token& cur() const { return t_[k_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(k_ + n, t_.size() - 1)]; }
  std::string at(const std::string& what) const { return "line " + std::to_string(cur().line) + ": " + what; }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == Tok::kName && cur().text == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++k_;
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    ++k_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(at(std::string("expected '") + op + "'" + got()));
  }
  std::string got() const {
    switch (cur().type) {
      case Tok::kEof: return " (got the end of the template)";
      case Tok::kBlockEnd: return " (got the end of the statement)";
      case Tok::kVarEnd: return " (got the end of the print statement)";
      default: return " (got '" + cur().text + "')";
    }
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail(at("expected a name" + got()));
    return t_[k_++].text;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) fail(at("expected the end of the statement" + got()));
    ++k_;
  }

  // Nodes until a block tag whose first name is in `ends` (left unconsumed, at its name).
  Body body(const std::vector<const char*>& ends) {
    Depth d(this);
    Body out;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEof) {
        if (!ends.empty()) fail(at(std::string("unexpected end of template: expected '") + ends.back() + "'"));
        return out;
      }
      if (t.type == Tok::kText) {
        auto n = node(Node::Kind::kText);
        n->text = t.text;
        out.push_back(std::move(n));
        ++k_;
      } else if (t.type == Tok::kVarBegin) {
        ++k_;
        auto n = node(Node::Kind::kOutput);
        n->expr = tuple(true);
        if (cur().type != Tok::kVarEnd) fail(at("expected the end of the print statement" + got()));
        ++k_;
        out.push_back(std::move(n));
      } else if (t.type == Tok::kBlockBegin) {
        if (peek().type == Tok::kName) {
          for (const char* e : ends) {
            if (peek().text == e) {
              ++k_;
              return out;
            }
          }
        }
        ++k_;
        out.push_back(statement());
      } else {
        fail(at("unexpected token"));
      }
    }
  }

  std::unique_ptr<Node> node(Node::Kind kind) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = cur().line;
    return n;
  }

  std::unique_ptr<Node> statement() {
    const std::string word = expect_name();
    if (word == "if") return if_statement();
    if (word == "for") return for_statement();
    if (word == "set") return set_statement();
    if (word == "macro") return macro_statement();
    if (word == "call") return call_statement();
    if (word == "filter") return filter_statement();
    if (word == "generation") {  // Hugging Face's marker of assistant text: its body
      expect_block_end();
      auto n = node(Node::Kind::kScope);
      n->body = body({"endgeneration"});
      ++k_;
      expect_block_end();
      return n;
    }
    if (word == "break" || word == "continue") {
      if (loops_ == 0) fail(at("'" + word + "' outside of a loop"));
      auto n = node(word == "break" ? Node::Kind::kBreak : Node::Kind::kContinue);
      expect_block_end();
      return n;
    }
    --k_;
    fail(at("Encountered unknown tag '" + word + "'"));
  }

  std::unique_ptr<Node> if_statement() {
    auto n = node(Node::Kind::kIf);
    while (true) {
      ExprPtr cond = tuple(false);
      expect_block_end();
      Body b = body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(b));
      const std::string w = expect_name();
      if (w == "elif") continue;
      if (w == "else") {
        expect_block_end();
        n->else_body = body({"endif"});
        expect_name();
      }
      break;
    }
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> for_statement() {
    auto n = node(Node::Kind::kFor);
    do {
      skip_op("(");
      n->targets.push_back(expect_name());
      skip_op(")");
    } while (skip_op(","));
    if (!skip_name("in")) fail(at("expected 'in'" + got()));
    n->expr = tuple(false, /*stop_at_if=*/true);
    if (skip_name("if")) n->filter = expression(true);
    if (skip_name("recursive")) n->recursive = true;
    expect_block_end();
    ++loops_;
    n->body = body({"endfor", "else"});
    --loops_;
    if (expect_name() == "else") {
      expect_block_end();
      n->else_body = body({"endfor"});
      expect_name();
    }
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> set_statement() {
    auto n = node(Node::Kind::kSet);
    n->targets.push_back(expect_name());
    if (skip_op(".")) {
      n->targets.push_back(expect_name());
      n->attr_target = true;
    } else {
      while (skip_op(",")) n->targets.push_back(expect_name());
    }
    if (skip_op("=")) {
      n->expr = tuple(true);
      expect_block_end();
      return n;
    }
    if (n->attr_target || n->targets.size() != 1) fail(at("expected '='" + got()));
    n->kind = Node::Kind::kSetBlock;
    if (is_op("|")) n->filter = filters(subject_placeholder());
    expect_block_end();
    n->body = body({"endset"});
    ++k_;
    expect_block_end();
    return n;
  }

  void params(std::vector<std::pair<std::string, ExprPtr>>& out) {
    expect_op("(");
    while (!skip_op(")")) {
      if (!out.empty()) expect_op(",");
      if (skip_op(")")) break;
      std::string name = expect_name();
      ExprPtr def;
      if (skip_op("=")) def = expression(true);
      out.emplace_back(std::move(name), std::move(def));
    }
  }

  std::unique_ptr<Node> macro_statement() {
    auto n = node(Node::Kind::kMacro);
    n->name = expect_name();
    params(n->params);
    expect_block_end();
    const int loops = loops_;
    loops_ = 0;
    n->body = body({"endmacro"});
    loops_ = loops;
    ++k_;
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> call_statement() {
    auto n = node(Node::Kind::kCallBlock);
    if (is_op("(")) params(n->params);
    n->expr = expression(true);
    if (n->expr->kind != Expr::Kind::kCall) fail(at("expected a call"));
    expect_block_end();
    n->body = body({"endcall"});
    ++k_;
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> filter_statement() {
    auto n = node(Node::Kind::kFilterBlock);
    n->filter = filters(subject_placeholder(), /*first_without_pipe=*/true);
    expect_block_end();
    n->body = body({"endfilter"});
    ++k_;
    expect_block_end();
    return n;
  }

  ExprPtr subject_placeholder() {
    auto e = expr(Expr::Kind::kName);
    return e;  // name "" : the value being filtered (the block's output)
  }

  ExprPtr expr(Expr::Kind kind) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = cur().line;
    return e;
  }

  // ---- expressions (jinja2's parser.py, precedence lowest first) ----

  // An expression, or several separated by commas (a tuple), as jinja2's parse_tuple.
  ExprPtr tuple(bool with_cond, bool stop_at_if = false) {
    std::vector<ExprPtr> items;
    bool trailing = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        trailing = true;
      }
      if (tuple_end(stop_at_if)) break;
      items.push_back(expression(with_cond));
      trailing = false;
    }
    if (items.size() == 1 && !trailing) return std::move(items[0]);
    if (items.empty() && !trailing) fail(at("expected an expression" + got()));
    auto t = expr(Expr::Kind::kTuple);
    t->args = std::move(items);
    return t;
  }
  bool tuple_end(bool stop_at_if) const {
    const Token& t = cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || t.type == Tok::kEof) return true;
    if (t.type == Tok::kOp && (t.text == ")" || t.text == "]" || t.text == "}" || t.text == "=")) return true;
    return stop_at_if && t.type == Tok::kName && (t.text == "if" || t.text == "recursive");
  }

  ExprPtr expression(bool with_cond) { return with_cond ? cond() : or_expr(); }

  ExprPtr cond() {
    Depth d(this);
    ExprPtr a = or_expr();
    while (skip_name("if")) {
      auto e = expr(Expr::Kind::kCond);
      ExprPtr c = or_expr();
      ExprPtr b = skip_name("else") ? cond() : nullptr;
      e->args.push_back(std::move(a));
      e->args.push_back(std::move(c));
      e->args.push_back(std::move(b));
      a = std::move(e);
    }
    return a;
  }
  ExprPtr binary(Expr::Kind kind, ExprPtr a, ExprPtr b, std::string op = {}) {
    auto e = expr(kind);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }
  ExprPtr or_expr() {
    ExprPtr a = and_expr();
    while (skip_name("or")) a = binary(Expr::Kind::kOr, std::move(a), and_expr());
    return a;
  }
  ExprPtr and_expr() {
    ExprPtr a = not_expr();
    while (skip_name("and")) a = binary(Expr::Kind::kAnd, std::move(a), not_expr());
    return a;
  }
  ExprPtr not_expr() {
    Depth d(this);
    if (skip_name("not")) {
      auto e = expr(Expr::Kind::kNot);
      e->args.push_back(not_expr());
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr first = math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      const Token& t = cur();
      std::string op;
      if (t.type == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                 t.text == "<=" || t.text == ">=")) {
        op = t.text;
        ++k_;
      } else if (is_name("in")) {
        op = "in";
        ++k_;
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        op = "notin";
        k_ += 2;
      } else {
        break;
      }
      ops.push_back(op);
      rest.push_back(math1());
    }
    if (ops.empty()) return first;
    auto e = expr(Expr::Kind::kCompare);
    e->args.push_back(std::move(first));
    for (auto& r : rest) e->args.push_back(std::move(r));
    e->ops = std::move(ops);
    return e;
  }
  ExprPtr math1() {
    ExprPtr a = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[k_++].text;
      a = binary(Expr::Kind::kBinary, std::move(a), concat(), op);
    }
    return a;
  }
  ExprPtr concat() {
    ExprPtr a = math2();
    if (!is_op("~")) return a;
    auto e = expr(Expr::Kind::kConcat);
    e->args.push_back(std::move(a));
    while (skip_op("~")) e->args.push_back(math2());
    return e;
  }
  ExprPtr math2() {
    ExprPtr a = pow_expr();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[k_++].text;
      a = binary(Expr::Kind::kBinary, std::move(a), pow_expr(), op);
    }
    return a;
  }
  ExprPtr pow_expr() {
    ExprPtr a = unary(true);
    while (skip_op("**")) a = binary(Expr::Kind::kBinary, std::move(a), unary(true), "**");
    return a;
  }
  ExprPtr unary(bool with_filter) {
    Depth d(this);
    ExprPtr n;
    if (is_op("-") || is_op("+")) {
      const bool neg = is_op("-");
      ++k_;
      n = expr(neg ? Expr::Kind::kNeg : Expr::Kind::kPos);
      n->args.push_back(unary(false));
    } else {
      n = postfix(primary());
    }
    return with_filter ? filters(std::move(n)) : std::move(n);
  }
  ExprPtr primary() {
    const Token t = cur();
    switch (t.type) {
      case Tok::kName: {
        ++k_;
        auto e = expr(Expr::Kind::kLiteral);
        if (t.text == "true" || t.text == "True") e->value = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") e->value = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") e->value = Value::none();
        else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (cur().type == Tok::kString) s += t_[k_++].text;  // adjacent strings join
        auto e = expr(Expr::Kind::kLiteral);
        e->value = Value::str(std::move(s));
        return e;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        ++k_;
        auto e = expr(Expr::Kind::kLiteral);
        e->value = t.type == Tok::kInt ? Value::integer(t.i) : Value::real(t.f);
        return e;
      }
      case Tok::kOp:
        if (t.text == "(") {
          ++k_;
          if (skip_op(")")) {
            auto e = expr(Expr::Kind::kTuple);
            return e;
          }
          ExprPtr e = tuple(true);
          expect_op(")");
          if (e->kind == Expr::Kind::kTuple) e->name = "()";
          return e;
        }
        if (t.text == "[") {
          ++k_;
          auto e = expr(Expr::Kind::kList);
          while (!skip_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (skip_op("]")) break;
            e->args.push_back(expression(true));
          }
          return e;
        }
        if (t.text == "{") {
          ++k_;
          auto e = expr(Expr::Kind::kDict);
          while (!skip_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (skip_op("}")) break;
            e->args.push_back(expression(true));
            expect_op(":");
            e->args.push_back(expression(true));
          }
          return e;
        }
        break;
      default: break;
    }
    fail(at("unexpected" + got()));
  }
  ExprPtr postfix(ExprPtr n) {
    while (true) {
      if (is_op(".")) {
        ++k_;
        if (cur().type == Tok::kInt) {
          auto e = expr(Expr::Kind::kItem);
          auto key = expr(Expr::Kind::kLiteral);
          key->value = Value::integer(t_[k_++].i);
          e->args.push_back(std::move(n));
          e->args.push_back(std::move(key));
          n = std::move(e);
          continue;
        }
        auto e = expr(Expr::Kind::kAttr);
        e->name = expect_name();
        e->args.push_back(std::move(n));
        n = std::move(e);
      } else if (is_op("[")) {
        ++k_;
        n = subscript(std::move(n));
      } else if (is_op("(")) {
        n = call(std::move(n));
      } else {
        return n;
      }
    }
  }
  ExprPtr subscript(ExprPtr subject) {
    std::vector<ExprPtr> items;
    do {
      if (is_op("]")) break;
      ExprPtr a, b, c;
      bool slice = false;
      if (!is_op(":")) a = expression(true);
      if (skip_op(":")) {
        slice = true;
        if (!is_op("]") && !is_op(",") && !is_op(":")) b = expression(true);
        if (skip_op(":") && !is_op("]") && !is_op(",")) c = expression(true);
      }
      if (slice) {
        auto s = expr(Expr::Kind::kSlice);
        s->args.push_back(std::move(a));
        s->args.push_back(std::move(b));
        s->args.push_back(std::move(c));
        items.push_back(std::move(s));
      } else {
        items.push_back(std::move(a));
      }
    } while (skip_op(","));
    expect_op("]");
    if (items.empty()) fail(at("expected a subscript"));
    auto e = expr(Expr::Kind::kItem);
    e->args.push_back(std::move(subject));
    if (items.size() == 1) {
      e->args.push_back(std::move(items[0]));
    } else {
      auto t = expr(Expr::Kind::kTuple);
      t->args = std::move(items);
      e->args.push_back(std::move(t));
    }
    return e;
  }
  void call_args(Expr& e) {
    expect_op("(");
    while (!skip_op(")")) {
      if (e.args.size() > 1 || !e.kwargs.empty()) expect_op(",");
      if (skip_op(")")) break;
      if (is_op("*") || is_op("**")) fail(at("*args and **kwargs in calls are not supported"));
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        std::string k = t_[k_].text;
        k_ += 2;
        e.kwargs.emplace_back(std::move(k), expression(true));
      } else {
        if (!e.kwargs.empty()) fail(at("a positional argument after keyword arguments"));
        e.args.push_back(expression(true));
      }
    }
  }
  ExprPtr call(ExprPtr callee) {
    auto e = expr(Expr::Kind::kCall);
    e->args.push_back(std::move(callee));
    call_args(*e);
    return e;
  }
  ExprPtr filters(ExprPtr n, bool first_without_pipe = false) {
    while (true) {
      if (first_without_pipe || skip_op("|")) {
        first_without_pipe = false;
        auto e = expr(Expr::Kind::kFilter);
        e->name = expect_name();
        while (skip_op(".")) e->name += "." + expect_name();
        e->args.push_back(std::move(n));
        if (is_op("(")) call_args(*e);
        n = std::move(e);
      } else if (skip_name("is")) {
        auto e = expr(Expr::Kind::kTest);
        e->negated = skip_name("not");
        e->name = expect_name();
        while (skip_op(".")) e->name += "." + expect_name();
        e->args.push_back(std::move(n));
        const Token& t = cur();
        if (is_op("(")) {
          call_args(*e);
        } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt || t.type == Tok::kFloat ||
                    is_op("[") || is_op("{") || is_op("(")) &&
                   !(t.type == Tok::kName && (t.text == "else" || t.text == "or" || t.text == "and"))) {
          if (is_name("is")) fail(at("You cannot chain multiple tests with is"));
          e->args.push_back(postfix(primary()));
        }
        n = std::move(e);
      } else if (is_op("(")) {
        n = call(std::move(n));
      } else {
        return n;
      }
    }
  }

  std::vector<Token> t_;
  const Options& o_;
  size_t k_ = 0;
  int depth_ = 0;
  int loops_ = 0;
  const char* stack_base_ = nullptr;
};

}  // namespace

std::shared_ptr<const Program> parse_program(std::string_view source, const Options& options) {
  if (source.size() > options.limits.max_source) {
    fail("the template is " + std::to_string(source.size()) + " bytes, more than the limit of " +
         std::to_string(options.limits.max_source));
  }
  Lexer lexer(source, options);
  Parser parser(lexer.run(), options);
  return parser.program();
}

}  // namespace combs::jinja
