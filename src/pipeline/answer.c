/* answer: POST /answer's pipeline (see answer.h): the request and result, the sampler, and an
 * answer's life as a sequence -- begin; step 1, the ranking (answer_order.c's phases, each a
 * rerank sequence whose passes the engine's steps carry, or attention_sort's whole run); step
 * 2, the prompt and the intervention (answer_prompt.c) and its own cache, seeded with the
 * prompt rows the session's prompt cache holds (the ranking's last); then one part per
 * engine step (a prompt chunk or a decode step), decoding after each call that gave its
 * logits (step 3: sample, text, stop strings: answer_stream.c); end -- and its cost. */
#include "pipeline/answer_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "pipeline/sample.h"
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
    for (int32_t i = 0; i < req->n_messages; i++) {
        free(req->messages[i].role);
        free(req->messages[i].content);
    }
    free(req->messages);
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

static double now_ms(void)
{
    return fitm_clock_ms();
}

/* The decoding state of one request: everything allocated once before the token loop. */
typedef struct {
    const fitm_answer_request *req;
    int32_t k;                /* candidates the forward pass selects: 1 when greedy, else
                                 min(FITM_TOP_MAX, V)                                      */
    fitm_top top[FITM_TOP_MAX]; /* the step's candidates, most likely first               */
    uint64_t rng;
} sampler;

/* One answer's decoding state, allocated once before the token loop: its plan (order,
 * prompt, intervention), its sampler and its text. */
typedef struct {
    fitm_answer_plan pl;
    sampler sm;
    fitm_answer_text text;
} answer_state;

/* One answer in progress: its working state, its own KV cache and where it stands. Every
 * buffer is allocated in fitm_answer_begin; steps allocate nothing. */
struct fitm_answer_seq {
    fitm_session *r;
    const fitm_answer_request *req; /* &resolved                                        */
    fitm_answer_request resolved;   /* the request's fields (borrowed), defaults filled  */
    fitm_answer_result *res;
    bool (*stop)(const void *);
    const void *stop_arg;
    fitm_answer_on_delta on_delta;
    void *delta_arg;
    answer_state s;
    fitm_answer_ranking rk;      /* step 1's phase                                  */
    fitm_rerank_seq *rank;       /* the phase's ranking, while it runs in the batch  */
    fitm_rerank_result rank_res; /* its result                                       */
    fitm_kv *kv;         /* [0, T + max_gen - 1) rows: the prompt, then the generated */
    int64_t pos;         /* the next position to compute                              */
    int64_t n_done;      /* tokens generated                                          */
    bool decoding;       /* the prompt is done; pos holds the last sampled token      */
    fitm_forward_opts o; /* this step's options                                       */
    fitm_position_method position; /* the request's, resolved at begin                 */
    double t0, t_prefill;
    int64_t first_ns;    /* when the first token was sampled (fitm_clock_ns)          */
};

/* Where a chat on the transcript (a model without a chat template) stops unless told: at the
 * next turn of any role the transcript writes, which a base model goes on to write itself
 * after its own (the user's, most often, or another of the assistant's). */
static char *const transcript_stop[] = {(char *)"\nuser:", (char *)"\nassistant:",
                                        (char *)"\nsystem:", (char *)"\ntool:"};

/* req with the server's defaults (fitm_session_answer_defaults, and the answer template's
 * stop string, or the transcript's) where it left an option unset: a shallow copy, borrowing
 * what req owns. */
static fitm_answer_request with_defaults(const fitm_session *r, const fitm_answer_request *req)
{
    const fitm_answer_defaults *d = fitm_session_answer_defaults(r);
    fitm_answer_request q = *req;
    if (q.calibrate == FITM_ANSWER_UNSET)
        q.calibrate = d->calibrate;
    if (q.reorder == FITM_ANSWER_UNSET)
        q.reorder = d->reorder;
    if (q.reorder_last == FITM_ANSWER_UNSET)
        q.reorder_last = d->reorder_last;
    if (q.top_n == FITM_ANSWER_UNSET)
        q.top_n = d->top_n;
    if (!q.has_stop && !q.ignore_eos && q.base.n_docs > 0) {
        char *const *stop;
        q.n_stop = fitm_session_answer_stop(r, &stop);
        q.stop = (char **)stop; /* borrowed like the rest: never freed through q */
    } else if (!q.has_stop && !q.ignore_eos && q.base.n_docs == 0 && !q.raw_prompt &&
               fitm_session_is_raw(r)) {
        q.n_stop = (int32_t)(sizeof transcript_stop / sizeof transcript_stop[0]);
        q.stop = (char **)transcript_stop;
    }
    return q;
}

size_t fitm_answer_seq_kv_bytes(const fitm_answer_seq *q)
{
    return (q->kv ? fitm_kv_bytes(q->kv) : 0) + (q->rank ? fitm_rerank_seq_kv_bytes(q->rank) : 0);
}

/* The answer's own cache, seeded with the rows of its prompt the session's prompt cache
 * already holds (its ranking left its rows there; rows before the intervention are the same
 * with or without it); the remaining rows run in the engine's steps, with the intervention.
 * Also the text buffer, with room for typical pieces up front so the token loop rarely grows
 * it. */
static fitm_status prefill_setup(fitm_answer_seq *q, fitm_err *err)
{
    fitm_session *r = q->r;
    fitm_answer_plan *pl = &q->s.pl;
    fitm_answer_text *text = &q->s.text;
    text->cap = (size_t)pl->max_gen * 32 + 1;
    text->v = malloc(text->cap);
    if (!text->v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    text->v[0] = '\0';
    int64_t start = fitm_session_cached(r, q->res->tokens, pl->T);
    int64_t limit = pl->intervene ? pl->iv.from_pos : pl->T - 1;
    start = start < limit ? start : limit;
    fitm_status st =
        fitm_session_kv_create(r, q->position, pl->T + pl->max_gen - 1, &q->kv, err);
    if (st == FITM_OK)
        st = fitm_session_copy_rows(r, q->kv, start, err);
    if (st != FITM_OK)
        return st;
    q->pos = start;
    q->res->forward_tokens += pl->T - start;
    return FITM_OK;
}

/* The request's position method, checked; the prompt cache is made that method's (so only
 * rows computed under it are reused). */
static fitm_status use_position(fitm_answer_seq *q, fitm_err *err)
{
    fitm_status st = fitm_session_position(q->r, q->req->base.position, &q->position, err);
    if (st == FITM_OK)
        st = fitm_session_cache_method(q->r, q->position, err);
    return st;
}

/* Step 2 once the ranking is done: the prompt, and the cache seeded for its prefill. */
static fitm_status prompt_ready(fitm_answer_seq *q, bool plain, fitm_err *err)
{
    q->res->rank_ms = now_ms() - q->t0;
    q->t_prefill = now_ms();
    fitm_status st = fitm_answer_prompt(q->r, q->req, plain, &q->s.pl, q->res, err);
    if (st == FITM_OK)
        st = prefill_setup(q, err);
    return st;
}

/* Takes the ranking of the phase that ended (rank_res; its status st) and frees it. */
static fitm_status took(fitm_answer_seq *q, fitm_status st)
{
    if (st == FITM_OK)
        fitm_answer_rank_took(q->r, q->req, &q->s.pl, &q->rk, &q->rank_res, q->res);
    else
        q->res->forward_tokens += q->rank_res.usage.forward_tokens;
    fitm_rerank_result_free(&q->rank_res);
    return st;
}

/* Runs the ranking on from its current phase: each phase that batches joins the engine's
 * steps as q->rank (returns with it posted); attention_sort's runs whole here; once no phase
 * is left, step 2. */
static fitm_status rank_on(fitm_answer_seq *q, fitm_err *err)
{
    fitm_status st = FITM_OK;
    while (st == FITM_OK && q->rk.phase != FITM_ANSWER_RANK_DONE) {
        if (!fitm_rerank_batches(&q->rk.q)) {
            st = took(q, fitm_rerank_run(q->r, &q->rk.q, q->stop, q->stop_arg, &q->rank_res,
                                         err));
            continue;
        }
        st = fitm_rerank_begin(q->r, &q->rk.q, q->stop, q->stop_arg, &q->rank_res, &q->rank,
                               err);
        if (st == FITM_OK && q->rank)
            return FITM_OK;
        st = took(q, st); /* it ended before a pass */
    }
    if (st == FITM_OK)
        st = prompt_ready(q, false, err);
    return st;
}

/* After the call that carried a part of the phase's ranking: once that ranking ended, its
 * result taken, then the next phase, or step 2 with the rows the ranking left. */
static fitm_status rank_after(fitm_answer_seq *q, int64_t T, fitm_status st, fitm_err *err)
{
    bool ended = false;
    fitm_rerank_seq_after(q->rank, 0, T, st, err, &ended); /* an answer's ranking: one lane */
    if (!ended)
        return FITM_OK;
    st = took(q, fitm_rerank_seq_status(q->rank, err));
    if (st == FITM_OK && q->rk.phase == FITM_ANSWER_RANK_DONE &&
        (st = fitm_rerank_seq_keep_rows(q->rank, err)) == FITM_OK)
        st = prompt_ready(q, false, err);
    fitm_err e;
    fitm_rerank_end(q->rank, &e);
    q->rank = NULL;
    if (st == FITM_OK && q->rk.phase != FITM_ANSWER_RANK_DONE)
        st = rank_on(q, err);
    return st;
}

fitm_status fitm_answer_begin(fitm_session *r, const fitm_answer_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_answer_on_delta on_delta, void *delta_arg,
                              fitm_answer_result *res, fitm_answer_seq **out, fitm_err *err)
{
    memset(res, 0, sizeof *res);
    *out = NULL;
    fitm_answer_seq *q = calloc(1, sizeof *q);
    if (!q)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    *q = (fitm_answer_seq){.r = r, .resolved = with_defaults(r, req), .res = res, .stop = stop,
                           .stop_arg = stop_arg, .on_delta = on_delta, .delta_arg = delta_arg,
                           .t0 = now_ms()};
    q->t_prefill = q->t0;
    req = q->req = &q->resolved;
    res->calibrate = req->calibrate;
    res->reorder = req->reorder;
    res->reorder_last = req->reorder_last;
    res->top_n = req->top_n;
    *out = q;
    /* Plain generation (the OpenAI routes without documents) has nothing to order. */
    const bool plain = req->base.n_docs == 0;
    fitm_status st = use_position(q, err);
    res->position_method = (int32_t)q->position;
    const int32_t V = fitm_model_config_of(fitm_session_model(r))->n_vocab;
    const int32_t k = V < FITM_TOP_MAX ? V : FITM_TOP_MAX;
    q->s.sm = (sampler){.req = req, .k = req->temperature > 0 ? k : 1, .rng = req->seed};
    if (st == FITM_OK)
        st = fitm_answer_plan_init(r, req, &q->s.pl, res, err);
    if (st != FITM_OK || plain)
        return st == FITM_OK ? prompt_ready(q, plain, err) : st;
    fitm_answer_rank_start(req, &q->s.pl, &q->rk, res);
    return rank_on(q, err);
}

void fitm_answer_seq_part(fitm_answer_seq *q, int64_t budget, int64_t logit_room,
                          fitm_forward_seq *part)
{
    answer_state *s = &q->s;
    if (q->rank) {
        fitm_rerank_seq_part(q->rank, 0, budget, logit_room, part); /* posted: it runs */
        return;
    }
    int64_t T = 1;
    if (!q->decoding)
        T = s->pl.T - q->pos < budget ? s->pl.T - q->pos : budget;
    const bool logits = q->decoding || q->pos + T == s->pl.T;
    const bool step = fitm_session_answer_prompt_step(q->r);
    q->o = (fitm_forward_opts){.n_logits = logits ? 1 : 0,
                               .top_k = s->sm.k,
                               .top = s->sm.top,
                               .intervention = s->pl.intervene ? &s->pl.iv : NULL,
                               .position = q->position,
                               .path = q->decoding ? FITM_PATH_AUTO
                                     : step        ? FITM_PATH_STEP
                                                   : FITM_PATH_BATCH};
    *part = (fitm_forward_seq){q->kv, q->res->tokens + q->pos, T, q->pos, &q->o};
}

/* Step 3, decode, after a call that gave q's logits: sample, hand out text, stop at EOS, a
 * stop string or the length. *done when the answer is complete (or failed). */
static fitm_status after_logits(fitm_answer_seq *q, bool *done, fitm_err *err)
{
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    const fitm_answer_request *req = q->req;
    const fitm_tokenizer *tok = fitm_session_tokenizer(q->r);
    *done = true;
    if (!q->decoding) {
        q->decoding = true;
        res->prefill_ms = now_ms() - q->t_prefill;
        res->finish = FITM_FINISH_LENGTH;
    }
    const fitm_sampling how = {.temperature = req->temperature, .top_p = req->top_p,
                               .min_p = req->min_p, .top_k = req->top_k};
    int32_t next = fitm_sample_draw(s->sm.top, s->sm.k, &how, &s->sm.rng);
    res->tokens[s->pl.T + q->n_done++] = next;
    res->completion_tokens = q->n_done;
    if (q->n_done == 1) {
        q->first_ns = fitm_clock_ns();
        res->first_token_ms = (double)q->first_ns / 1e6 - q->t0;
    }
    if (!req->ignore_eos && fitm_tok_is_eog(tok, next)) {
        res->finish = FITM_FINISH_STOP;
        return FITM_OK;
    }
    char piece[FITM_TOK_MAX_PIECE_BYTES];
    size_t n_piece = 0;
    fitm_status st;
    if ((st = fitm_tok_piece(tok, next, 0, piece, sizeof piece, &n_piece, err)) != FITM_OK ||
        (st = fitm_answer_text_append(&s->text, piece, n_piece, err)) != FITM_OK)
        return st;
    if (fitm_answer_text_cut_at_stop(req, &s->text, n_piece)) {
        res->finish = FITM_FINISH_STOP;
        return FITM_OK;
    }
    if ((st = fitm_answer_text_flush(req, &s->text, false, q->on_delta, q->delta_arg, err)) !=
            FITM_OK ||
        q->n_done == s->pl.max_gen)
        return st;
    q->pos = s->pl.T + q->n_done - 1;
    *done = false;
    return FITM_OK;
}

fitm_status fitm_answer_seq_after(fitm_answer_seq *q, int64_t T, fitm_status st, bool *done,
                                  fitm_err *err)
{
    *done = false;
    if (q->rank) {
        st = rank_after(q, T, st, err);
        *done = st != FITM_OK;
        return st;
    }
    if (st != FITM_OK) {
        *done = true;
        return st;
    }
    q->res->forward_tokens += q->decoding ? 1 : 0;
    if (q->o.n_logits == 0) { /* a prompt chunk before the last */
        q->pos += T;
        return FITM_OK;
    }
    st = after_logits(q, done, err);
    *done = *done || st != FITM_OK;
    return st;
}

bool fitm_answer_seq_stopped(const fitm_answer_seq *q)
{
    return q->stop && q->stop(q->stop_arg);
}

bool fitm_answer_seq_decoding(const fitm_answer_seq *q)
{
    return q->decoding;
}

bool fitm_answer_seq_first_after(const fitm_answer_seq *q, int64_t ns)
{
    return q->n_done == 1 && ns < q->first_ns;
}

fitm_status fitm_answer_end(fitm_answer_seq *q, fitm_status st, fitm_err *err)
{
    if (!q)
        return st;
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    res->n_tokens = s->pl.T + q->n_done;
    res->decode_ms = q->decoding ? now_ms() - q->t_prefill - res->prefill_ms : 0.0;
    if (!q->decoding)
        res->prefill_ms = now_ms() - q->t_prefill;
    if (st == FITM_OK)
        st = fitm_answer_text_flush(q->req, &s->text, true, q->on_delta, q->delta_arg, err);
    if (st == FITM_OK && !s->text.v)
        st = fitm_answer_text_append(&s->text, "", 0, err);
    if (st == FITM_OK) {
        res->answer = s->text.v;
        res->answer_len = s->text.n;
        s->text.v = NULL;
    }
    res->total_ms = now_ms() - q->t0;
    if (q->rank) { /* ended (stopped, failed) while it ranked */
        fitm_err e;
        fitm_rerank_end(q->rank, &e);
    }
    fitm_rerank_result_free(&q->rank_res);
    fitm_answer_plan_free(&s->pl);
    free(s->text.v);
    fitm_kv_destroy(q->kv);
    free(q);
    return st;
}

/* The ranking's forward tokens: the reorder's, and the calibration's unless it takes the
 * reorder's scores (fitm_answer_rank_took). */
static fitm_status ranking_cost(const fitm_session *r, const fitm_answer_request *req,
                                int64_t *sum, fitm_err *err)
{
    const bool reorder = req->reorder >= 0;
    int64_t t = 0;
    fitm_status st = FITM_OK;
    if (reorder) {
        fitm_rerank_request q = fitm_answer_rank_request(req, (fitm_rerank_method)req->reorder,
                                                         req->base.docs);
        st = fitm_rerank_cost(r, &q, false, &t, err);
        *sum += t;
    }
    fitm_rerank_request cal =
        fitm_answer_rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
    if (st == FITM_OK && req->calibrate &&
        !(req->reorder == FITM_RERANK_CALIBRATED && fitm_rerank_scores_alone(r, &cal))) {
        st = fitm_rerank_cost(r, &cal, reorder, &t, err);
        *sum += t;
    }
    return st;
}

/* At most the answer prompt's tokens: exact in request order, bounded when the reorder's
 * order is not known yet. */
static fitm_status prompt_cost(const fitm_session *r, const fitm_answer_request *req,
                               int64_t *t, fitm_err *err)
{
    fitm_rerank_request q = fitm_answer_rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
    const fitm_rerank_frame *f = fitm_session_answer_frame(r);
    if (req->reorder >= 0)
        return fitm_rerank_prompt_bound(r, &q, f, t, err);
    int32_t *ids = NULL;
    fitm_span *spans = malloc((size_t)q.n_docs * sizeof *spans);
    fitm_status st = spans ? fitm_rerank_prompt(r, &q, f, NULL, &ids, t, spans, err)
                           : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    free(ids);
    free(spans);
    return st;
}

fitm_status fitm_answer_cost(const fitm_session *r, const fitm_answer_request *request,
                             int64_t *tokens, fitm_err *err)
{
    const fitm_answer_request resolved = with_defaults(r, request), *req = &resolved;
    const int64_t n_ctx = fitm_session_n_ctx(r);
    /* Plain generation: its rendered prompt, then one step per generated token but the
     * last, never past the context. */
    if (req->base.n_docs == 0) {
        fitm_answer_result res = {0};
        int64_t T = 0;
        fitm_status st = fitm_answer_plain_prompt(r, req, &T, &res, err);
        free(res.tokens);
        int64_t gen = T + req->max_tokens - 1;
        *tokens = gen < n_ctx ? gen : n_ctx;
        return st;
    }
    int64_t sum = 0, t = 0;
    fitm_status st = ranking_cost(r, req, &sum, err);
    /* Prefill at most the whole answer prompt (rows the cache holds are skipped), then one
     * step per generated token but the last, never past the context. */
    if (st == FITM_OK) {
        st = prompt_cost(r, req, &t, err);
        int64_t gen = t + req->max_tokens - 1;
        sum += gen < n_ctx ? gen : n_ctx;
    }
    *tokens = sum;
    return st;
}
