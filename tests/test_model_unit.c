/* Unit tests of the model module's pieces: thread pool, the intervention and RoPE-table ops,
 * KV cache bookkeeping, loading a generated model from memory, forward-call argument checks
 * and the split-invariance of the forward pass. (Numerical checks against the numpy oracle
 * are in test_model.py.) */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/pool.h"
#include "check.h"
#include "gen_model.h"
#include "compute/ops.h"
#include "compute/quant.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/genmodel.h"
#include "model/kv.h"
#include "model/model.h"

/* ---- pool -------------------------------------------------------------------------------- */

typedef struct {
    _Atomic int64_t *hits;
    _Atomic int bad_thread;
    int n_threads;
} pool_ctx;

static void pool_task(void *ctx_, int64_t task, int thread)
{
    pool_ctx *ctx = ctx_;
    atomic_fetch_add(&ctx->hits[task], 1);
    if (thread < 0 || thread >= ctx->n_threads)
        atomic_store(&ctx->bad_thread, 1);
}

static void test_pool(void)
{
    for (int n = 1; n <= 4; n++) {
        fitm_pool *p = NULL;
        fitm_err err;
        CHECK(fitm_pool_create(&p, n, &err) == FITM_OK);
        if (!p)
            continue;
        CHECK(fitm_pool_n_threads(p) == n);
        enum { MAX_TASKS = 257 };
        _Atomic int64_t hits[MAX_TASKS];
        pool_ctx ctx = {hits, 0, n};
        /* many short runs back to back, of varying sizes: every task exactly once per run */
        for (int run = 0; run < 2000; run++) {
            int64_t n_tasks = run % MAX_TASKS;
            for (int64_t i = 0; i < MAX_TASKS; i++)
                atomic_store(&hits[i], 0);
            fitm_pool_run(p, n_tasks, pool_task, &ctx);
            for (int64_t i = 0; i < MAX_TASKS; i++)
                if (atomic_load(&hits[i]) != (i < n_tasks ? 1 : 0)) {
                    CHECK(!"task run count");
                    i = MAX_TASKS;
                    run = 2000;
                }
        }
        CHECK(atomic_load(&ctx.bad_thread) == 0);
        fitm_pool_destroy(p);
    }
    fitm_pool *p = NULL;
    fitm_err err;
    CHECK(fitm_pool_create(&p, 0, &err) == FITM_ERR_INVALID && p == NULL);
    fitm_pool_destroy(NULL);
}

/* ---- fitm_ops_exp_le0 --------------------------------------------------------------------- */

/* The distance of e from the long double reference r in units of the last place of r as a
 * double. */
static double ulps(double e, long double r)
{
    const double rd = (double)r;
    return (double)fabsl((long double)e - r) / (nextafter(rd, INFINITY) - rd);
}

/* Within 1.5 ulp of expl over the whole range: fresh uniform draws on [-708, 0] and log-uniform
 * ones on [-2^-40, -10], the points around each reduction boundary (k + 1/2) ln 2, and the
 * ends; 0 below -708 and at -inf, NaN for NaN, 1 at both zeros. */
static void test_exp_le0(void)
{
    uint64_t s = 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
    double worst = 0, worst_d = 0;
    for (int i = 0; i < 3000000; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const double u = (double)(s >> 11) * 0x1p-53;
        double d;
        if (i % 3 == 0)
            d = -708.0 * u;
        else if (i % 3 == 1)
            d = -exp2(-40.0 + 43.3 * u);
        else { /* next to a boundary of the reduction's k */
            const int k = (int)(u * 1021);
            d = nextafter(-(k + 0.5) * 0.6931471805599453, (i / 3) % 2 ? 0.0 : -INFINITY);
            d = nextafter(d, (i / 6) % 2 ? 0.0 : -INFINITY);
            if (d < -708.0)
                continue;
        }
        const double err = ulps(fitm_ops_exp_le0(d), expl((long double)d));
        if (err > worst)
            worst = err, worst_d = d;
    }
    const double ends[] = {-708.0, -707.999999, -1e-300, -0x1p-1074, -0.34657359027997264};
    for (size_t i = 0; i < sizeof ends / sizeof *ends; i++) {
        const double err = ulps(fitm_ops_exp_le0(ends[i]), expl((long double)ends[i]));
        if (err > worst)
            worst = err, worst_d = ends[i];
    }
    printf("fitm_ops_exp_le0: worst %.3f ulp at %.17g\n", worst, worst_d);
    CHECK(worst <= 1.5, "fitm_ops_exp_le0 is %.3f ulp from expl at %.17g", worst, worst_d);
    CHECK(fitm_ops_exp_le0(0.0) == 1.0 && fitm_ops_exp_le0(-0.0) == 1.0);
    CHECK(fitm_ops_exp_le0(-708.0000001) == 0.0 && fitm_ops_exp_le0(-1e300) == 0.0);
    CHECK(fitm_ops_exp_le0(-INFINITY) == 0.0);
    CHECK(isnan(fitm_ops_exp_le0(NAN)));
}

/* ---- ops --------------------------------------------------------------------------------- */

static void test_rope_table(void)
{
    float a[64], b[64], cs[64];
    for (int neox = 0; neox < 2; neox++)
        for (int64_t pos = 0; pos < 300; pos += 37) {
            for (int i = 0; i < 64; i++)
                a[i] = b[i] = sinf((float)i * 0.37f + (float)pos);
            fitm_ops_rope(a, 64, 48, pos, 10000.0f, neox);
            fitm_ops_rope_table(cs, 48, pos, 10000.0f, 1.0f);
            fitm_ops_rope_apply(b, cs, 48, neox);
            for (int i = 0; i < 64; i++)
                CHECK(fabsf(a[i] - b[i]) <= 1e-6f);
        }
    /* rows from frequencies computed once per base (the forward driver's tables) are
     * fitm_ops_rope_table's, bit for bit: random positions up to 2^20, the bases of Gemma 3
     * and Llama 3 and a position method's scaled one, freq_scale 1 and not, n_rot 256 */
    static const float bases[] = {10000.0f, 1000000.0f, 500000.0f, 10000.0f * 1.37f};
    double w[128];
    float want[256], got[256];
    uint64_t r = 43;
    int differ = 0;
    for (size_t k = 0; k < sizeof bases / sizeof bases[0]; k++) {
        fitm_ops_rope_freqs(w, 256, bases[k]);
        for (int j = 0; j < 500; j++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            const int64_t pos = (int64_t)(r >> 44);
            const float scale = j % 2 ? 1.0f : 0.37f;
            fitm_ops_rope_table(want, 256, pos, bases[k], scale);
            fitm_ops_rope_table_at(got, 256, pos, scale, w);
            differ += memcmp(want, got, sizeof want) != 0;
        }
    }
    CHECK(differ == 0, "%d of 2000 rows from cached frequencies differ", differ);
}

static void test_intervene(void)
{
    enum { N = 40 };
    float p[N], orig[N];
    double mass[8];
    double sum = 0.0;
    for (int i = 0; i < N; i++) {
        p[i] = (float)(1.0 + (i * 7) % 5);
        sum += p[i];
    }
    for (int i = 0; i < N; i++)
        orig[i] = p[i] = (float)(p[i] / sum);
    const fitm_span spans[3] = {{2, 8}, {8, 20}, {25, 31}};
    const float alpha[3] = {0.5f, 0.2f, 0.3f};
    double S = 0.0;
    for (int k = 0; k < 3; k++)
        for (int64_t i = spans[k].start; i < spans[k].end; i++)
            S += orig[i];
    fitm_ops_intervene(p, 0, N, spans, alpha, 3, mass);
    /* documents keep their total mass; other keys are untouched; per-token mass ~ alpha */
    double S2 = 0.0, per_tok[3];
    for (int k = 0; k < 3; k++) {
        double m = 0.0;
        for (int64_t i = spans[k].start; i < spans[k].end; i++)
            m += p[i];
        S2 += m;
        per_tok[k] = m / (double)(spans[k].end - spans[k].start);
    }
    CHECK(fabs(S2 - S) < 1e-6);
    for (int i = 0; i < N; i++)
        if ((i < 2) || (i >= 20 && i < 25) || i >= 31)
            CHECK(p[i] == orig[i]);
    for (int k = 0; k < 3; k++)
        CHECK(fabs(per_tok[k] / per_tok[0] - alpha[k] / alpha[0]) < 1e-5);

    /* a span the row cannot see (mass 0) is left out; the visible ones share their own mass */
    for (int i = 0; i < N; i++)
        p[i] = i < 10 ? 0.0f : 1.0f / 30.0f;
    fitm_ops_intervene(p, 0, N, spans, alpha, 3, mass);
    for (int i = 2; i < 8; i++)
        CHECK(p[i] == 0.0f);
    double m1 = 0.0, m2 = 0.0;
    for (int i = 8; i < 20; i++)
        m1 += p[i];
    for (int i = 25; i < 31; i++)
        m2 += p[i];
    CHECK(fabs((m1 + m2) - 16.0 / 30.0) < 1e-6);
    CHECK(fabs((m1 / 12.0) / (m2 / 6.0) - 0.2 / 0.3) < 1e-5);

    /* rows that start later than key 0 (a sliding window): spans clipped to the row */
    float q[10];
    for (int i = 0; i < 10; i++)
        q[i] = 0.1f;
    const fitm_span far[2] = {{0, 12}, {12, 20}};
    const float al[2] = {1.0f, 1.0f};
    fitm_ops_intervene(q, 10, 10, far, al, 2, mass); /* keys [10, 20) */
    double tot = 0.0;
    for (int i = 0; i < 10; i++)
        tot += q[i];
    CHECK(fabs(tot - 1.0) < 1e-6);

    float mrow[3];
    float r[6] = {0.1f, 0.2f, 0.3f, 0.1f, 0.2f, 0.1f};
    const fitm_span sp[3] = {{0, 2}, {4, 100}, {50, 60}};
    fitm_ops_span_mass(mrow, r, 0, 6, sp, 3);
    CHECK(fabsf(mrow[0] - 0.3f) < 1e-7f && fabsf(mrow[1] - 0.3f) < 1e-7f && mrow[2] == 0.0f);
}

/* ---- model, KV cache, forward -------------------------------------------------------------- */

static fitm_model *gen_model(fitm_gen_arch arch, fitm_dtype type, void **buf)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    cfg.type = type;
    cfg.n_layer = arch == FITM_GEN_ARCH_GEMMA3 ? 7 : 2;
    return gen_model_load(&cfg, buf);
}

static void test_model_config(void)
{
    void *buf;
    fitm_model *m = gen_model(FITM_GEN_ARCH_GEMMA3, FITM_DTYPE_Q8_0, &buf);
    CHECK(m != NULL);
    if (m) {
        const fitm_model_config *c = fitm_model_config_of(m);
        CHECK(c->arch == FITM_ARCH_GEMMA3 && c->n_layer == 7 && c->n_swa > 0);
        CHECK(c->rope_neox && c->qk_norm && c->post_norms && c->act == FITM_ACT_GELU);
        CHECK(fabsf(c->embd_scale - sqrtf((float)c->n_embd)) < 1e-6f);
        CHECK(fitm_model_output(m)->data == fitm_model_tok_embd(m)->data); /* tied */
        for (int32_t l = 0; l < 7; l++)
            CHECK(fitm_model_layer(m, l)->local == (l % 6 < 5));
        CHECK(fitm_model_layer(m, 5)->rope_base == c->rope_base);
        CHECK(fitm_model_layer(m, 0)->rope_base == 10000.0f);
        CHECK(fitm_model_key_visible(m, 5, 100, 0));
        CHECK(!fitm_model_key_visible(m, 0, 100, 100 - c->n_swa));
        CHECK(fitm_model_key_visible(m, 0, 100, 100 - c->n_swa + 1));
        CHECK(!fitm_model_key_visible(m, 0, 100, 101));
        CHECK(fitm_model_tok_embd(m)->type == FITM_DTYPE_Q8_0);
        CHECK(fitm_model_layer(m, 0)->attn_norm.type == FITM_DTYPE_F32);
    }
    fitm_model_close(m);
    free(buf);
    fitm_model_close(NULL);
}

static void test_forward(fitm_gen_arch arch, fitm_dtype type)
{
    void *buf;
    fitm_model *m = gen_model(arch, type, &buf);
    CHECK(m != NULL);
    if (!m) {
        free(buf);
        return;
    }
    const fitm_model_config *c = fitm_model_config_of(m);
    fitm_err err;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *kv = NULL, *kv2 = NULL, *br = NULL;
    enum { T = 40 };
    fitm_forward_params fp = {T, T, T};
    CHECK(fitm_backend_cpu_create(&b, 2, &err) == FITM_OK);
    CHECK(fitm_forward_create(&fw, m, b, &fp, &err) == FITM_OK);
    CHECK(fitm_kv_create(&kv, b, c, T, &err) == FITM_OK);
    CHECK(fitm_kv_create(&kv2, b, c, T, &err) == FITM_OK);
    CHECK(fitm_kv_create(&br, b, c, T, &err) == FITM_OK);
    if (!fw || !kv || !kv2 || !br)
        goto out;
    int32_t ids[T];
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % c->n_vocab);
    const int64_t V = c->n_vocab;
    float *full = malloc(sizeof(float) * T * V), *part = malloc(sizeof(float) * T * V);
    fitm_forward_opts o = {.n_logits = T, .logits = full, .path = FITM_PATH_STEP};
    CHECK(fitm_forward_run(fw, kv, ids, T, 0, &o, &err) == FITM_OK);
    CHECK(fitm_kv_pos_end(kv) == T);
    /* the same rows one token at a time: bit-identical */
    for (int64_t t = 0; t < T; t++) {
        fitm_forward_opts o1 = {.n_logits = 1, .logits = part + t * V};
        CHECK(fitm_forward_run(fw, kv2, &ids[t], 1, t, &o1, &err) == FITM_OK);
    }
    CHECK(memcmp(full, part, sizeof(float) * T * V) == 0);
    /* a branch over kv's first 10 positions recomputing [10, T) gives the same rows */
    CHECK(fitm_kv_rebase(br, 10, &err) == FITM_OK);
    fitm_forward_opts ob = {.prefix = kv, .n_logits = T - 10, .logits = part,
                            .path = FITM_PATH_STEP};
    CHECK(fitm_forward_run(fw, br, ids + 10, T - 10, 10, &ob, &err) == FITM_OK);
    CHECK(memcmp(full + 10 * V, part, sizeof(float) * (T - 10) * V) == 0);

    /* argument checks leave the cache as it was */
    int64_t end = fitm_kv_pos_end(kv);
    int32_t bad = c->n_vocab;
    CHECK(fitm_forward_run(fw, kv, &bad, 1, end - 1, NULL, &err) == FITM_ERR_INVALID);
    CHECK(fitm_forward_run(fw, kv, ids, 1, end + 1, NULL, &err) == FITM_ERR_INVALID);
    CHECK(fitm_forward_run(fw, kv, ids, T + 1, 0, NULL, &err) == FITM_ERR_LIMIT);
    CHECK(fitm_forward_run(fw, kv, ids, 1, T, NULL, &err) == FITM_ERR_LIMIT);
    CHECK(fitm_forward_run(fw, br, ids, 1, 30, NULL, &err) == FITM_ERR_INVALID); /* no prefix */
    fitm_forward_opts ob2 = {.prefix = br};
    CHECK(fitm_forward_run(fw, br, ids, 1, 30, &ob2, &err) == FITM_ERR_INVALID); /* itself */
    int64_t row = 5;
    fitm_capture cap = {.rows = &row, .n_rows = 1};
    fitm_forward_opts oc = {.capture = &cap};
    CHECK(fitm_forward_run(fw, kv, ids, 1, end - 1, &oc, &err) == FITM_ERR_INVALID);
    fitm_span sp[2] = {{0, 5}, {3, 8}};
    float al[2] = {1.0f, 1.0f};
    fitm_intervention iv = {.spans = sp, .n_spans = 2, .alpha = al};
    fitm_forward_opts oi = {.intervention = &iv};
    CHECK(fitm_forward_run(fw, kv, ids, 1, end - 1, &oi, &err) == FITM_ERR_INVALID);
    CHECK(fitm_kv_pos_end(kv) == end);
    fitm_kv_truncate(kv, 3);
    CHECK(fitm_kv_pos_end(kv) == 3);
    fitm_kv_truncate(kv, 30);
    CHECK(fitm_kv_pos_end(kv) == 3);
    CHECK(fitm_kv_rebase(kv, -1, &err) == FITM_ERR_INVALID);
    free(full);
    free(part);
out:
    fitm_kv_destroy(kv);
    fitm_kv_destroy(kv2);
    fitm_kv_destroy(br);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    free(buf);
}

/* fp16 KV caches (fitm_backend_set_kv_half): half the bytes; layer 0's K and V rows are the
 * F32 cache's rounded to fp16 exactly (the same inputs reach them); the logits stay within
 * fp16's rounding of the F32 cache's; caches of the two types do not mix. */
static void test_forward_half(fitm_gen_arch arch)
{
    void *buf;
    fitm_model *m = gen_model(arch, FITM_DTYPE_F32, &buf);
    CHECK(m != NULL);
    if (!m) {
        free(buf);
        return;
    }
    const fitm_model_config *c = fitm_model_config_of(m);
    enum { T = 24 };
    fitm_err err;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *k32 = NULL, *k16 = NULL, *br = NULL;
    fitm_forward_params fp = {T, T, T};
    CHECK(fitm_backend_cpu_create(&b, 2, &err) == FITM_OK);
    CHECK(fitm_forward_create(&fw, m, b, &fp, &err) == FITM_OK);
    CHECK(fitm_kv_create(&k32, b, c, T, &err) == FITM_OK);
    CHECK(fitm_backend_set_kv_half(b, true, &err) == FITM_OK);
    CHECK(fitm_kv_create(&k16, b, c, T, &err) == FITM_OK);
    CHECK(fitm_kv_create(&br, b, c, T, &err) == FITM_OK);
    if (!fw || !k32 || !k16 || !br)
        goto out;
    CHECK(!fitm_kv_half(k32) && fitm_kv_half(k16) && fitm_kv_elem_bytes(k16) == 2);
    CHECK(2 * fitm_kv_bytes(k16) == fitm_kv_bytes(k32));
    const int64_t V = c->n_vocab, n = (int64_t)T * c->n_head_kv * c->head_dim;
    int32_t ids[T];
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 4493 + 7) % V);
    float *l32 = malloc(sizeof(float) * T * V), *l16 = malloc(sizeof(float) * T * V);
    fitm_forward_opts o32 = {.n_logits = T, .logits = l32}, o16 = {.n_logits = T, .logits = l16};
    CHECK(fitm_forward_run(fw, k32, ids, T, 0, &o32, &err) == FITM_OK);
    CHECK(fitm_forward_run(fw, k16, ids, T, 0, &o16, &err) == FITM_OK);
    const float *a = fitm_kv_k(k32, 0), *va = fitm_kv_v(k32, 0);
    const uint16_t *h = fitm_kv_k(k16, 0), *vh = fitm_kv_v(k16, 0);
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (h[i] != fitm_fp32_to_fp16(a[i]) || vh[i] != fitm_fp32_to_fp16(va[i]))
            bad = i;
    CHECK(bad < 0, " %s: layer 0's fp16 K/V value %lld is not the F32 cache's rounded",
          fitm_gen_arch_name(arch), (long long)bad);
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < T * V; i++) {
        worst = fmax(worst, fabs((double)l16[i] - l32[i]));
        scale = fmax(scale, fabs((double)l32[i]));
    }
    CHECK(worst <= 1e-2 * (scale + 1) && worst > 0, " %s: logits of the fp16 cache differ by %g "
          "(largest logit %g)", fitm_gen_arch_name(arch), worst, scale);
    /* no mixing: a copy between the types, an fp16 branch over an F32 prefix */
    CHECK(fitm_kv_copy(br, k32, 4, &err) == FITM_ERR_INVALID);
    CHECK(fitm_kv_rebase(br, 10, &err) == FITM_OK);
    fitm_forward_opts ob = {.prefix = k32};
    CHECK(fitm_forward_run(fw, br, ids + 10, 1, 10, &ob, &err) == FITM_ERR_INVALID);
    CHECK(fitm_kv_pos_end(br) == 10);
    free(l32);
    free(l16);
out:
    fitm_kv_destroy(k32);
    fitm_kv_destroy(k16);
    fitm_kv_destroy(br);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    free(buf);
}

int main(void)
{
    test_pool();
    test_rope_table();
    test_exp_le0();
    test_intervene();
    test_model_config();
    for (int a = 0; a < FITM_GEN_ARCH_COUNT; a++) {
        test_forward((fitm_gen_arch)a, FITM_DTYPE_F32);
        test_forward((fitm_gen_arch)a, FITM_DTYPE_Q4_K);
        test_forward_half((fitm_gen_arch)a);
    }
    if (failures) {
        fprintf(stderr, "test_model_unit: %d failures\n", failures);
        return 1;
    }
    printf("test_model_unit: ok\n");
    return 0;
}
