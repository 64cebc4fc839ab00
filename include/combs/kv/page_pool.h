// PagePool: the K/V memory of one model instance on one device, shared by every session's cache.
//
// Per layer one K and one V arena, each [num_pages, n_kv_heads, page_size, head_dim] in the pool's
// dtype, allocated once at creation (from a memory budget) and never resized. A page id names the
// same page in every layer's arenas. Pages are reference counted, so forked caches share full
// pages; a page goes back to the free list when its count reaches zero. The free list is a LIFO
// stack that hands out page 0 first, so allocation order is deterministic.
//
// Bookkeeping (free list, counts) is plain host data; the arenas live on the backend's device.
// Thread-safety: the bookkeeping is guarded by the pool's own (recursive) mutex, so caches of
// different sequences may grow, shrink and fork from different threads at once; hold
// bookkeeping_lock() across a check and the allocations that rely on it. A page's data is touched
// only by the one thread that owns the cache writing it (shared pages are never written).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
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
// How many pages fit in `budget_bytes` (0 when not even one does).
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

  const KVGeometry& geometry() const { return options_.geometry; }
  int page_size() const { return options_.page_size; }
  int64_t num_pages() const { return options_.num_pages; }
  int64_t num_free() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return static_cast<int64_t>(free_.size());
  }
  int64_t num_used() const { return num_pages() - num_free(); }
  std::unique_lock<std::recursive_mutex> bookkeeping_lock() const {
    return std::unique_lock<std::recursive_mutex>(mu_);
  }
  Backend& backend() const { return *backend_; }

  // A free page with reference count 1, or nullopt when none is free.
  std::optional<int32_t> alloc();
  // Adds a reference to a page in use.
  void retain(int32_t page);
  // Drops a reference; at zero the page returns to the free list.
  void release(int32_t page);
  int32_t refcount(int32_t page) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return refcount_[page];
  }

  // Copies page src into page dst in every layer, K and V.
  void copy_page(int32_t src, int32_t dst);

  // Arena of one layer: [num_pages, n_kv_heads, page_size, head_dim].
  const Tensor& k_arena(int layer) const { return k_[layer]; }
  const Tensor& v_arena(int layer) const { return v_[layer]; }
  // Layout of a sequence with page table `pages` in `layer`.
  KVLayout layout(int layer, const int32_t* pages) const;

 private:
  PagePool(Backend& backend, const PagePoolOptions& options);

  Backend* backend_;
  PagePoolOptions options_;
  std::vector<Tensor> k_, v_;
  mutable std::recursive_mutex mu_;  // guards free_ and refcount_
  std::vector<int32_t> free_;  // stack: back() is handed out next
  std::vector<int32_t> refcount_;
};

}  // namespace combs
