// Writers of ggml's block formats (quant.h's QuantFormat::quantize): round to nearest with a search
// of each block's (and sub-block's) scale, then the layouts that quant.cc's dequantizers read. Not
// llama.cpp's quantizers (no importance matrix, a simpler search); the layout is the same, so
// llama.cpp reads these blocks as its own (tests: combs' blocks against the NumPy reference).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "combs/backend/dtype.h"
#include "combs/backend/quant.h"
#include "cpu/kernels/scale_search.h"

namespace combs {
namespace {

void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}
float f16_round(float v) { return f16_to_f32(f32_to_f16(v)); }

// std::lround's rounding (halves away from zero), clamped to lo..hi, inline: the scale searches
// call it for every value they try, and libm's lroundf was 40% of writing a Q4_K_M file. Values
// beyond the range (infinities too) clamp to its ends; NaN gives the level nearest 0.
int nearest(float v, int lo, int hi) {
  if (!(v == v)) return std::clamp(0, lo, hi);
  const float c = std::clamp(v, static_cast<float>(lo) - 1.0f, static_cast<float>(hi) + 1.0f);
  // Adding the float just below 1/2 and truncating rounds halves away from zero without a
  // branch (equal to lround on every float of magnitude up to 200, checked exhaustively).
  const float t = std::trunc(c + std::copysign(0.49999997f, c));
  return std::clamp(static_cast<int>(t), lo, hi);
}

// Where the CPU has AVX-512, scale_search.h's vectors take the searches' divisions and roundings:
// each value's the same operations, the sums over the values still in order here.
bool wide() {
  static const bool v = __builtin_cpu_supports("avx512f");
  return v;
}

// q[i] = nearest((x[i] + off) / d, lo, hi), i < n.
void levels(const float* x, int n, float off, float d, int lo, int hi, int* q) {
  if (wide() && n % 16 == 0) return cpu::avx512::levels(x, n, off, d, lo, hi, q);
  for (int i = 0; i < n; ++i) q[i] = nearest((x[i] + off) / d, lo, hi);
}

// The scale d of n values whose levels are the integers lo..hi (value d * q) that minimizes the
// squared error, among scales that put the value of largest magnitude near an end of the range
// (steps of a tenth of a level, up to half a level either way) and the least-squares refit of
// the best of them.
float best_scale(const float* x, int n, int lo, int hi) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
  if (m == 0.0f) return 0.0f;
  // (x[i] + 0) / d rounds as x[i] / d does: only -0 becomes +0, both level 0.
  int q[32];
  auto error = [&](float d) {
    if (d == 0.0f) return std::numeric_limits<double>::infinity();
    levels(x, n, 0.0f, d, lo, hi, q);
    double e = 0;
    for (int i = 0; i < n; ++i) {
      const double r = x[i] - d * q[i];
      e += r * r;
    }
    return e;
  };
  auto refit = [&](float d) {
    levels(x, n, 0.0f, d, lo, hi, q);
    double qx = 0, qq = 0;
    for (int i = 0; i < n; ++i) qx += double(q[i]) * x[i], qq += double(q[i]) * q[i];
    return qq > 0 ? static_cast<float>(qx / qq) : d;
  };
  // The candidates in order: the first, then each end's (the errors of all at once where the CPU
  // has AVX-512: the same sums, scale_search.h), the best the first of the least error.
  float d[23];
  int count = 0;
  d[count++] = m / static_cast<float>(m > 0 ? hi : lo);
  for (int end : {lo, hi}) {
    for (int k = -5; k <= 5; ++k) {
      const float level = static_cast<float>(end) + 0.1f * static_cast<float>(k);
      if (level != 0.0f) d[count++] = m / level;
    }
  }
  double e[23];
  if (wide() && std::all_of(d, d + count, [](float v) { return v != 0.0f; })) {
    cpu::avx512::scale_errors(x, n, lo, hi, d, count, e);
  } else {
    for (int j = 0; j < count; ++j) e[j] = error(d[j]);
  }
  float best = d[0];
  double best_e = e[0];
  for (int j = 1; j < count; ++j)
    if (e[j] < best_e) best_e = e[j], best = d[j];
  const float r = refit(best);
  return error(r) < best_e ? r : best;
}

// The (d, offset) of n values whose levels are 0..hi (value d * q - offset, offset >= 0) that
// minimizes the squared error: from the range's ends, then least-squares refits.
void best_scale_offset(const float* x, int n, int hi, float* d_out, float* off_out) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) mn = std::min(mn, x[i]), mx = std::max(mx, x[i]);
  mn = std::min(mn, 0.0f);  // the offset only lowers the values
  if (mx <= mn) {
    *d_out = 0.0f, *off_out = -mn;
    return;
  }
  int q[32];
  auto error = [&](float d, float off) {
    levels(x, n, off, d, 0, hi, q);
    double e = 0;
    for (int i = 0; i < n; ++i) {
      const double r = x[i] - (d * q[i] - off);
      e += r * r;
    }
    return e;
  };
  float best_d = (mx - mn) / static_cast<float>(hi), best_off = -mn;
  double best_e = error(best_d, best_off);
  for (int k = -2; k <= 2; ++k) {
    float d = (mx - mn) / (static_cast<float>(hi) + 0.2f * static_cast<float>(k)), off = -mn;
    for (int iter = 0; iter < 2; ++iter) {
      if (d <= 0.0f) break;
      if (const double e = error(d, off); e < best_e) best_e = e, best_d = d, best_off = off;
      // Least squares of x ~ d q - off over the current levels, the offset kept >= 0.
      double sq = 0, sx = 0, sqq = 0, sqx = 0;
      levels(x, n, off, d, 0, hi, q);
      for (int i = 0; i < n; ++i) sq += q[i], sx += x[i], sqq += double(q[i]) * q[i], sqx += double(q[i]) * x[i];
      const double det = n * sqq - sq * sq;
      if (det <= 0) break;
      double nd = (n * sqx - sq * sx) / det, noff = -(sx - nd * sq) / n;
      if (noff < 0) noff = 0, nd = sqq > 0 ? sqx / sqq : nd;
      d = static_cast<float>(nd), off = static_cast<float>(noff);
    }
  }
  *d_out = best_d, *off_out = best_off;
}

// ---- 32-element formats -------------------------------------------------------------------

// Q4_0 / Q5_0: symmetric levels -8..7 / -16..15 with an f16 scale.
template <int kBits>
void q_sym32(const float* x, void* out, int64_t nb) {
  constexpr int kBytes = kBits == 4 ? 18 : 22, lo = -(1 << (kBits - 1)), hi = (1 << (kBits - 1)) - 1;
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 32, b += kBytes) {
    std::memset(b, 0, kBytes);
    const float d = f16_round(best_scale(x, 32, lo, hi));
    put_f16(b, d);
    int v[32];
    for (int j = 0; j < 32; ++j) v[j] = (d != 0.0f ? nearest(x[j] / d, lo, hi) : 0) - lo;  // 0 .. 2^bits - 1
    uint8_t* qs = b + (kBits == 4 ? 2 : 6);
    for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((v[j] & 15) | (v[j + 16] & 15) << 4);
    if constexpr (kBits == 5) {
      uint32_t qh = 0;
      for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>(v[j] >> 4) << j;
      for (int k = 0; k < 4; ++k) b[2 + k] = static_cast<uint8_t>(qh >> (8 * k));
    }
  }
}

// Q4_1 / Q5_1: levels 0..15 / 0..31, value d q + m (f16 d, f16 m).
template <int kBits>
void q_asym32(const float* x, void* out, int64_t nb) {
  constexpr int kBytes = kBits == 4 ? 20 : 24, hi = (1 << kBits) - 1;
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 32, b += kBytes) {
    std::memset(b, 0, kBytes);
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
    // Any-signed minimum: shift so the offset search (offset >= 0) sees values >= min.
    float shifted[32];
    for (int j = 0; j < 32; ++j) shifted[j] = x[j] - mn;
    float d, off;
    best_scale_offset(shifted, 32, hi, &d, &off);
    d = f16_round(d);
    const float m = f16_round(mn - off);
    put_f16(b, d), put_f16(b + 2, m);
    int v[32];
    for (int j = 0; j < 32; ++j) v[j] = d != 0.0f ? nearest((x[j] - m) / d, 0, hi) : 0;
    uint8_t* qs = b + (kBits == 4 ? 4 : 8);
    for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((v[j] & 15) | (v[j + 16] & 15) << 4);
    if constexpr (kBits == 5) {
      uint32_t qh = 0;
      for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>(v[j] >> 4) << j;
      for (int k = 0; k < 4; ++k) b[4 + k] = static_cast<uint8_t>(qh >> (8 * k));
    }
  }
}

// Q8_0: d = max|x| / 127 (stored f16), q = nearest(x / d) — the rounding combs' Q8_0 files have
// always had.
void q_q8_0(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 32, b += 34) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(nearest(x[j] * inv, -127, 127)));
  }
}

// Non-uniform 16-level tables (quant.cc's): the index of the level nearest v.
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kFP4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
int nearest_level(float v, const int8_t (&levels)[16]) {
  if (&levels == &kIQ4Levels) {  // ascending: the two around v
    const int8_t* up = std::lower_bound(levels, levels + 16, v, [](int8_t l, float x) { return l < x; });
    if (up == levels) return 0;
    if (up == levels + 16) return 15;
    return v - up[-1] <= *up - v ? static_cast<int>(up - levels) - 1 : static_cast<int>(up - levels);
  }
  int best = 0;
  for (int i = 1; i < 16; ++i)
    if (std::fabs(v - levels[i]) < std::fabs(v - levels[best])) best = i;
  return best;
}
// The scale d of n values over the IQ4 levels (value d * level) that minimizes the squared error.
float best_iq4_scale(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
  if (m == 0.0f) return 0.0f;
  float best = m / -127.0f;
  double best_e = std::numeric_limits<double>::infinity();
  for (float end : {-127.0f, 113.0f}) {
    for (int k = -6; k <= 6; k += 2) {
      const float d = m / (end * (1.0f + 0.015f * static_cast<float>(k)));
      double e = 0;
      for (int i = 0; i < n; ++i) {
        const double r = x[i] - d * kIQ4Levels[nearest_level(x[i] / d, kIQ4Levels)];
        e += r * r;
      }
      if (e < best_e) best_e = e, best = d;
    }
  }
  return best;
}

void q_iq4_nl(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 32, b += 18) {
    const float d = f16_round(best_iq4_scale(x, 32));
    put_f16(b, d);
    for (int j = 0; j < 16; ++j) {
      const int lo = d != 0.0f ? nearest_level(x[j] / d, kIQ4Levels) : 8, hi = d != 0.0f ? nearest_level(x[j + 16] / d, kIQ4Levels) : 8;
      b[2 + j] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}

// MXFP4: a power-of-two scale 2^(e - 128) over the doubled E2M1 levels (largest 12).
void q_mxfp4(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 32, b += 17) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    int best_e = 2;
    if (amax > 0.0f) {
      const int top = std::clamp(static_cast<int>(std::ceil(std::log2(amax / 12.0f))) + 128, 2, 254);
      double best_err = std::numeric_limits<double>::infinity();
      for (int e = std::max(2, top - 1); e <= std::min(254, top + 1); ++e) {
        const float d = std::ldexp(1.0f, e - 128);
        double err = 0;
        for (int j = 0; j < 32; ++j) {
          const double r = x[j] - d * kFP4Levels[nearest_level(x[j] / d, kFP4Levels)];
          err += r * r;
        }
        if (err < best_err) best_err = err, best_e = e;
      }
    }
    b[0] = static_cast<uint8_t>(best_e);
    const float d = std::ldexp(1.0f, best_e - 128);
    for (int j = 0; j < 16; ++j) {
      b[1 + j] = static_cast<uint8_t>(nearest_level(x[j] / d, kFP4Levels) | nearest_level(x[j + 16] / d, kFP4Levels) << 4);
    }
  }
}

// ---- K-quants (256-element super-blocks) ----------------------------------------------------

// Sub-block scales s[k] (k < n) to unsigned `bits`-bit integers under one f16 super-scale:
// d = max / (2^bits - 1); returns d, writes the integers.
float super_scale(const float* s, int n, int bits, int* q) {
  float mx = 0.0f;
  for (int k = 0; k < n; ++k) mx = std::max(mx, s[k]);
  const int top = (1 << bits) - 1;
  const float d = f16_round(mx / static_cast<float>(top));
  for (int k = 0; k < n; ++k) q[k] = d > 0.0f ? nearest(s[k] / d, 0, top) : 0;
  return d;
}

// Q4_K / Q5_K: eight groups of 32, each (d sc) q - (dmin mn), 6-bit sc and mn, levels 0..15/31.
template <int kBits>
void q_k45(const float* x, void* out, int64_t nb) {
  constexpr int kBytes = kBits == 4 ? 144 : 176, hi = (1 << kBits) - 1;
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 256, b += kBytes) {
    std::memset(b, 0, kBytes);
    float ds[8], offs[8];
    for (int g = 0; g < 8; ++g) best_scale_offset(x + 32 * g, 32, hi, &ds[g], &offs[g]);
    int sc[8], mn[8];
    const float d = super_scale(ds, 8, 6, sc), dmin = super_scale(offs, 8, 6, mn);
    put_f16(b, d), put_f16(b + 2, dmin);
    uint8_t* s = b + 4;
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        s[j] |= static_cast<uint8_t>(sc[j]), s[j + 4] |= static_cast<uint8_t>(mn[j]);
      } else {
        s[j + 4] = static_cast<uint8_t>((sc[j] & 0xF) | (mn[j] & 0xF) << 4);
        s[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
        s[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
      }
    }
    uint8_t* qh = b + 16;
    uint8_t* qs = b + (kBits == 4 ? 16 : 48);
    for (int e = 0; e < 256; ++e) {
      const int g = e / 32, l = e % 32;
      const float dl = d * static_cast<float>(sc[g]), ml = dmin * static_cast<float>(mn[g]);
      const int v = dl > 0.0f ? nearest((x[e] + ml) / dl, 0, hi) : 0;
      qs[32 * (g / 2) + l] |= static_cast<uint8_t>((v & 0xF) << (4 * (g % 2)));
      if constexpr (kBits == 5) qh[l] |= static_cast<uint8_t>((v >> 4) << g);
    }
  }
}

// Q2_K: sixteen groups of 16, (d sc) q - (dmin mn) with 4-bit sc and mn, levels 0..3.
void q_q2_k(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 256, b += 84) {
    std::memset(b, 0, 84);
    float ds[16], offs[16];
    for (int g = 0; g < 16; ++g) best_scale_offset(x + 16 * g, 16, 3, &ds[g], &offs[g]);
    int sc[16], mn[16];
    const float d = super_scale(ds, 16, 4, sc), dmin = super_scale(offs, 16, 4, mn);
    for (int g = 0; g < 16; ++g) b[g] = static_cast<uint8_t>(sc[g] | mn[g] << 4);
    put_f16(b + 80, d), put_f16(b + 82, dmin);
    for (int e = 0; e < 256; ++e) {
      const int g = e / 16, half = e / 128, s = (e % 128) / 32, l = e % 32;
      const float dl = d * static_cast<float>(sc[g]), ml = dmin * static_cast<float>(mn[g]);
      const int v = dl > 0.0f ? nearest((x[e] + ml) / dl, 0, 3) : 0;
      b[16 + 32 * half + l] |= static_cast<uint8_t>(v << (2 * s));
    }
  }
}

// Signed sub-block scales under one f16 super-scale, as integers in [-top, top].
float signed_super_scale(const float* s, int n, int top, int* q) {
  float mx = 0.0f;
  for (int k = 0; k < n; ++k) mx = std::max(mx, std::fabs(s[k]));
  const float d = f16_round(mx / static_cast<float>(top));
  for (int k = 0; k < n; ++k) q[k] = d > 0.0f ? nearest(s[k] / d, -top, top) : 0;
  return d;
}

// The levels of sixteen groups of 16 under scales d sc[g] (all 0 where that is 0): a super-block's
// values once its scales are set (Q3_K, Q6_K).
void group_levels(const float* x, float d, const int* sc, int lo, int hi, int* q) {
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(sc[g]);
    if (dl != 0.0f) {
      levels(x + 16 * g, 16, 0.0f, dl, lo, hi, q + 16 * g);
    } else {
      std::fill(q + 16 * g, q + 16 * g + 16, 0);
    }
  }
}

// Q3_K: sixteen groups of 16, (d sc) q with 6-bit signed sc, levels -4..3 (two bits in qs, the
// third in hmask).
void q_q3_k(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 256, b += 110) {
    std::memset(b, 0, 110);
    float s[16];
    for (int g = 0; g < 16; ++g) s[g] = best_scale(x + 16 * g, 16, -4, 3);
    int sc[16];
    const float d = signed_super_scale(s, 16, 31, sc);
    uint8_t* p = b + 96;
    for (int g = 0; g < 16; ++g) {
      const int v = sc[g] + 32;  // 1 .. 63
      p[g < 8 ? g : g - 8] |= static_cast<uint8_t>((v & 0xF) << (g < 8 ? 0 : 4));
      p[8 + g % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (g / 4)));
    }
    put_f16(b + 108, d);
    int q[256];
    group_levels(x, d, sc, -4, 3, q);
    for (int e = 0; e < 256; ++e) {
      const int half = e / 128, s2 = (e % 128) / 32, l = e % 32;
      const int v = q[e] + 4;  // 0 .. 7
      b[32 + 32 * half + l] |= static_cast<uint8_t>((v & 3) << (2 * s2));
      if (v >> 2) b[l] |= static_cast<uint8_t>(1 << (4 * half + s2));
    }
  }
}

// Q6_K: sixteen groups of 16, (d sc) q with int8 sc, levels -32..31.
void q_q6_k(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 256, b += 210) {
    std::memset(b, 0, 210);
    float s[16];
    for (int g = 0; g < 16; ++g) s[g] = best_scale(x + 16 * g, 16, -32, 31);
    int sc[16];
    const float d = signed_super_scale(s, 16, 127, sc);
    for (int g = 0; g < 16; ++g) b[192 + g] = static_cast<uint8_t>(static_cast<int8_t>(sc[g]));
    put_f16(b + 208, d);
    int q[256];
    group_levels(x, d, sc, -32, 31, q);
    for (int e = 0; e < 256; ++e) {
      const int half = e / 128, s2 = (e % 128) / 32, l = e % 32;
      const int v = q[e] + 32;  // 0 .. 63
      b[64 * half + l + 32 * (s2 % 2)] |= static_cast<uint8_t>((v & 0xF) << (4 * (s2 / 2)));
      b[128 + 32 * half + l] |= static_cast<uint8_t>((v >> 4) << (2 * s2));
    }
  }
}

// IQ4_XS: eight groups of 32 over the IQ4 levels, (d (ls - 32)) level with a 6-bit ls.
void q_iq4_xs(const float* x, void* out, int64_t nb) {
  uint8_t* b = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < nb; ++i, x += 256, b += 136) {
    std::memset(b, 0, 136);
    float s[8];
    for (int g = 0; g < 8; ++g) s[g] = best_iq4_scale(x + 32 * g, 32);
    int ls[8];
    const float d = signed_super_scale(s, 8, 31, ls);
    put_f16(b, d);
    uint16_t scales_h = 0;
    for (int g = 0; g < 8; ++g) {
      const int v = ls[g] + 32;  // 1 .. 63
      b[4 + g / 2] |= static_cast<uint8_t>((v & 0xF) << (4 * (g % 2)));
      scales_h |= static_cast<uint16_t>((v >> 4) << (2 * g));
    }
    std::memcpy(b + 2, &scales_h, 2);
    for (int g = 0; g < 8; ++g) {
      const float dl = d * static_cast<float>(ls[g]);
      for (int j = 0; j < 16; ++j) {
        const int lo = dl != 0.0f ? nearest_level(x[32 * g + j] / dl, kIQ4Levels) : 8;
        const int hi = dl != 0.0f ? nearest_level(x[32 * g + j + 16] / dl, kIQ4Levels) : 8;
        b[8 + 16 * g + j] = static_cast<uint8_t>(lo | hi << 4);
      }
    }
  }
}

}  // namespace

QuantizeFn quantizer(DType t) {
  switch (t) {
    case DType::kQ4_0: return q_sym32<4>;
    case DType::kQ5_0: return q_sym32<5>;
    case DType::kQ4_1: return q_asym32<4>;
    case DType::kQ5_1: return q_asym32<5>;
    case DType::kQ8_0: return q_q8_0;
    case DType::kIQ4_NL: return q_iq4_nl;
    case DType::kMXFP4: return q_mxfp4;
    case DType::kQ2_K: return q_q2_k;
    case DType::kQ3_K: return q_q3_k;
    case DType::kQ4_K: return q_k45<4>;
    case DType::kQ5_K: return q_k45<5>;
    case DType::kQ6_K: return q_q6_k;
    case DType::kIQ4_XS: return q_iq4_xs;
    default: return nullptr;
  }
}

}  // namespace combs
