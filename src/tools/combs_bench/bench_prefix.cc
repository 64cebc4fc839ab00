// combs-bench prefix: the prefix cache's effect through the engine. N sessions start at once, each
// with the same S-token system prompt and a Q-token question of its own, and generate G tokens
// (greedy): time to first token (p50/p99, from the submission) and output tokens/s, with the
// prefix cache off, on and cold (nothing cached when they arrive), and on and warm (one earlier
// request left the system prompt cached); and, with nothing shared (every prompt its own), the
// cache on against off (its cost). Each scenario runs on a fresh engine, --rounds times; medians.
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/engine/engine.h"
#ifdef COMBS_HAVE_CUDA
#include "combs/model/cuda_runner.h"
#endif
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {

namespace {

struct Figures {
  double ttft_p50_ms = 0, ttft_p99_ms = 0, tokens_per_s = 0, cached_share = 0;
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

struct Scenario {
  const char* name;
  bool cache;
  bool shared;
  bool warm;
};

}  // namespace

int run_prefix(int argc, char** argv) {
  tools::Flags flags("combs-bench prefix",
                     {{"shape", "tiny"}, {"dtype", "bf16"}, {"model", ""}, {"vocab", tools::default_vocab()},
                      {"device", "cpu"}, {"sessions", "64"}, {"shared", "2048"}, {"question", "64"}, {"gen", "128"},
                      {"rounds", "3"}, {"threads", "0"}, {"kv-memory-mib", "0"}, {"dir", "/tmp/combs-bench-models"}});
  flags.describe({{"vocab", kVocabHelp},
                  {"device", "cpu or cuda (the engine's runner)"},
                  {"kv-memory-mib", "the page pool; 0: 4096 MiB on the CPU, 85% of the free memory on a GPU"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (--model PATH, or a random model of --shape/--dtype written once into --dir)");
    return 0;
  }
  long long n, shared, question, gen, rounds, threads, kv_mib;
  if (!flags.integer("sessions", &n, 1, 4096) || !flags.integer("shared", &shared, 1, 1 << 20) ||
      !flags.integer("question", &question, 1, 1 << 20) || !flags.integer("gen", &gen, 1, 1 << 16) ||
      !flags.integer("rounds", &rounds, 1, 100) || !flags.integer("threads", &threads, 0, 1024) ||
      !flags.integer("kv-memory-mib", &kv_mib, 0, 1 << 24)) {
    return 2;
  }
  const std::string device = flags.str("device");
  if (const Status st = check_bench_device(device); !st.ok()) return std::fprintf(stderr, "combs-bench prefix: %s\n", st.message().c_str()), 2;
  auto model_path = bench_model_flag(flags);
  if (!model_path.ok()) return std::fprintf(stderr, "combs-bench prefix: %s\n", model_path.status().message().c_str()), 2;
  const std::string path = *model_path;
  std::printf("# combs-bench prefix: %s on %s, %lld sessions at once, each %lld shared + %lld own prompt tokens, "
              "%lld generated (greedy); medians of %lld rounds\n\n",
              path.c_str(), device.c_str(), n, shared, question, gen, rounds);
  std::printf("| scenario | TTFT p50 ms | TTFT p99 ms | output tok/s | prompt positions reused |\n|---|---|---|---|---|\n");

  const Scenario scenarios[] = {
      {"shared prompt, cache off", false, true, false},
      {"shared prompt, cache on (cold)", true, true, false},
      {"shared prompt, cache on (warm)", true, true, true},
      {"nothing shared, cache off", false, false, false},
      {"nothing shared, cache on", true, false, false},
  };
  std::vector<Figures> medians;
  for (const Scenario& sc : scenarios) {
    std::vector<double> p50, p99, tps, reused;
    for (long long round = 0; round < rounds; ++round) {
      auto model = Model::load(path);
      if (!model.ok()) return std::fprintf(stderr, "combs-bench: %s\n", model.status().to_string().c_str()), 1;
      const int vocab = (*model)->config().n_vocab;
      EngineOptions eo;
      eo.threads = static_cast<int>(threads);
      eo.max_sessions = static_cast<int>(n) + 2;
      eo.prefix_cache = sc.cache;
      eo.max_tokens_per_request = static_cast<int>(gen);
      if (kv_mib > 0) eo.kv_memory_bytes = kv_mib << 20;
      else if (device == "cpu") eo.kv_memory_bytes = int64_t{4096} << 20;
      else eo.kv_memory_fraction = 0.85;
#ifdef COMBS_HAVE_CUDA
      if (device == "cuda") eo.make_runner = make_cuda_runner(0);
#endif
      auto engine = Engine::create(std::move(model).value(), eo);
      if (!engine.ok()) return std::fprintf(stderr, "combs-bench: %s\n", engine.status().to_string().c_str()), 1;
      Engine& e = **engine;
      std::mt19937 rng(static_cast<uint32_t>(round * 7919 + 1));
      auto tokens = [&](long long count) {
        std::vector<int32_t> t(count);
        for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
        return t;
      };
      const std::vector<int32_t> system = tokens(shared);
      std::mutex mu;
      std::condition_variable cv;
      int done = 0;
      int64_t cached = 0, prompt_positions = 0;
      std::vector<double> first(n, 0.0);
      Status failed;
      auto submit = [&](long long i, std::vector<int32_t> prompt, int max_tokens, double* first_at) -> Status {
        GenerateRequest r = greedy_request(std::move(prompt), max_tokens);
        COMBS_ASSIGN_OR_RETURN(SessionId id, e.create_session());
        return e.generate(id, std::move(r), [&, i, first_at](const GenerateEvent& ev) {
                  std::lock_guard<std::mutex> lock(mu);
                  if (ev.type == GenerateEvent::Type::kToken) {
                    if (first_at && *first_at == 0.0) *first_at = now_seconds();
                    return;
                  }
                  if (!ev.status.ok()) failed = ev.status;
                  if (i >= 0) {
                    cached += ev.usage.cached_tokens;
                    prompt_positions += ev.usage.input_tokens;
                  }
                  ++done;
                  cv.notify_all();
                })
            .status();
      };
      auto wait_for = [&](int count) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return done >= count; });
      };
      int expected = 0;
      if (sc.warm) {  // an earlier request with the same system prompt
        std::vector<int32_t> p = system;
        const std::vector<int32_t> q = tokens(question);
        p.insert(p.end(), q.begin(), q.end());
        if (Status s = submit(-1, std::move(p), 1, nullptr); !s.ok()) return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
        wait_for(++expected);
      }
      std::vector<std::vector<int32_t>> prompts;
      for (long long i = 0; i < n; ++i) {
        std::vector<int32_t> p = sc.shared ? system : tokens(shared);
        const std::vector<int32_t> q = tokens(question);
        p.insert(p.end(), q.begin(), q.end());
        prompts.push_back(std::move(p));
      }
      const double t0 = now_seconds();
      for (long long i = 0; i < n; ++i) {
        if (Status s = submit(i, std::move(prompts[i]), static_cast<int>(gen), &first[i]); !s.ok()) {
          return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
        }
      }
      wait_for(expected + static_cast<int>(n));
      const double wall = now_seconds() - t0;
      if (!failed.ok()) return std::fprintf(stderr, "combs-bench prefix: %s\n", failed.to_string().c_str()), 1;
      std::vector<double> ttft;
      for (double f : first) ttft.push_back((f - t0) * 1e3);
      p50.push_back(quantile(ttft, 0.5));
      p99.push_back(quantile(ttft, 0.99));
      tps.push_back(static_cast<double>(n * gen) / wall);
      reused.push_back(prompt_positions > 0 ? static_cast<double>(cached) / static_cast<double>(prompt_positions) : 0.0);
    }
    Figures f{median(p50), median(p99), median(tps), median(reused)};
    medians.push_back(f);
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f%% |\n", sc.name, f.ttft_p50_ms, f.ttft_p99_ms, f.tokens_per_s,
                100.0 * f.cached_share);
    std::fflush(stdout);
  }
  std::printf("\nshared prompt, warm cache vs off: TTFT p50 %.1fx lower, throughput %.2fx; cold cache vs off: TTFT p50 "
              "%.1fx lower, throughput %.2fx; nothing shared, on vs off: throughput %.3fx\n",
              medians[0].ttft_p50_ms / medians[2].ttft_p50_ms, medians[2].tokens_per_s / medians[0].tokens_per_s,
              medians[0].ttft_p50_ms / medians[1].ttft_p50_ms, medians[1].tokens_per_s / medians[0].tokens_per_s,
              medians[4].tokens_per_s / medians[3].tokens_per_s);
  return 0;
}

}  // namespace combs::bench
