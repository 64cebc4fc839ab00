// matmul kernels for avx512bf16 (flags set in CMakeLists.txt).
#include <algorithm>
#define COMBS_ISA_NS avx512bf16
#include "kernels/matmul_kernels.inc"
