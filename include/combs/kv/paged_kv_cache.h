// PagedKVCache: one sequence's page table into a shared PagePool (MLC / vLLM style).
//
// Growing takes pages from the pool as positions cross page boundaries; popn() returns pages that
// become wholly unused; reset() and destruction return them all. fork() makes a second cache that
// shares every full page by reference count and copies the partly filled last page; writing into a
// page that is still shared (after a popn into it) first copies it (copy-on-write), so a sequence
// never changes what another sees. Attention reads K/V in place in the pool's pages.
//
// Sliding windows: where every layer attends only to a window of recent keys, the pages behind it
// are dead weight. release_before(pos) gives back the full pages wholly before pos; the table then
// names the pool's zero page for them (seq_len() and every position's place stay as they were) and
// first_held_position() says where the held positions begin. An attention whose window would read
// a released position fails (FAILED_PRECONDITION) instead of reading the zero page; popn() to
// before first_held_position() leaves nothing held, so the cache resets itself (a caller rebuilds
// the positions from its tokens, as after an eviction).
// Thread-compatible (see kv_cache.h); the pool must outlive the cache.
#pragma once

#include <memory>
#include <span>

#include "combs/kv/kv_cache.h"
#include "combs/kv/page_pool.h"

namespace combs {

class PagedKVCache final : public KVCache {
 public:
  // INVALID_ARGUMENT unless max_seq_len >= 1.
  static StatusOr<std::unique_ptr<PagedKVCache>> create(PagePool& pool, int64_t max_seq_len);
  ~PagedKVCache() override;

  // A new cache holding the same positions, sharing this one's full pages. FAILED_PRECONDITION
  // while layers have different lengths (mid-forward); RESOURCE_EXHAUSTED when the partly filled
  // last page cannot be copied for want of a free page.
  StatusOr<std::unique_ptr<PagedKVCache>> fork() const;

  // Appends full pages that hold the next positions' K/V (the prefix cache's), sharing them as a
  // fork does (a reference each; writing into one copies it first). FAILED_PRECONDITION unless
  // every layer holds seq_len() positions and seq_len() is a whole number of pages;
  // RESOURCE_EXHAUSTED past capacity(). On error nothing changes.
  Status adopt_pages(std::span<const int32_t> pages);
  // Appends pages that hold positions [seq_len(), end) (the host tier's copies loaded into pages
  // the caller allocated): the cache takes over their references (one each, not retained). end may
  // fall inside the last page. Preconditions and errors as adopt_pages, and INVALID_ARGUMENT unless
  // the pages hold exactly the positions up to end; on error nothing changes (the caller keeps the
  // references).
  Status adopt_filled_pages(std::span<const int32_t> pages, int64_t end);

  // Drops the last min(n, seq_len()) positions; to before first_held_position(), everything.
  int64_t popn(int64_t n) override;
  void reset() override;
  // Pages held (released ones are not).
  std::optional<int64_t> pages_used() const override {
    return static_cast<int64_t>(table_.size()) - released_;
  }
  int64_t capacity() const override { return max_seq_len_; }
  int64_t first_held_position() const override { return released_ * pool_->page_size(); }

  // Gives back the pages that hold only positions before min(pos, the shortest layer's length)
  // (full pages, none already released) and returns how many went. Their positions are then no
  // longer held (see above). Prefix-cached pages stay in the pool's index.
  int64_t release_before(int64_t pos);

  // Logical page -> physical page id (the pool's zero_page() for a released page).
  std::span<const int32_t> page_table() const { return table_; }
  // Pages of this cache that another cache also holds (the prefix cache's reference aside).
  int64_t pages_shared() const;
  // Pages that growing to `end` positions would take from the pool (new and copy-on-write).
  int64_t pages_to_grow(int64_t end) const { return pages_needed(end); }
  PagePool& page_pool() const { return *pool_; }

 protected:
  PagePool* pool() const override { return pool_; }
  int64_t pages_needed(int64_t end) const override;
  void reserve(int64_t end) override;
  KVLayout layout(int layer) const override { return pool_->layout(layer, table_.data()); }

 private:
  PagedKVCache(PagePool& pool, int64_t max_seq_len);
  // Index of the first page that positions from seq_len() on would write into.
  int64_t first_written_page(int64_t end) const;
  void release_pages_from(int64_t keep);
  // adopt_pages' checks: every layer at seq_len(), a page boundary, end within the capacity.
  Status check_adoptable(const char* who, int64_t end) const;

  PagePool* pool_;
  int64_t max_seq_len_;
  std::vector<int32_t> table_;
  int64_t released_ = 0;  // the first released_ pages of table_ are released (the zero page)
};

// One shard of a paged cache whose pool is split over devices (PagePool::create_sharded): what
// a tensor-parallel rank's attention reads and writes — the shard's KV heads, on its device, at
// the whole cache's page ids. A view, bound to a cache between steps with the cache's lengths;
// the pages are reserved (reserve_batch_pages) and the lengths committed (commit_batch) on the
// whole caches by the thread that drives the ranks, before and after every rank's step, so a
// rank's step neither takes pages nor moves the cache (popn and reset do nothing here).
class PagedKVShard final : public KVCache {
 public:
  PagedKVShard(PagePool& pool, int shard);
  // FAILED_PRECONDITION unless the cache is on this view's pool with every layer at seq_len().
  Status bind(const PagedKVCache& cache);

  int64_t popn(int64_t) override { return 0; }
  void reset() override {}
  std::optional<int64_t> pages_used() const override { return cache_ ? cache_->pages_used() : 0; }
  int64_t capacity() const override { return cache_ ? cache_->capacity() : 0; }
  int64_t first_held_position() const override { return cache_ ? cache_->first_held_position() : 0; }

 protected:
  int64_t pages_needed(int64_t) const override { return 0; }
  void reserve(int64_t) override {}
  KVLayout layout(int layer) const override { return pool_->layout(layer, cache_->page_table().data(), shard_); }

 private:
  PagePool* pool_;
  int shard_;
  const PagedKVCache* cache_ = nullptr;
};

}  // namespace combs
