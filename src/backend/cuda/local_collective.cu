// In-process collectives for ranks that share one GPU (collective.h's make_local_group): each
// call waits for the rank's stream, meets the other ranks at a host barrier, and reads their
// buffers directly (one device, one address space). Sums run over the ranks in rank order, so
// every rank gets the same bits. For tests of the tensor-parallel split on a one-GPU machine.
#include <cuda_runtime.h>

#include <condition_variable>
#include <mutex>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "combs/backend/cuda/collective.h"

namespace combs {
namespace {

constexpr int kMaxLocalRanks = 8;

struct Ptrs {
  const float* p[kMaxLocalRanks];
};

__global__ void sum_ranks_kernel(Ptrs src, int world, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float s = src.p[0][i];
    for (int r = 1; r < world; ++r) s += src.p[r][i];
    out[i] = s;
  }
}

// The ranks' meeting point: a reusable barrier, each rank's published buffer, the abort flag.
struct LocalGroup {
  explicit LocalGroup(int w) : world(w) {}
  const int world;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  const float* published[kMaxLocalRanks] = {};

  // Every rank arrives before any leaves; UNAVAILABLE on abort or past the deadline (then aborted).
  Status barrier(int rank, std::chrono::milliseconds deadline) {
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) return unavailable_error("local collective: rank " + std::to_string(rank) + ": the group was aborted");
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return ok_status();
    }
    if (!cv.wait_for(lock, deadline, [&] { return generation != gen || aborted; })) {
      aborted = true;
      cv.notify_all();
      return unavailable_error("local collective: rank " + std::to_string(rank) + ": peers did not arrive in " +
                               std::to_string(deadline.count()) + " ms; the group is aborted");
    }
    if (aborted) return unavailable_error("local collective: rank " + std::to_string(rank) + ": the group was aborted");
    return ok_status();
  }
};

constexpr std::chrono::milliseconds kBarrierDeadline{60000};

class LocalCollective final : public Collective {
 public:
  LocalCollective(std::shared_ptr<LocalGroup> group, int rank, int device)
      : group_(std::move(group)), rank_(rank), device_(device) {}
  ~LocalCollective() override {
    if (tmp_) cudaFree(tmp_);
  }
  int rank() const override { return rank_; }
  int world() const override { return group_->world; }
  int device() const override { return device_; }
  bool capturable() const override { return false; }
  std::string description() const override { return "in-process (" + std::to_string(world()) + " ranks, one GPU)"; }

  Status all_reduce_sum(float* data, int64_t n, void* stream) override {
    auto st = static_cast<cudaStream_t>(stream);
    COMBS_RETURN_IF_ERROR(grow(n));
    COMBS_RETURN_IF_ERROR(publish(data, st));
    Ptrs p{};
    for (int r = 0; r < world(); ++r) p.p[r] = group_->published[r];
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));
    sum_ranks_kernel<<<blocks, 256, 0, st>>>(p, world(), n, tmp_);
    COMBS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    COMBS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    COMBS_RETURN_IF_ERROR(group_->barrier(rank_, kBarrierDeadline));  // every rank has read every buffer
    return cuda::cuda_status(cudaMemcpyAsync(data, tmp_, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, st),
                             "cudaMemcpyAsync(all-reduce)");
  }

  Status all_gather(const float* send, float* recv, int64_t n, void* stream) override {
    auto st = static_cast<cudaStream_t>(stream);
    COMBS_RETURN_IF_ERROR(publish(send, st));
    for (int r = 0; r < world(); ++r) {
      COMBS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(recv + r * n, group_->published[r], static_cast<size_t>(n) * 4,
                                                 cudaMemcpyDeviceToDevice, st));
    }
    COMBS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    return group_->barrier(rank_, kBarrierDeadline);
  }

  Status wait(void* stream, std::chrono::milliseconds) override {
    return cuda::cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(group_->mu);
    group_->aborted = true;
    group_->cv.notify_all();
  }
  bool aborted() const override {
    std::lock_guard<std::mutex> lock(group_->mu);
    return group_->aborted;
  }

 private:
  // This rank's buffer, once its stream has written it, visible to all ranks (after the barrier).
  Status publish(const float* data, cudaStream_t st) {
    COMBS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      group_->published[rank_] = data;
    }
    return group_->barrier(rank_, kBarrierDeadline);
  }
  Status grow(int64_t n) {
    if (n <= capacity_) return ok_status();
    if (tmp_) cudaFree(tmp_);
    tmp_ = nullptr;
    capacity_ = 0;
    COMBS_CUDA_RETURN_IF_ERROR(cudaMalloc(&tmp_, static_cast<size_t>(n) * 4));
    capacity_ = n;
    return ok_status();
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_, device_;
  float* tmp_ = nullptr;
  int64_t capacity_ = 0;
};

}  // namespace

StatusOr<std::vector<std::unique_ptr<Collective>>> make_local_group(int world, int device) {
  if (world < 1 || world > kMaxLocalRanks) {
    return invalid_argument_error("local collective: " + std::to_string(world) + " ranks; 1 to " +
                                  std::to_string(kMaxLocalRanks) + " in one process");
  }
  auto group = std::make_shared<LocalGroup>(world);
  std::vector<std::unique_ptr<Collective>> out;
  for (int r = 0; r < world; ++r) out.push_back(std::make_unique<LocalCollective>(group, r, device));
  return std::move(out);
}

}  // namespace combs
