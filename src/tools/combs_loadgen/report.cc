// Distributions, the statistics of a run and its reports (table, JSON, SVG chart).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>

#include "combs/base/status.h"
#include <nlohmann/json.hpp>

#include "loadgen.h"

namespace combs::loadgen {

bool Dist::parse(const std::string& spec, Dist* out, std::string* error) {
  std::vector<double> v;
  std::string kind = spec;
  const size_t colon = spec.find(':');
  if (colon != std::string::npos) {
    kind = spec.substr(0, colon);
    std::stringstream ss(spec.substr(colon + 1));
    for (std::string part; std::getline(ss, part, ':');) {
      char* end = nullptr;
      const double x = std::strtod(part.c_str(), &end);
      if (part.empty() || *end != '\0' || !std::isfinite(x)) {
        *error = "'" + spec + "': '" + part + "' is not a number";
        return false;
      }
      v.push_back(x);
    }
  }
  Dist d;
  d.spec = spec;
  if (colon == std::string::npos) {
    char* end = nullptr;
    const double x = std::strtod(spec.c_str(), &end);
    if (spec.empty() || *end != '\0' || !(x >= 1) || x > 1e6) {
      *error = "'" + spec + "' is not a count in [1, 1e6] (or uniform:A:B, normal:MEAN:SD, exp:MEAN)";
      return false;
    }
    d.kind_ = Kind::kConst, d.a_ = x;
  } else if (kind == "uniform" && v.size() == 2 && v[0] >= 1 && v[1] >= v[0] && v[1] <= 1e6) {
    d.kind_ = Kind::kUniform, d.a_ = v[0], d.b_ = v[1];
  } else if (kind == "normal" && v.size() == 2 && v[0] >= 1 && v[0] <= 1e6 && v[1] >= 0) {
    d.kind_ = Kind::kNormal, d.a_ = v[0], d.b_ = v[1];
  } else if (kind == "exp" && v.size() == 1 && v[0] >= 1 && v[0] <= 1e6) {
    d.kind_ = Kind::kExp, d.a_ = v[0];
  } else {
    *error = "'" + spec + "' is not N, uniform:A:B (1 <= A <= B), normal:MEAN:SD or exp:MEAN";
    return false;
  }
  *out = d;
  return true;
}

int Dist::sample(std::mt19937_64& rng) const {
  double x = a_;
  switch (kind_) {
    case Kind::kConst: break;
    case Kind::kUniform: x = std::uniform_int_distribution<int>(static_cast<int>(a_), static_cast<int>(b_))(rng); break;
    case Kind::kNormal: x = std::normal_distribution<double>(a_, b_)(rng); break;
    case Kind::kExp: x = std::exponential_distribution<double>(1.0 / a_)(rng); break;
  }
  return static_cast<int>(std::clamp(std::round(x), 1.0, 1e6));
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

namespace {
double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

void Stats::record_generate(const GenResult& r) {
  if (r.start >= t0_) ++measured_;  // toward --requests
  std::lock_guard<std::mutex> lock(mu_);
  auto second = [&](Clock::time_point t) -> Second& {
    const size_t sec = static_cast<size_t>(std::max(0.0, secs(t - t0_)));
    if (seconds_.size() <= sec) seconds_.resize(sec + 1);
    return seconds_[sec];
  };
  // Tokens count where they arrived, inside the window.
  Clock::time_point at = r.first_token;
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    if (i > 0) at += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(r.itl_s[i - 1]));
    if (at >= t0_ && at < t1_) {
      ++output_tokens_;
      ++second(at).tokens;
    }
  }
  if (r.end >= t0_ && r.end < t1_) {
    ++ok_requests_;
    prefilled_tokens_ += r.usage_prefilled;
    cached_tokens_ += r.usage_cached;
    ++second(r.end).requests;
  }
  if (r.start < t0_) return;  // warm-up: no latency samples
  Second& s = second(std::min(r.end, t1_ - std::chrono::nanoseconds(1)));
  const double e2e = secs(r.end - r.start);
  e2e_.push_back(e2e);
  s.e2e.push_back(e2e);
  if (!r.tokens.empty()) {
    const double ttft = secs(r.first_token - r.start);
    ttft_.push_back(ttft);
    s.ttft.push_back(ttft);
  }
  itl_.insert(itl_.end(), r.itl_s.begin(), r.itl_s.end());
  s.itl.insert(s.itl.end(), r.itl_s.begin(), r.itl_s.end());
}

void Stats::record_error(const std::string& method, int grpc_code, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string key = method + " " + std::string(status_code_name(static_cast<StatusCode>(grpc_code)));
  ++errors_[key];
  last_error_[key] = message;
}

void Stats::check(const std::string& name, bool ok, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& c = checks_[name];
  if (ok) {
    ++c.first;
  } else {
    ++c.second;
    if (mismatch_examples_.size() < 20) mismatch_examples_.push_back(name + ": " + detail);
  }
}

int64_t Stats::errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [k, v] : errors_) n += v;
  return n;
}

int64_t Stats::mismatches() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [k, v] : checks_) n += v.second;
  return n;
}

void Stats::watch(Clock::time_point end, bool progress, const std::function<bool()>& running) const {
  Clock::time_point last_progress = Clock::now();
  while (running() && Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (progress && Clock::now() - last_progress >= std::chrono::seconds(1)) {
      last_progress = Clock::now();
      std::fprintf(stderr, "\r%s", progress_line(seconds(last_progress - t0_)).c_str());
      std::fflush(stderr);
    }
  }
}

double Stats::finish_window() {
  close_window(Clock::now());
  return std::max(0.0, seconds(t1() - t0_));
}

std::string Stats::progress_line(double elapsed_s) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t errs = 0, bad = 0;
  for (const auto& [k, v] : errors_) errs += v;
  for (const auto& [k, v] : checks_) bad += v.second;
  // The last full second's throughput.
  const Second* last = seconds_.size() >= 2 ? &seconds_[seconds_.size() - 2] : nullptr;
  char buf[256];
  std::snprintf(buf, sizeof buf, "[%6.1fs] %lld requests  %6lld tok/s  ttft p50 %7.1f ms  itl p50 %6.1f ms  errors %lld  mismatches %lld ",
                elapsed_s, static_cast<long long>(ok_requests_), static_cast<long long>(last ? last->tokens : 0),
                percentile(last ? last->ttft : ttft_, 50) * 1e3, percentile(last ? last->itl : itl_, 50) * 1e3,
                static_cast<long long>(errs), static_cast<long long>(bad));
  return buf;
}

std::string Stats::table(const Options& o, double measured_s) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  char buf[512];
  const double t = std::max(measured_s, 1e-9);
  std::snprintf(buf, sizeof buf, "combs-loadgen against %s: %s, %.1f s measured after %.1f s warm-up\n",
                o.server.c_str(),
                o.rate > 0 ? ("open loop, " + std::to_string(o.rate) + " flows/s").c_str()
                           : ("closed loop, " + std::to_string(o.concurrency) + " concurrent flows").c_str(),
                measured_s, o.warmup_s);
  out += buf;
  std::snprintf(buf, sizeof buf, "  generate requests  %8lld   %10.2f req/s\n  output tokens      %8lld   %10.1f tok/s\n",
                static_cast<long long>(ok_requests_), static_cast<double>(ok_requests_) / t,
                static_cast<long long>(output_tokens_), static_cast<double>(output_tokens_) / t);
  out += buf;
  // Of the positions each request needed before generating: those whose pages were there (its
  // session's or the prefix cache's) and those prefilled.
  const int64_t needed = cached_tokens_ + prefilled_tokens_;
  std::snprintf(buf, sizeof buf, "  prompt positions   %8lld   %.1f%% reused from cached pages, the rest prefilled\n",
                static_cast<long long>(needed),
                needed > 0 ? 100.0 * static_cast<double>(cached_tokens_) / static_cast<double>(needed) : 0.0);
  out += buf;
  out += "  latency (ms)          p50        p90        p99        max\n";
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<double>*>{"time to first token", &ttft_},
                                {"inter-token", &itl_},
                                {"end to end", &e2e_}}) {
    std::snprintf(buf, sizeof buf, "  %-19s %9.2f  %9.2f  %9.2f  %9.2f\n", name, percentile(*v, 50) * 1e3,
                  percentile(*v, 90) * 1e3, percentile(*v, 99) * 1e3, percentile(*v, 100) * 1e3);
    out += buf;
  }
  out += "  errors by method and code:";
  if (errors_.empty()) out += " none";
  out += "\n";
  for (const auto& [k, n] : errors_) out += "    " + k + ": " + std::to_string(n) + " (last: " + last_error_.at(k) + ")\n";
  if (dropped_ > 0) out += "  dropped arrivals (max in flight reached): " + std::to_string(dropped_.load()) + "\n";
  out += "  checks (passed / failed):\n";
  for (const auto& [k, c] : checks_) {
    std::snprintf(buf, sizeof buf, "    %-16s %8lld / %lld\n", k.c_str(), static_cast<long long>(c.first),
                  static_cast<long long>(c.second));
    out += buf;
  }
  for (const auto& m : mismatch_examples_) out += "    mismatch: " + m + "\n";
  return out;
}

namespace {

nlohmann::ordered_json latency_json(const std::vector<double>& v) {
  return {{"count", v.size()},
          {"p50_ms", percentile(v, 50) * 1e3},
          {"p90_ms", percentile(v, 90) * 1e3},
          {"p99_ms", percentile(v, 99) * 1e3},
          {"max_ms", percentile(v, 100) * 1e3}};
}

}  // namespace

std::string Stats::json(const Options& o, double measured_s) const {
  std::lock_guard<std::mutex> lock(mu_);
  const double t = std::max(measured_s, 1e-9);
  nlohmann::ordered_json j;
  j["server"] = o.server;
  j["mode"] = o.rate > 0 ? "open" : "closed";
  j["concurrency"] = o.concurrency;
  j["rate"] = o.rate;
  j["prompt_tokens"] = o.prompt_tokens.spec;
  j["shared_prefix_tokens"] = o.shared_prefix;
  j["output_tokens"] = o.output_tokens.spec;
  j["temperature"] = o.temperature;
  for (int i = 0; i < 5; ++i) j["mix"][kFlowNames[i]] = o.mix[i];
  j["warmup_s"] = o.warmup_s;
  j["measured_s"] = measured_s;
  j["requests"] = ok_requests_;
  j["requests_per_s"] = static_cast<double>(ok_requests_) / t;
  j["output_tokens_total"] = output_tokens_;
  j["output_tokens_per_s"] = static_cast<double>(output_tokens_) / t;
  j["prefilled_tokens_total"] = prefilled_tokens_;
  j["cached_tokens_total"] = cached_tokens_;
  j["ttft"] = latency_json(ttft_);
  j["itl"] = latency_json(itl_);
  j["e2e"] = latency_json(e2e_);
  int64_t errs = 0;
  j["errors_by_code"] = nlohmann::ordered_json::object();
  for (const auto& [k, n] : errors_) {
    j["errors_by_code"][k] = n;
    errs += n;
  }
  j["errors"] = errs;
  j["dropped_arrivals"] = dropped_.load();
  int64_t failed = 0;
  j["checks"] = nlohmann::ordered_json::object();
  for (const auto& [k, c] : checks_) {
    j["checks"][k] = {{"passed", c.first}, {"failed", c.second}};
    failed += c.second;
  }
  j["mismatches"] = failed;
  j["timeline"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < seconds_.size(); ++i) {
    const Second& s = seconds_[i];
    j["timeline"].push_back({{"t", i},
                             {"requests", s.requests},
                             {"tokens", s.tokens},
                             {"ttft_p50_ms", percentile(s.ttft, 50) * 1e3},
                             {"itl_p50_ms", percentile(s.itl, 50) * 1e3},
                             {"e2e_p99_ms", percentile(s.e2e, 99) * 1e3}});
  }
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

// Two panels over the run's seconds: output tokens/s above, latency (TTFT p50, ITL p50, E2E p99)
// below, each with its axis labelled.
std::string Stats::svg(double measured_s) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int W = 900, H = 800, left = 70, right = 20, panel = 180, gap = 70, top = 40;
  const size_t n = std::max<size_t>(seconds_.size(), 1);
  std::vector<double> tok, ttft, ttft99, itl, itl99, e2e, e2e99;
  for (const Second& s : seconds_) {
    tok.push_back(static_cast<double>(s.tokens));
    ttft.push_back(percentile(s.ttft, 50) * 1e3);
    ttft99.push_back(percentile(s.ttft, 99) * 1e3);
    itl.push_back(percentile(s.itl, 50) * 1e3);
    itl99.push_back(percentile(s.itl, 99) * 1e3);
    e2e.push_back(percentile(s.e2e, 50) * 1e3);
    e2e99.push_back(percentile(s.e2e, 99) * 1e3);
  }
  auto max_of = [](const std::vector<double>& v) {
    double m = 0;
    for (double x : v) m = std::max(m, x);
    return m > 0 ? m * 1.1 : 1.0;
  };
  char buf[512];
  std::string out;
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
                "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
                "<text x=\"%d\" y=\"22\" font-size=\"15\">combs-loadgen: %.1f s measured</text>\n",
                W, H, left, measured_s);
  out += buf;
  auto panel_at = [&](int y0, const char* title, double ymax,
                      const std::vector<std::pair<const std::vector<double>*, const char*>>& series) {
    const int x0 = left, x1 = W - right, y1 = y0 + panel;
    std::snprintf(buf, sizeof buf,
                  "<text x=\"%d\" y=\"%d\">%s</text>\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n"
                  "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
                  x0, y0 - 8, title, x0, y1, x1, y1, x0, y0, x0, y1);
    out += buf;
    for (int k = 0; k <= 4; ++k) {  // y ticks
      const double v = ymax * k / 4;
      const int y = y1 - panel * k / 4;
      std::snprintf(buf, sizeof buf,
                    "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%.4g</text>\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" "
                    "y2=\"%d\" stroke=\"#ddd\"/>\n",
                    x0 - 6, y + 4, v, x0, y, x1, y);
      out += buf;
    }
    const size_t step = std::max<size_t>(1, (n + 9) / 10);  // x ticks: whole seconds
    for (size_t sec = 0; sec <= n; sec += step) {
      const double x = x0 + (x1 - x0) * static_cast<double>(sec) / static_cast<double>(n);
      std::snprintf(buf, sizeof buf, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%zu s</text>\n", x, y1 + 16,
                    sec);
      out += buf;
    }
    for (const auto& [v, color] : series) {
      std::string pts;
      for (size_t i = 0; i < v->size(); ++i) {
        const double x = x0 + (x1 - x0) * (static_cast<double>(i) + 0.5) / static_cast<double>(n);
        const double y = y1 - panel * std::min((*v)[i] / ymax, 1.0);
        std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x, y);
        pts += buf;
      }
      out += "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" + std::string(color) + "\" points=\"" + pts + "\"/>\n";
    }
  };
  panel_at(top + 20, "output tokens / s", max_of(tok), {{&tok, "#1f77b4"}});
  panel_at(top + 20 + panel + gap,
           "per-token latency (ms): TTFT p50 (orange), p99 (red); inter-token p50 (green), p99 (purple)",
           std::max({max_of(ttft), max_of(ttft99), max_of(itl), max_of(itl99)}),
           {{&ttft, "#ff7f0e"}, {&ttft99, "#d62728"}, {&itl, "#2ca02c"}, {&itl99, "#9467bd"}});
  panel_at(top + 20 + 2 * (panel + gap), "end-to-end latency (ms): p50 (blue), p99 (red)",
           std::max(max_of(e2e), max_of(e2e99)), {{&e2e, "#1f77b4"}, {&e2e99, "#d62728"}});
  out += "</svg>\n";
  return out;
}

}  // namespace combs::loadgen
