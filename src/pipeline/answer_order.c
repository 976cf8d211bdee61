/* answer_order: step 1 of an /answer with documents: their order (an optional reorder by a
 * rerank method, then top_n's documents kept) and the intervention's weights alpha (the
 * calibrated method's weights of the documents in that order), from rankings run by the
 * caller (answer.c: in the engine's batch steps, or attention_sort's whole run) and taken
 * here phase by phase: an answer's scoring. */
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

/* The plan's documents in its order, their positions in the answer and, when the weights are
 * the reorder's scores (rk->scored), alpha by position; then the ranking's next phase: the
 * calibration of the documents kept, unless the weights are already scored or not wanted. */
static void arrange(const fitm_answer_request *req, fitm_answer_plan *pl,
                    fitm_answer_ranking *rk, fitm_answer_result *res)
{
    keep_top(req, pl, res);
    for (int32_t p = 0; p < pl->K; p++) {
        pl->docs[p] = req->base.docs[pl->order[p]];
        res->docs[pl->order[p]].position = p;
        if (rk->scored)
            pl->alpha[p] = (float)res->docs[pl->order[p]].weight;
    }
    rk->phase = FITM_ANSWER_RANK_DONE;
    if (req->calibrate && !rk->scored) {
        rk->phase = FITM_ANSWER_RANK_CALIBRATE;
        rk->q = fitm_answer_rank_request(req, FITM_RERANK_CALIBRATED, pl->docs);
        rk->q.n_docs = rk->q.top_n = pl->K;
    }
}

void fitm_answer_rank_start(const fitm_answer_request *req, fitm_answer_plan *pl,
                            fitm_answer_ranking *rk, fitm_answer_result *res)
{
    *rk = (fitm_answer_ranking){.phase = FITM_ANSWER_RANK_REORDER};
    if (req->reorder < 0) {
        arrange(req, pl, rk, res);
        return;
    }
    rk->q = fitm_answer_rank_request(req, (fitm_rerank_method)req->reorder, req->base.docs);
    rk->q.n_docs = rk->q.top_n = pl->K;
}

/* The reorder's ranking rr: the documents most relevant first (or last, reorder_last), and
 * its weights when they are the calibration's own. */
static void took_reorder(const fitm_session *s, const fitm_answer_request *req,
                         fitm_answer_plan *pl, fitm_answer_ranking *rk,
                         const fitm_rerank_result *rr, fitm_answer_result *res)
{
    for (int32_t p = 0; p < pl->K; p++)
        pl->order[p] = rr->results[req->reorder_last ? pl->K - 1 - p : p].index;
    /* Scores of documents that each had a prompt of their own (windows of 1) do not depend on
     * the order: the reorder's calibrated scores are the reordered prompt's. With documents
     * left out the weights are the kept ones' own, scored by the calibration. */
    fitm_rerank_request cal = fitm_answer_rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
    rk->scored = req->calibrate && req->reorder == FITM_RERANK_CALIBRATED &&
                 !(req->top_n >= 1 && req->top_n < pl->K) && fitm_rerank_scores_alone(s, &cal);
    for (int32_t i = 0; rk->scored && i < pl->K; i++) {
        const fitm_rerank_doc_result *d = &rr->results[i];
        res->docs[d->index].weight = d->weight;
        res->docs[d->index].calibrated_attention = d->calibrated_attention;
    }
    arrange(req, pl, rk, res);
}

/* The calibration's ranking rr of the kept documents in the plan's order: their weights. */
static void took_calibration(fitm_answer_plan *pl, fitm_answer_ranking *rk,
                             const fitm_rerank_result *rr, fitm_answer_result *res)
{
    for (int32_t i = 0; i < pl->K; i++) {
        int32_t p = rr->results[i].index; /* the reordered request's index = position */
        pl->alpha[p] = (float)rr->results[i].weight;
        res->docs[pl->order[p]].weight = rr->results[i].weight;
        res->docs[pl->order[p]].calibrated_attention = rr->results[i].calibrated_attention;
    }
    rk->phase = FITM_ANSWER_RANK_DONE;
}

void fitm_answer_rank_took(const fitm_session *s, const fitm_answer_request *req,
                           fitm_answer_plan *pl, fitm_answer_ranking *rk,
                           const fitm_rerank_result *rr, fitm_answer_result *res)
{
    res->forward_tokens += rr->usage.forward_tokens;
    if (rk->phase == FITM_ANSWER_RANK_REORDER)
        took_reorder(s, req, pl, rk, rr, res);
    else if (rk->phase == FITM_ANSWER_RANK_CALIBRATE)
        took_calibration(pl, rk, rr, res);
}
