// CudaRunner: the transformer forward on one NVIDIA GPU (combs_cuda). The same computation as the
// CPU Runner, on device memory: weights copied to the device at create (F32/F16/BF16 as they are;
// Q8_0 dequantized to BF16 once, so every matmul is a cuBLAS tensor-core GEMM — Q8_0 saves disk
// and host memory, not GPU bandwidth), activations f32, the KV caches' pages on the device, the
// residual add fused into the next RMSNorm, attention through an AttentionStep (the CUDA kernels;
// its host work once per forward). Only the logits, or with ForwardOptions::argmax the token ids,
// cross to the host.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "combs/backend/cuda/collective.h"
#include "combs/backend/cuda/cuda_backend.h"
#include "combs/model/runner.h"

namespace combs {

struct CudaRunnerOptions {
  int device = 0;
  // Decode steps (one new token per sequence, up to 512 sequences) as CUDA graphs, one per batch
  // size: a step is then one graph launch. Off: every kernel launched on its own (to compare).
  bool cuda_graphs = true;
  // Times each forward's device work (from its first launch to its last, uploads excluded) with a
  // pair of CUDA events, into stats().device_seconds: for benchmarks (what of a step the host adds).
  bool time_device = false;
  // Tensor parallelism (Megatron's split): this runner is rank collective->rank() of
  // collective->world(), on collective->device() (`device` unused). It holds its share of every
  // layer — its query and KV heads' rows of Q/K/V and their columns of the attention output, its
  // columns of gate/up and rows of down — and its rows of the output (the vocabulary split), with
  // the embedding whole; an all-reduce joins the attention's and the FFN's partial outputs, and
  // rank 0 gathers the logits (it alone samples or writes logits and token ids). Its caches hold
  // its KV heads (kv_geometry()). Every rank must run the same forwards, each from its own
  // thread. Null: the whole model on one GPU.
  Collective* collective = nullptr;
};

struct CudaRunnerStats {
  int64_t graph_captures = 0;  // decode graphs captured (the first and any whose launch key changed)
  int64_t graph_replays = 0;   // decode steps run as one graph launch
  double host_seconds = 0;     // forward's host work: from its call until it waits for the device
  double device_seconds = 0;   // with time_device: the device's time from a forward's first launch to its last
  // The device memory the weights took (its free memory before the upload less after: the
  // allocator's rounding included). Blocks stay blocks: about the file's tensor bytes (this
  // rank's share of them under tensor parallelism).
  int64_t weight_bytes = 0;
};

class CudaRunner final : public ModelRunner {
 public:
  // The model must outlive the runner. UNAVAILABLE without a GPU; RESOURCE_EXHAUSTED when the
  // weights do not fit.
  static StatusOr<std::unique_ptr<CudaRunner>> create(const Model& model, CudaRunnerOptions options = {});
  ~CudaRunner() override;

  Status forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options = {}) override;
  Backend& backend() override;
  const Model& model() const override { return *model_; }
  bool samples_on_device() const override { return true; }
  CudaBackend& cuda();
  CudaRunnerStats stats() const;
  // What this runner's caches store: the model's geometry, or a tensor-parallel rank's KV heads.
  KVGeometry kv_geometry(DType dtype) const;

 private:
  struct Impl;
  explicit CudaRunner(const Model& model, std::unique_ptr<Impl> impl);
  const Model* model_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace combs

namespace combs {
// ForwardOptions::sampling as cuda::sample_rows reads it: [SampleParamsDev x rows] then the rows'
// SampleAdjustDev entries (logit bias, then penalties, each row's at its *_at offsets).
void pack_sampling(std::span<const RowSampling> rows, std::vector<char>* out);
// INVALID_ARGUMENT unless ForwardOptions::sampling holds one valid row for each of n_out output
// rows (parameters, a draw in [0, 1), penalized tokens in the vocabulary) and token_ids to write.
Status check_sampling(const ForwardOptions& options, int64_t n_out, int n_vocab);

// For EngineOptions::make_runner: a CudaRunner on `device`.
inline auto make_cuda_runner(int device = 0) {
  return [device](const Model& m) -> StatusOr<std::unique_ptr<ModelRunner>> {
    COMBS_ASSIGN_OR_RETURN(auto r, CudaRunner::create(m, {.device = device}));
    return std::unique_ptr<ModelRunner>(std::move(r));
  };
}
}  // namespace combs
