// CPU kernels behind attention_batch(): writing K/V into a cache's layout and the two attention
// paths. Internal to kv/; inputs are validated by attention_batch().
#pragma once

#include <cstdint>
#include <span>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/kv_cache.h"
#include "combs/kv/kv_layout.h"
#include "kv/device_attention.h"

namespace combs::cpu {

using combs::SeqWork;

// Converts rows [row, row + n_new) of k and v ([T, n_kv, head_dim]) into the cache at
// positions [pos, pos + n_new).
void write_kv(CpuBackend& backend, std::span<const SeqWork> seqs, int n_kv_heads, const Tensor& k,
              const Tensor& v);

// out[row + i, h] = softmax(cap(scale * q[row + i, h] . K[lo .. pos + i])) @ V[lo .. pos + i], with
// KV head h / (n_q / n_kv) (GQA), lo = pos + i - window + 1 (0 without a window) and cap the
// params' softcap. f32 accumulation.
void attention(CpuBackend& backend, std::span<const SeqWork> seqs, int n_kv_heads,
               const Tensor& q, const Tensor& out, const AttentionParams& params, AttentionImpl impl);

}  // namespace combs::cpu
