#include "pipeline/rerank_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

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

static const fitm_rr_template templates[] = {
    {"raw", NULL, "", ""},
    {"gemma", "<start_of_turn>", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"},
    {"chatml", "<|im_start|>", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"},
    {"llama3", "<|start_header_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
     "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    {"llama2", "[INST]", "[INST] ", " [/INST]"},
};
#define N_TEMPLATES (sizeof templates / sizeof templates[0])

/* Logit rows per forward call (query_likelihood scores its question in pieces of this). */
#define LOGIT_ROWS 32
/* Passes of attention_sort (Peysakhovich & Lerer sort and rerun; the last pass scores). */
#define SORT_PASSES 3

fitm_status fitm_rr_reserve(fitm_rr_ids *a, int64_t more, fitm_err *err)
{
    if (a->n + more <= a->cap)
        return FITM_OK;
    int64_t cap = a->cap ? a->cap : 256;
    while (cap < a->n + more)
        cap *= 2;
    int32_t *v = realloc(a->v, (size_t)cap * sizeof *v);
    if (!v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %lld token ids",
                            (long long)cap);
    a->v = v;
    a->cap = cap;
    return FITM_OK;
}

fitm_status fitm_rr_encode(const fitm_tokenizer *tok, fitm_rr_ids *a, const char *text,
                           size_t len, uint32_t flags, int64_t keep, fitm_err *err)
{
    int64_t room = (int64_t)len + 8, n = 0;
    fitm_status st = fitm_rr_reserve(a, room, err);
    if (st != FITM_OK)
        return st;
    st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, room, &n, err);
    if (st == FITM_ERR_LIMIT && n > room) {
        if ((st = fitm_rr_reserve(a, n, err)) != FITM_OK)
            return st;
        st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, n, &n, err);
    }
    if (st != FITM_OK)
        return st;
    a->n += keep >= 0 && n > keep ? keep : n;
    return FITM_OK;
}

double fitm_rr_now_ms(void)
{
    return fitm_clock_ms();
}
#define now_ms fitm_rr_now_ms

static const fitm_rr_template *pick_template(const fitm_model *m, const fitm_tokenizer *tok,
                                             const char *want)
{
    if (want && strcmp(want, "auto") != 0) {
        for (size_t i = 0; i < N_TEMPLATES; i++)
            if (!strcmp(templates[i].name, want))
                return &templates[i];
        return &templates[0];
    }
    fitm_gguf_str s = {0};
    if (fitm_gguf_get_str(fitm_model_gguf(m), "tokenizer.chat_template", &s, NULL) != FITM_OK)
        return &templates[0];
    for (size_t i = 1; i < N_TEMPLATES; i++) {
        const char *mk = templates[i].marker;
        size_t n = strlen(mk);
        bool found = false;
        for (uint64_t j = 0; !found && j + n <= s.len; j++)
            found = !memcmp(s.ptr + j, mk, n);
        /* A template whose control tokens the vocabulary lacks would be tokenized as text. */
        if (found && (i == N_TEMPLATES - 1 || fitm_tok_find(tok, mk) >= 0))
            return &templates[i];
    }
    return &templates[0];
}

void fitm_reranker_destroy(fitm_reranker *r)
{
    if (!r)
        return;
    fitm_kv_destroy(r->branch);
    fitm_kv_destroy(r->kv);
    fitm_forward_destroy(r->fwd);
    fitm_score_opts_free(&r->defaults);
    free(r->dummy);
    free(r->logits);
    free(r->kv_ids);
    free(r->answer_text);
    free(r->answer_stop[0]);
    free(r);
}

const fitm_answer_defaults *fitm_reranker_answer_defaults(const fitm_reranker *r)
{
    return &r->answer;
}

const char *fitm_reranker_template(const fitm_reranker *r)
{
    return r->tmpl->name;
}

/* The default dummy's ids: " " + text. */
static fitm_status encode_dummy(fitm_reranker *r, const char *text, fitm_err *err)
{
    fitm_rr_ids d = {0};
    size_t dl = strlen(text);
    char *t = malloc(dl + 2);
    if (!t)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    t[0] = ' ';
    memcpy(t + 1, text, dl + 1);
    fitm_status st = fitm_rr_encode(r->tok, &d, t, dl + 1, FITM_TOK_CONTINUATION, -1, err);
    free(t);
    r->dummy = d.v;
    r->n_dummy = d.n;
    if (st == FITM_OK && r->n_dummy == 0)
        st = fitm_err_set(err, FITM_ERR_INVALID, "dummy_text gives no tokens");
    return st;
}

/* t with "\\n" and "\\\\" unescaped, malloc'd; NULL when out of memory. */
static char *unescape(const char *t)
{
    char *u = malloc(strlen(t) + 1), *o = u;
    if (!u)
        return NULL;
    for (; *t; t++) {
        bool esc = t[0] == '\\' && (t[1] == 'n' || t[1] == '\\');
        *o++ = esc ? (t[1] == 'n' ? '\n' : '\\') : *t;
        t += esc;
    }
    *o = '\0';
    return u;
}

/* The answer template, unescaped, cut at its one {documents}, and its stop string: the
 * configured one, else the built-in template's line break (its worked answers are one line
 * each), else none. */
static fitm_status parse_answer_template(fitm_reranker *r, const char *t, const char *stop,
                                         fitm_err *err)
{
    static const char DOCS[] = "{documents}";
    const bool builtin = !t || !*t;
    t = builtin ? fitm_rerank_answer_template : t;
    char *u = unescape(t);
    if (!u)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    r->answer_text = u;
    if (stop && *stop ? !(r->answer_stop[0] = unescape(stop))
                      : builtin && !(r->answer_stop[0] = unescape("\\n")))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    char *d = strstr(u, DOCS);
    if (!d || strstr(d + 1, DOCS) || !strstr(d, "{question}"))
        return fitm_err_set(err, FITM_ERR_INVALID, "answer_template must hold {documents} once "
                                                   "and {question} after it");
    *d = '\0';
    r->answer_frame = (fitm_rerank_frame){.before = u, .after = d + sizeof DOCS - 1};
    return FITM_OK;
}

/* Built-in options under the server's. */
static fitm_status resolve_defaults(fitm_reranker *r, const fitm_reranker_params *p,
                                    fitm_err *err)
{
    fitm_status st = fitm_score_opts_builtin(&r->defaults, r->L, err);
    if (st == FITM_OK && p->defaults)
        st = fitm_score_opts_overlay(&r->defaults, p->defaults, err);
    if (st == FITM_OK && p->defaults && isnan(p->defaults->score_scale) &&
        !isnan(p->defaults->temperature))
        r->defaults.score_scale = 1.0 / r->defaults.temperature; /* still orders like weight */
    r->paper_temperature = p->paper_temperature > 0 ? p->paper_temperature : 5e-5;
    r->answer = (fitm_answer_defaults){.calibrate = 1, .reorder = -1, .reorder_last = 0};
    if (p->answer)
        fitm_answer_defaults_overlay(&r->answer, p->answer);
    return st;
}

fitm_status fitm_reranker_create(fitm_reranker **out, const fitm_model *m,
                                 const fitm_tokenizer *tok, fitm_backend *b,
                                 const fitm_reranker_params *p, fitm_err *err)
{
    *out = NULL;
    const fitm_model_config *c = fitm_model_config_of(m);
    if (p->n_ctx < 16 || p->chunk < 1)
        return fitm_err_set(err, FITM_ERR_INVALID, "reranker: context %lld or chunk %lld too small",
                            (long long)p->n_ctx, (long long)p->chunk);
    fitm_reranker *r = calloc(1, sizeof *r);
    if (!r)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_score_opts_init(&r->defaults);
    r->m = m;
    r->tok = tok;
    r->b = b;
    r->n_ctx = p->n_ctx;
    r->chunk = p->chunk < p->n_ctx ? p->chunk : p->n_ctx;
    r->L = c->n_layer;
    r->H = c->n_head;
    r->tmpl = pick_template(m, tok, p->chat_template);
    r->V = c->n_vocab;
    r->logit_rows = r->chunk < LOGIT_ROWS ? r->chunk : LOGIT_ROWS;
    fitm_forward_params fp = {.max_tokens = r->chunk, .max_ctx = r->n_ctx,
                              .max_logits = r->logit_rows};
    fitm_status st;
    r->logits = malloc((size_t)r->logit_rows * (size_t)(uint32_t)r->V * sizeof *r->logits);
    r->kv_ids = malloc((size_t)r->n_ctx * sizeof *r->kv_ids);
    if (!r->logits || !r->kv_ids) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for logits");
        goto fail;
    }
    r->moice = p->moice;
    r->position_default = p->position;
    r->answer_path = p->answer_prompt_step ? FITM_PATH_STEP : FITM_PATH_BATCH;
    r->rerank_path = p->rerank_step ? FITM_PATH_STEP : FITM_PATH_BATCH;
    r->run_path = FITM_PATH_BATCH;
    if ((st = fitm_forward_create(&r->fwd, m, b, &fp, err)) != FITM_OK ||
        (st = fitm_forward_positions(r->fwd, p->moice, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->kv, b, c, r->n_ctx, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->branch, b, c, r->n_ctx, err)) != FITM_OK ||
        (st = encode_dummy(r, p->dummy_text, err)) != FITM_OK ||
        (st = resolve_defaults(r, p, err)) != FITM_OK ||
        (st = parse_answer_template(r, p->answer_template, p->answer_stop, err)) != FITM_OK)
        goto fail;
    snprintf(r->profile, sizeof r->profile, "%s", p->profile ? p->profile : "");
    *out = r;
    return FITM_OK;
fail:
    fitm_err_prefix(err, "reranker");
    fitm_reranker_destroy(r);
    return st;
}

/* How many tokens of a document's text to keep: max_tokens_per_doc, or all of them when a
 * longer document is refused instead (no_truncate, checked by doc_fits). */
static int64_t doc_keep(const fitm_rerank_request *req)
{
    return req->no_truncate ? -1 : req->max_tokens_per_doc;
}

/* FITM_ERR_LIMIT naming document k when the request refuses to cut it and its n tokens are
 * over max_tokens_per_doc. */
static fitm_status doc_fits(const fitm_rerank_request *req, int32_t k, int64_t n, fitm_err *err)
{
    if (!req->no_truncate || req->max_tokens_per_doc <= 0 || n <= req->max_tokens_per_doc)
        return FITM_OK;
    return fitm_err_set(err, FITM_ERR_LIMIT,
                        "'%s[%d]' has %lld tokens, more than max_tokens_per_doc = %d (send "
                        "truncate: true to cut it)",
                        req->tei ? "texts" : "documents", (int)k, (long long)n,
                        (int)req->max_tokens_per_doc);
}

fitm_status fitm_rr_body(const fitm_reranker *r, const fitm_rerank_request *req, int32_t k,
                         fitm_rr_ids *a, fitm_err *err)
{
    const fitm_rerank_doc *d = &req->docs[k];
    char *line = malloc(d->text_len + 2);
    if (!line)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    line[0] = ' ';
    memcpy(line + 1, d->text, d->text_len);
    const int64_t before = a->n;
    fitm_status st = fitm_rr_encode(r->tok, a, line, d->text_len + 1, FITM_TOK_CONTINUATION,
                                    doc_keep(req), err);
    free(line);
    if (st == FITM_OK)
        st = doc_fits(req, k, a->n - before, err);
    return st;
}

/* Appends text[0..len) with every {question} replaced by q (tokenized on its own, so its
 * span is exact; a space before the marker goes with the question). *span: the last
 * occurrence's span. first: the flags of the first piece. */
static fitm_status encode_framed(const fitm_reranker *r, fitm_rr_ids *ids, const char *text,
                                 const char *q, size_t q_len, uint32_t first, fitm_span *span,
                                 fitm_err *err)
{
    static const char MARK[] = "{question}";
    fitm_status st = FITM_OK;
    uint32_t flags = first;
    while (st == FITM_OK && *text) {
        const char *m = strstr(text, MARK);
        size_t n = m ? (size_t)(m - text) : strlen(text);
        bool space = m && n > 0 && text[n - 1] == ' ';
        if (n - space > 0) {
            st = fitm_rr_encode(r->tok, ids, text, n - space, flags, -1, err);
            flags = FITM_TOK_CONTINUATION;
        }
        if (!m || st != FITM_OK)
            break;
        char *piece = malloc(q_len + 2);
        if (!piece)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        piece[0] = ' ';
        memcpy(piece + 1, q, q_len);
        int64_t s = ids->n;
        st = fitm_rr_encode(r->tok, ids, piece + !space, q_len + space, flags, -1, err);
        free(piece);
        flags = FITM_TOK_CONTINUATION;
        if (span)
            *span = (fitm_span){.start = s, .end = ids->n};
        text = m + sizeof MARK - 1;
    }
    return st;
}

/* The line before each document's body (its 1-based position, its title). */
#define DOC_HEADER "Document [%d](Title: %s)"

/* The document lines: "Document [i](Title: t)" + body + "\n" each, spans of the bodies. */
static fitm_status encode_documents(const fitm_reranker *r, const fitm_rerank_request *req,
                                    const int32_t *order, int32_t n, fitm_rr_ids *ids,
                                    fitm_span *spans, fitm_err *err)
{
    for (int32_t k = 0; k < n; k++) {
        const fitm_rerank_doc *d = &req->docs[order ? order[k] : k];
        size_t cap = d->title_len + 64;
        char *line = malloc(cap);
        if (!line)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        int hn = snprintf(line, cap, DOC_HEADER, (int)k + 1, d->title);
        fitm_status st = fitm_rr_encode(r->tok, ids, line, (size_t)hn, FITM_TOK_CONTINUATION, -1,
                                        err);
        free(line);
        spans[k].start = ids->n;
        if (st == FITM_OK)
            st = fitm_rr_body(r, req, order ? order[k] : k, ids, err);
        spans[k].end = ids->n;
        if (st == FITM_OK)
            st = fitm_rr_encode(r->tok, ids, "\n", 1, FITM_TOK_CONTINUATION, -1, err);
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

fitm_status fitm_rr_build_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const fitm_rerank_frame *f, const int32_t *order, int32_t n,
                                 const fitm_rr_queries *q, fitm_rr_ids *ids, fitm_span *spans,
                                 fitm_span *question, fitm_err *err)
{
    f = f ? f : &fitm_rerank_default_frame;
    fitm_rr_queries own = {req->query, req->query, req->query_len, req->query_len};
    q = q ? q : &own;
    bool raw = r->tmpl == &templates[0];
    fitm_span unused;
    fitm_status st;
    /* BOS and the template's head (its control tokens parsed; user text never is). */
    if ((st = fitm_rr_encode(r->tok, ids, r->tmpl->head, strlen(r->tmpl->head),
                             FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, -1, err)) != FITM_OK ||
        (st = encode_framed(r, ids, f->before, q->head, q->head_len,
                            raw ? 0 : FITM_TOK_CONTINUATION, &unused, err)) != FITM_OK ||
        (st = encode_documents(r, req, order, n, ids, spans, err)) != FITM_OK ||
        (st = encode_framed(r, ids, f->after, q->tail, q->tail_len, FITM_TOK_CONTINUATION,
                            question ? question : &unused, err)) != FITM_OK)
        return st;
    if (!raw)
        st = fitm_rr_encode(r->tok, ids, r->tmpl->tail, strlen(r->tmpl->tail),
                            FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
    return st;
}

/* The sub-capture of cap for the rows in [pos0, pos0 + n) (NULL when none are). */
static const fitm_capture *capture_part(const fitm_reranker *r, const fitm_capture *cap,
                                        int64_t pos0, int64_t n, fitm_capture *part)
{
    if (!cap)
        return NULL;
    int32_t i = 0, j;
    while (i < cap->n_rows && cap->rows[i] < pos0)
        i++;
    for (j = i; j < cap->n_rows && cap->rows[j] < pos0 + n; j++)
        ;
    if (j == i)
        return NULL;
    const size_t per = (size_t)r->L * (size_t)r->H;
    *part = *cap;
    part->rows = cap->rows + i;
    part->n_rows = j - i;
    if (cap->span_mass)
        part->span_mass = cap->span_mass + (size_t)i * per * (size_t)cap->n_spans;
    if (cap->probs)
        part->probs = cap->probs + (size_t)i * per * (size_t)cap->probs_stride;
    return part;
}

static fitm_status seq_pass(struct fitm_rerank_seq *q, fitm_kv *kv, const fitm_kv *prefix,
                            const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                            int64_t n_logits, int32_t n_layers, fitm_forward_path path,
                            fitm_err *err);

fitm_status fitm_rr_run(fitm_reranker *r, fitm_kv *kv, const fitm_kv *prefix, const int32_t *ids,
                        int64_t n, int64_t pos0, const fitm_capture *cap, int64_t n_logits,
                        fitm_rr_stop stop, const void *stop_arg, fitm_err *err)
{
    if (kv == r->kv && r->kv_n > pos0)
        r->kv_n = pos0; /* rows from pos0 on are about to change */
    /* Rows a later /answer may continue (fitm_reranker_cached): every layer's, computed as its
     * prompt would be. A pass that stops early leaves the later layers without its rows. */
    const int32_t layers = n_logits ? 0 : r->run_layers;
    const bool reusable = layers == 0 && r->run_path == r->answer_path;
    if (r->seq)
        return seq_pass(r->seq, kv, prefix, ids, n, pos0, cap, n_logits, layers, r->run_path,
                        err);
    fitm_status pst;
    if (r->position == FITM_POSITION_BUCKETS &&
        (pst = fitm_kv_passes(kv, FITM_BUCKETS, pos0 + n - fitm_kv_pos_base(kv), err)) != FITM_OK)
        return pst;
    for (int64_t off = 0; off < n; off += r->chunk) {
        if (stop && stop(stop_arg))
            return fitm_err_set(err, FITM_ERR_TIMEOUT,
                                "stopped: the request's deadline passed or the server is "
                                "shutting down");
        int64_t len = n - off < r->chunk ? n - off : r->chunk;
        bool last_call = off + len == n;
        fitm_capture part;
        /* Never AUTO: a reference pass's last chunk may be one token, and its rows must be
         * computed exactly as the original pass's were. */
        fitm_forward_opts o = {.prefix = prefix,
                               .position = r->position,
                               .capture = capture_part(r, cap, pos0 + off, len, &part),
                               .n_logits = last_call ? n_logits : 0,
                               .logits = last_call && n_logits ? r->logits : NULL,
                               .path = r->run_path,
                               .n_layers = layers};
        fitm_status st = fitm_forward_run(r->fwd, kv, ids + off, len, pos0 + off, &o, err);
        if (st == FITM_ERR_INVALID || st == FITM_ERR_LIMIT) {
            fitm_err_prefix(err, "forward pass");
            return FITM_ERR_INTERNAL; /* arguments were checked: this is a bug */
        }
        if (st != FITM_OK)
            return st;
        if (kv == r->kv && r->kv_n == pos0 + off && prefix == NULL && reusable) {
            memcpy(r->kv_ids + pos0 + off, ids + off, (size_t)len * sizeof *ids);
            r->kv_n = pos0 + off + len;
        }
    }
    return FITM_OK;
}


/* ---- a /rerank in the running batch ------------------------------------------------------ */

typedef enum {
    SEQ_HOST,     /* the helper thread runs the method's host side                  */
    SEQ_POSTED,   /* it waits for the posted pass                                   */
    SEQ_FINISHED, /* the method returned: run_st, run_err                            */
} seq_phase;

struct fitm_rerank_seq {
    fitm_reranker view; /* the reranker with caches of its own, .seq = this            */
    const fitm_rerank_request *req;
    bool (*stop)(const void *);
    const void *stop_arg;
    fitm_rerank_result *res;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    seq_phase phase;        /* under mu: who runs                                       */
    /* The posted pass (fitm_rr_run's arguments), and how far it got. */
    fitm_kv *kv;
    const fitm_kv *prefix;
    const int32_t *ids;
    int64_t n, pos0, n_logits, done_rows;
    int32_t n_layers;
    fitm_forward_path path;
    const fitm_capture *cap;
    fitm_status pass_st;    /* what the pass ended with, for the helper thread          */
    fitm_err pass_err;
    fitm_capture part_cap;  /* this step's part                                         */
    fitm_forward_opts part_opts;
    fitm_status run_st;     /* the method's status, when FINISHED                       */
    fitm_err run_err;
};

/* Helper thread, inside fitm_rr_run: posts the pass, waits until the steps have run it. */
static fitm_status seq_pass(fitm_rerank_seq *q, fitm_kv *kv, const fitm_kv *prefix,
                            const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                            int64_t n_logits, int32_t n_layers, fitm_forward_path path,
                            fitm_err *err)
{
    if (n < 1)
        return FITM_OK;
    pthread_mutex_lock(&q->mu);
    q->kv = kv;
    q->prefix = prefix;
    q->ids = ids;
    q->n = n;
    q->pos0 = pos0;
    q->cap = cap;
    q->n_logits = n_logits;
    q->n_layers = n_layers;
    q->path = path;
    q->done_rows = 0;
    q->phase = SEQ_POSTED;
    pthread_cond_broadcast(&q->cv);
    while (q->phase == SEQ_POSTED)
        pthread_cond_wait(&q->cv, &q->mu);
    fitm_status st = q->pass_st;
    if (st != FITM_OK)
        *err = q->pass_err;
    pthread_mutex_unlock(&q->mu);
    return st;
}

static void *seq_main(void *arg)
{
    fitm_rerank_seq *q = arg;
    fitm_err err = {{0}};
    fitm_status st = fitm_reranker_run(&q->view, q->req, q->stop, q->stop_arg, q->res, &err);
    pthread_mutex_lock(&q->mu);
    q->run_st = st;
    q->run_err = err;
    q->phase = SEQ_FINISHED;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* The caller's side: waits while the helper thread runs its host side (mu held). */
static void seq_wait_host(fitm_rerank_seq *q)
{
    while (q->phase == SEQ_HOST)
        pthread_cond_wait(&q->cv, &q->mu);
}

bool fitm_rerank_batches(const fitm_rerank_request *req)
{
    return req->method == FITM_RERANK_CALIBRATED || req->method == FITM_RERANK_ATTENTION ||
           req->method == FITM_RERANK_PAPER;
}

static void seq_free(fitm_rerank_seq *q)
{
    fitm_kv_destroy(q->view.kv);
    fitm_kv_destroy(q->view.branch);
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

fitm_status fitm_rerank_begin(fitm_reranker *r, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_rerank_seq **out, fitm_err *err)
{
    *out = NULL;
    memset(res, 0, sizeof *res);
    if (!fitm_rerank_batches(req))
        return fitm_err_set(err, FITM_ERR_INTERNAL, "method %s does not run as a sequence",
                            fitm_rerank_method_name(req->method));
    int64_t rows = 0;
    fitm_status st = fitm_rr_attention_rows(r, req, &rows, err);
    if (st != FITM_OK)
        return st;
    fitm_rerank_seq *q = calloc(1, sizeof *q);
    if (!q)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    /* Shares what the reranker holds read-only; never its caches, scratch or logits (the
     * attention methods read no logits). */
    q->view = *r;
    q->view.kv = q->view.branch = NULL;
    q->view.fwd = NULL;
    q->view.logits = NULL;
    q->view.kv_ids = NULL;
    q->view.kv_n = 0;
    q->view.seq = q;
    q->req = req;
    q->stop = stop;
    q->stop_arg = stop_arg;
    q->res = res;
    q->phase = SEQ_HOST;
    if (pthread_mutex_init(&q->mu, NULL)) {
        free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot create a lock");
    }
    if (pthread_cond_init(&q->cv, NULL)) {
        pthread_mutex_destroy(&q->mu);
        free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot create a condition");
    }
    /* the caches hold a pass per bucket when the request runs attention_buckets */
    q->view.position = req->position < 0 ? r->position_default
                                          : (fitm_position_method)req->position;
    if ((st = fitm_reranker_kv_create(&q->view, rows > 0 ? rows : 1, &q->view.kv, err)) !=
            FITM_OK ||
        (st = fitm_reranker_kv_create(&q->view, rows > 0 ? rows : 1, &q->view.branch, err)) !=
            FITM_OK) {
        seq_free(q);
        return st;
    }
    if (pthread_create(&q->thread, NULL, seq_main, q)) {
        seq_free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start a rerank thread");
    }
    q->started = true;
    pthread_mutex_lock(&q->mu);
    seq_wait_host(q);
    bool finished = q->phase == SEQ_FINISHED;
    pthread_mutex_unlock(&q->mu);
    if (finished)
        return fitm_rerank_end(q, err);
    *out = q;
    return FITM_OK;
}

void fitm_rerank_seq_part(fitm_rerank_seq *q, int64_t budget, fitm_forward_seq *part)
{
    const int64_t left = q->n - q->done_rows;
    int64_t T = left;
    if (left > budget) /* the logit rows stay in the pass's last call */
        T = left - q->n_logits >= 1 ? (budget < left - q->n_logits ? budget : left - q->n_logits)
                                    : left;
    T = T < 1 ? 1 : T;
    const bool last = q->done_rows + T == q->n;
    const int64_t pos = q->pos0 + q->done_rows;
    q->part_opts = (fitm_forward_opts){
        .prefix = q->prefix, .capture = capture_part(&q->view, q->cap, pos, T, &q->part_cap),
        .n_logits = last ? q->n_logits : 0, .logits = NULL, .position = q->view.position,
        .path = q->path, .n_layers = q->n_layers};
    *part = (fitm_forward_seq){q->kv, q->ids + q->done_rows, T, pos, &q->part_opts};
}

void fitm_rerank_seq_after(fitm_rerank_seq *q, int64_t T, fitm_status st, const fitm_err *err,
                           bool *done)
{
    pthread_mutex_lock(&q->mu);
    *done = q->phase == SEQ_FINISHED;
    if (q->phase == SEQ_POSTED) {
        q->done_rows += st == FITM_OK ? T : 0;
        if (st != FITM_OK || q->done_rows >= q->n) {
            q->pass_st = st;
            if (st != FITM_OK)
                q->pass_err = *err;
            q->phase = SEQ_HOST;
            pthread_cond_broadcast(&q->cv);
            seq_wait_host(q);
            *done = q->phase == SEQ_FINISHED;
        }
    }
    pthread_mutex_unlock(&q->mu);
}

bool fitm_rerank_seq_stopped(const fitm_rerank_seq *q)
{
    return q->stop && q->stop(q->stop_arg);
}

fitm_status fitm_rerank_end(fitm_rerank_seq *q, fitm_err *err)
{
    if (q->started) {
        pthread_mutex_lock(&q->mu);
        /* A sequence ended early (shutdown) unwinds its helper thread first. */
        while (q->phase != SEQ_FINISHED) {
            if (q->phase == SEQ_POSTED) {
                q->pass_st = fitm_err_set(&q->pass_err, FITM_ERR_TIMEOUT,
                                          "stopped: the request's deadline passed or the server "
                                          "is shutting down");
                q->phase = SEQ_HOST;
                pthread_cond_broadcast(&q->cv);
            }
            seq_wait_host(q);
        }
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->thread, NULL);
    }
    fitm_status st = q->run_st;
    if (st != FITM_OK)
        *err = q->run_err;
    seq_free(q);
    return st;
}

size_t fitm_rerank_seq_kv_bytes(const fitm_rerank_seq *q)
{
    return fitm_kv_bytes(q->view.kv) + fitm_kv_bytes(q->view.branch);
}

/* fitm_rr_run without logits. */
static fitm_status run_tokens(fitm_reranker *r, fitm_kv *kv, const fitm_kv *prefix,
                              const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                              fitm_rr_stop stop, const void *stop_arg, fitm_err *err)
{
    return fitm_rr_run(r, kv, prefix, ids, n, pos0, cap, 0, stop, stop_arg, err);
}

/* run_tokens_logits: the per-document methods' name for fitm_rr_run. */
#define run_tokens_logits fitm_rr_run

/* A[k]: mean over the span's visible chosen layers and all heads of (span mass / N_k). */
static void doc_attention(const fitm_reranker *r, const float *mass, int32_t n_spans,
                          int32_t k, int64_t span_start, int64_t N, const uint8_t *use,
                          int64_t last, double *out)
{
    double sum = 0;
    int64_t count = 0;
    for (int32_t l = 0; l < r->L; l++) {
        if (!use[l] || !fitm_model_key_visible(r->m, l, last, span_start))
            continue;
        for (int32_t h = 0; h < r->H; h++)
            sum += mass[((int64_t)l * r->H + h) * n_spans + k];
        count += r->H;
    }
    *out = count && N > 0 ? sum / (double)count / (double)N : 0.0;
}

static int cmp_results(const void *a, const void *b)
{
    const fitm_rerank_doc_result *x = a, *y = b;
    if (x->relevance_score != y->relevance_score)
        return x->relevance_score > y->relevance_score ? -1 : 1;
    return x->index - y->index;
}

void fitm_rr_sort(fitm_rerank_doc_result *res, int32_t K)
{
    qsort(res, (size_t)K, sizeof *res, cmp_results);
}

fitm_status fitm_rr_layers(const fitm_reranker *r, const int32_t *layers, int32_t n, uint8_t *use,
                           fitm_err *err)
{
    memset(use, 0, (size_t)(uint32_t)r->L);
    if (n > 0) {
        for (int32_t i = 0; i < n; i++) {
            int32_t l = layers[i] < 0 ? r->L + layers[i] : layers[i];
            if (l < 0 || l >= r->L)
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "'layers[%d]' = %d: the model has %d layers", (int)i,
                                    (int)layers[i], (int)r->L);
            use[l] = 1;
        }
        return FITM_OK;
    }
    bool any_global = false;
    for (int32_t l = 0; l < r->L; l++)
        any_global |= !fitm_model_layer(r->m, l)->local;
    for (int32_t l = 0; l < r->L; l++)
        use[l] = !any_global || !fitm_model_layer(r->m, l)->local;
    return FITM_OK;
}

int32_t fitm_rr_last_layer(const fitm_reranker *r, const uint8_t *use)
{
    int32_t n = 0;
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            n = l + 1;
    return n;
}

/* The layers to average over (fitm_rr_layers of the request's), listed into meta. */
static fitm_status choose_layers(const fitm_reranker *r, const fitm_rerank_request *req,
                                 uint8_t *use, fitm_rerank_meta *meta, fitm_err *err)
{
    fitm_status st = fitm_rr_layers(r, req->opt.layers, req->opt.layers ? req->opt.n_layers : 0,
                                    use, err);
    if (st != FITM_OK)
        return st;
    meta->layers = calloc((size_t)(uint32_t)r->L, sizeof *meta->layers);
    if (!meta->layers)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            meta->layers[meta->n_layers++] = l;
    return FITM_OK;
}

fitm_status fitm_rr_too_long(int64_t T, const fitm_reranker *r, const fitm_rerank_request *req,
                             fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_LIMIT,
                        "the prompt is %lld tokens, over the context of %lld tokens even with "
                        "documents cut to max_tokens_per_doc = %d tokens: send fewer or "
                        "shorter documents",
                        (long long)T, (long long)r->n_ctx, (int)req->max_tokens_per_doc);
}
#define prompt_too_long fitm_rr_too_long


/* The next pass's order: positions stably sorted by mass M, ascending (the most attended go
 * last, next to the question); next is (K) scratch. */
static void reorder_by_mass(int32_t *order, int32_t *next, const double *M, int32_t K)
{
    for (int32_t p = 0; p < K; p++)
        next[p] = p;
    for (int32_t i = 1; i < K; i++)
        for (int32_t j = i; j > 0 && M[next[j - 1]] > M[next[j]]; j--) {
            int32_t t = next[j];
            next[j] = next[j - 1];
            next[j - 1] = t;
        }
    for (int32_t p = 0; p < K; p++)
        next[p] = order[next[p]];
    memcpy(order, next, (size_t)K * sizeof *order);
}

/* attention_sort: score every document by its attention mass (sum over its tokens), move the
 * most attended documents last (next to the question), and rerun; the last pass scores. */
static fitm_status run_attention_sort(fitm_reranker *r, const fitm_rerank_request *req,
                                      bool (*stop)(const void *), const void *stop_arg,
                                      fitm_rerank_result *res, fitm_err *err)
{
    double t0 = now_ms(), tok_ms = 0;
    const int32_t K = req->n_docs;
    fitm_rr_ids ids = {0};
    fitm_span *spans = calloc((size_t)K, sizeof *spans);
    uint8_t *use = malloc((size_t)(uint32_t)r->L);
    int32_t *order = malloc((size_t)K * sizeof *order), *next = malloc((size_t)K * sizeof *next);
    double *A = calloc((size_t)K * 2, sizeof *A), *M = A ? A + K : NULL;
    float *mass = malloc((size_t)(uint32_t)r->L * (size_t)(uint32_t)r->H * (size_t)K * sizeof *mass);
    fitm_status st = FITM_OK;
    if (!spans || !use || !order || !next || !A || !mass) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %d documents", (int)K);
        goto done;
    }
    if ((st = choose_layers(r, req, use, &res->meta, err)) != FITM_OK)
        goto done;
    r->run_layers = r->run_all_layers ? 0 : fitm_rr_last_layer(r, use); /* none read later */
    for (int32_t k = 0; k < K; k++)
        order[k] = k;
    int64_t forward = 0, T = 0;
    for (int pass = 0; pass < SORT_PASSES; pass++) {
        double tt = now_ms();
        ids.n = 0;
        if ((st = fitm_rr_build_prompt(r, req, NULL, order, K, NULL, &ids, spans, NULL, err)) != FITM_OK)
            goto done;
        tok_ms += now_ms() - tt;
        T = ids.n;
        if (T > r->n_ctx) {
            st = prompt_too_long(T, r, req, err);
            goto done;
        }
        const int64_t last = T - 1;
        fitm_capture cap = {.rows = &last, .n_rows = 1, .spans = spans, .n_spans = K,
                            .span_mass = mass};
        if ((st = fitm_kv_rebase(r->kv, 0, err)) != FITM_OK ||
            (st = run_tokens(r, r->kv, NULL, ids.v, T, 0, &cap, stop, stop_arg, err)) != FITM_OK)
            goto done;
        forward += T;
        for (int32_t p = 0; p < K; p++) {
            int64_t N = spans[p].end - spans[p].start;
            doc_attention(r, mass, K, p, spans[p].start, N, use, last, &A[p]);
            M[p] = A[p] * (double)N;
        }
        if (pass == SORT_PASSES - 1)
            break;
        reorder_by_mass(order, next, M, K);
    }
    res->results = calloc((size_t)K, sizeof *res->results);
    if (!res->results) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    res->n_results = K;
    for (int32_t p = 0; p < K; p++) {
        fitm_rerank_doc_result *o = &res->results[p];
        o->index = order[p];
        o->position = p;
        o->attention = A[p];
        o->relevance_score = M[p];
        o->raw_score = M[p];
    }
    qsort(res->results, (size_t)K, sizeof *res->results, cmp_results);
    res->usage = (fitm_rerank_usage){.prompt_tokens = T, .forward_tokens = forward,
                                     .total_tokens = T};
    res->meta.tokenize_ms = tok_ms;
    res->meta.forward_ms = now_ms() - t0 - tok_ms;
done:
    r->run_layers = 0;
    free(ids.v);
    free(spans);
    free(use);
    free(order);
    free(next);
    free(A);
    free(mass);
    return st;
}

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
        fitm_rr_ids v = {0};
        if (fitm_rr_encode(tok, &v, words[w], strlen(words[w]), FITM_TOK_CONTINUATION, -1, NULL) ==
                FITM_OK &&
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
    bool ql;          /* query_likelihood, else relevance                           */
    fitm_rr_ids q;    /* query_likelihood: " {query}" + RESTRICT, the scored tokens */
    int32_t yes[4], no[4];
    int n_yes, n_no;  /* relevance: first tokens of Yes/yes and No/no             */
} per_doc;

/* query_likelihood's prompt for document k: BOS, its text, "\n\nQuestion:", then the scored
 * question (whose last token is never fed). */
static fitm_status ql_prompt(const fitm_reranker *r, const fitm_rerank_request *req, int32_t k,
                             const per_doc *pd, fitm_rr_ids *ids, fitm_err *err)
{
    const fitm_rerank_doc *d = &req->docs[k];
    fitm_status st = fitm_rr_encode(r->tok, ids, "", 0, FITM_TOK_ADD_BOS, -1, err);
    const int64_t body = ids->n;
    if (!st)
        st = fitm_rr_encode(r->tok, ids, d->text, d->text_len, 0, doc_keep(req), err);
    if (!st)
        st = doc_fits(req, k, ids->n - body, err);
    if (!st)
        st = fitm_rr_encode(r->tok, ids, "\n\nQuestion:", 11, FITM_TOK_CONTINUATION, -1, err);
    if (!st && !(st = fitm_rr_reserve(ids, pd->q.n, err))) {
        memcpy(ids->v + ids->n, pd->q.v, (size_t)pd->q.n * sizeof *ids->v);
        ids->n += pd->q.n;
    }
    return st;
}

/* relevance's prompt for document k, in the chat template: "Document: {text}\n\nQuestion:
 * {query}" + ASK (+ "\nAnswer:" without a template). */
static fitm_status relevance_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                    int32_t k, fitm_rr_ids *ids, fitm_err *err)
{
    const bool raw = fitm_reranker_is_raw(r);
    fitm_status st = fitm_rr_encode(r->tok, ids, r->tmpl->head, strlen(r->tmpl->head),
                                    FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, -1, err);
    if (!st)
        st = fitm_rr_encode(r->tok, ids, "Document:", 9, raw ? 0 : FITM_TOK_CONTINUATION, -1, err);
    if (!st)
        st = fitm_rr_body(r, req, k, ids, err);
    size_t qn = req->query_len + sizeof ASK + 32;
    char *buf = st ? NULL : malloc(qn);
    if (!st && !buf)
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (!st) {
        int n = snprintf(buf, qn, "\n\nQuestion: %s%s%s", req->query, ASK, raw ? "\nAnswer:" : "");
        st = fitm_rr_encode(r->tok, ids, buf, (size_t)n, FITM_TOK_CONTINUATION, -1, err);
    }
    free(buf);
    if (!st && !raw)
        st = fitm_rr_encode(r->tok, ids, r->tmpl->tail, strlen(r->tmpl->tail),
                            FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
    return st;
}

/* query_likelihood's score of a prompt of T fed tokens whose question starts at n_pre: the
 * geometric-mean probability of the question's tokens, logit_rows at a time. */
static fitm_status ql_score(fitm_reranker *r, const per_doc *pd, const fitm_rr_ids *ids,
                            int64_t n_pre, int64_t T, fitm_rr_stop stop, const void *stop_arg,
                            double *score, fitm_err *err)
{
    int64_t head = n_pre - 1; /* rows head .. T - 1 predict the question's tokens */
    fitm_status st = FITM_OK;
    if (head > 0)
        st = run_tokens(r, r->kv, NULL, ids->v, head, 0, NULL, stop, stop_arg, err);
    double sum = 0;
    for (int64_t p = head; st == FITM_OK && p < T; p += r->logit_rows) {
        int64_t n = T - p < r->logit_rows ? T - p : r->logit_rows;
        st = run_tokens_logits(r, r->kv, NULL, ids->v + p, n, p, NULL, n, stop, stop_arg, err);
        for (int64_t i = 0; st == FITM_OK && i < n; i++)
            sum += log_prob(r->logits + i * r->V, r->V, ids->v[p + i + 1]);
    }
    *score = exp(sum / (double)pd->q.n);
    return st;
}

/* relevance's score: P(yes) / (P(yes) + P(no)) after the whole prompt. */
static fitm_status relevance_score(fitm_reranker *r, const per_doc *pd, const fitm_rr_ids *ids,
                                   fitm_rr_stop stop, const void *stop_arg, double *score,
                                   fitm_err *err)
{
    fitm_status st = run_tokens_logits(r, r->kv, NULL, ids->v, ids->n, 0, NULL, 1, stop,
                                       stop_arg, err);
    double py = 0, pn = 0;
    for (int i = 0; st == FITM_OK && i < pd->n_yes; i++)
        py += exp(log_prob(r->logits, r->V, pd->yes[i]));
    for (int i = 0; st == FITM_OK && i < pd->n_no; i++)
        pn += exp(log_prob(r->logits, r->V, pd->no[i]));
    *score = py + pn > 0 ? py / (py + pn) : 0.5;
    return st;
}

static fitm_status per_doc_init(const fitm_reranker *r, const fitm_rerank_request *req,
                                per_doc *pd, fitm_err *err)
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
            fitm_rr_encode(r->tok, &pd->q, buf, (size_t)len, FITM_TOK_CONTINUATION, -1, err);
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

/* query_likelihood (LongLLMLingua's r_k): per document, the mean log-probability of
 * " {query} We can get the answer to this question in the given documents." after
 * "{text}\n\nQuestion:"; relevance_score = exp of it (the tokens' geometric-mean probability).
 * relevance: per document, "Document: {text}\n\nQuestion: {query}\n\nIs the document relevant
 * to the question? Answer Yes or No." in the chat template; relevance_score = P(yes) /
 * (P(yes) + P(no)) over the first tokens of "Yes"/"yes" and "No"/"no". One pass per document
 * on a cache of its own prompt (no shared prefix to reuse). */
static fitm_status run_per_document(fitm_reranker *r, const fitm_rerank_request *req,
                                    bool (*stop)(const void *), const void *stop_arg,
                                    fitm_rerank_result *res, fitm_err *err)
{
    double t0 = now_ms(), tok_ms = 0;
    const int32_t K = req->n_docs;
    per_doc pd = {.ql = req->method == FITM_RERANK_QUERY_LIKELIHOOD};
    fitm_rr_ids ids = {0};
    int64_t forward = 0, T_max = 0;
    res->results = calloc((size_t)K, sizeof *res->results);
    fitm_status st = res->results ? per_doc_init(r, req, &pd, err)
                                  : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    res->n_results = res->results ? K : 0;
    for (int32_t k = 0; st == FITM_OK && k < K; k++) {
        double tt = now_ms(), score = 0;
        ids.n = 0;
        st = pd.ql ? ql_prompt(r, req, k, &pd, &ids, err) : relevance_prompt(r, req, k, &ids, err);
        tok_ms += now_ms() - tt;
        int64_t T = pd.ql ? ids.n - 1 : ids.n; /* the question's last token is never fed */
        if (st == FITM_OK && T > r->n_ctx)
            st = prompt_too_long(T, r, req, err);
        if (st == FITM_OK)
            st = fitm_kv_rebase(r->kv, 0, err);
        if (st == FITM_OK)
            st = pd.ql ? ql_score(r, &pd, &ids, ids.n - pd.q.n, T, stop, stop_arg, &score, err)
                       : relevance_score(r, &pd, &ids, stop, stop_arg, &score, err);
        T_max = T > T_max ? T : T_max;
        forward += T;
        res->results[k] = (fitm_rerank_doc_result){.index = k, .position = k,
                                                   .relevance_score = score, .raw_score = score};
    }
    if (st == FITM_OK)
        fitm_rr_sort(res->results, K);
    res->usage = (fitm_rerank_usage){.prompt_tokens = T_max, .forward_tokens = forward,
                                     .total_tokens = T_max};
    res->meta.tokenize_ms = tok_ms;
    res->meta.forward_ms = now_ms() - t0 - tok_ms;
    free(ids.v);
    free(pd.q.v);
    return st;
}

fitm_status fitm_reranker_run(fitm_reranker *r, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_err *err)
{
    memset(res, 0, sizeof *res);
    fitm_score_opts_init(&res->meta.opts);
    res->meta.method = req->method;
    fitm_status pst = fitm_reranker_use_position(r, req->position, err);
    if (pst != FITM_OK)
        return pst;
    res->meta.position = r->position;
    r->run_path = req->answer_scoring ? r->answer_path : r->rerank_path;
    /* An answer continues its scoring's rows only when its frame has the scoring prompt's
     * text before the documents; else (the default answer template on a raw model, a text of
     * its own) those rows are read for their attention only, as a rerank's. */
    r->run_all_layers =
        req->answer_scoring &&
        strcmp(fitm_reranker_answer_frame(r)->before, fitm_rerank_default_frame.before) == 0;
    fitm_status st;
    switch (req->method) {
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
    case FITM_RERANK_PAPER:
        st = fitm_rr_run_attention(r, req, stop, stop_arg, res, err);
        break;
    case FITM_RERANK_ATTENTION_SORT:
        st = run_attention_sort(r, req, stop, stop_arg, res, err);
        break;
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
        st = run_per_document(r, req, stop, stop_arg, res, err);
        break;
    default:
        st = fitm_err_set(err, FITM_ERR_INVALID, "'method': unknown");
        break;
    }
    r->run_path = FITM_PATH_BATCH;
    return st;
}

/* ---- what /answer shares ----------------------------------------------------------------- */

fitm_status fitm_reranker_use_position(fitm_reranker *r, int32_t position, fitm_err *err)
{
    const fitm_position_method m =
        position < 0 ? r->position_default : (fitm_position_method)position;
    if ((unsigned)m >= FITM_POSITION_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "'position_method': unknown");
    if (m == FITM_POSITION_MOICE && !r->moice)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'position_method' = 'moice' needs a MoICE router sidecar: this "
                            "server runs without one (start fitmd with --moice FILE)");
    if (m == FITM_POSITION_BUCKETS && !r->b->ops->capture_add)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "'position_method' = 'attention_buckets' does not run on the %s "
                            "backend: it cannot sum the passes' captures "
                            "(docs/position-methods.md)", r->b->ops->name);
    if (m != r->position)
        r->kv_n = 0; /* rows computed under another method are not this one's */
    r->position = m;
    /* The reranker's own caches hold the bucket passes only while buckets run (rr_passes
     * grows them to what a run needs). */
    fitm_status st = FITM_OK;
    if (m != FITM_POSITION_BUCKETS && r->kv && fitm_kv_n_passes(r->kv) > 1 &&
        (st = fitm_kv_passes(r->kv, 1, 0, err)) == FITM_OK)
        st = fitm_kv_passes(r->branch, 1, 0, err);
    return st;
}

fitm_position_method fitm_reranker_position(const fitm_reranker *r)
{
    return r->position;
}

const fitm_model *fitm_reranker_model(const fitm_reranker *r) { return r->m; }
const fitm_tokenizer *fitm_reranker_tokenizer(const fitm_reranker *r) { return r->tok; }
int64_t fitm_reranker_n_ctx(const fitm_reranker *r) { return r->n_ctx; }
bool fitm_reranker_is_raw(const fitm_reranker *r) { return r->tmpl == &templates[0]; }

const fitm_rerank_frame *fitm_reranker_answer_frame(const fitm_reranker *r)
{
    return fitm_reranker_is_raw(r) ? &r->answer_frame : &fitm_rerank_default_frame;
}

int32_t fitm_reranker_answer_stop(const fitm_reranker *r, char *const **stop)
{
    *stop = r->answer_stop;
    return fitm_reranker_is_raw(r) && r->answer_stop[0] ? 1 : 0;
}

fitm_status fitm_reranker_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const fitm_rerank_frame *f, const int32_t *order, int32_t **ids,
                                 int64_t *n_ids, fitm_span *spans, fitm_err *err)
{
    fitm_rr_ids v = {0};
    fitm_status st =
        fitm_rr_build_prompt(r, req, f, order, req->n_docs, NULL, &v, spans, NULL, err);
    *ids = v.v;
    *n_ids = v.n;
    return st;
}

int64_t fitm_reranker_cached(const fitm_reranker *r, const int32_t *ids, int64_t n)
{
    int64_t i = 0;
    while (i < n && i < r->kv_n && r->kv_ids[i] == ids[i])
        i++;
    return i;
}

/* Arguments were checked before any forward pass: its INVALID or LIMIT is a bug. */
static fitm_status forward_failed(fitm_status st, fitm_err *err)
{
    if (st != FITM_ERR_INVALID && st != FITM_ERR_LIMIT)
        return st;
    fitm_err_prefix(err, "forward pass");
    return FITM_ERR_INTERNAL;
}

/* ---- cost: the forward tokens of a request, counted before it runs ------------------------ */

/* Most tokens a piece of n bytes encoded on its own can give: every token covers at least one
 * byte (byte fallback, byte-level BPE, an unknown character), plus a space prefix. */
static int64_t piece_bound(size_t n)
{
    return (int64_t)n + 1;
}

fitm_status fitm_rr_prompt_bound(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const fitm_rerank_frame *f, const fitm_rr_queries *q,
                                 const int32_t *starts, int32_t G, int64_t *frame,
                                 int64_t *docs, fitm_err *err)
{
    const int32_t K = req->n_docs;
    fitm_rr_ids ids = {0};
    fitm_status st = fitm_rr_build_prompt(r, req, f, NULL, 0, q, &ids, NULL, NULL, err);
    *frame = ids.n;
    int64_t d = 0;
    size_t longest = 0;
    bool same = true;
    for (int32_t k = 0; st == FITM_OK && k < K; k++) {
        const fitm_rerank_doc *x = &req->docs[k];
        longest = x->title_len > longest ? x->title_len : longest;
        same = same && x->title_len == req->docs[0].title_len &&
               !memcmp(x->title, req->docs[0].title, x->title_len);
        ids.n = 0;
        if ((st = fitm_rr_body(r, req, k, &ids, err)) == FITM_OK)
            d += ids.n;
    }
    ids.n = 0;
    if (st == FITM_OK && (st = fitm_rr_encode(r->tok, &ids, "\n", 1, FITM_TOK_CONTINUATION, -1,
                                              err)) == FITM_OK)
        d += (int64_t)K * ids.n;
    /* The header of the place p of a group: exact when every title is the same (then the
     * order does not change it), else bounded by its bytes with the longest title. */
    char *line = st == FITM_OK ? malloc(longest + 64) : NULL;
    if (st == FITM_OK && !line)
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t g = 0; st == FITM_OK && g < G; g++)
        for (int32_t p = 0; st == FITM_OK && p < starts[g + 1] - starts[g]; p++) {
            int hn = snprintf(line, longest + 64, DOC_HEADER, (int)p + 1,
                              same ? req->docs[0].title : "");
            if (!same) {
                d += piece_bound((size_t)hn + longest);
                continue;
            }
            ids.n = 0;
            if ((st = fitm_rr_encode(r->tok, &ids, line, (size_t)hn, FITM_TOK_CONTINUATION, -1,
                                     err)) == FITM_OK)
                d += ids.n;
        }
    free(line);
    free(ids.v);
    *docs = d;
    return st;
}

/* attention_sort: the first pass's prompt exactly; the later passes' (documents reordered)
 * the same when every title is the same, else bounded. */
static fitm_status attention_sort_cost(const fitm_reranker *r, const fitm_rerank_request *req,
                                       int64_t *tokens, fitm_err *err)
{
    const int32_t K = req->n_docs;
    fitm_rr_ids ids = {0};
    fitm_span *spans = calloc((size_t)K, sizeof *spans);
    fitm_status st = spans ? fitm_rr_build_prompt(r, req, NULL, NULL, K, NULL, &ids, spans, NULL,
                                                  err)
                           : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const int64_t T = ids.n;
    free(ids.v);
    free(spans);
    if (st == FITM_OK && T > r->n_ctx)
        st = prompt_too_long(T, r, req, err);
    int32_t starts[2] = {0, K};
    int64_t frame = 0, docs = 0;
    if (st == FITM_OK)
        st = fitm_rr_prompt_bound(r, req, NULL, NULL, starts, 1, &frame, &docs, err);
    int64_t later = frame + docs > T ? frame + docs : T;
    *tokens = T + (SORT_PASSES - 1) * later;
    return st;
}

/* query_likelihood and relevance: each document's prompt, as run_per_document feeds it. */
static fitm_status per_document_cost(const fitm_reranker *r, const fitm_rerank_request *req,
                                     int64_t *tokens, fitm_err *err)
{
    per_doc pd = {.ql = req->method == FITM_RERANK_QUERY_LIKELIHOOD};
    fitm_rr_ids ids = {0};
    int64_t sum = 0;
    fitm_status st = per_doc_init(r, req, &pd, err);
    for (int32_t k = 0; st == FITM_OK && k < req->n_docs; k++) {
        ids.n = 0;
        st = pd.ql ? ql_prompt(r, req, k, &pd, &ids, err) : relevance_prompt(r, req, k, &ids, err);
        int64_t T = pd.ql ? ids.n - 1 : ids.n;
        if (st == FITM_OK && T > r->n_ctx)
            st = prompt_too_long(T, r, req, err);
        sum += T;
    }
    free(ids.v);
    free(pd.q.v);
    *tokens = sum;
    return st;
}

fitm_status fitm_reranker_cost(const fitm_reranker *r, const fitm_rerank_request *req,
                               bool any_order, int64_t *tokens, fitm_err *err)
{
    *tokens = 0;
    switch (req->method) {
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
    case FITM_RERANK_PAPER:
        return fitm_rr_attention_cost(r, req, any_order, tokens, err);
    case FITM_RERANK_ATTENTION_SORT:
        return attention_sort_cost(r, req, tokens, err);
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
        return per_document_cost(r, req, tokens, err);
    case FITM_RERANK_METHOD_COUNT:
        break;
    }
    return fitm_err_set(err, FITM_ERR_INVALID, "'method': unknown");
}

fitm_status fitm_reranker_prompt_bound(const fitm_reranker *r, const fitm_rerank_request *req,
                                       const fitm_rerank_frame *f, int64_t *tokens,
                                       fitm_err *err)
{
    int32_t starts[2] = {0, req->n_docs};
    int64_t frame = 0, docs = 0;
    fitm_status st = fitm_rr_prompt_bound(r, req, f, NULL, starts, 1, &frame, &docs, err);
    *tokens = frame + docs;
    return st;
}

fitm_status fitm_reranker_kv_create(fitm_reranker *r, int64_t n_rows, fitm_kv **out,
                                    fitm_err *err)
{
    fitm_status st = fitm_kv_create(out, r->b, fitm_model_config_of(r->m), n_rows, err);
    if (st == FITM_OK && r->position == FITM_POSITION_BUCKETS &&
        (st = fitm_kv_passes(*out, FITM_BUCKETS, 0, err)) != FITM_OK) {
        fitm_kv_destroy(*out);
        *out = NULL;
    }
    return st;
}

fitm_status fitm_reranker_copy_rows(fitm_reranker *r, fitm_kv *dst, int64_t n, fitm_err *err)
{
    if (n < 0 || n > r->kv_n || n > fitm_kv_n_rows(dst) || fitm_kv_pos_base(dst) != 0)
        return fitm_err_set(err, FITM_ERR_INTERNAL,
                            "copying %lld prompt rows: the cache holds %lld, the target %lld",
                            (long long)n, (long long)r->kv_n, (long long)fitm_kv_n_rows(dst));
    fitm_status st = fitm_kv_copy(dst, r->kv, n, err); /* every pass (attention_buckets) */
    if (st != FITM_OK) {
        fitm_err_prefix(err, "copying prompt rows");
        return FITM_ERR_INTERNAL;
    }
    if (r->b->ops->status)
        return r->b->ops->status(r->b, err);
    return FITM_OK;
}

bool fitm_reranker_answer_prompt_step(const fitm_reranker *r)
{
    return r->answer_path == FITM_PATH_STEP;
}

int64_t fitm_reranker_batch_tokens(const fitm_reranker *r)
{
    return r->chunk;
}

int64_t fitm_reranker_batch_logits(const fitm_reranker *r)
{
    return r->logit_rows;
}

fitm_status fitm_reranker_run_batch(fitm_reranker *r, const fitm_forward_seq *seqs,
                                    int32_t n_seqs, fitm_err *err)
{
    for (int32_t i = 0; i < n_seqs; i++)
        if (seqs[i].kv == r->kv || seqs[i].kv == r->branch)
            return fitm_err_set(err, FITM_ERR_INTERNAL,
                                "a batched sequence runs on the reranker's own cache");
    return forward_failed(fitm_forward_run_batch(r->fwd, seqs, n_seqs, err), err);
}
