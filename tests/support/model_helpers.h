// A tiny random model written to a temp dir, loaded, with a backend and a runner.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/contiguous_kv_cache.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/model/random_model.h"
#include "combs/model/runner.h"
#include "support/temp_dir.h"

namespace combs::testing {

// A model file of the test data (tests/data/models), for TinyModel.
struct ModelFile {
  std::string path;
};

struct TinyModel {
  TinyModel(const std::string& shape, DType dtype, uint64_t seed = 7, RunnerOptions ro = {})
      : backend({2}) {
    RandomModelOptions o;
    o.shape = std::move(named_shape(shape)).value();
    o.dtype = dtype;
    o.seed = seed;
    path = dir.file(shape + ".gguf");
    REQUIRE(write_random_model(o, path).ok());
    load(ro);
  }
  explicit TinyModel(const RandomModelOptions& o, RunnerOptions ro = {}) : backend({2}) {
    path = dir.file(o.shape.name + ".gguf");
    REQUIRE(write_random_model(o, path).ok());
    load(ro);
  }
  explicit TinyModel(ModelFile file, RunnerOptions ro = {}) : path(std::move(file.path)), backend({2}) { load(ro); }
  std::unique_ptr<PagedKVCache> cache(int64_t max_len = 1024) {
    return std::move(PagedKVCache::create(*pool, max_len)).value();
  }
  int n_vocab() const { return model->config().n_vocab; }

  TempDir dir;
  std::string path;
  CpuBackend backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<Runner> runner;
  std::unique_ptr<PagePool> pool;

 private:
  void load(RunnerOptions ro) {
    auto m = Model::load(path);
    INFO(path << ": " << (m.ok() ? "" : m.status().to_string()));
    REQUIRE(m.ok());
    model = std::move(m).value();
    runner = std::move(Runner::create(*model, backend, ro)).value();
    PagePoolOptions po{model->config().kv_geometry(DType::kF32), 16, 256};
    pool = std::move(PagePool::create(backend, po)).value();
  }
};

// The block-quantized files of the test data, relative to data_dir/models: the two mixes that
// llama.cpp's llama-quantize made (every block type, in per-tensor mixes as real files have), then
// its 20 presets (data_dir/models/presets: one type a file mostly, Q4_K_M .. Q2_K of llama and
// qwen2, and a shape whose rows fall back to Q5_0 / Q8_0 / IQ4_NL / Q4_0), sorted. README there.
inline std::vector<std::string> quantized_test_models(const std::string& data_dir) {
  std::vector<std::string> files = {"tiny-mix-a.gguf", "qwen2-tiny-mix-b.gguf"};
  std::vector<std::string> presets;
  for (const auto& e : std::filesystem::directory_iterator(data_dir + "/models/presets"))
    if (e.path().extension() == ".gguf") presets.push_back("presets/" + e.path().filename().string());
  std::sort(presets.begin(), presets.end());
  CHECK(presets.size() == 20);
  files.insert(files.end(), presets.begin(), presets.end());
  return files;
}

}  // namespace combs::testing
