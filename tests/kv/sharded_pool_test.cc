// A page pool split by KV heads over several backends (tensor parallelism's KV cache): each
// shard's view of a cache attends over its heads exactly as the whole pool does over the same
// heads — prefill, decode and a chunk, then a fork (whose partly filled page is copied on every
// shard); the bookkeeping is one; the host tier copies every shard's heads; bad splits and binds
// are refused.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/host_page_pool.h"
#include "combs/kv/paged_kv_cache.h"
#include "support/host_tier_check.h"
#include "support/kv_helpers.h"
#include "support/random.h"

using namespace combs;
using combs::testing::view;

namespace {

constexpr int kShards = 2, kQHeads = 8, kHeadDim = 8;
const KVGeometry kGeometry{2, 4, kHeadDim, DType::kF32};

// Heads [from, to) of each token of a [n, heads, head_dim] tensor.
std::vector<float> heads(const std::vector<float>& x, int64_t n, int heads, int from, int to) {
  std::vector<float> out;
  for (int64_t t = 0; t < n; ++t) {
    const float* row = x.data() + (t * heads + from) * kHeadDim;
    out.insert(out.end(), row, row + (to - from) * kHeadDim);
  }
  return out;
}

// One step of n tokens at the caches' length: the whole pool's attention and each shard's, per
// layer; every shard's output equals the whole's on its heads.
void step_and_compare(PagedKVCache& whole, PagedKVCache& split, std::vector<std::unique_ptr<PagedKVShard>>& views,
                      int64_t n, testing::Rng& rng) {
  const int64_t pos = whole.seq_len();
  REQUIRE(split.seq_len() == pos);
  const SeqAttention w[] = {{&whole, pos, n}};
  const SeqAttention s[] = {{&split, pos, n}};
  AttentionStep whole_step;
  REQUIRE(whole_step.begin(w, kQHeads).ok());
  REQUIRE(reserve_batch_pages(s).ok());  // once, on the whole cache, before the shards read it
  std::vector<AttentionStep> shard_steps(kShards);
  for (int r = 0; r < kShards; ++r) {
    REQUIRE(views[r]->bind(split).ok());
    const SeqAttention v[] = {{views[r].get(), pos, n}};
    const Status begun = shard_steps[r].begin(v, kQHeads / kShards);
    INFO(begun.to_string());
    REQUIRE(begun.ok());
  }
  const int nkv = kGeometry.n_kv_heads, q_each = kQHeads / kShards, kv_each = nkv / kShards;
  for (int layer = 0; layer < kGeometry.num_layers; ++layer) {
    std::vector<float> q = rng.floats(n * kQHeads * kHeadDim), k = rng.floats(n * nkv * kHeadDim),
                       v = rng.floats(n * nkv * kHeadDim), out(n * kQHeads * kHeadDim);
    REQUIRE(whole_step
                .run(layer, view(q, {n, kQHeads, kHeadDim}), view(k, {n, nkv, kHeadDim}),
                     view(v, {n, nkv, kHeadDim}), 0.35f, view(out, {n, kQHeads, kHeadDim}))
                .ok());
    for (int r = 0; r < kShards; ++r) {
      std::vector<float> qr = heads(q, n, kQHeads, r * q_each, (r + 1) * q_each),
                         kr = heads(k, n, nkv, r * kv_each, (r + 1) * kv_each),
                         vr = heads(v, n, nkv, r * kv_each, (r + 1) * kv_each), outr(n * q_each * kHeadDim);
      REQUIRE(shard_steps[r]
                  .run(layer, view(qr, {n, q_each, kHeadDim}), view(kr, {n, kv_each, kHeadDim}),
                       view(vr, {n, kv_each, kHeadDim}), 0.35f, view(outr, {n, q_each, kHeadDim}))
                  .ok());
      INFO("layer " << layer << ", shard " << r << ", " << n << " tokens at " << pos);
      CHECK(outr == heads(out, n, kQHeads, r * q_each, (r + 1) * q_each));
    }
  }
  whole_step.commit();
  for (AttentionStep& st : shard_steps) st.commit();  // (the views' lengths; the cache's below)
  CHECK(split.seq_len() == pos);
  commit_batch(s);
  CHECK(split.seq_len() == pos + n);
}

}  // namespace

TEST_CASE("a page pool split by kv heads attends on each shard as the whole pool does", "[kv]") {
  CpuBackend b0({1}), b1({1}), one({1});
  Backend* backends[] = {&b0, &b1};
  const PagePoolOptions o{kGeometry, 4, 32};
  auto whole_pool = PagePool::create(one, o).value();
  auto pool = PagePool::create_sharded(backends, o).value();
  CHECK(pool->num_shards() == 2);
  CHECK(pool->shard_geometry().n_kv_heads == 2);
  CHECK(pool->geometry() == kGeometry);
  CHECK(&pool->shard_backend(1) == &b1);
  CHECK(&pool->backend() == &b0);
  CHECK(pool->k_arena(0, 1).dim(1) == 2);
  std::vector<std::unique_ptr<PagedKVShard>> views;
  for (int r = 0; r < kShards; ++r) views.push_back(std::make_unique<PagedKVShard>(*pool, r));
  CHECK(views[1]->geometry().n_kv_heads == 2);
  CHECK(&views[1]->backend() == &b1);

  testing::Rng rng(11);
  auto whole = PagedKVCache::create(*whole_pool, 256).value();
  auto split = PagedKVCache::create(*pool, 256).value();
  for (int64_t n : {7, 1, 1, 1, 5}) step_and_compare(*whole, *split, views, n, rng);
  CHECK(pool->num_used() == whole_pool->num_used());  // one bookkeeping: 15 positions, 4 pages
  CHECK(views[0]->pages_used() == split->pages_used());

  // A fork copies its partly filled last page on every shard; both go on as the whole's do.
  auto whole_child = whole->fork().value();
  auto split_child = split->fork().value();
  for (int64_t n : {1, 3}) step_and_compare(*whole_child, *split_child, views, n, rng);
  for (int64_t n : {2}) step_and_compare(*whole, *split, views, n, rng);
  // Rollback is the whole cache's: the views follow at their next bind.
  CHECK(split->popn(6) == 6);
  CHECK(whole->popn(6) == 6);
  step_and_compare(*whole, *split, views, 4, rng);
}

TEST_CASE("a split page pool refuses uneven shards and foreign caches", "[kv]") {
  CpuBackend b0({1}), b1({1}), b2({1});
  Backend* three[] = {&b0, &b1, &b2};
  const auto uneven = PagePool::create_sharded(three, {kGeometry, 4, 8});
  CHECK(uneven.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(uneven.status().message(), Catch::Contains("4 KV heads do not split evenly over 3 shards"));
  Backend* two[] = {&b0, &b1};
  auto pool = PagePool::create_sharded(two, {kGeometry, 4, 8}).value();
  auto other = PagePool::create(b0, {kGeometry, 4, 8}).value();
  auto foreign = PagedKVCache::create(*other, 64).value();
  PagedKVShard shard(*pool, 0);
  CHECK(shard.bind(*foreign).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("the host tier stores and loads the pages of a split pool on every shard", "[kv]") {
  testing::Rng rng(testing::test_seed());
  INFO("seed " << rng.seed());
  CpuBackend b0({1}), b1({1});
  Backend* two[] = {&b0, &b1};
  auto pool = PagePool::create_sharded(two, {kGeometry, 4, 8}).value();
  auto host = std::move(HostPagePool::create(*pool, 8)).value();
  CHECK(host->page_bytes() == page_bytes(kGeometry, 4));  // every shard's heads: a whole page
  testing::check_round_trip(*pool, *host, {0, 5, 3}, {7, 1, 2}, rng);
  testing::check_round_trip(*pool, *host, {0, 1, 2, 3, 4, 5, 6, 7}, {7, 6, 5, 4, 3, 2, 1, 0}, rng);
}
