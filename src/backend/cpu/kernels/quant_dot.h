// Dot products of block-quantized weight rows with activations rounded to 8 bits, for decoding:
// a row is read once, its blocks widened in registers and multiplied by int8 dot products (AVX-512
// VNNI, or AVX2), as llama.cpp does. Internal to the CPU backend; cpu_ops.cc picks them where the CPU has
// the instructions, else dequantizes rows (quant.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace combs::cpu {

// 256 activations rounded to 8 bits: value = d * q, d = max|x| / 127, and the sums of each 16 q
// (for the formats' offsets and minimums).
struct BlockQ8Act {
  float d;
  int8_t q[256];
  int16_t sums[16];
};

// The same kernels for AVX-512 (VNNI machines) and for AVX2 (+ FMA, F16C), picked at run time.
namespace avx512vnni {
// x[0, n) (n a multiple of 256) as n / 256 blocks: d = max|x| / 127, q = nearest(x * (127 / max)).
void quantize_act(const float* x, int64_t n, BlockQ8Act* out);
// One row of n / 256 Q4_K (Q5_K, Q6_K, IQ4_XS) super-blocks against n / 256 activation blocks.
// dot_q4_k and dot_q5_k take the activations arranged by arrange_act_k4 (in place: in each 128,
// the 32 of group 1 and of group 2 swapped), the others as quantize_act writes them.
void arrange_act_k4(BlockQ8Act* x, int64_t n_blocks);
float dot_q4_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_q5_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_q6_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_iq4_xs(const void* row, const BlockQ8Act* x, int64_t n_blocks);
// Four rows (row, row + row_bytes, ...) against the same activations: out[i] is, bit for bit, what
// dot_q*_k / dot_iq4_xs gives row i (and what quant_gemm.h's products give), for a quarter of the
// reductions.
void dot4_q4_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]);
void dot4_q5_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]);
void dot4_q6_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]);
void dot4_iq4_xs(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]);
// Q8_0, rows of whole 256s (n32 a multiple of 8), with quant_gemm.h's float steps (per block of
// 32) where dot_q8_0 rounds per pair of blocks: not dot_q8_0's numbers. row_bytes 0: one row.
void dot4_q8_0(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n32, float out[4]);
// MXFP4 and IQ4_NL: n32 blocks of 32, as the AVX2 kernels below take them (two blocks per vpdpbusd).
float dot_mxfp4(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_iq4_nl(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_q8_0(const void* row, const BlockQ8Act* x, int64_t n32);
}  // namespace avx512vnni
namespace avx2 {
void quantize_act(const float* x, int64_t n, BlockQ8Act* out);
float dot_q4_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_q5_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_q6_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_iq4_xs(const void* row, const BlockQ8Act* x, int64_t n_blocks);
// The 32-element formats, for both instruction sets: n32 weight blocks of 32 against the first
// 32 n32 activations of x (ceil(n32 / 8) blocks of 256; a row need not be whole 256s).
float dot_q4_0(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_q4_1(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_q5_0(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_q5_1(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_iq4_nl(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_mxfp4(const void* row, const BlockQ8Act* x, int64_t n32);
float dot_q8_0(const void* row, const BlockQ8Act* x, int64_t n32);
// Q2_K and Q3_K, for both instruction sets too.
float dot_q2_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
float dot_q3_k(const void* row, const BlockQ8Act* x, int64_t n_blocks);
}  // namespace avx2

}  // namespace combs::cpu
