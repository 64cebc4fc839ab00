// The outputs of one decode-sized matmul (the BF16/F16 kernel in cuda_ops.cu and the block-quantized
// one in quant_matmul.cu). Private to the CUDA backend.
#pragma once

#include <cstdint>

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

}  // namespace combs::cuda
