/* Every slot of the backend vtable (model/backend.h) against the CPU reference ops
 * (compute/ops.h, compute/quant.h, plain double loops here), on random inputs and odd shapes.
 *
 * The backend under test is reached only through its vtable, and every float buffer it reads
 * or writes goes through its alloc / upload / download, so a device backend runs the same
 * checks: make_backend() is the one place that picks it. Weights are host fitm_weight views
 * (the contract's "looked up by address"); prepare is optional and not exercised here.
 *
 * Tolerances: ops whose reference is the same formula in float get 1e-5 relative; products
 * get a bound relative to sum |w||x| (float rounding for the BATCH path and float weights,
 * the Q8 activation rounding, about 1/127 of each term, for the STEP path on quantized
 * weights). The CUDA backend's BATCH path in bfloat16 (its default, gpu_weights = bf16) is
 * held against a reference that rounds both operands to bfloat16 and sums in double: a
 * product of two bfloat16 values (8 significant bits each) is exact in float, so what is left
 * is the float accumulation of K terms (plus the bias), within gamma_(K+1) ~ (K + 1) u of
 * sum |w x| + |bias| (u = 2^-24) for any order of round-to-nearest adds; tensor cores may
 * align and truncate inside their adds instead of rounding, up to twice that, hence
 * (2K + 4) u. Operands rounded the wrong way (truncated, or one left in F32) move each term
 * by up to 2^-8 of itself, hundreds of times that bound. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cpu.h"
#include "check.h"
#include "compute/ops.h"
#include "compute/quant.h"
#include "model/backend.h"
#include "model/kv.h"
#ifdef FITM_TEST_BACKEND_CUDA
#include "kernels.h"
#include "model/backend_cuda.h"
#endif

/* ---- harness --------------------------------------------------------------------------- */

static uint64_t rng_state = 0x5eed;

static double urand(void) /* [0, 1) */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

static float *rand_vec(int64_t n, float lo, float hi)
{
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = lo + (hi - lo) * (float)urand();
    return v;
}

/* The backend under test: the CPU's, or with FITM_TEST_BACKEND_CUDA the CUDA backend (on a
 * device, or on the emulator of tests/cuda_emu); without a device that test skips (77). */
static fitm_backend *make_backend(void)
{
    fitm_backend *b = NULL;
    fitm_err err = {{0}};
#ifdef FITM_TEST_BACKEND_CUDA
    if (fitm_cuda_device_count() == 0) {
        printf("no CUDA device: skipped\n");
        exit(77);
    }
    if (fitm_backend_cuda_create(&b, 0, &err) != FITM_OK) {
#else
    if (fitm_backend_cpu_create(&b, 2, &err) != FITM_OK) {
#endif
        fprintf(stderr, "backend: %s\n", err.msg);
        exit(1);
    }
    return b;
}

/* Backend memory holding a copy of host[0..n). */
static float *to_dev(fitm_backend *b, const float *host, int64_t n)
{
    float *d = b->ops->alloc(b, (size_t)n * sizeof(float));
    if (!d) {
        fprintf(stderr, "backend alloc of %lld floats failed\n", (long long)n);
        exit(1);
    }
    if (host)
        b->ops->upload(b, d, host, (size_t)n * sizeof(float));
    return d;
}

static float *to_host(fitm_backend *b, const float *dev, int64_t n)
{
    float *h = malloc((size_t)n * sizeof *h);
    b->ops->download(b, h, dev, (size_t)n * sizeof(float));
    return h;
}

/* Largest |got - want| / (tol_abs[i] or 1) over n values; checks it is <= 1. */
static void check_close(const char *what, const float *got, const double *want, int64_t n,
                        const double *bound, double tol)
{
    double worst = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        double scale = bound ? bound[i] : fmax(1.0, fabs(want[i]));
        double e = fabs((double)got[i] - want[i]) / (tol * scale);
        if (!(e <= worst)) { /* also catches NaN */
            worst = isnan(e) ? INFINITY : e;
            at = i;
        }
    }
    CHECK(worst <= 1.0, "%s: element %lld is %.9g, expected %.9g (error %.3g of tolerance)", what,
          (long long)at, got[at], want[at], worst);
}

/* A random (N, K) weight of type t, and its dequantized values (what the backend must use). */
typedef struct {
    fitm_weight w;
    void *data;
    float *deq; /* (N, K) */
} test_weight;

static test_weight make_weight(fitm_dtype t, int64_t N, int64_t K)
{
    test_weight tw = {0};
    size_t rb = fitm_dtype_row_bytes(t, K);
    tw.data = malloc(rb * (size_t)N);
    tw.deq = malloc((size_t)(N * K) * sizeof(float));
    float *src = rand_vec(K, -1, 1);
    for (int64_t r = 0; r < N; r++) {
        for (int64_t k = 0; k < K; k++)
            src[k] = (float)(urand() * 2 - 1);
        fitm_quant_row(t, src, (char *)tw.data + r * rb, K);
        fitm_dequant_row(t, (char *)tw.data + r * rb, tw.deq + r * K, K);
    }
    free(src);
    tw.w = (fitm_weight){
        .name = "w", .type = t, .n_rows = N, .n_cols = K, .row_bytes = rb, .data = tw.data};
    return tw;
}

static void free_weight(test_weight *tw)
{
    free(tw->data);
    free(tw->deq);
}

static fitm_weight f32_vector(const float *v, int64_t n)
{
    return (fitm_weight){.name = "v",
                         .type = FITM_DTYPE_F32,
                         .n_rows = 1,
                         .n_cols = n,
                         .row_bytes = (size_t)n * sizeof(float),
                         .data = v};
}

/* ---- embed, matmul ------------------------------------------------------------------------ */

static void test_embed(fitm_backend *b, fitm_dtype t, int64_t V, int64_t C)
{
    test_weight tw = make_weight(t, V, C);
    const int64_t T = 5;
    int32_t ids[5] = {0, (int32_t)(V - 1), 3 % (int32_t)V, 0, (int32_t)(V / 2)};
    float scale = 1.75f;
    float *x = to_dev(b, NULL, T * C);
    b->ops->embed(b, &tw.w, ids, T, scale, x);
    float *got = to_host(b, x, T * C);
    double *want = malloc((size_t)(T * C) * sizeof *want);
    for (int64_t i = 0; i < T; i++)
        for (int64_t c = 0; c < C; c++)
            want[i * C + c] = (double)tw.deq[ids[i] * C + c] * scale;
    char what[64];
    snprintf(what, sizeof what, "embed %s V %lld C %lld", fitm_dtype_info_of(t)->name, (long long)V,
             (long long)C);
    check_close(what, got, want, T * C, NULL, 1e-6);
    free(got);
    free(want);
    b->ops->free(b, x);
    free_weight(&tw);
}

#ifdef FITM_TEST_BACKEND_CUDA
/* f rounded to bfloat16 (nearest, ties to even; f finite) and back to float. */
static float round_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + (u >> 16 & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* The product's reference with both operands rounded to bfloat16: want (T, N) in double and
 * bound = sum |w x| + |bias| (what the tolerance is relative to). */
static void bf16_reference(const float *deq, const float *x, const float *bias, int64_t T,
                           int64_t K, int64_t N, double *want, double *bound)
{
    for (int64_t i = 0; i < T; i++)
        for (int64_t n = 0; n < N; n++) {
            double s = bias ? bias[n] : 0, mag = bias ? fabs(bias[n]) : 0;
            for (int64_t k = 0; k < K; k++) {
                const double p = (double)round_bf16(deq[n * K + k]) * round_bf16(x[i * K + k]);
                s += p;
                mag += fabs(p);
            }
            want[i * N + n] = s;
            bound[i * N + n] = mag + 1e-30;
        }
}
#endif

/* Two outputs sharing x, the second with a bias, on the STEP path (pass 0), the BATCH path
 * (pass 1: in F32 on the CUDA backend) and, on the CUDA backend, the BATCH path in bfloat16
 * (pass 2). */
static void test_matmul(fitm_backend *b, fitm_dtype t, int64_t T, int64_t K, int64_t N0, int64_t N1)
{
    test_weight w0 = make_weight(t, N0, K), w1 = make_weight(t, N1, K);
    float *bias = rand_vec(N1, -0.5f, 0.5f);
    fitm_weight bw = f32_vector(bias, N1);
    float *xh = rand_vec(T * K, -2, 2);
    float *x = to_dev(b, xh, T * K);
    double *want0 = malloc((size_t)(T * N0) * sizeof(double)),
           *bound0 = malloc((size_t)(T * N0) * sizeof(double));
    double *want1 = malloc((size_t)(T * N1) * sizeof(double)),
           *bound1 = malloc((size_t)(T * N1) * sizeof(double));
    for (int64_t i = 0; i < T; i++) {
        for (int64_t n = 0; n < N0 + N1; n++) {
            const float *wr = n < N0 ? w0.deq + n * K : w1.deq + (n - N0) * K;
            double s = n < N0 ? 0 : bias[n - N0], mag = n < N0 ? 0 : fabs(bias[n - N0]);
            for (int64_t k = 0; k < K; k++) {
                s += (double)wr[k] * xh[i * K + k];
                mag += fabs((double)wr[k] * xh[i * K + k]);
            }
            if (n < N0) {
                want0[i * N0 + n] = s;
                bound0[i * N0 + n] = mag + 1e-3;
            } else {
                want1[i * N1 + n - N0] = s;
                bound1[i * N1 + n - N0] = mag + 1e-3;
            }
        }
    }
    bool quantized = fitm_quant_vec_dtype(t) != FITM_DTYPE_F32;
#ifdef FITM_TEST_BACKEND_CUDA
    const int n_passes = 3;
    double *want16_0 = malloc((size_t)(T * N0) * sizeof(double)),
           *bound16_0 = malloc((size_t)(T * N0) * sizeof(double));
    double *want16_1 = malloc((size_t)(T * N1) * sizeof(double)),
           *bound16_1 = malloc((size_t)(T * N1) * sizeof(double));
    bf16_reference(w0.deq, xh, NULL, T, K, N0, want16_0, bound16_0);
    bf16_reference(w1.deq, xh, bias, T, K, N1, want16_1, bound16_1);
#else
    const int n_passes = 2;
#endif
    for (int pass = 0; pass < n_passes; pass++) {
        const bool batched = pass > 0, bf16 = pass == 2;
        const double *w0_want = want0, *w0_bound = bound0, *w1_want = want1, *w1_bound = bound1;
#ifdef FITM_TEST_BACKEND_CUDA
        fitm_backend_cuda_set_weights(b, bf16 ? FITM_CUDA_WEIGHTS_BF16 : FITM_CUDA_WEIGHTS_F32);
        if (bf16)
            w0_want = want16_0, w0_bound = bound16_0, w1_want = want16_1, w1_bound = bound16_1;
#endif
        float *y0 = to_dev(b, NULL, T * N0), *y1 = to_dev(b, NULL, T * N1);
        fitm_mm_out outs[2] = {{&w0.w, NULL, y0}, {&w1.w, &bw, y1}};
        b->ops->matmul(b, x, T, outs, 2, batched);
        float *g0 = to_host(b, y0, T * N0), *g1 = to_host(b, y1, T * N1);
        double tol = !batched && quantized ? 1.0 / 64 : 1e-5;
        if (bf16)
            tol = (2.0 * (double)K + 4) * 0x1p-24;
        const char *path = bf16 ? "batch bf16" : batched ? "batch" : "step";
        char what[96];
        snprintf(what, sizeof what, "matmul %s %s T %lld K %lld N %lld (out 0)",
                 fitm_dtype_info_of(t)->name, path, (long long)T, (long long)K, (long long)N0);
        check_close(what, g0, w0_want, T * N0, w0_bound, tol);
        snprintf(what, sizeof what, "matmul %s %s T %lld K %lld N %lld (out 1, bias)",
                 fitm_dtype_info_of(t)->name, path, (long long)T, (long long)K, (long long)N1);
        check_close(what, g1, w1_want, T * N1, w1_bound, tol);
        free(g0);
        free(g1);
        b->ops->free(b, y0);
        b->ops->free(b, y1);
    }
    free(want0), free(want1), free(bound0), free(bound1);
#ifdef FITM_TEST_BACKEND_CUDA
    free(want16_0), free(want16_1), free(bound16_0), free(bound16_1);
#endif
    free(xh), free(bias);
    b->ops->free(b, x);
    free_weight(&w0);
    free_weight(&w1);
}

/* ---- element-wise and row-wise ops -------------------------------------------------------- */

static void test_rmsnorm(fitm_backend *b, int64_t rows, int64_t n, bool in_place)
{
    float *xh = rand_vec(rows * n, -3, 3), *wh = rand_vec(n, 0.5f, 1.5f);
    for (int64_t i = 3; i < n; i += 7) /* zero weights of both signs: +0 in the output */
        wh[i] = i % 2 ? -0.0f : 0.0f;
    fitm_weight w = f32_vector(wh, n);
    float *x = to_dev(b, xh, rows * n), *y = in_place ? x : to_dev(b, NULL, rows * n);
    b->ops->rmsnorm(b, y, x, &w, rows, n, 1e-6f);
    float *got = to_host(b, y, rows * n);
    double *want = malloc((size_t)(rows * n) * sizeof *want);
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < n; i++)
            ss += (double)xh[r * n + i] * xh[r * n + i];
        double inv = 1.0 / sqrt(ss / (double)n + 1e-6);
        for (int64_t i = 0; i < n; i++)
            want[r * n + i] = xh[r * n + i] * inv * wh[i];
    }
    check_close(in_place ? "rmsnorm (in place)" : "rmsnorm", got, want, rows * n, NULL, 1e-5);
    if (strcmp(b->ops->name, "cpu") == 0) { /* the CPU backend's are fitm_ops_rmsnorm's bits */
        float *ref = malloc((size_t)(rows * n) * sizeof *ref);
        fitm_ops_rmsnorm(ref, xh, wh, 0.0f, rows, n, 1e-6f);
        CHECK(memcmp(ref, got, (size_t)(rows * n) * sizeof *ref) == 0,
              "rmsnorm %lld x %lld: not fitm_ops_rmsnorm's bits", (long long)rows, (long long)n);
        free(ref);
    }
    free(got), free(want), free(xh), free(wh);
    if (!in_place)
        b->ops->free(b, y);
    b->ops->free(b, x);
}

static void test_rope(fitm_backend *b, int64_t T, int64_t H, int64_t D, int64_t n_rot, bool neox)
{
    float *xh = rand_vec(T * H * D, -2, 2);
    float *cs = malloc((size_t)(T * n_rot) * sizeof *cs);
    for (int64_t t = 0; t < T; t++)
        fitm_ops_rope_table(cs + t * n_rot, n_rot, 7 + 13 * t, 10000.0f, 1.0f);
    float *x = to_dev(b, xh, T * H * D);
    /* the table is backend memory, as the driver's (forward.c keeps it on the backend) */
    float *cs_dev = to_dev(b, cs, T * n_rot);
    b->ops->rope(b, x, T, H, D, n_rot, cs_dev, neox);
    float *got = to_host(b, x, T * H * D);
    double *want = malloc((size_t)(T * H * D) * sizeof *want);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *v = xh + (t * H + h) * D;
            double *o = want + (t * H + h) * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = v[d];
            for (int64_t i = 0; i < n_rot / 2; i++) {
                int64_t a = neox ? i : 2 * i, c = neox ? i + n_rot / 2 : 2 * i + 1;
                double cos_ = cs[t * n_rot + 2 * i], sin_ = cs[t * n_rot + 2 * i + 1];
                o[a] = v[a] * cos_ - v[c] * sin_;
                o[c] = v[a] * sin_ + v[c] * cos_;
            }
        }
    check_close(neox ? "rope neox" : "rope normal", got, want, T * H * D, NULL, 1e-5);
    free(got), free(want), free(xh), free(cs);
    b->ops->free(b, cs_dev);
    b->ops->free(b, x);
}

static void test_elementwise(fitm_backend *b, int64_t n)
{
    float *gh = rand_vec(n, -6, 6), *uh = rand_vec(n, -2, 2);
    float *g = to_dev(b, gh, n), *u = to_dev(b, uh, n), *y = to_dev(b, NULL, n);
    double *want = malloc((size_t)n * sizeof *want);
    for (int act = 0; act < 2; act++) {
        b->ops->glu(b, y, g, u, n, act ? FITM_ACT_GELU : FITM_ACT_SILU);
        float *got = to_host(b, y, n);
        for (int64_t i = 0; i < n; i++) {
            double x = gh[i];
            double a = act ? 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
                           : x / (1 + exp(-x));
            want[i] = a * uh[i];
        }
        check_close(act ? "glu gelu" : "glu silu", got, want, n, NULL, 1e-5);
        free(got);
    }
    b->ops->add(b, g, u, n); /* g += u */
    float *got = to_host(b, g, n);
    for (int64_t i = 0; i < n; i++)
        want[i] = (double)gh[i] + uh[i];
    check_close("add", got, want, n, NULL, 1e-6);
    free(got);
    b->ops->softcap(b, u, n, 1.5f);
    got = to_host(b, u, n);
    for (int64_t i = 0; i < n; i++)
        want[i] = 1.5 * tanh(uh[i] / 1.5);
    check_close("softcap", got, want, n, NULL, 1e-5);
    free(got), free(want), free(gh), free(uh);
    b->ops->free(b, g), b->ops->free(b, u), b->ops->free(b, y);
}

/* ops->qk_rope (optional): the per-head norms (where given) and RoPE of q and k in one op,
 * bit for bit the backend's own rmsnorm and rope calls on the same inputs, and within the
 * rmsnorm and rope tolerances of a double-precision reference. */
static void test_qk_rope(fitm_backend *b, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                         int64_t n_rot, bool neox, bool norms)
{
    if (!b->ops->qk_rope)
        return;
    const int64_t nq = T * H * D, nk = T * Hkv * D;
    float *qh = rand_vec(nq, -2, 2), *kh = rand_vec(nk, -2, 2);
    float *qwh = rand_vec(D, 0.5f, 1.5f), *kwh = rand_vec(D, 0.5f, 1.5f);
    fitm_weight qw = f32_vector(qwh, D), kw = f32_vector(kwh, D);
    float *cs = malloc((size_t)(T * n_rot) * sizeof *cs);
    for (int64_t t = 0; t < T; t++)
        fitm_ops_rope_table(cs + t * n_rot, n_rot, 3 + 29 * t, 10000.0f, 1.0f);
    float *cs_dev = to_dev(b, cs, T * n_rot);
    float *q1 = to_dev(b, qh, nq), *k1 = to_dev(b, kh, nk);
    float *q2 = to_dev(b, qh, nq), *k2 = to_dev(b, kh, nk);
    if (norms) {
        b->ops->rmsnorm(b, q1, q1, &qw, T * H, D, 1e-6f);
        b->ops->rmsnorm(b, k1, k1, &kw, T * Hkv, D, 1e-6f);
    }
    b->ops->rope(b, q1, T, H, D, n_rot, cs_dev, neox);
    b->ops->rope(b, k1, T, Hkv, D, n_rot, cs_dev, neox);
    b->ops->qk_rope(b, q2, k2, T, H, Hkv, D, n_rot, cs_dev, neox, norms ? &qw : NULL,
                    norms ? &kw : NULL, 1e-6f);
    float *s[2] = {to_host(b, q1, nq), to_host(b, k1, nk)};
    float *got[2] = {to_host(b, q2, nq), to_host(b, k2, nk)};
    const float *in[2] = {qh, kh}, *wh[2] = {qwh, kwh};
    const int64_t heads[2] = {H, Hkv};
    char what[96];
    for (int i = 0; i < 2; i++) {
        const int64_t n = T * heads[i] * D;
        snprintf(what, sizeof what, "qk_rope %s T %lld D %lld rot %lld %s%s", i ? "k" : "q",
                 (long long)T, (long long)D, (long long)n_rot, neox ? "neox" : "normal",
                 norms ? " normed" : "");
        CHECK(memcmp(s[i], got[i], (size_t)n * sizeof(float)) == 0,
              "%s: differs from the backend's rmsnorm and rope", what);
        double *want = malloc((size_t)n * sizeof *want), *v = malloc((size_t)D * sizeof *v);
        for (int64_t r = 0; r < T * heads[i]; r++) {
            const int64_t t = r / heads[i];
            double ss = 0;
            for (int64_t d = 0; d < D; d++)
                ss += (double)in[i][r * D + d] * in[i][r * D + d];
            const double inv = norms ? 1.0 / sqrt(ss / (double)D + 1e-6) : 1.0;
            for (int64_t d = 0; d < D; d++)
                v[d] = in[i][r * D + d] * inv * (norms ? wh[i][d] : 1.0f);
            double *o = want + r * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = v[d];
            for (int64_t j = 0; j < n_rot / 2; j++) {
                const int64_t a = neox ? j : 2 * j, c = neox ? j + n_rot / 2 : 2 * j + 1;
                const double cos_ = cs[t * n_rot + 2 * j], sin_ = cs[t * n_rot + 2 * j + 1];
                o[a] = v[a] * cos_ - v[c] * sin_;
                o[c] = v[a] * sin_ + v[c] * cos_;
            }
        }
        check_close(what, got[i], want, n, NULL, 1e-5);
        free(want), free(v), free(s[i]), free(got[i]);
    }
    free(qh), free(kh), free(qwh), free(kwh), free(cs);
    b->ops->free(b, cs_dev), b->ops->free(b, q1), b->ops->free(b, k1), b->ops->free(b, q2),
        b->ops->free(b, k2);
}

/* ops->matmul_glu (optional): a decode step's gate and up products and the GLU in one op,
 * bit for bit the backend's own STEP matmul and glu calls, and within the STEP product's
 * tolerance (test_matmul's, times the activation's slope) of a double reference. Gate and up
 * of the same type, and of two types (which a backend may run as the separate ops). */
static void test_matmul_glu(fitm_backend *b, fitm_dtype tg, fitm_dtype tu, int64_t T, int64_t K,
                            int64_t F)
{
    if (!b->ops->matmul_glu)
        return;
    test_weight wg = make_weight(tg, F, K), wu = make_weight(tu, F, K);
    float *xh = rand_vec(T * K, -2, 2);
    float *x = to_dev(b, xh, T * K);
    const bool quantized =
        fitm_quant_vec_dtype(tg) != FITM_DTYPE_F32 || fitm_quant_vec_dtype(tu) != FITM_DTYPE_F32;
    const double rtol = quantized ? 1.0 / 64 : 1e-5;
    for (int act = 0; act < 2; act++) {
        const fitm_act a = act ? FITM_ACT_GELU : FITM_ACT_SILU;
        float *g1 = to_dev(b, NULL, T * F), *u1 = to_dev(b, NULL, T * F);
        float *g2 = to_dev(b, NULL, T * F), *u2 = to_dev(b, NULL, T * F);
        const fitm_mm_out sep[2] = {{&wg.w, NULL, g1}, {&wu.w, NULL, u1}};
        const fitm_mm_out one[2] = {{&wg.w, NULL, g2}, {&wu.w, NULL, u2}};
        b->ops->matmul(b, x, T, sep, 2, false);
        b->ops->glu(b, g1, g1, u1, T * F, a);
        b->ops->matmul_glu(b, x, T, one, a);
        float *s = to_host(b, g1, T * F), *got = to_host(b, g2, T * F);
        char what[96];
        snprintf(what, sizeof what, "matmul_glu %s/%s T %lld K %lld F %lld %s",
                 fitm_dtype_info_of(tg)->name, fitm_dtype_info_of(tu)->name, (long long)T,
                 (long long)K, (long long)F, act ? "gelu" : "silu");
        CHECK(memcmp(s, got, (size_t)(T * F) * sizeof(float)) == 0,
              "%s: differs from the backend's matmul and glu", what);
        double *want = malloc((size_t)(T * F) * sizeof *want);
        double *bound = malloc((size_t)(T * F) * sizeof *bound);
        for (int64_t i = 0; i < T; i++)
            for (int64_t n = 0; n < F; n++) {
                double sg = 0, su = 0, mg = 0, mu = 0;
                for (int64_t k = 0; k < K; k++) {
                    sg += (double)wg.deq[n * K + k] * xh[i * K + k];
                    su += (double)wu.deq[n * K + k] * xh[i * K + k];
                    mg += fabs((double)wg.deq[n * K + k] * xh[i * K + k]);
                    mu += fabs((double)wu.deq[n * K + k] * xh[i * K + k]);
                }
                const double ag =
                    act ? 0.5 * sg * (1 + tanh(0.7978845608028654 * (sg + 0.044715 * sg * sg * sg)))
                        : sg / (1 + exp(-sg));
                want[i * F + n] = ag * su;
                /* check_close allows rtol times this: each product off by up to rtol times
                 * its magnitude (test_matmul's bound), carried through act (slope <= 1.13)
                 * times |up| and through |act(g)| <= |g| times the up product's error, plus
                 * the activation's own rounding */
                bound[i * F + n] = 1.13 * (fabs(su) + rtol * mu + 1e-3) * (mg + 1e-3) +
                                   (fabs(sg) + rtol * mg + 1e-3) * (mu + 1e-3) +
                                   fmax(1.0, fabs(want[i * F + n]));
            }
        check_close(what, got, want, T * F, bound, rtol);
        free(s), free(got), free(want), free(bound);
        b->ops->free(b, g1), b->ops->free(b, u1), b->ops->free(b, g2), b->ops->free(b, u2);
    }
    free(xh);
    b->ops->free(b, x);
    free_weight(&wg);
    free_weight(&wu);
}

/* to_half / from_half (a backend with fp16 KV caches): n values over fp16's range and past
 * it -- ties halfway between two halves, subnormals, overflow to inf, signed zeros, inf and
 * NaN -- each rounded as fitm_fp32_to_fp16 rounds (the portable reference), back exactly. */
static void test_half(fitm_backend *b, int64_t n)
{
    float *xh = rand_vec(n, -4, 4);
    for (int64_t i = 0; i < n; i++) {
        const double r = urand();
        if (i % 7 == 1) /* halfway between two halves of [1, 2): the tie goes to the even one */
            xh[i] = 1.0f + ((float)(int)(r * 1023) + 0.5f) / 1024.0f;
        else if (i % 7 == 2) /* subnormal and underflowing halves */
            xh[i] = (float)((r - 0.5) * 1e-6);
        else if (i % 7 == 3) /* near and past the largest half, 65504 */
            xh[i] = (float)((r - 0.5) * 2.0 * 70000.0);
        else if (i % 7 == 4)
            xh[i] = ldexpf((float)r + 0.5f, (int)(r * 40) - 20);
    }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f,
                             5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f};
    for (size_t i = 0; i < sizeof special / sizeof special[0] && (int64_t)i < n; i++)
        xh[i] = special[i];
    float *x = to_dev(b, xh, n), *back = to_dev(b, NULL, n);
    void *h = b->ops->alloc(b, (size_t)n * sizeof(uint16_t));
    b->ops->to_half(b, h, x, n);
    b->ops->from_half(b, back, h, n);
    uint16_t *got = malloc((size_t)n * sizeof *got);
    b->ops->download(b, got, h, (size_t)n * sizeof *got);
    float *got_back = to_host(b, back, n);
    int64_t bad = -1, bad_back = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (got[i] != fitm_fp32_to_fp16(xh[i]))
            bad = i;
    for (int64_t i = 0; i < n && bad_back < 0; i++) {
        const float want = fitm_fp16_to_fp32(fitm_fp32_to_fp16(xh[i]));
        if (memcmp(&got_back[i], &want, sizeof want) != 0)
            bad_back = i;
    }
    CHECK(bad < 0, "to_half of %lld values: value %lld (%g) gave 0x%04x, want 0x%04x",
          (long long)n, (long long)bad, bad < 0 ? 0.0 : xh[bad], bad < 0 ? 0 : got[bad],
          bad < 0 ? 0 : fitm_fp32_to_fp16(xh[bad]));
    CHECK(bad_back < 0, "from_half of %lld values: value %lld differs", (long long)n,
          (long long)bad_back);
    free(xh), free(got), free(got_back);
    b->ops->free(b, x), b->ops->free(b, back), b->ops->free(b, h);
}

/* ---- kv_store_many -------------------------------------------------------------------- */

/* kv_store_many (a backend with it) against fitm_kv_store one sequence at a time: n_seqs
 * caches of each kind (F32, or fp16 where half), their bytes first set to the same fresh
 * random bytes, get each layer's rows of sequences of different lengths at different rows
 * (from one block of source rows, as a call's K and V sit in the forward's scratch); the
 * caches must then hold the same bytes, which are the random ones but for the stored rows,
 * and those the source values (F32) or fitm_fp32_to_fp16 of them (fp16). */
static void test_kv_store_many(fitm_backend *b, int n_seqs, bool half)
{
    enum { MAX_SEQS = 80, L = 3 };
    const fitm_model_config c = {.n_layer = L, .n_head_kv = 2, .head_dim = 24};
    const int64_t row = (int64_t)c.n_head_kv * c.head_dim, n_rows = 16;
    fitm_err err = {{0}};
    fitm_kv *kv[2][MAX_SEQS] = {{NULL}};
    int64_t T[MAX_SEQS], at[MAX_SEQS], row0[MAX_SEQS], total = 0;
    CHECK(n_seqs <= MAX_SEQS && fitm_backend_set_kv_half(b, half, &err) == FITM_OK, "%s",
          err.msg);
    for (int s = 0; s < n_seqs; s++) {
        T[s] = s % 4 == 2 ? 1 + (int64_t)(urand() * 9) : 1; /* a prompt's rows beside steps */
        at[s] = (int64_t)(urand() * (double)(n_rows - T[s] + 1));
        row0[s] = total;
        total += T[s];
    }
    /* (L, total, 2, row): layer l's K and V rows of the call, as the forward's scratch */
    float *src_h = rand_vec(L * total * 2 * row, -3, 3);
    float *src = to_dev(b, src_h, L * total * 2 * row);
    const size_t elem = half ? 2 : 4, bytes = (size_t)(2 * L * n_rows * row) * elem;
    unsigned char *init = malloc(bytes * (size_t)n_seqs), *got[2] = {malloc(bytes), malloc(bytes)};
    int64_t bad = -1, bad_ref = -1;
    for (int s = 0; s < n_seqs; s++) {
        unsigned char *mine = init + bytes * (size_t)s;
        for (size_t i = 0; i < bytes; i++)
            mine[i] = (unsigned char)(urand() * 256);
        for (int k = 0; k < 2; k++) {
            CHECK(fitm_kv_create(&kv[k][s], b, &c, n_rows, &err) == FITM_OK, "%s", err.msg);
            CHECK(fitm_kv_bytes(kv[k][s]) == bytes && fitm_kv_half(kv[k][s]) == half);
            b->ops->upload(b, fitm_kv_k(kv[k][s], 0), mine, bytes);
        }
    }
    fitm_kv_rows r[MAX_SEQS];
    for (int32_t l = 0; l < L; l++) {
        const float *k = src + (int64_t)l * total * 2 * row, *v = k + total * row;
        for (int s = 0; s < n_seqs; s++) {
            fitm_kv_store(kv[0][s], l, at[s], k + row0[s] * row, v + row0[s] * row, T[s]);
            r[s] = fitm_kv_rows_of(kv[1][s], l, at[s], k + row0[s] * row, v + row0[s] * row,
                                   T[s]);
        }
        b->ops->kv_store_many(b, r, n_seqs);
    }
    for (int s = 0; s < n_seqs; s++) {
        for (int k = 0; k < 2; k++)
            b->ops->download(b, got[k], fitm_kv_k(kv[k][s], 0), bytes);
        if (bad < 0 && memcmp(got[0], got[1], bytes) != 0)
            bad = s;
        /* the reference: its random bytes, the stored rows replaced by the values */
        unsigned char *want = init + bytes * (size_t)s;
        for (int32_t l = 0; l < L; l++)
            for (int kv_i = 0; kv_i < 2; kv_i++)
                for (int64_t i = 0; i < T[s] * row; i++) {
                    const float x =
                        src_h[((int64_t)l * total * 2 + kv_i * total + row0[s]) * row + i];
                    const uint16_t h16 = fitm_fp32_to_fp16(x);
                    memcpy(want + ((size_t)(2 * l + kv_i) * (size_t)(n_rows * row) +
                                   (size_t)(at[s] * row + i)) * elem,
                           half ? (const void *)&h16 : (const void *)&x, elem);
                }
        if (bad_ref < 0 && memcmp(got[1], want, bytes) != 0)
            bad_ref = s;
    }
    CHECK(bad < 0, "kv_store_many of %d sequences (%s): sequence %lld's cache differs from "
          "fitm_kv_store's", n_seqs, half ? "fp16" : "F32", (long long)bad);
    CHECK(bad_ref < 0, "kv_store_many of %d sequences (%s): sequence %lld's cache is not its "
          "bytes with the stored rows set to its values", n_seqs, half ? "fp16" : "F32", (long long)bad_ref);
    for (int s = 0; s < n_seqs; s++)
        for (int k = 0; k < 2; k++)
            fitm_kv_destroy(kv[k][s]);
    CHECK(fitm_backend_set_kv_half(b, false, &err) == FITM_OK);
    b->ops->free(b, src);
    free(src_h), free(init), free(got[0]), free(got[1]);
}

/* ---- topk ------------------------------------------------------------------------------- */

/* logit descending, NaN after every number, then id ascending */
static int cmp_top_ref(const void *a, const void *b)
{
    const fitm_top *x = a, *y = b;
    const bool xn = isnan(x->logit), yn = isnan(y->logit);
    if (xn != yn)
        return xn ? 1 : -1;
    if (!xn && x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* rows of n values, each row's k first entries against a full sort of the row (an independent
 * reference). levels > 0 draws every value from that many distinct ones, so most entries tie
 * (greedy's first maximum must be the lowest id among equal maxima); levels 0: continuous,
 * with negative values and -inf entries mixed in; levels -1: 60% NaN, 20% -inf, the rest
 * numbers. Exact: values and ids must be equal. */
static void test_topk(fitm_backend *b, int64_t rows, int64_t n, int32_t k, int levels)
{
    float *xh = rand_vec(rows * n, -30, 30);
    for (int64_t i = 0; i < rows * n; i++) {
        const double u = urand();
        if (levels > 0)
            xh[i] = (float)(int)(urand() * levels) - 2.0f;
        else if (levels < 0 && u < 0.8)
            xh[i] = u < 0.6 ? NAN : -INFINITY;
        else if (u < 0.01)
            xh[i] = -INFINITY;
    }
    float *x = to_dev(b, xh, rows * n);
    fitm_top *got = malloc((size_t)(rows * k) * sizeof *got);
    fitm_top *ref = malloc((size_t)n * sizeof *ref);
    b->ops->topk(b, x, rows, n, k, got);
    int64_t bad = -1;
    for (int64_t r = 0; r < rows && bad < 0; r++) {
        for (int64_t i = 0; i < n; i++)
            ref[i] = (fitm_top){xh[r * n + i], (int32_t)i};
        qsort(ref, (size_t)n, sizeof *ref, cmp_top_ref);
        for (int32_t j = 0; j < k && bad < 0; j++)
            if (memcmp(&got[r * k + j].logit, &ref[j].logit, sizeof(float)) ||
                got[r * k + j].id != ref[j].id)
                bad = r * k + j;
    }
    CHECK(bad < 0,
          "topk (rows %lld, n %lld, k %d, levels %d): entry %lld is (%g, %d), expected "
          "(%g, %d)",
          (long long)rows, (long long)n, (int)k, levels, (long long)bad,
          bad < 0 ? 0.0 : got[bad].logit, bad < 0 ? 0 : (int)got[bad].id,
          bad < 0 ? 0.0 : ref[bad % k].logit, bad < 0 ? 0 : (int)ref[bad % k].id);
    free(got), free(ref), free(xh);
    b->ops->free(b, x);
}

/* ---- logprob ------------------------------------------------------------------------------ */

/* rows of n values drawn by kind (0: uniform in [-30, 30]; 1: magnitudes from 1e-30 to 3e38
 * of both signs with -inf entries, so exponents underflow and the maximum dwarfs the rest;
 * 2: all equal but one; 3, the CPU backend only: rows by r % 4 with a NaN, with a +inf, of
 * zeros of both signs, all -inf; 4: one 1 among values in [-40, -20], so that z is 1 plus
 * sums of small terms and -log z, the 1's log-probability (picked too), shows z's last bits),
 * n_pick ids per row with 0 and n - 1 among them. Each value against
 * an independent reference (long double log-sum-exp) within the bound of a sum of n terms in
 * double in any order, (2n + 8) 2^-53 + 2^-50 (|lp| + ln n); the CPU backend must moreover
 * give fitm_ops_logprob's bits (the host path's), a device backend be within that bound of
 * them (kernels/logprob.cu). */
static void test_logprob(fitm_backend *b, int64_t rows, int64_t n, int32_t n_pick, int kind)
{
    float *xh = rand_vec(rows * n, -30, 30);
    for (int64_t i = 0; kind == 1 && i < rows * n; i++) {
        const double u = urand();
        xh[i] = u < 0.02 ? -INFINITY
                         : (float)((urand() < 0.5 ? -1 : 1) * pow(10.0, -30.0 + 68.5 * u));
    }
    for (int64_t i = 0; kind == 2 && i < rows * n; i++)
        xh[i] = i % n == n / 2 ? 4.0f : -1.5f;
    for (int64_t i = 0; kind == 4 && i < rows * n; i++)
        xh[i] = i % n == n / 3 ? 1.0f : (float)(-40.0 + 20.0 * urand());
    for (int64_t r = 0; kind == 3 && r < rows; r++) {
        float *row = xh + r * n;
        const int64_t at = (int64_t)(urand() * (double)n);
        if (r % 4 == 0)
            row[at] = NAN;
        else if (r % 4 == 1)
            row[at] = INFINITY;
        for (int64_t v = 0; r % 4 >= 2 && v < n; v++)
            row[v] = r % 4 == 3 ? -INFINITY : v % 3 ? 0.0f : -0.0f;
    }
    int32_t *pick = malloc((size_t)(rows * n_pick) * sizeof *pick);
    double *got = malloc((size_t)(rows * n_pick) * sizeof *got);
    double *host = malloc((size_t)(rows * n_pick) * sizeof *host);
    for (int64_t i = 0; i < rows * n_pick; i++)
        pick[i] = i % n_pick == 0 ? 0 : i % n_pick == 1 ? (int32_t)(n - 1)
                                                         : (int32_t)(urand() * (double)n);
    for (int64_t i = 2; kind == 4 && i < rows * n_pick; i += n_pick)
        pick[i] = (int32_t)(n / 3);
    float *x = to_dev(b, xh, rows * n);
    b->ops->logprob(b, x, rows, n, pick, n_pick, got);
    const bool exact = strcmp(b->ops->name, "cpu") == 0;
    int64_t bad = -1;
    double want_bad = 0, host_bad = 0;
    for (int64_t r = 0; r < rows && bad < 0; r++) {
        const float *row = xh + r * n;
        fitm_ops_logprob(row, n, pick + r * n_pick, n_pick, host + r * n_pick);
        long double m = -INFINITY, z = 0;
        for (int64_t v = 0; v < n; v++)
            m = row[v] > m ? row[v] : m;
        for (int64_t v = 0; v < n; v++)
            z += expl((long double)row[v] - m);
        for (int32_t j = 0; j < n_pick && bad < 0; j++) {
            const int64_t i = r * n_pick + j;
            const double want = (double)((long double)row[pick[i]] - m - logl(z));
            const double tol = (2.0 * (double)n + 8.0) * 0x1p-53 +
                               0x1p-50 * (fabs(want) + log((double)n));
            const bool same = got[i] == want || fabs(got[i] - want) <= tol ||
                              (kind == 3 && r % 4 != 2); /* NaN: the bits as the host's */
            const bool as_host = exact ? !memcmp(&got[i], &host[i], sizeof(double))
                                       : got[i] == host[i] || fabs(got[i] - host[i]) <= tol;
            if (!same || !as_host)
                bad = i, want_bad = want, host_bad = host[i];
        }
    }
    CHECK(bad < 0,
          "logprob (rows %lld, n %lld, picks %d, kind %d) on %s: value %lld (id %d) is %.17g, "
          "reference %.17g, host %.17g",
          (long long)rows, (long long)n, (int)n_pick, kind, b->ops->name, (long long)bad,
          bad < 0 ? 0 : (int)pick[bad], bad < 0 ? 0.0 : got[bad], want_bad, host_bad);
    free(xh), free(pick), free(got), free(host);
    b->ops->free(b, x);
}

/* ---- attention ---------------------------------------------------------------------------- */

typedef struct {
    int64_t T, pos0, own_base, window;
    int32_t H, Hkv, D;
    bool capture, intervene, after;
    int32_t mix;    /* > 0: a mixture of this many experts (the position methods)          */
    int32_t mix_kh; /* the experts' key heads: Hkv or H                                     */
} attn_case;

/* A mixture's host arrays (fitm_attn_mix's layout). */
typedef struct {
    int32_t E, kh;
    const float *q, *k, *w;
    int64_t k_stride;
} mix_host;

/* softmax over keys [0, pos] of query q (D) against key rows kp (below own_base) / ko, head
 * g of `heads`; masked keys 0. */
static void ref_softmax(const attn_case *c, const float *q, const float *kp, const float *ko,
                        int64_t own_base, int32_t heads, int32_t g, int64_t pos, double *p)
{
    const int64_t D = c->D, HD = (int64_t)heads * D;
    double mx = -INFINITY;
    for (int64_t j = 0; j <= pos; j++) {
        bool vis = c->window <= 0 || pos - j < c->window;
        if (!vis) {
            p[j] = -INFINITY;
            continue;
        }
        const float *k = (j < own_base ? kp + j * HD : ko + (j - own_base) * HD) + g * D;
        double s = 0;
        for (int64_t d = 0; d < D; d++)
            s += (double)q[d] * k[d];
        p[j] = s / sqrt((double)D);
        mx = fmax(mx, p[j]);
    }
    double z = 0;
    for (int64_t j = 0; j <= pos; j++)
        z += p[j] = isinf(p[j]) ? 0 : exp(p[j] - mx);
    for (int64_t j = 0; j <= pos; j++)
        p[j] /= z;
}

/* The reference row of query i, head h: probabilities over keys [0, pos] (masked keys 0) --
 * for a mixture, sum_e w_e softmax_e -- intervened when asked, in p (pos + 1 values). */
static void ref_probs(const attn_case *c, const float *q, const float *kp, const float *ko,
                      const mix_host *mx, int64_t i, int32_t h, const fitm_intervention *iv,
                      bool do_iv, double *p)
{
    const int64_t pos = c->pos0 + i, D = c->D;
    if (!mx) {
        ref_softmax(c, q + (i * c->H + h) * D, kp, ko, c->own_base, c->Hkv, h / (c->H / c->Hkv),
                    pos, p);
    } else {
        double *pe = malloc((size_t)(pos + 1) * sizeof *pe);
        for (int64_t j = 0; j <= pos; j++)
            p[j] = 0;
        for (int32_t e = 0; e < mx->E; e++) {
            const double w = mx->w[(i * c->H + h) * mx->E + e];
            if (w == 0)
                continue;
            const float *ke = mx->k + e * mx->k_stride;
            ref_softmax(c, mx->q + ((e * c->T + i) * c->H + h) * D, ke, ke, 0, mx->kh,
                        h / (c->H / mx->kh), pos, pe);
            for (int64_t j = 0; j <= pos; j++)
                p[j] += w * pe[j];
        }
        free(pe);
    }
    if (!do_iv)
        return;
    float *pf = malloc((size_t)(pos + 1) * sizeof *pf);
    double *mass = malloc((size_t)iv->n_spans * sizeof *mass);
    for (int64_t j = 0; j <= pos; j++)
        pf[j] = (float)p[j];
    fitm_ops_intervene(pf, 0, pos + 1, iv->spans, iv->alpha, iv->n_spans, mass);
    for (int64_t j = 0; j <= pos; j++)
        p[j] = pf[j];
    free(pf);
    free(mass);
}

/* A call's captures, set aside while a check recomputes them from zeros in the same arrays:
 * cap_same compares the two, cap_put_back restores the first. */
typedef struct {
    float *probs, *mass, *probs0, *mass0;
    size_t np, nm; /* bytes */
} cap_aside;

static cap_aside cap_set_aside(float *probs, int64_t np, float *mass, int64_t nm)
{
    cap_aside s = {probs, mass, malloc((size_t)np * sizeof(float)),
                   malloc((size_t)nm * sizeof(float)), (size_t)np * sizeof(float),
                   (size_t)nm * sizeof(float)};
    memcpy(s.probs0, probs, s.np);
    memcpy(s.mass0, mass, s.nm);
    memset(probs, 0, s.np);
    memset(mass, 0, s.nm);
    return s;
}

static bool cap_same(const cap_aside *s)
{
    return memcmp(s->probs0, s->probs, s->np) == 0 && memcmp(s->mass0, s->mass, s->nm) == 0;
}

static void cap_put_back(cap_aside *s)
{
    memcpy(s->probs, s->probs0, s->np);
    memcpy(s->mass, s->mass0, s->nm);
    free(s->probs0), free(s->mass0);
}

/* Row i of the call a as a call of its own (a decode step's row), its output at out + i rows. */
static fitm_attn_args row_call(const fitm_attn_args *a, int64_t i, float *out)
{
    const int64_t HD = (int64_t)a->n_head * a->head_dim;
    fitm_attn_args r = *a;
    r.T = 1, r.pos0 = a->pos0 + i, r.q = a->q + i * HD, r.out = out + i * HD;
    r.cap_index = a->cap_index ? a->cap_index + i : NULL;
    return r;
}

/* Backend memory holding host's n values as fp16 (half) or F32; host is first rounded to
 * fp16's grid where half, so the reference reads the values the backend reads. */
static void *kv_dev(fitm_backend *b, float *host, int64_t n, bool half)
{
    if (!half)
        return to_dev(b, host, n);
    uint16_t *h = malloc((size_t)n * sizeof *h);
    for (int64_t i = 0; i < n; i++) {
        h[i] = fitm_fp32_to_fp16(host[i]);
        host[i] = fitm_fp16_to_fp32(h[i]);
    }
    void *d = b->ops->alloc(b, (size_t)n * sizeof *h);
    if (!d) {
        fprintf(stderr, "backend alloc of %lld halves failed\n", (long long)n);
        exit(1);
    }
    b->ops->upload(b, d, h, (size_t)n * sizeof *h);
    free(h);
    return d;
}

/* One attention case against the double reference, with K and V held as fp16 values where
 * half (a backend with ops->kv_half), else as F32. */
static void test_attention(fitm_backend *b, const attn_case *c, bool half)
{
    const int64_t T = c->T, D = c->D, HD = (int64_t)c->H * D, HkvD = (int64_t)c->Hkv * D;
    const int64_t n_keys = c->pos0 + T, own_rows = n_keys - c->own_base;
    const int32_t L = 3, layer = 1;
    float *qh = rand_vec(T * HD, -1.5f, 1.5f);
    float *kph = rand_vec(c->own_base * HkvD + 1, -1.5f, 1.5f),
          *vph = rand_vec(c->own_base * HkvD + 1, -1, 1);
    float *koh = rand_vec(own_rows * HkvD, -1.5f, 1.5f), *voh = rand_vec(own_rows * HkvD, -1, 1);
    float *q = to_dev(b, qh, T * HD), *out = to_dev(b, NULL, T * HD);
    void *kp = kv_dev(b, kph, c->own_base * HkvD + 1, half),
         *vp = kv_dev(b, vph, c->own_base * HkvD + 1, half);
    void *ko = kv_dev(b, koh, own_rows * HkvD, half), *vo = kv_dev(b, voh, own_rows * HkvD, half);
    /* A mixture: each expert's queries and keys (positions [0, n_keys), a padded stride),
     * weights per (row, head) summing to 1 over a random subset of experts (one-hot rows too,
     * and every expert skipped by some rows). */
    const int32_t E = c->mix;
    const int64_t k_stride = n_keys * c->mix_kh * D + 5;
    float *mqh = NULL, *mkh = NULL, *mwh = NULL, *mq = NULL, *mk = NULL, *mw = NULL;
    fitm_attn_mix mix = {0};
    mix_host mxh = {0};
    if (E > 0) {
        mqh = rand_vec(E * T * HD, -1.5f, 1.5f);
        mkh = rand_vec(E * k_stride, -1.5f, 1.5f);
        mwh = rand_vec(T * c->H * E, 0.05f, 1.0f);
        for (int64_t r = 0; r < T * c->H; r++) {
            float *w = mwh + r * E, sum = 0;
            const int32_t one = (int32_t)(urand() * E);
            for (int32_t e = 0; e < E; e++) {
                if (r % 3 == 0 ? e != one : urand() < 1.0 / 3 && e != one)
                    w[e] = 0;
                sum += w[e];
            }
            for (int32_t e = 0; e < E; e++)
                w[e] /= sum;
        }
        mq = to_dev(b, mqh, E * T * HD), mk = to_dev(b, mkh, E * k_stride);
        mw = to_dev(b, mwh, T * c->H * E);
        mix = (fitm_attn_mix){.n_mix = E, .q = mq, .k = mk, .k_stride = k_stride,
                              .k_heads = c->mix_kh, .w = mw};
        mxh = (mix_host){E, c->mix_kh, mqh, mkh, mwh, k_stride};
    }

    /* Spans: two documents inside the keys, sorted and disjoint. */
    fitm_span spans[2] = {{1, 1 + n_keys / 3}, {n_keys / 3 + 2, n_keys / 3 + 2 + n_keys / 4 + 1}};
    float alpha[2] = {0.8f, 0.2f};
    fitm_intervention iv = {
        .spans = spans, .n_spans = 2, .alpha = alpha, .layers = NULL, .from_pos = c->pos0 + T / 2};
    /* Capture rows: the first and the last of the call. */
    int64_t rows[2] = {c->pos0, c->pos0 + T - 1};
    int32_t n_rows = T > 1 ? 2 : 1;
    int32_t *cap_index = malloc((size_t)T * sizeof *cap_index);
    for (int64_t i = 0; i < T; i++)
        cap_index[i] = i == 0 ? 0 : i == T - 1 ? 1 : -1;
    const int64_t stride = n_keys + 3;
    float *span_mass = calloc((size_t)n_rows * L * c->H * 2, sizeof(float));
    float *probs = calloc((size_t)((int64_t)n_rows * L * c->H * stride), sizeof(float));
    fitm_capture cap = {.rows = rows,
                        .n_rows = n_rows,
                        .spans = spans,
                        .n_spans = 2,
                        .span_mass = span_mass,
                        .probs = probs,
                        .probs_stride = stride,
                        .after_intervention = c->after};
    fitm_attn_args a = {.layer = layer,
                        .T = T,
                        .pos0 = c->pos0,
                        .n_head = c->H,
                        .n_head_kv = c->Hkv,
                        .head_dim = c->D,
                        .scale = 1.0f / sqrtf((float)D),
                        .window = c->window,
                        .q = q,
                        .out = out,
                        .k_pre = kp,
                        .v_pre = vp,
                        .k_own = ko,
                        .v_own = vo,
                        .own_base = c->own_base,
                        .kv_half = half,
                        .capture = c->capture ? &cap : NULL,
                        .cap_index = c->capture ? cap_index : NULL,
                        .n_layer = L,
                        .intervention = c->intervene ? &iv : NULL,
                        .mix = E > 0 ? &mix : NULL};
    fitm_err err = {{0}};
    CHECK(b->ops->reserve(b, T, n_keys, D, &err) == FITM_OK, "reserve: %s", err.msg);
    b->ops->attention(b, &a);
    float *got = to_host(b, out, T * HD);

    double *want = calloc((size_t)(T * HD), sizeof *want), *p = malloc((size_t)n_keys * sizeof *p);
    double *want_mag = calloc((size_t)(T * HD), sizeof *want_mag); /* sum_j p_j |v_j| */
    double *pre = malloc((size_t)n_keys * sizeof *pre);
    float *want_probs = calloc((size_t)((int64_t)n_rows * L * c->H * stride), sizeof(float));
    double *want_mass = calloc((size_t)n_rows * L * c->H * 2, sizeof(double));
    for (int64_t i = 0; i < T; i++) {
        const int64_t pos = c->pos0 + i;
        bool do_iv = c->intervene && pos >= iv.from_pos;
        for (int32_t h = 0; h < c->H; h++) {
            const int32_t g = h / (c->H / c->Hkv);
            ref_probs(c, qh, kph, koh, E > 0 ? &mxh : NULL, i, h, &iv, do_iv, p);
            for (int64_t j = 0; j <= pos; j++) {
                const float *v =
                    (j < c->own_base ? vph + j * HkvD : voh + (j - c->own_base) * HkvD) + g * D;
                for (int64_t d = 0; d < D; d++) {
                    want[(i * c->H + h) * D + d] += p[j] * v[d];
                    want_mag[(i * c->H + h) * D + d] += p[j] * fabs(v[d]);
                }
            }
            if (cap_index[i] < 0)
                continue;
            /* the captured row: after the intervention when asked, else before it */
            const double *cp = p;
            if (do_iv && !c->after) {
                ref_probs(c, qh, kph, koh, E > 0 ? &mxh : NULL, i, h, &iv, false, pre);
                cp = pre;
            }
            int64_t slot = ((int64_t)cap_index[i] * L + layer) * c->H + h;
            for (int64_t j = 0; j <= pos; j++)
                want_probs[slot * stride + j] = (float)cp[j];
            for (int s = 0; s < 2; s++)
                for (int64_t j = spans[s].start; j < spans[s].end && j <= pos; j++)
                    want_mass[slot * 2 + s] += cp[j];
        }
    }
    char what[176];
    snprintf(what, sizeof what,
             "attention T %lld pos0 %lld own_base %lld window %lld H %d Hkv %d D %d%s%s%s mix %d "
             "%s KV",
             (long long)T, (long long)c->pos0, (long long)c->own_base, (long long)c->window,
             (int)c->H, (int)c->Hkv, (int)c->D, c->capture ? " capture" : "",
             c->intervene ? " intervene" : "", c->after ? " (after)" : "", (int)E,
             half ? "fp16" : "F32");
    check_close(what, got, want, T * HD, NULL, 2e-5);
    const int64_t np = (int64_t)n_rows * L * c->H * stride, nm = (int64_t)n_rows * L * c->H * 2;
    if (c->capture) {
        double *wp = malloc((size_t)np * sizeof *wp);
        for (int64_t i = 0; i < np; i++)
            wp[i] = want_probs[i];
        char w2[224];
        snprintf(w2, sizeof w2, "%s: captured probs", what);
        check_close(w2, probs, wp, np, NULL, 2e-5);
        snprintf(w2, sizeof w2, "%s: captured span mass", what);
        check_close(w2, span_mass, want_mass, nm, NULL, 2e-5);
        free(wp);
    }
    if (b->ops->attention_many && T > 1 && E == 0) {
        /* A decode step of T sequences, one row each, as one attention_many: every row (and
         * capture) bit for bit as in the one call above. The CPU backend spreads the calls
         * over its threads with other head groupings; the CUDA backend launches the calls
         * without a capture together, each block reading its call's arguments. Without a
         * capture, each call gets Eq. 5 weights of its own, as the sequences of a calibrated
         * decode step do, and the reference is then the calls one by one. */
        cap_aside aside = cap_set_aside(probs, np, span_mass, nm);
        const bool vary = c->intervene && !c->capture;
        float *out2 = to_dev(b, NULL, T * HD);
        fitm_attn_args *many = malloc((size_t)T * sizeof *many);
        fitm_intervention *ivs = malloc((size_t)T * sizeof *ivs);
        float *alphas = malloc((size_t)(2 * T) * sizeof *alphas);
        for (int64_t i = 0; i < T; i++) {
            many[i] = row_call(&a, i, out2);
            alphas[2 * i] = 0.9f - 0.07f * (float)(i % 9);
            alphas[2 * i + 1] = 1.0f - alphas[2 * i];
            ivs[i] = iv;
            ivs[i].alpha = alphas + 2 * i;
            if (vary)
                many[i].intervention = &ivs[i];
        }
        b->ops->attention_many(b, many, (int)T);
        float *got2 = to_host(b, out2, T * HD);
        char w4[256];
        if (vary) {
            float *out3 = to_dev(b, NULL, T * HD);
            for (int64_t i = 0; i < T; i++) {
                fitm_attn_args a3 = many[i];
                a3.out = out3 + i * HD;
                b->ops->attention(b, &a3);
            }
            float *got3 = to_host(b, out3, T * HD);
            snprintf(w4, sizeof w4, "%s: attention_many, weights per call, equals the calls",
                     what);
            CHECK(memcmp(got2, got3, (size_t)(T * HD) * sizeof(float)) == 0, "%s", w4);
            free(got3);
            b->ops->free(b, out3);
        } else {
            snprintf(w4, sizeof w4, "%s: attention_many of one-row calls equals one call", what);
            CHECK(memcmp(got2, got, (size_t)(T * HD) * sizeof(float)) == 0, "%s", w4);
        }
        if (c->capture)
            CHECK(cap_same(&aside), "%s: captures", w4);
        cap_put_back(&aside);
        free(got2), free(many), free(ivs), free(alphas);
        b->ops->free(b, out2);
    }
    if (T > 1 && E == 0 && !half) {
        /* The same call as a batched one (fitm_attn_args.batched): its captured and intervened
         * rows, and the captures, bit for bit the call's above; its plain rows within 2^-6 of
         * sum_j w_j |v_j| of the reference (the CUDA backend's tensor-core kernel rounds Q, K,
         * V and the weights to bfloat16; its own test bounds it tightly), or bit for bit where
         * the backend has one arithmetic for both (the CPU's). */
        cap_aside aside = cap_set_aside(probs, np, span_mass, nm);
        float *outb = to_dev(b, NULL, T * HD);
        fitm_attn_args ab = a;
        ab.out = outb, ab.batched = true;
        b->ops->attention(b, &ab);
        float *gotb = to_host(b, outb, T * HD);
        const bool exact = strcmp(b->ops->name, "cpu") == 0;
        double *bound = malloc((size_t)HD * sizeof *bound);
        char w5[256];
        for (int64_t i = 0; i < T; i++) {
            const bool plain = !(c->capture && cap_index[i] >= 0) &&
                               !(c->intervene && c->pos0 + i >= iv.from_pos);
            snprintf(w5, sizeof w5, "%s: batched, row %lld (%s)", what, (long long)i,
                     plain ? "plain" : "captured or intervened");
            if (exact || !plain) {
                CHECK(memcmp(gotb + i * HD, got + i * HD, (size_t)HD * sizeof(float)) == 0, "%s",
                      w5);
                continue;
            }
            for (int64_t e = 0; e < HD; e++)
                bound[e] = want_mag[i * HD + e] + 1e-3;
            check_close(w5, gotb + i * HD, want + i * HD, HD, bound, 0x1p-6);
        }
        if (c->capture)
            CHECK(cap_same(&aside), "%s: batched: captures", what);
        cap_put_back(&aside);
        free(gotb), free(bound);
        b->ops->free(b, outb);
    }
    if (strcmp(b->ops->name, "cpu") == 0 && T > 1 && E == 0) {
        /* The CPU backend's promise: a row's values do not depend on the call it came in.
         * The same rows again, one call each (as decode steps run them; several heads of a
         * group then share a task), bit for bit, captures included. */
        cap_aside aside = cap_set_aside(probs, np, span_mass, nm);
        float *out1 = to_dev(b, NULL, T * HD);
        for (int64_t i = 0; i < T; i++) {
            const fitm_attn_args a1 = row_call(&a, i, out1);
            b->ops->attention(b, &a1);
        }
        float *got1 = to_host(b, out1, T * HD);
        char w3[224];
        snprintf(w3, sizeof w3, "%s: one call per row equals one call", what);
        CHECK(memcmp(got1, got, (size_t)(T * HD) * sizeof(float)) == 0, "%s", w3);
        if (c->capture)
            CHECK(cap_same(&aside), "%s: captures", w3);
        cap_put_back(&aside);
        free(got1);
        b->ops->free(b, out1);
    }
    free(got), free(want), free(want_mag), free(p), free(pre), free(want_probs), free(want_mass);
    free(span_mass), free(probs), free(cap_index);
    free(qh), free(kph), free(vph), free(koh), free(voh);
    b->ops->free(b, q), b->ops->free(b, out), b->ops->free(b, kp), b->ops->free(b, vp);
    b->ops->free(b, ko), b->ops->free(b, vo);
    if (E > 0) {
        free(mqh), free(mkh), free(mwh);
        b->ops->free(b, mq), b->ops->free(b, mk), b->ops->free(b, mw);
    }
}

/* No argument: every slot. "attention": only the attention cases 0, 4, 6 and 8 (GQA; capture
 * with prefix rows; capture, intervention and prefix rows; a mixture), for the ThreadSanitizer
 * build of tests/meson.build, where each CUDA thread is an OS thread. */
int main(int argc, char **argv)
{
    const bool attention_only = argc > 1 && strcmp(argv[1], "attention") == 0;
    /* tests/meson.build runs this once per SIMD path (FITM_CPU); one the CPU lacks skips */
    const char *forced = getenv("FITM_CPU");
    int want = forced ? fitm_cpu_parse_path(forced) : -1;
    if (want >= 0 && !fitm_cpu_supports((fitm_cpu_path_id)want)) {
        printf("SKIP test_backend_ops: this CPU has no %s path\n", forced);
        return 77;
    }
    fitm_backend *b = make_backend();
    fitm_err err = {{0}};
    if (b->ops->reserve(b, 64, 256, 2048, &err) != FITM_OK) {
        fprintf(stderr, "reserve: %s\n", err.msg);
        return 1;
    }
    static const fitm_dtype types[] = {FITM_DTYPE_F32,  FITM_DTYPE_F16,  FITM_DTYPE_BF16,
                                       FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q8_0,
                                       FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0] && !attention_only; i++) {
        fitm_dtype t = types[i];
        int64_t blk = fitm_dtype_info_of(t)->block_elems;
        int64_t K = blk == 1 ? 37 : blk * 3; /* odd: 37 floats, 3 blocks */
        test_embed(b, t, 11, K);
        test_matmul(b, t, 1, K, 7, 5);
        test_matmul(b, t, 13, K, 33, 3);
    }
    if (attention_only)
        goto attention;
    test_rmsnorm(b, 7, 45, false);
    test_rmsnorm(b, 1, 640, true);
    for (int64_t n = 1; n <= 40; n += 3) /* every tail of the lanes and of the vectors */
        test_rmsnorm(b, 3, n, n % 2);
    test_rmsnorm(b, 5, 256, false);
    test_rope(b, 5, 3, 16, 16, false);
    test_rope(b, 3, 2, 24, 16, true);
    test_elementwise(b, 1001);
    test_qk_rope(b, 3, 4, 1, 32, 32, true, true);
    test_qk_rope(b, 5, 3, 3, 24, 16, false, true);
    test_qk_rope(b, 4, 6, 2, 16, 16, false, false);
    test_matmul_glu(b, FITM_DTYPE_Q8_0, FITM_DTYPE_Q8_0, 1, 64, 9);
    test_matmul_glu(b, FITM_DTYPE_Q4_K, FITM_DTYPE_Q4_K, 11, 256, 7);
    test_matmul_glu(b, FITM_DTYPE_F32, FITM_DTYPE_F32, 3, 37, 5);
    test_matmul_glu(b, FITM_DTYPE_Q4_K, FITM_DTYPE_Q6_K, 2, 256, 6); /* two types */
    /* fp16 KV caches: where the backend has them (with the two conversions), else refused */
    CHECK(fitm_backend_set_kv_half(b, true, &err) ==
              (b->ops->kv_half ? FITM_OK : FITM_ERR_UNSUPPORTED),
          "set_kv_half on the %s backend: %s", b->ops->name, err.msg);
    CHECK(!b->ops->kv_half || (b->ops->to_half && b->ops->from_half));
    CHECK(fitm_backend_set_kv_half(b, false, &err) == FITM_OK && !b->kv_half);
    if (b->ops->kv_half) {
        test_half(b, 1);
        test_half(b, 4099); /* vectors of 16 and 8 and a scalar tail */
    }
    /* the stores of a step's sequences as one job: a few, more than one CUDA launch takes */
    for (int half = 0; b->ops->kv_store_many && half < (b->ops->kv_half ? 2 : 1); half++) {
        test_kv_store_many(b, 2, half);
        test_kv_store_many(b, 7, half);
        test_kv_store_many(b, 70, half);
    }
    /* one-block rows, rows split over chunks (> 4096 on the device), k 1 (greedy) to 64 */
    test_topk(b, 1, 1, 1, 0);
    test_topk(b, 3, 77, 1, 3);
    test_topk(b, 2, 77, 64, 0);
    test_topk(b, 2, 999, 17, 5);
    test_topk(b, 1, 5003, 64, 4);
    test_topk(b, 3, 4099, 64, 0);
    test_topk(b, 2, 100, 64, -1); /* fewer numbers than k: the list ends in NaNs */
    test_topk(b, 2, 20000, 64, -1);
    test_topk(b, 2, 70001, 1, 2);
    test_topk(b, 8, 4099, 40, 1); /* a decode step of 8 sequences: rows over the threads */
    /* Gemma 3's vocabulary, one-entry rows, rows over the threads, relevance's 8 answers */
    CHECK(b->ops->logprob != NULL, "the %s backend has no logprob", b->ops->name);
    if (b->ops->logprob) {
        test_logprob(b, 3, 262144, FITM_PICK_MAX, 0);
        test_logprob(b, 2, 1, 2, 0);
        test_logprob(b, 4, 5003, 8, 1);
        test_logprob(b, 2, 300, 3, 2);
        test_logprob(b, 33, 777, 1, 0);
        test_logprob(b, 4, 262147, 3, 4);
        if (strcmp(b->ops->name, "cpu") == 0)
            test_logprob(b, 8, 4099, 3, 3);
    }
attention:;
    static const attn_case cases[] = {
        {.T = 9, .pos0 = 0, .own_base = 0, .window = 0, .H = 4, .Hkv = 2, .D = 16},
        {.T = 1, .pos0 = 20, .own_base = 0, .window = 0, .H = 3, .Hkv = 1, .D = 8},
        /* heads of a group in one task (6 rows), head dims of 4 vectors and a remainder */
        {.T = 3, .pos0 = 9, .own_base = 3, .window = 0, .H = 4, .Hkv = 1, .D = 72,
         .capture = true, .intervene = true},
        {.T = 17, .pos0 = 5, .own_base = 0, .window = 6, .H = 2, .Hkv = 2, .D = 32},
        {.T = 7,
         .pos0 = 11,
         .own_base = 11,
         .window = 0,
         .H = 4,
         .Hkv = 1,
         .D = 16,
         .capture = true},
        {.T = 21,
         .pos0 = 4,
         .own_base = 4,
         .window = 0,
         .H = 2,
         .Hkv = 1,
         .D = 8,
         .capture = true,
         .intervene = true},
        {.T = 21,
         .pos0 = 4,
         .own_base = 2,
         .window = 0,
         .H = 2,
         .Hkv = 1,
         .D = 8,
         .capture = true,
         .intervene = true,
         .after = true},
        {.T = 70,
         .pos0 = 0,
         .own_base = 0,
         .window = 33,
         .H = 2,
         .Hkv = 2,
         .D = 8,
         .capture = true,
         .intervene = true,
         .after = true},
        /* mixtures (the position methods): MoICE-like (experts share the KV heads) and
         * Ms-PoE-like (one expert per head, keys per query head) */
        {.T = 13, .pos0 = 6, .own_base = 6, .window = 0, .H = 4, .Hkv = 1, .D = 16,
         .capture = true, .intervene = true, .mix = 3, .mix_kh = 1},
        {.T = 9, .pos0 = 30, .own_base = 0, .window = 12, .H = 2, .Hkv = 2, .D = 8,
         .capture = true, .intervene = true, .after = true, .mix = 2, .mix_kh = 2},
        {.T = 1, .pos0 = 40, .own_base = 40, .window = 0, .H = 4, .Hkv = 2, .D = 32,
         .capture = true, .mix = 4, .mix_kh = 4},
        /* an intervention without a capture (a calibrated decode step's rows: the CUDA
         * backend's attention_many launches them together), prefix rows, GQA, a window */
        {.T = 12, .pos0 = 7, .own_base = 5, .window = 0, .H = 4, .Hkv = 2, .D = 24,
         .intervene = true},
        {.T = 6, .pos0 = 19, .own_base = 19, .window = 9, .H = 2, .Hkv = 1, .D = 40,
         .intervene = true},
    };
    for (int half = 0; half < (b->ops->kv_half ? 2 : 1); half++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (!attention_only || i == 0 || i == 4 || i == 6 || i == 8)
                test_attention(b, &cases[i], half);
    fitm_backend_destroy(b);
    printf("%d checks, %d failed (cpu path %s)\n", n_checks, failures,
           fitm_cpu_path_name(fitm_cpu_path()));
    return failures ? 1 : 0;
}
