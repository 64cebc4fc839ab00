#include "combs/model/cuda_runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <initializer_list>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "combs/base/hash.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "combs/kv/cuda/cuda_attention.h"

namespace combs {
namespace {

// A decode step's launches as a CUDA graph: captured the second time a step's launch key is seen
// (the first runs eagerly and sizes every buffer), replayed while the key holds.
struct DecodeGraph {
  uint64_t key = 0, pending = 0;
  cudaGraphExec_t exec = nullptr;

  DecodeGraph() = default;
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;
  ~DecodeGraph() {
    if (exec) cudaGraphExecDestroy(exec);
  }

  // Runs `launches` for a step with this key: replays, captures (and launches), or runs them.
  // A failed capture (a buffer had to grow mid-capture, say) runs them eagerly instead; the next
  // step with this key tries again.
  Status run(cudaStream_t st, uint64_t step_key, const std::function<Status()>& launches, CudaRunnerStats& stats) {
    if (exec && key == step_key) {
      ++stats.graph_replays;
      return cuda::cuda_status(cudaGraphLaunch(exec, st), "cudaGraphLaunch");
    }
    if (pending != step_key) {
      pending = step_key;
      return launches();
    }
    pending = 0;
    COMBS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const Status captured = launches();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(st, &graph);
    cudaGraphExec_t instance = nullptr;
    const bool ok = captured.ok() && ended == cudaSuccess && graph != nullptr &&
                    cudaGraphInstantiate(&instance, graph, 0) == cudaSuccess;
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
      cudaGetLastError();  // the failed capture's error is handled here
      return launches();
    }
    if (exec) cudaGraphExecDestroy(exec);
    exec = instance;
    key = step_key;
    ++stats.graph_captures;
    return cuda::cuda_status(cudaGraphLaunch(exec, st), "cudaGraphLaunch");
  }
};

}  // namespace

Status check_sampling(const ForwardOptions& o, int64_t n_out, int n_vocab) {
  if (o.token_ids == nullptr) return invalid_argument_error("forward: sampling needs token_ids to write to");
  if (static_cast<int64_t>(o.sampling.size()) != n_out) {
    return invalid_argument_error("forward: " + std::to_string(o.sampling.size()) + " sampling entries for " +
                                  std::to_string(n_out) + " output rows");
  }
  for (size_t r = 0; r < o.sampling.size(); ++r) {
    const RowSampling& s = o.sampling[r];
    if (s.params == nullptr) return invalid_argument_error("forward: sampling row " + std::to_string(r) + " has no parameters");
    COMBS_RETURN_IF_ERROR(validate(*s.params, n_vocab));
    if (!(s.uniform >= 0.0 && s.uniform < 1.0)) {
      return invalid_argument_error("forward: sampling row " + std::to_string(r) + ": draw outside [0, 1)");
    }
    for (const auto& [id, count] : s.penalized) {
      if (id < 0 || id >= n_vocab || count < 1) {
        return invalid_argument_error("forward: sampling row " + std::to_string(r) + ": penalized token " +
                                      std::to_string(id) + " x " + std::to_string(count));
      }
    }
  }
  return ok_status();
}

void pack_sampling(std::span<const RowSampling> rows, std::vector<char>* out) {
  size_t n_adjust = 0;
  for (const RowSampling& r : rows) n_adjust += r.params->logit_bias.size() + r.penalized.size();
  out->resize(rows.size() * sizeof(cuda::SampleParamsDev) + n_adjust * sizeof(cuda::SampleAdjustDev));
  char* params = out->data();
  char* adjust = params + rows.size() * sizeof(cuda::SampleParamsDev);
  int32_t at = 0;  // entries written so far
  auto put = [&](int32_t token, cuda::SampleAdjustDev a) {
    a.token = token;
    std::memcpy(adjust + static_cast<size_t>(at++) * sizeof(a), &a, sizeof(a));
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    const SamplingParams& p = *rows[r].params;
    cuda::SampleParamsDev d{};
    d.temperature = p.temperature, d.top_p = p.top_p, d.min_p = p.min_p;
    d.repetition = p.repetition_penalty, d.presence = p.presence_penalty, d.frequency = p.frequency_penalty;
    d.top_k = p.top_k;
    d.uniform = rows[r].uniform;
    d.bias_at = at;
    d.n_bias = static_cast<int32_t>(p.logit_bias.size());
    for (const auto& [id, v] : p.logit_bias) {
      cuda::SampleAdjustDev a{};
      a.value = v;
      put(id, a);
    }
    d.penalized_at = at;
    d.n_penalized = static_cast<int32_t>(rows[r].penalized.size());
    for (const auto& [id, count] : rows[r].penalized) {
      cuda::SampleAdjustDev a{};
      a.count = count;
      put(id, a);
    }
    std::memcpy(params + r * sizeof(d), &d, sizeof(d));
  }
}

// A projection's weights stacked by rows on the device: one tensor per run of parts of one dtype
// (a Q4_K_M file's attn_v may be Q6_K beside Q4_K attn_q and attn_k), each covering whole outputs.
struct WeightStack {
  std::vector<Tensor> parts;
  std::vector<size_t> outputs;  // how many of the projection's outputs each part covers
  const Tensor& first() const { return parts.front(); }
};

// A tensor-parallel rank's share of the model (the whole model for one rank): its query and KV
// heads, its FFN columns (the dense FFN's or the shared expert's), its experts and its rows of the
// output (vocabulary), each a contiguous range.
struct Shard {
  int rank = 0, world = 1;
  int64_t nq = 0, nkv = 0, ff = 0;  // this rank's query heads, KV heads, FFN width
  int64_t n_exp = 0;                // its experts: [rank n_exp, (rank + 1) n_exp)
  int64_t expert_begin() const { return rank * n_exp; }
  int64_t n_vocab = 0, vocab_stride = 0;  // rank r's output rows: [r stride, min(n_vocab, (r + 1) stride))
  int64_t vocab_begin(int r) const { return r * vocab_stride; }
  int64_t vocab_rows(int r) const { return std::min(n_vocab, (r + 1) * vocab_stride) - r * vocab_stride; }
};

// The split of `config` over `world` ranks, or why it cannot be split: heads, KV heads, FFN
// width and experts must divide evenly, and a block type's column split (the attention output's
// and down's inputs) must fall on whole blocks of every layer's matrices. Experts are split whole
// (expert parallelism: an expert's FFN is narrow, and its rows would rarely split on whole
// K-quant blocks: qwen3-30b-a3b's 768 over 2).
static StatusOr<Shard> plan_shard(const Model& m, int rank, int world) {
  const ModelConfig& c = m.config();
  Shard s;
  s.rank = rank, s.world = world;
  s.n_vocab = c.n_vocab;
  s.vocab_stride = (c.n_vocab + world - 1) / world;
  auto refuse = [&](const std::string& why) {
    return invalid_argument_error("tensor parallel: " + c.arch_name + " over " + std::to_string(world) +
                                  " GPUs: " + why);
  };
  for (auto [what, n] : {std::pair<const char*, int64_t>{"query heads", c.n_heads}, {"KV heads", c.n_kv_heads},
                         {"FFN width", c.dense_ffn() ? c.n_ff : world}, {"experts", c.n_expert > 0 ? c.n_expert : world}}) {
    if (n % world != 0) return refuse(std::string(what) + " (" + std::to_string(n) + ") do not divide evenly");
  }
  s.nq = c.n_heads / world, s.nkv = c.n_kv_heads / world, s.ff = c.n_ff / world, s.n_exp = c.n_expert / world;
  if (s.vocab_rows(world - 1) < 1) return refuse("a vocabulary of " + std::to_string(c.n_vocab) + " is too small");
  if (world > 1) {
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const LayerWeights& w = m.layers[l];
      for (auto [t, cols] : {std::pair<const Tensor*, int64_t>{&w.wo, s.nq * c.head_dim}, {&w.w_down, s.ff}}) {
        if (t->defined() && cols % dtype_block_elems(t->dtype()) != 0) {
          return refuse("layer " + std::to_string(l) + ": " + std::to_string(cols) + " columns a rank are not whole " +
                        std::string(dtype_name(t->dtype())) + " blocks");
        }
      }
    }
  }
  return s;
}

// The config a rank's forward sees: the model's, with its heads and FFN width.
static ModelConfig shard_config(const ModelConfig& c, const Shard& s) {
  ModelConfig r = c;
  r.n_heads = static_cast<int>(s.nq), r.n_kv_heads = static_cast<int>(s.nkv);
  if (c.dense_ffn()) r.n_ff = static_cast<int>(s.ff);
  return r;
}

struct CudaRunner::Impl {
  std::unique_ptr<CudaBackend> backend;
  Collective* tp = nullptr;  // tensor parallelism's collectives (null: one GPU)
  Shard shard;
  ModelConfig config;  // the model's, with this rank's heads and FFN width
  struct Layer {
    Tensor attn_norm, bqkv, wo, ffn_norm, w_down;
    Tensor q_norm, k_norm, post_attn_norm, post_ffn_norm;  // where the architecture has them
    WeightStack wqkv,
        w_gate_up;  // Q/K/V and gate/up fused by rows (the dense FFN or shared expert)
    // Mixture of experts: the router, the experts' gate and up rows stacked per expert
    // [n_expert, 2 n_ff_exp, n_embd], their down [n_expert, n_embd, n_ff_exp]; the shared expert's
    // gate [1, n_embd].
    Tensor router, gate_up_exps, down_exps, shared_gate;
    // gpt-oss: the attention output's bias, the sinks, the router's bias, the experts' biases
    // (gate_up_exps_b [n_expert, 2 n_ff_exp]: each expert's gate then up, as their rows).
    Tensor bo, sinks, router_b, gate_up_exps_b, down_exps_b;
  };
  Tensor weights;  // the device memory of every weight below (WeightArena's; undefined under tensor parallelism)
  Tensor tok_embd, output_norm, output, inv_freq, inv_freq_local;  // RoPE of global and windowed layers
  std::vector<Layer> layers;
  // Activations, grown to the largest batch seen.
  int64_t capacity = 0, logit_rows = 0;
  Tensor x, h, q, k, v, att, delta, gate, up, last, logits, ints;
  Tensor part, gathered;  // tensor parallelism: this rank's logits [n, its vocab], every rank's [world, n, stride]
  Tensor router_logits, shared_out, shared_logit, expert_ints, expert_floats,
      expert_xq;  // experts' scratch
  cuda::ExpertScratch experts{};
  uint64_t activations_generation = 0;  // bumped when the activations move
  std::vector<int32_t> host_ints;  // tokens, output rows
  std::vector<char> sampling;      // SampleParamsDev rows, then SampleAdjustDev entries
  std::vector<SeqAttention> batch;
  AttentionStep step;
  // Decode steps as CUDA graphs, one per batch size and output (logits or argmax ids).
  bool use_graphs = true;
  std::unordered_map<int64_t, DecodeGraph> graphs;
  CudaRunnerStats stats;
  // time_device: events recorded before a forward's first launch and after its last.
  cudaEvent_t launched = nullptr, finished = nullptr;
  ~Impl() {
    if (launched) cudaEventDestroy(launched);
    if (finished) cudaEventDestroy(finished);
  }
};

namespace {

// The weights' device memory: one allocation for all of them, handed out 256-byte aligned (as
// cudaMalloc's), so that the resident bytes are the file's tensor bytes — a cudaMalloc a tensor
// rounds each up to the allocator's granularity (2 MB pages for large ones). A tensor past the
// reservation (none is expected) gets its own allocation.
class WeightArena {
 public:
  explicit WeightArena(CudaBackend& b) : b_(b) {}
  Status reserve(size_t bytes) {
    COMBS_ASSIGN_OR_RETURN(block_, b_.alloc({static_cast<int64_t>((bytes + 3) / 4)}, DType::kF32));  // (as words)
    return ok_status();
  }
  StatusOr<Tensor> alloc(Shape shape, DType dtype) {
    const size_t n = nbytes_for(dtype, shape.numel()), at = (used_ + 255) / 256 * 256;
    if (!block_.defined() || at + n > block_.nbytes()) return b_.alloc(shape, dtype);
    used_ = at + n;
    return Tensor::wrap(block_.data_as<char>() + at, shape, dtype, DeviceType::kCuda);
  }
  Status copy(const Tensor& src, const Tensor& dst) { return b_.copy(src, dst); }
  Tensor block() const { return block_; }  // keeps the weights' memory (the tensors are views of it)

 private:
  CudaBackend& b_;
  Tensor block_;
  size_t used_ = 0;
};

// Host tensors of one dtype stacked by rows into one device tensor, copied as they are (block
// types stay in their blocks: no dequantized copy; all parts or none defined).
StatusOr<Tensor> upload(WeightArena& b, std::span<const Tensor* const> parts) {
  const Tensor& first = *parts.front();
  if (!first.defined()) return Tensor();
  int64_t rows = 0;
  for (const Tensor* t : parts) {
    if (t->dtype() != first.dtype()) return internal_error("cuda upload: parts of one stack differ in dtype");
    rows += t->dim(0);
  }
  const Shape shape = first.rank() == 2 ? Shape{rows, first.dim(1)} : Shape{rows};
  COMBS_ASSIGN_OR_RETURN(Tensor d, b.alloc(shape, first.dtype()));
  int64_t row = 0;
  for (const Tensor* t : parts) {
    COMBS_RETURN_IF_ERROR(b.copy(*t, d.rows(row, row + t->dim(0))));
    row += t->dim(0);
  }
  return d;
}
StatusOr<Tensor> upload(WeightArena& b, std::initializer_list<const Tensor*> parts) {
  return upload(b, std::span<const Tensor* const>(parts.begin(), parts.size()));
}

// Columns [begin, end) of a host matrix (whole blocks of a block type: plan_shard checked) on
// the device, in its dtype.
StatusOr<Tensor> upload_columns(WeightArena& b, const Tensor& t, int64_t begin, int64_t end) {
  if (!t.defined() || (begin == 0 && end == t.dim(1))) return upload(b, {&t});
  const size_t row = nbytes_for(t.dtype(), t.dim(1)), skip = nbytes_for(t.dtype(), begin),
               width = nbytes_for(t.dtype(), end - begin);
  COMBS_ASSIGN_OR_RETURN(Tensor d, b.alloc({t.dim(0), end - begin}, t.dtype()));
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(d.data(), width, static_cast<const char*>(t.data()) + skip, row, width,
                                          static_cast<size_t>(t.dim(0)), cudaMemcpyHostToDevice));
  return d;
}

// Rows [begin, end) of a host tensor, or nothing where it is absent.
Tensor rows_of(const Tensor& t, int64_t begin, int64_t end) { return t.defined() ? t.rows(begin, end) : Tensor(); }

// A projection's parts (in output order) as a WeightStack: consecutive parts of one dtype share a
// device tensor.
StatusOr<WeightStack> upload_stack(WeightArena& b, std::initializer_list<const Tensor*> parts) {
  WeightStack s;
  std::vector<const Tensor*> run;
  auto flush = [&]() -> Status {
    if (run.empty()) return ok_status();
    COMBS_ASSIGN_OR_RETURN(Tensor t, upload(b, run));
    s.parts.push_back(std::move(t));
    s.outputs.push_back(run.size());
    run.clear();
    return ok_status();
  };
  for (const Tensor* t : parts) {
    if (!run.empty() && run.front()->dtype() != t->dtype()) COMBS_RETURN_IF_ERROR(flush());
    run.push_back(t);
  }
  COMBS_RETURN_IF_ERROR(flush());
  return s;
}

// Stacked gate and up [n, rows, cols] (host, one dtype) on the device as [n, 2 rows, cols]: each
// expert's gate rows, then its up rows (the pairs quant_gemv_experts reads; their biases alike).
StatusOr<Tensor> upload_pairs(WeightArena& b, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.dim(0), r = gate.dim(1), cols = gate.dim(2);
  COMBS_ASSIGN_OR_RETURN(Tensor pairs, b.alloc({n, 2 * r, cols}, gate.dtype()));
  const Tensor rows = pairs.reshape({n * 2 * r, cols});
  for (int64_t e = 0; e < n; ++e) {
    COMBS_RETURN_IF_ERROR(b.copy(expert(gate, e), rows.rows(2 * e * r, (2 * e + 1) * r)));
    COMBS_RETURN_IF_ERROR(b.copy(expert(up, e), rows.rows((2 * e + 1) * r, (2 * e + 2) * r)));
  }
  return pairs;
}

// A layer's experts [e0, e1) on the device: gate and up interleaved per expert (each expert's
// gate rows, then its up rows: the pairs quant_gemv_experts reads), down as it is. Block types only.
Status upload_experts(WeightArena& b, const LayerWeights& w, int layer, int64_t e0, int64_t e1, Tensor* gate_up,
                      Tensor* down) {
  for (const Tensor* t : {&w.gate_exps, &w.up_exps, &w.down_exps}) {
    if (!is_block_quant(t->dtype())) {
      return unimplemented_error(
          "cuda: layer " + std::to_string(layer) + "'s experts are " +
          std::string(dtype_name(t->dtype())) +
          ": the GPU runs experts in block types only (Q4_K, Q8_0, MXFP4, ...)");
    }
  }
  if (w.gate_exps.dtype() != w.up_exps.dtype()) {
    return unimplemented_error("cuda: layer " + std::to_string(layer) +
                               "'s gate and up experts differ in type");
  }
  COMBS_ASSIGN_OR_RETURN(*gate_up, upload_pairs(b, w.gate_exps.rows(e0, e1), w.up_exps.rows(e0, e1)));
  const Tensor held = w.down_exps.rows(e0, e1);
  COMBS_ASSIGN_OR_RETURN(*down, b.alloc(held.shape(), held.dtype()));
  return b.copy(held, *down);
}

bool decode_fused(const WeightStack& w, int64_t n) {
  for (const Tensor& p : w.parts)
    if (!cuda::decode_fused(p, n)) return false;
  return true;
}

// The dtype x takes for every part of w (cuda::input_dtype), or F32 where the parts differ (each
// then rounds x itself, from f32).
DType input_dtype(const WeightStack& w) {
  const DType dt = cuda::input_dtype(w.first());
  for (const Tensor& p : w.parts)
    if (cuda::input_dtype(p) != dt) return DType::kF32;
  return dt;
}

// cuda::matmul_split over each part of w with its outputs (rounded: x is in input_dtype(w)).
Status matmul_split(CudaBackend& b, const WeightStack& w, const void* x, int64_t n, std::span<const cuda::MatmulOut> outs,
                    bool rounded, const float* norm_weight = nullptr, float eps = 0.0f) {
  if (!rounded) {  // x rounded to 8 bits once for every part where they all take the decode kernel
    return cuda::matmul_split_parts(b, w.parts, w.outputs, static_cast<const float*>(x), n, outs, norm_weight, eps);
  }
  size_t at = 0;
  for (size_t i = 0; i < w.parts.size(); ++i) {
    COMBS_RETURN_IF_ERROR(cuda::matmul_split_rounded(b, w.parts[i], x, n, outs.subspan(at, w.outputs[i])));
    at += w.outputs[i];
  }
  return ok_status();
}

}  // namespace

StatusOr<std::unique_ptr<CudaRunner>> CudaRunner::create(const Model& model, CudaRunnerOptions options) {
  {
    const ModelConfig& c = model.config();
    if (c.activation == Activation::kSwigluOai && c.dense_ffn()) {  // (gpt-oss has experts only)
      return unimplemented_error("cuda: " + c.arch_name + ": the clamped SwiGLU in a dense FFN runs on the CPU only");
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->tp = options.collective;
  const int rank = impl->tp ? impl->tp->rank() : 0, world = impl->tp ? impl->tp->world() : 1;
  COMBS_ASSIGN_OR_RETURN(impl->shard, plan_shard(model, rank, world));
  impl->config = shard_config(model.config(), impl->shard);
  const Shard& sh = impl->shard;
  impl->use_graphs = options.cuda_graphs && (!impl->tp || impl->tp->capturable());
  COMBS_ASSIGN_OR_RETURN(impl->backend,
                         CudaBackend::create({.device = impl->tp ? impl->tp->device() : options.device}));
  if (options.time_device) {
    COMBS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl->launched));
    COMBS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl->finished));
  }
  register_cuda_attention();
  const ModelConfig& c = model.config();
  size_t free_before = 0, free_after = 0, total = 0;
  COMBS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total));
  WeightArena b(*impl->backend);
  if (world == 1) {  // every file tensor once, each aligned, and the RoPE tables (a rank's share: unsized)
    const size_t tensors = model.file().tensors().size() + 2;
    COMBS_RETURN_IF_ERROR(b.reserve(static_cast<size_t>(model.file_tensor_bytes()) + 256 * tensors +
                                    2 * sizeof(float) * static_cast<size_t>(c.rope_dim)));
  }
  impl->weights = b.block();
  COMBS_ASSIGN_OR_RETURN(impl->tok_embd, upload(b, {&model.tok_embd}));
  COMBS_ASSIGN_OR_RETURN(impl->output_norm, upload(b, {&model.output_norm}));
  if (model.output.data() == model.tok_embd.data() && world == 1) {
    impl->output = impl->tok_embd;  // tied
  } else {  // (a rank's vocabulary rows)
    const Tensor rows = model.output.rows(sh.vocab_begin(rank), sh.vocab_begin(rank) + sh.vocab_rows(rank));
    COMBS_ASSIGN_OR_RETURN(impl->output, upload(b, {&rows}));
  }
  const int64_t hd = c.head_dim;
  // This rank's rows of Q, K, V (its heads), gate and up (its FFN columns); its columns of the
  // attention output and down.
  const int64_t q0 = rank * sh.nq * hd, q1 = q0 + sh.nq * hd, kv0 = rank * sh.nkv * hd, kv1 = kv0 + sh.nkv * hd;
  const int64_t f0 = rank * sh.ff, f1 = f0 + sh.ff;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerWeights& w = model.layers[i];
    Impl::Layer l;
    if (c.n_expert > 0) {  // (the router whole: every rank routes every token)
      const int64_t e0 = sh.expert_begin(), e1 = e0 + sh.n_exp;
      COMBS_ASSIGN_OR_RETURN(l.router, upload(b, {&w.router}));
      COMBS_RETURN_IF_ERROR(upload_experts(b, w, static_cast<int>(i), e0, e1, &l.gate_up_exps, &l.down_exps));
      if (c.shared_expert) {
        const Tensor row = w.shared_gate.reshape({1, c.n_embd});
        COMBS_ASSIGN_OR_RETURN(l.shared_gate, upload(b, {&row}));
      }
      COMBS_ASSIGN_OR_RETURN(l.router_b, upload(b, {&w.router_b}));
      if (w.gate_exps_b.defined()) {
        const int64_t ff = w.gate_exps_b.dim(1);
        const Tensor gb = w.gate_exps_b.rows(e0, e1), ub = w.up_exps_b.rows(e0, e1);
        COMBS_ASSIGN_OR_RETURN(l.gate_up_exps_b,
                               upload_pairs(b, gb.reshape({e1 - e0, 1, ff}), ub.reshape({e1 - e0, 1, ff})));
      }
      const Tensor down_b = rows_of(w.down_exps_b, e0, e1);
      COMBS_ASSIGN_OR_RETURN(l.down_exps_b, upload(b, {&down_b}));
    }
    if (rank == 0) {  // (added once, before the all-reduce)
      COMBS_ASSIGN_OR_RETURN(l.bo, upload(b, {&w.bo}));
    }
    const Tensor sinks = rows_of(w.sinks, rank * sh.nq, (rank + 1) * sh.nq);
    COMBS_ASSIGN_OR_RETURN(l.sinks, upload(b, {&sinks}));
    COMBS_ASSIGN_OR_RETURN(l.attn_norm, upload(b, {&w.attn_norm}));
    const Tensor wq = w.wq.rows(q0, q1), wk = w.wk.rows(kv0, kv1), wv = w.wv.rows(kv0, kv1);
    COMBS_ASSIGN_OR_RETURN(l.wqkv, upload_stack(b, {&wq, &wk, &wv}));
    const Tensor bq = rows_of(w.bq, q0, q1), bk = rows_of(w.bk, kv0, kv1), bv = rows_of(w.bv, kv0, kv1);
    COMBS_ASSIGN_OR_RETURN(l.bqkv, upload(b, {&bq, &bk, &bv}));
    COMBS_ASSIGN_OR_RETURN(l.wo, upload_columns(b, w.wo, q0, q1));
    COMBS_ASSIGN_OR_RETURN(l.ffn_norm, upload(b, {&w.ffn_norm}));
    if (c.dense_ffn()) {
      const Tensor gate = w.w_gate.rows(f0, f1), up = w.w_up.rows(f0, f1);
      COMBS_ASSIGN_OR_RETURN(l.w_gate_up, upload_stack(b, {&gate, &up}));
      COMBS_ASSIGN_OR_RETURN(l.w_down, upload_columns(b, w.w_down, f0, f1));
    }
    COMBS_ASSIGN_OR_RETURN(l.q_norm, upload(b, {&w.q_norm}));
    COMBS_ASSIGN_OR_RETURN(l.k_norm, upload(b, {&w.k_norm}));
    COMBS_ASSIGN_OR_RETURN(l.post_attn_norm, upload(b, {&w.post_attn_norm}));
    COMBS_ASSIGN_OR_RETURN(l.post_ffn_norm, upload(b, {&w.post_ffn_norm}));
    impl->layers.push_back(std::move(l));
  }
  // The model's RoPE frequencies (the CPU runner's, so both rotate by the same f32 angles).
  for (bool local : {false, true}) {
    const std::vector<float>& f = model.rope_inv_freq(local);
    const Tensor host = Tensor::wrap(const_cast<float*>(f.data()), Shape{c.rope_dim / 2}, DType::kF32);
    Tensor& table = local ? impl->inv_freq_local : impl->inv_freq;  // (not `c ? a : b` as a macro's target:
    COMBS_ASSIGN_OR_RETURN(table, upload(b, {&host}));              //  `c ? a : b = x` assigns b alone)
  }
  COMBS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total));
  impl->stats.weight_bytes = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  return std::unique_ptr<CudaRunner>(new CudaRunner(model, std::move(impl)));
}

CudaRunner::CudaRunner(const Model& model, std::unique_ptr<Impl> impl) : model_(&model), impl_(std::move(impl)) {}
CudaRunner::~CudaRunner() = default;
Backend& CudaRunner::backend() { return *impl_->backend; }
CudaBackend& CudaRunner::cuda() { return *impl_->backend; }
CudaRunnerStats CudaRunner::stats() const { return impl_->stats; }
KVGeometry CudaRunner::kv_geometry(DType dtype) const { return impl_->config.kv_geometry(dtype); }

// Decode steps of at most this many sequences run as CUDA graphs.
constexpr int64_t kMaxGraphBatch = 512;
// How long a tensor-parallel rank waits for a forward's collectives before it gives the group up
// (a prefill of thousands of tokens on a large model takes seconds).
constexpr std::chrono::milliseconds kCollectiveDeadline{60000};

Status CudaRunner::forward(std::span<const SequenceInput> seqs, float* logits, ForwardOptions options) {
  const Model& m = *model_;
  const ModelConfig& c = m.config();
  Impl& I = *impl_;
  CudaBackend& b = *I.backend;
  if (I.tp && I.tp->aborted()) {  // (its graphs hold collectives of freed communicators)
    return unavailable_error("cuda: tensor-parallel rank " + std::to_string(I.shard.rank) +
                             ": the group was aborted after a failure");
  }
  if (seqs.empty()) return ok_status();
  const auto t_enter = std::chrono::steady_clock::now();
  int64_t total = 0;
  COMBS_RETURN_IF_ERROR(check_forward_inputs(I.config, seqs, &b, &total));  // (this rank's KV heads)
  // This rank's query heads, KV heads and FFN width (the model's on one GPU).
  const int64_t e = c.n_embd, hd = c.head_dim, nq = I.shard.nq, nkv = I.shard.nkv, ff = I.shard.ff;
  const Shard& sh = I.shard;
  const bool lead = sh.rank == 0;  // samples, or writes the logits and token ids
  const int64_t n_out = output_rows(seqs, options.all_logits);
  const bool sampling = !options.sampling.empty();
  if (!lead && (sampling || options.token_ids || logits)) {
    return invalid_argument_error("forward: tensor-parallel rank " + std::to_string(sh.rank) +
                                  " has no logits to give: rank 0 samples and writes them");
  }
  if (sampling) COMBS_RETURN_IF_ERROR(check_sampling(options, n_out, c.n_vocab));
  // The activations, grown to this step's size. (A rank's failure here, or anywhere after the
  // checks every rank makes alike, aborts the group: its peers are in collectives it never joins.)
  auto grow = [&]() -> Status {
    if (total > I.capacity) {
      const int64_t cap = std::max<int64_t>(total, 2 * I.capacity);
      COMBS_ASSIGN_OR_RETURN(I.x, b.alloc({cap, e}, DType::kF32));
      COMBS_ASSIGN_OR_RETURN(I.h, b.alloc({cap, e}, DType::kF32));
      COMBS_ASSIGN_OR_RETURN(I.delta, b.alloc({cap, e}, DType::kF32));
      COMBS_ASSIGN_OR_RETURN(I.q, b.alloc({cap, nq * hd}, DType::kF32));
      COMBS_ASSIGN_OR_RETURN(I.att, b.alloc({cap, nq * hd}, DType::kF32));
      // K then V, gate then up, in one allocation each: their projections run as one batched GEMM.
      COMBS_ASSIGN_OR_RETURN(Tensor kv, b.alloc({2 * cap, nkv * hd}, DType::kF32));
      I.k = kv.rows(0, cap), I.v = kv.rows(cap, 2 * cap);
      COMBS_ASSIGN_OR_RETURN(Tensor gate_up, b.alloc({2 * cap, ff}, DType::kF32));
      I.gate = gate_up.rows(0, cap), I.up = gate_up.rows(cap, 2 * cap);
      COMBS_ASSIGN_OR_RETURN(I.last, b.alloc({cap, e}, DType::kF32));
      COMBS_ASSIGN_OR_RETURN(I.ints, b.alloc({3 * cap}, DType::kF32));  // int32: tokens, rows, ids
      if (c.n_expert > 0) {
        const int64_t kk = c.n_expert_used, fe = c.n_ff_exp;
        COMBS_ASSIGN_OR_RETURN(I.router_logits, b.alloc({cap, c.n_expert}, DType::kF32));
        // int32: ids, order [cap k], start [expert_start_size]; f32: weights [cap k], hidden [cap k, ff],
        // out [cap k, e] (Each part 256-byte aligned: the kernels load rows by 16 bytes.)
        auto up = [](int64_t n) { return (n + 63) / 64 * 64; };
        const int64_t pairs = up(cap * kk);
        COMBS_ASSIGN_OR_RETURN(I.expert_ints, b.alloc({2 * pairs + cuda::expert_start_size(c.n_expert)}, DType::kF32));
        COMBS_RETURN_IF_ERROR(b.zero(I.expert_ints));  // (start's last entry: the router's counter)
        COMBS_ASSIGN_OR_RETURN(I.expert_floats,
                               b.alloc({pairs + up(cap * kk * fe) + cap * kk * e}, DType::kF32));
        const size_t xq = cuda::expert_activation_bytes(cap, static_cast<int>(kk), e, fe);
        COMBS_ASSIGN_OR_RETURN(I.expert_xq,
                               b.alloc({static_cast<int64_t>((xq + 3) / 4)}, DType::kF32));
        int32_t* ints = I.expert_ints.data_as<int32_t>();
        float* floats = I.expert_floats.data_as<float>();
        I.experts = {ints,
                     floats,
                     ints + pairs,
                     ints + 2 * pairs,
                     I.expert_xq.data(),
                     floats + pairs,
                     floats + pairs + up(cap * kk * fe)};
        if (c.shared_expert) {
          COMBS_ASSIGN_OR_RETURN(I.shared_out, b.alloc({cap, e}, DType::kF32));
          COMBS_ASSIGN_OR_RETURN(I.shared_logit, b.alloc({cap, 1}, DType::kF32));
        }
      }
      I.capacity = cap;
      ++I.activations_generation;
    }
    if (n_out > I.logit_rows) {
      if (lead) {
        COMBS_ASSIGN_OR_RETURN(I.logits, b.alloc({n_out, static_cast<int64_t>(c.n_vocab)}, DType::kF32));
      }
      if (sh.world > 1) {
        COMBS_ASSIGN_OR_RETURN(I.part, b.alloc({n_out, sh.vocab_stride}, DType::kF32));
        COMBS_ASSIGN_OR_RETURN(I.gathered, b.alloc({sh.world, n_out * sh.vocab_stride}, DType::kF32));
      } else {
        I.part = I.logits;
      }
      I.logit_rows = n_out;
      ++I.activations_generation;
    }
    return ok_status();
  };
  if (Status s = grow(); !s.ok()) {
    if (I.tp) I.tp->abort();
    return s;
  }
  // Tokens and the rows whose logits are wanted: one upload (positions travel with the attention
  // metadata).
  I.host_ints.assign(static_cast<size_t>(total + n_out), 0);
  I.batch.clear();
  bool decode = true;  // one new token per sequence
  int64_t row = 0, out = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SequenceInput& in = seqs[s];
    const int64_t pos = in.cache->seq_len();
    I.batch.push_back({in.cache, pos, static_cast<int64_t>(in.tokens.size())});
    decode &= in.tokens.size() == 1;
    const bool every = options.all_logits || in.all_logits;
    for (size_t i = 0; i < in.tokens.size(); ++i, ++row) {
      I.host_ints[static_cast<size_t>(row)] = in.tokens[i];
      if (every || i + 1 == in.tokens.size()) I.host_ints[static_cast<size_t>(total + out++)] = static_cast<int32_t>(row);
    }
  }
  // A step that verifies drafts (a sequence with an output row per token) of 4 to 8 rows takes
  // cuBLAS for its F16/BF16 projections: on the H100 a 5-token verification of llama-8b took 6.9 ms
  // there against 7.6 on the tensor-core decode kernel (llama-1b: 1.88 vs 1.77 ms; bench/RESULTS.md,
  // 2026-12-07 session 12). Its numbers differ from the decode kernels' in the last bits, as a
  // multi-token step's attention does already.
  bool verifying = false;
  for (const SequenceInput& in : seqs) verifying |= in.tokens.size() > 1 && (options.all_logits || in.all_logits);
  const cuda::RowsForDecodeKernel decode_kernel_rows(verifying ? 3 : 8);
  // Checks the caches, reserves their pages and uploads the attention metadata, for every layer;
  // RoPE runs inside the step, fused with the K/V append.
  const AttentionRope rope{I.inv_freq.data_as<float>(), c.rope_dim, c.rope_style == RopeStyle::kAdjacent};
  if (Status s = I.step.begin(I.batch, static_cast<int>(nq), &rope, default_attention_impl(), c.widest_window()); !s.ok()) {
    // (Checks every rank makes alike fail on all: INVALID_ARGUMENT, FAILED_PRECONDITION; others
    // may be this device's alone.)
    if (I.tp && s.code() != StatusCode::kInvalidArgument && s.code() != StatusCode::kFailedPrecondition) {
      I.tp->abort();
    }
    return s;
  }
  auto fail = [&](const Status& s) {
    // A rank that fails mid-step leaves its peers' collectives unmatched: the group is given up.
    if (I.tp) I.tp->abort();
    b.synchronize().ignore();
    I.step.cancel();  // the caches keep their lengths; pages reserved for this step go back
    return s;
  };
  auto st = static_cast<cudaStream_t>(b.stream());
  int32_t* d_ints = I.ints.data_as<int32_t>();
  if (Status s = cuda::cuda_status(cudaMemcpyAsync(d_ints, I.host_ints.data(), I.host_ints.size() * 4,
                                                   cudaMemcpyHostToDevice, st),
                                   "cudaMemcpyAsync(tokens)");
      !s.ok()) {
    return fail(s);
  }
  int32_t* d_ids = d_ints + total + n_out;  // token ids, after the rows (the buffer has room: 3 * capacity)
  // Sampling: every row's parameters, draw, bias and penalty entries, one upload.
  const cuda::SampleParamsDev* d_sample_params = nullptr;
  const cuda::SampleAdjustDev* d_sample_adjust = nullptr;
  if (sampling) {
    pack_sampling(options.sampling, &I.sampling);
    auto dev = b.upload(CudaBackend::kSamplingSlot, I.sampling.data(), I.sampling.size());
    if (!dev.ok()) return fail(dev.status());
    d_sample_params = static_cast<const cuda::SampleParamsDev*>(*dev);
    d_sample_adjust = reinterpret_cast<const cuda::SampleAdjustDev*>(d_sample_params + n_out);
  }
  const bool device_argmax = options.token_ids && !sampling;
  // Tensor parallelism: the partial sums of every rank's share of a row-split projection, summed.
  auto all_reduce = [&](float* data) -> Status {
    return sh.world == 1 ? ok_status() : I.tp->all_reduce_sum(data, total * e, b.stream());
  };

  // Every device operation of the forward, from the embedding to the logits (or their argmax): only
  // launches, so that a decode step's can be captured into a graph.
  auto launches = [&]() -> Status {
    const int32_t* d_tokens = d_ints;
    const int32_t* d_rows = d_ints + total;
    float* x = I.x.data_as<float>();
    float* h = I.h.data_as<float>();
    float* delta = I.delta.data_as<float>();
    float* q = I.q.data_as<float>();
    float* k = I.k.data_as<float>();
    float* v = I.v.data_as<float>();
    float* att = I.att.data_as<float>();
    const Tensor q_t = Tensor::wrap(q, {total, nq, hd}, DType::kF32, DeviceType::kCuda);
    const Tensor k_t = Tensor::wrap(k, {total, nkv, hd}, DType::kF32, DeviceType::kCuda);
    const Tensor v_t = Tensor::wrap(v, {total, nkv, hd}, DType::kF32, DeviceType::kCuda);
    const Tensor att_t = Tensor::wrap(att, {total, nq, hd}, DType::kF32, DeviceType::kCuda);
    auto bias = [](const Tensor& t) { return t.defined() ? t.data_as<float>() : nullptr; };
    COMBS_RETURN_IF_ERROR(cuda::embedding(b, I.tok_embd, d_tokens, total, x));
    if (c.embed_scale != 1.0f) COMBS_RETURN_IF_ERROR(cuda::scale(b, x, total * e, c.embed_scale));
    // Decode-sized steps fold the norms into the projections' input and the residual adds into
    // their output (x += W a): no separate norm or add kernels. (Every layer's projections: a
    // mixed file's layers differ in their types.) The gate/up pair must be one tensor whose
    // output the down projection takes as it is.
    // (Architectures with post norms or an activation the fused kernels lack take the general
    // path; q/k norms run on the projections' outputs either way.)
    // A mixture of experts folds the attention's: the experts add their sum to the residual
    // (experts_ffn's accumulate) after the FFN's norm (in f32: the router and the experts' 8-bit
    // rounding take it).
    // Tensor parallelism: a row-split projection's partial outputs are summed by an all-reduce.
    // Fused, rank 0 adds its part to the residual x and the others write theirs over their copy
    // of x, so the all-reduce of x leaves every rank the residual plus every part; in the general
    // path the parts in delta are summed before they join the residual.
    // A dense FFN, decode-sized, whose gate/up pair and product come from one kernel and whose
    // down projection takes that product as it is (the fused path's, and the general path's for
    // gemma's post norms and GELU).
    auto decode_pairs = [&](const Impl::Layer& w) {
      return (c.activation == Activation::kSilu || c.activation == Activation::kGeluTanh) &&
             decode_fused(w.w_gate_up, total) && w.w_gate_up.parts.size() == 1 && cuda::decode_fused(w.w_down, total) &&
             cuda::input_dtype(w.w_gate_up.first()) == cuda::input_dtype(w.w_down);
    };
    bool fused_attention = !c.post_norms;
    bool fused = !c.post_norms && c.activation == Activation::kSilu && c.n_expert == 0;
    for (const Impl::Layer& w : I.layers) {
      fused_attention = fused_attention && decode_fused(w.wqkv, total) && cuda::decode_fused(w.wo, total);
      fused = fused && fused_attention && decode_pairs(w);
    }
    fused_attention = fused_attention && (fused || c.n_expert > 0);  // the residual whole in x after every layer
    // Otherwise: add delta (if any; normalized by add_norm first where that is set: a post norm)
    // to the residual and normalize it with norm_w, then project the norm by wt into outs. The
    // norm's output is rounded for the projection's GEMM (in h, which has room for it) or, where
    // this projection alone takes the decode kernel, stays f32 for it.
    // A post norm's weights still to apply to delta where it joins the residual (gemma2, gemma3:
    // one kernel for the post norm, the residual add and the next norm).
    const float* delta_norm = nullptr;
    // Where every part takes x rounded to 8 bits, the norm's kernel rounds it (into h): no
    // rounding kernel between the norm and the projection.
    auto takes_q8 = [&](const WeightStack& wt) {
      bool all = true;
      for (const Tensor& p : wt.parts) all = all && cuda::takes_q8(p, total) && p.dim(1) == wt.first().dim(1);
      return all;
    };
    auto norm_then_split = [&](const float* add, const float* add_norm, const Tensor& norm_w, const WeightStack& wt,
                               std::span<const cuda::MatmulOut> outs) -> Status {
      if (takes_q8(wt)) {
        COMBS_RETURN_IF_ERROR(cuda::add_normed_rms_norm_q8(b, x, add, add_norm, norm_w.data_as<float>(), h, total, e, c.rms_eps));
        return cuda::matmul_split_parts_q8(b, wt.parts, wt.outputs, h, total, outs);
      }
      const bool gemv = decode_fused(wt, total);
      const DType dt = gemv ? DType::kF32 : input_dtype(wt);
      COMBS_RETURN_IF_ERROR(
          cuda::add_normed_rms_norm(b, x, add, add_norm, norm_w.data_as<float>(), h, dt, total, e, c.rms_eps));
      return matmul_split(b, wt, h, total, outs, /*rounded=*/dt != DType::kF32);
    };
    const cuda::MatmulOut gate_up[] = {{I.gate.data_as<float>(), ff}, {I.up.data_as<float>(), ff}};
    // The layer's experts on h (its FFN norm's output), their sum into y (+= with accumulate).
    auto experts = [&](const Impl::Layer& w, float* y, bool accumulate) -> Status {
      cuda::ExpertsFfn f{.gate_up = &w.gate_up_exps,
                         .down = &w.down_exps,
                         .k = c.n_expert_used,
                         .normalize = c.expert_weights_norm,
                         .softmax_chosen = c.expert_softmax_chosen,
                         .gate_up_bias = bias(w.gate_up_exps_b),
                         .down_bias = bias(w.down_exps_b),
                         .router = &w.router,
                         .router_bias = bias(w.router_b),
                         .n_expert = c.n_expert,
                         .first_expert = static_cast<int>(sh.expert_begin())};
      if (c.activation == Activation::kSwigluOai) f.swiglu_alpha = kSwigluOaiAlpha, f.swiglu_limit = kSwigluOaiLimit;
      if (c.shared_expert) {
        COMBS_RETURN_IF_ERROR(matmul_split(b, w.w_gate_up, h, total, gate_up, /*rounded=*/false));
        COMBS_RETURN_IF_ERROR(cuda::matmul_swiglu(b, w.w_down, I.gate.data_as<float>(),
                                                  I.up.data_as<float>(), total,
                                                  I.shared_out.data_as<float>()));
        COMBS_RETURN_IF_ERROR(
            cuda::matmul(b, w.shared_gate, h, total, I.shared_logit.data_as<float>()));
        f.shared = I.shared_out.data_as<float>(),
        f.shared_logit = I.shared_logit.data_as<float>();
      }
      return cuda::experts_ffn(b, f, I.router_logits.data_as<float>(), h, total, I.experts, y, accumulate);
    };
    for (int l = 0; l < c.n_layers; ++l) {
      const Impl::Layer& w = I.layers[static_cast<size_t>(l)];
      const float* bqkv = bias(w.bqkv);
      const cuda::MatmulOut qkv[] = {{q, nq * hd, bqkv}, {k, nkv * hd, bqkv ? bqkv + nq * hd : nullptr},
                                     {v, nkv * hd, bqkv ? bqkv + (nq + nkv) * hd : nullptr}};
      if (fused_attention) {
        COMBS_RETURN_IF_ERROR(matmul_split(b, w.wqkv, x, total, qkv, false, w.attn_norm.data_as<float>(), c.rms_eps));
      } else {
        // The previous layer's MLP output joins the residual here, fused with this layer's norm.
        COMBS_RETURN_IF_ERROR(norm_then_split(l == 0 ? nullptr : delta, delta_norm, w.attn_norm, w.wqkv, qkv));
      }
      if (c.qk_norm) {  // every head of q and k, in place, before the step's RoPE
        COMBS_RETURN_IF_ERROR(cuda::heads_rms_norm(b, q, w.q_norm.data_as<float>(), total * nq, k,
                                                   w.k_norm.data_as<float>(), total * nkv, hd, c.rms_eps));
      }
      const LayerAttention& la = m.attention(l);
      AttentionParams params(la.scale, la.window, la.softcap, la.rope_mscale);
      params.sinks = bias(w.sinks);  // (the device's copy of la.sinks)
      COMBS_RETURN_IF_ERROR(I.step.run(l, q_t, k_t, v_t, params, att_t,
                                       la.window > 0 ? I.inv_freq_local.data_as<float>() : nullptr));
      if (fused) {
        COMBS_RETURN_IF_ERROR(cuda::matmul(b, w.wo, att, total, x, bias(w.bo), /*accumulate=*/lead));
        COMBS_RETURN_IF_ERROR(all_reduce(x));
        // silu(gate) * up in the weights' dtype, over the gate buffer (half its bytes).
        COMBS_RETURN_IF_ERROR(cuda::matmul_gate_up(b, w.w_gate_up.first(), x, total, w.ffn_norm.data_as<float>(), c.rms_eps, I.gate.data()));
        COMBS_RETURN_IF_ERROR(cuda::matmul_rounded(b, w.w_down, I.gate.data(), total, x, /*accumulate=*/lead));
        COMBS_RETURN_IF_ERROR(all_reduce(x));
      } else if (fused_attention) {  // a mixture of experts, decode-sized: the residual stays in x
        COMBS_RETURN_IF_ERROR(cuda::matmul(b, w.wo, att, total, x, bias(w.bo), /*accumulate=*/lead));
        COMBS_RETURN_IF_ERROR(all_reduce(x));
        COMBS_RETURN_IF_ERROR(cuda::add_rms_norm(b, x, nullptr, w.ffn_norm.data_as<float>(), h, total, e, c.rms_eps));
        COMBS_RETURN_IF_ERROR(experts(w, x, /*accumulate=*/lead));  // (the ranks' parts summed below)
        COMBS_RETURN_IF_ERROR(all_reduce(x));
      } else {
        COMBS_RETURN_IF_ERROR(cuda::matmul(b, w.wo, att, total, delta, bias(w.bo)));
        COMBS_RETURN_IF_ERROR(all_reduce(delta));
        delta_norm = c.post_norms ? w.post_attn_norm.data_as<float>() : nullptr;
        if (c.n_expert > 0) {  // the residual add, the norm in f32, then the experts into delta
          COMBS_RETURN_IF_ERROR(cuda::add_normed_rms_norm(b, x, delta, delta_norm, w.ffn_norm.data_as<float>(), h,
                                                          DType::kF32, total, e, c.rms_eps));
          COMBS_RETURN_IF_ERROR(experts(w, delta, /*accumulate=*/false));
        } else if (decode_pairs(w)) {  // the pair's product from one kernel, in the down projection's dtype
          const auto act = c.activation == Activation::kGeluTanh ? cuda::GateActivation::kGeluTanh : cuda::GateActivation::kSilu;
          if (takes_q8(w.w_gate_up)) {
            COMBS_RETURN_IF_ERROR(cuda::add_normed_rms_norm_q8(b, x, delta, delta_norm, w.ffn_norm.data_as<float>(), h,
                                                               total, e, c.rms_eps));
            COMBS_RETURN_IF_ERROR(cuda::matmul_gate_up_q8(b, w.w_gate_up.first(), h, total, I.gate.data(), act));
          } else {
            COMBS_RETURN_IF_ERROR(cuda::add_normed_rms_norm(b, x, delta, delta_norm, w.ffn_norm.data_as<float>(), h,
                                                            DType::kF32, total, e, c.rms_eps));
            COMBS_RETURN_IF_ERROR(cuda::matmul_gate_up(b, w.w_gate_up.first(), h, total, nullptr, 0.0f, I.gate.data(), act));
          }
          COMBS_RETURN_IF_ERROR(cuda::matmul_rounded(b, w.w_down, I.gate.data(), total, delta));
        } else {
          COMBS_RETURN_IF_ERROR(norm_then_split(delta, delta_norm, w.ffn_norm, w.w_gate_up, gate_up));
          if (c.activation == Activation::kGeluTanh) {
            COMBS_RETURN_IF_ERROR(
                cuda::gelu_tanh_mul(b, I.gate.data_as<float>(), I.up.data_as<float>(), total * ff));
            COMBS_RETURN_IF_ERROR(cuda::matmul(b, w.w_down, I.gate.data_as<float>(), total, delta));
          } else {
            COMBS_RETURN_IF_ERROR(cuda::matmul_swiglu(b, w.w_down, I.gate.data_as<float>(),
                                                      I.up.data_as<float>(), total, delta));
          }
        }
        COMBS_RETURN_IF_ERROR(all_reduce(delta));  // (the experts' or the FFN's parts)
        delta_norm = c.post_norms ? w.post_ffn_norm.data_as<float>() : nullptr;
      }
    }
    if (fused_attention && n_out == total && cuda::decode_fused(I.output, n_out)) {
      // Every row wanted (the rows ascend: in place): the final norm folded into the logits' projection.
      const cuda::MatmulOut logits_out[] = {{I.part.data_as<float>(), sh.vocab_rows(sh.rank)}};
      COMBS_RETURN_IF_ERROR(cuda::matmul_split(b, I.output, x, total, logits_out, I.output_norm.data_as<float>(), c.rms_eps));
    } else {
      // The last residual add, the wanted rows, the final norm and the logits.
      COMBS_RETURN_IF_ERROR(cuda::add_normed_rms_norm(b, x, fused_attention ? nullptr : delta,
                                                      fused_attention ? nullptr : delta_norm,
                                                      I.output_norm.data_as<float>(), h, DType::kF32, total, e, c.rms_eps));
      COMBS_RETURN_IF_ERROR(cuda::gather_rows(b, h, d_rows, n_out, e, I.last.data_as<float>()));
      COMBS_RETURN_IF_ERROR(cuda::matmul(b, I.output, I.last.data_as<float>(), n_out, I.part.data_as<float>()));
    }
    const int64_t part_cols = sh.vocab_rows(sh.rank);
    if (c.final_softcap > 0.0f) {
      COMBS_RETURN_IF_ERROR(cuda::softcap(b, I.part.data_as<float>(), n_out * part_cols, c.final_softcap));
    }
    if (sh.world > 1) {  // every rank's vocabulary columns to rank 0, into the rows of its logits
      const int64_t each = n_out * sh.vocab_stride;
      COMBS_RETURN_IF_ERROR(I.tp->all_gather(I.part.data_as<float>(), I.gathered.data_as<float>(), each, b.stream()));
      for (int r = 0; lead && r < sh.world; ++r) {
        const size_t width = static_cast<size_t>(sh.vocab_rows(r)) * 4;
        COMBS_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(I.logits.data_as<float>() + sh.vocab_begin(r),
                                                     static_cast<size_t>(c.n_vocab) * 4,
                                                     I.gathered.data_as<float>() + r * each, width, width,
                                                     static_cast<size_t>(n_out), cudaMemcpyDeviceToDevice, st));
      }
    }
    if (device_argmax) COMBS_RETURN_IF_ERROR(cuda::argmax_rows(b, I.logits.data_as<float>(), n_out, c.n_vocab, d_ids));
    return ok_status();
  };

  if (I.launched) {
    if (Status s = cuda::cuda_status(cudaEventRecord(I.launched, st), "cudaEventRecord"); !s.ok()) return fail(s);
  }
  Status ran;
  const int64_t n_seqs = static_cast<int64_t>(seqs.size());
  if (I.use_graphs && decode && n_seqs <= kMaxGraphBatch && I.step.replayable()) {
    // Everything a captured launch depends on: the attention's launches, the scratch and
    // activation buffers, and what the step computes.
    uint64_t key = I.step.launch_key();
    for (uint64_t f : {b.scratch_generation(), I.activations_generation, static_cast<uint64_t>(n_seqs),
                       static_cast<uint64_t>(device_argmax)}) {
      key = hash_mix(key, f);
    }
    ran = I.graphs[2 * n_seqs + (device_argmax ? 1 : 0)].run(st, key, launches, I.stats);
  } else {
    ran = launches();
  }
  if (ran.ok() && sampling) {
    ran = cuda::sample_rows(b, I.logits.data_as<float>(), n_out, c.n_vocab, d_sample_params, d_sample_adjust, d_ids);
  }
  if (ran.ok() && I.finished) ran = cuda::cuda_status(cudaEventRecord(I.finished, st), "cudaEventRecord");
  if (!ran.ok()) return fail(ran);
  // (Before the copy: a copy to pageable host memory waits for the device.)
  I.stats.host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_enter).count();
  // A rank waits for its peers' collectives with a deadline: a failed peer aborts the group, never
  // a hang.
  if (I.tp) {
    if (Status s = I.tp->wait(b.stream(), kCollectiveDeadline); !s.ok()) return fail(s);
  }
  if (lead) {
    const Status copied =
        options.token_ids
            ? cuda::cuda_status(cudaMemcpyAsync(options.token_ids, d_ids, static_cast<size_t>(n_out) * 4,
                                                cudaMemcpyDeviceToHost, st),
                                "cudaMemcpyAsync(argmax)")  // only the token ids cross to the host
            : cuda::cuda_status(cudaMemcpyAsync(logits, I.logits.data(), static_cast<size_t>(n_out * c.n_vocab) * 4,
                                                cudaMemcpyDeviceToHost, st),
                                "cudaMemcpyAsync(logits)");
    if (!copied.ok()) return fail(copied);
  }
  if (Status s = b.synchronize(); !s.ok()) return fail(s);
  if (I.launched) {
    float ms = 0.0f;
    if (Status s = cuda::cuda_status(cudaEventElapsedTime(&ms, I.launched, I.finished), "cudaEventElapsedTime"); !s.ok()) {
      return fail(s);
    }
    I.stats.device_seconds += ms * 1e-3;
  }
  I.step.commit();
  return ok_status();
}

}  // namespace combs
