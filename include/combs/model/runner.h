// Runner: the transformer forward on the CPU backend (ModelRunner: the interface every backend's
// runner implements). One forward runs a ragged batch — several
// sequences, each at its own position with its own number of new tokens — in one pass, and reaches
// K/V only through the caches' batched attention call:
//   embedding -> per layer (RMSNorm, Q/K/V projections (+ biases), RoPE, cache attention, output
//   projection, residual, RMSNorm, SwiGLU MLP, residual) -> final RMSNorm -> logits.
// Thread-compatible: one forward at a time. Scratch memory grows to the largest batch seen and is
// reused, so steady-state decoding allocates nothing.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/kv/kv_cache.h"
#include "combs/kv/page_pool.h"
#include "combs/model/model.h"
#include "combs/model/sampler.h"

namespace combs {

struct SequenceInput {
  KVCache* cache = nullptr;           // its geometry must be the model's
  std::span<const int32_t> tokens;    // appended at cache->seq_len(); at least one
  bool all_logits = false;            // an output row for every token (a speculative step's
                                      // verification), not only for the last
};

// Output rows of a forward: one per sequence, or one per token of the sequences that ask for
// all_logits (every token with ForwardOptions::all_logits), in input order.
int64_t output_rows(std::span<const SequenceInput> seqs, bool all_logits);

// One output row's sampling by the runner (ModelRunner::samples_on_device()): what
// Sampler::sample does with the same inputs — the parameters, the draw it would take
// (Sampler::uniform(); unused when temperature is 0) and the penalty window's tokens.
struct RowSampling {
  const SamplingParams* params = nullptr;
  double uniform = 0.0;
  std::span<const std::pair<int32_t, int32_t>> penalized;  // (token, count), Sampler::penalized()
};

struct ForwardOptions {
  bool all_logits = false;  // logits of every token, not only of each sequence's last
  // When set: each output row's token is written here — its argmax (lowest id on ties: greedy
  // sampling), or, with `sampling` (one entry per output row; only for a runner that
  // samples_on_device()), the token sampled by those rules. A device runner then copies only
  // these ids to the host, not the logits (`logits` may be null).
  int32_t* token_ids = nullptr;
  std::span<const RowSampling> sampling;
};

struct RunnerOptions {
  // Every token's logits bitwise independent of the other tokens in the forward (matmuls stay on
  // combs' kernels; see cpu::MatmulPolicy). Off: prefill may use oneDNN, ~1.3x faster here.
  // Attention is batch-invariant either way for a given split of a sequence into chunks.
  bool batch_invariant = false;
};

// A model forward on one backend: the CPU's Runner below, or CudaRunner (combs_cuda). The engine
// holds one; the caches it runs must live on its backend().
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Appends every sequence's tokens to its cache and writes f32 logits into `logits` (host
  // memory): [output_rows(seqs, options.all_logits), n_vocab] — each sequence's last token, or
  // each of its tokens where it (or the options) asks for all_logits. INVALID_ARGUMENT for a bad token id, empty input or a cache of another geometry or
  // backend; RESOURCE_EXHAUSTED / FAILED_PRECONDITION from the caches. On error no cache changes.
  virtual Status forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options = {}) = 0;
  virtual Backend& backend() = 0;
  virtual const Model& model() const = 0;
  // Whether forward() takes ForwardOptions::sampling.
  virtual bool samples_on_device() const { return false; }
  // The page pool for this runner's caches: on backend(), or (tensor parallelism) split by KV
  // heads over its ranks' devices.
  virtual StatusOr<std::unique_ptr<PagePool>> make_page_pool(const PagePoolOptions& options) {
    return PagePool::create(backend(), options);
  }
  // Devices a page is split over (a KV memory budget is each device's).
  virtual int kv_shards() const { return 1; }
  // OK while the runner can serve; UNAVAILABLE once it cannot (a tensor-parallel group that lost
  // a rank). Safe from any thread.
  virtual Status health() const { return ok_status(); }
};

// The checks every runner makes of a forward's input: each sequence has a cache of the model's
// geometry (and, when `backend` is set, on that backend) and at least one token, every token in
// the vocabulary. INVALID_ARGUMENT naming the sequence otherwise; on success *total is the number
// of tokens.
Status check_forward_inputs(const ModelConfig& config, std::span<const SequenceInput> seqs,
                            const Backend* backend, int64_t* total);

class Runner final : public ModelRunner {
 public:
  // The model and backend must outlive the runner.
  static StatusOr<std::unique_ptr<Runner>> create(const Model& model, CpuBackend& backend,
                                                  RunnerOptions options = {});

  Status forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options = {}) override;
  Backend& backend() override { return *backend_; }
  const Model& model() const override { return *model_; }

 private:
  Runner(const Model& model, CpuBackend& backend, RunnerOptions options)
      : model_(&model), backend_(&backend), options_(options) {}
  void reserve(int64_t n_tokens);
  // The mixture of experts of layer w on n normalized rows `in`: route, run each chosen expert on
  // its tokens, and write every token's weighted sum of its experts to out [n, n_embd].
  void experts(const LayerWeights& w, const float* in, int64_t n, cpu::MatmulPolicy policy, float* out);
  // gate[i] = act(gate[i]) * up[i] by the model's activation, for n values.
  void activate(float* gate, const float* up, int64_t n) const;

  const Model* model_;
  CpuBackend* backend_;
  RunnerOptions options_;
  int64_t capacity_ = 0;
  std::vector<float> x_, h_, q_, k_, v_, att_, gate_, up_;
  // Experts: the router's logits (and the shared expert's gates), each token's chosen experts and
  // weights, the (token, slot) pairs by expert, one expert's input rows, every slot's output, the sum.
  std::vector<float> router_, expert_weights_, expert_in_, expert_out_, moe_;
  std::vector<int32_t> expert_ids_;
  std::vector<int64_t> expert_order_, expert_start_;
  std::vector<int32_t> tokens_, pos_;
  std::vector<SeqAttention> batch_;
};

}  // namespace combs
