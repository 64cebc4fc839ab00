// Small vectorizable math shared by the CPU kernels. Internal to combs_core.
#pragma once

#include <cstdint>
#include <cstring>

namespace combs::cpu {

// exp(x) for x <= 0 (softmax after subtracting the max), relative error < 3e-7; 0 below -87.
// Branch-free so the loops over it vectorize: 2^n * p(r) with r = x - n ln2 (Cephes' expf).
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  // Round to nearest by adding and removing 1.5 * 2^23 (vectorizes, unlike floor).
  const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(x) = x * sigmoid(x), through exp of a non-positive argument only (vectorizes).
inline float silu(float x) {
  const float e = exp_nonpositive(x >= 0.0f ? -x : x);
  return x * (x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

// Rounds n floats to bf16 (nearest even; NaN stays NaN), branch-free so that it vectorizes.
inline void f32_to_bf16_row(const float* x, uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &x[i], sizeof b);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    y[i] = static_cast<uint16_t>(nan ? ((b >> 16) | 0x40u) : rounded);
  }
}

}  // namespace combs::cpu
