// Chat templates: combs' Jinja engine renders the 50 real templates of tests/data/chat byte for
// byte as Python's jinja2 does with Hugging Face's settings (tests/reference/render_templates.py,
// run here), for each conversation of tests/data/chat/contexts.json; where jinja2 fails, combs
// fails, with the template's own message where the template raises it.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <map>
#include <sstream>

#include "combs/chat/jinja.h"
#include "support/temp_dir.h"

using namespace combs;

namespace {

constexpr std::time_t kNow = 1764633600;  // 2025-12-02 00:00:00 UTC, what strftime_now formats

std::string data(const std::string& name) { return std::string(COMBS_TEST_DATA_DIR) + "/chat/" + name; }

std::vector<std::string> templates() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(data("")))
    if (e.path().extension() == ".jinja") out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The reference's JSON lines for every template and context.
std::vector<nlohmann::ordered_json> reference(const std::vector<std::string>& names) {
  combs::testing::TempDir dir;
  std::string cmd = std::string(COMBS_PYTHON) + " " + COMBS_REFERENCE_DIR "/render_templates.py " +
                    std::to_string(kNow) + " " + data("contexts.json");
  for (const auto& n : names) cmd += " " + data(n);
  cmd += " > " + dir.file("ref.jsonl");
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::istringstream lines(combs::testing::read_file(dir.file("ref.jsonl")));
  std::vector<nlohmann::ordered_json> out;
  for (std::string line; std::getline(lines, line);) out.push_back(nlohmann::ordered_json::parse(line));
  return out;
}

}  // namespace

TEST_CASE("50 real chat templates render as jinja2 renders them", "[chat]") {
  setenv("TZ", "UTC", 1);
  tzset();
  const auto names = templates();
  REQUIRE(names.size() == 50);
  const auto contexts = nlohmann::ordered_json::parse(combs::testing::read_file(data("contexts.json")));
  const auto ref = reference(names);
  REQUIRE(ref.size() == names.size() * contexts.size());
  std::map<std::string, StatusOr<jinja::Template>> parsed;
  int same = 0, both_fail = 0;
  for (const auto& r : ref) {
    const std::string name = r["template"];
    const size_t i = r["case"];
    if (!parsed.count(name)) parsed.emplace(name, jinja::Template::parse(combs::testing::read_file(data(name))));
    const auto& t = parsed.at(name);
    INFO(name << " case " << i);
    StatusOr<std::string> out = t.ok() ? t->render(contexts[i], kNow) : StatusOr<std::string>(t.status());
    if (r["ok"]) {
      INFO(out.status().to_string());
      CHECK(out.ok());
      if (out.ok()) CHECK(*out == r["output"].get<std::string>());
      same += out.ok() && *out == r["output"].get<std::string>();
    } else {
      INFO("jinja2: " << r["error"].get<std::string>());
      CHECK_FALSE(out.ok());
      if (!out.ok()) {
        CHECK(out.status().code() == StatusCode::kInvalidArgument);
        if (r["raised"]) CHECK(out.status().message() == r["error"].get<std::string>());
        ++both_fail;
      }
    }
  }
  WARN(same << " renderings equal, " << both_fail << " failures where jinja2 fails too");
}

TEST_CASE("combs-template prints the rendering and only it and fails with the template's message", "[chat]") {
  const auto names = templates();
  const auto contexts = nlohmann::ordered_json::parse(combs::testing::read_file(data("contexts.json")));
  const auto ref = reference(names);
  combs::testing::TempDir dir;
  auto run = [&](const std::string& tmpl, const nlohmann::ordered_json& context) {
    std::ofstream(dir.file("c.json")) << context.dump();
    const std::string cmd = "TZ=UTC " + std::string(COMBS_TEMPLATE_BIN) + " --template " + data(tmpl) + " --context " +
                            dir.file("c.json") + " --now " + std::to_string(kNow) + " > " + dir.file("out") + " 2> " +
                            dir.file("err");
    const int rc = std::system(cmd.c_str());
    return std::make_tuple(WEXITSTATUS(rc), combs::testing::read_file(dir.file("out")),
                           combs::testing::read_file(dir.file("err")));
  };
  int rendered = 0, raised = 0;
  for (const auto& r : ref) {
    if (r["ok"] && rendered < 3) {  // a few renderings through the tool, byte for byte
      const auto [rc, out, err] = run(r["template"], contexts[r["case"].get<size_t>()]);
      INFO(r["template"].get<std::string>() << " case " << r["case"] << ": " << err);
      CHECK(rc == 0);
      CHECK(out == r["output"].get<std::string>());
      CHECK(err.empty());
      ++rendered;
    } else if (!r["ok"] && r["raised"] && raised < 2) {
      const auto [rc, out, err] = run(r["template"], contexts[r["case"].get<size_t>()]);
      CHECK(rc == 1);
      CHECK(out.empty());
      CHECK_THAT(err, Catch::Contains(r["error"].get<std::string>()));
      ++raised;
    }
  }
  CHECK(rendered == 3);
  CHECK(raised == 2);
  std::ofstream(dir.file("bad.json")) << "{not json";
  const std::string cmd = std::string(COMBS_TEMPLATE_BIN) + " --template " + data(names[0]) + " --context " +
                          dir.file("bad.json") + " > /dev/null 2>&1";
  CHECK(WEXITSTATUS(std::system(cmd.c_str())) == 1);
}
