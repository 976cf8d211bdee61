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

/* The fused scores into res (the calibrated run's results) from qr (query_likelihood's):
 * score_k = ln(QL_k) + w x z_k over the K documents, sorted. ql: (K) scratch. */
static void combine(fitm_rerank_result *res, const fitm_rerank_result *qr, int32_t K, double w,
                    double *ql)
{
    for (int32_t i = 0; i < K; i++)
        ql[qr->results[i].index] = log(qr->results[i].relevance_score);
    double mean, sd;
    attention_moments(res->results, K, &mean, &sd);
    for (int32_t i = 0; i < K; i++) {
        fitm_rerank_doc_result *d = &res->results[i];
        double z = sd > 0 ? (d->calibrated_attention - mean) / sd : 0;
        d->relevance_score = d->raw_score = ql[d->index] + w * z;
    }
    fitm_results_sort(res->results, K);
}

/* The run between two passes: the two components as machines of their own (calibrated into
 * res, query_likelihood into qr), both started at the start, and how far each lane got: its
 * share of the calibrated windows, then its share of query_likelihood's documents. */
typedef struct {
    fitm_passes *ps;
    fitm_rerank_result *res;
    fitm_rerank_request c, q; /* the components' requests (c's options its own) */
    fitm_rerank_result qr;
    fitm_machine cal, ql; /* end NULL: not started */
    /* each lane's stage: 0 its calibrated share, 1 its query_likelihood share, 2 done */
    uint8_t stage[FITM_SESSION_LANES_MAX];
    int32_t n_done; /* lanes at stage 2 */
    double w;
} fused_run;

/* Both components have made their results (every lane done with both): combined into res. */
static fitm_status fuse(fused_run *f, fitm_err *err)
{
    double *ql = malloc((size_t)f->q.n_docs * sizeof *ql);
    if (!ql)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    combine(f->res, &f->qr, f->q.n_docs, f->w, ql);
    free(ql);
    return FITM_OK;
}

static fitm_status fused_next(void *run, int32_t lane, const fitm_pass **pass, fitm_err *err)
{
    fused_run *f = run;
    *pass = NULL;
    fitm_status st;
    if (f->stage[lane] == 0) {
        if ((st = f->cal.next(f->cal.run, lane, pass, err)) != FITM_OK || *pass)
            return st;
        f->stage[lane] = 1; /* its calibrated share done: on to its query_likelihood share */
    }
    if (f->stage[lane] == 1) {
        if ((st = f->ql.next(f->ql.run, lane, pass, err)) != FITM_OK || *pass)
            return st;
        f->stage[lane] = 2;
        if (++f->n_done == f->ps->n_lanes)
            return fuse(f, err);
    }
    return FITM_OK;
}

static void fused_ran(void *run, int32_t lane)
{
    fused_run *f = run;
    if (f->stage[lane] == 0)
        f->cal.ran(f->cal.run, lane);
    else
        f->ql.ran(f->ql.run, lane);
}

static fitm_status fused_end(void *run, fitm_status st)
{
    fused_run *f = run;
    if (!f)
        return st;
    if (f->cal.end)
        st = f->cal.end(f->cal.run, st);
    if (f->ql.end)
        st = f->ql.end(f->ql.run, st);
    fitm_rerank_result *res = f->res;
    if (st == FITM_OK) {
        res->usage.forward_tokens += f->qr.usage.forward_tokens;
        if (f->qr.usage.prompt_tokens > res->usage.prompt_tokens)
            res->usage.prompt_tokens = res->usage.total_tokens = f->qr.usage.prompt_tokens;
        res->meta.tokenize_ms += f->qr.meta.tokenize_ms;
        res->meta.forward_ms += f->qr.meta.forward_ms;
        res->meta.opts.fuse_weight = f->w;
    }
    free(f->qr.results); /* all a query_likelihood run allocates */
    fitm_score_opts_free(&f->c.opt);
    free(f);
    return st;
}

fitm_status fitm_fused_start(fitm_passes *ps, const fitm_rerank_request *req,
                             fitm_rerank_result *res, fitm_machine *m, fitm_err *err)
{
    fused_run *f = calloc(1, sizeof *f);
    *m = (fitm_machine){.run = f, .next = fused_next, .ran = fused_ran, .end = fused_end};
    if (!f)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    f->ps = ps;
    f->res = res;
    f->w = fuse_weight(ps->s, req);
    f->q = *req;
    f->q.method = FITM_RERANK_QUERY_LIKELIHOOD;
    fitm_status st = calibrated_request(req, &f->c, err);
    if (st == FITM_OK)
        st = fitm_attention_machine(ps, &f->c, res, &f->cal, err);
    if (st == FITM_OK)
        st = fitm_per_doc_start(ps, &f->q, &f->qr, &f->ql, err);
    return st;
}

fitm_status fitm_fused_run(fitm_passes *ps, const fitm_rerank_request *req,
                           fitm_rerank_result *res, fitm_err *err)
{
    fitm_machine m;
    fitm_status st = fitm_fused_start(ps, req, res, &m, err);
    return fitm_machine_run(ps, &m, st, err);
}

fitm_status fitm_fused_cost(const fitm_session *r, const fitm_rerank_request *req, bool any_order,
                            int32_t n_lanes, int64_t *tokens, fitm_err *err)
{
    fitm_rerank_request q = *req, c;
    q.method = FITM_RERANK_QUERY_LIKELIHOOD;
    int64_t tq = 0, tc = 0;
    fitm_status st = calibrated_request(req, &c, err);
    if (st == FITM_OK)
        st = fitm_attention_cost(r, &c, any_order, n_lanes, &tc, err);
    if (st == FITM_OK)
        st = fitm_per_doc_cost(r, &q, &tq, err);
    fitm_score_opts_free(&c.opt);
    *tokens = tq + tc;
    return st;
}

fitm_status fitm_fused_rows(const fitm_session *r, const fitm_rerank_request *req,
                            int64_t *rows, fitm_err *err)
{
    fitm_rerank_request q = *req, c;
    q.method = FITM_RERANK_QUERY_LIKELIHOOD;
    int64_t rq = 0, rc = 0;
    fitm_status st = calibrated_request(req, &c, err);
    if (st == FITM_OK)
        st = fitm_attention_rows(r, &c, &rc, err);
    if (st == FITM_OK)
        st = fitm_per_doc_rows(r, &q, &rq, err);
    fitm_score_opts_free(&c.opt);
    *rows = rq > rc ? rq : rc;
    return st;
}
