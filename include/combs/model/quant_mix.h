// llama.cpp's file types as per-tensor mixes of block types ("Q4_K_M" is Q4_K with Q6_K on the
// output and on some layers' attn_v / ffn_down, ...): the rules of its llama-quantize for dense
// models, read off the files it writes (tests/data/quant/mixes.txt: two probe models quantized to
// every file type below, and the test that these rules give the same type for every tensor).
// combs-mkmodel writes random models with these mixes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "combs/backend/dtype.h"

namespace combs {

struct QuantMix {
  std::string_view name;  // llama-quantize's name, lower case: "q4_k_m"
  DType base;             // the type of the tensors no rule names
  uint32_t file_type;     // general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
};

// The mix of a name (case-insensitive), or nullptr.
const QuantMix* find_quant_mix(std::string_view name);
// "q4_0, q4_1, ..." for messages.
std::string quant_mix_names();

// What the mix stores a weight matrix as. tensor: its GGUF name ("blk.3.attn_v.weight");
// row_elems: its rows' length (ggml's ne0); output: it is the output projection (output.weight,
// or token_embd.weight where the output is tied to it); n_layers, n_gqa, n_expert: the model's
// layer count, query heads per KV head and experts (8 experts: llama.cpp's Mixtral rules, attn_k
// and attn_v in Q8_0, attn_output in Q5_K; experts' ffn_down as a dense one's). Rows that are not whole 256-element blocks get llama.cpp's
// fallbacks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0, IQ4_XS -> IQ4_NL).
// mxfp4_moe (gpt-oss's files): the experts in MXFP4, every other matrix (output included) in Q8_0.
DType quant_mix_type(const QuantMix& mix, std::string_view tensor, int64_t row_elems, bool output, int n_layers,
                     int n_gqa, int n_expert = 0);

}  // namespace combs
