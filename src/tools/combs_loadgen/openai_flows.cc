#include "openai_flows.h"

#include <httplib.h>

#include <chrono>
#include <thread>

#include "combs/base/status.h"

namespace combs::loadgen {

namespace {

using json = nlohmann::ordered_json;

json user(const std::string& text) { return {{"role", "user"}, {"content", text}}; }

}  // namespace

OpenAiDriver::OpenAiDriver(Options options, std::string host, int port, std::string model)
    : o_(std::move(options)),
      host_(std::move(host)),
      port_(port),
      model_(std::move(model)),
      stats_(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.warmup_s)),
             Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o_.warmup_s + o_.duration_s))),
      rng_(o_.seed) {
  const std::string shared = words(o_.shared_prefix);
  for (int i = 0; i < o_.prompt_pool; ++i) prompts_.push_back(shared + words(draw(o_.prompt_tokens)));
}

std::string OpenAiDriver::words(int n) {
  static const char* kSyllables[] = {"ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe"};
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (int i = 0; i < n; ++i) {
    const int len = std::uniform_int_distribution<int>(1, 3)(rng_);
    for (int k = 0; k < len; ++k) out += kSyllables[std::uniform_int_distribution<int>(0, 11)(rng_)];
    out += ' ';
  }
  return out;
}

int OpenAiDriver::draw(const Dist& d) {
  std::lock_guard<std::mutex> lock(mu_);
  return d.sample(rng_);
}

OpenAiDriver::Reply OpenAiDriver::complete(const json& messages, int max_tokens, int n) {
  Reply r;
  r.texts.assign(n, "");
  r.finish.assign(n, "");
  json body = {{"model", model_},
               {"messages", messages},
               {"max_tokens", max_tokens},
               {"temperature", o_.temperature},
               {"n", n},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (o_.temperature > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    body["seed"] = std::uniform_int_distribution<int64_t>(0, 1 << 30)(rng_);
  }
  httplib::Client client(host_, port_);
  client.set_read_timeout(600, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.set_header("Content-Type", "application/json");
  if (!o_.api_key.empty()) req.set_header("Authorization", "Bearer " + o_.api_key);
  req.body = body.dump();
  std::string pending;
  Clock::time_point last;
  r.timing.start = Clock::now();
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    pending.append(data, len);
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos;) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;  // a comment (keep-alive)
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        r.done = true;
        continue;
      }
      const json j = json::parse(payload, nullptr, false);
      if (!j.is_object()) {
        r.timing.error = "an event that is not a JSON object";
        continue;
      }
      if (j.contains("error")) {
        r.timing.error = j["error"].is_object() && j["error"].contains("message") ? j["error"]["message"].dump() : j["error"].dump();
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const json& u = j["usage"];
        auto integer = [](const json& o, const char* k, int64_t fallback) {
          return o.contains(k) && o[k].is_number_integer() ? o[k].get<int64_t>() : fallback;
        };
        r.completion_tokens = integer(u, "completion_tokens", -1);
        r.timing.usage_input = integer(u, "prompt_tokens", 0);
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
          r.timing.usage_cached = integer(u["prompt_tokens_details"], "cached_tokens", 0);
        }
        r.timing.usage_prefilled = r.timing.usage_input - r.timing.usage_cached;
      }
      if (!j.contains("choices") || !j["choices"].is_array()) continue;
      for (const json& c : j["choices"]) {
        if (!c.is_object() || !c.contains("index") || !c["index"].is_number_integer()) continue;
        const int64_t i = c["index"].get<int64_t>();
        if (i < 0 || i >= n) continue;
        if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish[i] = c["finish_reason"];
        const bool has_text = c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content") &&
                              c["delta"]["content"].is_string();
        const std::string text = has_text ? c["delta"]["content"].get<std::string>() : "";
        if (text.empty()) continue;
        r.texts[i] += text;
        const Clock::time_point now = Clock::now();
        if (r.timing.tokens.empty()) r.timing.first_token = now;
        else r.timing.itl_s.push_back(seconds(now - last));
        last = now;
        r.timing.tokens.push_back(0);  // an arrival
      }
    }
    return !stopping_ || Clock::now() < stats_.t1() + std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(o_.drain_s));
  };
  httplib::Result res = client.send(req);
  r.timing.end = Clock::now();
  if (!res) {
    r.timing.grpc_code = static_cast<int>(StatusCode::kUnavailable);
    r.timing.error = "HTTP: " + httplib::to_string(res.error());
  } else if (res->status != 200) {
    const json j = json::parse(res->body, nullptr, false);
    r.timing.grpc_code = res->status == 429 ? static_cast<int>(StatusCode::kResourceExhausted)
                         : res->status == 400 ? static_cast<int>(StatusCode::kInvalidArgument)
                                              : static_cast<int>(StatusCode::kInternal);
    r.timing.error = "HTTP " + std::to_string(res->status) + ": " +
                     (j.is_object() && j.contains("error") ? j["error"].dump() : res->body.substr(0, 200));
  }
  r.timing.finished = r.done;
  r.timing.usage_output = r.completion_tokens;
  return r;
}

void OpenAiDriver::check_reply(const Reply& r, int max_tokens, int n) {
  if (!r.timing.error.empty()) {
    stats_.record_error("chat.completions", r.timing.grpc_code == 0 ? static_cast<int>(StatusCode::kInternal) : r.timing.grpc_code,
                        r.timing.error);
    return;
  }
  stats_.record_generate(r.timing);
  stats_.check("stream-finished", r.done && r.completion_tokens >= 0, "a stream without usage or [DONE]");
  for (int i = 0; i < n; ++i) {
    const bool ok = r.finish[i] == "length" || r.finish[i] == "stop";
    stats_.check("finish-reason", ok, "choice " + std::to_string(i) + " finished '" + r.finish[i] + "'");
  }
  // Cut by length, every choice holds max_tokens tokens.
  bool all_length = true;
  for (const std::string& f : r.finish) all_length &= f == "length";
  if (all_length) {
    stats_.check("token-count", r.completion_tokens == int64_t{max_tokens} * n,
                 "usage says " + std::to_string(r.completion_tokens) + " tokens, " + std::to_string(n) + " x max_tokens " +
                     std::to_string(max_tokens));
  }
}

void OpenAiDriver::flow() {
  FlowKind kind;
  std::string prompt;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::discrete_distribution<int> pick(std::begin(o_.mix), std::end(o_.mix));
    kind = static_cast<FlowKind>(pick(rng_));
    prompt = prompts_[std::uniform_int_distribution<size_t>(0, prompts_.size() - 1)(rng_)];
  }
  const bool greedy = o_.temperature == 0;
  const int out = draw(o_.output_tokens);
  json messages = json::array({{{"role", "system"}, {"content", "You are a load test."}}, user(prompt)});
  const int n = kind == FlowKind::kFork ? o_.fork_width : 1;
  const Reply first = complete(messages, out, n);
  check_reply(first, out, n);
  if (!first.timing.error.empty() || stopping_) return;
  switch (kind) {
    case FlowKind::kChat: {
      json conversation = messages;
      std::string reply = first.texts[0];
      for (int turn = 1, turns = draw(o_.turns); turn < turns && !stopping_; ++turn) {
        conversation.push_back({{"role", "assistant"}, {"content", reply}});
        conversation.push_back(user(words(draw(o_.turn_tokens))));
        const int m = draw(o_.output_tokens);
        const Reply next = complete(conversation, m, 1);
        check_reply(next, m, 1);
        if (!next.timing.error.empty()) return;
        reply = next.texts[0];
      }
      break;
    }
    case FlowKind::kRollback: {
      const Reply again = complete(messages, out, 1);
      check_reply(again, out, 1);
      if (greedy && again.timing.error.empty()) {
        stats_.check("rollback-replay", again.texts[0] == first.texts[0], "the same conversation gave another greedy reply");
      }
      break;
    }
    case FlowKind::kFork:
      if (greedy) {
        for (int i = 1; i < n; ++i) {
          stats_.check("fork-agree", first.texts[i] == first.texts[0], "greedy choices of one request differ");
        }
      }
      break;
    case FlowKind::kReset: {
      json longer = messages;
      longer.push_back({{"role", "assistant"}, {"content", first.texts[0]}});
      longer.push_back(user(words(draw(o_.turn_tokens))));
      const int m = draw(o_.output_tokens);
      check_reply(complete(longer, m, 1), m, 1);
      const Reply again = complete(messages, out, 1);
      check_reply(again, out, 1);
      if (greedy && again.timing.error.empty()) {
        stats_.check("reset-repeat", again.texts[0] == first.texts[0], "the first request again gave another greedy reply");
      }
      break;
    }
    case FlowKind::kOneshot: break;
  }
}

void OpenAiDriver::run() {
  const Clock::time_point end = stats_.t1();
  std::vector<std::thread> threads;  // the closed loop's workers
  auto bounded = [&] { return o_.requests > 0 && stats_.measured_requests() >= o_.requests; };
  auto worker = [&] {
    while (!stopping_ && Clock::now() < end && !bounded()) flow();
  };
  std::thread arrivals;
  if (o_.rate > 0) {  // open loop: Poisson arrivals, a thread per flow
    arrivals = std::thread([&] {
      std::mt19937_64 rng(o_.seed ^ 0x5bd1e995);
      std::exponential_distribution<double> gap(o_.rate);
      Clock::time_point next = Clock::now();
      while (!stopping_ && Clock::now() < end && !bounded()) {
        next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        std::this_thread::sleep_until(next);
        if (running_ >= o_.max_in_flight) {
          stats_.dropped_arrival();
          continue;
        }
        ++running_;
        std::thread([this] {  // detached: run() waits for running_ to reach 0
          flow();
          --running_;
        }).detach();
      }
    });
  } else {
    for (int i = 0; i < o_.concurrency; ++i) threads.emplace_back(worker);
  }
  stats_.watch(end, o_.progress, [&] { return !stopping_ && !bounded(); });
  stop();
  measured_s_ = stats_.finish_window();
  if (arrivals.joinable()) arrivals.join();
  for (auto& t : threads) t.join();  // each ends its flow's current request (drain_s at most)
  while (running_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (o_.progress) std::fprintf(stderr, "\r%s\n", stats_.progress_line(measured_s_).c_str());
}

}  // namespace combs::loadgen
