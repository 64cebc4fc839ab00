// quant_gemm.h for AVX-512 VNNI (flags set in CMakeLists.txt). The block layouts are quant.cc's
// (ggml's); the unpacking follows the decode kernels of quant_dot_avx512vnni.cc.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "combs/backend/quant.h"
#include "kernels/quant_dot_isa.h"  // half()
#include "kernels/quant_gemm.h"

// GCC 12's AVX-512 intrinsics fill lanes from _mm*_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive: every lane used here is written).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace combs::cpu::avx512vnni {
namespace {

inline int32_t int16_pair(int lo, int hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                              static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
}

// The sum of the 32 signed bytes of v: of the bytes plus 128, minus 32 * 128.
inline int32_t signed_sum32(__m256i v) {
  uint64_t s[4];
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(s),
      _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))),
                      _mm256_setzero_si256()));
  return static_cast<int32_t>(s[0] + s[1] + s[2] + s[3]) - 32 * 128;
}

// The sums of each 8 bytes of v (unsigned), as eight 64-bit lanes.
inline void sums_of_8(__m512i v, uint64_t out[8]) {
  _mm512_storeu_si512(out, _mm512_sad_epu8(v, _mm512_setzero_si512()));
}

// Q4_K and Q5_K (quant.cc): groups of 32, scale and minimum 6-bit integers, d and dmin.
template <bool kFifthBit>
void pack_k45(const uint8_t* b, PackedBlock* p) {
  constexpr int kQuants = kFifthBit ? 48 : 16;
  p->d = half(b);
  p->dmin = half(b + 2);
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    k4_scale_min(g, b + 4, &sc, &mn);
    p->sc[g] = sc;
    p->mm[g] = int16_pair(mn, mn);  // both subgroups of group g
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  [[maybe_unused]] __m512i qh;
  if constexpr (kFifthBit) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    qh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
  }
  for (int j = 0; j < 2; ++j) {  // 64 bytes: groups 4j..4j+3, low nibbles of 4j and 4j + 2
    const __m512i q = _mm512_loadu_si512(b + kQuants + 64 * j);
    const __m512i lo = _mm512_and_si512(q, low4),
                  hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    __m512i v[2] = {_mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)),   // groups 4j, 4j + 1
                    _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2))};  // 4j + 2, 4j + 3
    for (int h = 0; h < 2; ++h) {
      const int g = 4 * j + 2 * h;
      if constexpr (kFifthBit) {  // element l of group g adds 16 where bit g of qh[l] is set
        const __m512i bits =
            _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << g)),
                               _mm256_set1_epi8(static_cast<char>(1 << (g + 1))), 1);
        v[h] = _mm512_mask_add_epi8(v[h], _mm512_test_epi8_mask(qh, bits), v[h], sixteen);
      }
      _mm512_storeu_si512(p->q + 64 * (2 * j + h), v[h]);
      uint64_t s[8];
      sums_of_8(v[h], s);
      p->corr[g] = -128 * static_cast<int32_t>(s[0] + s[1] + s[2] + s[3]);
      p->corr[g + 1] = -128 * static_cast<int32_t>(s[4] + s[5] + s[6] + s[7]);
    }
  }
}

// Q6_K (quant.cc): sixteen groups of 16 with int8 scales; the quants stored plus 32 (0..63), the
// offset being the minimum part: 32 * sc, times d.
void pack_q6_k(const uint8_t* b, PackedBlock* p) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  p->d = p->dmin = half(b + 208);
  for (int j = 0; j < 16; ++j) p->sc[j] = sc[j];
  for (int q = 0; q < 8; ++q) p->mm[q] = int16_pair(32 * sc[2 * q], 32 * sc[2 * q + 1]);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i qh = _mm512_inserti64x4(_mm512_zextsi256_si512(qh256), qh256, 1);
    const __m512i hi01 =
        _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, qh, _mm512_srli_epi16(qh, 2)), two);
    const __m512i hi23 = _mm512_and_si512(
        _mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(qh, 4), _mm512_srli_epi16(qh, 6)), two);
    const __m512i v[2] = {_mm512_or_si512(_mm512_and_si512(ql, low4),
                                          _mm512_slli_epi16(hi01, 4)),  // elements 128h + 0..63
                          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                          _mm512_slli_epi16(hi23, 4))};
    for (int s = 0; s < 2; ++s) {
      _mm512_storeu_si512(p->q + 128 * h + 64 * s, v[s]);
      uint64_t sums[8];
      sums_of_8(v[s], sums);
      for (int j = 0; j < 4; ++j)
        p->corr[8 * h + 4 * s + j] = -128 * static_cast<int32_t>(sums[2 * j] + sums[2 * j + 1]);
    }
  }
}

// IQ4_XS (quant.cc): eight groups of 32 with 6-bit scales (minus 32), the nibbles indices into the
// IQ4 levels (-127..113: signed bytes as they are); no minimum parts.
void pack_iq4_xs(const uint8_t* b, PackedBlock* p) {
  const __m128i levels =
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  p->d = half(b);
  p->dmin = 0.0f;
  const int scales_h = b[2] | b[3] << 8;
  for (int g = 0; g < 8; ++g) {
    p->sc[g] = (((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | ((scales_h >> (2 * g)) & 3) << 4) - 32;
    p->mm[g] = 0;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * g));
    const __m128i lo = _mm_shuffle_epi8(levels, _mm_and_si128(q, low4));  // elements 0-15
    const __m128i hi =
        _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(q, 4), low4));  // 16-31
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p->q + 32 * g), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p->q + 32 * g + 16), hi);
    p->corr[g] = -128 * signed_sum32(_mm256_set_m128i(hi, lo));
  }
}

// Q8_0: eight blocks of 32 signed quants, each with its f16 scale.
void pack_q8_0(const uint8_t* b, PackedBlock* p) {
  for (int k = 0; k < 8; ++k, b += 34) {
    p->dg[k] = half(b);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p->q + 32 * k), q);
    p->corr[k] = -128 * signed_sum32(q);
  }
}

inline __m512i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// The int32 sums of group g (kGroup elements, 4 a step) of four rows by T tiles of 16 tokens, each
// started at the group's -128 x quant sum: exact sums of quant x activation.
template <int T, int kGroup>
[[gnu::always_inline]] inline void group_sums(const PackedBlock* const wr[4],
                                              const ActTile* const xt[T], int g, __m512i s[4][T]) {
  for (int r = 0; r < 4; ++r) {
    const __m512i c = _mm512_set1_epi32(wr[r]->corr[g]);
    for (int t = 0; t < T; ++t) s[r][t] = c;
  }
#pragma GCC unroll 8
  for (int kk = 0; kk < kGroup / 4; ++kk) {
    const int k = g * kGroup / 4 + kk;
    __m512i a[T];
    for (int t = 0; t < T; ++t) a[t] = _mm512_loadu_si512(xt[t]->q[k]);
    for (int r = 0; r < 4; ++r) {
      const __m512i q = broadcast4(wr[r]->q + 4 * k);
      for (int t = 0; t < T; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], a[t], q);
    }
  }
}

// Four rows (w, w + nb, ...) by T tiles of 16 tokens (x, x + nb, ...) over nb blocks into acc.
// K-quants: kGroup elements a group (32, or Q6_K's 16); kMinsOfD: the minimum parts scale by d
// (Q6_K) rather than dmin.
template <int T, int kGroup, bool kMinsOfD>
void kquant_4rows(const PackedBlock* w, int64_t nb, const ActTile* x, float acc[4][3][16]) {
  constexpr int kGroups = 256 / kGroup;
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[r][t], _mm512_setzero_ps());
  for (int64_t i = 0; i < nb; ++i) {
    const PackedBlock* wr[4] = {w + i, w + nb + i, w + 2 * nb + i, w + 3 * nb + i};
    const ActTile* xt[T];
    for (int t = 0; t < T; ++t) xt[t] = x + t * nb + i;
    __m512i isum[4][T];
    for (int r = 0; r < 4; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; ++g) {
      __m512i s[4][T];
      group_sums<T, kGroup>(wr, xt, g, s);
      for (int r = 0; r < 4; ++r) {
        const __m512i sc = _mm512_set1_epi32(wr[r]->sc[g]);
        for (int t = 0; t < T; ++t)
          isum[r][t] = _mm512_add_epi32(isum[r][t], _mm512_mullo_epi32(s[r][t], sc));
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 xd = _mm512_loadu_ps(xt[t]->d);
      for (int r = 0; r < 4; ++r) {
        __m512i m = _mm512_setzero_si512();
        for (int p = 0; p < 8; ++p) {
          m = _mm512_dpwssd_epi32(m, _mm512_loadu_si512(xt[t]->sums[p]),
                                  _mm512_set1_epi32(wr[r]->mm[p]));
        }
        __m512 a = _mm512_loadu_ps(acc[r][t]);
        if constexpr (kMinsOfD) {
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][t], m)),
                              _mm512_mul_ps(xd, _mm512_set1_ps(wr[r]->d)), a);
        } else {
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t]),
                              _mm512_mul_ps(xd, _mm512_set1_ps(wr[r]->d)), a);
          a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m),
                               _mm512_mul_ps(xd, _mm512_set1_ps(wr[r]->dmin)), a);
        }
        _mm512_storeu_ps(acc[r][t], a);
      }
    }
  }
}

// Q8_0: the float scale applies per block of 32.
template <int T>
void q8_0_4rows(const PackedBlock* w, int64_t nb, const ActTile* x, float acc[4][3][16]) {
  __m512 sum[4][T];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < T; ++t) sum[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const PackedBlock* wr[4] = {w + i, w + nb + i, w + 2 * nb + i, w + 3 * nb + i};
    const ActTile* xt[T];
    for (int t = 0; t < T; ++t) xt[t] = x + t * nb + i;
    for (int g = 0; g < 8; ++g) {
      __m512i s[4][T];
      group_sums<T, 32>(wr, xt, g, s);
      for (int t = 0; t < T; ++t) {
        const __m512 xd = _mm512_loadu_ps(xt[t]->d);
        for (int r = 0; r < 4; ++r) {
          sum[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][t]),
                                      _mm512_mul_ps(xd, _mm512_set1_ps(wr[r]->dg[g])), sum[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[r][t], sum[r][t]);
}

using Tile4 = void (*)(const PackedBlock*, int64_t, const ActTile*, float[4][3][16]);

template <int T>
Tile4 tile_kernel(DType t) {
  switch (t) {
    case DType::kQ4_K:
    case DType::kQ5_K:
      return kquant_4rows<T, 32, false>;
    case DType::kQ6_K:
      return kquant_4rows<T, 16, true>;
    case DType::kIQ4_XS:
      return kquant_4rows<T, 32, true>;  // minimum parts all 0
    case DType::kQ8_0:
      return q8_0_4rows<T>;
    default:
      return nullptr;
  }
}

}  // namespace

bool gemm_supports(DType t) {
  return t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K || t == DType::kIQ4_XS ||
         t == DType::kQ8_0;
}

bool gemm_matches_decode(DType t) {
  return gemm_supports(t);  // Q8_0 with dot4_q8_0, which decode takes for rows of whole 256s
}

void pack_rows(DType t, const void* rows, size_t row_bytes, int64_t n_rows, int64_t k,
               PackedBlock* out) {
  const int64_t nb = k / 256;
  const int64_t block_bytes = static_cast<int64_t>(row_bytes) / nb;  // Q8_0: its 8 blocks of 32
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* b = static_cast<const uint8_t*>(rows) + r * row_bytes;
    for (int64_t i = 0; i < nb; ++i, b += block_bytes) {
      PackedBlock* p = out + r * nb + i;
      switch (t) {
        case DType::kQ4_K:
          pack_k45<false>(b, p);
          break;
        case DType::kQ5_K:
          pack_k45<true>(b, p);
          break;
        case DType::kQ6_K:
          pack_q6_k(b, p);
          break;
        case DType::kIQ4_XS:
          pack_iq4_xs(b, p);
          break;
        case DType::kQ8_0:
          pack_q8_0(b, p);
          break;
        default:
          break;
      }
    }
  }
  // Rows up to a multiple of 4: zeros (their products are computed and dropped).
  std::memset(static_cast<void*>(out + n_rows * nb), 0,
              sizeof(PackedBlock) * ((4 - n_rows % 4) % 4) * nb);
}

void pack_act_tile(const BlockQ8Act* x, int64_t n_tokens, int64_t nb, int64_t tile, ActTile* out) {
  for (int64_t i = 0; i < nb; ++i) {
    ActTile& o = out[i];
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t token = 16 * tile + lane;
      if (token >= n_tokens) {
        for (int k = 0; k < 64; ++k) o.q[k][lane] = 0;
        for (int p = 0; p < 8; ++p) o.sums[p][lane] = 0;
        o.d[lane] = 0.0f;
        continue;
      }
      const BlockQ8Act& a = x[token * nb + i];
      for (int k = 0; k < 64; ++k) {
        uint32_t v;
        std::memcpy(&v, a.q + 4 * k, 4);
        o.q[k][lane] = v ^ 0x80808080u;  // each byte plus 128
      }
      for (int p = 0; p < 8; ++p) o.sums[p][lane] = int16_pair(a.sums[2 * p], a.sums[2 * p + 1]);
      o.d[lane] = a.d;
    }
  }
}

void gemm(DType t, const PackedBlock* w, int64_t n_rows, const ActTile* x, int64_t n_tiles,
          int64_t n_tokens, int64_t nb, float* y, int64_t ldy, const float* bias) {
  const Tile4 kernels[3] = {tile_kernel<1>(t), tile_kernel<2>(t), tile_kernel<3>(t)};
  alignas(64) float acc[4][3][16];
  for (int64_t t0 = 0; t0 < n_tiles; t0 += 3) {
    const int tiles = static_cast<int>(std::min<int64_t>(3, n_tiles - t0));
    for (int64_t r0 = 0; r0 < n_rows; r0 += 4) {
      kernels[tiles - 1](w + r0 * nb, nb, x + t0 * nb, acc);
      const int rows = static_cast<int>(std::min<int64_t>(4, n_rows - r0));
      for (int tt = 0; tt < tiles; ++tt) {
        if (rows == 4 &&
            16 * (t0 + tt + 1) <= n_tokens) {  // a whole tile: 4 x 16 transposed in registers
          const __m512 a0 = _mm512_load_ps(acc[0][tt]), a1 = _mm512_load_ps(acc[1][tt]);
          const __m512 a2 = _mm512_load_ps(acc[2][tt]), a3 = _mm512_load_ps(acc[3][tt]);
          const __m512 lo01 = _mm512_unpacklo_ps(a0, a1), hi01 = _mm512_unpackhi_ps(a0, a1);
          const __m512 lo23 = _mm512_unpacklo_ps(a2, a3), hi23 = _mm512_unpackhi_ps(a2, a3);
          // u[k]'s 128-bit lane j: the four rows of token 4j + k
          __m512 u[4] = {_mm512_shuffle_ps(lo01, lo23, 0x44), _mm512_shuffle_ps(lo01, lo23, 0xEE),
                         _mm512_shuffle_ps(hi01, hi23, 0x44), _mm512_shuffle_ps(hi01, hi23, 0xEE)};
          if (bias) {
            const __m512 b = _mm512_broadcast_f32x4(_mm_loadu_ps(bias + r0));
            for (__m512& v : u) v = _mm512_add_ps(v, b);
          }
          float* yt = y + 16 * (t0 + tt) * ldy + r0;
          for (int k = 0; k < 4; ++k) {
            _mm_storeu_ps(yt + k * ldy, _mm512_castps512_ps128(u[k]));
            _mm_storeu_ps(yt + (4 + k) * ldy, _mm512_extractf32x4_ps(u[k], 1));
            _mm_storeu_ps(yt + (8 + k) * ldy, _mm512_extractf32x4_ps(u[k], 2));
            _mm_storeu_ps(yt + (12 + k) * ldy, _mm512_extractf32x4_ps(u[k], 3));
          }
          continue;
        }
        for (int lane = 0; lane < 16; ++lane) {
          const int64_t token = 16 * (t0 + tt) + lane;
          if (token >= n_tokens) break;
          float* yt = y + token * ldy + r0;
          for (int r = 0; r < rows; ++r)
            yt[r] = bias ? acc[r][tt][lane] + bias[r0 + r] : acc[r][tt][lane];
        }
      }
    }
  }
}

}  // namespace combs::cpu::avx512vnni
