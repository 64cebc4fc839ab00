// ggml's block-quantized weight formats, as GGUF files store them: for each ggml type id its name,
// block geometry, and (for the formats combs reads) a scalar dequantization of whole blocks.
//
// The block layouts are those of ggml's ggml-common.h (described in quant.cc beside each
// dequantizer). Dequantization is exact to the float32 operations ggml's reference
// dequantize_row_* performs, in the same order (quant.cc is compiled without FMA contraction), so
// it equals llama.cpp's and an independent NumPy reference bit for bit
// (tests/reference/dequant_ref.py). These are the reference and the fallback for every kernel
// that reads quantized weights.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "combs/backend/dtype.h"

namespace combs {

// Dequantizes `n_blocks` consecutive blocks at `blocks` into n_blocks * block_elems floats.
using DequantizeFn = void (*)(const void* blocks, float* out, int64_t n_blocks);

struct QuantFormat {
  DType dtype;            // combs' name for it
  uint32_t ggml_type;     // GGUF's tensor type id
  std::string_view name;  // ggml's name, e.g. "Q4_K"
  int block_elems;        // elements per block (32 or 256)
  int block_bytes;        // bytes per block
  DequantizeFn dequantize;
};

// Every block format combs dequantizes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, IQ4_NL, IQ4_XS, MXFP4.
const std::vector<QuantFormat>& quant_formats();

// The format of a ggml type id; nullptr when combs has none for it (F32/F16/BF16 are element
// types, not block formats; IQ1/IQ2/IQ3, TQ, NVFP4 and the removed repacked types are refused).
const QuantFormat* quant_format(uint32_t ggml_type);

// The format of a block type (is_block_quant(t)); nullptr for the element types.
const QuantFormat* quant_format(DType t);

// Quantizes n_blocks * block_elems floats at x into n_blocks blocks (src/backend/quantize.cc:
// round to nearest with a search of each block's scales; llama.cpp reads the blocks as its own).
using QuantizeFn = void (*)(const float* x, void* blocks, int64_t n_blocks);
// The writer of a block type; nullptr for the element types.
QuantizeFn quantizer(DType t);

// The (6-bit scale, 6-bit min) pair j (0..7) of a Q4_K/Q5_K super-block's 12 scale bytes q:
// pairs 0..3 are the low 6 bits of bytes j and j + 4; pairs 4..7 take their low 4 bits from byte
// j + 4's nibbles and their top 2 from the top bits of bytes j - 4 and j.
inline void k4_scale_min(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | (q[j - 4] >> 6) << 4;
    *mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
  }
}

// ggml's name of any type id it has defined ("IQ2_XXS", "Q4_0_4_4 (removed)", ...), for errors;
// "ggml type N" for an id it never defined.
std::string ggml_type_name(uint32_t ggml_type);

// Bytes of `elems` elements of a block format: elems must be a multiple of the block (a row that
// is not whole blocks is malformed); -1 when it is not, or when the size overflows int64.
int64_t quant_bytes(const QuantFormat& f, int64_t elems);

}  // namespace combs
