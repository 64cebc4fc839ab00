// combs-bench: benchmark programs (never timed assertions in tests). Each subcommand prints a
// Markdown table with its figures and the bound or baseline measured in the same run.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <string>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/base/status.h"
#include "combs/engine/engine.h"
#include "combs/model/random_model.h"

namespace combs::tools {
class Flags;
}

namespace combs::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v);

// The process's resident memory (VmRSS of /proc/self/status), bytes; 0 where unknown.
int64_t resident_bytes();

// A comma-separated list flag ("a,b,,c") as its non-empty items.
std::vector<std::string> split_list(const std::string& s);

// Median GB/s of summing a buffer of `bytes` (larger than the caches) on all of the backend's
// threads: the memory-bandwidth bound that results are compared with.
double measure_read_bandwidth(CpuBackend& backend, int64_t bytes, int reps);

// The --vocab flag of the model benchmarks: a vocabulary GGUF whose tokenizer the random-weight
// models copy. Default: Llama 3's 128,256 tokens (installed beside the binary, share/combs), so the
// output matrix has the real shape's size; "none": the built-in 259-token byte-level vocabulary.
inline constexpr const char* kVocabHelp =
    "vocabulary GGUF of the random-weight models (default: Llama 3's 128,256 tokens from share/combs beside the "
    "binary); none: the built-in 259-token vocabulary";
// The flag's value as RandomModelOptions::vocab_path (empty for "none"), checked to exist.
StatusOr<std::string> bench_vocab(const std::string& flag);

// The random-weight model DIR/SHAPE-DTYPE-VOCAB.gguf (VOCAB: the vocabulary file's stem, or
// "v259" for the built-in one), written there once (write_random_model_once) and reused by later
// runs and by the peer, which reads the same files.
StatusOr<std::string> bench_model(const std::string& dir, const std::string& shape, const std::string& dtype,
                                  const std::string& vocab_path);
// The model a benchmark runs: --model, or else the random-weight model of --shape, --dtype and
// --vocab in --dir (bench_model).
StatusOr<std::string> bench_model_flag(const tools::Flags& flags);
// --device checked: cpu, or cuda where this build has CUDA.
Status check_bench_device(const std::string& device);
// The random-weight model of `options` as DIR/NAME.gguf, written there once (bench_model's, and
// the benchmarks' that change a shape first).
StatusOr<std::string> bench_model_file(const std::string& dir, const RandomModelOptions& options, const std::string& name);

// A greedy request of `input` for max_tokens tokens that does not stop at an end of generation:
// the benchmarks' requests.
GenerateRequest greedy_request(std::vector<int32_t> input, int max_tokens);

int run_kv(int argc, char** argv);
int run_model(int argc, char** argv);
int run_tokenizer(int argc, char** argv);
int run_engine(int argc, char** argv);
int run_prefix(int argc, char** argv);
int run_journal(int argc, char** argv);
int run_resume(int argc, char** argv);
int run_spec(int argc, char** argv);
int run_window(int argc, char** argv);
int run_gpu(int argc, char** argv);  // where built with CUDA

}  // namespace combs::bench
