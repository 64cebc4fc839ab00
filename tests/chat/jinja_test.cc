// The Jinja engine on its own: Python's semantics where templates rely on them, errors for bad
// templates and contexts, bounded work on hostile input. Expected values are jinja2's (noted).
#include <catch2/catch.hpp>

#include "combs/chat/jinja.h"

using namespace combs;

namespace {

std::string render(const std::string& source, const char* context = "{}") {
  auto t = jinja::Template::parse(source);
  if (!t.ok()) return "PARSE: " + t.status().message();
  auto out = t->render(nlohmann::ordered_json::parse(context), 0);
  if (!out.ok()) return "ERROR: " + out.status().message();
  return *out;
}

}  // namespace

TEST_CASE("jinja expressions follow Python", "[chat]") {
  // Each expected value is what jinja2 3.1 renders for the same source.
  CHECK(render("{{ 1.0 }} {{ 1e20 }} {{ 0.1+0.2 }} {{ 10/4 }} {{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }}") ==
        "1.0 1e+20 0.30000000000000004 2.5 3 -4 2 1024");
  CHECK(render("{{ \"a\" ~ 1 ~ none ~ x }}") == "a1None");
  CHECK(render("{{ [1, \"a\", none, true, 1.5, (1,2), {\"k\": [1]}] }}") == "[1, 'a', None, True, 1.5, (1, 2), {'k': [1]}]");
  CHECK(render("{{ \"abc\"[::-1] }} {{ [1,2,3][1:] }} {{ \"h\xc3\xa9llo\"[1] }}") == "cba [2, 3] \xc3\xa9");
  CHECK(render("{{ \"  a b  \".split() }} {{ \"a,b,,c\".split(\",\") }} {{ \"hello world\".title() }}") ==
        "['a', 'b'] ['a', 'b', '', 'c'] Hello World");
  CHECK(render("{{ {\"a\": 1, \"b\": [true, none]} | tojson }} {{ \"\xc3\xa9\\n\" | tojson }}") ==
        "{\"a\": 1, \"b\": [true, null]} \"\xc3\xa9\\n\"");
  CHECK(render("{{ {\"b\": 1, \"a\": 2} | tojson(indent=2, sort_keys=true) }}") == "{\n  \"a\": 2,\n  \"b\": 1\n}");
  CHECK(render("{% for a, b in [(1,2),(3,4)] %}{{ a }}{{ b }}{{ loop.index }}{{ loop.last }}{% endfor %}") ==
        "121False342True");
  CHECK(render("{{ 'x' if false }}|{{ ('x' if false) is defined }}") == "|False");
  CHECK(render("{{ 3 is divisibleby 3 }} {{ 'a' is string }} {{ x is not defined }}") == "True True True");
  CHECK(render("{% set ns = namespace(b=2) %}{% set ns.b = 3 %}{{ ns.b }}") == "3");
  CHECK(render("{% for i in range(3) %}{% if i == 0 %}{% set x = 'a' %}{% endif %}[{{ x }}]{% endfor %}") == "[a][][]");
  CHECK(render("{% set x = 1 %}{% for i in range(2) %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}") == "12121");
  CHECK(render("{% macro m(a, b='d') %}{{ a }}{{ b }}{{ y }}{% endmacro %}{% set y = 5 %}{{ m(1) }}{{ m(2, b=3) }}") ==
        "1d5235");
  CHECK(render("  {% if true %}\n  x\n  {% endif %}\n") == "  x\n");
  CHECK(render("a  {%- if true -%}  b  {%- endif %}") == "ab");
  CHECK(render("{% for x in [1,2,3] if x != 2 %}{{ loop.length }}{{ x }}{% else %}none{% endfor %}") == "2123");
  CHECK(render("{% for x in [] %}{{ x }}{% else %}none{% endfor %}") == "none");
  // A break in a loop's else body belongs to the enclosing loop (jinja2: "12").
  CHECK(render("{% for i in [1,2,3] %}{{ i }}{% for j in [] %}{% else %}{% if i == 2 %}{% break %}{% endif %}"
               "{% endfor %}{% endfor %}") == "12");
  CHECK(render("{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}") == "1");
  CHECK(render("{{ [3,1,2] | sort | join(',') }} {{ ['b','A','a'] | unique | list }} {{ {'b':1,'a':2} | dictsort }}") ==
        "1,2,3 ['b', 'A'] [('a', 2), ('b', 1)]");
  CHECK(render("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('|') }}",
               R"({"msgs": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}, {"role": "user", "content": "c"}]})") ==
        "a|c");
  CHECK(render("{{ 'a\nb\n\nc' | indent(2) }}|{{ 'x' | indent(2, true) }}") == "a\n  b\n\n  c|  x");
  CHECK(render("{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d['a'] }} {{ d.a }} {{ d.items() | list }}", R"({"d": {"a": 1}})") ==
        "1 dflt 1 1 [('a', 1)]");
  CHECK(render("{{ '%s-%d' % ('a', 3) }} {{ 'abc'.startswith(('x', 'a')) }} {{ ' x '.strip() }}") == "a-3 True x");
  CHECK(render("{% set t %}in {{ 1 }}{% endset %}[{{ t }}]") == "[in 1]");
  CHECK(render("{% filter upper %}abc{% endfilter %}") == "ABC");
  CHECK(render("{% generation %}kept{% endgeneration %}") == "kept");
  CHECK(render("{% raw %}{{ not rendered }}{% endraw %}") == "{{ not rendered }}");
  CHECK(render("{#- a comment -#}\n  x") == "x");
  CHECK(render("{{ 'ab' * 3 }} {{ [0] * 2 }} {{ 1 in [1] }} {{ 'b' in 'abc' }} {{ 'k' in {'k': 0} }}") ==
        "ababab [0, 0] True True True");
  CHECK(render("line\n") == "line");  // keep_trailing_newline is off
  CHECK(render("a\r\nb") == "a\nb");  // newlines normalized
}

TEST_CASE("jinja errors are clear and never crash", "[chat]") {
  CHECK(render("{{ raise_exception('Conversation roles must alternate') }}") ==
        "ERROR: Conversation roles must alternate");
  CHECK(render("{{ x.y }}") == "ERROR: 'x' is undefined");
  CHECK(render("{{ [1].append(2) }}").starts_with("ERROR: access to attribute 'append' of 'list' object is unsafe"));
  CHECK(render("{{ 1 + 'a' }}").starts_with("ERROR: unsupported operand type(s) for +"));
  CHECK(render("{{ x | from_json }}").find("No filter named 'from_json'") != std::string::npos);
  CHECK(render("{{ x is frobbed }}").find("No test named 'frobbed'") != std::string::npos);
  CHECK(render("{% if x %}unclosed").starts_with("PARSE: "));
  CHECK(render("{% frobnicate %}").find("unknown tag 'frobnicate'") != std::string::npos);
  CHECK(render("{{ 'unterminated }}").starts_with("PARSE: "));
  CHECK(render("{{ (1, 2 }}").starts_with("PARSE: "));
  CHECK(render("{% for x in y %}{% endif %}").starts_with("PARSE: "));
  CHECK(render("{% break %}").starts_with("PARSE: "));
  CHECK(render("{{ 1/0 }}") == "ERROR: division by zero");
  CHECK(render("{{ foo() }}") == "ERROR: 'foo' is undefined");
  auto bad_context = jinja::Template::parse("{{ x }}");
  REQUIRE(bad_context.ok());
  CHECK(bad_context->render(nlohmann::ordered_json::array(), 0).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("jinja bounds depth, loops and output", "[chat]") {
  std::string deep;
  for (int i = 0; i < 5000; ++i) deep += "(";
  CHECK(render("{{ " + deep + " }}").starts_with("PARSE: "));
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += "{% if true %}";
  CHECK(render(nested).starts_with("PARSE: "));
  CHECK(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("nest") != std::string::npos);
  CHECK(render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").find("limit") !=
        std::string::npos);
  CHECK(render("{% set s = 'x' * 1000000 %}{% for i in range(1000) %}{{ s }}{% endfor %}").find("output limit") !=
        std::string::npos);
  CHECK(render("{{ 'x' * 100000000000 }}").find("limit") != std::string::npos);
}

TEST_CASE("the jinja parser survives random templates", "[chat]") {
  // Pieces of template syntax in random order: every result is a rendering or an error.
  const char* pieces[] = {"{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " if ", " for ", " in ", " endif ", " endfor ",
                          " set ", "=", "x", "'s'", "\"t\"", "(", ")", "[", "]", "{", "}", "|", " is ", "defined",
                          "1", "2.5", ",", ":", ".", "~", "*", "not", " else ", "\n", " ", "macro", "endmacro",
                          "loop.index", "raw", "endraw", "\\", "%", "**", "//", "messages[0]", "tojson"};
  uint64_t state = 12345;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string src;
    const int n = 1 + static_cast<int>((state >> 33) % 24);
    for (int k = 0; k < n; ++k) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      src += pieces[(state >> 33) % std::size(pieces)];
    }
    INFO(src);
    const std::string r = render(src, R"({"x": [1, 2], "messages": [{"role": "user"}]})");
    CHECK(r.size() < (1u << 20));
  }
}
