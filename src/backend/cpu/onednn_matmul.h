// Matrix-matrix products through oneDNN (when combs is built with it): for prefill and large
// batches of BF16 weights, oneDNN's AVX-512-BF16 brgemm kernels run ~1.3-1.9x faster than combs'
// own tiles on the development machine (bench/RESULTS.md). Internal to the CPU backend.
#pragma once

#include <cstdint>

namespace combs::cpu::onednn {

// Whether oneDNN is compiled in and runs BF16 matmuls natively on this processor.
bool available();

// y[m, n] = sum_k x_bf16[m, k] * w[n, k] (w: BF16 [n_out, k] row-major), f32 out. Returns false
// (nothing written) when oneDNN cannot run it. Threads: `threads` (OpenMP).
bool matmul_bf16(const uint16_t* x_bf16, const uint16_t* w, float* y, int64_t m, int64_t n_out,
                 int64_t k, int threads);

}  // namespace combs::cpu::onednn
