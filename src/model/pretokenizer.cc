#include "combs/model/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <initializer_list>

#include "unicode.h"

namespace combs {
namespace {

// ---- llama.cpp's table: tokenizer.ggml.pre values -> expressions and flags ----
// The expressions are the tokenizers' own (their tokenizer.json, as llama-vocab.cpp quotes them;
// characters beyond ASCII written as \x{...}, so no editor's normalization can change them);
// where llama.cpp rewrote one for std::regex (no \p{Lu}, no (?i:), no possessive quantifiers,
// no class intersection), the original runs here, since PCRE2 has them all. (?i:'s|...) is
// spelled '[sS]|... as llama.cpp does: PCRE2's caseless match would also fold U+017F to 's'.

#define CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
// GPT-2's expression. llama.cpp lists it without the last |\s+: what that would match (one
// whitespace character before a non-space) is left between matches, a word all the same.
constexpr const char* kGpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3 = CONTRACTIONS
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 = CONTRACTIONS
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
#define CASED_WORDS(NUM)                                                                          \
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+" CONTRACTIONS \
  "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" CONTRACTIONS \
  "?|" NUM "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
constexpr const char* kDeepseek3Words =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLines = "[^\\n]+|[\\n]+";

enum Flag : uint8_t {
  kIgnoreMerges = 1, kAddsBos = 2, kRawUtf8 = 4, kEscapesSpaces = 8, kNewlineTokens = 16, kForcesBos = 32,
};

struct Spec {
  std::initializer_list<const char*> names;
  std::initializer_list<const char*> regexes;
  uint8_t flags = 0;
};

const Spec kSpecs[] = {
    {{"default"},
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"},
     {kLlama3}, kIgnoreMerges | kAddsBos},
    {{"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"}, {kLlama3}},
    {{"jais-2"},
     {CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                   "\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|"
                   "\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"}},
    {{"deepseek-llm"},
     {"[\r\n]",
      "\\s?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}\\x{1E900}-\\x{1E943}]+",
      "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}]+", "\\s+$", "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+", "\\p{N}+"}},
    {{"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"},
     {"\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+", kDeepseek3Words}},
    {{"spark2_5"},
     {"\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
      " ?[\\p{P}\\p{S}]+|[\\r\\n]|\\s+(?!\\S)|\\s+",
      "\\p{N}"}},
    {{"youtu"},
     {"[\\x{AC00}-\\x{D7A3}\\x{3131}-\\x{318E}]+|[\\x{FF01}\\x{2026}\\x{201C}\\x{201D}\\x{2018}\\x{2019}\\x{2014}\\x{FF1A}\\x{FF1B}\\x{FF0C}\\x{3001}-\\x{303F}\\x{FE30}-\\x{FE4F}]+|[\\x{3105}-\\x{312F}]+|[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+", CASED_WORDS("\\p{N}")},
     kIgnoreMerges},
    {{"deepseek-coder"}, {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+", "\\p{N}"}},
    {{"falcon"}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", kGpt2, "[0-9][0-9][0-9]"}},
    {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"},
     {"\\p{N}", kGpt2}},
    {{"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-v1-en", "jina-v2-code",
      "roberta-bpe"},
     {kGpt2}},
    {{"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"}, {kQwen2}},
    {{"qwen35"},
     {CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                   "\\s+(?!\\S)|\\s+"}},
    {{"poro-chat", "bloom", "gpt3-finnish"}, {" ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+"}},
    {{"viking"}, {" ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+", "\\p{N}"}},
    {{"tekken"},
     {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
      "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
      " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     kIgnoreMerges | kAddsBos},
    {{"chameleon"},
     {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
      "[\\p{P}!-/:-@\\[-`{-~]", kGpt2},
     kAddsBos},
    {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {CASED_WORDS("\\p{N}{1,3}")}},
    {{"granite-embed-multi-97m"},
     {"[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+" CONTRACTIONS
      "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*" CONTRACTIONS
      "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     kIgnoreMerges},
    {{"tiny_aya", "cohere2moe"}, {"\\d{1,3}(?=(?:\\d{3})*\\b)", CASED_WORDS("\\p{N}{1,3}")}},
    {{"kimi-k2"},
     {"[\\p{Han}]+|[^\\r\\n\\p{L}\\p{N}]?(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])*"
      "(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])+" CONTRACTIONS
      "?|[^\\r\\n\\p{L}\\p{N}]?(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])+"
      "(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])*" CONTRACTIONS
      "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"superbpe"}, {"\\p{N}+", "(?=(\\d{3})+(?!\\d))"}},
    {{"bailingmoe", "bailingmoe2", "llada-moe"},
     {"'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*|\\s*[\\r\\n]|"
      "\\s+(?!\\S)|\\s+"}},
    {{"seed-coder"},
     {CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"ufakzeka"}, {"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"grok-2"}, {kQwen2}},
    // llama.cpp's copy of AFMoE's CJK class starts its compatibility range at U+8C48 (U+F900 after
    // Unicode normalization of its source): U+F900 here, as the tokenizer publishes it.
    {{"afmoe"},
     {"\\p{N}{1,3}(?=(?:\\p{N}{3})*(?!\\p{N}))",  // llama.cpp's AFMoE digits: the run's remainder mod 3 first
      "[\\x{4E00}-\\x{9FFF}\\x{3400}-\\x{4DBF}\\x{F900}-\\x{FAFF}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}\\x{FF65}-\\x{FF9F}\\x{2F00}-\\x{2FDF}\\x{E40}-\\x{E7F}\\x{E80}-\\x{EFF}\\x{1780}-\\x{17FF}\\x{1000}-\\x{109F}\\x{AA60}-\\x{AA7F}\\x{A9E0}-\\x{A9FF}\\x{AC00}-\\x{D7AF}\\x{1100}-\\x{11FF}]+", kDeepseek3Words}},
    {{"laguna"}, {kLines, kQwen2}},
    {{"exaone-moe"},
     {CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|"
                   "\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"}},
    // SentencePiece-style BPE over raw UTF-8: spaces are U+2581 first, only newlines cut.
    // llama.cpp's Gemma 4 workarounds: runs of newlines looked up whole, BOS whatever the file says
    // (its PRs 21343 and 21500).
    {{"gemma4", "granite-embed-multi-311m"}, {kLines}, kRawUtf8 | kEscapesSpaces | kNewlineTokens | kForcesBos},
    {{"sarvam-moe"}, {kLines}, kRawUtf8 | kEscapesSpaces},
    // jina-embeddings-v2-base-zh's: whole runs of non-space over raw UTF-8 (its "whitespace"
    // tokenizer model, which also drops the spaces, is not served here).
    {{"whitespace"}, {"\\S+"}, kRawUtf8},
    {{"minicpm5"},
     {"\\p{N}{1,3}",
      CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     kIgnoreMerges},
};

const Spec* find_spec(std::string_view pre) {
  for (const Spec& s : kSpecs)
    for (const char* n : s.names)
      if (pre == n) return &s;
  return nullptr;
}

// ---- Hand-written matchers: the end (exclusive) of the word that starts at character i ----

using unicode::Char;

struct Chars {  // an invalid byte is no character, as the end of the text
  const Char* c;
  size_t count;
  bool in(size_t j) const { return j < count && c[j].valid; }
  bool is(size_t j, uint32_t cp) const { return in(j) && c[j].cp == cp; }
  bool L(size_t j) const { return in(j) && unicode::is_letter(c[j]); }
  bool N(size_t j) const { return in(j) && unicode::is_number(c[j]); }
  bool S(size_t j) const { return in(j) && unicode::is_space(c[j]); }
  bool O(size_t j) const { return in(j) && !L(j) && !N(j) && !S(j); }  // [^\s\p{L}\p{N}]
  bool nl(size_t j) const { return is(j, '\r') || is(j, '\n'); }
  size_t run(size_t j, bool (Chars::*pred)(size_t) const) const {
    while ((this->*pred)(j)) ++j;
    return j;
  }
  // 's 't 're 've 'm 'll 'd (ASCII case-insensitive when asked): the end, or 0.
  size_t contraction(size_t i, bool any_case) const {
    if (!is(i, '\'')) return 0;
    auto ch = [&](size_t j, char want) {
      const uint32_t cp = in(j) && c[j].cp < 0x80 ? c[j].cp : 0;
      return any_case ? (cp | 0x20) == static_cast<uint32_t>(want) : cp == static_cast<uint32_t>(want);
    };
    if (ch(i + 1, 'r') && ch(i + 2, 'e')) return i + 3;
    if (ch(i + 1, 'v') && ch(i + 2, 'e')) return i + 3;
    if (ch(i + 1, 'l') && ch(i + 2, 'l')) return i + 3;
    for (char k : {'s', 't', 'm', 'd'})
      if (ch(i + 1, k)) return i + 2;
    return 0;
  }
  // \s+(?!\S) then \s+
  size_t trailing_space(size_t i) const {
    const size_t e = run(i, &Chars::S);
    if (!in(e) || e - i < 2) return e;  // \s+ alone when (?!\S) cannot hold
    return e - 1;
  }
};

// kGpt2
size_t match_gpt2(const Chars& x, size_t i) {
  if (size_t e = x.contraction(i, false)) return e;
  const size_t j = x.is(i, ' ') ? i + 1 : i;
  if (x.L(j)) return x.run(j, &Chars::L);
  if (x.N(j)) return x.run(j, &Chars::N);
  if (x.O(j)) return x.run(j, &Chars::O);
  if (x.S(i)) return x.trailing_space(i);
  return i + 1;
}

// kLlama3 (max_digits 3) and kQwen2 (max_digits 1)
size_t match_llama3(const Chars& x, size_t i, size_t max_digits) {
  if (size_t e = x.contraction(i, true)) return e;
  if (x.L(i)) return x.run(i, &Chars::L);
  if (x.in(i) && !x.nl(i) && !x.N(i) && x.L(i + 1)) return x.run(i + 1, &Chars::L);
  if (x.N(i)) {
    size_t e = i;
    while (e - i < max_digits && x.N(e)) ++e;
    return e;
  }
  const size_t j = x.is(i, ' ') && x.O(i + 1) ? i + 1 : i;
  if (x.O(j)) {
    size_t e = x.run(j, &Chars::O);
    while (x.nl(e)) ++e;
    return e;
  }
  if (x.S(i)) {
    const size_t e = x.run(i, &Chars::S);
    for (size_t k = e; k > i; --k) {
      if (x.nl(k - 1)) return k;  // \s*[\r\n]+ ends after the run's last newline
    }
    return x.trailing_space(i);
  }
  return i + 1;
}

}  // namespace

// ---- PCRE2 ----

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  ~Regex() { pcre2_code_free(code); }
};

namespace {

// Per thread: match data, a JIT stack and the limits (a match context holds the stack, so it
// cannot be shared).
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 4 << 20, nullptr);
  MatchState() {
    pcre2_jit_stack_assign(context, nullptr, stack);
    pcre2_set_match_limit(context, 10'000'000);
    pcre2_set_depth_limit(context, 100'000);
    pcre2_set_heap_limit(context, 64 << 10);  // KiB
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

// Cuts the words [first, last) of `words` (offsets into text) by one expression into `out`.
void cut(pcre2_code* code, std::string_view text, const std::vector<PreTokenizer::Word>& words,
         std::vector<PreTokenizer::Word>& out) {
  MatchState& ms = match_state();
  const auto* base = reinterpret_cast<PCRE2_SPTR>(text.data());
  for (const PreTokenizer::Word& w : words) {
    const PCRE2_SPTR subject = base + w.begin;
    const size_t len = w.end - w.begin;
    size_t last = 0, at = 0;  // end of the last word cut; where the next search starts
    uint32_t options = 0;
    auto emit = [&](size_t b, size_t e) {
      if (e > b) out.push_back({static_cast<uint32_t>(w.begin + b), static_cast<uint32_t>(w.begin + e)});
    };
    while (at <= len) {
      const int rc = pcre2_match(code, subject, len, at, options | PCRE2_NO_UTF_CHECK, ms.data, ms.context);
      if (rc == PCRE2_ERROR_NOMATCH) {
        if (options == 0) break;
        // After an empty match: nothing non-empty here, so step one character on.
        options = 0;
        ++at;
        while (at < len && (subject[at] & 0xc0) == 0x80) ++at;
        continue;
      }
      if (rc < 0) break;  // a limit: the rest of the word stays as it is
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.data);
      emit(last, ov[0]);
      emit(ov[0], ov[1]);
      last = std::max<size_t>(last, ov[1]);
      at = ov[1];
      options = ov[0] == ov[1] ? (PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED) : 0;
    }
    emit(last, len);
  }
}

}  // namespace

PreTokenizer::~PreTokenizer() = default;

std::vector<std::string_view> PreTokenizer::known() {
  std::vector<std::string_view> out;
  for (const Spec& s : kSpecs) out.insert(out.end(), s.names.begin(), s.names.end());
  return out;
}

StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::create(std::string_view pre, Matcher matcher) {
  const Spec* spec = find_spec(pre);
  if (spec == nullptr) {
    std::string list;
    for (std::string_view n : known()) (list += list.empty() ? "" : ", ") += n;
    return invalid_argument_error("pre-tokenizer '" + std::string(pre) + "' is not supported (known: " + list + ")");
  }
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  p->name_ = pre;
  p->ignore_merges_ = spec->flags & kIgnoreMerges;
  p->adds_bos_ = spec->flags & kAddsBos;
  p->byte_level_ = !(spec->flags & kRawUtf8);
  p->escapes_spaces_ = spec->flags & kEscapesSpaces;
  p->newline_tokens_ = spec->flags & kNewlineTokens;
  p->forces_bos_ = spec->flags & kForcesBos;
  const std::vector<const char*> regexes(spec->regexes);
  if (matcher == Matcher::kHandWritten && regexes.size() == 1) {
    if (regexes[0] == kGpt2) p->fast_ = Fast::kGpt2;
    if (regexes[0] == kLlama3) p->fast_ = Fast::kLlama3;
    if (regexes[0] == kQwen2) p->fast_ = Fast::kQwen2;
  }
  if (p->fast_ != Fast::kNone) return p;
  for (const char* r : regexes) {
    int err = 0;
    PCRE2_SIZE at = 0;
    auto re = std::make_unique<Regex>();
    re->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(r), PCRE2_ZERO_TERMINATED,
                             PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY, &err, &at, nullptr);
    if (re->code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      return internal_error("pre-tokenizer '" + std::string(pre) + "': expression " + r + " at " +
                            std::to_string(at) + ": " + reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) it interprets
    p->regexes_.push_back(std::move(re));
  }
  return p;
}

void PreTokenizer::split(std::string_view text, std::vector<Word>& words) const {
  const auto chars = unicode::split_utf8(text);
  const size_t n = chars.size();
  if (fast_ != Fast::kNone) {  // the matchers see an invalid byte as the end of the text
    const Chars x{chars.data(), n};
    for (size_t i = 0; i < n;) {
      const size_t e = fast_ == Fast::kGpt2 ? match_gpt2(x, i) : match_llama3(x, i, fast_ == Fast::kQwen2 ? 1 : 3);
      words.push_back({chars[i].offset, e < n ? chars[e].offset : static_cast<uint32_t>(text.size())});
      i = e;
    }
    return;
  }
  std::vector<Word> cur, next;
  for (size_t k0 = 0; k0 < n;) {
    if (!chars[k0].valid) {  // an invalid byte: a word of its own
      words.push_back({chars[k0].offset, chars[k0].offset + 1u});
      ++k0;
      continue;
    }
    size_t k1 = k0;
    while (k1 < n && chars[k1].valid) ++k1;
    const uint32_t end = k1 < n ? chars[k1].offset : static_cast<uint32_t>(text.size());
    cur.assign(1, Word{chars[k0].offset, end});  // each expression cuts the words of the one before
    for (const auto& re : regexes_) {
      next.clear();
      cut(re->code, text, cur, next);
      cur.swap(next);
    }
    words.insert(words.end(), cur.begin(), cur.end());
    k0 = k1;
  }
}

}  // namespace combs
