// The OpenAI-compatible HTTP API over the engine (routes on an HttpServer):
//   POST /v1/chat/completions  messages rendered with the model's chat template
//   POST /v1/completions       a prompt (text or token ids)
//   GET  /v1/models, /v1/models/{id}
// Requests are stateless: each one runs in a session of its own (closed at the end), and the
// engine's prefix cache lets a client that resends its conversation pay only for the new part
// (usage.prompt_tokens_details.cached_tokens says how much was reused). n > 1 prefills one session
// and forks it n times. `stream: true` answers with server-sent events ending `data: [DONE]`.
// Stop strings end the text before them, as OpenAI's do (a stream holds back text that may begin
// one). A client that goes away cancels its generation (a stream's next write fails; a waiting
// non-streamed request notices at its next keep-alive byte, sent as JSON whitespace).
// Errors are OpenAI's error object with the HTTP status: 400 bad request (context_length_exceeded
// when the prompt and max_tokens do not fit), 401 missing or unknown key, 404 unknown model or
// path, 413 body too large, 429 no room (sessions or KV pages), 503 draining, 500 otherwise.
// Thread-safe; the engine, tokenizer, keys and metrics outlive it.
#pragma once

#include <httplib.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api_keys.h"
#include "combs/engine/engine.h"
#include "combs/model/tokenizer.h"
#include "metrics.h"

namespace combs::server {

struct ApiError;  // an OpenAI error object and its HTTP status (openai_api.cc)

struct OpenAiOptions {
  std::string model_id = "combs";  // what /v1/models lists; requests must name it
  int max_choices = 16;            // n at most
  int64_t max_input_tokens = 0;    // prompt tokens per request at most; 0: up to the context
  int keepalive_ms = 1000;         // idle streams send a comment, waiting requests a space
  int max_running = 62;            // requests at once (each holds an HTTP thread); 429 beyond
};

class OpenAiApi {
 public:
  // tokenizer may be null (a model without one: only token-id prompts, no text out).
  OpenAiApi(Engine& engine, const Tokenizer* tokenizer, const ApiKeys& keys, OpenAiOptions options,
            Metrics* metrics = nullptr);
  ~OpenAiApi();
  void add_routes(httplib::Server& server);
  // Shutdown has begun: new completions are 503 (running ones go on).
  void drain() { draining_ = true; }

  struct Job;  // one completion request (openai_api.cc)

 private:
  void chat_completions(const httplib::Request& req, httplib::Response& res);
  void completions(const httplib::Request& req, httplib::Response& res);
  // Both: the key, the drain, the body, the shared fields, the prompt; then the run.
  void serve(const httplib::Request& req, httplib::Response& res, bool chat);
  void serve_checked(const httplib::Request& req, httplib::Response& res, bool chat);
  // The prompt of a chat (messages through the template) or of a text completion; the error the
  // request gets otherwise.
  std::optional<ApiError> chat_prompt(const nlohmann::ordered_json& body, std::vector<int32_t>* prompt) const;
  std::optional<ApiError> text_prompt(const nlohmann::ordered_json& body, std::vector<int32_t>* prompt) const;
  void models(const httplib::Request& req, httplib::Response& res, const std::string& id);

  Engine* engine_;
  const Tokenizer* tokenizer_;
  const ApiKeys* keys_;
  OpenAiOptions options_;
  Metrics* metrics_;
  std::string fingerprint_;  // system_fingerprint
  std::atomic<bool> draining_{false};
  std::shared_ptr<std::atomic<int>> running_ = std::make_shared<std::atomic<int>>(0);  // jobs alive
};

}  // namespace combs::server
