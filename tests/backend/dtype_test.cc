// f16 and bf16 conversions against exact values and the float64 definition of rounding.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "combs/backend/dtype.h"
#include "support/random.h"

using namespace combs;

TEST_CASE("f16 conversion is exact on representable values and rounds to nearest", "[kv]") {
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0xc000) == -2.0f);
  CHECK(f16_to_f32(0x7bff) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(std::isinf(f16_to_f32(0x7c00)));
  CHECK(std::isnan(f16_to_f32(0x7e00)));
  CHECK(f32_to_f16(1.0f) == 0x3c00);
  CHECK(f32_to_f16(65504.0f) == 0x7bff);
  CHECK(f32_to_f16(1e6f) == 0x7c00);
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie -> even
  // Every f16 round-trips.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    REQUIRE(f32_to_f16(f16_to_f32(uint16_t(h))) == h);
  }
  testing::Rng rng(testing::test_seed());
  INFO("seed " << rng.seed());
  for (int i = 0; i < 10000; ++i) {
    const float x = rng.uniform(-70000, 70000) * std::pow(10.0f, float(rng.integer(-8, 0)));
    const float y = f16_to_f32(f32_to_f16(x));
    if (std::abs(x) < 65504) REQUIRE(std::abs(double(y) - x) <= std::abs(double(x)) * 4.9e-4 + 3e-8);
  }
}

TEST_CASE("bf16 conversion truncates the mantissa with round to nearest even", "[kv]") {
  CHECK(bf16_to_f32(0x3f80) == 1.0f);
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  CHECK(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);  // tie -> even
  CHECK(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  testing::Rng rng(testing::test_seed());
  INFO("seed " << rng.seed());
  for (int i = 0; i < 10000; ++i) {
    const float x = rng.uniform(-1e4f, 1e4f);
    REQUIRE(std::abs(double(bf16_to_f32(f32_to_bf16(x))) - x) <= std::abs(double(x)) * 3.91e-3);
  }
}
