// The runner against a float64 reference forward, and against itself: prefill chunkings, paged vs
// contiguous caches, batches vs single sequences, rollback and replay.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "combs/backend/cpu/cpu_ops.h"
#include "combs/model/sampler.h"
#include "support/model_helpers.h"
#include "support/model_reference.h"
#include "support/random.h"

using namespace combs;
using namespace combs::testing;

namespace {

std::string id_list(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

// The largest |got - want| / (1 + |want|) over every token's logits.
double worst_relative_error(const std::vector<float>& got, const std::vector<std::vector<double>>& want, int n_vocab) {
  double worst = 0;
  for (size_t t = 0; t < want.size(); ++t) {
    for (int v = 0; v < n_vocab; ++v) {
      const double g = got[t * n_vocab + v], w = want[t][v];
      worst = std::max(worst, std::abs(g - w) / (1.0 + std::abs(w)));
    }
  }
  return worst;
}

std::vector<int32_t> random_tokens(Rng& rng, int n, int n_vocab) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.integer(0, n_vocab - 1));
  return t;
}

// All logits of `tokens` appended to `cache` in chunks of the given sizes.
std::vector<float> run_chunks(TinyModel& m, KVCache& cache, const std::vector<int32_t>& tokens,
                              const std::vector<int>& chunks) {
  std::vector<float> all;
  size_t at = 0;
  for (int n : chunks) {
    std::vector<float> out(size_t(n) * m.n_vocab());
    const SequenceInput in{&cache, {tokens.data() + at, size_t(n)}};
    ForwardOptions every_token;
    every_token.all_logits = true;
    REQUIRE(m.runner->forward({&in, 1}, out.data(), every_token).ok());
    all.insert(all.end(), out.begin(), out.end());
    at += n;
  }
  REQUIRE(at == tokens.size());
  return all;
}

// Whether this CPU multiplies block-quantized rows by int8 dot products with activations rounded to
// 8 bits (cpu_ops.cc: AVX2 with FMA and F16C, or AVX-512 VNNI), Q8_0's included.
bool cpu_int8_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace

TEST_CASE("runner logits on block-quantized files agree with the float64 reference over the dequantized weights",
          "[model][quant]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  const std::vector<std::string> files = quantized_test_models(COMBS_TEST_DATA_DIR);
  for (const std::string& file : files) {
    INFO(file);
    TinyModel m(ModelFile{std::string(COMBS_TEST_DATA_DIR) + "/models/" + file});
    std::set<DType> types;
    for (const auto& t : m.model->file().tensors()) types.insert(t.dtype);
    if (!file.starts_with("presets/")) CHECK(types.size() >= 6);  // the mix is really in the file (f32 norms and 5 or 9 block types)
    const ReferenceModel reference(m.model->file(), m.model->config());
    // Up to 15 tokens a forward: the decode path. Where the CPU has AVX-512 VNNI or AVX2, the rows
    // of every type multiply activations rounded to 8 bits per 256 (their kernels are
    // exact on the rounded values: tests/backend/quant_test.cc), which moves these logits by up to
    // ~5% (over 25 random seeds with the K-quant and IQ4_XS kernels: 2.2-2.4e-2 for tiny-mix-a, up
    // to 5.4e-2 for qwen2-tiny-mix-b, whose matrices are nearly all of those types; with every
    // type's kernel: 3.8e-2 and 4.0e-2 at the test's seed; with the 20 preset files, up to 6.8e-2
    // over 8 seeds, whatever the type: the rounding is the activations'; a wrong scale moves them by O(1)). 24
    // tokens at once: the prefill path — Q4_K, Q5_K, Q6_K and Q8_0 by int8 products of the same
    // rounded activations where the CPU has AVX-512 VNNI (quant_gemm.h: 4.5e-2 for
    // qwen2-tiny-mix-b at one seed), the other types through oneDNN, weights and activations
    // rounded to bf16 (bf16's tolerance).
    const bool int8_activations = cpu_int8_kernels();
    for (int n : {10, 24}) {
      const auto tokens = random_tokens(rng, n, m.n_vocab());
      auto cache = m.cache();
      const auto got = run_chunks(m, *cache, tokens, {n});
      const auto want = reference.forward(tokens);
      const double tol = int8_activations ? 1e-1 : n >= 16 ? 4e-2 : 2e-5;
      const double worst = worst_relative_error(got, want, m.n_vocab());
      INFO(n << " tokens: worst relative error " << worst);
      CHECK(worst < tol);
    }
    // Decoding token by token gives the one-shot forward's logits (same path, same sums).
    const auto tokens = random_tokens(rng, 8, m.n_vocab());
    auto a = m.cache(), b = m.cache();
    CHECK(run_chunks(m, *a, tokens, {8}) == run_chunks(m, *b, tokens, {1, 1, 1, 1, 1, 1, 1, 1}));
  }
}

// Fields of a reference line "a|b|c...".
std::vector<std::string> split_bars(const std::string& line) {
  std::vector<std::string> f;
  size_t at = 0;
  for (size_t bar; (bar = line.find('|', at)) != std::string::npos; at = bar + 1) f.push_back(line.substr(at, bar - at));
  f.push_back(line.substr(at));
  return f;
}

std::vector<int32_t> ids_of(const std::string& text) {
  std::vector<int32_t> v;
  std::istringstream is(text);
  for (int32_t x; is >> x;) v.push_back(x);
  return v;
}

// llama.cpp's greedy continuation `want` of `prompt` fed back as the prompt (teacher forcing): the
// argmax after each position is compared with llama.cpp's next token. Random models part ways on
// any rounding difference (llama.cpp rounds activations to 8 bits for quantized products), so
// free-running text is no test; the first prediction must agree and 90% of them.
void check_teacher_forced(TinyModel& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& want) {
  REQUIRE(want.size() >= 8);  // 24, or fewer where llama.cpp's next token ended generation
  std::vector<int32_t> forced = prompt;
  forced.insert(forced.end(), want.begin(), want.end() - 1);
  auto cache = m.cache();
  const auto logits = run_chunks(m, *cache, forced, {static_cast<int>(forced.size())});
  // A position agrees where combs' argmax is llama.cpp's token, or where combs scores llama.cpp's
  // token within 2% of its best: a near-tie that rounding decides (llama.cpp rounds activations to
  // 8 bits for quantized products; combs' Q8_0 prefill through oneDNN multiplies bf16-rounded
  // weights: measured 1.2% apart from its exact decode path at gemma3-gguf-py's first position).
  size_t agree = 0;
  std::vector<int32_t> got;
  std::vector<bool> ok;
  for (size_t i = 0; i < want.size(); ++i) {
    const float* row = logits.data() + (prompt.size() - 1 + i) * m.n_vocab();
    got.push_back(static_cast<int32_t>(std::max_element(row, row + m.n_vocab()) - row));
    const float best = row[got.back()], theirs = row[want[i]];
    ok.push_back(got.back() == want[i] || best - theirs <= 2e-2f * std::abs(best));
    agree += ok.back();
  }
  const float* first = logits.data() + (prompt.size() - 1) * m.n_vocab();
  INFO("combs' argmax: " << id_list(got) << "; " << agree << " of " << want.size() << " agree; first position: combs' " << first[got[0]] << ", llama.cpp's token " << first[want[0]]);
  CHECK(ok[0]);
  CHECK(10 * agree >= 9 * want.size());
}

uint64_t fnv1a_of_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t h = 0xcbf29ce484222325ull;
  for (std::istreambuf_iterator<char> it(in), end; it != end; ++it) h = (h ^ static_cast<unsigned char>(*it)) * 0x100000001b3ull;
  return h;
}

TEST_CASE("on block-quantized files the runner predicts llama.cpp's greedy tokens under teacher forcing",
          "[model][quant]") {
  // tests/data/models/llama_cpp_greedy.txt: file|prompt ids|continuation ids. The files: made by
  // llama.cpp's llama-quantize, and gemma3, phi3, qwen3moe and gpt-oss written by its gguf-py (README.md there).
  std::ifstream in(std::string(COMBS_TEST_DATA_DIR) + "/models/llama_cpp_greedy.txt");
  REQUIRE(in.good());
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto f = split_bars(line);
    REQUIRE(f.size() == 3);
    INFO(line);
    const auto want = ids_of(f[2]);
    REQUIRE(want.size() == 24);
    TinyModel m(ModelFile{std::string(COMBS_TEST_DATA_DIR) + "/models/" + f[0]});
    check_teacher_forced(m, ids_of(f[1]), want);
    ++cases;
  }
  CHECK(cases == 18);
}

TEST_CASE("on llama.cpp's quantization presets the runner predicts its greedy tokens under teacher forcing",
          "[model][quant]") {
  // tests/data/models/presets/llama_cpp_greedy.txt (tests/reference/record_llama_quantize_presets.sh):
  // file|tensor types|prompt|continuation. llama-quantize's presets of random f16 llama and qwen2
  // models (its per-tensor mixes, e.g. Q4_K_M's Q6_K on the output and on some attn_v / ffn_down),
  // and of qwen2-tiny-384, whose rows of 384 and 640 are not whole K-quant blocks (its fallbacks:
  // Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_0 ...).
  const std::string dir = std::string(COMBS_TEST_DATA_DIR) + "/models/presets/";
  std::ifstream in(dir + "llama_cpp_greedy.txt");
  REQUIRE(in.good());
  std::set<std::string> files, fallback_types;
  std::unique_ptr<TinyModel> m;
  std::string loaded;
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto f = split_bars(line);
    REQUIRE(f.size() == 4);
    INFO(line);
    if (loaded != f[0]) {
      m = std::make_unique<TinyModel>(ModelFile{dir + f[0]});
      loaded = f[0];
      // The file holds the types the reference line names (and combs reads them as such).
      std::map<std::string, int> types;
      for (const auto& t : m->model->file().tensors()) ++types[std::string(dtype_name(t.dtype))];
      std::string listed;
      for (const auto& [name, count] : types) listed += (listed.empty() ? "" : " ") + name + ":" + std::to_string(count);
      std::string want = f[1];
      std::transform(want.begin(), want.end(), want.begin(), ::toupper);
      std::transform(listed.begin(), listed.end(), listed.begin(), ::toupper);
      CHECK(listed == want);
      if (f[0].starts_with("qwen2-tiny-384")) {
        for (const char* t : {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"})
          if (types.count(t)) fallback_types.insert(t);
      }
    }
    check_teacher_forced(*m, ids_of(f[2]), ids_of(f[3]));
    files.insert(f[0]);
    ++cases;
  }
  for (const char* shape : {"tiny", "qwen2-tiny"}) {
    for (const char* preset : {"q4_k_m", "q5_k_m", "q6_k", "q4_0", "q4_1", "iq4_xs", "q3_k_m", "q2_k"}) {
      INFO(shape << " " << preset);
      CHECK(files.count(std::string(shape) + "-" + preset + ".gguf"));
    }
  }
  INFO("fallback types on qwen2-tiny-384: " << fallback_types.size());
  CHECK(fallback_types.size() >= 2);  // rows that are not whole K-quant blocks took other types
  CHECK(cases == 2 * static_cast<int>(files.size()));
}

TEST_CASE("on every architecture the runner predicts llama.cpp's greedy tokens under teacher forcing", "[model]") {
  // tests/data/models/llama_cpp_arch_greedy.txt (tests/reference/record_llama_cpp_greedy.sh):
  // shape|type|seed|hash|prompt|continuation, on the files combs-mkmodel writes; written here
  // again, the same bytes (the hash) or the reference is stale.
  std::ifstream in(std::string(COMBS_TEST_DATA_DIR) + "/models/llama_cpp_arch_greedy.txt");
  REQUIRE(in.good());
  std::set<std::string> shapes;
  std::unique_ptr<TinyModel> m;
  std::string loaded;
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto f = split_bars(line);
    REQUIRE(f.size() == 6);
    INFO(line);
    if (loaded != f[0] + f[1]) {
      RandomModelOptions o;
      o.shape = std::move(named_shape(f[0])).value();
      REQUIRE(set_weight_type(f[1], &o).ok());
      o.seed = std::stoull(f[2]);
      m = std::make_unique<TinyModel>(o);
      char hash[17];
      std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a_of_file(m->path)));
      INFO("combs-mkmodel writes another file than llama.cpp ran on: record the reference again");
      REQUIRE(hash == f[3]);
      loaded = f[0] + f[1];
    }
    check_teacher_forced(*m, ids_of(f[4]), ids_of(f[5]));
    shapes.insert(f[0]);
    ++cases;
  }
  CHECK(shapes == std::set<std::string>{"qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "llama-yarn-tiny", "phi3-tiny",
                                        "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny", "gpt-oss-tiny",
                                        "gemma3-swa-tiny"});
  CHECK(cases == 72);
}

TEST_CASE("a batch of sessions on a block-quantized file equals each alone", "[model][quant]") {
  RunnerOptions ro;
  ro.batch_invariant = true;
  TinyModel m(ModelFile{std::string(COMBS_TEST_DATA_DIR) + "/models/tiny-mix-a.gguf"}, ro);
  Rng rng(test_seed());
  std::vector<std::vector<int32_t>> prompts;
  for (int s = 0; s < 5; ++s) prompts.push_back(random_tokens(rng, 3 + 4 * s, m.n_vocab()));
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    auto c = m.cache();
    const auto all = run_chunks(m, *c, p, {static_cast<int>(p.size())});
    alone.emplace_back(all.end() - m.n_vocab(), all.end());
  }
  std::vector<std::unique_ptr<PagedKVCache>> caches;
  std::vector<SequenceInput> batch;
  for (const auto& p : prompts) {
    caches.push_back(m.cache());
    batch.push_back({caches.back().get(), {p.data(), p.size()}});
  }
  std::vector<float> together(prompts.size() * m.n_vocab());
  REQUIRE(m.runner->forward(batch, together.data()).ok());
  for (size_t s = 0; s < prompts.size(); ++s) {
    INFO("session " << s);
    CHECK(std::equal(alone[s].begin(), alone[s].end(), together.begin() + s * m.n_vocab()));
  }
}

// Every architecture's tiny shape (random_model.h): 24 tokens cross the windows of 8 keys; the
// mixtures of experts route each token to 2 of 4 or 8 experts (gpt-oss: 4 of 8).
const char* const kArchShapes[] = {"tiny",          "qwen2-tiny",    "qwen2-tiny-384", "qwen3-tiny",   "gemma2-tiny",
                                   "gemma3-tiny",   "llama-yarn-tiny", "phi3-tiny",  "qwen3moe-tiny",
                                   "qwen2moe-tiny", "mixtral-tiny",  "gpt-oss-tiny", "gemma3-swa-tiny"};

TEST_CASE("runner logits agree with the float64 reference in every weight dtype", "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (const char* shape : kArchShapes) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0}) {
      INFO(shape << " " << dtype_name(dtype));
      TinyModel m(shape, dtype);
      // (bf16's rounded activations move router scores: a token whose k-th and (k+1)-th experts
      // nearly tie goes elsewhere than in float64, off by far more than any tolerance; so do
      // q8_0's where its kernels round activations to 8 bits. The mixtures of experts are held to
      // float64 in the exact dtypes; in bf16, to transformers.)
      const bool int8_activations = dtype == DType::kQ8_0 && cpu_int8_kernels();
      if ((dtype == DType::kBF16 || int8_activations) && m.model->config().n_expert > 0) continue;
      const auto tokens = random_tokens(rng, 24, m.n_vocab());
      auto cache = m.cache();
      // Chunks that start and end inside a window and across its edge.
      const auto got = run_chunks(m, *cache, tokens, {5, 9, 1, 9});
      const auto want = ReferenceModel(m.model->file(), m.model->config()).forward(tokens);
      // bf16 weights multiply activations rounded to bf16 (native bf16 dot products): the error
      // grows with depth (2e-2 a layer; gemma's post norms and 16x embedding scale amplify it
      // most); q8_0, where the CPU has int8 kernels, multiplies activations rounded to 8 bits per
      // 256 (as llama.cpp and the CUDA backend do; measured over 4 seeds: 3.4e-2 to 5.9e-2, gemma2
      // 7e-3, gemma3 8.1e-2 to 1.2e-1 with its 16x embedding scale); the other dtypes multiply f32
      // activations by the exactly dequantized weights.
      const double tol = dtype == DType::kBF16 ? 2e-2 * m.model->config().n_layers
                         : int8_activations    ? 2.5e-1
                                               : 2e-5;
      const double worst = worst_relative_error(got, want, m.n_vocab());
      INFO("worst relative error " << worst);
      CHECK(worst < tol);
    }
  }
}

// Logits within tolerance and the same greedy token at every position (unless the top two are
// closer than the tolerance). A single token's matmul sums in another order than a tile of
// several; with bf16 weights the activations are rounded to bf16, so a last-bit difference can
// move a value by one bf16 step (2^-8 relative); q8_0 prefill multiplies bf16-rounded weights
// (oneDNN) while decode multiplies exact ones by activations rounded to 8 bits (its tolerance at
// the call).
void require_same(const std::vector<float>& a, const std::vector<float>& b, int n_vocab, float tol = 3e-2f) {
  REQUIRE(a.size() == b.size());
  for (size_t t = 0; t < a.size() / n_vocab; ++t) {
    const float* x = a.data() + t * n_vocab;
    const float* y = b.data() + t * n_vocab;
    for (int v = 0; v < n_vocab; ++v) REQUIRE(std::abs(x[v] - y[v]) <= tol * (1.0f + std::abs(y[v])));
    const auto ax = std::max_element(x, x + n_vocab) - x, ay = std::max_element(y, y + n_vocab) - y;
    if (ax != ay) CHECK(std::abs(y[ax] - y[ay]) <= 2 * tol * (1.0f + std::abs(y[ay])));
  }
}

TEST_CASE("one-shot prefill equals chunked prefill equals token-by-token decode", "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (const char* shape : kArchShapes) {
    // q8_0 (bf16-rounded weights in prefill, exact ones times 8-bit activations in decode) on the
    // 2-layer llama, f16 on the deeper ones (bf16's rounding grows with depth past require_same's
    // tolerance).
    const DType dtype = std::string(shape) == "tiny" ? DType::kQ8_0 : DType::kF16;
    INFO(shape << " " << dtype_name(dtype));
    TinyModel m(shape, dtype);
    const auto tokens = random_tokens(rng, 40, m.n_vocab());
    auto a = m.cache(), b = m.cache(), c = m.cache();
    const auto one_shot = run_chunks(m, *a, tokens, {40});
    const auto chunked = run_chunks(m, *b, tokens, {7, 1, 16, 16});
    const auto by_token = run_chunks(m, *c, tokens, std::vector<int>(40, 1));
    // q8_0's decode rounds activations to 8 bits where the CPU has int8 kernels: 3.5e-2 to 5.9e-2
    // apart from its bf16 prefill over 8 seeds.
    const float tol = dtype == DType::kQ8_0 && cpu_int8_kernels() ? 1e-1f : 3e-2f;
    require_same(one_shot, chunked, m.n_vocab(), tol);
    require_same(one_shot, by_token, m.n_vocab(), tol);
  }
}

TEST_CASE("paged and contiguous caches give the same logits", "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  for (const char* shape : {"qwen2-tiny", "gemma3-tiny"}) {
    INFO(shape);
    TinyModel m(shape, DType::kBF16);
    const auto tokens = random_tokens(rng, 33, m.n_vocab());
    auto paged = m.cache();
    auto contiguous = std::move(ContiguousKVCache::create(
                                    m.backend, m.model->config().kv_geometry(DType::kF32), 64))
                          .value();
    CHECK(run_chunks(m, *paged, tokens, {20, 13}) == run_chunks(m, *contiguous, tokens, {20, 13}));
  }
}

TEST_CASE("a batch equals its sequences one at a time", "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  // (The mixtures of experts: a step's tokens meet in the experts they share, in other groupings.)
  // BF16, and the weight types whose prefill (16 tokens and more: the int8 products of quant_gemm.h) and
  // decode (dot products) kernels must give the same bits: the 36-token first step and the
  // 21-token prompt alone take the former, the others the latter.
  const std::pair<const char*, const char*> models[] = {
      {"tiny", "bf16"},          {"gemma2-tiny", "bf16"},   {"gemma3-tiny", "bf16"},  {"qwen3moe-tiny", "bf16"},
      {"qwen2moe-tiny", "bf16"}, {"gpt-oss-tiny", "bf16"},  {"tiny", "q4_k_m"},       {"qwen3-tiny", "q5_k_m"},
      {"tiny", "iq4_xs"},        {"tiny", "q8_0"},          {"phi3-tiny", "bf16"},    {"llama-yarn-tiny", "bf16"},
      {"mixtral-tiny", "bf16"},  {"qwen2-tiny-384", "q4_k_m"}};
  for (const auto& [shape, weights] : models) {
  INFO(shape << " " << weights);
  RandomModelOptions o;
  o.shape = std::move(named_shape(shape)).value();
  o.seed = 7;
  REQUIRE(set_weight_type(weights, &o).ok());
  TinyModel m(o, RunnerOptions{.batch_invariant = true});
  const int n_seqs = 3, V = m.n_vocab();
  std::vector<std::unique_ptr<PagedKVCache>> batched, alone;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n_seqs; ++i) {
    batched.push_back(m.cache());
    alone.push_back(m.cache());
    prompts.push_back(random_tokens(rng, 3 + 9 * i, V));
  }
  // Step 0: ragged prefill; steps 1..5: one token each (mixed with a new prefill chunk at step 3).
  for (int step = 0; step < 6; ++step) {
    std::vector<std::vector<int32_t>> inputs(n_seqs);
    for (int i = 0; i < n_seqs; ++i) {
      inputs[i] = step == 0 ? prompts[i] : random_tokens(rng, step == 3 && i == 1 ? 5 : 1, V);
    }
    std::vector<SequenceInput> seqs;
    for (int i = 0; i < n_seqs; ++i) seqs.push_back({batched[i].get(), inputs[i]});
    std::vector<float> out(size_t(n_seqs) * V);
    REQUIRE(m.runner->forward(seqs, out.data()).ok());
    for (int i = 0; i < n_seqs; ++i) {
      std::vector<float> one(V);
      const SequenceInput in{alone[i].get(), inputs[i]};
      REQUIRE(m.runner->forward({&in, 1}, one.data()).ok());
      INFO("step " << step << " sequence " << i);
      // Bitwise: a batch-invariant runner gives each sequence exactly what it gets alone.
      CHECK(std::vector<float>(out.begin() + i * V, out.begin() + (i + 1) * V) == one);
    }
  }
  }
}

TEST_CASE("popn then the same seeded continuation reproduces the same tokens", "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  TinyModel m("tiny", DType::kQ8_0);
  const auto prompt = random_tokens(rng, 12, m.n_vocab());
  auto cache = m.cache();
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.top_k = 50;
  sp.seed = rng.integer(0, 1 << 30);
  auto generate = [&](int n) {
    Sampler sampler(sp);
    std::vector<float> logits(m.n_vocab());
    const SequenceInput in{cache.get(), prompt};
    REQUIRE(m.runner->forward({&in, 1}, logits.data()).ok());
    std::vector<int32_t> history = prompt, out;
    for (int i = 0; i < n; ++i) {
      const int32_t t = sampler.sample(logits, history);
      out.push_back(t);
      history.push_back(t);
      const SequenceInput one{cache.get(), {&t, 1}};
      REQUIRE(m.runner->forward({&one, 1}, logits.data()).ok());
    }
    return out;
  };
  const auto first = generate(16);
  CHECK(cache->popn(16 + 12) == 28);
  CHECK(generate(16) == first);
  // Rolling back only the generated part and regenerating gives them again too.
  CHECK(cache->popn(16) == 16);
  Sampler sampler(sp);
  std::vector<float> logits(m.n_vocab());
  const int32_t last = prompt.back();
  CHECK(cache->popn(1) == 1);
  const SequenceInput in{cache.get(), {&last, 1}};
  REQUIRE(m.runner->forward({&in, 1}, logits.data()).ok());
  std::vector<int32_t> history = prompt;
  CHECK(sampler.sample(logits, history) == first[0]);
}

TEST_CASE("forward rejects bad input and leaves the cache as it was", "[model]") {
  TinyModel m("tiny", DType::kF32);
  auto cache = m.cache();
  std::vector<float> logits(m.n_vocab());
  const std::vector<int32_t> bad = {1, m.n_vocab()}, negative = {-1}, none = {};
  for (const auto* tokens : {&bad, &negative, &none}) {
    const SequenceInput in{cache.get(), *tokens};
    const Status s = m.runner->forward({&in, 1}, logits.data());
    CHECK(s.code() == StatusCode::kInvalidArgument);
  }
  CHECK(cache->seq_len() == 0);
  auto other = std::move(ContiguousKVCache::create(m.backend, {1, 2, 64, DType::kF32}, 8)).value();
  const std::vector<int32_t> ok = {1};
  const SequenceInput wrong{other.get(), ok};
  CHECK(m.runner->forward({&wrong, 1}, logits.data()).code() == StatusCode::kInvalidArgument);
  auto small = m.cache(4);
  const std::vector<int32_t> five = {1, 2, 3, 4, 5};
  const SequenceInput too_long{small.get(), five};
  CHECK(m.runner->forward({&too_long, 1}, logits.data()).code() == StatusCode::kResourceExhausted);
  CHECK(small->seq_len() == 0);
}

TEST_CASE(
    "expert routing takes the k most probable, ties to the lower id, renormalized where asked",
    "[model]") {
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  // Ties everywhere: the lowest ids, each 1/4 of the mass, or half of the chosen.
  const float even[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  cpu::route_experts(even, 1, 4, 2, false, ids.data(), w.data());
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 1);
  CHECK(w[0] == Approx(0.25f));
  CHECK(w[1] == Approx(0.25f));
  cpu::route_experts(even, 1, 4, 2, true, ids.data(), w.data());
  CHECK(w[0] == Approx(0.5f));
  CHECK(w[1] == Approx(0.5f));
  // Descending by probability, a tie between experts 1 and 2 to the lower; two tokens at once.
  const float two[8] = {1.0f, 3.0f, 3.0f, 2.0f, -4.0f, 0.0f, 7.0f, 0.0f};
  cpu::route_experts(two, 2, 4, 2, false, ids.data(), w.data());
  CHECK(std::vector<int32_t>(ids.begin(), ids.end()) == std::vector<int32_t>{1, 2, 2, 1});
  const double z = std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0);
  CHECK(w[0] == Approx(std::exp(3.0) / z));
  CHECK(w[1] == Approx(std::exp(3.0) / z));
  // k = n_expert: every expert, in order of probability; the weights the whole softmax.
  cpu::route_experts(two + 4, 1, 4, 4, false, ids.data(), w.data());
  CHECK(std::vector<int32_t>(ids.begin(), ids.end()) == std::vector<int32_t>{2, 1, 3, 0});
  CHECK(w[0] + w[1] + w[2] + w[3] == Approx(1.0f));
  // Scores far apart stay finite: one expert takes everything.
  const float far[4] = {1000.0f, -1000.0f, 0.0f, 80.0f};
  cpu::route_experts(far, 1, 4, 2, true, ids.data(), w.data());
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 3);
  CHECK(w[0] == 1.0f);
  CHECK(w[1] == 0.0f);
}

TEST_CASE("gpt-oss routing: the top k by logit, weighted by a softmax over those k alone", "[model]") {
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  // Experts 1 and 3 (3.0 and 2.0; 1.0 and -4.0 left out): e^3 / (e^3 + e^2), e^2 / (e^3 + e^2),
  // not their shares of the whole softmax; normalize has no say.
  const float z[4] = {1.0f, 3.0f, -4.0f, 2.0f};
  for (bool normalize : {false, true}) {
    cpu::route_experts(z, 1, 4, 2, normalize, ids.data(), w.data(), /*softmax_chosen=*/true);
    CHECK(ids[0] == 1);
    CHECK(ids[1] == 3);
    CHECK(w[0] == Approx(1.0 / (1.0 + std::exp(-1.0))));
    CHECK(w[1] == Approx(1.0 / (1.0 + std::exp(1.0))));
  }
  // Ties to the lower id; k = 1: weight 1 whatever the logit.
  const float tie[4] = {-50.0f, 5.0f, 5.0f, 5.0f};
  cpu::route_experts(tie, 1, 4, 1, false, ids.data(), w.data(), true);
  CHECK(ids[0] == 1);
  CHECK(w[0] == 1.0f);
  // k = n_expert: the softmax of all, ordered by logit; far-apart logits stay finite.
  const float far[4] = {-1000.0f, 1000.0f, 0.0f, 80.0f};
  cpu::route_experts(far, 1, 4, 4, false, ids.data(), w.data(), true);
  CHECK(std::vector<int32_t>(ids.begin(), ids.end()) == std::vector<int32_t>{1, 3, 2, 0});
  CHECK(w[0] == 1.0f);
  CHECK(w[3] == 0.0f);
}

TEST_CASE("gpt-oss's clamped SwiGLU follows its formula at and beyond the clamps", "[model]") {
  // g = min(gate, 7), u = clamp(up, -7, 7): g sigmoid(1.702 g) (u + 1).
  const std::vector<float> gate = {-3.0f, 0.0f, 1.0f, 7.0f, 20.0f, 2.0f, 2.0f};
  const std::vector<float> up = {0.5f, 4.0f, -1.0f, 0.0f, 1.0f, 30.0f, -30.0f};
  std::vector<float> out = gate;
  cpu::swiglu_oai_mul(out.data(), up.data(), static_cast<int64_t>(out.size()), kSwigluOaiAlpha, kSwigluOaiLimit);
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = std::min<double>(gate[i], 7.0), u = std::clamp<double>(up[i], -7.0, 7.0);
    INFO(i);
    CHECK(out[i] == Approx(g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0)).margin(1e-6));
  }
  CHECK(out[4] == out[3] * 2.0f);  // gate clamped at 7 (u + 1 = 2 vs 1)
  CHECK(out[2] == 0.0f);           // u = -1
}

TEST_CASE(
    "experts: every expert chosen, and decode steps that leave most unpicked, agree with the "
    "float64 reference",
    "[model]") {
  Rng rng(test_seed());
  INFO("seed " << rng.seed());
  // k = n_expert; one expert a token (6 or 7 of 8 unpicked each decode step).
  for (int used : {8, 1}) {
    INFO("experts used " << used);
    RandomModelOptions o;
    o.shape = std::move(named_shape("qwen3moe-tiny")).value();
    o.shape.n_expert_used = used;
    o.dtype = DType::kF32;
    TinyModel m(o);
    const auto tokens = random_tokens(rng, 16, m.n_vocab());
    auto cache = m.cache();
    const auto got = run_chunks(m, *cache, tokens, {4, 1, 1, 1, 1, 8});
    const auto want = ReferenceModel(m.model->file(), m.model->config()).forward(tokens);
    const double worst = worst_relative_error(got, want, m.n_vocab());
    INFO("worst relative error " << worst);
    CHECK(worst < 2e-5);
  }
}
