/* quant: weight formats on the CPU — dequantization, quantization, dot products, and the
 * matrix products the forward pass runs over weights kept as stored.
 *
 * Shapes: a weight W is (N, K) row-major as in GGUF (ne[0] = K contiguous, ne[1] = N rows);
 * each row is fitm_dtype_row_bytes(t, K) bytes. Activations are F32. K must be a multiple of
 * the type's block size (checked by the model loader, asserted here).
 *
 * Threading: these functions are single-threaded and re-entrant. Callers split work by output
 * rows [n0, n1) across their own threads; scratch buffers are the caller's, so nothing here
 * allocates. */
#ifndef FITM_QUANT_H
#define FITM_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"

/* Types fitm can store weights in (F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K). */
bool fitm_quant_supported(fitm_dtype t);

/* Scalar conversions. To fp16/bf16: round to nearest, ties to even; overflow gives inf; NaN
 * stays NaN (quieted, sign and top payload bits kept). fp16 -> fp32 is exact (NaN quieted, as
 * the F16C instruction does); bf16 -> fp32 is exact (a 16-bit shift). */
uint16_t fitm_fp32_to_fp16(float f);
float fitm_fp16_to_fp32(uint16_t h);
uint16_t fitm_fp32_to_bf16(float f);
float fitm_bf16_to_fp32(uint16_t h);

/* Row conversions of n elements (n a multiple of the block size). fitm_dequant_row is
 * bit-exact with the format definition for every type fitm_quant_supported() accepts, and
 * for Q8_K. fitm_quant_row writes valid blocks of any of those types, round to nearest (ties
 * to even) against the scale it chose; scale choices (see quant.c):
 *   Q8_0, Q8_K  d = max|x| / 127, q in -127..127
 *   Q4_0, Q5_0  d = (value of largest magnitude) / -8 or / -16 (it maps to the lowest q)
 *   Q4_K, Q5_K  per 32 elements a least-squares (scale, min) search, 6-bit scales and mins
 *   Q6_K        per 16 elements a least-squares symmetric scale search, 8-bit scales
 * Non-finite input gives valid but meaningless blocks. src and dst must not overlap. */
void fitm_dequant_row(fitm_dtype t, const void *src, float *dst, int64_t n);
void fitm_quant_row(fitm_dtype t, const float *src, void *dst, int64_t n);

/* The activation type a weight type's fast dot product pairs with: Q8_0 for the 32-blocks,
 * Q8_K for the K-quants, F32 for the float types. A quantized activation row of n elements
 * takes fitm_dtype_row_bytes(fitm_quant_vec_dtype(t), n) bytes. */
fitm_dtype fitm_quant_vec_dtype(fitm_dtype t);

/* dot(W row, x) where x was converted with fitm_quant_row(fitm_quant_vec_dtype(t), ...).
 * Hand-vectorised (AVX2/FMA/F16C; AVX-VNNI and AVX-512BW/VL instructions on 256-bit vectors
 * where the build targets them) when the build targets such a CPU; the portable scalar path
 * otherwise. Integer sums inside each block are exact; only the float accumulation across
 * blocks is rounded (see tests/test_quant_oracle.py for the bound). */
float fitm_quant_dot(fitm_dtype t, const void *w_row, const void *x_q, int64_t n);

/* Matrix-vector: y[n] = W[n,:] . x for n in [n0, n1). x_q is x quantized as above; y is
 * indexed by absolute row (y[n0] is the first written). Equal to fitm_quant_dot per row.
 * The SIMD path prefetches weight bytes up to 8 KiB past row n1 - 1 (a hint: it never faults
 * and reads nothing into the result). */
void fitm_matvec(fitm_dtype t, const void *W, int64_t K, const void *x_q, float *y,
                 int64_t n0, int64_t n1);

/* fitm_matvec for M activation rows: Y[m * ldy + n] = W[n,:] . x_m for m in [0, M), n in
 * [n0, n1), where x_m = x_q + m * x_stride bytes. Every value equal to fitm_matvec's for that
 * row alone; the weights are read once for up to fitm_matvec_rows_once(t, K) rows (decode
 * steps of several sequences); more rows read them again. */
void fitm_matvec_rows(fitm_dtype t, const void *W, int64_t K, const void *x_q, size_t x_stride,
                      int64_t M, float *Y, int64_t ldy, int64_t n0, int64_t n1);

/* The most activation rows fitm_matvec_rows multiplies with one read of each weight row of
 * type t and length K on this CPU's path (at least 1; more rows read the weights again).
 * Callers size their tasks by it: weights read once may stream in long runs, weights read
 * again should come in runs that stay in cache. */
int64_t fitm_matvec_rows_once(fitm_dtype t, int64_t K);

/* Packed weights. On the AVX-512 path, Q8_0, Q5_0, Q4_K and Q6_K weights whose row count is a
 * multiple of 16 multiply faster in a layout of their own (quant_internal.h: each block of 16
 * rows stored side by side, so that one 512-bit integer dot product serves 16 outputs and no
 * horizontal sum is needed; about 3x fewer instructions per activation row, which is what a
 * decode step of several sequences spends). A weight's owner packs it once into
 * fitm_pack_bytes(t, N, K) bytes (0: this path keeps t as stored, use the calls above; for N
 * a multiple of 16 it is also where row N's group starts) and then calls fitm_packed_row and
 * fitm_matvec_rows_packed in place of fitm_dequant_row and fitm_matvec_rows. The packed
 * product's value for an output is the float chain
 *     acc = 0;  for each block b in order:  acc = fma(isum_b, d_w,b * d_x,b, acc)
 * with isum_b the block's exact integer sum (K-quants: per super-block, isum_b = sum over
 * its sub-blocks of scale * integer dot; Q4_K then also acc = fma(-msum_b, dmin_w,b * d_x,b,
 * acc) with msum_b the exact sum of the mins times the activations' sub-block sums): the
 * same bits for any M, task split or path (quant_scalar.c's reference); against fitm_matvec
 * only the float rounding differs. */
#define FITM_PACK_ROWS 16 /* rows of a packed group; a packed weight's N is a multiple */
size_t fitm_pack_bytes(fitm_dtype t, int64_t N, int64_t K);
void fitm_pack(fitm_dtype t, const void *W, int64_t N, int64_t K, void *P);

/* Row n of a packed weight converted to F32: equal to fitm_dequant_row of the stored row. */
void fitm_packed_row(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst);

/* Rows [n, n + 16) of a packed weight (n a multiple of 16) converted to F32 column by column:
 * dst[k * ld + i] = element k of row n + i for k < K, i < 16 (a float product's K-major
 * weight tile), each value equal to fitm_packed_row's. */
void fitm_packed_cols(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst, int64_t ld);

/* fitm_matvec_rows on a packed weight, n0 and n1 multiples of 16. Each weight row is read
 * once for any M. With several rows the SIMD path prefetches weight bytes up to 8 KiB past
 * row n1 - 1 (a hint, as fitm_matvec's). */
void fitm_matvec_rows_packed(fitm_dtype t, const void *P, int64_t K, const void *x_q,
                             size_t x_stride, int64_t M, float *Y, int64_t ldy, int64_t n0,
                             int64_t n1);

/* Scratch floats fitm_matmul needs (dequantized weight tile); one scratch per thread. */
size_t fitm_matmul_scratch_floats(int64_t K);

/* Matrix-matrix: Y[m, n] = X[m,:] . W[n,:] for m in [0, M), n in [n0, n1).
 * X (M, K) F32 row-major with row stride K; Y row stride ldy. Dequantizes W in tiles of rows
 * into scratch and multiplies with BLAS sgemm (single-threaded BLAS; the caller threads). */
void fitm_matmul(fitm_dtype t, const void *W, int64_t K, const float *X, int64_t M, float *Y,
                 int64_t ldy, int64_t n0, int64_t n1, float *scratch);

/* Makes the BLAS library run each call on the calling thread only (OpenBLAS: sets its thread
 * count to 1), since fitm threads over output rows itself. Call once at startup, before any
 * fitm_matmul. A no-op for a BLAS without its own threads. */
void fitm_quant_blas_single_thread(void);

#endif
