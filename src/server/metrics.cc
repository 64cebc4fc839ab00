#include "metrics.h"

#include <cmath>
#include <cstdio>

namespace combs::server {

namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void header(std::string* out, const char* name, const char* type, const char* help) {
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string* out, const std::string& series, double v) { *out += series + " " + number(v) + "\n"; }
// Counts print as integers: %g would round them once past 1e9.
void sample(std::string* out, const std::string& series, uint64_t v) {
  *out += series + " " + std::to_string(v) + "\n";
}
void sample(std::string* out, const std::string& series, int64_t v) {
  *out += series + " " + std::to_string(v) + "\n";
}

// Latency buckets from 1 ms to 60 s.
std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

const char* grpc_code_name(int code) {
  return status_code_name(static_cast<StatusCode>(code)).data();  // the names are literals
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(const std::string& name, std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const double le = i < bounds_.size() ? bounds_[i] : INFINITY;
    sample(out, name + "_bucket{le=\"" + number(le) + "\"}", cumulative);
  }
  sample(out, name + "_sum", sum_);
  sample(out, name + "_count", count_);
}

Metrics::Metrics(std::function<EngineStats()> stats)
    : stats_(std::move(stats)), ttft_(latency_bounds()), itl_(latency_bounds()), generate_(latency_bounds()) {}

void Metrics::count_request(const std::string& method, int grpc_code) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{method, grpc_code}];
}

void Metrics::add_tokens(int64_t input, int64_t output) {
  input_tokens_ += input;
  output_tokens_ += output;
}

std::string Metrics::render() const {
  std::string out;
  header(&out, "combs_requests_total", "counter", "Finished RPCs by method and gRPC status code.");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, n] : requests_) {
      sample(&out, "combs_requests_total{method=\"" + key.first + "\",code=\"" + grpc_code_name(key.second) + "\"}",
             n);
    }
  }
  header(&out, "combs_input_tokens_total", "counter", "Tokens appended to sessions by Generate requests.");
  sample(&out, "combs_input_tokens_total", input_tokens_.load());
  header(&out, "combs_output_tokens_total", "counter", "Tokens generated.");
  sample(&out, "combs_output_tokens_total", output_tokens_.load());
  header(&out, "combs_time_to_first_token_seconds", "histogram", "From the Generate call to its first token.");
  ttft_.render("combs_time_to_first_token_seconds", &out);
  header(&out, "combs_inter_token_latency_seconds", "histogram", "Between consecutive tokens of a Generate stream.");
  itl_.render("combs_inter_token_latency_seconds", &out);
  header(&out, "combs_generate_duration_seconds", "histogram", "From the Generate call to its end.");
  generate_.render("combs_generate_duration_seconds", &out);

  const EngineStats st = stats_();
  const std::pair<const char*, std::pair<const char*, int64_t>> gauges[] = {
      {"combs_sessions", {"Open sessions.", st.sessions}},
      {"combs_requests_generating", {"Generate requests in progress.", st.generating}},
      {"combs_queue_depth", {"Generate requests that had no place in the last engine step.", st.waiting}},
      {"combs_batch_sequences", {"Sequences in the last engine step.", st.batch_sequences}},
      {"combs_batch_tokens", {"Tokens in the last engine step.", st.batch_tokens}},
      {"combs_kv_pages_total", {"KV cache pages in the pool.", st.pages_total}},
      {"combs_kv_pages_used", {"KV cache pages held by sessions or the prefix cache.", st.pages_used}},
      {"combs_kv_pages_free", {"KV cache pages free.", st.pages_free}},
      {"combs_kv_pages_cached", {"KV cache pages the prefix cache names.", st.pages_cached}},
      {"combs_kv_pages_reclaimable", {"Cached pages no session holds (reused first when pages run out).", st.pages_reclaimable}},
      {"combs_kv_host_pages_total", {"Pages of the host tier (0: none, or it does not pay on this device).", st.host_pages_total}},
      {"combs_kv_host_pages_used", {"Host tier pages holding sessions' K/V.", st.host_pages_used}},
  };
  for (const auto& [name, g] : gauges) {
    header(&out, name, "gauge", g.first);
    sample(&out, name, g.second);
  }
  const std::pair<const char*, std::pair<const char*, int64_t>> counters[] = {
      {"combs_engine_steps_total", {"Engine steps (model forwards).", st.steps}},
      {"combs_forward_tokens_total", {"Tokens through the model (prefill and decode).", st.forward_tokens}},
      {"combs_kv_evictions_total", {"Idle sessions whose pages were taken for others.", st.evictions}},
      {"combs_prefix_cache_lookups_total", {"Requests that looked their prefix up in the prefix cache.", st.prefix_lookups}},
      {"combs_prefix_cache_hits_total", {"Requests that found cached pages of their prefix.", st.prefix_hits}},
      {"combs_prefix_cache_hit_tokens_total", {"Positions mapped from the prefix cache instead of prefilled.", st.prefix_hit_tokens}},
      {"combs_prefix_cache_evictions_total", {"Cached pages taken back for reuse.", st.cached_pages_reclaimed}},
      {"combs_preemptions_total", {"Waiting requests whose pages were taken so that others could run (they resume).", st.preemptions}},
      {"combs_kv_window_pages_released_total", {"Pages given back from behind sessions' sliding windows (all-windowed models).", st.window_pages_released}},
      {"combs_kv_window_rebuilds_total", {"Caches rebuilt for a rollback behind the positions a sliding window released.", st.window_rebuilds}},
      {"combs_queue_timeouts_total", {"Requests ended for waiting past --queue-timeout-s.", st.queue_timeouts}},
      {"combs_speculation_drafted_tokens_total", {"Tokens drafted by speculative decoding and verified.", st.drafted_tokens}},
      {"combs_speculation_accepted_tokens_total", {"Drafted tokens the model agreed with (each saved a forward).", st.accepted_tokens}},
      {"combs_draft_forwards_total", {"Forwards of the draft model (--draft-model), each drafting a position for a batch of sessions.", st.draft_forwards}},
      {"combs_draft_cache_evictions_total", {"Draft caches dropped for room in the draft model's pool (rebuilt when next drafted).", st.draft_cache_evictions}},
      {"combs_kv_host_offloads_total", {"Sessions whose pages moved to the host tier.", st.host_offloads}},
      {"combs_kv_host_restores_total", {"Copies of pages back from the host tier.", st.host_restores}},
      {"combs_kv_host_restored_tokens_total", {"Positions copied back from the host tier instead of prefilled.", st.host_restored_tokens}},
      {"combs_kv_host_dropped_total", {"Host tier copies dropped to make room (those sessions prefill again).", st.host_copies_dropped}},
  };
  for (const auto& [name, c] : counters) {
    header(&out, name, "counter", c.first);
    sample(&out, name, c.second);
  }
  return out;
}

}  // namespace combs::server
