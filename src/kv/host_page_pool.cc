#include "combs/kv/host_page_pool.h"

#include <cassert>
#include <limits>
#include <string>

namespace combs {

StatusOr<std::unique_ptr<HostPagePool>> HostPagePool::create(PagePool& device, int64_t num_pages) {
  if (num_pages < 1 || num_pages > std::numeric_limits<int32_t>::max()) {
    return invalid_argument_error("host page pool: num_pages must be in [1, 2^31), got " + std::to_string(num_pages) +
                                  " (is the host KV memory smaller than one page of " +
                                  std::to_string(combs::page_bytes(device.geometry(), device.page_size())) + " bytes?)");
  }
  const int64_t bytes = num_pages * combs::page_bytes(device.geometry(), device.page_size());
  const DType dt = device.geometry().dtype;  // an element type: pages are whole elements
  auto memory = device.backend().alloc_host(Shape{bytes / static_cast<int64_t>(dtype_size(dt))}, dt);
  if (!memory.ok()) {
    return resource_exhausted_error("host page pool: cannot pin " + std::to_string(bytes >> 20) +
                                    " MiB of host memory for " + std::to_string(num_pages) + " pages: " +
                                    memory.status().message());
  }
  return std::unique_ptr<HostPagePool>(new HostPagePool(device, std::move(memory).value(), num_pages));
}

HostPagePool::HostPagePool(PagePool& device, Tensor memory, int64_t num_pages)
    : device_(&device), memory_(std::move(memory)), refcount_(num_pages, 0) {
  const KVGeometry& g = device.shard_geometry();
  num_layers_ = g.num_layers;
  num_shards_ = device.num_shards();
  chunk_bytes_ = static_cast<int64_t>(g.n_kv_heads) * device.page_size() * g.head_dim *
                 static_cast<int64_t>(dtype_size(g.dtype));
  free_.reserve(num_pages);
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

std::optional<int32_t> HostPagePool::alloc() {
  if (free_.empty()) return std::nullopt;
  const int32_t page = free_.back();
  free_.pop_back();
  assert(refcount_[page] == 0);
  refcount_[page] = 1;
  return page;
}

void HostPagePool::retain(int32_t page) {
  assert(refcount_[page] > 0);
  ++refcount_[page];
}

void HostPagePool::release(int32_t page) {
  assert(refcount_[page] > 0);
  if (--refcount_[page] == 0) free_.push_back(page);
}

Status HostPagePool::store(std::span<const int32_t> device_pages, std::span<const int32_t> host_pages) {
  return copy(device_pages, host_pages, true);
}

Status HostPagePool::load(std::span<const int32_t> host_pages, std::span<const int32_t> device_pages) {
  return copy(device_pages, host_pages, false);
}

Status HostPagePool::copy(std::span<const int32_t> device_pages, std::span<const int32_t> host_pages, bool to_host) {
  if (device_pages.size() != host_pages.size()) {
    return invalid_argument_error("host page pool: " + std::to_string(device_pages.size()) + " device pages for " +
                                  std::to_string(host_pages.size()) + " host pages");
  }
  for (size_t i = 0; i < device_pages.size(); ++i) {
    if (device_pages[i] < 0 || device_pages[i] >= device_->num_pages() || host_pages[i] < 0 ||
        host_pages[i] >= num_pages()) {
      return invalid_argument_error("host page pool: page " + std::to_string(i) + " of the copy is out of range");
    }
  }
  char* host = static_cast<char*>(memory_.data());
  for (int shard = 0; shard < num_shards_; ++shard) {  // each shard's heads by its own device
    chunks_.clear();
    for (size_t i = 0; i < device_pages.size(); ++i) {
      char* page = host + host_pages[i] * page_bytes();
      for (int layer = 0; layer < num_layers_; ++layer) {
        int kv = 0;
        for (const Tensor* arena : {&device_->k_arena(layer, shard), &device_->v_arena(layer, shard)}) {
          char* dev = static_cast<char*>(arena->data()) + device_pages[i] * chunk_bytes_;
          char* h = page + ((shard * num_layers_ + layer) * 2 + kv++) * chunk_bytes_;
          chunks_.push_back(to_host ? Backend::CopyChunk{dev, h} : Backend::CopyChunk{h, dev});
        }
      }
    }
    COMBS_RETURN_IF_ERROR(device_->shard_backend(shard).copy_chunks(chunks_, static_cast<size_t>(chunk_bytes_)));
  }
  return ok_status();
}

}  // namespace combs
