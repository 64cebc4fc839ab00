// combs: command-line client of a combs server.
//   combs [--server ADDR] health | create | generate | chat | rollback | reset | fork | info | list | close | tokenize
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>

#include "chat.h"
#include "combs/v1/combs.grpc.pb.h"
#include "common/flags.h"

namespace {

using namespace combs::v1;

int fail(const grpc::Status& s) {
  std::fprintf(stderr, "combs: %d %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
  return 1;
}

// grpc.health.v1.Health/Check without its generated stubs: an empty request, and a response whose
// field 1 (status) is 1 for SERVING.
int health(grpc::Channel& channel) {
  grpc::GenericStub stub(channel.shared_from_this());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice empty_message("", 0);  // an empty HealthCheckRequest (service "": the server)
  grpc::ByteBuffer request(&empty_message, 1), response;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return fail(status);
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const bool serving = bytes.size() >= 2 && bytes[0] == 0x08 && bytes[1] == 0x01;
  std::printf("%s\n", serving ? "SERVING" : "NOT_SERVING");
  return serving ? 0 : 1;
}

void print_info(const SessionInfo& i) {
  std::printf("%s length=%lld cached=%lld pages=%lld shared=%lld%s\n", i.session_id().c_str(),
              static_cast<long long>(i.length()), static_cast<long long>(i.cached()),
              static_cast<long long>(i.pages_held()), static_cast<long long>(i.pages_shared()),
              i.generating() ? " generating" : "");
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage =
      "usage: combs [--server ADDR] [--api-key KEY] [--tls-ca CA.pem] COMMAND [flags]\n"
      "  health                         is the server serving?\n"
      "  create                         open a session, print its id\n"
      "  generate [--session ID] (--prompt TEXT | --ids \"1 2\") [--max-tokens N] [--temperature T]\n"
      "           [--seed S]            stream the generated text (a new session when none is given)\n"
      "  chat [--session ID] [--system TEXT] [--messages FILE.json] [--max-tokens N] [--temperature T] [--seed S]\n"
      "                                 a conversation with the model's chat template: interactive (/rollback N,\n"
      "                                 /reset, /fork, /info, /quit), or the messages of FILE.json as one turn\n"
      "  rollback --session ID --n N    drop the last N tokens, print the new length\n"
      "  reset|fork|info|close --session ID\n"
      "  list                           the sessions\n"
      "  tokenize --prompt TEXT         print the token ids\n";
  std::string server = "127.0.0.1:50051", api_key, tls_ca;
  int first = 1;
  while (first + 1 < argc) {  // options before the command
    const std::string opt = argv[first];
    if (opt == "--server") server = argv[first + 1];
    else if (opt == "--api-key") api_key = argv[first + 1];
    else if (opt == "--tls-ca") tls_ca = argv[first + 1];
    else break;
    first += 2;
  }
  if (argc <= first || std::string(argv[first]) == "--help") {
    std::fputs(usage, argc <= first ? stderr : stdout);
    return argc <= first ? 2 : 0;
  }
  const std::string cmd = argv[first];
  combs::tools::Flags flags("combs " + cmd, {{"session", ""}, {"prompt", ""}, {"ids", ""}, {"max-tokens", "64"},
                                             {"temperature", "0.8"}, {"seed", "0"}, {"n", "0"},
                                             {"system", ""}, {"messages", ""}});
  if (!flags.parse(argc, argv, first + 1)) return 2;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls_ca.empty()) {
    std::ifstream f(tls_ca, std::ios::binary);
    if (!f) return std::fprintf(stderr, "combs: cannot read --tls-ca %s\n", tls_ca.c_str()), 2;
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    creds = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateChannel(server, creds);
  // A server just started may still be loading: wait for it a while.
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
    std::fprintf(stderr, "combs: no server at %s\n", server.c_str());
    return 1;
  }
  auto stub = Combs::NewStub(channel);
  grpc::ClientContext ctx;
  if (!api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key);
  // For a session-affine proxy (deploy/envoy.yaml routes on this header).
  if (flags.given("session")) ctx.AddMetadata("combs-session-id", flags.str("session"));
  if (cmd == "health") return health(*channel);
  if (cmd == "chat") {
    combs::cli::ChatOptions o;
    o.session = flags.str("session");
    o.api_key = api_key;
    o.system = flags.str("system");
    o.messages_file = flags.str("messages");
    long long max_tokens, seed;
    double temperature;
    if (!flags.integer("max-tokens", &max_tokens, 0, 1 << 24) || !flags.integer("seed", &seed, 0, 1ll << 62) ||
        !flags.number("temperature", &temperature)) {
      return 2;
    }
    if (!flags.given("max-tokens")) max_tokens = 256;
    o.max_tokens = static_cast<int>(max_tokens);
    o.temperature = static_cast<float>(temperature);
    o.seed = static_cast<unsigned long long>(seed);
    return combs::cli::run_chat(*stub, o);
  }
  if (cmd == "create") {
    CreateSessionResponse r;
    if (auto s = stub->CreateSession(&ctx, CreateSessionRequest(), &r); !s.ok()) return fail(s);
    std::printf("%s\n", r.session_id().c_str());
    return 0;
  }
  if (cmd == "generate") {
    GenerateRequest req;
    std::string id = flags.str("session");
    if (id.empty()) {
      grpc::ClientContext c2;
      if (!api_key.empty()) c2.AddMetadata("authorization", "Bearer " + api_key);
      CreateSessionResponse r;
      if (auto s = stub->CreateSession(&c2, CreateSessionRequest(), &r); !s.ok()) return fail(s);
      id = r.session_id();
      std::fprintf(stderr, "combs: session %s\n", id.c_str());
      ctx.AddMetadata("combs-session-id", id);
    }
    req.set_session_id(id);
    if (flags.given("ids")) {
      std::vector<long long> ids;
      if (!flags.ints("ids", &ids)) return 2;
      for (long long t : ids) req.mutable_tokens()->add_ids(static_cast<int32_t>(t));
    } else {
      req.set_text(flags.str("prompt"));
      req.set_add_bos(true);
    }
    long long max_tokens, seed;
    double temperature;
    if (!flags.integer("max-tokens", &max_tokens, 0, 1 << 24) || !flags.integer("seed", &seed, 0, 1ll << 62) ||
        !flags.number("temperature", &temperature)) {
      return 2;
    }
    req.set_max_tokens(static_cast<int32_t>(max_tokens));
    req.mutable_sampling()->set_temperature(static_cast<float>(temperature));
    req.mutable_sampling()->set_seed(static_cast<uint64_t>(seed));
    auto reader = stub->Generate(&ctx, req);
    GenerateResponse r;
    while (reader->Read(&r)) {
      std::fputs(r.text().c_str(), stdout);
      std::fflush(stdout);
      if (r.finished()) {
        std::fprintf(stderr, "\ncombs: finished (%s), %lld tokens\n", FinishReason_Name(r.finish_reason()).c_str(),
                     static_cast<long long>(r.usage().output_tokens()));
      }
    }
    std::printf("\n");
    if (auto s = reader->Finish(); !s.ok()) return fail(s);
    return 0;
  }
  const std::string id = flags.str("session");
  if (cmd == "rollback") {
    long long n;
    if (!flags.integer("n", &n, 0, 1ll << 40)) return 2;
    RollbackRequest req;
    req.set_session_id(id);
    req.set_n(n);
    RollbackResponse r;
    if (auto s = stub->Rollback(&ctx, req, &r); !s.ok()) return fail(s);
    std::printf("%lld\n", static_cast<long long>(r.length()));
    return 0;
  }
  if (cmd == "reset") {
    ResetRequest req;
    req.set_session_id(id);
    ResetResponse r;
    if (auto s = stub->Reset(&ctx, req, &r); !s.ok()) return fail(s);
    return 0;
  }
  if (cmd == "fork") {
    ForkRequest req;
    req.set_session_id(id);
    ForkResponse r;
    if (auto s = stub->Fork(&ctx, req, &r); !s.ok()) return fail(s);
    std::printf("%s\n", r.session_id().c_str());
    return 0;
  }
  if (cmd == "info") {
    GetSessionRequest req;
    req.set_session_id(id);
    SessionInfo r;
    if (auto s = stub->GetSession(&ctx, req, &r); !s.ok()) return fail(s);
    print_info(r);
    return 0;
  }
  if (cmd == "close") {
    CloseSessionRequest req;
    req.set_session_id(id);
    CloseSessionResponse r;
    if (auto s = stub->CloseSession(&ctx, req, &r); !s.ok()) return fail(s);
    return 0;
  }
  if (cmd == "list") {
    ListSessionsResponse r;
    if (auto s = stub->ListSessions(&ctx, ListSessionsRequest(), &r); !s.ok()) return fail(s);
    for (const auto& i : r.sessions()) print_info(i);
    return 0;
  }
  if (cmd == "tokenize") {
    TokenizeRequest req;
    req.set_text(flags.str("prompt"));
    req.set_add_special(true);
    TokenizeResponse r;
    if (auto s = stub->Tokenize(&ctx, req, &r); !s.ok()) return fail(s);
    for (int i = 0; i < r.ids_size(); ++i) std::printf(i ? " %d" : "%d", r.ids(i));
    std::printf("\n");
    return 0;
  }
  std::fprintf(stderr, "combs: unknown command '%s'\n%s", cmd.c_str(), usage);
  return 2;
}
