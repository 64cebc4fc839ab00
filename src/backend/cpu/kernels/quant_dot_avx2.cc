// quant_dot.h for AVX2 (+ FMA, F16C; flags set in CMakeLists.txt): the AVX-512 kernels' arithmetic
// (quant_dot_avx512vnni.cc describes each format's layout and sums) in 256-bit registers. Without
// AVX-512's 16-bit permutes, each 32 products of one group take its scale by a broadcast: vpmaddubsw
// of 32 unsigned weights and 32 signed activations, then vpmaddwd by the group's int16 scale (or by
// two scales, one per 128-bit half, for the 16-element groups of Q6_K).
#include "kernels/quant_dot_isa.h"

#include <immintrin.h>

#include <cstring>

#include "combs/backend/dtype.h"

namespace combs::cpu::avx2 {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 products of unsigned w and signed a, times one int16 scale per 16 elements (lo: elements
// 0-15, hi: 16-31), as eight int32 sums.
inline __m256i scaled(__m256i w, const int8_t* a, int16_t lo, int16_t hi) {
  const __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  return _mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo)));
}

template <bool kFifthBit>
float dot_k4(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  constexpr int kBlockBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m256i one = _mm256_set1_epi8(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  float acc_min = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i, b += kBlockBytes, ++x) {
    prefetch_ahead(b, kBlockBytes);
    const float d = half(b), dmin = half(b + 2);
    uint32_t u[3];
    std::memcpy(u, b + 4, 12);
    const uint32_t packed[4] = {u[0] & 0x3f3f3f3f, (u[2] & 0x0f0f0f0f) | ((u[0] >> 6) & 0x03030303) << 4,
                                u[1] & 0x3f3f3f3f, ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 6) & 0x03030303) << 4};
    uint8_t sm[16];  // scales 0-7, then mins 0-7
    std::memcpy(sm, packed, 16);
    __m256i isum = _mm256_setzero_si256();
    const uint8_t* qs = b + kQuants;
    [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kFifthBit) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 1), one), 4));
      }
      isum = _mm256_add_epi32(isum, scaled(lo, x->q + 64 * k, sm[2 * k], sm[2 * k]));
      isum = _mm256_add_epi32(isum, scaled(hi, x->q + 64 * k + 32, sm[2 * k + 1], sm[2 * k + 1]));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x->d * d), acc);
    int msum = 0;
    for (int g = 0; g < 8; ++g) msum += sm[8 + g] * (x->sums[2 * g] + x->sums[2 * g + 1]);
    acc_min += x->d * dmin * static_cast<float>(msum);
  }
  return hsum(acc) - acc_min;
}

}  // namespace

void quantize_act(const float* x, int64_t n, BlockQ8Act* out) { quantize_act_blocks(x, n, out); }

float dot_q4_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k4<false>(row, x, n_blocks); }
float dot_q5_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k4<true>(row, x, n_blocks); }

float dot_q6_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  float acc_corr = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i, b += 210, ++x) {
    prefetch_ahead(b, 210);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    int corr = 0;  // sum_j sc_j * sums_j: the -32 of every level
    for (int j = 0; j < 16; ++j) corr += sc[j] * x->sums[j];
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4))};
      for (int s = 0; s < 4; ++s) {
        isum = _mm256_add_epi32(isum, scaled(q[s], x->q + 128 * h + 32 * s, sc[8 * h + 2 * s], sc[8 * h + 2 * s + 1]));
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x->d * d), acc);
    acc_corr += x->d * d * static_cast<float>(32 * corr);
  }
  return hsum(acc) - acc_corr;
}

float dot_iq4_xs(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i levels = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n_blocks; ++i, b += 136, ++x) {
    prefetch_ahead(b, 136);
    const float d = half(b);
    const int scales_h = b[2] | b[3] << 8;
    int16_t ls[8];
    for (int g = 0; g < 8; ++g) ls[g] = static_cast<int16_t>((((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | ((scales_h >> (2 * g)) & 3) << 4) - 32);
    __m256i isum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * k));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      for (int g = 0; g < 2; ++g) {  // group 2k + g: its low nibbles, then its high nibbles
        const __m256i w = _mm256_shuffle_epi8(levels, _mm256_permute2x128_si256(lo, hi, g == 0 ? 0x20 : 0x31));
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + 64 * k + 32 * g));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(ls[2 * k + g])));
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x->d * d), acc);
  }
  return hsum(acc);
}

// The 32-element formats (quant.cc: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q8_0): n32 weight
// blocks, block j against the 32 activations of part j % 8 of activation block j / 8 (a row need
// not be whole 256s: gpt-oss's 2880), each its 32 levels against the block's 32 activations —
// vpmaddubsw (unsigned levels, or for the signed tables and Q8_0's bytes |level| against
// sign(level) a), vpmaddwd by ones, one float multiply-add by the block's scale times the
// activations'; a format's offset (-8, -16, or its f16 minimum) times the 32 activations' sum,
// from the activation block's sums of 16. Used on the AVX-512 machines as well for Q4_0, Q4_1,
// Q5_0 and Q5_1 (256 bits are enough: one block is 32 bytes); MXFP4, IQ4_NL and Q8_0 have an
// AVX-512 kernel there, which leaves a row's last blocks to this one.
template <DType T>
float dot32(const void* row, const BlockQ8Act* x, int64_t n32) {
  constexpr int kBytes = static_cast<int>(dtype_block_bytes(T));
  constexpr bool kTable = T == DType::kIQ4_NL || T == DType::kMXFP4;
  constexpr int kQs = T == DType::kMXFP4 ? 1 : T == DType::kQ4_0 || T == DType::kIQ4_NL || T == DType::kQ8_0 ? 2
                      : T == DType::kQ4_1 ? 4 : T == DType::kQ5_0 ? 6 : 8;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i levels = _mm256_broadcastsi128_si256(
      T == DType::kMXFP4 ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                         : _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
  // Fifth bits (Q5_0 / Q5_1): element e takes byte e / 8 of the 32 bits, tested against bit e % 8.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                          3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  __m256 acc = _mm256_setzero_ps();
  float acc_offset = 0.0f;
  for (int64_t i = 0; i < n32; i += 8, ++x) {
    prefetch_ahead(b, 8 * kBytes);
    for (int j = 0; j < 8 && i + j < n32; ++j, b += kBytes) {
      __m256i w;
      if constexpr (T == DType::kQ8_0) {  // 32 signed bytes as they are
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQs));
      } else {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQs));
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
      }
      if constexpr (T == DType::kQ5_0 || T == DType::kQ5_1) {
        uint32_t qh;
        std::memcpy(&qh, b + kQs - 4, 4);
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
      }
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + 32 * j));
      __m256i p;
      if constexpr (kTable) {
        const __m256i l = _mm256_shuffle_epi8(levels, w);
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(l), _mm256_sign_epi8(a, l));
      } else if constexpr (T == DType::kQ8_0) {  // |w| (-128 is 128 unsigned) against sign(w) a
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
      } else {
        p = _mm256_maddubs_epi16(w, a);
      }
      float d;
      if constexpr (T == DType::kMXFP4) {
        const uint32_t bits = b[0] < 2 ? uint32_t{0x00200000} << b[0] : static_cast<uint32_t>(b[0] - 1) << 23;
        std::memcpy(&d, &bits, 4);
      } else {
        d = half(b);
      }
      const float dx = d * x->d;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(dx), acc);
      const int asum = x->sums[2 * j] + x->sums[2 * j + 1];
      if constexpr (T == DType::kQ4_0) acc_offset -= 8.0f * dx * static_cast<float>(asum);
      if constexpr (T == DType::kQ5_0) acc_offset -= 16.0f * dx * static_cast<float>(asum);
      if constexpr (T == DType::kQ4_1 || T == DType::kQ5_1) acc_offset += half(b + 2) * x->d * static_cast<float>(asum);
    }
  }
  return hsum(acc) + acc_offset;
}

// Q2_K and Q3_K (quant.cc): per half of 128 elements 32 bytes of 2-bit quants, element 32 s + l
// (l < 32) at bits 2s of byte l, sixteen 16-element groups with their own scales. Q2_K: 4-bit
// scale and 4-bit minimum per group, levels 0..3, value (d sc) q - (dmin mn); Q3_K: a third bit in
// hmask (bit 4 h + s of byte l; clear: minus 4), 6-bit signed scales, value (d sc) (u - 4) for u
// = the three bits in 0..7. Both: vpmaddubsw of the unsigned levels, vpmaddwd by each group's
// scale; the minimums and the -4 through the activations' sums of 16, once per super-block.
template <bool kThirdBit>
float dot_k23(const void* row, const BlockQ8Act* x, int64_t n_blocks) {
  constexpr int kBytes = kThirdBit ? 110 : 84, kQs = kThirdBit ? 32 : 16;
  const uint8_t* b = static_cast<const uint8_t*>(row);
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float acc_offset = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i, b += kBytes, ++x) {
    prefetch_ahead(b, kBytes);
    int16_t sc[16];
    int offset = 0;  // Q2_K: sum mn_g sums_g; Q3_K: 4 sum sc_g sums_g
    float d, dmin = 0.0f;
    if constexpr (kThirdBit) {
      const uint8_t* p = b + 96;
      for (int g = 0; g < 16; ++g) {
        const int low = g < 8 ? p[g] & 0xF : p[g - 8] >> 4, top = (p[8 + g % 4] >> (2 * (g / 4))) & 3;
        sc[g] = static_cast<int16_t>((low | top << 4) - 32);
        offset += 4 * sc[g] * x->sums[g];
      }
      d = half(b + 108);
    } else {
      for (int g = 0; g < 16; ++g) {
        sc[g] = static_cast<int16_t>(b[g] & 0xF);
        offset += (b[g] >> 4) * x->sums[g];
      }
      d = half(b + 80), dmin = half(b + 82);
    }
    [[maybe_unused]] const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQs + 32 * h));
      for (int s2 = 0; s2 < 4; ++s2) {
        __m256i w = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s2), three);
        if constexpr (kThirdBit) {
          w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s2), one), 2));
        }
        const int g = 8 * h + 2 * s2;
        isum = _mm256_add_epi32(isum, scaled(w, x->q + 128 * h + 32 * s2, sc[g], sc[g + 1]));
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x->d * d), acc);
    acc_offset += x->d * (kThirdBit ? d : dmin) * static_cast<float>(offset);
  }
  return hsum(acc) - acc_offset;
}

float dot_q2_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k23<false>(row, x, n_blocks); }
float dot_q3_k(const void* row, const BlockQ8Act* x, int64_t n_blocks) { return dot_k23<true>(row, x, n_blocks); }

float dot_q4_0(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kQ4_0>(row, x, n32); }
float dot_q4_1(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kQ4_1>(row, x, n32); }
float dot_q5_0(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kQ5_0>(row, x, n32); }
float dot_q5_1(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kQ5_1>(row, x, n32); }
float dot_iq4_nl(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kIQ4_NL>(row, x, n32); }
float dot_mxfp4(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kMXFP4>(row, x, n32); }
float dot_q8_0(const void* row, const BlockQ8Act* x, int64_t n32) { return dot32<DType::kQ8_0>(row, x, n32); }

}  // namespace combs::cpu::avx2
