// quant_dot.h for AVX-512 VNNI (flags set in CMakeLists.txt). The block layouts are those of
// quant.cc (ggml's); each dot product sums, per super-block, exact int32 products of the stored
// quants with the 8-bit activations, then applies the block's float scales once.
#include "kernels/quant_dot.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "combs/backend/dtype.h"

// GCC 12's AVX-512 intrinsics fill lanes from _mm*_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive: every lane used here is written).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace combs::cpu::avx512vnni {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline int hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }

// 16 int32 lanes: four each of a[0], a[1], a[2], a[3].
inline __m512i four_each(int a0, int a1, int a2, int a3) {
  return _mm512_set_epi32(a3, a3, a3, a3, a2, a2, a2, a2, a1, a1, a1, a1, a0, a0, a0, a0);
}

}  // namespace

void quantize_act(const float* x, int64_t n, BlockQ8Act* out) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256, ++out) {
    float amax = 0.0f;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(x[i]));
    out->d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 16 * j; i < 16 * j + 16; ++i) {
        const int q = static_cast<int>(std::nearbyint(x[i] * inv));
        out->q[i] = static_cast<int8_t>(std::clamp(q, -127, 127));
        s += out->q[i];
      }
      out->sums[j] = static_cast<int16_t>(s);
    }
  }
}

// Q4_K (quant.cc): per super-block d, dmin, eight 6-bit (scale, min) pairs, 4-bit quants; each 64
// elements are 32 bytes whose low nibbles are group 2k and high nibbles group 2k + 1. A group's
// weights are d * sc * q - dmin * m: its dot product is d * sc * sum(q * a) - dmin * m * sum(a).
float dot_q4_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  float sum = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i, b += 144, ++x) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* s = b + 4;
    int sc[8], mn[8];
    for (int j = 0; j < 4; ++j) {
      sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
      sc[j + 4] = (s[j + 8] & 0xF) | (s[j] >> 6) << 4;
      mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
    int msum = 0;
    for (int g = 0; g < 8; ++g) msum += mn[g] * (x->sums[2 * g] + x->sums[2 * g + 1]);
    __m512i acc = _mm512_setzero_si512();
    const uint8_t* qs = b + 16;
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      const __m512i w = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
      const __m512i a = _mm512_loadu_si512(x->q + 64 * k);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);  // lanes 0-7: group 2k
      const __m512i scale = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set1_epi32(sc[2 * k])),
                                               _mm256_set1_epi32(sc[2 * k + 1]), 1);
      acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot, scale));
    }
    sum += x->d * (d * static_cast<float>(hsum(acc)) - dmin * static_cast<float>(msum));
  }
  return sum;
}

// Q6_K (quant.cc): per half of 128 elements 64 bytes of low nibbles and 32 of 2-bit high parts;
// element l + 32 s has nibble s / 2 of low byte l + 32 (s % 2) and bits 2s of high byte l, minus
// 32, scale sc[l / 16 + 2 s] of the half's eight. The dot product is d * sum_j sc_j * (sum(q_u * a)
// - 32 * sum(a)) over the sixteen 16-element groups j, q_u = q + 32 in [0, 63].
float dot_q6_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
  float sum = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i, b += 210, ++x) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    int corr = 0;
    for (int j = 0; j < 16; ++j) corr += sc[j] * x->sums[j];
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);  // [l] and [l + 32]
      const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i qh = _mm512_inserti64x4(_mm512_zextsi256_si512(qh256), qh256, 1);
      // s = 0 | 1: low nibbles, high bits 0-1 | 2-3; s = 2 | 3: high nibbles, bits 4-5 | 6-7.
      const __m512i hi01 = _mm512_and_si512(
          _mm512_mask_blend_epi64(0xF0, qh, _mm512_srli_epi16(qh, 2)), two);
      const __m512i hi23 = _mm512_and_si512(
          _mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(qh, 4), _mm512_srli_epi16(qh, 6)), two);
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(hi01, 4));
      const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(hi23, 4));
      const int8_t* s8 = sc + 8 * h;
      const __m512i d01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q01, _mm512_loadu_si512(x->q + 128 * h));
      const __m512i d23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q23, _mm512_loadu_si512(x->q + 128 * h + 64));
      acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(d01, four_each(s8[0], s8[1], s8[2], s8[3])));
      acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(d23, four_each(s8[4], s8[5], s8[6], s8[7])));
    }
    sum += x->d * d * static_cast<float>(hsum(acc) - 32 * corr);
  }
  return sum;
}

}  // namespace combs::cpu::avx512vnni
