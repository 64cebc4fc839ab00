// What the int8 kernels of every instruction set share (quant_dot_avx512vnni.cc, quant_dot_avx2.cc;
// included by those files only). In an unnamed namespace on purpose: each kernel file compiles its
// own copy with its own instruction-set flags. An inline function with external linkage would be
// one symbol for the linker, which could keep the AVX-512 file's copy for the AVX2 kernels too.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/quant_dot.h"

namespace combs::cpu {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The cache lines of [at, at + bytes) requested now.
inline void prefetch(const uint8_t* at, int bytes) {
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(at) + off, _MM_HINT_T0);
}

// A row is one sequential stream, but a short one (a few KB): the cache lines of the block `bytes`
// long 2 KB ahead are requested while this one is computed (as the BF16 decode kernel does).
inline void prefetch_ahead(const uint8_t* block, int bytes) { prefetch(block + 2048, bytes); }

// x[0, n) (n a multiple of 256) as n / 256 blocks: d = max|x| / 127, q = nearest(x * (127 / max)).
inline void quantize_act_blocks(const float* x, int64_t n, BlockQ8Act* out) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256, ++out) {
    float amax = 0.0f;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(x[i]));
    out->d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 16 * j; i < 16 * j + 16; ++i) {
        const int q = static_cast<int>(std::nearbyint(x[i] * inv));
        out->q[i] = static_cast<int8_t>(std::clamp(q, -127, 127));
        s += out->q[i];
      }
      out->sums[j] = static_cast<int16_t>(s);
    }
  }
}

}  // namespace
}  // namespace combs::cpu
