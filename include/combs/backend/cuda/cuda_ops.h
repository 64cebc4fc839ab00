// Device ops of the CUDA backend, on device pointers, queued on the backend's stream (they
// return when queued; errors of the launch come back at once, errors of the kernel at the next
// synchronize()). Activations are f32; weights keep their dtype (F32, F16, BF16, or any block type
// of combs/backend/quant.h, kept in its blocks: see src/backend/cuda/quant_matmul.h).
#pragma once

#include <cstdint>
#include <span>

#include "combs/backend/cuda/cuda_backend.h"
#include "combs/backend/tensor.h"

namespace combs::cuda {

// Copies `bytes` for each of n chunks (the list in device memory: CudaBackend::copy_chunks), a
// block per chunk, 16 bytes a load where every address and the size allow.
Status copy_chunks(CudaBackend& b, const Backend::CopyChunk* chunks, int64_t n, size_t bytes);

// y[t, :] = x[t, :] @ w^T (+ bias): w [out, in] on the device, x [n, in] f32, y [n, out] f32.
// F16/BF16 weights: x rounded to the weight's dtype, f32 accumulation; n <= 8 (decode) a
// bandwidth-bound kernel, larger n cuBLAS on tensor cores. F32 weights: cuBLAS SGEMM. Block types:
// n <= 8 x rounded to 8 bits and int8 dot products over the blocks, larger n the blocks
// dequantized to BF16 a tile at a time for cuBLAS.
// accumulate: y += the product (a residual add folded into the projection).
Status matmul(CudaBackend& b, const Tensor& w, const float* x, int64_t n, float* y, const float* bias = nullptr,
              bool accumulate = false);

// Whether w and n take the decode kernel, which can also fold an RMSNorm of x into its input
// (matmul_split's norm_weight).
bool decode_fused(const Tensor& w, int64_t n);
// The fewest rows of x for which w's type takes a tensor-core decode kernel (the rows of x as an
// mma's n side: 2 to 8 rows cost about what one does), 9 where it has none; fewer rows take the
// kernel built for one row. A row's numbers are the same in every call of that many to 8 rows
// that takes the decode kernels (decode_fused: F16/BF16 with f32 x stage n x in in 96 KB, so at
// rows of 8,192 7-8 rows go to cuBLAS; RowsForDecodeKernel lowers the rows; Q4_K needs weights and
// rounded x 16-byte aligned, else the unit loop).
int decode_mma_min_rows(DType t);
// Whether matmul rounds x to 8 bits (per 256, or per 32 where the row is not whole groups of 256)
// for w and n rows: the decode kernel's n <= 8, and the super-block formats' batches up to 64
// rows; otherwise a block-quantized product rounds x and the weights to BF16.
bool rounds_x_to_8_bits(const Tensor& w, int64_t n);

// Rows of x the F16/BF16 decode kernels take at most on this thread (1 to 8, default 8); more go
// to cuBLAS. A runner lowers it for a step that verifies drafts (RowsForDecodeKernel scopes it),
// where cuBLAS measured faster on llama-8b (cuda_runner.cc).
void set_decode_kernel_max_rows(int rows);
int decode_kernel_max_rows();
class RowsForDecodeKernel {
 public:
  explicit RowsForDecodeKernel(int rows) : before_(decode_kernel_max_rows()) { set_decode_kernel_max_rows(rows); }
  ~RowsForDecodeKernel() { set_decode_kernel_max_rows(before_); }
  RowsForDecodeKernel(const RowsForDecodeKernel&) = delete;
  RowsForDecodeKernel& operator=(const RowsForDecodeKernel&) = delete;

 private:
  int before_;
};

// One output of matmul_split: the next `rows` rows of the weight go to y [n, rows] (+ bias).
struct MatmulOut {
  float* y;
  int64_t rows;
  const float* bias = nullptr;
};
// A fused projection: w's rows split among up to three outputs (Q/K/V, or gate/up), one pass
// over the weights for decode-sized n.
// norm_weight (only where decode_fused(w, n)): x is RMS-normalized (eps) with these weights first,
// as add_rms_norm does, inside the same kernel.
Status matmul_split(CudaBackend& b, const Tensor& w, const float* x, int64_t n, std::span<const MatmulOut> outs,
                    const float* norm_weight = nullptr, float eps = 0.0f);

// matmul_split over weights that take the same x, in parts (a projection stacked by runs of one
// dtype: a Q4_K_M layer's Q4_K attn_q/attn_k and Q6_K attn_v): part i's outputs are the next
// outputs[i] of outs. Where every part takes the quantized decode kernel, x is rounded to 8 bits
// (normalized with norm_weight) once for all of them.
Status matmul_split_parts(CudaBackend& b, std::span<const Tensor> parts, std::span<const size_t> outputs,
                          const float* x, int64_t n, std::span<const MatmulOut> outs, const float* norm_weight = nullptr,
                          float eps = 0.0f);

// matmul_split of x [n, in] already in input_dtype(w) (add_rms_norm's y_dtype output), on cuBLAS
// for any n (block types: as matmul).
Status matmul_split_rounded(CudaBackend& b, const Tensor& w, const void* x, int64_t n, std::span<const MatmulOut> outs);

// The MLP's first half for decode (only where decode_fused(w, n)): w [2 ff, in] holds the gate rows,
// then the up rows; h [n, ff] = act(norm(x) gate^T) * (norm(x) up^T) in w's dtype (the down
// projection's input, for matmul_rounded; f32 for block types), one pass over the weights. act:
// silu, or GELU's tanh approximation (gemma's). norm_weight as matmul_split's (null: x as it is).
enum class GateActivation : uint8_t { kSilu, kGeluTanh };
Status matmul_gate_up(CudaBackend& b, const Tensor& w, const float* x, int64_t n, const float* norm_weight,
                      float eps, void* h, GateActivation act = GateActivation::kSilu);

// x rounded to 8 bits, as the decode kernel of block-quantized weights takes it (groups of 256, or
// of 32 where the rows are not whole 256s: src/backend/cuda/quant_matmul.h), made by
// add_normed_rms_norm_q8 and taken by matmul_split_parts_q8 / matmul_gate_up_q8: a norm followed
// by such a projection then needs no rounding kernel between them (the same numbers as the
// projections that round x themselves). takes_q8: whether w takes it for n rows (a block type
// whose kernel for n rows multiplies 8-bit x: decode_fused(w, n), or the int8 tensor-core kernel
// of the super-block formats up to 64 rows); q8_bytes: its size for n rows of dim.
// matmul_gate_up_q8 only where decode_fused(w, n).
bool takes_q8(const Tensor& w, int64_t n);
size_t q8_bytes(int64_t n, int64_t dim);
Status matmul_split_parts_q8(CudaBackend& b, std::span<const Tensor> parts, std::span<const size_t> outputs,
                             const void* xq, int64_t n, std::span<const MatmulOut> outs);
Status matmul_gate_up_q8(CudaBackend& b, const Tensor& w, const void* xq, int64_t n, void* h,
                         GateActivation act = GateActivation::kSilu);

// The dtype x takes for matmul_rounded / matmul_split_rounded / matmul_gate_up's output: w's
// own for F16/BF16, f32 for F32 and the block types.
DType input_dtype(const Tensor& w);

// y (+)= x @ w^T for x [n, in] already in input_dtype(w): matmul_gate_up's output, or
// add_rms_norm's y_dtype output.
Status matmul_rounded(CudaBackend& b, const Tensor& w, const void* x, int64_t n, float* y, bool accumulate = false);

// y = (silu(gate) * up) @ w^T, the MLP's down projection: the product formed first, rounded to w's
// dtype in scratch (16-bit weights), to 8 bits in scratch where w's kernel takes 8-bit x
// (takes_q8), else over gate (f32 and the other block weights).
Status matmul_swiglu(CudaBackend& b, const Tensor& w, float* gate, const float* up, int64_t n, float* y,
                     bool accumulate = false);

// out[i, :] = table[ids[i], :] as f32; table [n_rows, dim] on the device (any weight dtype; block
// rows dequantized exactly as the CPU does).
// Ids outside [0, n_rows) are the caller's to exclude (the runner validates them).
Status embedding(CudaBackend& b, const Tensor& table, const int32_t* ids, int64_t n, float* out);

// Fused residual add and RMSNorm over n rows of dim: if delta, residual += delta; then
// y = residual / rms(residual) * weight.
Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, float* y, int64_t n,
                    int64_t dim, float eps);
// As above, y written in y_dtype (F32, F16 or BF16): rounded as the input of a GEMM with weights of
// that dtype (matmul_split_rounded), so the GEMM needs no rounding pass of its own. (Rows go by
// float4 where dim and every pointer allow it.)
Status add_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* weight, void* y, DType y_dtype,
                    int64_t n, int64_t dim, float eps);
// As above with delta RMS-normalized first and times delta_weight (a post norm, gemma2's and
// gemma3's: the numbers of add_rms_norm(delta, delta_weight) into delta, then add_rms_norm; one
// launch, and delta itself unchanged). delta_weight null: add_rms_norm.
Status add_normed_rms_norm(CudaBackend& b, float* residual, const float* delta, const float* delta_weight,
                           const float* weight, void* y, DType y_dtype, int64_t n, int64_t dim, float eps);
// As above with y rounded to 8 bits into xq (q8_bytes(n, dim); see takes_q8).
Status add_normed_rms_norm_q8(CudaBackend& b, float* residual, const float* delta, const float* delta_weight,
                              const float* weight, void* xq, int64_t n, int64_t dim, float eps);

// The per-head RMSNorm of q and k (qwen3's, gemma3's), in place, in one launch: each of q_rows
// rows of q (dim wide) times q_weight, each of k_rows rows of k times k_weight (a warp a row: a
// row's numbers never depend on the others).
Status heads_rms_norm(CudaBackend& b, float* q, const float* q_weight, int64_t q_rows, float* k, const float* k_weight,
                      int64_t k_rows, int64_t dim, float eps);

// dst[i, :] = src[rows[i], :] for n rows of dim f32 (rows on the device).
Status gather_rows(CudaBackend& b, const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst);

// out[r] = the index of the largest of x[r, 0 .. cols) (the lowest on ties), for `rows` rows.
Status argmax_rows(CudaBackend& b, const float* x, int64_t rows, int64_t cols, int32_t* out);

// Sampling on the device, one row of logits each (the steps of Sampler::sample; see sampler.h):
// the row's parameters, its draw, and where its logit-bias and penalty entries lie in `adjust`.
struct SampleParamsDev {
  float temperature, top_p, min_p, repetition, presence, frequency;
  int32_t top_k;
  int32_t n_bias, bias_at;            // entries (token, value) added in order
  int32_t n_penalized, penalized_at;  // entries (token, count), distinct tokens of the penalty window
  int32_t pad;
  double uniform;  // the draw in [0, 1), from the sequence's generator
};
struct SampleAdjustDev {
  int32_t token;
  union {
    float value;    // logit bias
    int32_t count;  // occurrences in the penalty window
  };
};
// out[r] = the token of row r of logits [rows, n_vocab] (modified in place by bias and penalties),
// sampled as Sampler::sample would — in fixed-point arithmetic, so the same logits and draw give
// the same token on every run; params and adjust on the device.
Status sample_rows(CudaBackend& b, float* logits, int64_t rows, int64_t n_vocab, const SampleParamsDev* params,
                   const SampleAdjustDev* adjust, int32_t* out);

// A mixture of experts' FFN (ModelConfig::n_expert) on n normalized rows h [n, in]: each token's
// k experts by the router's scores (router_logits [n, n_expert], routed as cpu::route_experts),
// each chosen expert's down(silu(gate h) * up h) with h rounded to 8 bits as the decode kernels
// round it (to BF16 in batched steps: below), the token's experts weighted and summed in slot
// order into y [n, in] (+= with accumulate), plus sigmoid(shared_logit[t]) * shared[t] where
// shared is set (qwen2moe's shared expert, computed by the caller). Experts in a block type:
// gate_up [n_expert, 2 ff, in], each expert's gate rows then its up rows; down [n_expert, in, ff].
// gpt-oss: softmax_chosen routes as cpu::route_experts' softmax_chosen; gate_up_bias [n_expert,
// 2 ff] (each expert's gate then up biases) and down_bias [n_expert, in] join the products before
// the activation and the weighting; swiglu_limit > 0 takes the clamped SwiGLU (cpu::swiglu_oai_mul
// with swiglu_alpha and that limit) for silu(gate) * up.
// Tensor parallelism splits the experts over the ranks: gate_up and down (and their biases) hold
// experts [first_expert, first_expert + gate_up's count) of the router's n_expert; every rank
// routes every token alike and adds only its own experts' products (the ranks' y summed after).
struct ExpertsFfn {
  const Tensor* gate_up = nullptr;
  const Tensor* down = nullptr;
  int k = 0;
  bool normalize = false;
  const float* shared = nullptr;        // [n, in]
  const float* shared_logit = nullptr;  // [n]
  bool softmax_chosen = false;
  const float* gate_up_bias = nullptr;
  const float* down_bias = nullptr;
  float swiglu_alpha = 0.0f, swiglu_limit = 0.0f;
  // The router [n_expert, in] and its bias [n_expert]: experts_ffn computes the scores itself (one
  // kernel with the routing for decode-sized steps of an F32 router). Unset: the scores are given.
  const Tensor* router = nullptr;
  const float* router_bias = nullptr;
  int n_expert = 0;      // the experts routed over (0: gate_up's count, all of them here)
  int first_expert = 0;  // gate_up's first
};
// Device scratch for n tokens: ids, weights, order [n k]; start [expert_start_size(n_expert)]
// (each expert's first pair in order, then the count of experts chosen and their ids: the
// products' blocks go to chosen experts only; its last entry a counter the router's kernel uses
// and leaves at zero: zero it once when the scratch is allocated); xq (expert_activation_bytes);
// hidden [n k, ff] (f32: batched steps keep there the BF16 products and, after them, their tile
// list of at most 16 (n k / 64 + n_expert + 2) bytes); out [n k, in].
struct ExpertScratch {
  int32_t* ids;
  float* weights;
  int32_t* order;
  int32_t* start;
  void* xq;
  float* hidden;
  float* out;
};
size_t expert_activation_bytes(int64_t n, int k, int64_t in, int64_t ff);
constexpr int64_t expert_start_size(int64_t n_expert) { return 2 * (n_expert + 1) + 1; }
// Steps whose (token, expert) pairs are at least kExpertMmaPairs per routed expert take tensor
// cores: h and the hidden products rounded to BF16 (not 8 bits), each expert's weights read once
// per 64 of its pairs (hidden then holds the BF16 products and the tiles' list). Measured on the
// H100 (qwen3-30b-a3b's first 2 layers, decode steps of 128 / 256 / 512 sessions, 8 of 128
// experts a token): 0.56x / 1.04x / 1.19x of the decode kernels, prefill 2,048 2.35x. The rule
// counts the experts routed over, not a tensor-parallel rank's: every rank takes the same path.
constexpr int64_t kExpertMmaPairs = 16;
constexpr bool experts_batched(int64_t n, int k, int n_expert) { return n * k >= kExpertMmaPairs * n_expert; }
// router_logits [n, n_expert]: the router's scores, given (f.router unset) or written.
Status experts_ffn(CudaBackend& b, const ExpertsFfn& f, float* router_logits, const float* h,
                   int64_t n, const ExpertScratch& s, float* y, bool accumulate = false);

// gate[i] = silu(gate[i]) * up[i].
Status silu_mul(CudaBackend& b, float* gate, const float* up, int64_t n);
// gate[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (as cpu::gelu_tanh_mul).
Status gelu_tanh_mul(CudaBackend& b, float* gate, const float* up, int64_t n);
// x[i] *= factor.
Status scale(CudaBackend& b, float* x, int64_t n, float factor);
// x[i] = cap * tanh(x[i] / cap) (cap > 0).
Status softcap(CudaBackend& b, float* x, int64_t n, float cap);

}  // namespace combs::cuda
