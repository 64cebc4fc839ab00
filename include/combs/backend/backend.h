// Backend: one compute device (the CPU, or one CUDA GPU). It owns the memory of the tensors it
// allocates and the device's execution resources (threads, streams).
//
// A backend is picked once at start-up; code above it holds a Backend& and dispatches on
// device_type() in one place per op (see kv/attention.cc), not with #ifdefs.
// Thread-safety: alloc() and copy() are thread-safe; compute entry points of a concrete backend
// say their own rules (the CPU backend's parallel_for runs one caller at a time).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

#include "combs/backend/tensor.h"
#include "combs/base/status.h"

namespace combs {

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual DeviceType device_type() const = 0;
  virtual std::string_view name() const = 0;

  // Uninitialized memory for `shape` x `dtype` on this device. RESOURCE_EXHAUSTED when the device
  // cannot provide it.
  StatusOr<Tensor> alloc(Shape shape, DType dtype);
  // Copies src into dst (same dtype and element count); either may be host memory.
  virtual Status copy(const Tensor& src, const Tensor& dst) = 0;
  virtual Status zero(const Tensor& t) = 0;
  // Bytes of device memory free now; nullopt where there is no such limit to read (the CPU).
  virtual std::optional<int64_t> free_memory_bytes() const { return std::nullopt; }

  // Host memory that this device copies to and from at its link's full speed, for data that moves
  // between the two (the host tier of the K/V pages): page-locked and addressable by the device's
  // kernels on a GPU, plain memory on the CPU. A host tensor (DeviceType::kCpu) whose storage this
  // backend frees. RESOURCE_EXHAUSTED when there is not that much.
  StatusOr<Tensor> alloc_host(Shape shape, DType dtype);

  // One of a batch of equal-sized copies: bytes from src to dst, each on this device or in its
  // alloc_host() memory.
  struct CopyChunk {
    const void* src;
    void* dst;
  };
  // Copies every chunk's `bytes` as one batched operation (one kernel on a GPU, not a call per
  // chunk) and returns when they are done. Chunks must not overlap.
  virtual Status copy_chunks(std::span<const CopyChunk> chunks, size_t bytes) = 0;

 protected:
  // nullptr when out of memory.
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* ptr) noexcept = 0;
  // alloc_host()'s memory; by default the device's own (a host device).
  virtual void* raw_alloc_host(size_t bytes) { return raw_alloc(bytes); }
  virtual void raw_free_host(void* ptr) noexcept { raw_free(ptr); }

 private:
  friend struct TensorStorage;
  StatusOr<Tensor> allocate(Shape shape, DType dtype, bool host);
};

}  // namespace combs
