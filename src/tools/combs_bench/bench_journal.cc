// combs-bench journal: restart time with many sessions in the journal — N sessions of L tokens
// written into a fresh SQLite journal, then the time to read them back (SqliteJournal::open) and
// to start an engine holding them all (Engine::create with them to restore, the tiny model).
#include <cstdio>
#include <filesystem>
#include <future>
#include <random>
#include <string>

#include "bench.h"
#include "combs/engine/engine.h"
#include "combs/engine/sqlite_journal.h"
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {

int run_journal(int argc, char** argv) {
  tools::Flags flags("combs-bench journal",
                     {{"sessions", "10000"}, {"tokens", "1000"}, {"dir", "/tmp/combs-bench-journal"},
                      {"models", "/tmp/combs-bench-models"}, {"vocab", tools::default_vocab()}, {"rounds", "3"}});
  flags.describe({{"vocab", kVocabHelp}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) return flags.print_usage("[flags]"), 0;
  long long n, len, rounds;
  if (!flags.integer("sessions", &n, 1, 1 << 22) || !flags.integer("tokens", &len, 1, 1 << 20) ||
      !flags.integer("rounds", &rounds, 1, 100)) {
    return 2;
  }
  auto vocab = bench_vocab(flags.str("vocab"));
  if (!vocab.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", vocab.status().message().c_str()), 2;
  auto path = bench_model(flags.str("models"), "tiny", "bf16", *vocab);
  if (!path.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", path.status().message().c_str()), 2;
  auto model = Model::load(*path);
  if (!model.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", model.status().to_string().c_str()), 1;
  const std::string fingerprint = to_hex((*model)->file().fingerprint());
  const int vocab_size = (*model)->config().n_vocab;

  std::filesystem::remove_all(flags.str("dir"));
  SqliteJournalOptions jo;
  jo.dir = flags.str("dir");
  jo.model_fingerprint = fingerprint;
  const double t_write = now_seconds();
  {
    std::vector<SessionRecord> none;
    auto j = SqliteJournal::open(jo, &none);
    if (!j.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", j.status().message().c_str()), 1;
    std::mt19937 rng(1);
    char id[33];
    for (long long i = 0; i < n; ++i) {
      SessionRecord r;
      std::snprintf(id, sizeof id, "%016llx%016llx", 0x1234ull, static_cast<unsigned long long>(i));
      r.id = id;
      r.history.resize(len);
      for (auto& t : r.history) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab_size));
      (*j)->put(r);
    }
    auto done = std::make_shared<std::promise<void>>();
    (*j)->barrier([done] { done->set_value(); });
    done->get_future().wait();
  }
  const double write_s = now_seconds() - t_write;
  std::vector<double> open_s, engine_s;
  for (long long round = 0; round < rounds; ++round) {
    std::vector<SessionRecord> loaded;
    const double t0 = now_seconds();
    auto j = SqliteJournal::open(jo, &loaded);
    if (!j.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", j.status().message().c_str()), 1;
    const double t1 = now_seconds();
    auto m = Model::load(*path);
    if (!m.ok()) return 1;
    EngineOptions eo;
    eo.max_sessions = static_cast<int>(n) + 1;
    eo.journal = j->get();
    eo.restore = std::move(loaded);
    const double t2 = now_seconds();
    auto e = Engine::create(std::move(m).value(), eo);
    if (!e.ok()) return std::fprintf(stderr, "combs-bench journal: %s\n", e.status().to_string().c_str()), 1;
    const double t3 = now_seconds();
    if (static_cast<long long>((*e)->stats().sessions) != n) return std::fprintf(stderr, "sessions lost\n"), 1;
    open_s.push_back(t1 - t0);
    engine_s.push_back(t3 - t2);
  }
  const auto bytes = std::filesystem::file_size(std::filesystem::path(jo.dir) / "sessions.db");
  std::printf("# combs-bench journal: %lld sessions of %lld tokens (%.1f MB database, written in %.1f s); medians of %lld rounds\n\n",
              n, len, static_cast<double>(bytes) / 1e6, write_s, rounds);
  std::printf("| step | seconds |\n|---|---|\n| read the journal (open) | %.3f |\n| start the engine with them | %.3f |\n"
              "| restart, both | %.3f |\n",
              median(open_s), median(engine_s), median(open_s) + median(engine_s));
  return 0;
}

}  // namespace combs::bench
