/* test_backend_cuda: the whole CUDA backend against the CPU backend on generated models
 * (llama, qwen2, gemma3 x the nine weight types), through the one forward driver: logits,
 * captured span masses and the logits of intervened passes, plain, with Ms-PoE (an
 * attention mixture: the position methods' path) and with Attention Buckets (passes whose
 * captures are summed: ops->capture_add); and on the CUDA backend alone,
 * prefix reuse and single-token steps of the BATCH class (cuBLAS GEMMs of a fixed row count,
 * F32 and bfloat16) bit-identical to a full pass, STEP-class steps (the warp-per-output
 * kernel) within the logit tolerance of it, and decode steps with CUDA graphs and with fused
 * kernels (the defaults) bit-identical to steps without.
 *
 * Runs on a CUDA device, or on the emulator of tests/cuda_emu (test_backend_cuda_emu); exits
 * 77 (skip) without a device.
 *
 * Tolerances. Both backends multiply by the same decoded weight values (the CPU's BATCH path
 * converts weights to F32 tiles, the GPU decodes them in registers), so the two differ only in
 * the order of float sums and in fused multiply-adds: a unit roundoff u = 6e-8 per operation,
 * growing like sqrt(K) u |w||x| over a dot product of length K <= 512 (about 1.4e-6 relative),
 * then carried through 2-6 layers of norms and residual sums, which amplify it by about the
 * ratio of a logit to its inputs' norms. Measured worst cases on these models are about 5e-6
 * of the largest logit (printed per model); the bounds below, 2e-4 of the largest logit of the
 * row and 2e-4 absolute for probabilities (span masses lie in [0, 1]), leave a factor of 40
 * over them and are still far below what a wrong mask, span boundary or Eq. 5 factor gives
 * (1e-2 and more).
 * One exception: the CPU computes the output head on its STEP path (model/forward.h), which
 * for quantized weights first rounds the head's input to Q8 (each element within 1/254 of its
 * block's largest magnitude), while the GPU multiplies by the exact input. Over a dot product
 * of K = 256 such roundings with random signs that is about sqrt(256)/254 = 6e-2 of a typical
 * term, a few 1e-2 of the largest logit (measured up to 1.5e-2): quantized heads get 5e-2.
 * The layers below the head are still held to 2e-4 there, through the captured span masses,
 * which match to about 3e-6 for every type.
 * Those bounds hold the F32 products (gpu_weights f32). The default, bfloat16 products, rounds
 * both operands of every weight product to 8 significant bits (unit roundoff 2^-8): each term
 * moves by up to 2^-7 of itself, about 3e-3 rms, so a dot product carries about 3e-3 of its own
 * size whatever K, 2000 times the F32 products' error, carried through the same layers. Measured
 * on these models: 5e-3..2.4e-2 of the largest logit (the quantized heads' Q8 rounding
 * included) and 2e-3..1.7e-2 on span masses (the most on gemma3's six layers); the bounds,
 * 7e-2 and 5e-2 (LOGIT_RTOL_BF16, MASS_ATOL_BF16), leave a factor of about 3 over those for a
 * device's other summation order and stay below what a conversion in the wrong layout or type
 * gives (logits off by their own size, masses by 1e-1 and more).
 * What bfloat16 must keep exactly, it is held to exactly: prefix reuse and single-token BATCH
 * steps against the full pass, memcmp. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "gen_model.h"
#include "gguf/gguf_writer.h"
#include "kernels.h"
#include "model/backend_check.h"
#include "model/backend_cuda.h"
#include "model/forward.h"
#include "model/genmodel.h"

#define T 20
#define NL 6 /* logit rows compared: the last six (the intervention starts at row 15) */
#define LOGIT_RTOL 2e-4
#define LOGIT_RTOL_Q8 5e-2
#define MASS_ATOL 2e-4
#define LOGIT_RTOL_BF16 7e-2
#define MASS_ATOL_BF16 5e-2

static const fitm_dtype types[] = {FITM_DTYPE_F32,  FITM_DTYPE_F16,  FITM_DTYPE_BF16,
                                   FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q8_0,
                                   FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K};

static fitm_model *gen_model(fitm_gen_arch arch, fitm_dtype type, void **buf)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    cfg.type = type;
    cfg.seed = 7 + (uint64_t)type;
    /* gemma3: layers 0-4 local (window 16 < T), layer 5 global */
    cfg.n_layer = arch == FITM_GEN_ARCH_GEMMA3 ? 6 : 2;
    return gen_model_load(&cfg, buf);
}

typedef struct {
    fitm_backend *b;
    fitm_forward *f;
    fitm_kv *kv, *kv2;
} runner;

static bool runner_open(runner *r, fitm_backend *b, const fitm_model *m)
{
    fitm_err err;
    const fitm_forward_params fp = {T, T, T};
    memset(r, 0, sizeof *r);
    r->b = b;
    const fitm_model_config *c = fitm_model_config_of(m);
    if (fitm_forward_create(&r->f, m, b, &fp, &err) || fitm_kv_create(&r->kv, b, c, T, &err) ||
        fitm_kv_create(&r->kv2, b, c, T, &err) || fitm_forward_positions(r->f, NULL, &err)) {
        fprintf(stderr, "%s: %s\n", b->ops->name, err.msg);
        return false;
    }
    return true;
}

static void runner_close(runner *r)
{
    fitm_kv_destroy(r->kv);
    fitm_kv_destroy(r->kv2);
    fitm_forward_destroy(r->f);
}

/* One pass over ids with logits of every row; capture, intervention and position method as
 * given. */
static bool run_pos(runner *r, const int32_t *ids, float *logits, const fitm_capture *cap,
                    const fitm_intervention *iv, fitm_position_method pos)
{
    fitm_err err;
    fitm_kv_truncate(r->kv, 0);
    fitm_forward_opts o = {.n_logits = NL,
                           .logits = logits,
                           .capture = cap,
                           .intervention = iv,
                           .path = FITM_PATH_BATCH,
                           .position = pos};
    fitm_status s = fitm_forward_run(r->f, r->kv, ids, T, 0, &o, &err);
    CHECK(s == FITM_OK, "%s forward: %s", r->b->ops->name, err.msg);
    return s == FITM_OK;
}

static bool run(runner *r, const int32_t *ids, float *logits, const fitm_capture *cap,
                const fitm_intervention *iv)
{
    return run_pos(r, ids, logits, cap, iv, FITM_POSITION_NONE);
}

/* Worst |got - want| over each row, relative to the row's largest |want|. */
static double logit_err(const float *got, const float *want, int64_t rows, int64_t V)
{
    double worst = 0;
    for (int64_t t = 0; t < rows; t++) {
        double mx = 1e-30, e = 0;
        for (int64_t v = 0; v < V; v++) {
            mx = fmax(mx, fabs(want[t * V + v]));
            e = fmax(e, fabs((double)got[t * V + v] - want[t * V + v]));
        }
        worst = fmax(worst, isfinite(e) ? e / mx : INFINITY);
    }
    return worst;
}

static double abs_err(const float *got, const float *want, int64_t n)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        e = fmax(e, isfinite(d) ? d : INFINITY);
    }
    return e;
}

static void test_model(fitm_backend *cpu, fitm_backend *gpu, fitm_gen_arch arch, fitm_dtype t)
{
    void *buf = NULL;
    fitm_model *m = gen_model(arch, t, &buf);
    CHECK(m != NULL, "model");
    runner rc, rg;
    bool ok = m && runner_open(&rc, cpu, m) && runner_open(&rg, gpu, m);
    CHECK(ok, "runners");
    if (!ok) {
        fitm_model_close(m);
        free(buf);
        return;
    }
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab, L = c->n_layer, H = c->n_head;
    int32_t ids[T];
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 7919 + 13 * (int)t + 5) % V);
    float *lc = malloc(sizeof(float) * T * V), *lg = malloc(sizeof(float) * T * V);
    float *lg2 = malloc(sizeof(float) * T * V);

    /* plain pass */
    double e_plain = INFINITY, e_iv = INFINITY, e_mass = INFINITY;
    if (run(&rc, ids, lc, NULL, NULL) && run(&rg, ids, lg, NULL, NULL))
        e_plain = logit_err(lg, lc, NL, V);

    /* captured and intervened: two documents, captured rows 4 and T-1 after the intervention */
    const fitm_span spans[2] = {{2, 7}, {8, 15}};
    const float alpha[2] = {1.7f, 0.3f};
    const int64_t rows[2] = {4, T - 1};
    const int64_t nm = 2 * L * H * 2;
    float *mc = calloc((size_t)nm, sizeof(float)), *mg = calloc((size_t)nm, sizeof(float));
    fitm_capture cc = {.rows = rows,
                       .n_rows = 2,
                       .spans = spans,
                       .n_spans = 2,
                       .span_mass = mc,
                       .after_intervention = true};
    fitm_capture cg = cc;
    cg.span_mass = mg;
    const fitm_intervention iv = {.spans = spans, .n_spans = 2, .alpha = alpha, .from_pos = 15};
    float *lg_iv = malloc(sizeof(float) * T * V);
    if (run(&rc, ids, lc, &cc, &iv) && run(&rg, ids, lg_iv, &cg, &iv)) {
        e_iv = logit_err(lg_iv, lc, NL, V);
        e_mass = abs_err(mg, mc, nm);
    }
#ifdef FITM_CUDA_EMU
    /* the captured rows of every layer reach the arrays at the pass's one wait (its logits
     * download), not a wait per row and layer: the same pass again, its masses cleared first */
    {
        fitm_emu_stats st[2];
        float *again = malloc(sizeof(float) * (size_t)nm);
        fitm_capture ca = cg;
        ca.span_mass = again;
        for (int64_t i = 0; again && i < nm; i++)
            again[i] = NAN;
        fitm_emu_get_stats(&st[0]);
        const bool ran = again && run(&rg, ids, lg2, &ca, &iv);
        fitm_emu_get_stats(&st[1]);
        CHECK(ran && st[1].host_waits - st[0].host_waits == 1, "a captured pass waited %llu times",
              st[1].host_waits - st[0].host_waits);
        CHECK(ran && memcmp(again, mg, sizeof(float) * (size_t)nm) == 0,
              "captured masses of the same pass differ");
        free(again);
    }
#endif
    char what[96];
    snprintf(what, sizeof what, "%s %s", fitm_gen_arch_name(arch), fitm_dtype_info_of(t)->name);
    printf("%-16s logits %.2e  intervened %.2e  span mass %.2e\n", what, e_plain, e_iv, e_mass);
    const double rtol = fitm_dtype_info_of(t)->block_elems > 1 ? LOGIT_RTOL_Q8 : LOGIT_RTOL;
    CHECK(e_plain <= rtol, "%s: logits off by %.3g of the largest", what, e_plain);
    CHECK(e_iv <= rtol, "%s: intervened logits off by %.3g", what, e_iv);
    CHECK(e_mass <= MASS_ATOL, "%s: captured span mass off by %.3g", what, e_mass);

    /* CUDA alone: a branch over [0, 9) recomputing [9, T), and single-token steps on the
     * BATCH path, give the full pass's rows bit for bit (lg holds the plain pass); on the
     * STEP path (another kernel: sums in another order) within the logit tolerance */
    fitm_err err;
    {
        fitm_kv_rebase(rg.kv2, 9, &err);
        fitm_forward_opts ob = {
            .prefix = rg.kv, .n_logits = NL, .logits = lg2, .path = FITM_PATH_BATCH};
        CHECK(fitm_forward_run(rg.f, rg.kv2, ids + 9, T - 9, 9, &ob, &err) == FITM_OK, "%s",
              err.msg);
        CHECK(memcmp(lg, lg2, sizeof(float) * NL * V) == 0,
              "%s: prefix reuse differs from the full pass", what);
        for (int path = FITM_PATH_BATCH; path <= FITM_PATH_STEP && t == FITM_DTYPE_Q4_K; path++) {
            fitm_kv_rebase(rg.kv2, 0, &err); /* one type: slow emulated */
            memset(lg2, 0, sizeof(float) * NL * V);
            for (int64_t i = 0; i < T; i++) {
                fitm_forward_opts o1 = {.n_logits = i >= T - NL,
                                        .logits = i >= T - NL ? lg2 + (i - (T - NL)) * V : NULL,
                                        .path = (fitm_forward_path)path};
                CHECK(fitm_forward_run(rg.f, rg.kv2, ids + i, 1, i, &o1, &err) == FITM_OK, "%s",
                      err.msg);
            }
            if (path == FITM_PATH_BATCH)
                CHECK(memcmp(lg, lg2, sizeof(float) * NL * V) == 0,
                      "%s: single-token steps (BATCH) differ from the full pass", what);
            else
                CHECK(logit_err(lg2, lg, NL, V) <= LOGIT_RTOL,
                      "%s: single-token steps (STEP) off by %.3g of the largest logit", what,
                      logit_err(lg2, lg, NL, V));
        }
        /* the intervention did change the rows it covers (else the checks above are void) */
        CHECK(logit_err(lg + 2 * V, lg_iv + 2 * V, NL - 2, V) > 1e-3,
              "%s: the intervention changed nothing", what);
    }
    /* Ms-PoE, the attention mixture of the position methods with one expert per head (after
     * the checks above, which read the plain pass's cache): the same head ranks on both
     * backends (from their own calibration passes), captured masses and intervened logits
     * within the tolerances, and different from the plain pass */
    double e_ms = INFINITY, e_ms_mass = INFINITY, ms_change = 0;
    /* logits of a position method's pass (Ms-PoE here, Attention Buckets below) */
    float *lg_pos = malloc(sizeof(float) * T * V), *lc_pos = malloc(sizeof(float) * T * V);
    const int32_t *rk_c = fitm_forward_ms_poe_ranks(rc.f), *rk_g = fitm_forward_ms_poe_ranks(rg.f);
    CHECK(rk_c && rk_g && memcmp(rk_c, rk_g, sizeof(int32_t) * (size_t)(L * H)) == 0,
          "Ms-PoE head ranks differ between the backends");
    if (run_pos(&rc, ids, lc_pos, &cc, &iv, FITM_POSITION_MS_POE) &&
        run_pos(&rg, ids, lg_pos, &cg, &iv, FITM_POSITION_MS_POE)) {
        e_ms = logit_err(lg_pos, lc_pos, NL, V);
        e_ms_mass = abs_err(mg, mc, nm);
        ms_change = logit_err(lc_pos, lc, NL, V);
    }
    printf("%-16s ms_poe logits %.2e  span mass %.2e  (change from plain %.2e)\n", what, e_ms,
           e_ms_mass, ms_change);
    CHECK(e_ms <= rtol, "%s: Ms-PoE logits off by %.3g", what, e_ms);
    CHECK(e_ms_mass <= MASS_ATOL, "%s: Ms-PoE span mass off by %.3g", what, e_ms_mass);
    /* (the 2-layer models have no layer from FITM_MS_POE_FIRST_LAYER on: Ms-PoE is their plain
     * pass, so only gemma3's six layers show the mixture) */
    CHECK(L <= FITM_MS_POE_FIRST_LAYER || ms_change > 1e-3, "%s: Ms-PoE changed nothing (%.3g)",
          what, ms_change);
    /* Attention Buckets: FITM_BUCKETS passes, each with a cache of its own, their captures
     * summed in the caller's arrays (ops->capture_add: on CUDA the device rows are added on the
     * host) and divided by the passes; the output log p^ of the passes' weighted mixture.
     * Masses and full probability rows within the tolerances of one pass; different from the
     * plain pass */
    double e_bk = INFINITY, e_bk_mass = INFINITY, e_bk_probs = INFINITY, bk_change = 0;
    const int64_t np = 2 * L * H * T;
    float *pc = calloc((size_t)np, sizeof(float)), *pg = calloc((size_t)np, sizeof(float));
    fitm_capture bc = cc, bg = cg;
    bc.probs = pc, bc.probs_stride = T;
    bg.probs = pg, bg.probs_stride = T;
    bool passes = fitm_kv_passes(rc.kv, FITM_BUCKETS, 0, &err) == FITM_OK &&
                  fitm_kv_passes(rg.kv, FITM_BUCKETS, 0, &err) == FITM_OK;
    CHECK(passes, "bucket caches: %s", err.msg);
    if (passes && run_pos(&rc, ids, lc_pos, &bc, &iv, FITM_POSITION_BUCKETS) &&
        run_pos(&rg, ids, lg_pos, &bg, &iv, FITM_POSITION_BUCKETS)) {
        e_bk = logit_err(lg_pos, lc_pos, NL, V);
        e_bk_mass = abs_err(mg, mc, nm);
        e_bk_probs = abs_err(pg, pc, np);
        /* buckets give log p^: set against the plain pass's log-softmax (lc becomes it) */
        for (int64_t r = 0; r < NL; r++) {
            float *x = lc + r * V;
            double mx = -INFINITY, z = 0;
            for (int64_t v = 0; v < V; v++)
                mx = fmax(mx, x[v]);
            for (int64_t v = 0; v < V; v++)
                z += exp(x[v] - mx);
            for (int64_t v = 0; v < V; v++)
                x[v] = (float)(x[v] - mx - log(z));
        }
        bk_change = logit_err(lc_pos, lc, NL, V);
    }
    printf("%-16s buckets logits %.2e  span mass %.2e  probs %.2e  (change from plain %.2e)\n",
           what, e_bk, e_bk_mass, e_bk_probs, bk_change);
    CHECK(e_bk <= rtol, "%s: Attention Buckets logits off by %.3g", what, e_bk);
    CHECK(e_bk_mass <= MASS_ATOL, "%s: Attention Buckets span mass off by %.3g", what, e_bk_mass);
    CHECK(e_bk_probs <= MASS_ATOL, "%s: Attention Buckets probabilities off by %.3g", what,
          e_bk_probs);
    CHECK(bk_change > 1e-3, "%s: Attention Buckets changed nothing (%.3g)", what, bk_change);
    free(pc), free(pg);
    free(lc), free(lg), free(lg2), free(lg_iv), free(mc), free(mg), free(lg_pos), free(lc_pos);
    runner_close(&rc);
    runner_close(&rg);
    /* fitmd's start-up self-test passes on this model (its bounds, backend_check.c, are looser
     * than the ones above: they must hold for 30-layer models too) */
    fitm_backend_check_report rep;
    CHECK(fitm_backend_check(m, cpu, gpu, FITM_CHECK_PRODUCTS_F32, &rep, &err) == FITM_OK, "%s: %s",
          what, err.msg);
    printf("%-16s start-up check: logits %.2e  attention %.2e\n", what, rep.logit_err,
           rep.prob_err);
    fitm_model_close(m);
    free(buf);
}

/* Device bytes of the bfloat16 copies of m's layer matrices: 2 per weight. */
static size_t bf16_bytes_of(const fitm_model *m)
{
    size_t n = 0;
    for (int32_t l = 0; l < fitm_model_config_of(m)->n_layer; l++) {
        const fitm_layer *ly = fitm_model_layer(m, l);
        const fitm_weight *w[] = {&ly->wq,     &ly->wk,   &ly->wv,    &ly->wo,
                                  &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
            n += w[i]->data ? (size_t)(w[i]->n_rows * w[i]->n_cols) * 2 : 0;
    }
    return n;
}

/* The BATCH class in bfloat16 (gpu16, the backend's default) on model (arch, t): the copies
 * made at prepare are the layer matrices' size; a branch over [0, 9) recomputing [9, T) and
 * (for Q4_K) single-token steps give the full pass's rows bit for bit, as in F32; the rows
 * differ from the F32 path's (gpu32: the bfloat16 products are what ran); against the CPU,
 * logits and captured span masses of an intervened pass within LOGIT_RTOL_BF16 and
 * MASS_ATOL_BF16 (derived above); fitmd's start-up check with its bfloat16 bounds passes. */
static void test_model_bf16(fitm_backend *cpu, fitm_backend *gpu32, fitm_backend *gpu16,
                            fitm_gen_arch arch, fitm_dtype t)
{
    void *buf = NULL;
    fitm_model *m = gen_model(arch, t, &buf);
    runner rc, r32, rg;
    bool ok =
        m && runner_open(&rc, cpu, m) && runner_open(&r32, gpu32, m) && runner_open(&rg, gpu16, m);
    CHECK(ok, "bf16 runners");
    if (!ok) {
        fitm_model_close(m);
        free(buf);
        return;
    }
    char what[96];
    snprintf(what, sizeof what, "%s %s bf16", fitm_gen_arch_name(arch),
             fitm_dtype_info_of(t)->name);
    CHECK(fitm_backend_cuda_bf16_bytes(gpu16) == bf16_bytes_of(m),
          "%s: bfloat16 copies of %zu bytes, the layer matrices hold %zu weights", what,
          fitm_backend_cuda_bf16_bytes(gpu16), bf16_bytes_of(m) / 2);
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab, L = c->n_layer, H = c->n_head;
    int32_t ids[T];
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 7919 + 13 * (int)t + 5) % V);
    float *lc = malloc(sizeof(float) * T * V), *lg = malloc(sizeof(float) * T * V);
    float *lg2 = malloc(sizeof(float) * T * V), *l32 = malloc(sizeof(float) * T * V);
    const fitm_span spans[2] = {{2, 7}, {8, 15}};
    const float alpha[2] = {1.7f, 0.3f};
    const int64_t rows[2] = {4, T - 1};
    const int64_t nm = 2 * L * H * 2;
    float *mc = calloc((size_t)nm, sizeof(float)), *mg = calloc((size_t)nm, sizeof(float));
    fitm_capture cc = {.rows = rows,
                       .n_rows = 2,
                       .spans = spans,
                       .n_spans = 2,
                       .span_mass = mc,
                       .after_intervention = true};
    fitm_capture cg = cc;
    cg.span_mass = mg;
    const fitm_intervention iv = {.spans = spans, .n_spans = 2, .alpha = alpha, .from_pos = 15};
    double e_iv = INFINITY, e_mass = INFINITY;
    if (run(&rc, ids, lc, &cc, &iv) && run(&rg, ids, lg, &cg, &iv)) {
        e_iv = logit_err(lg, lc, NL, V);
        e_mass = abs_err(mg, mc, nm);
    }
    /* the plain pass on both paths: bfloat16 must differ from F32 (else it did not run) */
    bool plain = run(&r32, ids, l32, NULL, NULL) && run(&rg, ids, lg, NULL, NULL);
    const double e_f32 = plain ? logit_err(lg, l32, NL, V) : 0;
    printf("%-21s intervened logits %.2e  span mass %.2e  (from the F32 path %.2e)\n", what, e_iv,
           e_mass, e_f32);
    const double rtol = fitm_dtype_info_of(t)->block_elems > 1
                            ? fmax(LOGIT_RTOL_Q8, LOGIT_RTOL_BF16)
                            : LOGIT_RTOL_BF16;
    CHECK(e_iv <= rtol, "%s: intervened logits off by %.3g of the largest", what, e_iv);
    CHECK(e_mass <= MASS_ATOL_BF16, "%s: captured span mass off by %.3g", what, e_mass);
    CHECK(plain && e_f32 > 0, "%s: the bfloat16 path gave the F32 path's logits", what);

    fitm_err err;
    if (plain) {
        fitm_kv_rebase(rg.kv2, 9, &err);
        fitm_forward_opts ob = {
            .prefix = rg.kv, .n_logits = NL, .logits = lg2, .path = FITM_PATH_BATCH};
        CHECK(fitm_forward_run(rg.f, rg.kv2, ids + 9, T - 9, 9, &ob, &err) == FITM_OK, "%s",
              err.msg);
        CHECK(memcmp(lg, lg2, sizeof(float) * NL * V) == 0,
              "%s: prefix reuse differs from the full pass", what);
    }
    if (plain && t == FITM_DTYPE_Q4_K) { /* one type: slow emulated */
        fitm_kv_rebase(rg.kv2, 0, &err);
        memset(lg2, 0, sizeof(float) * NL * V);
        for (int64_t i = 0; i < T; i++) {
            fitm_forward_opts o1 = {.n_logits = i >= T - NL,
                                    .logits = i >= T - NL ? lg2 + (i - (T - NL)) * V : NULL,
                                    .path = FITM_PATH_BATCH};
            CHECK(fitm_forward_run(rg.f, rg.kv2, ids + i, 1, i, &o1, &err) == FITM_OK, "%s",
                  err.msg);
        }
        CHECK(memcmp(lg, lg2, sizeof(float) * NL * V) == 0,
              "%s: single-token steps (BATCH) differ from the full pass", what);
    }
    free(lc), free(lg), free(lg2), free(l32), free(mc), free(mg);
    runner_close(&rc);
    runner_close(&r32);
    runner_close(&rg);
    fitm_backend_check_report rep;
    CHECK(fitm_backend_check(m, cpu, gpu16, FITM_CHECK_PRODUCTS_BF16, &rep, &err) == FITM_OK,
          "%s: %s", what, err.msg);
    printf("%-21s start-up check: logits %.2e (tol %.0e)  attention %.2e (tol %.0e)\n", what,
           rep.logit_err, rep.logit_tol, rep.prob_err, rep.prob_tol);
    fitm_model_close(m);
    free(buf);
}

/* Rows across the bfloat16 GEMM's 64-row tiles: a 70-token pass (two row tiles, the second
 * mostly zero padding) against branches at 9 and at 60 that recompute its suffix (rows moving
 * from the second tile to the first, and to other places in it), the last rows' logits bit for
 * bit. */
static void test_bf16_chunks(fitm_backend *gpu16)
{
    enum { TL = 70, NLL = 8 };
    void *buf = NULL;
    fitm_model *m = gen_model(FITM_GEN_ARCH_LLAMA, FITM_DTYPE_Q4_K, &buf);
    const fitm_forward_params fp = {TL, TL, TL};
    fitm_forward *f = NULL;
    fitm_kv *kv = NULL, *kv2 = NULL;
    fitm_err err = {{0}};
    const fitm_model_config *c = m ? fitm_model_config_of(m) : NULL;
    bool ok = m && fitm_forward_create(&f, m, gpu16, &fp, &err) == FITM_OK &&
              fitm_kv_create(&kv, gpu16, c, TL, &err) == FITM_OK &&
              fitm_kv_create(&kv2, gpu16, c, TL, &err) == FITM_OK;
    CHECK(ok, "bf16 chunk test setup: %s", err.msg);
    const int64_t V = ok ? c->n_vocab : 1;
    int32_t ids[TL];
    for (int i = 0; i < TL; i++)
        ids[i] = (int32_t)((i * 613 + 29) % V);
    float *full = malloc(sizeof(float) * NLL * V), *part = malloc(sizeof(float) * NLL * V);
    fitm_forward_opts o = {.n_logits = NLL, .logits = full, .path = FITM_PATH_BATCH};
    ok = ok && fitm_forward_run(f, kv, ids, TL, 0, &o, &err) == FITM_OK;
    CHECK(ok, "70-token pass: %s", err.msg);
    const int64_t at[] = {9, 60};
    for (size_t i = 0; i < sizeof at / sizeof at[0] && ok; i++) {
        fitm_kv_rebase(kv2, at[i], &err);
        fitm_forward_opts ob = {
            .prefix = kv, .n_logits = NLL, .logits = part, .path = FITM_PATH_BATCH};
        CHECK(fitm_forward_run(f, kv2, ids + at[i], TL - at[i], at[i], &ob, &err) == FITM_OK, "%s",
              err.msg);
        CHECK(memcmp(full, part, sizeof(float) * NLL * V) == 0,
              "bf16: a branch at %lld differs from the 70-token pass", (long long)at[i]);
    }
    free(full), free(part);
    fitm_kv_destroy(kv);
    fitm_kv_destroy(kv2);
    fitm_forward_destroy(f);
    fitm_model_close(m);
    free(buf);
}

/* A conversion to bfloat16 that fails at prepare (an injected launch failure) fails the
 * forward's creation with the weight's name and the way out; the next prepare converts them
 * all. */
static void test_bf16_prepare_error(void)
{
#ifdef FITM_CUDA_EMU
    void *buf = NULL;
    fitm_model *m = gen_model(FITM_GEN_ARCH_LLAMA, FITM_DTYPE_Q8_0, &buf);
    fitm_backend *b = NULL;
    fitm_forward *f = NULL;
    fitm_err err = {{0}};
    if (!m || fitm_backend_cuda_create(&b, 0, &err) != FITM_OK) {
        CHECK(false, "bf16 prepare error setup: %s", err.msg);
        return;
    }
    const fitm_forward_params fp = {T, T, T};
    fitm_emu_inject_error("launch", cudaErrorInvalidConfiguration);
    CHECK(fitm_forward_create(&f, m, b, &fp, &err) == FITM_ERR_BACKEND && !f);
    CHECK(strstr(err.msg, "converting 'blk.0.attn_q.weight' to bfloat16") &&
              strstr(err.msg, "gpu_weights f32") && strstr(err.msg, "InvalidConfiguration"),
          "%s", err.msg);
    CHECK(fitm_forward_create(&f, m, b, &fp, &err) == FITM_OK, "%s", err.msg);
    CHECK(fitm_backend_cuda_bf16_bytes(b) == bf16_bytes_of(m));
    fitm_forward_destroy(f);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    free(buf);
#endif
}

/* A failed launch becomes FITM_ERR_BACKEND for that call and the next call works. */
static void test_error_channel(fitm_backend *gpu)
{
#ifdef FITM_CUDA_EMU
    void *buf = NULL;
    fitm_model *m = gen_model(FITM_GEN_ARCH_LLAMA, FITM_DTYPE_Q8_0, &buf);
    runner r;
    if (!m || !runner_open(&r, gpu, m)) {
        CHECK(false, "error channel setup");
        return;
    }
    int32_t ids[T] = {1, 2, 3};
    float *l = malloc(sizeof(float) * T * fitm_model_config_of(m)->n_vocab);
    fitm_err err;
    fitm_emu_inject_error("launch", cudaErrorInvalidConfiguration);
    fitm_forward_opts o = {.n_logits = 1, .logits = l};
    CHECK(fitm_forward_run(r.f, r.kv, ids, 3, 0, &o, &err) == FITM_ERR_BACKEND);
    CHECK(strstr(err.msg, "cudaErrorInvalidConfiguration") != NULL, "message: %s", err.msg);
    CHECK(fitm_kv_pos_end(r.kv) == 0);
    CHECK(fitm_forward_run(r.f, r.kv, ids, 3, 0, &o, &err) == FITM_OK, "%s", err.msg);
    free(l);
    runner_close(&r);
    fitm_model_close(m);
    free(buf);
#else
    (void)gpu; /* a real device cannot be made to fail on demand */
#endif
}

/* Two ways of running the same steps that must give the same bits, through the forward
 * driver: the same backend with one of them turned off as the reference.
 * GRAPHS: CUDA graphs (the backend's default: the work between two waits captured and
 * replayed as one submission) against none.
 * FUSION: fused kernels (the default: the residual add with the next norm, a decode step's Q,
 * K and V products as one launch, the per-head norms with RoPE, a decode step's gate and up
 * products with the GLU, the K and V stores of a step's sequences as one launch) against each
 * op on its own (two copies per sequence for the stores: the caches, read by every later
 * step, must hold the same bits);
 * every fused kernel keeps the arithmetic of the ones it replaces, so bit for bit again.
 * On a gemma3 model (local and global layers, per-head norms, GELU) and for FUSION also a
 * llama one (no per-head norms, SiLU), with the BATCH class in F32 (weights w) and on gemma3
 * in bfloat16 too: prompts of different lengths (the BATCH class, whose cuBLAS products in F32
 * end a capture early, while the bfloat16 GEMM is captured with the rest, and with FUSION runs
 * Q, K and V, and gate and up, as one launch each; on the emulator, with bfloat16, GRAPHS sees
 * the prompts after the first submitted with no cuBLAS call and no kernel launched outside a
 * graph), then decode steps of three and of two sequences in
 * turn (two shapes, so graphs are both updated with new arguments and kept per shape), logits
 * and top-k of every step bit for bit equal, and last a pass of both classes at once. On the
 * emulator, the steps after the first of each shape must be submitted as graphs: no kernel
 * launched directly, at least one graph launch a step; with GRAPHS the same kernels run as
 * without graphs, with FUSION at least the launches a layer the fused kernels save fewer (2 for
 * Q, K and V in one launch; 2 for the GLU; 3 for norms and RoPE with per-head norms, else 1;
 * with post-norms, 2 more: each post-norm runs with the add and the norm after it, the last
 * one with the final norm of the step's rows; less the one launch of the K and V stores,
 * which unfused are copies).
 * On the emulator and on a device, with GRAPHS, the steps from the fourth on (each shape run
 * twice before) update their shapes' instances (fitm_backend_cuda_get_stats) and instantiate
 * none. PIECES compares gpu submitting its graphs in pieces of a few ops with the default
 * (one graph between two waits): the same bits, more graph launches, as many waits, and
 * no instance made after the fourth step either. PDL compares gpu's programmatic launches
 * (the default where the device has them: every kernel's grid may start while the kernel
 * before it runs, and waits for it first; on the emulator, which reports sm_90, every kernel
 * of gpu's steps runs so) with plain ones: the same bits, so no kernel reads what the kernel
 * before it writes ahead of its wait (on a device the grids really overlap). */
enum { GRAPHS, FUSION, PIECES, PDL };
static void test_same_steps(fitm_backend *gpu, fitm_cuda_weights w, fitm_gen_arch arch, int mode)
{
    void *buf = NULL;
    fitm_model *m = gen_model(arch, FITM_DTYPE_Q5_0, &buf);
    fitm_backend *plain = NULL;
    fitm_err err = {{0}};
    const char *way = mode == GRAPHS   ? "graphs"
                      : mode == FUSION ? "fusion"
                      : mode == PIECES ? "pieces"
                                       : "programmatic launches";
    if (!m || fitm_backend_cuda_create(&plain, 0, &err) != FITM_OK) {
        CHECK(false, "%s test setup: %s", way, err.msg);
        return;
    }
    fitm_backend_cuda_set_weights(plain, w); /* as gpu's */
    if (mode == GRAPHS)
        fitm_backend_cuda_set_graphs(plain, false);
    else if (mode == FUSION)
        fitm_backend_cuda_set_fusion(plain, false);
    else if (mode == PIECES)
        fitm_backend_cuda_set_pieces(gpu, 24);
    else
        fitm_backend_cuda_set_pdl(plain, false);
    enum { B = 3, PROMPT = 5, STEPS = 6, K = 8 };
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab;
    fitm_backend *bk[2] = {plain, gpu};
    fitm_forward *f[2] = {NULL, NULL};
    fitm_kv *kv[2][B] = {{NULL}};
    float *lg[2] = {malloc(sizeof(float) * B * V), malloc(sizeof(float) * B * V)};
    fitm_top top[2][B * K];
    const fitm_forward_params fp = {T, T, T};
    bool ready = lg[0] && lg[1];
    for (int i = 0; i < 2 && ready; i++) {
        ready = fitm_forward_create(&f[i], m, bk[i], &fp, &err) == FITM_OK;
        for (int q = 0; q < B && ready; q++)
            ready = fitm_kv_create(&kv[i][q], bk[i], c, T, &err) == FITM_OK;
    }
    CHECK(ready, "%s test: %s", way, err.msg);
    int32_t ids[B][PROMPT + STEPS];
    for (int q = 0; q < B; q++)
        for (int t = 0; t < PROMPT + STEPS; t++)
            ids[q][t] = (int32_t)((q * 131 + t * 17 + 3) % V);
    int64_t pos[B];
    for (int q = 0; q < B && ready; q++) { /* prompts of 3, 4 and 5 tokens */
        pos[q] = PROMPT - (B - 1 - q);
        for (int i = 0; i < 2; i++) {
            fitm_forward_opts o = {.n_logits = 2, .logits = lg[i]};
#ifdef FITM_CUDA_EMU
            fitm_emu_stats st[2];
            fitm_emu_get_stats(&st[0]);
#endif
            CHECK(fitm_forward_run(f[i], kv[i][q], ids[q], pos[q], 0, &o, &err) == FITM_OK,
                  "prompt: %s", err.msg);
#ifdef FITM_CUDA_EMU
            fitm_emu_get_stats(&st[1]);
            /* the first prompt grows the backend's scratch: allocations end its capture */
            if (i == 1 && q > 0 && mode == GRAPHS && w == FITM_CUDA_WEIGHTS_BF16)
                CHECK(st[1].blas_calls == st[0].blas_calls && st[1].launches == st[0].launches &&
                          st[1].graph_launches > st[0].graph_launches,
                      "prompt %d in bfloat16: %llu cuBLAS calls, %llu kernels launched outside "
                      "a graph, %llu graph launches",
                      q, st[1].blas_calls - st[0].blas_calls, st[1].launches - st[0].launches,
                      st[1].graph_launches - st[0].graph_launches);
#endif
        }
        CHECK(memcmp(lg[0], lg[1], sizeof(float) * 2 * V) == 0,
              "prompt %d: logits with %s differ from those without", q, way);
    }
    for (int t = 0; t < STEPS && ready; t++) {
        const int nb = t % 2 ? B - 1 : B;
#ifdef FITM_CUDA_EMU
        fitm_emu_stats st[2][2];
#endif
        fitm_backend_cuda_stats gs[2], ps[2];
        fitm_backend_cuda_get_stats(gpu, &gs[0]);
        fitm_backend_cuda_get_stats(plain, &ps[0]);
        for (int i = 0; i < 2; i++) {
            fitm_forward_opts o[B];
            fitm_forward_seq seq[B];
            for (int q = 0; q < nb; q++) {
                o[q] = (fitm_forward_opts){
                    .n_logits = 1, .logits = lg[i] + q * V, .top_k = K, .top = top[i] + q * K};
                seq[q] = (fitm_forward_seq){kv[i][q], &ids[q][pos[q]], 1, pos[q], &o[q]};
            }
#ifdef FITM_CUDA_EMU
            fitm_emu_get_stats(&st[i][0]);
#endif
            CHECK(fitm_forward_run_batch(f[i], seq, nb, &err) == FITM_OK, "step %d: %s", t,
                  err.msg);
#ifdef FITM_CUDA_EMU
            fitm_emu_get_stats(&st[i][1]);
#endif
        }
        fitm_backend_cuda_get_stats(gpu, &gs[1]);
        fitm_backend_cuda_get_stats(plain, &ps[1]);
        /* each shape has its instances once its second step ran (the first step's scratch
         * growth ends its capture early): later steps replay them whole, every submission
         * of the step (a logits download splits it in two; the K/V rows, key counts, ids and
         * RoPE tables are staged bytes, not launch arguments), or, in pieces, update them */
        if (mode == GRAPHS && t >= 3)
            CHECK(gs[1].graph_instantiations == gs[0].graph_instantiations &&
                      gs[1].graph_updates == gs[0].graph_updates &&
                      gs[1].graph_replays - gs[0].graph_replays ==
                          gs[1].graph_launches - gs[0].graph_launches &&
                      gs[1].graph_replays > gs[0].graph_replays,
                  "step %d: %llu graphs instantiated, %llu updated, %llu replayed", t,
                  (unsigned long long)(gs[1].graph_instantiations - gs[0].graph_instantiations),
                  (unsigned long long)(gs[1].graph_updates - gs[0].graph_updates),
                  (unsigned long long)(gs[1].graph_replays - gs[0].graph_replays));
        if (mode == PIECES && t >= 3)
            CHECK(gs[1].graph_instantiations == gs[0].graph_instantiations &&
                      gs[1].graph_updates > gs[0].graph_updates,
                  "step %d: %llu graphs instantiated, %llu updated", t,
                  (unsigned long long)(gs[1].graph_instantiations - gs[0].graph_instantiations),
                  (unsigned long long)(gs[1].graph_updates - gs[0].graph_updates));
        if (mode == PIECES)
            CHECK(gs[1].waits - gs[0].waits == ps[1].waits - ps[0].waits &&
                      gs[1].graph_launches - gs[0].graph_launches >
                          ps[1].graph_launches - ps[0].graph_launches,
                  "step %d: in pieces %llu graphs and %llu waits, whole %llu and %llu", t,
                  (unsigned long long)(gs[1].graph_launches - gs[0].graph_launches),
                  (unsigned long long)(gs[1].waits - gs[0].waits),
                  (unsigned long long)(ps[1].graph_launches - ps[0].graph_launches),
                  (unsigned long long)(ps[1].waits - ps[0].waits));
        for (int q = 0; q < nb; q++)
            pos[q]++;
        CHECK(memcmp(lg[0], lg[1], sizeof(float) * (size_t)(nb * V)) == 0,
              "step %d: logits with %s differ from those without", t, way);
        CHECK(memcmp(top[0], top[1], sizeof(fitm_top) * (size_t)(nb * K)) == 0,
              "step %d: top entries with %s differ from those without", t, way);
#ifdef FITM_CUDA_EMU
        const fitm_emu_stats *a = st[0], *g = st[1];
        const unsigned long long ran_a = a[1].kernels_run - a[0].kernels_run,
                                 ran_g = g[1].kernels_run - g[0].kernels_run;
        /* fused: fewer kernels, though the K and V stores of the step's nb > 1 sequences
         * are one launch a layer where the unfused step copies (no kernel) */
        const unsigned long long saved = (unsigned long long)c->n_layer * (c->qk_norm ? 6 : 4) +
                                         (c->post_norms ? 2ull * c->n_layer : 0);
        if (mode == GRAPHS)
            CHECK(ran_g == ran_a && a[1].launches - a[0].launches == ran_a,
                  "step %d: the same kernels run with and without graphs", t);
        else if (mode == PIECES)
            CHECK(ran_g == ran_a, "step %d: the same kernels run in pieces and whole", t);
        else if (mode == PDL)
            CHECK(ran_g == ran_a && g[1].programmatic - g[0].programmatic == ran_g &&
                      a[1].programmatic == a[0].programmatic,
                  "step %d: %llu of %llu kernels programmatic, %llu of the plain backend's", t,
                  g[1].programmatic - g[0].programmatic, ran_g,
                  a[1].programmatic - a[0].programmatic);
        else
            CHECK(ran_g + saved <= ran_a,
                  "step %d: %llu kernels fused, %llu not (%llu fewer "
                  "expected at least)",
                  t, ran_g, ran_a, saved);
        if (t >= 2)
            CHECK(g[1].launches == g[0].launches && g[1].graph_launches > g[0].graph_launches,
                  "step %d: %llu kernels launched directly, %llu graph launches", t,
                  g[1].launches - g[0].launches, g[1].graph_launches - g[0].graph_launches);
#endif
    }
    /* One pass of both classes (continuous batching: a decode step beside a prompt's rows),
     * where the fused gate/up/GLU runs the STEP rows and the BATCH rows go through the BATCH
     * products (cuBLAS, or the bfloat16 GEMM) and the GLU apart: sequence 0 decodes one
     * token, sequence 2 appends two on the BATCH path. */
    for (int i = 0; i < 2 && ready; i++) {
        fitm_forward_opts o[2] = {
            {.n_logits = 1, .logits = lg[i]},
            {.n_logits = 2, .logits = lg[i] + V, .path = FITM_PATH_BATCH},
        };
        fitm_forward_seq seq[2] = {{kv[i][0], &ids[0][pos[0]], 1, pos[0], &o[0]},
                                   {kv[i][2], &ids[2][pos[2]], 2, pos[2], &o[1]}};
        CHECK(fitm_forward_run_batch(f[i], seq, 2, &err) == FITM_OK, "mixed pass: %s", err.msg);
    }
    CHECK(!ready || memcmp(lg[0], lg[1], sizeof(float) * 3 * V) == 0,
          "a pass of both classes: logits with %s differ from those without", way);
    for (int i = 0; i < 2; i++) {
        for (int q = 0; q < B; q++)
            fitm_kv_destroy(kv[i][q]);
        fitm_forward_destroy(f[i]);
        free(lg[i]);
    }
    if (mode == PIECES)
        fitm_backend_cuda_set_pieces(gpu, 0);
    fitm_backend_destroy(plain);
    fitm_model_close(m);
    free(buf);
}

/* Replay (backend_cuda.c, replay_start): work between two waits that equals an instance's
 * last capture, item for item, is that instance launched again: no capture, no update, no
 * instantiation, graph_replays one more. On a gemma3 model after a prompt of random tokens,
 * gpu (graphs on) against plain (graphs off), each step's top entries (and logits, where a
 * step downloads them) bit for bit, steps rewinding the cache to position P (fitm_forward_run:
 * pos0 below the cache's end) unless said otherwise. A step that hands out only its top
 * entries is one submission (one wait, its top-k download); one that downloads its logits
 * too is two (the logits' download waits, then the top-k runs). Per step, the replays and
 * the instances updated or made (captures) that gpu must show:
 *   a warm-up step with an intervention (its scratch growth ends its capture early): not
 *     checked;
 *   the step at P: captured (1);
 *   the same step again: replayed (1 replay, no capture; on the emulator no kernel launched
 *     outside a graph and one graph launch);
 *   another token: staged bytes only (the ids), the same launches: replayed, other top entries;
 *   an intervention: its arrays staged before attention's arguments move those (the kernel's
 *     argument) in the staging buffer, so it differs from the step before; the warm-up step
 *     had the same launches (another token, the same intervention), and the candidates are
 *     narrowed item by item, not chosen by their first: replayed (1);
 *   an intervention of other spans' weights and another first position: staged bytes only
 *     (attention's arguments and spans): replayed, other top entries;
 *   another top-k count: the top-k kernel's arguments change at the end of the step, after
 *     everything else matched: captured, so the matched prefix must have run first;
 *   two tokens: other arguments from the first items on: captured (a new shape);
 *   the top-k count of two steps before: replayed (its instance, among several);
 *   the step with its logits downloaded, twice: captured (2), then replayed (2 replays);
 *   the steps at P + 1 and P + 2: other cache rows written (the K/V stores' staged
 *     descriptors) and one key more read (attention's staged arguments), the same launches:
 *     replayed (1). */
static void test_replay(fitm_backend *gpu, fitm_cuda_weights w)
{
    void *buf = NULL;
    fitm_model *m = gen_model(FITM_GEN_ARCH_GEMMA3, FITM_DTYPE_Q8_0, &buf);
    fitm_backend *plain = NULL;
    fitm_err err = {{0}};
    if (!m || fitm_backend_cuda_create(&plain, 0, &err) != FITM_OK) {
        CHECK(false, "replay test setup: %s", err.msg);
        fitm_model_close(m);
        free(buf);
        return;
    }
    fitm_backend_cuda_set_weights(plain, w);
    fitm_backend_cuda_set_graphs(plain, false);
    enum { P = 6, K = 8, K2 = 5 };
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab;
    fitm_backend *bk[2] = {plain, gpu};
    fitm_forward *f[2] = {NULL, NULL};
    fitm_kv *kv[2] = {NULL, NULL};
    float *lg[2] = {malloc(sizeof(float) * 2 * V), malloc(sizeof(float) * 2 * V)};
    fitm_top top[2][K], before[K];
    const fitm_forward_params fp = {T, T, T};
    bool ready = lg[0] && lg[1];
    for (int i = 0; i < 2 && ready; i++)
        ready = fitm_forward_create(&f[i], m, bk[i], &fp, &err) == FITM_OK &&
                fitm_kv_create(&kv[i], bk[i], c, T, &err) == FITM_OK;
    CHECK(ready, "replay test: %s", err.msg);
    uint64_t seed = (uint64_t)time(NULL);
    printf("replay test: seed %llu\n", (unsigned long long)seed);
    int32_t ids[P + 4];
    for (int i = 0; i < P + 4; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((seed >> 33) % (uint64_t)V);
    }
    const int32_t b_id = (int32_t)(((uint64_t)ids[P] + 1 + (seed >> 40) % (uint64_t)(V - 1)) %
                                   (uint64_t)V); /* another token than ids[P] */
    const fitm_span spans[2] = {{1, 3}, {3, 5}};
    const float alpha[2][2] = {{2.5f, 0.5f}, {0.25f, 3.0f}};
    const fitm_intervention iv[2] = {
        {.spans = spans, .n_spans = 2, .alpha = alpha[0], .from_pos = 5},
        {.spans = spans, .n_spans = 2, .alpha = alpha[1], .from_pos = 4},
    };
    for (int i = 0; i < 2 && ready; i++) {
        fitm_forward_opts o = {.n_logits = 1, .logits = lg[i]};
        CHECK(fitm_forward_run(f[i], kv[i], ids, P, 0, &o, &err) == FITM_OK, "prompt: %s", err.msg);
    }
    /* the steps: position, tokens, top-k count, intervention, logits downloaded; the replays
     * and captures gpu shows (-1: not checked) */
    struct {
        int64_t pos, n;
        const int32_t *ids;
        int k;
        const fitm_intervention *iv;
        bool logits;
        int replays, captures;
        const char *what;
    } steps[] = {
        {P, 1, &b_id, K, &iv[0], false, -1, -1, "a warm-up step"},
        {P, 1, &ids[P], K, NULL, false, 0, 1, "the step at P"},
        {P, 1, &ids[P], K, NULL, false, 1, 0, "the same step again"},
        {P, 1, &b_id, K, NULL, false, 1, 0, "another token"},
        {P, 1, &ids[P], K, &iv[0], false, 1, 0, "an intervention"},
        {P, 1, &ids[P], K, &iv[1], false, 1, 0, "an intervention of other weights"},
        {P, 1, &ids[P], K2, NULL, false, 0, 1, "another top-k count"},
        {P, 2, &ids[P], K, NULL, false, 0, 1, "two tokens"},
        {P, 1, &ids[P], K2, NULL, false, 1, 0, "the top-k count of two steps before"},
        {P, 1, &ids[P], K, NULL, true, 0, 2, "the step with its logits"},
        {P, 1, &ids[P], K, NULL, true, 2, 0, "the step with its logits again"},
        {P + 1, 1, &ids[P + 1], K, NULL, false, 1, 0, "the next position"},
        {P + 2, 1, &ids[P + 2], K, NULL, false, 1, 0, "the position after"},
    };
    for (size_t t = 0; t < sizeof steps / sizeof steps[0] && ready; t++) {
        fitm_backend_cuda_stats gs[2];
#ifdef FITM_CUDA_EMU
        fitm_emu_stats st[2];
#endif
        for (int i = 0; i < 2; i++) {
            fitm_forward_opts o = {.n_logits = 1,
                                   .logits = steps[t].logits ? lg[i] : NULL,
                                   .top_k = steps[t].k,
                                   .top = top[i],
                                   .intervention = steps[t].iv};
            if (i == 1) {
                fitm_backend_cuda_get_stats(gpu, &gs[0]);
#ifdef FITM_CUDA_EMU
                fitm_emu_get_stats(&st[0]);
#endif
            }
            CHECK(fitm_forward_run(f[i], kv[i], steps[t].ids, steps[t].n, steps[t].pos, &o, &err) ==
                      FITM_OK,
                  "%s: %s", steps[t].what, err.msg);
        }
        fitm_backend_cuda_get_stats(gpu, &gs[1]);
#ifdef FITM_CUDA_EMU
        fitm_emu_get_stats(&st[1]);
#endif
        const long long replays = (long long)(gs[1].graph_replays - gs[0].graph_replays),
                        made = (long long)(gs[1].graph_updates - gs[0].graph_updates +
                                           gs[1].graph_instantiations - gs[0].graph_instantiations);
        CHECK(steps[t].replays < 0 ||
                  (replays == steps[t].replays && made == steps[t].captures &&
                   gs[1].graph_launches - gs[0].graph_launches == (uint64_t)(replays + made)),
              "%s: %lld replays and %lld captures, want %d and %d", steps[t].what, replays, made,
              steps[t].replays, steps[t].captures);
#ifdef FITM_CUDA_EMU
        if (steps[t].replays > 0 && steps[t].captures == 0)
            CHECK(st[1].launches == st[0].launches &&
                      st[1].graph_launches - st[0].graph_launches == (uint64_t)steps[t].replays,
                  "%s: %llu kernels launched outside a graph, %llu graph launches", steps[t].what,
                  st[1].launches - st[0].launches, st[1].graph_launches - st[0].graph_launches);
#endif
        if (steps[t].logits)
            CHECK(memcmp(lg[0], lg[1], sizeof(float) * (size_t)V) == 0,
                  "%s: logits with graphs differ from those without", steps[t].what);
        CHECK(memcmp(top[0], top[1], sizeof(fitm_top) * (size_t)steps[t].k) == 0,
              "%s: top entries with graphs differ from those without", steps[t].what);
        /* the replays of other staged bytes gave other entries than the step before */
        if (t >= 1 && (steps[t].ids == &b_id || steps[t].iv == &iv[1]))
            CHECK(memcmp(before, top[1], sizeof before) != 0,
                  "%s: the top entries of the step before", steps[t].what);
        memcpy(before, top[1], sizeof before);
    }
    for (int i = 0; i < 2; i++) {
        fitm_kv_destroy(kv[i]);
        fitm_forward_destroy(f[i]);
        free(lg[i]);
    }
    fitm_backend_destroy(plain);
    fitm_model_close(m);
    free(buf);
}

/* The post-norm kept pending (fusion on) against each op launched as it comes (fusion off),
 * on a prepared gemma3 model's norm weights (resident, as the forward driver's are) and the
 * same fresh random rows, ops called directly: every order the pending work can meet must
 * give the bits the unfused ops give. The forward driver's post-norm, add and next norm (all
 * rows; the last row alone, as the final norm of a prompt; the first, as of a step's first
 * sequence) run as one kernel on the emulator; a download (a wait) after the norm or after
 * the add, an add of another buffer, another op between the add and the norm, a norm with
 * another eps, fusion turned off with work pending, and a launch failure with work pending
 * (reported by status, after which the next ops are right again) launch it in order. */
static void test_pending_norm(void)
{
    void *buf = NULL;
    fitm_model *m = gen_model(FITM_GEN_ARCH_GEMMA3, FITM_DTYPE_Q8_0, &buf);
    fitm_backend *bk[2] = {NULL, NULL}; /* fused (the default), unfused */
    fitm_forward *f[2] = {NULL, NULL};
    fitm_err err = {{0}};
    const fitm_forward_params fp = {T, T, T};
    bool ready = m != NULL;
    for (int i = 0; i < 2 && ready; i++)
        ready = fitm_backend_cuda_create(&bk[i], 0, &err) == FITM_OK &&
                fitm_forward_create(&f[i], m, bk[i], &fp, &err) == FITM_OK; /* prepares */
    CHECK(ready, "pending norm setup: %s", err.msg);
    if (!ready)
        goto done;
    fitm_backend_cuda_set_fusion(bk[1], false);
    const fitm_model_config *c = fitm_model_config_of(m);
    const fitm_layer *ly = fitm_model_layer(m, 0);
    const fitm_weight *post = &ly->post_attn_norm, *next = &ly->ffn_norm;
    enum { R = 3 };
    const int64_t C = c->n_embd, n = R * C;
    const float eps = c->norm_eps;
    const size_t bytes = (size_t)n * sizeof(float);
    float *init = malloc(3 * bytes), *got[2] = {malloc(3 * bytes), malloc(3 * bytes)};
    float *dev[2][3] = {{NULL}}; /* t (a block's output), x (the residual), xn */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            dev[i][j] = bk[i]->ops->alloc(bk[i], bytes);
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    static const char *const cases[] = {
        "post-norm, add, norm",
        "post-norm, add, norm of the last row",
        "post-norm, add, norm of the first row",
        "post-norm, download",
        "post-norm, add, download",
        "post-norm, add of another buffer, norm",
        "post-norm, add, softcap, norm",
        "post-norm, add, norm with another eps",
        "post-norm, fusion off, add, norm",
        "post-norm, add, launch failure, status",
    };
    for (int k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++) {
        for (int64_t e = 0; e < 3 * n; e++) { /* t and x in [-2, 2), xn as garbage */
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            init[e] = (float)((seed >> 40) * (4.0 / 16777216.0) - 2.0);
        }
        unsigned long long ran[2] = {0, 0};
        bool failed_right = true;
        for (int i = 0; i < 2; i++) {
            fitm_backend *b = bk[i];
            const fitm_backend_ops *o = b->ops;
            float *t = dev[i][0], *x = dev[i][1], *xn = dev[i][2];
            for (int j = 0; j < 3; j++)
                o->upload(b, dev[i][j], init + j * n, bytes);
            CHECK(o->status(b, &err) == FITM_OK, "%s: upload: %s", cases[k], err.msg);
#ifdef FITM_CUDA_EMU
            fitm_emu_stats st[2];
            fitm_emu_get_stats(&st[0]);
#endif
            o->rmsnorm(b, t, t, post, R, C, eps);
            switch (k) {
            case 0:
                o->add(b, x, t, n);
                o->rmsnorm(b, xn, x, next, R, C, eps);
                break;
            case 1:
            case 2:
                o->add(b, x, t, n);
                o->rmsnorm(b, xn, x + (k == 1 ? (R - 1) * C : 0), next, 1, C, eps);
                break;
            case 3:
                o->download(b, got[i], t, bytes);
                break;
            case 4:
                o->add(b, x, t, n);
                o->download(b, got[i], x, bytes);
                break;
            case 5:
                o->add(b, x, xn, n);
                o->rmsnorm(b, t, x, next, R, C, eps);
                break;
            case 6:
                o->add(b, x, t, n);
                o->softcap(b, x, n, 1.5f);
                o->rmsnorm(b, xn, x, next, R, C, eps);
                break;
            case 7:
                o->add(b, x, t, n);
                o->rmsnorm(b, xn, x, next, R, C, 2 * eps);
                break;
            case 8:
                fitm_backend_cuda_set_fusion(b, false);
                o = b->ops;
                o->add(b, x, t, n);
                o->rmsnorm(b, xn, x, next, R, C, eps);
                fitm_backend_cuda_set_fusion(b, i == 0);
                o = b->ops;
                break;
            case 9:
                o->add(b, x, t, n);
#ifdef FITM_CUDA_EMU
                if (i == 0) { /* the unfused ops were launched already */
                    fitm_emu_inject_error("launch", cudaErrorInvalidConfiguration);
                    failed_right = o->status(b, &err) == FITM_ERR_BACKEND;
                }
                for (int j = 0; j < 3; j++) /* the next ops see nothing of the failed ones */
                    o->upload(b, dev[i][j], init + j * n, bytes);
                o->rmsnorm(b, t, t, post, R, C, eps);
                o->add(b, x, t, n);
                o->rmsnorm(b, xn, x, next, R, C, eps);
#endif
                break;
            }
            for (int j = 0; j < 3; j++)
                o->download(b, got[i] + j * n, dev[i][j], bytes);
            CHECK(o->status(b, &err) == FITM_OK, "%s: %s", cases[k], err.msg);
#ifdef FITM_CUDA_EMU
            fitm_emu_get_stats(&st[1]);
            ran[i] = st[1].kernels_run - st[0].kernels_run;
#endif
        }
        CHECK(failed_right, "%s: the launch failure not reported", cases[k]);
        CHECK(memcmp(got[0], got[1], 3 * bytes) == 0, "%s: fused and unfused values differ",
              cases[k]);
        CHECK(memcmp(got[0], init, 2 * bytes) != 0, "%s: nothing computed", cases[k]);
#ifdef FITM_CUDA_EMU
        if (k <= 2)
            CHECK(ran[0] == 1 && ran[1] == 3, "%s: %llu kernels fused, %llu not (1 and 3 expected)",
                  cases[k], ran[0], ran[1]);
#else
        (void)ran;
#endif
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            bk[i]->ops->free(bk[i], dev[i][j]);
    free(init), free(got[0]), free(got[1]);
done:
    for (int i = 0; i < 2; i++) {
        fitm_forward_destroy(f[i]);
        fitm_backend_destroy(bk[i]);
    }
    fitm_model_close(m);
    free(buf);
}

/* A freed allocation is handed out again (backend_cuda.c, "the pool"): to an allocation it
 * fits (at most a quarter larger than asked), zeroed whatever its last owner wrote, and on the
 * emulator with no cudaMalloc or cudaFree; a smaller request gets memory of its own. A
 * cudaMalloc that finds the device full releases the pool and succeeds on its second try. */
static void test_pool(void)
{
    enum { n = 1 << 18 }; /* floats */
    fitm_backend *gpu = NULL; /* its own, so that its pool starts empty */
    fitm_err err = {{0}};
    if (fitm_backend_cuda_create(&gpu, 0, &err) != FITM_OK) {
        CHECK(false, "pool test: %s", err.msg);
        return;
    }
    float *host = malloc(n * sizeof *host);
    uint32_t x = 0x9e3779b9u;
    for (int i = 0; i < n; i++) { /* xorshift: fresh non-zero values */
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        host[i] = (float)(x >> 8) / 16777216.0f + 0.5f;
    }
    float *a = gpu->ops->alloc(gpu, n * sizeof(float));
    CHECK(host && a);
    if (!host || !a) {
        free(host);
        fitm_backend_destroy(gpu);
        return;
    }
    gpu->ops->upload(gpu, a, host, n * sizeof(float));
    gpu->ops->free(gpu, a);
#ifdef FITM_CUDA_EMU
    fitm_emu_stats st[2];
    fitm_emu_get_stats(&st[0]);
#endif
    const int64_t m = n - n / 8;
    float *b = gpu->ops->alloc(gpu, (size_t)m * sizeof(float));
    CHECK(b == a, "the freed block serves an allocation 7/8 of its size");
    gpu->ops->download(gpu, host, b, (size_t)m * sizeof(float));
    int64_t nonzero = 0;
    for (int64_t i = 0; i < m; i++)
        nonzero += host[i] != 0.0f;
    CHECK(nonzero == 0, "%lld of %lld values of the reused block not zeroed", (long long)nonzero,
          (long long)m);
    gpu->ops->free(gpu, b);
    float *c = gpu->ops->alloc(gpu, (n / 2) * sizeof(float));
    CHECK(c && c != a, "a block twice the size is not handed to half of it");
#ifdef FITM_CUDA_EMU
    fitm_emu_get_stats(&st[1]);
    CHECK(st[1].mallocs - st[0].mallocs == 1 && st[1].frees == st[0].frees,
          "one cudaMalloc (the half), no cudaFree: %llu, %llu", st[1].mallocs - st[0].mallocs,
          st[1].frees - st[0].frees);
    /* the device full once: the pool (a) is released and the second try succeeds */
    fitm_emu_inject_error("malloc", cudaErrorMemoryAllocation);
    float *d = gpu->ops->alloc(gpu, 2 * n * sizeof(float));
    fitm_emu_get_stats(&st[0]);
    CHECK(d != NULL, "an allocation after the pool's release");
    CHECK(st[0].frees - st[1].frees == 1 && st[0].mallocs - st[1].mallocs == 1,
          "the pool's one block released, one cudaMalloc: %llu, %llu",
          st[0].frees - st[1].frees, st[0].mallocs - st[1].mallocs);
    gpu->ops->free(gpu, d);
#endif
    gpu->ops->free(gpu, c);
    CHECK(gpu->ops->status(gpu, &err) == FITM_OK, "%s", err.msg);
    free(host);
    fitm_backend_destroy(gpu);
}

/* Host memory handed to an op where device memory belongs (the rope table of a test that once
 * passed a malloc'd one): the emulated device, like a real one, loses the context with an
 * illegal address; the backend reports it as a lost device on every later status, and
 * allocates nothing more. Last, since the device is gone afterwards (the emulator's reset
 * brings it back for the end of the process). */
static void test_lost_context(fitm_backend *gpu)
{
#ifdef FITM_CUDA_EMU
    enum { rows = 2, heads = 2, dim = 8, n_rot = 8 };
    float *x = gpu->ops->alloc(gpu, (size_t)(rows * heads * dim) * sizeof(float));
    float table[rows * n_rot];
    for (int i = 0; i < rows * n_rot; i++)
        table[i] = (float)i / 16.0f;
    fitm_err err = {{0}};
    CHECK(x && gpu->ops->status(gpu, &err) == FITM_OK);
    gpu->ops->rope(gpu, x, rows, heads, dim, n_rot, table, false);
    CHECK(gpu->ops->status(gpu, &err) == FITM_ERR_BACKEND);
    CHECK(strstr(err.msg, "cudaErrorIllegalAddress") && strstr(err.msg, "device lost"), "%s",
          err.msg);
    CHECK(gpu->ops->status(gpu, &err) == FITM_ERR_BACKEND, "sticky");
    void *more = gpu->ops->alloc(gpu, 64);
    CHECK(more == NULL, "an allocation after the loss");
    gpu->ops->free(gpu, x);
    fitm_emu_reset_device();
#else
    (void)gpu; /* a real device would have to be lost for good */
#endif
}

/* Everything but the model comparisons: the bf16 chunks, the steps' modes, replay, the error
 * channel and (last: it loses gpu's context) a lost device; gpu16 is destroyed on the way. */
static void test_rest(fitm_backend *gpu, fitm_backend *gpu16)
{
    test_bf16_chunks(gpu16);
    test_same_steps(gpu16, FITM_CUDA_WEIGHTS_BF16, FITM_GEN_ARCH_GEMMA3, GRAPHS);
    test_same_steps(gpu16, FITM_CUDA_WEIGHTS_BF16, FITM_GEN_ARCH_GEMMA3, FUSION);
    test_same_steps(gpu16, FITM_CUDA_WEIGHTS_BF16, FITM_GEN_ARCH_GEMMA3, PIECES);
#ifdef FITM_CUDA_EMU
    CHECK(fitm_backend_cuda_pdl(gpu16), "the emulated sm_90 takes programmatic launches");
#endif
    printf("programmatic launches: %s\n", fitm_backend_cuda_pdl(gpu16) ? "on" : "off");
    test_same_steps(gpu16, FITM_CUDA_WEIGHTS_BF16, FITM_GEN_ARCH_GEMMA3, PDL);
    test_replay(gpu16, FITM_CUDA_WEIGHTS_BF16);
    fitm_backend_destroy(gpu16);
    test_bf16_prepare_error();
    test_same_steps(gpu, FITM_CUDA_WEIGHTS_F32, FITM_GEN_ARCH_GEMMA3, GRAPHS);
    test_same_steps(gpu, FITM_CUDA_WEIGHTS_F32, FITM_GEN_ARCH_GEMMA3, FUSION);
    test_same_steps(gpu, FITM_CUDA_WEIGHTS_F32, FITM_GEN_ARCH_GEMMA3, PDL);
    test_same_steps(gpu, FITM_CUDA_WEIGHTS_F32, FITM_GEN_ARCH_LLAMA, FUSION);
    test_error_channel(gpu);
    test_pending_norm();
    test_pool();
    test_lost_context(gpu);
}

int main(int argc, char **argv)
{
    if (fitm_cuda_device_count() == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    fitm_backend *cpu = NULL, *gpu = NULL, *gpu16 = NULL;
    fitm_err err;
    if (fitm_backend_cpu_create(&cpu, 2, &err) || fitm_backend_cuda_create(&gpu, 0, &err) ||
        fitm_backend_cuda_create(&gpu16, 0, &err)) {
        fprintf(stderr, "backend: %s\n", err.msg);
        return 1;
    }
    /* gpu: the F32 products, held to the CPU's float rounding; gpu16: the default, bfloat16 */
    fitm_backend_cuda_set_weights(gpu, FITM_CUDA_WEIGHTS_F32);
    /* Parts, so that a test runner can spread them over its processes: "--models ARCH
     * [TYPE]" the model comparisons of that architecture alone (of the types whose name
     * starts with TYPE), "--rest" everything else; else argv[1]: only the types whose name
     * starts with it (for quick runs by hand), and the rest. */
    const bool rest_only = argc > 1 && strcmp(argv[1], "--rest") == 0;
    const char *arch_only = argc > 2 && strcmp(argv[1], "--models") == 0 ? argv[2] : NULL;
    const char *type_prefix = arch_only && argc > 3           ? argv[3]
                              : argc > 1 && argv[1][0] != '-' ? argv[1]
                                                              : "";
    for (int pass = 0; pass < 2 && !rest_only; pass++)
        for (int a = 0; a < FITM_GEN_ARCH_COUNT; a++)
            for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
                if ((arch_only && strcmp(fitm_gen_arch_name((fitm_gen_arch)a), arch_only) != 0) ||
                    strncmp(fitm_dtype_info_of(types[i])->name, type_prefix, strlen(type_prefix)) !=
                        0)
                    continue;
                if (pass == 0)
                    test_model(cpu, gpu, (fitm_gen_arch)a, types[i]);
                else
                    test_model_bf16(cpu, gpu, gpu16, (fitm_gen_arch)a, types[i]);
            }
    if (arch_only)
        fitm_backend_destroy(gpu16);
    else
        test_rest(gpu, gpu16);
    fitm_backend_destroy(cpu);
    fitm_backend_destroy(gpu);
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures || n_checks == 0 ? 1 : 0;
}
