// Block-quantized weight rows dequantized straight to BF16, for prompt processing (cpu_ops.cc
// rounds each weight matrix to BF16 for oneDNN's GEMM): bit for bit what quant.h's dequantize_row
// followed by f32_to_bf16_row gives, in one pass and in vector registers. Internal to the CPU
// backend; cpu_ops.cc picks them where the CPU has AVX-512 (F, BW), else takes that two-step path.
#pragma once

#include <cstdint>

namespace combs::cpu::avx512 {
// nb blocks at src (super-blocks of 256 for the K formats, blocks of 32 for Q8_0) to nb * 256
// (32) BF16 values at y.
void dequant_bf16_q4_k(const void* src, uint16_t* y, int64_t nb);
void dequant_bf16_q5_k(const void* src, uint16_t* y, int64_t nb);
void dequant_bf16_q6_k(const void* src, uint16_t* y, int64_t nb);
void dequant_bf16_q8_0(const void* src, uint16_t* y, int64_t nb);
}  // namespace combs::cpu::avx512
