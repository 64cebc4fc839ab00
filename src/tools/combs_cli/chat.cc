#include "chat.h"

#include <editline/readline.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include <nlohmann/json.hpp>

namespace combs::cli {
namespace {

using namespace combs::v1;

void report(const grpc::Status& s) {
  std::fprintf(stderr, "combs chat: %d %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
}

class Chat {
 public:
  Chat(Combs::Stub& stub, const ChatOptions& o) : stub_(stub), o_(o), session_(o.session) {}

  void context(grpc::ClientContext& ctx) const {
    if (!o_.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + o_.api_key);
    if (!session_.empty()) ctx.AddMetadata("combs-session-id", session_);
  }

  bool ensure_session() {
    if (!session_.empty()) return true;
    grpc::ClientContext ctx;
    context(ctx);
    CreateSessionResponse r;
    if (auto s = stub_.CreateSession(&ctx, CreateSessionRequest(), &r); !s.ok()) return report(s), false;
    session_ = r.session_id();
    std::fprintf(stderr, "combs chat: session %s\n", session_.c_str());
    return true;
  }

  // One turn: streams the reply to stdout. False on an error (reported).
  bool turn(const std::vector<std::pair<std::string, std::string>>& messages) {
    ChatRequest req;
    req.set_session_id(session_);
    if (first_ && !o_.system.empty()) {
      ChatMessage* m = req.add_messages();
      m->set_role("system");
      m->set_content(o_.system);
    }
    for (const auto& [role, content] : messages) {
      ChatMessage* m = req.add_messages();
      m->set_role(role);
      m->set_content(content);
    }
    req.set_max_tokens(o_.max_tokens);
    req.mutable_sampling()->set_temperature(o_.temperature);
    req.mutable_sampling()->set_seed(o_.seed);
    grpc::ClientContext ctx;
    context(ctx);
    auto reader = stub_.Chat(&ctx, req);
    GenerateResponse r;
    while (reader->Read(&r)) {
      std::fputs(r.text().c_str(), stdout);
      std::fflush(stdout);
      if (r.finished()) {
        std::fprintf(stderr, "\n[%s: %lld tokens; %lld reused, %lld computed]\n",
                     FinishReason_Name(r.finish_reason()).c_str(), static_cast<long long>(r.usage().output_tokens()),
                     static_cast<long long>(r.usage().cached_tokens()),
                     static_cast<long long>(r.usage().prefilled_tokens()));
      }
    }
    if (auto s = reader->Finish(); !s.ok()) return std::printf("\n"), report(s), false;
    first_ = false;
    return true;
  }

  // A /command; false to quit.
  bool command(const std::string& line) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    grpc::ClientContext ctx;
    context(ctx);
    if (cmd == "/quit" || cmd == "/exit") return false;
    if (cmd == "/rollback") {
      long long n = -1;
      if (!(in >> n) || n < 0) {
        std::fprintf(stderr, "usage: /rollback N   (drops the last N tokens)\n");
        return true;
      }
      RollbackRequest req;
      req.set_session_id(session_);
      req.set_n(n);
      RollbackResponse r;
      if (auto s = stub_.Rollback(&ctx, req, &r); !s.ok()) report(s);
      else std::fprintf(stderr, "[%lld tokens left]\n", static_cast<long long>(r.length()));
    } else if (cmd == "/reset") {
      ResetRequest req;
      req.set_session_id(session_);
      ResetResponse r;
      if (auto s = stub_.Reset(&ctx, req, &r); !s.ok()) report(s);
      else first_ = true, std::fprintf(stderr, "[reset]\n");
    } else if (cmd == "/fork") {
      ForkRequest req;
      req.set_session_id(session_);
      ForkResponse r;
      if (auto s = stub_.Fork(&ctx, req, &r); !s.ok()) {
        report(s);
      } else {
        std::fprintf(stderr, "[now on the fork %s; the parent %s stays as it was]\n", r.session_id().c_str(),
                     session_.c_str());
        session_ = r.session_id();
      }
    } else if (cmd == "/info") {
      GetSessionRequest req;
      req.set_session_id(session_);
      SessionInfo r;
      if (auto s = stub_.GetSession(&ctx, req, &r); !s.ok()) return report(s), true;
      grpc::ClientContext c2;
      context(c2);
      GetConversationRequest creq;
      creq.set_session_id(session_);
      Conversation conv;
      if (auto s = stub_.GetConversation(&c2, creq, &conv); !s.ok()) return report(s), true;
      std::fprintf(stderr, "[session %s: %lld tokens, %lld cached, %lld pages; %d messages]\n", session_.c_str(),
                   static_cast<long long>(r.length()), static_cast<long long>(r.cached()),
                   static_cast<long long>(r.pages_held()), conv.messages_size());
    } else {
      std::fprintf(stderr, "commands: /rollback N, /reset, /fork, /info, /quit\n");
    }
    return true;
  }

  const std::string& session() const { return session_; }

 private:
  Combs::Stub& stub_;
  const ChatOptions& o_;
  std::string session_;
  bool first_ = true;
};

bool read_line(bool tty, std::string* line) {
  if (!tty) return static_cast<bool>(std::getline(std::cin, *line));
  char* l = readline("> ");
  if (l == nullptr) return false;
  *line = l;
  if (!line->empty()) add_history(l);
  free(l);
  return true;
}

}  // namespace

int run_chat(Combs::Stub& stub, const ChatOptions& o) {
  Chat chat(stub, o);
  if (!chat.ensure_session()) return 1;
  if (!o.messages_file.empty()) {
    std::ifstream f(o.messages_file, std::ios::binary);
    if (!f) return std::fprintf(stderr, "combs chat: cannot read %s\n", o.messages_file.c_str()), 2;
    const auto j = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()),
                                         nullptr, /*allow_exceptions=*/false);
    if (!j.is_array()) return std::fprintf(stderr, "combs chat: %s: expected a JSON array of messages\n", o.messages_file.c_str()), 2;
    std::vector<std::pair<std::string, std::string>> messages;
    for (size_t i = 0; i < j.size(); ++i) {
      const auto& m = j[i];
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          (m.contains("content") && !m["content"].is_string())) {
        return std::fprintf(stderr, "combs chat: %s: message %zu needs a string role and content\n",
                            o.messages_file.c_str(), i), 2;
      }
      messages.emplace_back(m["role"].get<std::string>(), m.value("content", std::string()));
    }
    const bool ok = chat.turn(messages);
    std::printf("\n");
    return ok ? 0 : 1;
  }
  const bool tty = isatty(0);
  if (tty) std::fprintf(stderr, "combs chat on %s: type a message; /rollback N, /reset, /fork, /info, /quit\n", chat.session().c_str());
  std::string line;
  while (read_line(tty, &line)) {
    if (line.empty()) continue;
    if (line[0] == '/') {
      if (!chat.command(line)) break;
      continue;
    }
    chat.turn({{"user", line}});
    std::printf("\n");
  }
  return 0;
}

}  // namespace combs::cli
