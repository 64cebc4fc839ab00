// CPU kernels of the model runner. Activations are f32, row-major [tokens, features]; weights are
// row-major [out, in] in f32, f16, bf16 or q8_0. Matrix products run on the backend's threads;
// SIMD code is chosen at run time (AVX-512 with BF16 dot products, AVX2, or generic).
#pragma once

#include <cstdint>
#include <string_view>

#include "combs/backend/cpu/cpu_backend.h"

namespace combs::cpu {

// kFastest may hand large products to a library (oneDNN) whose summation order depends on the
// number of tokens; kBatchInvariant keeps to combs' kernels, where each output is computed in the
// same order whatever else shares the call, so a token's result is bitwise independent of its
// batch (what continuous batching needs to give every session the tokens it would get alone).
enum class MatmulPolicy : uint8_t { kFastest, kBatchInvariant };

// y[t, o] = sum_i w[o, i] * x[t, i] (+ bias[o]) for t < n_tokens. x: [n_tokens, in], y: [n_tokens,
// out]; w: [out, in] in any dtype (`in` a multiple of its block size). The block types take int8
// dot products with activations rounded to 8 bits per 256 where the CPU has AVX2 or AVX-512 VNNI
// (quant_dot.h), else a row is dequantized and multiplied in f32 (Q8_0: its f32 kernel); larger
// batches under kFastest go to oneDNN in BF16.
void matmul(CpuBackend& backend, const Tensor& w, const float* x, int64_t n_tokens, float* y,
            const float* bias = nullptr, MatmulPolicy policy = MatmulPolicy::kFastest);

// The instruction set matmul uses on this processor: "avx512bf16", "avx2" or "generic".
std::string_view matmul_isa();

// y[t] = x[t] / rms(x[t]) * weight, for n rows of dim elements.
void rms_norm(const float* x, const float* weight, float* y, int64_t n, int64_t dim, float eps);

// Rotary embedding in place on x [n_tokens, n_heads, head_dim] at positions pos[t]: the first
// rope_dim dims of each head rotate by pos * base^(-2i / rope_dim) / freq_factors[i] (factors
// optional). adjacent_pairs: pairs (2i, 2i+1), else (i, i + rope_dim / 2).
void rope(float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
          float freq_base, const float* freq_factors, bool adjacent_pairs);
// As above with the frequencies given (rope_inv_freq's), the rotated dims multiplied by mscale
// (RoPE scaling's magnitude correction, ggml's attn_factor; the others pass unchanged).
void rope(float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
          const float* inv_freq, bool adjacent_pairs, float mscale = 1.0f);
// The rotation frequencies rope uses: inv_freq[i] = 1 / base^(2i / rope_dim) / freq_factors[i],
// i < rope_dim / 2 (the CUDA K/V append's RoPE takes them from here, so both rotate by the same
// f32 angles: at position 30k a 1-ulp difference in a frequency moves the angle by 2e-3).
void rope_inv_freq(int rope_dim, float freq_base, const float* freq_factors, float* inv_freq);

// gate[i] = silu(gate[i]) * up[i].
void silu_mul(float* gate, const float* up, int64_t n);
// gate[i] = gelu(gate[i]) * up[i], GELU's tanh approximation:
// gelu(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))).
void gelu_tanh_mul(float* gate, const float* up, int64_t n);
// gate[i] = swiglu_oai(gate[i], up[i]) (gpt-oss): with g = min(gate, limit) and
// u = clamp(up, -limit, limit), g * sigmoid(alpha g) * (u + 1) — ggml's swiglu_oai.
void swiglu_oai_mul(float* gate, const float* up, int64_t n, float alpha, float limit);
// Mixture-of-experts routing of n tokens (llama.cpp's build_moe_ffn): from the router's logits
// [n, n_expert], each token's k highest-scoring experts (descending, ties to the lower id) into
// ids [n, k] and their weights into weights [n, k]. The weights: their probabilities under a
// softmax over all experts, divided by their sum (at least 2^-14, as llama.cpp clamps it) where
// `normalize`; or, with `softmax_chosen` (gpt-oss: llama.cpp's SOFTMAX_WEIGHT gating), a softmax
// over the k chosen logits alone.
void route_experts(const float* logits, int64_t n, int n_expert, int k, bool normalize, int32_t* ids,
                   float* weights, bool softmax_chosen = false);

// x[i] = cap * tanh(x[i] / cap) (cap > 0).
void softcap(float* x, int64_t n, float cap);

// out[i, :] = table[ids[i], :] as f32. table: [n_rows, dim] in any weight dtype.
void embedding(const Tensor& table, const int32_t* ids, int64_t n, float* out);

// n elements of `src` (a row of `dtype`; n a multiple of its block size) as f32: the block types
// as ggml's reference dequantizes them, bit for bit (combs/backend/quant.h).
void dequantize_row(const void* src, DType dtype, float* dst, int64_t n);
// The reverse: n f32 values stored as `dtype` (16-bit types: round to nearest even; block types:
// quant.h's quantizer, q8_0 per block of 32 with d = max|x| / 127 and q = round(x / d)).
void quantize_row(const float* src, DType dtype, void* dst, int64_t n);

}  // namespace combs::cpu
