// The engine: batching is invisible to each session, fork/rollback/reset semantics, eviction under
// a tiny pool, cancellation, and a randomized many-thread run that checks the page invariants.
#include <catch2/catch.hpp>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "combs/engine/engine.h"
#include "combs/model/random_model.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"
#include "support/temp_dir.h"

using namespace combs;
using namespace combs::testing;

TEST_CASE("sessions decoded together produce exactly the tokens each produces alone", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  // The block-quantized runner keeps every property (batch invariance, rollback, fork).
  const std::string weights = GENERATE(as<std::string>{}, "bf16", "q4_k_m");
  INFO("weights " << weights);
  ModelFile mf(weights);
  const int n = 6;
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < n; ++i) {
    reqs.push_back(request(random_tokens(rng, 5 + 37 * i % 150, 3, 258), 24, i % 2 ? 0.0f : 0.8f, 100 + i));
  }
  std::vector<std::vector<int32_t>> alone(n), together(n);
  {
    auto e = mf.engine();
    for (int i = 0; i < n; ++i) alone[i] = run(*e, e->create_session().value(), reqs[i]);
  }
  auto e = mf.engine();
  std::vector<Collector> cs(n);
  std::vector<SessionId> ids;
  for (int i = 0; i < n; ++i) ids.push_back(e->create_session().value());
  for (int i = 0; i < n; ++i) REQUIRE(e->generate(ids[i], reqs[i], cs[i].sink()).ok());
  for (int i = 0; i < n; ++i) {
    cs[i].wait();
    REQUIRE(cs[i].finish == FinishKind::kLength);
    CHECK(cs[i].tokens == alone[i]);
  }
  CHECK(e->stats().steps < 6 * 24);  // they really shared steps
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("rollback then generate equals a fresh session fed the truncated history", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  // The block-quantized runner keeps every property (batch invariance, rollback, fork).
  const std::string weights = GENERATE(as<std::string>{}, "bf16", "q4_k_m");
  INFO("weights " << weights);
  ModelFile mf(weights);
  auto e = mf.engine();
  const auto prompt = random_tokens(rng, 40, 3, 258);
  const SessionId a = e->create_session().value();
  const auto first = run(*e, a, request(prompt, 20, 0.0f, 0));
  CHECK(e->info(a)->length == 60);
  CHECK(e->rollback(a, 61).status().code() == StatusCode::kOutOfRange);  // not a clamp
  CHECK(e->rollback(a, 25).value() == 35);
  const auto again = run(*e, a, request({}, 12, 0.0f, 0));
  const SessionId b = e->create_session().value();
  const auto fresh = run(*e, b, request(std::vector<int32_t>(prompt.begin(), prompt.begin() + 35), 12, 0.0f, 0));
  CHECK(again == fresh);
  // Rolling back only generated tokens regenerates them (greedy).
  CHECK(e->rollback(a, 12).value() == 35);
  CHECK(run(*e, a, request({}, 12, 0.0f, 0)) == fresh);
  CHECK(e->reset(a).ok());
  CHECK(e->info(a)->length == 0);
  CHECK(e->info(a)->pages_held == 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("forks continue independently and share pages counted once", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  // The block-quantized runner keeps every property (batch invariance, rollback, fork).
  const std::string weights = GENERATE(as<std::string>{}, "bf16", "q4_k_m");
  INFO("weights " << weights);
  ModelFile mf(weights);
  auto e = mf.engine();
  const SessionId parent = e->create_session().value();
  run(*e, parent, request(random_tokens(rng, 70, 3, 258), 10, 0.0f, 0));
  const int64_t used_before = e->stats().pages_used;
  const SessionId child = e->fork(parent).value();
  CHECK(e->info(child)->length == 80);
  CHECK(e->info(child)->pages_shared > 0);
  // The child is of the parent's family (the first 16 hex digits), with its own random half.
  CHECK(child.size() == 32);
  CHECK(child.substr(0, 16) == parent.substr(0, 16));
  CHECK(child.substr(16) != parent.substr(16));
  CHECK(e->stats().pages_used <= used_before + 1);  // only the partial last page is copied
  REQUIRE(e->check_invariants().ok());
  // Same request on both: same tokens (and neither disturbs the other).
  const auto cont = request({7, 8, 9}, 15, 0.7f, 5);
  const auto p1 = run(*e, parent, cont);
  const auto c1 = run(*e, child, cont);
  CHECK(p1 == c1);
  // The child rolls back into shared pages and writes there: the parent is unchanged.
  CHECK(e->rollback(child, 50).ok());
  run(*e, child, request({1, 2, 3, 4, 5}, 20, 0.9f, 11));
  REQUIRE(e->check_invariants().ok());
  const SessionId twin = e->fork(parent).value();  // a copy of the parent as it was
  const auto p2 = run(*e, parent, request({42}, 10, 0.0f, 0));
  const auto t2 = run(*e, twin, request({42}, 10, 0.0f, 0));
  CHECK(p2 == t2);
  // Closing the parent leaves the child whole.
  CHECK(e->close(parent).ok());
  CHECK(e->info(parent).status().code() == StatusCode::kNotFound);
  REQUIRE(e->check_invariants().ok());
  CHECK(run(*e, child, request({3}, 5, 0.0f, 0)).size() == 5);
  CHECK(e->close(child).ok());
  CHECK(e->close(twin).ok());
  // What stays in use is the prefix cache's, and only it holds it.
  CHECK(e->stats().pages_used == e->stats().pages_cached);
  CHECK(e->stats().pages_reclaimable == e->stats().pages_cached);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("evicted sessions rebuild transparently and produce the same tokens", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const int n = 5, turns = 3;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) prompts.push_back(random_tokens(rng, 60, 3, 258));
  auto play = [&](Engine& e) {
    std::vector<SessionId> ids;
    for (int i = 0; i < n; ++i) ids.push_back(e.create_session().value());
    std::vector<int32_t> all;
    for (int t = 0; t < turns; ++t)
      for (int i = 0; i < n; ++i) {
        auto out = run(e, ids[i], request(t == 0 ? prompts[i] : std::vector<int32_t>{int32_t(10 + t)}, 8, 0.8f, 7 * i + t));
        all.insert(all.end(), out.begin(), out.end());
        REQUIRE(e.check_invariants().ok());
      }
    return all;
  };
  auto big = mf.engine();
  const auto expected = play(*big);
  EngineOptions small;
  // Room for about two sessions' pages at a time: 2 layers x 2 KV heads x 64 x 2 bytes x 2 (K, V)
  // per position, pages of 16.
  const int64_t per_page = 2 * 2 * 64 * 2 * 2 * 16;
  small.kv_memory_bytes = per_page * 16;
  auto tiny = mf.engine(small);
  CHECK(play(*tiny) == expected);
  CHECK(tiny->stats().evictions > 0);
}

TEST_CASE("limits busy sessions and bad input are refused with their status", "[engine]") {
  ModelFile mf;
  EngineOptions o;
  o.max_sessions = 2;
  o.max_context = 64;
  o.max_tokens_per_request = 16;
  auto e = mf.engine(o);
  const SessionId a = e->create_session().value();
  REQUIRE(e->create_session().ok());
  CHECK(e->create_session().status().code() == StatusCode::kResourceExhausted);
  Collector c;
  CHECK(e->generate(a, request({1, 300}, 4, 0, 0), c.sink()).status().code() == StatusCode::kInvalidArgument);
  CHECK(e->generate(a, request({1}, 17, 0, 0), c.sink()).status().code() == StatusCode::kResourceExhausted);
  CHECK(e->generate(a, request(std::vector<int32_t>(60, 5), 10, 0, 0), c.sink()).status().code() ==
        StatusCode::kResourceExhausted);
  auto bad = request({1}, 4, 0, 0);
  bad.sampling->top_p = 0;
  CHECK(e->generate(a, bad, c.sink()).status().code() == StatusCode::kInvalidArgument);
  CHECK(e->generate("nope", request({1}, 4, 0, 0), c.sink()).status().code() == StatusCode::kNotFound);
  // Busy: a long generate, then everything else on that session is refused until it ends.
  Collector long_run;
  auto h = e->generate(a, request({1, 2, 3}, 16, 0.5f, 1), long_run.sink());
  REQUIRE(h.ok());
  Collector second;
  const auto busy = e->generate(a, request({4}, 1, 0, 0), second.sink());
  if (!long_run.done) {  // (it may already have finished on a fast machine)
    CHECK((busy.status().code() == StatusCode::kFailedPrecondition || busy.ok()));
  }
  (*h)->cancel();
  long_run.wait();
  if (busy.ok()) second.wait();
  CHECK((long_run.finish == FinishKind::kCancelled || long_run.finish == FinishKind::kLength));
  // Cancelled tokens stay in the session.
  CHECK(e->info(a)->length >= 3 + static_cast<int64_t>(long_run.tokens.size()));
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("a cancelled generate stops and keeps its tokens", "[engine]") {
  ModelFile mf;
  auto e = mf.engine();
  const SessionId a = e->create_session().value();
  std::mutex mu;
  std::condition_variable cv;
  int seen = 0;
  bool done = false;
  FinishKind finish = FinishKind::kError;
  std::shared_ptr<GenerateHandle> handle;
  auto h = e->generate(a, request({1, 2, 3}, 2000, 0.8f, 3), [&](const GenerateEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    if (ev.type == GenerateEvent::Type::kToken) ++seen;
    else {
      finish = ev.finish;
      done = true;
    }
    cv.notify_all();
  });
  REQUIRE(h.ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return seen >= 5 || done; });
    REQUIRE_FALSE(done);  // 2,000 tokens: still running
  }
  // One operation at a time: everything else on a generating session is refused.
  Collector other;
  CHECK(e->generate(a, request({4}, 1, 0, 0), other.sink()).status().code() == StatusCode::kFailedPrecondition);
  CHECK(e->rollback(a, 1).status().code() == StatusCode::kFailedPrecondition);
  CHECK(e->reset(a).code() == StatusCode::kFailedPrecondition);
  CHECK(e->fork(a).status().code() == StatusCode::kFailedPrecondition);
  CHECK(e->info(a)->generating);
  (*h)->cancel();
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  CHECK(finish == FinishKind::kCancelled);
  CHECK(seen < 2000);
  CHECK(e->info(a)->length == 3 + seen);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("thousands of mixed operations from many threads keep the page invariants", "[engine]") {
  Rng seed_rng(test_seed());
  const uint64_t seed = seed_rng.integer(0, 1 << 30);
  // The prefix cache on or off; with it on, a host tier too (smaller than the pool: its copies
  // are dropped as well as taken back, shared by forks and trimmed by rollbacks); and with both,
  // a model whose every layer is windowed, its sessions releasing the pages behind their windows
  // (rollbacks past the 2 positions kept rebuild).
  const int config = GENERATE(0, 1, 2, 3);
  const bool prefix_cache = config != 1, host_tier = config >= 2, windowed = config == 3;
  INFO("seed " << seed << ", prefix cache " << (prefix_cache ? "on" : "off") << ", host tier " << (host_tier ? "on" : "off")
                << ", windowed " << windowed);
  ModelFile mf("bf16", windowed ? "gemma3-swa-tiny" : "tiny");
  EngineOptions o;
  o.kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 40;  // 40 pages (20 of the 4-layer model's): eviction and waiting happen
  o.window_rollback = 2;
  o.max_context = 256;
  o.prefix_cache = prefix_cache;
  if (host_tier) {
    o.host_kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 24;
    o.host_kv_restore = EngineOptions::HostRestore::kCopy;
  }
  auto e = mf.engine(o);
  // Sessions in two namespaces start from a few shared prefixes (cache hits, copy-on-write after
  // rollbacks into cached pages, cached pages reclaimed under pressure).
  Rng prefix_rng(seed);
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 3; ++i) prefixes.push_back(random_tokens(prefix_rng, static_cast<int>(prefix_rng.integer(16, 56)), 3, 258));
  std::mutex ids_mu;
  std::vector<SessionId> ids;
  std::atomic<int> failures{0};
  auto worker = [&](int w) {
    Rng rng(seed + w);
    for (int op = 0; op < 600; ++op) {  // 4 threads: 2,400 operations
      SessionId id;
      {
        std::lock_guard<std::mutex> lock(ids_mu);
        if (!ids.empty()) id = ids[rng.integer(0, ids.size() - 1)];
      }
      switch (id.empty() ? 0 : rng.integer(0, 7)) {
        case 0: {
          SessionOptions so;
          so.cache_namespace = rng.integer(0, 1) ? "tenant-a" : "tenant-b";
          auto s = e->create_session(so);
          if (s.ok()) {
            std::lock_guard<std::mutex> lock(ids_mu);
            ids.push_back(*s);
          }
          break;
        }
        case 1:
        case 2: {
          auto c = std::make_shared<Collector>();
          std::vector<int32_t> input = random_tokens(rng, rng.integer(1, 20), 3, 258);
          if (rng.integer(0, 1) == 0) {  // a shared prefix, then its own tokens
            std::vector<int32_t> shared = prefixes[rng.integer(0, prefixes.size() - 1)];
            input.insert(input.begin(), shared.begin(), shared.end());
          }
          auto h = e->generate(id, request(std::move(input), rng.integer(0, 6), 0.7f, op), c->sink());
          if (h.ok()) {
            if (rng.integer(0, 3) == 0) (*h)->cancel();
            c->wait();
            if (c->finish == FinishKind::kError && c->status.code() != StatusCode::kResourceExhausted) ++failures;
          }
          break;
        }
        case 3: e->rollback(id, rng.integer(0, 10)).status().ignore(); break;
        case 4: e->reset(id).ignore(); break;
        case 5: {
          auto f = e->fork(id);
          if (f.ok()) {
            std::lock_guard<std::mutex> lock(ids_mu);
            ids.push_back(*f);
          }
          break;
        }
        case 6: {
          e->close(id).ignore();
          std::lock_guard<std::mutex> lock(ids_mu);
          ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
          break;
        }
        default: e->info(id).status().ignore(); break;
      }
      if (!e->check_invariants().ok()) ++failures;
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) threads.emplace_back(worker, w);
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  if (windowed) {
    // Whether the threads' random rollbacks reached behind a released window depends on how
    // they interleaved: one session of 60 positions rolled back by 30 (window 8 plus the 2
    // kept) rebuilds for every interleaving.
    const SessionId r = e->create_session().value();
    Rng rng(seed);
    generate(*e, r, request(random_tokens(rng, 59, 3, 258), 1, 0.0f, 0));
    const int64_t before = e->stats().window_rebuilds;
    REQUIRE(e->rollback(r, 30).ok());
    CHECK(e->stats().window_rebuilds == before + 1);
  }
  for (const SessionInfo& s : e->list()) CHECK(e->close(s.id).ok());
  CHECK(e->stats().pages_used == e->stats().pages_cached);
  CHECK(e->stats().pages_reclaimable == e->stats().pages_cached);
  if (!prefix_cache) CHECK(e->stats().pages_used == 0);
  CHECK(e->stats().sessions == 0);
  CHECK(e->stats().host_pages_used == 0);
  if (host_tier) CHECK(e->stats().host_offloads > 0);
  if (host_tier) CHECK(e->stats().host_restores > 0);
  if (windowed) CHECK(e->stats().window_pages_released > 0);
  if (windowed) CHECK(e->stats().window_rebuilds > 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("idle sessions expire after their time to live", "[engine]") {
  ModelFile mf;
  EngineOptions o;
  o.session_ttl = std::chrono::milliseconds(20);
  auto e = mf.engine(o);
  const SessionId a = e->create_session().value();
  run(*e, a, request({1, 2, 3}, 2, 0.0f, 0));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (e->info(a).ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(e->info(a).status().code() == StatusCode::kNotFound);
  CHECK(e->stats().pages_used == 0);
}

TEST_CASE("a request that cannot get pages fails and leaves its session as it was", "[engine]") {
  ModelFile mf;
  EngineOptions o;
  o.kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 4;  // 4 pages: 64 positions
  o.max_context = 1024;
  auto e = mf.engine(o);
  const SessionId a = e->create_session().value();
  run(*e, a, request({1, 2, 3}, 2, 0.0f, 0));
  CHECK(e->info(a)->length == 5);
  Collector c;
  REQUIRE(e->generate(a, request(std::vector<int32_t>(100, 7), 1, 0.0f, 0), c.sink()).ok());
  c.wait();
  CHECK(c.finish == FinishKind::kError);
  CHECK(c.status.code() == StatusCode::kResourceExhausted);
  CHECK(e->info(a)->length == 5);
  REQUIRE(e->check_invariants().ok());
  // The session still works.
  CHECK(run(*e, a, request({4}, 3, 0.0f, 0)).size() == 3);
}

TEST_CASE("an abort ends running generates from the scheduler thread and is not sticky", "[engine]") {
  ModelFile mf;
  auto e = mf.engine();
  const SessionId a = e->create_session().value(), b = e->create_session().value();
  Collector ca, cb;
  std::thread::id sink_thread;
  std::atomic<bool> other_thread{false};
  std::mutex mu;
  auto tagged = [&](Collector& c) {
    EventSink inner = c.sink();
    return EventSink([&, inner](const GenerateEvent& ev) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (sink_thread == std::thread::id()) sink_thread = std::this_thread::get_id();
        other_thread = other_thread || sink_thread != std::this_thread::get_id();
      }
      inner(ev);
    });
  };
  REQUIRE(e->generate(a, request({1, 2, 3}, 2000, 0.8f, 3), tagged(ca)).ok());
  REQUIRE(e->generate(b, request({4, 5}, 2000, 0.8f, 4), tagged(cb)).ok());
  e->abort_generating(Status(StatusCode::kUnavailable, "shutting down"));
  ca.wait();
  cb.wait();
  CHECK(ca.status.code() == StatusCode::kUnavailable);
  CHECK(cb.status.code() == StatusCode::kUnavailable);
  CHECK_FALSE(other_thread);  // every event from the scheduler thread, in order
  CHECK(e->info(a)->length == 0);  // a failed request is undone
  // The next request runs normally.
  Collector c2;
  REQUIRE(e->generate(a, request({7}, 3, 0.0f, 0), c2.sink()).ok());
  c2.wait();
  CHECK(c2.status.ok());
  CHECK(c2.tokens.size() == 3);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("requests that fit the pool alone never fail for lack of pages: waiting ones are preempted", "[engine]") {
  Rng rng(test_seed());
  // Without a host tier preempted pages are dropped and rebuilt; with one they go there and come
  // back by copy.
  const bool host_tier = GENERATE(false, true);
  INFO("seed " << rng.seed() << ", host tier " << (host_tier ? "on" : "off"));
  ModelFile mf;
  EngineOptions tight;
  tight.kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 12;  // 12 pages of 16: 192 positions
  if (host_tier) {
    tight.host_kv_memory_bytes = 2 * 2 * 64 * 2 * 2 * 16 * 64;
    tight.host_kv_restore = EngineOptions::HostRestore::kCopy;
  }
  auto e = mf.engine(tight);
  auto roomy = mf.engine();
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::unique_ptr<Collector>> runs;
  // Each prompt takes 3 pages, its 100 tokens 6 more: four prompts fill the pool, and then none
  // of the four can grow.
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(random_tokens(rng, 40, 3, 258));
    runs.push_back(std::make_unique<Collector>());
    REQUIRE(e->generate(e->create_session().value(), request(prompts.back(), 100, 0.0f, 0), runs.back()->sink()).ok());
  }
  for (int i = 0; i < 8; ++i) {
    runs[i]->wait();
    INFO("request " << i << ": " << runs[i]->status.to_string());
    CHECK(runs[i]->finish == FinishKind::kLength);
    // Preempted or not, the tokens a request gets alone.
    CHECK(runs[i]->tokens == run(*roomy, roomy->create_session().value(), request(prompts[i], 100, 0.0f, 0)));
  }
  const EngineStats st = e->stats();
  CHECK(st.preemptions > 0);
  CHECK(st.host_offloads >= (host_tier ? st.preemptions : 0));
  CHECK((st.host_restored_tokens > 0) == host_tier);
  REQUIRE(e->check_invariants().ok());
}
