/* work: what a fitmd job carries between the HTTP thread that builds it (http.c) and the
 * engine thread that runs it (fitmd_main.c's hooks.run). The engine itself sees only the kind
 * and an opaque pointer (fitm_job.kind, fitm_job.work).
 *
 * The submitter owns both the request and the result; hooks.run fills the result, and the
 * submitter frees it after on_done. */
#ifndef FITM_WORK_H
#define FITM_WORK_H

#include "pipeline/answer.h"
#include "pipeline/rerank.h"
#include "server/api.h"

typedef enum {
    FITM_WORK_RERANK = 1, /* work is a fitm_rerank_work */
    FITM_WORK_ANSWER,     /* work is a fitm_answer_work */
    FITM_WORK_TOKENS,     /* work is a fitm_tokens_work */
} fitm_work_kind;

typedef struct {
    const fitm_rerank_request *req;
    fitm_rerank_result result; /* filled when the job's status is FITM_OK */
    fitm_rerank_seq *seq;      /* engine thread only: the rerank while it is in the batch */
} fitm_rerank_work;

typedef struct {
    const fitm_answer_request *req;
    fitm_answer_on_delta on_delta; /* text as it is generated; may be NULL */
    void *delta_arg;
    fitm_answer_result result; /* filled as far as the run got, also on failure */
    fitm_answer_seq *seq;      /* engine thread only: the answer while it is in the batch */
} fitm_answer_work;

/* POST /tokenize and /detokenize: run whole between two engine steps (the tokenizer is the
 * loaded model's). */
typedef struct {
    fitm_api_tokens *t; /* the request: run fills ids (tokenize) or text (detokenize) */
    int64_t n_ctx;      /* filled: the context the server was started with            */
} fitm_tokens_work;

#endif
