// Random test data with a seed that every test logs (shown by Catch2 when a check fails).
// COMBS_TEST_SEED=<n> replays a run.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace combs::testing {

inline uint64_t test_seed() {
  if (const char* env = std::getenv("COMBS_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  return std::random_device{}();
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed), gen_(seed) {}
  uint64_t seed() const { return seed_; }
  float uniform(float lo = -1.0f, float hi = 1.0f) {
    return std::uniform_real_distribution<float>(lo, hi)(gen_);
  }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  std::vector<float> floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (float& x : v) x = uniform(lo, hi);
    return v;
  }

 private:
  uint64_t seed_;
  std::mt19937_64 gen_;
};

// n token ids drawn uniformly from [lo, hi].
inline std::vector<int32_t> random_tokens(Rng& rng, int64_t n, int32_t lo, int32_t hi) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.integer(lo, hi));
  return t;
}

inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace combs::testing
