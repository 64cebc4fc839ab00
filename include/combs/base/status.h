// Status and StatusOr<T>: how errors cross module boundaries in combs (no exceptions across them).
//
// The codes are gRPC's, one for one, so the server maps an engine Status to a gRPC status without a
// table. Thread-compatible value types.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace combs {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "RESOURCE_EXHAUSTED: page pool exhausted ..." or "OK".
  std::string to_string() const;

  // Marks an intentionally ignored status.
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }
inline Status invalid_argument_error(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status failed_precondition_error(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status resource_exhausted_error(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status out_of_range_error(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status not_found_error(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status unavailable_error(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status unimplemented_error(std::string m) {
  return {StatusCode::kUnimplemented, std::move(m)};
}

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr needs a value or an error");
    if (status_.ok()) status_ = internal_error("StatusOr constructed from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace combs

#define COMBS_CONCAT_INNER_(a, b) a##b
#define COMBS_CONCAT_(a, b) COMBS_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define COMBS_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::combs::Status combs_status_ = (expr);      \
    if (!combs_status_.ok()) return combs_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status from the enclosing function.
#define COMBS_ASSIGN_OR_RETURN(lhs, expr) \
  COMBS_ASSIGN_OR_RETURN_IMPL_(COMBS_CONCAT_(combs_statusor_, __LINE__), lhs, expr)
#define COMBS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
