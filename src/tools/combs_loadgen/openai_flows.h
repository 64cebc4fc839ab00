// combs-loadgen --api openai: the same flows over the OpenAI-compatible HTTP API, as a stateless
// client sends them (every request carries the whole conversation; the server's prefix cache is
// what keeps a conversation's earlier turns from being computed again):
//   chat      a conversation of `turns` requests, each resending the earlier turns and replies
//   rollback  a reply, then the same conversation again: greedy, the same reply
//   fork      one request with n = fork_width choices: greedy, all alike
//   reset     a reply, another turn, then the first request again: greedy, the first reply
//   oneshot   one request
// Prompts are words (the prompt-tokens distributions count words); replies stream (server-sent
// events, usage in the last chunk), each content delta an arrival for the latency figures.
// Checks: every stream ends with [DONE] after a finish reason and usage; a reply cut by length
// has max_tokens tokens; the greedy repeats above. One thread per running flow (cpp-httplib's
// client blocks).
#pragma once

#include <atomic>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loadgen.h"

namespace combs::loadgen {

class OpenAiDriver {
 public:
  // model: the served model's name (GET /v1/models).
  OpenAiDriver(Options options, std::string host, int port, std::string model);
  void run();  // as Driver::run: until the duration or request bound, or stop(); then drains
  void stop() { stopping_ = true; }
  const Stats& stats() const { return stats_; }
  double measured_seconds() const { return measured_s_; }

  // One streamed chat completion as the client saw it (choices: their texts by index).
  struct Reply {
    GenResult timing;
    std::vector<std::string> texts;
    std::vector<std::string> finish;
    int64_t completion_tokens = -1;
    bool done = false;  // [DONE] arrived
  };

 private:
  Reply complete(const nlohmann::ordered_json& messages, int max_tokens, int n);
  void flow();
  std::string words(int n);
  int draw(const Dist& d);
  void check_reply(const Reply& r, int max_tokens, int n);

  Options o_;
  std::string host_;
  int port_;
  std::string model_;
  Stats stats_;
  double measured_s_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> running_{0};
  std::mutex mu_;  // rng_, prompts_
  std::mt19937_64 rng_;
  std::vector<std::string> prompts_;
};

}  // namespace combs::loadgen
