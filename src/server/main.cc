// combs-server: serves combs.v1.Combs (plus grpc.health.v1.Health and server reflection) over gRPC
// for one model. Without --model it writes (once) a small random-weight model into --cache-dir and
// serves that: with the vocabulary of --vocab (by default Llama 3's, installed beside the binary in
// share/combs), or the built-in byte-level one (--vocab none).
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <future>
#include <thread>

#include "combs/engine/engine.h"
#include "combs/engine/sqlite_journal.h"
#ifdef COMBS_HAVE_CUDA
#include "combs/model/cuda_runner.h"
#include "combs/model/tensor_parallel_runner.h"
#endif
#include "combs/model/random_model.h"
#include "combs_service.h"
#include "common/data_files.h"
#include "common/files.h"
#include "common/flags.h"
#include "http_server.h"
#include "log.h"
#include "metrics.h"
#include "openai_api.h"

namespace {
volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }
}  // namespace

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-server",
                     {{"config", ""}, {"model", ""}, {"listen", "127.0.0.1:50051"}, {"metrics-listen", ""}, {"http-listen", ""}, {"http-threads", "64"}, {"http-keepalive-ms", "1000"}, {"max-body-bytes", "8388608"}, {"model-name", ""},
                      {"threads", "0"}, {"kv-memory-mib", "0"}, {"kv-memory-fraction", "0.85"}, {"host-kv-memory-mib", "0"}, {"host-kv-restore", "auto"}, {"queue-timeout-s", "0"}, {"speculation", "off"}, {"max-draft", "4"}, {"draft-model", ""}, {"draft-kv-memory-mib", "256"}, {"max-sessions", "1024"}, {"max-context", "0"},
                      {"max-input-tokens", "0"}, {"max-new-tokens", "4096"}, {"max-message-bytes", "4194304"},
                      {"session-ttl-s", "1800"}, {"cache-dir", ""}, {"grace-s", "10"}, {"vocab", tools::default_vocab()}, {"chat-template", ""},
                      {"api-keys", ""}, {"prefix-cache", "on"}, {"window-release", "on"}, {"window-rollback", "128"}, {"state-dir", ""}, {"durability", "full"}, {"journal-flush-ms", "200"}, {"prefix-cache-sharing", "key"}, {"tls-cert", ""}, {"tls-key", ""}, {"log-format", "text"}, {"log-level", "info"}, {"device", "auto"}},
                     {"drop-foreign-sessions"});
  flags.describe({
      {"config", "config file of 'name = value' lines (the flags below without --); the command line wins"},
      {"model", "GGUF model to serve; none: a small random-weight model written once into --cache-dir"},
      {"listen", "gRPC address HOST:PORT (port 0: any free port, printed at start)"},
      {"metrics-listen", "Prometheus endpoint HOST:PORT serving GET /metrics; none: no metrics endpoint"},
      {"http-listen", "OpenAI-compatible HTTP API HOST:PORT (/v1/chat/completions, /v1/completions, /v1/models; also GET /metrics); none: off"},
      {"http-threads", "HTTP requests served at once (a streaming one holds its thread; completions beyond all but two: 429)"},
      {"http-keepalive-ms", "HTTP API: an idle stream sends a comment, a waiting completion a space, this often (finds clients that left)"},
      {"max-body-bytes", "largest HTTP request body accepted (413 beyond)"},
      {"model-name", "the model's name in the HTTP API (default: the model file's name without .gguf)"},
      {"threads", "CPU threads; 0: all cores"},
      {"kv-memory-mib", "KV cache page pool budget (MiB); 0: 1024 on the CPU, --kv-memory-fraction on a GPU"},
      {"kv-memory-fraction", "on a GPU without --kv-memory-mib: this fraction of the memory free after the weights"},
      {"host-kv-memory-mib", "host tier (MiB of pinned host memory): idle sessions' and preempted requests' KV pages move there under pressure and are copied back; 0: none (they are dropped and prefilled again)"},
      {"host-kv-restore", "auto: keep the host tier only where copying a page back is measured (at start) to cost less than computing it; copy: always"},
      {"queue-timeout-s", "a request waiting this long without room to run ends RESOURCE_EXHAUSTED; 0: it waits as long as it takes"},
      {"speculation", "speculative decoding of sessions that choose none: off, ngram (prompt lookup drafts) or draft (--draft-model's); drafts are verified in one forward: greedy output unchanged on the CPU, within the kernels' rounding on a GPU"},
      {"max-draft", "--speculation: tokens drafted per step at most (1 to 16; fewer while drafts are rejected)"},
      {"draft-model", "a GGUF of the model's vocabulary whose greedy continuation is drafted (speculation method draft; refused at start for another vocabulary)"},
      {"draft-kv-memory-mib", "--draft-model: memory for its per-session draft caches (least recently used dropped when full)"},
      {"max-sessions", "open sessions at most"},
      {"max-context", "tokens per session at most; 0: the model's context length"},
      {"max-input-tokens", "input tokens per Generate request at most; 0: up to the session's context"},
      {"max-new-tokens", "max_tokens per Generate request at most"},
      {"max-message-bytes", "largest gRPC request message accepted"},
      {"session-ttl-s", "idle sessions expire after this many seconds"},
      {"cache-dir", "where the default model is written; default ~/.cache/combs"},
      {"grace-s", "on SIGTERM/SIGINT, running streams get this long to finish, then end UNAVAILABLE"},
      {"vocab", "vocabulary GGUF of the default model (default: Llama 3's, from share/combs beside the binary); none or empty: a built-in byte-level vocabulary"},
      {"chat-template", "Jinja chat template for Chat (default: the model's tokenizer.chat_template; the default model carries Llama 3's)"},
      {"api-keys", "file of API keys, one a line; callers send 'authorization: Bearer <key>'"},
      {"prefix-cache", "on: sessions whose histories begin alike share the KV pages of the common prefix; off: never"},
      {"window-release", "on: where every layer of the model attends through a sliding window, sessions give back the KV pages behind it; off: they keep them"},
      {"window-rollback", "positions kept behind a sliding window so that a rollback of up to this many tokens needs no rebuild (with --window-release on)"},
      {"state-dir", "journal every session change in DIR/sessions.db (SQLite) and restore the sessions at start; none: sessions live in memory only"},
      {"durability", "full: a finished request's tokens survive a process or machine crash (fsync per commit); fast: a process crash loses nothing, a machine crash at most --journal-flush-ms"},
      {"journal-flush-ms", "--durability fast: how often the journal is synced to disk"},
      {"drop-foreign-sessions", "a --state-dir journal written for another model: delete its sessions (else refuse to start)"},
      {"prefix-cache-sharing", "key: cached prefixes serve only sessions of the API key that made them; all: every key's"},
      {"tls-cert", "PEM certificate chain (with --tls-key: serve TLS)"},
      {"tls-key", "PEM private key of --tls-cert"},
      {"log-format", "text (key=value) or json"},
      {"log-level", "trace, debug, info, warn, error or off"},
      {"device", "cpu, cuda, cuda:N, cuda:N,M,... (tensor parallelism over those GPUs, NCCL), or auto (the first GPU where there is one, else the CPU)"},
  });
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[--config FILE] [--model PATH] [--listen HOST:PORT] [--metrics-listen HOST:PORT] [flags]");
    return 0;
  }
  if (flags.given("config") && !flags.load_config(flags.str("config"))) return 2;
  long long http_threads, max_body, keepalive_ms;
  if (!flags.integer("http-threads", &http_threads, 3, 4096) || !flags.integer("max-body-bytes", &max_body, 1024, 1ll << 32) ||
      !flags.integer("http-keepalive-ms", &keepalive_ms, 10, 60000)) {
    return 2;
  }
  long long threads, kv_mib, host_kv_mib, queue_timeout, max_sessions, ttl, grace, max_context, max_input, max_new, max_message;
  if (!flags.integer("threads", &threads, 0, 1024) || !flags.integer("kv-memory-mib", &kv_mib, 0, 1 << 24) ||
      !flags.integer("host-kv-memory-mib", &host_kv_mib, 0, 1 << 24) || !flags.integer("queue-timeout-s", &queue_timeout, 0, 1ll << 31) ||
      !flags.integer("max-sessions", &max_sessions, 1, 1 << 24) || !flags.integer("session-ttl-s", &ttl, 1, 1ll << 31) ||
      !flags.integer("grace-s", &grace, 0, 3600) || !flags.integer("max-context", &max_context, 0, 1ll << 31) ||
      !flags.integer("max-input-tokens", &max_input, 0, 1ll << 31) ||
      !flags.integer("max-new-tokens", &max_new, 1, 1 << 30) ||
      !flags.integer("max-message-bytes", &max_message, 1024, 1 << 30)) {
    return 2;
  }
  if (Status s = server::init_logging(flags.str("log-format"), flags.str("log-level")); !s.ok()) {
    return std::fprintf(stderr, "combs-server: %s\n", s.message().c_str()), 2;
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
    std::string vocab = flags.str("vocab") == "none" ? "" : flags.str("vocab");
    if (!vocab.empty() && !std::filesystem::is_regular_file(vocab, ec)) {
      return std::fprintf(stderr, "combs-server: --vocab %s: no such file\n", vocab.c_str()), 2;
    }
    if (vocab.empty() && !flags.given("vocab")) {
      server::LogLine("no_default_vocabulary")
          .add("detail", "share/combs/ggml-vocab-llama-bpe.gguf is not beside the binary: the default model gets the "
                         "built-in byte-level vocabulary")
          .warn();
    }
    // With Llama 3's vocabulary the default model carries Llama 3's chat template (installed
    // beside the vocabulary), so Chat works out of the box.
    RandomModelOptions o;
    const std::string chat = tools::default_chat_template();
    if (!vocab.empty() && std::filesystem::path(vocab).filename() == "ggml-vocab-llama-bpe.gguf" && !chat.empty()) {
      tools::read_file(chat, &o.chat_template);
    }
    path = dir + "/default-tiny" + (vocab.empty() ? "" : "-" + std::filesystem::path(vocab).stem().string()) +
           (o.chat_template.empty() ? "" : "-chat") + ".gguf";
    o.shape = std::move(named_shape("tiny")).value();
    o.vocab_path = vocab;
    if (Status s = write_random_model_once(o, path); !s.ok()) {
      return std::fprintf(stderr, "combs-server: %s\n", s.to_string().c_str()), 1;
    }
  }
  auto model = Model::load(path);
  if (!model.ok()) return std::fprintf(stderr, "combs-server: %s\n", model.status().to_string().c_str()), 1;
  std::unique_ptr<Tokenizer> tokenizer;
  if (auto t = Tokenizer::from_gguf((*model)->file()); t.ok() && (*t)->n_vocab() == (*model)->config().n_vocab) {
    tokenizer = std::move(t).value();
  }
  EngineOptions eo;
  if (flags.given("chat-template")) {
    auto source = tools::read_chat_template(flags.str("chat-template"));
    if (!source.ok()) return std::fprintf(stderr, "combs-server: --chat-template %s\n", source.status().message().c_str()), 2;
    eo.chat_template = std::move(source).value();
  }
  // The device: the engine's runner (and so its KV pages) lives there.
  std::string device = flags.str("device");
#ifdef COMBS_HAVE_CUDA
  if (device == "auto") device = CudaBackend::device_count() > 0 ? "cuda" : "cpu";
  if (device.rfind("cuda", 0) == 0) {
    // cuda, cuda:N, or cuda:N,M,...: tensor parallelism over those GPUs (NCCL).
    std::vector<int> indices;
    bool good = device.size() == 4 || device[4] == ':';
    for (size_t at = 5; good && at <= device.size() && device.size() > 4;) {
      const size_t comma = std::min(device.find(',', at), device.size());
      const std::string part = device.substr(at, comma - at);
      good = !part.empty() && part.size() <= 3 && part.find_first_not_of("0123456789") == std::string::npos;
      if (good) indices.push_back(std::stoi(part));
      at = comma + 1;
    }
    if (!good) {
      return std::fprintf(stderr, "combs-server: --device %s: expected cpu, cuda, cuda:N, cuda:N,M,... or auto\n",
                          device.c_str()), 2;
    }
    if (indices.size() > 1) {
      eo.make_runner = make_tensor_parallel_runner(indices);
    } else {
      eo.make_runner = make_cuda_runner(indices.empty() ? 0 : indices[0]);
    }
  } else if (device != "cpu") {
    return std::fprintf(stderr, "combs-server: --device %s: expected cpu, cuda, cuda:N, cuda:N,M,... or auto\n",
                        device.c_str()), 2;
  }
#else
  if (device == "auto") device = "cpu";
  if (device != "cpu") {
    return std::fprintf(stderr, "combs-server: --device %s: this build has no CUDA backend (cpu only)\n", device.c_str()), 2;
  }
#endif
  eo.threads = static_cast<int>(threads);
  eo.kv_memory_bytes = (kv_mib > 0 ? kv_mib : 1024) << 20;
  if (kv_mib == 0) {
    double fraction = 0;
    if (!flags.number("kv-memory-fraction", &fraction)) return 2;
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      return std::fprintf(stderr, "combs-server: --kv-memory-fraction %g: expected a fraction in (0, 1]\n", fraction), 2;
    }
    eo.kv_memory_fraction = fraction;  // used where the device reports free memory (a GPU)
  }
  eo.host_kv_memory_bytes = host_kv_mib << 20;
  if (flags.str("host-kv-restore") != "auto" && flags.str("host-kv-restore") != "copy") {
    return std::fprintf(stderr, "combs-server: --host-kv-restore %s: expected auto or copy\n", flags.str("host-kv-restore").c_str()), 2;
  }
  eo.host_kv_restore = flags.str("host-kv-restore") == "copy" ? EngineOptions::HostRestore::kCopy : EngineOptions::HostRestore::kAuto;
  eo.queue_timeout = std::chrono::seconds(queue_timeout);
  const std::string method = flags.str("speculation");
  if (method != "off" && method != "ngram" && method != "draft") {
    return std::fprintf(stderr, "combs-server: --speculation %s: expected off, ngram or draft\n", method.c_str()), 2;
  }
  long long max_draft;
  if (!flags.integer("max-draft", &max_draft, 1, 16)) return 2;
  eo.speculation.method = method == "ngram"   ? SpeculationParams::Method::kNgram
                          : method == "draft" ? SpeculationParams::Method::kDraft
                                              : SpeculationParams::Method::kOff;
  eo.speculation.max_draft = static_cast<int>(max_draft);
  if (!flags.str("draft-model").empty()) {
    auto draft = Model::load(flags.str("draft-model"));
    if (!draft.ok()) return std::fprintf(stderr, "combs-server: --draft-model: %s\n", draft.status().to_string().c_str()), 1;
    eo.draft_model = std::shared_ptr<const Model>(std::move(draft).value());
    long long draft_kv_mib;
    if (!flags.integer("draft-kv-memory-mib", &draft_kv_mib, 1, int64_t{1} << 30)) return 2;
    eo.draft_kv_memory_bytes = static_cast<int64_t>(draft_kv_mib) << 20;
  } else if (method == "draft") {
    return std::fprintf(stderr, "combs-server: --speculation draft needs --draft-model FILE\n"), 2;
  }
  eo.max_sessions = static_cast<int>(max_sessions);
  eo.session_ttl = std::chrono::seconds(ttl);
  eo.max_context = max_context;
  eo.max_tokens_per_request = static_cast<int>(max_new);
  if (flags.str("prefix-cache") != "on" && flags.str("prefix-cache") != "off") {
    return std::fprintf(stderr, "combs-server: --prefix-cache %s: expected on or off\n", flags.str("prefix-cache").c_str()), 2;
  }
  eo.prefix_cache = flags.str("prefix-cache") == "on";
  if (flags.str("window-release") != "on" && flags.str("window-release") != "off") {
    return std::fprintf(stderr, "combs-server: --window-release %s: expected on or off\n", flags.str("window-release").c_str()), 2;
  }
  eo.release_behind_window = flags.str("window-release") == "on";
  long long window_rollback;
  if (!flags.integer("window-rollback", &window_rollback, 0, 1ll << 31)) return 2;
  eo.window_rollback = window_rollback;
  if (flags.str("prefix-cache-sharing") != "key" && flags.str("prefix-cache-sharing") != "all") {
    return std::fprintf(stderr, "combs-server: --prefix-cache-sharing %s: expected key or all\n",
                        flags.str("prefix-cache-sharing").c_str()),
           2;
  }
  const bool share_prefixes = flags.str("prefix-cache-sharing") == "all";
  // The journal: every session change recorded off the scheduler thread; at start, its sessions.
  std::unique_ptr<SqliteJournal> journal;
  if (!flags.str("state-dir").empty()) {
    SqliteJournalOptions jo;
    jo.dir = flags.str("state-dir");
    jo.model_fingerprint = to_hex((*model)->file().fingerprint());
    if (flags.str("durability") != "full" && flags.str("durability") != "fast") {
      return std::fprintf(stderr, "combs-server: --durability %s: expected full or fast\n", flags.str("durability").c_str()), 2;
    }
    jo.durability = flags.str("durability") == "full" ? SqliteJournalOptions::Durability::kFull : SqliteJournalOptions::Durability::kFast;
    long long flush_ms;
    if (!flags.integer("journal-flush-ms", &flush_ms, 1, 60000)) return 2;
    jo.flush_ms = static_cast<int>(flush_ms);
    jo.drop_foreign = flags.on("drop-foreign-sessions");
    auto j = SqliteJournal::open(jo, &eo.restore);
    if (!j.ok()) return std::fprintf(stderr, "combs-server: %s\n", j.status().message().c_str()), 1;
    journal = std::move(j).value();
    eo.journal = journal.get();
  }
  const size_t restored = eo.restore.size();
  auto engine = Engine::create(std::move(model).value(), eo);
  if (!engine.ok()) return std::fprintf(stderr, "combs-server: %s\n", engine.status().to_string().c_str()), 1;

  // API keys: one a line ('#' comments and blank lines ignored); none: no authentication.
  server::ApiKeys keys;
  if (!flags.str("api-keys").empty()) {
    auto loaded = server::ApiKeys::load(flags.str("api-keys"), share_prefixes);
    if (!loaded.ok()) return std::fprintf(stderr, "combs-server: %s\n", loaded.status().message().c_str()), 2;
    keys = std::move(loaded).value();
  }
  Engine& eng = **engine;
  server::Metrics metrics([&eng] { return eng.stats(); });
  server::ServiceOptions so;
  const bool auth = keys.enabled();
  so.api_keys = keys;
  so.max_input_tokens = max_input;
  so.metrics = &metrics;
  server::CombsService service(eng, tokenizer.get(), std::move(so));
  server::HttpServerOptions ho;
  ho.threads = static_cast<int>(http_threads);
  ho.max_body_bytes = static_cast<size_t>(max_body);
  std::unique_ptr<server::HttpServer> metrics_http;
  auto render_metrics = [&metrics] { return metrics.render(); };
  if (!flags.str("metrics-listen").empty()) {
    auto h = server::HttpServer::start(flags.str("metrics-listen"), ho,
                                       [&](httplib::Server& s) { server::add_metrics_routes(s, render_metrics); });
    if (!h.ok()) return std::fprintf(stderr, "combs-server: --metrics-listen: %s\n", h.status().message().c_str()), 1;
    metrics_http = std::move(h).value();
    std::printf("combs-server: metrics on http://%s:%d/metrics\n", metrics_http->host().c_str(), metrics_http->port());
  }
  server::OpenAiOptions oo;
  oo.model_id = flags.str("model-name").empty() ? std::filesystem::path(path).stem().string() : flags.str("model-name");
  oo.max_input_tokens = max_input;
  oo.max_running = static_cast<int>(http_threads) - 2;  // threads left for /metrics and /v1/models
  oo.keepalive_ms = static_cast<int>(keepalive_ms);
  server::OpenAiApi openai(eng, tokenizer.get(), keys, oo, &metrics);
  std::unique_ptr<server::HttpServer> api_http;
  if (!flags.str("http-listen").empty()) {
    auto h = server::HttpServer::start(flags.str("http-listen"), ho, [&](httplib::Server& s) {
      openai.add_routes(s);
      server::add_metrics_routes(s, render_metrics);
    });
    if (!h.ok()) return std::fprintf(stderr, "combs-server: --http-listen: %s\n", h.status().message().c_str()), 1;
    api_http = std::move(h).value();
    std::printf("combs-server: OpenAI API on http://%s:%d/v1 (model %s)\n", api_http->host().c_str(), api_http->port(),
                oo.model_id.c_str());
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // TLS: a certificate chain and its private key (PEM), both or neither.
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (flags.str("tls-cert").empty() != flags.str("tls-key").empty()) {
    return std::fprintf(stderr, "combs-server: --tls-cert and --tls-key go together\n"), 2;
  }
  if (!flags.str("tls-cert").empty()) {
    auto slurp = [](const std::string& path, std::string* out) { return tools::read_file(path, out) && !out->empty(); };
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    if (!slurp(flags.str("tls-cert"), &pair.cert_chain) || !slurp(flags.str("tls-key"), &pair.private_key)) {
      return std::fprintf(stderr, "combs-server: cannot read --tls-cert / --tls-key\n"), 2;
    }
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    creds = grpc::SslServerCredentials(ssl);
  }
  // The drain's signals are caught before the server is up: a SIGTERM right after "serving" (a
  // supervisor, a test) must drain, not kill (it did when the handlers came after the line).
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not the end of the server
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.str("listen"), creds, &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  std::unique_ptr<grpc::Server> srv = builder.BuildAndStart();
  if (!srv || port == 0) return std::fprintf(stderr, "combs-server: cannot listen on %s\n", flags.str("listen").c_str()), 1;
  const std::string host = flags.str("listen").substr(0, flags.str("listen").rfind(':'));
  server::LogLine("start")
      .add("model", path)
      .add("listen", host + ":" + std::to_string(port))
      .add("device", device)
      .add("tls", flags.str("tls-cert").empty() ? "off" : "on")
      .add("auth", auth ? "api-keys" : "off")
      .add("kv_pages", eng.stats().pages_total)
      .add("sessions_restored", static_cast<int64_t>(restored))
      .info();
  if (host_kv_mib > 0) {  // what the start-up measurement decided, and why
    const EngineStats st = eng.stats();
    server::LogLine("host_tier")
        .add("active", st.host_tier_active ? "yes" : "no (recomputing is cheaper here)")
        .add("host_pages", st.host_pages_total)
        .add("prefill_us_per_token", st.host_prefill_us_per_token)
        .add("copy_us_per_token", st.host_copy_us_per_token)
        .info();
  }
  std::printf("combs-server: serving %s on %s:%d\n", path.c_str(), host.c_str(), port);
  std::fflush(stdout);

  bool serving = true;
  while (g_signal == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // A runner that can no longer serve (a tensor-parallel group lost a rank): health NOT_SERVING
    // at once; requests get its error (UNAVAILABLE) until the server is restarted.
    if (const Status h = eng.runner_health(); serving && !h.ok()) {
      serving = false;
      server::LogLine("not_serving").add("reason", h.message()).error();
      srv->GetHealthCheckService()->SetServingStatus(false);
    }
  }
  // Graceful: health NOT_SERVING and no new work (UNAVAILABLE: clients retry elsewhere); running
  // streams get the grace period, then end UNAVAILABLE; then the server stops.
  server::LogLine("drain").add("signal", static_cast<int>(g_signal)).add("grace_s", static_cast<int64_t>(grace)).info();
  srv->GetHealthCheckService()->SetServingStatus(false);
  service.drain();
  openai.drain();
  // Waits up to `limit` for the engine to have no request running; what is still running.
  auto wait_idle = [&eng](std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (eng.stats().generating > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return eng.stats().generating;
  };
  const int64_t aborted = wait_idle(std::chrono::seconds(grace));
  if (aborted > 0) {
    eng.abort_generating(unavailable_error("combs-server is shutting down"));
    wait_idle(std::chrono::seconds(5));
  }
  if (journal) {  // the finished requests' last events wait for the journal: let it deliver them
    auto flushed = std::make_shared<std::promise<void>>();
    journal->barrier([flushed] { flushed->set_value(); });
    flushed->get_future().wait_for(std::chrono::seconds(5));
  }
  srv->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  srv.reset();
  api_http.reset();  // its streams have ended with the engine's requests
  metrics_http.reset();  // every call is done (their last log lines written) before the logger stops
  server::LogLine("stopped").add("streams_aborted", aborted).info();
  spdlog::default_logger()->flush();
  return 0;
}
