#include "pipeline/rerank.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

static const char *method_names[FITM_RERANK_METHOD_COUNT] = {
    [FITM_RERANK_CALIBRATED] = "calibrated",
    [FITM_RERANK_ATTENTION] = "attention",
    [FITM_RERANK_ATTENTION_SORT] = "attention_sort",
    [FITM_RERANK_QUERY_LIKELIHOOD] = "query_likelihood",
    [FITM_RERANK_RELEVANCE] = "relevance",
};

const char *fitm_rerank_method_name(fitm_rerank_method m)
{
    if ((unsigned)m >= FITM_RERANK_METHOD_COUNT)
        return "unknown";
    return method_names[m];
}

int fitm_rerank_method_parse(const char *s)
{
    for (int i = 0; i < FITM_RERANK_METHOD_COUNT; i++)
        if (!strcmp(s, method_names[i]))
            return i;
    return -1;
}

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
    free(req->layers);
    free(req->dummy);
    memset(req, 0, sizeof *req);
}

void fitm_rerank_result_free(fitm_rerank_result *res)
{
    if (!res)
        return;
    free(res->results);
    free(res->meta.layers);
    free(res->tokens);
    free(res->spans);
    free(res->dummy_tokens);
    free(res->dummy_offsets);
    memset(res, 0, sizeof *res);
}

/* ---- the pipeline ------------------------------------------------------------------------ */

/* Liu et al.'s query-aware prompt (docs/design.md, Method). */
static const char PROMPT_HEAD[] = "Write a high-quality answer for the given question using only "
                                  "the provided search results (some of which might be "
                                  "irrelevant).\n\nQuestion: ";

typedef struct {
    const char *name;
    const char *marker; /* in tokenizer.chat_template, and a token of the vocabulary */
    const char *head;   /* before the user's content (control tokens parsed)          */
    const char *tail;   /* after it, up to where the model's answer starts            */
} chat_template;

static const chat_template templates[] = {
    {"raw", NULL, "", ""},
    {"gemma", "<start_of_turn>", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"},
    {"chatml", "<|im_start|>", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"},
    {"llama3", "<|start_header_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
     "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    {"llama2", "[INST]", "[INST] ", " [/INST]"},
};
#define N_TEMPLATES (sizeof templates / sizeof templates[0])

struct fitm_reranker {
    const fitm_model *m;
    const fitm_tokenizer *tok;
    fitm_backend *b;
    fitm_forward *fwd;
    fitm_kv *kv;     /* the prompt's cache, [0, T)            */
    fitm_kv *branch; /* one reference pass: [s_k, T) on kv    */
    int64_t n_ctx, chunk;
    const chat_template *tmpl;
    int32_t *dummy;  /* default dummy ids (" " + dummy_text)  */
    int64_t n_dummy;
    int32_t L, H, V;
    int64_t logit_rows; /* min(LOGIT_ROWS, chunk)                                  */
    float *logits;   /* (logit_rows, V) host, for query_likelihood and relevance */
};

/* Logit rows per forward call (query_likelihood scores its question in pieces of this). */
#define LOGIT_ROWS 32
/* Passes of attention_sort (Peysakhovich & Lerer sort and rerun; the last pass scores). */
#define SORT_PASSES 3

typedef struct {
    int32_t *v;
    int64_t n, cap;
} ids_vec;

static fitm_status vec_reserve(ids_vec *a, int64_t more, fitm_err *err)
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

/* Tokenizes text[0..len) and appends at most keep ids (keep < 0: all). */
static fitm_status encode_append(const fitm_tokenizer *tok, ids_vec *a, const char *text,
                                 size_t len, uint32_t flags, int64_t keep, fitm_err *err)
{
    int64_t room = (int64_t)len + 8, n = 0;
    fitm_status st = vec_reserve(a, room, err);
    if (st != FITM_OK)
        return st;
    st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, room, &n, err);
    if (st == FITM_ERR_LIMIT && n > room) {
        if ((st = vec_reserve(a, n, err)) != FITM_OK)
            return st;
        st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, n, &n, err);
    }
    if (st != FITM_OK)
        return st;
    a->n += keep >= 0 && n > keep ? keep : n;
    return FITM_OK;
}

static double now_ms(void)
{
    return fitm_clock_ms();
}

static const chat_template *pick_template(const fitm_model *m, const fitm_tokenizer *tok,
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
    free(r->dummy);
    free(r->logits);
    free(r);
}

const char *fitm_reranker_template(const fitm_reranker *r)
{
    return r->tmpl->name;
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
    if (!r->logits) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for logits");
        goto fail;
    }
    if ((st = fitm_forward_create(&r->fwd, m, b, &fp, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->kv, b, c, r->n_ctx, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->branch, b, c, r->n_ctx, err)) != FITM_OK)
        goto fail;
    ids_vec d = {0};
    size_t dl = strlen(p->dummy_text);
    char *text = malloc(dl + 2);
    if (!text) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    text[0] = ' ';
    memcpy(text + 1, p->dummy_text, dl + 1);
    st = encode_append(tok, &d, text, dl + 1, FITM_TOK_CONTINUATION, -1, err);
    free(text);
    r->dummy = d.v;
    r->n_dummy = d.n;
    if (st != FITM_OK)
        goto fail;
    if (r->n_dummy == 0) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "dummy_text gives no tokens");
        goto fail;
    }
    *out = r;
    return FITM_OK;
fail:
    fitm_err_prefix(err, "reranker");
    fitm_reranker_destroy(r);
    return st;
}

/* The prompt of docs/design.md, tokenized piecewise: ids, and the body span of the document at
 * each position. order[p] is the document at position p (NULL: request order). */
static fitm_status build_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                const int32_t *order, ids_vec *ids, fitm_span *spans,
                                fitm_err *err)
{
    const fitm_tokenizer *tok = r->tok;
    bool raw = r->tmpl == &templates[0];
    fitm_status st;
    /* BOS and the template's head (its control tokens parsed; user text never is). */
    if ((st = encode_append(tok, ids, r->tmpl->head, strlen(r->tmpl->head),
                            FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, -1, err)) != FITM_OK)
        return st;
    size_t hl = strlen(PROMPT_HEAD);
    size_t n = hl + req->query_len + 2;
    char *buf = malloc(n + 1);
    if (!buf)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    memcpy(buf, PROMPT_HEAD, hl);
    memcpy(buf + hl, req->query, req->query_len);
    memcpy(buf + hl + req->query_len, "\n\n", 3);
    st = encode_append(tok, ids, buf, n, raw ? 0 : FITM_TOK_CONTINUATION, -1, err);
    free(buf);
    if (st != FITM_OK)
        return st;
    for (int32_t k = 0; k < req->n_docs; k++) {
        const fitm_rerank_doc *d = &req->docs[order ? order[k] : k];
        size_t cap = d->title_len + d->text_len + 64;
        char *line = malloc(cap);
        if (!line)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        int hn = snprintf(line, cap, "Document [%d](Title: %s)", (int)k + 1, d->title);
        st = encode_append(tok, ids, line, (size_t)hn, FITM_TOK_CONTINUATION, -1, err);
        if (st == FITM_OK) {
            line[0] = ' ';
            memcpy(line + 1, d->text, d->text_len);
            spans[k].start = ids->n;
            st = encode_append(tok, ids, line, d->text_len + 1, FITM_TOK_CONTINUATION,
                               req->max_tokens_per_doc, err);
            spans[k].end = ids->n;
        }
        free(line);
        if (st == FITM_OK)
            st = encode_append(tok, ids, "\n", 1, FITM_TOK_CONTINUATION, -1, err);
        if (st != FITM_OK)
            return st;
    }
    n = 11 + req->query_len + 8;
    buf = malloc(n + 1);
    if (!buf)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    memcpy(buf, "\nQuestion: ", 11);
    memcpy(buf + 11, req->query, req->query_len);
    memcpy(buf + 11 + req->query_len, "\nAnswer:", 9);
    st = encode_append(tok, ids, buf, n, FITM_TOK_CONTINUATION, -1, err);
    free(buf);
    if (st == FITM_OK && !raw)
        st = encode_append(tok, ids, r->tmpl->tail, strlen(r->tmpl->tail),
                           FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
    return st;
}

/* Runs ids at positions [pos0, pos0 + n) on kv (a branch of prefix when prefix is non-NULL)
 * in chunks; cap (may be NULL) goes with the last chunk, which holds the last position. */
static fitm_status run_tokens_logits(fitm_reranker *r, fitm_kv *kv, const fitm_kv *prefix,
                                     const int32_t *ids, int64_t n, int64_t pos0,
                                     const fitm_capture *cap, int64_t n_logits,
                                     bool (*stop)(const void *), const void *stop_arg,
                                     fitm_err *err)
{
    for (int64_t off = 0; off < n; off += r->chunk) {
        if (stop && stop(stop_arg))
            return fitm_err_set(err, FITM_ERR_TIMEOUT,
                                "stopped: the request's deadline passed or the server is "
                                "shutting down");
        int64_t len = n - off < r->chunk ? n - off : r->chunk;
        bool last_call = off + len == n;
        /* Always the batch path: a reference pass's last chunk may be one token, and its rows
         * must be computed exactly as the original pass's were. */
        fitm_forward_opts o = {.prefix = prefix, .capture = last_call ? cap : NULL,
                               .n_logits = last_call ? n_logits : 0,
                               .logits = last_call && n_logits ? r->logits : NULL,
                               .path = FITM_PATH_BATCH};
        fitm_status st = fitm_forward_run(r->fwd, kv, ids + off, len, pos0 + off, &o, err);
        if (st == FITM_ERR_INVALID || st == FITM_ERR_LIMIT) {
            fitm_err_prefix(err, "forward pass");
            return FITM_ERR_INTERNAL; /* arguments were checked: this is a bug */
        }
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

/* run_tokens_logits without logits. */
static fitm_status run_tokens(fitm_reranker *r, fitm_kv *kv, const fitm_kv *prefix,
                              const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                              bool (*stop)(const void *), const void *stop_arg, fitm_err *err)
{
    return run_tokens_logits(r, kv, prefix, ids, n, pos0, cap, 0, stop, stop_arg, err);
}

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

/* The layers to average over: the request's (negative = from the end), else every layer
 * that sees the whole context (all layers for models without sliding windows). */
static fitm_status choose_layers(const fitm_reranker *r, const fitm_rerank_request *req,
                                 uint8_t *use, fitm_rerank_meta *meta, fitm_err *err)
{
    memset(use, 0, (size_t)(uint32_t)r->L);
    if (req->layers) {
        for (int32_t i = 0; i < req->n_layers; i++) {
            int32_t l = req->layers[i] < 0 ? r->L + req->layers[i] : req->layers[i];
            if (l < 0 || l >= r->L)
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "'layers[%d]' = %d: the model has %d layers", (int)i,
                                    (int)req->layers[i], (int)r->L);
            use[l] = 1;
        }
    } else {
        bool any_global = false;
        for (int32_t l = 0; l < r->L; l++)
            any_global |= !fitm_model_layer(r->m, l)->local;
        for (int32_t l = 0; l < r->L; l++)
            use[l] = !any_global || !fitm_model_layer(r->m, l)->local;
    }
    meta->layers = calloc((size_t)(uint32_t)r->L, sizeof *meta->layers);
    if (!meta->layers)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            meta->layers[meta->n_layers++] = l;
    return FITM_OK;
}

static fitm_status prompt_too_long(int64_t T, const fitm_reranker *r,
                                   const fitm_rerank_request *req, fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_LIMIT,
                        "the prompt is %lld tokens, over the context of %lld tokens even with "
                        "documents cut to max_tokens_per_doc = %d tokens: send fewer or "
                        "shorter documents",
                        (long long)T, (long long)r->n_ctx, (int)req->max_tokens_per_doc);
}

/* calibrated and attention: one pass over the prompt, and for calibrated one reference pass
 * per document on a branch of the prompt's cache. */
static fitm_status run_attention(fitm_reranker *r, const fitm_rerank_request *req,
                                 bool (*stop)(const void *), const void *stop_arg,
                                 fitm_rerank_result *res, fitm_err *err)
{
    double t0 = now_ms();
    const int32_t K = req->n_docs;
    bool calibrated = req->method == FITM_RERANK_CALIBRATED;
    ids_vec ids = {0}, dummy = {0};
    fitm_span *spans = calloc((size_t)K, sizeof *spans);
    uint8_t *use = malloc((size_t)r->L);
    double *A = calloc((size_t)K * 2, sizeof *A), *A_dum = A ? A + K : NULL;
    float *mass = malloc((size_t)r->L * (size_t)r->H * (size_t)K * sizeof *mass);
    float *mass1 = malloc((size_t)r->L * (size_t)r->H * sizeof *mass1);
    int32_t *ref = NULL;
    fitm_status st = FITM_OK;
    if (!spans || !use || !A || !mass || !mass1) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %d documents", (int)K);
        goto done;
    }
    if ((st = choose_layers(r, req, use, &res->meta, err)) != FITM_OK)
        goto done;
    if ((st = build_prompt(r, req, NULL, &ids, spans, err)) != FITM_OK)
        goto done;
    const int64_t T = ids.n;
    if (T > r->n_ctx) {
        st = prompt_too_long(T, r, req, err);
        goto done;
    }
    /* The dummy: the request's text or the server's, as ids to repeat or cut. */
    const int32_t *dv = r->dummy;
    int64_t dn = r->n_dummy;
    if (calibrated && req->dummy) {
        char *t = malloc(req->dummy_len + 2);
        if (!t) {
            st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
            goto done;
        }
        t[0] = ' ';
        memcpy(t + 1, req->dummy, req->dummy_len + 1);
        st = encode_append(r->tok, &dummy, t, req->dummy_len + 1, FITM_TOK_CONTINUATION, -1, err);
        free(t);
        if (st != FITM_OK)
            goto done;
        dv = dummy.v;
        dn = dummy.n;
    }
    res->meta.tokenize_ms = now_ms() - t0;

    double tf = now_ms();
    const int64_t last = T - 1;
    fitm_capture cap = {.rows = &last, .n_rows = 1, .spans = spans, .n_spans = K,
                        .span_mass = mass};
    if ((st = fitm_kv_rebase(r->kv, 0, err)) != FITM_OK ||
        (st = run_tokens(r, r->kv, NULL, ids.v, T, 0, &cap, stop, stop_arg, err)) != FITM_OK)
        goto done;
    int64_t forward = T;
    for (int32_t k = 0; k < K; k++)
        doc_attention(r, mass, K, k, spans[k].start, spans[k].end - spans[k].start, use, last,
                      &A[k]);

    if (calibrated) {
        int64_t total_ref = 0;
        for (int32_t k = 0; k < K; k++)
            total_ref += spans[k].end - spans[k].start;
        ref = malloc((size_t)(T > 0 ? T : 1) * sizeof *ref);
        if (req->return_tokens) {
            res->dummy_tokens = malloc((size_t)(total_ref > 0 ? total_ref : 1) * sizeof(int32_t));
            res->dummy_offsets = calloc((size_t)K, sizeof(int64_t));
        }
        if (!ref || (req->return_tokens && (!res->dummy_tokens || !res->dummy_offsets))) {
            st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
            goto done;
        }
        int64_t doff = 0;
        for (int32_t k = 0; k < K; k++) {
            /* Reference pass k: the dummy, length-matched, in place of document k's body;
             * [0, s_k) is the original pass's cache, read through the branch. */
            int64_t s = spans[k].start, e = spans[k].end, N = e - s;
            for (int64_t i = 0; i < N; i++)
                ref[i] = dv[i % dn];
            memcpy(ref + N, ids.v + e, (size_t)(T - e) * sizeof *ref);
            if (res->dummy_tokens) {
                res->dummy_offsets[k] = doff;
                memcpy(res->dummy_tokens + doff, ref, (size_t)N * sizeof *ref);
                doff += N;
            }
            fitm_span own = {.start = s, .end = e};
            fitm_capture c1 = {.rows = &last, .n_rows = 1, .spans = &own, .n_spans = 1,
                               .span_mass = mass1};
            if (req->prefix_reuse) {
                if ((st = fitm_kv_rebase(r->branch, s, err)) != FITM_OK ||
                    (st = run_tokens(r, r->branch, s > 0 ? r->kv : NULL, ref, T - s, s, &c1,
                                     stop, stop_arg, err)) != FITM_OK)
                    goto done;
                forward += T - s;
            } else {
                /* The whole reference prompt from position 0 (for benchmarks and checks). */
                memmove(ref + s, ref, (size_t)(T - s) * sizeof *ref);
                memcpy(ref, ids.v, (size_t)s * sizeof *ref);
                if ((st = fitm_kv_rebase(r->branch, 0, err)) != FITM_OK ||
                    (st = run_tokens(r, r->branch, NULL, ref, T, 0, &c1, stop, stop_arg, err)) !=
                        FITM_OK)
                    goto done;
                forward += T;
            }
            doc_attention(r, mass1, 1, 0, s, N, use, last, &A_dum[k]);
        }
    }
    res->meta.forward_ms = now_ms() - tf;

    res->results = calloc((size_t)K, sizeof *res->results);
    if (!res->results) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    res->n_results = K;
    double mx = -INFINITY, z = 0;
    for (int32_t k = 0; k < K; k++) {
        double rel = (A[k] - A_dum[k]) / req->temperature;
        if (rel > mx)
            mx = rel;
    }
    for (int32_t k = 0; k < K; k++)
        z += exp((A[k] - A_dum[k]) / req->temperature - mx);
    for (int32_t k = 0; k < K; k++) {
        fitm_rerank_doc_result *o = &res->results[k];
        o->index = k;
        o->position = k;
        o->attention = A[k];
        o->dummy_attention = calibrated ? A_dum[k] : 0.0;
        o->calibrated_attention = calibrated ? A[k] - A_dum[k] : 0.0;
        o->relevance_score =
            calibrated ? exp((A[k] - A_dum[k]) / req->temperature - mx) / z : A[k];
    }
    qsort(res->results, (size_t)K, sizeof *res->results, cmp_results);
    res->usage.prompt_tokens = T;
    res->usage.forward_tokens = forward;
    res->usage.total_tokens = T;
    if (req->return_tokens) {
        res->tokens = ids.v;
        res->n_tokens = T;
        res->spans = spans;
        ids.v = NULL;
        spans = NULL;
    }
done:
    free(ids.v);
    free(dummy.v);
    free(spans);
    free(use);
    free(A);
    free(mass);
    free(mass1);
    free(ref);
    return st;
}

/* attention_sort: score every document by its attention mass (sum over its tokens), move the
 * most attended documents last (next to the question), and rerun; the last pass scores. */
static fitm_status run_attention_sort(fitm_reranker *r, const fitm_rerank_request *req,
                                      bool (*stop)(const void *), const void *stop_arg,
                                      fitm_rerank_result *res, fitm_err *err)
{
    double t0 = now_ms(), tok_ms = 0;
    const int32_t K = req->n_docs;
    ids_vec ids = {0};
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
    for (int32_t k = 0; k < K; k++)
        order[k] = k;
    int64_t forward = 0, T = 0;
    for (int pass = 0; pass < SORT_PASSES; pass++) {
        double tt = now_ms();
        ids.n = 0;
        if ((st = build_prompt(r, req, order, &ids, spans, err)) != FITM_OK)
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
        /* Stable insertion sort of positions by mass, ascending: the most attended go last. */
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
    }
    qsort(res->results, (size_t)K, sizeof *res->results, cmp_results);
    res->usage = (fitm_rerank_usage){.prompt_tokens = T, .forward_tokens = forward,
                                     .total_tokens = T};
    res->meta.tokenize_ms = tok_ms;
    res->meta.forward_ms = now_ms() - t0 - tok_ms;
done:
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
        ids_vec v = {0};
        if (encode_append(tok, &v, words[w], strlen(words[w]), FITM_TOK_CONTINUATION, -1, NULL) ==
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
    static const char RESTRICT[] = " We can get the answer to this question in the given documents.";
    static const char ASK[] = "\n\nIs the document relevant to the question? Answer Yes or No.";
    static const char *const YES[4] = {" Yes", "Yes", " yes", "yes"};
    static const char *const NO[4] = {" No", "No", " no", "no"};
    double t0 = now_ms(), tok_ms = 0;
    const int32_t K = req->n_docs;
    const bool ql = req->method == FITM_RERANK_QUERY_LIKELIHOOD;
    const bool raw = r->tmpl == &templates[0];
    ids_vec ids = {0}, q = {0};
    int64_t forward = 0, T_max = 0;
    int32_t yes[4], no[4];
    int n_yes = 0, n_no = 0;
    fitm_status st = FITM_OK;
    size_t qn = req->query_len + sizeof RESTRICT + sizeof ASK + 32;
    char *buf = malloc(qn);
    res->results = calloc((size_t)K, sizeof *res->results);
    if (!buf || !res->results) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    res->n_results = K;
    if (ql) {
        int n = snprintf(buf, qn, " %s%s", req->query, RESTRICT);
        if ((st = encode_append(r->tok, &q, buf, (size_t)n, FITM_TOK_CONTINUATION, -1, err)))
            goto done;
    } else {
        n_yes = answer_ids(r->tok, YES, yes);
        n_no = answer_ids(r->tok, NO, no);
        if (!n_yes || !n_no) {
            st = fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                              "'method' = 'relevance': the vocabulary cannot spell Yes/No");
            goto done;
        }
    }
    for (int32_t k = 0; k < K; k++) {
        const fitm_rerank_doc *d = &req->docs[k];
        double tt = now_ms();
        ids.n = 0;
        uint32_t first = FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL;
        if (ql) {
            st = encode_append(r->tok, &ids, "", 0, FITM_TOK_ADD_BOS, -1, err);
            if (!st)
                st = encode_append(r->tok, &ids, d->text, d->text_len, 0, req->max_tokens_per_doc,
                                   err);
            if (!st)
                st = encode_append(r->tok, &ids, "\n\nQuestion:", 11, FITM_TOK_CONTINUATION, -1,
                                   err);
        } else {
            st = encode_append(r->tok, &ids, r->tmpl->head, strlen(r->tmpl->head), first, -1, err);
            if (!st)
                st = encode_append(r->tok, &ids, "Document:", 9, raw ? 0 : FITM_TOK_CONTINUATION,
                                   -1, err);
            if (!st) {
                char *t = malloc(d->text_len + 2);
                if (!t) {
                    st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
                    goto done;
                }
                t[0] = ' ';
                memcpy(t + 1, d->text, d->text_len + 1);
                st = encode_append(r->tok, &ids, t, d->text_len + 1, FITM_TOK_CONTINUATION,
                                   req->max_tokens_per_doc, err);
                free(t);
            }
            if (!st) {
                int n = snprintf(buf, qn, "\n\nQuestion: %s%s%s", req->query, ASK,
                                 raw ? "\nAnswer:" : "");
                st = encode_append(r->tok, &ids, buf, (size_t)n, FITM_TOK_CONTINUATION, -1, err);
            }
            if (!st && !raw)
                st = encode_append(r->tok, &ids, r->tmpl->tail, strlen(r->tmpl->tail),
                                   FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
        }
        if (st != FITM_OK)
            goto done;
        int64_t n_pre = ids.n;
        if (ql) { /* the scored question follows the document */
            if ((st = vec_reserve(&ids, q.n, err)) != FITM_OK)
                goto done;
            memcpy(ids.v + ids.n, q.v, (size_t)q.n * sizeof *q.v);
            ids.n += q.n;
        }
        tok_ms += now_ms() - tt;
        int64_t T = ql ? ids.n - 1 : ids.n; /* the question's last token is never fed */
        if (T > r->n_ctx) {
            st = prompt_too_long(T, r, req, err);
            goto done;
        }
        T_max = T > T_max ? T : T_max;
        double score = 0;
        if ((st = fitm_kv_rebase(r->kv, 0, err)) != FITM_OK)
            goto done;
        if (!ql) {
            if ((st = run_tokens_logits(r, r->kv, NULL, ids.v, T, 0, NULL, 1, stop, stop_arg,
                                        err)) != FITM_OK)
                goto done;
            double py = 0, pn = 0;
            for (int i = 0; i < n_yes; i++)
                py += exp(log_prob(r->logits, r->V, yes[i]));
            for (int i = 0; i < n_no; i++)
                pn += exp(log_prob(r->logits, r->V, no[i]));
            score = py + pn > 0 ? py / (py + pn) : 0.5;
        } else {
            /* Rows n_pre - 1 .. T - 1 predict the question's tokens, logit_rows at a time. */
            int64_t head = n_pre - 1;
            if (head > 0 && (st = run_tokens(r, r->kv, NULL, ids.v, head, 0, NULL, stop, stop_arg,
                                             err)) != FITM_OK)
                goto done;
            double sum = 0;
            for (int64_t p = head; p < T; p += r->logit_rows) {
                int64_t n = T - p < r->logit_rows ? T - p : r->logit_rows;
                if ((st = run_tokens_logits(r, r->kv, NULL, ids.v + p, n, p, NULL, n, stop,
                                            stop_arg, err)) != FITM_OK)
                    goto done;
                for (int64_t i = 0; i < n; i++)
                    sum += log_prob(r->logits + i * r->V, r->V, ids.v[p + i + 1]);
            }
            score = exp(sum / (double)q.n);
        }
        forward += T;
        res->results[k] = (fitm_rerank_doc_result){.index = k, .position = k,
                                                   .relevance_score = score};
    }
    qsort(res->results, (size_t)K, sizeof *res->results, cmp_results);
    res->usage = (fitm_rerank_usage){.prompt_tokens = T_max, .forward_tokens = forward,
                                     .total_tokens = T_max};
    res->meta.tokenize_ms = tok_ms;
    res->meta.forward_ms = now_ms() - t0 - tok_ms;
done:
    free(buf);
    free(ids.v);
    free(q.v);
    return st;
}

fitm_status fitm_reranker_run(fitm_reranker *r, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_err *err)
{
    memset(res, 0, sizeof *res);
    res->meta.method = req->method;
    res->meta.temperature = req->temperature;
    switch (req->method) {
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
        return run_attention(r, req, stop, stop_arg, res, err);
    case FITM_RERANK_ATTENTION_SORT:
        return run_attention_sort(r, req, stop, stop_arg, res, err);
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
        return run_per_document(r, req, stop, stop_arg, res, err);
    case FITM_RERANK_METHOD_COUNT:
        break;
    }
    return fitm_err_set(err, FITM_ERR_INVALID, "'method': unknown");
}

void fitm_reranker_parts_of(fitm_reranker *r, fitm_reranker_parts *out)
{
    *out = (fitm_reranker_parts){.m = r->m, .tok = r->tok, .fwd = r->fwd, .kv = r->kv,
                                 .n_ctx = r->n_ctx, .chunk = r->chunk};
}

fitm_status fitm_reranker_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const int32_t *order, int32_t **ids, int64_t *n_ids,
                                 fitm_span *spans, fitm_err *err)
{
    ids_vec v = {0};
    fitm_status st = build_prompt(r, req, order, &v, spans, err);
    *ids = v.v;
    *n_ids = v.n;
    return st;
}
