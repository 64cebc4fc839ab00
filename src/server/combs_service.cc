#include "combs_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "log.h"

namespace combs::server {

grpc::Status to_grpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One RPC: its request id, for the log line and the metrics at its end.
struct Call {
  const char* method;
  std::string request_id;
  std::string session;
  Clock::time_point start = Clock::now();
  Metrics* metrics;

  Call(grpc::CallbackServerContext* ctx, const char* m, std::string s, Metrics* mx)
      : method(m), session(std::move(s)), metrics(mx) {
    const auto& md = ctx->client_metadata();
    auto it = md.find("x-request-id");
    request_id = server::request_id(it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size()));
    ctx->AddInitialMetadata("x-request-id", request_id);
  }

  // Counts and logs the outcome; `extra` adds fields to the log line.
  void end(int grpc_code, const std::string& message, const std::function<void(LogLine&)>& extra = {}) const {
    if (metrics) metrics->count_request(method, grpc_code);
    LogLine line("rpc");
    line.add("method", method).add("request_id", request_id);
    if (!session.empty()) line.add("session", session);
    line.add("code", grpc_code_name(grpc_code)).add("ms", seconds_since(start) * 1e3);
    if (extra) extra(line);
    if (!message.empty()) line.add("error", message);
    if (grpc_code == 13 /* INTERNAL */ || grpc_code == 2 /* UNKNOWN */) line.error();
    else line.info();
  }
};

grpc::ServerUnaryReactor* done(grpc::CallbackServerContext* ctx, const Call& call, const Status& s) {
  call.end(static_cast<int>(s.code()), s.message());
  auto* r = ctx->DefaultReactor();
  r->Finish(to_grpc(s));
  return r;
}

SamplingParams merge(const SamplingParams& base, const v1::SamplingParams& p) {
  SamplingParams out = base;
  if (p.has_temperature()) out.temperature = p.temperature();
  if (p.has_top_k()) out.top_k = p.top_k();
  if (p.has_top_p()) out.top_p = p.top_p();
  if (p.has_min_p()) out.min_p = p.min_p();
  if (p.has_repetition_penalty()) out.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) out.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) out.frequency_penalty = p.frequency_penalty();
  if (p.has_penalty_last_n()) out.penalty_last_n = p.penalty_last_n();
  if (p.has_seed()) out.seed = p.seed();
  for (const auto& [id, bias] : p.logit_bias()) out.logit_bias.emplace_back(id, bias);
  return out;
}

// A request's or a session's speculation (nullopt: unset, the session's default). INVALID_ARGUMENT
// for an unknown method or a bad max_draft.
StatusOr<std::optional<SpeculationParams>> speculation_of(const v1::Speculation& s, bool set) {
  if (!set || s.method() == v1::Speculation::METHOD_UNSPECIFIED) return std::optional<SpeculationParams>();
  SpeculationParams p;
  switch (s.method()) {
    case v1::Speculation::METHOD_OFF: p.method = SpeculationParams::Method::kOff; break;
    case v1::Speculation::METHOD_NGRAM: p.method = SpeculationParams::Method::kNgram; break;
    case v1::Speculation::METHOD_DRAFT: p.method = SpeculationParams::Method::kDraft; break;
    default: return invalid_argument_error("speculation: unknown method " + std::to_string(s.method()));
  }
  if (s.max_draft() != 0) p.max_draft = s.max_draft();
  COMBS_RETURN_IF_ERROR(validate(p));
  return std::optional<SpeculationParams>(p);
}

void fill_info(const SessionInfo& i, v1::SessionInfo* out) {
  out->set_session_id(i.id);
  out->set_length(i.length);
  out->set_cached(i.cached);
  out->set_pages_held(i.pages_held);
  out->set_pages_shared(i.pages_shared);
  out->set_generating(i.generating);
  out->set_drafted_tokens(i.drafted_tokens);
  out->set_accepted_tokens(i.accepted_tokens);
}

v1::FinishReason finish_reason(FinishKind k) {
  switch (k) {
    case FinishKind::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishKind::kEos: return v1::FINISH_REASON_EOS;
    case FinishKind::kStop: return v1::FINISH_REASON_STOP;
    case FinishKind::kCancelled: return v1::FINISH_REASON_CANCELLED;
    case FinishKind::kError: return v1::FINISH_REASON_UNSPECIFIED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// One Generate stream. The engine's sink (scheduler thread) queues responses; one write is in
// flight at a time, the next started from OnWriteDone. The shared State outlives the reactor, so a
// late engine event after the client went away is harmless.
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  struct State {
    std::mutex mu;
    GenerateReactor* reactor = nullptr;  // null once the RPC is done
    std::deque<v1::GenerateResponse> queue;
    bool writing = false, finished = false;
    bool ended = false;  // the engine's last event arrived
    grpc::Status final_status;
    std::shared_ptr<GenerateHandle> handle;
    // For the metrics and the log line.
    Metrics* metrics = nullptr;
    Clock::time_point start, last_token;
    bool got_token = false;
    Usage usage;
    const char* finish = "";
  };

  // Starts the engine's operation with the sink that streams its events (Generate's or Chat's).
  using Starter = std::function<StatusOr<std::shared_ptr<GenerateHandle>>(EventSink)>;

  GenerateReactor(Starter starter, Status allowed, grpc::CallbackServerContext* ctx, Call call)
      : state_(std::make_shared<State>()), ctx_(ctx), call_(std::move(call)) {
    state_->reactor = this;
    state_->start = call_.start;
    state_->metrics = call_.metrics;
    Status s = allowed.ok() ? start(starter) : allowed;
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->final_status = to_grpc(s);
      record_end();
      Finish(state_->final_status);
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->writing = false;
    if (!ok) {  // the stream broke: stop generating; Finish comes with the engine's last event
      state_->queue.clear();
      if (state_->handle) state_->handle->cancel();
    }
    pump();
  }
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->handle) state_->handle->cancel();  // deadline or client cancellation
  }
  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->reactor = nullptr;
      if (state_->handle) state_->handle->cancel();
    }
    delete this;
  }

 private:
  Status start(const Starter& starter) {
    std::shared_ptr<State> st = state_;
    COMBS_ASSIGN_OR_RETURN(auto handle, starter([st](const GenerateEvent& e) {
      v1::GenerateResponse resp;
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->ended) return;  // nothing follows the end of the stream
      if (e.type == GenerateEvent::Type::kToken) {
        const Clock::time_point now = Clock::now();
        if (st->metrics) {
          if (!st->got_token) st->metrics->observe_ttft(std::chrono::duration<double>(now - st->start).count());
          else st->metrics->observe_itl(std::chrono::duration<double>(now - st->last_token).count());
        }
        st->got_token = true;
        st->last_token = now;
        resp.set_token_id(e.token);
        resp.set_text(to_valid_utf8(e.text));
      } else {
        if (!e.status.ok()) {
          st->final_status = to_grpc(e.status);
        } else {
          resp.set_finished(true);
          resp.set_text(to_valid_utf8(e.text));
          resp.set_finish_reason(finish_reason(e.finish));
          auto* u = resp.mutable_usage();
          u->set_input_tokens(e.usage.input_tokens);
          u->set_output_tokens(e.usage.output_tokens);
          u->set_prefilled_tokens(e.usage.prefilled_tokens);
          u->set_cached_tokens(e.usage.cached_tokens);
          u->set_drafted_tokens(e.usage.drafted_tokens);
          u->set_accepted_tokens(e.usage.accepted_tokens);
          resp.set_session_length(e.session_length);
          st->finish = v1::FinishReason_Name(resp.finish_reason()).c_str();
        }
        st->usage = e.usage;
        st->finished = true;
        st->ended = true;
      }
      // Every token is sent (token id 0 with empty text serializes to nothing, and still counts);
      // an error ends the stream with its status and no final message.
      if (e.type == GenerateEvent::Type::kToken || resp.finished()) st->queue.push_back(std::move(resp));
      if (st->reactor) st->reactor->pump();
    }));
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->handle = handle;
    return ok_status();
  }

  // Called with state_->mu held.
  void pump() {
    State& st = *state_;
    if (st.writing) return;
    if (!st.queue.empty()) {
      current_ = std::move(st.queue.front());
      st.queue.pop_front();
      st.writing = true;
      StartWrite(&current_);
      return;
    }
    if (st.finished) {
      st.finished = false;  // finish once
      record_end();
      Finish(st.final_status);
    }
  }

  // Counts and logs the call as it ends (before Finish, so a client that saw the end sees it in
  // the metrics). Called with state_->mu held.
  void record_end() {
    const State& st = *state_;
    int code = st.final_status.error_code();
    if (ctx_->IsCancelled()) {  // the client went away or its deadline passed
      // The server's deadline is the client's timeout counted from the request's arrival, so it
      // falls a little after the client's own: the client's RST_STREAM for its deadline can arrive
      // first (seen in CI on a loaded machine). A cancellation within that slack of the deadline is
      // the deadline's (a client's own cancel that close to its deadline is counted so too).
      constexpr auto kDeadlineSlack = std::chrono::milliseconds(250);
      code = ctx_->deadline() <= std::chrono::system_clock::now() + kDeadlineSlack
                 ? grpc::StatusCode::DEADLINE_EXCEEDED
                 : grpc::StatusCode::CANCELLED;
    }
    if (call_.metrics && st.ended) {  // a request the engine ran (not one refused up front)
      call_.metrics->add_tokens(st.usage.input_tokens, st.usage.output_tokens);
      call_.metrics->observe_generate(seconds_since(call_.start));
    }
    call_.end(code, st.final_status.error_message(), [&](LogLine& l) {
      l.add("input_tokens", st.usage.input_tokens).add("output_tokens", st.usage.output_tokens);
      if (*st.finish) l.add("finish", st.finish);
    });
  }

  std::shared_ptr<State> state_;
  v1::GenerateResponse current_;
  grpc::CallbackServerContext* ctx_;
  Call call_;
};

}  // namespace

StatusOr<std::string> CombsService::caller(grpc::CallbackServerContext* ctx) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return keys_.authenticate(std::nullopt);
  return keys_.authenticate(std::string_view(it->second.data(), it->second.size()));
}

Status CombsService::check_owner(grpc::CallbackServerContext* ctx, const std::string& session) {
  COMBS_ASSIGN_OR_RETURN(std::string key, caller(ctx));
  if (!keys_.enabled()) return ok_status();
  std::lock_guard<std::mutex> lock(owners_mu_);
  auto it = owners_.find(session);
  if (it == owners_.end() || it->second != key) return not_found_error("session " + session + " not found");
  return ok_status();
}

void CombsService::own(const std::string& session, const std::string& key) {
  if (!keys_.enabled()) return;
  std::lock_guard<std::mutex> lock(owners_mu_);
  owners_[session] = key;
  // Sessions also end by expiring (TTL) in the engine: drop their owners now and then, so the
  // map does not grow with every session ever made.
  if (++owned_since_prune_ >= 1024) {
    owned_since_prune_ = 0;
    std::unordered_map<std::string, std::string> live;
    for (const SessionInfo& i : engine_->list()) {
      if (auto it = owners_.find(i.id); it != owners_.end()) live.insert(*it);
    }
    live[session] = key;
    owners_.swap(live);
  }
}

grpc::ServerUnaryReactor* CombsService::CreateSession(grpc::CallbackServerContext* ctx,
                                                      const v1::CreateSessionRequest* req,
                                                      v1::CreateSessionResponse* resp) {
  const Call call(ctx, "CreateSession", "", options_.metrics);
  if (draining_) return done(ctx, call, unavailable_error("combs-server is shutting down"));
  auto key = caller(ctx);
  if (!key.ok()) return done(ctx, call, key.status());
  SessionOptions o;
  o.sampling = merge(SamplingParams{}, req->sampling());
  o.max_context = req->max_context();
  auto spec = speculation_of(req->speculation(), req->has_speculation());
  if (!spec.ok()) return done(ctx, call, spec.status());
  o.speculation = *spec;
  o.cache_namespace = keys_.prefix_namespace(*key);
  o.owner = *key;
  auto id = engine_->create_session(o);
  if (id.ok()) {
    own(*id, *key);
    resp->set_session_id(*id);
  }
  return done(ctx, call, id.status());
}

namespace {

StatusOr<GenerateRequest> engine_request(Engine& engine, const Tokenizer* tok, const v1::GenerateRequest& req,
                                         int64_t max_input_tokens) {
  GenerateRequest r;
  if (req.has_tokens()) {
    r.input.assign(req.tokens().ids().begin(), req.tokens().ids().end());
  } else if (req.has_text()) {
    if (tok == nullptr) return invalid_argument_error("generate: this model has no tokenizer: send token ids");
    r.input = tok->encode(req.text(), {req.add_bos(), false});
  }
  if (max_input_tokens > 0 && static_cast<int64_t>(r.input.size()) > max_input_tokens) {
    return resource_exhausted_error("generate: " + std::to_string(r.input.size()) + " input tokens exceed the limit of " +
                                    std::to_string(max_input_tokens) + " per request");
  }
  if (req.max_tokens() < 0) return invalid_argument_error("generate: max_tokens must be >= 0");
  r.max_tokens = req.max_tokens();
  COMBS_ASSIGN_OR_RETURN(SessionInfo info, engine.info(req.session_id()));
  r.sampling = merge(info.sampling, req.sampling());
  for (const auto& seq : req.stop_token_sequences()) r.stop_sequences.emplace_back(seq.ids().begin(), seq.ids().end());
  r.ignore_eos = req.ignore_eos();
  r.stop_strings.assign(req.stop().begin(), req.stop().end());
  COMBS_ASSIGN_OR_RETURN(r.speculation, speculation_of(req.speculation(), req.has_speculation()));
  return r;
}

StatusOr<ChatRequest> engine_chat_request(Engine& engine, const v1::ChatRequest& req) {
  ChatRequest r;
  for (const auto& m : req.messages()) r.messages.push_back({{"role", m.role()}, {"content", m.content()}});
  r.replace = req.replace();
  if (!req.variables_json().empty()) {
    r.variables = nlohmann::ordered_json::parse(req.variables_json(), nullptr, /*allow_exceptions=*/false);
    if (r.variables.is_discarded() || !r.variables.is_object()) {
      return invalid_argument_error("chat: variables_json must be a JSON object");
    }
  }
  if (req.max_tokens() < 0) return invalid_argument_error("chat: max_tokens must be >= 0");
  r.max_tokens = req.max_tokens();
  COMBS_ASSIGN_OR_RETURN(SessionInfo info, engine.info(req.session_id()));
  r.sampling = merge(info.sampling, req.sampling());
  r.stop_strings.assign(req.stop().begin(), req.stop().end());
  r.ignore_eos = req.ignore_eos();
  return r;
}

}  // namespace

grpc::ServerWriteReactor<v1::GenerateResponse>* CombsService::Generate(grpc::CallbackServerContext* ctx,
                                                                       const v1::GenerateRequest* req) {
  Status allowed = draining_ ? unavailable_error("combs-server is shutting down") : check_owner(ctx, req->session_id());
  Engine* engine = engine_;
  const Tokenizer* tok = tokenizer_;
  const int64_t max_input = options_.max_input_tokens;
  auto starter = [engine, tok, max_input, req](EventSink sink) -> StatusOr<std::shared_ptr<GenerateHandle>> {
    COMBS_ASSIGN_OR_RETURN(GenerateRequest r, engine_request(*engine, tok, *req, max_input));
    return engine->generate(req->session_id(), std::move(r), std::move(sink));
  };
  return new GenerateReactor(starter, std::move(allowed), ctx, Call(ctx, "Generate", req->session_id(), options_.metrics));
}

grpc::ServerWriteReactor<v1::GenerateResponse>* CombsService::Chat(grpc::CallbackServerContext* ctx,
                                                                   const v1::ChatRequest* req) {
  Status allowed = draining_ ? unavailable_error("combs-server is shutting down") : check_owner(ctx, req->session_id());
  Engine* engine = engine_;
  auto starter = [engine, req](EventSink sink) -> StatusOr<std::shared_ptr<GenerateHandle>> {
    COMBS_ASSIGN_OR_RETURN(ChatRequest r, engine_chat_request(*engine, *req));
    return engine->chat(req->session_id(), std::move(r), std::move(sink));
  };
  return new GenerateReactor(starter, std::move(allowed), ctx, Call(ctx, "Chat", req->session_id(), options_.metrics));
}

grpc::ServerUnaryReactor* CombsService::GetConversation(grpc::CallbackServerContext* ctx,
                                                        const v1::GetConversationRequest* req, v1::Conversation* resp) {
  const Call call(ctx, "GetConversation", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  auto conv = engine_->conversation(req->session_id());
  if (conv.ok()) {
    for (const auto& m : *conv) {
      v1::ChatMessage* out = resp->add_messages();
      if (m.contains("role") && m["role"].is_string()) out->set_role(m["role"].get<std::string>());
      if (m.contains("content") && m["content"].is_string()) out->set_content(m["content"].get<std::string>());
    }
  }
  return done(ctx, call, conv.status());
}

grpc::ServerUnaryReactor* CombsService::Rollback(grpc::CallbackServerContext* ctx, const v1::RollbackRequest* req,
                                                 v1::RollbackResponse* resp) {
  const Call call(ctx, "Rollback", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  auto len = engine_->rollback(req->session_id(), req->n());
  if (len.ok()) resp->set_length(*len);
  return done(ctx, call, len.status());
}

grpc::ServerUnaryReactor* CombsService::Reset(grpc::CallbackServerContext* ctx, const v1::ResetRequest* req,
                                              v1::ResetResponse*) {
  const Call call(ctx, "Reset", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  return done(ctx, call, engine_->reset(req->session_id()));
}

grpc::ServerUnaryReactor* CombsService::Fork(grpc::CallbackServerContext* ctx, const v1::ForkRequest* req,
                                             v1::ForkResponse* resp) {
  const Call call(ctx, "Fork", req->session_id(), options_.metrics);
  if (draining_) return done(ctx, call, unavailable_error("combs-server is shutting down"));
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  auto id = engine_->fork(req->session_id());
  if (id.ok()) {
    own(*id, caller(ctx).value());
    resp->set_session_id(*id);
  }
  return done(ctx, call, id.status());
}

grpc::ServerUnaryReactor* CombsService::ExportSession(grpc::CallbackServerContext* ctx,
                                                      const v1::ExportSessionRequest* req, v1::ExportSessionResponse* resp) {
  const Call call(ctx, "ExportSession", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  auto blob = engine_->export_session(req->session_id());
  if (blob.ok()) resp->set_session(std::move(blob).value());
  return done(ctx, call, blob.status());
}

grpc::ServerUnaryReactor* CombsService::ImportSession(grpc::CallbackServerContext* ctx,
                                                      const v1::ImportSessionRequest* req, v1::ImportSessionResponse* resp) {
  const Call call(ctx, "ImportSession", "", options_.metrics);
  if (draining_) return done(ctx, call, unavailable_error("combs-server is shutting down"));
  auto key = caller(ctx);
  if (!key.ok()) return done(ctx, call, key.status());
  auto id = engine_->import_session(req->session(), *key, keys_.prefix_namespace(*key));
  if (id.ok()) {
    own(*id, *key);
    resp->set_session_id(*id);
  }
  return done(ctx, call, id.status());
}

grpc::ServerUnaryReactor* CombsService::CloseSession(grpc::CallbackServerContext* ctx,
                                                     const v1::CloseSessionRequest* req, v1::CloseSessionResponse*) {
  const Call call(ctx, "CloseSession", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  Status s = engine_->close(req->session_id());
  if (s.ok() && keys_.enabled()) {
    std::lock_guard<std::mutex> lock(owners_mu_);
    owners_.erase(req->session_id());
  }
  return done(ctx, call, s);
}

grpc::ServerUnaryReactor* CombsService::GetSession(grpc::CallbackServerContext* ctx, const v1::GetSessionRequest* req,
                                                   v1::SessionInfo* resp) {
  const Call call(ctx, "GetSession", req->session_id(), options_.metrics);
  if (Status a = check_owner(ctx, req->session_id()); !a.ok()) return done(ctx, call, a);
  auto info = engine_->info(req->session_id());
  if (info.ok()) fill_info(*info, resp);
  return done(ctx, call, info.status());
}

grpc::ServerUnaryReactor* CombsService::ListSessions(grpc::CallbackServerContext* ctx, const v1::ListSessionsRequest*,
                                                     v1::ListSessionsResponse* resp) {
  const Call call(ctx, "ListSessions", "", options_.metrics);
  auto key = caller(ctx);
  if (!key.ok()) return done(ctx, call, key.status());
  std::lock_guard<std::mutex> lock(owners_mu_);
  std::unordered_map<std::string, std::string> live;
  for (const SessionInfo& i : engine_->list()) {
    if (keys_.enabled()) {
      auto it = owners_.find(i.id);
      if (it == owners_.end()) continue;
      live.insert(*it);  // ownership of sessions that expired is dropped below
      if (it->second != *key) continue;
    }
    fill_info(i, resp->add_sessions());
  }
  if (keys_.enabled()) owners_.swap(live);
  return done(ctx, call, ok_status());
}

grpc::ServerUnaryReactor* CombsService::Tokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest* req,
                                                 v1::TokenizeResponse* resp) {
  const Call call(ctx, "Tokenize", "", options_.metrics);
  if (auto key = caller(ctx); !key.ok()) return done(ctx, call, key.status());
  if (tokenizer_ == nullptr) return done(ctx, call, failed_precondition_error("tokenize: this model has no tokenizer"));
  for (int32_t id : tokenizer_->encode(req->text(), {req->add_special(), req->parse_special()})) resp->add_ids(id);
  return done(ctx, call, ok_status());
}

grpc::ServerUnaryReactor* CombsService::Detokenize(grpc::CallbackServerContext* ctx, const v1::DetokenizeRequest* req,
                                                   v1::DetokenizeResponse* resp) {
  const Call call(ctx, "Detokenize", "", options_.metrics);
  if (auto key = caller(ctx); !key.ok()) return done(ctx, call, key.status());
  if (tokenizer_ == nullptr) return done(ctx, call, failed_precondition_error("detokenize: this model has no tokenizer"));
  std::vector<int32_t> ids(req->ids().begin(), req->ids().end());
  for (int32_t id : ids) {
    if (id < 0 || id >= tokenizer_->n_vocab()) {
      return done(ctx, call, invalid_argument_error("detokenize: token id " + std::to_string(id) + " is outside the vocabulary"));
    }
  }
  resp->set_text(tokenizer_->decode(ids, req->render_special()));
  return done(ctx, call, ok_status());
}

grpc::ServerUnaryReactor* CombsService::GetModelInfo(grpc::CallbackServerContext* ctx, const v1::GetModelInfoRequest*,
                                                     v1::ModelInfo* resp) {
  const Call call(ctx, "GetModelInfo", "", options_.metrics);
  if (auto key = caller(ctx); !key.ok()) return done(ctx, call, key.status());
  const Model& m = engine_->model();
  const ModelConfig& c = m.config();
  resp->set_architecture(c.arch_name);
  if (auto name = m.file().get_string("general.name"); name.ok()) resp->set_name(*name);
  resp->set_n_vocab(c.n_vocab);
  resp->set_n_layers(c.n_layers);
  resp->set_n_embd(c.n_embd);
  resp->set_n_heads(c.n_heads);
  resp->set_n_kv_heads(c.n_kv_heads);
  resp->set_context_length(c.context_length);
  resp->set_weight_dtype(std::string(dtype_name(m.layers[0].wq.dtype())));
  std::map<DType, std::pair<int32_t, int64_t>> mix;  // tensors and bytes of each type
  for (const gguf::TensorInfo& t : m.file().tensors()) {
    auto& [tensors, bytes] = mix[t.dtype];
    ++tensors;
    bytes += static_cast<int64_t>(t.nbytes);
  }
  std::vector<std::pair<DType, std::pair<int32_t, int64_t>>> shares(mix.begin(), mix.end());
  std::sort(shares.begin(), shares.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  for (const auto& [dtype, count] : shares) {
    v1::TensorTypeShare* s = resp->add_tensor_types();
    s->set_dtype(std::string(dtype_name(dtype)));
    s->set_tensors(count.first);
    s->set_bytes(count.second);
  }
  resp->set_bos_id(tokenizer_ ? tokenizer_->bos_id() : -1);
  resp->set_eos_id(tokenizer_ ? tokenizer_->eos_id() : -1);
  resp->set_has_chat_template(engine_->has_chat_template());
  if (tokenizer_) {
    for (int32_t id : tokenizer_->end_of_generation()) resp->add_eog_ids(id);
  }
  const EngineStats st = engine_->stats();
  resp->set_kv_pages_total(st.pages_total);
  return done(ctx, call, ok_status());
}

}  // namespace combs::server
