// Device ops of the CUDA backend, on device pointers, queued on the backend's stream (they
// return when queued; errors of the launch come back at once, errors of the kernel at the next
// synchronize()). Activations are f32; weights keep their dtype (F32, F16, BF16).
#pragma once

#include <cstdint>

#include "combs/backend/cuda/cuda_backend.h"
#include "combs/backend/tensor.h"

namespace combs::cuda {

// y[t, :] = x[t, :] @ w^T (+ bias): w [out, in] on the device (F32, F16 or BF16), x [n, in] f32,
// y [n, out] f32. F16/BF16 weights: cuBLAS on tensor cores with x rounded to the weight's dtype
// and f32 accumulation; F32: cuBLAS SGEMM.
Status matmul(CudaBackend& b, const Tensor& w, const float* x, int64_t n, float* y, const float* bias = nullptr);

// out[i, :] = table[ids[i], :] as f32; table [n_rows, dim] on the device (F32, F16, BF16).
// Ids outside [0, n_rows) are the caller's to exclude (the runner validates them).
Status embedding(CudaBackend& b, const Tensor& table, const int32_t* ids, int64_t n, float* out);

// Fused residual add and RMSNorm over n rows of dim: if delta, residual += delta; then
// y = residual / rms(residual) * weight.
Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, float* y, int64_t n,
                    int64_t dim, float eps);

// Rotary embedding in place, as cpu::rope: x [n_tokens, n_heads, head_dim] at positions pos[t];
// inv_freq: the rope_dim / 2 frequencies of cpu::rope_inv_freq, on the device (computed once per
// model on the host, so CPU and GPU rotate by the same f32 angles: at position 30k a 1-ulp
// difference in a frequency moves the angle by 2e-3).
Status rope(CudaBackend& b, float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
            const float* inv_freq, bool adjacent_pairs);

// dst[i, :] = src[rows[i], :] for n rows of dim f32 (rows on the device).
Status gather_rows(CudaBackend& b, const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst);

// gate[i] = silu(gate[i]) * up[i].
Status silu_mul(CudaBackend& b, float* gate, const float* up, int64_t n);

}  // namespace combs::cuda
