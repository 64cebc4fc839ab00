// How a byte-level BPE vocabulary cuts text into words before its merges run: one
// `tokenizer.ggml.pre` value, as llama.cpp reads it (llama-vocab.cpp), is a list of regular
// expressions applied in turn — each one cuts every word of the step before into its matches and
// the text between them. The expressions run through PCRE2 (JIT, Unicode properties); the three
// most common lists (gpt-2, llama3, qwen2) also have hand-written matchers, used because they are
// faster, and tested to cut exactly as the expressions do.
//
// A byte that is not part of valid UTF-8 is a word of its own and cuts the text as its end would
// (no expression sees it). Matching is bounded: an expression that exceeds PCRE2's limits on some
// input leaves the rest of that word uncut rather than failing.
//
// Immutable after construction; split() is safe from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "combs/base/status.h"

namespace combs {

class PreTokenizer {
 public:
  struct Word {
    uint32_t begin, end;  // bytes of the text, end exclusive
  };
  enum class Matcher : uint8_t { kHandWritten, kRegex };  // kRegex: the expressions even where a
                                                          // hand-written matcher exists (tests)

  // INVALID_ARGUMENT for a value llama.cpp does not know (the message lists those that are).
  static StatusOr<std::unique_ptr<PreTokenizer>> create(std::string_view pre,
                                                         Matcher matcher = Matcher::kHandWritten);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Appends the words of `text` (non-empty, in order, covering every byte) to `words`.
  void split(std::string_view text, std::vector<Word>& words) const;

  const std::string& name() const { return name_; }
  // What the value implies besides its expressions (llama.cpp's flags for it):
  bool ignore_merges() const { return ignore_merges_; }   // a word that is a token is that token
  bool adds_bos() const { return adds_bos_; }             // add_bos when the file does not say
  bool forces_bos() const { return forces_bos_; }         // add_bos even where the file says no
  bool byte_level() const { return byte_level_; }         // GPT-2's byte-to-symbol alphabet
  bool escapes_spaces() const { return escapes_spaces_; } // ' ' becomes U+2581 before the split
  bool newline_runs_are_tokens() const { return newline_tokens_; }  // "\n\n" is looked up whole

  static std::vector<std::string_view> known();  // every value create() accepts

 private:
  struct Regex;
  enum class Fast : uint8_t { kNone, kGpt2, kLlama3, kQwen2 };
  PreTokenizer() = default;

  std::string name_;
  std::vector<std::unique_ptr<Regex>> regexes_;
  Fast fast_ = Fast::kNone;
  bool ignore_merges_ = false, adds_bos_ = false, byte_level_ = true, escapes_spaces_ = false, newline_tokens_ = false,
       forces_bos_ = false;
};

}  // namespace combs
