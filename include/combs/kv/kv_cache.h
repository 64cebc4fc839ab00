// KVCache: per-sequence key/value storage that owns the attention computation
// ("attention in cache"). For each layer the model runner hands over the new q, k and v and gets
// the attention output back; the cache appends K/V, owns their layout, expands GQA heads and
// applies the causal mask (bottom-right aligned, so chunked prefill at pos > 0 works; one decoded
// token attends to everything and needs no mask).
//
// Activations are token-major, as the projections produce them:
//   q, out: [n_new, n_q_heads, head_dim]      k, v: [n_new, n_kv_heads, head_dim]
// each f32, f16 or bf16 (independently); K/V are stored in the cache's dtype; scores, softmax and
// the weighted sum accumulate in f32.
//
// Lengths are tracked per layer: attention(layer, ..., pos) requires pos == layer_len(layer), and
// seq_len() is the longest layer. A forward over all layers leaves them equal; a forward that
// fails half-way is undone with popn(n_new).
//
// Errors (never aborts):
//   INVALID_ARGUMENT     layer out of range; a shape, dtype, device or head-count mismatch
//   FAILED_PRECONDITION  pos != layer_len(layer); the layer's window reaches positions the cache
//                        released (first_held_position())
//   RESOURCE_EXHAUSTED   pos + n_new > capacity(); the page pool has too few free pages
// On error nothing changes (prepare, then apply).
//
// Thread-compatible: one thread uses a cache at a time; caches sharing a PagePool must be used
// from one thread (the engine's scheduler thread).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "combs/backend/backend.h"
#include "combs/base/status.h"
#include "combs/kv/kv_layout.h"

namespace combs {

class KVCache;
class PagePool;
class DeviceAttentionPlan;
struct SeqWork;

// Which attention computation runs. kFlash: fused, online softmax, reads K/V in place, never
// materializes the [n_new, total] scores. kManual: the reference (gather, explicit scores, mask,
// softmax, P@V).
enum class AttentionImpl : uint8_t { kFlash, kManual };

// COMBS_ATTN=flash|manual, default flash; read once per process.
AttentionImpl default_attention_impl();

// INVALID_ARGUMENT unless every field is positive and within sane bounds (layers <= 4096, heads
// <= 4096, head_dim <= 4096).
Status validate_kv_geometry(const KVGeometry& geometry);

// How a layer attends, besides its caches and tensors: the scores' scale, a sliding window (the
// query at position p sees the keys at p - window < k <= p, itself included, as llama.cpp's
// standard window; 0: every earlier key) and a softcap (scaled scores s -> softcap *
// tanh(s / softcap); 0: none). A bare float is the scale of plain causal attention. rope_mscale:
// with an attention step's RoPE, the rotated dims of q and k are multiplied by it (RoPE scaling's
// magnitude correction; only the rotated ones, as ggml and transformers do with partial rotary).
struct AttentionParams {
  float scale = 1.0f;
  int64_t window = 0;
  float softcap = 0.0f;
  float rope_mscale = 1.0f;
  // Attention sinks (gpt-oss; null: none): one logit per query head, in the caches' memory (host
  // memory for CPU caches, device memory for GPU ones: read by the kernels, as AttentionRope's
  // inv_freq), that joins every row's softmax (after scale and softcap) and adds no value:
  // out = sum_k e^{s_k} v_k / (e^{sink} + sum_k e^{s_k}).
  const float* sinks = nullptr;
  AttentionParams() = default;
  AttentionParams(float s) : scale(s) {}  // NOLINT(google-explicit-constructor): a scale is a params
  AttentionParams(float s, int64_t w, float c, float m = 1.0f) : scale(s), window(w), softcap(c), rope_mscale(m) {}
};

// One sequence of a batched attention call: its cache, the position of its first new token, and
// how many new tokens it has. The sequences' tokens lie one after another in q, k, v and out.
struct SeqAttention {
  KVCache* cache = nullptr;
  int64_t pos = 0;
  int64_t n_new = 0;
};

// Batched attention-in-cache: appends each sequence's K/V into its own cache and computes the
// attention of all sequences at once (the single-sequence KVCache::attention is the batch of one).
// q, k, v, out: as for KVCache::attention, with n_new = the sum over seqs. out == nullptr appends
// only. Checks everything before changing anything; on error no cache changes. A cache may appear
// only once per call; all caches must share one backend and geometry.
Status attention_batch(std::span<const SeqAttention> seqs, int layer, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionParams& params, const Tensor* out,
                       AttentionImpl impl = default_attention_impl());

// Internal to kv/ (attention_batch and AttentionStep): reserves the pages of pos + n_new positions
// for every sequence, all pools' bookkeeping locked together; RESOURCE_EXHAUSTED (nothing reserved)
// when a pool has too few free pages.
Status reserve_batch_pages(std::span<const SeqAttention> seqs);
// After a step whose attention ran on views of the caches (tensor parallelism: each rank's
// PagedKVShard, on its own thread) into pages that reserve_batch_pages() reserved: every layer of
// each cache now holds pos + n_new positions.
void commit_batch(std::span<const SeqAttention> seqs);

// Rotary position embedding applied by an AttentionStep as it appends (on a GPU, fused with the
// K/V write into the pages): q and k are rotated in place, each token at its own position, before
// k is stored and q attends. The same rotation as cpu::rope.
struct AttentionRope {
  const float* inv_freq = nullptr;  // rope_dim / 2 frequencies (cpu::rope_inv_freq), on the caches' device
  int rope_dim = 0;                 // the first rope_dim dims of each head rotate; even, <= head_dim
  bool adjacent_pairs = false;      // pairs (2i, 2i+1), else (i, i + rope_dim / 2)
};

// One forward's attention over every layer, with the host work done once: attention_batch() per
// layer checks the batch, reserves pages and prepares the kernels' metadata, identically for every
// layer. A step does that once (begin), each layer then only queues its kernels (run), and the
// lengths advance at the end (commit). On a device whose plan is replayable(), run()'s launches
// depend on launch_key() alone, so a runner can capture them (all layers) into a CUDA graph once
// and replay it for later steps with the same key.
// Thread-compatible; a runner keeps one and reuses it (no allocation per step once warm).
class AttentionStep {
 public:
  AttentionStep();
  ~AttentionStep();
  AttentionStep(const AttentionStep&) = delete;
  AttentionStep& operator=(const AttentionStep&) = delete;

  // Checks the batch as attention_batch does, for all layers at once (every layer of each cache
  // must hold exactly pos positions), reserves the pages of pos + n_new positions and does the
  // device's host work. With a rope (which must outlive the step), run() rotates q and k first.
  // widest_window: the widest window run() will attend with (ModelConfig::widest_window; 0: a
  // layer reads every key); a cache whose released positions (first_held_position) it would
  // reach is refused here, FAILED_PRECONDITION, rather than in run() (a replayed CUDA graph calls
  // no run(), and a tensor-parallel rank failing mid-step gives its group up).
  // Errors as attention_batch's; on error nothing changes.
  Status begin(std::span<const SeqAttention> seqs, int n_q_heads, const AttentionRope* rope = nullptr,
               AttentionImpl impl = default_attention_impl(), int64_t widest_window = 0);
  // Appends layer `layer`'s k, v and writes the attention of q into out (shapes as attention_batch;
  // out on the caches' backend, f32 on CUDA; q and k f32 with a rope, rotated in place). Lengths do
  // not move until commit(). inv_freq (with a rope): this layer's frequencies instead of the rope's
  // (rope_dim / 2 of them, on the caches' device; a model whose windowed layers rotate with their
  // own base); they must outlive the step's launches.
  Status run(int layer, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
             const Tensor& out, const float* inv_freq = nullptr);
  // Every layer of every cache now holds pos + n_new positions.
  void commit();
  // Abandons the step: lengths stay at pos; pages reserved beyond them go back to the pool.
  void cancel();
  bool active() const { return active_; }

  bool replayable() const;
  uint64_t launch_key() const;

 private:
  std::vector<SeqAttention> seqs_;
  std::vector<SeqWork> work_;
  std::unique_ptr<DeviceAttentionPlan> plan_;
  Backend* plan_backend_ = nullptr;
  AttentionRope rope_;
  std::vector<int32_t> positions_;  // each token's, for the CPU's rope
  AttentionImpl impl_ = AttentionImpl::kFlash;
  int64_t n_tokens_ = 0;
  uint64_t launch_key_ = 0;
  int n_q_heads_ = 0;
  bool active_ = false;
};

class KVCache {
 public:
  virtual ~KVCache() = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // Appends k, v at positions [pos, pos + n_new) of `layer` and writes the causal attention of q
  // over positions [0, pos + n_new) into out (allocated by the caller). scale is the logit scale,
  // usually 1/sqrt(head_dim).
  Status attention(int layer, const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos,
                   const AttentionParams& params, const Tensor& out);
  // As above, returning a new f32 output tensor on the cache's backend.
  StatusOr<Tensor> attention(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             int64_t pos, const AttentionParams& params);
  // Appends k, v without attending (restoring a cache, filling one for a benchmark).
  Status append(int layer, const Tensor& k, const Tensor& v, int64_t pos);

  int64_t seq_len() const;
  int64_t layer_len(int layer) const { return layer_len_[layer]; }
  // Drops the last min(n, seq_len()) positions of every layer; returns how many were dropped.
  virtual int64_t popn(int64_t n) = 0;
  // Drops everything (and, for a paged cache, returns its pages to the pool).
  virtual void reset() = 0;
  // Pages the sequence holds; nullopt for a cache that is not paged.
  virtual std::optional<int64_t> pages_used() const = 0;
  // Most positions this cache can hold.
  virtual int64_t capacity() const = 0;
  // Positions before this one were released (a paged cache's pages behind a sliding window,
  // PagedKVCache::release_before): their K/V are gone, and an attention that would read one fails
  // with FAILED_PRECONDITION. 0 for a cache that holds every position it has.
  virtual int64_t first_held_position() const { return 0; }

  const KVGeometry& geometry() const { return geometry_; }
  Backend& backend() const { return *backend_; }

 protected:
  KVCache(Backend& backend, const KVGeometry& geometry);

  // --- Hooks for attention_batch(): prepare (no side effects), then apply. ---
  // The page pool new pages come from; nullptr for a cache that does not page.
  virtual PagePool* pool() const { return nullptr; }
  // Pages that growing to `end` positions takes from pool() (new pages and copy-on-write copies).
  virtual int64_t pages_needed(int64_t end) const = 0;
  // Makes positions [0, end) writable: allocates and unshares pages. Called only after
  // pages_needed(end) pages were found free; cannot fail then.
  virtual void reserve(int64_t end) = 0;
  // Where layer `layer` lies.
  virtual KVLayout layout(int layer) const = 0;

  void truncate_layers(int64_t len);  // every layer_len = min(layer_len, len)
  void grow_layers_to(int64_t len);   // every layer_len = len (a fork's copy of its parent)

 private:
  friend Status attention_batch(std::span<const SeqAttention> seqs, int layer, const Tensor& q,
                                const Tensor& k, const Tensor& v, const AttentionParams& params, const Tensor* out,
                                AttentionImpl impl);
  friend class AttentionStep;
  friend Status reserve_batch_pages(std::span<const SeqAttention> seqs);
  friend void commit_batch(std::span<const SeqAttention> seqs);

  Backend* backend_;
  KVGeometry geometry_;
  std::vector<int64_t> layer_len_;
};

}  // namespace combs
