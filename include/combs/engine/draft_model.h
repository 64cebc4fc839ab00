// A draft model for speculative decoding (SpeculationParams::Method::kDraft): a smaller model of
// the target's vocabulary, run by its own runner on the target's device with its own page pool and
// one draft cache per session. Its drafts are its greedy continuation of the session's history.
//
// A draft cache follows its session lazily: before drafting, the cache is compared with the
// session's history and what differs is dropped (popn: a rollback, a reset, the rejected drafts of
// the last verification, a chat turn's edit) and what is new appended, so every change to the
// session applies to the draft cache without the engine telling it — but fork (the child starts
// from a fork of the parent's draft cache) and close (its pages go). Under pressure on its own pool
// the least recently used draft caches are dropped; a dropped one is rebuilt from the history the
// next time its session drafts; a session longer than the whole pool never drafts. A catch-up (a
// new prompt) takes at most `catch_up_chunk` positions a step, shared by the step's sessions, in
// steps of its own; the session drafts once its draft cache is up to date. create() runs one
// forward of that size, so the runner's scratch is taken before the target's KV pool is sized.
//
// Drafting for a step's sessions is batched: one forward for every session's catch-up and first
// draft, then one forward per further drafted position over the sessions still drafting.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "combs/engine/speculation.h"
#include "combs/kv/page_pool.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/model/model.h"
#include "combs/model/runner.h"

namespace combs {

struct DraftModelOptions {
  int64_t kv_memory_bytes = int64_t{256} << 20;  // the draft caches' pages
  int page_size = 16;
  DType kv_dtype = DType::kF16;
  int64_t catch_up_chunk = 512;  // draft-cache positions one step computes at most (all sessions)
  int64_t max_context = 0;       // of each draft cache; 0: the draft model's context length
};

struct DraftModelStats {
  int64_t forwards = 0;        // draft forwards run
  int64_t drafted_tokens = 0;  // drafts handed out
  int64_t caught_up_tokens = 0;  // history positions computed to catch up
  int64_t evictions = 0;       // draft caches dropped for pages
  int64_t sessions = 0;        // draft caches held
};

class DraftModel final : public Proposer {
 public:
  using MakeRunner = std::function<StatusOr<std::unique_ptr<ModelRunner>>(const Model&)>;
  // FAILED_PRECONDITION when `draft`'s vocabulary is not `target`'s (the same number of tokens and,
  // where either file has a tokenizer, the same token texts), naming the first difference.
  static StatusOr<std::unique_ptr<DraftModel>> create(std::shared_ptr<const Model> draft, const Model& target,
                                                      const MakeRunner& make_runner, DraftModelOptions options);

  using Proposer::propose;
  void propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) override;
  void propose(std::span<const DraftRequest> requests, std::vector<std::vector<int32_t>>* drafts) override;
  void fork(std::string_view parent, std::string_view child) override;
  void forget(std::string_view session) override;

  const Model& model() const { return *model_; }
  const PagePool& pool() const { return *pool_; }
  DraftModelStats stats() const;

 private:
  struct State {
    std::unique_ptr<PagedKVCache> cache;
    std::vector<int32_t> tokens;  // what the cache holds, position by position
    uint64_t used = 0;            // LRU stamp
  };
  DraftModel(std::shared_ptr<const Model> model, DraftModelOptions options) : model_(std::move(model)), options_(options) {}
  // Pages for `need` more: the least recently used caches not in `keep` are dropped first.
  bool make_room(int64_t need, int64_t* reserved, const std::vector<State*>& keep);
  void drop(State& s);

  std::shared_ptr<const Model> model_;
  DraftModelOptions options_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<PagePool> pool_;  // after runner_: its pages live on the runner's backend
  std::unordered_map<std::string, State> states_;
  uint64_t clock_ = 0;  // propose() calls
  // A session drafts in the step that brings its cache up to date only when that takes at most
  // this many positions (a verification's sync: the bonus token and the last draft).
  static constexpr int64_t kShortSync = 4;
  int failures_ = 0;         // failed forwards in a row
  uint64_t resume_at_ = 0;   // no drafting before this propose() call
  DraftModelStats stats_;
  std::vector<int32_t> ids_;  // scratch: a forward's argmax ids
  std::vector<float> logits_;
};

}  // namespace combs
