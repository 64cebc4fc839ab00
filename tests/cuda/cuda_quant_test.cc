// The CUDA kernels of the block-quantized formats (src/backend/cuda/quant_matmul.h) against float64
// references over the weights' exact values (cpu::dequantize_row, itself bit-exact against a NumPy
// reference in quant_test.cc), for every format: blocks llama-quantize made (tests/data/quant), and
// random MXFP4 blocks. Outputs are poisoned (NaN) before each run. [cuda]: skipped without a GPU.
//
// The tolerances, derived:
// - decode (n <= 8), and batches up to 64 rows on the super-block formats (Q2_K-Q6_K, IQ4_XS:
//   cuda::rounds_x_to_8_bits): x is rounded to 8 bits per group of G (256, or 32 where the row is not whole
//   groups of 256): x^ = d q with d = max|x| / 127, q = nearest(x * 127 / max). The kernel's sums of
//   level * q products are exact integers; what remains is float32 arithmetic over a few hundred
//   terms (the batches' integer sums are exact too, scaled once a block). So against the float64 product with x^ (rounded here as the kernel rounds it):
//   |y - ref(x^)| <= 1e-5 * sum |w x^|; and against the unrounded x, since |x - x^| <= d / 2:
//   |y - ref(x)| <= sum_i |w_i| d_g(i) / 2 (* 1.001) + 1e-5 * sum |w x|.
// - other larger n: weights and x rounded to BF16 (relative 2^-9 each), cuBLAS with f32 accumulation: against
//   the float64 product of the BF16 values, |y - ref| <= 1e-5 * sum |w x|; against the exact values
//   |y - ref| <= (2^-8 + 2^-17) * sum |w x| + 1e-5 * sum |w x|.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "combs/backend/cpu/cpu_ops.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "combs/backend/quant.h"
#include "combs/model/model.h"
#include "support/cuda_helpers.h"

using namespace combs;
using combs::testing::download;
using combs::testing::gpu_or_skip;
using combs::testing::upload;

namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Blocks of format f: llama-quantize's (tests/data/quant), or for MXFP4 random ones (exponents
// near 1, random nibbles).
std::vector<uint8_t> source_blocks(const QuantFormat& f) {
  if (f.dtype == DType::kMXFP4) {
    std::mt19937 rng(5);
    std::vector<uint8_t> b(static_cast<size_t>(64) * f.block_bytes);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i % 17 == 0 ? 120 + rng() % 10 : rng());
    return b;
  }
  std::vector<uint8_t> b = read_bytes(std::string(COMBS_TEST_DATA_DIR) + "/quant/" + std::string(f.name) + ".bin");
  REQUIRE(b.size() >= static_cast<size_t>(f.block_bytes));
  return b;
}

// A weight matrix [out, in] of format f made of the source blocks in turn.
std::vector<uint8_t> weight_bytes(const QuantFormat& f, int64_t out, int64_t in) {
  const std::vector<uint8_t> src = source_blocks(f);
  const size_t n_src = src.size() / f.block_bytes, blocks = static_cast<size_t>(out * in / f.block_elems);
  std::vector<uint8_t> w(blocks * f.block_bytes);
  for (size_t i = 0; i < blocks; ++i) std::memcpy(&w[i * f.block_bytes], &src[((i * 7) % n_src) * f.block_bytes], f.block_bytes);
  return w;
}

Tensor upload_bytes(CudaBackend& b, const std::vector<uint8_t>& bytes, Shape shape, DType dt) {
  Tensor t = b.alloc(shape, dt).value();
  REQUIRE(b.copy(Tensor::wrap(const_cast<uint8_t*>(bytes.data()), shape, dt), t).ok());
  return t;
}

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// E experts' random matrices [E, rows, cols] in Q8_0 on the device.
Tensor random_q8_0_experts(CudaBackend& gpu, std::mt19937& rng, int E, int64_t rows, int64_t cols) {
  const auto v = random_floats(rng, static_cast<size_t>(E * rows * cols), 0.1f);
  std::vector<uint8_t> bytes(nbytes_for(DType::kQ8_0, static_cast<int64_t>(v.size())));
  cpu::quantize_row(v.data(), DType::kQ8_0, bytes.data(), static_cast<int64_t>(v.size()));
  return upload_bytes(gpu, bytes, Shape{E, rows, cols}, DType::kQ8_0);
}

// experts_ffn's scratch for n tokens (the router's counter zeroed); its tensors appended to *keep
// (reserved: they must not move).
cuda::ExpertScratch expert_scratch(CudaBackend& gpu, int64_t n, int k, int E, int64_t in, int64_t ff,
                                   std::vector<Tensor>* keep) {
  auto scratch = [&](int64_t count) { keep->push_back(gpu.alloc(Shape{count}, DType::kF32).value()); };
  const size_t at = keep->size();
  for (int64_t count : {n * k, n * k, n * k, cuda::expert_start_size(E)}) scratch(count);
  REQUIRE(gpu.zero(keep->back()).ok());
  scratch(static_cast<int64_t>(cuda::expert_activation_bytes(n, k, in, ff) + 3) / 4);
  scratch(n * k * ff);
  scratch(n * k * in);
  const Tensor* t = keep->data() + at;
  return cuda::ExpertScratch{t[0].data_as<int32_t>(), t[1].data_as<float>(), t[2].data_as<int32_t>(),
                             t[3].data_as<int32_t>(), t[4].data(),          t[5].data_as<float>(),
                             t[6].data_as<float>()};
}

// x rounded as the decode kernel rounds it, and each element's half step d / 2.
void round_8bit(const std::vector<float>& x, int64_t in, std::vector<float>* xr, std::vector<double>* half_step) {
  const int64_t g = in % 256 == 0 ? 256 : 32;
  xr->resize(x.size());
  half_step->resize(x.size());
  for (size_t c = 0; c < x.size(); c += g) {
    float amax = 0.0f;
    for (int64_t i = 0; i < g; ++i) amax = std::max(amax, std::fabs(x[c + i]));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < g; ++i) {
      const int q = std::clamp(static_cast<int>(std::nearbyint(x[c + i] * inv)), -127, 127);
      (*xr)[c + i] = d * static_cast<float>(q);
      (*half_step)[c + i] = d / 2.0;
    }
  }
}

float to_bf16_and_back(float v) {
  const uint16_t h = f32_to_bf16(v);
  return bf16_to_f32(h);
}

// The values a block-quantized matmul of w with n rows of x multiplies (cuda::rounds_x_to_8_bits):
// x rounded to 8 bits as the kernels round it (half_step: each element's d / 2) and the exact
// weights, or x and the weights rounded to BF16 (half steps 0).
struct Multiplied {
  bool eight_bit;
  std::vector<float> x;
  std::vector<double> half_step;
  float weight(float v) const { return eight_bit ? v : to_bf16_and_back(v); }
};
Multiplied as_multiplied(const Tensor& w, int64_t n, const std::vector<float>& x, int64_t in) {
  Multiplied m{cuda::rounds_x_to_8_bits(w, n), {}, std::vector<double>(x.size(), 0.0)};
  if (m.eight_bit) {
    round_8bit(x, in, &m.x, &m.half_step);
  } else {
    m.x = x;
    for (auto& v : m.x) v = to_bf16_and_back(v);
  }
  return m;
}
}  // namespace

TEST_CASE("cuda block-quantized matmul of every format against float64 with derived tolerances", "[cuda][quant]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(3);
  for (const QuantFormat& f : quant_formats()) {
    for (const int64_t in : {int64_t{512}, int64_t{96}, int64_t{288}}) {
      if (in % f.block_elems != 0) continue;
      const int64_t out = 70;
      const std::vector<uint8_t> wb = weight_bytes(f, out, in);
      std::vector<float> w(static_cast<size_t>(out * in));
      cpu::dequantize_row(wb.data(), f.dtype, w.data(), out * in);
      const Tensor wd = upload_bytes(*gpu, wb, Shape{out, in}, f.dtype);
      // 1-8: decode; 9-64: the int8 tensor-core kernel (super-block formats), 9-32 (and up to 64
      // for rows of 4,096): the BF16 tensor-core kernel (the others); the rest: BF16 tiles and cuBLAS.
      for (const int64_t n : {1, 3, 8, 9, 17, 40, 64, 65}) {
        INFO(f.name << " in " << in << " n " << n);
        const auto x = random_floats(rng, static_cast<size_t>(n * in));
        const auto bias = random_floats(rng, static_cast<size_t>(out));
        const Tensor xd = upload(*gpu, x, Shape{n, in}), bd = upload(*gpu, bias, Shape{out});
        const Tensor yd = upload(*gpu, std::vector<float>(static_cast<size_t>(n * out), std::nanf("")), Shape{n, out});
        REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, yd.data_as<float>(), bd.data_as<float>()).ok());
        const std::vector<float> y = download(*gpu, yd);
        // The values the kernel multiplies: x rounded to 8 bits, or both rounded to BF16.
        const Multiplied m = as_multiplied(wd, n, x, in);
        const bool decode = m.eight_bit;
        const std::vector<float>& xk = m.x;
        const std::vector<double>& half_step = m.half_step;
        std::vector<float> wk = w;
        for (auto& v : wk) v = m.weight(v);
        double worst_tight = 0, worst_loose = 0;
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t o = 0; o < out; ++o) {
            double ref_k = bias[o], ref = bias[o], mag_k = 0, mag = 0, step = 0;
            for (int64_t i = 0; i < in; ++i) {
              const double wi = w[o * in + i], xi = x[t * in + i];
              ref_k += double(wk[o * in + i]) * xk[t * in + i];
              mag_k += std::abs(double(wk[o * in + i]) * xk[t * in + i]);
              ref += wi * xi;
              mag += std::abs(wi * xi);
              step += std::abs(wi) * half_step[t * in + i];
            }
            const double got = y[t * out + o];
            REQUIRE(std::isfinite(got));
            const double tight = 1e-5 * mag_k + 1e-6;
            const double loose = (decode ? step * 1.001 : mag * (std::ldexp(1.0, -8) + std::ldexp(1.0, -17))) + 1e-5 * mag + 1e-6;
            worst_tight = std::max(worst_tight, std::abs(got - ref_k) / tight);
            worst_loose = std::max(worst_loose, std::abs(got - ref) / loose);
          }
        }
        INFO("error / tight bound " << worst_tight << ", error / derived tolerance " << worst_loose);
        CHECK(worst_tight <= 1.0);
        CHECK(worst_loose <= 1.0);
      }
    }
  }
}

TEST_CASE("cuda block-quantized embedding equals the cpu's values and fused projections follow float64", "[cuda][quant]") {
  // A decode step's one row of x and a few.
  const int64_t n = GENERATE(as<int64_t>{}, 1, 3, 5, 8);  // (Q4_K from 4 rows: its tensor-core kernel)
  INFO("n " << n);
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(9);
  SECTION("embedding rows of every format, bit for bit") {
    for (const QuantFormat& f : quant_formats()) {
      INFO(f.name);
      const int64_t vocab = 40, dim = 256;
      const std::vector<uint8_t> tb = weight_bytes(f, vocab, dim);
      std::vector<int32_t> ids = {0, 39, 7, 7, 21};
      std::vector<float> want(ids.size() * dim);
      cpu::embedding(Tensor::wrap(const_cast<uint8_t*>(tb.data()), Shape{vocab, dim}, f.dtype), ids.data(),
                     static_cast<int64_t>(ids.size()), want.data());
      const Tensor td = upload_bytes(*gpu, tb, Shape{vocab, dim}, f.dtype);
      Tensor idd = gpu->alloc(Shape{static_cast<int64_t>(ids.size())}, DType::kF32).value();
      REQUIRE(gpu->copy(Tensor::wrap(ids.data(), idd.shape(), DType::kF32), idd).ok());
      const Tensor od = upload(*gpu, std::vector<float>(want.size(), std::nanf("")), Shape{static_cast<int64_t>(want.size())});
      REQUIRE(cuda::embedding(*gpu, td, idd.data_as<int32_t>(), static_cast<int64_t>(ids.size()), od.data_as<float>()).ok());
      const std::vector<float> got = download(*gpu, od);
      CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
    }
  }
  SECTION("q/k/v outputs with the norm folded in, the residual accumulated, and gate/up pairs") {
    for (DType dt : {DType::kQ4_K, DType::kQ6_K, DType::kQ8_0}) {
      const QuantFormat& f = *quant_format(dt);
      INFO(f.name);
      const int64_t in = 512, rows[3] = {64, 32, 32}, out = 128;
      const std::vector<uint8_t> wb = weight_bytes(f, out, in);
      std::vector<float> w(static_cast<size_t>(out * in));
      cpu::dequantize_row(wb.data(), dt, w.data(), out * in);
      const Tensor wd = upload_bytes(*gpu, wb, Shape{out, in}, dt);
      const auto x = random_floats(rng, n * in), nw = random_floats(rng, in), y0 = random_floats(rng, n * out);
      std::vector<float> xn(x.size());
      cpu::rms_norm(x.data(), nw.data(), xn.data(), n, in, 1e-5f);
      std::vector<float> xr;
      std::vector<double> half_step;
      round_8bit(xn, in, &xr, &half_step);
      // The reference product of row o with token t, and its derived tolerance (the norm's scale
      // may differ from the CPU's in its last bit, moving a rounding: the loose bound).
      auto ref = [&](int64_t o, int64_t t, double* tol) {
        double s = 0, mag = 0, step = 0;
        for (int64_t i = 0; i < in; ++i) {
          s += double(w[o * in + i]) * xn[t * in + i];
          mag += std::abs(double(w[o * in + i]) * xn[t * in + i]);
          step += std::abs(double(w[o * in + i])) * half_step[t * in + i];
        }
        *tol = step * 1.001 + 2e-5 * mag + 1e-6;
        return s;
      };
      const Tensor xd = upload(*gpu, x, Shape{n, in}), nwd = upload(*gpu, nw, Shape{in});
      std::vector<Tensor> yd;
      for (int p = 0; p < 3; ++p) {
        yd.push_back(upload(*gpu, std::vector<float>(static_cast<size_t>(n * rows[p]), std::nanf("")), Shape{n, rows[p]}));
      }
      const cuda::MatmulOut outs[] = {{yd[0].data_as<float>(), rows[0]}, {yd[1].data_as<float>(), rows[1]},
                                      {yd[2].data_as<float>(), rows[2]}};
      REQUIRE(cuda::decode_fused(wd, n));
      REQUIRE(cuda::matmul_split(*gpu, wd, xd.data_as<float>(), n, outs, nwd.data_as<float>(), 1e-5f).ok());
      int64_t row0 = 0;
      for (int p = 0; p < 3; ++p) {
        const std::vector<float> got = download(*gpu, yd[p]);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t o = 0; o < rows[p]; ++o) {
            double tol;
            const double want = ref(row0 + o, t, &tol);
            INFO("part " << p << " token " << t << " row " << o);
            REQUIRE(std::abs(got[t * rows[p] + o] - want) <= tol);
          }
        }
        row0 += rows[p];
      }
      // The residual stream: y (+)= W norm(x)... here y0 + W xn by accumulate, x already normalized.
      const Tensor xnd = upload(*gpu, xn, Shape{n, in}), acc = upload(*gpu, y0, Shape{n, out});
      REQUIRE(cuda::matmul(*gpu, wd, xnd.data_as<float>(), n, acc.data_as<float>(), nullptr, /*accumulate=*/true).ok());
      const std::vector<float> got = download(*gpu, acc);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < out; ++o) {
          double tol;
          const double want = y0[t * out + o] + ref(o, t, &tol);
          REQUIRE(std::abs(got[t * out + o] - want) <= tol + 1e-6 * std::abs(want));
        }
      }
      // Gate rows 0..63, up rows 64..127: h = silu(gate) * up, f32.
      const Tensor h = upload(*gpu, std::vector<float>(static_cast<size_t>(n * out / 2), std::nanf("")), Shape{n, out / 2});
      REQUIRE(cuda::matmul_gate_up(*gpu, wd, xd.data_as<float>(), n, nwd.data_as<float>(), 1e-5f, h.data()).ok());
      const std::vector<float> hg = download(*gpu, h);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < out / 2; ++o) {
          double tg, tu;
          const double g = ref(o, t, &tg), u = ref(o + out / 2, t, &tu);
          const double silu = g / (1 + std::exp(-g));
          // d(silu(g) u) <= |u| |silu'(g)| tg + |silu(g)| tu + tg tu, with |silu'| <= 1.1.
          const double tol = std::abs(u) * 1.1 * tg + std::abs(silu) * tu + tg * tu + 1e-5;
          INFO("token " << t << " unit " << o);
          REQUIRE(std::abs(hg[t * (out / 2) + o] - silu * u) <= tol);
        }
      }
      // gemma's pair: GELU (tanh) of the gate; |gelu'| <= 1.13.
      REQUIRE(cuda::matmul_gate_up(*gpu, wd, xd.data_as<float>(), n, nwd.data_as<float>(), 1e-5f, h.data(),
                                   cuda::GateActivation::kGeluTanh)
                  .ok());
      const std::vector<float> hgelu = download(*gpu, h);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < out / 2; ++o) {
          double tg, tu;
          const double g = ref(o, t, &tg), u = ref(o + out / 2, t, &tu);
          const double gelu = 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
          const double tol = std::abs(u) * 1.13 * tg + std::abs(gelu) * tu + tg * tu + 1e-5;
          INFO("gelu: token " << t << " unit " << o);
          REQUIRE(std::abs(hgelu[t * (out / 2) + o] - gelu * u) <= tol);
        }
      }
    }
  }
}

TEST_CASE("cuda batches of 9 to 64 rows of x: split outputs with biases and the residual accumulated, every format",
          "[cuda][quant]") {
  // The tensor-core kernels' epilogue: rows of three outputs (a Q/K/V stack) not whole 64-row
  // tiles, each output with its bias; and y += W x. The products: 8-bit x and the exact weights
  // (super-block formats), or BF16 weights and x; f32 sums.
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(29);
  for (const QuantFormat& f : quant_formats()) {
    const int64_t in = 4096, rows[3] = {70, 33, 27}, out = 130;  // (rows of 4,096: the tensor-core kernel up to 64 rows of x)
    const std::vector<uint8_t> wb = weight_bytes(f, out, in);
    std::vector<float> w(static_cast<size_t>(out * in));
    cpu::dequantize_row(wb.data(), f.dtype, w.data(), out * in);
    const Tensor wd = upload_bytes(*gpu, wb, Shape{out, in}, f.dtype);
    for (const int64_t n : {int64_t{12}, int64_t{33}, int64_t{64}}) {
      INFO(f.name << " n " << n);
      const auto x = random_floats(rng, static_cast<size_t>(n * in)), bias = random_floats(rng, out),
                 y0 = random_floats(rng, static_cast<size_t>(n * out));
      const Multiplied m = as_multiplied(wd, n, x, in);
      const std::vector<float>& xk = m.x;
      std::vector<float> wk = w;
      for (auto& v : wk) v = m.weight(v);
      auto ref = [&](int64_t o, int64_t t, double* tol) {
        double s = 0, mag = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double p = double(wk[o * in + i]) * xk[t * in + i];
          s += p, mag += std::abs(p);
        }
        *tol = 1e-5 * mag + 1e-6;
        return s;
      };
      const Tensor xd = upload(*gpu, x, Shape{n, in}), bd = upload(*gpu, bias, Shape{out});
      std::vector<Tensor> yd;
      for (int p = 0; p < 3; ++p) {
        yd.push_back(upload(*gpu, std::vector<float>(static_cast<size_t>(n * rows[p]), std::nanf("")), Shape{n, rows[p]}));
      }
      const cuda::MatmulOut outs[] = {{yd[0].data_as<float>(), rows[0], bd.data_as<float>()},
                                      {yd[1].data_as<float>(), rows[1], bd.data_as<float>() + rows[0]},
                                      {yd[2].data_as<float>(), rows[2], bd.data_as<float>() + rows[0] + rows[1]}};
      REQUIRE(cuda::matmul_split(*gpu, wd, xd.data_as<float>(), n, outs).ok());
      int64_t row0 = 0;
      for (int p = 0; p < 3; ++p) {
        const std::vector<float> got = download(*gpu, yd[p]);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t o = 0; o < rows[p]; ++o) {
            double tol;
            const double want = bias[row0 + o] + ref(row0 + o, t, &tol);
            INFO("part " << p << " token " << t << " row " << o);
            REQUIRE(std::abs(got[t * rows[p] + o] - want) <= tol + 1e-6 * std::abs(want));
          }
        }
        row0 += rows[p];
      }
      const Tensor acc = upload(*gpu, y0, Shape{n, out});
      REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, acc.data_as<float>(), nullptr, /*accumulate=*/true).ok());
      const std::vector<float> got = download(*gpu, acc);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < out; ++o) {
          double tol;
          const double want = y0[t * out + o] + ref(o, t, &tol);
          INFO("accumulated token " << t << " row " << o);
          REQUIRE(std::abs(got[t * out + o] - want) <= tol + 1e-6 * std::abs(want));
        }
      }
    }
  }
}

TEST_CASE("cuda batch products of few and many row tiles in turn write every output", "[cuda][quant]") {
  // Every batch product shares one split scratch: llama-8b's O (64 row tiles, cut along k) at 64
  // rows of x, then its gate/up (448 tiles), then O again, for the int8 kernel (Q4_K) and the BF16
  // one (Q4_0). Outputs poisoned; every one finite, sampled rows against float64 (the tight bound).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(31);
  const int64_t in = 4096, n = 64;
  for (const DType dt : {DType::kQ4_K, DType::kQ4_0}) {
    const QuantFormat& f = *quant_format(dt);
    const auto x = random_floats(rng, static_cast<size_t>(n * in));
    const Tensor xd = upload(*gpu, x, Shape{n, in});
    for (const int64_t out : {int64_t{4096}, int64_t{28672}, int64_t{4096}}) {
      INFO(f.name << " rows " << out);
      const std::vector<uint8_t> wb = weight_bytes(f, out, in);
      const Tensor wd = upload_bytes(*gpu, wb, Shape{out, in}, dt);
      const Tensor yd = upload(*gpu, std::vector<float>(static_cast<size_t>(n * out), std::nanf("")), Shape{n, out});
      REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, yd.data_as<float>()).ok());
      const std::vector<float> y = download(*gpu, yd);
      for (float v : y) REQUIRE(std::isfinite(v));
      const Multiplied m = as_multiplied(wd, n, x, in);
      const size_t row_bytes = nbytes_for(dt, in);
      for (int64_t o : {int64_t{0}, int64_t{63}, int64_t{64}, out - 1, static_cast<int64_t>(rng() % out)}) {
        std::vector<float> w(static_cast<size_t>(in));
        cpu::dequantize_row(wb.data() + o * row_bytes, dt, w.data(), in);
        for (int64_t t = 0; t < n; t += 7) {
          double ref = 0, mag = 0;
          for (int64_t i = 0; i < in; ++i) {
            const double p = double(m.weight(w[i])) * m.x[t * in + i];
            ref += p, mag += std::abs(p);
          }
          INFO("row " << o << " token " << t);
          REQUIRE(std::abs(y[t * out + o] - ref) <= 1e-5 * mag + 1e-6);
        }
      }
    }
  }
}

TEST_CASE("cuda projections stacked in parts of two formats round x once and equal the parts run alone", "[cuda][quant]") {
  // A Q4_K_M layer's Q/K (Q4_K) and V (Q6_K): matmul_split_parts rounds x to 8 bits once for both;
  // the outputs are bit for bit those of each part on its own (the same rounding, the same kernel).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(21);
  const int64_t in = 512, n = 2;
  const std::vector<uint8_t> qk = weight_bytes(*quant_format(DType::kQ4_K), 96, in);
  const std::vector<uint8_t> v = weight_bytes(*quant_format(DType::kQ6_K), 32, in);
  const Tensor parts[] = {upload_bytes(*gpu, qk, Shape{96, in}, DType::kQ4_K), upload_bytes(*gpu, v, Shape{32, in}, DType::kQ6_K)};
  const size_t outputs[] = {2, 1};
  const auto x = random_floats(rng, n * in), nw = random_floats(rng, in);
  const Tensor xd = upload(*gpu, x, Shape{n, in}), nwd = upload(*gpu, nw, Shape{in});
  auto fresh = [&](int64_t rows) { return upload(*gpu, std::vector<float>(static_cast<size_t>(n * rows), std::nanf("")), Shape{n, rows}); };
  const Tensor q1 = fresh(64), k1 = fresh(32), v1 = fresh(32), q2 = fresh(64), k2 = fresh(32), v2 = fresh(32);
  const cuda::MatmulOut together[] = {{q1.data_as<float>(), 64}, {k1.data_as<float>(), 32}, {v1.data_as<float>(), 32}};
  REQUIRE(cuda::matmul_split_parts(*gpu, parts, outputs, xd.data_as<float>(), n, together, nwd.data_as<float>(), 1e-5f).ok());
  const cuda::MatmulOut qk_alone[] = {{q2.data_as<float>(), 64}, {k2.data_as<float>(), 32}};
  const cuda::MatmulOut v_alone[] = {{v2.data_as<float>(), 32}};
  REQUIRE(cuda::matmul_split(*gpu, parts[0], xd.data_as<float>(), n, qk_alone, nwd.data_as<float>(), 1e-5f).ok());
  REQUIRE(cuda::matmul_split(*gpu, parts[1], xd.data_as<float>(), n, v_alone, nwd.data_as<float>(), 1e-5f).ok());
  for (const auto& [a, b] : {std::pair{&q1, &q2}, std::pair{&k1, &k2}, std::pair{&v1, &v2}}) {
    const std::vector<float> ga = download(*gpu, *a), gb = download(*gpu, *b);
    for (float f : ga) REQUIRE(std::isfinite(f));
    CHECK(std::memcmp(ga.data(), gb.data(), ga.size() * 4) == 0);
  }
  const size_t wrong[] = {2, 2};  // more outputs than given
  CHECK(cuda::matmul_split_parts(*gpu, parts, wrong, xd.data_as<float>(), n, together, nwd.data_as<float>(), 1e-5f).code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("cuda block-quantized projections at a real model's shapes follow float64 on sampled rows", "[cuda][quant]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(13);
  // llama-1b's logits (128,256 x 2,048), its down projection (2,048 x 8,192) and its gate/up pair
  // (2 x 8,192 x 2,048): many blocks of rows, several BF16 tiles, rows not 16-byte aligned (Q6_K);
  // and a gate/up pair of rows of 4,096 whose count is not whole tiles of 16.
  struct Case {
    DType dt;
    int64_t out, in;
    bool pairs;
  };
  for (const Case& c : {Case{DType::kQ6_K, 128256, 2048, false}, Case{DType::kQ4_K, 2048, 8192, false},
                        Case{DType::kQ4_K, 2 * 8192, 2048, true}, Case{DType::kQ6_K, 2048, 8192, false},
                        Case{DType::kQ4_K, 2 * 1000, 4096, true}}) {
    const QuantFormat& f = *quant_format(c.dt);
    const std::vector<uint8_t> wb = weight_bytes(f, c.out, c.in);
    const Tensor wd = upload_bytes(*gpu, wb, Shape{c.out, c.in}, c.dt);
    const size_t row_bytes = nbytes_for(c.dt, c.in);
    auto row = [&](int64_t o) {
      std::vector<float> r(static_cast<size_t>(c.in));
      cpu::dequantize_row(wb.data() + o * row_bytes, c.dt, r.data(), c.in);
      return r;
    };
    for (const int64_t n : {int64_t{1}, int64_t{8}, int64_t{40}, int64_t{64}, int64_t{100}}) {
      if (c.pairs && n > 8) continue;
      INFO(f.name << " [" << c.out << ", " << c.in << "] n " << n << (c.pairs ? " gate/up" : ""));
      const auto x = random_floats(rng, static_cast<size_t>(n * c.in));
      const Tensor xd = upload(*gpu, x, Shape{n, c.in});
      const int64_t out_cols = c.pairs ? c.out / 2 : c.out;
      const Tensor yd = upload(*gpu, std::vector<float>(static_cast<size_t>(n * out_cols), std::nanf("")), Shape{n, out_cols});
      if (c.pairs) {
        REQUIRE(cuda::matmul_gate_up(*gpu, wd, xd.data_as<float>(), n, nullptr, 0.0f, yd.data()).ok());
      } else {
        REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, yd.data_as<float>()).ok());
      }
      const std::vector<float> y = download(*gpu, yd);
      for (float v : y) REQUIRE(std::isfinite(v));
      const Multiplied m = as_multiplied(wd, n, x, c.in);
      const std::vector<float>& xk = m.x;
      // The tight bound of the first test case: against x as the kernel rounds it.
      auto dot = [&](const std::vector<float>& w, int64_t t, double* tol) {
        double s = 0, mag = 0;
        for (int64_t i = 0; i < c.in; ++i) {
          const double wi = m.weight(w[i]);
          s += wi * xk[t * c.in + i];
          mag += std::abs(wi * xk[t * c.in + i]);
        }
        *tol = 1e-5 * mag + 1e-6;
        return s;
      };
      for (int64_t o : {int64_t{0}, out_cols / 3, out_cols - 1, static_cast<int64_t>(rng() % out_cols)}) {
        const std::vector<float> w = row(o);
        const std::vector<float> wu = c.pairs ? row(o + c.out / 2) : std::vector<float>();
        for (int64_t t = 0; t < n; ++t) {
          double tol, tu;
          const double g = dot(w, t, &tol);
          double want = g;
          if (c.pairs) {
            const double u = dot(wu, t, &tu);
            want = g / (1 + std::exp(-g)) * u;
            tol = std::abs(u) * 1.1 * tol + std::abs(g) * tu + 1e-5;
          }
          INFO("row " << o << " token " << t);
          REQUIRE(std::abs(y[t * out_cols + o] - want) <= tol);
        }
      }
    }
  }
}

TEST_CASE("cuda experts route as the cpu does and follow float64 through each chosen expert",
          "[cuda][quant]") {
  // experts_ffn on its own, so that no rounding upstream can move a token to another expert: the
  // router's logits are given (with ties among them), the routing (ids and weights) is the CPU's
  // cpu::route_experts, and y is the float64 sum over each token's experts of
  // w_j down(round8(silu(gate x^) up x^)) with x^ rounded as the kernels round it (gpt-oss's
  // cases: w_j from the softmax of the chosen, biases on every product, its clamped SwiGLU). The kernel's
  // hidden values equal the float64 ones to float32 arithmetic, so their 8-bit rounding can differ
  // only where a value sits on a rounding boundary: a step d of that group, at most a couple of
  // times a row. Tolerance: 1e-4 of the absolute sum, plus two steps of the largest |w_down|, per
  // expert, weighted. A wrong expert, weight, row or slot is off by about the value itself.
  // Batched steps (cuda::experts_batched: tensor cores) round x and the hidden values to
  // BF16 instead, and widen the weights to BF16: the reference takes the BF16 weights, and a
  // hidden value's step is its BF16 ulp. n 150: experts with more pairs than a tile (64).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(17);
  struct Case {
    DType type;
    int64_t in, ff;
    int n_expert, k;
    bool normalize, shared, accumulate;
    bool oss = false;  // gpt-oss: softmax over the chosen, biases, the clamped SwiGLU
  };
  for (const Case c : {Case{DType::kQ8_0, 256, 96, 16, 4, true, false, false},
                       Case{DType::kQ4_K, 256, 256, 8, 2, false, true, true},
                       Case{DType::kQ8_0, 64, 64, 4, 4, true, true, false},
                       Case{DType::kQ6_K, 256, 256, 32, 8, true, false, true},
                       Case{DType::kMXFP4, 96, 160, 32, 4, false, false, false, true},
                       Case{DType::kQ8_0, 256, 64, 8, 8, false, false, true, true},
                       Case{DType::kQ4_K, 2048, 256, 8, 2, true, false, false},     // rows > 1024: a warp a row
                       Case{DType::kQ4_K, 1024, 768, 16, 4, true, false, true}}) {  // (down: 768, 8 lanes a row)
    for (const int64_t n : {int64_t{1}, int64_t{5}, int64_t{40}, int64_t{150}}) {
      const int E = c.n_expert, k = c.k;
      const bool batched = cuda::experts_batched(n, k, E);
      const int64_t in = c.in, ff = c.ff;
      INFO(dtype_name(c.type) << " experts " << E << " k " << k << " in " << in << " ff " << ff
                              << " n " << n << (c.oss ? " gpt-oss" : "") << (batched ? " batched" : ""));
      // Weights: random values in the block type; their exact values back on the host.
      auto quantized = [&](int64_t rows, int64_t cols, std::vector<float>* exact) {
        const auto v = random_floats(rng, static_cast<size_t>(E * rows * cols), 0.1f);
        std::vector<uint8_t> bytes(nbytes_for(c.type, static_cast<int64_t>(v.size())));
        cpu::quantize_row(v.data(), c.type, bytes.data(), static_cast<int64_t>(v.size()));
        exact->resize(v.size());
        cpu::dequantize_row(bytes.data(), c.type, exact->data(), static_cast<int64_t>(v.size()));
        return upload_bytes(*gpu, bytes, Shape{E, rows, cols}, c.type);
      };
      std::vector<float> gu, dn;
      const Tensor gud = quantized(2 * ff, in, &gu), dnd = quantized(in, ff, &dn);
      // gpt-oss's biases (each expert's gate then up, as its rows; down), large enough that the
      // SwiGLU's clamps at +-7 bite.
      const auto gu_bias = random_floats(rng, static_cast<size_t>(E * 2 * ff), 8.0f),
                 dn_bias = random_floats(rng, static_cast<size_t>(E * in));
      const Tensor gubd = upload(*gpu, gu_bias, Shape{E, 2 * ff}), dnbd = upload(*gpu, dn_bias, Shape{E, in});
      // Router logits on a coarse grid (ties happen), inputs, the shared expert's output and gate.
      std::vector<float> logits(static_cast<size_t>(n * E));
      for (auto& z : logits) z = static_cast<float>(static_cast<int>(rng() % 9)) * 0.5f - 2.0f;
      const auto h = random_floats(rng, static_cast<size_t>(n * in));
      const auto shared = random_floats(rng, static_cast<size_t>(n * in)),
                 shared_logit = random_floats(rng, static_cast<size_t>(n));
      const auto y0 = random_floats(rng, static_cast<size_t>(n * in));
      std::vector<int32_t> ids(static_cast<size_t>(n * k));
      std::vector<float> weights(ids.size());
      cpu::route_experts(logits.data(), n, E, k, c.normalize, ids.data(), weights.data(), c.oss);

      const Tensor ld = upload(*gpu, logits, Shape{n, E}), hd = upload(*gpu, h, Shape{n, in});
      const Tensor sd = upload(*gpu, shared, Shape{n, in}),
                   sld = upload(*gpu, shared_logit, Shape{n});
      const Tensor yd = upload(
          *gpu, c.accumulate ? y0 : std::vector<float>(y0.size(), std::nanf("")), Shape{n, in});
      auto scratch = [&](int64_t count) { return gpu->alloc(Shape{count}, DType::kF32).value(); };
      const Tensor t_ids = scratch(n * k), t_w = scratch(n * k), t_order = scratch(n * k),
                   t_start = scratch(cuda::expert_start_size(E));
      const Tensor t_xq =
          scratch(static_cast<int64_t>(cuda::expert_activation_bytes(n, k, in, ff) + 3) / 4);
      const Tensor t_hidden = scratch(n * k * ff), t_out = scratch(n * k * in);
      const cuda::ExpertScratch s{
          t_ids.data_as<int32_t>(),   t_w.data_as<float>(), t_order.data_as<int32_t>(),
          t_start.data_as<int32_t>(), t_xq.data(),          t_hidden.data_as<float>(),
          t_out.data_as<float>()};
      cuda::ExpertsFfn f{.gate_up = &gud, .down = &dnd, .k = k, .normalize = c.normalize};
      if (c.shared) f.shared = sd.data_as<float>(), f.shared_logit = sld.data_as<float>();
      if (c.oss) {
        f.softmax_chosen = true;
        f.gate_up_bias = gubd.data_as<float>(), f.down_bias = dnbd.data_as<float>();
        f.swiglu_alpha = kSwigluOaiAlpha, f.swiglu_limit = kSwigluOaiLimit;
      }
      REQUIRE(cuda::experts_ffn(*gpu, f, ld.data_as<float>(), hd.data_as<float>(), n, s,
                                yd.data_as<float>(), c.accumulate)
                  .ok());
      const std::vector<float> y = download(*gpu, yd);
      std::vector<int32_t> got_ids(ids.size());
      REQUIRE(gpu->copy(t_ids, Tensor::wrap(got_ids.data(), t_ids.shape(), DType::kF32)).ok());
      const std::vector<float> got_w = download(*gpu, t_w);

      // The routing: the CPU's experts in the CPU's slot order, the same weights to the ulps of
      // --use_fast_math's expf and division.
      CHECK(got_ids == ids);
      for (size_t i = 0; i < weights.size(); ++i)
        CHECK(std::abs(got_w[i] - weights[i]) <= 2e-6 * weights[i] + 1e-9);

      // The rounding of x, and of the hidden values (half_step: half a rounding step, per value
      // or per group), by the path this step takes.
      auto round_x = [&](const std::vector<float>& v, int64_t cols, std::vector<float>* r, std::vector<double>* half_step) {
        if (!batched) return round_8bit(v, cols, r, half_step);
        r->resize(v.size());
        half_step->resize(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
          (*r)[i] = to_bf16_and_back(v[i]);
          (*half_step)[i] = std::ldexp(std::abs(double(v[i])), -8);
        }
      };
      if (batched) {
        for (auto& v : gu) v = to_bf16_and_back(v);
        for (auto& v : dn) v = to_bf16_and_back(v);
      }
      std::vector<float> xr;
      std::vector<double> half_step;
      round_x(h, in, &xr, &half_step);
      double worst = 0;
      for (int64_t t = 0; t < n; ++t) {
        std::vector<double> want(static_cast<size_t>(in), 0.0), tol(static_cast<size_t>(in), 1e-6);
        for (int j = 0; j < k; ++j) {
          const int e = ids[t * k + j];
          const double wj = weights[t * k + j];
          const float* g = gu.data() + static_cast<int64_t>(e) * 2 * ff * in;
          std::vector<float> hid(static_cast<size_t>(ff));
          for (int64_t o = 0; o < ff; ++o) {
            double a = 0, b = 0;
            for (int64_t i = 0; i < in; ++i) {
              a += double(g[o * in + i]) * xr[t * in + i];
              b += double(g[(ff + o) * in + i]) * xr[t * in + i];
            }
            if (c.oss) {
              a = std::min(a + gu_bias[e * 2 * ff + o], double(kSwigluOaiLimit));
              b = std::clamp(b + gu_bias[(e * 2 + 1) * ff + o], -double(kSwigluOaiLimit), double(kSwigluOaiLimit));
              hid[o] = static_cast<float>(a / (1 + std::exp(-double(kSwigluOaiAlpha) * a)) * (b + 1));
            } else {
              hid[o] = static_cast<float>(a / (1 + std::exp(-a)) * b);
            }
          }
          std::vector<float> hr;
          std::vector<double> hstep;
          round_x(hid, ff, &hr, &hstep);
          const double step = 2 * *std::max_element(hstep.begin(), hstep.end());
          const float* d = dn.data() + static_cast<int64_t>(e) * in * ff;
          for (int64_t o = 0; o < in; ++o) {
            double sum = 0, mag = 0, wmax = 0;
            for (int64_t i = 0; i < ff; ++i) {
              sum += double(d[o * ff + i]) * hr[i];
              mag += std::abs(double(d[o * ff + i]) * hr[i]);
              wmax = std::max(wmax, std::abs(double(d[o * ff + i])));
            }
            want[o] += wj * (sum + (c.oss ? dn_bias[e * in + o] : 0.0));
            tol[o] += wj * (1e-4 * mag + 2 * wmax * step);
          }
        }
        for (int64_t o = 0; o < in; ++o) {
          if (c.shared) {  // (--use_fast_math's expf: a few ulps)
            want[o] += shared[t * in + o] / (1 + std::exp(-double(shared_logit[t])));
            tol[o] += 1e-5 * std::abs(shared[t * in + o]);
          }
          if (c.accumulate) want[o] += y0[t * in + o];
          const double got = y[t * in + o];
          REQUIRE(std::isfinite(got));
          worst = std::max(worst, std::abs(got - want[o]) / (tol[o] + 1e-6 * std::abs(want[o])));
        }
      }
      INFO("error / tolerance " << worst);
      CHECK(worst <= 1.0);
    }
  }
}

TEST_CASE("cuda experts' own router scores follow float64 and route as the given scores do", "[cuda][quant]") {
  // experts_ffn with the router set: decode-sized steps (n <= 8) take one kernel for the scores and
  // the routing (the last block to finish routes, leaving its counter at zero), larger ones the
  // general matmul. Its scores (written to router_logits) against float64 dots; everything after
  // them against experts_ffn run on those scores given: the same ids, weights and y to the bit.
  // Two inputs through one scratch: the second call routes afresh (the counter was put back).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(29);
  struct Case {
    int n_expert, k;
    int64_t in;
    bool bias;
  };
  for (const Case c : {Case{8, 2, 256, false}, Case{128, 8, 2048, false}, Case{32, 4, 512, true}, Case{16, 16, 256, false}}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{12}}) {
      const int E = c.n_expert, k = c.k;
      const int64_t in = c.in, ff = 64;
      INFO("experts " << E << " k " << k << " in " << in << " n " << n << (c.bias ? " bias" : ""));
      const Tensor gud = random_q8_0_experts(*gpu, rng, E, 2 * ff, in), dnd = random_q8_0_experts(*gpu, rng, E, in, ff);
      const auto router = random_floats(rng, static_cast<size_t>(E * in), 0.05f);
      const auto router_bias = random_floats(rng, static_cast<size_t>(E));
      const Tensor rd = upload(*gpu, router, Shape{E, in}), rbd = upload(*gpu, router_bias, Shape{E});
      auto scratch = [&](int64_t count) { return gpu->alloc(Shape{count}, DType::kF32).value(); };
      std::vector<Tensor> own_keep, given_keep;
      own_keep.reserve(7), given_keep.reserve(7);
      const cuda::ExpertScratch own = expert_scratch(*gpu, n, k, E, in, ff, &own_keep),
                                given = expert_scratch(*gpu, n, k, E, in, ff, &given_keep);
      for (int round = 0; round < 2; ++round) {
        INFO("call " << round);
        const auto h = random_floats(rng, static_cast<size_t>(n * in));
        const Tensor hd = upload(*gpu, h, Shape{n, in});
        const Tensor ld = scratch(n * E), yd = scratch(n * in), y2d = scratch(n * in);
        cuda::ExpertsFfn f{.gate_up = &gud, .down = &dnd, .k = k, .normalize = true};
        f.router = &rd;
        if (c.bias) f.router_bias = rbd.data_as<float>();
        REQUIRE(cuda::experts_ffn(*gpu, f, ld.data_as<float>(), hd.data_as<float>(), n, own, yd.data_as<float>()).ok());
        const std::vector<float> logits = download(*gpu, ld);
        for (int64_t t = 0; t < n; ++t) {
          for (int e = 0; e < E; ++e) {
            double want = c.bias ? router_bias[e] : 0.0, mag = std::abs(want);
            for (int64_t i = 0; i < in; ++i) {
              want += double(router[e * in + i]) * h[t * in + i];
              mag += std::abs(double(router[e * in + i]) * h[t * in + i]);
            }
            CHECK(std::abs(logits[t * E + e] - want) <= 1e-5 * mag + 1e-7);
          }
        }
        cuda::ExpertsFfn g = f;
        g.router = nullptr, g.router_bias = nullptr;
        REQUIRE(cuda::experts_ffn(*gpu, g, ld.data_as<float>(), hd.data_as<float>(), n, given, y2d.data_as<float>()).ok());
        std::vector<int32_t> own_ids(static_cast<size_t>(n * k)), given_ids(own_ids.size());
        REQUIRE(gpu->copy(own_keep[0], Tensor::wrap(own_ids.data(), own_keep[0].shape(), DType::kF32)).ok());
        REQUIRE(gpu->copy(given_keep[0], Tensor::wrap(given_ids.data(), given_keep[0].shape(), DType::kF32)).ok());
        std::vector<int32_t> cpu_ids(own_ids.size());
        std::vector<float> cpu_w(own_ids.size());
        cpu::route_experts(logits.data(), n, E, k, true, cpu_ids.data(), cpu_w.data(), false);
        CHECK(own_ids == cpu_ids);
        CHECK(own_ids == given_ids);
        CHECK(download(*gpu, own_keep[1]) == download(*gpu, given_keep[1]));
        CHECK(download(*gpu, yd) == download(*gpu, y2d));
      }
    }
  }
}

TEST_CASE("cuda experts split over ranks add up to the whole", "[cuda][quant]") {
  // Tensor parallelism's expert split: each rank holds experts [r E / world, (r + 1) E / world)
  // (views of the whole stack here), routes every token over all E from the same scores, and adds
  // only its experts' products (rank 0 writes y, the others add to it, as the all-reduce sums
  // them). The sum equals experts_ffn over the whole stack but for the order of the additions.
  // Decode-sized (the router's own kernel) and larger steps; gpt-oss's biases and routing.
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(41);
  struct Case {
    int n_expert, k;
    int64_t in, ff;
    bool oss;
  };
  for (const Case c : {Case{8, 2, 256, 128, false}, Case{16, 4, 512, 64, true}}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{12}}) {
      const int E = c.n_expert, k = c.k;
      const int64_t in = c.in, ff = c.ff;
      const Tensor gud = random_q8_0_experts(*gpu, rng, E, 2 * ff, in), dnd = random_q8_0_experts(*gpu, rng, E, in, ff);
      const Tensor rd = upload(*gpu, random_floats(rng, static_cast<size_t>(E * in), 0.05f), Shape{E, in});
      const Tensor gubd = upload(*gpu, random_floats(rng, static_cast<size_t>(E * 2 * ff), 2.0f), Shape{E, 2 * ff});
      const Tensor dnbd = upload(*gpu, random_floats(rng, static_cast<size_t>(E * in)), Shape{E, in});
      const Tensor hd = upload(*gpu, random_floats(rng, static_cast<size_t>(n * in)), Shape{n, in});
      auto scratch = [&](int64_t count) { return gpu->alloc(Shape{count}, DType::kF32).value(); };
      std::vector<Tensor> keep;
      keep.reserve(7 * 7);  // (the whole, then 2 and 4 ranks: a scratch each)
      auto make_scratch = [&]() { return expert_scratch(*gpu, n, k, E, in, ff, &keep); };
      auto ffn = [&](const Tensor& gu, const Tensor& dn, const float* gu_bias, const float* dn_bias, int first) {
        cuda::ExpertsFfn f{.gate_up = &gu, .down = &dn, .k = k, .normalize = !c.oss, .router = &rd};
        f.n_expert = E, f.first_expert = first;
        if (c.oss) {
          f.softmax_chosen = true, f.gate_up_bias = gu_bias, f.down_bias = dn_bias;
          f.swiglu_alpha = kSwigluOaiAlpha, f.swiglu_limit = kSwigluOaiLimit;
        }
        return f;
      };
      const Tensor whole_y = scratch(n * in), logits = scratch(n * E);
      REQUIRE(cuda::experts_ffn(*gpu, ffn(gud, dnd, gubd.data_as<float>(), dnbd.data_as<float>(), 0),
                                logits.data_as<float>(), hd.data_as<float>(), n, make_scratch(),
                                whole_y.data_as<float>())
                  .ok());
      const std::vector<float> want = download(*gpu, whole_y);
      double scale = 1e-6;
      for (float v : want) scale = std::max(scale, double(std::abs(v)));
      for (const int world : {2, 4}) {
        INFO("experts " << E << " k " << k << " n " << n << " over " << world << (c.oss ? " gpt-oss" : ""));
        const int each = E / world;
        const Tensor y = scratch(n * in);
        for (int r = 0; r < world; ++r) {
          const Tensor gu = gud.rows(r * each, (r + 1) * each), dn = dnd.rows(r * each, (r + 1) * each);
          const Tensor gb = gubd.rows(r * each, (r + 1) * each), db = dnbd.rows(r * each, (r + 1) * each);
          const Status s = cuda::experts_ffn(*gpu, ffn(gu, dn, gb.data_as<float>(), db.data_as<float>(), r * each),
                                             logits.data_as<float>(), hd.data_as<float>(), n, make_scratch(),
                                             y.data_as<float>(), /*accumulate=*/r > 0);
          INFO(s.to_string());
          REQUIRE(s.ok());
        }
        const std::vector<float> got = download(*gpu, y);
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(double(got[i]) - want[i]) / scale);
        INFO("worst " << worst);
        CHECK(worst < 1e-5);
      }
    }
  }
}

TEST_CASE("cuda decode products give a row of x the same numbers whatever rows share the call", "[cuda][quant]") {
  // A verification of k + 1 drafted tokens, or sessions decoding together: each row's numbers
  // must not depend on the other rows of the step, within each kernel (the unit loop below
  // decode_mma_min_rows, the tensor-core one from there to 8): plain, split with the norm folded
  // in, gate/up pairs.
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(29);
  auto all_finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); });
  };
  for (const QuantFormat& f : quant_formats()) {
    // Rows long enough for the unit loop's split (several warps a row), and outputs not whole
    // tiles of 16 rows.
    const int64_t in = 4096, out = 200;
    if (in % f.block_elems != 0) continue;
    const std::vector<uint8_t> wb = weight_bytes(f, out, in);
    const Tensor wd = upload_bytes(*gpu, wb, Shape{out, in}, f.dtype);
    const auto norm = random_floats(rng, static_cast<size_t>(in));
    const Tensor nwd = upload(*gpu, norm, Shape{in});
    for (const int64_t n : {3, 5, 8}) {
      INFO(f.name << " n " << n);
      const auto x = random_floats(rng, static_cast<size_t>(n * in), 2.0f);
      // kind 0: plain; 1: split 120 + 80 with the norm; 2: gate/up pairs (f32 h [rows, out / 2]).
      auto run = [&](int kind, const float* xs, int64_t rows) {
        const Tensor xd = upload(*gpu, std::vector<float>(xs, xs + rows * in), Shape{rows, in});
        const int64_t cols = kind == 2 ? out / 2 : out;
        const Tensor y = upload(*gpu, std::vector<float>(static_cast<size_t>(rows * cols), std::nanf("")), Shape{rows, cols});
        if (kind == 0) {
          REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), rows, y.data_as<float>()).ok());
          return download(*gpu, y);
        }
        if (kind == 2) {
          REQUIRE(cuda::matmul_gate_up(*gpu, wd, xd.data_as<float>(), rows, nwd.data_as<float>(), 1e-5f, y.data()).ok());
          return download(*gpu, y);
        }
        const Tensor y2 = upload(*gpu, std::vector<float>(static_cast<size_t>(rows * 80), std::nanf("")), Shape{rows, 80});
        const cuda::MatmulOut outs[] = {{y.data_as<float>(), 120}, {y2.data_as<float>(), 80}};
        REQUIRE(cuda::matmul_split(*gpu, wd, xd.data_as<float>(), rows, outs, nwd.data_as<float>(), 1e-5f).ok());
        const auto a = download(*gpu, y), b = download(*gpu, y2);
        std::vector<float> joined;  // row r: its 120, then its 80
        for (int64_t r = 0; r < rows; ++r) {
          joined.insert(joined.end(), a.begin() + r * 120, a.begin() + (r + 1) * 120);
          joined.insert(joined.end(), b.begin() + r * 80, b.begin() + (r + 1) * 80);
        }
        return joined;
      };
      // Each row against the row first in a call of the fewest rows that take the same kernel
      // (alone, or with the rows after it: the tensor-core kernel's least).
      const int64_t least = n >= cuda::decode_mma_min_rows(f.dtype) ? cuda::decode_mma_min_rows(f.dtype) : 1;
      for (int kind = 0; kind < 3; ++kind) {
        INFO("kind " << kind);
        const auto together = run(kind, x.data(), n);
        CHECK(all_finite(together));
        const size_t cols = together.size() / static_cast<size_t>(n);
        for (int64_t r = 0; r < n; ++r) {
          INFO("row " << r << " first of " << least);
          std::vector<float> few;
          for (int64_t k = 0; k < least; ++k) {
            const int64_t s = (r + k) % n;
            few.insert(few.end(), x.begin() + s * in, x.begin() + (s + 1) * in);
          }
          const auto first = run(kind, few.data(), least);
          REQUIRE(first.size() == cols * static_cast<size_t>(least));
          CHECK(all_finite(first));
          CHECK(std::memcmp(first.data(), together.data() + r * cols, cols * sizeof(float)) == 0);
        }
      }
    }
  }
}
