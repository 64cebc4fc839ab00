// Speculative decoding in the engine: a proposer drafts the tokens a session's history is likely to
// continue with; the session's next forward computes them with its last token (one position each,
// all in one step) and keeps the longest run the model agrees with — exactly for greedy requests,
// and for sampled ones by the rejection rule that leaves the output distributed as without
// speculation (Sampler::verify); the rejected positions are dropped from the cache (popn), which
// is all rollback costs. How many tokens a session drafts follows its measured acceptance.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "combs/base/status.h"

namespace combs {

struct SpeculationParams {
  // kNgram: prompt lookup — the tokens that followed the latest earlier occurrence of the history's
  // last few tokens (or EngineOptions::proposer's drafts). kDraft: a draft model's greedy
  // continuation (EngineOptions::draft_model; DraftModel).
  enum class Method : uint8_t { kOff, kNgram, kDraft } method = Method::kOff;
  int max_draft = 4;  // tokens drafted per step at most, 1 to 16
};

// INVALID_ARGUMENT naming the field for a value out of range.
Status validate(const SpeculationParams& params);
std::string_view method_name(SpeculationParams::Method m);  // "off", "ngram", "draft"

// One session's request for drafts.
struct DraftRequest {
  std::string_view session;           // its id (a proposer may keep state per session)
  std::span<const int32_t> history;   // what the drafts continue
  int max = 0;                        // tokens at most
};

// Drafts tokens to follow a history. Called from the engine's scheduler thread only.
class Proposer {
 public:
  virtual ~Proposer() = default;
  // Up to `max` tokens continuing `history` into *out (cleared first; empty: nothing to propose).
  virtual void propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) = 0;
  // The drafts of every request of a step, (*drafts)[i] for requests[i]; by default one propose()
  // each (a draft model runs them as one batch).
  virtual void propose(std::span<const DraftRequest> requests, std::vector<std::vector<int32_t>>* drafts);
  // A session's state (if any) is copied to its fork, or dropped when it is closed.
  virtual void fork(std::string_view /*parent*/, std::string_view /*child*/) {}
  virtual void forget(std::string_view /*session*/) {}
};

// Prompt lookup (vLLM's n-gram proposer, llama.cpp's lookup decoding): the longest suffix of the
// history of at most max_n and at least min_n tokens that occurred earlier; the tokens that followed
// its latest earlier occurrence. Costs one backward scan of the history per call.
class NgramProposer final : public Proposer {
 public:
  using Proposer::propose;
  explicit NgramProposer(int min_n = 2, int max_n = 4) : min_n_(min_n), max_n_(max_n) {}
  void propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) override;

 private:
  int min_n_, max_n_;
};

// The adaptive draft length: how many tokens the next step drafts, from the acceptance measured so
// far (a moving average of the share of drafted tokens accepted) and, where the engine reports
// the steps' times, from what a token costs with drafts against without. Where drafts are mostly
// rejected, or cost more time per token than plain decoding (a draft model nearly as slow as the
// target), it stops drafting and probes now and then — after 8 steps, then 16, 32, ... up to 256
// while the probes fail — so that a session whose drafts do not pay runs at the speed of no
// speculation. While drafting, every 32nd step is a plain one, which keeps the cost without drafts
// measured.
class DraftLength {
 public:
  explicit DraftLength(int max_draft) : max_(max_draft) {}
  int next();                             // 0: no draft this step
  void observe(int drafted, int accepted);  // after a verification
  // After each decode step of the session: tokens drafted (0: a plain step), tokens it emitted,
  // and the step's time (its drafts' included).
  void observe_time(int drafted, int emitted, double seconds);
  double acceptance() const { return rate_; }
  // Whether drafting takes less time per token than not, as measured (true until both are).
  bool pays() const {
    return spec_.tokens == 0.0 || plain_.tokens == 0.0 || spec_.seconds * plain_.tokens < plain_.seconds * spec_.tokens;
  }

 private:
  int by_rate() const;  // the draft length the acceptance suggests
  int max_;
  static constexpr int kFirstProbe = 8, kMaxProbeEvery = 256, kPlainEvery = 32;
  static constexpr double kMinRate = 0.15;
  double rate_ = 0.6;  // prior: drafts are worth trying
  int idle_ = 0;       // steps without a draft since the last probe
  int probe_every_ = kFirstProbe;
  bool timed_ = false;               // observe_time() has been called
  int64_t steps_ = 0, next_plain_ = 2;  // the second decode step is a plain one
  // Steps with drafts and without: moving sums of their seconds and of the tokens they emitted,
  // over about the last 30 of each (a ratio of sums, over a window long enough that runs of
  // rejected drafts do not stop drafts that pay on average).
  struct Cost {
    double seconds = 0.0, tokens = 0.0;
  };
  Cost spec_, plain_;
};

}  // namespace combs
