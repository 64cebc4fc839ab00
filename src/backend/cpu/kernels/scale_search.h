// The block quantizer's scale search (src/backend/quantize.cc), several candidate scales at once:
// the squared error of rounding n values to the levels lo..hi under each scale, with each
// candidate's arithmetic exactly the scalar search's (the same IEEE operations in the same order:
// the same sums bit for bit), so the files written are the same on every machine. Internal to the
// quantizer; picked at run time where the CPU has AVX-512.
#pragma once

namespace combs::cpu::avx512 {

// e[j] = sum over i in order of (double)(x[i] - d[j] * nearest(x[i] / d[j], lo, hi))^2, the
// difference in float (quantize.cc's error(); nearest rounds halves away from zero and clamps to
// lo..hi), for j < count; d[j] != 0.
void scale_errors(const float* x, int n, int lo, int hi, const float* d, int count, double* e);

// q[i] = nearest((x[i] + off) / d, lo, hi) for i < n, n a multiple of 16 (quantize.cc's levels of
// one scale, each element as the scalar code computes it).
void levels(const float* x, int n, float off, float d, int lo, int hi, int* q);

}  // namespace combs::cpu::avx512
