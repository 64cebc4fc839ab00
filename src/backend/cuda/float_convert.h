// Element conversions between f32 and the 16-bit types on the device (round to nearest even).
// Private to the CUDA backend and kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "pdl.h"

namespace combs::cuda {

__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__half v) { return __half2float(v); }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_f32(float v);
template <>
__device__ inline float from_f32<float>(float v) { return v; }
template <>
__device__ inline __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// y[i] = x[i] rounded to T, a thread an element (launched with launch_pdl).
template <typename T>
__global__ void convert_kernel(const float* __restrict__ x, T* __restrict__ y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  pdl_launch_dependents();
  pdl_wait();
  if (i < n) y[i] = from_f32<T>(x[i]);
}

}  // namespace combs::cuda
