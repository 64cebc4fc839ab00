// The OpenAI-compatible HTTP API of a real combs-server, through an HTTP client (cpp-httplib's):
// models, chat and text completions plain and streamed (the deltas add up to the plain text),
// stop strings, n > 1, the prefix cache seen through usage, errors and their statuses, keys, and a
// client that goes away mid-stream.
#include <catch2/catch.hpp>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <thread>

#include "support/server_process.h"
#include "support/temp_dir.h"

using namespace combs::testing;
using json = nlohmann::ordered_json;

namespace {

const char* kModel = "tiny-test";

struct Api {
  std::string host;
  int port = 0;
  std::string key;

  explicit Api(const std::string& address, std::string k = "") : key(std::move(k)) {
    host = address.substr(0, address.rfind(':'));
    port = std::stoi(address.substr(address.rfind(':') + 1));
  }
  httplib::Result post(const std::string& path, const std::string& body) const {
    httplib::Client c(host, port);
    c.set_read_timeout(60, 0);
    httplib::Headers h;
    if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
    return c.Post(path.c_str(), h, body, "application/json");
  }
  // POSTs a JSON body; the status and the parsed answer.
  std::pair<int, json> call(const std::string& path, const json& body) const {
    auto r = post(path, body.dump());
    REQUIRE(r);
    json j = json::parse(r->body, nullptr, false);
    INFO(r->body);
    REQUIRE(!j.is_discarded());
    return {r->status, j};
  }
  std::pair<int, json> get(const std::string& path) const {
    httplib::Client c(host, port);
    httplib::Headers h;
    if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
    auto r = c.Get(path.c_str(), h);
    REQUIRE(r);
    return {r->status, json::parse(r->body, nullptr, false)};
  }
};

// The `data:` events of a server-sent event stream; `done` when it ended with [DONE].
std::vector<json> events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);  // every event ends with a blank line
    const std::string event = body.substr(at, end - at);
    at = end + 2;
    if (event.rfind(":", 0) == 0) continue;  // a comment (keep-alive)
    REQUIRE(event.rfind("data: ", 0) == 0);
    CHECK_FALSE(*done);  // nothing after [DONE]
    const std::string data = event.substr(6);
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    json j = json::parse(data, nullptr, false);
    REQUIRE(!j.is_discarded());
    out.push_back(std::move(j));
  }
  return out;
}

json chat_body(const std::string& user, int max_tokens) {
  return {{"model", kModel},
          {"messages", json::array({{{"role", "system"}, {"content", "You are a test."}}, {{"role", "user"}, {"content", user}}})},
          {"max_tokens", max_tokens},
          {"temperature", 0}};
}

double metric(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + series.size() + 2));
}

// Starts a streamed chat completion on a raw socket and reads until its first event: the socket
// (the stream goes on until it is closed).
int open_stream(int port, json body) {
  body["stream"] = true;
  const std::string payload = body.dump();
  const std::string request = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                              "Content-Length: " + std::to_string(payload.size()) + "\r\n\r\n" + payload;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {  // the stream has begun
    const ssize_t n = read(fd, buf, sizeof buf);
    REQUIRE(n > 0);
    got.append(buf, static_cast<size_t>(n));
  }
  CHECK(got.rfind("HTTP/1.1 200", 0) == 0);
  return fd;
}

}  // namespace

TEST_CASE("the OpenAI API answers chat completions plain and streamed alike", "[server]") {
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel});
  REQUIRE(!server.http_address.empty());
  Api api(server.http_address);

  auto [ms, models] = api.get("/v1/models");
  CHECK(ms == 200);
  CHECK(models["object"] == "list");
  REQUIRE(models["data"].size() == 1);
  CHECK(models["data"][0]["id"] == kModel);
  CHECK(api.get(std::string("/v1/models/") + kModel).first == 200);
  CHECK(api.get("/v1/models/other").first == 404);

  auto [status, plain] = api.call("/v1/chat/completions", chat_body("Hello there", 12));
  REQUIRE(status == 200);
  CHECK(plain["object"] == "chat.completion");
  CHECK(plain["model"] == kModel);
  CHECK(plain["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  REQUIRE(plain["choices"].size() == 1);
  const json& choice = plain["choices"][0];
  CHECK(choice["message"]["role"] == "assistant");
  const std::string text = choice["message"]["content"];
  const json& usage = plain["usage"];
  const int64_t prompt_tokens = usage["prompt_tokens"];
  CHECK(prompt_tokens > 16);
  CHECK(usage["total_tokens"] == prompt_tokens + usage["completion_tokens"].get<int64_t>());
  if (choice["finish_reason"] == "length") CHECK(usage["completion_tokens"] == 12);

  // The same conversation streamed: the deltas add up to the same text at temperature 0, and the
  // prompt comes from the prefix cache (every whole page but the one holding its last position).
  json streamed = chat_body("Hello there", 12);
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  auto r = api.post("/v1/chat/completions", streamed.dump());
  REQUIRE(r);
  REQUIRE(r->status == 200);
  CHECK(r->get_header_value("Content-Type").rfind("text/event-stream", 0) == 0);
  bool done = false;
  const std::vector<json> chunks = events(r->body, &done);
  CHECK(done);
  REQUIRE(chunks.size() >= 3);
  std::string joined;
  std::string finish;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    const json& c = chunks[i];
    CHECK(c["object"] == "chat.completion.chunk");
    CHECK(c["id"] == chunks[0]["id"]);
    REQUIRE(c["choices"].size() == 1);
    const json& d = c["choices"][0]["delta"];
    if (i == 0) CHECK(d["role"] == "assistant");
    if (d.contains("content")) joined += d["content"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  CHECK(joined == text);
  CHECK(finish == choice["finish_reason"]);
  const json& last = chunks.back();  // include_usage: the usage, no choices
  CHECK(last["choices"].empty());
  CHECK(last["usage"]["prompt_tokens"] == prompt_tokens);
  CHECK(last["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) / 16 * 16);
  CHECK(server.stop() == 0);
}

TEST_CASE("the OpenAI API ends text before a stop string and forks n choices", "[server]") {
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel});
  Api api(server.http_address);
  json body = {{"model", kModel}, {"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 0}};
  auto [status, full] = api.call("/v1/completions", body);
  REQUIRE(status == 200);
  CHECK(full["object"] == "text_completion");
  const std::string text = full["choices"][0]["text"];
  // A stop string from the middle of the greedy text (two ASCII characters, so that it is valid
  // UTF-8 on its own); the answer is the text before its first occurrence.
  std::string stop;
  for (size_t i = text.size() / 3; i + 1 < text.size() && stop.empty(); ++i) {
    const unsigned char a = text[i], b = text[i + 1];
    if (a > 32 && a < 127 && b > 32 && b < 127) stop = text.substr(i, 2);
  }
  INFO("text '" << text << "', stop '" << stop << "'");
  REQUIRE(!stop.empty());
  const std::string expected = text.substr(0, text.find(stop));
  body["stop"] = json::array({stop, "never-appears-here"});
  auto [s2, stopped] = api.call("/v1/completions", body);
  REQUIRE(s2 == 200);
  CHECK(stopped["choices"][0]["text"] == expected);
  CHECK(stopped["choices"][0]["finish_reason"] == "stop");
  body["stream"] = true;
  auto r = api.post("/v1/completions", body.dump());
  REQUIRE(r);
  bool done = false;
  std::string joined;
  for (const json& c : events(r->body, &done)) {
    for (const json& ch : c["choices"]) joined += ch["text"].get<std::string>();
  }
  CHECK(done);
  CHECK(joined == expected);  // nothing of the stop string leaked into a delta

  // n = 3 through forks: sampled choices with their own seeds, greedy ones alike.
  json n3 = {{"model", kModel}, {"prompt", "Once upon a time"}, {"max_tokens", 6}, {"n", 3}, {"temperature", 0}};
  auto [s3, greedy] = api.call("/v1/completions", n3);
  REQUIRE(s3 == 200);
  REQUIRE(greedy["choices"].size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(greedy["choices"][i]["index"] == i);
    CHECK(greedy["choices"][i]["text"] == greedy["choices"][0]["text"]);
  }
  CHECK(greedy["usage"]["completion_tokens"] == 18);
  n3["temperature"] = 1.0;
  n3["seed"] = 5;
  auto [s4, sampled] = api.call("/v1/chat/completions",
                                json{{"model", kModel}, {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
                                     {"n", 3}, {"max_tokens", 8}, {"temperature", 1.0}, {"seed", 5}});
  REQUIRE(s4 == 200);
  REQUIRE(sampled["choices"].size() == 3);
  CHECK(sampled["choices"][0]["message"]["content"] != sampled["choices"][1]["message"]["content"]);
  auto [s5, again] = api.call("/v1/chat/completions",
                              json{{"model", kModel}, {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
                                   {"n", 3}, {"max_tokens", 8}, {"temperature", 1.0}, {"seed", 5}});
  CHECK(again["choices"] == sampled["choices"]);  // the same seed, the same choices
  CHECK(server.stop() == 0);
}

TEST_CASE("the OpenAI API refuses bad requests with OpenAI's error object and status", "[server]") {
  TempDir dir;
  const std::string keys = dir.file("keys");
  REQUIRE(write_file(keys, "key-one\nkey-two\n"));
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--api-keys", keys, "--max-body-bytes", "4096"});
  Api api(server.http_address, "key-one");
  auto expect = [&](const std::string& path, const std::string& body, int status, const std::string& param = "",
                    const std::string& code = "") {
    INFO(path << " " << body.substr(0, 200));
    auto r = api.post(path, body);
    REQUIRE(r);
    CHECK(r->status == status);
    json j = json::parse(r->body, nullptr, false);
    REQUIRE(!j.is_discarded());
    REQUIRE(j.contains("error"));
    CHECK(j["error"]["message"].is_string());
    CHECK(j["error"]["type"].is_string());
    if (!param.empty()) CHECK(j["error"]["param"] == param);
    if (!code.empty()) CHECK(j["error"]["code"] == code);
  };
  const std::string chat = "/v1/chat/completions";
  auto with = [](json b, const std::string& k, json v) {
    b[k] = std::move(v);
    return b.dump();
  };
  const json ok = chat_body("hi", 4);
  expect(chat, "{not json", 400);
  expect(chat, "[1, 2]", 400);
  expect(chat, json{{"messages", ok["messages"]}}.dump(), 400, "model");
  expect(chat, with(ok, "model", "gpt-4o"), 404, "model", "model_not_found");
  expect(chat, with(ok, "messages", json::array()), 400, "messages");
  expect(chat, with(ok, "messages", json::array({{{"content", "no role"}}})), 400, "messages");
  expect(chat, with(ok, "temperature", 3), 400, "temperature");
  expect(chat, with(ok, "top_p", 0), 400, "top_p");
  expect(chat, with(ok, "n", 0), 400, "n");
  expect(chat, with(ok, "max_tokens", 0), 400, "max_tokens");
  expect(chat, with(ok, "max_tokens", 100000), 400, "messages", "context_length_exceeded");
  expect(chat, with(ok, "stop", json::array({"a", "b", "c", "d", "e"})), 400, "stop");
  expect(chat, with(ok, "logit_bias", {{"abc", 1}}), 400, "logit_bias");
  expect(chat, with(ok, "logit_bias", {{"5", 1000}}), 400, "logit_bias");
  expect(chat, with(ok, "frequency_penalty", -3), 400, "frequency_penalty");
  expect(chat, with(ok, "stream_options", {{"include_usage", true}}), 400, "stream_options");
  expect("/v1/completions", json{{"model", kModel}, {"prompt", json::array({-1})}}.dump(), 400, "prompt");
  expect("/v1/completions", json{{"model", kModel}, {"prompt", "x"}, {"echo", true}}.dump(), 400, "echo");
  expect(chat, with(ok, "pad", std::string(8000, 'x')), 413);  // over --max-body-bytes
  expect("/v1/completions", "{\"model\":\"tiny-test\",\"prompt\":" + std::string(2000, '[') + std::string(2000, ']') + "}", 400);
  expect(chat, with(ok, "messages", json::array({{{"role", "user"}, {"content", json::array({{{"type", 1}, {"text", "x"}}})}}})), 400,
         "messages");
  expect(chat, with(ok, "n", "three"), 400, "n");
  expect(chat, with(ok, "max_tokens", INT64_MAX), 400, "messages", "context_length_exceeded");
  expect("/v1/nothing", "{}", 404);
  CHECK(api.call(chat, ok).first == 200);  // and it goes on serving
  Api wrong(server.http_address, "key-three"), none(server.http_address);
  auto [ws, wj] = wrong.call(chat, ok);
  CHECK(ws == 401);
  CHECK(wj["error"]["code"] == "invalid_api_key");
  CHECK(none.call(chat, ok).first == 401);
  CHECK(none.get("/v1/models").first == 401);
  CHECK(server.stop() == 0);
}

TEST_CASE("the OpenAI API reuses a key's cached prompt and never another key's", "[server]") {
  TempDir dir;
  const std::string keys = dir.file("keys");
  REQUIRE(write_file(keys, "key-one\nkey-two\n"));
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--api-keys", keys});
  Api one(server.http_address, "key-one"), two(server.http_address, "key-two");
  std::string document;
  for (int i = 0; i < 60; ++i) document += "line " + std::to_string(i) + " of a long shared document. ";
  const json first = chat_body(document + "What is line 3?", 4);
  auto [s1, a1] = one.call("/v1/chat/completions", first);
  REQUIRE(s1 == 200);
  CHECK(a1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0);
  const int64_t prompt = a1["usage"]["prompt_tokens"];
  // A second turn resends the conversation: only the new part is computed.
  json second = first;
  second["messages"].push_back({{"role", "assistant"}, {"content", a1["choices"][0]["message"]["content"]}});
  second["messages"].push_back({{"role", "user"}, {"content", "And line 4?"}});
  auto [s2, a2] = one.call("/v1/chat/completions", second);
  REQUIRE(s2 == 200);
  CHECK(a2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>() >= (prompt - 1) / 16 * 16);
  // Another key's identical request computes everything.
  auto [s3, a3] = two.call("/v1/chat/completions", first);
  REQUIRE(s3 == 200);
  CHECK(a3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0);
  CHECK(a3["choices"][0]["message"]["content"] == a1["choices"][0]["message"]["content"]);
  CHECK(server.stop() == 0);
}

TEST_CASE("a client that leaves cancels its generation streamed or not", "[server]") {
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--metrics-listen", "127.0.0.1:0",
                        "--http-keepalive-ms", "50"});
  Api api(server.http_address);
  const bool stream = GENERATE(true, false);
  INFO((stream ? "streamed" : "not streamed"));
  if (stream) {
    close(open_stream(api.port, chat_body("Tell me everything.", 1500)));
  } else {  // a client that asks for compression, as the SDKs do, and hangs up while it waits
    const std::string payload = chat_body("Tell me everything.", 1500).dump();
    const std::string request = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAccept-Encoding: gzip, br\r\n"
                                "Content-Type: application/json\r\nContent-Length: " + std::to_string(payload.size()) +
                                "\r\n\r\n" + payload;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(api.port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
    char buf[256];
    REQUIRE(read(fd, buf, sizeof buf) > 0);  // the headers: the generation is under way
    close(fd);
  }
  // The generation stops and its session goes, long before 1,500 tokens.
  std::string m;
  for (int i = 0; i < 200; ++i) {
    m = http_get(server.metrics_address, "/metrics");
    if (metric(m, "combs_requests_generating") == 0 && metric(m, "combs_sessions") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(metric(m, "combs_requests_generating") == 0);
  CHECK(metric(m, "combs_sessions") == 0);
  CHECK(metric(m, "combs_forward_tokens_total") < 1000);
  CHECK(server.stop() == 0);
}

TEST_CASE("the official openai npm client talks to the API", "[server]") {
  // npm's `openai` (pinned), installed into the build tree by the first run.
  const std::string dir = COMBS_NODE_CLIENT_DIR;
  if (read_file(dir + "/node_modules/openai/package.json").empty()) {
    auto [code, out] = run_command("npm install --prefix '" + dir + "' --no-audit --no-fund --loglevel=error openai@6.30.1");
    INFO(out);
    REQUIRE(code == 0);
  }
  TempDir dir_keys;
  const std::string keys = dir_keys.file("keys");
  REQUIRE(write_file(keys, "key-one\n"));
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--api-keys", keys});
  auto [code, out] = run_command("node '" + std::string(COMBS_TEST_DIR) + "/server/openai_client_test.mjs' '" + dir + "' 'http://" +
                                 server.http_address + "/v1' key-one " + kModel);
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("FAILED") == std::string::npos);
  CHECK(out.find("ok: a wrong key is 401") != std::string::npos);  // it ran to the end
  CHECK(server.stop() == 0);
}

TEST_CASE("curl sees server-sent events framed as the OpenAI API frames them", "[server]") {
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel});
  json body = chat_body("Hello", 5);
  body["stream"] = true;
  TempDir dir;
  REQUIRE(write_file(dir.file("body.json"), body.dump()));
  auto [code, out] = run_command("curl -sS -N -i -H 'Content-Type: application/json' --data-binary @'" + dir.file("body.json") +
                                 "' http://" + server.http_address + "/v1/chat/completions");
  INFO(out);
  REQUIRE(code == 0);
  CHECK(out.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(out.find("\r\nContent-Type: text/event-stream") != std::string::npos);
  const std::string events_text = out.substr(out.find("\r\n\r\n") + 4);
  // Each event one "data: " line and a blank line; five tokens (or fewer and a stop), a last
  // chunk with the finish reason, then [DONE] and nothing after it.
  CHECK(events_text.rfind("data: {", 0) == 0);
  CHECK(events_text.size() > 14);
  CHECK(events_text.substr(events_text.size() - 14) == "data: [DONE]\n\n");
  size_t n = 0;
  for (size_t at = 0; (at = events_text.find("data: ", at)) != std::string::npos; at += 6) {
    CHECK((at == 0 || events_text.compare(at - 2, 2, "\n\n") == 0));
    ++n;
  }
  CHECK(n >= 3);
  CHECK(n <= 7);
  CHECK(server.stop() == 0);
}

TEST_CASE("the OpenAI API refuses what the KV pool cannot hold and more requests than its threads", "[server]") {
  // 1 MiB of pages (the tiny model: 16 KiB a page of 16 positions) holds 1,024 positions.
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--kv-memory-mib", "1", "--http-threads", "3"});
  Api api(server.http_address);
  auto [big, body] = api.call("/v1/chat/completions", chat_body("hi", 1500));
  CHECK(big == 400);
  CHECK(body["error"]["code"] == "context_length_exceeded");
  // Three threads: one completion at a time; a second one while it streams is 429.
  const int fd = open_stream(api.port, chat_body("Tell me everything.", 900));
  auto [busy, why] = api.call("/v1/chat/completions", chat_body("hi", 4));
  CHECK(busy == 429);
  CHECK(why["error"]["code"] == "server_busy");
  CHECK(api.get("/v1/models").first == 200);  // the other routes still answer
  close(fd);
  int status = 429;
  for (int i = 0; i < 200 && status == 429; ++i) {
    status = api.call("/v1/chat/completions", chat_body("hi", 4)).first;
    if (status == 429) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(status == 200);
  CHECK(server.stop() == 0);
}

TEST_CASE("the OpenAI API answers 429 without room and 503 while draining", "[server]") {
  ServerProcess server({"--http-listen", "127.0.0.1:0", "--model-name", kModel, "--max-sessions", "1", "--grace-s", "20"});
  Api api(server.http_address);
  // The one session a gRPC client holds: no room for a request's own.
  auto stub = server.stub();
  grpc::ClientContext ctx;
  combs::v1::CreateSessionResponse created;
  REQUIRE(stub->CreateSession(&ctx, combs::v1::CreateSessionRequest(), &created).ok());
  auto [full, body] = api.call("/v1/chat/completions", chat_body("hi", 4));
  CHECK(full == 429);
  CHECK(body["error"]["message"].get<std::string>().find("sessions") != std::string::npos);
  grpc::ClientContext ctx2;
  combs::v1::CloseSessionRequest close_req;
  close_req.set_session_id(created.session_id());
  combs::v1::CloseSessionResponse closed;
  REQUIRE(stub->CloseSession(&ctx2, close_req, &closed).ok());
  CHECK(api.call("/v1/chat/completions", chat_body("hi", 4)).first == 200);
  // A long stream holds the drain open; meanwhile new requests are 503.
  const int fd = open_stream(api.port, chat_body("Tell me everything.", 1900));
  server.signal(SIGTERM);
  int status = 0;
  for (int i = 0; i < 100 && status != 503; ++i) {
    status = api.call("/v1/chat/completions", chat_body("hi", 4)).first;
    if (status != 503) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(status == 503);
  close(fd);  // the stream ends: the server stops
  CHECK(server.wait() == 0);
}
