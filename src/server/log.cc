#include "log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

namespace combs::server {

namespace {

bool g_json = false;

// A JSON string literal (nlohmann-json's escaping; invalid UTF-8 becomes U+FFFD).
std::string json_quoted(std::string_view s) {
  return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

Status init_logging(const std::string& format, const std::string& level) {
  if (format != "text" && format != "json") return invalid_argument_error("--log-format must be text or json, not '" + format + "'");
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return invalid_argument_error("--log-level must be trace, debug, info, warn, error or off, not '" + level + "'");
  }
  g_json = format == "json";
  auto logger = spdlog::stderr_logger_mt("combs");
  logger->set_pattern(g_json ? R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l",%v})" : "%Y-%m-%dT%H:%M:%S.%eZ %l %v",
                      spdlog::pattern_time_type::utc);
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
  spdlog::flush_every(std::chrono::seconds(1));
  return ok_status();
}

LogLine& LogLine::add(std::string_view key, std::string_view value) {
  const bool plain = !g_json && !value.empty() && value.find_first_of(" \"=\\\n\r\t") == std::string_view::npos;
  fields_.emplace_back(std::string(key), plain ? std::string(value) : json_quoted(value));
  return *this;
}

LogLine& LogLine::add(std::string_view key, int64_t value) {
  fields_.emplace_back(std::string(key), std::to_string(value));
  return *this;
}

LogLine& LogLine::add(std::string_view key, double value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", value);
  fields_.emplace_back(std::string(key), buf);
  return *this;
}

std::string LogLine::render() const {
  std::string out;
  for (const auto& [k, v] : fields_) {
    if (!out.empty()) out += g_json ? "," : " ";
    out += g_json ? json_quoted(k) + ":" + v : k + "=" + v;
  }
  return out;
}

void LogLine::info() const { spdlog::info("{}", render()); }
void LogLine::warn() const { spdlog::warn("{}", render()); }
void LogLine::error() const { spdlog::error("{}", render()); }

std::string request_id(std::string_view from_client) {
  bool ok = !from_client.empty() && from_client.size() <= 64;
  for (char c : from_client) ok &= std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  if (ok) return std::string(from_client);
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

}  // namespace combs::server
