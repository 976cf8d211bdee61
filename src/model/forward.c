#include "model/forward.h"

#include <stdlib.h>
#include <string.h>

struct fitm_forward {
    const fitm_model *m;
    fitm_backend *b;
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
    int32_t *ids;       /* (T) the call's tokens, in row order */
};

static void free_scratch(fitm_forward *f)
{
    fitm_backend *b = f->b;
    float *bufs[] = {f->x,      f->xn,     f->q,     f->att, f->tmp, f->g,
                     f->u,      f->logits, f->cs[0], f->cs[1], f->k,  f->v};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        b->ops->free(b, bufs[i]);
    free(f->cs_host);
    free(f->cap_index);
    free(f->ids);
}

void fitm_forward_destroy(fitm_forward *f)
{
    if (!f)
        return;
    free_scratch(f);
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
    f->ids = malloc((size_t)Tm * sizeof(int32_t));
    if (!ok || !f->cs_host || !f->cap_index || !f->ids) {
        fitm_forward_destroy(f);
        return fitm_err_set(err, FITM_ERR_NOMEM, "cannot allocate forward scratch for %lld tokens",
                            (long long)Tm);
    }
    int64_t max_k = C > F ? C : F;
    max_k = max_k > HD ? max_k : HD;
    fitm_status s = b->ops->reserve(b, Tm, p->max_ctx, max_k, err);
    if (s == FITM_OK && b->ops->prepare)
        s = b->ops->prepare(b, m, err);
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

/* Everything a call's arguments must satisfy, checked before the cache is touched. */
static fitm_status check_run(const fitm_forward *f, const fitm_kv *kv, const int32_t *tokens,
                             int64_t T, int64_t pos0, const fitm_forward_opts *opts,
                             int32_t *cap_index, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    if (!fitm_kv_fits(kv, c) || (opts->prefix && !fitm_kv_fits(opts->prefix, c)))
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache was made for another model shape");
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
    if (opts->n_logits < 0 || opts->n_logits > T || opts->n_logits > f->p.max_logits ||
        (opts->n_logits > 0 && !opts->logits && opts->top_k <= 0))
        return fitm_err_set(err, FITM_ERR_INVALID, "%lld logit rows asked for (T %lld, limit %lld)",
                            (long long)opts->n_logits, (long long)T, (long long)f->p.max_logits);
    if (opts->top_k < 0 || opts->top_k > FITM_TOP_MAX || opts->top_k > c->n_vocab ||
        (opts->top_k > 0 && opts->n_logits > 0 && !opts->top))
        return fitm_err_set(err, FITM_ERR_INVALID, "top %d of the logits asked for (limit %d)",
                            (int)opts->top_k,
                            (int)(c->n_vocab < FITM_TOP_MAX ? c->n_vocab : FITM_TOP_MAX));
    if ((unsigned)opts->path > FITM_PATH_STEP)
        return fitm_err_set(err, FITM_ERR_INVALID, "unknown forward path %d", (int)opts->path);
    fitm_status s;
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
    bool batched;   /* its numerics path                                              */
} seq_part;

/* One call's state, shared by the layer steps. Rows are laid out STEP sequences first, then
 * BATCH sequences, so each path's rows are one contiguous run [0, n_step), [n_step, T). */
typedef struct {
    fitm_forward *f;
    seq_part seq[FITM_FORWARD_MAX_SEQS];
    int32_t n_seqs;
    int64_t T, n_step, n_logits;
} pass;

static void rope_tables(fitm_forward *f, const pass *p, float base, float scale, float *dst)
{
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        for (int64_t t = 0; t < q->T; t++)
            fitm_ops_rope_table(f->cs_host + (q->row0 + t) * n_rot, n_rot, q->pos0 + t, base,
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

/* outs (y laid out over all T rows) = x (T, K) . W^T, as one product per path: the STEP rows,
 * then the BATCH rows. */
static void matmul_paths(const pass *p, const float *x, int64_t K, const fitm_mm_out *outs,
                         int n_outs)
{
    fitm_backend *b = p->f->b;
    fitm_mm_out part[3];
    for (int g = 0; g < 2; g++) {
        const int64_t r0 = g == 0 ? 0 : p->n_step, nr = g == 0 ? p->n_step : p->T - p->n_step;
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
        .capture = opts->capture,
        .cap_index = p->f->cap_index + q->row0,
        .n_layer = c->n_layer,
        .intervention = iv,
    };
}

/* x += attention block of layer l; appends each sequence's K/V rows to its cache. */
static void attention_block(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_layer *ly = fitm_model_layer(f->m, l);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const int64_t T = p->T, C = c->n_embd, H = c->n_head, Hkv = c->n_head_kv, D = c->head_dim;
    const float *cs = f->cs[ly->local ? 1 : 0];

    o->rmsnorm(b, f->xn, f->x, &ly->attn_norm, T, C, c->norm_eps);
    const fitm_mm_out qkv[3] = {
        {&ly->wq, ly->bq.data ? &ly->bq : NULL, f->q},
        {&ly->wk, ly->bk.data ? &ly->bk : NULL, f->k},
        {&ly->wv, ly->bv.data ? &ly->bv : NULL, f->v},
    };
    matmul_paths(p, f->xn, C, qkv, 3);
    if (c->qk_norm) {
        o->rmsnorm(b, f->q, f->q, &ly->q_norm, T * H, D, c->norm_eps);
        o->rmsnorm(b, f->k, f->k, &ly->k_norm, T * Hkv, D, c->norm_eps);
    }
    o->rope(b, f->q, T, H, D, c->n_rot, cs, c->rope_neox);
    o->rope(b, f->k, T, Hkv, D, c->n_rot, cs, c->rope_neox);
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        const int64_t dst = (q->pos0 - q->base) * Hkv * D, src = q->row0 * Hkv * D;
        const size_t n = (size_t)(q->T * Hkv * D) * sizeof(float);
        o->copy(b, fitm_kv_k(q->kv, l) + dst, f->k + src, n);
        o->copy(b, fitm_kv_v(q->kv, l) + dst, f->v + src, n);
        fitm_attn_args a = attn_args(p, q, l);
        o->attention(b, &a);
    }
    const fitm_mm_out wo = {&ly->wo, ly->bo.data ? &ly->bo : NULL, f->tmp};
    matmul_paths(p, f->att, H * D, &wo, 1);
    if (c->post_norms)
        o->rmsnorm(b, f->tmp, f->tmp, &ly->post_attn_norm, T, C, c->norm_eps);
    o->add(b, f->x, f->tmp, T * C);
}

/* x += feed-forward block of layer l. */
static void ffn_block(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_layer *ly = fitm_model_layer(f->m, l);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const int64_t T = p->T, C = c->n_embd, F = c->n_ff;

    o->rmsnorm(b, f->xn, f->x, &ly->ffn_norm, T, C, c->norm_eps);
    const fitm_mm_out gu[2] = {{&ly->w_gate, NULL, f->g}, {&ly->w_up, NULL, f->u}};
    matmul_paths(p, f->xn, C, gu, 2);
    o->glu(b, f->g, f->g, f->u, T * F, c->act);
    const fitm_mm_out down = {&ly->w_down, NULL, f->tmp};
    matmul_paths(p, f->g, F, &down, 1);
    if (c->post_norms)
        o->rmsnorm(b, f->tmp, f->tmp, &ly->post_ffn_norm, T, C, c->norm_eps);
    o->add(b, f->x, f->tmp, T * C);
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
        if (nl > 0 && q->opts->top_k > 0)
            o->topk(b, f->logits + q->lrow0 * V, nl, V, q->opts->top_k, q->opts->top);
    }
}

/* Checks every sequence and lays out the call's rows (STEP sequences first), its tokens and
 * its capture index. Touches no cache. */
static fitm_status plan_pass(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                             pass *p, fitm_err *err)
{
    static const fitm_forward_opts no_opts;
    if (n_seqs < 1 || n_seqs > FITM_FORWARD_MAX_SEQS || !seqs)
        return fitm_err_set(err, FITM_ERR_INVALID, "%d sequences in one call, limit %d",
                            (int)n_seqs, FITM_FORWARD_MAX_SEQS);
    p->f = f;
    p->n_seqs = n_seqs;
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
            .batched = opts->path == FITM_PATH_BATCH ||
                       (opts->path == FITM_PATH_AUTO && in->T >= FITM_FORWARD_BATCH_MIN),
        };
        p->T += in->T;
        p->n_logits += opts->n_logits;
        if (!p->seq[s].batched)
            p->n_step += in->T;
    }
    int64_t next[2] = {0, p->n_step}; /* the next free row of each path */
    for (int32_t s = 0; s < n_seqs; s++) {
        seq_part *q = &p->seq[s];
        q->row0 = next[q->batched];
        next[q->batched] += q->T;
        fitm_status st = check_run(f, q->kv, seqs[s].tokens, q->T, q->pos0, q->opts,
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

fitm_status fitm_forward_run_batch(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                                   fitm_err *err)
{
    pass p;
    fitm_status s = plan_pass(f, seqs, n_seqs, &p, err);
    if (s != FITM_OK)
        return s;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    pass_rope_tables(&p);
    f->b->ops->embed(f->b, fitm_model_tok_embd(f->m), f->ids, p.T, c->embd_scale, f->x);
    for (int32_t l = 0; l < c->n_layer; l++) {
        attention_block(&p, l);
        ffn_block(&p, l);
    }
    for (int32_t i = 0; i < n_seqs; i++)
        fitm_kv_set_end(p.seq[i].kv, p.seq[i].pos0 + p.seq[i].T);
    if (p.n_logits > 0)
        output_head(&p);
    if (f->b->ops->status && (s = f->b->ops->status(f->b, err)) != FITM_OK) {
        for (int32_t i = 0; i < n_seqs; i++) /* the rows this call wrote cannot be trusted */
            fitm_kv_set_end(p.seq[i].kv, p.seq[i].pos0);
        return s;
    }
    return FITM_OK;
}

fitm_status fitm_forward_run(fitm_forward *f, fitm_kv *kv, const int32_t *tokens, int64_t T,
                             int64_t pos0, const fitm_forward_opts *opts, fitm_err *err)
{
    const fitm_forward_seq seq = {kv, tokens, T, pos0, opts};
    return fitm_forward_run_batch(f, &seq, 1, err);
}
