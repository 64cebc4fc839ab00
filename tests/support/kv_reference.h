// A float64 model of one sequence's KV cache and causal attention, written independently of the
// kernels: explicit loops, no paging, no blocking. K/V are kept as the cache stores them (rounded to
// its dtype) so comparisons measure the attention math, not the storage rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "combs/backend/dtype.h"

namespace combs::testing {

inline float round_to(DType t, float x) {
  switch (t) {
    case DType::kBF16: return bf16_to_f32(f32_to_bf16(x));
    case DType::kF16: return f16_to_f32(f32_to_f16(x));
    default: return x;
  }
}

class ReferenceKV {
 public:
  ReferenceKV(int n_kv, int head_dim, DType dtype) : n_kv_(n_kv), hd_(head_dim), dtype_(dtype) {}

  int64_t len() const { return static_cast<int64_t>(k_.size()) / (n_kv_ * hd_); }
  void truncate(int64_t len) {
    k_.resize(len * n_kv_ * hd_);
    v_.resize(len * n_kv_ * hd_);
  }

  // k, v: [n_new, n_kv, hd]; q: [n_new, n_q, hd]. Appends, then returns [n_new, n_q, hd].
  // window > 0: the query at position p sees keys p - window < key <= p; softcap > 0: scores
  // become softcap * tanh(score / softcap); sinks (n_q logits): each joins its head's softmax
  // denominators with no value.
  std::vector<double> attend(const std::vector<float>& q, const std::vector<float>& k,
                             const std::vector<float>& v, int n_q, double scale, int64_t window = 0,
                             double softcap = 0, const std::vector<float>* sinks = nullptr) {
    const int64_t n_new = static_cast<int64_t>(k.size()) / (n_kv_ * hd_);
    const int64_t pos = len();
    for (float x : k) k_.push_back(round_to(dtype_, x));
    for (float x : v) v_.push_back(round_to(dtype_, x));
    const int n_rep = n_q / n_kv_;
    std::vector<double> out(n_new * n_q * hd_, 0.0);
    for (int64_t i = 0; i < n_new; ++i) {
      const int64_t last = pos + i;  // causal: keys 0..pos+i
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int h = 0; h < n_q; ++h) {
        const int g = h / n_rep;
        std::vector<double> s(last + 1, 0.0);
        double mx = -INFINITY;
        for (int64_t p = first; p <= last; ++p) {
          double d = 0;
          for (int e = 0; e < hd_; ++e)
            d += double(q[(i * n_q + h) * hd_ + e]) * k_[(p * n_kv_ + g) * hd_ + e];
          s[p] = d * scale;
          if (softcap > 0) s[p] = softcap * std::tanh(s[p] / softcap);
          mx = std::max(mx, s[p]);
        }
        if (sinks) mx = std::max(mx, double((*sinks)[h]));
        double sum = sinks ? std::exp((*sinks)[h] - mx) : 0.0;
        for (int64_t p = first; p <= last; ++p) sum += (s[p] = std::exp(s[p] - mx));
        for (int64_t p = first; p <= last; ++p)
          for (int e = 0; e < hd_; ++e)
            out[(i * n_q + h) * hd_ + e] += s[p] / sum * v_[(p * n_kv_ + g) * hd_ + e];
      }
    }
    return out;
  }

 private:
  int n_kv_, hd_;
  DType dtype_;
  std::vector<double> k_, v_;  // [len, n_kv, hd]
};

}  // namespace combs::testing
