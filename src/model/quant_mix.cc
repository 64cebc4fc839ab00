#include "combs/model/quant_mix.h"

#include <cctype>
#include <charconv>

namespace combs {
namespace {

constexpr QuantMix kMixes[] = {
    {"q4_0", DType::kQ4_0, 2},     {"q4_1", DType::kQ4_1, 3},     {"q5_0", DType::kQ5_0, 8},
    {"q5_1", DType::kQ5_1, 9},     {"q8_0", DType::kQ8_0, 7},     {"q2_k", DType::kQ2_K, 10},
    {"q3_k_m", DType::kQ3_K, 12},  {"q4_k_m", DType::kQ4_K, 15},  {"q5_k_m", DType::kQ5_K, 17},
    {"q6_k", DType::kQ6_K, 18},    {"iq4_nl", DType::kIQ4_NL, 25}, {"iq4_xs", DType::kIQ4_XS, 30},
    {"mxfp4_moe", DType::kMXFP4, 38},
};

// The layer of "blk.N.*", or -1.
int layer_of(std::string_view tensor) {
  if (tensor.substr(0, 4) != "blk.") return -1;
  int n = -1;
  const char* begin = tensor.data() + 4;
  std::from_chars(begin, tensor.data() + tensor.size(), n);
  return n;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between.
bool more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

DType fallback(DType t) {
  switch (t) {
    case DType::kQ2_K: case DType::kQ3_K: return DType::kQ4_0;
    case DType::kQ4_K: return DType::kQ5_0;
    case DType::kQ5_K: return DType::kQ5_1;
    case DType::kQ6_K: return DType::kQ8_0;
    case DType::kIQ4_XS: return DType::kIQ4_NL;
    default: return t;
  }
}

}  // namespace

const QuantMix* find_quant_mix(std::string_view name) {
  for (const QuantMix& m : kMixes) {
    if (m.name.size() != name.size()) continue;
    bool same = true;
    for (size_t i = 0; i < name.size(); ++i) same &= std::tolower(static_cast<unsigned char>(name[i])) == m.name[i];
    if (same) return &m;
  }
  return nullptr;
}

std::string quant_mix_names() {
  std::string s;
  for (const QuantMix& m : kMixes) s += (s.empty() ? "" : ", ") + std::string(m.name);
  return s;
}

DType quant_mix_type(const QuantMix& mix, std::string_view tensor, int64_t row_elems, bool output, int n_layers,
                     int n_gqa, int n_expert) {
  const std::string_view n = mix.name;
  if (mix.base == DType::kMXFP4) {  // MXFP4_MOE: the experts (3-D tensors) in MXFP4, all else Q8_0
    const bool experts = tensor.find("_exps.") != std::string_view::npos;
    return experts && row_elems % 32 == 0 ? DType::kMXFP4 : DType::kQ8_0;
  }
  const bool whole = row_elems % 256 == 0;
  if (output) return !whole || mix.base == DType::kQ8_0 ? DType::kQ8_0 : DType::kQ6_K;
  const int i = layer_of(tensor);
  const bool iq4 = n == "iq4_nl" || n == "iq4_xs";
  DType t = mix.base;
  if (ends_with(tensor, "attn_v.weight")) {
    if (n == "q2_k") t = n_gqa >= 4 ? DType::kQ4_K : DType::kQ3_K;
    else if (n == "q3_k_m") t = i < 2 ? DType::kQ5_K : DType::kQ4_K;
    else if (iq4 && n_gqa >= 4) t = DType::kQ5_K;
    else if ((n == "q4_k_m" || n == "q5_k_m") && more_bits(i, n_layers)) t = DType::kQ6_K;
    if (n_expert == 8) t = DType::kQ8_0;  // "bumping this to Q8_0 trades just ~128MB"
  } else if (ends_with(tensor, "attn_k.weight") && n_expert == 8) {
    t = DType::kQ8_0;
  } else if (tensor.find("ffn_down") != std::string_view::npos) {  // experts' and shared ones' too
    if (n == "q2_k") t = DType::kQ3_K;
    else if (n == "q3_k_m") t = i < n_layers / 16 ? DType::kQ5_K : DType::kQ4_K;
    else if ((n == "q4_k_m" || n == "q5_k_m") && more_bits(i, n_layers)) t = DType::kQ6_K;
    else if (iq4 && i < n_layers / 8) t = DType::kQ5_K;
  } else if (ends_with(tensor, "attn_output.weight")) {
    if (n_expert == 8) {
      if (n == "q2_k" || n == "q3_k_m" || n == "iq4_nl" || n == "q4_k_m" || n == "iq4_xs") t = DType::kQ5_K;
    } else if (n == "q2_k") t = DType::kQ3_K;
    else if (n == "q3_k_m") t = DType::kQ4_K;
  }
  return whole ? t : fallback(t);
}

}  // namespace combs
