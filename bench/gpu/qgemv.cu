// Microbenchmark of the block-quantized decode kernels (src/backend/cuda/quant_matmul.cu, compiled
// into this program so that its private kernels can be launched side by side): for the matrices of
// a llama-8b / llama-1b Q4_K_M decode step, each kernel's time per call and the weight bytes it
// reads per second, against the device copy bandwidth measured in the same run; and the largest
// difference between the variants' outputs. Each call reads a different copy of the weights
// (enough copies to pass 400 MB), so that L2 (50 MB) holds none of them.
//
// Build (needs libcombs_core.a from a CUDA build, e.g. build/portable):
//   nvcc -O3 -std=c++20 --use_fast_math -arch=sm_90 -Iinclude -Isrc bench/gpu/qgemv.cu \
//     build/portable/libcombs_core.a -lcublas -o qgemv
// Run: ./qgemv [REPS]   (tab-separated: case, variant, us per call, GB/s, fraction of copy, max diff
// to the first variant; QGEMV_ONLY=S: the cases whose name holds S)
//      ./qgemv REPS mma N   the batch kernel (quant_mma) for N rows of x on the same matrices: us per
// call, the weights' GB/s and fraction of copy, and TFLOPS
//      ./qgemv REPS imma N  the 8-bit batch kernel (quant_imma) against quant_mma, N rows of x: us per
// call of each, GB/s, and the largest difference of their outputs relative to the largest output
#include "../../src/backend/cuda/quant_matmul.cu"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace combs;
using namespace combs::cuda;

namespace {

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

struct Case {
  const char* name;
  DType type;
  int64_t rows, in;  // rows: of the output (pairs: gate rows; the weight has twice as many)
  bool pairs;
};

// Random blocks with finite f16 scales (d and dmin small, so that sums stay finite).
std::vector<uint8_t> random_blocks(DType t, int64_t blocks, std::mt19937& rng) {
  const int64_t bb = static_cast<int64_t>(dtype_block_bytes(t));
  std::vector<uint8_t> v(static_cast<size_t>(blocks * bb));
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(1e-4f, 2e-3f);
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t* b = v.data() + i * bb;
    auto put = [&](int at) {
      const __half h = __float2half(scale(rng));
      std::memcpy(b + at, &h, 2);
    };
    if (t == DType::kQ6_K) {
      put(208);
    } else {
      put(0), put(2);
    }
  }
  return v;
}

// Device copy bandwidth (read + write counted as bytes read: the figure the bound uses).
double copy_gbs(size_t bytes) {
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  cudaEventRecord(e0);
  for (int i = 0; i < 10; ++i) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaFree(a), cudaFree(b);
  return 2.0 * bytes * 10 / (ms * 1e-3) / 1e9;
}

constexpr Case kCases[] = {
      {"8b.qk.q4_k", DType::kQ4_K, 5120, 4096, false},     {"8b.v.q6_k", DType::kQ6_K, 1024, 4096, false},
      {"8b.o.q4_k", DType::kQ4_K, 4096, 4096, false},      {"8b.gate_up.q4_k", DType::kQ4_K, 14336, 4096, true},
      {"8b.down.q4_k", DType::kQ4_K, 4096, 14336, false},  {"8b.down.q6_k", DType::kQ6_K, 4096, 14336, false},
      {"8b.output.q6_k", DType::kQ6_K, 128256, 4096, false}, {"1b.gate_up.q4_k", DType::kQ4_K, 8192, 2048, true},
      {"1b.qk.q4_k", DType::kQ4_K, 2560, 2048, false},     {"1b.o.q4_k", DType::kQ4_K, 2048, 2048, false},
      {"1b.v.q6_k", DType::kQ6_K, 512, 2048, false},       {"1b.down.q4_k", DType::kQ4_K, 2048, 8192, false},
      {"1b.down.q6_k", DType::kQ6_K, 2048, 8192, false},    {"1b.output.q6_k", DType::kQ6_K, 128256, 2048, false},
};

// Microseconds a call of run(i) takes on st: 3 calls to warm, then the mean of reps.
template <typename F>
double time_us(cudaStream_t st, int reps, F&& run) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = 0; i < 3; ++i) (void)run(i);
  cudaEventRecord(e0, st);
  for (int i = 0; i < reps; ++i) (void)run(i);
  cudaEventRecord(e1, st);
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return ms * 1e3 / reps;
}

// quant_mma for n rows of x on each case's whole weight (pairs: both halves as one matrix).
int mma_main(int reps, int n, double copy, bool imma) {
  std::mt19937 rng(7);
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  const char* only = std::getenv("QGEMV_CASE");  // one case by name (a profiler's run)
  for (const Case& c : kCases) {
    if (only && std::string(only) != c.name) continue;
    const int64_t wrows = c.pairs ? 2 * c.rows : c.rows;
    const int64_t bytes = wrows * static_cast<int64_t>(nbytes_for(c.type, c.in));
    const int copies = static_cast<int>(std::max<int64_t>(1, (int64_t{400} << 20) / bytes + 1));
    const std::vector<uint8_t> host = random_blocks(c.type, bytes / static_cast<int64_t>(dtype_block_bytes(c.type)), rng);
    uint8_t* w;
    CHECK(cudaMalloc(&w, static_cast<size_t>(bytes) * copies));
    for (int i = 0; i < copies; ++i) CHECK(cudaMemcpy(w + i * bytes, host.data(), bytes, cudaMemcpyHostToDevice));
    std::vector<__nv_bfloat16> xh(static_cast<size_t>(n * c.in));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : xh) v = __float2bfloat16(nd(rng));
    __nv_bfloat16* x;
    float* y;
    CHECK(cudaMalloc(&x, xh.size() * 2));
    CHECK(cudaMalloc(&y, n * wrows * 4));
    CHECK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
    // x in f32 (the BF16 values) rounded to 8 bits, for quant_imma.
    std::vector<float> xf(xh.size());
    for (size_t i = 0; i < xh.size(); ++i) xf[i] = __bfloat162float(xh[i]);
    float* x32;
    void* xq;
    CHECK(cudaMalloc(&x32, xf.size() * 4));
    CHECK(cudaMalloc(&xq, activation_bytes(n, c.in)));
    CHECK(cudaMemcpy(x32, xf.data(), xf.size() * 4, cudaMemcpyHostToDevice));
    if (!quantize_activations(st, x32, n, c.in, nullptr, 0.0f, xq).ok()) return 1;
    GemvOut outs{};
    outs.y[0] = y, outs.end[0] = wrows, outs.count = 1;
    void* split;
    const size_t split_bytes = std::max(quant_mma_scratch_bytes(Tensor::wrap(w, Shape{wrows, c.in}, c.type), n),
                                        quant_imma_scratch_bytes(Tensor::wrap(w, Shape{wrows, c.in}, c.type), n));
    CHECK(cudaMalloc(&split, split_bytes));
    CHECK(cudaMemset(split, 0, split_bytes));
    auto run = [&](int i) {
      const Tensor t = Tensor::wrap(w + (i % copies) * bytes, Shape{wrows, c.in}, c.type);
      return quant_mma(st, t, x, n, outs, split);
    };
    if (!run(0).ok()) return 1;
    if (imma) {
      auto run8 = [&](int i) {
        const Tensor t = Tensor::wrap(w + (i % copies) * bytes, Shape{wrows, c.in}, c.type);
        return quant_imma(st, t, xq, n, outs, split);
      };
      std::vector<float> ya(static_cast<size_t>(n * wrows)), yb(ya.size());
      CHECK(cudaMemset(y, 0xFF, n * wrows * 4));
      if (!run(0).ok()) return 1;
      CHECK(cudaMemcpy(ya.data(), y, ya.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemset(y, 0xFF, n * wrows * 4));
      if (!run8(0).ok()) return 1;
      CHECK(cudaMemcpy(yb.data(), y, yb.size() * 4, cudaMemcpyDeviceToHost));
      double diff = 0, scale = 0;
      for (size_t i = 0; i < ya.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::fabs(ya[i] - yb[i])));  // (NaN: an unwritten output)
        if (!(std::fabs(ya[i] - yb[i]) <= 1e30f)) diff = INFINITY;
        scale = std::max(scale, static_cast<double>(std::fabs(ya[i])));
      }
      for (int round = 0; round < 3; ++round) {
        const double us8 = time_us(st, reps, run8), us = time_us(st, reps, run);
        std::printf("%s\timma n %d\t%.2f us\t%.0f GB/s\t%.2f\tmma %.2f us\timma / mma %.2f\tdiff %.2e of %.2e\n", c.name, n,
                    us8, bytes / (us8 * 1e-6) / 1e9, bytes / (us8 * 1e-6) / 1e9 / copy, us, us8 / us, diff, scale);
      }
      cudaFree(w), cudaFree(x), cudaFree(y), cudaFree(split), cudaFree(x32), cudaFree(xq);
      continue;
    }
    // The path it replaces (cuda_ops.cu's quant_gemm): rows dequantized to BF16 a 64 MB tile at a
    // time, one cuBLAS GEMM a tile.
    const int64_t tile_rows = std::min<int64_t>(wrows, (int64_t{64} << 20) / (c.in * 2));
    __nv_bfloat16* tile;
    CHECK(cudaMalloc(&tile, tile_rows * c.in * 2));
    cublasHandle_t handle;
    cublasCreate(&handle);
    cublasSetStream(handle, st);
    auto run_tiles = [&](int i) {
      const Tensor t = Tensor::wrap(w + (i % copies) * bytes, Shape{wrows, c.in}, c.type);
      const float one = 1.0f, zero = 0.0f;
      for (int64_t r0 = 0; r0 < wrows; r0 += tile_rows) {
        const int64_t m = std::min(tile_rows, wrows - r0);
        if (!dequantize_rows_bf16(st, t, r0, m, tile).ok()) return false;
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), n, static_cast<int>(c.in), &one, tile, CUDA_R_16BF,
                     static_cast<int>(c.in), x, CUDA_R_16BF, static_cast<int>(c.in), &zero, y + r0, CUDA_R_32F,
                     static_cast<int>(wrows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      }
      return true;
    };
    for (int round = 0; round < 3; ++round) {
      const double us = time_us(st, reps, run), gbs = bytes / (us * 1e-6) / 1e9;
      std::printf("%s\tmma n %d\t%.2f us\t%.0f GB/s\t%.2f\t%.0f TFLOPS\n", c.name, n, us, gbs, gbs / copy,
                  2.0 * n * wrows * c.in / (us * 1e-6) / 1e12);
      const double tus = time_us(st, reps, run_tiles), tgbs = bytes / (tus * 1e-6) / 1e9;
      std::printf("%s\ttiles n %d\t%.2f us\t%.0f GB/s\t%.2f\tmma / tiles %.2f\n", c.name, n, tus, tgbs, tgbs / copy, us / tus);
    }
    cublasDestroy(handle);
    cudaFree(w), cudaFree(x), cudaFree(y), cudaFree(split), cudaFree(tile), cudaFree(x32), cudaFree(xq);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const double copy = copy_gbs(size_t{1} << 30);
  std::printf("copy\t%.0f GB/s\n", copy);
  if (argc > 3 && std::string(argv[2]) == "mma") return mma_main(reps, std::atoi(argv[3]), copy, false);
  if (argc > 3 && std::string(argv[2]) == "imma") return mma_main(reps, std::atoi(argv[3]), copy, true);
  const auto& cases = kCases;
  std::mt19937 rng(7);
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  const char* only = std::getenv("QGEMV_ONLY");  // (a substring of the cases' names to run)
  for (const Case& c : cases) {
    if (only != nullptr && std::string(c.name).find(only) == std::string::npos) continue;
    const int64_t wrows = c.pairs ? 2 * c.rows : c.rows;
    const int64_t row_bytes = static_cast<int64_t>(nbytes_for(c.type, c.in));
    const int64_t bytes = wrows * row_bytes;
    const int copies = static_cast<int>(std::max<int64_t>(1, (int64_t{400} << 20) / bytes + 1));
    const std::vector<uint8_t> host = random_blocks(c.type, bytes / static_cast<int64_t>(dtype_block_bytes(c.type)), rng);
    uint8_t* w;
    CHECK(cudaMalloc(&w, static_cast<size_t>(bytes) * copies));
    for (int i = 0; i < copies; ++i) CHECK(cudaMemcpy(w + i * bytes, host.data(), bytes, cudaMemcpyHostToDevice));
    std::vector<float> xh(static_cast<size_t>(c.in));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : xh) v = nd(rng);
    float *x, *y;
    void* xq;
    CHECK(cudaMalloc(&x, c.in * 4));
    CHECK(cudaMalloc(&y, wrows * 4));
    CHECK(cudaMalloc(&xq, activation_bytes(1, c.in)));
    CHECK(cudaMemcpy(x, xh.data(), c.in * 4, cudaMemcpyHostToDevice));
    if (!quantize_activations(st, x, 1, c.in, nullptr, 0.0f, xq).ok()) return 1;
    const int8_t* q = static_cast<const int8_t*>(xq);
    const float* d = reinterpret_cast<const float*>(q + activation_scales_offset(1, c.in));
    GemvOut outs{};
    outs.y[0] = y, outs.end[0] = c.rows, outs.count = 1;
    // The variants: rows cut into 1, 2, 4 segments, and the kernel's own choice.
    struct Variant {
      const char* name;
      int split;
    };
    std::vector<Variant> variants = {{"split/1", 1}, {"split/2", 2}, {"split/4", 4}, {"auto", 0}};
    auto launch = [&](const Variant& v, const uint8_t* wp) {
      auto go = [&](auto k) { return decltype(k)::launch(st, wp, q, d, outs, 1, c.in, 3, c.rows, v.split); };
      if (c.type == DType::kQ4_K) return c.pairs ? go(GemvVariant<DType::kQ4_K, 1, true>{}) : go(GemvVariant<DType::kQ4_K, 1, false>{});
      return c.pairs ? go(GemvVariant<DType::kQ6_K, 1, true>{}) : go(GemvVariant<DType::kQ6_K, 1, false>{});
    };
    std::vector<float> ya(static_cast<size_t>(c.rows)), yb(static_cast<size_t>(c.rows));
    std::vector<double> diffs;
    double scale = 0;
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      CHECK(cudaMemset(y, 0xFF, wrows * 4));  // NaN: every row must be written
      if (!launch(variants[vi], w).ok()) return 1;
      CHECK(cudaMemcpy(vi == 0 ? ya.data() : yb.data(), y, c.rows * 4, cudaMemcpyDeviceToHost));
      double diff = 0;
      for (int64_t i = 0; vi > 0 && i < c.rows; ++i) diff = std::max(diff, static_cast<double>(std::fabs(ya[i] - yb[i])));
      for (int64_t i = 0; vi == 0 && i < c.rows; ++i) scale = std::max(scale, static_cast<double>(std::fabs(ya[i])));
      diffs.push_back(diff);
    }
    for (int round = 0; round < 3; ++round) {
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        const double us = time_us(st, reps, [&](int i) { return launch(variants[vi], w + (i % copies) * bytes); });
        const double gbs = bytes / (us * 1e-6) / 1e9;
        std::printf("%s\t%s\t%.2f us\t%.0f GB/s\t%.2f\tdiff %.2e of %.2e\n", c.name, variants[vi].name, us, gbs, gbs / copy,
                    diffs[vi], scale);
      }
    }
    cudaFree(w), cudaFree(x), cudaFree(y), cudaFree(xq);
  }
  auto regs = [](const char* name, const void* f) {
    cudaFuncAttributes a{};
    cudaFuncGetAttributes(&a, f);
    std::printf("regs\t%s\t%d\tlocal %zu\n", name, a.numRegs, a.localSizeBytes);
  };
  regs("q4_k", reinterpret_cast<const void*>(quant_gemv_kernel<DType::kQ4_K, 1, false, false>));
  regs("q4_k split", reinterpret_cast<const void*>(quant_gemv_kernel<DType::kQ4_K, 1, false, true>));
  regs("q4_k pairs", reinterpret_cast<const void*>(quant_gemv_kernel<DType::kQ4_K, 1, true, false>));
  regs("q6_k", reinterpret_cast<const void*>(quant_gemv_kernel<DType::kQ6_K, 1, false, false>));
  regs("q6_k split", reinterpret_cast<const void*>(quant_gemv_kernel<DType::kQ6_K, 1, false, true>));
  return 0;
}
