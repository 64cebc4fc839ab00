// combs-tokenize: prints the token ids of a text, separated by spaces (works on vocab-only GGUFs).
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "combs/model/gguf.h"
#include "combs/model/tokenizer.h"
#include "common/flags.h"

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-tokenize", {{"model", ""}, {"text", ""}, {"file", ""}},
                     {"no-bos", "parse-special"});
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("--model PATH (--text TEXT | --file F) [--no-bos] [--parse-special]");
    return 0;
  }
  if (flags.str("model").empty()) return std::fprintf(stderr, "combs-tokenize: --model PATH is required\n"), 2;
  if (flags.given("text") == flags.given("file")) {
    return std::fprintf(stderr, "combs-tokenize: give exactly one of --text and --file\n"), 2;
  }
  std::string text = flags.str("text");
  if (flags.given("file")) {
    std::ifstream f(flags.str("file"), std::ios::binary);
    if (!f) return std::fprintf(stderr, "combs-tokenize: cannot read %s\n", flags.str("file").c_str()), 1;
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  auto file = gguf::GgufFile::open(flags.str("model"));
  if (!file.ok()) return std::fprintf(stderr, "combs-tokenize: %s\n", file.status().to_string().c_str()), 1;
  auto tok = Tokenizer::from_gguf(**file);
  if (!tok.ok()) return std::fprintf(stderr, "combs-tokenize: %s\n", tok.status().to_string().c_str()), 1;
  const auto ids = (*tok)->encode(text, {!flags.on("no-bos"), flags.on("parse-special")});
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += std::to_string(ids[i]);
  }
  std::printf("%s\n", out.c_str());
  return 0;
}
