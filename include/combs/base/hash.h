// Combining 64-bit values into a key (not cryptographic; for launch keys and cache keys).
#pragma once

#include <cstdint>

namespace combs {

// h with v mixed in: order matters, every bit of v reaches h.
inline uint64_t hash_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0x100000001b3ull;
}

}  // namespace combs
