#include "combs/backend/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace combs {

// Persistent workers that wake for each parallel_for; the caller works too and waits for the rest.
class CpuBackend::ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : num_threads_(num_threads) {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int num_threads() const { return num_threads_; }

  void run(int64_t n, FunctionRef<void(int64_t)> fn) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1 || inside_) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> serialize(call_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    inside_ = true;
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
    inside_ = false;
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  static thread_local bool inside_;

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const FunctionRef<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

thread_local bool CpuBackend::ThreadPool::inside_ = false;

CpuBackend::CpuBackend(CpuBackendOptions options) {
  int n = options.num_threads;
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  pool_ = std::make_unique<ThreadPool>(n);
}

CpuBackend::~CpuBackend() = default;

int CpuBackend::num_threads() const { return pool_->num_threads(); }

void CpuBackend::parallel_for(int64_t n, FunctionRef<void(int64_t)> fn) {
  pool_->run(n, fn);
}

void* CpuBackend::raw_alloc(size_t bytes) {
  constexpr size_t kAlign = 64;
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t align = bytes >= kHugePage ? kHugePage : kAlign;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p != nullptr && bytes >= kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // a hint only
  return p;
}

void CpuBackend::raw_free(void* ptr) noexcept { std::free(ptr); }

Status CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() != dst.dtype() || src.numel() != dst.numel()) {
    return invalid_argument_error("copy: source " + std::string(dtype_name(src.dtype())) +
                                  src.shape().to_string() + " does not fit destination " +
                                  std::string(dtype_name(dst.dtype())) + dst.shape().to_string());
  }
  if (src.device() != DeviceType::kCpu || dst.device() != DeviceType::kCpu) {
    return invalid_argument_error("copy: the CPU backend copies host memory only");
  }
  if (src.nbytes() > 0) std::memmove(dst.data(), src.data(), src.nbytes());
  return ok_status();
}

Status CpuBackend::copy_chunks(std::span<const CopyChunk> chunks, size_t bytes) {
  for (const CopyChunk& c : chunks) std::memcpy(c.dst, c.src, bytes);
  return ok_status();
}

Status CpuBackend::zero(const Tensor& t) {
  if (t.device() != DeviceType::kCpu) return invalid_argument_error("zero: not host memory");
  if (t.nbytes() > 0) std::memset(t.data(), 0, t.nbytes());
  return ok_status();
}

}  // namespace combs
