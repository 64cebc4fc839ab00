// The GGUF reader: round trips with the writer, and a clear error for every kind of bad file.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <fstream>
#include <iterator>

#include "combs/model/gguf.h"
#include "combs/model/model.h"
#include "combs/model/random_model.h"
#include "support/temp_dir.h"

using namespace combs;
using namespace combs::gguf;
using combs::testing::TempDir;

namespace {

std::vector<char> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_all(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A small valid file: a few metadata types and two tensors.
std::vector<char> small_file(const TempDir& dir) {
  static const float a[4] = {1, 2, 3, 4};
  static const uint16_t b[64] = {};
  GgufWriter w;
  w.set("general.architecture", Value::str("llama"));
  w.set("x.count", Value::u32(7));
  w.set("x.list", Value::array(ValueType::kI32, {Value::i32(-1), Value::i32(2)}));
  w.add_tensor("a", {4}, DType::kF32, a);
  w.add_tensor("b", {32, 2}, DType::kBF16, b);
  const std::string path = dir.file("small.gguf");
  REQUIRE(w.write(path).ok());
  return read_all(path);
}

Status open_bytes(const TempDir& dir, const std::vector<char>& bytes) {
  const std::string path = dir.file("bad.gguf");
  write_all(path, bytes);
  return GgufFile::open(path).status();
}

// Offset of the first occurrence of `needle` in bytes.
size_t find(const std::vector<char>& bytes, const std::string& needle) {
  auto it = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  REQUIRE(it != bytes.end());
  return static_cast<size_t>(it - bytes.begin());
}

// A random f32 model of `shape` written into dir as SHAPE.gguf, checked to load: its path.
std::string valid_model_file(const TempDir& dir, const char* shape) {
  RandomModelOptions o;
  o.shape = std::move(named_shape(shape)).value();
  o.dtype = DType::kF32;
  const std::string path = dir.file(std::string(shape) + ".gguf");
  REQUIRE(write_random_model(o, path).ok());
  REQUIRE(Model::load(path).ok());
  return path;
}

}  // namespace

TEST_CASE("gguf round trip of metadata and tensors", "[model]") {
  TempDir dir;
  small_file(dir);
  auto f = GgufFile::open(dir.file("small.gguf"));
  REQUIRE(f.ok());
  CHECK((*f)->version() == 3);
  CHECK((*f)->get_string("general.architecture").value() == "llama");
  CHECK((*f)->get_uint("x.count").value() == 7);
  const Array* list = (*f)->get_array("x.list").value();
  REQUIRE(list->items.size() == 2);
  CHECK(std::get<int64_t>(list->items[0].v) == -1);
  const TensorInfo* a = (*f)->find_tensor("a");
  REQUIRE(a != nullptr);
  CHECK(a->dtype == DType::kF32);
  CHECK(static_cast<const float*>(a->data)[3] == 4.0f);
  CHECK((*f)->find_tensor("b")->dims == std::vector<int64_t>{32, 2});
  CHECK((*f)->get_uint("general.architecture").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("every truncation of a gguf file is a clear error", "[model]") {
  TempDir dir;
  const auto bytes = small_file(dir);
  for (size_t n = 0; n < bytes.size(); ++n) {
    const Status s = open_bytes(dir, std::vector<char>(bytes.begin(), bytes.begin() + n));
    INFO("truncated to " << n << " of " << bytes.size() << " bytes: " << s.to_string());
    REQUIRE_FALSE(s.ok());
    REQUIRE(s.message().find("bad.gguf") != std::string::npos);
  }
}

TEST_CASE("gguf with a wrong magic or version is rejected", "[model]") {
  TempDir dir;
  auto bytes = small_file(dir);
  auto wrong = bytes;
  wrong[0] = 'X';
  CHECK_THAT(open_bytes(dir, wrong).message(), Catch::Contains("magic"));
  wrong = bytes;
  wrong[4] = 9;
  const Status v = open_bytes(dir, wrong);
  CHECK(v.code() == StatusCode::kUnimplemented);
  CHECK_THAT(v.message(), Catch::Contains("version"));
}

TEST_CASE("gguf with bad tensor offsets types or dims is rejected", "[model]") {
  TempDir dir;
  const auto bytes = small_file(dir);
  // Tensor "b": name, u32 n_dims, u64 dims[2], u32 type, u64 offset.
  const size_t b = find(bytes, std::string("\x01\x00\x00\x00\x00\x00\x00\x00" "b", 9)) + 9;
  auto patch = [&](size_t at, const void* v, size_t n) {
    auto copy = bytes;
    std::memcpy(copy.data() + at, v, n);
    return open_bytes(dir, copy);
  };
  const uint64_t far = 1ull << 40, misaligned = 3;
  const uint32_t unknown_type = 16 /* IQ2_XXS */, five_dims = 5, zero_dims = 0;
  const uint64_t zero = 0;
  CHECK_THAT(patch(b + 4 + 16 + 4, &far, 8).message(), Catch::Contains("offset"));
  CHECK_THAT(patch(b + 4 + 16 + 4, &misaligned, 8).message(), Catch::Contains("alignment"));
  const Status t = patch(b + 4 + 16, &unknown_type, 4);
  CHECK(t.code() == StatusCode::kUnimplemented);
  CHECK_THAT(t.message(), Catch::Contains("type") && Catch::Contains("'b'") && Catch::Contains("(IQ2_XXS)") && Catch::Contains("Q4_K, Q5_K"));
  // A block type whose rows are not whole blocks (tensor b's rows are 32 long, a q4_k block 256):
  // refused by name before anything is read. (Data that runs past the end: the offset check above.)
  const uint32_t q4_k = 12;
  const Status blocks = patch(b + 4 + 16, &q4_k, 4);
  CHECK(blocks.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(blocks.message(), Catch::Contains("'b'") && Catch::Contains("not a multiple of the q4_k block size"));
  CHECK_THAT(patch(b, &five_dims, 4).message(), Catch::Contains("n_dims"));
  CHECK_THAT(patch(b, &zero_dims, 4).message(), Catch::Contains("n_dims"));
  CHECK_THAT(patch(b + 4, &zero, 8).message(), Catch::Contains("dims"));
  // A string length that runs past the end of the file.
  const size_t key = find(bytes, "x.count") - 8;
  const uint64_t huge = 1ull << 50;
  CHECK_THAT(patch(key, &huge, 8).message(), Catch::Contains("string length"));
}

TEST_CASE("model files with a wrong architecture or missing or misshapen tensors are rejected", "[model]") {
  TempDir dir;
  const auto bytes = read_all(valid_model_file(dir, "tiny"));
  auto load_patched = [&](const std::string& from, const std::string& to) {
    REQUIRE(from.size() == to.size());
    auto copy = bytes;
    std::memcpy(copy.data() + find(bytes, from), to.data(), to.size());
    write_all(dir.file("bad.gguf"), copy);
    return Model::load(dir.file("bad.gguf")).status();
  };
  // The architecture string "llama" -> "llamb".
  const Status arch = load_patched(std::string("\x05\x00\x00\x00\x00\x00\x00\x00llama", 13),
                                   std::string("\x05\x00\x00\x00\x00\x00\x00\x00llamb", 13));
  CHECK(arch.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(arch.message(), Catch::Contains("llamb") && Catch::Contains("general.architecture"));
  // A tensor renamed away: blk.1.ffn_up.weight -> blk.1.ffn_xx.weight.
  const Status missing = load_patched("blk.1.ffn_up.weight", "blk.1.ffn_xx.weight");
  CHECK_THAT(missing.message(), Catch::Contains("blk.1.ffn_up.weight") && Catch::Contains("missing"));
  // The metadata disagrees with the tensors: feed_forward_length 512 -> 513.
  auto copy = bytes;
  const size_t ff = find(bytes, "llama.feed_forward_length") + 25 + 4;
  uint32_t v;
  std::memcpy(&v, copy.data() + ff, 4);
  REQUIRE(v == 512);
  v = 513;
  std::memcpy(copy.data() + ff, &v, 4);
  write_all(dir.file("bad.gguf"), copy);
  const Status shape = Model::load(dir.file("bad.gguf")).status();
  CHECK_THAT(shape.message(), Catch::Contains("shape") && Catch::Contains("ffn_gate"));
  CHECK(Model::load(dir.file("does-not-exist.gguf")).status().code() == StatusCode::kNotFound);
}

TEST_CASE("non-finite norms, biases and sinks are refused by name", "[model]") {
  // The small F32 tensors (norms, biases, sinks, RoPE factors) are checked at load; a NaN or an
  // infinity there would turn every token's logits to NaN.
  TempDir dir;
  const std::string path = valid_model_file(dir, "gpt-oss-tiny");
  const auto bytes = read_all(path);
  for (const char* name : {"blk.1.attn_sinks.weight", "blk.0.attn_norm.weight", "blk.2.ffn_down_exps.bias"}) {
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      INFO(name << " " << bad);
      // The tensor's bytes (random values: found once in the file), its third element poisoned.
      std::string data;
      {
        auto file = GgufFile::open(path);
        REQUIRE(file.ok());
        const TensorInfo* t = (*file)->find_tensor(name);
        REQUIRE(t != nullptr);
        data.assign(static_cast<const char*>(t->data), t->nbytes);
      }
      auto copy = bytes;
      std::memcpy(copy.data() + find(bytes, data) + 2 * sizeof(float), &bad, sizeof bad);
      write_all(dir.file("bad.gguf"), copy);
      const Status s = Model::load(dir.file("bad.gguf")).status();
      CHECK(s.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(s.message(), Catch::Contains(name) && Catch::Contains("non-finite") && Catch::Contains("element 2"));
    }
  }
}

TEST_CASE("every architecture's missing or inconsistent keys and tensors are refused by name", "[model]") {
  TempDir dir;
  // A shape's f32 file changed by `patch`: Model::load's status.
  auto load_changed = [&](const char* shape, const std::function<void(std::vector<char>&)>& patch) {
    auto bytes = read_all(valid_model_file(dir, shape));
    patch(bytes);
    write_all(dir.file("bad.gguf"), bytes);
    return Model::load(dir.file("bad.gguf")).status();
  };
  // ... with `from` replaced by `to` (same length) once.
  auto load_patched = [&](const char* shape, const std::string& from, const std::string& to) {
    REQUIRE(from.size() == to.size());
    return load_changed(shape, [&](std::vector<char>& bytes) { std::memcpy(bytes.data() + find(bytes, from), to.data(), to.size()); });
  };
  const Status q_norm = load_patched("qwen3-tiny", "blk.1.attn_q_norm.weight", "blk.1.attn_q_norX.weight");
  CHECK_THAT(q_norm.message(), Catch::Contains("blk.1.attn_q_norm.weight") && Catch::Contains("missing"));
  const Status post = load_patched("gemma2-tiny", "blk.3.post_ffw_norm.weight", "blk.3.post_ffw_norX.weight");
  CHECK_THAT(post.message(), Catch::Contains("blk.3.post_ffw_norm.weight") && Catch::Contains("missing"));
  // RoPE scaling "linear" -> "cubicx": named with the choices.
  const Status scaling = load_patched("gemma3-tiny", "linear", "cubicx");
  CHECK(scaling.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(scaling.message(), Catch::Contains("rope.scaling.type") && Catch::Contains("cubicx") && Catch::Contains("yarn"));
  // A softcap of 2.0 -> -2.0 (the f32 after its key and type).
  const Status softcap = load_changed("gemma2-tiny", [](std::vector<char>& bytes) {
    const std::string key = "gemma2.attn_logit_softcapping";
    const size_t at = find(bytes, key) + key.size() + 4;
    float v;
    std::memcpy(&v, bytes.data() + at, 4);
    REQUIRE(v == 2.0f);
    v = -2.0f;
    std::memcpy(bytes.data() + at, &v, 4);
  });
  CHECK_THAT(softcap.message(), Catch::Contains("attn_logit_softcapping") && Catch::Contains("range"));
  // phi3: layer 0 fuses Q/K/V, so every layer must.
  const Status qkv = load_patched("phi3-tiny", "blk.1.attn_qkv.weight", "blk.1.attn_qkx.weight");
  CHECK_THAT(qkv.message(), Catch::Contains("blk.1.attn_qkv.weight") && Catch::Contains("missing"));
  // An architecture combs does not describe names the ones it does.
  const Status arch = load_patched("phi3-tiny", std::string("\x04\x00\x00\x00\x00\x00\x00\x00phi3", 12),
                                   std::string("\x04\x00\x00\x00\x00\x00\x00\x00phi4", 12));
  CHECK_THAT(arch.message(), Catch::Contains("'phi4' is not supported") && Catch::Contains("gemma3"));

  // Mixtures of experts: a u32 key's value changed.
  auto load_u32 = [&](const char* shape, const std::string& key, uint32_t from, uint32_t to) {
    return load_changed(shape, [&](std::vector<char>& bytes) {
      const size_t at = find(bytes, key) + key.size() + 4;
      uint32_t v;
      std::memcpy(&v, bytes.data() + at, 4);
      REQUIRE(v == from);
      std::memcpy(bytes.data() + at, &to, 4);
    });
  };
  const Status no_experts = load_patched("qwen3moe-tiny", "qwen3moe.expert_count", "qwen3moe.expert_counX");
  CHECK_THAT(no_experts.message(), Catch::Contains("qwen3moe.expert_count") && Catch::Contains("mixture of experts"));
  const Status zero = load_u32("qwen3moe-tiny", "qwen3moe.expert_count", 8, 0);
  CHECK_THAT(zero.message(), Catch::Contains("qwen3moe.expert_count") && Catch::Contains("missing or 0"));
  const Status used = load_u32("qwen3moe-tiny", "qwen3moe.expert_used_count", 2, 9);
  CHECK_THAT(used.message(), Catch::Contains("expert_used_count") && Catch::Contains("out of range"));
  const Status no_used = load_patched("mixtral-tiny", "llama.expert_used_count", "llama.expert_used_counX");
  CHECK_THAT(no_used.message(), Catch::Contains("llama.expert_used_count") && Catch::Contains("missing"));
  const Status width = load_u32("qwen3moe-tiny", "qwen3moe.expert_feed_forward_length", 128, 64);
  CHECK_THAT(width.message(), Catch::Contains("blk.0.ffn_gate_exps.weight") && Catch::Contains("expected"));
  const Status down = load_patched("qwen2moe-tiny", "blk.1.ffn_down_exps.weight", "blk.1.ffn_down_expX.weight");
  CHECK_THAT(down.message(), Catch::Contains("blk.1.ffn_down_exps.weight") && Catch::Contains("missing"));
  const Status shared = load_patched("qwen2moe-tiny", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_gate_inp_shexX.weight");
  CHECK_THAT(shared.message(), Catch::Contains("blk.0.ffn_gate_inp_shexp.weight") && Catch::Contains("missing"));
  // Experts in a file of an architecture without them: dense tensors missing, named.
  const Status dense = load_patched("qwen3moe-tiny", std::string("\x08\x00\x00\x00\x00\x00\x00\x00qwen3moe", 16),
                                    std::string("\x08\x00\x00\x00\x00\x00\x00\x00qwen3mox", 16));
  CHECK_THAT(dense.message(), Catch::Contains("'qwen3mox' is not supported") && Catch::Contains("qwen3moe"));
  // gpt-oss: sinks, the experts' and the attention output's biases, the FFN norm (stored as
  // post_attention_norm) and the window are required.
  for (const char* tensor : {"blk.2.attn_sinks.weight", "blk.1.ffn_up_exps.bias", "blk.3.ffn_gate_inp.bias",
                             "blk.0.attn_output.bias", "blk.1.post_attention_norm.weight"}) {
    std::string bad = tensor;
    bad[bad.size() - 3] = 'X';
    const Status missing = load_patched("gpt-oss-tiny", tensor, bad);
    CHECK_THAT(missing.message(), Catch::Contains(tensor) && Catch::Contains("missing"));
  }
  const Status no_window = load_patched("gpt-oss-tiny", "gpt-oss.attention.sliding_window", "gpt-oss.attention.sliding_windoX");
  CHECK_THAT(no_window.message(), Catch::Contains("gpt-oss.attention.sliding_window") && Catch::Contains("missing"));
  const Status zero_window = load_u32("gpt-oss-tiny", "gpt-oss.attention.sliding_window", 8, 0);
  CHECK_THAT(zero_window.message(), Catch::Contains("gpt-oss.attention.sliding_window") && Catch::Contains("out of range"));
}

namespace {
// A field of /proc/self/status (VmRSS, RssFile, ...), in bytes.
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}
}  // namespace

TEST_CASE("a loaded model's weights are resident once and not beside the file's pages", "[model]") {
  // A model of ~140 MB (the tiny shape with Llama 3's vocabulary: its embedding and output are most
  // of it). The weights are copied into one buffer and the mapping's pages of each copied tensor
  // given back: the file's resident pages grow by its metadata only, not by the tensor bytes.
  combs::testing::TempDir dir;
  RandomModelOptions o;
  o.shape = named_shape("tiny").value();
  o.vocab_path = std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf";
  const std::string path = dir.file("m.gguf");
  REQUIRE(write_random_model(o, path).ok());
  const int64_t file_before = status_bytes("RssFile"), anon_before = status_bytes("RssAnon");
  REQUIRE(file_before >= 0);
  auto m = Model::load(path);
  REQUIRE(m.ok());
  int64_t tensor_bytes = 0;
  for (const auto& t : (*m)->file().tensors()) tensor_bytes += static_cast<int64_t>(t.nbytes);
  const int64_t file_grown = status_bytes("RssFile") - file_before, anon_grown = status_bytes("RssAnon") - anon_before;
  INFO("tensor bytes " << tensor_bytes << "; file pages grew by " << file_grown << ", anonymous by " << anon_grown);
  CHECK(tensor_bytes > 100'000'000);
  CHECK(file_grown < tensor_bytes / 8);  // metadata (the vocabulary: ~8 MB of this file), not the weights (without
                                        // the pages given back: 141 MB)
  CHECK(anon_grown >= tensor_bytes);      // the copies
}
