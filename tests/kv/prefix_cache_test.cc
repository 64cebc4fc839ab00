// The page pool's cached pages and the prefix cache's index: references, the reclaim order
// (least recently released first), the hook, and keys that name a page's whole prefix.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/prefix_cache.h"

using namespace combs;

namespace {

std::unique_ptr<PagePool> make_pool(CpuBackend& backend, int64_t num_pages) {
  PagePoolOptions o;
  o.geometry = {2, 2, 8, DType::kF32};
  o.page_size = 4;
  o.num_pages = num_pages;
  auto pool = PagePool::create(backend, o);
  REQUIRE(pool.ok());
  return std::move(pool).value();
}

}  // namespace

TEST_CASE("cached pages stay filled until alloc reclaims the least recently released", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 3);
  const int32_t a = *pool->alloc(), b = *pool->alloc(), c = *pool->alloc();
  pool->cache_page(a);
  pool->cache_page(b);
  CHECK(pool->refcount(a) == 2);
  CHECK(pool->num_cached() == 2);
  CHECK(pool->num_reclaimable() == 0);  // their holders still hold them
  CHECK(pool->num_available() == 0);
  pool->release(b);  // b first: it goes first
  pool->release(a);
  CHECK(pool->num_free() == 0);
  CHECK(pool->num_reclaimable() == 2);
  CHECK(pool->num_available() == 2);
  std::vector<int32_t> told;
  pool->set_reclaim_hook([&](int32_t p) { told.push_back(p); });
  CHECK(pool->alloc() == b);
  CHECK(told == std::vector<int32_t>{b});
  CHECK_FALSE(pool->is_cached(b));
  CHECK(pool->refcount(b) == 1);
  // Held again, a is not reclaimable; released, it is.
  pool->retain(a);
  CHECK(pool->num_reclaimable() == 0);
  CHECK(pool->alloc() == std::nullopt);
  pool->release(a);
  CHECK(pool->num_reclaimable() == 1);
  // Uncached while only the index holds it: free.
  pool->uncache_page(a);
  CHECK(pool->num_free() == 1);
  CHECK(pool->num_cached() == 0);
  CHECK(pool->refcount(a) == 0);
  pool->release(c);
  CHECK(pool->num_free() == 2);
}

TEST_CASE("the prefix cache names pages by their whole prefix and forgets reclaimed ones", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 4);
  PrefixCache cache(*pool);
  const Digest root = cache.chain_root("model", "tenant"), other = cache.chain_root("model", "other");
  CHECK(root != other);
  CHECK(cache.chain_root("another model", "tenant") != root);
  const std::vector<int32_t> t0{1, 2, 3, 4}, t1{5, 6, 7, 8};
  const Digest k0 = PrefixCache::chain_next(root, t0), k1 = PrefixCache::chain_next(k0, t1);
  CHECK(PrefixCache::chain_next(other, t0) != k0);               // namespaces do not meet
  CHECK(PrefixCache::chain_next(PrefixCache::chain_next(root, t1), t1) != k1);  // nor other prefixes
  const int32_t p0 = *pool->alloc(), p1 = *pool->alloc();
  CHECK(cache.insert(k0, p0));
  CHECK(cache.insert(k1, p1));
  CHECK_FALSE(cache.insert(k1, p0));  // p0 is named already
  const int32_t dup = *pool->alloc();
  CHECK_FALSE(cache.insert(k1, dup));  // k1 names p1 already
  pool->release(dup);
  CHECK(cache.find(k0) == p0);
  CHECK(cache.find(k1) == p1);
  CHECK(cache.key_of(p1) == k1);
  CHECK(cache.consistent());
  pool->release(p1);  // the session goes: p1, then p0, become reclaimable
  pool->release(p0);
  CHECK(cache.size() == 2);
  // Two free pages, then the reclaimable ones in the order released.
  const int32_t f0 = *pool->alloc(), f1 = *pool->alloc();
  CHECK(cache.size() == 2);
  CHECK(pool->alloc() == p1);
  CHECK(cache.find(k1) == std::nullopt);
  CHECK(cache.find(k0) == p0);
  CHECK(cache.consistent());
  pool->release(f0);
  pool->release(f1);
  pool->release(p1);
  cache.clear();
  CHECK(cache.size() == 0);
  CHECK(pool->num_free() == 4);
  CHECK(cache.consistent());
}
