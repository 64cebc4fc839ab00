// combs-bench resume: what bringing an evicted session back costs — through the host tier (its
// pages copied back from host memory) against recomputing them (a prefill of its history) — per
// history length. Two sessions of L tokens take turns on a page pool that holds one of them, so
// each request resumes the one the other pushed out; its time to first token (a one-token input,
// one generated) is the resume latency — by copy it includes moving the other session's pages
// out to the host (a swap: the pool holds one), by recompute dropping them. The same request on a
// session whose pages stayed is the floor. The engine's own start-up measurement (prefill vs copy per token, and so whether
// --host-kv-restore auto keeps the tier) is printed too. Medians of --rounds.
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/engine/engine.h"
#include "combs/kv/page_pool.h"
#ifdef COMBS_HAVE_CUDA
#include "combs/model/cuda_runner.h"
#endif
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {

namespace {

// Seconds from submitting `input` (max_tokens 1) to its token.
StatusOr<double> time_to_token(Engine& e, const SessionId& id, std::vector<int32_t> input, Usage* usage) {
  GenerateRequest r = greedy_request(std::move(input), 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  double first = 0.0;
  Status st;
  const double t0 = now_seconds();
  COMBS_RETURN_IF_ERROR(e.generate(id, std::move(r), [&](const GenerateEvent& ev) {
                           std::lock_guard<std::mutex> lock(mu);
                           if (ev.type == GenerateEvent::Type::kToken) {
                             if (first == 0.0) first = now_seconds();
                             return;
                           }
                           st = ev.status;
                           *usage = ev.usage;
                           done = true;
                           cv.notify_all();
                         })
                             .status());
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  COMBS_RETURN_IF_ERROR(st);
  return first - t0;
}

}  // namespace

int run_resume(int argc, char** argv) {
  tools::Flags flags("combs-bench resume",
                     {{"shape", "tiny"}, {"dtype", "bf16"}, {"model", ""}, {"vocab", tools::default_vocab()},
                      {"device", "cpu"}, {"lengths", "1000,4000"}, {"rounds", "5"}, {"threads", "0"},
                      {"dir", "/tmp/combs-bench-models"}});
  flags.describe({{"vocab", kVocabHelp},
                  {"device", "cpu or cuda (the engine's runner)"},
                  {"lengths", "history lengths (tokens) of the sessions that are evicted and resumed"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (--model PATH, or a random model of --shape/--dtype written once into --dir)");
    return 0;
  }
  long long rounds, threads;
  if (!flags.integer("rounds", &rounds, 1, 100) || !flags.integer("threads", &threads, 0, 1024)) return 2;
  std::vector<long long> lengths;
  for (const std::string& l : split_list(flags.str("lengths"))) {
    char* end = nullptr;
    const long long v = std::strtoll(l.c_str(), &end, 10);
    if (*end != '\0' || v < 16 || v > (1 << 20)) return std::fprintf(stderr, "combs-bench resume: --lengths: bad length '%s'\n", l.c_str()), 2;
    lengths.push_back(v);
  }
  const std::string device = flags.str("device");
  if (const Status st = check_bench_device(device); !st.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", st.message().c_str()), 2;
  auto model_path = bench_model_flag(flags);
  if (!model_path.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", model_path.status().message().c_str()), 2;
  const std::string path = *model_path;
  auto engine_for = [&](long long len, bool tier, EngineOptions::HostRestore restore) -> StatusOr<std::unique_ptr<Engine>> {
    COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(path));
    EngineOptions eo;
    eo.threads = static_cast<int>(threads);
    eo.prefix_cache = false;  // the positions come back from the host or are computed, nothing else
    const KVGeometry g = model->config().kv_geometry(eo.kv_dtype);
    // One session's pages as it grows over the rounds (two tokens a turn), and a few to spare:
    // the other session's turn pushes it out.
    const int64_t most = len + 8 + 4 * (rounds + 1);
    eo.kv_memory_bytes = (pages_for_tokens(most, eo.page_size) + 2) * page_bytes(g, eo.page_size);
    eo.max_context = most;
    if (tier) eo.host_kv_memory_bytes = 2 * (pages_for_tokens(most, eo.page_size) + 2) * page_bytes(g, eo.page_size);
    eo.host_kv_restore = restore;
#ifdef COMBS_HAVE_CUDA
    if (device == "cuda") eo.make_runner = make_cuda_runner(0);
#endif
    return Engine::create(std::move(model), eo);
  };
  std::printf("# combs-bench resume: %s on %s; two sessions of L tokens take turns on a pool that holds one; "
              "time to first token of a 1-token request (1 generated), medians of %lld rounds\n\n",
              path.c_str(), device.c_str(), rounds);
  {  // what the engine's own measurement decides (at the longest length's pool size)
    auto e = engine_for(lengths.back(), true, EngineOptions::HostRestore::kAuto);
    if (!e.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", e.status().to_string().c_str()), 1;
    const EngineStats st = (*e)->stats();
    std::printf("start-up measurement: prefill %.2f us/token, copy to the host and back %.2f us/token: the host tier is %s "
                "with --host-kv-restore auto\n\n",
                st.host_prefill_us_per_token, st.host_copy_us_per_token, st.host_tier_active ? "used" : "not used");
  }
  std::printf("| L tokens | resident ms | host tier: copy back ms | recompute ms | copy ms / 1k tokens over resident | "
              "recompute ms / 1k tokens over resident | recompute / copy |\n|---|---|---|---|---|---|---|\n");
  for (long long len : lengths) {
    std::vector<double> resident, copy, recompute;
    for (int mode = 0; mode < 2; ++mode) {  // 0: host tier, 1: none
      auto engine = engine_for(len, mode == 0, EngineOptions::HostRestore::kCopy);
      if (!engine.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", engine.status().to_string().c_str()), 1;
      Engine& e = **engine;
      const int vocab = e.model().config().n_vocab;
      std::mt19937 rng(static_cast<uint32_t>(len));
      auto tokens = [&](long long count) {
        std::vector<int32_t> t(count);
        for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
        return t;
      };
      SessionId s[2];
      Usage u;
      for (int i = 0; i < 2; ++i) {  // each filled in turn; the second pushes the first out
        auto id = e.create_session();
        if (!id.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", id.status().to_string().c_str()), 1;
        s[i] = *id;
        if (auto t = time_to_token(e, s[i], tokens(len - 1), &u); !t.ok()) {
          return std::fprintf(stderr, "combs-bench resume: %s\n", t.status().to_string().c_str()), 1;
        }
      }
      for (long long round = 0; round < rounds + 1; ++round) {  // round 0 warms the kernels up
        const SessionId& back = s[round % 2];  // pushed out by the other's last turn
        auto t = time_to_token(e, back, tokens(1), &u);
        if (!t.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", t.status().to_string().c_str()), 1;
        if (u.cached_tokens < (mode == 0 ? len - 16 : 0) || (mode == 1 && u.prefilled_tokens < len)) {
          return std::fprintf(stderr, "combs-bench resume: the session did not resume as it should (cached %lld, prefilled %lld)\n",
                              static_cast<long long>(u.cached_tokens), static_cast<long long>(u.prefilled_tokens)),
                 1;
        }
        auto floor = time_to_token(e, back, tokens(1), &u);  // again, its pages now resident
        if (!floor.ok()) return std::fprintf(stderr, "combs-bench resume: %s\n", floor.status().to_string().c_str()), 1;
        if (round == 0) continue;
        (mode == 0 ? copy : recompute).push_back(*t * 1e3);
        resident.push_back(*floor * 1e3);
      }
      if (mode == 0 && e.stats().host_restores < rounds) {
        return std::fprintf(stderr, "combs-bench resume: the host tier restored %lld times in %lld rounds\n",
                            static_cast<long long>(e.stats().host_restores), rounds),
               1;
      }
    }
    const double r = median(resident), c = median(copy), p = median(recompute);
    std::printf("| %lld | %.2f | %.2f | %.2f | %.3f | %.3f | %.1fx |\n", len, r, c, p,
                (c - r) * 1000.0 / static_cast<double>(len), (p - r) * 1000.0 / static_cast<double>(len), p / c);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace combs::bench
