/* rerank_seq: a /rerank of an attention method as a sequence of the engine's running batch
 * (see rerank.h). The method's code runs unchanged on a helper thread with passes whose sink
 * is this sequence: each pass it asks for is posted here and the helper waits; the engine's
 * steps carry the pass's chunks (fitm_rerank_seq_part) and, once it is complete, let the
 * helper run on to its next pass or its end (fitm_rerank_seq_after). The helper runs only
 * while the engine's thread waits for it, so one thread computes at a time. */
#include "pipeline/rerank_methods.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    SEQ_HOST,     /* the helper thread runs the method's host side */
    SEQ_POSTED,   /* it waits for the posted pass */
    SEQ_FINISHED, /* the method returned: run_st, run_err */
} seq_phase;

struct fitm_rerank_seq {
    fitm_session *s;
    fitm_kv *kv, *branch; /* the request's own caches */
    fitm_passes passes;   /* the request's passes: on kv and branch, sunk here */
    const fitm_rerank_request *req;
    bool (*stop)(const void *);
    const void *stop_arg;
    fitm_rerank_result *res;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    seq_phase phase;     /* under mu: who runs */
    fitm_pass pass;      /* the posted pass */
    int64_t done_rows;   /* how far it got */
    fitm_status pass_st; /* what the pass ended with, for the helper thread */
    fitm_err pass_err;
    fitm_capture part_cap; /* this step's part */
    fitm_forward_opts part_opts;
    fitm_status run_st; /* the method's status, when FINISHED */
    fitm_err run_err;
};

/* The passes' sink, on the helper thread: posts the pass, waits until the steps have run it. */
static fitm_status post_pass(void *arg, const fitm_pass *pass, fitm_err *err)
{
    fitm_rerank_seq *q = arg;
    pthread_mutex_lock(&q->mu);
    q->pass = *pass;
    q->done_rows = 0;
    q->phase = SEQ_POSTED;
    pthread_cond_broadcast(&q->cv);
    while (q->phase == SEQ_POSTED)
        pthread_cond_wait(&q->cv, &q->mu);
    fitm_status st = q->pass_st;
    if (st != FITM_OK)
        *err = q->pass_err;
    pthread_mutex_unlock(&q->mu);
    return st;
}

/* The helper thread: the method, start to end, its passes sunk into the sequence. */
static void *seq_main(void *arg)
{
    fitm_rerank_seq *q = arg;
    fitm_err err = {{0}};
    fitm_rerank_result *res = q->res;
    memset(res, 0, sizeof *res);
    fitm_score_opts_init(&res->meta.opts);
    res->meta.method = q->req->method;
    fitm_status st = fitm_rerank_run_passes(&q->passes, q->req, res, &err);
    pthread_mutex_lock(&q->mu);
    q->run_st = st;
    q->run_err = err;
    q->phase = SEQ_FINISHED;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* The caller's side: waits while the helper thread runs its host side (mu held). */
static void seq_wait_host(fitm_rerank_seq *q)
{
    while (q->phase == SEQ_HOST)
        pthread_cond_wait(&q->cv, &q->mu);
}

bool fitm_rerank_batches(const fitm_rerank_request *req)
{
    return req->method == FITM_RERANK_CALIBRATED || req->method == FITM_RERANK_ATTENTION ||
           req->method == FITM_RERANK_PAPER;
}

static void seq_free(fitm_rerank_seq *q)
{
    fitm_kv_destroy(q->kv);
    fitm_kv_destroy(q->branch);
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

/* A sequence for req with its lock, and its caches of rows rows (a pass per bucket when the
 * request runs attention_buckets). */
static fitm_status seq_create(fitm_session *s, const fitm_rerank_request *req, int64_t rows,
                              fitm_rerank_seq **out, fitm_err *err)
{
    fitm_rerank_seq *q = calloc(1, sizeof *q);
    if (!q)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (pthread_mutex_init(&q->mu, NULL)) {
        free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot create a lock");
    }
    if (pthread_cond_init(&q->cv, NULL)) {
        pthread_mutex_destroy(&q->mu);
        free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot create a condition");
    }
    *out = q;
    q->s = s;
    const fitm_position_method m =
        req->position < 0 ? s->position_default : (fitm_position_method)req->position;
    fitm_status st = fitm_session_kv_create(s, m, rows > 0 ? rows : 1, &q->kv, err);
    if (st == FITM_OK)
        st = fitm_session_kv_create(s, m, rows > 0 ? rows : 1, &q->branch, err);
    return st;
}

fitm_status fitm_rerank_begin(fitm_session *s, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_rerank_seq **out, fitm_err *err)
{
    *out = NULL;
    memset(res, 0, sizeof *res);
    if (!fitm_rerank_batches(req))
        return fitm_err_set(err, FITM_ERR_INTERNAL, "method %s does not run as a sequence",
                            fitm_rerank_method_name(req->method));
    int64_t rows = 0;
    fitm_rerank_seq *q = NULL;
    fitm_status st = fitm_attention_rows(s, req, &rows, err);
    if (st == FITM_OK)
        st = seq_create(s, req, rows, &q, err);
    if (st != FITM_OK) {
        if (q)
            seq_free(q);
        return st;
    }
    q->req = req;
    q->stop = stop;
    q->stop_arg = stop_arg;
    q->res = res;
    q->phase = SEQ_HOST;
    /* A position method the request may not use fails here, as a whole run's would. */
    if ((st = fitm_passes_init(&q->passes, s, req, q->kv, q->branch, err)) != FITM_OK) {
        seq_free(q);
        return st;
    }
    q->passes.sink = post_pass;
    q->passes.sink_arg = q;
    if (pthread_create(&q->thread, NULL, seq_main, q)) {
        seq_free(q);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start a rerank thread");
    }
    q->started = true;
    pthread_mutex_lock(&q->mu);
    seq_wait_host(q);
    bool finished = q->phase == SEQ_FINISHED;
    pthread_mutex_unlock(&q->mu);
    if (finished)
        return fitm_rerank_end(q, err);
    *out = q;
    return FITM_OK;
}

void fitm_rerank_seq_part(fitm_rerank_seq *q, int64_t budget, fitm_forward_seq *part)
{
    const fitm_pass *p = &q->pass;
    const int64_t left = p->n - q->done_rows;
    int64_t T = left;
    if (left > budget) /* the logit rows stay in the pass's last call */
        T = left - p->n_logits >= 1 ? (budget < left - p->n_logits ? budget : left - p->n_logits)
                                    : left;
    T = T < 1 ? 1 : T;
    const bool last = q->done_rows + T == p->n;
    const int64_t pos = p->pos0 + q->done_rows;
    q->part_opts =
        (fitm_forward_opts){.prefix = p->prefix,
                            .capture = fitm_passes_capture_part(q->s, p->cap, pos, T, &q->part_cap),
                            .n_logits = last ? p->n_logits : 0,
                            .logits = NULL,
                            .position = p->position,
                            .path = p->path,
                            .n_layers = p->n_layers};
    *part = (fitm_forward_seq){p->kv, p->ids + q->done_rows, T, pos, &q->part_opts};
}

void fitm_rerank_seq_after(fitm_rerank_seq *q, int64_t T, fitm_status st, const fitm_err *err,
                           bool *done)
{
    pthread_mutex_lock(&q->mu);
    *done = q->phase == SEQ_FINISHED;
    if (q->phase == SEQ_POSTED) {
        q->done_rows += st == FITM_OK ? T : 0;
        if (st != FITM_OK || q->done_rows >= q->pass.n) {
            q->pass_st = st;
            if (st != FITM_OK)
                q->pass_err = *err;
            q->phase = SEQ_HOST;
            pthread_cond_broadcast(&q->cv);
            seq_wait_host(q);
            *done = q->phase == SEQ_FINISHED;
        }
    }
    pthread_mutex_unlock(&q->mu);
}

bool fitm_rerank_seq_stopped(const fitm_rerank_seq *q)
{
    return q->stop && q->stop(q->stop_arg);
}

fitm_status fitm_rerank_end(fitm_rerank_seq *q, fitm_err *err)
{
    if (q->started) {
        pthread_mutex_lock(&q->mu);
        /* A sequence ended early (shutdown) unwinds its helper thread first. */
        while (q->phase != SEQ_FINISHED) {
            if (q->phase == SEQ_POSTED) {
                q->pass_st = fitm_err_set(&q->pass_err, FITM_ERR_TIMEOUT,
                                          "stopped: the request's deadline passed or the server "
                                          "is shutting down");
                q->phase = SEQ_HOST;
                pthread_cond_broadcast(&q->cv);
            }
            seq_wait_host(q);
        }
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->thread, NULL);
    }
    fitm_status st = q->run_st;
    if (st != FITM_OK)
        *err = q->run_err;
    seq_free(q);
    return st;
}

size_t fitm_rerank_seq_kv_bytes(const fitm_rerank_seq *q)
{
    return fitm_kv_bytes(q->kv) + fitm_kv_bytes(q->branch);
}
