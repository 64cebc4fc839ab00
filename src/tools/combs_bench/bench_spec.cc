// combs-bench spec: one session's decode with speculative decoding against without it. A
// bench-only proposer replays the known greedy continuation with each drafted token wrong with a
// set probability, so that the acceptance sweeps from 0 to 1; then the n-gram proposer on the
// model's own continuation (random-weight models fall into loops: their acceptance is reported);
// then, with --draft-dtype or --draft-model, a draft model (the target's own weights quantized, or
// a file), whose caches and forwards are the engine's.
// Decode tokens/s is from the first generated token to the last (the prefill excluded); the
// tokens are checked against the greedy continuation without speculation. Medians of --rounds.
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/engine/engine.h"
#include "combs/engine/speculation.h"
#ifdef COMBS_HAVE_CUDA
#include "combs/model/cuda_runner.h"
#endif
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {

namespace {

// Replays `truth` from the history's length on, each drafted token wrong with probability
// `error` (decided by the position and the round, so reruns differ); or, with error < 0, the
// n-gram prompt lookup.
class BenchProposer final : public Proposer {
 public:
  using Proposer::propose;
  void set(std::vector<int32_t> truth, double error, uint64_t round, int vocab) {
    truth_ = std::move(truth), error_ = error, round_ = round, vocab_ = vocab;
  }
  void propose(std::span<const int32_t> history, int max, std::vector<int32_t>* out) override {
    if (error_ < 0) return ngram_.propose(history, max, out);
    out->clear();
    for (size_t p = history.size(); p < truth_.size() && static_cast<int>(out->size()) < max; ++p) {
      std::mt19937_64 rng(p * 0x9e3779b97f4a7c15ull + round_);
      const bool wrong = std::uniform_real_distribution<double>(0.0, 1.0)(rng) < error_;
      out->push_back(wrong ? static_cast<int32_t>((truth_[p] + 1 + rng() % (vocab_ - 1)) % vocab_) : truth_[p]);
    }
  }

 private:
  NgramProposer ngram_;
  std::vector<int32_t> truth_;
  double error_ = 0.0;
  uint64_t round_ = 0;
  int vocab_ = 2;
};

struct Run {
  std::vector<int32_t> tokens;
  double decode_tok_s = 0.0;
  Usage usage;
};

StatusOr<Run> decode(Engine& e, const std::vector<int32_t>& prompt, int n, const std::optional<SpeculationParams>& spec) {
  GenerateRequest r = greedy_request(prompt, n);
  r.speculation = spec;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  double first = 0.0, last = 0.0;
  Run run;
  Status st;
  COMBS_ASSIGN_OR_RETURN(SessionId id, e.create_session());
  COMBS_RETURN_IF_ERROR(e.generate(id, std::move(r), [&](const GenerateEvent& ev) {
                           std::lock_guard<std::mutex> lock(mu);
                           if (ev.type == GenerateEvent::Type::kToken) {
                             last = now_seconds();
                             if (first == 0.0) first = last;
                             run.tokens.push_back(ev.token);
                             return;
                           }
                           st = ev.status;
                           run.usage = ev.usage;
                           done = true;
                           cv.notify_all();
                         })
                            .status());
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  COMBS_RETURN_IF_ERROR(st);
  COMBS_RETURN_IF_ERROR(e.close(id));
  run.decode_tok_s = static_cast<double>(run.tokens.size() - 1) / (last - first);
  return run;
}

}  // namespace

int run_spec(int argc, char** argv) {
  tools::Flags flags("combs-bench spec",
                     {{"shape", "tiny"}, {"dtype", "bf16"}, {"model", ""}, {"vocab", tools::default_vocab()},
                      {"device", "cpu"}, {"prompt", "64"}, {"tokens", "256"}, {"max-draft", "4"},
                      {"errors", "1,0.7,0.5,0.3,0.1,0"}, {"draft-dtype", ""}, {"draft-model", ""}, {"rounds", "3"}, {"threads", "0"}, {"dir", "/tmp/combs-bench-models"}});
  flags.describe({{"vocab", kVocabHelp},
                  {"device", "cpu or cuda (the engine's runner)"},
                  {"errors", "rates of wrong drafted tokens of the replaying proposer (acceptance about 1 - rate, less at the runs' ends)"},
                  {"draft-dtype", "also a draft model: the random target's weights in this type (q4_0, q8_0, ...; not with --model)"},
                  {"draft-model", "also a draft model: this GGUF (the target's vocabulary)"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (--model PATH, or a random model of --shape/--dtype written once into --dir)");
    return 0;
  }
  long long prompt_len, n, max_draft, rounds, threads;
  if (!flags.integer("prompt", &prompt_len, 1, 1 << 20) || !flags.integer("tokens", &n, 2, 1 << 16) ||
      !flags.integer("max-draft", &max_draft, 1, 16) || !flags.integer("rounds", &rounds, 1, 100) ||
      !flags.integer("threads", &threads, 0, 1024)) {
    return 2;
  }
  std::vector<double> errors;
  for (const std::string& x : split_list(flags.str("errors"))) {
    char* end = nullptr;
    const double v = std::strtod(x.c_str(), &end);
    if (*end != '\0' || !(v >= 0.0 && v <= 1.0)) return std::fprintf(stderr, "combs-bench spec: --errors: bad rate '%s'\n", x.c_str()), 2;
    errors.push_back(v);
  }
  const std::string device = flags.str("device");
  if (const Status st = check_bench_device(device); !st.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", st.message().c_str()), 2;
  auto model_path = bench_model_flag(flags);
  if (!model_path.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", model_path.status().message().c_str()), 2;
  const std::string path = *model_path;
  std::string draft_path = flags.str("draft-model");
  if (!flags.str("draft-dtype").empty()) {
    if (!flags.str("model").empty()) return std::fprintf(stderr, "combs-bench spec: --draft-dtype makes a draft of a random model, not of --model\n"), 2;
    auto vocab = bench_vocab(flags.str("vocab"));
    if (!vocab.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", vocab.status().message().c_str()), 2;
    auto made = bench_model(flags.str("dir"), flags.str("shape"), flags.str("draft-dtype"), *vocab);
    if (!made.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", made.status().message().c_str()), 2;
    draft_path = *made;
  }
  auto model = Model::load(path);
  if (!model.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", model.status().to_string().c_str()), 1;
  const int vocab = (*model)->config().n_vocab;
  auto proposer = std::make_shared<BenchProposer>();
  EngineOptions eo;
  eo.threads = static_cast<int>(threads);
  eo.proposer = proposer;
  eo.prefix_cache = false;
  eo.max_tokens_per_request = static_cast<int>(n);
  if (device == "cpu") eo.kv_memory_bytes = int64_t{2048} << 20;
  else eo.kv_memory_fraction = 0.5;
#ifdef COMBS_HAVE_CUDA
  if (device == "cuda") eo.make_runner = make_cuda_runner(0);
#endif
  if (!draft_path.empty()) {
    auto draft = Model::load(draft_path);
    if (!draft.ok()) return std::fprintf(stderr, "combs-bench spec: draft: %s\n", draft.status().to_string().c_str()), 1;
    eo.draft_model = std::shared_ptr<const Model>(std::move(draft).value());
  }
  auto engine = Engine::create(std::move(model).value(), eo);
  if (!engine.ok()) return std::fprintf(stderr, "combs-bench spec: %s\n", engine.status().to_string().c_str()), 1;
  Engine& e = **engine;
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(prompt_len);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  auto fail = [](const Status& s) { return std::fprintf(stderr, "combs-bench spec: %s\n", s.to_string().c_str()), 1; };

  std::printf("# combs-bench spec: %s on %s, one session, %lld-token prompt, %lld greedy tokens, up to %lld drafted a "
              "step; decode tok/s from the first token to the last, medians of %lld rounds\n\n",
              path.c_str(), device.c_str(), prompt_len, n, max_draft, rounds);
  // The baseline, and the continuation the replaying proposer drafts from.
  std::vector<double> base;
  std::vector<int32_t> truth;
  for (long long r = 0; r < rounds + 1; ++r) {  // round 0 warms up
    auto run = decode(e, prompt, static_cast<int>(n), std::nullopt);
    if (!run.ok()) return fail(run.status());
    if (r == 0) truth = run->tokens;
    else base.push_back(run->decode_tok_s);
  }
  const double b = median(base);
  std::vector<int32_t> known = prompt;
  known.insert(known.end(), truth.begin(), truth.end());
  std::printf("| drafts | acceptance | decode tok/s | vs no speculation | tokens as without |\n|---|---|---|---|---|\n");
  std::printf("| none | - | %.1f | 1.00x | - |\n", b);
  SpeculationParams spec;
  spec.max_draft = static_cast<int>(max_draft);
  auto sweep = [&](const std::string& name, double error, SpeculationParams::Method method = SpeculationParams::Method::kNgram) -> int {
    spec.method = method;
    std::vector<double> tps, acc;
    bool same = true;
    for (long long r = 0; r < rounds; ++r) {
      proposer->set(known, error, static_cast<uint64_t>(r), vocab);
      auto run = decode(e, prompt, static_cast<int>(n), spec);
      if (!run.ok()) return fail(run.status());
      same &= run->tokens == truth;
      tps.push_back(run->decode_tok_s);
      acc.push_back(run->usage.drafted_tokens ? static_cast<double>(run->usage.accepted_tokens) / static_cast<double>(run->usage.drafted_tokens) : 0.0);
    }
    std::printf("| %s | %.2f | %.1f | %.2fx | %s |\n", name.c_str(), median(acc), median(tps), median(tps) / b, same ? "yes" : "NO");
    std::fflush(stdout);
    return 0;
  };
  for (double error : errors) {
    char name[64];
    std::snprintf(name, sizeof name, "replay, %.0f%% wrong", 100.0 * error);
    if (int rc = sweep(name, error)) return rc;
  }
  if (int rc = sweep("n-gram (prompt lookup)", -1.0)) return rc;
  if (!draft_path.empty()) {
    const std::string name = "draft model " + std::filesystem::path(draft_path).filename().string();
    if (int rc = sweep(name, 0.0, SpeculationParams::Method::kDraft)) return rc;
  }
  return 0;
}

}  // namespace combs::bench
