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
  // One line of help per flag, shown by print_usage.
  void describe(std::map<std::string, std::string> help) { help_text_ = std::move(help); }
  // A config file: `name = value` lines (`#` comments, blank lines; a value may be "quoted";
  // switches take true/false). Flags given on the command line win. Prints the problem (file and
  // line) and returns false on an unknown name or a malformed line.
  bool load_config(const std::string& path);
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
  std::map<std::string, std::string> help_text_;
};

}  // namespace combs::tools
