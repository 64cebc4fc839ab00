// combs-bench: benchmark programs (never timed assertions in tests). Each subcommand prints a
// Markdown table with its figures and the bound or baseline measured in the same run.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <string>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"

namespace combs::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v);

// A comma-separated list flag ("a,b,,c") as its non-empty items.
std::vector<std::string> split_list(const std::string& s);

// Median GB/s of summing a buffer of `bytes` (larger than the caches) on all of the backend's
// threads: the memory-bandwidth bound that results are compared with.
double measure_read_bandwidth(CpuBackend& backend, int64_t bytes, int reps);

int run_kv(int argc, char** argv);
int run_model(int argc, char** argv);
int run_tokenizer(int argc, char** argv);
int run_engine(int argc, char** argv);
int run_gpu(int argc, char** argv);  // where built with CUDA

}  // namespace combs::bench
