// The tokenizer against the real vocabularies' expected tokenizations (tests/data/vocab, from the
// reference tokenizers), round trips, streaming detokenization and bad metadata.
#include <catch2/catch.hpp>

#include <filesystem>
#include <sstream>

#include "combs/model/gguf.h"
#include "combs/model/tokenizer.h"
#include "support/random.h"
#include "support/temp_dir.h"

using namespace combs;
using namespace combs::testing;

namespace {

// Every vocabulary of llama.cpp's tokenizer tests that combs reads (tests/data/vocab/README.md).
const char* kVocabs[] = {"ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-gpt-2.gguf",
                         "ggml-vocab-qwen2.gguf", "ggml-vocab-phi-3.gguf", "ggml-vocab-qwen35.gguf",
                         "ggml-vocab-gemma-4.gguf", "ggml-vocab-deepseek-llm.gguf", "ggml-vocab-deepseek-coder.gguf",
                         "ggml-vocab-starcoder.gguf", "ggml-vocab-falcon.gguf", "ggml-vocab-command-r.gguf",
                         "ggml-vocab-mpt.gguf", "ggml-vocab-refact.gguf"};

// The vocabularies the tools use lie in tests/data/vocab; the others are unpacked from
// more-vocabs.tar.xz into the build tree. The .inp/.out files are all in tests/data/vocab.
std::string data(const std::string& name) {
  const std::string here = std::string(COMBS_TEST_DATA_DIR) + "/vocab/" + name;
  if (name.ends_with(".inp") || name.ends_with(".out") || std::filesystem::exists(here)) return here;
  return std::string(COMBS_MORE_VOCAB_DIR) + "/" + name;
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
};

// Cases are separated by "\n__ggml_vocab_test__\n" (the last one may end without it, as
// llama.cpp's test-tokenizer-0 reads them); the .out file has one line of ids per case.
std::vector<Case> load_cases(const std::string& vocab) {
  const std::string inp = read_file(data(vocab + ".inp")), out = read_file(data(vocab + ".out"));
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<Case> cases;
  for (size_t pos = 0; pos < inp.size();) {
    const size_t end = inp.find(sep, pos);
    cases.push_back({inp.substr(pos, end == std::string::npos ? std::string::npos : end - pos), {}});
    if (end == std::string::npos) break;
    pos = end + sep.size();
  }
  std::istringstream lines(out);
  std::string line;
  for (Case& c : cases) {
    REQUIRE(std::getline(lines, line));
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
  }
  REQUIRE_FALSE(std::getline(lines, line));  // as many cases as lines of ids
  return cases;
}

struct Loaded {
  std::unique_ptr<gguf::GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
};
Loaded load(const std::string& vocab) {
  Loaded l;
  l.file = std::move(gguf::GgufFile::open(data(vocab))).value();
  auto t = Tokenizer::from_gguf(*l.file);
  INFO(vocab << ": " << t.status().to_string());
  REQUIRE(t.ok());
  l.tok = std::move(t).value();
  return l;
}

std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  StreamDecoder d(tok);
  std::string out;
  for (int32_t id : ids) out += d.push(id);
  return out + d.finish();
}

}  // namespace

TEST_CASE("every vocab test case tokenizes to the reference ids", "[tokenizer]") {
  for (const char* vocab : kVocabs) {
    Loaded l = load(vocab);
    const auto cases = load_cases(vocab);
    REQUIRE(cases.size() >= 46);
    for (size_t i = 0; i < cases.size(); ++i) {
      INFO(vocab << " case " << i << ": '" << cases[i].text << "'");
      CHECK(l.tok->encode(cases[i].text, {false, false}) == cases[i].ids);
    }
  }
}

TEST_CASE("decoding gives the text back and streaming equals whole decoding", "[tokenizer]") {
  for (const char* vocab : kVocabs) {
    Loaded l = load(vocab);
    for (const Case& c : load_cases(vocab)) {
      INFO(vocab << ": '" << c.text << "'");
      CHECK(l.tok->decode(c.ids) == c.text);
      CHECK(stream_decode(*l.tok, c.ids) == l.tok->decode(c.ids));
      // Streaming never emits a broken multi-byte character before its end.
      StreamDecoder d(*l.tok);
      for (int32_t id : c.ids) {
        const std::string part = d.push(id);
        if (!part.empty()) {
          const auto last = static_cast<uint8_t>(part.back());
          CHECK((last < 0x80 || (last & 0xc0) == 0x80));
        }
      }
    }
  }
}

TEST_CASE("random unicode and invalid utf-8 round trip", "[tokenizer]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const std::pair<uint32_t, uint32_t> ranges[] = {
      {0x20, 0x7e}, {0x09, 0x0d}, {0xa0, 0x24f}, {0x300, 0x36f}, {0x391, 0x3c9}, {0x400, 0x4ff},
      {0x600, 0x6ff}, {0x900, 0x97f}, {0x3040, 0x30ff}, {0x4e00, 0x9fff}, {0xac00, 0xd7a3},
      {0x1f300, 0x1f64f}, {0x2000, 0x206f}, {0x10000, 0x1007f}};
  for (const char* vocab : kVocabs) {
    Loaded l = load(vocab);
    for (int trial = 0; trial < 60; ++trial) {
      std::string s;
      const int len = static_cast<int>(rng.integer(0, 40));
      for (int i = 0; i < len; ++i) {
        const auto& r = ranges[rng.integer(0, std::size(ranges) - 1)];
        uint32_t cp = static_cast<uint32_t>(rng.integer(r.first, r.second));
        if (cp < 0x80) s += static_cast<char>(cp);
        else if (cp < 0x800) s += {char(0xc0 | (cp >> 6)), char(0x80 | (cp & 0x3f))};
        else if (cp < 0x10000) s += {char(0xe0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3f)), char(0x80 | (cp & 0x3f))};
        else s += {char(0xf0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3f)), char(0x80 | ((cp >> 6) & 0x3f)), char(0x80 | (cp & 0x3f))};
      }
      if (trial % 5 == 4 && !s.empty()) s.insert(rng.integer(0, s.size() - 1), 1, char(0xff));  // invalid
      if (trial % 7 == 6) s += char(0xe2);  // a truncated character at the end
      INFO(vocab << " trial " << trial);
      const auto ids = l.tok->encode(s, {false, false});
      for (int32_t id : ids) REQUIRE((id >= 0 && id < l.tok->n_vocab()));
      CHECK(stream_decode(*l.tok, ids) == l.tok->decode(ids));
      if (l.tok->has_every_byte()) CHECK(l.tok->decode(ids) == s);
    }
  }
}

TEST_CASE("special tokens come from text only when asked and bos follows the metadata", "[tokenizer]") {
  Loaded spm = load("ggml-vocab-llama-spm.gguf");
  CHECK(spm.tok->add_bos());
  CHECK(spm.tok->encode("Hello").front() == spm.tok->bos_id());
  const auto plain = spm.tok->encode("<s>", {false, false});
  CHECK(std::find(plain.begin(), plain.end(), 1) == plain.end());
  CHECK(spm.tok->encode("<s>", {false, true}) == std::vector<int32_t>{1});
  Loaded bpe = load("ggml-vocab-llama-bpe.gguf");
  const auto text = bpe.tok->encode("<|begin_of_text|>hi", {false, false});
  CHECK(std::find(text.begin(), text.end(), 128000) == text.end());
  const auto parsed = bpe.tok->encode("<|begin_of_text|>hi", {false, true});
  REQUIRE(parsed.size() >= 2);
  CHECK(parsed[0] == 128000);
  CHECK(bpe.tok->decode(parsed) == "hi");
  CHECK(bpe.tok->decode(parsed, true) == "<|begin_of_text|>hi");
}

TEST_CASE("inconsistent tokenizer metadata is a clear error", "[tokenizer]") {
  TempDir dir;
  using gguf::Value;
  using gguf::ValueType;
  auto base = [] {
    gguf::GgufWriter w;
    w.set("tokenizer.ggml.model", Value::str("llama"));
    w.set("tokenizer.ggml.tokens", Value::array(ValueType::kString, {Value::str("a"), Value::str("b")}));
    w.set("tokenizer.ggml.scores", Value::array(ValueType::kF32, {Value::f32(0), Value::f32(0)}));
    return w;
  };
  auto check = [&](gguf::GgufWriter w, const char* key) {
    const std::string path = dir.file("v.gguf");
    REQUIRE(w.write(path).ok());
    auto f = std::move(gguf::GgufFile::open(path)).value();
    const Status s = Tokenizer::from_gguf(*f).status();
    INFO(s.to_string());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(key));
  };
  {
    auto w = base();
    REQUIRE(w.write(dir.file("ok.gguf")).ok());
    auto f = std::move(gguf::GgufFile::open(dir.file("ok.gguf"))).value();
    CHECK(Tokenizer::from_gguf(*f).ok() == false);  // add_bos defaults on, but there is no bos id
  }
  auto w = base();
  w.set("tokenizer.ggml.scores", Value::array(ValueType::kF32, {Value::f32(0)}));
  check(w, "tokenizer.ggml.scores");
  w = base();
  w.set("tokenizer.ggml.model", Value::str("wordpiece"));
  check(w, "tokenizer.ggml.model");
  w = base();
  w.set("tokenizer.ggml.bos_token_id", Value::u32(7));
  check(w, "tokenizer.ggml.bos_token_id");
  w = base();
  w.set("tokenizer.ggml.token_type", Value::array(ValueType::kI32, {Value::i32(1), Value::i32(9)}));
  check(w, "tokenizer.ggml.token_type");
  w = base();
  w.set("tokenizer.ggml.model", Value::str("gpt2"));
  w.set("tokenizer.ggml.merges", Value::array(ValueType::kString, {Value::str("ab")}));
  check(w, "tokenizer.ggml.merges");
  w = base();
  w.set("tokenizer.ggml.model", Value::str("gpt2"));
  w.set("tokenizer.ggml.pre", Value::str("mystery"));
  check(w, "tokenizer.ggml.pre");
  gguf::GgufWriter none;
  none.set("general.architecture", Value::str("llama"));
  check(none, "tokenizer.ggml.model");
}

TEST_CASE("to_valid_utf8 keeps valid characters and replaces stray bytes", "[tokenizer]") {
  CHECK(to_valid_utf8("caf\xc3\xa9 \xf0\x9f\xa6\x99") == "caf\xc3\xa9 \xf0\x9f\xa6\x99");
  CHECK(to_valid_utf8("a\xff" "b") == "a\xef\xbf\xbd" "b");
  CHECK(to_valid_utf8("\xe2\x96") == "\xef\xbf\xbd\xef\xbf\xbd");  // a truncated character
  CHECK(to_valid_utf8("\xc0\x80") == "\xef\xbf\xbd\xef\xbf\xbd");  // overlong
}

TEST_CASE("which vocabularies give every byte a token", "[tokenizer]") {
  // The random round trip above is exact only for these (has_every_byte): make sure it is checked.
  for (const char* vocab : kVocabs) {
    Loaded l = load(vocab);
    const std::string v = vocab;
    const bool full = !(v.find("falcon") != v.npos || v.find("deepseek") != v.npos || v.find("mpt") != v.npos ||
                        v.find("refact") != v.npos || v.find("starcoder") != v.npos);
    INFO(vocab);
    CHECK(l.tok->has_every_byte() == full);
  }
}

TEST_CASE("the end-of-generation set is llama.cpp's", "[tokenizer]") {
  // llama.cpp's sets (its load log, "printing all EOG tokens", of llama-tokenize from the
  // node-llama-cpp 3.22.1 bundle on these files; for gemma-4 the log lists 212 '</s>' too, then
  // removes it: "special_eog_ids contains '<|tool_response>', removing '</s>' token").
  const std::pair<const char*, std::vector<int32_t>> expected[] = {
      {"ggml-vocab-command-r.gguf", {0, 255001}},      {"ggml-vocab-deepseek-coder.gguf", {32014}},
      {"ggml-vocab-deepseek-llm.gguf", {100001}},      {"ggml-vocab-falcon.gguf", {11}},
      {"ggml-vocab-gemma-4.gguf", {1, 50, 106}},      {"ggml-vocab-mpt.gguf", {0}},
      {"ggml-vocab-phi-3.gguf", {2, 32000, 32007}},    {"ggml-vocab-qwen2.gguf", {128247, 151643, 151645}},
      {"ggml-vocab-qwen35.gguf", {128247, 151643, 151645}}, {"ggml-vocab-refact.gguf", {0, 4, 18}},
      {"ggml-vocab-starcoder.gguf", {0, 4}},           {"ggml-vocab-gpt-2.gguf", {50256}},
      {"ggml-vocab-llama-bpe.gguf", {128001, 128009}}, {"ggml-vocab-llama-spm.gguf", {2}}};
  for (const auto& [vocab, ids] : expected) {
    Loaded l = load(vocab);
    INFO(vocab);
    CHECK(l.tok->end_of_generation() == ids);
    for (int32_t id : ids) {
      CHECK(l.tok->is_end_of_generation(id));
      CHECK(l.tok->token_type(id) == TokenType::kControl);  // rendered only with render_special
    }
    CHECK_FALSE(l.tok->is_end_of_generation(l.tok->n_vocab() / 2 + 1));
  }
  Loaded llama3 = load("ggml-vocab-llama-bpe.gguf");
  CHECK(llama3.tok->eot_id() == 128009);  // <|eot_id|>
}
