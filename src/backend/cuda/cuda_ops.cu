// The CUDA backend's ops (see include/combs/backend/cuda/cuda_ops.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"

namespace combs::cuda {

namespace {

cudaStream_t stream_of(CudaBackend& b) { return static_cast<cudaStream_t>(b.stream()); }

Status launched(const char* kernel) { return cuda_status(cudaGetLastError(), kernel); }

__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__half v) { return __half2float(v); }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_f32(float v);
template <>
__device__ inline __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void convert_kernel(const float* __restrict__ x, T* __restrict__ y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = from_f32<T>(x[i]);
}

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
__global__ void add_rms_norm_kernel(float* __restrict__ residual, const float* __restrict__ delta,
                                    const float* __restrict__ weight, float* __restrict__ y, int64_t dim, float eps) {
  float* r = residual + blockIdx.x * dim;
  const float* d = delta ? delta + blockIdx.x * dim : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = d ? r[i] + d[i] : r[i];
    if (d) r[i] = v;
    ss += v * v;
  }
  __shared__ float warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < (blockDim.x >> 5) ? warp_sums[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (threadIdx.x == 0) warp_sums[0] = ss;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / static_cast<float>(dim) + eps);
  float* yr = y + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = r[i] * scale * weight[i];
}

// One thread per (token, head, pair).
__global__ void rope_kernel(float* __restrict__ x, const int32_t* __restrict__ pos, int64_t n_tokens, int n_heads,
                            int head_dim, int rope_dim, const float* __restrict__ inv_freq, bool adjacent) {
  const int half = rope_dim / 2;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n_tokens * n_heads * half) return;
  const int i = static_cast<int>(idx % half);
  const int64_t th = idx / half;  // token * n_heads + head
  const int64_t t = th / n_heads;
  // As the CPU: the angle in f32, its cos/sin in f64.
  const float angle = static_cast<float>(pos[t]) * inv_freq[i];
  double s, c;
  sincos(static_cast<double>(angle), &s, &c);
  float* v = x + th * head_dim;
  const int a = adjacent ? 2 * i : i, bb = adjacent ? 2 * i + 1 : i + half;
  const float x0 = v[a], x1 = v[bb];
  v[a] = x0 * static_cast<float>(c) - x1 * static_cast<float>(s);
  v[bb] = x0 * static_cast<float>(s) + x1 * static_cast<float>(c);
}

__global__ void silu_mul_kernel(float* __restrict__ gate, const float* __restrict__ up, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                                   float* __restrict__ dst, int64_t dim) {
  const float* s = src + static_cast<int64_t>(rows[blockIdx.x]) * dim;
  float* d = dst + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) d[i] = s[i];
}

unsigned blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

Status matmul(CudaBackend& b, const Tensor& w, const float* x, int64_t n, float* y, const float* bias) {
  if (w.rank() != 2) return invalid_argument_error("cuda matmul: weight must be 2-D, not " + w.shape().to_string());
  if (w.device() != DeviceType::kCuda) return invalid_argument_error("cuda matmul: weight is not in device memory");
  const int64_t out = w.dim(0), in = w.dim(1);
  if (n == 0) return ok_status();
  auto handle = static_cast<cublasHandle_t>(b.cublas());
  const float one = 1.0f, zero = 0.0f;
  cudaDataType_t wtype;
  const void* xin = x;
  switch (w.dtype()) {
    case DType::kF32: wtype = CUDA_R_32F; break;
    case DType::kF16:
    case DType::kBF16: {
      wtype = w.dtype() == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
      COMBS_ASSIGN_OR_RETURN(void* xs, b.scratch(static_cast<size_t>(n * in) * 2));
      if (w.dtype() == DType::kF16) {
        convert_kernel<<<blocks(n * in, 256), 256, 0, stream_of(b)>>>(x, static_cast<__half*>(xs), n * in);
      } else {
        convert_kernel<<<blocks(n * in, 256), 256, 0, stream_of(b)>>>(x, static_cast<__nv_bfloat16*>(xs), n * in);
      }
      COMBS_RETURN_IF_ERROR(launched("convert_kernel"));
      xin = xs;
      break;
    }
    default:
      return unimplemented_error("cuda matmul: " + std::string(dtype_name(w.dtype())) +
                                 " weights (convert Q8_0 to BF16 at load)");
  }
  // Column-major view: y^T [out, n] = w [in, out]^T . x^T [in, n].
  COMBS_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                                            static_cast<int>(in), &one, w.data(), wtype, static_cast<int>(in), xin,
                                            wtype, static_cast<int>(in), &zero, y, CUDA_R_32F, static_cast<int>(out),
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (bias) {
    add_bias_kernel<<<blocks(n * out, 256), 256, 0, stream_of(b)>>>(y, bias, n, out);
    COMBS_RETURN_IF_ERROR(launched("add_bias_kernel"));
  }
  return ok_status();
}

Status embedding(CudaBackend& b, const Tensor& table, const int32_t* ids, int64_t n, float* out) {
  if (table.rank() != 2 || table.device() != DeviceType::kCuda) {
    return invalid_argument_error("cuda embedding: the table must be a 2-D device tensor");
  }
  if (n == 0) return ok_status();
  const int64_t dim = table.dim(1);
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

Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, float* y, int64_t n,
                    int64_t dim, float eps) {
  if (n == 0) return ok_status();
  add_rms_norm_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(residual, delta, weight, y, dim, eps);
  return launched("add_rms_norm_kernel");
}

Status rope(CudaBackend& b, float* x, const int32_t* pos, int64_t n_tokens, int n_heads, int head_dim, int rope_dim,
            const float* inv_freq, bool adjacent_pairs) {
  const int64_t total = n_tokens * n_heads * (rope_dim / 2);
  if (total == 0) return ok_status();
  rope_kernel<<<blocks(total, 256), 256, 0, stream_of(b)>>>(x, pos, n_tokens, n_heads, head_dim, rope_dim, inv_freq,
                                                            adjacent_pairs);
  return launched("rope_kernel");
}

Status gather_rows(CudaBackend& b, const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst) {
  if (n == 0) return ok_status();
  gather_rows_kernel<<<static_cast<unsigned>(n), 256, 0, stream_of(b)>>>(src, rows, dst, dim);
  return launched("gather_rows_kernel");
}

Status silu_mul(CudaBackend& b, float* gate, const float* up, int64_t n) {
  if (n == 0) return ok_status();
  silu_mul_kernel<<<blocks(n, 256), 256, 0, stream_of(b)>>>(gate, up, n);
  return launched("silu_mul_kernel");
}

}  // namespace combs::cuda
