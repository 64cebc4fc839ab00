// Cross-validation of the attention-in-cache call: paged vs contiguous vs a float64 reference,
// flash vs manual, over GQA ratios, head sizes, page sizes, K/V dtypes and prefill chunkings,
// through popn, regrowth and reset; and batched vs one-by-one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/paged_kv_cache.h"
#include "support/kv_helpers.h"
#include "support/kv_reference.h"

using namespace combs;
using namespace combs::testing;

namespace {

constexpr int kLayers = 2;
constexpr int kKvHeads = 2;
constexpr int64_t kCapacity = 96;
constexpr int64_t kReleaseMargin = 20;

struct Case {
  int n_rep;
  int head_dim;
  int page_size;
  DType dtype;
  int64_t window = 0;  // sliding window (0: none)
  float softcap = 0.0f;
  bool sinks = false;  // a sink logit per query head (gpt-oss)
  // After every step the paged caches release the pages behind the window, less kReleaseMargin
  // positions (the most a scenario's popn drops).
  bool release = false;
  std::string describe() const {
    std::ostringstream s;
    s << "n_rep " << n_rep << ", head_dim " << head_dim << ", page_size " << page_size << ", "
      << dtype_name(dtype) << ", window " << window << ", softcap " << softcap << ", sinks " << sinks
      << ", release " << release;
    return s.str();
  }
};

// |got - want| <= 2e-5 + 1e-4 |want|: f32 accumulation error only (the reference stores K/V
// rounded as the cache does).
void require_close(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= 2e-5 + 1e-4 * std::abs(want[i]))) {
      FAIL("element " << i << ": got " << got[i] << ", want " << want[i]);
    }
  }
}

// Three caches fed identical inputs — paged (flash), contiguous (flash), paged (manual) — and
// the float64 reference; every output is checked after every step.
class CrossCheck {
 public:
  CrossCheck(const Case& c, Rng& rng) : c_(c), rng_(rng), backend_({2}) {
    const KVGeometry g{kLayers, kKvHeads, c.head_dim, c.dtype};
    PagePoolOptions o;
    o.geometry = g;
    o.page_size = c.page_size;
    o.num_pages = 2 * pages_for_tokens(kCapacity, c.page_size);
    pool_ = std::move(PagePool::create(backend_, o)).value();
    paged_ = std::move(PagedKVCache::create(*pool_, kCapacity)).value();
    paged_manual_ = std::move(PagedKVCache::create(*pool_, kCapacity)).value();
    contiguous_ = std::move(ContiguousKVCache::create(backend_, g, kCapacity)).value();
    refs_.assign(kLayers, ReferenceKV(kKvHeads, c.head_dim, c.dtype));
    // Sinks from far below the scores to far above them (every row's maximum, then).
    if (c.sinks) sinks_ = rng.floats(kKvHeads * c.n_rep, -8, 8);
  }

  void run(int64_t n_new) {
    const int n_q = kKvHeads * c_.n_rep, hd = c_.head_dim;
    AttentionParams params(1.0f / std::sqrt(float(hd)), c_.window, c_.softcap);
    if (c_.sinks) params.sinks = sinks_.data();
    const int64_t pos = paged_->seq_len();
    for (int layer = 0; layer < kLayers; ++layer) {
      auto q = rng_.floats(n_new * n_q * hd, -3, 3);  // peaky softmax
      auto k = rng_.floats(n_new * kKvHeads * hd);
      auto v = rng_.floats(n_new * kKvHeads * hd);
      const Tensor qt = view(q, {n_new, n_q, hd}), kt = view(k, {n_new, kKvHeads, hd}),
                   vt = view(v, {n_new, kKvHeads, hd});
      std::vector<float> a(q.size()), b(q.size()), m(q.size());
      const Tensor at = view(a, qt.shape()), bt = view(b, qt.shape()), mt = view(m, qt.shape());
      const SeqAttention sp{paged_.get(), pos, n_new}, sc{contiguous_.get(), pos, n_new},
          sm{paged_manual_.get(), pos, n_new};
      REQUIRE(attention_batch({&sp, 1}, layer, qt, kt, vt, params, &at, AttentionImpl::kFlash).ok());
      REQUIRE(attention_batch({&sc, 1}, layer, qt, kt, vt, params, &bt, AttentionImpl::kFlash).ok());
      REQUIRE(attention_batch({&sm, 1}, layer, qt, kt, vt, params, &mt, AttentionImpl::kManual).ok());
      const auto want = refs_[layer].attend(q, k, v, n_q, params.scale, params.window, params.softcap,
                                            c_.sinks ? &sinks_ : nullptr);
      INFO("layer " << layer << ", pos " << pos << ", n_new " << n_new);
      REQUIRE(a == b);  // same kernel, pages or not: bit-identical
      require_close(a, want);
      require_close(m, want);
    }
    REQUIRE(paged_->seq_len() == pos + n_new);
    if (c_.release) {
      const int64_t before = paged_->pages_used().value();
      const int64_t n = paged_->release_before(pos + n_new - c_.window + 1 - kReleaseMargin);
      REQUIRE(paged_manual_->release_before(pos + n_new - c_.window + 1 - kReleaseMargin) == n);
      REQUIRE(paged_->pages_used() == before - n);
      REQUIRE(paged_->first_held_position() == paged_manual_->first_held_position());
      // (after a popn it may lie past this step's release point, never past what the window reads)
      REQUIRE(paged_->first_held_position() <= std::max<int64_t>(0, pos + n_new - c_.window + 1));
      released_ += n;
    }
    REQUIRE(paged_->pages_used() ==
            pages_for_tokens(pos + n_new, c_.page_size) - paged_->first_held_position() / c_.page_size);
  }

  // Pages the caches gave back from behind the window, over the scenario.
  int64_t released() const { return released_; }
  // The zero page (the released positions' stand-in) still holds zeros in every layer.
  void require_zero_page_intact() const {
    const int64_t page = pool_->k_arena(0).numel() / pool_->num_pages();
    for (int layer = 0; layer < kLayers; ++layer)
      for (const Tensor* arena : {&pool_->k_arena(layer), &pool_->v_arena(layer)}) {
        const auto* bytes = static_cast<const uint8_t*>(arena->data()) + arena->nbytes();
        const size_t n = static_cast<size_t>(page) * dtype_size(arena->dtype());
        REQUIRE(std::all_of(bytes, bytes + n, [](uint8_t b) { return b == 0; }));
      }
  }

  void popn(int64_t n) {
    const int64_t len = paged_->seq_len();
    REQUIRE(paged_->popn(n) == std::min(n, len));
    REQUIRE(paged_manual_->popn(n) == std::min(n, len));
    REQUIRE(contiguous_->popn(n) == std::min(n, len));
    for (auto& r : refs_) r.truncate(std::max<int64_t>(0, len - n));
    REQUIRE(paged_->pages_used() ==
            pages_for_tokens(paged_->seq_len(), c_.page_size) - paged_->first_held_position() / c_.page_size);
  }

  void reset() {
    paged_->reset();
    paged_manual_->reset();
    contiguous_->reset();
    for (auto& r : refs_) r.truncate(0);
    REQUIRE(pool_->num_free() == pool_->num_pages());
  }

  int64_t len() const { return paged_->seq_len(); }

 private:
  Case c_;
  Rng& rng_;
  CpuBackend backend_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<PagedKVCache> paged_, paged_manual_;
  std::unique_ptr<ContiguousKVCache> contiguous_;
  std::vector<ReferenceKV> refs_;
  std::vector<float> sinks_;
  int64_t released_ = 0;
};

enum class Chunking { kOneChunk, kSeveralChunks, kTokenByToken };

// Prefill by `chunking`, decode, popn and regrow, reset and reuse; the pages released (release).
int64_t scenario(const Case& c, Chunking chunking, Rng& rng) {
  INFO(c.describe());
  CrossCheck x(c, rng);
  auto prefill = [&](int64_t total) {
    while (x.len() < total) {
      const int64_t left = total - x.len();
      switch (chunking) {
        case Chunking::kOneChunk: x.run(left); break;
        case Chunking::kSeveralChunks: x.run(std::min<int64_t>(left, rng.integer(2, 20))); break;
        case Chunking::kTokenByToken: x.run(1); break;
      }
    }
  };
  prefill(rng.integer(33, 50));
  for (int i = 0; i < 3; ++i) x.run(1);  // decode
  x.popn(rng.integer(1, 20));
  prefill(x.len() + rng.integer(10, 30));  // regrow into freed pages
  x.run(1);
  const int64_t released = x.released();
  x.reset();
  prefill(rng.integer(5, 17));
  x.run(1);
  x.require_zero_page_intact();
  return released + x.released();
}

void scenario(Chunking chunking) {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (int n_rep : {1, 2, 4, 8})
    for (int head_dim : {40, 64, 128})  // 40: the generic path; 64, 128: the fast path
      for (int page_size : {1, 3, 16, 32})
        for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) scenario({n_rep, head_dim, page_size, dtype}, chunking, rng);
}

}  // namespace

TEST_CASE("attention matches the float64 reference with prefill in one chunk", "[kv]") {
  scenario(Chunking::kOneChunk);
}

TEST_CASE("attention matches the float64 reference with prefill in several chunks", "[kv]") {
  scenario(Chunking::kSeveralChunks);
}

TEST_CASE("attention matches the float64 reference token by token", "[kv]") {
  scenario(Chunking::kTokenByToken);
}

TEST_CASE("sliding-window and softcapped attention matches the float64 reference", "[kv]") {
  // Windows of one key, of fewer than a page (they start mid-page), of exactly a page, and wider
  // than every context; chunks cross the window's edge (contexts of 33 to 80 keys); the softcap
  // alone and with a window.
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (int64_t window : {1, 7, 16, 4096})
    for (int page_size : {16, 32})
      for (int head_dim : {40, 64, 128})
        for (float softcap : {0.0f, 2.0f})
          for (Chunking chunking : {Chunking::kOneChunk, Chunking::kSeveralChunks, Chunking::kTokenByToken}) {
            const DType dtype = head_dim == 64 ? DType::kBF16 : DType::kF32;
            scenario({head_dim == 40 ? 1 : 4, head_dim, page_size, dtype, window, softcap}, chunking, rng);
          }
  for (Chunking chunking : {Chunking::kOneChunk, Chunking::kTokenByToken}) scenario({2, 64, 16, DType::kF16, 0, 3.0f}, chunking, rng);
}

TEST_CASE("windowed attention over a cache that released the pages behind its window", "[kv]") {
  // The paged caches (flash and manual) give back their pages behind the window after every step;
  // their outputs still equal the contiguous cache's and the float64 reference's (popn of up to
  // kReleaseMargin positions included), and the zero page that stands for the released positions
  // is never written.
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  int64_t released = 0;
  for (int64_t window : {1, 7, 16})
    for (int page_size : {1, 3, 16})
      for (int head_dim : {40, 64})
        for (Chunking chunking : {Chunking::kOneChunk, Chunking::kSeveralChunks, Chunking::kTokenByToken}) {
          const DType dtype = head_dim == 64 ? DType::kBF16 : DType::kF32;
          Case c{head_dim == 40 ? 1 : 4, head_dim, page_size, dtype, window, 0.0f};
          c.release = true;
          released += scenario(c, chunking, rng);
        }
  CHECK(released > 0);
}

TEST_CASE("attention with sinks matches the float64 reference", "[kv]") {
  // gpt-oss: a logit per query head in every row's softmax; with and without a window, on the
  // generic (40) and fast (64, 128) paths and the manual one, every chunking.
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (int64_t window : {0, 7})
    for (int head_dim : {40, 64, 128})
      for (int n_rep : {1, 4})
        for (Chunking chunking : {Chunking::kOneChunk, Chunking::kSeveralChunks, Chunking::kTokenByToken}) {
          const DType dtype = head_dim == 64 ? DType::kBF16 : DType::kF32;
          Case c{n_rep, head_dim, 16, dtype, window};
          c.sinks = true;
          scenario(c, chunking, rng);
        }
}

TEST_CASE("batched attention equals one sequence at a time", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    INFO(dtype_name(dtype));
    const int hd = 64, n_q = 8, n_kv = 2, n_seqs = 5;
    CpuBackend backend({2});
    PagePoolOptions o;
    o.geometry = {1, n_kv, hd, dtype};
    o.num_pages = 64;
    auto pool = std::move(PagePool::create(backend, o)).value();
    std::vector<std::unique_ptr<PagedKVCache>> batched, single;
    std::vector<ReferenceKV> refs(n_seqs, ReferenceKV(n_kv, hd, dtype));
    for (int i = 0; i < n_seqs; ++i) {
      batched.push_back(std::move(PagedKVCache::create(*pool, 128)).value());
      single.push_back(std::move(PagedKVCache::create(*pool, 128)).value());
    }
    const float scale = 0.125f;
    for (int step = 0; step < 6; ++step) {
      // Ragged: each sequence at its own position with its own count (0: it sits this step out).
      std::vector<SeqAttention> seqs;
      int64_t total = 0;
      for (int i = 0; i < n_seqs; ++i) {
        const int64_t n = step == 0 ? rng.integer(1, 40) : rng.integer(0, 3);
        seqs.push_back({batched[i].get(), batched[i]->seq_len(), n});
        total += n;
      }
      auto q = rng.floats(total * n_q * hd, -2, 2);
      auto k = rng.floats(total * n_kv * hd);
      auto v = rng.floats(total * n_kv * hd);
      std::vector<float> out(q.size());
      const Tensor out_t = view(out, {total, n_q, hd});
      REQUIRE(attention_batch(seqs, 0, view(q, {total, n_q, hd}), view(k, {total, n_kv, hd}),
                              view(v, {total, n_kv, hd}), scale, &out_t)
                  .ok());
      int64_t row = 0;
      for (int i = 0; i < n_seqs; ++i) {
        const int64_t n = seqs[i].n_new;
        auto slice = [&](const std::vector<float>& x, int heads) {
          return std::vector<float>(x.begin() + row * heads * hd, x.begin() + (row + n) * heads * hd);
        };
        auto qi = slice(q, n_q), ki = slice(k, n_kv), vi = slice(v, n_kv);
        std::vector<float> alone(qi.size());
        REQUIRE(single[i]
                    ->attention(0, view(qi, {n, n_q, hd}), view(ki, {n, n_kv, hd}),
                                view(vi, {n, n_kv, hd}), single[i]->seq_len(), scale,
                                view(alone, {n, n_q, hd}))
                    .ok());
        INFO("step " << step << ", sequence " << i << ", n_new " << n);
        REQUIRE(slice(out, n_q) == alone);
        require_close(alone, refs[i].attend(qi, ki, vi, n_q, scale));
        REQUIRE(batched[i]->seq_len() == single[i]->seq_len());
        row += n;
      }
    }
  }
}

// The engine rebuilds evicted pages by recomputing their tokens, perhaps in other chunks: a token's
// attention must not depend on the chunk it is in. Whole prompts take the fast path's grouped
// scores (many rows an item), single tokens its key-by-key ones (a few query heads): equal bits.
TEST_CASE("a token's attention is the same bits in a long chunk and alone", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (int hd : {64, 128, 256}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      INFO("head_dim " << hd << " " << dtype_name(dtype));
      const int n_q = 8, n_kv = 2;
      const int64_t n = 150;  // three key blocks, the last partial
      CpuBackend backend({2});
      PagePoolOptions o;
      o.geometry = {1, n_kv, hd, dtype};
      o.num_pages = 32;
      auto pool = std::move(PagePool::create(backend, o)).value();
      auto whole = std::move(PagedKVCache::create(*pool, n)).value();
      auto one_by_one = std::move(PagedKVCache::create(*pool, n)).value();
      auto q = rng.floats(n * n_q * hd, -2, 2), k = rng.floats(n * n_kv * hd), v = rng.floats(n * n_kv * hd);
      std::vector<float> a(q.size()), b(q.size());
      REQUIRE(whole->attention(0, view(q, {n, n_q, hd}), view(k, {n, n_kv, hd}), view(v, {n, n_kv, hd}), 0, 0.1f,
                               view(a, {n, n_q, hd}))
                  .ok());
      for (int64_t t = 0; t < n; ++t) {
        auto part = [&](std::vector<float>& x, int heads) { return Tensor::wrap(x.data() + t * heads * hd, {1, heads, hd}, DType::kF32); };
        REQUIRE(one_by_one->attention(0, part(q, n_q), part(k, n_kv), part(v, n_kv), t, 0.1f, part(b, n_q)).ok());
      }
      REQUIRE(a == b);
    }
  }
}

TEST_CASE("attention over a long context with 16-bit q and out", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const int hd = 128, n_q = 8, n_kv = 1;
  CpuBackend backend({2});
  PagePoolOptions o;
  o.geometry = {1, n_kv, hd, DType::kBF16};
  o.num_pages = pages_for_tokens(2100, 16);
  auto pool = std::move(PagePool::create(backend, o)).value();
  auto cache = std::move(PagedKVCache::create(*pool, 2100)).value();
  ReferenceKV ref(n_kv, hd, DType::kBF16);
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t n : {2000, 1, 1, 37}) {
    auto q = rng.floats(n * n_q * hd, -3, 3);
    for (float& x : q) x = round_to(DType::kBF16, x);
    auto k = rng.floats(n * n_kv * hd), v = rng.floats(n * n_kv * hd);
    std::vector<uint16_t> q16(q.size()), out16(q.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = f32_to_bf16(q[i]);
    auto out = cache->attention(0, Tensor::wrap(q16.data(), {n, n_q, hd}, DType::kBF16),
                                view(k, {n, n_kv, hd}), view(v, {n, n_kv, hd}), cache->seq_len(),
                                scale);
    REQUIRE(out.ok());
    REQUIRE(out->dtype() == DType::kF32);
    require_close(std::vector<float>(out->data_as<float>(), out->data_as<float>() + q.size()),
                  ref.attend(q, k, v, n_q, scale));
    // The same attention written as bf16: within bf16's rounding of the f32 result.
    REQUIRE(cache->popn(n) == n);
    ref.truncate(cache->seq_len());
    REQUIRE(cache->attention(0, Tensor::wrap(q16.data(), {n, n_q, hd}, DType::kBF16),
                             view(k, {n, n_kv, hd}), view(v, {n, n_kv, hd}), cache->seq_len(),
                             scale, Tensor::wrap(out16.data(), {n, n_q, hd}, DType::kBF16))
                .ok());
    const auto want = ref.attend(q, k, v, n_q, scale);
    for (size_t i = 0; i < want.size(); ++i) {
      REQUIRE(bf16_to_f32(out16[i]) == Approx(want[i]).epsilon(8e-3).margin(1e-4));
    }
  }
}

TEST_CASE("an attention step over every layer equals attention_batch layer by layer", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const int hd = 32, n_q = 4, n_kv = 2, layers = 3, n_seqs = 3;
  CpuBackend backend({2});
  auto pool = PagePool::create(backend, {{layers, n_kv, hd, DType::kF32}, 8, 64}).value();
  std::vector<std::unique_ptr<PagedKVCache>> stepped, layered;
  for (int i = 0; i < n_seqs; ++i) {
    stepped.push_back(std::move(PagedKVCache::create(*pool, 256)).value());
    layered.push_back(std::move(PagedKVCache::create(*pool, 256)).value());
  }
  AttentionStep step;
  for (int it = 0; it < 5; ++it) {
    std::vector<SeqAttention> a, b;
    int64_t total = 0;
    for (int i = 0; i < n_seqs; ++i) {
      const int64_t n = it == 0 ? rng.integer(1, 20) : rng.integer(1, 3);
      a.push_back({stepped[i].get(), stepped[i]->seq_len(), n});
      b.push_back({layered[i].get(), layered[i]->seq_len(), n});
      total += n;
    }
    REQUIRE(step.begin(a, n_q).ok());
    for (int l = 0; l < layers; ++l) {
      auto q = rng.floats(total * n_q * hd, -2, 2);
      auto k = rng.floats(total * n_kv * hd);
      auto v = rng.floats(total * n_kv * hd);
      std::vector<float> out_a(q.size(), -7.0f), out_b(q.size(), 7.0f);
      const Tensor ta = view(out_a, {total, n_q, hd}), tb = view(out_b, {total, n_q, hd});
      REQUIRE(step.run(l, view(q, {total, n_q, hd}), view(k, {total, n_kv, hd}), view(v, {total, n_kv, hd}), 0.2f, ta)
                  .ok());
      CHECK(stepped[0]->layer_len(l) == a[0].pos);  // lengths move at commit
      REQUIRE(attention_batch(b, l, view(q, {total, n_q, hd}), view(k, {total, n_kv, hd}), view(v, {total, n_kv, hd}),
                              0.2f, &tb)
                  .ok());
      INFO("iteration " << it << ", layer " << l);
      REQUIRE(out_a == out_b);
    }
    step.commit();
    for (int i = 0; i < n_seqs; ++i) {
      REQUIRE(stepped[i]->seq_len() == layered[i]->seq_len());
      for (int l = 0; l < layers; ++l) REQUIRE(stepped[i]->layer_len(l) == layered[i]->seq_len());
      REQUIRE(stepped[i]->pages_used() == layered[i]->pages_used());
    }
  }
}

TEST_CASE("an attention step that is cancelled or refused changes no cache", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const int hd = 8, n_q = 4, n_kv = 2, layers = 2;
  CpuBackend backend({1});
  auto pool = PagePool::create(backend, {{layers, n_kv, hd, DType::kF32}, 4, 4}).value();
  auto cache = std::move(PagedKVCache::create(*pool, 64)).value();
  AttentionStep step;
  const SeqAttention first{cache.get(), 0, 6};
  REQUIRE(step.begin({&first, 1}, n_q).ok());
  CHECK(pool->num_free() == 2);  // reserved at begin
  CHECK(step.begin({&first, 1}, n_q).code() == StatusCode::kFailedPrecondition);  // one step at a time
  step.cancel();
  CHECK(cache->seq_len() == 0);
  CHECK(pool->num_free() == 4);
  // Refusals: too many pages, a wrong position, a layer half-way, query heads, run outside a step.
  const SeqAttention big{cache.get(), 0, 17};
  CHECK(step.begin({&big, 1}, n_q).code() == StatusCode::kResourceExhausted);
  CHECK(pool->num_free() == 4);
  const SeqAttention late{cache.get(), 3, 1};
  CHECK(step.begin({&late, 1}, n_q).code() == StatusCode::kFailedPrecondition);
  CHECK(step.begin({&first, 1}, 3).code() == StatusCode::kInvalidArgument);
  auto q = rng.floats(n_q * hd), k = rng.floats(n_kv * hd), v = rng.floats(n_kv * hd);
  std::vector<float> out(q.size());
  std::vector<float> q6 = rng.floats(6 * n_q * hd), k6 = rng.floats(6 * n_kv * hd), v6 = rng.floats(6 * n_kv * hd);
  CHECK(step.run(0, view(q, {1, n_q, hd}), view(k, {1, n_kv, hd}), view(v, {1, n_kv, hd}), 0.3f, view(out, {1, n_q, hd}))
            .code() == StatusCode::kFailedPrecondition);
  REQUIRE(cache->attention(0, view(q, {1, n_q, hd}), view(k, {1, n_kv, hd}), view(v, {1, n_kv, hd}), 0, 0.3f,
                           view(out, {1, n_q, hd}))
              .ok());  // layer 0 holds 1 position, layer 1 none: a step needs every layer at pos
  const SeqAttention half{cache.get(), 1, 1};
  const Status s = step.begin({&half, 1}, n_q);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("layer 1"));
  CHECK(cache->layer_len(0) == 1);
  CHECK(pool->num_free() == 3);
  // A step whose run fails (a wrong shape) is cancelled by its owner; nothing moved.
  cache->popn(1);
  REQUIRE(step.begin({&first, 1}, n_q).ok());
  CHECK(step.run(0, view(q, {1, n_q, hd}), view(k, {1, n_kv, hd}), view(v, {1, n_kv, hd}), 0.3f, view(out, {1, n_q, hd}))
            .code() == StatusCode::kInvalidArgument);  // 1 token where the step has 6
  std::vector<float> out6(q6.size());
  REQUIRE(step.run(0, view(q6, {6, n_q, hd}), view(k6, {6, n_kv, hd}), view(v6, {6, n_kv, hd}), 0.3f,
                   view(out6, {6, n_q, hd}))
              .ok());
  step.cancel();
  CHECK(cache->seq_len() == 0);
  CHECK(pool->num_free() == 4);
}

TEST_CASE("an attention step with a rope rotates q and k as cpu rope does before appending", "[kv]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const int hd = 16, n_q = 4, n_kv = 2, rope_dim = 12;
  for (bool adjacent : {false, true}) {
    CpuBackend backend({1});
    PagePoolOptions o;
    o.geometry = {1, n_kv, hd, DType::kF32};
    o.page_size = 4;
    o.num_pages = 32;
    auto pool = std::move(PagePool::create(backend, o)).value();
    auto a = std::move(PagedKVCache::create(*pool, 64)).value();
    auto b = std::move(PagedKVCache::create(*pool, 64)).value();
    std::vector<float> inv_freq(rope_dim / 2);
    cpu::rope_inv_freq(rope_dim, 10000.0f, nullptr, inv_freq.data());
    const AttentionRope rope{inv_freq.data(), rope_dim, adjacent};
    AttentionStep step;
    for (int64_t n : {5, 1, 3}) {
      const int64_t pos = a->seq_len();
      auto q = rng.floats(n * n_q * hd), k = rng.floats(n * n_kv * hd), v = rng.floats(n * n_kv * hd);
      auto q2 = q, k2 = k;
      std::vector<int32_t> positions;
      for (int64_t i = 0; i < n; ++i) positions.push_back(static_cast<int32_t>(pos + i));
      cpu::rope(q2.data(), positions.data(), n, n_q, hd, rope_dim, 10000.0f, nullptr, adjacent);
      cpu::rope(k2.data(), positions.data(), n, n_kv, hd, rope_dim, 10000.0f, nullptr, adjacent);
      std::vector<float> out_a(q.size()), out_b(q.size());
      const SeqAttention sa{a.get(), pos, n};
      REQUIRE(step.begin({&sa, 1}, n_q, &rope).ok());
      REQUIRE(step.run(0, view(q, {n, n_q, hd}), view(k, {n, n_kv, hd}), view(v, {n, n_kv, hd}), 0.25f,
                       view(out_a, {n, n_q, hd}))
                  .ok());
      step.commit();
      REQUIRE(b->attention(0, view(q2, {n, n_q, hd}), view(k2, {n, n_kv, hd}), view(v, {n, n_kv, hd}), pos, 0.25f,
                           view(out_b, {n, n_q, hd}))
                  .ok());
      INFO("adjacent " << adjacent << ", n " << n);
      CHECK(q == q2);  // rotated in place
      CHECK(out_a == out_b);
    }
  }
  // A rope that cannot be: refused before anything changes.
  CpuBackend backend({1});
  auto pool = std::move(PagePool::create(backend, {{1, n_kv, hd, DType::kF32}, 4, 8})).value();
  auto c = std::move(PagedKVCache::create(*pool, 64)).value();
  const SeqAttention s{c.get(), 0, 1};
  float f[8] = {};
  for (const AttentionRope& bad : {AttentionRope{f, 18, false}, AttentionRope{f, 7, false}, AttentionRope{nullptr, 8, false}}) {
    CHECK(AttentionStep().begin({&s, 1}, n_q, &bad).code() == StatusCode::kInvalidArgument);
  }
  CHECK(pool->num_free() == 8);
}
