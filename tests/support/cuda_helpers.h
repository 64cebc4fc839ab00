// The [cuda] tests' GPU: a CudaBackend with the attention kernels registered, or — on a machine
// without a GPU — nothing, with the test saying it is skipped; host <-> device copies.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <memory>
#include <vector>

#include "combs/backend/cpu/cpu_ops.h"
#include "combs/backend/cuda/cuda_backend.h"
#include "combs/kv/cuda/cuda_attention.h"

namespace combs::testing {

inline bool have_gpu() {
  if (CudaBackend::device_count() > 0) return true;
  WARN("no CUDA device: [cuda] test skipped");
  std::fprintf(stderr, "combs_cuda_tests: no CUDA device: [cuda] test skipped\n");
  return false;
}

inline std::unique_ptr<CudaBackend> gpu_or_skip() {
  if (!have_gpu()) return nullptr;
  register_cuda_attention();
  auto b = CudaBackend::create();
  REQUIRE(b.ok());
  return std::move(b).value();
}

// A device tensor holding `host`, stored as `dtype` (rounded as cpu::quantize_row rounds).
inline Tensor upload(CudaBackend& b, const std::vector<float>& host, Shape shape, DType dtype = DType::kF32) {
  std::vector<uint8_t> bytes(nbytes_for(dtype, static_cast<int64_t>(host.size())));
  cpu::quantize_row(host.data(), dtype, bytes.data(), static_cast<int64_t>(host.size()));
  Tensor t = b.alloc(shape, dtype).value();
  REQUIRE(b.copy(Tensor::wrap(bytes.data(), shape, dtype), t).ok());
  return t;
}
// A device f32 tensor back on the host, after the stream's queued work.
inline std::vector<float> download(CudaBackend& b, const Tensor& t) {
  REQUIRE(b.synchronize().ok());
  std::vector<float> out(static_cast<size_t>(t.numel()));
  REQUIRE(b.copy(t, Tensor::wrap(out.data(), t.shape(), DType::kF32)).ok());
  return out;
}

}  // namespace combs::testing
