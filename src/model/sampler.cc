#include "combs/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace combs {

Status validate(const SamplingParams& p, int n_vocab) {
  auto bad = [](const std::string& field, const std::string& why) {
    return invalid_argument_error("sampling: " + field + " " + why);
  };
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) return bad("temperature", "must be >= 0");
  if (p.top_k < 0) return bad("top_k", "must be >= 0");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return bad("top_p", "must be in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return bad("min_p", "must be in [0, 1]");
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty)) {
    return bad("repetition_penalty", "must be > 0");
  }
  if (!std::isfinite(p.presence_penalty)) return bad("presence_penalty", "must be finite");
  if (!std::isfinite(p.frequency_penalty)) return bad("frequency_penalty", "must be finite");
  if (p.penalty_last_n < -1) return bad("penalty_last_n", "must be >= -1");
  for (const auto& [id, b] : p.logit_bias) {
    if (id < 0 || id >= n_vocab) {
      return bad("logit_bias", "token id " + std::to_string(id) + " is outside the vocabulary");
    }
    if (std::isnan(b)) return bad("logit_bias", "value for token " + std::to_string(id) + " is NaN");
  }
  return ok_status();
}

Sampler::Sampler(SamplingParams params)
    : params_(std::move(params)), state_(params_.seed ^ 0x9e3779b97f4a7c15ull) {}

double Sampler::uniform() {
  // splitmix64: small, fast, and the same on every platform.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

void Sampler::penalized(std::span<const int32_t> history, int n, std::vector<std::pair<int32_t, int32_t>>* out) {
  const SamplingParams& p = params_;
  out->clear();
  if (p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f) return;
  size_t window = history.size();
  if (p.penalty_last_n >= 0) window = std::min(window, static_cast<size_t>(p.penalty_last_n));
  if (counts_.size() < static_cast<size_t>(n)) counts_.resize(n, 0);
  const auto recent = history.subspan(history.size() - window);
  for (int32_t t : recent) {
    if (t >= 0 && t < n) ++counts_[t];
  }
  for (int32_t t : recent) {  // each distinct token once: its count is reset after use
    if (t < 0 || t >= n || counts_[t] == 0) continue;
    out->emplace_back(t, counts_[t]);
    counts_[t] = 0;
  }
}

void Sampler::adjust(std::span<float> logits, std::span<const int32_t> history) {
  const SamplingParams& p = params_;
  const int n = static_cast<int>(logits.size());
  for (const auto& [id, b] : p.logit_bias) logits[id] += b;
  penalized(history, n, &penalized_);
  for (const auto& [t, count] : penalized_) {
    float& l = logits[t];
    l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    l -= p.presence_penalty + p.frequency_penalty * static_cast<float>(count);
  }
}

double Sampler::keep_candidates(std::span<const float> logits) {
  const SamplingParams& p = params_;
  const int n = static_cast<int>(logits.size());
  candidates_.resize(n);
  for (int i = 0; i < n; ++i) candidates_[i] = {logits[i] / p.temperature, i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = candidates_.size();
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < keep) {
    keep = p.top_k;
    std::nth_element(candidates_.begin(), candidates_.begin() + keep - 1, candidates_.end(), by_logit);
  }
  candidates_.resize(keep);
  std::sort(candidates_.begin(), candidates_.end(), by_logit);
  const float max_logit = candidates_[0].first;
  double sum = 0.0;
  for (auto& c : candidates_) sum += (c.first = std::exp(c.first - max_logit));
  for (auto& c : candidates_) c.first = static_cast<float>(c.first / sum);
  if (p.min_p > 0.0f) {
    const float floor = p.min_p * candidates_[0].first;
    while (candidates_.size() > 1 && candidates_.back().first < floor) candidates_.pop_back();
  }
  if (p.top_p < 1.0f) {
    double mass = 0.0;
    size_t i = 0;
    while (i < candidates_.size() && mass < p.top_p) mass += candidates_[i++].first;
    candidates_.resize(std::max<size_t>(i, 1));
  }
  double total = 0.0;
  for (const auto& c : candidates_) total += c.first;
  return total;
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  adjust(logits, history);
  if (params_.temperature == 0.0f) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const double total = keep_candidates(logits);
  double r = uniform() * total;
  for (const auto& c : candidates_) {
    r -= c.first;
    if (r < 0.0) return c.second;
  }
  return candidates_.back().second;
}

int32_t Sampler::verify(std::span<float> logits, std::span<const int32_t> history, int32_t draft, bool* accepted) {
  adjust(logits, history);
  if (params_.temperature == 0.0f) {
    const auto t = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    *accepted = t == draft;
    return t;
  }
  const double total = keep_candidates(logits);
  double mass = 0.0;  // the draft's share of the kept candidates
  for (const auto& c : candidates_)
    if (c.second == draft) mass = c.first;
  *accepted = uniform() * total < mass;
  if (*accepted) return draft;
  // The rest of the distribution, renormalized without the draft (it has mass < total here).
  double r = uniform() * (total - mass);
  int32_t last = -1;
  for (const auto& c : candidates_) {
    if (c.second == draft) continue;
    last = c.second;
    r -= c.first;
    if (r < 0.0) return c.second;
  }
  return last;
}

std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kEos: return "eos";
    case FinishReason::kStopSequence: return "stop";
  }
  return "none";
}

FinishReason check_stop(const StopCriteria& stop, std::span<const int32_t> generated) {
  if (!generated.empty()) {
    if (std::find(stop.eos_ids.begin(), stop.eos_ids.end(), generated.back()) != stop.eos_ids.end()) {
      return FinishReason::kEos;
    }
    for (const auto& seq : stop.stop_sequences) {
      if (!seq.empty() && seq.size() <= generated.size() &&
          std::equal(seq.rbegin(), seq.rend(), generated.rbegin())) {
        return FinishReason::kStopSequence;
      }
    }
  }
  if (static_cast<int>(generated.size()) >= stop.max_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

}  // namespace combs
