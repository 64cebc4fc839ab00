// combs-server as a subprocess on free loopback ports (gRPC and, when asked, metrics), with its
// stderr (the logs) in a file; stop() sends SIGTERM and returns the exit code.
#pragma once

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "combs/v1/combs.grpc.pb.h"
#include "support/temp_dir.h"

namespace combs::testing {

struct ServerProcess {
  pid_t pid = -1;
  std::string address;          // gRPC HOST:PORT
  std::string metrics_address;  // HOST:PORT of /metrics, when --metrics-listen was given
  std::string http_address;     // HOST:PORT of the OpenAI API, when --http-listen was given
  TempDir dir;

  // Extra flags after the defaults (a small pool, 2 threads, the Llama 3 vocabulary of the test
  // data: without `test_vocab`, no --vocab, so the server takes its default). `binary`: another
  // copy of combs-server (an installed layout).
  explicit ServerProcess(std::vector<std::string> extra = {}, bool test_vocab = true,
                         std::string binary = COMBS_SERVER_BIN) {
    std::vector<std::string> args = {std::move(binary), "--listen", "127.0.0.1:0", "--cache-dir", dir.file("cache"),
                                     "--threads", "2", "--kv-memory-mib", "64"};
    if (test_vocab) {
      args.insert(args.end(), {"--vocab", std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf"});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    int out[2];
    REQUIRE(pipe(out) == 0);
    const std::string log = log_path();
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      std::FILE* err = std::fopen(log.c_str(), "w");
      if (err) dup2(fileno(err), STDERR_FILENO);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    FILE* f = fdopen(out[0], "r");
    char line[512];
    // "combs-server: metrics on http://HOST:PORT/metrics" and "... OpenAI API on http://HOST:PORT/v1"
    // (optional), then "... serving X on HOST:PORT".
    while (std::fgets(line, sizeof line, f) != nullptr) {
      std::string s(line);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      if (s.find("OpenAI API on http://") != std::string::npos) {
        http_address = s.substr(s.find("http://") + 7);
        http_address = http_address.substr(0, http_address.find('/'));
      }
      if (s.find("metrics on http://") != std::string::npos) {
        metrics_address = s.substr(s.find("http://") + 7);
        metrics_address = metrics_address.substr(0, metrics_address.find('/'));
      }
      if (s.find(" serving ") != std::string::npos) {
        address = s.substr(s.rfind(" on ") + 4);
        break;
      }
    }
    std::fclose(f);
    INFO("combs-server log:\n" << logs());
    REQUIRE(!address.empty());
  }
  std::string log_path() const { return dir.file("server.log"); }
  std::string logs() const { return read_file(log_path()); }
  std::unique_ptr<v1::Combs::Stub> stub() const {
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
    return v1::Combs::NewStub(channel);
  }
  void signal(int sig) const { kill(pid, sig); }
  // Waits for the process; its exit code, or -1 when a signal killed it.
  int wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    if (WIFSIGNALED(status)) UNSCOPED_INFO("combs-server killed by signal " << WTERMSIG(status) << "; log:\n" << logs());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  int stop() {
    signal(SIGTERM);
    return wait();
  }
  ~ServerProcess() {
    if (pid > 0) stop();
  }
};

// Runs a shell command; its exit code (-1 when a signal ended it) and stdout with stderr joined in.
inline std::pair<int, std::string> run_command(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// GET path from HOST:PORT over plain HTTP/1.1; the whole response (status line, headers, body).
inline std::string http_get(const std::string& host_port, const std::string& path,
                            const std::string& method = "GET") {
  const int port = std::stoi(host_port.substr(host_port.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string resp;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    // An empty body's length said, as clients do (cpp-httplib refuses a POST without one).
    const std::string req = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" +
                            (method == "GET" ? "" : "Content-Length: 0\r\n") + "\r\n";
    (void)!write(fd, req.data(), req.size());
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return resp;
}

// A new session (REQUIREs success).
inline std::string create(v1::Combs::Stub& stub) {
  grpc::ClientContext ctx;
  v1::CreateSessionResponse r;
  REQUIRE(stub.CreateSession(&ctx, v1::CreateSessionRequest(), &r).ok());
  return r.session_id();
}

inline v1::GenerateRequest greedy(const std::string& session, std::vector<int32_t> input, int max_tokens) {
  v1::GenerateRequest g;
  g.set_session_id(session);
  for (int32_t t : input) g.mutable_tokens()->add_ids(t);
  g.set_max_tokens(max_tokens);
  g.mutable_sampling()->set_temperature(0.0f);
  g.set_ignore_eos(true);
  return g;
}

inline v1::SessionInfo info(v1::Combs::Stub& stub, const std::string& session, grpc::StatusCode* code = nullptr) {
  grpc::ClientContext ctx;
  v1::GetSessionRequest q;
  q.set_session_id(session);
  v1::SessionInfo i;
  grpc::Status s = stub.GetSession(&ctx, q, &i);
  if (code) *code = s.error_code();
  return i;
}

// A Generate stream read to its end.
struct Streamed {
  std::vector<int32_t> tokens;
  v1::GenerateResponse last;
  grpc::Status status;
};

inline Streamed generate(v1::Combs::Stub& stub, const v1::GenerateRequest& req,
                         std::chrono::milliseconds deadline = std::chrono::milliseconds(0)) {
  grpc::ClientContext ctx;
  if (deadline.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub.Generate(&ctx, req);
  Streamed out;
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    if (r.finished()) out.last = r;
    else out.tokens.push_back(r.token_id());
  }
  out.status = reader->Finish();
  return out;
}

}  // namespace combs::testing
