// combs-loadgen: the load-test client for combs deployments (see loadgen.h for the flows and checks).
//   combs-loadgen --server HOST:PORT [--concurrency N | --rate R] [--duration-s S] [--requests N] ...
// Exit status: 0 when every call succeeded and every check passed, 1 otherwise, 2 on bad flags.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <nlohmann/json.hpp>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "common/flags.h"
#include "flows.h"
#include "openai_flows.h"

namespace {
volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }
}  // namespace

int main(int argc, char** argv) {
  using namespace combs;
  using namespace combs::loadgen;
  tools::Flags flags("combs-loadgen",
                     {{"server", "127.0.0.1:50051"}, {"api", "grpc"}, {"api-key", ""}, {"tls-ca", ""}, {"concurrency", "16"},
                      {"rate", "0"}, {"max-in-flight", "1024"}, {"duration-s", "30"}, {"warmup-s", "0"},
                      {"drain-s", "30"}, {"requests", "0"}, {"mix", "chat=4,rollback=2,fork=1,reset=1,oneshot=2"},
                      {"prompt-tokens", "uniform:16:128"}, {"output-tokens", "uniform:8:64"},
                      {"turn-tokens", "uniform:4:32"}, {"turns", "uniform:2:4"}, {"rollback-loops", "uniform:1:3"},
                      {"fork-width", "3"}, {"prompt-pool", "8"}, {"shared-prefix", "0"}, {"temperature", "0"}, {"seed", "1"}, {"json", ""},
                      {"svg", ""}, {"config", ""}},
                     {"quiet"});
  flags.describe({
      {"server", "combs-server address HOST:PORT (its --listen; with --api openai its --http-listen)"},
      {"api", "grpc (combs' sessions) or openai (the same flows over the OpenAI-compatible HTTP API, stateless)"},
      {"api-key", "sent as 'authorization: Bearer KEY'"},
      {"tls-ca", "PEM root certificate: connect with TLS"},
      {"concurrency", "closed loop: flows running at once"},
      {"rate", "> 0: open loop, flows started per second (Poisson arrivals)"},
      {"max-in-flight", "open loop: arrivals beyond this many running flows are dropped (and counted)"},
      {"duration-s", "measured seconds (after the warm-up)"},
      {"warmup-s", "seconds run before measuring"},
      {"drain-s", "at the end, running calls get this long before they are cancelled"},
      {"requests", "> 0: stop after this many measured generate requests"},
      {"mix", "weights of the flows chat, rollback, fork, reset, oneshot"},
      {"prompt-tokens", "N | uniform:A:B | normal:MEAN:SD | exp:MEAN"},
      {"output-tokens", "new tokens per generate (same forms)"},
      {"turn-tokens", "chat: tokens of each further user turn"},
      {"turns", "chat: generates per session"},
      {"rollback-loops", "rollback: roll back and regenerate this many times"},
      {"fork-width", "fork: children per session"},
      {"prompt-pool", "distinct prompts (repeats let greedy outputs be compared across sessions)"},
      {"shared-prefix", "tokens every prompt begins with, the same for all (a system prompt: the prefix cache shares it)"},
      {"temperature", "sampling temperature; 0: greedy (enables the determinism checks)"},
      {"seed", "seed of the workload (prompts, lengths, mix)"},
      {"json", "write the full report as JSON to this file"},
      {"svg", "write a chart of throughput and latency over time to this file"},
      {"config", "scenario file of 'name = value' lines with these flags' names"},
      {"quiet", "no live progress line"},
  });
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("--server HOST:PORT [--concurrency N | --rate R] [--duration-s S] [--requests N] [flags]");
    return 0;
  }
  if (flags.given("config") && !flags.load_config(flags.str("config"))) return 2;
  Options o;
  o.server = flags.str("server");
  o.api_key = flags.str("api-key");
  o.tls_ca = flags.str("tls-ca");
  long long concurrency, max_in_flight, requests, fork_width, pool, seed, shared_prefix;
  double rate, temperature;
  if (!flags.integer("concurrency", &concurrency, 1, 1 << 20) || !flags.integer("max-in-flight", &max_in_flight, 1, 1 << 20) ||
      !flags.integer("requests", &requests, 0, 1ll << 40) || !flags.integer("fork-width", &fork_width, 1, 64) ||
      !flags.integer("prompt-pool", &pool, 1, 1 << 20) || !flags.integer("shared-prefix", &shared_prefix, 0, 1 << 20) || !flags.integer("seed", &seed, 0, 1ll << 62) ||
      !flags.number("rate", &rate) || !flags.number("duration-s", &o.duration_s) ||
      !flags.number("warmup-s", &o.warmup_s) || !flags.number("drain-s", &o.drain_s) ||
      !flags.number("temperature", &temperature)) {
    return 2;
  }
  if (rate < 0 || o.duration_s <= 0 || o.warmup_s < 0 || o.drain_s < 0 || temperature < 0) {
    return std::fprintf(stderr, "combs-loadgen: --rate, --warmup-s, --drain-s and --temperature must be >= 0, --duration-s > 0\n"), 2;
  }
  o.concurrency = static_cast<int>(concurrency);
  o.max_in_flight = static_cast<int>(max_in_flight);
  o.requests = requests;
  o.fork_width = static_cast<int>(fork_width);
  o.prompt_pool = static_cast<int>(pool);
  o.shared_prefix = static_cast<int>(shared_prefix);
  o.seed = static_cast<uint64_t>(seed);
  o.rate = rate;
  o.temperature = static_cast<float>(temperature);
  o.json_path = flags.str("json");
  o.svg_path = flags.str("svg");
  o.progress = !flags.on("quiet");
  for (auto [name, dist] : {std::pair<const char*, Dist*>{"prompt-tokens", &o.prompt_tokens},
                            {"output-tokens", &o.output_tokens}, {"turn-tokens", &o.turn_tokens},
                            {"turns", &o.turns}, {"rollback-loops", &o.rollback_loops}}) {
    std::string error;
    if (!Dist::parse(flags.str(name), dist, &error)) {
      return std::fprintf(stderr, "combs-loadgen: --%s: %s\n", name, error.c_str()), 2;
    }
  }
  {  // --mix name=weight,...
    for (double& w : o.mix) w = 0;
    std::stringstream ss(flags.str("mix"));
    for (std::string part; std::getline(ss, part, ',');) {
      const size_t eq = part.find('=');
      int kind = -1;
      for (int i = 0; i < 5; ++i)
        if (eq != std::string::npos && part.substr(0, eq) == kFlowNames[i]) kind = i;
      char* end = nullptr;
      const double w = kind < 0 ? -1 : std::strtod(part.c_str() + eq + 1, &end);
      if (kind < 0 || *end != '\0' || !(w >= 0)) {
        return std::fprintf(stderr, "combs-loadgen: --mix: '%s' is not FLOW=WEIGHT (flows: chat, rollback, fork, reset, oneshot)\n",
                            part.c_str()), 2;
      }
      o.mix[kind] = w;
    }
    if (o.mix[0] + o.mix[1] + o.mix[2] + o.mix[3] + o.mix[4] <= 0) {
      return std::fprintf(stderr, "combs-loadgen: --mix: no flow has a weight\n"), 2;
    }
  }

  if (flags.str("api") != "grpc" && flags.str("api") != "openai") {
    return std::fprintf(stderr, "combs-loadgen: --api %s: expected grpc or openai\n", flags.str("api").c_str()), 2;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto report = [&o](const Stats& st, double measured_s) {
    std::printf("%s", st.table(o, measured_s).c_str());
    if (!o.json_path.empty()) {
      std::ofstream(o.json_path) << st.json(o, measured_s);
      std::printf("  report: %s\n", o.json_path.c_str());
    }
    if (!o.svg_path.empty()) {
      std::ofstream(o.svg_path) << st.svg(measured_s);
      std::printf("  chart: %s\n", o.svg_path.c_str());
    }
    return st.errors() == 0 && st.mismatches() == 0 ? 0 : 1;
  };
  if (flags.str("api") == "openai") {
    if (!o.tls_ca.empty()) return std::fprintf(stderr, "combs-loadgen: --tls-ca is for --api grpc only\n"), 2;
    std::string host;
    int port = 0;
    const size_t colon = o.server.rfind(':');
    if (colon == std::string::npos || (port = std::atoi(o.server.c_str() + colon + 1)) <= 0) {
      return std::fprintf(stderr, "combs-loadgen: --server %s is not HOST:PORT\n", o.server.c_str()), 2;
    }
    host = o.server.substr(0, colon);
    httplib::Client client(host, port);
    httplib::Headers headers;
    if (!o.api_key.empty()) headers.emplace("Authorization", "Bearer " + o.api_key);
    auto models = client.Get("/v1/models", headers);
    const auto list = models && models->status == 200 ? nlohmann::json::parse(models->body, nullptr, false) : nlohmann::json();
    if (!list.is_object() || !list.contains("data") || list["data"].empty()) {
      return std::fprintf(stderr, "combs-loadgen: GET http://%s/v1/models: %s\n", o.server.c_str(),
                          models ? ("HTTP " + std::to_string(models->status)).c_str() : httplib::to_string(models.error()).c_str()),
             1;
    }
    OpenAiDriver driver(o, host, port, list["data"][0].value("id", ""));
    std::atomic<bool> finished{false};
    std::thread watcher([&] {
      while (!finished) {
        if (g_signal != 0) driver.stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    driver.run();
    finished = true;
    watcher.join();
    return report(driver.stats(), driver.measured_seconds());
  }

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.tls_ca.empty()) {
    std::ifstream f(o.tls_ca);
    if (!f) return std::fprintf(stderr, "combs-loadgen: cannot read --tls-ca %s\n", o.tls_ca.c_str()), 2;
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(o.server, creds, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    return std::fprintf(stderr, "combs-loadgen: cannot connect to %s\n", o.server.c_str()), 1;
  }
  int n_vocab = 0;
  {
    auto stub = v1::Combs::NewStub(channel);
    grpc::ClientContext ctx;
    if (!o.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + o.api_key);
    v1::ModelInfo info;
    grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
    if (!s.ok()) return std::fprintf(stderr, "combs-loadgen: GetModelInfo: %s\n", s.error_message().c_str()), 1;
    n_vocab = info.n_vocab();
  }

  Driver driver(channel, o, n_vocab);
  std::atomic<bool> finished{false};
  std::thread watcher([&] {  // Ctrl-C: stop cleanly and still report
    while (!finished) {
      if (g_signal != 0) driver.stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  driver.run();
  finished = true;
  watcher.join();

  return report(driver.stats(), driver.measured_seconds());
}
