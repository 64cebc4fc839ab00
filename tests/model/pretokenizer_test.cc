// The pre-tokenizers: every value llama.cpp knows compiles and cuts text into words that cover it;
// the hand-written matchers cut exactly as their expressions do through PCRE2; matching stays
// bounded on long and adversarial input. (Their tokenizations against the reference tokenizers
// are tokenizer_test's vectors.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "combs/model/pretokenizer.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

void append_utf8(uint32_t cp, std::string& s) {
  if (cp < 0x80) s += static_cast<char>(cp);
  else if (cp < 0x800) s += {char(0xc0 | (cp >> 6)), char(0x80 | (cp & 0x3f))};
  else if (cp < 0x10000) s += {char(0xe0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3f)), char(0x80 | (cp & 0x3f))};
  else s += {char(0xf0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3f)), char(0x80 | ((cp >> 6) & 0x3f)), char(0x80 | (cp & 0x3f))};
}

// Text that exercises every branch of the expressions: contractions in both cases, letters,
// marks, digits of several scripts, runs of spaces, tabs and newlines, non-ASCII spaces,
// punctuation and symbols, CJK, emoji; now and then an invalid byte.
std::string random_text(Rng& rng, int len) {
  static const char* kPieces[] = {"'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "'x", "'",
                                  " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\t \n ", "\r"};
  static const std::pair<uint32_t, uint32_t> kRanges[] = {
      {'a', 'z'}, {'A', 'Z'}, {'0', '9'}, {'!', '/'}, {':', '@'}, {'[', '`'}, {'{', '~'},
      {0xa0, 0xff},    // Latin-1: NBSP, symbols, letters
      {0x300, 0x36f},  // combining marks
      {0x391, 0x3c9}, {0x400, 0x45f}, {0x5d0, 0x5ea}, {0x620, 0x64a}, {0x660, 0x669},  // Arabic-Indic digits
      {0x900, 0x97f}, {0x2000, 0x200a}, {0x2028, 0x2029}, {0x2010, 0x2027}, {0x2070, 0x2079},  // superscripts
      {0x2160, 0x2188},  // Roman numerals (Nl)
      {0x3000, 0x3003}, {0x3040, 0x30ff}, {0x4e00, 0x4e80}, {0xac00, 0xac40}, {0xff01, 0xff5e}, {0x1f600, 0x1f64f}};
  std::string s;
  for (int i = 0; i < len; ++i) {
    const int kind = static_cast<int>(rng.integer(0, 9));
    if (kind < 3) {
      s += kPieces[rng.integer(0, std::size(kPieces) - 1)];
    } else if (kind == 9 && rng.integer(0, 9) == 0) {
      s += static_cast<char>(0xff);  // invalid
    } else {
      const auto& r = kRanges[rng.integer(0, std::size(kRanges) - 1)];
      append_utf8(static_cast<uint32_t>(rng.integer(r.first, r.second)), s);
    }
  }
  return s;
}

std::vector<std::string> words(const PreTokenizer& p, const std::string& text) {
  std::vector<PreTokenizer::Word> w;
  p.split(text, w);
  std::vector<std::string> out;
  uint32_t at = 0;
  bool tiled = true;  // in order, no gaps, nothing empty
  for (const auto& x : w) {
    tiled = tiled && x.begin == at && x.end > x.begin;
    out.push_back(text.substr(x.begin, x.end - x.begin));
    at = x.end;
  }
  REQUIRE(tiled);
  REQUIRE(at == text.size());
  return out;
}

}  // namespace

TEST_CASE("every pre-tokenizer llama.cpp knows compiles and covers its text", "[tokenizer]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const auto known = PreTokenizer::known();
  for (const char* n : {"default", "llama-bpe", "qwen2", "qwen35", "gemma4", "deepseek-v3", "gpt-4o", "kimi-k2"}) {
    CHECK(std::find(known.begin(), known.end(), n) != known.end());
  }
  for (std::string_view name : known) {
    INFO(name);
    auto p = PreTokenizer::create(name, PreTokenizer::Matcher::kRegex);
    REQUIRE(p.ok());
    CHECK((*p)->name() == name);
    for (int trial = 0; trial < 20; ++trial) words(**p, random_text(rng, 40));
  }
  auto bad = PreTokenizer::create("no-such-pre");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("no-such-pre") && Catch::Contains("qwen35"));
}

TEST_CASE("hand-written pre-tokenizers cut exactly as their expressions", "[tokenizer]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (const char* name : {"gpt-2", "llama-bpe", "qwen2"}) {
    auto fast = PreTokenizer::create(name);
    auto slow = PreTokenizer::create(name, PreTokenizer::Matcher::kRegex);
    REQUIRE(fast.ok());
    REQUIRE(slow.ok());
    for (int trial = 0; trial < 20000; ++trial) {
      const std::string text = random_text(rng, static_cast<int>(rng.integer(0, 60)));
      INFO(name << " trial " << trial << ": '" << text << "'");
      REQUIRE(words(**fast, text) == words(**slow, text));
    }
  }
}

TEST_CASE("known cuts of the expressions", "[tokenizer]") {
  auto cut = [](const char* pre, const std::string& text) {
    auto p = PreTokenizer::create(pre, PreTokenizer::Matcher::kRegex);
    REQUIRE(p.ok());
    return words(**p, text);
  };
  using V = std::vector<std::string>;
  CHECK(cut("gpt-2", "Hello world's  end  ") == V{"Hello", " world", "'s", " ", " end", "  "});
  CHECK(cut("llama-bpe", "12345 I'M\n\n  x") == V{"123", "45", " I", "'M", "\n\n", " ", " x"});
  CHECK(cut("qwen2", "12 ab") == V{"1", "2", " ab"});
  CHECK(cut("superbpe", "1234567") == V{"1", "234", "567"});           // groups of three from the right
  CHECK(cut("afmoe", "1234567 x") == V{"1", "234", "567", " x"});      // the remainder first
  CHECK(cut("gemma4", "a b\n\nc") == V{"a b", "\n\n", "c"});
  CHECK(cut("whitespace", "ab  c") == V{"ab", "  ", "c"});
  CHECK(cut("deepseek-llm", "ab\ncd") == V{"ab", "\n", "cd"});
  CHECK(cut("llama-bpe", "a\xff" "b") == V{"a", "\xff", "b"});         // an invalid byte: a word of its own
}

TEST_CASE("pre-tokenizers stay bounded on long and adversarial text", "[tokenizer]") {
  const std::string cases[] = {std::string(1 << 20, ' '), std::string(1 << 20, 'a'), std::string(1 << 20, '1'),
                               std::string(300000, '\n') + "x", [] {
                                 std::string s;
                                 for (int i = 0; i < 100000; ++i) s += "\xe3\x80\x80\t'";  // U+3000, tab, quote
                                 return s;
                               }()};
  for (const char* name : {"default", "deepseek-llm", "jais-2", "gpt-4o", "kimi-k2", "bailingmoe", "exaone-moe",
                           "tekken", "superbpe", "chameleon"}) {
    auto p = PreTokenizer::create(name);
    REQUIRE(p.ok());
    for (const std::string& text : cases) {
      INFO(name << " on " << text.size() << " bytes");
      words(**p, text);  // covers the text, in order (a limit hit leaves a word uncut, never a gap)
    }
  }
}

TEST_CASE("the gpt-4o pre-tokenizer (gpt-oss) cuts as o200k's published expression does", "[tokenizer]") {
  // tests/data/vocab/gpt-4o.words.jsonl (tests/reference/pretokenize_gpt4o.py): the words Python's
  // regex module finds with the expression of o200k's tokenizer.json, on llama.cpp's tokenizer
  // test texts and gpt-oss's Harmony markup.
  std::ifstream in(std::string(COMBS_TEST_DATA_DIR) + "/vocab/gpt-4o.words.jsonl");
  REQUIRE(in.good());
  auto fast = PreTokenizer::create("gpt-4o");
  auto regex = PreTokenizer::create("gpt-4o", PreTokenizer::Matcher::kRegex);
  REQUIRE(fast.ok());
  REQUIRE(regex.ok());
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string text = j.at("text");
    const std::vector<std::string> want = j.at("words");
    INFO("'" << text << "'");
    CHECK(words(**fast, text) == want);
    CHECK(words(**regex, text) == want);
    ++cases;
  }
  CHECK(cases >= 60);
}
