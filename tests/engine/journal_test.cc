// The session journal: what the SQLite journal writes it reads back; damaged, foreign and newer
// databases are refused with the reason; an engine with a journal restarts with its sessions, and
// a restored session continues as the original does.
#include <catch2/catch.hpp>
#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "combs/engine/engine.h"
#include "combs/engine/sqlite_journal.h"
#include "support/engine_helpers.h"
#include "support/engine_model.h"
#include "support/random.h"
#include "support/temp_dir.h"

using namespace combs;
using namespace combs::testing;

namespace {

SqliteJournalOptions options_in(const TempDir& dir, std::string model = "model-a") {
  SqliteJournalOptions o;
  o.dir = dir.file("state");
  o.model_fingerprint = std::move(model);
  return o;
}

// Waits until everything recorded so far is committed.
void flush(SessionJournal& j) {
  auto done = std::make_shared<std::promise<void>>();
  j.barrier([done] { done->set_value(); });
  done->get_future().wait();
}

std::vector<int32_t> iota_tokens(int from, int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = from + i;
  return t;
}

void sql(const std::string& db_path, const std::string& statement) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(db_path.c_str(), &db) == SQLITE_OK);
  CHECK(sqlite3_exec(db, statement.c_str(), nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(db);
}

}  // namespace

TEST_CASE("the sqlite journal reads back what it recorded", "[engine]") {
  TempDir dir;
  const auto durability = GENERATE(SqliteJournalOptions::Durability::kFull, SqliteJournalOptions::Durability::kFast);
  SqliteJournalOptions o = options_in(dir);
  o.durability = durability;
  {
    std::vector<SessionRecord> loaded;
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE(j.ok());
    CHECK(loaded.empty());
    SessionRecord a;
    a.id = std::string(32, 'a');
    a.owner = "key-1";
    a.cache_namespace = "ns";
    a.sampling.temperature = 0.5f;
    a.sampling.logit_bias = {{7, -2.5f}};
    a.max_context = 900;
    a.history = iota_tokens(10, 5);
    (*j)->put(a);
    (*j)->append(a.id, 5, iota_tokens(100, 3));  // merged with the next, one run
    (*j)->append(a.id, 8, iota_tokens(200, 4));
    (*j)->truncate(a.id, 10);                     // into the middle of the run at 5
    (*j)->append(a.id, 10, iota_tokens(300, 2));
    (*j)->set_conversation(a.id, nlohmann::ordered_json::array({{{"role", "user"}, {"content", "hi"}}}));
    SessionRecord b = a;
    b.id = std::string(32, 'b');
    b.parent = a.id;
    (*j)->put(b);
    (*j)->truncate(b.id, 0);
    SessionRecord c = a;
    c.id = std::string(32, 'c');
    (*j)->put(c);
    (*j)->erase(c.id);
    flush(**j);
    CHECK((*j)->health().ok());
  }
  std::vector<SessionRecord> loaded;
  auto j = SqliteJournal::open(o, &loaded);
  REQUIRE(j.ok());
  REQUIRE(loaded.size() == 2);
  std::sort(loaded.begin(), loaded.end(), [](auto& x, auto& y) { return x.id < y.id; });
  const SessionRecord& a = loaded[0];
  CHECK(a.id == std::string(32, 'a'));
  CHECK(a.owner == "key-1");
  CHECK(a.cache_namespace == "ns");
  CHECK(a.sampling.temperature == 0.5f);
  REQUIRE(a.sampling.logit_bias.size() == 1);
  CHECK(a.sampling.logit_bias[0].second == -2.5f);
  CHECK(a.max_context == 900);
  std::vector<int32_t> expected = iota_tokens(10, 5);
  for (int32_t t : {100, 101, 102, 200, 201}) expected.push_back(t);
  for (int32_t t : {300, 301}) expected.push_back(t);
  CHECK(a.history == expected);
  CHECK(a.conversation.size() == 1);
  CHECK(loaded[1].parent == a.id);
  CHECK(loaded[1].history.empty());
}

TEST_CASE("damaged foreign and newer journals are refused with the reason", "[engine]") {
  TempDir dir;
  SqliteJournalOptions o = options_in(dir);
  const std::string db = o.dir + "/sessions.db";
  auto write_one = [&] {
    std::vector<SessionRecord> loaded;
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE(j.ok());
    SessionRecord r;
    r.id = std::string(32, 'd');
    r.history = iota_tokens(1, 4000);
    (*j)->put(r);
    flush(**j);
  };
  std::vector<SessionRecord> loaded;
  SECTION("another model") {
    write_one();
    SqliteJournalOptions other = o;
    other.model_fingerprint = "model-b";
    auto j = SqliteJournal::open(other, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK(j.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(j.status().message(), Catch::Contains("another model") && Catch::Contains("--drop-foreign-sessions"));
    other.drop_foreign = true;
    auto dropped = SqliteJournal::open(other, &loaded);
    REQUIRE(dropped.ok());
    CHECK(loaded.empty());
  }
  SECTION("a newer schema") {
    write_one();
    sql(db, "UPDATE meta SET value = '99' WHERE key = 'schema_version'");
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK_THAT(j.status().message(), Catch::Contains("schema version 99"));
  }
  SECTION("not a database") {
    std::filesystem::create_directories(o.dir);
    std::ofstream(db) << std::string(10000, 'x');
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK_THAT(j.status().message(), Catch::Contains("sessions.db"));
  }
  SECTION("truncated or with flipped bytes") {
    write_one();
    const auto size = std::filesystem::file_size(db);
    const bool truncate = GENERATE(true, false);
    if (truncate) {
      std::filesystem::resize_file(db, size / 2);
    } else {
      std::fstream f(db, std::ios::in | std::ios::out | std::ios::binary);
      for (std::streamoff at = 4096; at < static_cast<std::streamoff>(size); at += 997) {
        f.seekp(at);
        f.put('\x5a');
      }
    }
    auto j = SqliteJournal::open(o, &loaded);
    // Refused with the reason, or every session read back whole: never a session cut short.
    if (j.ok()) {
      for (const SessionRecord& r : loaded) CHECK(r.history == iota_tokens(1, 4000));
    } else {
      CHECK_THAT(j.status().message(), Catch::Contains("sessions.db"));
    }
  }
  SECTION("a token changed inside its row") {
    write_one();
    sql(db, "UPDATE tokens SET ids = zeroblob(16000)");
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK_THAT(j.status().message(), Catch::Contains("checksum"));
  }
  SECTION("rows that do not add up") {
    write_one();
    sql(db, "UPDATE sessions SET length = 5000");
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK_THAT(j.status().message(), Catch::Contains("should hold 5000 tokens"));
  }
}

TEST_CASE("an engine restarted on its journal continues every session as before", "[engine]") {
  Rng rng(test_seed());
  ModelFile mf;
  TempDir dir;
  SqliteJournalOptions jo = options_in(dir, "tiny");
  std::vector<SessionId> ids;
  std::vector<std::vector<int32_t>> continuation;
  {
    std::vector<SessionRecord> loaded;
    auto journal = SqliteJournal::open(jo, &loaded);
    REQUIRE(journal.ok());
    EngineOptions eo;
    eo.journal = journal->get();
    auto e = mf.engine(eo);
    std::vector<int32_t> prompt(40);
    for (auto& t : prompt) t = static_cast<int32_t>(rng.integer(3, 258));
    SessionOptions so;
    so.owner = "key-1";
    const SessionId a = e->create_session(so).value();
    run(*e, a, request(prompt, 12));
    const SessionId b = e->fork(a).value();
    run(*e, b, request({5, 6, 7}, 9, 0.9f, 4));
    REQUIRE(e->rollback(a, 5).ok());
    const SessionId c = e->create_session().value();
    run(*e, c, request(prompt, 3));
    REQUIRE(e->reset(c).ok());
    const SessionId gone = e->create_session().value();
    run(*e, gone, request({1, 2, 3}, 2));
    REQUIRE(e->close(gone).ok());
    ids = {a, b, c};
    // What each continues with (greedy), after which the session is as before (rolled back).
    for (const SessionId& id : {a, b}) {
      continuation.push_back(run(*e, id, request({}, 8)));
      REQUIRE(e->rollback(id, 8).ok());
    }
    flush(**journal);
  }
  std::vector<SessionRecord> loaded;
  auto journal = SqliteJournal::open(jo, &loaded);
  REQUIRE(journal.ok());
  CHECK(loaded.size() == 3);
  EngineOptions eo;
  eo.journal = journal->get();
  eo.restore = loaded;
  auto e = mf.engine(eo);
  CHECK(e->info(ids[0])->length == 40 + 12 - 5);
  CHECK(e->info(ids[0])->owner == "key-1");
  CHECK(e->info(ids[1])->length == 40 + 12 + 3 + 9);
  CHECK(e->info(ids[1])->parent == ids[0]);
  CHECK(e->info(ids[1])->owner == "key-1");
  CHECK(e->info(ids[2])->length == 0);
  CHECK(e->info(ids[0])->cached == 0);  // no pages until used
  CHECK(run(*e, ids[0], request({}, 8)) == continuation[0]);
  CHECK(run(*e, ids[1], request({}, 8)) == continuation[1]);
  REQUIRE(e->check_invariants().ok());
  // A record that does not fit is refused by name.
  EngineOptions bad;
  SessionRecord r;
  r.id = std::string(32, 'e');
  r.history = {999999};
  bad.restore = {r};
  auto m = Model::load(mf.path);
  REQUIRE(m.ok());
  auto refused = Engine::create(std::move(m).value(), bad);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.status().message(), Catch::Contains(r.id) && Catch::Contains("outside the vocabulary"));
}

TEST_CASE("a version 1 journal is migrated in place and keeps every session", "[engine]") {
  TempDir dir;
  SqliteJournalOptions o = options_in(dir);
  const std::string db = o.dir + "/sessions.db";
  {
    std::vector<SessionRecord> loaded;
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE(j.ok());
    SessionRecord r;
    r.id = std::string(32, 'a');
    r.owner = "key-1";
    r.history = iota_tokens(1, 300);
    (*j)->put(r);
    r.id = std::string(32, 'b');
    r.parent = std::string(32, 'a');
    (*j)->put(r);
    (*j)->append(r.id, 300, iota_tokens(7, 3));
    flush(**j);
  }
  // The file as version 1 wrote it: no last_used column; with its version row, or without one
  // (stopped before writing meta: the tables tell the version).
  const bool version_row = GENERATE(true, false);
  INFO("version row " << version_row);
  sql(db, version_row ? "ALTER TABLE sessions DROP COLUMN last_used; UPDATE meta SET value = '1' WHERE key = 'schema_version'"
                      : "ALTER TABLE sessions DROP COLUMN last_used; DELETE FROM meta");
  const int64_t before = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  for (int open = 0; open < 2; ++open) {  // migrated once, then read as it is
    INFO("open " << open);
    std::vector<SessionRecord> loaded;
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE(j.ok());
    REQUIRE(loaded.size() == 2);
    std::sort(loaded.begin(), loaded.end(), [](auto& x, auto& y) { return x.id < y.id; });
    CHECK(loaded[0].history == iota_tokens(1, 300));
    CHECK(loaded[0].owner == "key-1");
    std::vector<int32_t> b = iota_tokens(1, 300);
    for (int32_t t : iota_tokens(7, 3)) b.push_back(t);
    CHECK(loaded[1].history == b);
    CHECK(loaded[1].parent == loaded[0].id);
    for (const SessionRecord& r : loaded) {  // used as of the migration
      CHECK(r.last_used_unix_ms >= before);
      CHECK(r.last_used_unix_ms <= before + 60000);
    }
  }
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* q = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, "SELECT value FROM meta WHERE key = 'schema_version'", -1, &q, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(q) == SQLITE_ROW);
  CHECK(std::string(reinterpret_cast<const char*>(sqlite3_column_text(q, 0))) == "2");
  sqlite3_finalize(q);
  sqlite3_close(h);
  // A version this server cannot read (0, or not a number) is refused, the file left as it is.
  for (const char* v : {"0", "x1"}) {
    sql(db, std::string("UPDATE meta SET value = '") + v + "' WHERE key = 'schema_version'");
    std::vector<SessionRecord> loaded;
    auto j = SqliteJournal::open(o, &loaded);
    REQUIRE_FALSE(j.ok());
    CHECK_THAT(j.status().message(), Catch::Contains(std::string("schema version ") + v));
  }
}

TEST_CASE("restored sessions keep the time to live they had left", "[engine]") {
  ModelFile mf;
  TempDir dir;
  SqliteJournalOptions jo = options_in(dir, "tiny");
  SessionId fresh, stale;
  {
    std::vector<SessionRecord> loaded;
    auto journal = SqliteJournal::open(jo, &loaded);
    REQUIRE(journal.ok());
    EngineOptions eo;
    eo.journal = journal->get();
    auto e = mf.engine(eo);
    fresh = e->create_session().value();
    stale = e->create_session().value();
    run(*e, fresh, request({1, 2, 3}, 2));
    run(*e, stale, request({4, 5, 6}, 2));
    flush(**journal);
  }
  // stale's last change was two hours ago.
  const int64_t two_hours_ago = std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::system_clock::now().time_since_epoch()).count() - 7200 * 1000;
  sql(jo.dir + "/sessions.db", "UPDATE sessions SET last_used = " + std::to_string(two_hours_ago) + " WHERE id = '" + stale + "'");
  std::vector<SessionRecord> loaded;
  auto journal = SqliteJournal::open(jo, &loaded);
  REQUIRE(journal.ok());
  REQUIRE(loaded.size() == 2);
  EngineOptions eo;
  eo.journal = journal->get();
  eo.restore = loaded;
  eo.session_ttl = std::chrono::hours(1);
  auto e = mf.engine(eo);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (e->info(stale).ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(e->info(stale).status().code() == StatusCode::kNotFound);  // expired, and erased from the journal
  CHECK(e->info(fresh)->length == 5);
  flush(**journal);
  journal->reset();
  std::vector<SessionRecord> again;
  REQUIRE(SqliteJournal::open(jo, &again).ok());
  REQUIRE(again.size() == 1);
  CHECK(again[0].id == fresh);
}
