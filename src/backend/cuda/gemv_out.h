// The outputs of one decode-sized matmul (the BF16/F16 kernels in cuda_ops.cu and the
// block-quantized ones in quant_matmul.cu), and the tile epilogue of the tensor-core ones
// (finish_mma_tile). Private to the CUDA backend.
#pragma once

#include <cstdint>

#include "float_convert.h"

namespace combs::cuda {

// Up to three outputs of one small-batch matmul: rows [0, end[0]) go to y[0], [end[0], end[1])
// to y[1], ... (a fused Q/K/V or gate/up projection). Gate/up pairs (PAIRS): one output of end[0]
// rows, act(gate) * up at y[0] (in the dtype the down projection takes): silu, or GELU's tanh
// approximation where gelu_tanh is set (gemma's).
struct GemvOut {
  float* y[3];
  const float* bias[3];
  int64_t end[3];
  int count;
  bool accumulate;       // y += result (the residual stream) instead of y = result
  const float* norm_w;   // when set: x is RMS-normalized with these weights as it is staged
  float eps;
  bool gelu_tanh = false;  // PAIRS: the gate's activation is GELU (tanh), not silu
};

// Where weight row `row`'s result goes: its output's y and bias, that output's rows and the row's
// index in it. Selects, not an index (a runtime index into outs would copy it to local memory).
struct GemvRow {
  float* y;
  const float* bias;
  int64_t rows, index;
};
// The rows of all outputs (outs.end's last), by selects.
__device__ __forceinline__ int64_t gemv_rows(const GemvOut& outs) {
  return outs.count == 1 ? outs.end[0] : outs.count == 2 ? outs.end[1] : outs.end[2];
}
__device__ __forceinline__ GemvRow gemv_row(const GemvOut& outs, int64_t row) {
  const int seg = row < outs.end[0] ? 0 : row < outs.end[1] ? 1 : 2;
  const int64_t begin = seg == 0 ? 0 : seg == 1 ? outs.end[0] : outs.end[1];
  return {seg == 0 ? outs.y[0] : seg == 1 ? outs.y[1] : outs.y[2],
          seg == 0 ? outs.bias[0] : seg == 1 ? outs.bias[1] : outs.bias[2],
          (seg == 0 ? outs.end[0] : seg == 1 ? outs.end[1] : outs.end[2]) - begin, row - begin};
}

__device__ inline float silu(float g) { return g / (1.0f + expf(-g)); }
// GELU's tanh approximation (cpu::gelu_tanh_mul's and cuda::gelu_tanh_mul's formula).
__device__ inline float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}
// The gate/up pair's product, act(gate) * up.
__device__ inline float gated(const GemvOut& outs, float gate, float up) {
  return outs.gelu_tanh ? gelu_tanh(gate) * up : silu(gate) * up;
}

// The end of a tile of the tensor-core decode kernels (gemv_mma_kernel, q4k_mma_gemv_kernel): 16
// weight rows from row0 and up to 8 rows of x, each of kWarps warps holding its share of the sums as
// mma C fragments acc[part][0..3] (lane g = lane / 4, t = lane % 4: c[0..1] row g, x rows 2t, 2t + 1;
// c[2..3] row g + 8). The warps' sums are added in warp order through sums[parity] (one barrier a
// tile; the parity alternates, so a tile's sums are not overwritten while the one before is read)
// and acc is cleared. Outputs: outs' rows, or (kParts 2: gate rows and their up rows) gated(gate,
// up) into y[0] [n, units] as OutT.
template <int kWarps, int kParts, typename OutT>
__device__ __forceinline__ void finish_mma_tile(float (&sums)[2][kWarps][4 * kParts][32], float (&acc)[kParts][4],
                                                int& parity, int64_t row0, const GemvOut& outs, int n, int64_t units) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sums[parity][warp][p * 4 + i][lane] = acc[p][i], acc[p][i] = 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 4 * 32) {
    const int i = threadIdx.x / 32, l = threadIdx.x % 32;
    const int64_t row = row0 + l / 4 + 8 * (i / 2);
    const int r = 2 * (l % 4) + i % 2;  // the row of x
    float s[kParts];
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      s[p] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s[p] += sums[parity][w][p * 4 + i][l];
    }
    if (r < n && row < units) {
      if constexpr (kParts == 2) {
        reinterpret_cast<OutT*>(outs.y[0])[r * units + row] = from_f32<OutT>(gated(outs, s[0], s[1]));
      } else {
        const GemvRow to = gemv_row(outs, row);
        float* dst = to.y + r * to.rows + to.index;
        *dst = (outs.accumulate ? *dst : 0.0f) + s[0] + (to.bias ? to.bias[to.index] : 0.0f);
      }
    }
  }
  parity ^= 1;
}

}  // namespace combs::cuda
