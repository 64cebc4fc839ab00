// combs-loadgen against a CPU combs-server: short runs with zero errors and every check passing,
// open and closed loop, Ctrl-C, and its reports.
#include <catch2/catch.hpp>

#include <regex>
#include <thread>

#include "combs/model/random_model.h"
#include "support/server_process.h"
#include "support/temp_dir.h"

using combs::testing::read_file;
using combs::testing::run_command;
using combs::testing::ServerProcess;

namespace {


// The number after "key": in a JSON text; -1 when absent.
double json_number(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + "\": ?([-0-9.e]+)"))) return -1;
  return std::stod(m[1]);
}

// passed/failed of one check in the JSON report.
std::pair<int, int> check_counts(const std::string& json, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + name + "\":\\{\"passed\":([0-9]+),\"failed\":([0-9]+)\\}"))) {
    return {-1, -1};
  }
  return {std::stoi(m[1]), std::stoi(m[2])};
}



// A closed-loop run of every flow against a server started with `server_args`: no errors, and
// every check of the flows passes.
void check_closed_loop(std::vector<std::string> server_args) {
  for (const char* a : {"--log-level", "warn", "--kv-memory-mib", "256"}) server_args.push_back(a);
  ServerProcess server(server_args);
  combs::testing::TempDir dir;
  const std::string json = dir.file("report.json"), svg = dir.file("chart.svg");
  const auto [rc, out] = run_command(
      std::string(COMBS_LOADGEN_BIN) + " --server " + server.address +
      " --concurrency 8 --duration-s 6 --warmup-s 0.5 --requests 60 --prompt-tokens uniform:8:48"
      " --output-tokens uniform:4:16 --mix chat=1,rollback=1,fork=1,reset=1,oneshot=1 --quiet"
      " --json " + json + " --svg " + svg);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("time to first token") != std::string::npos);
  const std::string r = read_file(json);
  CHECK(json_number(r, "errors") == 0);
  CHECK(json_number(r, "mismatches") == 0);
  CHECK(json_number(r, "requests") >= 10);
  CHECK(json_number(r, "output_tokens_per_s") > 0);
  for (const char* check : {"token-count", "finish-reason", "session-length", "rollback-length", "rollback-replay",
                            "fork-agree", "reset-repeat", "greedy-repeat"}) {
    INFO(check);
    const auto [passed, failed] = check_counts(r, check);
    CHECK(passed > 0);
    CHECK(failed == 0);
  }
  const std::string chart = read_file(svg);
  CHECK(chart.rfind("<svg", 0) == 0);
  CHECK(chart.find("<polyline") != std::string::npos);
  CHECK(chart.find("</svg>") != std::string::npos);
  CHECK(server.stop() == 0);
}

}  // namespace

TEST_CASE("a closed-loop loadgen run has no errors and every check passes", "[loadgen]") { check_closed_loop({}); }

TEST_CASE("the loadgen's checks pass on a Q4_K_M model too", "[loadgen][quant]") {
  // The tiny shape as llama.cpp's Q4_K_M mix (Q4_K, Q6_K on the output and some layers' attn_v /
  // ffn_down), quantized by combs.
  combs::testing::TempDir dir;
  combs::RandomModelOptions o;
  o.shape = combs::named_shape("tiny").value();
  REQUIRE(combs::set_weight_type("q4_k_m", &o).ok());
  const std::string model = dir.file("tiny-q4_k_m.gguf");
  REQUIRE(combs::write_random_model(o, model).ok());
  check_closed_loop({"--model", model});
}

TEST_CASE("an open-loop loadgen run with sampling stops by itself", "[loadgen]") {
  ServerProcess server({"--log-level", "warn"});
  const auto [rc, out] = run_command(std::string(COMBS_LOADGEN_BIN) + " --server " + server.address +
                                     " --rate 8 --duration-s 3 --prompt-tokens 16 --output-tokens exp:8"
                                     " --temperature 0.8 --mix oneshot=3,chat=1 --quiet");
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("open loop") != std::string::npos);
  CHECK(out.find("errors by method and code: none") != std::string::npos);
  CHECK(server.stop() == 0);
}

TEST_CASE("Ctrl-C stops the loadgen cleanly and it still reports", "[loadgen]") {
  ServerProcess server({"--log-level", "warn"});
  combs::testing::TempDir dir;
  const std::string out_path = dir.file("out.txt");
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::FILE* f = std::fopen(out_path.c_str(), "w");
    dup2(fileno(f), STDOUT_FILENO);
    execl(COMBS_LOADGEN_BIN, COMBS_LOADGEN_BIN, "--server", server.address.c_str(), "--concurrency", "4",
          "--duration-s", "600", "--quiet", nullptr);
    _exit(127);
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  kill(pid, SIGINT);
  const auto t = std::chrono::steady_clock::now();
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(std::chrono::steady_clock::now() - t < std::chrono::seconds(30));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::string out = read_file(out_path);
  INFO(out);
  CHECK(out.find("generate requests") != std::string::npos);
  CHECK(server.stop() == 0);
}

TEST_CASE("the loadgen refuses bad flags", "[loadgen]") {
  for (const char* flags : {"--mix chat=x", "--mix nothing=1", "--prompt-tokens uniform:9:3", "--output-tokens 0",
                            "--concurrency 0", "--duration-s -1", "--bogus 1"}) {
    INFO(flags);
    CHECK(run_command(std::string(COMBS_LOADGEN_BIN) + " --server 127.0.0.1:1 " + flags).first == 2);
  }
}
