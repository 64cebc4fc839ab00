// The combs.v1.Combs gRPC service: adapts the Engine's API (gRPC callback API; reactors never wait
// for a forward — the engine runs them on its scheduler thread and pushes events back).
// API keys (optional): every call carries `authorization: Bearer <key>`; a missing or unknown key
// is UNAUTHENTICATED; a session belongs to the key that created (or forked) it and is NOT_FOUND for
// every other key, so ids cannot be probed.
// Every call gets a request id (the client's `x-request-id` metadata when sane, else a random one),
// sent back as `x-request-id` initial metadata, logged with the call's outcome and counted in the
// metrics.
// Thread-safe; the engine, tokenizer and metrics must outlive the service.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "combs/engine/engine.h"
#include "combs/model/tokenizer.h"
#include "combs/v1/combs.grpc.pb.h"
#include "api_keys.h"
#include "metrics.h"

namespace combs::server {

struct ServiceOptions {
  ApiKeys api_keys;  // none: no authentication, every caller sees every session
  int64_t max_input_tokens = 0;    // per Generate request; 0: up to the session's context
  Metrics* metrics = nullptr;      // optional
};

class CombsService final : public combs::v1::Combs::CallbackService {
 public:
  // tokenizer may be null (a model without one: text input and output are refused).
  // Sessions the engine already holds (restored from a journal) keep the owners they were made by.
  CombsService(Engine& engine, const Tokenizer* tokenizer, ServiceOptions options = {})
      : engine_(&engine), tokenizer_(tokenizer), keys_(options.api_keys), options_(std::move(options)) {
    for (const SessionInfo& i : engine.list()) owners_[i.id] = i.owner;
  }

  // Shutdown has begun: CreateSession, Fork and Generate are UNAVAILABLE (a client retries on
  // another replica); calls on existing sessions and running streams go on.
  void drain() { draining_ = true; }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx, const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Chat(grpc::CallbackServerContext* ctx,
                                                       const v1::ChatRequest* req) override;
  grpc::ServerUnaryReactor* GetConversation(grpc::CallbackServerContext* ctx, const v1::GetConversationRequest* req,
                                            v1::Conversation* resp) override;
  grpc::ServerUnaryReactor* Rollback(grpc::CallbackServerContext* ctx, const v1::RollbackRequest* req,
                                     v1::RollbackResponse* resp) override;
  grpc::ServerUnaryReactor* Reset(grpc::CallbackServerContext* ctx, const v1::ResetRequest* req,
                                  v1::ResetResponse* resp) override;
  grpc::ServerUnaryReactor* Fork(grpc::CallbackServerContext* ctx, const v1::ForkRequest* req,
                                 v1::ForkResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* ctx, const v1::GetSessionRequest* req,
                                       v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx, const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest* req,
                                     v1::TokenizeResponse* resp) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* ctx, const v1::DetokenizeRequest* req,
                                       v1::DetokenizeResponse* resp) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* ExportSession(grpc::CallbackServerContext* ctx, const v1::ExportSessionRequest* req,
                                          v1::ExportSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ImportSession(grpc::CallbackServerContext* ctx, const v1::ImportSessionRequest* req,
                                          v1::ImportSessionResponse* resp) override;

 private:
  // The caller's key ("" without authentication), or UNAUTHENTICATED.
  StatusOr<std::string> caller(grpc::CallbackServerContext* ctx) const;
  // OK when the caller may use the session; NOT_FOUND otherwise (also for unknown sessions).
  Status check_owner(grpc::CallbackServerContext* ctx, const std::string& session);
  void own(const std::string& session, const std::string& key);

  Engine* engine_;
  const Tokenizer* tokenizer_;
  ApiKeys keys_;
  ServiceOptions options_;
  std::atomic<bool> draining_{false};
  std::mutex owners_mu_;
  std::unordered_map<std::string, std::string> owners_;  // session id -> key
  int owned_since_prune_ = 0;
};

// combs Status -> grpc::Status (the codes are the same numbers).
grpc::Status to_grpc(const Status& s);

}  // namespace combs::server
