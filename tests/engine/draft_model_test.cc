// Speculative decoding with a draft model: greedy output equals greedy output without speculation
// whatever the draft (the target itself, its Q8_0 quantization, an unrelated model), the draft
// caches follow rollback, reset, fork and close, a small draft pool evicts caches without changing
// any output, and a draft model of another vocabulary is refused.
#include <catch2/catch.hpp>

#include "combs/engine/draft_model.h"
#include "combs/engine/engine.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

// A tiny model file of `weights` and `seed` (ModelFile's is bf16, seed 3); vocab_path: another
// vocabulary than the built-in one.
std::string write_model(const TempDir& dir, const std::string& name, const std::string& weights, uint64_t seed,
                        const std::string& vocab_path = "") {
  RandomModelOptions o;
  o.shape = std::move(named_shape("tiny")).value();
  REQUIRE(set_weight_type(weights, &o).ok());
  o.seed = seed;
  o.vocab_path = vocab_path;
  const std::string path = dir.file(name);
  REQUIRE(write_random_model(o, path).ok());
  return path;
}

std::shared_ptr<const Model> load(const std::string& path) {
  auto m = Model::load(path);
  REQUIRE(m.ok());
  return std::shared_ptr<const Model>(std::move(m).value());
}

SpeculationParams with_draft(int max_draft) { return speculation(SpeculationParams::Method::kDraft, max_draft); }

GenerateRequest drafted(GenerateRequest r, int max_draft = 4) {
  r.speculation = with_draft(max_draft);
  return r;
}

}  // namespace

TEST_CASE("greedy output with a draft model equals greedy output without it", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  TempDir dir;
  // The target itself (every draft right), its Q8_0 quantization (most right), another model.
  const std::string kind = GENERATE(as<std::string>{}, "itself", "q8_0", "unrelated");
  INFO("seed " << rng.seed() << ", draft " << kind);
  const std::string path = kind == "itself" ? mf.path : write_model(dir, "draft.gguf", kind == "q8_0" ? "q8_0" : "bf16", kind == "q8_0" ? 3 : 77);
  EngineOptions o;
  o.draft_model = load(path);
  auto e = mf.engine(o);
  auto plain_engine = mf.engine();
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> prompt = random_tokens(rng, 10 + 17 * i, 3, 258);
    const std::vector<int32_t> plain = run(*plain_engine, plain_engine->create_session().value(), request(prompt, 60));
    const int64_t steps = e->stats().steps;
    const Generated g = generate(*e, e->create_session().value(), drafted(request(prompt, 60), 2 + 2 * i));
    INFO("prompt " << i);
    CHECK(g.tokens == plain);
    CHECK(g.usage.accepted_tokens <= g.usage.drafted_tokens);
    CHECK(e->stats().steps - steps + g.usage.accepted_tokens == 60);  // a step per token less the accepted
    // (How many it drafts follows the time drafts save: a draft as large as the target may stop.)
    if (kind == "itself") CHECK(g.usage.accepted_tokens == g.usage.drafted_tokens);
  }
  const EngineStats st = e->stats();
  CHECK(st.draft_forwards > 0);
  CHECK(st.draft_sessions == 3);
  if (kind == "q8_0") CHECK(st.accepted_tokens * 2 > st.drafted_tokens);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("draft caches follow rollback, reset, fork and close", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  // The target drafts for itself: a draft cache that does not hold exactly the session's history
  // (stale positions after a rollback, a fork's, a reset's) drafts wrong tokens, and every draft
  // accepted says that it does.
  EngineOptions o;
  o.draft_model = load(mf.path);
  auto e = mf.engine(o);
  auto fresh = mf.engine();
  // What a fresh session fed `history` generates without speculation.
  auto alone = [&](const std::vector<int32_t>& history, int n) {
    return run(*fresh, fresh->create_session().value(), request(history, n));
  };
  // Generates with drafts; every draft must be accepted. (Each request drafts at most a number the
  // session has not used yet: a draft as large as the target does not pay on the CPU, and what a
  // session learned of that carries over only to requests of the same speculation.)
  int max_draft = 2;
  auto go = [&](const SessionId& id, std::vector<int32_t> input, int n) {
    const Generated g = generate(*e, id, drafted(request(std::move(input), n), max_draft++));
    CHECK(g.usage.drafted_tokens > 0);
    CHECK(g.usage.accepted_tokens == g.usage.drafted_tokens);
    return g.tokens;
  };
  std::vector<int32_t> history = random_tokens(rng, 30, 3, 258);
  const SessionId id = e->create_session().value();
  std::vector<int32_t> out = go(id, history, 40);
  CHECK(out == alone(history, 40));
  history.insert(history.end(), out.begin(), out.end());
  // Rolled back into what was drafted and accepted: the draft cache drops it too.
  REQUIRE(e->rollback(id, 25).ok());
  history.resize(history.size() - 25);
  out = go(id, {7, 8, 9}, 30);
  history.insert(history.end(), {7, 8, 9});
  CHECK(out == alone(history, 30));
  history.insert(history.end(), out.begin(), out.end());
  // A fork drafts from its parent's draft cache; both go their own ways.
  const SessionId child = e->fork(id).value();
  CHECK(e->stats().draft_sessions == 2);
  const std::vector<int32_t> a = go(child, {11}, 20);
  const std::vector<int32_t> b = go(id, {12}, 20);
  std::vector<int32_t> ha = history, hb = history;
  ha.push_back(11);
  hb.push_back(12);
  CHECK(a == alone(ha, 20));
  CHECK(b == alone(hb, 20));
  // Reset: a new history from scratch.
  REQUIRE(e->reset(id).ok());
  const std::vector<int32_t> prompt = random_tokens(rng, 12, 3, 258);
  CHECK(go(id, prompt, 30) == alone(prompt, 30));
  REQUIRE(e->close(child).ok());
  CHECK(e->stats().draft_sessions == 1);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("a small draft pool drops draft caches, not tokens", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  TempDir dir;
  EngineOptions o;
  o.draft_model = load(write_model(dir, "draft.gguf", "q8_0", 3));
  // Room for about two sessions' draft caches: six sessions take turns.
  const int64_t page = page_bytes(o.draft_model->config().kv_geometry(o.kv_dtype), o.page_size);
  o.draft_kv_memory_bytes = 14 * page;
  auto e = mf.engine(o);
  const int n = 6;
  std::vector<GenerateRequest> reqs;
  std::vector<std::vector<int32_t>> expected(n);
  {
    auto plain = mf.engine();
    for (int i = 0; i < n; ++i) {
      reqs.push_back(request(random_tokens(rng, 40 + 11 * i, 3, 258), 50));
      expected[i] = run(*plain, plain->create_session().value(), reqs[i]);
    }
  }
  for (int round = 0; round < 2; ++round) {  // all at once, then one after another
    std::vector<Collector> cs(n);
    for (int i = 0; i < n; ++i) {
      REQUIRE(e->generate(e->create_session().value(), drafted(reqs[i], 3), cs[i].sink()).ok());
      if (round == 1) cs[i].wait();
    }
    for (int i = 0; i < n; ++i) {
      cs[i].wait();
      INFO("round " << round << ", request " << i);
      CHECK(cs[i].finish == FinishKind::kLength);
      CHECK(cs[i].tokens == expected[i]);
    }
  }
  CHECK(e->stats().draft_cache_evictions > 0);
  CHECK(e->stats().accepted_tokens > 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("a session longer than the draft pool does not draft and evicts no one", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  TempDir dir;
  EngineOptions o;
  o.draft_model = load(write_model(dir, "draft.gguf", "q8_0", 3));
  const int64_t page = page_bytes(o.draft_model->config().kv_geometry(o.kv_dtype), o.page_size);
  o.draft_kv_memory_bytes = 8 * page;  // 128 positions
  auto e = mf.engine(o);
  auto plain = mf.engine();
  const std::vector<int32_t> short_prompt = random_tokens(rng, 20, 3, 258), long_prompt = random_tokens(rng, 150, 3, 258);
  const SessionId a = e->create_session().value();
  const Generated first = generate(*e, a, drafted(request(short_prompt, 30)));
  CHECK(first.tokens == run(*plain, plain->create_session().value(), request(short_prompt, 30)));
  CHECK(first.usage.drafted_tokens > 0);
  const Generated g = generate(*e, e->create_session().value(), drafted(request(long_prompt, 20)));
  CHECK(g.tokens == run(*plain, plain->create_session().value(), request(long_prompt, 20)));
  CHECK(g.usage.drafted_tokens == 0);
  CHECK(e->stats().draft_cache_evictions == 0);  // a's cache stayed
  CHECK(e->stats().draft_sessions == 1);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("a draft model is refused for another vocabulary, and drafts need one", "[engine]") {
  ModelFile mf;
  TempDir dir;
  {  // Llama 3's 128,256 tokens against the built-in 259
    EngineOptions o;
    o.draft_model = load(write_model(dir, "llama3-vocab.gguf", "bf16", 3, std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf"));
    auto m = Model::load(mf.path);
    REQUIRE(m.ok());
    auto e = Engine::create(std::move(m).value(), o);
    REQUIRE_FALSE(e.ok());
    CHECK(e.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(e.status().message(), Catch::Contains("vocabulary") && Catch::Contains("128256"));
  }
  // No draft model: a request, a session or an engine default that asks for drafts is refused.
  auto e = mf.engine();
  const SessionId id = e->create_session().value();
  Collector c;
  auto refused = e->generate(id, drafted(request({5, 6, 7}, 4)), c.sink());
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.status().message(), Catch::Contains("draft model"));
  SessionOptions so;
  so.speculation = with_draft(4);
  CHECK_FALSE(e->create_session(so).ok());
  EngineOptions o;
  o.speculation = with_draft(4);
  auto m = Model::load(mf.path);
  REQUIRE(m.ok());
  CHECK_FALSE(Engine::create(std::move(m).value(), o).ok());
}
