// Speculative decoding in the engine: the n-gram proposer and the adaptive draft length; greedy
// output with speculation equals greedy output without it, token for token (drafts right, wrong
// or half and half, sessions with and without speculation sharing steps, stops inside an accepted
// run, rollback after); sampled output keeps its distribution (two-sample chi-square over seeds).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "combs/engine/engine.h"
#include "combs/engine/speculation.h"
#include "combs/model/runner.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

SpeculationParams ngram(int max_draft = 4) { return speculation(SpeculationParams::Method::kNgram, max_draft); }

// The prompt and its greedy continuation of n tokens without speculation (what a replaying
// proposer drafts).
std::vector<int32_t> greedy_history(const ModelFile& mf, const std::vector<int32_t>& prompt, int n) {
  auto e = mf.engine();
  std::vector<int32_t> history = prompt;
  const std::vector<int32_t> out = run(*e, e->create_session().value(), request(prompt, n));
  history.insert(history.end(), out.begin(), out.end());
  return history;
}

GenerateRequest speculative(GenerateRequest r, int max_draft = 4) {
  r.speculation = ngram(max_draft);
  return r;
}

}  // namespace

TEST_CASE("the n-gram proposer drafts what followed the latest earlier occurrence of the history's end", "[engine]") {
  NgramProposer p(2, 4);
  std::vector<int32_t> out;
  p.propose(std::vector<int32_t>{5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3}, 3, &out);
  CHECK(out == std::vector<int32_t>{7, 1, 2});  // [1 2 3] last seen before at 6: 7 followed
  p.propose(std::vector<int32_t>{5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3}, 10, &out);
  CHECK(out == std::vector<int32_t>{7, 1, 2, 3});  // up to the history's end
  p.propose(std::vector<int32_t>{8, 6, 1, 2, 9, 9, 4, 1, 2}, 2, &out);
  CHECK(out == std::vector<int32_t>{9, 9});  // the 2-gram [1 2]
  p.propose(std::vector<int32_t>{1, 2, 3, 4, 5}, 4, &out);
  CHECK(out.empty());  // nothing repeats
  p.propose(std::vector<int32_t>{7, 7, 7}, 4, &out);
  CHECK(out == std::vector<int32_t>{7});  // overlapping occurrences count
  p.propose(std::vector<int32_t>{1, 2, 1, 2}, 0, &out);
  CHECK(out.empty());
  NgramProposer strict(3, 3);
  strict.propose(std::vector<int32_t>{8, 6, 1, 2, 9, 9, 4, 1, 2}, 2, &out);
  CHECK(out.empty());  // no 3-gram repeats
}

TEST_CASE("the draft length follows the acceptance and probes when drafts fail", "[engine]") {
  DraftLength good(8);
  for (int i = 0; i < 20; ++i) good.observe(4, 4);
  CHECK(good.next() == 8);
  DraftLength bad(8);
  for (int i = 0; i < 40; ++i) bad.observe(4, 0);
  CHECK(bad.acceptance() < 0.01);
  std::vector<int> probes;  // the steps that draft one token while every probe fails
  for (int i = 1; i <= 1000; ++i) {
    const int n = bad.next();
    CHECK(n <= 1);
    if (n == 1) probes.push_back(i), bad.observe(1, 0);
  }
  CHECK(probes == std::vector<int>{8, 24, 56, 120, 248, 504, 760});  // waits doubling to 256
  bad.observe(1, 1);  // a probe that holds: the next comes soon again
  int soon = 0;
  while (bad.next() == 0) ++soon;
  CHECK(soon < 8);
  DraftLength half(8);
  for (int i = 0; i < 30; ++i) half.observe(4, 2);
  CHECK(half.next() == 2);  // rate 0.5: one expected, and one more
  CHECK(validate(ngram(0)).code() == StatusCode::kInvalidArgument);
  CHECK(validate(ngram(17)).code() == StatusCode::kInvalidArgument);
  CHECK(validate(ngram(16)).ok());
}

TEST_CASE("the draft length stops drafting where drafts cost more time per token than none", "[engine]") {
  // Every draft accepted; a step emits drafted + 1 tokens. `spec_ms` a token with drafts, 1 ms
  // without: the share of steps that draft.
  auto drafting_share = [](double spec_ms) {
    DraftLength d(4);
    int drafting = 0;
    const int steps = 2000;
    for (int i = 0; i < steps; ++i) {
      const int k = d.next();
      if (k > 0) {
        d.observe(k, k);
        d.observe_time(k, k + 1, (k + 1) * spec_ms * 1e-3);
        ++drafting;
      } else {
        d.observe_time(0, 1, 1e-3);
      }
    }
    return static_cast<double>(drafting) / steps;
  };
  CHECK(drafting_share(0.5) > 0.95);  // drafts halve a token's time: nearly every step drafts
  CHECK(drafting_share(1.2) < 0.02);  // drafts cost 20% more: probes only, further and further apart
  CHECK(drafting_share(0.95) > 0.9);
  // Noisy: each draft right with probability 0.6 (a step emits its run of right drafts and one
  // more), a step with k drafts takes 1 + 0.25 k ms: about 0.8 ms a token against 1 ms without.
  // Steps that reject every draft cost 1.5 ms a token: the average, not the last step, decides.
  Rng rng(5);
  DraftLength d(4);
  int drafting = 0;
  for (int i = 0; i < 2000; ++i) {
    const int k = d.next();
    if (k == 0) {
      d.observe_time(0, 1, 1e-3);
      continue;
    }
    int run = 0;
    while (run < k && rng.uniform(0.0f, 1.0f) < 0.6f) ++run;
    d.observe(k, run);
    d.observe_time(k, run + 1, (1.0 + 0.25 * k) * 1e-3);
    ++drafting;
  }
  CHECK(drafting > 1800);
}

TEST_CASE("greedy output with speculation equals greedy output without it", "[engine]") {
  Rng rng(test_seed());
  const std::string weights = GENERATE(as<std::string>{}, "bf16", "q4_k_m");
  INFO("seed " << rng.seed() << ", weights " << weights);
  ModelFile mf(weights);
  auto e = mf.engine();
  for (int i = 0; i < 4; ++i) {
    // Random models fall into loops: the n-gram proposer finds them.
    const std::vector<int32_t> prompt = random_tokens(rng, 10 + 13 * i, 3, 258);
    const Generated plain = generate(*e, e->create_session().value(), request(prompt, 80));
    const int64_t steps = e->stats().steps;
    const Generated spec = generate(*e, e->create_session().value(), speculative(request(prompt, 80), 1 + 2 * i));
    INFO("prompt " << i);
    CHECK(spec.tokens == plain.tokens);
    CHECK(spec.usage.accepted_tokens <= spec.usage.drafted_tokens);
    // One prefill step, then a step per token less one per accepted draft.
    CHECK(e->stats().steps - steps + spec.usage.accepted_tokens == 80);
  }
  CHECK(e->stats().accepted_tokens > 0);
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("drafts right, wrong or half and half give the tokens of no speculation", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const std::vector<int32_t> prompt = random_tokens(rng, 20, 3, 258);
  const std::vector<int32_t> truth = greedy_history(mf, prompt, 60);
  const std::vector<int32_t> expected(truth.begin() + 20, truth.end());
  for (double error : {0.0, 0.5, 1.0}) {
    INFO("draft error rate " << error);
    EngineOptions o;
    o.proposer = std::make_shared<ReplayProposer>(truth, error);
    auto e = mf.engine(o);
    const Generated g = generate(*e, e->create_session().value(), speculative(request(prompt, 60), 6));
    CHECK(g.tokens == expected);
    if (error == 0.0) CHECK(g.usage.accepted_tokens == g.usage.drafted_tokens);
    // How many steps draft also follows the measured time a token takes with drafts and without
    // (wall-clock: under a sanitizer on a loaded machine a tiny model's steps vary), so only that
    // they did is certain.
    if (error == 0.0) CHECK(g.usage.accepted_tokens > 0);
    if (error == 1.0) CHECK(g.usage.accepted_tokens == 0);
    if (error == 1.0) CHECK(g.usage.drafted_tokens < 20);  // it stops drafting, probing now and then
    if (error == 1.0) {
      // The session's next request of the same speculation starts from what it learned, not
      // from the prior. One token a draft, every one rejected: the acceptance falls from the
      // prior 0.6 by 0.85 a draft and is below 0.15 after 9 drafts, whichever request drafted
      // them (how many the first one drafts follows the measured step times: where drafts are
      // measured dearer it only probes). After that only probes draft, at most two in 20 steps.
      // A session that forgot would draft up to 9 again.
      const SessionId id = e->create_session().value();
      const Generated first = generate(*e, id, speculative(request(prompt, 30), 1));
      const Generated next = generate(*e, id, speculative(request({}, 20), 1));
      INFO("first request drafted " << first.usage.drafted_tokens);
      CHECK(first.usage.drafted_tokens > 0);
      CHECK(next.usage.drafted_tokens <= std::max<int64_t>(0, 9 - first.usage.drafted_tokens) + 2);
    }
    REQUIRE(e->check_invariants().ok());
  }
}

TEST_CASE("sessions with and without speculation share steps and each gets its alone tokens", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const int n = 6;
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < n; ++i) {
    GenerateRequest r = request(random_tokens(rng, 8 + 21 * i % 90, 3, 258), 48);
    if (i % 2) r = speculative(r, 2 + i);
    reqs.push_back(r);
  }
  std::vector<std::vector<int32_t>> alone(n);
  {
    auto e = mf.engine();
    for (int i = 0; i < n; ++i) {
      GenerateRequest plain = reqs[i];
      plain.speculation.reset();
      alone[i] = run(*e, e->create_session().value(), plain);
    }
  }
  auto e = mf.engine();
  std::vector<Collector> cs(n);
  for (int i = 0; i < n; ++i) REQUIRE(e->generate(e->create_session().value(), reqs[i], cs[i].sink()).ok());
  for (int i = 0; i < n; ++i) {
    cs[i].wait();
    INFO("request " << i);
    CHECK(cs[i].finish == FinishKind::kLength);
    CHECK(cs[i].tokens == alone[i]);
  }
  REQUIRE(e->check_invariants().ok());
}

namespace {

// The CPU runner, recording each forward: its sequences' token counts and which were
// verifications (every position's output).
class RecordingRunner final : public ModelRunner {
 public:
  struct Forward {
    std::vector<int64_t> tokens;
    std::vector<bool> verifies;
    int64_t total() const { return std::accumulate(tokens.begin(), tokens.end(), int64_t{0}); }
  };
  RecordingRunner(std::unique_ptr<Runner> inner, std::vector<Forward>* log) : inner_(std::move(inner)), log_(log) {}
  Status forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options) override {
    Forward f;
    for (const SequenceInput& s : seqs) {
      f.tokens.push_back(static_cast<int64_t>(s.tokens.size()));
      f.verifies.push_back(s.all_logits);
    }
    log_->push_back(std::move(f));
    return inner_->forward(seqs, logits, options);
  }
  Backend& backend() override { return inner_->backend(); }
  const Model& model() const override { return inner_->model(); }

 private:
  std::unique_ptr<Runner> inner_;
  std::vector<Forward>* log_;
};

}  // namespace

TEST_CASE("a step's token budget counts the drafted tokens", "[engine]") {
  // Three sessions drafting up to 8 tokens each (all right: the acceptance climbs and so does the
  // draft length) under a budget of 6 tokens a step: every forward holds at most 6 tokens, drafts
  // included — a verification takes only the room the step has left, or waits.
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const std::vector<int32_t> prompt = random_tokens(rng, 10, 3, 258);
  const std::vector<int32_t> truth = greedy_history(mf, prompt, 40);
  const std::vector<int32_t> expected(truth.begin() + 10, truth.end());
  const int64_t budget = 6;
  CpuBackend backend(CpuBackendOptions{.num_threads = 2});
  std::vector<RecordingRunner::Forward> log;
  EngineOptions o;
  o.step_token_budget = budget;
  o.prefill_chunk = 4;  // (a prefill chunk alone in its step may exceed the budget; not here)
  o.proposer = std::make_shared<ReplayProposer>(truth, 0.0);
  o.make_runner = [&](const Model& m) -> StatusOr<std::unique_ptr<ModelRunner>> {
    COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Runner> r, Runner::create(m, backend, RunnerOptions{.batch_invariant = true}));
    return std::unique_ptr<ModelRunner>(std::make_unique<RecordingRunner>(std::move(r), &log));
  };
  auto e = mf.engine(o);
  const int n = 3;
  std::vector<Collector> cs(n);
  for (int i = 0; i < n; ++i) {
    REQUIRE(e->generate(e->create_session().value(), speculative(request(prompt, 40), 8), cs[i].sink()).ok());
  }
  int64_t drafted = 0;
  for (int i = 0; i < n; ++i) {
    cs[i].wait();
    INFO("session " << i);
    CHECK(cs[i].tokens == expected);
    drafted += cs[i].usage.drafted_tokens;
  }
  e.reset();  // (the log is complete)
  CHECK(drafted > 0);
  int64_t largest = 0;
  bool shared = false;  // a verification in a step with another sequence
  for (const RecordingRunner::Forward& f : log) {
    largest = std::max(largest, f.total());
    for (bool v : f.verifies) shared = shared || (v && f.tokens.size() > 1);
  }
  INFO(log.size() << " forwards");
  CHECK(largest <= budget);
  CHECK(largest == budget);  // the budget was reached: drafts would have taken more
  CHECK(shared);
}

TEST_CASE("a stop inside an accepted run ends the request there and the session stays consistent", "[engine]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  ModelFile mf;
  const std::vector<int32_t> prompt = random_tokens(rng, 16, 3, 258);
  const std::vector<int32_t> truth = greedy_history(mf, prompt, 40);
  EngineOptions o;
  o.proposer = std::make_shared<ReplayProposer>(truth, 0.0);
  auto e = mf.engine(o);
  // A stop sequence: the 7th and 8th generated tokens, drafted together with what follows them.
  GenerateRequest r = speculative(request(prompt, 40), 8);
  r.stop_sequences = {{truth[16 + 6], truth[16 + 7]}};
  const SessionId id = e->create_session().value();
  Collector c;
  REQUIRE(e->generate(id, r, c.sink()).ok());
  c.wait();
  CHECK(c.finish == FinishKind::kStop);
  const auto end = std::search(truth.begin() + 16, truth.end(), r.stop_sequences[0].begin(), r.stop_sequences[0].end()) + 2;
  CHECK(c.tokens == std::vector<int32_t>(truth.begin() + 16, end));
  CHECK(e->info(id)->length == end - truth.begin());
  CHECK(e->info(id)->cached == e->info(id)->length - 1);
  REQUIRE(e->check_invariants().ok());
  // max_tokens inside a run: exactly that many.
  const Generated g = generate(*e, e->create_session().value(), speculative(request(prompt, 5), 8));
  CHECK(g.tokens == std::vector<int32_t>(truth.begin() + 16, truth.begin() + 21));
  // Rolled back and continued without speculation: as a fresh session fed the same history.
  REQUIRE(e->rollback(id, 3).ok());
  std::vector<int32_t> history(truth.begin(), end - 3);
  auto fresh = mf.engine();
  CHECK(run(*e, id, request({}, 10)) == run(*fresh, fresh->create_session().value(), request(history, 10)));
  REQUIRE(e->check_invariants().ok());
}

TEST_CASE("sampled output with speculation keeps its distribution", "[engine]") {
  // The 2nd and 3rd tokens of many seeded generations, with drafts (the greedy continuation, often
  // right, often wrong) and without: two samples of one distribution if the rejection rule holds.
  ModelFile mf;
  Rng rng(11);
  const std::vector<int32_t> prompt = random_tokens(rng, 12, 3, 258);
  const std::vector<int32_t> truth = greedy_history(mf, prompt, 8);
  EngineOptions o;
  o.proposer = std::make_shared<ReplayProposer>(truth, 0.0);
  auto e = mf.engine(o);
  const int n = 1500;
  std::map<int32_t, int> plain[2], spec[2];
  int64_t drafted = 0, accepted = 0;
  for (int seed = 0; seed < n; ++seed) {
    // Cool enough that the greedy drafts are often right, warm enough that they are often not.
    GenerateRequest r = request(prompt, 4, 0.2f, static_cast<uint64_t>(seed));
    r.sampling->top_k = 8;
    const SessionId sa = e->create_session().value(), sb = e->create_session().value();
    const Generated a = generate(*e, sa, r);
    const Generated b = generate(*e, sb, speculative(r, 3));
    REQUIRE(e->close(sa).ok());
    REQUIRE(e->close(sb).ok());
    drafted += b.usage.drafted_tokens;
    accepted += b.usage.accepted_tokens;
    for (int k = 0; k < 2; ++k) ++plain[k][a.tokens[k + 1]], ++spec[k][b.tokens[k + 1]];
  }
  INFO("drafted " << drafted << ", accepted " << accepted);
  CHECK(accepted > n / 4);             // drafts were taken ...
  CHECK(drafted - accepted > n / 4);   // ... and refused, often
  for (int k = 0; k < 2; ++k) {
    // Categories with at least 10 observations in all; the rest pooled into one.
    std::map<int32_t, std::pair<int, int>> cells;
    for (auto [t, c] : plain[k]) cells[t].first += c;
    for (auto [t, c] : spec[k]) cells[t].second += c;
    std::vector<std::pair<int, int>> table{{0, 0}};
    for (auto [t, c] : cells) {
      if (c.first + c.second >= 10) table.push_back(c);
      else table[0].first += c.first, table[0].second += c.second;
    }
    if (table[0].first + table[0].second == 0) table.erase(table.begin());
    double chi2 = 0.0;
    for (auto [x, y] : table) chi2 += std::pow(x - y, 2) / (x + y);  // equal sample sizes
    const double df = static_cast<double>(table.size()) - 1;
    // The 0.999 quantile of chi-square(df) (Wilson-Hilferty).
    const double z = 3.09, q = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
    INFO("token " << k + 2 << ": chi-square " << chi2 << " over " << df << " degrees of freedom, 0.999 quantile " << q);
    CHECK(df >= 3);
    CHECK(chi2 < q);
  }
}
