#include "combs/engine/journal.h"

namespace combs {

nlohmann::ordered_json sampling_to_json(const SamplingParams& p) {
  nlohmann::ordered_json bias = nlohmann::ordered_json::array();
  for (const auto& [id, b] : p.logit_bias) bias.push_back({id, b});
  return {{"temperature", p.temperature},
          {"top_k", p.top_k},
          {"top_p", p.top_p},
          {"min_p", p.min_p},
          {"repetition_penalty", p.repetition_penalty},
          {"presence_penalty", p.presence_penalty},
          {"frequency_penalty", p.frequency_penalty},
          {"penalty_last_n", p.penalty_last_n},
          {"logit_bias", std::move(bias)},
          {"seed", p.seed}};
}

StatusOr<SamplingParams> sampling_from_json(const nlohmann::ordered_json& j) {
  if (!j.is_object()) return invalid_argument_error("sampling: not a JSON object");
  SamplingParams p;
  auto number = [&](const char* key, float* out) -> Status {
    if (!j.contains(key)) return ok_status();
    if (!j[key].is_number()) return invalid_argument_error(std::string("sampling: ") + key + " is not a number");
    *out = j[key].get<float>();
    return ok_status();
  };
  auto integer = [&](const char* key, auto* out) -> Status {
    if (!j.contains(key)) return ok_status();
    if (!j[key].is_number_integer()) return invalid_argument_error(std::string("sampling: ") + key + " is not an integer");
    *out = j[key].get<std::decay_t<decltype(*out)>>();
    return ok_status();
  };
  COMBS_RETURN_IF_ERROR(number("temperature", &p.temperature));
  COMBS_RETURN_IF_ERROR(integer("top_k", &p.top_k));
  COMBS_RETURN_IF_ERROR(number("top_p", &p.top_p));
  COMBS_RETURN_IF_ERROR(number("min_p", &p.min_p));
  COMBS_RETURN_IF_ERROR(number("repetition_penalty", &p.repetition_penalty));
  COMBS_RETURN_IF_ERROR(number("presence_penalty", &p.presence_penalty));
  COMBS_RETURN_IF_ERROR(number("frequency_penalty", &p.frequency_penalty));
  COMBS_RETURN_IF_ERROR(integer("penalty_last_n", &p.penalty_last_n));
  COMBS_RETURN_IF_ERROR(integer("seed", &p.seed));
  if (j.contains("logit_bias")) {
    if (!j["logit_bias"].is_array()) return invalid_argument_error("sampling: logit_bias is not an array");
    for (const auto& e : j["logit_bias"]) {
      if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() || !e[1].is_number()) {
        return invalid_argument_error("sampling: a logit_bias entry is not [token, bias]");
      }
      p.logit_bias.emplace_back(e[0].get<int32_t>(), e[1].get<float>());
    }
  }
  return p;
}

}  // namespace combs
