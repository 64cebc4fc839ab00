// An HTTP/1.1 server on its own threads (cpp-httplib): the OpenAI-compatible API and the
// Prometheus endpoint are routes on one. Request bodies over max_body_bytes are refused with 413,
// request lines and headers over cpp-httplib's limit (8 KiB) with 414 / 400; unknown paths 404.
#pragma once

#include <httplib.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "combs/base/status.h"

namespace combs::server {

struct HttpServerOptions {
  int threads = 64;                     // requests served at once (a streaming one holds its thread)
  size_t max_body_bytes = 4 << 20;      // 413 beyond
  int read_timeout_s = 30;              // a client that stops sending a request is dropped
  int write_timeout_s = 30;             // ... or stops reading a response
};

class HttpServer {
 public:
  // host_port: "HOST:PORT" (IPv4, IPv6 in brackets, or a name); port 0 picks a free one. `routes`
  // registers the handlers before the server starts. UNAVAILABLE when it cannot listen.
  static StatusOr<std::unique_ptr<HttpServer>> start(const std::string& host_port, const HttpServerOptions& options,
                                                     const std::function<void(httplib::Server&)>& routes);
  ~HttpServer();  // stops serving (running handlers finish first)
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

 private:
  HttpServer() = default;
  httplib::Server server_;
  std::string host_;
  int port_ = 0;
  std::thread thread_;
};

// The Prometheus endpoint's routes: GET /metrics answers with render()'s text; other methods 405.
void add_metrics_routes(httplib::Server& server, std::function<std::string()> render);

// Splits "HOST:PORT" ("[::1]:9090" for IPv6); false when malformed or the port is out of range.
bool split_host_port(const std::string& host_port, std::string* host, int* port);

}  // namespace combs::server
