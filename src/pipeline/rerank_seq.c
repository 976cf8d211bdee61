/* rerank_seq: a /rerank as a sequence of the engine's running batch (see rerank.h). The
 * sequence has lanes, each with caches of its own and its block of the request's windows or
 * documents, and holds the method's state machine (fitm_machine: for an attention method each
 * lane's window, the pass of its plan and what the passes so far captured; for a
 * per-document method each lane's document and its logit rows so far; for fused the
 * component each lane is in) and the pass each lane has posted: the engine's steps carry the
 * passes' chunks side by side (fitm_rerank_seq_part), and once a lane's pass is complete
 * fitm_rerank_seq_after hands its capture or logits to the method and readies the lane's next
 * pass; the run ends after the last lane's last pass. Everything runs on the engine's thread. */
#include "pipeline/rerank_methods.h"

#include <stdlib.h>
#include <string.h>

/* A lane: its caches, the pass it has posted and this step's part of it. */
typedef struct {
    fitm_kv *kv, *branch;
    const fitm_pass *pass; /* the posted pass (the run's); NULL once the lane's share is done */
    int64_t done_rows;     /* how far the posted pass got */
    fitm_capture part_cap; /* this step's part */
    fitm_forward_opts part_opts;
} seq_lane;

struct fitm_rerank_seq {
    fitm_session *s;
    int32_t n_lanes, n_drained;
    seq_lane lanes[FITM_SESSION_LANES_MAX];
    fitm_passes passes; /* the request's passes: on the lanes' caches */
    fitm_machine run;   /* the method between two passes; end NULL once it ended */
    bool (*stop)(const void *);
    const void *stop_arg;
    fitm_status run_st; /* the method's status, once it ended */
    fitm_err run_err;
    /* (lane 0's prompt cache's rows) the ids of the rows an answer may continue: [0, kv_n);
     * an answer's scoring has one lane */
    int32_t *kv_ids;
    int64_t kv_n;
};

static fitm_status stopped(fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_TIMEOUT,
                        "stopped: the request's deadline passed or the server is shutting down");
}

/* Ends the method's run with st (err: its message when st is not FITM_OK). */
static void run_end(fitm_rerank_seq *q, fitm_status st, const fitm_err *err)
{
    q->run_st = q->run.end(q->run.run, st);
    if (st != FITM_OK)
        q->run_err = *err;
    q->run = (fitm_machine){0};
    for (int32_t l = 0; l < q->n_lanes; l++)
        q->lanes[l].pass = NULL;
}

/* Runs the method's host side for lane l up to its next pass with rows to compute (posted)
 * or the end of its share; a pass without rows is done as soon as it is planned. The run
 * ends once every lane's share is done (the machine made the result) or on a failure. */
static void advance(fitm_rerank_seq *q, int32_t l)
{
    seq_lane *ln = &q->lanes[l];
    fitm_err err = {{0}};
    fitm_status st;
    while ((st = q->run.next(q->run.run, l, &ln->pass, &err)) == FITM_OK && ln->pass &&
           ln->pass->n < 1)
        q->run.ran(q->run.run, l);
    ln->done_rows = 0;
    if (st != FITM_OK)
        run_end(q, st, &err);
    else if (!ln->pass && ++q->n_drained == q->n_lanes)
        run_end(q, FITM_OK, &err);
}

bool fitm_rerank_batches(const fitm_rerank_request *req)
{
    return req->method != FITM_RERANK_ATTENTION_SORT;
}

/* Whether req's method reads the attention of reference passes on a branch cache. */
static bool has_branch(const fitm_rerank_request *req)
{
    return req->method != FITM_RERANK_QUERY_LIKELIHOOD && req->method != FITM_RERANK_RELEVANCE &&
           req->method != FITM_RERANK_FUSED;
}

/* The most rows any pass of req has: its caches' size. */
static fitm_status seq_rows(const fitm_session *s, const fitm_rerank_request *req, int64_t *rows,
                            fitm_err *err)
{
    if (!has_branch(req))
        return fitm_per_doc_rows(s, req, rows, err);
    return fitm_attention_rows(s, req, rows, err);
}

/* The end of a method that never started. */
static fitm_status no_machine_end(void *run, fitm_status st)
{
    (void)run;
    return st;
}

/* Starts req's method on ps into res as *m, which goes to m->end even on failure. */
static fitm_status machine_start(fitm_passes *ps, const fitm_rerank_request *req,
                                 fitm_rerank_result *res, fitm_machine *m, fitm_err *err)
{
    switch (req->method) {
    case FITM_RERANK_QUERY_LIKELIHOOD:
    case FITM_RERANK_RELEVANCE:
    case FITM_RERANK_FUSED:
        return fitm_per_doc_start(ps, req, res, m, err);
    case FITM_RERANK_CALIBRATED:
    case FITM_RERANK_ATTENTION:
    case FITM_RERANK_PAPER:
        return fitm_attention_machine(ps, req, res, m, err);
    case FITM_RERANK_ATTENTION_SORT:
    case FITM_RERANK_METHOD_COUNT:
        break;
    }
    *m = (fitm_machine){.end = no_machine_end};
    return fitm_err_set(err, FITM_ERR_INTERNAL, "method %s has no state machine",
                        fitm_rerank_method_name(req->method));
}

int32_t fitm_rerank_lanes(const fitm_session *s, const fitm_rerank_request *req)
{
    if (!fitm_rerank_batches(req) || req->answer_scoring)
        return 1;
    const bool per_doc = req->method == FITM_RERANK_QUERY_LIKELIHOOD ||
                         req->method == FITM_RERANK_RELEVANCE || req->method == FITM_RERANK_FUSED;
    const int32_t units = per_doc ? req->n_docs : fitm_attention_windows(s, req);
    const int32_t n = s->rerank_lanes < units ? s->rerank_lanes : units;
    return n > 1 ? n : 1;
}

static void seq_free(fitm_rerank_seq *q)
{
    if (q->run.end)
        q->run.end(q->run.run, FITM_OK);
    for (int32_t l = 0; l < q->n_lanes; l++) {
        fitm_kv_destroy(q->lanes[l].kv);
        fitm_kv_destroy(q->lanes[l].branch);
    }
    free(q->kv_ids);
    free(q);
}

/* A sequence for req with its lanes' caches of rows rows (a pass per bucket when the request
 * runs attention_buckets). */
static fitm_status seq_create(fitm_session *s, const fitm_rerank_request *req, int64_t rows,
                              fitm_rerank_seq **out, fitm_err *err)
{
    fitm_rerank_seq *q = calloc(1, sizeof *q);
    if (!q)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    *out = q;
    q->s = s;
    q->kv_ids = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *q->kv_ids);
    if (!q->kv_ids)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const fitm_position_method m =
        req->position < 0 ? s->position_default : (fitm_position_method)req->position;
    const int32_t n_lanes = fitm_rerank_lanes(s, req);
    fitm_status st = FITM_OK;
    for (; st == FITM_OK && q->n_lanes < n_lanes; q->n_lanes++) {
        seq_lane *ln = &q->lanes[q->n_lanes];
        st = fitm_session_kv_create(s, m, rows > 0 ? rows : 1, &ln->kv, err);
        if (st == FITM_OK && has_branch(req))
            st = fitm_session_kv_create(s, m, rows > 0 ? rows : 1, &ln->branch, err);
    }
    return st;
}

fitm_status fitm_rerank_begin(fitm_session *s, const fitm_rerank_request *req,
                              bool (*stop)(const void *), const void *stop_arg,
                              fitm_rerank_result *res, fitm_rerank_seq **out, fitm_err *err)
{
    *out = NULL;
    memset(res, 0, sizeof *res);
    fitm_score_opts_init(&res->meta.opts);
    res->meta.method = req->method;
    if (!fitm_rerank_batches(req))
        return fitm_err_set(err, FITM_ERR_INTERNAL, "method %s does not run as a sequence",
                            fitm_rerank_method_name(req->method));
    int64_t rows = 0;
    fitm_rerank_seq *q = NULL;
    fitm_status st = seq_rows(s, req, &rows, err);
    if (st == FITM_OK)
        st = seq_create(s, req, rows, &q, err);
    fitm_kv *kv[FITM_SESSION_LANES_MAX] = {0}, *branch[FITM_SESSION_LANES_MAX] = {0};
    for (int32_t l = 0; q && l < q->n_lanes; l++) {
        kv[l] = q->lanes[l].kv;
        branch[l] = q->lanes[l].branch;
    }
    /* A position method the request may not use fails here, as a whole run's would. */
    if (st == FITM_OK &&
        (st = fitm_passes_init(&q->passes, s, req, q->n_lanes, kv, branch, err)) == FITM_OK) {
        res->meta.position = q->passes.position;
        st = machine_start(&q->passes, req, res, &q->run, err);
    }
    if (st != FITM_OK) {
        if (q)
            seq_free(q);
        return st;
    }
    q->stop = stop;
    q->stop_arg = stop_arg;
    for (int32_t l = 0; l < q->n_lanes && q->run.end; l++)
        advance(q, l);
    if (!q->run.end)
        return fitm_rerank_end(q, err);
    *out = q;
    return FITM_OK;
}

int32_t fitm_rerank_seq_lanes(const fitm_rerank_seq *q)
{
    return q->n_lanes;
}

bool fitm_rerank_seq_part(fitm_rerank_seq *q, int32_t lane, int64_t budget, int64_t logit_room,
                          fitm_forward_seq *part)
{
    seq_lane *ln = &q->lanes[lane];
    const fitm_pass *p = ln->pass;
    if (!q->run.end || !p)
        return false;
    const int64_t left = p->n - ln->done_rows;
    /* the rows before the pass's logit rows, then as many of those as the call has room for */
    const int64_t plain = p->n - p->n_logits - ln->done_rows;
    const int64_t most = (plain > 0 ? plain : 0) + (logit_room > 0 ? logit_room : 0);
    int64_t T = left < budget ? left : budget;
    T = T < most ? T : most;
    T = T < 1 ? 1 : T;
    int64_t at = 0;
    const int64_t n_logits = fitm_pass_logit_rows(p, ln->done_rows, T, &at);
    const int64_t pos = p->pos0 + ln->done_rows;
    ln->part_opts = (fitm_forward_opts){
        .prefix = p->prefix,
        .capture = fitm_passes_capture_part(q->s, p->cap, pos, T, &ln->part_cap),
        .n_logits = n_logits,
        .n_pick = p->n_pick,
        .pick = n_logits ? p->pick + at * p->n_pick : NULL,
        .logprob = n_logits ? p->logprob + at * p->n_pick : NULL,
        .position = p->position,
        .path = p->path,
        .n_layers = p->n_layers};
    *part = (fitm_forward_seq){p->kv, p->ids + ln->done_rows, T, pos, &ln->part_opts};
    return true;
}

void fitm_rerank_seq_after(fitm_rerank_seq *q, int32_t lane, int64_t T, fitm_status st,
                           const fitm_err *err, bool *done)
{
    if (q->run.end && st != FITM_OK) {
        run_end(q, st, err);
        *done = true;
        return;
    }
    seq_lane *ln = &q->lanes[lane];
    if (q->run.end && ln->pass) {
        if (lane == 0 && ln->pass->kv == ln->kv)
            fitm_pass_record(q->s, ln->pass, ln->done_rows, T, q->kv_ids, &q->kv_n);
        if ((ln->done_rows += T) >= ln->pass->n) {
            q->run.ran(q->run.run, lane);
            advance(q, lane);
        }
    }
    *done = q->run.end == NULL;
}

bool fitm_rerank_seq_stopped(const fitm_rerank_seq *q)
{
    return q->stop && q->stop(q->stop_arg);
}

fitm_status fitm_rerank_end(fitm_rerank_seq *q, fitm_err *err)
{
    if (q->run.end) { /* a sequence ended early (shutdown) */
        fitm_err e;
        run_end(q, stopped(&e), &e);
    }
    fitm_status st = q->run_st;
    if (st != FITM_OK)
        *err = q->run_err;
    seq_free(q);
    return st;
}

size_t fitm_rerank_seq_kv_bytes(const fitm_rerank_seq *q)
{
    size_t n = 0;
    for (int32_t l = 0; l < q->n_lanes; l++)
        n += fitm_kv_bytes(q->lanes[l].kv) +
             (q->lanes[l].branch ? fitm_kv_bytes(q->lanes[l].branch) : 0);
    return n;
}

fitm_status fitm_rerank_seq_status(const fitm_rerank_seq *q, fitm_err *err)
{
    if (q->run_st != FITM_OK)
        *err = q->run_err;
    return q->run_st;
}

fitm_status fitm_rerank_seq_keep_rows(const fitm_rerank_seq *q, fitm_err *err)
{
    fitm_session *s = q->s;
    s->kv_n = 0; /* until the rows are there */
    fitm_status st = fitm_session_cache_method(s, q->passes.position, err);
    const fitm_kv *kv = q->lanes[0].kv;
    const int32_t n_passes = fitm_kv_n_passes(kv);
    if (st == FITM_OK && fitm_kv_n_passes(s->kv) < n_passes)
        st = fitm_kv_passes(s->kv, n_passes, 0, err);
    if (st == FITM_OK)
        st = fitm_kv_rebase(s->kv, 0, err);
    if (st == FITM_OK && (st = fitm_kv_copy(s->kv, kv, q->kv_n, err)) != FITM_OK) {
        fitm_err_prefix(err, "keeping ranked rows");
        return FITM_ERR_INTERNAL;
    }
    if (st == FITM_OK && s->b->ops->status)
        st = s->b->ops->status(s->b, err);
    if (st != FITM_OK)
        return st;
    memcpy(s->kv_ids, q->kv_ids, (size_t)q->kv_n * sizeof *q->kv_ids);
    s->kv_n = q->kv_n;
    return FITM_OK;
}
