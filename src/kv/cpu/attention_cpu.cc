#include "kv/cpu/attention_cpu.h"

#include "backend/cpu/vec_math.h"
#include "combs/backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Internal functions only: the vector ABI across them does not matter.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's AVX-512 intrinsics fill lanes from _mm*_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive: every lane used here is written).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace combs::cpu {
namespace {

constexpr int kKeyBlock = 64;  // keys converted and scored together
constexpr int kRowBlock = 32;  // query rows (token x head of a GQA group) per work item

// Rows of K/V, q and activations as f32 (the backend's conversion, with F16C where present).
inline void load_f32(const void* src, DType t, float* dst, int64_t n) { dequantize_row(src, t, dst, n); }

inline void store_f32(const float* src, DType t, void* dst, int64_t n) { quantize_row(src, t, dst, n); }

inline const char* at(const void* base, int64_t elem, DType t) {
  return static_cast<const char*>(base) + elem * static_cast<int64_t>(dtype_size(t));
}
inline char* at(void* base, int64_t elem, DType t) {
  return static_cast<char*>(base) + elem * static_cast<int64_t>(dtype_size(t));
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// 16 floats: one AVX-512 register, two AVX2 ones; GCC lowers it to what -march offers.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef float f32x8 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16u*>(p); }

inline f32x16 splat16(float x) {
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = x;
  return v;
}

// a * b + c, fused where the target has FMA. The scores' products are written with it: the
// compiler contracts a * b + c into an FMA where it sees fit, differently in different code paths,
// and a score must be the same bits in each (an intrinsic is never contracted).
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  f32x16 r;
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, 64), std::memcpy(y, &b, 64), std::memcpy(z, &c, 64);
  const __m256 lo = _mm256_fmadd_ps(x[0], y[0], z[0]), hi = _mm256_fmadd_ps(x[1], y[1], z[1]);
  std::memcpy(&r, &lo, 32), std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  return a * b + c;
#endif
}
inline void store16(float* p, f32x16 v) { *reinterpret_cast<f32x16u*>(p) = v; }
typedef int32_t i32x16 __attribute__((vector_size(64)));

// The sums of 16 vectors' lanes: lane j of the result is v[j]'s lanes summed, by the same tree for
// every j (lanes i + 8, then i + 4, i + 2, i + 1 apart), the sixteen sums sharing each step's
// shuffles and adds: 45 operations for 16 sums, where summing each vector on its own takes ~10.
inline f32x16 hsum16(const f32x16* v) {
  constexpr i32x16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr i32x16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  constexpr i32x16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  constexpr i32x16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  constexpr i32x16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  constexpr i32x16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  constexpr i32x16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  constexpr i32x16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  f32x16 a[8], b[4], c[2];
  for (int m = 0; m < 8; ++m)  // vectors 2m, 2m + 1: lanes 0-7 and 8-15
    a[m] = __builtin_shuffle(v[2 * m], v[2 * m + 1], lo8) + __builtin_shuffle(v[2 * m], v[2 * m + 1], hi8);
  for (int m = 0; m < 4; ++m)  // vectors 4m .. 4m + 3: four lanes each
    b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo4) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi4);
  for (int m = 0; m < 2; ++m)  // vectors 8m .. 8m + 7: two lanes each
    c[m] = __builtin_shuffle(b[2 * m], b[2 * m + 1], lo2) + __builtin_shuffle(b[2 * m], b[2 * m + 1], hi2);
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

// One vector's lanes summed by hsum16's tree (the same number as its lane for that vector).
inline float hsum_tree(f32x16 v) {
  f32x8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const f32x8 s = lo + hi;  // lanes i and i + 8
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// q . k over NV vectors of 16 before the lanes are summed: one chain, q[0] k[0] first.
template <int NV>
inline f32x16 dot_lanes(const f32x16* q, const float* k) {
  f32x16 x = q[0] * load16(k);
  for (int j = 1; j < NV; ++j) x = fma16(q[j], load16(k + 16 * j), x);
  return x;
}

// s[r * stride + c] = q_r . k_c for rows r < n_rows and keys c < count[r].
void block_scores(const float* q, int n_rows, const float* const* krows, const int* count, int hd,
                  float* s, int stride) {
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < count[r]; ++c) s[r * stride + c] = dot(q + r * hd, krows[c], hd);
}

// acc[0..hd) += sum_c p[c] * rows[c][0..hd).
void accumulate_rows(float* acc, const float* p, const float* const* rows, int count, int hd) {
  for (int c = 0; c < count; ++c) {
    const float pc = p[c];
    const float* v = rows[c];
#pragma omp simd
    for (int d = 0; d < hd; ++d) acc[d] += pc * v[d];
  }
}

struct Scratch {
  std::vector<float> q, acc, m, l, s, kf, vf;
  void fit(size_t rows, size_t hd, size_t keys) {
    if (q.size() < rows * hd) q.resize(rows * hd), acc.resize(rows * hd);
    if (m.size() < rows) m.resize(rows), l.resize(rows);
    if (s.size() < rows * keys) s.resize(rows * keys);
    if (kf.size() < keys * hd) kf.resize(keys * hd), vf.resize(keys * hd);
  }
};

// Rows of one work item: tokens [i0, i1) x the n_rep query heads of KV head g.
struct Item {
  const SeqWork* seq;
  int g;           // KV head (the first of [g, g_end) for the fast path)
  int64_t r0, r1;  // rows r = i * n_rep + j
  int g_end;
};

struct Problem {
  int n_kv, n_rep, hd;
  int64_t n_q;
  const Tensor* q;
  const Tensor* out;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  const float* sinks;  // null: none

  // Row r's sink (its query head's, r = token * n_rep + head within the group); -inf: none.
  float sink_of(const Item& it, int64_t r) const {
    return sinks != nullptr ? sinks[int64_t{it.g} * n_rep + r % n_rep] : -std::numeric_limits<float>::infinity();
  }
  // 1 / the softmax's denominator of row r of item `it` whose running maximum is m and sum l;
  // with a sink, its e^{sink} joins the sum and acc [hd] is rescaled where it raises the maximum.
  float denominator_inv(const Item& it, int64_t r, float m, float l, float* acc) const {
    if (sinks != nullptr) {
      const float sink = sink_of(it, r);
      if (sink > m) {
        const float c = std::exp(m - sink);
        for (int d = 0; d < hd; ++d) acc[d] *= c;
        l = l * c + 1.0f;
      } else {
        l += std::exp(sink - m);
      }
    }
    return 1.0f / l;
  }

  // The first key a query whose last visible key is `horizon` sees.
  int64_t first_key(int64_t horizon) const { return window > 0 ? std::max<int64_t>(0, horizon - window + 1) : 0; }
  // Scaled scores s[0, n) through the softcap.
  void cap(float* s, int n) const {
    if (softcap > 0.0f) cpu::softcap(s, n, softcap);  // the runner's logit softcap, on a row of scores
  }

  // Loads rows [r0, r1) of an item into dst ([rows, hd]), pre-scaled.
  void load_queries(const Item& it, float* dst) const {
    for (int64_t r = it.r0; r < it.r1; ++r) {
      const int64_t tok = it.seq->row + r / n_rep;
      const int64_t head = int64_t{it.g} * n_rep + r % n_rep;
      float* d = dst + (r - it.r0) * hd;
      load_f32(at(q->data(), (tok * n_q + head) * hd, q->dtype()), q->dtype(), d, hd);
      for (int i = 0; i < hd; ++i) d[i] *= scale;
    }
  }
  void store_row(const Item& it, int64_t r, const float* src) const {
    const int64_t tok = it.seq->row + r / n_rep;
    const int64_t head = int64_t{it.g} * n_rep + r % n_rep;
    store_f32(src, out->dtype(), at(out->data(), (tok * n_q + head) * hd, out->dtype()), hd);
  }
};

// Row pointers to keys [k0, k0 + count) of head g, converted to f32 in `buf` unless stored as f32.
// Walks the page table a page at a time (no division per key).
void key_rows(const KVLayout& kv, const void* base, int g, int64_t k0, int count, float* buf,
              const float** rows) {
  const int hd = kv.head_dim;
  int64_t page = k0 / kv.page_size, slot = k0 % kv.page_size;
  const char* src = at(base, kv.offset(k0, g), kv.dtype);
  for (int c = 0; c < count; ++c) {
    if (kv.dtype == DType::kF32) {
      rows[c] = reinterpret_cast<const float*>(src);
    } else {
      load_f32(src, kv.dtype, buf + c * hd, hd);
      rows[c] = buf + c * hd;
    }
    if (++slot == kv.page_size) {
      slot = 0;
      ++page;
      if (c + 1 < count) src = at(base, kv.offset(page * kv.page_size, g), kv.dtype);
    } else {
      src += hd * dtype_size(kv.dtype);
    }
  }
}

// Online-softmax attention over key blocks for any head size (see flash_fast for the common
// ones); K/V are read in place, or converted a block at a time when stored in 16 bits.
void flash_item(const Problem& pb, const Item& it, Scratch& sc) {
  const KVLayout& kv = it.seq->kv;
  const int hd = pb.hd;
  const int64_t rows = it.r1 - it.r0;
  sc.fit(kRowBlock, hd, kKeyBlock);
  pb.load_queries(it, sc.q.data());
  std::fill_n(sc.acc.data(), rows * hd, 0.0f);
  std::fill_n(sc.m.data(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(sc.l.data(), rows, 0.0f);

  const int64_t pos = it.seq->pos;
  const int64_t key_end = pos + (it.r1 - 1) / pb.n_rep + 1;  // the last row's causal horizon
  // Key blocks from the one holding the first row's first key (blocks stay aligned to kKeyBlock,
  // so a row's arithmetic does not depend on the rows it shares the item with).
  const int64_t key_begin = pb.first_key(pos + it.r0 / pb.n_rep) / kKeyBlock * kKeyBlock;
  const float* krows[kKeyBlock];
  const float* vrows[kKeyBlock];
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - k0));
    key_rows(kv, kv.k, it.g, k0, len, sc.kf.data(), krows);
    key_rows(kv, kv.v, it.g, k0, len, sc.vf.data(), vrows);
    int count[kRowBlock], first[kRowBlock];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t horizon = pos + (it.r0 + r) / pb.n_rep;  // last key this row may see
      count[r] = static_cast<int>(std::clamp<int64_t>(horizon - k0 + 1, 0, len));
      first[r] = static_cast<int>(std::clamp<int64_t>(pb.first_key(horizon) - k0, 0, count[r]));
    }
    block_scores(sc.q.data(), static_cast<int>(rows), krows, count, hd, sc.s.data(), kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const int n = count[r], f = first[r];
      if (n == f) continue;
      float* s = sc.s.data() + r * kKeyBlock;
      pb.cap(s + f, n - f);
      float mx = -std::numeric_limits<float>::infinity();
      for (int c = f; c < n; ++c) mx = std::max(mx, s[c]);
      float* acc = sc.acc.data() + r * hd;
      if (mx > sc.m[r]) {
        const float corr = exp_nonpositive(sc.m[r] - mx);
        sc.l[r] *= corr;
        for (int d = 0; d < hd; ++d) acc[d] *= corr;
        sc.m[r] = mx;
      }
      const float m = sc.m[r];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int c = f; c < n; ++c) {
        s[c] = exp_nonpositive(s[c] - m);
        sum += s[c];
      }
      for (int c = 0; c < f; ++c) s[c] = 0.0f;
      sc.l[r] += sum;
      accumulate_rows(acc, s, vrows, n, hd);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = sc.acc.data() + r * hd;
    const float inv = pb.denominator_inv(it, it.r0 + r, sc.m[r], sc.l[r], acc);
    for (int d = 0; d < hd; ++d) acc[d] *= inv;
    pb.store_row(it, it.r0 + r, acc);
  }
}

// The reference: gather K/V, explicit [rows, total] scores, mask, softmax, P @ V.
void manual_item(const Problem& pb, const Item& it, Scratch& sc) {
  const KVLayout& kv = it.seq->kv;
  const int hd = pb.hd;
  const int64_t rows = it.r1 - it.r0;
  const int64_t total = it.seq->pos + it.seq->n_new;
  std::vector<float> kf(total * hd), vf(total * hd), scores(rows * total), o(hd);
  for (int64_t p = 0; p < total; ++p) {
    load_f32(at(kv.k, kv.offset(p, it.g), kv.dtype), kv.dtype, &kf[p * hd], hd);
    load_f32(at(kv.v, kv.offset(p, it.g), kv.dtype), kv.dtype, &vf[p * hd], hd);
  }
  sc.fit(rows, hd, 0);
  pb.load_queries(it, sc.q.data());
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = &scores[r * total];
    for (int64_t p = 0; p < total; ++p) srow[p] = dot(&sc.q[r * hd], &kf[p * hd], hd);
    pb.cap(srow, static_cast<int>(total));
    const int64_t horizon = it.seq->pos + (it.r0 + r) / pb.n_rep;
    for (int64_t p = horizon + 1; p < total; ++p) srow[p] = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < pb.first_key(horizon); ++p) srow[p] = -std::numeric_limits<float>::infinity();
    const float sink = pb.sink_of(it, it.r0 + r);
    const float mx = std::max(sink, *std::max_element(srow, srow + total));
    float sum = pb.sinks ? std::exp(sink - mx) : 0.0f;
    for (int64_t p = 0; p < total; ++p) sum += (srow[p] = std::exp(srow[p] - mx));
    for (int64_t p = 0; p < total; ++p) srow[p] /= sum;
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t p = 0; p < total; ++p)
      for (int d = 0; d < hd; ++d) o[d] += srow[p] * vf[p * hd + d];
    pb.store_row(it, it.r0 + r, o.data());
  }
}


// ---- Fast path: head_dim a multiple of 16, K/V converted in registers, rows in groups of 4 ----

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <DType DT>
inline f32x16 load_kv16(const char* row, int j);
template <>
inline f32x16 load_kv16<DType::kF32>(const char* row, int j) {
  return load16(reinterpret_cast<const float*>(row) + 16 * j);
}
template <>
inline f32x16 load_kv16<DType::kBF16>(const char* row, int j) {
  const u16x16 h = *reinterpret_cast<const u16x16*>(reinterpret_cast<const uint16_t*>(row) + 16 * j);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}
template <>
inline f32x16 load_kv16<DType::kF16>(const char* row, int j) {
  const auto* h = reinterpret_cast<const uint16_t*>(row) + 16 * j;
#if defined(__AVX512F__)
  // One conversion into one register: two halves stored and read back as one vector stalled
  // every load on a failed store forwarding (~30% of a decode step's attention, perf annotate).
  return reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
#else
  f32x16 f;
#if defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
  std::memcpy(&f, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&f) + 32, &hi, 32);
#else
  for (int i = 0; i < 16; ++i) f[i] = f16_to_f32(h[i]);
#endif
  return f;
#endif
}

// Row addresses of keys [k0, k0 + count) of head g in `base`, walking the page table a page at a
// time; the rows of the next block are prefetched while this one is computed.
inline void row_addresses(const KVLayout& kv, const void* base, int g, int64_t k0, int count,
                          const char** rows) {
  const int64_t row_bytes = int64_t{kv.head_dim} * static_cast<int64_t>(dtype_size(kv.dtype));
  int64_t slot = k0 % kv.page_size, page = k0 / kv.page_size;
  const char* src = at(base, kv.offset(k0, g), kv.dtype);
  for (int c = 0; c < count; ++c) {
    rows[c] = src;
    if (++slot == kv.page_size) {
      slot = 0;
      ++page;
      if (c + 1 < count) src = at(base, kv.offset(page * kv.page_size, g), kv.dtype);
    } else {
      src += row_bytes;
    }
  }
}

inline void prefetch_row(const char* row, int64_t row_bytes) {
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);  // into L2
}

// p[r][c] (c < count) times V rows into acc rows, for a group of RG rows and NV vectors of 16.
template <int NV, DType DT, int RG>
void accumulate_group(float* acc, int hd, const float* p, int p_stride, const char* const* vrows,
                      int count) {
  constexpr int kChunk = NV < 4 ? NV : 4;  // vectors per pass: RG * kChunk accumulators
  for (int j0 = 0; j0 < NV; j0 += kChunk) {
    f32x16 a[RG][kChunk];
    for (int r = 0; r < RG; ++r)
      for (int j = 0; j < kChunk; ++j) a[r][j] = load16(acc + r * hd + 16 * (j0 + j));
    for (int c = 0; c < count; ++c) {
      f32x16 v[kChunk];
      for (int j = 0; j < kChunk; ++j) v[j] = load_kv16<DT>(vrows[c], j0 + j);
      for (int r = 0; r < RG; ++r) {
        const f32x16 pc = splat16(p[r * p_stride + c]);
        for (int j = 0; j < kChunk; ++j) a[r][j] = fma16(pc, v[j], a[r][j]);
      }
    }
    for (int r = 0; r < RG; ++r)
      for (int j = 0; j < kChunk; ++j) store16(acc + r * hd + 16 * (j0 + j), a[r][j]);
  }
}

// The flash pass of one KV head over an item's rows, a key block at a time (see flash_fast).
// Each row's arithmetic is the same whatever rows share its item, so a token's attention does not
// depend on how its sequence was split into chunks (the engine relies on it to rebuild evicted
// pages bit for bit).
template <int NV, DType DT>
class HeadPass {
 public:
  // `it` names this head; q, acc: [kRowBlock, hd] and s: [kRowBlock, kKeyBlock] scratch; kf:
  // [kKeyBlock, hd] (a key block's K in f32, rewritten by each block(): may be shared by passes).
  void begin(const Problem& pb, const Item& it, float* q, float* acc, float* s, float* kf) {
    pb_ = &pb;
    it_ = it;
    q_ = q, acc_ = acc, s_ = s, kf_ = kf;
    rows_ = static_cast<int>(it.r1 - it.r0);
    pb.load_queries(it, q_);
    std::fill_n(acc_, rows_ * pb.hd, 0.0f);
    std::fill_n(m_, rows_, -std::numeric_limits<float>::infinity());
    std::fill_n(l_, rows_, 0.0f);
    key_end_ = it.seq->pos + (it.r1 - 1) / pb.n_rep + 1;  // the last row's causal horizon
    n_blocks_ = (key_end_ + kKeyBlock - 1) / kKeyBlock;
    // Blocks before the one holding the first row's first key see nothing (a window).
    first_block_ = pb.first_key(it.seq->pos + it.r0 / pb.n_rep) / kKeyBlock;
    for (int64_t b = first_block_; b < first_block_ + kAhead; ++b) find_rows(b);
  }
  int64_t first_block() const { return first_block_; }
  int64_t n_blocks() const { return n_blocks_; }

  void block(int64_t blk) {
    const int hd = pb_->hd;
    const int64_t row_bytes = int64_t{hd} * static_cast<int64_t>(dtype_size(DT));
    const int64_t pos = it_.seq->pos;
    const int64_t k0 = blk * kKeyBlock;
    const int len = block_len(blk);
    find_rows(blk + kAhead);
    const int n_next = blk + kAhead < n_blocks_ ? block_len(blk + kAhead) : 0;
    const char* const* krows = krows_[blk % kRing];
    const char* const* vrows = vrows_[blk % kRing];
    const char* const* kpre = krows_[(blk + kAhead) % kRing];
    const char* const* vpre = vrows_[(blk + kAhead) % kRing];
    int count[kRowBlock], first[kRowBlock];
    int max_count = 0;
    for (int r = 0; r < rows_; ++r) {
      const int64_t horizon = pos + (it_.r0 + r) / pb_->n_rep;  // last key this row may see
      count[r] = static_cast<int>(std::clamp<int64_t>(horizon - k0 + 1, 0, len));
      first[r] = static_cast<int>(std::clamp<int64_t>(pb_->first_key(horizon) - k0, 0, count[r]));
      max_count = std::max(max_count, count[r]);
    }
    // Scores, q . k by the same operations whatever the rows or keys around it (dot_lanes, then
    // hsum16's tree), so that a token's numbers do not depend on its chunk or its neighbours.
    if (rows_ < kGroupedRows) {  // few rows (decode): each K row loaded once, summed on its own
      // KU keys at a time: their chains are independent (one chain a score is a long one).
      constexpr int KU = NV <= 8 ? 2 : 1;
      for (int c0 = 0; c0 < max_count; c0 += KU) {
        const int ku = std::min(KU, max_count - c0);
        f32x16 k[KU][NV];
        for (int u = 0; u < ku; ++u) {
          const int c = c0 + u;
          if (c < n_next) {  // spread over the block, so the prefetches do not queue up at once
            prefetch_row(kpre[c], row_bytes);
            prefetch_row(vpre[c], row_bytes);
          }
          for (int j = 0; j < NV; ++j) k[u][j] = load_kv16<DT>(krows[c], j);
        }
        for (int r = 0; r < rows_; ++r) {
          const float* qr = q_ + r * hd;
          f32x16 x[KU];
          for (int u = 0; u < ku; ++u) x[u] = load16(qr) * k[u][0];
          for (int j = 1; j < NV; ++j) {
            const f32x16 qj = load16(qr + 16 * j);
            for (int u = 0; u < ku; ++u) x[u] = fma16(qj, k[u][j], x[u]);
          }
          for (int u = 0; u < ku; ++u) {
            const int c = c0 + u;
            if (c < count[r] && c >= first[r]) s_[r * kKeyBlock + c] = hsum_tree(x[u]);
          }
        }
      }
    } else {
      grouped_scores(count, first, max_count, n_next, kpre, vpre, krows, row_bytes);
    }
    softmax_and_values(count, first, max_count, vrows);
  }

  void end() {
    const int hd = pb_->hd;
    for (int r = 0; r < rows_; ++r) {
      float* ar = acc_ + r * hd;
      const float inv = pb_->denominator_inv(it_, it_.r0 + r, m_[r], l_[r], ar);
      for (int d = 0; d < hd; ++d) ar[d] *= inv;
      pb_->store_row(it_, it_.r0 + r, ar);
    }
  }

 private:
  // Rows of an item from which the scores take grouped_scores (fewer: decode's query heads).
  static constexpr int kGroupedRows = 8;

  // The scores of many rows (prefill): the block's K rows converted to f32 once (zeros up to a
  // whole 16), then each row's 16 keys at a time, q in registers, the 16 sums reduced together
  // (hsum16: ~3 operations a score where hsum_tree takes ~10). Keys outside a row's are computed
  // too and zeroed by the softmax.
  void grouped_scores(const int* count, const int* first, int max_count, int n_next, const char* const* kpre,
                      const char* const* vpre, const char* const* krows, int64_t row_bytes) {
    const int hd = pb_->hd;
    const int key_groups = (max_count + 15) / 16;
    for (int c = 0; c < key_groups * 16; ++c) {
      float* kc = kf_ + c * hd;
      if (c >= max_count) {
        for (int j = 0; j < NV; ++j) store16(kc + 16 * j, f32x16{});
        continue;
      }
      if (c < n_next) {  // spread over the block, so the prefetches do not queue up at once
        prefetch_row(kpre[c], row_bytes);
        prefetch_row(vpre[c], row_bytes);
      }
      for (int j = 0; j < NV; ++j) store16(kc + 16 * j, load_kv16<DT>(krows[c], j));
    }
    for (int r = 0; r < rows_; ++r) {
      if (first[r] >= count[r]) continue;
      f32x16 qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = load16(q_ + r * hd + 16 * j);
      for (int g = first[r] / 16; g < (count[r] + 15) / 16; ++g) {
        f32x16 a[16];
        for (int c = 0; c < 16; ++c) a[c] = dot_lanes<NV>(qv, kf_ + (g * 16 + c) * hd);
        store16(s_ + r * kKeyBlock + g * 16, hsum16(a));
      }
    }
  }

  // Online softmax; probabilities outside a row's keys are 0 so groups share one count; then P V.
  void softmax_and_values(const int* count, const int* first, int max_count, const char* const* vrows) {
    const int hd = pb_->hd;
    for (int r = 0; r < rows_; ++r) {
      float* sr = s_ + r * kKeyBlock;
      const int n = count[r], f = first[r];
      pb_->cap(sr + f, n - f);
      float mx = m_[r];
      for (int c = f; c < n; ++c) mx = std::max(mx, sr[c]);
      if (mx > m_[r]) {
        const float corr = exp_nonpositive(m_[r] - mx);
        l_[r] *= corr;
        float* ar = acc_ + r * hd;
        for (int d = 0; d < hd; ++d) ar[d] *= corr;
        m_[r] = mx;
      }
      const float mr = m_[r];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int c = f; c < n; ++c) {
        sr[c] = exp_nonpositive(sr[c] - mr);
        sum += sr[c];
      }
      for (int c = 0; c < f; ++c) sr[c] = 0.0f;
      for (int c = n; c < max_count; ++c) sr[c] = 0.0f;
      l_[r] += sum;
    }
    // P @ V in groups of 4 rows: each V row is loaded once per group.
    for (int r0 = 0; r0 < rows_; r0 += 4) {
      const int rg = std::min(4, rows_ - r0);
      int gcount = 0;
      for (int r = r0; r < r0 + rg; ++r) gcount = std::max(gcount, count[r]);
      float* ar = acc_ + r0 * hd;
      const float* pr = s_ + r0 * kKeyBlock;
      switch (rg) {
        case 4: accumulate_group<NV, DT, 4>(ar, hd, pr, kKeyBlock, vrows, gcount); break;
        case 3: accumulate_group<NV, DT, 3>(ar, hd, pr, kKeyBlock, vrows, gcount); break;
        case 2: accumulate_group<NV, DT, 2>(ar, hd, pr, kKeyBlock, vrows, gcount); break;
        default: accumulate_group<NV, DT, 1>(ar, hd, pr, kKeyBlock, vrows, gcount); break;
      }
    }
  }

  // Row addresses of blocks b .. b + kAhead in a ring; block b + kAhead is prefetched while
  // block b is computed.
  static constexpr int kAhead = 2, kRing = kAhead + 1;
  int block_len(int64_t b) const {
    return static_cast<int>(std::min<int64_t>(kKeyBlock, key_end_ - b * kKeyBlock));
  }
  void find_rows(int64_t b) {
    if (b >= n_blocks_) return;
    const KVLayout& kv = it_.seq->kv;
    row_addresses(kv, kv.k, it_.g, b * kKeyBlock, block_len(b), krows_[b % kRing]);
    row_addresses(kv, kv.v, it_.g, b * kKeyBlock, block_len(b), vrows_[b % kRing]);
  }

  const Problem* pb_ = nullptr;
  Item it_{};
  float *q_ = nullptr, *acc_ = nullptr, *s_ = nullptr, *kf_ = nullptr;
  int rows_ = 0;
  int64_t key_end_ = 0, n_blocks_ = 0, first_block_ = 0;
  float m_[kRowBlock], l_[kRowBlock];
  const char* krows_[kRing][kKeyBlock];
  const char* vrows_[kRing][kKeyBlock];
};

// The fast flash path for one item: its KV heads [g, g_end) advance together a key block at a
// time, so a page's K/V of all those heads (adjacent in the arena) are read together.
template <int NV, DType DT>
void flash_fast(const Problem& pb, const Item& it, Scratch& sc) {
  const int heads = it.g_end - it.g;
  sc.fit(static_cast<size_t>(heads) * kRowBlock, pb.hd, kKeyBlock);
  thread_local std::vector<HeadPass<NV, DT>> passes;
  if (passes.size() < static_cast<size_t>(heads)) passes.resize(heads);
  for (int h = 0; h < heads; ++h) {
    Item one = it;
    one.g = it.g + h;
    passes[h].begin(pb, one, sc.q.data() + h * kRowBlock * pb.hd, sc.acc.data() + h * kRowBlock * pb.hd,
                    sc.s.data() + h * kRowBlock * kKeyBlock, sc.kf.data());
  }
  const int64_t n_blocks = passes[0].n_blocks();
  for (int64_t blk = passes[0].first_block(); blk < n_blocks; ++blk)
    for (int h = 0; h < heads; ++h) passes[h].block(blk);
  for (int h = 0; h < heads; ++h) passes[h].end();
}

template <int NV>
void flash_fast(const Problem& pb, const Item& it, Scratch& sc) {
  switch (it.seq->kv.dtype) {
    case DType::kF32: return flash_fast<NV, DType::kF32>(pb, it, sc);
    case DType::kBF16: return flash_fast<NV, DType::kBF16>(pb, it, sc);
    case DType::kF16: return flash_fast<NV, DType::kF16>(pb, it, sc);
    default: return;  // block types: rejected by validate_kv_geometry
  }
}

}  // namespace

void write_kv(CpuBackend& /*backend*/, std::span<const SeqWork> seqs, int n_kv_heads,
              const Tensor& k, const Tensor& v) {
  thread_local std::vector<float> tmp;
  for (const SeqWork& s : seqs) {
    const KVLayout& kv = s.kv;
    const int hd = kv.head_dim;
    tmp.resize(hd);
    for (int64_t i = 0; i < s.n_new; ++i) {
      for (int h = 0; h < n_kv_heads; ++h) {
        const int64_t src = ((s.row + i) * n_kv_heads + h) * hd;
        const int64_t dst = kv.offset(s.pos + i, h);
        for (auto [from, to] : {std::pair{&k, kv.k}, std::pair{&v, kv.v}}) {
          const char* sp = at(from->data(), src, from->dtype());
          char* dp = at(to, dst, kv.dtype);
          if (from->dtype() == kv.dtype) {
            std::memcpy(dp, sp, hd * dtype_size(kv.dtype));
          } else {
            load_f32(sp, from->dtype(), tmp.data(), hd);
            store_f32(tmp.data(), kv.dtype, dp, hd);
          }
        }
      }
    }
  }
}

void attention(CpuBackend& backend, std::span<const SeqWork> seqs, int n_kv_heads, const Tensor& q,
               const Tensor& out, const AttentionParams& params, AttentionImpl impl) {
  Problem pb;
  pb.n_kv = n_kv_heads;
  pb.n_q = q.dim(1);
  pb.n_rep = static_cast<int>(pb.n_q / n_kv_heads);
  pb.hd = static_cast<int>(q.dim(2));
  pb.q = &q;
  pb.out = &out;
  pb.scale = params.scale;
  pb.window = params.window;
  pb.softcap = params.softcap;
  pb.sinks = params.sinks;
  // Rows of one item: the manual path keeps a whole sequence (its scores matrix is the point).
  auto block_of = [&](const SeqWork& s) {
    return impl == AttentionImpl::kFlash ? int64_t{kRowBlock} : std::max<int64_t>(1, s.n_new * pb.n_rep);
  };
  // Reused from call to call (a decode step allocates nothing). A reference, so that the workers
  // below see this thread's list, not their own thread_local one.
  thread_local std::vector<Item> items_storage;
  std::vector<Item>& items = items_storage;
  items.clear();
  // With enough (sequence, row block) pairs to keep every thread busy, an item takes all KV heads
  // (the fast path then reads each page's heads together); otherwise one head per item.
  const bool fast = impl == AttentionImpl::kFlash && (pb.hd == 64 || pb.hd == 128 || pb.hd == 256);
  int64_t pairs = 0;
  for (const SeqWork& s : seqs) pairs += (s.n_new * pb.n_rep + block_of(s) - 1) / block_of(s);
  const int heads_per_item = fast && pairs >= 2 * backend.num_threads() ? std::min(n_kv_heads, 8) : 1;
  for (const SeqWork& s : seqs) {
    const int64_t rows = s.n_new * pb.n_rep;
    const int64_t block = block_of(s);
    for (int64_t r0 = 0; r0 < rows; r0 += block)
      for (int g = 0; g < n_kv_heads; g += heads_per_item)
        items.push_back({&s, g, r0, std::min(rows, r0 + block), std::min(n_kv_heads, g + heads_per_item)});
  }
  backend.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch scratch;
    if (impl == AttentionImpl::kManual) return manual_item(pb, items[i], scratch);
    switch (pb.hd) {  // register-resident fast paths for the common head sizes
      case 64: return flash_fast<4>(pb, items[i], scratch);
      case 128: return flash_fast<8>(pb, items[i], scratch);
      case 256: return flash_fast<16>(pb, items[i], scratch);
      default: return flash_item(pb, items[i], scratch);
    }
  });
}

}  // namespace combs::cpu
