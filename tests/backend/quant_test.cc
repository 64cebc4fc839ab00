// ggml's block formats (combs/backend/quant.h): every format's dequantization equals the NumPy
// reference (tests/reference/dequant_ref.py, written from the published block layouts) bit for bit,
// on blocks llama-quantize made and on random blocks; sizes of malformed rows are refused.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "combs/backend/dtype.h"
#include "combs/backend/quant.h"
#include "kernels/dequant_bf16.h"
#include "kernels/quant_dot.h"
#include "kernels/quant_gemm.h"
#include "support/temp_dir.h"

using namespace combs;

namespace {

// Byte offsets of each format's f16 scales: random blocks get finite ones there (a NaN's payload
// is not what is compared), every other byte is random.
std::vector<int> f16_fields(std::string_view name) {
  if (name == "Q4_1" || name == "Q5_1" || name == "Q4_K" || name == "Q5_K") return {0, 2};
  if (name == "Q2_K") return {80, 82};
  if (name == "Q3_K") return {108};
  if (name == "Q6_K") return {208};
  if (name == "MXFP4") return {};
  return {0};
}

std::vector<uint8_t> random_blocks(const QuantFormat& f, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(static_cast<size_t>(n) * f.block_bytes);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  for (int i = 0; i < n; ++i) {
    for (int off : f16_fields(f.name)) {
      // Scales of every magnitude f16 has, subnormals included, none inf or NaN.
      const float v = std::ldexp(scale(rng), static_cast<int>(rng() % 40) - 24);
      const uint16_t h = f32_to_f16(v);
      std::memcpy(&b[static_cast<size_t>(i) * f.block_bytes + off], &h, 2);
    }
  }
  return b;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The reference's values for these blocks.
std::vector<float> reference(const QuantFormat& f, const std::vector<uint8_t>& blocks) {
  combs::testing::TempDir dir;
  const std::string in = dir.file("blocks.bin"), out = dir.file("values.f32");
  {
    std::ofstream o(in, std::ios::binary);
    o.write(reinterpret_cast<const char*>(blocks.data()), static_cast<std::streamsize>(blocks.size()));
  }
  const std::string cmd = std::string(COMBS_PYTHON) + " " + COMBS_REFERENCE_DIR + "/dequant_ref.py " +
                          std::string(f.name) + " " + in + " " + out + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string said;
  char buf[512];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) said.append(buf, n);
  INFO(cmd << "\n" << said);
  REQUIRE(pclose(p) == 0);
  const std::vector<uint8_t> raw = read_bytes(out);
  std::vector<float> v(raw.size() / 4);
  std::memcpy(v.data(), raw.data(), v.size() * 4);
  return v;
}

// combs' values, into a buffer poisoned beforehand, with a guard past the end that must stay.
std::vector<float> dequantized(const QuantFormat& f, const std::vector<uint8_t>& blocks) {
  const int64_t nb = static_cast<int64_t>(blocks.size()) / f.block_bytes;
  std::vector<float> y(static_cast<size_t>(nb * f.block_elems) + 16, std::nanf("0x5a5a"));
  f.dequantize(blocks.data(), y.data(), nb);
  for (size_t i = y.size() - 16; i < y.size(); ++i) REQUIRE(std::isnan(y[i]));
  y.resize(y.size() - 16);
  return y;
}

void check_bit_exact(const QuantFormat& f, const std::vector<uint8_t>& blocks) {
  const std::vector<float> want = reference(f, blocks), got = dequantized(f, blocks);
  REQUIRE(got.size() == want.size());
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0 && mismatches++ == 0) first = i;
  }
  INFO(f.name << ": " << mismatches << " of " << got.size() << " values differ; first at " << first << ": "
              << (mismatches ? got[first] : 0.0f) << " vs " << (mismatches ? want[first] : 0.0f));
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("every block format dequantizes bit-exactly as the numpy reference on llama-quantize blocks",
          "[backend][quant]") {
  int files = 0;
  for (const QuantFormat& f : quant_formats()) {
    const std::vector<uint8_t> blocks = read_bytes(std::string(COMBS_TEST_DATA_DIR) + "/quant/" + std::string(f.name) + ".bin");
    if (f.name == "MXFP4") continue;  // no llama-quantize file (see tests/data/quant/README.md)
    INFO(f.name);
    REQUIRE(!blocks.empty());
    REQUIRE(blocks.size() % f.block_bytes == 0);
    check_bit_exact(f, blocks);
    ++files;
  }
  CHECK(files == 12);
}

TEST_CASE("every block format dequantizes bit-exactly as the numpy reference on random blocks", "[backend][quant]") {
  uint32_t seed = 1;
  for (const QuantFormat& f : quant_formats()) {
    INFO(f.name);
    check_bit_exact(f, random_blocks(f, f.block_elems == 256 ? 64 : 512, seed++));
  }
}

TEST_CASE("the AVX-512 dequantizers to BF16 give the numpy reference's values rounded to nearest even",
          "[backend][quant]") {
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))) {
    WARN("no AVX-512 on this CPU: its dequantizers to BF16 are not tested");
    return;
  }
  using Fn = void (*)(const void*, uint16_t*, int64_t);
  const std::pair<std::string_view, Fn> kernels[] = {{"Q4_K", cpu::avx512::dequant_bf16_q4_k},
                                                     {"Q5_K", cpu::avx512::dequant_bf16_q5_k},
                                                     {"Q6_K", cpu::avx512::dequant_bf16_q6_k},
                                                     {"Q8_0", cpu::avx512::dequant_bf16_q8_0}};
  // The reference's f32 to bf16: nearest, ties to even (no NaN in these blocks).
  auto bf16 = [](float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    const uint32_t lower = b & 0xFFFF, upper = b >> 16;
    return static_cast<uint16_t>(upper + (lower > 0x8000 || (lower == 0x8000 && (upper & 1))));
  };
  uint32_t seed = 11;
  for (const QuantFormat& f : quant_formats()) {
    const auto it = std::find_if(std::begin(kernels), std::end(kernels), [&](const auto& k) { return k.first == f.name; });
    if (it == std::end(kernels)) continue;
    for (const bool from_llama : {true, false}) {
      INFO(f.name << (from_llama ? " llama-quantize's blocks" : " random blocks"));
      const std::vector<uint8_t> blocks =
          from_llama ? read_bytes(std::string(COMBS_TEST_DATA_DIR) + "/quant/" + std::string(f.name) + ".bin")
                     : random_blocks(f, f.block_elems == 256 ? 64 : 512, seed++);
      REQUIRE(!blocks.empty());
      const std::vector<float> want = reference(f, blocks);
      const int64_t nb = static_cast<int64_t>(blocks.size()) / f.block_bytes;
      std::vector<uint16_t> got(static_cast<size_t>(nb * f.block_elems) + 16, 0x5a5a);  // poisoned, a guard after
      it->second(blocks.data(), got.data(), nb);
      for (size_t i = got.size() - 16; i < got.size(); ++i) REQUIRE(got[i] == 0x5a5a);
      REQUIRE(want.size() == got.size() - 16);
      size_t mismatches = 0, first = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (got[i] != bf16(want[i]) && mismatches++ == 0) first = i;
      }
      INFO(mismatches << " of " << want.size() << " differ; first at " << first);
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE("block formats know their geometry and refuse rows that are not whole blocks", "[backend][quant]") {
  CHECK(quant_formats().size() == 13);
  for (const QuantFormat& f : quant_formats()) {  // dtype.h's constexpr geometry agrees with the table
    INFO(f.name);
    CHECK(is_block_quant(f.dtype));
    CHECK(dtype_block_elems(f.dtype) == f.block_elems);
    CHECK(dtype_block_bytes(f.dtype) == static_cast<size_t>(f.block_bytes));
    CHECK(quant_format(f.dtype) == &f);
    DType parsed;
    REQUIRE(parse_dtype(dtype_name(f.dtype), &parsed));
    CHECK(parsed == f.dtype);
  }
  CHECK(quant_format(DType::kBF16) == nullptr);
  const QuantFormat* q4k = quant_format(12);
  REQUIRE(q4k != nullptr);
  CHECK(q4k->name == "Q4_K");
  CHECK(quant_bytes(*q4k, 4096) == 16 * 144);
  CHECK(quant_bytes(*q4k, 4000) == -1);  // not whole super-blocks
  CHECK(quant_bytes(*q4k, -256) == -1);
  CHECK(quant_bytes(*quant_format(8), INT64_MAX / 32 * 32) == -1);  // 2^58 blocks of 34 bytes overflow int64
  CHECK(quant_format(8)->block_bytes == static_cast<int>(sizeof(BlockQ8_0)));
  for (uint32_t refused : {16u, 17u, 18u, 19u, 21u, 22u, 29u, 31u, 34u, 35u, 36u, 40u, 99u}) {
    INFO(refused);
    CHECK(quant_format(refused) == nullptr);
  }
  CHECK(ggml_type_name(16) == "IQ2_XXS");
  CHECK(ggml_type_name(33) == "Q4_0_8_8 (removed)");
  CHECK(ggml_type_name(39) == "MXFP4");
  CHECK(ggml_type_name(1000) == "ggml type 1000");
}

TEST_CASE("the int8 dot products of every format with a kernel equal the exact sums over the rounded activations",
          "[backend][quant]") {
  __builtin_cpu_init();
  struct Kernels {
    const char* name;
    bool available;
    void (*quantize_act)(const float*, int64_t, cpu::BlockQ8Act*);
    float (*dot[4])(const void*, const cpu::BlockQ8Act*, int64_t);  // q4_k, q5_k, q6_k, iq4_xs
  };
  using Dot = float (*)(const void*, const cpu::BlockQ8Act*, int64_t);
  // The 32-element formats, Q2_K and Q3_K: one AVX2 kernel each, for both instruction sets (MXFP4,
  // IQ4_NL and Q8_0 have an AVX-512 one too).
  const std::pair<DType, Dot> blocks32[] = {{DType::kQ4_0, cpu::avx2::dot_q4_0},   {DType::kQ4_1, cpu::avx2::dot_q4_1},
                                            {DType::kQ5_0, cpu::avx2::dot_q5_0},   {DType::kQ5_1, cpu::avx2::dot_q5_1},
                                            {DType::kIQ4_NL, cpu::avx2::dot_iq4_nl}, {DType::kMXFP4, cpu::avx2::dot_mxfp4},
                                            {DType::kQ2_K, cpu::avx2::dot_q2_k},   {DType::kQ3_K, cpu::avx2::dot_q3_k},
                                            {DType::kQ8_0, cpu::avx2::dot_q8_0}};
  const Kernels isas[] = {
      {"avx512vnni",
       __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"),
       cpu::avx512vnni::quantize_act,
       {cpu::avx512vnni::dot_q4_k, cpu::avx512vnni::dot_q5_k, cpu::avx512vnni::dot_q6_k, cpu::avx512vnni::dot_iq4_xs}},
      {"avx2", __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
       cpu::avx2::quantize_act, {cpu::avx2::dot_q4_k, cpu::avx2::dot_q5_k, cpu::avx2::dot_q6_k, cpu::avx2::dot_iq4_xs}}};
  for (const Kernels& k : isas) {
    INFO(k.name);
    if (!k.available) {
      WARN(std::string("skipped: this CPU has no ") + k.name);
      continue;
    }
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::pair<DType, Dot>> kernels = {{DType::kQ4_K, k.dot[0]}, {DType::kQ5_K, k.dot[1]},
                                                  {DType::kQ6_K, k.dot[2]}, {DType::kIQ4_XS, k.dot[3]}};
    kernels.insert(kernels.end(), std::begin(blocks32), std::end(blocks32));
    if (std::string(k.name) == "avx512vnni") {  // its own kernels of the table formats
      kernels.push_back({DType::kMXFP4, cpu::avx512vnni::dot_mxfp4});
      kernels.push_back({DType::kIQ4_NL, cpu::avx512vnni::dot_iq4_nl});
      kernels.push_back({DType::kQ8_0, cpu::avx512vnni::dot_q8_0});
    }
    for (const auto& [t, dot] : kernels) {
      const QuantFormat& f = *quant_format(t);
      INFO(f.name);
      // Rows of 4 x 256 elements: llama-quantize's blocks (none for MXFP4), then random ones (MXFP4's
      // exponents near 1: a random byte reaches 2^127).
      std::vector<uint8_t> blocks = read_bytes(std::string(COMBS_TEST_DATA_DIR) + "/quant/" + std::string(f.name) + ".bin");
      std::vector<uint8_t> more = random_blocks(f, 16 * 256 / f.block_elems, 9);
      if (t == DType::kMXFP4) {
        for (size_t i = 0; i < more.size(); i += 17) more[i] = static_cast<uint8_t>(118 + i % 16);
      }
      blocks.insert(blocks.end(), more.begin(), more.end());
      const int64_t n = 4 * 256, row_bytes = 4 * 256 / f.block_elems * f.block_bytes;
      for (size_t r = 0; (r + 1) * row_bytes <= blocks.size(); ++r) {
        const uint8_t* row = blocks.data() + r * row_bytes;
        std::vector<float> x(n), w(n);
        for (float& v : x) v = normal(rng) * (r % 3 == 0 ? 100.0f : 1.0f);
        std::vector<cpu::BlockQ8Act> xq(4);
        k.quantize_act(x.data(), n, xq.data());
        f.dequantize(row, w.data(), n / f.block_elems);
        double exact = 0, magnitude = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double a = double(xq[i / 256].d) * xq[i / 256].q[i % 256];
          CHECK(std::abs(a - x[i]) <= 0.5 * xq[i / 256].d * 1.0001);  // rounded to the nearest step
          exact += double(w[i]) * a;
          magnitude += std::abs(double(w[i]) * a);
        }
        if (std::string(k.name) == "avx512vnni" && (t == DType::kQ4_K || t == DType::kQ5_K)) {
          cpu::avx512vnni::arrange_act_k4(xq.data(), 4);  // the order those kernels read
        }
        const float got = dot(row, xq.data(), n / f.block_elems);  // super-blocks, or blocks of 32
        INFO("row " << r << ": " << got << " vs " << exact);
        // Integer sums are exact; the float scales round a few times per super-block.
        CHECK(std::abs(got - exact) <= 1e-5 * magnitude + 1e-30);
      }
    }
  }
}

TEST_CASE("the 32-element formats' int8 dot products take rows that are not whole 256s", "[backend][quant]") {
  // gpt-oss's rows are 2,880 wide (90 blocks of 32, 11.25 activation blocks): the activations'
  // last 256 are padded with zeros, the kernel stops after the row's last block.
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
    WARN("skipped: this CPU has no AVX2");
    return;
  }
  using Dot = float (*)(const void*, const cpu::BlockQ8Act*, int64_t);
  const std::pair<DType, Dot> kernels[] = {{DType::kQ4_0, cpu::avx2::dot_q4_0},     {DType::kQ4_1, cpu::avx2::dot_q4_1},
                                           {DType::kQ5_0, cpu::avx2::dot_q5_0},     {DType::kQ5_1, cpu::avx2::dot_q5_1},
                                           {DType::kIQ4_NL, cpu::avx2::dot_iq4_nl}, {DType::kMXFP4, cpu::avx2::dot_mxfp4},
                                           {DType::kQ8_0, cpu::avx2::dot_q8_0}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::pair<DType, Dot>> all(std::begin(kernels), std::end(kernels));
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    all.push_back({DType::kMXFP4, cpu::avx512vnni::dot_mxfp4});  // eight blocks a step, the rest by AVX2
    all.push_back({DType::kIQ4_NL, cpu::avx512vnni::dot_iq4_nl});
    all.push_back({DType::kQ8_0, cpu::avx512vnni::dot_q8_0});
  }
  for (const auto& [t, dot] : all) {
    const QuantFormat& f = *quant_format(t);
    for (int64_t n : {32, 224, 288, 2880}) {
      INFO(f.name << ", " << n << " elements");
      std::vector<float> w0(n), x(n), w(n);
      for (float& v : w0) v = normal(rng);
      for (float& v : x) v = normal(rng);
      std::vector<uint8_t> row(static_cast<size_t>(n / 32 * f.block_bytes));
      quantizer(t)(w0.data(), row.data(), n / 32);
      f.dequantize(row.data(), w.data(), n / 32);
      const int64_t nb = (n + 255) / 256;
      std::vector<float> padded(nb * 256, 0.0f);
      std::copy(x.begin(), x.end(), padded.begin());
      std::vector<cpu::BlockQ8Act> xq(nb);
      cpu::avx2::quantize_act(padded.data(), nb * 256, xq.data());
      double exact = 0, magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double a = double(xq[i / 256].d) * xq[i / 256].q[i % 256];
        exact += double(w[i]) * a;
        magnitude += std::abs(double(w[i]) * a);
      }
      const float got = dot(row.data(), xq.data(), n / 32);
      INFO(got << " vs " << exact);
      CHECK(std::abs(got - exact) <= 1e-5 * magnitude + 1e-30);
    }
  }
}

namespace {

// Relative RMS error of quantizing x with format f and reading it back (combs' dequantizer,
// itself checked against the reference above); the blocks also go through the reference.
double roundtrip_error(const QuantFormat& f, const std::vector<float>& x) {
  std::vector<uint8_t> blocks(static_cast<size_t>(x.size() / f.block_elems) * f.block_bytes, 0xA5);
  quantizer(f.dtype)(x.data(), blocks.data(), static_cast<int64_t>(x.size() / f.block_elems));
  check_bit_exact(f, blocks);  // combs-made blocks read by the independent reference
  const std::vector<float> y = dequantized(f, blocks);
  double e = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) e += double(x[i] - y[i]) * (x[i] - y[i]), n += double(x[i]) * x[i];
  return std::sqrt(e / n);
}

}  // namespace

TEST_CASE("every block format's quantizer writes blocks the numpy reference reads within its error bound",
          "[backend][quant]") {
  // The bound of each format: the relative RMS error of uniform rounding with its step over
  // normal data (the step of b bits over about +-3 sigma of a block is 6 sigma / 2^b, its RMS
  // error step / sqrt(12)), doubled for the scales' own rounding and the blocks' outliers; the
  // 4-bit non-uniform IQ4 levels as 4 bits, MXFP4's power-of-two scale as 3 bits.
  auto bound = [](DType t) {
    const double bits = t == DType::kQ8_0 ? 8 : t == DType::kQ6_K ? 6 : t == DType::kQ5_0 || t == DType::kQ5_1 || t == DType::kQ5_K ? 5
                        : t == DType::kQ3_K ? 3 : t == DType::kQ2_K ? 2 : t == DType::kMXFP4 ? 3 : 4;
    return 2.0 * 6.0 / std::pow(2.0, bits) / std::sqrt(12.0);
  };
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const QuantFormat& f : quant_formats()) {
    REQUIRE(quantizer(f.dtype) != nullptr);
    std::vector<float> gauss(256 * 64), flat(256 * 64), spiky(256 * 64);
    for (auto& v : gauss) v = normal(rng) * 0.02f;
    for (auto& v : flat) v = uniform(rng) + 0.5f;  // all of one sign: the offsets' case
    for (size_t i = 0; i < spiky.size(); ++i) spiky[i] = (i % 97 == 0 ? 40.0f : 1.0f) * normal(rng);
    const double eg = roundtrip_error(f, gauss), ef = roundtrip_error(f, flat), es = roundtrip_error(f, spiky);
    CAPTURE(f.name);
    INFO(f.name << ": relative RMS error " << eg << " (normal), " << ef << " (one-signed), " << es << " (outliers); bound "
                << bound(f.dtype));
    CHECK(eg <= bound(f.dtype));
    CHECK(ef <= bound(f.dtype));
    CHECK(es <= bound(f.dtype));
    // Zeros stay zero (no division by a zero scale).
    std::vector<uint8_t> zb(static_cast<size_t>(256 / f.block_elems) * f.block_bytes, 0xA5);
    quantizer(f.dtype)(std::vector<float>(256, 0.0f).data(), zb.data(), 256 / f.block_elems);
    for (float v : dequantized(f, zb)) CHECK(v == 0.0f);
  }
}

TEST_CASE("the int8 prefill products equal the exact sums over the rounded activations in any batch",
          "[backend][quant]") {
  // quant_gemm.h: tokens in tiles of 16 lanes, rows in fours, activations rounded per 256 as for
  // decode. Every output against float64 of the dequantized weights (bit-exact against the NumPy
  // reference above) times the rounded activations; a token's outputs bit for bit the same
  // computed alone, in a tile with others, or in the last partial tile.
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))) {
    WARN("skipped: this CPU has no AVX-512 VNNI");
    return;
  }
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (DType t : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kIQ4_XS, DType::kQ8_0}) {
    const QuantFormat& f = *quant_format(t);
    REQUIRE(cpu::avx512vnni::gemm_supports(t));
    for (int64_t in : {256, 768}) {
      const int64_t out = 7, nb = in / 256, row_bytes = in / f.block_elems * f.block_bytes;
      // Rows: llama-quantize's blocks where there are enough, else random ones; one row scaled 100x.
      std::vector<uint8_t> w = read_bytes(std::string(COMBS_TEST_DATA_DIR) + "/quant/" + std::string(f.name) + ".bin");
      std::vector<uint8_t> more = random_blocks(f, static_cast<int>(out * in / f.block_elems), 13);
      w.insert(w.end(), more.begin(), more.end());
      w.resize(static_cast<size_t>(out * row_bytes));
      std::vector<float> wf(out * in);
      f.dequantize(w.data(), wf.data(), out * in / f.block_elems);
      std::vector<float> bias(out);
      for (float& b : bias) b = normal(rng);
      std::vector<cpu::avx512vnni::PackedBlock> packed((out + 3) / 4 * 4 * nb);
      cpu::avx512vnni::pack_rows(t, w.data(), row_bytes, out, in, packed.data());
      for (int64_t n : {1, 5, 16, 17, 50}) {
        INFO(f.name << ", rows of " << in << ", " << n << " tokens");
        std::vector<float> x(n * in);
        for (int64_t i = 0; i < n * in; ++i) x[i] = normal(rng) * ((i / in) % 3 == 0 ? 100.0f : 1.0f);
        std::vector<cpu::BlockQ8Act> xq(n * nb);
        for (int64_t i = 0; i < n; ++i) cpu::avx512vnni::quantize_act(x.data() + i * in, in, xq.data() + i * nb);
        const int64_t tiles = (n + 15) / 16;
        std::vector<cpu::avx512vnni::ActTile> xt(tiles * nb);
        for (int64_t i = 0; i < tiles; ++i) cpu::avx512vnni::pack_act_tile(xq.data(), n, nb, i, xt.data() + i * nb);
        // y with a stride wider than the rows: the gaps and the row past the last must stay poisoned.
        const int64_t ldy = out + 2;
        std::vector<float> y(n * ldy + 1, std::nanf("0x5a5a"));
        cpu::avx512vnni::gemm(t, packed.data(), out, xt.data(), tiles, n, nb, y.data(), ldy, bias.data());
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t r = 0; r < ldy; ++r) {
            if (r >= out) {
              CHECK(std::isnan(y[i * ldy + r]));
              continue;
            }
            double exact = bias[r], magnitude = std::abs(bias[r]);
            for (int64_t e = 0; e < in; ++e) {
              const cpu::BlockQ8Act& a = xq[i * nb + e / 256];
              const double p = double(wf[r * in + e]) * double(a.d) * a.q[e % 256];
              exact += p;
              magnitude += std::abs(p);
            }
            INFO("token " << i << ", row " << r << ": " << y[i * ldy + r] << " vs " << exact);
            CHECK(std::abs(y[i * ldy + r] - exact) <= 1e-5 * magnitude + 1e-30);
          }
        }
        CHECK(std::isnan(y[n * ldy]));
        // The decode kernels' numbers, bit for bit (the runner's batch-invariant policy relies on it).
        if (cpu::avx512vnni::gemm_matches_decode(t)) {
          using Dot = float (*)(const void*, const cpu::BlockQ8Act*, int64_t);
          using Dot4 = void (*)(const void*, size_t, const cpu::BlockQ8Act*, int64_t, float*);
          const Dot4 dot4 = t == DType::kQ4_K   ? cpu::avx512vnni::dot4_q4_k
                            : t == DType::kQ5_K ? cpu::avx512vnni::dot4_q5_k
                            : t == DType::kQ6_K ? cpu::avx512vnni::dot4_q6_k
                            : t == DType::kIQ4_XS ? cpu::avx512vnni::dot4_iq4_xs
                                                : cpu::avx512vnni::dot4_q8_0;
          // One row: the single-row kernel, or for Q8_0 the four-row one on four copies of it.
          const Dot dot1 = t == DType::kQ4_K   ? cpu::avx512vnni::dot_q4_k
                           : t == DType::kQ5_K ? cpu::avx512vnni::dot_q5_k
                           : t == DType::kQ6_K ? cpu::avx512vnni::dot_q6_k
                           : t == DType::kIQ4_XS ? cpu::avx512vnni::dot_iq4_xs
                                                : nullptr;
          const int64_t count = in / f.block_elems;  // super-blocks, or Q8_0's blocks of 32
          auto dot = [&](const void* row, const cpu::BlockQ8Act* a) {
            if (dot1) return dot1(row, a, count);
            float o[4];
            dot4(row, 0, a, count, o);
            return o[0];
          };
          std::vector<cpu::BlockQ8Act> arranged = xq;
          if (t == DType::kQ4_K || t == DType::kQ5_K) cpu::avx512vnni::arrange_act_k4(arranged.data(), n * nb);
          size_t differ = 0;
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t r = 0; r < out; ++r) {
              const float d = dot(w.data() + r * row_bytes, arranged.data() + i * nb) + bias[r];
              differ += std::memcmp(&d, &y[i * ldy + r], 4) != 0;
            }
          }
          CHECK(differ == 0);
          // Four rows a call: the same bits again.
          size_t differ4 = 0;
          for (int64_t i = 0; i < n; ++i) {
            float d4[4];
            dot4(w.data() + row_bytes, row_bytes, arranged.data() + i * nb, count, d4);  // rows 1-4
            for (int j = 0; j < 4; ++j) {
              const float d = d4[j] + bias[1 + j];
              differ4 += std::memcmp(&d, &y[i * ldy + 1 + j], 4) != 0;
            }
          }
          CHECK(differ4 == 0);
        }
        // Each token alone: the same bits.
        size_t differ = 0;
        for (int64_t i = 0; i < n; ++i) {
          std::vector<cpu::avx512vnni::ActTile> one(nb);
          cpu::avx512vnni::pack_act_tile(xq.data() + i * nb, 1, nb, 0, one.data());
          std::vector<float> y1(out);
          cpu::avx512vnni::gemm(t, packed.data(), out, one.data(), 1, 1, nb, y1.data(), out, bias.data());
          differ += std::memcmp(y1.data(), y.data() + i * ldy, out * sizeof(float)) != 0;
        }
        CHECK(differ == 0);
      }
    }
  }
}
