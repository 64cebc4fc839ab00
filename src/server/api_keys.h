// API keys, shared by the gRPC service and the HTTP API: callers send `authorization: Bearer
// <key>`; with no keys configured there is no authentication (every caller is the key "").
// Each key is also a tenant of the prefix cache: its sessions' cached pages serve only its own
// sessions, unless sharing across keys is configured.
// Immutable after construction: thread-safe.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "combs/base/status.h"

namespace combs::server {

class ApiKeys {
 public:
  ApiKeys() = default;  // no authentication
  ApiKeys(std::set<std::string> keys, bool share_prefix_cache)
      : keys_(keys.begin(), keys.end()), share_prefix_cache_(share_prefix_cache) {}
  // One key a line; '#' comments and blank lines ignored. INVALID_ARGUMENT for an unreadable file
  // or one without a key.
  static StatusOr<ApiKeys> load(const std::string& path, bool share_prefix_cache);

  bool enabled() const { return !keys_.empty(); }
  // The caller's key from its authorization header's value (nullopt: none sent); "" without
  // authentication. UNAUTHENTICATED for a missing, malformed or unknown key.
  StatusOr<std::string> authenticate(std::optional<std::string_view> authorization) const;
  // The prefix cache namespace of a key's sessions (a hash of the key, or one for all).
  std::string prefix_namespace(const std::string& key) const;

 private:
  std::set<std::string, std::less<>> keys_;
  bool share_prefix_cache_ = false;
};

}  // namespace combs::server
