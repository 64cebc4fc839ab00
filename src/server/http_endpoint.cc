#include "http_endpoint.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace combs::server {

bool split_host_port(const std::string& host_port, std::string* host, int* port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon + 1 >= host_port.size()) return false;
  std::string h = host_port.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const std::string p = host_port.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return false;
  const int v = std::stoi(p);
  if (v > 65535) return false;
  *host = h;
  *port = v;
  return true;
}

StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::start(const std::string& host_port,
                                                            std::function<std::string()> render_metrics) {
  std::string host;
  int port = 0;
  if (!split_host_port(host_port, &host, &port)) {
    return invalid_argument_error("metrics address '" + host_port + "' is not HOST:PORT");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    return invalid_argument_error("metrics address '" + host_port + "': " + gai_strerror(rc));
  }
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    // Non-blocking: a connection reset between poll() and accept() must not block the thread.
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 16) != 0) {
      err = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return unavailable_error("cannot listen on " + host_port + " for metrics: " + err);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int actual = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<HttpEndpoint>(new HttpEndpoint(fd, actual, std::move(render_metrics)));
}

HttpEndpoint::HttpEndpoint(int fd, int port, std::function<std::string()> render)
    : fd_(fd), port_(port), render_(std::move(render)) {
  thread_ = std::thread([this] { serve(); });
}

HttpEndpoint::~HttpEndpoint() {
  stop_ = true;
  thread_.join();
  close(fd_);
}

void HttpEndpoint::serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;  // wakes to see stop_
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(conn);
    close(conn);
  }
}

void HttpEndpoint::answer(int conn) {
  // A slow or silent client cannot hold the endpoint: 2 s for the whole request, 2 s per send.
  timeval timeout{2, 0};
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::string req;
  char buf[1024];
  while (req.find("\r\n\r\n") == std::string::npos && req.size() <= 8192) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{conn, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = recv(conn, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) break;
    req.append(buf, static_cast<size_t>(n));
  }
  int code = 400;
  const char* reason = "Bad Request";
  std::string body = "bad request\n", type = "text/plain; charset=utf-8";
  const size_t line_end = req.find("\r\n");
  if (line_end != std::string::npos && req.size() <= 8192) {
    const std::string line = req.substr(0, line_end);
    const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
    if (sp1 != std::string::npos && sp2 > sp1 && line.compare(sp2 + 1, 5, "HTTP/") == 0) {
      const std::string method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
      const std::string path = target.substr(0, target.find('?'));
      if (method != "GET" && method != "HEAD") {
        code = 405, reason = "Method Not Allowed", body = "only GET\n";
      } else if (path != "/metrics") {
        code = 404, reason = "Not Found", body = "not found: try /metrics\n";
      } else {
        code = 200, reason = "OK", body = render_(), type = "text/plain; version=0.0.4; charset=utf-8";
      }
      if (method == "HEAD") body.clear();
    }
  }
  std::string resp = "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + type +
                     "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  for (size_t sent = 0; sent < resp.size();) {
    const ssize_t n = send(conn, resp.data() + sent, resp.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace combs::server
