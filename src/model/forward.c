/* forward: the one forward driver (see forward.h): argument checks, one call's layout, the
 * layer steps, the output head. The position methods' parts of a call are position.c's. */
#include "model/forward_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>




static void free_scratch(fitm_forward *f)
{
    fitm_backend *b = f->b;
    float *bufs[] = {f->x,      f->xn,     f->q,     f->att, f->tmp, f->g,
                     f->u,      f->logits, f->cs[0], f->cs[1], f->k,  f->v};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        b->ops->free(b, bufs[i]);
    free(f->cs_host);
    for (int i = 0; i < 2; i++) {
        free(f->rope_w[i]);
        free(f->rope_rows[i]);
    }
    free(f->cap_index);
    free(f->top);
    free(f->pick);
    free(f->lp);
    free(f->lp_row);
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
    for (int i = 0; i < 2; i++) {
        f->rope_w[i] = malloc((size_t)(c->n_rot / 2 + 1) * sizeof(double));
        f->rope_w_base[i] = NAN;
    }
    f->cap_index = malloc((size_t)Tm * sizeof(int32_t));
    f->top = malloc((size_t)(p->max_logits * FITM_TOP_MAX + 1) * sizeof(fitm_top));
    f->ids = malloc((size_t)Tm * sizeof(int32_t));
    const size_t picks = (size_t)(p->max_logits * FITM_PICK_MAX + 1);
    f->pick = malloc(picks * sizeof *f->pick);
    f->lp = malloc(picks * sizeof *f->lp);
    f->lp_row = malloc((size_t)c->n_vocab * sizeof *f->lp_row);
    if (!ok || !f->cs_host || !f->rope_w[0] || !f->rope_w[1] || !f->cap_index || !f->top ||
        !f->ids || !f->pick || !f->lp || !f->lp_row) {
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

/* Makes f->rope_w[which] the frequencies of base b. */
static void rope_freqs(fitm_forward *f, int which, float b)
{
    if (!(f->rope_w_base[which] == b)) {
        fitm_ops_rope_freqs(f->rope_w[which], fitm_model_config_of(f->m)->n_rot, b);
        f->rope_w_base[which] = b;
    }
}

/* The kept rows of table `which` (base, scale: the table's own), holding positions [0, need):
 * those not kept yet are computed now. NULL where need is past max_ctx or the room cannot
 * grow (the caller computes its rows itself). */
static const float *rope_rows(fitm_forward *f, int which, float base, float scale, int64_t need)
{
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    if (need > f->p.max_ctx)
        return NULL;
    if (need > f->rope_cap[which]) {
        int64_t cap = f->rope_cap[which] * 2 > 256 ? f->rope_cap[which] * 2 : 256;
        cap = cap < need ? need : cap > f->p.max_ctx ? f->p.max_ctx : cap;
        float *r = realloc(f->rope_rows[which], (size_t)(cap * n_rot) * sizeof *r);
        if (!r)
            return NULL;
        f->rope_rows[which] = r;
        f->rope_cap[which] = cap;
    }
    if (need > f->rope_n[which]) {
        rope_freqs(f, which, base);
        for (int64_t t = f->rope_n[which]; t < need; t++)
            fitm_ops_rope_table_at(f->rope_rows[which] + t * n_rot, n_rot, t, scale,
                                   f->rope_w[which]);
        f->rope_n[which] = need;
    }
    return f->rope_rows[which];
}

/* Table `which` (0 global, 1 local) of every row's position, base `base` times each
 * sequence's factor: the rows of fitm_ops_rope_table, from the kept rows where the factor is 1
 * (rope_rows), else from frequencies computed once per base. */
static void rope_tables(fitm_forward *f, const pass *p, int which, float base, float scale,
                        float *dst)
{
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        float *cs = f->cs_host + q->row0 * n_rot;
        const float b = base * q->role.factor; /* factor 1: the base itself, bit for bit */
        const float *kept = b == base ? rope_rows(f, which, base, scale, q->pos0 + q->T) : NULL;
        if (kept) {
            memcpy(cs, kept + q->pos0 * n_rot, (size_t)(q->T * n_rot) * sizeof *cs);
            continue;
        }
        rope_freqs(f, which, b);
        for (int64_t t = 0; t < q->T; t++)
            fitm_ops_rope_table_at(cs + t * n_rot, n_rot, q->pos0 + t, scale, f->rope_w[which]);
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
        rope_tables(p->f, p, 0, c->rope_base, c->rope_freq_scale, p->f->cs[0]);
    if (any_local)
        rope_tables(p->f, p, 1, c->rope_base_local, 1.0f, p->f->cs[1]);
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
        .batched = q->batched,
    };
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
    /* The per-head norms and RoPE as one op where the backend has it, unless Ms-PoE's
     * statistics read the normed heads before their rotation. */
    const bool fused = o->qk_rope && !f->stat_host;
    for (int i = 0; i < runs && fused; i++)
        o->qk_rope(b, f->q + r0[i] * H * D, f->k + r0[i] * Hkv * D, n[i], H, Hkv, D, n_rot,
                   cs + r0[i] * n_rot, c->rope_neox, c->qk_norm ? &ly->q_norm : NULL,
                   c->qk_norm ? &ly->k_norm : NULL, c->norm_eps);
    for (int i = 0; i < runs && !fused && c->qk_norm; i++) {
        o->rmsnorm(b, f->q + r0[i] * H * D, f->q + r0[i] * H * D, &ly->q_norm, n[i] * H, D,
                   c->norm_eps);
        o->rmsnorm(b, f->k + r0[i] * Hkv * D, f->k + r0[i] * Hkv * D, &ly->k_norm, n[i] * Hkv,
                   D, c->norm_eps);
    }
    if (f->stat_host)
        fitm_position_ms_poe_stats(p, l);
    for (int i = 0; i < runs && !fused; i++) {
        o->rope(b, f->q + r0[i] * H * D, n[i], H, D, n_rot, cs + r0[i] * n_rot, c->rope_neox);
        o->rope(b, f->k + r0[i] * Hkv * D, n[i], Hkv, D, n_rot, cs + r0[i] * n_rot,
                c->rope_neox);
    }
    fitm_attn_args a[FITM_FORWARD_MAX_SEQS];
    fitm_kv_rows store[FITM_FORWARD_MAX_SEQS];
    const seq_part *run[FITM_FORWARD_MAX_SEQS];
    int32_t n_run = 0;
    bool one_by_one = false;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        if (!runs_layer(q, l))
            continue;
        const int64_t src = q->row0 * Hkv * D;
        store[n_run] = fitm_kv_rows_of(q->kv, l, q->pos0 - q->base, f->k + src, f->v + src, q->T);
        run[n_run] = q;
        a[n_run] = attn_args(p, q, l);
        one_by_one |= fitm_position_layer(f, q->opts->position, l) ||
                      (a[n_run].capture && a[n_run].capture->add);
        n_run++;
    }
    /* The K and V rows into each cache: one job for the call's sequences where the backend
     * has it (a step's stores as one launch, not two copies per sequence; a lone sequence's
     * too, whose rows then move from step to step in the job's data, not in its arguments). */
    if (o->kv_store_many && n_run > 0)
        o->kv_store_many(b, store, n_run);
    else
        for (int32_t s = 0; s < n_run; s++)
            fitm_kv_store(run[s]->kv, l, run[s]->pos0 - run[s]->base, store[s].k, store[s].v,
                          run[s]->T);
    /* One job for all sequences needs calls that share no memory they write or build: a
     * mixture's queries, keys and weights are built in the driver's one set of scratch arrays
     * (fitm_position_mix), and Attention Buckets' passes add their captures into the same arrays
     * (capture->add), so a step with either runs its sequences one at a time. */
    if (o->attention_many && n_run > 1 && !one_by_one) {
        o->attention_many(b, a, n_run);
    } else {
        for (int32_t s = 0; s < n_run; s++) {
            fitm_attn_mix mix;
            if (fitm_position_layer(f, run[s]->opts->position, l)) {
                fitm_position_mix(p, run[s], l, &mix);
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
    fitm_backend *b = f->b;
    if (b->ops->matmul_glu && p->act[0] > 0) {
        /* the STEP rows (first in the pass) as one op, the BATCH rows as below */
        b->ops->matmul_glu(b, f->xn, p->act[0], gu, c->act);
        const int64_t r0 = p->n_step, nr = p->act[1];
        if (nr > 0) {
            const fitm_mm_out part[2] = {{gu[0].w, NULL, f->g + r0 * F},
                                         {gu[1].w, NULL, f->u + r0 * F}};
            b->ops->matmul(b, f->xn + r0 * c->n_embd, nr, part, 2, true);
            b->ops->glu(b, part[0].y, part[0].y, part[1].y, nr * F, c->act);
        }
    } else {
        matmul_paths(p, f->xn, c->n_embd, gu, 2);
        int64_t r0[2], n[2];
        for (int i = 0, runs = layer_runs(p, r0, n); i < runs; i++)
            b->ops->glu(b, f->g + r0[i] * F, f->g + r0[i] * F, f->u + r0[i] * F, n[i] * F, c->act);
    }
    const fitm_mm_out down = {&ly->w_down, NULL, f->tmp};
    matmul_paths(p, f->g, F, &down, 1);
    add_block(p, &ly->post_ffn_norm);
}

/* The log-probabilities of sequences [s, e)'s logit rows (adjacent in f->logits from
 * p->seq[s]'s first, each sequence picking n_pick ids per row) into each one's
 * opts->logprob: computed on the backend (ops->logprob) over all their rows at once, or, on
 * a backend without it, by fitm_ops_logprob of each row on the host (the row a sequence
 * downloaded into opts->logits, else a download of its own). */
static void pick_rows(const pass *p, int32_t s, int32_t e, int32_t n_pick)
{
    fitm_forward *f = p->f;
    fitm_backend *b = f->b;
    const int64_t V = fitm_model_config_of(f->m)->n_vocab, lrow0 = p->seq[s].lrow0;
    if (!b->ops->logprob) {
        for (int32_t t = s; t < e; t++) {
            const fitm_forward_opts *o = p->seq[t].opts;
            for (int64_t i = 0; i < o->n_logits; i++) {
                const float *row = o->logits ? o->logits + i * V : f->lp_row;
                if (!o->logits)
                    b->ops->download(b, f->lp_row, f->logits + (p->seq[t].lrow0 + i) * V,
                                     (size_t)V * sizeof(float));
                fitm_ops_logprob(row, V, o->pick + i * n_pick, n_pick, o->logprob + i * n_pick);
            }
        }
        return;
    }
    int64_t rows = 0;
    for (int32_t t = s; t < e; t++) {
        const fitm_forward_opts *o = p->seq[t].opts;
        memcpy(f->pick + rows * n_pick, o->pick, (size_t)(o->n_logits * n_pick) * sizeof(int32_t));
        rows += o->n_logits;
    }
    b->ops->logprob(b, f->logits + lrow0 * V, rows, V, f->pick, n_pick, f->lp);
    for (int32_t t = s; t < e; t++) {
        const fitm_forward_opts *o = p->seq[t].opts;
        memcpy(o->logprob, f->lp + (p->seq[t].lrow0 - lrow0) * n_pick,
               (size_t)(o->n_logits * n_pick) * sizeof(double));
    }
}

/* d when every sequence's logit rows (its last n_logits) are rows lrow0 + d on of the call,
 * so that the call's rows [d, d + n_logits) are all its logit rows in logit order (a decode
 * step's: every sequence one row); else -1. */
static int64_t logit_rows_shift(const pass *p)
{
    int64_t d = -1;
    bool first = true;
    for (int32_t s = 0; s < p->n_seqs; s++) {
        const seq_part *q = &p->seq[s];
        if (q->opts->n_logits == 0)
            continue;
        const int64_t at = q->row0 + q->T - q->opts->n_logits - q->lrow0;
        if (at < 0 || (!first && at != d))
            return -1;
        d = at, first = false;
    }
    return d;
}

/* Each sequence's last n_logits rows' logits into its opts->logits and/or their top entries
 * into opts->top and/or their log-probabilities at its picks into opts->logprob (selected or
 * computed by the backend, so only those leave it): the rows are gathered
 * (normed) into one block so the output head's weights are read once (always the STEP
 * products, so a row's logits do not depend on the rows beside it). */
static void output_head(const pass *p)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const int64_t C = c->n_embd, V = c->n_vocab;
    const int64_t d = logit_rows_shift(p);
    for (int32_t s = 0; s < p->n_seqs && d < 0; s++) {
        const seq_part *q = &p->seq[s];
        const int64_t nl = q->opts->n_logits;
        if (nl > 0)
            o->rmsnorm(b, f->xn + q->lrow0 * C, f->x + (q->row0 + q->T - nl) * C,
                       fitm_model_output_norm(f->m), nl, C, c->norm_eps);
    }
    if (d >= 0) /* the rows as one block: one norm (fused with the last layer's sums) */
        o->rmsnorm(b, f->xn, f->x + d * C, fitm_model_output_norm(f->m), p->n_logits, C,
                   c->norm_eps);
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
    /* Log-probabilities: the same grouping, by n_pick (the rerank passes of a step's
     * sequences in one backend call). */
    for (int32_t s = 0, e; s < p->n_seqs; s = e) {
        const int32_t k = p->seq[s].opts->n_pick;
        e = s + 1;
        if (k <= 0 || p->seq[s].opts->n_logits == 0)
            continue;
        while (e < p->n_seqs && p->seq[e].opts->n_pick == k && p->seq[e].opts->n_logits > 0)
            e++;
        pick_rows(p, s, e, k);
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
            fitm_position_bucket_add(p, &p->seq[i]);
    return FITM_OK;
}



/* A call with BUCKETS sequences: each expands to one sequence per pass of its cache (pass b
 * on pass b of kv and of its prefix, bases times factor b; pass 0 stores the captures, the
 * others add to them); the expanded list runs in groups that fit the limits, in order (so
 * pass 0 of every layer comes first). Every group is checked before any runs, and a group
 * that fails on the backend undoes them all. Then each bucket sequence's rows become log p^
 * and its captures the passes' mean (fitm_position_buckets_finish). */
static fitm_status run_buckets(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                               fitm_err *err)
{
    int32_t n = 0;
    fitm_status st = fitm_position_buckets_expand(f, seqs, n_seqs, &n, err);
    if (st != FITM_OK)
        return st;
    int32_t starts[FITM_FORWARD_MAX_SEQS * FITM_BUCKETS + 1];
    const int32_t n_groups = fitm_position_buckets_groups(f, n, starts);
    pass p;
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
    fitm_position_buckets_finish(f, seqs, n_seqs);
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
    bool mixing = false;
    fitm_status s = fitm_position_alloc(f, mo, &mixing, err);
    if (s != FITM_OK || !mixing)
        return s;
    const int32_t n_mix = f->n_mix;
    f->n_mix = 0; /* the calibration pass is a plain one */
    s = ms_poe_calibrate(f, err);
    f->n_mix = n_mix;
    return s == FITM_OK ? fitm_position_tables(f, err) : s;
}
