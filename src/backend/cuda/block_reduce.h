// Reductions over a whole thread block (every thread calls them; blockDim.x a multiple of 32, at
// most 1024): a fold with any associative op, and the argmax rule that every device argmax uses.
// Private to the CUDA backend's kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace combs::cuda {

// op over every thread's v, returned to every thread. identity: op(identity, x) == x (fills the
// lanes past the block's warps). shared: 32 elements.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared may still be read by the reduction before
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// Argmax: the largest value, the lowest index among equal ones; NaN is never taken (as
// std::max_element unless the first element is NaN). A thread takes its elements in any order,
// then block_argmax combines the threads'.
struct ArgMax {
  float value = -INFINITY;
  int64_t index = INT64_MAX;  // INT64_MAX: nothing taken
  __device__ void take(float v, int64_t i) {
    if (v > value || (v == value && i < index)) value = v, index = i;
  }
};

// The block's argmax index (INT64_MAX when no thread took a value other than NaN).
__device__ inline int64_t block_argmax(const ArgMax& a, float* fshared, int64_t* ishared) {
  const float m = block_reduce(a.value, [](float x, float y) { return fmaxf(x, y); }, -INFINITY, fshared);
  return block_reduce(a.value == m ? a.index : INT64_MAX, [](int64_t x, int64_t y) { return x < y ? x : y; },
                      INT64_MAX, ishared);
}

}  // namespace combs::cuda
