#include "combs/kv/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace combs {

AttentionImpl default_attention_impl() {
  static const AttentionImpl impl = [] {
    const char* env = std::getenv("COMBS_ATTN");
    return env != nullptr && std::strcmp(env, "manual") == 0 ? AttentionImpl::kManual
                                                             : AttentionImpl::kFlash;
  }();
  return impl;
}

Status validate_kv_geometry(const KVGeometry& g) {
  auto bad = [](const char* field, int value, int max) {
    return invalid_argument_error(std::string("KV geometry: ") + field + " must be in [1, " +
                                  std::to_string(max) + "], got " + std::to_string(value));
  };
  if (g.num_layers < 1 || g.num_layers > 4096) return bad("num_layers", g.num_layers, 4096);
  if (g.n_kv_heads < 1 || g.n_kv_heads > 4096) return bad("n_kv_heads", g.n_kv_heads, 4096);
  if (g.head_dim < 1 || g.head_dim > 4096) return bad("head_dim", g.head_dim, 4096);
  if (is_block_quant(g.dtype)) {
    return invalid_argument_error("KV geometry: K/V cannot be stored as " + std::string(dtype_name(g.dtype)) +
                                  " (f32, f16 or bf16)");
  }
  return ok_status();
}

KVCache::KVCache(Backend& backend, const KVGeometry& geometry)
    : backend_(&backend), geometry_(geometry), layer_len_(geometry.num_layers, 0) {}

int64_t KVCache::seq_len() const {
  return layer_len_.empty() ? 0 : *std::max_element(layer_len_.begin(), layer_len_.end());
}

void KVCache::truncate_layers(int64_t len) {
  for (int64_t& l : layer_len_) l = std::min(l, len);
}

void KVCache::grow_layers_to(int64_t len) { std::fill(layer_len_.begin(), layer_len_.end(), len); }

Status KVCache::attention(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                          int64_t pos, const AttentionParams& params, const Tensor& out) {
  if (k.rank() < 1) return invalid_argument_error("attention: k must be [n_new, n_kv_heads, head_dim]");
  const SeqAttention seq{this, pos, k.dim(0)};
  return attention_batch({&seq, 1}, layer, q, k, v, params, &out);
}

StatusOr<Tensor> KVCache::attention(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                                    int64_t pos, const AttentionParams& params) {
  if (q.rank() != 3) {
    return invalid_argument_error("attention: q must be [n_new, n_q_heads, head_dim], got " +
                                  q.shape().to_string());
  }
  COMBS_ASSIGN_OR_RETURN(Tensor out, backend_->alloc(q.shape(), DType::kF32));
  COMBS_RETURN_IF_ERROR(attention(layer, q, k, v, pos, params, out));
  return out;
}

Status KVCache::append(int layer, const Tensor& k, const Tensor& v, int64_t pos) {
  if (k.rank() < 1) return invalid_argument_error("append: k must be [n_new, n_kv_heads, head_dim]");
  const SeqAttention seq{this, pos, k.dim(0)};
  return attention_batch({&seq, 1}, layer, Tensor(), k, v, AttentionParams(), nullptr);
}

}  // namespace combs
