/* rerank_methods: each rerank method's run and cost, for rerank.c's dispatch and the batch
 * sequence (rerank_seq.c). rerank_attn.c: calibrated, attention, paper; rerank_sort.c:
 * attention_sort; rerank_per_doc.c: query_likelihood, relevance, fused. Every method but
 * attention_sort runs as a state machine of passes (fitm_machine), whole here or as a
 * sequence of the engine's batch. A run takes the request's passes (fitm_passes: where they
 * run) and fills the result; a cost reads only the session. Not for other modules: they use
 * rerank.h. */
#ifndef FITM_RERANK_METHODS_H
#define FITM_RERANK_METHODS_H

#include "pipeline/session_internal.h"

/* The attention methods (rerank_attn.c), run as a state machine over each window's plan of
 * passes (its main pass, its dummy passes, its null pass), each lane of the passes through
 * its block of the windows (fitm_passes_share): fitm_attention_start plans the
 * options; fitm_attention_next readies a lane's next pass of the plan (planning a window when it
 * starts, calibrating it when its passes are done, making the result after the last), which
 * its owner runs -- here (fitm_passes_run_pass), or in the engine's batch steps -- and reports
 * with fitm_attention_ran; fitm_attention_end fills res's usage and timings and frees. */
typedef struct fitm_attention fitm_attention;

/* Starts req's attention method on the passes ps into res (zeroed, meta.method set by the
 * caller). *out is set even on failure (NULL when out of memory) and goes to
 * fitm_attention_end. */
fitm_status fitm_attention_start(fitm_passes *ps, const fitm_rerank_request *req,
                                 fitm_rerank_result *res, fitm_attention **out, fitm_err *err);

/* Lane's next pass to run (*pass, valid until fitm_attention_ran for that lane), or *pass
 * NULL once the lane's windows are done; the call that finds every lane done makes the
 * result. The pass's cache (the lane's) is readied for it (rebased or cut at its start). */
fitm_status fitm_attention_next(fitm_attention *a, int32_t lane, const fitm_pass **pass,
                                fitm_err *err);

/* The pass fitm_attention_next handed out for lane has run: its capture is read. */
void fitm_attention_ran(fitm_attention *a, int32_t lane);

/* Ends the run with status st (returned): res's usage and timings, a's memory freed. a may be
 * NULL. */
fitm_status fitm_attention_end(fitm_attention *a, fitm_status st);

/* fitm_attention_start as a fitm_machine. */
fitm_status fitm_attention_machine(fitm_passes *ps, const fitm_rerank_request *req,
                                   fitm_rerank_result *res, fitm_machine *m, fitm_err *err);

/* The whole run, its passes run here one after another through the same state machine. */
fitm_status fitm_attention_run(fitm_passes *ps, const fitm_rerank_request *req,
                               fitm_rerank_result *res, fitm_err *err);

/* The forward tokens the run of req on n_lanes lanes computes: exactly, or (any_order: the
 * documents in an order not known yet) at most this. Fails as the run would for options,
 * layers or heads the model does not have and for a prompt over the context (exact only). */
fitm_status fitm_attention_cost(const fitm_session *r, const fitm_rerank_request *req,
                                bool any_order, int32_t n_lanes, int64_t *tokens, fitm_err *err);

/* The windows (groups) req's run scores, as fitm_score_groups makes them with the run's
 * window option: what its lanes share. */
int32_t fitm_attention_windows(const fitm_session *r, const fitm_rerank_request *req);

/* The most rows any prompt of fitm_attention_run for req can have (a lane's caches' size):
 * the prompt of its largest window's documents in any order with the request's query or (a
 * null reference) the content-free one, at most n_ctx. */
fitm_status fitm_attention_rows(const fitm_session *r, const fitm_rerank_request *req,
                                int64_t *rows, fitm_err *err);

/* attention_sort (rerank_sort.c). */
fitm_status fitm_attention_sort_run(fitm_passes *ps, const fitm_rerank_request *req,
                                    fitm_rerank_result *res, fitm_err *err);
fitm_status fitm_attention_sort_cost(const fitm_session *r, const fitm_rerank_request *req,
                                     int64_t *tokens, fitm_err *err);

/* query_likelihood, relevance and fused (rerank_per_doc.c): a state machine over the
 * documents, each lane through its block of them (fitm_passes_share), each document's prompt
 * on the lane's cache rebased at 0: query_likelihood's question rows with logits, at most
 * logit_rows a pass, the first pass also taking the rows before them (their log-probabilities
 * added in row order), and for fused the query's rows' attention to the document captured in
 * the same passes; relevance's whole prompt, its last row's logits. The whole run drives the
 * same machine (fitm_machine_run). */
fitm_status fitm_per_doc_start(fitm_passes *ps, const fitm_rerank_request *req,
                               fitm_rerank_result *res, fitm_machine *m, fitm_err *err);
fitm_status fitm_per_doc_run(fitm_passes *ps, const fitm_rerank_request *req,
                             fitm_rerank_result *res, fitm_err *err);
fitm_status fitm_per_doc_cost(const fitm_session *r, const fitm_rerank_request *req,
                              int64_t *tokens, fitm_err *err);
/* The most rows a document's pass of req has (a sequence's cache size). */
fitm_status fitm_per_doc_rows(const fitm_session *r, const fitm_rerank_request *req,
                              int64_t *rows, fitm_err *err);

#endif
