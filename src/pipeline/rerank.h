/* rerank: the request and result of POST /rerank as plain C structs (filled and written by
 * api.c, which is the only JSON user), and the pipeline that turns one into the other on the
 * engine's thread with the session (session.h): rerank.c dispatches by method; prompt.c
 * builds the prompts; rerank_attn.c runs the attention methods in steps, score -> reference
 * passes -> calibrate, with the scoring options of score.h; rerank_sort.c attention_sort;
 * rerank_per_doc.c query_likelihood, relevance and fused (query likelihood's passes with the
 * attention they capture); passes.c runs their forward passes;
 * rerank_seq.c makes a method's run a sequence of the engine's batch.
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
#include "model/forward.h"
#include "model/kv.h"
#include "pipeline/score.h"
#include "pipeline/session.h"

/* Longest `layers` list a request may carry. */
#define FITM_RERANK_MAX_LAYERS FITM_SCORE_MAX_LIST

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
    fitm_score_opts opt;        /* owned; the options the request sets (others unset:
                                   the server's defaults)                                  */
    char *dummy;                /* owned; NULL: the server's dummy text                 */
    size_t dummy_len;
    bool return_tokens;
    bool prefix_reuse;          /* calibrated: reference passes reuse the prompt's cache   */
    bool answer_scoring;        /* an /answer's scoring: the passes take the answer prompt's
                                   path (answer_prompt_path), not rerank_path, so its ranks
                                   are what its accuracy was measured with; and they run
                                   every layer where the answer continues their rows (its
                                   frame has the scoring prompt's text before the documents),
                                   else only up to the last one read, as a rerank's do      */
    bool tei;                   /* asked in TEI's shape (`texts`): answer in TEI's shape */
    bool no_truncate;           /* a document over max_tokens_per_doc fails the request
                                   (FITM_ERR_LIMIT) instead of being cut (TEI's
                                   truncate: false)                                        */
    bool raw_scores;            /* TEI's raw_scores: its answer gives raw_score            */
    int32_t position;           /* a fitm_position_method, or -1: the server's default   */
} fitm_rerank_request;

/* Releases what req owns and zeroes it. NULL is a no-op. */
void fitm_rerank_request_free(fitm_rerank_request *req);

typedef struct {
    int32_t index;               /* the document's index in the request                   */
    double relevance_score;      /* the method's score: calibrated: sigmoid(score_scale x
                                    rel_scaled + score_bias); paper: alpha; attention: A   */
    int32_t position;            /* 0-based place of the document in its scored prompt     */
    double calibrated_attention; /* rel (0 for methods without a reference)                */
    double attention;            /* A                                                      */
    double dummy_attention;      /* A_ref, the reference's attention (0 without one)       */
    double weight;               /* alpha = softmax(rel_scaled / temperature) over K (the
                                    attention methods; 0 for the others)                   */
    double raw_score;            /* the score before the method's squashing: calibrated:
                                    score_scale x rel_scaled + score_bias; the others:
                                    relevance_score (TEI's raw_scores)                     */
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
    bool has_opts;        /* the attention methods: opts holds the options used          */
    fitm_score_opts opts; /* owned, every option set (layers as given, before resolving) */
    int32_t n_groups;     /* prompts scored (windows)                                   */
    char profile[256];    /* the server's profile ("" when none)                         */
    fitm_position_method position; /* the position method the passes used               */
} fitm_rerank_meta;

/* One scored prompt's tokens (return_tokens): its ids, each document's body span, the span of
 * the trailing question, the dummy ids of its reference passes (document j's dummy is
 * dummy_tokens + dummy_offsets[j], spans[j] long; NULL without dummy passes), and the
 * null reference's prompt with its spans and question span (NULL without one). Documents
 * first_doc .. first_doc + n_docs - 1 of the request, in that order. */
typedef struct {
    int32_t first_doc, n_docs;
    int32_t *ids;
    int64_t n_ids;
    fitm_span *spans;
    fitm_span question;
    int32_t *dummy_tokens;
    int64_t *dummy_offsets;
    int32_t *null_ids;
    int64_t n_null_ids;
    fitm_span *null_spans;
    fitm_span null_question;
} fitm_rerank_tokens;

typedef struct {
    fitm_rerank_doc_result *results; /* (n_results) owned, sorted by relevance_score desc */
    int32_t n_results;               /* K (the writer cuts to top_n)                     */
    fitm_rerank_usage usage;
    fitm_rerank_meta meta;
    fitm_rerank_tokens *groups; /* (n_groups) owned, with return_tokens; NULL otherwise */
    int32_t n_groups;
} fitm_rerank_result;

/* Releases what res owns and zeroes it. NULL is a no-op. */
void fitm_rerank_result_free(fitm_rerank_result *res);

/* ---- the pipeline ------------------------------------------------------------------------ */

/* The built-in answer_template: two short worked examples (a name, a place) before the
 * documents, so a base model answers in a few words instead of continuing the documents'
 * prose. Two answer types, because a single example made the model copy its answer type; a
 * trailing "Answer in a few words:" cue alone made it repeat the cue. The answer ends at the
 * line break: its default stop string (fitm_session_params.answer_stop). */
extern const char fitm_rerank_answer_template[];

/* The frame of the prompt of docs/design.md (Method) (Liu et al.'s, used by the attention
 * methods). */
extern const fitm_rerank_frame fitm_rerank_default_frame;

/* Scores req's documents (docs/design.md) into *res (the caller frees it, also after a failure).
 * stop(stop_arg) is polled between forward calls; when it returns true the run ends with
 * FITM_ERR_TIMEOUT. Errors: FITM_ERR_CONTEXT when the prompt does not fit n_ctx even after
 * per-document truncation, FITM_ERR_INVALID for layers or heads the model does not have,
 * FITM_ERR_UNSUPPORTED for methods not implemented yet, FITM_ERR_BACKEND from the backend.
 * Runs on the session's own caches (which then hold the prompt for a later request). */
fitm_status fitm_rerank_run(fitm_session *s, const fitm_rerank_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_rerank_result *res, fitm_err *err);

/* Whether req's calibrated scores are each document's alone (method calibrated with windows
 * of 1, by the request or the server's default, or one document): then they do not depend on
 * the documents' order, and /answer's intervention may take a calibrated reorder's weights. */
bool fitm_rerank_scores_alone(const fitm_session *r, const fitm_rerank_request *req);

/* The forward tokens (usage.forward_tokens) req computes as the server runs it -- a
 * sequence (fitm_rerank_begin) on its lanes (fitm_rerank_lanes), attention_sort whole
 * (fitm_rerank_run) -- counted from its tokenized prompts without running the model: exact
 * for every method with the documents in request order, except attention_sort with titles
 * that differ (its reordered passes are bounded: a header counts at most its bytes). A
 * whole run of a sequence's method (one lane) computes at most this: each lane's first
 * window computes the prompt's shared head afresh. any_order: the documents will be in an
 * order not known yet (/answer's reorder): an upper bound. Fails as the run would
 * (FITM_ERR_CONTEXT for a prompt over the context, FITM_ERR_INVALID for layers or heads the
 * model does not have, ...). Reads only what fitm_session_create made, so it may run on any
 * thread while fitm_rerank_run runs on another. */
fitm_status fitm_rerank_cost(const fitm_session *s, const fitm_rerank_request *req,
                             bool any_order, int64_t *tokens, fitm_err *err);

/* ---- a /rerank in the running batch ------------------------------------------------------
 * Every method but attention_sort (whose second pass depends on the first's order) also runs
 * as a sequence that advances one batched forward call at a time beside other sequences
 * (continuous batching, server/engine.c): fitm_rerank_begin gives the request lanes
 * (fitm_rerank_lanes), each with caches of its own (a prompt's and, for a method with
 * reference passes, one branch over it) and a contiguous block of the request's windows
 * (attention methods) or documents (query_likelihood, relevance; fused: its calibrated
 * windows, then its query_likelihood documents), and starts the method's run as a state
 * machine of passes with a pass posted per lane -- an attention method's over each window's
 * plan (main pass, dummy passes, null pass); query_likelihood's and relevance's over the
 * documents (a prompt's rows and its logit rows, one pass where they fit); fused's the
 * calibrated machine followed by query_likelihood's on each lane, combined at the end.
 * Prompts, captures, logits and scores are exactly fitm_rerank_run's code, which drives the
 * same machine on one lane in a loop -- up to each lane's first pass; each step carries a
 * chunk of every lane's posted pass that fits (fitm_rerank_seq_part), and
 * fitm_rerank_seq_after, once a lane's pass is complete, hands its capture or logits to the
 * method and readies the lane's next pass; the steps over all K documents (softmax, sigmoid,
 * the sort, fused's combination) run once every lane is done. All of it runs on the session's
 * thread, between the batch's forward calls. Scores are bit-identical to fitm_rerank_run's
 * and to one lane's: every pass runs on the path the whole run takes, whose rows and logits
 * do not depend on the chunking or on what else shares the call (fitm_forward_run_batch), and
 * a window's or document's score reads only its own passes. */
typedef struct fitm_rerank_seq fitm_rerank_seq;

/* The lanes req runs on as a sequence: the session's rerank_lanes (fitm_session_params), at
 * most its windows (attention methods; fused: K windows of 1) or documents, and 1 for an
 * /answer's scoring (whose rows the answer continues from one prompt cache) and for
 * attention_sort (a whole run). Reads only what fitm_session_create made. */
int32_t fitm_rerank_lanes(const fitm_session *s, const fitm_rerank_request *req);

/* Whether req runs as a sequence (every method but attention_sort, which runs whole with
 * fitm_rerank_run). */
bool fitm_rerank_batches(const fitm_rerank_request *req);

/* Starts req (fitm_rerank_batches) into *res (the caller frees res, also after a failure):
 * its lanes' caches, sized by req's longest possible prompt, and the run up to each lane's
 * first pass.
 * *out is NULL when the run already ended (a failure, or an error the method found before
 * its first pass): the return value is then its status. Otherwise FITM_OK and *out is the
 * sequence to step. stop as in fitm_rerank_run, polled by fitm_batch_step. */
fitm_status fitm_rerank_begin(fitm_session *r, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_rerank_seq **out, fitm_err *err);

/* q's lanes (fitm_rerank_lanes of its request). */
int32_t fitm_rerank_seq_lanes(const fitm_rerank_seq *q);

/* This step's part of q's lane (0 .. fitm_rerank_seq_lanes - 1): the next at most budget
 * rows of the lane's posted pass, of which at most logit_room (>= 1) are the pass's logit
 * rows (they end the pass, so a part holding some ends with them). False (part untouched)
 * when the lane has no pass posted: its share is done, or the run ended. */
bool fitm_rerank_seq_part(fitm_rerank_seq *q, int32_t lane, int64_t budget, int64_t logit_room,
                          fitm_forward_seq *part);

/* After the call that carried the part of T rows of q's lane ended with st (err its
 * message): the lane's pass advances, and when it is complete the run reads its capture and
 * readies the lane's next pass; after the last lane's last pass the run ends (the result
 * made). A failed st ends the run with st, whatever the lane. *done once the run ended. st
 * FITM_ERR_TIMEOUT with T = 0 stops q (its stop()). */
void fitm_rerank_seq_after(fitm_rerank_seq *q, int32_t lane, int64_t T, fitm_status st,
                           const fitm_err *err, bool *done);

/* Whether q's stop() asks it to end. */
bool fitm_rerank_seq_stopped(const fitm_rerank_seq *q);

/* After q finished (done): its run's status into err, the result complete; frees q. A q not
 * finished (shutdown) ends with FITM_ERR_TIMEOUT. */
fitm_status fitm_rerank_end(fitm_rerank_seq *q, fitm_err *err);

/* The bytes of q's own KV caches, every lane's. */
size_t fitm_rerank_seq_kv_bytes(const fitm_rerank_seq *q);

/* Once q's run ended (*done) and before fitm_rerank_end: its status (err its message when it
 * failed); the result is complete and q's caches are still there. */
fitm_status fitm_rerank_seq_status(const fitm_rerank_seq *q, fitm_err *err);

/* After q's run ended (*done), for an /answer whose ranking q ran: the session's prompt cache
 * takes the rows of q's prompt cache that a later prompt may continue (fitm_session_cached:
 * rows its passes computed for every layer on the answer path), as a whole run on the
 * session's caches would have left them there. */
fitm_status fitm_rerank_seq_keep_rows(const fitm_rerank_seq *q, fitm_err *err);

/* ---- the prompt, for /answer ------------------------------------------------------------ */

/* The prompt for req in frame f (NULL: the default frame) exactly as the attention methods
 * build it: *ids (malloc'd, the caller frees it, also after a failure) of *n_ids tokens, and
 * spans[p] (K entries, caller's) the body of the document at position p. order[p] is the
 * document at position p (NULL: request order). */
fitm_status fitm_rerank_prompt(const fitm_session *r, const fitm_rerank_request *req,
                               const fitm_rerank_frame *f, const int32_t *order, int32_t **ids,
                               int64_t *n_ids, fitm_span *spans, fitm_err *err);

/* At most the tokens of the prompt of frame f (NULL: the default) over req's documents in any
 * order (exact when every title is the same). Thread-safety as fitm_rerank_cost. */
fitm_status fitm_rerank_prompt_bound(const fitm_session *r, const fitm_rerank_request *req,
                                     const fitm_rerank_frame *f, int64_t *tokens,
                                     fitm_err *err);

#endif
