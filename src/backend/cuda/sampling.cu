// Token sampling on the device (cuda::sample_rows, see cuda_ops.h): the steps of Sampler::sample
// — logit bias, penalties, temperature, top-k, softmax, min-p, top-p, a draw in descending
// probability order — without sorting the vocabulary.
//
// Every cut (top-k, top-p, the draw) asks the same question: walking the candidates in sorted
// order (value descending, index ascending on ties), where does the running total of a weight
// (1 for top-k, probability mass for top-p and the draw) reach a target? It is answered by a radix
// select over the values' order-preserving 32-bit keys, 8 bits per pass, each pass a histogram of
// weights, then one pass that finds the tied element (same value) by index. Mass is fixed point
// (p * 2^40, 64-bit integers), so every sum is exact and its order does not matter: the same
// logits and draw give the same token, run after run, however the work is split.
//
// A row is split over several blocks (a group; a row of 128k logits is ~20 passes over the
// vocabulary, far too much for one SM's block: 2 ms a token, measured): each block takes a slice
// of the row, its histograms added into the group's in global memory, and the blocks of the whole
// grid meet at a barrier between passes (a cooperative launch: all blocks resident). Rows beyond
// the groups are taken in turns; every block passes every barrier of every turn.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_reduce.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"

namespace combs::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxGroupBlocks = 64;  // blocks a row at most
constexpr double kMassOne = 1099511627776.0;  // 2^40: probability 1 in fixed point

struct Row {
  const float* l;
  int64_t n;
  float temperature, max_s;
};

// (__ldcg: the group's first block may have changed the row, past another SM's L1.)
__device__ inline float scaled(const Row& r, int64_t i) { return __ldcg(r.l + i) / r.temperature; }
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

// A group's work area in global memory (zeroed by its blocks at the start of each turn).
struct GroupWork {
  unsigned long long hist[3][4][256];      // per cut (top-k, top-p, draw), per radix pass
  unsigned long long part[4][kMaxGroupBlocks];  // per block: top-p's mass, the draw's mass, ties
  float best[kMaxGroupBlocks];             // per block: the slice's max (or argmax value)
  long long best_idx[kMaxGroupBlocks];     // the slice's argmax index
  long long tie_idx[3];                    // per cut: the tied element found
};

// What a block of a group works on: its row, its slice [lo, hi) of the row, the grid's barrier.
struct Ctx {
  GroupWork* g;
  int block, blocks;  // this block's place in its group, the group's blocks
  int64_t lo, hi;
  unsigned* barrier;
  unsigned passed;  // barriers this block has passed (each adds gridDim.x to the count)
};

// Every block of the grid meets here; global writes before it are seen after it (read them with
// __ldcg: the L1 is not coherent across SMs).
__device__ void grid_barrier(Ctx& c) {
  __syncthreads();
  c.passed += gridDim.x;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c.barrier, 1u);
    while (*reinterpret_cast<volatile unsigned*>(c.barrier) < c.passed) __nanosleep(20);
    __threadfence();
  }
  __syncthreads();
}

// The cut where the running weight over the kept candidates first reaches `target` (pass =
// false: total >= target; true: total > target). counting: weight 1, else probability mass.
// Every block of the group calls it (and every block of the grid passes its barriers: run =
// false skips the work, not the barriers); each returns the same cut.
__device__ Cut find_cut(Ctx& c, bool run, int cut, const Row& r, const Filters& f, bool counting, uint64_t target,
                        bool pass, uint64_t* hist, uint64_t* scratch) {
  __shared__ uint32_t s_prefix;
  __shared__ uint64_t s_target;
  if (threadIdx.x == 0) s_prefix = 0, s_target = target;
  for (int pass_i = 0; pass_i < 4; ++pass_i) {
    const int shift = 24 - 8 * pass_i;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    // Warp-aggregated: the lanes of one bin add their weights together (logits crowd a few bins).
    for (int64_t i0 = c.lo; run && i0 < c.hi; i0 += blockDim.x) {
      const int64_t i = i0 + threadIdx.x;
      uint32_t bin = 256;
      uint64_t w = 0;
      if (i < c.hi) {
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
    unsigned long long* group_hist = c.g->hist[cut][pass_i];
    for (int b = threadIdx.x; run && b < 256; b += blockDim.x) {
      if (hist[b]) atomicAdd(&group_hist[b], hist[b]);
    }
    grid_barrier(c);
    // Every block the same choice from the group's histogram (loaded at once, then scanned).
    for (int b = threadIdx.x; run && b < 256; b += blockDim.x) hist[b] = __ldcg(&group_hist[b]);
    __syncthreads();
    if (run && threadIdx.x == 0) {
      uint64_t cum = 0, t = s_target;
      int b = 0;
      for (; b < 255; ++b) {
        if (pass ? cum + hist[b] > t : cum + hist[b] >= t) break;
        cum += hist[b];
      }
      s_target = t - cum;
      s_prefix = (prefix << 8) | static_cast<uint32_t>(b);
    }
    __syncthreads();
  }
  // Ties: every kept candidate with this key has the same weight; take the m-th by index. The
  // slices ascend with the blocks and, within one, the threads' contiguous chunks: count, scan
  // (the blocks' counts through the group's work area), find.
  const uint32_t key = s_prefix;
  const uint64_t w = counting ? 1 : mass(prob(r, value_of(key)));
  const uint64_t rem = s_target;
  uint64_t m = w == 0 ? 1 : pass ? rem / w + 1 : (rem + w - 1) / w;
  if (m == 0) m = 1;
  const int64_t chunk = (c.hi - c.lo + blockDim.x - 1) / blockDim.x;
  const int64_t lo = c.lo + threadIdx.x * chunk, hi = min(c.hi, lo + chunk);
  uint64_t mine = 0;
  for (int64_t i = lo; run && i < hi; ++i) {
    const float s = scaled(r, i);
    const uint32_t k = key_of(s);
    if (k == key && f.keeps(r, i, s, k)) ++mine;
  }
  scratch[threadIdx.x] = mine;
  __syncthreads();
  for (int o = 1; o < kThreads; o <<= 1) {
    const uint64_t add = threadIdx.x >= o ? scratch[threadIdx.x - o] : 0;
    __syncthreads();
    scratch[threadIdx.x] += add;
    __syncthreads();
  }
  const uint64_t in_block = scratch[kThreads - 1];
  if (threadIdx.x == 0) {
    c.g->part[2][c.block] = in_block;
    if (c.block == 0) c.g->tie_idx[cut] = -1;
  }
  grid_barrier(c);
  uint64_t* counts = hist;  // (the histogram's room: done with)
  for (int b = threadIdx.x; b < c.blocks; b += blockDim.x) counts[b] = __ldcg(&c.g->part[2][b]);
  __syncthreads();
  uint64_t before_block = 0, all = 0;
  for (int b = 0; b < c.blocks; ++b) {
    if (b < c.block) before_block += counts[b];
    all += counts[b];
  }
  if (m > all) m = all;  // rounding: at most every tie
  const uint64_t before = before_block + scratch[threadIdx.x] - mine;
  if (run && mine > 0 && before < m && m <= before + mine) {
    uint64_t seen = before;
    for (int64_t i = lo; i < hi; ++i) {
      const float s = scaled(r, i);
      const uint32_t k = key_of(s);
      if (k == key && f.keeps(r, i, s, k) && ++seen == m) {
        c.g->tie_idx[cut] = i;
        break;
      }
    }
  }
  grid_barrier(c);
  return Cut{key, __ldcg(&c.g->tie_idx[cut])};  // (-1 only with no kept candidate: unreachable)
}

// The sum over the group's blocks of each block's v (one barrier; room: kMaxGroupBlocks shared).
__device__ uint64_t group_sum(Ctx& c, uint64_t v, int slot, uint64_t* room) {
  if (threadIdx.x == 0) c.g->part[slot][c.block] = v;
  grid_barrier(c);
  for (int b = threadIdx.x; b < c.blocks; b += blockDim.x) room[b] = __ldcg(&c.g->part[slot][b]);
  __syncthreads();
  uint64_t all = 0;
  for (int b = 0; b < c.blocks; ++b) all += room[b];
  __syncthreads();  // room is the caller's again
  return all;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(float* __restrict__ logits, int64_t n_vocab, int64_t rows,
                                                          const SampleParamsDev* __restrict__ params,
                                                          const SampleAdjustDev* __restrict__ adjust,
                                                          int32_t* __restrict__ out, int group_blocks,
                                                          GroupWork* __restrict__ work, unsigned* barrier) {
  __shared__ uint64_t hist[256];
  __shared__ uint64_t scratch[kThreads];
  __shared__ float fred[kMaxGroupBlocks];
  __shared__ int64_t ired[32];
  const int64_t groups = gridDim.x / group_blocks;
  const int64_t group = blockIdx.x / group_blocks;
  Ctx c{work + group, static_cast<int>(blockIdx.x % group_blocks), group_blocks, 0, 0, barrier, 0};
  const int64_t slice = (n_vocab + group_blocks - 1) / group_blocks;
  c.lo = min(n_vocab, c.block * slice), c.hi = min(n_vocab, c.lo + slice);
  const int64_t turns = (rows + groups - 1) / groups;
  for (int64_t turn = 0; turn < turns; ++turn) {
    const int64_t row = group + turn * groups;
    const bool live = row < rows;
    const SampleParamsDev P = live ? params[row] : SampleParamsDev{};
    float* l = logits + (live ? row : 0) * n_vocab;
    // The group's work area zeroed; the logit bias in order (a token may appear twice), then the
    // penalties (distinct tokens), by the group's first block.
    unsigned long long* words = &c.g->hist[0][0][0];
    for (int64_t i = static_cast<int64_t>(c.block) * blockDim.x + threadIdx.x; i < 3 * 4 * 256;
         i += static_cast<int64_t>(group_blocks) * blockDim.x) {
      words[i] = 0;
    }
    if (live && c.block == 0) {
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
    }
    grid_barrier(c);
    const bool greedy = P.temperature == 0.0f;
    const bool sampled = live && !greedy;
    // The slice's argmax (greedy: the lowest index on ties) or max of the scaled logits.
    Row r{l, n_vocab, greedy ? 1.0f : P.temperature, 0.0f};
    if (live) {
      ArgMax a;
      if (greedy) {
        for (int64_t i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) a.take(__ldcg(l + i), i);
        const int64_t at = block_argmax(a, fred, ired);
        a.value = at < n_vocab ? __ldcg(l + at) : -INFINITY, a.index = at;
      } else {
        for (int64_t i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) a.value = fmaxf(a.value, __ldcg(l + i) / r.temperature);
        a.value = block_reduce(a.value, [](float x, float y) { return fmaxf(x, y); }, -INFINITY, fred);
      }
      if (threadIdx.x == 0) c.g->best[c.block] = a.value, c.g->best_idx[c.block] = a.index;
    }
    grid_barrier(c);
    float* best = fred;  // (kMaxGroupBlocks of room in fred and scratch: loaded at once)
    int64_t* best_idx = reinterpret_cast<int64_t*>(scratch);
    for (int b = threadIdx.x; live && b < group_blocks; b += blockDim.x) {
      best[b] = __ldcg(&c.g->best[b]), best_idx[b] = __ldcg(&c.g->best_idx[b]);
    }
    __syncthreads();
    if (live) {
      ArgMax a;
      for (int b = 0; b < group_blocks; ++b) {
        if (greedy) {
          a.take(best[b], best_idx[b]);
        } else {
          a.value = fmaxf(a.value, best[b]);
        }
      }
      if (greedy && c.block == 0 && threadIdx.x == 0) out[row] = static_cast<int32_t>(a.index < n_vocab ? a.index : 0);
      r.max_s = a.value;
    }
    Filters f;
    const bool top_k = sampled && P.top_k > 0 && P.top_k < n_vocab;
    f.top_k = find_cut(c, top_k, 0, r, f, true, static_cast<uint64_t>(P.top_k), false, hist, scratch);
    if (!top_k) f.top_k = Cut{};
    // Top-p: the mass kept by top-k (100%), then the cut at top_p of it.
    const bool top_p = sampled && P.top_p < 1.0f;
    uint64_t mass_sum = 0;
    for (int64_t i = c.lo + threadIdx.x; top_p && i < c.hi; i += blockDim.x) {
      const float s = scaled(r, i);
      if (f.top_k.keeps(key_of(s), i)) mass_sum += mass(prob(r, s));
    }
    mass_sum = block_reduce(mass_sum, [](uint64_t a, uint64_t b) { return a + b; }, uint64_t{0}, scratch);
    const uint64_t z = group_sum(c, mass_sum, 0, hist);
    f.min_p = P.min_p;
    const uint64_t target = static_cast<uint64_t>(static_cast<double>(P.top_p) * static_cast<double>(z));
    f.top_p = find_cut(c, top_p, 1, r, f, false, target > 0 ? target : 1, false, hist, scratch);
    if (!top_p) f.top_p = Cut{};
    f.min_p = P.min_p;
    // The draw: the kept candidate where the running mass passes u * (their total).
    uint64_t total_mass = 0;
    for (int64_t i = c.lo + threadIdx.x; sampled && i < c.hi; i += blockDim.x) {
      const float s = scaled(r, i);
      if (f.keeps(r, i, s, key_of(s))) total_mass += mass(prob(r, s));
    }
    total_mass = block_reduce(total_mass, [](uint64_t a, uint64_t b) { return a + b; }, uint64_t{0}, scratch);
    total_mass = group_sum(c, total_mass, 1, hist);
    uint64_t draw = static_cast<uint64_t>(P.uniform * static_cast<double>(total_mass));
    if (draw >= total_mass) draw = total_mass > 0 ? total_mass - 1 : 0;
    const Cut pick = find_cut(c, sampled, 2, r, f, false, draw, true, hist, scratch);
    if (sampled && c.block == 0 && threadIdx.x == 0) {
      out[row] = static_cast<int32_t>(pick.idx >= 0 && pick.idx < n_vocab ? pick.idx : 0);
    }
    grid_barrier(c);  // the group's work area is zeroed for the next turn only after every block read it
  }
}

}  // namespace

Status sample_rows(CudaBackend& b, float* logits, int64_t rows, int64_t n_vocab, const SampleParamsDev* params,
                   const SampleAdjustDev* adjust, int32_t* out) {
  if (rows == 0) return ok_status();
  // The grid: as many blocks as stay resident (a cooperative launch needs them all at once), in
  // groups of up to kMaxGroupBlocks a row, each block at least a few thousand logits.
  static const int resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sample_kernel, kThreads, 0);
    cudaGetLastError();
    return std::max(1, sms * per_sm);
  }();
  const int64_t by_vocab = std::max<int64_t>(1, n_vocab / (4 * kThreads));
  const int group_blocks =
      static_cast<int>(std::clamp<int64_t>(resident / rows, 1, std::min<int64_t>(kMaxGroupBlocks, by_vocab)));
  const int64_t groups = std::min<int64_t>(rows, resident / group_blocks);
  const size_t work_bytes = static_cast<size_t>(groups) * sizeof(GroupWork);
  COMBS_ASSIGN_OR_RETURN(void* work, b.scratch(work_bytes + 256, CudaBackend::kSampleWorkSlot));
  unsigned* barrier = reinterpret_cast<unsigned*>(static_cast<char*>(work) + work_bytes);
  auto st = static_cast<cudaStream_t>(b.stream());
  COMBS_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(barrier, 0, sizeof(unsigned), st), "sample_rows: barrier"));
  GroupWork* gw = static_cast<GroupWork*>(work);
  int gb = group_blocks;
  void* args[] = {&logits, &n_vocab, &rows, &params, &adjust, &out, &gb, &gw, &barrier};
  return cuda_status(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(sample_kernel),
                                                 dim3(static_cast<unsigned>(groups * group_blocks)), dim3(kThreads),
                                                 args, 0, st),
                     "sample_kernel");
}

}  // namespace combs::cuda
