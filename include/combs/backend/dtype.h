// Element types of tensors, and the scalar conversions between them.
//
// f16 is IEEE 754 binary16; bf16 is the upper half of an IEEE binary32 (round to nearest even on
// the way down). Both are stored as uint16_t bit patterns. q8_0 (weights only) is llama.cpp's
// block format: blocks of 32 values, each an f16 scale d and 32 int8 q, value = d * q.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace combs {

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0 };

struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[32];
};
static_assert(sizeof(BlockQ8_0) == 34);

// Elements per block (32 for q8_0, else 1) and bytes per block.
constexpr int64_t dtype_block_elems(DType t) { return t == DType::kQ8_0 ? 32 : 1; }
constexpr size_t dtype_block_bytes(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kQ8_0 ? sizeof(BlockQ8_0) : 2;
}
// Bytes per element of an element type (not q8_0, whose elements come in blocks).
constexpr size_t dtype_size(DType t) { return dtype_block_bytes(t); }
// Bytes of `numel` elements; numel must be a multiple of the block size.
constexpr size_t nbytes_for(DType t, int64_t numel) {
  return static_cast<size_t>(numel / dtype_block_elems(t)) * dtype_block_bytes(t);
}
std::string_view dtype_name(DType t);  // "f32", "f16", "bf16", "q8_0"
// Parses "f32" / "f16" / "bf16" / "q8_0"; false on anything else.
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
