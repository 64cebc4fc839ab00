// Driving an Engine from a test: a Collector of one generate's events, and a synchronous generate.
#pragma once

#include <catch2/catch.hpp>

#include <condition_variable>
#include <mutex>
#include <vector>

#include "combs/engine/engine.h"
#include "combs/engine/speculation.h"
#include "support/random.h"

namespace combs::testing {

// Collects one generate's events; wait() returns when it has finished.
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  bool done = false;
  FinishKind finish = FinishKind::kError;
  Status status;
  Usage usage;

  EventSink sink() {
    return [this](const GenerateEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e.type == GenerateEvent::Type::kToken) {
        if (e.token >= 0) tokens.push_back(e.token);
        return;
      }
      finish = e.finish;
      status = e.status;
      usage = e.usage;
      done = true;
      cv.notify_all();
    };
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
};

// A request of exactly max_tokens new tokens (ignore_eos), top-k 40 at `temperature` (0: greedy).
// Speculation by `method`, up to max_draft tokens a step.
// A bench-style proposer: drafts the known continuation `truth` (from the history's length on),
// each token wrong (another id of a 259-token vocabulary, the tiny models') with probability
// `error`, decided by the position so that the drafts are reproducible.
class ReplayProposer final : public Proposer {
 public:
  using Proposer::propose;
  ReplayProposer(std::vector<int32_t> truth, double error) : truth_(std::move(truth)), error_(error) {}
  void propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) override {
    out->clear();
    for (size_t p = history.size(); p < truth_.size() && static_cast<int>(out->size()) < max; ++p) {
      Rng rng(p * 7919 + 1);
      out->push_back(rng.uniform(0.0f, 1.0f) < error_ ? (truth_[p] + 1 + static_cast<int32_t>(rng.integer(0, 200))) % 259
                                                       : truth_[p]);
    }
  }

 private:
  std::vector<int32_t> truth_;
  double error_;
};

inline SpeculationParams speculation(SpeculationParams::Method method, int max_draft = 4) {
  SpeculationParams p;
  p.method = method;
  p.max_draft = max_draft;
  return p;
}

inline GenerateRequest request(std::vector<int32_t> input, int max_tokens, float temperature = 0.0f,
                               uint64_t seed = 0) {
  GenerateRequest r;
  r.input = std::move(input);
  r.max_tokens = max_tokens;
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 40;
  p.seed = seed;
  r.sampling = p;
  r.ignore_eos = true;
  return r;
}

// A finished generate: its tokens and usage.
struct Generated {
  std::vector<int32_t> tokens;
  Usage usage;
};

// Generates synchronously (REQUIREs success).
inline Generated generate(Engine& e, const SessionId& id, GenerateRequest r) {
  Collector c;
  auto h = e.generate(id, std::move(r), c.sink());
  REQUIRE(h.ok());
  c.wait();
  INFO(c.status.to_string());
  REQUIRE(c.finish != FinishKind::kError);
  return {c.tokens, c.usage};
}

// Generates synchronously; returns the tokens (REQUIREs success).
inline std::vector<int32_t> run(Engine& e, const SessionId& id, GenerateRequest r) {
  return generate(e, id, std::move(r)).tokens;
}

}  // namespace combs::testing
