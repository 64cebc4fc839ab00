#include "combs/backend/dtype.h"

namespace combs {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kQ8_0: return "q8_0";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  if (name == "f32") *out = DType::kF32;
  else if (name == "f16") *out = DType::kF16;
  else if (name == "bf16") *out = DType::kBF16;
  else if (name == "q8_0") *out = DType::kQ8_0;
  else return false;
  return true;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {
    // Subnormal or zero in f16: add 0.5 so that the FPU's round-to-nearest-even does the work.
    float a;
    std::memcpy(&a, &ax, sizeof a);
    a += 0.5f;
    uint32_t r;
    std::memcpy(&r, &a, sizeof r);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to even.
  const uint32_t mant_odd = (ax >> 13) & 1u;
  uint32_t r = ax + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace combs
