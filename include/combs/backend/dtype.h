// Element types of tensors, and the scalar conversions between them.
//
// f16 is IEEE 754 binary16; bf16 is the upper half of an IEEE binary32 (round to nearest even on
// the way down). Both are stored as uint16_t bit patterns. The block types (weights only) are
// llama.cpp's block-quantized formats (combs/backend/quant.h): q8_0, blocks of 32 values, each an
// f16 scale d and 32 int8 q, value = d * q; the legacy q4_0..q5_1, the K-quants q2_k..q6_k (256
// values a block), iq4_nl, iq4_xs and mxfp4.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace combs {

enum class DType : uint8_t {
  kF32, kF16, kBF16,
  // Block types from here on (is_block_quant).
  kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kMXFP4,
};

struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[32];
};
static_assert(sizeof(BlockQ8_0) == 34);

constexpr bool is_block_quant(DType t) { return t >= DType::kQ8_0; }

// Elements per block (1 for the element types) and bytes per block.
constexpr int64_t dtype_block_elems(DType t) {
  switch (t) {
    case DType::kF32: case DType::kF16: case DType::kBF16: return 1;
    case DType::kQ2_K: case DType::kQ3_K: case DType::kQ4_K: case DType::kQ5_K: case DType::kQ6_K:
    case DType::kIQ4_XS: return 256;
    default: return 32;
  }
}
constexpr size_t dtype_block_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kQ8_0: return sizeof(BlockQ8_0);
    case DType::kQ4_0: case DType::kIQ4_NL: return 18;
    case DType::kQ4_1: return 20;
    case DType::kQ5_0: return 22;
    case DType::kQ5_1: return 24;
    case DType::kQ2_K: return 84;
    case DType::kQ3_K: return 110;
    case DType::kQ4_K: return 144;
    case DType::kQ5_K: return 176;
    case DType::kQ6_K: return 210;
    case DType::kIQ4_XS: return 136;
    case DType::kMXFP4: return 17;
  }
  return 0;
}
// Bytes per element of an element type (not of the block types, whose elements come in blocks).
constexpr size_t dtype_size(DType t) { return dtype_block_bytes(t); }
// Bytes of `numel` elements; numel must be a multiple of the block size.
constexpr size_t nbytes_for(DType t, int64_t numel) {
  return static_cast<size_t>(numel / dtype_block_elems(t)) * dtype_block_bytes(t);
}
// The types combs can write (cpu::quantize_row, combs-mkmodel): every one (the block types by
// src/backend/quantize.cc).
constexpr bool can_quantize(DType t) { return t <= DType::kMXFP4; }
std::string_view dtype_name(DType t);  // "f32", "f16", "bf16", "q8_0", "q4_k", "iq4_xs", ...
// Parses dtype_name's names; false on anything else.
bool parse_dtype(std::string_view name, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// Branch-free, so loops over it vectorize.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Shift exponent+mantissa into place and rebias by multiplying with 2^112; this also handles
  // subnormals. Inf/NaN (exponent 31) get the exponent forced to 255.
  uint32_t bits = em << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f *= 5.192296858534828e+33f;  // 2^112
  std::memcpy(&bits, &f, sizeof bits);
  if (em >= 0x7c00u) bits |= 0x7f800000u;
  bits |= sign;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t f32_to_f16(float f);  // round to nearest even; overflow to inf

}  // namespace combs
