/* batch: the engine's scheduler (see batch.h). A step is built in two passes over the
 * members -- decode steps first, one row each, then prompt chunks and rerank passes (a part
 * of every lane's posted pass) in the members' order within the budget -- then run as one
 * forward call, whose outcome each part's member (and lane) takes in turn. */
#include "pipeline/batch.h"

#include <stdint.h>

static fitm_status stopped(fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_TIMEOUT,
                        "stopped: the request's deadline passed or the server is shutting down");
}

/* The parts of one step's call and the room left in it. */
typedef struct {
    fitm_forward_seq parts[FITM_FORWARD_MAX_SEQS];
    int32_t idx[FITM_FORWARD_MAX_SEQS];  /* the member each part is of */
    int32_t lane[FITM_FORWARD_MAX_SEQS]; /* a rerank's part: the lane it is of */
    int32_t n_parts;
    int64_t room, logit_room; /* rows and logit rows the call may still carry */
    int64_t budget;           /* prompt rows the step may still carry */
} step_parts;

/* When the oldest member that is still computing its prompt (an answer) or its passes (a
 * rerank) arrived; INT64_MAX when none is. */
static int64_t oldest_unfinished(const fitm_batch_seq *seqs, int32_t n)
{
    int64_t oldest = INT64_MAX;
    for (int32_t i = 0; i < n; i++)
        if ((seqs[i].rerank || !fitm_answer_seq_decoding(seqs[i].answer)) &&
            seqs[i].arrived_ns < oldest)
            oldest = seqs[i].arrived_ns;
    return oldest;
}

/* Arrival order: an answer with only its first token waits (held) while work that arrived
 * before that token is unfinished. Returns whether any answer decodes in this step (a
 * stream whose gap between two tokens the prompt budget bounds). */
static bool hold_early_streams(const fitm_batch_seq *seqs, int32_t n, bool *held)
{
    const int64_t oldest = oldest_unfinished(seqs, n);
    bool streaming = false;
    for (int32_t i = 0; i < n; i++) {
        const fitm_answer_seq *q = seqs[i].answer;
        held[i] = false;
        if (!q || !fitm_answer_seq_decoding(q))
            continue;
        held[i] = fitm_answer_seq_first_after(q, oldest);
        streaming = streaming || !held[i];
    }
    return streaming;
}

/* A member whose stop() says to end finishes now: a rerank through its own end (its status
 * comes from fitm_rerank_end), an answer with FITM_ERR_TIMEOUT. Returns whether it stopped. */
static bool stop_if_asked(const fitm_batch_seq *m, fitm_status *st, bool *done, fitm_err *errs)
{
    *st = FITM_OK;
    *done = false;
    if (m->rerank && fitm_rerank_seq_stopped(m->rerank)) {
        fitm_err e;
        fitm_rerank_seq_after(m->rerank, 0, 0, stopped(&e), &e, done);
        return true;
    }
    if (m->answer && fitm_answer_seq_stopped(m->answer)) {
        *st = stopped(errs);
        *done = true;
        return true;
    }
    return false;
}

/* Takes the part just written at sp->parts[sp->n_parts] into the call as member i's (lane's)
 * part when its rows and logit rows fit; else it is left out (the member waits). */
static void take_part(int32_t i, int32_t lane, bool decoding, step_parts *sp)
{
    const fitm_forward_seq *part = &sp->parts[sp->n_parts];
    if (part->T > sp->room || part->opts->n_logits > sp->logit_room)
        return; /* its logit rows do not fit this call */
    sp->room -= part->T;
    sp->logit_room -= part->opts->n_logits;
    sp->budget -= decoding ? 0 : part->T;
    sp->idx[sp->n_parts] = i;
    sp->lane[sp->n_parts++] = lane;
}

/* Adds member i's part (decoding: one row; else a chunk within the budget) when it fits; a
 * rerank adds a part of each of its lanes' posted passes, in lane order, while they fit. */
static void add_part(const fitm_batch_seq *m, int32_t i, bool decoding, step_parts *sp)
{
    if (!m->rerank) {
        const int64_t want = decoding ? 1 : (sp->budget < sp->room ? sp->budget : sp->room);
        if (want < 1)
            return;
        fitm_answer_seq_part(m->answer, want, sp->logit_room, &sp->parts[sp->n_parts]);
        take_part(i, 0, decoding, sp);
        return;
    }
    const int32_t n_lanes = fitm_rerank_seq_lanes(m->rerank);
    for (int32_t l = 0; l < n_lanes && sp->n_parts < FITM_FORWARD_MAX_SEQS && sp->logit_room > 0;
         l++) {
        const int64_t want = sp->budget < sp->room ? sp->budget : sp->room;
        if (want < 1)
            return;
        if (fitm_rerank_seq_part(m->rerank, l, want, sp->logit_room, &sp->parts[sp->n_parts]))
            take_part(i, l, false, sp);
    }
}

/* The step's parts: decode steps first (one row each), then prompt chunks and rerank passes
 * in the order given, within the budget; a member left out this step waits for the next. */
static void gather_parts(const fitm_batch_seq *seqs, int32_t n, const bool *held, fitm_status *st,
                         bool *done, fitm_err *errs, step_parts *sp)
{
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < n; i++) {
            if (pass == 0 && stop_if_asked(&seqs[i], &st[i], &done[i], &errs[i]))
                continue;
            const bool decoding = seqs[i].answer && fitm_answer_seq_decoding(seqs[i].answer);
            if (done[i] || held[i] || decoding != (pass == 0) ||
                sp->n_parts == FITM_FORWARD_MAX_SEQS || sp->logit_room < 1)
                continue;
            add_part(&seqs[i], i, decoding, sp);
        }
}

int64_t fitm_batch_step(fitm_session *s, const fitm_batch_seq *seqs, int32_t n,
                        int64_t prefill_budget, fitm_status *st, bool *done, fitm_err *errs)
{
    step_parts sp = {.n_parts = 0,
                     .room = fitm_session_batch_tokens(s),
                     .logit_room = fitm_session_batch_logits(s),
                     .budget = prefill_budget};
    bool held[FITM_FORWARD_MAX_SEQS];
    /* With no stream decoding there is no gap to bound: prompts take the whole call. */
    if (!hold_early_streams(seqs, n, held))
        sp.budget = sp.room;
    gather_parts(seqs, n, held, st, done, errs, &sp);
    if (sp.n_parts == 0)
        return 0;
    fitm_err err = {{0}};
    const fitm_status bs = fitm_session_run_batch(s, sp.parts, sp.n_parts, &err);
    int64_t tokens = 0;
    for (int32_t k = 0; k < sp.n_parts; k++) {
        const int32_t i = sp.idx[k];
        tokens += sp.parts[k].T;
        if (seqs[i].rerank) {
            fitm_rerank_seq_after(seqs[i].rerank, sp.lane[k], sp.parts[k].T, bs, &err, &done[i]);
            continue;
        }
        st[i] = fitm_answer_seq_after(seqs[i].answer, sp.parts[k].T, bs, &done[i], &errs[i]);
        if (bs != FITM_OK)
            errs[i] = err;
    }
    return tokens;
}

fitm_status fitm_answer_run(fitm_session *s, const fitm_answer_request *req,
                            bool (*stop)(const void *), const void *stop_arg,
                            fitm_answer_on_delta on_delta, void *delta_arg, fitm_answer_result *res,
                            fitm_err *err)
{
    fitm_answer_seq *q = NULL;
    fitm_status st = fitm_answer_begin(s, req, stop, stop_arg, on_delta, delta_arg, res, &q, err);
    bool done = st != FITM_OK;
    fitm_batch_seq one = {.answer = q};
    while (!done)
        (void)fitm_batch_step(s, &one, 1, fitm_session_batch_tokens(s), &st, &done, err);
    return fitm_answer_end(q, st, err);
}
