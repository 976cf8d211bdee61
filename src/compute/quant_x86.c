/* quant_x86: AVX2/FMA/F16C dot products, matvec, dequantizers and activation quantizers.
 * Compiled once per SIMD path of base/cpu.h (src/compute/meson.build): with -march=x86-64-v3
 * as the fitm_quant_*_avx2 functions and with -march=x86-64-v4 -mavx512vnni as
 * fitm_quant_*_avx512; quant.c calls the path the CPU has. Optional extras on the same 256-bit vectors where the build targets
 * them: AVX-VNNI or AVX512-VNNI + VL (one vpdpbusd instead of vpmaddubsw + vpmaddwd; the
 * results are identical because no pmaddubsw pair below can saturate: |pair| <= 2 * 128 *
 * 127 < 32768 for the value ranges each caller feeds it) and AVX512BW + VL (mask registers
 * for Q5_0's fifth bits, a variable shift for nibbles). Where the build targets AVX512F/BW/
 * DQ/VNNI, the Q8_0 and Q5_0 dots (most of a Gemma 3 decode step) run on 512-bit vectors, two
 * blocks per vector (FITM_DOT512), and so do the K-quants' integer sums (the same sums, so the
 * same results as the 256-bit kernels); packed weights (quant.h) have their own kernels there.
 * tests/meson.build runs the unit test
 * once per path the machine has (FITM_CPU), so every path is checked.
 *
 * Layouts: quant_internal.h. Every integer block sum equals the scalar path's; only float
 * accumulation order differs. The dequantizers and quantizers use the scalar path's exact
 * float operations (mul then sub, never fused), so their output is bit-identical. */
#include "compute/quant.h"
#include "compute/quant_internal.h"
#include "compute/simd_x86.h"

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || !defined(FITM_SIMD_SUFFIX)
#error "quant_x86.c is built once per SIMD path, with its -march and FITM_SIMD_SUFFIX"
#endif
#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
/* this object's names of the quant_internal.h entry points */
#define fitm_quant_dot_simd SIMD_CAT(fitm_quant_dot, FITM_SIMD_SUFFIX)
#define fitm_quant_dequant_row_simd SIMD_CAT(fitm_quant_dequant_row, FITM_SIMD_SUFFIX)
#define fitm_quant_quant_row_simd SIMD_CAT(fitm_quant_quant_row, FITM_SIMD_SUFFIX)
#define fitm_quant_matvec_simd SIMD_CAT(fitm_quant_matvec, FITM_SIMD_SUFFIX)
#define fitm_quant_matvec_rows_simd SIMD_CAT(fitm_quant_matvec_rows, FITM_SIMD_SUFFIX)
#define fitm_quant_matvec_rows_once_simd SIMD_CAT(fitm_quant_matvec_rows_once, FITM_SIMD_SUFFIX)
#define fitm_quant_matvec_packed_simd SIMD_CAT(fitm_quant_matvec_packed, FITM_SIMD_SUFFIX)
#define fitm_quant_packed_row_simd SIMD_CAT(fitm_quant_packed_row, FITM_SIMD_SUFFIX)
#define fitm_quant_packed_cols_simd SIMD_CAT(fitm_quant_packed_cols, FITM_SIMD_SUFFIX)

#include <immintrin.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FITM_VNNI 1
#define DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#elif defined(__AVXVNNI__)
#define FITM_VNNI 1
#define DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#else
#define FITM_VNNI 0
#endif

/* 512-bit integer dots (AVX-512 with VNNI): the Q8_0 and K-quant rows below take them */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) &&                      \
    defined(__AVX512VNNI__)
#define FITM_DOT512 1
#else
#define FITM_DOT512 0
#endif

static inline float fp16(uint16_t h)
{
    return _cvtsh_ss(h);
}

static inline float bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __m256i loadu256(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Sums of 4 adjacent products of unsigned bytes a and signed bytes b, as 8 int32. */
static inline __m256i dot_u8s8(__m256i a, __m256i b)
{
#if FITM_VNNI
    return DPBUSD(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

#if !FITM_DOT512 /* (512-bit builds scale their sums in the wide kernels instead) */
/* As dot_u8s8, each pair sum multiplied by the int16 in scale16 at its position, then
 * pairs added: with one scale per 128-bit lane, 8 int32 of scale * (sum of 4 products).
 * The caller guarantees the pairs cannot saturate int16. (maddubs + madd: as cheap as
 * vpdpbusd + vpmulld and without the need to widen the scale to 32 bits.) */
static inline __m256i dot_u8s8_scaled(__m256i a, __m256i b, __m256i scale16)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), scale16);
}
#endif

/* Byte shuffle that broadcasts 16-bit element j of each 128-bit lane across that lane. */
static inline __m256i bcast16_mask(int j)
{
    return _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j));
}

/* Signed x signed bytes via |w| and x * sign(w). w = -128 gives |w| = 128 as unsigned,
 * still exact; x is an activation (-127..127), so pairs stay below 2*128*127. */
static inline __m256i dot_s8s8(__m256i w, __m256i x)
{
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* 32 nibbles of 16 bytes: element j = low nibble of byte j, element j+16 = high nibble. */
static inline __m256i nibbles32(const uint8_t *qs)
{
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* both lanes get the 16 bytes; one variable shift moves the high lane's nibbles down */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi16(v, _mm256_set_epi64x(0x0004000400040004, 0x0004000400040004, 0, 0));
#else
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
#endif
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* 0xFF in byte j where bit j of bits is set. */
static inline __m256i bits_to_bytes(uint32_t bits)
{
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_movm_epi8((__mmask32)bits);
#else
    __m256i v = _mm256_set1_epi32((int)bits);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0x0000000000000000);
    v = _mm256_shuffle_epi8(v, spread); /* byte j <- byte j/8 of bits */
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)); /* all but bit j%8 */
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
#endif
}

/* Q5_0 values as signed bytes: nibble | 0xF0 (= nibble - 16) where the 5th bit is clear,
 * nibble (= nibble + 16 - 16) where it is set. */
static inline __m256i q5_0_values(const fitm_block_q5_0 *b)
{
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    __m256i hi = _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8((char)0xF0));
    return _mm256_or_si256(nibbles32(b->qs), hi);
}

/* ---------------------------------------------------------------------------------------
 * Dot products */

static float dot_f32(const float *w, const float *x, int64_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float acc = fitm_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++)
        acc += w[i] * x[i];
    return acc;
}

static inline __m256 load_f16x8(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 load_bf16x8(const uint16_t *p)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

#define DEF_DOT_HALF(name, load, conv)                                                        \
    static float name(const uint16_t *w, const float *x, int64_t n)                           \
    {                                                                                         \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                           \
        int64_t i = 0;                                                                        \
        for (; i + 32 <= n; i += 32) {                                                        \
            a0 = _mm256_fmadd_ps(load(w + i), _mm256_loadu_ps(x + i), a0);                    \
            a1 = _mm256_fmadd_ps(load(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);            \
            a2 = _mm256_fmadd_ps(load(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);          \
            a3 = _mm256_fmadd_ps(load(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);          \
        }                                                                                     \
        for (; i + 8 <= n; i += 8)                                                            \
            a0 = _mm256_fmadd_ps(load(w + i), _mm256_loadu_ps(x + i), a0);                    \
        float acc = fitm_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));     \
        for (; i < n; i++)                                                                    \
            acc += conv(w[i]) * x[i];                                                         \
        return acc;                                                                           \
    }

DEF_DOT_HALF(dot_f16, load_f16x8, fp16)
DEF_DOT_HALF(dot_bf16, load_bf16x8, bf16)

/* ---------------------------------------------------------------------------------------
 * Quantized dots, one weight row each. (Kernels that share each activation block among
 * four rows ran ~10% faster in cache but 2-4x slower streaming from DRAM, where the
 * interleaved short streams defeat the hardware prefetcher even with software prefetch;
 * weights of a real model stream from DRAM, so matvec walks rows one after another.) */

#define KERNEL static inline __attribute__((always_inline))

/* acc + sums of 4 adjacent products of unsigned bytes a and signed bytes b, as 8 int32. */
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i a, __m256i b)
{
#if FITM_VNNI
    return DPBUSD(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

/* -bias * (sum of each 4-byte group of x): the starting value that turns dot_u8s8_acc of
 * unsigned values u into the dot of (u - bias). Pairs: 2 * 16 * 128, no saturation. */
static inline __m256i neg_bias(__m256i x, int bias)
{
    return _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8s8(_mm256_set1_epi8((char)bias), x));
}

/* Q5_0 values as unsigned bytes 0..31 (bias 16). */
static inline __m256i q5_0_unsigned(const fitm_block_q5_0 *b)
{
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m256i nib = nibbles32(b->qs);
    return _mm256_mask_add_epi8(nib, (__mmask32)qh, nib, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(nibbles32(b->qs), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
#endif
}

/* Integer dot of one 32-block of row type t (Q8_0, Q4_0 or Q5_0) with activation bytes xv;
 * nbias is neg_bias(xv, 8) for Q4_0 and neg_bias(xv, 16) for Q5_0 (unused for Q8_0). */
KERNEL __m256i block32_dot(fitm_dtype t, const uint8_t *blk, __m256i xv, __m256i nbias, uint16_t *d)
{
    switch (t) {
    case FITM_DTYPE_Q4_0: {
        const fitm_block_q4_0 *b = (const fitm_block_q4_0 *)blk;
        *d = b->d;
        return dot_u8s8_acc(nbias, nibbles32(b->qs), xv);
    }
    case FITM_DTYPE_Q5_0: {
        const fitm_block_q5_0 *b = (const fitm_block_q5_0 *)blk;
        *d = b->d;
        return dot_u8s8_acc(nbias, q5_0_unsigned(b), xv);
    }
    default: {
        const fitm_block_q8_0 *b = (const fitm_block_q8_0 *)blk;
        *d = b->d;
        return dot_s8s8(loadu256(b->qs), xv);
    }
    }
}

/* Row . x for a 32-block type; two accumulators (even and odd blocks) give two
 * independent FMA chains. */
KERNEL float dot_block32(fitm_dtype t, const uint8_t *w, const fitm_block_q8_0 *x, int64_t nb)
{
    const size_t bb = t == FITM_DTYPE_Q4_0 ? sizeof(fitm_block_q4_0)
                      : t == FITM_DTYPE_Q5_0 ? sizeof(fitm_block_q5_0)
                                             : sizeof(fitm_block_q8_0);
    const int bias = t == FITM_DTYPE_Q4_0 ? 8 : 16;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const __m256i x0 = loadu256(x[i].qs), x1 = loadu256(x[i + 1].qs);
        const __m256i nb0 = t == FITM_DTYPE_Q8_0 ? x0 : neg_bias(x0, bias);
        const __m256i nb1 = t == FITM_DTYPE_Q8_0 ? x1 : neg_bias(x1, bias);
        const uint8_t *row = w + (size_t)i * bb;
        uint16_t d0, d1;
        __m256i p0 = block32_dot(t, row, x0, nb0, &d0);
        __m256i p1 = block32_dot(t, row + bb, x1, nb1, &d1);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(fp16(d0) * fp16(x[i].d)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(fp16(d1) * fp16(x[i + 1].d)), acc1);
    }
    for (; i < nb; i++) {
        const __m256i x0 = loadu256(x[i].qs);
        const __m256i nb0 = t == FITM_DTYPE_Q8_0 ? x0 : neg_bias(x0, bias);
        uint16_t d0;
        __m256i p0 = block32_dot(t, w + (size_t)i * bb, x0, nb0, &d0);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(fp16(d0) * fp16(x[i].d)), acc0);
    }
    return fitm_hsum8(_mm256_add_ps(acc0, acc1));
}

#if FITM_DOT512
/* Q8_0 . Q8_0 on 512-bit vectors, two blocks per vector (this is Gemma 3's tied output head,
 * most of a decode step's weight bytes). Signed x signed bytes as |w| times x negated where
 * w < 0 (a mask register; x is -127..127, so negation is exact). Each block's 8 int32 lanes
 * are converted and multiplied by d_w * d_x, then accumulated per lane; xs holds x's block
 * scales as floats (fp16 -> fp32 is exact, so converting them once per matvec or per block
 * gives the same values). */
KERNEL __m512 q8_0_pair(__m512 acc, __m512i wv, __m512i xv, float s0, float s1)
{
    const __mmask64 neg = _mm512_movepi8_mask(wv);
    const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), xs);
    const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc);
}

KERNEL __m512i load_q8_0_pair(const fitm_block_q8_0 *b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(loadu256(b[0].qs)), loadu256(b[1].qs), 1);
}

/* Q5_0 . Q8_0, two blocks per 512-bit vector: nibbles of block i in the low 256 bits (low
 * nibbles, then high), block i + 1 in the high; the fifth bits added as 16 under a mask;
 * the bias of 16 taken off by starting the dot at -16 * (sums of 4 x bytes), as
 * dot_block32 does (exact: pairs <= 2 * 31 * 127). */
KERNEL __m512i q5_0_pair_unsigned(const fitm_block_q5_0 *b)
{
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b[0].qs));
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b[1].qs));
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    v = _mm512_srlv_epi16(v, _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                              0x0004000400040004, 0x0004000400040004, 0, 0));
    v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    uint32_t h0, h1;
    memcpy(&h0, b[0].qh, 4);
    memcpy(&h1, b[1].qh, 4);
    return _mm512_mask_add_epi8(v, (__mmask64)h0 | (__mmask64)h1 << 32, v, _mm512_set1_epi8(0x10));
}

/* -b * (sums of 4 bytes of xv), b the bytes of bias: the start that turns vpdpbusd's dot of
 * unsigned values u with xv into the dot of u - b. */
KERNEL __m512i bias_start512(__m512i bias, __m512i xv)
{
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, xv));
}

/* dot_q5_0_512's odd last block: the 256-bit kernel's arithmetic for it (xsv: x's scale). */
KERNEL float q5_0_last_block(const fitm_block_q5_0 *w, const fitm_block_q8_0 *x, float xsv)
{
    const __m256i x0 = loadu256(x->qs);
    uint16_t d0;
    const __m256i p0 = block32_dot(FITM_DTYPE_Q5_0, (const uint8_t *)w, x0, neg_bias(x0, 16), &d0);
    return fitm_hsum8(_mm256_mul_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(fp16(d0) * xsv)));
}

KERNEL float dot_q5_0_512(const fitm_block_q5_0 *w, const fitm_block_q8_0 *x, const float *xs,
                          int64_t nb)
{
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const __m512i xv = load_q8_0_pair(x + i);
        const __m512i nbias = bias_start512(_mm512_set1_epi8(16), xv);
        const __m512i p = _mm512_dpbusd_epi32(nbias, q5_0_pair_unsigned(w + i), xv);
        const float s0 = fp16(w[i].d) * (xs ? xs[i] : fp16(x[i].d));
        const float s1 = fp16(w[i + 1].d) * (xs ? xs[i + 1] : fp16(x[i + 1].d));
        const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
        if (i % 4 == 0)
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc0);
        else
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc1);
    }
    const float tail = i < nb ? q5_0_last_block(w + i, x + i, xs ? xs[i] : fp16(x[i].d)) : 0.0f;
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail;
}

/* dot_q8_0_512's end from block i: a last pair, or a last block with a zero partner, into
 * acc. */
KERNEL __m512 q8_0_tail(__m512 acc, const fitm_block_q8_0 *w, const fitm_block_q8_0 *x,
                        const float *xs, int64_t i, int64_t nb)
{
    for (; i < nb; i += 2) {
        const int two = i + 1 < nb;
        const __m512i wv = two ? load_q8_0_pair(w + i) : _mm512_zextsi256_si512(loadu256(w[i].qs));
        const __m512i xv = two ? load_q8_0_pair(x + i) : _mm512_zextsi256_si512(loadu256(x[i].qs));
        const float s0 = fp16(w[i].d) * (xs ? xs[i] : fp16(x[i].d));
        const float s1 = two ? fp16(w[i + 1].d) * (xs ? xs[i + 1] : fp16(x[i + 1].d)) : 0.0f;
        acc = q8_0_pair(acc, wv, xv, s0, s1);
    }
    return acc;
}

KERNEL float dot_q8_0_512(const fitm_block_q8_0 *w, const fitm_block_q8_0 *x, const float *xs,
                          int64_t nb)
{
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        float x0 = xs ? xs[i] : fp16(x[i].d), x1 = xs ? xs[i + 1] : fp16(x[i + 1].d);
        float x2 = xs ? xs[i + 2] : fp16(x[i + 2].d), x3 = xs ? xs[i + 3] : fp16(x[i + 3].d);
        acc0 = q8_0_pair(acc0, load_q8_0_pair(w + i), load_q8_0_pair(x + i), fp16(w[i].d) * x0,
                         fp16(w[i + 1].d) * x1);
        acc1 = q8_0_pair(acc1, load_q8_0_pair(w + i + 2), load_q8_0_pair(x + i + 2),
                         fp16(w[i + 2].d) * x2, fp16(w[i + 3].d) * x3);
    }
    acc0 = q8_0_tail(acc0, w, x, xs, i, nb);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

/* The 8 scales and 8 mins (0..63) of a Q4_K/Q5_K super-block, unpacked with 32-bit word
 * operations: bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7,
 * bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble)
 * and mins 4-7 (high nibble). */
static inline void k_scales_mins(const uint8_t s12[12], uint8_t sc[8], uint8_t m[8])
{
    uint32_t u0, u1, u2;
    memcpy(&u0, s12, 4);
    memcpy(&u1, s12 + 4, 4);
    memcpy(&u2, s12 + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    uint32_t s_lo = u0 & lo6, m_lo = u1 & lo6;
    uint32_t s_hi = (u2 & lo4) | (((u0 >> 6) & top2) << 4);
    uint32_t m_hi = ((u2 >> 4) & lo4) | (((u1 >> 6) & top2) << 4);
    memcpy(sc, &s_lo, 4);
    memcpy(sc + 4, &s_hi, 4);
    memcpy(m, &m_lo, 4);
    memcpy(m + 4, &m_hi, 4);
}

/* sum_j m[j] * (bsums[2j] + bsums[2j+1]) as 8 int32 lanes (to be summed), from the 16 bsums
 * and the 8 mins each widened to the two 16-bit lanes of its pair. */
static inline __m256i k_min_sums(__m256i bsums, const uint8_t m[8])
{
    uint64_t m8;
    memcpy(&m8, m, 8);
    __m128i mm = _mm_cvtsi64_si128((long long)m8);
    __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mm, mm)); /* m0 m0 m1 m1 ... */
    return _mm256_madd_epi16(bsums, m16);
}

/* Q4_K / Q5_K: q unsigned (<= 31) times q8 (|q8| <= 128): pairs <= 2*31*128. The mins
 * are accumulated as vectors too, so a super-block needs no horizontal sum.
 *
 * The K-quant dots take M activation rows (M a compile-time constant after inlining) against
 * one weight row: each super-block's values and scales are unpacked once for all the rows,
 * and each row is summed as it would be alone (exact integer block sums, its own FMA chains
 * in block order), so the one-row dot is the M = 1 instance and a row's value does not depend
 * on M. xq: the rows' Q8_K blocks, x_stride bytes apart; out[r * out_stride]. */
#if FITM_DOT512 /* 32 vector registers: a block unpacked once serves the 8 rows of a step of
                  8 sequences (2048 x 640, one thread, in cache: Q4_K 166 -> 154 us, Q6_K
                  158 -> 144 us against 4 rows at a time) */
#define ROWSK_MAX 8
#else
#define ROWSK_MAX 4
#endif

#if FITM_DOT512
/* The K-quant rows on 512-bit vectors (FITM_DOT512 builds): the two 256-bit products of a
 * group (or of two groups) side by side, each 128-bit lane with its own scales, and pair
 * sums times scales added by one vpdpwssd. A block's upper 256 bits are then added onto the
 * lower ones: lane l of the lower half sums the same byte positions as lane l of the 256-bit
 * kernels' isum, so every integer block sum, and so every result, is theirs bit for bit. */

/* 16-bit counts: c0 in every lane of the lower 256 bits, c1 of the upper. */
static inline __m512i halves16(int c0, int c1)
{
    const long long a = (long long)(0x0001000100010001ull * (unsigned)c0),
                    b = (long long)(0x0001000100010001ull * (unsigned)c1);
    return _mm512_set_epi64(b, b, b, b, a, a, a, a);
}

/* bcast16_mask(j0) in the lower 256 bits, bcast16_mask(j1) in the upper. */
static inline __m512i bcast16_mask2(int j0, int j1)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(bcast16_mask(j0)), bcast16_mask(j1), 1);
}

/* The block's 256-bit integer sum of one row from its 512-bit accumulator. */
static inline __m256i fold512(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
#endif

KERNEL void dot_q45_k_rows(fitm_dtype t, const uint8_t *w, const uint8_t *xq, size_t x_stride,
                           const int M, int64_t nb, float *out, int64_t out_stride)
{
    const int is5 = t == FITM_DTYPE_Q5_K;
    const size_t bb = is5 ? sizeof(fitm_block_q5_k) : sizeof(fitm_block_q4_k);
    __m256 acc[ROWSK_MAX], accm[ROWSK_MAX];
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + (size_t)i * bb;
        const fitm_block_q4_k *b4 = (const fitm_block_q4_k *)blk; /* same header */
        const uint8_t *qs = is5 ? ((const fitm_block_q5_k *)blk)->qs : b4->qs;
        uint8_t sc[8], m[8];
        k_scales_mins(b4->scales, sc, m);
        uint64_t sc8;
        memcpy(&sc8, sc, 8);
        /* the 8 scales as int16, in both 128-bit lanes */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
        __m256i h = is5 ? loadu256(((const fitm_block_q5_k *)blk)->qh) : _mm256_setzero_si256();
        __m256i isum[ROWSK_MAX];
#if FITM_DOT512
        /* group g as one vector: low nibbles (scale 2g) below, high nibbles (2g + 1) above,
         * against the row's 64 bytes of the group, which lie in that order */
        const __m512i sc512 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16));
        const __m512i h512 = _mm512_broadcast_i64x4(h), low4x = _mm512_set1_epi8(0x0F);
        __m512i isum5[ROWSK_MAX];
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum5[r] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i q = _mm512_broadcast_i64x4(loadu256(qs + 32 * g));
            q = _mm512_and_si512(_mm512_srlv_epi16(q, halves16(0, 4)), low4x);
            if (is5) { /* bits 2g (low nibbles) and 2g + 1 (high) of each qh byte */
                const __m512i b = _mm512_srlv_epi16(h512, halves16(2 * g, 2 * g + 1));
                q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi8(1)), 4));
            }
            const __m512i sg = _mm512_shuffle_epi8(sc512, bcast16_mask2(2 * g, 2 * g + 1));
#pragma GCC unroll 8
            for (int r = 0; r < M; r++) {
                const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)r * x_stride);
                isum5[r] = _mm512_dpwssd_epi32(
                    isum5[r], _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[i].qs + 64 * g)), sg);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum[r] = fold512(isum5[r]);
#else
        const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i q = loadu256(qs + 32 * g);
            __m256i lo = _mm256_and_si256(q, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (is5) { /* bit 2g / 2g+1 of byte l: the 5th bits of this group */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(
                    hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                h = _mm256_srli_epi16(h, 2);
            }
            const __m256i slo = _mm256_shuffle_epi8(sc16, bcast16_mask(2 * g));
            const __m256i shi = _mm256_shuffle_epi8(sc16, bcast16_mask(2 * g + 1));
#pragma GCC unroll 8
            for (int r = 0; r < M; r++) {
                const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)r * x_stride);
                isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(lo, loadu256(x[i].qs + 64 * g), slo));
                isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(hi, loadu256(x[i].qs + 64 * g + 32), shi));
            }
        }
#endif
        const float d = fp16(b4->d), dmin = fp16(b4->dmin);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
            const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)r * x_stride);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[i].d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * x[i].d),
                                      _mm256_cvtepi32_ps(k_min_sums(loadu256(x[i].bsums), m)), accm[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        out[r * out_stride] = fitm_hsum8(acc[r]) - fitm_hsum8(accm[r]);
}

/* The four 32-byte groups of 6-bit values (0..63, unsigned) of one Q6_K half. */
static inline void q6_k_half(const uint8_t *ql, const uint8_t *qh, __m256i q[4])
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    __m256i l0 = loadu256(ql), l1 = loadu256(ql + 32), h = loadu256(qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                           _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
}

/* Q6_K: sum sc * (q6 - 32) * q8 = sum sc * q6 * q8 - 32 * sum_g sc[g] * bsums[g] (a
 * scale covers exactly one 16-element bsums group). q6 <= 63: pairs <= 2*63*128. */
KERNEL void dot_q6_k_rows(const fitm_block_q6_k *w, const uint8_t *xq, size_t x_stride,
                          const int M, int64_t nb, float *out, int64_t out_stride)
{
    __m256 acc[ROWSK_MAX];
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const fitm_block_q6_k *b = &w[i];
        /* scales as int16: even-numbered ones in the low lane, odd-numbered in the high
         * lane, so group s = 2j (first 16 bytes: scale 2j, next 16: 2j+1) is one shuffle */
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)b->scales);
        const __m128i evod = _mm_shuffle_epi8(sc8, _mm_set_epi8(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0));
        const __m256i sc_eo = _mm256_cvtepi8_epi16(evod);
        __m256i isum[ROWSK_MAX];
#if FITM_DOT512
        /* q6_k_half's groups 0, 1 and 2, 3 as two vectors, against the row's 64 bytes each */
        const __m512i sc512 = _mm512_broadcast_i64x4(sc_eo), low4x = _mm512_set1_epi8(0x0F),
                      low2x = _mm512_set1_epi8(3);
        __m512i isum5[ROWSK_MAX];
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum5[r] = _mm512_setzero_si512();
        for (int hh = 0; hh < 2; hh++) {
            const __m512i l = _mm512_loadu_si512(b->ql + 64 * hh);
            const __m512i h = _mm512_broadcast_i64x4(loadu256(b->qh + 32 * hh));
            const __m512i q01 = _mm512_or_si512(
                _mm512_and_si512(l, low4x),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, halves16(0, 2)), low2x), 4));
            const __m512i q23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(l, 4), low4x),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, halves16(4, 6)), low2x), 4));
            const __m512i s01 = _mm512_shuffle_epi8(sc512, bcast16_mask2(4 * hh, 4 * hh + 1));
            const __m512i s23 = _mm512_shuffle_epi8(sc512, bcast16_mask2(4 * hh + 2, 4 * hh + 3));
#pragma GCC unroll 8
            for (int r = 0; r < M; r++) {
                const int8_t *xr = ((const fitm_block_q8_k *)(xq + (size_t)r * x_stride))[i].qs + 128 * hh;
                isum5[r] = _mm512_dpwssd_epi32(isum5[r], _mm512_maddubs_epi16(q01, _mm512_loadu_si512(xr)), s01);
                isum5[r] = _mm512_dpwssd_epi32(isum5[r], _mm512_maddubs_epi16(q23, _mm512_loadu_si512(xr + 64)), s23);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum[r] = fold512(isum5[r]);
#else
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            isum[r] = _mm256_setzero_si256();
        for (int hh = 0; hh < 2; hh++) {
            __m256i q[4];
            q6_k_half(b->ql + 64 * hh, b->qh + 32 * hh, q);
            for (int k = 0; k < 4; k++) {
                const __m256i s = _mm256_shuffle_epi8(sc_eo, bcast16_mask(4 * hh + k));
#pragma GCC unroll 8
                for (int r = 0; r < M; r++) {
                    const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)r * x_stride);
                    isum[r] = _mm256_add_epi32(
                        isum[r], dot_u8s8_scaled(q[k], loadu256(x[i].qs + 128 * hh + 32 * k), s));
                }
            }
        }
#endif
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const float d = fp16(b->d);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
            const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)r * x_stride);
            isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(loadu256(x[i].bsums), sc16), 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[i].d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        out[r * out_stride] = fitm_hsum8(acc[r]);
}

KERNEL float dot_q45_k(fitm_dtype t, const uint8_t *w, const fitm_block_q8_k *x, int64_t nb)
{
    float out;
    dot_q45_k_rows(t, w, (const uint8_t *)x, 0, 1, nb, &out, 0);
    return out;
}

static float dot_q6_k(const fitm_block_q6_k *w, const fitm_block_q8_k *x, int64_t nb)
{
    float out;
    dot_q6_k_rows(w, (const uint8_t *)x, 0, 1, nb, &out, 0);
    return out;
}

float fitm_quant_dot_simd(fitm_dtype t, const void *w_row, const void *x_q, int64_t n)
{
    switch (t) {
    case FITM_DTYPE_F32:
        return dot_f32(w_row, x_q, n);
    case FITM_DTYPE_F16:
        return dot_f16(w_row, x_q, n);
    case FITM_DTYPE_BF16:
        return dot_bf16(w_row, x_q, n);
    case FITM_DTYPE_Q8_0:
#if FITM_DOT512
        return dot_q8_0_512(w_row, x_q, NULL, n / FITM_QK);
#else
        return dot_block32(FITM_DTYPE_Q8_0, w_row, x_q, n / FITM_QK);
#endif
    case FITM_DTYPE_Q4_0:
        return dot_block32(FITM_DTYPE_Q4_0, w_row, x_q, n / FITM_QK);
    case FITM_DTYPE_Q5_0:
#if FITM_DOT512
        return dot_q5_0_512(w_row, x_q, NULL, n / FITM_QK);
#else
        return dot_block32(FITM_DTYPE_Q5_0, w_row, x_q, n / FITM_QK);
#endif
    case FITM_DTYPE_Q4_K:
        return dot_q45_k(FITM_DTYPE_Q4_K, w_row, x_q, n / FITM_QK_K);
    case FITM_DTYPE_Q5_K:
        return dot_q45_k(FITM_DTYPE_Q5_K, w_row, x_q, n / FITM_QK_K);
    case FITM_DTYPE_Q6_K:
        return dot_q6_k(w_row, x_q, n / FITM_QK_K);
    default:
        return fitm_quant_dot_scalar(t, w_row, x_q, n);
    }
}

#define MATVEC_PREFETCH 8192
#define MATVEC_XS_MAX 512 /* Q8_0 blocks (K <= 16384) whose x scales matvec converts once */

void fitm_quant_matvec_simd(fitm_dtype t, const uint8_t *w, size_t row_bytes, int64_t K,
                            const void *x_q, float *y, int64_t n_rows)
{
    /* Weights stream from DRAM (a decode step reads every matrix once): prefetching
     * MATVEC_PREFETCH bytes ahead keeps more lines in flight than the hardware prefetcher
     * does on its own (Gemma 3 270M's 262144 x 640 Q8_0 head: 31 -> 37 GB/s on one thread of
     * the 2-core EPYC test machine; decode +15-25%). It runs past this call's last row on
     * purpose: the backend splits a layer's small matrices into tasks of a few KiB, and the
     * rows after a task are the next task's, about to be read (+7% decode). Prefetches never
     * fault (hence the integer address: the line may lie past the array) and change no
     * result. */
#if FITM_DOT512
    float xs[MATVEC_XS_MAX]; /* x's block scales (Q8_0), converted once for all rows */
    const bool xs_ok =
        (t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q5_0) && K / FITM_QK <= MATVEC_XS_MAX;
    if (xs_ok)
        for (int64_t i = 0; i < K / FITM_QK; i++)
            xs[i] = fp16(((const fitm_block_q8_0 *)x_q)[i].d);
#endif
    for (int64_t r = 0; r < n_rows; r++, w += row_bytes) {
        const uintptr_t pf = (uintptr_t)w + MATVEC_PREFETCH;
        for (size_t o = 0; o < row_bytes; o += 64)
            _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
#if FITM_DOT512
        if (xs_ok) {
            y[r] = t == FITM_DTYPE_Q8_0
                       ? dot_q8_0_512((const fitm_block_q8_0 *)w, x_q, xs, K / FITM_QK)
                       : dot_q5_0_512((const fitm_block_q5_0 *)w, x_q, xs, K / FITM_QK);
            continue;
        }
#endif
        y[r] = fitm_quant_dot_simd(t, w, x_q, K);
    }
}

/* Several activation rows against one weight row (decode steps of several sequences in one
 * call): each weight block is loaded and unpacked once and multiplied with every row's block,
 * so the weights stream once per call instead of being re-read (and re-unpacked) per
 * sequence. Each row's value is computed exactly as dot_block32 computes it alone: the same
 * integer block sums, the same two FMA chains (even and odd blocks) in the same order, the
 * same final sum. */
#define ROWS_MAX 4

/* The unpacked weight bytes of one 32-block (dot_block32's operand) and its scale. */
KERNEL __m256i block32_weights(fitm_dtype t, const uint8_t *blk, float *d)
{
    switch (t) {
    case FITM_DTYPE_Q4_0: {
        const fitm_block_q4_0 *b = (const fitm_block_q4_0 *)blk;
        *d = fp16(b->d);
        return nibbles32(b->qs);
    }
    case FITM_DTYPE_Q5_0: {
        const fitm_block_q5_0 *b = (const fitm_block_q5_0 *)blk;
        *d = fp16(b->d);
        return q5_0_unsigned(b);
    }
    default: {
        const fitm_block_q8_0 *b = (const fitm_block_q8_0 *)blk;
        *d = fp16(b->d);
        return loadu256(b->qs);
    }
    }
}

/* block32_dot's integer sum for unpacked weights u and activation bytes xv. */
KERNEL __m256i block32_apply(fitm_dtype t, __m256i u, __m256i xv, int bias)
{
    return t == FITM_DTYPE_Q8_0 ? dot_s8s8(u, xv) : dot_u8s8_acc(neg_bias(xv, bias), u, xv);
}

/* M rows (a compile-time constant after inlining, so the 2M accumulators stay in registers)
 * against one weight row. xs holds each row's activation block scales as floats, xs[r * nb +
 * i] = fp16(x_r[i].d): the conversion is exact, so d * xs[...] is the product dot_block32
 * forms. For Q8_0 |w| is taken once per block and shared by the rows (dot_s8s8's operands). */
KERNEL void dot_block32_rows(fitm_dtype t, const uint8_t *w, const uint8_t *xq, size_t x_stride,
                             const int M, int64_t nb, const float *xs, float *out,
                             int64_t out_stride)
{
    const size_t bb = t == FITM_DTYPE_Q4_0 ? sizeof(fitm_block_q4_0)
                      : t == FITM_DTYPE_Q5_0 ? sizeof(fitm_block_q5_0)
                                             : sizeof(fitm_block_q8_0);
    const int bias = t == FITM_DTYPE_Q4_0 ? 8 : 16;
    __m256 acc0[ROWS_MAX], acc1[ROWS_MAX];
#pragma GCC unroll 4
    for (int r = 0; r < M; r++)
        acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *row = w + (size_t)i * bb;
        float d0, d1;
        const __m256i u0 = block32_weights(t, row, &d0), u1 = block32_weights(t, row + bb, &d1);
        const __m256i a0 = _mm256_sign_epi8(u0, u0), a1 = _mm256_sign_epi8(u1, u1);
#pragma GCC unroll 4
        for (int r = 0; r < M; r++) {
            const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)(xq + (size_t)r * x_stride);
            const __m256i x0 = loadu256(x[i].qs), x1 = loadu256(x[i + 1].qs);
            __m256i p0, p1;
            if (t == FITM_DTYPE_Q8_0) {
                p0 = dot_u8s8(a0, _mm256_sign_epi8(x0, u0));
                p1 = dot_u8s8(a1, _mm256_sign_epi8(x1, u1));
            } else {
                p0 = block32_apply(t, u0, x0, bias);
                p1 = block32_apply(t, u1, x1, bias);
            }
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xs[r * nb + i]), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * xs[r * nb + i + 1]), acc1[r]);
        }
    }
    for (; i < nb; i++) {
        float d0;
        const __m256i u0 = block32_weights(t, w + (size_t)i * bb, &d0);
#pragma GCC unroll 4
        for (int r = 0; r < M; r++) {
            const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)(xq + (size_t)r * x_stride);
            const __m256i p0 = block32_apply(t, u0, loadu256(x[i].qs), bias);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xs[r * nb + i]), acc0[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < M; r++)
        out[r * out_stride] = fitm_hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

/* dot_block32_rows for one type and row count: each instance has t and M constant. */
#define DEF_ROWS(name, T, M)                                                                       \
    static void name(const uint8_t *w, const uint8_t *xq, size_t x_stride, int64_t nb,            \
                     const float *xs, float *out, int64_t out_stride)                             \
    {                                                                                              \
        dot_block32_rows(T, w, xq, x_stride, M, nb, xs, out, out_stride);                          \
    }
#define DEF_ROWS_TYPE(T, tag)                                                                      \
    DEF_ROWS(rows_##tag##_1, T, 1)                                                                 \
    DEF_ROWS(rows_##tag##_2, T, 2)                                                                 \
    DEF_ROWS(rows_##tag##_3, T, 3)                                                                 \
    DEF_ROWS(rows_##tag##_4, T, 4)
/* (FITM_DOT512 builds have their own one-row Q8_0 and Q5_0 dots: those types keep them) */
#if !FITM_DOT512
DEF_ROWS_TYPE(FITM_DTYPE_Q8_0, q8_0)
DEF_ROWS_TYPE(FITM_DTYPE_Q5_0, q5_0)
#endif
DEF_ROWS_TYPE(FITM_DTYPE_Q4_0, q4_0)

typedef void (*rowsk_fn)(const uint8_t *, const uint8_t *, size_t, int64_t, float *, int64_t);

#define DEF_ROWSK(M)                                                                               \
    static void rowsk_q4_k_##M(const uint8_t *w, const uint8_t *xq, size_t x_stride, int64_t nb,   \
                               float *out, int64_t out_stride)                                    \
    {                                                                                              \
        dot_q45_k_rows(FITM_DTYPE_Q4_K, w, xq, x_stride, M, nb, out, out_stride);                  \
    }                                                                                              \
    static void rowsk_q5_k_##M(const uint8_t *w, const uint8_t *xq, size_t x_stride, int64_t nb,   \
                               float *out, int64_t out_stride)                                    \
    {                                                                                              \
        dot_q45_k_rows(FITM_DTYPE_Q5_K, w, xq, x_stride, M, nb, out, out_stride);                  \
    }                                                                                              \
    static void rowsk_q6_k_##M(const uint8_t *w, const uint8_t *xq, size_t x_stride, int64_t nb,   \
                               float *out, int64_t out_stride)                                    \
    {                                                                                              \
        dot_q6_k_rows((const fitm_block_q6_k *)w, xq, x_stride, M, nb, out, out_stride);           \
    }
DEF_ROWSK(1)
DEF_ROWSK(2)
DEF_ROWSK(3)
DEF_ROWSK(4)
#if FITM_DOT512
DEF_ROWSK(5)
DEF_ROWSK(6)
DEF_ROWSK(7)
DEF_ROWSK(8)
#define ROWSK_TABLE(tag) {rowsk_##tag##_1, rowsk_##tag##_2, rowsk_##tag##_3, rowsk_##tag##_4, \
                          rowsk_##tag##_5, rowsk_##tag##_6, rowsk_##tag##_7, rowsk_##tag##_8}
#else
#define ROWSK_TABLE(tag) {rowsk_##tag##_1, rowsk_##tag##_2, rowsk_##tag##_3, rowsk_##tag##_4}
#endif

#if FITM_DOT512
/* Several activation rows against one Q8_0 or Q5_0 weight row on 512-bit vectors (the types
 * whose one-row dot is dot_q8_0_512 / dot_q5_0_512 in this build). Each row's value is
 * computed as that one-row dot computes it alone: the same integer sum per pair of blocks,
 * the same scale products, the same two accumulators (pair p into accumulator p % 2), the
 * same tail and final sum. What the rows share is the weight pair, loaded and unpacked once
 * for all of them as unsigned bytes: Q5_0's 5-bit values, or Q8_0's w + 128 (w ^ 0x80), whose
 * dot with x is the signed dot plus 128 * (sums of 4 x bytes), an exact integer identity the
 * bias start below takes off again. For each chunk of rows the caller forms, once per call,
 * an entry per row r and full pair p of blocks 2p and 2p + 1 (entry r * np + p):
 *   x      the row's 64 activation bytes of the pair, contiguous
 *   bias   the integer sum's start, -bias * (sums of 4 x bytes): 128 for Q8_0, 16 for Q5_0
 *   scale  the row's block scales [xs(2p) x 8, xs(2p+1) x 8] (fp16 -> fp32 is exact, and a
 *          vector multiply by w's pair scales rounds each lane as the scalar product does) */
#define ROWS512_MAX 8       /* rows per kernel call: 2 x 8 accumulators of 32 registers */
/* The kernels f_1 .. f_8 of a DEF_* family, indexed by rows - 1. */
#define BY_ROWS8(f) {f##_1, f##_2, f##_3, f##_4, f##_5, f##_6, f##_7, f##_8}
#define ROWS512_ENTRIES 160 /* entries held on the stack (30 KiB): 16 rows of K = 640 */

typedef struct {
    __m512i x, bias;
    __m512 scale;
} rows512_entry;

KERNEL __m512 pair_scales(float a, float b)
{
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* The unsigned weight bytes of full pair p and the pair's weight scales. */
KERNEL __m512i pair512_weights(fitm_dtype t, const uint8_t *w, int64_t p, __m512 *ws)
{
    if (t == FITM_DTYPE_Q8_0) {
        const fitm_block_q8_0 *b = (const fitm_block_q8_0 *)w + 2 * p;
        *ws = pair_scales(fp16(b[0].d), fp16(b[1].d));
        return _mm512_xor_si512(load_q8_0_pair(b), _mm512_set1_epi8((char)0x80));
    }
    const fitm_block_q5_0 *b = (const fitm_block_q5_0 *)w + 2 * p;
    *ws = pair_scales(fp16(b[0].d), fp16(b[1].d));
    return q5_0_pair_unsigned(b);
}

KERNEL __m512 pair512_step(__m512 acc, __m512i u, __m512 ws, const rows512_entry *e)
{
    const __m512i p = _mm512_dpbusd_epi32(e->bias, u, e->x);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(ws, e->scale), acc);
}

KERNEL void dot_pairs512_rows(fitm_dtype t, const uint8_t *w, const uint8_t *xq, size_t x_stride,
                              const int M, int64_t nb, const rows512_entry *ent, float *out,
                              int64_t out_stride)
{
    const int64_t np = nb / 2;
    __m512 acc0[ROWS512_MAX], acc1[ROWS512_MAX];
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= np; p += 2) {
        __m512 ws0, ws1;
        const __m512i u0 = pair512_weights(t, w, p, &ws0), u1 = pair512_weights(t, w, p + 1, &ws1);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
            acc0[r] = pair512_step(acc0[r], u0, ws0, &ent[r * np + p]);
            acc1[r] = pair512_step(acc1[r], u1, ws1, &ent[r * np + p + 1]);
        }
    }
    if (p < np) {
        __m512 ws0;
        const __m512i u0 = pair512_weights(t, w, p, &ws0);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            acc0[r] = pair512_step(acc0[r], u0, ws0, &ent[r * np + p]);
    }
    const int64_t j = 2 * np; /* an odd last block, as the one-row dot runs it */
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
        const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)(xq + (size_t)r * x_stride);
        float tail = 0.0f;
        if (t == FITM_DTYPE_Q8_0)
            acc0[r] = q8_0_tail(acc0[r], (const fitm_block_q8_0 *)w, x, NULL, j, nb);
        else if (j < nb)
            tail = q5_0_last_block((const fitm_block_q5_0 *)w + j, x + j, fp16(x[j].d));
        out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + tail;
    }
}

typedef void (*rows512_fn)(const uint8_t *, const uint8_t *, size_t, int64_t,
                           const rows512_entry *, float *, int64_t);

#define DEF_ROWS512(M)                                                                             \
    static void rows512_q8_0_##M(const uint8_t *w, const uint8_t *xq, size_t x_stride,           \
                                 int64_t nb, const rows512_entry *e, float *out, int64_t stride)  \
    {                                                                                              \
        dot_pairs512_rows(FITM_DTYPE_Q8_0, w, xq, x_stride, M, nb, e, out, stride);                \
    }                                                                                              \
    static void rows512_q5_0_##M(const uint8_t *w, const uint8_t *xq, size_t x_stride,           \
                                 int64_t nb, const rows512_entry *e, float *out, int64_t stride)  \
    {                                                                                              \
        dot_pairs512_rows(FITM_DTYPE_Q5_0, w, xq, x_stride, M, nb, e, out, stride);                \
    }
DEF_ROWS512(1)
DEF_ROWS512(2)
DEF_ROWS512(3)
DEF_ROWS512(4)
DEF_ROWS512(5)
DEF_ROWS512(6)
DEF_ROWS512(7)
DEF_ROWS512(8)

/* M >= 2 rows of Q8_0 or Q5_0 with np = K / 64 <= ROWS512_ENTRIES / 2. When the entries of
 * all M rows fit the stack, each weight row is read once and applied to the rows ROWS512_MAX
 * at a time; otherwise chunks of rows whose entries fit run one after another over all the
 * task's weight rows (matvec_rows512_once says which). */
static int64_t matvec_rows512_once(int64_t np)
{
    return np ? ROWS512_ENTRIES / np : ROWS512_ENTRIES;
}

/* Whether matvec_rows512 takes rows of type t with nb blocks (at least 2 rows' entries fit). */
static bool rows512_takes(fitm_dtype t, int64_t nb)
{
    return (t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q5_0) && nb / 2 <= ROWS512_ENTRIES / 2;
}

static void matvec_rows512(fitm_dtype t, const uint8_t *w, size_t row_bytes, int64_t K,
                           const uint8_t *xq, size_t x_stride, int64_t M, float *y,
                           int64_t y_stride, int64_t n_rows)
{
    static const rows512_fn q8_0[ROWS512_MAX] = BY_ROWS8(rows512_q8_0),
                            q5_0[ROWS512_MAX] = BY_ROWS8(rows512_q5_0);
    const rows512_fn *fn = t == FITM_DTYPE_Q8_0 ? q8_0 : q5_0;
    const int64_t nb = K / FITM_QK, np = nb / 2, once = matvec_rows512_once(np);
    const int64_t pass = M <= once ? M : once; /* rows whose entries are formed at a time */
    const __m512i bias = _mm512_set1_epi8((char)(t == FITM_DTYPE_Q8_0 ? 128 : 16));
    rows512_entry ent[ROWS512_ENTRIES];
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t n = M - m0 < pass ? M - m0 : pass;
        const uint8_t *xc = xq + (size_t)m0 * x_stride;
        for (int64_t r = 0; r < n; r++) {
            const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)(xc + (size_t)r * x_stride);
            for (int64_t p = 0; p < np; p++) {
                rows512_entry *e = &ent[r * np + p];
                e->x = load_q8_0_pair(x + 2 * p);
                e->bias = bias_start512(bias, e->x);
                e->scale = pair_scales(fp16(x[2 * p].d), fp16(x[2 * p + 1].d));
            }
        }
        const uint8_t *wr = w;
        for (int64_t r = 0; r < n_rows; r++, wr += row_bytes) {
            const uintptr_t pf = (uintptr_t)wr + MATVEC_PREFETCH; /* as fitm_quant_matvec_simd */
            for (size_t o = 0; m0 == 0 && o < row_bytes; o += 64)
                _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
            for (int64_t c0 = 0; c0 < n; c0 += ROWS512_MAX) {
                const int k = (int)(n - c0 < ROWS512_MAX ? n - c0 : ROWS512_MAX);
                fn[k - 1](wr, xc + (size_t)c0 * x_stride, x_stride, nb, ent + c0 * np,
                          y + (m0 + c0) * y_stride + r, y_stride);
            }
        }
    }
}

/* Packed Q8_0 and Q5_0 weights (quant_internal.h): a chunk's eight 64-byte vectors hold 16
 * weight rows side by side, four bytes each, so for one activation row the block's integer
 * sums of all 16 rows are eight vpdpbusd with the row's dwords broadcast, starting from the
 * row's -off * (sum of its 32 bytes) (the unsigned values' offset, an exact identity); then
 * one fma per block per row into a vector whose lane r is output row r. No lane is ever
 * summed with another, so each output is the chain fitm_quant_matvec_packed_scalar computes,
 * and the weights a chunk decodes once serve up to PACKED01_MAX activation rows. */
/* Activation rows per kernel call. Q8_0 and Q5_0: 16 accumulators and 8 weight vectors, 26 of
 * the 32 vector registers. Unpacking a chunk, and each row's conversion and fma per block, run
 * on the same ports as the dot products; 16 rows a chunk instead of 8 halve the unpacking a
 * row (docs/cpu-forward-benchmark.md). The K-quants keep an integer sum per row besides its
 * accumulator, so 8 there. */
#define PACKED01_MAX 16
#define PACKED_MAX 8
#define PACKED_XS_MAX FITM_PACK_MAX_BLOCKS /* (row, block) entries prepared per pass (32 KiB) */
/* With 4 or more activation rows a packed product is bound by the vector units more than by
 * memory, and the hardware prefetchers alone fall behind: the kernel then asks for the
 * weights PACKED_AHEAD bytes ahead, into L2 (a step of 8 sequences: the output head 6.4 ->
 * 5.8 ms, the Q5_0 gate and up products 2.2 -> 2.0 ms; 8, 16 and 32 KiB alike). With fewer
 * rows the product streams at memory speed and the requests only cost (one row: the head
 * 4.6 -> 5.8 ms), so it does not ask. Prefetches never fault, so those past the weight's end
 * are harmless. */
#define PACKED_AHEAD 8192
#define PACKED_AHEAD_ROWS 4

typedef struct {
    int32_t bias; /* -off * (sum of the block's 32 activation bytes) */
    float d;      /* the block's activation scale                    */
} packed_x;

/* The 16 rows' scales and unsigned value vectors V_0..V_7 of one chunk. */
KERNEL void packed_chunk(fitm_dtype t, const uint8_t *c, __m512 *dw, __m512i v[8])
{
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c));
    if (t == FITM_DTYPE_Q8_0) {
        const fitm_chunk_q8_0x16 *q = (const fitm_chunk_q8_0x16 *)c;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            v[k] = _mm512_loadu_si512(q->q[k]);
        return;
    }
    const fitm_chunk_q5_0x16 *q = (const fitm_chunk_q5_0x16 *)c;
    const __m512i low4 = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(16);
#pragma GCC unroll 4
    for (int k = 0; k < 8; k += 2) {
        const __m512i n = _mm512_loadu_si512(q->nib[k / 2]);
        v[k] = _mm512_or_si512(_mm512_and_si512(n, low4), _mm512_maskz_mov_epi8(q->hi[k], five));
        v[k + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n, 4), low4),
                                   _mm512_maskz_mov_epi8(q->hi[k + 1], five));
    }
}

/* acc + the dot products of u's unsigned bytes with the 4 signed bytes at x, repeated in
 * every dword: vpdpbusd with its broadcast read from memory ({1to16}), one instruction where
 * _mm512_set1_epi32 makes the compiler emit a separate broadcast that competes with the dot
 * products for the vector units. */
typedef int32_t i32_any __attribute__((may_alias, aligned(1)));

KERNEL __m512i dpbusd_bcst(__m512i acc, __m512i u, const int8_t *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const i32_any *)x));
    return acc;
}

/* The M activation rows' 16 outputs each, row m's at y + m * y_stride. */
KERNEL void store_rows(const __m512 *acc, const int M, float *y, int64_t y_stride)
{
#pragma GCC unroll 16
    for (int m = 0; m < M; m++)
        _mm512_storeu_ps(y + m * y_stride, acc[m]);
}

KERNEL void packed_group(fitm_dtype t, const uint8_t *P, int64_t nb, const uint8_t *xq,
                         size_t x_stride, const packed_x *px, const int M, float *y,
                         int64_t y_stride)
{
    const size_t cb = fitm_chunk_bytes(t);
    __m512 acc[PACKED01_MAX] = {0}; /* row m's 16 outputs */
    for (int64_t b = 0; b < nb; b++) {
        __m512 dw;
        __m512i v[8];
        if (M >= PACKED_AHEAD_ROWS)
            for (size_t o = 0; o < cb; o += 64)
                _mm_prefetch((const char *)P + (size_t)b * cb + PACKED_AHEAD + o, _MM_HINT_T1);
        packed_chunk(t, P + (size_t)b * cb, &dw, v);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            const packed_x *e = &px[m * nb + b];
            const int8_t *x = ((const fitm_block_q8_0 *)(xq + (size_t)m * x_stride))[b].qs;
            __m512i s = _mm512_set1_epi32(e->bias);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                s = dpbusd_bcst(s, v[k], x + 4 * k);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(e->d)),
                                     acc[m]);
        }
    }
    store_rows(acc, M, y, y_stride);
}

/* Packed Q4_K: per super-block and sub-block j, eight vpdpbusd of the 16 rows' nibbles
 * (low ones for even j, high for odd) with the activation's dwords give each row's integer
 * dot in its lane; times the rows' scales (vpmulld) they add up to isum. The mins' sum is
 * four vpdpwssd of the rows' (m, m') word pairs with the activation's pairs of sub-block
 * sums. Both exact, then the two fmas of the reference chain per block. */
typedef struct {
    int16_t bs[8]; /* the activation's sum over each sub-block of 32 */
    float d;
} packed_xk;

#define PACKED_XK_MAX (FITM_PACK_MAX_BLOCKS / 8)

/* The 16 rows' scales of sub-block j (Q4_K) and of group g (Q6_K, signed), one per dword; and
 * the Q4_K rows' mins of sub-block j. The products and fitm_packed_cols both read them. */
KERNEL __m512i q4_k_scales(const fitm_chunk_q4_kx16 *c, int j)
{
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c->sc[j]));
}

KERNEL __m512i q4_k_mins(const fitm_chunk_q4_kx16 *c, int j)
{
    const __m512i pairs = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)c->m[j / 2]));
    return j % 2 ? _mm512_srli_epi32(pairs, 16) : _mm512_and_si512(pairs, _mm512_set1_epi32(0xFF));
}

KERNEL __m512i q6_k_scales(const fitm_chunk_q6_kx16 *c, int g)
{
    const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)c->sc[g / 2]));
    return g % 2 ? _mm512_srai_epi32(pair, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
}

KERNEL __m512i dpwssd_bcst(__m512i acc, __m512i w, const int16_t *x)
{
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_any *)x));
    return acc;
}

/* isum + sc * (the dots of the n vectors v with x's n dwords): one activation row's integer
 * sum over a sub-block for the 16 rows, times the rows' scales, added to their block sums. */
KERNEL __m512i scaled_dots(__m512i isum, const __m512i *v, const int n, const int8_t *x,
                           __m512i sc)
{
    __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < n; k++)
        s = dpbusd_bcst(s, v[k], x + 4 * k);
    return _mm512_add_epi32(isum, _mm512_mullo_epi32(s, sc));
}

KERNEL void packed_q4_k_group(const fitm_chunk_q4_kx16 *C, int64_t nb, const uint8_t *xq,
                              size_t x_stride, const packed_xk *px, const int M, float *y,
                              int64_t y_stride)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PACKED_MAX] = {0}; /* row m's 16 outputs */
    for (int64_t b = 0; b < nb; b++) {
        const fitm_chunk_q4_kx16 *c = &C[b];
        if (M >= PACKED_AHEAD_ROWS)
            for (size_t o = 0; o < sizeof *c; o += 64)
                _mm_prefetch((const char *)c + PACKED_AHEAD + o, _MM_HINT_T1);
        __m512i isum[PACKED_MAX] = {0}; /* row m's block sums */
        for (int j = 0; j < 8; j++) {
            const __m512i sc = q4_k_scales(c, j);
            __m512i v[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i n = _mm512_loadu_si512(c->nib[j / 2][k]);
                v[k] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(n, 4) : n, low4);
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)m * x_stride);
                isum[m] = scaled_dots(isum[m], v, 8, x[b].qs + 32 * j, sc);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d)),
                     dmw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->dmin));
        __m512i mins[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            mins[k] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)c->m[k]));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const packed_xk *e = &px[m * nb + b];
            __m512i ms = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                ms = dpwssd_bcst(ms, mins[k], e->bs + 2 * k);
            const __m512 dx = _mm512_set1_ps(e->d);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(dw, dx), acc[m]);
            acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmw, dx), acc[m]);
        }
    }
    store_rows(acc, M, y, y_stride);
}

/* Packed Q6_K: per group of 16 elements, four value vectors (low nibbles and top two bits
 * put together), four vpdpbusd per activation row and one vpmulld by the rows' signed scales;
 * the values' offset 32 comes off at the end as 32 * sum of scale * (the activation's group
 * sum), eight vpdpwssd of the rows' scale pairs with the activation's pairs of sums (Q8_K's
 * bsums). Exact, then the reference chain's one fma per block. */
KERNEL void packed_q6_k_group(const fitm_chunk_q6_kx16 *C, int64_t nb, const uint8_t *xq,
                              size_t x_stride, const int M, float *y, int64_t y_stride)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    __m512 acc[PACKED_MAX] = {0}; /* row m's 16 outputs */
    for (int64_t b = 0; b < nb; b++) {
        const fitm_chunk_q6_kx16 *c = &C[b];
        /* at every row count: unpacking a Q6_K chunk costs enough that one row's product no
         * longer streams at memory speed by itself (a 1-row step's Q6_K ffn_down, 9 layers:
         * ~0.2 ms more without, ~0.05 ms less with, than the stored layout's kernel) */
        for (size_t o = 0; o < sizeof *c; o += 64)
            _mm_prefetch((const char *)c + PACKED_AHEAD + o, _MM_HINT_T1);
        __m512i isum[PACKED_MAX] = {0}; /* row m's block sums */
        for (int g = 0; g < 16; g++) {
            const __m512i sc = q6_k_scales(c, g);
            const __m512i n0 = _mm512_loadu_si512(c->nib[2 * g]),
                          n1 = _mm512_loadu_si512(c->nib[2 * g + 1]),
                          h = _mm512_loadu_si512(c->hi[g]);
            __m512i v[4];
            v[0] = _mm512_or_si512(_mm512_and_si512(n0, low4),
                                   _mm512_and_si512(_mm512_slli_epi16(h, 4), top2));
            v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n0, 4), low4),
                                   _mm512_and_si512(_mm512_slli_epi16(h, 2), top2));
            v[2] = _mm512_or_si512(_mm512_and_si512(n1, low4), _mm512_and_si512(h, top2));
            v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n1, 4), low4),
                                   _mm512_and_si512(_mm512_srli_epi16(h, 2), top2));
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)m * x_stride);
                isum[m] = scaled_dots(isum[m], v, 4, x[b].qs + 16 * g, sc);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        __m512i scs[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            scs[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)c->sc[k]));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xq + (size_t)m * x_stride) + b;
            __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                off = dpwssd_bcst(off, scs[k], x->bsums + 2 * k);
            isum[m] = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(off, 5));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(x->d)), acc[m]);
        }
    }
    store_rows(acc, M, y, y_stride);
}

/* Row n of a packed weight as 32 signed values per block (u - off), then the stored row's
 * dequantizer's product (store_mul: (float)q * d), so the floats are the same bits. */
static inline void store_mul(__m256i q, float d, float *y);

void fitm_quant_packed_row_simd(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst)
{
    if (t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q6_K) {
        fitm_quant_packed_row_k(t, P, K, n, dst);
        return;
    }
    const int64_t nb = K / FITM_QK, g = n / FITM_PACK_ROWS;
    const int r = (int)(n % FITM_PACK_ROWS);
    const size_t cb = fitm_chunk_bytes(t);
    const uint8_t *c = (const uint8_t *)P + (size_t)(g * nb) * cb;
    int32_t d4[8];
    for (int64_t b = 0; b < nb; b++, c += cb, dst += FITM_QK) {
        const uint16_t d = ((const uint16_t *)c)[r];
        __m256i q;
        if (t == FITM_DTYPE_Q8_0) {
            const fitm_chunk_q8_0x16 *ch = (const fitm_chunk_q8_0x16 *)c;
            for (int k = 0; k < 8; k++)
                memcpy(&d4[k], ch->q[k] + 4 * r, 4);
            q = _mm256_xor_si256(loadu256(d4), _mm256_set1_epi8((char)0x80));
        } else {
            const fitm_chunk_q5_0x16 *ch = (const fitm_chunk_q5_0x16 *)c;
            for (int k = 0; k < 4; k++)
                memcpy(&d4[k], ch->nib[k] + 4 * r, 4);
            const __m128i nib = _mm_loadu_si128((const __m128i *)d4), low4 = _mm_set1_epi8(0x0F);
            const __m128i lo = _mm_and_si128(nib, low4),
                          hi = _mm_and_si128(_mm_srli_epi16(nib, 4), low4);
            /* dword k of the row: even k low nibbles of nib[k / 2], odd k high ones */
            q = _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
            uint32_t fifth = 0;
            for (int k = 0; k < 8; k++)
                fifth |= (uint32_t)((ch->hi[k] >> (4 * r)) & 0xF) << (4 * k);
            q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_maskz_mov_epi8(fifth, _mm256_set1_epi8(16))),
                                _mm256_set1_epi8(16));
        }
        store_mul(q, fp16(d), dst);
    }
}

/* fitm_packed_cols. A chunk's 64-byte vector of a dword group holds the 16 rows' 4 values side
 * by side, a dword per row, so column c of the group is lane r's byte c: one shift and mask
 * give all 16 rows of a column in their lanes, and the rows' scales (a vector too) turn them
 * into floats with the row reader's operations (u - off, then times d; K-quants d * sc times
 * the value, minus dmin * m), lane by lane. */
KERNEL __m512i byte_col(__m512i u, int shift, int mask)
{
    return _mm512_and_si512(_mm512_srli_epi32(u, (unsigned)shift), _mm512_set1_epi32(mask));
}

KERNEL void cols_q8_0_q5_0(fitm_dtype t, const uint8_t *c, float *dst, int64_t ld)
{
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c));
    const __m512i off = _mm512_set1_epi32(fitm_chunk_off(t)), fifth = _mm512_set1_epi32(16);
    for (int k = 0; k < 8; k++, dst += 4 * ld) {
        __m512i u;
        uint64_t hi = 0;
        if (t == FITM_DTYPE_Q8_0) {
            u = _mm512_loadu_si512(((const fitm_chunk_q8_0x16 *)c)->q[k]);
        } else {
            const fitm_chunk_q5_0x16 *q = (const fitm_chunk_q5_0x16 *)c;
            u = _mm512_srli_epi32(_mm512_loadu_si512(q->nib[k / 2]), 4 * (k % 2));
            hi = q->hi[k]; /* bit 4r + c: row r's column c */
        }
        for (int col = 0; col < 4; col++) {
            __m512i v = byte_col(u, 8 * col, t == FITM_DTYPE_Q8_0 ? 0xFF : 0x0F);
            if (t == FITM_DTYPE_Q5_0)
                v = _mm512_mask_or_epi32(v, (__mmask16)_pext_u64(hi, 0x1111111111111111ull << col),
                                         v, fifth);
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(v, off));
            _mm512_storeu_ps(dst + col * ld, _mm512_mul_ps(f, d));
        }
    }
}

KERNEL void cols_q4_k(const fitm_chunk_q4_kx16 *c, float *dst, int64_t ld)
{
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d)),
                 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->dmin));
    for (int p = 0; p < 4; p++, dst += 64 * ld) { /* sub-blocks 2p (low nibbles), 2p + 1 */
        const __m512 d0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q4_k_scales(c, 2 * p))),
                     d1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q4_k_scales(c, 2 * p + 1))),
                     o0 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(q4_k_mins(c, 2 * p))),
                     o1 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(q4_k_mins(c, 2 * p + 1)));
        for (int k = 0; k < 8; k++) {
            const __m512i u = _mm512_loadu_si512(c->nib[p][k]);
            for (int col = 0; col < 4; col++) {
                float *y = dst + (4 * k + col) * ld;
                const __m512 lo = _mm512_cvtepi32_ps(byte_col(u, 8 * col, 0xF)),
                             hi = _mm512_cvtepi32_ps(byte_col(u, 8 * col + 4, 0xF));
                _mm512_storeu_ps(y, _mm512_sub_ps(_mm512_mul_ps(d0, lo), o0));
                _mm512_storeu_ps(y + 32 * ld, _mm512_sub_ps(_mm512_mul_ps(d1, hi), o1));
            }
        }
    }
}

KERNEL void cols_q6_k(const fitm_chunk_q6_kx16 *c, float *dst, int64_t ld)
{
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
    const __m512i off = _mm512_set1_epi32(32);
    __m512 dg[16]; /* group g's scales d * sc */
    for (int g = 0; g < 16; g++)
        dg[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q6_k_scales(c, g)));
    for (int k = 0; k < 64; k++, dst += 4 * ld) { /* elements 4k..4k+3 */
        const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512(c->nib[k / 2]), 4 * (k % 2)),
                      hi = _mm512_srli_epi32(_mm512_loadu_si512(c->hi[k / 4]), 2 * (k % 4));
        for (int col = 0; col < 4; col++) {
            const __m512i u = _mm512_or_si512(byte_col(lo, 8 * col, 0xF),
                                              _mm512_slli_epi32(byte_col(hi, 8 * col, 3), 4));
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, off));
            _mm512_storeu_ps(dst + col * ld, _mm512_mul_ps(dg[k / 4], f));
        }
    }
}

void fitm_quant_packed_cols_simd(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst,
                                 int64_t ld)
{
    const int64_t E = fitm_chunk_elems(t), nb = K / E;
    const size_t cb = fitm_chunk_bytes(t);
    const uint8_t *c = (const uint8_t *)P + (size_t)((n / FITM_PACK_ROWS) * nb) * cb;
    for (int64_t b = 0; b < nb; b++, c += cb, dst += E * ld) {
        if (t == FITM_DTYPE_Q4_K)
            cols_q4_k((const fitm_chunk_q4_kx16 *)c, dst, ld);
        else if (t == FITM_DTYPE_Q6_K)
            cols_q6_k((const fitm_chunk_q6_kx16 *)c, dst, ld);
        else
            cols_q8_0_q5_0(t, c, dst, ld);
    }
}

typedef void (*packed_fn)(const uint8_t *, int64_t, const uint8_t *, size_t, const packed_x *,
                          float *, int64_t);

#define DEF_PACKED01(M)                                                                            \
    static void packed_q8_0_##M(const uint8_t *P, int64_t nb, const uint8_t *xq, size_t xs,       \
                                const packed_x *px, float *y, int64_t ys)                         \
    {                                                                                              \
        packed_group(FITM_DTYPE_Q8_0, P, nb, xq, xs, px, M, y, ys);                                \
    }                                                                                              \
    static void packed_q5_0_##M(const uint8_t *P, int64_t nb, const uint8_t *xq, size_t xs,       \
                                const packed_x *px, float *y, int64_t ys)                         \
    {                                                                                              \
        packed_group(FITM_DTYPE_Q5_0, P, nb, xq, xs, px, M, y, ys);                                \
    }
#define DEF_PACKED_K(M)                                                                            \
    static void packed_q4_k_##M(const fitm_chunk_q4_kx16 *P, int64_t nb, const uint8_t *xq,       \
                                size_t xs, const packed_xk *px, float *y, int64_t ys)             \
    {                                                                                              \
        packed_q4_k_group(P, nb, xq, xs, px, M, y, ys);                                            \
    }                                                                                              \
    static void packed_q6_k_##M(const fitm_chunk_q6_kx16 *P, int64_t nb, const uint8_t *xq,       \
                                size_t xs, float *y, int64_t ys)                                  \
    {                                                                                              \
        packed_q6_k_group(P, nb, xq, xs, M, y, ys);                                                \
    }
#define DEF_PACKED(M) DEF_PACKED01(M) DEF_PACKED_K(M)
DEF_PACKED(1)
DEF_PACKED(2)
DEF_PACKED(3)
DEF_PACKED(4)
DEF_PACKED(5)
DEF_PACKED(6)
DEF_PACKED(7)
DEF_PACKED(8)
DEF_PACKED01(9)
DEF_PACKED01(10)
DEF_PACKED01(11)
DEF_PACKED01(12)
DEF_PACKED01(13)
DEF_PACKED01(14)
DEF_PACKED01(15)
DEF_PACKED01(16)
#define BY_ROWS16(f)                                                                               \
    {f##_1, f##_2,  f##_3,  f##_4,  f##_5,  f##_6,  f##_7,  f##_8,                                \
     f##_9, f##_10, f##_11, f##_12, f##_13, f##_14, f##_15, f##_16}

typedef void (*packed_k_fn)(const fitm_chunk_q4_kx16 *, int64_t, const uint8_t *, size_t,
                            const packed_xk *, float *, int64_t);

typedef void (*packed_k6_fn)(const fitm_chunk_q6_kx16 *, int64_t, const uint8_t *, size_t,
                             float *, int64_t);

static void matvec_packed_q6_k(const uint8_t *P, int64_t K, const void *x_q, size_t x_stride,
                               int64_t M, float *y, int64_t y_stride, int64_t n_groups)
{
    static const packed_k6_fn fn[PACKED_MAX] = BY_ROWS8(packed_q6_k);
    const int64_t nb = K / FITM_QK_K;
    const fitm_chunk_q6_kx16 *C = (const fitm_chunk_q6_kx16 *)P;
    for (int64_t g = 0; g < n_groups; g++)
        for (int64_t c0 = 0; c0 < M; c0 += PACKED_MAX) {
            const int k = (int)(M - c0 < PACKED_MAX ? M - c0 : PACKED_MAX);
            fn[k - 1](C + g * nb, nb, (const uint8_t *)x_q + (size_t)c0 * x_stride, x_stride,
                      y + c0 * y_stride + g * FITM_PACK_ROWS, y_stride);
        }
}

static void matvec_packed_q4_k(const uint8_t *P, int64_t K, const void *x_q, size_t x_stride,
                               int64_t M, float *y, int64_t y_stride, int64_t n_groups)
{
    static const packed_k_fn fn[PACKED_MAX] = BY_ROWS8(packed_q4_k);
    const int64_t nb = K / FITM_QK_K;
    const int64_t pass = PACKED_XK_MAX / nb < M ? PACKED_XK_MAX / nb : M; /* >= 1: quant.c */
    const fitm_chunk_q4_kx16 *C = (const fitm_chunk_q4_kx16 *)P;
    packed_xk px[PACKED_XK_MAX];
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t n = M - m0 < pass ? M - m0 : pass;
        const uint8_t *xc = (const uint8_t *)x_q + (size_t)m0 * x_stride;
        for (int64_t m = 0; m < n; m++) {
            const fitm_block_q8_k *x = (const fitm_block_q8_k *)(xc + (size_t)m * x_stride);
            for (int64_t b = 0; b < nb; b++) {
                packed_xk *e = &px[m * nb + b];
                for (int j = 0; j < 8; j++) /* |sum| <= 32 * 128: an int16 */
                    e->bs[j] = (int16_t)(x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
                e->d = x[b].d;
            }
        }
        for (int64_t g = 0; g < n_groups; g++)
            for (int64_t c0 = 0; c0 < n; c0 += PACKED_MAX) {
                const int k = (int)(n - c0 < PACKED_MAX ? n - c0 : PACKED_MAX);
                fn[k - 1](C + g * nb, nb, xc + (size_t)c0 * x_stride, x_stride, px + c0 * nb,
                          y + (m0 + c0) * y_stride + g * FITM_PACK_ROWS, y_stride);
            }
    }
}

void fitm_quant_matvec_packed_simd(fitm_dtype t, const uint8_t *P, int64_t K, const void *x_q,
                                   size_t x_stride, int64_t M, float *y, int64_t y_stride,
                                   int64_t n_groups)
{
    if (t == FITM_DTYPE_Q4_K) {
        matvec_packed_q4_k(P, K, x_q, x_stride, M, y, y_stride, n_groups);
        return;
    }
    if (t == FITM_DTYPE_Q6_K) {
        matvec_packed_q6_k(P, K, x_q, x_stride, M, y, y_stride, n_groups);
        return;
    }
    static const packed_fn q8_0[PACKED01_MAX] = BY_ROWS16(packed_q8_0),
                           q5_0[PACKED01_MAX] = BY_ROWS16(packed_q5_0);
    const packed_fn *fn = t == FITM_DTYPE_Q8_0 ? q8_0 : q5_0;
    const int64_t nb = K / FITM_QK;
    const int off = fitm_chunk_off(t);
    const size_t cb = fitm_chunk_bytes(t);
    const size_t group = (size_t)nb * cb;
    const int64_t pass = PACKED_XS_MAX / nb < M ? PACKED_XS_MAX / nb : M; /* >= 1: quant.c */
    packed_x px[PACKED_XS_MAX];
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t n = M - m0 < pass ? M - m0 : pass;
        const uint8_t *xc = (const uint8_t *)x_q + (size_t)m0 * x_stride;
        for (int64_t m = 0; m < n; m++) {
            const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)(xc + (size_t)m * x_stride);
            for (int64_t b = 0; b < nb; b++) {
                const __m256i s = _mm256_sad_epu8(
                    _mm256_xor_si256(loadu256(x[b].qs), _mm256_set1_epi8((char)0x80)),
                    _mm256_setzero_si256()); /* sums of (q + 128) per 8 bytes */
                const int32_t sum = _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 2) +
                                    _mm256_extract_epi32(s, 4) + _mm256_extract_epi32(s, 6) -
                                    128 * FITM_QK;
                px[m * nb + b] = (packed_x){-off * sum, fp16(x[b].d)};
            }
        }
        for (int64_t g = 0; g < n_groups; g++) {
            const uint8_t *pg = P + (size_t)g * group;
            for (int64_t c0 = 0; c0 < n; c0 += PACKED01_MAX) {
                const int k = (int)(n - c0 < PACKED01_MAX ? n - c0 : PACKED01_MAX);
                fn[k - 1](pg, nb, xc + (size_t)c0 * x_stride, x_stride, px + c0 * nb,
                          y + (m0 + c0) * y_stride + g * FITM_PACK_ROWS, y_stride);
            }
        }
    }
}
#endif

typedef void (*rows_fn)(const uint8_t *, const uint8_t *, size_t, int64_t, const float *, float *,
                        int64_t);

#define ROWS_XS_MAX 2048 /* activation block scales held on the stack (M * K / 32) */

int64_t fitm_quant_matvec_rows_once_simd(fitm_dtype t, int64_t K)
{
    const int64_t nb = K / FITM_QK;
#if FITM_DOT512
    if (rows512_takes(t, nb))
        return matvec_rows512_once(nb / 2);
    if (t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q5_0) /* rows too wide: the one-row dots */
        return INT64_MAX;
    const bool block32 = t == FITM_DTYPE_Q4_0;
#else
    const bool block32 = t == FITM_DTYPE_Q4_0 || t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q5_0;
#endif
    /* the block-32 rows kernels while the rows' scales fit (beyond: one matvec per row); the
     * other types walk the weight rows once for any number of rows */
    return block32 ? (ROWS_XS_MAX / nb > 1 ? ROWS_XS_MAX / nb : 1) : INT64_MAX;
}

void fitm_quant_matvec_rows_simd(fitm_dtype t, const uint8_t *w, size_t row_bytes, int64_t K,
                                 const void *x_q, size_t x_stride, int64_t M, float *y,
                                 int64_t y_stride, int64_t n_rows)
{
    /* The types whose one-row dot is dot_block32 in this build (FITM_DOT512 has its own
     * Q8_0 and Q5_0 kernels, and matvec_rows512 their rows). */
    static const rows_fn q4_0[4] = {rows_q4_0_1, rows_q4_0_2, rows_q4_0_3, rows_q4_0_4};
    const rows_fn *fn = t == FITM_DTYPE_Q4_0 ? q4_0 : NULL;
#if !FITM_DOT512
    static const rows_fn q8_0[4] = {rows_q8_0_1, rows_q8_0_2, rows_q8_0_3, rows_q8_0_4};
    static const rows_fn q5_0[4] = {rows_q5_0_1, rows_q5_0_2, rows_q5_0_3, rows_q5_0_4};
    fn = t == FITM_DTYPE_Q8_0 ? q8_0 : t == FITM_DTYPE_Q5_0 ? q5_0 : fn;
#endif
    const int64_t nb = K / FITM_QK;
#if FITM_DOT512
    if (M >= 2 && rows512_takes(t, nb)) {
        matvec_rows512(t, w, row_bytes, K, x_q, x_stride, M, y, y_stride, n_rows);
        return;
    }
#endif
    if (M < 2 || (fn && M * nb > ROWS_XS_MAX)) {
        for (int64_t m = 0; m < M; m++)
            fitm_quant_matvec_simd(t, w, row_bytes, K, (const uint8_t *)x_q + (size_t)m * x_stride,
                                   y + m * y_stride, n_rows);
        return;
    }
    if (!fn) {
        /* Other types: each weight row against every activation row while it is in L1, so
         * the weights stream from memory once; the K-quants through their multi-row kernels
         * (ROWSK_MAX rows at a time), the rest through the one-row dot (the same values). */
        static const rowsk_fn q4_k[ROWSK_MAX] = ROWSK_TABLE(q4_k);
        static const rowsk_fn q5_k[ROWSK_MAX] = ROWSK_TABLE(q5_k);
        static const rowsk_fn q6_k[ROWSK_MAX] = ROWSK_TABLE(q6_k);
        const rowsk_fn *kf = t == FITM_DTYPE_Q4_K   ? q4_k
                             : t == FITM_DTYPE_Q5_K ? q5_k
                             : t == FITM_DTYPE_Q6_K ? q6_k
                                                    : NULL;
        for (int64_t r = 0; r < n_rows; r++, w += row_bytes) {
            const uintptr_t pf = (uintptr_t)w + MATVEC_PREFETCH;
            for (size_t o = 0; o < row_bytes; o += 64)
                _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
            for (int64_t m0 = 0; kf && m0 < M; m0 += ROWSK_MAX) {
                const int n = M - m0 < ROWSK_MAX ? (int)(M - m0) : ROWSK_MAX;
                kf[n - 1](w, (const uint8_t *)x_q + (size_t)m0 * x_stride, x_stride, K / FITM_QK_K,
                          y + m0 * y_stride + r, y_stride);
            }
            for (int64_t m = 0; !kf && m < M; m++)
                y[m * y_stride + r] =
                    fitm_quant_dot_simd(t, w, (const uint8_t *)x_q + (size_t)m * x_stride, K);
        }
        return;
    }
    float xs[ROWS_XS_MAX];
    for (int64_t m = 0; m < M; m++) {
        const fitm_block_q8_0 *x = (const fitm_block_q8_0 *)((const uint8_t *)x_q + (size_t)m * x_stride);
        for (int64_t i = 0; i < nb; i++)
            xs[m * nb + i] = fp16(x[i].d);
    }
    for (int64_t r = 0; r < n_rows; r++, w += row_bytes) {
        const uintptr_t pf = (uintptr_t)w + MATVEC_PREFETCH; /* as fitm_quant_matvec_simd */
        for (size_t o = 0; o < row_bytes; o += 64)
            _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_MAX) {
            const int n = M - m0 < ROWS_MAX ? (int)(M - m0) : ROWS_MAX;
            fn[n - 1](w, (const uint8_t *)x_q + (size_t)m0 * x_stride, x_stride, nb, xs + m0 * nb,
                      y + m0 * y_stride + r, y_stride);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * Dequantization: 32 signed byte values -> 32 floats q * d (- o), in the scalar order. */

/* y[0..16) = q[0..16) * d_lo, y[16..32) = q[16..32) * d_hi. */
static inline void store_mul2(__m256i q, float d_lo, float d_hi, float *y)
{
    const __m256 vlo = _mm256_set1_ps(d_lo), vhi = _mm256_set1_ps(d_hi);
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vlo));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vlo));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vhi));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vhi));
}

static inline void store_mul(__m256i q, float d, float *y)
{
    store_mul2(q, d, d, y);
}

static inline void store_mul_sub(__m256i q, float d, float o, float *y)
{
    const __m256 vd = _mm256_set1_ps(d), vo = _mm256_set1_ps(o);
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; k++) {
        __m256 v = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])));
        _mm256_storeu_ps(y + 8 * k, _mm256_sub_ps(v, vo));
    }
}

void fitm_quant_dequant_row_simd(fitm_dtype t, const void *src, float *dst, int64_t n)
{
    switch (t) {
    case FITM_DTYPE_F16: {
        const uint16_t *s = src;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, load_f16x8(s + i));
        for (; i < n; i++)
            dst[i] = fp16(s[i]);
        return;
    }
    case FITM_DTYPE_BF16: {
        const uint16_t *s = src;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, load_bf16x8(s + i));
        for (; i < n; i++)
            dst[i] = bf16(s[i]);
        return;
    }
    case FITM_DTYPE_Q8_0: {
        const fitm_block_q8_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++)
            store_mul(loadu256(b[i].qs), fp16(b[i].d), dst + i * FITM_QK);
        return;
    }
    case FITM_DTYPE_Q4_0: {
        const fitm_block_q4_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++)
            store_mul(_mm256_sub_epi8(nibbles32(b[i].qs), _mm256_set1_epi8(8)), fp16(b[i].d),
                      dst + i * FITM_QK);
        return;
    }
    case FITM_DTYPE_Q5_0: {
        const fitm_block_q5_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++)
            store_mul(q5_0_values(&b[i]), fp16(b[i].d), dst + i * FITM_QK);
        return;
    }
    case FITM_DTYPE_Q4_K:
    case FITM_DTYPE_Q5_K: {
        const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        const int is5 = t == FITM_DTYPE_Q5_K;
        const size_t bytes = is5 ? sizeof(fitm_block_q5_k) : sizeof(fitm_block_q4_k);
        for (int64_t i = 0; i < n / FITM_QK_K; i++) {
            const uint8_t *blk = (const uint8_t *)src + (size_t)i * bytes;
            /* d, dmin and scales sit at the same offsets in both layouts */
            const fitm_block_q4_k *b4 = (const fitm_block_q4_k *)blk;
            const uint8_t *qs = is5 ? ((const fitm_block_q5_k *)blk)->qs : b4->qs;
            __m256i h = is5 ? loadu256(((const fitm_block_q5_k *)blk)->qh) : _mm256_setzero_si256();
            const float d = fp16(b4->d), dmin = fp16(b4->dmin);
            float *y = dst + i * FITM_QK_K;
            for (int g = 0; g < 4; g++) {
                uint8_t sc0, m0, sc1, m1;
                fitm_quant_k_scale_min(b4->scales, 2 * g, &sc0, &m0);
                fitm_quant_k_scale_min(b4->scales, 2 * g + 1, &sc1, &m1);
                __m256i q = loadu256(qs + 32 * g);
                __m256i lo = _mm256_and_si256(q, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                if (is5) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                    hi = _mm256_or_si256(
                        hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                    h = _mm256_srli_epi16(h, 2);
                }
                store_mul_sub(lo, d * sc0, dmin * m0, y + 64 * g);
                store_mul_sub(hi, d * sc1, dmin * m1, y + 64 * g + 32);
            }
        }
        return;
    }
    case FITM_DTYPE_Q6_K: {
        const fitm_block_q6_k *b = src;
        const __m256i off = _mm256_set1_epi8(32);
        for (int64_t i = 0; i < n / FITM_QK_K; i++) {
            const float d = fp16(b[i].d);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6_k_half(b[i].ql + 64 * h, b[i].qh + 32 * h, q);
                for (int k = 0; k < 4; k++) {
                    float *y = dst + i * FITM_QK_K + 128 * h + 32 * k;
                    const int s = 8 * h + 2 * k;
                    store_mul2(_mm256_sub_epi8(q[k], off), d * (float)b[i].scales[s],
                               d * (float)b[i].scales[s + 1], y);
                }
            }
        }
        return;
    }
    default:
        fitm_quant_dequant_row_scalar(t, src, dst, n);
        return;
    }
}

/* ---------------------------------------------------------------------------------------
 * Activation quantization (Q8_0, Q8_K): the scalar quantizer's exact operations, so the bytes
 * are identical: d = amax / 127, id = 1/d (0 when d is 0), q = clamp(rint(x * id), -127, 127)
 * with the clamp taking NaN to -127 as fmaxf/fminf do there. */

static inline float absmax_vec(const float *x, int n)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) /* NaN lanes keep the running max (second operand) */
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 32 values -> 32 int8 of clamp(rint(x * id)). */
static inline __m256i quant32(const float *x, float id)
{
    const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi); /* max(NaN, lo) = lo */
        q[k] = _mm256_cvtps_epi32(v);
    }
    /* packs work per 128-bit lane: order 0-3 8-11 4-7 12-15 | ... ; fix with a permute */
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_packs_epi16(p01, p23);
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void fitm_quant_quant_row_simd(fitm_dtype t, const float *src, void *dst, int64_t n)
{
    if (t == FITM_DTYPE_Q8_0) {
        fitm_block_q8_0 *b = dst;
        for (int64_t i = 0; i < n / FITM_QK; i++, src += FITM_QK) {
            const float d = absmax_vec(src, FITM_QK) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = fitm_fp32_to_fp16(d);
            _mm256_storeu_si256((__m256i *)b[i].qs, quant32(src, id));
        }
        return;
    }
    if (t == FITM_DTYPE_Q8_K) {
        fitm_block_q8_k *b = dst;
        for (int64_t i = 0; i < n / FITM_QK_K; i++, src += FITM_QK_K) {
            const float d = absmax_vec(src, FITM_QK_K) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = d;
            for (int k = 0; k < FITM_QK_K / 32; k++) {
                __m256i q = quant32(src + 32 * k, id);
                _mm256_storeu_si256((__m256i *)(b[i].qs + 32 * k), q);
                /* two bsums: the int8 sums of each 16-byte half */
                __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                                              _mm256_set1_epi16(1)); /* 8 sums of 4 */
                __m256i hs = _mm256_hadd_epi32(s, s);  /* lanes: s0+s1, s2+s3 | s4+s5, s6+s7 */
                hs = _mm256_hadd_epi32(hs, hs);        /* lane 0: sum of low half, lane 4: high */
                b[i].bsums[2 * k] = (int16_t)_mm256_extract_epi32(hs, 0);
                b[i].bsums[2 * k + 1] = (int16_t)_mm256_extract_epi32(hs, 4);
            }
        }
        return;
    }
    fitm_quant_quant_row_scalar(t, src, dst, n);
}
