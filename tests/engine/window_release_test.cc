// Sessions of a model whose every layer is windowed keep only the pages their window reads
// (EngineOptions::release_behind_window): the same tokens as an engine that keeps every page,
// through rollbacks within and beyond the kept margin, forks and speculation; fewer pages held.
#include <catch2/catch.hpp>

#include "combs/engine/engine.h"
#include "combs/kv/page_pool.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

constexpr int kWindow = 8;    // gemma3-swa-tiny's
constexpr int kRollback = 4;  // the margin the releasing engine keeps behind the window

EngineOptions keeping() {
  EngineOptions o;
  o.release_behind_window = false;
  return o;
}

EngineOptions releasing() {
  EngineOptions o;
  o.window_rollback = kRollback;
  return o;
}

}  // namespace

TEST_CASE("an all-windowed model's sessions hold only their window's pages and produce the same tokens", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf("bf16", "gemma3-swa-tiny");
  const auto prompt = random_tokens(rng, 70, 3, 258);
  struct Outcome {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<int64_t> pages_held;
    std::vector<Usage> usage;
  };
  auto play = [&](Engine& e) {
    Outcome o;
    auto turn = [&](const SessionId& id, GenerateRequest r) {
      Generated g = generate(e, id, std::move(r));
      o.tokens.push_back(g.tokens);
      o.usage.push_back(g.usage);
      o.pages_held.push_back(e.info(id)->pages_held);
      REQUIRE(e.check_invariants().ok());
    };
    const SessionId a = e.create_session().value();
    turn(a, request(prompt, 30, 0.8f, 1));  // 100 positions
    REQUIRE(e.rollback(a, 3).ok());         // within the margin
    turn(a, request({}, 10, 0.8f, 2));
    REQUIRE(e.rollback(a, 30).ok());        // beyond it
    turn(a, request({7, 9}, 10, 0.8f, 3));
    const SessionId b = e.fork(a).value();
    turn(b, request({}, 12, 0.8f, 4));
    turn(a, request({11}, 12, 0.0f, 5));
    GenerateRequest spec = request({}, 24, 0.0f, 6);  // drafts rejected and accepted
    spec.speculation = speculation(SpeculationParams::Method::kNgram, 4);
    turn(b, spec);
    return o;
  };
  auto kept = mf.engine(keeping());
  auto released = mf.engine(releasing());
  const Outcome want = play(*kept), got = play(*released);
  CHECK(got.tokens == want.tokens);
  // The window (8 positions) and the margin (4) behind the next position lie in at most two pages
  // of 16, with the partly filled one: at most 3 held, where the keeping engine holds them all.
  for (size_t i = 0; i < got.pages_held.size(); ++i) {
    INFO("turn " << i);
    CHECK(got.pages_held[i] <= 3);
    CHECK(want.pages_held[i] >= 5);
  }
  const EngineStats st = released->stats();
  CHECK(st.window_pages_released > 0);
  CHECK(st.window_rebuilds == 1);  // the rollback of 30
  CHECK(kept->stats().window_pages_released == 0);
  // The rebuild mapped the released pages back from the prefix cache, which kept them.
  CHECK(got.usage[2].cached_tokens > 0);
}

TEST_CASE("an all-windowed model's idle sessions fit a pool that could not hold their whole histories", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf("bf16", "gemma3-swa-tiny");
  // 4 layers x 2 KV heads x 64 x 2 bytes x 2 (K, V) per position, pages of 16: 24 pages; six
  // sessions of 128 positions would hold 48.
  const int64_t per_page = 4 * 2 * 64 * 2 * 2 * 16;
  const int n = 6;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) prompts.push_back(random_tokens(rng, 120, 3, 258));
  auto play = [&](Engine& e, int64_t* prefilled) {
    std::vector<SessionId> ids;
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) {
      ids.push_back(e.create_session().value());
      out.push_back(run(e, ids[i], request(prompts[i], 8, 0.8f, i)));
    }
    *prefilled = 0;
    for (int i = 0; i < n; ++i) {  // a second turn on each
      Generated g = generate(e, ids[i], request({5}, 8, 0.8f, 10 + i));
      out.push_back(g.tokens);
      *prefilled += g.usage.prefilled_tokens;
    }
    REQUIRE(e.check_invariants().ok());
    return out;
  };
  EngineOptions k = keeping(), r = releasing();
  k.kv_memory_bytes = r.kv_memory_bytes = per_page * 24;
  k.prefix_cache = r.prefix_cache = false;  // pages the sessions dropped are gone
  auto kept = mf.engine(k);
  auto released = mf.engine(r);
  int64_t kept_prefilled = 0, released_prefilled = 0;
  CHECK(play(*released, &released_prefilled) == play(*kept, &kept_prefilled));
  CHECK(kept->stats().evictions > 0);
  CHECK(released->stats().evictions == 0);
  // The second turns: the keeping engine rebuilt evicted sessions' histories; the releasing one
  // computed each turn's new positions only (its last token and the input).
  CHECK(released_prefilled == 2 * n);
  CHECK(kept_prefilled > 100);
}

TEST_CASE("an all-windowed model's sessions longer than the pool wait for pages rather than fail", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf("bf16", "gemma3-swa-tiny");
  // 12 pages; three sessions of 400-token prompts (25 pages of history each) at once: each holds
  // at most a prefill chunk's pages (8) and its window's before the step releases them, so they
  // take turns for pages, and each gives the tokens it gives alone in a roomy pool.
  const int64_t per_page = 4 * 2 * 64 * 2 * 2 * 16;
  EngineOptions tight = releasing();
  tight.kv_memory_bytes = per_page * 12;
  const int n = 3;
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < n; ++i) reqs.push_back(request(random_tokens(rng, 400, 3, 258), 8, 0.8f, i));
  std::vector<std::vector<int32_t>> alone(n);
  {
    auto e = mf.engine(keeping());
    for (int i = 0; i < n; ++i) alone[i] = run(*e, e->create_session().value(), reqs[i]);
  }
  auto e = mf.engine(tight);
  std::vector<Collector> cs(n);
  std::vector<SessionId> ids;
  for (int i = 0; i < n; ++i) ids.push_back(e->create_session().value());
  for (int i = 0; i < n; ++i) REQUIRE(e->generate(ids[i], reqs[i], cs[i].sink()).ok());
  for (int i = 0; i < n; ++i) {
    INFO("session " << i);
    cs[i].wait();
    INFO(cs[i].status.to_string());
    REQUIRE(cs[i].finish == FinishKind::kLength);
    CHECK(cs[i].tokens == alone[i]);
  }
  CHECK(e->releases_behind_window());
  CHECK(e->kv_capacity_tokens() < 400);
  REQUIRE(e->check_invariants().ok());
}
