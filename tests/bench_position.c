/* bench_position: the cost of the position methods (docs/position-methods.md): prefill of P
 * tokens in one batch and N single-token decode steps, for none, ms_poe, attention_buckets
 * (FITM_BUCKETS passes on a cache with a pass per bucket, each decode step one call) and
 * (with a sidecar) moice, run back to back in rounds so a shared machine's load hits every
 * method alike; prints best tok/s per method and its ratio to none, and the KV bytes each
 * holds. Never fails on speed.
 *
 *   bench_position -m MODEL [--moice SIDECAR] [-t THREADS] [-p 256] [-n 32] [-r 2] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "model/moice.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *moice_path = NULL;
    int threads = 2, reps = 2;
    long n_pp = 256, n_tg = 32;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            path = argv[++i];
        else if (!strcmp(argv[i], "--moice") && i + 1 < argc)
            moice_path = argv[++i];
        else if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-p") && i + 1 < argc)
            n_pp = atol(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            n_tg = atol(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_position -m MODEL [--moice SIDECAR] [-t THREADS] "
                            "[-p 256] [-n 32] [-r 2]\n");
            return 2;
        }
    }
    if (!path || n_pp < 2 || n_tg < 1 || reps < 1) {
        fprintf(stderr, "bench_position: -m MODEL is required (and -p >= 2, -n, -r >= 1)\n");
        return 2;
    }
    fitm_err err = {{0}};
    fitm_model *m = NULL;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_moice *mo = NULL;
    fitm_kv *kv = NULL, *kvb = NULL;
    fitm_status s = fitm_model_open(&m, path, &err);
    if (!s)
        s = fitm_backend_cpu_create(&b, threads, &err);
    if (!s && moice_path) {
        fitm_moice_base id;
        if (!(s = fitm_moice_load(&mo, moice_path, &err)) &&
            !(s = fitm_moice_model_identity(m, path, &id, &err)))
            s = fitm_moice_check(mo, &id, &err);
    }
    const fitm_model_config *c = s ? NULL : fitm_model_config_of(m);
    const int64_t ctx = n_pp + n_tg;
    /* room for one logit row per bucket, so a buckets decode step is one call */
    fitm_forward_params fp = {n_pp, ctx, n_pp < FITM_BUCKETS ? n_pp : FITM_BUCKETS};
    double t_pos = 0;
    if (!s)
        s = fitm_forward_create(&fw, m, b, &fp, &err);
    if (!s) {
        t_pos = now_s();
        s = fitm_forward_positions(fw, mo, &err);
        t_pos = now_s() - t_pos;
    }
    if (!s)
        s = fitm_kv_create(&kv, b, c, ctx, &err);
    if (!s)
        s = fitm_kv_create(&kvb, b, c, ctx, &err);
    if (!s)
        s = fitm_kv_passes(kvb, FITM_BUCKETS, 0, &err);
    float *logits = s ? NULL : malloc((size_t)c->n_vocab * sizeof *logits);
    int32_t *ids = s ? NULL : malloc((size_t)ctx * sizeof *ids);
    if (s || !logits || !ids) {
        fprintf(stderr, "bench_position: %s\n", s ? err.msg : "out of memory");
        return 1;
    }
    for (int64_t i = 0; i < ctx; i++)
        ids[i] = (int32_t)((i * 7 + 3) % c->n_vocab);
    const fitm_position_method methods[] = {FITM_POSITION_NONE, FITM_POSITION_MS_POE,
                                            FITM_POSITION_BUCKETS, FITM_POSITION_MOICE};
    const int n_methods = mo ? 4 : 3;
    double best_pp[4] = {0}, best_tg[4] = {0};
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < n_methods; k++) {
            fitm_forward_opts o = {.n_logits = 1, .logits = logits, .position = methods[k]};
            fitm_kv *x = methods[k] == FITM_POSITION_BUCKETS ? kvb : kv;
            double t0 = now_s();
            s = fitm_forward_run(fw, x, ids, n_pp, 0, &o, &err);
            double t1 = now_s();
            for (long i = 0; i < n_tg && !s; i++)
                s = fitm_forward_run(fw, x, &ids[n_pp + i], 1, n_pp + i, &o, &err);
            double t2 = now_s();
            if (s) {
                fprintf(stderr, "bench_position: %s\n", err.msg);
                return 1;
            }
            double pp = (double)n_pp / (t1 - t0), tg = (double)n_tg / (t2 - t1);
            best_pp[k] = pp > best_pp[k] ? pp : best_pp[k];
            best_tg[k] = tg > best_tg[k] ? tg : best_tg[k];
        }
    printf("model %s, %d threads, pp %ld, tg %ld, best of %d rounds (methods back to back)\n",
           path, threads, n_pp, n_tg, reps);
    if (mo)
        printf("MoICE: %d experts, top-%d\n", (int)fitm_moice_n_experts(mo),
               (int)fitm_moice_top_k(mo));
    printf("position methods enabled in %.0f ms (Ms-PoE ranking pass, tables)\n", t_pos * 1e3);
    printf("%-17s %12s %8s %12s %8s\n", "method", "pp tok/s", "vs none", "tg tok/s",
           "vs none");
    for (int k = 0; k < n_methods; k++)
        printf("%-17s %12.1f %8.2f %12.2f %8.2f\n", fitm_position_method_name(methods[k]),
               best_pp[k], best_pp[k] / best_pp[0], best_tg[k], best_tg[k] / best_tg[0]);
    printf("KV cache for %lld positions: %zu bytes (none, ms_poe, moice); attention_buckets "
           "%zu bytes (%d passes, %.2fx)\n",
           (long long)ctx, fitm_kv_bytes(kv), fitm_kv_bytes(kvb), FITM_BUCKETS,
           (double)fitm_kv_bytes(kvb) / (double)fitm_kv_bytes(kv));
    free(logits);
    free(ids);
    fitm_kv_destroy(kv);
    fitm_kv_destroy(kvb);
    fitm_forward_destroy(fw);
    fitm_moice_destroy(mo);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    return 0;
}
