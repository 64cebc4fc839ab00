// Scalar dequantization of ggml's block formats (see quant.h). Each function states its block's
// layout; the arithmetic is float32, one operation at a time in the order ggml's reference
// dequantizers use, so that the result is bit-exact (this file is compiled with
// -ffp-contract=off: a fused multiply-add rounds once where the reference rounds twice).
#include "combs/backend/quant.h"

#include <cstring>
#include <limits>

#include "combs/backend/dtype.h"

namespace combs {
namespace {

constexpr int kQK = 256;  // elements of a K-quant super-block

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// IQ4_NL / IQ4_XS: a 4-bit index into these non-uniform levels.
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4: E2M1 values times two (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), scaled by half the
// block's power of two.
constexpr int8_t kFP4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_0, 32 elements in 18 bytes: f16 d; 16 bytes of nibbles. Element j < 16 is the low nibble of
// byte j, element j + 16 its high nibble; value (q - 8) * d.
void dq_q4_0(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 18, y += 32) {
    const float d = half(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
      y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

// Q4_1, 32 in 20: f16 d, f16 m; nibbles as Q4_0; value q * d + m.
void dq_q4_1(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 20, y += 32) {
    const float d = half(b), m = half(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

// The fifth bits of Q5_0/Q5_1: a little-endian uint32 whose bit j belongs to element j.
inline uint32_t high_bits(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

// Q5_0, 32 in 22: f16 d; 4 bytes of fifth bits; nibbles as Q4_0; value (q - 16) * d.
// Q5_1, 32 in 24: f16 d, f16 m; fifth bits; nibbles; value q * d + m.
template <bool kMin>
void dq_q5(const void* src, float* y, int64_t nb) {
  constexpr int kHeader = kMin ? 4 : 2, kBytes = kHeader + 4 + 16;
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += kBytes, y += 32) {
    const float d = half(b);
    [[maybe_unused]] const float m = kMin ? half(b + 2) : 0.0f;
    const uint32_t qh = high_bits(b + kHeader);
    const uint8_t* qs = b + kHeader + 4;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | static_cast<int>((qh >> j) & 1) << 4;
      const int hi = (qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
      if constexpr (kMin) {
        y[j] = static_cast<float>(lo) * d + m;
        y[j + 16] = static_cast<float>(hi) * d + m;
      } else {
        y[j] = static_cast<float>(lo - 16) * d;
        y[j + 16] = static_cast<float>(hi - 16) * d;
      }
    }
  }
}
void dq_q5_0(const void* src, float* y, int64_t nb) { dq_q5<false>(src, y, nb); }
void dq_q5_1(const void* src, float* y, int64_t nb) { dq_q5<true>(src, y, nb); }

// Q8_0, 32 in 34: f16 d; 32 int8; value q * d.
void dq_q8_0(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 34, y += 32) {
    const float d = half(b);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
}

// Q2_K, 256 in 84: 16 bytes of (4-bit scale | 4-bit min << 4), one per 16 elements; 64 bytes of
// 2-bit quants; f16 d, f16 dmin. The quants of each 128 elements are 32 bytes; element
// 32 * s + l (s = 0..3, l < 32) of a half is bits 2s..2s+1 of byte l. Value
// (d * scale) * q - (dmin * min).
void dq_q2_k(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 84) {
    const uint8_t* scales = b;
    const uint8_t* q = b + 16;
    const float d = half(b + 80), dmin = half(b + 82);
    int is = 0;
    for (int n = 0; n < kQK; n += 128, q += 32) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int part = 0; part < 2; ++part) {
          const uint8_t sc = scales[is++];
          const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[16 * part + l] >> shift) & 3) - ml;
        }
      }
    }
  }
}

// The 16 six-bit scales of Q3_K, packed in 12 bytes: byte j < 8 holds scale j's low 4 bits
// (j < 8: low nibble of byte j; 8..15: high nibble of byte j - 8); their top 2 bits are bit pairs of
// bytes 8..11 (scale s: byte 8 + s % 4, bits 2 * (s / 4)).
inline void q3k_scales(const uint8_t* p, int out[16]) {
  for (int s = 0; s < 16; ++s) {
    const int low = s < 8 ? p[s] & 0xF : p[s - 8] >> 4;
    const int top = (p[8 + s % 4] >> (2 * (s / 4))) & 3;
    out[s] = (low | top << 4) - 32;
  }
}

// Q3_K, 256 in 110: 32 bytes of high bits (hmask), 64 bytes of 2-bit quants, 12 bytes of scales, f16
// d. Element 32 * s + l of each half of 128 (l < 32) takes bits 2s of byte l of the half's 32 quant
// bytes, minus 4 where bit (4 * half + s) of hmask byte l is clear. Value (d * scale) * q.
void dq_q3_k(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 110) {
    const uint8_t* hm = b;
    const uint8_t* q = b + 32;
    int scales[16];
    q3k_scales(b + 96, scales);
    const float d = half(b + 108);
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < kQK; n += 128, q += 32) {
      for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
        for (int part = 0; part < 2; ++part) {
          const float dl = d * static_cast<float>(scales[is++]);
          for (int l = 16 * part; l < 16 * part + 16; ++l) {
            const int v = ((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4);
            *y++ = dl * static_cast<float>(v);
          }
        }
      }
    }
  }
}

// Q4_K, 256 in 144: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. Each 64
// elements are 32 bytes: the low nibbles (scale pair 2k), then the high nibbles (pair 2k + 1).
// Value (d * scale) * q - (dmin * min).
// Q5_K, 256 in 176: as Q4_K with 32 bytes of fifth bits after the scales: element l of the
// k-th 32-element group (k = 0..7) adds 16 where bit k of byte l is set.
template <bool kFifthBit>
void dq_k45(const void* src, float* y, int64_t nb) {
  constexpr int kBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += kBytes) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    [[maybe_unused]] const uint8_t* qh = b + 16;
    const uint8_t* ql = b + kQuants;
    // Group j's fifth bit of element l (0 without fifth bits).
    auto fifth = [&](int l, int j) { return kFifthBit ? ((qh[l] >> j) & 1) * 16 : 0; };
    for (int j = 0; j < 8; j += 2, ql += 32) {
      int sc, mn;
      k4_scale_min(j, scales, &sc, &mn);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
      k4_scale_min(j + 1, scales, &sc, &mn);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>((ql[l] & 0xF) + fifth(l, j)) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>((ql[l] >> 4) + fifth(l, j + 1)) - m2;
    }
  }
}
void dq_q4_k(const void* src, float* y, int64_t nb) { dq_k45<false>(src, y, nb); }
void dq_q5_k(const void* src, float* y, int64_t nb) { dq_k45<true>(src, y, nb); }

// Q6_K, 256 in 210: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one
// per 16 elements), f16 d. Per 128 elements (64 low bytes, 32 high bytes, 8 scales), element
// l + 32 * s (l < 32, s = 0..3) is nibble (s / 2) of low byte l + 32 * (s % 2) with bits 2s..2s+1
// of high byte l on top, minus 32. Value (d * scale) * q.
void dq_q6_k(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int n = 0; n < kQK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        for (int s = 0; s < 4; ++s) {
          const int lo = s < 2 ? ql[l + 32 * s] & 0xF : ql[l + 32 * (s - 2)] >> 4;
          const int q = (lo | ((qh[l] >> (2 * s)) & 3) << 4) - 32;
          y[l + 32 * s] = d * static_cast<float>(sc[l / 16 + 2 * s]) * static_cast<float>(q);
        }
      }
    }
  }
}

// IQ4_NL, 32 in 18: f16 d; nibbles as Q4_0, each an index into kIQ4Levels; value d * level.
void dq_iq4_nl(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 18, y += 32) {
    const float d = half(b);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(kIQ4Levels[b[2 + j] & 0xF]);
      y[j + 16] = d * static_cast<float>(kIQ4Levels[b[2 + j] >> 4]);
    }
  }
}

// IQ4_XS, 256 in 136: f16 d; uint16 of high scale bits (2 per 32 elements); 4 bytes of low scale
// nibbles (group k: nibble k % 2 of byte k / 2); 128 bytes of IQ4_NL nibbles, 16 bytes a group.
// Group scale (low | high << 4) - 32; value (d * scale) * level.
void dq_iq4_xs(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 136) {
    const float d = half(b);
    const int scales_h = b[2] | b[3] << 8;
    const uint8_t* scales_l = b + 4;
    const uint8_t* qs = b + 8;
    for (int k = 0; k < 8; ++k, qs += 16, y += 32) {
      const int ls = ((scales_l[k / 2] >> (4 * (k % 2))) & 0xF) | ((scales_h >> (2 * k)) & 3) << 4;
      const float dl = d * static_cast<float>(ls - 32);
      for (int j = 0; j < 16; ++j) {
        y[j] = dl * static_cast<float>(kIQ4Levels[qs[j] & 0xF]);
        y[j + 16] = dl * static_cast<float>(kIQ4Levels[qs[j] >> 4]);
      }
    }
  }
}

// MXFP4, 32 in 17: an E8M0 exponent e, then nibbles as Q4_0, each an index into kFP4Levels. The
// scale is 2^(e - 128) (half of 2^(e - 127), as the levels are doubled): for e < 2 a subnormal.
void dq_mxfp4(const void* src, float* y, int64_t nb) {
  const uint8_t* b = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < nb; ++i, b += 17, y += 32) {
    const uint32_t bits = b[0] < 2 ? uint32_t{0x00200000} << b[0] : static_cast<uint32_t>(b[0] - 1) << 23;
    float d;
    std::memcpy(&d, &bits, 4);
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(kFP4Levels[b[1 + j] & 0xF]) * d;
      y[j + 16] = static_cast<float>(kFP4Levels[b[1 + j] >> 4]) * d;
    }
  }
}

}  // namespace

const std::vector<QuantFormat>& quant_formats() {
  // Geometry from dtype.h's constexpr tables, the one place it is written.
  auto format = [](DType t, uint32_t ggml_type, std::string_view name, DequantizeFn fn) {
    return QuantFormat{t, ggml_type, name, static_cast<int>(dtype_block_elems(t)), static_cast<int>(dtype_block_bytes(t)), fn};
  };
  static const std::vector<QuantFormat> formats = {
      format(DType::kQ4_0, 2, "Q4_0", dq_q4_0),        format(DType::kQ4_1, 3, "Q4_1", dq_q4_1),
      format(DType::kQ5_0, 6, "Q5_0", dq_q5_0),        format(DType::kQ5_1, 7, "Q5_1", dq_q5_1),
      format(DType::kQ8_0, 8, "Q8_0", dq_q8_0),        format(DType::kQ2_K, 10, "Q2_K", dq_q2_k),
      format(DType::kQ3_K, 11, "Q3_K", dq_q3_k),       format(DType::kQ4_K, 12, "Q4_K", dq_q4_k),
      format(DType::kQ5_K, 13, "Q5_K", dq_q5_k),       format(DType::kQ6_K, 14, "Q6_K", dq_q6_k),
      format(DType::kIQ4_NL, 20, "IQ4_NL", dq_iq4_nl), format(DType::kIQ4_XS, 23, "IQ4_XS", dq_iq4_xs),
      format(DType::kMXFP4, 39, "MXFP4", dq_mxfp4),
  };
  return formats;
}

const QuantFormat* quant_format(uint32_t ggml_type) {
  for (const QuantFormat& f : quant_formats()) {
    if (f.ggml_type == ggml_type) return &f;
  }
  return nullptr;
}

const QuantFormat* quant_format(DType t) {
  for (const QuantFormat& f : quant_formats()) {
    if (f.dtype == t) return &f;
  }
  return nullptr;
}

std::string ggml_type_name(uint32_t t) {
  static constexpr std::string_view kNames[] = {
      "F32",     "F16",           "Q4_0",          "Q4_1",          "Q4_2 (removed)", "Q4_3 (removed)",
      "Q5_0",    "Q5_1",          "Q8_0",          "Q8_1",          "Q2_K",           "Q3_K",
      "Q4_K",    "Q5_K",          "Q6_K",          "Q8_K",          "IQ2_XXS",        "IQ2_XS",
      "IQ3_XXS", "IQ1_S",         "IQ4_NL",        "IQ3_S",         "IQ2_S",          "IQ4_XS",
      "I8",      "I16",           "I32",           "I64",           "F64",            "IQ1_M",
      "BF16",    "Q4_0_4_4 (removed)", "Q4_0_4_8 (removed)", "Q4_0_8_8 (removed)", "TQ1_0", "TQ2_0",
      "IQ4_NL_4_4 (removed)", "IQ4_NL_4_8 (removed)", "IQ4_NL_8_8 (removed)", "MXFP4", "NVFP4", "Q1_0",
      "Q2_0"};
  if (t < std::size(kNames)) return std::string(kNames[t]);
  return "ggml type " + std::to_string(t);
}

int64_t quant_bytes(const QuantFormat& f, int64_t elems) {
  if (elems < 0 || elems % f.block_elems != 0) return -1;
  const int64_t blocks = elems / f.block_elems;
  if (blocks > std::numeric_limits<int64_t>::max() / f.block_bytes) return -1;
  return blocks * f.block_bytes;
}

}  // namespace combs
