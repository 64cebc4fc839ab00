// Mixtures of experts on the device (cuda_ops.h's experts_ffn): routing, the chosen experts'
// products (quant_matmul.h's quant_gemv_experts for decode-sized steps, quant_mma_experts on
// tensor cores for larger ones) and each token's weighted sum, all launches on the stream (no
// host round trip: a decode step stays one CUDA graph).
#include <algorithm>
#include <string>

#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"
#include "pdl.h"
#include "quant_matmul.h"

namespace combs::cuda {
namespace {

constexpr int kRouteThreads = 1024;   // the routing block of route_kernel
constexpr int kRouterThreads = 256;   // router_route_kernel's blocks
constexpr int kCombineThreads = 128;  // combine_kernel's, four columns a thread

// Routes n tokens by their router scores (logits [n, n_expert]), one block: each warp routes
// tokens (softmax over the scores, the k best by score, ties to the lower id: cpu::route_experts'
// rule, and its softmax_chosen weighting: a softmax over the k chosen scores alone; a token's
// scores in the warp's shared row, the butterfly reductions leave every lane the same max, sum and
// choice), then the (token, slot) pairs are counted and grouped by expert, and the experts chosen
// listed (start's layout: quant_matmul.h): those in [lo, hi) only, the experts this rank holds
// (tensor parallelism). A pair's place within its expert's group is whatever the atomics give: no
// pair's arithmetic depends on it, nor on the other tokens routed with it.
// smem: (n_expert + 1) ints, then n_expert floats per warp (route_smem).
__device__ void route_block(const float* logits, int n, int n_expert, int lo, int hi, int k, bool normalize,
                            bool softmax_chosen, int32_t* __restrict__ ids, float* __restrict__ weights, int32_t* __restrict__ order,
                            int32_t* __restrict__ start, int32_t* smem) {
  int32_t* cursor = smem;  // [n_expert + 1]: counts, then each expert's next place
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* z = reinterpret_cast<float*>(smem + n_expert + 1) + static_cast<int64_t>(warp) * n_expert;
  for (int i = threadIdx.x; i <= n_expert; i += blockDim.x) cursor[i] = 0;
  __syncthreads();
  for (int t = warp; t < n; t += warps) {
    // (__ldcg: the scores may come from other blocks of this kernel, past this SM's L1.)
    for (int i = lane; i < n_expert; i += 32) z[i] = __ldcg(logits + static_cast<int64_t>(t) * n_expert + i);
    __syncwarp();
    float mx = -INFINITY, sum = 0.0f;
    if (!softmax_chosen) {
      for (int i = lane; i < n_expert; i += 32) mx = fmaxf(mx, z[i]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
      for (int i = lane; i < n_expert; i += 32) sum += expf(z[i] - mx);
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    }
    // The j-th best: the largest (score, -id) below the (j-1)-th. Slot j is written by lane j % 32
    // (which also rescales it below: its own writes).
    float prev_z = INFINITY, chosen = 0.0f;
    int prev_id = -1;
    for (int j = 0; j < k; ++j) {
      float bz = -INFINITY;
      int best = -1;
      for (int i = lane; i < n_expert; i += 32) {
        const float zi = z[i];
        const bool below = zi < prev_z || (zi == prev_z && i > prev_id);
        if (below && (best < 0 || zi > bz)) best = i, bz = zi;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float oz = __shfl_xor_sync(0xffffffff, bz, o);
        const int oi = __shfl_xor_sync(0xffffffff, best, o);
        if (oi >= 0 && (best < 0 || oz > bz || (oz == bz && oi < best))) best = oi, bz = oz;
      }
      if (best < 0) best = 0, bz = z[0];  // NaN scores: expert 0 rather than an index out of range
      if (softmax_chosen && j == 0) mx = bz;  // the first chosen is the largest
      const float p = softmax_chosen ? expf(bz - mx) : expf(bz - mx) / sum;
      if (lane == j % 32) {
        ids[t * k + j] = best;
        weights[t * k + j] = p;
        atomicAdd(&cursor[best + 1], 1);
      }
      chosen += p;
      prev_z = bz, prev_id = best;
    }
    if (normalize || softmax_chosen) {
      if (!softmax_chosen) chosen = fmaxf(chosen, 6.103515625e-5f);  // (softmax_chosen's is >= 1)
      for (int j = lane; j < k; j += 32) weights[t * k + j] /= chosen;
    }
    __syncwarp();  // z is the next token's
  }
  __syncthreads();
  if (warp == 0) {  // counts to starts (an inclusive scan, 32 experts at a time); the chosen listed
    int carry = 0, n_chosen = 0;
    for (int base = 1; base <= n_expert; base += 32) {
      const int i = base + lane;
      const int c = i <= n_expert ? cursor[i] : 0;
      int incl = c;
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffff, incl, o);
        if (lane >= o) incl += v;
      }
      const bool held = c > 0 && i - 1 >= lo && i - 1 < hi;
      const unsigned picked = __ballot_sync(0xffffffff, held);
      if (held) start[n_expert + 2 + n_chosen + __popc(picked & ((1u << lane) - 1))] = i - 1;
      n_chosen += __popc(picked);
      if (i <= n_expert) cursor[i] = start[i] = carry + incl;
      carry += __shfl_sync(0xffffffff, incl, 31);
    }
    if (lane == 0) start[0] = 0, start[n_expert + 1] = n_chosen;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n * k; p += blockDim.x) order[atomicAdd(&cursor[ids[p]], 1)] = p;
}

size_t route_smem(int n_expert, int threads) {
  return static_cast<size_t>(n_expert + 1) * 4 + static_cast<size_t>(threads / 32) * n_expert * 4;
}

// Routing alone, the scores given: one block.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ logits, int n, int n_expert, int lo, int hi, int k, bool normalize,
                 bool softmax_chosen,
                 int32_t* __restrict__ ids, float* __restrict__ weights, int32_t* __restrict__ order,
                 int32_t* __restrict__ start) {
  extern __shared__ int32_t smem[];
  pdl_launch_dependents();
  pdl_wait();
  route_block(logits, n, n_expert, lo, hi, k, normalize, softmax_chosen, ids, weights, order, start, smem);
}

// The router's scores for a decode-sized step and the routing in one kernel: logits [n, n_expert]
// = router [n_expert, in] (f32) h [n, in] (+ bias), a block a score (threads four elements at a
// time, blockDim * 4 apart, then the warps' butterflies and their sum in warp order: a token's
// score is its own, whatever else the step holds); the last block to finish (a ticket taken from
// *counter after its scores are out, which it puts back to zero) routes them as route_kernel.
__global__ void __launch_bounds__(kRouterThreads)
    router_route_kernel(const float* __restrict__ router, const float* __restrict__ bias, const float* __restrict__ h,
                        int64_t in, float* logits, int n, int n_expert, int lo, int hi, int k, bool normalize,
                        bool softmax_chosen,
                        int32_t* __restrict__ ids, float* __restrict__ weights, int32_t* __restrict__ order,
                        int32_t* __restrict__ start, int32_t* __restrict__ counter) {
  extern __shared__ int32_t smem[];
  __shared__ float part[kRouterThreads / 32];
  __shared__ bool last;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  pdl_launch_dependents();
  pdl_wait();
  const int64_t items = static_cast<int64_t>(n) * n_expert, quads = in / 4;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const int64_t t = it / n_expert;
    const int e = static_cast<int>(it % n_expert);
    const float4* wr = reinterpret_cast<const float4*>(router + e * in);
    const float4* xr = reinterpret_cast<const float4*>(h + t * in);
    float acc = 0.0f;
    for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
      const float4 a = __ldg(wr + i), b = __ldg(xr + i);
      acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int w = 0; w < warps; ++w) sum += part[w];
      logits[it] = sum + (bias ? bias[e] : 0.0f);
    }
    __syncthreads();
  }
  __threadfence();  // this block's scores out before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  route_block(logits, n, n_expert, lo, hi, k, normalize, softmax_chosen, ids, weights, order, start, smem);
  if (threadIdx.x == 0) *counter = 0;
}

// y[t, :] (+)= sum over slots j (in order) whose expert ids[t, j] is in [lo, hi) (this rank's) of
// weights[t, j] * out[t k + j, :], plus sigmoid(shared_logit[t]) * shared[t, :] where there is a
// shared expert. Blocks (columns, token); a thread four columns (dim % 4 == 0) or one.
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const float* __restrict__ out, const float* __restrict__ weights, const int32_t* __restrict__ ids,
                   int lo, int hi, int k, int64_t dim,
                   const float* __restrict__ shared, const float* __restrict__ shared_logit, bool accumulate,
                   float* __restrict__ y) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t t = blockIdx.y;
  const int per = dim % 4 == 0 ? 4 : 1;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * per;
  if (c0 >= dim) return;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (per == 4) {
#pragma unroll 8
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      if (e < lo || e >= hi) continue;
      const float wj = weights[t * k + j];
      const float4 o = *reinterpret_cast<const float4*>(out + (t * k + j) * dim + c0);
      v[0] += wj * o.x, v[1] += wj * o.y, v[2] += wj * o.z, v[3] += wj * o.w;
    }
  } else {
#pragma unroll 8
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      if (e >= lo && e < hi) v[0] += weights[t * k + j] * out[(t * k + j) * dim + c0];
    }
  }
  for (int c = 0; c < per; ++c) {
    float x = v[c];
    if (shared) x += shared[t * dim + c0 + c] / (1.0f + expf(-shared_logit[t]));
    float* dst = y + t * dim + c0 + c;
    *dst = accumulate ? *dst + x : x;
  }
}

}  // namespace

size_t expert_activation_bytes(int64_t n, int k, int64_t in, int64_t ff) {
  return std::max(activation_bytes(n, in), activation_bytes(n * k, ff));
}

Status experts_ffn(CudaBackend& b, const ExpertsFfn& f, float* router_logits, const float* h,
                   int64_t n, const ExpertScratch& s, float* y, bool accumulate) {
  const Tensor& gu = *f.gate_up;
  const Tensor& down = *f.down;
  const int held = static_cast<int>(gu.dim(0)), n_expert = f.n_expert > 0 ? f.n_expert : held;
  const int lo = f.first_expert, hi = lo + held;
  const int64_t in = gu.dim(2), ff = gu.dim(1) / 2;
  if (lo < 0 || hi > n_expert) {
    return invalid_argument_error("cuda experts_ffn: experts [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                  ") of " + std::to_string(n_expert));
  }
  if (down.rank() != 3 || down.dim(0) != held || down.dim(1) != in || down.dim(2) != ff) {
    return invalid_argument_error("cuda experts_ffn: down experts " + down.shape().to_string() +
                                  " do not match gate/up " + gu.shape().to_string());
  }
  if (f.k < 1 || f.k > n_expert)
    return invalid_argument_error("cuda experts_ffn: " + std::to_string(f.k) + " experts a token");
  if (n == 0) return ok_status();
  if (n * f.k > (int64_t{1} << 30))
    return invalid_argument_error("cuda experts_ffn: too many tokens");
  auto st = static_cast<cudaStream_t>(b.stream());
  int32_t* counter = s.start + expert_start_size(n_expert) - 1;
  const bool fused_router = f.router && f.router->dtype() == DType::kF32 && f.router->rank() == 2 &&
                            f.router->dim(0) == n_expert && f.router->dim(1) == in && in % 4 == 0 &&
                            n <= kQuantGemvMaxRows;
  if (f.router && !fused_router) {  // scores by the general matmul, then the routing alone
    COMBS_RETURN_IF_ERROR(matmul(b, *f.router, h, n, router_logits, f.router_bias));
  }
  if (fused_router) {
    const size_t smem = route_smem(n_expert, kRouterThreads);
    if (smem > (48u << 10)) return invalid_argument_error("cuda experts_ffn: " + std::to_string(n_expert) + " experts");
    const int64_t scores = n * n_expert;
    COMBS_RETURN_IF_ERROR(cuda_status(
        launch_pdl(router_route_kernel, dim3(static_cast<unsigned>(std::min<int64_t>(scores, 2048))),
                   dim3(kRouterThreads), smem, st, f.router->data_as<float>(), f.router_bias, h, in, router_logits,
                   static_cast<int>(n), n_expert, lo, hi, f.k, f.normalize, f.softmax_chosen, s.ids, s.weights,
                   s.order, s.start, counter),
        "router_route_kernel"));
  } else {
    const size_t smem = route_smem(n_expert, kRouteThreads);
    if (smem > (48u << 10)) return invalid_argument_error("cuda experts_ffn: " + std::to_string(n_expert) + " experts");
    COMBS_RETURN_IF_ERROR(cuda_status(
        launch_pdl(route_kernel, dim3(1), dim3(kRouteThreads), smem, st, static_cast<const float*>(router_logits),
                   static_cast<int>(n), n_expert, lo, hi, f.k, f.normalize, f.softmax_chosen, s.ids, s.weights,
                   s.order, s.start),
        "route_kernel"));
  }
  if (experts_batched(n, f.k, n_expert) && expert_tile_bound(n * f.k, held) <= kMaxExpertTiles) {
    // Tensor cores, the activations in BF16: h's copy in out (free until the down product writes
    // it), the hidden products in hidden's first half and the tile list after them.
    const int64_t pairs = n * f.k;
    auto* xs = reinterpret_cast<__nv_bfloat16*>(s.out);
    auto* hidden = reinterpret_cast<__nv_bfloat16*>(s.hidden);
    void* tiles = reinterpret_cast<uint8_t*>(s.hidden) + (pairs * ff * 2 + 15) / 16 * 16;
    COMBS_RETURN_IF_ERROR(round_bf16(st, h, n * in, xs));
    COMBS_RETURN_IF_ERROR(expert_tiles(st, s.start, n_expert, pairs, held, tiles));
    COMBS_RETURN_IF_ERROR(quant_mma_experts(st, gu, xs, pairs, s.order, tiles, f.k, /*is_pairs=*/true, hidden,
                                            {f.gate_up_bias, f.swiglu_alpha, f.swiglu_limit}, lo));
    COMBS_RETURN_IF_ERROR(
        quant_mma_experts(st, down, hidden, pairs, s.order, tiles, 1, /*is_pairs=*/false, s.out, {f.down_bias}, lo));
  } else {
    COMBS_RETURN_IF_ERROR(quantize_activations(st, h, n, in, nullptr, 0.0f, s.xq));
    COMBS_RETURN_IF_ERROR(quant_gemv_experts(st, gu, s.xq, n, s.order, s.start, f.k, /*pairs=*/true, s.hidden,
                                             {f.gate_up_bias, f.swiglu_alpha, f.swiglu_limit}, n_expert, lo));
    COMBS_RETURN_IF_ERROR(quantize_activations(st, s.hidden, n * f.k, ff, nullptr, 0.0f, s.xq));
    COMBS_RETURN_IF_ERROR(quant_gemv_experts(st, down, s.xq, n * f.k, s.order, s.start, 1, /*pairs=*/false, s.out,
                                             {f.down_bias}, n_expert, lo));
  }
  const int per = in % 4 == 0 ? 4 : 1;
  const dim3 grid(static_cast<unsigned>((in / per + kCombineThreads - 1) / kCombineThreads), static_cast<unsigned>(n));
  return cuda_status(launch_pdl(combine_kernel, grid, dim3(kCombineThreads), 0, st, s.out, s.weights,
                                static_cast<const int32_t*>(s.ids), lo, hi, f.k, in,
                                f.shared, f.shared_logit, accumulate, y),
                     "combine_kernel");
}

}  // namespace combs::cuda
