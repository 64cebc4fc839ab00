// scale_search.h for AVX-512: sixteen candidate scales a vector, the values in order.
#include "scale_search.h"

// (GCC 12 warns of maybe-uninitialized vectors inside avx512fintrin.h's roundscale and conversions:
// its own headers' undefined pass-through operands, not this file's.)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

namespace combs::cpu::avx512 {

namespace {

// nearest(v, lo, hi) of each lane: clamp to lo - 1 .. hi + 1, add 0.49999997 with the value's sign,
// truncate, clamp to lo .. hi; NaN the level nearest 0.
__m512i nearest16(__m512 v, int lo, int hi) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(static_cast<float>(lo) - 1.0f)),
                                 _mm512_set1_ps(static_cast<float>(hi) + 1.0f));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i half = _mm512_castps_si512(_mm512_set1_ps(0.49999997f));
  const __m512 h = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(c), sign), half));
  const __m512 t = _mm512_roundscale_ps(_mm512_add_ps(c, h), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(t), _mm512_set1_epi32(lo)), _mm512_set1_epi32(hi));
  return _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(std::clamp(0, lo, hi)));
}

}  // namespace

void levels(const float* x, int n, float off, float d, int lo, int hi, int* q) {
  const __m512 offv = _mm512_set1_ps(off), dv = _mm512_set1_ps(d);
  for (int i = 0; i < n; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_add_ps(_mm512_loadu_ps(x + i), offv), dv);
    _mm512_storeu_si512(q + i, nearest16(v, lo, hi));
  }
}

void scale_errors(const float* x, int n, int lo, int hi, const float* d, int count, double* e) {
  for (int j0 = 0; j0 < count; j0 += 16) {
    const int lanes = std::min(16, count - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 dv = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), live, d + j0);
    __m512d e_lo = _mm512_setzero_pd(), e_hi = _mm512_setzero_pd();
    for (int i = 0; i < n; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i]);
      const __m512i q = nearest16(_mm512_div_ps(xv, dv), lo, hi);
      const __m512 r = _mm512_sub_ps(xv, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q)));
      const __m512d r_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
      const __m512d r_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
      e_lo = _mm512_add_pd(e_lo, _mm512_mul_pd(r_lo, r_lo));
      e_hi = _mm512_add_pd(e_hi, _mm512_mul_pd(r_hi, r_hi));
    }
    alignas(64) double out[16];
    _mm512_store_pd(out, e_lo);
    _mm512_store_pd(out + 8, e_hi);
    std::copy(out, out + lanes, e + j0);
  }
}

}  // namespace combs::cpu::avx512
