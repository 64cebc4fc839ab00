#include "flows.h"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <thread>

namespace combs::loadgen {

namespace {

// One Generate stream: reads until the server ends it, timing every token.
class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(v1::Combs::Stub* stub, v1::GenerateRequest req, std::function<void(grpc::ClientContext*)> prepare,
               std::function<void(GenResult&, grpc::ClientContext*)> done)
      : req_(std::move(req)), done_(std::move(done)) {
    prepare(&ctx_);
    result_.start = Clock::now();
    stub->async()->Generate(&ctx_, &req_, this);
    StartRead(&resp_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    const Clock::time_point now = Clock::now();
    if (resp_.finished()) {
      result_.finished = true;
      result_.finish_reason = resp_.finish_reason();
      result_.usage_input = resp_.usage().input_tokens();
      result_.usage_output = resp_.usage().output_tokens();
      result_.usage_cached = resp_.usage().cached_tokens();
      result_.usage_prefilled = resp_.usage().prefilled_tokens();
      result_.session_length = resp_.session_length();
    } else {
      if (result_.tokens.empty()) result_.first_token = now;
      else result_.itl_s.push_back(seconds(now - last_));
      last_ = now;
      result_.tokens.push_back(resp_.token_id());
    }
    StartRead(&resp_);
  }
  void OnDone(const grpc::Status& s) override {
    result_.end = Clock::now();
    result_.grpc_code = s.error_code();
    result_.error = s.error_message();
    done_(result_, &ctx_);
    delete this;
  }

 private:
  grpc::ClientContext ctx_;
  v1::GenerateRequest req_;
  v1::GenerateResponse resp_;
  GenResult result_;
  Clock::time_point last_;
  std::function<void(GenResult&, grpc::ClientContext*)> done_;
};

}  // namespace

// One running flow; owned by the callbacks of its calls (shared_ptr), gone when the last returns.
struct Flow : std::enable_shared_from_this<Flow> {
  Driver* d;
  FlowKind kind;
  std::string session;
  std::vector<std::string> children;
  std::vector<int32_t> prompt, output;  // output: the last generate's tokens
  int64_t length = 0;                   // the session's length as the flow expects it
  int out = 0, rounds = 0;
  bool greedy = true;
  std::mutex mu;
  std::vector<std::vector<int32_t>> fork_outputs;
  int pending = 0;

  explicit Flow(Driver* driver) : d(driver) {}

  void begin() {
    auto self = shared_from_this();
    d->create([self](bool ok, const std::string& id) {
      if (!ok) {
        // The server refused a session (limit, draining): back off before the loop tries again.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return self->d->flow_done();
      }
      self->session = id;
      self->first();
    });
  }

  // The first generate of a fresh session, with a prompt from the pool.
  void first() {
    if (d->stopping()) return finish();
    auto self = shared_from_this();
    gen(session, prompt, out, [self](GenResult& r) {
      if (self->greedy) self->d->check_greedy_repeat(self->prompt, r.tokens);
      self->after_first();
    });
  }

  void after_first() {
    if (d->stopping()) return finish();
    switch (kind) {
      case FlowKind::kChat: return chat_turn();
      case FlowKind::kRollback: return rollback_round();
      case FlowKind::kFork: return fork_all();
      case FlowKind::kReset: return reset_and_repeat();
      case FlowKind::kOneshot: return finish();
    }
  }

  void chat_turn() {
    if (rounds-- <= 0 || d->stopping()) return finish();
    auto self = shared_from_this();
    gen(session, d->random_tokens(d->draw(d->o_.turn_tokens)), d->draw(d->o_.output_tokens),
        [self](GenResult&) { self->chat_turn(); });
  }

  // Generate-and-rollback: drop j of the last k tokens and generate j again.
  void rollback_round() {
    if (rounds-- <= 0 || d->stopping() || output.empty()) return finish();
    auto self = shared_from_this();
    const int drop = d->uniform(1, static_cast<int>(output.size()));
    v1::RollbackRequest req;
    req.set_session_id(session);
    req.set_n(drop);
    d->unary<v1::RollbackRequest, v1::RollbackResponse>(
        "Rollback", req,
        [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->Rollback(ctx, rq, rs, std::move(cb)); },
        [self, drop](const grpc::Status& s, v1::RollbackResponse& resp) {
          if (!s.ok()) return self->finish();
          self->d->stats_.check("rollback-length", resp.length() == self->length - drop,
                                "rollback " + std::to_string(drop) + ": length " + std::to_string(resp.length()) +
                                    ", expected " + std::to_string(self->length - drop));
          self->length = resp.length();
          if (self->d->stopping()) return self->finish();
          const std::vector<int32_t> kept(self->output.begin(), self->output.end() - drop);
          const std::vector<int32_t> dropped(self->output.end() - drop, self->output.end());
          self->gen(self->session, {}, drop, [self, kept, dropped](GenResult& r) {
            if (self->greedy) {
              self->d->stats_.check("rollback-replay", r.tokens == dropped,
                                    "greedy tokens after a rollback differ from the ones rolled back");
            }
            self->output = kept;  // the session's tail: what was kept, then the new tokens
            self->output.insert(self->output.end(), r.tokens.begin(), r.tokens.end());
            self->rollback_round();
          });
        });
  }

  void fork_all() {
    auto self = shared_from_this();
    pending = d->o_.fork_width;
    for (int i = 0; i < d->o_.fork_width; ++i) {
      v1::ForkRequest req;
      req.set_session_id(session);
      d->unary<v1::ForkRequest, v1::ForkResponse>(
          "Fork", req, [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->Fork(ctx, rq, rs, std::move(cb)); },
          [self](const grpc::Status& s, v1::ForkResponse& resp) {
            if (s.ok()) {
              std::lock_guard<std::mutex> lock(self->mu);
              self->children.push_back(resp.session_id());
            }
            if (self->one_done()) self->children_generate();
          });
    }
  }

  void children_generate() {
    auto self = shared_from_this();
    std::vector<std::string> kids;
    {
      std::lock_guard<std::mutex> lock(mu);
      kids = children;
      pending = static_cast<int>(kids.size());
    }
    if (kids.empty() || d->stopping()) return finish();
    const int m = d->draw(d->o_.output_tokens);
    for (const std::string& kid : kids) {
      gen_on(kid, {}, m, length, [self](GenResult& r) {
        {
          std::lock_guard<std::mutex> lock(self->mu);
          if (r.grpc_code == 0) self->fork_outputs.push_back(r.tokens);
        }
        if (!self->one_done()) return;
        if (self->greedy) {
          bool agree = true;
          for (const auto& o : self->fork_outputs) agree &= o == self->fork_outputs.front();
          self->d->stats_.check("fork-agree", agree, "greedy continuations of forks of one session differ");
        }
        self->finish();
      });
    }
  }

  void reset_and_repeat() {
    auto self = shared_from_this();
    v1::ResetRequest req;
    req.set_session_id(session);
    d->unary<v1::ResetRequest, v1::ResetResponse>(
        "Reset", req, [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->Reset(ctx, rq, rs, std::move(cb)); },
        [self](const grpc::Status& s, v1::ResetResponse&) {
          if (!s.ok() || self->d->stopping()) return self->finish();
          self->length = 0;
          const std::vector<int32_t> before = self->output;
          self->gen(self->session, self->prompt, self->out, [self, before](GenResult& r) {
            if (self->greedy) {
              self->d->stats_.check("reset-repeat", r.tokens == before,
                                    "greedy output after a reset differs from the session's first");
            }
            self->finish();
          });
        });
  }

  // Closes the session and its children; the flow ends when every close has returned.
  void finish() {
    std::vector<std::string> all;
    {
      std::lock_guard<std::mutex> lock(mu);
      all = children;
      children.clear();
      if (!session.empty()) all.push_back(session);
      session.clear();
      pending = static_cast<int>(all.size());
    }
    if (all.empty()) return d->flow_done();
    auto self = shared_from_this();
    for (const std::string& id : all) {
      d->close(id, [self] {
        if (self->one_done()) self->d->flow_done();
      });
    }
  }

  bool one_done() {
    std::lock_guard<std::mutex> lock(mu);
    return --pending == 0;
  }

  // A generate on the flow's session: checks, then `next` on success; the flow ends on failure.
  void gen(const std::string& id, std::vector<int32_t> input, int max_tokens, std::function<void(GenResult&)> next) {
    auto self = shared_from_this();
    gen_on(id, std::move(input), max_tokens, length, [self, next = std::move(next)](GenResult& r) {
      if (r.grpc_code != 0) return self->finish();
      self->length = r.session_length;
      self->output = r.tokens;
      next(r);
    });
  }
  void gen_on(const std::string& id, std::vector<int32_t> input, int max_tokens, int64_t length_before,
              std::function<void(GenResult&)> next) {
    const int64_t n_input = static_cast<int64_t>(input.size());
    auto self = shared_from_this();
    d->generate(id, std::move(input), max_tokens, [self, n_input, max_tokens, length_before, next = std::move(next)](GenResult& r) {
      if (r.grpc_code == 0) self->d->check_stream(r, n_input, max_tokens, length_before);
      next(r);
    });
  }
};

Driver::Driver(std::shared_ptr<grpc::Channel> channel, Options options, int n_vocab)
    : o_(std::move(options)),
      stub_(v1::Combs::NewStub(channel)),
      n_vocab_(n_vocab),
      stats_(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.warmup_s)),
             Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o_.warmup_s + o_.duration_s))),
      rng_(o_.seed) {
  const std::vector<int32_t> shared = random_tokens(o_.shared_prefix);
  for (int i = 0; i < o_.prompt_pool; ++i) {
    std::vector<int32_t> p = shared;
    const std::vector<int32_t> own = random_tokens(draw(o_.prompt_tokens));
    p.insert(p.end(), own.begin(), own.end());
    prompts_.push_back(std::move(p));
  }
}

int Driver::uniform(int lo, int hi) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::uniform_int_distribution<int>(lo, hi)(rng_);
}

int Driver::draw(const Dist& d) {
  std::lock_guard<std::mutex> lock(mu_);
  return d.sample(rng_);
}

std::vector<int32_t> Driver::random_tokens(int n) {
  // Ordinary tokens: ids from 1 to min(n_vocab, 32000) - 1 (special tokens sit at the top of most
  // vocabularies).
  std::uniform_int_distribution<int32_t> id(1, std::max(2, std::min(n_vocab_, 32000)) - 1);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = id(rng_);
  return out;
}

void Driver::add_context(grpc::ClientContext* ctx, const std::string& session) {
  if (!o_.api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + o_.api_key);
  // A session-affine proxy routes on it (deploy/envoy.yaml); a new session has none and spreads.
  if (!session.empty()) ctx->AddMetadata("combs-session-id", session);
  std::lock_guard<std::mutex> lock(mu_);
  live_.insert(ctx);
  ++calls_in_flight_;
}

void Driver::remove_context(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(ctx);
  --calls_in_flight_;
}

void Driver::generate(const std::string& session, std::vector<int32_t> input, int max_tokens,
                      std::function<void(GenResult&)> done) {
  v1::GenerateRequest req;
  req.set_session_id(session);
  for (int32_t t : input) req.mutable_tokens()->add_ids(t);
  req.set_max_tokens(max_tokens);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(o_.temperature);
  if (o_.temperature > 0) req.mutable_sampling()->set_seed(static_cast<uint64_t>(uniform(0, 1 << 30)));
  new GenerateCall(stub_.get(), std::move(req), [this, session](grpc::ClientContext* ctx) { add_context(ctx, session); },
                   [this, done = std::move(done)](GenResult& r, grpc::ClientContext* ctx) {
                     remove_context(ctx);
                     const bool ours = r.grpc_code == grpc::StatusCode::CANCELLED && stopping();
                     if (r.grpc_code != 0 && !ours) stats_.record_error("Generate", r.grpc_code, r.error);
                     if (r.grpc_code == 0) {
                       stats_.record_generate(r);
                       if (o_.requests > 0 && stats_.measured_requests() >= o_.requests) stop();
                     }
                     done(r);
                   });
}

template <typename Req, typename Resp, typename Start>
void Driver::unary(const char* method, Req req, Start start, std::function<void(const grpc::Status&, Resp&)> done) {
  struct Call {
    grpc::ClientContext ctx;
    Req req;
    Resp resp;
  };
  auto* c = new Call;
  c->req = std::move(req);
  if constexpr (requires { c->req.session_id(); }) add_context(&c->ctx, c->req.session_id());
  else add_context(&c->ctx, "");
  start(stub_->async(), &c->ctx, &c->req, &c->resp, [this, c, method, done = std::move(done)](grpc::Status s) {
    remove_context(&c->ctx);
    const bool ours = s.error_code() == grpc::StatusCode::CANCELLED && stopping();
    if (!s.ok() && !ours) stats_.record_error(method, s.error_code(), s.error_message());
    done(s, c->resp);
    delete c;
  });
}

void Driver::create(std::function<void(bool, const std::string&)> done) {
  unary<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      "CreateSession", v1::CreateSessionRequest(),
      [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->CreateSession(ctx, rq, rs, std::move(cb)); },
      [done = std::move(done)](const grpc::Status& s, v1::CreateSessionResponse& r) { done(s.ok(), r.session_id()); });
}

void Driver::close(const std::string& session, std::function<void()> done) {
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  unary<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      "CloseSession", req,
      [](auto* a, auto* ctx, auto* rq, auto* rs, auto cb) { a->CloseSession(ctx, rq, rs, std::move(cb)); },
      [done = std::move(done)](const grpc::Status&, v1::CloseSessionResponse&) { done(); });
}

void Driver::check_stream(const GenResult& r, int64_t input, int max_tokens, int64_t length_before) {
  const auto n = static_cast<int64_t>(r.tokens.size());
  stats_.check("stream-finished", r.finished, "a stream ended OK without its final message");
  stats_.check("token-count", n == max_tokens && r.usage_output == n,
               "streamed " + std::to_string(n) + " tokens, usage says " + std::to_string(r.usage_output) +
                   ", max_tokens " + std::to_string(max_tokens));
  stats_.check("finish-reason", r.finish_reason == v1::FINISH_REASON_LENGTH,
               "finish reason " + v1::FinishReason_Name(r.finish_reason) + " with ignore_eos");
  stats_.check("usage-input", r.usage_input == input,
               "usage input " + std::to_string(r.usage_input) + ", sent " + std::to_string(input));
  stats_.check("session-length", r.session_length == length_before + input + n,
               "session length " + std::to_string(r.session_length) + ", expected " +
                   std::to_string(length_before + input + n));
}

void Driver::check_greedy_repeat(const std::vector<int32_t>& prompt, const std::vector<int32_t>& output) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = greedy_outputs_.emplace(prompt, output);
  if (inserted) return;
  const size_t n = std::min(it->second.size(), output.size());
  stats_.check("greedy-repeat", std::equal(output.begin(), output.begin() + static_cast<ptrdiff_t>(n), it->second.begin()),
               "the same prompt gave different greedy outputs in two sessions");
  if (output.size() > it->second.size()) it->second = output;
}

void Driver::start_flow(bool slot_held) {
  auto f = std::make_shared<Flow>(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!slot_held) ++flows_in_flight_;
    std::discrete_distribution<int> pick(std::begin(o_.mix), std::end(o_.mix));
    f->kind = static_cast<FlowKind>(pick(rng_));
    f->prompt = prompts_[std::uniform_int_distribution<size_t>(0, prompts_.size() - 1)(rng_)];
    f->greedy = o_.temperature == 0;
  }
  f->out = draw(o_.output_tokens);
  f->rounds = f->kind == FlowKind::kChat ? draw(o_.turns) - 1 : draw(o_.rollback_loops);
  f->begin();
}

void Driver::flow_done() {
  bool again;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Closed loop: the next flow takes this one's slot, so the count never reads 0 in between
    // (run() returns once it does, and the Driver goes with it).
    again = o_.rate <= 0 && !stopping();
    if (!again) --flows_in_flight_;
    cv_.notify_all();
  }
  if (again) start_flow(/*slot_held=*/true);
}

void Driver::run() {
  const Clock::time_point end = stats_.t1();
  std::thread arrivals;
  if (o_.rate > 0) {  // open loop: Poisson arrivals
    arrivals = std::thread([this] {
      std::mt19937_64 rng(o_.seed ^ 0x5bd1e995);
      std::exponential_distribution<double> gap(o_.rate);
      Clock::time_point next = Clock::now();
      while (!stopping()) {
        next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        std::this_thread::sleep_until(next);
        if (stopping()) break;
        bool room;
        {
          std::lock_guard<std::mutex> lock(mu_);
          room = flows_in_flight_ < o_.max_in_flight;
        }
        if (room) start_flow();
        else stats_.dropped_arrival();
      }
    });
  } else {
    for (int i = 0; i < o_.concurrency; ++i) start_flow();
  }
  stats_.watch(end, o_.progress, [this] { return !stopping(); });
  stop();
  measured_s_ = stats_.finish_window();
  if (arrivals.joinable()) arrivals.join();
  // Drain: flows end at their next step; calls still running after drain_s are cancelled.
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(o_.drain_s), [this] { return flows_in_flight_ == 0; })) {
    for (grpc::ClientContext* ctx : live_) ctx->TryCancel();
    cv_.wait(lock, [this] { return flows_in_flight_ == 0; });
  }
  while (calls_in_flight_ > 0) {  // the last closes
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    lock.lock();
  }
  if (o_.progress) std::fprintf(stderr, "\r%s\n", stats_.progress_line(measured_s_).c_str());
}

}  // namespace combs::loadgen
