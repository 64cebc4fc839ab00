// The outputs of one decode-sized matmul (the BF16/F16 kernel in cuda_ops.cu and the block-quantized
// one in quant_matmul.cu). Private to the CUDA backend.
#pragma once

#include <cstdint>

namespace combs::cuda {

// Up to three outputs of one small-batch matmul: rows [0, end[0]) go to y[0], [end[0], end[1])
// to y[1], ... (a fused Q/K/V or gate/up projection). Gate/up pairs (PAIRS): one output of end[0]
// rows, silu(gate) * up at y[0] (in the dtype the down projection takes).
struct GemvOut {
  float* y[3];
  const float* bias[3];
  int64_t end[3];
  int count;
  bool accumulate;       // y += result (the residual stream) instead of y = result
  const float* norm_w;   // when set: x is RMS-normalized with these weights as it is staged
  float eps;
};

__device__ inline float silu(float g) { return g / (1.0f + expf(-g)); }

}  // namespace combs::cuda
