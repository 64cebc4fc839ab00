// A decoder-only transformer loaded from GGUF: its configuration and weights.
//
// Architectures are data: one ArchSpec each (model.cc's table) says which norms, biases, q/k
// norms, activation, embedding scale, softcaps, RoPE style and sliding-window pattern it has;
// read_config resolves it with the file's keys into a ModelConfig, and the one runner per backend
// follows the config (no per-architecture code in a forward). Known: `llama` (Llama 2/3, Mistral,
// TinyLlama; RoPE on adjacent pairs, as llama.cpp's converter permutes Q/K for it; linear and YaRN
// RoPE scaling, Llama 3.1's rope_freqs), `qwen2` (Q/K/V biases; RoPE on halves, "neox" style),
// `qwen3` (per-head RMSNorm of q and k), `gemma2` (embeddings scaled, norms after each sublayer,
// GELU, attention and final logit softcapping, every other layer sliding-window) and `gemma3` (as
// gemma2 with q/k norms instead of the attention softcap, five of six layers sliding-window with
// their own RoPE base) and `phi3` (Q/K/V fused in attn_qkv, gate and up in ffn_up, partial rotary,
// LongRoPE factors); with a mixture of experts as the FFN: `qwen3moe` (qwen3's attention),
// `qwen2moe` (qwen2's, and a shared expert), `llama` files with expert_count (Mixtral) and
// `gpt-oss` (biases on Q/K/V, the attention output, the router and every expert; attention sinks;
// top-k-then-softmax routing; the clamped SwiGLU; every other layer windowed, all YaRN-scaled).
// Standard llama.cpp tensor names and metadata keys, read as llama.cpp reads
// them (its gemma converters store norm weights already offset by one, so they load unchanged). Weights keep their own dtype (F32, F16, BF16
// or any block type) and are copied from the file into huge-page memory at load; norms and biases are F32.
//
// Matrices are row-major [out, in] here (ggml's dims [in, out]): y = W x reads row o of W for
// output o. Immutable after load; safe to share between threads.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "combs/backend/tensor.h"
#include "combs/base/status.h"
#include "combs/kv/kv_layout.h"
#include "combs/model/gguf.h"

namespace combs {

enum class RopeStyle : uint8_t {
  kAdjacent,  // rotate (x[2i], x[2i+1]) — llama.cpp's "normal" rope
  kHalves,    // rotate (x[i], x[i + rope_dim/2]) — "neox" rope (qwen2, Hugging Face layout)
};

enum class Activation : uint8_t {
  kSilu,       // SwiGLU: silu(gate) * up
  kGeluTanh,   // GeGLU: gelu(gate) * up, tanh approximation (gemma)
  kSwigluOai,  // gpt-oss: g = min(gate, 7), u = clamp(up, -7, 7): g * sigmoid(1.702 g) * (u + 1)
};
// gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants).
inline constexpr float kSwigluOaiAlpha = 1.702f, kSwigluOaiLimit = 7.0f;
// RoPE context scaling ({arch}.rope.scaling.type): angles divided by the factor (linear), or
// YaRN's per-frequency blend of interpolated and extrapolated angles with its magnitude scale.
enum class RopeScaling : uint8_t { kNone, kLinear, kYarn };

struct ModelConfig {
  std::string arch_name;   // general.architecture
  int n_vocab = 0;
  int n_embd = 0;          // {arch}.embedding_length
  int n_layers = 0;        // {arch}.block_count
  int n_heads = 0;         // {arch}.attention.head_count
  int n_kv_heads = 0;      // {arch}.attention.head_count_kv (default n_heads)
  int head_dim = 0;        // {arch}.attention.key_length (default n_embd / n_heads)
  int n_ff = 0;            // {arch}.feed_forward_length
  int64_t context_length = 0;   // {arch}.context_length
  float rope_freq_base = 10000.0f;  // {arch}.rope.freq_base
  int rope_dim = 0;        // {arch}.rope.dimension_count (default head_dim)
  float rms_eps = 1e-5f;   // {arch}.attention.layer_norm_rms_epsilon
  RopeStyle rope_style = RopeStyle::kAdjacent;
  bool tied_output = false;  // no output.weight: logits use token_embd.weight
  bool qkv_bias = false;     // attn_q/k/v.bias
  bool qk_norm = false;      // attn_q_norm / attn_k_norm: RMSNorm of every q and k head before RoPE
  bool post_norms = false;   // post_attention_norm / post_ffw_norm on each sublayer's output
  bool qkv_fused = false;    // the file has attn_qkv (Q, K, V rows in one tensor) for attn_q/k/v
  bool gate_up_fused = false;  // ffn_up holds the gate's rows then the up's (phi3), no ffn_gate
  bool rope_factors_long = false;  // LongRoPE: the long factors (context_length > rope_orig_context)
  bool attn_out_bias = false;  // attn_output.bias (gpt-oss)
  bool attn_sinks = false;     // attn_sinks.weight: a logit per query head in every softmax (gpt-oss)
  // The FFN's input norm is stored as post_attention_norm (gpt-oss, whose converter names it after
  // Hugging Face's post_attention_layernorm), not ffn_norm.
  bool ffn_norm_post_attention = false;
  Activation activation = Activation::kSilu;
  float embed_scale = 1.0f;    // the embeddings are multiplied by this (gemma: sqrt(n_embd))
  float attn_scale = 0.0f;     // the scores' scale: 1/sqrt(head_dim), or what the architecture implies
  float attn_softcap = 0.0f;   // scores -> c * tanh(scores / c) ({arch}.attn_logit_softcapping); 0: none
  float final_softcap = 0.0f;  // logits likewise ({arch}.final_logit_softcapping)
  // Sliding-window attention: a windowed layer's query sees the last sliding_window keys (itself
  // included: keys at pos - window < k <= pos, llama.cpp's LLAMA_SWA_TYPE_STANDARD) and rotates
  // with rope_freq_base_swa; the others see everything.
  int sliding_window = 0;              // {arch}.attention.sliding_window; 0: none
  std::vector<uint8_t> layer_windowed;  // per layer ({arch}.attention.sliding_window_pattern)
  float rope_freq_base_swa = 10000.0f;  // {arch}.rope.freq_base_swa
  RopeScaling rope_scaling = RopeScaling::kNone;  // of the global layers (and windowed ones where rope_scaling_swa)
  bool rope_scaling_swa = false;       // windowed layers scaled as the global ones (gpt-oss); else unscaled
  float rope_scale_factor = 1.0f;      // {arch}.rope.scaling.factor
  int64_t rope_orig_context = 0;       // {arch}.rope.scaling.original_context_length (YaRN)
  float rope_attn_factor = 1.0f;       // {arch}.rope.scaling.attn_factor
  float yarn_beta_fast = 32.0f, yarn_beta_slow = 1.0f;
  // Mixture of experts (n_expert > 0; llama.cpp's build_moe_ffn): the FFN is n_expert experts of
  // width n_ff_exp. A router (ffn_gate_inp) scores them per token, softmax over all; the
  // n_expert_used most probable (ties: the lower id) run, and their outputs are summed weighted by
  // their probabilities, renormalized to sum 1 where expert_weights_norm. shared_expert
  // (qwen2moe): a dense FFN of width n_ff runs beside them (the *_shexp tensors), its output
  // scaled by sigmoid(ffn_gate_inp_shexp . x). expert_softmax_chosen (gpt-oss): the top k by the
  // router's logits, weighted by a softmax over those k alone. expert_biases (gpt-oss): the router
  // and every expert's projections add a bias (ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias).
  int n_expert = 0;        // {arch}.expert_count
  int n_expert_used = 0;   // {arch}.expert_used_count
  int n_ff_exp = 0;        // {arch}.expert_feed_forward_length (the architecture's default otherwise)
  bool expert_weights_norm = false;
  bool shared_expert = false;
  bool expert_softmax_chosen = false;
  bool expert_biases = false;

  // Whether layers have a dense FFN (w_gate, w_up, w_down of width n_ff): every model without
  // experts, and the shared expert of one with.
  bool dense_ffn() const { return n_expert == 0 || shared_expert; }

  // Keys layer `l` attends to back from each query (0: all).
  int window(int layer) const { return layer_windowed.empty() || !layer_windowed[layer] ? 0 : sliding_window; }
  // The widest window over the layers: how far back any layer reads; 0 where a layer reads every
  // key (or none is windowed).
  int widest_window() const {
    int w = n_layers > 0 ? window(0) : 0;
    for (int l = 1; l < n_layers && w > 0; ++l) w = window(l) == 0 ? 0 : std::max(w, window(l));
    return w;
  }

  // What a KV cache of this model stores, in `dtype`.
  KVGeometry kv_geometry(DType dtype) const { return {n_layers, n_kv_heads, head_dim, dtype}; }
};

// Sets the architecture's fixed traits (arch_name, rope_style, qkv_bias, qk_norm, post_norms,
// activation, and embed_scale from config->n_embd, which must be set) from its description; an error naming the known ones for any other name.
// read_config starts from this; combs-mkmodel uses it to lay out a file's tensors.
Status apply_architecture(std::string_view name, ModelConfig* config);

struct LayerWeights {
  Tensor attn_norm;           // [n_embd] f32
  Tensor wq, wk, wv, wo;      // [n_heads*hd, n_embd], [n_kv*hd, n_embd] x2, [n_embd, n_heads*hd]
                              // (row views of attn_qkv where the file fuses them; w_gate, w_up of ffn_up)
  Tensor bq, bk, bv;          // qkv_bias: f32 biases
  Tensor q_norm, k_norm;      // qk_norm: [head_dim] f32
  Tensor post_attn_norm;      // post_norms: [n_embd] f32
  Tensor ffn_norm;            // [n_embd] f32
  Tensor w_gate, w_up, w_down;  // [n_ff, n_embd] x2, [n_embd, n_ff]
  Tensor post_ffn_norm;       // post_norms: [n_embd] f32
  // Mixture of experts: the router [n_expert, n_embd] (ffn_gate_inp) and the experts stacked,
  // [n_expert, n_ff_exp, n_embd] (gate, up) and [n_expert, n_embd, n_ff_exp] (down): expert() views
  // one. shared_gate: shared_expert's gate [n_embd] f32. (w_gate, w_up, w_down: the dense FFN, or
  // the shared expert.)
  Tensor router, gate_exps, up_exps, down_exps;
  Tensor shared_gate;
  // gpt-oss: the attention output's bias [n_embd], the sinks [n_heads], the router's bias
  // [n_expert] and the experts' biases [n_expert, n_ff_exp] (gate, up) and [n_expert, n_embd] (down).
  Tensor bo, sinks;
  Tensor router_b, gate_exps_b, up_exps_b, down_exps_b;
};

// Expert `i` of a stacked [n_expert, out, in] tensor as an [out, in] matrix (a view).
inline Tensor expert(const Tensor& stacked, int64_t i) {
  return stacked.rows(i, i + 1).reshape({stacked.dim(1), stacked.dim(2)});
}

// How one layer attends, resolved at load: the scores' scale, the window (windowed layers rotate
// by the local RoPE table: Model::rope_inv_freq(true)), the softcap, its RoPE frequencies (rope_dim / 2 of them, host memory) and the magnitude its rotated dims take (RoPE
// scaling's correction: not foldable into the scale where only part of each head rotates).
struct LayerAttention {
  float scale = 1.0f;
  float rope_mscale = 1.0f;
  int window = 0;
  float softcap = 0.0f;
  const float* inv_freq = nullptr;
  const float* sinks = nullptr;  // n_heads logits (host memory), where the model has them
};

class Model {
 public:
  // Reads and checks everything: clear errors name the file and the key or tensor.
  static StatusOr<std::unique_ptr<Model>> load(const std::string& path);
  // From metadata alone (also used for vocab-only files).
  static StatusOr<ModelConfig> read_config(const gguf::GgufFile& file);

  const ModelConfig& config() const { return config_; }
  const gguf::GgufFile& file() const { return *file_; }

  Tensor tok_embd;     // [n_vocab, n_embd]
  Tensor output_norm;  // [n_embd] f32
  Tensor output;       // [n_vocab, n_embd]; the same as tok_embd when tied
  Tensor rope_freqs;   // optional [rope_dim / 2] f32 frequency divisors (Llama 3.1 style scaling)
  // (LongRoPE's rope_factors_long / _short are read into the RoPE tables at load.)
  std::vector<LayerWeights> layers;

  // Bytes of weights one decode step reads (every matrix once, one embedding row; of the experts,
  // the router and n_expert_used experts).
  int64_t weight_bytes_per_token() const;
  // The weights' bytes in the file (every tensor the model reads, as stored: blocks stay blocks),
  // and the host memory holding them (one buffer: each tensor 64-byte aligned, the whole rounded
  // up to 2 MB huge pages). No other copy of a weight is made on the host.
  int64_t file_tensor_bytes() const { return file_tensor_bytes_; }
  int64_t resident_weight_bytes() const { return resident_weight_bytes_; }

  const LayerAttention& attention(int layer) const { return attention_[layer]; }
  // The RoPE frequencies of the global (local = false) or windowed layers: rope_dim / 2 values.
  const std::vector<float>& rope_inv_freq(bool local) const { return inv_freq_[local ? 1 : 0]; }

 private:
  Model() = default;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<gguf::GgufFile> file_;
  std::unique_ptr<char, Free> memory_;  // the weights, copied out of the file's mapping
  int64_t file_tensor_bytes_ = 0, resident_weight_bytes_ = 0;
  ModelConfig config_;
  std::vector<float> inv_freq_[2];
  std::vector<LayerAttention> attention_;
};

// The RoPE of a config's global (local = false) or windowed layers: the frequencies every pair
// rotates by (base^(-2i / rope_dim), divided by freq_factors where given, then scaled as the
// config's RoPE scaling says, as ggml's rope_yarn does) and the factor that scaling multiplies
// the rotated q and k by (1 but for YaRN and an attn_factor).
struct RopeTable {
  std::vector<float> inv_freq;
  float mscale = 1.0f;
};
RopeTable rope_table(const ModelConfig& config, bool local, const float* freq_factors);

// The weights of a model, by llama.cpp name, with their expected ggml dims ([in, out] for
// matrices), whether they must be present, and whether they must be f32. The one list that
// loading, validation and combs-mkmodel all use.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> dims;
  bool required = true;
  bool f32_only = false;
};
std::vector<WeightSpec> weight_specs(const ModelConfig& config);

}  // namespace combs
