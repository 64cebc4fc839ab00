// The host tier on the GPU: pages copied to pinned host memory and back by one kernel hold the
// same bytes; an engine on the GPU whose sessions go to the host and come back by copy (evicted
// and preempted) gives the tokens of one that never runs short of pages; the start-up measurement.
// Sessions of an all-windowed model that give back the pages behind their windows give the
// tokens of an engine that keeps them.
// [cuda]: skipped (and saying so) without a GPU.
#include <catch2/catch.hpp>

#include "combs/engine/engine.h"
#include "combs/kv/host_page_pool.h"
#include "combs/model/cuda_runner.h"
#include "support/cuda_helpers.h"
#include "support/engine_helpers.h"
#include "support/host_tier_check.h"
#include "support/model_helpers.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

TEST_CASE("pages copied to pinned host memory and back on the gpu hold the same bytes", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const DType dtype = GENERATE(DType::kF16, DType::kBF16, DType::kF32);
  const int head_dim = GENERATE(64, 128, 9);  // 9: chunks of 36 or 72 bytes (the byte loop)
  PagePoolOptions o;
  o.geometry = {4, 2, head_dim, dtype};
  o.page_size = head_dim == 9 ? 1 : 16;
  o.num_pages = 24;
  auto pool = std::move(PagePool::create(*gpu, o)).value();
  auto host = std::move(HostPagePool::create(*pool, 24)).value();
  check_round_trip(*pool, *host, {0, 23, 7, 8, 9}, {3, 2, 1, 0, 22}, rng);
  std::vector<int32_t> all(24), reversed(24);
  for (int i = 0; i < 24; ++i) all[i] = i, reversed[i] = 23 - i;
  check_round_trip(*pool, *host, all, reversed, rng);
}

TEST_CASE("an engine on the gpu whose sessions move to the host tier gives the tokens of a roomy one", "[cuda]") {
  if (!have_gpu()) return;
  register_cuda_attention();
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  testing::TinyModel m("tiny", DType::kBF16);
  const int64_t page = page_bytes(m.model->config().kv_geometry(DType::kF16), 16);
  auto engine = [&](int64_t pages, int64_t host_pages) {
    EngineOptions eo;
    eo.kv_memory_bytes = pages * page;
    eo.host_kv_memory_bytes = host_pages * page;
    eo.host_kv_restore = EngineOptions::HostRestore::kCopy;
    eo.make_runner = make_cuda_runner(0);
    return std::move(Engine::create(std::move(Model::load(m.path)).value(), eo)).value();
  };
  // One session runs at a time, so every step is the same in both engines: on the GPU a step's
  // rounding depends on what shares it (more than 8 rows take cuBLAS, fewer the GEMV kernels), and
  // a page rebuilt by prefill is not bitwise the one decode wrote. Pages copied back are bitwise
  // what was computed, so the tight engine's tokens are the roomy one's.
  auto tight = engine(12, 160), roomy = engine(1024, 0);
  std::vector<SessionId> ids, roomy_ids;
  for (int i = 0; i < 8; ++i) {  // 100 positions each: 7 of the 12 pages; each pushes the last out
    INFO("session " << i);
    std::vector<int32_t> p(40);
    for (auto& t : p) t = static_cast<int32_t>(rng.integer(3, m.n_vocab() - 1));
    ids.push_back(tight->create_session().value());
    roomy_ids.push_back(roomy->create_session().value());
    CHECK(run(*tight, ids[i], request(p, 60)) == run(*roomy, roomy_ids[i], request(p, 60)));
  }
  for (int i = 0; i < 8; ++i) {  // each comes back by copy, pushing the one before out
    INFO("session " << i);
    const Generated t = generate(*tight, ids[i], request({5}, 16));
    CHECK(t.usage.cached_tokens == 99);
    CHECK(t.tokens == run(*roomy, roomy_ids[i], request({5}, 16)));
  }
  const EngineStats st = tight->stats();
  CHECK(st.host_offloads >= 14);
  CHECK(st.host_restores == 8);
  CHECK(st.host_copies_dropped == 0);
  CHECK(tight->check_invariants().ok());
  // Preempted requests (eight at once that cannot all hold their pages) go to the host and come
  // back; all finish (their tokens are the CPU engine tests' to compare: they share steps here).
  std::vector<std::unique_ptr<Collector>> runs;
  for (int i = 0; i < 8; ++i) {
    runs.push_back(std::make_unique<Collector>());
    REQUIRE(tight->generate(ids[i], request({7}, 60), runs.back()->sink()).ok());
  }
  for (auto& r : runs) {
    r->wait();
    CHECK(r->finish == FinishKind::kLength);
  }
  CHECK(tight->stats().preemptions > 0);
  CHECK(tight->check_invariants().ok());
  // The measurement on this device (the figures go to RESULTS.md through combs-bench).
  EngineOptions eo;
  eo.host_kv_memory_bytes = 64 * page;
  eo.make_runner = make_cuda_runner(0);
  auto measured = std::move(Engine::create(std::move(Model::load(m.path)).value(), eo)).value();
  const EngineStats ms = measured->stats();
  WARN("tiny on the gpu: prefill " << ms.host_prefill_us_per_token << " us/token, copy " << ms.host_copy_us_per_token
                                   << " us/token, tier " << (ms.host_tier_active ? "on" : "off"));
  CHECK(ms.host_prefill_us_per_token > 0.0);
  CHECK(ms.host_copy_us_per_token > 0.0);
}

TEST_CASE("an engine on the gpu whose sessions release the pages behind their windows gives the tokens of one that keeps them", "[cuda]") {
  if (!have_gpu()) return;
  register_cuda_attention();
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  testing::TinyModel m("gemma3-swa-tiny", DType::kBF16);  // every layer windowed, 8 keys
  auto engine = [&](bool release) {
    EngineOptions eo;
    eo.release_behind_window = release;
    eo.window_rollback = 4;
    eo.make_runner = make_cuda_runner(0);
    return std::move(Engine::create(std::move(Model::load(m.path)).value(), eo)).value();
  };
  // One session runs at a time, so both engines' steps are the same (on the GPU a step's rounding
  // depends on what shares it); the released engine reads the same keys through other page tables.
  auto kept = engine(false), released = engine(true);
  std::vector<int32_t> prompt(70);
  for (auto& t : prompt) t = static_cast<int32_t>(rng.integer(3, m.n_vocab() - 1));
  const SessionId a = kept->create_session().value(), b = released->create_session().value();
  CHECK(run(*kept, a, request(prompt, 30)) == run(*released, b, request(prompt, 30)));
  CHECK(released->info(b)->pages_held <= 3);  // the window and the margin
  CHECK(kept->info(a)->pages_held == 7);
  REQUIRE(kept->rollback(a, 3).ok());  // within the margin
  REQUIRE(released->rollback(b, 3).ok());
  CHECK(run(*kept, a, request({}, 10)) == run(*released, b, request({}, 10)));
  const SessionId fa = kept->fork(a).value(), fb = released->fork(b).value();
  CHECK(run(*kept, fa, request({9}, 12)) == run(*released, fb, request({9}, 12)));
  CHECK(released->stats().window_pages_released > 0);
  CHECK(released->check_invariants().ok());
  CHECK(kept->check_invariants().ok());
}
