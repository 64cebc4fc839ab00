// combs-mkmodel: writes a GGUF model with random weights of a named shape.
#include <cstdio>
#include <string>

#include "combs/model/random_model.h"
#include "common/files.h"
#include "common/flags.h"

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-mkmodel", {{"shape", "tiny"}, {"dtype", "bf16"}, {"seed", "1"},
                                       {"vocab", ""}, {"chat-template", ""}, {"out", ""},
                                       {"layers", "0"}});
  if (!flags.parse(argc, argv)) return 2;
  std::string shapes;
  for (const auto& n : shape_names()) shapes += (shapes.empty() ? "" : "|") + n;
  if (flags.help_requested()) {
    flags.print_usage("--out PATH [--shape " + shapes +
                      "] [--dtype f32|f16|bf16|" + quant_mix_names() + "] [--seed N] [--vocab VOCAB.gguf] [--chat-template FILE.jinja] [--layers N]\n"
                      "  (q4_k_m, ...: llama.cpp's per-tensor mixes of its file types, quantized by combs;\n"
                      "   --layers: the shape's first N layers only, e.g. to time one layer's kernels of a large shape)");
    return 0;
  }
  if (flags.str("out").empty()) {
    std::fprintf(stderr, "combs-mkmodel: --out PATH is required\n");
    return 2;
  }
  RandomModelOptions o;
  auto shape = named_shape(flags.str("shape"));
  if (!shape.ok()) {
    std::fprintf(stderr, "combs-mkmodel: %s\n", shape.status().message().c_str());
    return 2;
  }
  o.shape = *shape;
  long long layers;
  if (!flags.integer("layers", &layers, 0, 4096)) return 2;
  if (layers > 0) o.shape.n_layers = static_cast<int>(layers);
  if (const Status t = set_weight_type(flags.str("dtype"), &o); !t.ok()) {
    std::fprintf(stderr, "combs-mkmodel: --dtype: %s\n", t.message().c_str());
    return 2;
  }
  long long seed;
  if (!flags.integer("seed", &seed, 0, (1ll << 62))) return 2;
  o.seed = static_cast<uint64_t>(seed);
  o.vocab_path = flags.str("vocab");
  if (flags.given("chat-template")) {  // checked here: a template that does not parse is refused
    auto source = tools::read_chat_template(flags.str("chat-template"));
    if (!source.ok()) return std::fprintf(stderr, "combs-mkmodel: --chat-template %s\n", source.status().message().c_str()), 1;
    o.chat_template = std::move(source).value();
  }
  const Status s = write_random_model(o, flags.str("out"));
  if (!s.ok()) {
    std::fprintf(stderr, "combs-mkmodel: %s\n", s.to_string().c_str());
    return 1;
  }
  std::fprintf(stderr, "combs-mkmodel: wrote %s (%s, %s, seed %lld)\n", flags.str("out").c_str(),
               o.shape.name.c_str(), o.mix ? std::string(o.mix->name).c_str() : std::string(dtype_name(o.dtype)).c_str(), seed);
  return 0;
}
