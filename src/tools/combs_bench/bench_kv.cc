// combs-bench kv: decode-attention time, paged vs contiguous, for several batch sizes and
// contexts, and the effective bandwidth (bytes of K/V read per second) against the memory
// bandwidth measured in the same run with the same threads.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "common/flags.h"
#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/paged_kv_cache.h"

namespace combs::bench {
namespace {

struct Setup {
  int n_q, n_kv, head_dim, page_size;
  DType dtype;
  AttentionImpl impl;
  int reps;
  bool interleave;  // pages of different sequences alternate in the pool
};

// Fills every cache to `ctx` positions, a page at a time round robin, so that the pages of
// different sequences interleave in the pool as they do under continuous batching.
Status fill(std::vector<KVCache*>& caches, int64_t ctx, const Setup& s, CpuBackend& backend,
            int64_t chunk) {
  COMBS_ASSIGN_OR_RETURN(Tensor kv, backend.alloc({chunk, s.n_kv, s.head_dim}, DType::kF32));
  float* d = kv.data_as<float>();
  uint32_t x = 12345;
  for (int64_t i = 0; i < kv.numel(); ++i) {
    x = x * 1664525u + 1013904223u;
    d[i] = float(int32_t(x >> 8) % 2001 - 1000) * 1e-3f;
  }
  for (int64_t pos = 0; pos < ctx; pos += chunk) {
    const int64_t n = std::min(chunk, ctx - pos);
    for (KVCache* c : caches) COMBS_RETURN_IF_ERROR(c->append(0, kv.rows(0, n), kv.rows(0, n), pos));
  }
  return ok_status();
}

// Seconds of one decode step (one new token per sequence over all caches), undone afterwards.
StatusOr<double> time_decode(std::vector<KVCache*>& caches, int64_t ctx, const Setup& s,
                             CpuBackend& backend) {
  const int64_t b = static_cast<int64_t>(caches.size());
  COMBS_ASSIGN_OR_RETURN(Tensor q, backend.alloc({b, s.n_q, s.head_dim}, DType::kF32));
  COMBS_ASSIGN_OR_RETURN(Tensor kv, backend.alloc({b, s.n_kv, s.head_dim}, DType::kF32));
  COMBS_ASSIGN_OR_RETURN(Tensor out, backend.alloc({b, s.n_q, s.head_dim}, DType::kF32));
  for (int64_t i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = std::sin(float(i));
  for (int64_t i = 0; i < kv.numel(); ++i) kv.data_as<float>()[i] = std::cos(float(i));
  std::vector<SeqAttention> seqs;
  for (KVCache* c : caches) seqs.push_back({c, ctx, 1});
  const double t0 = now_seconds();
  COMBS_RETURN_IF_ERROR(
      attention_batch(seqs, 0, q, kv, kv, 1.0f / std::sqrt(float(s.head_dim)), &out, s.impl));
  const double dt = now_seconds() - t0;
  for (KVCache* c : caches) c->popn(1);
  return dt;
}

// A batch of caches of one kind, filled to ctx.
struct Batch {
  std::unique_ptr<PagePool> pool;
  std::vector<std::unique_ptr<KVCache>> owned;
  std::vector<KVCache*> caches;
};

StatusOr<Batch> make_batch(bool paged, int64_t n, int64_t ctx, const Setup& s,
                           CpuBackend& backend) {
  const KVGeometry g{1, s.n_kv, s.head_dim, s.dtype};
  const int64_t cap = ctx + 1;
  Batch b;
  if (paged) {
    const PagePoolOptions o{g, s.page_size, n * pages_for_tokens(cap, s.page_size)};
    COMBS_ASSIGN_OR_RETURN(b.pool, PagePool::create(backend, o));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (paged) {
      COMBS_ASSIGN_OR_RETURN(auto c, PagedKVCache::create(*b.pool, cap));
      b.owned.push_back(std::move(c));
    } else {
      COMBS_ASSIGN_OR_RETURN(auto c, ContiguousKVCache::create(backend, g, cap));
      b.owned.push_back(std::move(c));
    }
    b.caches.push_back(b.owned.back().get());
  }
  COMBS_RETURN_IF_ERROR(fill(b.caches, ctx, s, backend, paged && s.interleave ? s.page_size : ctx));
  return b;
}

// Median decode-step seconds of {contiguous, paged}, measured alternately so that both see
// the same machine noise.
StatusOr<std::pair<double, double>> compare(int64_t n, int64_t ctx, const Setup& s,
                                            CpuBackend& backend) {
  COMBS_ASSIGN_OR_RETURN(Batch contiguous, make_batch(false, n, ctx, s, backend));
  COMBS_ASSIGN_OR_RETURN(Batch paged, make_batch(true, n, ctx, s, backend));
  std::vector<double> tc, tp;
  for (int r = 0; r < s.reps + 1; ++r) {
    COMBS_ASSIGN_OR_RETURN(double c, time_decode(contiguous.caches, ctx, s, backend));
    COMBS_ASSIGN_OR_RETURN(double p, time_decode(paged.caches, ctx, s, backend));
    if (r > 0) {  // the first round warms up
      tc.push_back(c);
      tp.push_back(p);
    }
  }
  return std::make_pair(median(tc), median(tp));
}

}  // namespace

int run_kv(int argc, char** argv) {
  tools::Flags flags("combs-bench kv",
                     {{"seqs", "1,64"}, {"contexts", "512,2048,8192"}, {"heads", "32"},
                      {"kv-heads", "8"}, {"head-dim", "128"}, {"page-size", "16"}, {"dtype", "bf16"},
                      {"impl", "flash"}, {"threads", "0"}, {"reps", "9"}, {"bandwidth-mib", "1024"},
                      {"interleave", "1"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]");
    return 0;
  }
  std::vector<long long> seqs, contexts;
  long long heads, kv_heads, head_dim, page_size, threads, reps, bw_mib, interleave;
  if (!flags.ints("seqs", &seqs) || !flags.ints("contexts", &contexts) ||
      !flags.integer("heads", &heads, 1, 1024) || !flags.integer("kv-heads", &kv_heads, 1, 1024) ||
      !flags.integer("head-dim", &head_dim, 1, 4096) ||
      !flags.integer("page-size", &page_size, 1, 1 << 20) ||
      !flags.integer("threads", &threads, 0, 1024) || !flags.integer("reps", &reps, 1, 100000) ||
      !flags.integer("bandwidth-mib", &bw_mib, 1, 1 << 20) ||
      !flags.integer("interleave", &interleave, 0, 1)) {
    return 2;
  }
  for (long long v : seqs) if (v < 1) return std::fprintf(stderr, "combs-bench: --seqs must be >= 1\n"), 2;
  for (long long v : contexts) if (v < 1) return std::fprintf(stderr, "combs-bench: --contexts must be >= 1\n"), 2;
  Setup s{int(heads), int(kv_heads), int(head_dim), int(page_size), DType::kBF16,
          AttentionImpl::kFlash, int(reps), interleave != 0};
  if (!parse_dtype(flags.str("dtype"), &s.dtype)) {
    std::fprintf(stderr, "combs-bench: --dtype must be f32, f16 or bf16\n");
    return 2;
  }
  const std::string impl = flags.str("impl");
  if (impl != "flash" && impl != "manual") {
    std::fprintf(stderr, "combs-bench: --impl must be flash or manual\n");
    return 2;
  }
  s.impl = impl == "manual" ? AttentionImpl::kManual : AttentionImpl::kFlash;
  if (kv_heads < 1 || heads < kv_heads || heads % kv_heads || head_dim < 1 || page_size < 1 ||
      reps < 1 || seqs.empty() || contexts.empty()) {
    std::fprintf(stderr, "combs-bench: need heads a multiple of kv-heads, positive sizes\n");
    return 2;
  }

  CpuBackend backend({int(threads)});
  const double bandwidth = measure_read_bandwidth(backend, bw_mib << 20, int(reps));
  std::printf("# combs-bench kv: %d threads, %lld q heads / %lld KV heads, head_dim %lld, %s K/V, "
              "page size %lld, %s attention, median of %lld\n",
              backend.num_threads(), heads, kv_heads, head_dim,
              std::string(dtype_name(s.dtype)).c_str(), page_size, impl.c_str(), reps);
  std::printf("# measured read bandwidth: %.1f GB/s (%lld MiB buffer)\n\n", bandwidth, bw_mib);
  std::printf("| seqs | context | contiguous ms | paged ms | paged / contiguous | paged GB/s | "
              "paged / bandwidth |\n|---|---|---|---|---|---|---|\n");
  for (long long n : seqs) {
    for (long long ctx : contexts) {
      const int64_t cap = ctx + 1;
      auto t = compare(n, ctx, s, backend);
      if (!t.ok()) {
        std::fprintf(stderr, "combs-bench: %s\n", t.status().to_string().c_str());
        return 1;
      }
      const auto [tc, tp] = *t;
      const double bytes = double(n) * double(cap) * double(s.n_kv) * double(s.head_dim) * 2.0 *
                           double(dtype_size(s.dtype));
      const double gbs = bytes / tp / 1e9;
      std::printf("| %lld | %lld | %.3f | %.3f | %.2f | %.1f | %.0f%% |\n", n, ctx, tc * 1e3,
                  tp * 1e3, tp / tc, gbs, 100.0 * gbs / bandwidth);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace combs::bench
