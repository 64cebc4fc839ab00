// What the decode-sized matmuls (the BF16/F16 kernels in cuda_ops.cu and the block-quantized ones
// in quant_matmul.cu) share: their outputs (GemvOut), their weights' loads, the tile epilogue and
// grid of the tensor-core ones (finish_mma_tile, equal_tiles_grid), and the switch between a type's
// one-row and tensor-core kernels (rows_from_env). Private to the CUDA backend.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "float_convert.h"

namespace combs::cuda {

// The weights' loads: read-only, and not kept in L1 (each is read once per step; measured on the
// H200 against __ldg: llama-8b decode 232 vs 227-228 tok/s, llama-1b 1,145 vs 1,113-1,118).
__device__ __forceinline__ uint4 load_weights16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_weights8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// Up to three outputs of one small-batch matmul: rows [0, end[0]) go to y[0], [end[0], end[1])
// to y[1], ... (a fused Q/K/V or gate/up projection). Gate/up pairs (PAIRS): one output of end[0]
// rows, act(gate) * up at y[0] (in the dtype the down projection takes): silu, or GELU's tanh
// approximation where gelu_tanh is set (gemma's).
struct GemvOut {
  float* y[3];
  const float* bias[3];
  int64_t end[3];
  int count;
  bool accumulate;       // y += result (the residual stream) instead of y = result
  const float* norm_w;   // when set: x is RMS-normalized with these weights as it is staged
  float eps;
  bool gelu_tanh = false;  // PAIRS: the gate's activation is GELU (tanh), not silu
};

// Where weight row `row`'s result goes: its output's y and bias, that output's rows and the row's
// index in it. Selects, not an index (a runtime index into outs would copy it to local memory).
struct GemvRow {
  float* y;
  const float* bias;
  int64_t rows, index;
};
// The rows of all outputs (outs.end's last), by selects.
__device__ __forceinline__ int64_t gemv_rows(const GemvOut& outs) {
  return outs.count == 1 ? outs.end[0] : outs.count == 2 ? outs.end[1] : outs.end[2];
}
__device__ __forceinline__ GemvRow gemv_row(const GemvOut& outs, int64_t row) {
  const int seg = row < outs.end[0] ? 0 : row < outs.end[1] ? 1 : 2;
  const int64_t begin = seg == 0 ? 0 : seg == 1 ? outs.end[0] : outs.end[1];
  return {seg == 0 ? outs.y[0] : seg == 1 ? outs.y[1] : outs.y[2],
          seg == 0 ? outs.bias[0] : seg == 1 ? outs.bias[1] : outs.bias[2],
          (seg == 0 ? outs.end[0] : seg == 1 ? outs.end[1] : outs.end[2]) - begin, row - begin};
}

__device__ inline float silu(float g) { return g / (1.0f + expf(-g)); }
// GELU's tanh approximation (cpu::gelu_tanh_mul's and cuda::gelu_tanh_mul's formula).
__device__ inline float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}
// The gate/up pair's product, act(gate) * up.
__device__ inline float gated(const GemvOut& outs, float gate, float up) {
  return outs.gelu_tanh ? gelu_tanh(gate) * up : silu(gate) * up;
}

// The end of a tile of the tensor-core decode kernels (gemv_mma_kernel, q4k_mma_gemv_kernel): 16
// weight rows from row0 and up to 8 rows of x, each of kWarps warps holding its share of the sums as
// mma C fragments acc[part][0..3] (lane g = lane / 4, t = lane % 4: c[0..1] row g, x rows 2t, 2t + 1;
// c[2..3] row g + 8). The warps' sums are added in warp order through sums[parity] (one barrier a
// tile; the parity alternates, so a tile's sums are not overwritten while the one before is read)
// and acc is cleared. Outputs: outs' rows, or (kParts 2: gate rows and their up rows) gated(gate,
// up) into y[0] [n, units] as OutT.
template <int kWarps, int kParts, typename OutT>
__device__ __forceinline__ void finish_mma_tile(float (&sums)[2][kWarps][4 * kParts][32], float (&acc)[kParts][4],
                                                int& parity, int64_t row0, const GemvOut& outs, int n, int64_t units) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sums[parity][warp][p * 4 + i][lane] = acc[p][i], acc[p][i] = 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 4 * 32) {
    const int i = threadIdx.x / 32, l = threadIdx.x % 32;
    const int64_t row = row0 + l / 4 + 8 * (i / 2);
    const int r = 2 * (l % 4) + i % 2;  // the row of x
    float s[kParts];
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      s[p] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s[p] += sums[parity][w][p * 4 + i][l];
    }
    if (r < n && row < units) {
      if constexpr (kParts == 2) {
        reinterpret_cast<OutT*>(outs.y[0])[r * units + row] = from_f32<OutT>(gated(outs, s[0], s[1]));
      } else {
        const GemvRow to = gemv_row(outs, row);
        float* dst = to.y + r * to.rows + to.index;
        *dst = (outs.accumulate ? *dst : 0.0f) + s[0] + (to.bias ? to.bias[to.index] : 0.0f);
      }
    }
  }
  parity ^= 1;
}

// The tiles of a tensor-core decode kernel's block (blockIdx.x): tiles_per_block consecutive ones
// of `tile` weight rows from *tile0, fewer for the last block; how many.
__device__ __forceinline__ int64_t block_tiles(int64_t units, int tile, int64_t tiles_per_block, int64_t* tile0) {
  const int64_t tiles = (units + tile - 1) / tile;
  *tile0 = static_cast<int64_t>(blockIdx.x) * tiles_per_block;
  const int64_t left = tiles - *tile0;
  return left < 0 ? 0 : left < tiles_per_block ? left : tiles_per_block;
}

// The main loop of the tensor-core decode kernels: steps 0 .. n - 1, each one's weights loaded two
// steps ahead into one of two slices (load(slice, j)) and consumed in order (consume(slice, j));
// ready() runs once the first two loads are issued (the programmatic-dependent-launch wait, x's
// staging): the weights do not depend on the kernels before.
template <typename Slice, typename Load, typename Ready, typename Consume>
__device__ __forceinline__ void double_buffered(int64_t n, Load&& load, Ready&& ready, Consume&& consume) {
  Slice s0, s1;
  if (n > 0) load(s0, 0);
  if (n > 1) load(s1, 1);
  ready();
  for (int64_t j = 0; j < n; j += 2) {
    consume(s0, j);
    if (j + 2 < n) load(s0, j + 2);
    if (j + 1 < n) {
      consume(s1, j + 1);
      if (j + 3 < n) load(s1, j + 3);
    }
  }
}

// The grid of a tensor-core decode kernel over `tiles` tiles, `resident` blocks at once: every
// block the same number of consecutive tiles (*per_block; the last block's share may be short), as
// few as keep every resident block busy.
// COMBS_MMA_TILES_PER_BLOCK (1-64) sets the tiles a block instead, for measuring the grid's effect.
inline unsigned equal_tiles_grid(int64_t tiles, int64_t resident, int64_t* per_block) {
  static const int64_t forced = [] {
    const char* v = std::getenv("COMBS_MMA_TILES_PER_BLOCK");
    const long n = v ? std::strtol(v, nullptr, 10) : 0;
    return n >= 1 && n <= 64 ? static_cast<int64_t>(n) : int64_t{0};
  }();
  *per_block = forced > 0 ? forced : std::max<int64_t>(1, (tiles + resident - 1) / resident);
  return static_cast<unsigned>(std::max<int64_t>(1, (tiles + *per_block - 1) / *per_block));
}

// A row count from the environment variable `name` (1 to 9), else fallback: the fewest rows of x
// that take a type's tensor-core decode kernel (9: never).
inline int rows_from_env(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long rows = std::strtol(v, &end, 10);
  return *end == '\0' && rows >= 1 && rows <= 9 ? static_cast<int>(rows) : fallback;
}

}  // namespace combs::cuda
