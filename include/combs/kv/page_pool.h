// PagePool: the K/V memory of one model instance on one device, shared by every session's cache.
//
// Per layer one K and one V arena, each [num_pages, n_kv_heads, page_size, head_dim] in the pool's
// dtype, allocated once at creation (from a memory budget) and never resized. A page id names the
// same page in every layer's arenas. Pages are reference counted, so forked caches share full
// pages; a page goes back to the free list when its count reaches zero. The free list is a LIFO
// stack that hands out page 0 first, so allocation order is deterministic.
//
// Cached pages (the prefix cache's, kv/prefix_cache.h): a full page whose K/V a content index
// names holds one more reference, the index's. While nothing else holds it, a cached page is
// reclaimable: it stays filled, in least-recently-released order, and alloc() takes the oldest one
// when the free list is empty (the reclaim hook tells the index first). So cached pages never make
// an allocation fail: num_available() = free + reclaimable is what a caller can count on.
//
// The zero page: one more page in every arena, past the pool's own, filled with zeros at creation
// and never handed out nor written. A cache's table names it for the positions it has released
// (behind a sliding window, paged_kv_cache.h): a kernel that reads a released position reads zeros,
// never another sequence's K/V nor memory outside the arenas.
//
// Bookkeeping (free list, counts) is plain host data; the arenas live on the backend's device.
// Tensor parallelism shards a pool by KV heads over several devices (create_sharded): one
// bookkeeping, so a page id names the same positions on every device, and on each shard's device
// arenas of its heads [num_pages, n_kv_heads / shards, page_size, head_dim]; every page copy
// copies on every shard.
// Thread-safety: the bookkeeping is guarded by the pool's own (recursive) mutex, so caches of
// different sequences may grow, shrink and fork from different threads at once; hold
// bookkeeping_lock() across a check and the allocations that rely on it. A page's data is touched
// only by the one thread that owns the cache writing it (shared pages are never written).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "combs/backend/backend.h"
#include "combs/kv/kv_layout.h"

namespace combs {

struct PagePoolOptions {
  KVGeometry geometry;   // layers, KV heads, head_dim, dtype of what is stored
  int page_size = 16;    // tokens per page, >= 1
  int64_t num_pages = 0; // pages in the pool, >= 1 (see pages_for_budget)
};

// Bytes one page takes across all layers, K and V.
int64_t page_bytes(const KVGeometry& geometry, int page_size);
// How many pages fit in `budget_bytes` (0 when not even one does). A pool of n pages allocates
// n + 1 (the zero page): one page past the budget.
int64_t pages_for_budget(const KVGeometry& geometry, int page_size, int64_t budget_bytes);
// Pages needed to hold `tokens` positions: ceil(tokens / page_size).
inline int64_t pages_for_tokens(int64_t tokens, int page_size) {
  return (tokens + page_size - 1) / page_size;
}

class PagePool {
 public:
  // INVALID_ARGUMENT for a bad option, RESOURCE_EXHAUSTED when the backend cannot hold the arenas.
  static StatusOr<std::unique_ptr<PagePool>> create(Backend& backend,
                                                    const PagePoolOptions& options);
  // A pool whose KV heads are split evenly over `shards` (shard s holds heads
  // [s n / shards, (s + 1) n / shards)); INVALID_ARGUMENT where they do not divide.
  static StatusOr<std::unique_ptr<PagePool>> create_sharded(std::span<Backend* const> shards,
                                                            const PagePoolOptions& options);

  const KVGeometry& geometry() const { return options_.geometry; }
  // Unique among the pools this process makes (an address may be reused, an id is not).
  uint64_t id() const { return id_; }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  // What each shard stores: geometry() with n_kv_heads / num_shards() heads.
  const KVGeometry& shard_geometry() const { return shard_geometry_; }
  Backend& shard_backend(int shard) const { return *shards_[shard].backend; }
  int page_size() const { return options_.page_size; }
  int64_t num_pages() const { return options_.num_pages; }
  // The zero page's id (num_pages()): no reference count, never in the free list or the index.
  int32_t zero_page() const { return static_cast<int32_t>(options_.num_pages); }
  int64_t num_free() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return static_cast<int64_t>(free_.size());
  }
  int64_t num_used() const { return num_pages() - num_free(); }  // held or cached
  // Free pages and reclaimable cached ones: what alloc() can hand out.
  int64_t num_available() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return static_cast<int64_t>(free_.size()) + reclaimable_;
  }
  std::unique_lock<std::recursive_mutex> bookkeeping_lock() const {
    return std::unique_lock<std::recursive_mutex>(mu_);
  }
  Backend& backend() const { return *shards_[0].backend; }

  // A page with reference count 1: a free one, else the least recently released reclaimable
  // cached one (the reclaim hook is called with it first); nullopt when neither exists.
  std::optional<int32_t> alloc();
  // Adds a reference to a page in use (a reclaimable cached page is held again).
  void retain(int32_t page);
  // Drops a reference; at zero the page returns to the free list (a cached page left with only
  // the index's reference becomes reclaimable instead).
  void release(int32_t page);
  int32_t refcount(int32_t page) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return refcount_[page];
  }

  // --- Cached pages (for the prefix cache) ---
  // Marks a page in use as cached, adding the index's reference. The page must not be cached.
  void cache_page(int32_t page);
  // Unmarks a cached page, dropping the index's reference (freeing it when nothing else holds it).
  void uncache_page(int32_t page);
  bool is_cached(int32_t page) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return cached_[page] != 0;
  }
  int64_t num_cached() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return cached_count_;
  }
  // Cached pages that only the index holds.
  int64_t num_reclaimable() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return reclaimable_;
  }
  // Cached pages alloc() has taken back since the pool was made.
  int64_t num_reclaimed() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return reclaimed_;
  }
  // Called (with the bookkeeping lock held) with a cached page alloc() is about to reuse, before
  // its mark goes: the index forgets it. One hook per pool; empty: none.
  void set_reclaim_hook(std::function<void(int32_t page)> hook) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    reclaim_hook_ = std::move(hook);
  }

  // Copies page src into page dst in every layer, K and V (on every shard).
  void copy_page(int32_t src, int32_t dst);

  // Arena of one layer: [num_pages, n_kv_heads, page_size, head_dim] (a shard's heads); the zero
  // page follows its last page in memory.
  const Tensor& k_arena(int layer, int shard = 0) const { return shards_[shard].k[layer]; }
  const Tensor& v_arena(int layer, int shard = 0) const { return shards_[shard].v[layer]; }
  // Layout of a sequence with page table `pages` in `layer` (in a shard's arenas: its heads).
  KVLayout layout(int layer, const int32_t* pages, int shard = 0) const;

 private:
  PagePool(const PagePoolOptions& options);

  struct Shard {
    Backend* backend = nullptr;
    std::vector<Tensor> k, v;  // per layer: the pool's pages (views; the zero page follows)
  };
  uint64_t id_;
  PagePoolOptions options_;
  KVGeometry shard_geometry_;
  std::vector<Shard> shards_;
  // The reclaimable pages' list (intrusive, doubly linked by page id; kNone ends it).
  static constexpr int32_t kNone = -1;
  void lru_push_back(int32_t page);
  void lru_unlink(int32_t page);

  mutable std::recursive_mutex mu_;  // guards everything below
  std::vector<int32_t> free_;  // stack: back() is handed out next
  std::vector<int32_t> refcount_;
  std::vector<uint8_t> cached_;
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = kNone, lru_tail_ = kNone;  // oldest, newest
  int64_t cached_count_ = 0, reclaimable_ = 0, reclaimed_ = 0;
  std::function<void(int32_t)> reclaim_hook_;
};

}  // namespace combs
