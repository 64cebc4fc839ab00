#include "log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <cstdio>
#include <random>

namespace combs::server {

namespace {

bool g_json = false;

std::string json_escape(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
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
  if (g_json) {
    fields_.emplace_back(std::string(key), "\"" + json_escape(value) + "\"");
  } else {
    const bool plain = !value.empty() && value.find_first_of(" \"=\\\n\r\t") == std::string_view::npos;
    fields_.emplace_back(std::string(key), plain ? std::string(value) : "\"" + json_escape(value) + "\"");
  }
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
    out += g_json ? "\"" + k + "\":" + v : k + "=" + v;
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
