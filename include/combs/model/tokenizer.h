// Tokenizer read from a GGUF's tokenizer.* metadata (works on vocab-only files).
//
// Models: `llama` — SentencePiece-style: scores drive merges, byte fallback to <0xNN> tokens, a
// space prefix, spaces as U+2581; `gpt2` — byte-level BPE with ranked merges, after the
// pre-tokenizer tokenizer.ggml.pre names (every value llama.cpp knows: pretokenizer.h);
// `gemma4` — BPE over raw UTF-8 with spaces as U+2581 and byte fallback to <0xNN> tokens.
//
// Text that spells a control token is not turned into it unless parse_special is set; user-defined
// tokens are split out of the text always, before the pre-tokenizer (as Hugging Face's added tokens). Invalid
// UTF-8 in the input is kept byte for byte: each invalid byte is a character of its own (no
// letter, digit or space), encoded through byte fallback (llama) or its byte-level symbol (gpt2),
// so decode(encode(text)) gives the same bytes back.
//
// Immutable after construction; encode/decode are safe from several threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "combs/base/status.h"
#include "combs/model/gguf.h"
#include "combs/model/pretokenizer.h"

namespace combs {

enum class TokenType : int32_t {  // llama.cpp's values
  kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6,
};

// Hashes std::string keys and std::string_view lookups alike (no temporary strings).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class Tokenizer {
 public:
  enum class Model : uint8_t { kSpm, kBpe };

  // INVALID_ARGUMENT naming the key when the metadata is missing or inconsistent.
  static StatusOr<std::unique_ptr<Tokenizer>> from_gguf(const gguf::GgufFile& file);

  struct EncodeOptions {
    bool add_special = true;     // BOS / EOS as the model's add_bos / add_eos flags say
    bool parse_special = false;  // turn spelled special tokens (control, user-defined) into them
  };
  std::vector<int32_t> encode(std::string_view text, EncodeOptions options) const;
  std::vector<int32_t> encode(std::string_view text) const { return encode(text, EncodeOptions{}); }

  // The bytes of the token ids, as one string (control tokens render as nothing unless
  // render_special; a llama model's space prefix is removed from the first piece).
  std::string decode(std::span<const int32_t> ids, bool render_special = false) const;
  // The bytes of one token (no prefix handling).
  std::string piece(int32_t id, bool render_special = false) const;

  int n_vocab() const { return static_cast<int>(tokens_.size()); }
  const std::string& token_text(int32_t id) const { return tokens_[id]; }
  TokenType token_type(int32_t id) const { return types_[id]; }
  int32_t bos_id() const { return bos_; }  // -1 when the model has none
  int32_t eos_id() const { return eos_; }
  int32_t eot_id() const { return eot_; }  // the file's, or found by its text (<|eot_id|>, <|im_end|>, ...)
  int32_t eom_id() const { return eom_; }
  // The tokens that end a generation by default, ascending: eos, eot, eom and the special tokens
  // that end a turn, as llama.cpp derives them from the vocabulary (find_end_of_generation).
  const std::vector<int32_t>& end_of_generation() const { return eog_; }
  bool is_end_of_generation(int32_t id) const;
  int32_t pad_id() const { return pad_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool strips_leading_space() const { return model_ == Model::kSpm && add_space_prefix_; }
  Model model() const { return model_; }
  // Every byte has a token of its own (byte fallback or byte-level symbol, not a user-defined
  // token): then decode(encode(text)) == text for any bytes. Falcon's vocabulary, for one, lacks
  // some control bytes; DeepSeek's has U+00FF only as a user-defined token.
  bool has_every_byte() const { return has_every_byte_; }
  const PreTokenizer* pre_tokenizer() const { return pre_.get(); }  // null for llama (SentencePiece)

 private:
  Tokenizer() = default;
  void encode_fragment(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void byte_fallback(std::string_view s, std::vector<int32_t>& out) const;
  int32_t find(std::string_view text) const;
  void find_end_of_generation();

  Model model_ = Model::kSpm;
  std::unique_ptr<PreTokenizer> pre_;
  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<TokenType> types_;
  StringMap index_;
  StringMap merge_rank_;  // "left right" -> rank
  std::vector<int32_t> byte_tokens_;                     // byte -> <0xNN> token (spm) or symbol token
  std::vector<bool> joins_;   // code point < 0x30000 appears in a multi-character token (spm)
  std::vector<std::pair<std::string, int32_t>> specials_;  // longest first
  std::array<std::vector<uint32_t>, 256> specials_by_byte_;  // indexes into specials_, by first byte
  int32_t bos_ = -1, eos_ = -1, eot_ = -1, eom_ = -1, unk_ = -1, pad_ = -1;
  std::vector<int32_t> eog_;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = true, has_every_byte_ = true;
};

// `text` with every byte that is not part of a valid UTF-8 character replaced by U+FFFD (what a
// protocol with UTF-8 strings can carry; token ids stay exact).
std::string to_valid_utf8(std::string_view text);

// Detokenizes one token at a time: push() returns the text that is complete so far, holding back a
// piece that ends inside a multi-byte UTF-8 character until the character is complete.
// The concatenation of every push() and finish() equals Tokenizer::decode of all the tokens.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool render_special = false)
      : tok_(&tokenizer), render_special_(render_special) {}
  std::string push(int32_t id);
  std::string finish();  // whatever is held back, complete or not

 private:
  const Tokenizer* tok_;
  bool render_special_;
  bool started_ = false;
  std::string pending_;
};

}  // namespace combs
