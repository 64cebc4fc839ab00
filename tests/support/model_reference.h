// A float64 transformer forward written independently of the runner's kernels: plain loops over
// the weights as the GGUF stores them (its own dequantization), full causal attention recomputed
// from scratch, logits for every position.
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "combs/backend/quant.h"
#include "combs/model/gguf.h"
#include "combs/model/model.h"

namespace combs::testing {

class ReferenceModel {
 public:
  ReferenceModel(const gguf::GgufFile& file, const ModelConfig& config) : f_(file), c_(config) {}

  // Logits [tokens.size()][n_vocab] of the sequence `tokens` from position 0.
  std::vector<std::vector<double>> forward(const std::vector<int32_t>& tokens) const {
    const int n = static_cast<int>(tokens.size());
    const int e = c_.n_embd, hd = c_.head_dim, nq = c_.n_heads, nkv = c_.n_kv_heads;
    std::vector<std::vector<double>> x(n);
    const auto emb = matrix("token_embd.weight");
    for (int t = 0; t < n; ++t) x[t] = emb[tokens[t]];
    for (int l = 0; l < c_.n_layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      std::vector<std::vector<double>> q(n), k(n), v(n);
      const auto wq = matrix(b + "attn_q.weight"), wk = matrix(b + "attn_k.weight"),
                 wv = matrix(b + "attn_v.weight");
      const auto attn_norm = vec(b + "attn_norm.weight"), ffn_norm = vec(b + "ffn_norm.weight");
      for (int t = 0; t < n; ++t) {
        const auto h = rms_norm(x[t], attn_norm);
        q[t] = matvec(wq, h);
        k[t] = matvec(wk, h);
        v[t] = matvec(wv, h);
        if (c_.qkv_bias) {
          add(q[t], vec(b + "attn_q.bias"));
          add(k[t], vec(b + "attn_k.bias"));
          add(v[t], vec(b + "attn_v.bias"));
        }
        for (int h2 = 0; h2 < nq; ++h2) rope(&q[t][h2 * hd], t);
        for (int h2 = 0; h2 < nkv; ++h2) rope(&k[t][h2 * hd], t);
      }
      const auto wo = matrix(b + "attn_output.weight");
      for (int t = 0; t < n; ++t) {
        std::vector<double> att(nq * hd, 0.0);
        for (int h2 = 0; h2 < nq; ++h2) {
          const int g = h2 / (nq / nkv);
          std::vector<double> s(t + 1);
          double mx = -1e300;
          for (int p = 0; p <= t; ++p) {
            double d = 0;
            for (int i = 0; i < hd; ++i) d += q[t][h2 * hd + i] * k[p][g * hd + i];
            s[p] = d / std::sqrt(double(hd));
            mx = std::max(mx, s[p]);
          }
          double sum = 0;
          for (double& z : s) sum += (z = std::exp(z - mx));
          for (int p = 0; p <= t; ++p)
            for (int i = 0; i < hd; ++i) att[h2 * hd + i] += s[p] / sum * v[p][g * hd + i];
        }
        add(x[t], matvec(wo, att));
      }
      const auto gate = matrix(b + "ffn_gate.weight"), up = matrix(b + "ffn_up.weight"),
                 down = matrix(b + "ffn_down.weight");
      for (int t = 0; t < n; ++t) {
        const auto h = rms_norm(x[t], ffn_norm);
        auto g = matvec(gate, h);
        const auto u = matvec(up, h);
        for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        add(x[t], matvec(down, g));
      }
    }
    const auto out = matrix(f_.find_tensor("output.weight") ? "output.weight" : "token_embd.weight");
    const auto out_norm = vec("output_norm.weight");
    std::vector<std::vector<double>> logits(n);
    for (int t = 0; t < n; ++t) logits[t] = matvec(out, rms_norm(x[t], out_norm));
    (void)e;
    return logits;
  }

 private:
  // Rows of a stored [out, in] matrix (ggml dims [in, out]) as doubles.
  std::vector<std::vector<double>> matrix(const std::string& name) const {
    const gguf::TensorInfo* t = f_.find_tensor(name);
    const int64_t in = t->dims[0], out = t->dims.size() > 1 ? t->dims[1] : 1;
    std::vector<std::vector<double>> m(out, std::vector<double>(in));
    const auto* bytes = static_cast<const uint8_t*>(t->data);
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        const int64_t idx = o * in + i;
        double w = 0;
        switch (t->dtype) {
          case DType::kF32: {
            float f;
            std::memcpy(&f, bytes + idx * 4, 4);
            w = f;
            break;
          }
          case DType::kF16:
          case DType::kBF16: {
            uint16_t h;
            std::memcpy(&h, bytes + idx * 2, 2);
            w = t->dtype == DType::kF16 ? half_to_double(h) : bf16_to_double(h);
            break;
          }
          case DType::kQ8_0: {
            const uint8_t* blk = bytes + (idx / 32) * 34;
            uint16_t d;
            std::memcpy(&d, blk, 2);
            w = half_to_double(d) * static_cast<int8_t>(blk[2 + idx % 32]);
            break;
          }
          default: {  // the other block types: their dequantized values, exact as the NumPy
                      // reference's (tests/backend/quant_test.cc checks them bit for bit)
            const QuantFormat* f = quant_format(t->dtype);
            if (idx % f->block_elems == 0) {
              f->dequantize(bytes + idx / f->block_elems * f->block_bytes, block_.data(), 1);
            }
            w = block_[idx % f->block_elems];
            break;
          }
        }
        m[o][i] = w;
      }
    }
    return m;
  }
  std::vector<double> vec(const std::string& name) const { return matrix(name)[0]; }
  mutable std::vector<float> block_ = std::vector<float>(256);  // one dequantized block

  static double half_to_double(uint16_t h) {
    const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exp == 0) return sign * std::ldexp(mant, -24);
    return sign * std::ldexp(1024 + mant, exp - 25);
  }
  static double bf16_to_double(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

  static std::vector<double> matvec(const std::vector<std::vector<double>>& m,
                                    const std::vector<double>& x) {
    std::vector<double> y(m.size(), 0.0);
    for (size_t o = 0; o < m.size(); ++o)
      for (size_t i = 0; i < x.size(); ++i) y[o] += m[o][i] * x[i];
    return y;
  }
  static void add(std::vector<double>& a, const std::vector<double>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  }
  std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& w) const {
    double ss = 0;
    for (double z : x) ss += z * z;
    const double s = 1.0 / std::sqrt(ss / x.size() + c_.rms_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
    return y;
  }
  void rope(double* v, int pos) const {
    const int half = c_.rope_dim / 2;
    for (int i = 0; i < half; ++i) {
      const double theta = pos * std::pow(double(c_.rope_freq_base), -2.0 * i / c_.rope_dim);
      const int a = c_.rope_style == RopeStyle::kAdjacent ? 2 * i : i;
      const int b = c_.rope_style == RopeStyle::kAdjacent ? 2 * i + 1 : i + half;
      const double x0 = v[a], x1 = v[b];
      v[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
      v[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
    }
  }

  const gguf::GgufFile& f_;
  ModelConfig c_;
};

}  // namespace combs::testing
