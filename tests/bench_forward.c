/* bench_forward: forward-pass speed, as llama-bench measures it (pp = prefill of P tokens
 * in one batch, tg = N single-token decode steps from an empty cache), next to the machine's
 * own sgemm ceiling measured in the same process, plus resident memory after loading.
 * With -B B: also B sequences decoding together, one fitm_forward_run_batch call per step
 * (what the server's continuous batching runs), as aggregate tok/s against tg's.
 *
 *   bench_forward -m MODEL [-b cpu|cuda] [-t THREADS] [-p 512] [-n 128] [-r REPS] [-B B]...
 *                 [--ref-pp TOK_S] [--ref-tg TOK_S]   (e.g. llama-bench's figures, for ratios)
 *
 * -b cuda (a CUDA build) runs on device 0; the sgemm ceiling stays the CPU's, so for the GPU's
 * limits see tests/bench_cuda.py, which runs this. It adds where a one-sequence decode step's
 * time goes (waiting for the device, submitting graphs, the rest of the host), with the
 * backend's fused kernels and graphs off and on.
 *
 * bench_forward_cuda_emu is this program on the CUDA emulator of tests/cuda_emu (-b cuda runs
 * the CUDA backend there; use small -p and -n: the emulator is slow): it adds what a prefill
 * of -p tokens and what a decode step ask of the device, from the emulator's counters (the
 * step with the backend's CUDA graphs off and on and its fused kernels off and on, side by
 * side): kernel launches, cuBLAS calls, copies and memsets, graph launches (the host's
 * submissions; a launch costs a real device a few microseconds of host time and leaves it idle
 * between kernels), kernels run, and host waits, for the prefill and per step, for one
 * sequence and for each -B.
 *
 * Prints best and median tok/s over the REPS runs (llama-bench prints mean +- stddev) in a
 * table; never fails on speed (benchmarks measure, tests assert). */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/pool.h"
#include "compute/ops.h"
#include "compute/quant.h"
#include "fitm_config.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#if FITM_HAVE_CUDA || defined(FITM_BENCH_CUDA_EMU)
#include "model/backend_cuda.h"
#endif
#ifdef FITM_BENCH_CUDA_EMU
#include <cuda_runtime_api.h>
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* VmRSS of this process in KiB, or -1. */
static long vm_rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6))
            kib = strtol(line + 6, NULL, 10);
    fclose(f);
    return kib;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n sorted values (mean of the middle two when n is even). */
static double median_sorted(const double *v, int n)
{
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    int n, k, m_per;
    float *a, *b, *c;
} sgemm_job;

static void sgemm_task(void *ctx, int64_t task, int thread)
{
    sgemm_job *j = ctx;
    (void)thread;
    /* each thread: C_t (n, m_per) = A (n, k) . B_t (m_per, k)^T, its own slice of B and C */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, j->m_per, j->k, 1.0f, j->a, j->k,
                j->b + (size_t)task * j->m_per * j->k, j->k, 0.0f,
                j->c + (size_t)task * j->n * j->m_per, j->m_per);
}

/* Best GFLOP/s of single-threaded sgemm calls run on every pool thread at once. */
static double sgemm_gflops(fitm_pool *pool, int threads)
{
    const int n = 512, k = 1024, m_per = 512;
    sgemm_job j = {n, k, m_per, NULL, NULL, NULL};
    j.a = malloc(sizeof(float) * n * k);
    j.b = malloc(sizeof(float) * (size_t)threads * m_per * k);
    j.c = malloc(sizeof(float) * (size_t)threads * n * m_per);
    if (!j.a || !j.b || !j.c) {
        free(j.a);
        free(j.b);
        free(j.c);
        return 0.0;
    }
    for (size_t i = 0; i < (size_t)n * k; i++)
        j.a[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < (size_t)threads * m_per * k; i++)
        j.b[i] = (float)(i % 5) * 0.1f;
    double best = 0.0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now_s();
        fitm_pool_run(pool, threads, sgemm_task, &j);
        double dt = now_s() - t0;
        double gf = 2.0 * n * k * m_per * threads / dt * 1e-9;
        best = gf > best ? gf : best;
    }
    free(j.a);
    free(j.b);
    free(j.c);
    return best;
}

/* Best aggregate tok/s over reps runs of B sequences decoding n_tg steps together, each from
 * a cache of its own holding ctx0 prompt tokens of its own (prefilled once, not timed; 0:
 * empty caches): every step one batched call with a token and a logit row per sequence. ids
 * holds at least ctx0 + n_tg tokens. */
static fitm_status bench_batched_decode(fitm_forward *fw, fitm_backend *b,
                                        const fitm_model_config *c, const int32_t *ids,
                                        long ctx0, long n_tg, int B, int reps, double *tps,
                                        fitm_err *err)
{
    fitm_kv *kv[FITM_FORWARD_MAX_SEQS] = {0};
    fitm_forward_seq seq[FITM_FORWARD_MAX_SEQS];
    fitm_forward_opts o[FITM_FORWARD_MAX_SEQS];
    fitm_top *top = malloc(sizeof *top * FITM_TOP_MAX * (size_t)B);
    fitm_status s = top ? FITM_OK : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const long n_ids = ctx0 + n_tg;
    int32_t *own = malloc(sizeof *own * (size_t)n_ids * (size_t)B);
    if (!own && !s)
        s = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int q = 0; q < B && !s; q++) { /* each sequence its own tokens: ids rotated */
        for (long i = 0; i < n_ids; i++)
            own[q * n_ids + i] = ids[(i + 7 * q) % n_ids];
        s = fitm_kv_create(&kv[q], b, c, n_ids, err);
        if (!s && ctx0 > 0)
            s = fitm_forward_run(fw, kv[q], own + q * n_ids, ctx0, 0, NULL, err);
    }
    double best = 0.0;
    for (int r = 0; r < reps && !s; r++) {
        for (int q = 0; q < B; q++) {
            fitm_kv_truncate(kv[q], ctx0);
            o[q] = (fitm_forward_opts){ /* what /answer's sampler takes, as the tg row */
                .n_logits = 1,
                .top_k = c->n_vocab < FITM_TOP_MAX ? (int32_t)c->n_vocab : FITM_TOP_MAX,
                .top = top + (size_t)q * FITM_TOP_MAX};
        }
        double t0 = now_s();
        for (long i = ctx0; i < n_ids && !s; i++) {
            for (int q = 0; q < B; q++)
                seq[q] = (fitm_forward_seq){kv[q], &own[q * n_ids + i], 1, i, &o[q]};
            s = fitm_forward_run_batch(fw, seq, B, err);
        }
        double tps_r = (double)B * n_tg / (now_s() - t0);
        best = tps_r > best ? tps_r : best;
    }
    for (int q = 0; q < B; q++)
        fitm_kv_destroy(kv[q]);
    free(own);
    free(top);
    *tps = best;
    return s;
}

#ifdef FITM_BENCH_CUDA_EMU
/* Prints what one prefill of the n_pp tokens ids with the options o (after a warm-up prefill
 * of the same size) asks of the emulated device, with the default fusion and graphs. */
static fitm_status bench_prefill_submissions(fitm_forward *fw, fitm_kv *kv, const int32_t *ids,
                                             long n_pp, fitm_forward_opts *o, fitm_err *err)
{
    fitm_emu_stats before = {0}, after = {0};
    fitm_status s = FITM_OK;
    for (int r = 0; r < 2 && !s; r++) { /* run 0 warms up (allocations, graphs) */
        fitm_kv_rebase(kv, 0, NULL);
        fitm_emu_get_stats(&before);
        s = fitm_forward_run(fw, kv, ids, n_pp, 0, o, err);
        fitm_emu_get_stats(&after);
    }
    if (s)
        return s;
#define D(f) (after.f - before.f)
    printf("\nwhat a prefill of %ld tokens asks of the device (emulator counters, fusion and "
           "graphs on)\n",
           n_pp);
    printf("| launches | cuBLAS | copies | graph launches | submissions | kernels run | of them "
           "programmatic | host waits |\n");
    printf("| -------: | -----: | -----: | -------------: | ----------: | ----------: | "
           "--------------------: | ---------: |\n");
    printf("| %8llu | %6llu | %6llu | %14llu | %11llu | %11llu | %20llu | %10llu |\n",
           D(launches), D(blas_calls), D(copies), D(graph_launches),
           D(launches) + D(blas_calls) + D(copies) + D(graph_launches), D(kernels_run),
           D(programmatic), D(host_waits));
#undef D
    return FITM_OK;
}

/* Prints four rows per batch size: what one decode step of B sequences (n steps from a
 * warmed-up state, each sequence at its own position) asks of the emulated device, per step,
 * with the backend's fused kernels off and on (fitm_backend_cuda_set_fusion) and its graphs
 * off and on. */
static fitm_status bench_submissions(fitm_forward *fw, fitm_backend *b,
                                     const fitm_model_config *c, const int32_t *ids, long n_ids,
                                     const int *batches, int n_batches, fitm_err *err)
{
    enum { STEPS = 4 };
    printf("\nwhat a decode step asks of the device (emulator counters, per step, mean of %d "
           "steps)\n",
           STEPS);
    printf("| seqs | fusion | graphs | launches | cuBLAS | copies | graph launches | submissions "
           "| kernels run | host waits |\n");
    printf("| ---: | ------ | ------ | -------: | -----: | -----: | -------------: | ----------: "
           "| ----------: | ---------: |\n");
    fitm_status s = FITM_OK;
    int sizes[9] = {1};
    int n_sizes = 1;
    for (int i = 0; i < n_batches; i++)
        if (batches[i] != 1)
            sizes[n_sizes++] = batches[i];
    double subs[9][4] = {{0}}, ran[9][4] = {{0}}; /* [size][fusion + 2 * graphs] */
    for (int i = 0; i < n_sizes && !s; i++) {
        const int B = sizes[i];
        for (int v = 0; v < 4 && !s; v++) {
            const int fu = v % 2, g = v / 2;
            fitm_backend_cuda_set_fusion(b, fu == 1);
            fitm_backend_cuda_set_graphs(b, g == 1);
            fitm_kv *kv[FITM_FORWARD_MAX_SEQS] = {0};
            fitm_forward_seq seq[FITM_FORWARD_MAX_SEQS];
            fitm_forward_opts o[FITM_FORWARD_MAX_SEQS];
            fitm_top top[FITM_TOP_MAX * FITM_FORWARD_MAX_SEQS];
            for (int q = 0; q < B && !s; q++) {
                s = fitm_kv_create(&kv[q], b, c, STEPS + 1, err);
                o[q] = (fitm_forward_opts){
                    .n_logits = 1,
                    .top_k = c->n_vocab < FITM_TOP_MAX ? (int32_t)c->n_vocab : FITM_TOP_MAX,
                    .top = top + (size_t)q * FITM_TOP_MAX};
            }
            fitm_emu_stats before = {0}, after = {0};
            for (long t = 0; t <= STEPS && !s; t++) { /* step 0 warms up (allocations, graphs) */
                if (t == 1)
                    fitm_emu_get_stats(&before);
                for (int q = 0; q < B; q++)
                    seq[q] = (fitm_forward_seq){kv[q], &ids[(t + 3 * q) % n_ids], 1, t, &o[q]};
                s = fitm_forward_run_batch(fw, seq, B, err);
            }
            fitm_emu_get_stats(&after);
            for (int q = 0; q < B; q++)
                fitm_kv_destroy(kv[q]);
            if (s)
                break;
#define PER(f) ((double)(after.f - before.f) / STEPS)
            subs[i][v] = PER(launches) + PER(blas_calls) + PER(copies) + PER(graph_launches);
            ran[i][v] = PER(kernels_run);
            printf("| %4d | %-6s | %-6s | %8.1f | %6.1f | %6.1f | %14.1f | %11.1f | %11.1f | "
                   "%10.1f |\n",
                   B, fu ? "on" : "off", g ? "on" : "off", PER(launches), PER(blas_calls),
                   PER(copies), PER(graph_launches), subs[i][v], ran[i][v], PER(host_waits));
#undef PER
        }
    }
    fitm_backend_cuda_set_fusion(b, true);
    fitm_backend_cuda_set_graphs(b, true);
    for (int i = 0; i < n_sizes && !s; i++)
        printf("%d sequence%s: %.1f submissions a step without graphs, %.1f with (%.0fx fewer); "
               "%.1f kernels a step without fusion, %.1f with (%.2fx fewer)\n",
               sizes[i], sizes[i] > 1 ? "s" : "", subs[i][1], subs[i][3],
               subs[i][3] > 0 ? subs[i][1] / subs[i][3] : 0.0, ran[i][0], ran[i][1],
               ran[i][1] > 0 ? ran[i][0] / ran[i][1] : 0.0);
    return s;
}
#endif

#if FITM_HAVE_CUDA || defined(FITM_BENCH_CUDA_EMU)
/* Prints where a one-sequence decode step's wall time goes on the CUDA backend, with its fused
 * kernels off and on, its graphs off and on, and its graphs submitted whole or in pieces of
 * 64 and 32 ops (fitm_backend_cuda_set_pieces), its launches programmatic (where the device
 * has them: fitm_backend_cuda_set_pdl) or plain: n steps from an empty cache (after one warm-up
 * step), each handing out the sampler's top entries as the tg row does. Per step: the wall
 * time; the time the host waited for the device (the device still busy after the host has
 * enqueued the step); the time in ending the capture and submitting it (cudaStreamEndCapture,
 * cudaGraphExecUpdate or cudaGraphInstantiate, cudaGraphLaunch); the rest is the host's own
 * (the forward driver, and launching or capturing each op); and how many graphs were replayed
 * (the step's work equal to an instance's last capture: that instance launched again, no
 * capture and no update) and how many instances were updated and made. The row "repeated"
 * runs one step n times at position 0 (each rewinding the cache: the same work, the same
 * arguments), a step the backend replays whatever it stores per step. A step whose wait is
 * small is bound by the host, one whose wait is most of it by the device. On the emulator
 * only the counts mean anything. */
static fitm_status bench_step_split(fitm_forward *fw, fitm_backend *b, fitm_kv *kv,
                                    const int32_t *ids, long n,
                                    const fitm_forward_opts *o_step, fitm_err *err)
{
    printf("\nwhere a decode step's time goes (1 sequence, %ld steps, CUDA backend; us a step)\n",
           n);
    printf("| fusion | graphs     | launches     |   tok/s |     wall | waiting for the device | "
           "capture end + update + launch | rest of the host | graphs | replays | updates | "
           "instantiations |\n");
    printf("| ------ | ---------- | ------------ | ------: | -------: | ---------------------: | "
           "----------------------------: | ---------------: | -----: | ------: | ------: | "
           "-------------: |\n");
    /* fusion, graphs, ops a piece (0: whole), the same step repeated, programmatic launches;
     * the default first */
    static const int way[][5] = {{1, 1, 0, 0, 1}, {1, 1, 0, 0, 0}, {1, 1, 0, 1, 1},
                                 {1, 1, 64, 0, 1}, {1, 1, 32, 0, 1}, {1, 0, 0, 0, 1},
                                 {1, 0, 0, 0, 0}, {0, 1, 0, 0, 1}, {0, 0, 0, 0, 0}};
    const bool pdl_default = fitm_backend_cuda_pdl(b);
    fitm_status s = FITM_OK;
    for (size_t v = 0; v < sizeof way / sizeof way[0] && !s; v++) {
        const int fu = way[v][0], g = way[v][1], piece = way[v][2], same = way[v][3];
        if (way[v][4] && !pdl_default && v > 0)
            continue; /* the same as the row without programmatic launches */
        const bool pdl = fitm_backend_cuda_set_pdl(b, way[v][4] == 1 && pdl_default);
        fitm_backend_cuda_set_fusion(b, fu == 1);
        fitm_backend_cuda_set_graphs(b, g == 1);
        fitm_backend_cuda_set_pieces(b, piece);
        fitm_kv_rebase(kv, 0, NULL);
        s = fitm_forward_run(fw, kv, ids, 1, 0, o_step, err); /* warm-up: graphs, scratch */
        fitm_kv_rebase(kv, 0, NULL);
        fitm_backend_cuda_stats a, z;
        fitm_backend_cuda_get_stats(b, &a);
        const double t0 = now_s();
        for (long i = 0; i < n && !s; i++)
            s = fitm_forward_run(fw, kv, &ids[same ? 0 : i], 1, same ? 0 : i, o_step, err);
        const double wall = (now_s() - t0) / (double)n * 1e6;
        fitm_backend_cuda_get_stats(b, &z);
        if (s)
            break;
        const double wait = (double)(z.wait_ns - a.wait_ns) / (double)n * 1e-3,
                     sub = (double)(z.submit_ns - a.submit_ns) / (double)n * 1e-3;
        char gw[16];
        snprintf(gw, sizeof gw, !g ? "off" : piece ? "%d ops" : same ? "repeated" : "whole", piece);
        printf("| %-6s | %-10s | %-12s | %7.0f | %8.0f | %22.0f | %29.0f | %16.0f | %6.2f | "
               "%7.2f | %7.2f | %14.2f |\n",
               fu ? "on" : "off", gw, pdl ? "programmatic" : "plain", 1e6 / wall, wall, wait,
               sub, wall - wait - sub,
               (double)(z.graph_launches - a.graph_launches) / (double)n,
               (double)(z.graph_replays - a.graph_replays) / (double)n,
               (double)(z.graph_updates - a.graph_updates) / (double)n,
               (double)(z.graph_instantiations - a.graph_instantiations) / (double)n);
    }
    fitm_backend_cuda_set_pdl(b, pdl_default);
    fitm_backend_cuda_set_fusion(b, true);
    fitm_backend_cuda_set_graphs(b, true);
    fitm_backend_cuda_set_pieces(b, 0);
    return s;
}

/* Prints where a prefill of the n_pp tokens ids goes: wall time against the host's wait for
 * the device, its graph work and the rest of the host, for the first prefill after a step (the
 * pass captured) and a second of the same tokens (replayed when it equals the first's tape),
 * each from position 0, with the default fusion and graphs; then both again with plain
 * launches where the default launches are programmatic (fitm_backend_cuda_set_pdl). */
static fitm_status bench_prefill_split(fitm_forward *fw, fitm_backend *b, fitm_kv *kv,
                                       const int32_t *ids, long n_pp, fitm_forward_opts *o,
                                       fitm_err *err)
{
    printf("\nwhere a prefill's time goes (%ld tokens, CUDA backend; us a prefill)\n", n_pp);
    printf("| prefill | launches     | tok/s | wall | waiting for the device | capture end + "
           "update + launch | rest of the host | graphs | replays | updates | instantiations |\n");
    printf("| ------- | ------------ | ----: | ---: | ---------------------: | "
           "----------------------------: | ---------------: | -----: | ------: | ------: | "
           "-------------: |\n");
    const bool pdl_default = fitm_backend_cuda_pdl(b);
    fitm_status s = FITM_OK;
    for (int r = 0; r < (pdl_default ? 4 : 2) && !s; r++) {
        const bool pdl = r == 2 ? fitm_backend_cuda_set_pdl(b, false) : fitm_backend_cuda_pdl(b);
        fitm_kv_rebase(kv, 0, NULL);
        fitm_backend_cuda_stats a, z;
        fitm_backend_cuda_get_stats(b, &a);
        const double t0 = now_s();
        s = fitm_forward_run(fw, kv, ids, n_pp, 0, o, err);
        const double wall = (now_s() - t0) * 1e6;
        fitm_backend_cuda_get_stats(b, &z);
        if (s)
            break;
        const double wait = (double)(z.wait_ns - a.wait_ns) * 1e-3,
                     sub = (double)(z.submit_ns - a.submit_ns) * 1e-3;
        printf("| %-7s | %-12s | %5.0f | %4.0f | %22.0f | %29.0f | %16.0f | %6llu | %7llu | "
               "%7llu | %14llu |\n",
               r % 2 ? "again" : "first", pdl ? "programmatic" : "plain", n_pp / wall * 1e6,
               wall, wait, sub, wall - wait - sub,
               (unsigned long long)(z.graph_launches - a.graph_launches),
               (unsigned long long)(z.graph_replays - a.graph_replays),
               (unsigned long long)(z.graph_updates - a.graph_updates),
               (unsigned long long)(z.graph_instantiations - a.graph_instantiations));
    }
    fitm_backend_cuda_set_pdl(b, pdl_default);
    return s;
}
#endif

/* Prints what a prefill of n_pp tokens from position 0 spends on the host filling its RoPE
 * tables (one for the global layers' base, one for the local layers' where the model has
 * both), as the forward driver fills them the first time it reaches those positions (each
 * base's frequencies once, fitm_ops_rope_freqs), as it fills them afterwards (the rows it
 * kept, copied), and as it did before (a pow per row and pair, fitm_ops_rope_table), best of
 * reps, and that the ways give the same bits. The host does this before the pass's work goes
 * to the device. */
static void bench_rope_tables(const fitm_model *m, long n_pp, int reps)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    bool local = false, global = false;
    for (int32_t l = 0; l < c->n_layer; l++)
        *(fitm_model_layer(m, l)->local ? &local : &global) = true;
    const float base[2] = {c->rope_base, c->rope_base_local},
                scale[2] = {c->rope_freq_scale, 1.0f};
    const bool use[2] = {global, local};
    const int64_t n_rot = c->n_rot;
    const size_t n = (size_t)(2 * n_pp * n_rot + 1); /* both tables */
    float *a = malloc(sizeof *a * n), *z = malloc(sizeof *z * n);
    double *w = malloc(sizeof *w * (size_t)(n_rot / 2 + 1));
    if (!a || !z || !w) {
        free(a), free(z), free(w);
        return;
    }
    memset(a, 0, sizeof *a * n);
    memset(z, 0, sizeof *z * n);
    float *y = malloc(sizeof *y * n);
    double best[3] = {1e30, 1e30, 1e30};
    for (int r = 0; r < reps && y; r++) {
        const double t0 = now_s();
        memcpy(y, a, sizeof *a * n); /* the rows kept (a holds them from the last rep) */
        const double dt = now_s() - t0;
        best[2] = r > 0 && dt < best[2] ? dt : best[2];
        for (int way = 0; way < 2; way++) {
            const double t0 = now_s();
            for (int k = 0; k < 2; k++) {
                float *cs = (way ? z : a) + k * n_pp * n_rot;
                if (!use[k])
                    continue;
                if (way == 0)
                    fitm_ops_rope_freqs(w, n_rot, base[k]);
                for (long t = 0; t < n_pp; t++) {
                    if (way == 0)
                        fitm_ops_rope_table_at(cs + t * n_rot, n_rot, t, scale[k], w);
                    else
                        fitm_ops_rope_table(cs + t * n_rot, n_rot, t, base[k], scale[k]);
                }
            }
            const double dt = now_s() - t0;
            best[way] = dt < best[way] ? dt : best[way];
        }
    }
    const bool same = memcmp(a, z, sizeof *a * n) == 0;
    printf("RoPE tables of a pp%ld pass on the host (%d table%s of %ld rows, n_rot %lld): "
           "%.3f ms the first time (%.1fx faster than a pow per row and pair, "
           "fitm_ops_rope_table: %.3f ms), %.3f ms from the rows kept; the same bits: %s\n",
           n_pp, use[0] + use[1], use[0] + use[1] > 1 ? "s" : "", n_pp, (long long)n_rot,
           best[0] * 1e3, best[1] / best[0], best[1] * 1e3, reps > 1 && y ? best[2] * 1e3 : 0.0,
           same ? "yes" : "NO");
    free(a), free(z), free(w), free(y);
}

int main(int argc, char **argv)
{
    const char *path = NULL, *backend = "cpu";
    int threads = 2, reps = 3;
    bool kv_half = false;
    const char *gpu_weights = "bf16"; /* the CUDA backend's BATCH operands (config gpu_weights) */
    long n_pp = 512, n_tg = 128, ctx0 = 0;
    double ref_pp = 0.0, ref_tg = 0.0;
    int batches[8], n_batches = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            path = argv[++i];
        else if (!strcmp(argv[i], "-b") && i + 1 < argc)
            backend = argv[++i];
        else if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-p") && i + 1 < argc)
            n_pp = atol(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            n_tg = atol(argv[++i]);
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "f16") || !strcmp(argv[i + 1], "f32")))
            kv_half = !strcmp(argv[++i], "f16");
        else if (!strcmp(argv[i], "--gpu-weights") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "bf16") || !strcmp(argv[i + 1], "f32")))
            gpu_weights = argv[++i];
        else if (!strcmp(argv[i], "-c") && i + 1 < argc)
            ctx0 = atol(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-B") && i + 1 < argc && n_batches < 8)
            batches[n_batches++] = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ref-pp") && i + 1 < argc)
            ref_pp = atof(argv[++i]);
        else if (!strcmp(argv[i], "--ref-tg") && i + 1 < argc)
            ref_tg = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_forward -m MODEL [-b cpu|cuda] [-t THREADS] [-p 512] "
                            "[-n 128] [-r 3] [-B B (up to 8 times)] [-c CTX (each -B sequence's "
                            "context before it decodes, default 0)] [--kv f32|f16] "
                            "[--gpu-weights bf16|f32 (cuda: the prefill products' operands)] "
                            "[--ref-pp TOK_S] "
                            "[--ref-tg TOK_S]\n");
            return 2;
        }
    }
    int max_b = 1;
    for (int i = 0; i < n_batches; i++) {
        if (batches[i] < 1 || batches[i] > FITM_FORWARD_MAX_SEQS) {
            fprintf(stderr, "bench_forward: -B must be in [1, %d]\n", FITM_FORWARD_MAX_SEQS);
            return 2;
        }
        max_b = batches[i] > max_b ? batches[i] : max_b;
    }
    if (!path || threads < 1 || n_pp < 1 || n_tg < 1 || reps < 1 || ctx0 < 0) {
        fprintf(stderr, "bench_forward: -m MODEL is required; counts must be positive\n");
        return 2;
    }
    fitm_quant_blas_single_thread();
    long rss0 = vm_rss_kib();
    fitm_err err = {{0}};
    fitm_model *m = NULL;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *kv = NULL;
    int64_t n_ctx = n_pp > n_tg ? n_pp : n_tg;
    n_ctx = ctx0 + n_tg > n_ctx ? ctx0 + n_tg : n_ctx;
    double t_load = now_s();
    fitm_status s = fitm_model_open(&m, path, &err);
    const fitm_model_config *c = s ? NULL : fitm_model_config_of(m);
    const long max_rows = n_pp > ctx0 ? n_pp : ctx0;
    fitm_forward_params fp = {max_rows > max_b ? max_rows : max_b, n_ctx, max_b};
    if (!s && !strcmp(backend, "cpu"))
        s = fitm_backend_cpu_create(&b, threads, &err);
#if FITM_HAVE_CUDA || defined(FITM_BENCH_CUDA_EMU)
    else if (!s && !strcmp(backend, "cuda")) {
        s = fitm_backend_cuda_create(&b, 0, &err);
        if (!s) /* before the forward's prepare, which makes the bfloat16 copies */
            fitm_backend_cuda_set_weights(b, !strcmp(gpu_weights, "f32") ? FITM_CUDA_WEIGHTS_F32
                                                                         : FITM_CUDA_WEIGHTS_BF16);
    }
#endif
    else if (!s)
        s = fitm_err_set(&err, FITM_ERR_INVALID, "backend '%s' is not in this build", backend);
    (void)gpu_weights; /* a build without the CUDA backend takes the flag and has no use for it */
    if (!s)
        s = fitm_backend_set_kv_half(b, kv_half, &err);
    if (!s)
        s = fitm_forward_create(&fw, m, b, &fp, &err);
    if (!s)
        s = fitm_kv_create(&kv, b, c, n_ctx, &err);
    if (s) {
        fprintf(stderr, "bench_forward: %s: %s\n", fitm_status_name(s), err.msg);
        return 1;
    }
    t_load = now_s() - t_load;
    int32_t *ids = malloc(sizeof *ids * (size_t)n_ctx);
    float *logits = malloc(sizeof *logits * (size_t)c->n_vocab);
    uint64_t st = 12345;
    for (int64_t i = 0; i < n_ctx; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((st >> 33) % (uint64_t)c->n_vocab);
    }
    fitm_forward_opts o = {.n_logits = 1, .logits = logits};
    /* decode steps hand out what /answer's sampler takes: the 64 top logits (on a device
     * backend selected there, so the step copies 64 pairs, not the vocabulary's row) */
    fitm_top top[FITM_TOP_MAX];
    const fitm_forward_opts o_step = {
        .n_logits = 1, .top_k = c->n_vocab < FITM_TOP_MAX ? c->n_vocab : FITM_TOP_MAX, .top = top};

    /* warm-up: touches the weights once (page faults are not what we measure) */
    fitm_kv_rebase(kv, 0, NULL);
    fitm_forward_run(fw, kv, ids, n_pp < 16 ? n_pp : 16, 0, &o, &err);

    double *t_pp = calloc((size_t)reps, sizeof *t_pp), *t_tg = calloc((size_t)reps, sizeof *t_tg);
    if (!t_pp || !t_tg) {
        fprintf(stderr, "bench_forward: out of memory\n");
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        fitm_kv_rebase(kv, 0, NULL);
        double t0 = now_s();
        s = fitm_forward_run(fw, kv, ids, n_pp, 0, &o, &err);
        t_pp[r] = now_s() - t0;
        fitm_kv_rebase(kv, 0, NULL);
        t0 = now_s();
        for (long i = 0; i < n_tg && !s; i++)
            s = fitm_forward_run(fw, kv, &ids[i], 1, i, &o_step, &err);
        t_tg[r] = now_s() - t0;
        if (s) {
            fprintf(stderr, "bench_forward: %s: %s\n", fitm_status_name(s), err.msg);
            return 1;
        }
    }
    long rss = vm_rss_kib();
    qsort(t_pp, (size_t)reps, sizeof *t_pp, cmp_double);
    qsort(t_tg, (size_t)reps, sizeof *t_tg, cmp_double);
    const double best_pp = t_pp[0], best_tg = t_tg[0];
    const double med_pp = median_sorted(t_pp, reps), med_tg = median_sorted(t_tg, reps);

    fitm_pool *pool = NULL;
    double gf1 = 0.0, gfn = 0.0;
    if (fitm_pool_create(&pool, threads, &err) == FITM_OK) {
        fitm_pool *one = NULL;
        if (fitm_pool_create(&one, 1, &err) == FITM_OK)
            gf1 = sgemm_gflops(one, 1);
        fitm_pool_destroy(one);
        gfn = sgemm_gflops(pool, threads);
        fitm_pool_destroy(pool);
    }

    /* FLOPs of a prefill: 2 per weight per token in the layers, the attention products over
     * the visible keys, and one row of the output head. */
    double per_tok = 0.0;
    const double C = c->n_embd, F = c->n_ff, HD = (double)c->n_head * c->head_dim,
                 HkvD = (double)c->n_head_kv * c->head_dim;
    per_tok = 2.0 * c->n_layer * (C * HD + 2 * C * HkvD + HD * C + 3 * C * F);
    double attn = 0.0;
    for (int32_t l = 0; l < c->n_layer; l++)
        for (long t = 0; t < n_pp; t++) {
            long keys = t + 1;
            if (fitm_model_layer(m, l)->local && keys > c->n_swa)
                keys = c->n_swa;
            attn += 4.0 * keys * HD;
        }
    double pp_flops = per_tok * n_pp + attn + 2.0 * C * c->n_vocab;
    double pp_tps = n_pp / best_pp, tg_tps = n_tg / best_tg;
    double pp_med = n_pp / med_pp, tg_med = n_tg / med_tg;
    double file_mib = fitm_gguf_file_bytes(fitm_model_gguf(m)) / 1048576.0;
    double kv_mib = fitm_kv_bytes(kv) / 1048576.0;

    printf("bench_forward: %s (%s, L=%d C=%d H=%d Hkv=%d D=%d F=%d V=%d), %s backend, %d "
           "threads, %d runs, %s KV cache\n",
           path, fitm_arch_name(c->arch), c->n_layer, c->n_embd, c->n_head, c->n_head_kv,
           c->head_dim, c->n_ff, c->n_vocab, backend, threads, reps, kv_half ? "fp16" : "F32");
    printf("| test                        | tok/s best | tok/s median |   GFLOP/s | vs sgemm "
           "ceiling | vs reference |\n");
    printf("| --------------------------- | ---------: | -----------: | --------: | "
           "---------------: | -----------: |\n");
    printf("| pp%-5ld (prefill, 1 batch)  | %10.1f | %12.1f | %9.1f | %15.0f%% |", n_pp, pp_tps,
           pp_med, pp_flops / best_pp * 1e-9,
           gfn > 0 ? 100.0 * pp_flops / best_pp * 1e-9 / gfn : 0.0);
    if (ref_pp > 0)
        printf(" %11.2fx |\n", pp_tps / ref_pp);
    else
        printf(" %12s |\n", "-");
    printf("| tg%-5ld (decode, 1 token)   | %10.1f | %12.1f | %9s | %16s |", n_tg, tg_tps, tg_med,
           "-", "-");
    if (ref_tg > 0)
        printf(" %11.2fx |\n", tg_tps / ref_tg);
    else
        printf(" %12s |\n", "-");
    for (int i = 0; i < n_batches; i++) {
        double tps = 0.0;
        s = bench_batched_decode(fw, b, c, ids, ctx0, n_tg, batches[i], reps, &tps, &err);
        if (s) {
            fprintf(stderr, "bench_forward: %s: %s\n", fitm_status_name(s), err.msg);
            return 1;
        }
        printf("| tg%-5ld x %-2d seqs @ %-5ld ctx | %10.1f | %12s | %9s | %16s | %10.2fx tg |\n",
               n_tg, batches[i], ctx0, tps, "-", "-", "-", tps / tg_tps);
    }
    printf("| sgemm 512x1024x512, 1 thread |          - |            - | %9.1f | %16s | %12s |\n",
           gf1, "-", "-");
    printf(
        "| sgemm, %d threads at once     |          - |            - | %9.1f | %15.0f%% | %12s |\n",
        threads, gfn, 100.0, "-");
#if FITM_HAVE_CUDA || defined(FITM_BENCH_CUDA_EMU)
    if (!strcmp(backend, "cuda")) {
        s = bench_step_split(fw, b, kv, ids, n_tg < 64 ? n_tg : 64, &o_step, &err);
        if (!s)
            s = bench_prefill_split(fw, b, kv, ids, n_pp, &o, &err);
        if (s) {
            fprintf(stderr, "bench_forward: %s: %s\n", fitm_status_name(s), err.msg);
            return 1;
        }
    }
#endif
#ifdef FITM_BENCH_CUDA_EMU
    if (!strcmp(backend, "cuda")) {
        s = bench_prefill_submissions(fw, kv, ids, n_pp, &o, &err);
        if (!s)
            s = bench_submissions(fw, b, c, ids, (long)n_ctx, batches, n_batches, &err);
        if (s) {
            fprintf(stderr, "bench_forward: %s: %s\n", fitm_status_name(s), err.msg);
            return 1;
        }
    }
#endif
    bench_rope_tables(m, n_pp, reps);
    printf("load %.3f s; VmRSS before load %.1f MiB, after load + %d-row KV cache + runs %.1f MiB; "
           "file %.1f MiB, KV cache %.1f MiB; (VmRSS - before) / (file + KV) = %.2f\n",
           t_load, rss0 / 1024.0, (int)n_ctx, rss / 1024.0, file_mib, kv_mib,
           (rss - rss0) / 1024.0 / (file_mib + kv_mib));
    free(t_pp);
    free(t_tg);
    free(ids);
    free(logits);
    fitm_kv_destroy(kv);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    return 0;
}
