// Block-quantized rows straight to BF16 with AVX-512 (dequant_bf16.h): the values quant.cc's
// dequantizers compute, in the same order (this file, like quant.cc, is compiled without FMA
// contraction), rounded as f32_to_bf16_row rounds them (nearest even; NaN stays NaN).
#include "dequant_bf16.h"

#include <immintrin.h>

#include <cstring>

#include "combs/backend/quant.h"

namespace combs::cpu::avx512 {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 floats to BF16: nearest even, a NaN kept quiet (its top bits with bit 6 set), as
// f32_to_bf16_row.
inline void store_bf16(uint16_t* y, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i top = _mm512_srli_epi32(b, 16);
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, top, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(r));
}

// The 16 bytes at b (levels, unsigned or signed) as floats.
inline __m512 u8_to_f32(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m512 i8_to_f32(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }

// 32 levels (q) of a group: d * q - m, to y.
inline void group_dm(uint16_t* y, __m256i q, float d, float m) {
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  store_bf16(y, _mm512_sub_ps(_mm512_mul_ps(vd, u8_to_f32(_mm256_castsi256_si128(q))), vm));
  store_bf16(y + 16, _mm512_sub_ps(_mm512_mul_ps(vd, u8_to_f32(_mm256_extracti128_si256(q, 1))), vm));
}

template <bool kFifthBit>
void k45_bf16(const void* src, uint16_t* y, int64_t nb) {
  constexpr int kBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  const uint8_t* b = static_cast<const uint8_t*>(src);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i, b += kBytes) {
    const float d = f16(b), dmin = f16(b + 2);
    [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int j = 0; j < 8; j += 2, y += 64) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQuants + 16 * j));
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kFifthBit) {  // bit j (j + 1) of byte l: 16 more for element l of group j (j + 1)
        const __m256i bj = _mm256_set1_epi8(static_cast<char>(1 << j)), bj1 = _mm256_set1_epi8(static_cast<char>(2 << j));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bj), bj), _mm256_set1_epi8(16)));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bj1), bj1), _mm256_set1_epi8(16)));
      }
      int sc, mn;
      k4_scale_min(j, b + 4, &sc, &mn);
      group_dm(y, lo, d * static_cast<float>(sc), dmin * static_cast<float>(mn));
      k4_scale_min(j + 1, b + 4, &sc, &mn);
      group_dm(y + 32, hi, d * static_cast<float>(sc), dmin * static_cast<float>(mn));
    }
  }
}

}  // namespace

void dequant_bf16_q4_k(const void* src, uint16_t* y, int64_t nb) { k45_bf16<false>(src, y, nb); }
void dequant_bf16_q5_k(const void* src, uint16_t* y, int64_t nb) { k45_bf16<true>(src, y, nb); }

// Q6_K: element 32 s + l (s = 0..3) of each 128 is (ql's nibble | qh's 2 bits << 4) - 32, times
// d * scale, as quant.cc's dq_q6_k ((d * scale) * q).
void dequant_bf16_q6_k(const void* src, uint16_t* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; ++half, y += 128, sc += 8) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
      const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
      for (int s = 0; s < 4; ++s) {
        const __m256i h = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), two);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[s], _mm256_slli_epi16(h, 4)), off);
        for (int k = 0; k < 2; ++k) {  // elements l = 16 k .. 16 k + 15: scale l / 16 + 2 s
          const __m512 ds = _mm512_set1_ps(d * static_cast<float>(sc[k + 2 * s]));
          const __m128i qk = k == 0 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
          store_bf16(y + 32 * s + 16 * k, _mm512_mul_ps(ds, i8_to_f32(qk)));
        }
      }
    }
  }
}

// Q8_0: 32 int8 times the f16 d, as quant.cc's dq_q8_0 (q * d).
void dequant_bf16_q8_0(const void* src, uint16_t* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 34, y += 32) {
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    store_bf16(y, _mm512_mul_ps(i8_to_f32(q0), d));
    store_bf16(y + 16, _mm512_mul_ps(i8_to_f32(q1), d));
  }
}

}  // namespace combs::cpu::avx512
