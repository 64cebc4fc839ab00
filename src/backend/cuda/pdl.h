// Programmatic dependent launch (Hopper): a kernel launched with launch_pdl() may start while the
// kernel before it on the stream is still finishing; it must call pdl_wait() before it reads
// anything that kernel wrote (and before it writes anything that kernel reads). What comes before
// the wait — reading weights, page tables, metadata uploaded earlier — overlaps the predecessor's
// tail and the launch latency. pdl_launch_dependents() lets the next such kernel start early.
// Private to the CUDA backend and kernels; inside CUDA graphs the dependencies become
// programmatic edges.
#pragma once

#include <cuda_runtime.h>

namespace combs::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

}  // namespace combs::cuda
