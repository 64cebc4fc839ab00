#include "combs/backend/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace combs {

// Persistent workers that wake for each parallel_for; the caller works too and waits for the rest.
// A decode step is a chain of short parallel_fors (tens of microseconds each on small models), and
// waking a thread blocked on a condition variable costs about as much (a futex, and on a virtual
// machine an interrupt to a halted vCPU). So a worker that finishes spins on the generation for
// up to kSpinFor before it blocks, and the caller spins the same while the workers finish: back
// to back calls never sleep, an idle pool sleeps after kSpinFor (as OpenMP's and llama.cpp's
// pools do). park() sends spinning workers to sleep at once, before another pool takes the cores.
class CpuBackend::ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : num_threads_(num_threads) {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true, std::memory_order_release);
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
      active_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
      park_.store(false, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);  // publishes the job to spinning workers
    }
    wake_.notify_all();  // and to blocked ones
    drain();
    auto finished = [this] { return active_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, finished);
    }
    fn_ = nullptr;
  }

  void park() { park_.store(true, std::memory_order_relaxed); }

 private:
  static constexpr std::chrono::microseconds kSpinFor{100};

  // Polls `ready` (with the CPU's pause hint) for up to kSpinFor; whether it became true.
  template <typename Ready>
  static bool spin_until(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + kSpinFor;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  void drain() {
    inside_ = true;
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
    inside_ = false;
  }

  void worker_loop() {
    uint64_t seen = 0;
    auto called = [&] {
      return stop_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    for (;;) {
      if (!spin_until([&] { return called() || park_.load(std::memory_order_relaxed); }) ||
          !called()) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, called);
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      drain();
      // The caller checks active_ under mu_ before it blocks: notifying under mu_ cannot slip
      // between its check and its wait.
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_one();
      }
    }
  }

  static thread_local bool inside_;

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const FunctionRef<void(int64_t)>* fn_ = nullptr;  // written under mu_ before generation_ moves
  int64_t n_ = 0;
  alignas(64) std::atomic<int64_t> next_{0};  // every task's fetch_add: a line of its own
  alignas(64) std::atomic<int> active_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> park_{false};  // set by park(), cleared by the next run()
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

void CpuBackend::park_workers() { pool_->park(); }

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
