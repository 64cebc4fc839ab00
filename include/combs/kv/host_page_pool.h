// HostPagePool: a second tier for a PagePool's pages, in the host memory its backend copies to and
// from at the link's speed (Backend::alloc_host: page-locked on a GPU). Under device memory
// pressure the engine moves idle sessions' pages here instead of dropping them, and copies them
// back when that costs less than computing them again.
//
// A host page holds what one device page does: every layer's K and V of page_size positions,
// [num_pages, shards, num_layers, 2 (K, V), n_kv_heads / shards, page_size, head_dim] in the
// device pool's dtype (a pool split over several devices, PagePool::create_sharded: each shard's
// heads copied by its own device; the host memory is portable, pinned for every device).
// Pages are reference counted (a fork shares its parent's host copy); the free list hands out low
// ids first. Bookkeeping is plain host data.
// Thread-compatible (the engine uses it under its lock). store() and load() run on the device
// pool's backend and return when the copy is done; the device pages they touch must not be
// written meanwhile.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "combs/backend/tensor.h"
#include "combs/kv/page_pool.h"

namespace combs {

class HostPagePool {
 public:
  // INVALID_ARGUMENT for num_pages < 1 (or past 2^31); RESOURCE_EXHAUSTED when the host cannot
  // give (pin) that much memory.
  static StatusOr<std::unique_ptr<HostPagePool>> create(PagePool& device, int64_t num_pages);

  int64_t num_pages() const { return static_cast<int64_t>(refcount_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return num_pages() - num_free(); }
  // Bytes of one page (PagePool's page_bytes()).
  int64_t page_bytes() const { return 2 * static_cast<int64_t>(num_layers_) * num_shards_ * chunk_bytes_; }
  PagePool& device() const { return *device_; }

  // A free page with reference count 1; nullopt when none is free.
  std::optional<int32_t> alloc();
  void retain(int32_t page);
  void release(int32_t page);  // at zero the page is free again
  int32_t refcount(int32_t page) const { return refcount_[page]; }

  // Copies device_pages[i] into host_pages[i] (every layer, K and V) as one batched copy.
  // INVALID_ARGUMENT for lists of different lengths or a page id out of range.
  Status store(std::span<const int32_t> device_pages, std::span<const int32_t> host_pages);
  // Copies host_pages[i] into device_pages[i].
  Status load(std::span<const int32_t> host_pages, std::span<const int32_t> device_pages);

 private:
  HostPagePool(PagePool& device, Tensor memory, int64_t num_pages);
  Status copy(std::span<const int32_t> device_pages, std::span<const int32_t> host_pages, bool to_host);

  PagePool* device_;
  Tensor memory_;            // num_pages * page_bytes() bytes
  int num_layers_ = 0, num_shards_ = 1;
  int64_t chunk_bytes_ = 0;  // one layer's K (or V) of one page on one shard
  std::vector<int32_t> free_;  // stack: back() is handed out next
  std::vector<int32_t> refcount_;
  std::vector<Backend::CopyChunk> chunks_;  // scratch of copy()
};

}  // namespace combs
