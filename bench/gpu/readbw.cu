// Read bandwidth of the H200 by access pattern and size: the ceiling a decode GEMV that reads each
// weight once can reach, for the matrix sizes of llama-8b's layer (QKV 50 MB, wo 34 MB, down 117 MB,
// gate/up 235 MB) and 1 GiB. Each launch reads fresh memory (offsets walk a 4 GiB buffer, so L2
// holds none of it); launches back to back on one stream, median of 5. Patterns: grid-stride 16-byte
// loads (ldg), the decode GEMV's (warps walking rows, 8-load batches two deep: rows strided /
// contig), the mma-fragment one (lane g, t reads rows g and g + 8, 64 bytes per row per load), and
// bulk copies into a shared ring (cp.async.bulk with mbarriers; BULK=1 for the 1-block-per-SM set).
// Not part of the build (a measurement of the machine, not of combs):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -o readbw bench/gpu/readbw.cu
// Figures: bench/RESULTS.md, "Read bandwidth by size".
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cstdlib>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ unsigned sink;

__device__ __forceinline__ unsigned mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// 1: grid-stride, UNROLL loads in flight per thread
template <int UNROLL>
__global__ void __launch_bounds__(256) read_ldg(const uint4* p, int64_t n) {
  unsigned acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= mix(v[u]);
  }
  for (; i < n; i += stride) acc ^= mix(__ldg(p + i));
  if (acc == 0x12345678) sink = acc;
}

// The decode GEMV's pipeline: nbat batches through two buffers, each reloaded (batch j + 2) once
// it has been used; the patterns below differ only in what load() reads.
template <typename Buf, typename Load, typename Use>
__device__ __forceinline__ void two_deep(int64_t nbat, Buf& b0, Buf& b1, Load load, Use use) {
  if (nbat > 0) load(b0, 0);
  if (nbat > 1) load(b1, 1);
  for (int64_t j = 0; j < nbat; j += 2) {
    use(b0); if (j + 2 < nbat) load(b0, j + 2);
    if (j + 1 < nbat) { use(b1); if (j + 3 < nbat) load(b1, j + 3); }
  }
}

// 2: GEMV-like: warps walk rows (row_bytes) strided (CONTIG false) or contiguous ranges, 8 loads per
// batch, two batches in flight
template <bool CONTIG>
__global__ void __launch_bounds__(256, 2) read_rows(const uint4* p, int64_t rows, int64_t row16) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * 8, w = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
  const int nb = (int)((row16 + 255) / 256);
  int64_t r0, rstep, nrows;
  if (CONTIG) { const int64_t per = (rows + warps - 1) / warps; r0 = w * per; rstep = 1; nrows = std::max<int64_t>(0, std::min(per, rows - r0)); }
  else { r0 = w; rstep = warps; nrows = w < rows ? (rows - w + warps - 1) / warps : 0; }
  const int64_t nbat = nrows * nb;
  unsigned acc = 0;
  uint4 b0[8], b1[8];
  auto load = [&](uint4 (&b)[8], int64_t j) {
    const uint4* r = p + (r0 + (j / nb) * rstep) * row16;
    const int64_t base = (j % nb) * 256 + lane;
#pragma unroll
    for (int u = 0; u < 8; ++u) { const int64_t i = base + u * 32; b[u] = i < row16 ? __ldg(r + i) : make_uint4(0,0,0,0); }
  };
  auto use = [&](uint4 (&b)[8]) {
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= mix(b[u]);
  };
  two_deep(nbat, b0, b1, load, use);
  if (acc == 0x12345678) sink = acc;
}

// 3: mma-fragment pattern: block = 8 warps on a unit of 16 rows, warp w on k-slice w of 8; lane (g = lane/4,
// t = lane%4) loads rows g and g+8, 16 bytes at k-step*64B + 16t; KSTEPS k-steps per batch (2 loads each), 2 batches
template <int KSTEPS>
__global__ void __launch_bounds__(256, 2) read_mma(const uint4* p, int64_t rows, int64_t row16) {
  const int lane = threadIdx.x % 32, wi = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t units = rows / 16;
  const int64_t steps = row16 / 4;  // 64-byte k-steps per row
  const int64_t s0 = steps * wi / 8, s1 = steps * (wi + 1) / 8, ns = s1 - s0;
  const int64_t my_units = blockIdx.x < units ? (units - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int64_t nbpu = (ns + KSTEPS - 1) / KSTEPS;  // batches per unit
  const int64_t nbat = my_units * nbpu;
  unsigned acc = 0;
  uint4 b0[2 * KSTEPS], b1[2 * KSTEPS];
  auto load = [&](uint4 (&b)[2 * KSTEPS], int64_t j) {
    const int64_t unit = blockIdx.x + (j / nbpu) * gridDim.x;
    const uint4* r = p + (unit * 16 + g) * row16;
    const int64_t st = s0 + (j % nbpu) * KSTEPS;
#pragma unroll
    for (int u = 0; u < KSTEPS; ++u) {
      const bool ok = st + u < s1;
      b[2 * u] = ok ? __ldg(r + (st + u) * 4 + t) : make_uint4(0,0,0,0);
      b[2 * u + 1] = ok ? __ldg(r + 8 * row16 + (st + u) * 4 + t) : make_uint4(0,0,0,0);
    }
  };
  auto use = [&](uint4 (&b)[2 * KSTEPS]) {
#pragma unroll
    for (int u = 0; u < 2 * KSTEPS; ++u) acc ^= mix(b[u]);
  };
  two_deep(nbat, b0, b1, load, use);
  if (acc == 0x12345678) sink = acc;
}

// 4: bulk copies (TMA 1D) into a shared ring of S stages of C bytes; a block streams one contiguous range
__device__ __forceinline__ uint32_t sa(const void* q) { return (uint32_t)__cvta_generic_to_shared(q); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(c)); }
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(tx) : "memory"); }
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" :: "r"(sa(b)), "r"(parity) : "memory");
}

__global__ void __launch_bounds__(256) read_bulk(const unsigned char* p, int64_t bytes, int S, int C) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[16];
  const int64_t per = ((bytes / gridDim.x) + 15) / 16 * 16;
  const int64_t b0 = (int64_t)blockIdx.x * per, b1 = std::min<int64_t>(bytes, b0 + per);
  const int64_t nch = b1 > b0 ? (b1 - b0 + C - 1) / C : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int64_t c) {
    const int s = (int)(c % S);
    const int64_t off = b0 + c * C;
    const uint32_t n = (uint32_t)std::min<int64_t>(C, b1 - off);
    mbar_expect(&full[s], n);
    bulk_g2s(ring + (size_t)s * C, p + off, n, &full[s]);
  };
  if (threadIdx.x == 0) for (int64_t c = 0; c < std::min<int64_t>(S, nch); ++c) issue(c);
  unsigned acc = 0;
  for (int64_t c = 0; c < nch; ++c) {
    const int s = (int)(c % S);
    mbar_wait(&full[s], (uint32_t)((c / S) & 1));
    const int64_t off = b0 + c * C;
    const int n16 = (int)(std::min<int64_t>(C, b1 - off) / 16);
    const uint4* st = reinterpret_cast<const uint4*>(ring + (size_t)s * C);
    for (int i = threadIdx.x; i < n16; i += 256) acc ^= mix(st[i]);
    __syncthreads();
    if (threadIdx.x == 0 && c + S < nch) issue(c + S);
  }
  if (acc == 0x12345678) sink = acc;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t total = 4ull << 30;
  unsigned char* buf; CK(cudaMalloc(&buf, total)); CK(cudaMemset(buf, 1, total));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  CK(cudaFuncSetAttribute(read_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
  const double sizes[] = {33.6e6, 50.3e6, 117.5e6, 235e6, 1073.7e6};
  auto run = [&](const char* name, auto launch) {
    printf("%-28s", name);
    for (double sz : sizes) {
      const size_t bytes = (size_t)sz / 4096 * 4096;
      const int per = (int)std::min<size_t>(64, total / bytes);
      std::vector<float> ts;
      for (int rep = 0; rep < 5; ++rep) {
        cudaEventRecord(e0);
        for (int k = 0; k < per; ++k) launch(buf + (size_t)k * bytes, bytes);
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms / per);
      }
      std::sort(ts.begin(), ts.end());
      printf(" %5.0fMB %6.1fus %5.2fTB/s |", bytes / 1e6, ts[2] * 1e3, bytes / (ts[2] * 1e-3) / 1e12);
    }
    printf("\n");
    CK(cudaGetLastError());
  };
  for (int mult : {2, 4, 8}) {
    char nm[64]; snprintf(nm, 64, "ldg u8 grid %dxSM", mult);
    run(nm, [&](unsigned char* p, size_t b) { read_ldg<8><<<sms * mult, 256>>>((const uint4*)p, b / 16); });
  }
  run("ldg u4 grid 4xSM", [&](unsigned char* p, size_t b) { read_ldg<4><<<sms * 4, 256>>>((const uint4*)p, b / 16); });
  run("ldg u16 grid 2xSM", [&](unsigned char* p, size_t b) { read_ldg<16><<<sms * 2, 256>>>((const uint4*)p, b / 16); });
  for (int rb : {8192, 28672}) {
    char nm[64]; snprintf(nm, 64, "rows %d strided", rb);
    run(nm, [&](unsigned char* p, size_t b) { read_rows<false><<<sms * 2, 256>>>((const uint4*)p, b / rb, rb / 16); });
    snprintf(nm, 64, "rows %d contig", rb);
    run(nm, [&](unsigned char* p, size_t b) { read_rows<true><<<sms * 2, 256>>>((const uint4*)p, b / rb, rb / 16); });
  }
  for (int rb : {8192, 28672}) {
    char nm[64]; snprintf(nm, 64, "mma k4 rows %d", rb);
    run(nm, [&](unsigned char* p, size_t b) { read_mma<4><<<sms * 2, 256>>>((const uint4*)p, b / rb, rb / 16); });
    snprintf(nm, 64, "mma k2 rows %d", rb);
    run(nm, [&](unsigned char* p, size_t b) { read_mma<2><<<sms * 2, 256>>>((const uint4*)p, b / rb, rb / 16); });
  }
  if (getenv("BULK")) for (int S : {4, 6, 8}) for (int C : {16384, 24576, 32768}) {
    if ((size_t)S * C > 216 * 1024) continue;
    char nm[64]; snprintf(nm, 64, "bulk S%d C%dK 1/SM", S, C / 1024);
    run(nm, [&](unsigned char* p, size_t b) { read_bulk<<<sms, 256, (size_t)S * C>>>(p, b, S, C); });
  }
  for (int S : {3, 4}) {
    const int C = 12288;
    char nm[64]; snprintf(nm, 64, "bulk S%d C%dK 2/SM", S, C / 1024);
    run(nm, [&](unsigned char* p, size_t b) { read_bulk<<<sms * 2, 256, (size_t)S * C>>>(p, b, S, C); });
  }
  // copy for reference (read + write)
  printf("%-28s", "memcpy d2d (r+w)");
  for (double sz : sizes) {
    const size_t bytes = (size_t)sz / 4096 * 4096;
    std::vector<float> ts;
    for (int rep = 0; rep < 5; ++rep) {
      cudaEventRecord(e0);
      const int per = (int)std::min<size_t>(8, total / (2 * bytes));
      for (int k = 0; k < per; ++k) cudaMemcpyAsync(buf + (2 * k + 1) * bytes, buf + 2 * k * bytes, bytes, cudaMemcpyDeviceToDevice);
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms / per);
    }
    std::sort(ts.begin(), ts.end());
    printf(" %5.0fMB %6.1fus %5.2fTB/s |", bytes / 1e6, ts[2] * 1e3, 2 * bytes / (ts[2] * 1e-3) / 1e12);
  }
  printf("\n");
}
