// TensorParallelRunner: one model over the GPUs of one host (combs_cuda). One CudaRunner per
// rank, each holding its share of the weights (cuda_runner.h, CudaRunnerOptions::collective) and
// driven by its own thread with its GPU current; the engine sees one ModelRunner and one page pool
// whose pages are split by KV heads over the ranks' devices (PagePool::create_sharded), so
// sessions, rollback, fork, eviction, the prefix cache and speculation work unchanged on top.
//
// A forward: the caller's thread checks the batch and reserves its pages on the whole caches;
// every rank runs the same forward on views of them (PagedKVShard: its heads, same page ids);
// rank 0 samples or writes the logits; then the caches' lengths move (commit_batch). A failed
// rank aborts the collectives, so its peers fail too, never hang; the caches then keep their
// lengths and the reserved pages go back, and every later forward fails (UNAVAILABLE): the
// group does not recover.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "combs/backend/cuda/collective.h"
#include "combs/model/cuda_runner.h"

namespace combs {

class TensorParallelRunner final : public ModelRunner {
 public:
  // One rank per collective (rank i on ranks[i]->device()); the model must outlive the runner.
  // Errors as CudaRunner::create's, and INVALID_ARGUMENT where the model does not split over
  // that many ranks (heads, KV heads, FFN width or experts not divisible; a block type's column
  // split not on whole blocks).
  static StatusOr<std::unique_ptr<TensorParallelRunner>> create(const Model& model,
                                                                std::vector<std::unique_ptr<Collective>> ranks,
                                                                CudaRunnerOptions options = {});
  ~TensorParallelRunner() override;

  Status forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options = {}) override;
  Backend& backend() override;  // rank 0's (the pool's first shard)
  const Model& model() const override;
  bool samples_on_device() const override { return true; }
  StatusOr<std::unique_ptr<PagePool>> make_page_pool(const PagePoolOptions& options) override;
  int kv_shards() const override;
  Status health() const override;

  int world() const;
  CudaRunner& rank(int r);
  const Collective& collective(int r) const;

 private:
  struct Impl;
  explicit TensorParallelRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// For EngineOptions::make_runner: tensor parallelism over `devices` with NCCL.
inline auto make_tensor_parallel_runner(std::vector<int> devices) {
  return [devices](const Model& m) -> StatusOr<std::unique_ptr<ModelRunner>> {
    COMBS_ASSIGN_OR_RETURN(auto ranks, make_nccl_group(devices));
    COMBS_ASSIGN_OR_RETURN(auto r, TensorParallelRunner::create(m, std::move(ranks)));
    return std::unique_ptr<ModelRunner>(std::move(r));
  };
}

}  // namespace combs
