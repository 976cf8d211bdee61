/* rerank_per_doc: the per-document methods, one prompt of its own per document on the
 * prompt cache (no shared prefix to reuse): query_likelihood (LongLLMLingua's r_k), relevance
 * (a yes/no question in the chat template) and fused (query likelihood's passes, their
 * question's attention to the document captured too). */
#include "pipeline/rerank_methods.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

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
    bool ql;    /* query_likelihood's prompt and scores (query_likelihood, fused), else relevance */
    bool fused; /* fused: the question's attention to the document too */
    fitm_ids q; /* query_likelihood: " {query}" + RESTRICT, the scored tokens */
    int64_t n_query; /* the ids of " {query}" at the start of q: fused's captured rows */
    int32_t answers[8]; /* relevance: first tokens of Yes/yes (n_yes), then of No/no (n_no) */
    int n_yes, n_no;
    uint8_t *use;  /* fused: (L) the layers of fuse_layers */
    int32_t n_use; /* fused: how many */
    double w;      /* fused: fuse_weight */
    double scale, bias; /* fused: relevance_score = sigmoid(scale x score + bias) */
    bool sentences;     /* query likelihood's passages: the best of the whole text and of its
                         * first sentence joined to each later one (passages = sentences) */
} per_doc;

/* Whether t[i] ends a sentence: '.', '!' or '?' followed by whitespace. */
static bool ends_sentence(const char *t, size_t n, size_t i)
{
    return (t[i] == '.' || t[i] == '!' || t[i] == '?') && i + 1 < n &&
           isspace((unsigned char)t[i + 1]);
}

/* The sentence that starts at or after *at in t (leading whitespace skipped), its bytes
 * [*from, *to); *at moves past it. false when none is left. */
static bool next_sentence(const char *t, size_t n, size_t *at, size_t *from, size_t *to)
{
    size_t i = *at;
    while (i < n && isspace((unsigned char)t[i]))
        i++;
    if (i >= n)
        return false;
    *from = i;
    while (i < n && !ends_sentence(t, n, i))
        i++;
    *to = *at = i < n ? i + 1 : n;
    return true;
}

/* Document k's passages: 1 (its whole text), or with `sentences` and three sentences or
 * more, one per sentence: the whole text, then the first sentence joined by a space to each
 * later one. */
static int32_t doc_passages(const fitm_rerank_request *req, const per_doc *pd, int32_t k)
{
    const fitm_rerank_doc *d = &req->docs[k];
    int32_t n = 0;
    size_t at = 0, from, to;
    while (pd->sentences && n < INT32_MAX && next_sentence(d->text, d->text_len, &at, &from, &to))
        n++;
    return n >= 3 ? n : 1;
}

/* Where a document's passages are: its first sentence, and where the next passage's sentence
 * is looked for (each passage continues from the one before, so a document's passages cost
 * one scan of its text). */
typedef struct {
    size_t f0, t0, at;
} passage_cursor;

/* Passage j of document k (doc_passages, taken in order from 0 with the same cursor) into
 * *text, *len: the document's own text for j 0, else a new string in *buf (freed by the
 * caller). */
static fitm_status passage_text(const fitm_rerank_request *req, int32_t k, int32_t j,
                                passage_cursor *c, const char **text, size_t *len, char **buf,
                                fitm_err *err)
{
    const fitm_rerank_doc *d = &req->docs[k];
    *buf = NULL;
    *text = d->text;
    *len = d->text_len;
    if (j == 0) {
        *c = (passage_cursor){0};
        if (!next_sentence(d->text, d->text_len, &c->at, &c->f0, &c->t0))
            c->f0 = c->t0 = 0;
        return FITM_OK;
    }
    size_t fj = 0, tj = 0;
    if (!next_sentence(d->text, d->text_len, &c->at, &fj, &tj))
        return fitm_err_set(err, FITM_ERR_INTERNAL, "document %d has no passage %d", k, j);
    const size_t n0 = c->t0 - c->f0;
    if (!(*buf = malloc(n0 + 1 + (tj - fj) + 1)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    memcpy(*buf, d->text + c->f0, n0);
    (*buf)[n0] = ' ';
    memcpy(*buf + n0 + 1, d->text + fj, tj - fj);
    *len = n0 + 1 + (tj - fj);
    (*buf)[*len] = 0;
    *text = *buf;
    return FITM_OK;
}

/* query_likelihood's prompt for passage j of document k: BOS, its text (its tokens' span into
 * *doc), then "\n\nQuestion:" and the scored question (whose last token is never fed). */
static fitm_status ql_prompt(const fitm_session *r, const fitm_rerank_request *req, int32_t k,
                             int32_t j, passage_cursor *c, const per_doc *pd, fitm_ids *ids,
                             fitm_span *doc, fitm_err *err)
{
    const char *text;
    size_t len;
    char *buf;
    fitm_status st = passage_text(req, k, j, c, &text, &len, &buf, err);
    if (!st)
        st = fitm_prompt_encode(r->tok, ids, "", 0, FITM_TOK_ADD_BOS, -1, err);
    const int64_t body = ids->n;
    if (!st)
        st = fitm_prompt_encode(r->tok, ids, text, len, 0, fitm_prompt_doc_keep(req), err);
    free(buf);
    *doc = (fitm_span){body, ids->n};
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

/* fused's layers (the request's fuse_layers, else the server's; never empty) and weight into
 * pd. */
static fitm_status fuse_options(const fitm_session *r, const fitm_rerank_request *req,
                                per_doc *pd, fitm_err *err)
{
    const fitm_score_opts *o = req->opt.fuse_layers ? &req->opt : &r->defaults;
    pd->w = !isnan(req->opt.fuse_weight) ? req->opt.fuse_weight : r->defaults.fuse_weight;
    pd->scale = !isnan(req->opt.fuse_scale) ? req->opt.fuse_scale : r->defaults.fuse_scale;
    pd->bias = !isnan(req->opt.fuse_bias) ? req->opt.fuse_bias : r->defaults.fuse_bias;
    if (!(pd->use = calloc((size_t)r->L, 1)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_status st =
        fitm_layers_choose(r, "fuse_layers", o->fuse_layers, o->n_fuse_layers, pd->use, err);
    for (int32_t l = 0; l < r->L; l++)
        pd->n_use += pd->use[l];
    return st;
}

static fitm_status per_doc_init(const fitm_session *r, const fitm_rerank_request *req, per_doc *pd,
                                fitm_err *err)
{
    static const char *const YES[4] = {" Yes", "Yes", " yes", "yes"};
    static const char *const NO[4] = {" No", "No", " no", "no"};
    if (pd->ql) {
        const int32_t passages =
            req->opt.passages >= 0 ? req->opt.passages : r->defaults.passages;
        pd->sentences = passages == FITM_PASSAGES_SENTENCES;
        size_t n = req->query_len + sizeof RESTRICT + 1;
        char *buf = malloc(n);
        if (!buf)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        /* fused's query rows: the leading ids of q that " {query}" encoded alone also begins
         * with (all of them unless the tokenizer merged the query's end with RESTRICT's
         * start, as a trailing space may be) */
        fitm_ids alone = {0};
        int len = snprintf(buf, n, " %s", req->query);
        fitm_status st = pd->fused ? fitm_prompt_encode(r->tok, &alone, buf, (size_t)len,
                                                        FITM_TOK_CONTINUATION, -1, err)
                                   : FITM_OK;
        len = snprintf(buf, n, " %s%s", req->query, RESTRICT);
        if (st == FITM_OK)
            st = fitm_prompt_encode(r->tok, &pd->q, buf, (size_t)len, FITM_TOK_CONTINUATION, -1,
                                    err);
        free(buf);
        while (st == FITM_OK && pd->n_query < alone.n && pd->n_query < pd->q.n &&
               pd->q.v[pd->n_query] == alone.v[pd->n_query])
            pd->n_query++;
        free(alone.v);
        return st == FITM_OK && pd->fused ? fuse_options(r, req, pd, err) : st;
    }
    pd->n_yes = answer_ids(r->tok, YES, pd->answers);
    pd->n_no = answer_ids(r->tok, NO, pd->answers + pd->n_yes);
    if (!pd->n_yes || !pd->n_no)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "'method' = 'relevance': the vocabulary cannot spell Yes/No");
    return FITM_OK;
}

/* Passage j of document k's pass: its prompt into ids and the T tokens the pass feeds
 * (query_likelihood never feeds the question's last token), checked against the context.
 * The run and the cost both take a passage's pass from here. */
static fitm_status doc_pass(const fitm_session *r, const fitm_rerank_request *req,
                            const per_doc *pd, int32_t k, int32_t j, passage_cursor *c,
                            fitm_ids *ids, int64_t *T, fitm_span *doc, fitm_err *err)
{
    ids->n = 0;
    *doc = (fitm_span){0, 0};
    fitm_status st = pd->ql ? ql_prompt(r, req, k, j, c, pd, ids, doc, err)
                            : relevance_prompt(r, req, k, ids, err);
    *T = pd->ql ? ids->n - 1 : ids->n;
    if (st == FITM_OK && *T > r->n_ctx)
        st = fitm_prompt_too_long(*T, r, req, err);
    return st;
}

/* ---- the run: a state machine over the documents, lane by lane --------------------------- */

/* A lane's part of the run between two passes: its share of the documents, the document it
 * is at, how far that one's passes got, and what its logit rows so far added up to. */
typedef struct {
    fitm_kv *kv;
    int32_t k, k_end; /* the document running, and the end of the lane's share */
    int32_t j, n_pass;  /* the document's passage running, and how many it has */
    passage_cursor cur; /* where its passages are */
    double best;        /* query_likelihood: the best passage's mean log-probability so far */
    fitm_ids ids;       /* its prompt */
    int64_t T, at;    /* its fed tokens; the next pass's first row (-1: not begun) */
    double sum;       /* query_likelihood: its question's log-probabilities so far; relevance:
                       * its score */
    double *lp;       /* (rows, n_pick) the logit rows' log-probabilities: rows = the most
                       * logit rows of one pass; query_likelihood picks each row's next token,
                       * relevance the answer ids */
    fitm_pass pass;   /* the pass handed out */
    bool drained;     /* its share is done */
    /* fused: the document's span, the pass's captured query rows, their masses and the sum
     * of those so far over the rows and the layers' heads */
    fitm_span doc;
    fitm_capture cap;
    int64_t *rows; /* (n_query) */
    float *mass;   /* (n_query, L, H) */
    double att;
} doc_lane;

/* The run: what the lanes share (the method's texts, the results, the counts) and each
 * lane's part. A document's score reads only its own passes' logit rows. */
typedef struct {
    fitm_passes *ps;
    const fitm_rerank_request *req;
    fitm_rerank_result *res;
    per_doc pd;
    double t0, tok_ms; /* when the run started; its tokenizing */
    int64_t forward, T_max;
    int32_t n_lanes, n_drained;
    doc_lane *lanes; /* (n_lanes) */
} per_doc_run;

/* Lane ln's document k's passage j's prompt (doc_pass, timed apart) and its cache rebased at
 * 0. */
static fitm_status doc_begin(per_doc_run *d, doc_lane *ln, fitm_err *err)
{
    const double t0 = fitm_clock_ms();
    if (ln->j == 0) {
        ln->n_pass = doc_passages(d->req, &d->pd, ln->k);
        ln->att = 0;
    }
    fitm_status st =
        doc_pass(d->ps->s, d->req, &d->pd, ln->k, ln->j, &ln->cur, &ln->ids, &ln->T, &ln->doc,
                 err);
    d->tok_ms += fitm_clock_ms() - t0;
    if (st == FITM_OK)
        st = fitm_kv_rebase(ln->kv, 0, err);
    d->T_max = ln->T > d->T_max ? ln->T : d->T_max;
    d->forward += ln->T;
    ln->at = 0;
    ln->sum = 0;
    return st;
}

/* fused: the capture of the query's rows (the first n_query of the scored question) among
 * the n rows of lane ln's next pass, over its document's span; NULL when it has none. */
static const fitm_capture *query_rows(const per_doc_run *d, doc_lane *ln, int64_t n)
{
    const int64_t q0 = ln->ids.n - d->pd.q.n;
    const int64_t from = q0 > ln->at ? q0 : ln->at;
    const int64_t to = q0 + d->pd.n_query < ln->at + n ? q0 + d->pd.n_query : ln->at + n;
    int32_t n_rows = 0;
    for (int64_t p = from; p < to; p++)
        ln->rows[n_rows++] = p;
    ln->cap = (fitm_capture){.rows = ln->rows, .n_rows = n_rows, .spans = &ln->doc, .n_spans = 1,
                             .span_mass = ln->mass};
    return n_rows > 0 ? &ln->cap : NULL;
}

/* Lane ln's document's next pass from row at, or false when its passes have all run.
 * query_likelihood: the question's rows head .. T - 1 (each predicts the next token) with
 * logits, at most logit_rows a pass, the first pass also taking every row before them: a
 * question of at most logit_rows tokens is one pass with the document. relevance: the whole
 * prompt, the last row's logits. A row's values do not depend on the pass it is in (the
 * forward's numerics classes), and the question's log-probabilities are added in row order
 * whatever the passes. */
static bool doc_next_pass(const per_doc_run *d, doc_lane *ln)
{
    const fitm_session *r = d->ps->s;
    if (ln->at >= ln->T)
        return false;
    int64_t n, n_logits;
    if (d->pd.ql) {
        const int64_t head = ln->ids.n - d->pd.q.n - 1;
        const int64_t from = head > ln->at ? head : ln->at; /* the first logit row */
        n_logits = (ln->T - from - 1) % r->logit_rows + 1;  /* the rest go logit_rows a pass */
        n = from - ln->at + n_logits;
    } else {
        n = ln->T - ln->at;
        n_logits = 1;
    }
    /* query_likelihood's row i picks the token after it, ids[at + i + 1]: the question's
     * ids from the second on, as they stand in the prompt */
    const int32_t n_pick = d->pd.ql ? 1 : d->pd.n_yes + d->pd.n_no;
    const int32_t *pick = d->pd.ql ? ln->ids.v + ln->at + (n - n_logits) + 1 : d->pd.answers;
    ln->pass = fitm_passes_pass(d->ps, ln->kv, NULL, ln->ids.v + ln->at, n, ln->at,
                                d->pd.fused && ln->j == 0 ? query_rows(d, ln, n) : NULL,
                                n_logits, n_pick, pick, ln->lp);
    return true;
}

/* Lane ln's passage's score once its passes ran: on to the document's next passage, else the
 * document's score (its best passage's) and on to its next document. fused's attention is
 * that of the whole text's passes (passage 0). */
static void doc_end(per_doc_run *d, doc_lane *ln)
{
    const fitm_session *r = d->ps->s;
    const double lp = ln->sum / (double)d->pd.q.n;
    ln->best = ln->j == 0 || lp > ln->best ? lp : ln->best;
    ln->at = -1;
    if (++ln->j < ln->n_pass)
        return;
    ln->j = 0;
    const double mean_lp = ln->best;
    /* fused: the mean log-probability for now, combined with the attention once every
     * document has both (fuse) */
    const double score = d->pd.fused ? mean_lp : d->pd.ql ? exp(mean_lp) : ln->sum;
    const double n_att = (double)d->pd.n_query * d->pd.n_use * r->H;
    d->res->results[ln->k] = (fitm_rerank_doc_result){
        .index = ln->k,
        .position = ln->k,
        .relevance_score = score,
        .raw_score = score,
        .attention = d->pd.fused && n_att > 0 ? ln->att / n_att : 0};
    ln->k++;
}

/* fused's scores, every document scored: raw_score_k = mean log-probability_k + w x z_k, z
 * the z-score of attention over the K documents (0 when it does not vary), and
 * relevance_score_k = sigmoid(scale x raw_score_k + bias), in (0, 1) as every other method's. */
static void fuse(fitm_rerank_doc_result *res, int32_t K, const per_doc *pd)
{
    double m = 0, var = 0;
    for (int32_t k = 0; k < K; k++)
        m += res[k].attention;
    m /= K;
    for (int32_t k = 0; k < K; k++)
        var += (res[k].attention - m) * (res[k].attention - m);
    const double sd = sqrt(var / K);
    for (int32_t k = 0; k < K; k++) {
        const double z = sd > 0 ? (res[k].attention - m) / sd : 0;
        res[k].raw_score = res[k].raw_score + pd->w * z;
        res[k].relevance_score = fitm_score_sigmoid(res[k].raw_score, pd->scale, pd->bias);
    }
}

static fitm_status per_doc_next(void *run, int32_t lane, const fitm_pass **pass, fitm_err *err)
{
    per_doc_run *d = run;
    doc_lane *ln = &d->lanes[lane];
    *pass = NULL;
    fitm_status st = FITM_OK;
    while (st == FITM_OK && ln->k < ln->k_end) {
        if (ln->at < 0)
            st = doc_begin(d, ln, err);
        else if (doc_next_pass(d, ln))
            break;
        else
            doc_end(d, ln);
    }
    if (st != FITM_OK)
        return st;
    if (ln->k < ln->k_end) {
        *pass = &ln->pass;
        return FITM_OK;
    }
    if (!ln->drained) {
        ln->drained = true;
        /* every document scored: the results in ranking order */
        if (++d->n_drained == d->n_lanes) {
            if (d->pd.fused)
                fuse(d->res->results, d->req->n_docs, &d->pd);
            fitm_results_sort(d->res->results, d->req->n_docs);
        }
    }
    return FITM_OK;
}

/* The pass handed out for a lane has run: its logit rows read. query_likelihood: each row's
 * log-probability of the token after it, added in row order; relevance: P(yes) / (P(yes) +
 * P(no)) of its last row, over the first tokens of "Yes"/"yes" and "No"/"no". */
static void per_doc_ran(void *run, int32_t lane)
{
    per_doc_run *d = run;
    doc_lane *ln = &d->lanes[lane];
    const fitm_pass *p = &ln->pass;
    if (d->pd.ql) {
        for (int64_t i = 0; i < p->n_logits; i++)
            ln->sum += ln->lp[i];
        const fitm_session *r = d->ps->s;
        const float *mass = p->cap ? p->cap->span_mass : NULL; /* (rows, L, H) */
        for (int32_t i = 0; mass && i < p->cap->n_rows; i++)
            for (int32_t l = 0; l < r->L; l++)
                if (d->pd.use[l])
                    for (int32_t h = 0; h < r->H; h++)
                        ln->att += mass[((int64_t)i * r->L + l) * r->H + h];
    } else {
        double py = 0, pn = 0;
        for (int i = 0; i < d->pd.n_yes; i++)
            py += exp(ln->lp[i]);
        for (int i = 0; i < d->pd.n_no; i++)
            pn += exp(ln->lp[d->pd.n_yes + i]);
        ln->sum = py + pn > 0 ? py / (py + pn) : 0.5;
    }
    ln->at = p->pos0 + p->n;
}

static fitm_status per_doc_end(void *run, fitm_status st)
{
    per_doc_run *d = run;
    if (!d)
        return st;
    fitm_rerank_result *res = d->res;
    res->usage = (fitm_rerank_usage){
        .prompt_tokens = d->T_max, .forward_tokens = d->forward, .total_tokens = d->T_max};
    res->meta.tokenize_ms = d->tok_ms;
    res->meta.forward_ms = fitm_clock_ms() - d->t0 - d->tok_ms;
    for (int32_t l = 0; d->lanes && l < d->n_lanes; l++) {
        free(d->lanes[l].ids.v);
        free(d->lanes[l].lp);
        free(d->lanes[l].rows);
        free(d->lanes[l].mass);
    }
    free(d->lanes);
    free(d->pd.q.v);
    free(d->pd.use);
    free(d);
    return st;
}

/* The lanes, each with its share of the K documents, its cache and room for one pass's
 * logit rows' log-probabilities. */
static fitm_status lanes_start(per_doc_run *d, fitm_err *err)
{
    const fitm_session *r = d->ps->s;
    d->n_lanes = d->ps->n_lanes;
    if (!(d->lanes = calloc((size_t)d->n_lanes, sizeof *d->lanes)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    /* relevance: one row of n_yes + n_no picks; query_likelihood: a pass's rows, one each */
    const int64_t n_lp = !d->pd.ql                   ? d->pd.n_yes + d->pd.n_no
                         : d->pd.q.n < r->logit_rows ? d->pd.q.n
                                                     : r->logit_rows;
    /* fused: room for every query row of a pass and its masses */
    const size_t n_rows = d->pd.fused && d->pd.n_query > 0 ? (size_t)d->pd.n_query : 1;
    for (int32_t l = 0; l < d->n_lanes; l++) {
        doc_lane *ln = &d->lanes[l];
        fitm_passes_share(d->req->n_docs, d->n_lanes, l, &ln->k, &ln->k_end);
        ln->kv = d->ps->kv[l];
        ln->at = -1;
        if (!(ln->lp = malloc((size_t)(n_lp > 0 ? n_lp : 1) * sizeof *ln->lp)))
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        if (d->pd.fused &&
            (!(ln->rows = malloc(n_rows * sizeof *ln->rows)) ||
             !(ln->mass = malloc(n_rows * (size_t)r->L * (size_t)r->H * sizeof *ln->mass))))
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    return FITM_OK;
}

/* The method's per_doc, nothing set up yet. */
static per_doc per_doc_mode(const fitm_rerank_request *req)
{
    const bool fused = req->method == FITM_RERANK_FUSED;
    return (per_doc){.ql = fused || req->method == FITM_RERANK_QUERY_LIKELIHOOD, .fused = fused};
}

/* fused's meta: the layers its attention averages over and its weight. */
static fitm_status fused_meta(const fitm_session *r, const per_doc *pd, fitm_rerank_result *res,
                              fitm_err *err)
{
    if (!(res->meta.layers = malloc((size_t)pd->n_use * sizeof *res->meta.layers)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < r->L; l++)
        if (pd->use[l])
            res->meta.layers[res->meta.n_layers++] = l;
    res->meta.opts.fuse_weight = pd->w;
    res->meta.opts.fuse_scale = pd->scale;
    res->meta.opts.fuse_bias = pd->bias;
    snprintf(res->meta.profile, sizeof res->meta.profile, "%s", r->profile);
    return FITM_OK;
}

/* query_likelihood (LongLLMLingua's r_k): per document, the mean log-probability of
 * " {query} We can get the answer to this question in the given documents." after
 * "{text}\n\nQuestion:"; relevance_score = exp of it (the tokens' geometric-mean probability).
 * relevance: per document, "Document: {text}\n\nQuestion: {query}\n\nIs the document relevant
 * to the question? Answer Yes or No." in the chat template; relevance_score = P(yes) /
 * (P(yes) + P(no)). One prompt per document on a cache of its own (no shared prefix to
 * reuse). */
fitm_status fitm_per_doc_start(fitm_passes *ps, const fitm_rerank_request *req,
                               fitm_rerank_result *res, fitm_machine *m, fitm_err *err)
{
    per_doc_run *d = calloc(1, sizeof *d);
    *m = (fitm_machine){.run = d, .next = per_doc_next, .ran = per_doc_ran, .end = per_doc_end};
    if (!d)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const fitm_session *r = ps->s;
    const int32_t K = req->n_docs;
    *d = (per_doc_run){.ps = ps,
                       .req = req,
                       .res = res,
                       .t0 = fitm_clock_ms(),
                       .pd = per_doc_mode(req)};
    res->results = calloc((size_t)K, sizeof *res->results);
    res->n_results = res->results ? K : 0;
    fitm_status st = res->results ? per_doc_init(r, req, &d->pd, err)
                                  : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (st == FITM_OK && d->pd.fused)
        st = fused_meta(r, &d->pd, res, err);
    res->meta.opts.passages = d->pd.sentences ? FITM_PASSAGES_SENTENCES : FITM_PASSAGES_WHOLE;
    return st == FITM_OK ? lanes_start(d, err) : st;
}

fitm_status fitm_per_doc_run(fitm_passes *ps, const fitm_rerank_request *req,
                             fitm_rerank_result *res, fitm_err *err)
{
    fitm_machine m;
    fitm_status st = fitm_per_doc_start(ps, req, res, &m, err);
    return fitm_machine_run(ps, &m, st, err);
}

/* Each passage's pass (doc_pass), as the run takes them: their fed tokens in all and the
 * most of one. */
static fitm_status doc_passes(const fitm_session *r, const fitm_rerank_request *req, int64_t *sum,
                              int64_t *most, fitm_err *err)
{
    per_doc pd = per_doc_mode(req);
    fitm_ids ids = {0};
    *sum = *most = 0;
    fitm_status st = per_doc_init(r, req, &pd, err);
    passage_cursor c;
    for (int32_t k = 0; st == FITM_OK && k < req->n_docs; k++)
        for (int32_t j = 0, n = doc_passages(req, &pd, k); st == FITM_OK && j < n; j++) {
            int64_t T = 0;
            fitm_span doc;
            st = doc_pass(r, req, &pd, k, j, &c, &ids, &T, &doc, err);
            *sum += T;
            *most = T > *most ? T : *most;
        }
    free(ids.v);
    free(pd.q.v);
    free(pd.use);
    return st;
}

fitm_status fitm_per_doc_cost(const fitm_session *r, const fitm_rerank_request *req,
                              int64_t *tokens, fitm_err *err)
{
    int64_t most = 0;
    return doc_passes(r, req, tokens, &most, err);
}

fitm_status fitm_per_doc_rows(const fitm_session *r, const fitm_rerank_request *req, int64_t *rows,
                              fitm_err *err)
{
    int64_t sum = 0;
    return doc_passes(r, req, &sum, rows, err);
}
