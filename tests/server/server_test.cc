// combs-server as a subprocess on a free loopback port, driven by a real gRPC client.
#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "combs/v1/combs.grpc.pb.h"
#include "support/server_process.h"

using namespace combs::v1;

using combs::testing::generate;
using combs::testing::ServerProcess;
using combs::testing::Streamed;

TEST_CASE("combs-server serves sessions over gRPC", "[server]") {
  ServerProcess server;
  INFO("server at " << server.address);
  auto channel = grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials());
  REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  auto stub = Combs::NewStub(channel);

  CreateSessionResponse created;
  {
    grpc::ClientContext ctx;
    REQUIRE(stub->CreateSession(&ctx, CreateSessionRequest(), &created).ok());
  }
  CHECK(created.session_id().size() == 32);
  // The combs CLI against the same server: health, then info of the session.
  {
    const std::string cmd = std::string(COMBS_CLI_BIN) + " --server " + server.address + " health";
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    char out[64] = {};
    const bool got = std::fgets(out, sizeof out, p) != nullptr;
    CHECK(pclose(p) == 0);
    CHECK((got && std::string(out) == "SERVING\n"));
  }

  GenerateRequest g;
  g.set_session_id(created.session_id());
  for (int t : {128000, 9906, 1917}) g.mutable_tokens()->add_ids(t);
  g.set_max_tokens(8);
  g.mutable_sampling()->set_temperature(0.0f);
  g.set_ignore_eos(true);
  Streamed first = generate(*stub, g);
  REQUIRE(first.status.ok());
  CHECK(first.tokens.size() == 8);
  CHECK(first.last.finished());
  CHECK(first.last.finish_reason() == FINISH_REASON_LENGTH);
  CHECK(first.last.usage().output_tokens() == 8);
  CHECK(first.last.session_length() == 11);

  SessionInfo info;
  {
    grpc::ClientContext ctx;
    GetSessionRequest q;
    q.set_session_id(created.session_id());
    REQUIRE(stub->GetSession(&ctx, q, &info).ok());
  }
  CHECK(info.length() == 11);

  // Roll back the generated tokens and regenerate: greedy gives them again.
  {
    grpc::ClientContext ctx;
    RollbackRequest rb;
    rb.set_session_id(created.session_id());
    rb.set_n(8);
    RollbackResponse resp;
    REQUIRE(stub->Rollback(&ctx, rb, &resp).ok());
    CHECK(resp.length() == 3);
  }
  GenerateRequest again = g;
  again.clear_tokens();
  CHECK(generate(*stub, again).tokens == first.tokens);
  {
    grpc::ClientContext ctx;
    RollbackRequest rb;
    rb.set_session_id(created.session_id());
    rb.set_n(1000);
    RollbackResponse resp;
    CHECK(stub->Rollback(&ctx, rb, &resp).error_code() == grpc::StatusCode::OUT_OF_RANGE);
  }
  // Fork, then the child continues; text input through the model's tokenizer.
  ForkResponse forked;
  {
    grpc::ClientContext ctx;
    ForkRequest f;
    f.set_session_id(created.session_id());
    REQUIRE(stub->Fork(&ctx, f, &forked).ok());
  }
  GenerateRequest text;
  text.set_session_id(forked.session_id());
  text.set_text("hello");
  text.set_max_tokens(4);
  text.set_ignore_eos(true);
  Streamed child = generate(*stub, text);
  REQUIRE(child.status.ok());
  // The default model has the Llama 3 vocabulary: "hello" is one token (15339, no BOS asked).
  CHECK(child.last.usage().input_tokens() == 1);
  // Bad input and unknown sessions.
  GenerateRequest bad = g;
  bad.mutable_tokens()->add_ids(1 << 30);
  CHECK(generate(*stub, bad).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  {
    grpc::ClientContext ctx;
    CloseSessionRequest c;
    c.set_session_id(forked.session_id());
    CloseSessionResponse resp;
    REQUIRE(stub->CloseSession(&ctx, c, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    GetSessionRequest q;
    q.set_session_id(forked.session_id());
    CHECK(stub->GetSession(&ctx, q, &info).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  // A long generate: a second operation on the session is FAILED_PRECONDITION; the client's
  // cancellation stops it.
  {
    GenerateRequest longer = g;
    longer.clear_tokens();
    longer.set_max_tokens(2000);
    longer.mutable_sampling()->set_temperature(0.8f);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, longer);
    GenerateResponse r;
    REQUIRE(reader->Read(&r));  // it is running
    grpc::ClientContext ctx2;
    RollbackRequest rb;
    rb.set_session_id(created.session_id());
    rb.set_n(1);
    RollbackResponse resp;
    CHECK(stub->Rollback(&ctx2, rb, &resp).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    ctx.TryCancel();
    while (reader->Read(&r)) {
    }
    CHECK(reader->Finish().error_code() == grpc::StatusCode::CANCELLED);
  }
  CHECK(server.stop() == 0);
}

TEST_CASE("api keys authenticate callers and sessions are invisible to other keys", "[server]") {
  combs::testing::TempDir keys_dir;
  const std::string keys = keys_dir.file("keys");
  {
    std::FILE* f = std::fopen(keys.c_str(), "w");
    std::fputs("# two clients\nkey-alice\n\nkey-bob\n", f);
    std::fclose(f);
  }
  ServerProcess server({"--api-keys", keys});
  auto channel = grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials());
  REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  auto stub = Combs::NewStub(channel);
  auto as = [](grpc::ClientContext& ctx, const char* key) {
    if (key) ctx.AddMetadata("authorization", std::string("Bearer ") + key);
  };
  {
    grpc::ClientContext ctx;
    CreateSessionResponse r;
    CHECK(stub->CreateSession(&ctx, CreateSessionRequest(), &r).error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    as(ctx, "key-mallory");
    CreateSessionResponse r;
    CHECK(stub->CreateSession(&ctx, CreateSessionRequest(), &r).error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  CreateSessionResponse alice;
  {
    grpc::ClientContext ctx;
    as(ctx, "key-alice");
    REQUIRE(stub->CreateSession(&ctx, CreateSessionRequest(), &alice).ok());
  }
  GetSessionRequest q;
  q.set_session_id(alice.session_id());
  SessionInfo info;
  {
    grpc::ClientContext ctx;
    as(ctx, "key-alice");
    CHECK(stub->GetSession(&ctx, q, &info).ok());
  }
  {
    grpc::ClientContext ctx;
    as(ctx, "key-bob");
    CHECK(stub->GetSession(&ctx, q, &info).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    as(ctx, "key-bob");
    CloseSessionRequest c;
    c.set_session_id(alice.session_id());
    CloseSessionResponse r;
    CHECK(stub->CloseSession(&ctx, c, &r).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    as(ctx, "key-bob");
    GenerateRequest g;
    g.set_session_id(alice.session_id());
    g.mutable_tokens()->add_ids(9906);
    auto reader = stub->Generate(&ctx, g);
    GenerateResponse r;
    while (reader->Read(&r)) {
    }
    CHECK(reader->Finish().error_code() == grpc::StatusCode::NOT_FOUND);
  }
  ListSessionsResponse listed;
  {
    grpc::ClientContext ctx;
    as(ctx, "key-bob");
    REQUIRE(stub->ListSessions(&ctx, ListSessionsRequest(), &listed).ok());
    CHECK(listed.sessions_size() == 0);
  }
  {
    grpc::ClientContext ctx;
    as(ctx, "key-alice");
    REQUIRE(stub->ListSessions(&ctx, ListSessionsRequest(), &listed).ok());
    CHECK(listed.sessions_size() == 1);
  }
  CHECK(server.stop() == 0);
}

TEST_CASE("the server speaks TLS with a certificate and key", "[server]") {
  combs::testing::TempDir dir;
  const std::string cert = dir.file("cert.pem"), key = dir.file("key.pem");
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                          "-addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " + key + " -out " + cert +
                          " >/dev/null 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  ServerProcess server({"--tls-cert", cert, "--tls-key", key});
  std::string pem;
  {
    std::FILE* f = std::fopen(cert.c_str(), "r");
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) pem.append(buf, n);
    std::fclose(f);
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pem;
  auto channel = grpc::CreateChannel(server.address, grpc::SslCredentials(ssl));
  REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  auto stub = Combs::NewStub(channel);
  grpc::ClientContext ctx;
  CreateSessionResponse r;
  CHECK(stub->CreateSession(&ctx, CreateSessionRequest(), &r).ok());
  // A plaintext client gets nowhere.
  auto plain = grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials());
  auto plain_stub = Combs::NewStub(plain);
  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  CHECK_FALSE(plain_stub->CreateSession(&ctx2, CreateSessionRequest(), &r).ok());
  CHECK(server.stop() == 0);
}
