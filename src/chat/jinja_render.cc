// The renderer: statements, expressions with Python's semantics, and the filters, tests, methods
// and globals (jinja2's defaults, Hugging Face's additions) that chat templates use.
#include <unicode/uchar.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "combs/base/utf8.h"
#include "jinja_internal.h"

namespace combs::jinja {
namespace {

struct Frame {
  Frame* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(std::string_view name) const {
    for (const Frame* f = this; f != nullptr; f = f->parent)
      for (auto it = f->vars.rbegin(); it != f->vars.rend(); ++it)
        if (it->first == name) return &it->second;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

enum class Flow : uint8_t { kNormal, kBreak, kContinue };

// ---- UTF-8 and Python's str helpers ----

// The code points of s; an invalid byte as that byte's value (re-encoded where a string is rebuilt).
std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  each_code_point(s, [&](uint32_t cp, size_t, size_t len) { out.push_back(len == 1 && cp >= 0xdc80 ? cp - 0xdc00 : cp); });
  return out;
}
void put(uint32_t cp, std::string& out) { append_utf8(cp, out); }
std::string from_code_points(const std::vector<uint32_t>& cps, size_t b, size_t e) {
  std::string out;
  for (size_t k = b; k < e; ++k) put(cps[k], out);
  return out;
}
bool cased(uint32_t cp) { return u_isUUppercase(cp) || u_isULowercase(cp) || u_istitle(cp); }
uint32_t upper(uint32_t cp) { return cp < 0x80 ? (cp >= 'a' && cp <= 'z' ? cp - 32 : cp) : u_toupper(cp); }
uint32_t lower(uint32_t cp) { return cp < 0x80 ? (cp >= 'A' && cp <= 'Z' ? cp + 32 : cp) : u_tolower(cp); }
std::string map_case(std::string_view s, uint32_t (*f)(uint32_t)) {
  std::string out;
  for (uint32_t cp : code_points(s)) put(f(cp), out);
  return out;
}
std::string py_title(std::string_view s) {  // str.title()
  std::string out;
  bool prev = false;
  for (uint32_t cp : code_points(s)) {
    put(prev ? lower(cp) : u_totitle(cp), out);
    prev = cased(cp);
  }
  return out;
}
std::string py_capitalize(std::string_view s) {
  const auto cps = code_points(s);
  std::string out;
  for (size_t k = 0; k < cps.size(); ++k) put(k == 0 ? u_totitle(cps[k]) : lower(cps[k]), out);
  return out;
}
std::string py_strip(std::string_view s, const Value& chars, bool left, bool right) {
  const auto cps = code_points(s);
  std::vector<uint32_t> set;
  const bool custom = chars.is_string();
  if (custom) set = code_points(chars.s);
  auto strip_it = [&](uint32_t cp) { return custom ? std::find(set.begin(), set.end(), cp) != set.end() : py_space(cp); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return from_code_points(cps, b, e);
}
bool line_break(uint32_t cp) {
  return cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || (cp >= 0x1c && cp <= 0x1e) || cp == 0x85 ||
         cp == 0x2028 || cp == 0x2029;
}
std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const auto cps = code_points(s);
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t k = 0; k < cps.size(); ++k) {
    if (!line_break(cps[k])) continue;
    size_t e = k + 1;
    if (cps[k] == '\r' && e < cps.size() && cps[e] == '\n') ++e;
    out.push_back(from_code_points(cps, b, keepends ? e : k));
    b = e;
    k = e - 1;
  }
  if (b < cps.size()) out.push_back(from_code_points(cps, b, cps.size()));
  return out;
}
Value py_split(std::string_view s, const Value& sep, int64_t maxsplit, bool from_right) {
  ValueList parts;
  if (sep.is_none() || sep.is_undefined()) {  // runs of whitespace; no empty parts
    const auto cps = code_points(s);
    std::vector<std::pair<size_t, size_t>> words;
    for (size_t k = 0; k < cps.size();) {
      while (k < cps.size() && py_space(cps[k])) ++k;
      if (k >= cps.size()) break;
      size_t e = k;
      while (e < cps.size() && !py_space(cps[e])) ++e;
      words.emplace_back(k, e);
      k = e;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      if (from_right) {
        const size_t keep = words.size() - static_cast<size_t>(maxsplit);
        size_t b = 0;
        while (b < cps.size() && py_space(cps[b])) ++b;
        parts.push_back(Value::str(from_code_points(cps, b, words[keep - 1].second)));
        for (size_t k = keep; k < words.size(); ++k) parts.push_back(Value::str(from_code_points(cps, words[k].first, words[k].second)));
      } else {
        for (int64_t k = 0; k < maxsplit; ++k) parts.push_back(Value::str(from_code_points(cps, words[k].first, words[k].second)));
        size_t e = cps.size();
        while (e > 0 && py_space(cps[e - 1])) --e;
        parts.push_back(Value::str(from_code_points(cps, words[maxsplit].first, e)));
      }
      return Value::new_list(std::move(parts));
    }
    for (const auto& [b, e] : words) parts.push_back(Value::str(from_code_points(cps, b, e)));
    return Value::new_list(std::move(parts));
  }
  if (!sep.is_string()) fail("must be str or None, not " + type_name(sep));
  if (sep.s.empty()) fail("empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t b = 0;
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      const size_t at = s.find(sep.s, b);
      if (at == std::string_view::npos) break;
      pieces.emplace_back(s.substr(b, at - b));
      b = at + sep.s.size();
    }
    pieces.emplace_back(s.substr(b));
  } else {
    size_t e = s.size();
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      if (e < sep.s.size()) break;
      const size_t at = s.rfind(sep.s, e - sep.s.size());
      if (at == std::string_view::npos) break;
      pieces.emplace_back(s.substr(at + sep.s.size(), e - at - sep.s.size()));
      e = at;
    }
    pieces.emplace_back(s.substr(0, e));
    std::reverse(pieces.begin(), pieces.end());
  }
  for (auto& p : pieces) parts.push_back(Value::str(std::move(p)));
  return Value::new_list(std::move(parts));
}
std::string py_replace(std::string_view s, std::string_view from, std::string_view to, int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` around every character
    const auto cps = code_points(s);
    int64_t n = 0;
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (k < cps.size()) put(cps[k], out);
    }
    return out;
  }
  size_t b = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t at = s.find(from, b);
    if (at == std::string_view::npos) break;
    out.append(s.substr(b, at - b));
    out.append(to);
    b = at + from.size();
  }
  out.append(s.substr(b));
  return out;
}

std::string html_escape(std::string_view s) {  // markupsafe's escape
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

int64_t to_int(const Value& v, std::string_view what) {
  if (v.kind == Value::Kind::kInt) return v.i;
  if (v.kind == Value::Kind::kBool) return v.b;
  fail(std::string(what) + ": an integer is required, not " + type_name(v));
}
double to_double(const Value& v) {
  if (v.kind == Value::Kind::kFloat) return v.f;
  return static_cast<double>(to_int(v, "number"));
}

[[noreturn]] void undefined_error(const Value& v) {
  fail(v.s.empty() ? std::string("an undefined value was used") : v.s);
}
Value undefined_name(std::string_view name) { return Value::undefined("'" + std::string(name) + "' is undefined"); }
Value no_attribute(const Value& obj, const std::string& attr) {
  return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + attr + "'");
}

// Python's slice of a sequence of n items: the indices taken.
std::vector<int64_t> slice_indices(int64_t n, const Value& start, const Value& stop, const Value& step) {
  const int64_t st = step.is_none() || step.is_undefined() ? 1 : to_int(step, "slice step");
  if (st == 0) fail("slice step cannot be zero");
  auto bound = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t x = to_int(v, "slice index");
    if (x < 0) x += n;
    if (st > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t b = bound(start, st > 0 ? 0 : n - 1), e = bound(stop, st > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(k);
  return out;
}

class Renderer {
 public:
  Renderer(const Options& o, std::time_t now) : o_(o), now_(now) {}

  std::string run(const Program& p, const nlohmann::ordered_json& context) {
    const char base = 0;
    stack_base_ = &base;
    if (!context.is_object()) fail("the context must be a JSON object");
    add_globals();
    for (const auto& [k, v] : context.items()) root_.set(k, from_json(v));
    std::string out;
    exec(p.body, root_, out);
    return out;
  }

 private:
  // ---- statements ----

  Flow exec(const Body& body, Frame& f, std::string& out) {
    for (const auto& n : body) {
      const Flow fl = exec(*n, f, out);
      if (fl != Flow::kNormal) return fl;
    }
    return Flow::kNormal;
  }

  void emit(std::string& out, std::string_view s) {
    emitted_ += s.size();
    if (emitted_ > o_.limits.max_output) {
      fail("the rendering exceeds the output limit of " + std::to_string(o_.limits.max_output) + " bytes");
    }
    out.append(s);
  }

  void step() {
    if (++steps_ > o_.limits.max_steps) {
      fail("the rendering exceeds the limit of " + std::to_string(o_.limits.max_steps) + " loop iterations and calls");
    }
  }

  Flow exec(const Node& n, Frame& f, std::string& out) {
    check_stack(stack_base_);
    switch (n.kind) {
      case Node::Kind::kText: emit(out, n.text); return Flow::kNormal;
      case Node::Kind::kOutput: {
        const Value v = eval(*n.expr, f);
        emit(out, to_str(v));
        return Flow::kNormal;
      }
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches)
          if (truthy(eval(*cond, f))) return exec(body, f, out);
        return exec(n.else_body, f, out);
      case Node::Kind::kFor: return exec_for(n, f, out);
      case Node::Kind::kSet: {
        Value v = eval(*n.expr, f);
        assign(n, f, std::move(v));
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        Frame inner{&f, {}};
        exec(n.body, inner, captured);
        Value v = Value::str(std::move(captured));
        if (n.filter) v = apply_filters(*n.filter, std::move(v), f);
        f.set(n.targets[0], std::move(v));
        return Flow::kNormal;
      }
      case Node::Kind::kMacro: f.set(n.name, make_macro(n, nullptr)); return Flow::kNormal;
      case Node::Kind::kCallBlock: {
        Frame inner{&f, {}};
        inner.set("caller", make_macro(n, &f));
        emit(out, to_str(eval(*n.expr, inner)));
        return Flow::kNormal;
      }
      case Node::Kind::kFilterBlock: {
        std::string captured;
        Frame inner{&f, {}};
        exec(n.body, inner, captured);
        emit(out, to_str(apply_filters(*n.filter, Value::str(std::move(captured)), f)));
        return Flow::kNormal;
      }
      case Node::Kind::kBreak: return Flow::kBreak;
      case Node::Kind::kContinue: return Flow::kContinue;
      case Node::Kind::kScope: return exec(n.body, f, out);
    }
    return Flow::kNormal;
  }

  void assign(const Node& n, Frame& f, Value v) {
    if (n.attr_target) {
      const Value* ns = f.find(n.targets[0]);
      if (ns == nullptr || !ns->is_dict() || !ns->dict->ns) fail("cannot assign attribute on non-namespace object");
      ns->dict->set(Value::str(n.targets[1]), std::move(v));
      return;
    }
    if (n.targets.size() == 1) {
      f.set(n.targets[0], std::move(v));
      return;
    }
    const ValueList items = iterate(v);
    if (items.size() != n.targets.size()) {
      fail(items.size() > n.targets.size() ? "too many values to unpack (expected " + std::to_string(n.targets.size()) + ")"
                                           : "not enough values to unpack (expected " + std::to_string(n.targets.size()) + ")");
    }
    for (size_t k = 0; k < items.size(); ++k) f.set(n.targets[k], items[k]);
  }

  Flow exec_for(const Node& n, Frame& f, std::string& out) {
    if (n.recursive) fail("recursive loops are not supported");
    const Value seq = eval(*n.expr, f);
    ValueList items = iterate(seq);
    if (n.filter) {  // `for x in xs if cond`: the condition sees the loop variables
      ValueList kept;
      for (Value& item : items) {
        step();
        Frame probe{&f, {}};
        bind_targets(n, probe, item);
        if (truthy(eval(*n.filter, probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      step();
      Frame inner{&f, {}};
      Value loop = Value::new_dict();
      auto& d = *loop.dict;
      d.set(Value::str("index"), Value::integer(k + 1));
      d.set(Value::str("index0"), Value::integer(k));
      d.set(Value::str("revindex"), Value::integer(len - k));
      d.set(Value::str("revindex0"), Value::integer(len - k - 1));
      d.set(Value::str("first"), Value::boolean(k == 0));
      d.set(Value::str("last"), Value::boolean(k == len - 1));
      d.set(Value::str("length"), Value::integer(len));
      d.set(Value::str("depth"), Value::integer(1));
      d.set(Value::str("depth0"), Value::integer(0));
      d.set(Value::str("previtem"), k > 0 ? items[k - 1] : Value::undefined("there is no previous item"));
      d.set(Value::str("nextitem"), k + 1 < len ? items[k + 1] : Value::undefined("there is no next item"));
      d.set(Value::str("cycle"), Value::callable("cycle", [k](Args& a) {
              if (a.pos.empty()) fail("no items for cycling given");
              return a.pos[static_cast<size_t>(k) % a.pos.size()];
            }));
      inner.set("loop", std::move(loop));
      bind_targets(n, inner, items[k]);
      if (exec(n.body, inner, out) == Flow::kBreak) break;
    }
    if (len == 0) {  // the else body is outside this loop: a break there is an enclosing loop's
      Frame inner{&f, {}};
      return exec(n.else_body, inner, out);
    }
    return Flow::kNormal;
  }

  void bind_targets(const Node& n, Frame& f, const Value& item) {
    if (n.targets.size() == 1) {
      f.set(n.targets[0], item);
      return;
    }
    const ValueList parts = iterate(item);
    if (parts.size() != n.targets.size()) {
      fail(parts.size() > n.targets.size() ? "too many values to unpack (expected " + std::to_string(n.targets.size()) + ")"
                                           : "not enough values to unpack (expected " + std::to_string(n.targets.size()) + ")");
    }
    for (size_t k = 0; k < parts.size(); ++k) f.set(n.targets[k], parts[k]);
  }

  // A macro (or a call block's caller): renders its body in a frame of its own over the
  // template's top level (a caller over the frame it was written in).
  Value make_macro(const Node& n, Frame* scope) {
    Frame* parent = scope != nullptr ? scope : &root_;
    const Node* node = &n;
    const std::string name = n.kind == Node::Kind::kMacro ? n.name : "caller";
    return Value::callable(name, [this, node, parent, name](Args& a) {
      step();
      if (++depth_ > o_.limits.max_depth) fail("macro calls nest deeper than " + std::to_string(o_.limits.max_depth));
      struct Leave {
        int& d;
        ~Leave() { --d; }
      } leave{depth_};
      if (a.pos.size() > node->params.size()) {
        fail("macro '" + name + "' takes not more than " + std::to_string(node->params.size()) + " argument(s)");
      }
      Frame inner{parent, {}};
      for (size_t k = 0; k < node->params.size(); ++k) {
        const auto& [pname, def] = node->params[k];
        Value v;
        bool given = false;
        if (k < a.pos.size()) {
          v = a.pos[k];
          given = true;
        }
        for (const auto& [kn, kv] : a.kw) {
          if (kn != pname) continue;
          if (given) fail("macro '" + name + "' got multiple values for argument '" + pname + "'");
          v = kv;
          given = true;
        }
        if (!given) v = def ? eval(*def, inner) : Value::undefined("parameter '" + pname + "' was not provided");
        inner.set(pname, std::move(v));
      }
      for (const auto& [kn, kv] : a.kw) {
        bool known = kn == "caller";
        for (const auto& p : node->params) known = known || p.first == kn;
        if (!known) fail("macro '" + name + "' takes no keyword argument '" + kn + "'");
        if (kn == "caller") inner.set("caller", kv);
      }
      std::string out;
      exec(node->body, inner, out);
      return Value::str(std::move(out));
    });
  }

  // ---- expressions ----

  Value eval(const Expr& e, Frame& f) {
    check_stack(stack_base_);
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.value;
      case Expr::Kind::kName: {
        const Value* v = f.find(e.name);
        return v != nullptr ? *v : undefined_name(e.name);
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        ValueList items;
        for (const auto& a : e.args) items.push_back(eval(*a, f));
        return Value::new_list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        Value d = Value::new_dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) d.dict->set(eval(*e.args[k], f), eval(*e.args[k + 1], f));
        return d;
      }
      case Expr::Kind::kAttr: return getattr(eval(*e.args[0], f), e.name);
      case Expr::Kind::kItem: {
        const Value obj = eval(*e.args[0], f);
        const Expr& key = *e.args[1];
        if (key.kind == Expr::Kind::kSlice) {
          auto part = [&](size_t k) { return key.args[k] ? eval(*key.args[k], f) : Value::none(); };
          return slice(obj, part(0), part(1), part(2));
        }
        return getitem(obj, eval(key, f));
      }
      case Expr::Kind::kSlice: fail("a slice outside of a subscript");
      case Expr::Kind::kCall: {
        const Value callee = eval(*e.args[0], f);
        Args a = args(e, 1, f);
        return call(callee, a);
      }
      case Expr::Kind::kFilter: {
        Value subject = eval(*e.args[0], f);
        Args a = args(e, 1, f);
        return filter(e.name, std::move(subject), a, f);
      }
      case Expr::Kind::kTest: {
        const Value subject = eval(*e.args[0], f);
        Args a = args(e, 1, f);
        const bool r = test(e.name, subject, a);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        const Value v = eval(*e.args[0], f);
        if (v.is_undefined()) undefined_error(v);
        if (v.kind == Value::Kind::kFloat) return Value::real(e.kind == Expr::Kind::kNeg ? -v.f : v.f);
        if (v.kind == Value::Kind::kInt || v.kind == Value::Kind::kBool) {
          const int64_t x = v.kind == Value::Kind::kBool ? v.b : v.i;
          return Value::integer(e.kind == Expr::Kind::kNeg ? -x : x);
        }
        fail("bad operand type for unary " + std::string(e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'");
      }
      case Expr::Kind::kNot: return Value::boolean(!truthy(eval(*e.args[0], f)));
      case Expr::Kind::kAnd: {
        Value a = eval(*e.args[0], f);
        return truthy(a) ? eval(*e.args[1], f) : a;
      }
      case Expr::Kind::kOr: {
        Value a = eval(*e.args[0], f);
        return truthy(a) ? a : eval(*e.args[1], f);
      }
      case Expr::Kind::kBinary: return binary(e.name, eval(*e.args[0], f), eval(*e.args[1], f));
      case Expr::Kind::kCompare: {
        Value left = eval(*e.args[0], f);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], f);
          if (!compare_op(e.ops[k], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kCond:
        if (truthy(eval(*e.args[1], f))) return eval(*e.args[0], f);
        return e.args[2] ? eval(*e.args[2], f) : Value::undefined("the inline if-expression on line " + std::to_string(e.line) + " evaluated to false and no else section was defined");
      case Expr::Kind::kConcat: {
        std::string s;
        for (const auto& a : e.args) s += to_str(eval(*a, f));
        return Value::str(std::move(s));
      }
    }
    fail("unknown expression");
  }

  Args args(const Expr& e, size_t from, Frame& f) {
    Args a;
    for (size_t k = from; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k], f));
    for (const auto& [name, x] : e.kwargs) a.kw.emplace_back(name, eval(*x, f));
    return a;
  }

  Value apply_filters(const Expr& chain, Value subject, Frame& f) {
    // The chain was parsed over a placeholder name "": evaluate it with the subject bound to it.
    Frame inner{&f, {}};
    inner.set("", std::move(subject));
    return eval(chain, inner);
  }

  Value call(const Value& callee, Args& a) {
    if (callee.kind == Value::Kind::kCallable) return callee.fn->fn(a);
    if (callee.is_undefined()) undefined_error(callee);
    fail("'" + type_name(callee) + "' object is not callable");
  }

  bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a);
    if (op == "notin") return !contains(b, a);
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    const int c = compare(a, b, op);
    if (op == "<") return c < 0;
    if (op == ">") return c > 0;
    if (op == "<=") return c <= 0;
    return c >= 0;
  }

  static bool contains(const Value& seq, const Value& x) {
    switch (seq.kind) {
      case Value::Kind::kUndefined: return false;
      case Value::Kind::kString:
        if (!x.is_string()) fail("'in <string>' requires string as left operand, not " + type_name(x));
        return seq.s.find(x.s) != std::string::npos;
      case Value::Kind::kList:
        for (const Value& v : seq.list->items)
          if (equal(v, x)) return true;
        return false;
      case Value::Kind::kDict: return !seq.dict->ns && seq.dict->find(x) != nullptr;
      default: fail("argument of type '" + type_name(seq) + "' is not iterable");
    }
  }

  Value binary(const std::string& op, const Value& a, const Value& b) {
    using K = Value::Kind;
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    const bool nums = a.is_number() && b.is_number();
    const bool ints = nums && a.kind != K::kFloat && b.kind != K::kFloat;
    auto iv = [](const Value& v) { return v.kind == K::kBool ? static_cast<int64_t>(v.b) : v.i; };
    auto bad = [&]() -> Value {
      fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    };
    if (op == "+") {
      if (ints) {
        int64_t r;
        if (__builtin_add_overflow(iv(a), iv(b), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::real(to_double(a) + to_double(b));
      if (a.is_string() && b.is_string()) {
        if (a.safe == b.safe) {
          Value r = Value::str(a.s + b.s);
          r.safe = a.safe;
          return r;
        }
        Value r = Value::str(a.safe ? a.s + html_escape(b.s) : html_escape(a.s) + b.s);  // Markup's + escapes
        r.safe = true;
        return r;
      }
      if (a.is_list() && b.is_list() && a.list->tuple == b.list->tuple) {
        ValueList items = a.list->items;
        items.insert(items.end(), b.list->items.begin(), b.list->items.end());
        return Value::new_list(std::move(items), a.list->tuple);
      }
      if (a.is_string() || b.is_string()) {
        fail(a.is_string() ? "can only concatenate str (not \"" + type_name(b) + "\") to str"
                           : "unsupported operand type(s) for +: '" + type_name(a) + "' and 'str'");
      }
      return bad();
    }
    if (op == "-") {
      if (ints) {
        int64_t r;
        if (__builtin_sub_overflow(iv(a), iv(b), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::real(to_double(a) - to_double(b));
      return bad();
    }
    if (op == "*") {
      if (ints) {
        int64_t r;
        if (__builtin_mul_overflow(iv(a), iv(b), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::real(to_double(a) * to_double(b));
      const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
      const Value* times = seq == &a ? &b : &a;
      if (seq != nullptr && (times->kind == K::kInt || times->kind == K::kBool)) {
        const int64_t n = std::max<int64_t>(0, iv(*times));
        const size_t unit = seq->is_string() ? seq->s.size() : seq->list->items.size();
        if (static_cast<double>(unit) * static_cast<double>(n) > static_cast<double>(o_.limits.max_output)) {
          fail("a repetition beyond the output limit");
        }
        if (seq->is_string()) {
          std::string s;
          for (int64_t k = 0; k < n; ++k) s += seq->s;
          return Value::str(std::move(s));
        }
        ValueList items;
        for (int64_t k = 0; k < n; ++k) items.insert(items.end(), seq->list->items.begin(), seq->list->items.end());
        return Value::new_list(std::move(items), seq->list->tuple);
      }
      return bad();
    }
    if (op == "/") {
      if (!nums) return bad();
      if (to_double(b) == 0) fail("division by zero");
      return Value::real(to_double(a) / to_double(b));
    }
    if (op == "//" || op == "%") {
      if (a.is_string() && op == "%") return Value::str(percent_format(a.s, b));
      if (!nums) return bad();
      if (ints) {
        const int64_t x = iv(a), y = iv(b);
        if (y == 0) fail(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero");
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return Value::integer(op == "//" ? q : r);
      }
      const double x = to_double(a), y = to_double(b);
      if (y == 0) fail("float division by zero");
      if (op == "//") return Value::real(std::floor(x / y));
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value::real(r);
    }
    if (op == "**") {
      if (!nums) return bad();
      if (ints && iv(b) >= 0) {
        int64_t r = 1, base = iv(a);
        for (int64_t k = 0; k < iv(b); ++k) {
          if (__builtin_mul_overflow(r, base, &r)) fail("integer overflow");
        }
        return Value::integer(r);
      }
      return Value::real(std::pow(to_double(a), to_double(b)));
    }
    return bad();
  }

  // "..." % args with %s, %r, %d, %i, %f and %%.
  std::string percent_format(const std::string& fmt, const Value& args) {
    const ValueList items = args.is_list() && args.list->tuple ? args.list->items : ValueList{args};
    size_t next = 0;
    std::string out;
    for (size_t k = 0; k < fmt.size(); ++k) {
      if (fmt[k] != '%') {
        out += fmt[k];
        continue;
      }
      if (++k >= fmt.size()) fail("incomplete format");
      const char c = fmt[k];
      if (c == '%') {
        out += '%';
        continue;
      }
      if (next >= items.size()) fail("not enough arguments for format string");
      const Value& v = items[next++];
      if (c == 's') out += to_str(v);
      else if (c == 'r') out += repr(v);
      else if (c == 'd' || c == 'i') out += std::to_string(v.kind == Value::Kind::kFloat ? static_cast<int64_t>(v.f) : to_int(v, "%d format"));
      else if (c == 'f') {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%f", to_double(v));
        out += buf;
      } else {
        fail(std::string("unsupported format character '") + c + "'");
      }
    }
    if (next < items.size()) fail("not all arguments converted during string formatting");
    return out;
  }

  Value slice(const Value& obj, const Value& a, const Value& b, const Value& c) {
    if (obj.is_undefined()) undefined_error(obj);
    if (obj.is_string()) {
      const auto cps = code_points(obj.s);
      std::string out;
      for (int64_t k : slice_indices(static_cast<int64_t>(cps.size()), a, b, c)) put(cps[static_cast<size_t>(k)], out);
      return Value::str(std::move(out));
    }
    if (obj.is_list()) {
      ValueList items;
      for (int64_t k : slice_indices(static_cast<int64_t>(obj.list->items.size()), a, b, c)) {
        items.push_back(obj.list->items[static_cast<size_t>(k)]);
      }
      return Value::new_list(std::move(items), obj.list->tuple);
    }
    fail("'" + type_name(obj) + "' object is not subscriptable");
  }

  // jinja2's getitem: obj[key], else the attribute of that name.
  Value getitem(const Value& obj, const Value& key) {
    switch (obj.kind) {
      case Value::Kind::kUndefined: undefined_error(obj);
      case Value::Kind::kList:
      case Value::Kind::kString:
        if (key.kind == Value::Kind::kInt || key.kind == Value::Kind::kBool) {
          int64_t i = key.kind == Value::Kind::kBool ? key.b : key.i;
          if (obj.is_list()) {
            const int64_t n = static_cast<int64_t>(obj.list->items.size());
            if (i < 0) i += n;
            if (i < 0 || i >= n) return Value::undefined("'" + type_name(obj) + " object' has no element " + std::to_string(key.i));
            return obj.list->items[static_cast<size_t>(i)];
          }
          const auto cps = code_points(obj.s);
          const int64_t n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) return Value::undefined("'str object' has no element " + std::to_string(key.i));
          return Value::str(from_code_points(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
        }
        break;
      case Value::Kind::kDict:
        if (!obj.dict->ns) {
          if (const Value* v = obj.dict->find(key)) return *v;
        }
        break;
      default: break;
    }
    if (key.is_string()) return getattr(obj, key.s, /*from_item=*/true);
    return Value::undefined("'" + type_name(obj) + " object' has no element " + repr(key));
  }

  // jinja2's getattr: the attribute (a method), else obj[name].
  Value getattr(const Value& obj, const std::string& name, bool from_item = false) {
    switch (obj.kind) {
      case Value::Kind::kUndefined: undefined_error(obj);
      case Value::Kind::kDict:
        if (obj.dict->ns) {
          if (const Value* v = obj.dict->find(name)) return *v;
          return no_attribute(obj, name);
        }
        if (Value m = dict_method(obj, name); !m.is_undefined()) return m;
        if (!from_item) {
          if (const Value* v = obj.dict->find(name)) return *v;
        }
        return no_attribute(obj, name);
      case Value::Kind::kString:
        if (Value m = str_method(obj, name); !m.is_undefined()) return m;
        return no_attribute(obj, name);
      case Value::Kind::kList:
        if (Value m = list_method(obj, name); !m.is_undefined()) return m;
        return no_attribute(obj, name);
      default: return no_attribute(obj, name);
    }
  }

  static Value unsafe(const Value& obj, const std::string& name) {
    const std::string msg = "access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.";
    return Value::callable(name, [msg](Args&) -> Value { fail(msg); });
  }

  Value dict_method(const Value& obj, const std::string& name) {
    const auto d = obj.dict;
    if (name == "get") {
      return Value::callable("get", [d](Args& a) {
        a.expect_at_most(2, "get");
        if (a.pos.empty()) fail("get expected at least 1 argument, got 0");
        const Value* v = d->find(a.pos[0]);
        return v != nullptr ? *v : a.pos.size() > 1 ? a.pos[1] : Value::none();
      });
    }
    if (name == "items" || name == "keys" || name == "values") {
      return Value::callable(name, [d, name](Args&) {
        ValueList out;
        for (const auto& [k, v] : d->items) {
          if (name == "items") out.push_back(Value::new_list({k, v}, true));
          else out.push_back(name == "keys" ? k : v);
        }
        return Value::new_list(std::move(out));
      });
    }
    if (name == "copy") return Value::callable("copy", [d](Args&) {
        Value c = Value::new_dict();
        c.dict->items = d->items;
        return c;
      });
    for (const char* m : {"pop", "popitem", "update", "setdefault", "clear"})
      if (name == m) return unsafe(obj, name);
    return Value::undefined();
  }

  Value list_method(const Value& obj, const std::string& name) {
    const auto l = obj.list;
    if (name == "index" || name == "count") {
      return Value::callable(name, [l, name](Args& a) {
        if (a.pos.empty()) fail(name + "() takes at least 1 argument");
        int64_t n = 0;
        for (size_t k = 0; k < l->items.size(); ++k) {
          if (!equal(l->items[k], a.pos[0])) continue;
          if (name == "index") return Value::integer(static_cast<int64_t>(k));
          ++n;
        }
        if (name == "index") fail(repr(a.pos[0]) + " is not in list");
        return Value::integer(n);
      });
    }
    for (const char* m : {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"})
      if (name == m) return unsafe(obj, name);
    return Value::undefined();
  }

  Value str_method(const Value& obj, const std::string& name) {
    const std::string s = obj.s;
    auto fn = [&](std::function<Value(Args&)> f) { return Value::callable(name, std::move(f)); };
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const bool l = name != "rstrip", r = name != "lstrip";
      return fn([s, l, r](Args& a) { return Value::str(py_strip(s, a.get(0, "chars", Value::none()), l, r)); });
    }
    if (name == "split" || name == "rsplit") {
      const bool right = name == "rsplit";
      return fn([s, right](Args& a) {
        const Value max = a.get(1, "maxsplit", Value::integer(-1));
        return py_split(s, a.get(0, "sep", Value::none()), to_int(max, "maxsplit"), right);
      });
    }
    if (name == "splitlines") {
      return fn([s](Args& a) {
        ValueList out;
        for (auto& line : py_splitlines(s, truthy(a.get(0, "keepends", Value::boolean(false))))) out.push_back(Value::str(line));
        return Value::new_list(std::move(out));
      });
    }
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return fn([s, start, name](Args& a) {
        if (a.pos.empty()) fail(name + "() takes at least 1 argument (0 given)");
        const ValueList options = a.pos[0].is_list() ? a.pos[0].list->items : ValueList{a.pos[0]};
        for (const Value& o : options) {
          if (!o.is_string()) fail(name + " first arg must be str or a tuple of str, not " + type_name(o));
          if (start ? s.compare(0, o.s.size(), o.s) == 0 && s.size() >= o.s.size()
                    : s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0) {
            return Value::boolean(true);
          }
        }
        return Value::boolean(false);
      });
    }
    if (name == "replace") {
      return fn([s](Args& a) {
        const Value from = a.get(0, "old"), to = a.get(1, "new");
        if (!from.is_string() || !to.is_string()) fail("replace() arguments must be str");
        return Value::str(py_replace(s, from.s, to.s, to_int(a.get(2, "count", Value::integer(-1)), "count")));
      });
    }
    if (name == "upper") return fn([s](Args&) { return Value::str(map_case(s, upper)); });
    if (name == "lower") return fn([s](Args&) { return Value::str(map_case(s, lower)); });
    if (name == "title") return fn([s](Args&) { return Value::str(py_title(s)); });
    if (name == "capitalize") return fn([s](Args&) { return Value::str(py_capitalize(s)); });
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
      return fn([s, name](Args& a) {
        const Value sub = a.get(0, "sub");
        if (!sub.is_string()) fail("must be str, not " + type_name(sub));
        if (name == "count") {
          if (sub.s.empty()) return Value::integer(length(Value::str(s)) + 1);
          int64_t n = 0;
          for (size_t at = s.find(sub.s); at != std::string::npos; at = s.find(sub.s, at + sub.s.size())) ++n;
          return Value::integer(n);
        }
        const size_t at = name[0] == 'r' ? s.rfind(sub.s) : s.find(sub.s);
        if (at == std::string::npos) {
          if (name.find("index") != std::string::npos) fail("substring not found");
          return Value::integer(-1);
        }
        return Value::integer(static_cast<int64_t>(code_points(std::string_view(s).substr(0, at)).size()));
      });
    }
    if (name == "join") {
      return fn([s](Args& a) {
        std::string out;
        bool first = true;
        for (const Value& v : iterate(a.get(0, "iterable"))) {
          if (!v.is_string()) fail("sequence item: expected str instance, " + type_name(v) + " found");
          if (!first) out += s;
          out += v.s;
          first = false;
        }
        return Value::str(std::move(out));
      });
    }
    if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "isupper" ||
        name == "islower" || name == "isnumeric" || name == "isdecimal") {
      return fn([s, name](Args&) {
        const auto cps = code_points(s);
        if (cps.empty()) return Value::boolean(false);
        bool any_cased = false;
        for (uint32_t cp : cps) {
          bool ok = true;
          if (name == "isdigit" || name == "isnumeric" || name == "isdecimal") ok = u_isdigit(cp);
          else if (name == "isalpha") ok = u_isalpha(cp);
          else if (name == "isalnum") ok = u_isalnum(cp);
          else if (name == "isspace") ok = py_space(cp);
          else if (name == "isupper") {
            ok = !u_isULowercase(cp);
            any_cased = any_cased || u_isUUppercase(cp);
          } else {
            ok = !u_isUUppercase(cp);
            any_cased = any_cased || u_isULowercase(cp);
          }
          if (!ok) return Value::boolean(false);
        }
        return Value::boolean(name == "isupper" || name == "islower" ? any_cased : true);
      });
    }
    if (name == "removeprefix" || name == "removesuffix") {
      const bool pre = name == "removeprefix";
      return fn([s, pre](Args& a) {
        const Value x = a.get(0, "affix");
        if (!x.is_string()) fail("must be str, not " + type_name(x));
        if (pre && s.compare(0, x.s.size(), x.s) == 0) return Value::str(s.substr(x.s.size()));
        if (!pre && s.size() >= x.s.size() && s.compare(s.size() - x.s.size(), x.s.size(), x.s) == 0) {
          return Value::str(s.substr(0, s.size() - x.s.size()));
        }
        return Value::str(s);
      });
    }
    return Value::undefined();
  }

  // ---- globals ----

  void add_globals() {
    root_.set("range", Value::callable("range", [this](Args& a) {
      int64_t start = 0, stop = 0, st = 1;
      if (a.pos.size() == 1) {
        stop = to_int(a.pos[0], "range");
      } else if (a.pos.size() >= 2) {
        start = to_int(a.pos[0], "range");
        stop = to_int(a.pos[1], "range");
        if (a.pos.size() > 2) st = to_int(a.pos[2], "range");
      } else {
        fail("range expected at least 1 argument, got 0");
      }
      if (st == 0) fail("range() arg 3 must not be zero");
      ValueList out;
      for (int64_t k = start; st > 0 ? k < stop : k > stop; k += st) {
        step();
        out.push_back(Value::integer(k));
      }
      return Value::new_list(std::move(out));
    }));
    root_.set("namespace", Value::callable("namespace", [](Args& a) {
      Value ns = Value::new_dict();
      ns.dict->ns = true;
      for (const Value& p : a.pos) {  // namespace(dict) copies its items
        if (!p.is_dict()) fail("namespace() takes a mapping and keyword arguments");
        for (const auto& [k, v] : p.dict->items) ns.dict->set(k, v);
      }
      for (const auto& [k, v] : a.kw) ns.dict->set(Value::str(k), v);
      return ns;
    }));
    root_.set("dict", Value::callable("dict", [](Args& a) {
      Value d = Value::new_dict();
      for (const Value& p : a.pos) {
        if (!p.is_dict()) fail("dict() takes a mapping and keyword arguments");
        for (const auto& [k, v] : p.dict->items) d.dict->set(k, v);
      }
      for (const auto& [k, v] : a.kw) d.dict->set(Value::str(k), v);
      return d;
    }));
    root_.set("raise_exception", Value::callable("raise_exception", [](Args& a) -> Value {
      fail(to_str(a.get(0, "message")));
    }));
    root_.set("strftime_now", Value::callable("strftime_now", [this](Args& a) {
      const Value fmt = a.get(0, "format");
      if (!fmt.is_string()) fail("strftime() argument 1 must be str, not " + type_name(fmt));
      std::tm tm{};
      localtime_r(&now_, &tm);
      char buf[512];
      const size_t n = std::strftime(buf, sizeof buf, fmt.s.c_str(), &tm);
      return Value::str(std::string(buf, n));
    }));
  }

  // ---- filters ----

  Value attribute_of(const Value& item, const Value& path) {  // jinja2's make_attrgetter: "a.b", "0"
    if (path.kind == Value::Kind::kInt) return getitem(item, path);
    Value v = item;
    const std::string p = to_str(path);
    size_t b = 0;
    while (true) {
      const size_t dot = p.find('.', b);
      const std::string part = p.substr(b, dot == std::string::npos ? std::string::npos : dot - b);
      const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      v = digits ? getitem(v, Value::integer(std::stoll(part))) : getitem(v, Value::str(part));
      if (dot == std::string::npos) return v;
      b = dot + 1;
    }
  }

  int sort_compare(const Value& a, const Value& b, bool case_sensitive) {
    if (!case_sensitive && a.is_string() && b.is_string()) {
      return compare(Value::str(map_case(a.s, lower)), Value::str(map_case(b.s, lower)), "<");
    }
    return compare(a, b, "<");
  }

  Value filter(const std::string& name, Value v, Args& a, Frame& f) {
    using K = Value::Kind;
    auto soft = [](const Value& x) { return to_str(x); };
    if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") {
      Value r = Value::str(name == "safe" || (v.is_string() && v.safe && name != "forceescape") ? to_str(v) : html_escape(to_str(v)));
      r.safe = true;
      return r;
    }
    if (name == "tojson") {  // Hugging Face's: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys)
      JsonStyle st;
      st.ensure_ascii = truthy(a.get(0, "ensure_ascii", Value::boolean(false)));
      const Value indent = a.get(1, "indent", Value::none());
      const Value seps = a.get(2, "separators", Value::none());
      st.sort_keys = truthy(a.get(3, "sort_keys", Value::boolean(false)));
      if (!indent.is_none() && !indent.is_undefined()) {
        if (indent.is_string()) fail("tojson: a string indent is not supported");
        st.indent = static_cast<int>(std::max<int64_t>(0, to_int(indent, "indent")));
        st.item_sep = ",";
      }
      if (!seps.is_none() && !seps.is_undefined()) {
        const ValueList s = iterate(seps);
        if (s.size() != 2 || !s[0].is_string() || !s[1].is_string()) fail("tojson: separators must be two strings");
        st.item_sep = s[0].s;
        st.key_sep = s[1].s;
      }
      return Value::str(to_json(v, st));
    }
    if (name == "length" || name == "count") return Value::integer(length(v));
    // These keep a safe string safe (soft_str keeps jinja2's Markup, whose methods return Markup).
    auto keep = [&](std::string s) {
      Value r = Value::str(std::move(s));
      r.safe = v.is_string() && v.safe;
      return r;
    };
    if (name == "string") return keep(soft(v));
    if (name == "trim") return keep(py_strip(soft(v), a.get(0, "chars", Value::none()), true, true));
    if (name == "upper") return keep(map_case(soft(v), upper));
    if (name == "lower") return keep(map_case(soft(v), lower));
    if (name == "capitalize") return Value::str(py_capitalize(soft(v)));
    if (name == "title") {  // jinja2's: each word after -, whitespace, (, {, [ or <
      const auto cps = code_points(soft(v));
      std::string out;
      bool start = true;
      for (uint32_t cp : cps) {
        const bool sep = cp == '-' || py_space(cp) || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        put(sep ? cp : start ? upper(cp) : lower(cp), out);
        start = sep;
      }
      return Value::str(std::move(out));
    }
    if (name == "default" || name == "d") {
      const Value dflt = a.get(0, "default_value", Value::str(""));
      const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
      return v.is_undefined() || (boolean && !truthy(v)) ? dflt : v;
    }
    if (name == "replace") {
      const Value from = a.get(0, "old"), to = a.get(1, "new"), count = a.get(2, "count", Value::none());
      return Value::str(py_replace(soft(v), soft(from), soft(to), count.is_none() ? -1 : to_int(count, "count")));
    }
    if (name == "join") {
      const Value sep = a.get(0, "d", Value::str(""));
      const Value attr = a.get(1, "attribute", Value::none());
      std::string out;
      bool first = true;
      for (const Value& x : iterate(v)) {
        if (!first) out += soft(sep);
        out += soft(attr.is_none() ? x : attribute_of(x, attr));
        first = false;
      }
      return Value::str(std::move(out));
    }
    if (name == "list") return Value::new_list(iterate(v));
    if (name == "first" || name == "last") {
      const ValueList items = iterate(v);
      if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        auto cps = code_points(v.s);
        std::reverse(cps.begin(), cps.end());
        return Value::str(from_code_points(cps, 0, cps.size()));
      }
      ValueList items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::new_list(std::move(items));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::new_list();
      if (!v.is_dict() || v.dict->ns) fail("Can only get item pairs from a mapping.");
      ValueList out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::new_list({k, x}, true));
      return Value::new_list(std::move(out));
    }
    if (name == "dictsort") {
      if (!v.is_dict() || v.dict->ns) fail("You can only sort by either \"key\" or \"value\"");
      const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const Value by = a.get(1, "by", Value::str("key"));
      const bool rev = truthy(a.get(2, "reverse", Value::boolean(false)));
      const int pos = to_str(by) == "value" ? 1 : 0;
      ValueList out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::new_list({k, x}, true));
      std::stable_sort(out.begin(), out.end(), [&](const Value& p, const Value& q) {
        const int c = sort_compare(p.list->items[pos], q.list->items[pos], cs);
        return rev ? c > 0 : c < 0;
      });
      return Value::new_list(std::move(out));
    }
    if (name == "sort") {
      const bool rev = truthy(a.get(0, "reverse", Value::boolean(false)));
      const bool cs = truthy(a.get(1, "case_sensitive", Value::boolean(false)));
      const Value attr = a.get(2, "attribute", Value::none());
      ValueList items = iterate(v);
      std::vector<Value> keys;
      for (const Value& x : items) keys.push_back(attr.is_none() ? x : attribute_of(x, attr));
      std::vector<size_t> idx(items.size());
      for (size_t k = 0; k < idx.size(); ++k) idx[k] = k;
      std::stable_sort(idx.begin(), idx.end(), [&](size_t p, size_t q) {
        const int c = sort_compare(keys[p], keys[q], cs);
        return rev ? c > 0 : c < 0;
      });
      ValueList out;
      for (size_t k : idx) out.push_back(items[k]);
      return Value::new_list(std::move(out));
    }
    if (name == "unique") {
      const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const Value attr = a.get(1, "attribute", Value::none());
      ValueList out, seen;
      for (const Value& x : iterate(v)) {
        Value key = attr.is_none() ? x : attribute_of(x, attr);
        if (!cs && key.is_string()) key = Value::str(map_case(key.s, lower));
        bool dup = false;
        for (const Value& s : seen) dup = dup || equal(s, key);
        if (dup) continue;
        seen.push_back(key);
        out.push_back(x);
      }
      return Value::new_list(std::move(out));
    }
    if (name == "map") {
      ValueList out;
      if (!truthy(v)) return Value::generator({});
      const Value attr = a.get(99, "attribute", Value::undefined());
      if (!attr.is_undefined()) {
        const Value dflt = a.get(99, "default", Value::undefined());
        for (const Value& x : iterate(v)) {
          Value y = attribute_of(x, attr);
          out.push_back(y.is_undefined() && !dflt.is_undefined() ? dflt : y);
        }
        return Value::generator(std::move(out));
      }
      if (a.pos.empty()) fail("map requires a filter argument");
      const std::string fname = to_str(a.pos[0]);
      if (!known_filter(fname)) fail("No filter named '" + fname + "'.");
      Args rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& x : iterate(v)) {
        Args copy = rest;
        out.push_back(filter(fname, x, copy, f));
      }
      return Value::generator(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      if (!truthy(v)) return Value::generator({});
      const bool attr = name.ends_with("attr");
      const bool keep_if = name.starts_with("select");
      size_t k = 0;
      Value path;
      if (attr) {
        if (a.pos.empty()) fail(name + " requires an attribute");
        path = a.pos[k++];
      }
      std::string tname;
      if (k < a.pos.size()) tname = to_str(a.pos[k++]);
      if (!tname.empty() && !known_test(tname)) fail("No test named '" + tname + "'.");
      Args targs;
      targs.pos.assign(a.pos.begin() + static_cast<ptrdiff_t>(std::min(k, a.pos.size())), a.pos.end());
      targs.kw = a.kw;
      ValueList out;
      for (const Value& x : iterate(v)) {
        const Value subject = attr ? attribute_of(x, path) : x;
        Args copy = targs;
        const bool r = tname.empty() ? truthy(subject) : test(tname, subject, copy);
        if (r == keep_if) out.push_back(x);
      }
      return Value::generator(std::move(out));
    }
    if (name == "indent") {
      const Value width = a.get(0, "width", Value::integer(4));
      const bool first = truthy(a.get(1, "first", Value::boolean(false)));
      const bool blank = truthy(a.get(2, "blank", Value::boolean(false)));
      const std::string ind = width.is_string() ? width.s : std::string(static_cast<size_t>(std::max<int64_t>(0, to_int(width, "width"))), ' ');
      const std::string s = soft(v) + "\n";
      const auto lines = py_splitlines(s, false);
      std::string rv;
      if (blank) {
        for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + ind : "") + lines[k];
      } else {
        rv = lines.empty() ? "" : lines[0];
        for (size_t k = 1; k < lines.size(); ++k) rv += "\n" + (lines[k].empty() ? "" : ind + lines[k]);
      }
      return Value::str(first ? ind + rv : rv);
    }
    if (name == "int") {
      const Value dflt = a.get(0, "default", Value::integer(0));
      if (v.kind == K::kInt) return v;
      if (v.kind == K::kBool) return Value::integer(v.b);
      if (v.kind == K::kFloat) return std::isfinite(v.f) ? Value::integer(static_cast<int64_t>(v.f)) : dflt;
      if (v.is_string()) {
        const std::string t = py_strip(v.s, Value::none(), true, true);
        try {
          size_t used = 0;
          const long long x = std::stoll(t, &used, 10);
          if (used == t.size()) return Value::integer(x);
          const double d = std::stod(t, &used);
          if (used == t.size() && std::isfinite(d)) return Value::integer(static_cast<int64_t>(d));
        } catch (const std::exception&) {
        }
      }
      return dflt;
    }
    if (name == "float") {
      const Value dflt = a.get(0, "default", Value::real(0.0));
      if (v.kind == K::kFloat) return v;
      if (v.kind == K::kInt || v.kind == K::kBool) return Value::real(to_double(v));
      if (v.is_string()) {
        try {
          size_t used = 0;
          const std::string t = py_strip(v.s, Value::none(), true, true);
          const double d = std::stod(t, &used);
          if (used == t.size()) return Value::real(d);
        } catch (const std::exception&) {
        }
      }
      return dflt;
    }
    if (name == "abs") {
      if (v.kind == K::kFloat) return Value::real(std::fabs(v.f));
      const int64_t x = to_int(v, "abs");
      return Value::integer(x < 0 ? -x : x);
    }
    if (name == "round") {
      const int64_t prec = to_int(a.get(0, "precision", Value::integer(0)), "precision");
      const std::string method = to_str(a.get(1, "method", Value::str("common")));
      const double m = std::pow(10.0, static_cast<double>(prec)), x = to_double(v) * m;
      const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
      return Value::real(r / m);
    }
    if (name == "sum") {
      const Value attr = a.get(0, "attribute", Value::none());
      Value total = a.get(1, "start", Value::integer(0));
      for (const Value& x : iterate(v)) total = binary("+", total, attr.is_none() ? x : attribute_of(x, attr));
      return total;
    }
    if (name == "min" || name == "max") {
      const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      const Value attr = a.get(1, "attribute", Value::none());
      const ValueList items = iterate(v);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      size_t best = 0;
      for (size_t k = 1; k < items.size(); ++k) {
        const Value x = attr.is_none() ? items[k] : attribute_of(items[k], attr);
        const Value y = attr.is_none() ? items[best] : attribute_of(items[best], attr);
        const int c = sort_compare(x, y, cs);
        if (name == "min" ? c < 0 : c > 0) best = k;
      }
      return items[best];
    }
    if (name == "attr") return getattr(v, to_str(a.get(0, "name")));
    if (name == "wordcount") {  // runs of \w
      int64_t n = 0;
      bool in_word = false;
      for (uint32_t cp : code_points(soft(v))) {
        const bool w = cp == '_' || u_isalnum(cp);
        n += w && !in_word;
        in_word = w;
      }
      return Value::integer(n);
    }
    if (name == "center") {
      const int64_t width = to_int(a.get(0, "width", Value::integer(80)), "width");
      const std::string s = soft(v);
      const int64_t n = length(Value::str(s));
      if (n >= width) return Value::str(s);
      const int64_t pad = width - n, left = pad / 2 + (pad & width & 1);
      return Value::str(std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(pad - left), ' '));
    }
    fail("No filter named '" + name + "'.");
  }

 public:
  static bool known_filter(std::string_view n) {
    static const char* kFilters[] = {"safe", "e", "escape", "forceescape", "tojson", "length", "count", "string",
                                     "trim", "upper", "lower", "capitalize", "title", "default", "d", "replace",
                                     "join", "list", "first", "last", "reverse", "items", "dictsort", "sort",
                                     "unique", "map", "select", "reject", "selectattr", "rejectattr", "indent",
                                     "int", "float", "abs", "round", "sum", "min", "max", "attr", "wordcount",
                                     "center"};
    for (const char* f : kFilters)
      if (n == f) return true;
    return false;
  }
  static bool known_test(std::string_view n) {
    static const char* kTests[] = {"defined", "undefined", "none", "string", "number", "integer", "float",
                                   "boolean", "true", "false", "mapping", "iterable", "sequence", "callable",
                                   "even", "odd", "divisibleby", "eq", "equalto", "==", "ne", "!=", "gt", ">",
                                   "greaterthan", "ge", ">=", "lt", "<", "lessthan", "le", "<=", "in", "lower",
                                   "upper", "sameas", "escaped", "filter", "test"};
    for (const char* t : kTests)
      if (n == t) return true;
    return false;
  }

 private:
  bool test(const std::string& name, const Value& v, Args& a) {
    using K = Value::Kind;
    auto arg = [&]() -> Value {
      if (a.pos.empty()) fail("test '" + name + "' needs an argument");
      return a.pos[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == K::kInt;
    if (name == "float") return v.kind == K::kFloat;
    if (name == "boolean") return v.kind == K::kBool;
    if (name == "true") return v.kind == K::kBool && v.b;
    if (name == "false") return v.kind == K::kBool && !v.b;
    if (name == "mapping") return v.is_dict() && !v.dict->ns;
    if (name == "iterable") return v.is_undefined() || v.is_string() || v.is_list() || (v.is_dict() && !v.dict->ns);
    if (name == "sequence") {
      return v.is_undefined() || v.is_string() || (v.is_list() && !v.list->generator) || (v.is_dict() && !v.dict->ns);
    }
    if (name == "callable") return v.kind == K::kCallable;
    if (name == "even" || name == "odd") {
      const int64_t x = v.kind == K::kFloat ? static_cast<int64_t>(v.f) : to_int(v, name);
      return ((x % 2) != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      const int64_t d = to_int(arg(), "divisibleby");
      if (d == 0) fail("integer modulo by zero");
      return to_int(v, "divisibleby") % d == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg());
    if (name == "ne" || name == "!=") return !equal(v, arg());
    if (name == "gt" || name == ">" || name == "greaterthan") return compare_op(">", v, arg());
    if (name == "ge" || name == ">=") return compare_op(">=", v, arg());
    if (name == "lt" || name == "<" || name == "lessthan") return compare_op("<", v, arg());
    if (name == "le" || name == "<=") return compare_op("<=", v, arg());
    if (name == "in") return contains(arg(), v);
    if (name == "lower" || name == "upper") {
      const std::string s = to_str(v);
      bool any = false;
      for (uint32_t cp : code_points(s)) {
        if (name == "lower" ? u_isUUppercase(cp) : u_isULowercase(cp)) return false;
        any = any || (name == "lower" ? u_isULowercase(cp) : u_isUUppercase(cp));
      }
      return any;
    }
    if (name == "sameas") {
      const Value o = arg();
      if (v.kind != o.kind) return false;
      switch (v.kind) {
        case K::kList: return v.list == o.list;
        case K::kDict: return v.dict == o.dict;
        case K::kCallable: return v.fn == o.fn;
        case K::kString: return false;  // distinct objects unless interned: jinja2 cannot promise either
        default: return equal(v, o);
      }
    }
    if (name == "escaped") return false;
    if (name == "filter") return known_filter(to_str(v));
    if (name == "test") return known_test(to_str(v));
    fail("No test named '" + name + "'.");
  }

  const Options& o_;
  std::time_t now_;
  const char* stack_base_ = nullptr;
  Frame root_;
  int64_t steps_ = 0;
  size_t emitted_ = 0;
  int depth_ = 0;
};

// jinja2's compiler fails on an unknown filter or test unless it sits in an if statement's frame or
// a conditional expression ("soft" frames: there it fails only if it runs); loops and macros open
// frames of their own, which are not soft.
void check_names(const Expr& e, bool soft) {
  if (!soft && e.kind == Expr::Kind::kFilter && !Renderer::known_filter(e.name)) {
    fail("line " + std::to_string(e.line) + ": No filter named '" + e.name + "'.");
  }
  if (!soft && e.kind == Expr::Kind::kTest && !Renderer::known_test(e.name)) {
    fail("line " + std::to_string(e.line) + ": No test named '" + e.name + "'.");
  }
  const bool inner = soft || e.kind == Expr::Kind::kCond;
  for (const auto& a : e.args)
    if (a) check_names(*a, inner);
  for (const auto& [k, a] : e.kwargs)
    if (a) check_names(*a, inner);
}
void check_names(const Body& body, bool soft) {
  for (const auto& n : body) {
    const bool own_frame = n->kind == Node::Kind::kFor || n->kind == Node::Kind::kMacro || n->kind == Node::Kind::kCallBlock;
    if (n->expr) check_names(*n->expr, soft);
    if (n->filter) check_names(*n->filter, own_frame ? false : soft);
    for (const auto& [c, b] : n->branches) {
      check_names(*c, true);
      check_names(b, true);
    }
    for (const auto& [k, d] : n->params)
      if (d) check_names(*d, false);
    check_names(n->body, own_frame ? false : soft);
    check_names(n->else_body, n->kind == Node::Kind::kIf ? true : own_frame ? false : soft);
  }
}

}  // namespace

// jinja2 reports unknown filters and tests when it compiles a template, whether or not they run.
void check_program(const Program& p) { check_names(p.body, false); }

std::string render_program(const Program& program, const Options& options, const nlohmann::ordered_json& context,
                           std::time_t now) {
  Renderer r(options, now);
  return r.run(program, context);
}

}  // namespace combs::jinja
