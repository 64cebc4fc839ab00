// Matrix-product kernels compiled once per instruction set (see matmul_<isa>.cc); cpu_ops.cc picks
// one at run time. Internal to the CPU backend.
#pragma once

#include <cstdint>

#include "combs/backend/dtype.h"

namespace combs::cpu {

// One task of a matmul: rows [row0, row1) of w for all n_tokens tokens. x_bf16 is x rounded to
// bf16 (only read by kernels with native bf16 dot products; may be null otherwise).
struct MatmulTask {
  const void* w;
  DType dtype;
  int64_t in;
  const float* x;
  const uint16_t* x_bf16;
  int64_t n_tokens;
  float* y;
  int64_t out;
  const float* bias;
};

using MatmulKernel = void (*)(const MatmulTask& task, int64_t row0, int64_t row1);

namespace avx512bf16 {
void matmul_rows(const MatmulTask& task, int64_t row0, int64_t row1);
}
namespace avx2 {
void matmul_rows(const MatmulTask& task, int64_t row0, int64_t row1);
}
namespace generic {
void matmul_rows(const MatmulTask& task, int64_t row0, int64_t row1);
}

}  // namespace combs::cpu
