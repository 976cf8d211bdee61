/* bench_decode: the two kernels that a decode step of several sequences spends most of its time
 * in, alone, on random data (no model): the attention of S sequences (attention_many, one row
 * each, 4 query heads on one KV head of 256 dims, over CTX keys of each sequence's own cache,
 * for L layers, 5 of every 6 with a 512-key window as in Gemma 3) and the packed Q8_0 / Q5_0
 * products (an N x 640 weight, the shape of Gemma 3 270M's output head at N = 262144) with
 * M = 1, 4, 8 activation rows. Prints the best of R runs in ms and the bytes streamed per
 * second; asserts nothing about speed (docs/cpu-forward-benchmark.md).
 *
 *   bench_decode [-t THREADS] [-s 8] [-c 540] [-l 18] [-n 65536] [-r 9] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compute/quant.h"
#include "model/backend.h"

enum { HEADS = 4, DIM = 256, K_COLS = 640 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* Value i of a K/V array of fp16 (half) or F32 values. */
static void put(void *p, size_t i, float x, bool half)
{
    if (half) {
        const uint16_t h = fitm_fp32_to_fp16(x);
        memcpy((unsigned char *)p + i * sizeof h, &h, sizeof h);
    } else {
        memcpy((unsigned char *)p + i * sizeof x, &x, sizeof x);
    }
}

static int bench_attention(int threads, int S, int64_t ctx, int L, int reps, bool half)
{
    fitm_err err = {{0}};
    fitm_backend *b = NULL;
    if (fitm_backend_cpu_create(&b, threads, &err) != FITM_OK ||
        b->ops->reserve(b, S, ctx, DIM * HEADS, &err) != FITM_OK) {
        fprintf(stderr, "bench_decode: %s\n", err.msg);
        fitm_backend_destroy(b);
        return 1;
    }
    const size_t es = half ? sizeof(uint16_t) : sizeof(float), per = (size_t)ctx * DIM;
    const size_t n = per * (size_t)S * (size_t)L;
    void *K = malloc(n * es), *V = malloc(n * es);
    float *q = malloc(sizeof(float) * (size_t)(S * HEADS * DIM)),
          *o = malloc(sizeof(float) * (size_t)(S * HEADS * DIM));
    fitm_attn_args *a = calloc((size_t)S, sizeof *a);
    if (!K || !V || !q || !o || !a) {
        fprintf(stderr, "bench_decode: out of memory\n");
        free(K), free(V), free(q), free(o), free(a);
        fitm_backend_destroy(b);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        put(K, i, frand(), half);
        put(V, i, frand(), half);
    }
    for (int i = 0; i < S * HEADS * DIM; i++)
        q[i] = frand();
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        for (int l = 0; l < L; l++) {
            for (int s = 0; s < S; s++) {
                const size_t at = ((size_t)l * (size_t)S + (size_t)s) * per * es;
                a[s] = (fitm_attn_args){.layer = l, .T = 1, .pos0 = ctx - 1, .n_head = HEADS,
                                        .n_head_kv = 1, .head_dim = DIM, .scale = 0.0625f,
                                        .window = l % 6 == 5 ? 0 : 512, .q = q + s * HEADS * DIM,
                                        .out = o + s * HEADS * DIM,
                                        .k_own = (const unsigned char *)K + at,
                                        .v_own = (const unsigned char *)V + at, .kv_half = half};
            }
            b->ops->attention_many(b, a, S);
        }
        const double dt = now_s() - t0;
        best = dt < best ? dt : best;
    }
    printf("attention  %d seqs x %d layers, %lld keys, %-4s KV, %d threads: %8.3f ms/step %7.1f "
           "GB/s of K and V\n",
           S, L, (long long)ctx, half ? "fp16" : "F32", threads, best * 1e3,
           (double)(2 * n * es) / best / 1e9);
    free(K), free(V), free(q), free(o), free(a);
    fitm_backend_destroy(b);
    return 0;
}

typedef struct {
    fitm_dtype t;
    const void *P, *xq;
    size_t x_stride;
    int64_t M, N, n0, n1;
    float *Y;
} mv_part;

static void *mv_run(void *arg)
{
    const mv_part *p = arg;
    fitm_matvec_rows_packed(p->t, p->P, K_COLS, p->xq, p->x_stride, p->M, p->Y, p->N, p->n0, p->n1);
    return NULL;
}

static int bench_packed(fitm_dtype t, int threads, int64_t N, int reps)
{
    const size_t pb = fitm_pack_bytes(t, N, K_COLS);
    if (!pb) {
        printf("packed %s: not on this CPU's path (AVX-512 only)\n", fitm_dtype_info_of(t)->name);
        return 0;
    }
    const size_t rb = fitm_dtype_row_bytes(t, K_COLS);
    const fitm_dtype vt = fitm_quant_vec_dtype(t);
    const size_t xs = fitm_dtype_row_bytes(vt, K_COLS);
    uint8_t *W = malloc(rb * (size_t)N), *P = malloc(pb), *xq = malloc(xs * 8);
    float *Y = malloc(sizeof(float) * (size_t)N * 8), row[K_COLS];
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    mv_part *parts = calloc((size_t)threads, sizeof *parts);
    if (!W || !P || !xq || !Y || !tid || !parts) {
        fprintf(stderr, "bench_decode: out of memory\n");
        free(W), free(P), free(xq), free(Y), free(tid), free(parts);
        return 1;
    }
    for (int64_t r = 0; r < N; r++) {
        for (int k = 0; k < K_COLS; k++)
            row[k] = frand();
        fitm_quant_row(t, row, W + rb * (size_t)r, K_COLS);
    }
    fitm_pack(t, W, N, K_COLS, P);
    free(W);
    for (int m = 0; m < 8; m++) {
        for (int k = 0; k < K_COLS; k++)
            row[k] = frand();
        fitm_quant_row(vt, row, xq + xs * (size_t)m, K_COLS);
    }
    const int64_t groups = N / FITM_PACK_ROWS;
    static const int64_t rows_per_call[] = {1, 4, 8};
    for (size_t c = 0; c < sizeof rows_per_call / sizeof *rows_per_call; c++) {
        const int64_t M = rows_per_call[c];
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            const double t0 = now_s();
            for (int i = 0; i < threads; i++) {
                parts[i] = (mv_part){t, P, xq, xs, M, N, groups * i / threads * FITM_PACK_ROWS,
                                     groups * (i + 1) / threads * FITM_PACK_ROWS, Y};
                if (i > 0)
                    pthread_create(&tid[i], NULL, mv_run, &parts[i]);
            }
            mv_run(&parts[0]);
            for (int i = 1; i < threads; i++)
                pthread_join(tid[i], NULL);
            const double dt = now_s() - t0;
            best = dt < best ? dt : best;
        }
        printf("packed %-4s %lld x %d, M = %lld rows, %d threads: %8.3f ms %7.1f GB/s of weights "
               "%7.1f G products/s\n",
               fitm_dtype_info_of(t)->name, (long long)N, K_COLS, (long long)M, threads, best * 1e3,
               (double)pb / best / 1e9, (double)N * K_COLS * (double)M / best / 1e9);
    }
    free(P), free(xq), free(Y), free(tid), free(parts);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 2, S = 8, L = 18, reps = 9;
    int64_t ctx = 540, N = 65536;
    for (int i = 1; i < argc; i += 2) { /* flag and value pairs */
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            goto usage;
        if (!strcmp(f, "-t"))
            threads = atoi(v);
        else if (!strcmp(f, "-s"))
            S = atoi(v);
        else if (!strcmp(f, "-c"))
            ctx = atol(v);
        else if (!strcmp(f, "-l"))
            L = atoi(v);
        else if (!strcmp(f, "-n"))
            N = atol(v);
        else if (!strcmp(f, "-r"))
            reps = atoi(v);
        else
            goto usage;
    }
    if (threads < 1 || threads > 64 || S < 1 || S > 64 || ctx < 1 || L < 1 || reps < 1 ||
        N < FITM_PACK_ROWS || N % FITM_PACK_ROWS)
        goto usage;
    int rc = bench_attention(threads, S, ctx, L, reps, true) ||
             bench_attention(threads, S, ctx, L, reps, false) ||
             bench_packed(FITM_DTYPE_Q8_0, threads, N, reps) ||
             bench_packed(FITM_DTYPE_Q5_0, threads, N, reps);
    return rc;
usage:
    fprintf(stderr, "usage: bench_decode [-t THREADS] [-s SEQS <= 64] [-c KEYS] [-l LAYERS] "
                    "[-n ROWS, a multiple of 16] [-r RUNS]\n");
    return 2;
}
