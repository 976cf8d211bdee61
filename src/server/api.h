/* api: JSON <-> plain C structs for fitmd's routes, and the one mapping of errors to HTTP.
 * The only module that uses cJSON. Everything here is pure (no I/O, no globals): every
 * function may be called from any thread.
 *
 * Strings returned as `char *` are malloc'd, NUL-terminated JSON text the caller frees. */
#ifndef FITM_API_H
#define FITM_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "pipeline/answer.h"
#include "pipeline/rerank.h"

/* Protocol-level refusals that have no fitm_status of their own. FITM_API_COND_NONE means
 * "classify by the status". */
typedef enum {
    FITM_API_COND_NONE = 0,
    FITM_API_COND_UNAUTHORIZED,   /* missing or wrong bearer key         */
    FITM_API_COND_METHOD,         /* method not allowed on this route    */
    FITM_API_COND_BODY_TOO_LARGE, /* body over max_body_bytes            */
    FITM_API_COND_MEDIA_TYPE,     /* POST body that is not JSON          */
    FITM_API_COND_FRAMING,        /* ambiguous HTTP framing (400, closes) */
    FITM_API_COND_CODING,         /* a transfer coding other than chunked (501) */
    FITM_API_COND_SLOW,           /* headers or body not received in time (408) */
    FITM_API_COND_TARGET_TOO_LONG, /* request target over the limit (414)          */
    FITM_API_COND_HEAD_TOO_LARGE,  /* request head over the limit (431)            */
    FITM_API_COND_VERSION,         /* an HTTP version other than 1.0/1.1 (505)     */
    FITM_API_COND_EXPECTATION,     /* an Expect other than 100-continue (417)       */
} fitm_api_cond;

typedef struct {
    int http;         /* HTTP status code                                    */
    const char *type; /* error.type, e.g. "invalid_request_error"            */
    const char *code; /* error.code, e.g. "invalid_json", "queue_full"       */
    bool retry;       /* send Retry-After (503s)                             */
} fitm_api_error_class;

/* THE mapping from an error to HTTP: every error response fitmd sends goes through it.
 * A non-NONE cond wins over s. s = FITM_OK with cond NONE gives 500 (a caller bug). */
fitm_api_error_class fitm_api_classify(fitm_status s, fitm_api_cond cond);

/* {"error":{"message":message,"type":...,"code":...}} for the class. message may be NULL
 * ("" then). Returns NULL only when out of memory. */
char *fitm_api_error_json(const fitm_api_error_class *c, const char *message);

/* The server's limits a request is checked against. */
typedef struct {
    int32_t max_documents;
    int32_t max_tokens_per_doc;
    const char *model_name; /* the served model's name                           */
    bool strict_model;      /* a request's `model`, when given, must equal model_name */
    int32_t max_answer_tokens; /* most max_tokens an /answer or OpenAI request may ask for */
    int64_t max_json_members;  /* most object members and array elements in a body; 0: any */
    int32_t default_method;    /* a fitm_rerank_method: /rerank's when a request names none */
} fitm_api_limits;

/* Parses and validates a /rerank body (Cohere/Jina shape, or TEI's with `texts`) into *out,
 * which the caller releases with fitm_rerank_request_free (also after a failure). Errors name
 * the field: FITM_ERR_FORMAT for invalid JSON; FITM_ERR_INVALID for wrong types, missing or
 * empty values, non-UTF-8 text, unknown methods, out-of-range numbers; FITM_ERR_LIMIT for
 * more documents than lim->max_documents; FITM_ERR_NOT_FOUND, with lim->strict_model, for a
 * `model` this server does not serve (else any name is answered by the served model). top_n
 * above the document count is lowered to it. Unknown fields are ignored (clients send their own extras). A per-request
 * max_tokens_per_doc above the server's limit is lowered to it. */
fitm_status fitm_api_parse_rerank(const char *body, size_t len, const fitm_api_limits *lim,
                                  fitm_rerank_request *out, fitm_err *err);

/* The /rerank response for req and res: {id, model, results[:top_n], usage, meta} (and
 * `tokens` with return_tokens), or TEI's array [{index, score, text?}] when req->tei. */
char *fitm_api_write_rerank(const fitm_rerank_request *req, const fitm_rerank_result *res,
                            const char *id, const char *model);

/* GET /v1/models: {"object":"list","data":[{"id":model,"object":"model","created":...,
 * "owned_by":"fitm", ...}]}; with one, GET /v1/models/{id}: that model object alone. */
char *fitm_api_write_models(const char *model, int64_t created_s, int64_t n_ctx,
                            const char *arch, bool one);

/* GET /health: {"status":status} plus a message when non-NULL. */
char *fitm_api_write_health(const char *status, const char *message);

/* Whether s[0..n) is valid UTF-8 (no overlongs, surrogates or code points past U+10FFFF). */
bool fitm_api_utf8_valid(const char *s, size_t n);

/* Parses and validates a /answer body into *out (release with fitm_answer_request_free, also
 * after a failure): /rerank's query, documents, max_tokens_per_doc, model and return_tokens,
 * plus max_tokens (lowered to lim->max_answer_tokens), stop, temperature, top_p, top_k,
 * min_p, seed, calibrate, calibration {temperature, layers, dummy}, reorder,
 * intervention_layers, stream.
 * Errors as fitm_api_parse_rerank, naming the field. */
fitm_status fitm_api_parse_answer(const char *body, size_t len, const fitm_api_limits *lim,
                                  fitm_answer_request *out, fitm_err *err);

/* The /answer response {id, object, model, answer, finish_reason, documents, usage, meta}
 * (`tokens` too with return_tokens). Without with_answer: the same less `answer` (a stream's
 * final event). Bytes of the answer that are not UTF-8 become U+FFFD. */
char *fitm_api_write_answer(const fitm_answer_request *req, const fitm_answer_result *res,
                            const char *id, const char *model, double queue_ms, double total_ms,
                            bool with_answer);

/* One stream event's JSON: {"delta": text}. */
char *fitm_api_write_answer_delta(const char *text, size_t len);

/* ---- the OpenAI routes ----------------------------------------------------------------- */

/* Parses a POST /v1/chat/completions (chat) or /v1/completions body into *out (release with
 * fitm_answer_request_free, also after a failure): messages (roles system, developer = system,
 * user, assistant, tool; content a string or text parts) or prompt (a string or an array of
 * one), model (as /rerank's), max_tokens or max_completion_tokens (lowered to
 * lim->max_answer_tokens; default min(256, that)), n (1 only), stop, temperature ([0, 2],
 * default 1 as OpenAI's), top_p, top_k, min_p, seed, stream, stream_options.include_usage
 * (into *include_usage). The extension field `documents` (as /answer's, with max_tokens_per_doc,
 * calibrate, calibration, reorder and intervention_layers) makes it a calibrated answer whose
 * question is the last user message (the prompt); without it n_docs is 0: plain generation.
 * Other OpenAI fields are ignored. Errors as fitm_api_parse_answer. */
fitm_status fitm_api_parse_openai(const char *body, size_t len, const fitm_api_limits *lim,
                                  bool chat, fitm_answer_request *out, bool *include_usage,
                                  fitm_err *err);

/* What every OpenAI response and chunk of one request repeats. */
typedef struct {
    const char *id; /* "chatcmpl-..." / "cmpl-..." */
    const char *model;
    int64_t created; /* unix seconds */
    bool chat;       /* chat.completion(.chunk), else text_completion */
} fitm_api_openai_head;

/* The whole response: one choice with the answer and its finish_reason, usage, and (with
 * documents) the extension field `documents` as /answer's. */
char *fitm_api_write_openai(const fitm_api_openai_head *h, const fitm_answer_result *res);

/* One stream chunk. final NULL: a piece of text (role: the first chunk, which names the
 * assistant role); final non-NULL: the last choice chunk (empty delta, finish_reason,
 * `documents`), or with usage_only the chunk stream_options.include_usage asks for (no
 * choices, usage). */
char *fitm_api_write_openai_chunk(const fitm_api_openai_head *h, const char *text, size_t len,
                                  bool role, const fitm_answer_result *final, bool usage_only);

/* ---- vLLM's score route and the tokenizer routes ----------------------------------------- */

/* Parses a POST /v1/score body (vLLM's: text_1 a string or an array of one, the query;
 * text_2 a string or an array of strings, the documents; model) into *out as a /rerank of
 * method calibrated, /rerank's default (release with fitm_rerank_request_free, also after a
 * failure). Other fields are ignored. Errors as fitm_api_parse_rerank, naming text_1 and
 * text_2. */
fitm_status fitm_api_parse_score(const char *body, size_t len, const fitm_api_limits *lim,
                                 fitm_rerank_request *out, fitm_err *err);

/* vLLM's score response {id, object: "list", created, model, data: [{index, object: "score",
 * score}] in text_2's order, usage}. */
char *fitm_api_write_score(const fitm_rerank_result *res, const char *id, const char *model,
                           int64_t created);

/* POST /tokenize and /detokenize as plain values: text to token ids, or ids to text. */
typedef struct {
    bool detokenize;
    char *text; /* owned: tokenize's input, detokenize's output (any bytes)   */
    size_t text_len;
    bool add_special;  /* tokenize: the BOS/EOS the model adds to a prompt       */
    int32_t *ids;      /* owned: detokenize's input, tokenize's output           */
    int64_t n_ids;
} fitm_api_tokens;

/* Releases what t owns and zeroes it. NULL is a no-op. */
void fitm_api_tokens_free(fitm_api_tokens *t);

/* Parses /tokenize's body (content, or vLLM's prompt; add_special, or vLLM's
 * add_special_tokens, default false) or /detokenize's (tokens: ids >= 0; the vocabulary
 * bound is checked when decoding) into *out. Errors as fitm_api_parse_rerank. */
fitm_status fitm_api_parse_tokens(const char *body, size_t len, const fitm_api_limits *lim,
                                  bool detokenize, fitm_api_tokens *out, fitm_err *err);

/* /tokenize's response {tokens, count, max_model_len} or /detokenize's {content, prompt}
 * (the same text under llama.cpp's and vLLM's names; bytes that are not UTF-8 become
 * U+FFFD). */
char *fitm_api_write_tokens(const fitm_api_tokens *t, int64_t max_model_len);

#endif
