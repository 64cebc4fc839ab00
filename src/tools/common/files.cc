#include "files.h"

#include <fstream>
#include <iterator>

#include "combs/chat/jinja.h"

namespace combs::tools {

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

StatusOr<std::string> read_chat_template(const std::string& path) {
  std::string source;
  if (!read_file(path, &source)) return invalid_argument_error(path + ": cannot read it");
  if (auto t = jinja::Template::parse(source); !t.ok()) return invalid_argument_error(path + ": " + t.status().message());
  return source;
}

}  // namespace combs::tools
