// The gRPC API contract (proto/combs/v1/combs.proto): the service offers every RPC of the session
// API, and optional sampling fields keep "unset" apart from zero across the wire.
#include <catch2/catch.hpp>

#include <set>
#include <string>

#include "combs/v1/combs.grpc.pb.h"
#include "combs/v1/combs.pb.h"

TEST_CASE("the combs service declares the session API", "[server]") {
  const auto* service = combs::v1::GenerateRequest::descriptor()->file()->FindServiceByName("Combs");
  REQUIRE(service != nullptr);
  std::set<std::string> methods;
  for (int i = 0; i < service->method_count(); ++i) methods.insert(service->method(i)->name());
  for (const char* m : {"CreateSession", "Generate", "Rollback", "Reset", "Fork", "CloseSession", "GetSession",
                        "ListSessions", "Tokenize", "Detokenize", "GetModelInfo", "Chat", "GetConversation"}) {
    INFO(m);
    CHECK(methods.count(m) == 1);
  }
  CHECK(service->FindMethodByName("Generate")->server_streaming());
  CHECK_FALSE(service->FindMethodByName("Rollback")->server_streaming());
}

TEST_CASE("generate requests round trip with unset sampling fields kept unset", "[server]") {
  combs::v1::GenerateRequest r;
  r.set_session_id("0123456789abcdef0123456789abcdef");
  r.mutable_tokens()->add_ids(1);
  r.mutable_tokens()->add_ids(42);
  r.set_max_tokens(16);
  r.mutable_sampling()->set_temperature(0.0f);  // set to zero: greedy, not "default"
  (*r.mutable_sampling()->mutable_logit_bias())[7] = -2.5f;
  r.add_stop("\n\n");
  const std::string wire = r.SerializeAsString();
  combs::v1::GenerateRequest back;
  REQUIRE(back.ParseFromString(wire));
  CHECK(back.session_id() == r.session_id());
  REQUIRE(back.input_case() == combs::v1::GenerateRequest::kTokens);
  CHECK(back.tokens().ids_size() == 2);
  CHECK(back.sampling().has_temperature());
  CHECK(back.sampling().temperature() == 0.0f);
  CHECK_FALSE(back.sampling().has_top_p());
  CHECK(back.sampling().logit_bias().at(7) == -2.5f);
  CHECK(back.stop(0) == "\n\n");
  combs::v1::GenerateResponse last;
  last.set_finished(true);
  last.set_finish_reason(combs::v1::FINISH_REASON_EOS);
  last.mutable_usage()->set_output_tokens(3);
  combs::v1::GenerateResponse parsed;
  REQUIRE(parsed.ParseFromString(last.SerializeAsString()));
  CHECK(parsed.finished());
  CHECK(parsed.finish_reason() == combs::v1::FINISH_REASON_EOS);
  CHECK(parsed.usage().output_tokens() == 3);
}
