// combs-bench SUBCOMMAND [flags]: see bench.h.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bench.h"

namespace combs::bench {

bool Flags::parse(int argc, char** argv, int first,
                  const std::map<std::string, std::string>& known) {
  values_ = known;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || !known.count(arg.substr(2))) {
      std::fprintf(stderr, "combs-bench: unknown argument '%s'\n", arg.c_str());
      return false;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "combs-bench: %s needs a value\n", arg.c_str());
      return false;
    }
    values_[arg.substr(2)] = argv[++i];
  }
  return true;
}

bool Flags::ints(const std::string& name, std::vector<long long>* out) const {
  out->clear();
  const std::string& s = values_.at(name);
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, end - start);
    char* stop = nullptr;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v < 0) {
      std::fprintf(stderr, "combs-bench: --%s: '%s' is not a non-negative integer\n", name.c_str(),
                   item.c_str());
      return false;
    }
    out->push_back(v);
    start = end + 1;
  }
  return true;
}

bool Flags::int1(const std::string& name, long long* out) const {
  std::vector<long long> v;
  if (!ints(name, &v)) return false;
  if (v.size() != 1) {
    std::fprintf(stderr, "combs-bench: --%s takes one integer\n", name.c_str());
    return false;
  }
  *out = v[0];
  return true;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace combs::bench

int main(int argc, char** argv) {
  const char* usage =
      "usage: combs-bench SUBCOMMAND [flags]\n"
      "  kv    decode attention, paged vs contiguous, against measured memory bandwidth\n"
      "        (combs-bench kv --help for its flags)\n";
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "kv")) return combs::bench::run_kv(argc, argv);
  std::fprintf(stderr, "combs-bench: unknown subcommand '%s'\n%s", argv[1], usage);
  return 2;
}
