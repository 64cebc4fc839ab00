// A Jinja template engine that renders what Python's jinja2 renders (3.1) for the templates chat
// models ship: statements if/for/set/macro/call-free filter blocks/break/continue (loop controls),
// `{% generation %}` (Hugging Face's marker, rendered as its body), whitespace control (`-`, `+`,
// trim_blocks, lstrip_blocks), expressions with Python's semantics (str, int, float, list, tuple,
// dict, None; `~`, slicing, `in`, `is` tests, filters), the Python string/list/dict methods real
// templates call, namespace(), range(), and Hugging Face's globals raise_exception and
// strftime_now. Names that are not set are jinja2's default Undefined: they print as nothing,
// iterate as empty and fail when used further (attribute of, arithmetic with, call).
//
// As Hugging Face renders (transformers' apply_chat_template): an immutable sandbox — methods that
// change a list or dict (append, pop, update, ...) fail, as jinja2's ImmutableSandboxedEnvironment
// makes them; `tojson` is json.dumps(x, ensure_ascii=False) with its indent/separators/sort_keys.
//
// Bad templates and bad inputs are errors, never a crash or a hang: parsing and rendering bound
// the nesting depth, the number of loop iterations and macro calls, and the output size.
//
// Template is immutable after parse(); render() is safe from several threads at once.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "combs/base/status.h"

namespace combs::jinja {

struct Limits {
  int max_depth = 200;                  // nesting of statements and expressions, and of macro calls
  int64_t max_steps = 5'000'000;        // loop iterations and macro calls of one render
  size_t max_output = 64u << 20;        // bytes of one render
  size_t max_source = 4u << 20;         // bytes of a template
};

struct Options {
  bool trim_blocks = true;    // the first newline after a block tag is removed (Hugging Face's)
  bool lstrip_blocks = true;  // whitespace before a block tag on its line is removed (Hugging Face's)
  Limits limits;
};

struct Program;  // the parsed template (internal)

class Template {
 public:
  // INVALID_ARGUMENT naming the line and what is wrong for a template that does not parse.
  static StatusOr<Template> parse(std::string_view source, const Options& options = {});

  // Renders with `context` (a JSON object: its keys are the template's variables). `now` is what
  // strftime_now formats (local time). INVALID_ARGUMENT with the template's message where the
  // template raises (raise_exception) or fails (a type error, an undefined name used, a limit).
  StatusOr<std::string> render(const nlohmann::ordered_json& context, std::time_t now) const;
  StatusOr<std::string> render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const Program> program_;
  Options options_;
};

}  // namespace combs::jinja
