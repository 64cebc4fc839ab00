// combs-bench tokenizer: encode and decode speed on about 1 MB of English text, per vocabulary.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "bench.h"
#include "combs/model/gguf.h"
#include "combs/model/pretokenizer.h"
#include "combs/model/tokenizer.h"
#include "common/flags.h"

namespace combs::bench {

int run_tokenizer(int argc, char** argv) {
  tools::Flags flags("combs-bench tokenizer",
                     {{"vocabs", "tests/data/vocab/ggml-vocab-llama-spm.gguf,"
                                 "tests/data/vocab/ggml-vocab-llama-bpe.gguf,"
                                 "tests/data/vocab/ggml-vocab-gpt-2.gguf"},
                      {"file", "/usr/share/common-licenses/GPL-3"}, {"kib", "1024"}, {"reps", "5"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (the text of --file is repeated up to --kib KiB)");
    return 0;
  }
  long long kib, reps;
  if (!flags.integer("kib", &kib, 1, 1 << 20) || !flags.integer("reps", &reps, 1, 1000)) return 2;
  std::ifstream f(flags.str("file"), std::ios::binary);
  const std::string base{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  if (base.empty()) return std::fprintf(stderr, "combs-bench: cannot read %s\n", flags.str("file").c_str()), 2;
  std::string text;
  while (text.size() < static_cast<size_t>(kib) << 10) text += base;
  text.resize(static_cast<size_t>(kib) << 10);
  std::printf("# combs-bench tokenizer: %zu bytes of %s (repeated), one thread, median of %lld\n\n",
              text.size(), flags.str("file").c_str(), reps);
  std::printf("| vocabulary | tokens | encode s | encode MB/s | decode s | round trip |\n|---|---|---|---|---|---|\n");
  std::string list = flags.str("vocabs");
  for (size_t start = 0; start < list.size();) {
    size_t end = std::min(list.find(',', start), list.size());
    const std::string path = list.substr(start, end - start);
    start = end + 1;
    auto file = gguf::GgufFile::open(path);
    if (!file.ok()) return std::fprintf(stderr, "combs-bench: %s\n", file.status().to_string().c_str()), 1;
    auto tok = Tokenizer::from_gguf(**file);
    if (!tok.ok()) return std::fprintf(stderr, "combs-bench: %s\n", tok.status().to_string().c_str()), 1;
    std::vector<double> te, td;
    std::vector<int32_t> ids;
    std::string back;
    for (long long r = 0; r < reps; ++r) {
      double t0 = now_seconds();
      ids = (*tok)->encode(text, {false, false});
      te.push_back(now_seconds() - t0);
      t0 = now_seconds();
      back = (*tok)->decode(ids);
      td.push_back(now_seconds() - t0);
    }
    const double enc = median(te);
    std::printf("| %s | %zu | %.3f | %.1f | %.3f | %s |\n", path.substr(path.rfind('/') + 1).c_str(),
                ids.size(), enc, text.size() / enc / 1e6, median(td), back == text ? "exact" : "DIFFERS");
  }
  // Why the three most common pre-tokenizers keep hand-written matchers: the split alone, both ways.
  std::printf("\n| pre-tokenizer | words | hand-written MB/s | PCRE2 JIT MB/s | same words |\n|---|---|---|---|---|\n");
  for (const char* pre : {"gpt-2", "llama-bpe", "qwen2"}) {
    double mbs[2];
    std::vector<PreTokenizer::Word> words[2];
    for (int m = 0; m < 2; ++m) {
      auto p = PreTokenizer::create(pre, m == 0 ? PreTokenizer::Matcher::kHandWritten : PreTokenizer::Matcher::kRegex);
      if (!p.ok()) return std::fprintf(stderr, "combs-bench: %s\n", p.status().to_string().c_str()), 1;
      std::vector<double> t;
      for (long long r = 0; r < reps; ++r) {
        words[m].clear();
        const double t0 = now_seconds();
        (*p)->split(text, words[m]);
        t.push_back(now_seconds() - t0);
      }
      mbs[m] = text.size() / median(t) / 1e6;
    }
    const bool same = words[0].size() == words[1].size() &&
                      std::equal(words[0].begin(), words[0].end(), words[1].begin(),
                                 [](const auto& a, const auto& b) { return a.begin == b.begin && a.end == b.end; });
    std::printf("| %s | %zu | %.1f | %.1f | %s |\n", pre, words[0].size(), mbs[0], mbs[1], same ? "yes" : "NO");
  }
  return 0;
}

}  // namespace combs::bench
