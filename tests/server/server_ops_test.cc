// combs-server operated as users run it: every RPC, the documented errors, limits, deadlines,
// request ids, metrics over HTTP, config files and flags, and the graceful shutdown.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <map>
#include <thread>

#include "combs/model/random_model.h"
#include "support/server_process.h"
#include "support/temp_dir.h"

using namespace combs::v1;
using combs::testing::generate;
using combs::testing::http_get;
using combs::testing::run_command;
using combs::testing::ServerProcess;
using combs::testing::Streamed;
using combs::testing::create;
using combs::testing::greedy;
using combs::testing::info;

namespace {

// The value of one sample line "name value" in a Prometheus text exposition; -1 when absent.
double metric(const std::string& text, const std::string& series) {
  size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

}  // namespace

TEST_CASE("every rpc answers its happy path", "[server]") {
  ServerProcess server;
  auto stub = server.stub();
  const std::string a = create(*stub);
  Streamed g = generate(*stub, greedy(a, {128000, 9906, 1917}, 4));
  REQUIRE(g.status.ok());
  {  // Reset empties the session
    grpc::ClientContext ctx;
    ResetRequest r;
    r.set_session_id(a);
    ResetResponse resp;
    REQUIRE(stub->Reset(&ctx, r, &resp).ok());
    CHECK(info(*stub, a).length() == 0);
  }
  {  // Tokenize / Detokenize round trip through the Llama 3 vocabulary
    grpc::ClientContext ctx;
    TokenizeRequest t;
    t.set_text("Hello world");
    TokenizeResponse tr;
    REQUIRE(stub->Tokenize(&ctx, t, &tr).ok());
    CHECK(std::vector<int32_t>(tr.ids().begin(), tr.ids().end()) == std::vector<int32_t>{9906, 1917});
    grpc::ClientContext ctx2;
    DetokenizeRequest d;
    d.mutable_ids()->CopyFrom(tr.ids());
    DetokenizeResponse dr;
    REQUIRE(stub->Detokenize(&ctx2, d, &dr).ok());
    CHECK(dr.text() == "Hello world");
  }
  {
    grpc::ClientContext ctx;
    ModelInfo m;
    REQUIRE(stub->GetModelInfo(&ctx, GetModelInfoRequest(), &m).ok());
    CHECK(m.architecture() == "llama");
    CHECK(m.n_vocab() == 128256);
    CHECK(m.bos_id() == 128000);
    // The default model: bf16 matrices and f32 norms, the larger share first.
    REQUIRE(m.tensor_types_size() == 2);
    CHECK(m.tensor_types(0).dtype() == "bf16");
    CHECK(m.tensor_types(1).dtype() == "f32");
    CHECK(m.tensor_types(0).bytes() > m.tensor_types(1).bytes());
    CHECK(m.kv_pages_total() > 0);
  }
  const std::string b = create(*stub);
  {
    grpc::ClientContext ctx;
    ListSessionsResponse l;
    REQUIRE(stub->ListSessions(&ctx, ListSessionsRequest(), &l).ok());
    CHECK(l.sessions_size() == 2);
  }
  {  // a request id given by the client comes back; one is made up otherwise
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-request-id", "trace-42.a_b");
    GetSessionRequest q;
    q.set_session_id(b);
    SessionInfo i;
    REQUIRE(stub->GetSession(&ctx, q, &i).ok());
    auto it = ctx.GetServerInitialMetadata().find("x-request-id");
    REQUIRE(it != ctx.GetServerInitialMetadata().end());
    CHECK(std::string(it->second.data(), it->second.size()) == "trace-42.a_b");
    grpc::ClientContext ctx2;
    ctx2.AddMetadata("x-request-id", "not a sane id!");
    REQUIRE(stub->GetSession(&ctx2, q, &i).ok());
    it = ctx2.GetServerInitialMetadata().find("x-request-id");
    REQUIRE(it != ctx2.GetServerInitialMetadata().end());
    CHECK(it->second.size() == 16);
  }
  CHECK(server.stop() == 0);
  // One log line per call, with the request id.
  const std::string logs = server.logs();
  CHECK(logs.find("event=rpc method=GetSession request_id=trace-42.a_b session=" + b + " code=OK") != std::string::npos);
  CHECK(logs.find("method=Generate") != std::string::npos);
  CHECK(logs.find("event=stopped") != std::string::npos);
}

TEST_CASE("bad input gets its documented error while other sessions are served", "[server]") {
  ServerProcess server({"--max-new-tokens", "64", "--max-input-tokens", "16", "--max-sessions", "4",
                        "--max-message-bytes", "65536"});
  auto stub = server.stub();
  const std::string busy = create(*stub), s = create(*stub);
  // A long stream runs on one session throughout.
  GenerateRequest long_req = greedy(busy, {128000, 9906}, 64);
  long_req.mutable_sampling()->set_temperature(0.7f);
  grpc::ClientContext long_ctx;
  auto long_stream = stub->Generate(&long_ctx, long_req);
  GenerateResponse first;
  REQUIRE(long_stream->Read(&first));

  auto code_of = [&](const GenerateRequest& r) { return generate(*stub, r).status.error_code(); };
  using C = grpc::StatusCode;
  CHECK(code_of(greedy("0123456789abcdef0123456789abcdef", {1}, 1)) == C::NOT_FOUND);
  CHECK(code_of(greedy(s, {128256}, 1)) == C::INVALID_ARGUMENT);  // one past the vocabulary
  CHECK(code_of(greedy(s, {-1}, 1)) == C::INVALID_ARGUMENT);
  CHECK(code_of(greedy(s, {1}, -1)) == C::INVALID_ARGUMENT);
  for (int field = 0; field < 5; ++field) {
    GenerateRequest r = greedy(s, {1}, 1);
    auto* p = r.mutable_sampling();
    if (field == 0) p->set_temperature(-1);
    if (field == 1) p->set_top_p(1.5f);
    if (field == 2) p->set_top_k(-3);
    if (field == 3) p->set_min_p(2);
    if (field == 4) (*p->mutable_logit_bias())[1 << 20] = 1.0f;
    INFO("sampling field " << field);
    CHECK(code_of(r) == C::INVALID_ARGUMENT);
  }
  CHECK(code_of(greedy(s, {1}, 65)) == C::RESOURCE_EXHAUSTED);                                  // --max-new-tokens
  CHECK(code_of(greedy(s, std::vector<int32_t>(17, 1), 1)) == C::RESOURCE_EXHAUSTED);            // --max-input-tokens
  {  // --max-message-bytes: 30000 three-byte ids do not fit in 64 KiB
    Streamed big = generate(*stub, greedy(s, std::vector<int32_t>(30000, 100000), 1));
    CHECK(big.status.error_code() == C::RESOURCE_EXHAUSTED);
    CHECK(big.status.error_message().find("larger than") != std::string::npos);
  }
  {
    GenerateRequest r = greedy(s, {}, 1);
    r.clear_tokens();
    r.set_text("x");
    r.add_stop("");
    CHECK(code_of(r) == C::INVALID_ARGUMENT);  // empty stop string
  }
  CHECK(code_of(greedy(busy, {1}, 1)) == C::FAILED_PRECONDITION);  // busy
  auto rollback = [&](const std::string& id, int64_t n) {
    grpc::ClientContext ctx;
    RollbackRequest r;
    r.set_session_id(id);
    r.set_n(n);
    RollbackResponse resp;
    return stub->Rollback(&ctx, r, &resp).error_code();
  };
  CHECK(rollback(s, -1) == C::INVALID_ARGUMENT);
  CHECK(rollback(s, 1) == C::OUT_OF_RANGE);  // the session is empty: nothing was appended by the failures
  CHECK(rollback(busy, 1) == C::FAILED_PRECONDITION);
  CHECK(rollback("nope", 1) == C::NOT_FOUND);
  {
    grpc::ClientContext ctx;
    DetokenizeRequest d;
    d.add_ids(1 << 30);
    DetokenizeResponse r;
    CHECK(stub->Detokenize(&ctx, d, &r).error_code() == C::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    CreateSessionRequest c;
    c.mutable_sampling()->set_top_p(0);
    CreateSessionResponse r;
    CHECK(stub->CreateSession(&ctx, c, &r).error_code() == C::INVALID_ARGUMENT);
  }
  create(*stub);
  create(*stub);  // four sessions: the limit
  {
    grpc::ClientContext ctx;
    CreateSessionResponse r;
    CHECK(stub->CreateSession(&ctx, CreateSessionRequest(), &r).error_code() == C::RESOURCE_EXHAUSTED);
  }
  // Throughout, the long stream went on and ends normally; the failed requests left s as it was.
  int n = 1;
  for (GenerateResponse r; long_stream->Read(&r);) n += r.finished() ? 0 : 1;
  CHECK(long_stream->Finish().ok());
  CHECK(n == 64);
  CHECK(info(*stub, s).length() == 0);
  Streamed ok = generate(*stub, greedy(s, {128000, 9906}, 3));
  CHECK(ok.status.ok());
  CHECK(ok.tokens.size() == 3);
  CHECK(server.stop() == 0);
}

TEST_CASE("a deadline stops the generation and the session keeps what was generated", "[server]") {
  ServerProcess server({"--metrics-listen", "127.0.0.1:0"});
  auto stub = server.stub();
  const std::string s = create(*stub);
  Streamed r = generate(*stub, greedy(s, {128000, 9906}, 1000), std::chrono::milliseconds(400));
  CHECK(r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  SessionInfo i;
  for (int tries = 0; tries < 100; ++tries) {  // the engine sees the cancellation at its next step
    i = info(*stub, s);
    if (!i.generating()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK_FALSE(i.generating());
  CHECK(i.length() >= 2 + static_cast<int64_t>(r.tokens.size()));
  CHECK(i.length() < 2 + 1000);
  // The session goes on.
  CHECK(generate(*stub, greedy(s, {}, 2)).tokens.size() == 2);
  // The cancelled Generate is counted as its stream finishes (on the engine's last event for it),
  // which can come just after the session shows it stopped generating: the scrape waits a while.
  // (Seen once in the fresh root: the counter was not yet there.)
  const std::string counter = "combs_requests_total{method=\"Generate\",code=\"DEADLINE_EXCEEDED\"}";
  double deadline_exceeded = -1;
  std::string scrape;
  for (int tries = 0; tries < 100 && deadline_exceeded < 1; ++tries) {
    if (tries > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    scrape = http_get(server.metrics_address, "/metrics");
    deadline_exceeded = metric(scrape, counter);
  }
  INFO(scrape);  // on failure: which code the call was counted under
  CHECK(deadline_exceeded == 1);
  CHECK(server.stop() == 0);
}

TEST_CASE("metrics are served over http at /metrics", "[server]") {
  ServerProcess server({"--metrics-listen", "127.0.0.1:0"});
  REQUIRE(!server.metrics_address.empty());
  auto stub = server.stub();
  const std::string s = create(*stub);
  REQUIRE(generate(*stub, greedy(s, {128000, 9906, 1917}, 5)).status.ok());
  REQUIRE(generate(*stub, greedy(s, {42}, 7)).status.ok());
  CHECK(generate(*stub, greedy("unknown", {1}, 1)).status.error_code() == grpc::StatusCode::NOT_FOUND);

  const std::string resp = http_get(server.metrics_address, "/metrics");
  REQUIRE(resp.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(resp.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  const std::string m = resp.substr(resp.find("\r\n\r\n") + 3);
  CHECK(metric(m, "combs_requests_total{method=\"CreateSession\",code=\"OK\"}") == 1);
  CHECK(metric(m, "combs_requests_total{method=\"Generate\",code=\"OK\"}") == 2);
  CHECK(metric(m, "combs_requests_total{method=\"Generate\",code=\"NOT_FOUND\"}") == 1);
  CHECK(metric(m, "combs_input_tokens_total") == 4);
  CHECK(metric(m, "combs_output_tokens_total") == 12);
  CHECK(metric(m, "combs_time_to_first_token_seconds_count") == 2);
  CHECK(metric(m, "combs_inter_token_latency_seconds_count") == 10);
  CHECK(metric(m, "combs_time_to_first_token_seconds_bucket{le=\"+Inf\"}") == 2);
  CHECK(metric(m, "combs_sessions") == 1);
  CHECK(metric(m, "combs_kv_pages_used") == 1);  // 16 tokens: one page
  CHECK(metric(m, "combs_kv_pages_used") + metric(m, "combs_kv_pages_free") == metric(m, "combs_kv_pages_total"));
  CHECK(metric(m, "combs_requests_generating") == 0);
  CHECK(metric(m, "combs_queue_depth") == 0);
  CHECK(metric(m, "combs_batch_sequences") >= 0);
  CHECK(metric(m, "combs_forward_tokens_total") == 15);  // 16 positions, the last one not yet computed
  CHECK(m.find("# TYPE combs_inter_token_latency_seconds histogram") != std::string::npos);

  CHECK(http_get(server.metrics_address, "/other").rfind("HTTP/1.1 404", 0) == 0);
  CHECK(http_get(server.metrics_address, "/metrics", "POST").rfind("HTTP/1.1 405", 0) == 0);
  CHECK(http_get(server.metrics_address, "/metrics", "GARBAGE\r\n").rfind("HTTP/1.1 400", 0) == 0);
  CHECK(server.stop() == 0);
}

TEST_CASE("flags come from the command line or a config file and bad ones are refused", "[server]") {
  const std::string bin = COMBS_SERVER_BIN;
  auto [help_code, help] = run_command(bin + " --help");
  CHECK(help_code == 0);
  for (const char* flag : {"--config", "--model", "--listen", "--metrics-listen", "--max-new-tokens", "--api-keys",
                           "--tls-cert", "--grace-s", "--log-format"}) {
    INFO(flag);
    CHECK(help.find(flag) != std::string::npos);
  }
  auto [bad_code, bad] = run_command(bin + " --log-format xml --listen 127.0.0.1:0");
  CHECK(bad_code == 2);
  CHECK(bad.find("--log-format") != std::string::npos);
  CHECK(run_command(bin + " --max-new-tokens -5").first == 2);
  auto [fraction_code, fraction] = run_command(bin + " --kv-memory-fraction 1.5");
  CHECK(fraction_code == 2);
  CHECK(fraction.find("--kv-memory-fraction") != std::string::npos);
  CHECK(run_command(bin + " --no-such-flag 1").first == 2);
  for (const char* device : {"cuda:", "cuda:0,", "cuda:a", "cudax", "tpu", "cuda:0,,1"}) {
    INFO(device);
    auto [code, out] = run_command(bin + " --device " + device);
    CHECK(code == 2);
    CHECK(out.find(std::string("--device ") + device) != std::string::npos);
  }

  combs::testing::TempDir dir;
  const std::string cfg = dir.file("combs.conf");
  {
    std::FILE* f = std::fopen(cfg.c_str(), "w");
    std::fputs("# combs-server configuration\nmax-new-tokens = 8\nlog-format = \"json\"\n\nmetrics-listen=127.0.0.1:0\n", f);
    std::fclose(f);
  }
  {
    ServerProcess server({"--config", cfg, "--max-new-tokens", "9"});  // the command line wins
    auto stub = server.stub();
    const std::string s = create(*stub);
    CHECK(generate(*stub, greedy(s, {1}, 9)).status.ok());
    CHECK(generate(*stub, greedy(s, {1}, 10)).status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(!server.metrics_address.empty());
    CHECK(server.stop() == 0);
    const std::string logs = server.logs();
    CHECK(logs.find(R"("level":"info","event":"rpc","method":"Generate")") != std::string::npos);
  }
  {
    std::FILE* f = std::fopen(cfg.c_str(), "w");
    std::fputs("listen = 127.0.0.1:0\nmax-new-tokenz = 8\n", f);
    std::fclose(f);
  }
  auto [cfg_code, cfg_out] = run_command(bin + " --config " + cfg);
  CHECK(cfg_code == 2);
  CHECK(cfg_out.find("combs.conf:2: unknown flag 'max-new-tokenz'") != std::string::npos);
  CHECK(run_command(bin + " --config " + dir.file("missing.conf")).first == 2);
}

namespace {
int n_vocab(const ServerProcess& server) {
  auto stub = server.stub();
  grpc::ClientContext ctx;
  ModelInfo m;
  REQUIRE(stub->GetModelInfo(&ctx, GetModelInfoRequest(), &m).ok());
  return m.n_vocab();
}
}  // namespace

TEST_CASE("the default vocabulary is found beside the binary in the build tree and in an installed prefix", "[server]") {
  {  // build/<preset>/bin/combs-server finds build/<preset>/share/combs/ggml-vocab-llama-bpe.gguf
    ServerProcess server({}, /*test_vocab=*/false);
    CHECK(n_vocab(server) == 128256);
    grpc::ClientContext ctx;
    ModelInfo m;
    REQUIRE(server.stub()->GetModelInfo(&ctx, GetModelInfoRequest(), &m).ok());
    // Llama 3's ends of generation, as llama.cpp derives them: <|end_of_text|>, <|eot_id|>.
    CHECK(std::vector<int32_t>(m.eog_ids().begin(), m.eog_ids().end()) == std::vector<int32_t>{128001, 128009});
    CHECK(server.stop() == 0);
  }
  // An installed layout elsewhere: PREFIX/bin/combs-server with PREFIX/share/combs, as cmake --install
  // lays it out; nothing of the source or build tree is read.
  namespace fs = std::filesystem;
  combs::testing::TempDir prefix;
  fs::create_directories(prefix.file("bin"));
  fs::create_directories(prefix.file("share/combs"));
  fs::copy_file(COMBS_SERVER_BIN, prefix.file("bin/combs-server"));
  fs::copy_file(std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf",
                prefix.file("share/combs/ggml-vocab-llama-bpe.gguf"));
  {
    ServerProcess server({}, false, prefix.file("bin/combs-server"));
    CHECK(n_vocab(server) == 128256);
    CHECK(server.stop() == 0);
  }
  {  // without it: the built-in byte-level vocabulary, and a warning that says why
    fs::remove(prefix.file("share/combs/ggml-vocab-llama-bpe.gguf"));
    ServerProcess server({}, false, prefix.file("bin/combs-server"));
    CHECK(n_vocab(server) == 259);
    CHECK(server.stop() == 0);
    CHECK(server.logs().find("event=no_default_vocabulary") != std::string::npos);
  }
  {  // --vocab none asks for the built-in one (no warning)
    ServerProcess server({"--vocab", "none"}, false);
    CHECK(n_vocab(server) == 259);
    CHECK(server.stop() == 0);
    CHECK(server.logs().find("no_default_vocabulary") == std::string::npos);
  }
  auto [code, out] = run_command(std::string(COMBS_SERVER_BIN) + " --cache-dir " + prefix.file("c") +
                                 " --vocab " + prefix.file("missing.gguf"));
  CHECK(code == 2);
  CHECK(out.find("missing.gguf: no such file") != std::string::npos);
}

TEST_CASE("a block-quantized model serves sessions: generate and rollback and its type mix", "[server][quant]") {
  ServerProcess server({"--model", std::string(COMBS_TEST_DATA_DIR) + "/models/tiny-mix-a.gguf"}, false);
  auto stub = server.stub();
  {
    grpc::ClientContext ctx;
    ModelInfo m;
    REQUIRE(stub->GetModelInfo(&ctx, GetModelInfoRequest(), &m).ok());
    std::map<std::string, int> tensors;
    for (const auto& t : m.tensor_types()) tensors[t.dtype()] = t.tensors();
    CHECK(tensors.size() == 10);  // f32 norms and nine block types (tests/data/models/README.md)
    CHECK(tensors["q6_k"] == 1);   // output.weight
    CHECK(tensors["q2_k"] == 2);   // ffn_gate of both layers
  }
  const std::string s = create(*stub);
  Streamed first = generate(*stub, greedy(s, {1, 5, 9, 200, 17}, 12));
  REQUIRE(first.status.ok());
  REQUIRE(first.tokens.size() == 12);
  // Rolled back by 6 and generated again: the same 6 tokens (greedy).
  {
    grpc::ClientContext ctx;
    RollbackRequest r;
    r.set_session_id(s);
    r.set_n(6);
    RollbackResponse out;
    REQUIRE(stub->Rollback(&ctx, r, &out).ok());
    CHECK(out.length() == 5 + 6);
  }
  GenerateRequest again = greedy(s, {}, 6);
  Streamed replay = generate(*stub, again);
  REQUIRE(replay.status.ok());
  CHECK(replay.tokens == std::vector<int32_t>(first.tokens.begin() + 6, first.tokens.end()));
  CHECK(server.stop() == 0);
}

TEST_CASE("SIGTERM drains: health NOT_SERVING then running streams finish or end UNAVAILABLE and exit 0",
          "[server]") {
  // The long stream must outlast the grace: 2,000 tokens (the tiny model's context is 2,048) on
  // one thread would need ~900 tok/s to finish in 2 s, ~60 GB/s from one core (the tiny model
  // with Llama 3's vocabulary reads 68 MB a token). 1,000 tokens with a 3 s grace on two threads
  // finished in time on a machine at ~300 tok/s.
  ServerProcess server({"--grace-s", "2", "--threads", "1"});
  auto stub = server.stub();
  const std::string short_s = create(*stub), long_s = create(*stub);
  grpc::ClientContext short_ctx, long_ctx;
  GenerateRequest short_req = greedy(short_s, {128000, 9906}, 12), long_req = greedy(long_s, {128000, 9906}, 2000);
  auto short_stream = stub->Generate(&short_ctx, short_req);
  auto long_stream = stub->Generate(&long_ctx, long_req);
  GenerateResponse r;
  REQUIRE(long_stream->Read(&r));
  REQUIRE(short_stream->Read(&r));
  server.signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Draining: health says NOT_SERVING; new work is UNAVAILABLE; existing sessions still answer.
  auto [health_code, health] = run_command(std::string(COMBS_CLI_BIN) + " --server " + server.address + " health");
  CHECK(health_code == 1);
  CHECK(health == "NOT_SERVING\n");
  {
    grpc::ClientContext ctx;
    CreateSessionResponse c;
    CHECK(stub->CreateSession(&ctx, CreateSessionRequest(), &c).error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  int short_tokens = 1;
  for (; short_stream->Read(&r);) short_tokens += r.finished() ? 0 : 1;
  CHECK(short_stream->Finish().ok());
  CHECK(short_tokens == 12);
  while (long_stream->Read(&r)) {
  }
  const grpc::Status long_status = long_stream->Finish();
  CHECK(long_status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(server.wait() == 0);
  CHECK(server.logs().find("event=stopped streams_aborted=1") != std::string::npos);
}

TEST_CASE("every token is streamed even one that serializes to nothing", "[server]") {
  // The built-in byte-level vocabulary: token 0 is <unk>, whose text is empty, so its message
  // (token_id 0, text "") has no bytes on the wire; it must still reach the client.
  ServerProcess server({"--vocab", ""});
  auto stub = server.stub();
  const std::string s = create(*stub);
  GenerateRequest g = greedy(s, {65, 66}, 5);
  (*g.mutable_sampling()->mutable_logit_bias())[0] = 100.0f;
  Streamed r = generate(*stub, g);
  REQUIRE(r.status.ok());
  CHECK(r.tokens == std::vector<int32_t>(5, 0));
  CHECK(r.last.usage().output_tokens() == 5);
  // Stop strings end the request at the token that completes one: with the vocabulary's byte
  // tokens, bias 'x' then check that the session holds exactly up to it.
  const std::string t = create(*stub);
  GenerateRequest st = greedy(t, {65}, 20);
  (*st.mutable_sampling()->mutable_logit_bias())[static_cast<int>('x') + 3] = 100.0f;  // byte tokens start at 3
  st.add_stop("xx");
  Streamed sr = generate(*stub, st);
  REQUIRE(sr.status.ok());
  CHECK(sr.last.finish_reason() == FINISH_REASON_STOP);
  CHECK(sr.tokens.size() == 2);
  CHECK(info(*stub, t).length() == 1 + 2);
  CHECK(server.stop() == 0);
}

TEST_CASE("speculation over grpc: the tokens of a plain generate with drafted and accepted counted", "[server]") {
  // The built-in 259-token vocabulary: a random-weight model over it falls into loops within a
  // hundred or so greedy tokens, and the n-gram proposer drafts from them.
  ServerProcess server({"--metrics-listen", "127.0.0.1:0", "--vocab", "none"}, false);
  auto stub = server.stub();
  std::vector<int32_t> prompt;
  for (int r = 0; r < 3; ++r)
    for (int32_t t : {11, 40, 90, 27, 141, 59, 65, 89}) prompt.push_back(t);
  const Streamed plain = generate(*stub, greedy(create(*stub), prompt, 160));
  REQUIRE(plain.status.ok());
  GenerateRequest g = greedy(create(*stub), prompt, 160);
  g.mutable_speculation()->set_method(Speculation::METHOD_NGRAM);
  g.mutable_speculation()->set_max_draft(6);
  const Streamed spec = generate(*stub, g);
  REQUIRE(spec.status.ok());
  CHECK(spec.tokens == plain.tokens);
  CHECK(spec.last.usage().drafted_tokens() > 0);
  CHECK(spec.last.usage().accepted_tokens() <= spec.last.usage().drafted_tokens());
  CHECK(plain.last.usage().drafted_tokens() == 0);
  CHECK(info(*stub, g.session_id()).drafted_tokens() == spec.last.usage().drafted_tokens());
  // A session default, and bad values refused.
  {
    grpc::ClientContext ctx;
    CreateSessionRequest c;
    c.mutable_speculation()->set_method(Speculation::METHOD_NGRAM);
    CreateSessionResponse r;
    REQUIRE(stub->CreateSession(&ctx, c, &r).ok());
    const Streamed d = generate(*stub, greedy(r.session_id(), prompt, 160));
    REQUIRE(d.status.ok());
    CHECK(d.tokens == plain.tokens);
    CHECK(d.last.usage().drafted_tokens() > 0);
  }
  for (int bad : {17, -1}) {
    GenerateRequest b = greedy(create(*stub), prompt, 4);
    b.mutable_speculation()->set_method(Speculation::METHOD_NGRAM);
    b.mutable_speculation()->set_max_draft(bad);
    CHECK(generate(*stub, b).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  const std::string metrics = http_get(server.metrics_address, "/metrics");
  CHECK(metric(metrics, "combs_speculation_drafted_tokens_total") >= spec.last.usage().drafted_tokens());
  CHECK(server.stop() == 0);
  // The server's default for sessions that choose none (the same default model, written again).
  ServerProcess with_default({"--vocab", "none", "--speculation", "ngram", "--max-draft", "3"}, false);
  auto stub2 = with_default.stub();
  const Streamed d = generate(*stub2, greedy(create(*stub2), prompt, 160));
  REQUIRE(d.status.ok());
  CHECK(d.tokens == plain.tokens);
  CHECK(d.last.usage().drafted_tokens() > 0);
  // No draft model: a request for its drafts is refused.
  GenerateRequest nd = greedy(create(*stub2), prompt, 4);
  nd.mutable_speculation()->set_method(Speculation::METHOD_DRAFT);
  CHECK(generate(*stub2, nd).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(with_default.stop() == 0);
}

TEST_CASE("a draft model over grpc: the tokens of a plain generate, its drafts counted", "[server]") {
  // The default model's weights (tiny, seed 1, the built-in vocabulary) in Q8_0: a close draft.
  combs::testing::TempDir dir;
  combs::RandomModelOptions o;
  o.shape = std::move(combs::named_shape("tiny")).value();
  REQUIRE(combs::set_weight_type("q8_0", &o).ok());
  const std::string draft = dir.file("draft.gguf");
  REQUIRE(combs::write_random_model(o, draft).ok());
  ServerProcess server({"--metrics-listen", "127.0.0.1:0", "--vocab", "none", "--draft-model", draft}, false);
  auto stub = server.stub();
  const std::vector<int32_t> prompt = {11, 40, 90, 27, 141, 59, 65, 89};
  const Streamed plain = generate(*stub, greedy(create(*stub), prompt, 60));
  REQUIRE(plain.status.ok());
  GenerateRequest g = greedy(create(*stub), prompt, 60);
  g.mutable_speculation()->set_method(Speculation::METHOD_DRAFT);
  const Streamed spec = generate(*stub, g);
  REQUIRE(spec.status.ok());
  CHECK(spec.tokens == plain.tokens);
  CHECK(spec.last.usage().accepted_tokens() > 0);
  CHECK(info(*stub, g.session_id()).accepted_tokens() == spec.last.usage().accepted_tokens());
  const std::string metrics = http_get(server.metrics_address, "/metrics");
  CHECK(metric(metrics, "combs_draft_forwards_total") > 0);
  CHECK(server.stop() == 0);
  // A draft model of another vocabulary (Llama 3's): the server does not start, and says why; nor
  // does one asked to draft without a draft model.
  o.vocab_path = std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf";
  const std::string other = dir.file("other-vocab.gguf");
  REQUIRE(combs::write_random_model(o, other).ok());
  const std::string bin = std::string(COMBS_SERVER_BIN) + " --listen 127.0.0.1:0 --threads 2 --kv-memory-mib 64 --vocab none --cache-dir " + dir.file("cache");
  auto [code, out] = run_command(bin + " --draft-model " + other);
  CHECK(code == 1);
  CHECK_THAT(out, Catch::Contains("draft model: its vocabulary is not the target's (128256 tokens, the target 259)"));
  auto [code2, out2] = run_command(bin + " --speculation draft");
  CHECK(code2 == 2);
  CHECK_THAT(out2, Catch::Contains("--draft-model"));
}
