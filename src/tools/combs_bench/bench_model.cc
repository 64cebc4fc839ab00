// combs-bench model: prompt processing and decode tokens/s of random-weight models, with the
// decode bound (measured read bandwidth / bytes of weights read per token) from the same run.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench.h"
#include "combs/backend/cpu/cpu_ops.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/model/runner.h"
#include "common/data_files.h"
#include "common/flags.h"

namespace combs::bench {
namespace {

struct Figures {
  double prompt_tps, decode_tps, bandwidth_gbs, decode_over_bound;
};

// Median prompt and decode speeds over `reps` fresh sequences. The read bandwidth is measured
// right before each decode run and each run's ratio to its bound taken: the machines are noisy.
StatusOr<Figures> measure(Runner& runner, CpuBackend& backend, int prompt, int gen, int reps,
                          int64_t bandwidth_bytes, double weight_bytes) {
  const ModelConfig& c = runner.model().config();
  const int64_t ctx = prompt + gen + 1;
  PagePoolOptions po{c.kv_geometry(DType::kF16), 16, pages_for_tokens(ctx, 16)};
  COMBS_ASSIGN_OR_RETURN(auto pool, PagePool::create(backend, po));
  std::vector<float> logits(c.n_vocab);
  std::vector<int32_t> tokens(prompt);
  for (int i = 0; i < prompt; ++i) tokens[i] = (i * 7919 + 13) % c.n_vocab;
  std::vector<double> tp, td, bw, ratio;
  for (int r = 0; r < reps + 1; ++r) {  // the first round warms up
    COMBS_ASSIGN_OR_RETURN(auto cache, PagedKVCache::create(*pool, ctx));
    const SequenceInput in{cache.get(), tokens};
    double t0 = now_seconds();
    COMBS_RETURN_IF_ERROR(runner.forward({&in, 1}, logits.data()));
    const double dt_prompt = now_seconds() - t0;
    const double gbs = measure_read_bandwidth(backend, bandwidth_bytes, 3);
    t0 = now_seconds();
    for (int i = 0; i < gen; ++i) {
      const int32_t next = static_cast<int32_t>((i * 31 + 7) % c.n_vocab);
      const SequenceInput one{cache.get(), {&next, 1}};
      COMBS_RETURN_IF_ERROR(runner.forward({&one, 1}, logits.data()));
    }
    const double dt_gen = now_seconds() - t0;
    if (r > 0) {
      tp.push_back(prompt / dt_prompt);
      td.push_back(gen / dt_gen);
      bw.push_back(gbs);
      ratio.push_back(gen / dt_gen / (gbs * 1e9 / weight_bytes));
    }
  }
  return Figures{median(tp), median(td), median(bw), median(ratio)};
}

}  // namespace

int run_model(int argc, char** argv) {
  tools::Flags flags("combs-bench model",
                     {{"shapes", "tiny,llama-1b"}, {"dtypes", "bf16,q8_0"}, {"prompt", "512"},
                      {"gen", "128"}, {"threads", "0"}, {"reps", "3"}, {"bandwidth-mib", "512"},
                      {"dir", "/tmp/combs-bench-models"}, {"vocab", tools::default_vocab()}, {"models", ""}});
  flags.describe({{"vocab", kVocabHelp},
                  {"models", "GGUF files to measure instead of --shapes x --dtypes (e.g. llama-quantize's)"}});
  if (!flags.parse(argc, argv, 2)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("[flags]   (models are written once into --dir and reused)");
    return 0;
  }
  long long prompt, gen, threads, reps, bw_mib;
  if (!flags.integer("prompt", &prompt, 1, 1 << 20) || !flags.integer("gen", &gen, 1, 1 << 20) ||
      !flags.integer("threads", &threads, 0, 1024) || !flags.integer("reps", &reps, 1, 1000) ||
      !flags.integer("bandwidth-mib", &bw_mib, 1, 1 << 20)) {
    return 2;
  }
  auto vocab = bench_vocab(flags.str("vocab"));
  if (!vocab.ok()) return std::fprintf(stderr, "combs-bench model: %s\n", vocab.status().message().c_str()), 2;
  CpuBackend backend({static_cast<int>(threads)});
  std::printf("# combs-bench model: %d threads, matmul %s, prompt %lld tokens, decode %lld tokens, "
              "median of %lld; read bandwidth (%lld MiB, all threads) measured before each decode run; vocabulary %s\n\n",
              backend.num_threads(), std::string(cpu::matmul_isa()).c_str(), prompt, gen, reps, bw_mib,
              vocab->empty() ? "built-in (259 tokens)" : vocab->c_str());
  std::printf("| model | dtype | vocabulary | weights read/token | file's tensors (resident after load / them) "
              "| prompt tok/s | decode tok/s | bandwidth GB/s | decode bound tok/s | decode / bound |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  // (model label, weights label, file): --models' files, else the random models of each shape and type.
  struct Job {
    std::string model, weights, path;
  };
  std::vector<Job> jobs;
  for (const std::string& file : split_list(flags.str("models"))) {
    jobs.push_back({std::filesystem::path(file).stem().string(), "", file});
  }
  for (const std::string& shape_name : jobs.empty() ? split_list(flags.str("shapes")) : std::vector<std::string>()) {
    for (const std::string& dtype_str : split_list(flags.str("dtypes"))) {
      auto path = bench_model(flags.str("dir"), shape_name, dtype_str, *vocab);
      if (!path.ok()) return std::fprintf(stderr, "combs-bench model: %s\n", path.status().message().c_str()), 1;
      jobs.push_back({shape_name, dtype_str, *path});
    }
  }
  for (const Job& job : jobs) {
    {
      std::fprintf(stderr, "combs-bench model: %s\n", job.path.c_str());
      const int64_t rss_before = resident_bytes();
      auto model = Model::load(job.path);
      if (!model.ok()) return std::fprintf(stderr, "combs-bench model: %s\n", model.status().to_string().c_str()), 1;
      auto runner = Runner::create(**model, backend);
      if (!runner.ok()) return std::fprintf(stderr, "combs-bench model: %s\n", runner.status().to_string().c_str()), 1;
      // What loading made resident (the weights' buffer, the runner's tables): blocks stay blocks.
      const double file_bytes = double((*model)->file_tensor_bytes());
      const double loaded = double(resident_bytes() - rss_before);
      const double bytes = double((*model)->weight_bytes_per_token());
      auto f = measure(**runner, backend, int(prompt), int(gen), int(reps), bw_mib << 20, bytes);
      if (!f.ok()) {
        std::fprintf(stderr, "combs-bench: %s\n", f.status().to_string().c_str());
        return 1;
      }
      const std::string weights = job.weights.empty() ? std::string(dtype_name((*model)->layers[0].wq.dtype())) : job.weights;
      std::printf("| %s | %s | %d | %.1f MB | %.1f MB (%.3fx) | %.1f | %.2f | %.1f | %.2f | %.0f%% |\n", job.model.c_str(),
                  weights.c_str(), (*model)->config().n_vocab, bytes / 1e6, file_bytes / 1e6, loaded / file_bytes,
                  f->prompt_tps, f->decode_tps, f->bandwidth_gbs, f->bandwidth_gbs * 1e9 / bytes,
                  100.0 * f->decode_over_bound);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace combs::bench
