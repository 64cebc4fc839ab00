// Chat turns on sessions: the conversation is rendered with the chat template, only what the new
// rendering does not share with the history is computed, edits roll back to where the rendering
// changes, the end of a turn stops the reply, and bad messages are INVALID_ARGUMENT.
#include <catch2/catch.hpp>

#include "combs/chat/jinja.h"
#include "combs/engine/engine.h"
#include "combs/model/random_model.h"
#include "combs/model/tokenizer.h"
#include "support/engine_helpers.h"
#include "support/temp_dir.h"

using namespace combs;
using namespace combs::testing;

namespace {

// Llama 3's turn format (no trimming, no date: the reply is rendered back as it was generated).
const char* kTemplate =
    "{{ bos_token }}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}{% if m.content is not defined %}"
    "{{ raise_exception('a message without content') }}{% endif %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";

constexpr int32_t kEotId = 128009;  // <|eot_id|>

struct ChatModel {
  TempDir dir;
  std::string path;
  ChatModel() {
    RandomModelOptions o;
    o.shape = std::move(named_shape("tiny")).value();
    o.vocab_path = std::string(COMBS_TEST_DATA_DIR) + "/vocab/ggml-vocab-llama-bpe.gguf";
    o.seed = 11;
    path = dir.file("chat.gguf");
    REQUIRE(write_random_model(o, path).ok());
  }
  std::unique_ptr<Engine> engine(std::string chat_template = kTemplate) const {
    EngineOptions eo;
    eo.threads = 2;
    eo.kv_memory_bytes = 64 << 20;
    eo.chat_template = std::move(chat_template);
    auto m = Model::load(path);
    REQUIRE(m.ok());
    auto e = Engine::create(std::move(m).value(), eo);
    REQUIRE(e.ok());
    return std::move(e).value();
  }
};

ChatRequest turn(const std::string& role, const std::string& content, int max_tokens = 6) {
  ChatRequest r;
  r.messages.push_back({{"role", role}, {"content", content}});
  r.max_tokens = max_tokens;
  SamplingParams greedy;
  greedy.temperature = 0;
  r.sampling = greedy;
  return r;
}

struct Turn {
  Collector c;
  Status started;
};
void chat(Engine& e, const SessionId& id, ChatRequest r, Turn& t) {
  auto h = e.chat(id, std::move(r), t.c.sink());
  t.started = h.status();
  if (h.ok()) t.c.wait();
}

}  // namespace

TEST_CASE("a 10-turn chat prefills only each new turn", "[engine]") {
  ChatModel cm;
  auto e = cm.engine();
  const SessionId id = e->create_session().value();
  int64_t length = 0;
  for (int k = 0; k < 10; ++k) {
    Turn t;
    chat(*e, id, turn("user", "Turn " + std::to_string(k) + ": tell me something new."), t);
    INFO("turn " << k << ": " << t.started.to_string() << " " << t.c.status.to_string());
    REQUIRE(t.started.ok());
    REQUIRE(t.c.finish != FinishKind::kError);
    // Nothing of the history before the turn is computed again: the cache holds all of it but the
    // last reply's last token (sampled, never fed), and what is prefilled is that token and the
    // turn's new text (the end of the reply, the user's message, the assistant's header).
    CHECK(t.c.usage.cached_tokens == std::max<int64_t>(0, length - 1));
    CHECK(t.c.usage.cached_tokens + t.c.usage.prefilled_tokens == length + t.c.usage.input_tokens);
    CHECK(t.c.usage.input_tokens < 40);
    const int64_t now = e->info(id).value().length;
    CHECK(now == length + t.c.usage.input_tokens + t.c.usage.output_tokens);
    length = now;
  }
  const auto conv = e->conversation(id).value();
  REQUIRE(conv.size() == 20);
  CHECK(conv[19]["role"] == "assistant");
  // The history is what the template renders of the whole conversation, plus the last reply.
  auto tok = Tokenizer::from_gguf(e->model().file());
  REQUIRE(tok.ok());
  auto tmpl = jinja::Template::parse(kTemplate);
  REQUIRE(tmpl.ok());
  nlohmann::ordered_json before = conv;
  before.erase(before.size() - 1);
  auto text = tmpl->render({{"messages", before}, {"add_generation_prompt", true}, {"bos_token", "<|begin_of_text|>"}}, 0);
  REQUIRE(text.ok());
  const auto prompt = (*tok)->encode(*text, {false, true});
  REQUIRE(e->info(id).value().length > static_cast<int64_t>(prompt.size()));
  CHECK(e->check_invariants().ok());
}

TEST_CASE("editing an earlier turn rolls back to it and a fork keeps the conversation", "[engine]") {
  ChatModel cm;
  auto e = cm.engine();
  const SessionId id = e->create_session().value();
  for (int k = 0; k < 4; ++k) {
    Turn t;
    chat(*e, id, turn("user", "Question " + std::to_string(k)), t);
    REQUIRE(t.started.ok());
  }
  const SessionId twin = e->fork(id).value();
  CHECK(e->conversation(twin).value() == e->conversation(id).value());
  const int64_t length = e->info(id).value().length;
  auto conv = e->conversation(id).value();  // 8 messages; turn 3's question is message 4
  conv[4]["content"] = "Question 2, edited";
  conv.erase(conv.begin() + 5, conv.end());
  // The tokens that stay: the rendering of the first four messages (those before the edit).
  auto tok = Tokenizer::from_gguf(e->model().file());
  auto tmpl = jinja::Template::parse(kTemplate);
  nlohmann::ordered_json head(conv.begin(), conv.begin() + 4);
  const auto kept = (*tok)->encode(*tmpl->render({{"messages", head}, {"add_generation_prompt", false},
                                                  {"bos_token", "<|begin_of_text|>"}}, 0), {false, true});
  ChatRequest edit;
  edit.messages = conv;
  edit.replace = true;
  edit.max_tokens = 4;
  Turn t;
  chat(*e, id, std::move(edit), t);
  REQUIRE(t.started.ok());
  REQUIRE(t.c.finish != FinishKind::kError);
  CHECK(t.c.usage.cached_tokens >= static_cast<int64_t>(kept.size()));
  CHECK(t.c.usage.cached_tokens < length);
  const auto after = e->conversation(id).value();
  REQUIRE(after.size() == 6);
  CHECK(after[4]["content"] == "Question 2, edited");
  CHECK(e->conversation(twin).value().size() == 8);  // the fork is untouched
  CHECK(e->check_invariants().ok());
}

TEST_CASE("the end of a turn stops the reply and is not part of it", "[engine]") {
  ChatModel cm;
  auto e = cm.engine();
  const SessionId id = e->create_session().value();
  ChatRequest r = turn("user", "Say nothing.", 50);
  r.sampling->logit_bias.emplace_back(kEotId, 1000.0f);  // <|eot_id|> at once
  Turn t;
  chat(*e, id, std::move(r), t);
  REQUIRE(t.started.ok());
  CHECK(t.c.finish == FinishKind::kEos);
  CHECK(t.c.tokens == std::vector<int32_t>{kEotId});
  const auto conv = e->conversation(id).value();
  REQUIRE(conv.size() == 2);
  CHECK(conv[1]["content"] == "");
  // ignore_eos goes on past it.
  ChatRequest more = turn("user", "Now talk.", 5);
  more.sampling->logit_bias.emplace_back(kEotId, 1000.0f);
  more.ignore_eos = true;
  Turn t2;
  chat(*e, id, std::move(more), t2);
  REQUIRE(t2.started.ok());
  CHECK(t2.c.finish == FinishKind::kLength);
  CHECK(t2.c.tokens.size() == 5);
}

TEST_CASE("bad chat messages and a model without a template are refused", "[engine]") {
  ChatModel cm;
  auto e = cm.engine();
  const SessionId id = e->create_session().value();
  auto refused = [&](ChatRequest r) {
    Collector c;
    return e->chat(id, std::move(r), c.sink()).status();
  };
  Status s = refused(turn("narrator", "Once upon a time"));
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("unknown role: narrator"));  // the template's message
  ChatRequest no_content;
  no_content.messages.push_back({{"role", "user"}});
  s = refused(no_content);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("a message without content"));
  ChatRequest not_text;
  not_text.messages.push_back({{"role", "user"}, {"content", {1, 2}}});
  CHECK(refused(not_text).code() == StatusCode::kInvalidArgument);
  ChatRequest no_role;
  no_role.messages.push_back({{"content", "hi"}});
  CHECK(refused(no_role).code() == StatusCode::kInvalidArgument);
  ChatRequest not_array;
  not_array.messages = {{"role", "user"}};
  CHECK(refused(not_array).code() == StatusCode::kInvalidArgument);
  CHECK(e->info(id).value().length == 0);  // nothing happened to the session
  CHECK(e->conversation(id).value().empty());
  // The session still chats.
  Turn t;
  chat(*e, id, turn("user", "hello"), t);
  CHECK(t.started.ok());

  auto plain = cm.engine("");  // the random model's file has no chat template
  const SessionId p = plain->create_session().value();
  Collector c;
  s = plain->chat(p, turn("user", "hi"), c.sink()).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("no chat template"));
  auto broken = cm.engine("{% if %}");
  s = broken->chat(broken->create_session().value(), turn("user", "hi"), c.sink()).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("does not parse"));
}

TEST_CASE("a template that rewrites earlier turns rolls back to the rewrite", "[engine]") {
  // Like templates that drop the reasoning of earlier replies: an assistant message that is not
  // the last renders as a placeholder.
  const std::string rewriting =
      "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
      "{% if m.role == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m.content }}{% endif %}"
      "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
  ChatModel cm;
  auto e = cm.engine(rewriting);
  const SessionId id = e->create_session().value();
  Turn first;
  chat(*e, id, turn("user", "First question"), first);
  REQUIRE(first.started.ok());
  REQUIRE(first.c.usage.output_tokens > 0);
  // What the second rendering shares with the history: the first turn's prompt, up to the reply.
  auto tok = Tokenizer::from_gguf(e->model().file());
  auto tmpl = jinja::Template::parse(rewriting);
  nlohmann::ordered_json one = nlohmann::ordered_json::array();
  one.push_back({{"role", "user"}, {"content", "First question"}});
  const auto prompt = (*tok)->encode(*tmpl->render({{"messages", one}, {"add_generation_prompt", true},
                                                    {"bos_token", "<|begin_of_text|>"}}, 0), {false, true});
  Turn second;
  chat(*e, id, turn("user", "Second question"), second);
  REQUIRE(second.started.ok());
  CHECK(second.c.usage.cached_tokens == static_cast<int64_t>(prompt.size()));
  CHECK(second.c.usage.prefilled_tokens == second.c.usage.input_tokens);
  const auto conv = e->conversation(id).value();
  REQUIRE(conv.size() == 4);
  CHECK(conv[1]["role"] == "assistant");  // the conversation keeps the first reply as it was
  CHECK(e->check_invariants().ok());
}
