// The CPU backend: host memory (64-byte aligned, transparent huge pages for large buffers) and a
// pool of worker threads for data-parallel kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "combs/backend/backend.h"

namespace combs {

// A non-owning reference to a callable (no allocation, unlike std::function): valid while the
// callable it was made from lives.
template <typename Fn>
class FunctionRef;
template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  template <typename F>
  FunctionRef(F&& f)  // NOLINT: implicit by design
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(a)...);
        }) {}
  R operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

struct CpuBackendOptions {
  int num_threads = 0;  // 0: one per hardware thread
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuBackendOptions options = {});
  ~CpuBackend() override;

  DeviceType device_type() const override { return DeviceType::kCpu; }
  std::string_view name() const override { return "cpu"; }
  Status copy(const Tensor& src, const Tensor& dst) override;
  Status zero(const Tensor& t) override;
  Status copy_chunks(std::span<const CopyChunk> chunks, size_t bytes) override;

  int num_threads() const;
  // Runs fn(i) for every i in [0, n) on the worker threads and the calling thread, dynamically
  // scheduled, and returns when all are done. fn must not throw. Calls from several threads are
  // serialized; a call from inside fn runs inline on that thread.
  void parallel_for(int64_t n, FunctionRef<void(int64_t)> fn);
  // Asks the workers, which spin for a moment after each parallel_for, to block now: for a caller
  // about to hand the cores to another thread pool (oneDNN's OpenMP team).
  void park_workers();

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* ptr) noexcept override;

 private:
  class ThreadPool;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace combs
