// combs-server: serves combs.v1.Combs (plus grpc.health.v1.Health and server reflection) over gRPC
// for one model. Without --model it writes (once) a small random-weight model into --cache-dir and
// serves that: with the vocabulary of --vocab (by default the Llama 3 vocabulary of the source
// tree, where it exists), else the built-in byte-level one.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <thread>

#include "combs/engine/engine.h"
#include "combs/model/random_model.h"
#include "combs/server/combs_service.h"
#include "common/flags.h"

namespace {
volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }
}  // namespace

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-server",
                     {{"model", ""}, {"listen", "127.0.0.1:50051"}, {"threads", "0"},
                      {"kv-memory-mib", "1024"}, {"max-sessions", "1024"}, {"session-ttl-s", "1800"},
                      {"cache-dir", ""}, {"grace-s", "10"}, {"vocab", COMBS_DEFAULT_VOCAB}, {"api-keys", ""},
                      {"tls-cert", ""}, {"tls-key", ""}});
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[--model PATH] [--listen HOST:PORT] [flags]");
    return 0;
  }
  long long threads, kv_mib, max_sessions, ttl, grace;
  if (!flags.integer("threads", &threads, 0, 1024) || !flags.integer("kv-memory-mib", &kv_mib, 1, 1 << 24) ||
      !flags.integer("max-sessions", &max_sessions, 1, 1 << 24) || !flags.integer("session-ttl-s", &ttl, 1, 1ll << 31) ||
      !flags.integer("grace-s", &grace, 0, 3600)) {
    return 2;
  }
  std::string path = flags.str("model");
  if (path.empty()) {
    std::string dir = flags.str("cache-dir");
    if (dir.empty()) {
      const char* home = std::getenv("HOME");
      dir = std::string(home ? home : "/tmp") + "/.cache/combs";
    }
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::string vocab = flags.str("vocab");
    if (!vocab.empty() && !std::filesystem::exists(vocab)) {
      if (flags.given("vocab")) return std::fprintf(stderr, "combs-server: --vocab %s: no such file\n", vocab.c_str()), 2;
      vocab.clear();  // the built-in default is not there (an installed binary): byte-level vocabulary
    }
    path = dir + "/default-tiny" + (vocab.empty() ? "" : "-" + std::filesystem::path(vocab).stem().string()) + ".gguf";
    if (!std::filesystem::exists(path)) {
      RandomModelOptions o;
      o.shape = std::move(named_shape("tiny")).value();
      o.vocab_path = vocab;
      if (Status s = write_random_model(o, path + ".tmp"); !s.ok()) {
        return std::fprintf(stderr, "combs-server: %s\n", s.to_string().c_str()), 1;
      }
      std::filesystem::rename(path + ".tmp", path, ec);
    }
  }
  auto model = Model::load(path);
  if (!model.ok()) return std::fprintf(stderr, "combs-server: %s\n", model.status().to_string().c_str()), 1;
  std::unique_ptr<Tokenizer> tokenizer;
  if (auto t = Tokenizer::from_gguf((*model)->file()); t.ok() && (*t)->n_vocab() == (*model)->config().n_vocab) {
    tokenizer = std::move(t).value();
  }
  EngineOptions eo;
  eo.threads = static_cast<int>(threads);
  eo.kv_memory_bytes = kv_mib << 20;
  eo.max_sessions = static_cast<int>(max_sessions);
  eo.session_ttl = std::chrono::seconds(ttl);
  auto engine = Engine::create(std::move(model).value(), eo);
  if (!engine.ok()) return std::fprintf(stderr, "combs-server: %s\n", engine.status().to_string().c_str()), 1;

  // API keys: one a line ('#' comments and blank lines ignored); none: no authentication.
  std::set<std::string> keys;
  if (!flags.str("api-keys").empty()) {
    std::ifstream f(flags.str("api-keys"));
    if (!f) return std::fprintf(stderr, "combs-server: --api-keys %s: cannot read\n", flags.str("api-keys").c_str()), 2;
    for (std::string line; std::getline(f, line);) {
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      if (!line.empty() && line[0] != '#') keys.insert(line);
    }
    if (keys.empty()) return std::fprintf(stderr, "combs-server: --api-keys %s holds no key\n", flags.str("api-keys").c_str()), 2;
  }
  server::CombsService service(**engine, tokenizer.get(), std::move(keys));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // TLS: a certificate chain and its private key (PEM), both or neither.
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (flags.given("tls-cert") != flags.given("tls-key")) {
    return std::fprintf(stderr, "combs-server: --tls-cert and --tls-key go together\n"), 2;
  }
  if (flags.given("tls-cert")) {
    auto slurp = [](const std::string& path, std::string* out) {
      std::ifstream f(path, std::ios::binary);
      if (!f) return false;
      out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      return !out->empty();
    };
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    if (!slurp(flags.str("tls-cert"), &pair.cert_chain) || !slurp(flags.str("tls-key"), &pair.private_key)) {
      return std::fprintf(stderr, "combs-server: cannot read --tls-cert / --tls-key\n"), 2;
    }
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    creds = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.str("listen"), creds, &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> srv = builder.BuildAndStart();
  if (!srv || port == 0) return std::fprintf(stderr, "combs-server: cannot listen on %s\n", flags.str("listen").c_str()), 1;
  const std::string host = flags.str("listen").substr(0, flags.str("listen").rfind(':'));
  std::printf("combs-server: serving %s on %s:%d\n", path.c_str(), host.c_str(), port);
  std::fflush(stdout);

  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  while (g_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Graceful: health NOT_SERVING, no new calls, in-flight ones get the grace period.
  srv->GetHealthCheckService()->SetServingStatus(false);
  srv->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(grace));
  std::fprintf(stderr, "combs-server: stopped\n");
  return 0;
}
