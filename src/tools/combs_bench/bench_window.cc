// combs-bench window: sessions of a model whose every layer attends through a sliding window, the
// engine releasing the KV pages behind the window (EngineOptions::release_behind_window) against
// keeping every page: in a pool sized for a few whole histories, many sessions' first turns (a long
// prompt) and second turns (one token): wall time, positions recomputed, evictions and preemptions,
// pages a session holds; then the cost of a rollback past the kept margin (a rebuild) against one
// within it.
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/engine/engine.h"
#include "combs/kv/page_pool.h"
#include "common/flags.h"

namespace combs::bench {
namespace {

struct Turns {
  double first_s = 0.0, second_s = 0.0;  // wall time of all sessions' first / second turns
  int64_t recomputed = 0;                // positions prefilled in the second turns (beyond their own)
  double pages_per_session = 0.0;        // held by an idle session after its second turn
  EngineStats stats;
  double rollback_ms = 0.0, rollback_far_ms = 0.0;  // a 1-token generate after a rollback within / past the margin
};

// Every session generates at once; returns when all have finished. usage: each request's.
Status generate_all(Engine& e, const std::vector<SessionId>& ids, const std::vector<GenerateRequest>& reqs,
                    std::vector<Usage>* usage) {
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  Status failed;
  usage->assign(ids.size(), Usage{});
  for (size_t i = 0; i < ids.size(); ++i) {
    auto h = e.generate(ids[i], reqs[i], [&, i](const GenerateEvent& ev) {
      if (ev.type != GenerateEvent::Type::kFinished) return;
      std::lock_guard<std::mutex> lock(mu);
      (*usage)[i] = ev.usage;
      if (ev.finish == FinishKind::kError) failed = ev.status;
      if (++done == ids.size()) cv.notify_all();
    });
    if (!h.ok()) return h.status();
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == ids.size(); });
  return failed;
}

StatusOr<Turns> play(const std::string& path, bool release, int64_t sessions, int64_t prompt, int64_t gen,
                     int64_t pool_pages, int64_t rollback, int threads) {
  COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(path));
  const ModelConfig& c = model->config();
  EngineOptions eo;
  eo.threads = threads;
  eo.release_behind_window = release;
  eo.window_rollback = rollback;
  eo.kv_memory_bytes = pool_pages * page_bytes(c.kv_geometry(eo.kv_dtype), eo.page_size);
  eo.max_sessions = static_cast<int>(sessions) + 1;
  const int32_t vocab = c.n_vocab;
  COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::create(std::move(model), eo));
  std::vector<SessionId> ids;
  std::vector<GenerateRequest> first, second;
  for (int64_t i = 0; i < sessions; ++i) {
    COMBS_ASSIGN_OR_RETURN(SessionId id, e->create_session());
    ids.push_back(id);
    std::vector<int32_t> p;
    for (int64_t k = 0; k < prompt; ++k) p.push_back(static_cast<int32_t>((i * 131 + k * 7 + 3) % vocab));
    first.push_back(greedy_request(std::move(p), static_cast<int>(gen)));
    second.push_back(greedy_request({static_cast<int32_t>((i + 5) % vocab)}, static_cast<int>(gen)));
  }
  Turns t;
  std::vector<Usage> usage;
  double t0 = now_seconds();
  COMBS_RETURN_IF_ERROR(generate_all(*e, ids, first, &usage));
  t.first_s = now_seconds() - t0;
  t0 = now_seconds();
  COMBS_RETURN_IF_ERROR(generate_all(*e, ids, second, &usage));
  t.second_s = now_seconds() - t0;
  for (const Usage& u : usage) t.recomputed += u.prefilled_tokens - 2;  // its last token and the input are new
  for (const SessionId& id : ids) t.pages_per_session += static_cast<double>(e->info(id)->pages_held);
  t.pages_per_session /= static_cast<double>(sessions);
  // Rollbacks on the last session (its pages are held): within the margin, then past it.
  const SessionId& last = ids.back();
  std::vector<Usage> one;
  for (int64_t n : {std::max<int64_t>(1, rollback / 2), rollback + 64}) {
    COMBS_RETURN_IF_ERROR(e->rollback(last, n).status());
    t0 = now_seconds();
    COMBS_RETURN_IF_ERROR(generate_all(*e, {last}, {greedy_request({}, 1)}, &one));
    (n <= rollback ? t.rollback_ms : t.rollback_far_ms) = (now_seconds() - t0) * 1e3;
  }
  t.stats = e->stats();
  return t;
}

}  // namespace

int run_window(int argc, char** argv) {
  tools::Flags flags("combs-bench window",
                     {{"shape", "gemma3-swa-tiny"}, {"dtype", "bf16"}, {"window", "256"}, {"sessions", "16"},
                      {"prompt", "1536"}, {"gen", "32"}, {"fit", "4"}, {"rollback", "128"}, {"rounds", "3"},
                      {"threads", "0"}, {"dir", "/tmp/combs-bench-models"}});
  flags.describe({{"shape", "a tiny or real shape (random_model.h), written with every layer windowed"},
                  {"window", "the sliding window of every layer"},
                  {"fit", "the page pool holds this many sessions' whole histories"},
                  {"rollback", "EngineOptions::window_rollback: positions kept behind the window"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]");
    return 0;
  }
  long long window, sessions, prompt, gen, fit, rollback, rounds, threads;
  if (!flags.integer("window", &window, 1, 1 << 20) || !flags.integer("sessions", &sessions, 1, 4096) ||
      !flags.integer("prompt", &prompt, 1, 1 << 20) || !flags.integer("gen", &gen, 1, 1 << 16) ||
      !flags.integer("fit", &fit, 1, 4096) || !flags.integer("rollback", &rollback, 0, 1 << 20) ||
      !flags.integer("rounds", &rounds, 1, 100) || !flags.integer("threads", &threads, 0, 1024)) {
    return 2;
  }
  RandomModelOptions o;
  auto shape = named_shape(flags.str("shape"));
  if (!shape.ok()) return std::fprintf(stderr, "combs-bench window: %s\n", shape.status().message().c_str()), 2;
  o.shape = *shape;
  o.shape.sliding_window = static_cast<int>(window);
  o.shape.swa_all = true;
  if (Status s = set_weight_type(flags.str("dtype"), &o); !s.ok()) {
    return std::fprintf(stderr, "combs-bench window: %s\n", s.message().c_str()), 2;
  }
  if (prompt + 2 * gen + 1 > o.shape.context_length) {
    return std::fprintf(stderr, "combs-bench window: prompt + 2 gen exceeds the shape's context of %lld\n",
                        static_cast<long long>(o.shape.context_length)),
           2;
  }
  auto written = bench_model_file(flags.str("dir"), o,
                                  flags.str("shape") + "-swa" + std::to_string(window) + "-" + flags.str("dtype") + "-v259");
  if (!written.ok()) return std::fprintf(stderr, "combs-bench window: %s\n", written.status().message().c_str()), 1;
  const std::string& path = *written;
  const int64_t page = EngineOptions{}.page_size;  // the engines' (play() keeps the default)
  const int64_t pool_pages = fit * pages_for_tokens(prompt + 2 * gen + 1, page);
  std::printf("# combs-bench window: %s, %lld sessions, prompt %lld, %lld generated per turn (two turns), "
              "a pool of %lld pages (%lld whole histories), %lld positions kept behind the window; medians of %lld rounds\n\n",
              path.c_str(), sessions, prompt, gen, static_cast<long long>(pool_pages), fit, rollback, rounds);
  std::printf("| pages behind the window | first turns s | second turns s | positions recomputed | evictions | "
              "preemptions | pages per idle session | rollback %lld ms | rollback %lld ms | rebuilds |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n",
              std::max(1LL, rollback / 2), rollback + 64);
  for (bool release : {false, true}) {
    std::vector<double> first, second, rb, rb_far;
    Turns last;
    for (long long r = 0; r < rounds; ++r) {
      auto t = play(path, release, sessions, prompt, gen, pool_pages, rollback, static_cast<int>(threads));
      if (!t.ok()) return std::fprintf(stderr, "combs-bench window: %s\n", t.status().to_string().c_str()), 1;
      first.push_back(t->first_s);
      second.push_back(t->second_s);
      rb.push_back(t->rollback_ms);
      rb_far.push_back(t->rollback_far_ms);
      last = *t;
    }
    std::printf("| %s | %.2f | %.2f | %lld | %lld | %lld | %.1f | %.1f | %.1f | %lld |\n", release ? "released" : "kept",
                median(first), median(second), static_cast<long long>(last.recomputed),
                static_cast<long long>(last.stats.evictions), static_cast<long long>(last.stats.preemptions),
                last.pages_per_session, median(rb), median(rb_far), static_cast<long long>(last.stats.window_rebuilds));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace combs::bench
