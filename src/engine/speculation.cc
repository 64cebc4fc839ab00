#include "combs/engine/speculation.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace combs {

Status validate(const SpeculationParams& p) {
  if (p.method != SpeculationParams::Method::kOff && p.method != SpeculationParams::Method::kNgram &&
      p.method != SpeculationParams::Method::kDraft) {
    return invalid_argument_error("speculation: unknown method");
  }
  if (p.max_draft < 1 || p.max_draft > 16) {
    return invalid_argument_error("speculation: max_draft must be in [1, 16], got " + std::to_string(p.max_draft));
  }
  return ok_status();
}

std::string_view method_name(SpeculationParams::Method m) {
  switch (m) {
    case SpeculationParams::Method::kOff: return "off";
    case SpeculationParams::Method::kNgram: return "ngram";
    case SpeculationParams::Method::kDraft: return "draft";
  }
  return "?";
}

void Proposer::propose(std::span<const DraftRequest> requests, std::vector<std::vector<int32_t>>* drafts) {
  drafts->resize(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) propose(requests[i].history, requests[i].max, &(*drafts)[i]);
}

void NgramProposer::propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) {
  out->clear();
  const auto len = static_cast<int64_t>(history.size());
  if (max < 1) return;
  for (int n = std::min<int64_t>(max_n_, len - 1); n >= min_n_; --n) {
    const std::span<const int32_t> suffix = history.subspan(static_cast<size_t>(len - n));
    // The latest earlier occurrence: ends before the suffix itself starts.
    for (int64_t at = len - n - 1; at >= 0; --at) {
      if (!std::equal(suffix.begin(), suffix.end(), history.begin() + at)) continue;
      const int64_t from = at + n, to = std::min(len, from + max);
      out->assign(history.begin() + from, history.begin() + to);
      return;
    }
  }
}

int DraftLength::by_rate() const {
  // About as many as are expected to be accepted, and one more: a run of accepted tokens is
  // geometric with mean rate / (1 - rate).
  const double expect = rate_ / std::max(1e-3, 1.0 - rate_);
  return std::clamp(static_cast<int>(std::lround(1.0 + expect)), 1, max_);
}

int DraftLength::next() {
  ++steps_;
  if (timed_ && steps_ >= next_plain_) {  // what a token costs without drafts, measured now and then
    next_plain_ = steps_ + kPlainEvery;
    return 0;
  }
  if (rate_ >= kMinRate && pays()) return by_rate();
  if (++idle_ >= probe_every_) {  // a probe; each that fails waits twice as long for the next
    idle_ = 0;
    probe_every_ = std::min(2 * probe_every_, kMaxProbeEvery);
    return rate_ >= kMinRate ? by_rate() : 1;  // (accepted but too dear: the length that was dear)
  }
  return 0;
}

void DraftLength::observe(int drafted, int accepted) {
  if (drafted <= 0) return;
  rate_ = 0.85 * rate_ + 0.15 * static_cast<double>(accepted) / static_cast<double>(drafted);
  if (accepted > 0 && pays()) probe_every_ = kFirstProbe;  // drafts pay again: probe soon if they stop
}

void DraftLength::observe_time(int drafted, int emitted, double seconds) {
  if (emitted <= 0 || !(seconds > 0.0)) return;
  timed_ = true;
  Cost& c = drafted > 0 ? spec_ : plain_;
  c.seconds = 0.97 * c.seconds + seconds;
  c.tokens = 0.97 * c.tokens + emitted;
  if (drafted > 0 && rate_ >= kMinRate && pays()) probe_every_ = kFirstProbe;  // a probe that paid
}

}  // namespace combs
