// Paged attention on the GPU against the CPU's (checked against float64 in tests/kv) and against
// a contiguous GPU cache, over ragged batches of prefill chunks (tensor cores from 16 new tokens)
// and decodes: page sizes 16 and 32 (and 7, 24),
// GQA ratios 1 to 8, head_dim 64 and 128, f16/bf16/f32 caches, contexts up to 32k (split-KV), and
// the manual reference path. [cuda]: skipped (and saying so) without a GPU.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdio>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/backend/cuda/cuda_backend.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/cuda/cuda_attention.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/kv/page_pool.h"
#include "support/cuda_helpers.h"
#include "support/random.h"

using namespace combs;
using combs::testing::download;
using combs::testing::gpu_or_skip;
using combs::testing::upload;

namespace {

// max |a - b| / max |b|; infinite when a holds a NaN.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 1e-6;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

struct Case {
  int page_size, n_kv, group, head_dim;
  DType dtype;
  std::vector<std::pair<int64_t, int64_t>> seqs;  // (cached prefix, new tokens)
  AttentionParams params = 0.125f;                 // scale, sliding window, softcap
  std::vector<float> sinks = {};                   // a logit per query head (params.sinks), or none
};

// Runs one batched call on CPU paged caches, GPU paged caches (flash and manual) and GPU
// contiguous caches fed the same K/V, and compares the outputs.
void run_case(CudaBackend& gpu, const Case& c, uint64_t seed) {
  CpuBackend cpu;
  testing::Rng rng(seed);
  const KVGeometry g{1, c.n_kv, c.head_dim, c.dtype};
  int64_t pages = 0, max_len = 0;
  for (auto [pre, n] : c.seqs) {
    pages += (pre + n + c.page_size - 1) / c.page_size + 1;
    max_len = std::max(max_len, pre + n);
  }
  auto cpu_pool = PagePool::create(cpu, {g, c.page_size, pages}).value();
  auto gpu_pool = PagePool::create(gpu, {g, c.page_size, pages}).value();
  std::vector<std::unique_ptr<KVCache>> cpu_caches, gpu_caches, contiguous;
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    cpu_caches.push_back(PagedKVCache::create(*cpu_pool, max_len).value());
    gpu_caches.push_back(PagedKVCache::create(*gpu_pool, max_len).value());
    contiguous.push_back(ContiguousKVCache::create(gpu, g, max_len).value());
  }
  const int n_q = c.n_kv * c.group;
  // The sinks: the CPU reads them from host memory, the GPU from its own.
  const Tensor d_sinks = c.sinks.empty() ? Tensor() : upload(gpu, c.sinks, Shape{n_q});
  // The prefixes: appended in one append-only batched call per cache set.
  auto batched = [&](std::vector<std::unique_ptr<KVCache>>& caches, bool prefix, Backend* dev,
                     std::vector<float>& q, std::vector<float>& k, std::vector<float>& v, int64_t tokens,
                     AttentionImpl impl) -> std::vector<float> {
    std::vector<SeqAttention> batch;
    for (size_t i = 0; i < caches.size(); ++i) {
      const auto [pre, n] = c.seqs[i];
      batch.push_back({caches[i].get(), prefix ? 0 : pre, prefix ? pre : n});
    }
    const Shape qs{tokens, n_q, c.head_dim}, ks{tokens, c.n_kv, c.head_dim};
    AttentionParams params = c.params;
    if (!c.sinks.empty()) params.sinks = dev == nullptr ? c.sinks.data() : d_sinks.data_as<float>();
    if (dev == nullptr) {
      std::vector<float> out(static_cast<size_t>(tokens * n_q * c.head_dim));
      Tensor ot = Tensor::wrap(out.data(), qs, DType::kF32);
      REQUIRE(attention_batch(batch, 0, Tensor::wrap(q.data(), qs, DType::kF32), Tensor::wrap(k.data(), ks, DType::kF32),
                              Tensor::wrap(v.data(), ks, DType::kF32), params, prefix ? nullptr : &ot, impl)
                  .ok());
      return out;
    }
    Tensor qd = prefix ? Tensor() : upload(gpu, q, qs), kd = upload(gpu, k, ks), vd = upload(gpu, v, ks);
    Tensor od = gpu.alloc(qs, DType::kF32).value();
    const Status s = attention_batch(batch, 0, qd, kd, vd, params, prefix ? nullptr : &od, impl);
    INFO(s.to_string());
    REQUIRE(s.ok());
    REQUIRE(gpu.synchronize().ok());
    return prefix ? std::vector<float>() : download(gpu, od);
  };
  int64_t pre_tokens = 0, new_tokens = 0;
  for (auto [pre, n] : c.seqs) pre_tokens += pre, new_tokens += n;
  auto pk = rng.floats(static_cast<size_t>(pre_tokens * c.n_kv * c.head_dim)),
       pv = rng.floats(static_cast<size_t>(pre_tokens * c.n_kv * c.head_dim));
  std::vector<float> none;
  if (pre_tokens > 0) {
    batched(cpu_caches, true, nullptr, none, pk, pv, pre_tokens, AttentionImpl::kFlash);
    batched(gpu_caches, true, &gpu, none, pk, pv, pre_tokens, AttentionImpl::kFlash);
    batched(contiguous, true, &gpu, none, pk, pv, pre_tokens, AttentionImpl::kFlash);
  }
  auto q = rng.floats(static_cast<size_t>(new_tokens * n_q * c.head_dim)),
       k = rng.floats(static_cast<size_t>(new_tokens * c.n_kv * c.head_dim)),
       v = rng.floats(static_cast<size_t>(new_tokens * c.n_kv * c.head_dim));
  const auto want = batched(cpu_caches, false, nullptr, q, k, v, new_tokens, AttentionImpl::kFlash);
  const auto paged = batched(gpu_caches, false, &gpu, q, k, v, new_tokens, AttentionImpl::kFlash);
  const auto flat = batched(contiguous, false, &gpu, q, k, v, new_tokens, AttentionImpl::kFlash);
  // Chunks of 16 or more new tokens run on tensor cores: q and the softmax weights are rounded to
  // the cache dtype there, so the tolerance is that dtype's.
  const double tol = c.dtype == DType::kF32 ? 2e-4 : c.dtype == DType::kF16 ? 3e-3 : 2.5e-2;
  CHECK(rel_err(paged, want) < tol);
  CHECK(rel_err(flat, paged) < 2e-5);
  // The manual path on the GPU: roll the new tokens back and attend again.
  for (size_t i = 0; i < gpu_caches.size(); ++i) gpu_caches[i]->popn(c.seqs[i].second);
  const auto manual = batched(gpu_caches, false, &gpu, q, k, v, new_tokens, AttentionImpl::kManual);
  CHECK(rel_err(manual, want) < 2e-4);
}

}  // namespace

TEST_CASE("cuda paged attention matches the cpu and a contiguous cache over ragged batches", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const std::vector<std::pair<int64_t, int64_t>> ragged = {{0, 37}, {100, 1}, {5, 20}, {1000, 1}, {300, 64}, {31, 1}};
  uint64_t seed = 1;
  for (int page_size : {16, 32}) {
    for (int group : {1, 2, 4, 8}) {
      for (int head_dim : {64, 128}) {
        INFO("page " << page_size << " group " << group << " head_dim " << head_dim);
        run_case(*gpu, {page_size, 2, group, head_dim, DType::kF16, ragged}, seed++);
      }
    }
  }
  for (DType dt : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dt));
    run_case(*gpu, {16, 4, 4, 64, dt, ragged}, seed++);
  }
  // head_dim 256 (gemma): f16/bf16 caches on tensor cores, groups of one warp and of four.
  for (int group : {1, 2, 8, 20}) {
    INFO("head_dim 256 group " << group);
    run_case(*gpu, {16, 2, group, 256, DType::kBF16, ragged}, seed++);
    run_case(*gpu, {32, 2, group, 256, DType::kF16, ragged}, seed++);
  }
  // Page sizes that are not powers of two (positions to pages by division; a 16-key tile spans up
  // to three pages of 7).
  for (int page_size : {7, 24}) {
    INFO("page " << page_size);
    run_case(*gpu, {page_size, 2, 4, 128, DType::kBF16, ragged}, seed++);
    run_case(*gpu, {page_size, 2, 8, 64, DType::kF32, ragged}, seed++);
  }
  // Groups the tensor-core kernel packs unevenly (3, 7 heads per KV head: a prefill tile holds
  // 21 or 9 tokens), fills (16: one warp's 16 rows) or spreads over a 4-warp decode block (20, 32).
  for (int group : {3, 7, 16, 20, 32}) {
    INFO("group " << group);
    run_case(*gpu, {16, 2, group, 128, DType::kBF16, ragged}, seed++);
    run_case(*gpu, {32, 1, group, 64, DType::kF16, ragged}, seed++);
  }
  // f32 caches (the plain kernel) at every group up to 8: Llama 3.2 3B has 3 heads per KV head,
  // Qwen2.5-32B 5, Qwen2.5-1.5B 6, Qwen2.5-0.5B 7.
  for (int group : {3, 5, 6, 7}) {
    INFO("f32 group " << group);
    run_case(*gpu, {16, 2, group, group % 2 ? 64 : 128, DType::kF32, ragged}, seed++);
  }
}

TEST_CASE("cuda paged decode over a 32k context splits and merges correctly", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  run_case(*gpu, {16, 2, 4, 128, DType::kF16, {{32767, 1}}}, 99);
  run_case(*gpu, {32, 8, 4, 64, DType::kBF16, {{16000, 1}, {9000, 1}, {20, 1}}}, 100);
  // Several new tokens (fewer than a prefill tile's minimum) after a long prefix: the splits are
  // sized from the sequence's end, each token's keys end at its own position.
  run_case(*gpu, {16, 2, 4, 128, DType::kBF16, {{5000, 8}, {3, 1}}}, 101);
}

TEST_CASE("cuda decode over short contexts, a few splits each, matches the cpu", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  // Splits of 16 keys (head_dim 128) or 32 (head_dim 64): a few splits per sequence, empty ones
  // in the grid beside them, each token's merged by merge_splits_kernel (grids of more than 8
  // splits); the paged call then the contiguous one.
  run_case(*gpu, {16, 2, 4, 128, DType::kF16, {{100, 1}, {40, 1}, {3, 1}}}, 201);
  run_case(*gpu, {32, 8, 4, 64, DType::kBF16, {{250, 1}, {70, 3}}}, 202);
  run_case(*gpu, {16, 2, 16, 128, DType::kBF16, {{200, 1}}}, 203);  // a 16-head group: one warp's rows
  run_case(*gpu, {16, 2, 4, 64, DType::kBF16, {{0, 37}, {100, 1}}}, 204);  // after a prefill grid
  run_case(*gpu, {16, 4, 4, 64, DType::kF16, {{270, 1}, {200, 1}}}, 205);
  // Past 16 splits (a second batch of the merge's loads), a 4-warp decode block (groups above 16
  // heads), many decode tokens.
  run_case(*gpu, {16, 2, 4, 128, DType::kBF16, {{300, 1}, {20, 1}}}, 206);
  run_case(*gpu, {16, 2, 20, 128, DType::kBF16, {{500, 1}}}, 207);
  run_case(*gpu,
           {16, 2, 4, 128, DType::kBF16, {{100, 1}, {90, 1}, {80, 1}, {70, 1}, {60, 1}, {50, 1}, {40, 1}, {30, 1}, {20, 1}}},
           208);
}

TEST_CASE("cuda decode of many sequences merges its splits in the last split's block", "[cuda]") {
  // Enough decode tokens x KV heads that the grid takes at most 8 splits (on an H100 / H200, 132
  // multiprocessors: 3 or 4 here), so the last split's block to finish merges each token's (no
  // merge kernel): every head size with blocks of 1 (2 for head_dim 256) and 4 warps, windows that
  // leave splits empty (2 keys over up to 4 splits), sinks, prefill tiles in the same call.
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto decodes = [](int n, int64_t base, int64_t step) {
    std::vector<std::pair<int64_t, int64_t>> seqs;
    for (int i = 0; i < n; ++i) seqs.push_back({base + (i * step) % 700, 1});
    return seqs;
  };
  run_case(*gpu, {16, 8, 4, 128, DType::kBF16, decodes(24, 40, 23)}, 401);
  run_case(*gpu, {32, 8, 8, 64, DType::kF16, decodes(20, 70, 37)}, 402);
  run_case(*gpu, {16, 4, 2, 256, DType::kBF16, decodes(20, 30, 41)}, 403);  // two warps a block
  for (int head_dim : {64, 128, 256}) {  // four warps a block
    INFO("group 20 head_dim " << head_dim);
    run_case(*gpu, {16, 2, 20, head_dim, DType::kBF16, decodes(40, 60, 29)}, 404);
  }
  auto mixed = decodes(30, 50, 31);
  mixed.insert(mixed.begin(), {{0, 37}, {300, 64}});
  run_case(*gpu, {16, 8, 4, 128, DType::kF16, mixed}, 405);
  std::vector<float> sinks;
  for (int h = 0; h < 32; ++h) sinks.push_back(std::array<float, 4>{-20.0f, 0.5f, 2.0f, 30.0f}[h % 4]);
  for (int64_t window : {2, 7, 128}) {
    INFO("window " << window);
    run_case(*gpu, {16, 8, 4, 64, DType::kBF16, decodes(24, 100, 53), AttentionParams(0.125f, window, 0.0f), sinks}, 406);
  }
}

TEST_CASE("cuda tensor-core prefill over long chunks after long prefixes matches the cpu", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  run_case(*gpu, {16, 8, 4, 128, DType::kBF16, {{1000, 300}, {0, 513}, {77, 16}, {5000, 1}}}, 7);
  run_case(*gpu, {32, 2, 8, 64, DType::kF16, {{2047, 129}, {1, 15}, {0, 17}}}, 8);
}

TEST_CASE("cuda sliding-window and softcapped attention matches the cpu", "[cuda]") {
  // The CPU kernels are checked against the float64 reference (tests/kv/attention_test.cc).
  // Windows of one key, mid-page (7), a page, wider than the contexts; ragged prefill (f32 and
  // tensor-core tiles, tiles that straddle the window's edge), decode with splits that the window
  // leaves empty, long contexts.
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const std::vector<std::pair<int64_t, int64_t>> ragged = {{0, 37}, {100, 1}, {5, 20}, {1000, 1}, {300, 64}, {31, 1}, {40, 3}};
  uint64_t seed = 300;
  for (int64_t window : {1, 7, 16, 4096}) {
    for (float softcap : {0.0f, 2.0f}) {
      for (int head_dim : {64, 128, 256}) {
        INFO("window " << window << " softcap " << softcap << " head_dim " << head_dim);
        const AttentionParams p(0.125f, window, softcap);
        run_case(*gpu, {16, 2, 4, head_dim, DType::kBF16, ragged, p}, seed++);
        run_case(*gpu, {32, 2, 8, head_dim, DType::kF16, ragged, p}, seed++);
        if (head_dim != 256) run_case(*gpu, {16, 4, 1, head_dim, DType::kF32, ragged, p}, seed++);  // f32 caches: 64, 128
        run_case(*gpu, {16, 2, 4, head_dim, DType::kBF16, {{9000, 1}, {2047, 129}, {4090, 16}}, p}, seed++);
      }
    }
  }
}

TEST_CASE("cuda attention with sinks matches the cpu", "[cuda]") {
  // gpt-oss's sinks (a logit per query head in every row's softmax, no value; the CPU's are held to
  // float64 in tests/kv): on every GPU path (f32 decode, tensor-core prefill and decode, split-KV
  // merges, the manual reference) with windows, and sinks far below, near and far above the scores
  // (a sink of 30 outweighs every key: the rows come out near 0).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const std::vector<std::pair<int64_t, int64_t>> ragged = {{0, 37}, {100, 1}, {5, 20}, {1000, 1}, {300, 64}, {31, 1}, {40, 3}};
  uint64_t seed = 900;
  for (int64_t window : {0, 7, 128}) {
    INFO("window " << window);
    const AttentionParams p(0.125f, window, 0.0f);
    auto sinks = [](int n) {
      std::vector<float> s;
      for (int h = 0; h < n; ++h) s.push_back(std::array<float, 5>{-20.0f, 0.5f, -1.0f, 2.0f, 30.0f}[h % 5]);
      return s;
    };
    run_case(*gpu, {16, 2, 4, 64, DType::kBF16, ragged, p, sinks(8)}, seed++);
    run_case(*gpu, {32, 2, 8, 64, DType::kF16, ragged, p, sinks(16)}, seed++);
    run_case(*gpu, {16, 4, 2, 64, DType::kF32, ragged, p, sinks(8)}, seed++);
    run_case(*gpu, {16, 1, 8, 128, DType::kF32, ragged, p, sinks(8)}, seed++);
    run_case(*gpu, {16, 2, 4, 64, DType::kBF16, {{9000, 1}, {2047, 129}, {4090, 16}}, p, sinks(8)}, seed++);
  }
}

TEST_CASE("a cuda attention step rotates q and k in its append as the cpu step does", "[cuda]") {
  auto gpu_ptr = gpu_or_skip();
  if (!gpu_ptr) return;
  CudaBackend& gpu = *gpu_ptr;
  testing::Rng rng(testing::test_seed());
  INFO("seed " << rng.seed());
  // Both pair layouts, whole and partial rotation, frequency factors; the third sequence starts
  // after a 30,000-position prefix (large angles).
  const int hd = 64, n_kv = 2, n_q = 8, layers = 2;
  const int64_t prefix = 30000;
  for (auto [adjacent, rope_dim] : {std::pair{false, 64}, std::pair{true, 64}, std::pair{false, 32}, std::pair{true, 32}}) {
    CpuBackend cpu;
    const KVGeometry g{layers, n_kv, hd, DType::kF32};
    const int64_t pages = 64 + prefix / 16 + 1;
    auto cpu_pool = PagePool::create(cpu, {g, 16, pages}).value();
    auto gpu_pool = PagePool::create(gpu, {g, 16, pages}).value();
    std::vector<std::unique_ptr<KVCache>> cc, gc;
    for (int i = 0; i < 3; ++i) {
      cc.push_back(PagedKVCache::create(*cpu_pool, prefix + 256).value());
      gc.push_back(PagedKVCache::create(*gpu_pool, prefix + 256).value());
    }
    const auto pk = rng.floats(prefix * n_kv * hd), pv = rng.floats(prefix * n_kv * hd);
    const Shape ps{prefix, n_kv, hd};
    const Tensor pkd = upload(gpu, pk, ps), pvd = upload(gpu, pv, ps);
    for (int l = 0; l < layers; ++l) {
      REQUIRE(cc[2]->append(l, Tensor::wrap(const_cast<float*>(pk.data()), ps, DType::kF32),
                            Tensor::wrap(const_cast<float*>(pv.data()), ps, DType::kF32), 0)
                  .ok());
      REQUIRE(gc[2]->append(l, pkd, pvd, 0).ok());
    }
    auto factors = rng.floats(rope_dim / 2);
    for (float& f : factors) f = 1.0f + std::abs(f);
    std::vector<float> inv_freq(rope_dim / 2);
    cpu::rope_inv_freq(rope_dim, 500000.0f, factors.data(), inv_freq.data());
    const Tensor inv_gpu = upload(gpu, inv_freq, {rope_dim / 2});
    const AttentionRope cpu_rope{inv_freq.data(), rope_dim, adjacent}, gpu_rope{inv_gpu.data_as<float>(), rope_dim, adjacent};
    // Layer 1 rotates by its own frequencies (a windowed layer's RoPE base) and sees 5 keys.
    std::vector<float> inv_local(rope_dim / 2);
    cpu::rope_inv_freq(rope_dim, 10000.0f, nullptr, inv_local.data());
    const Tensor inv_local_gpu = upload(gpu, inv_local, {rope_dim / 2});
    AttentionStep cpu_step, gpu_step;
    for (int it = 0; it < 4; ++it) {  // a ragged prefill (one sequence on tensor cores), then decodes
      std::vector<SeqAttention> cb, gb;
      int64_t total = 0;
      for (int i = 0; i < 3; ++i) {
        const int64_t n = it == 0 ? 7 + 13 * i : 1;
        cb.push_back({cc[i].get(), cc[i]->seq_len(), n});
        gb.push_back({gc[i].get(), gc[i]->seq_len(), n});
        total += n;
      }
      REQUIRE(cpu_step.begin(cb, n_q, &cpu_rope).ok());
      REQUIRE(gpu_step.begin(gb, n_q, &gpu_rope).ok());
      for (int l = 0; l < layers; ++l) {
        auto q = rng.floats(total * n_q * hd), k = rng.floats(total * n_kv * hd), v = rng.floats(total * n_kv * hd);
        const Shape qs{total, n_q, hd}, ks{total, n_kv, hd};
        Tensor qd = upload(gpu, q, qs), kd = upload(gpu, k, ks), vd = upload(gpu, v, ks);
        Tensor od = gpu.alloc(qs, DType::kF32).value();
        std::vector<float> out(q.size());
        const AttentionParams params(0.125f, l == 1 ? 5 : 0, 0.0f);
        REQUIRE(cpu_step.run(l, Tensor::wrap(q.data(), qs, DType::kF32), Tensor::wrap(k.data(), ks, DType::kF32),
                             Tensor::wrap(v.data(), ks, DType::kF32), params, Tensor::wrap(out.data(), qs, DType::kF32),
                             l == 1 ? inv_local.data() : nullptr)
                    .ok());
        const Status s = gpu_step.run(l, qd, kd, vd, params, od, l == 1 ? inv_local_gpu.data_as<float>() : nullptr);
        INFO(s.to_string());
        REQUIRE(s.ok());
        INFO("adjacent " << adjacent << ", rope_dim " << rope_dim << ", iteration " << it << ", layer " << l);
        CHECK(rel_err(download(gpu, qd), q) < 1e-6);  // q rotated in place, as the cpu's
        CHECK(rel_err(download(gpu, od), out) < 2e-4);
      }
      cpu_step.commit();
      gpu_step.commit();
      for (int i = 0; i < 3; ++i) CHECK(gc[i]->seq_len() == cc[i]->seq_len());
    }
  }
}
