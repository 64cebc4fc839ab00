#include "combs/backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "combs/backend/quant.h"
#include "kernels/matmul_kernels.h"
#include "kernels/dequant_bf16.h"
#include "kernels/quant_dot.h"
#include "kernels/quant_gemm.h"
#include "onednn_matmul.h"
#include "vec_math.h"

namespace combs::cpu {
namespace {

struct Isa {
  MatmulKernel kernel;
  std::string_view name;
};

const Isa& isa() {
  static const Isa chosen = []() -> Isa {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16")) {
      return {avx512bf16::matmul_rows, "avx512bf16"};
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return {avx2::matmul_rows, "avx2"};
    }
#endif
    return {generic::matmul_rows, "generic"};
  }();
  return chosen;
}

}  // namespace

// From this many tokens on, products take the prefill paths: BF16 (and the block types without an
// int8 GEMM) to oneDNN where it is built in (measured: faster from a few dozen tokens), the block
// types of quant_gemm.h to it (one tile of 16 tokens); decode stays on the streaming kernels.
constexpr int64_t kPrefillMinTokens = 16;

std::string_view matmul_isa() { return onednn::available() ? "avx512bf16+onednn" : isa().name; }

namespace {

// Rows a parallel_for task takes. Decode (a few tokens) spreads the weight stream over the threads
// in tasks of about kDecodeTaskBytes: each task costs an atomic on a line the threads share and
// restarts the weight stream, whose prefetchers take a while to reach full speed again. At 16 rows
// a task the 128,256 x 256 output matrix of a small model made 8,016 tasks of 4 KB (64 KB tasks:
// the tiny MoE's decode 2.5x faster, llama-1b's Q4_K_M +20%); 512 KB tasks gave llama-1b another
// +19% (Q4_K_M) and +20% (Q8_0) on an AMD EPYC (bench/RESULTS.md). At least two tasks a thread
// stay for balance; multiples of 4 rows keep the kernels' 4-row tiles whole. Prefill takes
// `prefill_rows` (a task's rows stay in L2 while every token passes).
constexpr size_t kDecodeTaskBytes = size_t{512} << 10;
int64_t rows_per_task(int64_t out, size_t row_bytes, int64_t n_tokens, int threads,
                      int64_t prefill_rows) {
  if (n_tokens > 4) return prefill_rows;
  int64_t rows =
      static_cast<int64_t>((kDecodeTaskBytes + row_bytes - 1) / std::max<size_t>(row_bytes, 1));
  rows = std::min(rows, out / (2 * std::max(threads, 1)));
  return std::max<int64_t>(16, (rows + 3) / 4 * 4);
}

// The block types with int8 dot products on this CPU (AVX-512 VNNI, else AVX2 with FMA and F16C):
// a row's dot product with activations rounded to 8 bits per 256 (quant_dot.h), and that
// instruction set's rounding of the activations; none where the CPU has neither. The third
// argument counts the format's blocks: of 256 elements, or of 32 for the 32-element formats.
using QuantDot = float (*)(const void* row, const BlockQ8Act* x, int64_t n_blocks);
using QuantizeAct = void (*)(const float* x, int64_t n, BlockQ8Act* out);
using QuantDot4 = void (*)(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]);
// The kernels that differ by instruction set; the other 32-element formats, Q2_K and Q3_K have one
// AVX2 kernel each, for both.
struct QuantKernels {
  QuantizeAct quantize_act = nullptr;  // none: no int8 kernels on this CPU
  // Where set, q4_k and q5_k take the activations arranged by it (quant_dot.h).
  void (*arrange_k4)(BlockQ8Act* x, int64_t n_blocks) = nullptr;
  QuantDot q4_k = nullptr, q5_k = nullptr, q6_k = nullptr, iq4_xs = nullptr;
  QuantDot mxfp4 = avx2::dot_mxfp4, iq4_nl = avx2::dot_iq4_nl, q8_0 = avx2::dot_q8_0;
  // Four rows a call, where the instruction set has them (the same numbers as four calls).
  QuantDot4 q4_k4 = nullptr, q5_k4 = nullptr, q6_k4 = nullptr, iq4_xs4 = nullptr;
  // Q8_0 rows of whole 256s, every row (a matrix's last rows too: one row as four copies), for
  // prefill's numbers (quant_dot.h).
  QuantDot4 q8_04 = nullptr;
};
// Whether this CPU has the AVX-512 parts the int8 kernels use (F, BW, VL, VNNI).
bool cpu_has_avx512vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}
const QuantKernels& quant_kernels() {
  static const QuantKernels chosen = []() -> QuantKernels {
#if defined(__x86_64__)
    __builtin_cpu_init();
    // COMBS_QUANT_ISA=avx2 takes the AVX2 kernels on a machine that has AVX-512 too (their tests).
    const char* forced = std::getenv("COMBS_QUANT_ISA");
    const bool avx2_only = forced && std::string_view(forced) == "avx2";
    if (!avx2_only && cpu_has_avx512vnni()) {
      return {avx512vnni::quantize_act, avx512vnni::arrange_act_k4, avx512vnni::dot_q4_k,
              avx512vnni::dot_q5_k,     avx512vnni::dot_q6_k,       avx512vnni::dot_iq4_xs,
              avx512vnni::dot_mxfp4,    avx512vnni::dot_iq4_nl,     avx512vnni::dot_q8_0,
              avx512vnni::dot4_q4_k,    avx512vnni::dot4_q5_k,      avx512vnni::dot4_q6_k,
              avx512vnni::dot4_iq4_xs,  avx512vnni::dot4_q8_0};
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return {avx2::quantize_act, nullptr, avx2::dot_q4_k, avx2::dot_q5_k, avx2::dot_q6_k, avx2::dot_iq4_xs};
    }
#endif
    return {};
  }();
  return chosen;
}
// The one-pass dequantizer of t to BF16 on this CPU (dequant_bf16.h), or null: AVX-512 (F, BW,
// VL) for Q4_K, Q5_K, Q6_K and Q8_0 — a Q4_K_M model's prompt spent ~10% of its time dequantizing
// row by row to f32 and rounding.
using DequantBf16 = void (*)(const void* src, uint16_t* y, int64_t n_blocks);
DequantBf16 dequant_bf16(DType t) {
#if defined(__x86_64__)
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  }();
  if (!avx512) return nullptr;
  switch (t) {
    case DType::kQ4_K: return avx512::dequant_bf16_q4_k;
    case DType::kQ5_K: return avx512::dequant_bf16_q5_k;
    case DType::kQ6_K: return avx512::dequant_bf16_q6_k;
    case DType::kQ8_0: return avx512::dequant_bf16_q8_0;
    default: return nullptr;
  }
#else
  (void)t;
  return nullptr;
#endif
}

// A row of `in` elements of type t by int8 dot products, or null. The 32-element formats take rows
// of any whole number of their blocks (the activations' last 256 padded with zeros); the others
// whole super-blocks of 256.
QuantDot quant_dot(DType t, int64_t in) {
  const QuantKernels& k = quant_kernels();
  if (!k.quantize_act || in % dtype_block_elems(t) != 0) return nullptr;
  if (in % 256 != 0 && dtype_block_elems(t) != 32) return nullptr;
  switch (t) {
    case DType::kQ4_K: return k.q4_k;
    case DType::kQ5_K: return k.q5_k;
    case DType::kQ6_K: return k.q6_k;
    case DType::kIQ4_XS: return k.iq4_xs;
    case DType::kQ4_0: return avx2::dot_q4_0;
    case DType::kQ4_1: return avx2::dot_q4_1;
    case DType::kQ5_0: return avx2::dot_q5_0;
    case DType::kQ5_1: return avx2::dot_q5_1;
    case DType::kIQ4_NL: return k.iq4_nl;
    case DType::kMXFP4: return k.mxfp4;
    case DType::kQ8_0: return k.q8_0;
    case DType::kQ2_K: return avx2::dot_q2_k;
    case DType::kQ3_K: return avx2::dot_q3_k;
    default: return nullptr;
  }
}

// The block types (Q8_0 too where it has an int8 kernel): rows by their int8 dot
// products where quant_dot has one, else each task dequantizes its weight rows one at a time
// (bit-exact, quant.h) and multiplies every token by it in f32. Each output is one row's dot
// product summed in the same order whatever the number of tokens, so a token's result does not
// depend on its neighbours (batch invariance). The weights stay quantized: a row lives
// dequantized only in the task's buffer.
void matmul_dequantized(CpuBackend& backend, const Tensor& w, const float* x, int64_t n_tokens, float* y,
                        const float* bias) {
  const int64_t in = w.dim(1), out = w.dim(0);
  const size_t row_bytes = nbytes_for(w.dtype(), in);
  const int64_t task_rows = rows_per_task(out, row_bytes, n_tokens, backend.num_threads(), 16);
  if (const QuantDot dot = quant_dot(w.dtype(), in)) {
    const int64_t nb = (in + 255) / 256, count = in / dtype_block_elems(w.dtype());
    thread_local std::vector<BlockQ8Act> xq;  // every token's activations, rounded once per call
    if (xq.size() < static_cast<size_t>(n_tokens * nb)) xq.resize(n_tokens * nb);
    thread_local std::vector<float> padded;  // a row that is not whole 256s, zeros after it
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * in;
      if (in % 256 != 0) {
        padded.assign(static_cast<size_t>(nb * 256), 0.0f);
        std::copy(xt, xt + in, padded.begin());
        xt = padded.data();
      }
      quant_kernels().quantize_act(xt, nb * 256, xq.data() + t * nb);
    }
    if (quant_kernels().arrange_k4 && (w.dtype() == DType::kQ4_K || w.dtype() == DType::kQ5_K)) {
      quant_kernels().arrange_k4(xq.data(), n_tokens * nb);
    }
    const BlockQ8Act* xs = xq.data();
    const QuantKernels& qk = quant_kernels();
    const bool q8_0_rows = w.dtype() == DType::kQ8_0 && qk.q8_04 && in % 256 == 0;
    const QuantDot4 dot4 = w.dtype() == DType::kQ4_K     ? qk.q4_k4
                           : w.dtype() == DType::kQ5_K   ? qk.q5_k4
                           : w.dtype() == DType::kQ6_K   ? qk.q6_k4
                           : w.dtype() == DType::kIQ4_XS ? qk.iq4_xs4
                           : q8_0_rows                   ? qk.q8_04
                                                         : nullptr;
    backend.parallel_for((out + task_rows - 1) / task_rows, [&](int64_t task) {
      const int64_t end = std::min(out, (task + 1) * task_rows);
      int64_t r = task * task_rows;
      for (; dot4 && r + 4 <= end; r += 4) {
        const void* wr = static_cast<const char*>(w.data()) + r * row_bytes;
        for (int64_t t = 0; t < n_tokens; ++t) {
          float s[4];
          dot4(wr, row_bytes, xs + t * nb, count, s);
          for (int j = 0; j < 4; ++j) y[t * out + r + j] = bias ? s[j] + bias[r + j] : s[j];
        }
      }
      for (; r < end; ++r) {
        const void* wr = static_cast<const char*>(w.data()) + r * row_bytes;
        for (int64_t t = 0; t < n_tokens; ++t) {
          float s4[4];
          if (q8_0_rows) dot4(wr, 0, xs + t * nb, count, s4);  // one row, as the others' numbers
          const float s = q8_0_rows ? s4[0] : dot(wr, xs + t * nb, count);
          y[t * out + r] = bias ? s + bias[r] : s;
        }
      }
    });
    return;
  }
  backend.parallel_for((out + task_rows - 1) / task_rows, [&](int64_t task) {
    thread_local std::vector<float> row;
    if (row.size() < static_cast<size_t>(in)) row.resize(in);
    float* wr = row.data();
    for (int64_t r = task * task_rows; r < std::min(out, (task + 1) * task_rows); ++r) {
      dequantize_row(static_cast<const char*>(w.data()) + r * row_bytes, w.dtype(), wr, in);
      for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * in;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < in; ++i) s += wr[i] * xt[i];
        y[t * out + r] = bias ? s + bias[r] : s;
      }
    }
  });
}

// Prefill of the block types quant_gemm.h takes, on AVX-512 VNNI: int8 products of the quants
// with the activations rounded to 8 bits per 256 (as decode rounds them), 64 products an
// instruction where oneDNN's BF16 GEMM does 32, and no BF16 copy of the weights. Under
// kBatchInvariant only the types whose products equal the decode kernels' (Q4_K, Q5_K, Q6_K,
// IQ4_XS, Q8_0, with the AVX-512 decode kernels chosen): a token's numbers then do not depend on
// which path its step took. Off with COMBS_QUANT_GEMM=off (oneDNN, or the decode kernels, then
// take these calls: for A/B measurements).
bool quant_gemm_usable(DType t, int64_t in, MatmulPolicy policy) {
  if (policy == MatmulPolicy::kBatchInvariant &&
      !(avx512vnni::gemm_matches_decode(t) && quant_kernels().q4_k == avx512vnni::dot_q4_k)) {
    return false;
  }
  static const bool on = [] {
    const char* v = std::getenv("COMBS_QUANT_GEMM");
    return !(v && std::string_view(v) == "off") && cpu_has_avx512vnni();
  }();
  return on && avx512vnni::gemm_supports(t) && in % 256 == 0;
}

// The activations rounded and transposed once (tiles of 16 tokens), then tasks of rows: each
// unpacks its rows (about 256 KB of them, so they stay in L2 while every token passes) and
// multiplies every tile by them.
void matmul_quant_gemm(CpuBackend& backend, const Tensor& w, const float* x, int64_t n_tokens, float* y,
                       const float* bias) {
  using avx512vnni::ActTile;
  using avx512vnni::PackedBlock;
  const int64_t in = w.dim(1), out = w.dim(0), nb = in / 256, tiles = (n_tokens + 15) / 16;
  thread_local std::vector<BlockQ8Act> xq;
  thread_local std::vector<ActTile> xt;
  if (xq.size() < static_cast<size_t>(n_tokens * nb)) xq.resize(n_tokens * nb);
  if (xt.size() < static_cast<size_t>(tiles * nb)) xt.resize(tiles * nb);
  BlockQ8Act* xqp = xq.data();
  ActTile* xtp = xt.data();
  backend.parallel_for(n_tokens, [&](int64_t t) { quant_kernels().quantize_act(x + t * in, in, xqp + t * nb); });
  backend.parallel_for(tiles, [&](int64_t i) { avx512vnni::pack_act_tile(xqp, n_tokens, nb, i, xtp + i * nb); });
  const size_t row_bytes = nbytes_for(w.dtype(), in);
  int64_t task_rows = static_cast<int64_t>((size_t{256} << 10) / (nb * sizeof(PackedBlock)));
  task_rows = std::min(task_rows, (out + 2 * backend.num_threads() - 1) / (2 * backend.num_threads()));
  task_rows = std::clamp<int64_t>(task_rows / 4 * 4, 4, 64);
  backend.parallel_for((out + task_rows - 1) / task_rows, [&](int64_t task) {
    const int64_t r0 = task * task_rows, rows = std::min(task_rows, out - r0);
    thread_local std::vector<PackedBlock> wp;
    if (wp.size() < static_cast<size_t>((rows + 3) / 4 * 4 * nb)) wp.resize((rows + 3) / 4 * 4 * nb);
    avx512vnni::pack_rows(w.dtype(), static_cast<const char*>(w.data()) + r0 * row_bytes, row_bytes, rows, in, wp.data());
    avx512vnni::gemm(w.dtype(), wp.data(), rows, xtp, tiles, n_tokens, nb, y + r0, out, bias ? bias + r0 : nullptr);
  });
}

}  // namespace

void matmul(CpuBackend& backend, const Tensor& w, const float* x, int64_t n_tokens, float* y,
            const float* bias, MatmulPolicy policy) {
  const Isa& chosen = isa();
  MatmulTask k{w.data(), w.dtype(), w.dim(1), x, nullptr, n_tokens, y, w.dim(0), bias};
  // Prefill of BF16 weights goes to oneDNN; so does that of Q8_0 weights, dequantized to BF16
  // first (a pass over the weights, repaid many times over by the faster products).
  const bool use_onednn = policy == MatmulPolicy::kFastest &&
                          (w.dtype() == DType::kBF16 || is_block_quant(w.dtype())) &&
                          n_tokens >= kPrefillMinTokens && onednn::available();
  // The block types go to matmul_dequantized unless oneDNN takes the call; Q8_0 does where this CPU
  // has its int8 kernel (AVX2 or AVX-512 VNNI: about twice the bandwidth of its f32 kernel, and
  // the activations' rounding of the other types, of llama.cpp and of the CUDA backend), else it
  // takes its f32 kernel below.
  const bool dequantized = is_block_quant(w.dtype()) &&
                           (w.dtype() != DType::kQ8_0 || quant_dot(DType::kQ8_0, k.in) != nullptr);
  if (n_tokens >= kPrefillMinTokens && quant_gemm_usable(w.dtype(), k.in, policy)) {
    return matmul_quant_gemm(backend, w, x, n_tokens, y, bias);
  }
  if (dequantized && !use_onednn) return matmul_dequantized(backend, w, x, n_tokens, y, bias);
  thread_local std::vector<uint16_t> x_bf16, w_bf16;  // grow to the largest call, then stay
  if ((w.dtype() == DType::kBF16 && chosen.name == "avx512bf16") || use_onednn) {
    if (x_bf16.size() < static_cast<size_t>(n_tokens * k.in)) x_bf16.resize(n_tokens * k.in);
    uint16_t* xb = x_bf16.data();
    if (n_tokens >= 8) {  // spread large conversions (prefill) over the threads
      backend.parallel_for(n_tokens, [&](int64_t t) { f32_to_bf16_row(x + t * k.in, xb + t * k.in, k.in); });
    } else {
      f32_to_bf16_row(x, xb, n_tokens * k.in);
    }
    k.x_bf16 = xb;
  }
  if (use_onednn) {
    const uint16_t* wb = static_cast<const uint16_t*>(k.w);
    if (is_block_quant(w.dtype())) {  // rows to bf16: in one pass where a kernel has the type
      if (w_bf16.size() < static_cast<size_t>(k.out * k.in)) w_bf16.resize(k.out * k.in);
      uint16_t* dst = w_bf16.data();
      const size_t row_bytes = nbytes_for(w.dtype(), k.in);
      const DequantBf16 direct = dequant_bf16(w.dtype());
      const int64_t blocks = k.in / dtype_block_elems(w.dtype());
      backend.parallel_for(k.out, [&](int64_t r) {
        const char* src = static_cast<const char*>(k.w) + r * row_bytes;
        if (direct) return direct(src, dst + r * k.in, blocks);
        thread_local std::vector<float> row;
        if (row.size() < static_cast<size_t>(k.in)) row.resize(k.in);
        dequantize_row(src, w.dtype(), row.data(), k.in);
        f32_to_bf16_row(row.data(), dst + r * k.in, k.in);
      });
      wb = dst;
    }
    backend.park_workers();  // oneDNN's OpenMP threads take the cores: ours must not spin on them
    if (onednn::matmul_bf16(k.x_bf16, wb, y, n_tokens, k.out, k.in, backend.num_threads())) {
      if (bias) {
        for (int64_t t = 0; t < n_tokens; ++t)
          for (int64_t o = 0; o < k.out; ++o) y[t * k.out + o] += bias[o];
      }
      return;
    }
  }
  if (dequantized) return matmul_dequantized(backend, w, x, n_tokens, y, bias);  // oneDNN declined
  const int64_t task_rows =
      rows_per_task(k.out, nbytes_for(w.dtype(), k.in), n_tokens, backend.num_threads(), 64);
  const int64_t n_tasks = (k.out + task_rows - 1) / task_rows;
  backend.parallel_for(n_tasks, [&](int64_t i) {
    chosen.kernel(k, i * task_rows, std::min(k.out, (i + 1) * task_rows));
  });
}

void rms_norm(const float* x, const float* weight, float* y, int64_t n, int64_t dim, float eps) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * dim;
    float* yr = y + t * dim;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * scale * weight[i];
  }
}

void rope_inv_freq(int rope_dim, float freq_base, const float* freq_factors, float* inv_freq) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    // As Hugging Face computes it: 1 / base^(2i / dim) in f32.
    inv_freq[i] = 1.0f / std::pow(freq_base, static_cast<float>(2 * i) / static_cast<float>(rope_dim));
    if (freq_factors) inv_freq[i] /= freq_factors[i];
  }
}

void rope(float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
          float freq_base, const float* freq_factors, bool adjacent_pairs) {
  float inv_freq[2048];  // rope_dim / 2 <= 2048: head_dim is at most 4096 (validate_kv_geometry)
  rope_inv_freq(rope_dim, freq_base, freq_factors, inv_freq);
  rope(x, pos, n_tokens, n_heads, head_dim, rope_dim, inv_freq, adjacent_pairs);
}

void rope(float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
          const float* inv_freq, bool adjacent_pairs, float mscale) {
  const int half = rope_dim / 2;
  thread_local std::vector<float> cs, sn;
  cs.resize(static_cast<size_t>(half));
  sn.resize(static_cast<size_t>(half));
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos[t]) * inv_freq[i];
      cs[i] = static_cast<float>(std::cos(static_cast<double>(angle))) * mscale;
      sn[i] = static_cast<float>(std::sin(static_cast<double>(angle))) * mscale;
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const int a = adjacent_pairs ? 2 * i : i;
        const int b = adjacent_pairs ? 2 * i + 1 : i + half;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x0 * sn[i] + x1 * cs[i];
      }
    }
  }
}

void silu_mul(float* gate, const float* up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

void swiglu_oai_mul(float* gate, const float* up, int64_t n, float alpha, float limit) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
    gate[i] = g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
  }
}

void route_experts(const float* logits, int64_t n, int n_expert, int k, bool normalize, int32_t* ids,
                   float* weights, bool softmax_chosen) {
  std::vector<int32_t> order(static_cast<size_t>(n_expert));
  for (int64_t t = 0; t < n; ++t) {
    const float* z = logits + t * n_expert;
    for (int i = 0; i < n_expert; ++i) order[static_cast<size_t>(i)] = i;
    // Ranked by score (softmax keeps the order, and probabilities that underflow to 0 do not tie).
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    for (int j = 0; j < k; ++j) ids[t * k + j] = order[static_cast<size_t>(j)];
    // The weights: the chosen scores' own softmax (the first is the largest), or their share of
    // the softmax over every expert (renormalized over the chosen where `normalize`).
    const float mx = softmax_chosen ? z[order[0]] : *std::max_element(z, z + n_expert);
    float sum = 0.0f;
    if (softmax_chosen) {
      for (int j = 0; j < k; ++j) sum += (weights[t * k + j] = std::exp(z[ids[t * k + j]] - mx));
      for (int j = 0; j < k; ++j) weights[t * k + j] /= sum;
      continue;
    }
    for (int i = 0; i < n_expert; ++i) sum += std::exp(z[i] - mx);
    float chosen = 0.0f;
    for (int j = 0; j < k; ++j) chosen += (weights[t * k + j] = std::exp(z[ids[t * k + j]] - mx) / sum);
    if (normalize) {
      chosen = std::max(chosen, 6.103515625e-5f);
      for (int j = 0; j < k; ++j) weights[t * k + j] /= chosen;
    }
  }
}

void gelu_tanh_mul(float* gate, const float* up, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    gate[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x))) * up[i];
  }
}

void softcap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

void dequantize_row(const void* src, DType dtype, float* dst, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(v));
      }
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(h[i]);
      return;
    }
    case DType::kBF16: {
      const auto* h = static_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    }
    case DType::kQ8_0: {
      const auto* b = static_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < n / 32; ++i) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < 32; ++j) dst[i * 32 + j] = d * static_cast<float>(b[i].qs[j]);
      }
      return;
    }
    default: {
      const QuantFormat* f = quant_format(dtype);
      f->dequantize(src, dst, n / f->block_elems);
      return;
    }
  }
}

void quantize_row(const float* src, DType dtype, void* dst, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_f16(src[i]);
      return;
    case DType::kBF16:
      f32_to_bf16_row(src, static_cast<uint16_t*>(dst), n);
      return;
    default: {
      const QuantFormat* f = quant_format(dtype);
      quantizer(dtype)(src, dst, n / f->block_elems);
      return;
    }
  }
}

void embedding(const Tensor& table, const int32_t* ids, int64_t n, float* out) {
  const int64_t dim = table.dim(1);
  const size_t row_bytes = nbytes_for(table.dtype(), dim);
  for (int64_t i = 0; i < n; ++i) {
    dequantize_row(static_cast<const char*>(table.data()) + ids[i] * row_bytes, table.dtype(),
                   out + i * dim, dim);
  }
}

}  // namespace combs::cpu
