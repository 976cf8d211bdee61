/* answer: the request and result of POST /answer as plain C structs (filled and written by
 * api.c), and the pipeline on the engine's thread, in three steps: order (answer_order.c: an
 * optional reorder, then alpha = the calibrated method's weights), the prompt (answer_prompt.c:
 * the answer template for a base model, else the rerank prompt inside the chat template, with
 * exact document spans; rows the session's prompt cache already holds are reused) and decode
 * (answer.c, with answer_stream.c for the text), with the intervention in the chosen layers
 * for every query row after the last document. It uses the session and the rerank pipeline
 * only through session.h and rerank.h.
 *
 * Ownership: a request owns every string and array it points to (fitm_answer_request_free);
 * a result likewise (fitm_answer_result_free).
 *
 * Legend: T prompt tokens, K documents, L layers, V vocab. */
#ifndef FITM_ANSWER_H
#define FITM_ANSWER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "pipeline/rerank.h"

/* Most stop strings a request may carry, and their longest length. */
#define FITM_ANSWER_MAX_STOP 8
#define FITM_ANSWER_MAX_STOP_CHARS 64 /* code points (at most 256 bytes) */

/* One turn of a conversation (the OpenAI routes): role is "system", "user", "assistant" or
 * another name the template writes as is. Both strings owned. */
typedef struct {
    char *role;
    char *content;
} fitm_answer_message;

typedef struct {
    /* query, docs, max_tokens_per_doc, model, return_tokens; method is CALIBRATED and
     * opt and dummy are the calibration options. n_docs 0 (the OpenAI routes without
     * documents): plain generation from messages, no ranking and no intervention. */
    fitm_rerank_request base;
    /* Plain generation's prompt (n_docs 0): the conversation rendered in the chat template
     * (fitm_answer_render), or, with raw_prompt, messages[0].content as it is (a completion). */
    fitm_answer_message *messages; /* (n_messages) owned */
    int32_t n_messages;
    bool raw_prompt;
    int32_t max_tokens; /* in [1, server limit]                                        */
    char **stop;        /* (n_stop) owned, non-empty strings                           */
    int32_t n_stop;
    bool has_stop;      /* the request gave stop (even none): else, with documents, the
                           answer template's (fitm_session_answer_stop) unless ignore_eos */
    double temperature;        /* sampling; 0 = greedy                                        */
    double top_p;              /* (0, 1]                                                      */
    int32_t top_k;             /* [0, 64]: draw from the top_k most likely; 0: all 64         */
    double min_p;              /* [0, 1]: keep tokens of at least min_p of the top one's
                                  probability; 0: no cut (fitm_sampling)                     */
    uint64_t seed;             /* the sampler's seed                                          */
    bool has_seed;             /* the request gave it (else the HTTP layer picks one)         */
    /* FITM_ANSWER_UNSET in the next four: the server's default (fitm_answer_defaults). */
    int32_t calibrate;         /* 1: intervene with the calibrated alpha; 0: not              */
    int32_t reorder;           /* -1: none; else a fitm_rerank_method to order documents by   */
    int32_t reorder_last;      /* 1: the reorder puts the most relevant last (by the query)   */
    int32_t top_n;             /* >= 1: only the top_n first of the reorder (else of the
                                  documents as sent) enter the prompt; 0: every document.
                                  Send 0 for plain generation on a server whose default
                                  keeps fewer                                                */
    bool ignore_eos;           /* generate past end-of-generation tokens (load tests)         */
    int32_t *intervene_layers; /* (n_intervene_layers) owned; NULL: the last half          */
    int32_t n_intervene_layers;
    bool stream;
} fitm_answer_request;

/* Releases what req owns and zeroes it. NULL is a no-op. */
void fitm_answer_request_free(fitm_answer_request *req);

typedef enum {
    FITM_FINISH_STOP = 0, /* EOS or a stop string */
    FITM_FINISH_LENGTH,   /* max_tokens, or the context is full */
} fitm_answer_finish;

/* "stop" | "length". */
const char *fitm_answer_finish_name(fitm_answer_finish f);

typedef struct {
    int32_t index;               /* the document's index in the request                 */
    int32_t position;            /* 0-based place in the prompt (after any reorder); -1:
                                    left out by top_n                                    */
    double weight;               /* alpha_k (1/K without calibration)                    */
    double calibrated_attention; /* rel = A - A_dum (0 without calibration)              */
} fitm_answer_doc;

typedef struct {
    char *answer; /* owned, NUL-terminated (the stop string and EOS are not in it) */
    size_t answer_len;
    fitm_answer_finish finish;
    fitm_answer_doc *docs; /* (n_docs) owned, in request order */
    int32_t n_docs;
    int64_t prompt_tokens, completion_tokens, forward_tokens;
    double rank_ms, prefill_ms, decode_ms, first_token_ms, total_ms;
    int32_t position_method;     /* the fitm_position_method the passes used              */
    int32_t calibrate, reorder, reorder_last, top_n; /* the options as run (defaults in) */
    int32_t *tokens; /* (n_tokens) owned: prompt ids then generated ids; always kept */
    int64_t n_tokens;
    fitm_span *spans; /* (n_docs) owned: each document's body in the prompt, request order
                         ({0, 0} for one top_n left out) */
} fitm_answer_result;

/* Releases what res owns and zeroes it. NULL is a no-op. */
void fitm_answer_result_free(fitm_answer_result *res);

/* Called on the engine's thread after every generated token with the new piece of answer text:
 * whole UTF-8 characters only, never a part of a stop string; len 0 when the token added
 * nothing sendable yet. Returns false to cancel (the client went away). */
typedef bool (*fitm_answer_on_delta)(void *arg, const char *text, size_t len);

/* The text of plain generation's prompt for req (n_docs 0) in the session's chat template,
 * as fitm_answer_run tokenizes it: with a template (gemma, chatml, llama2, llama3), every
 * message in the template's turn markers (gemma has no system turn: a system message opens the
 * first user turn) and the assistant's turn opened; without one (raw: a base model) a
 * transcript "role: content" one line per message, ending in "assistant:". Control markers are
 * tokenized as control tokens, message text never is. *out is malloc'd (the caller frees it).
 * For tests and logs; fitm_answer_run renders the same way. */
fitm_status fitm_answer_render(const fitm_session *r, const fitm_answer_request *req, char **out,
                               size_t *len, fitm_err *err);

/* ---- batched generation ------------------------------------------------------------------
 * An answer as a sequence that advances one batched forward call at a time together with
 * other answers and reranks (continuous batching, server/engine.c): fitm_answer_begin starts
 * its ranking (the reorder, then the calibration of the documents kept), whose passes the
 * scheduler (batch.h, fitm_batch_step) carries like a rerank sequence's (attention_sort's
 * reorder alone runs whole, on the session's prompt cache); once it ended, the answer builds
 * its prompt and gets a KV cache of its own, seeded with the prompt rows the session's prompt
 * cache holds (where the ranking's last run left its rows, as a whole run would). Each call
 * advances a begun answer by one part -- a chunk of a ranking pass, a prompt chunk or a decode
 * step (fitm_answer_seq_part, then fitm_answer_seq_after); fitm_answer_end completes the
 * result and frees the sequence.
 * Tokens, text and logits are the same as fitm_answer_run's, whatever ran beside them
 * (fitm_forward_run_batch's batching rule). All on the session's thread. */
typedef struct fitm_answer_seq fitm_answer_seq;

/* Starts req into *res (as fitm_answer_run; the caller frees res). *out is the sequence to
 * step, also on failure (then pass it straight to fitm_answer_end); it holds req with the
 * defaults filled in, borrowing what req owns until fitm_answer_end. */
fitm_status fitm_answer_begin(fitm_session *r, const fitm_answer_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_answer_on_delta on_delta, void *delta_arg,
                              fitm_answer_result *res, fitm_answer_seq **out, fitm_err *err);

/* This step's part of seq: while it ranks, the ranking pass's next rows (as
 * fitm_rerank_seq_part, at most budget rows of which at most logit_room are logit rows);
 * then the next prompt chunk (at most budget tokens, on the path the server's
 * answer_prompt_path names) or the next decode step. */
void fitm_answer_seq_part(fitm_answer_seq *seq, int64_t budget, int64_t logit_room,
                          fitm_forward_seq *part);

/* After the call that carried seq's part of T rows ended with st: the ranking advances (to
 * its next phase, or to the prompt once it ended), the prompt advances, or (a call that gave
 * its logits) the next token is sampled and its text handed out. *done
 * when the answer is complete or failed; returns its status then (err its message). */
fitm_status fitm_answer_seq_after(fitm_answer_seq *seq, int64_t T, fitm_status st, bool *done,
                                  fitm_err *err);

/* Whether seq's stop() asks it to end. */
bool fitm_answer_seq_stopped(const fitm_answer_seq *seq);

/* Whether seq's prompt is done and it decodes one token per step. */
bool fitm_answer_seq_decoding(const fitm_answer_seq *seq);

/* Whether seq has only its first token, sampled after ns (fitm_clock_ns's scale). */
bool fitm_answer_seq_first_after(const fitm_answer_seq *seq, int64_t ns);

/* Completes seq's result after its last step (st: how it ended), frees seq, and returns the
 * answer's status. NULL seq returns st. */
fitm_status fitm_answer_end(fitm_answer_seq *seq, fitm_status st, fitm_err *err);

/* The bytes of seq's own KV caches: its ranking's while it ranks, then its own (0 before it
 * has one). */
size_t fitm_answer_seq_kv_bytes(const fitm_answer_seq *seq);


/* At most the forward tokens (forward_tokens) fitm_answer_run will compute for req (the
 * server's defaults filled in), counted from its tokenized prompts without running the model:
 * the reorder's and the calibration's ranking (fitm_rerank_cost; bounded when the reorder's
 * order is not known yet; one ranking when the calibration takes a calibrated reorder's
 * scores, fitm_rerank_scores_alone), the whole answer prompt (plain generation's: its
 * rendered messages; less when the cache already holds its start) and max_tokens - 1 decode
 * steps, within the context. Fails as fitm_rerank_cost does. Thread-safety as
 * fitm_rerank_cost. */
fitm_status fitm_answer_cost(const fitm_session *r, const fitm_answer_request *req,
                             int64_t *tokens, fitm_err *err);

#endif
