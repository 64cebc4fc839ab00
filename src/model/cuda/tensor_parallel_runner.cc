#include "combs/model/tensor_parallel_runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "combs/kv/paged_kv_cache.h"

namespace combs {
namespace {

// A rank's thread: its GPU current, one job at a time.
class RankThread {
 public:
  explicit RankThread(int device) : thread_([this, device] { loop(device); }) {}
  ~RankThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    busy_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }

 private:
  void loop(int device) {
    cudaSetDevice(device);  // (a failure shows in the rank's first CUDA call)
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || job_; });
      if (!job_) return;
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // (last: starts once the rest is built)
};

}  // namespace

struct TensorParallelRunner::Impl {
  const Model* model = nullptr;
  std::vector<std::unique_ptr<Collective>> collectives;
  std::vector<std::unique_ptr<CudaRunner>> ranks;
  std::vector<std::unique_ptr<RankThread>> threads;  // destroyed first (declared last)
  // Per forward: the whole caches' batch, and each rank's views and inputs.
  std::vector<SeqAttention> batch;
  uint64_t views_pool = 0;  // PagePool::id() of the pool the views are of
  std::vector<std::vector<std::unique_ptr<PagedKVShard>>> views;  // [rank][sequence]
  std::vector<std::vector<SequenceInput>> inputs;                 // [rank][sequence]
  std::vector<Status> results;
  std::atomic<bool> failed{false};  // a rank failed mid-step: the collectives are aborted for good

  ~Impl() { threads.clear(); }  // the ranks' threads end before the runners they drive go

  // Runs job(r) on every rank's thread; their statuses in results.
  void on_ranks(const std::function<Status(int)>& job) {
    results.assign(threads.size(), ok_status());
    for (size_t r = 0; r < threads.size(); ++r) {
      threads[r]->post([this, &job, r] { results[r] = job(static_cast<int>(r)); });
    }
    for (auto& t : threads) t->wait();
  }
  // The error that says what happened: the first that is not a peer's "the group was aborted"
  // (UNAVAILABLE), else the first.
  Status first_error() const {
    for (const Status& s : results)
      if (!s.ok() && s.code() != StatusCode::kUnavailable) return s;
    for (const Status& s : results)
      if (!s.ok()) return s;
    return ok_status();
  }
};

StatusOr<std::unique_ptr<TensorParallelRunner>> TensorParallelRunner::create(
    const Model& model, std::vector<std::unique_ptr<Collective>> ranks, CudaRunnerOptions options) {
  if (ranks.empty()) return invalid_argument_error("tensor parallel: no ranks");
  auto impl = std::make_unique<Impl>();
  impl->model = &model;
  impl->collectives = std::move(ranks);
  const size_t world = impl->collectives.size();
  impl->ranks.resize(world);
  for (size_t r = 0; r < world; ++r) {
    if (impl->collectives[r]->rank() != static_cast<int>(r) || impl->collectives[r]->world() != static_cast<int>(world)) {
      return invalid_argument_error("tensor parallel: collective " + std::to_string(r) + " is rank " +
                                    std::to_string(impl->collectives[r]->rank()) + " of " +
                                    std::to_string(impl->collectives[r]->world()));
    }
    impl->threads.push_back(std::make_unique<RankThread>(impl->collectives[r]->device()));
  }
  // Each rank loads its share on its own thread (its device current), all at once.
  impl->on_ranks([&](int r) -> Status {
    CudaRunnerOptions o = options;
    o.collective = impl->collectives[static_cast<size_t>(r)].get();
    COMBS_ASSIGN_OR_RETURN(impl->ranks[static_cast<size_t>(r)], CudaRunner::create(model, o));
    return ok_status();
  });
  COMBS_RETURN_IF_ERROR(impl->first_error());
  impl->views.resize(world);
  impl->inputs.resize(world);
  return std::unique_ptr<TensorParallelRunner>(new TensorParallelRunner(std::move(impl)));
}

TensorParallelRunner::TensorParallelRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TensorParallelRunner::~TensorParallelRunner() = default;
Backend& TensorParallelRunner::backend() { return impl_->ranks[0]->backend(); }
const Model& TensorParallelRunner::model() const { return *impl_->model; }
int TensorParallelRunner::kv_shards() const { return world(); }
Status TensorParallelRunner::health() const {
  if (!impl_->failed && !impl_->collectives[0]->aborted()) return ok_status();
  return unavailable_error("tensor parallel: a rank failed; the group of " + std::to_string(world()) +
                           " GPUs is aborted");
}
int TensorParallelRunner::world() const { return static_cast<int>(impl_->ranks.size()); }
CudaRunner& TensorParallelRunner::rank(int r) { return *impl_->ranks[static_cast<size_t>(r)]; }
const Collective& TensorParallelRunner::collective(int r) const { return *impl_->collectives[static_cast<size_t>(r)]; }

StatusOr<std::unique_ptr<PagePool>> TensorParallelRunner::make_page_pool(const PagePoolOptions& options) {
  std::vector<Backend*> shards;
  for (auto& r : impl_->ranks) shards.push_back(&r->backend());
  return PagePool::create_sharded(shards, options);
}

Status TensorParallelRunner::forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options) {
  Impl& I = *impl_;
  if (I.failed) {
    return unavailable_error("tensor parallel: a rank failed in an earlier step; the group is aborted");
  }
  if (seqs.empty()) return ok_status();
  int64_t total = 0;
  const ModelConfig& c = I.model->config();
  COMBS_RETURN_IF_ERROR(check_forward_inputs(c, seqs, &backend(), &total));
  // Everything rank 0 alone checks, checked here: a rank that fails alone aborts the group.
  if (!options.sampling.empty()) {
    COMBS_RETURN_IF_ERROR(check_sampling(options, output_rows(seqs, options.all_logits), c.n_vocab));
  }
  if (!logits && !options.token_ids) return invalid_argument_error("forward: neither logits nor token ids to write");
  // The whole caches: paged, on one pool split over these ranks, each once, room for the tokens.
  I.batch.clear();
  const PagePool* pool = nullptr;
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto* cache = dynamic_cast<PagedKVCache*>(seqs[i].cache);
    auto which = [i] { return "tensor parallel: sequence " + std::to_string(i); };
    if (cache == nullptr) return invalid_argument_error(which() + ": the cache is not paged");
    if (pool == nullptr) pool = &cache->page_pool();
    if (&cache->page_pool() != pool || pool->num_shards() != world()) {
      return invalid_argument_error(which() + ": the cache is not on this runner's page pool (make_page_pool)");
    }
    const int64_t pos = cache->seq_len(), n = static_cast<int64_t>(seqs[i].tokens.size());
    if (pos + n > cache->capacity()) {
      return resource_exhausted_error(which() + ": " + std::to_string(pos + n) +
                                      " positions exceed the cache capacity of " + std::to_string(cache->capacity()));
    }
    for (const SeqAttention& b : I.batch) {
      if (b.cache == cache) return invalid_argument_error(which() + ": the cache appears twice in the batch");
    }
    I.batch.push_back({cache, pos, n});
  }
  // Each rank's views of the caches (kept between steps; rebuilt for another pool).
  if (I.views_pool != pool->id()) {
    for (auto& v : I.views) v.clear();
    I.views_pool = pool->id();
  }
  for (int r = 0; r < world(); ++r) {
    auto& views = I.views[static_cast<size_t>(r)];
    auto& inputs = I.inputs[static_cast<size_t>(r)];
    while (views.size() < seqs.size()) {
      views.push_back(std::make_unique<PagedKVShard>(const_cast<PagePool&>(*pool), r));
    }
    inputs.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      COMBS_RETURN_IF_ERROR(views[i]->bind(*static_cast<PagedKVCache*>(I.batch[i].cache)));
      inputs.push_back({views[i].get(), seqs[i].tokens, seqs[i].all_logits});
    }
  }
  // The step's pages, once, before any rank reads the page tables.
  COMBS_RETURN_IF_ERROR(reserve_batch_pages(I.batch));
  I.on_ranks([&](int r) -> Status {
    const auto& in = I.inputs[static_cast<size_t>(r)];
    if (r == 0) return I.ranks[0]->forward(in, logits, options);
    ForwardOptions peer;  // (no outputs: rank 0 has them)
    peer.all_logits = options.all_logits;
    return I.ranks[static_cast<size_t>(r)]->forward(in, nullptr, peer);
  });
  if (Status s = I.first_error(); !s.ok()) {
    for (const SeqAttention& b : I.batch) b.cache->popn(0);  // lengths stay; the step's pages go back
    // Failed alike on every rank before any collective (checks of the same batch), the group
    // serves on; a rank that failed otherwise aborted it.
    for (const auto& c : I.collectives) I.failed = I.failed || c->aborted();
    return s;
  }
  commit_batch(I.batch);
  return ok_status();
}

}  // namespace combs
