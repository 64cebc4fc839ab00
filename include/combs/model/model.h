// A Llama-family model loaded from GGUF: its configuration and weights.
//
// Architectures: `llama` (Llama 2/3, Mistral, TinyLlama; RoPE on adjacent pairs, as llama.cpp's
// converter permutes Q/K for it) and `qwen2` (Q/K/V biases; RoPE on halves, "neox" style).
// Standard llama.cpp tensor names and metadata keys. Weights keep their own dtype (F32, F16, BF16
// or Q8_0) and are copied from the file into huge-page memory at load; norms and biases are F32.
//
// Matrices are row-major [out, in] here (ggml's dims [in, out]): y = W x reads row o of W for
// output o. Immutable after load; safe to share between threads.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "combs/backend/tensor.h"
#include "combs/base/status.h"
#include "combs/kv/kv_layout.h"
#include "combs/model/gguf.h"

namespace combs {

enum class Arch : uint8_t { kLlama, kQwen2 };
enum class RopeStyle : uint8_t {
  kAdjacent,  // rotate (x[2i], x[2i+1]) — llama.cpp's "normal" rope
  kHalves,    // rotate (x[i], x[i + rope_dim/2]) — "neox" rope (qwen2, Hugging Face layout)
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
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
  bool qkv_bias = false;

  // What a KV cache of this model stores, in `dtype`.
  KVGeometry kv_geometry(DType dtype) const { return {n_layers, n_kv_heads, head_dim, dtype}; }
};

struct LayerWeights {
  Tensor attn_norm;           // [n_embd] f32
  Tensor wq, wk, wv, wo;      // [n_heads*hd, n_embd], [n_kv*hd, n_embd] x2, [n_embd, n_heads*hd]
  Tensor bq, bk, bv;          // qwen2 only: f32 biases
  Tensor ffn_norm;            // [n_embd] f32
  Tensor w_gate, w_up, w_down;  // [n_ff, n_embd] x2, [n_embd, n_ff]
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
  std::vector<LayerWeights> layers;

  // Bytes of weights one decode step reads (every matrix once, one embedding row).
  int64_t weight_bytes_per_token() const;

 private:
  Model() = default;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<gguf::GgufFile> file_;
  std::unique_ptr<char, Free> memory_;  // the weights, copied out of the file's mapping
  ModelConfig config_;
};

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
