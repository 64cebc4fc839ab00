// combs-bench gpu: the CUDA backend on random-weight models — one-session decode, prefill, many
// sessions decoding together — and paged vs contiguous decode attention, each against the bound
// measured in the same run (device-to-device copy bandwidth; bytes of weights or K/V read). With
// --tensor-parallel N: the models split over GPUs 0..N-1 (NCCL; the bound is N GPUs' bandwidth),
// and the all-reduce's latency for decode-sized messages.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <thread>

#include "bench.h"
#include "combs/backend/cuda/cuda_backend.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/cuda/cuda_attention.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/model/cuda_runner.h"
#include "combs/model/tensor_parallel_runner.h"
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {
namespace {

// Device copy bandwidth (bytes read + written per second), median of reps, 1 GiB buffers.
double copy_bandwidth(CudaBackend& b) {
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess) return 0;
  auto st = static_cast<cudaStream_t>(b.stream());
  std::vector<double> v;
  for (int r = 0; r < 6; ++r) {
    cudaStreamSynchronize(st);
    const double t0 = now_seconds();
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st);
    cudaStreamSynchronize(st);
    if (r > 0) v.push_back(2.0 * bytes / (now_seconds() - t0));
  }
  cudaFree(src);
  cudaFree(dst);
  return median(v);
}

struct Run {
  double prompt_tps = 0, decode_tps = 0;
  // Per decode step: forward's host work before its wait, the device's time from its first launch
  // to its last (a runner with time_device; else 0), and all of it.
  double host_us = 0, device_us = 0, step_us = 0;
};

// n_seqs sessions, each a prompt of `prompt` tokens (prefilled one session at a time), then
// `gen` decode steps of all sessions together, greedy as the engine runs it (the argmax on the
// device; only token ids reach the host). Median over reps.
// With `sampling`, every decode step samples on the device by those rules instead of argmax.
// The counters of a runner (of rank 0 for tensor parallelism).
CudaRunnerStats stats_of(ModelRunner& r) {
  if (auto* c = dynamic_cast<CudaRunner*>(&r)) return c->stats();
  if (auto* t = dynamic_cast<TensorParallelRunner*>(&r)) return t->rank(0).stats();
  return {};
}

StatusOr<Run> run_sessions(ModelRunner& runner, int n_seqs, int prompt, int gen, int reps,
                           const SamplingParams* sampling = nullptr) {
  const ModelConfig& c = runner.model().config();
  const int64_t ctx = prompt + gen + 1;
  PagePoolOptions po{c.kv_geometry(DType::kBF16), 16, pages_for_tokens(ctx, 16) * n_seqs + 16};
  COMBS_ASSIGN_OR_RETURN(auto pool, runner.make_page_pool(po));
  std::vector<float> logits(static_cast<size_t>(n_seqs) * c.n_vocab);
  std::vector<int32_t> tokens(prompt);
  for (int i = 0; i < prompt; ++i) tokens[i] = (i * 7919 + 13) % c.n_vocab;
  std::vector<double> tp, td, th, tg, ts;
  for (int r = 0; r < reps + 1; ++r) {  // the first round warms up
    std::vector<std::unique_ptr<PagedKVCache>> caches;
    double t_prompt = 0;
    for (int s = 0; s < n_seqs; ++s) {
      COMBS_ASSIGN_OR_RETURN(auto cache, PagedKVCache::create(*pool, ctx));
      const SequenceInput in{cache.get(), tokens};
      const double t0 = now_seconds();
      COMBS_RETURN_IF_ERROR(runner.forward({&in, 1}, logits.data()));
      t_prompt += now_seconds() - t0;
      caches.push_back(std::move(cache));
    }
    std::vector<int32_t> next(n_seqs), ids(n_seqs);
    std::vector<SequenceInput> batch(n_seqs);
    std::vector<RowSampling> rows;
    ForwardOptions fo;
    fo.token_ids = ids.data();
    if (sampling) {
      for (int s = 0; s < n_seqs; ++s) rows.push_back({sampling, (s + 0.5) / n_seqs, {}});
      fo.sampling = rows;
    }
    const double host0 = stats_of(runner).host_seconds, device0 = stats_of(runner).device_seconds;
    const double t0 = now_seconds();
    for (int i = 0; i < gen; ++i) {
      for (int s = 0; s < n_seqs; ++s) {
        next[s] = static_cast<int32_t>((i * 31 + s * 7 + 7) % c.n_vocab);
        batch[s] = {caches[s].get(), {&next[s], 1}};
      }
      COMBS_RETURN_IF_ERROR(runner.forward(batch, logits.data(), fo));
    }
    const double dt = now_seconds() - t0;
    if (r > 0) {
      th.push_back((stats_of(runner).host_seconds - host0) * 1e6 / gen);
      tg.push_back((stats_of(runner).device_seconds - device0) * 1e6 / gen);
      ts.push_back(dt * 1e6 / gen);
      tp.push_back(double(prompt) * n_seqs / t_prompt);
      td.push_back(double(gen) * n_seqs / dt);
    }
  }
  return Run{median(tp), median(td), median(th), median(tg), median(ts)};
}

// A decode-attention geometry: query heads, KV heads, head_dim (bf16 K/V).
struct AttentionShape {
  int nq, nkv, hd;
};

// Decode attention alone: one token over `ctx` keys for n_seqs sequences of shape a, BF16 K/V; GB/s
// of K/V read, paged (page 16) and contiguous. Timed as a forward runs it: an AttentionStep begun
// once (the host work, once per forward), then the device work of one layer (K/V append, attention,
// split merge) 20 times back to back; median of 5 such rounds.
StatusOr<std::pair<double, double>> attention_gbs(CudaBackend& b, const AttentionShape& a, int64_t ctx, int n_seqs) {
  const KVGeometry g{1, a.nkv, a.hd, DType::kBF16};
  const int nq = a.nq, nkv = a.nkv, hd = a.hd;
  COMBS_ASSIGN_OR_RETURN(auto pool, PagePool::create(b, {g, 16, pages_for_tokens(ctx + 1, 16) * n_seqs}));
  std::vector<std::unique_ptr<KVCache>> paged, flat;
  for (int s = 0; s < n_seqs; ++s) {
    COMBS_ASSIGN_OR_RETURN(auto p, PagedKVCache::create(*pool, ctx + 1));
    COMBS_ASSIGN_OR_RETURN(auto f, ContiguousKVCache::create(b, g, ctx + 1));
    paged.push_back(std::move(p));
    flat.push_back(std::move(f));
  }
  // Fill: append ctx positions (values do not matter for speed; zeros).
  const int64_t chunk = 4096;
  COMBS_ASSIGN_OR_RETURN(Tensor kv, b.alloc({chunk, nkv, hd}, DType::kF32));
  COMBS_RETURN_IF_ERROR(b.zero(kv));
  for (auto* set : {&paged, &flat}) {
    for (auto& cache : *set) {
      for (int64_t p = 0; p < ctx; p += chunk) {
        const int64_t n = std::min(chunk, ctx - p);
        const Tensor part = kv.rows(0, n);
        COMBS_RETURN_IF_ERROR(cache->append(0, part, part, p));
      }
    }
  }
  COMBS_ASSIGN_OR_RETURN(Tensor q, b.alloc({n_seqs, nq, hd}, DType::kF32));
  COMBS_ASSIGN_OR_RETURN(Tensor out, b.alloc({n_seqs, nq, hd}, DType::kF32));
  COMBS_ASSIGN_OR_RETURN(Tensor k1, b.alloc({n_seqs, nkv, hd}, DType::kF32));
  COMBS_RETURN_IF_ERROR(b.zero(q));
  COMBS_RETURN_IF_ERROR(b.zero(k1));
  auto time = [&](std::vector<std::unique_ptr<KVCache>>& set) -> StatusOr<double> {
    std::vector<SeqAttention> batch;
    for (auto& c : set) batch.push_back({c.get(), ctx, 1});
    AttentionStep step;
    COMBS_RETURN_IF_ERROR(step.begin(batch, nq));
    std::vector<double> v;
    constexpr int kRuns = 20;
    for (int r = 0; r < 6; ++r) {  // the first round warms up
      COMBS_RETURN_IF_ERROR(b.synchronize());
      const double t0 = now_seconds();
      for (int i = 0; i < kRuns; ++i) COMBS_RETURN_IF_ERROR(step.run(0, q, k1, k1, 1.0f / std::sqrt(float(hd)), out));
      COMBS_RETURN_IF_ERROR(b.synchronize());
      if (r > 0) v.push_back((now_seconds() - t0) / kRuns);
    }
    step.cancel();
    const double bytes = 2.0 * (ctx + 1) * nkv * hd * 2 * n_seqs;  // K and V, bf16
    return bytes / median(v) / 1e9;
  };
  COMBS_ASSIGN_OR_RETURN(double paged_gbs, time(paged));
  COMBS_ASSIGN_OR_RETURN(double flat_gbs, time(flat));
  return std::make_pair(paged_gbs, flat_gbs);
}

// An all-reduce of `floats` f32 values over GPUs 0..world-1 (NCCL, one thread a rank, as the
// runner calls it): microseconds per call, median of 5 rounds of 200 back-to-back calls.
StatusOr<double> allreduce_us(int world, int64_t floats) {
  std::vector<int> ids(static_cast<size_t>(world));
  std::iota(ids.begin(), ids.end(), 0);
  COMBS_ASSIGN_OR_RETURN(auto ranks, make_nccl_group(ids));
  std::vector<double> per_round;
  std::vector<Status> results(static_cast<size_t>(world), ok_status());
  std::vector<std::vector<double>> times(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Collective& c = *ranks[static_cast<size_t>(r)];
      cudaSetDevice(c.device());
      cudaStream_t st = nullptr;
      float* buf = nullptr;
      if (cudaStreamCreate(&st) != cudaSuccess || cudaMalloc(&buf, static_cast<size_t>(floats) * 4) != cudaSuccess) {
        results[static_cast<size_t>(r)] = internal_error("allreduce bench: no stream or memory");
        return;
      }
      cudaMemset(buf, 0, static_cast<size_t>(floats) * 4);
      constexpr int kCalls = 200;
      for (int round = 0; round < 6 && results[static_cast<size_t>(r)].ok(); ++round) {  // the first warms up
        const double t0 = now_seconds();
        for (int i = 0; i < kCalls; ++i) {
          if (Status s = c.all_reduce_sum(buf, floats, st); !s.ok()) {
            results[static_cast<size_t>(r)] = s;
            break;
          }
        }
        if (Status s = c.wait(st, std::chrono::milliseconds(30000)); !s.ok()) results[static_cast<size_t>(r)] = s;
        if (round > 0) times[static_cast<size_t>(r)].push_back((now_seconds() - t0) * 1e6 / kCalls);
      }
      cudaFree(buf);
      cudaStreamDestroy(st);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) COMBS_RETURN_IF_ERROR(s);
  return median(times[0]);
}

}  // namespace

int run_gpu(int argc, char** argv) {
  tools::Flags flags("combs-bench gpu", {{"shapes", "llama-1b"}, {"dir", "/tmp/combs-bench-models"}, {"reps", "3"},
                                         {"sessions", "64"}, {"attention-contexts", "2048,8192,32768"}, {"attention-shapes", "32/8/128"}, {"decode-prompt", "128"},
                                         {"only", ""}, {"vocab", tools::default_vocab()}, {"models", ""}, {"dtypes", "bf16"},
                                         {"tensor-parallel", "1"}});
  flags.describe({{"vocab", kVocabHelp},
                  {"dtypes", "weight types of the random models of --shapes (bf16, f16, q8_0, or a llama.cpp file type such as q4_k_m, quantized by combs; llama-quantize's files: --models)"},
                  {"models", "GGUF files to measure instead of --shapes (e.g. llama-quantize's); a row is labelled by the file's name"},
                  {"tensor-parallel", "GPUs (0..N-1) each model is split over (NCCL), for every run; 1: one GPU, no NCCL"},
                  {"attention-shapes", "decode-attention geometries for --only attention: q heads/KV heads/head_dim, comma-separated (llama-8b 32/8/128, gemma3-4b 8/4/256)"},
                  {"decode-prompt", "tokens before the one-session decode's 256 (e.g. 16384: a long context's decode, where sliding windows pay)"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[--shapes llama-1b,llama-8b | --models FILE,...] [--dir DIR] [--reps N] [--sessions N] [--only decode|sampled|prefill|sessions|attention|models] [--vocab PATH|none]");
    return 0;
  }
  long long reps, sessions, tp, decode_prompt;
  std::vector<long long> contexts;
  if (!flags.integer("reps", &reps, 1, 100) || !flags.integer("sessions", &sessions, 1, 4096) ||
      !flags.integer("tensor-parallel", &tp, 1, 64) || !flags.integer("decode-prompt", &decode_prompt, 1, 1 << 20) ||
      !flags.ints("attention-contexts", &contexts)) {
    return 2;
  }
  std::vector<AttentionShape> attention_shapes;
  for (const std::string& spec : split_list(flags.str("attention-shapes"))) {
    AttentionShape a{};
    char tail = 0;
    if (std::sscanf(spec.c_str(), "%d/%d/%d%c", &a.nq, &a.nkv, &a.hd, &tail) != 3 || a.nkv < 1 || a.nq < a.nkv ||
        a.nq % a.nkv != 0 || a.hd < 1 || a.hd > 1024) {
      return std::fprintf(stderr, "combs-bench gpu: --attention-shapes: '%s' is not Q/KV/HEAD_DIM (Q a multiple of KV)\n", spec.c_str()), 2;
    }
    attention_shapes.push_back(a);
  }
  const std::string only = flags.str("only");
  if (!only.empty() && only != "decode" && only != "sampled" && only != "prefill" && only != "sessions" &&
      only != "attention" && only != "models") {
    return std::fprintf(stderr, "combs-bench gpu: --only decode|sampled|prefill|sessions|attention|models\n"), 2;
  }
  // The workloads, one definition for the table and for --only: one session's decode (256 new
  // tokens after a 128-token prompt, or --decode-prompt's), a 2,048-token prefill, `sessions`
  // sessions' decode (128 new after 1,024-token prompts).
  auto decode_run = [&](ModelRunner& r, const SamplingParams* sampling = nullptr) {
    return run_sessions(r, 1, int(decode_prompt), 256, int(reps), sampling);
  };
  auto prefill_run = [&](ModelRunner& r) { return run_sessions(r, 1, 2048, 1, int(reps)); };
  SamplingParams table_sampling;  // the table's "same sampling" column and --only sampled
  table_sampling.temperature = 0.8f, table_sampling.top_p = 0.95f;
  auto sessions_run = [&](ModelRunner& r) { return run_sessions(r, int(sessions), 1024, 128, int(reps)); };
  // A model's runner: on GPU 0, or split over GPUs 0..tp-1.
  auto make_runner = [&](const Model& m, CudaRunnerOptions o) -> StatusOr<std::unique_ptr<ModelRunner>> {
    if (tp == 1) {
      COMBS_ASSIGN_OR_RETURN(auto r, CudaRunner::create(m, o));
      return std::unique_ptr<ModelRunner>(std::move(r));
    }
    std::vector<int> ids(static_cast<size_t>(tp));
    std::iota(ids.begin(), ids.end(), 0);
    COMBS_ASSIGN_OR_RETURN(auto ranks, make_nccl_group(ids));
    COMBS_ASSIGN_OR_RETURN(auto r, TensorParallelRunner::create(m, std::move(ranks), o));
    return std::unique_ptr<ModelRunner>(std::move(r));
  };
  auto vocab = bench_vocab(flags.str("vocab"));
  if (!vocab.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", vocab.status().message().c_str()), 2;
  // (label, file) of a random model of each --shapes x --dtypes, written into --dir once.
  using Measured = std::vector<std::pair<std::string, std::string>>;
  auto random_models = [&](Measured* out) -> Status {
    for (const std::string& shape : split_list(flags.str("shapes"))) {
      for (const std::string& dtype : split_list(flags.str("dtypes"))) {
        COMBS_ASSIGN_OR_RETURN(std::string path, bench_model(flags.str("dir"), shape, dtype, *vocab));
        out->emplace_back(dtype == "bf16" ? shape : shape + "-" + dtype, std::move(path));
      }
    }
    return ok_status();
  };
  if (only == "models") {  // write the models (no GPU needed) and print their paths, e.g. for the peer
    Measured written;
    const Status st = random_models(&written);
    for (const auto& [label, file] : written) std::printf("%s %s\n", label.c_str(), file.c_str());
    if (!st.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", st.message().c_str()), 2;
    return 0;
  }
  auto backend = CudaBackend::create();
  if (!backend.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", backend.status().to_string().c_str()), 1;
  register_cuda_attention();
  const double bw = copy_bandwidth(**backend) * static_cast<double>(tp);
  std::printf("# combs-bench gpu on %s: device copy bandwidth %.0f GB/s (read + write%s), median of %lld; vocabulary %s\n\n",
              (*backend)->description().c_str(), bw / 1e9, tp > 1 ? (", x" + std::to_string(tp) + " GPUs").c_str() : "",
              reps, vocab->empty() ? "built-in (259 tokens)" : vocab->c_str());
  if (tp > 1) {
    std::printf("| all-reduce over %lld GPUs (NCCL) | floats | us per call |\n|---|---|---|\n", tp);
    for (int64_t floats : {int64_t{4096}, int64_t{8192}, int64_t{64} * 4096, int64_t{2048} * 4096}) {
      auto us = allreduce_us(static_cast<int>(tp), floats);
      if (!us.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", us.status().to_string().c_str()), 1;
      std::printf("| | %lld | %.1f |\n", static_cast<long long>(floats), *us);
    }
    std::printf("\n");
  }
  if (only.empty()) {
    std::printf("| model | weights | bound tok/s | 1 session: decode tok/s (256 after a %lld prompt) | / bound | same without "
                "CUDA graphs | same sampling (T 0.8, top-p 0.95) | prefill tok/s (2048 prompt) | %lld sessions: aggregate decode tok/s (1024 prompts, 128 new) |"
                "\n|---|---|---|---|---|---|---|---|---|\n",
                decode_prompt, sessions);
  }
  // (label, file): --models as they are, else the random models.
  Measured measured;
  for (const std::string& file : split_list(flags.str("models"))) {
    std::string label = file.substr(file.find_last_of('/') + 1);
    if (label.size() > 5 && label.ends_with(".gguf")) label.resize(label.size() - 5);
    measured.emplace_back(label, file);
  }
  if (measured.empty() && only != "attention") {
    if (const Status st = random_models(&measured); !st.ok()) {
      return std::fprintf(stderr, "combs-bench gpu: %s\n", st.message().c_str()), 2;
    }
  }
  for (const auto& [shape, file] : measured) {
    auto model = Model::load(file);
    if (!model.ok()) return std::fprintf(stderr, "%s\n", model.status().to_string().c_str()), 1;
    // --only decode / sessions also times the device's part of a step (two events per forward).
    auto runner = make_runner(**model, {.time_device = !only.empty() && only != "prefill"});
    if (!runner.ok()) return std::fprintf(stderr, "%s\n", runner.status().to_string().c_str()), 1;
    const double bytes = static_cast<double>((*model)->weight_bytes_per_token());
    {  // Resident weights against the file's tensor bytes: blocks stay blocks, on the host and the device.
      const double file_bytes = static_cast<double>((*model)->file_tensor_bytes());
      const double host = static_cast<double>((*model)->resident_weight_bytes());
      std::printf("# %s weights: the file's tensors %.1f MB; resident on the host %.1f MB (%.3fx)", shape.c_str(),
                  file_bytes / 1e6, host / 1e6, host / file_bytes);
      if (auto* one = dynamic_cast<CudaRunner*>(runner->get())) {
        const double device = static_cast<double>(one->stats().weight_bytes);
        std::printf(", on the device %.1f MB (%.3fx)", device / 1e6, device / file_bytes);
      }
      std::printf("\n");
    }
    if (!only.empty()) {  // one part alone (for a profiler): no table
      const bool pre = only == "prefill";
      auto r = pre                 ? prefill_run(**runner)
               : only == "decode"  ? decode_run(**runner)
               : only == "sampled" ? decode_run(**runner, &table_sampling)
                                   : sessions_run(**runner);
      if (!r.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", r.status().to_string().c_str()), 1;
      std::printf("%s %s: %.0f tok/s", shape.c_str(), only.c_str(), pre ? r->prompt_tps : r->decode_tps);
      if (!pre) {
        std::printf(" (per step: %.1f us, the device's work %.1f from its first launch to its last, host work %.1f before "
                    "it waits)",
                    r->step_us, r->device_us, r->host_us);
      }
      std::printf("\n");
      continue;
    }
    auto one = decode_run(**runner);
    StatusOr<Run> eager = Run{};
    {
      auto no_graphs = make_runner(**model, {.cuda_graphs = false});
      if (!no_graphs.ok()) return std::fprintf(stderr, "%s\n", no_graphs.status().to_string().c_str()), 1;
      eager = decode_run(**no_graphs);
    }
    auto sampled = decode_run(**runner, &table_sampling);
    auto prefill = prefill_run(**runner);
    auto many = sessions_run(**runner);
    for (const StatusOr<Run>* r : {&one, &eager, &sampled, &prefill, &many}) {
      if (!r->ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", r->status().to_string().c_str()), 1;
    }
    const double bound = bw / bytes;
    std::printf("| %s | %.2f GB | %.0f | %.0f | %.2f | %.0f | %.0f | %.0f | %.0f |\n", shape.c_str(), bytes / 1e9, bound,
                one->decode_tps, one->decode_tps / bound, eager->decode_tps, sampled->decode_tps, prefill->prompt_tps,
                many->decode_tps);
    std::fflush(stdout);
  }
  if ((!only.empty() && only != "attention") || contexts.empty()) return 0;
  for (const AttentionShape& a : attention_shapes) {
    std::printf("\n| decode attention (%d q / %d kv heads, hd %d, bf16) | sequences | paged GB/s | contiguous GB/s | "
                "paged / contiguous time | paged / copy bandwidth |\n|---|---|---|---|---|---|\n", a.nq, a.nkv, a.hd);
    for (long long ctx : contexts) {
      for (int n : {1, 16}) {
        auto r = attention_gbs(**backend, a, ctx, n);
        if (!r.ok()) return std::fprintf(stderr, "combs-bench gpu: %s\n", r.status().to_string().c_str()), 1;
        std::printf("| context %lld | %d | %.0f | %.0f | %.2f | %.2f |\n", ctx, n, r->first, r->second,
                    r->second / r->first, r->first * 1e9 / bw);
      }
    }
  }
  return 0;
}

}  // namespace combs::bench
