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

fitm_status fitm_answer_run(fitm_reranker *r, const fitm_answer_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_answer_on_delta on_delta, void *delta_arg, fitm_answer_result *res,
                            fitm_err *err)
{
    memset(res, 0, sizeof *res);
    double t0 = now_ms();
    fitm_reranker_parts P;
    fitm_reranker_parts_of(r, &P);
    const fitm_model_config *c = fitm_model_config_of(P.m);
    const int32_t K = req->base.n_docs, L = c->n_layer;
    fitm_status st = FITM_OK;
    fitm_rerank_result rr = {0};
    int32_t *order = malloc((size_t)K * sizeof *order);
    fitm_rerank_doc *docs = malloc((size_t)K * sizeof *docs);
    fitm_span *spans = calloc((size_t)K, sizeof *spans);
    float *alpha = malloc((size_t)K * sizeof *alpha);
    uint8_t *use = calloc((size_t)L, 1);
    text_buf text = {0};
    sampler sm = {.req = req, .V = c->n_vocab, .rng = req->seed};
    sm.logits = malloc((size_t)sm.V * sizeof *sm.logits);
    sm.sorted =
        req->temperature > 0 && req->top_p < 1.0 ? malloc((size_t)sm.V * sizeof *sm.sorted) : NULL;
    res->docs = calloc((size_t)K, sizeof *res->docs);
    res->n_docs = K;
    if (!order || !docs || !spans || !alpha || !use || !sm.logits || !res->docs ||
        (req->temperature > 0 && req->top_p < 1.0 && !sm.sorted)) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int32_t k = 0; k < K; k++) {
        order[k] = k;
        alpha[k] = 1.0f / (float)K;
        res->docs[k] = (fitm_answer_doc){.index = k, .position = k, .weight = 1.0 / K};
    }

    /* Reorder (most relevant first), then calibrate on the reordered prompt. */
    if (req->reorder >= 0) {
        if ((st = rank(r, req, (fitm_rerank_method)req->reorder, req->base.docs, stop, stop_arg,
                       &rr, err)) != FITM_OK)
            goto done;
        for (int32_t p = 0; p < K; p++)
            order[p] = rr.results[p].index;
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_result_free(&rr);
    }
    for (int32_t p = 0; p < K; p++) {
        docs[p] = req->base.docs[order[p]];
        res->docs[order[p]].position = p;
    }
    if (req->calibrate) {
        if ((st = rank(r, req, FITM_RERANK_CALIBRATED, docs, stop, stop_arg, &rr, err)) != FITM_OK)
            goto done;
        for (int32_t i = 0; i < K; i++) {
            int32_t p = rr.results[i].index; /* the reordered request's index = position */
            alpha[p] = (float)rr.results[i].relevance_score;
            res->docs[order[p]].weight = rr.results[i].relevance_score;
            res->docs[order[p]].calibrated_attention = rr.results[i].calibrated_attention;
        }
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_result_free(&rr);
    }
    res->rank_ms = now_ms() - t0;

    int64_t T = 0;
    if ((st = fitm_reranker_prompt(r, &req->base, order, &res->tokens, &T, spans, err)) != FITM_OK)
        goto done;
    if (T > P.n_ctx) {
        st = fitm_err_set(err, FITM_ERR_LIMIT,
                          "the prompt is %lld tokens, over the context of %lld tokens: send "
                          "fewer or shorter documents",
                          (long long)T, (long long)P.n_ctx);
        goto done;
    }
    /* Every generated token but the last needs a KV row. */
    int64_t max_gen = req->max_tokens < P.n_ctx - T + 1 ? req->max_tokens : P.n_ctx - T + 1;
    int32_t *grown = realloc(res->tokens, (size_t)(T + max_gen) * sizeof *grown);
    if (!grown) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    res->tokens = grown;
    res->prompt_tokens = T;
    res->spans = malloc((size_t)K * sizeof *res->spans);
    if (!res->spans) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int32_t p = 0; p < K; p++)
        res->spans[order[p]] = spans[p];
    /* Room for typical pieces up front, so the token loop rarely grows the text. */
    text.cap = (size_t)max_gen * 32 + 1;
    if (!(text.v = malloc(text.cap))) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the answer text");
        goto done;
    }
    text.v[0] = '\0';

    if (req->intervene_layers) {
        for (int32_t i = 0; i < req->n_intervene_layers; i++) {
            int32_t l = req->intervene_layers[i];
            if (l < 0)
                l += L;
            if (l < 0 || l >= L) {
                st = fitm_err_set(err, FITM_ERR_INVALID,
                                  "'intervention_layers[%d]' = %d: the model has %d layers", (int)i,
                                  (int)req->intervene_layers[i], (int)L);
                goto done;
            }
            use[l] = 1;
        }
    } else {
        for (int32_t l = L / 2; l < L; l++)
            use[l] = 1;
    }
    fitm_intervention iv = {
        .spans = spans, .n_spans = K, .alpha = alpha, .layers = use, .from_pos = spans[K - 1].end};
    const fitm_intervention *ivp = req->calibrate ? &iv : NULL;

    /* Prefill on the batch path in every chunk (as `fitm generate`'s one call), logits for the
     * last prompt token. The calibrated scoring just computed this very prompt into the cache
     * (rerank.h), and rows before the intervention are the same with or without it: only
     * [from_pos, T) is recomputed then. */
    double t1 = now_ms();
    int64_t start = req->calibrate ? iv.from_pos : 0;
    for (int64_t off = start; off < T; off += P.chunk) {
        if (stop && stop(stop_arg)) {
            st = stopped(err);
            goto done;
        }
        int64_t len = T - off < P.chunk ? T - off : P.chunk;
        bool last = off + len == T;
        fitm_forward_opts o = {.n_logits = last ? 1 : 0,
                               .logits = last ? sm.logits : NULL,
                               .intervention = ivp,
                               .path = FITM_PATH_BATCH};
        if ((st = fitm_forward_run(P.fwd, P.kv, res->tokens + off, len, off, &o, err)) != FITM_OK)
            goto forward_failed;
    }
    res->forward_tokens += T - start;
    res->prefill_ms = now_ms() - t1;

    double t2 = now_ms();
    res->finish = FITM_FINISH_LENGTH;
    int64_t n_done = 0;
    while (n_done < max_gen) {
        int32_t next = sample(&sm);
        res->tokens[T + n_done++] = next;
        res->completion_tokens = n_done;
        if (n_done == 1)
            res->first_token_ms = now_ms() - t0;
        if (fitm_tok_is_eog(P.tok, next)) {
            res->finish = FITM_FINISH_STOP;
            break;
        }
        char piece[FITM_TOK_MAX_PIECE_BYTES];
        size_t n_piece = 0;
        if ((st = fitm_tok_piece(P.tok, next, 0, piece, sizeof piece, &n_piece, err)) != FITM_OK ||
            (st = text_append(&text, piece, n_piece, err)) != FITM_OK)
            goto done;
        if (cut_at_stop(req, &text, n_piece)) {
            res->finish = FITM_FINISH_STOP;
            break;
        }
        if ((st = flush(req, &text, false, on_delta, delta_arg, err)) != FITM_OK)
            goto done;
        if (n_done == max_gen)
            break;
        if (stop && stop(stop_arg)) {
            st = stopped(err);
            goto done;
        }
        int64_t pos = T + n_done - 1;
        fitm_forward_opts o = {.n_logits = 1, .logits = sm.logits, .intervention = ivp};
        if ((st = fitm_forward_run(P.fwd, P.kv, &res->tokens[pos], 1, pos, &o, err)) != FITM_OK)
            goto forward_failed;
        res->forward_tokens++;
    }
    if ((st = flush(req, &text, true, on_delta, delta_arg, err)) != FITM_OK)
        goto done;
    res->n_tokens = T + n_done;
    res->decode_ms = now_ms() - t2;
    if (!text.v && (st = text_append(&text, "", 0, err)) != FITM_OK)
        goto done;
    res->answer = text.v;
    res->answer_len = text.n;
    text.v = NULL;
    res->total_ms = now_ms() - t0;
    goto done;
forward_failed:
    if (st == FITM_ERR_INVALID || st == FITM_ERR_LIMIT) {
        fitm_err_prefix(err, "forward pass");
        st = FITM_ERR_INTERNAL; /* arguments were checked: this is a bug */
    }
done:
    fitm_rerank_result_free(&rr);
    free(order);
    free(docs);
    free(spans);
    free(alpha);
    free(use);
    free(sm.logits);
    free(sm.sorted);
    free(text.v);
    return st;
}
