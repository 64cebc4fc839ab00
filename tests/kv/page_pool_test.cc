// The page pool's allocator (ported from the seed's PageAllocator tests) and its sizing.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/page_pool.h"

using namespace combs;

namespace {

std::unique_ptr<PagePool> make_pool(CpuBackend& backend, int64_t num_pages, int page_size = 16) {
  PagePoolOptions o;
  o.geometry = {2, 2, 8, DType::kF32};
  o.page_size = page_size;
  o.num_pages = num_pages;
  auto pool = PagePool::create(backend, o);
  REQUIRE(pool.ok());
  return std::move(pool).value();
}

}  // namespace

TEST_CASE("page pool allocates in order and exhausts", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 3);
  CHECK(pool->num_free() == 3);
  CHECK(pool->alloc() == 0);
  CHECK(pool->alloc() == 1);
  CHECK(pool->alloc() == 2);
  CHECK(pool->alloc() == std::nullopt);
  CHECK(pool->num_free() == 0);
  CHECK(pool->num_used() == 3);
}

TEST_CASE("page pool reuses freed pages last in first out", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 2);
  const int32_t p0 = *pool->alloc();
  const int32_t p1 = *pool->alloc();
  pool->release(p1);
  pool->release(p0);
  CHECK(pool->num_free() == 2);
  CHECK(pool->alloc() == p0);  // most recently freed first
  CHECK(pool->alloc() == p1);
}

TEST_CASE("page pool counts references and frees at zero", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 2);
  const int32_t p = *pool->alloc();
  pool->retain(p);
  CHECK(pool->refcount(p) == 2);
  pool->release(p);
  CHECK(pool->refcount(p) == 1);
  CHECK(pool->num_free() == 1);
  pool->release(p);
  CHECK(pool->refcount(p) == 0);
  CHECK(pool->num_free() == 2);
}

TEST_CASE("page counts round up", "[kv]") {
  CHECK(pages_for_tokens(16, 16) == 1);
  CHECK(pages_for_tokens(17, 16) == 2);
  CHECK(pages_for_tokens(1, 16) == 1);
  CHECK(pages_for_tokens(0, 16) == 0);
  CHECK(pages_for_tokens(7, 1) == 7);
  CHECK(pages_for_tokens(7, 3) == 3);
}

TEST_CASE("page pool is sized from a memory budget", "[kv]") {
  const KVGeometry g{4, 8, 128, DType::kBF16};
  // 2 (K, V) * 4 layers * 8 heads * 16 slots * 128 dims * 2 bytes
  CHECK(page_bytes(g, 16) == 2 * 4 * 8 * 16 * 128 * 2);
  CHECK(pages_for_budget(g, 16, page_bytes(g, 16) * 10 + 5) == 10);
  CHECK(pages_for_budget(g, 16, page_bytes(g, 16) - 1) == 0);

  CpuBackend backend({1});
  PagePoolOptions o;
  o.geometry = g;
  o.num_pages = pages_for_budget(g, 16, 1 << 20);
  auto pool = PagePool::create(backend, o);
  REQUIRE(pool.ok());
  CHECK((*pool)->k_arena(3).shape() == Shape{o.num_pages, 8, 16, 128});
  CHECK((*pool)->v_arena(0).dtype() == DType::kBF16);
}

TEST_CASE("page pool copies a page in every layer", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 2, 3);
  for (int layer = 0; layer < 2; ++layer) {
    float* k = pool->k_arena(layer).data_as<float>();
    float* v = pool->v_arena(layer).data_as<float>();
    const int64_t page = pool->k_arena(layer).numel() / 2;
    for (int64_t i = 0; i < page; ++i) {
      k[i] = float(i + 1000 * layer);
      v[i] = -float(i + 1000 * layer);
      k[page + i] = v[page + i] = 0.0f;
    }
  }
  pool->copy_page(0, 1);
  for (int layer = 0; layer < 2; ++layer) {
    const float* k = pool->k_arena(layer).data_as<float>();
    const float* v = pool->v_arena(layer).data_as<float>();
    const int64_t page = pool->k_arena(layer).numel() / 2;
    for (int64_t i = 0; i < page; ++i) {
      REQUIRE(k[page + i] == float(i + 1000 * layer));
      REQUIRE(v[page + i] == -float(i + 1000 * layer));
    }
  }
}
