/* quant_scalar: the portable kernels of every weight format: fp16/bf16 conversions and, per
 * format, the scalar dequantizer, quantizer and dot product (quant_internal.h's *_scalar).
 * The reference the vectorised paths (quant_x86.c) are tested against and fall back to; calls
 * nothing else of quant. Block layouts: see quant_internal.h. */
#include "compute/quant.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#include "compute/quant_internal.h"
/* ---------------------------------------------------------------------------------------
 * fp16 / bf16 */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t fitm_fp32_to_fp16(float f)
{
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet it, keep the top of the payload */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 (halfway above the largest half) or inf: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal half: rebias the exponent by -112, round at bit 13 */
        a += 0xc8000fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    /* Subnormal half (k * 2^-24) or zero. Value = m * 2^(e - 150) with the implicit bit. */
    uint32_t e = a >> 23;
    if (e < 102) /* below 2^-25: rounds to zero */
        return (uint16_t)sign;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t k = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (k & 1u)))
        k++; /* may carry into the smallest normal, which is the right encoding */
    return (uint16_t)(sign | k);
}

float fitm_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) /* inf, or NaN (quieted, as the F16C instruction does) */
        return bits_f32(sign | 0x7f800000u | (m ? 0x400000u : 0u) | (m << 13));
    if (e == 0) {
        if (m == 0)
            return bits_f32(sign);
        /* subnormal: normalise m so its leading one becomes the implicit bit */
        uint32_t exp = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            exp--;
        }
        return bits_f32(sign | (exp << 23) | ((m & 0x3ffu) << 13));
    }
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t fitm_fp32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float fitm_bf16_to_fp32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

#define FP16(h) fitm_fp16_to_fp32(h)

#ifndef NDEBUG /* the asserts' */
static inline int64_t block_elems(fitm_dtype t)
{
    const fitm_dtype_info *info = fitm_dtype_info_of((int)t);
    assert(info);
    return info->block_elems;
}
#endif

/* ---------------------------------------------------------------------------------------
 * Dequantization (scalar reference; the order of float operations is the format's) */

static void dequant_q4_k_block(const fitm_block_q4_k *b, float *y)
{
    const float d = FP16(b->d), dmin = FP16(b->dmin);
    for (int g = 0; g < 4; g++) { /* 32-byte group g: sub-blocks 2g (low), 2g+1 (high) */
        uint8_t sc0, m0, sc1, m1;
        fitm_quant_k_scale_min(b->scales, 2 * g, &sc0, &m0);
        fitm_quant_k_scale_min(b->scales, 2 * g + 1, &sc1, &m1);
        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
        const uint8_t *q = b->qs + 32 * g;
        for (int l = 0; l < 32; l++) {
            y[64 * g + l] = d0 * (float)(q[l] & 0xF) - o0;
            y[64 * g + 32 + l] = d1 * (float)(q[l] >> 4) - o1;
        }
    }
}

static void dequant_q5_k_block(const fitm_block_q5_k *b, float *y)
{
    const float d = FP16(b->d), dmin = FP16(b->dmin);
    for (int g = 0; g < 4; g++) {
        uint8_t sc0, m0, sc1, m1;
        fitm_quant_k_scale_min(b->scales, 2 * g, &sc0, &m0);
        fitm_quant_k_scale_min(b->scales, 2 * g + 1, &sc1, &m1);
        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
        const uint8_t *q = b->qs + 32 * g;
        for (int l = 0; l < 32; l++) {
            int h0 = (b->qh[l] >> (2 * g)) & 1, h1 = (b->qh[l] >> (2 * g + 1)) & 1;
            y[64 * g + l] = d0 * (float)((q[l] & 0xF) | (h0 << 4)) - o0;
            y[64 * g + 32 + l] = d1 * (float)((q[l] >> 4) | (h1 << 4)) - o1;
        }
    }
}

/* The 6-bit value of Q6_K element i (0..255), 0..63 (the stored value minus 32 is q). */
static inline int q6_k_get(const fitm_block_q6_k *b, int i)
{
    int h = i >> 7, k = (i >> 5) & 3, l = i & 31;
    const uint8_t *ql = b->ql + 64 * h + ((k & 1) ? 32 : 0);
    int lo = (k & 2) ? (ql[l] >> 4) : (ql[l] & 0xF);
    int hi = (b->qh[32 * h + l] >> (2 * k)) & 3;
    return lo | (hi << 4);
}

static void dequant_q6_k_block(const fitm_block_q6_k *b, float *y)
{
    const float d = FP16(b->d);
    for (int i = 0; i < FITM_QK_K; i++) /* scale index = 16-element group index */
        y[i] = (d * (float)b->scales[i >> 4]) * (float)(q6_k_get(b, i) - 32);
}

void fitm_quant_dequant_row_scalar(fitm_dtype t, const void *src, float *dst, int64_t n)
{
    assert(n % block_elems(t) == 0);
    switch (t) {
    case FITM_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case FITM_DTYPE_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fitm_fp16_to_fp32(s[i]);
        return;
    }
    case FITM_DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fitm_bf16_to_fp32(s[i]);
        return;
    }
    case FITM_DTYPE_Q4_0: {
        const fitm_block_q4_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++, dst += FITM_QK) {
            const float d = FP16(b[i].d);
            for (int j = 0; j < 16; j++) {
                dst[j] = (float)((b[i].qs[j] & 0xF) - 8) * d;
                dst[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
            }
        }
        return;
    }
    case FITM_DTYPE_Q5_0: {
        const fitm_block_q5_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++, dst += FITM_QK) {
            const float d = FP16(b[i].d);
            uint32_t qh;
            memcpy(&qh, b[i].qh, 4);
            for (int j = 0; j < 16; j++) {
                int x0 = (int)((b[i].qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
                int x1 = (int)((b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
                dst[j] = (float)x0 * d;
                dst[j + 16] = (float)x1 * d;
            }
        }
        return;
    }
    case FITM_DTYPE_Q8_0: {
        const fitm_block_q8_0 *b = src;
        for (int64_t i = 0; i < n / FITM_QK; i++, dst += FITM_QK) {
            const float d = FP16(b[i].d);
            for (int j = 0; j < FITM_QK; j++)
                dst[j] = (float)b[i].qs[j] * d;
        }
        return;
    }
    case FITM_DTYPE_Q4_K: {
        const fitm_block_q4_k *b = src;
        for (int64_t i = 0; i < n / FITM_QK_K; i++)
            dequant_q4_k_block(&b[i], dst + i * FITM_QK_K);
        return;
    }
    case FITM_DTYPE_Q5_K: {
        const fitm_block_q5_k *b = src;
        for (int64_t i = 0; i < n / FITM_QK_K; i++)
            dequant_q5_k_block(&b[i], dst + i * FITM_QK_K);
        return;
    }
    case FITM_DTYPE_Q6_K: {
        const fitm_block_q6_k *b = src;
        for (int64_t i = 0; i < n / FITM_QK_K; i++)
            dequant_q6_k_block(&b[i], dst + i * FITM_QK_K);
        return;
    }
    case FITM_DTYPE_Q8_K: {
        const fitm_block_q8_k *b = src;
        for (int64_t i = 0; i < n / FITM_QK_K; i++, dst += FITM_QK_K)
            for (int j = 0; j < FITM_QK_K; j++)
                dst[j] = (float)b[i].qs[j] * b[i].d;
        return;
    }
    default:
        assert(!"fitm_dequant_row: unsupported type");
    }
}

/* ---------------------------------------------------------------------------------------
 * Quantization. Round to nearest, ties to even (rintf in the default rounding mode). Clamps
 * are applied in float before the int conversion, so NaN input cannot reach an int cast. */

static inline int rint_clamp(float v, float lo, float hi)
{
    return (int)fminf(fmaxf(rintf(v), lo), hi);
}

static inline float inv_or_zero(float d)
{
    return d != 0.0f ? 1.0f / d : 0.0f;
}

/* Value of largest magnitude in x[0..n) with its sign (the first one on ties). */
static float absmax_signed(const float *x, int n)
{
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            m = x[i];
        }
    return m;
}

static float absmax(const float *x, int n)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

static void quant_q8_0(const float *x, fitm_block_q8_0 *b, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK) {
        const float d = absmax(x, FITM_QK) / 127.0f, id = inv_or_zero(d);
        b[i].d = fitm_fp32_to_fp16(d);
        for (int j = 0; j < FITM_QK; j++)
            b[i].qs[j] = (int8_t)rint_clamp(x[j] * id, -127.0f, 127.0f);
    }
}

static void quant_q8_k(const float *x, fitm_block_q8_k *b, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK_K) {
        const float d = absmax(x, FITM_QK_K) / 127.0f, id = inv_or_zero(d);
        b[i].d = d;
        for (int g = 0; g < FITM_QK_K / 16; g++) {
            int sum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) {
                b[i].qs[j] = (int8_t)rint_clamp(x[j] * id, -127.0f, 127.0f);
                sum += b[i].qs[j];
            }
            b[i].bsums[g] = (int16_t)sum;
        }
    }
}

/* Q4_0 (half = 8) and Q5_0 (half = 16): the value of largest magnitude maps to -half. */
static void quant_q4_0_q5_0(const float *x, void *dst, int64_t nb, int half)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK) {
        const float d = absmax_signed(x, FITM_QK) / (float)-half, id = inv_or_zero(d);
        uint8_t q[FITM_QK];
        for (int j = 0; j < FITM_QK; j++)
            q[j] = (uint8_t)(rint_clamp(x[j] * id, (float)-half, (float)(half - 1)) + half);
        uint8_t *qs;
        if (half == 8) {
            fitm_block_q4_0 *b = (fitm_block_q4_0 *)dst + i;
            b->d = fitm_fp32_to_fp16(d);
            qs = b->qs;
        } else {
            fitm_block_q5_0 *b = (fitm_block_q5_0 *)dst + i;
            b->d = fitm_fp32_to_fp16(d);
            uint32_t qh = 0;
            for (int j = 0; j < FITM_QK; j++)
                qh |= (uint32_t)(q[j] >> 4) << j;
            memcpy(b->qh, &qh, 4);
            qs = b->qs;
        }
        for (int j = 0; j < 16; j++)
            qs[j] = (uint8_t)((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    }
}

/* Fits x[0..n) ≈ s * q - o with q in 0..nmax, s >= 0, o >= 0 (the formats can only subtract
 * a min). Candidate scales around (max - min) / nmax; for each, assign q by rounding and refit
 * (s, o) by least squares given q; keep the pair with the smallest squared error. */
static void fit_asymmetric(const float *x, int n, int nmax, float *s_out, float *o_out)
{
    float lo = 0.0f, hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    *s_out = 0.0f;
    *o_out = -lo;
    if (!(hi > lo))
        return;
    float best_err = INFINITY;
    for (int step = -4; step <= 12; step++) {
        const float s0 = (hi - lo) / ((float)nmax + 0.1f * (float)step);
        const float is0 = 1.0f / s0;
        double sq = 0, sqq = 0, sx = 0, sqx = 0;
        for (int i = 0; i < n; i++) {
            int q = rint_clamp((x[i] - lo) * is0, 0.0f, (float)nmax);
            sq += q;
            sqq += (double)q * q;
            sx += x[i];
            sqx += (double)q * x[i];
        }
        /* least squares for x ≈ s q + b; b = -o must be <= 0, and when every q is equal
         * (det = 0: a constant sub-block) only s is fitted */
        double det = n * sqq - sq * sq, s = 0, b = 1;
        if (det > 0) {
            s = (n * sqx - sq * sx) / det;
            b = (sqq * sx - sq * sqx) / det;
        }
        if (b > 0) {
            if (sqq == 0)
                continue;
            b = 0;
            s = sqx / sqq;
        }
        if (!(s > 0))
            continue;
        double err = 0;
        for (int i = 0; i < n; i++) {
            int q = rint_clamp((float)((x[i] - b) / s), 0.0f, (float)nmax);
            double e = s * q + b - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = (float)err;
            *s_out = (float)s;
            *o_out = (float)-b;
        }
    }
}

/* Packs 8 scales and 8 mins (each 0..63) into the 12 bytes of Q4_K/Q5_K. */
static void pack_k_scales(const uint8_t sc[8], const uint8_t m[8], uint8_t s12[12])
{
    for (int j = 0; j < 4; j++) {
        s12[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        s12[j + 4] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
        s12[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
}

/* Q4_K (nmax 15) / Q5_K (nmax 31): per sub-block fit, then 6-bit scales and mins relative to
 * the fp16 super-block d and dmin, then the final q against the stored (rounded) scales. */
static void quant_k_asym(const float *x, uint8_t *scales12, uint16_t *d_out, uint16_t *dmin_out,
                         uint8_t q[FITM_QK_K], int nmax)
{
    float s[8], o[8], smax = 0.0f, omax = 0.0f;
    for (int j = 0; j < 8; j++) {
        fit_asymmetric(x + 32 * j, 32, nmax, &s[j], &o[j]);
        smax = fmaxf(smax, s[j]);
        omax = fmaxf(omax, o[j]);
    }
    *d_out = fitm_fp32_to_fp16(smax / 63.0f);
    *dmin_out = fitm_fp32_to_fp16(omax / 63.0f);
    const float d = FP16(*d_out), dmin = FP16(*dmin_out);
    const float id = inv_or_zero(d), idmin = inv_or_zero(dmin);
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = (uint8_t)rint_clamp(s[j] * id, 0.0f, 63.0f);
        m[j] = (uint8_t)rint_clamp(o[j] * idmin, 0.0f, 63.0f);
        const float ds = d * sc[j], om = dmin * m[j], ids = inv_or_zero(ds);
        for (int l = 0; l < 32; l++)
            q[32 * j + l] = (uint8_t)rint_clamp((x[32 * j + l] + om) * ids, 0.0f, (float)nmax);
    }
    pack_k_scales(sc, m, scales12);
}

static void quant_q4_k(const float *x, fitm_block_q4_k *b, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK_K) {
        uint8_t q[FITM_QK_K];
        quant_k_asym(x, b[i].scales, &b[i].d, &b[i].dmin, q, 15);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * g + l] = (uint8_t)(q[64 * g + l] | (q[64 * g + 32 + l] << 4));
    }
}

static void quant_q5_k(const float *x, fitm_block_q5_k *b, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK_K) {
        uint8_t q[FITM_QK_K];
        quant_k_asym(x, b[i].scales, &b[i].d, &b[i].dmin, q, 31);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                int q0 = q[64 * g + l], q1 = q[64 * g + 32 + l];
                b[i].qs[32 * g + l] = (uint8_t)((q0 & 0xF) | ((q1 & 0xF) << 4));
                b[i].qh[l] |= (uint8_t)(((q0 >> 4) << (2 * g)) | ((q1 >> 4) << (2 * g + 1)));
            }
    }
}

/* Symmetric fit of a 16-element group for Q6_K (q in -32..31): candidates put the value of
 * largest magnitude at -32 or slightly inside, each refit by least squares. Returns the
 * scale with its sign (negative when the largest-magnitude value is positive). */
static float fit_symmetric_q6(const float *x)
{
    const float m = absmax_signed(x, 16);
    if (m == 0.0f)
        return 0.0f;
    float best = m / -32.0f;
    double best_err = INFINITY;
    for (int step = 0; step <= 10; step++) {
        const float s0 = m / -(32.0f - 0.25f * (float)step), is0 = 1.0f / s0;
        double sqq = 0, sqx = 0;
        for (int i = 0; i < 16; i++) {
            int q = rint_clamp(x[i] * is0, -32.0f, 31.0f);
            sqq += (double)q * q;
            sqx += (double)q * x[i];
        }
        if (sqq == 0)
            continue;
        const float s = (float)(sqx / sqq), is = inv_or_zero(s);
        double err = 0;
        for (int i = 0; i < 16; i++) {
            double e = (double)s * rint_clamp(x[i] * is, -32.0f, 31.0f) - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = err;
            best = s;
        }
    }
    return best;
}

static void quant_q6_k(const float *x, fitm_block_q6_k *b, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += FITM_QK_K) {
        float s[16], smax = 0.0f;
        for (int g = 0; g < 16; g++) {
            s[g] = fit_symmetric_q6(x + 16 * g);
            smax = fmaxf(smax, fabsf(s[g]));
        }
        b[i].d = fitm_fp32_to_fp16(smax / 127.0f);
        const float d = FP16(b[i].d), id = inv_or_zero(d);
        uint8_t q[FITM_QK_K];
        for (int g = 0; g < 16; g++) {
            b[i].scales[g] = (int8_t)rint_clamp(s[g] * id, -127.0f, 127.0f);
            const float ids = inv_or_zero(d * (float)b[i].scales[g]);
            for (int l = 0; l < 16; l++)
                q[16 * g + l] = (uint8_t)(rint_clamp(x[16 * g + l] * ids, -32.0f, 31.0f) + 32);
        }
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int v = q[128 * h + 32 * k + l];
                    uint8_t *ql = b[i].ql + 64 * h + ((k & 1) ? 32 : 0) + l;
                    if (k & 2)
                        *ql = (uint8_t)(*ql | ((v & 0xF) << 4));
                    else
                        *ql = (uint8_t)(v & 0xF);
                    b[i].qh[32 * h + l] |= (uint8_t)((v >> 4) << (2 * k));
                }
    }
}

void fitm_quant_quant_row_scalar(fitm_dtype t, const float *src, void *dst, int64_t n)
{
    assert(n % block_elems(t) == 0);
    switch (t) {
    case FITM_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case FITM_DTYPE_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = fitm_fp32_to_fp16(src[i]);
        return;
    }
    case FITM_DTYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = fitm_fp32_to_bf16(src[i]);
        return;
    }
    case FITM_DTYPE_Q4_0:
        quant_q4_0_q5_0(src, dst, n / FITM_QK, 8);
        return;
    case FITM_DTYPE_Q5_0:
        quant_q4_0_q5_0(src, dst, n / FITM_QK, 16);
        return;
    case FITM_DTYPE_Q8_0:
        quant_q8_0(src, dst, n / FITM_QK);
        return;
    case FITM_DTYPE_Q4_K:
        quant_q4_k(src, dst, n / FITM_QK_K);
        return;
    case FITM_DTYPE_Q5_K:
        quant_q5_k(src, dst, n / FITM_QK_K);
        return;
    case FITM_DTYPE_Q6_K:
        quant_q6_k(src, dst, n / FITM_QK_K);
        return;
    case FITM_DTYPE_Q8_K:
        quant_q8_k(src, dst, n / FITM_QK_K);
        return;
    default:
        assert(!"fitm_quant_row: unsupported type");
    }
}

/* ---------------------------------------------------------------------------------------
 * Scalar dot products. Integer sums inside a block, float across blocks. */

static float dot_q8_0_family(fitm_dtype t, const void *w, const fitm_block_q8_0 *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int q[FITM_QK];
        uint16_t dw;
        if (t == FITM_DTYPE_Q8_0) {
            const fitm_block_q8_0 *b = (const fitm_block_q8_0 *)w + i;
            dw = b->d;
            for (int j = 0; j < FITM_QK; j++)
                q[j] = b->qs[j];
        } else if (t == FITM_DTYPE_Q4_0) {
            const fitm_block_q4_0 *b = (const fitm_block_q4_0 *)w + i;
            dw = b->d;
            for (int j = 0; j < 16; j++) {
                q[j] = (b->qs[j] & 0xF) - 8;
                q[j + 16] = (b->qs[j] >> 4) - 8;
            }
        } else {
            const fitm_block_q5_0 *b = (const fitm_block_q5_0 *)w + i;
            dw = b->d;
            uint32_t qh;
            memcpy(&qh, b->qh, 4);
            for (int j = 0; j < 16; j++) {
                q[j] = (int)((b->qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
                q[j + 16] = (int)((b->qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
            }
        }
        int sum = 0;
        for (int j = 0; j < FITM_QK; j++)
            sum += q[j] * x[i].qs[j];
        acc += (FP16(dw) * FP16(x[i].d)) * (float)sum;
    }
    return acc;
}

static float dot_q4_k(const fitm_block_q4_k *w, const fitm_block_q8_k *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            fitm_quant_k_scale_min(w[i].scales, j, &sc, &m);
            const uint8_t *qs = w[i].qs + 32 * (j >> 1);
            const int8_t *q8 = x[i].qs + 32 * j;
            int s = 0;
            for (int l = 0; l < 32; l++)
                s += ((j & 1) ? (qs[l] >> 4) : (qs[l] & 0xF)) * q8[l];
            isum += sc * s;
            msum += m * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
        }
        acc += FP16(w[i].d) * x[i].d * (float)isum - FP16(w[i].dmin) * x[i].d * (float)msum;
    }
    return acc;
}

static float dot_q5_k(const fitm_block_q5_k *w, const fitm_block_q8_k *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            fitm_quant_k_scale_min(w[i].scales, j, &sc, &m);
            const uint8_t *qs = w[i].qs + 32 * (j >> 1);
            const int8_t *q8 = x[i].qs + 32 * j;
            int s = 0;
            for (int l = 0; l < 32; l++) {
                int lo = (j & 1) ? (qs[l] >> 4) : (qs[l] & 0xF);
                s += (lo | (((w[i].qh[l] >> j) & 1) << 4)) * q8[l];
            }
            isum += sc * s;
            msum += m * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
        }
        acc += FP16(w[i].d) * x[i].d * (float)isum - FP16(w[i].dmin) * x[i].d * (float)msum;
    }
    return acc;
}

static float dot_q6_k(const fitm_block_q6_k *w, const fitm_block_q8_k *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int isum = 0;
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 16 * g; l < 16 * g + 16; l++)
                s += (q6_k_get(&w[i], l) - 32) * x[i].qs[l];
            isum += w[i].scales[g] * s;
        }
        acc += FP16(w[i].d) * x[i].d * (float)isum;
    }
    return acc;
}

float fitm_quant_dot_scalar(fitm_dtype t, const void *w_row, const void *x_q, int64_t n)
{
    assert(n % block_elems(t) == 0);
    switch (t) {
    case FITM_DTYPE_F32:
    case FITM_DTYPE_F16:
    case FITM_DTYPE_BF16: {
        const float *x = x_q;
        float acc = 0.0f;
        for (int64_t i0 = 0; i0 < n; i0 += 64) { /* partial sums keep rounding error small */
            float part = 0.0f;
            for (int64_t i = i0; i < n && i < i0 + 64; i++) {
                float w = t == FITM_DTYPE_F32   ? ((const float *)w_row)[i]
                          : t == FITM_DTYPE_F16 ? fitm_fp16_to_fp32(((const uint16_t *)w_row)[i])
                                                : fitm_bf16_to_fp32(((const uint16_t *)w_row)[i]);
                part += w * x[i];
            }
            acc += part;
        }
        return acc;
    }
    case FITM_DTYPE_Q4_0:
    case FITM_DTYPE_Q5_0:
    case FITM_DTYPE_Q8_0:
        return dot_q8_0_family(t, w_row, x_q, n / FITM_QK);
    case FITM_DTYPE_Q4_K:
        return dot_q4_k(w_row, x_q, n / FITM_QK_K);
    case FITM_DTYPE_Q5_K:
        return dot_q5_k(w_row, x_q, n / FITM_QK_K);
    case FITM_DTYPE_Q6_K:
        return dot_q6_k(w_row, x_q, n / FITM_QK_K);
    default:
        assert(!"fitm_quant_dot: unsupported type");
        return 0.0f;
    }
}

/* ---------------------------------------------------------------------------------------
 * Packed weights (layouts: quant_internal.h) */

/* Row r's block scale and unsigned value of element 4k + i in a chunk. */
static uint16_t chunk_d(const void *c, int r)
{
    return ((const uint16_t *)c)[r]; /* d[16] leads both chunk types */
}

static int chunk_u(fitm_dtype t, const void *c, int r, int k, int i)
{
    const int byte = 4 * r + i;
    if (t == FITM_DTYPE_Q8_0)
        return ((const fitm_chunk_q8_0x16 *)c)->q[k][byte];
    const fitm_chunk_q5_0x16 *q = c;
    const int nib = (q->nib[k / 2][byte] >> (k % 2 ? 4 : 0)) & 0xF;
    return nib | (int)(((q->hi[k] >> byte) & 1u) << 4);
}

/* Q4_K rows into Q4_Kx16 chunks: row r's stored bytes, scales and mins moved to its lanes. */
static void pack_q4_k(const fitm_block_q4_k *W, int64_t N, int64_t nb, fitm_chunk_q4_kx16 *out)
{
    for (int64_t g = 0; g < N / FITM_PACK_ROWS; g++)
        for (int64_t b = 0; b < nb; b++, out++) {
            memset(out, 0, sizeof *out);
            for (int r = 0; r < FITM_PACK_ROWS; r++) {
                const fitm_block_q4_k *w = &W[(g * FITM_PACK_ROWS + r) * nb + b];
                out->d[r] = w->d;
                out->dmin[r] = w->dmin;
                for (int j = 0; j < 8; j++)
                    fitm_quant_k_scale_min(w->scales, j, &out->sc[j][r],
                                           &out->m[j / 2][2 * r + j % 2]);
                for (int p = 0; p < 4; p++)
                    for (int k = 0; k < 8; k++)
                        memcpy(out->nib[p][k] + 4 * r, w->qs + 32 * p + 4 * k, 4);
            }
        }
}

/* Q6_K rows into Q6_Kx16 chunks. */
static void pack_q6_k(const fitm_block_q6_k *W, int64_t N, int64_t nb, fitm_chunk_q6_kx16 *out)
{
    for (int64_t g = 0; g < N / FITM_PACK_ROWS; g++)
        for (int64_t b = 0; b < nb; b++, out++) {
            memset(out, 0, sizeof *out);
            for (int r = 0; r < FITM_PACK_ROWS; r++) {
                const fitm_block_q6_k *w = &W[(g * FITM_PACK_ROWS + r) * nb + b];
                out->d[r] = w->d;
                for (int j = 0; j < 16; j++)
                    out->sc[j / 2][2 * r + j % 2] = w->scales[j];
                for (int e = 0; e < FITM_QK_K; e++) {
                    const int u = q6_k_get(w, e), k = e / 4, byte = 4 * r + e % 4;
                    out->nib[k / 2][byte] |= (uint8_t)((u & 0xF) << (4 * (k % 2)));
                    out->hi[k / 4][byte] |= (uint8_t)((u >> 4) << (2 * (k % 4)));
                }
            }
        }
}

/* Row r's unsigned 6-bit value of element e in a Q6_Kx16 chunk. */
static int chunk_q6_k_u(const fitm_chunk_q6_kx16 *c, int r, int e)
{
    const int k = e / 4, byte = 4 * r + e % 4;
    return ((c->nib[k / 2][byte] >> (4 * (k % 2))) & 0xF) |
           ((c->hi[k / 4][byte] >> (2 * (k % 4))) & 3) << 4;
}

void fitm_quant_pack_scalar(fitm_dtype t, const void *W, int64_t N, int64_t K, void *P)
{
    assert(N % FITM_PACK_ROWS == 0 && K % fitm_chunk_elems(t) == 0);
    if (t == FITM_DTYPE_Q4_K) {
        pack_q4_k(W, N, K / FITM_QK_K, P);
        return;
    }
    if (t == FITM_DTYPE_Q6_K) {
        pack_q6_k(W, N, K / FITM_QK_K, P);
        return;
    }
    assert(t == FITM_DTYPE_Q8_0 || t == FITM_DTYPE_Q5_0);
    const int64_t nb = K / FITM_QK;
    const size_t rb = fitm_dtype_row_bytes(t, K), bb = rb / (size_t)nb, cb = fitm_chunk_bytes(t);
    uint8_t *out = P;
    for (int64_t g = 0; g < N / FITM_PACK_ROWS; g++) {
        for (int64_t b = 0; b < nb; b++, out += cb) {
            memset(out, 0, cb);
            for (int r = 0; r < FITM_PACK_ROWS; r++) {
                const uint8_t *blk = (const uint8_t *)W + (size_t)(g * FITM_PACK_ROWS + r) * rb +
                                     (size_t)b * bb;
                uint16_t d;
                memcpy(&d, blk, 2); /* d leads both block types */
                ((uint16_t *)out)[r] = d;
                /* four elements (one dword of the stored values) at a time: elements 4k..4k+3
                 * go to bytes 4r..4r+3 of V_k */
                if (t == FITM_DTYPE_Q8_0) {
                    fitm_chunk_q8_0x16 *q = (fitm_chunk_q8_0x16 *)out;
                    for (int k = 0; k < 8; k++) {
                        uint32_t v;
                        memcpy(&v, ((const fitm_block_q8_0 *)blk)->qs + 4 * k, 4);
                        v ^= 0x80808080u; /* + 128 in each byte */
                        memcpy(q->q[k] + 4 * r, &v, 4);
                    }
                } else {
                    const fitm_block_q5_0 *w = (const fitm_block_q5_0 *)blk;
                    fitm_chunk_q5_0x16 *q = (fitm_chunk_q5_0x16 *)out;
                    uint32_t qh, lo[8];
                    memcpy(&qh, w->qh, 4);
                    for (int k = 0; k < 4; k++) { /* elements 0-15 low nibbles, 16-31 high */
                        uint32_t v;
                        memcpy(&v, w->qs + 4 * k, 4);
                        lo[k] = v & 0x0F0F0F0Fu;
                        lo[k + 4] = (v >> 4) & 0x0F0F0F0Fu;
                    }
                    for (int k = 0; k < 8; k += 2) {
                        const uint32_t v = lo[k] | lo[k + 1] << 4;
                        memcpy(q->nib[k / 2] + 4 * r, &v, 4);
                    }
                    for (int k = 0; k < 8; k++)
                        q->hi[k] |= (uint64_t)((qh >> (4 * k)) & 0xFu) << (4 * r);
                }
            }
        }
    }
}

/* Row r of one chunk as floats (fitm_chunk_elems(t) of them), the stored row's dequantizer's
 * values: (float)(u - off) * d, or fitm_quant_packed_block_k's for the K-quants. */
static void chunk_row(fitm_dtype t, const void *c, int r, float *y)
{
    if (t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q6_K) {
        fitm_quant_packed_block_k(t, c, r, y);
        return;
    }
    const float d = FP16(chunk_d(c, r));
    for (int j = 0; j < FITM_QK; j++)
        y[j] = (float)(chunk_u(t, c, r, j / 4, j % 4) - fitm_chunk_off(t)) * d;
}

/* The first chunk of row n's group. */
static const uint8_t *group_chunks(fitm_dtype t, const void *P, int64_t K, int64_t n)
{
    return (const uint8_t *)P +
           (size_t)((n / FITM_PACK_ROWS) * (K / fitm_chunk_elems(t))) * fitm_chunk_bytes(t);
}

void fitm_quant_packed_row_scalar(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst)
{
    const int64_t E = fitm_chunk_elems(t);
    const uint8_t *c = group_chunks(t, P, K, n);
    for (int64_t b = 0; b < K / E; b++, c += fitm_chunk_bytes(t), dst += E)
        chunk_row(t, c, (int)(n % FITM_PACK_ROWS), dst);
}

void fitm_quant_packed_cols_scalar(fitm_dtype t, const void *P, int64_t K, int64_t n, float *dst,
                                   int64_t ld)
{
    const int64_t E = fitm_chunk_elems(t);
    const uint8_t *c = group_chunks(t, P, K, n);
    float y[FITM_QK_K];
    for (int64_t b = 0; b < K / E; b++, c += fitm_chunk_bytes(t), dst += E * ld)
        for (int r = 0; r < FITM_PACK_ROWS; r++) {
            chunk_row(t, c, r, y);
            for (int64_t e = 0; e < E; e++)
                dst[e * ld + r] = y[e];
        }
}

/* The packed K-quant products: per super-block the exact integer sum isum (Q4_K: over its
 * sub-blocks of 32, sc * (values . activations); Q6_K: over its groups of 16, sc * ((u - 32) .
 * activations)), then acc = fma(isum, d * d_x, acc); Q4_K then also acc = fma(-msum, dmin *
 * d_x, acc), msum the sum of m * (the sub-block's activation sum). */
static float packed_k_block(fitm_dtype t, const void *chunk, int r, const fitm_block_q8_k *x,
                            float acc)
{
    if (t == FITM_DTYPE_Q6_K) {
        const fitm_chunk_q6_kx16 *c = chunk;
        int32_t isum = 0; /* exact: |isum| <= 16 * 128 * 16 * 32 * 128 */
        for (int j = 0; j < 16; j++) {
            int32_t s = 0;
            for (int e = 16 * j; e < 16 * j + 16; e++)
                s += (chunk_q6_k_u(c, r, e) - 32) * x->qs[e];
            isum += c->sc[j / 2][2 * r + j % 2] * s;
        }
        return fmaf((float)isum, FP16(c->d[r]) * x->d, acc);
    }
    const fitm_chunk_q4_kx16 *c = chunk;
    int32_t isum = 0, msum = 0; /* exact: |isum| <= 8 * 63 * 32 * 15 * 128 */
    for (int j = 0; j < 8; j++) {
        int32_t s = 0;
        for (int e = 0; e < 32; e++) {
            const uint8_t q = c->nib[j / 2][e / 4][4 * r + e % 4];
            s += ((j % 2) ? q >> 4 : q & 0xF) * x->qs[32 * j + e];
        }
        isum += c->sc[j][r] * s;
        msum += c->m[j / 2][2 * r + j % 2] * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
    }
    acc = fmaf((float)isum, FP16(c->d[r]) * x->d, acc);
    return fmaf((float)-msum, FP16(c->dmin[r]) * x->d, acc);
}

static void matvec_packed_k(fitm_dtype t, const uint8_t *P, int64_t K, const void *x_q,
                            size_t x_stride, int64_t M, float *y, int64_t y_stride,
                            int64_t n_groups)
{
    const int64_t nb = K / FITM_QK_K;
    const size_t cb = fitm_chunk_bytes(t);
    for (int64_t g = 0; g < n_groups; g++)
        for (int64_t m = 0; m < M; m++) {
            const fitm_block_q8_k *x =
                (const fitm_block_q8_k *)((const uint8_t *)x_q + (size_t)m * x_stride);
            for (int r = 0; r < FITM_PACK_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++)
                    acc = packed_k_block(t, P + (size_t)(g * nb + b) * cb, r, &x[b], acc);
                y[m * y_stride + g * FITM_PACK_ROWS + r] = acc;
            }
        }
}

void fitm_quant_matvec_packed_scalar(fitm_dtype t, const uint8_t *P, int64_t K, const void *x_q,
                                     size_t x_stride, int64_t M, float *y, int64_t y_stride,
                                     int64_t n_groups)
{
    if (t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q6_K) {
        matvec_packed_k(t, P, K, x_q, x_stride, M, y, y_stride, n_groups);
        return;
    }
    const int64_t nb = K / FITM_QK;
    const int off = fitm_chunk_off(t);
    const size_t cb = fitm_chunk_bytes(t);
    for (int64_t g = 0; g < n_groups; g++) {
        for (int64_t m = 0; m < M; m++) {
            const fitm_block_q8_0 *x =
                (const fitm_block_q8_0 *)((const uint8_t *)x_q + (size_t)m * x_stride);
            for (int r = 0; r < FITM_PACK_ROWS; r++) {
                const uint8_t *c = P + (size_t)(g * nb) * cb;
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++, c += cb) {
                    int32_t isum = 0; /* exact: |isum| <= 32 * 128 * 127 */
                    for (int j = 0; j < FITM_QK; j++)
                        isum += (chunk_u(t, c, r, j / 4, j % 4) - off) * x[b].qs[j];
                    acc = fmaf((float)isum, FP16(chunk_d(c, r)) * FP16(x[b].d), acc);
                }
                y[m * y_stride + g * FITM_PACK_ROWS + r] = acc;
            }
        }
    }
}
