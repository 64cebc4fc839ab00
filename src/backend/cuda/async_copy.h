// cp.async (sm_80+): 16-byte copies from global to shared memory that do not pass through
// registers, in groups a thread commits and then waits for. Private to the CUDA backend and kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace combs::cuda {

// The shared-memory address of p (a pointer into __shared__ memory), as cp.async and ldmatrix take it.
__device__ inline uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes src -> shared dst; zero-filled when !valid.
__device__ inline void cp_async16(uint32_t dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// 4 bytes src -> shared dst (through L1); zero-filled when !valid.
__device__ inline void cp_async4(uint32_t dst, const void* src, bool valid = true) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace combs::cuda
