// Page-table bookkeeping of PagedKVCache (ported from the seed's tests), and forks that share pages.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/paged_kv_cache.h"
#include "support/kv_helpers.h"
#include "support/kv_reference.h"

using namespace combs;
using namespace combs::testing;

namespace {

struct Fixture {
  explicit Fixture(int64_t num_pages, int page_size = 16, int64_t max_seq_len = 64)
      : backend({1}), rng(test_seed()) {
    PagePoolOptions o;
    o.geometry = {2, 2, 8, DType::kF32};
    o.page_size = page_size;
    o.num_pages = num_pages;
    pool = std::move(PagePool::create(backend, o)).value();
    cache = std::move(PagedKVCache::create(*pool, max_seq_len)).value();
  }
  void grow_to(int64_t total) { REQUIRE(grow(*cache, total, rng).ok()); }

  CpuBackend backend;
  Rng rng;
  std::unique_ptr<PagePool> pool;
  std::unique_ptr<PagedKVCache> cache;
};

}  // namespace

TEST_CASE("popn frees only fully unused pages", "[kv]") {
  Fixture f(4);
  INFO("seed " << f.rng.seed());
  f.grow_to(40);  // pages 0, 1, 2 (page 2 holds slots 32..39)
  CHECK(f.cache->pages_used() == 3);
  CHECK(f.pool->num_free() == 1);

  CHECK(f.cache->popn(9) == 9);  // 31 -> page 2 wholly unused, freed
  CHECK(f.cache->seq_len() == 31);
  CHECK(f.cache->pages_used() == 2);
  CHECK(f.pool->num_free() == 2);

  f.cache->popn(15);  // 16 -> page 1 unused
  CHECK(f.cache->pages_used() == 1);
  f.cache->popn(1);  // 15 -> page 0 still needed
  CHECK(f.cache->pages_used() == 1);

  CHECK(f.cache->popn(1000) == 15);  // clamps to seq_len
  CHECK(f.cache->seq_len() == 0);
  CHECK(f.cache->pages_used() == 0);
  CHECK(f.pool->num_free() == 4);
}

TEST_CASE("popn at an exact page edge", "[kv]") {
  Fixture f(4);
  INFO("seed " << f.rng.seed());
  f.grow_to(32);  // exactly 2 pages
  f.cache->popn(16);
  CHECK(f.cache->pages_used() == 1);
  CHECK(f.pool->num_free() == 3);
  f.cache->popn(16);
  CHECK(f.cache->pages_used() == 0);
  CHECK(f.pool->num_free() == 4);
}

TEST_CASE("regrowth after popn reuses the freed pages", "[kv]") {
  Fixture f(4);
  INFO("seed " << f.rng.seed());
  f.grow_to(40);
  const auto before = std::vector<int32_t>(f.cache->page_table().begin(), f.cache->page_table().end());
  f.cache->popn(9);  // frees the page of slots 32..47
  f.grow_to(33);     // needs a page again: the one just freed
  CHECK(f.cache->pages_used() == 3);
  CHECK(f.pool->num_free() == 1);
  CHECK(std::vector<int32_t>(f.cache->page_table().begin(), f.cache->page_table().end()) == before);
}

TEST_CASE("reset releases all pages", "[kv]") {
  Fixture f(4);
  INFO("seed " << f.rng.seed());
  f.grow_to(40);
  f.cache->reset();
  CHECK(f.cache->seq_len() == 0);
  CHECK(f.cache->pages_used() == 0);
  CHECK(f.pool->num_free() == 4);
  CHECK(f.pool->alloc() == 0);  // released last page first: page 0 is on top again
}

TEST_CASE("page size 1 and odd page sizes keep one page per started page", "[kv]") {
  for (int ps : {1, 3, 5}) {
    Fixture f(64, ps, 64);
    INFO("page size " << ps << ", seed " << f.rng.seed());
    f.grow_to(10);
    CHECK(f.cache->pages_used() == pages_for_tokens(10, ps));
    f.cache->popn(4);
    CHECK(f.cache->pages_used() == pages_for_tokens(6, ps));
    CHECK(f.pool->num_free() == 64 - pages_for_tokens(6, ps));
  }
}

TEST_CASE("caches on one pool draw from the shared free list", "[kv]") {
  Fixture f(6);
  INFO("seed " << f.rng.seed());
  auto other = std::move(PagedKVCache::create(*f.pool, 64)).value();
  f.grow_to(20);                                   // pages 0, 1
  REQUIRE(grow(*other, 17, f.rng).ok());           // pages 2, 3
  CHECK(f.pool->num_free() == 2);
  CHECK(std::vector<int32_t>(other->page_table().begin(), other->page_table().end()) ==
        std::vector<int32_t>{2, 3});
  other.reset();  // destroying a cache returns its pages
  CHECK(f.pool->num_free() == 4);
}

// Runs one attention step on `cache` and the reference with the same random inputs, in every
// layer, and checks the outputs agree. Returns the outputs of the last layer.
static std::vector<float> step(KVCache& cache, std::vector<ReferenceKV>& ref, int64_t n_new,
                               Rng& rng) {
  const KVGeometry& g = cache.geometry();
  const int n_q = g.n_kv_heads * 2;
  const float scale = 1.0f / std::sqrt(float(g.head_dim));
  std::vector<float> out;
  const int64_t pos = cache.seq_len();
  for (int layer = 0; layer < g.num_layers; ++layer) {
    auto q = rng.floats(n_new * n_q * g.head_dim, -2, 2);
    auto k = rng.floats(n_new * g.n_kv_heads * g.head_dim);
    auto v = rng.floats(n_new * g.n_kv_heads * g.head_dim);
    out.assign(n_new * n_q * g.head_dim, 0.0f);
    REQUIRE(cache
                .attention(layer, view(q, {n_new, n_q, g.head_dim}),
                           view(k, {n_new, g.n_kv_heads, g.head_dim}),
                           view(v, {n_new, g.n_kv_heads, g.head_dim}), pos, scale,
                           view(out, {n_new, n_q, g.head_dim}))
                .ok());
    const auto want = ref[layer].attend(q, k, v, n_q, scale);
    for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(want[i]).margin(1e-5));
  }
  return out;
}

TEST_CASE("fork shares full pages and copies the partial page and both continue independently", "[kv]") {
  Fixture f(16, 4, 64);
  INFO("seed " << f.rng.seed());
  std::vector<ReferenceKV> parent_ref(2, ReferenceKV(2, 8, DType::kF32));
  step(*f.cache, parent_ref, 10, f.rng);  // pages 0, 1 full; page 2 holds 2 of 4
  auto forked = f.cache->fork();
  REQUIRE(forked.ok());
  auto child = std::move(forked).value();
  std::vector<ReferenceKV> child_ref = parent_ref;

  CHECK(child->seq_len() == 10);
  CHECK(child->pages_used() == 3);
  CHECK(child->page_table()[0] == f.cache->page_table()[0]);
  CHECK(child->page_table()[1] == f.cache->page_table()[1]);
  CHECK(child->page_table()[2] != f.cache->page_table()[2]);
  CHECK(child->pages_shared() == 2);
  CHECK(f.pool->num_used() == 4);  // shared pages counted once

  // Different continuations; each matches its own history.
  for (int i = 0; i < 3; ++i) {
    step(*f.cache, parent_ref, 3, f.rng);
    step(*child, child_ref, 2, f.rng);
  }

  // The child rolls back into shared page 1 and writes there: copy-on-write keeps the parent intact.
  const int32_t shared = child->page_table()[1];
  CHECK(child->popn(child->seq_len() - 6) > 0);  // 6 positions: page 1 holds slots 4..5, shared
  for (auto& r : child_ref) r.truncate(6);
  step(*child, child_ref, 5, f.rng);
  CHECK(child->page_table()[1] != shared);
  CHECK(f.cache->page_table()[1] == shared);
  CHECK(f.pool->refcount(shared) == 1);
  step(*f.cache, parent_ref, 1, f.rng);  // the parent still sees its own history

  // Closing the parent leaves the child whole.
  f.cache.reset();
  CHECK(child->pages_shared() == 0);
  step(*child, child_ref, 3, f.rng);
  const int64_t child_pages = *child->pages_used();
  CHECK(f.pool->num_used() == child_pages);
  child.reset();
  CHECK(f.pool->num_free() == 16);
}

TEST_CASE("fork at a page edge copies nothing and fork fails cleanly without a free page", "[kv]") {
  Fixture f(3, 4, 64);
  INFO("seed " << f.rng.seed());
  f.grow_to(8);
  auto child = f.cache->fork();
  REQUIRE(child.ok());
  CHECK(f.pool->num_used() == 2);
  CHECK((*child)->pages_shared() == 2);

  f.grow_to(9);  // parent takes the last free page, partly filled
  auto refused = f.cache->fork();
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK(f.pool->refcount(f.cache->page_table()[0]) == 2);  // unchanged by the failed fork
}

TEST_CASE("release_before gives back the full pages behind a position, and popn, fork and reset keep count", "[kv]") {
  Fixture f(8, 16, 128);
  INFO("seed " << f.rng.seed());
  f.grow_to(70);  // pages 0..4, page 4 partly filled
  const std::vector<int32_t> pages(f.cache->page_table().begin(), f.cache->page_table().end());
  CHECK(f.cache->release_before(40) == 2);  // positions 0..31: pages 0 and 1
  CHECK(f.cache->first_held_position() == 32);
  CHECK(f.cache->seq_len() == 70);  // positions keep their places
  CHECK(f.cache->pages_used() == 3);
  CHECK(f.pool->num_free() == 5);
  CHECK(f.cache->page_table()[0] == f.pool->zero_page());
  CHECK(f.cache->page_table()[1] == f.pool->zero_page());
  CHECK(f.cache->page_table()[2] == pages[2]);
  CHECK(f.pool->refcount(pages[0]) == 0);
  CHECK(f.cache->release_before(40) == 0);  // nothing more before 40
  CHECK(f.cache->release_before(-5) == 0);
  CHECK(f.cache->release_before(1000) == 2);  // up to the length: the partly filled page stays
  CHECK(f.cache->first_held_position() == 64);
  CHECK(f.cache->pages_used() == 1);

  // A fork holds what its parent holds: the partly filled page copied, the released ones not.
  auto forked = f.cache->fork();
  REQUIRE(forked.ok());
  std::unique_ptr<PagedKVCache> child = std::move(forked).value();
  CHECK(child->first_held_position() == 64);
  CHECK(child->pages_used() == 1);
  CHECK(f.pool->num_free() == 6);
  f.grow_to(100);  // both go on past the released pages
  REQUIRE(grow(*child, 90, f.rng).ok());
  CHECK(child->pages_used() == 2);

  // popn within the held positions keeps the release; popn to before them leaves nothing held.
  CHECK(f.cache->popn(30) == 30);
  CHECK(f.cache->seq_len() == 70);
  CHECK(f.cache->first_held_position() == 64);
  CHECK(f.cache->popn(10) == 10);  // 60 < 64
  CHECK(f.cache->seq_len() == 0);
  CHECK(f.cache->first_held_position() == 0);
  CHECK(f.cache->pages_used() == 0);
  CHECK(f.pool->num_free() == 8 - 2);  // the child's two
  f.grow_to(20);  // and it grows again from the start
  CHECK(f.cache->pages_used() == 2);
  child->reset();
  CHECK(child->first_held_position() == 0);
  f.cache->reset();
  CHECK(f.pool->num_free() == 8);
}
