// Token sampling on the device (cuda::sample_rows, see cuda_ops.h): the steps of Sampler::sample
// — logit bias, penalties, temperature, top-k, softmax, min-p, top-p, a draw in descending
// probability order — without sorting the vocabulary. One block per row.
//
// Every cut (top-k, top-p, the draw) asks the same question: walking the candidates in sorted
// order (value descending, index ascending on ties), where does the running total of a weight
// (1 for top-k, probability mass for top-p and the draw) reach a target? It is answered by a radix
// select over the values' order-preserving 32-bit keys, 8 bits per pass, each pass a histogram of
// weights in shared memory, then one pass that finds the tied element (same value) by index. Mass
// is fixed point (p * 2^40, 64-bit integers), so every sum is exact and its order does not matter:
// the same logits and draw give the same token, run after run.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "block_reduce.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"

namespace combs::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr double kMassOne = 1099511627776.0;  // 2^40: probability 1 in fixed point

struct Row {
  const float* l;
  int64_t n;
  float temperature, max_s;
};

__device__ inline float scaled(const Row& r, int64_t i) { return r.l[i] / r.temperature; }
// Ascending key = descending value.
__device__ inline uint32_t key_of(float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t asc = (b & 0x80000000u) ? ~b : b | 0x80000000u;
  return ~asc;
}
__device__ inline float value_of(uint32_t key) {
  const uint32_t asc = ~key;
  return __uint_as_float((asc & 0x80000000u) ? asc & 0x7fffffffu : ~asc);
}
__device__ inline float prob(const Row& r, float s) { return expf(s - r.max_s); }
__device__ inline uint64_t mass(float p) { return static_cast<uint64_t>(static_cast<double>(p) * kMassOne + 0.5); }

// Kept after a cut: before it in sorted order, or tied with it at or before its index.
struct Cut {
  uint32_t key = 0xffffffffu;
  int64_t idx = INT64_MAX;  // default: keeps everything
  __device__ bool keeps(uint32_t k, int64_t i) const { return k < key || (k == key && i <= idx); }
};

struct Filters {
  Cut top_k, top_p;
  float min_p = 0.0f;
  __device__ bool keeps(const Row& r, int64_t i, float s, uint32_t k) const {
    return top_k.keeps(k, i) && (min_p <= 0.0f || prob(r, s) >= min_p) && top_p.keeps(k, i);
  }
};

// The cut where the running weight over the kept candidates first reaches `target` (pass =
// false: total >= target; true: total > target). counting: weight 1, else probability mass.
// *total_out (when set) gets the total weight of the kept candidates.
__device__ Cut find_cut(const Row& r, const Filters& f, bool counting, uint64_t target, bool pass, uint64_t* hist,
                        uint64_t* scratch, uint64_t* total_out) {
  __shared__ uint32_t s_prefix;
  __shared__ uint64_t s_target;
  __shared__ int64_t s_idx;
  if (threadIdx.x == 0) s_prefix = 0, s_target = target;
  for (int pass_i = 0; pass_i < 4; ++pass_i) {
    const int shift = 24 - 8 * pass_i;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    // Warp-aggregated: the lanes of one bin add their weights together (logits crowd a few bins).
    for (int64_t i0 = 0; i0 < r.n; i0 += blockDim.x) {
      const int64_t i = i0 + threadIdx.x;
      uint32_t bin = 256;
      uint64_t w = 0;
      if (i < r.n) {
        const float s = scaled(r, i);
        const uint32_t k = key_of(s);
        if ((pass_i == 0 || (k >> (shift + 8)) == prefix) && f.keeps(r, i, s, k)) {
          bin = (k >> shift) & 0xff;
          w = counting ? 1 : mass(prob(r, s));
        }
      }
      const unsigned peers = __match_any_sync(0xffffffff, bin);
      uint64_t sum;
      if (counting) {
        sum = static_cast<uint64_t>(__popc(peers));
      } else {  // w <= 2^40: three 20-bit parts, each summed over <= 32 lanes without overflow
        sum = static_cast<uint64_t>(__reduce_add_sync(peers, static_cast<unsigned>(w & 0xfffff))) +
              (static_cast<uint64_t>(__reduce_add_sync(peers, static_cast<unsigned>((w >> 20) & 0xfffff))) << 20) +
              (static_cast<uint64_t>(__reduce_add_sync(peers, static_cast<unsigned>(w >> 40))) << 40);
      }
      if (bin < 256 && static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) {
        atomicAdd(reinterpret_cast<unsigned long long*>(&hist[bin]), static_cast<unsigned long long>(sum));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint64_t cum = 0, t = s_target;
      int b = 0;
      if (pass_i == 0 && total_out) {
        uint64_t all = 0;
        for (int j = 0; j < 256; ++j) all += hist[j];
        *total_out = all;
      }
      for (; b < 255; ++b) {
        if (pass ? cum + hist[b] > t : cum + hist[b] >= t) break;
        cum += hist[b];
      }
      s_target = t - cum;
      s_prefix = (prefix << 8) | static_cast<uint32_t>(b);
    }
    __syncthreads();
  }
  // Ties: every kept candidate with this key has the same weight; take the m-th by index.
  const uint32_t key = s_prefix;
  const uint64_t w = counting ? 1 : mass(prob(r, value_of(key)));
  const uint64_t rem = s_target;
  uint64_t m = w == 0 ? 1 : pass ? rem / w + 1 : (rem + w - 1) / w;
  if (m == 0) m = 1;
  // Contiguous chunks per thread: count, scan, find.
  const int64_t chunk = (r.n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * chunk, hi = min(r.n, lo + chunk);
  uint64_t mine = 0;
  int64_t last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const float s = scaled(r, i);
    const uint32_t k = key_of(s);
    if (k == key && f.keeps(r, i, s, k)) ++mine, last = i;
  }
  // Exclusive scan of the counts (in thread order = index order).
  scratch[threadIdx.x] = mine;
  if (threadIdx.x == 0) s_idx = -1;
  __syncthreads();
  for (int o = 1; o < kThreads; o <<= 1) {
    const uint64_t add = threadIdx.x >= o ? scratch[threadIdx.x - o] : 0;
    __syncthreads();
    scratch[threadIdx.x] += add;
    __syncthreads();
  }
  const uint64_t before = scratch[threadIdx.x] - mine, all = scratch[kThreads - 1];
  if (m > all) m = all;  // rounding: at most every tie
  if (mine > 0 && before < m && m <= before + mine) {
    uint64_t seen = before;
    for (int64_t i = lo; i < hi; ++i) {
      const float s = scaled(r, i);
      const uint32_t k = key_of(s);
      if (k == key && f.keeps(r, i, s, k) && ++seen == m) {
        s_idx = i;
        break;
      }
    }
  }
  if (all == 0 && threadIdx.x == 0) s_idx = last;  // unreachable with a kept candidate
  __syncthreads();
  return Cut{key, s_idx};
}

__global__ void __launch_bounds__(kThreads) sample_kernel(float* __restrict__ logits, int64_t n_vocab,
                                                          const SampleParamsDev* __restrict__ rows,
                                                          const SampleAdjustDev* __restrict__ adjust,
                                                          int32_t* __restrict__ out) {
  __shared__ uint64_t hist[256];
  __shared__ uint64_t scratch[kThreads];
  __shared__ float fred[32];
  __shared__ int64_t ired[32];
  __shared__ uint64_t s_total;
  const SampleParamsDev P = rows[blockIdx.x];
  float* l = logits + static_cast<int64_t>(blockIdx.x) * n_vocab;
  // Logit bias in order (a token may appear twice), then the penalties (distinct tokens).
  if (threadIdx.x == 0) {
    for (int j = 0; j < P.n_bias; ++j) l[adjust[P.bias_at + j].token] += adjust[P.bias_at + j].value;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < P.n_penalized; j += blockDim.x) {
    const SampleAdjustDev a = adjust[P.penalized_at + j];
    float x = l[a.token];
    x = x > 0.0f ? x / P.repetition : x * P.repetition;
    x -= P.presence + P.frequency * static_cast<float>(a.count);
    l[a.token] = x;
  }
  __syncthreads();
  if (P.temperature == 0.0f) {  // greedy: the argmax, the lowest index on ties
    ArgMax a;
    for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) a.take(l[i], i);
    const int64_t first = block_argmax(a, fred, ired);
    if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(first < n_vocab ? first : 0);
    return;
  }
  Row r{l, n_vocab, P.temperature, 0.0f};
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) mx = fmaxf(mx, scaled(r, i));
  r.max_s = block_reduce(mx, [](float a, float b) { return fmaxf(a, b); }, -INFINITY, fred);
  Filters f;
  uint64_t z = 0;  // mass after top-k (top-p's 100%)
  if (P.top_k > 0 && P.top_k < n_vocab) {
    f.top_k = find_cut(r, f, true, static_cast<uint64_t>(P.top_k), false, hist, scratch, nullptr);
  }
  if (P.top_p < 1.0f) {
    uint64_t mass_sum = 0;
    for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) {
      const float s = scaled(r, i);
      if (f.top_k.keeps(key_of(s), i)) mass_sum += mass(prob(r, s));
    }
    z = block_reduce(mass_sum, [](uint64_t a, uint64_t b) { return a + b; }, uint64_t{0}, scratch);
    f.min_p = P.min_p;
    const uint64_t target = static_cast<uint64_t>(static_cast<double>(P.top_p) * static_cast<double>(z));
    f.top_p = find_cut(r, f, false, target > 0 ? target : 1, false, hist, scratch, nullptr);
  }
  f.min_p = P.min_p;
  // The draw: the kept candidate where the running mass passes u * (their total).
  uint64_t total_mass = 0;
  for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) {
    const float s = scaled(r, i);
    if (f.keeps(r, i, s, key_of(s))) total_mass += mass(prob(r, s));
  }
  total_mass = block_reduce(total_mass, [](uint64_t a, uint64_t b) { return a + b; }, uint64_t{0}, scratch);
  uint64_t draw = static_cast<uint64_t>(P.uniform * static_cast<double>(total_mass));
  if (draw >= total_mass) draw = total_mass > 0 ? total_mass - 1 : 0;
  const Cut pick = find_cut(r, f, false, draw, true, hist, scratch, &s_total);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(pick.idx >= 0 && pick.idx < n_vocab ? pick.idx : 0);
}

}  // namespace

Status sample_rows(CudaBackend& b, float* logits, int64_t rows, int64_t n_vocab, const SampleParamsDev* params,
                   const SampleAdjustDev* adjust, int32_t* out) {
  if (rows == 0) return ok_status();
  sample_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(b.stream())>>>(
      logits, n_vocab, params, adjust, out);
  return cuda_status(cudaGetLastError(), "sample_kernel");
}

}  // namespace combs::cuda
