// Mixtures of experts on the device (cuda_ops.h's experts_ffn): routing, the chosen experts'
// products (quant_matmul.h's quant_gemv_experts) and each token's weighted sum, all launches on
// the stream (no host round trip: a decode step stays one CUDA graph).
#include <algorithm>
#include <string>

#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"
#include "quant_matmul.h"

namespace combs::cuda {
namespace {

constexpr int kRouteThreads = 1024;

// One block: each warp routes tokens (softmax over the router's scores, the k best by score,
// ties to the lower id: cpu::route_experts' rule, and its softmax_chosen weighting: a softmax over
// the k chosen scores alone; a token's lanes hold every 32nd score, and the
// butterfly reductions leave every lane the same max, sum and choice), then the (token, slot)
// pairs are counted and grouped by expert, and the experts chosen listed (start's layout:
// quant_matmul.h). A pair's place within its expert's group is whatever the atomics give: no
// pair's arithmetic depends on it, nor on the other tokens routed with it.
__global__ void route_kernel(const float* __restrict__ logits, int n, int n_expert, int k,
                             bool normalize, bool softmax_chosen, int32_t* __restrict__ ids, float* __restrict__ weights,
                             int32_t* __restrict__ order, int32_t* __restrict__ start) {
  extern __shared__ int32_t cursor[];  // [n_expert + 1]
  for (int i = threadIdx.x; i <= n_expert; i += blockDim.x) cursor[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int t = threadIdx.x / 32; t < n; t += blockDim.x / 32) {
    const float* z = logits + static_cast<int64_t>(t) * n_expert;
    float mx = -INFINITY, sum = 0.0f;
    if (!softmax_chosen) {
      for (int i = lane; i < n_expert; i += 32) mx = fmaxf(mx, z[i]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
      for (int i = lane; i < n_expert; i += 32) sum += expf(z[i] - mx);
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    }
    // The j-th best: the largest (score, -id) below the (j-1)-th.
    float prev_z = INFINITY, chosen = 0.0f;
    int prev_id = -1;
    for (int j = 0; j < k; ++j) {
      float bz = -INFINITY;
      int best = -1;
      for (int i = lane; i < n_expert; i += 32) {
        const bool below = z[i] < prev_z || (z[i] == prev_z && i > prev_id);
        if (below && (best < 0 || z[i] > bz)) best = i, bz = z[i];
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float oz = __shfl_xor_sync(0xffffffff, bz, o);
        const int oi = __shfl_xor_sync(0xffffffff, best, o);
        if (oi >= 0 && (best < 0 || oz > bz || (oz == bz && oi < best))) best = oi, bz = oz;
      }
      if (best < 0) best = 0, bz = z[0];  // NaN scores: expert 0 rather than an index out of range
      if (softmax_chosen && j == 0) mx = bz;  // the first chosen is the largest
      const float p = softmax_chosen ? expf(bz - mx) : expf(bz - mx) / sum;
      if (lane == 0) {
        ids[t * k + j] = best;
        weights[t * k + j] = p;
        atomicAdd(&cursor[best + 1], 1);
      }
      chosen += p;
      prev_z = bz, prev_id = best;
    }
    if ((normalize || softmax_chosen) && lane == 0) {
      if (!softmax_chosen) chosen = fmaxf(chosen, 6.103515625e-5f);  // (softmax_chosen's is >= 1)
      for (int j = 0; j < k; ++j) weights[t * k + j] /= chosen;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int n_chosen = 0;
    for (int i = 1; i <= n_expert; ++i) {
      if (cursor[i] > 0) start[n_expert + 2 + n_chosen++] = i - 1;
      cursor[i] += cursor[i - 1];
    }
    start[n_expert + 1] = n_chosen;
    for (int i = 0; i <= n_expert; ++i) start[i] = cursor[i];
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n * k; p += blockDim.x) order[atomicAdd(&cursor[ids[p]], 1)] = p;
}

// y[t, :] (+)= sum over slots j (in order) of weights[t, j] * out[t k + j, :], plus
// sigmoid(shared_logit[t]) * shared[t, :] where there is a shared expert.
__global__ void combine_kernel(const float* __restrict__ out, const float* __restrict__ weights,
                               int k, int64_t dim, const float* __restrict__ shared,
                               const float* __restrict__ shared_logit, bool accumulate,
                               float* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = 0.0f;
    for (int j = 0; j < k; ++j) v += weights[t * k + j] * out[(t * k + j) * dim + i];
    if (shared) v += shared[t * dim + i] / (1.0f + expf(-shared_logit[t]));
    y[t * dim + i] = accumulate ? y[t * dim + i] + v : v;
  }
}

}  // namespace

size_t expert_activation_bytes(int64_t n, int k, int64_t in, int64_t ff) {
  return std::max(activation_bytes(n, in), activation_bytes(n * k, ff));
}

Status experts_ffn(CudaBackend& b, const ExpertsFfn& f, const float* router_logits, const float* h,
                   int64_t n, const ExpertScratch& s, float* y, bool accumulate) {
  const Tensor& gu = *f.gate_up;
  const Tensor& down = *f.down;
  const int n_expert = static_cast<int>(gu.dim(0));
  const int64_t in = gu.dim(2), ff = gu.dim(1) / 2;
  if (down.rank() != 3 || down.dim(0) != n_expert || down.dim(1) != in || down.dim(2) != ff) {
    return invalid_argument_error("cuda experts_ffn: down experts " + down.shape().to_string() +
                                  " do not match gate/up " + gu.shape().to_string());
  }
  if (f.k < 1 || f.k > n_expert)
    return invalid_argument_error("cuda experts_ffn: " + std::to_string(f.k) + " experts a token");
  if (n == 0) return ok_status();
  if (n * f.k > (int64_t{1} << 30))
    return invalid_argument_error("cuda experts_ffn: too many tokens");
  auto st = static_cast<cudaStream_t>(b.stream());
  route_kernel<<<1, kRouteThreads, static_cast<size_t>(n_expert + 1) * sizeof(int32_t), st>>>(
      router_logits, static_cast<int>(n), n_expert, f.k, f.normalize, f.softmax_chosen, s.ids, s.weights,
      s.order, s.start);
  COMBS_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "route_kernel"));
  COMBS_RETURN_IF_ERROR(quantize_activations(st, h, n, in, nullptr, 0.0f, s.xq));
  COMBS_RETURN_IF_ERROR(
      quant_gemv_experts(st, gu, s.xq, n, s.order, s.start, f.k, /*pairs=*/true, s.hidden,
                         {f.gate_up_bias, f.swiglu_alpha, f.swiglu_limit}));
  COMBS_RETURN_IF_ERROR(quantize_activations(st, s.hidden, n * f.k, ff, nullptr, 0.0f, s.xq));
  COMBS_RETURN_IF_ERROR(
      quant_gemv_experts(st, down, s.xq, n * f.k, s.order, s.start, 1, /*pairs=*/false, s.out,
                         {f.down_bias}));
  combine_kernel<<<static_cast<unsigned>(n), 256, 0, st>>>(s.out, s.weights, f.k, in, f.shared,
                                                           f.shared_logit, accumulate, y);
  return cuda_status(cudaGetLastError(), "combine_kernel");
}

}  // namespace combs::cuda
