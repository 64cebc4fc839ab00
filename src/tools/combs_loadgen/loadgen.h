// combs-loadgen: drives session workloads against a combs deployment through the gRPC callback
// API (thousands of streams from one process), checks what comes back, and reports. With
// --api openai the same flows go over the OpenAI-compatible HTTP API (openai_flows.h).
//
// Workloads ("flows"), mixed by weight:
//   chat      create; generate (prompt); then per turn append a user turn and generate; close
//   rollback  create; generate (prompt, k); per loop: roll back j <= k, generate j again; close
//   fork      create; generate (prompt, k); fork into W children; each generates m; close all
//   reset     create; generate (prompt, k); reset; generate the same again; close
//   oneshot   create; generate (prompt); close
// Checks (counted, never fatal): every stream's token count, usage and finish reason; rollback
// and reset lengths; for greedy requests, the same prompt gives the same output across sessions,
// a rollback followed by the same greedy continuation reproduces the dropped tokens, forks of one
// state agree, and a reset session repeats its first output.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace combs::loadgen {

using Clock = std::chrono::steady_clock;
inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A positive integer distribution: "N", "uniform:A:B", "normal:MEAN:SD", "exp:MEAN".
class Dist {
 public:
  static bool parse(const std::string& spec, Dist* out, std::string* error);
  int sample(std::mt19937_64& rng) const;
  std::string spec;

 private:
  enum class Kind { kConst, kUniform, kNormal, kExp } kind_ = Kind::kConst;
  double a_ = 1, b_ = 1;
};

enum class FlowKind { kChat, kRollback, kFork, kReset, kOneshot };
inline constexpr const char* kFlowNames[] = {"chat", "rollback", "fork", "reset", "oneshot"};

struct Options {
  std::string server = "127.0.0.1:50051", api_key, tls_ca;
  int concurrency = 16;  // closed loop: flows running at once
  double rate = 0;       // > 0: open loop, flows started per second (Poisson)
  int max_in_flight = 1024;  // open loop: arrivals beyond this are counted as dropped
  double duration_s = 30, warmup_s = 0, drain_s = 30;
  int64_t requests = 0;  // > 0: stop after this many measured Generate requests
  double mix[5] = {4, 2, 1, 1, 2};
  Dist prompt_tokens, output_tokens, turn_tokens, turns, rollback_loops;
  int fork_width = 3;
  int prompt_pool = 8;   // distinct prompts (repeats make the greedy checks possible)
  int shared_prefix = 0;  // tokens every prompt begins with (a system prompt the prefix cache can share)
  float temperature = 0;  // 0: greedy
  uint64_t seed = 1;
  std::string json_path, svg_path;
  bool progress = true;
};

// One Generate stream as the client saw it.
struct GenResult {
  int grpc_code = 0;
  std::string error;
  std::vector<int32_t> tokens;
  bool finished = false;
  int finish_reason = 0;
  int64_t usage_input = 0, usage_output = 0, usage_cached = 0, usage_prefilled = 0, session_length = -1;
  Clock::time_point start, first_token, end;
  std::vector<double> itl_s;  // gaps between consecutive tokens
};

// Latency samples and counters; thread-safe.
class Stats {
 public:
  // The measured window [from, to): latencies of requests started in it, tokens that arrived
  // in it, requests that ended in it.
  Stats(Clock::time_point from, Clock::time_point to) : t0_(from), t1_(to) {}
  Clock::time_point t0() const { return t0_; }
  Clock::time_point t1() const {
    std::lock_guard<std::mutex> lock(mu_);
    return t1_;
  }
  // Ends the window early (a --requests bound or Ctrl-C): what arrives later is not counted.
  void close_window(Clock::time_point at) {
    std::lock_guard<std::mutex> lock(mu_);
    t1_ = std::min(t1_, std::max(at, t0_));
  }
  void record_generate(const GenResult& r);
  void record_error(const std::string& method, int grpc_code, const std::string& message);
  void check(const std::string& name, bool ok, const std::string& detail = "");
  void dropped_arrival() { ++dropped_; }

  int64_t measured_requests() const { return measured_.load(); }
  int64_t errors() const;
  int64_t mismatches() const;
  // The final report: the table (stdout), the JSON and the SVG.
  std::string table(const Options& o, double measured_s) const;
  std::string json(const Options& o, double measured_s) const;
  std::string svg(double measured_s) const;
  std::string progress_line(double elapsed_s) const;
  // The run's main loop, both protocols': sleeps while running() and before `end`, writing the
  // progress line to stderr once a second where `progress`.
  void watch(Clock::time_point end, bool progress, const std::function<bool()>& running) const;
  // The window closed now (the run stopped): its length in seconds.
  double finish_window();

 private:
  struct Second {  // one second of the run, for the charts
    int64_t requests = 0, tokens = 0;
    std::vector<double> ttft, itl, e2e;
  };
  Clock::time_point t0_, t1_;
  mutable std::mutex mu_;
  std::vector<double> ttft_, itl_, e2e_;
  int64_t ok_requests_ = 0, output_tokens_ = 0, prefilled_tokens_ = 0, cached_tokens_ = 0;
  std::map<std::string, int64_t> errors_;  // "Method CODE" -> count
  std::map<std::string, std::string> last_error_;
  std::map<std::string, std::pair<int64_t, int64_t>> checks_;  // name -> (passed, failed)
  std::vector<std::string> mismatch_examples_;
  std::vector<Second> seconds_;
  std::atomic<int64_t> measured_{0}, dropped_{0};
};

double percentile(std::vector<double> v, double p);  // p in [0, 100]; 0 when empty

}  // namespace combs::loadgen
