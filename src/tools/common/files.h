// Reading the files the tools are given (templates, contexts, certificates).
#pragma once

#include <string>

#include "combs/base/status.h"

namespace combs::tools {

// The bytes of the file at path; false where it cannot be opened.
bool read_file(const std::string& path, std::string* out);

// A chat template file (Jinja source), checked to parse: INVALID_ARGUMENT naming the file where it
// cannot be read or does not parse.
StatusOr<std::string> read_chat_template(const std::string& path);

}  // namespace combs::tools
