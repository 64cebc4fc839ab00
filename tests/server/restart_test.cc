// Sessions that survive the server: kill -9 of combs-server with --state-dir, restarted on the same
// directory, again and again; every session that existed is there with every token of every
// finished Generate, a Generate streaming at the kill kept a whole prefix of what it had, and a
// greedy continuation of each session equals that of a new session fed the same history.
#include <catch2/catch.hpp>

#include <map>
#include <thread>

#include "support/random.h"
#include "support/server_process.h"
#include "support/temp_dir.h"

using namespace combs::testing;
using namespace combs::v1;

TEST_CASE("sessions survive kill -9 of the server restart after restart", "[server]") {
  Rng rng(test_seed());
  TempDir state;
  const std::string dir = state.file("state");
  std::map<std::string, std::vector<int32_t>> known;  // each session's history as the client saw it
  // The session that was streaming at the last kill: its id, input and what the client received.
  struct Busy {
    std::string id;
    std::vector<int32_t> input, streamed;
  } pending;
  constexpr int kRestarts = 50;
  for (int round = 0; round <= kRestarts; ++round) {
    INFO("round " << round);
    ServerProcess server({"--state-dir", dir, "--log-level", "warn", "--durability", round % 2 ? "fast" : "full"});
    auto stub = server.stub();
    if (!pending.id.empty()) {
      // It holds nothing, its input, or its input and what it generated before the kill: when the
      // client received all of that, it is known; else (the journal ran ahead of the stream) only
      // its length is, and it goes.
      grpc::StatusCode code;
      const int64_t length = info(*stub, pending.id, &code).length();
      const int64_t in = static_cast<int64_t>(pending.input.size());
      INFO("the streaming session holds " << length << " tokens; " << pending.streamed.size() << " were streamed");
      CHECK((code == grpc::StatusCode::OK || code == grpc::StatusCode::NOT_FOUND));
      CHECK((length == 0 || (length >= in && length <= in + 1800)));
      if (code == grpc::StatusCode::OK && length <= in + static_cast<int64_t>(pending.streamed.size())) {
        known[pending.id] = length >= in ? concat(pending.input, {pending.streamed.begin(), pending.streamed.begin() + (length - in)})
                                         : std::vector<int32_t>{};
      } else if (code == grpc::StatusCode::OK) {
        grpc::ClientContext ctx;
        CloseSessionRequest q;
        q.set_session_id(pending.id);
        CloseSessionResponse a;
        REQUIRE(stub->CloseSession(&ctx, q, &a).ok());
      }
      pending = {};
    }
    for (const auto& [id, history] : known) {
      grpc::StatusCode code;
      const SessionInfo i = info(*stub, id, &code);
      INFO("session " << id);
      REQUIRE(code == grpc::StatusCode::OK);
      CHECK(i.length() == static_cast<int64_t>(history.size()));
    }
    if (round == kRestarts) {
      // Every history is what the client saw: a session continues as a new one fed the same tokens.
      for (const auto& [id, history] : known) {
        if (history.empty()) continue;
        const Streamed restored = generate(*stub, greedy(id, {}, 4));
        const Streamed fresh = generate(*stub, greedy(create(*stub), history, 4));
        INFO("session " << id << ", " << history.size() << " tokens");
        REQUIRE(restored.status.ok());
        CHECK(restored.tokens == fresh.tokens);
      }
      CHECK(server.stop() == 0);
      break;
    }
    // A new session with a prompt and a reply.
    const std::string s = create(*stub);
    const std::vector<int32_t> prompt = random_tokens(rng, rng.integer(4, 24), 1, 30000);
    const Streamed r = generate(*stub, greedy(s, prompt, 6));
    REQUIRE(r.status.ok());
    known[s] = concat(prompt, r.tokens);
    // An earlier one goes on, rolls back or forks.
    auto it = known.begin();
    std::advance(it, rng.integer(0, known.size() - 1));
    const std::string old = it->first;
    switch (round % 3) {
      case 0: {
        const Streamed more = generate(*stub, greedy(old, {7, 8, 9}, 4));
        REQUIRE(more.status.ok());
        known[old] = concat(concat(known[old], {7, 8, 9}), more.tokens);
        break;
      }
      case 1: {
        grpc::ClientContext ctx;
        RollbackRequest q;
        q.set_session_id(old);
        q.set_n(std::min<int64_t>(3, static_cast<int64_t>(known[old].size())));
        RollbackResponse a;
        REQUIRE(stub->Rollback(&ctx, q, &a).ok());
        known[old].resize(known[old].size() - static_cast<size_t>(q.n()));
        break;
      }
      default: {
        grpc::ClientContext ctx;
        ForkRequest q;
        q.set_session_id(old);
        ForkResponse a;
        REQUIRE(stub->Fork(&ctx, q, &a).ok());
        known[a.session_id()] = known[old];
        break;
      }
    }
    // A long Generate streams as the server is killed.
    const std::string busy = create(*stub);
    const std::vector<int32_t> input = random_tokens(rng, 8, 1, 30000);
    Streamed streaming;
    std::thread t([&] { streaming = generate(*stub, greedy(busy, input, 1800)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(rng.integer(20, 200)));
    server.signal(SIGKILL);
    t.join();
    server.wait();
    pending = {busy, input, streaming.tokens};
  }
}

TEST_CASE("a session exported from one server continues on another", "[server]") {
  Rng rng(test_seed());
  ServerProcess a, b;
  auto sa = a.stub(), sb = b.stub();
  const std::string id = create(*sa);
  REQUIRE(generate(*sa, greedy(id, random_tokens(rng, 20, 1, 30000), 10)).status.ok());
  auto export_of = [](Combs::Stub& stub, const std::string& session, grpc::Status* status) {
    grpc::ClientContext ctx;
    ExportSessionRequest q;
    q.set_session_id(session);
    ExportSessionResponse r;
    *status = stub.ExportSession(&ctx, q, &r);
    return r.session();
  };
  auto import_to = [](Combs::Stub& stub, const std::string& blob, std::string* id) {
    grpc::ClientContext ctx;
    ImportSessionRequest q;
    q.set_session(blob);
    ImportSessionResponse r;
    grpc::Status s = stub.ImportSession(&ctx, q, &r);
    *id = r.session_id();
    return s.error_code();
  };
  grpc::Status st;
  const std::string blob = export_of(*sa, id, &st);
  REQUIRE(st.ok());
  std::string imported;
  REQUIRE(import_to(*sb, blob, &imported) == grpc::StatusCode::OK);
  CHECK(imported == id);  // the same id: its family routes it as before
  CHECK(info(*sb, id).length() == 30);
  CHECK(generate(*sb, greedy(id, {}, 6)).tokens == generate(*sa, greedy(id, {}, 6)).tokens);
  // Bad, damaged, repeated and foreign blobs import nothing.
  std::string none;
  CHECK(import_to(*sb, "not a session", &none) == grpc::StatusCode::INVALID_ARGUMENT);
  std::string flipped = blob;
  flipped[flipped.size() / 2] ^= 0x20;
  CHECK(import_to(*sb, flipped, &none) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(import_to(*sb, blob.substr(0, blob.size() - 7), &none) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(import_to(*sb, blob, &none) == grpc::StatusCode::ALREADY_EXISTS);
  ServerProcess other({"--vocab", "none"}, /*test_vocab=*/false);  // another model: the byte-level vocabulary
  auto so = other.stub();
  CHECK(import_to(*so, blob, &none) == grpc::StatusCode::FAILED_PRECONDITION);
  export_of(*sa, "0123456789abcdef0123456789abcdef", &st);
  CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  ListSessionsResponse list;
  REQUIRE(sb->ListSessions(&ctx, ListSessionsRequest(), &list).ok());
  CHECK(list.sessions_size() == 1);
}
