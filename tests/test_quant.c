/* Unit test for quant.c / quant_x86.c:
 *  - fp16 and bf16 conversions: every one of the 65536 bit patterns each way against
 *    references written here from the format definitions (value from fields; nearest value by
 *    search over the sorted representable values), midpoints and random floats, inf/NaN;
 *    the F16C instructions where the CPU has them;
 *  - the vectorised paths (the one base/cpu.h picks, or FITM_CPU forces: tests/meson.build
 *    runs this once per path) against the scalar ones (dequantization bit-exact, dots within
 *    float rounding) on random blocks and odd lengths;
 *  - matvec == per-row dot and writes only its rows; matmul (dequantized tiles + BLAS)
 *    against matvec on the same activation values; matvec_rows (several activation rows)
 *    == per-row dot bit for bit, for every row count and writing only its rows; the K-quant
 *    products of the AVX2 and AVX-512 objects bit-identical where the CPU runs both;
 *  - packed Q8_0 / Q5_0 / Q4_K / Q6_K weights: rows read back equal the stored ones, the
 *    product equals the scalar reference bit for bit for every row count, the reference the
 *    dot's value;
 *  - quantizers on degenerate input (zeros, constants, tiny, huge, inf/NaN) write valid blocks.
 * Random data is seeded (FITM_TEST_SEED overrides) and never all zeros. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cpu.h"
#include "check.h"
#include "compute/quant.h"
#include "compute/quant_internal.h"

#if FITM_QUANT_X86
#include <immintrin.h>
/* The hardware's conversions, as references where the CPU has them (have_f16c). */
static bool have_f16c;
__attribute__((target("f16c"))) static uint16_t f16c_from_f32(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
__attribute__((target("f16c"))) static float f16c_to_f32(uint16_t h)
{
    return _cvtsh_ss(h);
}
#endif

static uint64_t rng_state;
static uint64_t rnd(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double unif(void) { return (double)(rnd() >> 11) * 0x1p-53; }
static float gauss(void)
{
    double u = unif() + 1e-300, v = unif();
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}

static uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---------------------------------------------------------------------------------------
 * Reference conversions, from the definitions. */

/* fp16 fields -> value, computed with ldexp (no bit tricks). NaN for NaN patterns. */
static double ref_half_value(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, -24);
    else
        v = ldexp((double)(1024 + m), e - 25);
    return s ? -v : v;
}

static double ref_bf16_value(uint16_t h)
{
    int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
    double v;
    if (e == 255)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, -133);
    else
        v = ldexp((double)(128 + m), e - 134);
    return s ? -v : v;
}

/* Nearest representable value by binary search over the positive finite patterns (whose
 * values increase with the pattern), ties to the even pattern; beyond the largest finite
 * value the next "value" is the one a wider exponent would give (overflow threshold). */
static uint16_t ref_round(double a, double (*value)(uint16_t), uint16_t max_finite, double beyond)
{
    uint16_t lo = 0, hi = max_finite;
    if (a >= value(max_finite)) {
        lo = max_finite;
    } else {
        while (hi - lo > 1) { /* invariant: value(lo) <= a < value(hi) */
            uint16_t mid = (uint16_t)((lo + hi) / 2);
            if (value(mid) <= a)
                lo = mid;
            else
                hi = mid;
        }
    }
    double vl = value(lo), vh = lo == max_finite ? beyond : value((uint16_t)(lo + 1));
    if (a - vl < vh - a)
        return lo;
    if (a - vl > vh - a)
        return (uint16_t)(lo + 1);
    return (lo & 1) ? (uint16_t)(lo + 1) : lo;
}

static uint16_t ref_to_half(float f)
{
    uint16_t sign = (fbits(f) >> 31) ? 0x8000 : 0;
    if (isnan(f))
        return 0xffff; /* marker: caller checks NaN-ness */
    double a = fabs((double)f);
    if (isinf(f))
        return sign | 0x7c00;
    uint16_t r = ref_round(a, ref_half_value, 0x7bff, 65536.0);
    return (uint16_t)(sign | r);
}

static uint16_t ref_to_bf16(float f)
{
    uint16_t sign = (fbits(f) >> 31) ? 0x8000 : 0;
    if (isnan(f))
        return 0xffff;
    double a = fabs((double)f);
    if (isinf(f))
        return sign | 0x7f80;
    uint16_t r = ref_round(a, ref_bf16_value, 0x7f7f, ldexp(1.0, 128));
    return (uint16_t)(sign | r);
}

static void check_to_half(float f)
{
    uint16_t got = fitm_fp32_to_fp16(f), want = ref_to_half(f);
    if (isnan(f)) {
        CHECK((got & 0x7c00) == 0x7c00 && (got & 0x3ff) && (got >> 15) == (fbits(f) >> 31),
              "fp16(NaN %08x) = %04x", fbits(f), got);
        CHECK((got & 0x200) != 0, "fp16(NaN %08x) = %04x not quiet", fbits(f), got);
    } else {
        CHECK(got == want, "fp16(%a = %08x) = %04x, want %04x", f, fbits(f), got, want);
    }
#if FITM_QUANT_X86
    if (have_f16c) {
        uint16_t hw = f16c_from_f32(f);
        CHECK(got == hw, "fp16(%08x) = %04x, F16C says %04x", fbits(f), got, hw);
    }
#endif
}

static void check_to_bf16(float f)
{
    uint16_t got = fitm_fp32_to_bf16(f), want = ref_to_bf16(f);
    if (isnan(f))
        CHECK((got & 0x7f80) == 0x7f80 && (got & 0x7f) && (got >> 15) == (fbits(f) >> 31),
              "bf16(NaN %08x) = %04x", fbits(f), got);
    else
        CHECK(got == want, "bf16(%a = %08x) = %04x, want %04x", f, fbits(f), got, want);
}

static void test_conversions(void)
{
    /* every 16-bit pattern, both formats, widening */
    for (uint32_t h = 0; h < 65536; h++) {
        double want = ref_half_value((uint16_t)h);
        float got = fitm_fp16_to_fp32((uint16_t)h);
        if (isnan(want)) {
            CHECK(isnan(got) && (fbits(got) >> 31) == (h >> 15) &&
                      ((fbits(got) >> 13) & 0x3ff) == ((h & 0x3ff) | 0x200), /* quieted */
                  "fp16->fp32 NaN %04x -> %08x", h, fbits(got));
        } else {
            CHECK((double)got == want && !signbit(got) == !signbit(want), "fp16->fp32 %04x", h);
        }
#if FITM_QUANT_X86
        if (have_f16c)
            CHECK(fbits(got) == fbits(f16c_to_f32((uint16_t)h)), "fp16 %04x vs F16C", h);
#endif
        double wb = ref_bf16_value((uint16_t)h);
        float gb = fitm_bf16_to_fp32((uint16_t)h);
        if (isnan(wb))
            CHECK(isnan(gb), "bf16->fp32 NaN %04x", h);
        else
            CHECK((double)gb == wb && !signbit(gb) == !signbit(wb), "bf16->fp32 %04x", h);

        /* narrowing: each representable value maps to itself; midpoints to the neighbours
         * and their float32 neighbours one ulp either side */
        if (!isnan(want)) {
            check_to_half((float)want);
            check_to_bf16((float)wb);
        }
        if ((h & 0x7fff) < 0x7c00) {
            double next = (h & 0x7fff) == 0x7bff ? 65536.0 : fabs(ref_half_value((uint16_t)(h + 1)));
            float mid = (float)((fabs(want) + next) / 2); /* exact: 12 significant bits */
            if (h & 0x8000)
                mid = -mid;
            check_to_half(mid);
            check_to_half(nextafterf(mid, 0.0f));
            check_to_half(nextafterf(mid, INFINITY));
            check_to_half(nextafterf(mid, -INFINITY));
        }
        if ((h & 0x7fff) < 0x7f80) {
            double next = (h & 0x7fff) == 0x7f7f ? ldexp(1.0, 128) : fabs(ref_bf16_value((uint16_t)(h + 1)));
            double midd = (fabs(wb) + next) / 2;
            if (midd < ldexp(1.0, 128)) {
                float mid = (float)midd; /* exact: 9 significant bits */
                if (h & 0x8000)
                    mid = -mid;
                check_to_bf16(mid);
                check_to_bf16(nextafterf(mid, 0.0f));
                check_to_bf16(nextafterf(mid, INFINITY));
            } else {
                check_to_bf16(h & 0x8000 ? -FLT_MAX : FLT_MAX); /* rounds to inf */
            }
        }
    }
    /* random float32 bit patterns (all classes, NaNs included) */
    for (int i = 0; i < 2000000; i++) {
        float f = bitsf((uint32_t)rnd());
        check_to_half(f);
        check_to_bf16(f);
    }
    /* named specials */
    CHECK(fitm_fp32_to_fp16(INFINITY) == 0x7c00, "inf");
    CHECK(fitm_fp32_to_fp16(-INFINITY) == 0xfc00, "-inf");
    CHECK(fitm_fp32_to_fp16(65519.996f) == 0x7bff, "just below the overflow midpoint");
    CHECK(fitm_fp32_to_fp16(65520.0f) == 0x7c00, "overflow midpoint rounds to inf");
    CHECK(fitm_fp32_to_fp16(-0.0f) == 0x8000, "-0");
    CHECK(fitm_fp32_to_fp16(0x1p-25f) == 0x0000, "half of the smallest subnormal: even (0)");
    CHECK(fitm_fp32_to_fp16(0x1.8p-24f) == 0x0002, "1.5 subnormal ulps: even (2)");
    CHECK(fitm_fp32_to_bf16(INFINITY) == 0x7f80 && fitm_fp32_to_bf16(-INFINITY) == 0xff80, "bf16 inf");
    CHECK(isnan(fitm_fp16_to_fp32(fitm_fp32_to_fp16(NAN))), "fp16 NaN round trip");
    CHECK(isnan(fitm_bf16_to_fp32(fitm_fp32_to_bf16(-NAN))), "bf16 NaN round trip");
    CHECK(fitm_fp32_to_bf16(bitsf(0x7f800001u)) != 0x7f80, "bf16 sNaN must not become inf");
    CHECK(fitm_fp32_to_fp16(bitsf(0x7f800001u)) != 0x7c00, "fp16 sNaN must not become inf");
}

/* ---------------------------------------------------------------------------------------
 * Random blocks and data */

static const fitm_dtype weight_types[] = {
    FITM_DTYPE_F32, FITM_DTYPE_F16, FITM_DTYPE_BF16, FITM_DTYPE_Q8_0, FITM_DTYPE_Q4_0,
    FITM_DTYPE_Q5_0, FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K,
};
#define N_WEIGHT_TYPES (int)(sizeof weight_types / sizeof weight_types[0])

static const char *tname(fitm_dtype t) { return fitm_dtype_info_of((int)t)->name; }

static void put_f16(uint8_t *p, float v)
{
    uint16_t h = fitm_fp32_to_fp16(v);
    memcpy(p, &h, 2);
}

/* Random bytes for n values of type t, float scale fields set to finite values of both
 * signs (every bit pattern of the quantized fields is legal). */
static void random_row(fitm_dtype t, void *dst, int64_t n)
{
    size_t bytes = fitm_dtype_row_bytes(t, n);
    uint8_t *p = dst;
    for (size_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)rnd();
    const fitm_dtype_info *info = fitm_dtype_info_of((int)t);
    int64_t nb = n / info->block_elems;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = p + b * info->block_bytes;
        float s = gauss() * (float)pow(10, -3 + 3 * unif());
        switch (t) {
        case FITM_DTYPE_F32: {
            float v = gauss() * (float)pow(10, -5 + 10 * unif());
            memcpy(blk, &v, 4);
            break;
        }
        case FITM_DTYPE_F16:
            put_f16(blk, gauss() * (float)pow(10, -6 + 10 * unif()));
            break;
        case FITM_DTYPE_BF16: {
            uint16_t h = fitm_fp32_to_bf16(gauss() * (float)pow(10, -20 + 40 * unif()));
            memcpy(blk, &h, 2);
            break;
        }
        case FITM_DTYPE_Q4_K:
        case FITM_DTYPE_Q5_K:
            put_f16(blk + 2, s * 0.5f * gauss());
            put_f16(blk, s);
            break;
        case FITM_DTYPE_Q6_K:
            put_f16(blk + 208, s);
            break;
        case FITM_DTYPE_Q8_K:
            memcpy(blk, &s, 4);
            break;
        default:
            put_f16(blk, s);
            break;
        }
    }
}

static void random_floats(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) {
        x[i] = gauss() * scale;
        if (rnd() % 64 == 0)
            x[i] *= -20.0f; /* outliers of either sign */
    }
}

/* Magnitude the rounding of a dot product scales with: sum |w_i x_i| plus, for Q4_K/Q5_K,
 * sum |dmin * m_i * x_i| (the two terms those formats subtract). */
static double dot_magnitude(fitm_dtype t, const void *w, const float *wd, const float *xd, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += fabs((double)wd[i] * xd[i]);
    if (t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q5_K) {
        const size_t bb = t == FITM_DTYPE_Q4_K ? sizeof(fitm_block_q4_k) : sizeof(fitm_block_q5_k);
        for (int64_t b = 0; b < n / FITM_QK_K; b++) {
            const fitm_block_q4_k *blk = (const void *)((const uint8_t *)w + b * bb);
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                fitm_quant_k_scale_min(blk->scales, j, &sc, &m);
                for (int l = 0; l < 32; l++)
                    s += fabs((double)fitm_fp16_to_fp32(blk->dmin) * m * xd[b * 256 + 32 * j + l]);
            }
        }
    }
    return s;
}

/* ---------------------------------------------------------------------------------------
 * SIMD vs scalar */

static void test_paths(void)
{
    /* odd block counts (32, 96, 160, 224) reach the 32-block kernels' tails; the K-quants
     * (256-blocks) skip them */
    const int64_t sizes[] = {256, 512, 1280, 4096, 32, 96, 160, 224};
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        fitm_dtype t = weight_types[ti], vt = fitm_quant_vec_dtype(t);
        for (int si = 0; si < (int)(sizeof sizes / sizeof sizes[0]); si++) {
            if (!fitm_dtype_row_bytes(t, sizes[si]) || !fitm_dtype_row_bytes(vt, sizes[si]))
                continue;
            for (int rep = 0; rep < 20; rep++) {
                int64_t n = sizes[si];
                void *w = malloc(fitm_dtype_row_bytes(t, n));
                void *xq = malloc(fitm_dtype_row_bytes(vt, n));
                float *x = malloc(n * sizeof(float)), *wd = malloc(n * sizeof(float));
                float *wd2 = malloc(n * sizeof(float)), *xd = malloc(n * sizeof(float));
                random_row(t, w, n);
                random_floats(x, n, (float)pow(10, -2 + 3 * unif()));
                fitm_quant_row(vt, x, xq, n);
                if (vt != FITM_DTYPE_F32) { /* activation quantizer: paths give the same bytes */
                    size_t xb = fitm_dtype_row_bytes(vt, n);
                    uint8_t *xq2 = malloc(xb);
                    fitm_quant_quant_row_scalar(vt, x, xq2, n);
                    CHECK(memcmp(xq, xq2, xb) == 0, "%s quant paths differ", tname(vt));
                    free(xq2);
                }
                fitm_quant_dequant_row_scalar(t, w, wd, n);
                fitm_dequant_row(t, w, wd2, n);
                CHECK(memcmp(wd, wd2, n * sizeof(float)) == 0, "%s dequant paths differ", tname(t));
                fitm_quant_dequant_row_scalar(vt, xq, xd, n);
                fitm_dequant_row(vt, xq, wd2, n);
                CHECK(memcmp(xd, wd2, n * sizeof(float)) == 0, "%s dequant paths differ", tname(vt));

                double ref = 0;
                for (int64_t i = 0; i < n; i++)
                    ref += (double)wd[i] * xd[i];
                double mag = dot_magnitude(t, w, wd, xd, n);
                /* both paths: exact integer block sums, float32 accumulation of at most
                 * n/32 + 70 rounded terms (see test_quant_oracle.py); the dequantized
                 * reference itself is rounded once per element: another u * mag */
                double tol = ((double)n / 32 + 71) * 0x1p-24 * mag;
                float fs = fitm_quant_dot_scalar(t, w, xq, n), fv = fitm_quant_dot(t, w, xq, n);
                CHECK(fabs(fs - ref) <= tol, "%s n=%ld scalar %g ref %g tol %g", tname(t), (long)n, fs, ref, tol);
                CHECK(fabs(fv - ref) <= tol, "%s n=%ld simd %g ref %g tol %g", tname(t), (long)n, fv, ref, tol);
                float mv = 0.0f;
                fitm_matvec(t, w, n, xq, &mv, 0, 1);
                CHECK(mv == fv, "%s n=%ld matvec %g != dot %g", tname(t), (long)n, mv, fv);
                CHECK(fabs(ref) > 0, "%s: degenerate data", tname(t));
                free(w), free(xq), free(x), free(wd), free(wd2), free(xd);
            }
        }
    }
    /* odd lengths for the float types (tails of the vector loops) */
    const fitm_dtype ftypes[] = {FITM_DTYPE_F32, FITM_DTYPE_F16, FITM_DTYPE_BF16};
    for (int ti = 0; ti < 3; ti++)
        for (int64_t n = 1; n <= 100; n += 3) {
            fitm_dtype t = ftypes[ti];
            uint8_t w[400];
            float x[100], wd[100];
            random_row(t, w, n);
            random_floats(x, n, 1.0f);
            fitm_dequant_row(t, w, wd, n);
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) {
                ref += (double)wd[i] * x[i];
                mag += fabs((double)wd[i] * x[i]);
            }
            double tol = ((double)n / 32 + 71) * 0x1p-24 * mag;
            CHECK(fabs(fitm_quant_dot(t, w, x, n) - ref) <= tol, "%s n=%ld", tname(t), (long)n);
            CHECK(fabs(fitm_quant_dot_scalar(t, w, x, n) - ref) <= tol, "%s scalar n=%ld", tname(t), (long)n);
        }
}

/* ---------------------------------------------------------------------------------------
 * matvec and matmul */

#define GUARD 1234.5f

static void test_matvec_matmul(void)
{
    const int64_t N = 600, K = 512, M = 9, ldy = N + 5, n0 = 3, n1 = 597; /* 3 tiles */
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        fitm_dtype t = weight_types[ti], vt = fitm_quant_vec_dtype(t);
        size_t rb = fitm_dtype_row_bytes(t, K), xqb = fitm_dtype_row_bytes(vt, K);
        float *Wf = malloc(N * K * sizeof(float));
        uint8_t *W = malloc(N * rb);
        random_floats(Wf, N * K, 0.05f);
        fitm_quant_row(t, Wf, W, N * K);

        float *X = malloc(M * K * sizeof(float)), *Y = malloc(M * ldy * sizeof(float));
        uint8_t *xq = malloc(M * xqb);
        float *y = malloc((N + 2) * sizeof(float));
        float *scratch = malloc(fitm_matmul_scratch_floats(K) * sizeof(float));
        for (int64_t m = 0; m < M; m++) {
            float *xr = X + m * K;
            random_floats(xr, K, 1.0f);
            /* matmul gets exactly the values matvec sees: the dequantized x_q */
            fitm_quant_row(vt, xr, xq + m * xqb, K);
            fitm_dequant_row(vt, xq + m * xqb, xr, K);
        }
        for (int64_t i = 0; i < M * ldy; i++)
            Y[i] = GUARD;
        fitm_matmul(t, W, K, X, M, Y, ldy, n0, n1, scratch);
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < N + 2; i++)
                y[i] = GUARD;
            fitm_matvec(t, W, K, xq + m * xqb, y + 1, n0, n1); /* y + 1: guard below too */
            CHECK(y[0] == GUARD && y[1 + n0 - 1] == GUARD && y[1 + n1] == GUARD,
                  "%s matvec wrote outside [n0, n1)", tname(t));
            for (int64_t n = 0; n < ldy; n++) {
                float got = Y[m * ldy + n];
                if (n < n0 || n >= n1) {
                    CHECK(got == GUARD, "%s matmul wrote outside [n0, n1): col %ld", tname(t), (long)n);
                    continue;
                }
                float d = fitm_quant_dot(t, W + n * rb, xq + m * xqb, K);
                CHECK(y[1 + n] == d, "%s matvec != dot at row %ld", tname(t), (long)n);
                float wd[512];
                fitm_dequant_row(t, W + n * rb, wd, K);
                double mag = dot_magnitude(t, W + n * rb, wd, X + m * K, K);
                /* matmul: sgemm on float32 W, up to K roundings; matvec: K/32 + 71 */
                double tol = ((double)K + K / 32 + 90) * 0x1p-24 * mag;
                CHECK(fabs((double)got - d) <= tol, "%s matmul %g vs matvec %g (tol %g) at (%ld,%ld)",
                      tname(t), got, d, tol, (long)m, (long)n);
            }
        }
        free(Wf), free(W), free(X), free(Y), free(xq), free(y), free(scratch);
    }
}

/* fitm_matvec_rows == fitm_quant_dot per (weight row, activation row), bit for bit, and
 * writes only its rows: a row's value may not depend on how many rows share the call. Row
 * counts 1..11 cross the multi-row kernels' block sizes (4 rows on AVX2, chunks of up to 8 on
 * AVX-512); the lengths cover an odd last block, a last lone pair, chunks of rows cut short
 * by wide rows (K = 2080, 4160) and rows too wide for the 512-bit multi-row kernels (8192). */
static void test_matvec_rows(void)
{
    const int64_t N = 37, n0 = 2, n1 = 35, M_MAX = 11, ldy = N + 3;
    const int64_t lens[] = {32, 96, 160, 256, 640, 768, 2080, 2304, 4160, 8192};
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        fitm_dtype t = weight_types[ti], vt = fitm_quant_vec_dtype(t);
        const int64_t be = fitm_dtype_info_of((int)t)->block_elems;
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            const int64_t K = lens[li];
            if (K % be)
                continue;
            size_t rb = fitm_dtype_row_bytes(t, K), xqb = fitm_dtype_row_bytes(vt, K) + 4;
            uint8_t *W = malloc(N * rb), *xq = malloc(M_MAX * xqb);
            float *x = malloc(K * sizeof(float)), *Y = malloc(M_MAX * ldy * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                random_row(t, W + n * rb, K);
            for (int64_t m = 0; m < M_MAX; m++) { /* rows xqb apart: a stride (blocks kept aligned) */
                random_floats(x, K, 1.0f + (float)m);
                fitm_quant_row(vt, x, xq + m * xqb, K);
            }
            for (int64_t M = 1; M <= M_MAX; M++) {
                for (int64_t i = 0; i < M_MAX * ldy; i++)
                    Y[i] = GUARD;
                fitm_matvec_rows(t, W, K, xq, xqb, M, Y, ldy, n0, n1);
                int bad = 0;
                for (int64_t m = 0; m < M_MAX; m++)
                    for (int64_t n = 0; n < ldy; n++) {
                        const float got = Y[m * ldy + n];
                        const bool in = m < M && n >= n0 && n < n1;
                        const float want = in ? fitm_quant_dot(t, W + n * rb, xq + m * xqb, K) : GUARD;
                        if (fbits(got) != fbits(want) && bad++ < 3)
                            CHECK(false, "%s K=%ld M=%ld: Y[%ld, %ld] = %.9g, %s %.9g", tname(t),
                                  (long)K, (long)M, (long)m, (long)n, got,
                                  in ? "one-row dot" : "untouched", want);
                    }
            }
            free(W), free(xq), free(x), free(Y);
        }
    }
}

/* The K-quant products of the AVX2 and the AVX-512 objects form the same integer block sums
 * (256-bit lanes; 512-bit vectors folded onto them) and the same float chains: bit-identical
 * for every row count, where the CPU runs both. */
static void test_kquant_paths(void)
{
#if FITM_QUANT_X86
    if (!fitm_cpu_supports(FITM_CPU_AVX512) || !fitm_cpu_supports(FITM_CPU_AVX2))
        return;
    const fitm_dtype kt[] = {FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K};
    const int64_t N = 19, M_MAX = 9, lens[] = {256, 768, 2048};
    for (int ti = 0; ti < 3; ti++)
        for (int li = 0; li < 3; li++) {
            const fitm_dtype t = kt[ti], vt = fitm_quant_vec_dtype(t);
            const int64_t K = lens[li];
            const size_t rb = fitm_dtype_row_bytes(t, K), xqb = fitm_dtype_row_bytes(vt, K);
            uint8_t *W = malloc(N * rb), *xq = malloc(M_MAX * xqb);
            float *x = malloc(K * sizeof(float)), *y2 = malloc(M_MAX * N * sizeof(float)),
                  *y5 = malloc(M_MAX * N * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                random_row(t, W + n * rb, K);
            for (int64_t m = 0; m < M_MAX; m++) {
                random_floats(x, K, 0.5f + (float)m);
                fitm_quant_row(vt, x, xq + m * xqb, K);
            }
            for (int64_t M = 1; M <= M_MAX; M++) {
                fitm_quant_matvec_rows_avx2(t, W, rb, K, xq, xqb, M, y2, N, N);
                fitm_quant_matvec_rows_avx512(t, W, rb, K, xq, xqb, M, y5, N, N);
                CHECK(memcmp(y2, y5, (size_t)(M * N) * sizeof(float)) == 0,
                      "%s K=%ld M=%ld: AVX2 and AVX-512 products differ", tname(t), (long)K,
                      (long)M);
            }
            for (int64_t n = 0; n < N; n++) {
                const float a = fitm_quant_dot_avx2(t, W + n * rb, xq, K),
                            b = fitm_quant_dot_avx512(t, W + n * rb, xq, K);
                CHECK(fbits(a) == fbits(b), "%s K=%ld row %ld: dots %.9g and %.9g", tname(t),
                      (long)K, (long)n, a, b);
            }
            free(W), free(xq), free(x), free(y2), free(y5);
        }
#endif
}

/* ---------------------------------------------------------------------------------------
 * Packed weights: the layout holds the stored values (rows read back bit for bit); the
 * product on this path equals the scalar reference bit for bit for every row count and
 * writes only its groups; and the reference is the stored weights' dot within rounding. */

/* The dot of a stored Q4_K row with Q8_K activations from their integers, in double (the
 * format's exact value but for the scale products' rounding), and its magnitude. */
static double q4_k_dot_exact(const fitm_block_q4_k *w, const fitm_block_q8_k *x, int64_t nb,
                             double *mag)
{
    double acc = 0;
    *mag = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            fitm_quant_k_scale_min(w[b].scales, j, &sc, &m);
            for (int e = 0; e < 32; e++) {
                const int q = (w[b].qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 0xF;
                isum += (int64_t)sc * q * x[b].qs[32 * j + e];
                msum += (int64_t)m * x[b].qs[32 * j + e];
            }
        }
        const double a = (double)fitm_fp16_to_fp32(w[b].d) * x[b].d * (double)isum,
                     c = (double)fitm_fp16_to_fp32(w[b].dmin) * x[b].d * (double)msum;
        acc += a - c;
        *mag += fabs(a) + fabs(c);
    }
    return acc;
}

/* The same for Q6_K. */
static double q6_k_dot_exact(const fitm_block_q6_k *w, const fitm_block_q8_k *x, int64_t nb,
                             double *mag)
{
    double acc = 0;
    *mag = 0;
    for (int64_t b = 0; b < nb; b++) {
        float v[FITM_QK_K]; /* d * sc * (u - 32): the integer u - 32 from the dequantized value */
        fitm_dequant_row(FITM_DTYPE_Q6_K, &w[b], v, FITM_QK_K);
        const double d = fitm_fp16_to_fp32(w[b].d);
        int64_t isum = 0;
        for (int e = 0; e < FITM_QK_K; e++) {
            const int sc = w[b].scales[e / 16];
            const long q = sc && d != 0 ? lround(v[e] / (d * sc)) : 0;
            isum += (int64_t)sc * q * x[b].qs[e];
        }
        const double a = d * x[b].d * (double)isum;
        acc += a;
        *mag += fabs(a);
    }
    return acc;
}

static void test_packed(void)
{
    const int64_t N = 48, M_MAX = 19, ldy = N + 3, n0 = 16, n1 = 48;
    const int64_t lens[] = {32, 64, 96, 640, 2080}, lens_k[] = {256, 512, 1024, 2304};
    const fitm_dtype types[] = {FITM_DTYPE_Q8_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q4_K, FITM_DTYPE_Q6_K};
    const bool packs = fitm_cpu_path() == FITM_CPU_AVX512;
    CHECK(fitm_pack_bytes(FITM_DTYPE_Q8_0, 40, 64) == 0, "40 rows are not whole groups");
    CHECK(fitm_pack_bytes(FITM_DTYPE_Q5_K, 48, 256) == 0, "Q5_K has no packed layout");
    CHECK(fitm_pack_bytes(FITM_DTYPE_Q8_0, 48, 32 * (FITM_PACK_MAX_BLOCKS + 1)) == 0, "K too long");
    CHECK(fitm_pack_bytes(FITM_DTYPE_Q4_K, 48, 32 * (FITM_PACK_MAX_BLOCKS + 8)) == 0, "K too long");
    for (int ti = 0; ti < 4; ti++) {
        const fitm_dtype t = types[ti], vt = fitm_quant_vec_dtype(t);
        const bool kq = t == FITM_DTYPE_Q4_K || t == FITM_DTYPE_Q6_K;
        for (size_t li = 0; li < (kq ? 4 : 5); li++) {
            const int64_t K = kq ? lens_k[li] : lens[li];
            const size_t rb = fitm_dtype_row_bytes(t, K), xqb = fitm_dtype_row_bytes(vt, K) + 4;
            const size_t pb = t == FITM_DTYPE_Q4_K ? (size_t)(N / 16 * K / 256) * 2368 : N * rb;
            CHECK(fitm_pack_bytes(t, N, K) == (packs ? pb : 0), "%s K=%ld: pack bytes %zu",
                  tname(t), (long)K, fitm_pack_bytes(t, N, K));
            if (packs)
                CHECK(fitm_pack_bytes(t, n0, K) == pb / 3, "%s K=%ld: where row 16 starts",
                      tname(t), (long)K);
            uint8_t *W = malloc(N * rb), *P = malloc(pb), *xq = malloc(M_MAX * xqb);
            float *x = malloc(K * sizeof(float)), *a = malloc(K * sizeof(float)),
                  *b = malloc(K * sizeof(float)), *Y = malloc(M_MAX * ldy * sizeof(float)),
                  *R = malloc(M_MAX * N * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                random_row(t, W + n * rb, K);
            fitm_pack(t, W, N, K, P);
            int bad = 0;
            for (int64_t n = 0; n < N; n++) {
                fitm_dequant_row(t, W + n * rb, x, K);
                fitm_packed_row(t, P, K, n, a);
                fitm_quant_packed_row_scalar(t, P, K, n, b);
                if ((memcmp(a, x, K * sizeof(float)) || memcmp(b, x, K * sizeof(float))) && bad++ < 3)
                    CHECK(false, "%s K=%ld: packed row %ld differs from the stored one", tname(t),
                          (long)K, (long)n);
            }
            /* the groups column by column, ld past the 16 rows (the lanes between untouched) */
            const int64_t ld = FITM_PACK_ROWS + 3;
            float *cols = malloc(2 * K * ld * sizeof(float));
            for (int64_t n = 0; n < N; n += FITM_PACK_ROWS) {
                for (int64_t i = 0; i < 2 * K * ld; i++)
                    cols[i] = GUARD;
                fitm_packed_cols(t, P, K, n, cols, ld);
                fitm_quant_packed_cols_scalar(t, P, K, n, cols + K * ld, ld);
                for (int64_t r = 0; r < ld; r++) {
                    if (r < FITM_PACK_ROWS)
                        fitm_dequant_row(t, W + (n + r) * rb, x, K);
                    for (int64_t k = 0; k < K; k++)
                        for (int s = 0; s < 2; s++) {
                            const float got = cols[s * K * ld + k * ld + r];
                            const float want = r < FITM_PACK_ROWS ? x[k] : GUARD;
                            if (fbits(got) != fbits(want) && bad++ < 3)
                                CHECK(false, "%s K=%ld: packed %s cols, row %ld col %ld: %.9g, "
                                      "want %.9g", tname(t), (long)K, s ? "scalar" : "path",
                                      (long)(n + r), (long)k, got, want);
                        }
                }
            }
            free(cols);
            for (int64_t m = 0; m < M_MAX; m++) {
                random_floats(x, K, 1.0f + (float)m);
                fitm_quant_row(vt, x, xq + m * xqb, K);
            }
            fitm_quant_matvec_packed_scalar(t, P, K, xq, xqb, M_MAX, R, N, N / FITM_PACK_ROWS);
            for (int64_t m = 0; m < M_MAX; m++)
                for (int64_t n = 0; n < N; n++) {
                    double ref = 0, mag = 0, tol;
                    const fitm_block_q8_k *xk = (const fitm_block_q8_k *)(xq + m * xqb);
                    if (t == FITM_DTYPE_Q4_K) { /* two scale products, two fmas per super-block */
                        ref = q4_k_dot_exact((const fitm_block_q4_k *)(W + n * rb), xk, K / 256,
                                             &mag);
                        tol = (4.0 * K / 256 + 2) * 0x1p-24 * mag;
                    } else if (t == FITM_DTYPE_Q6_K) {
                        ref = q6_k_dot_exact((const fitm_block_q6_k *)(W + n * rb), xk, K / 256,
                                             &mag);
                        tol = (2.0 * K / 256 + 2) * 0x1p-24 * mag;
                    } else {
                        fitm_dequant_row(t, W + n * rb, a, K);
                        fitm_dequant_row(vt, xq + m * xqb, b, K);
                        for (int64_t i = 0; i < K; i++) {
                            ref += (double)a[i] * b[i];
                            mag += fabs((double)a[i] * b[i]);
                        }
                        /* exact block sums, one rounded scale product and one rounded fma per
                         * block */
                        tol = (2.0 * K / 32 + 2) * 0x1p-24 * mag;
                    }
                    if (fabs(R[m * N + n] - ref) > tol && bad++ < 3)
                        CHECK(false, "%s K=%ld: packed reference (%ld, %ld) = %.9g, dot %.9g (tol %g)",
                              tname(t), (long)K, (long)m, (long)n, R[m * N + n], ref, tol);
                }
            for (int64_t M = 1; M <= M_MAX; M++) {
                for (int64_t i = 0; i < M_MAX * ldy; i++)
                    Y[i] = GUARD;
                fitm_matvec_rows_packed(t, P, K, xq, xqb, M, Y, ldy, n0, n1);
                for (int64_t m = 0; m < M_MAX; m++)
                    for (int64_t n = 0; n < ldy; n++) {
                        const bool in = m < M && n >= n0 && n < n1;
                        const float got = Y[m * ldy + n], want = in ? R[m * N + n] : GUARD;
                        if (fbits(got) != fbits(want) && bad++ < 3)
                            CHECK(false, "%s K=%ld M=%ld: packed Y[%ld, %ld] = %.9g, %s %.9g",
                                  tname(t), (long)K, (long)M, (long)m, (long)n, got,
                                  in ? "reference" : "untouched", want);
                    }
            }
            free(W), free(P), free(xq), free(x), free(a), free(b), free(Y), free(R);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * Degenerate input to the quantizers */

static void test_degenerate(void)
{
    const int64_t n = 512;
    float x[512], y[512];
    uint8_t q[2048];
    const fitm_dtype qtypes[] = {FITM_DTYPE_Q8_0, FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q4_K,
                                 FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K, FITM_DTYPE_Q8_K};
    for (int ti = 0; ti < 7; ti++) {
        fitm_dtype t = qtypes[ti];
        for (int kind = 0; kind < 6; kind++) {
            for (int64_t i = 0; i < n; i++) {
                switch (kind) {
                case 0: x[i] = 0.0f; break;                      /* zeros: d = 0 */
                case 1: x[i] = -0.75f; break;                    /* constant negative */
                case 2: x[i] = 3.5f; break;                      /* constant positive */
                case 3: x[i] = gauss() * 1e-30f; break;          /* below fp16 range */
                case 4: x[i] = gauss() * 1e3f; break;            /* large */
                default: x[i] = (i % 7 == 0) ? NAN : (i % 11 == 0 ? INFINITY : gauss()); break;
                }
            }
            fitm_quant_row(t, x, q, n);
            uint8_t q2[2048];
            fitm_quant_quant_row_scalar(t, x, q2, n);
            CHECK(memcmp(q, q2, fitm_dtype_row_bytes(t, n)) == 0, "%s kind %d: quant paths differ", tname(t), kind);
            fitm_dequant_row(t, q, y, n);
            if (kind == 5)
                continue; /* non-finite input: only "no crash, no UB" is promised */
            double maxerr = 0, amax = 0;
            for (int64_t i = 0; i < n; i++) {
                maxerr = fmax(maxerr, fabs((double)x[i] - y[i]));
                amax = fmax(amax, fabs((double)x[i]));
                CHECK(isfinite(y[i]), "%s kind %d: non-finite output", tname(t), kind);
            }
            /* zeros and constants are represented to within a few fp16 ulps; tiny values
             * flush to (nearly) zero; large ones keep the format's relative error */
            double bound = kind == 3 ? 1e-29 : amax * 0.2 + 1e-30;
            CHECK(maxerr <= bound, "%s kind %d: max error %g (amax %g)", tname(t), kind, maxerr, amax);
        }
    }
}

int main(void)
{
    const char *seed = getenv("FITM_TEST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 0) : 0x5eedf00dull;
    const char *forced = getenv("FITM_CPU");
    int want = forced ? fitm_cpu_parse_path(forced) : -1;
    if (want >= 0 && !fitm_cpu_supports((fitm_cpu_path_id)want)) {
        printf("SKIP test_quant: this CPU has no %s path\n", forced);
        return 77;
    }
#if FITM_QUANT_X86
    have_f16c = fitm_cpu_supports(FITM_CPU_AVX2);
#endif
    fitm_quant_blas_single_thread();
    test_conversions();
    test_paths();
    test_matvec_matmul();
    test_matvec_rows();
    test_kquant_paths();
    test_packed();
    test_degenerate();
    if (failures) {
        fprintf(stderr, "test_quant: %d failures\n", failures);
        return 1;
    }
    printf("test_quant: ok (path %s)\n", fitm_cpu_path_name(fitm_cpu_path()));
    return 0;
}
