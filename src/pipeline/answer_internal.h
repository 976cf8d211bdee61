/* answer_internal: what the /answer pipeline's files share, by the file that defines it:
 *   answer_stream.c  the answer's text: stop strings, what is handed to on_delta
 *   answer_order.c   the documents' order and the intervention's weights (the scoring)
 *   answer_prompt.c  the answer prompt (or plain generation's), its spans and the
 *                    intervention
 * answer.c (decoding, a sequence's life) calls into them; they call none of each other's
 * functions but through this header's types, and never answer.c. Not for other modules. */
#ifndef FITM_ANSWER_INTERNAL_H
#define FITM_ANSWER_INTERNAL_H

#include "pipeline/answer.h"

/* ---- answer_stream.c ----------------------------------------------------------------------- */

/* The answer's text so far and how much of it was handed to on_delta. */
typedef struct {
    char *v;
    size_t n, cap, sent;
} fitm_answer_text;

/* Appends s[0..n) (NUL-terminated after it). */
fitm_status fitm_answer_text_append(fitm_answer_text *t, const char *s, size_t n, fitm_err *err);

/* Cuts the text at the first stop string that ends in the last n_new bytes; true if one did. */
bool fitm_answer_text_cut_at_stop(const fitm_answer_request *req, fitm_answer_text *t,
                                  size_t n_new);

/* Hands the sendable new text to on_delta (all of it when final): whole UTF-8 characters,
 * never a part of a stop string. FITM_ERR_CANCELLED when on_delta returned false. */
fitm_status fitm_answer_text_flush(const fitm_answer_request *req, fitm_answer_text *t, bool final,
                                   fitm_answer_on_delta on_delta, void *arg, fitm_err *err);

/* FITM_ERR_TIMEOUT: the request's stop() said to end. */
fitm_status fitm_answer_stopped(fitm_err *err);

/* ---- answer_order.c, answer_prompt.c -------------------------------------------------------- */

/* What an answer's prompt is: the documents in their order with their weights, their spans in
 * the prompt, the intervention, the prompt's length and the most tokens to generate. */
typedef struct {
    int32_t K, L;
    int32_t *order;        /* (K) the document at each position */
    fitm_rerank_doc *docs; /* (K) the request's documents in that order (shallow) */
    fitm_span *spans;      /* (K) their bodies in the answer prompt, by position */
    float *alpha;          /* (K) the intervention's weights, by position */
    uint8_t *use;          /* (L) the layers intervened in */
    fitm_intervention iv;
    bool intervene;
    int64_t T, max_gen;
} fitm_answer_plan;

/* The plan's arrays for req (documents in request order, uniform weights) and res->docs. */
fitm_status fitm_answer_plan_init(const fitm_session *s, const fitm_answer_request *req,
                                  fitm_answer_plan *pl, fitm_answer_result *res, fitm_err *err);
void fitm_answer_plan_free(fitm_answer_plan *pl);

/* The shallow request copy that ranks req's documents docs (in that order) with method m, as
 * an answer's scoring. */
fitm_rerank_request fitm_answer_rank_request(const fitm_answer_request *req, fitm_rerank_method m,
                                             const fitm_rerank_doc *docs);

/* Step 1, order, as phases: the reorder by req->reorder (when set), then the calibration of
 * the documents kept (when wanted and the reorder's scores are not already its weights). */
typedef enum {
    FITM_ANSWER_RANK_REORDER,
    FITM_ANSWER_RANK_CALIBRATE,
    FITM_ANSWER_RANK_DONE
} fitm_answer_rank_phase;

/* An answer's ranking between two phases: the phase that runs next and its ranking request
 * (a shallow copy borrowing the answer request's documents, or the plan's once reordered). */
typedef struct {
    fitm_answer_rank_phase phase;
    fitm_rerank_request q; /* the phase's ranking, while phase is not DONE */
    bool scored;           /* the reorder's calibrated scores are the weights */
} fitm_answer_ranking;

/* Starts req's ranking on pl (from fitm_answer_plan_init): the first phase with a ranking to
 * run, or, with neither a reorder nor a calibration, the plan's order as sent and DONE. */
void fitm_answer_rank_start(const fitm_answer_request *req, fitm_answer_plan *pl,
                            fitm_answer_ranking *rk, fitm_answer_result *res);

/* Takes rr, the successful run of rk->q (wherever it ran), into pl and res, and moves rk to
 * its next phase: after the reorder, the order, top_n's documents kept, and the calibration
 * of those (or DONE); after the calibration, the weights, and DONE. */
void fitm_answer_rank_took(const fitm_session *s, const fitm_answer_request *req,
                           fitm_answer_plan *pl, fitm_answer_ranking *rk,
                           const fitm_rerank_result *rr, fitm_answer_result *res);

/* Plain generation's prompt (no documents): the rendered messages tokenized into
 * res->tokens, *T its length (answer_prompt.c). */
fitm_status fitm_answer_plain_prompt(const fitm_session *s, const fitm_answer_request *req,
                                     int64_t *T, fitm_answer_result *res, fitm_err *err);

/* Step 2, the prompt: the answer prompt with the documents in pl's order (or plain
 * generation's), res->tokens with room for the generated ids, res->spans, pl->T and
 * pl->max_gen, and the intervention (answer_prompt.c). */
fitm_status fitm_answer_prompt(const fitm_session *s, const fitm_answer_request *req, bool plain,
                               fitm_answer_plan *pl, fitm_answer_result *res, fitm_err *err);

#endif
