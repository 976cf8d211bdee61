/* simd_x86: vector helpers shared by the objects built once per SIMD path (quant_x86.c,
 * backend_cpu.c). For x86 objects built with AVX only. */
#ifndef FITM_SIMD_X86_H
#define FITM_SIMD_X86_H

#if !defined(__AVX__)
#error "compute/simd_x86.h is for objects built with AVX"
#endif
#include <immintrin.h>

/* The sum of 8 lanes in a fixed pairwise tree: t[i] + t[i + w] for w = 4, 2, 1 (128-bit
 * halves, then movehl, then movehdup), the same sums whatever calls it. */
static inline float fitm_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));  /* lanes 0, 1: t0 + t2, t1 + t3 */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));   /* lane 0: (t0 + t2) + (t1 + t3) */
    return _mm_cvtss_f32(s);
}

#endif
