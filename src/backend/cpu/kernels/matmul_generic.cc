// matmul kernels for generic (flags set in CMakeLists.txt).
#include <algorithm>
#define COMBS_ISA_NS generic
#include "kernels/matmul_kernels.inc"
