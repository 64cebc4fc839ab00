// CUDA and cuBLAS errors as Status (private to the CUDA backend).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "combs/base/status.h"

namespace combs::cuda {

inline Status cuda_status(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return ok_status();
  const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                          : e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ? StatusCode::kUnavailable
                                                                                        : StatusCode::kInternal;
  return Status(code, std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

inline Status cublas_status(cublasStatus_t e, const char* call) {
  if (e == CUBLAS_STATUS_SUCCESS) return ok_status();
  const StatusCode code = e == CUBLAS_STATUS_ALLOC_FAILED ? StatusCode::kResourceExhausted : StatusCode::kInternal;
  return Status(code, std::string(call) + ": " + cublasGetStatusName(e) + " (" + cublasGetStatusString(e) + ")");
}

}  // namespace combs::cuda

#define COMBS_CUDA_RETURN_IF_ERROR(call) COMBS_RETURN_IF_ERROR(::combs::cuda::cuda_status((call), #call))
#define COMBS_CUBLAS_RETURN_IF_ERROR(call) COMBS_RETURN_IF_ERROR(::combs::cuda::cublas_status((call), #call))
