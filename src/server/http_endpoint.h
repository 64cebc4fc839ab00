// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers with the text a
// callback renders; every other path is 404, every other method 405, a malformed or oversized
// request 400. One connection at a time (scrapes are rare and small), Connection: close.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "combs/base/status.h"

namespace combs::server {

class HttpEndpoint {
 public:
  // host_port: "HOST:PORT" (IPv4, IPv6 in brackets, or a name); port 0 picks a free one.
  static StatusOr<std::unique_ptr<HttpEndpoint>> start(const std::string& host_port,
                                                       std::function<std::string()> render_metrics);
  ~HttpEndpoint();  // stops serving
  int port() const { return port_; }

 private:
  HttpEndpoint(int fd, int port, std::function<std::string()> render);
  void serve();
  void answer(int conn);

  int fd_;
  int port_;
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Splits "HOST:PORT" ("[::1]:9090" for IPv6); false when malformed or the port is out of range.
bool split_host_port(const std::string& host_port, std::string* host, int* port);

}  // namespace combs::server
