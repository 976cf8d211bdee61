/* rerank_per_doc: the per-document methods, one prompt of its own per document on the
 * prompt cache (no shared prefix to reuse): query_likelihood (LongLLMLingua's r_k) and
 * relevance (a yes/no question in the chat template). */
#include "pipeline/rerank_methods.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

/* log of the softmax of row (V) at id. */
static double log_prob(const float *row, int32_t V, int32_t id)
{
    float mx = row[0];
    for (int32_t v = 1; v < V; v++)
        mx = row[v] > mx ? row[v] : mx;
    double z = 0;
    for (int32_t v = 0; v < V; v++)
        z += exp((double)row[v] - (double)mx);
    return (double)row[id] - (double)mx - log(z);
}

/* The first token of each spelling, deduplicated, into ids (at most 4). */
static int answer_ids(const fitm_tokenizer *tok, const char *const *words, int32_t *ids)
{
    int n = 0;
    for (int w = 0; w < 4; w++) {
        fitm_ids v = {0};
        if (fitm_prompt_encode(tok, &v, words[w], strlen(words[w]), FITM_TOK_CONTINUATION, -1,
                               NULL) == FITM_OK &&
            v.n > 0) {
            bool dup = false;
            for (int i = 0; i < n; i++)
                dup |= ids[i] == v.v[0];
            if (!dup)
                ids[n++] = v.v[0];
        }
        free(v.v);
    }
    return n;
}

/* The per-document methods' fixed texts and the ids of their answers. */
static const char RESTRICT[] = " We can get the answer to this question in the given documents.";
static const char ASK[] = "\n\nIs the document relevant to the question? Answer Yes or No.";

typedef struct {
    bool ql;    /* query_likelihood, else relevance */
    fitm_ids q; /* query_likelihood: " {query}" + RESTRICT, the scored tokens */
    int32_t yes[4], no[4];
    int n_yes, n_no; /* relevance: first tokens of Yes/yes and No/no */
} per_doc;

/* query_likelihood's prompt for document k: BOS, its text, "\n\nQuestion:", then the scored
 * question (whose last token is never fed). */
static fitm_status ql_prompt(const fitm_session *r, const fitm_rerank_request *req, int32_t k,
                             const per_doc *pd, fitm_ids *ids, fitm_err *err)
{
    const fitm_rerank_doc *d = &req->docs[k];
    fitm_status st = fitm_prompt_encode(r->tok, ids, "", 0, FITM_TOK_ADD_BOS, -1, err);
    const int64_t body = ids->n;
    if (!st)
        st = fitm_prompt_encode(r->tok, ids, d->text, d->text_len, 0, fitm_prompt_doc_keep(req),
                                err);
    if (!st)
        st = fitm_prompt_doc_fits(req, k, ids->n - body, err);
    if (!st)
        st = fitm_prompt_encode(r->tok, ids, "\n\nQuestion:", 11, FITM_TOK_CONTINUATION, -1, err);
    if (!st && !(st = fitm_ids_reserve(ids, pd->q.n, err))) {
        memcpy(ids->v + ids->n, pd->q.v, (size_t)pd->q.n * sizeof *ids->v);
        ids->n += pd->q.n;
    }
    return st;
}

/* relevance's prompt for document k, in the chat template: "Document: {text}\n\nQuestion:
 * {query}" + ASK (+ "\nAnswer:" without a template). */
static fitm_status relevance_prompt(const fitm_session *r, const fitm_rerank_request *req,
                                    int32_t k, fitm_ids *ids, fitm_err *err)
{
    const bool raw = fitm_session_is_raw(r);
    fitm_status st = fitm_prompt_encode(r->tok, ids, r->tmpl->head, strlen(r->tmpl->head),
                                        FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, -1, err);
    if (!st)
        st = fitm_prompt_encode(r->tok, ids, "Document:", 9, raw ? 0 : FITM_TOK_CONTINUATION, -1,
                                err);
    if (!st)
        st = fitm_prompt_body(r, req, k, ids, err);
    size_t qn = req->query_len + sizeof ASK + 32;
    char *buf = st ? NULL : malloc(qn);
    if (!st && !buf)
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (!st) {
        int n = snprintf(buf, qn, "\n\nQuestion: %s%s%s", req->query, ASK, raw ? "\nAnswer:" : "");
        st = fitm_prompt_encode(r->tok, ids, buf, (size_t)n, FITM_TOK_CONTINUATION, -1, err);
    }
    free(buf);
    if (!st && !raw)
        st = fitm_prompt_encode(r->tok, ids, r->tmpl->tail, strlen(r->tmpl->tail),
                                FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
    return st;
}

/* query_likelihood's score of a prompt of T fed tokens whose question starts at n_pre: the
 * geometric-mean probability of the question's tokens, logit_rows at a time. */
static fitm_status ql_score(fitm_passes *ps, const per_doc *pd, const fitm_ids *ids, int64_t n_pre,
                            int64_t T, double *score, fitm_err *err)
{
    const fitm_session *r = ps->s;
    int64_t head = n_pre - 1; /* rows head .. T - 1 predict the question's tokens */
    fitm_status st = FITM_OK;
    if (head > 0)
        st = fitm_passes_run(ps, ps->kv, NULL, ids->v, head, 0, NULL, 0, err);
    double sum = 0;
    for (int64_t p = head; st == FITM_OK && p < T; p += r->logit_rows) {
        int64_t n = T - p < r->logit_rows ? T - p : r->logit_rows;
        st = fitm_passes_run(ps, ps->kv, NULL, ids->v + p, n, p, NULL, n, err);
        for (int64_t i = 0; st == FITM_OK && i < n; i++)
            sum += log_prob(r->logits + i * r->V, r->V, ids->v[p + i + 1]);
    }
    *score = exp(sum / (double)pd->q.n);
    return st;
}

/* relevance's score: P(yes) / (P(yes) + P(no)) after the whole prompt. */
static fitm_status relevance_score(fitm_passes *ps, const per_doc *pd, const fitm_ids *ids,
                                   double *score, fitm_err *err)
{
    const fitm_session *r = ps->s;
    fitm_status st = fitm_passes_run(ps, ps->kv, NULL, ids->v, ids->n, 0, NULL, 1, err);
    double py = 0, pn = 0;
    for (int i = 0; st == FITM_OK && i < pd->n_yes; i++)
        py += exp(log_prob(r->logits, r->V, pd->yes[i]));
    for (int i = 0; st == FITM_OK && i < pd->n_no; i++)
        pn += exp(log_prob(r->logits, r->V, pd->no[i]));
    *score = py + pn > 0 ? py / (py + pn) : 0.5;
    return st;
}

static fitm_status per_doc_init(const fitm_session *r, const fitm_rerank_request *req, per_doc *pd,
                                fitm_err *err)
{
    static const char *const YES[4] = {" Yes", "Yes", " yes", "yes"};
    static const char *const NO[4] = {" No", "No", " no", "no"};
    if (pd->ql) {
        size_t n = req->query_len + sizeof RESTRICT + 1;
        char *buf = malloc(n);
        if (!buf)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        int len = snprintf(buf, n, " %s%s", req->query, RESTRICT);
        fitm_status st =
            fitm_prompt_encode(r->tok, &pd->q, buf, (size_t)len, FITM_TOK_CONTINUATION, -1, err);
        free(buf);
        return st;
    }
    pd->n_yes = answer_ids(r->tok, YES, pd->yes);
    pd->n_no = answer_ids(r->tok, NO, pd->no);
    if (!pd->n_yes || !pd->n_no)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "'method' = 'relevance': the vocabulary cannot spell Yes/No");
    return FITM_OK;
}

/* Document k's pass: its prompt into ids and the T tokens the pass feeds (query_likelihood
 * never feeds the question's last token), checked against the context. The run and the
 * cost both take a document's pass from here. */
static fitm_status doc_pass(const fitm_session *r, const fitm_rerank_request *req,
                            const per_doc *pd, int32_t k, fitm_ids *ids, int64_t *T, fitm_err *err)
{
    ids->n = 0;
    fitm_status st =
        pd->ql ? ql_prompt(r, req, k, pd, ids, err) : relevance_prompt(r, req, k, ids, err);
    *T = pd->ql ? ids->n - 1 : ids->n;
    if (st == FITM_OK && *T > r->n_ctx)
        st = fitm_prompt_too_long(*T, r, req, err);
    return st;
}

/* query_likelihood (LongLLMLingua's r_k): per document, the mean log-probability of
 * " {query} We can get the answer to this question in the given documents." after
 * "{text}\n\nQuestion:"; relevance_score = exp of it (the tokens' geometric-mean probability).
 * relevance: per document, "Document: {text}\n\nQuestion: {query}\n\nIs the document relevant
 * to the question? Answer Yes or No." in the chat template; relevance_score = P(yes) /
 * (P(yes) + P(no)) over the first tokens of "Yes"/"yes" and "No"/"no". One pass per document
 * on a cache of its own prompt (no shared prefix to reuse). */
fitm_status fitm_per_doc_run(fitm_passes *ps, const fitm_rerank_request *req,
                             fitm_rerank_result *res, fitm_err *err)
{
    const fitm_session *r = ps->s;
    double t0 = fitm_clock_ms(), tok_ms = 0;
    const int32_t K = req->n_docs;
    per_doc pd = {.ql = req->method == FITM_RERANK_QUERY_LIKELIHOOD};
    fitm_ids ids = {0};
    int64_t forward = 0, T_max = 0;
    res->results = calloc((size_t)K, sizeof *res->results);
    fitm_status st = res->results ? per_doc_init(r, req, &pd, err)
                                  : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    res->n_results = res->results ? K : 0;
    for (int32_t k = 0; st == FITM_OK && k < K; k++) {
        double tt = fitm_clock_ms(), score = 0;
        int64_t T = 0;
        st = doc_pass(r, req, &pd, k, &ids, &T, err);
        tok_ms += fitm_clock_ms() - tt;
        if (st == FITM_OK)
            st = fitm_kv_rebase(ps->kv, 0, err);
        if (st == FITM_OK)
            st = pd.ql ? ql_score(ps, &pd, &ids, ids.n - pd.q.n, T, &score, err)
                       : relevance_score(ps, &pd, &ids, &score, err);
        T_max = T > T_max ? T : T_max;
        forward += T;
        res->results[k] =
            (fitm_rerank_doc_result){.index = k, .position = k, .relevance_score = score,
                                     .raw_score = score};
    }
    if (st == FITM_OK)
        fitm_results_sort(res->results, K);
    res->usage = (fitm_rerank_usage){
        .prompt_tokens = T_max, .forward_tokens = forward, .total_tokens = T_max};
    res->meta.tokenize_ms = tok_ms;
    res->meta.forward_ms = fitm_clock_ms() - t0 - tok_ms;
    free(ids.v);
    free(pd.q.v);
    return st;
}

/* query_likelihood and relevance: each document's pass (doc_pass), as fitm_per_doc_run runs
 * them. */
fitm_status fitm_per_doc_cost(const fitm_session *r, const fitm_rerank_request *req,
                              int64_t *tokens, fitm_err *err)
{
    per_doc pd = {.ql = req->method == FITM_RERANK_QUERY_LIKELIHOOD};
    fitm_ids ids = {0};
    int64_t sum = 0;
    fitm_status st = per_doc_init(r, req, &pd, err);
    for (int32_t k = 0; st == FITM_OK && k < req->n_docs; k++) {
        int64_t T = 0;
        st = doc_pass(r, req, &pd, k, &ids, &T, err);
        sum += T;
    }
    free(ids.v);
    free(pd.q.v);
    *tokens = sum;
    return st;
}
