#include "kv/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace combs::cpu {
namespace {

constexpr int kKeyBlock = 64;  // keys converted and scored together
constexpr int kRowBlock = 32;  // query rows (token x head of a GQA group) per work item

void load_f32(const void* src, DType t, float* dst, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
      }
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
  }
}

void store_f32(const float* src, DType t, void* dst, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
  }
}

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

// acc[0..n) += sum_c p[c] * rows[c][0..n), keeping 16-lane chunks of acc in registers.
inline void accumulate_rows(float* acc, const float* p, const float* const* rows, int count,
                            int n) {
  int d0 = 0;
  for (; d0 + 16 <= n; d0 += 16) {
    float a[16];
    for (int j = 0; j < 16; ++j) a[j] = acc[d0 + j];
    for (int c = 0; c < count; ++c) {
      const float pc = p[c];
      const float* r = rows[c] + d0;
#pragma omp simd
      for (int j = 0; j < 16; ++j) a[j] += pc * r[j];
    }
    for (int j = 0; j < 16; ++j) acc[d0 + j] = a[j];
  }
  for (; d0 < n; ++d0) {
    float a = acc[d0];
    for (int c = 0; c < count; ++c) a += p[c] * rows[c][d0];
    acc[d0] = a;
  }
}

struct Scratch {
  std::vector<float> q, acc, m, l, s, kf, vf;
  void fit(size_t rows, size_t hd, size_t keys) {
    if (q.size() < rows * hd) q.resize(rows * hd), acc.resize(rows * hd);
    if (m.size() < rows) m.resize(rows), l.resize(rows);
    if (s.size() < keys) s.resize(keys);
    if (kf.size() < keys * hd) kf.resize(keys * hd), vf.resize(keys * hd);
  }
};

// Rows of one work item: tokens [i0, i1) x the n_rep query heads of KV head g.
struct Item {
  const SeqWork* seq;
  int g;
  int64_t r0, r1;  // rows r = i * n_rep + j
};

struct Problem {
  int n_kv, n_rep, hd;
  int64_t n_q;
  const Tensor* q;
  const Tensor* out;
  float scale;

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
void key_rows(const KVLayout& kv, const void* base, int g, int64_t k0, int count, float* buf,
              const float** rows) {
  const int hd = kv.head_dim;
  for (int c = 0; c < count; ++c) {
    const char* src = at(base, kv.offset(k0 + c, g), kv.dtype);
    if (kv.dtype == DType::kF32) {
      rows[c] = reinterpret_cast<const float*>(src);
    } else {
      load_f32(src, kv.dtype, buf + c * hd, hd);
      rows[c] = buf + c * hd;
    }
  }
}

// Online-softmax attention over key blocks; K/V are read in place, one block at a time.
void flash_item(const Problem& pb, const Item& it, Scratch& sc) {
  const KVLayout& kv = it.seq->kv;
  const int hd = pb.hd;
  const int64_t rows = it.r1 - it.r0;
  sc.fit(rows, hd, kKeyBlock);
  pb.load_queries(it, sc.q.data());
  std::fill_n(sc.acc.data(), rows * hd, 0.0f);
  std::fill_n(sc.m.data(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(sc.l.data(), rows, 0.0f);

  const int64_t pos = it.seq->pos;
  const int64_t key_end = pos + (it.r1 - 1) / pb.n_rep + 1;  // the last row's causal horizon
  const float* krows[kKeyBlock];
  const float* vrows[kKeyBlock];
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - k0));
    key_rows(kv, kv.k, it.g, k0, len, sc.kf.data(), krows);
    key_rows(kv, kv.v, it.g, k0, len, sc.vf.data(), vrows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t horizon = pos + (it.r0 + r) / pb.n_rep;  // last key this row may see
      if (horizon < k0) continue;
      const int count = static_cast<int>(std::min<int64_t>(len, horizon - k0 + 1));
      const float* qr = sc.q.data() + r * hd;
      float* s = sc.s.data();
      float mx = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < count; ++c) {
        s[c] = dot(qr, krows[c], hd);
        mx = std::max(mx, s[c]);
      }
      float* acc = sc.acc.data() + r * hd;
      if (mx > sc.m[r]) {
        const float corr = std::exp(sc.m[r] - mx);
        sc.l[r] *= corr;
        for (int d = 0; d < hd; ++d) acc[d] *= corr;
        sc.m[r] = mx;
      }
      float sum = 0.0f;
      for (int c = 0; c < count; ++c) {
        s[c] = std::exp(s[c] - sc.m[r]);
        sum += s[c];
      }
      sc.l[r] += sum;
      accumulate_rows(acc, s, vrows, count, hd);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = sc.acc.data() + r * hd;
    const float inv = 1.0f / sc.l[r];
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
    const int64_t horizon = it.seq->pos + (it.r0 + r) / pb.n_rep;
    if (it.seq->n_new > 1) {  // one decoded token sees everything: no mask
      for (int64_t p = horizon + 1; p < total; ++p) srow[p] = -std::numeric_limits<float>::infinity();
    }
    const float mx = *std::max_element(srow, srow + total);
    float sum = 0.0f;
    for (int64_t p = 0; p < total; ++p) sum += (srow[p] = std::exp(srow[p] - mx));
    for (int64_t p = 0; p < total; ++p) srow[p] /= sum;
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t p = 0; p < total; ++p)
      for (int d = 0; d < hd; ++d) o[d] += srow[p] * vf[p * hd + d];
    pb.store_row(it, it.r0 + r, o.data());
  }
}

}  // namespace

void write_kv(CpuBackend& /*backend*/, std::span<const SeqWork> seqs, int n_kv_heads,
              const Tensor& k, const Tensor& v) {
  std::vector<float> tmp;
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
               const Tensor& out, float scale, AttentionImpl impl) {
  Problem pb;
  pb.n_kv = n_kv_heads;
  pb.n_q = q.dim(1);
  pb.n_rep = static_cast<int>(pb.n_q / n_kv_heads);
  pb.hd = static_cast<int>(q.dim(2));
  pb.q = &q;
  pb.out = &out;
  pb.scale = scale;
  // The manual path keeps whole sequences per item (its scores matrix is the point).
  const int64_t block = impl == AttentionImpl::kFlash ? kRowBlock : std::numeric_limits<int64_t>::max();
  std::vector<Item> items;
  for (const SeqWork& s : seqs) {
    const int64_t rows = s.n_new * pb.n_rep;
    for (int g = 0; g < n_kv_heads; ++g)
      for (int64_t r0 = 0; r0 < rows; r0 += block) items.push_back({&s, g, r0, std::min(rows, r0 + block)});
  }
  backend.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch scratch;
    if (impl == AttentionImpl::kFlash) flash_item(pb, items[i], scratch);
    else manual_item(pb, items[i], scratch);
  });
}

}  // namespace combs::cpu
