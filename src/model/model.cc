#include "combs/model/model.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace combs {
namespace {

std::string blk(int i, const char* name) { return "blk." + std::to_string(i) + "." + name; }

StatusOr<int> get_int(const gguf::GgufFile& f, const std::string& key, int64_t lo, int64_t hi) {
  COMBS_ASSIGN_OR_RETURN(uint64_t v, f.get_uint(key));
  if (v < static_cast<uint64_t>(lo) || v > static_cast<uint64_t>(hi)) {
    return invalid_argument_error(f.path() + ": metadata '" + key + "': " + std::to_string(v) +
                                  " is out of range [" + std::to_string(lo) + ", " +
                                  std::to_string(hi) + "]");
  }
  return static_cast<int>(v);
}

}  // namespace

StatusOr<ModelConfig> Model::read_config(const gguf::GgufFile& f) {
  ModelConfig c;
  COMBS_ASSIGN_OR_RETURN(c.arch_name, f.get_string("general.architecture"));
  if (c.arch_name == "llama") {
    c.arch = Arch::kLlama;
    c.rope_style = RopeStyle::kAdjacent;
  } else if (c.arch_name == "qwen2") {
    c.arch = Arch::kQwen2;
    c.rope_style = RopeStyle::kHalves;
    c.qkv_bias = true;
  } else {
    return invalid_argument_error(f.path() + ": metadata 'general.architecture': '" + c.arch_name +
                                  "' is not supported (llama and qwen2 are)");
  }
  const std::string a = c.arch_name + ".";
  COMBS_ASSIGN_OR_RETURN(c.n_embd, get_int(f, a + "embedding_length", 1, 1 << 16));
  COMBS_ASSIGN_OR_RETURN(c.n_layers, get_int(f, a + "block_count", 1, 1024));
  COMBS_ASSIGN_OR_RETURN(c.n_heads, get_int(f, a + "attention.head_count", 1, 1024));
  c.n_kv_heads = c.n_heads;
  if (f.find(a + "attention.head_count_kv")) {
    COMBS_ASSIGN_OR_RETURN(c.n_kv_heads, get_int(f, a + "attention.head_count_kv", 1, c.n_heads));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return invalid_argument_error(f.path() + ": metadata '" + a + "attention.head_count_kv': " +
                                  std::to_string(c.n_kv_heads) + " does not divide head_count " +
                                  std::to_string(c.n_heads));
  }
  c.head_dim = c.n_embd / c.n_heads;
  if (f.find(a + "attention.key_length")) {
    COMBS_ASSIGN_OR_RETURN(c.head_dim, get_int(f, a + "attention.key_length", 2, 1024));
  } else if (c.n_embd % c.n_heads != 0) {
    return invalid_argument_error(f.path() + ": metadata '" + a +
                                  "attention.head_count' does not divide embedding_length");
  }
  if (c.head_dim % 2 != 0) {
    return invalid_argument_error(f.path() + ": head dimension " + std::to_string(c.head_dim) +
                                  " is odd: RoPE needs pairs");
  }
  if (f.find(a + "attention.value_length")) {
    COMBS_ASSIGN_OR_RETURN(int vlen, get_int(f, a + "attention.value_length", 1, 1024));
    if (vlen != c.head_dim) {
      return invalid_argument_error(f.path() + ": metadata '" + a +
                                    "attention.value_length' differs from key_length: unsupported");
    }
  }
  COMBS_ASSIGN_OR_RETURN(c.n_ff, get_int(f, a + "feed_forward_length", 1, 1 << 20));
  c.context_length = 4096;
  if (f.find(a + "context_length")) {
    COMBS_ASSIGN_OR_RETURN(c.context_length, get_int(f, a + "context_length", 1, 1 << 30));
  }
  if (f.find(a + "rope.freq_base")) {
    COMBS_ASSIGN_OR_RETURN(double base, f.get_float(a + "rope.freq_base"));
    if (!(base > 1.0 && base < 1e12)) {
      return invalid_argument_error(f.path() + ": metadata '" + a + "rope.freq_base': " +
                                    std::to_string(base) + " is out of range");
    }
    c.rope_freq_base = static_cast<float>(base);
  }
  c.rope_dim = c.head_dim;
  if (f.find(a + "rope.dimension_count")) {
    COMBS_ASSIGN_OR_RETURN(c.rope_dim, get_int(f, a + "rope.dimension_count", 2, c.head_dim));
    if (c.rope_dim % 2 != 0) {
      return invalid_argument_error(f.path() + ": metadata '" + a + "rope.dimension_count' is odd");
    }
  }
  if (f.find(a + "attention.layer_norm_rms_epsilon")) {
    COMBS_ASSIGN_OR_RETURN(double eps, f.get_float(a + "attention.layer_norm_rms_epsilon"));
    if (!(eps > 0.0 && eps < 1.0)) {
      return invalid_argument_error(f.path() + ": metadata '" + a +
                                    "attention.layer_norm_rms_epsilon' is out of range");
    }
    c.rms_eps = static_cast<float>(eps);
  }
  // The vocabulary size: the embedding's rows, else the tokenizer's token list.
  if (const gguf::TensorInfo* t = f.find_tensor("token_embd.weight"); t && t->dims.size() == 2) {
    c.n_vocab = static_cast<int>(t->dims[1]);
  } else if (f.find(a + "vocab_size")) {
    COMBS_ASSIGN_OR_RETURN(c.n_vocab, get_int(f, a + "vocab_size", 1, 1 << 24));
  } else if (auto tokens = f.get_array("tokenizer.ggml.tokens"); tokens.ok()) {
    c.n_vocab = static_cast<int>((*tokens)->items.size());
  }
  if (c.n_vocab < 1) {
    return invalid_argument_error(f.path() + ": cannot tell the vocabulary size");
  }
  c.tied_output = f.find_tensor("output.weight") == nullptr;
  return c;
}

std::vector<WeightSpec> weight_specs(const ModelConfig& c) {
  const int64_t e = c.n_embd, q = int64_t{c.n_heads} * c.head_dim,
                kv = int64_t{c.n_kv_heads} * c.head_dim, ff = c.n_ff, v = c.n_vocab;
  std::vector<WeightSpec> s = {
      {"token_embd.weight", {e, v}},
      {"output_norm.weight", {e}, true, true},
      {"output.weight", {e, v}, false},
      {"rope_freqs.weight", {c.rope_dim / 2}, false, true},
  };
  for (int i = 0; i < c.n_layers; ++i) {
    s.push_back({blk(i, "attn_norm.weight"), {e}, true, true});
    s.push_back({blk(i, "attn_q.weight"), {e, q}});
    s.push_back({blk(i, "attn_k.weight"), {e, kv}});
    s.push_back({blk(i, "attn_v.weight"), {e, kv}});
    if (c.qkv_bias) {
      s.push_back({blk(i, "attn_q.bias"), {q}, true, true});
      s.push_back({blk(i, "attn_k.bias"), {kv}, true, true});
      s.push_back({blk(i, "attn_v.bias"), {kv}, true, true});
    }
    s.push_back({blk(i, "attn_output.weight"), {q, e}});
    s.push_back({blk(i, "ffn_norm.weight"), {e}, true, true});
    s.push_back({blk(i, "ffn_gate.weight"), {e, ff}});
    s.push_back({blk(i, "ffn_up.weight"), {e, ff}});
    s.push_back({blk(i, "ffn_down.weight"), {ff, e}});
  }
  return s;
}

StatusOr<std::unique_ptr<Model>> Model::load(const std::string& path) {
  std::unique_ptr<Model> m(new Model());
  COMBS_ASSIGN_OR_RETURN(m->file_, gguf::GgufFile::open(path));
  COMBS_ASSIGN_OR_RETURN(m->config_, read_config(*m->file_));
  const ModelConfig& c = m->config_;
  m->layers.resize(c.n_layers);
  auto slot = [&](const std::string& name) -> Tensor* {
    if (name == "token_embd.weight") return &m->tok_embd;
    if (name == "output_norm.weight") return &m->output_norm;
    if (name == "output.weight") return &m->output;
    if (name == "rope_freqs.weight") return &m->rope_freqs;
    const size_t dot = name.find('.', 4);
    LayerWeights& l = m->layers[std::stoi(name.substr(4, dot - 4))];
    const std::string w = name.substr(dot + 1);
    if (w == "attn_norm.weight") return &l.attn_norm;
    if (w == "attn_q.weight") return &l.wq;
    if (w == "attn_k.weight") return &l.wk;
    if (w == "attn_v.weight") return &l.wv;
    if (w == "attn_q.bias") return &l.bq;
    if (w == "attn_k.bias") return &l.bk;
    if (w == "attn_v.bias") return &l.bv;
    if (w == "attn_output.weight") return &l.wo;
    if (w == "ffn_norm.weight") return &l.ffn_norm;
    if (w == "ffn_gate.weight") return &l.w_gate;
    if (w == "ffn_up.weight") return &l.w_up;
    return &l.w_down;
  };
  // Weights are copied into one anonymous buffer backed by transparent huge pages: decoding
  // streams every weight once per token, and 4 KB file pages cost a TLB miss every 4 KB.
  const std::vector<WeightSpec> specs = weight_specs(c);
  size_t total = 0;
  for (const WeightSpec& spec : specs) {
    if (const gguf::TensorInfo* t = m->file_->find_tensor(spec.name)) total += (t->nbytes + 63) / 64 * 64;
  }
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t alloc = (total + kHuge - 1) / kHuge * kHuge;
  m->memory_.reset(static_cast<char*>(std::aligned_alloc(kHuge, alloc == 0 ? kHuge : alloc)));
  if (!m->memory_) return resource_exhausted_error(path + ": cannot allocate " + std::to_string(total) + " bytes for the weights");
  madvise(m->memory_.get(), alloc, MADV_HUGEPAGE);
  size_t used = 0;
  for (const WeightSpec& spec : specs) {
    const gguf::TensorInfo* t = m->file_->find_tensor(spec.name);
    if (t == nullptr) {
      if (spec.required) return invalid_argument_error(path + ": tensor '" + spec.name + "' is missing");
      continue;
    }
    if (t->dims != spec.dims) {
      auto show = [](const std::vector<int64_t>& d) {
        std::string s = "[";
        for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
        return s + "]";
      };
      return invalid_argument_error(path + ": tensor '" + spec.name + "' has shape " +
                                    show(t->dims) + ", expected " + show(spec.dims) +
                                    " from the metadata");
    }
    if (spec.f32_only && t->dtype != DType::kF32) {
      return invalid_argument_error(path + ": tensor '" + spec.name + "' must be F32, is " +
                                    std::string(dtype_name(t->dtype)));
    }
    Shape shape = t->dims.size() == 1 ? Shape{t->dims[0]} : Shape{t->dims[1], t->dims[0]};
    char* dst = m->memory_.get() + used;
    std::memcpy(dst, t->data, t->nbytes);
    m->file_->drop_pages(*t);  // the copy is the weight now: resident once, not twice
    used += (t->nbytes + 63) / 64 * 64;
    *slot(spec.name) = Tensor::wrap(dst, shape, t->dtype);
  }
  if (c.tied_output) m->output = m->tok_embd;
  return m;
}

int64_t Model::weight_bytes_per_token() const {
  int64_t bytes = static_cast<int64_t>(nbytes_for(tok_embd.dtype(), config_.n_embd));
  bytes += static_cast<int64_t>(output.nbytes());
  for (const LayerWeights& l : layers) {
    for (const Tensor* t : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

}  // namespace combs
