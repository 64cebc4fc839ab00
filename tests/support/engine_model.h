// A tiny model file for engine tests, and engines on it.
#pragma once

#include <catch2/catch.hpp>

#include <memory>
#include <string>

#include "combs/engine/engine.h"
#include "combs/model/random_model.h"
#include "support/temp_dir.h"

namespace combs::testing {

// A tiny random-weight model file (seed 3) and engines on it (2 threads, a 64 MiB pool unless the
// options set another budget).
struct ModelFile {
  TempDir dir;
  std::string path;
  // weights: bf16, or a llama.cpp file type such as q4_k_m (Q4_K with Q6_K on the output and on
  // some layers' attn_v and ffn_down, quantized by combs). shape: random_model.h's tiny shapes.
  explicit ModelFile(const std::string& weights = "bf16", const std::string& shape = "tiny") {
    RandomModelOptions o;
    o.shape = std::move(named_shape(shape)).value();
    REQUIRE(set_weight_type(weights, &o).ok());
    o.seed = 3;
    path = dir.file("tiny.gguf");
    REQUIRE(write_random_model(o, path).ok());
  }
  std::unique_ptr<Engine> engine(EngineOptions eo = {}) const {
    eo.threads = 2;
    if (eo.kv_memory_bytes == (int64_t{1} << 30)) eo.kv_memory_bytes = 64 << 20;
    auto m = Model::load(path);
    REQUIRE(m.ok());
    auto e = Engine::create(std::move(m).value(), eo);
    REQUIRE(e.ok());
    return std::move(e).value();
  }
};

}  // namespace combs::testing
