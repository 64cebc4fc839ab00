// Block-quantized weights on the GPU (ggml's formats, combs/backend/quant.h): the weights stay in
// their blocks in device memory and are widened only in registers (decode), in shared memory
// (batches up to 64 rows) or in a bounded scratch tile (larger batches). Private to the CUDA
// backend: cuda_ops.cu's matmuls and embedding call these for every block type.
//
// Decode (n <= kQuantGemvMaxRows rows of x): x is first rounded to 8 bits (quantize_activations),
// as the CPU's int8 kernels round it (combs/backend/cpu/kernels/quant_dot.h: d = max|x| / 127 per
// group of 256, or of 32 where the row is not whole groups of 256), then each warp reads one weight
// row's blocks once and sums int8 products (dp4a) per 16 weights, scaled by the blocks' scales:
// the bandwidth of the quantized bytes, and the CPU's rounding of x. Q4_K (from 4 rows) and Q6_K
// (from 3) on int8 tensor cores with the rows of x as the mma's n side.
// Batches up to kQuantMmaMaxRows: for the super-block formats (Q2_K-Q6_K, IQ4_XS: quant_imma) x
// rounded to 8 bits as decode rounds it and int8 tensor cores on the blocks' integer levels and
// scales (exact integer sums, one float step a block); for the others (quant_mma) x rounded to
// BF16, the blocks widened to BF16 in shared memory a chunk at a time (exactly, as quant.cc does)
// and multiplied on tensor cores. Either way the weights are read once, as decode reads them
// (cuda_ops.cu routes 33-64 rows of short weight rows of the other formats to the tiles, which
// were faster there).
// Larger batches (prefill): rows of the weights dequantized to BF16 in a scratch tile of at most
// kQuantTileBytes, one cuBLAS GEMM per tile.
// A mixture's experts: decode-sized steps as decode (quant_gemv_experts), larger ones as quant_mma
// over each expert's pairs, 64 at a time (quant_mma_experts).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "combs/base/status.h"
#include "combs/backend/tensor.h"
#include "gemv_out.h"

namespace combs::cuda {

constexpr int kQuantGemvMaxRows = 8;
constexpr int kQuantMmaMaxRows = 64;
constexpr size_t kQuantTileBytes = size_t{64} << 20;

// The activations' group: 256 where `in` is whole groups of 256, else 32 (every block row is whole
// groups of 32).
inline int64_t activation_group(int64_t in) { return in % 256 == 0 ? 256 : 32; }

// Where quantize_activations' float scales start: after the n * in int8 values, 16-byte aligned.
inline size_t activation_scales_offset(int64_t n, int64_t in) { return static_cast<size_t>((n * in + 15) / 16 * 16); }
// Where the unit sums start (groups of 256 only), after the scales, 16-byte aligned: per row and
// group of 256, 16 bytes — the sums of its eight units of 32 int8 values, each as 128 hi + lo with
// lo (0..127) in bytes 0-7 and hi (-32..31) in bytes 8-15, both int8: the 8-bit batch kernel's
// products of the formats' offsets take them as int8 operands (as llama.cpp's q8_1 blocks carry
// their sums).
inline size_t activation_sums_offset(int64_t n, int64_t in) {
  return (activation_scales_offset(n, in) + static_cast<size_t>(n * (in / activation_group(in))) * 4 + 15) / 16 * 16;
}
// Bytes quantize_activations writes for n rows of in: the int8 values, one float per group, and
// for groups of 256 the unit sums.
inline size_t activation_bytes(int64_t n, int64_t in) {
  return activation_sums_offset(n, in) + (activation_group(in) == 256 ? static_cast<size_t>(n * (in / 256)) * 16 : 0);
}

// Unit u's sum s (|s| <= 32 x 127) into its group's 16 bytes of activation_sums_offset: lo =
// s & 127 at byte u, hi = s >> 7 at byte 8 + u (s = 128 hi + lo).
__host__ __device__ inline void store_unit_sum(int8_t* group_sums, int u, int s) {
  group_sums[u] = static_cast<int8_t>(s & 127);
  group_sums[8 + u] = static_cast<int8_t>(s >> 7);
}

// x [n, in] f32 -> xq (activation_bytes(n, in)): int8 values [n, in], then float scales
// [n, in / group] (16-byte aligned), then for groups of 256 the unit sums (activation_sums_offset).
// norm_w: RMS-normalize each row first (eps), as add_rms_norm. up (norm_w null): x is a gate, and
// silu(x) * up [n, in] is rounded (the floats of silu_mul; the down projection's input).
Status quantize_activations(cudaStream_t st, const float* x, int64_t n, int64_t in, const float* norm_w, float eps,
                            void* xq, const float* up = nullptr);

// outs (+)= w x for w a block-quantized device tensor [rows, in] and xq from quantize_activations,
// n <= kQuantGemvMaxRows. pairs: w holds gate rows then up rows; y[0] [n, rows / 2] =
// silu(gate) * up in f32.
Status quant_gemv(cudaStream_t st, const Tensor& w, const void* xq, int n, const GemvOut& outs, bool pairs);
// The fewest rows of x for which quant_gemv takes a tensor-core kernel (Q4_K, Q6_K: rows of x as
// an int8 mma's n side; Q6_K's where a row is an even number of blocks), kQuantGemvMaxRows + 1
// where t has none.
int quant_gemv_mma_min_rows(DType t);

// outs (+)= w x for w a block-quantized device tensor [rows, in] and xs [n, in] BF16 (x rounded),
// n <= kQuantMmaMaxRows: the products of the BF16 dequantized weights with xs, summed in f32.
// scratch: quant_mma_scratch_bytes(w, n) of device memory, zero-filled before its first use (the
// kernel leaves its counters at zero).
size_t quant_mma_scratch_bytes(const Tensor& w, int n);
Status quant_mma(cudaStream_t st, const Tensor& w, const __nv_bfloat16* xs, int n, const GemvOut& outs, void* scratch);

// outs (+)= w x for w of a super-block format (quant_imma_takes: Q2_K-Q6_K, IQ4_XS) [rows, in] and
// xq from quantize_activations (x rounded to 8 bits per 256, as decode rounds it), n <=
// kQuantMmaMaxRows: int8 tensor cores on the blocks' levels, the integer sums exact, scaled once a
// block. scratch: quant_imma_scratch_bytes(w, n), as quant_mma's.
bool quant_imma_takes(DType t);
size_t quant_imma_scratch_bytes(const Tensor& w, int n);
Status quant_imma(cudaStream_t st, const Tensor& w, const void* xq, int n, const GemvOut& outs, void* scratch);

// The chosen experts' products for a mixture of experts: w [n_expert, out, in] (block type) on the
// device, xq quantize_activations' x_rows rows; the (token, slot) pairs grouped by expert (order:
// pair ids, expert e's at order[start[e] .. start[e + 1]); start[n_expert + 1] experts chosen,
// their ids from start[n_expert + 2] on: blocks go to those only); pair p takes x row p / x_div and
// writes y [pairs, out] row p. pairs: each expert's rows are its gate rows then its up rows, and
// y row p = silu(gate) * up [out / 2]. Every expert's weights read once per 4 of its pairs.
// epilogue: each expert's bias [n_expert, out] added to its products (before the activation), and
// gpt-oss's clamped SwiGLU instead of silu(gate) * up where limit > 0.
// experts: the experts routed (start's n_expert; 0: w's count) and w's first of them (a
// tensor-parallel rank's share; only its experts are among start's chosen).
struct ExpertEpilogue {
  const float* bias = nullptr;
  float alpha = 0.0f, limit = 0.0f;
};
Status quant_gemv_experts(cudaStream_t st, const Tensor& w, const void* xq, int64_t x_rows,
                          const int32_t* order, const int32_t* start, int x_div, bool pairs,
                          float* y, ExpertEpilogue epilogue = {}, int experts = 0, int first_expert = 0);

// The chosen experts' products of a batched step (prefill, many sessions) on tensor cores: as
// quant_gemv_experts, with x [.., in] rounded to BF16 (round_bf16; pair p takes row p / x_div) and
// the blocks widened to BF16 in shared memory as quant_mma widens them; each tile of up to 64 of an
// expert's pairs reads that expert's weights once. tiles: expert_tiles' list for these pairs
// (made once a routing, for both products). is_pairs: y [pairs, out / 2] BF16 = silu(gate) * up
// (or the epilogue's clamped SwiGLU), the down product's x; else y [pairs, out] f32.
// The list holds at most expert_tile_bound(pairs, held) tiles: a tile for every 64 pairs and one
// more for each expert chosen (held: the experts w holds).
// (At most kMaxExpertTiles: a grid's rows.)
constexpr int kMaxExpertTiles = 65535;
int expert_tile_bound(int64_t pairs, int held);
Status expert_tiles(cudaStream_t st, const int32_t* start, int n_expert, int64_t pairs, int held, void* tiles);
Status quant_mma_experts(cudaStream_t st, const Tensor& w, const __nv_bfloat16* x, int64_t pairs, const int32_t* order,
                         const void* tiles, int x_div, bool is_pairs, void* y, ExpertEpilogue epilogue = {},
                         int first_expert = 0);
// y [n] = x [n] rounded to BF16 (nearest even).
Status round_bf16(cudaStream_t st, const float* x, int64_t n, __nv_bfloat16* y);

// out [rows, in] = rows [row0, row0 + rows) of w dequantized to BF16.
Status dequantize_rows_bf16(cudaStream_t st, const Tensor& w, int64_t row0, int64_t rows, __nv_bfloat16* out);

// out [n, in] = the rows ids[0..n) of w dequantized to f32, equal to quant.cc's values (an
// embedding table).
Status dequantize_rows_f32(cudaStream_t st, const Tensor& w, const int32_t* ids, int64_t n, float* out);

}  // namespace combs::cuda
