/* rerank_sort: method attention_sort (Peysakhovich & Lerer): score every document by the
 * attention mass the last prompt token puts on it, move the most attended documents last
 * (next to the question), and rerun; the last of SORT_PASSES passes scores. Each pass is a
 * whole prompt on the prompt cache. */
#include "pipeline/rerank_methods.h"

#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "model/model.h"

/* Passes of attention_sort (sort and rerun; the last pass scores). */
#define SORT_PASSES 3

/* A[k]: mean over the span's visible chosen layers and all heads of (span mass / N_k). */
static void doc_attention(const fitm_session *r, const float *mass, int32_t n_spans, int32_t k,
                          int64_t span_start, int64_t N, const uint8_t *use, int64_t last,
                          double *out)
{
    double sum = 0;
    int64_t count = 0;
    for (int32_t l = 0; l < r->L; l++) {
        if (!use[l] || !fitm_model_key_visible(r->m, l, last, span_start))
            continue;
        for (int32_t h = 0; h < r->H; h++)
            sum += mass[((int64_t)l * r->H + h) * n_spans + k];
        count += r->H;
    }
    *out = count && N > 0 ? sum / (double)count / (double)N : 0.0;
}

/* The layers to average over (fitm_layers_choose of the request's), listed into meta. */
static fitm_status choose_layers(const fitm_session *r, const fitm_rerank_request *req,
                                 uint8_t *use, fitm_rerank_meta *meta, fitm_err *err)
{
    fitm_status st = fitm_layers_choose(r, "layers", req->opt.layers,
                                        req->opt.layers ? req->opt.n_layers : 0, use, err);
    if (st != FITM_OK)
        return st;
    meta->layers = calloc((size_t)(uint32_t)r->L, sizeof *meta->layers);
    if (!meta->layers)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            meta->layers[meta->n_layers++] = l;
    return FITM_OK;
}

/* The next pass's order: positions stably sorted by mass M, ascending (the most attended go
 * last, next to the question); next is (K) scratch. */
static void reorder_by_mass(int32_t *order, int32_t *next, const double *M, int32_t K)
{
    for (int32_t p = 0; p < K; p++)
        next[p] = p;
    for (int32_t i = 1; i < K; i++)
        for (int32_t j = i; j > 0 && M[next[j - 1]] > M[next[j]]; j--) {
            int32_t t = next[j];
            next[j] = next[j - 1];
            next[j - 1] = t;
        }
    for (int32_t p = 0; p < K; p++)
        next[p] = order[next[p]];
    memcpy(order, next, (size_t)K * sizeof *order);
}

/* One attention_sort run's buffers: the prompt's ids and spans, the layers read, the order of
 * the documents, their attention A and mass M by position, the captured mass. */
typedef struct {
    fitm_ids ids;
    fitm_span *spans;      /* (K) */
    uint8_t *use;          /* (L) */
    int32_t *order, *next; /* (K) each */
    double *A, *M;         /* (K) each */
    float *mass;           /* (L, H, K) the last row's mass per span */
    int64_t T, forward;
    double tok_ms;
} sort_run;

static void sort_run_free(sort_run *sr)
{
    free(sr->ids.v);
    free(sr->spans);
    free(sr->use);
    free(sr->order);
    free(sr->next);
    free(sr->A);
    free(sr->mass);
}

static fitm_status sort_run_alloc(const fitm_session *r, int32_t K, sort_run *sr, fitm_err *err)
{
    sr->spans = calloc((size_t)K, sizeof *sr->spans);
    sr->use = malloc((size_t)(uint32_t)r->L);
    sr->order = malloc((size_t)K * sizeof *sr->order);
    sr->next = malloc((size_t)K * sizeof *sr->next);
    sr->A = calloc((size_t)K * 2, sizeof *sr->A);
    sr->M = sr->A ? sr->A + K : NULL;
    sr->mass =
        malloc((size_t)(uint32_t)r->L * (size_t)(uint32_t)r->H * (size_t)K * sizeof *sr->mass);
    if (!sr->spans || !sr->use || !sr->order || !sr->next || !sr->A || !sr->mass)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %d documents", (int)K);
    for (int32_t k = 0; k < K; k++)
        sr->order[k] = k;
    return FITM_OK;
}

/* One pass over the documents in sr->order: the prompt, its capture of the last row, and
 * each position's attention A and mass M. */
static fitm_status sort_pass(fitm_passes *ps, const fitm_rerank_request *req, sort_run *sr,
                             fitm_err *err)
{
    const fitm_session *r = ps->s;
    const int32_t K = req->n_docs;
    double tt = fitm_clock_ms();
    sr->ids.n = 0;
    fitm_status st =
        fitm_prompt_build(r, req, NULL, sr->order, K, NULL, &sr->ids, sr->spans, NULL, err);
    sr->tok_ms += fitm_clock_ms() - tt;
    if (st != FITM_OK)
        return st;
    sr->T = sr->ids.n;
    if (sr->T > r->n_ctx)
        return fitm_prompt_too_long(sr->T, r, req, err);
    const int64_t last = sr->T - 1;
    fitm_capture cap = {
        .rows = &last, .n_rows = 1, .spans = sr->spans, .n_spans = K, .span_mass = sr->mass};
    if ((st = fitm_kv_rebase(ps->kv[0], 0, err)) != FITM_OK ||
        (st = fitm_passes_run(ps, ps->kv[0], NULL, sr->ids.v, sr->T, 0, &cap, err)) != FITM_OK)
        return st;
    sr->forward += sr->T;
    for (int32_t p = 0; p < K; p++) {
        int64_t N = sr->spans[p].end - sr->spans[p].start;
        doc_attention(r, sr->mass, K, p, sr->spans[p].start, N, sr->use, last, &sr->A[p]);
        sr->M[p] = sr->A[p] * (double)N;
    }
    return FITM_OK;
}

/* The last pass's scores (mass), sorted. */
static fitm_status sort_results(const sort_run *sr, int32_t K, fitm_rerank_result *res,
                                fitm_err *err)
{
    res->results = calloc((size_t)K, sizeof *res->results);
    if (!res->results)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    res->n_results = K;
    for (int32_t p = 0; p < K; p++)
        res->results[p] = (fitm_rerank_doc_result){.index = sr->order[p],
                                                   .position = p,
                                                   .attention = sr->A[p],
                                                   .relevance_score = sr->M[p],
                                                   .raw_score = sr->M[p]};
    fitm_results_sort(res->results, K);
    return FITM_OK;
}

fitm_status fitm_attention_sort_run(fitm_passes *ps, const fitm_rerank_request *req,
                                    fitm_rerank_result *res, fitm_err *err)
{
    const fitm_session *r = ps->s;
    const double t0 = fitm_clock_ms();
    const int32_t K = req->n_docs;
    sort_run sr = {0};
    fitm_status st = sort_run_alloc(r, K, &sr, err);
    if (st == FITM_OK && (st = choose_layers(r, req, sr.use, &res->meta, err)) == FITM_OK)
        ps->n_layers = ps->all_layers ? 0 : fitm_layers_last(r, sr.use); /* none read later */
    for (int pass = 0; st == FITM_OK && pass < SORT_PASSES; pass++) {
        st = sort_pass(ps, req, &sr, err);
        if (st == FITM_OK && pass < SORT_PASSES - 1)
            reorder_by_mass(sr.order, sr.next, sr.M, K);
    }
    if (st == FITM_OK && (st = sort_results(&sr, K, res, err)) == FITM_OK) {
        res->usage = (fitm_rerank_usage){
            .prompt_tokens = sr.T, .forward_tokens = sr.forward, .total_tokens = sr.T};
        res->meta.tokenize_ms = sr.tok_ms;
        res->meta.forward_ms = fitm_clock_ms() - t0 - sr.tok_ms;
    }
    ps->n_layers = 0;
    sort_run_free(&sr);
    return st;
}

/* attention_sort: the first pass's prompt exactly; the later passes' (documents reordered)
 * the same when every title is the same, else bounded. */
fitm_status fitm_attention_sort_cost(const fitm_session *r, const fitm_rerank_request *req,
                                     int64_t *tokens, fitm_err *err)
{
    const int32_t K = req->n_docs;
    fitm_ids ids = {0};
    fitm_span *spans = calloc((size_t)K, sizeof *spans);
    fitm_status st = spans ? fitm_prompt_build(r, req, NULL, NULL, K, NULL, &ids, spans, NULL, err)
                           : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const int64_t T = ids.n;
    free(ids.v);
    free(spans);
    if (st == FITM_OK && T > r->n_ctx)
        st = fitm_prompt_too_long(T, r, req, err);
    int32_t starts[2] = {0, K};
    int64_t frame = 0, docs = 0;
    if (st == FITM_OK)
        st = fitm_prompt_bound(r, req, NULL, NULL, starts, 1, &frame, &docs, err);
    int64_t later = frame + docs > T ? frame + docs : T;
    *tokens = T + (SORT_PASSES - 1) * later;
    return st;
}
