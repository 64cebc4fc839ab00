// The Jinja engine's pieces (internal to src/chat): values with Python's semantics, the syntax
// tree, the parser and the renderer. Errors inside the engine are thrown as jinja::Error and turned
// into a Status at the API (jinja.h); nothing else throws across it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "combs/chat/jinja.h"

namespace combs::jinja {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string& message);

// Recursion guard by stack use (parser and renderer recurse with the template's nesting): fails
// once more than kStackBudget bytes lie between `base` and the caller's frame, whatever the frame
// sizes of the build (sanitizers make them several times larger).
constexpr size_t kStackBudget = 1u << 20;
inline void check_stack(const char* base) {
  const char here = 0;
  const char* p = &here;
  if (base != nullptr && static_cast<size_t>(base > p ? base - p : p - base) > kStackBudget) {
    fail("the template nests too deeply");
  }
}

// ---- Text: UTF-8 as Python's str sees it ----

// The code point at s[i] and its byte length; an invalid or truncated lead byte b stands for itself
// as U+DC00 + b (Python's surrogateescape), one byte long.
inline uint32_t decode_utf8(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  const size_t n = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 1;
  *len = 1;
  if (n == 1 || i + n > s.size()) return b0 < 0x80 ? b0 : 0xdc00u + b0;
  uint32_t cp = b0 & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3f);
  *len = n;
  return cp;
}
// f(code point, byte offset, byte length) for each code point of s.
template <typename F>
void each_code_point(std::string_view s, F&& f) {
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    const uint32_t cp = decode_utf8(s, i, &len);
    f(cp, i, len);
  }
}
// Python's str.isspace for one code point.
inline bool py_space(uint32_t cp) {
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
         cp == 0x205f || cp == 0x3000;
}

// ---- Values ----

struct Value;
struct List;
struct Dict;
struct Callable;
using ValueList = std::vector<Value>;

struct Value {
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // a string; for an undefined value, what it was (for errors)
  bool safe = false;  // a string marked safe (jinja2's Markup: `|safe`, `|escape`): `+` escapes the other side
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<const Callable> fn;

  static Value undefined(std::string what = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value real(double v);
  static Value str(std::string v);
  static Value new_list(ValueList items = {}, bool tuple = false);
  static Value generator(ValueList items);
  static Value new_dict();
  static Value callable(std::string name, std::function<Value(struct Args&)> fn);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
};

struct List {
  ValueList items;
  bool tuple = false;
  // A generator (what jinja2's select, reject, selectattr, rejectattr and map return): true however
  // long, no len(), not JSON, and empty once iterated.
  bool generator = false;
  bool consumed = false;
};

struct Dict {
  std::vector<std::pair<Value, Value>> items;  // in insertion order, as Python's dict
  bool ns = false;                             // namespace(): attributes can be set
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(const Value& key, Value v);
};

struct Args {
  ValueList pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Python's argument binding: the value of parameter `name` at `index`, or `fallback`.
  Value get(size_t index, std::string_view name, Value fallback = Value::undefined()) const;
  void expect_at_most(size_t n, std::string_view who) const;
};

struct Callable {
  std::string name;
  std::function<Value(Args&)> fn;
};

// Python's semantics.
bool truthy(const Value& v);
std::string to_str(const Value& v);   // str(v); undefined prints as nothing
std::string repr(const Value& v);     // repr(v)
std::string type_name(const Value& v);  // Python's type name, for errors
bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b, std::string_view op);  // <0, 0, >0; fails on unorderable
std::string float_repr(double d);
struct JsonStyle {
  int indent = -1;  // none
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
std::string to_json(const Value& v, const JsonStyle& style);
Value from_json(const nlohmann::ordered_json& j);
int64_t length(const Value& v);  // len(v); fails where Python's would
ValueList iterate(const Value& v);  // iter(v) materialized; undefined is empty

// ---- Syntax tree ----

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Expr {
  enum class Kind : uint8_t {
    kLiteral, kName, kList, kTuple, kDict, kAttr, kItem, kSlice, kCall, kFilter, kTest,
    kNeg, kPos, kNot, kAnd, kOr, kBinary, kCompare, kCond, kConcat,
  };
  Kind kind;
  int line = 0;
  Value value;                       // kLiteral
  std::string name;                  // kName, kAttr, kFilter, kTest, kBinary's operator
  std::vector<ExprPtr> args;         // operands; call/filter/test arguments after the subject
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;      // kCompare: the operators between args
  bool negated = false;              // kTest: `is not`
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;
struct Node {
  enum class Kind : uint8_t { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kFilterBlock,
                              kBreak, kContinue, kScope };
  Kind kind;
  int line = 0;
  std::string text;                                  // kText
  ExprPtr expr;                                      // kOutput, kSet's value, kFor's iterable, kCallBlock's call
  std::vector<std::pair<ExprPtr, Body>> branches;    // kIf: (condition, body), ...
  Body body, else_body;
  std::vector<std::string> targets;                  // kFor / kSet: names; kSet "ns.attr" as {ns, attr} + attr_target
  bool attr_target = false;
  ExprPtr filter;                                    // kFor's `if`, kFilterBlock's filter chain (on a kName "")
  std::string name;                                  // kMacro
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro / kCallBlock's caller
  bool recursive = false;                            // kFor
};

struct Program {
  Body body;
};

std::shared_ptr<const Program> parse_program(std::string_view source, const Options& options);
void check_program(const Program& program);  // unknown filters and tests, as jinja2's compiler finds them
std::string render_program(const Program& program, const Options& options, const nlohmann::ordered_json& context,
                           std::time_t now);

}  // namespace combs::jinja
