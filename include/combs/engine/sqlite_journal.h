// SqliteJournal: the session journal in an SQLite database (WAL mode), DIR/sessions.db.
//
// Durability (what survives, by the time a finished request's last event is delivered):
//   kFull  every change is fsync'ed at its commit: it survives a process crash (kill -9) and a
//          machine crash;
//   kFast  commits are written to the WAL without fsync and the WAL is synced every flush_ms:
//          nothing is lost in a process crash; a machine crash may lose the last flush_ms.
// Changes are committed by a writer thread in batches (one transaction per batch), so the
// engine's steps never wait for the disk.
//
// The database names the model it was written for (a fingerprint of the GGUF): opening it for
// another model is FAILED_PRECONDITION unless `drop_foreign` (then its sessions are deleted).
// Schema version 2: an older file is migrated in place at open, a version at a time, each step
// one transaction (so a crash mid-way leaves the last whole version); a newer version, a file that
// is not a database, or rows that do not add up (a token run missing or overlapping) are refused
// with the reason — never a crash, never a session silently cut short.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "combs/base/status.h"
#include "combs/engine/journal.h"

struct sqlite3;

namespace combs {

struct SqliteJournalOptions {
  std::string dir;                            // created if missing
  std::string model_fingerprint;              // stored; compared at open
  enum class Durability : uint8_t { kFull, kFast } durability = Durability::kFull;
  int flush_ms = 200;                         // kFast: how often the WAL is synced
  bool drop_foreign = false;                  // sessions of another model: deleted instead of refused
};

class SqliteJournal final : public SessionJournal {
 public:
  // Opens (or creates) the database and reads every session in it (`loaded`).
  static StatusOr<std::unique_ptr<SqliteJournal>> open(const SqliteJournalOptions& options,
                                                        std::vector<SessionRecord>* loaded);
  ~SqliteJournal() override;  // commits what is queued, then closes

  void put(const SessionRecord& record) override;
  void append(const SessionId& id, int64_t at, std::span<const int32_t> tokens) override;
  void truncate(const SessionId& id, int64_t length) override;
  void set_conversation(const SessionId& id, const nlohmann::ordered_json& conversation) override;
  void erase(const SessionId& id) override;
  void barrier(std::function<void()> done) override;

  // The first error the writer met (a full disk, say); OK while none. Changes after it are kept
  // in memory and retried with the next batch.
  Status health() const;

  struct Op;  // a queued change (sqlite_journal.cc)

 private:
  SqliteJournal(sqlite3* db, SqliteJournalOptions options);
  void push(Op op);
  void writer();

  sqlite3* db_;
  SqliteJournalOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stopping_ = false;
  Status health_;
  std::thread thread_;
};

}  // namespace combs
