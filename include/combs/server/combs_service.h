// The combs.v1.Combs gRPC service: adapts the Engine's API (gRPC callback API; reactors never wait
// for a forward — the engine runs them on its scheduler thread and pushes events back).
// Thread-safe; the engine and tokenizer must outlive the service.
#pragma once

#include <memory>

#include "combs/engine/engine.h"
#include "combs/model/tokenizer.h"
#include "combs/v1/combs.grpc.pb.h"

namespace combs::server {

class CombsService final : public combs::v1::Combs::CallbackService {
 public:
  // tokenizer may be null (a model without one: text input and output are refused).
  CombsService(Engine& engine, const Tokenizer* tokenizer) : engine_(&engine), tokenizer_(tokenizer) {}

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
  Engine* engine_;
  const Tokenizer* tokenizer_;
};

// combs Status -> grpc::Status (the codes are the same numbers).
grpc::Status to_grpc(const Status& s);

}  // namespace combs::server
