#include "flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace combs::tools {

Flags::Flags(std::string program, std::map<std::string, std::string> defaults,
             std::vector<std::string> switches)
    : program_(std::move(program)), values_(std::move(defaults)), switches_(std::move(switches)) {
  for (const auto& s : switches_) values_.emplace(s, "0");
}

bool Flags::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    const std::string name = arg.rfind("--", 0) == 0 ? arg.substr(2) : "";
    if (name.empty() || !values_.count(name)) {
      std::fprintf(stderr, "%s: unknown argument '%s' (see --help)\n", program_.c_str(), arg.c_str());
      return false;
    }
    given_[name] = true;
    if (std::find(switches_.begin(), switches_.end(), name) != switches_.end()) {
      values_[name] = "1";
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s needs a value\n", program_.c_str(), arg.c_str());
      return false;
    }
    values_[name] = argv[++i];
  }
  return true;
}

void Flags::print_usage(const std::string& synopsis) const {
  std::printf("usage: %s %s\nflags (default):\n", program_.c_str(), synopsis.c_str());
  for (const auto& [k, v] : values_) {
    const bool sw = std::find(switches_.begin(), switches_.end(), k) != switches_.end();
    auto it = help_text_.find(k);
    std::printf("  --%-20s %s%s%s\n", k.c_str(), sw ? "(switch)" : v.empty() ? "(none)" : v.c_str(),
                it == help_text_.end() ? "" : "\n      ", it == help_text_.end() ? "" : it->second.c_str());
  }
}

bool Flags::load_config(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    std::fprintf(stderr, "%s: config %s: cannot open\n", program_.c_str(), path.c_str());
    return false;
  }
  auto trim = [](std::string s) {
    const size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  const std::map<std::string, bool> from_command_line = given_;
  char buf[4096];
  bool ok = true;
  for (int line_no = 1; ok && std::fgets(buf, sizeof buf, f) != nullptr; ++line_no) {
    std::string line = trim(buf);
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    std::string name = eq == std::string::npos ? "" : trim(line.substr(0, eq));
    std::string value = eq == std::string::npos ? "" : trim(line.substr(eq + 1));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
    const bool sw = std::find(switches_.begin(), switches_.end(), name) != switches_.end();
    if (name.empty()) {
      std::fprintf(stderr, "%s: %s:%d: expected 'name = value'\n", program_.c_str(), path.c_str(), line_no);
      ok = false;
    } else if (!values_.count(name) || name == "config") {
      std::fprintf(stderr, "%s: %s:%d: unknown flag '%s' (see --help)\n", program_.c_str(), path.c_str(), line_no,
                   name.c_str());
      ok = false;
    } else if (sw && value != "true" && value != "false" && value != "1" && value != "0") {
      std::fprintf(stderr, "%s: %s:%d: %s takes true or false\n", program_.c_str(), path.c_str(), line_no, name.c_str());
      ok = false;
    } else if (!from_command_line.count(name)) {  // the command line wins
      values_[name] = sw ? (value == "true" || value == "1" ? "1" : "0") : value;
      given_[name] = true;
    }
  }
  std::fclose(f);
  return ok;
}

bool Flags::integer(const std::string& name, long long* out, long long lo, long long hi) const {
  const std::string& s = values_.at(name);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0 || v < lo || v > hi) {
    std::fprintf(stderr, "%s: --%s: '%s' is not an integer in [%lld, %lld]\n", program_.c_str(),
                 name.c_str(), s.c_str(), lo, hi);
    return false;
  }
  *out = v;
  return true;
}

bool Flags::number(const std::string& name, double* out) const {
  const std::string& s = values_.at(name);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v)) {
    std::fprintf(stderr, "%s: --%s: '%s' is not a number\n", program_.c_str(), name.c_str(), s.c_str());
    return false;
  }
  *out = v;
  return true;
}

bool Flags::ints(const std::string& name, std::vector<long long>* out) const {
  out->clear();
  const std::string& s = values_.at(name);
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find_first_of(", ", start);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(start, end - start);
    if (!item.empty()) {
      char* stop = nullptr;
      errno = 0;
      const long long v = std::strtoll(item.c_str(), &stop, 10);
      if (*stop != '\0' || errno != 0) {
        std::fprintf(stderr, "%s: --%s: '%s' is not an integer\n", program_.c_str(), name.c_str(),
                     item.c_str());
        return false;
      }
      out->push_back(v);
    }
    start = end + 1;
  }
  return true;
}

}  // namespace combs::tools
