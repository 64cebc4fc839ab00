// The CUDA backend's ops (see include/combs/backend/cuda/cuda_ops.h).
#include <cuda_bf16.h>
#include <algorithm>
#include <cuda_fp16.h>

#include "async_copy.h"
#include "block_reduce.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"
#include "float_convert.h"
#include "gemv_out.h"
#include "kernel_smem.h"
#include "mma.h"
#include "pdl.h"
#include "quant_matmul.h"

namespace combs::cuda {

namespace {

cudaStream_t stream_of(CudaBackend& b) { return static_cast<cudaStream_t>(b.stream()); }

Status launched(const char* kernel) { return cuda_status(cudaGetLastError(), kernel); }

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n, int64_t out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * out) y[i] += bias[i % out];
}

template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, const int32_t* __restrict__ ids, float* __restrict__ out,
                                 int64_t dim) {
  const T* row = table + static_cast<int64_t>(ids[blockIdx.x]) * dim;
  float* o = out + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = to_f32(row[i]);
}

// One block per row: residual += delta, then y = residual * rsqrt(mean(residual^2) + eps) * w.
// Rows of a multiple of 4 go by float4 (the row stays in L1 between the two passes). Launched
// with programmatic dependent launch: the block waits for the kernel before, then starts.
template <typename T>
__device__ inline void store4(T* p, float4 v) {
  p[0] = from_f32<T>(v.x), p[1] = from_f32<T>(v.y), p[2] = from_f32<T>(v.z), p[3] = from_f32<T>(v.w);
}
template <>
__device__ inline void store4<float>(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
template <>
__device__ inline void store4<__nv_bfloat16>(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}

__device__ inline float block_sum(float v, float* sums) {
  return block_reduce(v, [](float a, float b) { return a + b; }, 0.0f, sums);
}

// Float4s of a row a thread of add_rms_norm_kernel keeps in registers (rows of up to 4,096 at 256
// threads): a decode step's norm is one block, and its time the latency of its loads, so the
// weights are requested before the wait for the kernel that wrote the residual and delta, and
// those are read once, all at once (passes over memory were three dependent round trips).
constexpr int kNormCached = 4;

// A norm's output rounded to 8 bits for the quantized decode kernel (quant_matmul.h's activation
// layout): row r's int8 values at q + r dim, its groups' scales at d + r (dim / group).
struct Q8Out {
  int8_t* q = nullptr;
  float* d = nullptr;
  int group = 0;          // 32 or 256
  int8_t* sums = nullptr;  // groups of 256: the unit sums (activation_sums_offset)
};

// y's float4 j of this thread (elements i..i+3, i = threadIdx.x * 4 + j * blockDim.x * 4) rounded
// into q8 as quantize_act_kernel rounds y read back (the same max, quotient and rounding): a group
// of 32 is 8 neighbouring lanes, one of 256 is two neighbouring warps (their maxima meet in
// shared memory: one barrier).
// (kGroup a constant: the four float4s' shuffles unrolled and interleaved, one chain's latency.)
template <int kGroup>
__device__ void round_q8(const float4 (&y)[kNormCached], int64_t dim, int8_t* qr, float* dr, int8_t* sr = nullptr) {
  __shared__ float warp_max[kNormCached][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * 4;
  constexpr int kLanes = kGroup == 256 ? 32 : kGroup / 4;
  float amax[kNormCached];
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    amax[j] = 0.0f;
    if (threadIdx.x * 4 + j * stride < dim) {
      amax[j] = fmaxf(fmaxf(fmaxf(fmaxf(amax[j], fabsf(y[j].x)), fabsf(y[j].y)), fabsf(y[j].z)), fabsf(y[j].w));
    }
  }
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) {
#pragma unroll
    for (int j = 0; j < kNormCached; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffff, amax[j], o));
  }
  if constexpr (kGroup == 256) {
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kNormCached; ++j) warp_max[j][warp] = amax[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kNormCached; ++j) amax[j] = fmaxf(warp_max[j][warp & ~1], warp_max[j][warp | 1]);
  }
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    const int64_t i = threadIdx.x * 4 + j * stride;
    if (i >= dim) continue;
    const float inv = amax[j] > 0.0f ? __fdiv_rn(127.0f, amax[j]) : 0.0f;
    const float e[4] = {y[j].x, y[j].y, y[j].z, y[j].w};
    uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int q = min(127, max(-127, __float2int_rn(__fmul_rn(e[k], inv))));
      packed |= static_cast<uint32_t>(q & 0xFF) << (8 * k);
    }
    *reinterpret_cast<uint32_t*>(qr + i) = packed;
    if (i % kGroup == 0) dr[i / kGroup] = __fdiv_rn(amax[j], 127.0f);
    if (kGroup == 256 && sr) {  // a unit of 32 is eight lanes (a warp's 128 elements all in the row or none)
      int s = __dp4a(static_cast<int>(packed), 0x01010101, 0);
      s += __shfl_xor_sync(0xffffffff, s, 1);
      s += __shfl_xor_sync(0xffffffff, s, 2);
      s += __shfl_xor_sync(0xffffffff, s, 4);
      if (lane % 8 == 0) store_unit_sum(sr + i / 256 * 16, static_cast<int>(i % 256 / 32), s);
    }
  }
}

// add_rms_norm_kernel for rows of dim <= blockDim.x * 4 * kNormCached (16-byte aligned float4s):
// the same numbers as its loops (each thread's sums in the same order). q8.q set: y rounded to 8
// bits into q8 instead (yr unused).
template <typename T>
__device__ void add_rms_norm_cached(float* __restrict__ r, const float* __restrict__ d,
                                    const float* __restrict__ delta_weight, const float* __restrict__ weight,
                                    T* __restrict__ yr, int64_t dim, float eps, float* sums, const Q8Out& q8 = {}) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * 4;
  float4 w[kNormCached], g[kNormCached], v[kNormCached], e[kNormCached];
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    const int64_t i = threadIdx.x * 4 + j * stride;
    if (i < dim) {
      w[j] = *reinterpret_cast<const float4*>(weight + i);
      if (delta_weight) g[j] = *reinterpret_cast<const float4*>(delta_weight + i);
    }
  }
  pdl_wait();
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    const int64_t i = threadIdx.x * 4 + j * stride;
    if (i < dim) {
      v[j] = *reinterpret_cast<const float4*>(r + i);
      if (d) e[j] = *reinterpret_cast<const float4*>(d + i);
    }
  }
  float dscale = 1.0f;
  if (d && delta_weight) {
    float ds = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormCached; ++j)
      if (threadIdx.x * 4 + j * stride < dim) ds += e[j].x * e[j].x + e[j].y * e[j].y + e[j].z * e[j].z + e[j].w * e[j].w;
    dscale = rsqrtf(block_sum(ds, sums) / static_cast<float>(dim) + eps);
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    const int64_t i = threadIdx.x * 4 + j * stride;
    if (i >= dim) continue;
    if (d) {
      float4 a = e[j];
      if (delta_weight) a = make_float4(a.x * dscale * g[j].x, a.y * dscale * g[j].y, a.z * dscale * g[j].z, a.w * dscale * g[j].w);
      v[j].x += a.x, v[j].y += a.y, v[j].z += a.z, v[j].w += a.w;
      *reinterpret_cast<float4*>(r + i) = v[j];
    }
    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  const float scale = rsqrtf(block_sum(ss, sums) / static_cast<float>(dim) + eps);
  if (q8.q) {
    float4 y[kNormCached];
#pragma unroll
    for (int j = 0; j < kNormCached; ++j) {
      y[j] = make_float4(v[j].x * scale * w[j].x, v[j].y * scale * w[j].y, v[j].z * scale * w[j].z, v[j].w * scale * w[j].w);
    }
    int8_t* qr = q8.q + blockIdx.x * dim;
    float* dr = q8.d + blockIdx.x * (dim / q8.group);
    return q8.group == 256 ? round_q8<256>(y, dim, qr, dr, q8.sums ? q8.sums + blockIdx.x * (dim / 256) * 16 : nullptr)
                           : round_q8<32>(y, dim, qr, dr);
  }
#pragma unroll
  for (int j = 0; j < kNormCached; ++j) {
    const int64_t i = threadIdx.x * 4 + j * stride;
    if (i < dim) {
      store4(yr + i, make_float4(v[j].x * scale * w[j].x, v[j].y * scale * w[j].y, v[j].z * scale * w[j].z,
                                 v[j].w * scale * w[j].w));
    }
  }
}

// add_rms_norm_kernel's cached rows with the output rounded to 8 bits (add_normed_rms_norm_q8).
__global__ void add_rms_norm_q8_kernel(float* __restrict__ residual, const float* __restrict__ delta,
                                       const float* __restrict__ delta_weight, const float* __restrict__ weight,
                                       int64_t dim, float eps, Q8Out q8) {
  __shared__ float sums[32];
  pdl_launch_dependents();
  add_rms_norm_cached<float>(residual + blockIdx.x * dim, delta ? delta + blockIdx.x * dim : nullptr, delta_weight,
                             weight, nullptr, dim, eps, sums, q8);
}

// delta_weight (post norms: gemma2's, gemma3's): delta is RMS-normalized and times delta_weight
// before it joins the residual — the numbers of add_rms_norm on delta alone, then this one.
template <typename T>
__global__ void add_rms_norm_kernel(float* __restrict__ residual, const float* __restrict__ delta,
                                    const float* __restrict__ delta_weight, const float* __restrict__ weight,
                                    T* __restrict__ y, int64_t dim, float eps, bool vec) {
  float* r = residual + blockIdx.x * dim;
  const float* d = delta ? delta + blockIdx.x * dim : nullptr;
  T* yr = y + blockIdx.x * dim;
  __shared__ float sums[32];
  pdl_launch_dependents();
  if (vec && dim <= static_cast<int64_t>(blockDim.x) * 4 * kNormCached) {
    return add_rms_norm_cached(r, d, delta_weight, weight, yr, dim, eps, sums);
  }
  pdl_wait();
  float dscale = 1.0f;
  if (d && delta_weight) {
    float ds = 0.0f;
    if (vec) {
#pragma unroll 4
      for (int64_t i = threadIdx.x * 4; i < dim; i += blockDim.x * 4) {
        const float4 e = *reinterpret_cast<const float4*>(d + i);
        ds += e.x * e.x + e.y * e.y + e.z * e.z + e.w * e.w;
      }
    } else {
      for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ds += d[i] * d[i];
    }
    dscale = rsqrtf(block_sum(ds, sums) / static_cast<float>(dim) + eps);
  }
  float ss = 0.0f;
  if (vec) {
#pragma unroll 4
    for (int64_t i = threadIdx.x * 4; i < dim; i += blockDim.x * 4) {
      float4 v = *reinterpret_cast<const float4*>(r + i);
      if (d) {
        float4 e = *reinterpret_cast<const float4*>(d + i);
        if (delta_weight) {
          const float4 g = *reinterpret_cast<const float4*>(delta_weight + i);
          e = make_float4(e.x * dscale * g.x, e.y * dscale * g.y, e.z * dscale * g.z, e.w * dscale * g.w);
        }
        v.x += e.x, v.y += e.y, v.z += e.z, v.w += e.w;
        *reinterpret_cast<float4*>(r + i) = v;
      }
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const float e = d ? (delta_weight ? d[i] * dscale * delta_weight[i] : d[i]) : 0.0f;
      const float v = d ? r[i] + e : r[i];
      if (d) r[i] = v;
      ss += v * v;
    }
  }
  const float scale = rsqrtf(block_sum(ss, sums) / static_cast<float>(dim) + eps);
  if (vec) {
#pragma unroll 4
    for (int64_t i = threadIdx.x * 4; i < dim; i += blockDim.x * 4) {
      const float4 v = *reinterpret_cast<const float4*>(r + i), w = *reinterpret_cast<const float4*>(weight + i);
      store4(yr + i, make_float4(v.x * scale * w.x, v.y * scale * w.y, v.z * scale * w.z, v.w * scale * w.w));
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = from_f32<T>(r[i] * scale * weight[i]);
  }
}

// heads_rms_norm: a warp a row (rows of q, then rows of k), lanes 32 elements apart.
constexpr int kHeadNormWarps = 4;
__global__ void __launch_bounds__(kHeadNormWarps * 32)
    heads_rms_norm_kernel(float* __restrict__ q, const float* __restrict__ q_weight, int64_t q_rows,
                          float* __restrict__ k, const float* __restrict__ k_weight, int64_t k_rows, int64_t dim,
                          float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kHeadNormWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  pdl_launch_dependents();
  pdl_wait();
  if (row >= q_rows + k_rows) return;
  const bool is_q = row < q_rows;
  float* r = is_q ? q + row * dim : k + (row - q_rows) * dim;
  const float* w = is_q ? q_weight : k_weight;
  float ss = 0.0f;
  for (int64_t i = lane; i < dim; i += 32) ss += r[i] * r[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  const float scale = rsqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = lane; i < dim; i += 32) r[i] = r[i] * scale * w[i];
}

// out[i] = silu(gate[i]) * up[i] (out may be gate; T: the dtype of the GEMM that takes it).
template <typename T>
__global__ void silu_mul_kernel(const float* gate, const float* __restrict__ up, T* out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  pdl_launch_dependents();
  pdl_wait();
  if (i < n) {
    const float g = gate[i];
    out[i] = from_f32<T>(silu(g) * up[i]);
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                                   float* __restrict__ dst, int64_t dim) {
  const float* s = src + static_cast<int64_t>(rows[blockIdx.x]) * dim;
  float* d = dst + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) d[i] = s[i];
}

constexpr int kGemvWarps = 8;  // warps per block
constexpr int kGemvBatch = 8;  // 16-byte loads per lane per batch

// The norm's weights are the layer's own, not an output of the kernels before: requested into L1
// before the PDL wait (one 128-byte line per thread), so stage_gemv_x finds them there, not in DRAM.
__device__ __forceinline__ void prefetch_norm_l1(const GemvOut& outs, int64_t in) {
  if (!outs.norm_w) return;
  for (int64_t k = threadIdx.x * 32; k < in; k += blockDim.x * 32) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(outs.norm_w + k));
  }
}

// Stages the decode kernels' x into shared memory xs [n, in] (after the PDL wait), rounded to T as
// the cuBLAS path rounds it (the same numbers whatever n), with the RMSNorm folded in (outs.norm_w);
// or (XT) x already in T, copied as it is (cp.async). Ends with a barrier.
template <typename T, int N, bool XT>
__device__ __forceinline__ void stage_gemv_x(T* xs, const void* __restrict__ xin, const GemvOut& outs, int n, int64_t in) {
  const int lane = threadIdx.x % 32;
  __shared__ float scale[8];
  // Staging x: float4 loads, kStageUnroll per thread in flight (a block's staging is a few round
  // trips to L2, not one per element): for one row four (a 4,096-wide x in one round trip per
  // pass; llama-8b decode 236 vs 234 tok/s on the H200), for more two (four spill registers).
  constexpr int kStageUnroll = N == 1 ? 4 : 2;
  const int64_t in4 = in / 4, total4 = XT ? 0 : n * in4;
  const float4* x4 = static_cast<const float4*>(xin);
  const float4* nw4 = reinterpret_cast<const float4*>(outs.norm_w);
  bool staged = false;  // (the one-row norm path below stages x itself)
  if constexpr (XT) {  // 16-byte chunks straight to shared memory, all in flight at once
    const uint4* src = static_cast<const uint4*>(xin);
    for (int64_t i = threadIdx.x; i < n * in / 8; i += blockDim.x) cp_async16(smem_addr(reinterpret_cast<uint4*>(xs) + i), src + i);
    cp_async_commit();
    cp_async_wait<0>();
  } else if (N == 1 && outs.norm_w && in4 <= static_cast<int64_t>(blockDim.x) * kStageUnroll) {
    // One row of at most kStageUnroll float4s per thread (decode of one sequence, in <= 4,096): x
    // is loaded once and kept in registers; after the one barrier that gathers the warps' sums
    // every thread takes the scale itself (the same sums in the same order as below), then stages
    // its part with the norm's weights (from L1). One pass over x, two barriers instead of three
    // (H200: llama-8b decode 238 vs 235 tok/s). The weights are loaded after the barrier: kept in
    // registers beside x they spilled 40-48 bytes.
    float4 v[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t k = threadIdx.x + u * blockDim.x;
      v[u] = k < in4 ? x4[k] : make_float4(0, 0, 0, 0);
    }
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    __shared__ float red_1[kGemvWarps];
    if (lane == 0) red_1[threadIdx.x / 32] = ss;
    __syncthreads();
    float t = 0.0f;
    for (int w8 = 0; w8 < kGemvWarps; ++w8) t += red_1[w8];
    const float sc = rsqrtf(t / static_cast<float>(in) + outs.eps);
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t k = threadIdx.x + u * blockDim.x;
      if (k >= in4) break;
      const float4 nw = nw4[k];  // (in L1: requested before the PDL wait)
      const float f[4] = {v[u].x * sc * nw.x, v[u].y * sc * nw.y, v[u].z * sc * nw.z, v[u].w * sc * nw.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) xs[k * 4 + e] = from_f32<T>(f[e]);
    }
    staged = true;
  } else if (outs.norm_w) {
    // RMSNorm of each x row: add_rms_norm's formula (its warps' sums added in another order, so the
    // scale may differ from it in the last bit).
    float ss[N];
#pragma unroll
    for (int r = 0; r < N; ++r) ss[r] = 0.0f;
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (r >= n) break;
      for (int64_t i = threadIdx.x; i < in4; i += blockDim.x * kStageUnroll) {
        float4 v[kStageUnroll];
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          const int64_t k = i + u * blockDim.x;
          v[u] = k < in4 ? x4[r * in4 + k] : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) ss[r] += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
      }
    }
    __shared__ float red_n[kGemvWarps][N];
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float t = ss[r];
      for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
      if (lane == 0) red_n[threadIdx.x / 32][r] = t;
    }
    __syncthreads();
    if (threadIdx.x < n) {
      float t = 0.0f;
      for (int w8 = 0; w8 < kGemvWarps; ++w8) t += red_n[w8][threadIdx.x];
      scale[threadIdx.x] = rsqrtf(t / static_cast<float>(in) + outs.eps);
    }
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < (staged ? 0 : total4); i += blockDim.x * kStageUnroll) {
    float4 v[kStageUnroll], nw[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t k = i + u * blockDim.x;
      if (k < total4) {
        v[u] = x4[k];
        if (outs.norm_w) nw[u] = nw4[k % in4];
      }
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t k = i + u * blockDim.x;
      if (k >= total4) break;
      float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
      if (outs.norm_w) {
        const float sc = scale[k / in4];
        const float ww[4] = {nw[u].x, nw[u].y, nw[u].z, nw[u].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = f[e] * sc * ww[e];
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) xs[k * 4 + e] = from_f32<T>(f[e]);
    }
  }
  __syncthreads();
}

// Small-batch matmul (decode): y[n, o] = sum_i w[o, i] x[n, i] (+ bias[o]) for N <= 8 rows of x.
// Decode is bound by reading the weights once, so the kernel is built to keep enough of them in
// flight: persistent blocks (a few per SM) whose warps walk the output rows with a stride, one row
// at a time, each lane reading 16 bytes (8 elements) per load in batches of kGemvBatch loads, two
// batches in flight, the next row's loads issued while the current row is summed (~8 KB in flight
// per warp, across row ends). The first two batches are requested before the block stages x in
// shared memory — once per block — rounded to the weights' dtype, as the cuBLAS path rounds it (the
// same numbers whatever n), with the RMSNorm folded in (norm_w); or (XT) x already in the weights'
// dtype, copied as it is (cp.async).
// PAIRS: the MLP's gate/up projection, w = the ff gate rows then the ff up rows: a warp takes gate
// row u and up row u one after the other and writes silu(gate) * up rounded to T (the down
// projection's input, as matmul_swiglu rounds it), so the down projection stages half the bytes
// and nothing computes the product twice.
template <typename T, int N, bool XT, bool PAIRS>
__global__ void __launch_bounds__(kGemvWarps * 32, 2)
    gemv_kernel(const T* __restrict__ w, const void* __restrict__ xin, GemvOut outs, int n, int64_t in) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);  // [n, in]
  constexpr int kStep = 32 * 8;  // elements of one warp-wide 16-byte load
  constexpr int kSpan = kGemvBatch * kStep;
  constexpr int kParts = PAIRS ? 2 : 1;  // rows per unit of work: one, or a gate/up pair
  const int lane = threadIdx.x % 32;
  const int64_t units = gemv_rows(outs);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kGemvWarps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  // This warp's units: first, first + warps, ...; each of kParts rows in nb batches: a flat stream
  // of n_batches batches, batch j = (unit first + (j / (kParts nb)) * warps, part (j / nb) % kParts,
  // elements (j % nb) * kSpan ..).
  const int nb = static_cast<int>((in + kSpan - 1) / kSpan);
  const int64_t my_units = first < units ? (units - first + warps - 1) / warps : 0;
  const int64_t n_batches = my_units * kParts * nb;
  auto unit_of = [&](int64_t j) { return first + (j / (kParts * nb)) * warps; };
  pdl_launch_dependents();  // the next kernel may start loading its weights as this one's blocks end
  uint4 buf0[kGemvBatch], buf1[kGemvBatch];
  auto load = [&](uint4(&buf)[kGemvBatch], int64_t j) {
    const int64_t row = PAIRS ? unit_of(j) + ((j / nb) & 1) * units : unit_of(j);
    const T* wr = w + row * in;
    const int64_t base = (j % nb) * kSpan + lane * 8;
#pragma unroll
    for (int u = 0; u < kGemvBatch; ++u) {
      const int64_t i = base + u * kStep;
      buf[u] = i < in ? load_weights16(wr + i) : make_uint4(0, 0, 0, 0);
    }
  };
  if (n_batches > 0) load(buf0, 0);
  if (n_batches > 1) load(buf1, 1);
  if (!XT) prefetch_norm_l1(outs, in);
  pdl_wait();  // x (and y, for accumulate) come from the kernels before
  stage_gemv_x<T, N, XT>(xs, xin, outs, n, in);

  float acc[N], gate[PAIRS ? N : 1];
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = 0.0f;
  auto consume = [&](const uint4(&buf)[kGemvBatch], int64_t j) {
    const int64_t base = (j % nb) * kSpan + lane * 8;
#pragma unroll
    for (int u = 0; u < kGemvBatch; ++u) {
      const int64_t i = base + u * kStep;
      if (i >= in) break;
      const T* p = reinterpret_cast<const T*>(&buf[u]);
      float wf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) wf[e] = to_f32(p[e]);
#pragma unroll
      for (int r = 0; r < N; ++r) {
        if (r < n) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xs + r * in + i);
          const T* xq = reinterpret_cast<const T*>(&xv);
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) s += wf[e] * to_f32(xq[e]);
          acc[r] += s;
        }
      }
    }
    if (j % nb != nb - 1) return;
    // The row is done: reduce over the warp and write its outputs.
    const int64_t row = unit_of(j);
    if constexpr (PAIRS) {  // the gate row's sums wait for the up row's
      const bool up = (j / nb) & 1;
#pragma unroll
      for (int r = 0; r < N; ++r) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        acc[r] = 0.0f;
        if (!up) {
          gate[r] = v;
        } else if (lane == 0 && r < n) {
          reinterpret_cast<T*>(outs.y[0])[r * units + row] = from_f32<T>(gated(outs, gate[r], v));
        }
      }
      return;
    }
    const GemvRow to = gemv_row(outs, row);
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float v = acc[r];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
      acc[r] = 0.0f;
      if (lane == 0 && r < n) {
        float* dst = to.y + r * to.rows + to.index;
        *dst = (outs.accumulate ? *dst : 0.0f) + v + (to.bias ? to.bias[to.index] : 0.0f);
      }
    }
  };
  for (int64_t j = 0; j < n_batches; j += 2) {
    consume(buf0, j);
    if (j + 2 < n_batches) load(buf0, j + 2);
    if (j + 1 < n_batches) {
      consume(buf1, j + 1);
      if (j + 3 < n_batches) load(buf1, j + 3);
    }
  }
}

// The decode matmul on tensor cores, for gemv_mma_rows() to 8 rows of x (gemv_kernel above takes
// fewer): the rows of x are the n side of an mma m16n8k16, so 1 to 8 rows cost the same
// instructions, where gemv_kernel's cost grows with each row (a verification of 5 drafted tokens
// took 2.5 decode steps). A lane's 16-byte loads of weight rows g and g + 8 (g = lane / 4, t = lane
// % 4: elements k0 + 8t .. k0 + 8t + 7) are its A fragments as they come: the mma's k indices 2t,
// 2t + 1 / 2t + 8, 2t + 9 stand for elements 8t, 8t + 1 / 8t + 2, 8t + 3 (the first mma; 8t + 4 ..
// 8t + 7 the second), and row g of x's same 8 elements are the B fragments (x's rows past n are
// zeros) — the same permutation of k on both sides, so the products are w's and x's. No shared
// memory for the weights, no conversions. A tile is 16 weight rows (PAIRS: 16 gate rows and their
// 16 up rows); the block's 8 warps split its k in chunks of 32 (warp w takes chunks w, w + 8, ..)
// and their sums are added in warp order (sums[tile parity]: one barrier a tile): a row of x gets
// the same numbers whatever rows share the call (an mma's columns do not mix). Blocks are
// persistent, each with the same number of consecutive tiles. x: staged once a block as
// gemv_kernel stages it (stage_gemv_x: f32 rounded to T, the norm folded in; its many-row path for
// every n, so a row's norm is summed alike whatever n is), or (XT) read from global memory as it
// is (no staging, so no limit on its width).
constexpr int kMmaTile = 16;  // weight rows a tile

template <typename T, bool XT, bool PAIRS>
__global__ void __launch_bounds__(kGemvWarps * 32, 2)
    gemv_mma_kernel(const T* __restrict__ w, const void* __restrict__ xin, GemvOut outs, int n, int64_t in,
                    int64_t tiles_per_block) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);  // [n, in] (staged x)
  constexpr int kParts = PAIRS ? 2 : 1;
  constexpr int kChunks = kGemvBatch / (2 * kParts);  // chunks of 32 elements a batch (two rows each, per part)
  __shared__ float sums[2][kGemvWarps][4 * kParts][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t units = gemv_rows(outs);  // weight rows (PAIRS: gate rows)
  int64_t tile0 = 0;
  const int64_t my_tiles = block_tiles(units, kMmaTile, tiles_per_block, &tile0);
  // Each tile is nb batches for every warp: batch b holds the warp's chunks b kChunks .. + kChunks.
  const int64_t chunks = (in + 31) / 32;
  const int nb = static_cast<int>(((chunks + kGemvWarps - 1) / kGemvWarps + kChunks - 1) / kChunks);
  const int64_t n_batches = my_tiles * nb;
  // Element offset of this lane's 8 in chunk c of batch b of a tile.
  auto element = [&](int b, int c) { return (static_cast<int64_t>(warp + kGemvWarps * (b * kChunks + c))) * 32 + 8 * t; };
  pdl_launch_dependents();
  // buf[(p * 2 + h) * kChunks + c]: part p's row g + 8h, chunk c.
  using Buf = uint4[kGemvBatch];
  auto load = [&](Buf& buf, int64_t j) {
    const int64_t tile = tile0 + j / nb;
    const int b = static_cast<int>(j % nb);
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = tile * kMmaTile + g + 8 * h;
        const T* wr = w + (row + p * units) * in;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int64_t k = element(b, c);
          buf[(p * 2 + h) * kChunks + c] = row < units && k < in ? load_weights16(wr + k) : make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  auto ready = [&] {
    if (!XT) prefetch_norm_l1(outs, in);
    pdl_wait();  // x (and y, for accumulate) come from the kernels before
    if constexpr (!XT) stage_gemv_x<T, 8, false>(xs, xin, outs, n, in);  // (one path for every n)
  };
  const T* xg = static_cast<const T*>(xin) + g * in;  // (XT) this lane's row of x

  float acc[kParts][4];
#pragma unroll
  for (int p = 0; p < kParts; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.0f;
  int parity = 0;
  auto consume = [&](const Buf& buf, int64_t j) {
    const int b = static_cast<int>(j % nb);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t k = element(b, c);
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (g < n && k < in) xv = XT ? __ldg(reinterpret_cast<const uint4*>(xg + k)) : *reinterpret_cast<const uint4*>(xs + g * in + k);
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        const uint4 lo = buf[(p * 2) * kChunks + c], hi = buf[(p * 2 + 1) * kChunks + c];  // rows g, g + 8
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
        mma16816<T>(acc[p], a0, xv.x, xv.y);
        mma16816<T>(acc[p], a1, xv.z, xv.w);
      }
    }
    if (b != nb - 1) return;
    finish_mma_tile<kGemvWarps, kParts, T>(sums, acc, parity, (tile0 + j / nb) * kMmaTile, outs, n, units);
  };
  double_buffered<Buf>(n_batches, load, ready, consume);
}

constexpr size_t kGemvMaxShared = 96 * 1024;  // x staged per block; larger goes to cuBLAS
constexpr int kGemvMaxRows = 8;                // rows of x the decode kernels take

template <typename T, int N, bool XT, bool PAIRS>
void launch_gemv_n(const T* w, const void* x, const GemvOut& outs, int n, int64_t in, cudaStream_t st) {
  // Persistent blocks: as many as stay resident (computed once per kernel for the largest x).
  allow_dynamic_smem<gemv_kernel<T, N, XT, PAIRS>>(kGemvMaxShared);
  static const int resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<T, N, XT, PAIRS>, kGemvWarps * 32,
                                                  static_cast<size_t>(N) * 2048 * sizeof(T));
    cudaGetLastError();
    return std::max(1, sms) * std::clamp(per_sm, 1, 2);
  }();
  const int64_t units = outs.end[outs.count - 1];
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((units + kGemvWarps - 1) / kGemvWarps, resident));
  launch_pdl(gemv_kernel<T, N, XT, PAIRS>, dim3(grid), dim3(kGemvWarps * 32), static_cast<size_t>(n * in) * sizeof(T), st,
             w, x, outs, n, in);
}

template <typename T, bool XT, bool PAIRS>
void launch_gemv_mma(const T* w, const void* x, const GemvOut& outs, int n, int64_t in, cudaStream_t st) {
  allow_dynamic_smem<gemv_mma_kernel<T, XT, PAIRS>>(kGemvMaxShared);
  static const int resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_mma_kernel<T, XT, PAIRS>, kGemvWarps * 32,
                                                  XT ? 0 : size_t{8} * 2048 * sizeof(T));
    cudaGetLastError();
    return std::max(1, sms) * std::clamp(per_sm, 1, 2);
  }();
  int64_t per_block = 0;
  const unsigned grid = equal_tiles_grid((outs.end[outs.count - 1] + kMmaTile - 1) / kMmaTile, resident, &per_block);
  launch_pdl(gemv_mma_kernel<T, XT, PAIRS>, dim3(grid), dim3(kGemvWarps * 32),
             XT ? size_t{0} : static_cast<size_t>(n * in) * sizeof(T), st, w, x, outs, n, in, per_block);
}

// The fewest rows of x that take gemv_mma_kernel; fewer take gemv_kernel, faster there for
// llama-8b (H100, a step of sessions decoding together: one 5.56 vs 6.30 ms, 2: 6.44 vs 6.81, 3:
// 7.88 vs 8.98, 4: 7.85 vs 8.21; 5: 10.4 vs 8.2, where gemv_kernel's 8-row variant takes over;
// llama-1b's gains from 2 rows). COMBS_GEMV_MMA_ROWS (1-9) overrides it, for comparing the two in
// one binary (9: gemv_kernel always).
int gemv_mma_rows() {
  static const int rows = rows_from_env("COMBS_GEMV_MMA_ROWS", 5);
  return rows;
}

template <typename T, bool XT, bool PAIRS>
void launch_gemv(const T* w, const void* x, const GemvOut& outs, int n, int64_t in, cudaStream_t st) {
  if (n >= gemv_mma_rows()) {
    launch_gemv_mma<T, XT, PAIRS>(w, x, outs, n, in, st);
    return;
  }
  if (n <= 1) launch_gemv_n<T, 1, XT, PAIRS>(w, x, outs, n, in, st);
  else if (n <= 2) launch_gemv_n<T, 2, XT, PAIRS>(w, x, outs, n, in, st);
  else if (n <= 4) launch_gemv_n<T, 4, XT, PAIRS>(w, x, outs, n, in, st);
  else launch_gemv_n<T, 8, XT, PAIRS>(w, x, outs, n, in, st);
}

// The decode kernel for w (gemv_fits): x f32 (XT false) or in w's dtype (XT).
template <bool XT = false, bool PAIRS = false>
void gemv(const Tensor& w, const void* x, const GemvOut& outs, int n, cudaStream_t st) {
  if (w.dtype() == DType::kBF16) launch_gemv<__nv_bfloat16, XT, PAIRS>(w.data_as<__nv_bfloat16>(), x, outs, n, w.dim(1), st);
  else launch_gemv<__half, XT, PAIRS>(w.data_as<__half>(), x, outs, n, w.dim(1), st);
}

thread_local int t_decode_kernel_max_rows = kGemvMaxRows;  // set_decode_kernel_max_rows()

// Whether the decode kernels take w and n rows of x: f32 x (staged in shared memory, at most
// kGemvMaxShared), or x_rounded, already in w's dtype (matmul_rounded: the tensor-core kernel reads
// it from global memory, any width; gemv_kernel stages it too).
bool gemv_fits(const Tensor& w, int64_t n, bool x_rounded = false) {
  // Block types: x is read from global memory as 8-bit values (quant_matmul.h), no staging limit.
  if (is_block_quant(w.dtype())) return n <= kQuantGemvMaxRows && w.dim(1) % dtype_block_elems(w.dtype()) == 0;
  const bool staged = !x_rounded || n < gemv_mma_rows();
  return n <= t_decode_kernel_max_rows && w.dim(1) % 8 == 0 && (w.dtype() == DType::kBF16 || w.dtype() == DType::kF16) &&
         (!staged || static_cast<size_t>(n * w.dim(1)) * 2 <= kGemvMaxShared);
}

// This thread's share of columns [c0, c1) of row r, a block's threads blockDim.x apart: four
// floats at a time where the row allows (vec: r 16-byte aligned, c0 and c1 multiples of 4).
__device__ inline ArgMax scan_argmax(const float* __restrict__ r, int64_t c0, int64_t c1, bool vec) {
  ArgMax a;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(r);
#pragma unroll 4
    for (int64_t i = c0 / 4 + threadIdx.x; i < c1 / 4; i += blockDim.x) {
      const float4 v = r4[i];
      a.take(v.x, 4 * i), a.take(v.y, 4 * i + 1), a.take(v.z, 4 * i + 2), a.take(v.w, 4 * i + 3);
    }
  } else {
    for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) a.take(r[i], i);
  }
  return a;
}

// One block per row: each thread scans a stride (four floats at a time where the rows allow: vec),
// then block_argmax (ties to the lower id; a row of NaN gives 0).
__global__ void argmax_kernel(const float* __restrict__ x, int64_t cols, int32_t* __restrict__ out, bool vec) {
  __shared__ float fred[32];
  __shared__ int64_t ired[32];
  const float* r = x + blockIdx.x * cols;
  pdl_wait();  // the logits come from the projection before
  const int64_t best = block_argmax(scan_argmax(r, 0, cols, vec), fred, ired);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(best < cols ? best : 0);
}

// Rows longer than kArgmaxChunk (a vocabulary's logits: one block scanning 262,144 took ~30 us of
// a decode step) in two passes: block (c, r) takes the argmax of chunk c of row r (value and
// index), then a block per row takes the argmax of its chunks' (the largest value, the lowest
// index among equal ones: the same answer as one scan).
constexpr int64_t kArgmaxChunk = 4096;
__global__ void argmax_chunks_kernel(const float* __restrict__ x, int64_t cols, float* __restrict__ part_v,
                                     int64_t* __restrict__ part_i, bool vec) {
  __shared__ float fred[32];
  __shared__ int64_t ired[32];
  const float* r = x + blockIdx.y * cols;
  const int64_t c0 = blockIdx.x * kArgmaxChunk, c1 = c0 + kArgmaxChunk < cols ? c0 + kArgmaxChunk : cols;
  pdl_launch_dependents();
  pdl_wait();  // the logits come from the projection before
  const int64_t best = block_argmax(scan_argmax(r, c0, c1, vec), fred, ired);
  if (threadIdx.x == 0) {
    const int64_t at = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    part_v[at] = best < cols ? r[best] : -INFINITY;
    part_i[at] = best;
  }
}

__global__ void argmax_merge_kernel(const float* __restrict__ part_v, const int64_t* __restrict__ part_i, int chunks,
                                    int64_t cols, int32_t* __restrict__ out) {
  __shared__ float fred[32];
  __shared__ int64_t ired[32];
  ArgMax a;
  pdl_launch_dependents();
  pdl_wait();
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int64_t at = static_cast<int64_t>(blockIdx.x) * chunks + c;
    if (part_i[at] < cols) a.take(part_v[at], part_i[at]);
  }
  const int64_t best = block_argmax(a, fred, ired);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(best < cols ? best : 0);
}

// Block b copies chunk b (grid-strided over chunks when there are more than the grid holds).
// Either side may be mapped host memory: the loads or stores then cross the bus.
__global__ void copy_chunks_kernel(const Backend::CopyChunk* __restrict__ chunks, int64_t n, size_t bytes, bool vec) {
  for (int64_t c = blockIdx.x; c < n; c += gridDim.x) {
    const Backend::CopyChunk ch = chunks[c];
    if (vec) {
      const uint4* src = static_cast<const uint4*>(ch.src);
      uint4* dst = static_cast<uint4*>(ch.dst);
      const size_t n16 = bytes / 16;
#pragma unroll 4
      for (size_t i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = src[i];
    } else {
      const char* src = static_cast<const char*>(ch.src);
      char* dst = static_cast<char*>(ch.dst);
      for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
    }
  }
}

unsigned blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Weights a GEMM takes directly: F32, F16 or BF16 (block types go through quant_gemm's tiles).
cudaDataType_t cuda_dtype(const Tensor& w) {
  return w.dtype() == DType::kF32 ? CUDA_R_32F : w.dtype() == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

Status check_gemm_dtype(const Tensor& w) {
  if (w.dtype() == DType::kF32 || w.dtype() == DType::kF16 || w.dtype() == DType::kBF16) return ok_status();
  return unimplemented_error("cuda matmul: " + std::string(dtype_name(w.dtype())) + " weights have no cuBLAS path");
}

// A projection's weight, for every entry point: 2-D, in device memory (op names the caller).
Status check_weight(const Tensor& w, const char* op) {
  if (w.rank() != 2) return invalid_argument_error(std::string(op) + ": weight must be 2-D, not " + w.shape().to_string());
  if (w.device() != DeviceType::kCuda) return invalid_argument_error(std::string(op) + ": weight is not in device memory");
  return ok_status();
}

// A split projection's weight and outputs: 1 to 3, their rows adding up to the weight's.
Status check_split(const Tensor& w, std::span<const MatmulOut> outs) {
  COMBS_RETURN_IF_ERROR(check_weight(w, "cuda matmul_split"));
  if (outs.empty() || outs.size() > 3) return invalid_argument_error("cuda matmul_split: 1 to 3 outputs");
  int64_t rows = 0;
  for (const MatmulOut& o : outs) rows += o.rows;
  if (rows != w.dim(0)) {
    return invalid_argument_error("cuda matmul_split: the outputs' rows do not add up to the weight's " + w.shape().to_string());
  }
  return ok_status();
}

// count f32 values of x rounded to dt (F16 or BF16) in scratch slot 0 (valid until the next op
// that uses the scratch).
StatusOr<const void*> rounded_copy(CudaBackend& b, const float* x, int64_t count, DType dt) {
  COMBS_ASSIGN_OR_RETURN(void* xs, b.scratch(static_cast<size_t>(count) * 2));
  if (dt == DType::kF16) {
    launch_pdl(convert_kernel<__half>, dim3(blocks(count, 256)), dim3(256), 0, stream_of(b), x, static_cast<__half*>(xs), count);
  } else {
    launch_pdl(convert_kernel<__nv_bfloat16>, dim3(blocks(count, 256)), dim3(256), 0, stream_of(b), x, static_cast<__nv_bfloat16*>(xs), count);
  }
  COMBS_RETURN_IF_ERROR(launched("convert_kernel"));
  return static_cast<const void*>(xs);
}

// x as a cuBLAS GEMM takes it with w: f32 weights read x itself; 16-bit weights a copy rounded to
// their dtype (rounded_copy).
StatusOr<const void*> gemm_input(CudaBackend& b, const Tensor& w, const float* x, int64_t n) {
  COMBS_RETURN_IF_ERROR(check_gemm_dtype(w));
  if (w.dtype() == DType::kF32) return static_cast<const void*>(x);
  return rounded_copy(b, x, n * w.dim(1), w.dtype());
}

// y (+)= xin @ w^T (+ bias) on cuBLAS, xin from gemm_input(w).
Status gemm(CudaBackend& b, const Tensor& w, const void* xin, int64_t n, float* y, const float* bias, bool accumulate) {
  const int64_t out = w.dim(0), in = w.dim(1);
  auto handle = static_cast<cublasHandle_t>(b.cublas());
  const float one = 1.0f, zero = 0.0f;
  const float* beta = accumulate ? &one : &zero;
  const cudaDataType_t wtype = cuda_dtype(w);
  // Column-major view: y^T [out, n] = w [in, out]^T . x^T [in, n].
  COMBS_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                                            static_cast<int>(in), &one, w.data(), wtype, static_cast<int>(in), xin,
                                            wtype, static_cast<int>(in), beta, y, CUDA_R_32F, static_cast<int>(out),
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (bias) {
    add_bias_kernel<<<blocks(n * out, 256), 256, 0, stream_of(b)>>>(y, bias, n, out);
    COMBS_RETURN_IF_ERROR(launched("add_bias_kernel"));
  }
  return ok_status();
}

// The outputs of one projection on cuBLAS: w's rows split among outs, x from gemm_input(w). Two
// consecutive parts of equal rows without bias whose outputs lie in that order (K and V, gate and
// up: the runner allocates each pair together) run as one strided-batched GEMM.
Status gemm_parts(CudaBackend& b, const Tensor& w, const void* xin, int64_t n, std::span<const MatmulOut> outs) {
  int64_t begin = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const MatmulOut& o = outs[i];
    if (i + 1 < outs.size() && outs[i + 1].rows == o.rows && !o.bias && !outs[i + 1].bias &&
        outs[i + 1].y - o.y >= o.rows * n) {  // the second output starts past the first
      const int64_t in = w.dim(1);
      auto handle = static_cast<cublasHandle_t>(b.cublas());
      const float one = 1.0f, zero = 0.0f;
      const cudaDataType_t wtype = cuda_dtype(w);
      const Tensor part = w.rows(begin, begin + 2 * o.rows);
      COMBS_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(o.rows), static_cast<int>(n), static_cast<int>(in), &one,
          part.data(), wtype, static_cast<int>(in), static_cast<long long>(o.rows * in), xin, wtype,
          static_cast<int>(in), 0, &zero, o.y, CUDA_R_32F, static_cast<int>(o.rows),
          static_cast<long long>(outs[i + 1].y - o.y), 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      begin += 2 * o.rows;
      ++i;
      continue;
    }
    COMBS_RETURN_IF_ERROR(gemm(b, w.rows(begin, begin + o.rows), xin, n, o.y, o.bias, false));
    begin += o.rows;
  }
  return ok_status();
}

// The decode kernels' view of outs (consecutive row ranges of one weight).
GemvOut gemv_out(std::span<const MatmulOut> outs, bool accumulate, const float* norm_weight, float eps) {
  GemvOut g{};
  int64_t end = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    end += outs[i].rows;
    g.y[i] = outs[i].y, g.bias[i] = outs[i].bias, g.end[i] = end;
  }
  g.count = static_cast<int>(outs.size());
  g.accumulate = accumulate;
  g.norm_w = norm_weight;
  g.eps = eps;
  return g;
}

// Decode of block-quantized weights: x rounded to 8 bits once (RMS-normalized with norm_w first,
// where set) into scratch slot 0, then one pass over the weights.
Status quant_decode(CudaBackend& b, const Tensor& w, const float* x, int64_t n, const GemvOut& outs, bool pairs) {
  const int64_t in = w.dim(1);
  if (!gemv_fits(w, n)) return invalid_argument_error("cuda matmul: " + w.shape().to_string() + " " + std::string(dtype_name(w.dtype())) + " weights for " + std::to_string(n) + " rows: not whole blocks, or more than 8 rows");
  COMBS_ASSIGN_OR_RETURN(void* xq, b.scratch(activation_bytes(n, in)));
  COMBS_RETURN_IF_ERROR(quantize_activations(stream_of(b), x, n, in, outs.norm_w, outs.eps, xq));
  return quant_gemv(stream_of(b), w, xq, static_cast<int>(n), outs, pairs);
}

// outs (+)= w xq for xq x rounded to 8 bits (quantize_activations' layout) where
// rounds_x_to_8_bits(w, n): the decode kernel, or int8 tensor cores (their split-k scratch in
// kMmaSplitSlot).
Status quant_q8(CudaBackend& b, const Tensor& w, const void* xq, int64_t n, const GemvOut& outs) {
  if (gemv_fits(w, n)) return quant_gemv(stream_of(b), w, xq, static_cast<int>(n), outs, false);
  COMBS_ASSIGN_OR_RETURN(void* split, b.scratch(quant_imma_scratch_bytes(w, static_cast<int>(n)), CudaBackend::kMmaSplitSlot));
  return quant_imma(stream_of(b), w, xq, static_cast<int>(n), outs, split);
}

// Larger batches of block-quantized weights: x rounded to BF16 (scratch slot 0), each output's rows
// dequantized to BF16 a tile at a time (kWeightTileSlot, at most kQuantTileBytes) and multiplied on
// cuBLAS; the tiles are scratch, never a copy of the model.
Status quant_gemm(CudaBackend& b, const Tensor& w, const float* x, int64_t n, std::span<const MatmulOut> outs,
                  bool accumulate) {
  const int64_t in = w.dim(1);
  COMBS_ASSIGN_OR_RETURN(const void* xs, rounded_copy(b, x, n * in, DType::kBF16));
  int64_t largest = 0;
  for (const MatmulOut& o : outs) largest = std::max(largest, o.rows);
  const int64_t tile_rows = std::max<int64_t>(1, std::min<int64_t>(largest, static_cast<int64_t>(kQuantTileBytes) / (in * 2)));
  COMBS_ASSIGN_OR_RETURN(void* tile, b.scratch(static_cast<size_t>(tile_rows * in) * 2, CudaBackend::kWeightTileSlot));
  auto handle = static_cast<cublasHandle_t>(b.cublas());
  const float one = 1.0f, zero = 0.0f;
  int64_t begin = 0;
  for (const MatmulOut& o : outs) {
    for (int64_t r0 = 0; r0 < o.rows; r0 += tile_rows) {
      const int64_t m = std::min(tile_rows, o.rows - r0);
      COMBS_RETURN_IF_ERROR(dequantize_rows_bf16(stream_of(b), w, begin + r0, m, static_cast<__nv_bfloat16*>(tile)));
      // Column-major view: y^T [rows, n] (this tile's m of them) = tile [in, m]^T . x^T [in, n].
      COMBS_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                                                static_cast<int>(in), &one, tile, CUDA_R_16BF, static_cast<int>(in), xs,
                                                CUDA_R_16BF, static_cast<int>(in), accumulate ? &one : &zero, o.y + r0,
                                                CUDA_R_32F, static_cast<int>(o.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    if (o.bias) {
      add_bias_kernel<<<blocks(n * o.rows, 256), 256, 0, stream_of(b)>>>(o.y, o.bias, n, o.rows);
      COMBS_RETURN_IF_ERROR(launched("add_bias_kernel"));
    }
    begin += o.rows;
  }
  return ok_status();
}

// A projection of block-quantized weights into outs, any n.
Status quant_matmul(CudaBackend& b, const Tensor& w, const float* x, int64_t n, std::span<const MatmulOut> outs,
                    bool accumulate, const float* norm_weight, float eps) {
  if (w.dim(1) % dtype_block_elems(w.dtype()) != 0) {  // checked before any kernel reads a row
    return invalid_argument_error("cuda matmul: " + std::string(dtype_name(w.dtype())) + " rows of " +
                                  std::to_string(w.dim(1)) + " elements are not whole blocks");
  }
  if (gemv_fits(w, n)) return quant_decode(b, w, x, n, gemv_out(outs, accumulate, norm_weight, eps), false);
  if (norm_weight) return invalid_argument_error("cuda matmul_split: a fused norm needs decode_fused(w, n)");
  // The super-block formats: x rounded to 8 bits, int8 tensor cores (llama-8b Q4_K_M's matrices at
  // 64 rows: 0.55-0.91 of the BF16 kernel's time on the H100; 64 sessions 1.24x faster; RESULTS).
  if (n <= kQuantMmaMaxRows && quant_imma_takes(w.dtype())) {
    COMBS_ASSIGN_OR_RETURN(void* xq, b.scratch(activation_bytes(n, w.dim(1))));
    COMBS_RETURN_IF_ERROR(quantize_activations(stream_of(b), x, n, w.dim(1), nullptr, 0.0f, xq));
    return quant_q8(b, w, xq, n, gemv_out(outs, accumulate, nullptr, 0.0f));
  }
  // The weights read once, widened in shared memory: for up to 32 rows of x every llama-1b/8b
  // matrix took 0.46-0.96 the time of the tiles below; for 33-64 rows only rows of 4,096 and more
  // won (0.56-0.98; llama-1b's rows of 2,048: 1.10-1.29). bench/gpu/qgemv.cu, H200.
  if (n <= kQuantMmaMaxRows && (n <= 32 || w.dim(1) >= 4096)) {
    COMBS_ASSIGN_OR_RETURN(const void* xs, rounded_copy(b, x, n * w.dim(1), DType::kBF16));
    COMBS_ASSIGN_OR_RETURN(void* split, b.scratch(quant_mma_scratch_bytes(w, static_cast<int>(n)), CudaBackend::kMmaSplitSlot));
    return quant_mma(stream_of(b), w, static_cast<const __nv_bfloat16*>(xs), static_cast<int>(n),
                     gemv_out(outs, accumulate, nullptr, 0.0f), split);
  }
  return quant_gemm(b, w, x, n, outs, accumulate);
}

}  // namespace

DType input_dtype(const Tensor& w) {
  return w.dtype() == DType::kF16 || w.dtype() == DType::kBF16 ? w.dtype() : DType::kF32;
}

bool decode_fused(const Tensor& w, int64_t n) { return gemv_fits(w, n); }

void set_decode_kernel_max_rows(int rows) { t_decode_kernel_max_rows = std::clamp(rows, 1, kGemvMaxRows); }
int decode_kernel_max_rows() { return t_decode_kernel_max_rows; }

int decode_mma_min_rows(DType t) {
  if (t == DType::kBF16 || t == DType::kF16) return gemv_mma_rows();
  return quant_gemv_mma_min_rows(t);
}

bool rounds_x_to_8_bits(const Tensor& w, int64_t n) {
  return is_block_quant(w.dtype()) && (gemv_fits(w, n) || (n <= kQuantMmaMaxRows && quant_imma_takes(w.dtype())));
}

Status matmul(CudaBackend& b, const Tensor& w, const float* x, int64_t n, float* y, const float* bias, bool accumulate) {
  COMBS_RETURN_IF_ERROR(check_weight(w, "cuda matmul"));
  const int64_t out = w.dim(0), in = w.dim(1);
  if (n == 0) return ok_status();
  if (is_block_quant(w.dtype())) {
    const MatmulOut o[] = {{y, out, bias}};
    return quant_matmul(b, w, x, n, o, accumulate, nullptr, 0.0f);
  }
  // Decode-sized batches of 16-bit weights: the bandwidth-bound kernel above (in: whole 16-byte
  // chunks; every model dimension is a multiple of 8).
  if (gemv_fits(w, n)) {
    GemvOut o{{y, nullptr, nullptr}, {bias, nullptr, nullptr}, {out, 0, 0}, 1, accumulate, nullptr, 0.0f};
    gemv(w, x, o, static_cast<int>(n), stream_of(b));
    return launched("decode matmul");
  }
  COMBS_ASSIGN_OR_RETURN(const void* xin, gemm_input(b, w, x, n));
  return gemm(b, w, xin, n, y, bias, accumulate);
}

Status matmul_split(CudaBackend& b, const Tensor& w, const float* x, int64_t n, std::span<const MatmulOut> outs,
                    const float* norm_weight, float eps) {
  COMBS_RETURN_IF_ERROR(check_split(w, outs));
  if (n == 0) return ok_status();
  if (is_block_quant(w.dtype())) return quant_matmul(b, w, x, n, outs, false, norm_weight, eps);
  if (gemv_fits(w, n)) {
    gemv(w, x, gemv_out(outs, false, norm_weight, eps), static_cast<int>(n), stream_of(b));
    return launched("decode matmul");
  }
  if (norm_weight) return invalid_argument_error("cuda matmul_split: a fused norm needs decode_fused(w, n)");
  // x rounded once for every part.
  COMBS_ASSIGN_OR_RETURN(const void* xin, gemm_input(b, w, x, n));
  return gemm_parts(b, w, xin, n, outs);
}

Status matmul_split_parts(CudaBackend& b, std::span<const Tensor> parts, std::span<const size_t> outputs,
                          const float* x, int64_t n, std::span<const MatmulOut> outs, const float* norm_weight, float eps) {
  if (parts.size() != outputs.size() || parts.empty()) return invalid_argument_error("cuda matmul_split_parts: parts and outputs differ");
  bool once = parts.size() > 1 && n > 0;
  for (const Tensor& p : parts) {
    once = once && is_block_quant(p.dtype()) && gemv_fits(p, n) && p.dim(1) == parts[0].dim(1) &&
           p.dim(1) % dtype_block_elems(p.dtype()) == 0;
  }
  size_t at = 0;
  if (!once) {
    for (size_t i = 0; i < parts.size(); ++i) {
      if (at + outputs[i] > outs.size()) return invalid_argument_error("cuda matmul_split_parts: more outputs than outs");
      COMBS_RETURN_IF_ERROR(matmul_split(b, parts[i], x, n, outs.subspan(at, outputs[i]), norm_weight, eps));
      at += outputs[i];
    }
    return ok_status();
  }
  const int64_t in = parts[0].dim(1);
  COMBS_ASSIGN_OR_RETURN(void* xq, b.scratch(activation_bytes(n, in)));
  COMBS_RETURN_IF_ERROR(quantize_activations(stream_of(b), x, n, in, norm_weight, eps, xq));
  return matmul_split_parts_q8(b, parts, outputs, xq, n, outs);
}

Status matmul_split_rounded(CudaBackend& b, const Tensor& w, const void* x, int64_t n, std::span<const MatmulOut> outs) {
  COMBS_RETURN_IF_ERROR(check_split(w, outs));
  if (is_block_quant(w.dtype())) {
    return n == 0 ? ok_status() : quant_matmul(b, w, static_cast<const float*>(x), n, outs, false, nullptr, 0.0f);
  }
  COMBS_RETURN_IF_ERROR(check_gemm_dtype(w));
  return n == 0 ? ok_status() : gemm_parts(b, w, x, n, outs);
}

namespace {

// The checks of a gate/up pair weight (matmul_gate_up, matmul_gate_up_q8), and the decode kernels'
// view of its output h [n, rows / 2].
Status check_gate_up(const Tensor& w, const char* what) {
  COMBS_RETURN_IF_ERROR(check_weight(w, what));
  if (w.dim(0) % 2 != 0) {
    return invalid_argument_error(std::string(what) + ": weight must hold gate and up rows (an even count), not " +
                                  w.shape().to_string());
  }
  return ok_status();
}
GemvOut gate_up_out(const Tensor& w, void* h, GateActivation act, const float* norm_weight, float eps) {
  return GemvOut{{static_cast<float*>(h), nullptr, nullptr}, {nullptr, nullptr, nullptr}, {w.dim(0) / 2, 0, 0}, 1, false,
                 norm_weight, eps, act == GateActivation::kGeluTanh};
}

}  // namespace

Status matmul_gate_up(CudaBackend& b, const Tensor& w, const float* x, int64_t n, const float* norm_weight,
                      float eps, void* h, GateActivation act) {
  COMBS_RETURN_IF_ERROR(check_gate_up(w, "cuda matmul_gate_up"));
  if (n == 0) return ok_status();
  if (!gemv_fits(w, n)) return invalid_argument_error("cuda matmul_gate_up: needs decode_fused(w, n)");
  const GemvOut g = gate_up_out(w, h, act, norm_weight, eps);
  if (is_block_quant(w.dtype())) return quant_decode(b, w, x, n, g, /*pairs=*/true);
  gemv</*XT=*/false, /*PAIRS=*/true>(w, x, g, static_cast<int>(n), stream_of(b));
  return launched("decode matmul");
}

Status matmul_gate_up_q8(CudaBackend& b, const Tensor& w, const void* xq, int64_t n, void* h, GateActivation act) {
  COMBS_RETURN_IF_ERROR(check_gate_up(w, "cuda matmul_gate_up_q8"));
  if (n == 0) return ok_status();
  if (!is_block_quant(w.dtype()) || !gemv_fits(w, n)) {
    return invalid_argument_error("cuda matmul_gate_up_q8: needs block-quantized weights and decode_fused(w, n)");
  }
  return quant_gemv(stream_of(b), w, xq, static_cast<int>(n), gate_up_out(w, h, act, nullptr, 0.0f), /*pairs=*/true);
}

Status matmul_rounded(CudaBackend& b, const Tensor& w, const void* x, int64_t n, float* y, bool accumulate) {
  COMBS_RETURN_IF_ERROR(check_weight(w, "cuda matmul"));
  if (input_dtype(w) == DType::kF32) return matmul(b, w, static_cast<const float*>(x), n, y, nullptr, accumulate);
  if (n == 0) return ok_status();
  if (gemv_fits(w, n, /*x_rounded=*/true) && reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // 16-byte loads of x
    GemvOut g{{y, nullptr, nullptr}, {nullptr, nullptr, nullptr}, {w.dim(0), 0, 0}, 1, accumulate, nullptr, 0.0f};
    gemv</*XT=*/true>(w, x, g, static_cast<int>(n), stream_of(b));
    return launched("decode matmul");
  }
  return gemm(b, w, x, n, y, nullptr, accumulate);
}

Status matmul_swiglu(CudaBackend& b, const Tensor& w, float* gate, const float* up, int64_t n, float* y,
                     bool accumulate) {
  COMBS_RETURN_IF_ERROR(check_weight(w, "cuda matmul"));
  if (n == 0) return ok_status();
  const bool rows16 = reinterpret_cast<uintptr_t>(gate) % 16 == 0 && reinterpret_cast<uintptr_t>(up) % 16 == 0;
  if (rows16 && rounds_x_to_8_bits(w, n) && w.dim(1) % dtype_block_elems(w.dtype()) == 0) {
    // The product formed as it is rounded to 8 bits: no silu_mul pass (the same numbers).
    COMBS_ASSIGN_OR_RETURN(void* xq, b.scratch(activation_bytes(n, w.dim(1))));
    COMBS_RETURN_IF_ERROR(quantize_activations(stream_of(b), gate, n, w.dim(1), nullptr, 0.0f, xq, up));
    const MatmulOut o[] = {{y, w.dim(0)}};
    return quant_q8(b, w, xq, n, gemv_out(o, accumulate, nullptr, 0.0f));
  }
  if (w.dtype() != DType::kF16 && w.dtype() != DType::kBF16) {
    COMBS_RETURN_IF_ERROR(silu_mul(b, gate, up, n * w.dim(1)));
    return matmul(b, w, gate, n, y, nullptr, accumulate);
  }
  // The product rounded to the weights' dtype as it is formed: the GEMM's input, no rounding pass.
  const int64_t count = n * w.dim(1);
  COMBS_ASSIGN_OR_RETURN(void* xs, b.scratch(static_cast<size_t>(count) * 2));
  if (w.dtype() == DType::kF16) {
    launch_pdl(silu_mul_kernel<__half>, dim3(blocks(count, 256)), dim3(256), 0, stream_of(b), gate, up, static_cast<__half*>(xs), count);
  } else {
    launch_pdl(silu_mul_kernel<__nv_bfloat16>, dim3(blocks(count, 256)), dim3(256), 0, stream_of(b), gate, up, static_cast<__nv_bfloat16*>(xs), count);
  }
  COMBS_RETURN_IF_ERROR(launched("silu_mul_kernel"));
  return matmul_rounded(b, w, xs, n, y, accumulate);
}

Status embedding(CudaBackend& b, const Tensor& table, const int32_t* ids, int64_t n, float* out) {
  if (table.rank() != 2 || table.device() != DeviceType::kCuda) {
    return invalid_argument_error("cuda embedding: the table must be a 2-D device tensor");
  }
  if (n == 0) return ok_status();
  const int64_t dim = table.dim(1);
  if (is_block_quant(table.dtype())) {
    return dequantize_rows_f32(stream_of(b), table, ids, n, out);
  }
  switch (table.dtype()) {
    case DType::kF32:
      embedding_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(table.data_as<float>(), ids, out, dim);
      break;
    case DType::kF16:
      embedding_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(table.data_as<__half>(), ids, out, dim);
      break;
    case DType::kBF16:
      embedding_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(table.data_as<__nv_bfloat16>(), ids, out,
                                                                           dim);
      break;
    default: return unimplemented_error("cuda embedding: " + std::string(dtype_name(table.dtype())) + " table");
  }
  return launched("embedding_kernel");
}

Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, void* y, DType y_dtype,
                    int64_t n, int64_t dim, float eps) {
  return add_normed_rms_norm(b, residual, delta, nullptr, weight, y, y_dtype, n, dim, eps);
}

Status add_normed_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* delta_weight,
                           const float* weight, void* y, DType y_dtype, int64_t n, int64_t dim, float eps) {
  if (n == 0) return ok_status();
  const unsigned grid = static_cast<unsigned>(n);
  // float4 rows: dim a multiple of 4, every row 16-byte aligned (y's 4 elements: 16 or 8 bytes).
  auto aligned = [](const void* p, uintptr_t a) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % a == 0; };
  const bool vec = dim % 4 == 0 && aligned(residual, 16) && aligned(delta, 16) && aligned(delta_weight, 16) &&
                   aligned(weight, 16) && aligned(y, y_dtype == DType::kF32 ? 16 : 8);
  switch (y_dtype) {
    case DType::kF32: launch_pdl(add_rms_norm_kernel<float>, dim3(grid), dim3(256), 0, stream_of(b), residual, delta, delta_weight, weight, static_cast<float*>(y), dim, eps, vec); break;
    case DType::kF16: launch_pdl(add_rms_norm_kernel<__half>, dim3(grid), dim3(256), 0, stream_of(b), residual, delta, delta_weight, weight, static_cast<__half*>(y), dim, eps, vec); break;
    case DType::kBF16: launch_pdl(add_rms_norm_kernel<__nv_bfloat16>, dim3(grid), dim3(256), 0, stream_of(b), residual, delta, delta_weight, weight, static_cast<__nv_bfloat16*>(y), dim, eps, vec); break;
    default: return invalid_argument_error("cuda add_rms_norm: output dtype must be f32, f16 or bf16");
  }
  return launched("add_rms_norm_kernel");
}

bool takes_q8(const Tensor& w, int64_t n) { return rounds_x_to_8_bits(w, n); }

size_t q8_bytes(int64_t n, int64_t dim) { return activation_bytes(n, dim); }

Status add_normed_rms_norm_q8(CudaBackend& b, float* residual, const float* delta, const float* delta_weight,
                              const float* weight, void* xq, int64_t n, int64_t dim, float eps) {
  if (n == 0) return ok_status();
  if (dim % 32 != 0) return invalid_argument_error("cuda add_normed_rms_norm_q8: rows of " + std::to_string(dim) + " (not whole groups of 32)");
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  constexpr int kThreads = 256;
  if (dim <= kThreads * 4 * kNormCached && aligned(residual) && aligned(delta) && aligned(delta_weight) &&
      aligned(weight) && aligned(xq)) {
    int8_t* q = static_cast<int8_t*>(xq);
    const Q8Out q8{q, reinterpret_cast<float*>(q + activation_scales_offset(n, dim)), static_cast<int>(activation_group(dim)),
                   activation_group(dim) == 256 ? q + activation_sums_offset(n, dim) : nullptr};
    launch_pdl(add_rms_norm_q8_kernel, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream_of(b), residual, delta,
               delta_weight, weight, dim, eps, q8);
    return launched("add_rms_norm_q8_kernel");
  }
  // Longer or unaligned rows: the norm in f32 (scratch), then rounded (the same numbers).
  COMBS_ASSIGN_OR_RETURN(void* y, b.scratch(static_cast<size_t>(n * dim) * sizeof(float)));
  COMBS_RETURN_IF_ERROR(add_normed_rms_norm(b, residual, delta, delta_weight, weight, y, DType::kF32, n, dim, eps));
  return quantize_activations(stream_of(b), static_cast<const float*>(y), n, dim, nullptr, 0.0f, xq);
}

Status matmul_split_parts_q8(CudaBackend& b, std::span<const Tensor> parts, std::span<const size_t> outputs,
                             const void* xq, int64_t n, std::span<const MatmulOut> outs) {
  if (parts.size() != outputs.size() || parts.empty()) return invalid_argument_error("cuda matmul_split_parts_q8: parts and outputs differ");
  size_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!takes_q8(parts[i], n) || parts[i].dim(1) != parts[0].dim(1)) {
      return invalid_argument_error("cuda matmul_split_parts_q8: part " + std::to_string(i) + " (" + parts[i].shape().to_string() +
                                    " " + std::string(dtype_name(parts[i].dtype())) + ") does not take 8-bit x for " +
                                    std::to_string(n) + " rows");
    }
    if (at + outputs[i] > outs.size()) return invalid_argument_error("cuda matmul_split_parts_q8: more outputs than outs");
    const auto part_outs = outs.subspan(at, outputs[i]);
    COMBS_RETURN_IF_ERROR(check_split(parts[i], part_outs));
    if (n > 0) COMBS_RETURN_IF_ERROR(quant_q8(b, parts[i], xq, n, gemv_out(part_outs, false, nullptr, 0.0f)));
    at += outputs[i];
  }
  return ok_status();
}

Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, float* y, int64_t n,
                    int64_t dim, float eps) {
  return add_rms_norm(b, residual, delta, weight, y, DType::kF32, n, dim, eps);
}

Status heads_rms_norm(CudaBackend& b, float* q, const float* q_weight, int64_t q_rows, float* k, const float* k_weight,
                      int64_t k_rows, int64_t dim, float eps) {
  const int64_t rows = q_rows + k_rows;
  if (rows == 0) return ok_status();
  launch_pdl(heads_rms_norm_kernel, dim3(static_cast<unsigned>((rows + kHeadNormWarps - 1) / kHeadNormWarps)),
             dim3(kHeadNormWarps * 32), 0, stream_of(b), q, q_weight, q_rows, k, k_weight, k_rows, dim, eps);
  return launched("heads_rms_norm_kernel");
}

Status gather_rows(CudaBackend& b, const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst) {
  if (n == 0) return ok_status();
  gather_rows_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(src, rows, dst, dim);
  return launched("gather_rows_kernel");
}

Status copy_chunks(CudaBackend& b, const Backend::CopyChunk* chunks, int64_t n, size_t bytes) {
  if (n == 0) return ok_status();
  // The chunks are page slices (16-byte multiples at 16-byte aligned addresses) in practice; the
  // byte loop keeps any other call correct.
  const bool vec = bytes % 16 == 0;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 65535));
  copy_chunks_kernel<<<grid, 256, 0, stream_of(b)>>>(chunks, n, bytes, vec);
  return launched("copy_chunks_kernel");
}

Status argmax_rows(CudaBackend& b, const float* x, int64_t rows, int64_t cols, int32_t* out) {
  if (rows == 0) return ok_status();
  const bool vec = cols % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t chunks = (cols + kArgmaxChunk - 1) / kArgmaxChunk;
  if (chunks <= 1 || rows > 65535) {
    launch_pdl(argmax_kernel, dim3(static_cast<unsigned>(rows)), dim3(1024), 0, stream_of(b), x, cols, out, vec);
    return launched("argmax_kernel");
  }
  const size_t n = static_cast<size_t>(rows * chunks);
  COMBS_ASSIGN_OR_RETURN(void* part, b.scratch(n * (sizeof(int64_t) + sizeof(float))));
  int64_t* part_i = static_cast<int64_t*>(part);
  float* part_v = reinterpret_cast<float*>(part_i + n);
  launch_pdl(argmax_chunks_kernel, dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(rows)), dim3(256), 0,
             stream_of(b), x, cols, part_v, part_i, vec);
  COMBS_RETURN_IF_ERROR(launched("argmax_chunks_kernel"));
  launch_pdl(argmax_merge_kernel, dim3(static_cast<unsigned>(rows)), dim3(256), 0, stream_of(b), part_v, part_i,
             static_cast<int>(chunks), cols, out);
  return launched("argmax_merge_kernel");
}

Status silu_mul(CudaBackend& b, float* gate, const float* up, int64_t n) {
  if (n == 0) return ok_status();
  silu_mul_kernel<<<blocks(n, 256), 256, 0, stream_of(b)>>>(gate, up, gate, n);
  return launched("silu_mul_kernel");
}

namespace {

// x[i] = f(x[i], y ? y[i] : 0) over n elements: the runner's elementwise odds and ends.
template <typename F>
__global__ void elementwise_kernel(float* x, const float* __restrict__ y, int64_t n, F f) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  pdl_launch_dependents();
  pdl_wait();
  if (i < n) x[i] = f(x[i], y ? y[i] : 0.0f);
}

template <typename F>
Status elementwise(CudaBackend& b, float* x, const float* y, int64_t n, F f, const char* name) {
  if (n == 0) return ok_status();
  launch_pdl(elementwise_kernel<F>, dim3(blocks(n, 256)), dim3(256), 0, stream_of(b), x, y, n, f);
  return launched(name);
}

struct GeluTanhMul {
  __device__ float operator()(float g, float u) const {
    return gelu_tanh(g) * u;
  }
};
struct Scale {
  float s;
  __device__ float operator()(float x, float) const { return x * s; }
};
struct Softcap {
  float cap, inv;
  __device__ float operator()(float x, float) const { return cap * tanhf(x * inv); }
};

}  // namespace

Status gelu_tanh_mul(CudaBackend& b, float* gate, const float* up, int64_t n) {
  return elementwise(b, gate, up, n, GeluTanhMul{}, "gelu_tanh_mul");
}
Status scale(CudaBackend& b, float* x, int64_t n, float factor) { return elementwise(b, x, nullptr, n, Scale{factor}, "scale"); }
Status softcap(CudaBackend& b, float* x, int64_t n, float cap) {
  return elementwise(b, x, nullptr, n, Softcap{cap, 1.0f / cap}, "softcap");
}

}  // namespace combs::cuda
