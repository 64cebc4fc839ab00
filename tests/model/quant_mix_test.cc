// combs' per-tensor mixes (combs/model/quant_mix.h) against what llama.cpp's llama-quantize wrote
// for two probe models (tests/data/quant/mixes.txt, made by tests/reference/mix_probe.py): every
// tensor of every file type the same.
#include <catch2/catch.hpp>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "combs/backend/quant.h"
#include "combs/model/quant_mix.h"

using namespace combs;

TEST_CASE("quant mixes give every tensor the type llama-quantize gives it", "[model][quant]") {
  struct Probe {
    int64_t n_embd, n_ff;
    int n_layers, n_gqa;
    bool tied;
  };
  const std::map<std::string, Probe> probes = {{"a", {256, 512, 16, 4, true}}, {"b", {320, 512, 16, 1, false}}};
  std::ifstream in(std::string(COMBS_TEST_DATA_DIR) + "/quant/mixes.txt");
  REQUIRE(in.good());
  std::map<std::string, int> checked;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string probe, type, tensor, want;
    REQUIRE(ls >> probe >> type >> tensor >> want);
    const Probe& p = probes.at(probe);
    const QuantMix* mix = find_quant_mix(type);
    REQUIRE(mix != nullptr);
    const bool down = tensor.find("ffn_down") != std::string::npos;
    const bool output = tensor == "output.weight" || (tensor == "token_embd.weight" && p.tied);
    const DType got = quant_mix_type(*mix, tensor, down ? p.n_ff : p.n_embd, output, p.n_layers, p.n_gqa);
    INFO(line);
    CHECK(std::string(quant_format(got)->name) == want);
    ++checked[type];
  }
  CHECK(checked.size() == 12);
  for (const auto& [type, n] : checked) CHECK(n >= 2 * 16 * 7);
  CHECK(find_quant_mix("Q4_K_M") == find_quant_mix("q4_k_m"));
  CHECK(find_quant_mix("q4_k_s") == nullptr);
}
