/* answer_order: step 1 of an /answer with documents: their order (an optional reorder by a
 * rerank method) and the intervention's weights alpha (the calibrated method's weights of the
 * documents in that order), both from rerank runs on the session: an answer's scoring. */
#include "pipeline/answer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "model/model.h"

fitm_status fitm_answer_plan_init(const fitm_session *s, const fitm_answer_request *req,
                                  fitm_answer_plan *pl, fitm_answer_result *res, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(fitm_session_model(s));
    const int32_t K = req->base.n_docs;
    *pl = (fitm_answer_plan){.K = K, .L = c->n_layer};
    const size_t k1 = K > 0 ? (size_t)K : 1; /* plain generation has no documents */
    pl->order = malloc(k1 * sizeof *pl->order);
    pl->docs = malloc(k1 * sizeof *pl->docs);
    pl->spans = calloc(k1, sizeof *pl->spans);
    pl->alpha = malloc(k1 * sizeof *pl->alpha);
    pl->use = calloc((size_t)pl->L, 1);
    res->docs = calloc(k1, sizeof *res->docs);
    res->n_docs = K;
    if (!pl->order || !pl->docs || !pl->spans || !pl->alpha || !pl->use || !res->docs)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t k = 0; k < K; k++) {
        pl->order[k] = k;
        pl->alpha[k] = 1.0f / (float)K;
        res->docs[k] = (fitm_answer_doc){.index = k, .position = k, .weight = 1.0 / K};
    }
    return FITM_OK;
}

void fitm_answer_plan_free(fitm_answer_plan *pl)
{
    free(pl->order);
    free(pl->docs);
    free(pl->spans);
    free(pl->alpha);
    free(pl->use);
}

fitm_rerank_request fitm_answer_rank_request(const fitm_answer_request *req, fitm_rerank_method m,
                                             const fitm_rerank_doc *docs)
{
    fitm_rerank_request q = req->base;
    q.docs = (fitm_rerank_doc *)docs;
    q.method = m;
    q.top_n = q.n_docs;
    q.return_tokens = false;
    q.return_documents = false;
    q.tei = false;
    /* On the answer's path, where the answers' accuracy was measured (docs/load-benchmark.md
     * says what the other path changed), every layer where the answer continues the scored
     * rows (fitm_passes_init decides). */
    q.answer_scoring = true;
    return q;
}

/* Ranks with method on docs in order (NULL: request order) and returns the shallow request
 * copy's result in *out. */
static fitm_status rank(fitm_session *s, const fitm_answer_request *req, fitm_rerank_method m,
                        const fitm_rerank_doc *docs, int32_t n_docs, bool (*stop)(const void *),
                        const void *stop_arg, fitm_rerank_result *out, fitm_err *err)
{
    fitm_rerank_request q = fitm_answer_rank_request(req, m, docs);
    q.n_docs = q.top_n = n_docs;
    return fitm_rerank_run(s, &q, stop, stop_arg, out, err);
}

/* top_n: the plan keeps the n most relevant (the reorder's first n, the best still where
 * reorder_last puts it; without a reorder the first n as sent); the documents left out have
 * no place in the prompt and no weight. */
static void keep_top(const fitm_answer_request *req, fitm_answer_plan *pl,
                     fitm_answer_result *res)
{
    const int32_t n = req->top_n;
    if (n < 1 || n >= pl->K)
        return;
    if (req->reorder >= 0 && req->reorder_last)
        memmove(pl->order, pl->order + pl->K - n, (size_t)n * sizeof *pl->order);
    for (int32_t k = 0; k < pl->K; k++)
        res->docs[k] = (fitm_answer_doc){.index = k, .position = -1};
    for (int32_t p = 0; p < n; p++) {
        res->docs[pl->order[p]].weight = 1.0 / n;
        pl->alpha[p] = 1.0f / (float)n;
    }
    pl->K = n;
}

/* The documents reordered by req->reorder (most relevant first, or last with reorder_last,
 * where a model that favours what it read last finds it), the top_n of them kept, then the
 * intervention's weights from the calibrated scores of the documents kept, in that order. */
fitm_status fitm_answer_order(fitm_session *s, const fitm_answer_request *req, fitm_answer_plan *pl,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_answer_result *res, fitm_err *err)
{
    fitm_rerank_result rr = {0};
    fitm_status st = FITM_OK;
    /* Scores of documents that each had a prompt of their own (windows of 1) do not depend on
     * the order: the reorder's calibrated scores are the reordered prompt's. */
    bool scored = false;
    if (req->reorder >= 0) {
        st = rank(s, req, (fitm_rerank_method)req->reorder, req->base.docs, pl->K, stop,
                  stop_arg, &rr, err);
        for (int32_t p = 0; st == FITM_OK && p < pl->K; p++)
            pl->order[p] = rr.results[req->reorder_last ? pl->K - 1 - p : p].index;
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_request q =
            fitm_answer_rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
        /* with documents left out the weights are the kept ones' own, scored below */
        scored = st == FITM_OK && req->calibrate && req->reorder == FITM_RERANK_CALIBRATED &&
                 !(req->top_n >= 1 && req->top_n < pl->K) && fitm_rerank_scores_alone(s, &q);
        for (int32_t i = 0; scored && i < pl->K; i++) {
            const fitm_rerank_doc_result *d = &rr.results[i];
            res->docs[d->index].weight = d->weight;
            res->docs[d->index].calibrated_attention = d->calibrated_attention;
        }
        fitm_rerank_result_free(&rr);
    }
    if (st == FITM_OK)
        keep_top(req, pl, res);
    for (int32_t p = 0; st == FITM_OK && p < pl->K; p++) {
        pl->docs[p] = req->base.docs[pl->order[p]];
        res->docs[pl->order[p]].position = p;
        if (scored)
            pl->alpha[p] = (float)res->docs[pl->order[p]].weight;
    }
    if (st == FITM_OK && req->calibrate && !scored) {
        st = rank(s, req, FITM_RERANK_CALIBRATED, pl->docs, pl->K, stop, stop_arg, &rr, err);
        for (int32_t i = 0; st == FITM_OK && i < pl->K; i++) {
            int32_t p = rr.results[i].index; /* the reordered request's index = position */
            pl->alpha[p] = (float)rr.results[i].weight;
            res->docs[pl->order[p]].weight = rr.results[i].weight;
            res->docs[pl->order[p]].calibrated_attention = rr.results[i].calibrated_attention;
        }
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_result_free(&rr);
    }
    return st;
}
