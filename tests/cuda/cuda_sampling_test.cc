// Sampling on the device against the CPU's Sampler: the same logits and the same draw give the
// same token (greedy, temperature, top-k, top-p, min-p, penalties, logit bias, ties); and the
// engine on the GPU, sampling there, reproduces a seeded CPU run. [cuda]: skipped without a GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>

#include "combs/backend/cuda/cuda_backend.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "combs/engine/engine.h"
#include "combs/model/cuda_runner.h"
#include "combs/model/sampler.h"
#include "support/cuda_helpers.h"
#include "support/engine_helpers.h"
#include "support/model_helpers.h"
#include "support/random.h"

using namespace combs;
using combs::testing::download;
using combs::testing::gpu_or_skip;
using combs::testing::have_gpu;
using combs::testing::upload;

namespace {

struct Draws {
  std::vector<int32_t> cpu, gpu;
};

// `rows` draws from one logits row: the CPU Sampler with its own generator; the device (packed as
// the runner packs it) with the draw the CPU took (read from the generator before sample() takes
// it) and the same penalties.
Draws sample_both(CudaBackend& gpu, const std::vector<float>& logits, const SamplingParams& params,
                  const std::vector<int32_t>& history, int rows) {
  const int V = static_cast<int>(logits.size());
  Sampler cpu(params);
  Draws d;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> pen(rows);
  std::vector<RowSampling> sampling;
  for (int r = 0; r < rows; ++r) {
    const uint64_t state = cpu.generator_state();
    const double u = params.temperature > 0 ? cpu.uniform() : 0.0;
    cpu.set_generator_state(state);
    std::vector<float> l = logits;
    d.cpu.push_back(cpu.sample(l, history));
    cpu.penalized(history, V, &pen[r]);
    sampling.push_back({&params, u, pen[r]});
  }
  std::vector<float> all;
  for (int r = 0; r < rows; ++r) all.insert(all.end(), logits.begin(), logits.end());
  Tensor l = upload(gpu, all, {rows, V});
  std::vector<char> blob;
  pack_sampling(sampling, &blob);
  void* d_blob = gpu.upload(3, blob.data(), blob.size()).value();
  Tensor ids = gpu.alloc({rows}, DType::kF32).value();
  REQUIRE(cuda::sample_rows(gpu, l.data_as<float>(), rows, V, static_cast<cuda::SampleParamsDev*>(d_blob),
                            reinterpret_cast<cuda::SampleAdjustDev*>(static_cast<cuda::SampleParamsDev*>(d_blob) + rows),
                            ids.data_as<int32_t>())
              .ok());
  d.gpu.resize(rows);
  REQUIRE(gpu.copy(ids, Tensor::wrap(d.gpu.data(), {rows}, DType::kF32)).ok());
  return d;
}

}  // namespace

TEST_CASE("device sampling picks the cpu sampler's token for the same draw", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  testing::Rng rng(testing::test_seed());
  INFO("seed " << rng.seed());
  for (int V : {300, 128256}) {
    std::vector<float> logits = rng.floats(V, -4.0f, 4.0f);
    for (int i = 0; i < 8; ++i) logits[rng.integer(0, V - 1)] = 3.5f;  // ties, among the likely tokens
    logits[rng.integer(0, V - 1)] = 6.0f;
    std::vector<int32_t> history;
    for (int i = 0; i < 40; ++i) history.push_back(static_cast<int32_t>(rng.integer(0, V - 1)));
    std::vector<SamplingParams> cases;
    auto add = [&](float t, int k, float p, float mp) {
      SamplingParams s;
      s.temperature = t, s.top_k = k, s.top_p = p, s.min_p = mp;
      s.seed = cases.size() * 7919 + V;
      cases.push_back(s);
    };
    add(0.0f, 0, 1.0f, 0.0f);
    add(1.0f, 0, 1.0f, 0.0f);
    add(0.7f, 40, 1.0f, 0.0f);
    add(1.3f, 0, 0.9f, 0.0f);
    add(0.8f, 50, 0.95f, 0.05f);
    add(1.0f, 1, 1.0f, 0.0f);
    add(1.0f, 0, 0.3f, 0.0f);
    add(2.0f, 0, 1.0f, 0.2f);
    SamplingParams pen;
    pen.temperature = 0.9f, pen.top_k = 20, pen.repetition_penalty = 1.3f, pen.presence_penalty = 0.4f;
    pen.frequency_penalty = 0.2f, pen.penalty_last_n = 32, pen.logit_bias = {{5, 2.0f}, {7, -100.0f}, {5, 1.0f}};
    pen.seed = 99;
    cases.push_back(pen);
    SamplingParams greedy_pen = pen;
    greedy_pen.temperature = 0.0f;
    cases.push_back(greedy_pen);
    for (size_t c = 0; c < cases.size(); ++c) {
      const SamplingParams& p = cases[c];
      INFO("V " << V << ", case " << c << ": temperature " << p.temperature << " top_k " << p.top_k << " top_p "
                << p.top_p << " min_p " << p.min_p);
      // (The device splits a row over up to 64 blocks and takes rows in turns past the blocks that
      // stay resident: 1,500 small rows take several turns, 256 large ones a few blocks each.)
      const Draws d = sample_both(*gpu, logits, p, history, V == 300 ? 1500 : 256);
      int differ = 0;
      for (size_t i = 0; i < d.cpu.size(); ++i) differ += d.cpu[i] != d.gpu[i];
      // The device sums probability in fixed point and the CPU in double: a draw within ~1e-9 of
      // a boundary between two tokens may fall either way, nothing more.
      CHECK(differ <= 1);
      if (p.temperature > 0 && p.top_k != 1) {  // the draws spread over more than one token
        std::vector<int32_t> distinct = d.gpu;
        std::sort(distinct.begin(), distinct.end());
        CHECK(std::unique(distinct.begin(), distinct.end()) - distinct.begin() > 1);
      }
    }
  }
}

TEST_CASE("the engine samples on the gpu as the cpu engine does for a seeded request", "[cuda]") {
  if (!have_gpu()) return;
  testing::TinyModel m("tiny", DType::kF32);
  auto run_engine = [&](bool gpu) {
    EngineOptions eo;
    eo.kv_memory_bytes = 64 << 20;
    eo.kv_dtype = DType::kF32;
    if (gpu) eo.make_runner = make_cuda_runner(0);
    auto engine = std::move(Engine::create(std::move(Model::load(m.path)).value(), eo)).value();
    std::vector<std::vector<int32_t>> outs;
    for (int variant = 0; variant < 3; ++variant) {
      GenerateRequest r;
      r.input = {1, 2, 3, 4, 5, 6, 7, 8};
      r.max_tokens = 48;
      r.ignore_eos = true;
      SamplingParams s;
      s.temperature = 0.9f, s.seed = 1234 + variant;
      if (variant == 1) s.top_k = 20, s.top_p = 0.9f, s.min_p = 0.02f;
      if (variant == 2) s.repetition_penalty = 1.2f, s.frequency_penalty = 0.3f, s.logit_bias = {{3, 1.5f}};
      r.sampling = s;
      const SessionId id = engine->create_session().value();
      outs.push_back(testing::run(*engine, id, std::move(r)));
    }
    return outs;
  };
  const auto cpu = run_engine(false);
  const auto gpu = run_engine(true);
  const auto gpu_again = run_engine(true);
  CHECK(gpu == gpu_again);  // same seed, same tokens
  for (size_t v = 0; v < cpu.size(); ++v) {
    INFO("variant " << v);
    REQUIRE(cpu[v].size() == 48);
    CHECK(gpu[v] == cpu[v]);
  }
}
