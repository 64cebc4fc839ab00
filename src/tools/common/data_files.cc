#include "data_files.h"

#include <filesystem>

namespace combs::tools {

std::string installed_data_file(const std::string& name) {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const std::filesystem::path file = exe.parent_path().parent_path() / "share" / "combs" / name;
  return std::filesystem::is_regular_file(file, ec) ? file.string() : std::string();
}

std::string default_vocab() { return installed_data_file("ggml-vocab-llama-bpe.gguf"); }

std::string default_chat_template() { return installed_data_file("meta-llama-Llama-3.2-3B-Instruct.jinja"); }

}  // namespace combs::tools
