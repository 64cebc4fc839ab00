// A float64 transformer forward written independently of the runner's kernels: plain loops over
// the weights as the GGUF stores them (its own dequantization), full causal attention recomputed
// from scratch, logits for every position. It follows the config's architecture traits with the
// formulas of the papers and llama.cpp's graphs (not the runner's code): embedding scale, q/k
// RMSNorm, RoPE with its own base on windowed layers and linear / YaRN scaling (ggml's rope_yarn),
// sliding windows, score and logit softcapping, attention sinks, post-sublayer norms, SwiGLU,
// tanh-GELU or gpt-oss's clamped SwiGLU, and mixtures of experts (softmax routing, top-k, shared
// experts; gpt-oss's top-k-then-softmax routing and biases).
#pragma once

#include <algorithm>
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
  ReferenceModel(const gguf::GgufFile& file, const ModelConfig& config) : f_(file), c_(config) {
    // Frequency divisors: rope_freqs (Llama 3.1), else LongRoPE's long factors past the original
    // context, its short ones below it.
    const char* name = f_.find_tensor("rope_freqs.weight")            ? "rope_freqs.weight"
                       : c_.context_length > c_.rope_orig_context ? "rope_factors_long.weight"
                                                                    : "rope_factors_short.weight";
    if (f_.find_tensor(name)) factors_ = vec(name);
  }

  // Logits [tokens.size()][n_vocab] of the sequence `tokens` from position 0.
  std::vector<std::vector<double>> forward(const std::vector<int32_t>& tokens) const {
    const int n = static_cast<int>(tokens.size());
    const int e = c_.n_embd, hd = c_.head_dim, nq = c_.n_heads, nkv = c_.n_kv_heads;
    std::vector<std::vector<double>> x(n);
    const auto emb = matrix("token_embd.weight");
    for (int t = 0; t < n; ++t) {
      x[t] = emb[tokens[t]];
      for (double& z : x[t]) z *= c_.embed_scale;
    }
    for (int l = 0; l < c_.n_layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      const int window = c_.window(l);
      std::vector<std::vector<double>> q(n), k(n), v(n);
      std::vector<std::vector<double>> wq, wk, wv;
      if (f_.find_tensor(b + "attn_qkv.weight")) {  // one tensor: Q's rows, K's, V's
        const auto qkv = matrix(b + "attn_qkv.weight");
        wq.assign(qkv.begin(), qkv.begin() + nq * hd);
        wk.assign(qkv.begin() + nq * hd, qkv.begin() + (nq + nkv) * hd);
        wv.assign(qkv.begin() + (nq + nkv) * hd, qkv.end());
      } else {
        wq = matrix(b + "attn_q.weight"), wk = matrix(b + "attn_k.weight"), wv = matrix(b + "attn_v.weight");
      }
      const auto attn_norm = vec(b + "attn_norm.weight");
      const auto ffn_norm = vec(b + (c_.ffn_norm_post_attention ? "post_attention_norm.weight" : "ffn_norm.weight"));
      const auto sinks = c_.attn_sinks ? vec(b + "attn_sinks.weight") : std::vector<double>{};
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
        if (c_.qk_norm) {
          const auto qn = vec(b + "attn_q_norm.weight"), kn = vec(b + "attn_k_norm.weight");
          for (int h2 = 0; h2 < nq; ++h2) head_norm(&q[t][h2 * hd], qn);
          for (int h2 = 0; h2 < nkv; ++h2) head_norm(&k[t][h2 * hd], kn);
        }
        for (int h2 = 0; h2 < nq; ++h2) rope(&q[t][h2 * hd], t, window > 0);
        for (int h2 = 0; h2 < nkv; ++h2) rope(&k[t][h2 * hd], t, window > 0);
      }
      const auto wo = matrix(b + "attn_output.weight");
      for (int t = 0; t < n; ++t) {
        std::vector<double> att(nq * hd, 0.0);
        const int first = window > 0 ? std::max(0, t - window + 1) : 0;
        for (int h2 = 0; h2 < nq; ++h2) {
          const int g = h2 / (nq / nkv);
          std::vector<double> s(t + 1);
          double mx = -1e300;
          for (int p = first; p <= t; ++p) {
            double d = 0;
            for (int i = 0; i < hd; ++i) d += q[t][h2 * hd + i] * k[p][g * hd + i];
            s[p] = d * c_.attn_scale;
            if (c_.attn_softcap > 0) s[p] = c_.attn_softcap * std::tanh(s[p] / c_.attn_softcap);
            mx = std::max(mx, s[p]);
          }
          // A sink: its logit joins the softmax's denominator, with no value.
          if (!sinks.empty()) mx = std::max(mx, sinks[h2]);
          double sum = sinks.empty() ? 0.0 : std::exp(sinks[h2] - mx);
          for (int p = first; p <= t; ++p) sum += (s[p] = std::exp(s[p] - mx));
          for (int p = first; p <= t; ++p)
            for (int i = 0; i < hd; ++i) att[h2 * hd + i] += s[p] / sum * v[p][g * hd + i];
        }
        auto o = matvec(wo, att);
        if (c_.attn_out_bias) add(o, vec(b + "attn_output.bias"));
        if (c_.post_norms) o = rms_norm(o, vec(b + "post_attention_norm.weight"));
        add(x[t], o);
      }
      for (int t = 0; t < n; ++t) {
        const auto h = rms_norm(x[t], ffn_norm);
        std::vector<double> d(e, 0.0);
        if (c_.n_expert > 0) d = experts(b, h);
        if (c_.dense_ffn()) {
          const std::string suffix = c_.shared_expert ? "_shexp.weight" : ".weight";
          auto y = ffn(matrix(b + "ffn_up" + suffix), matrix(b + "ffn_down" + suffix),
                       f_.find_tensor(b + "ffn_gate" + suffix) ? matrix(b + "ffn_gate" + suffix)
                                                               : std::vector<std::vector<double>>{},
                       h);
          double scale = 1.0;
          if (c_.shared_expert) {  // gated by sigmoid(ffn_gate_inp_shexp . h)
            const auto g = vec(b + "ffn_gate_inp_shexp.weight");
            double dot = 0;
            for (int i = 0; i < e; ++i) dot += g[i] * h[i];
            scale = 1.0 / (1.0 + std::exp(-dot));
          }
          for (int i = 0; i < e; ++i) d[i] += scale * y[i];
        }
        if (c_.post_norms) d = rms_norm(d, vec(b + "post_ffw_norm.weight"));
        add(x[t], d);
      }
    }
    const auto out = matrix(f_.find_tensor("output.weight") ? "output.weight" : "token_embd.weight");
    const auto out_norm = vec("output_norm.weight");
    std::vector<std::vector<double>> logits(n);
    for (int t = 0; t < n; ++t) {
      logits[t] = matvec(out, rms_norm(x[t], out_norm));
      if (c_.final_softcap > 0) {
        for (double& z : logits[t]) z = c_.final_softcap * std::tanh(z / c_.final_softcap);
      }
    }
    (void)e;
    return logits;
  }

 private:
  // The gated FFN down(act(gate h) * up h); without a gate matrix, up holds the gate's rows then
  // the up's (phi3).
  // Biases (gpt-oss's experts): added to gate h, up h and the output where given.
  std::vector<double> ffn(std::vector<std::vector<double>> up, const std::vector<std::vector<double>>& down,
                          std::vector<std::vector<double>> gate, const std::vector<double>& h,
                          const double* gate_b = nullptr, const double* up_b = nullptr,
                          const double* down_b = nullptr) const {
    if (gate.empty()) {
      const size_t half = up.size() / 2;
      gate.assign(up.begin(), up.begin() + half);
      up.erase(up.begin(), up.begin() + half);
    }
    auto g = matvec(gate, h);
    auto u = matvec(up, h);
    for (size_t i = 0; i < g.size(); ++i) {
      if (gate_b) g[i] += gate_b[i];
      if (up_b) u[i] += up_b[i];
      const double z = g[i];
      switch (c_.activation) {
        case Activation::kGeluTanh:
          g[i] = 0.5 * z * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z))) * u[i];
          break;
        case Activation::kSwigluOai: {  // gpt-oss: alpha 1.702, limit 7
          const double x = std::min(z, 7.0), y = std::clamp(u[i], -7.0, 7.0);
          g[i] = x / (1.0 + std::exp(-1.702 * x)) * (y + 1.0);
          break;
        }
        case Activation::kSilu: g[i] = z / (1.0 + std::exp(-z)) * u[i]; break;
      }
    }
    auto y = matvec(down, g);
    if (down_b) {
      for (size_t i = 0; i < y.size(); ++i) y[i] += down_b[i];
    }
    return y;
  }

  // The mixture of experts of layer prefix b on h: softmax of the router's scores, the
  // n_expert_used most probable (ties: the lower id), their FFNs weighted by their probabilities
  // (renormalized where the config says).
  // gpt-oss (expert_softmax_chosen): the top k by the router's biased logits, weighted by the
  // softmax of those k; its experts add their biases.
  std::vector<double> experts(const std::string& b, const std::vector<double>& h) const {
    auto p = matvec(matrix(b + "ffn_gate_inp.weight"), h);
    if (c_.expert_biases) add(p, vec(b + "ffn_gate_inp.bias"));
    const std::vector<double> logits = p;
    const double mx = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& z : p) sum += (z = std::exp(z - mx));
    for (double& z : p) z /= sum;
    std::vector<int> ids(p.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int z) { return p[a] > p[z]; });
    ids.resize(c_.n_expert_used);
    double chosen = 0;
    for (int i : ids) chosen += p[i];
    double chosen_exp = 0;  // the k chosen logits' softmax denominator (gpt-oss)
    for (int i : ids) chosen_exp += std::exp(logits[i] - logits[ids[0]]);
    std::vector<std::vector<double>> gb, ub, db;
    if (c_.expert_biases) {
      gb = matrix(b + "ffn_gate_exps.bias"), ub = matrix(b + "ffn_up_exps.bias"), db = matrix(b + "ffn_down_exps.bias");
    }
    std::vector<double> y(h.size(), 0.0);
    for (int i : ids) {
      const int64_t ff = c_.n_ff_exp;
      const auto out = ffn(matrix(b + "ffn_up_exps.weight", i * ff, ff), matrix(b + "ffn_down_exps.weight", i * h.size(), h.size()),
                           matrix(b + "ffn_gate_exps.weight", i * ff, ff), h, gb.empty() ? nullptr : gb[i].data(),
                           ub.empty() ? nullptr : ub[i].data(), db.empty() ? nullptr : db[i].data());
      const double w = c_.expert_softmax_chosen ? std::exp(logits[i] - logits[ids[0]]) / chosen_exp
                       : c_.expert_weights_norm ? p[i] / chosen
                                                : p[i];
      for (size_t j = 0; j < y.size(); ++j) y[j] += w * out[j];
    }
    return y;
  }

  // Rows [first, first + count) of a stored [out, in] matrix (ggml dims [in, out], or [in, out,
  // n] with the n matrices' rows after one another), all of them by default, as doubles.
  std::vector<std::vector<double>> matrix(const std::string& name, int64_t first = 0, int64_t count = -1) const {
    const gguf::TensorInfo* t = f_.find_tensor(name);
    const int64_t in = t->dims[0];
    int64_t out = 1;
    for (size_t d = 1; d < t->dims.size(); ++d) out *= t->dims[d];
    if (count < 0) count = out - first;
    std::vector<std::vector<double>> m(count, std::vector<double>(in));
    const auto* bytes = static_cast<const uint8_t*>(t->data);
    for (int64_t o = 0; o < count; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        const int64_t idx = (first + o) * in + i;
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
  void head_norm(double* h, const std::vector<double>& w) const {
    const auto y = rms_norm(std::vector<double>(h, h + c_.head_dim), w);
    std::copy(y.begin(), y.end(), h);
  }
  // RoPE at `pos`: windowed (local) layers with their own base, unscaled (but where
  // rope_scaling_swa: gpt-oss); the others with the file's scaling. Linear: every angle times 1/factor. YaRN (ggml's rope_yarn, ext_factor 1):
  // each pair's angle blends the interpolated and the original one by a ramp between the
  // correction dimensions of beta_fast and beta_slow, and the rotated values are multiplied by
  // attn_factor * (1 + 0.1 ln factor).
  void rope(double* v, int pos, bool local) const {
    const int d = c_.rope_dim, half = d / 2;
    const double base = local ? c_.rope_freq_base_swa : c_.rope_freq_base;
    const RopeScaling scaling = local && !c_.rope_scaling_swa ? RopeScaling::kNone : c_.rope_scaling;
    const double fs = 1.0 / c_.rope_scale_factor;
    double mscale = c_.rope_attn_factor;  // llama.cpp multiplies every rotation by it
    double low = 0, high = 0;
    if (scaling == RopeScaling::kYarn) {
      auto corr = [&](double n_rot) {
        return d * std::log(double(c_.rope_orig_context) / (n_rot * 2 * M_PI)) / (2 * std::log(base));
      };
      low = std::max(0.0, std::floor(corr(c_.yarn_beta_fast)));
      high = std::min(double(d - 1), std::ceil(corr(c_.yarn_beta_slow)));
      mscale *= 1.0 + 0.1 * std::log(1.0 / fs);
    }
    for (int i = 0; i < half; ++i) {
      double theta = pos * std::pow(base, -2.0 * i / d) / (factors_.empty() ? 1.0 : factors_[i]);
      if (scaling == RopeScaling::kLinear) theta *= fs;
      if (scaling == RopeScaling::kYarn) {
        const double ramp = 1.0 - std::clamp((i - low) / std::max(0.001, high - low), 0.0, 1.0);
        theta = fs * theta * (1.0 - ramp) + theta * ramp;
      }
      const int a = c_.rope_style == RopeStyle::kAdjacent ? 2 * i : i;
      const int b = c_.rope_style == RopeStyle::kAdjacent ? 2 * i + 1 : i + half;
      const double x0 = v[a], x1 = v[b];
      v[a] = (x0 * std::cos(theta) - x1 * std::sin(theta)) * mscale;
      v[b] = (x0 * std::sin(theta) + x1 * std::cos(theta)) * mscale;
    }
  }

  const gguf::GgufFile& f_;
  ModelConfig c_;
  std::vector<double> factors_;
};

}  // namespace combs::testing
