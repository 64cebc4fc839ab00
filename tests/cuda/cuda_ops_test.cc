// The CUDA backend's ops against the CPU implementations (themselves checked against float64
// references), on fresh random inputs, with outputs poisoned (NaN) before every run. [cuda]: on a
// machine without a GPU every test says so and checks nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/backend/cuda/cuda_ops.h"
#include "support/cuda_helpers.h"

using namespace combs;
using combs::testing::download;
using combs::testing::gpu_or_skip;
using combs::testing::upload;

namespace {

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <typename T>
Tensor upload_raw(CudaBackend& b, const std::vector<T>& host, DType dtype) {
  Tensor t = b.alloc(Shape{static_cast<int64_t>(host.size() * sizeof(T) / 4)}, dtype).value();
  REQUIRE(b.copy(Tensor::wrap(const_cast<T*>(host.data()), t.shape(), dtype), t).ok());
  return t;
}
// An f32 device buffer of n NaNs (poisoned output).
Tensor poisoned(CudaBackend& b, int64_t n) {
  std::vector<float> nan(static_cast<size_t>(n), std::nanf(""));
  return upload(b, nan, Shape{n});
}

// A 16-bit (f16 or bf16) device tensor's values as f32 on the host.
std::vector<float> download_16bit(CudaBackend& b, const Tensor& t) {
  std::vector<uint16_t> raw(static_cast<size_t>(t.numel()));
  REQUIRE(b.copy(t, Tensor::wrap(raw.data(), t.shape(), t.dtype())).ok());
  std::vector<float> f(raw.size());
  cpu::dequantize_row(raw.data(), t.dtype(), f.data(), t.numel());
  return f;
}

// max |a - b| / (|b| + floor), over all elements; NaN anywhere fails.
double max_rel_err(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-2) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]) / (std::abs(static_cast<double>(b[i])) + floor));
  }
  return m;
}

}  // namespace

TEST_CASE("cuda matmul agrees with the cpu in f32 f16 and bf16 with and without bias", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  INFO(gpu->description());
  CpuBackend cpu;
  std::mt19937 rng(7);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t n : {1, 3, 8, 9, 64, 257}) {
      const int64_t in = 384, out = 200;
      auto w = random_floats(rng, out * in, 0.05f), x = random_floats(rng, n * in), bias = random_floats(rng, out);
      // The CPU computes with the same rounded weights and (for 16-bit weights) activations.
      std::vector<uint8_t> wq(nbytes_for(dt, out * in));
      cpu::quantize_row(w.data(), dt, wq.data(), out * in);
      cpu::dequantize_row(wq.data(), dt, w.data(), out * in);
      std::vector<float> xr = x;
      if (dt != DType::kF32) {  // x is rounded to the weights' dtype
        std::vector<uint8_t> xq(nbytes_for(dt, n * in));
        cpu::quantize_row(x.data(), dt, xq.data(), n * in);
        cpu::dequantize_row(xq.data(), dt, xr.data(), n * in);
      }
      std::vector<float> want(static_cast<size_t>(n * out));
      cpu::matmul(cpu, Tensor::wrap(w.data(), Shape{out, in}, DType::kF32), xr.data(), n, want.data(), bias.data());
      Tensor wd = upload(*gpu, w, Shape{out, in}, dt), xd = upload(*gpu, x, Shape{n, in}),
             bd = upload(*gpu, bias, Shape{out}), yd = poisoned(*gpu, n * out);
      REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, yd.data_as<float>(), bd.data_as<float>()).ok());
      INFO("dtype " << dtype_name(dt) << " n " << n);
      CHECK(max_rel_err(download(*gpu, yd), want) < (dt == DType::kF32 ? 1e-4 : 2e-3));
    }
  }
}

TEST_CASE("cuda embedding rms norm and silu agree with the cpu", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(11);
  const int64_t n = 37, dim = 320, vocab = 500;
  SECTION("embedding in every table dtype") {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      auto table = random_floats(rng, vocab * dim);
      std::vector<uint8_t> tq(nbytes_for(dt, vocab * dim));
      cpu::quantize_row(table.data(), dt, tq.data(), vocab * dim);
      std::vector<int32_t> ids(n);
      for (auto& i : ids) i = static_cast<int32_t>(rng() % vocab);
      std::vector<float> want(static_cast<size_t>(n * dim));
      cpu::embedding(Tensor::wrap(tq.data(), Shape{vocab, dim}, dt), ids.data(), n, want.data());
      Tensor td = upload(*gpu, table, Shape{vocab, dim}, dt), idd = upload_raw(*gpu, ids, DType::kF32),
             od = poisoned(*gpu, n * dim);
      REQUIRE(cuda::embedding(*gpu, td, idd.data_as<int32_t>(), n, od.data_as<float>()).ok());
      INFO(dtype_name(dt));
      CHECK(max_rel_err(download(*gpu, od), want, 1e-6) == 0.0);
    }
  }
  SECTION("residual add fused with rms norm, rows by float4 and (dim 318) by element") {
    for (const int64_t dim : {int64_t{320}, int64_t{318}}) {
      INFO("dim " << dim);
      auto r = random_floats(rng, n * dim), d = random_floats(rng, n * dim), w = random_floats(rng, dim);
      std::vector<float> sum(r.size()), want(r.size());
      for (size_t i = 0; i < r.size(); ++i) sum[i] = r[i] + d[i];
      cpu::rms_norm(sum.data(), w.data(), want.data(), n, dim, 1e-5f);
      Tensor rd = upload(*gpu, r, Shape{n * dim}), dd = upload(*gpu, d, Shape{n * dim}), wd = upload(*gpu, w, Shape{dim}),
             yd = poisoned(*gpu, n * dim);
      REQUIRE(cuda::add_rms_norm(*gpu, rd.data_as<float>(), dd.data_as<float>(), wd.data_as<float>(), yd.data_as<float>(),
                                 n, dim, 1e-5f)
                  .ok());
      CHECK(max_rel_err(download(*gpu, yd), want) < 1e-5);
      CHECK(max_rel_err(download(*gpu, rd), sum) < 1e-6);
      // Without a delta: the plain norm.
      Tensor y2 = poisoned(*gpu, n * dim);
      REQUIRE(cuda::add_rms_norm(*gpu, rd.data_as<float>(), nullptr, wd.data_as<float>(), y2.data_as<float>(), n, dim,
                                 1e-5f)
                  .ok());
      CHECK(max_rel_err(download(*gpu, y2), want) < 1e-5);
    }
  }
  SECTION("silu times up") {
    auto g = random_floats(rng, n * dim, 3.0f), u = random_floats(rng, n * dim);
    std::vector<float> want = g;
    cpu::silu_mul(want.data(), u.data(), n * dim);
    Tensor gd = upload(*gpu, g, Shape{n * dim}), ud = upload(*gpu, u, Shape{n * dim});
    REQUIRE(cuda::silu_mul(*gpu, gd.data_as<float>(), ud.data_as<float>(), n * dim).ok());
    CHECK(max_rel_err(download(*gpu, gd), want) < 1e-5);
  }
}

TEST_CASE("cuda errors come back as status", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  CHECK(CudaBackend::create({.device = 99}).status().code() == StatusCode::kUnavailable);
  auto huge = gpu->alloc(Shape{int64_t{1} << 40}, DType::kF32);  // 4 TiB
  CHECK(huge.status().code() == StatusCode::kResourceExhausted);
  std::vector<float> host(64);
  Tensor w = Tensor::wrap(host.data(), Shape{8, 8}, DType::kF32);  // host memory
  CHECK(cuda::matmul(*gpu, w, nullptr, 1, nullptr).code() == StatusCode::kInvalidArgument);
  // Host 16-bit weights of decode size: refused by every projection before its kernel would read them.
  std::vector<uint16_t> host16(64);
  Tensor w16 = Tensor::wrap(host16.data(), Shape{8, 8}, DType::kBF16);
  const cuda::MatmulOut all_rows[] = {{nullptr, 8}};
  CHECK(cuda::matmul_split(*gpu, w16, nullptr, 1, all_rows).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_rounded(*gpu, w16, nullptr, 1, nullptr).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_gate_up(*gpu, w16, nullptr, 1, nullptr, 1e-5f, nullptr).code() == StatusCode::kInvalidArgument);
  // Block weights whose rows are not whole blocks (32 elements of Q4_K's 256): refused before a kernel runs.
  Tensor q = gpu->alloc(Shape{8, 32}, DType::kQ4_K).value();
  CHECK(cuda::matmul(*gpu, q, nullptr, 1, nullptr).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul(*gpu, q, nullptr, 20, nullptr).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("cuda fused projections split outputs and fold swiglu into the down projection", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  CpuBackend cpu;
  std::mt19937 rng(5);
  const int64_t in = 256, a = 96, bb = 32, c = 32;
  for (int64_t n : {1, 5, 8, 20}) {
    INFO("n " << n);
    auto w = random_floats(rng, (a + bb + c) * in, 0.05f), x = random_floats(rng, n * in), bias = random_floats(rng, a + bb + c);
    Tensor wd = upload(*gpu, w, Shape{a + bb + c, in}, DType::kBF16), xd = upload(*gpu, x, Shape{n, in}),
           bd = upload(*gpu, bias, Shape{a + bb + c});
    Tensor whole = poisoned(*gpu, n * (a + bb + c));
    REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, whole.data_as<float>(), bd.data_as<float>()).ok());
    Tensor ya = poisoned(*gpu, n * a), yb = poisoned(*gpu, n * bb), yc = poisoned(*gpu, n * c);
    const cuda::MatmulOut outs[] = {{ya.data_as<float>(), a, bd.data_as<float>()},
                                    {yb.data_as<float>(), bb, bd.data_as<float>() + a},
                                    {yc.data_as<float>(), c, bd.data_as<float>() + a + bb}};
    REQUIRE(cuda::matmul_split(*gpu, wd, xd.data_as<float>(), n, outs).ok());
    const auto all = download(*gpu, whole), ga = download(*gpu, ya), gb = download(*gpu, yb), gc = download(*gpu, yc);
    std::vector<float> want_a, want_b, want_c;
    for (int64_t t = 0; t < n; ++t) {
      const float* row = all.data() + t * (a + bb + c);
      want_a.insert(want_a.end(), row, row + a);
      want_b.insert(want_b.end(), row + a, row + a + bb);
      want_c.insert(want_c.end(), row + a + bb, row + a + bb + c);
    }
    CHECK(max_rel_err(ga, want_a) < 1e-5);
    CHECK(max_rel_err(gb, want_b) < 1e-5);
    CHECK(max_rel_err(gc, want_c) < 1e-5);
    // swiglu: against silu_mul then matmul.
    auto g = random_floats(rng, n * in, 2.0f), u = random_floats(rng, n * in);
    Tensor gd = upload(*gpu, g, Shape{n * in}), ud = upload(*gpu, u, Shape{n * in}), y1 = poisoned(*gpu, n * (a + bb + c));
    REQUIRE(cuda::matmul_swiglu(*gpu, wd, gd.data_as<float>(), ud.data_as<float>(), n, y1.data_as<float>()).ok());
    Tensor gd2 = upload(*gpu, g, Shape{n * in}), y2 = poisoned(*gpu, n * (a + bb + c));
    REQUIRE(cuda::silu_mul(*gpu, gd2.data_as<float>(), ud.data_as<float>(), n * in).ok());
    REQUIRE(cuda::matmul(*gpu, wd, gd2.data_as<float>(), n, y2.data_as<float>()).ok());
    CHECK(max_rel_err(download(*gpu, y1), download(*gpu, y2)) < 1e-3);
  }
}

TEST_CASE("the down projection of block weights forms silu(gate) times up as it rounds x to 8 bits: silu_mul's numbers", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(6);
  const int64_t in = 512, out = 96;
  // Q4_K and Q6_K: the decode kernel (3 rows) and int8 tensor cores (40, 64); Q4_0 at 40 rows
  // takes BF16 x (silu_mul over gate, then the projection): the same path on both sides.
  for (DType t : {DType::kQ4_K, DType::kQ6_K, DType::kQ4_0}) {
    for (int64_t n : {3, 40, 64}) {
      for (bool accumulate : {false, true}) {
        INFO(dtype_name(t) << ", n " << n << ", accumulate " << accumulate);
        const auto w = random_floats(rng, out * in, 0.05f), g = random_floats(rng, n * in, 3.0f), u = random_floats(rng, n * in),
                   y0 = random_floats(rng, n * out);
        const Tensor wd = upload(*gpu, w, Shape{out, in}, t), ud = upload(*gpu, u, Shape{n * in});
        Tensor g1 = upload(*gpu, g, Shape{n * in}), y1 = upload(*gpu, y0, Shape{n * out});
        REQUIRE(cuda::matmul_swiglu(*gpu, wd, g1.data_as<float>(), ud.data_as<float>(), n, y1.data_as<float>(), accumulate).ok());
        Tensor g2 = upload(*gpu, g, Shape{n * in}), y2 = upload(*gpu, y0, Shape{n * out});
        REQUIRE(cuda::silu_mul(*gpu, g2.data_as<float>(), ud.data_as<float>(), n * in).ok());
        REQUIRE(cuda::matmul(*gpu, wd, g2.data_as<float>(), n, y2.data_as<float>(), nullptr, accumulate).ok());
        const auto got = download(*gpu, y1), want = download(*gpu, y2);
        CHECK(got == want);  // bit for bit
        CHECK(std::none_of(got.begin(), got.end(), [](float v) { return std::isnan(v); }));
      }
    }
  }
}

TEST_CASE("cuda argmax rows take the first of equal maxima", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(41);
  // cols 1000 and a vocabulary's 128,256: four floats at a time; 1001 and a row start off 16 bytes:
  // one at a time. Row 3 of the widest holds a tie 4,096 columns apart (one thread's in a one-pass
  // scan, two chunks' in the two-pass one). NaN is
  // never taken (row 4: NaN among numbers, as std::max_element after a number; row 5: all NaN: 0).
  for (int64_t cols : {1000, 1001, 128256}) {
    for (int64_t offset : {0, 1}) {
      INFO("cols " << cols << ", offset " << offset);
      const int64_t rows = 6;
      auto x = random_floats(rng, offset + rows * cols);
      float* r = x.data() + offset;
      r[0 * cols + 517] = 9.0f, r[0 * cols + 901] = 9.0f;  // a tie: the lower index
      r[1 * cols + cols - 1] = 7.0f;                        // the last column
      if (cols > 8192) r[3 * cols + 100] = 8.0f, r[3 * cols + 4196] = 8.0f;
      for (int64_t i = 0; i < cols; ++i) r[2 * cols + i] = -INFINITY;  // nothing above -inf: column 0
      for (int64_t i = 5; i < cols; i += 7) r[4 * cols + i] = NAN;
      for (int64_t i = 0; i < cols; ++i) r[5 * cols + i] = NAN;
      Tensor xd = upload(*gpu, x, Shape{offset + rows * cols});
      Tensor ids = gpu->alloc(Shape{rows}, DType::kF32).value();  // 4-byte slots for the ids
      REQUIRE(cuda::argmax_rows(*gpu, xd.data_as<float>() + offset, rows, cols, ids.data_as<int32_t>()).ok());
      std::vector<int32_t> got(rows);
      REQUIRE(gpu->copy(ids, Tensor::wrap(got.data(), Shape{rows}, DType::kF32)).ok());
      for (int64_t i = 0; i < rows; ++i) {
        INFO("row " << i);
        CHECK(got[i] == std::max_element(r + i * cols, r + (i + 1) * cols) - (r + i * cols));
      }
      CHECK(got[0] == 517);
      CHECK(got[1] == cols - 1);
      CHECK(got[2] == 0);
      if (cols > 8192) CHECK(got[3] == 100);
      CHECK(got[5] == 0);
    }
  }
}

TEST_CASE("cuda decode mlp pairs gate and up rows and projects their rounded product", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(33);
  // ff above the decode kernel's warp count (some warps take two gate/up pairs); in and ff not
  // whole multiples of a warp's 2,048-element batch.
  const int64_t in = 2304, ff = 2600, out = 192;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    auto wgu = random_floats(rng, 2 * ff * in, 0.05f), wdn = random_floats(rng, out * ff, 0.05f), g = random_floats(rng, in);
    Tensor wgu_d = upload(*gpu, wgu, Shape{2 * ff, in}, dt), wdn_d = upload(*gpu, wdn, Shape{out, ff}, dt),
           g_d = upload(*gpu, g, Shape{in});
    for (int64_t n : {1, 3, 8}) {
      INFO(dtype_name(dt) << " n " << n);
      auto x = random_floats(rng, n * in, 2.0f);
      Tensor x_d = upload(*gpu, x, Shape{n * in});
      // Reference: the split gate/up projection (f32 outputs), then silu(gate) * up on the host.
      Tensor gate = poisoned(*gpu, n * ff), up = poisoned(*gpu, n * ff);
      const cuda::MatmulOut parts[] = {{gate.data_as<float>(), ff}, {up.data_as<float>(), ff}};
      REQUIRE(cuda::matmul_split(*gpu, wgu_d, x_d.data_as<float>(), n, parts, g_d.data_as<float>(), 1e-5f).ok());
      const auto gf = download(*gpu, gate), uf = download(*gpu, up);
      std::vector<float> want(gf.size());
      for (size_t i = 0; i < want.size(); ++i) want[i] = gf[i] / (1.0f + std::exp(-gf[i])) * uf[i];
      Tensor h = gpu->alloc(Shape{n, ff}, dt).value();
      std::vector<uint16_t> nan16(static_cast<size_t>(n * ff), 0xFFFF);  // NaN in f16 and bf16: every element must be written
      REQUIRE(gpu->copy(Tensor::wrap(nan16.data(), Shape{n, ff}, dt), h).ok());
      REQUIRE(cuda::matmul_gate_up(*gpu, wgu_d, x_d.data_as<float>(), n, g_d.data_as<float>(), 1e-5f, h.data()).ok());
      const auto got = download_16bit(*gpu, h);
      CHECK(max_rel_err(got, want) < (dt == DType::kBF16 ? 8e-3 : 1e-3));  // one rounding to dt
      {  // gemma's pair: GELU (tanh) of the gate, on the same projections
        std::vector<float> want_gelu(gf.size());
        for (size_t i = 0; i < want_gelu.size(); ++i) {
          const double gv = gf[i];
          want_gelu[i] = static_cast<float>(0.5 * gv * (1.0 + std::tanh(0.7978845608028654 * (gv + 0.044715 * gv * gv * gv))) * uf[i]);
        }
        Tensor hg = gpu->alloc(Shape{n, ff}, dt).value();
        REQUIRE(gpu->copy(Tensor::wrap(nan16.data(), Shape{n, ff}, dt), hg).ok());
        REQUIRE(cuda::matmul_gate_up(*gpu, wgu_d, x_d.data_as<float>(), n, g_d.data_as<float>(), 1e-5f, hg.data(),
                                     cuda::GateActivation::kGeluTanh)
                    .ok());
        // (--use_fast_math makes the device's tanhf tanh.approx, ~2^-11 relative: with f16's
        // rounding, up to ~1.5e-3 measured on the H100.)
        CHECK(max_rel_err(download_16bit(*gpu, hg), want_gelu) < (dt == DType::kBF16 ? 8e-3 : 2.5e-3));
      }
      // The down projection of the rounded product against the f32 path on the same values, then
      // with the residual add.
      Tensor got_f32 = upload(*gpu, got, Shape{n * ff}), y1 = poisoned(*gpu, n * out), y2 = poisoned(*gpu, n * out);
      REQUIRE(cuda::matmul_rounded(*gpu, wdn_d, h.data(), n, y1.data_as<float>()).ok());
      REQUIRE(cuda::matmul(*gpu, wdn_d, got_f32.data_as<float>(), n, y2.data_as<float>()).ok());
      const auto plain = download(*gpu, y2);
      CHECK(max_rel_err(download(*gpu, y1), plain) < 1e-5);
      auto resid = random_floats(rng, n * out);
      Tensor y3 = upload(*gpu, resid, Shape{n * out});
      REQUIRE(cuda::matmul_rounded(*gpu, wdn_d, h.data(), n, y3.data_as<float>(), /*accumulate=*/true).ok());
      auto sum = plain;
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += resid[i];
      CHECK(max_rel_err(download(*gpu, y3), sum) < 1e-5);
    }
    // A batch past the decode kernel: the pairing is refused; the rounded input goes to cuBLAS.
    const int64_t n = 20;
    auto x = random_floats(rng, n * ff);
    Tensor x_dt = upload(*gpu, x, Shape{n, ff}, dt), y1 = poisoned(*gpu, n * out), y2 = poisoned(*gpu, n * out);
    Tensor x_f32 = upload(*gpu, download_16bit(*gpu, x_dt), Shape{n * ff}), h = poisoned(*gpu, n * ff);
    CHECK(cuda::matmul_gate_up(*gpu, wgu_d, x_f32.data_as<float>(), n, g_d.data_as<float>(), 1e-5f, h.data()).code() ==
          StatusCode::kInvalidArgument);
    REQUIRE(cuda::matmul_rounded(*gpu, wdn_d, x_dt.data(), n, y1.data_as<float>()).ok());
    REQUIRE(cuda::matmul(*gpu, wdn_d, x_f32.data_as<float>(), n, y2.data_as<float>()).ok());
    CHECK(max_rel_err(download(*gpu, y1), download(*gpu, y2)) < 1e-4);
  }
}

TEST_CASE("cuda decode projections fold the rms norm into their input and the residual add into their output", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(9);
  const int64_t in = 512, out = 96;
  for (int64_t n : {1, 3, 8}) {
    INFO("n " << n);
    auto w = random_floats(rng, out * in, 0.05f), x = random_floats(rng, n * in, 3.0f), g = random_floats(rng, in);
    auto resid = random_floats(rng, n * out);
    Tensor wd = upload(*gpu, w, Shape{out, in}, DType::kBF16), xd = upload(*gpu, x, Shape{n * in}),
           gd = upload(*gpu, g, Shape{in});
    REQUIRE(cuda::decode_fused(wd, n));
    // Reference: add_rms_norm (no delta) into h, then the plain projection.
    Tensor xc = upload(*gpu, x, Shape{n * in}), h = poisoned(*gpu, n * in), want = poisoned(*gpu, n * out);
    REQUIRE(cuda::add_rms_norm(*gpu, xc.data_as<float>(), nullptr, gd.data_as<float>(), h.data_as<float>(), n, in, 1e-5f).ok());
    REQUIRE(cuda::matmul(*gpu, wd, h.data_as<float>(), n, want.data_as<float>()).ok());
    Tensor got = poisoned(*gpu, n * out);
    const cuda::MatmulOut o[] = {{got.data_as<float>(), out}};
    REQUIRE(cuda::matmul_split(*gpu, wd, xd.data_as<float>(), n, o, gd.data_as<float>(), 1e-5f).ok());
    CHECK(max_rel_err(download(*gpu, got), download(*gpu, want)) < 2e-3);
    // Accumulate: y = resid + W x.
    Tensor y = upload(*gpu, resid, Shape{n * out}), plain = poisoned(*gpu, n * out);
    REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, y.data_as<float>(), nullptr, /*accumulate=*/true).ok());
    REQUIRE(cuda::matmul(*gpu, wd, xd.data_as<float>(), n, plain.data_as<float>()).ok());
    auto sum = download(*gpu, plain);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += resid[i];
    CHECK(max_rel_err(download(*gpu, y), sum) < 1e-5);
  }
  // Without the decode kernel a fused norm is refused, not ignored.
  auto w = random_floats(rng, out * in);
  Tensor wd = upload(*gpu, w, Shape{out, in}, DType::kF32), x = poisoned(*gpu, in), g = poisoned(*gpu, in), y = poisoned(*gpu, out);
  const cuda::MatmulOut o[] = {{y.data_as<float>(), out}};
  CHECK(cuda::matmul_split(*gpu, wd, x.data_as<float>(), 1, o, g.data_as<float>(), 1e-5f).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("a norm rounded to 8 bits in its kernel gives quantized projections the numbers of rounding after it", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(22);
  // Rows of 2,560 (groups of 256, kept in registers), 96 (groups of 32) and 8,192 (past the
  // registers: the f32 norm, then rounded); with and without a post norm on delta; 1 and 3 rows
  // (the decode kernel), and 40 where every part is a super-block format (int8 tensor cores).
  struct Case {
    int64_t in;
    DType wt, wv;  // Q and K's type, V's
  };
  for (const Case k : {Case{2560, DType::kQ4_K, DType::kQ8_0}, Case{96, DType::kQ4_0, DType::kQ8_0},
                       Case{8192, DType::kQ6_K, DType::kQ4_K}, Case{2560, DType::kQ4_K, DType::kQ6_K}}) {
    for (int64_t n : {1, 3, 40}) {
      const bool batch = n > 8;
      if (batch && (k.in % 256 != 0 || k.wv == DType::kQ8_0)) continue;
      for (bool post : {false, true}) {
        INFO("in " << k.in << ", " << dtype_name(k.wt) << " and " << dtype_name(k.wv) << ", n " << n << ", post norm " << post);
        const int64_t in = k.in, a = 64, kv = 32, ff = 64;
        const auto x = random_floats(rng, n * in, 2.0f), delta = random_floats(rng, n * in), g = random_floats(rng, in),
                   dg = random_floats(rng, in);
        const auto w = random_floats(rng, (a + 2 * kv) * in, 0.05f), wv = random_floats(rng, kv * in, 0.05f),
                   wgu = random_floats(rng, 2 * ff * in, 0.05f);
        // Q and K in one tensor, V in another of another type (a Q4_K_M layer's parts).
        const Tensor parts[] = {upload(*gpu, w, Shape{a + kv, in}, k.wt), upload(*gpu, wv, Shape{kv, in}, k.wv)};
        const size_t outputs[] = {2, 1};
        const Tensor gate_up = upload(*gpu, wgu, Shape{2 * ff, in}, k.wt);
        const Tensor dd = upload(*gpu, delta, Shape{n * in}), gd = upload(*gpu, g, Shape{in}), dgd = upload(*gpu, dg, Shape{in});
        const float* post_w = post ? dgd.data_as<float>() : nullptr;
        struct Got {
          std::vector<float> residual, q, kv, h;
        };
        auto run = [&](bool q8) {
          Tensor xd = upload(*gpu, x, Shape{n * in}), q = poisoned(*gpu, n * a), kvd = poisoned(*gpu, 2 * n * kv);
          Tensor hd = poisoned(*gpu, n * ff);
          Tensor y = gpu->alloc(Shape{std::max<int64_t>(n * in, static_cast<int64_t>(cuda::q8_bytes(n, in) / 4 + 1))}, DType::kF32).value();
          const cuda::MatmulOut outs[] = {{q.data_as<float>(), a}, {kvd.data_as<float>(), kv}, {kvd.data_as<float>() + n * kv, kv}};
          if (q8) {
            REQUIRE(cuda::add_normed_rms_norm_q8(*gpu, xd.data_as<float>(), dd.data_as<float>(), post_w, gd.data_as<float>(),
                                                 y.data(), n, in, 1e-6f).ok());
            REQUIRE(cuda::matmul_split_parts_q8(*gpu, parts, outputs, y.data(), n, outs).ok());
            if (!batch) REQUIRE(cuda::matmul_gate_up_q8(*gpu, gate_up, y.data(), n, hd.data(), cuda::GateActivation::kGeluTanh).ok());
          } else {
            REQUIRE(cuda::add_normed_rms_norm(*gpu, xd.data_as<float>(), dd.data_as<float>(), post_w, gd.data_as<float>(),
                                              y.data(), DType::kF32, n, in, 1e-6f).ok());
            REQUIRE(cuda::matmul_split_parts(*gpu, parts, outputs, y.data_as<float>(), n, outs).ok());
            if (!batch) {
              REQUIRE(cuda::matmul_gate_up(*gpu, gate_up, y.data_as<float>(), n, nullptr, 0.0f, hd.data(),
                                           cuda::GateActivation::kGeluTanh).ok());
            }
          }
          return Got{download(*gpu, xd), download(*gpu, q), download(*gpu, kvd), download(*gpu, hd)};
        };
        const Got want = run(false), got = run(true);
        CHECK(got.residual == want.residual);
        CHECK(got.q == want.q);  // bit for bit (NaN, the poison, fails ==)
        CHECK(got.kv == want.kv);
        if (!batch) CHECK(got.h == want.h);
      }
    }
  }
  // Weights that do not take 8-bit x, or more rows than their kernels take, are refused; the
  // gate/up pair's kernel only for decode-sized batches.
  const Tensor bf = upload(*gpu, random_floats(rng, 64 * 256), Shape{64, 256}, DType::kBF16);
  const Tensor q4 = upload(*gpu, random_floats(rng, 64 * 256), Shape{64, 256}, DType::kQ4_K);
  const Tensor q40 = upload(*gpu, random_floats(rng, 64 * 256), Shape{64, 256}, DType::kQ4_0);
  Tensor y = poisoned(*gpu, 80 * 256), out = poisoned(*gpu, 80 * 64);
  const size_t one[] = {1};
  const cuda::MatmulOut outs[] = {{out.data_as<float>(), 64}};
  CHECK(cuda::matmul_split_parts_q8(*gpu, std::span(&bf, 1), one, y.data(), 1, outs).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_split_parts_q8(*gpu, std::span(&q4, 1), one, y.data(), 65, outs).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_split_parts_q8(*gpu, std::span(&q40, 1), one, y.data(), 9, outs).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_gate_up_q8(*gpu, bf, y.data(), 1, out.data()).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::matmul_gate_up_q8(*gpu, q4, y.data(), 9, out.data()).code() == StatusCode::kInvalidArgument);
  CHECK(cuda::takes_q8(q4, 8));
  CHECK(cuda::takes_q8(q4, 64));
  CHECK_FALSE(cuda::takes_q8(q4, 65));
  CHECK(cuda::takes_q8(q40, 8));
  CHECK_FALSE(cuda::takes_q8(q40, 9));
  CHECK_FALSE(cuda::takes_q8(bf, 1));
}

TEST_CASE("x rounded to 8 bits in groups of 256 carries each unit's sum of levels for the batch kernel's offsets", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(23);
  // Rows of 2,560 (the norm's kernel rounds them) and 8,192 (the f32 norm, then quantize_activations);
  // large values saturate whole units at +-127 (sums of +-4,064, the split's ends).
  for (int64_t in : {2560, 8192}) {
    for (int64_t n : {1, 3}) {
      INFO("in " << in << ", n " << n);
      auto x = random_floats(rng, n * in, 2.0f);
      for (int64_t i = 0; i < 64; ++i) x[static_cast<size_t>(i)] = 1000.0f, x[static_cast<size_t>(64 + i)] = -1000.0f;
      auto g = random_floats(rng, in);
      std::fill(g.begin(), g.begin() + 128, 1.0f);
      const size_t bytes = cuda::q8_bytes(n, in), sums_at = bytes - static_cast<size_t>(n * (in / 256)) * 16;
      Tensor xd = upload(*gpu, x, Shape{n * in}), gd = upload(*gpu, g, Shape{in});
      Tensor y = poisoned(*gpu, static_cast<int64_t>(bytes / 4 + 1));
      REQUIRE(cuda::add_normed_rms_norm_q8(*gpu, xd.data_as<float>(), nullptr, nullptr, gd.data_as<float>(), y.data(), n, in,
                                           1e-6f).ok());
      const std::vector<float> got = download(*gpu, y);
      const auto* b = reinterpret_cast<const int8_t*>(got.data());
      int mismatches = 0, saturated = 0;
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < in / 256; ++c) {
          for (int u = 0; u < 8; ++u) {
            int sum = 0;
            for (int k = 0; k < 32; ++k) sum += b[r * in + c * 256 + u * 32 + k];
            const int8_t* rec = b + sums_at + (r * (in / 256) + c) * 16;
            const int lo = rec[u], hi = rec[8 + u];
            mismatches += !(lo >= 0 && lo <= 127 && hi >= -32 && hi <= 31 && 128 * hi + lo == sum);
            saturated += std::abs(sum) == 32 * 127;
          }
        }
      }
      CHECK(mismatches == 0);
      CHECK(saturated >= 2);
    }
  }
}

TEST_CASE("cuda projections take a norm already rounded for them and batch equal parts", "[cuda]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(21);
  const int64_t n = 20, in = 256, a = 96, kv = 32;  // a Q-like part, then K- and V-like parts
  auto x = random_floats(rng, n * in, 2.0f), g = random_floats(rng, in), w = random_floats(rng, (a + 2 * kv) * in, 0.05f);
  std::vector<float> want_norm(x.size());
  cpu::rms_norm(x.data(), g.data(), want_norm.data(), n, in, 1e-5f);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    INFO(dtype_name(dt));
    // The norm written in the weights' dtype: the f32 norm rounded once.
    Tensor xd = upload(*gpu, x, Shape{n * in}), gd = upload(*gpu, g, Shape{in});
    Tensor h = gpu->alloc(Shape{n, in}, dt).value();
    REQUIRE(cuda::add_rms_norm(*gpu, xd.data_as<float>(), nullptr, gd.data_as<float>(), h.data(), dt, n, in, 1e-5f).ok());
    const auto got_norm = download_16bit(*gpu, h);
    CHECK(max_rel_err(got_norm, want_norm) < (dt == DType::kBF16 ? 8e-3 : 1e-3));
    // Parts from the rounded input, K and V in one buffer (one batched GEMM), against the whole
    // product of the f32 norm (rounded inside matmul).
    Tensor wd = upload(*gpu, w, Shape{a + 2 * kv, in}, dt), ref_in = upload(*gpu, want_norm, Shape{n * in});
    Tensor whole = poisoned(*gpu, n * (a + 2 * kv)), qa = poisoned(*gpu, n * a), kvd = poisoned(*gpu, 2 * n * kv);
    REQUIRE(cuda::matmul(*gpu, wd, ref_in.data_as<float>(), n, whole.data_as<float>()).ok());
    const cuda::MatmulOut outs[] = {{qa.data_as<float>(), a}, {kvd.data_as<float>(), kv}, {kvd.data_as<float>() + n * kv, kv}};
    REQUIRE(cuda::matmul_split_rounded(*gpu, wd, h.data(), n, outs).ok());
    const auto all = download(*gpu, whole), gq = download(*gpu, qa), gkv = download(*gpu, kvd);
    std::vector<float> want_q, want_kv(static_cast<size_t>(2 * n * kv));
    for (int64_t t = 0; t < n; ++t) {
      const float* row = all.data() + t * (a + 2 * kv);
      want_q.insert(want_q.end(), row, row + a);
      std::copy(row + a, row + a + kv, want_kv.begin() + t * kv);
      std::copy(row + a + kv, row + a + 2 * kv, want_kv.begin() + n * kv + t * kv);
    }
    // The two sides round the same norm independently (f32 norm then rounding, or rounded in the
    // norm kernel), so they agree to the weights' dtype.
    CHECK(max_rel_err(gq, want_q) < 2e-2);
    CHECK(max_rel_err(gkv, want_kv) < 2e-2);
  }
  // A dtype the norm cannot write is refused.
  Tensor xd = upload(*gpu, x, Shape{n * in}), gd = upload(*gpu, g, Shape{in}), y = poisoned(*gpu, n * in);
  CHECK(cuda::add_rms_norm(*gpu, xd.data_as<float>(), nullptr, gd.data_as<float>(), y.data(), DType::kQ8_0, n, in, 1e-5f)
            .code() == StatusCode::kInvalidArgument);
}

TEST_CASE("the 16-bit decode kernels give a row of x the same numbers whatever rows share the call", "[cuda]") {
  // A verification of k + 1 drafted tokens, or sessions decoding together: each row's numbers
  // must not depend on the other rows of the step (within each kernel: the one-row kernel below
  // decode_mma_min_rows, the tensor-core one from there to 8).
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  std::mt19937 rng(71);
  auto all_finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); });
  };
  // Row r of a [rows, cols] result.
  auto row_of = [](const std::vector<float>& v, int64_t r, int64_t cols) {
    return std::vector<float>(v.begin() + r * cols, v.begin() + (r + 1) * cols);
  };
  for (DType dt : {DType::kBF16, DType::kF16}) {
    // in not whole chunks of a warp's share; outputs not whole tiles of 16 rows.
    const int64_t in = 2312, out = 1000, ff = 1480, wide = 8192;
    const int64_t nin = 4096, q = 520, kv = 136;  // a fused Q/K/V with the norm folded in (one row: its own staging path)
    auto w = random_floats(rng, out * in, 0.05f), bias = random_floats(rng, out);
    auto wqkv = random_floats(rng, (q + 2 * kv) * nin, 0.05f), g = random_floats(rng, nin);
    auto wgu = random_floats(rng, 2 * ff * nin, 0.05f), wdn = random_floats(rng, out * wide, 0.02f);
    Tensor w_d = upload(*gpu, w, Shape{out, in}, dt), b_d = upload(*gpu, bias, Shape{out});
    Tensor wqkv_d = upload(*gpu, wqkv, Shape{q + 2 * kv, nin}, dt), g_d = upload(*gpu, g, Shape{nin});
    Tensor wgu_d = upload(*gpu, wgu, Shape{2 * ff, nin}, dt), wdn_d = upload(*gpu, wdn, Shape{out, wide}, dt);
    for (int64_t n : {2, 3, 5, 8}) {
      INFO(dtype_name(dt) << " n " << n);
      auto x = random_floats(rng, n * in, 2.0f), xn = random_floats(rng, n * nin, 2.0f), xw = random_floats(rng, n * wide);
      // f(x rows, count) -> outputs as rows of `cols` floats, run on all n rows, then on each row
      // first in a call of the fewest rows that take the same kernel (alone, or with the rows after
      // it: the tensor-core kernel's least).
      const int64_t least = n >= cuda::decode_mma_min_rows(dt) ? cuda::decode_mma_min_rows(dt) : 1;
      auto same_rows = [&](const std::vector<float>& xs, int64_t width, int64_t cols, auto&& f) {
        const auto together = f(xs, n);
        REQUIRE(together.size() == static_cast<size_t>(n * cols));
        CHECK(all_finite(together));
        for (int64_t r = 0; r < n; ++r) {
          std::vector<float> few;
          for (int64_t k = 0; k < least; ++k) {
            const int64_t s = (r + k) % n;
            few.insert(few.end(), xs.begin() + s * width, xs.begin() + (s + 1) * width);
          }
          const auto first = row_of(f(few, least), 0, cols);
          INFO("row " << r << " first of " << least);
          CHECK(all_finite(first));
          CHECK(std::memcmp(first.data(), row_of(together, r, cols).data(), first.size() * sizeof(float)) == 0);
        }
      };
      same_rows(x, in, out, [&](const std::vector<float>& xs, int64_t rows) {  // plain, with bias
        Tensor x_d = upload(*gpu, xs, Shape{rows * in}), y = poisoned(*gpu, rows * out);
        REQUIRE(cuda::matmul(*gpu, w_d, x_d.data_as<float>(), rows, y.data_as<float>(), b_d.data_as<float>()).ok());
        return download(*gpu, y);
      });
      same_rows(xn, nin, q + 2 * kv, [&](const std::vector<float>& xs, int64_t rows) {  // split, norm folded in
        Tensor x_d = upload(*gpu, xs, Shape{rows * nin}), yq = poisoned(*gpu, rows * q), yk = poisoned(*gpu, rows * kv),
               yv = poisoned(*gpu, rows * kv);
        const cuda::MatmulOut o[] = {{yq.data_as<float>(), q}, {yk.data_as<float>(), kv}, {yv.data_as<float>(), kv}};
        REQUIRE(cuda::matmul_split(*gpu, wqkv_d, x_d.data_as<float>(), rows, o, g_d.data_as<float>(), 1e-5f).ok());
        const auto a = download(*gpu, yq), k = download(*gpu, yk), v = download(*gpu, yv);
        std::vector<float> joined;  // row r: its q, k, v
        for (int64_t r = 0; r < rows; ++r) {
          for (const auto* part : {&a, &k, &v}) {
            const int64_t c = static_cast<int64_t>(part->size()) / rows;
            joined.insert(joined.end(), part->begin() + r * c, part->begin() + (r + 1) * c);
          }
        }
        return joined;
      });
      same_rows(xn, nin, ff, [&](const std::vector<float>& xs, int64_t rows) {  // gate/up pairs, norm folded in
        Tensor x_d = upload(*gpu, xs, Shape{rows * nin}), h = gpu->alloc(Shape{rows, ff}, dt).value();
        std::vector<uint16_t> nan16(static_cast<size_t>(rows * ff), 0xFFFF);
        REQUIRE(gpu->copy(Tensor::wrap(nan16.data(), Shape{rows, ff}, dt), h).ok());
        REQUIRE(cuda::matmul_gate_up(*gpu, wgu_d, x_d.data_as<float>(), rows, g_d.data_as<float>(), 1e-5f, h.data()).ok());
        return download_16bit(*gpu, h);
      });
      same_rows(xw, wide, out, [&](const std::vector<float>& xs, int64_t rows) {  // x already 16-bit, 8,192 wide
        Tensor x_dt = upload(*gpu, xs, Shape{rows, wide}, dt), y = poisoned(*gpu, rows * out);
        REQUIRE(cuda::matmul_rounded(*gpu, wdn_d, x_dt.data(), rows, y.data_as<float>()).ok());
        return download(*gpu, y);
      });
    }
  }
}
