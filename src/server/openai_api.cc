#include "openai_api.h"

#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "combs/base/sha256.h"
#include "log.h"

namespace combs::server {

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr int kMaxJsonDepth = 64;

// Invalid UTF-8 (a token that ends mid-character at the end of a reply) becomes U+FFFD rather
// than an exception.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

// ---- Errors ----

struct ApiError {
  int http = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault; empty: null
  std::string code;   // empty: null
};

namespace {

ApiError bad_request(std::string message, std::string param = "", std::string code = "") {
  return {400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
}

// An engine error as OpenAI's statuses and types.
ApiError api_error(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition: return bad_request(s.message());
    case StatusCode::kUnauthenticated: return {401, s.message(), "invalid_request_error", "", "invalid_api_key"};
    case StatusCode::kNotFound: return {404, s.message(), "invalid_request_error", "", ""};
    case StatusCode::kResourceExhausted: return {429, s.message(), "server_overloaded", "", "server_busy"};
    case StatusCode::kUnavailable: return {503, s.message(), "server_error", "", "unavailable"};
    default: return {500, s.message(), "server_error", "", ""};
  }
}

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http;
  res.set_content(dump(error_json(e)), "application/json");
}

// The status code a metric counts an HTTP status as.
StatusCode metric_code(int http) {
  switch (http) {
    case 200: return StatusCode::kOk;
    case 400: return StatusCode::kInvalidArgument;
    case 401: return StatusCode::kUnauthenticated;
    case 404: return StatusCode::kNotFound;
    case 413: case 429: return StatusCode::kResourceExhausted;
    case 503: return StatusCode::kUnavailable;
    default: return StatusCode::kInternal;
  }
}

std::string random_hex(int digits) {
  thread_local std::mt19937_64 gen{std::random_device{}()};
  std::string s;
  while (static_cast<int>(s.size()) < digits) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(gen()));
    s += buf;
  }
  return s.substr(0, digits);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- Request fields ----

// What chat and text completions share.
struct Params {
  std::string model;
  int n = 1;
  bool stream = false;
  bool include_usage = false;
  std::optional<int64_t> max_tokens;
  SamplingParams sampling;
  bool seeded = false;
  std::vector<std::string> stop;
};

std::optional<ApiError> number_in(const json& body, const char* key, double lo, double hi, bool lo_open, float* out) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number()) return bad_request(std::string(key) + " must be a number", key);
  const double x = v.get<double>();
  if (x > hi || x < lo || (lo_open && x == lo)) {
    return bad_request(std::string(key) + " must be in " + (lo_open ? "(" : "[") + std::to_string(lo).substr(0, 4) + ", " +
                           std::to_string(hi).substr(0, 4) + "], got " + v.dump(),
                       key);
  }
  *out = static_cast<float>(x);
  return std::nullopt;
}

std::optional<ApiError> read_params(const json& body, const OpenAiOptions& o, int n_vocab, Params* p) {
  if (!body.contains("model") || !body["model"].is_string()) return bad_request("model is required (a string)", "model");
  p->model = body["model"].get<std::string>();
  if (p->model != o.model_id) {
    return ApiError{404, "The model '" + p->model + "' does not exist; this server serves '" + o.model_id + "'",
                    "invalid_request_error", "model", "model_not_found"};
  }
  if (body.contains("n") && !body["n"].is_null()) {
    if (!body["n"].is_number_integer() || body["n"].get<int64_t>() < 1 || body["n"].get<int64_t>() > o.max_choices) {
      return bad_request("n must be an integer in [1, " + std::to_string(o.max_choices) + "]", "n");
    }
    p->n = body["n"].get<int>();
  }
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean()) return bad_request("stream must be a boolean", "stream");
    p->stream = body["stream"].get<bool>();
  }
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!p->stream) return bad_request("stream_options is only allowed with stream: true", "stream_options");
    if (!so.is_object()) return bad_request("stream_options must be an object", "stream_options");
    if (so.contains("include_usage")) {
      if (!so["include_usage"].is_boolean()) return bad_request("stream_options.include_usage must be a boolean", "stream_options");
      p->include_usage = so["include_usage"].get<bool>();
    }
  }
  for (const char* key : {"max_completion_tokens", "max_tokens"}) {  // the newer name wins
    if (p->max_tokens || !body.contains(key) || body[key].is_null()) continue;
    if (!body[key].is_number_integer() || body[key].get<int64_t>() < 1) {
      return bad_request(std::string(key) + " must be an integer >= 1", key);
    }
    p->max_tokens = body[key].get<int64_t>();
  }
  SamplingParams& s = p->sampling;
  s.temperature = 1.0f;  // OpenAI's defaults
  s.top_p = 1.0f;
  if (auto e = number_in(body, "temperature", 0, 2, false, &s.temperature)) return e;
  if (auto e = number_in(body, "top_p", 0, 1, true, &s.top_p)) return e;
  if (auto e = number_in(body, "frequency_penalty", -2, 2, false, &s.frequency_penalty)) return e;
  if (auto e = number_in(body, "presence_penalty", -2, 2, false, &s.presence_penalty)) return e;
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) return bad_request("seed must be an integer", "seed");
    s.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>()
                                                : static_cast<uint64_t>(body["seed"].get<int64_t>());
    p->seeded = true;
  }
  if (body.contains("logit_bias") && !body["logit_bias"].is_null()) {
    const json& lb = body["logit_bias"];
    if (!lb.is_object()) return bad_request("logit_bias must be an object of token id to bias", "logit_bias");
    if (lb.size() > 1024) return bad_request("logit_bias holds more than 1024 tokens", "logit_bias");
    for (const auto& [key, value] : lb.items()) {
      int64_t id = -1;
      size_t used = 0;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || id < 0 || id >= n_vocab) {
        return bad_request("logit_bias: '" + key + "' is not a token id in [0, " + std::to_string(n_vocab) + ")", "logit_bias");
      }
      if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100) {
        return bad_request("logit_bias: the bias of token " + key + " must be a number in [-100, 100]", "logit_bias");
      }
      s.logit_bias.emplace_back(static_cast<int32_t>(id), value.get<float>());
    }
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) {
      p->stop.push_back(st.get<std::string>());
    } else if (st.is_array() && st.size() <= 4) {
      for (const json& x : st) {
        if (!x.is_string()) return bad_request("stop must be a string or an array of up to 4 strings", "stop");
        p->stop.push_back(x.get<std::string>());
      }
    } else {
      return bad_request("stop must be a string or an array of up to 4 strings", "stop");
    }
    for (const std::string& x : p->stop) {
      if (x.empty()) return bad_request("stop strings must not be empty", "stop");
    }
  }
  if (body.contains("logprobs") && !body["logprobs"].is_null() && body["logprobs"] != false) {
    return bad_request("logprobs is not supported", "logprobs");
  }
  return std::nullopt;
}

// Chat messages as the template reads them: text content (an array of text parts is joined),
// "developer" as "system" (templates know the older name).
std::optional<ApiError> read_messages(const json& body, json* out) {
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty()) {
    return bad_request("messages must be a non-empty array", "messages");
  }
  *out = json::array();
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    json m = body["messages"][i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return bad_request(at + " must be an object", "messages");
    if (!m.contains("role") || !m["role"].is_string()) return bad_request(at + ".role must be a string", "messages");
    if (m["role"] == "developer") m["role"] = "system";
    if (m.contains("content") && m["content"].is_array()) {
      std::string text;
      for (const json& part : m["content"]) {
        const bool text_part = part.is_object() && part.contains("type") && part["type"] == "text" && part.contains("text") &&
                               part["text"].is_string();
        if (!text_part) {
          return bad_request(at + ".content: only text parts are supported", "messages");
        }
        text += part["text"].get<std::string>();
      }
      m["content"] = text;
    }
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null()) {
      return bad_request(at + ".content must be a string or an array of text parts", "messages");
    }
    out->push_back(std::move(m));
  }
  return std::nullopt;
}

// Holds back text that may begin a stop string, and cuts the text before the first one.
class StopFilter {
 public:
  explicit StopFilter(const std::vector<std::string>* stops) : stops_(stops) {}
  // The text that can be sent now.
  std::string push(const std::string& text) {
    if (stopped_) return {};
    held_ += text;
    size_t cut = std::string::npos;
    for (const std::string& s : *stops_) cut = std::min(cut, held_.find(s));
    if (cut != std::string::npos) {
      stopped_ = true;
      std::string out = held_.substr(0, cut);
      held_.clear();
      return out;
    }
    size_t keep = 0;  // the longest tail that begins a stop string
    for (const std::string& s : *stops_) {
      for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
        if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
          keep = k;
          break;
        }
      }
    }
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }
  std::string finish() {
    std::string out = stopped_ ? std::string() : std::move(held_);
    held_.clear();
    return out;
  }
  bool stopped() const { return stopped_; }

 private:
  const std::vector<std::string>* stops_;
  std::string held_;
  bool stopped_ = false;
};

const char* finish_reason(FinishKind k) { return k == FinishKind::kLength ? "length" : "stop"; }

}  // namespace

// ---- One request: its sessions, the engine's events, the choices' text ----

struct OpenAiApi::Job {
  Engine* engine = nullptr;
  Params params;
  bool chat = true;
  std::string id;
  int64_t created = 0;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  Clock::time_point start = Clock::now();
  std::shared_ptr<void> slot;  // one of OpenAiOptions::max_running, held while the job lives

  // Filled by the engine's sinks (the scheduler thread), read by the handler's thread.
  struct Piece {
    int index = 0;
    bool finished = false;
    std::string text;
    FinishKind finish = FinishKind::kLength;
    Status status;
    Usage usage;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> pieces;

  std::vector<SessionId> sessions;  // closed by end()
  std::vector<std::shared_ptr<GenerateHandle>> handles;

  struct Choice {
    explicit Choice(const std::vector<std::string>* stops) : filter(stops) {}
    StopFilter filter;
    std::string text;
    bool done = false, role_sent = false;
    FinishKind finish = FinishKind::kLength;
    Status status;
    Usage usage;
  };
  std::vector<Choice> choices;
  int remaining = 0;  // choices not done
  bool ended = false;

  EventSink sink(std::shared_ptr<Job> self, int index) {
    return [self, index](const GenerateEvent& e) {
      Piece p;
      p.index = index;
      p.text = e.text;
      if (e.type == GenerateEvent::Type::kFinished) {
        p.finished = true;
        p.finish = e.finish;
        p.status = e.status;
        p.usage = e.usage;
      } else if (p.text.empty()) {
        return;  // nothing to show (a special token, a held-back partial character)
      }
      std::lock_guard<std::mutex> lock(self->mu);
      self->pieces.push_back(std::move(p));
      self->cv.notify_all();
    };
  }
  // The next piece, waiting up to `timeout`; nullopt on timeout.
  std::optional<Piece> next(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return !pieces.empty(); })) return std::nullopt;
    Piece p = std::move(pieces.front());
    pieces.pop_front();
    return p;
  }
  // Applies a piece to its choice; the text to send now (after the stop filter).
  std::string apply(const Piece& p) {
    Choice& c = choices[p.index];
    std::string out = c.filter.push(p.text);
    if (p.finished) {
      out += c.filter.finish();
      c.done = true;
      c.finish = c.filter.stopped() ? FinishKind::kStop : p.finish;
      c.status = p.status;
      c.usage = p.usage;
      --remaining;
    }
    c.text += out;
    return out;
  }
  // Cancels what still runs and closes the sessions (idempotent).
  void end() {
    if (ended) return;
    ended = true;
    for (auto& h : handles) h->cancel();
    for (const SessionId& s : sessions) engine->close(s).ignore();
  }
  int64_t completion_tokens() const {
    int64_t n = 0;
    for (const Choice& c : choices) n += c.usage.output_tokens;
    return n;
  }
  json usage() const {
    const int64_t out = completion_tokens();
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", out},
            {"total_tokens", prompt_tokens + out},
            {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  }
  // The first error among the choices, if any.
  std::optional<Status> error() const {
    for (const Choice& c : choices)
      if (c.done && c.finish == FinishKind::kError) return c.status;
    return std::nullopt;
  }
};

namespace {

// The JSON objects of a completion, whole or as stream chunks.
json completion_object(const OpenAiApi::Job& job, const std::string& model, const std::string& fingerprint) {
  json choices = json::array();
  for (size_t i = 0; i < job.choices.size(); ++i) {
    const auto& c = job.choices[i];
    json ch = {{"index", i}};
    if (job.chat) {
      ch["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
    } else {
      ch["text"] = c.text;
    }
    ch["logprobs"] = nullptr;
    ch["finish_reason"] = finish_reason(c.finish);
    choices.push_back(std::move(ch));
  }
  return {{"id", job.id},
          {"object", job.chat ? "chat.completion" : "text_completion"},
          {"created", job.created},
          {"model", model},
          {"system_fingerprint", fingerprint},
          {"choices", std::move(choices)},
          {"usage", job.usage()}};
}

json chunk_object(const OpenAiApi::Job& job, const std::string& model, const std::string& fingerprint, json choices) {
  json j = {{"id", job.id},
            {"object", job.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", job.created},
            {"model", model},
            {"system_fingerprint", fingerprint},
            {"choices", std::move(choices)}};
  if (job.params.include_usage) j["usage"] = nullptr;
  return j;
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace

OpenAiApi::OpenAiApi(Engine& engine, const Tokenizer* tokenizer, const ApiKeys& keys, OpenAiOptions options,
                     Metrics* metrics)
    : engine_(&engine), tokenizer_(tokenizer), keys_(&keys), options_(std::move(options)), metrics_(metrics) {
  fingerprint_ = "combs-" + to_hex(engine.model().file().fingerprint()).substr(0, 12);
}

OpenAiApi::~OpenAiApi() = default;

void OpenAiApi::add_routes(httplib::Server& server) {
  server.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { chat_completions(req, res); });
  server.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { completions(req, res); });
  server.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { models(req, res, ""); });
  server.Get(R"(/v1/models/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    models(req, res, req.matches[1].str());
  });
  // Whatever the router or the transport refused (404, 405, 413, 414, 400) as an error object.
  server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message;
    switch (res.status) {
      case 404: message = "no such route: " + req.method + " " + req.path; break;
      case 413: message = "the request body is larger than this server accepts"; break;
      case 414: message = "the request line is too long"; break;
      default: message = "the request could not be read (HTTP " + std::to_string(res.status) + ")"; break;
    }
    res.set_content(dump(error_json({res.status, message, "invalid_request_error", "", ""})), "application/json");
  });
}

void OpenAiApi::models(const httplib::Request& req, httplib::Response& res, const std::string& id) {
  auto key = keys_->authenticate(req.has_header("Authorization") ? std::optional<std::string_view>(req.get_header_value("Authorization"))
                                                                  : std::nullopt);
  if (!key.ok()) return send_error(res, api_error(key.status()));
  const json model = {{"id", options_.model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "combs"}};
  if (!id.empty()) {
    if (id != options_.model_id) {
      return send_error(res, {404, "The model '" + id + "' does not exist", "invalid_request_error", "model", "model_not_found"});
    }
    return res.set_content(dump(model), "application/json");
  }
  res.set_content(dump(json{{"object", "list"}, {"data", json::array({model})}}), "application/json");
}

namespace {

// Runs a completion whose prompt is known: sessions, generation, the response (whole or
// streamed). Returns the HTTP status it answered with (for the metrics).
struct Runner {
  Engine& engine;
  const ApiKeys& keys;
  const OpenAiOptions& options;
  const std::string& fingerprint;
  Metrics* metrics;

  int run(const httplib::Request& req, httplib::Response& res, std::shared_ptr<OpenAiApi::Job> job,
          const std::vector<int32_t>& prompt, const std::string& key);
};

int Runner::run(const httplib::Request&, httplib::Response& res, std::shared_ptr<OpenAiApi::Job> job,
                const std::vector<int32_t>& prompt, const std::string& key) {
  auto fail = [&](const ApiError& e) {
    job->end();
    send_error(res, e);
    return e.http;
  };
  Params& p = job->params;
  // (A session that releases the pages behind its window holds a window's worth, whatever its length.)
  const int64_t context =
      engine.releases_behind_window() ? engine.max_context() : std::min(engine.max_context(), engine.kv_capacity_tokens());
  job->prompt_tokens = static_cast<int64_t>(prompt.size());
  if (prompt.empty()) return fail(bad_request("the prompt is empty", job->chat ? "messages" : "prompt"));
  if (options.max_input_tokens > 0 && job->prompt_tokens > options.max_input_tokens) {
    return fail(bad_request("the prompt has " + std::to_string(prompt.size()) + " tokens; this server accepts " +
                                std::to_string(options.max_input_tokens),
                            "messages", "context_length_exceeded"));
  }
  const int64_t room = std::min<int64_t>(context - job->prompt_tokens, engine.max_tokens_per_request());
  const int64_t max_tokens = p.max_tokens.value_or(room);
  if (max_tokens < 1 || max_tokens > context - job->prompt_tokens) {
    return fail(bad_request("This server's maximum context length is " + std::to_string(context) + " tokens. However, you requested " +
                                std::to_string(job->prompt_tokens + std::min(max_tokens, INT64_MAX - job->prompt_tokens)) + " tokens (" + std::to_string(prompt.size()) +
                                " in the prompt, " + std::to_string(max_tokens) + " for the completion).",
                            "messages", "context_length_exceeded"));
  }
  if (max_tokens > engine.max_tokens_per_request()) {
    return fail(bad_request("max_tokens " + std::to_string(max_tokens) + " exceeds this server's limit of " +
                                std::to_string(engine.max_tokens_per_request()),
                            "max_tokens"));
  }
  SessionOptions so;
  so.cache_namespace = keys.prefix_namespace(key);
  auto root = engine.create_session(so);
  if (!root.ok()) return fail(api_error(root.status()));
  job->sessions.push_back(*root);
  job->choices.assign(static_cast<size_t>(p.n), OpenAiApi::Job::Choice(&p.stop));
  job->remaining = p.n;
  GenerateRequest g;
  g.max_tokens = static_cast<int>(max_tokens);
  g.stop_strings = p.stop;
  auto sampling_of = [&](int i) {
    SamplingParams s = p.sampling;
    s.seed = p.seeded ? s.seed + static_cast<uint64_t>(i) : std::random_device{}() * 0x9e3779b97f4a7c15ull + i;
    return s;
  };
  if (p.n == 1) {
    g.input = prompt;
    g.sampling = sampling_of(0);
    auto h = engine.generate(*root, std::move(g), job->sink(job, 0));
    if (!h.ok()) return fail(api_error(h.status()));
    job->handles.push_back(*h);
  } else {
    // One prefill, then a fork per choice: the prompt's pages are shared, not computed n times.
    auto prefill = std::make_shared<OpenAiApi::Job>();
    prefill->engine = &engine;
    prefill->choices.assign(1, OpenAiApi::Job::Choice(&p.stop));
    prefill->remaining = 1;
    GenerateRequest pre;
    pre.input = prompt;
    auto h = engine.generate(*root, std::move(pre), prefill->sink(prefill, 0));
    if (!h.ok()) return fail(api_error(h.status()));
    std::optional<OpenAiApi::Job::Piece> done;
    while (!(done = prefill->next(std::chrono::milliseconds(3600 * 1000)))) {
    }
    if (done->finish == FinishKind::kError) return fail(api_error(done->status));
    job->cached_tokens = done->usage.cached_tokens;
    for (int i = 0; i < p.n; ++i) {
      auto child = engine.fork(*root);
      if (!child.ok()) return fail(api_error(child.status()));
      job->sessions.push_back(*child);
      GenerateRequest gi = g;
      gi.sampling = sampling_of(i);
      auto hi = engine.generate(*child, std::move(gi), job->sink(job, i));
      if (!hi.ok()) return fail(api_error(hi.status()));
      job->handles.push_back(*hi);
    }
  }

  // Up to the first piece the status can still say how the request fared (a full pool: 429).
  const auto keepalive = std::chrono::milliseconds(options.keepalive_ms);
  std::optional<OpenAiApi::Job::Piece> first;
  while (!(first = job->next(keepalive))) {
  }
  if (first->finished && first->finish == FinishKind::kError) return fail(api_error(first->status));
  if (metrics) metrics->observe_ttft(std::chrono::duration<double>(Clock::now() - job->start).count());

  const std::string model = options.model_id;
  const std::string fp = fingerprint;
  Metrics* m = metrics;
  auto settle = [job, m] {  // once every choice is done
    if (job->params.n == 1) job->cached_tokens = job->choices[0].usage.cached_tokens;
    if (m) {
      m->add_tokens(job->prompt_tokens, job->completion_tokens());
      m->observe_generate(std::chrono::duration<double>(Clock::now() - job->start).count());
    }
  };
  auto pending = std::make_shared<std::optional<OpenAiApi::Job::Piece>>(std::move(first));
  if (!p.stream) {
    // JSON may begin with whitespace: a space now and then while waiting finds a client that left.
    // With the charset, cpp-httplib does not compress it (compression would hold the spaces back).
    res.set_chunked_content_provider(
        "application/json; charset=utf-8",
        [job, pending, keepalive, model, fp, settle](size_t, httplib::DataSink& sink) {
          if (*pending) {
            job->apply(**pending);
            pending->reset();
          }
          Clock::time_point last_write = Clock::now();
          while (job->remaining > 0) {
            if (auto piece = job->next(keepalive)) job->apply(*piece);
            if (Clock::now() - last_write >= keepalive) {  // however fast the tokens come
              if (!sink.write(" ", 1)) return false;
              last_write = Clock::now();
            }
          }
          settle();
          const std::string body = job->error() ? dump(error_json(api_error(*job->error())))
                                                : dump(completion_object(*job, model, fp));
          job->end();
          if (!sink.write(body.data(), body.size())) return false;
          sink.done();
          return true;
        },
        [job](bool) { job->end(); });
    return 200;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [job, pending, keepalive, model, fp, settle](size_t, httplib::DataSink& sink) {
        auto send = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
        auto delta_choice = [&](int index, const std::string& text, const char* finish) {
          json ch = {{"index", index}};
          auto& c = job->choices[index];
          if (job->chat) {
            json delta = json::object();
            if (!c.role_sent) {
              delta["role"] = "assistant";
              c.role_sent = true;
            }
            if (!text.empty() || !finish) delta["content"] = text;
            ch["delta"] = std::move(delta);
          } else {
            ch["text"] = text;
          }
          ch["logprobs"] = nullptr;
          ch["finish_reason"] = finish ? json(finish) : json(nullptr);
          return ch;
        };
        while (job->remaining > 0) {
          std::optional<OpenAiApi::Job::Piece> piece;
          if (*pending) {
            piece = std::move(**pending);
            pending->reset();
          } else {
            piece = job->next(keepalive);
          }
          if (!piece) {
            if (!send(": keep-alive\n\n")) return false;
            continue;
          }
          const std::string text = job->apply(*piece);
          const auto& c = job->choices[piece->index];
          if (c.done && c.finish == FinishKind::kError) {
            job->end();
            send(sse(error_json(api_error(c.status))));
            send("data: [DONE]\n\n");
            sink.done();
            return true;
          }
          if (!text.empty() || (job->chat && !c.role_sent)) {
            json chunk = chunk_object(*job, model, fp, json::array({delta_choice(piece->index, text, nullptr)}));
            if (!send(sse(chunk))) return false;
          }
          if (c.done) {
            json chunk = chunk_object(*job, model, fp, json::array({delta_choice(piece->index, "", finish_reason(c.finish))}));
            if (!send(sse(chunk))) return false;
          }
        }
        settle();
        job->end();
        if (job->params.include_usage) {
          json chunk = chunk_object(*job, model, fp, json::array());
          chunk["usage"] = job->usage();
          if (!send(sse(chunk))) return false;
        }
        if (!send("data: [DONE]\n\n")) return false;
        sink.done();
        return true;
      },
      [job](bool) { job->end(); });
  return 200;
}

}  // namespace

void OpenAiApi::chat_completions(const httplib::Request& req, httplib::Response& res) { serve(req, res, true); }

void OpenAiApi::completions(const httplib::Request& req, httplib::Response& res) { serve(req, res, false); }

std::optional<ApiError> OpenAiApi::chat_prompt(const json& body, std::vector<int32_t>* prompt) const {
  json messages;
  if (auto e = read_messages(body, &messages)) return e;
  json variables = json::object();
  if (body.contains("tools") && !body["tools"].is_null()) variables["tools"] = body["tools"];
  if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].is_object()) {
    for (const auto& [k, v] : body["chat_template_kwargs"].items()) variables[k] = v;
  }
  auto tokens = engine_->render_chat(messages, variables);
  if (!tokens.ok()) return api_error(tokens.status());
  *prompt = std::move(tokens).value();
  return std::nullopt;
}

std::optional<ApiError> OpenAiApi::text_prompt(const json& body, std::vector<int32_t>* prompt) const {
  for (const char* unsupported : {"echo", "suffix", "best_of"}) {
    if (body.contains(unsupported) && !body[unsupported].is_null() && body[unsupported] != false &&
        !(std::string(unsupported) == "best_of" && body[unsupported] == 1)) {
      return bad_request(std::string(unsupported) + " is not supported", unsupported);
    }
  }
  // One prompt: a string, token ids, or an array holding one of those.
  const int n_vocab = engine_->model().config().n_vocab;
  json field = body.contains("prompt") ? body["prompt"] : json(nullptr);
  if (field.is_array() && field.size() == 1 && (field[0].is_string() || field[0].is_array())) field = json(field[0]);
  if (field.is_string()) {
    if (tokenizer_ == nullptr) return bad_request("this model has no tokenizer: send the prompt as token ids", "prompt");
    *prompt = tokenizer_->encode(field.get<std::string>(), {true, false});
    return std::nullopt;
  }
  if (field.is_array() && !field.empty() && field[0].is_number_integer()) {
    for (const json& t : field) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= n_vocab) {
        return bad_request("prompt token ids must be integers in [0, " + std::to_string(n_vocab) + ")", "prompt");
      }
      prompt->push_back(t.get<int32_t>());
    }
    return std::nullopt;
  }
  return bad_request("prompt must be a string or an array of token ids (one prompt per request)", "prompt");
}

void OpenAiApi::serve(const httplib::Request& req, httplib::Response& res, bool chat) {
  try {
    serve_checked(req, res, chat);
  } catch (const json::exception& e) {  // a field of an unexpected type that a check missed
    send_error(res, bad_request(std::string("the request could not be read: ") + e.what()));
  }
}

void OpenAiApi::serve_checked(const httplib::Request& req, httplib::Response& res, bool chat) {
  int status = 400;
  auto answer = [&](const ApiError* e) {
    if (e) {
      send_error(res, *e);
      status = e->http;
    }
    if (metrics_) {
      metrics_->count_request(chat ? "http /v1/chat/completions" : "http /v1/completions",
                              static_cast<int>(metric_code(status)));
    }
  };
  auto key = keys_->authenticate(req.has_header("Authorization") ? std::optional<std::string_view>(req.get_header_value("Authorization"))
                                                                  : std::nullopt);
  if (!key.ok()) {
    const ApiError e = api_error(key.status());
    return answer(&e);
  }
  if (draining_) {
    const ApiError e{503, "combs-server is shutting down", "server_error", "", "unavailable"};
    return answer(&e);
  }
  // Each running request holds an HTTP thread: beyond the cap, 429 rather than a silent queue
  // in front of everything (GET /metrics included).
  auto slot = std::shared_ptr<void>(nullptr, [running = running_](void*) { --*running; });
  if (++*running_ > options_.max_running) {
    const ApiError e{429, "the server is busy: " + std::to_string(options_.max_running) + " requests are running",
                     "server_overloaded", "", "server_busy"};
    return answer(&e);
  }
  // Nesting is bounded (copies of a value recurse: a deep one would overflow the stack).
  bool too_deep = false;
  json body = json::parse(
      req.body,
      [&too_deep](int depth, json::parse_event_t, json&) {
        if (depth > kMaxJsonDepth) too_deep = true;
        return depth <= kMaxJsonDepth;
      },
      false);
  if (too_deep) {
    const ApiError e = bad_request("the body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    return answer(&e);
  }
  if (body.is_discarded() || !body.is_object()) {
    const ApiError e = bad_request("the body is not a JSON object");
    return answer(&e);
  }
  auto job = std::make_shared<Job>();
  job->engine = engine_;
  job->slot = slot;
  job->chat = chat;
  job->id = (chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
  job->created = unix_now();
  std::vector<int32_t> prompt;
  std::optional<ApiError> e = read_params(body, options_, engine_->model().config().n_vocab, &job->params);
  if (!e) e = chat ? chat_prompt(body, &prompt) : text_prompt(body, &prompt);
  if (e) return answer(&*e);
  Runner r{*engine_, *keys_, options_, fingerprint_, metrics_};
  status = r.run(req, res, job, prompt, *key);
  answer(nullptr);
}

}  // namespace combs::server
