// Every error of the KV layer is a documented Status, and a failed call changes nothing.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/paged_kv_cache.h"
#include "support/kv_helpers.h"

using namespace combs;
using namespace combs::testing;

namespace {

constexpr int kHd = 8, kKv = 2, kQ = 4;

struct Inputs {
  std::vector<float> q, k, v, out;
  Inputs(Rng& rng, int64_t n)
      : q(rng.floats(n * kQ * kHd)), k(rng.floats(n * kKv * kHd)), v(rng.floats(n * kKv * kHd)),
        out(n * kQ * kHd) {}
  int64_t n() const { return static_cast<int64_t>(k.size()) / (kKv * kHd); }
  Status run(KVCache& c, int layer, int64_t pos) {
    return c.attention(layer, view(q, {n(), kQ, kHd}), view(k, {n(), kKv, kHd}),
                       view(v, {n(), kKv, kHd}), pos, 0.3f, view(out, {n(), kQ, kHd}));
  }
};

struct Fixture {
  CpuBackend backend{CpuBackendOptions{1}};
  Rng rng{test_seed()};
  std::unique_ptr<PagePool> pool;
  std::unique_ptr<PagedKVCache> cache;
  Fixture(int64_t num_pages = 4, int64_t max_seq_len = 32) {
    PagePoolOptions o;
    o.geometry = {2, kKv, kHd, DType::kF32};
    o.page_size = 4;
    o.num_pages = num_pages;
    pool = std::move(PagePool::create(backend, o)).value();
    cache = std::move(PagedKVCache::create(*pool, max_seq_len)).value();
  }
  void require_unchanged(int64_t len, int64_t free) {
    REQUIRE(cache->seq_len() == len);
    REQUIRE(pool->num_free() == free);
  }
};

}  // namespace

TEST_CASE("capacity exceeded is RESOURCE_EXHAUSTED", "[kv]") {
  Fixture f(16, 10);
  INFO("seed " << f.rng.seed());
  Inputs in(f.rng, 11);
  const Status s = in.run(*f.cache, 0, 0);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(s.message(), Catch::Contains("capacity"));
  f.require_unchanged(0, 16);
}

TEST_CASE("pool exhausted is RESOURCE_EXHAUSTED and leaves every cache as it was", "[kv]") {
  Fixture f(4, 64);
  INFO("seed " << f.rng.seed());
  auto other = std::move(PagedKVCache::create(*f.pool, 64)).value();
  REQUIRE(grow(*other, 9, f.rng).ok());  // 3 of 4 pages
  Inputs in(f.rng, 5);                   // needs 2
  const Status s = in.run(*f.cache, 0, 0);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(s.message(), Catch::Contains("page pool exhausted"));
  f.require_unchanged(0, 1);
  // A batch is all or nothing: two sequences needing a page each, with one free.
  REQUIRE(other->popn(1) == 1);          // 8 positions: page 2 returns, 2 free
  REQUIRE(f.pool->alloc().has_value());  // someone else takes one: 1 free
  Inputs two(f.rng, 2);
  std::vector<float> out(2 * kQ * kHd);
  const Tensor out_t = view(out, {2, kQ, kHd});
  const SeqAttention both[] = {{f.cache.get(), 0, 1}, {other.get(), 8, 1}};
  const Status b = attention_batch(both, 0, view(two.q, {2, kQ, kHd}), view(two.k, {2, kKv, kHd}),
                                   view(two.v, {2, kKv, kHd}), 0.3f, &out_t);
  CHECK(b.code() == StatusCode::kResourceExhausted);
  CHECK(f.cache->seq_len() == 0);
  CHECK(other->seq_len() == 8);
  CHECK(other->pages_used() == 2);
  CHECK(f.pool->num_free() == 1);
}

TEST_CASE("pos other than the cached length is FAILED_PRECONDITION", "[kv]") {
  Fixture f;
  INFO("seed " << f.rng.seed());
  REQUIRE(grow(*f.cache, 5, f.rng).ok());
  Inputs in(f.rng, 1);
  for (int64_t pos : {0, 4, 6}) {
    const Status s = in.run(*f.cache, 0, pos);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::Contains("pos"));
  }
  f.require_unchanged(5, 2);
}

TEST_CASE("a window or a global layer that reaches released positions is FAILED_PRECONDITION", "[kv]") {
  Fixture f(8, 64);
  INFO("seed " << f.rng.seed());
  REQUIRE(grow(*f.cache, 21, f.rng).ok());
  REQUIRE(f.cache->release_before(12) == 3);  // positions 0..11 (pages of 4)
  Inputs in(f.rng, 1);
  auto attend = [&](int64_t window) {
    std::vector<float>& q = in.q;
    return f.cache->attention(0, view(q, {1, kQ, kHd}), view(in.k, {1, kKv, kHd}), view(in.v, {1, kKv, kHd}), 21,
                              AttentionParams(0.3f, window, 0.0f), view(in.out, {1, kQ, kHd}));
  };
  for (int64_t window : {0, 11, 100}) {  // position 21's window of 11 reads 11 on
    const Status s = attend(window);
    INFO("window " << window);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::Contains("released"));
    f.require_unchanged(21, 8 - 3);
  }
  REQUIRE(attend(10).ok());  // reads 12 on
  CHECK(f.cache->layer_len(0) == 22);
  // An attention step is refused at begin, before any page is reserved, by the widest window its
  // layers attend with.
  f.cache->popn(1);
  AttentionStep step;
  const SeqAttention next{f.cache.get(), 21, 3};
  for (int64_t widest : {0, 11}) {
    INFO("widest window " << widest);
    const Status s = step.begin({&next, 1}, kQ, nullptr, AttentionImpl::kFlash, widest);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::Contains("released"));
    f.require_unchanged(21, 8 - 3);
  }
  CHECK(step.begin({&next, 1}, kQ, nullptr, AttentionImpl::kFlash, -1).code() == StatusCode::kInvalidArgument);
  REQUIRE(step.begin({&next, 1}, kQ, nullptr, AttentionImpl::kFlash, 10).ok());
  step.cancel();
}

TEST_CASE("layer out of range is INVALID_ARGUMENT", "[kv]") {
  Fixture f;
  INFO("seed " << f.rng.seed());
  Inputs in(f.rng, 1);
  for (int layer : {-1, 2, 1000}) {
    const Status s = in.run(*f.cache, layer, 0);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains("layer"));
  }
  f.require_unchanged(0, 4);
}

TEST_CASE("shape mismatches are INVALID_ARGUMENT", "[kv]") {
  Fixture f;
  INFO("seed " << f.rng.seed());
  Inputs in(f.rng, 3);
  auto q = view(in.q, {3, kQ, kHd}), k = view(in.k, {3, kKv, kHd}), v = view(in.v, {3, kKv, kHd}),
       out = view(in.out, {3, kQ, kHd});
  std::vector<float> wide(3 * 3 * kHd);
  const struct {
    const char* what;
    Tensor q, k, v, out;
  } bad[] = {
      {"k with the wrong head count", q, view(in.k, {3, 1, 2 * kHd}), v, out},
      {"v with fewer tokens than k", q, k, view(in.v, {2, kKv, kHd}), out},
      {"q heads not a multiple of KV heads", view(wide, {3, 3, kHd}), k, v, view(wide, {3, 3, kHd})},
      {"out shaped unlike q", q, k, v, view(in.out, {3, kHd, kQ})},
      {"q of rank 2", view(in.q, {3, kQ * kHd}), k, v, out},
  };
  for (const auto& b : bad) {
    INFO(b.what);
    const Status s = f.cache->attention(0, b.q, b.k, b.v, 0, 0.3f, b.out);
    CHECK(s.code() == StatusCode::kInvalidArgument);
  }
  f.require_unchanged(0, 4);
}

TEST_CASE("bad pool and cache and geometry options are INVALID_ARGUMENT", "[kv]") {
  CpuBackend backend({1});
  PagePoolOptions o;
  o.geometry = {2, kKv, kHd, DType::kF32};
  o.num_pages = 0;
  CHECK(PagePool::create(backend, o).status().code() == StatusCode::kInvalidArgument);
  o.num_pages = 4;
  o.page_size = 0;
  CHECK(PagePool::create(backend, o).status().code() == StatusCode::kInvalidArgument);
  o.page_size = 16;
  o.geometry.head_dim = 0;
  CHECK(PagePool::create(backend, o).status().code() == StatusCode::kInvalidArgument);
  o.geometry.head_dim = kHd;
  auto pool = std::move(PagePool::create(backend, o)).value();
  CHECK(PagedKVCache::create(*pool, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(ContiguousKVCache::create(backend, {0, kKv, kHd, DType::kF32}, 8).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(ContiguousKVCache::create(backend, o.geometry, -1).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("a cache twice in one batch or caches of another geometry are INVALID_ARGUMENT", "[kv]") {
  Fixture f;
  INFO("seed " << f.rng.seed());
  Inputs in(f.rng, 2);
  std::vector<float> out(in.out.size());
  const Tensor out_t = view(out, {2, kQ, kHd});
  const SeqAttention twice[] = {{f.cache.get(), 0, 1}, {f.cache.get(), 0, 1}};
  CHECK(attention_batch(twice, 0, view(in.q, {2, kQ, kHd}), view(in.k, {2, kKv, kHd}),
                        view(in.v, {2, kKv, kHd}), 0.3f, &out_t)
            .code() == StatusCode::kInvalidArgument);
  auto other = std::move(ContiguousKVCache::create(f.backend, {2, kKv, kHd, DType::kBF16}, 8)).value();
  const SeqAttention mixed[] = {{f.cache.get(), 0, 1}, {other.get(), 0, 1}};
  CHECK(attention_batch(mixed, 0, view(in.q, {2, kQ, kHd}), view(in.k, {2, kKv, kHd}),
                        view(in.v, {2, kKv, kHd}), 0.3f, &out_t)
            .code() == StatusCode::kInvalidArgument);
  f.require_unchanged(0, 4);
  CHECK(other->seq_len() == 0);
}

TEST_CASE("a forward that fails half-way is undone by popn", "[kv]") {
  Fixture f;
  INFO("seed " << f.rng.seed());
  Inputs in(f.rng, 3);
  REQUIRE(in.run(*f.cache, 0, 0).ok());  // layer 0 done, layer 1 never runs
  CHECK(f.cache->seq_len() == 3);
  CHECK(f.cache->layer_len(1) == 0);
  CHECK(f.cache->fork().status().code() == StatusCode::kFailedPrecondition);
  CHECK(f.cache->popn(3) == 3);
  CHECK(f.cache->layer_len(0) == 0);
  REQUIRE(in.run(*f.cache, 0, 0).ok());
  REQUIRE(in.run(*f.cache, 1, 0).ok());
  CHECK(f.cache->seq_len() == 3);
}
