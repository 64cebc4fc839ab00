#include "http_server.h"

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

StatusOr<std::unique_ptr<HttpServer>> HttpServer::start(const std::string& host_port, const HttpServerOptions& options,
                                                        const std::function<void(httplib::Server&)>& routes) {
  std::string host;
  int port = 0;
  if (!split_host_port(host_port, &host, &port)) {
    return invalid_argument_error("HTTP address '" + host_port + "' is not HOST:PORT");
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  httplib::Server& srv = s->server_;
  const int threads = std::max(1, options.threads);
  srv.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  srv.set_payload_max_length(options.max_body_bytes);
  srv.set_read_timeout(options.read_timeout_s, 0);
  srv.set_write_timeout(options.write_timeout_s, 0);
  routes(srv);
  if (port == 0) {
    port = srv.bind_to_any_port(host.empty() ? "0.0.0.0" : host);
    if (port <= 0) return unavailable_error("cannot listen on " + host_port);
  } else if (!srv.bind_to_port(host.empty() ? "0.0.0.0" : host, port)) {
    return unavailable_error("cannot listen on " + host_port);
  }
  s->host_ = host;
  s->port_ = port;
  s->thread_ = std::thread([raw = &s->server_] { raw->listen_after_bind(); });
  return s;
}

HttpServer::~HttpServer() {
  server_.stop();
  if (thread_.joinable()) thread_.join();
}

void add_metrics_routes(httplib::Server& server, std::function<std::string()> render) {
  server.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  auto not_allowed = [](const httplib::Request&, httplib::Response& res) {
    res.status = 405;
    res.set_header("Allow", "GET");
    res.set_content("only GET /metrics\n", "text/plain");
  };
  server.Post("/metrics", not_allowed);
  server.Put("/metrics", not_allowed);
  server.Delete("/metrics", not_allowed);
  server.Patch("/metrics", not_allowed);
}

}  // namespace combs::server
