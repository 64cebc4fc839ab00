// attention_batch(): validation, page reservation (prepare, then apply) and the per-device
// dispatch of the attention-in-cache call. Device choice happens here and nowhere else in kv/.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

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
  if (t.dtype() == DType::kQ8_0) {
    return invalid_argument_error(std::string("attention: ") + name + " cannot be q8_0");
  }
  if (t.device() != device) {
    return invalid_argument_error(std::string("attention: ") + name +
                                  " is not on the cache's device");
  }
  return ok_status();
}

DeviceAttentionFn g_cuda_attention = nullptr;

}  // namespace

void set_device_attention(DeviceType device, DeviceAttentionFn fn) {
  if (device == DeviceType::kCuda) g_cuda_attention = fn;
}

Status attention_batch(std::span<const SeqAttention> seqs, int layer, const Tensor& q,
                       const Tensor& k, const Tensor& v, float scale, const Tensor* out,
                       AttentionImpl impl) {
  if (seqs.empty()) return ok_status();
  // ---- Check everything; change nothing. ----
  KVCache* first = seqs[0].cache;
  if (first == nullptr) return invalid_argument_error("attention: null cache in batch");
  const KVGeometry& g = first->geometry();
  Backend& backend = first->backend();
  if (layer < 0 || layer >= g.num_layers) {
    return invalid_argument_error("attention: layer " + std::to_string(layer) +
                                  " out of range [0, " + std::to_string(g.num_layers) + ")");
  }
  // Buffers reused from call to call: a decode step allocates nothing.
  thread_local std::vector<const KVCache*> seen;
  thread_local std::vector<std::pair<PagePool*, int64_t>> demand;
  thread_local std::vector<cpu::SeqWork> work;
  int64_t n_tokens = 0;
  seen.clear();
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqAttention& s = seqs[i];
    auto which = [i] { return "attention: sequence " + std::to_string(i); };
    if (s.cache == nullptr) return invalid_argument_error(which() + ": null cache");
    if (&s.cache->backend() != &backend || !(s.cache->geometry() == g)) {
      return invalid_argument_error(which() + ": cache has another backend or geometry than the first");
    }
    seen.push_back(s.cache);
    if (s.n_new < 0) return invalid_argument_error(which() + ": negative n_new");
    if (s.pos != s.cache->layer_len(layer)) {
      return failed_precondition_error(which() + ": pos " + std::to_string(s.pos) +
                                       " != cached length " +
                                       std::to_string(s.cache->layer_len(layer)) + " of layer " +
                                       std::to_string(layer));
    }
    if (s.pos + s.n_new > s.cache->capacity()) {
      return resource_exhausted_error(which() + ": " + std::to_string(s.pos + s.n_new) +
                                      " positions exceed the cache capacity of " +
                                      std::to_string(s.cache->capacity()));
    }
    n_tokens += s.n_new;
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
    return invalid_argument_error("attention: the same cache appears twice in one batch");
  }
  COMBS_RETURN_IF_ERROR(check_tokens("k", k, n_tokens, g.n_kv_heads, g.head_dim, backend.device_type()));
  COMBS_RETURN_IF_ERROR(check_tokens("v", v, n_tokens, g.n_kv_heads, g.head_dim, backend.device_type()));
  if (out != nullptr) {
    if (q.rank() != 3 || q.dim(1) < 1 || q.dim(1) % g.n_kv_heads != 0) {
      return invalid_argument_error("attention: " + describe("q", q) +
                                    " should be [n_new, n_q_heads, head_dim] with n_q_heads a "
                                    "multiple of n_kv_heads = " + std::to_string(g.n_kv_heads));
    }
    COMBS_RETURN_IF_ERROR(check_tokens("q", q, n_tokens, q.dim(1), g.head_dim, backend.device_type()));
    COMBS_RETURN_IF_ERROR(check_tokens("out", *out, n_tokens, q.dim(1), g.head_dim, backend.device_type()));
  }
  if (backend.device_type() == DeviceType::kCuda && g_cuda_attention == nullptr) {
    return unimplemented_error("attention: the CUDA kernels are not registered (register_cuda_attention())");
  }
  // Pages: every pool must have what its caches need, all together; the pools' bookkeeping stays
  // locked (in a fixed order) from the count through the reservations.
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
    if (n > pool->num_free()) {
      return resource_exhausted_error("attention: page pool exhausted: the batch needs " +
                                      std::to_string(n) + " pages, " +
                                      std::to_string(pool->num_free()) + " of " +
                                      std::to_string(pool->num_pages()) + " are free");
    }
  }

  // ---- Apply. ----
  work.clear();
  int64_t row = 0;
  for (const SeqAttention& s : seqs) {
    s.cache->reserve(s.pos + s.n_new);
    work.push_back({s.cache->layout(layer), row, s.pos, s.n_new});
    row += s.n_new;
  }
  locks.clear();
  if (backend.device_type() == DeviceType::kCuda) {
    // Lengths advance only once the kernels are queued; a launch error leaves them as they were.
    COMBS_RETURN_IF_ERROR(g_cuda_attention(backend, work, g.n_kv_heads, q, k, v, out, scale, impl));
    for (const SeqAttention& s : seqs) s.cache->layer_len_[layer] = s.pos + s.n_new;
    return ok_status();
  }
  auto& cpu_backend = static_cast<CpuBackend&>(backend);
  cpu::write_kv(cpu_backend, work, g.n_kv_heads, k, v);
  for (const SeqAttention& s : seqs) s.cache->layer_len_[layer] = s.pos + s.n_new;
  if (out != nullptr) cpu::attention(cpu_backend, work, g.n_kv_heads, q, *out, scale, impl);
  return ok_status();
}

}  // namespace combs
