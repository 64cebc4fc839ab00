// CUDA kernels of attention_batch(): K/V append into the pages, and paged attention that reads
// K/V where they lie (no gather) for ragged batches.
//
// Attention for f16/bf16 caches runs on tensor cores: flash_kernel (FlashAttention-2 style) for
// prefill tiles, and for decode tokens where decode_swap_kernel (head_dim 64 and 128, groups of at
// most 8 query heads: the common shapes) does not take them; f32 caches use a CUDA-core kernel
// (attention_kernel). All serve a whole GQA group per block, so each K/V row is read once per group, with the online
// softmax in f32 (exp2, log2e folded into the scale). Decode splits long contexts across blocks
// (split-KV) and merges them by log-sum-exp: on tensor cores with at most 8 splits in the last
// split's block to finish (merge_in_last_split), else in a second kernel (merge_splits_kernel),
// which lets the next one (the output projection) launch once the attention is done. COMBS_ATTN=manual runs a
// simple reference instead (scores in global memory, softmax, P@V).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/async_copy.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/float_convert.h"
#include "backend/cuda/kernel_smem.h"
#include "backend/cuda/mma.h"
#include "backend/cuda/pdl.h"
#include "combs/base/hash.h"
#include "combs/backend/cuda/cuda_backend.h"
#include "combs/kv/cuda/cuda_attention.h"
#include "kv/device_attention.h"

namespace combs {
namespace {

constexpr int kWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;

// One sequence as the kernels see it (uploaded per call).
struct SeqDev {
  const void* k;
  const void* v;
  int64_t page_stride, head_stride;  // elements
  int32_t page_size, table_off;      // table_off: its page table in the tables array
  int32_t row, pos, n_new, pad;  // pad: log2(page_size) when a power of two, else -1
  int32_t splits, unused;        // splits: how many of the grid's splits this sequence's keys use
};

// What every kernel gets: the sequences, each token's sequence, the page tables, and the layer's
// K/V arenas when all sequences share them (then SeqDev::k/v are null and the uploaded metadata
// is the same for every layer of a forward: it is uploaded once, and the launches of a layer
// differ from another's only in k and v).
struct Meta {
  const SeqDev* seqs;
  const int32_t* tok_seq;
  const int32_t* tables;
  const void* k;
  const void* v;
  int prefill_min;  // tokens of sequences with at least this many new tokens go to prefill tiles
};

using cuda::from_f32;
using cuda::to_f32;

// Position p's page in the sequence's table and slot in that page (positions fit in 32 bits:
// checked on the host; pad: log2(page_size), or -1).
__device__ inline int kv_page(const SeqDev& s, int p) { return s.pad >= 0 ? p >> s.pad : p / s.page_size; }
__device__ inline int kv_slot(const SeqDev& s, int p) { return s.pad >= 0 ? p & (s.page_size - 1) : p % s.page_size; }
// Where position p's head lies in the arena, given its page's number in the pool.
__device__ inline int64_t kv_offset_in(const SeqDev& s, int32_t page, int p, int head, int hd) {
  return static_cast<int64_t>(page) * s.page_stride + head * s.head_stride + static_cast<int64_t>(kv_slot(s, p)) * hd;
}
__device__ inline int64_t kv_offset(const SeqDev& s, const int32_t* tables, int64_t p, int head, int hd) {
  const int pi = static_cast<int>(p);
  return kv_offset_in(s, tables[s.table_off + kv_page(s, pi)], pi, head, hd);
}

// A layer's AttentionParams beyond the scale, as the kernels take them: the window (0: none), the
// softcap in exp2 units (softcap * log2e; 0: none) and the sinks (device memory, a logit per query
// head; null: none).
struct LayerDev {
  int window;
  float cap_log2;
  const float* sinks;
  // The first key a query at position p sees.
  __device__ int64_t first_key(int64_t p) const { return window > 0 && p >= window ? p - window + 1 : 0; }
  // A score in exp2 units through the softcap.
  __device__ float cap(float x) const { return cap_log2 > 0.0f ? cap_log2 * tanhf(x / cap_log2) : x; }
  // Query head h's sink in a softmax's denominator whose largest score is m (exp2 units, as the
  // row's sum of exp2(s - m)); 0 without sinks. A sink far above m gives inf: the row's output 0.
  __device__ float sink_term(int h, float m) const { return sinks ? exp2f(sinks[h] * kLog2e - m) : 0.0f; }
};

// The rotation of an AttentionRope, as the kernels take it (inv_freq null: none).
struct RopeDev {
  const float* inv_freq;
  int rope_dim;
  bool adjacent;
  float mscale = 1.0f;  // the rotated dims' magnitude (AttentionParams::rope_mscale)
};

// grid (tokens, n_kv); block: head_dim threads (rounded up to a warp). Writes token t's K/V head h
// into its page; with a rope, first rotates that K head and, in place, the G query heads of its
// GQA group, as cpu::rope does (the angle in f32, its cos/sin in f64): RoPE fused with the append.
template <typename T>
__global__ void write_kv_kernel(const Meta M, float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, int n_kv, int n_q, int hd, RopeDev rope) {
  const int t = blockIdx.x, h = blockIdx.y;
  const SeqDev s = M.seqs[M.tok_seq[t]];
  const int64_t p = s.pos + (t - s.row);
  const int64_t off = kv_offset(s, M.tables, p, h, hd);
  const int64_t src = (static_cast<int64_t>(t) * n_kv + h) * hd;
  T* K = static_cast<T*>(const_cast<void*>(s.k ? s.k : M.k)) + off;
  T* V = static_cast<T*>(const_cast<void*>(s.v ? s.v : M.v)) + off;
  // The rotation's cos / sin depend on the position alone: computed before the wait (a thread has
  // at most one pair: blockDim >= head_dim >= rope_dim).
  const int half = rope.inv_freq ? rope.rope_dim / 2 : 0, G = n_q / n_kv, i = threadIdx.x;
  float c = 1.0f, sf = 0.0f;
  if (i < half) {
    const float angle = static_cast<float>(p) * rope.inv_freq[i];
    double sn, cs;
    sincos(static_cast<double>(angle), &sn, &cs);
    c = static_cast<float>(cs) * rope.mscale, sf = static_cast<float>(sn) * rope.mscale;  // as cpu::rope
  }
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // q, k, v come from the projection before
  for (int d = threadIdx.x; d < hd; d += blockDim.x) V[d] = from_f32<T>(v[src + d]);
  const int rotated = rope.inv_freq ? rope.rope_dim : 0;
  for (int d = rotated + threadIdx.x; d < hd; d += blockDim.x) K[d] = from_f32<T>(k[src + d]);
  if (i < half) {
    const int a = rope.adjacent ? 2 * i : i, b = rope.adjacent ? 2 * i + 1 : i + half;
    const float k0 = k[src + a], k1 = k[src + b];
    K[a] = from_f32<T>(k0 * c - k1 * sf);
    K[b] = from_f32<T>(k0 * sf + k1 * c);
    for (int g = 0; g < G; ++g) {
      float* qh = q + (static_cast<int64_t>(t) * n_q + h * G + g) * hd;
      const float q0 = qh[a], q1 = qh[b];
      qh[a] = q0 * c - q1 * sf;
      qh[b] = q0 * sf + q1 * c;
    }
  }
}

// 16 bytes of K or V as loaded (8 elements of a 16-bit type; f32 takes two).
template <typename T>
struct Raw {
  uint4 a;
};
template <>
struct Raw<float> {
  uint4 a, b;
};
template <typename T>
__device__ inline void load_raw(const T* p, Raw<T>& r) {
  r.a = *reinterpret_cast<const uint4*>(p);
}
template <>
__device__ inline void load_raw<float>(const float* p, Raw<float>& r) {
  r.a = *reinterpret_cast<const uint4*>(p);
  r.b = *reinterpret_cast<const uint4*>(p + 4);
}
__device__ inline void to_f32x8(const Raw<float>& r, float* f) {
  const float* a = reinterpret_cast<const float*>(&r.a);
  const float* b = reinterpret_cast<const float*>(&r.b);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = a[i], f[4 + i] = b[i];
}

// The f32 cache's decode kernel. grid (tokens, n_kv, splits); block kWarps warps. HD: head_dim
// (64 or 128); G: query heads per KV head. Each key is read by a group of LPK = HD / 8 lanes, each lane 8 dimensions (one 16-byte
// load of K and one of V); a warp reads 32 / LPK keys at once. Every lane keeps the G heads' query
// dims and output accumulators for its 8 dimensions in registers, with its group's running
// softmax state; the groups and warps merge at the end. With splits == 1 writes out; else the
// split's unnormalized output and its (m, l).
template <typename T, int HD, int G>
__global__ void __launch_bounds__(kWarps * 32)
    attention_kernel(const Meta M, const float* __restrict__ q, float* __restrict__ out,
                     float* __restrict__ part_o, float* __restrict__ part_ml, int n_kv, float scale_log2, LayerDev L) {
  constexpr int DPL = 8, LPK = HD / DPL, KPW = 32 / LPK, SLOTS = kWarps * KPW;
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, grid_splits = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPK, sub = lane % LPK;
  const SeqDev s = M.seqs[M.tok_seq[t]];
  cuda::pdl_wait();  // every block, before any exit: this grid completes only after the one before
  if (s.n_new >= M.prefill_min) return;  // a prefill tile's
  const int splits = s.splits;
  if (split >= splits) return;  // a shorter sequence than the grid was sized for
  const int64_t ctx = s.pos + (t - s.row) + 1;  // causal: keys [lo, ctx)
  const int64_t lo = L.first_key(ctx - 1);
  const int64_t chunk = (ctx - lo + splits - 1) / splits;
  const int64_t k0 = lo + split * chunk, k1 = ctx < k0 + chunk ? ctx : k0 + chunk;  // a window's may be empty
  const int n_q = n_kv * G;

  float qr[G][DPL], acc[G][DPL], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float* qp = q + (static_cast<int64_t>(t) * n_q + kvh * G + g) * HD + sub * DPL;
#pragma unroll
    for (int e = 0; e < DPL; ++e) qr[g][e] = qp[e] * scale_log2, acc[g][e] = 0.0f;
    m[g] = -INFINITY, l[g] = 0.0f;
  }
  const T* K = static_cast<const T*>(s.k ? s.k : M.k);
  const T* V = static_cast<const T*>(s.v ? s.v : M.v);
  // One key of the group: scores of the G heads (reduced over the group's lanes), then the
  // online-softmax update of the group's state. Every lane runs it (the shuffles need the warp).
  auto step = [&](const float* kf, const float* vf, bool valid) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sc = 0.0f;
#pragma unroll
      for (int e = 0; e < DPL; ++e) sc += qr[g][e] * kf[e];
#pragma unroll
      for (int o = LPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffff, sc, o);
      sc = L.cap(sc);
      if (valid) {
        const float m_new = fmaxf(m[g], sc);
        const float corr = exp2f(m[g] - m_new);  // 0 while m[g] is -inf
        const float p = exp2f(sc - m_new);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[g][e] = acc[g][e] * corr + p * vf[e];
        m[g] = m_new;
      }
    }
  };
  // Two keys per group per iteration, and the next iteration's loads issued before this one's
  // arithmetic: eight 16-byte loads in flight per lane.
  struct Pair {
    Raw<T> ka, va, kb, vb;
    bool a, b;
  };
  auto fetch = [&](int64_t base, Pair& p) {
    const int64_t ka = base + grp, kb = base + KPW + grp;
    p.a = ka < k1, p.b = kb < k1;
    if (p.a) {
      const int64_t off = kv_offset(s, M.tables, ka, kvh, HD) + sub * DPL;
      load_raw(K + off, p.ka);
      load_raw(V + off, p.va);
    }
    if (p.b) {
      const int64_t off = kv_offset(s, M.tables, kb, kvh, HD) + sub * DPL;
      load_raw(K + off, p.kb);
      load_raw(V + off, p.vb);
    }
  };
  auto consume = [&](const Pair& p) {
    float kf[DPL], vf[DPL];
#pragma unroll
    for (int e = 0; e < DPL; ++e) kf[e] = vf[e] = 0.0f;
    if (p.a) to_f32x8(p.ka, kf), to_f32x8(p.va, vf);
    step(kf, vf, p.a);
#pragma unroll
    for (int e = 0; e < DPL; ++e) kf[e] = vf[e] = 0.0f;
    if (p.b) to_f32x8(p.kb, kf), to_f32x8(p.vb, vf);
    step(kf, vf, p.b);
  };
  int64_t base = k0 + warp * 2 * KPW;
  if (base < k1) {
    Pair cur, nxt;
    fetch(base, cur);
    for (; base < k1; base += 2 * SLOTS) {
      const bool more = base + 2 * SLOTS < k1;
      if (more) fetch(base + 2 * SLOTS, nxt);
      consume(cur);
      if (more) cur = nxt;
    }
  }
  // Merge the key slots (groups of every warp).
  __shared__ float sm[SLOTS][G], sl[SLOTS][G];
  __shared__ float so[SLOTS][G][HD];
  const int slot = warp * KPW + grp;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (sub == 0) sm[slot][g] = m[g], sl[slot][g] = l[g];
#pragma unroll
    for (int e = 0; e < DPL; ++e) so[slot][g][sub * DPL + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
    for (int w = 0; w < SLOTS; ++w) mx = fmaxf(mx, sm[w][g]);
    float den = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
      for (int w = 0; w < SLOTS; ++w) {
        const float f = exp2f(sm[w][g] - mx);  // 0 for a slot that saw no key
        den += sl[w][g] * f;
        o += so[w][g][d] * f;
      }
    }
    const int64_t row = static_cast<int64_t>(t) * n_q + kvh * G + g;
    if (splits == 1) {
      out[row * HD + d] = o / (den + L.sink_term(kvh * G + g, mx));
    } else {
      part_o[(row * grid_splits + split) * HD + d] = o;
      if (d == 0) {
        part_ml[(row * grid_splits + split) * 2] = mx;
        part_ml[(row * grid_splits + split) * 2 + 1] = den;
      }
    }
  }
}

// Tensor-core attention (mma.sync m16n8k16: f16/bf16 operands, f32 accumulation), FlashAttention-2
// style, for prefill and decode alike. A block of R warps serves 16 R query rows that share one KV
// head: the rows pack (token, query head of the GQA group) pairs — a prefill tile is 16 R / G
// consecutive new tokens of a sequence, a decode block one token's G heads (R = 1 while G <= 16) —
// so each K/V tile is read once for the whole group. K/V tiles of KT keys stream from the pages
// into shared memory with cp.async (STAGES deep, 16-byte chunks XOR-swizzled against bank
// conflicts), S = Q K^T and O += P V run on tensor cores with S, the online softmax (f32, exp2)
// and O in registers; q and P are rounded to T for the products, as flash attention does (the
// f32 CUDA-core kernel this replaced for decode kept q in f32). Decode blocks
// take a split of the keys (split-KV) and, when the sequence uses several, write unnormalized
// partials for merge_splits_kernel.
template <typename T>
__device__ inline uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

using cuda::ldmatrix_x4;
using cuda::ldmatrix_x4_trans;
using cuda::mma16816;
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;

// Splits' partials the merge requests at once, and the groups of threads a merge block divides a
// row's splits into (each merges a quarter, then the four are merged in group order: a row's 128
// splits were one thread's eight dependent round trips to L2).
constexpr int kMergeBatch = 16, kMergeGroups = 4;

// A partial log-sum-exp merge: the running maximum (exp2 units), the denominator and four
// output dimensions, all relative to the maximum.
struct MergeState {
  float mx = -INFINITY, l = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
};

// Folds (m, l, o) into st: empty parts (m = -inf) count for nothing.
__device__ inline void merge_into(MergeState& st, float m, float l, float4 o) {
  if (m == -INFINITY) return;
  const float m_new = fmaxf(st.mx, m);
  const float c = exp2f(st.mx - m_new), f = exp2f(m - m_new);  // c: 0 while st.mx is -inf
  st.l = st.l * c + l * f;
  st.o = make_float4(st.o.x * c + o.x * f, st.o.y * c + o.y * f, st.o.z * c + o.z * f, st.o.w * c + o.w * f);
  st.mx = m_new;
}

// A merged row's four output dimensions at d4, normalized (the query head's sink joins the
// denominator), to out [rows, hd]: both merges' last step.
__device__ inline void store_merged(float* out, int64_t row, int hd, int d4, const MergeState& st, const LayerDev& L, int n_q) {
  const float den = st.l + L.sink_term(static_cast<int>(row % n_q), st.mx);
  reinterpret_cast<float4*>(out + row * hd)[d4] = make_float4(st.o.x / den, st.o.y / den, st.o.z / den, st.o.w / den);
}

// Folds splits [b, e) of a batch of U loaded partials (ml: (m, l) in exp2 units; po: four output
// dimensions) into a running (mx, L, O): the batch's maximum first, then each split scaled to it;
// empty splits (m = -inf) count for nothing.
template <int U>
__device__ inline void fold_batch(float& mx, float& L, float4& O, const float2 (&ml)[U], const float4 (&po)[U], int b, int e) {
  float m_new = mx;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u >= b && u < e) m_new = fmaxf(m_new, ml[u].x);
  }
  if (m_new == -INFINITY) return;  // only empty splits so far
  const float c = exp2f(mx - m_new);  // 0 while mx is -inf
  L *= c, O.x *= c, O.y *= c, O.z *= c, O.w *= c;
  mx = m_new;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < b || u >= e || ml[u].x == -INFINITY) continue;  // outside the range, or empty
    const float f = exp2f(ml[u].x - mx);
    L += ml[u].y * f;
    O.x += po[u].x * f, O.y += po[u].y * f, O.z += po[u].z * f, O.w += po[u].w * f;
  }
}

// The log-sum-exp merge of splits [sp_begin, sp_end) of one output row (part_o [rows,
// grid_splits, hd], part_ml [rows, grid_splits] of (m, l), exp2 units) for the four dimensions at
// d4: kMergeBatch splits' partials requested at once (a loop waiting on each load would take a
// round trip to L2 per split), read from L2 (__ldcg: other blocks wrote them).
__device__ inline MergeState merge_splits4(const float* part_o, const float* part_ml, int64_t row, int grid_splits,
                                           int sp_begin, int sp_end, int hd, int d4) {
  constexpr int U = kMergeBatch;
  MergeState st;
  for (int sp0 = sp_begin; sp0 < sp_end; sp0 += U) {
    float2 ml[U];
    float4 po[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (sp0 + u < sp_end) {
        ml[u] = __ldcg(reinterpret_cast<const float2*>(part_ml) + row * grid_splits + sp0 + u);
        po[u] = __ldcg(reinterpret_cast<const float4*>(part_o + (row * grid_splits + sp0 + u) * hd) + d4);
      }
    }
    fold_batch<U>(st.mx, st.l, st.o, ml, po, 0, sp_end - sp0);
  }
  return st;
}

// Decode grids of at most kFoldMaxSplits splits merge them in the last split's block to finish
// (instead of merge_splits_kernel, a second launch: 20 us a llama-8b layer at 64 sessions, mostly
// its latency; H100, llama-8b Q4_K_M at 64 sessions 4,448 -> 4,471 tok/s); a counter per token and
// KV head, at most kFoldCounters of them, at the start of the attention's scratch. Longer splits
// lists (few sequences) keep the merge kernel, which spreads a row's splits over four groups.
constexpr int kFoldMaxSplits = 8, kFoldCounters = 16384;

// A decode block's end when its token's splits are merged in the last of them: each block has
// written its partials; the last to arrive (counter: left at zero again) merges the group's G rows
// (row0 ..) into out, in merge_splits_kernel's order (the splits in kMergeGroups ranges, each
// folded as merge_splits4 does, then the ranges in order: the same operations, the same numbers).
// NT: the block's threads.
template <int HD, int NT>
__device__ void merge_in_last_split(const float* part_o, const float* part_ml, float* out, int* counter, int64_t row0, int G,
                                    int n_q, int splits, LayerDev L) {
  __shared__ int last;
  __threadfence();  // this block's partials, before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int grid_splits = static_cast<int>(gridDim.z);
  for (int i = threadIdx.x; i < G * (HD / 4); i += NT) {
    const int64_t row = row0 + i / (HD / 4);
    const int d4 = i % (HD / 4);
    float2 ml[kFoldMaxSplits];
    float4 po[kFoldMaxSplits];
#pragma unroll
    for (int u = 0; u < kFoldMaxSplits; ++u) {
      if (u < splits) {
        ml[u] = __ldcg(reinterpret_cast<const float2*>(part_ml) + row * grid_splits + u);
        po[u] = __ldcg(reinterpret_cast<const float4*>(part_o + (row * grid_splits + u) * HD) + d4);
      }
    }
    MergeState st;
#pragma unroll
    for (int g = 0; g < kMergeGroups; ++g) {
      MergeState p;
      fold_batch<kFoldMaxSplits>(p.mx, p.l, p.o, ml, po, splits * g / kMergeGroups, splits * (g + 1) / kMergeGroups);
      if (g == 0) st = p;
      else merge_into(st, p.mx, p.l, p.o);
    }
    store_merged(out, row, HD, d4, st, L, n_q);
  }
  if (threadIdx.x == 0) *counter = 0;  // for the next launch
}

// One row's online-softmax step for a tile of the tensor-core kernels: mx, the row's max over the
// tile (reduced over the row's lanes), joins the running max m and the running sum l is rescaled.
// Returns the factor for O (0 while m was -inf) and leaves in mx the max to subtract from the
// tile's scores (0 while the row has no key yet, so exp2 of -inf stays 0).
__device__ __forceinline__ float online_rescale(float& m, float& mx, float& l) {
  const float m_new = fmaxf(m, mx);
  const float base = m_new == -INFINITY ? 0.0f : m_new;
  const float corr = exp2f(m - base);
  m = m_new;
  mx = base;
  l *= corr;
  return corr;
}

// The K/V tile pipeline of the tensor-core kernels: the tiles of KT keys over [kb, ke), STAGES
// deep in shared memory. fetch(k0) reads a tile's page-table entries one tile ahead of its copies
// (load(stage, k0): cp.async, so the table's round trip to L2 or DRAM does not stall every tile);
// sync() orders the block's warps (tile i is in, every warp is done with the stage reloaded next);
// body(stage, k0) consumes a tile. Returns with every copy landed.
template <int STAGES, int KT, typename Fetch, typename Load, typename Sync, typename Body>
__device__ __forceinline__ void stream_tiles(int64_t kb, int64_t ke, Fetch& fetch, Load& load, Sync&& sync, Body&& body) {
  const int n_tiles = static_cast<int>((ke - kb + KT - 1) / KT);
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_tiles) fetch(kb + st * KT), load(st, kb + st * KT);
    cp_async_commit();
  }
  if (STAGES - 1 < n_tiles) fetch(kb + (STAGES - 1) * KT);
  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<STAGES - 2>();
    sync();
    if (i + STAGES - 1 < n_tiles) load((i + STAGES - 1) % STAGES, kb + static_cast<int64_t>(i + STAGES - 1) * KT);
    if (i + STAGES < n_tiles) fetch(kb + static_cast<int64_t>(i + STAGES) * KT);
    cp_async_commit();
    body(i % STAGES, kb + static_cast<int64_t>(i) * KT);
  }
  cp_async_wait<0>();
}

// The tensor-core kernels' shapes: prefill blocks of 4 warps (64 query rows) with 64-key tiles;
// decode blocks of one warp with 8 KB K/V tiles four deep (measured on the H200 against 16 KB
// two or three deep: 16 x 8k contexts 0.91 of copy bandwidth vs 0.89 / 0.62), or of 4 warps when
// the group has more than 16 heads.
// head_dim 256 (gemma) takes 16-key decode tiles (whole mma n-tiles) and 32-key prefill tiles (its
// 128 output accumulators per lane leave no registers for wider score tiles). Its decode blocks
// are two warps that split the output dimensions (kDimWarps): each computes the whole score tile
// (the same mma sequence, so the same scores and softmax) and P V for its 128 dimensions. One warp
// holding all 256 needs Q's 64 fragment registers and 128 accumulators at once and spilled ~600
// bytes a lane to local memory, which the 64 KB of shared memory a block leaves no L1 for.
template <int HD, int R>
struct FlashShape {
  static constexpr int kKeys = R == 1 ? (2048 / HD > 16 ? 2048 / HD : 16) : HD >= 256 ? 32 : 64;
  static constexpr int kStages = R == 1 ? 4 : HD == 64 ? 3 : 2;
  static constexpr int kSmemBytes = kStages * 2 * kKeys * HD * 2;
  static constexpr int kDimWarps = R == 1 && HD >= 256 ? 2 : 1;
  static constexpr int kThreads = R * kDimWarps * 32;
};

// tiles: null for decode (grid (tokens, n_kv, splits): one token per block); for prefill
// (grid (tiles, n_kv)), per block (sequence, first new-token index of the tile).
template <typename T, int HD, int R>
__global__ void __launch_bounds__(FlashShape<HD, R>::kThreads)
    flash_kernel(const Meta M, const int32_t* __restrict__ tiles, const float* __restrict__ q, float* __restrict__ out,
                 float* __restrict__ part_o, float* __restrict__ part_ml, int* __restrict__ arrived, int n_kv, int G,
                 float scale_log2, LayerDev L) {
  constexpr int KT = FlashShape<HD, R>::kKeys, STAGES = FlashShape<HD, R>::kStages;
  constexpr int DW = FlashShape<HD, R>::kDimWarps, OD = HD / DW;  // warps sharing rows; output dims a warp
  constexpr int NT = FlashShape<HD, R>::kThreads, CH = HD / 8, LOADS = KT * CH / NT;  // 16-byte chunks per row; per thread per tile
  static_assert(KT * CH % NT == 0 && KT % 16 == 0 && OD % 16 == 0, "tile shape");
  extern __shared__ __align__(128) unsigned char flash_smem[];
  T* const smem = reinterpret_cast<T*>(flash_smem);
  const int kvh = blockIdx.y, tid = threadIdx.x, lane = tid % 32, quad = lane % 4;
  const int warp = tid / 32 / DW, dw = tid / 32 % DW;  // the warp's rows (16 from warp * 16) and output dims (from dw * OD)
  const bool decode = tiles == nullptr;
  const int seq = decode ? M.tok_seq[blockIdx.x] : tiles[2 * blockIdx.x];
  const SeqDev s = M.seqs[seq];
  // The split merge after a decode grid, or the decode grid after a prefill one, may launch once
  // every block of this one has started (it waits for this grid's completion before reading
  // anything). Not a projection: its persistent blocks, launched early, would wait for SMs still
  // busy here (measured: single-session decode 904 -> 867 tok/s).
  // (Where the last split's block merges the splits itself, the next kernel is the projection.)
  if (!decode || (gridDim.z > 1 && !arrived)) cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // every block, before any exit: this grid completes only after the one before
  int tl0, ntok, split = 0, splits = 1;
  int64_t kb = 0, ke;
  if (decode) {
    if (s.n_new >= M.prefill_min) return;  // a prefill tile's
    splits = s.splits, split = blockIdx.z;
    if (split >= splits) return;
    tl0 = blockIdx.x - s.row, ntok = 1;
    const int64_t ctx = s.pos + tl0 + 1, lo = L.first_key(ctx - 1);
    // splits <= ctx / 16: never empty without a window (a window's splits may be: m stays -inf)
    kb = lo + (ctx - lo) * split / splits, ke = lo + (ctx - lo) * (split + 1) / splits;
  } else {
    tl0 = tiles[2 * blockIdx.x + 1];
    ntok = min(R * 16 / G, s.n_new - tl0);
    ke = s.pos + tl0 + ntok;
    kb = L.first_key(s.pos + tl0);  // the tile's first token's first key
  }
  const int n_q = n_kv * G, valid_rows = ntok * G;
  const T* K = static_cast<const T*>(s.k ? s.k : M.k);
  const T* V = static_cast<const T*>(s.v ? s.v : M.v);

  // This lane's two rows (lane / 4 and lane / 4 + 8 of its warp's 16): the last key each may see,
  // its output row, and Q as A fragments (rows past the tile are zero and see every key).
  int lim[2], lo[2];
  int64_t orow[2];
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + lane / 4 + 8 * h;
    const bool valid = r < valid_rows;
    const int tl = tl0 + (valid ? r / G : 0);
    const int64_t last = s.pos + tl;
    lim[h] = static_cast<int>(valid && last < ke - 1 ? last : ke - 1);
    lo[h] = static_cast<int>(valid ? L.first_key(last) : kb);
    orow[h] = valid ? static_cast<int64_t>(s.row + tl) * n_q + kvh * G + r % G : -1;
    const float* qp = q + (valid ? orow[h] : 0) * HD;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
      float2 x0 = make_float2(0.0f, 0.0f), x1 = x0;
      if (valid) {
        x0 = *reinterpret_cast<const float2*>(qp + ks * 16 + 2 * quad);
        x1 = *reinterpret_cast<const float2*>(qp + ks * 16 + 8 + 2 * quad);
      }
      qf[ks][h] = pack2<T>(x0.x, x0.y);      // a0 (row lane/4), a1 (row + 8)
      qf[ks][2 + h] = pack2<T>(x1.x, x1.y);  // a2, a3: columns + 8
    }
  }
  const int min_lim = min(lim[0], lim[1]);  // this warp needs no mask for a tile wholly below
  const int max_lo = max(lo[0], lo[1]);     // and above

  const uint32_t smem_base = cuda::smem_addr(smem);
  // The page-table entries of the next tile's rows, read one tile ahead (a dependent load to L2
  // or DRAM before each tile's copies would otherwise stall the warp once per tile).
  int32_t pages[LOADS];
  auto fetch_pages = [&](int64_t k0) {
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int key = static_cast<int>(k0 + (tid + j * NT) / CH);
      pages[j] = key < ke ? M.tables[s.table_off + kv_page(s, key)] : 0;
    }
  };
  auto load_tile = [&](int stage, int64_t k0) {
    const uint32_t kbase = smem_base + stage * (2 * KT * HD * 2), vbase = kbase + KT * HD * 2;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int i = tid + j * NT, row = i / CH, c = i % CH;
      const int key = static_cast<int>(k0 + row);
      const bool valid = key < ke;
      const int64_t off = valid ? kv_offset_in(s, pages[j], key, kvh, HD) + c * 8 : 0;
      const uint32_t dst = (row * HD + ((c ^ (row & 7)) * 8)) * 2;
      cp_async16(kbase + dst, K + off, valid);
      cp_async16(vbase + dst, V + off, valid);
    }
  };
  auto sync = [] {
    if constexpr (NT == 32) __syncwarp();
    else __syncthreads();
  };

  float o[OD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int d = 0; d < OD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  stream_tiles<STAGES, KT>(kb, ke, fetch_pages, load_tile, sync, [&](int stage, int64_t k0) {
    const uint32_t kbase = smem_base + stage * (2 * KT * HD * 2), vbase = kbase + KT * HD * 2;

    // S = Q K^T: ldmatrix.x4 gives the B fragments of two 8-key n-tiles for 16 dims.
    float sc[KT / 8][4];
#pragma unroll
    for (int n = 0; n < KT / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < KT / 16; ++np) {
        const int key = np * 16 + (lane & 7) + (lane >> 4) * 8, c = 2 * ks + ((lane >> 3) & 1);
        uint32_t b[4];
        ldmatrix_x4(b, kbase + (key * HD + ((c ^ (lane & 7)) * 8)) * 2);
        mma16816<T>(sc[2 * np], qf[ks], b[0], b[1]);
        mma16816<T>(sc[2 * np + 1], qf[ks], b[2], b[3]);
      }
    }
    // Scale, mask (causal and the split's end) and the online softmax of the lane's two rows.
    const bool masked = k0 + KT - 1 > min_lim || k0 < max_lo;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < KT / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = L.cap(sc[n][e] * scale_log2);
        const int64_t key = k0 + n * 8 + 2 * quad + (e & 1);
        if (masked && (key > lim[e / 2] || key < lo[e / 2])) x = -INFINITY;
        sc[n][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      corr[h] = online_rescale(m[h], mx[h], l[h]);
    }
#pragma unroll
    for (int n = 0; n < KT / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(sc[n][e] - mx[e / 2]);
        sc[n][e] = p;
        l[e / 2] += p;
      }
    }
#pragma unroll
    for (int d = 0; d < OD / 8; ++d) o[d][0] *= corr[0], o[d][1] *= corr[0], o[d][2] *= corr[1], o[d][3] *= corr[1];
    // O += P V: the S accumulators of two n-tiles are the A fragment of 16 keys; ldmatrix.trans
    // gives V's B fragments for two 8-dim n-tiles.
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(sc[2 * kk][0], sc[2 * kk][1]), pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                             pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
      const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dp = 0; dp < OD / 16; ++dp) {
        const int c = 2 * (dw * (OD / 16) + dp) + (lane >> 4);
        uint32_t b[4];
        ldmatrix_x4_trans(b, vbase + (key * HD + ((c ^ (lane & 7)) * 8)) * 2);
        mma16816<T>(o[2 * dp], a, b[0], b[1]);
        mma16816<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  });

  // Each row's sum is spread over its quad's four lanes.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    if (orow[h] < 0) continue;
    if (splits == 1) {
      const float inv = 1.0f / (l[h] + L.sink_term(static_cast<int>(orow[h] % n_q), m[h]));
      float* op = out + orow[h] * HD + dw * OD + 2 * quad;
#pragma unroll
      for (int d = 0; d < OD / 8; ++d) *reinterpret_cast<float2*>(op + d * 8) = make_float2(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    } else {
      const int64_t prow = orow[h] * gridDim.z + split;
      float* op = part_o + prow * HD + dw * OD + 2 * quad;
#pragma unroll
      for (int d = 0; d < OD / 8; ++d) *reinterpret_cast<float2*>(op + d * 8) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      if (quad == 0 && dw == 0) part_ml[prow * 2] = m[h], part_ml[prow * 2 + 1] = l[h];
    }
  }
  if (splits > 1 && arrived) merge_in_last_split<HD, NT>(part_o, part_ml, out, arrived + blockIdx.x * n_kv + kvh,
                                                          static_cast<int64_t>(blockIdx.x) * n_q + kvh * G, G, n_q, splits, L);
}

// Where split i of splits over the keys [lo, ctx) begins (i = splits: ctx): an even share, rounded
// down to a multiple of kt keys so that every split's tiles start on a tile boundary, whatever
// the cache's pages (a split may be left empty by a window: its m stays -inf).
__device__ inline int64_t split_bound(int64_t lo, int64_t ctx, int i, int splits, int kt) {
  if (i == 0) return lo;
  if (i == splits) return ctx;
  return max(lo, (lo + (ctx - lo) * i / splits) / kt * kt);
}

// The decode kernel for head_dim 64 and 128 with at most 8 query heads per KV head (llama, qwen,
// mistral shapes): the GQA group's query heads are the mma's n side, S^T = K Q^T and
// O^T = V^T P^T, so up to 8 heads fill one 8-wide n-tile where flash_kernel's A tiles of 16 rows
// hold G of them (4 for llama-8b). Half the mma, and half the registers for Q's fragments
// (HD / 8) and O's accumulators (HD / 4): 124 registers at head_dim 128 against flash_kernel's
// 236, so with two K/V stages 13 blocks fit an SM and 64 llama-8b sessions' decode grid runs in
// one wave (H100: 5.3k against 5.16k tok/s with flash_kernel's decode, four stages were no
// faster). P^T's B fragments come from S^T's accumulators by movmatrix. Tiles as flash_kernel's
// decode tiles (KT keys, swizzled), each addressed from one page-table read where every tile lies
// in one page (no window, pages a power of two and a multiple of KT keys).
//
// grid (tokens, n_kv, splits); block: one warp. Splits end on tile boundaries (split_bound), the
// same for a paged and a contiguous cache.
template <int HD>
struct SwapShape {
  static constexpr int kKeys = FlashShape<HD, 1>::kKeys;
  static constexpr int kStages = 2;
  static constexpr int kSmemBytes = kStages * 2 * kKeys * HD * 2;
};

template <typename T, int HD>
__global__ void __launch_bounds__(32) decode_swap_kernel(const Meta M, const float* __restrict__ q, float* __restrict__ out,
                                                         float* __restrict__ part_o, float* __restrict__ part_ml,
                                                         int* __restrict__ arrived, int n_kv, int G, float scale_log2,
                                                         LayerDev L) {
  constexpr int KT = SwapShape<HD>::kKeys, S = SwapShape<HD>::kStages, MT = KT / 16, CH = HD / 8, LOADS = KT * CH / 32;
  static_assert(KT % 16 == 0 && KT * CH % 32 == 0 && 32 % CH == 0, "tile shape");
  extern __shared__ __align__(128) unsigned char flash_smem[];
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, lane = threadIdx.x, g = lane / 4, quad = lane % 4;
  const SeqDev s = M.seqs[M.tok_seq[t]];
  if (gridDim.z > 1 && !arrived) cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // every block, before any exit
  if (s.n_new >= M.prefill_min) return;  // a prefill tile's
  const int splits = s.splits;
  if (split >= splits) return;
  const int64_t ctx = s.pos + (t - s.row) + 1, lo = L.first_key(ctx - 1);
  const int64_t kb = split_bound(lo, ctx, split, splits, KT), ke = split_bound(lo, ctx, split + 1, splits, KT);
  const bool one_page = lo == 0 && s.pad >= 0 && s.page_size % KT == 0;
  const int n_q = n_kv * G;
  const T* K = static_cast<const T*>(s.k ? s.k : M.k);
  const T* V = static_cast<const T*>(s.v ? s.v : M.v);

  // Q^T's B fragments: query head g of the group (zero past G), dims 2 quad, +1 and + 8.
  uint32_t qf[HD / 16][2];
  {
    const bool valid = g < G;
    const float* qp = q + (static_cast<int64_t>(t) * n_q + kvh * G + (valid ? g : 0)) * HD;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
      float2 x0 = make_float2(0.0f, 0.0f), x1 = x0;
      if (valid) {
        x0 = *reinterpret_cast<const float2*>(qp + ks * 16 + 2 * quad);
        x1 = *reinterpret_cast<const float2*>(qp + ks * 16 + 8 + 2 * quad);
      }
      qf[ks][0] = pack2<T>(x0.x, x0.y), qf[ks][1] = pack2<T>(x1.x, x1.y);
    }
  }

  const uint32_t smem_base = cuda::smem_addr(flash_smem);
  int32_t pages[LOADS];
  auto fetch_pages = [&](int64_t k0) {
    if (one_page) {
      pages[0] = M.tables[s.table_off + (static_cast<int>(k0) >> s.pad)];
      return;
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int key = static_cast<int>(k0 + (lane + j * 32) / CH);
      pages[j] = key < ke ? M.tables[s.table_off + kv_page(s, key)] : 0;
    }
  };
  auto load_tile = [&](int stage, int64_t k0) {
    const uint32_t kbase = smem_base + stage * (2 * KT * HD * 2), vbase = kbase + KT * HD * 2;
    const int r0 = lane / CH, c = lane % CH;  // rows r0 + j (32 / CH), chunk c
    int64_t base = 0;
    if (one_page) {
      base = static_cast<int64_t>(pages[0]) * s.page_stride + kvh * s.head_stride +
             static_cast<int64_t>((static_cast<int>(k0) & (s.page_size - 1)) + r0) * HD + c * 8;
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int row = r0 + j * (32 / CH), key = static_cast<int>(k0 + row);
      const bool valid = key < ke;
      const int64_t off = one_page ? base + j * (32 / CH) * HD : valid ? kv_offset_in(s, pages[j], key, kvh, HD) + c * 8 : 0;
      const uint32_t dst = (row * HD + ((c ^ (row & 7)) * 8)) * 2;
      cp_async16(kbase + dst, K + off, valid);
      cp_async16(vbase + dst, V + off, valid);
    }
  };

  // O^T's accumulators: o[dt][0..1] dims dt * 16 + g, queries 2 quad, +1; o[dt][2..3] dims + 8.
  // m, l: this lane's two queries (2 quad, +1); l summed over the lane's keys until the end.
  float o[HD / 16][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int d = 0; d < HD / 16; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  stream_tiles<S, KT>(kb, ke, fetch_pages, load_tile, [] { __syncwarp(); }, [&](int stage, int64_t k0) {
    const uint32_t kbase = smem_base + stage * (2 * KT * HD * 2), vbase = kbase + KT * HD * 2;

    // S^T = K Q^T: ldmatrix.x4 gives K's A fragment of 16 keys x 16 dims.
    float sc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.0f;
      const int key = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        const int c = 2 * ks + (lane >> 4);
        uint32_t a[4];
        ldmatrix_x4(a, kbase + (key * HD + ((c ^ (lane & 7)) * 8)) * 2);
        mma16816<T>(sc[mt], a, qf[ks][0], qf[ks][1]);
      }
    }
    // Scale, mask (the split's end) and the online softmax of the lane's two queries: their keys
    // are spread over the lanes of the same quad position (xor 4, 8, 16).
    const bool masked = k0 + KT > ke;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = L.cap(sc[mt][e] * scale_log2);
        if (masked && k0 + mt * 16 + g + (e >> 1) * 8 >= ke) x = -INFINITY;
        sc[mt][e] = x;
        mx[e & 1] = fmaxf(mx[e & 1], x);
      }
    }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 4));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 8));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 16));
      corr[h] = online_rescale(m[h], mx[h], l[h]);
    }
    uint32_t pb[MT][2];  // P^T's B fragments: keys 2 quad, +1 (and + 8) of query g
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = exp2f(sc[mt][e] - mx[e & 1]), l[e & 1] += p[e];
      pb[mt][0] = cuda::movmatrix_trans(pack2<T>(p[0], p[1]));
      pb[mt][1] = cuda::movmatrix_trans(pack2<T>(p[2], p[3]));
    }
    // O^T += V^T P^T: ldmatrix.trans gives V^T's A fragment of 16 dims x 16 keys.
#pragma unroll
    for (int dt = 0; dt < HD / 16; ++dt) {
      o[dt][0] *= corr[0], o[dt][1] *= corr[1], o[dt][2] *= corr[0], o[dt][3] *= corr[1];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int key = mt * 16 + (lane & 7) + (lane >> 4) * 8, c = 2 * dt + ((lane >> 3) & 1);
        uint32_t a[4];
        ldmatrix_x4_trans(a, vbase + (key * HD + ((c ^ (lane & 7)) * 8)) * 2);
        mma16816<T>(o[dt], a, pb[mt][0], pb[mt][1]);
      }
    }
  });

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 16);
    const int qh = 2 * quad + h;
    if (qh >= G) continue;
    const int64_t orow = static_cast<int64_t>(t) * n_q + kvh * G + qh;
    if (splits == 1) {
      const float inv = 1.0f / (l[h] + L.sink_term(kvh * G + qh, m[h]));
      float* op = out + orow * HD + g;
#pragma unroll
      for (int dt = 0; dt < HD / 16; ++dt) op[dt * 16] = o[dt][h] * inv, op[dt * 16 + 8] = o[dt][2 + h] * inv;
    } else {
      const int64_t prow = orow * gridDim.z + split;
      float* op = part_o + prow * HD + g;
#pragma unroll
      for (int dt = 0; dt < HD / 16; ++dt) op[dt * 16] = o[dt][h], op[dt * 16 + 8] = o[dt][2 + h];
      if (g == 0) part_ml[prow * 2] = m[h], part_ml[prow * 2 + 1] = l[h];
    }
  }
  if (splits > 1 && arrived) merge_in_last_split<HD, 32>(part_o, part_ml, out, arrived + blockIdx.x * n_kv + kvh,
                                                          static_cast<int64_t>(blockIdx.x) * n_q + kvh * G, G, n_q, splits, L);
}

// grid (tokens * n_q); block (head_dim / 4 threads rounded up to a warp, kMergeGroups). The merge
// of a token's splits, for the rows of sequences that ran in several (those in one split were
// written by the attention kernel directly): group g merges its share of the splits, group 0 the
// groups' results in order, then query head's sink (L.sink_term) joins the denominator.
// head_dim: 64, 128 or 256. L: the layer's (for its sinks).
__global__ void merge_splits_kernel(const Meta meta, const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                    float* __restrict__ out, int grid_splits, int hd, int n_q, LayerDev L) {
  __shared__ MergeState groups[kMergeGroups - 1][64];
  const int64_t row = blockIdx.x;
  const int d4 = threadIdx.x, g = threadIdx.y;
  const SeqDev& s = meta.seqs[meta.tok_seq[row / n_q]];
  cuda::pdl_wait();
  // The attention is done: the next kernel (the output projection) may launch now and request its
  // weights while this merge runs (in a llama-8b layer its blocks start ~5 us before the merge
  // ends), but not earlier: launched while the attention runs, its loads slow the attention's more
  // (H200, llama-8b decode: 241 tok/s vs 239 launched at the merge's end, 227 at its start).
  cuda::pdl_launch_dependents();
  if (s.n_new >= meta.prefill_min || s.splits == 1) return;  // the whole block's row
  const bool active = d4 < hd / 4;
  MergeState st;
  if (active) {
    st = merge_splits4(part_o, part_ml, row, grid_splits, s.splits * g / kMergeGroups, s.splits * (g + 1) / kMergeGroups, hd, d4);
    if (g > 0) groups[g - 1][d4] = st;
  }
  __syncthreads();
  if (!active || g > 0) return;
  for (int i = 0; i < kMergeGroups - 1; ++i) merge_into(st, groups[i][d4].mx, groups[i][d4].l, groups[i][d4].o);
  store_merged(out, row, hd, d4, st, L, n_q);
}

// The reference: grid (tokens, n_q); scores of one row in scratch [tokens, n_q, max_ctx].
template <typename T>
__global__ void manual_attention_kernel(const Meta M, const float* __restrict__ q,
                                        float* __restrict__ out, float* __restrict__ scores, int n_kv, int n_q, int hd,
                                        int64_t max_ctx, float scale, LayerDev L) {
  const int t = blockIdx.x, h = blockIdx.y, kvh = h / (n_q / n_kv);
  const SeqDev s = M.seqs[M.tok_seq[t]];
  const int64_t ctx = s.pos + (t - s.row) + 1;
  const float* qr = q + (static_cast<int64_t>(t) * n_q + h) * hd;
  float* sc = scores + (static_cast<int64_t>(t) * n_q + h) * max_ctx;
  const T* K = static_cast<const T*>(s.k ? s.k : M.k);
  const T* V = static_cast<const T*>(s.v ? s.v : M.v);
  __shared__ float red[256];
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < ctx; j += blockDim.x) {
    const T* kr = K + kv_offset(s, M.tables, j, kvh, hd);
    float dot = 0.0f;
    for (int d = 0; d < hd; ++d) dot += qr[d] * to_f32(kr[d]);
    sc[j] = j < L.first_key(ctx - 1) ? -INFINITY : L.cap(dot * scale * kLog2e) / kLog2e;
    mx = fmaxf(mx, sc[j]);
  }
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < ctx; j += blockDim.x) {
    sc[j] = expf(sc[j] - mx);
    sum += sc[j];
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  sum = red[0];
  if (L.sinks) sum += expf(L.sinks[h] - mx);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t j = 0; j < ctx; ++j) o += sc[j] * to_f32(V[kv_offset(s, M.tables, j, kvh, hd) + d]);
    out[(static_cast<int64_t>(t) * n_q + h) * hd + d] = o / sum;
  }
}

template <typename T, int HD, int R>
cudaError_t flash_attr() {  // (prefill with head_dim 128 takes 64 KB)
  return cuda::allow_dynamic_smem<flash_kernel<T, HD, R>>(FlashShape<HD, R>::kSmemBytes);
}

// Blocks of Kernel (Threads a block, Smem bytes of dynamic shared memory) resident on the whole
// device at once, found once (1,056 where the runtime cannot tell).
template <auto Kernel, int Threads, int Smem>
int resident_capacity() {
  static const int cap = [] {
    int per_sm = 0, sms = 0, dev = 0;
    if (cuda::allow_dynamic_smem<Kernel>(Smem) != cudaSuccess || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, Threads, Smem) != cudaSuccess) {
      return 1056;
    }
    return std::max(per_sm * sms, 1);
  }();
  return cap;
}

// Blocks of the decode kernel resident on the whole device at once.
template <typename T, int HD, int R>
int flash_capacity_of() {
  return resident_capacity<flash_kernel<T, HD, R>, FlashShape<HD, R>::kThreads, FlashShape<HD, R>::kSmemBytes>();
}

// Calls f(std::integral_constant<int, HD>) for the head dimensions the tensor-core kernel has.
constexpr bool flash_head_dim(int hd) { return hd == 64 || hd == 128 || hd == 256; }
template <typename F>
auto with_head_dim(int hd, F&& f) {
  switch (hd) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 256>{});
  }
}

int flash_capacity(DType dt, int hd, int R) {
  const bool h = dt == DType::kF16;
  return with_head_dim(hd, [&](auto HD) {
    if (R == 1) return h ? flash_capacity_of<__half, decltype(HD)::value, 1>() : flash_capacity_of<__nv_bfloat16, decltype(HD)::value, 1>();
    return h ? flash_capacity_of<__half, decltype(HD)::value, 4>() : flash_capacity_of<__nv_bfloat16, decltype(HD)::value, 4>();
  });
}

// Decode tokens of head_dim 64 or 128 with at most 8 query heads per KV head run in
// decode_swap_kernel, the rest in flash_kernel.
constexpr bool swap_decode(int hd, int G) { return (hd == 64 || hd == 128) && G <= 8; }

template <typename T, int HD>
cudaError_t swap_attr() {
  return cuda::allow_dynamic_smem<decode_swap_kernel<T, HD>>(SwapShape<HD>::kSmemBytes);
}

// Blocks of decode_swap_kernel resident on the whole device at once.
template <typename T, int HD>
int swap_capacity_of() {
  return resident_capacity<decode_swap_kernel<T, HD>, 32, SwapShape<HD>::kSmemBytes>();
}

int swap_capacity(DType dt, int hd) {
  const bool h = dt == DType::kF16;
  if (hd == 64) return h ? swap_capacity_of<__half, 64>() : swap_capacity_of<__nv_bfloat16, 64>();
  return h ? swap_capacity_of<__half, 128>() : swap_capacity_of<__nv_bfloat16, 128>();
}

template <typename T, int HD>
cudaError_t launch_swap(dim3 grid, cudaStream_t st, const Meta& M, const float* q, float* out, float* part_o, float* part_ml,
                        int* arrived, int n_kv, int G, float scale_log2, LayerDev L) {
  if (const cudaError_t e = swap_attr<T, HD>(); e != cudaSuccess) return e;
  return cuda::launch_pdl(decode_swap_kernel<T, HD>, grid, dim3(32), SwapShape<HD>::kSmemBytes, st, M, q, out, part_o, part_ml,
                          arrived, n_kv, G, scale_log2, L);
}

// decode_swap_kernel for a cache of T, head_dim 64 or 128.
template <typename T>
cudaError_t launch_swap(int hd, dim3 grid, cudaStream_t st, const Meta& M, const float* q, float* out, float* part_o,
                        float* part_ml, int* arrived, int n_kv, int G, float scale_log2, LayerDev L) {
  return hd == 64 ? launch_swap<T, 64>(grid, st, M, q, out, part_o, part_ml, arrived, n_kv, G, scale_log2, L)
                  : launch_swap<T, 128>(grid, st, M, q, out, part_o, part_ml, arrived, n_kv, G, scale_log2, L);
}

// Keys of one tile of the kernel for head_dim hd with R warps a block.
int flash_keys(int hd, int R) {
  return with_head_dim(hd, [&](auto HD) { return R == 1 ? FlashShape<decltype(HD)::value, 1>::kKeys : FlashShape<decltype(HD)::value, 4>::kKeys; });
}

template <typename T, int HD, int R>
cudaError_t launch_flash(dim3 grid, cudaStream_t st, const Meta& M, const int32_t* tiles, const float* q, float* out,
                         float* part_o, float* part_ml, int* arrived, int n_kv, int G, float scale_log2, LayerDev L) {
  if (const cudaError_t e = flash_attr<T, HD, R>(); e != cudaSuccess) return e;
  return cuda::launch_pdl(flash_kernel<T, HD, R>, grid, dim3(FlashShape<HD, R>::kThreads), FlashShape<HD, R>::kSmemBytes, st, M,
                          tiles, q, out, part_o, part_ml, arrived, n_kv, G, scale_log2, L);
}

// The tensor-core kernel for a cache of T: head_dim 64, 128 or 256, R warps per block (1 or 4).
template <typename T>
cudaError_t launch_flash(int hd, int R, dim3 grid, cudaStream_t st, const Meta& M, const int32_t* tiles,
                         const float* q, float* out, float* part_o, float* part_ml, int* arrived, int n_kv, int G,
                         float scale_log2, LayerDev L) {
  return with_head_dim(hd, [&](auto HD) {
    return R == 1 ? launch_flash<T, decltype(HD)::value, 1>(grid, st, M, tiles, q, out, part_o, part_ml, arrived, n_kv, G, scale_log2, L)
                  : launch_flash<T, decltype(HD)::value, 4>(grid, st, M, tiles, q, out, part_o, part_ml, arrived, n_kv, G, scale_log2, L);
  });
}

template <typename T, int HD, int G>
void launch_attention(dim3 grid, cudaStream_t st, const Meta& M,
                      const float* q, float* out, float* part_o, float* part_ml, int n_kv, float scale_log2, LayerDev L) {
  cuda::launch_pdl(attention_kernel<T, HD, G>, grid, dim3(kWarps * 32), 0, st, M, q, out, part_o, part_ml, n_kv,
                   scale_log2, L);
}

template <typename T, int HD>
bool dispatch_g(int G, dim3 grid, cudaStream_t st, const Meta& M,
                const float* q, float* out, float* part_o, float* part_ml, int n_kv, float scale_log2, LayerDev L) {
  switch (G) {
    case 1: launch_attention<T, HD, 1>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 2: launch_attention<T, HD, 2>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 3: launch_attention<T, HD, 3>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 4: launch_attention<T, HD, 4>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 5: launch_attention<T, HD, 5>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 6: launch_attention<T, HD, 6>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 7: launch_attention<T, HD, 7>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    case 8: launch_attention<T, HD, 8>(grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L); return true;
    default: return false;
  }
}

template <typename T>
bool dispatch_hd(int HD, int G, dim3 grid, cudaStream_t st, const Meta& M, const float* q, float* out, float* part_o, float* part_ml, int n_kv,
                 float scale_log2, LayerDev L) {
  switch (HD) {
    case 64: return dispatch_g<T, 64>(G, grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L);
    case 128: return dispatch_g<T, 128>(G, grid, st, M, q, out, part_o, part_ml, n_kv, scale_log2, L);
    default: return false;
  }
}

// The batch's metadata, uploaded once per prepare(): [SeqDev x S][tok_seq x T][tiles 2 x n_tiles]
// [page tables]; launch() then only queues kernels (unless the sequences' arenas differ, as for
// contiguous caches: then each layer's SeqDev::k/v are patched in and the metadata re-uploaded).
class CudaAttentionPlan final : public DeviceAttentionPlan {
 public:
  explicit CudaAttentionPlan(CudaBackend& b) : b_(b) {}

  Status prepare(std::span<const SeqWork> work, int n_kv, int n_q, bool attend, AttentionImpl impl,
                 const AttentionRope* rope) override;
  Status launch(std::span<const SeqWork> layer_work, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor* out, const AttentionParams& params, const float* inv_freq) override;
  bool replayable() const override { return shared_arena_ && impl_ == AttentionImpl::kFlash; }
  uint64_t key() const override;

 private:
  Status upload_meta();

  CudaBackend& b_;
  std::vector<SeqDev> sd_;
  std::vector<int32_t> ints_;  // tok_seq, tiles, tables
  std::vector<char> blob_;
  Meta M_{};
  const int32_t* d_tiles_ = nullptr;
  float* part_o_ = nullptr;
  float* part_ml_ = nullptr;
  float* scores_ = nullptr;
  int* counters_ = nullptr;  // the last split's merge (fold_): kFoldCounters at the scratch's start
  int64_t tokens_ = 0, n_tiles_ = 0, n_decode_ = 0, max_ctx_ = 0;
  int n_kv_ = 0, n_q_ = 0, hd_ = 0, grid_splits_ = 1;
  DType dtype_ = DType::kF32;
  RopeDev rope_{nullptr, 0, false};
  AttentionImpl impl_ = AttentionImpl::kFlash;
  bool attend_ = false, shared_arena_ = true, tensor_cores_ = false, fold_ = false;
};

// Where the cache holds f16 or bf16, the head_dim is 64 or 128 and a GQA group has at most 64
// query heads, attention runs on tensor cores (flash_kernel): sequences with kPrefillMin or more
// new tokens in prefill tiles of 64 / G tokens, the other tokens (decode) one per block with
// split-KV. Otherwise (an f32 cache) attention_kernel runs the decode path for every token.
constexpr int kPrefillMin = 16, kPrefillRows = 64, kMaxTensorCoreGroup = 64;
// Decode splits: the grid's split count depends on the batch's decode token count only (so a
// batch's launches depend on its shape, not its contexts): for the tensor-core kernel from its
// resident-block capacity (prepare()), for the f32 one ~8 blocks per SM of an H200 (132 SMs).
// Each sequence uses up to that many, one per tile (tensor cores) or 64 keys of its own context.
// The partial results are capped at kMaxPartialBytes (a long prefill chunk batched with a decode
// would otherwise ask for gigabytes).
constexpr int64_t kTargetBlocks = 1056, kMinKeysPerSplit = 64, kMaxSplits = 128, kMaxPartialBytes = 64 << 20;

Status CudaAttentionPlan::prepare(std::span<const SeqWork> work, int n_kv, int n_q, bool attend, AttentionImpl impl,
                                  const AttentionRope* rope) {
  rope_ = rope ? RopeDev{rope->inv_freq, rope->rope_dim, rope->adjacent_pairs} : RopeDev{nullptr, 0, false};
  dtype_ = work[0].kv.dtype;
  hd_ = work[0].kv.head_dim;
  n_kv_ = n_kv, n_q_ = n_q, attend_ = attend, impl_ = impl;
  if (hd_ > 1024) return invalid_argument_error("attention (cuda): head_dim above 1024");
  if (dtype_ != DType::kF32 && dtype_ != DType::kF16 && dtype_ != DType::kBF16) {
    return invalid_argument_error("attention (cuda): cache dtype must be f32, f16 or bf16");
  }
  tokens_ = 0;
  max_ctx_ = 0;
  shared_arena_ = true;
  for (const SeqWork& w : work) {
    tokens_ += w.n_new;
    max_ctx_ = std::max(max_ctx_, w.pos + w.n_new);
    shared_arena_ &= w.kv.k == work[0].kv.k && w.kv.v == work[0].kv.v;
  }
  // The kernels index positions in 32 bits, including a tile's keys past the context's end (up to
  // 2,047 beyond it): positions stay below 2^31 - 4,096.
  if (max_ctx_ > INT32_MAX - 4096) return invalid_argument_error("attention (cuda): positions beyond 2^31 - 4096");
  const int G = n_q / n_kv, tile_tokens = std::max(kPrefillRows / G, 1);
  const bool tensor_cores = attend && impl == AttentionImpl::kFlash && flash_head_dim(hd_) &&
                            (dtype_ == DType::kF16 || dtype_ == DType::kBF16) && G <= kMaxTensorCoreGroup;
  tensor_cores_ = tensor_cores;
  n_tiles_ = 0;
  n_decode_ = tokens_;
  if (tensor_cores) {
    for (const SeqWork& w : work) {
      if (w.n_new < kPrefillMin) continue;
      n_decode_ -= w.n_new;
      n_tiles_ += (w.n_new + tile_tokens - 1) / tile_tokens;
    }
  }
  grid_splits_ = 1;
  int64_t min_keys = kMinKeysPerSplit;
  if (attend && impl == AttentionImpl::kFlash) {
    const int64_t base_blocks = std::max<int64_t>(n_decode_, 1) * n_kv;
    const int64_t per_split = std::max<int64_t>(tokens_ * n_q * (hd_ + 2) * 4, 1);
    const int64_t max_splits = std::clamp<int64_t>(kMaxPartialBytes / per_split, 1, kMaxSplits);
    if (tensor_cores) {
      // As many splits as fill the device's resident blocks once (a second, partial wave measured
      // slower: 1 x 32k 0.44 vs 0.57 of copy bandwidth); where a single split fills more than half
      // of them (64 sessions), two waves' worth (measured faster than one split: 7.3k vs 6.9k
      // tok/s for llama-8b).
      const int64_t capacity = swap_decode(hd_, G) ? swap_capacity(dtype_, hd_) : flash_capacity(dtype_, hd_, G <= 16 ? 1 : 4);
      const int64_t target = base_blocks > capacity / 2 ? 2 * capacity : capacity;
      grid_splits_ = static_cast<int>(std::clamp<int64_t>(target / base_blocks, 1, max_splits));
      // One tile of the decode kernel in use (4-warp blocks, for groups above 16 heads, take 64 keys).
      min_keys = flash_keys(hd_, G > 16 ? 4 : 1);
    } else {
      grid_splits_ = static_cast<int>(std::clamp<int64_t>((kTargetBlocks + base_blocks - 1) / base_blocks, 1, max_splits));
    }
  }
  sd_.clear();
  ints_.assign(static_cast<size_t>(tokens_ + 2 * n_tiles_), 0);
  int64_t tile = tokens_;
  for (size_t i = 0; i < work.size(); ++i) {
    const SeqWork& w = work[i];
    const int64_t end = w.pos + w.n_new;
    SeqDev d{};
    d.k = w.kv.k, d.v = w.kv.v, d.page_stride = w.kv.page_stride, d.head_stride = w.kv.head_stride;
    d.page_size = static_cast<int32_t>(w.kv.page_size);
    d.pad = (w.kv.page_size & (w.kv.page_size - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(w.kv.page_size)) : -1;
    d.table_off = static_cast<int32_t>(ints_.size() - static_cast<size_t>(tokens_ + 2 * n_tiles_));
    d.row = static_cast<int32_t>(w.row), d.pos = static_cast<int32_t>(w.pos), d.n_new = static_cast<int32_t>(w.n_new);
    d.splits = static_cast<int32_t>(std::clamp<int64_t>(end / min_keys, 1, grid_splits_));
    sd_.push_back(d);
    for (int64_t r = w.row; r < w.row + w.n_new; ++r) ints_[static_cast<size_t>(r)] = static_cast<int32_t>(i);
    if (tensor_cores && w.n_new >= kPrefillMin) {
      for (int64_t r0 = 0; r0 < w.n_new; r0 += tile_tokens, tile += 2) {
        ints_[static_cast<size_t>(tile)] = static_cast<int32_t>(i);
        ints_[static_cast<size_t>(tile + 1)] = static_cast<int32_t>(r0);
      }
    }
    const int64_t n_pages = (end + w.kv.page_size - 1) / w.kv.page_size;
    ints_.insert(ints_.end(), w.kv.page_table, w.kv.page_table + n_pages);
  }
  if (shared_arena_)
    for (SeqDev& d : sd_) d.k = d.v = nullptr;  // from Meta
  M_.prefill_min = tensor_cores ? kPrefillMin : INT32_MAX;
  COMBS_RETURN_IF_ERROR(upload_meta());
  // Partial results of the splits, or the reference's scores.
  const size_t part_o_bytes = grid_splits_ > 1 && n_decode_ > 0 ? static_cast<size_t>(tokens_ * n_q * grid_splits_ * hd_) * 4 : 0;
  const size_t part_ml_bytes = grid_splits_ > 1 && n_decode_ > 0 ? static_cast<size_t>(tokens_ * n_q * grid_splits_ * 2) * 4 : 0;
  const size_t manual_bytes = attend && impl == AttentionImpl::kManual ? static_cast<size_t>(tokens_ * n_q * max_ctx_) * 4 : 0;
  // Slot 2 of the scratch (this plan's alone): the partials or the reference's scores.
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  // The counters first, always there (zeroed when the slot is allocated; each merge leaves its own
  // at zero), so that no plan's partials land on them.
  constexpr size_t kCounterBytes = kFoldCounters * sizeof(int);
  COMBS_ASSIGN_OR_RETURN(void* scratch, b_.scratch(kCounterBytes + align(part_o_bytes) + align(part_ml_bytes) + manual_bytes + 256,
                                                   CudaBackend::kAttentionSlot));
  counters_ = static_cast<int*>(scratch);
  fold_ = tensor_cores && grid_splits_ > 1 && grid_splits_ <= kFoldMaxSplits && tokens_ * n_kv <= kFoldCounters;
  part_o_ = reinterpret_cast<float*>(static_cast<char*>(scratch) + kCounterBytes);
  part_ml_ = reinterpret_cast<float*>(reinterpret_cast<char*>(part_o_) + align(part_o_bytes));
  scores_ = reinterpret_cast<float*>(reinterpret_cast<char*>(part_ml_) + align(part_ml_bytes));
  return ok_status();
}

Status CudaAttentionPlan::upload_meta() {
  const size_t sd_bytes = sd_.size() * sizeof(SeqDev), int_bytes = ints_.size() * sizeof(int32_t);
  blob_.resize(sd_bytes + int_bytes);
  std::memcpy(blob_.data(), sd_.data(), sd_bytes);
  std::memcpy(blob_.data() + sd_bytes, ints_.data(), int_bytes);
  COMBS_ASSIGN_OR_RETURN(void* meta, b_.upload(CudaBackend::kAttentionMetaSlot, blob_.data(), blob_.size()));
  M_.seqs = static_cast<const SeqDev*>(meta);
  M_.tok_seq = reinterpret_cast<const int32_t*>(static_cast<char*>(meta) + sd_bytes);
  d_tiles_ = M_.tok_seq + tokens_;
  M_.tables = d_tiles_ + 2 * n_tiles_;
  return ok_status();
}

uint64_t CudaAttentionPlan::key() const {
  // Everything launch() passes to a kernel besides the layer's arenas.
  const uint64_t fields[] = {reinterpret_cast<uintptr_t>(M_.seqs), reinterpret_cast<uintptr_t>(part_o_),
                             static_cast<uint64_t>(sd_.size()), static_cast<uint64_t>(tokens_),
                             static_cast<uint64_t>(n_tiles_), static_cast<uint64_t>(n_decode_),
                             static_cast<uint64_t>(grid_splits_), static_cast<uint64_t>(M_.prefill_min),
                             static_cast<uint64_t>(n_kv_) << 32 | static_cast<uint32_t>(n_q_),
                             static_cast<uint64_t>(hd_) << 8 | static_cast<uint64_t>(dtype_),
                             static_cast<uint64_t>(fold_) << 2 | static_cast<uint64_t>(attend_) << 1 | static_cast<uint64_t>(tensor_cores_),
                             reinterpret_cast<uintptr_t>(rope_.inv_freq),
                             static_cast<uint64_t>(rope_.rope_dim) << 1 | static_cast<uint64_t>(rope_.adjacent)};
  uint64_t h = 0;
  for (uint64_t f : fields) h = hash_mix(h, f);
  return h;
}

Status CudaAttentionPlan::launch(std::span<const SeqWork> work, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor* out, const AttentionParams& params, const float* inv_freq) {
  auto st = static_cast<cudaStream_t>(b_.stream());
  const float scale = params.scale;
  if (params.window > INT32_MAX) return invalid_argument_error("attention (cuda): window beyond 2^31");
  const LayerDev L{static_cast<int>(params.window), params.softcap * kLog2e, params.sinks};
  RopeDev rope = rope_;
  if (inv_freq && rope.inv_freq) rope.inv_freq = inv_freq;
  rope.mscale = params.rope_mscale;
  if (k.dtype() != DType::kF32 || v.dtype() != DType::kF32 || (out && (q.dtype() != DType::kF32 || out->dtype() != DType::kF32))) {
    return invalid_argument_error("attention (cuda): q, k, v and out must be f32");
  }
  if (tokens_ == 0) return ok_status();
  if (out && reinterpret_cast<uintptr_t>(out->data()) % 16 != 0) {  // the kernels store float4s
    return invalid_argument_error("attention (cuda): out must be 16-byte aligned");
  }
  if (shared_arena_) {
    M_.k = work[0].kv.k;
    M_.v = work[0].kv.v;
  } else {  // each sequence's own arena: this layer's pointers into the metadata
    for (size_t i = 0; i < sd_.size(); ++i) sd_[i].k = work[i].kv.k, sd_[i].v = work[i].kv.v;
    COMBS_RETURN_IF_ERROR(upload_meta());
  }
  const int hd = hd_, n_kv = n_kv_, n_q = n_q_;
  const dim3 wgrid(static_cast<unsigned>(tokens_), static_cast<unsigned>(n_kv));
  const unsigned wthreads = static_cast<unsigned>((hd + 31) / 32 * 32);
  float* qr = rope.inv_freq ? q.data_as<float>() : nullptr;  // rotated in place
  switch (dtype_) {
    case DType::kF32: cuda::launch_pdl(write_kv_kernel<float>, wgrid, dim3(wthreads), 0, st, M_, qr, k.data_as<float>(), v.data_as<float>(), n_kv, n_q, hd, rope); break;
    case DType::kF16: cuda::launch_pdl(write_kv_kernel<__half>, wgrid, dim3(wthreads), 0, st, M_, qr, k.data_as<float>(), v.data_as<float>(), n_kv, n_q, hd, rope); break;
    default: cuda::launch_pdl(write_kv_kernel<__nv_bfloat16>, wgrid, dim3(wthreads), 0, st, M_, qr, k.data_as<float>(), v.data_as<float>(), n_kv, n_q, hd, rope); break;
  }
  COMBS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (!out || !attend_) return ok_status();
  const Meta& M = M_;

  if (impl_ == AttentionImpl::kManual) {
    const dim3 grid(static_cast<unsigned>(tokens_), static_cast<unsigned>(n_q));
    switch (dtype_) {
      case DType::kF32: manual_attention_kernel<float><<<grid, 256, 0, st>>>(M, q.data_as<float>(), out->data_as<float>(), scores_, n_kv, n_q, hd, max_ctx_, scale, L); break;
      case DType::kF16: manual_attention_kernel<__half><<<grid, 256, 0, st>>>(M, q.data_as<float>(), out->data_as<float>(), scores_, n_kv, n_q, hd, max_ctx_, scale, L); break;
      default: manual_attention_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(M, q.data_as<float>(), out->data_as<float>(), scores_, n_kv, n_q, hd, max_ctx_, scale, L); break;
    }
    COMBS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ok_status();
  }
  const float scale_log2 = scale * kLog2e;
  const int G = n_q / n_kv;
  const bool f16 = dtype_ == DType::kF16;
  if (n_tiles_ > 0) {
    const dim3 pgrid(static_cast<unsigned>(n_tiles_), static_cast<unsigned>(n_kv));
    COMBS_CUDA_RETURN_IF_ERROR(
        f16 ? launch_flash<__half>(hd, 4, pgrid, st, M, d_tiles_, q.data_as<float>(), out->data_as<float>(), nullptr,
                                   nullptr, nullptr, n_kv, G, scale_log2, L)
            : launch_flash<__nv_bfloat16>(hd, 4, pgrid, st, M, d_tiles_, q.data_as<float>(), out->data_as<float>(),
                                          nullptr, nullptr, nullptr, n_kv, G, scale_log2, L));
  }
  if (n_decode_ == 0) return ok_status();
  const dim3 grid(static_cast<unsigned>(tokens_), static_cast<unsigned>(n_kv), static_cast<unsigned>(grid_splits_));
  bool ok = true;
  if (tensor_cores_) {
    const int R = G <= 16 ? 1 : 4;
    int* arrived = fold_ ? counters_ : nullptr;
    if (swap_decode(hd, G)) {
      COMBS_CUDA_RETURN_IF_ERROR(
          f16 ? launch_swap<__half>(hd, grid, st, M, q.data_as<float>(), out->data_as<float>(), part_o_, part_ml_, arrived,
                                    n_kv, G, scale_log2, L)
              : launch_swap<__nv_bfloat16>(hd, grid, st, M, q.data_as<float>(), out->data_as<float>(), part_o_, part_ml_,
                                           arrived, n_kv, G, scale_log2, L));
    } else {
      COMBS_CUDA_RETURN_IF_ERROR(
          f16 ? launch_flash<__half>(hd, R, grid, st, M, nullptr, q.data_as<float>(), out->data_as<float>(), part_o_,
                                     part_ml_, arrived, n_kv, G, scale_log2, L)
              : launch_flash<__nv_bfloat16>(hd, R, grid, st, M, nullptr, q.data_as<float>(), out->data_as<float>(),
                                            part_o_, part_ml_, arrived, n_kv, G, scale_log2, L));
    }
  } else {
    ok = dtype_ == DType::kF32 &&
         dispatch_hd<float>(hd, G, grid, st, M, q.data_as<float>(), out->data_as<float>(), part_o_, part_ml_, n_kv, scale_log2, L);
  }
  if (!ok) {
    return unimplemented_error("attention (cuda): head_dim " + std::to_string(hd) + " with " + std::to_string(G) +
                               " query heads per KV head in a " + std::string(dtype_name(dtype_)) +
                               " cache (kernels: head_dim 64 or 128, f16/bf16 caches also 256, up to 64 heads per KV head; "
                               "f32 caches 1 to 8; COMBS_ATTN=manual runs any)");
  }
  COMBS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (grid_splits_ > 1 && !fold_) {  // (fold_: tensor cores only)
    if (hd > 256) return internal_error("attention (cuda): split merge of head_dim above 256");
    const unsigned mthreads = static_cast<unsigned>((hd / 4 + 31) / 32 * 32);
    cuda::launch_pdl(merge_splits_kernel, dim3(static_cast<unsigned>(tokens_ * n_q)), dim3(mthreads, kMergeGroups), 0, st, M, part_o_,
                     part_ml_, out->data_as<float>(), grid_splits_, hd, n_q, L);
    COMBS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return ok_status();
}

std::unique_ptr<DeviceAttentionPlan> make_plan(Backend& backend) {
  return std::make_unique<CudaAttentionPlan>(static_cast<CudaBackend&>(backend));
}

}  // namespace

void register_cuda_attention() {
  // (Once: tensor-parallel ranks create their runners on several threads at once.)
  static std::once_flag once;
  std::call_once(once, [] { set_device_attention(DeviceType::kCuda, &make_plan); });
}

}  // namespace combs
