/* batch: the engine's scheduler. Each step of the running batch is one batched forward call
 * (fitm_forward_run_batch) carrying a part of every member that fits: a decode step of each
 * decoding answer, then prompt chunks of answers and chunks of rerank passes in the members'
 * order, under a prompt budget while a stream decodes (docs/design.md, "A request's path").
 * Members are answers (answer.h) and reranks of every method but attention_sort (rerank.h); the
 * scheduler only asks each for its part and hands it the call's outcome, whatever its kind.
 * On the engine's thread. */
#ifndef FITM_BATCH_H
#define FITM_BATCH_H

#include "pipeline/answer.h"
#include "pipeline/rerank.h"

/* One member of the running batch: an answer or a /rerank (fitm_rerank_begin); exactly one
 * of the two is set. arrived_ns: when its request arrived, on fitm_clock_ns's scale. */
typedef struct {
    fitm_answer_seq *answer;
    fitm_rerank_seq *rerank;
    int64_t arrived_ns;
} fitm_batch_seq;

/* One batched forward call over seqs (n <= FITM_FORWARD_MAX_SEQS): every decoding answer
 * gets its next token; prompts and rerank passes get chunks of at most prefill_budget tokens
 * in all (the whole call when no answer is decoding: the budget bounds a stream's gap
 * between two tokens), in the order given, within the call's limits (a sequence left out
 * waits for the next step). Requests are served in the order they arrived: an answer that
 * has its first token waits, before its second, while a prompt or rerank of a request that
 * arrived before that first token is still being computed (requests that arrive together
 * are all prefilled, in whole calls, before any of them streams on); only the answers that
 * decode in the step bound the prompts by the budget. For each i: done[i] when seqs[i] has
 * finished, with st[i] (and errs[i] on failure) for an answer; a rerank's status and message
 * come from fitm_rerank_end. A sequence whose stop() is true finishes with FITM_ERR_TIMEOUT,
 * an answer whose on_delta returned false with FITM_ERR_CANCELLED. Finished sequences must
 * not be stepped again. Returns the forward tokens of the call (0: none ran). */
int64_t fitm_batch_step(fitm_session *s, const fitm_batch_seq *seqs, int32_t n,
                        int64_t prefill_budget, fitm_status *st, bool *done, fitm_err *errs);

/* Answers req into *res (the caller frees it, also after a failure), with the server's
 * defaults where req leaves calibrate, reorder or reorder_last unset (res says what ran).
 * stop(stop_arg) is polled between forward calls (FITM_ERR_TIMEOUT when it returns true);
 * on_delta may be NULL.
 * Errors: as fitm_rerank_run, plus FITM_ERR_CANCELLED when on_delta returned false.
 * Not thread-safe: runs on the session's thread, as a batch of one (fitm_batch_step). */
fitm_status fitm_answer_run(fitm_session *s, const fitm_answer_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_answer_on_delta on_delta, void *delta_arg, fitm_answer_result *res,
                            fitm_err *err);

#endif
