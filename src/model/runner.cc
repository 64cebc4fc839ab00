#include "combs/model/runner.h"

#include <cmath>
#include <string>

#include "combs/backend/cpu/cpu_ops.h"

namespace combs {

StatusOr<std::unique_ptr<Runner>> Runner::create(const Model& model, CpuBackend& backend,
                                                 RunnerOptions options) {
  return std::unique_ptr<Runner>(new Runner(model, backend, options));
}

void Runner::reserve(int64_t n) {
  if (n <= capacity_) return;
  const ModelConfig& c = model_->config();
  const int64_t q = int64_t{c.n_heads} * c.head_dim, kv = int64_t{c.n_kv_heads} * c.head_dim;
  x_.resize(n * c.n_embd);
  h_.resize(n * std::max<int64_t>(c.n_embd, q));
  q_.resize(n * q);
  k_.resize(n * kv);
  v_.resize(n * kv);
  att_.resize(n * q);
  gate_.resize(n * std::max(c.n_ff, c.n_ff_exp));
  up_.resize(n * std::max(c.n_ff, c.n_ff_exp));
  if (c.n_expert > 0) {
    const int64_t k = c.n_expert_used;
    router_.resize(n * c.n_expert);
    expert_ids_.resize(n * k);
    expert_weights_.resize(n * k);
    expert_order_.resize(n * k);
    expert_in_.resize(n * c.n_embd);
    expert_out_.resize(n * k * c.n_embd);
    moe_.resize(n * c.n_embd);
  }
  tokens_.resize(n);
  pos_.resize(n);
  capacity_ = n;
}

int64_t output_rows(std::span<const SequenceInput> seqs, bool all_logits) {
  int64_t n = 0;
  for (const SequenceInput& s : seqs) n += all_logits || s.all_logits ? static_cast<int64_t>(s.tokens.size()) : 1;
  return n;
}

Status check_forward_inputs(const ModelConfig& c, std::span<const SequenceInput> seqs, const Backend* backend,
                            int64_t* total) {
  *total = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SequenceInput& in = seqs[s];
    auto which = [s] { return "forward: sequence " + std::to_string(s); };
    if (in.cache == nullptr) return invalid_argument_error(which() + ": no cache");
    const KVGeometry& g = in.cache->geometry();
    if (g.num_layers != c.n_layers || g.n_kv_heads != c.n_kv_heads || g.head_dim != c.head_dim) {
      return invalid_argument_error(which() + ": the cache's geometry is not this model's");
    }
    if (backend && &in.cache->backend() != backend) {
      return invalid_argument_error(which() + ": the cache is not on this runner's " + std::string(backend->name()) +
                                    " backend");
    }
    if (in.tokens.empty()) return invalid_argument_error(which() + ": no tokens");
    for (int32_t t : in.tokens) {
      if (t < 0 || t >= c.n_vocab) {
        return invalid_argument_error(which() + ": token id " + std::to_string(t) +
                                      " is outside the vocabulary [0, " + std::to_string(c.n_vocab) + ")");
      }
    }
    *total += static_cast<int64_t>(in.tokens.size());
  }
  return ok_status();
}

Status Runner::forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options) {
  if (!options.sampling.empty()) {
    return invalid_argument_error("forward: this runner does not sample (samples_on_device() is false)");
  }
  const ModelConfig& c = model_->config();
  const Model& m = *model_;
  if (seqs.empty()) return invalid_argument_error("forward: no sequences");
  int64_t total = 0;
  COMBS_RETURN_IF_ERROR(check_forward_inputs(c, seqs, nullptr, &total));
  reserve(total);
  batch_.clear();
  int64_t row = 0;
  for (const SequenceInput& in : seqs) {
    const int64_t pos = in.cache->seq_len();
    batch_.push_back({in.cache, pos, static_cast<int64_t>(in.tokens.size())});
    for (size_t i = 0; i < in.tokens.size(); ++i, ++row) {
      tokens_[row] = in.tokens[i];
      pos_[row] = static_cast<int32_t>(pos + static_cast<int64_t>(i));
    }
  }

  const int64_t e = c.n_embd, hd = c.head_dim;
  const int64_t nq = c.n_heads, nkv = c.n_kv_heads;
  float* x = x_.data();
  float* h = h_.data();
  cpu::embedding(m.tok_embd, tokens_.data(), total, x);
  if (c.embed_scale != 1.0f) {
    for (int64_t i = 0; i < total * e; ++i) x[i] *= c.embed_scale;
  }
  const bool adjacent = c.rope_style == RopeStyle::kAdjacent;
  const Tensor q_t = Tensor::wrap(q_.data(), {total, nq, hd}, DType::kF32);
  const Tensor k_t = Tensor::wrap(k_.data(), {total, nkv, hd}, DType::kF32);
  const Tensor v_t = Tensor::wrap(v_.data(), {total, nkv, hd}, DType::kF32);
  const Tensor att_t = Tensor::wrap(att_.data(), {total, nq, hd}, DType::kF32);
  auto bias = [](const Tensor& b) { return b.defined() ? b.data_as<float>() : nullptr; };
  const cpu::MatmulPolicy policy = options_.batch_invariant ? cpu::MatmulPolicy::kBatchInvariant
                                                            : cpu::MatmulPolicy::kFastest;
  auto matmul = [&](const Tensor& w, const float* in, float* out, const float* b = nullptr) {
    cpu::matmul(*backend_, w, in, total, out, b, policy);
  };

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[l];
    cpu::rms_norm(x, w.attn_norm.data_as<float>(), h, total, e, c.rms_eps);
    matmul(w.wq, h, q_.data(), bias(w.bq));
    matmul(w.wk, h, k_.data(), bias(w.bk));
    matmul(w.wv, h, v_.data(), bias(w.bv));
    if (c.qk_norm) {  // every head of q and k, before RoPE
      cpu::rms_norm(q_.data(), w.q_norm.data_as<float>(), q_.data(), total * nq, hd, c.rms_eps);
      cpu::rms_norm(k_.data(), w.k_norm.data_as<float>(), k_.data(), total * nkv, hd, c.rms_eps);
    }
    const LayerAttention& la = m.attention(l);
    cpu::rope(q_.data(), pos_.data(), total, c.n_heads, c.head_dim, c.rope_dim, la.inv_freq, adjacent, la.rope_mscale);
    cpu::rope(k_.data(), pos_.data(), total, c.n_kv_heads, c.head_dim, c.rope_dim, la.inv_freq, adjacent, la.rope_mscale);
    AttentionParams params(la.scale, la.window, la.softcap);
    params.sinks = la.sinks;
    Status s = attention_batch(batch_, l, q_t, k_t, v_t, params, &att_t);
    if (!s.ok()) {
      // Layer 0 checks and reserves everything, so a later failure is unexpected; undo anyway.
      for (const SeqAttention& b : batch_) b.cache->popn(b.cache->seq_len() - b.pos);
      return s;
    }
    matmul(w.wo, att_.data(), h, bias(w.bo));
    if (c.post_norms) cpu::rms_norm(h, w.post_attn_norm.data_as<float>(), h, total, e, c.rms_eps);
    for (int64_t i = 0; i < total * e; ++i) x[i] += h[i];
    cpu::rms_norm(x, w.ffn_norm.data_as<float>(), h, total, e, c.rms_eps);
    if (c.n_expert > 0) experts(w, h, total, policy, moe_.data());
    if (c.dense_ffn()) {
      if (c.shared_expert) {  // the shared expert's gate, of its input
        for (int64_t t = 0; t < total; ++t) {
          const float* in = h + t * e;
          const float* g = w.shared_gate.data_as<float>();
          float d = 0.0f;
          for (int64_t i = 0; i < e; ++i) d += g[i] * in[i];
          router_[t] = 1.0f / (1.0f + std::exp(-d));
        }
      }
      matmul(w.w_gate, h, gate_.data());
      matmul(w.w_up, h, up_.data());
      activate(gate_.data(), up_.data(), total * c.n_ff);
      matmul(w.w_down, gate_.data(), h);
      if (c.shared_expert) {  // experts, then the gated shared expert
        for (int64_t t = 0; t < total; ++t)
          for (int64_t i = 0; i < e; ++i) h[t * e + i] = moe_[t * e + i] + h[t * e + i] * router_[t];
      }
    } else {
      std::copy(moe_.begin(), moe_.begin() + total * e, h);
    }
    if (c.post_norms) cpu::rms_norm(h, w.post_ffn_norm.data_as<float>(), h, total, e, c.rms_eps);
    for (int64_t i = 0; i < total * e; ++i) x[i] += h[i];
  }

  // Final norm and logits: every token of the sequences that ask for all, the last of the others.
  int64_t n_out = 0;
  {
    int64_t start = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t end = start + batch_[i].n_new;
      const int64_t from = options.all_logits || seqs[i].all_logits ? start : end - 1;
      std::copy(x + from * e, x + end * e, h + n_out * e);
      n_out += end - from;
      start = end;
    }
    cpu::rms_norm(h, m.output_norm.data_as<float>(), h, n_out, e, c.rms_eps);
  }
  cpu::matmul(*backend_, m.output, h, n_out, logits, nullptr, policy);
  if (c.final_softcap > 0.0f) cpu::softcap(logits, n_out * c.n_vocab, c.final_softcap);
  if (options.token_ids) {
    for (int64_t r = 0; r < n_out; ++r) {
      const float* row = logits + r * c.n_vocab;
      options.token_ids[r] = static_cast<int32_t>(std::max_element(row, row + c.n_vocab) - row);
    }
  }
  return ok_status();
}

void Runner::activate(float* gate, const float* up, int64_t n) const {
  switch (model_->config().activation) {
    case Activation::kSilu: return cpu::silu_mul(gate, up, n);
    case Activation::kGeluTanh: return cpu::gelu_tanh_mul(gate, up, n);
    case Activation::kSwigluOai: return cpu::swiglu_oai_mul(gate, up, n, kSwigluOaiAlpha, kSwigluOaiLimit);
  }
}

void Runner::experts(const LayerWeights& w, const float* in, int64_t n, cpu::MatmulPolicy policy, float* out) {
  const ModelConfig& c = model_->config();
  const int64_t e = c.n_embd, k = c.n_expert_used, ff = c.n_ff_exp;
  // An expert's bias row (gpt-oss), or null.
  auto bias_row = [](const Tensor& b, int x) { return b.defined() ? b.data_as<float>() + x * b.dim(1) : nullptr; };
  cpu::matmul(*backend_, w.router, in, n, router_.data(), w.router_b.defined() ? w.router_b.data_as<float>() : nullptr,
              policy);
  cpu::route_experts(router_.data(), n, c.n_expert, static_cast<int>(k), c.expert_weights_norm, expert_ids_.data(),
                     expert_weights_.data(), c.expert_softmax_chosen);
  // The (token, slot) pairs grouped by expert, tokens ascending within each: every chosen
  // expert's weights are read once for the step.
  std::vector<int64_t>& start = expert_start_;
  start.assign(static_cast<size_t>(c.n_expert) + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) ++start[static_cast<size_t>(expert_ids_[i]) + 1];
  for (size_t x = 1; x < start.size(); ++x) start[x] += start[x - 1];
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n * k; ++i) expert_order_[at[static_cast<size_t>(expert_ids_[i])]++] = i;
  }
  for (int x = 0; x < c.n_expert; ++x) {
    const int64_t first = start[static_cast<size_t>(x)], rows = start[static_cast<size_t>(x) + 1] - first;
    if (rows == 0) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = expert_order_[first + r] / k;
      std::copy(in + t * e, in + (t + 1) * e, expert_in_.data() + r * e);
    }
    cpu::matmul(*backend_, expert(w.gate_exps, x), expert_in_.data(), rows, gate_.data(), bias_row(w.gate_exps_b, x),
                policy);
    cpu::matmul(*backend_, expert(w.up_exps, x), expert_in_.data(), rows, up_.data(), bias_row(w.up_exps_b, x), policy);
    activate(gate_.data(), up_.data(), rows * ff);
    cpu::matmul(*backend_, expert(w.down_exps, x), gate_.data(), rows, expert_in_.data(), bias_row(w.down_exps_b, x),
                policy);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(expert_in_.data() + r * e, expert_in_.data() + (r + 1) * e, expert_out_.data() + expert_order_[first + r] * e);
    }
  }
  // Each token's experts summed in its own slot order (the same sums whatever shares the step).
  for (int64_t t = 0; t < n; ++t) {
    float* y = out + t * e;
    for (int64_t j = 0; j < k; ++j) {
      const float g = expert_weights_[t * k + j];
      const float* v = expert_out_.data() + (t * k + j) * e;
      if (j == 0) {
        for (int64_t i = 0; i < e; ++i) y[i] = g * v[i];
      } else {
        for (int64_t i = 0; i < e; ++i) y[i] += g * v[i];
      }
    }
  }
}

}  // namespace combs
