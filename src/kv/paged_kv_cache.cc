#include "combs/kv/paged_kv_cache.h"

#include <algorithm>
#include <string>

namespace combs {

StatusOr<std::unique_ptr<PagedKVCache>> PagedKVCache::create(PagePool& pool,
                                                             int64_t max_seq_len) {
  if (max_seq_len < 1) {
    return invalid_argument_error("paged KV cache: max_seq_len must be >= 1, got " +
                                  std::to_string(max_seq_len));
  }
  return std::unique_ptr<PagedKVCache>(new PagedKVCache(pool, max_seq_len));
}

PagedKVCache::PagedKVCache(PagePool& pool, int64_t max_seq_len)
    : KVCache(pool.backend(), pool.geometry()), pool_(&pool), max_seq_len_(max_seq_len) {}

PagedKVCache::~PagedKVCache() { release_pages_from(0); }

int64_t PagedKVCache::first_written_page(int64_t end) const {
  int64_t start = end;
  for (int l = 0; l < geometry().num_layers; ++l) start = std::min(start, layer_len(l));
  return start / pool_->page_size();
}

int64_t PagedKVCache::pages_needed(int64_t end) const {
  const int64_t have = static_cast<int64_t>(table_.size());
  int64_t needed = std::max<int64_t>(0, pages_for_tokens(end, pool_->page_size()) - have);
  // (Released pages lie before every layer's length: never written.)
  for (int64_t i = std::max(first_written_page(end), released_); i < have; ++i) {
    if (pool_->refcount(table_[i]) > 1) ++needed;  // copy-on-write
  }
  return needed;
}

void PagedKVCache::reserve(int64_t end) {
  const int64_t have = static_cast<int64_t>(table_.size());
  for (int64_t i = std::max(first_written_page(end), released_); i < have; ++i) {
    if (pool_->refcount(table_[i]) > 1) {
      const int32_t copy = *pool_->alloc();  // counted by pages_needed
      pool_->copy_page(table_[i], copy);
      pool_->release(table_[i]);
      table_[i] = copy;
    }
  }
  while (static_cast<int64_t>(table_.size()) < pages_for_tokens(end, pool_->page_size())) {
    table_.push_back(*pool_->alloc());
  }
}

void PagedKVCache::release_pages_from(int64_t keep) {
  // Last page first, so that the pool's LIFO hands them out again in table order.
  while (static_cast<int64_t>(table_.size()) > keep) {
    if (static_cast<int64_t>(table_.size()) > released_) pool_->release(table_.back());
    table_.pop_back();
  }
  released_ = std::min(released_, static_cast<int64_t>(table_.size()));
}

int64_t PagedKVCache::popn(int64_t n) {
  const int64_t len = seq_len();
  n = std::clamp<int64_t>(n, 0, len);
  if (len - n < first_held_position()) {  // what would be left is all released: nothing is held
    reset();
    return n;
  }
  truncate_layers(len - n);
  release_pages_from(pages_for_tokens(len - n, pool_->page_size()));
  return n;
}

void PagedKVCache::reset() {
  truncate_layers(0);
  release_pages_from(0);
}

int64_t PagedKVCache::release_before(int64_t pos) {
  // The pages wholly before min(pos, the shortest layer's length): those before the first one a
  // write from there would touch.
  const int64_t upto = std::min(first_written_page(std::max<int64_t>(pos, 0)), static_cast<int64_t>(table_.size()));
  const int64_t before = released_;
  for (; released_ < upto; ++released_) {
    pool_->release(table_[released_]);
    table_[released_] = pool_->zero_page();
  }
  return released_ - before;
}

Status PagedKVCache::check_adoptable(const char* who, int64_t end) const {
  const int64_t len = seq_len();
  const int ps = pool_->page_size();
  for (int l = 0; l < geometry().num_layers; ++l) {
    if (layer_len(l) != len) return failed_precondition_error(std::string(who) + ": layers hold different lengths");
  }
  if (len % ps != 0 || static_cast<int64_t>(table_.size()) != len / ps) {
    return failed_precondition_error(std::string(who) + ": the cache does not end at a page boundary");
  }
  if (end > max_seq_len_) {
    return resource_exhausted_error(std::string(who) + ": " + std::to_string(end) + " positions exceed the capacity of " +
                                    std::to_string(max_seq_len_));
  }
  return ok_status();
}

Status PagedKVCache::adopt_pages(std::span<const int32_t> pages) {
  const int64_t end = seq_len() + static_cast<int64_t>(pages.size()) * pool_->page_size();
  COMBS_RETURN_IF_ERROR(check_adoptable("adopt_pages", end));
  for (int32_t p : pages) {
    pool_->retain(p);
    table_.push_back(p);
  }
  grow_layers_to(end);
  return ok_status();
}

Status PagedKVCache::adopt_filled_pages(std::span<const int32_t> pages, int64_t end) {
  COMBS_RETURN_IF_ERROR(check_adoptable("adopt_filled_pages", end));
  if (end <= seq_len() || pages_for_tokens(end, pool_->page_size()) - static_cast<int64_t>(table_.size()) !=
                              static_cast<int64_t>(pages.size())) {
    return invalid_argument_error("adopt_filled_pages: " + std::to_string(pages.size()) + " pages do not hold positions " +
                                  std::to_string(seq_len()) + " to " + std::to_string(end));
  }
  table_.insert(table_.end(), pages.begin(), pages.end());
  grow_layers_to(end);
  return ok_status();
}

int64_t PagedKVCache::pages_shared() const {
  auto lock = pool_->bookkeeping_lock();
  return std::count_if(table_.begin() + released_, table_.end(), [this](int32_t p) {
    return pool_->refcount(p) - (pool_->is_cached(p) ? 1 : 0) > 1;  // the prefix cache's is no holder
  });
}

StatusOr<std::unique_ptr<PagedKVCache>> PagedKVCache::fork() const {
  const int64_t len = seq_len();
  for (int l = 0; l < geometry().num_layers; ++l) {
    if (layer_len(l) != len) {
      return failed_precondition_error(
          "fork: layers hold different lengths (a forward is in progress or failed half-way)");
    }
  }
  std::unique_ptr<PagedKVCache> child(new PagedKVCache(*pool_, max_seq_len_));
  const int64_t full = len / pool_->page_size();
  const bool partial = len % pool_->page_size() != 0;
  if (partial) {
    std::optional<int32_t> copy = pool_->alloc();
    if (!copy) {
      return resource_exhausted_error("fork: no free page to copy the partly filled last page into");
    }
    pool_->copy_page(table_[full], *copy);
    child->table_.assign(table_.begin(), table_.begin() + full);
    child->table_.push_back(*copy);
  } else {
    child->table_.assign(table_.begin(), table_.begin() + full);
  }
  for (int64_t i = released_; i < full; ++i) pool_->retain(table_[i]);
  child->released_ = released_;
  child->grow_layers_to(len);
  return child;
}

PagedKVShard::PagedKVShard(PagePool& pool, int shard)
    : KVCache(pool.shard_backend(shard), pool.shard_geometry()), pool_(&pool), shard_(shard) {}

Status PagedKVShard::bind(const PagedKVCache& cache) {
  if (&cache.page_pool() != pool_) return failed_precondition_error("kv shard: the cache is on another page pool");
  const int64_t len = cache.seq_len();
  for (int l = 0; l < cache.geometry().num_layers; ++l) {
    if (cache.layer_len(l) != len) {
      return failed_precondition_error("kv shard: layer " + std::to_string(l) + " holds " +
                                       std::to_string(cache.layer_len(l)) + " positions, the cache " +
                                       std::to_string(len) + " (mid-step)");
    }
  }
  cache_ = &cache;
  truncate_layers(0);
  grow_layers_to(len);
  return ok_status();
}

}  // namespace combs
