// Random-weight models of named shapes, written as GGUF (combs-mkmodel, tests, the server's
// embedded default). Weights are deterministic from a seed: each tensor draws from a generator
// seeded by (seed, tensor name), so the same options always write the same file.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "combs/backend/dtype.h"
#include "combs/model/quant_mix.h"
#include "combs/base/status.h"

namespace combs {

struct ModelShape {
  std::string name;
  std::string arch;  // general.architecture: one model.cc describes (llama, qwen2, qwen3, gemma2, gemma3)
  int n_embd = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, n_ff = 0;
  int head_dim = 0;  // written as attention.key_length / value_length when set; 0: n_embd / n_heads
  int64_t context_length = 4096;
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = false;
  // The embeddings' standard deviation as stored; 0: 1 / embed_scale (std 1 as the runner sees
  // them, as trained gemma embeddings are).
  float embd_std = 0.0f;
  // Written only when set, so that a file relies on the architecture's defaults otherwise.
  int sliding_window = 0;          // attention.sliding_window
  int swa_pattern = 0;             // attention.sliding_window_pattern (every n-th layer global)
  bool swa_all = false;            // attention.sliding_window_pattern = 0: every layer windowed
  float rope_freq_base_swa = 0.0f;  // rope.freq_base_swa
  float attn_softcap = 0.0f, final_softcap = 0.0f;  // attn_ / final_logit_softcapping
  std::string rope_scaling;        // rope.scaling.type: "linear" or "yarn"
  float rope_scale_factor = 0.0f;  // rope.scaling.factor
  int64_t rope_orig_context = 0;   // rope.scaling.original_context_length
  float rope_attn_factor = 0.0f;   // rope.scaling.attn_factor
  int rope_dim = 0;                // rope.dimension_count; 0: head_dim (partial rotary below it)
  bool fused_qkv = false;          // attn_qkv instead of attn_q, attn_k, attn_v
  bool longrope = false;           // rope_factors_long / rope_factors_short (LongRoPE)
  // Mixture of experts (n_expert > 0): expert_count, expert_used_count, and when set
  // expert_feed_forward_length / expert_shared_feed_forward_length.
  int n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
};

// Tiny shapes for tests (head_dim 64, small windows so that short contexts cross them): "tiny"
// (llama), "qwen2-tiny", "qwen2-tiny-384" (rows of 384: K-quant types fall back, as llama.cpp's for
// Qwen2-0.5B's 896; ffn_down's rows of 768 keep them), "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "gemma3-swa-tiny" (every layer
// windowed), "llama-yarn-tiny", "phi3-tiny",
// and with experts "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny" (llama), "gpt-oss-tiny"; real shapes for
// benchmarks: "llama-1b" (Llama-3.2-1B), "llama-8b" (Llama-3.1-8B), "qwen3-8b" (Qwen3-8B),
// "gemma3-4b" (Gemma-3-4B), "qwen3-30b-a3b" (Qwen3-30B-A3B), "gpt-oss-20b".
StatusOr<ModelShape> named_shape(std::string_view name);
std::vector<std::string> shape_names();

struct RandomModelOptions {
  ModelShape shape;
  DType dtype = DType::kBF16;  // of the matrices (norms and biases stay F32)
  // When set, each matrix's type by llama.cpp's rules for this file type (quant_mix.h) instead.
  const QuantMix* mix = nullptr;
  uint64_t seed = 1;
  // A GGUF whose tokenizer.* metadata (vocabulary) is copied; empty: the built-in byte-level
  // vocabulary (<unk>, <s>, </s> and the 256 byte tokens <0x00>..<0xFF>; phi3 adds <|endoftext|>).
  std::string vocab_path;
  // Written as tokenizer.chat_template (over a template the vocabulary file carries); empty: none
  // but the vocabulary's.
  std::string chat_template;
};

Status write_random_model(const RandomModelOptions& options, const std::string& path);

// Sets options->dtype (f32, f16, bf16) or options->mix (q4_k_m, q8_0, ...: quant_mix.h) from a
// name; an error naming the choices for any other.
Status set_weight_type(std::string_view name, RandomModelOptions* options);

// The same, written once: nothing when `path` exists, else written to path + ".tmp" and renamed,
// so that an interrupted write leaves no partial file where a later run would reuse it (the
// server's default model, the benchmarks' models).
Status write_random_model_once(const RandomModelOptions& options, const std::string& path);

}  // namespace combs
