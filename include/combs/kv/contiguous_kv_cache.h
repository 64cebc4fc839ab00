// ContiguousKVCache: the baseline — per layer one K and one V buffer, [n_kv_heads, capacity,
// head_dim], allocated up front for `capacity` positions. Used to cross-validate the paged cache
// and as the "contiguous" side of benchmarks. Thread-compatible.
#pragma once

#include <memory>
#include <vector>

#include "combs/kv/kv_cache.h"

namespace combs {

class ContiguousKVCache final : public KVCache {
 public:
  // INVALID_ARGUMENT for a bad geometry or capacity; RESOURCE_EXHAUSTED when the backend cannot
  // hold the buffers.
  static StatusOr<std::unique_ptr<ContiguousKVCache>> create(Backend& backend,
                                                             const KVGeometry& geometry,
                                                             int64_t capacity);

  int64_t popn(int64_t n) override;
  void reset() override;
  std::optional<int64_t> pages_used() const override { return std::nullopt; }
  int64_t capacity() const override { return capacity_; }

 protected:
  int64_t pages_needed(int64_t) const override { return 0; }
  void reserve(int64_t) override {}
  KVLayout layout(int layer) const override;

 private:
  ContiguousKVCache(Backend& backend, const KVGeometry& geometry, int64_t capacity);

  int64_t capacity_;
  std::vector<Tensor> k_, v_;
  static constexpr int32_t kOnePage[1] = {0};
};

}  // namespace combs
