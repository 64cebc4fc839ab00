// Sampling the next token from logits, and the stop conditions of a generation.
//
// Order of operations (llama.cpp's and Hugging Face's): logit bias; repetition, presence and
// frequency penalties over the last penalty_last_n tokens of the history; then greedy argmax when
// temperature == 0, else temperature, top-k, softmax, min-p, top-p and a draw from the sequence's
// own seeded generator (same seed and input, same tokens). Thread-compatible.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "combs/base/status.h"

namespace combs {

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy (argmax, lowest id on ties); else > 0
  int top_k = 0;                    // keep the k most likely; 0: all
  float top_p = 1.0f;               // keep the smallest set with this much mass; 1: all
  float min_p = 0.0f;               // drop tokens below min_p * p(most likely); 0: off
  float repetition_penalty = 1.0f;  // divide positive / multiply negative logits of seen tokens
  float presence_penalty = 0.0f;    // subtract once from every seen token
  float frequency_penalty = 0.0f;   // subtract per occurrence
  int penalty_last_n = 64;          // history window of the penalties; -1: all of it
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits
  uint64_t seed = 0;                // seeds the sequence's generator
};

// Greedy with nothing that changes the logits first (penalties, bias): the argmax of the raw
// logits, which a device runner can pick without sending the logits to the host.
inline bool is_plain_greedy(const SamplingParams& p) {
  return p.temperature == 0.0f && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
         p.frequency_penalty == 0.0f && p.logit_bias.empty();
}

// INVALID_ARGUMENT naming the field for a value out of range (n_vocab bounds logit_bias ids).
Status validate(const SamplingParams& params, int n_vocab);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  const SamplingParams& params() const { return params_; }

  // Picks the next token. logits (n_vocab values) are modified in place; history is the
  // sequence's tokens so far (prompt and generated) for the penalties.
  int32_t sample(std::span<float> logits, std::span<const int32_t> history);
  // Speculative decoding's check of a drafted token (a deterministic draft: a point mass), with
  // the same inputs as sample(): takes `draft` with the probability sample() would pick it (*accepted
  // true), else a token drawn from the rest of that distribution, renormalized without the draft —
  // so the token returned is distributed exactly as sample()'s. Greedy: the argmax, accepted when it
  // is the draft.
  int32_t verify(std::span<float> logits, std::span<const int32_t> history, int32_t draft, bool* accepted);

  // The pieces a device sampler needs to do what sample() does (cuda::sample_rows):
  // the draw sample() would take next (advances the generator; only when temperature > 0 does
  // sample() take one) ...
  double uniform();  // [0, 1), from the sequence's generator
  uint64_t generator_state() const { return state_; }
  void set_generator_state(uint64_t state) { state_ = state; }
  // ... and the penalty window's distinct tokens with their counts (empty when no penalty is
  // set; tokens outside [0, n_vocab) are skipped).
  void penalized(std::span<const int32_t> history, int n_vocab, std::vector<std::pair<int32_t, int32_t>>* out);

 private:
  // Logit bias and penalties, in place.
  void adjust(std::span<float> logits, std::span<const int32_t> history);
  // Temperature, top-k, softmax, min-p and top-p into candidates_ (probability, token), most likely
  // first; returns their total probability.
  double keep_candidates(std::span<const float> logits);

  SamplingParams params_;
  uint64_t state_;
  std::vector<std::pair<float, int32_t>> candidates_;
  std::vector<int> counts_;  // per token, zero between calls
  std::vector<std::pair<int32_t, int32_t>> penalized_;
};

enum class FinishReason : uint8_t { kNone, kLength, kEos, kStopSequence };
std::string_view finish_reason_name(FinishReason r);  // "none", "length", "eos", "stop"

struct StopCriteria {
  int max_tokens = 256;                           // generated tokens at most
  std::vector<int32_t> eos_ids;                   // end-of-sequence tokens (kept in the output)
  std::vector<std::vector<int32_t>> stop_sequences;  // token-id sequences that end generation
};

// Whether generation ends after `generated` (the tokens generated so far, the newest last).
FinishReason check_stop(const StopCriteria& stop, std::span<const int32_t> generated);

}  // namespace combs
