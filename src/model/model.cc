#include "combs/model/model.h"

#include "combs/backend/cpu/cpu_ops.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
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

// What an architecture is, as data: everything read_config needs to know of it besides the
// keys every architecture shares. Follows llama.cpp's reading (src/models/*.cpp of v0.5.0).
struct ArchSpec {
  const char* name;
  RopeStyle rope_style;
  bool qkv_bias = false, qk_norm = false, post_norms = false, embed_scale = false;
  bool gate_up_fused = false;  // ffn_up holds the gate's rows then the up's (no ffn_gate)
  Activation activation = Activation::kSilu;
  // Sliding window: every swa_pattern-th layer is global, the others windowed (llama.cpp's
  // set_swa_pattern; attention.sliding_window_pattern overrides, as a number or a per-layer
  // array). 0: the architecture has none. default_window: when the file gives no
  // attention.sliding_window (0: then no window at all).
  int swa_pattern = 0, default_window = 0;
  float base_swa = 0.0f;  // the windowed layers' RoPE base when the file has none (0: the global one)
  float attn_softcap = 0.0f, final_softcap = 0.0f;  // defaults; the file's keys override
  int layers_27b = 0;  // gemma's 27B shape (this many layers) scales queries by 1/sqrt(n_embd / n_heads)
  // Mixture of experts: kOptional where expert_count > 0 makes it one (llama: Mixtral), kRequired
  // where the architecture is one. Experts' width default (no expert_feed_forward_length):
  // feed_forward_length itself (llama) or divided by expert_used_count (qwen*moe, as llama.cpp).
  enum Moe : uint8_t { kDense, kOptional, kRequired } moe = kDense;
  bool ff_exp_divided = false;
  bool expert_weights_norm = false;
  bool shared_expert = false;  // qwen2moe: a gated dense FFN beside the experts
  // gpt-oss: see ModelConfig's fields of the same names. window_required: a file without
  // attention.sliding_window is refused (llama.cpp reads it as a required key).
  bool attn_out_bias = false, attn_sinks = false, ffn_norm_post_attention = false;
  bool expert_softmax_chosen = false, expert_biases = false;
  bool rope_scaling_swa = false, window_required = false;
};

constexpr ArchSpec kArchs[] = {
    {.name = "llama", .rope_style = RopeStyle::kAdjacent, .moe = ArchSpec::kOptional, .expert_weights_norm = true},
    {.name = "qwen2", .rope_style = RopeStyle::kHalves, .qkv_bias = true},
    {.name = "qwen3", .rope_style = RopeStyle::kHalves, .qk_norm = true},
    {.name = "qwen2moe", .rope_style = RopeStyle::kHalves, .qkv_bias = true, .moe = ArchSpec::kRequired,
     .ff_exp_divided = true, .shared_expert = true},
    {.name = "qwen3moe", .rope_style = RopeStyle::kHalves, .qk_norm = true, .moe = ArchSpec::kRequired,
     .ff_exp_divided = true, .expert_weights_norm = true},
    {.name = "gemma2", .rope_style = RopeStyle::kHalves, .post_norms = true, .embed_scale = true,
     .activation = Activation::kGeluTanh, .swa_pattern = 2, .default_window = 4096, .attn_softcap = 50.0f,
     .final_softcap = 30.0f, .layers_27b = 46},
    {.name = "gemma3", .rope_style = RopeStyle::kHalves, .qk_norm = true, .post_norms = true, .embed_scale = true,
     .activation = Activation::kGeluTanh, .swa_pattern = 6, .base_swa = 10000.0f, .layers_27b = 62},
    // phi3 (Phi-3, Phi-3.5, Phi-4-mini): llama.cpp v0.5.0 disables its sliding window ("results
    // might be suboptimal"): not read here either, so that both compute the same.
    {.name = "phi3", .rope_style = RopeStyle::kHalves, .gate_up_fused = true},
    // gpt-oss: even layers windowed (llama.cpp's pattern 2), YaRN on all of them (its swa freq
    // scale is the global one).
    {.name = "gpt-oss", .rope_style = RopeStyle::kHalves, .qkv_bias = true, .activation = Activation::kSwigluOai,
     .swa_pattern = 2, .moe = ArchSpec::kRequired, .attn_out_bias = true, .attn_sinks = true,
     .ffn_norm_post_attention = true, .expert_softmax_chosen = true, .expert_biases = true,
     .rope_scaling_swa = true, .window_required = true},
};

StatusOr<float> get_positive(const gguf::GgufFile& f, const std::string& key, double hi) {
  COMBS_ASSIGN_OR_RETURN(double v, f.get_float(key));
  if (!(v > 0.0 && v < hi)) {
    return invalid_argument_error(f.path() + ": metadata '" + key + "': " + std::to_string(v) + " is out of range");
  }
  return static_cast<float>(v);
}

const ArchSpec* find_arch(std::string_view name) {
  for (const ArchSpec& a : kArchs) {
    if (name == a.name) return &a;
  }
  return nullptr;
}

std::string arch_names() {
  std::string known;
  for (const ArchSpec& a : kArchs) known += (known.empty() ? "" : ", ") + std::string(a.name);
  return known;
}

// The mixture of experts' keys (ModelConfig::n_expert and after), as llama.cpp reads them.
Status read_experts(const gguf::GgufFile& f, const ArchSpec& spec, ModelConfig* c) {
  const std::string a = c->arch_name + ".";
  if (spec.moe != ArchSpec::kDense && f.find(a + "expert_count")) {
    COMBS_ASSIGN_OR_RETURN(c->n_expert, get_int(f, a + "expert_count", 0, 512));
  }
  if (c->n_expert == 0) {
    if (spec.moe == ArchSpec::kRequired) {
      return invalid_argument_error(f.path() + ": metadata '" + a + "expert_count' is missing or 0: " + c->arch_name +
                                    " is a mixture of experts");
    }
    return ok_status();
  }
  if (!f.find(a + "expert_used_count")) {
    return invalid_argument_error(f.path() + ": metadata '" + a + "expert_used_count' is missing");
  }
  COMBS_ASSIGN_OR_RETURN(c->n_expert_used, get_int(f, a + "expert_used_count", 1, c->n_expert));
  c->n_ff_exp = spec.ff_exp_divided ? c->n_ff / c->n_expert_used : c->n_ff;
  if (f.find(a + "expert_feed_forward_length")) {
    COMBS_ASSIGN_OR_RETURN(c->n_ff_exp, get_int(f, a + "expert_feed_forward_length", 1, 1 << 20));
  }
  if (c->n_ff_exp < 1) {
    return invalid_argument_error(f.path() + ": the experts' width (" + a + "feed_forward_length / expert_used_count) is 0");
  }
  c->expert_weights_norm = spec.expert_weights_norm;
  c->shared_expert = spec.shared_expert;
  if (c->shared_expert && f.find(a + "expert_shared_feed_forward_length")) {  // the shared expert's width
    COMBS_ASSIGN_OR_RETURN(c->n_ff, get_int(f, a + "expert_shared_feed_forward_length", 1, 1 << 20));
  }
  return ok_status();
}

}  // namespace

Status apply_architecture(std::string_view name, ModelConfig* c) {
  const ArchSpec* spec = find_arch(name);
  if (spec == nullptr) {
    return invalid_argument_error("architecture '" + std::string(name) + "' is not supported (" + arch_names() + " are)");
  }
  c->arch_name = std::string(name);
  c->rope_style = spec->rope_style;
  c->qkv_bias = spec->qkv_bias;
  c->qk_norm = spec->qk_norm;
  c->post_norms = spec->post_norms;
  c->activation = spec->activation;
  c->gate_up_fused = spec->gate_up_fused;
  c->embed_scale = spec->embed_scale ? std::sqrt(static_cast<float>(c->n_embd)) : 1.0f;
  c->expert_weights_norm = spec->expert_weights_norm;
  c->shared_expert = spec->shared_expert && c->n_expert > 0;
  c->attn_out_bias = spec->attn_out_bias;
  c->attn_sinks = spec->attn_sinks;
  c->ffn_norm_post_attention = spec->ffn_norm_post_attention;
  c->expert_softmax_chosen = spec->expert_softmax_chosen;
  c->expert_biases = spec->expert_biases;
  c->rope_scaling_swa = spec->rope_scaling_swa;
  return ok_status();
}

StatusOr<ModelConfig> Model::read_config(const gguf::GgufFile& f) {
  ModelConfig c;
  COMBS_ASSIGN_OR_RETURN(const std::string arch, f.get_string("general.architecture"));
  const ArchSpec* spec = find_arch(arch);
  if (spec == nullptr) {
    return invalid_argument_error(f.path() + ": metadata 'general.architecture': '" + arch +
                                  "' is not supported (" + arch_names() + " are)");
  }
  const std::string a = arch + ".";
  COMBS_ASSIGN_OR_RETURN(c.n_embd, get_int(f, a + "embedding_length", 1, 1 << 16));
  COMBS_RETURN_IF_ERROR(apply_architecture(arch, &c));
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
  COMBS_RETURN_IF_ERROR(read_experts(f, *spec, &c));
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
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (spec->layers_27b != 0 && c.n_layers == spec->layers_27b) {
    c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.n_embd / c.n_heads));
  }
  c.attn_softcap = spec->attn_softcap;
  c.final_softcap = spec->final_softcap;
  for (auto [key, value] : {std::pair{a + "attn_logit_softcapping", &c.attn_softcap},
                            std::pair{a + "final_logit_softcapping", &c.final_softcap}}) {
    if (!f.find(key)) continue;
    if (key.find("attn_") != std::string::npos && spec->attn_softcap == 0.0f) continue;  // as llama.cpp: not read
    COMBS_ASSIGN_OR_RETURN(double v, f.get_float(key));
    if (!(v >= 0.0 && v < 1e6)) return invalid_argument_error(f.path() + ": metadata '" + key + "' is out of range");
    *value = static_cast<float>(v);
  }
  // Sliding window and its layers.
  if (spec->swa_pattern != 0) {
    c.sliding_window = spec->default_window;
    if (spec->window_required && !f.find(a + "attention.sliding_window")) {
      return invalid_argument_error(f.path() + ": metadata '" + a + "attention.sliding_window' is missing");
    }
    if (f.find(a + "attention.sliding_window")) {
      COMBS_ASSIGN_OR_RETURN(c.sliding_window,
                             get_int(f, a + "attention.sliding_window", spec->window_required ? 1 : 0, 1 << 30));
    }
  }
  if (c.sliding_window > 0) {
    c.layer_windowed.assign(static_cast<size_t>(c.n_layers), 0);
    const std::string pkey = a + "attention.sliding_window_pattern";
    if (auto arr = f.get_array(pkey); arr.ok()) {
      if ((*arr)->items.size() != static_cast<size_t>(c.n_layers)) {
        return invalid_argument_error(f.path() + ": metadata '" + pkey + "' has " + std::to_string((*arr)->items.size()) +
                                      " entries for " + std::to_string(c.n_layers) + " layers");
      }
      for (int l = 0; l < c.n_layers; ++l) {
        const gguf::Value& v = (*arr)->items[static_cast<size_t>(l)];
        if (v.type != gguf::ValueType::kBool || !std::holds_alternative<bool>(v.v)) return invalid_argument_error(f.path() + ": metadata '" + pkey + "' must hold booleans");
        c.layer_windowed[static_cast<size_t>(l)] = std::get<bool>(v.v) ? 1 : 0;
      }
    } else {
      int pattern = spec->swa_pattern;
      if (f.find(pkey)) {
        COMBS_ASSIGN_OR_RETURN(pattern, get_int(f, pkey, 0, 1 << 20));
      }
      for (int l = 0; l < c.n_layers; ++l) {
        c.layer_windowed[static_cast<size_t>(l)] = pattern == 0 || l % pattern < pattern - 1;
      }
    }
    c.rope_freq_base_swa = spec->base_swa != 0.0f ? spec->base_swa : c.rope_freq_base;
    if (f.find(a + "rope.freq_base_swa")) {
      COMBS_ASSIGN_OR_RETURN(c.rope_freq_base_swa, get_positive(f, a + "rope.freq_base_swa", 1e12));
    }
  }
  // RoPE scaling (of the global layers; windowed ones rotate unscaled, as llama.cpp's swa scale 1,
  // but where the architecture scales them too).
  std::string scaling = "linear";
  if (f.find(a + "rope.scaling.type")) {
    COMBS_ASSIGN_OR_RETURN(scaling, f.get_string(a + "rope.scaling.type"));
  }
  float factor = 0.0f;
  for (const std::string& key : {a + "rope.scaling.factor", a + "rope.scale_linear"}) {
    if (f.find(key)) {
      COMBS_ASSIGN_OR_RETURN(factor, get_positive(f, key, 1e6));
      break;
    }
  }
  if (scaling == "none" || (scaling == "linear" && (factor == 0.0f || factor == 1.0f))) {
    c.rope_scaling = RopeScaling::kNone;
  } else if (scaling == "linear") {
    c.rope_scaling = RopeScaling::kLinear;
  } else if (scaling == "yarn") {
    c.rope_scaling = RopeScaling::kYarn;
  } else {
    return invalid_argument_error(f.path() + ": metadata '" + a + "rope.scaling.type': '" + scaling +
                                  "' is not supported (none, linear, yarn are)");
  }
  c.rope_scale_factor = factor == 0.0f ? 1.0f : factor;
  c.rope_orig_context = c.context_length;
  if (f.find(a + "rope.scaling.original_context_length")) {
    COMBS_ASSIGN_OR_RETURN(c.rope_orig_context, get_int(f, a + "rope.scaling.original_context_length", 1, 1 << 30));
  }
  if (f.find(a + "rope.scaling.attn_factor")) {
    COMBS_ASSIGN_OR_RETURN(c.rope_attn_factor, get_positive(f, a + "rope.scaling.attn_factor", 1e3));
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
  c.qkv_fused = f.find_tensor(blk(0, "attn_qkv.weight")) != nullptr;
  c.rope_factors_long = c.context_length > c.rope_orig_context;
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
  // LongRoPE (phi3): per-frequency divisors for contexts past the original one, and below it.
  s.push_back({"rope_factors_long.weight", {c.rope_dim / 2}, false, true});
  s.push_back({"rope_factors_short.weight", {c.rope_dim / 2}, false, true});
  for (int i = 0; i < c.n_layers; ++i) {
    s.push_back({blk(i, "attn_norm.weight"), {e}, true, true});
    if (c.qkv_fused) {  // its biases fused too (required where the architecture has them)
      s.push_back({blk(i, "attn_qkv.weight"), {e, q + 2 * kv}});
      s.push_back({blk(i, "attn_qkv.bias"), {q + 2 * kv}, c.qkv_bias, true});
    } else {
      s.push_back({blk(i, "attn_q.weight"), {e, q}});
      s.push_back({blk(i, "attn_k.weight"), {e, kv}});
      s.push_back({blk(i, "attn_v.weight"), {e, kv}});
    }
    if (c.qkv_bias && !c.qkv_fused) {
      s.push_back({blk(i, "attn_q.bias"), {q}, true, true});
      s.push_back({blk(i, "attn_k.bias"), {kv}, true, true});
      s.push_back({blk(i, "attn_v.bias"), {kv}, true, true});
    }
    if (c.qk_norm) {
      s.push_back({blk(i, "attn_q_norm.weight"), {c.head_dim}, true, true});
      s.push_back({blk(i, "attn_k_norm.weight"), {c.head_dim}, true, true});
    }
    s.push_back({blk(i, "attn_output.weight"), {q, e}});
    if (c.attn_out_bias) s.push_back({blk(i, "attn_output.bias"), {e}, true, true});
    if (c.attn_sinks) s.push_back({blk(i, "attn_sinks.weight"), {c.n_heads}, true, true});
    if (c.post_norms) s.push_back({blk(i, "post_attention_norm.weight"), {e}, true, true});
    s.push_back({blk(i, c.ffn_norm_post_attention ? "post_attention_norm.weight" : "ffn_norm.weight"), {e}, true, true});
    if (c.n_expert > 0) {
      const int64_t n = c.n_expert, fe = c.n_ff_exp;
      s.push_back({blk(i, "ffn_gate_inp.weight"), {e, n}});
      s.push_back({blk(i, "ffn_gate_exps.weight"), {e, fe, n}});
      s.push_back({blk(i, "ffn_up_exps.weight"), {e, fe, n}});
      s.push_back({blk(i, "ffn_down_exps.weight"), {fe, e, n}});
      if (c.expert_biases) {
        s.push_back({blk(i, "ffn_gate_inp.bias"), {n}, true, true});
        s.push_back({blk(i, "ffn_gate_exps.bias"), {fe, n}, true, true});
        s.push_back({blk(i, "ffn_up_exps.bias"), {fe, n}, true, true});
        s.push_back({blk(i, "ffn_down_exps.bias"), {e, n}, true, true});
      }
    }
    if (c.shared_expert) {
      s.push_back({blk(i, "ffn_gate_inp_shexp.weight"), {e}, true, true});
      s.push_back({blk(i, "ffn_gate_shexp.weight"), {e, ff}});
      s.push_back({blk(i, "ffn_up_shexp.weight"), {e, ff}});
      s.push_back({blk(i, "ffn_down_shexp.weight"), {ff, e}});
    } else if (c.n_expert > 0) {
      // no dense FFN
    } else if (c.gate_up_fused) {
      s.push_back({blk(i, "ffn_up.weight"), {e, 2 * ff}});
      s.push_back({blk(i, "ffn_down.weight"), {ff, e}});
    } else {
      s.push_back({blk(i, "ffn_gate.weight"), {e, ff}});
      s.push_back({blk(i, "ffn_up.weight"), {e, ff}});
      s.push_back({blk(i, "ffn_down.weight"), {ff, e}});
    }
    if (c.post_norms) s.push_back({blk(i, "post_ffw_norm.weight"), {e}, true, true});
  }
  return s;
}

StatusOr<std::unique_ptr<Model>> Model::load(const std::string& path) {
  std::unique_ptr<Model> m(new Model());
  COMBS_ASSIGN_OR_RETURN(m->file_, gguf::GgufFile::open(path));
  COMBS_ASSIGN_OR_RETURN(m->config_, read_config(*m->file_));
  const ModelConfig& c = m->config_;
  m->layers.resize(c.n_layers);
  Tensor factors_long, factors_short;
  auto slot = [&](const std::string& name) -> Tensor* {
    if (name == "token_embd.weight") return &m->tok_embd;
    if (name == "output_norm.weight") return &m->output_norm;
    if (name == "output.weight") return &m->output;
    if (name == "rope_freqs.weight") return &m->rope_freqs;
    if (name == "rope_factors_long.weight") return &factors_long;
    if (name == "rope_factors_short.weight") return &factors_short;
    const size_t dot = name.find('.', 4);
    LayerWeights& l = m->layers[std::stoi(name.substr(4, dot - 4))];
    const std::string w = name.substr(dot + 1);
    if (w == "attn_norm.weight") return &l.attn_norm;
    if (w == "attn_q.weight") return &l.wq;
    if (w == "attn_k.weight") return &l.wk;
    if (w == "attn_v.weight") return &l.wv;
    if (w == "attn_qkv.weight") return &l.wq;  // split into wq, wk, wv below
    if (w == "attn_qkv.bias") return &l.bq;
    if (w == "attn_q.bias") return &l.bq;
    if (w == "attn_k.bias") return &l.bk;
    if (w == "attn_v.bias") return &l.bv;
    if (w == "attn_q_norm.weight") return &l.q_norm;
    if (w == "attn_k_norm.weight") return &l.k_norm;
    if (w == "post_attention_norm.weight") return c.ffn_norm_post_attention ? &l.ffn_norm : &l.post_attn_norm;
    if (w == "post_ffw_norm.weight") return &l.post_ffn_norm;
    if (w == "attn_output.weight") return &l.wo;
    if (w == "ffn_norm.weight") return &l.ffn_norm;
    if (w == "ffn_gate.weight" || w == "ffn_gate_shexp.weight") return &l.w_gate;
    if (w == "ffn_up.weight" || w == "ffn_up_shexp.weight") return &l.w_up;
    if (w == "ffn_down.weight" || w == "ffn_down_shexp.weight") return &l.w_down;
    if (w == "ffn_gate_inp.weight") return &l.router;
    if (w == "ffn_gate_exps.weight") return &l.gate_exps;
    if (w == "ffn_up_exps.weight") return &l.up_exps;
    if (w == "ffn_down_exps.weight") return &l.down_exps;
    if (w == "ffn_gate_inp_shexp.weight") return &l.shared_gate;
    if (w == "attn_output.bias") return &l.bo;
    if (w == "attn_sinks.weight") return &l.sinks;
    if (w == "ffn_gate_inp.bias") return &l.router_b;
    if (w == "ffn_gate_exps.bias") return &l.gate_exps_b;
    if (w == "ffn_up_exps.bias") return &l.up_exps_b;
    if (w == "ffn_down_exps.bias") return &l.down_exps_b;
    return nullptr;
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
  m->resident_weight_bytes_ = static_cast<int64_t>(alloc == 0 ? kHuge : alloc);
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
    const Shape shape = t->dims.size() == 1   ? Shape{t->dims[0]}
                        : t->dims.size() == 2 ? Shape{t->dims[1], t->dims[0]}
                                              : Shape{t->dims[2], t->dims[1], t->dims[0]};
    char* dst = m->memory_.get() + used;
    std::memcpy(dst, t->data, t->nbytes);
    if (spec.f32_only) {  // norms, biases, sinks, RoPE factors: small, and a NaN there spoils every token
      const float* v = reinterpret_cast<const float*>(dst);
      for (int64_t i = 0; i < t->numel(); ++i) {
        if (!std::isfinite(v[i])) {
          return invalid_argument_error(path + ": tensor '" + spec.name + "' holds a non-finite value (" +
                                        std::to_string(v[i]) + ") at element " + std::to_string(i));
        }
      }
    }
    m->file_->drop_pages(*t);  // the copy is the weight now: resident once, not twice
    used += (t->nbytes + 63) / 64 * 64;
    m->file_tensor_bytes_ += static_cast<int64_t>(t->nbytes);
    Tensor* to = slot(spec.name);
    if (to == nullptr) return internal_error(path + ": tensor '" + spec.name + "' has no place in the model");
    *to = Tensor::wrap(dst, shape, t->dtype);
  }
  if (c.tied_output) m->output = m->tok_embd;
  // Fused projections as row views of their tensor: Q, K, V (attn_qkv) and gate, up (ffn_up).
  const int64_t q = int64_t{c.n_heads} * c.head_dim, kv = int64_t{c.n_kv_heads} * c.head_dim;
  for (LayerWeights& l : m->layers) {
    if (c.qkv_fused) {
      const Tensor qkv = l.wq;
      l.wq = qkv.rows(0, q), l.wk = qkv.rows(q, q + kv), l.wv = qkv.rows(q + kv, q + 2 * kv);
      if (l.bq.defined()) {
        const Tensor b = l.bq;
        l.bq = b.rows(0, q), l.bk = b.rows(q, q + kv), l.bv = b.rows(q + kv, q + 2 * kv);
      }
    }
    if (c.gate_up_fused) {
      const Tensor gate_up = l.w_up;
      l.w_gate = gate_up.rows(0, c.n_ff), l.w_up = gate_up.rows(c.n_ff, 2 * int64_t{c.n_ff});
    }
  }
  // Frequency divisors: Llama 3.1's rope_freqs, or LongRoPE's long (the model served past its
  // original context, as llama.cpp does for a context longer than that) or short factors.
  const Tensor& chosen = m->rope_freqs.defined() ? m->rope_freqs : c.rope_factors_long ? factors_long : factors_short;
  const float* factors = chosen.defined() ? chosen.data_as<float>() : nullptr;
  const RopeTable global = rope_table(c, false, factors), local = rope_table(c, true, factors);
  m->inv_freq_[0] = global.inv_freq;
  m->inv_freq_[1] = local.inv_freq;
  for (int l = 0; l < c.n_layers; ++l) {
    LayerAttention a;
    a.window = c.window(l);
    const bool windowed = a.window > 0;
    const float mscale = windowed ? local.mscale : global.mscale;
    a.scale = c.attn_scale;
    a.rope_mscale = mscale;
    a.softcap = c.attn_softcap;
    a.inv_freq = m->inv_freq_[windowed ? 1 : 0].data();
    if (c.attn_sinks) a.sinks = m->layers[static_cast<size_t>(l)].sinks.data_as<float>();
    m->attention_.push_back(a);
  }
  return m;
}

RopeTable rope_table(const ModelConfig& c, bool local, const float* freq_factors) {
  RopeTable t;
  const int half = c.rope_dim / 2;
  t.inv_freq.resize(static_cast<size_t>(half));
  cpu::rope_inv_freq(c.rope_dim, local ? c.rope_freq_base_swa : c.rope_freq_base, freq_factors, t.inv_freq.data());
  t.mscale = c.rope_attn_factor;  // whatever the scaling (llama.cpp's yarn_attn_factor *= it always)
  if ((local && !c.rope_scaling_swa) || c.rope_scaling == RopeScaling::kNone) return t;
  const float freq_scale = 1.0f / c.rope_scale_factor;
  if (c.rope_scaling == RopeScaling::kLinear) {
    for (float& f : t.inv_freq) f *= freq_scale;
    return t;
  }
  // YaRN (ggml's rope_yarn, ext_factor 1): pair i mixes the interpolated angle (freq_scale x) and
  // the extrapolated one by a ramp between the correction dimensions of beta_fast and beta_slow.
  const float base = local ? c.rope_freq_base_swa : c.rope_freq_base;
  auto corr_dim = [&](float n_rot) {
    return static_cast<float>(c.rope_dim) *
           std::log(static_cast<float>(c.rope_orig_context) / (n_rot * 2.0f * static_cast<float>(M_PI))) /
           (2.0f * std::log(base));
  };
  const float low = std::max(0.0f, std::floor(corr_dim(c.yarn_beta_fast)));
  const float high = std::min(static_cast<float>(c.rope_dim - 1), std::ceil(corr_dim(c.yarn_beta_slow)));
  for (int i = 0; i < half; ++i) {
    const float y = (static_cast<float>(i) - low) / std::max(0.001f, high - low);
    const float mix = 1.0f - std::min(1.0f, std::max(0.0f, y));
    t.inv_freq[static_cast<size_t>(i)] *= freq_scale * (1.0f - mix) + mix;
  }
  t.mscale *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
  return t;
}

int64_t Model::weight_bytes_per_token() const {
  int64_t bytes = static_cast<int64_t>(nbytes_for(tok_embd.dtype(), config_.n_embd));
  bytes += static_cast<int64_t>(output.nbytes());
  for (const LayerWeights& l : layers) {
    for (const Tensor* t : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down, &l.router})
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    if (config_.n_expert > 0) {  // the chosen experts' rows
      for (const Tensor* t : {&l.gate_exps, &l.up_exps, &l.down_exps})
        bytes += static_cast<int64_t>(t->nbytes()) / config_.n_expert * config_.n_expert_used;
    }
  }
  return bytes;
}

}  // namespace combs
