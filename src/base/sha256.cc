#include "combs/base/sha256.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>

namespace combs {

// EVP_MD_CTX is opaque; a failing OpenSSL call here means the library is broken (SHA-256 needs
// no provider beyond the default one), which no caller could handle.
struct Sha256::State {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~State() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : state_(std::make_unique<State>()) {
  if (state_->ctx == nullptr || EVP_DigestInit_ex(state_->ctx, EVP_sha256(), nullptr) != 1) {
    std::fprintf(stderr, "combs: OpenSSL's SHA-256 is unavailable\n");
    std::abort();
  }
}

Sha256::~Sha256() = default;

Sha256& Sha256::update(const void* data, size_t n) {
  EVP_DigestUpdate(state_->ctx, data, n);
  return *this;
}

Digest Sha256::finish() {
  Digest d{};
  unsigned int n = 0;
  EVP_DigestFinal_ex(state_->ctx, d.data(), &n);
  return d;
}

std::string to_hex(const Digest& d) {
  static const char* kHex = "0123456789abcdef";
  std::string s(2 * d.size(), '0');
  for (size_t i = 0; i < d.size(); ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}

}  // namespace combs
