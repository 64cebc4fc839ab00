#include "combs/model/random_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "combs/backend/cpu/cpu_ops.h"
#include "combs/model/gguf.h"
#include "combs/model/model.h"

namespace combs {
namespace {

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the name
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform in [center - half_width, center + half_width). One rounding (a fused multiply-add)
// whatever the build: a compiler free to contract a * b + c would give builds with and without
// FMA instructions (-march=native vs portable) different files, and the references recorded on
// them (tests/data/models) stale hashes.
void fill_uniform(float* dst, int64_t n, uint64_t seed, float center, float half_width) {
  uint64_t s = seed;
  for (int64_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53;
    dst[i] = std::fma(half_width, static_cast<float>(2.0 * u - 1.0), center);
  }
}

// Values [first, first + n) of a tensor whose values come in chunks of 2^20, chunk c from
// fill_uniform(seed + c 2^20): element j of a chunk is splitmix's (j + 1)-th draw from that
// seed, so any range can start anywhere (the generator's state after j draws is seed + j gamma).
void fill_range(float* dst, int64_t first, int64_t n, uint64_t seed, float center,
                float half_width) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  for (int64_t g = first; g < first + n;) {
    const int64_t chunk = g / kChunk * kChunk, len = std::min(chunk + kChunk, first + n) - g;
    fill_uniform(dst + (g - first), len,
                 seed + static_cast<uint64_t>(chunk) + static_cast<uint64_t>(g - chunk) * kGamma,
                 center, half_width);
    g += len;
  }
}

// extra: control tokens after the bytes (phi3's <|endoftext|>: llama.cpp's vocabulary loader
// looks it up in any model whose name says phi3).
int builtin_vocab(gguf::GgufWriter& w, const std::vector<std::string>& extra) {
  using gguf::Value;
  using gguf::ValueType;
  std::vector<Value> tokens, scores, types;
  auto add = [&](std::string text, int type) {
    tokens.push_back(Value::str(std::move(text)));
    scores.push_back(Value::f32(0.0f));
    types.push_back(Value::i32(type));
  };
  add("<unk>", 2);  // llama.cpp token types: 2 unknown, 3 control, 6 byte
  add("<s>", 3);
  add("</s>", 3);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    add(buf, 6);
  }
  for (const std::string& t : extra) add(t, 3);
  const int n = static_cast<int>(tokens.size());
  w.set("tokenizer.ggml.model", Value::str("llama"));
  w.set("tokenizer.ggml.tokens", Value::array(ValueType::kString, std::move(tokens)));
  w.set("tokenizer.ggml.scores", Value::array(ValueType::kF32, std::move(scores)));
  w.set("tokenizer.ggml.token_type", Value::array(ValueType::kI32, std::move(types)));
  w.set("tokenizer.ggml.unknown_token_id", Value::u32(0));
  w.set("tokenizer.ggml.bos_token_id", Value::u32(1));
  w.set("tokenizer.ggml.eos_token_id", Value::u32(2));
  w.set("tokenizer.ggml.add_bos_token", Value::boolean(true));
  w.set("tokenizer.ggml.add_eos_token", Value::boolean(false));
  return n;
}

}  // namespace

std::vector<std::string> shape_names() {
  return {"tiny",     "qwen2-tiny", "qwen2-tiny-384", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "llama-yarn-tiny", "phi3-tiny",
          "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny", "gpt-oss-tiny", "llama-1b", "llama-8b", "qwen3-8b", "gemma3-4b",
          "qwen3-30b-a3b", "gpt-oss-20b"};
}

StatusOr<ModelShape> named_shape(std::string_view name) {
  ModelShape s;
  s.name = std::string(name);
  // The tiny shapes: 64-wide heads (as the real ones; the GPU's flash kernels need 64 or 128),
  // windows of 8 keys so that a test's few dozen tokens cross them, untied outputs (random tied
  // embeddings make a model repeat its last token whatever the layers compute).
  auto tiny = [&](const char* arch) {
    s.arch = arch;
    s.n_embd = 256, s.n_layers = 2, s.n_heads = 4, s.n_kv_heads = 2, s.n_ff = 512;
    s.context_length = 2048;
  };
  if (name == "tiny" || name == "qwen2-tiny") {
    tiny(name == "tiny" ? "llama" : "qwen2");
    s.rope_freq_base = name == "tiny" ? 10000.0f : 1000000.0f;
    s.rms_eps = name == "tiny" ? 1e-5f : 1e-6f;
    return s;
  }
  if (name == "qwen2-tiny-384") {  // rows of 384: not whole 256-wide K-quant blocks, as Qwen2-0.5B's 896
    tiny("qwen2");                  // (and down's of 768 are, as its 4,864)
    s.n_embd = 384, s.n_heads = 6, s.n_kv_heads = 2, s.n_ff = 768;
    s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    return s;
  }
  if (name == "qwen3-tiny") {  // heads wider than n_embd / n_heads, as Qwen3-0.6B's
    tiny("qwen3");
    s.n_heads = 8, s.n_kv_heads = 4, s.head_dim = 64;
    s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    return s;
  }
  if (name == "gemma2-tiny") {  // the default pattern (every other layer windowed); small caps that bite
    tiny("gemma2");
    // llama.cpp's gemma2 always ties the output; embeddings small enough that a token's own
    // row does not win the logits (its logit ~ n_embd * embed_scale * std / rms(x) sigmas).
    s.n_layers = 4, s.sliding_window = 8, s.attn_softcap = 2.0f, s.final_softcap = 0.5f;
    s.tied_output = true, s.embd_std = 1.0f / 256.0f;
    s.rms_eps = 1e-6f;
    return s;
  }
  if (name == "gemma3-tiny") {  // the default pattern (5 of 6 windowed), linear scaling as 4B's
    tiny("gemma3");
    s.n_layers = 6, s.sliding_window = 8, s.rms_eps = 1e-6f;
    s.rope_freq_base = 1000000.0f, s.rope_freq_base_swa = 10000.0f;
    s.rope_scaling = "linear", s.rope_scale_factor = 8.0f;
    return s;
  }
  if (name == "gemma3-swa-tiny") {  // gemma3-tiny with every layer windowed (sliding_window_pattern 0)
    tiny("gemma3");
    s.n_layers = 4, s.sliding_window = 8, s.swa_all = true, s.rms_eps = 1e-6f;
    s.rope_freq_base = 1000000.0f, s.rope_freq_base_swa = 10000.0f;
    return s;
  }
  if (name == "llama-yarn-tiny") {
    tiny("llama");
    s.rope_scaling = "yarn", s.rope_scale_factor = 4.0f, s.rope_orig_context = 512;
    s.rope_attn_factor = 1.1f;
    return s;
  }
  if (name == "phi3-tiny") {  // as Phi-4-mini: fused projections, 3/4 of each head rotated, LongRoPE
    tiny("phi3");
    s.rope_dim = 48, s.fused_qkv = true, s.longrope = true;
    s.rope_orig_context = 2048, s.rope_attn_factor = 1.19f;  // short factors up to 2,048 positions
    return s;
  }
  // With experts: 8 of width 128 (4 of 256 in the llama one), 2 chosen per token.
  if (name == "qwen3moe-tiny") {
    tiny("qwen3moe");
    s.n_heads = 8, s.n_kv_heads = 4, s.head_dim = 64;
    s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    s.n_expert = 8, s.n_expert_used = 2, s.n_ff_exp = 128;
    return s;
  }
  if (name == "qwen2moe-tiny") {  // and a shared expert of width 256
    tiny("qwen2moe");
    s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    s.n_expert = 8, s.n_expert_used = 2, s.n_ff_exp = 128, s.n_ff_shexp = 256;
    return s;
  }
  if (name == "mixtral-tiny") {  // llama with experts of width feed_forward_length
    tiny("llama");
    s.n_ff = 256, s.n_expert = 4, s.n_expert_used = 2;
    return s;
  }
  if (name == "gpt-oss-tiny") {  // as gpt-oss-20b: 4 of the experts, even layers windowed, YaRN
    tiny("gpt-oss");
    s.n_layers = 4, s.n_heads = 8, s.n_kv_heads = 2, s.head_dim = 64, s.n_ff = 128;
    s.sliding_window = 8, s.rope_freq_base = 150000.0f;
    s.rope_scaling = "yarn", s.rope_scale_factor = 4.0f, s.rope_orig_context = 512;
    s.n_expert = 8, s.n_expert_used = 4, s.n_ff_exp = 128;
    return s;
  }
  if (name == "qwen3-30b-a3b") {  // Qwen3-30B-A3B
    s.arch = "qwen3moe";
    s.n_embd = 2048, s.n_layers = 48, s.n_heads = 32, s.n_kv_heads = 4, s.n_ff = 6144, s.head_dim = 128;
    s.context_length = 40960, s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    s.n_expert = 128, s.n_expert_used = 8, s.n_ff_exp = 768;
    return s;
  }
  if (name == "gpt-oss-20b") {  // gpt-oss-20b (its o200k vocabulary aside)
    s.arch = "gpt-oss";
    s.n_embd = 2880, s.n_layers = 24, s.n_heads = 64, s.n_kv_heads = 8, s.head_dim = 64, s.n_ff = 2880;
    s.context_length = 131072, s.rope_freq_base = 150000.0f, s.sliding_window = 128;
    s.rope_scaling = "yarn", s.rope_scale_factor = 32.0f, s.rope_orig_context = 4096;
    s.n_expert = 32, s.n_expert_used = 4, s.n_ff_exp = 2880;
    return s;
  }
  if (name == "llama-1b") {  // Llama-3.2-1B
    s.arch = "llama";
    s.n_embd = 2048, s.n_layers = 16, s.n_heads = 32, s.n_kv_heads = 8, s.n_ff = 8192;
    s.context_length = 131072, s.rope_freq_base = 500000.0f, s.tied_output = true;
    return s;
  }
  if (name == "llama-8b") {  // Llama-3.1-8B (with tied embeddings, as the peer's figures used)
    s.arch = "llama";
    s.n_embd = 4096, s.n_layers = 32, s.n_heads = 32, s.n_kv_heads = 8, s.n_ff = 14336;
    s.context_length = 131072, s.rope_freq_base = 500000.0f, s.tied_output = true;
    return s;
  }
  if (name == "qwen3-8b") {  // Qwen3-8B
    s.arch = "qwen3";
    s.n_embd = 4096, s.n_layers = 36, s.n_heads = 32, s.n_kv_heads = 8, s.n_ff = 12288, s.head_dim = 128;
    s.context_length = 40960, s.rope_freq_base = 1000000.0f, s.rms_eps = 1e-6f;
    return s;
  }
  if (name == "gemma3-4b") {  // Gemma-3-4B (text)
    s.arch = "gemma3";
    s.n_embd = 2560, s.n_layers = 34, s.n_heads = 8, s.n_kv_heads = 4, s.n_ff = 10240, s.head_dim = 256;
    s.context_length = 131072, s.rope_freq_base = 1000000.0f, s.rope_freq_base_swa = 10000.0f;
    s.sliding_window = 1024, s.rms_eps = 1e-6f, s.tied_output = true;
    s.rope_scaling = "linear", s.rope_scale_factor = 8.0f;
    return s;
  }
  std::string known;
  for (const auto& n : shape_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid_argument_error("unknown model shape '" + std::string(name) + "' (known: " + known + ")");
}

Status write_random_model(const RandomModelOptions& o, const std::string& path) {
  using gguf::Value;
  if (!o.mix && !can_quantize(o.dtype)) {
    return unimplemented_error("random models are not written as " + std::string(dtype_name(o.dtype)));
  }
  const ModelShape& s = o.shape;
  gguf::GgufWriter w;
  w.set("general.architecture", Value::str(s.arch));
  w.set("general.name", Value::str("combs random " + s.name));
  const uint32_t file_type = o.mix ? o.mix->file_type : o.dtype == DType::kF32 ? 0 : o.dtype == DType::kF16 ? 1
                             : o.dtype == DType::kQ8_0 ? 7 : 32;  // llama.cpp's LLAMA_FTYPE_*
  w.set("general.file_type", Value::u32(file_type));
  const std::string a = s.arch + ".";
  w.set(a + "context_length", Value::u32(static_cast<uint32_t>(s.context_length)));
  w.set(a + "embedding_length", Value::u32(s.n_embd));
  w.set(a + "block_count", Value::u32(s.n_layers));
  w.set(a + "feed_forward_length", Value::u32(s.n_ff));
  w.set(a + "attention.head_count", Value::u32(s.n_heads));
  w.set(a + "attention.head_count_kv", Value::u32(s.n_kv_heads));
  w.set(a + "rope.freq_base", Value::f32(s.rope_freq_base));
  const int head_dim = s.head_dim > 0 ? s.head_dim : s.n_embd / s.n_heads;
  if (s.head_dim > 0) {
    w.set(a + "attention.key_length", Value::u32(head_dim));
    w.set(a + "attention.value_length", Value::u32(head_dim));
  }
  const int rope_dim = s.rope_dim > 0 ? s.rope_dim : head_dim;
  w.set(a + "rope.dimension_count", Value::u32(rope_dim));
  w.set(a + "attention.layer_norm_rms_epsilon", Value::f32(s.rms_eps));
  if (s.sliding_window > 0) w.set(a + "attention.sliding_window", Value::u32(s.sliding_window));
  if (s.swa_pattern > 0 || s.swa_all) w.set(a + "attention.sliding_window_pattern", Value::u32(s.swa_all ? 0 : s.swa_pattern));
  if (s.rope_freq_base_swa > 0) w.set(a + "rope.freq_base_swa", Value::f32(s.rope_freq_base_swa));
  if (s.attn_softcap > 0) w.set(a + "attn_logit_softcapping", Value::f32(s.attn_softcap));
  if (s.final_softcap > 0) w.set(a + "final_logit_softcapping", Value::f32(s.final_softcap));
  if (!s.rope_scaling.empty()) {
    w.set(a + "rope.scaling.type", Value::str(s.rope_scaling));
    w.set(a + "rope.scaling.factor", Value::f32(s.rope_scale_factor));
  }
  if (s.rope_orig_context > 0) {
    w.set(a + "rope.scaling.original_context_length", Value::u32(static_cast<uint32_t>(s.rope_orig_context)));
  }
  if (s.rope_attn_factor > 0) w.set(a + "rope.scaling.attn_factor", Value::f32(s.rope_attn_factor));
  if (s.n_expert > 0) {
    w.set(a + "expert_count", Value::u32(s.n_expert));
    w.set(a + "expert_used_count", Value::u32(s.n_expert_used));
    if (s.n_ff_exp > 0) w.set(a + "expert_feed_forward_length", Value::u32(s.n_ff_exp));
    if (s.n_ff_shexp > 0) w.set(a + "expert_shared_feed_forward_length", Value::u32(s.n_ff_shexp));
  }
  int n_vocab = 259;
  std::unique_ptr<gguf::GgufFile> vocab;
  if (o.vocab_path.empty()) {
    n_vocab = builtin_vocab(w, s.arch == "phi3" ? std::vector<std::string>{"<|endoftext|>"} : std::vector<std::string>{});
  } else {
    COMBS_ASSIGN_OR_RETURN(vocab, gguf::GgufFile::open(o.vocab_path));
    COMBS_ASSIGN_OR_RETURN(const gguf::Array* tokens, vocab->get_array("tokenizer.ggml.tokens"));
    n_vocab = static_cast<int>(tokens->items.size());
    if (n_vocab < 1) return invalid_argument_error(o.vocab_path + ": empty tokenizer.ggml.tokens");
    for (const auto& [key, value] : vocab->metadata()) {
      if (key.rfind("tokenizer.", 0) == 0) w.set(key, value);
    }
  }
  if (!o.chat_template.empty()) w.set("tokenizer.chat_template", Value::str(o.chat_template));
  w.set(a + "vocab_size", Value::u32(n_vocab));

  // The file as Model reads it back: its layout from the metadata written above.
  ModelConfig c;
  {
    c.n_embd = s.n_embd, c.n_expert = s.n_expert;
    COMBS_RETURN_IF_ERROR(apply_architecture(s.arch, &c));
    c.n_vocab = n_vocab, c.n_layers = s.n_layers, c.n_heads = s.n_heads;
    c.n_kv_heads = s.n_kv_heads, c.head_dim = head_dim, c.n_ff = s.n_ff, c.rope_dim = rope_dim;
    c.qkv_fused = s.fused_qkv;
    if (s.n_expert > 0) {
      c.n_expert_used = s.n_expert_used;
      c.n_ff_exp = s.n_ff_exp > 0 ? s.n_ff_exp : s.n_ff;
      if (c.shared_expert && s.n_ff_shexp > 0) c.n_ff = s.n_ff_shexp;
    }
  }
  for (const WeightSpec& spec : weight_specs(c)) {
    // Of the optional tensors: the output unless tied, LongRoPE's factors where asked for.
    const bool factors = spec.name.rfind("rope_factors_", 0) == 0;
    if (!spec.required && !(spec.name == "output.weight" && !s.tied_output) && !(factors && s.longrope)) continue;
    int64_t numel = 1;
    for (int64_t d : spec.dims) numel *= d;
    const bool matrix = spec.dims.size() >= 2;
    const bool router = spec.name.find("ffn_gate_inp") != std::string::npos;  // F32, as converters keep it
    const bool output = spec.name == "output.weight" || (spec.name == "token_embd.weight" && s.tied_output);
    DType dt = spec.f32_only || !matrix || router ? DType::kF32
               : o.mix ? quant_mix_type(*o.mix, spec.name, spec.dims[0], output, s.n_layers, s.n_heads / s.n_kv_heads,
                                        s.n_expert)
                       : o.dtype;
    if (is_block_quant(dt) && spec.dims[0] % dtype_block_elems(dt) != 0) dt = DType::kBF16;  // no whole blocks
    const bool is_norm = spec.name.find("norm") != std::string::npos;
    const bool is_bias = spec.name.find(".bias") != std::string::npos;
    const bool sinks = spec.name.find("attn_sinks") != std::string::npos;  // logits in [-1.5, 2.5)
    // Matrices ~ U with std 1/sqrt(in), norms near 1, small biases, embeddings as ModelShape says.
    const float embd_std = s.embd_std > 0 ? s.embd_std : 1.0f / c.embed_scale;
    // LongRoPE divisors in [1, 3) (short) and [1, 9) (long).
    const float half = factors ? (spec.name.find("long") != std::string::npos ? 4.0f : 1.0f)
                       : sinks ? 2.0f : is_norm ? 0.1f : is_bias ? 0.1f
                       : spec.name == "token_embd.weight" ? std::sqrt(3.0f) * embd_std
                                                          : std::sqrt(3.0f / float(spec.dims[0]));
    const float center = factors ? 1.0f + half : sinks ? 0.5f : is_norm ? 1.0f : 0.0f;
    const uint64_t seed = name_seed(o.seed, spec.name);
    w.add_tensor(spec.name, spec.dims, dt, [=](void* dst) {
      // Pieces of 2^20 values through a bounded f32 buffer (4 MB: a model's load, measured right
      // after in tests, finds no large freed block to reuse), each piece's generation and
      // conversion (the block types' scale searches above all) split over every core in whole
      // 256-value blocks; values as fill_range defines them, whatever the split.
      constexpr int64_t kPiece = int64_t{1} << 20;
      std::vector<float> buf(static_cast<size_t>(std::min(numel, kPiece)));
      const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
      for (int64_t i = 0; i < numel; i += kPiece) {
        const int64_t n = std::min(kPiece, numel - i);
        char* out = static_cast<char*>(dst) + nbytes_for(dt, i);
        auto convert = [&](int64_t p0, int64_t len) {
          fill_range(buf.data() + p0, i + p0, len, seed, center, half);
          cpu::quantize_row(buf.data() + p0, dt, out + nbytes_for(dt, p0), len);
        };
        const int64_t parts = n < (1 << 16) ? 1 : cores;
        const int64_t step = (n / parts + 255) / 256 * 256;
        std::vector<std::thread> workers;
        for (int64_t p0 = step; p0 < n; p0 += step)
          workers.emplace_back(convert, p0, std::min(step, n - p0));
        convert(0, std::min(step, n));
        for (std::thread& t : workers) t.join();
      }
    });
  }
  return w.write(path);
}

Status set_weight_type(std::string_view name, RandomModelOptions* o) {
  o->mix = nullptr;
  if (name == "f32" || name == "f16" || name == "bf16") {
    parse_dtype(name, &o->dtype);
    return ok_status();
  }
  if (const QuantMix* m = find_quant_mix(name)) {
    o->mix = m;
    o->dtype = m->base;
    return ok_status();
  }
  return invalid_argument_error("unknown weight type '" + std::string(name) + "' (f32, f16, bf16, or one of llama.cpp's file types: " +
                                quant_mix_names() + ")");
}

Status write_random_model_once(const RandomModelOptions& options, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) return ok_status();
  COMBS_RETURN_IF_ERROR(write_random_model(options, path + ".tmp"));
  std::filesystem::rename(path + ".tmp", path, ec);
  if (ec) return internal_error("renaming " + path + ".tmp: " + ec.message());
  return ok_status();
}

}  // namespace combs
