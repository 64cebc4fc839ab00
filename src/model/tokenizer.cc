#include "combs/model/tokenizer.h"

#include <algorithm>
#include <queue>

#include "combs/model/pretokenizer.h"
#include "unicode.h"

namespace combs {
namespace {

using unicode::Char;

constexpr std::string_view kSpmSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's space

// text with each space as U+2581 (SentencePiece's), and one in front where asked.
std::string spm_spaces(std::string_view text, bool prefix) {
  std::string s;
  s.reserve(text.size() * 2 + 3);
  if (prefix) s += kSpmSpace;
  for (char ch : text) {
    if (ch == ' ') s += kSpmSpace;
    else s += ch;
  }
  return s;
}

// The byte-fallback token of byte b: <0xNN>.
std::string byte_token(uint8_t b) {
  char name[8];
  std::snprintf(name, sizeof name, "<0x%02X>", b);
  return name;
}

bool mergeable(TokenType t) {
  return t == TokenType::kNormal || t == TokenType::kUserDefined;
}

struct Bigram {
  double key;      // higher first (spm: score; bpe: -rank)
  int left, right;
  size_t size;     // bytes of the pair when queued
  bool operator<(const Bigram& o) const {
    return key < o.key || (key == o.key && left > o.left);
  }
};

struct Symbol {
  int prev, next;
  size_t start, len;  // bytes in the text
};

// Offers every adjacent pair to try_pair (which queues those that may merge), then merges the best
// queued pair whose sides are unchanged, again and again, offering each merged symbol's new
// neighbours. Shared by the SentencePiece-style (by score) and BPE (by rank) tokenizers.
template <typename TryPair>
void merge_all(std::vector<Symbol>& sym, std::priority_queue<Bigram>& queue, TryPair&& try_pair) {
  for (int k = 0; k + 1 < static_cast<int>(sym.size()); ++k) try_pair(k, k + 1);
  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = sym[b.left];
    Symbol& r = sym[b.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.size) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_pair(l.prev, b.left);
    try_pair(b.left, l.next);
  }
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const gguf::GgufFile& f) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  const std::string& path = f.path();
  auto bad = [&](const std::string& key, const std::string& why) {
    return invalid_argument_error(path + ": tokenizer metadata '" + key + "': " + why);
  };
  COMBS_ASSIGN_OR_RETURN(std::string model, f.get_string("tokenizer.ggml.model"));
  // gemma4: BPE over raw UTF-8 with SentencePiece's spaces (llama.cpp gives it the pre-tokenizer
  // of that name, whatever tokenizer.ggml.pre says).
  if (model == "llama") t->model_ = Model::kSpm;
  else if (model == "gpt2" || model == "gemma4") t->model_ = Model::kBpe;
  else return bad("tokenizer.ggml.model", "'" + model + "' is not supported (llama, gpt2 and gemma4 are)");

  COMBS_ASSIGN_OR_RETURN(const gguf::Array* tokens, f.get_array("tokenizer.ggml.tokens"));
  const size_t n = tokens->items.size();
  if (tokens->type != gguf::ValueType::kString || n == 0 || n > (1u << 24)) {
    return bad("tokenizer.ggml.tokens", "must be a non-empty array of strings");
  }
  t->tokens_.reserve(n);
  for (const auto& v : tokens->items) t->tokens_.push_back(std::get<std::string>(v.v));
  t->scores_.assign(n, 0.0f);
  if (f.find("tokenizer.ggml.scores")) {
    COMBS_ASSIGN_OR_RETURN(const gguf::Array* scores, f.get_array("tokenizer.ggml.scores"));
    if (scores->items.size() != n || scores->type != gguf::ValueType::kF32) {
      return bad("tokenizer.ggml.scores", "must hold one f32 per token (" + std::to_string(n) + ")");
    }
    for (size_t i = 0; i < n; ++i) t->scores_[i] = static_cast<float>(std::get<double>(scores->items[i].v));
  }
  t->types_.assign(n, TokenType::kNormal);
  if (f.find("tokenizer.ggml.token_type")) {
    COMBS_ASSIGN_OR_RETURN(const gguf::Array* types, f.get_array("tokenizer.ggml.token_type"));
    if (types->items.size() != n || types->type != gguf::ValueType::kI32) {
      return bad("tokenizer.ggml.token_type", "must hold one i32 per token (" + std::to_string(n) + ")");
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = std::get<int64_t>(types->items[i].v);
      if (v < 1 || v > 6) return bad("tokenizer.ggml.token_type", "unknown type " + std::to_string(v));
      t->types_[i] = static_cast<TokenType>(v);
    }
  }
  for (size_t i = 0; i < n; ++i) t->index_.emplace(t->tokens_[i], static_cast<int32_t>(i));

  auto id = [&](const char* key, int32_t* out) -> Status {
    if (!f.find(key)) return ok_status();
    COMBS_ASSIGN_OR_RETURN(uint64_t v, f.get_uint(key));
    if (v >= n) return bad(key, "token id " + std::to_string(v) + " is outside the vocabulary");
    *out = static_cast<int32_t>(v);
    return ok_status();
  };
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.bos_token_id", &t->bos_));
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.eos_token_id", &t->eos_));
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.eot_token_id", &t->eot_));
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.eom_token_id", &t->eom_));
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.unknown_token_id", &t->unk_));
  COMBS_RETURN_IF_ERROR(id("tokenizer.ggml.padding_token_id", &t->pad_));

  std::string pre = "default";
  if (f.find("tokenizer.ggml.pre")) {
    COMBS_ASSIGN_OR_RETURN(pre, f.get_string("tokenizer.ggml.pre"));
  }
  if (model == "gemma4") pre = "gemma4";
  if (t->model_ == Model::kSpm) {
    t->add_bos_ = true;
    for (int b = 0; b < 256; ++b) t->byte_tokens_.push_back(t->find(byte_token(static_cast<uint8_t>(b))));
    // Characters that are part of some multi-character token; text splits around the others.
    t->joins_.assign(0x30000, false);
    for (size_t i = 0; i < n; ++i) {
      if (!mergeable(t->types_[i])) continue;
      const auto chars = unicode::split_utf8(t->tokens_[i]);
      if (chars.size() < 2) continue;
      for (const Char& c : chars)
        if (c.cp < t->joins_.size()) t->joins_[c.cp] = true;
    }
  } else {
    auto p = PreTokenizer::create(pre);
    if (!p.ok()) return bad("tokenizer.ggml.pre", p.status().message());
    t->pre_ = std::move(p).value();
    t->add_bos_ = t->pre_->adds_bos();
    COMBS_ASSIGN_OR_RETURN(const gguf::Array* merges, f.get_array("tokenizer.ggml.merges"));
    if (merges->type != gguf::ValueType::kString) return bad("tokenizer.ggml.merges", "must be strings");
    for (size_t i = 0; i < merges->items.size(); ++i) {
      const std::string& m = std::get<std::string>(merges->items[i].v);
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos || sp + 1 >= m.size()) {
        return bad("tokenizer.ggml.merges", "entry " + std::to_string(i) + " ('" + m + "') is not 'left right'");
      }
      t->merge_rank_.emplace(m, static_cast<int32_t>(i));
    }
    for (int b = 0; b < 256; ++b) {  // GPT-2's symbol of the byte, or <0xNN> over raw UTF-8
      std::string sym;
      if (t->pre_->byte_level()) append_utf8(unicode::byte_to_symbol(static_cast<uint8_t>(b)), sym);
      else sym = byte_token(static_cast<uint8_t>(b));
      t->byte_tokens_.push_back(t->find(sym));
    }
  }
  if (f.find("tokenizer.ggml.add_bos_token")) {
    COMBS_ASSIGN_OR_RETURN(t->add_bos_, f.get_bool("tokenizer.ggml.add_bos_token"));
  }
  if (f.find("tokenizer.ggml.add_eos_token")) {
    COMBS_ASSIGN_OR_RETURN(t->add_eos_, f.get_bool("tokenizer.ggml.add_eos_token"));
  }
  if (f.find("tokenizer.ggml.add_space_prefix")) {
    COMBS_ASSIGN_OR_RETURN(t->add_space_prefix_, f.get_bool("tokenizer.ggml.add_space_prefix"));
  }
  if (t->pre_ && t->pre_->forces_bos()) t->add_bos_ = true;
  if (t->add_bos_ && t->bos_ < 0) return bad("tokenizer.ggml.add_bos_token", "set, but there is no bos_token_id");
  if (t->add_eos_ && t->eos_ < 0) return bad("tokenizer.ggml.add_eos_token", "set, but there is no eos_token_id");
  t->find_end_of_generation();
  for (int32_t id : t->byte_tokens_) {
    if (id < 0 || (t->types_[id] != TokenType::kNormal && t->types_[id] != TokenType::kByte)) t->has_every_byte_ = false;
  }
  for (size_t i = 0; i < n; ++i) {
    const TokenType ty = t->types_[i];
    if ((ty == TokenType::kControl || ty == TokenType::kUserDefined) && !t->tokens_[i].empty()) {
      t->specials_.emplace_back(t->tokens_[i], static_cast<int32_t>(i));
    }
  }
  std::stable_sort(t->specials_.begin(), t->specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (size_t k = 0; k < t->specials_.size(); ++k) {
    t->specials_by_byte_[static_cast<uint8_t>(t->specials_[k].first[0])].push_back(static_cast<uint32_t>(k));
  }
  return t;
}

// llama.cpp's derivation (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation"):
// by the tokens' texts, as model files do not mark them. Each is made a control token if the file
// did not say so (it then renders only with render_special, and text spells it only with
// parse_special), as llama.cpp does.
void Tokenizer::find_end_of_generation() {
  static constexpr std::string_view kEndOfTurn[] = {  // also the eot token when the file names none
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
      "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"};  // DeepSeek's <｜end▁of▁sentence｜>
  static constexpr std::string_view kEndOfGeneration[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
      "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
      "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
      "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", "[e~["};
  // Fill-in-the-middle's pad, repository and file-separator tokens end a completion too.
  static constexpr std::string_view kFim[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
                                              "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
                                              "<|file_sep|>"};
  if (eot_ < 0) {
    for (std::string_view text : kEndOfTurn)
      if (const int32_t id = find(text); id >= 0) {
        eot_ = id;
        break;
      }
  }
  if (eom_ < 0) eom_ = find("<|eom_id|>");
  std::vector<int32_t> eog;
  auto add = [&](int32_t id) {
    if (id >= 0 && std::find(eog.begin(), eog.end(), id) == eog.end()) eog.push_back(id);
  };
  for (std::string_view text : kFim) add(find(text));
  for (std::string_view text : kEndOfGeneration) add(find(text));
  add(eos_);
  add(eot_);
  add(eom_);
  // gpt-oss (and solar-open) end a message with <|end|> but keep generating: not an end there.
  auto has = [&](std::string_view text) { return find(text) >= 0; };
  if (has("<|end|>") && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")))) {
    std::erase(eog, find("<|end|>"));
  }
  // Gemma 4 uses </s> in text: not an end where <|tool_response> is one.
  if (has("<|tool_response>") && has("</s>")) std::erase(eog, find("</s>"));
  for (int32_t id : eog) {
    if (types_[id] == TokenType::kNormal || types_[id] == TokenType::kUserDefined) types_[id] = TokenType::kControl;
  }
  std::sort(eog.begin(), eog.end());
  eog_ = std::move(eog);
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::binary_search(eog_.begin(), eog_.end(), id);
}

int32_t Tokenizer::find(std::string_view text) const {
  auto it = index_.find(text);
  return it == index_.end() ? -1 : it->second;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, EncodeOptions options) const {
  std::vector<int32_t> out;
  if (options.add_special && add_bos_) out.push_back(bos_);
  bool prev_special = true;  // a space prefix goes on the text at the start and after specials
  size_t pos = 0, frag = 0;
  while (pos <= text.size()) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    if (pos < text.size()) {
      // User-defined tokens always (llama.cpp and Hugging Face split them out before anything
      // else: GPT-NeoX's runs of spaces), control tokens only when asked; the longest first.
      for (uint32_t k : specials_by_byte_[static_cast<uint8_t>(text[pos])]) {
        const auto& s = specials_[k];
        if (!options.parse_special && types_[s.second] != TokenType::kUserDefined) continue;
        if (text.compare(pos, s.first.size(), s.first) == 0) {
          hit = &s;
          break;
        }
      }
    }
    if (hit == nullptr && pos < text.size()) {
      ++pos;
      continue;
    }
    if (pos > frag) {
      encode_fragment(text.substr(frag, pos - frag), prev_special, out);
      prev_special = false;
    }
    if (hit == nullptr) break;  // end of text
    out.push_back(hit->second);
    prev_special = true;
    pos += hit->first.size();
    frag = pos;
  }
  if (options.add_special && add_eos_) out.push_back(eos_);
  return out;
}

void Tokenizer::encode_fragment(std::string_view text, bool after_special,
                                std::vector<int32_t>& out) const {
  if (model_ == Model::kSpm) {
    encode_spm(spm_spaces(text, add_space_prefix_ && after_special), out);
    return;
  }
  std::string escaped;
  if (pre_->escapes_spaces()) {
    escaped = spm_spaces(text, false);
    text = escaped;
  }
  std::vector<PreTokenizer::Word> words;
  words.reserve(text.size() / 4 + 1);
  pre_->split(text, words);
  std::unordered_map<std::string_view, std::vector<int32_t>> cache;  // per call: thread-safe
  for (const PreTokenizer::Word& w : words) {
    const std::string_view word = text.substr(w.begin, w.end - w.begin);
    auto it = cache.find(word);
    if (it == cache.end()) {
      std::vector<int32_t> ids;
      encode_bpe_word(word, ids);
      it = cache.emplace(word, std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  }
}

// Each byte of s as its byte token, or the unknown token where the vocabulary has none.
void Tokenizer::byte_fallback(std::string_view s, std::vector<int32_t>& out) const {
  for (char ch : s) {
    const int32_t bt = byte_tokens_[static_cast<uint8_t>(ch)];
    if (bt >= 0) out.push_back(bt);
    else if (unk_ >= 0) out.push_back(unk_);
  }
}

// SentencePiece-style: merge the adjacent pair whose concatenation is the highest-scoring token,
// leftmost first, until none is left; unknown characters fall back to byte tokens. The text is
// cut around characters that appear in no multi-character token (merges cannot cross them).
void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  const auto chars = unicode::split_utf8(text);
  auto joins = [&](const Char& c) { return c.valid && (c.cp >= joins_.size() || joins_[c.cp]); };
  std::vector<Symbol> sym;
  std::priority_queue<Bigram> queue;
  auto segment = [&](size_t c0, size_t c1) {
    const size_t base = chars[c0].offset;
    const size_t end = c1 < chars.size() ? chars[c1].offset : text.size();
    const std::string_view seg = text.substr(base, end - base);
    sym.clear();
    for (size_t k = c0; k < c1; ++k) {
      const int idx = static_cast<int>(k - c0);
      sym.push_back({idx - 1, k + 1 < c1 ? idx + 1 : -1, chars[k].offset - base, chars[k].len});
    }
    auto try_pair = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const std::string_view s = seg.substr(sym[l].start, sym[l].len + sym[r].len);
      const int32_t id = find(s);
      if (id < 0 || !mergeable(types_[id])) return;
      queue.push({scores_[id], l, r, s.size()});
    };
    merge_all(sym, queue, try_pair);
    for (int k = 0; k >= 0 && k < static_cast<int>(sym.size()); k = sym[k].next) {
      const std::string_view s = seg.substr(sym[k].start, sym[k].len);
      const int32_t id = find(s);
      if (id >= 0 && types_[id] != TokenType::kControl && types_[id] != TokenType::kUnknown) {
        out.push_back(id);
        continue;
      }
      byte_fallback(s, out);
    }
  };
  size_t start = 0;
  for (size_t k = 0; k < chars.size(); ++k) {
    if (joins(chars[k])) continue;
    if (k > start) segment(start, k);
    segment(k, k + 1);
    start = k + 1;
  }
  if (chars.size() > start) segment(start, chars.size());
}

// Byte-level BPE on one pre-tokenized word: bytes become printable symbols, then the adjacent
// pair with the lowest merge rank merges, leftmost first, until no pair has a rank.
void Tokenizer::encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  std::string s;
  if (pre_->byte_level()) {
    s.reserve(word.size() * 2);
    for (char ch : word) append_utf8(unicode::byte_to_symbol(static_cast<uint8_t>(ch)), s);
  } else {
    s = word;
  }
  // A word that is a token is that token: always with ignore_merges, and for runs of newlines
  // where the pre-tokenizer says so (Gemma 4's merges do not build them).
  if (pre_->ignore_merges() ||
      (pre_->newline_runs_are_tokens() && s.find_first_not_of('\n') == std::string::npos)) {
    if (const int32_t id = find(s); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const auto chars = unicode::split_utf8(s);
  std::vector<Symbol> sym;
  for (size_t k = 0; k < chars.size(); ++k) {
    const int idx = static_cast<int>(k);
    sym.push_back({idx - 1, k + 1 < chars.size() ? idx + 1 : -1, chars[k].offset, chars[k].len});
  }
  std::priority_queue<Bigram> queue;
  std::string key;
  auto try_pair = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    key.assign(s, sym[l].start, sym[l].len);
    key += ' ';
    key.append(s, sym[r].start, sym[r].len);
    auto it = merge_rank_.find(key);
    if (it == merge_rank_.end()) return;
    queue.push({-static_cast<double>(it->second), l, r, sym[l].len + sym[r].len});
  };
  merge_all(sym, queue, try_pair);
  for (int k = 0; k >= 0 && k < static_cast<int>(sym.size()); k = sym[k].next) {
    const std::string_view piece(s.data() + sym[k].start, sym[k].len);
    if (const int32_t id = find(piece); id >= 0) {
      out.push_back(id);
      continue;
    }
    if (!pre_->byte_level()) {  // raw UTF-8: byte fallback to <0xNN>
      byte_fallback(piece, out);
      continue;
    }
    for (const Char& c : unicode::split_utf8(piece)) {  // symbols the merges never reached
      const int32_t id = find(piece.substr(c.offset, c.len));
      if (id >= 0) out.push_back(id);
      else if (unk_ >= 0) out.push_back(unk_);
    }
  }
}

std::string Tokenizer::piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) return {};
  const std::string& text = tokens_[id];
  const TokenType type = types_[id];
  if (type == TokenType::kControl || type == TokenType::kUnknown || type == TokenType::kUnused) {
    return render_special ? text : std::string();
  }
  if (type == TokenType::kByte && text.size() == 6 && text.starts_with("<0x") && text.back() == '>' &&
      (model_ == Model::kSpm || !pre_->byte_level())) {
    return std::string(1, static_cast<char>(std::stoi(text.substr(3, 2), nullptr, 16)));
  }
  if (model_ == Model::kSpm || (type == TokenType::kNormal && pre_->escapes_spaces())) {
    std::string out;
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, kSpmSpace.size(), kSpmSpace) == 0) {
        out += ' ';
        i += kSpmSpace.size();
      } else {
        out += text[i++];
      }
    }
    return out;
  }
  if (type == TokenType::kUserDefined) return text;
  std::string out;
  for (const Char& c : unicode::split_utf8(text)) {
    const int b = c.valid ? unicode::symbol_to_byte(c.cp) : -1;
    if (b >= 0) out += static_cast<char>(b);
    else out.append(text, c.offset, c.len);
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool render_special) const {
  std::string out;
  bool started = false;
  for (int32_t id : ids) {
    std::string p = piece(id, render_special);
    if (!started && !p.empty()) {
      started = true;
      if (strips_leading_space() && p[0] == ' ') p.erase(0, 1);
    }
    out += p;
  }
  return out;
}

std::string to_valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const Char& c : unicode::split_utf8(text)) {
    if (c.valid) out.append(text, c.offset, c.len);
    else out += "\xEF\xBF\xBD";
  }
  return out;
}

std::string StreamDecoder::push(int32_t id) {
  std::string p = tok_->piece(id, render_special_);
  if (!started_ && !p.empty()) {
    started_ = true;
    if (tok_->strips_leading_space() && p[0] == ' ') p.erase(0, 1);
  }
  pending_ += p;
  const size_t n = unicode::complete_prefix(pending_);
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace combs
