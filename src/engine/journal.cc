#include "combs/engine/journal.h"

#include <cstring>

#include "combs/base/sha256.h"

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

namespace {
constexpr std::string_view kMagic = "COMBSSES";
constexpr uint32_t kBlobVersion = 1;

void put_u32(std::string& out, uint32_t v) {
  for (int b = 0; b < 4; ++b) out.push_back(static_cast<char>(v >> (8 * b)));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int b = 0; b < 4; ++b) v |= uint32_t{static_cast<uint8_t>(p[b])} << (8 * b);
  return v;
}
}  // namespace

std::string encode_session(const SessionRecord& r, std::string_view model_fingerprint) {
  const nlohmann::ordered_json header = {{"model_fingerprint", std::string(model_fingerprint)},
                                         {"id", r.id},
                                         {"parent", r.parent},
                                         {"owner", r.owner},
                                         {"cache_namespace", r.cache_namespace},
                                         {"sampling", sampling_to_json(r.sampling)},
                                         {"max_context", r.max_context},
                                         {"conversation", r.conversation},
                                         {"length", r.history.size()}};
  const std::string h = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::string out(kMagic);
  put_u32(out, kBlobVersion);
  put_u32(out, static_cast<uint32_t>(h.size()));
  out += h;
  for (int32_t t : r.history) put_u32(out, static_cast<uint32_t>(t));
  const Digest d = Sha256().update(out).finish();
  out.append(reinterpret_cast<const char*>(d.data()), d.size());
  return out;
}

StatusOr<SessionRecord> decode_session(std::string_view blob, std::string_view model_fingerprint) {
  const size_t fixed = kMagic.size() + 8, digest = 32;
  if (blob.size() < fixed + digest || blob.substr(0, kMagic.size()) != kMagic) {
    return invalid_argument_error("import: not a combs session (an ExportSession blob)");
  }
  const std::string_view body = blob.substr(0, blob.size() - digest);
  const Digest d = Sha256().update(body).finish();
  if (std::memcmp(d.data(), blob.data() + body.size(), digest) != 0) {
    return invalid_argument_error("import: the session's checksum does not match (damaged in transit?)");
  }
  if (const uint32_t v = get_u32(blob.data() + kMagic.size()); v != kBlobVersion) {
    return invalid_argument_error("import: session format version " + std::to_string(v) + "; this server reads " +
                                  std::to_string(kBlobVersion));
  }
  const uint32_t header_size = get_u32(blob.data() + kMagic.size() + 4);
  if (header_size > body.size() - fixed) return invalid_argument_error("import: the session's header overruns it");
  const auto header = nlohmann::ordered_json::parse(body.substr(fixed, header_size), nullptr, false);
  if (!header.is_object()) return invalid_argument_error("import: the session's header is not a JSON object");
  auto text = [&](const char* key) {
    return header.contains(key) && header[key].is_string() ? header[key].get<std::string>() : std::string();
  };
  if (text("model_fingerprint") != model_fingerprint) {
    return failed_precondition_error("import: the session belongs to another model (fingerprint " +
                                     text("model_fingerprint").substr(0, 16) + ", this one " +
                                     std::string(model_fingerprint.substr(0, 16)) + ")");
  }
  SessionRecord r;
  r.id = text("id");
  r.parent = text("parent");
  r.owner = text("owner");
  r.cache_namespace = text("cache_namespace");
  COMBS_ASSIGN_OR_RETURN(r.sampling, sampling_from_json(header.contains("sampling") ? header["sampling"] : nlohmann::ordered_json()));
  if (!header.contains("max_context") || !header["max_context"].is_number_integer() || !header.contains("length") ||
      !header["length"].is_number_unsigned()) {
    return invalid_argument_error("import: the session's header lacks max_context or length");
  }
  r.max_context = header["max_context"].get<int64_t>();
  if (header.contains("conversation") && header["conversation"].is_array()) r.conversation = header["conversation"];
  const size_t tokens = body.size() - fixed - header_size;
  if (tokens % 4 != 0 || tokens / 4 != header["length"].get<uint64_t>()) {
    return invalid_argument_error("import: the session's tokens do not match its length");
  }
  const char* p = body.data() + fixed + header_size;
  r.history.resize(tokens / 4);
  for (size_t i = 0; i < r.history.size(); ++i) r.history[i] = static_cast<int32_t>(get_u32(p + 4 * i));
  return r;
}

}  // namespace combs
