// SHA-256 (OpenSSL's), for content addresses that must not collide: the prefix cache's page keys
// and model fingerprints.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace combs {

using Digest = std::array<uint8_t, 32>;

// Incremental: update() any number of times, then finish() once. Thread-compatible.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  Sha256& update(const void* data, size_t n);
  Sha256& update(std::string_view s) { return update(s.data(), s.size()); }
  // A value's bytes as the machine holds them (little-endian here), with no length.
  template <typename T>
  Sha256& update_pod(const T& v) {
    return update(&v, sizeof v);
  }
  // A string's length (8 bytes), then its bytes: concatenations cannot collide.
  Sha256& update_framed(std::string_view s) {
    update_pod(static_cast<uint64_t>(s.size()));
    return update(s);
  }
  Digest finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// 64 lowercase hex digits.
std::string to_hex(const Digest& d);

// For unordered containers keyed by a digest: its first 8 bytes (already uniformly spread).
struct DigestHash {
  size_t operator()(const Digest& d) const {
    uint64_t h;
    static_assert(sizeof h <= sizeof(Digest));
    __builtin_memcpy(&h, d.data(), sizeof h);
    return static_cast<size_t>(h);
  }
};

}  // namespace combs
