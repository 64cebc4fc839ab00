// combs-server's Prometheus metrics: counters and histograms kept by the service, gauges read from
// the engine at scrape time, rendered in the text exposition format (version 0.0.4).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "combs/engine/engine.h"

namespace combs::server {

// Cumulative histogram over fixed upper bounds (seconds); thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Appends the _bucket/_sum/_count series of `name` to out.
  void render(const std::string& name, std::string* out) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bound, plus +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  // stats: read at every scrape (the engine's gauges and counters).
  explicit Metrics(std::function<EngineStats()> stats);

  // One finished RPC: combs_requests_total{method, code} (code: the gRPC code name, e.g. "OK").
  void count_request(const std::string& method, int grpc_code);
  void add_tokens(int64_t input, int64_t output);
  void observe_ttft(double seconds) { ttft_.observe(seconds); }
  void observe_itl(double seconds) { itl_.observe(seconds); }
  void observe_generate(double seconds) { generate_.observe(seconds); }

  std::string render() const;

 private:
  std::function<EngineStats()> stats_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  std::atomic<int64_t> input_tokens_{0}, output_tokens_{0};
  Histogram ttft_, itl_, generate_;
};

// The gRPC status code's canonical name ("OK", "NOT_FOUND", ...).
const char* grpc_code_name(int code);

}  // namespace combs::server
