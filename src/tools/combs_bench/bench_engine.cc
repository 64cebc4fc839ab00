// combs-bench engine: aggregate decode tokens/s and per-session inter-token latency with 1, 8 and
// 64 sessions generating at once through the engine (continuous batching on the CPU backend), and
// the aggregate as a ratio to one session's.
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/engine/engine.h"
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {

int run_engine(int argc, char** argv) {
  tools::Flags flags("combs-bench engine",
                     {{"shape", "tiny"}, {"dtype", "bf16"}, {"model", ""}, {"vocab", tools::default_vocab()},
                      {"sessions", "1,8,64"}, {"prompt", "64"}, {"gen", "32"}, {"threads", "0"},
                      {"dir", "/tmp/combs-bench-models"}});
  flags.describe({{"vocab", kVocabHelp}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (--model PATH, or a random model of --shape/--dtype written once into --dir)");
    return 0;
  }
  std::vector<long long> counts;
  long long prompt, gen, threads;
  if (!flags.ints("sessions", &counts) || !flags.integer("prompt", &prompt, 1, 1 << 16) ||
      !flags.integer("gen", &gen, 1, 1 << 16) || !flags.integer("threads", &threads, 0, 1024)) {
    return 2;
  }
  auto model_path = bench_model_flag(flags);
  if (!model_path.ok()) return std::fprintf(stderr, "combs-bench engine: %s\n", model_path.status().message().c_str()), 2;
  const std::string path = *model_path;
  std::printf("# combs-bench engine: %s, prompt %lld tokens, %lld generated per session, greedy\n\n",
              path.c_str(), prompt, gen);
  std::printf("| sessions | aggregate tok/s | vs 1 session | inter-token p50 ms | p90 ms | steps |\n"
              "|---|---|---|---|---|---|\n");
  double single = 0.0;
  for (long long n : counts) {
    auto model = Model::load(path);
    if (!model.ok()) return std::fprintf(stderr, "combs-bench: %s\n", model.status().to_string().c_str()), 1;
    const int vocab = (*model)->config().n_vocab;
    EngineOptions eo;
    eo.threads = static_cast<int>(threads);
    eo.kv_memory_bytes = int64_t{2} << 30;
    eo.max_sessions = static_cast<int>(n) + 1;
    auto engine = Engine::create(std::move(model).value(), eo);
    if (!engine.ok()) return std::fprintf(stderr, "combs-bench: %s\n", engine.status().to_string().c_str()), 1;
    std::mutex mu;
    std::vector<std::vector<double>> stamps(n);
    int done = 0;
    std::condition_variable cv;
    const double t0 = now_seconds();
    for (long long i = 0; i < n; ++i) {
      std::vector<int32_t> input;
      for (long long k = 0; k < prompt; ++k) input.push_back(static_cast<int32_t>((i * 131 + k * 7 + 3) % vocab));
      GenerateRequest r = greedy_request(std::move(input), static_cast<int>(gen));
      auto id = (*engine)->create_session();
      auto h = (*engine)->generate(*id, std::move(r), [&, i](const GenerateEvent& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (e.type == GenerateEvent::Type::kToken) stamps[i].push_back(now_seconds());
        else if (++done == n) cv.notify_all();
      });
      if (!h.ok()) return std::fprintf(stderr, "combs-bench: %s\n", h.status().to_string().c_str()), 1;
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done == n; });
    }
    const double wall = now_seconds() - t0;
    std::vector<double> gaps;
    for (const auto& s : stamps)
      for (size_t k = 1; k < s.size(); ++k) gaps.push_back((s[k] - s[k - 1]) * 1e3);
    std::sort(gaps.begin(), gaps.end());
    const double tps = double(n * gen) / wall;
    if (single == 0.0) single = tps;
    std::printf("| %lld | %.1f | %.2fx | %.2f | %.2f | %lld |\n", n, tps, tps / single,
                gaps.empty() ? 0.0 : gaps[gaps.size() / 2], gaps.empty() ? 0.0 : gaps[gaps.size() * 9 / 10],
                static_cast<long long>((*engine)->stats().steps));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace combs::bench
