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

uint64_t fitm_answer_rand(uint64_t *state)
{
    return fitm_rng_next(state);
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

/* Draws the next token from the forward pass's candidates: the k most likely tokens in the
 * total order of fitm_ops_topk (logit descending, ties by lower id), selected by the backend
 * so that a device backend copies k (logit, id) pairs per step, not the whole row.
 * Greedy: the first candidate, the row's first maximum (as `fitm generate`). Else
 * softmax(logits / temperature) over the candidates, cut to the smallest prefix of them whose
 * mass reaches top_p of theirs, drawn from the PRNG. The rule: tokens outside the 64 most
 * likely are never drawn (a top-k of 64 before top_p, as llama.cpp's default top-k of 40);
 * everything here is computed from the candidates alone, in their order, so every backend
 * that selects the same list draws the same token from the same seed. */
static int32_t sample(sampler *s)
{
    const fitm_top *c = s->top;
    const double t = s->req->temperature;
    if (t <= 0)
        return c[0].id;
    float p[FITM_TOP_MAX] = {0}; /* unnormalised probabilities, in candidate order */
    double total = 0;
    for (int32_t i = 0; i < s->k; i++) {
        p[i] = (float)exp((double)(c[i].logit - c[0].logit) / t);
        total += p[i];
    }
    const double u = (double)(fitm_answer_rand(&s->rng) >> 11) * 0x1.0p-53;
    int32_t n = s->k;
    double keep = total;
    if (s->req->top_p < 1.0) {
        keep = 0;
        n = 0;
        while (n < s->k && keep < s->req->top_p * total)
            keep += p[n++];
    }
    double acc = 0, target = u * keep;
    for (int32_t i = 0; i < n; i++) {
        acc += p[i];
        if (acc > target)
            return c[i].id;
    }
    return c[n > 0 ? n - 1 : 0].id;
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

/* The shallow request copy that ranks req's documents docs (in that order) with method m. */
static fitm_rerank_request rank_request(const fitm_answer_request *req, fitm_rerank_method m,
                                        const fitm_rerank_doc *docs)
{
    fitm_rerank_request q = req->base;
    q.docs = (fitm_rerank_doc *)docs;
    q.method = m;
    q.top_n = q.n_docs;
    q.return_tokens = false;
    q.return_documents = false;
    q.tei = false;
    /* On the answer's path, where its accuracy was measured (docs/load-benchmark.md,
     * nineteenth session: on rerank_path's STEP products the dev split lost 3 of 80 answers),
     * every layer where the answer continues the scored rows (fitm_reranker_run decides). */
    q.answer_scoring = true;
    return q;
}

/* Ranks with method on docs in order (NULL: request order) and returns the shallow request
 * copy's result in *out. */
static fitm_status rank(fitm_reranker *r, const fitm_answer_request *req, fitm_rerank_method m,
                        const fitm_rerank_doc *docs, bool (*stop)(const void *),
                        const void *stop_arg, fitm_rerank_result *out, fitm_err *err)
{
    fitm_rerank_request q = rank_request(req, m, docs);
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
    free(s->text.v);
}

static fitm_status state_init(const fitm_reranker *r, const fitm_answer_request *req,
                              answer_state *s, fitm_answer_result *res, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(fitm_reranker_model(r));
    const int32_t K = req->base.n_docs;
    const int32_t k = c->n_vocab < FITM_TOP_MAX ? c->n_vocab : FITM_TOP_MAX;
    *s = (answer_state){.K = K, .L = c->n_layer,
                        .sm = {.req = req, .k = req->temperature > 0 ? k : 1, .rng = req->seed}};
    const size_t k1 = K > 0 ? (size_t)K : 1; /* plain generation has no documents */
    s->order = malloc(k1 * sizeof *s->order);
    s->docs = malloc(k1 * sizeof *s->docs);
    s->spans = calloc(k1, sizeof *s->spans);
    s->alpha = malloc(k1 * sizeof *s->alpha);
    s->use = calloc((size_t)s->L, 1);
    res->docs = calloc(k1, sizeof *res->docs);
    res->n_docs = K;
    if (!s->order || !s->docs || !s->spans || !s->alpha || !s->use || !res->docs)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t k = 0; k < K; k++) {
        s->order[k] = k;
        s->alpha[k] = 1.0f / (float)K;
        res->docs[k] = (fitm_answer_doc){.index = k, .position = k, .weight = 1.0 / K};
    }
    return FITM_OK;
}

/* Step 1, order: the documents reordered by req->reorder (most relevant first, or last with
 * reorder_last, where a model that favours what it read last finds it), then the
 * intervention's weights from the calibrated scores of the reordered documents. */
static fitm_status order_documents(fitm_reranker *r, const fitm_answer_request *req,
                                   answer_state *s, bool (*stop)(const void *),
                                   const void *stop_arg, fitm_answer_result *res, fitm_err *err)
{
    fitm_rerank_result rr = {0};
    fitm_status st = FITM_OK;
    /* Scores of documents that each had a prompt of their own (windows of 1) do not depend on
     * the order: the reorder's calibrated scores are the reordered prompt's. */
    bool scored = false;
    if (req->reorder >= 0) {
        st = rank(r, req, (fitm_rerank_method)req->reorder, req->base.docs, stop, stop_arg, &rr,
                  err);
        for (int32_t p = 0; st == FITM_OK && p < s->K; p++)
            s->order[p] = rr.results[req->reorder_last ? s->K - 1 - p : p].index;
        res->forward_tokens += rr.usage.forward_tokens;
        fitm_rerank_request q = rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
        scored = st == FITM_OK && req->calibrate && req->reorder == FITM_RERANK_CALIBRATED &&
                 fitm_reranker_scores_alone(r, &q);
        for (int32_t i = 0; scored && i < s->K; i++) {
            const fitm_rerank_doc_result *d = &rr.results[i];
            res->docs[d->index].weight = d->weight;
            res->docs[d->index].calibrated_attention = d->calibrated_attention;
        }
        fitm_rerank_result_free(&rr);
    }
    for (int32_t p = 0; st == FITM_OK && p < s->K; p++) {
        s->docs[p] = req->base.docs[s->order[p]];
        res->docs[s->order[p]].position = p;
        if (scored)
            s->alpha[p] = (float)res->docs[s->order[p]].weight;
    }
    if (st == FITM_OK && req->calibrate && !scored) {
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
    const fitm_answer_request *req; /* &resolved                                        */
    fitm_answer_request resolved;   /* the request's fields (borrowed), defaults filled  */
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
    fitm_position_method position; /* the request's, resolved at begin                 */
    double t0, t_prefill;
    int64_t first_ns;    /* when the first token was sampled (fitm_clock_ns)          */
};

/* req with the server's defaults (fitm_reranker_answer_defaults, and the answer template's
 * stop string) where it left an option unset: a shallow copy, borrowing what req owns. */
static fitm_answer_request with_defaults(const fitm_reranker *r, const fitm_answer_request *req)
{
    const fitm_answer_defaults *d = fitm_reranker_answer_defaults(r);
    fitm_answer_request q = *req;
    if (q.calibrate == FITM_ANSWER_UNSET)
        q.calibrate = d->calibrate;
    if (q.reorder == FITM_ANSWER_UNSET)
        q.reorder = d->reorder;
    if (q.reorder_last == FITM_ANSWER_UNSET)
        q.reorder_last = d->reorder_last;
    if (!q.has_stop && !q.ignore_eos && q.base.n_docs > 0) {
        char *const *stop;
        q.n_stop = fitm_reranker_answer_stop(r, &stop);
        q.stop = (char **)stop; /* borrowed like the rest: never freed through q */
    }
    return q;
}

size_t fitm_answer_seq_kv_bytes(const fitm_answer_seq *q)
{
    return q->kv ? fitm_kv_bytes(q->kv) : 0;
}

/* ---- plain generation (no documents) ------------------------------------------------------ */

/* One piece of a rendered prompt: control markers (special) or text. */
typedef struct {
    const char *p;
    size_t n;
    bool special;
} piece;

/* A chat template's turn markers: open + role + mid, the content, close; `end` opens the
 * assistant's turn. model_role names the assistant in the markers (gemma: "model"). */
typedef struct {
    const char *name, *open, *mid, *close, *end, *model_role;
} turn_markers;

static const turn_markers markers[] = {
    {"gemma", "<start_of_turn>", "\n", "<end_of_turn>\n", "<start_of_turn>model\n", "model"},
    {"chatml", "<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n", "assistant"},
    {"llama3", "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>",
     "<|start_header_id|>assistant<|end_header_id|>\n\n", "assistant"},
};

/* The prompt's pieces into ps (room for 4 * n_messages + 2), their count. For a template
 * without markers (raw; llama2, whose turns are [INST] pairs) the pieces are written here too. */
static int32_t render_pieces(const fitm_reranker *r, const fitm_answer_request *req, piece *ps)
{
    const char *name = fitm_reranker_template(r);
    int32_t n = 0;
    if (req->raw_prompt) {
        ps[n++] = (piece){req->messages[0].content, strlen(req->messages[0].content), false};
        return n;
    }
    const turn_markers *tm = NULL;
    for (size_t i = 0; i < sizeof markers / sizeof markers[0]; i++)
        if (!strcmp(markers[i].name, name))
            tm = &markers[i];
    bool llama2 = !strcmp(name, "llama2");
    for (int32_t i = 0; i < req->n_messages; i++) {
        const fitm_answer_message *m = &req->messages[i];
        bool assistant = !strcmp(m->role, "assistant");
        const char *c = m->content;
        if (tm) {
            /* gemma has no system turn: a system message is a user turn */
            const char *role = assistant                                         ? tm->model_role
                               : !strcmp(tm->name, "gemma") && strcmp(m->role, "user") ? "user"
                                                                                      : m->role;
            ps[n++] = (piece){tm->open, strlen(tm->open), true};
            ps[n++] = (piece){role, strlen(role), false};
            ps[n++] = (piece){tm->mid, strlen(tm->mid), true};
            ps[n++] = (piece){c, strlen(c), false};
            ps[n++] = (piece){tm->close, strlen(tm->close), true};
        } else if (llama2) {
            ps[n++] = (piece){assistant ? " " : "[INST] ", assistant ? 1 : 7, !assistant};
            ps[n++] = (piece){c, strlen(c), false};
            ps[n++] = (piece){assistant ? " " : " [/INST]", assistant ? 1 : 8, !assistant};
        } else { /* raw: a transcript */
            ps[n++] = (piece){m->role, strlen(m->role), false};
            ps[n++] = (piece){": ", 2, false};
            ps[n++] = (piece){c, strlen(c), false};
            ps[n++] = (piece){"\n", 1, false};
        }
    }
    if (tm)
        ps[n++] = (piece){tm->end, strlen(tm->end), true};
    else if (!llama2)
        ps[n++] = (piece){"assistant:", 10, false};
    return n;
}

/* The pieces' texts in one malloc'd string. */
static fitm_status join_pieces(const piece *ps, int32_t n, char **out, size_t *len, fitm_err *err)
{
    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        total += ps[i].n;
    char *s = malloc(total + 1);
    if (!s)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    size_t o = 0;
    for (int32_t i = 0; i < n; i++) {
        memcpy(s + o, ps[i].p, ps[i].n);
        o += ps[i].n;
    }
    s[o] = '\0';
    *out = s;
    *len = o;
    return FITM_OK;
}

static piece *pieces_alloc(const fitm_answer_request *req)
{
    return malloc((size_t)(5 * req->n_messages + 2) * sizeof(piece));
}

fitm_status fitm_answer_render(const fitm_reranker *r, const fitm_answer_request *req, char **out,
                               size_t *len, fitm_err *err)
{
    *out = NULL;
    piece *ps = pieces_alloc(req);
    if (!ps)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    fitm_status st = join_pieces(ps, render_pieces(r, req, ps), out, len, err);
    free(ps);
    return st;
}

/* Appends the tokens of text[0..n) to *ids (cap grown as needed). */
static fitm_status encode_append(const fitm_tokenizer *tok, const char *text, size_t n,
                                 uint32_t flags, int32_t **ids, int64_t *n_ids, int64_t *cap,
                                 fitm_err *err)
{
    for (;;) {
        int64_t room = *cap - *n_ids, got = 0;
        fitm_status st = room > 0 ? fitm_tok_encode(tok, text, n, flags, *ids + *n_ids, room,
                                                    &got, err)
                                  : FITM_ERR_LIMIT;
        if (st == FITM_OK) {
            *n_ids += got;
            return FITM_OK;
        }
        if (st != FITM_ERR_LIMIT)
            return st;
        int64_t want = *cap * 2 + (int64_t)n + 16;
        int32_t *grown = realloc(*ids, (size_t)want * sizeof *grown);
        if (!grown)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt's tokens");
        *ids = grown;
        *cap = want;
    }
}

/* Plain generation's prompt: the rendered messages tokenized into res->tokens (a template's
 * markers as control tokens; a transcript, having none, in one piece), s->T set. */
static fitm_status plain_prompt(const fitm_reranker *r, const fitm_answer_request *req,
                                answer_state *s, fitm_answer_result *res, fitm_err *err)
{
    const fitm_tokenizer *tok = fitm_reranker_tokenizer(r);
    piece *ps = pieces_alloc(req);
    if (!ps)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the prompt");
    int32_t n = render_pieces(r, req, ps);
    bool any_special = false;
    for (int32_t i = 0; i < n; i++)
        any_special |= ps[i].special;
    int64_t cap = 256, T = 0;
    res->tokens = malloc((size_t)cap * sizeof *res->tokens);
    fitm_status st = res->tokens ? FITM_OK : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (st == FITM_OK && !any_special) {
        char *text = NULL;
        size_t len = 0;
        if ((st = join_pieces(ps, n, &text, &len, err)) == FITM_OK)
            st = encode_append(tok, text, len, FITM_TOK_ADD_BOS, &res->tokens, &T, &cap, err);
        free(text);
    }
    for (int32_t i = 0; st == FITM_OK && any_special && i < n; i++) {
        uint32_t f = (i == 0 ? FITM_TOK_ADD_BOS : FITM_TOK_CONTINUATION) |
                     (ps[i].special ? FITM_TOK_PARSE_SPECIAL : 0);
        st = encode_append(tok, ps[i].p, ps[i].n, f, &res->tokens, &T, &cap, err);
    }
    free(ps);
    s->T = T;
    if (st == FITM_OK && T < 1)
        st = fitm_err_set(err, FITM_ERR_INVALID, "the prompt is empty");
    return st;
}

/* Step 2, prefill setup: the answer prompt (the answer template for a model without a chat
 * template, else the chat-wrapped prompt of docs/design.md, Method) with the documents in
 * order -- or, for plain generation (no documents), the rendered messages without an
 * intervention --, a cache of its own, and the rows the reranker's prompt cache already
 * holds copied into it (rows before the intervention are the same with or without it); the
 * remaining rows run in fitm_answer_step, with the intervention. */
static fitm_status prefill_setup(fitm_answer_seq *q, bool plain, fitm_err *err)
{
    fitm_reranker *r = q->r;
    const fitm_answer_request *req = q->req;
    answer_state *s = &q->s;
    fitm_answer_result *res = q->res;
    const int64_t n_ctx = fitm_reranker_n_ctx(r);
    fitm_rerank_request rq = req->base;
    rq.docs = s->docs;
    fitm_status st = plain ? plain_prompt(r, req, s, res, err)
                           : fitm_reranker_prompt(r, &rq, fitm_reranker_answer_frame(r), NULL,
                                                  &res->tokens, &s->T, s->spans, err);
    if (st != FITM_OK)
        return st;
    if (s->T > n_ctx)
        return fitm_err_set(err, FITM_ERR_LIMIT,
                            "the prompt is %lld tokens, over the context of %lld tokens%s",
                            (long long)s->T, (long long)n_ctx,
                            plain ? "" : ": send fewer or shorter documents");
    /* Every generated token but the last needs a KV row. */
    s->max_gen = req->max_tokens < n_ctx - s->T + 1 ? req->max_tokens : n_ctx - s->T + 1;
    int32_t *grown = realloc(res->tokens, (size_t)(s->T + s->max_gen) * sizeof *grown);
    res->spans = plain ? NULL : malloc((size_t)s->K * sizeof *res->spans);
    if (grown)
        res->tokens = grown;
    /* Room for typical pieces up front, so the token loop rarely grows the text. */
    s->text.cap = (size_t)s->max_gen * 32 + 1;
    s->text.v = malloc(s->text.cap);
    if (!grown || (!plain && !res->spans) || !s->text.v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    s->text.v[0] = '\0';
    res->prompt_tokens = s->T;
    s->intervene = false;
    if (!plain) {
        for (int32_t p = 0; p < s->K; p++)
            res->spans[s->order[p]] = s->spans[p];
        if ((st = intervention_layers(req, s, err)) != FITM_OK)
            return st;
        s->iv = (fitm_intervention){.spans = s->spans, .n_spans = s->K, .alpha = s->alpha,
                                    .layers = s->use, .from_pos = s->spans[s->K - 1].end};
        s->intervene = req->calibrate;
    }
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
    *q = (fitm_answer_seq){.r = r, .resolved = with_defaults(r, req), .res = res, .stop = stop,
                           .stop_arg = stop_arg, .on_delta = on_delta, .delta_arg = delta_arg,
                           .t0 = now_ms()};
    req = q->req = &q->resolved;
    res->calibrate = req->calibrate;
    res->reorder = req->reorder;
    res->reorder_last = req->reorder_last;
    *out = q;
    /* Plain generation (the OpenAI routes without documents) has nothing to order. */
    const bool plain = req->base.n_docs == 0;
    fitm_status st = fitm_reranker_use_position(r, req->base.position, err);
    q->position = fitm_reranker_position(r);
    res->position_method = (int32_t)q->position;
    if (st == FITM_OK)
        st = state_init(r, req, &q->s, res, err);
    if (st == FITM_OK && !plain)
        st = order_documents(r, req, &q->s, stop, stop_arg, res, err);
    res->rank_ms = now_ms() - q->t0;
    q->t_prefill = now_ms();
    if (st == FITM_OK)
        st = prefill_setup(q, plain, err);
    return st;
}

/* This step's part of sequence q: the next prompt chunk (at most budget tokens, on the path
 * the server's answer_prompt_path names) or the next decode step. */
static void step_part(fitm_answer_seq *q, int64_t budget, fitm_forward_seq *part)
{
    answer_state *s = &q->s;
    int64_t T = 1;
    if (!q->decoding)
        T = s->T - q->pos < budget ? s->T - q->pos : budget;
    const bool logits = q->decoding || q->pos + T == s->T;
    const bool step = fitm_reranker_answer_prompt_step(q->r);
    q->o = (fitm_forward_opts){.n_logits = logits ? 1 : 0,
                               .top_k = s->sm.k,
                               .top = s->sm.top,
                               .intervention = s->intervene ? &s->iv : NULL,
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

void fitm_answer_step(fitm_reranker *r, const fitm_batch_seq *seqs, int32_t n,
                      int64_t prefill_budget, fitm_status *st, bool *done, fitm_err *errs)
{
    fitm_forward_seq parts[FITM_FORWARD_MAX_SEQS];
    int32_t idx[FITM_FORWARD_MAX_SEQS], n_parts = 0;
    int64_t room = fitm_reranker_batch_tokens(r), logit_room = fitm_reranker_batch_logits(r);
    /* Arrival order: an answer with only its first token waits while work that arrived
     * before that token is unfinished (the oldest such arrival is what decides). */
    int64_t oldest = INT64_MAX;
    for (int32_t i = 0; i < n; i++)
        if ((seqs[i].rerank || !seqs[i].answer->decoding) && seqs[i].arrived_ns < oldest)
            oldest = seqs[i].arrived_ns;
    bool held[FITM_FORWARD_MAX_SEQS] = {false};
    /* The prompt budget bounds the gap between two tokens of a running stream; with no
     * stream decoding there is no gap to bound, and prompts take the whole call. */
    bool streaming = false;
    for (int32_t i = 0; i < n; i++) {
        const fitm_answer_seq *q = seqs[i].answer;
        if (!q || !q->decoding)
            continue;
        held[i] = q->n_done == 1 && oldest < q->first_ns;
        streaming = streaming || !held[i];
    }
    if (!streaming)
        prefill_budget = room;
    /* Decode steps first (one row each), then prompt chunks and rerank passes in the order
     * given, within the budget; a sequence left out this step waits for the next. */
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < n; i++) {
            fitm_answer_seq *q = seqs[i].answer;
            fitm_rerank_seq *rq = seqs[i].rerank;
            if (pass == 0) {
                st[i] = FITM_OK;
                done[i] = false;
                if (rq && fitm_rerank_seq_stopped(rq)) {
                    fitm_err e;
                    fitm_rerank_seq_after(rq, 0, stopped(&e), &e, &done[i]);
                    st[i] = FITM_OK; /* the rerank's own status comes from fitm_rerank_end */
                    continue;
                }
                if (q && q->stop && q->stop(q->stop_arg)) {
                    st[i] = stopped(&errs[i]);
                    done[i] = true;
                    continue;
                }
            }
            const bool decoding = q && q->decoding;
            if (done[i] || held[i] || decoding != (pass == 0) ||
                n_parts == FITM_FORWARD_MAX_SEQS || logit_room < 1)
                continue;
            int64_t want = decoding ? 1 : (prefill_budget < room ? prefill_budget : room);
            if (want < 1)
                continue;
            if (rq) {
                fitm_rerank_seq_part(rq, want, &parts[n_parts]);
                if (parts[n_parts].T > room || parts[n_parts].opts->n_logits > logit_room)
                    continue; /* its logit rows do not fit this call */
            } else {
                step_part(q, want, &parts[n_parts]);
            }
            room -= parts[n_parts].T;
            logit_room -= parts[n_parts].opts->n_logits;
            prefill_budget -= decoding ? 0 : parts[n_parts].T;
            idx[n_parts++] = i;
        }
    if (n_parts == 0)
        return;
    fitm_err err = {{0}};
    fitm_status bs = fitm_reranker_run_batch(r, parts, n_parts, &err);
    for (int32_t k = 0; k < n_parts; k++) {
        const int32_t i = idx[k];
        if (seqs[i].rerank) {
            fitm_rerank_seq_after(seqs[i].rerank, parts[k].T, bs, &err, &done[i]);
            continue;
        }
        fitm_answer_seq *q = seqs[i].answer;
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
    fitm_batch_seq one = {.answer = q};
    while (!done)
        fitm_answer_step(r, &one, 1, fitm_reranker_batch_tokens(r), &st, &done, err);
    return fitm_answer_end(q, st, err);
}

fitm_status fitm_answer_cost(const fitm_reranker *r, const fitm_answer_request *request,
                             int64_t *tokens, fitm_err *err)
{
    const fitm_answer_request resolved = with_defaults(r, request), *req = &resolved;
    /* Plain generation: its rendered prompt, then one step per generated token but the
     * last, never past the context. */
    if (req->base.n_docs == 0) {
        answer_state s = {0};
        fitm_answer_result res = {0};
        fitm_status st = plain_prompt(r, req, &s, &res, err);
        free(res.tokens);
        int64_t n_ctx = fitm_reranker_n_ctx(r), gen = s.T + req->max_tokens - 1;
        *tokens = gen < n_ctx ? gen : n_ctx;
        return st;
    }
    const bool reorder = req->reorder >= 0;
    int64_t sum = 0, t = 0;
    fitm_status st = FITM_OK;
    if (reorder) {
        fitm_rerank_request q = rank_request(req, (fitm_rerank_method)req->reorder,
                                             req->base.docs);
        st = fitm_reranker_cost(r, &q, false, &t, err);
        sum += t;
    }
    /* The intervention's own scoring, unless it takes the reorder's (order_documents). */
    fitm_rerank_request cal = rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
    if (st == FITM_OK && req->calibrate &&
        !(req->reorder == FITM_RERANK_CALIBRATED && fitm_reranker_scores_alone(r, &cal))) {
        st = fitm_reranker_cost(r, &cal, reorder, &t, err);
        sum += t;
    }
    /* Prefill at most the whole answer prompt (rows the cache holds are skipped), then one
     * step per generated token but the last, never past the context. */
    if (st == FITM_OK) {
        fitm_rerank_request q = rank_request(req, FITM_RERANK_CALIBRATED, req->base.docs);
        const fitm_rerank_frame *f = fitm_reranker_answer_frame(r);
        if (reorder) {
            st = fitm_reranker_prompt_bound(r, &q, f, &t, err);
        } else {
            int32_t *ids = NULL;
            fitm_span *spans = malloc((size_t)q.n_docs * sizeof *spans);
            st = spans ? fitm_reranker_prompt(r, &q, f, NULL, &ids, &t, spans, err)
                       : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
            free(ids);
            free(spans);
        }
        int64_t n_ctx = fitm_reranker_n_ctx(r), gen = t + req->max_tokens - 1;
        sum += gen < n_ctx ? gen : n_ctx;
    }
    *tokens = sum;
    return st;
}
