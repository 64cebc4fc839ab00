// combs-template: renders a chat template with a context, as Hugging Face's apply_chat_template
// would (jinja2 with trim_blocks and lstrip_blocks), and prints the rendering and nothing else.
//   combs-template (--template FILE.jinja | --model MODEL.gguf [--name NAME]) [--context CONTEXT.json] [--now SECONDS]
// With --model the template is the file's tokenizer.chat_template (or tokenizer.chat_template.NAME),
// and bos_token / eos_token default to the vocabulary's. On an error: exit 1, the message on stderr.
#include <cstdio>
#include <ctime>
#include <string>

#include "combs/chat/jinja.h"
#include "combs/model/gguf.h"
#include "combs/model/tokenizer.h"
#include "common/files.h"
#include "common/flags.h"

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "combs-template: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace combs;
  tools::Flags flags("combs-template", {{"template", ""}, {"model", ""}, {"name", ""}, {"context", ""}, {"now", ""}});
  if (!flags.parse(argc, argv)) return 2;
  if (flags.help_requested()) {
    flags.print_usage("(--template FILE.jinja | --model MODEL.gguf [--name NAME]) [--context CONTEXT.json] [--now SECONDS]");
    return 0;
  }
  if (flags.given("template") == flags.given("model")) {
    std::fprintf(stderr, "combs-template: give exactly one of --template and --model\n");
    return 2;
  }
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  if (flags.given("context")) {
    std::string text;
    if (!tools::read_file(flags.str("context"), &text)) return fail("cannot read " + flags.str("context"));
    context = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (context.is_discarded()) return fail(flags.str("context") + ": not valid JSON");
    if (!context.is_object()) return fail(flags.str("context") + ": the context must be a JSON object");
  }
  std::time_t now = std::time(nullptr);
  if (flags.given("now")) {
    long long s;
    if (!flags.integer("now", &s, 0, 1LL << 40)) return 2;
    now = static_cast<std::time_t>(s);
  }
  std::string source;
  if (flags.given("template")) {
    if (!tools::read_file(flags.str("template"), &source)) return fail("cannot read " + flags.str("template"));
  } else {
    auto file = gguf::GgufFile::open(flags.str("model"));
    if (!file.ok()) return fail(file.status().to_string());
    const std::string key = flags.str("name").empty() ? "tokenizer.chat_template" : "tokenizer.chat_template." + flags.str("name");
    if (!(*file)->find(key)) return fail(flags.str("model") + " has no " + key);
    auto s = (*file)->get_string(key);
    if (!s.ok()) return fail(s.status().to_string());
    source = *s;
    if (auto tok = Tokenizer::from_gguf(**file); tok.ok()) {
      auto text = [&](int32_t id) { return id >= 0 ? (*tok)->token_text(id) : std::string(); };
      if (!context.contains("bos_token")) context["bos_token"] = text((*tok)->bos_id());
      if (!context.contains("eos_token")) context["eos_token"] = text((*tok)->eos_id());
    }
  }
  auto tmpl = jinja::Template::parse(source);
  if (!tmpl.ok()) return fail(tmpl.status().message());
  auto out = tmpl->render(context, now);
  if (!out.ok()) return fail(out.status().message());
  std::fwrite(out->data(), 1, out->size(), stdout);
  return 0;
}
