#include "api_keys.h"

#include <fstream>

#include "combs/base/sha256.h"

namespace combs::server {

StatusOr<ApiKeys> ApiKeys::load(const std::string& path, bool share_prefix_cache) {
  std::ifstream f(path);
  if (!f) return invalid_argument_error("--api-keys " + path + ": cannot read");
  std::set<std::string> keys;
  for (std::string line; std::getline(f, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!line.empty() && line[0] != '#') keys.insert(line);
  }
  if (keys.empty()) return invalid_argument_error("--api-keys " + path + " holds no key");
  return ApiKeys(std::move(keys), share_prefix_cache);
}

StatusOr<std::string> ApiKeys::authenticate(std::optional<std::string_view> authorization) const {
  if (keys_.empty()) return std::string();
  if (!authorization) return Status(StatusCode::kUnauthenticated, "missing 'authorization: Bearer <key>'");
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization->substr(0, kBearer.size()) != kBearer) {
    return Status(StatusCode::kUnauthenticated, "the authorization is not 'Bearer <key>'");
  }
  const std::string_view key = authorization->substr(kBearer.size());
  if (keys_.find(key) == keys_.end()) return Status(StatusCode::kUnauthenticated, "unknown API key");
  return std::string(key);
}

std::string ApiKeys::prefix_namespace(const std::string& key) const {
  if (share_prefix_cache_ || keys_.empty()) return "shared";
  return "key " + to_hex(Sha256().update(key).finish());
}

}  // namespace combs::server
