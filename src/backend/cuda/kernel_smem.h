// Dynamic shared memory past 48 KB for a kernel, opted into once per device. The attribute belongs
// to the kernel as loaded on the current device: opted into once per process, the other GPUs of a
// tensor-parallel group (a thread each) would keep 48 KB and their launches fail. Private to the
// CUDA backend and kernels.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace combs::cuda {

// Call before each launch of Kernel with up to `bytes` (the same for every call) of dynamic shared
// memory, and before an occupancy query with that much: after the first call on a device, a
// device query and an atomic load.
template <auto Kernel>
cudaError_t allow_dynamic_smem(size_t bytes) {
  static std::atomic<uint64_t> done{0};  // a bit per device, the first 64
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

}  // namespace combs::cuda
