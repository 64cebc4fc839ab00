// The host tier's page pool: allocation and reference counts, copies to the host and back that
// move exactly the pages asked for, and bad copies refused.
#include <catch2/catch.hpp>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/host_page_pool.h"
#include "support/host_tier_check.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

std::unique_ptr<PagePool> make_pool(Backend& backend, int64_t num_pages, DType dtype) {
  PagePoolOptions o;
  o.geometry = {3, 2, 8, dtype};
  o.page_size = 4;
  o.num_pages = num_pages;
  auto pool = PagePool::create(backend, o);
  REQUIRE(pool.ok());
  return std::move(pool).value();
}

}  // namespace

TEST_CASE("host page pool allocates low ids first and counts references", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 4, DType::kF16);
  auto host = HostPagePool::create(*pool, 3);
  REQUIRE(host.ok());
  HostPagePool& h = **host;
  CHECK(h.page_bytes() == page_bytes(pool->geometry(), pool->page_size()));
  CHECK(h.alloc() == 0);
  CHECK(h.alloc() == 1);
  CHECK(h.alloc() == 2);
  CHECK(h.alloc() == std::nullopt);
  h.retain(1);
  CHECK(h.refcount(1) == 2);
  h.release(1);
  CHECK(h.num_free() == 0);
  h.release(1);
  CHECK(h.num_free() == 1);
  CHECK(h.alloc() == 1);
  CHECK(h.num_used() == 3);
}

TEST_CASE("pages stored to the host and loaded back hold the same bytes", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  CpuBackend backend({1});
  const DType dtype = GENERATE(DType::kF32, DType::kF16, DType::kBF16);
  auto pool = make_pool(backend, 8, dtype);
  auto host = std::move(HostPagePool::create(*pool, 8)).value();
  check_round_trip(*pool, *host, {0, 5, 3}, {7, 1, 2}, rng);
  check_round_trip(*pool, *host, {6}, {6}, rng);  // back into the page it left
  check_round_trip(*pool, *host, {0, 1, 2, 3, 4, 5, 6, 7}, {7, 6, 5, 4, 3, 2, 1, 0}, rng);
}

TEST_CASE("host page pool refuses bad sizes and copies", "[kv]") {
  CpuBackend backend({1});
  auto pool = make_pool(backend, 2, DType::kF16);
  CHECK(HostPagePool::create(*pool, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(HostPagePool::create(*pool, int64_t{1} << 40).status().code() == StatusCode::kInvalidArgument);
  auto host = std::move(HostPagePool::create(*pool, 2)).value();
  const std::vector<int32_t> one{0}, two{0, 1}, bad_device{2}, bad_host{-1};
  CHECK(host->store(two, one).code() == StatusCode::kInvalidArgument);
  CHECK(host->store(bad_device, one).code() == StatusCode::kInvalidArgument);
  CHECK(host->load(bad_host, one).code() == StatusCode::kInvalidArgument);
  CHECK(host->store(one, std::vector<int32_t>{2}).code() == StatusCode::kInvalidArgument);
}
