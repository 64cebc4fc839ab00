#include "combs/backend/dtype.h"

#include <utility>

namespace combs {

namespace {
constexpr std::pair<DType, std::string_view> kNames[] = {
    {DType::kF32, "f32"},     {DType::kF16, "f16"},     {DType::kBF16, "bf16"},     {DType::kQ8_0, "q8_0"},
    {DType::kQ4_0, "q4_0"},   {DType::kQ4_1, "q4_1"},   {DType::kQ5_0, "q5_0"},     {DType::kQ5_1, "q5_1"},
    {DType::kQ2_K, "q2_k"},   {DType::kQ3_K, "q3_k"},   {DType::kQ4_K, "q4_k"},     {DType::kQ5_K, "q5_k"},
    {DType::kQ6_K, "q6_k"},   {DType::kIQ4_NL, "iq4_nl"}, {DType::kIQ4_XS, "iq4_xs"}, {DType::kMXFP4, "mxfp4"},
};
}  // namespace

std::string_view dtype_name(DType t) {
  for (const auto& [d, name] : kNames) {
    if (d == t) return name;
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  for (const auto& [d, n] : kNames) {
    if (n == name) return *out = d, true;
  }
  return false;
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
