// The combs.v1.Combs gRPC service: adapts the Engine's API (gRPC callback API; reactors never wait
// for a forward — the engine runs them on its scheduler thread and pushes events back).
// API keys (optional): every call carries `authorization: Bearer <key>`; a missing or unknown key
// is UNAUTHENTICATED; a session belongs to the key that created (or forked) it and is NOT_FOUND for
// every other key, so ids cannot be probed.
// Thread-safe; the engine and tokenizer must outlive the service.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "combs/engine/engine.h"
#include "combs/model/tokenizer.h"
#include "combs/v1/combs.grpc.pb.h"

namespace combs::server {

class CombsService final : public combs::v1::Combs::CallbackService {
 public:
  // tokenizer may be null (a model without one: text input and output are refused).
  // api_keys empty: no authentication, every caller sees every session.
  CombsService(Engine& engine, const Tokenizer* tokenizer, std::set<std::string> api_keys = {})
      : engine_(&engine), tokenizer_(tokenizer), keys_(std::move(api_keys)) {}

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx, const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override;
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

 private:
  // The caller's key ("" without authentication), or UNAUTHENTICATED.
  StatusOr<std::string> caller(grpc::CallbackServerContext* ctx) const;
  // OK when the caller may use the session; NOT_FOUND otherwise (also for unknown sessions).
  Status check_owner(grpc::CallbackServerContext* ctx, const std::string& session);
  void own(const std::string& session, const std::string& key);

  Engine* engine_;
  const Tokenizer* tokenizer_;
  std::set<std::string> keys_;
  std::mutex owners_mu_;
  std::unordered_map<std::string, std::string> owners_;  // session id -> key
};

// combs Status -> grpc::Status (the codes are the same numbers).
grpc::Status to_grpc(const Status& s);

}  // namespace combs::server
