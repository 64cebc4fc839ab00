// Data files that install with the binaries (share/combs/ beside bin/), found from the running
// binary's location: the same layout in the build tree (build/<preset>/{bin,share/combs}) and in
// an installed prefix (the container image's /opt/combs), so no path of the source tree is built in.
#pragma once

#include <string>

namespace combs::tools {

// <prefix>/share/combs/NAME, where <prefix> is the folder above the running binary's; empty when
// that file is not there.
std::string installed_data_file(const std::string& name);

// The default vocabulary (Llama 3's, 128,256 tokens): installed_data_file of
// ggml-vocab-llama-bpe.gguf; empty where it is not installed.
std::string default_vocab();

// Llama 3's chat template (Llama 3.2's, from its tokenizer_config.json), the default model's:
// installed_data_file of meta-llama-Llama-3.2-3B-Instruct.jinja; empty where it is not installed.
std::string default_chat_template();

}  // namespace combs::tools
