// combs-generate: runs a GGUF model on the CPU and prints the generated tokens on stdout
// (timings on stderr).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/model/model.h"
#include "combs/model/runner.h"
#include "combs/model/sampler.h"
#include "combs/model/tokenizer.h"
#include "common/flags.h"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int fail(const std::string& what) {
  std::fprintf(stderr, "combs-generate: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-generate",
                     {{"model", ""}, {"prompt", ""}, {"prompt-ids", ""}, {"max-tokens", "32"},
                      {"temperature", "0.8"}, {"top-k", "40"}, {"top-p", "0.95"}, {"min-p", "0.05"},
                      {"repeat-penalty", "1.0"}, {"presence-penalty", "0"},
                      {"frequency-penalty", "0"}, {"seed", "0"}, {"threads", "0"},
                      {"ctx", "4096"}, {"kv-dtype", "f16"}, {"logits-out", ""}},
                     {"ids", "ignore-eos"});
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("--model PATH (--prompt TEXT | --prompt-ids \"1 2 3\") [--ids] [flags]");
    return 0;
  }
  if (flags.str("model").empty()) return std::fprintf(stderr, "combs-generate: --model PATH is required\n"), 2;
  if (flags.given("prompt") == flags.given("prompt-ids")) {
    return std::fprintf(stderr, "combs-generate: give exactly one of --prompt and --prompt-ids\n"), 2;
  }
  long long max_tokens, top_k, seed, threads, ctx;
  double temperature, top_p, min_p, rep, pres, freq;
  if (!flags.integer("max-tokens", &max_tokens, 0, 1 << 24) ||
      !flags.integer("top-k", &top_k, 0, 1 << 24) || !flags.integer("seed", &seed, 0, 1ll << 62) ||
      !flags.integer("threads", &threads, 0, 1024) || !flags.integer("ctx", &ctx, 1, 1 << 24) ||
      !flags.number("temperature", &temperature) || !flags.number("top-p", &top_p) ||
      !flags.number("min-p", &min_p) || !flags.number("repeat-penalty", &rep) ||
      !flags.number("presence-penalty", &pres) || !flags.number("frequency-penalty", &freq)) {
    return 2;
  }
  DType kv_dtype;
  if (!parse_dtype(flags.str("kv-dtype"), &kv_dtype) || is_block_quant(kv_dtype)) {
    return std::fprintf(stderr, "combs-generate: --kv-dtype must be f32, f16 or bf16\n"), 2;
  }
  std::vector<long long> prompt_ll;
  if (!flags.ints("prompt-ids", &prompt_ll)) return 2;

  auto model = Model::load(flags.str("model"));
  if (!model.ok()) return fail(model.status().to_string());
  const ModelConfig& c = (*model)->config();
  // The tokenizer is needed for text in (--prompt) or out (without --ids).
  std::unique_ptr<Tokenizer> tokenizer;
  if (flags.given("prompt") || !flags.on("ids")) {
    auto t = Tokenizer::from_gguf((*model)->file());
    if (!t.ok()) return fail(t.status().to_string());
    if ((*t)->n_vocab() != c.n_vocab) {
      return fail("the tokenizer has " + std::to_string((*t)->n_vocab()) +
                  " tokens but the model's embedding has " + std::to_string(c.n_vocab));
    }
    tokenizer = std::move(t).value();
  }
  std::vector<int32_t> prompt(prompt_ll.begin(), prompt_ll.end());
  if (flags.given("prompt")) prompt = tokenizer->encode(flags.str("prompt"));
  if (prompt.empty()) return std::fprintf(stderr, "combs-generate: the prompt is empty\n"), 2;
  for (int32_t id : prompt) {
    if (id < 0 || id >= c.n_vocab) {
      return std::fprintf(stderr, "combs-generate: --prompt-ids: %d is outside the vocabulary [0, %d)\n",
                          id, c.n_vocab), 2;
    }
  }
  if (static_cast<long long>(prompt.size()) + max_tokens > ctx) {
    return std::fprintf(stderr, "combs-generate: prompt (%zu) + --max-tokens (%lld) exceed --ctx %lld\n",
                        prompt.size(), max_tokens, ctx), 2;
  }
  SamplingParams sp;
  sp.temperature = static_cast<float>(temperature);
  sp.top_k = static_cast<int>(top_k);
  sp.top_p = static_cast<float>(top_p);
  sp.min_p = static_cast<float>(min_p);
  sp.repetition_penalty = static_cast<float>(rep);
  sp.presence_penalty = static_cast<float>(pres);
  sp.frequency_penalty = static_cast<float>(freq);
  sp.seed = static_cast<uint64_t>(seed);
  if (Status s = validate(sp, c.n_vocab); !s.ok()) return std::fprintf(stderr, "combs-generate: %s\n", s.message().c_str()), 2;

  CpuBackend backend({static_cast<int>(threads)});
  PagePoolOptions po{c.kv_geometry(kv_dtype), 16, pages_for_tokens(ctx, 16)};
  auto pool = PagePool::create(backend, po);
  if (!pool.ok()) return fail(pool.status().to_string());
  auto cache = PagedKVCache::create(**pool, ctx);
  if (!cache.ok()) return fail(cache.status().to_string());
  auto runner = Runner::create(**model, backend);
  if (!runner.ok()) return fail(runner.status().to_string());

  StopCriteria stop;
  stop.max_tokens = static_cast<int>(max_tokens);
  if (!flags.on("ignore-eos")) {  // the vocabulary's end-of-generation tokens
    std::unique_ptr<Tokenizer> vocab;
    const Tokenizer* tok = tokenizer.get();
    if (tok == nullptr) {
      if (auto t = Tokenizer::from_gguf((*model)->file()); t.ok()) tok = (vocab = std::move(t).value()).get();
    }
    if (tok != nullptr) {
      for (int32_t id : tok->end_of_generation())
        if (id < c.n_vocab) stop.eos_ids.push_back(id);
    }
  }

  // Prompt, in chunks of at most 512 tokens; with --logits-out every position's logits are saved.
  const bool save_logits = !flags.str("logits-out").empty();
  std::vector<float> logits(c.n_vocab), all_logits;
  const double t0 = now();
  for (size_t start = 0; start < prompt.size(); start += 512) {
    const size_t n = std::min<size_t>(512, prompt.size() - start);
    const SequenceInput in{cache->get(), {prompt.data() + start, n}};
    std::vector<float> out(save_logits ? n * c.n_vocab : c.n_vocab);
    ForwardOptions fo;
    fo.all_logits = save_logits;
    if (Status s = (*runner)->forward({&in, 1}, out.data(), fo); !s.ok()) {
      return fail(s.to_string());
    }
    if (save_logits) all_logits.insert(all_logits.end(), out.begin(), out.end());
    std::copy(out.end() - c.n_vocab, out.end(), logits.begin());
  }
  const double t_prompt = now() - t0;
  if (save_logits) {
    std::ofstream f(flags.str("logits-out"), std::ios::binary);
    f.write(reinterpret_cast<const char*>(all_logits.data()),
            static_cast<std::streamsize>(all_logits.size() * sizeof(float)));
    if (!f) return fail("cannot write " + flags.str("logits-out"));
  }

  Sampler sampler(sp);
  std::unique_ptr<StreamDecoder> text_out;
  if (!flags.on("ids")) text_out = std::make_unique<StreamDecoder>(*tokenizer);
  std::vector<int32_t> history = prompt, generated;
  FinishReason reason = check_stop(stop, generated);
  const double t1 = now();
  while (reason == FinishReason::kNone) {
    const int32_t token = sampler.sample(logits, history);
    generated.push_back(token);
    history.push_back(token);
    if (text_out) std::fputs(text_out->push(token).c_str(), stdout);
    else std::printf(generated.size() > 1 ? " %d" : "%d", token);
    std::fflush(stdout);
    reason = check_stop(stop, generated);
    if (reason != FinishReason::kNone) break;
    const SequenceInput in{cache->get(), {&token, 1}};
    if (Status s = (*runner)->forward({&in, 1}, logits.data()); !s.ok()) return fail(s.to_string());
  }
  const double t_gen = now() - t1;
  if (text_out) std::fputs(text_out->finish().c_str(), stdout);
  std::printf("\n");
  std::fprintf(stderr,
               "combs-generate: prompt %zu tokens in %.3f s (%.1f tokens/s); generated %zu tokens in "
               "%.3f s (%.2f tokens/s); finish: %s\n",
               prompt.size(), t_prompt, prompt.size() / std::max(t_prompt, 1e-9), generated.size(),
               t_gen, generated.empty() ? 0.0 : generated.size() / std::max(t_gen, 1e-9),
               std::string(finish_reason_name(reason)).c_str());
  return 0;
}
