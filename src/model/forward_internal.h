/* forward_internal: what the forward driver (forward.c) and the position methods
 * (position.c) share: the forward's state, one call's layout, and the two small checks both
 * use. forward.c calls into position.c, never the other way. Not for other modules: they use
 * forward.h. */
#ifndef FITM_FORWARD_INTERNAL_H
#define FITM_FORWARD_INTERNAL_H

#include "model/forward.h"

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
    /* RoPE tables on the host, per table (global, local): the frequencies of the base last
     * used (fitm_ops_rope_freqs: a row's pows once per base; base NaN: none yet), and the rows
     * of the table's own base by position, each computed once and kept (rows [0, rope_n) of
     * rope_rows, room for rope_cap; grown on demand, at most max_ctx): a pass copies its
     * rows from there instead of computing sines and cosines again */
    double *rope_w[2]; /* (n_rot/2) */
    float rope_w_base[2];
    float *rope_rows[2];
    int64_t rope_n[2], rope_cap[2];
    int32_t *cap_index; /* (T)        */
    fitm_top *top;      /* (max_logits, FITM_TOP_MAX): several sequences' top-k in one call */
    int32_t *pick;      /* (max_logits, FITM_PICK_MAX) several sequences' picked ids        */
    double *lp;         /* (max_logits, FITM_PICK_MAX) their log-probabilities              */
    float *lp_row;      /* (V) a logit row, on a backend without ops->logprob               */
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

static inline float *alloc_floats(fitm_backend *b, int64_t n, bool *ok)
{
    float *p = b->ops->alloc(b, (size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p)
        *ok = false;
    return p;
}

/* Where a call's logits go: n_logits rows into logits and/or their top_k entries into top
 * and/or their log-probabilities at n_pick ids into logprob. */
static inline fitm_status check_output(const fitm_forward *f, int64_t T, const fitm_forward_opts *opts,
                                fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    if (opts->n_logits < 0 || opts->n_logits > T || opts->n_logits > f->p.max_logits ||
        (opts->n_logits > 0 && !opts->logits && opts->top_k <= 0 && opts->n_pick <= 0))
        return fitm_err_set(err, FITM_ERR_INVALID, "%lld logit rows asked for (T %lld, limit %lld)",
                            (long long)opts->n_logits, (long long)T, (long long)f->p.max_logits);
    if (opts->top_k < 0 || opts->top_k > FITM_TOP_MAX || opts->top_k > c->n_vocab ||
        (opts->top_k > 0 && opts->n_logits > 0 && !opts->top))
        return fitm_err_set(err, FITM_ERR_INVALID, "top %d of the logits asked for (limit %d)",
                            (int)opts->top_k,
                            (int)(c->n_vocab < FITM_TOP_MAX ? c->n_vocab : FITM_TOP_MAX));
    if (opts->n_pick < 0 || opts->n_pick > FITM_PICK_MAX ||
        (opts->n_pick > 0 && opts->n_logits > 0 && (!opts->pick || !opts->logprob)))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "%d log-probabilities per logit row asked for (limit %d)",
                            (int)opts->n_pick, FITM_PICK_MAX);
    for (int64_t i = 0; opts->n_pick > 0 && i < opts->n_logits * opts->n_pick; i++)
        if (opts->pick[i] < 0 || opts->pick[i] >= c->n_vocab)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "log-probability of id %d asked for (logit row %lld), not in "
                                "[0, %d)",
                                (int)opts->pick[i], (long long)(i / opts->n_pick),
                                (int)c->n_vocab);
    return FITM_OK;
}

/* ---- position.c: the position methods inside a call -------------------------------------- */

/* Whether layer l runs method m as a mixture (the other layers are plain). */
bool fitm_position_layer(const fitm_forward *f, fitm_position_method m, int32_t l);

/* The mixture of sequence q in layer l (attention_block): each expert's queries and keys
 * turned by its base change, and the weights (MoICE's routers, or Ms-PoE's one expert per
 * head). */
void fitm_position_mix(const pass *p, const seq_part *q, int32_t l, fitm_attn_mix *mix);

/* The Ms-PoE calibration pass's statistic of layer l, into the heads' ranks. */
void fitm_position_ms_poe_stats(const pass *p, int32_t l);

/* Attention Buckets: expands seqs into f->bk_seq / f->bk_role (a BUCKETS sequence becomes
 * one sequence per pass of its cache; the others stay as they are) and *n the expanded
 * count, after checking each BUCKETS sequence. */
fitm_status fitm_position_buckets_expand(fitm_forward *f, const fitm_forward_seq *seqs,
                                         int32_t n_seqs, int32_t *n, fitm_err *err);

/* Splits the n expanded sequences into groups [starts[g], starts[g + 1]) that fit one call's
 * limits, in order; returns the number of groups. */
int32_t fitm_position_buckets_groups(const fitm_forward *f, int32_t n, int32_t *starts);

/* After a call that ran bucket pass q: its logit rows into the accumulators. */
void fitm_position_bucket_add(const pass *p, const seq_part *q);

/* After every pass of the expanded seqs ran: each bucket sequence's logits and captures. */
void fitm_position_buckets_finish(fitm_forward *f, const fitm_forward_seq *seqs,
                                  int32_t n_seqs);

/* ---- position.c: creation ---------------------------------------------------------------- */

/* The position methods' scratch for moice (may be NULL); *mixing false when the backend has
 * no ops->attention_mix (nothing more to make). */
fitm_status fitm_position_alloc(fitm_forward *f, const fitm_moice *mo, bool *mixing,
                                fitm_err *err);

/* The rotation tables of MoICE's experts and of Ms-PoE's heads (after the calibration pass
 * ranked them). */
fitm_status fitm_position_tables(fitm_forward *f, fitm_err *err);

#endif
