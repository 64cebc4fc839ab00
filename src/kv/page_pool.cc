#include "combs/kv/page_pool.h"

#include <atomic>
#include <cassert>
#include <limits>
#include <string>

#include "combs/kv/kv_cache.h"

namespace combs {

namespace {
uint64_t next_pool_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}
}  // namespace

int64_t page_bytes(const KVGeometry& g, int page_size) {
  return 2 * int64_t{g.num_layers} * g.n_kv_heads * page_size * g.head_dim *
         static_cast<int64_t>(dtype_size(g.dtype));
}

int64_t pages_for_budget(const KVGeometry& g, int page_size, int64_t budget_bytes) {
  const int64_t per_page = page_bytes(g, page_size);
  return per_page > 0 && budget_bytes > 0 ? budget_bytes / per_page : 0;
}

StatusOr<std::unique_ptr<PagePool>> PagePool::create(Backend& backend,
                                                     const PagePoolOptions& options) {
  Backend* one[] = {&backend};
  return create_sharded(one, options);
}

StatusOr<std::unique_ptr<PagePool>> PagePool::create_sharded(std::span<Backend* const> shards,
                                                             const PagePoolOptions& options) {
  COMBS_RETURN_IF_ERROR(validate_kv_geometry(options.geometry));
  if (options.page_size < 1 || options.page_size > (1 << 20)) {
    return invalid_argument_error("page pool: page_size must be in [1, 1048576], got " +
                                  std::to_string(options.page_size));
  }
  if (options.num_pages < 1 || options.num_pages >= std::numeric_limits<int32_t>::max()) {
    return invalid_argument_error("page pool: num_pages must be in [1, 2^31 - 1), got " +
                                  std::to_string(options.num_pages) +
                                  " (is the KV memory budget smaller than one page of " +
                                  std::to_string(page_bytes(options.geometry, options.page_size)) +
                                  " bytes?)");
  }
  const int n_shards = static_cast<int>(shards.size());
  if (n_shards < 1 || options.geometry.n_kv_heads % n_shards != 0) {
    return invalid_argument_error("page pool: " + std::to_string(options.geometry.n_kv_heads) +
                                  " KV heads do not split evenly over " + std::to_string(n_shards) + " shards");
  }
  std::unique_ptr<PagePool> pool(new PagePool(options));
  KVGeometry g = options.geometry;
  g.n_kv_heads /= n_shards;
  pool->shard_geometry_ = g;
  const int64_t n = options.num_pages;
  const Shape arena{n + 1, g.n_kv_heads, options.page_size, g.head_dim};  // the pages, then the zero page
  for (Backend* backend : shards) {
    Shard s;
    s.backend = backend;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      for (std::vector<Tensor>* kv : {&s.k, &s.v}) {
        COMBS_ASSIGN_OR_RETURN(Tensor t, backend->alloc(arena, g.dtype));
        COMBS_RETURN_IF_ERROR(backend->zero(t.rows(n, n + 1)));
        kv->push_back(t.rows(0, n));
      }
    }
    pool->shards_.push_back(std::move(s));
  }
  return pool;
}

PagePool::PagePool(const PagePoolOptions& options)
    : id_(next_pool_id()),
      options_(options),
      refcount_(options.num_pages, 0),
      cached_(options.num_pages, 0),
      lru_prev_(options.num_pages, kNone),
      lru_next_(options.num_pages, kNone) {
  free_.reserve(options.num_pages);
  for (int64_t p = options.num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

std::optional<int32_t> PagePool::alloc() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (free_.empty()) {
    if (lru_head_ == kNone) return std::nullopt;
    const int32_t page = lru_head_;  // the cached page released longest ago
    assert(cached_[page] && refcount_[page] == 1);
    if (reclaim_hook_) reclaim_hook_(page);
    lru_unlink(page);
    cached_[page] = 0;
    --cached_count_;
    ++reclaimed_;
    return page;  // the index's reference becomes the caller's
  }
  const int32_t page = free_.back();
  free_.pop_back();
  assert(refcount_[page] == 0);
  refcount_[page] = 1;
  return page;
}

void PagePool::retain(int32_t page) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  assert(refcount_[page] > 0);
  if (cached_[page] && refcount_[page] == 1) lru_unlink(page);
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  assert(refcount_[page] > 0);
  const int32_t left = --refcount_[page];
  if (left == 0) free_.push_back(page);
  else if (left == 1 && cached_[page]) lru_push_back(page);
}

void PagePool::cache_page(int32_t page) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  assert(refcount_[page] > 0 && !cached_[page]);
  cached_[page] = 1;
  ++cached_count_;
  ++refcount_[page];
}

void PagePool::uncache_page(int32_t page) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  assert(cached_[page] && refcount_[page] > 0);
  if (refcount_[page] == 1) lru_unlink(page);
  cached_[page] = 0;
  --cached_count_;
  if (--refcount_[page] == 0) free_.push_back(page);
}

void PagePool::lru_push_back(int32_t page) {
  lru_prev_[page] = lru_tail_;
  lru_next_[page] = kNone;
  if (lru_tail_ != kNone) lru_next_[lru_tail_] = page;
  else lru_head_ = page;
  lru_tail_ = page;
  ++reclaimable_;
}

void PagePool::lru_unlink(int32_t page) {
  const int32_t prev = lru_prev_[page], next = lru_next_[page];
  if (prev != kNone) lru_next_[prev] = next;
  else lru_head_ = next;
  if (next != kNone) lru_prev_[next] = prev;
  else lru_tail_ = prev;
  lru_prev_[page] = lru_next_[page] = kNone;
  --reclaimable_;
}

void PagePool::copy_page(int32_t src, int32_t dst) {
  for (const Shard& s : shards_) {
    for (int layer = 0; layer < geometry().num_layers; ++layer) {
      for (const Tensor* arena : {&s.k[layer], &s.v[layer]}) {
        // Same dtype and size by construction: cannot fail.
        s.backend->copy(arena->rows(src, src + 1), arena->rows(dst, dst + 1)).ignore();
      }
    }
  }
}

KVLayout PagePool::layout(int layer, const int32_t* pages, int shard) const {
  const KVGeometry& g = shard_geometry_;
  KVLayout l;
  l.k = shards_[shard].k[layer].data();
  l.v = shards_[shard].v[layer].data();
  l.page_table = pages;
  l.page_size = options_.page_size;
  l.head_stride = int64_t{options_.page_size} * g.head_dim;
  l.page_stride = l.head_stride * g.n_kv_heads;
  l.head_dim = g.head_dim;
  l.dtype = g.dtype;
  return l;
}

}  // namespace combs
