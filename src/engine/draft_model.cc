#include "combs/engine/draft_model.h"

#include <algorithm>

#include "combs/model/tokenizer.h"

namespace combs {

namespace {

// The first difference between the two models' vocabularies, or "" where they are the same.
std::string vocabulary_difference(const Model& draft, const Model& target) {
  const int nd = draft.config().n_vocab, nt = target.config().n_vocab;
  if (nd != nt) return std::to_string(nd) + " tokens, the target " + std::to_string(nt);
  auto td = Tokenizer::from_gguf(draft.file());
  auto tt = Tokenizer::from_gguf(target.file());
  if (td.ok() != tt.ok()) {
    return td.ok() ? "a tokenizer where the target has none" : "no tokenizer where the target has one";
  }
  if (!td.ok()) return "";  // neither has one: ids are all they share
  for (int32_t i = 0; i < nd; ++i) {
    if ((*td)->token_text(i) != (*tt)->token_text(i)) {
      return "token " + std::to_string(i) + " is '" + (*td)->token_text(i) + "', the target's '" + (*tt)->token_text(i) + "'";
    }
  }
  return "";
}

}  // namespace

StatusOr<std::unique_ptr<DraftModel>> DraftModel::create(std::shared_ptr<const Model> draft, const Model& target,
                                                         const MakeRunner& make_runner, DraftModelOptions options) {
  if (!draft) return invalid_argument_error("draft model: none given");
  if (std::string d = vocabulary_difference(*draft, target); !d.empty()) {
    return failed_precondition_error("draft model: its vocabulary is not the target's (" + d +
                                     "); a draft model must use the same tokens");
  }
  if (options.catch_up_chunk < 1) return invalid_argument_error("draft model: catch_up_chunk must be >= 1");
  std::unique_ptr<DraftModel> m(new DraftModel(std::move(draft), options));
  if (m->options_.max_context <= 0) m->options_.max_context = m->model_->config().context_length;
  COMBS_ASSIGN_OR_RETURN(m->runner_, make_runner(*m->model_));
  const KVGeometry geometry = m->model_->config().kv_geometry(options.kv_dtype);
  const int64_t pages = pages_for_budget(geometry, options.page_size, options.kv_memory_bytes);
  if (pages < 1) {
    return invalid_argument_error("draft model: " + std::to_string(options.kv_memory_bytes) +
                                  " bytes of KV memory hold no page of " + std::to_string(page_bytes(geometry, options.page_size)));
  }
  COMBS_ASSIGN_OR_RETURN(m->pool_, m->runner_->make_page_pool({geometry, options.page_size, pages}));
  {  // The largest first forward, once: the runner's scratch is taken now, not after the target's pool
    const int64_t n = std::min(options.catch_up_chunk, pages * options.page_size);
    COMBS_ASSIGN_OR_RETURN(std::unique_ptr<PagedKVCache> cache, PagedKVCache::create(*m->pool_, n));
    const std::vector<int32_t> tokens(static_cast<size_t>(n), 0);
    m->ids_.resize(1);
    m->logits_.resize(static_cast<size_t>(m->model_->config().n_vocab));
    ForwardOptions fo;
    fo.token_ids = m->ids_.data();
    const SequenceInput in{cache.get(), tokens};
    COMBS_RETURN_IF_ERROR(m->runner_->forward(std::span<const SequenceInput>(&in, 1), m->logits_.data(), fo));
  }
  return m;
}

void DraftModel::propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) {
  std::vector<std::vector<int32_t>> drafts;
  const DraftRequest r{"", history, max};
  propose(std::span<const DraftRequest>(&r, 1), &drafts);
  *out = std::move(drafts[0]);
  forget("");
}

void DraftModel::drop(State& s) {
  s.cache->reset();
  s.tokens.clear();
}

bool DraftModel::make_room(int64_t need, int64_t* reserved, const std::vector<State*>& keep) {
  if (need > pool_->num_available() - *reserved) {  // drop nothing unless dropping can make the room
    int64_t held = 0;
    for (auto& [id, s] : states_) {
      if (!s.tokens.empty() && std::find(keep.begin(), keep.end(), &s) == keep.end()) held += *s.cache->pages_used();
    }
    if (need > pool_->num_available() - *reserved + held) return false;
  }
  while (need > pool_->num_available() - *reserved) {
    State* victim = nullptr;
    for (auto& [id, s] : states_) {
      if (s.tokens.empty() || std::find(keep.begin(), keep.end(), &s) != keep.end()) continue;
      if (victim == nullptr || s.used < victim->used) victim = &s;
    }
    if (victim == nullptr) return false;
    drop(*victim);
    ++stats_.evictions;
  }
  *reserved += need;
  return true;
}

void DraftModel::propose(std::span<const DraftRequest> requests, std::vector<std::vector<int32_t>>* drafts) {
  drafts->assign(requests.size(), {});
  struct Item {
    size_t request;
    State* state;
    int64_t feed;   // history positions computed this step
    bool drafts;    // caught up: its first forward's output is the first draft
  };
  std::vector<Item> items;
  std::vector<State*> keep;
  int64_t reserved = 0;
  ++clock_;
  if (clock_ < resume_at_) return;  // after failed forwards: wait, longer each time
  int64_t budget = options_.catch_up_chunk;  // positions the first forward computes, all sessions
  for (size_t i = 0; i < requests.size() && budget > 0; ++i) {
    const DraftRequest& r = requests[i];
    const auto len = static_cast<int64_t>(r.history.size());
    if (r.max < 1 || len < 1 || len + r.max > options_.max_context) continue;
    if (pages_for_tokens(len + r.max - 1, pool_->page_size()) > pool_->num_pages()) {
      forget(r.session);  // longer than the whole pool: it never drafts, and holds nothing
      continue;
    }
    auto [it, inserted] = states_.try_emplace(std::string(r.session));
    State& s = it->second;
    if (!s.cache) {
      auto cache = PagedKVCache::create(*pool_, options_.max_context);
      if (!cache.ok()) {
        states_.erase(it);
        continue;
      }
      s.cache = std::move(cache).value();
    }
    s.used = clock_;
    // Keep the longest common prefix, and at least the last token to compute again (its output is
    // the first draft).
    const auto held = static_cast<int64_t>(s.tokens.size());
    int64_t common = std::mismatch(s.tokens.begin(), s.tokens.end(), r.history.begin(), r.history.end()).first - s.tokens.begin();
    common = std::min(common, len - 1);
    if (held > common) {
      s.cache->popn(held - common);
      s.tokens.resize(static_cast<size_t>(common));
    }
    const int64_t feed = std::min(len - common, budget);
    // Drafts once the cache has caught up. A long catch-up (a new prompt, the tokens of steps that
    // did not draft) runs in a step of its own, so that a step's drafts cost what drafting costs.
    const bool caught_up = common + feed == len && feed <= kShortSync;
    const int64_t end = common + feed + (caught_up ? r.max - 1 : 0);
    keep.push_back(&s);
    if (!make_room(s.cache->pages_to_grow(end), &reserved, keep)) {
      keep.pop_back();
      continue;
    }
    items.push_back({i, &s, feed, caught_up});
    budget -= feed;
  }
  if (items.empty()) return;
  // The first forward: every item's catch-up (its last row the first draft where it caught up).
  std::vector<SequenceInput> seqs;
  for (const Item& it : items) {
    const auto from = static_cast<size_t>(it.state->tokens.size());
    seqs.push_back({it.state->cache.get(), requests[it.request].history.subspan(from, static_cast<size_t>(it.feed))});
  }
  const auto V = static_cast<size_t>(model_->config().n_vocab);
  ids_.resize(seqs.size());
  logits_.resize(seqs.size() * V);  // the CPU runner's argmax reads them; a GPU's stay on the device
  ForwardOptions fo;
  fo.token_ids = ids_.data();
  Status st = runner_->forward(seqs, logits_.data(), fo);
  ++stats_.forwards;
  if (!st.ok()) {  // the caches did not change; drop them all (rebuilt) and wait a while
    for (const Item& it : items) drop(*it.state);
    failures_ = std::min(failures_ + 1, 10);
    resume_at_ = clock_ + (uint64_t{1} << failures_);
    return;
  }
  failures_ = 0;
  std::vector<Item> drafting;
  for (size_t k = 0; k < items.size(); ++k) {
    const Item& it = items[k];
    const DraftRequest& r = requests[it.request];
    const size_t from = it.state->tokens.size();
    it.state->tokens.insert(it.state->tokens.end(), r.history.begin() + static_cast<ptrdiff_t>(from),
                            r.history.begin() + static_cast<ptrdiff_t>(from + static_cast<size_t>(it.feed)));
    stats_.caught_up_tokens += it.drafts ? it.feed - 1 : it.feed;
    if (!it.drafts) continue;
    (*drafts)[it.request].push_back(ids_[k]);
    if (r.max > 1) drafting.push_back(it);
  }
  // Each further position: the sessions that want more, one token each.
  std::vector<int32_t> last;
  while (!drafting.empty()) {
    seqs.clear();
    last.clear();
    for (const Item& it : drafting) last.push_back((*drafts)[it.request].back());
    for (size_t k = 0; k < drafting.size(); ++k) seqs.push_back({drafting[k].state->cache.get(), std::span<const int32_t>(&last[k], 1)});
    fo.token_ids = ids_.data();
    st = runner_->forward(seqs, logits_.data(), fo);
    ++stats_.forwards;
    if (!st.ok()) break;  // the drafts so far stand; the caches hold what their tokens say
    std::vector<Item> more;
    for (size_t k = 0; k < drafting.size(); ++k) {
      const Item& it = drafting[k];
      it.state->tokens.push_back(last[k]);
      std::vector<int32_t>& d = (*drafts)[it.request];
      d.push_back(ids_[k]);
      if (static_cast<int>(d.size()) < requests[it.request].max) more.push_back(it);
    }
    drafting = std::move(more);
  }
  for (const auto& d : *drafts) stats_.drafted_tokens += static_cast<int64_t>(d.size());
}

void DraftModel::fork(std::string_view parent, std::string_view child) {
  auto it = states_.find(std::string(parent));
  if (it == states_.end() || it->second.tokens.empty()) return;
  const State& p = it->second;  // (references outlive a rehash; iterators do not)
  auto copy = p.cache->fork();  // shares the parent's full pages
  if (!copy.ok()) return;       // the child rebuilds its own when it drafts
  State& s = states_[std::string(child)];
  s.cache = std::move(copy).value();
  s.tokens = p.tokens;
  s.used = p.used;
}

void DraftModel::forget(std::string_view session) { states_.erase(std::string(session)); }

DraftModelStats DraftModel::stats() const {
  DraftModelStats s = stats_;
  s.sessions = static_cast<int64_t>(states_.size());
  return s;
}

}  // namespace combs
