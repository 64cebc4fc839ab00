// Shapes and addresses of K/V storage, shared by the caches and the attention kernels.
#pragma once

#include <cstdint>

#include "combs/backend/dtype.h"

namespace combs {

// What a cache stores per token: for each of num_layers layers, K and V of n_kv_heads heads of
// head_dim elements, in dtype.
struct KVGeometry {
  int num_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;

  bool operator==(const KVGeometry&) const = default;
};

// Where one sequence's K/V of one layer lie: position p is in physical page
// page_table[p / page_size], slot p % page_size; head h of that token starts at element
//   page_table[p / page_size] * page_stride + h * head_stride + (p % page_size) * head_dim
// of k (and of v). A paged cache's arena is [num_pages, n_kv, page_size, head_dim]; a contiguous
// cache is one page of page_size = capacity, [n_kv, capacity, head_dim].
struct KVLayout {
  void* k = nullptr;
  void* v = nullptr;
  const int32_t* page_table = nullptr;
  int64_t page_size = 0;
  int64_t page_stride = 0;  // elements
  int64_t head_stride = 0;  // elements
  int head_dim = 0;
  DType dtype = DType::kF32;

  int64_t offset(int64_t p, int head) const {
    return static_cast<int64_t>(page_table[p / page_size]) * page_stride + head * head_stride +
           (p % page_size) * head_dim;
  }
};

}  // namespace combs
