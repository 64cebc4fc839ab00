// matmul kernels for avx2 (flags set in CMakeLists.txt).
#include <algorithm>
#define COMBS_ISA_NS avx2
#include "kernels/matmul_kernels.inc"
