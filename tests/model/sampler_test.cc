// The sampler's filters, penalties and seeding, and the stop conditions.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "combs/model/sampler.h"

using namespace combs;

namespace {
std::vector<float> logits_of(std::vector<float> v) { return v; }
}  // namespace

TEST_CASE("greedy takes the argmax and top-k 1 is greedy", "[model]") {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler greedy(p);
  auto l = logits_of({0.1f, 3.0f, -1.0f, 2.9f});
  CHECK(greedy.sample(l, {}) == 1);
  p.temperature = 1.5f;
  p.top_k = 1;
  Sampler k1(p);
  for (int i = 0; i < 20; ++i) {
    auto m = logits_of({0.1f, 3.0f, -1.0f, 2.9f});
    CHECK(k1.sample(m, {}) == 1);
  }
}

TEST_CASE("the same seed draws the same tokens and another seed differs", "[model]") {
  auto draw = [](uint64_t seed) {
    SamplingParams p;
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) {
      std::vector<float> l(50);
      for (int j = 0; j < 50; ++j) l[j] = std::sin(float(j * 7 + i));
      out.push_back(s.sample(l, {}));
    }
    return out;
  };
  CHECK(draw(42) == draw(42));
  CHECK(draw(42) != draw(43));
}

TEST_CASE("sampling follows the softmax of logits over temperature", "[model]") {
  SamplingParams p;
  p.temperature = 0.5f;
  p.seed = 9;
  Sampler s(p);
  const std::vector<float> base = {0.0f, std::log(2.0f) * 0.5f, std::log(4.0f) * 0.5f};
  // Divided by temperature 0.5 the logits are 0, log 2, log 4: probabilities 1:2:4 / 7.
  std::map<int, int> counts;
  const int n = 42000;
  for (int i = 0; i < n; ++i) {
    auto l = base;
    ++counts[s.sample(l, {})];
  }
  CHECK(counts[0] / double(n) == Approx(1.0 / 7).margin(0.01));
  CHECK(counts[1] / double(n) == Approx(2.0 / 7).margin(0.01));
  CHECK(counts[2] / double(n) == Approx(4.0 / 7).margin(0.01));
}

TEST_CASE("top-p and min-p drop the unlikely tail", "[model]") {
  // Probabilities 0.5, 0.25, 0.125, 0.125.
  const std::vector<float> base = {std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};
  SamplingParams p;
  p.top_p = 0.7f;  // keeps {0, 1}
  Sampler top_p(p);
  p.top_p = 1.0f;
  p.min_p = 0.4f;  // keeps p >= 0.2: {0, 1}
  Sampler min_p(p);
  for (int i = 0; i < 300; ++i) {
    auto a = base, b = base;
    CHECK(top_p.sample(a, {}) <= 1);
    CHECK(min_p.sample(b, {}) <= 1);
  }
}

TEST_CASE("penalties and logit bias change the logits as defined", "[model]") {
  SamplingParams p;
  p.temperature = 0.0f;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  p.logit_bias = {{3, 10.0f}};
  Sampler s(p);
  std::vector<float> l = {4.0f, -1.0f, 1.0f, 0.0f};
  const std::vector<int32_t> history = {0, 0, 1};
  CHECK(s.sample(l, history) == 3);       // the bias wins
  CHECK(l[0] == 4.0f / 2 - 0.5f - 0.5f);  // positive: divided; presence once; frequency twice
  CHECK(l[1] == -1.0f * 2 - 0.5f - 0.25f);
  CHECK(l[2] == 1.0f);  // unseen
  CHECK(l[3] == 10.0f);
  // penalty_last_n limits the window: only the last token (1) counts.
  p.logit_bias.clear();
  p.penalty_last_n = 1;
  Sampler w(p);
  std::vector<float> m = {4.0f, -1.0f, 1.0f, 0.0f};
  w.sample(m, history);
  CHECK(m[0] == 4.0f);
}

TEST_CASE("bad sampling parameters are INVALID_ARGUMENT naming the field", "[model]") {
  auto check = [](SamplingParams p, const char* field) {
    const Status s = validate(p, 10);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(field));
  };
  SamplingParams p;
  CHECK(validate(p, 10).ok());
  p.temperature = -1;
  check(p, "temperature");
  p = {};
  p.top_p = 0;
  check(p, "top_p");
  p = {};
  p.min_p = 2;
  check(p, "min_p");
  p = {};
  p.top_k = -3;
  check(p, "top_k");
  p = {};
  p.repetition_penalty = 0;
  check(p, "repetition_penalty");
  p = {};
  p.logit_bias = {{10, 1.0f}};
  check(p, "logit_bias");
}

TEST_CASE("generation stops on eos on stop sequences and at max tokens", "[model]") {
  StopCriteria stop;
  stop.max_tokens = 5;
  stop.eos_ids = {2};
  stop.stop_sequences = {{7, 8}};
  CHECK(check_stop(stop, std::vector<int32_t>{}) == FinishReason::kNone);
  CHECK(check_stop(stop, std::vector<int32_t>{4, 2}) == FinishReason::kEos);
  CHECK(check_stop(stop, std::vector<int32_t>{7, 8}) == FinishReason::kStopSequence);
  CHECK(check_stop(stop, std::vector<int32_t>{8, 7}) == FinishReason::kNone);
  CHECK(check_stop(stop, std::vector<int32_t>{1, 1, 1, 1, 1}) == FinishReason::kLength);
  stop.max_tokens = 0;
  CHECK(check_stop(stop, std::vector<int32_t>{}) == FinishReason::kLength);
}
