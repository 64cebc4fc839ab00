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

// One block: each thread routes tokens (softmax over the router's scores, the k best by score,
// ties to the lower id: cpu::route_experts' rule), then the (token, slot) pairs are counted and
// grouped by expert. A pair's place within its expert's group is whatever the atomics give: no
// pair's arithmetic depends on it.
__global__ void route_kernel(const float* __restrict__ logits, int n, int n_expert, int k,
                             bool normalize, int32_t* __restrict__ ids, float* __restrict__ weights,
                             int32_t* __restrict__ order, int32_t* __restrict__ start) {
  extern __shared__ int32_t cursor[];  // [n_expert + 1]
  for (int i = threadIdx.x; i <= n_expert; i += blockDim.x) cursor[i] = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const float* z = logits + static_cast<int64_t>(t) * n_expert;
    float mx = z[0];
    for (int i = 1; i < n_expert; ++i) mx = fmaxf(mx, z[i]);
    float sum = 0.0f;
    for (int i = 0; i < n_expert; ++i) sum += expf(z[i] - mx);
    // The j-th best: the largest (score, -id) below the (j-1)-th.
    float prev_z = INFINITY;
    int prev_id = -1;
    float chosen = 0.0f;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int i = 0; i < n_expert; ++i) {
        const bool below = z[i] < prev_z || (z[i] == prev_z && i > prev_id);
        if (below && (best < 0 || z[i] > z[best])) best = i;
      }
      const float p = expf(z[best] - mx) / sum;
      ids[t * k + j] = best;
      weights[t * k + j] = p;
      chosen += p;
      prev_z = z[best], prev_id = best;
      atomicAdd(&cursor[best + 1], 1);
    }
    if (normalize) {
      chosen = fmaxf(chosen, 6.103515625e-5f);
      for (int j = 0; j < k; ++j) weights[t * k + j] /= chosen;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i <= n_expert; ++i) cursor[i] += cursor[i - 1];
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
      router_logits, static_cast<int>(n), n_expert, f.k, f.normalize, s.ids, s.weights, s.order,
      s.start);
  COMBS_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "route_kernel"));
  COMBS_RETURN_IF_ERROR(quantize_activations(st, h, n, in, nullptr, 0.0f, s.xq));
  COMBS_RETURN_IF_ERROR(
      quant_gemv_experts(st, gu, s.xq, n, s.order, s.start, f.k, /*pairs=*/true, s.hidden));
  COMBS_RETURN_IF_ERROR(quantize_activations(st, s.hidden, n * f.k, ff, nullptr, 0.0f, s.xq));
  COMBS_RETURN_IF_ERROR(
      quant_gemv_experts(st, down, s.xq, n * f.k, s.order, s.start, 1, /*pairs=*/false, s.out));
  combine_kernel<<<static_cast<unsigned>(n), 256, 0, st>>>(s.out, s.weights, f.k, in, f.shared,
                                                           f.shared_logit, accumulate, y);
  return cuda_status(cudaGetLastError(), "combine_kernel");
}

}  // namespace combs::cuda
