/* rerank: POST /rerank's pipeline (see rerank.h): the request and result, the prompt frames
 * and answer template every method and /answer build on, and the dispatch of a request to
 * its method (rerank_attn.c, rerank_sort.c, rerank_per_doc.c) with its passes on the session's
 * own caches, or its cost. */
#include "pipeline/rerank_methods.h"

#include <stdlib.h>
#include <string.h>

void fitm_rerank_request_free(fitm_rerank_request *req)
{
    if (!req)
        return;
    for (int32_t i = 0; req->docs && i < req->n_docs; i++) {
        free(req->docs[i].text);
        free(req->docs[i].title);
    }
    free(req->docs);
    free(req->query);
    free(req->model);
    fitm_score_opts_free(&req->opt);
    free(req->dummy);
    memset(req, 0, sizeof *req);
    fitm_score_opts_init(&req->opt);
}

void fitm_rerank_result_free(fitm_rerank_result *res)
{
    if (!res)
        return;
    free(res->results);
    free(res->meta.layers);
    fitm_score_opts_free(&res->meta.opts);
    for (int32_t g = 0; res->groups && g < res->n_groups; g++) {
        fitm_rerank_tokens *t = &res->groups[g];
        free(t->ids);
        free(t->spans);
        free(t->dummy_tokens);
        free(t->dummy_offsets);
        free(t->null_ids);
        free(t->null_spans);
    }
    free(res->groups);
    memset(res, 0, sizeof *res);
    fitm_score_opts_init(&res->meta.opts);
}

/* ---- the pipeline ------------------------------------------------------------------------ */

/* Liu et al.'s query-aware prompt (docs/design.md, Method). */
const fitm_rerank_frame fitm_rerank_default_frame = {
    .before = "Write a high-quality answer for the given question using only the provided "
              "search results (some of which might be irrelevant).\n\nQuestion: {question}\n\n",
    .after = "\nQuestion: {question}\nAnswer:",
};

const char fitm_rerank_answer_template[] =
    "Answer the question in a few words, using only the documents.\\n\\n"
    "Document [1](Title: Orla Penmarric) Orla Penmarric (1871-1930) was a Velmish engineer who "
    "built the lighthouse of Carrow Point.\\n"
    "Document [2](Title: Tamsin Hale) Tamsin Hale is a painter from the river town of "
    "Lindwick.\\n\\n"
    "Question: Who built the lighthouse of Carrow Point?\\nAnswer: Orla Penmarric\\n\\n"
    "Question: Where is Tamsin Hale from?\\nAnswer: Lindwick\\n\\n"
    "{documents}\\nQuestion: {question}\\nAnswer:";

/* Runs req's method with its passes ps into res (zeroed, meta.method set). */
static fitm_status run_passes(fitm_passes *ps, const fitm_rerank_request *req,
                              fitm_rerank_result *res, fitm_err *err)
{
    res->meta.position = ps->position;
    switch (req->method) {
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
    case FITM_RERANK_PAPER:
        return fitm_attention_run(ps, req, res, err);
    case FITM_RERANK_ATTENTION_SORT:
        return fitm_attention_sort_run(ps, req, res, err);
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
    case FITM_RERANK_FUSED:
        return fitm_per_doc_run(ps, req, res, err);
    case FITM_RERANK_METHOD_COUNT:
        break;
    }
    return fitm_err_set(err, FITM_ERR_INVALID, "'method': unknown");
}

fitm_status fitm_rerank_run(fitm_session *s, const fitm_rerank_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_rerank_result *res, fitm_err *err)
{
    memset(res, 0, sizeof *res);
    fitm_score_opts_init(&res->meta.opts);
    res->meta.method = req->method;
    fitm_passes ps;
    fitm_status st = fitm_passes_init(&ps, s, req, 1, &s->kv, &s->branch, err);
    if (st != FITM_OK || (st = fitm_session_cache_method(s, ps.position, err)) != FITM_OK)
        return st;
    ps.stop = stop;
    ps.stop_arg = stop_arg;
    return run_passes(&ps, req, res, err);
}

fitm_status fitm_rerank_cost(const fitm_session *s, const fitm_rerank_request *req,
                             bool any_order, int64_t *tokens, fitm_err *err)
{
    *tokens = 0;
    const int32_t n_lanes = fitm_rerank_lanes(s, req);
    switch (req->method) {
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
    case FITM_RERANK_PAPER:
        return fitm_attention_cost(s, req, any_order, n_lanes, tokens, err);
    case FITM_RERANK_ATTENTION_SORT:
        return fitm_attention_sort_cost(s, req, tokens, err);
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
    case FITM_RERANK_FUSED:
        return fitm_per_doc_cost(s, req, tokens, err);
    case FITM_RERANK_METHOD_COUNT:
        break;
    }
    return fitm_err_set(err, FITM_ERR_INVALID, "'method': unknown");
}
