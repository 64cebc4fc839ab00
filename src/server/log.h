// combs-server's structured logs through spdlog: every event is one line of key=value pairs
// (`--log-format text`) or one JSON object (`--log-format json`), with a UTC timestamp and level.
//   LogLine("rpc").add("method", "Rollback").add("request_id", id).add("code", "OK").info();
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "combs/base/status.h"

namespace combs::server {

// format: "text" or "json"; level: trace, debug, info, warn, error, off.
Status init_logging(const std::string& format, const std::string& level);

class LogLine {
 public:
  explicit LogLine(std::string_view event) { add("event", event); }
  LogLine& add(std::string_view key, std::string_view value);
  LogLine& add(std::string_view key, const char* value) { return add(key, std::string_view(value)); }
  LogLine& add(std::string_view key, const std::string& value) { return add(key, std::string_view(value)); }
  LogLine& add(std::string_view key, int64_t value);
  LogLine& add(std::string_view key, int value) { return add(key, static_cast<int64_t>(value)); }
  LogLine& add(std::string_view key, double value);
  void info() const;
  void warn() const;
  void error() const;

 private:
  std::string render() const;
  std::vector<std::pair<std::string, std::string>> fields_;  // value already quoted for the format
};

// A request id: the client's own (x-request-id metadata) when it is 1 to 64 characters of
// [A-Za-z0-9._-], else 16 random hex digits.
std::string request_id(std::string_view from_client);

}  // namespace combs::server
