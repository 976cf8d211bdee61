/* rerank: the request and result of POST /rerank as plain C structs (filled and written by
 * api.c, which is the only JSON user), and the pipeline that turns one into the other on the
 * engine's thread (rerank.c: the prompt, spans, reference passes and scores of
 * docs/design.md, Method).
 *
 * Ownership: a request owns every string and array it points to; fitm_rerank_request_free
 * releases them. A result likewise owns its arrays; fitm_rerank_result_free releases them.
 *
 * Legend: T prompt tokens, K documents, L layers. */
#ifndef FITM_RERANK_H
#define FITM_RERANK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "compute/ops.h"

typedef enum {
    FITM_RERANK_CALIBRATED = 0, /* alpha = softmax((A - A_dum) / t)  (default)            */
    FITM_RERANK_ATTENTION,      /* uncalibrated A                                          */
    FITM_RERANK_ATTENTION_SORT, /* Peysakhovich & Lerer: attention mass, sort, repeat      */
    FITM_RERANK_QUERY_LIKELIHOOD, /* LongLLMLingua r_k                                     */
    FITM_RERANK_RELEVANCE,      /* yes/no prompting                                        */
    FITM_RERANK_METHOD_COUNT
} fitm_rerank_method;

/* The method's wire name ("calibrated", ...); "unknown" out of range. */
const char *fitm_rerank_method_name(fitm_rerank_method m);

/* Parses a wire name; -1 when unknown. */
int fitm_rerank_method_parse(const char *s);

/* Longest `layers` list a request may carry. */
#define FITM_RERANK_MAX_LAYERS 512

typedef struct {
    char *text;  /* owned, NUL-terminated, valid UTF-8 */
    size_t text_len;
    char *title; /* owned, "" when none                */
    size_t title_len;
} fitm_rerank_doc;

typedef struct {
    char *query; /* owned, non-empty, valid UTF-8 */
    size_t query_len;
    fitm_rerank_doc *docs; /* (n_docs) owned */
    int32_t n_docs;        /* K >= 1          */
    int32_t top_n;         /* in [1, K]; K when the request has none                    */
    bool return_documents;
    int32_t max_tokens_per_doc; /* 0: the server's limit; else in [1, server limit]     */
    char *model;                /* owned; NULL when absent (already checked by api)     */
    fitm_rerank_method method;
    double temperature;         /* > 0; 0 in the struct means the server default        */
    int32_t *layers;            /* (n_layers) owned; NULL: the method's default layers  */
    int32_t n_layers;
    char *dummy;                /* owned; NULL: the server's dummy text                 */
    size_t dummy_len;
    bool return_tokens;
    bool prefix_reuse;          /* calibrated: reference passes reuse the prompt's cache   */
    bool tei;                   /* asked in TEI's shape (`texts`): answer in TEI's shape */
} fitm_rerank_request;

/* Releases what req owns and zeroes it. NULL is a no-op. */
void fitm_rerank_request_free(fitm_rerank_request *req);

typedef struct {
    int32_t index;               /* the document's index in the request                   */
    double relevance_score;      /* the method's score; for calibrated: alpha             */
    int32_t position;            /* 0-based place of the document in the scored prompt     */
    double calibrated_attention; /* rel = A - A_dum (0 for methods without reference passes) */
    double attention;            /* A                                                      */
    double dummy_attention;      /* A_dum (0 without reference passes)                     */
} fitm_rerank_doc_result;

typedef struct {
    int64_t prompt_tokens;  /* T of the scored prompt                                    */
    int64_t forward_tokens; /* tokens actually computed over all passes                  */
    int64_t total_tokens;   /* prompt_tokens + generated (none for rerank)               */
} fitm_rerank_usage;

typedef struct {
    fitm_rerank_method method;
    double queue_ms, tokenize_ms, forward_ms, total_ms;
    int32_t *layers; /* (n_layers) owned: the layers scores were averaged over */
    int32_t n_layers;
    double temperature;
} fitm_rerank_meta;

typedef struct {
    fitm_rerank_doc_result *results; /* (n_results) owned, sorted by relevance_score desc */
    int32_t n_results;               /* K (the writer cuts to top_n)                     */
    fitm_rerank_usage usage;
    fitm_rerank_meta meta;
    /* With return_tokens: the prompt's ids, each document's span, and for each reference
     * pass the ids that replaced [s_k, e_k) (dummy_tokens + dummy_offsets[k], of length
     * spans[k].end - spans[k].start). NULL/0 otherwise. */
    int32_t *tokens;
    int64_t n_tokens;
    fitm_span *spans; /* (n_results) */
    int32_t *dummy_tokens;
    int64_t *dummy_offsets; /* (n_results) */
} fitm_rerank_result;

/* Releases what res owns and zeroes it. NULL is a no-op. */
void fitm_rerank_result_free(fitm_rerank_result *res);

/* ---- the pipeline ------------------------------------------------------------------------ */

typedef struct fitm_model fitm_model;
typedef struct fitm_tokenizer fitm_tokenizer;
typedef struct fitm_backend fitm_backend;
typedef struct fitm_reranker fitm_reranker;

typedef struct {
    int64_t n_ctx;             /* most prompt tokens (KV rows); <= the model's context      */
    int64_t chunk;             /* tokens per forward call (prefill batch)                   */
    const char *dummy_text;    /* the default dummy document text                           */
    const char *chat_template; /* auto | raw | chatml | gemma | llama2 | llama3             */
} fitm_reranker_params;

/* Prepares a reranker: the forward scratch and two KV caches of n_ctx rows (the prompt's and
 * one reference branch), allocated once. Borrows m, tok and b, which must outlive it. */
fitm_status fitm_reranker_create(fitm_reranker **out, const fitm_model *m,
                                 const fitm_tokenizer *tok, fitm_backend *b,
                                 const fitm_reranker_params *p, fitm_err *err);

/* NULL is a no-op. */
void fitm_reranker_destroy(fitm_reranker *r);

/* The chat template in use after create ("raw", "gemma", ...). */
const char *fitm_reranker_template(const fitm_reranker *r);

/* Scores req's documents (docs/design.md) into *res (the caller frees it, also after a failure).
 * stop(stop_arg) is polled between forward calls; when it returns true the run ends with
 * FITM_ERR_TIMEOUT. Errors: FITM_ERR_LIMIT when the prompt does not fit n_ctx even after
 * per-document truncation, FITM_ERR_INVALID for layers the model does not have,
 * FITM_ERR_UNSUPPORTED for methods not implemented yet, FITM_ERR_BACKEND from the backend.
 * Not thread-safe: one thread runs a reranker at a time. */
fitm_status fitm_reranker_run(fitm_reranker *r, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_err *err);

/* ---- what /answer shares (answer.c) ----------------------------------------------------- */

/* The reranker's model, tokenizer, forward scratch and prompt cache, for a pipeline that runs
 * on the same thread between reranker runs (it may overwrite the cache freely). Borrowed.
 * Promise: after a successful fitm_reranker_run with method calibrated or attention, kv holds
 * exactly the scored prompt's rows [0, T) (what fitm_reranker_prompt builds for the same
 * request), computed on the batch path for every row but possibly the last. */
typedef struct {
    const fitm_model *m;
    const fitm_tokenizer *tok;
    struct fitm_forward *fwd;
    struct fitm_kv *kv;
    int64_t n_ctx; /* KV rows                       */
    int64_t chunk; /* tokens per forward call, >= 1 */
} fitm_reranker_parts;

void fitm_reranker_parts_of(fitm_reranker *r, fitm_reranker_parts *out);

/* The prompt (docs/design.md) for req exactly as fitm_reranker_run builds it: *ids (malloc'd, the
 * caller frees it, also after a failure) of *n_ids tokens, and spans[p] (K entries, caller's)
 * the body of the document at position p. order[p] is the document at position p (NULL:
 * request order). */
fitm_status fitm_reranker_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const int32_t *order, int32_t **ids, int64_t *n_ids,
                                 fitm_span *spans, fitm_err *err);

#endif
