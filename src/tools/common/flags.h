// --name value flags for the command-line tools: declared with defaults, unknown flags and
// malformed values rejected with a message naming the flag (the tools exit 2).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace combs::tools {

class Flags {
 public:
  // name -> default value; "" marks a flag without a default. Names listed in `switches` take no
  // value ("1" when given).
  Flags(std::string program, std::map<std::string, std::string> defaults,
        std::vector<std::string> switches = {});

  // Parses argv[first..]; prints the problem and returns false on error. --help prints usage.
  bool parse(int argc, char** argv, int first = 1);
  bool help_requested() const { return help_; }
  void print_usage(const std::string& synopsis) const;

  bool given(const std::string& name) const { return given_.count(name) > 0; }
  std::string str(const std::string& name) const { return values_.at(name); }
  // Integer / float / comma-separated integer list; false (with a message) when malformed.
  bool integer(const std::string& name, long long* out, long long lo, long long hi) const;
  bool number(const std::string& name, double* out) const;
  bool ints(const std::string& name, std::vector<long long>* out) const;
  bool on(const std::string& name) const { return values_.at(name) == "1"; }

 private:
  std::string program_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> switches_;
  std::map<std::string, bool> given_;
  bool help_ = false;
};

}  // namespace combs::tools
