// The kernels behind attention_batch(), per device. The CPU's are built in (kv/cpu); a device
// backend's library registers its own (the CUDA ones: register_cuda_attention()), so combs_core
// needs no CUDA. Internal to kv/ and the device libraries; inputs arrive validated and with their
// pages reserved.
#pragma once

#include <cstdint>
#include <span>

#include "combs/kv/kv_cache.h"
#include "combs/kv/kv_layout.h"

namespace combs {

// One sequence of a batch: where its K/V lie, and its rows in q/k/v/out.
struct SeqWork {
  KVLayout kv;
  int64_t row = 0;    // first token row in q, k, v, out
  int64_t pos = 0;    // absolute position of that token
  int64_t n_new = 0;  // its number of new tokens
};

// Writes rows [row, row + n_new) of k and v into the caches at [pos, pos + n_new) and, when out is
// set, writes the causal attention of q (GQA, f32 accumulation) into out.
using DeviceAttentionFn = Status (*)(Backend& backend, std::span<const SeqWork> seqs, int n_kv_heads, const Tensor& q,
                                     const Tensor& k, const Tensor& v, const Tensor* out, float scale,
                                     AttentionImpl impl);

void set_device_attention(DeviceType device, DeviceAttentionFn fn);

}  // namespace combs
