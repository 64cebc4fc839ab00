// Block-quantized weights on the GPU (see quant_matmul.h). Every format is read 32 weights (a
// "unit") at a time: decode<T> widens one unit of a block into 32 integer levels (int8, four to an
// int) with one scale and one offset per 16, value = d * q - m, d and m formed as quant.cc forms
// them (so dequantize_rows_* equal the CPU's values bit for bit: no FMA contraction, __fmul_rn).
// The block layouts are described beside each dequantizer in src/backend/quant.cc.
#include "quant_matmul.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <type_traits>

#include "combs/backend/dtype.h"
#include "cuda_check.h"
#include "float_convert.h"
#include "kernel_smem.h"
#include "async_copy.h"
#include "mma.h"
#include "pdl.h"

namespace combs::cuda {
namespace {

struct Unit {
  uint32_t q[8];     // levels of elements 4k .. 4k + 3 in q[k] (int8 each)
  float d[2], m[2];  // element e: d[e / 16] * q - m[e / 16]
};

// Loads of a block's fields, from global or shared memory (the decode kernel stages rows in
// shared memory); p's alignment is named (a block's fields are 1, 2, 4 or 16 byte aligned by the
// format's block size, and a staged row keeps its alignment modulo 16).
__device__ __forceinline__ uint32_t u8_at(const uint8_t* p) { return *p; }
__device__ __forceinline__ float f16_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ uint32_t u32_a1(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
__device__ __forceinline__ uint32_t u32_a2(const uint8_t* p) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  return uint32_t{h[0]} | uint32_t{h[1]} << 16;
}
__device__ __forceinline__ uint32_t u32_a4(const uint8_t* p) { return *reinterpret_cast<const unsigned int*>(p); }
// Eight consecutive uint32 at a 16-byte aligned p.
__device__ __forceinline__ void u32x8_a16(const uint8_t* p, uint32_t v[8]) {
  const uint4 a = *reinterpret_cast<const uint4*>(p), b = *(reinterpret_cast<const uint4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Bits 0..3 of b to bit 4 of bytes 0..3 (the fifth bits of Q5_0/Q5_1).
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
  return (b & 1) << 4 | (b & 2) << 11 | (b & 4) << 18 | (b & 8) << 25;
}

// A 16-entry int8 table as four little-endian words.
struct Levels {
  uint32_t t[4];
};
constexpr Levels pack_levels(const int8_t (&v)[16]) {
  Levels l{};
  for (int i = 0; i < 16; ++i) l.t[i / 4] |= uint32_t{static_cast<uint8_t>(v[i])} << (8 * (i % 4));
  return l;
}
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr Levels kIQ4 = pack_levels(kIQ4Values), kFP4 = pack_levels(kFP4Values);

// Four indices (bytes of v, each < 16) to their levels (IQ4's, or FP4's): two byte permutes
// (entries 0-7, 8-15), picked per byte by the index's bit 3.
template <bool kFP4Table>
__device__ __forceinline__ uint32_t lookup4(uint32_t v) {
  constexpr Levels l = kFP4Table ? kFP4 : kIQ4;
  constexpr uint32_t t0 = l.t[0], t1 = l.t[1], t2 = l.t[2], t3 = l.t[3];
  const uint32_t sel = (v & 0xF) | ((v >> 4) & 0xF0) | ((v >> 8) & 0xF00) | ((v >> 12) & 0xF000);
  const uint32_t lo = __byte_perm(t0, t1, sel & 0x7777), hi = __byte_perm(t2, t3, sel & 0x7777);
  const uint32_t high = ((v & 0x08080808) >> 3) * 0xFF;
  return (hi & high) | (lo & ~high);
}

constexpr uint32_t kLow4 = 0x0F0F0F0F;

// Unit u (0 .. block elements / 32) of the block at b.
template <DType T>
__device__ __forceinline__ Unit decode(const uint8_t* b, int u) {
  Unit U;
  U.m[0] = U.m[1] = 0.0f;
  if constexpr (T == DType::kQ4_0 || T == DType::kIQ4_NL) {  // f16 d, 16 bytes of nibbles
    U.d[0] = U.d[1] = f16_at(b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = u32_a2(b + 2 + 4 * k);
      if constexpr (T == DType::kQ4_0) {
        U.q[k] = __vsub4(v & kLow4, 0x08080808), U.q[k + 4] = __vsub4((v >> 4) & kLow4, 0x08080808);
      } else {
        U.q[k] = lookup4<false>(v & kLow4), U.q[k + 4] = lookup4<false>((v >> 4) & kLow4);
      }
    }
  } else if constexpr (T == DType::kQ4_1) {  // f16 d, f16 m, nibbles; value q d + m
    U.d[0] = U.d[1] = f16_at(b);
    U.m[0] = U.m[1] = -f16_at(b + 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = u32_a4(b + 4 + 4 * k);
      U.q[k] = v & kLow4, U.q[k + 4] = (v >> 4) & kLow4;
    }
  } else if constexpr (T == DType::kQ5_0 || T == DType::kQ5_1) {  // d (, m), fifth bits, nibbles
    constexpr int kHeader = T == DType::kQ5_1 ? 4 : 2;
    U.d[0] = U.d[1] = f16_at(b);
    if constexpr (T == DType::kQ5_1) U.m[0] = U.m[1] = -f16_at(b + 2);
    const uint32_t qh = T == DType::kQ5_1 ? u32_a4(b + kHeader) : u32_a2(b + kHeader);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = T == DType::kQ5_1 ? u32_a4(b + kHeader + 4 + 4 * k) : u32_a2(b + kHeader + 4 + 4 * k);
      const uint32_t lo = (v & kLow4) | spread4(qh >> (4 * k)), hi = ((v >> 4) & kLow4) | spread4(qh >> (16 + 4 * k));
      if constexpr (T == DType::kQ5_0) {
        U.q[k] = __vsub4(lo, 0x10101010), U.q[k + 4] = __vsub4(hi, 0x10101010);
      } else {
        U.q[k] = lo, U.q[k + 4] = hi;
      }
    }
  } else if constexpr (T == DType::kQ8_0) {  // f16 d, 32 int8
    U.d[0] = U.d[1] = f16_at(b);
#pragma unroll
    for (int k = 0; k < 8; ++k) U.q[k] = u32_a2(b + 2 + 4 * k);
  } else if constexpr (T == DType::kMXFP4) {  // E8M0 exponent, nibbles of FP4 levels
    const uint32_t e = u8_at(b);
    U.d[0] = U.d[1] = __uint_as_float(e < 2 ? uint32_t{0x00200000} << e : (e - 1) << 23);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = u32_a1(b + 1 + 4 * k);
      U.q[k] = lookup4<true>(v & kLow4), U.q[k + 4] = lookup4<true>((v >> 4) & kLow4);
    }
  } else if constexpr (T == DType::kQ2_K) {  // 16 scale|min bytes, 64 bytes of 2-bit quants, d, dmin
    const int half = u >> 2, shift = 2 * (u & 3);
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sc = u8_at(b + 2 * u + h);
      U.d[h] = __fmul_rn(d, static_cast<float>(sc & 0xF));
      U.m[h] = __fmul_rn(dmin, static_cast<float>(sc >> 4));
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) U.q[k] = (u32_a4(b + 16 + 32 * half + 4 * k) >> shift) & 0x03030303;
  } else if constexpr (T == DType::kQ3_K) {  // hmask 32, quants 64, scales 12, d
    const int half = u >> 2, shift = 2 * (u & 3);
    const uint8_t* p = b + 96;
    const float d = f16_at(b + 108);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = 2 * u + h;
      const int low = s < 8 ? u8_at(p + s) & 0xF : u8_at(p + s - 8) >> 4;
      const int top = (u8_at(p + 8 + s % 4) >> (2 * (s / 4))) & 3;
      U.d[h] = __fmul_rn(d, static_cast<float>((low | top << 4) - 32));
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t q = (u32_a2(b + 32 + 32 * half + 4 * k) >> shift) & 0x03030303;
      const uint32_t clear = ~(u32_a2(b + 4 * k) >> u) & 0x01010101;  // hmask bit u clear: minus 4
      U.q[k] = __vsub4(q, clear << 2);
    }
  } else if constexpr (T == DType::kQ4_K || T == DType::kQ5_K) {  // d, dmin, 12 scale bytes, (qh,) nibbles
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* sp = b + 4;
    int sc, mn;
    if (u < 4) {
      sc = u8_at(sp + u) & 63, mn = u8_at(sp + u + 4) & 63;
    } else {
      sc = (u8_at(sp + u + 4) & 0xF) | (u8_at(sp + u - 4) >> 6) << 4;
      mn = (u8_at(sp + u + 4) >> 4) | (u8_at(sp + u) >> 6) << 4;
    }
    U.d[0] = U.d[1] = __fmul_rn(d, static_cast<float>(sc));
    U.m[0] = U.m[1] = __fmul_rn(dmin, static_cast<float>(mn));
    constexpr int kQs = T == DType::kQ5_K ? 48 : 16;
    uint32_t v[8];
    u32x8_a16(b + kQs + 32 * (u >> 1), v);
    const int shift = 4 * (u & 1);
    if constexpr (T == DType::kQ5_K) {
      uint32_t qh[8];
      u32x8_a16(b + 16, qh);
#pragma unroll
      for (int k = 0; k < 8; ++k) U.q[k] = ((v[k] >> shift) & kLow4) | ((qh[k] >> u) & 0x01010101) << 4;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) U.q[k] = (v[k] >> shift) & kLow4;
    }
  } else if constexpr (T == DType::kQ6_K) {  // ql 128, qh 64, int8 scales 16, d
    const int half = u >> 2, s = u & 3;
    const float d = f16_at(b + 208);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      U.d[h] = __fmul_rn(d, static_cast<float>(static_cast<int8_t>(u8_at(b + 192 + 8 * half + 2 * s + h))));
    }
    const uint8_t* ql = b + 64 * half + 32 * (s & 1);
    const uint8_t* qh = b + 128 + 32 * half;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t lo = (u32_a2(ql + 4 * k) >> (4 * (s >> 1))) & kLow4;
      const uint32_t hi = (u32_a2(qh + 4 * k) >> (2 * s)) & 0x03030303;
      U.q[k] = __vsub4(lo | hi << 4, 0x20202020);
    }
  } else if constexpr (T == DType::kIQ4_XS) {  // d, scales_h u16, scales_l 4, nibbles 128
    const float d = f16_at(b);
    const uint32_t sh = *reinterpret_cast<const unsigned short*>(b + 2);
    const int ls = ((u8_at(b + 4 + u / 2) >> (4 * (u & 1))) & 0xF) | ((sh >> (2 * u)) & 3) << 4;
    U.d[0] = U.d[1] = __fmul_rn(d, static_cast<float>(ls - 32));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = u32_a4(b + 8 + 16 * u + 4 * k);
      U.q[k] = lookup4<false>(v & kLow4), U.q[k + 4] = lookup4<false>((v >> 4) & kLow4);
    }
  }
  return U;
}

// The formats whose values carry an offset (m != 0): their dot products need the sums of x.
template <DType T>
constexpr bool kHasOffset = T == DType::kQ4_1 || T == DType::kQ5_1 || T == DType::kQ2_K || T == DType::kQ4_K || T == DType::kQ5_K;

// sum over the unit of (d q - m) * xq, for xq the unit's 32 int8 activations (xv).
template <DType T>
__device__ __forceinline__ float unit_dot(const Unit& U, const int (&xv)[8]) {
  int s0 = 0, s1 = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    s0 = __dp4a(static_cast<int>(U.q[k]), xv[k], s0);
    s1 = __dp4a(static_cast<int>(U.q[k + 4]), xv[k + 4], s1);
  }
  float r = U.d[0] * static_cast<float>(s0) + U.d[1] * static_cast<float>(s1);
  if constexpr (kHasOffset<T>) {
    int a0 = 0, a1 = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) a0 = __dp4a(xv[k], 0x01010101, a0), a1 = __dp4a(xv[k + 4], 0x01010101, a1);
    r -= U.m[0] * static_cast<float>(a0) + U.m[1] * static_cast<float>(a1);
  }
  return r;
}

// Q4_K's unit u (0..7) of the block at b as the unit loop takes it (a lane keeps one u in every
// block it visits: units 32 apart): its 32 levels' bytes masked in place — the high nibbles of an
// odd unit stay high, so its integer dot is 16 times the levels' and is shifted back once — and its
// scale d * sc and offset dmin * m, from the block's 16-byte head read as words, without a branch on
// u (a branch on a lane's u runs both sides in every warp).
struct Q4kUnit {
  uint32_t q[8];
  float d, m;
  int shift;  // 4 for an odd unit's high nibbles, else 0
};
__device__ __forceinline__ Q4kUnit q4k_unit(const uint8_t* b, int u) {
  Q4kUnit U;
  const uint4 h = *reinterpret_cast<const uint4*>(b);  // f16 d, f16 dmin, scale bytes 0..11
  const int sh = 8 * (u & 3);
  const uint32_t b0 = h.y >> sh, b1 = h.z >> sh, b2 = h.w >> sh;  // scale bytes u & 3, 4 + (u & 3), 8 + (u & 3)
  const bool high = u >= 4;
  const uint32_t sc = high ? (b2 & 0xF) | (b0 >> 2 & 0x30) : b0 & 63;
  const uint32_t mn = high ? (b2 >> 4 & 0xF) | (b1 >> 2 & 0x30) : b1 & 63;
  const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
  U.d = __fmul_rn(dm.x, static_cast<float>(sc));
  U.m = __fmul_rn(dm.y, static_cast<float>(mn));
  uint32_t v[8];
  u32x8_a16(b + 16 + 32 * (u >> 1), v);
  const uint32_t mask = (u & 1) ? 0xF0F0F0F0u : kLow4;
#pragma unroll
  for (int k = 0; k < 8; ++k) U.q[k] = v[k] & mask;
  U.shift = 4 * (u & 1);
  return U;
}

// sum over the unit of (d q - m) * xq for Q4_K, with the unit's sum of x's levels (xsum) as
// quantize_activations left it: one integer dot (unsigned levels, signed x), two float steps.
__device__ __forceinline__ float q4k_unit_dot(const Q4kUnit& U, const int (&xv)[8], int xsum) {
  int s = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(s) : "r"(U.q[k]), "r"(xv[k]));
  return U.d * static_cast<float>(s >> U.shift) - U.m * static_cast<float>(xsum);
}

// Unit u's sum of x's levels from quantize_activations' unit sums, in the group of 256 (8 units)
// at index group of xs (x's row times its groups, plus the group within the row).
__device__ __forceinline__ int unit_xsum(const int8_t* __restrict__ xs, int64_t group, int u) {
  return static_cast<int>(__ldg(xs + group * 16 + u)) + 128 * static_cast<int>(__ldg(xs + group * 16 + 8 + u));
}

// Unit gu (32 elements) of row xr of quantize_activations' x: its int8 levels, four to an int,
// and its group's scale (gshift: log2 of the units a group).
struct UnitX {
  int q[8];
  float d;
};
__device__ __forceinline__ UnitX unit_x(const int8_t* __restrict__ xq, const float* __restrict__ xd, int64_t xr,
                                        int64_t in, int64_t groups, int64_t gu, int gshift) {
  const int4* p = reinterpret_cast<const int4*>(xq + xr * in + gu * 32);
  const int4 a = __ldg(p), b = __ldg(p + 1);
  return {{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, __ldg(xd + xr * groups + (gu >> gshift))};
}

// Element e of a unit, as quant.cc computes it.
__device__ __forceinline__ float unit_value(const Unit& U, int e) {
  const int q = static_cast<int8_t>(U.q[e / 4] >> (8 * (e % 4)));
  return __fsub_rn(__fmul_rn(U.d[e / 16], static_cast<float>(q)), U.m[e / 16]);
}

template <DType T>
constexpr int kUnits = static_cast<int>(dtype_block_elems(T) / 32);  // units per block
template <DType T>
constexpr int kBlockBytes = static_cast<int>(dtype_block_bytes(T));

template <DType T>
__device__ __forceinline__ const uint8_t* unit_block(const uint8_t* row, int64_t gu) {
  return row + (gu / kUnits<T>) * kBlockBytes<T>;
}

// x rows to 8 bits (quant_matmul.h): one block of 1024 threads per row (a decode step's x is
// one row: the kernel's time is its latency, so the whole row is in flight at once); each warp
// takes 256 elements at a time,
// eight per lane; a group's max over 4 lanes (32) or the warp (256). The rounding is the CPU's
// (quantize_act in quant_dot_avx512vnni.cc): d = max / 127, q = nearest(x * (127 / max)).
// up (then norm_w is null): x is the gate, and silu(x) * up is rounded (silu_mul_kernel's floats).
__global__ void quantize_act_kernel(const float* __restrict__ x, int64_t in, const float* __restrict__ norm_w, float eps,
                                    int8_t* __restrict__ xq, float* __restrict__ xd, int group, int8_t* __restrict__ xs,
                                    const float* __restrict__ up) {
  const float* xr = x + blockIdx.x * in;
  int8_t* qr = xq + blockIdx.x * in;
  float* dr = xd + blockIdx.x * (in / group);
  int8_t* sr = xs ? xs + blockIdx.x * (in / 256) * 16 : nullptr;  // (groups of 256: the unit sums)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  pdl_launch_dependents();
  pdl_wait();
  float scale = 1.0f;
  if (norm_w) {
    __shared__ float sums[32];
    float ss = 0.0f;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * 4; i < in; i += static_cast<int64_t>(blockDim.x) * 4) {
      const float4 a = *reinterpret_cast<const float4*>(xr + i);  // in is whole groups of 32
      ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (lane == 0) sums[warp] = ss;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < warps; ++w) t += sums[w];
    scale = rsqrtf(t / static_cast<float>(in) + eps);
  }
  const int lanes_per_group = group / 8;
  for (int64_t c = static_cast<int64_t>(warp) * 256; c < in; c += static_cast<int64_t>(warps) * 256) {
    const int64_t i = c + lane * 8;
    const bool live = i < in;  // (in is whole groups of 32: a live lane's eight are all in the row)
    float v[8] = {};
    if (live) {
      const float4 a = *reinterpret_cast<const float4*>(xr + i), b = *reinterpret_cast<const float4*>(xr + i + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
      if (norm_w) {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(__fmul_rn(v[e], scale), norm_w[i + e]);
      }
      if (up) {
        const float* ur = up + blockIdx.x * in + i;
        const float4 c = *reinterpret_cast<const float4*>(ur), d = *reinterpret_cast<const float4*>(ur + 4);
        const float u[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = silu(v[e]) * u[e];
      }
    }
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
    for (int o = 1; o < lanes_per_group; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    if (!live) continue;
    const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int q = min(127, max(-127, __float2int_rn(__fmul_rn(v[e], inv))));
      packed[e / 4] |= static_cast<uint32_t>(q & 0xFF) << (8 * (e % 4));
    }
    *reinterpret_cast<uint2*>(qr + i) = make_uint2(packed[0], packed[1]);
    if (lane % lanes_per_group == 0) dr[i / group] = __fdiv_rn(amax, 127.0f);
    if (sr) {  // a unit of 32 is four lanes (a group of 256 the warp: all live or none)
      int s = __dp4a(static_cast<int>(packed[0]), 0x01010101, __dp4a(static_cast<int>(packed[1]), 0x01010101, 0));
      s += __shfl_xor_sync(0xffffffff, s, 1);
      s += __shfl_xor_sync(0xffffffff, s, 2);
      if (lane % 4 == 0) store_unit_sum(sr + i / 256 * 16, lane / 4, s);
    }
  }
}

// 16 bytes at src (16-byte aligned) to shared dst, of which only the first `bytes` (0..16) are
// read, the rest zero-filled: a staged row never reads past its tensor's end.
__device__ __forceinline__ void cp_async16_part(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

constexpr int kMaxWarps = 4;                    // warps per block of the decode kernel
constexpr size_t kMaxStageBytes = 200u << 10;  // its shared memory, at most

// Staged bytes of one row (from the row's start rounded down to 16 to its end, rounded up).
__host__ __device__ constexpr int64_t stage_bytes(int64_t row_bytes) { return (row_bytes + 15 + 15) / 16 * 16; }

// outs (+)= w x for up to N rows of x (quant_matmul.h). Persistent blocks walk the weight rows
// (PAIRS: a gate row and its up row), kMaxWarps / split rows at a time: each row is cut into
// `split` segments of whole blocks, a warp each (long rows: more warps in flight and shorter
// chains per warp), and the segments' sums are added in a fixed order (deterministic, and the
// same whatever n is). Each warp copies its segment whole into its shared memory by coalesced
// 16-byte cp.async (the bandwidth-bound part: the bytes read once, straight), the next row's
// segment in flight while this one is decoded; the first is requested before the wait for the
// kernel that wrote x. Then the lanes take the segment's units, 32 apart: each unit's 32 levels
// against the 32 int8 activations of each x row (from L1/L2).
// kWords (Q4_K only): each unit as q4k_unit reads it and x's unit sums (xs) from the rounding.
template <DType T, int N, bool PAIRS, bool kSplit, bool kWords>
__global__ void __launch_bounds__(kMaxWarps * 32)
    quant_gemv_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                      const int8_t* __restrict__ xs, GemvOut outs, int n, int64_t in, int gshift, int split_arg,
                      int64_t staged) {
  static_assert(!kWords || T == DType::kQ4_K);
  const int split = kSplit ? split_arg : 1;  // (kSplit false: the whole-row kernel, fewer registers)
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float partial[2][kMaxWarps][PAIRS ? 2 * N : N];  // the segments' sums, by iteration parity
  constexpr int kParts = PAIRS ? 2 : 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t rows = gemv_rows(outs);
  const int64_t units = in / 32, nb = units / kUnits<T>, row_bytes = nb * kBlockBytes<T>, groups = in >> (5 + gshift);
  const int seg = warp % split, per_block = warps / split;
  const int64_t b0 = nb * seg / split, b1 = nb * (seg + 1) / split;  // this warp's blocks of each row
  const int64_t seg_bytes = (b1 - b0) * kBlockBytes<T>;
  uint8_t* buffers = smem + static_cast<int64_t>(warp) * 2 * kParts * staged;  // [2][kParts][staged]
  const int64_t row_groups = (rows + per_block - 1) / per_block;
  auto row_of = [&](int64_t group) { return group * per_block + warp / split; };
  // The first byte of this warp's segment of row `row`'s part p (p 1: the up row).
  auto segment = [&](int64_t row, int p) { return w + (row + p * rows) * row_bytes + b0 * kBlockBytes<T>; };
  // The segment of row `row`'s parts into buffer `slot`, one commit group (empty past the last row).
  auto stage = [&](int64_t row, int slot) {
    if (row < rows) {
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        const uint8_t* src = segment(row, p);
        const uint8_t* base = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
        const int64_t end = (src - base) + seg_bytes;
        uint8_t* dst = buffers + (slot * kParts + p) * staged;
        for (int64_t c = lane * 16; c < end; c += 32 * 16) {
          cp_async16_part(smem_addr(dst + c), base + c, static_cast<int>(end - c < 16 ? end - c : 16));
        }
      }
    }
    cp_async_commit();
  };
  pdl_launch_dependents();
  stage(row_of(blockIdx.x), 0);
  pdl_wait();
  int slot = 0;
  for (int64_t group = blockIdx.x; group < row_groups; group += gridDim.x, slot ^= 1) {
    const int64_t row = row_of(group);
    stage(row_of(group + gridDim.x), slot ^ 1);
    cp_async_wait<1>();  // this row's group
    __syncwarp();
    float acc[N], acc_up[PAIRS ? N : 1];
#pragma unroll
    for (int r = 0; r < N; ++r) acc[r] = 0.0f;
    if constexpr (PAIRS) {
#pragma unroll
      for (int r = 0; r < N; ++r) acc_up[r] = 0.0f;
    }
    if (row < rows) {
      // The staged segment's first block (wr) and, for pairs, the up row's (wu): a staged copy
      // starts at its source rounded down to 16.
      auto staged_at = [&](int p) {
        return buffers + (slot * kParts + p) * staged + (reinterpret_cast<uintptr_t>(segment(row, p)) & 15);
      };
      const uint8_t* wr = staged_at(0);
      const uint8_t* wu = PAIRS ? staged_at(1) : wr;
      for (int64_t su = lane; su < (b1 - b0) * kUnits<T>; su += 32) {  // su: unit of the segment
        const int64_t gu = b0 * kUnits<T> + su;
        const int u = static_cast<int>(su % kUnits<T>);
        if constexpr (kWords) {
          const Q4kUnit U = q4k_unit(unit_block<T>(wr, su), u);
          Q4kUnit V;
          if constexpr (PAIRS) V = q4k_unit(unit_block<T>(wu, su), u);
#pragma unroll
          for (int r = 0; r < N; ++r) {
            if (r >= n) break;
            const UnitX x = unit_x(xq, xd, r, in, groups, gu, gshift);
            const int xsum = unit_xsum(xs, r * groups + (gu >> 3), u);
            acc[r] += x.d * q4k_unit_dot(U, x.q, xsum);
            if constexpr (PAIRS) acc_up[r] += x.d * q4k_unit_dot(V, x.q, xsum);
          }
        } else {
          const Unit U = decode<T>(unit_block<T>(wr, su), u);
          Unit V;
          if constexpr (PAIRS) V = decode<T>(unit_block<T>(wu, su), u);
#pragma unroll
          for (int r = 0; r < N; ++r) {
            if (r >= n) break;
            const UnitX x = unit_x(xq, xd, r, in, groups, gu, gshift);
            acc[r] += x.d * unit_dot<T>(U, x.q);
            if constexpr (PAIRS) acc_up[r] += x.d * unit_dot<T>(V, x.q);
          }
        }
      }
    }
    __syncwarp();  // every lane is done with this buffer before it is staged into again
    // Sum over the warp; then (split > 1) the segments' sums in order, by the row's first warp.
#pragma unroll
    for (int r = 0; r < N; ++r) {
      for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
      if constexpr (PAIRS) {
        for (int o = 16; o > 0; o >>= 1) acc_up[r] += __shfl_xor_sync(0xffffffff, acc_up[r], o);
      }
    }
    if (split > 1) {
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < N; ++r) {
          partial[slot][warp][r] = acc[r];
          if constexpr (PAIRS) partial[slot][warp][N + r] = acc_up[r];
        }
      }
      __syncthreads();
      if (seg == 0) {
#pragma unroll
        for (int r = 0; r < N; ++r) {
          acc[r] = partial[slot][warp][r];
          if constexpr (PAIRS) acc_up[r] = partial[slot][warp][N + r];
          for (int k = 1; k < split; ++k) {
            acc[r] += partial[slot][warp + k][r];
            if constexpr (PAIRS) acc_up[r] += partial[slot][warp + k][N + r];
          }
        }
      }
    }
    if (seg == 0 && lane == 0 && row < rows) {
      const GemvRow to = gemv_row(outs, row);
#pragma unroll
      for (int r = 0; r < N; ++r) {
        if (r >= n) break;
        if constexpr (PAIRS) {
          outs.y[0][r * rows + row] = gated(outs, acc[r], acc_up[r]);
        } else {
          float* dst = to.y + r * to.rows + to.index;
          *dst = (outs.accumulate ? *dst : 0.0f) + acc[r] + (to.bias ? to.bias[to.index] : 0.0f);
        }
      }
    }
  }
  cp_async_wait<0>();
}

// Q4_K decode on int8 tensor cores, from q4k_mma_rows() rows of x (fewer: the unit loop above):
// the rows of x are the n side of an mma m16n8k32, one mma a unit of 32 weights (one scale, one
// offset) for 16 weight rows and 8 rows of x, so 1 to 8 rows of x cost the same instructions
// (quant_gemv_kernel's grow with each row: 8 sessions' step 3.2x one session's on the H100). A
// lane (g = lane / 4, t = lane % 4) reads, of each block of weight rows g and g + 8: the 16-byte
// head (d, dmin, the 12 scale bytes) and bytes 8t .. 8t + 7 of each 32-byte group of nibbles — the
// low nibbles are unit 2j's elements 8t .. 8t + 7, the high ones unit 2j + 1's: as they come, the
// A fragments of two mmas (k indices 4t .. 4t + 3 / 16 + 4t .. 16 + 4t + 3 stand for elements 8t ..
// 8t + 3 / 8t + 4 .. 8t + 7), with x row g's same elements (8 bytes of the rounded activations) as
// B. A block's integer sums are exact: S = sum of sc * (the unit's integer sum) and M = sum of m *
// (x's unit sums, from quantize_activations), then one float step a block: y += xd (d S - dmin M)
// (quant_imma's arithmetic; S past 2^24 rounds as it becomes a float). A tile is 16 rows (PAIRS:
// 16 gate rows, then their up rows); the block's 8 warps split the row's blocks (warp w: w, w + 8,
// ..) and their sums are added in warp order: a row of x gets the same numbers in every call of
// this kernel. (One row runs slower than the unit loop, 295 vs 332 tok/s on llama-8b, though it
// issues far fewer instructions a weight: its 8-byte loads and the warps in flight are the
// suspects, not measured.)
constexpr int kQ4kWarps = 8;
constexpr int kQ4kTile = 16;

// One block (256 weights) of weight rows g and g + 8 as a lane holds it.
struct Q4kSlice {
  uint4 head[2];     // rows g, g + 8: d, dmin, scales
  uint2 nib[2][4];   // rows g, g + 8: bytes 8t .. 8t + 7 of nibble groups 0..3
};

template <bool PAIRS>
__global__ void __launch_bounds__(kQ4kWarps * 32, 2)
    q4k_mma_gemv_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                        const int8_t* __restrict__ xsums, GemvOut outs, int n, int64_t in, int64_t tiles_per_block) {
  constexpr int kParts = PAIRS ? 2 : 1;
  constexpr int kBytes = 144;
  __shared__ float sums[2][kQ4kWarps][4 * kParts][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t units = gemv_rows(outs);  // weight rows (PAIRS: gate rows)
  int64_t tile0 = 0;
  const int64_t my_tiles = block_tiles(units, kQ4kTile, tiles_per_block, &tile0);
  const int64_t nblocks = in / 256, row_bytes = nblocks * kBytes;
  const int per_warp = static_cast<int>((nblocks + kQ4kWarps - 1) / kQ4kWarps);  // blocks a warp, each part
  const int steps = kParts * per_warp;  // a tile's steps: part p's blocks i (step p per_warp + i)
  const int64_t n_steps = my_tiles * steps;
  pdl_launch_dependents();
  auto load = [&](Q4kSlice& s, int64_t j) {
    const int64_t tile = tile0 + j / steps;
    const int step = static_cast<int>(j % steps), p = step / per_warp;
    const int64_t kb = warp + static_cast<int64_t>(kQ4kWarps) * (step % per_warp);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = tile * kQ4kTile + g + 8 * h;
      if (row < units && kb < nblocks) {
        const uint8_t* b = w + (row + p * units) * row_bytes + kb * kBytes;
        s.head[h] = load_weights16(b);
#pragma unroll
        for (int q = 0; q < 4; ++q) s.nib[h][q] = load_weights8(b + 16 + 32 * q + 8 * t);
      } else {  // zero levels and scales: adds nothing
        s.head[h] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < 4; ++q) s.nib[h][q] = make_uint2(0, 0);
      }
    }
  };
  auto ready = [] { pdl_wait(); };  // x (and y, for accumulate) come from the kernels before

  const int64_t groups = nblocks;  // x's groups of 256: one a block
  float acc[kParts][4];
#pragma unroll
  for (int p = 0; p < kParts; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.0f;
  int parity = 0;
  auto consume = [&](const Q4kSlice& s, int64_t j) {
    const int step = static_cast<int>(j % steps), p = step / per_warp;
    const int64_t kb = warp + static_cast<int64_t>(kQ4kWarps) * (step % per_warp);
    if (kb < nblocks) {
      // The scales of rows g, g + 8 as bytes: sc of units 0-3 / 4-7, m of units 0-3 / 4-7.
      uint32_t sc[2][2], mn[2][2];
      float d[2], dmin[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t w0 = s.head[h].y, w1 = s.head[h].z, w2 = s.head[h].w;
        sc[h][0] = w0 & 0x3F3F3F3F;
        mn[h][0] = w1 & 0x3F3F3F3F;
        sc[h][1] = (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030);
        mn[h][1] = ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030);
        d[h] = __half2float(__ushort_as_half(static_cast<unsigned short>(s.head[h].x & 0xFFFF)));
        dmin[h] = __half2float(__ushort_as_half(static_cast<unsigned short>(s.head[h].x >> 16)));
      }
      // S[i]: c[i]'s sum over the block's units of sc times the unit's integer sum.
      int S[4] = {0, 0, 0, 0};
      const int8_t* xr = xq + g * in + kb * 256 + 8 * t;  // x row g's elements 8t .. of each unit
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        uint2 xv = make_uint2(0, 0);
        if (g < n) xv = __ldg(reinterpret_cast<const uint2*>(xr + 32 * u));
        const int shift = 4 * (u & 1);
        const uint2 r0 = s.nib[0][u / 2], r8 = s.nib[1][u / 2];  // rows g, g + 8
        const uint32_t a[4] = {(r0.x >> shift) & 0x0F0F0F0F, (r8.x >> shift) & 0x0F0F0F0F, (r0.y >> shift) & 0x0F0F0F0F,
                               (r8.y >> shift) & 0x0F0F0F0F};
        int c[4];
        mma_s8_16832_zero(c, a, xv.x, xv.y);
        const int s_g = (sc[0][u / 4] >> (8 * (u % 4))) & 0xFF, s_g8 = (sc[1][u / 4] >> (8 * (u % 4))) & 0xFF;
        S[0] += s_g * c[0], S[1] += s_g * c[1], S[2] += s_g8 * c[2], S[3] += s_g8 * c[3];
      }
      // x rows 2t, 2t + 1: their scale and unit sums (128 hi + lo) for this block.
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 2 * t + e;
        if (r >= n) continue;
        const uint4 xs = __ldg(reinterpret_cast<const uint4*>(xsums + (r * groups + kb) * 16));
        const float xscale = __ldg(xd + r * groups + kb);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int lo_sum = __dp4a(static_cast<int>(mn[h][0]), static_cast<int>(xs.x), __dp4a(static_cast<int>(mn[h][1]), static_cast<int>(xs.y), 0));
          const int hi_sum = __dp4a(static_cast<int>(mn[h][0]), static_cast<int>(xs.z), __dp4a(static_cast<int>(mn[h][1]), static_cast<int>(xs.w), 0));
          const int M = hi_sum * 128 + lo_sum;
          const int i = 2 * h + e;  // c[i]: row g + 8h, x row 2t + e
          const float v = d[h] * static_cast<float>(S[i]) - dmin[h] * static_cast<float>(M);
          if (p == 0) acc[0][i] += xscale * v;
          else acc[kParts - 1][i] += xscale * v;
        }
      }
    }
    if (step != steps - 1) return;
    finish_mma_tile<kQ4kWarps, kParts, float>(sums, acc, parity, (tile0 + j / steps) * kQ4kTile, outs, n, units);
  };
  double_buffered<Q4kSlice>(n_steps, load, ready, consume);
}

// Q6_K decode on int8 tensor cores, from q6k_mma_rows() rows of x, laid out as
// q4k_mma_gemv_kernel (16 weight rows a tile, a row's blocks over 8 warps, their sums added in warp
// order). A Q6_K block (210 bytes: ql[128] the levels' low nibbles, qh[64] their high pairs, 16
// int8 scales, d) has a scale every 16 weights, so each 16 take one mma m16n8k16: lane (g, t) holds
// weights 4t .. 4t + 3 of the 16 for rows g and g + 8 (levels less 32: int8) and x row g's same
// elements as B. Group (n, j, gi) — weights 128 n + 32 j + 16 gi .. + 15 — takes the low (j < 2) or
// high nibbles of ql bytes 64 n + 32 (j & 1) + 16 gi .., bits 2j, 2j + 1 of qh bytes 128 + 32 n +
// 16 gi .., and scale 8 n + 2 j + gi. A block's sum is exact, S = sum of scale x (the group's integer
// sum), then one float step a block: y += xd d S. A block of 210 bytes is 4-byte aligned at even
// indices only (rows of an even block count: the caller checks); warp w takes blocks w, w + 8, ...,
// so the odd warps read their words by halves.
constexpr int kQ6kWarps = 8;
constexpr int kQ6kTile = 16;

// One block of weight rows g and g + 8 as a lane holds it.
struct Q6kSlice {
  uint32_t ql[2][8];  // word 4 n + 2 jj + gi: ql bytes 64 n + 32 jj + 16 gi + 4t ..
  uint32_t qh[2][4];  // word 2 n + gi: qh bytes 32 n + 16 gi + 4t ..
  uint32_t sc[2][4];  // the 16 scales
  uint32_t d[2];      // d (f16 bits)
};

template <bool PAIRS>
__global__ void __launch_bounds__(kQ6kWarps * 32, 2)
    q6k_mma_gemv_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                        GemvOut outs, int n, int64_t in, int64_t tiles_per_block) {
  constexpr int kParts = PAIRS ? 2 : 1;
  constexpr int kBytes = 210;
  __shared__ float sums[2][kQ6kWarps][4 * kParts][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t units = gemv_rows(outs);  // weight rows (PAIRS: gate rows)
  int64_t tile0 = 0;
  const int64_t my_tiles = block_tiles(units, kQ6kTile, tiles_per_block, &tile0);
  const int64_t nblocks = in / 256, row_bytes = nblocks * kBytes;
  const int per_warp = static_cast<int>((nblocks + kQ6kWarps - 1) / kQ6kWarps);  // blocks a warp, each part
  const int steps = kParts * per_warp;  // a tile's steps: part p's blocks i (step p per_warp + i)
  const int64_t n_steps = my_tiles * steps;
  pdl_launch_dependents();
  auto load = [&](Q6kSlice& s, int64_t j) {
    const int64_t tile = tile0 + j / steps;
    const int step = static_cast<int>(j % steps), p = step / per_warp;
    const int64_t kb = warp + static_cast<int64_t>(kQ6kWarps) * (step % per_warp);
    const bool halves = (kb & 1) != 0;  // (the warp's every block: 2 bytes past a 4-byte boundary)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = tile * kQ6kTile + g + 8 * h;
      if (row < units && kb < nblocks) {
        const uint8_t* b = w + (row + p * units) * row_bytes + kb * kBytes;
        auto word = [&](int at) { return halves ? u32_a2(b + at) : u32_a4(b + at); };
#pragma unroll
        for (int i = 0; i < 8; ++i) s.ql[h][i] = word(64 * (i / 4) + 32 * (i / 2 % 2) + 16 * (i % 2) + 4 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) s.qh[h][i] = word(128 + 32 * (i / 2) + 16 * (i % 2) + 4 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) s.sc[h][i] = word(192 + 4 * i);
        s.d[h] = *reinterpret_cast<const unsigned short*>(b + 208);
      } else {  // zero scales and d: adds nothing
#pragma unroll
        for (int i = 0; i < 8; ++i) s.ql[h][i] = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) s.qh[h][i] = 0, s.sc[h][i] = 0;
        s.d[h] = 0;
      }
    }
  };
  auto ready = [] { pdl_wait(); };  // x (and y, for accumulate) come from the kernels before

  const int64_t groups = nblocks;  // x's groups of 256: one a block
  float acc[kParts][4];
#pragma unroll
  for (int p = 0; p < kParts; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.0f;
  int parity = 0;
  auto consume = [&](const Q6kSlice& s, int64_t j) {
    const int step = static_cast<int>(j % steps), p = step / per_warp;
    const int64_t kb = warp + static_cast<int64_t>(kQ6kWarps) * (step % per_warp);
    if (kb < nblocks) {
      int S[4] = {0, 0, 0, 0};
      const int8_t* xr = xq + g * in + kb * 256 + 4 * t;  // x row g's elements 4t .. 4t + 3 of each group
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
          for (int gi = 0; gi < 2; ++gi) {
            uint32_t xv = 0;
            if (g < n) xv = __ldg(reinterpret_cast<const unsigned int*>(xr + 128 * half + 32 * jj + 16 * gi));
            uint32_t a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t lw = s.ql[h][4 * half + 2 * (jj % 2) + gi], hw = s.qh[h][2 * half + gi];
              const uint32_t lo = (jj < 2 ? lw : lw >> 4) & 0x0F0F0F0F;
              const uint32_t hi = ((hw >> (2 * jj)) & 0x03030303) << 4;
              a[h] = __vsub4(lo | hi, 0x20202020);  // levels 0..63 less 32, bytewise
            }
            int c[4];
            mma_s8_16816_zero(c, a[0], a[1], xv);
            const int is = 8 * half + 2 * jj + gi;
            const int s_g = static_cast<int8_t>(s.sc[0][is / 4] >> (8 * (is % 4)));
            const int s_g8 = static_cast<int8_t>(s.sc[1][is / 4] >> (8 * (is % 4)));
            S[0] += s_g * c[0], S[1] += s_g * c[1], S[2] += s_g8 * c[2], S[3] += s_g8 * c[3];
          }
        }
      }
      float d[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) d[h] = __half2float(__ushort_as_half(static_cast<unsigned short>(s.d[h])));
      // x rows 2t, 2t + 1: their scale for this block.
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 2 * t + e;
        if (r >= n) continue;
        const float xscale = __ldg(xd + r * groups + kb);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 2 * h + e;  // c[i]: row g + 8h, x row 2t + e
          const float v = d[h] * static_cast<float>(S[i]);
          if (p == 0) acc[0][i] += xscale * v;
          else acc[kParts - 1][i] += xscale * v;
        }
      }
    }
    if (step != steps - 1) return;
    finish_mma_tile<kQ6kWarps, kParts, float>(sums, acc, parity, (tile0 + j / steps) * kQ6kTile, outs, n, units);
  };
  double_buffered<Q6kSlice>(n_steps, load, ready, consume);
}

// An expert's gate/up product: silu(gate) * up, or gpt-oss's clamped SwiGLU where ep.limit > 0
// (g = min(gate, limit), u = clamp(up, -limit, limit), g sigmoid(alpha g) (u + 1)).
__device__ __forceinline__ float expert_gated(float gate, float up, const ExpertEpilogue& ep) {
  if (ep.limit > 0.0f) {
    const float g = fminf(gate, ep.limit), u = fminf(fmaxf(up, -ep.limit), ep.limit);
    return g / (1.0f + expf(-ep.alpha * g)) * (u + 1.0f);
  }
  return silu(gate) * up;
}

// The experts' products (quant_matmul.h, quant_gemv_experts): block (x, c) takes the c-th chosen
// expert's weights, a warp 32 / LPR rows at a time (LPR lanes a row, LPR units apart: short rows
// take fewer lanes, so that a warp has several rows' loads in flight), and that expert's (token,
// slot) pairs N at a time. As soon as the expert is known its rows are asked into L2
// (prefetch), while the pairs' ids are still being read. The grid has a row of blocks per expert
// that could be chosen (at most one per pair); those past the count chosen return at once.
// Each pair's sum is its own (no pair's arithmetic depends on the others in its group).
template <DType T, int N, bool PAIRS, int LPR>
__global__ void __launch_bounds__(kMaxWarps * 32)
    expert_gemv_kernel(const uint8_t* __restrict__ w, int64_t expert_bytes, int64_t rows,
                       const int8_t* __restrict__ xq, const float* __restrict__ xd, int64_t in,
                       int gshift, const int32_t* __restrict__ order,
                       const int32_t* __restrict__ start, int n_expert, int first_expert, int x_div,
                       float* __restrict__ y, ExpertEpilogue ep) {
  constexpr int kRowsPerWarp = 32 / LPR;
  pdl_launch_dependents();
  pdl_wait();  // the routing (start, order) and xq come from the kernels before
  if (static_cast<int>(blockIdx.y) >= start[n_expert + 1]) return;
  const int e = start[n_expert + 2 + blockIdx.y];  // (routed id; w holds experts from first_expert on)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int sub = lane / LPR, sl = lane % LPR;  // this lane's row of the warp's, its place in the row
  const uint8_t* we = w + static_cast<int64_t>(e - first_expert) * expert_bytes;
  const int64_t units = in / 32, row_bytes = units / kUnits<T> * kBlockBytes<T>,
                groups = in >> (5 + gshift);
  const int64_t first_row = (static_cast<int64_t>(blockIdx.x) * warps + warp) * kRowsPerWarp;
  {  // the warp's first rows (and their up rows) into L2: 128-byte lines, a lane a line
    const int64_t span = min(static_cast<int64_t>(kRowsPerWarp), rows - first_row) * row_bytes;
    for (int p = 0; p < (PAIRS ? 2 : 1); ++p) {
      const uint8_t* base = we + (first_row + p * rows) * row_bytes;
      for (int64_t at = static_cast<int64_t>(lane) * 128; at < span; at += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base + at));
      }
    }
  }
  const float* bias = ep.bias ? ep.bias + static_cast<int64_t>(e - first_expert) * (PAIRS ? 2 * rows : rows) : nullptr;
  const int first = start[e], count = start[e + 1] - first;
  for (int64_t row0 = first_row; row0 < rows; row0 += static_cast<int64_t>(gridDim.x) * warps * kRowsPerWarp) {
    const int64_t row = row0 + sub;
    const bool live = row < rows;  // (a warp's last rows may be past the end: they only shuffle)
    const uint8_t* wr = we + (live ? row : 0) * row_bytes;
    const uint8_t* wu = PAIRS ? wr + rows * row_bytes : wr;
    for (int c0 = 0; c0 < count; c0 += N) {
      int pair[N];
#pragma unroll
      for (int r = 0; r < N; ++r) pair[r] = c0 + r < count ? order[first + c0 + r] : -1;
      float acc[N], acc_up[PAIRS ? N : 1];
#pragma unroll
      for (int r = 0; r < N; ++r) acc[r] = 0.0f;
      if constexpr (PAIRS) {
#pragma unroll
        for (int r = 0; r < N; ++r) acc_up[r] = 0.0f;
      }
#pragma unroll 2
      for (int64_t gu = sl; live && gu < units; gu += LPR) {
        const int u = static_cast<int>(gu % kUnits<T>);
        const Unit U = decode<T>(unit_block<T>(wr, gu), u);
        Unit V;
        if constexpr (PAIRS) V = decode<T>(unit_block<T>(wu, gu), u);
#pragma unroll
        for (int r = 0; r < N; ++r) {
          if (pair[r] < 0) break;
          const UnitX x = unit_x(xq, xd, pair[r] / x_div, in, groups, gu, gshift);
          acc[r] += x.d * unit_dot<T>(U, x.q);
          if constexpr (PAIRS) acc_up[r] += x.d * unit_dot<T>(V, x.q);
        }
      }
#pragma unroll
      for (int r = 0; r < N; ++r) {
        float v = acc[r], up = PAIRS ? acc_up[r] : 0.0f;  // (every lane shuffles, live or not)
        for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if constexpr (PAIRS) {
          for (int o = LPR / 2; o > 0; o >>= 1) up += __shfl_xor_sync(0xffffffff, up, o);
        }
        if (!live) continue;
        if (bias) v += bias[row];
        if constexpr (PAIRS) {
          if (bias) up += bias[rows + row];
          v = expert_gated(v, up, ep);
        }
        if (sl == 0 && pair[r] >= 0) y[static_cast<int64_t>(pair[r]) * rows + row] = v;
      }
    }
  }
}

// One thread per unit: rows of w (from `w`, row_bytes apart, or ids[r] where ids is set) to out
// [rows, in] in OutT.
template <DType T, typename OutT>
__global__ void dequantize_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, const int32_t* __restrict__ ids,
                                  int64_t units, int64_t total, OutT* __restrict__ out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t r = i / units, gu = i % units;
  const int64_t src = ids ? ids[r] : r;
  const Unit U = decode<T>(unit_block<T>(w + src * row_bytes, gu), static_cast<int>(gu % kUnits<T>));
  OutT* o = out + r * units * 32 + gu * 32;
  if constexpr (std::is_same_v<OutT, float>) {
#pragma unroll
    for (int e = 0; e < 32; e += 4) {
      *reinterpret_cast<float4*>(o + e) = make_float4(unit_value(U, e), unit_value(U, e + 1), unit_value(U, e + 2), unit_value(U, e + 3));
    }
  } else {
#pragma unroll
    for (int e = 0; e < 32; e += 8) {
      uint32_t p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(unit_value(U, e + 2 * k), unit_value(U, e + 2 * k + 1));
        p[k] = *reinterpret_cast<const uint32_t*>(&v);
      }
      *reinterpret_cast<uint4*>(o + e) = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
}

// Batches of kQuantGemvMaxRows < n <= kQuantMmaMaxRows rows of x (quant_mma): tensor cores on the
// blocks. A block of kMmaWarps warps takes kMmaRows weight rows (a warp 16 of them) and all n rows
// of x, and walks its share of the rows' chunks of kMmaChunk elements (a K-quant super-block, or
// eight 32-element blocks): the chunk's blocks of its rows and the chunk of every x row (BF16) are
// copied into shared memory by cp.async (the next chunk's blocks in flight while this one is used;
// the first requested before the wait for the kernel that wrote x), the blocks are widened to BF16
// in shared memory (the values dequantize_rows_bf16 gives: the products of the tile GEMM this
// replaces, without the tile in global memory), and mma.sync m16n8k16 sums them in f32 (fragments
// by ldmatrix).
// Rows too few to fill the device are cut along k into `splits` ranges of chunks (blockIdx.y):
// each block writes its partial sums to `partial`, and the last of a row tile's blocks to finish
// (a counter per tile, left at zero again) adds them in split order and writes the outputs: the
// same sums whichever block finishes last.
constexpr int kMmaWarps = 4, kMmaRows = 16 * kMmaWarps, kMmaChunk = 256, kMmaChunkUnits = kMmaChunk / 32;

template <DType T>
constexpr int kMmaChunkBytes = kMmaChunk / static_cast<int>(dtype_block_elems(T)) * kBlockBytes<T>;

// BF16 tiles in shared memory ([rows][kMmaChunk], 512 bytes a row) have their 16-byte pieces
// XOR-swizzled by row, so that ldmatrix (8 rows, one piece) touches every bank once. (The
// widening's stores, 8 lanes on one row's 8 units, still meet 4 to a bank: lanes on 8 rows would
// store without conflicts but read the blocks' scale bytes 8 to a bank.)
__device__ __forceinline__ int swizzle_of(int row) { return (row & 1) << 2 | (row >> 1 & 3); }
__device__ __forceinline__ int swizzled(int row, int piece) { return row * 32 + (piece ^ swizzle_of(row)); }

// The kernel's shared memory: staged blocks [2][kMmaRows][stage_bytes(chunk)], x [8 NT][kMmaChunk]
// and the widened tile [kMmaRows][kMmaChunk] (BF16; at most 102 KB: two blocks a multiprocessor).
__host__ __device__ constexpr int64_t mma_smem_bytes(int64_t chunk_bytes, int nt) {
  return 2 * kMmaRows * stage_bytes(chunk_bytes) + (8 * nt + kMmaRows) * kMmaChunk * 2;
}

// The main loop of the batch kernels (quant_mma_kernel, expert_mma_kernel): acc += the block's
// kMmaRows weight rows times its 8 NT rows of x over chunks [c_begin, c_end). w_row(r): row r's
// blocks (nullptr: no such row, zeros); x_row(j): x's row j, BF16 (nullptr: zeros). before_x()
// runs between the first chunk's weights requested and x's (the wait for the kernel that wrote
// x). acc[nt] holds this warp's rows warp * 16 + g (+ 8) and x rows nt * 8 + 2 t (+ 1), as mma16816's C.
// x_row(0) is never nullptr (a block has a row of x at least: the address the zero-filled pieces name).
template <DType T, int NT, typename WRow, typename XRow, typename BeforeX>
__device__ __forceinline__ void mma_chunks(uint8_t* smem, WRow w_row, XRow x_row, int64_t in, int c_begin, int c_end,
                                           BeforeX before_x, float (&acc)[NT][4]) {
  constexpr int kStaged = static_cast<int>(stage_bytes(kMmaChunkBytes<T>)), kXRows = 8 * NT, kThreads = kMmaWarps * 32;
  uint8_t* wbuf = smem;
  uint4* xbuf = reinterpret_cast<uint4*>(smem + 2 * kMmaRows * kStaged);  // 16-byte pieces, swizzled
  uint4* tile = xbuf + kXRows * (kMmaChunk / 8);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t units = in / 32;
  auto chunk_units = [&](int c) {
    const int64_t left = units - int64_t{c} * kMmaChunkUnits;
    return static_cast<int>(left < kMmaChunkUnits ? left : kMmaChunkUnits);
  };
  // Chunk c of the block's row r in global memory (a chunk's units are whole blocks).
  auto source = [&](int r, int c) { return w_row(r) + int64_t{c} * kMmaChunkBytes<T>; };
  auto stage_w = [&](int c, int slot) {
    const int bytes = chunk_units(c) / kUnits<T> * kBlockBytes<T>;
    constexpr int kPieces = kStaged / 16;
#pragma unroll 4
    for (int i = tid; i < kMmaRows * kPieces; i += kThreads) {
      const int r = i / kPieces, p = i % kPieces;
      if (w_row(r) == nullptr) continue;
      const uint8_t* src = source(r, c);
      const uint8_t* base = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
      const int end = static_cast<int>(src - base) + bytes;
      if (p * 16 < end) cp_async16_part(smem_addr(wbuf + (slot * kMmaRows + r) * kStaged + p * 16), base + p * 16, min(16, end - p * 16));
    }
  };
  auto stage_x = [&](int c) {
    const int pieces = chunk_units(c) * 4;  // 16 bytes: 8 values
#pragma unroll 4
    for (int i = tid; i < kXRows * 32; i += kThreads) {
      const int r = i / 32, p = i % 32;
      if (p >= pieces) continue;
      const __nv_bfloat16* row = x_row(r);
      cp_async16(smem_addr(xbuf + swizzled(r, p)), row ? row + int64_t{c} * kMmaChunk + p * 8 : x_row(0), row != nullptr);
    }
  };
  // Unit j of the chunk of row r (staged), widened into the tile.
  auto widen = [&](int r, int j, const uint8_t* staged) {
    if (w_row(r) == nullptr) {
#pragma unroll
      for (int e = 0; e < 4; ++e) tile[swizzled(r, 4 * j + e)] = make_uint4(0, 0, 0, 0);
      return;
    }
    const Unit U = decode<T>(staged + (j / kUnits<T>) * kBlockBytes<T>, j % kUnits<T>);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      uint32_t p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(unit_value(U, 8 * e + 2 * k), unit_value(U, 8 * e + 2 * k + 1));
        p[k] = *reinterpret_cast<const uint32_t*>(&v);
      }
      tile[swizzled(r, 4 * j + e)] = make_uint4(p[0], p[1], p[2], p[3]);
    }
  };
  // The groups in flight, oldest first: w(c), x(c), w(c + 1); x has one buffer (the next chunk's
  // x is asked for once the products of this one are done, and arrives during the next widening).
  if (c_begin < c_end) stage_w(c_begin, 0);
  cp_async_commit();
  before_x();
  if (c_begin < c_end) stage_x(c_begin);
  cp_async_commit();
  // ldmatrix.x4 addresses, a lane a row of one 8x8 matrix: A's four (rows 0-7 / 8-15 of the warp's
  // 16, k 0-7 / 8-15 of a step) make a[0..3]; x's four (n-tiles nt / nt + 1, k 0-7 / 8-15) make
  // b0, b1 of both.
  const int a_row = warp * 16 + (lane & 7) + (lane >> 3 & 1) * 8, a_piece = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_piece = lane >> 3 & 1;
  const int a_xor = swizzle_of(a_row), b_xor = swizzle_of(b_row);
  const uint32_t a_base = smem_addr(tile) + a_row * kMmaChunk * 2, b_base = smem_addr(xbuf) + b_row * kMmaChunk * 2;
  for (int c = c_begin; c < c_end; ++c) {
    const int slot = (c - c_begin) & 1, cu = chunk_units(c);
    if (c + 1 < c_end) stage_w(c + 1, slot ^ 1);
    cp_async_commit();
    cp_async_wait<2>();  // w(c)
    __syncthreads();
    // Widen: consecutive threads take a row's consecutive units (their scales are the same bytes;
    // lanes on different rows' scales would meet in a few banks).
    const uint8_t* staged0 = wbuf + slot * kMmaRows * kStaged;
    auto staged_row = [&](int r) {
      return staged0 + r * kStaged + (w_row(r) ? reinterpret_cast<uintptr_t>(source(r, c)) & 15 : 0);
    };
    if (cu == kMmaChunkUnits) {
#pragma unroll
      for (int i = tid; i < kMmaRows * kMmaChunkUnits; i += kThreads) {
        widen(i / kMmaChunkUnits, i % kMmaChunkUnits, staged_row(i / kMmaChunkUnits));
      }
    } else {
      for (int i = tid; i < kMmaRows * cu; i += kThreads) widen(i / cu, i % cu, staged_row(i / cu));
    }
    cp_async_wait<1>();  // x(c)
    __syncthreads();
    for (int j = 0; j < cu; ++j) {
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int piece = 4 * j + 2 * step;
        uint32_t a[4];
        ldmatrix_x4(a, a_base + (((piece + a_piece) ^ a_xor) << 4));
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b[4];  // b0, b1 of n-tile nt, then of nt + 1
          ldmatrix_x4(b, b_base + nt * 8 * kMmaChunk * 2 + (((piece + b_piece) ^ b_xor) << 4));
          mma16816<__nv_bfloat16>(acc[nt], a, b[0], b[1]);
          mma16816<__nv_bfloat16>(acc[nt + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with x and the tile before they are written again
    if (c + 1 < c_end) stage_x(c + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();
}

// The end of a batch kernel's row tile (quant_mma_kernel, quant_imma_kernel): acc (mma16816's C
// layout: this warp's rows warp * 16 + g (+ 8), x rows nt * 8 + 2 t (+ 1)) to its outputs. Where
// the tile's chunks are cut into gridDim.y ranges, each block writes its sums to its slice of
// `partial` ([tile][split][kMmaRows][8 NT]) and the last of the tile's blocks to arrive (a counter
// per tile, left at zero again) adds them in split order: the same sums whichever finishes last.
// (The block's x rows XR: 8 NT unless its warps split them; this warp's rows from warp * 16, its
// x rows from col0.)
template <int NT, int XR = 8 * NT>
__device__ __forceinline__ void store_tile(float (&acc)[NT][4], const GemvOut& outs, int n, int64_t rows, int64_t row0,
                                           float* __restrict__ partial, int* __restrict__ arrived, int warp = threadIdx.x / 32,
                                           int col0 = 0) {
  constexpr int kXRows = XR;
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, splits = gridDim.y;
  if (splits > 1) {
    // This block's sums to its slice of `partial` ([tile][split][kMmaRows][8 NT]); the last to arrive adds them.
    float* mine = partial + (static_cast<int64_t>(blockIdx.x) * splits + blockIdx.y) * kMmaRows * kXRows;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<float2*>(mine + (warp * 16 + g + 8 * h) * kXRows + col0 + nt * 8 + 2 * t) = make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
      }
    }
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (tid == 0) last = atomicAdd(arrived + blockIdx.x, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* all = partial + static_cast<int64_t>(blockIdx.x) * splits * kMmaRows * kXRows;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 s = make_float2(0.0f, 0.0f);
        for (int k = 0; k < splits; ++k) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(all + (k * kMmaRows + warp * 16 + g + 8 * h) * kXRows + col0 + nt * 8 + 2 * t));
          s.x += v.x, s.y += v.y;
        }
        acc[nt][2 * h] = s.x, acc[nt][2 * h + 1] = s.y;
      }
    }
    if (tid == 0) arrived[blockIdx.x] = 0;  // for the next call
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + warp * 16 + g + 8 * h;
    if (row >= rows) continue;
    const GemvRow to = gemv_row(outs, row);
    const float bias = to.bias ? to.bias[to.index] : 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = col0 + nt * 8 + 2 * t + e;
        if (col >= n) continue;
        float* dst = to.y + col * to.rows + to.index;
        *dst = (outs.accumulate ? *dst : 0.0f) + acc[nt][2 * h + e] + bias;
      }
    }
  }
}

template <DType T, int NT>
__global__ void __launch_bounds__(kMmaWarps * 32)
    quant_mma_kernel(const uint8_t* __restrict__ w, const __nv_bfloat16* __restrict__ x, GemvOut outs, int n, int64_t in,
                     float* __restrict__ partial, int* __restrict__ arrived) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t rows = gemv_rows(outs);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int64_t units = in / 32, row_bytes = units / kUnits<T> * kBlockBytes<T>;
  const int chunks = static_cast<int>((units + kMmaChunkUnits - 1) / kMmaChunkUnits), splits = gridDim.y;
  const int c_begin = chunks * blockIdx.y / splits, c_end = chunks * (blockIdx.y + 1) / splits;
  pdl_launch_dependents();
  float acc[NT][4] = {};
  mma_chunks<T, NT>(
      smem, [&](int r) { return row0 + r < rows ? w + (row0 + r) * row_bytes : nullptr; },
      [&](int r) { return r < n ? x + r * in : nullptr; }, in, c_begin, c_end, [] { pdl_wait(); }, acc);
  store_tile<NT>(acc, outs, n, rows, row0, partial, arrived);
}

// Batches of kQuantGemvMaxRows < n <= kQuantMmaMaxRows rows of x on the super-block formats
// (quant_imma): x rounded to 8 bits per 256 as decode rounds it, and int8 tensor cores on the
// blocks' integer levels. These formats are value = d * s * q - dmin * m, with d and dmin one
// f16 a block of 256 and s, m small integers per 32 (or 16) elements, so a block's contribution to
// y[row][col] is dx * (d * S - dmin * M) with dx x's scale for the block's 256 and
//   S = sum over units of s * (the unit's levels . x's levels)   (mma.sync m16n8k32, or two
//       m16n8k16 where the scales are per 16; times s in int32),
//   M = sum over units of m * (the sum of x's levels over the unit)  (Q4_K, Q5_K: from the unit
//       sums the 8-bit x carries, two m16n8k16 a block; Q2_K: a second m16n8k32 a unit whose A
//       holds m in every byte of its unit, the mma summing x's levels),
// both exact integers; one float step a block. The block takes kMmaRows weight rows and all n rows
// of x, as quant_mma_kernel does (its warps: kImmaWarps), a block of 256 (a chunk) at a time: the
// chunk's raw blocks and x's levels staged by cp.async (the next chunk's in flight: one barrier a
// chunk), each warp (or pair of warps) widening its own 16 rows to int8 levels and integer scales
// in shared memory (decode<T>'s levels). The sums of each output are its own, in a fixed order for
// a given NT and split (both change with n: at 16/17 and 32/33 rows of x). On the H100 (bench/gpu/qgemv.cu) llama-8b's matrices at 64 rows of x take
// 0.55-0.91 of quant_mma's time (0.42-0.76 at 16 rows): the kernel is bound by issue latency (5.8
// cycles an instruction, 2.6 warps a scheduler), the products under half of its instructions.
__host__ __device__ constexpr bool imma_type(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K ||
         t == DType::kIQ4_XS;
}
template <DType T>
constexpr bool kHalfScales = T == DType::kQ2_K || T == DType::kQ3_K || T == DType::kQ6_K;  // scales per 16

// Unit u's integer scales, bytes (s of elements 0-15, s of 16-31, m of 0-15, m of 16-31), each an
// int8 (quant.cc's decoding of each format's scale bytes, as decode<T> forms d * s and dmin * m).
template <DType T>
__device__ __forceinline__ uint32_t unit_int_scales(const uint8_t* b, int u) {
  auto pack = [](int s0, int s1, int m0, int m1) {
    return uint32_t{static_cast<uint8_t>(s0)} | uint32_t{static_cast<uint8_t>(s1)} << 8 |
           uint32_t{static_cast<uint8_t>(m0)} << 16 | uint32_t{static_cast<uint8_t>(m1)} << 24;
  };
  if constexpr (T == DType::kQ4_K || T == DType::kQ5_K) {  // (without a branch: lanes take both halves)
    const uint8_t* sp = b + 4;
    const int j = u & 3, a = u8_at(sp + j), m = u8_at(sp + j + 4), c = u8_at(sp + j + 8);
    const bool high = u >= 4;
    const int sc = high ? (c & 0xF) | (a >> 6) << 4 : a & 63, mn = high ? (c >> 4) | (m >> 6) << 4 : m & 63;
    return pack(sc, sc, mn, mn);
  } else if constexpr (T == DType::kQ6_K) {
    const int half = u >> 2, s = u & 3;
    return pack(static_cast<int8_t>(u8_at(b + 192 + 8 * half + 2 * s)), static_cast<int8_t>(u8_at(b + 192 + 8 * half + 2 * s + 1)), 0, 0);
  } else if constexpr (T == DType::kQ3_K) {
    const uint8_t* p = b + 96;
    int v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = 2 * u + h;
      const int low = s < 8 ? u8_at(p + s) & 0xF : u8_at(p + s - 8) >> 4;
      const int top = (u8_at(p + 8 + s % 4) >> (2 * (s / 4))) & 3;
      v[h] = (low | top << 4) - 32;
    }
    return pack(v[0], v[1], 0, 0);
  } else if constexpr (T == DType::kQ2_K) {
    const int s0 = u8_at(b + 2 * u), s1 = u8_at(b + 2 * u + 1);
    return pack(s0 & 0xF, s1 & 0xF, s0 >> 4, s1 >> 4);
  } else {  // IQ4_XS
    const uint32_t sh = *reinterpret_cast<const unsigned short*>(b + 2);
    const int ls = ((u8_at(b + 4 + u / 2) >> (4 * (u & 1))) & 0xF) | ((sh >> (2 * u)) & 3) << 4;
    return pack(ls - 32, ls - 32, 0, 0);
  }
}

// A block's (d, dmin) (dmin 0 for the formats without offsets).
template <DType T>
__device__ __forceinline__ float2 block_scales(const uint8_t* b) {
  if constexpr (T == DType::kQ4_K || T == DType::kQ5_K) return make_float2(f16_at(b), f16_at(b + 2));
  if constexpr (T == DType::kQ6_K) return make_float2(f16_at(b + 208), 0.0f);
  if constexpr (T == DType::kQ3_K) return make_float2(f16_at(b + 108), 0.0f);
  if constexpr (T == DType::kQ2_K) return make_float2(f16_at(b + 80), f16_at(b + 82));
  return make_float2(f16_at(b), 0.0f);  // IQ4_XS
}

constexpr int kImmaUnits = 8, kImmaPieces = 16;  // a chunk (one block of 256): units of 32, 16-byte pieces
constexpr int kImmaScaleStride = kImmaUnits + 1;  // (rows g and g + 8 of a warp's reads in other banks)

// Blocks whose size is whole 16-byte pieces (Q4_K, Q5_K) all start 16-byte aligned: staged
// whole, their rows kBlockBytes apart; the others from their source rounded down to 16.
template <DType T>
constexpr bool kAlignedBlocks = kBlockBytes<T> % 16 == 0;
template <DType T>
constexpr int kImmaStaged = kAlignedBlocks<T> ? kBlockBytes<T> : static_cast<int>(stage_bytes(kBlockBytes<T>));

// The kernel's shared memory: staged blocks [2][kMmaRows][kImmaStaged], the rows' levels
// [kMmaRows][256] and x's [2][8 NT][256] (int8, 16-byte pieces XOR-swizzled by row as for ldmatrix),
// the units' scales [kMmaRows][kImmaScaleStride], the blocks' (d, dmin) [kMmaRows] and x's scales
// for the chunk [2][8 NT].
// The offsets' products from x's unit sums (Q4_K, Q5_K: m per 32): M = sum over units of m times
// the unit's sum of x, one m16n8k16 product a block for each half of the sums (lo, and hi times
// 128: activation_sums_offset's bytes) with the rows' m in A, instead of a m16n8k32 a unit with m
// spread over the unit's 32 places. The same integers.
template <DType T>
constexpr bool kUnitSums = kHasOffset<T> && !kHalfScales<T>;

// (kUnitSums: then x's unit sums [2][8 NT] and the rows' m [kMmaRows][8]; only there, so that the
// other formats keep their resident blocks: IQ4_XS at NT 4 fits four only without them.)
template <DType T, int NT>
constexpr int64_t imma_smem_bytes() {
  return 2 * kMmaRows * kImmaStaged<T> + (kMmaRows + 2 * 8 * NT) * 256 + kMmaRows * kImmaScaleStride * 4 + kMmaRows * 8 +
         2 * 8 * NT * 4 + (kUnitSums<T> ? 2 * 8 * NT * 16 + kMmaRows * 8 : 0);
}

// The block's warps for 8 NT rows of x: up to 32, kMmaWarps, each all of x's rows for its 16
// weight rows (acc, S and M: 3 x 4 NT registers a thread); 33-64, twice as many, each pair of
// warps on the same 16 rows and each of the pair on half of x's rows. At 64 rows one warp held 96
// such registers: ptxas bounded at 168 (3 blocks) spilled 40-90 bytes and 3 blocks of 4 warps
// were 2.6 warps a scheduler; the pairs take 118-128 registers without spills, 2 blocks of 8 warps
// a multiprocessor (H100, llama-8b Q4_K_M at 64 sessions: 4,448 -> 5,095 tok/s).
template <int NT>
constexpr int kImmaWarps = NT >= 8 ? 2 * kMmaWarps : kMmaWarps;

// (Registers bounded for 2-4 resident blocks a multiprocessor: unbounded, ptxas took 240-255 with
// four warps and two blocks fit.)
template <DType T, int NT>
__global__ void __launch_bounds__(kImmaWarps<NT> * 32, kImmaWarps<NT> == kMmaWarps ? 4 : 2)
    quant_imma_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                      const int8_t* __restrict__ xs, GemvOut outs, int n, int64_t in, float* __restrict__ partial,
                      int* __restrict__ arrived) {
  static_assert(imma_type(T) && kUnits<T> == kImmaUnits);
  constexpr bool kSums = kUnitSums<T>;
  constexpr int W = kImmaWarps<NT>;
  static_assert(W == kMmaWarps || (W == 2 * kMmaWarps && NT % 4 == 0));
  constexpr int kStaged = kImmaStaged<T>, kXRows = 8 * NT, kThreads = W * 32;
  constexpr int kPair = W / kMmaWarps, NTW = NT / kPair;  // warps on the same rows; this warp's n-tiles
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* wbuf = smem;
  uint4* levels = reinterpret_cast<uint4*>(smem + 2 * kMmaRows * kStaged);  // [kMmaRows][kImmaPieces]
  uint4* xbuf = levels + kMmaRows * kImmaPieces;                             // [2][kXRows][kImmaPieces]
  uint32_t* scales = reinterpret_cast<uint32_t*>(xbuf + 2 * kXRows * kImmaPieces);
  float2* dd = reinterpret_cast<float2*>(scales + kMmaRows * kImmaScaleStride);
  float* dxs = reinterpret_cast<float*>(dd + kMmaRows);  // [2][kXRows]
  uint4* xsum = reinterpret_cast<uint4*>(dxs + 2 * kXRows);           // [2][kXRows] (kSums) x's unit sums
  uint32_t* mbytes = reinterpret_cast<uint32_t*>(xsum + 2 * kXRows);  // [kMmaRows][2] (kSums) the units' m
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
  // This warp's rows from warp * 16, its x rows from col0 (half: which of its pair).
  const int warp = kPair == 1 ? tid / 32 : tid / 32 % kMmaWarps, half = kPair == 1 ? 0 : tid / 32 / kMmaWarps;
  const int col0 = half * NTW * 8;
  const int64_t rows = gemv_rows(outs);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int64_t nb = in / 256, row_bytes = nb * kBlockBytes<T>;
  const int chunks = static_cast<int>(nb), splits = gridDim.y;
  const int c_begin = chunks * blockIdx.y / splits, c_end = chunks * (blockIdx.y + 1) / splits;
  auto stage_w = [&](int c, int slot) {
    constexpr int kPieces = kStaged / 16;
#pragma unroll 4
    for (int i = tid; i < kMmaRows * kPieces; i += kThreads) {
      const int r = i / kPieces, p = i % kPieces;
      if (row0 + r >= rows) continue;
      const uint8_t* src = w + (row0 + r) * row_bytes + int64_t{c} * kBlockBytes<T>;
      if constexpr (kAlignedBlocks<T>) {
        cp_async16(smem_addr(wbuf + (slot * kMmaRows + r) * kStaged + p * 16), src + p * 16);
      } else {
        const uint8_t* base = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
        const int end = static_cast<int>(src - base) + kBlockBytes<T>;
        if (p * 16 < end) cp_async16_part(smem_addr(wbuf + (slot * kMmaRows + r) * kStaged + p * 16), base + p * 16, min(16, end - p * 16));
      }
    }
  };
  auto stage_x = [&](int c, int slot) {
#pragma unroll 4
    for (int i = tid; i < kXRows * kImmaPieces; i += kThreads) {
      const int r = i / kImmaPieces, p = i % kImmaPieces;
      cp_async16(smem_addr(xbuf + (slot * kXRows + r) * kImmaPieces + (p ^ (r & 7))),
                 xq + (r < n ? r : 0) * in + int64_t{c} * 256 + p * 16, r < n);
    }
    if (tid < kXRows) cp_async4(smem_addr(dxs + slot * kXRows + tid), xd + (tid < n ? tid : 0) * nb + c, tid < n);
    if (kSums && tid < kXRows) cp_async16(smem_addr(xsum + slot * kXRows + tid), xs + ((tid < n ? tid : 0) * nb + c) * 16, tid < n);
  };
  // Chunk c's blocks and x in slot c & 1; c + 1's requested as c's work starts (once every warp is
  // done with c - 1's, which were in that slot): one barrier a chunk.
  pdl_launch_dependents();
  if (c_begin < c_end) stage_w(c_begin, 0);
  pdl_wait();
  if (c_begin < c_end) stage_x(c_begin, 0);
  cp_async_commit();
  // ldmatrix.x4 addresses: A's four 8x16-byte matrices (rows 0-7 / 8-15 of the warp's, bytes 0-15 /
  // 16-31 of a unit) are m16n8k32's a[0..3]; x's four (n-tiles nt / nt + 1, bytes 0-15 / 16-31) its
  // b0, b1 of both.
  const int a_row = warp * 16 + (lane & 7) + (lane >> 3 & 1) * 8, a_half = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_half = lane >> 3 & 1;
  const uint32_t a_base = smem_addr(levels + a_row * kImmaPieces), b_base0 = smem_addr(xbuf + (col0 + b_row) * kImmaPieces);
  const int r_lo = warp * 16 + g;  // this thread's C rows: r_lo, r_lo + 8
  float acc[NTW][4] = {};
  for (int c = c_begin; c < c_end; ++c) {
    const int slot = (c - c_begin) & 1;
    cp_async_wait<0>();  // chunk c
    __syncthreads();      // ... for every thread's copies; and every warp is done with c - 1
    if (c + 1 < c_end) stage_w(c + 1, slot ^ 1), stage_x(c + 1, slot ^ 1);
    cp_async_commit();
    const uint32_t b_base = b_base0 + slot * kXRows * 256;
    // The warp's 16 rows (its pair's) to levels and integer scales: a lane two units (2k, 2k + 1:
    // the same bytes of nibbles in Q4_K / Q5_K, read once), 8 rows at a time.
#pragma unroll 1
    for (int i = half * 32 + lane; i < 16 * kImmaUnits / 2; i += 32 * kPair) {
      const int r = warp * 16 + i / (kImmaUnits / 2), u0 = 2 * (i % (kImmaUnits / 2));
      uint4* dst = levels + r * kImmaPieces;
      if (row0 + r >= rows) {  // past the weight's rows: zeros
#pragma unroll
        for (int u = u0; u < u0 + 2; ++u) {
          dst[(2 * u) ^ (r & 7)] = dst[(2 * u + 1) ^ (r & 7)] = make_uint4(0, 0, 0, 0);
          scales[r * kImmaScaleStride + u] = 0;
          if constexpr (kSums) reinterpret_cast<uint8_t*>(mbytes)[r * 8 + u] = 0;
        }
        if (u0 == 0) dd[r] = make_float2(0.0f, 0.0f);
        continue;
      }
      // (a staged block starts at its source's offset from 16 bytes)
      const int off = kAlignedBlocks<T> ? 0 : static_cast<int>((reinterpret_cast<uintptr_t>(w) + (row0 + r) * row_bytes + int64_t{c} * kBlockBytes<T>) & 15);
      const uint8_t* b = wbuf + (slot * kMmaRows + r) * kStaged + off;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int u = u0 + k;
        const Unit U = decode<T>(b, u);
        dst[(2 * u) ^ (r & 7)] = make_uint4(U.q[0], U.q[1], U.q[2], U.q[3]);
        dst[(2 * u + 1) ^ (r & 7)] = make_uint4(U.q[4], U.q[5], U.q[6], U.q[7]);
        const uint32_t sc = unit_int_scales<T>(b, u);
        scales[r * kImmaScaleStride + u] = sc;
        if constexpr (kSums) reinterpret_cast<uint8_t*>(mbytes)[r * 8 + u] = static_cast<uint8_t>(sc >> 16);
      }
      if (u0 == 0) dd[r] = block_scales<T>(b);
    }
    // (each warp widens only the rows it multiplies, or its pair's)
    if constexpr (kPair == 1) {
      __syncwarp();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(1 + warp), "r"(32 * kPair) : "memory");
    }
    int s_sum[NTW][4] = {}, m_sum[NTW][4] = {};
#pragma unroll 2
    for (int j = 0; j < kImmaUnits; ++j) {
      uint32_t a[4];
      ldmatrix_x4(a, a_base + (((2 * j + a_half) ^ (a_row & 7)) << 4));
      const uint32_t s_lo = scales[r_lo * kImmaScaleStride + j], s_hi = scales[(r_lo + 8) * kImmaScaleStride + j];
      const int s0_lo = static_cast<int8_t>(s_lo), s1_lo = static_cast<int8_t>(s_lo >> 8);
      const int s0_hi = static_cast<int8_t>(s_hi), s1_hi = static_cast<int8_t>(s_hi >> 8);
      // m in every byte: rows g / g + 8, elements 0-15 / 16-31 (a[0..3]'s places).
      const uint32_t am[4] = {__byte_perm(s_lo, 0, 0x2222), __byte_perm(s_hi, 0, 0x2222), __byte_perm(s_lo, 0, 0x3333),
                              __byte_perm(s_hi, 0, 0x3333)};
#pragma unroll
      for (int nt = 0; nt < NTW; nt += 2) {
        uint32_t b[4];  // b0, b1 of n-tile nt, then of nt + 1
        ldmatrix_x4(b, b_base + nt * 8 * 256 + (((2 * j + b_half) ^ (b_row & 7)) << 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int (&s)[4] = s_sum[nt + h];
          if constexpr (kHalfScales<T>) {
            int p0[4], p1[4];
            mma_s8_16816_zero(p0, a[0], a[1], b[2 * h]);
            mma_s8_16816_zero(p1, a[2], a[3], b[2 * h + 1]);
            s[0] += s0_lo * p0[0] + s1_lo * p1[0], s[1] += s0_lo * p0[1] + s1_lo * p1[1];
            s[2] += s0_hi * p0[2] + s1_hi * p1[2], s[3] += s0_hi * p0[3] + s1_hi * p1[3];
          } else {
            int p[4];
            mma_s8_16832_zero(p, a, b[2 * h], b[2 * h + 1]);
            s[0] += s0_lo * p[0], s[1] += s0_lo * p[1], s[2] += s0_hi * p[2], s[3] += s0_hi * p[3];
          }
          if constexpr (kHasOffset<T> && !kSums) mma_s8_16832(m_sum[nt + h], am, b[2 * h], b[2 * h + 1]);
        }
      }
    }
    if constexpr (kSums) {  // M from the unit sums: k 0-7 the units (t 0, 1), 8-15 zeros (t 2, 3)
      const uint32_t a0 = t < 2 ? mbytes[r_lo * 2 + t] : 0, a1 = t < 2 ? mbytes[(r_lo + 8) * 2 + t] : 0;
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        const uint32_t* rec = reinterpret_cast<const uint32_t*>(xsum + slot * kXRows + col0 + nt * 8 + g);
        int lo[4], hi[4];
        mma_s8_16816_zero(lo, a0, a1, t < 2 ? rec[t] : 0);
        mma_s8_16816_zero(hi, a0, a1, t < 2 ? rec[2 + t] : 0);
#pragma unroll
        for (int e = 0; e < 4; ++e) m_sum[nt][e] = 128 * hi[e] + lo[e];
      }
    }
    // The block's step: y += dx (d S - dmin M).
    const float2 d_lo = dd[r_lo], d_hi = dd[r_lo + 8];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const float2 dx2 = *reinterpret_cast<const float2*>(dxs + slot * kXRows + col0 + nt * 8 + 2 * t);  // (0 past n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float dx = e == 0 ? dx2.x : dx2.y;
        float lo = d_lo.x * static_cast<float>(s_sum[nt][e]), hi = d_hi.x * static_cast<float>(s_sum[nt][2 + e]);
        if constexpr (kHasOffset<T>) {
          lo -= d_lo.y * static_cast<float>(m_sum[nt][e]);
          hi -= d_hi.y * static_cast<float>(m_sum[nt][2 + e]);
        }
        acc[nt][e] += dx * lo;
        acc[nt][2 + e] += dx * hi;
      }
    }
  }
  cp_async_wait<0>();
  store_tile<NTW, kXRows>(acc, outs, n, rows, row0, partial, arrived, warp, col0);
}

// The chosen experts' products of a batched step (quant_mma_experts): block (x, y) takes weight
// rows x (kMmaRows of them, or for PAIRS kMmaRows / 2 gate rows and their up rows, so that a
// block forms its rows' silu(gate) * up itself) of the expert of tile y of expert_tiles_kernel's
// list, and that tile's pairs (up to 8 NT) as the x rows: each pair's sum is its own, whatever
// other pairs share its tile. Blocks past the list's count return at once.
constexpr int kExpertMmaNT = 8, kExpertTilePairs = 8 * kExpertMmaNT;

// The list of (expert, first pair in order, pairs) tiles of up to kExpertTilePairs pairs, the
// chosen experts' in their chosen order: tiles[0].x the count (at most `bound`), then the tiles.
// One warp.
__global__ void expert_tiles_kernel(const int32_t* __restrict__ start, int n_expert, int4* __restrict__ tiles, int bound) {
  pdl_launch_dependents();
  pdl_wait();  // the routing (start)
  const int lane = threadIdx.x, chosen = start[n_expert + 1];
  int running = 0;
  for (int base = 0; base < chosen; base += 32) {
    const int c = base + lane;
    int e = 0, first = 0, count = 0;
    if (c < chosen) e = start[n_expert + 2 + c], first = start[e], count = start[e + 1] - first;
    const int mine = (count + kExpertTilePairs - 1) / kExpertTilePairs;
    int incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffff, incl, o);
      if (lane >= o) incl += v;
    }
    for (int i = 0, at = running + incl - mine; i < mine && at + i < bound; ++i) {
      tiles[1 + at + i] = make_int4(e, first + i * kExpertTilePairs, min(kExpertTilePairs, count - i * kExpertTilePairs), 0);
    }
    running += __shfl_sync(0xffffffff, incl, 31);
  }
  if (lane == 0) tiles[0] = make_int4(min(running, bound), 0, 0, 0);
}

template <DType T, bool PAIRS>
__global__ void __launch_bounds__(kMmaWarps * 32)
    expert_mma_kernel(const uint8_t* __restrict__ w, int64_t expert_bytes, int64_t rows,
                      const __nv_bfloat16* __restrict__ x, int64_t in, const int32_t* __restrict__ order,
                      const int4* __restrict__ tiles, int first_expert, int x_div, void* __restrict__ y,
                      ExpertEpilogue ep) {
  constexpr int NT = kExpertMmaNT;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int pair_of[kExpertTilePairs];
  pdl_launch_dependents();
  pdl_wait();  // the tiles, x and the routing come from the kernels before
  if (static_cast<int>(blockIdx.y) >= tiles[0].x) return;
  const int4 tile = tiles[1 + blockIdx.y];
  const int e = tile.x, count = tile.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  if (tid < kExpertTilePairs) pair_of[tid] = tid < count ? order[tile.y + tid] : -1;
  __syncthreads();
  const uint8_t* we = w + static_cast<int64_t>(e - first_expert) * expert_bytes;
  const int64_t units = in / 32, row_bytes = units / kUnits<T> * kBlockBytes<T>;
  constexpr int kOwn = PAIRS ? kMmaRows / 2 : kMmaRows;  // the block's output rows
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kOwn;
  const int chunks = static_cast<int>((units + kMmaChunkUnits - 1) / kMmaChunkUnits);
  float acc[NT][4] = {};
  mma_chunks<T, NT>(
      smem,
      [&](int r) -> const uint8_t* {
        const int64_t row = r0 + r % kOwn;  // (PAIRS: rows kOwn.. are the up rows, `rows` on)
        return row < rows ? we + (row + (PAIRS && r >= kOwn ? rows : 0)) * row_bytes : nullptr;
      },
      [&](int j) -> const __nv_bfloat16* {
        return pair_of[j] < 0 ? nullptr : x + static_cast<int64_t>(pair_of[j] / x_div) * in;
      },
      in, 0, chunks, [] {}, acc);
  const float* bias = ep.bias ? ep.bias + static_cast<int64_t>(e - first_expert) * (PAIRS ? 2 * rows : rows) : nullptr;
  if constexpr (PAIRS) {
    // The gate and up sums meet in shared memory ([kMmaRows][kExpertTilePairs + 1] f32), then each
    // thread forms a row's product for a pair: consecutive threads, consecutive rows of y.
    constexpr int kStride = kExpertTilePairs + 1;
    float* sums = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the tiles
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sums[(warp * 16 + g + 8 * h) * kStride + nt * 8 + 2 * t] = acc[nt][2 * h];
        sums[(warp * 16 + g + 8 * h) * kStride + nt * 8 + 2 * t + 1] = acc[nt][2 * h + 1];
      }
    }
    __syncthreads();
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(y);
    for (int i = tid; i < kOwn * kExpertTilePairs; i += kMmaWarps * 32) {
      const int r = i % kOwn, j = i / kOwn;
      const int64_t row = r0 + r;
      if (j >= count || row >= rows) continue;
      float v = sums[r * kStride + j], up = sums[(kOwn + r) * kStride + j];
      if (bias) v += bias[row], up += bias[rows + row];
      out[static_cast<int64_t>(pair_of[j]) * rows + row] = __float2bfloat16_rn(expert_gated(v, up, ep));
    }
  } else {
    float* out = static_cast<float*>(y);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = r0 + warp * 16 + g + 8 * h;
      if (row >= rows) continue;
      const float b = bias ? bias[row] : 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int j = nt * 8 + 2 * t + k;
          if (j < count) out[static_cast<int64_t>(pair_of[j]) * rows + row] = acc[nt][2 * h + k] + b;
        }
      }
    }
  }
}

// expert_mma_kernel's shared memory (allowed past 48 KB on the current device).
template <DType T, bool PAIRS>
size_t expert_mma_smem() {
  constexpr auto bytes = static_cast<size_t>(mma_smem_bytes(kMmaChunkBytes<T>, kExpertMmaNT));
  allow_dynamic_smem<expert_mma_kernel<T, PAIRS>>(bytes);
  return bytes;
}

// f(std::integral_constant<DType, T>) for w's block type T.
template <typename F>
Status for_block_type(DType t, F&& f) {
  switch (t) {
#define COMBS_BLOCK_TYPE(X) \
  case DType::X: return f(std::integral_constant<DType, DType::X>{});
    COMBS_BLOCK_TYPE(kQ4_0) COMBS_BLOCK_TYPE(kQ4_1) COMBS_BLOCK_TYPE(kQ5_0) COMBS_BLOCK_TYPE(kQ5_1)
    COMBS_BLOCK_TYPE(kQ8_0) COMBS_BLOCK_TYPE(kQ2_K) COMBS_BLOCK_TYPE(kQ3_K) COMBS_BLOCK_TYPE(kQ4_K)
    COMBS_BLOCK_TYPE(kQ5_K) COMBS_BLOCK_TYPE(kQ6_K) COMBS_BLOCK_TYPE(kIQ4_NL) COMBS_BLOCK_TYPE(kIQ4_XS)
    COMBS_BLOCK_TYPE(kMXFP4)
#undef COMBS_BLOCK_TYPE
    default: return invalid_argument_error(std::string("cuda: ") + std::string(dtype_name(t)) + " is not a block type");
  }
}

Status check_block_weight(const Tensor& w, const char* op) {
  if (!is_block_quant(w.dtype()) || w.rank() != 2 || w.dim(1) % dtype_block_elems(w.dtype()) != 0) {
    return invalid_argument_error(std::string(op) + ": a 2-D block-quantized weight of whole blocks per row, not " +
                                  std::string(dtype_name(w.dtype())) + " " + w.shape().to_string());
  }
  return ok_status();
}

// A mixture's stacked experts [n_expert, out, in]: a block type, whole blocks a row, and gate/up
// pairs (an even `out`) where pairs.
Status check_expert_weight(const Tensor& w, bool pairs, const char* op) {
  if (!is_block_quant(w.dtype()) || w.rank() != 3 || w.dim(2) % dtype_block_elems(w.dtype()) != 0 ||
      (pairs && w.dim(1) % 2 != 0)) {
    return invalid_argument_error(std::string(op) + ": a 3-D block-quantized weight of whole blocks per row, not " +
                                  std::string(dtype_name(w.dtype())) + " " + w.shape().to_string());
  }
  return ok_status();
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Staged bytes of a warp's segment of a row cut into `split` (its largest: whole blocks).
int64_t segment_stage_bytes(DType t, int64_t in, int split) {
  const int64_t nb = in / static_cast<int64_t>(dtype_block_elems(t));
  return stage_bytes((nb + split - 1) / split * static_cast<int64_t>(dtype_block_bytes(t)));
}

// Warps a row of the decode kernel: 1, 2 or 4. Long rows are cut into segments of at most
// kSegmentBytes (the longer a warp's segment, the fewer warps fit and the longer each warp's
// chain: llama-8b's down rows of 14,336 ran at 0.37 of the copy bandwidth whole, 0.44-0.50 in
// four); and rows too few to give every resident warp one are cut further, down to segments of
// kMinSegmentBlocks blocks (a 1,024-row V of 4,096: 5.0 us whole, 3.9 in two; shorter rows lose:
// llama-1b's Q/K of 2,048, 3.1 us whole, 3.75 in two). Measured by bench/gpu/qgemv.cu on the H200.
constexpr int64_t kSegmentBytes = 4096, kMinSegmentBlocks = 8;
int gemv_split(int64_t row_bytes, int64_t blocks, int64_t rows, int64_t resident_warps) {
  int split = row_bytes <= kSegmentBytes ? 1 : row_bytes <= 2 * kSegmentBytes ? 2 : 4;
  while (split < kMaxWarps && rows * split * 2 <= resident_warps && blocks / (split * 2) >= kMinSegmentBlocks) split *= 2;
  return split;
}

// Multiprocessors of the device (found once).
int device_sms() {
  static const int sms = [] {
    int device = 0, count = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return std::max(1, count);
  }();
  return sms;
}

// One instantiation of the decode kernel and its launch: persistent blocks, as many as stay
// resident with this much shared memory (by registers: the kernel's own occupancy, found once).
template <DType T, int N, bool PAIRS, bool W = false>
struct GemvVariant {
  template <bool kSplit>
  static int resident_blocks() {  // per multiprocessor, by registers
    allow_dynamic_smem<quant_gemv_kernel<T, N, PAIRS, kSplit, W>>(kMaxStageBytes);
    static const int per_sm = [] {
      int blocks = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, quant_gemv_kernel<T, N, PAIRS, kSplit, W>, kMaxWarps * 32, 0);
      cudaGetLastError();
      return std::max(1, blocks);
    }();
    return per_sm;
  }
  // split: warps a row (0: gemv_split's choice).
  static Status launch(cudaStream_t st, const uint8_t* w, const int8_t* q, const float* d, const int8_t* xs,
                       const GemvOut& outs, int n, int64_t in, int gshift, int64_t rows, int split) {
    const int sms = device_sms();
    // Blocks a multiprocessor holds: by its shared memory (two staged segments per warp), by registers.
    auto smem_of = [&](int s) { return static_cast<size_t>(kMaxWarps * 2 * (PAIRS ? 2 : 1) * segment_stage_bytes(T, in, s)); };
    auto by_smem = [&](int s) { return static_cast<int>(std::max<size_t>(1, (size_t{228} << 10) / (smem_of(s) + 1024))); };
    if (split == 0) {  // (by the 8-row kernel's residency: a row's split, so its numbers, the same whatever n)
      const int64_t resident = int64_t{sms} * std::min(GemvVariant<T, 8, PAIRS, W>::template resident_blocks<false>(), by_smem(1)) * kMaxWarps;
      split = gemv_split(static_cast<int64_t>(nbytes_for(T, in)), in / static_cast<int64_t>(dtype_block_elems(T)), rows, resident);
    }
    const int64_t staged = segment_stage_bytes(T, in, split);
    const size_t smem = smem_of(split);
    if (smem > kMaxStageBytes) {
      return invalid_argument_error("cuda quant_gemv: rows of " + std::to_string(in) + " do not fit shared memory");
    }
    const int by_registers = split > 1 ? resident_blocks<true>() : resident_blocks<false>();
    const int per_block = kMaxWarps / split;
    const int64_t wanted = (rows + per_block - 1) / per_block;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(wanted, int64_t{sms} * std::min(by_registers, by_smem(split)))));
    if (split > 1) {
      launch_pdl(quant_gemv_kernel<T, N, PAIRS, true, W>, grid, dim3(kMaxWarps * 32), smem, st, w, q, d, xs, outs, n, in,
                 gshift, split, staged);
    } else {
      launch_pdl(quant_gemv_kernel<T, N, PAIRS, false, W>, grid, dim3(kMaxWarps * 32), smem, st, w, q, d, xs, outs, n, in,
                 gshift, 1, staged);
    }
    return cuda_status(cudaGetLastError(), "quant_gemv_kernel");
  }
};

// A block-quantized tensor-core decode kernel's launch (q4k_ / q6k_mma_gemv_kernel: 8 warps, tiles
// of 16 rows): persistent blocks, as many as stay resident (at most two a multiprocessor), each the
// same number of tiles; the kernel's arguments, then the tiles a block.
static_assert(kQ4kWarps == kQ6kWarps && kQ4kTile == kQ6kTile);
template <auto Kernel, typename... Args>
Status launch_quant_mma_gemv(cudaStream_t st, const GemvOut& outs, const char* name, Args... args) {
  static const int per_sm = [] {
    int blocks = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, kQ4kWarps * 32, 0);
    cudaGetLastError();
    return std::clamp(blocks, 1, 2);
  }();
  int64_t per_block = 0;
  const unsigned grid = equal_tiles_grid((outs.end[outs.count - 1] + kQ4kTile - 1) / kQ4kTile,
                                         int64_t{device_sms()} * per_sm, &per_block);
  launch_pdl(Kernel, dim3(grid), dim3(kQ4kWarps * 32), 0, st, args..., per_block);
  return cuda_status(cudaGetLastError(), name);
}

// Whether Q4_K's unit loop reads a unit as q4k_unit does (scales as words, x's unit sums from the
// rounding: about half the instructions a unit of decode<kQ4_K>'s bytes and x's sums by dp4a,
// where ncu found the one-session GEMVs issue-bound) — the default; COMBS_Q4K_UNIT_LOOP=bytes
// takes the bytes. H100, llama-8b Q4_K_M, tok/s words vs bytes (session 15, alternated in one
// call): one session 337 / 338 vs 332 / 332; 2 sessions 524 vs 520; 3: 614 vs 611; 8: 1,384 vs 1,381.
bool q4k_unit_words() {
  static const bool words = [] {
    const char* v = std::getenv("COMBS_Q4K_UNIT_LOOP");
    return !(v && std::string_view(v) == "bytes");
  }();
  return words;
}

// The fewest rows of x that take q6k_mma_gemv_kernel (where a row is an even number of blocks);
// fewer take the unit loop. H100, llama-8b Q4_K_M (its output, and V and down of half the layers,
// are Q6_K), tok/s unit loop vs this kernel: 8 sessions 1,166 / 1,169 vs 1,384 / 1,382; 4: 726 vs
// 772; 3: 611 vs 648; 2: 520 vs 518; one session 333 / 335 vs 315. COMBS_Q6K_MMA_ROWS (1-9)
// overrides it (9: never).
int q6k_mma_rows() {
  static const int rows = rows_from_env("COMBS_Q6K_MMA_ROWS", 3);
  return rows;
}

// The fewest rows of x that take q4k_mma_gemv_kernel; fewer take the unit loop, which is faster
// for one to three (H100, llama-8b Q4_K_M, tok/s: one session 332 vs 295; 2 sessions 517 vs 505;
// 3: 618 vs 553; 4: 697 vs 707; 8: 838 vs 1,138). COMBS_Q4K_MMA_ROWS (1-9) overrides it (9: never).
int q4k_mma_rows() {
  static const int rows = rows_from_env("COMBS_Q4K_MMA_ROWS", 4);
  return rows;
}

// The batch kernels' row tiles; their split scratch: a counter per tile in a region of fixed size
// (kMaxMmaTiles counters), then the partial sums. Fixed, because every call shares one scratch slot
// (zeroed only when it grows) and each call's counters must be zero where it looks: sized by the
// call's own rows, a call with more tiles read the partial sums an earlier one with fewer had left
// past its counters as its own counters (llama-8b at 33-64 rows: O's 64 tiles cut in 6, then
// gate/up's 448), so its tiles' last blocks never found themselves last and left outputs unwritten.
constexpr int64_t kMaxMmaTiles = 65536;  // weights of up to 4,194,304 rows
int64_t mma_tiles(int64_t rows) { return (rows + kMmaRows - 1) / kMmaRows; }
constexpr size_t kMmaCounterBytes = kMaxMmaTiles * 4;
Status check_mma_tiles(int64_t rows, const char* op) {
  if (mma_tiles(rows) > kMaxMmaTiles) {
    return invalid_argument_error(std::string(op) + ": " + std::to_string(rows) + " weight rows (at most " +
                                  std::to_string(kMaxMmaTiles * kMmaRows) + ")");
  }
  return ok_status();
}
constexpr int kMaxMmaSplits = 16;

// Ranges of chunks each row tile of a batch kernel is cut into: the fewest that bring the waves of
// blocks (slots: blocks resident at once) times the time a block takes to their least (a tile's
// blocks run at about the same speed: 448 tiles on 396 resident blocks take two waves of 16
// chunks, 1,792 quarters five waves of 4). A cut block also writes its partial sums and the last
// reads them all: counted as NT / 4 chunks (measured on the H200 with bench/gpu/qgemv.cu:
// llama-8b's 2,004 output tiles lost 17% in quarters at NT 8).
int mma_splits(int64_t rows, int64_t chunks, int64_t slots, int nt) {
  const int64_t tiles = mma_tiles(rows);
  int best = 1;
  double best_cost = 1e300;
  for (int s = 1; s <= kMaxMmaSplits && s <= std::max<int64_t>(1, chunks / 2); ++s) {
    const double per_block = static_cast<double>((chunks + s - 1) / s) + (s > 1 ? nt / 4.0 : 0.0);
    const double cost = static_cast<double>((tiles * s + slots - 1) / slots) * per_block;
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// Blocks of a batch kernel resident on the device at once, with smem bytes of shared memory each.
template <typename Kernel>
int64_t resident_tiles(Kernel kernel, size_t smem, int threads = kMmaWarps * 32) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  cudaGetLastError();
  return int64_t{std::max(1, per_sm)} * device_sms();
}

// A batch kernel's split scratch (see kMmaCounterBytes): its bytes for `splits` ranges, and the
// counters and partial sums in it.
size_t split_scratch_bytes(int64_t rows, int splits, int nt) {
  return kMmaCounterBytes + (splits > 1 ? static_cast<size_t>(mma_tiles(rows) * splits * kMmaRows * 8 * nt) * 4 : 0);
}
struct SplitScratch {
  int* arrived;
  float* partial;
};
SplitScratch split_scratch(void* scratch) {
  return {static_cast<int*>(scratch), reinterpret_cast<float*>(static_cast<uint8_t*>(scratch) + kMmaCounterBytes)};
}

// One instantiation of the batch kernel and its launch.
template <DType T, int NT>
struct MmaVariant {
  static size_t smem() {  // (allowed past 48 KB on the current device)
    constexpr auto bytes = static_cast<size_t>(mma_smem_bytes(kMmaChunkBytes<T>, NT));
    allow_dynamic_smem<quant_mma_kernel<T, NT>>(bytes);
    return bytes;
  }
  // Blocks resident on the device at once.
  static int64_t slots() {
    static const int64_t n = resident_tiles(quant_mma_kernel<T, NT>, smem());
    return n;
  }
  static int splits(int64_t rows, int64_t in) {
    return mma_splits(rows, (in / 32 + kMmaChunkUnits - 1) / kMmaChunkUnits, slots(), NT);
  }
  static size_t scratch_bytes(int64_t rows, int64_t in) { return split_scratch_bytes(rows, splits(rows, in), NT); }
  static Status launch(cudaStream_t st, const uint8_t* w, const __nv_bfloat16* xs, const GemvOut& outs, int n, int64_t in,
                       void* scratch) {
    const int64_t rows = outs.end[outs.count - 1];
    COMBS_RETURN_IF_ERROR(check_mma_tiles(rows, "cuda quant_mma"));
    const dim3 grid(static_cast<unsigned>(mma_tiles(rows)), static_cast<unsigned>(splits(rows, in)));
    const SplitScratch sc = split_scratch(scratch);
    return cuda_status(launch_pdl(quant_mma_kernel<T, NT>, grid, dim3(kMmaWarps * 32), smem(), st, w, xs, outs, n, in,
                                  sc.partial, sc.arrived),
                       "quant_mma_kernel");
  }
};

// One instantiation of the 8-bit batch kernel and its launch (as MmaVariant; x: quantize_activations').
template <DType T, int NT>
struct ImmaVariant {
  static constexpr int W = kImmaWarps<NT>;
  static size_t smem() {
    constexpr auto bytes = static_cast<size_t>(imma_smem_bytes<T, NT>());
    allow_dynamic_smem<quant_imma_kernel<T, NT>>(bytes);
    return bytes;
  }
  static int64_t slots() {
    static const int64_t n = resident_tiles(quant_imma_kernel<T, NT>, smem(), W * 32);
    return n;
  }
  static int splits(int64_t rows, int64_t in) { return mma_splits(rows, in / 256, slots(), NT); }
  static size_t scratch_bytes(int64_t rows, int64_t in) { return split_scratch_bytes(rows, splits(rows, in), NT); }
  static Status launch(cudaStream_t st, const uint8_t* w, const int8_t* q, const float* d, const int8_t* s, const GemvOut& outs,
                       int n, int64_t in, void* scratch) {
    const int64_t rows = outs.end[outs.count - 1];
    COMBS_RETURN_IF_ERROR(check_mma_tiles(rows, "cuda quant_imma"));
    const dim3 grid(static_cast<unsigned>(mma_tiles(rows)), static_cast<unsigned>(splits(rows, in)));
    const SplitScratch sc = split_scratch(scratch);
    return cuda_status(launch_pdl(quant_imma_kernel<T, NT>, grid, dim3(W * 32), smem(), st, w, q, d, s, outs, n, in,
                                  sc.partial, sc.arrived),
                       "quant_imma_kernel");
  }
};

// f(ImmaVariant<T, NT>{}) for w's type (one that quant_imma_takes) and n's NT.
template <typename F>
Status for_imma_variant(DType t, int n, F&& f) {
  auto go = [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    if (n <= 16) return f(ImmaVariant<T, 2>{});
    if (n <= 32) return f(ImmaVariant<T, 4>{});
    return f(ImmaVariant<T, 8>{});
  };
  switch (t) {
    case DType::kQ2_K: return go(std::integral_constant<DType, DType::kQ2_K>{});
    case DType::kQ3_K: return go(std::integral_constant<DType, DType::kQ3_K>{});
    case DType::kQ4_K: return go(std::integral_constant<DType, DType::kQ4_K>{});
    case DType::kQ5_K: return go(std::integral_constant<DType, DType::kQ5_K>{});
    case DType::kQ6_K: return go(std::integral_constant<DType, DType::kQ6_K>{});
    case DType::kIQ4_XS: return go(std::integral_constant<DType, DType::kIQ4_XS>{});
    default: return invalid_argument_error(std::string("cuda quant_imma: ") + std::string(dtype_name(t)) + " is not a super-block format");
  }
}

// f(MmaVariant<T, NT>{}) for w's type and n's NT.
template <typename F>
Status for_mma_variant(DType t, int n, F&& f) {
  return for_block_type(t, [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    if (n <= 16) return f(MmaVariant<T, 2>{});
    if (n <= 32) return f(MmaVariant<T, 4>{});
    return f(MmaVariant<T, 8>{});
  });
}

// go(GemvVariant<T, N, pairs, W>{}) for the fewest rows N of 1, 2, 4, 8 that hold n.
template <DType T, bool W, typename Go>
Status gemv_by_rows(bool pairs, int n, const Go& go) {
  auto by_n = [&](auto p) -> Status {
    constexpr bool P = decltype(p)::value;
    if (n <= 1) return go(GemvVariant<T, 1, P, W>{});
    if (n <= 2) return go(GemvVariant<T, 2, P, W>{});
    if (n <= 4) return go(GemvVariant<T, 4, P, W>{});
    return go(GemvVariant<T, 8, P, W>{});
  };
  return pairs ? by_n(std::true_type{}) : by_n(std::false_type{});
}

}  // namespace

Status quantize_activations(cudaStream_t st, const float* x, int64_t n, int64_t in, const float* norm_w, float eps,
                            void* xq, const float* up) {
  if (in % 32 != 0) return invalid_argument_error("cuda quantize_activations: rows of " + std::to_string(in) + " (not whole groups of 32)");
  if (up && (norm_w || reinterpret_cast<uintptr_t>(up) % 16 != 0)) {
    return invalid_argument_error("cuda quantize_activations: up takes no norm, and 16-byte aligned rows");
  }
  if (n == 0) return ok_status();
  int8_t* q = static_cast<int8_t*>(xq);
  float* d = reinterpret_cast<float*>(q + activation_scales_offset(n, in));
  int8_t* s = activation_group(in) == 256 ? q + activation_sums_offset(n, in) : nullptr;
  constexpr int kQuantizeThreads = 1024;
  launch_pdl(quantize_act_kernel, dim3(static_cast<unsigned>(n)), dim3(kQuantizeThreads), 0, st, x, in, norm_w, eps, q, d,
             static_cast<int>(activation_group(in)), s, up);
  return cuda_status(cudaGetLastError(), "quantize_act_kernel");
}

Status quant_gemv(cudaStream_t st, const Tensor& w, const void* xq, int n, const GemvOut& outs, bool pairs) {
  COMBS_RETURN_IF_ERROR(check_block_weight(w, "cuda quant_gemv"));
  if (n < 1 || n > kQuantGemvMaxRows) return invalid_argument_error("cuda quant_gemv: 1 to 8 rows of x");
  const int64_t in = w.dim(1);
  const int8_t* q = static_cast<const int8_t*>(xq);
  const float* d = reinterpret_cast<const float*>(q + activation_scales_offset(n, in));
  const int gshift = activation_group(in) == 256 ? 3 : 0;
  const int64_t rows = outs.end[outs.count - 1];
  const uint8_t* wp = static_cast<const uint8_t*>(w.data());
  if (w.dtype() == DType::kQ4_K && n >= q4k_mma_rows() && reinterpret_cast<uintptr_t>(wp) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(q) % 16 == 0) {
    const int8_t* sums = q + activation_sums_offset(n, in);
    return pairs ? launch_quant_mma_gemv<q4k_mma_gemv_kernel<true>>(st, outs, "q4k_mma_gemv_kernel", wp, q, d, sums, outs, n, in)
                 : launch_quant_mma_gemv<q4k_mma_gemv_kernel<false>>(st, outs, "q4k_mma_gemv_kernel", wp, q, d, sums, outs, n, in);
  }
  if (w.dtype() == DType::kQ6_K && n >= q6k_mma_rows() && (in / 256) % 2 == 0 && reinterpret_cast<uintptr_t>(wp) % 4 == 0 &&
      reinterpret_cast<uintptr_t>(q) % 4 == 0) {
    return pairs ? launch_quant_mma_gemv<q6k_mma_gemv_kernel<true>>(st, outs, "q6k_mma_gemv_kernel", wp, q, d, outs, n, in)
                 : launch_quant_mma_gemv<q6k_mma_gemv_kernel<false>>(st, outs, "q6k_mma_gemv_kernel", wp, q, d, outs, n, in);
  }
  // The unit loop (quant_gemv_kernel): Q4_K reads words where q4k_unit_words() (x's unit sums
  // from the rounding, so groups of 256).
  const bool words = w.dtype() == DType::kQ4_K && q4k_unit_words() && gshift == 3;
  const int8_t* xs = words ? q + activation_sums_offset(n, in) : nullptr;
  auto go = [&](auto variant) { return decltype(variant)::launch(st, wp, q, d, xs, outs, n, in, gshift, rows, 0); };
  if (words) return gemv_by_rows<DType::kQ4_K, true>(pairs, n, go);
  return for_block_type(w.dtype(), [&](auto tag) -> Status { return gemv_by_rows<decltype(tag)::value, false>(pairs, n, go); });
}

namespace {
// The split scratch of the batch kernel variant that for_variant(type, n, f) picks (0: none).
template <typename ForVariant>
size_t variant_scratch_bytes(ForVariant for_variant, const Tensor& w, int n) {
  size_t bytes = 0;
  const Status s = for_variant(w.dtype(), n, [&](auto variant) {
    bytes = decltype(variant)::scratch_bytes(w.dim(0), w.dim(1));
    return ok_status();
  });
  return s.ok() ? bytes : 0;
}
}  // namespace

size_t quant_mma_scratch_bytes(const Tensor& w, int n) {
  return variant_scratch_bytes([](DType t, int m, auto&& f) { return for_mma_variant(t, m, f); }, w, n);
}

Status quant_mma(cudaStream_t st, const Tensor& w, const __nv_bfloat16* xs, int n, const GemvOut& outs, void* scratch) {
  COMBS_RETURN_IF_ERROR(check_block_weight(w, "cuda quant_mma"));
  if (n < 1 || n > kQuantMmaMaxRows) return invalid_argument_error("cuda quant_mma: 1 to 64 rows of x");
  if (outs.end[outs.count - 1] != w.dim(0)) return invalid_argument_error("cuda quant_mma: the outputs' rows are not the weight's");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data());
  return for_mma_variant(w.dtype(), n, [&](auto variant) { return decltype(variant)::launch(st, wp, xs, outs, n, w.dim(1), scratch); });
}

bool quant_imma_takes(DType t) { return imma_type(t); }

int quant_gemv_mma_min_rows(DType t) {
  return t == DType::kQ4_K ? q4k_mma_rows() : t == DType::kQ6_K ? q6k_mma_rows() : kQuantGemvMaxRows + 1;
}

size_t quant_imma_scratch_bytes(const Tensor& w, int n) {
  return variant_scratch_bytes([](DType t, int m, auto&& f) { return for_imma_variant(t, m, f); }, w, n);
}

Status quant_imma(cudaStream_t st, const Tensor& w, const void* xq, int n, const GemvOut& outs, void* scratch) {
  COMBS_RETURN_IF_ERROR(check_block_weight(w, "cuda quant_imma"));  // (for_imma_variant refuses the other formats)
  if (n < 1 || n > kQuantMmaMaxRows) return invalid_argument_error("cuda quant_imma: 1 to 64 rows of x");
  if (outs.end[outs.count - 1] != w.dim(0)) return invalid_argument_error("cuda quant_imma: the outputs' rows are not the weight's");
  if (reinterpret_cast<uintptr_t>(w.data()) % 16 != 0 || reinterpret_cast<uintptr_t>(xq) % 16 != 0) {
    return invalid_argument_error("cuda quant_imma: weights and x must start 16-byte aligned");  // (staged by 16-byte copies)
  }
  const int64_t in = w.dim(1);
  const int8_t* q = static_cast<const int8_t*>(xq);
  const float* d = reinterpret_cast<const float*>(q + activation_scales_offset(n, in));
  const int8_t* s = q + activation_sums_offset(n, in);  // (the super-block formats' rows are whole groups of 256)
  const uint8_t* wp = static_cast<const uint8_t*>(w.data());
  return for_imma_variant(w.dtype(), n, [&](auto variant) { return decltype(variant)::launch(st, wp, q, d, s, outs, n, in, scratch); });
}

Status quant_gemv_experts(cudaStream_t st, const Tensor& w, const void* xq, int64_t x_rows,
                          const int32_t* order, const int32_t* start, int x_div, bool pairs,
                          float* y, ExpertEpilogue epilogue, int experts, int first_expert) {
  COMBS_RETURN_IF_ERROR(check_expert_weight(w, pairs, "cuda quant_gemv_experts"));
  if (x_rows == 0) return ok_status();
  const int64_t in = w.dim(2), rows = pairs ? w.dim(1) / 2 : w.dim(1);
  const int8_t* q = static_cast<const int8_t*>(xq);
  const float* d = reinterpret_cast<const float*>(q + activation_scales_offset(x_rows, in));
  const int gshift = activation_group(in) == 256 ? 3 : 0;
  const int64_t expert_bytes = static_cast<int64_t>(nbytes_for(w.dtype(), w.dim(1) * in));
  const int held = static_cast<int>(w.dim(0)), n_expert = experts > 0 ? experts : held;
  if (first_expert < 0 || first_expert + held > n_expert) {
    return invalid_argument_error("cuda quant_gemv_experts: experts [" + std::to_string(first_expert) + ", " +
                                  std::to_string(first_expert + held) + ") of " + std::to_string(n_expert));
  }
  const int64_t most_chosen = std::min<int64_t>(held, x_rows * x_div);  // one expert a pair at most
  const uint8_t* wp = static_cast<const uint8_t*>(w.data());
  // Rows of up to 32 units (in <= 1024) take 8 lanes each, four rows a warp; longer ones a warp.
  const bool short_rows = in <= 1024;
  const dim3 grid(blocks_for(rows, kMaxWarps * (short_rows ? 4 : 1)), static_cast<unsigned>(most_chosen));
  return for_block_type(w.dtype(), [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    auto go = [&](auto kernel) {
      return cuda_status(launch_pdl(kernel, grid, dim3(kMaxWarps * 32), 0, st, wp, expert_bytes, rows, q, d, in, gshift,
                                    order, start, n_expert, first_expert, x_div, y, epilogue),
                         "expert_gemv_kernel");
    };
    if (pairs) return short_rows ? go(expert_gemv_kernel<T, 4, true, 8>) : go(expert_gemv_kernel<T, 4, true, 32>);
    return short_rows ? go(expert_gemv_kernel<T, 4, false, 8>) : go(expert_gemv_kernel<T, 4, false, 32>);
  });
}

Status round_bf16(cudaStream_t st, const float* x, int64_t n, __nv_bfloat16* y) {
  if (n == 0) return ok_status();
  return cuda_status(launch_pdl(convert_kernel<__nv_bfloat16>, dim3(blocks_for(n, 256)), dim3(256), 0, st, x, y, n),
                     "convert_kernel");
}

int expert_tile_bound(int64_t pairs, int held) {
  return static_cast<int>((pairs + kExpertTilePairs - 1) / kExpertTilePairs + std::min<int64_t>(held, pairs));
}

Status expert_tiles(cudaStream_t st, const int32_t* start, int n_expert, int64_t pairs, int held, void* tiles) {
  if (reinterpret_cast<uintptr_t>(tiles) % 16 != 0) return invalid_argument_error("cuda expert_tiles: tiles not 16-byte aligned");
  return cuda_status(launch_pdl(expert_tiles_kernel, dim3(1), dim3(32), 0, st, start, n_expert, static_cast<int4*>(tiles),
                                expert_tile_bound(pairs, held)),
                     "expert_tiles_kernel");
}

Status quant_mma_experts(cudaStream_t st, const Tensor& w, const __nv_bfloat16* x, int64_t pairs, const int32_t* order,
                         const void* tiles, int x_div, bool is_pairs, void* y, ExpertEpilogue epilogue, int first_expert) {
  COMBS_RETURN_IF_ERROR(check_expert_weight(w, is_pairs, "cuda quant_mma_experts"));
  const int64_t in = w.dim(2), rows = is_pairs ? w.dim(1) / 2 : w.dim(1);
  if (in % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) {
    return invalid_argument_error("cuda quant_mma_experts: x rows must start 16-byte aligned");
  }
  if (pairs == 0) return ok_status();
  const int held = static_cast<int>(w.dim(0));
  if (expert_tile_bound(pairs, held) > kMaxExpertTiles) {
    return invalid_argument_error("cuda quant_mma_experts: " + std::to_string(pairs) + " pairs (more tiles than a grid holds)");
  }
  const int64_t expert_bytes = static_cast<int64_t>(nbytes_for(w.dtype(), w.dim(1) * in));
  const int own = is_pairs ? kMmaRows / 2 : kMmaRows;
  const dim3 grid(blocks_for(rows, own), static_cast<unsigned>(expert_tile_bound(pairs, held)));
  const uint8_t* wp = static_cast<const uint8_t*>(w.data());
  const int4* list = static_cast<const int4*>(tiles);
  return for_block_type(w.dtype(), [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    auto go = [&](auto kernel, size_t smem) {
      return cuda_status(launch_pdl(kernel, grid, dim3(kMmaWarps * 32), smem, st, wp, expert_bytes, rows, x, in, order,
                                    list, first_expert, x_div, y, epilogue),
                         "expert_mma_kernel");
    };
    return is_pairs ? go(expert_mma_kernel<T, true>, expert_mma_smem<T, true>())
                    : go(expert_mma_kernel<T, false>, expert_mma_smem<T, false>());
  });
}

Status dequantize_rows_bf16(cudaStream_t st, const Tensor& w, int64_t row0, int64_t rows, __nv_bfloat16* out) {
  COMBS_RETURN_IF_ERROR(check_block_weight(w, "cuda dequantize_rows_bf16"));
  if (row0 < 0 || rows < 0 || row0 + rows > w.dim(0)) return invalid_argument_error("cuda dequantize_rows_bf16: rows out of range");
  if (rows == 0) return ok_status();
  const int64_t units = w.dim(1) / 32, row_bytes = static_cast<int64_t>(nbytes_for(w.dtype(), w.dim(1)));
  const uint8_t* base = static_cast<const uint8_t*>(w.data()) + row0 * row_bytes;
  return for_block_type(w.dtype(), [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    dequantize_kernel<T, __nv_bfloat16><<<blocks_for(rows * units, 256), 256, 0, st>>>(base, row_bytes, nullptr, units,
                                                                                       rows * units, out);
    return cuda_status(cudaGetLastError(), "dequantize_kernel");
  });
}

Status dequantize_rows_f32(cudaStream_t st, const Tensor& w, const int32_t* ids, int64_t n, float* out) {
  COMBS_RETURN_IF_ERROR(check_block_weight(w, "cuda dequantize_rows_f32"));
  if (n == 0) return ok_status();
  const int64_t units = w.dim(1) / 32, row_bytes = static_cast<int64_t>(nbytes_for(w.dtype(), w.dim(1)));
  return for_block_type(w.dtype(), [&](auto tag) -> Status {
    constexpr DType T = decltype(tag)::value;
    dequantize_kernel<T, float><<<blocks_for(n * units, 256), 256, 0, st>>>(static_cast<const uint8_t*>(w.data()), row_bytes,
                                                                            ids, units, n * units, out);
    return cuda_status(cudaGetLastError(), "dequantize_kernel");
  });
}

}  // namespace combs::cuda
