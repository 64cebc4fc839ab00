// The host tier's copies on any backend: pages stored to host memory and loaded back into other
// pages hold the same bytes on every shard, and nothing else changes (kv tests on the CPU, [cuda]
// on a GPU).
#pragma once

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "combs/kv/host_page_pool.h"
#include "support/random.h"

namespace combs::testing {

// Every shard's every layer's K and V arena as host bytes (through the shard's backend's copy).
inline std::vector<std::vector<char>> arena_bytes(PagePool& pool) {
  std::vector<std::vector<char>> out;
  for (int shard = 0; shard < pool.num_shards(); ++shard) {
    for (int layer = 0; layer < pool.geometry().num_layers; ++layer) {
      for (const Tensor* arena : {&pool.k_arena(layer, shard), &pool.v_arena(layer, shard)}) {
        std::vector<char> bytes(arena->nbytes());
        const Tensor host = Tensor::wrap(bytes.data(), arena->shape(), arena->dtype());
        REQUIRE(pool.shard_backend(shard).copy(*arena, host).ok());
        out.push_back(std::move(bytes));
      }
    }
  }
  return out;
}

// Random bytes in every arena (finite f16/bf16/f32 values are not needed: the copies move bytes).
inline void fill_arenas(PagePool& pool, Rng& rng) {
  for (int shard = 0; shard < pool.num_shards(); ++shard) {
    for (int layer = 0; layer < pool.geometry().num_layers; ++layer) {
      for (const Tensor* arena : {&pool.k_arena(layer, shard), &pool.v_arena(layer, shard)}) {
        std::vector<char> bytes(arena->nbytes());
        for (char& b : bytes) b = static_cast<char>(rng.integer(0, 255));
        const Tensor host = Tensor::wrap(bytes.data(), arena->shape(), arena->dtype());
        REQUIRE(pool.shard_backend(shard).copy(host, *arena).ok());
      }
    }
  }
}

// Stores device pages `from` to host pages, loads them into device pages `to`; checks that `to`
// now holds what `from` held and that every other page is untouched.
inline void check_round_trip(PagePool& pool, HostPagePool& host, const std::vector<int32_t>& from,
                             const std::vector<int32_t>& to, Rng& rng) {
  fill_arenas(pool, rng);
  const std::vector<std::vector<char>> before = arena_bytes(pool);
  std::vector<int32_t> host_pages;
  for (size_t i = 0; i < from.size(); ++i) host_pages.push_back(*host.alloc());
  REQUIRE(host.store(from, host_pages).ok());
  REQUIRE(host.load(host_pages, to).ok());
  const std::vector<std::vector<char>> after = arena_bytes(pool);
  const KVGeometry& g = pool.shard_geometry();  // (the whole geometry where there is one shard)
  const size_t page = static_cast<size_t>(g.n_kv_heads) * pool.page_size() * g.head_dim * dtype_size(g.dtype);
  for (size_t a = 0; a < after.size(); ++a) {
    for (int64_t p = 0; p < pool.num_pages(); ++p) {
      int64_t source = p;  // what page p must hold now
      for (size_t i = 0; i < to.size(); ++i)
        if (to[i] == p) source = from[i];
      INFO("arena " << a << " page " << p << " from page " << source);
      CHECK(std::memcmp(after[a].data() + p * page, before[a].data() + source * page, page) == 0);
    }
  }
  for (int32_t h : host_pages) host.release(h);
}

}  // namespace combs::testing
