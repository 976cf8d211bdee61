/* bench_quant: single-thread speed of the quant module (not a test; prints, asserts nothing).
 *
 *   matvec  GB/s of weight bytes streamed per type, for a weight matrix of ~64 MiB (larger
 *           than the last-level cache, as in decoding a real model) and for a cache-resident
 *           one (~1 MiB), with the activation quantization included; baseline: cblas_sgemv
 *           on the same shape in F32.
 *   matmul  GFLOP/s of Y (M, N) = X (M, K) . W^T at M = 512 per type; baseline: one plain
 *           F32 cblas_sgemm of the same shape.
 *   packed  GMAC/s of fitm_matvec_rows_packed (the quantized products of a step of several
 *           rows on AVX-512: /rerank's passes, decode steps of many sequences) per packed type
 *           at M = 1, 8, 16 and 32 activation rows, N = 2048, the weight cache-resident; no
 *           baseline inside: run another build's bench_quant beside it. Skipped where the path
 *           keeps weights as stored (fitm_pack_bytes 0).
 *
 * Usage: bench_quant [K] [seconds-per-measurement]   (defaults 2048, 0.3; K a multiple of 32,
 * K-quant types are skipped unless it is a multiple of 256; Gemma 3 270M has K = 640). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "compute/quant.h"

/* Wall-clock by default; FITM_BENCH_CLOCK=cpu measures this thread's CPU time instead, which
 * is steadier on a machine shared with other work (it hides memory stalls no better). */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(bench_clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 0x1234567;
static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static const fitm_dtype types[] = {
    FITM_DTYPE_F32, FITM_DTYPE_F16, FITM_DTYPE_BF16, FITM_DTYPE_Q8_0, FITM_DTYPE_Q4_0,
    FITM_DTYPE_Q5_0, FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K,
};
#define N_TYPES (int)(sizeof types / sizeof types[0])

/* A (N, K) weight of type t: 16 distinct quantized rows repeated (content does not affect
 * speed; quantizing 64 MiB of K-quants would take longer than the benchmark). */
static void *make_weight(fitm_dtype t, int64_t N, int64_t K)
{
    size_t rb = fitm_dtype_row_bytes(t, K);
    uint8_t *W = malloc(rb * (size_t)N);
    float *row = malloc((size_t)K * sizeof(float));
    for (int64_t r = 0; r < N; r++) {
        if (r < 16) {
            for (int64_t k = 0; k < K; k++)
                row[k] = frand() * 0.05f;
            fitm_quant_row(t, row, W + rb * r, K);
        } else {
            memcpy(W + rb * r, W + rb * (r % 16), rb);
        }
    }
    free(row);
    return W;
}

/* Seconds per call of matvec including the activation quantization. */
static double time_matvec(fitm_dtype t, const uint8_t *W, int64_t N, int64_t K, const float *x,
                          void *xq, float *y, double budget)
{
    int reps = 0;
    double t0 = now_s(), t1;
    do {
        fitm_quant_row(fitm_quant_vec_dtype(t), x, xq, K);
        fitm_matvec(t, W, K, xq, y, 0, N);
        reps++;
    } while ((t1 = now_s()) - t0 < budget || reps < 3);
    return (t1 - t0) / reps;
}

static double time_sgemv(const float *W, int64_t N, int64_t K, const float *x, float *y, double budget)
{
    int reps = 0;
    double t0 = now_s(), t1;
    do {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)N, (int)K, 1.0f, W, (int)K, x, 1, 0.0f, y, 1);
        reps++;
    } while ((t1 = now_s()) - t0 < budget || reps < 3);
    return (t1 - t0) / reps;
}

static void bench_matvec(int64_t K, double budget, size_t target_bytes, const char *label)
{
    float *x = malloc((size_t)K * sizeof(float));
    for (int64_t k = 0; k < K; k++)
        x[k] = frand();
    void *xq = malloc((size_t)K * sizeof(float) + 1024);

    int64_t Nf = (int64_t)(target_bytes / ((size_t)K * sizeof(float)));
    float *Wf = make_weight(FITM_DTYPE_F32, Nf, K);
    float *yf = malloc((size_t)Nf * sizeof(float));
    double tb = time_sgemv(Wf, Nf, K, x, yf, budget);
    double gbs_base = (double)Nf * K * 4 / tb / 1e9;
    printf("matvec %s, K=%ld: baseline cblas_sgemv F32 N=%ld: %.2f GB/s (%.3f ms)\n", label,
           (long)K, (long)Nf, gbs_base, tb * 1e3);
    free(Wf);
    free(yf);
    printf("  %-5s %8s %9s %9s %10s %8s\n", "type", "N", "MiB", "GB/s", "Gelem/s", "vs sgemv");
    for (int i = 0; i < N_TYPES; i++) {
        fitm_dtype t = types[i];
        size_t rb = fitm_dtype_row_bytes(t, K);
        if (rb == 0)
            continue;
        int64_t N = (int64_t)(target_bytes / rb);
        uint8_t *W = make_weight(t, N, K);
        float *y = malloc((size_t)N * sizeof(float));
        double s = time_matvec(t, W, N, K, x, xq, y, budget);
        double gbs = (double)rb * N / s / 1e9;
        printf("  %-5s %8ld %9.1f %9.2f %10.2f %7.2fx\n", fitm_dtype_info_of((int)t)->name, (long)N,
               (double)rb * N / 1048576.0, gbs, (double)N * K / s / 1e9, gbs / gbs_base);
        free(W);
        free(y);
    }
    free(x);
    free(xq);
}

static void bench_matmul(int64_t K, double budget)
{
    const int64_t M = 512, N = 2048;
    float *X = malloc((size_t)(M * K) * sizeof(float));
    float *Y = malloc((size_t)(M * N) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++)
        X[i] = frand();
    float *scratch = malloc(fitm_matmul_scratch_floats(K) * sizeof(float));
    const double flop = 2.0 * (double)M * N * K;

    float *Wf = make_weight(FITM_DTYPE_F32, N, K);
    int reps = 0;
    double t0 = now_s(), t1;
    do {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, X,
                    (int)K, Wf, (int)K, 0.0f, Y, (int)N);
        reps++;
    } while ((t1 = now_s()) - t0 < budget || reps < 2);
    double base = flop / ((t1 - t0) / reps) / 1e9;
    free(Wf);
    printf("matmul M=%ld N=%ld K=%ld: baseline cblas_sgemm F32: %.1f GFLOP/s\n", (long)M, (long)N,
           (long)K, base);
    printf("  %-5s %10s %8s\n", "type", "GFLOP/s", "vs sgemm");
    for (int i = 0; i < N_TYPES; i++) {
        fitm_dtype t = types[i];
        if (fitm_dtype_row_bytes(t, K) == 0)
            continue; /* K-quants need K % 256 == 0 */
        uint8_t *W = make_weight(t, N, K);
        reps = 0;
        t0 = now_s();
        do {
            fitm_matmul(t, W, K, X, M, Y, N, 0, N, scratch);
            reps++;
        } while ((t1 = now_s()) - t0 < budget || reps < 2);
        double g = flop / ((t1 - t0) / reps) / 1e9;
        printf("  %-5s %10.1f %7.2fx\n", fitm_dtype_info_of((int)t)->name, g, g / base);
        free(W);
    }
    free(X);
    free(Y);
    free(scratch);
}

static void bench_packed(int64_t K, double budget)
{
    static const fitm_dtype packed[] = {FITM_DTYPE_Q8_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q4_K,
                                        FITM_DTYPE_Q6_K};
    static const int64_t rows[] = {1, 8, 16, 32};
    const int64_t N = 2048, M_MAX = 32;
    float *x = malloc((size_t)K * sizeof(float)), *Y = malloc((size_t)(M_MAX * N) * sizeof(float));
    printf("packed products, N=%ld K=%ld: GMAC/s\n  %-5s", (long)N, (long)K, "type");
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
        printf(" %6s%-3ld", "M=", (long)rows[r]);
    printf("\n");
    for (size_t i = 0; i < sizeof packed / sizeof packed[0]; i++) {
        const fitm_dtype t = packed[i], vt = fitm_quant_vec_dtype(t);
        const size_t pb = fitm_pack_bytes(t, N, K), xb = fitm_dtype_row_bytes(vt, K);
        if (pb == 0 || xb == 0)
            continue; /* no packed layout here, or K not a multiple of the type's block */
        uint8_t *W = make_weight(t, N, K), *P = malloc(pb), *xq = malloc((size_t)M_MAX * xb);
        fitm_pack(t, W, N, K, P);
        for (int64_t m = 0; m < M_MAX; m++) {
            for (int64_t k = 0; k < K; k++)
                x[k] = frand();
            fitm_quant_row(vt, x, xq + (size_t)m * xb, K);
        }
        printf("  %-5s", fitm_dtype_info_of((int)t)->name);
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
            const int64_t M = rows[r];
            int reps = 0;
            double t0 = now_s(), t1;
            do {
                fitm_matvec_rows_packed(t, P, K, xq, xb, M, Y, N, 0, N);
                reps++;
            } while ((t1 = now_s()) - t0 < budget || reps < 3);
            printf(" %9.1f", (double)M * N * K / ((t1 - t0) / reps) / 1e9);
        }
        printf("\n");
        free(W);
        free(P);
        free(xq);
    }
    free(x);
    free(Y);
}

int main(int argc, char **argv)
{
    int64_t K = argc > 1 ? atoll(argv[1]) : 2048;
    double budget = argc > 2 ? atof(argv[2]) : 0.3;
    if (K <= 0 || K % 32 != 0) {
        fprintf(stderr, "bench_quant: K must be a positive multiple of 32\n");
        return 2;
    }
    const char *clk = getenv("FITM_BENCH_CLOCK");
    if (clk && strcmp(clk, "cpu") == 0)
        bench_clock = CLOCK_THREAD_CPUTIME_ID;
    printf("bench_quant: single thread, %s time\n", clk && !strcmp(clk, "cpu") ? "CPU" : "wall-clock");
    fitm_quant_blas_single_thread();
    bench_matvec(K, budget, (size_t)64 << 20, "64 MiB (memory)");
    bench_matvec(K, budget, (size_t)1 << 20, "1 MiB (cache)");
    bench_matmul(K, budget);
    bench_packed(K, budget);
    return 0;
}
