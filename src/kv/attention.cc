// attention_batch() and AttentionStep: validation, page reservation (prepare, then apply) and the
// per-device dispatch of the attention-in-cache call. Device choice happens here and nowhere else
// in kv/.
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "combs/backend/cpu/cpu_ops.h"
#include "combs/base/hash.h"
#include "combs/kv/kv_cache.h"
#include "combs/kv/page_pool.h"
#include "kv/cpu/attention_cpu.h"
#include "kv/device_attention.h"

namespace combs {
namespace {

std::string describe(const char* name, const Tensor& t) {
  return std::string(name) + " " + std::string(dtype_name(t.dtype())) + t.shape().to_string();
}

Status check_tokens(const char* name, const Tensor& t, int64_t n_tokens, int64_t heads,
                    int64_t head_dim, DeviceType device) {
  if (!t.defined()) return invalid_argument_error(std::string("attention: ") + name + " is missing");
  if (t.rank() != 3 || t.dim(0) != n_tokens || t.dim(1) != heads || t.dim(2) != head_dim) {
    return invalid_argument_error("attention: " + describe(name, t) + " should be [" +
                                  std::to_string(n_tokens) + ", " + std::to_string(heads) + ", " +
                                  std::to_string(head_dim) + "]");
  }
  if (is_block_quant(t.dtype())) {
    return invalid_argument_error(std::string("attention: ") + name + " cannot be " + std::string(dtype_name(t.dtype())));
  }
  if (t.device() != device) {
    return invalid_argument_error(std::string("attention: ") + name +
                                  " is not on the cache's device");
  }
  return ok_status();
}

DeviceAttentionFactory g_cuda_attention = nullptr;

Status check_params(const AttentionParams& p) {
  if (!std::isfinite(p.scale) || p.scale <= 0.0f) return invalid_argument_error("attention: the scale must be positive and finite");
  if (p.window < 0) return invalid_argument_error("attention: negative window " + std::to_string(p.window));
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f) return invalid_argument_error("attention: the softcap must be >= 0 and finite");
  if (!std::isfinite(p.rope_mscale) || p.rope_mscale <= 0.0f) return invalid_argument_error("attention: the rope magnitude must be positive and finite");
  return ok_status();
}

// The checks of a batch against its caches (everything but the tensors). layer >= 0: that layer
// must hold pos positions; layer < 0: every layer must. On success *n_tokens is the new tokens.
Status check_batch(std::span<const SeqAttention> seqs, int layer, int64_t* n_tokens) {
  KVCache* first = seqs[0].cache;
  if (first == nullptr) return invalid_argument_error("attention: null cache in batch");
  const KVGeometry& g = first->geometry();
  Backend& backend = first->backend();
  if (layer >= g.num_layers) {
    return invalid_argument_error("attention: layer " + std::to_string(layer) + " out of range [0, " +
                                  std::to_string(g.num_layers) + ")");
  }
  thread_local std::vector<const KVCache*> seen;
  seen.clear();
  *n_tokens = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqAttention& s = seqs[i];
    auto which = [i] { return "attention: sequence " + std::to_string(i); };
    if (s.cache == nullptr) return invalid_argument_error(which() + ": null cache");
    if (&s.cache->backend() != &backend || !(s.cache->geometry() == g)) {
      return invalid_argument_error(which() + ": cache has another backend or geometry than the first");
    }
    seen.push_back(s.cache);
    if (s.n_new < 0) return invalid_argument_error(which() + ": negative n_new");
    for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? g.num_layers : layer + 1); ++l) {
      if (s.pos != s.cache->layer_len(l)) {
        return failed_precondition_error(which() + ": pos " + std::to_string(s.pos) + " != cached length " +
                                         std::to_string(s.cache->layer_len(l)) + " of layer " + std::to_string(l));
      }
    }
    if (s.pos + s.n_new > s.cache->capacity()) {
      return resource_exhausted_error(which() + ": " + std::to_string(s.pos + s.n_new) +
                                      " positions exceed the cache capacity of " + std::to_string(s.cache->capacity()));
    }
    *n_tokens += s.n_new;
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
    return invalid_argument_error("attention: the same cache appears twice in one batch");
  }
  if (backend.device_type() == DeviceType::kCuda && g_cuda_attention == nullptr) {
    return unimplemented_error("attention: the CUDA kernels are not registered (register_cuda_attention())");
  }
  return ok_status();
}

// A layer with this window reads each sequence's keys from max(0, pos - window + 1) on (every
// key without one): none of them may be released. layer < 0: the widest of a step's layers.
Status check_window(std::span<const SeqAttention> seqs, int layer, int64_t window) {
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqAttention& s = seqs[i];
    const int64_t held = s.cache->first_held_position();
    if (held == 0 || s.n_new == 0) continue;
    const int64_t first = window > 0 ? std::max<int64_t>(0, s.pos - window + 1) : 0;
    if (first < held) {
      return failed_precondition_error("attention: sequence " + std::to_string(i) + ": " +
                                       (layer < 0 ? std::string("a layer") : "layer " + std::to_string(layer)) +
                                       " reads position " + std::to_string(first) + ", but the cache released the positions before " +
                                       std::to_string(held) + " (behind a sliding window): rebuild it");
    }
  }
  return ok_status();
}

// The tensors of a batch of n_tokens: k and v always; q and out when out is set.
Status check_tensors(const KVGeometry& g, DeviceType device, int64_t n_tokens, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor* out) {
  COMBS_RETURN_IF_ERROR(check_tokens("k", k, n_tokens, g.n_kv_heads, g.head_dim, device));
  COMBS_RETURN_IF_ERROR(check_tokens("v", v, n_tokens, g.n_kv_heads, g.head_dim, device));
  if (out != nullptr) {
    if (q.rank() != 3 || q.dim(1) < 1 || q.dim(1) % g.n_kv_heads != 0) {
      return invalid_argument_error("attention: " + describe("q", q) +
                                    " should be [n_new, n_q_heads, head_dim] with n_q_heads a "
                                    "multiple of n_kv_heads = " + std::to_string(g.n_kv_heads));
    }
    COMBS_RETURN_IF_ERROR(check_tokens("q", q, n_tokens, q.dim(1), g.head_dim, device));
    COMBS_RETURN_IF_ERROR(check_tokens("out", *out, n_tokens, q.dim(1), g.head_dim, device));
  }
  return ok_status();
}

}  // namespace

// Pages: every pool must have what its caches need, all together; the pools' bookkeeping stays
// locked (in a fixed order) from the count through the reservations. Cannot half-fail.
Status reserve_batch_pages(std::span<const SeqAttention> seqs) {
  thread_local std::vector<std::pair<PagePool*, int64_t>> demand;
  demand.clear();
  for (const SeqAttention& s : seqs) {
    PagePool* pool = s.cache->pool();
    if (pool && std::find_if(demand.begin(), demand.end(), [&](auto& d) { return d.first == pool; }) == demand.end()) {
      demand.emplace_back(pool, 0);
    }
  }
  std::sort(demand.begin(), demand.end());
  std::vector<std::unique_lock<std::recursive_mutex>> locks;
  for (const auto& d : demand) locks.push_back(d.first->bookkeeping_lock());
  for (const SeqAttention& s : seqs) {
    if (PagePool* pool = s.cache->pool()) {
      std::find_if(demand.begin(), demand.end(), [&](auto& d) { return d.first == pool; })->second +=
          s.cache->pages_needed(s.pos + s.n_new);
    }
  }
  for (const auto& [pool, n] : demand) {
    if (n > pool->num_available()) {
      return resource_exhausted_error("attention: page pool exhausted: the batch needs " + std::to_string(n) +
                                      " pages, " + std::to_string(pool->num_available()) + " of " +
                                      std::to_string(pool->num_pages()) + " are free or reclaimable");
    }
  }
  for (const SeqAttention& s : seqs) s.cache->reserve(s.pos + s.n_new);
  return ok_status();
}

void commit_batch(std::span<const SeqAttention> seqs) {
  for (const SeqAttention& s : seqs) s.cache->grow_layers_to(s.pos + s.n_new);
}

void set_device_attention(DeviceType device, DeviceAttentionFactory factory) {
  if (device == DeviceType::kCuda) g_cuda_attention = factory;
}

Status attention_batch(std::span<const SeqAttention> seqs, int layer, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionParams& params, const Tensor* out,
                       AttentionImpl impl) {
  if (seqs.empty()) return ok_status();
  // ---- Check everything; change nothing. ----
  if (layer < 0) return invalid_argument_error("attention: layer " + std::to_string(layer) + " out of range");
  int64_t n_tokens = 0;
  COMBS_RETURN_IF_ERROR(check_batch(seqs, layer, &n_tokens));
  const KVGeometry& g = seqs[0].cache->geometry();
  Backend& backend = seqs[0].cache->backend();
  COMBS_RETURN_IF_ERROR(check_params(params));
  COMBS_RETURN_IF_ERROR(check_tensors(g, backend.device_type(), n_tokens, q, k, v, out));
  if (out != nullptr) COMBS_RETURN_IF_ERROR(check_window(seqs, layer, params.window));
  COMBS_RETURN_IF_ERROR(reserve_batch_pages(seqs));

  // ---- Apply. ----
  thread_local std::vector<SeqWork> work;
  work.clear();
  int64_t row = 0;
  for (const SeqAttention& s : seqs) {
    work.push_back({s.cache->layout(layer), row, s.pos, s.n_new});
    row += s.n_new;
  }
  if (backend.device_type() == DeviceType::kCuda) {
    // Lengths advance only once the kernels are queued; a launch error leaves them as they were.
    std::unique_ptr<DeviceAttentionPlan> plan = g_cuda_attention(backend);
    COMBS_RETURN_IF_ERROR(plan->prepare(work, g.n_kv_heads, out ? static_cast<int>(q.dim(1)) : g.n_kv_heads,
                                        out != nullptr, impl, nullptr));
    COMBS_RETURN_IF_ERROR(plan->launch(work, q, k, v, out, params, nullptr));
    for (const SeqAttention& s : seqs) s.cache->layer_len_[layer] = s.pos + s.n_new;
    return ok_status();
  }
  auto& cpu_backend = static_cast<CpuBackend&>(backend);
  cpu::write_kv(cpu_backend, work, g.n_kv_heads, k, v);
  for (const SeqAttention& s : seqs) s.cache->layer_len_[layer] = s.pos + s.n_new;
  if (out != nullptr) cpu::attention(cpu_backend, work, g.n_kv_heads, q, *out, params, impl);
  return ok_status();
}

// ---- AttentionStep ----

AttentionStep::AttentionStep() = default;
AttentionStep::~AttentionStep() {
  if (active_) cancel();
}

Status AttentionStep::begin(std::span<const SeqAttention> seqs, int n_q_heads, const AttentionRope* rope,
                            AttentionImpl impl, int64_t widest_window) {
  if (active_) return failed_precondition_error("attention step: begin() before the last step's commit() or cancel()");
  if (seqs.empty()) return invalid_argument_error("attention step: empty batch");
  int64_t n_tokens = 0;
  COMBS_RETURN_IF_ERROR(check_batch(seqs, -1, &n_tokens));
  if (widest_window < 0) return invalid_argument_error("attention step: negative window " + std::to_string(widest_window));
  COMBS_RETURN_IF_ERROR(check_window(seqs, -1, widest_window));
  const KVGeometry& g = seqs[0].cache->geometry();
  if (n_q_heads < 1 || n_q_heads % g.n_kv_heads != 0) {
    return invalid_argument_error("attention step: " + std::to_string(n_q_heads) +
                                  " query heads is not a multiple of n_kv_heads = " + std::to_string(g.n_kv_heads));
  }
  if (rope && (rope->inv_freq == nullptr || rope->rope_dim < 2 || rope->rope_dim % 2 != 0 ||
               rope->rope_dim > g.head_dim)) {
    return invalid_argument_error("attention step: rope_dim " + std::to_string(rope ? rope->rope_dim : 0) +
                                  " must be even and in [2, head_dim = " + std::to_string(g.head_dim) +
                                  "], with frequencies");
  }
  Backend& backend = seqs[0].cache->backend();
  COMBS_RETURN_IF_ERROR(reserve_batch_pages(seqs));
  rope_ = rope ? *rope : AttentionRope{};
  seqs_.assign(seqs.begin(), seqs.end());
  work_.clear();
  int64_t row = 0;
  for (const SeqAttention& s : seqs_) {
    work_.push_back({s.cache->layout(0), row, s.pos, s.n_new});
    row += s.n_new;
  }
  n_tokens_ = n_tokens;
  n_q_heads_ = n_q_heads;
  impl_ = impl;
  active_ = true;
  if (backend.device_type() == DeviceType::kCuda) {
    if (!plan_ || plan_backend_ != &backend) {
      plan_ = g_cuda_attention(backend);
      plan_backend_ = &backend;
    }
    if (Status st = plan_->prepare(work_, g.n_kv_heads, n_q_heads, true, impl, rope ? &rope_ : nullptr); !st.ok()) {
      cancel();
      return st;
    }
    // The key: the plan's, and every layer's arenas (shared by the batch when replayable).
    launch_key_ = plan_->key();
    for (int l = 0; l < g.num_layers && plan_->replayable(); ++l) {
      const KVLayout kv = seqs_[0].cache->layout(l);
      for (const void* p : {kv.k, kv.v}) launch_key_ = hash_mix(launch_key_, reinterpret_cast<uintptr_t>(p));
    }
  }
  return ok_status();
}

Status AttentionStep::run(int layer, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                          const Tensor& out, const float* inv_freq) {
  if (!active_) return failed_precondition_error("attention step: run() outside begin() .. commit()");
  COMBS_RETURN_IF_ERROR(check_params(params));
  if (inv_freq && !rope_.inv_freq) return invalid_argument_error("attention step: layer frequencies without a rope");
  const KVGeometry& g = seqs_[0].cache->geometry();
  if (layer < 0 || layer >= g.num_layers) {
    return invalid_argument_error("attention step: layer " + std::to_string(layer) + " out of range [0, " +
                                  std::to_string(g.num_layers) + ")");
  }
  Backend& backend = seqs_[0].cache->backend();
  COMBS_RETURN_IF_ERROR(check_tensors(g, backend.device_type(), n_tokens_, q, k, v, &out));
  if (q.dim(1) != n_q_heads_) {
    return invalid_argument_error("attention step: q has " + std::to_string(q.dim(1)) + " heads, begin() said " +
                                  std::to_string(n_q_heads_));
  }
  if (rope_.inv_freq && (q.dtype() != DType::kF32 || k.dtype() != DType::kF32)) {
    return invalid_argument_error("attention step: q and k must be f32 to be rotated");
  }
  COMBS_RETURN_IF_ERROR(check_window(seqs_, layer, params.window));
  for (size_t i = 0; i < seqs_.size(); ++i) work_[i].kv = seqs_[i].cache->layout(layer);
  if (backend.device_type() == DeviceType::kCuda) return plan_->launch(work_, q, k, v, &out, params, inv_freq);
  const float* freqs = inv_freq ? inv_freq : rope_.inv_freq;
  auto& cpu_backend = static_cast<CpuBackend&>(backend);
  if (rope_.inv_freq) {
    positions_.clear();
    for (const SeqWork& w : work_)
      for (int64_t i = 0; i < w.n_new; ++i) positions_.push_back(static_cast<int32_t>(w.pos + i));
    cpu::rope(q.data_as<float>(), positions_.data(), n_tokens_, n_q_heads_, g.head_dim, rope_.rope_dim, freqs,
              rope_.adjacent_pairs, params.rope_mscale);
    cpu::rope(k.data_as<float>(), positions_.data(), n_tokens_, g.n_kv_heads, g.head_dim, rope_.rope_dim, freqs,
              rope_.adjacent_pairs, params.rope_mscale);
  }
  cpu::write_kv(cpu_backend, work_, g.n_kv_heads, k, v);
  cpu::attention(cpu_backend, work_, g.n_kv_heads, q, out, params, impl_);
  return ok_status();
}

void AttentionStep::commit() {
  if (!active_) return;
  for (const SeqAttention& s : seqs_) s.cache->grow_layers_to(s.pos + s.n_new);
  active_ = false;
}

void AttentionStep::cancel() {
  if (!active_) return;
  for (const SeqAttention& s : seqs_) s.cache->popn(0);  // lengths stay; pages past them are released
  active_ = false;
}

bool AttentionStep::replayable() const { return active_ && plan_ && plan_->replayable(); }
uint64_t AttentionStep::launch_key() const { return replayable() ? launch_key_ : 0; }

}  // namespace combs
