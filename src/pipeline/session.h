/* session: what the daemon holds for as long as it runs -- the model, the tokenizer, the
 * backend, the forward scratch, the prompt cache with one reference branch, the chat and
 * answer templates, the scoring defaults and the profile -- and what requests may ask of it.
 * A request (rerank.h, answer.h) is a value passed to the pipeline with the session; its
 * state lives in that call or in its own sequence, never in the session. The only thing a
 * request changes here is what the prompt cache holds, when a whole run computes its prompt
 * there (fitm_rerank_run), so that a later request may continue those rows.
 *
 * Not thread-safe: one thread (the engine's) uses a session, except where a function says it
 * only reads what fitm_session_create made. */
#ifndef FITM_SESSION_H
#define FITM_SESSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "model/forward.h"
#include "model/kv.h"
#include "pipeline/score.h"

typedef struct fitm_model fitm_model;
typedef struct fitm_tokenizer fitm_tokenizer;
typedef struct fitm_backend fitm_backend;
typedef struct fitm_session fitm_session;
struct fitm_moice;

typedef struct {
    int64_t n_ctx;                   /* most prompt tokens (KV rows); <= the model's context */
    int64_t chunk;                   /* tokens per forward call (prefill batch) */
    const char *dummy_text;          /* the default dummy document text */
    const char *chat_template;       /* auto | raw | chatml | gemma | llama2 | llama3 */
    const fitm_score_opts *defaults; /* the server's scoring options (profile and config);
                                        unset ones take the built-in defaults; may be NULL */
    double paper_temperature;        /* t of method paper when the request has none (> 0) */
    const char *answer_template;     /* /answer's prompt for a model without a chat template:
                                        text with one {documents} and, after it, {question};
                                        "\n" for a newline. NULL or "": the built-in one */
    const char *answer_stop;         /* the text that ends an answer in answer_template's
                                        format ("\n" for a newline), /answer's stop string
                                        when a request sends none. NULL or "": "\n" with the
                                        built-in template, none with another */
    const char *profile;             /* what meta reports as the profile in use; NULL: none */
    const fitm_answer_defaults *answer; /* /answer's defaults (profile and config); unset
                                           ones take the built-in; may be NULL */
    /* Position methods (docs/position-methods.md), enabled on the forward at creation:
     * MoICE's routers (borrowed, checked against the model; NULL: none, so requests for
     * moice get FITM_ERR_INVALID) and the method of requests that name none. */
    const struct fitm_moice *moice;
    fitm_position_method position;
    bool answer_prompt_step; /* /answer's prompts (and its scoring passes, whose rows the
                                answer continues) on the STEP path instead of BATCH */
    bool rerank_step;        /* /rerank's passes on the STEP path instead of BATCH */
    /* Lanes of a /rerank sequence (rerank.h, fitm_rerank_lanes): 1 .. FITM_SESSION_LANES_MAX;
     * 0: 1. */
    int32_t rerank_lanes;
    /* Most logit rows one forward call computes (the forward's logits scratch holds this many
     * rows of V floats), at most chunk; 0: FITM_SESSION_LOGIT_ROWS. */
    int64_t logit_rows;
} fitm_session_params;

/* The most lanes a /rerank sequence may have (fitm_session_params.rerank_lanes). */
#define FITM_SESSION_LANES_MAX 16

/* Logit rows per forward call unless fitm_session_params.logit_rows says otherwise. */
#define FITM_SESSION_LOGIT_ROWS 32

/* A prompt frame: the text before the documents and after them. Each may hold {question}
 * (replaced by the query; the span of its last occurrence in `after` is the question span).
 * The chat template's head and tail wrap the whole. */
typedef struct {
    const char *before, *after;
} fitm_rerank_frame;

/* Prepares a session: the forward scratch and two KV caches of n_ctx rows (the prompt's and
 * one reference branch), allocated once, and the scoring defaults (built-in under
 * p->defaults). Borrows m, tok and b, which must outlive it. FITM_ERR_INVALID for an
 * answer_template without {documents} and {question}, or default layers or (layer, head)
 * pairs the model does not have. */
fitm_status fitm_session_create(fitm_session **out, const fitm_model *m, const fitm_tokenizer *tok,
                                fitm_backend *b, const fitm_session_params *p, fitm_err *err);

/* NULL is a no-op. */
void fitm_session_destroy(fitm_session *s);

/* /answer's defaults after create, every one set. */
const fitm_answer_defaults *fitm_session_answer_defaults(const fitm_session *s);

/* The chat template in use after create ("raw", "gemma", ...). */
const char *fitm_session_template(const fitm_session *s);

/* The model and tokenizer the session serves, and its context (KV rows). Borrowed. */
const fitm_model *fitm_session_model(const fitm_session *s);
const fitm_tokenizer *fitm_session_tokenizer(const fitm_session *s);
int64_t fitm_session_n_ctx(const fitm_session *s);

/* Whether the chat template in use is raw (no template: a base model's prompt). */
bool fitm_session_is_raw(const fitm_session *s);

/* /answer's frame: the answer template's when the chat template is raw, else the default
 * frame (inside the chat template). Valid while s lives. */
const fitm_rerank_frame *fitm_session_answer_frame(const fitm_session *s);

/* The answer template's stop strings (params.answer_stop) into *stop (valid while s lives),
 * their count: 0 when the chat template is not raw (the template's end-of-turn token ends
 * the answer) or the template has none. */
int32_t fitm_session_answer_stop(const fitm_session *s, char *const **stop);

/* The position method a request asks for (position: its own, or -1 for the server's
 * default) into *out, after the checks: FITM_ERR_INVALID naming 'position_method' when it is
 * moice and the server has no sidecar, FITM_ERR_UNSUPPORTED when it is attention_buckets on a
 * backend without ops->capture_add. Reads only what create made. */
fitm_status fitm_session_position(const fitm_session *s, int32_t position,
                                  fitm_position_method *out, fitm_err *err);

/* Makes the prompt cache the cache of method m's rows: rows computed under another method
 * stop being reusable; under attention_buckets the session's caches hold a pass per bucket
 * (grown as runs need), under another method they drop their extra passes. */
fitm_status fitm_session_cache_method(fitm_session *s, fitm_position_method m, fitm_err *err);

/* How many leading rows of the prompt cache hold exactly ids[0, n) (what the last whole run
 * left there): a pipeline may start its forward pass at any position up to that. */
int64_t fitm_session_cached(const fitm_session *s, const int32_t *ids, int64_t n);

/* A KV cache of n_rows rows for the session's model on its backend, with FITM_BUCKETS passes
 * of n_rows rows each when m is attention_buckets (the caller destroys it with
 * fitm_kv_destroy before the session). */
fitm_status fitm_session_kv_create(fitm_session *s, fitm_position_method m, int64_t n_rows,
                                   fitm_kv **out, fitm_err *err);

/* Copies the prompt cache's first n rows (n <= what fitm_session_cached reports for the
 * prompt) into dst, an ordinary cache (base 0) of at least n rows: dst then holds [0, n). */
fitm_status fitm_session_copy_rows(fitm_session *s, fitm_kv *dst, int64_t n, fitm_err *err);

/* Whether /answer's prompt rows take the STEP path (fitm_session_params.answer_prompt_step). */
bool fitm_session_answer_prompt_step(const fitm_session *s);

/* Most tokens and most logit rows one batched call may carry. */
int64_t fitm_session_batch_tokens(const fitm_session *s);
int64_t fitm_session_batch_logits(const fitm_session *s);

/* One batched forward call (fitm_forward_run_batch) over sequences with caches of their own;
 * never the prompt cache or the branch. A rejected argument is reported as
 * FITM_ERR_INTERNAL (the pipeline checked them). */
fitm_status fitm_session_run_batch(fitm_session *s, const fitm_forward_seq *seqs, int32_t n_seqs,
                                   fitm_err *err);

#endif
