// The CUDA backend: device memory, one stream, a cuBLAS handle, and the device ops of
// cuda_ops.h. Every CUDA and cuBLAS error becomes a Status naming the call. No CUDA header shows
// here: the stream and handle are opaque to code above the backend.
#pragma once

#include <memory>
#include <string>

#include "combs/backend/backend.h"

namespace combs {

struct CudaBackendOptions {
  int device = 0;
};

class CudaBackend final : public Backend {
 public:
  // UNAVAILABLE when there is no such device (or no driver).
  static StatusOr<std::unique_ptr<CudaBackend>> create(CudaBackendOptions options = {});
  ~CudaBackend() override;

  // Devices this process can use; 0 without a driver or GPU.
  static int device_count();

  DeviceType device_type() const override { return DeviceType::kCuda; }
  std::string_view name() const override { return "cuda"; }
  // Host<->device and device<->device; waits for the copy.
  Status copy(const Tensor& src, const Tensor& dst) override;
  Status zero(const Tensor& t) override;
  std::optional<int64_t> free_memory_bytes() const override;
  // One kernel over all chunks (alloc_host() memory is mapped: the kernel reads and writes it over
  // the bus directly), then waits.
  Status copy_chunks(std::span<const CopyChunk> chunks, size_t bytes) override;

  // Waits for the stream; the first error of its queued work, if any.
  Status synchronize();
  // "NVIDIA H200 (sm_90, 139 GiB)".
  std::string description() const;

  void* stream() const;         // cudaStream_t
  void* cublas() const;         // cublasHandle_t
  // Device scratch of at least `bytes`, reused between calls on the stream (grows, never shrinks),
  // one buffer per user that may hold its data across the others' calls (the slots below); zeros
  // when new. Growing waits for the stream (the old buffer may be in use), so it fails while the
  // stream is being captured into a CUDA graph.
  static constexpr int kOpsSlot = 0;            // the ops' transient buffers (x rounded for a GEMM, ...)
  static constexpr int kAttentionMetaSlot = 1;  // a step's attention metadata, valid for all its layers (upload())
  static constexpr int kAttentionSlot = 2;      // attention partial results
  static constexpr int kSamplingSlot = 3;       // sampling parameters (upload())
  static constexpr int kWeightTileSlot = 4;     // block-quantized weights dequantized for a GEMM, a tile at a time
  static constexpr int kCopySlot = 5;           // copy_chunks()'s list of addresses (upload())
  static constexpr int kSampleWorkSlot = 6;     // sample_rows()'s histograms, partial sums and barrier
  static constexpr int kMmaSplitSlot = 7;       // the block-quantized batch matmul's k-split sums and counters
  static constexpr int kScratchSlots = 8;
  StatusOr<void*> scratch(size_t bytes, int slot = 0);
  // Bumped whenever a scratch buffer moves: launches captured before hold stale pointers.
  uint64_t scratch_generation() const;
  // Copies `bytes` of host memory into scratch slot `slot` on the stream — unless the previous
  // upload there was the same bytes — and returns the device copy.
  StatusOr<void*> upload(int slot, const void* host, size_t bytes);

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* ptr) noexcept override;
  // Page-locked and mapped (cudaHostAlloc): the device's kernels address it at the same pointer.
  void* raw_alloc_host(size_t bytes) override;
  void raw_free_host(void* ptr) noexcept override;

 private:
  struct Impl;
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace combs
