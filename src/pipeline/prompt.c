/* prompt: token id lists and the prompts of the rerank methods: the chat templates, the
 * query-aware prompt built piecewise so that every document's body and the trailing question
 * have exact spans (docs/design.md, Method), and bounds of a prompt's length for the admission
 * cost. Reads the session, never writes it. */
#include "pipeline/session_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tokenizer/tokenizer.h"

fitm_status fitm_ids_reserve(fitm_ids *a, int64_t more, fitm_err *err)
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

fitm_status fitm_prompt_encode(const fitm_tokenizer *tok, fitm_ids *a, const char *text, size_t len,
                               uint32_t flags, int64_t keep, fitm_err *err)
{
    int64_t room = (int64_t)len + 8, n = 0;
    fitm_status st = fitm_ids_reserve(a, room, err);
    if (st != FITM_OK)
        return st;
    st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, room, &n, err);
    if (st == FITM_ERR_LIMIT && n > room) {
        if ((st = fitm_ids_reserve(a, n, err)) != FITM_OK)
            return st;
        st = fitm_tok_encode(tok, text, len, flags, a->v + a->n, n, &n, err);
    }
    if (st != FITM_OK)
        return st;
    a->n += keep >= 0 && n > keep ? keep : n;
    return FITM_OK;
}

static const fitm_chat_template templates[] = {
    {"raw", NULL, "", ""},
    {"gemma", "<start_of_turn>", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"},
    {"chatml", "<|im_start|>", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"},
    {"llama3", "<|start_header_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
     "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    {"llama2", "[INST]", "[INST] ", " [/INST]"},
};
#define N_TEMPLATES (sizeof templates / sizeof templates[0])

const fitm_chat_template *fitm_prompt_template(const fitm_model *m, const fitm_tokenizer *tok,
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

bool fitm_prompt_template_raw(const fitm_chat_template *t)
{
    return t == &templates[0];
}

int64_t fitm_prompt_doc_keep(const fitm_rerank_request *req)
{
    return req->no_truncate ? -1 : req->max_tokens_per_doc;
}

fitm_status fitm_prompt_doc_fits(const fitm_rerank_request *req, int32_t k, int64_t n,
                                 fitm_err *err)
{
    if (!req->no_truncate || req->max_tokens_per_doc <= 0 || n <= req->max_tokens_per_doc)
        return FITM_OK;
    return fitm_err_set(err, FITM_ERR_LIMIT,
                        "'%s[%d]' has %lld tokens, more than max_tokens_per_doc = %d (send "
                        "truncate: true to cut it)",
                        req->tei ? "texts" : "documents", (int)k, (long long)n,
                        (int)req->max_tokens_per_doc);
}

fitm_status fitm_prompt_body(const fitm_session *r, const fitm_rerank_request *req, int32_t k,
                             fitm_ids *a, fitm_err *err)
{
    const fitm_rerank_doc *d = &req->docs[k];
    char *line = malloc(d->text_len + 2);
    if (!line)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    line[0] = ' ';
    memcpy(line + 1, d->text, d->text_len);
    const int64_t before = a->n;
    fitm_status st = fitm_prompt_encode(r->tok, a, line, d->text_len + 1, FITM_TOK_CONTINUATION,
                                        fitm_prompt_doc_keep(req), err);
    free(line);
    if (st == FITM_OK)
        st = fitm_prompt_doc_fits(req, k, a->n - before, err);
    return st;
}

/* Appends text[0..len) with every {question} replaced by q (tokenized on its own, so its
 * span is exact; a space before the marker goes with the question). *span: the last
 * occurrence's span. first: the flags of the first piece. */
static fitm_status encode_framed(const fitm_session *r, fitm_ids *ids, const char *text,
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
            st = fitm_prompt_encode(r->tok, ids, text, n - space, flags, -1, err);
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
        st = fitm_prompt_encode(r->tok, ids, piece + !space, q_len + space, flags, -1, err);
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
static fitm_status encode_documents(const fitm_session *r, const fitm_rerank_request *req,
                                    const int32_t *order, int32_t n, fitm_ids *ids,
                                    fitm_span *spans, fitm_err *err)
{
    for (int32_t k = 0; k < n; k++) {
        const fitm_rerank_doc *d = &req->docs[order ? order[k] : k];
        size_t cap = d->title_len + 64;
        char *line = malloc(cap);
        if (!line)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        int hn = snprintf(line, cap, DOC_HEADER, (int)k + 1, d->title);
        fitm_status st =
            fitm_prompt_encode(r->tok, ids, line, (size_t)hn, FITM_TOK_CONTINUATION, -1, err);
        free(line);
        spans[k].start = ids->n;
        if (st == FITM_OK)
            st = fitm_prompt_body(r, req, order ? order[k] : k, ids, err);
        spans[k].end = ids->n;
        if (st == FITM_OK)
            st = fitm_prompt_encode(r->tok, ids, "\n", 1, FITM_TOK_CONTINUATION, -1, err);
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

fitm_status fitm_prompt_build(const fitm_session *r, const fitm_rerank_request *req,
                              const fitm_rerank_frame *f, const int32_t *order, int32_t n,
                              const fitm_prompt_queries *q, fitm_ids *ids, fitm_span *spans,
                              fitm_span *question, fitm_err *err)
{
    f = f ? f : &fitm_rerank_default_frame;
    fitm_prompt_queries own = {req->query, req->query, req->query_len, req->query_len};
    q = q ? q : &own;
    bool raw = r->tmpl == &templates[0];
    fitm_span unused;
    fitm_status st;
    /* BOS and the template's head (its control tokens parsed; user text never is). */
    if ((st = fitm_prompt_encode(r->tok, ids, r->tmpl->head, strlen(r->tmpl->head),
                                 FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, -1, err)) != FITM_OK ||
        (st = encode_framed(r, ids, f->before, q->head, q->head_len,
                            raw ? 0 : FITM_TOK_CONTINUATION, &unused, err)) != FITM_OK ||
        (st = encode_documents(r, req, order, n, ids, spans, err)) != FITM_OK ||
        (st = encode_framed(r, ids, f->after, q->tail, q->tail_len, FITM_TOK_CONTINUATION,
                            question ? question : &unused, err)) != FITM_OK)
        return st;
    if (!raw)
        st = fitm_prompt_encode(r->tok, ids, r->tmpl->tail, strlen(r->tmpl->tail),
                                FITM_TOK_CONTINUATION | FITM_TOK_PARSE_SPECIAL, -1, err);
    return st;
}

fitm_status fitm_prompt_too_long(int64_t T, const fitm_session *r, const fitm_rerank_request *req,
                                 fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_CONTEXT,
                        "the prompt is %lld tokens, over the context of %lld tokens even with "
                        "documents cut to max_tokens_per_doc = %d tokens: send fewer or "
                        "shorter documents",
                        (long long)T, (long long)r->n_ctx, (int)req->max_tokens_per_doc);
}

/* Most tokens a piece of n bytes encoded on its own can give: every token covers at least one
 * byte (byte fallback, byte-level BPE, an unknown character), plus a space prefix. */
static int64_t piece_bound(size_t n)
{
    return (int64_t)n + 1;
}

fitm_status fitm_prompt_bound(const fitm_session *r, const fitm_rerank_request *req,
                              const fitm_rerank_frame *f, const fitm_prompt_queries *q,
                              const int32_t *starts, int32_t G, int64_t *frame, int64_t *docs,
                              fitm_err *err)
{
    const int32_t K = req->n_docs;
    fitm_ids ids = {0};
    fitm_status st = fitm_prompt_build(r, req, f, NULL, 0, q, &ids, NULL, NULL, err);
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
        if ((st = fitm_prompt_body(r, req, k, &ids, err)) == FITM_OK)
            d += ids.n;
    }
    ids.n = 0;
    if (st == FITM_OK &&
        (st = fitm_prompt_encode(r->tok, &ids, "\n", 1, FITM_TOK_CONTINUATION, -1, err)) == FITM_OK)
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
            if ((st = fitm_prompt_encode(r->tok, &ids, line, (size_t)hn, FITM_TOK_CONTINUATION, -1,
                                         err)) == FITM_OK)
                d += ids.n;
        }
    free(line);
    free(ids.v);
    *docs = d;
    return st;
}

fitm_status fitm_rerank_prompt(const fitm_session *r, const fitm_rerank_request *req,
                               const fitm_rerank_frame *f, const int32_t *order, int32_t **ids,
                               int64_t *n_ids, fitm_span *spans, fitm_err *err)
{
    fitm_ids v = {0};
    fitm_status st = fitm_prompt_build(r, req, f, order, req->n_docs, NULL, &v, spans, NULL, err);
    *ids = v.v;
    *n_ids = v.n;
    return st;
}

fitm_status fitm_rerank_prompt_bound(const fitm_session *r, const fitm_rerank_request *req,
                                     const fitm_rerank_frame *f, int64_t *tokens, fitm_err *err)
{
    int32_t starts[2] = {0, req->n_docs};
    int64_t frame = 0, docs = 0;
    fitm_status st = fitm_prompt_bound(r, req, f, NULL, starts, 1, &frame, &docs, err);
    *tokens = frame + docs;
    return st;
}
