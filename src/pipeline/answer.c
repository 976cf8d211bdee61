/* answer: POST /answer's pipeline (see answer.h). */
#include "pipeline/answer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/rng.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

void fitm_answer_request_free(fitm_answer_request *req)
{
    if (!req)
        return;
    fitm_rerank_request_free(&req->base);
    for (int32_t i = 0; i < req->n_stop; i++)
        free(req->stop[i]);
    free(req->stop);
    free(req->intervene_layers);
    memset(req, 0, sizeof *req);
}

void fitm_answer_result_free(fitm_answer_result *res)
{
    if (!res)
        return;
    free(res->answer);
    free(res->docs);
    free(res->tokens);
    free(res->spans);
    memset(res, 0, sizeof *res);
}

const char *fitm_answer_finish_name(fitm_answer_finish f)
{
    return f == FITM_FINISH_LENGTH ? "length" : "stop";
}

uint64_t fitm_answer_rand(uint64_t *state)
{
    return fitm_rng_next(state);
}

static double now_ms(void)
{
    return fitm_clock_ms();
}

/* One vocabulary entry's probability, for the top_p sort. */
typedef struct {
    float p;
    int32_t id;
} prob_id;

/* The decoding state of one request: everything allocated once before the token loop. */
typedef struct {
    const fitm_answer_request *req;
    int32_t V;
    float *logits;   /* (V) */
    prob_id *sorted; /* (V) scratch for top_p; NULL when greedy or top_p = 1 */
    uint64_t rng;
} sampler;

static int cmp_prob_desc(const void *a, const void *b)
{
    const prob_id *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return x->id - y->id;
}

/* Greedy: the first maximum (as `fitm generate`). Else softmax(logits / temperature) cut to
 * the smallest set of most likely tokens whose mass reaches top_p, drawn from the PRNG. */
static int32_t sample(sampler *s)
{
    const float *l = s->logits;
    int32_t best = 0;
    for (int32_t i = 1; i < s->V; i++)
        if (l[i] > l[best])
            best = i;
    double t = s->req->temperature;
    if (t <= 0)
        return best;
    /* Probabilities (unnormalised) in place of the logits: the row is not needed again. */
    float *p = s->logits;
    float mx = p[best];
    double total = 0;
    for (int32_t i = 0; i < s->V; i++) {
        p[i] = (float)exp((double)(p[i] - mx) / t);
        total += p[i];
    }
    double u = (double)(fitm_answer_rand(&s->rng) >> 11) * 0x1.0p-53;
    if (!s->sorted) {
        double acc = 0, target = u * total;
        for (int32_t i = 0; i < s->V; i++) {
            acc += p[i];
            if (acc > target)
                return i;
        }
        return best;
    }
    for (int32_t i = 0; i < s->V; i++)
        s->sorted[i] = (prob_id){p[i], i};
    qsort(s->sorted, (size_t)s->V, sizeof *s->sorted, cmp_prob_desc);
    double keep = 0;
    int32_t n = 0;
    while (n < s->V && keep < s->req->top_p * total)
        keep += s->sorted[n++].p;
    double acc = 0, target = u * keep;
    for (int32_t i = 0; i < n; i++) {
        acc += s->sorted[i].p;
        if (acc > target)
            return s->sorted[i].id;
    }
    return s->sorted[n > 0 ? n - 1 : 0].id;
}

/* The text buffer, what was handed to on_delta, and the stop-string logic. */
typedef struct {
    char *v;
    size_t n, cap, sent;
} text_buf;

static fitm_status text_append(text_buf *t, const char *s, size_t n, fitm_err *err)
{
    if (t->n + n + 1 > t->cap) {
        size_t cap = (t->cap + n + 1) * 2;
        char *v = realloc(t->v, cap);
        if (!v)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the answer text");
        t->v = v;
        t->cap = cap;
    }
    memcpy(t->v + t->n, s, n);
    t->n += n;
    t->v[t->n] = '\0';
    return FITM_OK;
}

/* Cuts the text at the first stop string that ends in the last n_new bytes; true if one did. */
static bool cut_at_stop(const fitm_answer_request *req, text_buf *t, size_t n_new)
{
    size_t best = (size_t)-1;
    for (int32_t i = 0; i < req->n_stop; i++) {
        size_t sl = strlen(req->stop[i]);
        size_t from = t->n >= n_new + sl ? t->n - n_new - sl + 1 : 0;
        for (size_t j = from; j + sl <= t->n && j < best; j++)
            if (!memcmp(t->v + j, req->stop[i], sl)) {
                best = j;
                break;
            }
    }
    if (best == (size_t)-1)
        return false;
    t->n = best;
    t->v[best] = '\0';
    if (t->sent > best)
        t->sent = best; /* cannot happen: held-back bytes cover every stop prefix */
    return true;
}

/* Bytes at the end of the text that could begin a stop string: not sent yet. */
static size_t held_back(const fitm_answer_request *req, const text_buf *t)
{
    size_t hold = 0;
    for (int32_t i = 0; i < req->n_stop; i++) {
        size_t sl = strlen(req->stop[i]);
        for (size_t l = sl - 1; l > hold; l--)
            if (l <= t->n && !memcmp(t->v + t->n - l, req->stop[i], l)) {
                hold = l;
                break;
            }
    }
    return hold;
}

/* Hands the sendable new text to on_delta (all of it when final). */
static fitm_status flush(const fitm_answer_request *req, text_buf *t, bool final,
                         fitm_answer_on_delta on_delta, void *arg, fitm_err *err)
{
    size_t end = t->n;
    if (!final) {
        end -= held_back(req, t);
        if (end < t->sent)
            end = t->sent;
        end = t->sent + fitm_tok_utf8_complete(t->v + t->sent, end - t->sent);
    }
    if (end == t->sent) /* nothing to send: still ask, so a gone client stops us */
        return final || !on_delta || on_delta(arg, "", 0)
                   ? FITM_OK
                   : fitm_err_set(err, FITM_ERR_CANCELLED, "the client went away");
    bool go_on = !on_delta || on_delta(arg, t->v + t->sent, end - t->sent);
    t->sent = end;
    return go_on ? FITM_OK : fitm_err_set(err, FITM_ERR_CANCELLED, "the client went away");
}

static fitm_status stopped(fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_TIMEOUT,
                        "stopped: the request's deadline passed or the server is shutting down");
}

/* Ranks with method on docs in order (NULL: request order) and returns the shallow request
 * copy's result in *out. */
static fitm_status rank(fitm_reranker *r, const fitm_answer_request *req, fitm_rerank_method m,
                        const fitm_rerank_doc *docs, bool (*stop)(const void *),
                        const void *stop_arg, fitm_rerank_result *out, fitm_err *err)
{
    fitm_rerank_request q = req->base;
    q.docs = (fitm_rerank_doc *)docs;
    q.method = m;
    q.top_n = q.n_docs;
    q.return_tokens = false;
    q.return_documents = false;
    q.tei = false;
    return fitm_reranker_run(r, &q, stop, stop_arg, out, err);
}

/* One answer's working state, allocated once before the token loop. */
typedef struct {
    int32_t K, L;
    int32_t *order;        /* (K) the document at each position                       */
    fitm_rerank_doc *docs; /* (K) the request's documents in that order (shallow)     */
    fitm_span *spans;      /* (K) their bodies in the answer prompt, by position      */
    float *alpha;          /* (K) the intervention's weights, by position             */
    uint8_t *use;          /* (L) the layers intervened in                            */
    fitm_intervention iv;
    bool intervene;
    sampler sm;
    text_buf text;
    int64_t T, max_gen;
} answer_state;

static void state_free(answer_state *s)
{
    free(s->order);
    free(s->docs);
    free(s->spans);
    free(s->alpha);
    free(s->use);
    free(s->sm.logits);
    free(s->sm.sorted);
    free(s->text.v);
}

static fitm_status state_init(const fitm_reranker *r, const fitm_answer_request *req,
                              answer_state *s, fitm_answer_result *res, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(fitm_reranker_model(r));
    const int32_t K = req->base.n_docs;
    bool sorted = req->temperature > 0 && req->top_p < 1.0;
    *s = (answer_state){.K = K, .L = c->n_layer,
                        .sm = {.req = req, .V = c->n_vocab, .rng = req->seed}};
    s->order = malloc((size_t)K * sizeof *s->order);
    s->docs = malloc((size_t)K * sizeof *s->docs);
    s->spans = calloc((size_t)K, sizeof *s->spans);
    s->alpha = malloc((size_t)K * sizeof *s->alpha);
    s->use = calloc((size_t)s->L, 1);
    s->sm.logits = malloc((size_t)s->sm.V * sizeof *s->sm.logits);
    s->sm.sorted = sorted ? malloc((size_t)s->sm.V * sizeof *s->sm.sorted) : NULL;
    res->docs = calloc((size_t)K, sizeof *res->docs);
    res->n_docs = K;
    if (!s->order || !s->docs || !s->spans || !s->alpha || !s->use || !s->sm.logits ||
        !res->docs || (sorted && !s->sm.sorted))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t k = 0; k < K; k++) {
        s->order[k] = k;
        s->alpha[k] = 1.0f / (float)K;
        res->docs[k] = (fitm_answer_doc){.index = k, .position = k, .weight = 1.0 / K};
    }
    return FITM_OK;
}

/* Step 1, order: the documents reordered by req->reorder (most relevant first), then the
 * intervention's weights from the calibrated scores of the reordered documents. */
static fitm_status order_documents(fitm_reranker *r, const fitm_answer_request *req,
                                   answer_state *s, bool (*stop)(const void *),
                                   const void *stop_arg, fitm_answer_result *res, fitm_err *err)
{
    fitm_rerank_result rr = {0};
    fitm_status st = FITM_OK;
    if (req->reorder >= 0) {
        st = rank(r, req, (fitm_rerank_method)req->reorder, req->base.docs, stop, stop_arg, &rr,
                  err);
        for (int32_t p = 0; st == FITM_OK && p < s->K; p++)
            s->order[p] = rr.results[p].index;
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_result_free(&rr);
    }
    for (int32_t p = 0; st == FITM_OK && p < s->K; p++) {
        s->docs[p] = req->base.docs[s->order[p]];
        res->docs[s->order[p]].position = p;
    }
    if (st == FITM_OK && req->calibrate) {
        st = rank(r, req, FITM_RERANK_CALIBRATED, s->docs, stop, stop_arg, &rr, err);
        for (int32_t i = 0; st == FITM_OK && i < s->K; i++) {
            int32_t p = rr.results[i].index; /* the reordered request's index = position */
            s->alpha[p] = (float)rr.results[i].weight;
            res->docs[s->order[p]].weight = rr.results[i].weight;
            res->docs[s->order[p]].calibrated_attention = rr.results[i].calibrated_attention;
        }
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_result_free(&rr);
    }
    return st;
}

/* The layers of the intervention: the request's, else the last half. */
static fitm_status intervention_layers(const fitm_answer_request *req, answer_state *s,
                                       fitm_err *err)
{
    if (!req->intervene_layers) {
        for (int32_t l = s->L / 2; l < s->L; l++)
            s->use[l] = 1;
        return FITM_OK;
    }
    for (int32_t i = 0; i < req->n_intervene_layers; i++) {
        int32_t l = req->intervene_layers[i] < 0 ? req->intervene_layers[i] + s->L
                                                 : req->intervene_layers[i];
        if (l < 0 || l >= s->L)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'intervention_layers[%d]' = %d: the model has %d layers", (int)i,
                                (int)req->intervene_layers[i], (int)s->L);
        s->use[l] = 1;
    }
    return FITM_OK;
}

/* One answer in progress: its working state, its own KV cache and where it stands. Every
 * buffer is allocated in fitm_answer_begin; steps allocate nothing. */
struct fitm_answer_seq {
    fitm_reranker *r;
    const fitm_answer_request *req;
    fitm_answer_result *res;
    bool (*stop)(const void *);
    const void *stop_arg;
    fitm_answer_on_delta on_delta;
    void *delta_arg;
    answer_state s;
    fitm_kv *kv;         /* [0, T + max_gen - 1) rows: the prompt, then the generated */
    int64_t pos;         /* the next position to compute                              */
    int64_t n_done;      /* tokens generated                                          */
    bool decoding;       /* the prompt is done; pos holds the last sampled token      */
    fitm_forward_opts o; /* this step's options                                       */
    double t0, t_prefill;
};

size_t fitm_answer_seq_kv_bytes(const fitm_answer_seq *q)
{
    return q->kv ? fitm_kv_bytes(q->kv) : 0;
}

/* Step 2, prefill setup: the answer prompt (the answer template for a model without a chat
 * template, else the chat-wrapped prompt of docs/design.md, Method) with the documents in
 * order, a cache of its own, and the rows the reranker's prompt cache already holds copied
 * into it (rows before the intervention are the same with or without it); the remaining
 * rows run in fitm_answer_step, with the intervention. */
static fitm_status prefill_setup(fitm_answer_seq *q, fitm_err *err)
{
    fitm_reranker *r = q->r;
    const fitm_answer_request *req = q->req;
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    const int64_t n_ctx = fitm_reranker_n_ctx(r);
    fitm_rerank_request rq = req->base;
    rq.docs = s->docs;
    fitm_status st = fitm_reranker_prompt(r, &rq, fitm_reranker_answer_frame(r), NULL,
                                          &res->tokens, &s->T, s->spans, err);
    if (st != FITM_OK)
        return st;
    if (s->T > n_ctx)
        return fitm_err_set(err, FITM_ERR_LIMIT,
                            "the prompt is %lld tokens, over the context of %lld tokens: send "
                            "fewer or shorter documents",
                            (long long)s->T, (long long)n_ctx);
    /* Every generated token but the last needs a KV row. */
    s->max_gen = req->max_tokens < n_ctx - s->T + 1 ? req->max_tokens : n_ctx - s->T + 1;
    int32_t *grown = realloc(res->tokens, (size_t)(s->T + s->max_gen) * sizeof *grown);
    res->spans = malloc((size_t)s->K * sizeof *res->spans);
    if (grown)
        res->tokens = grown;
    /* Room for typical pieces up front, so the token loop rarely grows the text. */
    s->text.cap = (size_t)s->max_gen * 32 + 1;
    s->text.v = malloc(s->text.cap);
    if (!grown || !res->spans || !s->text.v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    s->text.v[0] = '\0';
    res->prompt_tokens = s->T;
    for (int32_t p = 0; p < s->K; p++)
        res->spans[s->order[p]] = s->spans[p];
    if ((st = intervention_layers(req, s, err)) != FITM_OK)
        return st;
    s->iv = (fitm_intervention){.spans = s->spans, .n_spans = s->K, .alpha = s->alpha,
                                .layers = s->use, .from_pos = s->spans[s->K - 1].end};
    s->intervene = req->calibrate;
    int64_t start = fitm_reranker_cached(r, res->tokens, s->T);
    int64_t limit = s->intervene ? s->iv.from_pos : s->T - 1;
    start = start < limit ? start : limit;
    if ((st = fitm_reranker_kv_create(r, s->T + s->max_gen - 1, &q->kv, err)) != FITM_OK ||
        (st = fitm_reranker_copy_rows(r, q->kv, start, err)) != FITM_OK)
        return st;
    q->pos = start;
    res->forward_tokens += s->T - start;
    return FITM_OK;
}

fitm_status fitm_answer_begin(fitm_reranker *r, const fitm_answer_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_answer_on_delta on_delta, void *delta_arg,
                              fitm_answer_result *res, fitm_answer_seq **out, fitm_err *err)
{
    memset(res, 0, sizeof *res);
    *out = NULL;
    fitm_answer_seq *q = calloc(1, sizeof *q);
    if (!q)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    *q = (fitm_answer_seq){.r = r, .req = req, .res = res, .stop = stop, .stop_arg = stop_arg,
                           .on_delta = on_delta, .delta_arg = delta_arg, .t0 = now_ms()};
    *out = q;
    fitm_status st = state_init(r, req, &q->s, res, err);
    if (st == FITM_OK)
        st = order_documents(r, req, &q->s, stop, stop_arg, res, err);
    res->rank_ms = now_ms() - q->t0;
    q->t_prefill = now_ms();
    if (st == FITM_OK)
        st = prefill_setup(q, err);
    return st;
}

/* This step's part of sequence q: the next prompt chunk (at most budget tokens, on the batch
 * path, as fitm_reranker_prefill runs it) or the next decode step. */
static void step_part(fitm_answer_seq *q, int64_t budget, fitm_forward_seq *part)
{
    answer_state *s = &q->s;
    int64_t T = 1;
    if (!q->decoding)
        T = s->T - q->pos < budget ? s->T - q->pos : budget;
    const bool logits = q->decoding || q->pos + T == s->T;
    q->o = (fitm_forward_opts){.n_logits = logits ? 1 : 0,
                               .logits = logits ? s->sm.logits : NULL,
                               .intervention = s->intervene ? &s->iv : NULL,
                               .path = q->decoding ? FITM_PATH_AUTO : FITM_PATH_BATCH};
    *part = (fitm_forward_seq){q->kv, q->res->tokens + q->pos, T, q->pos, &q->o};
}

/* Step 3, decode, after a call that gave q's logits: sample, hand out text, stop at EOS, a
 * stop string or the length. *done when the answer is complete (or failed). */
static fitm_status after_logits(fitm_answer_seq *q, bool *done, fitm_err *err)
{
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    const fitm_answer_request *req = q->req;
    const fitm_tokenizer *tok = fitm_reranker_tokenizer(q->r);
    *done = true;
    if (!q->decoding) {
        q->decoding = true;
        res->prefill_ms = now_ms() - q->t_prefill;
        res->finish = FITM_FINISH_LENGTH;
    }
    int32_t next = sample(&s->sm);
    res->tokens[s->T + q->n_done++] = next;
    res->completion_tokens = q->n_done;
    if (q->n_done == 1)
        res->first_token_ms = now_ms() - q->t0;
    if (fitm_tok_is_eog(tok, next)) {
        res->finish = FITM_FINISH_STOP;
        return FITM_OK;
    }
    char piece[FITM_TOK_MAX_PIECE_BYTES];
    size_t n_piece = 0;
    fitm_status st;
    if ((st = fitm_tok_piece(tok, next, 0, piece, sizeof piece, &n_piece, err)) != FITM_OK ||
        (st = text_append(&s->text, piece, n_piece, err)) != FITM_OK)
        return st;
    if (cut_at_stop(req, &s->text, n_piece)) {
        res->finish = FITM_FINISH_STOP;
        return FITM_OK;
    }
    if ((st = flush(req, &s->text, false, q->on_delta, q->delta_arg, err)) != FITM_OK ||
        q->n_done == s->max_gen)
        return st;
    q->pos = s->T + q->n_done - 1;
    *done = false;
    return FITM_OK;
}

void fitm_answer_step(fitm_reranker *r, fitm_answer_seq *const *seqs, int32_t n,
                      int64_t prefill_budget, fitm_status *st, bool *done, fitm_err *errs)
{
    fitm_forward_seq parts[FITM_FORWARD_MAX_SEQS];
    int32_t idx[FITM_FORWARD_MAX_SEQS], n_parts = 0;
    int64_t room = fitm_reranker_batch_tokens(r), logit_room = fitm_reranker_batch_logits(r);
    /* Decode steps first (one row each), then prompt chunks in the order given, within the
     * budget; a sequence left out this step waits for the next. */
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < n; i++) {
            fitm_answer_seq *q = seqs[i];
            if (pass == 0) {
                st[i] = FITM_OK;
                done[i] = false;
                if (q->stop && q->stop(q->stop_arg)) {
                    st[i] = stopped(&errs[i]);
                    done[i] = true;
                    continue;
                }
            }
            if (done[i] || q->decoding != (pass == 0) || n_parts == FITM_FORWARD_MAX_SEQS ||
                logit_room < 1)
                continue;
            int64_t want = q->decoding ? 1 : (prefill_budget < room ? prefill_budget : room);
            if (want < 1 || (!q->decoding && pass == 1 && room < 1))
                continue;
            step_part(q, want, &parts[n_parts]);
            room -= parts[n_parts].T;
            logit_room -= q->o.n_logits;
            prefill_budget -= q->decoding ? 0 : parts[n_parts].T;
            idx[n_parts++] = i;
        }
    if (n_parts == 0)
        return;
    fitm_err err = {{0}};
    fitm_status bs = fitm_reranker_run_batch(r, parts, n_parts, &err);
    for (int32_t k = 0; k < n_parts; k++) {
        const int32_t i = idx[k];
        fitm_answer_seq *q = seqs[i];
        if (bs != FITM_OK) {
            st[i] = bs;
            errs[i] = err;
            done[i] = true;
            continue;
        }
        q->res->forward_tokens += q->decoding ? 1 : 0;
        if (q->o.n_logits == 0) { /* a prompt chunk before the last */
            q->pos += parts[k].T;
            continue;
        }
        st[i] = after_logits(q, &done[i], &errs[i]);
        done[i] = done[i] || st[i] != FITM_OK;
    }
}

fitm_status fitm_answer_end(fitm_answer_seq *q, fitm_status st, fitm_err *err)
{
    if (!q)
        return st;
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    res->n_tokens = s->T + q->n_done;
    res->decode_ms = q->decoding ? now_ms() - q->t_prefill - res->prefill_ms : 0.0;
    if (!q->decoding)
        res->prefill_ms = now_ms() - q->t_prefill;
    if (st == FITM_OK)
        st = flush(q->req, &s->text, true, q->on_delta, q->delta_arg, err);
    if (st == FITM_OK && !s->text.v)
        st = text_append(&s->text, "", 0, err);
    if (st == FITM_OK) {
        res->answer = s->text.v;
        res->answer_len = s->text.n;
        s->text.v = NULL;
    }
    res->total_ms = now_ms() - q->t0;
    state_free(s);
    fitm_kv_destroy(q->kv);
    free(q);
    return st;
}

fitm_status fitm_answer_run(fitm_reranker *r, const fitm_answer_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_answer_on_delta on_delta, void *delta_arg, fitm_answer_result *res,
                            fitm_err *err)
{
    fitm_answer_seq *q = NULL;
    fitm_status st = fitm_answer_begin(r, req, stop, stop_arg, on_delta, delta_arg, res, &q, err);
    bool done = st != FITM_OK;
    while (!done)
        fitm_answer_step(r, &q, 1, fitm_reranker_batch_tokens(r), &st, &done, err);
    return fitm_answer_end(q, st, err);
}
