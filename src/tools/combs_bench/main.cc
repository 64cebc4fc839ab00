// combs-bench SUBCOMMAND [flags]: see bench.h.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "bench.h"

namespace combs::bench {

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
      "  model prompt processing and decode tokens/s against the memory-bandwidth bound\n"
      "  tokenizer  encode/decode speed on 1 MB of English text\n"
      "  engine  aggregate tokens/s and inter-token latency of 1/8/64 sessions at once\n"
      "  prefix  sessions sharing a system prompt: time to first token and tokens/s, prefix cache on and off\n"
      "  journal restart time with many sessions in the session journal\n"
      "  resume  an evicted session brought back: host tier copy vs recompute, per history length\n"
      "  spec    one session's decode with speculative decoding, across draft acceptance, against without\n"
      "  window  an all-windowed model's sessions: the pages behind the window released vs kept\n"
      "  gpu     the CUDA backend: decode, prefill, many sessions, paged attention (CUDA builds)\n"
      "  (combs-bench SUBCOMMAND --help for the flags of each)\n";
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "kv")) return combs::bench::run_kv(argc, argv);
  if (!std::strcmp(argv[1], "model")) return combs::bench::run_model(argc, argv);
  if (!std::strcmp(argv[1], "tokenizer")) return combs::bench::run_tokenizer(argc, argv);
  if (!std::strcmp(argv[1], "engine")) return combs::bench::run_engine(argc, argv);
  if (!std::strcmp(argv[1], "prefix")) return combs::bench::run_prefix(argc, argv);
  if (!std::strcmp(argv[1], "journal")) return combs::bench::run_journal(argc, argv);
  if (!std::strcmp(argv[1], "resume")) return combs::bench::run_resume(argc, argv);
  if (!std::strcmp(argv[1], "spec")) return combs::bench::run_spec(argc, argv);
  if (!std::strcmp(argv[1], "window")) return combs::bench::run_window(argc, argv);
#ifdef COMBS_HAVE_CUDA
  if (!std::strcmp(argv[1], "gpu")) return combs::bench::run_gpu(argc, argv);
#endif
  std::fprintf(stderr, "combs-bench: unknown subcommand '%s'\n%s", argv[1], usage);
  return 2;
}
