// Helpers shared by the combs-bench subcommands.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/model/random_model.h"
#include "common/flags.h"

namespace combs::bench {

int64_t resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;  // "VmRSS:  123 kB"
  }
  return 0;
}

// Median GB/s of summing a buffer much larger than the caches, split over the backend's threads.
double measure_read_bandwidth(CpuBackend& backend, int64_t bytes, int reps) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  auto buf = backend.alloc({n}, DType::kF32);
  if (!buf.ok()) return 0.0;
  float* data = buf->data_as<float>();
  for (int64_t i = 0; i < n; ++i) data[i] = float(i & 1023);
  const int64_t parts = backend.num_threads() * 4;
  std::vector<float> sums(parts);
  std::vector<double> rates;
  for (int r = 0; r < reps + 1; ++r) {
    const double t0 = now_seconds();
    backend.parallel_for(parts, [&](int64_t p) {
      const float* d = data;  // a local copy: through the capture the loop does not vectorize
      const int64_t begin = n * p / parts, end = n * (p + 1) / parts;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = begin; i < end; ++i) s += d[i];
      sums[p] = s;
    });
    const double dt = now_seconds() - t0;
    if (r > 0) rates.push_back(double(bytes) / dt / 1e9);  // the first run warms up
  }
  return median(rates);
}

// "a,b,,c" -> {"a", "b", "c"}: empty items are dropped.
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

StatusOr<std::string> bench_vocab(const std::string& flag) {
  if (flag == "none") return std::string();
  if (flag.empty()) {
    return invalid_argument_error(
        "no default vocabulary: share/combs/ggml-vocab-llama-bpe.gguf is not beside the binary; pass --vocab PATH "
        "(e.g. tests/data/vocab/ggml-vocab-llama-bpe.gguf) or --vocab none");
  }
  std::error_code ec;
  if (!std::filesystem::is_regular_file(flag, ec)) return not_found_error("--vocab " + flag + ": no such file");
  return flag;
}

StatusOr<std::string> bench_model(const std::string& dir, const std::string& shape, const std::string& dtype,
                                  const std::string& vocab_path) {
  RandomModelOptions o;
  COMBS_ASSIGN_OR_RETURN(o.shape, named_shape(shape));
  COMBS_RETURN_IF_ERROR(set_weight_type(dtype, &o));
  o.vocab_path = vocab_path;
  const std::string stem = vocab_path.empty() ? "v259" : std::filesystem::path(vocab_path).stem().string();
  return bench_model_file(dir, o, shape + "-" + dtype + "-" + stem);
}

StatusOr<std::string> bench_model_flag(const tools::Flags& flags) {
  if (!flags.str("model").empty()) return flags.str("model");
  COMBS_ASSIGN_OR_RETURN(std::string vocab, bench_vocab(flags.str("vocab")));
  return bench_model(flags.str("dir"), flags.str("shape"), flags.str("dtype"), vocab);
}

Status check_bench_device(const std::string& device) {
  if (device != "cpu" && device != "cuda") return invalid_argument_error("--device cpu or cuda, not '" + device + "'");
#ifndef COMBS_HAVE_CUDA
  if (device == "cuda") return invalid_argument_error("--device cuda: this build has no CUDA");
#endif
  return ok_status();
}

StatusOr<std::string> bench_model_file(const std::string& dir, const RandomModelOptions& options, const std::string& name) {
  const std::string path = dir + "/" + name + ".gguf";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  COMBS_RETURN_IF_ERROR(write_random_model_once(options, path));
  return path;
}

GenerateRequest greedy_request(std::vector<int32_t> input, int max_tokens) {
  GenerateRequest r;
  r.input = std::move(input);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling = SamplingParams{};
  r.sampling->temperature = 0.0f;
  return r;
}

}  // namespace combs::bench
