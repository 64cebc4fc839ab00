#include "combs/engine/sqlite_journal.h"

#include <sqlite3.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>

namespace combs {

namespace {

// Version 2 added sessions.last_used (Unix milliseconds of the last change recorded), so that a
// restart keeps each session's time to live instead of giving every session a fresh one.
constexpr int kSchemaVersion = 2;

constexpr const char* kSchema = R"(
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(
  id TEXT PRIMARY KEY,
  parent TEXT NOT NULL,
  owner TEXT NOT NULL,
  cache_namespace TEXT NOT NULL,
  sampling TEXT NOT NULL,
  max_context INTEGER NOT NULL,
  conversation TEXT NOT NULL,
  length INTEGER NOT NULL,
  last_used INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tokens(
  session TEXT NOT NULL,
  pos INTEGER NOT NULL,
  ids BLOB NOT NULL,
  checksum INTEGER NOT NULL,
  PRIMARY KEY(session, pos)) WITHOUT ROWID;
)";

// Migrations: kMigrations[v - 1] takes a database from version v to v + 1 (one transaction with
// the version's bump). %NOW% is the migration's time in Unix milliseconds.
constexpr const char* kMigrations[] = {
    // 1 -> 2: sessions.last_used; what was there counts as used at the migration.
    "ALTER TABLE sessions ADD COLUMN last_used INTEGER NOT NULL DEFAULT 0;"
    "UPDATE sessions SET last_used = %NOW%;",
};
static_assert(std::size(kMigrations) == kSchemaVersion - 1);

int64_t unix_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Status db_error(sqlite3* db, const std::string& what) {
  return internal_error("session journal: " + what + ": " + (db ? sqlite3_errmsg(db) : "out of memory"));
}

// A prepared statement, finalized at scope end.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { ok_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr) == SQLITE_OK; }
  ~Stmt() { sqlite3_finalize(s_); }
  bool ok() const { return ok_; }
  sqlite3_stmt* get() const { return s_; }
  Stmt& text(int i, const std::string& v) {
    sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& integer(int i, int64_t v) {
    sqlite3_bind_int64(s_, i, v);
    return *this;
  }
  Stmt& blob(int i, const void* p, size_t n) {
    sqlite3_bind_blob(s_, i, p, static_cast<int>(n), SQLITE_TRANSIENT);
    return *this;
  }
  int step() { return sqlite3_step(s_); }
  // Runs a statement that returns no rows; then it can be bound and run again.
  bool run() {
    const int rc = sqlite3_step(s_);
    sqlite3_reset(s_);
    sqlite3_clear_bindings(s_);
    return rc == SQLITE_DONE;
  }
  std::string column_text(int i) const {
    const unsigned char* t = sqlite3_column_text(s_, i);
    return t ? std::string(reinterpret_cast<const char*>(t), static_cast<size_t>(sqlite3_column_bytes(s_, i))) : std::string();
  }

 private:
  sqlite3_stmt* s_ = nullptr;
  bool ok_ = false;
};

bool exec(sqlite3* db, const char* sql) { return sqlite3_exec(db, sql, nullptr, nullptr, nullptr) == SQLITE_OK; }

std::vector<uint8_t> token_bytes(std::span<const int32_t> tokens) {
  std::vector<uint8_t> out(tokens.size() * 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t v = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<uint8_t>(v >> (8 * b));
  }
  return out;
}

// FNV-1a over a token run's bytes: SQLite checks its pages' structure, not what a row holds, so a
// flipped byte inside a run would otherwise come back as another token.
int64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return static_cast<int64_t>(h);
}

}  // namespace

struct SqliteJournal::Op {
  enum class Kind : uint8_t { kPut, kAppend, kTruncate, kConversation, kErase, kBarrier } kind;
  SessionId id;
  int64_t when = unix_ms_now();   // the session's last_used
  SessionRecord record;           // kPut
  int64_t at = 0;                 // kAppend: position; kTruncate: length
  std::vector<int32_t> tokens;    // kAppend
  std::string conversation;       // kConversation
  std::function<void()> done;     // kBarrier
};

StatusOr<std::unique_ptr<SqliteJournal>> SqliteJournal::open(const SqliteJournalOptions& o,
                                                             std::vector<SessionRecord>* loaded) {
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) return invalid_argument_error("--state-dir " + o.dir + ": " + ec.message());
  const std::string path = (std::filesystem::path(o.dir) / "sessions.db").string();
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr) != SQLITE_OK) {
    Status s = db_error(db, "cannot open " + path);
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<SqliteJournal> j(new SqliteJournal(db, o));
  auto fail = [&](const std::string& what) {
    return failed_precondition_error("session journal " + path + ": " + what + ": " + sqlite3_errmsg(db) +
                                     " (move the file away to start without its sessions)");
  };
  sqlite3_busy_timeout(db, 5000);
  if (!exec(db, "PRAGMA journal_mode=WAL")) return fail("not a usable database");
  if (!exec(db, o.durability == SqliteJournalOptions::Durability::kFull ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL")) {
    return fail("cannot set synchronous");
  }
  {
    Stmt check(db, "PRAGMA quick_check");
    if (!check.ok() || check.step() != SQLITE_ROW || check.column_text(0) != "ok") {
      return failed_precondition_error("session journal " + path + " is damaged: " + (check.ok() ? check.column_text(0) : sqlite3_errmsg(db)) +
                                       " (move the file away to start without its sessions)");
    }
  }
  if (!exec(db, kSchema)) return fail("cannot create the schema");
  // Schema version and model.
  std::map<std::string, std::string> meta;
  {
    Stmt q(db, "SELECT key, value FROM meta");
    if (!q.ok()) return fail("cannot read meta");
    while (q.step() == SQLITE_ROW) meta[q.column_text(0)] = q.column_text(1);
  }
  int version = kSchemaVersion;  // a new file's
  if (!meta.count("schema_version")) {
    // A file without the row (one that stopped between creating its tables and writing meta) is
    // as old as its tables: version 1's sessions had no last_used.
    Stmt cols(db, "SELECT count(*) FROM pragma_table_info('sessions') WHERE name = 'last_used'");
    if (!cols.ok() || cols.step() != SQLITE_ROW) return fail("cannot read the sessions table's columns");
    if (sqlite3_column_int64(cols.get(), 0) == 0) version = 1;
  } else {
    const std::string& v = meta["schema_version"];
    if (v.empty() || v.size() > 4 || v.find_first_not_of("0123456789") != std::string::npos ||
        (version = std::stoi(v)) < 1 || version > kSchemaVersion) {
      return failed_precondition_error("session journal " + path + " has schema version " + v +
                                       "; this combs-server reads versions 1 to " + std::to_string(kSchemaVersion));
    }
  }
  bool foreign = meta.count("model_fingerprint") && meta["model_fingerprint"] != o.model_fingerprint;
  if (foreign && !o.drop_foreign) {
    return failed_precondition_error("session journal " + path + " holds sessions of another model (fingerprint " +
                                     meta["model_fingerprint"].substr(0, 16) + ", this one " + o.model_fingerprint.substr(0, 16) +
                                     "); start with --drop-foreign-sessions to delete them, or use another --state-dir");
  }
  if (foreign && (!exec(db, "DELETE FROM tokens") || !exec(db, "DELETE FROM sessions"))) return fail("cannot drop the sessions");
  for (; version < kSchemaVersion; ++version) {  // an older file: migrated in place, a version at a time
    std::string step = kMigrations[version - 1];
    const size_t at = step.find("%NOW%");
    if (at != std::string::npos) step.replace(at, 5, std::to_string(unix_ms_now()));
    const std::string bump = "UPDATE meta SET value = '" + std::to_string(version + 1) + "' WHERE key = 'schema_version';";
    if (!exec(db, "BEGIN IMMEDIATE") || !exec(db, (step + bump).c_str()) || !exec(db, "COMMIT")) {
      Status failed = fail("cannot migrate schema version " + std::to_string(version) + " to " + std::to_string(version + 1));
      exec(db, "ROLLBACK");
      return failed;
    }
  }
  {
    Stmt put(db, "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)");
    if (!put.ok() || !put.text(1, "schema_version").text(2, std::to_string(kSchemaVersion)).run() ||
        !put.text(1, "model_fingerprint").text(2, o.model_fingerprint).run()) {
      return fail("cannot write meta");
    }
  }
  // The sessions, each history from its token runs (which must tile [0, length) exactly).
  {
    Stmt q(db, "SELECT id, parent, owner, cache_namespace, sampling, max_context, conversation, length, last_used FROM sessions");
    Stmt t(db, "SELECT pos, ids, checksum FROM tokens WHERE session = ? ORDER BY pos");
    if (!q.ok() || !t.ok()) return fail("cannot read the sessions");
    while (q.step() == SQLITE_ROW) {
      SessionRecord r;
      r.id = q.column_text(0);
      r.parent = q.column_text(1);
      r.owner = q.column_text(2);
      r.cache_namespace = q.column_text(3);
      const auto sampling = nlohmann::ordered_json::parse(q.column_text(4), nullptr, false);
      auto params = sampling_from_json(sampling);
      if (!params.ok()) return failed_precondition_error("session journal " + path + ": session " + r.id + ": " + params.status().message());
      r.sampling = *params;
      r.max_context = sqlite3_column_int64(q.get(), 5);
      r.conversation = nlohmann::ordered_json::parse(q.column_text(6), nullptr, false);
      if (r.conversation.is_discarded() || !r.conversation.is_array()) {
        return failed_precondition_error("session journal " + path + ": session " + r.id + ": its conversation is not a JSON array");
      }
      const int64_t length = sqlite3_column_int64(q.get(), 7);
      r.last_used_unix_ms = sqlite3_column_int64(q.get(), 8);
      t.text(1, r.id);
      while (t.step() == SQLITE_ROW) {
        const int64_t pos = sqlite3_column_int64(t.get(), 0);
        const auto* p = static_cast<const uint8_t*>(sqlite3_column_blob(t.get(), 1));
        const int n = sqlite3_column_bytes(t.get(), 1);
        if (n > 0 && checksum(p, static_cast<size_t>(n)) != sqlite3_column_int64(t.get(), 2)) {
          return failed_precondition_error("session journal " + path + ": session " + r.id + ": its tokens at position " +
                                           std::to_string(pos) + " fail their checksum (the file is damaged)");
        }
        if (pos != static_cast<int64_t>(r.history.size()) || n % 4 != 0) {
          return failed_precondition_error("session journal " + path + ": session " + r.id + ": its tokens at position " +
                                           std::to_string(pos) + " do not continue the " + std::to_string(r.history.size()) +
                                           " before them");
        }
        for (int i = 0; i < n; i += 4) {
          r.history.push_back(static_cast<int32_t>(uint32_t{p[i]} | uint32_t{p[i + 1]} << 8 | uint32_t{p[i + 2]} << 16 |
                                                   uint32_t{p[i + 3]} << 24));
        }
      }
      sqlite3_reset(t.get());
      if (static_cast<int64_t>(r.history.size()) != length) {
        return failed_precondition_error("session journal " + path + ": session " + r.id + " should hold " +
                                         std::to_string(length) + " tokens, its rows hold " + std::to_string(r.history.size()));
      }
      loaded->push_back(std::move(r));
    }
  }
  j->thread_ = std::thread([raw = j.get()] { raw->writer(); });
  return j;
}

SqliteJournal::SqliteJournal(sqlite3* db, SqliteJournalOptions options) : db_(db), options_(std::move(options)) {}

SqliteJournal::~SqliteJournal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  sqlite3_close(db_);
}

Status SqliteJournal::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return health_;
}

void SqliteJournal::push(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
}

void SqliteJournal::put(const SessionRecord& record) {
  Op op{Op::Kind::kPut, record.id};
  op.record = record;
  push(std::move(op));
}

void SqliteJournal::append(const SessionId& id, int64_t at, std::span<const int32_t> tokens) {
  {  // consecutive appends to one session merge into one queued run
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty()) {
      Op& last = queue_.back();
      if (last.kind == Op::Kind::kAppend && last.id == id && last.at + static_cast<int64_t>(last.tokens.size()) == at) {
        last.tokens.insert(last.tokens.end(), tokens.begin(), tokens.end());
        return;
      }
    }
  }
  Op op{Op::Kind::kAppend, id};
  op.at = at;
  op.tokens.assign(tokens.begin(), tokens.end());
  push(std::move(op));
}

void SqliteJournal::truncate(const SessionId& id, int64_t length) {
  Op op{Op::Kind::kTruncate, id};
  op.at = length;
  push(std::move(op));
}

void SqliteJournal::set_conversation(const SessionId& id, const nlohmann::ordered_json& conversation) {
  Op op{Op::Kind::kConversation, id};
  op.conversation = conversation.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  push(std::move(op));
}

void SqliteJournal::erase(const SessionId& id) { push(Op{Op::Kind::kErase, id}); }

void SqliteJournal::barrier(std::function<void()> done) {
  Op op{Op::Kind::kBarrier, {}};
  op.done = std::move(done);
  push(std::move(op));
}

void SqliteJournal::writer() {
  Stmt put(db_, "INSERT OR REPLACE INTO sessions(id, parent, owner, cache_namespace, sampling, max_context, conversation, length, last_used) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)");
  Stmt clear(db_, "DELETE FROM tokens WHERE session = ?");
  Stmt insert(db_, "INSERT OR REPLACE INTO tokens(session, pos, ids, checksum) VALUES (?, ?, ?, ?)");
  auto insert_run = [&](const SessionId& id, int64_t pos, const std::vector<uint8_t>& ids) {
    return insert.text(1, id).integer(2, pos).blob(3, ids.data(), ids.size()).integer(4, checksum(ids.data(), ids.size())).run();
  };
  Stmt length(db_, "UPDATE sessions SET length = ?, last_used = ? WHERE id = ?");
  Stmt cut(db_, "DELETE FROM tokens WHERE session = ? AND pos >= ?");
  Stmt spanning(db_, "SELECT pos, ids FROM tokens WHERE session = ? AND pos < ? ORDER BY pos DESC LIMIT 1");
  Stmt conversation(db_, "UPDATE sessions SET conversation = ?, last_used = ? WHERE id = ?");
  Stmt erase_session(db_, "DELETE FROM sessions WHERE id = ?");
  auto apply = [&](const Op& op) -> bool {
    switch (op.kind) {
      case Op::Kind::kPut: {
        const SessionRecord& r = op.record;
        const std::vector<uint8_t> ids = token_bytes(r.history);
        return put.text(1, r.id).text(2, r.parent).text(3, r.owner).text(4, r.cache_namespace)
                   .text(5, sampling_to_json(r.sampling).dump()).integer(6, r.max_context)
                   .text(7, r.conversation.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace))
                   .integer(8, static_cast<int64_t>(r.history.size())).integer(9, op.when).run() &&
               clear.text(1, r.id).run() &&
               (ids.empty() || insert_run(r.id, 0, ids));
      }
      case Op::Kind::kAppend: {
        const std::vector<uint8_t> ids = token_bytes(op.tokens);
        return insert_run(op.id, op.at, ids) &&
               length.integer(1, op.at + static_cast<int64_t>(op.tokens.size())).integer(2, op.when).text(3, op.id).run();
      }
      case Op::Kind::kTruncate: {
        if (!cut.text(1, op.id).integer(2, op.at).run()) return false;
        // The run that holds position `at` keeps only what lies before it.
        spanning.text(1, op.id).integer(2, op.at);
        bool ok = true;
        if (spanning.step() == SQLITE_ROW) {
          const int64_t pos = sqlite3_column_int64(spanning.get(), 0);
          const int n = sqlite3_column_bytes(spanning.get(), 1);
          if (pos + n / 4 > op.at) {
            std::vector<uint8_t> keep(static_cast<const uint8_t*>(sqlite3_column_blob(spanning.get(), 1)),
                                      static_cast<const uint8_t*>(sqlite3_column_blob(spanning.get(), 1)) + 4 * (op.at - pos));
            sqlite3_reset(spanning.get());
            ok = insert_run(op.id, pos, keep);
          }
        }
        sqlite3_reset(spanning.get());
        sqlite3_clear_bindings(spanning.get());
        return ok && length.integer(1, op.at).integer(2, op.when).text(3, op.id).run();
      }
      case Op::Kind::kConversation: return conversation.text(1, op.conversation).integer(2, op.when).text(3, op.id).run();
      case Op::Kind::kErase: return clear.text(1, op.id).run() && erase_session.text(1, op.id).run();
      case Op::Kind::kBarrier: return true;
    }
    return true;
  };
  auto last_sync = std::chrono::steady_clock::now();
  for (;;) {
    std::deque<Op> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(options_.flush_ms), [&] { return stopping_ || !queue_.empty(); });
      batch.swap(queue_);
      if (batch.empty() && stopping_) break;
    }
    if (!batch.empty()) {
      // One transaction per batch; a failure (a full disk) is retried a few times, then reported
      // and the batch dropped so that clients are not held forever.
      bool ok = false;
      for (int attempt = 0; attempt < 3 && !ok; ++attempt) {
        ok = exec(db_, "BEGIN IMMEDIATE");
        for (const Op& op : batch) ok = ok && apply(op);
        ok = ok && exec(db_, "COMMIT");
        if (!ok) {
          exec(db_, "ROLLBACK");
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
      if (!ok) {
        std::lock_guard<std::mutex> lock(mu_);
        health_ = db_error(db_, "cannot commit " + std::to_string(batch.size()) + " changes");
      }
      for (Op& op : batch) {
        if (op.kind == Op::Kind::kBarrier && op.done) op.done();
      }
    }
    if (options_.durability == SqliteJournalOptions::Durability::kFast &&
        std::chrono::steady_clock::now() - last_sync >= std::chrono::milliseconds(options_.flush_ms)) {
      sqlite3_wal_checkpoint_v2(db_, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);  // syncs the WAL
      last_sync = std::chrono::steady_clock::now();
    }
  }
}

}  // namespace combs
