/* passes: a request's forward passes over the session's model -- where they run (its own
 * caches or the session's), on which path, through how many layers, under which position
 * method -- and running one here in chunks (a sequence of the engine's batch runs its passes
 * through the batch's steps instead: rerank_seq.c).
 * Also what every method reads its passes with: the layers chosen and the results' order. */
#include "pipeline/session_internal.h"

#include <stdlib.h>
#include <string.h>

#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"

fitm_status fitm_passes_init(fitm_passes *ps, fitm_session *s, const fitm_rerank_request *req,
                             int32_t n_lanes, fitm_kv *const *kv, fitm_kv *const *branch,
                             fitm_err *err)
{
    *ps = (fitm_passes){.s = s, .n_lanes = n_lanes};
    if (n_lanes < 1 || n_lanes > FITM_SESSION_LANES_MAX)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "%d lanes (1 .. %d)", (int)n_lanes,
                            FITM_SESSION_LANES_MAX);
    for (int32_t l = 0; l < n_lanes; l++) {
        ps->kv[l] = kv[l];
        ps->branch[l] = branch ? branch[l] : NULL;
    }
    fitm_status st = fitm_session_position(s, req->position, &ps->position, err);
    if (st != FITM_OK)
        return st;
    ps->path = req->answer_scoring ? s->answer_path : s->rerank_path;
    /* An answer continues its scoring's rows only when its frame has the scoring prompt's
     * text before the documents; else (the default answer template on a raw model, a text of
     * its own) those rows are read for their attention only, as a rerank's. */
    ps->all_layers = req->answer_scoring && strcmp(fitm_session_answer_frame(s)->before,
                                                   fitm_rerank_default_frame.before) == 0;
    return FITM_OK;
}

void fitm_passes_share(int32_t n, int32_t n_lanes, int32_t l, int32_t *lo, int32_t *hi)
{
    *lo = (int32_t)((int64_t)l * n / n_lanes);
    *hi = (int32_t)((int64_t)(l + 1) * n / n_lanes);
}

const fitm_capture *fitm_passes_capture_part(const fitm_session *r, const fitm_capture *cap,
                                             int64_t pos0, int64_t n, fitm_capture *part)
{
    if (!cap)
        return NULL;
    int32_t i = 0, j;
    while (i < cap->n_rows && cap->rows[i] < pos0)
        i++;
    for (j = i; j < cap->n_rows && cap->rows[j] < pos0 + n; j++)
        ;
    if (j == i)
        return NULL;
    const size_t per = (size_t)r->L * (size_t)r->H;
    *part = *cap;
    part->rows = cap->rows + i;
    part->n_rows = j - i;
    if (cap->span_mass)
        part->span_mass = cap->span_mass + (size_t)i * per * (size_t)cap->n_spans;
    if (cap->probs)
        part->probs = cap->probs + (size_t)i * per * (size_t)cap->probs_stride;
    return part;
}

/* Runs pass p here, chunk by chunk, on the session's forward; keeps the session's record of
 * the prompt cache's ids up to date (fitm_pass_record). */
static fitm_status run_here(fitm_passes *ps, const fitm_pass *p, fitm_err *err)
{
    fitm_session *r = ps->s;
    fitm_status st;
    if (p->position == FITM_POSITION_BUCKETS &&
        (st = fitm_kv_passes(p->kv, FITM_BUCKETS, p->pos0 + p->n - fitm_kv_pos_base(p->kv), err)) !=
            FITM_OK)
        return st;
    for (int64_t off = 0; off < p->n; off += r->chunk) {
        if (ps->stop && ps->stop(ps->stop_arg))
            return fitm_err_set(err, FITM_ERR_TIMEOUT,
                                "stopped: the request's deadline passed or the server is "
                                "shutting down");
        int64_t len = p->n - off < r->chunk ? p->n - off : r->chunk, at = 0;
        const int64_t n_logits = fitm_pass_logit_rows(p, off, len, &at);
        fitm_capture part;
        /* Never AUTO: a reference pass's last chunk may be one token, and its rows must be
         * computed exactly as the original pass's were. */
        fitm_forward_opts o = {.prefix = p->prefix,
                               .position = p->position,
                               .capture =
                                   fitm_passes_capture_part(r, p->cap, p->pos0 + off, len, &part),
                               .n_logits = n_logits,
                               .n_pick = p->n_pick,
                               .pick = n_logits ? p->pick + at * p->n_pick : NULL,
                               .logprob = n_logits ? p->logprob + at * p->n_pick : NULL,
                               .path = p->path,
                               .n_layers = p->n_layers};
        st = fitm_forward_run(r->fwd, p->kv, p->ids + off, len, p->pos0 + off, &o, err);
        if (st == FITM_ERR_INVALID || st == FITM_ERR_LIMIT) {
            fitm_err_prefix(err, "forward pass");
            return FITM_ERR_INTERNAL; /* arguments were checked: this is a bug */
        }
        if (st != FITM_OK)
            return st;
        if (p->kv == r->kv)
            fitm_pass_record(r, p, off, len, r->kv_ids, &r->kv_n);
    }
    return FITM_OK;
}

void fitm_pass_record(const fitm_session *s, const fitm_pass *p, int64_t from, int64_t n,
                      int32_t *ids, int64_t *n_ids)
{
    const int64_t at = p->pos0 + from;
    if (*n_ids > at)
        *n_ids = at; /* rows from here on were just recomputed */
    /* Rows a later /answer may continue: every layer's, computed as its prompt would be. A
     * pass that stops early leaves the later layers without its rows. */
    const bool reusable = p->n_layers == 0 && p->path == s->answer_path && p->prefix == NULL;
    if (reusable && *n_ids == at) {
        memcpy(ids + at, p->ids + from, (size_t)n * sizeof *p->ids);
        *n_ids = at + n;
    }
}

fitm_pass fitm_passes_pass(const fitm_passes *ps, fitm_kv *kv, const fitm_kv *prefix,
                           const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                           int64_t n_logits, int32_t n_pick, const int32_t *pick,
                           double *logprob)
{
    return (fitm_pass){.kv = kv,
                       .prefix = prefix,
                       .ids = ids,
                       .n = n,
                       .pos0 = pos0,
                       .cap = cap,
                       .n_logits = n_logits,
                       .n_pick = n_pick,
                       .pick = pick,
                       .logprob = logprob,
                       .n_layers = n_logits ? 0 : ps->n_layers,
                       .path = ps->path,
                       .position = ps->position};
}

fitm_status fitm_passes_run_pass(fitm_passes *ps, const fitm_pass *p, fitm_err *err)
{
    fitm_session *r = ps->s;
    if (p->kv == r->kv && r->kv_n > p->pos0)
        r->kv_n = p->pos0; /* rows from pos0 on are about to change */
    return run_here(ps, p, err);
}

fitm_status fitm_passes_run(fitm_passes *ps, fitm_kv *kv, const fitm_kv *prefix, const int32_t *ids,
                            int64_t n, int64_t pos0, const fitm_capture *cap, fitm_err *err)
{
    const fitm_pass p = fitm_passes_pass(ps, kv, prefix, ids, n, pos0, cap, 0, 0, NULL, NULL);
    return fitm_passes_run_pass(ps, &p, err);
}

fitm_status fitm_machine_run(fitm_passes *ps, fitm_machine *m, fitm_status st, fitm_err *err)
{
    const fitm_pass *pass = NULL;
    if (st == FITM_OK && ps->n_lanes != 1)
        st = fitm_err_set(err, FITM_ERR_INTERNAL, "a whole run has one lane, not %d",
                          (int)ps->n_lanes);
    while (st == FITM_OK && (st = m->next(m->run, 0, &pass, err)) == FITM_OK && pass)
        if ((st = fitm_passes_run_pass(ps, pass, err)) == FITM_OK)
            m->ran(m->run, 0);
    return m->end(m->run, st);
}

int64_t fitm_pass_logit_rows(const fitm_pass *p, int64_t from, int64_t n, int64_t *at)
{
    const int64_t first = p->n - p->n_logits; /* the logit rows are the pass's last */
    const int64_t lo = from > first ? from : first;
    *at = lo - first;
    return from + n > lo ? from + n - lo : 0;
}

fitm_status fitm_layers_choose(const fitm_session *r, const char *name, const int32_t *layers,
                               int32_t n, uint8_t *use, fitm_err *err)
{
    memset(use, 0, (size_t)(uint32_t)r->L);
    if (n > 0) {
        for (int32_t i = 0; i < n; i++) {
            int32_t l = fitm_layer_index(r, layers[i]);
            if (l < 0 || l >= r->L)
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "'%s[%d]' = %d: the model has %d layers", name, (int)i,
                                    (int)layers[i], (int)r->L);
            use[l] = 1;
        }
        return FITM_OK;
    }
    bool any_global = false;
    for (int32_t l = 0; l < r->L; l++)
        any_global |= !fitm_model_layer(r->m, l)->local;
    for (int32_t l = 0; l < r->L; l++)
        use[l] = !any_global || !fitm_model_layer(r->m, l)->local;
    return FITM_OK;
}

int32_t fitm_layers_last(const fitm_session *r, const uint8_t *use)
{
    int32_t n = 0;
    for (int32_t l = 0; l < r->L; l++)
        if (use[l])
            n = l + 1;
    return n;
}

static int cmp_results(const void *a, const void *b)
{
    const fitm_rerank_doc_result *x = a, *y = b;
    if (x->relevance_score != y->relevance_score)
        return x->relevance_score > y->relevance_score ? -1 : 1;
    if (x->raw_score != y->raw_score) /* a sigmoid may round two raw scores to one */
        return x->raw_score > y->raw_score ? -1 : 1;
    return x->index - y->index;
}

void fitm_results_sort(fitm_rerank_doc_result *res, int32_t K)
{
    qsort(res, (size_t)K, sizeof *res, cmp_results);
}
