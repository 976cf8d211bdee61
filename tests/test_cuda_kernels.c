/* test_cuda_kernels: every CUDA kernel (kernels.h) against its CPU reference in src/ on fresh
 * seeded random data.
 *
 * A check passes when |got - ref| <= atol + rtol*|ref| for every element whose reference is
 * finite (non-finite references are skipped; a non-finite result against a finite reference
 * is a mismatch). The first few mismatches are printed, then the maximum error. Every device
 * output sits between guard bytes that must survive the kernel, and starts as all-ones bytes
 * (NaN) so an element the kernel forgot to write fails too. Work runs on a non-blocking
 * stream, as the backend will run it.
 *
 * The launcher argument checks and the status helpers run first and need no device; the
 * kernels need one, and without one the test exits 77 (skip). */
#include <cuda_runtime_api.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "compute/ops.h"
#include "compute/quant.h"
#include "kernels.h"

#define GUARD_BYTES 256 /* before and after every device buffer; keeps the payload 256-aligned */
#define GUARD_BYTE 0xA7
#define MAX_REPORT 5

static cudaStream_t stream;

/* A CUDA runtime failure in the harness itself: nothing after it can be trusted. */
#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* ---- random data (xorshift64*, fixed seed: failures reproduce) ---- */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static uint64_t rng_u64(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static float rng_uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)((double)(rng_u64() >> 40) / (double)(1ull << 24));
}

static void fill_uniform(float *x, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_uniform(lo, hi);
}

static void fill_bytes(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(rng_u64() >> 56);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* ---- device buffers with guards ---- */

typedef struct {
    uint8_t *base; /* cudaMalloc'd: guard | payload | guard */
    void *p;       /* payload */
    size_t bytes;  /* payload bytes */
} dbuf;

/* Payload bytes start as 0xFF (NaN as float and as half); guards as GUARD_BYTE. */
static dbuf dbuf_new(size_t bytes)
{
    dbuf b = {NULL, NULL, bytes};
    CUDA_OK(cudaMalloc((void **)&b.base, bytes + 2 * GUARD_BYTES));
    CUDA_OK(cudaMemset(b.base, GUARD_BYTE, bytes + 2 * GUARD_BYTES));
    CUDA_OK(cudaMemset(b.base + GUARD_BYTES, 0xFF, bytes));
    CUDA_OK(cudaDeviceSynchronize());
    b.p = b.base + GUARD_BYTES;
    return b;
}

static dbuf dbuf_from(const void *host, size_t bytes)
{
    dbuf b = dbuf_new(bytes);
    CUDA_OK(cudaMemcpy(b.p, host, bytes, cudaMemcpyHostToDevice));
    /* From pageable memory cudaMemcpy may return before the DMA lands, and the non-blocking
     * stream the kernels run on does not wait for the legacy stream: wait here. */
    CUDA_OK(cudaDeviceSynchronize());
    return b;
}

static void dbuf_get(void *host, const dbuf *b)
{
    CUDA_OK(cudaMemcpy(host, b->p, b->bytes, cudaMemcpyDeviceToHost));
}

/* False (and a message) when a kernel wrote into the guard bytes around b. */
static bool dbuf_guards_ok(const dbuf *b, const char *what)
{
    uint8_t g[2 * GUARD_BYTES];
    CUDA_OK(cudaMemcpy(g, b->base, GUARD_BYTES, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(g + GUARD_BYTES, b->base + GUARD_BYTES + b->bytes, GUARD_BYTES,
                       cudaMemcpyDeviceToHost));
    for (int i = 0; i < 2 * GUARD_BYTES; i++) {
        if (g[i] != GUARD_BYTE) {
            fprintf(stderr, "  %s: out-of-bounds write, guard byte %d %s the output\n", what,
                    i < GUARD_BYTES ? GUARD_BYTES - i : i - GUARD_BYTES + 1,
                    i < GUARD_BYTES ? "before" : "after");
            return false;
        }
    }
    return true;
}

static void dbuf_free(dbuf *b)
{
    cudaFree(b->base);
    b->base = NULL;
    b->p = NULL;
}

/* ---- comparison ---- */

/* got vs ref over n elements; tol_each (may be NULL) replaces atol per element. */
static bool check_close_tol(const char *what, const float *ref, const float *got, int64_t n,
                            double atol, double rtol, const double *tol_each)
{
    int64_t bad = 0, skipped = 0;
    double max_abs = 0.0, max_ratio = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(ref[i])) {
            skipped++;
            continue;
        }
        double err = fabs((double)got[i] - (double)ref[i]);
        double tol = (tol_each ? tol_each[i] : atol) + rtol * fabs((double)ref[i]);
        if (!isfinite(got[i]))
            err = INFINITY;
        if (err > max_abs)
            max_abs = err;
        if (err / tol > max_ratio)
            max_ratio = err / tol;
        if (err > tol) {
            if (bad < MAX_REPORT)
                fprintf(stderr, "  %s: [%lld] ref %.9g got %.9g (err %.3g > tol %.3g)\n", what,
                        (long long)i, (double)ref[i], (double)got[i], err, tol);
            bad++;
        }
    }
    printf("%-56s %s  n=%-8lld max|err| %.3g  max err/tol %.3f%s\n", what, bad ? "FAIL" : "ok  ",
           (long long)n, max_abs, max_ratio, skipped ? "  (non-finite refs skipped)" : "");
    if (bad)
        fprintf(stderr, "  %s: %lld of %lld elements out of tolerance\n", what, (long long)bad,
                (long long)n);
    return bad == 0;
}

static bool check_close(const char *what, const float *ref, const float *got, int64_t n,
                        double atol, double rtol)
{
    return check_close_tol(what, ref, got, n, atol, rtol, NULL);
}

/* Both verdicts, each printing its own detail: a kernel that writes out of bounds usually
 * also gets values wrong, and the guard message says which it is. */
static bool values_and_guards_ok(bool values_ok, const dbuf *out, const char *what)
{
    bool guards_ok = dbuf_guards_ok(out, what);
    return values_ok && guards_ok;
}

/* Launch result, then the kernel's own completion. */
static bool launched(const char *what, int rc)
{
    if (rc != 0) {
        fprintf(stderr, "  %s: launcher returned %s\n", what, fitm_cuda_error_string(rc));
        return false;
    }
    cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) {
        fprintf(stderr, "  %s: kernel failed: %s\n", what, cudaGetErrorString(e));
        exit(1); /* a sticky error: every later check would fail too */
    }
    return true;
}

/* ---- weight data ---- */

static const fitm_dtype weight_types[] = {
    FITM_DTYPE_F32,  FITM_DTYPE_F16,  FITM_DTYPE_BF16, FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0,
    FITM_DTYPE_Q8_0, FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K,
};
#define N_WEIGHT_TYPES (int)(sizeof weight_types / sizeof weight_types[0])

static int64_t block_elems(fitm_dtype t)
{
    return fitm_dtype_info_of((int)t)->block_elems;
}

static void put_f16(uint8_t *p, float v)
{
    uint16_t h = fitm_fp32_to_fp16(v);
    memcpy(p, &h, 2);
}

/* Random bytes make every bit of every field take both values; only the half scales are
 * replaced by finite values of magnitude 1e-3..1e-2 (either sign) so the decoded values stay
 * in a range where the tolerances mean something. */
static void raw_blocks(fitm_dtype t, uint8_t *p, int64_t n)
{
    const fitm_dtype_info *info = fitm_dtype_info_of((int)t);
    fill_bytes(p, fitm_dtype_row_bytes(t, n));
    if (info->block_elems == 1)
        return;
    for (int64_t b = 0; b < n / info->block_elems; b++) {
        uint8_t *blk = p + b * info->block_bytes;
        float s1 = rng_uniform(1e-3f, 1e-2f) * (rng_u64() >> 63 ? -1.0f : 1.0f);
        float s2 = rng_uniform(1e-3f, 1e-2f) * (rng_u64() >> 63 ? -1.0f : 1.0f);
        switch (t) {
        case FITM_DTYPE_Q4_K:
        case FITM_DTYPE_Q5_K:
            put_f16(blk, s1);
            put_f16(blk + 2, s2);
            break;
        case FITM_DTYPE_Q6_K:
            put_f16(blk + 208, s1);
            break;
        default: /* Q4_0, Q5_0, Q8_0 */
            put_f16(blk, s1);
            break;
        }
    }
}

/* n elements of type t: quantized from uniform [-1, 1] floats, or raw_blocks. */
static uint8_t *make_weights(fitm_dtype t, int64_t n, bool raw)
{
    size_t bytes = fitm_dtype_row_bytes(t, n);
    uint8_t *p = xmalloc(bytes);
    if (raw) {
        raw_blocks(t, p, n);
    } else {
        float *f = xmalloc((size_t)n * sizeof(float));
        fill_uniform(f, n, -1.0f, 1.0f);
        fitm_quant_row(t, f, p, n);
        free(f);
    }
    return p;
}

/* ---- dequant ---- */

/* F32 output: exact for the float types, the 32-blocks and Q6_K; Q4_K/Q5_K's (d*sc)*q - dmin*m
 * may fuse into one rounding on the GPU, which moves the result by at most half an ulp of
 * (d*sc)*q (<= 20 here, so 1e-6) plus an ulp of the result: 2e-6 absolute + 1e-6 relative.
 * F16 output: against the reference rounded to half, with one half-precision ulp of slack
 * (2^-10 relative; 6e-8 absolute among subnormals) for an F32 difference that crosses a
 * rounding boundary. */
static void test_dequant(fitm_dtype t, int64_t n, bool raw)
{
    const char *tn = fitm_dtype_info_of((int)t)->name;
    char what[96];
    size_t bytes = fitm_dtype_row_bytes(t, n);
    uint8_t *w = make_weights(t, n, raw);
    float *ref = xmalloc((size_t)n * sizeof(float));
    float *got = xmalloc((size_t)n * sizeof(float));
    uint16_t *got16 = xmalloc((size_t)n * sizeof(uint16_t));
    fitm_dequant_row(t, w, ref, n);

    dbuf dw = dbuf_from(w, bytes);
    dbuf d32 = dbuf_new((size_t)n * sizeof(float));
    dbuf d16 = dbuf_new((size_t)n * sizeof(uint16_t));

    snprintf(what, sizeof what, "dequant_f32 %s n=%lld%s", tn, (long long)n, raw ? " raw" : "");
    bool ok = launched(what, fitm_cuda_dequant_f32(t, dw.p, d32.p, n, stream));
    if (ok) {
        dbuf_get(got, &d32);
        ok = values_and_guards_ok(check_close(what, ref, got, n, 2e-6, 1e-6), &d32, what);
    }
    CHECK(ok);

    snprintf(what, sizeof what, "dequant_f16 %s n=%lld%s", tn, (long long)n, raw ? " raw" : "");
    ok = launched(what, fitm_cuda_dequant_f16(t, dw.p, d16.p, n, stream));
    if (ok) {
        dbuf_get(got16, &d16);
        for (int64_t i = 0; i < n; i++) {
            got[i] = fitm_fp16_to_fp32(got16[i]);
            ref[i] = fitm_fp16_to_fp32(fitm_fp32_to_fp16(ref[i]));
        }
        ok = values_and_guards_ok(check_close(what, ref, got, n, 1e-7, 1e-3), &d16, what);
    }
    CHECK(ok);

    dbuf_free(&dw);
    dbuf_free(&d32);
    dbuf_free(&d16);
    free(w);
    free(ref);
    free(got);
    free(got16);
}

/* ---- matvec ---- */

/* Reference: each row dequantized on the CPU, dotted with x in double. The GPU sums in float
 * in another order, an error of a small multiple of eps * sum|w*x|, hence per row
 * tol = 1e-5 + 2e-6 * sum|w*x|. One element decoded or indexed wrong moves the result by
 * about sum|w*x| / K, which for K <= 16384 is at least 6e-5 * sum|w*x|, 30 times the tolerance. */
static void test_matvec(fitm_dtype t, int64_t N, int64_t K, bool raw)
{
    const char *tn = fitm_dtype_info_of((int)t)->name;
    char what[96];
    size_t row_bytes = fitm_dtype_row_bytes(t, K);
    uint8_t *W = make_weights(t, N * K, raw);
    float *x = xmalloc((size_t)K * sizeof(float));
    float *wrow = xmalloc((size_t)K * sizeof(float));
    float *ref = xmalloc((size_t)N * sizeof(float));
    float *got = xmalloc((size_t)N * sizeof(float));
    double *tol = xmalloc((size_t)N * sizeof(double));
    fill_uniform(x, K, -1.0f, 1.0f);
    for (int64_t r = 0; r < N; r++) {
        fitm_dequant_row(t, W + r * row_bytes, wrow, K);
        double s = 0.0, sa = 0.0;
        for (int64_t k = 0; k < K; k++) {
            s += (double)wrow[k] * x[k];
            sa += fabs((double)wrow[k] * x[k]);
        }
        ref[r] = (float)s;
        tol[r] = 1e-5 + 2e-6 * sa;
    }

    dbuf dW = dbuf_from(W, (size_t)N * row_bytes);
    dbuf dx = dbuf_from(x, (size_t)K * sizeof(float));
    dbuf dy = dbuf_new((size_t)N * sizeof(float));
    snprintf(what, sizeof what, "matvec %s N=%lld K=%lld%s", tn, (long long)N, (long long)K,
             raw ? " raw" : "");
    bool ok = launched(what, fitm_cuda_matvec(t, dW.p, N, K, dx.p, dy.p, stream));
    if (ok) {
        dbuf_get(got, &dy);
        ok = values_and_guards_ok(check_close_tol(what, ref, got, N, 0.0, 0.0, tol), &dy, what);
    }
    CHECK(ok);

    dbuf_free(&dW);
    dbuf_free(&dx);
    dbuf_free(&dy);
    free(W);
    free(x);
    free(wrow);
    free(ref);
    free(got);
    free(tol);
}

/* A decode step of several sequences: fitm_cuda_matmul_rows over T rows at once gives every
 * row bit for bit what that row gives alone (the STEP class's promise: a row's result does
 * not depend on the rows beside it), for T across the kernel's groups of rows. The values
 * themselves are test_matvec's. One row summed in another order, or read from a neighbour's
 * x, differs in the last bits of most outputs. */
static void test_matmul_rows(fitm_dtype t, int64_t N, int64_t K, int64_t T)
{
    const char *tn = fitm_dtype_info_of((int)t)->name;
    char what[96];
    snprintf(what, sizeof what, "matmul_rows %s N=%lld K=%lld T=%lld", tn, (long long)N,
             (long long)K, (long long)T);
    uint8_t *W = make_weights(t, N * K, false);
    float *x = xmalloc((size_t)(T * K) * sizeof(float));
    float *all = xmalloc((size_t)(T * N) * sizeof(float));
    float *one = xmalloc((size_t)N * sizeof(float));
    fill_uniform(x, T * K, -1.0f, 1.0f);
    for (int64_t r = 0; r < T; r++) /* rows of different scale */
        for (int64_t k = 0; k < K; k++)
            x[r * K + k] *= 0.25f + 0.5f * (float)(r % 7);
    dbuf dW = dbuf_from(W, (size_t)N * fitm_dtype_row_bytes(t, K));
    dbuf dx = dbuf_from(x, (size_t)(T * K) * sizeof(float));
    dbuf dy = dbuf_new((size_t)(T * N) * sizeof(float));
    bool ok = launched(what, fitm_cuda_matmul_rows(t, dW.p, N, K, dx.p, T, dy.p, stream));
    if (ok) {
        dbuf_get(all, &dy);
        ok = dbuf_guards_ok(&dy, what);
    }
    for (int64_t r = 0; ok && r < T; r++) {
        dbuf d1x = dbuf_from(x + r * K, (size_t)K * sizeof(float));
        dbuf d1y = dbuf_new((size_t)N * sizeof(float));
        ok = launched(what, fitm_cuda_matmul_rows(t, dW.p, N, K, d1x.p, 1, d1y.p, stream));
        if (ok) {
            dbuf_get(one, &d1y);
            int64_t n_diff = 0;
            for (int64_t n = 0; n < N; n++)
                n_diff += memcmp(&one[n], &all[r * N + n], sizeof(float)) != 0;
            if (n_diff) {
                fprintf(stderr, "  %s: row %lld alone differs from the batch in %lld of %lld\n",
                        what, (long long)r, (long long)n_diff, (long long)N);
                ok = false;
            }
        }
        dbuf_free(&d1x);
        dbuf_free(&d1y);
    }
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok);
    dbuf_free(&dW);
    dbuf_free(&dx);
    dbuf_free(&dy);
    free(W);
    free(x);
    free(all);
    free(one);
}

/* A decode step's Q, K and V products in one launch (fitm_cuda_matmul_rows_n) against one
 * fitm_cuda_matmul_rows launch per weight on the same input: bit for bit equal, for n = 1 to
 * 3 weights of different row counts (the blocks of one weight end inside a block of rows).
 * The values themselves are test_matvec's. */
static void test_matmul_rows_n(fitm_dtype t, int n, int64_t K, int64_t T)
{
    const char *tn = fitm_dtype_info_of((int)t)->name;
    char what[96];
    snprintf(what, sizeof what, "matmul_rows_n %s n=%d K=%lld T=%lld", tn, n, (long long)K,
             (long long)T);
    const int64_t Ns[3] = {13, 6, 9};
    const size_t row_bytes = fitm_dtype_row_bytes(t, K);
    float *x = xmalloc((size_t)(T * K) * sizeof(float));
    fill_uniform(x, T * K, -1.0f, 1.0f);
    dbuf dx = dbuf_from(x, (size_t)(T * K) * sizeof(float));
    dbuf dW[3], d1[3], dn[3];
    const void *W[3];
    float *y[3];
    bool ok = true;
    for (int i = 0; i < n; i++) {
        uint8_t *w = make_weights(t, Ns[i] * K, false);
        dW[i] = dbuf_from(w, (size_t)Ns[i] * row_bytes);
        free(w);
        d1[i] = dbuf_new((size_t)(T * Ns[i]) * sizeof(float));
        dn[i] = dbuf_new((size_t)(T * Ns[i]) * sizeof(float));
        W[i] = dW[i].p, y[i] = dn[i].p;
        ok = ok &&
             launched(what, fitm_cuda_matmul_rows(t, dW[i].p, Ns[i], K, dx.p, T, d1[i].p, stream));
    }
    ok = ok && launched(what, fitm_cuda_matmul_rows_n(t, n, W, Ns, K, dx.p, T, y, stream));
    for (int i = 0; i < n; i++) {
        const size_t bytes = (size_t)(T * Ns[i]) * sizeof(float);
        float *one = xmalloc(bytes), *all = xmalloc(bytes);
        if (ok) {
            dbuf_get(one, &d1[i]);
            dbuf_get(all, &dn[i]);
            ok = dbuf_guards_ok(&dn[i], what);
        }
        if (ok && memcmp(one, all, bytes) != 0) {
            fprintf(stderr, "  %s: output %d differs from its own launch\n", what, i);
            ok = false;
        }
        free(one), free(all);
        dbuf_free(&dW[i]), dbuf_free(&d1[i]), dbuf_free(&dn[i]);
    }
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok);
    dbuf_free(&dx);
    free(x);
}

/* The decode step's gate and up products with the GLU in one launch (fitm_cuda_matmul_glu)
 * against the three launches it replaces, run on the same inputs: bit for bit equal (the
 * backend's decode steps use it where they would run the three). And against the CPU: the
 * double-precision dots of the dequantized rows (tolerance per product as test_matvec's)
 * through fitm_ops_swiglu / fitm_ops_geglu, allowing each product's tolerance times the
 * activation's slope (|act'(g)| <= 1.13, and |act(g)| <= |g|) plus the activation's own 1e-5. */
static void test_matmul_glu(fitm_dtype t, int64_t N, int64_t K, int64_t T, bool gelu)
{
    const char *tn = fitm_dtype_info_of((int)t)->name;
    char what[112];
    snprintf(what, sizeof what, "matmul_glu %s N=%lld K=%lld T=%lld %s", tn, (long long)N,
             (long long)K, (long long)T, gelu ? "gelu" : "silu");
    const size_t row_bytes = fitm_dtype_row_bytes(t, K);
    const size_t ybytes = (size_t)(T * N) * sizeof(float);
    uint8_t *Wg = make_weights(t, N * K, false), *Wu = make_weights(t, N * K, false);
    float *x = xmalloc((size_t)(T * K) * sizeof(float)), *wrow = xmalloc((size_t)K * sizeof(float));
    float *rg = xmalloc(ybytes), *ru = xmalloc(ybytes), *ref = xmalloc(ybytes);
    float *sep = xmalloc(ybytes), *got = xmalloc(ybytes);
    double *tg = xmalloc((size_t)(T * N) * sizeof(double)),
           *tu = xmalloc((size_t)(T * N) * sizeof(double));
    double *tol = xmalloc((size_t)(T * N) * sizeof(double));
    fill_uniform(x, T * K, -1.0f, 1.0f);
    for (int64_t r = 0; r < T; r++) /* rows of different scale */
        for (int64_t k = 0; k < K; k++)
            x[r * K + k] *= 0.25f + 0.5f * (float)(r % 5);
    for (int w = 0; w < 2; w++)
        for (int64_t n = 0; n < N; n++) {
            fitm_dequant_row(t, (w ? Wu : Wg) + n * row_bytes, wrow, K);
            for (int64_t r = 0; r < T; r++) {
                double sum = 0.0, sa = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    sum += (double)wrow[k] * x[r * K + k];
                    sa += fabs((double)wrow[k] * x[r * K + k]);
                }
                (w ? ru : rg)[r * N + n] = (float)sum;
                (w ? tu : tg)[r * N + n] = 1e-5 + 2e-6 * sa;
            }
        }
    if (gelu)
        fitm_ops_geglu(ref, rg, ru, T * N);
    else
        fitm_ops_swiglu(ref, rg, ru, T * N);
    for (int64_t i = 0; i < T * N; i++)
        tol[i] = 1e-5 + 1.13 * fabs((double)ru[i]) * tg[i] + fabs((double)rg[i]) * tu[i];

    dbuf dg = dbuf_from(Wg, (size_t)N * row_bytes), du = dbuf_from(Wu, (size_t)N * row_bytes);
    dbuf dx = dbuf_from(x, (size_t)(T * K) * sizeof(float));
    dbuf yg = dbuf_new(ybytes), yu = dbuf_new(ybytes), dy = dbuf_new(ybytes);
    bool ok =
        launched(what, fitm_cuda_matmul_rows(t, dg.p, N, K, dx.p, T, yg.p, stream)) &&
        launched(what, fitm_cuda_matmul_rows(t, du.p, N, K, dx.p, T, yu.p, stream)) &&
        launched(what, gelu ? fitm_cuda_geglu(yg.p, yg.p, yu.p, T * N, stream)
                            : fitm_cuda_swiglu(yg.p, yg.p, yu.p, T * N, stream)) &&
        launched(what, fitm_cuda_matmul_glu(t, dg.p, du.p, N, K, dx.p, T, gelu, dy.p, stream));
    if (ok) {
        dbuf_get(sep, &yg);
        dbuf_get(got, &dy);
        ok = dbuf_guards_ok(&yg, what) && dbuf_guards_ok(&yu, what);
    }
    if (ok && memcmp(sep, got, ybytes) != 0) {
        int64_t n_diff = 0;
        for (int64_t i = 0; i < T * N; i++)
            n_diff += memcmp(&sep[i], &got[i], sizeof(float)) != 0;
        fprintf(stderr, "  %s: %lld of %lld differ from matmul_rows x 2 + glu\n", what,
                (long long)n_diff, (long long)(T * N));
        ok = false;
    }
    if (ok)
        ok = values_and_guards_ok(check_close_tol(what, ref, got, T * N, 0.0, 0.0, tol), &dy, what);
    CHECK(ok);
    dbuf_free(&dg), dbuf_free(&du), dbuf_free(&dx), dbuf_free(&yg), dbuf_free(&yu), dbuf_free(&dy);
    free(Wg), free(Wu), free(x), free(wrow), free(rg), free(ru), free(ref), free(sep), free(got);
    free(tg), free(tu), free(tol);
}

/* ---- rmsnorm ---- */

/* Float tree sum vs the reference's double sum, then an IEEE sqrt and divide: well under
 * 1e-5 relative. */
static void test_rmsnorm(int64_t T, int64_t C, float w_offset, float eps, bool in_place)
{
    char what[96];
    float *x = xmalloc((size_t)(T * C) * sizeof(float));
    float *w = xmalloc((size_t)C * sizeof(float));
    float *ref = xmalloc((size_t)(T * C) * sizeof(float));
    float *got = xmalloc((size_t)(T * C) * sizeof(float));
    fill_uniform(x, T * C, -2.0f, 2.0f);
    for (int64_t t = 0; t < T; t++) /* rows of different scale */
        for (int64_t c = 0; c < C; c++)
            x[t * C + c] *= (float)(1 + t % 5) * 0.3f;
    fill_uniform(w, C, 0.5f - w_offset, 1.5f - w_offset);
    fitm_ops_rmsnorm(ref, x, w, w_offset, T, C, eps);

    dbuf dx = dbuf_from(x, (size_t)(T * C) * sizeof(float));
    dbuf dw = dbuf_from(w, (size_t)C * sizeof(float));
    dbuf dy = in_place ? dx : dbuf_new((size_t)(T * C) * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm T=%lld C=%lld off=%g%s", (long long)T, (long long)C,
             (double)w_offset, in_place ? " in-place" : "");
    bool ok = launched(what, fitm_cuda_rmsnorm(dy.p, dx.p, dw.p, w_offset, T, C, eps, stream));
    if (ok) {
        dbuf_get(got, &dy);
        ok = values_and_guards_ok(check_close(what, ref, got, T * C, 1e-5, 1e-5), &dy, what);
    }
    CHECK(ok);

    if (!in_place)
        dbuf_free(&dy);
    dbuf_free(&dx);
    dbuf_free(&dw);
    free(x);
    free(w);
    free(ref);
    free(got);
}

/* The fused residual add + RMSNorm against the two kernels it replaces, run one after the
 * other on the same inputs: the sums and the normed rows bit for bit equal (the backend's
 * decode steps use it where they would run the two), and the normed rows within the rmsnorm
 * tolerance of the CPU reference on the sums. */
static void test_add_rmsnorm(int64_t T, int64_t C, float w_offset, bool in_place)
{
    char what[96];
    snprintf(what, sizeof what, "add_rmsnorm T=%lld C=%lld off=%g%s", (long long)T, (long long)C,
             (double)w_offset, in_place ? " in-place" : "");
    const size_t bytes = (size_t)(T * C) * sizeof(float);
    float *x = xmalloc(bytes), *r = xmalloc(bytes), *w = xmalloc((size_t)C * sizeof(float));
    float *sum1 = xmalloc(bytes), *sum2 = xmalloc(bytes), *y1 = xmalloc(bytes),
          *y2 = xmalloc(bytes), *ref = xmalloc(bytes);
    fill_uniform(x, T * C, -2.0f, 2.0f);
    fill_uniform(r, T * C, -1.0f, 1.0f);
    for (int64_t i = 0; i < T * C; i++) /* rows of different scale */
        r[i] *= (float)(1 + i / C % 4) * 0.7f;
    fill_uniform(w, C, 0.5f - w_offset, 1.5f - w_offset);
    dbuf dw = dbuf_from(w, (size_t)C * sizeof(float)), dr = dbuf_from(r, bytes);
    dbuf dx1 = dbuf_from(x, bytes), dx2 = dbuf_from(x, bytes);
    dbuf dy1 = dbuf_new(bytes), dy2 = in_place ? dx2 : dbuf_new(bytes);
    bool ok =
        launched(what, fitm_cuda_add(dx1.p, dr.p, T * C, stream)) &&
        launched(what, fitm_cuda_rmsnorm(dy1.p, dx1.p, dw.p, w_offset, T, C, 1e-6f, stream)) &&
        launched(what,
                 fitm_cuda_add_rmsnorm(dy2.p, dx2.p, dr.p, dw.p, w_offset, T, C, 1e-6f, stream));
    if (ok) {
        dbuf_get(sum1, &dx1);
        dbuf_get(y1, &dy1);
        dbuf_get(y2, &dy2);
        if (!in_place)
            dbuf_get(sum2, &dx2);
        ok = dbuf_guards_ok(&dx1, what) && dbuf_guards_ok(&dy1, what) &&
             dbuf_guards_ok(&dy2, what) && (in_place || dbuf_guards_ok(&dx2, what));
    }
    if (ok && !in_place && memcmp(sum1, sum2, bytes) != 0) {
        fprintf(stderr, "  %s: the sums differ from the add kernel's\n", what);
        ok = false;
    }
    if (ok && memcmp(y1, y2, bytes) != 0) {
        fprintf(stderr, "  %s: the normed rows differ from add + rmsnorm\n", what);
        ok = false;
    }
    if (ok) {
        fitm_ops_rmsnorm(ref, sum1, w, w_offset, T, C, 1e-6f);
        ok = check_close(what, ref, y2, T * C, 1e-5, 1e-5);
    }
    CHECK(ok);
    dbuf_free(&dw), dbuf_free(&dr), dbuf_free(&dx1), dbuf_free(&dx2), dbuf_free(&dy1);
    if (!in_place)
        dbuf_free(&dy2);
    free(x), free(r), free(w), free(sum1), free(sum2), free(y1), free(y2), free(ref);
}

/* The fused post-norm + residual add + RMSNorm (fitm_cuda_norm_add_rmsnorm) against the
 * kernels it replaces, run on copies of the same inputs: fitm_cuda_rmsnorm (p, o), then
 * fitm_cuda_add_rmsnorm (y, x, p) where the second norm takes every row, else fitm_cuda_add
 * (x, p) and fitm_cuda_rmsnorm of its ny rows from y0 (the final norm on a prompt's last row,
 * or on the first of a decode step's sequences). The post-normed rows p, the sums x and the
 * normed rows y must be bit for bit equal (memcmp). p_in_place: p is o (the forward driver
 * norms a block's output in place); y_in_x: y is x's row y0 (x then holds y there). Then
 * against the CPU: p within the rmsnorm tolerance of fitm_ops_rmsnorm (o), x within 1e-5 of
 * the double sum of the old x and that reference p, y within the rmsnorm tolerance of
 * fitm_ops_rmsnorm of the reference sums. Nothing else is written: o when p is apart, y's
 * rows past ny, and y's buffer when y is in x stay as they were. */
static void test_norm_add_rmsnorm(int64_t T, int64_t C, float w_offset, bool p_in_place,
                                  bool y_in_x, int64_t y0, int64_t ny)
{
    char what[112];
    snprintf(what, sizeof what, "norm_add_rmsnorm T=%lld C=%lld off=%g y rows %lld+%lld%s%s",
             (long long)T, (long long)C, (double)w_offset, (long long)y0, (long long)ny,
             p_in_place ? " p=o" : "", y_in_x ? " y in x" : "");
    const int64_t n = T * C;
    const size_t bytes = (size_t)n * sizeof(float), wbytes = (size_t)C * sizeof(float);
    const size_t ybytes = (size_t)(ny * C) * sizeof(float);
    float *o = xmalloc(bytes), *x = xmalloc(bytes), *wp = xmalloc(wbytes), *w = xmalloc(wbytes);
    float *got[2][3], *ref_p = xmalloc(bytes), *ref_x = xmalloc(bytes), *ref_y = xmalloc(bytes);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 3; j++)
            got[k][j] = xmalloc(bytes);
    fill_uniform(o, n, -3.0f, 3.0f);
    fill_uniform(x, n, -2.0f, 2.0f);
    for (int64_t i = 0; i < n; i++) /* rows of different scale */
        o[i] *= (float)(1 + i / C % 5) * 0.4f;
    fill_uniform(wp, C, 0.5f - w_offset, 1.5f - w_offset);
    fill_uniform(w, C, 0.5f - w_offset, 1.5f - w_offset);
    dbuf dwp = dbuf_from(wp, wbytes), dw = dbuf_from(w, wbytes);
    /* [0]: the separate kernels, [1]: the fused one; o, x, y of each, and p (o's buffer when
     * in place) */
    dbuf d[2][3], dp[2];
    float *py[2][2]; /* each run's p and y pointers */
    for (int k = 0; k < 2; k++) {
        d[k][0] = dbuf_from(o, bytes);
        d[k][1] = dbuf_from(x, bytes);
        d[k][2] = dbuf_new(bytes);
        dp[k] = p_in_place ? d[k][0] : dbuf_new(bytes);
        py[k][0] = dp[k].p;
        py[k][1] = y_in_x ? (float *)d[k][1].p + y0 * C : d[k][2].p;
    }
    float *x0 = d[0][1].p;
    bool ok = launched(what, fitm_cuda_rmsnorm(py[0][0], d[0][0].p, dwp.p, w_offset, T, C, 1e-6f,
                                               stream));
    if (y0 == 0 && ny == T)
        ok = ok && launched(what, fitm_cuda_add_rmsnorm(py[0][1], x0, py[0][0], dw.p, w_offset,
                                                        T, C, 1e-6f, stream));
    else
        ok = ok && launched(what, fitm_cuda_add(x0, py[0][0], n, stream)) &&
             launched(what, fitm_cuda_rmsnorm(py[0][1], x0 + y0 * C, dw.p, w_offset, ny, C,
                                              1e-6f, stream));
    ok = ok && launched(what, fitm_cuda_norm_add_rmsnorm(py[1][0], d[1][0].p, dwp.p, d[1][1].p,
                                                         py[1][1], dw.p, w_offset, T, y0, ny, C,
                                                         1e-6f, stream));
    for (int k = 0; k < 2 && ok; k++) {
        CUDA_OK(cudaMemcpy(got[k][0], py[k][0], bytes, cudaMemcpyDeviceToHost));
        dbuf_get(got[k][1], &d[k][1]);
        CUDA_OK(cudaMemcpy(got[k][2], py[k][1], ybytes, cudaMemcpyDeviceToHost));
        ok = dbuf_guards_ok(&d[k][0], what) && dbuf_guards_ok(&d[k][1], what) &&
             dbuf_guards_ok(&d[k][2], what) && dbuf_guards_ok(&dp[k], what);
    }
    static const char *const names[3] = {"post-normed rows p", "sums x", "normed rows y"};
    for (int j = 0; j < 3 && ok; j++) {
        if (memcmp(got[0][j], got[1][j], j == 2 ? ybytes : bytes) != 0) {
            fprintf(stderr, "  %s: the %s differ from the separate kernels'\n", what, names[j]);
            ok = false;
        }
    }
    if (ok) {
        float *untouched = xmalloc(bytes);
        dbuf_get(untouched, &d[1][0]);
        ok = p_in_place || memcmp(untouched, o, bytes) == 0;
        dbuf_get(untouched, &d[1][2]);
        for (int64_t i = y_in_x ? 0 : ny * C; i < n && ok; i++)
            ok = isnan(untouched[i]);
        free(untouched);
        if (!ok)
            fprintf(stderr, "  %s: wrote outside its outputs\n", what);
    }
    if (ok) {
        fitm_ops_rmsnorm(ref_p, o, wp, w_offset, T, C, 1e-6f);
        for (int64_t i = 0; i < n; i++)
            ref_x[i] = (float)((double)x[i] + (double)ref_p[i]);
        fitm_ops_rmsnorm(ref_y, ref_x + y0 * C, w, w_offset, ny, C, 1e-6f);
        char sub[128];
        snprintf(sub, sizeof sub, "%s p", what);
        ok = check_close(sub, ref_p, got[1][0], n, 1e-5, 1e-5);
        if (y_in_x) /* x's rows [y0, y0 + ny) hold y */
            memcpy(ref_x + y0 * C, got[1][1] + y0 * C, ybytes);
        snprintf(sub, sizeof sub, "%s x", what);
        ok = check_close(sub, ref_x, got[1][1], n, 1e-5, 1e-5) && ok;
        snprintf(sub, sizeof sub, "%s y", what);
        ok = check_close(sub, ref_y, got[1][2], ny * C, 1e-5, 1e-5) && ok;
    }
    CHECK(ok);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 3; j++) {
            dbuf_free(&d[k][j]);
            free(got[k][j]);
        }
    for (int k = 0; k < 2 && !p_in_place; k++)
        dbuf_free(&dp[k]);
    dbuf_free(&dwp), dbuf_free(&dw);
    free(o), free(x), free(wp), free(w), free(ref_p), free(ref_x), free(ref_y);
}

/* ---- softmax ---- */

/* expf within 2 ulp and a float sum against a double one: 1e-5 relative, plus 1e-7 absolute
 * for probabilities near zero. The columns [n, ld) must come back untouched (exactly). */
static void test_softmax(int64_t rows, int64_t n, int64_t ld, bool masked)
{
    char what[96];
    const int64_t total = rows * ld;
    float *x = xmalloc((size_t)total * sizeof(float));
    float *ref = xmalloc((size_t)total * sizeof(float));
    float *got = xmalloc((size_t)total * sizeof(float));
    fill_uniform(x, total, -10.0f, 10.0f);
    if (masked) {
        for (int64_t i = 0; i < total; i++)
            if (rng_u64() % 8 == 0)
                x[i] = -INFINITY;
        for (int64_t i = 0; i < n && rows > 1; i++) /* row 1 fully masked: NaN both sides */
            x[ld + i] = -INFINITY;
    }
    memcpy(ref, x, (size_t)total * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        fitm_ops_softmax(ref + r * ld, n);

    dbuf dx = dbuf_from(x, (size_t)total * sizeof(float));
    snprintf(what, sizeof what, "softmax rows=%lld n=%lld ld=%lld%s", (long long)rows, (long long)n,
             (long long)ld, masked ? " masked" : "");
    bool ok = launched(what, fitm_cuda_softmax_rows(dx.p, rows, n, ld, stream));
    if (ok) {
        dbuf_get(got, &dx);
        ok = values_and_guards_ok(check_close(what, ref, got, total, 1e-7, 1e-5), &dx, what);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = n; i < ld; i++)
                if (memcmp(&got[r * ld + i], &x[r * ld + i], sizeof(float)) != 0) {
                    fprintf(stderr, "  %s: padding [%lld, %lld] changed\n", what, (long long)r,
                            (long long)i);
                    ok = false;
                }
    }
    CHECK(ok);

    dbuf_free(&dx);
    free(x);
    free(ref);
    free(got);
}

/* ---- RoPE ---- */

/* Angles in double on both sides; cos/sin rounded to float may differ by an ulp and the
 * rotation may fuse: 1e-5 absolute and relative for inputs in [-1, 1]. The columns [H*D, ld)
 * and the dims past n_rot are compared too (the reference leaves them as they were). */
static void test_rope(int64_t T, int64_t H, int64_t D, int64_t ld, int64_t n_rot, float base,
                      float freq_scale, int neox, bool pos_array, int64_t pos0)
{
    char what[128];
    const int64_t total = T * ld;
    float *x = xmalloc((size_t)total * sizeof(float));
    float *ref = xmalloc((size_t)total * sizeof(float));
    float *got = xmalloc((size_t)total * sizeof(float));
    int32_t *pos = xmalloc((size_t)T * sizeof(int32_t));
    fill_uniform(x, total, -1.0f, 1.0f);
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)(rng_u64() % 131072);
    memcpy(ref, x, (size_t)total * sizeof(float));
    float *cs = xmalloc((size_t)n_rot * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = pos0 + (pos_array ? pos[t] : t);
        fitm_ops_rope_table(cs, n_rot, p, base, freq_scale);
        for (int64_t h = 0; h < H; h++) {
            if (freq_scale == 1.0f) /* both references, then: they promise the same bits */
                fitm_ops_rope(ref + t * ld + h * D, D, n_rot, p, base, neox);
            else
                fitm_ops_rope_apply(ref + t * ld + h * D, cs, n_rot, neox);
        }
    }
    free(cs);

    dbuf dx = dbuf_from(x, (size_t)total * sizeof(float));
    dbuf dpos = dbuf_from(pos, (size_t)T * sizeof(int32_t));
    snprintf(what, sizeof what, "rope T=%lld H=%lld D=%lld ld=%lld rot=%lld fs=%g %s %s",
             (long long)T, (long long)H, (long long)D, (long long)ld, (long long)n_rot,
             (double)freq_scale, neox ? "neox" : "norm", pos_array ? "pos[]" : "pos0+t");
    bool ok = launched(what, fitm_cuda_rope(dx.p, T, H, D, ld, n_rot, pos_array ? dpos.p : NULL,
                                            pos0, base, freq_scale, neox, stream));
    if (ok) {
        dbuf_get(got, &dx);
        ok = values_and_guards_ok(check_close(what, ref, got, total, 1e-5, 1e-5), &dx, what);
    }
    CHECK(ok);

    dbuf_free(&dx);
    dbuf_free(&dpos);
    free(x);
    free(ref);
    free(got);
    free(pos);
}

/* The per-head norms and RoPE of attention's queries and keys in one launch
 * (fitm_cuda_qk_norm_rope) against the launches it replaces (fitm_cuda_rmsnorm over the head
 * vectors of q and of k, then fitm_cuda_rope_table on each) on the same inputs: bit for bit
 * equal. And against the CPU: fitm_ops_rmsnorm then fitm_ops_rope_apply with the same table,
 * within the rmsnorm tolerance (1e-5), the rotation adding a few ulp. Without weights
 * (models without per-head norms) only the rotation runs. */
static void test_qk_norm_rope(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t n_rot, int neox,
                              bool norms)
{
    char what[112];
    snprintf(what, sizeof what, "qk_norm_rope T=%lld H=%lld Hkv=%lld D=%lld rot=%lld %s%s",
             (long long)T, (long long)H, (long long)Hkv, (long long)D, (long long)n_rot,
             neox ? "neox" : "norm", norms ? " normed" : "");
    const int64_t nq = T * H * D, nk = T * Hkv * D;
    float *q = xmalloc((size_t)nq * sizeof(float)), *k = xmalloc((size_t)nk * sizeof(float));
    float *qw = xmalloc((size_t)D * sizeof(float)), *kw = xmalloc((size_t)D * sizeof(float));
    float *cs = xmalloc((size_t)(T * n_rot) * sizeof(float));
    float *rq = xmalloc((size_t)nq * sizeof(float)), *rk = xmalloc((size_t)nk * sizeof(float));
    float *sq = xmalloc((size_t)nq * sizeof(float)), *sk = xmalloc((size_t)nk * sizeof(float));
    float *gq = xmalloc((size_t)nq * sizeof(float)), *gk = xmalloc((size_t)nk * sizeof(float));
    fill_uniform(q, nq, -3.0f, 3.0f);
    fill_uniform(k, nk, -3.0f, 3.0f);
    fill_uniform(qw, D, 0.2f, 1.8f);
    fill_uniform(kw, D, 0.2f, 1.8f);
    for (int64_t t = 0; t < T; t++)
        fitm_ops_rope_table(cs + t * n_rot, n_rot, (int64_t)(rng_u64() % 100000), 10000.0f, 1.0f);
    memcpy(rq, q, (size_t)nq * sizeof(float));
    memcpy(rk, k, (size_t)nk * sizeof(float));
    if (norms) {
        fitm_ops_rmsnorm(rq, rq, qw, 0.0f, T * H, D, 1e-6f);
        fitm_ops_rmsnorm(rk, rk, kw, 0.0f, T * Hkv, D, 1e-6f);
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++)
            fitm_ops_rope_apply(rq + (t * H + h) * D, cs + t * n_rot, n_rot, neox);
        for (int64_t h = 0; h < Hkv; h++)
            fitm_ops_rope_apply(rk + (t * Hkv + h) * D, cs + t * n_rot, n_rot, neox);
    }

    dbuf dq1 = dbuf_from(q, (size_t)nq * sizeof(float)),
         dk1 = dbuf_from(k, (size_t)nk * sizeof(float));
    dbuf dq2 = dbuf_from(q, (size_t)nq * sizeof(float)),
         dk2 = dbuf_from(k, (size_t)nk * sizeof(float));
    dbuf dqw = dbuf_from(qw, (size_t)D * sizeof(float)),
         dkw = dbuf_from(kw, (size_t)D * sizeof(float));
    dbuf dcs = dbuf_from(cs, (size_t)(T * n_rot) * sizeof(float));
    bool ok = true;
    if (norms)
        ok =
            launched(what, fitm_cuda_rmsnorm(dq1.p, dq1.p, dqw.p, 0.0f, T * H, D, 1e-6f, stream)) &&
            launched(what, fitm_cuda_rmsnorm(dk1.p, dk1.p, dkw.p, 0.0f, T * Hkv, D, 1e-6f, stream));
    ok = ok && launched(what, fitm_cuda_rope_table(dq1.p, T, H, D, n_rot, dcs.p, neox, stream)) &&
         launched(what, fitm_cuda_rope_table(dk1.p, T, Hkv, D, n_rot, dcs.p, neox, stream)) &&
         launched(what,
                  fitm_cuda_qk_norm_rope(dq2.p, dk2.p, norms ? dqw.p : NULL, norms ? dkw.p : NULL,
                                         0.0f, T, H, Hkv, D, n_rot, dcs.p, neox, 1e-6f, stream));
    if (ok) {
        dbuf_get(sq, &dq1), dbuf_get(sk, &dk1), dbuf_get(gq, &dq2), dbuf_get(gk, &dk2);
        ok = dbuf_guards_ok(&dq1, what) && dbuf_guards_ok(&dk1, what);
    }
    if (ok && (memcmp(sq, gq, (size_t)nq * sizeof(float)) != 0 ||
               memcmp(sk, gk, (size_t)nk * sizeof(float)) != 0)) {
        fprintf(stderr, "  %s: differs from rmsnorm + rope_table\n", what);
        ok = false;
    }
    if (ok) {
        const bool okq = check_close(what, rq, gq, nq, 1e-5, 1e-5);
        const bool okk = check_close(what, rk, gk, nk, 1e-5, 1e-5);
        ok = values_and_guards_ok(okq, &dq2, what) && values_and_guards_ok(okk, &dk2, what);
    }
    CHECK(ok);
    dbuf_free(&dq1), dbuf_free(&dk1), dbuf_free(&dq2), dbuf_free(&dk2), dbuf_free(&dqw),
        dbuf_free(&dkw), dbuf_free(&dcs);
    free(q), free(k), free(qw), free(kw), free(cs), free(rq), free(rk), free(sq), free(sk),
        free(gq), free(gk);
}

/* ---- KV cache stores ---- */

/* fitm_cuda_attention_many with its calls' KV stores in the launch (a decode step's, fusion
 * on): n_seqs calls of T rows (1 or 2) at their own positions, each reading its cache below
 * pos0 and its new rows from the stores' sources (k_new), against kv_store_many into a copy
 * of the caches and then attention_many reading every key from them: outputs and caches
 * equal by memcmp. Fresh random values; the caches' rows past the stored ones keep theirs. */
static void test_attention_kv(int n_seqs, int32_t H, int32_t Hkv, int32_t D)
{
    enum { MAX_SEQS = 8 };
    char what[96];
    snprintf(what, sizeof what, "attention_many + kv stores seqs=%d H=%d Hkv=%d D=%d", n_seqs, H,
             Hkv, D);
    const int64_t HkvD = (int64_t)Hkv * D, cap = 48;
    fitm_cuda_attn a[2][MAX_SEQS];
    fitm_cuda_kv_rows r[MAX_SEQS];
    dbuf cache[2][MAX_SEQS], src[MAX_SEQS], q[MAX_SEQS], out[2][MAX_SEQS];
    for (int s = 0; s < n_seqs; s++) {
        const int64_t T = 1 + s % 2, pos0 = 3 + (int64_t)(rng_u64() % 40);
        float *c = xmalloc((size_t)(2 * cap * HkvD) * sizeof(float)); /* K rows, then V rows */
        float *n = xmalloc((size_t)(2 * T * HkvD) * sizeof(float));
        float *qh = xmalloc((size_t)(T * H * D) * sizeof(float));
        fill_uniform(c, 2 * cap * HkvD, -1.0f, 1.0f);
        fill_uniform(n, 2 * T * HkvD, -1.0f, 1.0f);
        fill_uniform(qh, T * H * D, -1.0f, 1.0f);
        src[s] = dbuf_from(n, (size_t)(2 * T * HkvD) * sizeof(float));
        q[s] = dbuf_from(qh, (size_t)(T * H * D) * sizeof(float));
        for (int w = 0; w < 2; w++) {
            cache[w][s] = dbuf_from(c, (size_t)(2 * cap * HkvD) * sizeof(float));
            out[w][s] = dbuf_new((size_t)(T * H * D) * sizeof(float));
            float *kc = (float *)cache[w][s].p, *vc = kc + cap * HkvD;
            a[w][s] = (fitm_cuda_attn){.T = T, .pos0 = pos0, .n_head = H, .n_head_kv = Hkv,
                                       .head_dim = D, .scale = 1.0f / sqrtf((float)D),
                                       .q = (const float *)q[s].p, .out = (float *)out[w][s].p,
                                       .k_own = kc, .v_own = vc};
        }
        const float *sk = (const float *)src[s].p;
        float *kc = (float *)cache[1][s].p, *vc = kc + cap * HkvD;
        r[s] = (fitm_cuda_kv_rows){kc + pos0 * HkvD, vc + pos0 * HkvD, sk, sk + T * HkvD,
                                   T * HkvD, 0};
        a[1][s].new_base = pos0, a[1][s].k_new = sk, a[1][s].v_new = sk + T * HkvD;
        free(c), free(n), free(qh);
    }
    /* path 0: the stores into caches 0 first, then attention reading them */
    fitm_cuda_kv_rows r0[MAX_SEQS];
    for (int s = 0; s < n_seqs; s++) {
        r0[s] = r[s];
        r0[s].k_dst = (float *)a[0][s].k_own + a[0][s].pos0 * HkvD;
        r0[s].v_dst = (float *)a[0][s].v_own + a[0][s].pos0 * HkvD;
    }
    dbuf dr0 = dbuf_from(r0, (size_t)n_seqs * sizeof r0[0]);
    dbuf dr1 = dbuf_from(r, (size_t)n_seqs * sizeof r[0]);
    dbuf da0 = dbuf_from(a[0], (size_t)n_seqs * sizeof a[0][0]);
    dbuf da1 = dbuf_from(a[1], (size_t)n_seqs * sizeof a[1][0]);
    bool ok =
        launched(what, fitm_cuda_kv_store_many(r0, dr0.p, n_seqs, stream)) &&
        launched(what, fitm_cuda_attention_many(a[0], da0.p, n_seqs, NULL, NULL, 0, stream)) &&
        launched(what, fitm_cuda_attention_many(a[1], da1.p, n_seqs, r, dr1.p, n_seqs, stream));
    int64_t bad = 0;
    for (int s = 0; s < n_seqs && ok; s++) {
        for (int part = 0; part < 2; part++) { /* the caches, then the outputs */
            const dbuf *x = part ? &out[0][s] : &cache[0][s];
            const dbuf *y = part ? &out[1][s] : &cache[1][s];
            uint8_t *hx = xmalloc(x->bytes), *hy = xmalloc(y->bytes);
            dbuf_get(hx, x);
            dbuf_get(hy, y);
            if (memcmp(hx, hy, x->bytes) != 0) {
                fprintf(stderr, "  %s: sequence %d: the %s differ\n", what, s,
                        part ? "outputs" : "caches");
                bad++;
            }
            ok = ok && dbuf_guards_ok(y, what);
            free(hx), free(hy);
        }
    }
    CHECK(ok && bad == 0);
    printf("%-56s %s  bit for bit\n", what, ok && bad == 0 ? "ok  " : "FAIL");
    dbuf_free(&dr0), dbuf_free(&dr1), dbuf_free(&da0), dbuf_free(&da1);
    for (int s = 0; s < n_seqs; s++) {
        dbuf_free(&src[s]), dbuf_free(&q[s]);
        for (int w = 0; w < 2; w++)
            dbuf_free(&cache[w][s]), dbuf_free(&out[w][s]);
    }
}

/* fitm_cuda_kv_store_many: n_seqs stores of different row counts, each into its own cache
 * buffer at a row offset, F32 and fp16 caches mixed in one launch, against memcpy and
 * fitm_fp32_to_fp16 of each value, bit for bit. The values are fresh random ones over fp16's
 * range and past it, with specials (signed zeros, infinities, NaNs with payloads, fp16
 * subnormals, round-to-even ties) planted; the cache rows around the stored ones must keep
 * their bytes. */
static void test_kv_store(int n_seqs, int64_t row_vals)
{
    enum { MAX_SEQS = FITM_CUDA_KV_ROWS_MAX };
    char what[96];
    fitm_cuda_kv_rows r[MAX_SEQS];
    dbuf cache[MAX_SEQS], src[MAX_SEQS];
    int64_t rows[MAX_SEQS], at[MAX_SEQS], cap[MAX_SEQS];
    bool ok = true;
    for (int s = 0; s < n_seqs; s++) {
        rows[s] = 1 + (int64_t)(rng_u64() % 5);     /* 1 to 5 rows */
        at[s] = (int64_t)(rng_u64() % 7);           /* from row 0 to 6 */
        cap[s] = at[s] + rows[s] + (int64_t)(rng_u64() % 3);
        const int half = (s % 3) == 1;
        const size_t elem = half ? 2 : 4, n = (size_t)(rows[s] * row_vals);
        float *h = xmalloc(2 * n * sizeof(float)); /* K then V */
        for (size_t i = 0; i < 2 * n; i++) {
            const float mag = (float)ldexp(1.0, (int)(rng_u64() % 44) - 30); /* 2^-30 .. 2^13 */
            h[i] = rng_uniform(-mag, mag);
        }
        const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                    0x7fc01234u, 0xffa00001u, 0x477ff000u, 0x477fefffu,
                                    0x33800000u, 0x33000001u, 0x387fe000u, 0x3f801000u,
                                    0x3f803000u, 0xc7800000u};
        for (size_t i = 0; i < sizeof special / sizeof special[0] && half; i++)
            memcpy(&h[(i * 37 + (size_t)s) % (2 * n)], &special[i], sizeof(float));
        src[s] = dbuf_from(h, 2 * n * sizeof(float));
        cache[s] = dbuf_new(2 * (size_t)(cap[s] * row_vals) * elem); /* K rows, then V rows */
        uint8_t *c = (uint8_t *)cache[s].p;
        const size_t k_at = (size_t)(at[s] * row_vals) * elem;
        r[s] = (fitm_cuda_kv_rows){c + k_at, c + (size_t)(cap[s] * row_vals) * elem + k_at,
                                   (const float *)src[s].p, (const float *)src[s].p + n,
                                   (int64_t)n, half};
        free(h);
    }
    snprintf(what, sizeof what, "kv_store_many seqs=%d row=%lld", n_seqs, (long long)row_vals);
    dbuf dr = dbuf_from(r, (size_t)n_seqs * sizeof r[0]); /* the descriptors the kernel reads */
    ok = launched(what, fitm_cuda_kv_store_many(r, dr.p, n_seqs, stream));
    dbuf_free(&dr);
    int64_t bad = 0, checked = 0;
    for (int s = 0; s < n_seqs && ok; s++) {
        const size_t elem = r[s].half ? 2 : 4, n = (size_t)r[s].n;
        const size_t row_bytes = (size_t)row_vals * elem;
        float *h = xmalloc(2 * n * sizeof(float));
        uint8_t *c = xmalloc(cache[s].bytes);
        CUDA_OK(cudaMemcpy(h, src[s].p, 2 * n * sizeof(float), cudaMemcpyDeviceToHost));
        dbuf_get(c, &cache[s]);
        for (int kv = 0; kv < 2; kv++) {
            const uint8_t *part = c + (size_t)kv * (size_t)cap[s] * row_bytes;
            for (int64_t row = 0; row < cap[s]; row++) {
                const bool stored = row >= at[s] && row < at[s] + rows[s];
                for (int64_t j = 0; j < row_vals; j++, checked++) {
                    const uint8_t *got = part + (size_t)row * row_bytes + (size_t)j * elem;
                    uint8_t want[4] = {0xFF, 0xFF, 0xFF, 0xFF};
                    if (stored) {
                        const float x = h[(size_t)kv * n + (size_t)((row - at[s]) * row_vals + j)];
                        if (r[s].half) {
                            const uint16_t b = fitm_fp32_to_fp16(x);
                            memcpy(want, &b, 2);
                        } else {
                            memcpy(want, &x, 4);
                        }
                    }
                    if (memcmp(got, want, elem) != 0) {
                        if (bad < MAX_REPORT)
                            fprintf(stderr,
                                    "  %s: store %d (%s) %s row %lld value %lld: %s bytes "
                                    "differ\n",
                                    what, s, r[s].half ? "fp16" : "F32", kv ? "V" : "K",
                                    (long long)row, (long long)j, stored ? "stored" : "kept");
                        bad++;
                    }
                }
            }
        }
        ok = dbuf_guards_ok(&cache[s], what) && ok;
        free(h);
        free(c);
    }
    printf("%-56s %s  n=%-8lld %lld bytes differ\n", what, bad || !ok ? "FAIL" : "ok  ",
           (long long)checked, (long long)bad);
    CHECK(ok && bad == 0);
    for (int s = 0; s < n_seqs; s++) {
        dbuf_free(&cache[s]);
        dbuf_free(&src[s]);
    }
}

/* ---- gated activations ---- */

/* swiglu: expf and a divide, 1e-5 relative. geglu: 1 + tanh(z) cancels for z << 0, where
 * tanhf's 2 ulp (about 1.2e-7 absolute near -1) times 0.5*|g*u| <= 8 needs 1e-5 absolute. */
static void test_glu(bool geglu, int64_t n, bool in_place)
{
    char what[96];
    float *g = xmalloc((size_t)n * sizeof(float));
    float *u = xmalloc((size_t)n * sizeof(float));
    float *ref = xmalloc((size_t)n * sizeof(float));
    float *got = xmalloc((size_t)n * sizeof(float));
    fill_uniform(g, n, -8.0f, 8.0f);
    fill_uniform(u, n, -2.0f, 2.0f);
    const float special[] = {0.0f, -0.0f, 100.0f, -100.0f, 20.0f, -20.0f, 1e-30f, -90.0f};
    for (int64_t i = 0; i < n && i < (int64_t)(sizeof special / sizeof special[0]); i++)
        g[i * 7 % n] = special[i];
    if (geglu)
        fitm_ops_geglu(ref, g, u, n);
    else
        fitm_ops_swiglu(ref, g, u, n);

    dbuf dg = dbuf_from(g, (size_t)n * sizeof(float));
    dbuf du = dbuf_from(u, (size_t)n * sizeof(float));
    dbuf dy = in_place ? dg : dbuf_new((size_t)n * sizeof(float));
    snprintf(what, sizeof what, "%s n=%lld%s", geglu ? "geglu" : "swiglu", (long long)n,
             in_place ? " in-place" : "");
    int rc = geglu ? fitm_cuda_geglu(dy.p, dg.p, du.p, n, stream)
                   : fitm_cuda_swiglu(dy.p, dg.p, du.p, n, stream);
    bool ok = launched(what, rc);
    if (ok) {
        dbuf_get(got, &dy);
        ok = values_and_guards_ok(check_close(what, ref, got, n, geglu ? 1e-5 : 1e-6, 1e-5), &dy,
                                  what);
    }
    CHECK(ok);

    if (!in_place)
        dbuf_free(&dy);
    dbuf_free(&dg);
    dbuf_free(&du);
    free(g);
    free(u);
    free(ref);
    free(got);
}

/* ---- no device needed: argument checks and status helpers ---- */

/* ---- topk: exact, against fitm_ops_topk ---- */

/* What a row holds (param: the pattern's number); every pattern starts from fresh random
 * values, and the entries between n and the row stride are 1e30, which a kernel reading past
 * n would select. */
typedef enum {
    TOPK_RANDOM,       /* continuous in [-20, 20], -0 and +0 planted */
    TOPK_LEVELS,       /* param distinct values: most entries tie */
    TOPK_ALL_EQUAL,    /* every entry 1.5 */
    TOPK_MAX_COPIES,   /* param copies of the row's maximum (30) at random places */
    TOPK_AT_THRESHOLD, /* two 5s in every chunk and param larger values: T is a 5, and 5s come
                          on either side of it */
    TOPK_NEG_INF,      /* -inf but for param random entries */
    TOPK_NAN,          /* each entry NaN with probability param / n */
    TOPK_HOT_CHUNKS,   /* param whole chunks above every other entry */
} topk_fill;

static const char *const topk_fill_name[] = {"random", "levels", "all-equal", "max-copies",
                                             "at-threshold", "neg-inf", "nan", "hot-chunks"};

static int64_t topk_chunk(int64_t n)
{
    return (n + FITM_CUDA_TOPK_CHUNKS - 1) / FITM_CUDA_TOPK_CHUNKS;
}

static int64_t rng_below(int64_t n)
{
    return (int64_t)(rng_u64() % (uint64_t)n);
}

static void topk_fill_row(float *x, int64_t n, int64_t ld, topk_fill fill, int param)
{
    const int64_t chunk = topk_chunk(n);
    fill_uniform(x, n, -20.0f, 20.0f);
    for (int64_t i = n; i < ld; i++)
        x[i] = 1e30f;
    switch (fill) {
    case TOPK_RANDOM:
        x[rng_below(n)] = -0.0f, x[rng_below(n)] = 0.0f, x[rng_below(n)] = -0.0f;
        break;
    case TOPK_LEVELS:
        for (int64_t i = 0; i < n; i++)
            x[i] = (float)(int)((x[i] + 20.0f) / 40.0f * (float)param);
        break;
    case TOPK_ALL_EQUAL:
        for (int64_t i = 0; i < n; i++)
            x[i] = 1.5f;
        break;
    case TOPK_MAX_COPIES:
        for (int j = 0; j < param; j++)
            x[rng_below(n)] = 30.0f;
        break;
    case TOPK_AT_THRESHOLD:
        for (int64_t lo = 0; lo < n; lo += chunk) {
            const int64_t len = n - lo < chunk ? n - lo : chunk;
            x[lo + rng_below(len)] = 5.0f, x[lo + rng_below(len)] = 5.0f;
        }
        for (int j = 0; j < param; j++)
            x[rng_below(n)] = rng_uniform(6.0f, 10.0f);
        break;
    case TOPK_NEG_INF:
        for (int64_t i = 0; i < n; i++)
            x[i] = -INFINITY;
        for (int j = 0; j < param; j++)
            x[rng_below(n)] = rng_uniform(-20.0f, 20.0f);
        break;
    case TOPK_NAN:
        for (int64_t i = 0; i < n; i++)
            if (rng_below(n) < param)
                x[i] = i % 2 ? NAN : -NAN;
        break;
    case TOPK_HOT_CHUNKS:
        for (int j = 0; j < param; j++) {
            const int64_t lo = (3 + 5 * j) * chunk;
            for (int64_t i = lo; i < lo + chunk && i < n; i++)
                x[i] = rng_uniform(21.0f, 40.0f);
        }
        break;
    }
}

/* fitm_ops_topk's order, written again: whether (v, i) comes before (w, j). */
static bool topk_before(float v, int64_t i, float w, int64_t j)
{
    if (w != w)
        return v == v || i < j;
    return v > w || (v == w && i < j);
}

/* The number of candidates kernels/topk.cu's stage 2 collects from a row longer than
 * FITM_CUDA_TOPK_CAP, by its definition: T the k-th of the chunks' first entries, the count
 * the entries that are T or come before it. */
static int64_t topk_candidates(const float *x, int64_t n, int32_t k)
{
    const int64_t chunk = topk_chunk(n);
    int64_t first[FITM_CUDA_TOPK_CHUNKS] = {0};
    int c = 0;
    for (int64_t lo = 0; lo < n; lo += chunk) {
        int64_t b = lo;
        for (int64_t i = lo + 1; i < lo + chunk && i < n; i++)
            if (topk_before(x[i], i, x[b], b))
                b = i;
        int j = c++;
        for (; j > 0 && topk_before(x[b], b, x[first[j - 1]], first[j - 1]); j--)
            first[j] = first[j - 1];
        first[j] = b;
    }
    const int64_t t = first[k - 1];
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        count += i == t || topk_before(x[i], i, x[t], t);
    return count;
}

/* rows of n values (row stride ld >= n) filled as fill says; the kernel's list must equal the
 * reference's bit for bit, values and indices, and for rows cut in chunks each row's candidate
 * count (the scratch's first rows int32, kernels.h) must equal topk_candidates'. fallback: 1
 * every row must exceed FITM_CUDA_TOPK_CAP (so the fallback selected it), 0 none may. */
static void test_topk(int64_t rows, int64_t n, int64_t ld, int32_t k, topk_fill fill, int param,
                      int fallback)
{
    char what[128];
    snprintf(what, sizeof what, "topk rows=%lld n=%lld ld=%lld k=%d %s %d", (long long)rows,
             (long long)n, (long long)ld, (int)k, topk_fill_name[fill], param);
    float *x = xmalloc((size_t)(rows * ld) * sizeof *x);
    for (int64_t r = 0; r < rows; r++)
        topk_fill_row(x + r * ld, n, ld, fill, param);
    fitm_top *ref = xmalloc((size_t)(rows * k) * sizeof *ref);
    for (int64_t r = 0; r < rows; r++)
        fitm_ops_topk(x + r * ld, n, k, ref + r * k);
    dbuf dx = dbuf_from(x, (size_t)(rows * ld) * sizeof *x);
    dbuf dv = dbuf_new((size_t)(rows * k) * sizeof(float));
    dbuf di = dbuf_new((size_t)(rows * k) * sizeof(int32_t));
    dbuf ds = dbuf_new(fitm_cuda_topk_scratch(rows, n, k) + 1);
    bool ok = launched(what, fitm_cuda_topk(dx.p, rows, n, ld, k, ds.p, dv.p, di.p, stream));
    float *gv = xmalloc(dv.bytes);
    int32_t *gi = xmalloc(di.bytes);
    dbuf_get(gv, &dv);
    dbuf_get(gi, &di);
    int64_t bad = 0, over = 0;
    for (int64_t i = 0; ok && i < rows * k; i++) {
        if (memcmp(&gv[i], &ref[i].logit, sizeof(float)) == 0 && gi[i] == ref[i].id)
            continue;
        if (bad++ < MAX_REPORT)
            fprintf(stderr, "  %s: [%lld] ref (%.9g, %d) got (%.9g, %d)\n", what, (long long)i,
                    (double)ref[i].logit, (int)ref[i].id, (double)gv[i], (int)gi[i]);
    }
    if (ok && n > FITM_CUDA_TOPK_CAP) {
        int32_t *cnt = xmalloc((size_t)rows * sizeof *cnt);
        CUDA_OK(cudaMemcpy(cnt, ds.p, (size_t)rows * sizeof *cnt, cudaMemcpyDeviceToHost));
        for (int64_t r = 0; r < rows; r++) {
            const int64_t want = topk_candidates(x + r * ld, n, k);
            over += want > FITM_CUDA_TOPK_CAP;
            if (cnt[r] != want && bad++ < MAX_REPORT)
                fprintf(stderr, "  %s: row %lld collected %d candidates, want %lld\n", what,
                        (long long)r, (int)cnt[r], (long long)want);
        }
        free(cnt);
    }
    if (ok && over != (fallback ? rows : 0)) {
        fprintf(stderr, "  %s: %lld of %lld rows above the candidate list's %d, want %s\n", what,
                (long long)over, (long long)rows, FITM_CUDA_TOPK_CAP, fallback ? "all" : "none");
        bad++;
    }
    ok = ok && bad == 0;
    ok = values_and_guards_ok(ok, &dv, what) && dbuf_guards_ok(&di, what) &&
         dbuf_guards_ok(&ds, what);
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok, "%s", what);
    dbuf_free(&dx), dbuf_free(&dv), dbuf_free(&di), dbuf_free(&ds);
    free(x), free(ref), free(gv), free(gi);
}

/* ---- logprob: against fitm_ops_logprob within the kernel's bound ---- */

/* rows of n values in [-spread, spread], n_pick ids per row with 0 and n - 1 among them; each
 * value within (2n + 8) 2^-53 + 2^-50 (|lp| + ln n) of the host's (kernels.h), and no write
 * outside lp (its guards). */
static void test_logprob(int64_t rows, int64_t n, int32_t n_pick, float spread)
{
    char what[96];
    snprintf(what, sizeof what, "logprob rows=%lld n=%lld picks=%d spread=%g", (long long)rows,
             (long long)n, (int)n_pick, (double)spread);
    float *x = xmalloc((size_t)(rows * n) * sizeof *x);
    fill_uniform(x, rows * n, -spread, spread);
    int32_t *pick = xmalloc((size_t)(rows * n_pick) * sizeof *pick);
    for (int64_t i = 0; i < rows * n_pick; i++)
        pick[i] = i % n_pick == 0 ? 0 : i % n_pick == 1 ? (int32_t)(n - 1)
                                                         : (int32_t)((i * 7919) % n);
    double *ref = xmalloc((size_t)(rows * n_pick) * sizeof *ref);
    for (int64_t r = 0; r < rows; r++)
        fitm_ops_logprob(x + r * n, n, pick + r * n_pick, n_pick, ref + r * n_pick);
    dbuf dx = dbuf_from(x, (size_t)(rows * n) * sizeof *x);
    dbuf dp = dbuf_from(pick, (size_t)(rows * n_pick) * sizeof *pick);
    dbuf dl = dbuf_new((size_t)(rows * n_pick) * sizeof(double));
    bool ok = launched(what, fitm_cuda_logprob(dx.p, rows, n, dp.p, n_pick, dl.p, stream));
    double *got = xmalloc(dl.bytes);
    dbuf_get(got, &dl);
    int64_t bad = 0;
    for (int64_t i = 0; ok && i < rows * n_pick; i++) {
        const double tol = (2.0 * (double)n + 8.0) * 0x1p-53 +
                           0x1p-50 * (fabs(ref[i]) + log((double)n));
        if (fabs(got[i] - ref[i]) <= tol)
            continue;
        if (bad++ < MAX_REPORT)
            fprintf(stderr, "  %s: [%lld] ref %.17g got %.17g\n", what, (long long)i, ref[i],
                    got[i]);
    }
    ok = ok && bad == 0;
    ok = dbuf_guards_ok(&dl, what) && ok;
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok, "%s", what);
    dbuf_free(&dx), dbuf_free(&dp), dbuf_free(&dl);
    free(x), free(pick), free(ref), free(got);
}

/* ---- bfloat16 ---- */

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bfloat16 of f by the definition, not by bit tricks: bfloat16 keeps float's exponent range
 * and 8 significant bits, so a value of exponent e (f = m 2^e, m in [0.5, 1)) is a multiple of
 * 2^(e - 8), and below the normal range of 2^-133; f / quantum rounded to the nearest integer,
 * ties to even (rint in the default rounding mode), times the quantum, and a magnitude of
 * 2^128 or more is infinite. NaN is any NaN (the caller checks NaN-ness alone). */
static uint16_t bf16_by_definition(float f)
{
    if (isnan(f))
        return 0x7fc0;
    if (isinf(f) || f == 0.0f)
        return (uint16_t)(f2u(f) >> 16);
    int e = 0;
    frexp(f, &e);
    const int q = e - 8 < -133 ? -133 : e - 8;
    const double v = ldexp(rint(ldexp((double)f, -q)), q);
    const float r = fabs(v) > FLT_MAX ? copysignf(INFINITY, f) : (float)v;
    return (uint16_t)(f2u(r) >> 16);
}

/* Values that test the rounding: exact ties with an even and an odd last kept bit (must stay
 * and must round up), one unit below and above each tie, values already bfloat16, the largest
 * finite ones (rounding to infinity at the tie), subnormals, signed zeros, infinities, NaN;
 * then uniform random values over many magnitudes and random bit patterns. */
static void fill_bf16_cases(float *x, int64_t n)
{
    static const uint32_t fixed[] = {
        0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x3f818001u, 0x3f817fffu,
        0xbf808000u, 0xbf818000u, 0x3f800000u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu,
        0xff7f8000u, 0x00008000u, 0x00018000u, 0x00000001u, 0x807fffffu, 0x00000000u,
        0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xff812345u, 0x7f7f0000u,
    };
    const int64_t nf = (int64_t)(sizeof fixed / sizeof fixed[0]);
    for (int64_t i = 0; i < n; i++) {
        if (i < nf) {
            x[i] = u2f(fixed[i]);
        } else if (i % 3 == 0) { /* random bits: every exponent, NaN and inf now and then */
            x[i] = u2f((uint32_t)(rng_u64() >> 32));
        } else if (i % 3 == 1) { /* a tie of a random value */
            x[i] = u2f((f2u(rng_uniform(-8.0f, 8.0f)) & 0xffff0000u) | 0x8000u);
        } else {
            x[i] = ldexpf(rng_uniform(-1.0f, 1.0f), (int)(rng_u64() % 80) - 40);
        }
    }
}

/* fitm_cuda_to_bf16 on (rows, n), starting off floats into its buffer (rows of a call start
 * anywhere in the activations), into (rows_out, n): every element bit for bit the definition
 * (NaN for NaN), the padding rows +0, nothing outside the output written. */
static void test_to_bf16(int64_t rows, int64_t n, int64_t rows_out, int64_t off)
{
    char what[96];
    snprintf(what, sizeof what, "to_bf16 %lldx%lld -> %lld rows (+%lld)", (long long)rows,
             (long long)n, (long long)rows_out, (long long)off);
    const int64_t ni = rows * n, no = rows_out * n;
    float *x = xmalloc((size_t)(ni + off) * sizeof(float));
    uint16_t *got = xmalloc((size_t)no * sizeof(uint16_t));
    fill_bf16_cases(x + off, ni);
    for (int64_t i = 0; i < off; i++)
        x[i] = 1.0f;
    dbuf dx = dbuf_from(x, (size_t)(ni + off) * sizeof(float));
    dbuf dy = dbuf_new((size_t)no * sizeof(uint16_t));
    bool ok =
        launched(what, fitm_cuda_to_bf16((float *)dx.p + off, rows, n, rows_out, dy.p, stream));
    x += off;
    int64_t bad = 0;
    if (ok) {
        dbuf_get(got, &dy);
        for (int64_t i = 0; i < no; i++) {
            const uint16_t want = i < ni ? bf16_by_definition(x[i]) : 0;
            const bool nan = i < ni && isnan(x[i]);
            const bool good = nan ? isnan(u2f((uint32_t)got[i] << 16)) : got[i] == want;
            if (!good && bad++ < MAX_REPORT)
                fprintf(stderr, "  %s: [%lld] x %.9g (0x%08x) want 0x%04x got 0x%04x\n", what,
                        (long long)i, i < ni ? (double)x[i] : 0.0, i < ni ? f2u(x[i]) : 0u, want,
                        got[i]);
        }
        ok = values_and_guards_ok(bad == 0, &dy, what);
    }
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok, "%s: %lld elements wrong", what, (long long)bad);
    dbuf_free(&dx), dbuf_free(&dy);
    free(x - off), free(got);
}

/* ---- the BATCH class's bfloat16 GEMM ---- */

/* Random bfloat16 bits of values spread over [-1, 1) times 2^[-4, 4). */
static void fill_bf16_weights(uint16_t *w, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        w[i] = bf16_by_definition(ldexpf(rng_uniform(-1.0f, 1.0f), (int)(rng_u64() % 8) - 4));
}

/* x (n) rounded to bfloat16 bits (bf16_by_definition): a product's activations as
 * fitm_cuda_to_bf16 hands them to fitm_cuda_gemm_bf16 */
static uint16_t *bf16_bits(const float *x, int64_t n)
{
    uint16_t *b = xmalloc((size_t)(n + 1) * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++)
        b[i] = bf16_by_definition(x[i]);
    return b;
}

/* fitm_cuda_gemm_bf16 with n outputs of N[i] rows each, K, T rows of x starting at element off
 * of their buffer (only 2-byte aligned when off is odd), in the shape it picks and in each of
 * its tile shapes (fitm_cuda_gemm_bf16_shape): every element against a double sum of the
 * bfloat16-rounded operands (x rounded by bf16_by_definition), within (2K + 4) 2^-24 of the
 * sum of |products| (each product of two bfloat16 values is exact in float; K additions in
 * float, in whatever order the tensor cores take, each lose at most 2^-24 of the partial sum,
 * itself at most that sum; twice for slack), outputs between guard bytes; and every shape's
 * bits those of the first (memcmp: a row's sum does not depend on its tile). */
static void test_gemm_bf16(int n, const int64_t *N, int64_t K, int64_t T, int64_t off)
{
    char what[128];
    snprintf(what, sizeof what, "gemm_bf16 %d outputs N %lld.. K %lld T %lld (+%lld)", n,
             (long long)N[0], (long long)K, (long long)T, (long long)off);
    float *x = xmalloc((size_t)(T * K + off + 1) * sizeof(float));
    for (int64_t i = 0; i < T * K + off; i++) /* activations of Gemma's range: up to 2^8 */
        x[i] = ldexpf(rng_uniform(-1.0f, 1.0f), (int)(rng_u64() % 12) - 4);
    uint16_t *xb = bf16_bits(x, T * K + off);
    dbuf dx = dbuf_from(xb, (size_t)(T * K + off) * sizeof(uint16_t));
    uint16_t *w[FITM_CUDA_MM_MAX_OUTS];
    float *ref[FITM_CUDA_MM_MAX_OUTS], *first[FITM_CUDA_MM_MAX_OUTS];
    double *tol[FITM_CUDA_MM_MAX_OUTS];
    dbuf dw[FITM_CUDA_MM_MAX_OUTS], dy[FITM_CUDA_MM_MAX_OUTS];
    const uint16_t *wd[FITM_CUDA_MM_MAX_OUTS];
    float *yd[FITM_CUDA_MM_MAX_OUTS];
    const float *xr = x + off;
    for (int i = 0; i < n; i++) {
        w[i] = xmalloc((size_t)(N[i] * K + 1) * sizeof(uint16_t));
        fill_bf16_weights(w[i], N[i] * K);
        dw[i] = dbuf_from(w[i], (size_t)(N[i] * K) * sizeof(uint16_t));
        dy[i] = dbuf_new((size_t)(T * N[i]) * sizeof(float));
        wd[i] = dw[i].p, yd[i] = dy[i].p;
        ref[i] = xmalloc((size_t)(T * N[i] + 1) * sizeof(float));
        first[i] = xmalloc((size_t)(T * N[i] + 1) * sizeof(float));
        tol[i] = xmalloc((size_t)(T * N[i] + 1) * sizeof(double));
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < N[i]; j++) {
                double sum = 0.0, mag = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    const double p =
                        (double)u2f((uint32_t)bf16_by_definition(xr[t * K + k]) << 16) *
                        (double)u2f((uint32_t)w[i][j * K + k] << 16);
                    sum += p;
                    mag += fabs(p);
                }
                ref[i][t * N[i] + j] = (float)sum;
                tol[i][t * N[i] + j] = (2.0 * (double)K + 4.0) * ldexp(1.0, -24) * mag;
            }
    }
    static const int shapes[] = {FITM_CUDA_GEMM_AUTO, FITM_CUDA_GEMM_64X32, FITM_CUDA_GEMM_64X64,
                                 FITM_CUDA_GEMM_128X128};
    static const char *const shape_names[] = {"its choice", "64x32", "64x64", "128x128"};
    bool ok = true;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0] && ok; sh++) {
        for (int i = 0; i < n; i++)
            CUDA_OK(cudaMemset(dy[i].p, 0xFF, dy[i].bytes));
        ok = launched(what, fitm_cuda_gemm_bf16_shape(shapes[sh], n, wd, N, K,
                                                      (const uint16_t *)dx.p + off, T, yd, stream));
        for (int i = 0; i < n && ok; i++) {
            float *got = xmalloc((size_t)(T * N[i] + 1) * sizeof(float));
            dbuf_get(got, &dy[i]);
            char out[192];
            snprintf(out, sizeof out, "%s y[%d], %s", what, i, shape_names[sh]);
            if (sh == 0)
                memcpy(first[i], got, (size_t)(T * N[i]) * sizeof(float));
            else if (memcmp(first[i], got, (size_t)(T * N[i]) * sizeof(float)) != 0) {
                fprintf(stderr, "  %s: not the bits of %s\n", out, shape_names[0]);
                ok = false;
            }
            ok = values_and_guards_ok(
                     check_close_tol(out, ref[i], got, T * N[i], 0.0, 0.0, tol[i]), &dy[i], out) &&
                 ok;
            CHECK(ok, "%s", out);
            free(got);
        }
    }
    for (int i = 0; i < n; i++) {
        dbuf_free(&dw[i]), dbuf_free(&dy[i]);
        free(w[i]), free(ref[i]), free(first[i]), free(tol[i]);
    }
    dbuf_free(&dx);
    free(x), free(xb);
}

/* Row invariance of fitm_cuda_gemm_bf16: the rows [r0, r0 + len) of a T-row call are bit for
 * bit those of a call of just those rows (x and y offset by r0 rows), for calls that start
 * anywhere in a tile, cross tiles, or hold one row: a row's result depends on nothing but its
 * row of x and the weight (the prefix-reuse promise; memcmp, so the device run checks it on
 * the tensor cores too). */
static void test_gemm_bf16_rows(int64_t N, int64_t K, int64_t T)
{
    char what[96];
    snprintf(what, sizeof what, "gemm_bf16 rows alike in calls of any size N %lld K %lld T %lld",
             (long long)N, (long long)K, (long long)T);
    float *x = xmalloc((size_t)(T * K) * sizeof(float));
    fill_uniform(x, T * K, -4.0f, 4.0f);
    uint16_t *w = xmalloc((size_t)(N * K) * sizeof(uint16_t));
    fill_bf16_weights(w, N * K);
    float *all = xmalloc((size_t)(T * N) * sizeof(float));
    float *part = xmalloc((size_t)(T * N) * sizeof(float));
    uint16_t *xb = bf16_bits(x, T * K);
    dbuf dx = dbuf_from(xb, (size_t)(T * K) * sizeof(uint16_t));
    dbuf dw = dbuf_from(w, (size_t)(N * K) * sizeof(uint16_t));
    dbuf dy = dbuf_new((size_t)(T * N) * sizeof(float));
    const uint16_t *wd = dw.p;
    float *yd = dy.p;
    bool ok = launched(what, fitm_cuda_gemm_bf16(1, &wd, &N, K, dx.p, T, &yd, stream));
    if (ok)
        dbuf_get(all, &dy);
    const int64_t calls[][2] = {{0, 1},  {T - 1, 1}, {5, 7},
                                {60, 9}, {1, T - 1}, {T / 2, T - T / 2}};
    int64_t bad = 0;
    for (size_t c = 0; ok && c < sizeof calls / sizeof calls[0]; c++) {
        const int64_t r0 = calls[c][0], len = calls[c][1];
        CUDA_OK(cudaMemset(dy.p, 0xFF, dy.bytes));
        CUDA_OK(cudaDeviceSynchronize());
        float *yr = (float *)dy.p + r0 * N;
        ok = launched(what, fitm_cuda_gemm_bf16(1, &wd, &N, K, (const uint16_t *)dx.p + r0 * K, len,
                                                &yr, stream));
        if (!ok)
            break;
        dbuf_get(part, &dy);
        if (memcmp(part + r0 * N, all + r0 * N, (size_t)(len * N) * sizeof(float)) != 0 &&
            bad++ < MAX_REPORT)
            fprintf(stderr,
                    "  %s: rows [%lld, %lld) of a %lld-row call differ from those rows "
                    "alone\n",
                    what, (long long)r0, (long long)(r0 + len), (long long)T);
        for (int64_t i = 0; i < T * N && ok; i++) /* nothing outside the call's rows written */
            if ((i < r0 * N || i >= (r0 + len) * N) && f2u(part[i]) != 0xffffffffu) {
                fprintf(stderr, "  %s: element %lld outside rows [%lld, %lld) written\n", what,
                        (long long)i, (long long)r0, (long long)(r0 + len));
                bad++;
                break;
            }
    }
    ok = ok && bad == 0 && dbuf_guards_ok(&dy, what);
    printf("%-56s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok, "%s", what);
    dbuf_free(&dx), dbuf_free(&dw), dbuf_free(&dy);
    free(x), free(xb), free(w), free(all), free(part);
}

/* Host memory stands in for device pointers: every call here must be refused (or, for zero
 * sizes, accepted) before anything is launched. */
/* ---- attention: the tiled kernel against the one-block-per-(row, head) kernel ---- */

typedef struct {
    int64_t T, pos0, own_base, window;
    int32_t H, Hkv, D;
    int64_t i0, i1; /* the rows handed to the tiled kernel */
    bool intervene; /* an intervention from pos0 + i1 on: the tiled rows are below it */
} tile_case;

/* x rounded to bfloat16 (bf16_by_definition), as a float */
static float bf16_round(float x)
{
    return u2f((uint32_t)bf16_by_definition(x) << 16);
}

/* Double-precision attention of row i, head h (keys below own_base from kp, others from ko)
 * into out (T, H, D). bf16: Q, K and V rounded to bfloat16 first, as the tensor-core kernel
 * reads them, and tol (T, H, D) receives each element's bound for that kernel: its other
 * roundings are each probability to bfloat16, which moves a row's normalized weights by at
 * most 2^-8 of themselves, and the F32 sums of a score, at most D 2^-24 of its sum of |q k|, so
 * the bound is (2^-8 + 2.5 D 2^-24 max_j scale sum_d |q k|) sum_j w_j |v_j| + 1e-6. */
static void ref_attention_row(const tile_case *c, const float *q, const float *kp, const float *vp,
                              const float *ko, const float *vo, int64_t i, int32_t h, double *s,
                              float *out, bool bf16, double *tol)
{
    const int64_t D = c->D, HkvD = (int64_t)c->Hkv * D, p = c->pos0 + i;
    const int64_t v0 = c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
    const int32_t g = h / (c->H / c->Hkv);
    const float *qh = q + (i * c->H + h) * D;
    const double scale = 1.0 / sqrt((double)D);
    double mx = -INFINITY, z = 0.0, worst = 0.0;
    for (int64_t j = v0; j <= p; j++) {
        const float *k = (j < c->own_base ? kp + j * HkvD : ko + (j - c->own_base) * HkvD) + g * D;
        double d = 0.0, mag = 0.0;
        for (int64_t e = 0; e < D; e++) {
            const double t = bf16 ? (double)bf16_round(qh[e]) * bf16_round(k[e])
                                  : (double)qh[e] * k[e];
            d += t, mag += fabs(t);
        }
        s[j] = d * scale;
        worst = fmax(worst, mag * scale);
        mx = fmax(mx, s[j]);
    }
    for (int64_t j = v0; j <= p; j++)
        z += s[j] = exp(s[j] - mx);
    const double rel = ldexp(1.0, -8) + 2.5 * (double)D * ldexp(1.0, -24) * worst;
    for (int64_t e = 0; e < D; e++) {
        double o = 0.0, mag = 0.0;
        for (int64_t j = v0; j <= p; j++) {
            const float *v =
                (j < c->own_base ? vp + j * HkvD : vo + (j - c->own_base) * HkvD) + g * D;
            const double t = s[j] / z * (bf16 ? bf16_round(v[e]) : v[e]);
            o += t, mag += fabs(t);
        }
        out[(i * c->H + h) * D + e] = (float)o;
        if (tol)
            tol[(i * c->H + h) * D + e] = rel * mag + 1e-6;
    }
}

/* A tile case's fresh random data, host and device: queries, prefix and own K and V, and a
 * one-span intervention from row i1 on where the case asks for one; a, the call (out unset),
 * and what, the case's name for a kernel. */
typedef struct {
    float *qh, *kph, *vph, *koh, *voh;
    dbuf q, kp, vp, ko, vo, spans, alpha;
    fitm_cuda_attn a;
    char what[160];
} tile_data;

static void tile_data_make(tile_data *t, const tile_case *c, const char *kernel)
{
    const int64_t T = c->T, D = c->D, HD = (int64_t)c->H * D, HkvD = (int64_t)c->Hkv * D;
    const int64_t n_keys = c->pos0 + T, own_rows = n_keys - c->own_base;
    const int64_t n_pre = c->own_base > 0 ? c->own_base * HkvD : 1;
    t->qh = xmalloc((size_t)(T * HD) * sizeof(float));
    t->kph = xmalloc((size_t)n_pre * sizeof(float)), t->vph = xmalloc((size_t)n_pre * 4);
    t->koh = xmalloc((size_t)(own_rows * HkvD) * sizeof(float));
    t->voh = xmalloc((size_t)(own_rows * HkvD) * sizeof(float));
    fill_uniform(t->qh, T * HD, -1.5f, 1.5f);
    fill_uniform(t->kph, n_pre, -1.5f, 1.5f);
    fill_uniform(t->vph, n_pre, -1.0f, 1.0f);
    fill_uniform(t->koh, own_rows * HkvD, -1.5f, 1.5f);
    fill_uniform(t->voh, own_rows * HkvD, -1.0f, 1.0f);
    t->q = dbuf_from(t->qh, (size_t)(T * HD) * sizeof(float));
    t->kp = dbuf_from(t->kph, (size_t)n_pre * sizeof(float));
    t->vp = dbuf_from(t->vph, (size_t)n_pre * sizeof(float));
    t->ko = dbuf_from(t->koh, (size_t)(own_rows * HkvD) * sizeof(float));
    t->vo = dbuf_from(t->voh, (size_t)(own_rows * HkvD) * sizeof(float));
    const int64_t spans_h[2] = {0, n_keys / 2};
    const float alpha_h = 1.0f;
    t->spans = dbuf_from(spans_h, sizeof spans_h);
    t->alpha = dbuf_from(&alpha_h, sizeof alpha_h);
    t->a = (fitm_cuda_attn){
        .T = T,
        .pos0 = c->pos0,
        .own_base = c->own_base,
        .window = c->window,
        .n_head = c->H,
        .n_head_kv = c->Hkv,
        .head_dim = c->D,
        .scale = 1.0f / sqrtf((float)D),
        .q = t->q.p,
        .k_pre = c->own_base > 0 ? t->kp.p : NULL,
        .v_pre = c->own_base > 0 ? t->vp.p : NULL,
        .k_own = t->ko.p,
        .v_own = t->vo.p,
    };
    if (c->intervene) {
        t->a.iv_spans = t->spans.p, t->a.iv_alpha = t->alpha.p, t->a.iv_n_spans = 1;
        t->a.iv_from_pos = c->pos0 + c->i1;
    }
    snprintf(t->what, sizeof t->what,
             "attention %s rows [%lld, %lld) of T %lld pos0 %lld own_base %lld window %lld "
             "H %d Hkv %d D %d%s",
             kernel, (long long)c->i0, (long long)c->i1, (long long)T, (long long)c->pos0,
             (long long)c->own_base, (long long)c->window, (int)c->H, (int)c->Hkv, (int)c->D,
             c->intervene ? " intervene" : "");
}

static void tile_data_free(tile_data *t)
{
    free(t->qh), free(t->kph), free(t->vph), free(t->koh), free(t->voh);
    dbuf_free(&t->q), dbuf_free(&t->kp), dbuf_free(&t->vp), dbuf_free(&t->ko), dbuf_free(&t->vo);
    dbuf_free(&t->spans), dbuf_free(&t->alpha);
}

/* True when elements [lo, lo + n) of two attention outputs (rows of H heads of D) are bit for
 * bit equal; else prints the first difference, labelled, under what. */
static bool attn_rows_same(const char *what, const char *label, const float *a, const float *b,
                           int64_t lo, int64_t n, int64_t HD, int64_t D)
{
    if (memcmp(a + lo, b + lo, (size_t)n * sizeof(float)) == 0)
        return true;
    for (int64_t e = 0; e < n; e++)
        if (memcmp(a + lo + e, b + lo + e, sizeof(float)) != 0) {
            fprintf(stderr, "  %s: %s at row %lld head %lld dim %lld: %.9g != %.9g\n", what, label,
                    (long long)((lo + e) / HD), (long long)((lo + e) % HD / D),
                    (long long)((lo + e) % D), (double)a[lo + e], (double)b[lo + e]);
            break;
        }
    return false;
}

/* True when every element of out (total) outside [lo, lo + n) keeps dbuf_new's all-ones bytes
 * (a NaN): the launch wrote no row outside its range. */
static bool attn_outside_untouched(const char *what, const float *out, int64_t total, int64_t lo,
                                   int64_t n)
{
    for (int64_t e = 0; e < total; e++)
        if ((e < lo || e >= lo + n) && !isnan(out[e])) {
            fprintf(stderr, "  %s: a row outside the range was written\n", what);
            return false;
        }
    return true;
}

/* fitm_cuda_attention_tiled on rows [i0, i1) of fresh random data: each row's output bit for
 * bit fitm_cuda_attention's (memcmp), the rows outside untouched, the guards intact, and both
 * within 1e-5 of a double reference. */
static void test_attention_tiled(const tile_case *c)
{
    const int64_t T = c->T, D = c->D, HD = (int64_t)c->H * D;
    const int64_t n_keys = c->pos0 + T;
    tile_data t;
    tile_data_make(&t, c, "tiled");
    const char *what = t.what;
    dbuf out_rows = dbuf_new((size_t)(T * HD) * sizeof(float));
    dbuf out_tiles = dbuf_new((size_t)(T * HD) * sizeof(float));
    fitm_cuda_attn a = t.a;
    a.out = out_rows.p;
    bool ok = launched(what, fitm_cuda_attention(&a, stream));
    a.out = out_tiles.p;
    ok = ok && launched(what, fitm_cuda_attention_tiled(&a, c->i0, c->i1, stream));
    float *rows = xmalloc((size_t)(T * HD) * sizeof(float));
    float *tiles = xmalloc((size_t)(T * HD) * sizeof(float));
    dbuf_get(rows, &out_rows);
    dbuf_get(tiles, &out_tiles);
    float *want = xmalloc((size_t)(T * HD) * sizeof(float));
    double *s = xmalloc((size_t)n_keys * sizeof(double));
    for (int64_t i = c->i0; i < c->i1; i++)
        for (int32_t h = 0; h < c->H; h++)
            ref_attention_row(c, t.qh, t.kph, t.vph, t.koh, t.voh, i, h, s, want, false, NULL);
    const int64_t lo = c->i0 * HD, n = (c->i1 - c->i0) * HD;
    const bool same = attn_rows_same(what, "first difference", rows, tiles, lo, n, HD, D);
    const bool untouched = attn_outside_untouched(what, tiles, T * HD, lo, n);
    printf("%-56s %s  bit for bit\n", what, same && untouched ? "ok  " : "FAIL");
    CHECK(ok && same && untouched, "%s", what);
    char w2[200];
    snprintf(w2, sizeof w2, "%s vs double", what);
    CHECK(values_and_guards_ok(check_close(w2, want + lo, tiles + lo, n, 1e-5, 1e-5), &out_tiles,
                               what),
          "%s", w2);
    CHECK(dbuf_guards_ok(&out_rows, what));
    free(rows), free(tiles), free(want), free(s);
    dbuf_free(&out_rows), dbuf_free(&out_tiles);
    tile_data_free(&t);
}

/* fitm_cuda_attention_bf16 on rows [i0, i1) of fresh random data:
 *   - within ref_attention_row's bound of its double reference over the bfloat16-rounded Q, K
 *     and V;
 *   - the rows outside untouched and the guards intact;
 *   - row invariance: the same rows as two launches split at a row that is not a tile's edge,
 *     and as a call that starts at row i0 (pos0 + i0, T - i0: other tiles, another first key
 *     block), bit for bit the first launch's. */
static void test_attention_bf16(const tile_case *c)
{
    const int64_t T = c->T, D = c->D, HD = (int64_t)c->H * D;
    const int64_t n_keys = c->pos0 + T;
    tile_data t;
    tile_data_make(&t, c, "bf16");
    const char *what = t.what;
    dbuf out1 = dbuf_new((size_t)(T * HD) * sizeof(float));
    dbuf out2 = dbuf_new((size_t)(T * HD) * sizeof(float));
    dbuf out3 = dbuf_new((size_t)(T * HD) * sizeof(float));
    fitm_cuda_attn a = t.a;
    a.out = out1.p;
    bool ok = launched(what, fitm_cuda_attention_bf16(&a, c->i0, c->i1, stream));
    const int64_t mid = c->i0 + (c->i1 - c->i0) / 2 + (c->i1 - c->i0 > 2 ? 1 : 0);
    a.out = out2.p;
    ok = ok && launched(what, fitm_cuda_attention_bf16(&a, c->i0, mid, stream)) &&
         launched(what, fitm_cuda_attention_bf16(&a, mid, c->i1, stream));
    fitm_cuda_attn b = a; /* the call from row i0 on */
    b.T = T - c->i0, b.pos0 = c->pos0 + c->i0;
    b.q = (const float *)t.q.p + c->i0 * HD, b.out = (float *)out3.p + c->i0 * HD;
    ok = ok && launched(what, fitm_cuda_attention_bf16(&b, 0, c->i1 - c->i0, stream));
    float *got[3];
    const dbuf *outs[3] = {&out1, &out2, &out3};
    for (int k = 0; k < 3; k++) {
        got[k] = xmalloc((size_t)(T * HD) * sizeof(float));
        dbuf_get(got[k], outs[k]);
    }
    const int64_t lo = c->i0 * HD, n = (c->i1 - c->i0) * HD;
    const bool same =
        attn_rows_same(what, "the split launch differs", got[0], got[1], lo, n, HD, D) &&
        attn_rows_same(what, "the call from row i0 differs", got[0], got[2], lo, n, HD, D);
    const bool untouched = attn_outside_untouched(what, got[0], T * HD, lo, n);
    printf("%-56s %s  rows alike\n", what, same && untouched ? "ok  " : "FAIL");
    CHECK(ok && same && untouched, "%s", what);

    /* the reference over the rounded operands, and each element's bound */
    float *want = xmalloc((size_t)(T * HD) * sizeof(float));
    double *tol = xmalloc((size_t)(T * HD) * sizeof(double));
    double *w = xmalloc((size_t)n_keys * sizeof(double));
    for (int64_t i = c->i0; i < c->i1; i++)
        for (int32_t h = 0; h < c->H; h++)
            ref_attention_row(c, t.qh, t.kph, t.vph, t.koh, t.voh, i, h, w, want, true, tol);
    char w2[200];
    snprintf(w2, sizeof w2, "%s vs double", what);
    CHECK(values_and_guards_ok(
              check_close_tol(w2, want + lo, got[0] + lo, n, 0.0, 0.0, tol + lo), &out1, what),
          "%s", w2);
    CHECK(dbuf_guards_ok(&out2, what) && dbuf_guards_ok(&out3, what));
    free(want), free(tol), free(w);
    for (int k = 0; k < 3; k++)
        free(got[k]);
    dbuf_free(&out1), dbuf_free(&out2), dbuf_free(&out3);
    tile_data_free(&t);
}

static void test_contracts(void)
{
    static _Alignas(16) uint8_t fake[4096];
    float *f = (float *)fake;
    const int inval = (int)cudaErrorInvalidValue;

    CHECK(!fitm_cuda_dequant_supported(FITM_DTYPE_Q8_K));
    CHECK(!fitm_cuda_dequant_supported((fitm_dtype)3));
    for (int i = 0; i < N_WEIGHT_TYPES; i++)
        CHECK(fitm_cuda_dequant_supported(weight_types[i]));

    CHECK(fitm_cuda_dequant_f32(FITM_DTYPE_Q8_K, fake, f, 256, NULL) == inval);
    {
        const uint16_t *w[4] = {(const uint16_t *)fake, (const uint16_t *)fake,
                                (const uint16_t *)fake, (const uint16_t *)fake};
        float *y[4] = {f, f, f, f};
        const int64_t N[4] = {8, 8, 8, 8};
        const uint16_t *x = (const uint16_t *)(fake + 2048);
        CHECK(fitm_cuda_gemm_bf16(0, w, N, 8, x, 2, y, NULL) == inval); /* no output */
        CHECK(fitm_cuda_gemm_bf16(4, w, N, 8, x, 2, y, NULL) == inval); /* over the maximum */
        CHECK(fitm_cuda_gemm_bf16(1, w, N, 8, (const uint16_t *)(fake + 2049), 2, y, NULL) ==
              inval); /* x at an odd byte */
        const uint16_t *w_odd[1] = {(const uint16_t *)(fake + 1)};
        CHECK(fitm_cuda_gemm_bf16(1, w_odd, N, 8, x, 2, y, NULL) == inval);
        float *y_odd[1] = {(float *)(fake + 2)};
        CHECK(fitm_cuda_gemm_bf16(1, w, N, 8, x, 2, y_odd, NULL) == inval);
        const int64_t N_neg[1] = {-1};
        CHECK(fitm_cuda_gemm_bf16(1, w, N_neg, 8, x, 2, y, NULL) == inval);
        CHECK(fitm_cuda_gemm_bf16(1, w, N, 8, NULL, 2, y, NULL) == inval);
        CHECK(fitm_cuda_gemm_bf16(1, w, N, -1, x, 2, y, NULL) == inval);
        CHECK(fitm_cuda_gemm_bf16(1, w, N, 8, x, 0, y, NULL) == 0); /* no rows: nothing */
        CHECK(fitm_cuda_gemm_bf16_shape(-1, 1, w, N, 8, x, 2, y, NULL) == inval); /* no shape */
        CHECK(fitm_cuda_gemm_bf16_shape(FITM_CUDA_GEMM_128X128 + 1, 1, w, N, 8, x, 2, y, NULL) ==
              inval);
    }
    {
        fitm_cuda_kv_rows r[FITM_CUDA_KV_ROWS_MAX + 1];
        for (int i = 0; i <= FITM_CUDA_KV_ROWS_MAX; i++)
            r[i] = (fitm_cuda_kv_rows){fake, fake + 1024, f + 512, f + 768, 8, 0};
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, 0, NULL) == inval);
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, FITM_CUDA_KV_ROWS_MAX + 1, NULL) == inval);
        CHECK(fitm_cuda_kv_store_many(NULL, (const fitm_cuda_kv_rows *)fake, 1, NULL) == inval);
        CHECK(fitm_cuda_kv_store_many(r, NULL, 1, NULL) == inval);
        r[1].n = -1;
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, 2, NULL) == inval);
        r[1].n = 8, r[1].v = NULL;
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, 2, NULL) == inval);
        r[1].v = f + 768, r[1].k_dst = fake + 2; /* an F32 row at a 2-byte offset */
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, 2, NULL) == inval);
        r[1].half = 1; /* fine for fp16 */
        r[1].n = r[0].n = 0;
        CHECK(fitm_cuda_kv_store_many(r, (const fitm_cuda_kv_rows *)fake, 2, NULL) == 0); /* nothing to store: nothing */
    }
    CHECK(fitm_cuda_dequant_f32(FITM_DTYPE_Q4_K, fake, f, 255, NULL) == inval);
    CHECK(fitm_cuda_dequant_f32(FITM_DTYPE_Q8_0, fake, f, 48, NULL) == inval);
    CHECK(fitm_cuda_dequant_f16(FITM_DTYPE_Q8_0, fake + 2, (uint16_t *)fake, 32, NULL) == inval);
    CHECK(fitm_cuda_dequant_f32(FITM_DTYPE_F16, NULL, f, 8, NULL) == inval);
    CHECK(fitm_cuda_dequant_f32(FITM_DTYPE_Q6_K, fake, f, 0, NULL) == 0);

    CHECK(fitm_cuda_matvec(FITM_DTYPE_Q4_K, fake, 4, 128, f, f, NULL) == inval);
    CHECK(fitm_cuda_matvec(FITM_DTYPE_Q8_0, fake, 4, 32, f + 1, f, NULL) == inval);
    CHECK(fitm_cuda_matvec(FITM_DTYPE_Q8_K, fake, 4, 256, f, f, NULL) == inval);
    CHECK(fitm_cuda_matvec(FITM_DTYPE_F16, fake, -1, 8, f, f, NULL) == inval);
    CHECK(fitm_cuda_matvec(FITM_DTYPE_F16, fake, 0, 8, f, f, NULL) == 0);
    {
        const void *W3[3] = {fake, fake, NULL};
        const int64_t N3[3] = {4, 4, 4};
        float *y3[3] = {f, f, f};
        CHECK(fitm_cuda_matmul_rows_n(FITM_DTYPE_Q8_0, 4, W3, N3, 32, f, 1, y3, NULL) == inval);
        CHECK(fitm_cuda_matmul_rows_n(FITM_DTYPE_Q8_0, 3, W3, N3, 32, f, 1, y3, NULL) == inval);
        CHECK(fitm_cuda_matmul_rows_n(FITM_DTYPE_Q8_0, 2, W3, N3, 33, f, 1, y3, NULL) == inval);
        CHECK(fitm_cuda_matmul_rows_n(FITM_DTYPE_Q8_0, 2, W3, N3, 32, f, 0, y3, NULL) == 0);
    }
    CHECK(fitm_cuda_matmul_glu(FITM_DTYPE_Q8_0, fake, NULL, 4, 32, f, 1, 0, f, NULL) == inval);
    CHECK(fitm_cuda_matmul_glu(FITM_DTYPE_Q8_0, fake, fake + 2, 4, 32, f, 1, 0, f, NULL) == inval);
    CHECK(fitm_cuda_matmul_glu(FITM_DTYPE_Q8_0, fake, fake, 4, 32, f, 0, 1, f, NULL) == 0);

    CHECK(fitm_cuda_rmsnorm(f, f, NULL, 0.0f, 1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_rmsnorm(f, f, f, 0.0f, -1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_rmsnorm(f, f, f, 0.0f, 0, 8, 1e-6f, NULL) == 0);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, f, f, f, NULL, 0.0f, 1, 0, 1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, NULL, f, f, f, 0.0f, 1, 0, 1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(NULL, f, f, f, f, f, 0.0f, 1, 0, 1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, f, f, f, f, 0.0f, -1, 0, 0, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, f, f, f, f, 0.0f, 2, 1, 2, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, f, f, f, f, 0.0f, 2, -1, 1, 8, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_norm_add_rmsnorm(f, f, f, f, f, f, 0.0f, 0, 0, 0, 8, 1e-6f, NULL) == 0);
    CHECK(fitm_cuda_softmax_rows(f, 2, 8, 7, NULL) == inval);
    CHECK(fitm_cuda_softmax_rows(f, 0, 8, 8, NULL) == 0);
    CHECK(fitm_cuda_rope(f, 1, 2, 8, 16, 7, NULL, 0, 1e4f, 1, 0, NULL) == inval);  /* odd n_rot */
    CHECK(fitm_cuda_rope(f, 1, 2, 8, 16, 10, NULL, 0, 1e4f, 1, 0, NULL) == inval); /* > D */
    CHECK(fitm_cuda_rope(f, 1, 2, 8, 15, 8, NULL, 0, 1e4f, 1, 0, NULL) == inval);  /* ld < H*D */
    CHECK(fitm_cuda_rope(f, 0, 2, 8, 16, 8, NULL, 0, 1e4f, 1, 0, NULL) == 0);
    CHECK(fitm_cuda_qk_norm_rope(f, f, NULL, NULL, 0, 1, 2, 1, 8, 7, f, 0, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_qk_norm_rope(f, f, NULL, NULL, 0, 1, 2, 1, 8, 10, f, 0, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_qk_norm_rope(f, f, f, f, 0, 1, 2, 1, 8, 8, NULL, 0, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_qk_norm_rope(NULL, f, f, f, 0, 1, 2, 1, 8, 8, f, 0, 1e-6f, NULL) == inval);
    CHECK(fitm_cuda_qk_norm_rope(f, f, f, f, 0, 0, 2, 1, 8, 8, f, 0, 1e-6f, NULL) == 0);
    CHECK(fitm_cuda_swiglu(f, NULL, f, 8, NULL) == inval);
    CHECK(fitm_cuda_geglu(f, f, f, -1, NULL) == inval);
    CHECK(fitm_cuda_geglu(f, f, f, 0, NULL) == 0);
    float *v = f + 512;
    int32_t *id = (int32_t *)(fake + 3072);
    CHECK(fitm_cuda_topk(f, 1, 8, 8, 0, NULL, v, id, NULL) == inval);       /* k 0 */
    CHECK(fitm_cuda_topk(f, 1, 8, 8, 9, NULL, v, id, NULL) == inval);       /* k > n */
    CHECK(fitm_cuda_topk(f, 1, 100, 100, 65, NULL, v, id, NULL) == inval);  /* k > 64 */
    CHECK(fitm_cuda_topk(f, 2, 8, 7, 1, NULL, v, id, NULL) == inval);       /* ld < n */
    CHECK(fitm_cuda_topk(f, 1, 9000, 9000, 1, NULL, v, id, NULL) == inval); /* no scratch */
    CHECK(fitm_cuda_topk(f, 0, 8, 8, 1, NULL, v, id, NULL) == 0);
    CHECK(fitm_cuda_topk_scratch(1, FITM_CUDA_TOPK_CAP, 64) == 0);
    CHECK(fitm_cuda_topk_scratch(2, FITM_CUDA_TOPK_CAP + 1, 64) > 2 * FITM_CUDA_TOPK_CAP * 8);
    double *lp = (double *)(fake + 3584);
    CHECK(fitm_cuda_logprob(f, 1, 8, id, 0, lp, NULL) == inval);                  /* no picks */
    CHECK(fitm_cuda_logprob(f, 1, 8, id, FITM_CUDA_PICK_MAX + 1, lp, NULL) == inval);
    CHECK(fitm_cuda_logprob(f, 1, 0, id, 1, lp, NULL) == inval);                  /* n 0 */
    CHECK(fitm_cuda_logprob(f, 1, 8, NULL, 1, lp, NULL) == inval);
    CHECK(fitm_cuda_logprob(f, 0, 8, id, 1, lp, NULL) == 0);
    uint16_t *b16 = (uint16_t *)(fake + 2048);
    CHECK(fitm_cuda_to_bf16(f, 3, 8, 2, b16, NULL) == inval); /* rows_out < rows */
    CHECK(fitm_cuda_to_bf16((float *)(fake + 2), 1, 8, 1, b16, NULL) == inval); /* x: 2 bytes */
    CHECK(fitm_cuda_to_bf16(f, 1, 8, 1, (uint16_t *)(fake + 2049), NULL) == inval);
    CHECK(fitm_cuda_to_bf16(NULL, 1, 8, 1, b16, NULL) == inval);
    CHECK(fitm_cuda_to_bf16(f, -1, 8, 1, b16, NULL) == inval);
    CHECK(fitm_cuda_to_bf16(f, 0, 8, 0, b16, NULL) == 0);
    {
        /* the tiled and the tensor-core attention take plain rows only, within the call */
        int (*const plain[2])(const fitm_cuda_attn *, int64_t, int64_t, void *) = {
            fitm_cuda_attention_tiled, fitm_cuda_attention_bf16};
        const fitm_cuda_attn at = {.T = 4,
                                   .n_head = 4,
                                   .n_head_kv = 1,
                                   .head_dim = 8,
                                   .q = f,
                                   .out = f,
                                   .k_own = f,
                                   .v_own = f};
        CHECK(fitm_cuda_attention_rows(&at, -1, 2, NULL) == inval);
        for (int k = 0; k < 2; k++) {
            fitm_cuda_attn bad = at;
            CHECK(plain[k](&at, 2, 5, NULL) == inval); /* past T */
            CHECK(plain[k](&at, 3, 2, NULL) == inval);
            CHECK(plain[k](&at, 2, 2, NULL) == 0);
            bad.cap_index = id; /* a capture */
            CHECK(plain[k](&bad, 0, 4, NULL) == inval);
            bad = at; /* a mixture */
            bad.mix_n = 1, bad.mix_k_heads = 1, bad.mix_q = bad.mix_k = bad.mix_w = f;
            CHECK(plain[k](&bad, 0, 4, NULL) == inval);
            bad = at; /* an intervention from row 2: rows [0, 2) only */
            bad.iv_n_spans = 1, bad.iv_spans = (const int64_t *)fake, bad.iv_alpha = f;
            bad.iv_from_pos = 2;
            CHECK(plain[k](&bad, 0, 3, NULL) == inval);
            CHECK(plain[k](&bad, 0, 0, NULL) == 0);
            bad = at; /* a head dim past 256 */
            bad.head_dim = 257;
            CHECK(plain[k](&bad, 0, 4, NULL) == inval);
        }
        CHECK(fitm_cuda_attention_tile_rows(4, 1) == 4);
        CHECK(fitm_cuda_attention_tile_rows(2, 2) == 16);
        CHECK(fitm_cuda_attention_tile_rows(64, 2) == 1);
        CHECK(fitm_cuda_attention_tile_rows(4, 3) == 0);
    }

    fitm_err err;
    strcpy(err.msg, "untouched");
    CHECK(fitm_cuda_status(0, &err, "x") == FITM_OK);
    CHECK(strcmp(err.msg, "untouched") == 0);
    CHECK(fitm_cuda_status((int)cudaErrorMemoryAllocation, &err, "upload") == FITM_ERR_NOMEM);
    CHECK(strncmp(err.msg, "upload: cudaErrorMemoryAllocation", 33) == 0);
    CHECK(fitm_cuda_status(inval, NULL, NULL) == FITM_ERR_INVALID);
    CHECK(fitm_cuda_status((int)cudaErrorIllegalAddress, &err, NULL) == FITM_ERR_BACKEND);
    CHECK(strncmp(err.msg, "cudaErrorIllegalAddress", 23) == 0);
    CHECK(fitm_cuda_error_is_sticky((int)cudaErrorIllegalAddress));
    CHECK(!fitm_cuda_error_is_sticky((int)cudaErrorMemoryAllocation));
    CHECK(!fitm_cuda_error_is_sticky(0));
}

/* ---- tapes (kernels.h): a stream's work recorded, matched and held back ---- */

/* The work the tape test records: y += x, y = softcap(y, c1), z = y (a copy), z = softcap(z,
 * c2), z[0..3] = 0 (a memset). */
static void tape_work(float *y, const float *x, float *z, int64_t n, float c1, float c2)
{
    CHECK(fitm_cuda_add(y, x, n, stream) == 0);
    CHECK(fitm_cuda_softcap(y, n, c1, stream) == 0);
    CHECK(fitm_cuda_copy_async(z, y, (size_t)n * 4, cudaMemcpyDeviceToDevice, stream) == 0);
    CHECK(fitm_cuda_softcap(z, n, c2, stream) == 0);
    CHECK(fitm_cuda_memset_async(z, 0, 16, stream) == 0);
}

/* Whether y and z on the device hold want_y and want_z bit for bit. */
static bool tape_holds(const dbuf *y, const dbuf *z, const float *want_y, const float *want_z,
                       int64_t n)
{
    float *gy = xmalloc((size_t)n * 4), *gz = xmalloc((size_t)n * 4);
    CUDA_OK(cudaStreamSynchronize(stream));
    dbuf_get(gy, y);
    dbuf_get(gz, z);
    const bool same =
        memcmp(gy, want_y, (size_t)n * 4) == 0 && memcmp(gz, want_z, (size_t)n * 4) == 0;
    free(gy);
    free(gz);
    return same;
}

/* On fresh random rows: the work run with no tape gives the reference bits. Recorded, it runs
 * as usual (the same bits) and leaves 5 items on the tape. The same work again, expected
 * against that tape, is held back (y and z unchanged) and matched, and running the tape then
 * gives the reference bits: what a replay does. The work with the first softcap's cap
 * changed (its second item's argument bytes: grid, block and kernel the same) is held back
 * and not matched; unwound, its tape holds all 5 items (the add matched, then the rest), and
 * running it gives the bits of that work run directly. Work whose first item differs from
 * every candidate's is held back whole, too. */
static void test_tape(int64_t n)
{
    float *x = xmalloc((size_t)n * 4), *y0 = xmalloc((size_t)n * 4);
    float *ry = xmalloc((size_t)n * 4), *rz = xmalloc((size_t)n * 4);
    float *vy = xmalloc((size_t)n * 4), *vz = xmalloc((size_t)n * 4);
    fill_uniform(x, n, -4.0f, 4.0f);
    fill_uniform(y0, n, -4.0f, 4.0f);
    const float c1 = rng_uniform(1.0f, 3.0f), c2 = rng_uniform(1.0f, 3.0f), c1b = c1 * 1.5f;
    dbuf dx = dbuf_from(x, (size_t)n * 4), dy = dbuf_from(y0, (size_t)n * 4);
    dbuf dz = dbuf_new((size_t)n * 4);
    fitm_cuda_tape *rec = fitm_cuda_tape_create(), *held = fitm_cuda_tape_create();
    CHECK(rec && held);
    float *pz = dz.p, *py = dy.p;
    const float *px = dx.p;
    /* the references: the work and its variant, no tape */
    tape_work(py, px, pz, n, c1, c2);
    CUDA_OK(cudaStreamSynchronize(stream));
    dbuf_get(ry, &dy), dbuf_get(rz, &dz);
    CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
    tape_work(py, px, pz, n, c1b, c2);
    CUDA_OK(cudaStreamSynchronize(stream));
    dbuf_get(vy, &dy), dbuf_get(vz, &dz);
    CHECK(memcmp(ry, vy, (size_t)n * 4) != 0, "the variant's cap changes nothing");

    CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
    CHECK(fitm_cuda_tape_record(rec, stream));
    tape_work(py, px, pz, n, c1, c2);
    fitm_cuda_tape_stop(stream);
    CHECK(fitm_cuda_tape_length(rec) == 5, "%zu items recorded", fitm_cuda_tape_length(rec));
    CHECK(tape_holds(&dy, &dz, ry, rz, n), "recorded work: other bits than without a tape");

    CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(pz, vz, (size_t)n * 4, cudaMemcpyHostToDevice));
    CHECK(fitm_cuda_tape_expect(held, stream, &rec, 1));
    tape_work(py, px, pz, n, c1, c2);
    CHECK(fitm_cuda_tape_matched(stream) == 0, "the same work is not matched");
    fitm_cuda_tape_stop(stream);
    CHECK(tape_holds(&dy, &dz, y0, vz, n), "matched work ran");
    CHECK(fitm_cuda_tape_run(rec, stream) == 0);
    CHECK(tape_holds(&dy, &dz, ry, rz, n), "the tape run again: other bits than the work");

    for (int first = 0; first < 2; first++) { /* a difference in item 2, then in item 1 */
        CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(pz, rz, (size_t)n * 4, cudaMemcpyHostToDevice));
        CHECK(fitm_cuda_tape_expect(held, stream, &rec, 1));
        if (first) /* the add of another length: the first item differs */
            CHECK(fitm_cuda_add(py, px, n - 1, stream) == 0);
        tape_work(py, px, pz, n, c1b, c2);
        CHECK(fitm_cuda_tape_matched(stream) == -1, "work of another argument matched");
        fitm_cuda_tape_unwind(stream);
        CHECK(fitm_cuda_tape_length(held) == 5u + (size_t)first, "%zu items held back",
              fitm_cuda_tape_length(held));
        CHECK(tape_holds(&dy, &dz, y0, rz, n), "held-back work ran");
        if (first) { /* the reference of that: the extra add first */
            CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
            CHECK(fitm_cuda_add(py, px, n - 1, stream) == 0);
            tape_work(py, px, pz, n, c1b, c2);
            CUDA_OK(cudaStreamSynchronize(stream));
            dbuf_get(vy, &dy), dbuf_get(vz, &dz);
            CUDA_OK(cudaMemcpy(py, y0, (size_t)n * 4, cudaMemcpyHostToDevice));
        }
        CHECK(fitm_cuda_tape_run(held, stream) == 0);
        CHECK(tape_holds(&dy, &dz, vy, vz, n),
              "unwound work (difference in item %d): other bits than the work run directly",
              first ? 1 : 2);
    }
    fitm_cuda_tape_destroy(rec);
    fitm_cuda_tape_destroy(held);
    dbuf_free(&dx), dbuf_free(&dy), dbuf_free(&dz);
    free(x), free(y0), free(ry), free(rz), free(vy), free(vz);
}

/* The kernel groups to run: argv[1] as a comma-separated list of dequant, matvec, rmsnorm,
 * norm_add, softmax, rope, glu, topk, attention, logprob, bf16, gemm, kv_store, tape (the
 * ThreadSanitizer and mutant builds of tests/meson.build run a few), or every group without
 * an argument. With "small" in the list, the groups run only their shapes below about 10^4
 * elements and matvec only F32, Q8_0 and Q4_K (the ThreadSanitizer build, where each CUDA
 * thread is an OS thread, is ~10^3 times slower). */
static const char *groups;

static bool want(const char *group)
{
    if (!groups)
        return true;
    const size_t n = strlen(group);
    for (const char *p = groups; (p = strstr(p, group)) != NULL; p += n)
        if ((p == groups || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
            return true;
    return false;
}

int main(int argc, char **argv)
{
    groups = argc > 1 ? argv[1] : NULL;
    const bool small = groups && want("small");
    test_contracts();
    if (failures) {
        fprintf(stderr, "test_cuda_kernels: %d contract check(s) failed\n", failures);
        return 1;
    }
    if (fitm_cuda_device_count() == 0) {
        printf("test_cuda_kernels: contracts ok; no CUDA device, kernels skipped\n");
        return 77;
    }
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    /* the kernels launch as the backend launches them: programmatically where the device
     * passes the probe (sm_90 and later, and the emulator, which then checks that every
     * thread of every kernel begins with fitm_grid_begin) */
    const bool pdl = fitm_cuda_pdl_probe() == 1 && fitm_cuda_set_pdl(stream, true);
    printf("test_cuda_kernels: %s launches\n", pdl ? "programmatic" : "plain");

    for (int i = 0; i < N_WEIGHT_TYPES && want("dequant"); i++) {
        fitm_dtype t = weight_types[i];
        int64_t be = block_elems(t);
        test_dequant(t, 256 * 37, false);
        test_dequant(t, 256 * 37, true);
        if (be == 1) {
            test_dequant(t, 1001, false); /* any length, any alignment of the tail */
            test_dequant(t, 1, true);
        } else {
            test_dequant(t, be, true); /* a single block */
        }
    }

    for (int i = 0; i < N_WEIGHT_TYPES && want("matvec"); i++) {
        fitm_dtype t = weight_types[i];
        int64_t be = block_elems(t);
        bool quant = be > 1;
        if (small && t != FITM_DTYPE_F32 && t != FITM_DTYPE_Q8_0 && t != FITM_DTYPE_Q4_K)
            continue;
        test_matvec(t, 1, be > 1 ? be : 8, false);
        test_matvec(t, 37, 768, false);
        test_matmul_rows(t, 9, 256, 19); /* three groups of rows, the last partial */
        test_matmul_rows_n(t, 3, 256, 1);
        test_matmul_rows_n(t, 3, 256, 11);
        test_matmul_rows_n(t, 2, 256, 3);
        test_matmul_glu(t, 9, 256, 1, t == FITM_DTYPE_Q4_K);
        test_matmul_glu(t, 7, 256, 11, t != FITM_DTYPE_Q4_K); /* two groups, the last partial */
        if (small)
            continue;
        test_matvec(t, 130, 4096, false); /* N not a multiple of the rows per block */
        test_matvec(t, 4, 16384, false);  /* an FFN down projection's K */
        test_matmul_rows(t, 37, 768, 3);
        test_matmul_rows(t, 21, 512, 8);
        if (quant) {
            test_matvec(t, 37, 768, true);
            test_matvec(t, 9, 2560, true);
            /* an LM head's shape: several rows per warp, their blocks staged in passes that
             * end inside rows (K = 1024), the last warp's rows partial */
            test_matvec(t, 16387, 1024, false);
            test_matmul_rows(t, 16387, 256, 9);
            /* The block types' batched tiles (fitm_matvec_tiles) against the one-row kernel.
             * On the emulator (1 SM, 163 KiB of shared memory a block) a tile has 8, 16 or 32
             * rows of x for T up to 8, 16 or more, one block takes every group of rows, and x
             * is staged in slices when M rows of K do not fit: M = 32 from K = 1,184 on
             * (slices of 1,024), M = 16 from 2,480 (2,304), M = 8 from 4,960 (4,864). Rows
             * of W end inside a group of 32 (37 = 32 + 4 + 1: two warps of the second group
             * have rows, one partial); T at a tile's bounds (32; 33 and 40: a second tile of
             * 1 and of 8 rows); K sliced with a last slice of 256. */
            test_matmul_rows(t, 37, 256, 32);
            test_matmul_rows(t, 37, 512, 33);
            test_matmul_rows(t, 37, 256, 40);
            test_matmul_rows(t, 37, 1280, 32);  /* slices of 1,024 and 256 */
            test_matmul_rows(t, 21, 1280, 33);  /* the same, two tiles */
            test_matmul_rows(t, 13, 2560, 16);  /* M = 16: slices of 2,304 and 256 */
            test_matmul_rows(t, 6, 5120, 7);    /* M = 8: slices of 4,864 and 256 */
            test_matmul_rows_n(t, 3, 512, 33);  /* Q, K and V: groups of each weight */
            test_matmul_rows_n(t, 3, 1280, 32); /* sliced */
            test_matmul_glu(t, 37, 512, 33, t == FITM_DTYPE_Q5_0);
            test_matmul_glu(t, 21, 1280, 40, t != FITM_DTYPE_Q5_0); /* sliced, two tiles */
            test_matmul_glu(t, 9, 2560, 16, true);                  /* M = 16, sliced */
            /* LM heads' K (Gemma 3: 262,144 x 640 in Q5_0 or Q8_0) at 32 sequences and at a
             * tile's bounds, every group of 32 rows in one block (the emulator's one SM), 65
             * groups, the last one partial. The tiles take no other path for more rows (the
             * wide products' rows a warp are the one-row kernel's, above), so N is 2,051,
             * not an LM head's 16,384 or more, each row of which costs the emulator alike. */
            if (t == FITM_DTYPE_Q5_0)
                test_matmul_rows(t, 2051, 640, 32);
            if (t == FITM_DTYPE_Q8_0)
                test_matmul_rows(t, 2051, 640, 33);
            if (t == FITM_DTYPE_Q6_K)
                test_matmul_rows(t, 2051, 768, 40);
        } else {
            test_matvec(t, 13, 1001, false); /* K % 8 != 0: the per-element path */
            test_matvec(t, 3, 7, false);
            test_matmul_rows(t, 13, 1001, 10);
            test_matmul_glu(t, 5, 1001, 3, true); /* K % 8 != 0 */
            test_matmul_rows_n(t, 3, 1001, 2);
        }
    }

    if (want("rmsnorm")) {
        test_rmsnorm(3, 1000, 0.0f, 1e-6f, false);
        test_rmsnorm(17, 64, 1.0f, 1e-6f, false);
        test_rmsnorm(2, 33, 0.0f, 1e-5f, true);
        test_add_rmsnorm(3, 640, 0.0f, false);
        test_add_rmsnorm(5, 33, 1.0f, false);
        test_add_rmsnorm(2, 1000, 0.0f, true);
        if (!small) {
            test_rmsnorm(1, 4096, 0.0f, 1e-5f, false);
            test_rmsnorm(5, 5120, 0.0f, 1e-6f, true);
        }
    }

    if (want("norm_add")) {
        /* a decode step's row between layers, as the driver runs it: p in place, y apart */
        test_norm_add_rmsnorm(1, 640, 0.0f, true, false, 0, 1);
        test_norm_add_rmsnorm(5, 33, 1.0f, true, false, 0, 5); /* C below the block, odd */
        test_norm_add_rmsnorm(3, 1000, 0.0f, false, false, 0, 3);
        test_norm_add_rmsnorm(4, 257, 0.0f, true, true, 0, 4);
        test_norm_add_rmsnorm(2, 1001, 1.0f, false, true, 0, 2);
        test_norm_add_rmsnorm(9, 640, 0.0f, true, false, 0, 9);
        /* the final norm: a prompt's last row; the first of three sequences' rows; none */
        test_norm_add_rmsnorm(7, 640, 0.0f, true, false, 6, 1);
        test_norm_add_rmsnorm(3, 257, 0.0f, true, false, 0, 1);
        test_norm_add_rmsnorm(6, 33, 1.0f, false, true, 2, 3);
        test_norm_add_rmsnorm(2, 300, 0.0f, true, false, 1, 0);
        /* above the four elements a thread keeps in registers: the loop over memory */
        test_norm_add_rmsnorm(2, 2560, 0.0f, true, false, 0, 2);
        test_norm_add_rmsnorm(3, 1100, 1.0f, false, true, 1, 1);
    }

    if (want("softmax")) {
        test_softmax(1, 1, 1, false);
        test_softmax(3, 7, 9, false);
        test_softmax(5, 33, 40, true);
        test_softmax(4, 1000, 1000, true);
        test_softmax(2, 4097, 4100, false);
        if (!small)
            test_softmax(2, 50000, 50000, true);
    }

    if (want("rope")) {
        test_rope(5, 4, 64, 4 * 64, 64, 10000.0f, 1.0f, 0, true, 0);
        test_rope(5, 4, 64, 4 * 64 + 8, 64, 10000.0f, 1.0f, 1, true, 0);
        test_rope(7, 3, 128, 3 * 128 + 4, 64, 1000000.0f, 1.0f, 0, false,
                  37); /* partial rotation */
        test_rope(7, 3, 128, 3 * 128, 32, 1000000.0f, 1.0f, 1, false, 100000);
        test_rope(1, 2, 256, 2 * 256, 256, 10000.0f, 0.125f, 1, true,
                  5); /* Gemma 3: D 256, scaled */
        test_rope(64, 8, 128, 8 * 128, 128, 500000.0f, 1.0f, 1, false, 0);
        test_rope(9, 2, 64, 2 * 64 + 16, 64, 10000.0f, 0.25f, 0, true, 3);
        test_qk_norm_rope(3, 4, 1, 256, 256, 1, true); /* Gemma 3: D 256, per-head norms */
        test_qk_norm_rope(9, 4, 1, 256, 256, 1, true); /* two sequences' worth of rows */
        test_qk_norm_rope(2, 3, 3, 300, 128, 0, true); /* D above the block, partial rotation */
        test_qk_norm_rope(4, 6, 2, 64, 64, 0, false);  /* llama: rotation only */
        test_qk_norm_rope(5, 2, 1, 40, 32, 1, false);
    }

    if (want("glu")) {
        test_glu(false, 1, false);
        test_glu(false, 1000, false);
        test_glu(false, (1 << 20) + 3, false);
        test_glu(false, 4097, true);
        test_glu(true, 1, false);
        test_glu(true, 1000, false);
        test_glu(true, (1 << 20) + 3, false);
        test_glu(true, 4097, true);
    }

    if (want("topk")) {
        /* rows of at most FITM_CUDA_TOPK_CAP entries: one block sorts the whole row */
        test_topk(1, 1, 1, 1, TOPK_RANDOM, 0, 0);
        test_topk(1, 64, 64, 64, TOPK_RANDOM, 0, 0); /* k = n */
        test_topk(4, 300, 301, 1, TOPK_LEVELS, 2, 0); /* greedy over many equal maxima */
        test_topk(2, 777, 800, 33, TOPK_LEVELS, 6, 0);
        test_topk(2, 1500, 1507, 64, TOPK_NAN, 1480, 0); /* the list ends in NaNs */
        /* the three stages: chunks of 17 (the last partial), 40 and 1024 */
        test_topk(1, 4097, 4099, 64, TOPK_RANDOM, 0, 0);
        test_topk(1, 17000, 17000, 64, TOPK_ALL_EQUAL, 0, 1); /* 4222: the fallback */
        if (!small) {
            test_topk(1, 10000, 10000, 64, TOPK_ALL_EQUAL, 0, 0); /* 2521 candidates */
            test_topk(3, 4096, 4100, 64, TOPK_LEVELS, 3, 0);
            test_topk(33, 5003, 5010, 64, TOPK_RANDOM, 0, 0);
            test_topk(17, 9001, 9001, 63, TOPK_LEVELS, 40, 0);
            test_topk(3, 20000, 20001, 63, TOPK_AT_THRESHOLD, 30, 0);
            test_topk(2, 5000, 5000, 64, TOPK_NEG_INF, 10, 0);
            test_topk(1, 20000, 20000, 64, TOPK_NAN, 19990, 1);
            /* Gemma 3's vocabulary: 256 chunks of 1024 */
            test_topk(1, 262144, 262144, 1, TOPK_RANDOM, 0, 0);
            test_topk(2, 262144, 262150, 2, TOPK_RANDOM, 0, 0);
            test_topk(3, 262144, 262147, 63, TOPK_RANDOM, 0, 0);
            test_topk(1, 262144, 262144, 64, TOPK_RANDOM, 0, 0);
            test_topk(2, 262145, 262200, 64, TOPK_RANDOM, 0, 0); /* the last chunk 770 */
            test_topk(2, 262144, 262144, 64, TOPK_MAX_COPIES, 1000, 0);
            test_topk(1, 262144, 262144, 1, TOPK_MAX_COPIES, 1000, 0);
            test_topk(2, 262144, 262144, 64, TOPK_AT_THRESHOLD, 20, 0);
            test_topk(1, 262144, 262144, 64, TOPK_HOT_CHUNKS, 1, 0);
            test_topk(1, 262144, 262144, 64, TOPK_NAN, 100, 0);
            /* more candidates than the list holds */
            test_topk(2, 262144, 262144, 64, TOPK_ALL_EQUAL, 0, 1);
            test_topk(1, 262144, 262144, 1, TOPK_ALL_EQUAL, 0, 0); /* T the first entry */
            test_topk(1, 262144, 262144, 64, TOPK_NEG_INF, 10, 1);
            test_topk(1, 262144, 262144, 64, TOPK_HOT_CHUNKS, 6, 1);
        }
    }

    if (want("attention")) {
        static const tile_case tiles[] = {
            /* Gemma 3's heads (4 query heads on 1 KV head: 4 rows a block), the last block
             * partial, and a range starting inside the call */
            {.T = 37, .H = 4, .Hkv = 1, .D = 256, .i0 = 0, .i1 = 37},
            {.T = 37, .H = 4, .Hkv = 1, .D = 256, .i0 = 3, .i1 = 30},
            /* prefix rows and three 128-key tiles per row, a window of 260 (so each row's v0
             * differs inside a block, and its last 4-key tile may end in the same step as the
             * tile before), rows below an intervention */
            {.T = 21,
             .pos0 = 400,
             .own_base = 350,
             .window = 260,
             .H = 4,
             .Hkv = 1,
             .D = 72,
             .i0 = 0,
             .i1 = 13,
             .intervene = true},
            /* no GQA (16 rows a block), odd head dims, a prefix, a window inside the call */
            {.T = 35, .pos0 = 5, .own_base = 3, .H = 3, .Hkv = 3, .D = 40, .i0 = 0, .i1 = 35},
            {.T = 40,
             .pos0 = 150,
             .own_base = 150,
             .window = 19,
             .H = 2,
             .Hkv = 1,
             .D = 33,
             .i0 = 1,
             .i1 = 40},
            /* Llama 3.2 1B's head dims and groups (D 64: each half of the block's threads sums
             * 8 of the pairs), over a prefix */
            {.T = 33, .pos0 = 40, .own_base = 40, .H = 8, .Hkv = 2, .D = 64, .i0 = 0, .i1 = 33},
            /* 7 heads a group (pairs past the rows' heads idle), more heads than a block */
            {.T = 9, .pos0 = 2, .H = 14, .Hkv = 2, .D = 16, .i0 = 0, .i1 = 9},
            {.T = 5, .H = 32, .Hkv = 1, .D = 8, .i0 = 0, .i1 = 5},
            /* one row after 130 cached keys; D 256 without GQA (two dims a thread) */
            {.T = 1, .pos0 = 130, .own_base = 130, .H = 4, .Hkv = 1, .D = 256, .i0 = 0, .i1 = 1},
            {.T = 18,
             .pos0 = 120,
             .own_base = 100,
             .window = 64,
             .H = 2,
             .Hkv = 2,
             .D = 256,
             .i0 = 0,
             .i1 = 18},
            /* more keys than a block keeps the scores of (FITM_ATT_KEEP, 544): pass 2 computes
             * them again from a ring; then the window at the edge of keeping them (16 rows a
             * block: a block's keys 529 + 15 = 544, kept) and one key past it (545, a ring) */
            {.T = 7, .pos0 = 600, .own_base = 300, .H = 4, .Hkv = 1, .D = 256, .i0 = 0, .i1 = 7},
            {.T = 40,
             .pos0 = 520,
             .own_base = 520,
             .window = 529,
             .H = 2,
             .Hkv = 2,
             .D = 20,
             .i0 = 0,
             .i1 = 40},
            {.T = 40,
             .pos0 = 520,
             .own_base = 520,
             .window = 530,
             .H = 2,
             .Hkv = 2,
             .D = 20,
             .i0 = 0,
             .i1 = 40},
            /* D 128: the one-row kernel stages 64 keys' values a step, two a tile */
            {.T = 3, .pos0 = 200, .own_base = 150, .H = 4, .Hkv = 2, .D = 128, .i0 = 0, .i1 = 3},
            /* rows of more keys than a one-row block keeps the scores of (8,192): its later
             * passes compute them again from global memory */
            {.T = 2, .pos0 = 8300, .own_base = 8000, .H = 2, .Hkv = 1, .D = 16, .i0 = 0, .i1 = 2},
        };
        /* small: the ring of scores wrapping (565 keys, more than a block keeps the scores
         * of), a window cutting a block's rows */
        static const tile_case small_tiles[] = {
            {.T = 5, .pos0 = 560, .own_base = 550, .H = 4, .Hkv = 1, .D = 8, .i0 = 0, .i1 = 5},
            {.T = 9, .pos0 = 20, .window = 7, .H = 2, .Hkv = 2, .D = 12, .i0 = 1, .i1 = 9},
        };
        for (size_t i = 0; i < sizeof small_tiles / sizeof small_tiles[0]; i++)
            test_attention_tiled(&small_tiles[i]);
        for (size_t i = 0; i < sizeof tiles / sizeof tiles[0] && !small; i++)
            test_attention_tiled(&tiles[i]);
        /* the tensor-core kernel's own: head dims not whole float4s (element by element), a
         * window cutting a key block, 3 heads a group (30 of a tile's 32 pairs); 64 heads a
         * group (two chunks of 32); then 70 rows over two key blocks of 64 and 9 tiles of 8
         * rows */
        static const tile_case bf16_tiles[] = {
            {.T = 12, .pos0 = 130, .own_base = 100, .window = 70, .H = 3, .Hkv = 1, .D = 18,
             .i0 = 1, .i1 = 12},
            {.T = 3, .pos0 = 66, .own_base = 60, .H = 64, .Hkv = 1, .D = 16, .i0 = 0, .i1 = 3},
        };
        static const tile_case bf16_two_blocks = {.T = 70, .H = 4, .Hkv = 1, .D = 256, .i1 = 70};
        for (size_t i = 0; i < sizeof bf16_tiles / sizeof bf16_tiles[0]; i++)
            test_attention_bf16(&bf16_tiles[i]);
        if (!small)
            test_attention_bf16(&bf16_two_blocks);
        for (size_t i = 0; i < sizeof small_tiles / sizeof small_tiles[0]; i++)
            test_attention_bf16(&small_tiles[i]);
        for (size_t i = 0; i < sizeof tiles / sizeof tiles[0] && !small; i++)
            test_attention_bf16(&tiles[i]);
    }

    if (want("kv_store")) {
        test_kv_store(1, 16);
        test_attention_kv(1, 4, 1, 256); /* a Gemma 3 decode step of one sequence */
        test_attention_kv(5, 8, 2, 64);  /* five sequences, T 1 and 2 */
        test_attention_kv(3, 6, 3, 20);  /* D not whole float4s dividing 128: unstaged */
        test_kv_store(5, 256); /* Gemma 3 270M's row: one KV head of 256 */
        test_kv_store(3, 37);  /* rows of odd length: stores at every alignment */
        if (!small)
            test_kv_store(FITM_CUDA_KV_ROWS_MAX, 512);
    }

    if (want("logprob")) {
        test_logprob(1, 1, 1, 1.0f);
        test_logprob(3, 300, 8, 30.0f);  /* fewer entries than the block's threads */
        test_logprob(2, 4099, 16, 80.0f); /* most exponentials underflow */
        if (!small)
            test_logprob(2, 262144, 2, 20.0f); /* Gemma 3's vocabulary */
    }

    if (want("bf16")) {
        test_to_bf16(1, 40, 1, 0);     /* the fixed cases alone */
        test_to_bf16(5, 640, 64, 0);   /* a chunk of activations, padded to the GEMM's rows */
        test_to_bf16(64, 33, 64, 0);   /* a whole chunk, an odd row length */
        test_to_bf16(3, 37, 64, 37);   /* rows starting at an odd float of the activations */
        test_to_bf16(0, 16, 3, 0);     /* padding only */
        test_to_bf16(1, 100003, 1, 0); /* a weight as one row */
    }

    if (want("gemm")) {
        const int64_t one[] = {1}, odd[] = {37}, three[] = {65, 17, 130}, two[] = {129, 64};
        test_gemm_bf16(1, one, 1, 1, 0);     /* one element: every tail at once */
        test_gemm_bf16(1, odd, 45, 1, 1);    /* T = 1, odd N and K, x at an odd element */
        test_gemm_bf16(3, three, 77, 67, 0); /* Q/K/V-like outputs of three widths, tails */
        test_gemm_bf16(2, two, 96, 130, 3);  /* three row tiles, x off 16 bytes: element loads */
        test_gemm_bf16(2, two, 96, 130, 0);  /* 16-byte copies: three whole steps */
        test_gemm_bf16(2, two, 232, 70, 0);  /* copies, then 8 columns of a step: the rest zeros;
                                                8 steps through rings of 4 and 6 stages */
        test_gemm_bf16_rows(70, 50, 140);
        if (!small) {
            const int64_t gemma[] = {64};
            test_gemm_bf16(1, gemma, 640, 70, 0); /* Gemma 3 270M's K: 20 steps */
            /* a call of 64 x 64 tiles (enough blocks to fill a card; 8 steps through a ring
             * of 4) against calls of fewer rows in 64 x 32 tiles (a ring of 6): the same bits,
             * so the larger tiles are as right as the narrow ones checked above */
            test_gemm_bf16_rows(2048, 232, 520);
            /* 128 x 128 tiles (6 steps, the last partly past K) for the whole call and the
             * 639-row one, 64 x 64 for the 320-row one, 64 x 32 for the short ones */
            test_gemm_bf16_rows(6784, 168, 640);
        }
    }

    if (want("tape"))
        test_tape(small ? 1000 : 100003);

    CUDA_OK(cudaStreamDestroy(stream));
    if (failures) {
        fprintf(stderr, "test_cuda_kernels: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_cuda_kernels: ok\n");
    return 0;
}
