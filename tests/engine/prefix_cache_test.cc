// The engine's prefix cache: sessions that begin alike map each other's pages instead of
// prefilling them, within a namespace only; the tokens are bitwise those of a prefill; cached
// pages outlive their sessions and give way when the pool needs them.
#include <catch2/catch.hpp>

#include "combs/engine/engine.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

SessionId session(Engine& e, const std::string& ns = "") {
  SessionOptions o;
  o.cache_namespace = ns;
  auto id = e.create_session(o);
  REQUIRE(id.ok());
  return *id;
}

}  // namespace

TEST_CASE("a session sharing a 1000-token prefix maps the cached pages and prefills only the rest", "[engine]") {
  Rng rng(test_seed());
  const std::string weights = GENERATE(as<std::string>{}, "bf16", "q4_k_m");
  INFO("weights " << weights);
  ModelFile mf(weights);
  auto e = mf.engine();
  const std::vector<int32_t> shared = random_tokens(rng, 1000, 3, 258);
  const std::vector<int32_t> mine = random_tokens(rng, 24, 3, 258), yours = random_tokens(rng, 24, 3, 258);

  const Generated first = generate(*e, session(*e, "k"), request(concat(shared, mine), 8));
  CHECK(first.usage.cached_tokens == 0);
  CHECK(first.usage.prefilled_tokens == 1024);
  const EngineStats before = e->stats();
  CHECK(before.pages_cached == 1031 / 16);  // every full page of the 1,031 computed positions

  // Greedy and sampled, the second session's tokens are those of an engine without the cache.
  const float temperature = GENERATE(0.0f, 0.8f);
  INFO("temperature " << temperature);
  const Generated second = generate(*e, session(*e, "k"), request(concat(shared, yours), 16, temperature, 7));
  CHECK(second.usage.cached_tokens == 992);  // 62 whole pages; the 63rd holds its own tokens
  CHECK(second.usage.prefilled_tokens == 1024 - 992);
  const EngineStats after = e->stats();
  CHECK(after.prefix_hits == before.prefix_hits + 1);
  CHECK(after.prefix_hit_tokens == before.prefix_hit_tokens + 992);
  CHECK(after.prefix_lookups == before.prefix_lookups + 1);
  REQUIRE(e->check_invariants().ok());

  EngineOptions off;
  off.prefix_cache = false;
  auto plain = mf.engine(off);
  const Generated alone = generate(*plain, session(*plain, "k"), request(concat(shared, yours), 16, temperature, 7));
  CHECK(alone.usage.cached_tokens == 0);
  CHECK(second.tokens == alone.tokens);
  CHECK(plain->stats().pages_cached == 0);

  // Another namespace sees none of it.
  const Generated other = generate(*e, session(*e, "other key"), request(concat(shared, yours), 4));
  CHECK(other.usage.cached_tokens == 0);
  CHECK(other.usage.prefilled_tokens == 1024);
}

TEST_CASE("cached pages outlive closed and reset and rolled-back and evicted sessions", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  EngineOptions o;
  o.kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 24;  // 24 pages of 16 positions
  auto e = mf.engine(o);
  const std::vector<int32_t> prompt = random_tokens(rng, 160, 3, 258);  // 10 pages

  SECTION("closed") {
    const SessionId a = session(*e);
    const Generated ra = generate(*e, a, request(prompt, 4));
    REQUIRE(e->close(a).ok());
    CHECK(e->stats().pages_reclaimable == 10);  // the pages of positions 0..159; 160..163 are partial
    const Generated rb = generate(*e, session(*e), request(prompt, 4));
    CHECK(rb.usage.cached_tokens == 144);  // the last page holds the last position, computed again
    CHECK(rb.tokens == ra.tokens);
  }
  SECTION("reset") {
    const SessionId a = session(*e);
    const Generated ra = generate(*e, a, request(prompt, 4));
    REQUIRE(e->reset(a).ok());
    const Generated again = generate(*e, a, request(prompt, 4));
    CHECK(again.usage.cached_tokens == 144);
    CHECK(again.tokens == ra.tokens);
  }
  SECTION("rolled back, then the same tokens again") {
    const SessionId a = session(*e);
    const Generated ra = generate(*e, a, request(prompt, 4));
    REQUIRE(e->rollback(a, 164 - 40).ok());  // into page 2
    const std::vector<int32_t> rest(prompt.begin() + 40, prompt.end());
    const Generated again = generate(*e, a, request(rest, 4));
    // Its own 40 positions, then (once page 2 is completed) pages 3..8 from the cache.
    CHECK(again.usage.cached_tokens == 40 + 96);
    CHECK(again.usage.prefilled_tokens == 8 + 16);
    CHECK(again.tokens == ra.tokens);
    REQUIRE(e->rollback(a, 164 - 48).ok());  // at a page boundary: pages 3..8 map back
    const std::vector<int32_t> rest48(prompt.begin() + 48, prompt.end());
    const Generated mapped = generate(*e, a, request(rest48, 4));
    CHECK(mapped.usage.cached_tokens == 144);
    CHECK(mapped.tokens == ra.tokens);
  }
  SECTION("evicted") {
    const SessionId a = session(*e);
    const Generated ra = generate(*e, a, request(prompt, 4));
    // A second session's prompt needs the whole pool: a's pages go (evicted, then reclaimed).
    const SessionId b = session(*e);
    generate(*e, b, request(random_tokens(rng, 24 * 16 - 8, 3, 258), 4));
    CHECK(e->stats().evictions >= 1);
    CHECK(e->stats().cached_pages_reclaimed > 0);
    REQUIRE(e->close(b).ok());
    const Generated again = generate(*e, a, request({}, 4));  // rebuilt by prefill, partly from the cache
    CHECK(e->info(a)->length == 168);
    (void)again;
    REQUIRE(e->rollback(a, 8).ok());
    CHECK(generate(*e, a, request({}, 4)).tokens == ra.tokens);
  }
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("cached pages never make a request wait or fail", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  EngineOptions o;
  o.kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 12;  // 12 pages
  o.when_full = EngineOptions::WhenFull::kFail;      // no waiting: a page short is an error
  auto e = mf.engine(o);
  for (int i = 0; i < 6; ++i) {  // the pool fills with cached pages of closed sessions
    const SessionId s = session(*e);
    generate(*e, s, request(random_tokens(rng, 150, 3, 258), 2));
    REQUIRE(e->close(s).ok());
  }
  CHECK(e->stats().pages_cached > 0);
  CHECK(e->stats().pages_free < 12);
  // A prompt of the whole pool runs; the cached pages give way, least recently released first.
  const Generated r = generate(*e, session(*e), request(random_tokens(rng, 12 * 16 - 4, 3, 258), 2));
  CHECK(r.tokens.size() == 2);
  CHECK(e->stats().cached_pages_reclaimed > 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("forks of a prefilled session share its pages with the prefix cache", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  auto e = mf.engine();
  const SessionId parent = session(*e, "k");
  generate(*e, parent, request(random_tokens(rng, 200, 3, 258), 0));
  std::vector<SessionId> kids;
  for (int i = 0; i < 3; ++i) kids.push_back(e->fork(parent).value());
  for (size_t i = 0; i < kids.size(); ++i) {
    const Generated r = generate(*e, kids[i], request({}, 20, 0.9f, i));
    CHECK(r.usage.cached_tokens == 199);
    CHECK(r.usage.prefilled_tokens == 1);
  }
  REQUIRE(e->check_invariants().ok());
  const SessionInfo info = e->info(kids[0]).value();
  CHECK(info.pages_shared == 12);  // 200 positions: 12 whole pages held by all (and cached)
}

TEST_CASE("sessions arriving together with one prompt compute it once", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  auto e = mf.engine();
  const std::vector<int32_t> shared = random_tokens(rng, 512, 3, 258);
  std::vector<std::unique_ptr<Collector>> runs;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {  // submitted back to back: they meet in the scheduler's first steps
    prompts.push_back(concat(shared, random_tokens(rng, 20, 3, 258)));
    runs.push_back(std::make_unique<Collector>());
    REQUIRE(e->generate(session(*e), request(prompts.back(), 4), runs.back()->sink()).ok());
  }
  int64_t prefilled = 0;
  for (auto& c : runs) {
    c->wait();
    REQUIRE(c->finish == FinishKind::kLength);
    prefilled += c->usage.prefilled_tokens;
  }
  // One session computes the 512 shared positions; the others wait for its pages and map them.
  CHECK(prefilled == 512 + 8 * 20);
  // And each got the tokens it gets alone.
  EngineOptions off;
  off.prefix_cache = false;
  auto plain = mf.engine(off);
  for (int i = 0; i < 8; ++i) {
    Collector alone;
    REQUIRE(plain->generate(session(*plain), request(prompts[i], 4), alone.sink()).ok());
    alone.wait();
    CHECK(alone.tokens == runs[i]->tokens);
  }
  REQUIRE(e->check_invariants().ok());
}
