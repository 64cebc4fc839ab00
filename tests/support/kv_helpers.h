// Small helpers shared by the KV tests.
#pragma once

#include <vector>

#include "combs/backend/tensor.h"
#include "combs/kv/kv_cache.h"
#include "support/random.h"

namespace combs::testing {

// A host tensor viewing `data` (which must outlive it).
inline Tensor view(std::vector<float>& data, Shape shape) {
  return Tensor::wrap(data.data(), shape, DType::kF32);
}

// Appends random K/V to every layer until the cache holds `total` positions.
inline Status grow(KVCache& cache, int64_t total, Rng& rng) {
  const KVGeometry& g = cache.geometry();
  for (int layer = 0; layer < g.num_layers; ++layer) {
    const int64_t pos = cache.layer_len(layer);
    const int64_t n = total - pos;
    std::vector<float> k = rng.floats(n * g.n_kv_heads * g.head_dim);
    std::vector<float> v = rng.floats(n * g.n_kv_heads * g.head_dim);
    Status s = cache.append(layer, view(k, {n, g.n_kv_heads, g.head_dim}),
                            view(v, {n, g.n_kv_heads, g.head_dim}), pos);
    if (!s.ok()) return s;
  }
  return ok_status();
}

}  // namespace combs::testing
