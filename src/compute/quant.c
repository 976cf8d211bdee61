/* quant: the entry points of quant.h: which formats exist, and the row / matvec / matmul
 * drivers that call the vectorised kernels of the process's SIMD path (quant_x86.c, built per
 * path; base/cpu.h) and the scalar ones (quant_scalar.c) on the baseline path. Block layouts: see quant_internal.h. */
#include "compute/quant.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include <cblas.h>

#include "base/cpu.h"
#include "compute/quant_internal.h"

/* ---------------------------------------------------------------------------------------
 * Types */

bool fitm_quant_supported(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_F32:
    case FITM_DTYPE_F16:
    case FITM_DTYPE_BF16:
    case FITM_DTYPE_Q4_0:
    case FITM_DTYPE_Q5_0:
    case FITM_DTYPE_Q8_0:
    case FITM_DTYPE_Q4_K:
    case FITM_DTYPE_Q5_K:
    case FITM_DTYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

fitm_dtype fitm_quant_vec_dtype(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_Q4_0:
    case FITM_DTYPE_Q5_0:
    case FITM_DTYPE_Q8_0:
        return FITM_DTYPE_Q8_0;
    case FITM_DTYPE_Q4_K:
    case FITM_DTYPE_Q5_K:
    case FITM_DTYPE_Q6_K:
        return FITM_DTYPE_Q8_K;
    default:
        return FITM_DTYPE_F32;
    }
}

/* The SIMD path of this process (base/cpu.h), read once: every call below branches on it, a
 * predictable branch on a constant, against one dot product or one row (bench_quant: no
 * measurable cost). */
static fitm_cpu_path_id simd_path(void)
{
    static _Atomic int path = -1;
    int p = atomic_load_explicit(&path, memory_order_relaxed);
    if (p < 0) {
        p = FITM_QUANT_X86 ? (int)fitm_cpu_path() : FITM_CPU_BASELINE;
        atomic_store_explicit(&path, p, memory_order_relaxed);
    }
    return (fitm_cpu_path_id)p;
}

void fitm_dequant_row(fitm_dtype t, const void *src, float *dst, int64_t n)
{
#if FITM_QUANT_X86
    switch (simd_path()) {
    case FITM_CPU_AVX512:
        fitm_quant_dequant_row_avx512(t, src, dst, n);
        return;
    case FITM_CPU_AVX2:
        fitm_quant_dequant_row_avx2(t, src, dst, n);
        return;
    default:
        break;
    }
#endif
    fitm_quant_dequant_row_scalar(t, src, dst, n);
}

void fitm_quant_row(fitm_dtype t, const float *src, void *dst, int64_t n)
{
#if FITM_QUANT_X86
    if (t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q8_K) { /* activations: once per matvec */
        switch (simd_path()) {
        case FITM_CPU_AVX512:
            fitm_quant_quant_row_avx512(t, src, dst, n);
            return;
        case FITM_CPU_AVX2:
            fitm_quant_quant_row_avx2(t, src, dst, n);
            return;
        default:
            break;
        }
    }
#endif
    fitm_quant_quant_row_scalar(t, src, dst, n);
}

float fitm_quant_dot(fitm_dtype t, const void *w_row, const void *x_q, int64_t n)
{
#if FITM_QUANT_X86
    switch (simd_path()) {
    case FITM_CPU_AVX512:
        return fitm_quant_dot_avx512(t, w_row, x_q, n);
    case FITM_CPU_AVX2:
        return fitm_quant_dot_avx2(t, w_row, x_q, n);
    default:
        break;
    }
#endif
    return fitm_quant_dot_scalar(t, w_row, x_q, n);
}

/* ---------------------------------------------------------------------------------------
 * Matrix products */

void fitm_matvec(fitm_dtype t, const void *W, int64_t K, const void *x_q, float *y, int64_t n0,
                 int64_t n1)
{
    const size_t rb = fitm_dtype_row_bytes(t, K);
    assert(rb > 0);
    const uint8_t *w = (const uint8_t *)W + (size_t)n0 * rb;
#if FITM_QUANT_X86
    switch (simd_path()) {
    case FITM_CPU_AVX512:
        fitm_quant_matvec_avx512(t, w, rb, K, x_q, y + n0, n1 - n0);
        return;
    case FITM_CPU_AVX2:
        fitm_quant_matvec_avx2(t, w, rb, K, x_q, y + n0, n1 - n0);
        return;
    default:
        break;
    }
#endif
    for (int64_t n = n0; n < n1; n++, w += rb)
        y[n] = fitm_quant_dot_scalar(t, w, x_q, K);
}

void fitm_matvec_rows(fitm_dtype t, const void *W, int64_t K, const void *x_q, size_t x_stride,
                      int64_t M, float *Y, int64_t ldy, int64_t n0, int64_t n1)
{
    const size_t rb = fitm_dtype_row_bytes(t, K);
    assert(rb > 0);
    const uint8_t *w = (const uint8_t *)W + (size_t)n0 * rb;
#if FITM_QUANT_X86
    switch (simd_path()) {
    case FITM_CPU_AVX512:
        fitm_quant_matvec_rows_avx512(t, w, rb, K, x_q, x_stride, M, Y + n0, ldy, n1 - n0);
        return;
    case FITM_CPU_AVX2:
        fitm_quant_matvec_rows_avx2(t, w, rb, K, x_q, x_stride, M, Y + n0, ldy, n1 - n0);
        return;
    default:
        break;
    }
#endif
    for (int64_t m = 0; m < M; m++)
        fitm_matvec(t, W, K, (const uint8_t *)x_q + (size_t)m * x_stride, Y + m * ldy, n0, n1);
}

int64_t fitm_matvec_rows_once(fitm_dtype t, int64_t K)
{
#if FITM_QUANT_X86
    switch (simd_path()) {
    case FITM_CPU_AVX512:
        return fitm_quant_matvec_rows_once_avx512(t, K);
    case FITM_CPU_AVX2:
        return fitm_quant_matvec_rows_once_avx2(t, K);
    default:
        break;
    }
#endif
    return 1; /* the portable path: one matvec per row */
}

/* ---------------------------------------------------------------------------------------
 * Packed weights: only the AVX-512 path packs (its kernel is what the layout is for); the
 * portable functions pack, read and multiply on any path (the tests' reference). */

/* The bytes of N packed rows of type t and length K (N a multiple of 16), on any path. */
static size_t packed_bytes(fitm_dtype t, int64_t N, int64_t K)
{
    return (size_t)(N / FITM_PACK_ROWS) * (size_t)(K / fitm_chunk_elems(t)) * fitm_chunk_bytes(t);
}

size_t fitm_pack_bytes(fitm_dtype t, int64_t N, int64_t K)
{
    if ((t != FITM_DTYPE_Q8_0 && t != FITM_DTYPE_Q5_0 && t != FITM_DTYPE_Q4_K &&
         t != FITM_DTYPE_Q6_K) || N <= 0 ||
        N % FITM_PACK_ROWS || K <= 0 || K % fitm_chunk_elems(t) ||
        K / FITM_QK > FITM_PACK_MAX_BLOCKS || simd_path() != FITM_CPU_AVX512)
        return 0;
    return packed_bytes(t, N, K);
}

void fitm_pack(fitm_dtype t, const void *W, int64_t N, int64_t K, void *P)
{
    fitm_quant_pack_scalar(t, W, N, K, P);
}

void fitm_packed_row(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst)
{
#if FITM_QUANT_X86
    if (simd_path() == FITM_CPU_AVX512) {
        fitm_quant_packed_row_avx512(t, P, K, n, dst);
        return;
    }
#endif
    fitm_quant_packed_row_scalar(t, P, K, n, dst);
}

void fitm_packed_cols(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst, int64_t ld)
{
    assert(n % FITM_PACK_ROWS == 0);
#if FITM_QUANT_X86
    if (simd_path() == FITM_CPU_AVX512) {
        fitm_quant_packed_cols_avx512(t, P, K, n, dst, ld);
        return;
    }
#endif
    fitm_quant_packed_cols_scalar(t, P, K, n, dst, ld);
}

void fitm_matvec_rows_packed(fitm_dtype t, const void *P, int64_t K, const void *x_q,
                             size_t x_stride, int64_t M, float *Y, int64_t ldy, int64_t n0,
                             int64_t n1)
{
    assert(n0 % FITM_PACK_ROWS == 0 && n1 % FITM_PACK_ROWS == 0 && n0 <= n1);
    const uint8_t *p = (const uint8_t *)P + packed_bytes(t, n0, K);
    const int64_t groups = (n1 - n0) / FITM_PACK_ROWS;
#if FITM_QUANT_X86
    if (simd_path() == FITM_CPU_AVX512) {
        fitm_quant_matvec_packed_avx512(t, p, K, x_q, x_stride, M, Y + n0, ldy, groups);
        return;
    }
#endif
    fitm_quant_matvec_packed_scalar(t, p, K, x_q, x_stride, M, Y + n0, ldy, groups);
}

/* Rows of W dequantized per sgemm call. Measured (bench_quant, M = 512, one thread): 32 rows
 * reach 0.85x of one plain F32 sgemm, 64 rows 0.93x, 256 rows 0.97-1.0x. Capped so a tile
 * stays near 4 MiB for very wide rows. */
static int64_t matmul_tile_rows(int64_t K)
{
    int64_t rows = ((int64_t)1 << 20) / (K > 0 ? K : 1);
    return rows > 256 ? 256 : rows < 32 ? 32 : rows;
}

size_t fitm_matmul_scratch_floats(int64_t K)
{
    return (size_t)matmul_tile_rows(K) * (size_t)K;
}

void fitm_matmul(fitm_dtype t, const void *W, int64_t K, const float *X, int64_t M, float *Y,
                 int64_t ldy, int64_t n0, int64_t n1, float *scratch)
{
    if (M <= 0 || n1 <= n0)
        return;
    if (t == FITM_DTYPE_F32) { /* no conversion needed: multiply straight from W */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)(n1 - n0), (int)K,
                    1.0f, X, (int)K, (const float *)W + n0 * K, (int)K, 0.0f, Y + n0, (int)ldy);
        return;
    }
    const size_t rb = fitm_dtype_row_bytes(t, K);
    const int64_t tile = matmul_tile_rows(K);
    assert(rb > 0);
    for (int64_t nt = n0; nt < n1; nt += tile) {
        const int64_t rows = n1 - nt < tile ? n1 - nt : tile;
        const uint8_t *w = (const uint8_t *)W + (size_t)nt * rb;
        for (int64_t r = 0; r < rows; r++)
            fitm_dequant_row(t, w + (size_t)r * rb, scratch + r * K, K);
        /* Y[:, nt:nt+rows] = X (M, K) . tile (rows, K)^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)rows, (int)K, 1.0f, X,
                    (int)K, scratch, (int)K, 0.0f, Y + nt, (int)ldy);
    }
}

void fitm_quant_blas_single_thread(void)
{
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1);
#endif
}
