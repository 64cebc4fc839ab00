// The kernels behind attention_batch() and AttentionStep, per device. The CPU's are built in
// (kv/cpu); a device backend's library registers its own (the CUDA ones: register_cuda_attention()),
// so combs_core needs no CUDA. Internal to kv/ and the device libraries; inputs arrive validated and
// with their pages reserved.
#pragma once

#include <cstdint>
#include <memory>
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

// A batch's attention on a device, in two halves: prepare() does the host work once per batch
// (the kernels' metadata: positions, page tables, tiles, splits, uploaded); launch() queues one
// layer's kernels (K/V append into the pages, attention when out is set). Between the two the
// batch's page tables and positions must not change.
class DeviceAttentionPlan {
 public:
  virtual ~DeviceAttentionPlan() = default;
  // work: the batch as seen by one layer (any: page tables and positions are the same for all).
  // rope (or null): launch() rotates q and k in place first, fused with the K/V write.
  virtual Status prepare(std::span<const SeqWork> work, int n_kv_heads, int n_q_heads, bool attend,
                         AttentionImpl impl, const AttentionRope* rope) = 0;
  // layer_work: the batch with this layer's K/V arenas (as prepared otherwise).
  virtual Status launch(std::span<const SeqWork> layer_work, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor* out, const AttentionParams& params, const float* inv_freq) = 0;
  // (q and k are not const with a rope: they are rotated in place; inv_freq: this layer's
  // frequencies instead of the prepared rope's, or null.)
  // Whether launch() queues kernels and nothing else (no uploads, no host decisions beyond the
  // key), so its launches can be captured once and replayed for any batch of the same key.
  virtual bool replayable() const = 0;
  // Equal keys (with the same caches' pool): launch() queues the same kernels with the same
  // arguments; only the uploaded metadata differs.
  virtual uint64_t key() const = 0;
};

using DeviceAttentionFactory = std::unique_ptr<DeviceAttentionPlan> (*)(Backend& backend);

void set_device_attention(DeviceType device, DeviceAttentionFactory factory);

}  // namespace combs
