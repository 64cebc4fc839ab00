// Values with Python's semantics: truth, str(), repr(), ==, ordering, len(), iteration, and
// json.dumps as Hugging Face's tojson calls it.
#include <unicode/uchar.h>

#include <charconv>
#include <cmath>
#include <cstdio>

#include "jinja_internal.h"

namespace combs::jinja {

void fail(const std::string& message) { throw Error(message); }

Value Value::undefined(std::string what) {
  Value v;
  v.s = std::move(what);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::kBool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::kInt;
  v.i = x;
  return v;
}
Value Value::real(double x) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = x;
  return v;
}
Value Value::str(std::string x) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::move(x);
  return v;
}
Value Value::new_list(ValueList items, bool tuple) {
  Value v;
  v.kind = Kind::kList;
  v.list = std::make_shared<List>();
  v.list->items = std::move(items);
  v.list->tuple = tuple;
  return v;
}
Value Value::generator(ValueList items) {
  Value v = new_list(std::move(items));
  v.list->generator = true;
  return v;
}
Value Value::new_dict() {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::callable(std::string name, std::function<Value(Args&)> fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const Value* Dict::find(const Value& key) const {
  for (const auto& [k, v] : items)
    if (equal(k, key)) return &v;
  return nullptr;
}
const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k.kind == Value::Kind::kString && k.s == key) return &v;
  return nullptr;
}
void Dict::set(const Value& key, Value v) {
  for (auto& [k, old] : items) {
    if (equal(k, key)) {
      old = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

Value Args::get(size_t index, std::string_view name, Value fallback) const {
  if (index < pos.size()) return pos[index];
  for (const auto& [k, v] : kw)
    if (k == name) return v;
  return fallback;
}
void Args::expect_at_most(size_t n, std::string_view who) const {
  if (pos.size() > n) {
    fail(std::string(who) + "() takes at most " + std::to_string(n) + " positional arguments (" +
         std::to_string(pos.size()) + " given)");
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kInt: return v.i != 0;
    case Value::Kind::kFloat: return v.f != 0;
    case Value::Kind::kString: return !v.s.empty();
    case Value::Kind::kList: return v.list->generator || !v.list->items.empty();
    case Value::Kind::kDict: return v.dict->ns || !v.dict->items.empty();
    case Value::Kind::kCallable: return true;
  }
  return false;
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return v.list->generator ? "generator" : v.list->tuple ? "tuple" : "list";
    case Value::Kind::kDict: return v.dict->ns ? "Namespace" : "dict";
    case Value::Kind::kCallable: return "function";
  }
  return "object";
}

// Python's repr of a float: the shortest digits that round-trip; exponent form below 1e-4 and
// from 1e16.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]XX
  const size_t e = sci.find('e');
  const int exp10 = std::stoi(sci.substr(e + 1));
  std::string digits;
  const bool neg = sci[0] == '-';
  for (size_t k = neg ? 1 : 0; k < e; ++k)
    if (sci[k] != '.') digits += sci[k];
  const int decpt = exp10 + 1;
  std::string out = neg ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (decpt <= 0) return out + "0." + std::string(-decpt, '0') + digits;
  if (static_cast<size_t>(decpt) >= digits.size()) return out + digits + std::string(decpt - digits.size(), '0') + ".0";
  return out + digits.substr(0, decpt) + "." + digits.substr(decpt);
}

namespace {

bool printable(uint32_t cp) {  // Python's str.isprintable for one character
  if (cp == ' ') return true;
  if (cp < 0x20 || cp == 0x7f) return false;
  if (cp < 0x7f) return true;
  const int8_t t = u_charType(static_cast<UChar32>(cp));
  return !(t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_SURROGATE || t == U_PRIVATE_USE_CHAR ||
           t == U_UNASSIGNED || t == U_LINE_SEPARATOR || t == U_PARAGRAPH_SEPARATOR || t == U_SPACE_SEPARATOR);
}

std::string repr_str(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  each_code_point(s, [&](uint32_t cp, size_t at, size_t len) {
    char buf[16];
    if (cp == static_cast<uint32_t>(q) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (printable(cp) && !(cp >= 0xdc80 && cp <= 0xdcff)) {
      out.append(s, at, len);
    } else {
      std::snprintf(buf, sizeof buf, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", cp);
      out += buf;
    }
  });
  return out + q;
}

void json_str(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  each_code_point(s, [&](uint32_t cp, size_t at, size_t len) {
    char buf[16];
    switch (cp) {
      case '"': out += "\\\""; return;
      case '\\': out += "\\\\"; return;
      case '\n': out += "\\n"; return;
      case '\r': out += "\\r"; return;
      case '\t': out += "\\t"; return;
      case '\b': out += "\\b"; return;
      case '\f': out += "\\f"; return;
      default: break;
    }
    if (cp < 0x20 || (ensure_ascii && cp >= 0x7f)) {
      if (cp >= 0x10000) {
        const uint32_t v = cp - 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
      } else {
        std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      }
      out += buf;
    } else {
      out.append(s, at, len);
    }
  });
  out += '"';
}

void json_value(const Value& v, const JsonStyle& st, int level, std::string& out) {
  auto newline = [&](int lvl) {
    if (st.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(st.indent) * lvl, ' ');
  };
  switch (v.kind) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.b ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.i); return;
    case Value::Kind::kFloat:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f < 0 ? "-Infinity" : "Infinity";
      else out += float_repr(v.f);
      return;
    case Value::Kind::kString: json_str(v.s, st.ensure_ascii, out); return;
    case Value::Kind::kList: {
      if (v.list->generator) break;
      if (v.list->items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->items.size(); ++k) {
        if (k > 0) out += st.item_sep;
        newline(level + 1);
        json_value(v.list->items[k], st, level + 1, out);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->ns) break;
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      auto key_text = [](const Value& k) -> std::string {
        switch (k.kind) {
          case Value::Kind::kString: return k.s;
          case Value::Kind::kInt: return std::to_string(k.i);
          case Value::Kind::kFloat: return float_repr(k.f);
          case Value::Kind::kBool: return k.b ? "true" : "false";
          case Value::Kind::kNone: return "null";
          default: fail("keys must be str, int, float, bool or None, not " + type_name(k));
        }
      };
      if (st.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [&](const auto* a, const auto* b) { return compare(a->first, b->first, "<") < 0; });
      }
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out += st.item_sep;
        newline(level + 1);
        json_str(key_text(items[k]->first), st.ensure_ascii, out);
        out += st.key_sep;
        json_value(items[k]->second, st, level + 1, out);
      }
      newline(level);
      out += '}';
      return;
    }
    default: break;
  }
  fail("Object of type " + type_name(v) + " is not JSON serializable");
}

}  // namespace

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kString: return repr_str(v.s);
    case Value::Kind::kList: {
      if (v.list->generator) return "<generator object>";
      const bool t = v.list->tuple;
      std::string out = t ? "(" : "[";
      for (size_t k = 0; k < v.list->items.size(); ++k) out += (k ? ", " : "") + repr(v.list->items[k]);
      if (t && v.list->items.size() == 1) out += ",";
      return out + (t ? ")" : "]");
    }
    case Value::Kind::kDict: {
      std::string out = v.dict->ns ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        out += (k ? ", " : "") + repr(v.dict->items[k].first) + ": " + repr(v.dict->items[k].second);
      }
      return out + (v.dict->ns ? "}>" : "}");
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.b ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.i);
    case Value::Kind::kFloat: return float_repr(v.f);
    case Value::Kind::kString: return v.s;
    case Value::Kind::kCallable: return "<function " + v.fn->name + ">";
    default: return repr(v);
  }
}

bool equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    const bool fa = a.kind == K::kFloat, fb = b.kind == K::kFloat;
    const auto num = [](const Value& x) { return x.kind == K::kBool ? static_cast<int64_t>(x.b) : x.i; };
    if (!fa && !fb) return num(a) == num(b);
    return (fa ? a.f : static_cast<double>(num(a))) == (fb ? b.f : static_cast<double>(num(b)));
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kString: return a.s == b.s;
    case K::kList: {
      if (a.list->tuple != b.list->tuple || a.list->items.size() != b.list->items.size()) return false;
      for (size_t k = 0; k < a.list->items.size(); ++k)
        if (!equal(a.list->items[k], b.list->items[k])) return false;
      return true;
    }
    case K::kDict: {
      if (a.dict->ns || b.dict->ns) return a.dict == b.dict;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (o == nullptr || !equal(v, *o)) return false;
      }
      return true;
    }
    case K::kCallable: return a.fn == b.fn;
    default: return false;
  }
}

int compare(const Value& a, const Value& b, std::string_view op) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    auto num = [](const Value& x) {
      return x.kind == K::kFloat ? x.f : static_cast<double>(x.kind == K::kBool ? x.b : x.i);
    };
    if (a.kind != K::kFloat && b.kind != K::kFloat) {
      const int64_t x = a.kind == K::kBool ? a.b : a.i, y = b.kind == K::kBool ? b.b : b.i;
      return x < y ? -1 : x > y;
    }
    const double x = num(a), y = num(b);
    return x < y ? -1 : x > y;
  }
  if (a.kind == K::kString && b.kind == K::kString) return a.s < b.s ? -1 : a.s > b.s;
  if (a.kind == K::kList && b.kind == K::kList && a.list->tuple == b.list->tuple) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (!equal(x[k], y[k])) return compare(x[k], y[k], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size();
  }
  fail("'" + std::string(op) + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(v, style, 0, out);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(static_cast<int64_t>(u))
                                                   : Value::real(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::new_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::new_dict();
      for (const auto& [k, x] : j.items()) d.dict->items.emplace_back(Value::str(k), from_json(x));
      return d;
    }
    default: return Value::none();
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: {
      int64_t n = 0;
      each_code_point(v.s, [&](uint32_t, size_t, size_t) { ++n; });
      return n;
    }
    case Value::Kind::kList:
      if (v.list->generator) break;
      return static_cast<int64_t>(v.list->items.size());
    case Value::Kind::kDict:
      if (!v.dict->ns) return static_cast<int64_t>(v.dict->items.size());
      break;
    default: break;
  }
  fail("object of type '" + type_name(v) + "' has no len()");
}

ValueList iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList:
      if (v.list->generator) {
        if (v.list->consumed) return {};
        v.list->consumed = true;
      }
      return v.list->items;
    case Value::Kind::kDict: {
      if (v.dict->ns) break;
      ValueList keys;
      for (const auto& kv : v.dict->items) keys.push_back(kv.first);
      return keys;
    }
    case Value::Kind::kString: {
      ValueList chars;
      each_code_point(v.s, [&](uint32_t, size_t at, size_t len) { chars.push_back(Value::str(v.s.substr(at, len))); });
      return chars;
    }
    default: break;
  }
  fail("'" + type_name(v) + "' object is not iterable");
}

}  // namespace combs::jinja
