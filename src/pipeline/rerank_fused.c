/* rerank_fused: method fused, query likelihood led by the calibrated attention's tie-breaks.
 * Both components score each document alone (query_likelihood: one pass per document;
 * calibrated with windows of 1), so the fused ranking does not depend on the documents' order.
 *
 *   QL_k   = ln(query_likelihood's relevance_score_k)   mean log-probability of the question
 *   z_k    = (rel_k - mean rel) / sd rel over the K documents (0 when sd = 0), rel the
 *            calibrated method's calibrated_attention
 *   score_k = QL_k + fuse_weight x z_k                   relevance_score = raw_score = score_k
 *
 * A document query likelihood ranks well below another cannot be lifted over it by attention
 * alone (z moves a score by at most fuse_weight x sqrt(K - 1)), while attention orders the
 * documents whose question likelihoods are close. Each result keeps the calibrated run's
 * attention fields and weight. The score stays on the log scale: its exp would overflow for a
 * large weight. */
#include "pipeline/rerank_methods.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* fuse_weight as the request, else the server's defaults, set it. */
static double fuse_weight(const fitm_session *r, const fitm_rerank_request *req)
{
    return !isnan(req->opt.fuse_weight) ? req->opt.fuse_weight : r->defaults.fuse_weight;
}

/* The calibrated component: req's options with windows of 1 (each document alone). */
static fitm_status calibrated_request(const fitm_rerank_request *req, fitm_rerank_request *c,
                                      fitm_err *err)
{
    *c = *req;
    c->method = FITM_RERANK_CALIBRATED;
    fitm_score_opts_init(&c->opt);
    fitm_status st = fitm_score_opts_overlay(&c->opt, &req->opt, err);
    c->opt.window = 1;
    return st;
}

/* The mean and (population) standard deviation of the K results' calibrated_attention. */
static void attention_moments(const fitm_rerank_doc_result *r, int32_t K, double *mean,
                              double *sd)
{
    double m = 0, var = 0;
    for (int32_t i = 0; i < K; i++)
        m += r[i].calibrated_attention;
    m /= K;
    for (int32_t i = 0; i < K; i++)
        var += (r[i].calibrated_attention - m) * (r[i].calibrated_attention - m);
    *mean = m;
    *sd = sqrt(var / K);
}

fitm_status fitm_fused_run(fitm_passes *ps, const fitm_rerank_request *req,
                           fitm_rerank_result *res, fitm_err *err)
{
    const int32_t K = req->n_docs;
    const double w = fuse_weight(ps->s, req);
    fitm_rerank_request q = *req, c;
    q.method = FITM_RERANK_QUERY_LIKELIHOOD;
    fitm_rerank_result qr = {0};
    fitm_status st = calibrated_request(req, &c, err);
    if (st == FITM_OK)
        st = fitm_attention_run(ps, &c, res, err);
    if (st == FITM_OK)
        st = fitm_per_doc_run(ps, &q, &qr, err);
    double *ql = st == FITM_OK ? malloc((size_t)K * sizeof *ql) : NULL;
    if (st == FITM_OK && !ql)
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (st == FITM_OK) {
        for (int32_t i = 0; i < K; i++)
            ql[qr.results[i].index] = log(qr.results[i].relevance_score);
        double mean, sd;
        attention_moments(res->results, K, &mean, &sd);
        for (int32_t i = 0; i < K; i++) {
            fitm_rerank_doc_result *d = &res->results[i];
            double z = sd > 0 ? (d->calibrated_attention - mean) / sd : 0;
            d->relevance_score = d->raw_score = ql[d->index] + w * z;
        }
        fitm_results_sort(res->results, K);
        res->usage.forward_tokens += qr.usage.forward_tokens;
        if (qr.usage.prompt_tokens > res->usage.prompt_tokens)
            res->usage.prompt_tokens = res->usage.total_tokens = qr.usage.prompt_tokens;
        res->meta.tokenize_ms += qr.meta.tokenize_ms;
        res->meta.forward_ms += qr.meta.forward_ms;
        res->meta.opts.fuse_weight = w;
    }
    free(ql);
    free(qr.results); /* all a query_likelihood run allocates */
    fitm_score_opts_free(&c.opt);
    return st;
}

fitm_status fitm_fused_cost(const fitm_session *r, const fitm_rerank_request *req,
                            bool any_order, int64_t *tokens, fitm_err *err)
{
    fitm_rerank_request q = *req, c;
    q.method = FITM_RERANK_QUERY_LIKELIHOOD;
    int64_t tq = 0, tc = 0;
    fitm_status st = calibrated_request(req, &c, err);
    if (st == FITM_OK)
        st = fitm_attention_cost(r, &c, any_order, &tc, err);
    if (st == FITM_OK)
        st = fitm_per_doc_cost(r, &q, &tq, err);
    fitm_score_opts_free(&c.opt);
    *tokens = tq + tc;
    return st;
}
