/* rerank_attn: the attention methods (calibrated, attention, paper), in named steps:
 *   plan      the options: built-in < server (profile, config) < request; paper's are fixed
 *   groups    windows of documents, each scored as its own prompt
 *   score     one pass over a group's prompt capturing the chosen rows' attention
 *   reference the dummy passes and/or the null pass of that group
 *   calibrate A and A_ref per document (aggregate, skip_first, sinks), rel by the form,
 *             rel_scaled = rel x n_group, weight = softmax, relevance_score = sigmoid
 *   run       a state machine over the groups' plans (fitm_attention): each lane of the
 *             passes takes a contiguous block of the windows and hands out one pass at a
 *             time, whoever runs it reports it done, and nothing waits in between; the
 *             softmax and sigmoid over all K run once every lane is done
 * Attention is averaged uniformly over the (row, layer, head) triples whose layer sees the
 * whole document from that row (sliding windows); a document no triple sees gets A = 0. */
#include "pipeline/rerank_methods.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

static const char NULL_QUERY[] = "N/A";

typedef struct {
    fitm_score_opts o;   /* resolved: every option set                                  */
    fitm_rerank_method method;
    bool sink;           /* per-token capture: sink_factor > 0 with a reference         */
    bool dummy_passes, null_pass;
    uint8_t *pair;       /* (L * H) the (layer, head) pairs averaged over               */
    int32_t n_layers;    /* the passes run layers [0, n_layers): the last pair's and before */
    const int32_t *dummy;
    int64_t n_dummy;
    fitm_ids own_dummy; /* the request's dummy text's ids                           */
} plan;

/* One prompt: its ids, document spans, trailing question span and capture rows. */
typedef struct {
    fitm_ids ids;
    fitm_span *spans; /* (n) */
    fitm_span question;
    int64_t *rows;
    int32_t n_rows;
} prompt;

static void prompt_free(prompt *p)
{
    free(p->ids.v);
    free(p->spans);
    free(p->rows);
    memset(p, 0, sizeof *p);
}

/* One group's passes, planned before any of them runs: its prompt and where its pass starts
 * (the rows before are the cache's already), where each dummy pass starts on its branch, and
 * the null pass's prompt and start. score_group runs exactly these passes and group_cost
 * counts them, so the admission cost is the plan's. */
typedef struct {
    int32_t first, n;
    int32_t *order;      /* (n) the documents at the group's positions */
    prompt p;            /* the group's prompt                         */
    int64_t from;        /* its pass computes [from, T)                */
    int64_t *dummy_from; /* (n) dummy pass j computes [dummy_from[j], T); NULL: no dummy passes */
    prompt np;           /* the null pass's prompt (empty: none)       */
    int64_t null_from;   /* the null pass computes [null_from, T_null) */
} group_plan;

static void group_plan_free(group_plan *gp)
{
    free(gp->order);
    free(gp->dummy_from);
    prompt_free(&gp->p);
    prompt_free(&gp->np);
}

/* ---- plan -------------------------------------------------------------------------------- */

/* The paper's recipe: only layers, temperature and the dummy text come from the request. */
static fitm_status paper_opts(const fitm_session *r, const fitm_rerank_request *req,
                              fitm_score_opts *o, fitm_err *err)
{
    fitm_score_opts only = {0};
    fitm_score_opts_init(&only);
    only.layers = req->opt.layers;
    only.n_layers = req->opt.n_layers;
    fitm_status st = fitm_score_opts_overlay(o, &only, err);
    o->rows = FITM_ROWS_LAST;
    o->aggregate = FITM_AGG_MEAN;
    o->skip_first = 0;
    o->reference = FITM_REF_DUMMY;
    o->dummy_source = FITM_DUMMY_FIXED;
    o->form = FITM_FORM_DIFFERENCE;
    o->head_query = FITM_HEAD_QUERY;
    o->sink_factor = 0;
    o->window = 0;
    o->temperature = isnan(req->opt.temperature) ? r->paper_temperature : req->opt.temperature;
    o->score_scale = 1.0 / o->temperature;
    o->score_bias = 0;
    return st;
}

/* The (layer, head) pairs: `heads` when given, else every head of `layers` (paper without
 * layers: every layer that sees the whole context). */
static fitm_status choose_pairs(const fitm_session *r, plan *pl, fitm_rerank_meta *meta,
                                fitm_err *err)
{
    uint8_t *use = calloc((size_t)r->L, 1);
    pl->pair = calloc((size_t)r->L * (size_t)r->H, 1);
    meta->layers = calloc((size_t)r->L, sizeof *meta->layers);
    if (!use || !pl->pair || !meta->layers) {
        free(use);
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    const fitm_score_opts *o = &pl->o;
    fitm_status st = FITM_OK;
    if (o->heads) {
        for (int32_t i = 0; i < o->n_heads && st == FITM_OK; i++) {
            int32_t l = fitm_layer_index(r, o->heads[2 * i]);
            int32_t h = o->heads[2 * i + 1];
            if (l < 0 || l >= r->L || h >= r->H)
                st = fitm_err_set(err, FITM_ERR_INVALID,
                                  "'heads[%d]' = [%d, %d]: the model has %d layers of %d heads",
                                  (int)i, (int)o->heads[2 * i], (int)h, (int)r->L, (int)r->H);
            else
                use[l] = pl->pair[l * r->H + h] = 1;
        }
    } else if ((st = fitm_layers_choose(r, "layers", o->layers, o->layers ? o->n_layers : 0, use,
                                        err)) == FITM_OK) {
        for (int32_t l = 0; l < r->L; l++)
            memset(pl->pair + (size_t)l * (size_t)r->H, use[l], (size_t)r->H);
    }
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            meta->layers[meta->n_layers++] = l;
    pl->n_layers = fitm_layers_last(r, use);
    free(use);
    return st;
}

bool fitm_rerank_scores_alone(const fitm_session *r, const fitm_rerank_request *req)
{
    int32_t W = req->opt.window >= 0 ? req->opt.window : r->defaults.window;
    return req->method == FITM_RERANK_CALIBRATED && (req->n_docs == 1 || W == 1);
}

int32_t fitm_attention_windows(const fitm_session *r, const fitm_rerank_request *req)
{
    /* make_plan's window: paper has none, else the request's over the server's */
    const int32_t W = req->method == FITM_RERANK_PAPER ? 0
                      : req->opt.window >= 0           ? req->opt.window
                                                       : r->defaults.window;
    const int32_t K = req->n_docs;
    return K < 1 ? 1 : W <= 0 || W >= K ? 1 : (K + W - 1) / W; /* fitm_score_groups' G */
}

static fitm_status make_plan(const fitm_session *r, const fitm_rerank_request *req, plan *pl,
                             fitm_rerank_meta *meta, fitm_err *err)
{
    fitm_score_opts_init(&pl->o);
    pl->method = req->method;
    fitm_status st;
    if (req->method == FITM_RERANK_PAPER)
        st = paper_opts(r, req, &pl->o, err);
    else if ((st = fitm_score_opts_overlay(&pl->o, &r->defaults, err)) == FITM_OK)
        st = fitm_score_opts_overlay(&pl->o, &req->opt, err);
    if (st != FITM_OK)
        return st;
    if (req->method == FITM_RERANK_ATTENTION)
        pl->o.reference = FITM_REF_NONE;
    int32_t ref = pl->o.reference;
    pl->dummy_passes = ref == FITM_REF_DUMMY || ref == FITM_REF_BOTH;
    pl->null_pass = ref == FITM_REF_NULL_QUERY || ref == FITM_REF_NULL_SUFFIX || ref == FITM_REF_BOTH;
    pl->sink = pl->o.sink_factor > 0 && ref != FITM_REF_NONE;
    pl->dummy = r->dummy;
    pl->n_dummy = r->n_dummy;
    if (req->dummy && pl->dummy_passes) {
        fitm_rerank_doc d = {.text = req->dummy, .text_len = req->dummy_len};
        fitm_rerank_request one = {.docs = &d, .n_docs = 1, .max_tokens_per_doc = -1};
        if ((st = fitm_prompt_body(r, &one, 0, &pl->own_dummy, err)) != FITM_OK)
            return st;
        pl->dummy = pl->own_dummy.v;
        pl->n_dummy = pl->own_dummy.n;
    }
    if ((st = choose_pairs(r, pl, meta, err)) != FITM_OK)
        return st;
    meta->temperature = pl->o.temperature;
    meta->has_opts = true;
    if (req->method != FITM_RERANK_PAPER)
        snprintf(meta->profile, sizeof meta->profile, "%s", r->profile);
    return fitm_score_opts_overlay(&meta->opts, &pl->o, err);
}

/* ---- score: prompts and passes ---------------------------------------------------------- */

/* The prompt of the n documents order[0..n) with the queries q (NULL: the request's; the one
 * before the documents is "N/A" whatever q says under head_query null), and the rows the plan
 * captures in it. */
static fitm_status make_prompt(const fitm_session *r, const fitm_rerank_request *req,
                               const plan *pl, const int32_t *order, int32_t n,
                               const fitm_prompt_queries *q, prompt *p, fitm_err *err)
{
    p->spans = calloc((size_t)n, sizeof *p->spans);
    if (!p->spans)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_prompt_queries own = q ? *q
                            : (fitm_prompt_queries){req->query, req->query, req->query_len,
                                                req->query_len};
    if (pl->o.head_query == FITM_HEAD_NULL) {
        own.head = NULL_QUERY;
        own.head_len = sizeof NULL_QUERY - 1;
    }
    fitm_status st = fitm_prompt_build(r, req, NULL, order, n, &own, &p->ids, p->spans,
                                          &p->question, err);
    if (st != FITM_OK)
        return st;
    const int64_t T = p->ids.n;
    if (T > r->n_ctx)
        return fitm_prompt_too_long(T, r, req, err);
    int64_t a = T - 1, b = T;
    if (pl->o.rows == FITM_ROWS_QUESTION)
        a = p->question.start, b = p->question.end;
    else if (pl->o.rows == FITM_ROWS_SUFFIX)
        a = p->spans[n - 1].end;
    p->rows = malloc((size_t)(b - a) * sizeof *p->rows);
    if (!p->rows)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int64_t i = a; i < b; i++)
        p->rows[p->n_rows++] = i;
    return FITM_OK;
}

/* Averages one document's captured attention over the visible (row, pair) triples: the
 * summed span c of mass (n_spans spans) into out[0], or (sink) each token of span sp from
 * probs (rows of stride keys) into out[0, N). */
static void collect(const fitm_session *r, const plan *pl, const int64_t *rows, int32_t n_rows,
                    const float *mass, int32_t n_spans, int32_t c, const float *probs,
                    int64_t stride, fitm_span sp, double *out)
{
    const int64_t N = pl->sink ? sp.end - sp.start : 1;
    int64_t count = 0;
    memset(out, 0, (size_t)N * sizeof *out);
    for (int32_t i = 0; i < n_rows; i++)
        for (int32_t l = 0; l < r->L; l++) {
            if (!fitm_model_key_visible(r->m, l, rows[i], sp.start))
                continue;
            for (int32_t h = 0; h < r->H; h++) {
                if (!pl->pair[l * r->H + h])
                    continue;
                size_t at = ((size_t)i * (size_t)r->L + (size_t)l) * (size_t)r->H + (size_t)h;
                count++;
                if (!pl->sink)
                    out[0] += mass[at * (size_t)n_spans + (size_t)c];
                else
                    for (int64_t t = 0; t < N; t++)
                        out[t] += probs[at * (size_t)stride + (size_t)(sp.start + t)];
            }
        }
    for (int64_t t = 0; t < N; t++)
        out[t] = count ? out[t] / (double)count : 0.0;
}

/* One capturing pass as it is handed out to run, its capture's buffers, and where its
 * attention goes once it has run: each of the n documents with spans sp to out + off[j]
 * (collect). */
typedef struct {
    fitm_pass pass;
    fitm_capture cap;
    fitm_span *cs; /* (n) the counted part of each span */
    float *buf;    /* the capture's span masses or (sink) probabilities */
    const int64_t *rows;
    int32_t n_rows;
    const fitm_span *sp;
    int32_t n;
    const int64_t *off;
    double *out;
    int64_t T;
} attend_pass;

static void attend_free(attend_pass *ap)
{
    free(ap->cs);
    free(ap->buf);
    memset(ap, 0, sizeof *ap);
}

/* Readies one pass into ap: ids[from, T) at positions from.. on kv (a branch of prefix when
 * non-NULL), capturing rows, its attention for the n documents with spans sp going to out +
 * off[j]. kv is rebased or cut at from for it. */
static fitm_status attend_prepare(const fitm_passes *ps, const plan *pl, fitm_kv *kv,
                                  const fitm_kv *prefix, const int32_t *ids, int64_t T,
                                  int64_t from, const int64_t *rows, int32_t n_rows,
                                  const fitm_span *sp, int32_t n, const int64_t *off, double *out,
                                  attend_pass *ap, fitm_err *err)
{
    const fitm_session *r = ps->s;
    const size_t per = (size_t)n_rows * (size_t)r->L * (size_t)r->H;
    *ap = (attend_pass){.rows = rows, .n_rows = n_rows, .sp = sp, .n = n, .off = off, .out = out,
                        .T = T};
    ap->cs = malloc((size_t)n * sizeof *ap->cs);
    ap->buf = malloc(per * (size_t)(pl->sink ? T : n) * sizeof *ap->buf);
    if (!ap->cs || !ap->buf)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the attention capture");
    for (int32_t j = 0; j < n; j++) { /* the counted part of each span */
        int64_t skip = pl->o.skip_first < sp[j].end - sp[j].start ? pl->o.skip_first
                                                                  : sp[j].end - sp[j].start;
        ap->cs[j] = (fitm_span){.start = sp[j].start + skip, .end = sp[j].end};
    }
    ap->cap = (fitm_capture){.rows = rows, .n_rows = n_rows, .spans = pl->sink ? NULL : ap->cs,
                             .n_spans = pl->sink ? 0 : n, .span_mass = pl->sink ? NULL : ap->buf,
                             .probs = pl->sink ? ap->buf : NULL, .probs_stride = T};
    ap->pass = fitm_passes_pass(ps, kv, prefix, ids + from, T - from, from, &ap->cap, 0, 0, NULL,
                                NULL);
    /* A branch starts at from over prefix; a pass on its own cache from > 0 keeps the rows
     * [0, from) the cache holds (the caller checked they are this prompt's). */
    if (prefix || from == 0)
        return fitm_kv_rebase(kv, prefix ? from : 0, err);
    fitm_kv_truncate(kv, from);
    return FITM_OK;
}

/* Once ap's pass has run: each document's attention from its capture (collect). */
static void attend_collect(const fitm_session *r, const plan *pl, attend_pass *ap)
{
    for (int32_t j = 0; j < ap->n; j++)
        collect(r, pl, ap->rows, ap->n_rows, ap->buf, ap->n, j, ap->buf, ap->T, ap->sp[j],
                ap->out + ap->off[j]);
    attend_free(ap);
}

/* ---- reference --------------------------------------------------------------------------- */

/* The N ids that stand in for document order[j] in its dummy pass: the dummy text repeated,
 * or (dummy_source documents) the request's other documents' bodies, cycling from the next
 * one, cut to N; the fixed dummy when there is no other document. */
static fitm_status fill_dummy(const fitm_session *r, const fitm_rerank_request *req,
                              const plan *pl, int32_t k, int64_t N, int32_t *out, fitm_err *err)
{
    int64_t got = 0;
    if (pl->o.dummy_source == FITM_DUMMY_DOCUMENTS && req->n_docs > 1) {
        fitm_ids body = {0};
        /* empty: consecutive bodies without tokens; a whole cycle of them ends the loop */
        for (int32_t i = 1, empty = 0; got < N && empty < req->n_docs - 1;
             i = i % (req->n_docs - 1) + 1) {
            body.n = 0;
            fitm_status st = fitm_prompt_body(r, req, (k + i) % req->n_docs, &body, err);
            if (st != FITM_OK) {
                free(body.v);
                return st;
            }
            empty = body.n ? 0 : empty + 1;
            int64_t take = body.n < N - got ? body.n : N - got;
            memcpy(out + got, body.v, (size_t)take * sizeof *out);
            got += take;
        }
        free(body.v);
    }
    for (; got < N; got++)
        out[got] = pl->dummy[got % pl->n_dummy];
    return FITM_OK;
}

/* The null pass's queries: "N/A" in both places (null_query) or in the trailing question
 * only (null_suffix). */
static fitm_prompt_queries null_queries(const fitm_rerank_request *req, const plan *pl)
{
    const bool suffix = pl->o.reference == FITM_REF_NULL_SUFFIX;
    const size_t nl = sizeof NULL_QUERY - 1;
    return (fitm_prompt_queries){suffix ? req->query : NULL_QUERY, NULL_QUERY,
                             suffix ? req->query_len : nl, nl};
}

/* ---- calibrate --------------------------------------------------------------------------- */

typedef struct {
    double *A, *A_ref, *rel, *scaled; /* (K) each, request order */
    int32_t *position;                /* (K) place in its group's prompt */
    int64_t forward, T_max;
    double tok_ms;
} scores;

/* A, A_ref, rel and rel_scaled of the group's documents first .. first + n - 1. */
static void calibrate(const plan *pl, const fitm_span *spans, int32_t first, int32_t n,
                      const int64_t *off, const double *a, const double *a_ref, scores *sc)
{
    const fitm_score_opts *o = &pl->o;
    for (int32_t j = 0; j < n; j++) {
        int64_t N = spans[j].end - spans[j].start;
        double A, Ar;
        if (pl->sink) {
            fitm_score_reduce(a + off[j], a_ref + off[j], N, o->skip_first, o->sink_factor,
                              o->aggregate, &A, &Ar);
        } else {
            int64_t counted = N > o->skip_first ? N - o->skip_first : 0;
            double div = o->aggregate == FITM_AGG_MEAN ? (double)counted : 1.0;
            A = div > 0 ? a[off[j]] / div : 0.0;
            Ar = div > 0 && a_ref ? a_ref[off[j]] / div : 0.0;
        }
        int32_t k = first + j;
        sc->A[k] = A;
        sc->A_ref[k] = Ar;
        sc->rel[k] = fitm_score_rel(o->form, A, Ar);
        sc->scaled[k] = pl->method == FITM_RERANK_PAPER ? sc->rel[k] : sc->rel[k] * (double)n;
        sc->position[k] = j;
    }
}

/* Keeps the group's prompt for return_tokens. */
static void keep_tokens(prompt *p, int32_t first, int32_t n, fitm_rerank_tokens *tok)
{
    tok->first_doc = first;
    tok->n_docs = n;
    tok->ids = p->ids.v;
    tok->n_ids = p->ids.n;
    tok->spans = p->spans;
    tok->question = p->question;
    p->ids.v = NULL;
    p->spans = NULL;
}

/* Where the pass over p (n documents) starts: after the leading ids it shares with `held`, the
 * ids whose rows the cache holds (0 without prefix_reuse), short of the last document's end
 * (every captured row lies after it, so the pass computes them all). `held` becomes p's ids:
 * the cache holds them once the pass has run, and a failed pass ends the request. */
static fitm_status continue_from(bool reuse, fitm_ids *held, const prompt *p, int32_t n,
                                 int64_t *from, fitm_err *err)
{
    const int64_t lim = reuse ? p->spans[n - 1].end : 0;
    int64_t c = 0;
    while (c < lim && c < held->n && held->v[c] == p->ids.v[c])
        c++;
    *from = c;
    held->n = 0;
    fitm_status st = fitm_ids_reserve(held, p->ids.n, err);
    if (st == FITM_OK) {
        memcpy(held->v, p->ids.v, (size_t)p->ids.n * sizeof *p->ids.v);
        held->n = p->ids.n;
    }
    return st;
}

/* The plan of the group of the documents first .. first + n - 1 (see group_plan); held: the
 * ids the prompt cache holds before it, which become its prompt's (continue_from). */
static fitm_status plan_group(const fitm_session *r, const fitm_rerank_request *req,
                              const plan *pl, int32_t first, int32_t n, fitm_ids *held,
                              group_plan *gp, fitm_err *err)
{
    *gp = (group_plan){.first = first, .n = n};
    gp->order = malloc((size_t)n * sizeof *gp->order);
    gp->dummy_from = pl->dummy_passes ? malloc((size_t)n * sizeof *gp->dummy_from) : NULL;
    if (!gp->order || (pl->dummy_passes && !gp->dummy_from))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t j = 0; j < n; j++)
        gp->order[j] = first + j;
    fitm_status st = make_prompt(r, req, pl, gp->order, n, NULL, &gp->p, err);
    /* The groups' prompts share their head (the template, the instruction and the question
     * before the documents): a later group continues the cache from there. */
    if (st == FITM_OK)
        st = continue_from(req->prefix_reuse, held, &gp->p, n, &gp->from, err);
    for (int32_t j = 0; st == FITM_OK && pl->dummy_passes && j < n; j++)
        gp->dummy_from[j] = req->prefix_reuse ? gp->p.spans[j].start : 0;
    if (st != FITM_OK || !pl->null_pass)
        return st;
    fitm_prompt_queries q = null_queries(req, pl);
    if ((st = make_prompt(r, req, pl, gp->order, n, &q, &gp->np, err)) != FITM_OK)
        return st;
    const bool suffix = pl->o.reference == FITM_REF_NULL_SUFFIX;
    gp->null_from = suffix && req->prefix_reuse ? gp->p.spans[n - 1].end : 0;
    if (gp->null_from > 0 &&
        memcmp(gp->np.ids.v, gp->p.ids.v, (size_t)gp->null_from * sizeof *gp->np.ids.v) != 0)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "null_suffix: the prompts differ before the "
                                                    "end of the documents");
    return FITM_OK;
}

/* The forward tokens of the group's planned passes. */
static int64_t group_tokens(const plan *pl, const group_plan *gp)
{
    const int64_t T = gp->p.ids.n;
    int64_t sum = T - gp->from;
    for (int32_t j = 0; pl->dummy_passes && j < gp->n; j++)
        sum += T - gp->dummy_from[j];
    if (pl->null_pass)
        sum += gp->np.ids.n - gp->null_from;
    return sum;
}

/* ---- the method -------------------------------------------------------------------------- */

/* weight, relevance_score and the sorted results. */
static fitm_status finish(const plan *pl, const scores *sc, int32_t K, fitm_rerank_result *res,
                          fitm_err *err)
{
    double *w = malloc((size_t)K * sizeof *w);
    res->results = calloc((size_t)K, sizeof *res->results);
    if (!w || !res->results) {
        free(w);
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    res->n_results = K;
    fitm_score_softmax(sc->scaled, K, pl->o.temperature, w);
    bool ref = pl->o.reference != FITM_REF_NONE;
    for (int32_t k = 0; k < K; k++) {
        double score = pl->method == FITM_RERANK_PAPER       ? w[k]
                       : pl->method == FITM_RERANK_ATTENTION ? sc->A[k]
                                                             : fitm_score_sigmoid(sc->scaled[k],
                                                                                  pl->o.score_scale,
                                                                                  pl->o.score_bias);
        res->results[k] = (fitm_rerank_doc_result){
            .index = k, .position = sc->position[k], .attention = sc->A[k],
            .dummy_attention = ref ? sc->A_ref[k] : 0.0,
            .calibrated_attention = ref ? sc->rel[k] : 0.0, .weight = w[k],
            .relevance_score = score,
            .raw_score = pl->method == FITM_RERANK_PAPER || pl->method == FITM_RERANK_ATTENTION
                             ? score
                             : pl->o.score_scale * sc->scaled[k] + pl->o.score_bias};
    }
    free(w);
    fitm_results_sort(res->results, K);
    return FITM_OK;
}

/* ---- the run: a state machine over the windows' plans, lane by lane --------------------- */

/* A lane's part of the run: its share of the windows (fitm_passes_share: a contiguous block),
 * the window it is at, the pass of that window's plan it is at, and what that window's
 * passes so far captured; its caches, and the ids its prompt cache holds (a lane's first
 * window computes its prompt from row 0, a later one continues the lane's last). */
typedef struct {
    fitm_kv *kv, *branch;
    int32_t g, g_end; /* the window running, and the end of the lane's share */
    /* window g's next pass: -1 before its plan, 0 its main pass, 1 .. n its dummy passes,
     * n + 1 its null pass, n + 2 its calibration */
    int32_t step;
    group_plan gp;    /* window g's plan */
    int64_t *off;     /* (n + 1) where each document's attention lies in att */
    double *att;      /* the window's attention at off[j], its reference's at off[n] + off[j] */
    double *nul;      /* the null pass's reference: its own array beside dummy passes */
    int32_t *ref;     /* (T) a dummy pass's prompt */
    int32_t dummy_at; /* where the next dummy pass's tokens go in the window's dummy_tokens */
    attend_pass cur;  /* the pass handed out */
    fitm_ids held;    /* the ids the lane's prompt cache holds (its last window's prompt) */
    bool drained;     /* its share is done */
} lane;

/* The method's run between two passes: what the lanes share (the plan, the windows, the
 * scores of every document so far, the result) and each lane's part. Its owner runs each
 * pass that fitm_attention_next hands out for a lane (here, or in the engine's batch steps)
 * and reports it done with fitm_attention_ran. A window's calibration reads only its own
 * passes' captures, so the lanes' order of work does not change a score. */
struct fitm_attention {
    fitm_passes *ps;
    const fitm_rerank_request *req;
    fitm_rerank_result *res;
    double t0; /* when the run started */
    plan pl;
    scores sc;
    int32_t *starts; /* (K + 1) the windows' first documents */
    double *buf;     /* sc's arrays */
    int32_t G;       /* the windows */
    int32_t n_lanes, n_drained;
    lane *lanes;   /* (n_lanes) */
    bool finished; /* the result is made */
};

/* Where lane ln's window g's prompts go for return_tokens (NULL: not asked for). */
static fitm_rerank_tokens *window_tokens(const fitm_attention *a, const lane *ln)
{
    return a->res->groups ? &a->res->groups[ln->g] : NULL;
}

/* Releases what lane ln's window holds; its next window starts with its plan. */
static void window_free(const fitm_attention *a, lane *ln)
{
    group_plan_free(&ln->gp);
    memset(&ln->gp, 0, sizeof ln->gp);
    if (a->pl.dummy_passes && a->pl.null_pass)
        free(ln->nul);
    free(ln->off);
    free(ln->att);
    free(ln->ref);
    attend_free(&ln->cur);
    ln->off = NULL;
    ln->att = ln->nul = NULL;
    ln->ref = NULL;
    ln->step = -1;
}

/* Room for the dummy passes' prompt and (return_tokens) their dummy tokens. */
static fitm_status dummy_begin(const fitm_attention *a, lane *ln, fitm_err *err)
{
    const prompt *p = &ln->gp.p;
    fitm_rerank_tokens *tok = window_tokens(a, ln);
    int64_t total = 0;
    for (int32_t j = 0; j < ln->gp.n; j++)
        total += p->spans[j].end - p->spans[j].start;
    ln->ref = malloc((size_t)p->ids.n * sizeof *ln->ref);
    ln->dummy_at = 0;
    if (tok) {
        tok->dummy_tokens = malloc((size_t)(total > 0 ? total : 1) * sizeof(int32_t));
        tok->dummy_offsets = calloc((size_t)ln->gp.n, sizeof(int64_t));
    }
    if (!ln->ref || (tok && (!tok->dummy_tokens || !tok->dummy_offsets)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    return FITM_OK;
}

/* Lane ln's window g's plan (its tokenizing timed apart), and room for what its passes
 * capture. */
static fitm_status window_begin(fitm_attention *a, lane *ln, fitm_err *err)
{
    const plan *pl = &a->pl;
    scores *sc = &a->sc;
    const int32_t first = a->starts[ln->g], n = a->starts[ln->g + 1] - first;
    ln->off = malloc((size_t)(n + 1) * sizeof *ln->off);
    ln->step = 0;
    const double t0 = fitm_clock_ms();
    fitm_status st = ln->off ? plan_group(a->ps->s, a->req, pl, first, n, &ln->held, &ln->gp, err)
                             : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    sc->tok_ms += fitm_clock_ms() - t0;
    if (st != FITM_OK)
        return st;
    const prompt *p = &ln->gp.p;
    sc->forward += group_tokens(pl, &ln->gp);
    sc->T_max = p->ids.n > sc->T_max ? p->ids.n : sc->T_max;
    ln->off[0] = 0;
    for (int32_t j = 0; j < n; j++)
        ln->off[j + 1] = ln->off[j] + (pl->sink ? p->spans[j].end - p->spans[j].start : 1);
    const int64_t len = ln->off[n];
    if (!(ln->att = calloc((size_t)len * 2 + 1, sizeof *ln->att)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    ln->nul =
        pl->dummy_passes && pl->null_pass ? malloc((size_t)len * sizeof *ln->nul) : ln->att + len;
    if (!ln->nul)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    return pl->dummy_passes ? dummy_begin(a, ln, err) : FITM_OK;
}

/* Dummy pass j, the paper's reference: the prompt with document j's body replaced by a
 * length-matched dummy, on a branch of the lane's prompt cache from the start the plan gives
 * (s_j with prefix_reuse) or whole. */
static fitm_status dummy_pass(fitm_attention *a, lane *ln, int32_t j, fitm_err *err)
{
    const prompt *p = &ln->gp.p;
    const int64_t T = p->ids.n, s = p->spans[j].start, e = p->spans[j].end;
    fitm_rerank_tokens *tok = window_tokens(a, ln);
    memcpy(ln->ref, p->ids.v, (size_t)T * sizeof *ln->ref);
    fitm_status st = fill_dummy(a->ps->s, a->req, &a->pl, ln->gp.order[j], e - s, ln->ref + s, err);
    if (st != FITM_OK)
        return st;
    if (tok) {
        tok->dummy_offsets[j] = ln->dummy_at;
        memcpy(tok->dummy_tokens + ln->dummy_at, ln->ref + s, (size_t)(e - s) * sizeof *ln->ref);
        ln->dummy_at += (int32_t)(e - s);
    }
    const int64_t from = ln->gp.dummy_from[j];
    return attend_prepare(a->ps, &a->pl, ln->branch, from > 0 ? ln->kv : NULL, ln->ref, T, from,
                          p->rows, p->n_rows, &p->spans[j], 1, ln->off + j,
                          ln->att + ln->off[ln->gp.n], &ln->cur, err);
}

/* Readies the pass of lane ln's window's plan at `step` (see lane): the main pass over its
 * prompt, a dummy pass, or the content-free query's reference, the plan's null prompt (the
 * query replaced by "N/A" in both places, null_query, a whole pass; or in the trailing
 * question only, null_suffix, on a branch of the prompt's cache from the end of the documents
 * when prefix_reuse). */
static fitm_status prepare_pass(fitm_attention *a, lane *ln, fitm_err *err)
{
    const group_plan *gp = &ln->gp;
    const int32_t n = gp->n;
    if (ln->step == 0)
        return attend_prepare(a->ps, &a->pl, ln->kv, NULL, gp->p.ids.v, gp->p.ids.n, gp->from,
                              gp->p.rows, gp->p.n_rows, gp->p.spans, n, ln->off, ln->att, &ln->cur,
                              err);
    if (ln->step <= n)
        return dummy_pass(a, ln, ln->step - 1, err);
    const prompt *np = &gp->np;
    const int64_t from = gp->null_from;
    return attend_prepare(a->ps, &a->pl, ln->branch, from > 0 ? ln->kv : NULL, np->ids.v, np->ids.n,
                          from, np->rows, np->n_rows, np->spans, n, ln->off, ln->nul, &ln->cur,
                          err);
}

/* Whether a window's plan (n documents) has a pass at `step`. */
static bool pass_planned(const plan *pl, int32_t step, int32_t n)
{
    return step == 0 || (step <= n && pl->dummy_passes) || (step == n + 1 && pl->null_pass);
}

/* Lane ln's window's passes have all run: the reference (the dummy passes', the null pass's,
 * or both's mean), calibrate, the prompts kept for return_tokens; on to its next window. */
static void window_end(fitm_attention *a, lane *ln)
{
    const plan *pl = &a->pl;
    group_plan *gp = &ln->gp;
    const int32_t n = gp->n;
    const int64_t len = ln->off[n];
    double *refs = ln->att + len;
    fitm_rerank_tokens *tok = window_tokens(a, ln);
    if (pl->dummy_passes && pl->null_pass)
        for (int64_t i = 0; i < len; i++)
            refs[i] = 0.5 * (refs[i] + ln->nul[i]);
    const bool has_ref = pl->o.reference != FITM_REF_NONE;
    calibrate(pl, gp->p.spans, gp->first, n, ln->off, ln->att, has_ref ? refs : NULL, &a->sc);
    if (tok && pl->null_pass) {
        tok->null_ids = gp->np.ids.v;
        tok->n_null_ids = gp->np.ids.n;
        tok->null_spans = gp->np.spans;
        tok->null_question = gp->np.question;
        gp->np.ids.v = NULL;
        gp->np.spans = NULL;
    }
    if (tok)
        keep_tokens(&gp->p, gp->first, n, tok);
    window_free(a, ln);
    ln->g++;
}

/* The lanes, each with its share of the G windows and its caches. */
static fitm_status lanes_start(fitm_attention *a, fitm_err *err)
{
    const fitm_passes *ps = a->ps;
    a->n_lanes = ps->n_lanes;
    if (!(a->lanes = calloc((size_t)a->n_lanes, sizeof *a->lanes)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < a->n_lanes; l++) {
        lane *ln = &a->lanes[l];
        fitm_passes_share(a->G, a->n_lanes, l, &ln->g, &ln->g_end);
        ln->kv = ps->kv[l];
        ln->branch = ps->branch[l];
        ln->step = -1;
    }
    return FITM_OK;
}

fitm_status fitm_attention_start(fitm_passes *ps, const fitm_rerank_request *req,
                                 fitm_rerank_result *res, fitm_attention **out, fitm_err *err)
{
    fitm_attention *a = calloc(1, sizeof *a);
    *out = a;
    if (!a)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const int32_t K = req->n_docs;
    *a = (fitm_attention){.ps = ps, .req = req, .res = res, .t0 = fitm_clock_ms()};
    a->starts = malloc((size_t)(K + 1) * sizeof *a->starts);
    a->buf = calloc((size_t)K * 4, sizeof *a->buf);
    a->sc.position = calloc((size_t)K, sizeof *a->sc.position);
    fitm_status st = a->starts && a->buf && a->sc.position
                         ? make_plan(ps->s, req, &a->pl, &res->meta, err)
                         : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (st != FITM_OK)
        return st;
    double *buf = a->buf;
    a->sc = (scores){.A = buf, .A_ref = buf + K, .rel = buf + 2 * K, .scaled = buf + 3 * K,
                     .position = a->sc.position};
    a->G = fitm_score_groups(K, a->pl.o.window, a->starts);
    ps->n_layers = ps->all_layers ? 0 : a->pl.n_layers; /* no pass reads a later layer */
    res->meta.n_groups = a->G;
    if (req->return_tokens && !(res->groups = calloc((size_t)a->G, sizeof *res->groups)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    res->n_groups = res->groups ? a->G : 0;
    return lanes_start(a, err);
}

fitm_status fitm_attention_next(fitm_attention *a, int32_t lane_no, const fitm_pass **pass,
                                fitm_err *err)
{
    lane *ln = &a->lanes[lane_no];
    *pass = NULL;
    fitm_status st = FITM_OK;
    while (st == FITM_OK && ln->g < ln->g_end) {
        const int32_t n = ln->gp.n;
        if (ln->step < 0) {
            st = window_begin(a, ln, err);
        } else if (ln->step > n + 1) {
            window_end(a, ln);
        } else if (pass_planned(&a->pl, ln->step, n)) {
            st = prepare_pass(a, ln, err);
            *pass = st == FITM_OK ? &ln->cur.pass : NULL;
            return st;
        } else {
            ln->step++;
        }
    }
    if (st == FITM_OK && !ln->drained) {
        ln->drained = true;
        a->n_drained++;
    }
    /* softmax weights and sigmoid read every document's scores: once every lane is done */
    if (st == FITM_OK && a->n_drained == a->n_lanes && !a->finished) {
        a->finished = true;
        st = finish(&a->pl, &a->sc, a->req->n_docs, a->res, err);
    }
    return st;
}

void fitm_attention_ran(fitm_attention *a, int32_t lane_no)
{
    lane *ln = &a->lanes[lane_no];
    attend_collect(a->ps->s, &a->pl, &ln->cur);
    ln->step++;
}

fitm_status fitm_attention_end(fitm_attention *a, fitm_status st)
{
    if (!a)
        return st;
    fitm_rerank_result *res = a->res;
    a->ps->n_layers = 0;
    res->usage = (fitm_rerank_usage){.prompt_tokens = a->sc.T_max,
                                     .forward_tokens = a->sc.forward,
                                     .total_tokens = a->sc.T_max};
    res->meta.tokenize_ms = a->sc.tok_ms;
    res->meta.forward_ms = fitm_clock_ms() - a->t0 - a->sc.tok_ms;
    for (int32_t l = 0; a->lanes && l < a->n_lanes; l++) {
        window_free(a, &a->lanes[l]);
        free(a->lanes[l].held.v);
    }
    free(a->lanes);
    fitm_score_opts_free(&a->pl.o);
    free(a->pl.pair);
    free(a->pl.own_dummy.v);
    free(a->starts);
    free(a->buf);
    free(a->sc.position);
    free(a);
    return st;
}

static fitm_status machine_next(void *a, int32_t lane_no, const fitm_pass **pass, fitm_err *err)
{
    return fitm_attention_next(a, lane_no, pass, err);
}

static void machine_ran(void *a, int32_t lane_no)
{
    fitm_attention_ran(a, lane_no);
}

static fitm_status machine_end(void *a, fitm_status st)
{
    return fitm_attention_end(a, st);
}

fitm_status fitm_attention_machine(fitm_passes *ps, const fitm_rerank_request *req,
                                   fitm_rerank_result *res, fitm_machine *m, fitm_err *err)
{
    fitm_attention *a = NULL;
    fitm_status st = fitm_attention_start(ps, req, res, &a, err);
    *m = (fitm_machine){.run = a, .next = machine_next, .ran = machine_ran, .end = machine_end};
    return st;
}

fitm_status fitm_attention_run(fitm_passes *ps, const fitm_rerank_request *req,
                               fitm_rerank_result *res, fitm_err *err)
{
    fitm_machine m;
    fitm_status st = fitm_attention_machine(ps, req, res, &m, err);
    return fitm_machine_run(ps, &m, st, err);
}

/* ---- cost -------------------------------------------------------------------------------- */

/* Releases what make_plan put in a meta the cost does not keep. */
static void meta_free(fitm_rerank_meta *meta)
{
    free(meta->layers);
    fitm_score_opts_free(&meta->opts);
}

/* One group's forward tokens: its plan's passes, as score_group runs them. */
static fitm_status group_cost(const fitm_session *r, const fitm_rerank_request *req,
                              const plan *pl, int32_t first, int32_t n, fitm_ids *held,
                              int64_t *sum, fitm_err *err)
{
    group_plan gp = {0};
    fitm_status st = plan_group(r, req, pl, first, n, held, &gp, err);
    if (st == FITM_OK)
        *sum += group_tokens(pl, &gp);
    group_plan_free(&gp);
    return st;
}

fitm_status fitm_attention_cost(const fitm_session *r, const fitm_rerank_request *req,
                                bool any_order, int32_t n_lanes, int64_t *tokens, fitm_err *err)
{
    const int32_t K = req->n_docs;
    plan pl = {0};
    fitm_rerank_meta scratch = {0}; /* make_plan's meta, not kept */
    fitm_score_opts_init(&scratch.opts);
    int32_t *starts = malloc((size_t)(K + 1) * sizeof *starts);
    fitm_status st = starts ? make_plan(r, req, &pl, &scratch, err)
                            : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    int64_t sum = 0;
    int32_t G = st == FITM_OK ? fitm_score_groups(K, pl.o.window, starts) : 0;
    if (st == FITM_OK && !any_order) {
        /* lane by lane as the run's lanes take the windows: each lane's first window computes
         * its prompt from row 0, a later one continues the lane's last (held) */
        fitm_ids held = {0};
        for (int32_t l = 0; st == FITM_OK && l < n_lanes; l++) {
            int32_t lo, hi;
            fitm_passes_share(G, n_lanes, l, &lo, &hi);
            held.n = 0;
            for (int32_t g = lo; st == FITM_OK && g < hi; g++)
                st =
                    group_cost(r, req, &pl, starts[g], starts[g + 1] - starts[g], &held, &sum, err);
        }
        free(held.v);
    } else if (st == FITM_OK) {
        /* Whatever the lanes, every group's prompt is at most frame + its documents' part; the
         * parts add up to at most docs; a dummy pass is at most its group's prompt. */
        int32_t n_max = 0;
        for (int32_t g = 0; g < G; g++)
            n_max = starts[g + 1] - starts[g] > n_max ? starts[g + 1] - starts[g] : n_max;
        int64_t frame = 0, docs = 0;
        st = fitm_prompt_bound(r, req, NULL, NULL, starts, G, &frame, &docs, err);
        int64_t passes = G * frame + docs;
        sum = passes + (pl.dummy_passes ? n_max * passes : 0);
        if (st == FITM_OK && pl.null_pass) {
            fitm_prompt_queries q = null_queries(req, &pl);
            st = fitm_prompt_bound(r, req, NULL, &q, starts, G, &frame, &docs, err);
            sum += G * frame + docs;
        }
    }
    *tokens = sum;
    meta_free(&scratch);
    fitm_score_opts_free(&pl.o);
    free(pl.pair);
    free(pl.own_dummy.v);
    free(starts);
    return st;
}

/* The most rows of a window's prompt over the documents [first, first + n) with the queries q
 * (NULL: the request's), in any order within the window: the frame and those documents. */
static fitm_status window_rows(const fitm_session *r, const fitm_rerank_request *req,
                               const fitm_prompt_queries *q, int32_t first, int32_t n,
                               int64_t *rows, fitm_err *err)
{
    fitm_rerank_request sub = *req;
    sub.docs = req->docs + first;
    sub.n_docs = n;
    const int32_t starts[2] = {0, n};
    int64_t frame = 0, docs = 0;
    fitm_status st = fitm_prompt_bound(r, &sub, NULL, q, starts, 1, &frame, &docs, err);
    *rows = frame + docs;
    return st;
}

fitm_status fitm_attention_rows(const fitm_session *r, const fitm_rerank_request *req,
                                int64_t *rows, fitm_err *err)
{
    plan pl = {0};
    fitm_rerank_meta scratch = {0}; /* make_plan's meta, not kept */
    fitm_score_opts_init(&scratch.opts);
    const int32_t K = req->n_docs;
    int32_t *starts = malloc((size_t)(K + 1) * sizeof *starts);
    fitm_status st = starts ? make_plan(r, req, &pl, &scratch, err)
                            : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const int32_t G = st == FITM_OK ? fitm_score_groups(K, pl.o.window, starts) : 0;
    const fitm_prompt_queries nq = null_queries(req, &pl);
    int64_t most = 0;
    /* the main and dummy passes' prompts, then the null pass's; each lane's caches hold one
     * window's at a time, so the largest window's bound, not all K documents' */
    for (int pass = 0; st == FITM_OK && pass < (pl.null_pass ? 2 : 1); pass++) {
        const fitm_prompt_queries *q = pass ? &nq : NULL;
        int64_t all = 0, w = 0;
        /* every document first: one the run would refuse fails here as it would there */
        st = window_rows(r, req, q, 0, K, &all, err);
        most = G == 1 && all > most ? all : most;
        for (int32_t g = 0; st == FITM_OK && G > 1 && g < G; g++) {
            st = window_rows(r, req, q, starts[g], starts[g + 1] - starts[g], &w, err);
            most = w > most ? w : most;
        }
    }
    *rows = most < r->n_ctx ? most : r->n_ctx;
    meta_free(&scratch);
    fitm_score_opts_free(&pl.o);
    free(pl.pair);
    free(pl.own_dummy.v);
    free(starts);
    return st;
}
