#include "combs/chat/jinja.h"

#include "jinja_internal.h"

namespace combs::jinja {

StatusOr<Template> Template::parse(std::string_view source, const Options& options) {
  try {
    auto program = parse_program(source, options);
    check_program(*program);
    Template t;
    t.program_ = std::move(program);
    t.options_ = options;
    return t;
  } catch (const Error& e) {
    return invalid_argument_error(std::string("template: ") + e.what());
  } catch (const std::bad_alloc&) {
    return resource_exhausted_error("template: out of memory while parsing");
  }
}

StatusOr<std::string> Template::render(const nlohmann::ordered_json& context, std::time_t now) const {
  if (!program_) return failed_precondition_error("template: not parsed");
  try {
    return render_program(*program_, options_, context, now);
  } catch (const Error& e) {
    return invalid_argument_error(e.what());
  } catch (const std::bad_alloc&) {
    return resource_exhausted_error("template: out of memory while rendering");
  }
}

StatusOr<std::string> Template::render(const nlohmann::ordered_json& context) const {
  return render(context, std::time(nullptr));
}

}  // namespace combs::jinja
