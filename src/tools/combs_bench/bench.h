// combs-bench: benchmark programs (never timed assertions in tests). Each subcommand prints a
// Markdown table with its figures and the bound or baseline measured in the same run.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace combs::bench {

// --name value flags of one subcommand. Unknown flags and bad values are errors (exit 2).
class Flags {
 public:
  // Parses argv[first..]; on error prints it and returns false.
  bool parse(int argc, char** argv, int first, const std::map<std::string, std::string>& known);
  std::string str(const std::string& name) const { return values_.at(name); }
  // Integer, or a comma-separated list of them; false (with a message) when malformed.
  bool ints(const std::string& name, std::vector<long long>* out) const;
  bool int1(const std::string& name, long long* out) const;

 private:
  std::map<std::string, std::string> values_;
};

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v);

int run_kv(int argc, char** argv);

}  // namespace combs::bench
