// quant_dot.h for AVX-512 VNNI (flags set in CMakeLists.txt). The block layouts are those of
// quant.cc (ggml's); each dot product sums, per super-block, exact int32 products of the stored
// quants with the 8-bit activations, then applies the block's float scales once.
#include "kernels/quant_dot_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "combs/backend/dtype.h"

// GCC 12's AVX-512 intrinsics fill lanes from _mm*_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive: every lane used here is written).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace combs::cpu::avx512vnni {
namespace {

// For the kernels whose 64 elements k (k = 0..3) are groups 2k and 2k + 1 of 32: permutexvar
// indices giving int16 lanes 0-15 scale 2k and lanes 16-31 scale 2k + 1 of eight int16 scales.
inline void group_pair_indices(__m512i pick[4]) {
  for (int k = 0; k < 4; ++k) {
    pick[k] = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * k))),
                                 _mm256_set1_epi16(static_cast<short>(2 * k + 1)), 1);
  }
}

}  // namespace

// quantize_act_blocks (quant_dot_isa.h) 16 at a time, the same values: the same max, product and
// clamp, and vcvtps2dq rounds to nearest even as nearbyint does in the default rounding mode.
// Prefill rounds every token's activations before each product (~7% of a prompt's time scalar).
void quantize_act(const float* x, int64_t n, BlockQ8Act* out) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < n / 256; ++b, x += 256, ++out) {
    __m512 m = _mm512_setzero_ps();
    // |x| first: vmaxps returns its second operand where one is NaN, as std::max skips a NaN |x|
    for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
    const float amax = _mm512_reduce_max_ps(m);
    out->d = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int j = 0; j < 16; ++j) {
      const __m512i q = _mm512_min_epi32(
          _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), inv)), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out->q + 16 * j), _mm512_cvtepi32_epi8(q));
      out->sums[j] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
  }
}

// Q4_K (quant.cc): per super-block d, dmin, eight 6-bit (scale, min) pairs, 4-bit quants; each 64
// elements are 32 bytes whose low nibbles are group 2k and high nibbles group 2k + 1. A group's
// weights are d * sc * q - dmin * m: its dot product is d * sc * sum(q * a) - dmin * m * sum(a).
// 64 bytes of quants at a time: their low nibbles are groups 4j and 4j + 2, their high nibbles
// 4j + 1 and 4j + 3, which is why these kernels take the activations arranged by arrange_act_k4
// (each 128 in the order of those groups: two loads, no shuffle, per 128 elements). vpmaddubsw
// (pairs of q * a, in int16: at most 2 * 15 * 127), then vpdpwssd by the groups' scales (int32),
// summed over the super-block; the scales and mins unpacked from their 12 bytes in one register.
// Int32 sums are exact; a super-block's floats are one multiply-add. Q5_K is Q4_K with 32 bytes
// of fifth bits between the scales and the quants: element l of group g adds 16 where bit g of
// byte l is set (quant.cc); one template reads both.
void arrange_act_k4(BlockQ8Act* x, int64_t n_blocks) {
  for (int64_t i = 0; i < n_blocks; ++i) {
    for (int j = 0; j < 2; ++j) {  // swap the 32 activations of groups 4j + 1 and 4j + 2
      int8_t* q = x[i].q + 128 * j;
      const __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
      const __m256i g2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), g2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64), g1);
    }
  }
}

namespace {
// A super-block's exact integer totals (before any float): isum's lanes add up to I = sum_g sc_g
// * sum(q * a) over its groups, msum's to M = sum_g m_g * (sums[2g] + sums[2g + 1]); d2 = (xd d,
// xd dmin). quant_gemm.h's float steps follow: acc += I * (xd d), acc -= M * (xd dmin).
struct K4Block {
  __m512i isum;
  __m256i msum;
  __m128 d2;
};
template <bool kFifthBit>
struct K4 {
  static constexpr int kBlockBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  // int16 lanes 0-15 take group a's scale, 16-31 group b's: (a, b) = (4j, 4j + 2) for the low
  // nibbles of quants 64j.., (4j + 1, 4j + 3) for the high ones.
  __m512i pick[4];
  // int16 lanes 2g and 2g + 1 take min g (lanes 8-15 of the unpacked scales and mins).
  __m256i min_pairs = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  __m128i m6 = _mm_set1_epi32(0x3f3f3f3f), m4 = _mm_set1_epi32(0x0f0f0f0f), m2 = _mm_set1_epi32(0x03030303);
  __m128i u2_shift = _mm_setr_epi32(0, 4, 0, 0);
  K4() {
    for (int c = 0; c < 4; ++c) {
      const int a = 4 * (c / 2) + c % 2;
      pick[c] = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set1_epi16(static_cast<short>(a))),
                                   _mm256_set1_epi16(static_cast<short>(a + 2)), 1);
    }
  }
  // ahead: where the stream is read next, kBlockBytes of it requested now.
  K4Block block(const uint8_t* b, const BlockQ8Act* x, const uint8_t* ahead) const {
    prefetch(ahead, kBlockBytes);
    // d and dmin times the activations' scale
    uint32_t dd;
    std::memcpy(&dd, b, 4);
    const __m128 d2 = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd))), _mm_set1_ps(x->d));
    // 32-bit words u0 u1 u2 (the layout of quant.h's k4_scale_min): scales 0-3 = u0 & 0x3f..,
    // mins 0-3 = u1 & 0x3f..; scales 4-7 = u2 & 0x0f.. | (u0 >> 6 & 0x03..) << 4, mins 4-7 the same
    // of u2 >> 4 and u1.
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i lo = _mm_and_si128(u, m6);
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, 0xAA), u2_shift), m4),
                                    _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u, 6), m2), 4));
    const __m256i scmn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi32(lo, hi));  // int16: scales 0-7, mins 0-7
    const __m512i sc16 = _mm512_castsi256_si512(scmn);
    __m512i isum = _mm512_setzero_si512();
    const uint8_t* qs = b + kQuants;
    [[maybe_unused]] __m512i qh;
    if constexpr (kFifthBit) {  // bits 4j, 4j + 1 of each byte for the first 32 elements, 4j + 2, + 3 for the last
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      qh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
    }
    for (int j = 0; j < 2; ++j) {
      const __m512i q = _mm512_loadu_si512(qs + 64 * j);
      __m512i lo4 = _mm512_and_si512(q, low4), hi4 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      if constexpr (kFifthBit) {  // bit 4j (low nibbles) and 4j + 1 (high) of each byte, as 16
        const __m512i l5 = j == 0 ? _mm512_slli_epi16(qh, 4) : qh;
        const __m512i h5 = j == 0 ? _mm512_slli_epi16(qh, 3) : _mm512_srli_epi16(qh, 1);
        lo4 = _mm512_or_si512(lo4, _mm512_and_si512(l5, bit4));
        hi4 = _mm512_or_si512(hi4, _mm512_and_si512(h5, bit4));
      }
      const __m512i plo = _mm512_maddubs_epi16(lo4, _mm512_loadu_si512(x->q + 128 * j));
      const __m512i phi = _mm512_maddubs_epi16(hi4, _mm512_loadu_si512(x->q + 128 * j + 64));
      isum = _mm512_dpwssd_epi32(isum, plo, _mm512_permutexvar_epi16(pick[2 * j], sc16));
      isum = _mm512_dpwssd_epi32(isum, phi, _mm512_permutexvar_epi16(pick[2 * j + 1], sc16));
    }
    const __m256i msum = _mm256_madd_epi16(_mm256_permutexvar_epi16(min_pairs, scmn),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->sums)));
    return {isum, msum, d2};
  }
};

// The eight int32 lanes of the two halves of v added.
inline __m256i halves(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
// The totals of four vectors of eight int32, as four lanes.
inline __m128i totals4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));  // a b c d 0-3 | 4-7
  return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

template <bool kFifthBit>
float dot_k4(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const K4<kFifthBit> k;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < n_blocks; ++i, b += k.kBlockBytes, ++x) {
    const K4Block r = k.block(b, x, b + 2048);
    // lanes I 0+2, M 0+2, I 1+3, M 1+3 | the same of 4-7; then I 0-3, M 0-3 | I 4-7, M 4-7
    const __m256i i8 = halves(r.isum);
    __m256i h = _mm256_add_epi32(_mm256_unpacklo_epi32(i8, r.msum), _mm256_unpackhi_epi32(i8, r.msum));
    h = _mm256_add_epi32(h, _mm256_shuffle_epi32(h, 0x4E));
    const __m128 im = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    acc = _mm_fmadd_ss(im, r.d2, acc);
    acc = _mm_fnmadd_ss(_mm_movehdup_ps(im), _mm_movehdup_ps(r.d2), acc);
  }
  return _mm_cvtss_f32(acc);
}

// Four rows at once: one reduction of the four rows' totals per super-block, the float steps on
// four lanes (each lane the single-row kernel's numbers).
template <bool kFifthBit>
void dot4_k4(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  const K4<kFifthBit> k;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < n_blocks; ++i, b += k.kBlockBytes, ++x) {
    // The four rows are one stream of 4 row_bytes: the same super-block of the next four rows
    // is requested while this one is computed.
    const uint8_t* next = b + 4 * row_bytes;
    const K4Block r0 = k.block(b, x, next), r1 = k.block(b + row_bytes, x, next + row_bytes),
                  r2 = k.block(b + 2 * row_bytes, x, next + 2 * row_bytes),
                  r3 = k.block(b + 3 * row_bytes, x, next + 3 * row_bytes);
    const __m128 fi = _mm_cvtepi32_ps(totals4(halves(r0.isum), halves(r1.isum), halves(r2.isum), halves(r3.isum)));
    const __m128 fm = _mm_cvtepi32_ps(totals4(r0.msum, r1.msum, r2.msum, r3.msum));
    const __m128 t01 = _mm_unpacklo_ps(r0.d2, r1.d2), t23 = _mm_unpacklo_ps(r2.d2, r3.d2);  // d d dmin dmin
    acc = _mm_fmadd_ps(fi, _mm_movelh_ps(t01, t23), acc);
    acc = _mm_fnmadd_ps(fm, _mm_movehl_ps(t23, t01), acc);
  }
  _mm_storeu_ps(out, acc);
}
}  // namespace

float dot_q4_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k4<false>(row, x, n_blocks); }
float dot_q5_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k4<true>(row, x, n_blocks); }
void dot4_q4_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  dot4_k4<false>(row, row_bytes, x, n_blocks, out);
}
void dot4_q5_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  dot4_k4<true>(row, row_bytes, x, n_blocks, out);
}

// Q6_K (quant.cc): per half of 128 elements 64 bytes of low nibbles and 32 of 2-bit high parts;
// element l + 32 s has nibble s / 2 of low byte l + 32 (s % 2) and bits 2s of high byte l, minus
// 32, scale sc[l / 16 + 2 s] of the half's eight. The dot product is d * sum_j sc_j * (sum(q_u * a)
// - 32 * sum(a)) over the sixteen 16-element groups j, q_u = q + 32 in [0, 63]: vpmaddubsw of q_u
// and a (at most 2 * 63 * 127 in int16), vpmaddwd by the groups' int8 scales widened to int16.
namespace {
struct Q6K {
  static constexpr int kBytes = 210;
  static float scale(const uint8_t* b) { return half(b + 208); }
  __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
  // int16 lanes 8j..8j+7 (j = 0..3) take scale 4c + j of the sixteen, for c = 0..3.
  __m512i pick[4];
  Q6K() {
    for (int c = 0; c < 4; ++c) {
      alignas(64) int16_t idx[32];
      for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>(4 * c + l / 8);
      pick[c] = _mm512_load_si512(idx);
    }
  }
  // A super-block's exact integer total, in lanes: I - M = sum_j sc_j * (sum(q_u * a) - 32 sums_j).
  // ahead: where the stream is read next, 210 bytes of it requested now.
  __m512i block(const uint8_t* b, const BlockQ8Act* x, const uint8_t* ahead) const {
    prefetch(ahead, 210);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i scales = _mm512_zextsi256_si512(sc16);
    // 32 * sum_j sc_j * sums_j, subtracted from lanes 0-7
    const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->sums)));
    __m512i isum = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5)));
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);  // [l] and [l + 32]
      const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i qh = _mm512_inserti64x4(_mm512_zextsi256_si512(qh256), qh256, 1);
      // s = 0 | 1: low nibbles, high bits 0-1 | 2-3; s = 2 | 3: high nibbles, bits 4-5 | 6-7.
      const __m512i hi01 = _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, qh, _mm512_srli_epi16(qh, 2)), two);
      const __m512i hi23 =
          _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(qh, 4), _mm512_srli_epi16(qh, 6)), two);
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(hi01, 4));
      const __m512i q23 =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(hi23, 4));
      const __m512i p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(x->q + 128 * h));
      const __m512i p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(x->q + 128 * h + 64));
      isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p01, _mm512_permutexvar_epi16(pick[2 * h], scales)));
      isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p23, _mm512_permutexvar_epi16(pick[2 * h + 1], scales)));
    }
    return isum;
  }
};
}  // namespace

// IQ4_XS (quant.cc): per super-block d, 2 + 4 bits of eight 6-bit group scales (minus 32), and per
// 32-element group 16 bytes of indices into the IQ4 levels: low nibbles are elements 0-15, high
// nibbles 16-31. The indices become signed levels by a byte shuffle of the table; their signs move
// onto the activations (|w| * sign(w) a) for vpmaddubsw (at most 2 * 127 * 127 in int16), then
// vpmaddwd by the groups' scales.
namespace {
struct IQ4XS {
  static constexpr int kBytes = 136;
  static float scale(const uint8_t* b) { return half(b); }
  __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512i levels = _mm512_broadcast_i32x4(
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  __m512i pick[4];
  IQ4XS() { group_pair_indices(pick); }
  // A super-block's exact integer total I = sum_g ls_g * sum(level * a), in lanes.
  __m512i block(const uint8_t* b, const BlockQ8Act* x, const uint8_t* ahead) const {
    prefetch(ahead, 136);
    const int scales_h = b[2] | b[3] << 8;
    alignas(16) int16_t ls[8];
    for (int g = 0; g < 8; ++g) ls[g] = static_cast<int16_t>((((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | ((scales_h >> (2 * g)) & 3) << 4) - 32);
    const __m512i sc16 = _mm512_zextsi128_si512(_mm_load_si128(reinterpret_cast<const __m128i*>(ls)));
    __m512i isum = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * k));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      // element order: group 2k's low then high nibbles, then group 2k + 1's
      const __m512i idx = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                             _mm256_permute2x128_si256(lo, hi, 0x31), 1);
      const __m512i w = _mm512_shuffle_epi8(levels, idx);
      const __m512i a = _mm512_loadu_si512(x->q + 64 * k);
      const __m512i sa = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
      const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(w), sa);
      isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, _mm512_permutexvar_epi16(pick[k], sc16)));
    }
    return isum;
  }
};
}  // namespace

namespace {
// The drivers of the kernels whose super-block is one integer total I and one float scale d (K:
// Q6K, IQ4XS): quant_gemm.h's float step acc += I * (xd d) per super-block.
template <class K>
float dot_total(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const K k;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < n_blocks; ++i, b += K::kBytes, ++x) {
    const __m256i i8 = halves(k.block(b, x, b + 2048));
    const __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(i8), _mm256_extracti128_si256(i8, 1));
    const __m128i i2 = _mm_add_epi32(i4, _mm_unpackhi_epi64(i4, i4));
    const __m128i i1 = _mm_add_epi32(i2, _mm_shuffle_epi32(i2, 1));
    acc = _mm_fmadd_ss(_mm_cvtepi32_ps(i1), _mm_set_ss(x->d * K::scale(b)), acc);
  }
  return _mm_cvtss_f32(acc);
}

template <class K>
void dot4_total(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  const K k;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < n_blocks; ++i, b += K::kBytes, ++x) {
    const uint8_t* next = b + 4 * row_bytes;  // as dot4_k4
    const __m128i t = totals4(halves(k.block(b, x, next)), halves(k.block(b + row_bytes, x, next + row_bytes)),
                              halves(k.block(b + 2 * row_bytes, x, next + 2 * row_bytes)),
                              halves(k.block(b + 3 * row_bytes, x, next + 3 * row_bytes)));
    const __m128 d = _mm_setr_ps(K::scale(b), K::scale(b + row_bytes), K::scale(b + 2 * row_bytes),
                                 K::scale(b + 3 * row_bytes));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(t), _mm_mul_ps(_mm_set1_ps(x->d), d), acc);
  }
  _mm_storeu_ps(out, acc);
}
}  // namespace

float dot_q6_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_total<Q6K>(row, x, n_blocks); }
void dot4_q6_k(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  dot4_total<Q6K>(row, row_bytes, x, n_blocks, out);
}
float dot_iq4_xs(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_total<IQ4XS>(row, x, n_blocks); }
void dot4_iq4_xs(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n_blocks, float out[4]) {
  dot4_total<IQ4XS>(row, row_bytes, x, n_blocks, out);
}

// The 32-element formats with an AVX-512 kernel (quant.cc), each block an 8-bit scale or f16 scale
// and 32 weights: MXFP4 and IQ4_NL store four-bit indices into a signed table of 16 levels (MXFP4:
// the doubled E2M1 values 0..+-12 under a power-of-two e8m0 scale; IQ4_NL: -127..113 under an f16
// scale), a block's low nibbles elements 0-15 and high nibbles 16-31; Q8_0 stores 32 signed bytes
// under an f16 scale. The weights are shifted by K (12, 127, 128) into unsigned bytes (the levels
// by a shifted table, Q8_0's bytes by flipping their sign bit) so that one vpdpbusd multiplies 64
// of them (two blocks) by the signed activations; the int32 sums start at -K times each 16
// activations' sum (the activation block's sums), so they are the exact sums of weight *
// activation. One float multiply-add per two blocks by their scales times the activations'.
// Eight blocks (one block of activations) a step; a row's last n32 % 8 blocks go to the AVX2
// kernel.
namespace {
template <DType T>
float dot32_vnni(const void* row, const BlockQ8Act* x, int64_t n32) {
  static_assert(T == DType::kMXFP4 || T == DType::kIQ4_NL || T == DType::kQ8_0);
  constexpr bool kMx = T == DType::kMXFP4, kQ8 = T == DType::kQ8_0;
  constexpr int kBytes = kMx ? 17 : kQ8 ? 34 : 18, kQs = kMx ? 1 : 2, kShift = kMx ? 12 : kQ8 ? 128 : 127;
  alignas(16) static constexpr uint8_t kLevels[16] = {
      kMx ? 12 : 0,   kMx ? 13 : 23,  kMx ? 14 : 44,  kMx ? 15 : 62,  kMx ? 16 : 78,  kMx ? 18 : 92,
      kMx ? 20 : 105, kMx ? 24 : 117, kMx ? 12 : 128, kMx ? 11 : 140, kMx ? 10 : 152, kMx ? 9 : 165,
      kMx ? 8 : 180,  kMx ? 6 : 196,  kMx ? 4 : 216,  kMx ? 0 : 240};
  const __m512i levels = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kLevels)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // Pair k (blocks 2k, 2k + 1) puts its int32 lanes in four groups of 4. The levels, as their
  // nibbles are loaded: block 2k's elements 0-15, block 2k + 1's 0-15, block 2k's 16-31, block
  // 2k + 1's 16-31; Q8_0's bytes in their order: block 2k's 0-15, 16-31, block 2k + 1's 0-15,
  // 16-31. Each group's first lane starts at -K times its 16 activations' sum, and its scale is
  // its block's.
  __m512i sum_pick[4], scale_pick[4];
  for (int k = 0; k < 4; ++k) {
    const int s = 4 * k, e = 2 * k, o = 2 * k + 1;
    if constexpr (kQ8) {
      sum_pick[k] = _mm512_setr_epi32(s, 0, 0, 0, s + 1, 0, 0, 0, s + 2, 0, 0, 0, s + 3, 0, 0, 0);
      scale_pick[k] = _mm512_setr_epi32(e, e, e, e, e, e, e, e, o, o, o, o, o, o, o, o);
    } else {
      sum_pick[k] = _mm512_setr_epi32(s, 0, 0, 0, s + 2, 0, 0, 0, s + 1, 0, 0, 0, s + 3, 0, 0, 0);
      scale_pick[k] = _mm512_setr_epi32(e, e, e, e, o, o, o, o, e, e, e, e, o, o, o, o);
    }
  }
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};  // one chain per pair
  const int64_t full = n32 / 8;
  for (int64_t g = 0; g < full; ++g, ++x, b += 8 * kBytes) {
    prefetch_ahead(b, 8 * kBytes);
    // The eight blocks' scales times the activations'.
    __m256 d8;
    if constexpr (kMx) {
      alignas(8) uint8_t e[8];
      for (int j = 0; j < 8; ++j) e[j] = b[j * kBytes];
      const __m256i ei = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e)));
      const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), ei);  // e < 2: subnormal halves
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(ei, _mm256_set1_epi32(1)), 23);
      const __m256i bits = _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), ei));
      d8 = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(x->d));
    } else {
      alignas(16) uint16_t h[8];
      for (int j = 0; j < 8; ++j) std::memcpy(&h[j], b + j * kBytes, 2);
      d8 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))), _mm256_set1_ps(x->d));
    }
    const __m512 d16 = _mm512_zextps256_ps512(d8);
    const __m512i shifted_sums = _mm512_mullo_epi32(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->sums))), _mm512_set1_epi32(-kShift));
    for (int k = 0; k < 4; ++k) {
      const uint8_t* q0 = b + 2 * k * kBytes + kQs;
      __m512i w, a = _mm512_loadu_si512(x->q + 64 * k);
      if constexpr (kQ8) {
        w = _mm512_xor_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + kBytes)), 1),
            flip);
      } else {
        const __m256i q = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + kBytes)),
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0)));
        const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        w = _mm512_shuffle_epi8(levels, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
        a = _mm512_shuffle_i64x2(a, a, _MM_SHUFFLE(3, 1, 2, 0));  // 16-byte parts 0, 2, 1, 3
      }
      const __m512i start = _mm512_maskz_permutexvar_epi32(0x1111, sum_pick[k], shifted_sums);
      const __m512i sums = _mm512_dpbusd_epi32(start, w, a);
      acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(scale_pick[k], d16), acc[k]);
    }
  }
  float total = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  if (n32 % 8 != 0) {
    total += kMx ? avx2::dot_mxfp4(b, x, n32 % 8) : kQ8 ? avx2::dot_q8_0(b, x, n32 % 8) : avx2::dot_iq4_nl(b, x, n32 % 8);
  }
  return total;
}
}  // namespace

// Q8_0, four rows whose blocks are whole 256s: quant_gemm.h's float steps, acc += S_b (xd d_b) for
// each block of 32 in order, S_b its exact integer sum. The bytes and the starting sums as
// dot32_vnni's; the four rows' int32 lanes transposed and added (four per 128 bits), then each
// pair of 128-bit lanes (a block) added; the scales gathered block-major. For a single row (a matrix's
// last rows), row_bytes 0: four copies of the row.
void dot4_q8_0(const void* row, size_t row_bytes, const BlockQ8Act* x, int64_t n32, float out[4]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sum_pick[4];
  for (int k = 0; k < 4; ++k) {
    const int s = 4 * k;
    sum_pick[k] = _mm512_setr_epi32(s, 0, 0, 0, s + 1, 0, 0, 0, s + 2, 0, 0, 0, s + 3, 0, 0, 0);
  }
  alignas(64) int32_t offsets[16];
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 4; ++r) offsets[4 * j + r] = static_cast<int32_t>(r * row_bytes) + 34 * j;
  const __m512i scale_at = _mm512_load_si512(offsets);
  const uint8_t* b = static_cast<const uint8_t*>(row);
  __m128 acc = _mm_setzero_ps();
  for (int64_t g = 0; g < n32 / 8; ++g, ++x, b += 8 * 34) {
    for (int r = 0; r < 4; ++r) prefetch(b + (4 + r) * row_bytes, 8 * 34);  // the next four rows' (dot4_k4)
    const __m512i shifted_sums = _mm512_mullo_epi32(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->sums))), _mm512_set1_epi32(-128));
    __m512i f[4];  // pair k: 128-bit lane 0 the four rows' totals of block 2k, lane 2 of block 2k + 1
    for (int k = 0; k < 4; ++k) {
      const __m512i start = _mm512_maskz_permutexvar_epi32(0x1111, sum_pick[k], shifted_sums);
      const __m512i a = _mm512_loadu_si512(x->q + 64 * k);
      __m512i u[4];
      for (int r = 0; r < 4; ++r) {
        const uint8_t* q0 = b + r * row_bytes + 2 * k * 34 + 2;
        const __m512i w = _mm512_xor_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + 34)), 1),
            flip);
        u[r] = _mm512_dpbusd_epi32(start, w, a);
      }
      // each 128-bit lane's four int32 of the four rows transposed and added: lane j = [r0..r3]
      const __m512i s0 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[0], u[1]), _mm512_unpackhi_epi32(u[0], u[1]));
      const __m512i s1 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[2], u[3]), _mm512_unpackhi_epi32(u[2], u[3]));
      const __m512i g4 = _mm512_add_epi32(_mm512_unpacklo_epi64(s0, s1), _mm512_unpackhi_epi64(s0, s1));
      // lanes 0 + 1 (block 2k), 2 + 3 (block 2k + 1)
      f[k] = _mm512_add_epi32(g4, _mm512_shuffle_i64x2(g4, g4, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    // the scales, block j of row r in lane 4 j + r (blocks 0-3, then 4-7): gathered as the 32-bit
    // words they begin, their low halves kept
    const __m512 xd = _mm512_set1_ps(x->d);
    const __m512 d[2] = {
        _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(scale_at, b, 1))), xd),
        _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(scale_at, b + 4 * 34, 1))), xd)};
    // blocks 0..7 in order: block 2k's totals in lane 0 of f[k], 2k + 1's in lane 2; block j's
    // scales in lane j % 4 of d[j / 4]
    __m512 t = _mm512_cvtepi32_ps(f[0]);
    acc = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm512_castps512_ps128(d[0]), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(d[0], 1), acc);
    t = _mm512_cvtepi32_ps(f[1]);
    acc = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(d[0], 2), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(d[0], 3), acc);
    t = _mm512_cvtepi32_ps(f[2]);
    acc = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm512_castps512_ps128(d[1]), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(d[1], 1), acc);
    t = _mm512_cvtepi32_ps(f[3]);
    acc = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(d[1], 2), acc);
    acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(d[1], 3), acc);
  }
  _mm_storeu_ps(out, acc);
}

float dot_mxfp4(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32_vnni<DType::kMXFP4>(row, x, n32); }
float dot_iq4_nl(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32_vnni<DType::kIQ4_NL>(row, x, n32); }
float dot_q8_0(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32_vnni<DType::kQ8_0>(row, x, n32); }

}  // namespace combs::cpu::avx512vnni
