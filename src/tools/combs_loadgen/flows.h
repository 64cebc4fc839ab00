// The flows of combs-loadgen and the asynchronous calls they are made of (gRPC callback API: no
// thread waits on a call; each completion starts the flow's next call).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <set>

#include "combs/v1/combs.grpc.pb.h"
#include "loadgen.h"

namespace combs::loadgen {

struct Flow;

class Driver {
 public:
  Driver(std::shared_ptr<grpc::Channel> channel, Options options, int n_vocab);

  // Runs until the duration or request bound, or stop(); then lets in-flight flows finish their
  // current call (up to drain_s), cancels what is left, and returns.
  void run();
  void stop() { stopping_ = true; }  // safe from a signal-watching thread
  const Stats& stats() const { return stats_; }
  double measured_seconds() const { return measured_s_; }

 private:
  friend struct Flow;
  // slot_held: the flow takes over a finished flow's count in flows_in_flight_.
  void start_flow(bool slot_held = false);
  void flow_done();
  bool stopping() const { return stopping_.load(); }
  std::vector<int32_t> random_tokens(int n);
  int draw(const Dist& d);
  int uniform(int lo, int hi);  // inclusive

  // Asynchronous calls; `done` runs on a gRPC callback thread.
  void generate(const std::string& session, std::vector<int32_t> input, int max_tokens,
                std::function<void(GenResult&)> done);
  template <typename Req, typename Resp, typename Start>
  void unary(const char* method, Req req, Start start, std::function<void(const grpc::Status&, Resp&)> done);
  void create(std::function<void(bool ok, const std::string& id)> done);
  void close(const std::string& session, std::function<void()> done);

  // Checks shared by every Generate: token count, usage, finish reason, session length.
  void check_stream(const GenResult& r, int64_t input, int max_tokens, int64_t length_before);
  // The greedy output of a prompt on a fresh session, compared across sessions.
  void check_greedy_repeat(const std::vector<int32_t>& prompt, const std::vector<int32_t>& output);

  void add_context(grpc::ClientContext* ctx, const std::string& session);
  void remove_context(grpc::ClientContext* ctx);

  Options o_;
  std::unique_ptr<v1::Combs::Stub> stub_;
  int n_vocab_;
  Stats stats_;
  double measured_s_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;  // below
  std::condition_variable cv_;
  std::mt19937_64 rng_;
  std::vector<std::vector<int32_t>> prompts_;
  std::map<std::vector<int32_t>, std::vector<int32_t>> greedy_outputs_;
  std::set<grpc::ClientContext*> live_;
  int64_t flows_in_flight_ = 0, calls_in_flight_ = 0;
};

}  // namespace combs::loadgen
