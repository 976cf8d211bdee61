/* test_backend_check: fitm_backend_check (fitmd's start-up self-test) passes two correct backends
 * and fails a backend that computes slightly wrong or reports an error.
 *
 * The backend under test wraps the CPU backend and perturbs one op by a chosen relative amount:
 * the residual sums (everything after them drifts), or the attention outputs' RoPE (keys and
 * queries rotated wrong: probabilities move, logits too). A perturbation of 1e-2 stands for a
 * broken kernel (a lost barrier or a wrong lane is larger); one of 1e-7 relative is float
 * rounding, which a correct GPU differs by, and must pass.
 *
 * With FITM_CHECK_PRODUCTS_BF16 (the CUDA backend's gpu_weights = bf16) the wrapper stands in
 * for such a GPU: its BATCH products round both operands to bfloat16 and sum in float
 * (PERTURB_BF16), which the bfloat16 bounds must pass (and which moves the logits by more than
 * float rounding: the check sees it), while a perturbation of the residual sums by a third
 * (a conversion gone wrong) fails them. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "compute/quant.h"
#include "gen_model.h"
#include "gguf/gguf_writer.h"
#include "model/backend_check.h"
#include "model/genmodel.h"

typedef enum { PERTURB_NONE, PERTURB_ADD, PERTURB_ROPE, PERTURB_FAIL, PERTURB_BF16 } perturb;

typedef struct {
    fitm_backend base;
    fitm_backend *cpu;
    perturb what;
    float rel;
    fitm_backend_ops ops;
} wrapped;

static wrapped *wr(fitm_backend *b)
{
    return (wrapped *)b;
}

/* The delegating slots: every op goes to the CPU backend. */
static void w_destroy(fitm_backend *b)
{
    fitm_backend_destroy(wr(b)->cpu);
    free(b);
}
static fitm_status w_reserve(fitm_backend *b, int64_t t, int64_t k, int64_t mk, fitm_err *e)
{
    return wr(b)->cpu->ops->reserve(wr(b)->cpu, t, k, mk, e);
}
static void *w_alloc(fitm_backend *b, size_t n)
{
    return wr(b)->cpu->ops->alloc(wr(b)->cpu, n);
}
static void w_free(fitm_backend *b, void *p)
{
    wr(b)->cpu->ops->free(wr(b)->cpu, p);
}
static void w_upload(fitm_backend *b, void *d, const void *s, size_t n)
{
    wr(b)->cpu->ops->upload(wr(b)->cpu, d, s, n);
}
static void w_download(fitm_backend *b, void *d, const void *s, size_t n)
{
    wr(b)->cpu->ops->download(wr(b)->cpu, d, s, n);
}
static fitm_status w_status(fitm_backend *b, fitm_err *err)
{
    if (wr(b)->what == PERTURB_FAIL)
        return fitm_err_set(err, FITM_ERR_BACKEND, "injected failure");
    return FITM_OK;
}
static void w_embed(fitm_backend *b, const fitm_weight *w, const int32_t *ids, int64_t T, float s,
                    float *x)
{
    wr(b)->cpu->ops->embed(wr(b)->cpu, w, ids, T, s, x);
}
static float round_bf16(float f) /* nearest, ties to even; f finite */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + (u >> 16 & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* Each o[j].y (T, N) = x (T, K) . W^T (+ bias) with W's values and x rounded to bfloat16, the
 * products summed in float: a GPU's bfloat16 BATCH product, on host memory. */
static void bf16_matmul(const float *x, int64_t T, const fitm_mm_out *o, int n)
{
    for (int j = 0; j < n; j++) {
        const fitm_weight *w = o[j].w;
        const int64_t N = w->n_rows, K = w->n_cols;
        float *row = malloc((size_t)K * sizeof(float));
        for (int64_t r = 0; r < N && row; r++) {
            fitm_dequant_row(w->type, (const char *)w->data + r * w->row_bytes, row, K);
            for (int64_t k = 0; k < K; k++)
                row[k] = round_bf16(row[k]);
            const float bias = o[j].bias ? ((const float *)o[j].bias->data)[r] : 0.0f;
            for (int64_t t = 0; t < T; t++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++)
                    acc = fmaf(row[k], round_bf16(x[t * K + k]), acc);
                o[j].y[t * N + r] = acc + bias;
            }
        }
        free(row);
    }
}

static void w_matmul(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out *o, int n,
                     bool batched)
{
    if (batched && wr(b)->what == PERTURB_BF16)
        bf16_matmul(x, T, o, n);
    else
        wr(b)->cpu->ops->matmul(wr(b)->cpu, x, T, o, n, batched);
}
static void w_rmsnorm(fitm_backend *b, float *y, const float *x, const fitm_weight *w, int64_t r,
                      int64_t n, float eps)
{
    wr(b)->cpu->ops->rmsnorm(wr(b)->cpu, y, x, w, r, n, eps);
}
static void w_rope(fitm_backend *b, float *x, int64_t T, int64_t nh, int64_t D, int64_t n_rot,
                   const float *cs, bool neox)
{
    wrapped *w = wr(b);
    w->cpu->ops->rope(w->cpu, x, T, nh, D, n_rot, cs, neox);
    if (w->what == PERTURB_ROPE) /* host memory on the CPU backend */
        for (int64_t i = 0; i < T * nh * D; i += 2)
            x[i] *= 1.0f + w->rel;
}
static void w_glu(fitm_backend *b, float *y, const float *g, const float *u, int64_t n,
                  fitm_act act)
{
    wr(b)->cpu->ops->glu(wr(b)->cpu, y, g, u, n, act);
}
static void w_add(fitm_backend *b, float *y, const float *x, int64_t n)
{
    wrapped *w = wr(b);
    w->cpu->ops->add(w->cpu, y, x, n);
    if (w->what == PERTURB_ADD)
        for (int64_t i = 0; i < n; i++)
            y[i] *= 1.0f + w->rel * (float)((i % 3) - 1); /* not a uniform scale: norms undo that */
}
static void w_softcap(fitm_backend *b, float *x, int64_t n, float cap)
{
    wr(b)->cpu->ops->softcap(wr(b)->cpu, x, n, cap);
}
static void w_topk(fitm_backend *b, const float *x, int64_t rows, int64_t n, int32_t k,
                   fitm_top *top)
{
    wr(b)->cpu->ops->topk(wr(b)->cpu, x, rows, n, k, top);
}
static void w_attention(fitm_backend *b, const fitm_attn_args *a)
{
    wr(b)->cpu->ops->attention(wr(b)->cpu, a);
}

static fitm_backend *make_wrapped(perturb what, float rel)
{
    wrapped *w = calloc(1, sizeof *w);
    fitm_err err;
    if (!w || fitm_backend_cpu_create(&w->cpu, 1, &err)) {
        free(w);
        return NULL;
    }
    w->what = what;
    w->rel = rel;
    w->ops = *w->cpu->ops;
    w->ops.name = "perturbed";
    w->ops.destroy = w_destroy, w->ops.reserve = w_reserve, w->ops.alloc = w_alloc;
    w->ops.free = w_free, w->ops.upload = w_upload, w->ops.download = w_download;
    w->ops.prepare = NULL, w->ops.status = w_status, w->ops.embed = w_embed;
    w->ops.matmul = w_matmul, w->ops.rmsnorm = w_rmsnorm, w->ops.rope = w_rope;
    w->ops.glu = w_glu, w->ops.add = w_add, w->ops.softcap = w_softcap;
    w->ops.topk = w_topk, w->ops.attention = w_attention, w->ops.attention_many = NULL;
    w->ops.logprob = NULL; /* the driver's host path: the CPU's op would take w for its own */
    w->base.ops = &w->ops;
    return &w->base;
}

static fitm_model *gen_model(fitm_gen_arch arch, fitm_dtype type, void **buf)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    cfg.type = type;
    cfg.seed = 3;
    return gen_model_load(&cfg, buf);
}

static void test_arch(fitm_backend *cpu, fitm_gen_arch arch, fitm_dtype type)
{
    void *buf = NULL;
    fitm_model *m = gen_model(arch, type, &buf);
    CHECK(m != NULL);
    if (!m)
        return;
    const char *name = fitm_gen_arch_name(arch);
    fitm_backend_check_report rep;
    fitm_err err = {{0}};

    /* a second CPU backend with another thread count: correct, passes */
    fitm_backend *other = NULL;
    CHECK(fitm_backend_cpu_create(&other, 3, &err) == FITM_OK);
    fitm_status s = fitm_backend_check(m, cpu, other, FITM_CHECK_PRODUCTS_F32, &rep, &err);
    CHECK(s == FITM_OK, "%s: %s", name, err.msg);
    CHECK(rep.logit_err <= 1e-5 && rep.prob_err <= 1e-5, "%s: %g %g", name, rep.logit_err,
          rep.prob_err);
    CHECK(rep.logit_tol == (fitm_dtype_info_of(type)->block_elems > 1 ? 5e-2 : 1e-3));
    fitm_backend_destroy(other);

    /* rounding-sized perturbations pass, kernel-bug-sized ones fail with both figures */
    const struct {
        perturb what;
        float rel;
        bool pass;
    } cases[] = {{PERTURB_ADD, 1e-7f, true},  {PERTURB_ADD, 1e-2f, false},
                 {PERTURB_ROPE, 1e-7f, true}, {PERTURB_ROPE, 1e-2f, false},
                 {PERTURB_FAIL, 0, false}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fitm_backend *p = make_wrapped(cases[i].what, cases[i].rel);
        CHECK(p != NULL);
        if (!p)
            continue;
        s = fitm_backend_check(m, cpu, p, FITM_CHECK_PRODUCTS_F32, &rep, &err);
        printf("%-6s case %zu: logits %.2e (tol %.0e) attention %.2e (tol %.0e): %s\n", name, i,
               rep.logit_err, rep.logit_tol, rep.prob_err, rep.prob_tol,
               s == FITM_OK ? "pass" : err.msg);
        if (cases[i].pass) {
            CHECK(s == FITM_OK, "%s case %zu: %s", name, i, err.msg);
        } else {
            CHECK(s == FITM_ERR_BACKEND, "%s case %zu: status %d", name, i, (int)s);
            CHECK(strstr(err.msg, "perturbed") != NULL, "%s", err.msg);
        }
        if (cases[i].what == PERTURB_ROPE && !cases[i].pass)
            CHECK(rep.prob_err > rep.prob_tol, "%s: rope error not seen in attention: %g", name,
                  rep.prob_err);
        fitm_backend_destroy(p);
    }

    /* bfloat16 products: within their bounds, and seen; a gross error still fails */
    const struct {
        perturb what;
        float rel;
        bool pass;
    } bf16_cases[] = {{PERTURB_BF16, 0, true}, {PERTURB_ADD, 0.3f, false}};
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0]; i++) {
        fitm_backend *p = make_wrapped(bf16_cases[i].what, bf16_cases[i].rel);
        CHECK(p != NULL);
        if (!p)
            continue;
        s = fitm_backend_check(m, cpu, p, FITM_CHECK_PRODUCTS_BF16, &rep, &err);
        printf("%-6s bf16 case %zu: logits %.2e (tol %.0e) attention %.2e (tol %.0e): %s\n", name,
               i, rep.logit_err, rep.logit_tol, rep.prob_err, rep.prob_tol,
               s == FITM_OK ? "pass" : err.msg);
        CHECK(rep.logit_tol == 1e-1 && rep.prob_tol == 1e-1);
        if (bf16_cases[i].pass) {
            CHECK(s == FITM_OK, "%s bf16 case %zu: %s", name, i, err.msg);
            CHECK(rep.logit_err > 1e-4, "%s: bfloat16 products not seen (%g)", name, rep.logit_err);
        } else {
            CHECK(s == FITM_ERR_BACKEND, "%s bf16 case %zu: status %d", name, i, (int)s);
        }
        fitm_backend_destroy(p);
    }
    fitm_model_close(m);
    free(buf);
}

int main(void)
{
    fitm_backend *cpu = NULL;
    fitm_err err;
    if (fitm_backend_cpu_create(&cpu, 1, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    test_arch(cpu, FITM_GEN_ARCH_LLAMA, FITM_DTYPE_F32);
    test_arch(cpu, FITM_GEN_ARCH_QWEN2, FITM_DTYPE_Q4_K);
    test_arch(cpu, FITM_GEN_ARCH_GEMMA3, FITM_DTYPE_Q8_0);
    fitm_backend_destroy(cpu);
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures ? 1 : 0;
}
