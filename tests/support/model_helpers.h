// A tiny random model written to a temp dir, loaded, with a backend and a runner.
#pragma once

#include <catch2/catch.hpp>

#include <memory>
#include <string>

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

}  // namespace combs::testing
