// Products of block-quantized weights with many tokens (prompt processing) by int8 dot products,
// AVX-512 VNNI: the weights' quants multiply 8-bit activations with vpdpbusd, 64 products an
// instruction, where the BF16 route (dequantize to BF16, oneDNN) does 32. Internal to the CPU
// backend; cpu_ops.cc uses them for prefill (MatmulPolicy::kFastest) of the types below.
//
// Layout: a zmm holds 16 tokens (lanes), each lane 4 consecutive elements of the row; a row's 4
// quants are broadcast to every lane. So the activations are transposed once per call (ActTile),
// and the weight rows are only unpacked to one byte per quant (PackedBlock), never transposed:
// each vpdpbusd multiplies one row with 16 tokens. vpdpbusd takes unsigned bytes on the vector
// side, so the activations are stored plus 128 and the weights' sums times 128 start every group's
// sum (corr): integer sums stay exact. The float scales apply once per group (Q8_0) or once per
// super-block (the K-quants, whose group scales are integers applied by vpmulld).
//
// Each output is one token's lane through the same instructions whatever the other tokens are:
// the product is batch-invariant in itself. It also equals the AVX-512 VNNI decode kernels'
// (quant_dot.h) bit for bit: both sum exactly in integers first, then take the same float steps —
// per super-block acc += I * (xd d) and acc -= M * (xd dmin) for Q4_K and Q5_K, acc += (I - M) *
// (xd d) for Q6_K, acc += I * (xd d) for IQ4_XS; per block of 32 acc += S * (xd d) for Q8_0 (its
// decode kernel dot4_q8_0, for rows of whole 256s). So prefill and decode give a token the same
// numbers, and the runner's batch-invariant policy uses these products too (gemm_matches_decode).
#pragma once

#include <cstdint>

#include "combs/backend/dtype.h"
#include "kernels/quant_dot.h"

namespace combs::cpu::avx512vnni {

// 256 elements of one weight row, unpacked. K-quants: value = d * sc[g] * q - dmin * m, where the
// minimum part m of 16-element subgroup j is mm's int16 j (pairs packed per int32 as the
// activations' sums); Q6_K's -32 offset is its minimum part (m = 32 sc, dmin = d); IQ4_XS has
// none (its levels are the quants, signed). Q8_0: value =
// dg[b] * q for 32-element block b.
struct PackedBlock {
  int8_t q[256];     // quants: 0..63 for the K-quants, signed for IQ4_XS and Q8_0
  int32_t corr[16];  // -128 * (sum of the group's quants): the start of its sum
  int32_t sc[16];    // integer scale of each group (K-quants)
  int32_t mm[8];     // int16 pairs: minimum parts of subgroups 2p and 2p + 1 (K-quants)
  float d, dmin;     // K-quants
  float dg[8];       // Q8_0: the scale of each block of 32
};

// 16 tokens' activations of one 256-element block, transposed: q[k][lane] holds the 4 elements
// 4k..4k+3 of token `lane`, each plus 128; sums[p][lane] the int16 pair of that token's sums of
// elements 32p..32p+15 and 32p+16..32p+31 (BlockQ8Act::sums); d[lane] its scale. Lanes past the
// last token are zeros.
struct ActTile {
  uint32_t q[64][16];
  int32_t sums[8][16];
  float d[16];
};

// The types these kernels take (whole super-blocks of 256 per row).
bool gemm_supports(DType t);
// The types whose products equal the AVX-512 VNNI decode kernels' bit for bit.
bool gemm_matches_decode(DType t);
// n_rows rows (rows of row_bytes, k elements, k a multiple of 256) unpacked into out[n_rows][k /
// 256].
void pack_rows(DType t, const void* rows, size_t row_bytes, int64_t n_rows, int64_t k,
               PackedBlock* out);
// Tokens [16 * tile, 16 * tile + 16) of x (n_tokens tokens of nb blocks each, as quantize_act
// writes them) into out[nb]: one tile of 16.
void pack_act_tile(const BlockQ8Act* x, int64_t n_tokens, int64_t nb, int64_t tile, ActTile* out);
// y[t * ldy + r] = (row r) . (token t) (+ bias[r]) for rows [0, n_rows) of w (packed, n_rows a
// multiple of 4) and the tokens of tiles [0, n_tiles) below n_tokens; nb blocks of 256 per row.
void gemm(DType t, const PackedBlock* w, int64_t n_rows, const ActTile* x, int64_t n_tiles,
          int64_t n_tokens, int64_t nb, float* y, int64_t ldy, const float* bias);

}  // namespace combs::cpu::avx512vnni
