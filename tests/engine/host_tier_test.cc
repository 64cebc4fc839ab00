// The host tier: idle sessions' pages move to host memory under pressure and come back by copy
// with the tokens unchanged (preempted requests': engine_test.cc); copies are dropped least recently stored first
// when the tier is full, trimmed with the history, shared by forks; the start-up measurement
// decides whether the tier pays; a request that waits past the queue timeout ends undone.
#include <catch2/catch.hpp>

#include <thread>

#include "combs/engine/engine.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

constexpr int64_t kPage = 2 * 2 * 64 * 2 * 2 * 16;  // the tiny model's page: 16 positions, f16

EngineOptions tight(int64_t device_pages, int64_t host_pages) {
  EngineOptions o;
  o.kv_memory_bytes = device_pages * kPage;
  o.host_kv_memory_bytes = host_pages * kPage;
  o.host_kv_restore = EngineOptions::HostRestore::kCopy;
  o.prefix_cache = false;  // positions come back from the host, not from cached pages
  return o;
}

// The tokens a session with this history continues with (greedy), on a roomy engine.
std::vector<int32_t> continuation(const ModelFile& mf, const std::vector<int32_t>& history, int n) {
  auto e = mf.engine();
  return run(*e, e->create_session().value(), request(history, n));
}

}  // namespace

TEST_CASE("an idle session's pages move to the host tier and come back by copy with the same tokens", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  auto e = mf.engine(tight(12, 64));  // 12 pages: 192 positions
  REQUIRE(e->stats().host_tier_active);
  REQUIRE(e->stats().host_pages_total == 64);
  const std::vector<int32_t> pa = random_tokens(rng, 70, 3, 258);
  const SessionId a = e->create_session().value();
  const std::vector<int32_t> ta = run(*e, a, request(pa, 20));  // 90 positions: 6 pages
  // b needs 9 pages: a's go to the host.
  const SessionId b = e->create_session().value();
  run(*e, b, request(random_tokens(rng, 130, 3, 258), 10));
  CHECK(e->info(a)->cached == 0);
  CHECK(e->stats().host_offloads == 1);
  CHECK(e->stats().host_pages_used == 6);
  REQUIRE(e->check_invariants().ok());
  // a continues: its 89 positions come back by copy (the 90th is computed for its logits).
  const std::vector<int32_t> more = random_tokens(rng, 5, 3, 258);
  const Generated g = generate(*e, a, request(more, 15));
  CHECK(g.tokens == continuation(mf, concat(concat(pa, ta), more), 15));
  CHECK(g.usage.cached_tokens == 89);
  CHECK(g.usage.prefilled_tokens == 6);
  CHECK(e->stats().host_restored_tokens == 89);
  CHECK(e->stats().host_restores == 1);
  CHECK(e->stats().host_pages_used == 9);  // b's 140 positions went to the host in turn
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("a full host tier drops the least recently stored copies first", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  auto e = mf.engine(tight(8, 8));  // 8 device pages, 8 host pages
  std::vector<SessionId> ids;
  std::vector<std::vector<int32_t>> histories;
  for (int i = 0; i < 3; ++i) {  // each 60 positions: 4 pages; the third pushes the first out
    ids.push_back(e->create_session().value());
    const std::vector<int32_t> p = random_tokens(rng, 50, 3, 258);
    histories.push_back(concat(p, run(*e, ids.back(), request(p, 10))));
  }
  // The device holds the last two, the host the first. A fourth and a fifth push the second
  // and the third to the host: the first's copy (stored longest ago) is dropped for the third.
  for (int i = 0; i < 2; ++i) run(*e, e->create_session().value(), request(random_tokens(rng, 100, 3, 258), 10));
  CHECK(e->stats().host_copies_dropped >= 1);
  CHECK(e->stats().host_pages_used <= 8);
  REQUIRE(e->check_invariants().ok());
  // Dropped or copied, every session continues as it would have.
  for (int i = 0; i < 3; ++i) {
    INFO("session " << i);
    const Generated g = generate(*e, ids[i], request({7}, 8));
    CHECK(g.tokens == continuation(mf, concat(histories[i], {7}), 8));
  }
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("rollback trims a host copy, a fork shares it, reset and close free it", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  auto e = mf.engine(tight(10, 32));
  const std::vector<int32_t> p = random_tokens(rng, 90, 3, 258);
  const SessionId a = e->create_session().value();
  const std::vector<int32_t> history = concat(p, run(*e, a, request(p, 10)));  // 100 positions: 7 pages
  run(*e, e->create_session().value(), request(random_tokens(rng, 120, 3, 258), 5));       // a goes to the host
  REQUIRE(e->stats().host_pages_used == 7);
  const SessionId f = e->fork(a).value();
  CHECK(e->stats().host_pages_used == 7);  // shared
  REQUIRE(e->check_invariants().ok());
  CHECK(e->rollback(a, 40).value() == 60);  // a keeps 4 pages of the copy; the fork all 7
  CHECK(e->stats().host_pages_used == 7);
  REQUIRE(e->check_invariants().ok());
  const std::vector<int32_t> head(history.begin(), history.begin() + 60);
  const Generated ga = generate(*e, a, request({5}, 6));
  CHECK(ga.tokens == continuation(mf, concat(head, {5}), 6));
  CHECK(ga.usage.cached_tokens == 60);
  const Generated gf = generate(*e, f, request({9}, 6));
  CHECK(gf.tokens == continuation(mf, concat(history, {9}), 6));
  CHECK(gf.usage.cached_tokens == 99);  // all a's cache held: the last generated token was never fed
  REQUIRE(e->check_invariants().ok());
  // Both on the device again or pushed out: close and reset leave no host page behind.
  run(*e, e->create_session().value(), request(random_tokens(rng, 140, 3, 258), 5));
  CHECK(e->reset(a).ok());
  CHECK(e->close(f).ok());
  REQUIRE(e->check_invariants().ok());
  for (const SessionInfo& s : e->list()) CHECK(e->close(s.id).ok());
  CHECK(e->stats().host_pages_used == 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("the host tier's start-up measurement decides whether it is used", "[engine]") {
  ModelFile mf;
  EngineOptions o = tight(64, 64);
  o.host_kv_restore = EngineOptions::HostRestore::kAuto;
  auto e = mf.engine(o);
  const EngineStats st = e->stats();
  CHECK(st.host_prefill_us_per_token > 0.0);
  CHECK(st.host_copy_us_per_token > 0.0);
  CHECK(st.host_tier_active == (st.host_copy_us_per_token < st.host_prefill_us_per_token));
  CHECK(st.host_pages_total == (st.host_tier_active ? 64 : 0));
  CHECK(st.pages_used == 0);  // the measurement's pages went back
  // Without a tier nothing is measured.
  const EngineStats none = mf.engine(tight(64, 0)).get()->stats();
  CHECK_FALSE(none.host_tier_active);
  CHECK(none.host_copy_us_per_token == 0.0);
}

TEST_CASE("a request that waits past the queue timeout ends RESOURCE_EXHAUSTED and is undone", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const bool timeout = GENERATE(true, false);
  EngineOptions o;
  o.kv_memory_bytes = 4 * kPage;  // 64 positions
  o.queue_timeout = std::chrono::milliseconds(timeout ? 100 : 0);
  auto e = mf.engine(o);
  // a holds every page for 10 slow steps (its sink takes 50 ms a token); b needs two pages.
  const SessionId a = e->create_session().value(), b = e->create_session().value();
  Collector ca, cb;
  EventSink slow = [inner = ca.sink()](const GenerateEvent& ev) {
    if (ev.type == GenerateEvent::Type::kToken) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    inner(ev);
  };
  REQUIRE(e->generate(a, request(random_tokens(rng, 50, 3, 258), 10), slow).ok());
  while (e->info(a)->cached < 50) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(e->generate(b, request(random_tokens(rng, 20, 3, 258), 4), cb.sink()).ok());
  ca.wait();
  cb.wait();
  CHECK(ca.finish == FinishKind::kLength);
  if (timeout) {
    CHECK(cb.finish == FinishKind::kError);
    CHECK(cb.status.code() == StatusCode::kResourceExhausted);
    CHECK(e->info(b)->length == 0);
    CHECK(e->stats().queue_timeouts == 1);
  } else {
    CHECK(cb.finish == FinishKind::kLength);
    CHECK(e->stats().queue_timeouts == 0);
  }
  REQUIRE(e->check_invariants().ok());
}
