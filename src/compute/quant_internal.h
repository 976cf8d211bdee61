/* quant_internal: block layouts and the per-path kernels behind quant.h. Not part of the API;
 * included by quant.c, quant_x86.c and the quant tests (which compare the paths).
 *
 * Block layouts are the GGML ones as stored in GGUF (all little-endian, no padding):
 *   Q4_0  { fp16 d; u8 qs[16]; }                 x = d * (nibble - 8); element j in the low
 *                                                nibble of qs[j], element j+16 in the high one
 *   Q5_0  { fp16 d; u8 qh[4]; u8 qs[16]; }       x = d * ((nibble | bit << 4) - 16); bit j of
 *                                                the little-endian u32 qh belongs to element j
 *   Q8_0  { fp16 d; i8 qs[32]; }                 x = d * q
 *   Q4_K  { fp16 d, dmin; u8 scales[12]; u8 qs[128]; }             256 elements, 8 sub-blocks
 *   Q5_K  { fp16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }  of 32 with 6-bit scale sc
 *         and min m: x = (d*sc) * q - (dmin*m). qs is four 32-byte groups; group g holds
 *         sub-block 2g in its low nibbles, 2g+1 in its high ones; Q5_K's 5th bit of element
 *         l of sub-block s is bit s of qh[l].
 *   Q6_K  { u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d; }  x = (d*sc) * (q6 - 32), one
 *         scale per 16 elements (see quant.c's dequantizer for the bit placement)
 *   Q8_K  { f32 d; i8 qs[256]; i16 bsums[16]; }  x = d * q; bsums[g] = sum of qs[16g..16g+15]
 */
#ifndef FITM_QUANT_INTERNAL_H
#define FITM_QUANT_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "base/dtype.h"
#include "compute/quant.h" /* FITM_PACK_ROWS */

#define FITM_QK 32   /* elements of a Q4_0/Q5_0/Q8_0 block */
#define FITM_QK_K 256 /* elements of a K-quant super-block   */

typedef struct {
    uint16_t d;
    uint8_t qs[FITM_QK / 2];
} fitm_block_q4_0;

typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[FITM_QK / 2];
} fitm_block_q5_0;

typedef struct {
    uint16_t d;
    int8_t qs[FITM_QK];
} fitm_block_q8_0;

typedef struct {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qs[FITM_QK_K / 2];
} fitm_block_q4_k;

typedef struct {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qh[FITM_QK_K / 8];
    uint8_t qs[FITM_QK_K / 2];
} fitm_block_q5_k;

typedef struct {
    uint8_t ql[FITM_QK_K / 2];
    uint8_t qh[FITM_QK_K / 4];
    int8_t scales[FITM_QK_K / 16];
    uint16_t d;
} fitm_block_q6_k;

typedef struct {
    float d;
    int8_t qs[FITM_QK_K];
    int16_t bsums[FITM_QK_K / 16];
} fitm_block_q8_k;

_Static_assert(sizeof(fitm_block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(fitm_block_q5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(fitm_block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(fitm_block_q4_k) == 144, "Q4_K block");
_Static_assert(sizeof(fitm_block_q5_k) == 176, "Q5_K block");
_Static_assert(sizeof(fitm_block_q6_k) == 210, "Q6_K block");
_Static_assert(sizeof(fitm_block_q8_k) == 292, "Q8_K block");

/* Packed weights (quant.h's fitm_pack): Q8_0, Q5_0, Q4_K and Q6_K rows in groups of
 * FITM_PACK_ROWS = 16, one chunk per group and block (32 elements; K-quants: super-block of
 * 256). Group g's chunks are contiguous, block b at (g * nb + b) * chunk bytes:
 *   Q8_0x16  { fp16 d[16]; u8 q[8][64]; }                  (16 stored blocks' bytes)
 *   Q5_0x16  { fp16 d[16]; u8 nib[4][64]; u64 hi[8]; }     (16 stored blocks' bytes)
 *   Q4_Kx16  { fp16 d[16], dmin[16]; u8 sc[8][16]; u8 m[4][32]; u8 nib[4][8][64]; }
 *   Q6_Kx16  { fp16 d[16]; i8 sc[8][32]; u8 nib[32][64]; u8 hi[16][64]; }  (16 blocks' bytes)
 * d[r] is row r's block scale. Q8_0 and Q5_0 hold, for k = 0..7, a vector V_k of 64 unsigned
 * bytes: byte 4r + i of V_k is row r's element 4k + i as an unsigned value u, x = d * (u - off).
 *   Q8_0: V_k = q[k], u = stored int8 + 128 (off 128).
 *   Q5_0: u is the 5-bit value (off 16); its low nibble is in nib[k / 2], low half of the
 *         byte for even k, high half for odd k, and its fifth bit is bit 4r + i of hi[k].
 * Q4_K: byte 4r + i of nib[p][k] is row r's stored byte qs[32p + 4k + i], whose low nibble is
 * element 4k + i of sub-block 2p and high nibble the same of sub-block 2p + 1; sc[j][r] and
 * m[j / 2][2r + j % 2] are row r's 6-bit scale and min of sub-block j (the mins of a pair of
 * sub-blocks side by side, so widened to 16 bits they are one dword per row); 2368 bytes
 * against the 16 stored blocks' 2304.
 * Q6_K: row r's element 4k + i (k = 0..63) is the unsigned 6-bit u (x = d * sc * (u - 32));
 * its low nibble is byte 4r + i of nib[k / 2] (low half for even k, high for odd), its top
 * two bits are bits 2 (k % 4) and up of byte 4r + i of hi[k / 4]; sc[g / 2][2r + g % 2] is
 * row r's signed scale of the 16 elements of group g (pairs of groups side by side, as the
 * Q4_K mins).
 * So one 32-bit lane of a 512-bit vector is one row: a dot product of V_k with x's dword k
 * repeated sixteen times gives the 16 rows' partial sums side by side. */
#define FITM_PACK_MAX_BLOCKS 4096 /* K / 32 at most: the product prepares a row's blocks at once */

typedef struct {
    uint16_t d[FITM_PACK_ROWS];
    uint8_t q[8][64];
} fitm_chunk_q8_0x16;

typedef struct {
    uint16_t d[FITM_PACK_ROWS];
    uint8_t nib[4][64];
    uint64_t hi[8];
} fitm_chunk_q5_0x16;

typedef struct {
    uint16_t d[FITM_PACK_ROWS];
    uint16_t dmin[FITM_PACK_ROWS];
    uint8_t sc[8][FITM_PACK_ROWS];
    uint8_t m[4][2 * FITM_PACK_ROWS];
    uint8_t nib[4][8][64];
} fitm_chunk_q4_kx16;

typedef struct {
    uint16_t d[FITM_PACK_ROWS];
    int8_t sc[8][2 * FITM_PACK_ROWS];
    uint8_t nib[32][64];
    uint8_t hi[16][64];
} fitm_chunk_q6_kx16;

_Static_assert(sizeof(fitm_chunk_q8_0x16) == 16 * sizeof(fitm_block_q8_0), "Q8_0x16 chunk");
_Static_assert(sizeof(fitm_chunk_q5_0x16) == 16 * sizeof(fitm_block_q5_0), "Q5_0x16 chunk");
_Static_assert(sizeof(fitm_chunk_q4_kx16) == 2368, "Q4_Kx16 chunk");
_Static_assert(sizeof(fitm_chunk_q6_kx16) == 16 * sizeof(fitm_block_q6_k), "Q6_Kx16 chunk");

/* A packed type's chunk bytes, the elements of a row one chunk covers, and the offset off of
 * its unsigned values (Q8_0, Q5_0). */
static inline size_t fitm_chunk_bytes(fitm_dtype t)
{
    return t == FITM_DTYPE_Q8_0   ? sizeof(fitm_chunk_q8_0x16)
           : t == FITM_DTYPE_Q5_0 ? sizeof(fitm_chunk_q5_0x16)
           : t == FITM_DTYPE_Q4_K ? sizeof(fitm_chunk_q4_kx16)
                                  : sizeof(fitm_chunk_q6_kx16);
}

static inline int64_t fitm_chunk_elems(fitm_dtype t)
{
    return t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q6_K ? FITM_QK_K : FITM_QK;
}

static inline int fitm_chunk_off(fitm_dtype t)
{
    return t == FITM_DTYPE_Q8_0 ? 128 : 16;
}

/* Scale and min (each 0..63) of sub-block j (0..7) from the 12 packed bytes of Q4_K/Q5_K. */
static inline void fitm_quant_k_scale_min(const uint8_t *s12, int j, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = s12[j] & 63;
        *m = s12[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s12[j + 4] & 0xF) | ((s12[j - 4] >> 6) << 4));
        *m = (uint8_t)((s12[j + 4] >> 4) | ((s12[j] >> 6) << 4));
    }
}

/* Portable scalar paths, always compiled. Same contracts as the quant.h functions. */
void fitm_quant_dequant_row_scalar(fitm_dtype t, const void *src, float *dst, int64_t n);
void fitm_quant_quant_row_scalar(fitm_dtype t, const float *src, void *dst, int64_t n);
float fitm_quant_dot_scalar(fitm_dtype t, const void *w_row, const void *x_q, int64_t n);

/* Packed weights: the portable packer, row reader and product (the reference of the packed
 * product's values), and the AVX-512 product (quant_x86.c, the path that packs). n_groups
 * groups from P (the first of them group 0 of y); y + m * y_stride holds row m's outputs. */
void fitm_quant_pack_scalar(fitm_dtype t, const void *W, int64_t N, int64_t K, void *P);
/* Row r (0..15) of one packed Q4_K or Q6_K chunk (256 floats), and row n of a packed weight
 * (K floats), dequantized straight from the chunks with the stored row's dequantizer's
 * operations in its order (mul then sub, never fused; quant_scalar.c), so the same bits.
 * Inline: each path's object compiles (and vectorizes) it itself. */
static inline void fitm_quant_packed_block_k(fitm_dtype t, const void *chunk, int r, float *y)
{
    if (t == FITM_DTYPE_Q4_K) {
        const fitm_chunk_q4_kx16 *c = chunk;
        const float d = fitm_fp16_to_fp32(c->d[r]), dmin = fitm_fp16_to_fp32(c->dmin[r]);
        for (int p = 0; p < 4; p++) { /* stored qs[32p..]: sub-blocks 2p (low), 2p+1 */
            uint8_t q[32];
            for (int k = 0; k < 8; k++)
                memcpy(q + 4 * k, c->nib[p][k] + 4 * r, 4);
            const float d0 = d * c->sc[2 * p][r], o0 = dmin * c->m[p][2 * r],
                        d1 = d * c->sc[2 * p + 1][r], o1 = dmin * c->m[p][2 * r + 1];
            for (int l = 0; l < 32; l++) {
                y[64 * p + l] = d0 * (float)(q[l] & 0xF) - o0;
                y[64 * p + 32 + l] = d1 * (float)(q[l] >> 4) - o1;
            }
        }
        return;
    }
    const fitm_chunk_q6_kx16 *c = chunk;
    const float d = fitm_fp16_to_fp32(c->d[r]);
    uint8_t u[FITM_QK_K];
    for (int k = 0; k < 64; k++) { /* elements 4k..4k+3, a dword at a time */
        uint32_t lo, hi;
        memcpy(&lo, c->nib[k / 2] + 4 * r, 4);
        memcpy(&hi, c->hi[k / 4] + 4 * r, 4);
        const uint32_t v = ((lo >> (4 * (k % 2))) & 0x0F0F0F0Fu) |
                           ((hi >> (2 * (k % 4))) & 0x03030303u) << 4;
        memcpy(u + 4 * k, &v, 4);
    }
    for (int g = 0; g < 16; g++) {
        const float dg = d * (float)c->sc[g / 2][2 * r + g % 2];
        for (int e = 16 * g; e < 16 * g + 16; e++)
            y[e] = dg * (float)(u[e] - 32);
    }
}

static inline void fitm_quant_packed_row_k(fitm_dtype t, const void *P, int64_t K, int64_t n,
                                           float *y)
{
    const int64_t nb = K / FITM_QK_K;
    const unsigned char *c = (const unsigned char *)P + (size_t)((n / FITM_PACK_ROWS) * nb) *
                                                            fitm_chunk_bytes(t);
    for (int64_t b = 0; b < nb; b++, c += fitm_chunk_bytes(t), y += FITM_QK_K)
        fitm_quant_packed_block_k(t, c, (int)(n % FITM_PACK_ROWS), y);
}
void fitm_quant_packed_row_scalar(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst);
void fitm_quant_packed_cols_scalar(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst,
                                   int64_t ld);
void fitm_quant_matvec_packed_scalar(fitm_dtype t, const uint8_t *P, int64_t K, const void *x_q,
                                     size_t x_stride, int64_t M, float *y, int64_t y_stride,
                                     int64_t n_groups);

/* Vectorised paths (quant_x86.c), x86-64 only, compiled once per SIMD path of base/cpu.h
 * (src/compute/meson.build: -march=x86-64-v3 with FITM_SIMD_SUFFIX=avx2, x86-64-v4 + VNNI with
 * avx512); quant.c calls the one fitm_cpu_path() names, or the scalar paths for baseline. The
 * dequantizer is bit-exact with the scalar one; the dots differ from the scalar ones only in
 * float summation order (the integer block sums are identical). */
#if defined(__x86_64__)
#define FITM_QUANT_X86 1
#define FITM_QUANT_SIMD_DECL(sfx)                                                                  \
    float fitm_quant_dot_##sfx(fitm_dtype t, const void *w_row, const void *x_q, int64_t n);      \
    void fitm_quant_dequant_row_##sfx(fitm_dtype t, const void *src, float *dst, int64_t n);      \
    /* Q8_0 and Q8_K only (the activation types); bytes identical to the scalar one's. */        \
    void fitm_quant_quant_row_##sfx(fitm_dtype t, const float *src, void *dst, int64_t n);        \
    /* y[r] = dot(row r, x_q) for r in [0, n_rows), rows row_bytes apart starting at w. */        \
    void fitm_quant_matvec_##sfx(fitm_dtype t, const uint8_t *w, size_t row_bytes, int64_t K,     \
                                 const void *x_q, float *y, int64_t n_rows);                      \
    /* fitm_quant_matvec_##sfx for M activation rows x_stride bytes apart, row m's outputs at */ \
    /* y + m * y_stride; every value equal to the one-row call's. */                             \
    void fitm_quant_matvec_rows_##sfx(fitm_dtype t, const uint8_t *w, size_t row_bytes,         \
                                      int64_t K, const void *x_q, size_t x_stride, int64_t M,     \
                                      float *y, int64_t y_stride, int64_t n_rows);                \
    /* fitm_matvec_rows_once for this path */                                                    \
    int64_t fitm_quant_matvec_rows_once_##sfx(fitm_dtype t, int64_t K);
FITM_QUANT_SIMD_DECL(avx2)
FITM_QUANT_SIMD_DECL(avx512)
void fitm_quant_packed_row_avx512(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst);
void fitm_quant_packed_cols_avx512(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst,
                                   int64_t ld);
void fitm_quant_matvec_packed_avx512(fitm_dtype t, const uint8_t *P, int64_t K, const void *x_q,
                                     size_t x_stride, int64_t M, float *y, int64_t y_stride,
                                     int64_t n_groups);
#else
#define FITM_QUANT_X86 0
#endif

#endif
