#include "combs/kv/contiguous_kv_cache.h"

#include <algorithm>
#include <string>

namespace combs {

StatusOr<std::unique_ptr<ContiguousKVCache>> ContiguousKVCache::create(
    Backend& backend, const KVGeometry& geometry, int64_t capacity) {
  COMBS_RETURN_IF_ERROR(validate_kv_geometry(geometry));
  if (capacity < 1 || capacity > (int64_t{1} << 31)) {
    return invalid_argument_error("contiguous KV cache: capacity must be in [1, 2^31], got " +
                                  std::to_string(capacity));
  }
  std::unique_ptr<ContiguousKVCache> cache(new ContiguousKVCache(backend, geometry, capacity));
  const Shape shape{geometry.n_kv_heads, capacity, geometry.head_dim};
  for (int layer = 0; layer < geometry.num_layers; ++layer) {
    COMBS_ASSIGN_OR_RETURN(Tensor k, backend.alloc(shape, geometry.dtype));
    COMBS_ASSIGN_OR_RETURN(Tensor v, backend.alloc(shape, geometry.dtype));
    cache->k_.push_back(std::move(k));
    cache->v_.push_back(std::move(v));
  }
  return cache;
}

ContiguousKVCache::ContiguousKVCache(Backend& backend, const KVGeometry& geometry,
                                     int64_t capacity)
    : KVCache(backend, geometry), capacity_(capacity) {}

int64_t ContiguousKVCache::popn(int64_t n) {
  const int64_t len = seq_len();
  n = std::clamp<int64_t>(n, 0, len);
  truncate_layers(len - n);
  return n;
}

void ContiguousKVCache::reset() { truncate_layers(0); }

KVLayout ContiguousKVCache::layout(int layer) const {
  KVLayout l;
  l.k = k_[layer].data();
  l.v = v_[layer].data();
  l.page_table = kOnePage;
  l.page_size = capacity_;
  l.head_stride = capacity_ * geometry().head_dim;
  l.page_stride = l.head_stride * geometry().n_kv_heads;
  l.head_dim = geometry().head_dim;
  l.dtype = geometry().dtype;
  return l;
}

}  // namespace combs
