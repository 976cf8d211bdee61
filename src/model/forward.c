#include "model/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A sequence's role in a call: the RoPE base factor of its pass (1: the model's own bases)
 * and, for a bucket pass, the first accumulator row its logits go to (-1: none). */
typedef struct {
    float factor;
    int32_t n_pass;   /* the passes of its bucket sequence (0: not a bucket pass)        */
    int32_t pass;
    int64_t acc0;
} seq_role;

static const seq_role plain_role = {1.0f, 0, 0, -1};

struct fitm_forward {
    const fitm_model *m;
    fitm_backend *b;
    bool prepared; /* ops->prepare ran for this forward: ops->release on destroy */
    fitm_forward_params p;
    /* backend scratch */
    float *x;        /* (T, C) residual stream        */
    float *xn;       /* (T, C) normed                 */
    float *q;        /* (T, H*D)                      */
    float *att;      /* (T, H*D) attention output     */
    float *tmp;      /* (T, C) block outputs          */
    float *g, *u;    /* (T, F)                        */
    float *logits;   /* (max_logits, V)               */
    float *cs[2];    /* (T, n_rot) RoPE tables: global, local */
    float *k, *v;    /* (T, Hkv*D) the call's K/V rows before they go to each cache */
    /* host scratch */
    float *cs_host;     /* (T, n_rot) */
    int32_t *cap_index; /* (T)        */
    fitm_top *top;      /* (max_logits, FITM_TOP_MAX): several sequences' top-k in one call */
    int32_t *ids;       /* (T) the call's tokens, in row order */
    /* position methods (params.positions; docs/position-methods.md) */
    int32_t n_mix;      /* expert slots: max(H, MoICE N); 0 = no position methods        */
    float *q_mix;       /* (n_mix, Tm, H, D) each expert's queries                       */
    float *k_mix;       /* (n_mix, max_ctx, Hkv, D) each expert's keys                   */
    float *w_mix;       /* (Tm, H, n_mix) mixture weights                                */
    float **tabs;       /* (n_tabs) RoPE tables (max_ctx, n_rot) of one base change      */
    double (*tab_keys)[4]; /* (n_tabs) from_base, from_scale, to_base, to_scale         */
    int64_t *tab_filled;   /* (n_tabs) rows computed so far                               */
    double *tab_freq;      /* (n_rot / 2) one table's angle per position                  */
    float *tab_host;       /* (max_ctx, n_rot) staging rows                               */
    int32_t n_tabs, cap_tabs;
    int32_t *tab_moice;    /* (L, N) table of layer l's expert e; NULL without MoICE      */
    int32_t *tab_ms_poe;   /* (L, H) table of layer l's head h                            */
    int32_t *ms_poe_rank;  /* (L, H)                                                      */
    float *w_host;         /* (Tm, H, n_mix)                                              */
    float *x_host;         /* (Tm, H, D) router inputs                                    */
    float route_scratch[3 * FITM_MOICE_MAX_EXPERTS];
    const fitm_moice *moice; /* borrowed; NULL: no MoICE                                  */
    bool backend_mix;    /* b->ops->attention_mix                                       */
    float *stat_host;      /* non-NULL during the Ms-PoE calibration pass: (T + 1, Hkv|H, D) */
    /* Attention Buckets (run_buckets): a call's passes, their options and captures, and the
     * output accumulators; bk_acc is NULL on a backend without ops->capture_add. */
    fitm_forward_seq bk_seq[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS];
    fitm_forward_opts bk_opts[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS];
    fitm_capture bk_cap[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS];
    seq_role bk_role[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS];
    double *bk_acc;        /* (max_logits, V) sum_b a_b p_b, or log p_0 with one pass      */
    double *bk_sum;        /* (max_logits) sum_b a_b                                       */
    float *bk_row;         /* (V) one pass's logits row, host                              */
    double *bk_exp;        /* (V) exp(x - max x) of that row                               */
};

static const char *const position_names[FITM_POSITION_COUNT] = {"none", "moice", "ms_poe",
                                                                 "attention_buckets"};

const char *fitm_position_method_name(fitm_position_method m)
{
    return (unsigned)m < FITM_POSITION_COUNT ? position_names[m] : "unknown";
}

int fitm_position_method_parse(const char *s)
{
    for (int i = 0; s && i < FITM_POSITION_COUNT; i++)
        if (!strcmp(s, position_names[i]))
            return i;
    return -1;
}

double fitm_forward_bucket_factor(int32_t b)
{
    static const double factors[FITM_BUCKETS] = {1.0, 1.75, 1.8, 1.9, 2.0, 2.25, 2.5};
    return b >= 0 && b < FITM_BUCKETS ? factors[b] : 0.0;
}

int32_t fitm_forward_ms_poe_calib_id(int64_t i, int32_t n_vocab)
{
    return (int32_t)((i * 7919 + 17) % n_vocab);
}

const int32_t *fitm_forward_ms_poe_ranks(const fitm_forward *f)
{
    return f->ms_poe_rank;
}

static void free_scratch(fitm_forward *f)
{
    fitm_backend *b = f->b;
    float *bufs[] = {f->x,      f->xn,     f->q,     f->att, f->tmp, f->g,
                     f->u,      f->logits, f->cs[0], f->cs[1], f->k,  f->v};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        b->ops->free(b, bufs[i]);
    free(f->cs_host);
    free(f->cap_index);
    free(f->top);
    free(f->ids);
    b->ops->free(b, f->q_mix);
    b->ops->free(b, f->k_mix);
    b->ops->free(b, f->w_mix);
    for (int32_t i = 0; i < f->n_tabs; i++)
        b->ops->free(b, f->tabs[i]);
    free(f->tabs);
    free(f->tab_keys);
    free(f->tab_filled);
    free(f->tab_freq);
    free(f->tab_host);
    free(f->tab_moice);
    free(f->tab_ms_poe);
    free(f->ms_poe_rank);
    free(f->w_host);
    free(f->x_host);
    free(f->bk_acc);
    free(f->bk_sum);
    free(f->bk_row);
    free(f->bk_exp);
}



void fitm_forward_destroy(fitm_forward *f)
{
    if (!f)
        return;
    free_scratch(f);
    if (f->prepared && f->b->ops->release)
        f->b->ops->release(f->b, f->m);
    free(f);
}

static float *alloc_floats(fitm_backend *b, int64_t n, bool *ok)
{
    float *p = b->ops->alloc(b, (size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p)
        *ok = false;
    return p;
}

fitm_status fitm_forward_create(fitm_forward **out, const fitm_model *m, fitm_backend *b,
                                const fitm_forward_params *p, fitm_err *err)
{
    *out = NULL;
    const fitm_model_config *c = fitm_model_config_of(m);
    if (p->max_tokens < 1 || p->max_tokens > (1 << 20) || p->max_ctx < 1 ||
        p->max_ctx > ((int64_t)1 << 31) || p->max_logits < 0 || p->max_logits > p->max_tokens)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "forward limits out of range (tokens %lld, ctx %lld, logits %lld)",
                            (long long)p->max_tokens, (long long)p->max_ctx,
                            (long long)p->max_logits);
    fitm_forward *f = calloc(1, sizeof *f);
    if (!f)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the forward state");
    f->m = m;
    f->b = b;
    f->p = *p;
    f->backend_mix = b->ops->attention_mix;
    const int64_t Tm = p->max_tokens, C = c->n_embd, F = c->n_ff;
    const int64_t HD = (int64_t)c->n_head * c->head_dim;
    bool ok = true;
    f->x = alloc_floats(b, Tm * C, &ok);
    f->xn = alloc_floats(b, Tm * C, &ok);
    f->q = alloc_floats(b, Tm * HD, &ok);
    f->att = alloc_floats(b, Tm * HD, &ok);
    f->tmp = alloc_floats(b, Tm * C, &ok);
    f->g = alloc_floats(b, Tm * F, &ok);
    f->u = alloc_floats(b, Tm * F, &ok);
    f->logits = alloc_floats(b, p->max_logits * c->n_vocab, &ok);
    f->cs[0] = alloc_floats(b, Tm * c->n_rot, &ok);
    f->cs[1] = alloc_floats(b, Tm * c->n_rot, &ok);
    const int64_t KV = (int64_t)c->n_head_kv * c->head_dim;
    f->k = alloc_floats(b, Tm * KV, &ok);
    f->v = alloc_floats(b, Tm * KV, &ok);
    f->cs_host = malloc((size_t)(Tm * c->n_rot + 1) * sizeof(float));
    f->cap_index = malloc((size_t)Tm * sizeof(int32_t));
    f->top = malloc((size_t)(p->max_logits * FITM_TOP_MAX + 1) * sizeof(fitm_top));
    f->ids = malloc((size_t)Tm * sizeof(int32_t));
    if (!ok || !f->cs_host || !f->cap_index || !f->top || !f->ids) {
        fitm_forward_destroy(f);
        return fitm_err_set(err, FITM_ERR_NOMEM, "cannot allocate forward scratch for %lld tokens",
                            (long long)Tm);
    }
    int64_t max_k = C > F ? C : F;
    max_k = max_k > HD ? max_k : HD;
    fitm_status s = b->ops->reserve(b, Tm, p->max_ctx, max_k, err);
    if (s == FITM_OK && b->ops->prepare) {
        s = b->ops->prepare(b, m, err);
        f->prepared = s == FITM_OK;
    }
    if (s) {
        fitm_forward_destroy(f);
        return s;
    }
    *out = f;
    return FITM_OK;
}

const fitm_forward_params *fitm_forward_params_of(const fitm_forward *f)
{
    return &f->p;
}

/* ---- argument checks --------------------------------------------------------------------- */

static fitm_status check_capture(const fitm_capture *cap, int64_t T, int64_t pos0,
                                 int32_t *cap_index, fitm_err *err)
{
    for (int64_t i = 0; i < T; i++)
        cap_index[i] = -1;
    if (!cap)
        return FITM_OK;
    if (cap->n_rows < 0 || (cap->n_rows > 0 && !cap->rows) || cap->n_spans < 0 ||
        (cap->n_spans > 0 && !cap->spans))
        return fitm_err_set(err, FITM_ERR_INVALID, "capture: rows or spans missing");
    if (cap->n_spans > FITM_FORWARD_MAX_SPANS)
        return fitm_err_set(err, FITM_ERR_LIMIT, "capture: %d spans, limit %d", (int)cap->n_spans,
                            FITM_FORWARD_MAX_SPANS);
    for (int32_t r = 0; r < cap->n_rows; r++) {
        int64_t row = cap->rows[r];
        if (row < pos0 || row >= pos0 + T)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "capture row %lld is outside this call's positions [%lld, %lld)",
                                (long long)row, (long long)pos0, (long long)(pos0 + T));
        if (cap_index[row - pos0] >= 0)
            return fitm_err_set(err, FITM_ERR_INVALID, "capture row %lld is listed twice",
                                (long long)row);
        cap_index[row - pos0] = r;
        if (cap->probs && cap->probs_stride < row + 1)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "capture probs_stride %lld is shorter than row %lld + 1",
                                (long long)cap->probs_stride, (long long)row);
    }
    for (int32_t k = 0; k < cap->n_spans; k++)
        if (cap->spans[k].start < 0 || cap->spans[k].end < cap->spans[k].start)
            return fitm_err_set(err, FITM_ERR_INVALID, "capture span %d [%lld, %lld) is invalid",
                                (int)k, (long long)cap->spans[k].start,
                                (long long)cap->spans[k].end);
    return FITM_OK;
}

static fitm_status check_intervention(const fitm_intervention *iv, fitm_err *err)
{
    if (!iv)
        return FITM_OK;
    if (iv->n_spans < 1 || !iv->spans || !iv->alpha)
        return fitm_err_set(err, FITM_ERR_INVALID, "intervention: no document spans or weights");
    if (iv->n_spans > FITM_FORWARD_MAX_SPANS)
        return fitm_err_set(err, FITM_ERR_LIMIT, "intervention: %d spans, limit %d",
                            (int)iv->n_spans, FITM_FORWARD_MAX_SPANS);
    double z = 0.0;
    for (int32_t k = 0; k < iv->n_spans; k++) {
        const fitm_span *sp = &iv->spans[k];
        if (sp->start < 0 || sp->end <= sp->start ||
            (k > 0 && sp->start < iv->spans[k - 1].end))
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "intervention span %d [%lld, %lld) is empty, negative or overlaps "
                                "the one before",
                                (int)k, (long long)sp->start, (long long)sp->end);
        float a = iv->alpha[k];
        if (!(a >= 0.0f) || a > 3.0e38f)
            return fitm_err_set(err, FITM_ERR_INVALID, "intervention alpha[%d] is not finite and >= 0",
                                (int)k);
        z += (double)(sp->end - sp->start) * a;
    }
    if (!(z > 0.0))
        return fitm_err_set(err, FITM_ERR_INVALID, "intervention weights are all zero");
    return FITM_OK;
}

/* ---- the pass ---------------------------------------------------------------------------- */

/* Where a call's logits go: n_logits rows into logits and/or their top_k entries into top. */
static fitm_status check_output(const fitm_forward *f, int64_t T, const fitm_forward_opts *opts,
                                fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    if (opts->n_logits < 0 || opts->n_logits > T || opts->n_logits > f->p.max_logits ||
        (opts->n_logits > 0 && !opts->logits && opts->top_k <= 0))
        return fitm_err_set(err, FITM_ERR_INVALID, "%lld logit rows asked for (T %lld, limit %lld)",
                            (long long)opts->n_logits, (long long)T, (long long)f->p.max_logits);
    if (opts->top_k < 0 || opts->top_k > FITM_TOP_MAX || opts->top_k > c->n_vocab ||
        (opts->top_k > 0 && opts->n_logits > 0 && !opts->top))
        return fitm_err_set(err, FITM_ERR_INVALID, "top %d of the logits asked for (limit %d)",
                            (int)opts->top_k,
                            (int)(c->n_vocab < FITM_TOP_MAX ? c->n_vocab : FITM_TOP_MAX));
    return FITM_OK;
}

/* A bucket pass (expanded by run_buckets from a BUCKETS sequence) on a backend and forward
 * that run them. */
static fitm_status check_buckets(const fitm_forward *f, const seq_role *role, fitm_err *err)
{
    if (!f->b->ops->capture_add)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "position_method attention_buckets: the %s backend cannot sum the "
                            "passes' captures (ops->capture_add)", f->b->ops->name);
    if (!f->bk_acc)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "position_method attention_buckets: position methods are not "
                            "enabled on this forward");
    if (role->n_pass == 0)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "a bucket sequence was not expanded");
    return FITM_OK;
}

/* The layers a call with opts runs: [0, result). */
static int32_t call_layers(const fitm_model_config *c, const fitm_forward_opts *opts)
{
    return opts->n_layers > 0 && opts->n_layers < c->n_layer ? opts->n_layers : c->n_layer;
}

/* Everything a call's arguments must satisfy, checked before the cache is touched. */
static fitm_status check_run(const fitm_forward *f, const fitm_kv *kv, const int32_t *tokens,
                             int64_t T, int64_t pos0, const fitm_forward_opts *opts,
                             const seq_role *role, int32_t *cap_index, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    if (!fitm_kv_fits(kv, c) || (opts->prefix && !fitm_kv_fits(opts->prefix, c)))
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache was made for another model shape");
    if ((fitm_kv_half(kv) && !f->b->ops->kv_half) ||
        (opts->prefix && fitm_kv_half(opts->prefix) != fitm_kv_half(kv)))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "KV cache of fp16 values on a backend or prefix of F32 ones");
    if (T < 1 || !tokens)
        return fitm_err_set(err, FITM_ERR_INVALID, "no tokens to run");
    const int64_t base = fitm_kv_pos_base(kv);
    if (pos0 < base || pos0 > fitm_kv_pos_end(kv))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "position %lld does not continue the KV cache (holds [%lld, %lld))",
                            (long long)pos0, (long long)base, (long long)fitm_kv_pos_end(kv));
    if (pos0 + T > f->p.max_ctx || pos0 + T - base > fitm_kv_n_rows(kv))
        return fitm_err_set(err, FITM_ERR_LIMIT,
                            "positions up to %lld exceed the context (limit %lld, cache rows %lld)",
                            (long long)(pos0 + T), (long long)f->p.max_ctx,
                            (long long)fitm_kv_n_rows(kv));
    if (base > 0) {
        const fitm_kv *pre = opts->prefix;
        if (!pre || fitm_kv_pos_base(pre) != 0 || fitm_kv_pos_end(pre) < base)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "KV branch at %lld needs a prefix cache holding [0, %lld)",
                                (long long)base, (long long)base);
        if (pre == kv)
            return fitm_err_set(err, FITM_ERR_INVALID, "a KV branch cannot be its own prefix");
    }
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab)
            return fitm_err_set(err, FITM_ERR_INVALID, "token id %d at %lld is not in [0, %d)",
                                (int)tokens[t], (long long)t, (int)c->n_vocab);
    if (opts->n_layers < 0 || opts->n_layers > c->n_layer)
        return fitm_err_set(err, FITM_ERR_INVALID, "n_layers %d is outside [0, %d]",
                            (int)opts->n_layers, (int)c->n_layer);
    const int32_t layers = call_layers(c, opts);
    if (layers < c->n_layer && opts->n_logits > 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "a call that runs %d of the %d layers has no logits", (int)layers,
                            (int)c->n_layer);
    if ((pos0 > base && fitm_kv_layers(kv) < layers) ||
        (base > 0 && fitm_kv_layers(opts->prefix) < layers))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "the rows before position %lld were computed in %d layers, this call "
                            "runs %d",
                            (long long)pos0,
                            (int)(pos0 > base ? fitm_kv_layers(kv) : fitm_kv_layers(opts->prefix)),
                            (int)layers);
    fitm_status s;
    if (role->n_pass == 0 && (s = check_output(f, T, opts, err)) != FITM_OK)
        return s;
    if ((unsigned)opts->path > FITM_PATH_STEP)
        return fitm_err_set(err, FITM_ERR_INVALID, "unknown forward path %d", (int)opts->path);
    if ((unsigned)opts->position >= FITM_POSITION_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "unknown position method %d",
                            (int)opts->position);
    if (opts->position != FITM_POSITION_NONE) {
        const char *name = fitm_position_method_name(opts->position);
        if (opts->position == FITM_POSITION_BUCKETS) {
            if ((s = check_buckets(f, role, err)) != FITM_OK)
                return s;
        } else if (!f->backend_mix) {
            return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                                "position_method %s: the %s backend has no mixed attention", name,
                                f->b->ops->name);
        } else if (f->n_mix == 0) {
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "position_method %s: position methods are not enabled on this "
                                "forward", name);
        }
        if (opts->position == FITM_POSITION_MOICE && !f->moice)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "position_method moice needs a MoICE router sidecar (--moice)");
    }
    if ((s = check_capture(opts->capture, T, pos0, cap_index, err)) ||
        (s = check_intervention(opts->intervention, err)))
        return s;
    return FITM_OK;
}

/* One sequence of a call: where its rows and logit rows sit in the call's scratch. */
typedef struct {
    fitm_kv *kv;
    const fitm_forward_opts *opts;
    int64_t T, pos0;
    int64_t base;   /* the cache's first position (> 0: a branch over opts->prefix) */
    int64_t row0;   /* its first row in the call                                      */
    int64_t lrow0;  /* its first logit row in the call                                */
    int32_t n_layers; /* the layers it runs, [0, n_layers)                            */
    bool batched;   /* its numerics path                                              */
    seq_role role;
} seq_part;

/* One call's state, shared by the layer steps. Rows are laid out STEP sequences first, then
 * BATCH sequences, so each path's rows are one contiguous run [0, n_step), [n_step, T); in
 * each run, the sequences that run more of the layers come first (runs_ffn), so the rows a
 * part of a layer runs are the first act[0] of the STEP run and the first act[1] of the BATCH
 * run. */
typedef struct {
    fitm_forward *f;
    seq_part seq[FITM_FORWARD_MAX_SEQS];
    int32_t n_seqs, n_layers; /* the most layers a sequence runs */
    int64_t T, n_step, n_logits;
    int64_t act[2];           /* the layer being run: its rows of each path */
} pass;

/* The rows the current layer runs, as one or two runs [r0[i], r0[i] + n[i]); returns how
 * many. */
static int layer_runs(const pass *p, int64_t r0[2], int64_t n[2])
{
    if (p->act[0] == p->n_step || p->act[1] == 0) {
        r0[0] = p->act[0] > 0 ? 0 : p->n_step;
        n[0] = p->act[0] + p->act[1];
        return 1;
    }
    r0[0] = 0, n[0] = p->act[0];
    r0[1] = p->n_step, n[1] = p->act[1];
    return 2;
}

/* Whether sequence q runs layer l's attention. */
static bool runs_layer(const seq_part *q, int32_t l)
{
    return l < q->n_layers;
}

/* Whether it runs layer l's output projection and feed-forward block: after its last layer
 * only the rows with logits read the residual stream, so a sequence without logits leaves
 * its last layer after the attention (which gives its cache rows and captures). */
static bool runs_ffn(const seq_part *q, int32_t l)
{
    return l < q->n_layers - (q->opts->n_logits > 0 ? 0 : 1);
}

/* p->act = the rows of the sequences that run (ffn ? the feed-forward part : the attention
 * part of) layer l, per path; whether there are any. */
static bool set_act(pass *p, int32_t l, bool ffn)
{
    p->act[0] = p->act[1] = 0;
    for (int32_t i = 0; i < p->n_seqs; i++)
        if (ffn ? runs_ffn(&p->seq[i], l) : runs_layer(&p->seq[i], l))
            p->act[p->seq[i].batched] += p->seq[i].T;
    return p->act[0] + p->act[1] > 0;
}

static void rope_tables(fitm_forward *f, const pass *p, float base, float scale, float *dst)
{
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        const float b = base * q->role.factor; /* factor 1: the base itself, bit for bit */
        for (int64_t t = 0; t < q->T; t++)
            fitm_ops_rope_table(f->cs_host + (q->row0 + t) * n_rot, n_rot, q->pos0 + t, b,
                                scale);
    }
    f->b->ops->upload(f->b, dst, f->cs_host, (size_t)(p->T * n_rot) * sizeof(float));
}

/* The RoPE tables of every row's position, for the global and/or the local layers. */
static void pass_rope_tables(const pass *p)
{
    const fitm_model_config *c = fitm_model_config_of(p->f->m);
    bool any_local = false, any_global = false;
    for (int32_t l = 0; l < c->n_layer; l++) {
        if (fitm_model_layer(p->f->m, l)->local)
            any_local = true;
        else
            any_global = true;
    }
    if (any_global)
        rope_tables(p->f, p, c->rope_base, c->rope_freq_scale, p->f->cs[0]);
    if (any_local)
        rope_tables(p->f, p, c->rope_base_local, 1.0f, p->f->cs[1]);
}

/* outs (y laid out over all T rows) = x (T, K) . W^T for the rows the layer runs, as one
 * product per path: the STEP rows, then the BATCH rows. */
static void matmul_paths(const pass *p, const float *x, int64_t K, const fitm_mm_out *outs,
                         int n_outs)
{
    fitm_backend *b = p->f->b;
    fitm_mm_out part[3];
    for (int g = 0; g < 2; g++) {
        const int64_t r0 = g == 0 ? 0 : p->n_step, nr = p->act[g];
        if (nr == 0)
            continue;
        for (int i = 0; i < n_outs; i++) {
            part[i] = outs[i];
            part[i].y = outs[i].y + r0 * outs[i].w->n_rows;
        }
        b->ops->matmul(b, x + r0 * K, nr, part, n_outs, g == 1);
    }
}

/* The attention op's arguments for sequence q in layer l: its rows of the call's q against
 * its cache's rows (the prefix's below base), with its capture and, where this layer is
 * intervened, its intervention. */
static fitm_attn_args attn_args(const pass *p, const seq_part *q, int32_t l)
{
    const fitm_model_config *c = fitm_model_config_of(p->f->m);
    const fitm_layer *ly = fitm_model_layer(p->f->m, l);
    const fitm_forward_opts *opts = q->opts;
    const fitm_intervention *iv = opts->intervention;
    if (iv && iv->layers && !iv->layers[l])
        iv = NULL;
    const int64_t HD = (int64_t)c->n_head * c->head_dim;
    return (fitm_attn_args){
        .layer = l,
        .T = q->T,
        .pos0 = q->pos0,
        .n_head = c->n_head,
        .n_head_kv = c->n_head_kv,
        .head_dim = c->head_dim,
        .scale = c->attn_scale,
        .window = ly->local ? c->n_swa : 0,
        .q = p->f->q + q->row0 * HD,
        .out = p->f->att + q->row0 * HD,
        .k_pre = q->base > 0 ? fitm_kv_k(opts->prefix, l) : NULL,
        .v_pre = q->base > 0 ? fitm_kv_v(opts->prefix, l) : NULL,
        .k_own = fitm_kv_k(q->kv, l),
        .v_own = fitm_kv_v(q->kv, l),
        .own_base = q->base,
        .kv_half = fitm_kv_half(q->kv),
        .capture = opts->capture,
        .cap_index = p->f->cap_index + q->row0,
        .n_layer = c->n_layer,
        .intervention = iv,
    };
}

/* ---- position methods ------------------------------------------------------------------ */

/* Makes rows [0, n) of table id valid (computing the missing ones on the host staging rows). */
static void table_fill(fitm_forward *f, int32_t id, int64_t n)
{
    const int64_t have = f->tab_filled[id];
    if (n <= have)
        return;
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot, half = n_rot / 2;
    const double *k = f->tab_keys[id];
    for (int64_t i = 0; i < half; i++) {
        const double ex = -2.0 * (double)i / (double)n_rot;
        f->tab_freq[i] = k[3] * pow(k[2], ex) - k[1] * pow(k[0], ex);
    }
    float *host = f->tab_host;
    for (int64_t pos = have; pos < n; pos++)
        for (int64_t i = 0; i < half; i++) {
            const double a = (double)pos * f->tab_freq[i];
            host[(pos - have) * n_rot + 2 * i] = (float)cos(a);
            host[(pos - have) * n_rot + 2 * i + 1] = (float)sin(a);
        }
    f->b->ops->upload(f->b, f->tabs[id] + have * n_rot, host,
                      (size_t)((n - have) * n_rot) * sizeof(float));
    f->tab_filled[id] = n;
}

/* Whether layer l runs method m as a mixture (the other layers are plain). */
static bool position_layer(const fitm_forward *f, fitm_position_method m, int32_t l)
{
    if (m == FITM_POSITION_MOICE)
        return fitm_moice_routed(f->moice, l);
    return m == FITM_POSITION_MS_POE && l >= FITM_MS_POE_FIRST_LAYER;
}

/* The mixture of sequence q in layer l: per expert e, the call's queries and every visible
 * key (the prefix's below base) copied and turned on by the expert's base change (the cache
 * holds keys rotated with the layer's own base, and rotations compose); then the weights:
 * MoICE's routers on expert 0's queries, or Ms-PoE's one expert per head. */
static void position_mix(const pass *p, const seq_part *q, int32_t l, fitm_attn_mix *mix)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const bool moice = q->opts->position == FITM_POSITION_MOICE;
    const int64_t H = c->n_head, D = c->head_dim, HD = H * D, KV = (int64_t)c->n_head_kv * D;
    const int64_t T = q->T, n_keys = q->pos0 + T, n_rot = c->n_rot;
    const int32_t E = moice ? fitm_moice_n_experts(f->moice) : (int32_t)H;
    const int64_t k_stride = f->p.max_ctx * KV;
    for (int32_t e = 0; e < E; e++) {
        const int32_t id = moice ? f->tab_moice[l * E + e] : f->tab_ms_poe[l * H + e];
        table_fill(f, id, n_keys);
        const float *tab = f->tabs[id];
        float *qe = f->q_mix + e * T * HD, *ke = f->k_mix + e * k_stride;
        o->copy(b, qe, f->q + q->row0 * HD, (size_t)(T * HD) * sizeof(float));
        o->rope(b, qe, T, H, D, n_rot, tab + q->pos0 * n_rot, c->rope_neox);
        int64_t own0 = 0;
        if (q->base > 0) {
            fitm_kv_load_k(q->opts->prefix, l, 0, q->base, ke);
            own0 = q->base;
        }
        fitm_kv_load_k(q->kv, l, 0, n_keys - own0, ke + own0 * KV);
        o->rope(b, ke, n_keys, c->n_head_kv, D, n_rot, tab, c->rope_neox);
    }
    float *w = f->w_host;
    if (moice) {
        o->download(b, f->x_host, f->q_mix, (size_t)(T * HD) * sizeof(float));
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                fitm_moice_route(f->moice, l, (int32_t)h, f->x_host + (t * H + h) * D,
                                 w + (t * H + h) * E, f->route_scratch);
    } else {
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int32_t e = 0; e < E; e++)
                    w[(t * H + h) * E + e] = e == h ? 1.0f : 0.0f;
    }
    o->upload(b, f->w_mix, w, (size_t)(T * H * E) * sizeof(float));
    *mix = (fitm_attn_mix){.n_mix = E, .q = f->q_mix, .k = f->k_mix, .k_stride = k_stride,
                           .k_heads = c->n_head_kv, .w = f->w_mix};
}

/* The Ms-PoE calibration pass (one sequence from position 0): for each head, the last row's
 * attention on the queries and keys before RoPE, p = softmax(scale q.k) over the visible keys,
 * and the fraction of the row's keys with p > 3 mean(p) (the authors' outlier statistic); the
 * heads are ranked by it, most outliers first, the lower head first on ties. */
static void ms_poe_stats(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t T = p->T, H = c->n_head, Hkv = c->n_head_kv, D = c->head_dim;
    float *qh = f->stat_host, *kh = f->stat_host + H * D; /* last query row; (T, Hkv, D) */
    f->b->ops->download(f->b, qh, f->q + (T - 1) * H * D, (size_t)(H * D) * sizeof(float));
    f->b->ops->download(f->b, kh, f->k, (size_t)(T * Hkv * D) * sizeof(float));
    double frac[4096];
    for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / (H / Hkv);
        double mx = -INFINITY, z = 0.0;
        double sc[FITM_MS_POE_CALIB_LEN];
        for (int64_t j = 0; j < T; j++) {
            double d = 0.0;
            for (int64_t i = 0; i < D; i++)
                d += (double)qh[h * D + i] * kh[(j * Hkv + g) * D + i];
            sc[j] = fitm_model_key_visible(f->m, l, T - 1, j) ? d * c->attn_scale : -INFINITY;
            mx = sc[j] > mx ? sc[j] : mx;
        }
        for (int64_t j = 0; j < T; j++)
            z += sc[j] == -INFINITY ? 0.0 : exp(sc[j] - mx);
        int64_t n = 0;
        for (int64_t j = 0; j < T; j++) /* mean(p) over the row's T keys is 1 / T */
            n += sc[j] != -INFINITY && exp(sc[j] - mx) / z > 3.0 / (double)T;
        frac[h] = (double)n / (double)T;
    }
    for (int64_t h = 0; h < H; h++) {
        int32_t rank = 0;
        for (int64_t o = 0; o < H; o++) {
            const double mine = frac[h], other = frac[o];
            rank += other > mine || (other == mine && o < h);
        }
        f->ms_poe_rank[l * H + h] = rank;
    }
}

/* x += tmp (a block's output) for the rows the layer runs, tmp normed first where the model
 * has post-norms. */
static void add_block(const pass *p, const fitm_weight *post_norm)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    fitm_backend *b = f->b;
    const int64_t C = c->n_embd;
    int64_t r0[2], n[2];
    for (int i = 0, runs = layer_runs(p, r0, n); i < runs; i++) {
        float *t = f->tmp + r0[i] * C;
        if (c->post_norms)
            b->ops->rmsnorm(b, t, t, post_norm, n[i], C, c->norm_eps);
        b->ops->add(b, f->x + r0[i] * C, t, n[i] * C);
    }
}

/* xn = x normed with w, for the rows the layer runs. */
static void norm_rows(const pass *p, const fitm_weight *w)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t C = c->n_embd;
    int64_t r0[2], n[2];
    for (int i = 0, runs = layer_runs(p, r0, n); i < runs; i++)
        f->b->ops->rmsnorm(f->b, f->xn + r0[i] * C, f->x + r0[i] * C, w, n[i], C, c->norm_eps);
}

/* x += attention block of layer l for the sequences that run it; appends their K/V rows to
 * their caches. */
static void attention_block(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_layer *ly = fitm_model_layer(f->m, l);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const int64_t H = c->n_head, Hkv = c->n_head_kv, D = c->head_dim, n_rot = c->n_rot;
    const float *cs = f->cs[ly->local ? 1 : 0];

    norm_rows(p, &ly->attn_norm);
    const fitm_mm_out qkv[3] = {
        {&ly->wq, ly->bq.data ? &ly->bq : NULL, f->q},
        {&ly->wk, ly->bk.data ? &ly->bk : NULL, f->k},
        {&ly->wv, ly->bv.data ? &ly->bv : NULL, f->v},
    };
    matmul_paths(p, f->xn, c->n_embd, qkv, 3);
    int64_t r0[2], n[2];
    const int runs = layer_runs(p, r0, n);
    for (int i = 0; i < runs && c->qk_norm; i++) {
        o->rmsnorm(b, f->q + r0[i] * H * D, f->q + r0[i] * H * D, &ly->q_norm, n[i] * H, D,
                   c->norm_eps);
        o->rmsnorm(b, f->k + r0[i] * Hkv * D, f->k + r0[i] * Hkv * D, &ly->k_norm, n[i] * Hkv,
                   D, c->norm_eps);
    }
    if (f->stat_host)
        ms_poe_stats(p, l);
    for (int i = 0; i < runs; i++) {
        o->rope(b, f->q + r0[i] * H * D, n[i], H, D, n_rot, cs + r0[i] * n_rot, c->rope_neox);
        o->rope(b, f->k + r0[i] * Hkv * D, n[i], Hkv, D, n_rot, cs + r0[i] * n_rot,
                c->rope_neox);
    }
    fitm_attn_args a[FITM_FORWARD_MAX_SEQS];
    const seq_part *run[FITM_FORWARD_MAX_SEQS];
    int32_t n_run = 0;
    bool one_by_one = false;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        if (!runs_layer(q, l))
            continue;
        const int64_t src = q->row0 * Hkv * D;
        fitm_kv_store(q->kv, l, q->pos0 - q->base, f->k + src, f->v + src, q->T);
        run[n_run] = q;
        a[n_run] = attn_args(p, q, l);
        one_by_one |= position_layer(f, q->opts->position, l) ||
                      (a[n_run].capture && a[n_run].capture->add);
        n_run++;
    }
    /* One job for all sequences needs calls that share no memory they write or build: a
     * mixture's queries, keys and weights are built in the driver's one set of scratch arrays
     * (position_mix), and Attention Buckets' passes add their captures into the same arrays
     * (capture->add), so a step with either runs its sequences one at a time. */
    if (o->attention_many && n_run > 1 && !one_by_one) {
        o->attention_many(b, a, n_run);
    } else {
        for (int32_t s = 0; s < n_run; s++) {
            fitm_attn_mix mix;
            if (position_layer(f, run[s]->opts->position, l)) {
                position_mix(p, run[s], l, &mix);
                a[s].mix = &mix;
            }
            o->attention(b, &a[s]);
        }
    }
}

/* x += the attention output's projection for layer l's rows (after attention_block). */
static void attention_out(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_layer *ly = fitm_model_layer(f->m, l);
    const fitm_mm_out wo = {&ly->wo, ly->bo.data ? &ly->bo : NULL, f->tmp};
    matmul_paths(p, f->att, (int64_t)c->n_head * c->head_dim, &wo, 1);
    add_block(p, &ly->post_attn_norm);
}

/* x += feed-forward block of layer l, for the rows that run it. */
static void ffn_block(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_layer *ly = fitm_model_layer(f->m, l);
    const int64_t F = c->n_ff;

    norm_rows(p, &ly->ffn_norm);
    const fitm_mm_out gu[2] = {{&ly->w_gate, NULL, f->g}, {&ly->w_up, NULL, f->u}};
    matmul_paths(p, f->xn, c->n_embd, gu, 2);
    int64_t r0[2], n[2];
    for (int i = 0, runs = layer_runs(p, r0, n); i < runs; i++)
        f->b->ops->glu(f->b, f->g + r0[i] * F, f->g + r0[i] * F, f->u + r0[i] * F, n[i] * F,
                       c->act);
    const fitm_mm_out down = {&ly->w_down, NULL, f->tmp};
    matmul_paths(p, f->g, F, &down, 1);
    add_block(p, &ly->post_ffn_norm);
}

/* Each sequence's last n_logits rows' logits into its opts->logits and/or their top entries
 * into opts->top (selected by the backend, so only those leave it): the rows are gathered
 * (normed) into one block so the output head's weights are read once (always the STEP
 * products, so a row's logits do not depend on the rows beside it). */
static void output_head(const pass *p)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const int64_t C = c->n_embd, V = c->n_vocab;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        const int64_t nl = q->opts->n_logits;
        if (nl > 0)
            o->rmsnorm(b, f->xn + q->lrow0 * C, f->x + (q->row0 + q->T - nl) * C,
                       fitm_model_output_norm(f->m), nl, C, c->norm_eps);
    }
    const fitm_mm_out head = {fitm_model_output(f->m), NULL, f->logits};
    o->matmul(b, f->xn, p->n_logits, &head, 1, false);
    if (c->final_softcap > 0.0f)
        o->softcap(b, f->logits, p->n_logits * V, c->final_softcap);
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        const int64_t nl = q->opts->n_logits;
        if (nl > 0 && q->opts->logits)
            o->download(b, q->opts->logits, f->logits + q->lrow0 * V,
                        (size_t)(nl * V) * sizeof(float));
    }
    /* Top-k: consecutive sequences asking for the same k in one call (their logit rows are
     * adjacent), so a decode step's rows are scanned on all threads; each sequence's entries
     * are then copied out of the shared list. */
    for (int32_t s = 0, e; s < p->n_seqs; s = e) {
        const seq_part *q = &p->seq[s];
        const int32_t k = q->opts->top_k;
        e = s + 1;
        if (k <= 0 || q->opts->n_logits == 0)
            continue;
        int64_t rows = q->opts->n_logits;
        while (e < p->n_seqs && p->seq[e].opts->top_k == k && p->seq[e].opts->n_logits > 0)
            rows += p->seq[e++].opts->n_logits;
        o->topk(b, f->logits + q->lrow0 * V, rows, V, k, f->top);
        for (int32_t t = s; t < e; t++)
            memcpy(p->seq[t].opts->top, f->top + (p->seq[t].lrow0 - q->lrow0) * k,
                   (size_t)(p->seq[t].opts->n_logits * k) * sizeof(fitm_top));
    }
}

/* Checks every sequence and lays out the call's rows (STEP sequences first), its tokens and
 * its capture index. Touches no cache. */
static fitm_status plan_pass(fitm_forward *f, const fitm_forward_seq *seqs,
                             const seq_role *roles, int32_t n_seqs, pass *p, fitm_err *err)
{
    static const fitm_forward_opts no_opts;
    if (n_seqs < 1 || n_seqs > FITM_FORWARD_MAX_SEQS || !seqs)
        return fitm_err_set(err, FITM_ERR_INVALID, "%d sequences in one call, limit %d",
                            (int)n_seqs, FITM_FORWARD_MAX_SEQS);
    p->f = f;
    p->n_seqs = n_seqs;
    p->n_layers = 0;
    p->T = p->n_step = p->n_logits = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const fitm_forward_seq *in = &seqs[s];
        const fitm_forward_opts *opts = in->opts ? in->opts : &no_opts;
        if (!in->kv)
            return fitm_err_set(err, FITM_ERR_INVALID, "sequence %d has no KV cache", (int)s);
        if (in->T < 1 || in->T > f->p.max_tokens - p->T)
            return fitm_err_set(err, in->T < 1 ? FITM_ERR_INVALID : FITM_ERR_LIMIT,
                                "%lld tokens in one call (sequence %d), limit %lld",
                                (long long)(p->T + in->T), (int)s, (long long)f->p.max_tokens);
        if (opts->n_logits > f->p.max_logits - p->n_logits)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%lld logit rows in one call (sequence %d), limit %lld",
                                (long long)(p->n_logits + opts->n_logits), (int)s,
                                (long long)f->p.max_logits);
        for (int32_t r = 0; r < s; r++)
            if (seqs[r].kv == in->kv || (seqs[r].opts && seqs[r].opts->prefix == in->kv) ||
                opts->prefix == seqs[r].kv)
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "sequences %d and %d write or read the same KV cache",
                                    (int)r, (int)s);
        p->seq[s] = (seq_part){
            .kv = in->kv,
            .opts = opts,
            .T = in->T,
            .pos0 = in->pos0,
            .base = fitm_kv_pos_base(in->kv),
            .lrow0 = p->n_logits,
            .n_layers = call_layers(fitm_model_config_of(f->m), opts),
            .batched = opts->path == FITM_PATH_BATCH ||
                       (opts->path == FITM_PATH_AUTO && in->T >= FITM_FORWARD_BATCH_MIN),
            .role = roles ? roles[s] : plain_role,
        };
        p->T += in->T;
        p->n_logits += opts->n_logits;
        if (p->seq[s].n_layers > p->n_layers)
            p->n_layers = p->seq[s].n_layers;
        if (!p->seq[s].batched)
            p->n_step += in->T;
    }
    /* rows: within each path, the sequences that run more layers first, those with logits
     * first among equals (they run the last one's feed-forward part), in order on ties */
    int64_t next[2] = {0, p->n_step}; /* the next free row of each path */
    for (int32_t layers = p->n_layers; layers > 0; layers--)
        for (int with_logits = 1; with_logits >= 0; with_logits--)
            for (int32_t s = 0; s < n_seqs; s++)
                if (p->seq[s].n_layers == layers && (p->seq[s].opts->n_logits > 0) == with_logits) {
                    p->seq[s].row0 = next[p->seq[s].batched];
                    next[p->seq[s].batched] += p->seq[s].T;
                }
    for (int32_t s = 0; s < n_seqs; s++) {
        seq_part *q = &p->seq[s];
        fitm_status st = check_run(f, q->kv, seqs[s].tokens, q->T, q->pos0, q->opts, &q->role,
                                   f->cap_index + q->row0, err);
        if (st != FITM_OK) {
            if (n_seqs > 1) {
                fitm_err why = *err;
                fitm_err_set(err, st, "sequence %d: %s", (int)s, why.msg);
            }
            return st;
        }
        memcpy(f->ids + q->row0, seqs[s].tokens, (size_t)q->T * sizeof(int32_t));
    }
    return FITM_OK;
}

/* Attention Buckets' output, one pass's logit rows at a time: p = softmax(x) (in double),
 * a = max p = 1 / sum_v exp(x_v - max x); the sequence's accumulator rows get a p (pass 0
 * stores, the others add) and their sums a. With a single pass the rows get log p itself,
 * so one bucket of factor 1 is exactly the plain model's distribution. */
static void bucket_add(const pass *p, const seq_part *q)
{
    fitm_forward *f = p->f;
    const int64_t V = fitm_model_config_of(f->m)->n_vocab;
    for (int64_t i = 0; i < q->opts->n_logits; i++) {
        f->b->ops->download(f->b, f->bk_row, f->logits + (q->lrow0 + i) * V,
                            (size_t)V * sizeof(float));
        const float *x = f->bk_row;
        double *e = f->bk_exp, mx = -INFINITY, z = 0.0;
        for (int64_t v = 0; v < V; v++)
            mx = x[v] > mx ? x[v] : mx;
        for (int64_t v = 0; v < V; v++)
            z += e[v] = exp((double)x[v] - mx);
        double *acc = f->bk_acc + (q->role.acc0 + i) * V;
        if (q->role.n_pass == 1) {
            const double lz = mx + log(z);
            for (int64_t v = 0; v < V; v++)
                acc[v] = (double)x[v] - lz;
            continue;
        }
        const double a = 1.0 / z, az = a / z; /* a p_v = exp(x_v - mx) / z^2 */
        if (q->role.pass == 0) {
            f->bk_sum[q->role.acc0 + i] = a;
            for (int64_t v = 0; v < V; v++)
                acc[v] = az * e[v];
        } else {
            f->bk_sum[q->role.acc0 + i] += a;
            for (int64_t v = 0; v < V; v++)
                acc[v] += az * e[v];
        }
    }
}

/* Sets cap's slots of layers [from, L) to 0 (a call that did not run them). */
static void capture_clear(const fitm_forward *f, const fitm_capture *cap, int32_t from)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t per_row = (int64_t)c->n_layer * c->n_head, skip = (int64_t)from * c->n_head;
    for (int32_t r = 0; r < cap->n_rows; r++) {
        const int64_t slot = r * per_row + skip, n = per_row - skip;
        if (cap->span_mass && cap->n_spans > 0)
            memset(cap->span_mass + slot * cap->n_spans, 0,
                   (size_t)(n * cap->n_spans) * sizeof(float));
        if (cap->probs)
            memset(cap->probs + slot * cap->probs_stride, 0,
                   (size_t)(n * cap->probs_stride) * sizeof(float));
    }
}

/* Runs the call planned in p (bucket passes add their logit rows to the accumulators). */
static fitm_status run_pass(fitm_forward *f, pass *p, fitm_err *err)
{
    fitm_status s;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    pass_rope_tables(p);
    f->b->ops->embed(f->b, fitm_model_tok_embd(f->m), f->ids, p->T, c->embd_scale, f->x);
    for (int32_t l = 0; l < p->n_layers; l++) {
        set_act(p, l, false);
        attention_block(p, l);
        if (set_act(p, l, true)) {
            attention_out(p, l);
            ffn_block(p, l);
        }
    }
    for (int32_t i = 0; i < p->n_seqs; i++) {
        const seq_part *q = &p->seq[i];
        fitm_kv_set_end(q->kv, q->pos0 + q->T);
        fitm_kv_set_layers(q->kv, q->pos0, q->n_layers);
        if (q->n_layers < c->n_layer && q->opts->capture && !q->opts->capture->add)
            capture_clear(f, q->opts->capture, q->n_layers);
    }
    if (p->n_logits > 0)
        output_head(p);
    if (f->b->ops->status && (s = f->b->ops->status(f->b, err)) != FITM_OK) {
        for (int32_t i = 0; i < p->n_seqs; i++) /* the rows this call wrote cannot be trusted */
            fitm_kv_set_end(p->seq[i].kv, p->seq[i].pos0);
        return s;
    }
    for (int32_t i = 0; i < p->n_seqs; i++)
        if (p->seq[i].role.n_pass > 0 && p->seq[i].opts->n_logits > 0)
            bucket_add(p, &p->seq[i]);
    return FITM_OK;
}

/* A bucket sequence's output after all its passes ran: logits log p^ (p^ = sum a_b p_b /
 * sum a_b) into opts->logits and/or their top entries into opts->top; its captures divided
 * by the number of passes (the mean of the passes' probabilities and masses). */
static void bucket_finish(fitm_forward *f, const fitm_forward_seq *in, const seq_role *role)
{
    const fitm_forward_opts *o = in->opts;
    const int64_t V = fitm_model_config_of(f->m)->n_vocab;
    for (int64_t i = 0; i < o->n_logits; i++) {
        const double *acc = f->bk_acc + (role->acc0 + i) * V;
        const double sum = f->bk_sum[role->acc0 + i];
        float *row = o->logits ? o->logits + i * V : f->bk_row;
        for (int64_t v = 0; v < V; v++)
            row[v] = (float)(role->n_pass == 1 ? acc[v] : log(acc[v] / sum));
        if (o->top_k > 0)
            fitm_ops_topk(row, V, o->top_k, o->top + i * o->top_k);
    }
    const fitm_capture *cap = o->capture;
    if (!cap || role->n_pass < 2)
        return;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t slots = (int64_t)cap->n_rows * c->n_layer * c->n_head;
    const float P = (float)role->n_pass;
    if (cap->span_mass)
        for (int64_t i = 0; i < slots * cap->n_spans; i++)
            cap->span_mass[i] /= P;
    if (cap->probs)
        for (int64_t i = 0; i < slots * cap->probs_stride; i++)
            cap->probs[i] /= P;
}

/* A call with BUCKETS sequences: each expands to one sequence per pass of its cache (pass b
 * on pass b of kv and of its prefix, bases times factor b; pass 0 stores the captures, the
 * others add to them); the expanded list runs in groups that fit the limits, in order (so
 * pass 0 of every layer comes first). Every group is checked before any runs. Then each
 * bucket sequence's rows become log p^ (bucket_finish) and its captures the passes' mean. */
static fitm_status run_buckets(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                               fitm_err *err)
{
    if (n_seqs < 1 || n_seqs > FITM_FORWARD_MAX_SEQS)
        return fitm_err_set(err, FITM_ERR_INVALID, "%d sequences in one call, limit %d",
                            (int)n_seqs, FITM_FORWARD_MAX_SEQS);
    int32_t n = 0;
    int64_t acc = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const fitm_forward_seq *in = &seqs[s];
        const fitm_forward_opts *o = in->opts;
        if (!o || o->position != FITM_POSITION_BUCKETS) {
            f->bk_seq[n] = *in;
            f->bk_role[n++] = plain_role;
            continue;
        }
        if (!in->kv)
            return fitm_err_set(err, FITM_ERR_INVALID, "sequence %d has no KV cache", (int)s);
        const int32_t P = fitm_kv_n_passes(in->kv);
        if (P > FITM_BUCKETS)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "sequence %d: its cache holds %d passes, attention_buckets has %d",
                                (int)s, (int)P, FITM_BUCKETS);
        if (o->prefix && fitm_kv_n_passes(o->prefix) < P)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "sequence %d: its prefix cache holds %d passes, its cache %d",
                                (int)s, (int)fitm_kv_n_passes(o->prefix), (int)P);
        fitm_status st = check_output(f, in->T, o, err);
        if (st != FITM_OK)
            return st;
        if (o->n_logits > 0 && f->bk_acc && o->n_logits > f->p.max_logits - acc)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%lld logit rows in one call (sequence %d), limit %lld",
                                (long long)(acc + o->n_logits), (int)s,
                                (long long)f->p.max_logits);
        for (int32_t b = 0; b < P; b++, n++) {
            f->bk_opts[n] = *o;
            f->bk_opts[n].logits = NULL;
            f->bk_opts[n].top_k = 0;
            f->bk_opts[n].top = NULL;
            if (o->prefix)
                f->bk_opts[n].prefix = fitm_kv_pass(o->prefix, b);
            if (o->capture) {
                f->bk_cap[n] = *o->capture;
                f->bk_cap[n].add = b > 0;
                f->bk_opts[n].capture = &f->bk_cap[n];
            }
            f->bk_seq[n] = (fitm_forward_seq){fitm_kv_pass(in->kv, b), in->tokens, in->T,
                                              in->pos0, &f->bk_opts[n]};
            f->bk_role[n] = (seq_role){(float)fitm_forward_bucket_factor(b), P, b, acc};
        }
        acc += o->n_logits;
    }
    /* groups [g0, g1) that fit the call's limits; every group checked before any runs */
    int32_t starts[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS + 1], n_groups = 0;
    for (int32_t i = 0; i < n;) {
        int64_t rows = 0, logits = 0;
        int32_t j = i;
        for (; j < n && j - i < FITM_FORWARD_MAX_SEQS; j++) {
            const int64_t nl = f->bk_seq[j].opts ? f->bk_seq[j].opts->n_logits : 0;
            if (j > i && (rows + f->bk_seq[j].T > f->p.max_tokens ||
                          logits + nl > f->p.max_logits))
                break;
            rows += f->bk_seq[j].T;
            logits += nl;
        }
        starts[n_groups++] = i;
        i = j;
    }
    starts[n_groups] = n;
    pass p;
    fitm_status st = FITM_OK;
    for (int32_t g = 0; g < n_groups && st == FITM_OK; g++)
        st = plan_pass(f, f->bk_seq + starts[g], f->bk_role + starts[g],
                       starts[g + 1] - starts[g], &p, err);
    bool ran = false;
    for (int32_t g = 0; g < n_groups && st == FITM_OK; g++)
        if ((st = plan_pass(f, f->bk_seq + starts[g], f->bk_role + starts[g],
                            starts[g + 1] - starts[g], &p, err)) == FITM_OK) {
            ran = true;
            st = run_pass(f, &p, err);
        }
    if (st != FITM_OK) {
        for (int32_t i = 0; ran && i < n; i++) /* a group failed on the backend: undo them all */
            fitm_kv_set_end(f->bk_seq[i].kv, f->bk_seq[i].pos0);
        return st;
    }
    for (int32_t s = 0, i = 0; s < n_seqs; s++) {
        const int32_t P = f->bk_role[i].n_pass;
        if (P > 0)
            bucket_finish(f, &seqs[s], &f->bk_role[i]);
        i += P > 0 ? P : 1;
    }
    return FITM_OK;
}

fitm_status fitm_forward_run_batch(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                                   fitm_err *err)
{
    for (int32_t i = 0; seqs && i < n_seqs && i < FITM_FORWARD_MAX_SEQS; i++)
        if (seqs[i].opts && seqs[i].opts->position == FITM_POSITION_BUCKETS)
            return run_buckets(f, seqs, n_seqs, err);
    pass p;
    fitm_status s = plan_pass(f, seqs, NULL, n_seqs, &p, err);
    return s == FITM_OK ? run_pass(f, &p, err) : s;
}

fitm_status fitm_forward_run(fitm_forward *f, fitm_kv *kv, const int32_t *tokens, int64_t T,
                             int64_t pos0, const fitm_forward_opts *opts, fitm_err *err)
{
    const fitm_forward_seq seq = {kv, tokens, T, pos0, opts};
    return fitm_forward_run_batch(f, &seq, 1, err);
}

/* ---- position methods: creation ------------------------------------------------------------ */

/* The index of the table turning keys rotated with (from_base, from_scale) into keys rotated
 * with (to_base, to_scale), one per distinct change: row p holds, for each pair i, the cos and
 * sin of p (to_scale to_base^(-2i/n_rot) - from_scale from_base^(-2i/n_rot)), in double. A
 * zero change gives cos 1, sin 0: the keys come through bit for bit. Rows are filled on first
 * use (table_fill), so memory is touched only up to the longest context served. */
static int32_t rotation_table(fitm_forward *f, double from_base, double from_scale,
                              double to_base, double to_scale, bool *ok)
{
    for (int32_t i = 0; i < f->n_tabs; i++)
        if (f->tab_keys[i][0] == from_base && f->tab_keys[i][1] == from_scale &&
            f->tab_keys[i][2] == to_base && f->tab_keys[i][3] == to_scale)
            return i;
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    float *t = f->n_tabs < f->cap_tabs
                   ? f->b->ops->alloc(f->b, (size_t)(f->p.max_ctx * n_rot) * sizeof(float))
                   : NULL;
    if (!t) {
        *ok = false;
        return 0;
    }
    const int32_t id = f->n_tabs++;
    f->tabs[id] = t;
    f->tab_filled[id] = 0;
    f->tab_keys[id][0] = from_base;
    f->tab_keys[id][1] = from_scale;
    f->tab_keys[id][2] = to_base;
    f->tab_keys[id][3] = to_scale;
    return id;
}

/* Ranks the heads for Ms-PoE with a plain pass over the calibration ids (ms_poe_stats). */
static fitm_status ms_poe_calibrate(fitm_forward *f, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    int64_t T = FITM_MS_POE_CALIB_LEN;
    T = T < f->p.max_tokens ? T : f->p.max_tokens;
    T = T < f->p.max_ctx ? T : f->p.max_ctx;
    const int64_t H = c->n_head, D = c->head_dim;
    const int64_t KVH = H > c->n_head_kv ? H : c->n_head_kv;
    int32_t *ids = malloc((size_t)T * sizeof *ids);
    float *stat = malloc((size_t)((T + 1) * KVH * D) * sizeof(float));
    fitm_kv *kv = NULL;
    fitm_status s = FITM_OK;
    if (!ids || !stat)
        s = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the Ms-PoE calibration");
    if (s == FITM_OK)
        s = fitm_kv_create(&kv, f->b, c, T, err);
    if (s == FITM_OK) {
        for (int64_t i = 0; i < T; i++)
            ids[i] = fitm_forward_ms_poe_calib_id(i, c->n_vocab);
        f->stat_host = stat;
        s = fitm_forward_run(f, kv, ids, T, 0, NULL, err);
        f->stat_host = NULL;
    }
    fitm_kv_destroy(kv);
    free(ids);
    free(stat);
    return s;
}

fitm_status fitm_forward_positions(fitm_forward *f, const fitm_moice *mo, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    if (f->tabs)
        return fitm_err_set(err, FITM_ERR_INVALID, "position methods are already enabled");
    f->moice = mo;
    if (f->b->ops->capture_add) {
        const int64_t V = c->n_vocab, rows = f->p.max_logits > 0 ? f->p.max_logits : 1;
        f->bk_acc = calloc((size_t)(rows * V), sizeof *f->bk_acc);
        f->bk_sum = calloc((size_t)rows, sizeof *f->bk_sum);
        f->bk_row = malloc((size_t)V * sizeof *f->bk_row);
        f->bk_exp = malloc((size_t)V * sizeof *f->bk_exp);
        if (!f->bk_acc || !f->bk_sum || !f->bk_row || !f->bk_exp)
            return fitm_err_set(err, FITM_ERR_NOMEM,
                                "cannot allocate the Attention Buckets output scratch");
    }
    if (!f->backend_mix)
        return FITM_OK; /* its calls with a method fail UNSUPPORTED: reserve nothing for them */
    const int64_t L = c->n_layer, H = c->n_head, D = c->head_dim, Tm = f->p.max_tokens;
    const int32_t N = mo ? fitm_moice_n_experts(mo) : 0;
    if (mo) {
        const fitm_moice_base *mb = fitm_moice_base_of(mo);
        if (mb->block_count != (uint32_t)L || mb->head_count != (uint32_t)H ||
            mb->head_count_kv != (uint32_t)c->n_head_kv || mb->key_length != (uint32_t)D)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "MoICE sidecar shapes do not match the model (fitm_moice_check)");
    }
    f->n_mix = (int32_t)(N > H ? N : H);
    bool ok = true;
    f->q_mix = alloc_floats(f->b, f->n_mix * Tm * H * D, &ok);
    f->k_mix = alloc_floats(f->b, f->n_mix * f->p.max_ctx * c->n_head_kv * D, &ok);
    f->w_mix = alloc_floats(f->b, Tm * H * f->n_mix, &ok);
    f->cap_tabs = (int32_t)(L * (N + H));
    f->tabs = calloc((size_t)f->cap_tabs, sizeof *f->tabs);
    f->tab_keys = calloc((size_t)f->cap_tabs, sizeof *f->tab_keys);
    f->tab_moice = N ? malloc((size_t)(L * N) * sizeof *f->tab_moice) : NULL;
    f->tab_ms_poe = malloc((size_t)(L * H) * sizeof *f->tab_ms_poe);
    f->ms_poe_rank = calloc((size_t)(L * H), sizeof *f->ms_poe_rank);
    f->w_host = malloc((size_t)(Tm * H * f->n_mix) * sizeof *f->w_host);
    f->x_host = malloc((size_t)(Tm * H * D) * sizeof *f->x_host);
    f->tab_filled = calloc((size_t)f->cap_tabs, sizeof *f->tab_filled);
    f->tab_freq = malloc((size_t)(c->n_rot / 2 + 1) * sizeof *f->tab_freq);
    f->tab_host = malloc((size_t)(f->p.max_ctx * c->n_rot) * sizeof *f->tab_host);
    ok = ok && f->tabs && f->tab_keys && (!N || f->tab_moice) && f->tab_ms_poe &&
         f->ms_poe_rank && f->w_host && f->x_host && f->tab_filled && f->tab_freq &&
         f->tab_host;
    fitm_status s = FITM_OK;
    if (ok) {
        const int32_t n_mix = f->n_mix;
        f->n_mix = 0; /* the calibration pass is a plain one */
        s = ms_poe_calibrate(f, err);
        f->n_mix = n_mix;
    }
    for (int32_t l = 0; l < L && ok && s == FITM_OK; l++) {
        const fitm_layer *ly = fitm_model_layer(f->m, l);
        const double base = ly->rope_base, scale = ly->rope_freq_scale;
        for (int32_t e = 0; mo && e < N && fitm_moice_routed(mo, l); e++)
            f->tab_moice[l * N + e] = rotation_table(f, base, scale,
                                                     fitm_moice_bases(mo, l)[e], scale, &ok);
        for (int32_t h = 0; h < H && l >= FITM_MS_POE_FIRST_LAYER; h++) {
            const double r = FITM_MS_POE_MIN + (FITM_MS_POE_MAX - FITM_MS_POE_MIN) *
                                                   (double)f->ms_poe_rank[l * H + h] / (double)H;
            f->tab_ms_poe[l * H + h] = rotation_table(f, base, scale, base, scale / r, &ok);
        }
    }
    if (s == FITM_OK && !ok)
        s = fitm_err_set(err, FITM_ERR_NOMEM,
                         "cannot allocate the position methods' scratch (%d experts, %lld "
                         "positions)",
                         (int)f->n_mix, (long long)f->p.max_ctx);
    return s;
}
