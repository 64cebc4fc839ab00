// combs chat: a conversation on one session, interactive (line editing, /commands) or from a file.
#pragma once

#include <string>

#include "combs/v1/combs.grpc.pb.h"

namespace combs::cli {

struct ChatOptions {
  std::string session;        // empty: a new session
  std::string api_key;
  std::string system;         // a system message before the first turn
  std::string messages_file;  // non-interactive: a JSON array of messages sent as one turn
  int max_tokens = 256;
  float temperature = 0.8f;
  unsigned long long seed = 0;
};

// Returns the process's exit status.
int run_chat(combs::v1::Combs::Stub& stub, const ChatOptions& options);

}  // namespace combs::cli
