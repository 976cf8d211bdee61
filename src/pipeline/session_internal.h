/* session_internal: what the pipeline's own files share, by the file that defines it:
 *   session.c  the session's fields (struct fitm_session)
 *   prompt.c   token id lists, the chat templates, the rerank prompt and its bounds
 *   passes.c   a request's passes (fitm_passes): where they run, and running one
 * The files above them (rerank*.c, answer*.c, batch.c) call down into these, never the other
 * way. Not for other modules: they use session.h, rerank.h and answer.h. */
#ifndef FITM_SESSION_INTERNAL_H
#define FITM_SESSION_INTERNAL_H

#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "pipeline/rerank.h"
#include "tokenizer/tokenizer.h"

/* ---- session.c ----------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    const char *marker; /* in tokenizer.chat_template, and a token of the vocabulary */
    const char *head;   /* before the user's content (control tokens parsed) */
    const char *tail;   /* after it, up to where the model's answer starts */
} fitm_chat_template;

/* What lives as long as the daemon: the model and what serves it, the prompt cache and the
 * options every request starts from. A request never writes here; only whole runs on the
 * session's own caches (fitm_rerank_run) and an /answer's ranking once it ended
 * (fitm_rerank_seq_keep_rows: the rows its whole run would have left) update what those
 * caches hold (kv_ids, kv_n, kv_position). */
struct fitm_session {
    const fitm_model *m;
    const fitm_tokenizer *tok;
    fitm_backend *b;
    fitm_forward *fwd;
    fitm_kv *kv;     /* the prompt cache, [0, T): whole reranks and /answer's scoring */
    fitm_kv *branch; /* one reference pass over kv */
    int32_t *kv_ids; /* (n_ctx) the ids whose rows kv holds for every layer: [0, kv_n) */
    int64_t kv_n;
    fitm_position_method kv_position; /* the method kv's rows were computed under */
    int64_t n_ctx, chunk;
    fitm_forward_path answer_path, rerank_path; /* of /answer's prompts, of /rerank's passes */
    const fitm_chat_template *tmpl;
    int32_t *dummy; /* default dummy ids (" " + dummy_text) */
    int64_t n_dummy;
    int32_t L, H, V;
    int64_t logit_rows;          /* min(params.logit_rows, chunk): most logit rows per call */
    int32_t rerank_lanes;        /* most lanes of a /rerank sequence (fitm_rerank_lanes) */
    fitm_score_opts defaults;    /* every option set: built-in < params->defaults */
    fitm_answer_defaults answer; /* every one set: built-in < params->answer */
    double paper_temperature;
    char *answer_text; /* the answer template, unescaped and cut at {documents} */
    fitm_rerank_frame answer_frame;
    char *answer_stop[1]; /* the answer template's stop string; [0] NULL: none */
    char profile[256];
    const struct fitm_moice *moice; /* NULL: none */
    fitm_position_method position_default;
};

/* ---- prompt.c ------------------------------------------------------------------------------ */

/* A growable list of token ids. */
typedef struct {
    int32_t *v;
    int64_t n, cap;
} fitm_ids;

/* Room for more ids. */
fitm_status fitm_ids_reserve(fitm_ids *a, int64_t more, fitm_err *err);

/* Tokenizes text[0..len) and appends at most keep ids (keep < 0: all). */
fitm_status fitm_prompt_encode(const fitm_tokenizer *tok, fitm_ids *a, const char *text, size_t len,
                               uint32_t flags, int64_t keep, fitm_err *err);

/* The chat template `want` names ("auto": the one whose marker the model's template holds
 * and the vocabulary has; raw when none). */
const fitm_chat_template *fitm_prompt_template(const fitm_model *m, const fitm_tokenizer *tok,
                                               const char *want);

/* Whether t is raw (no template: a base model's prompt). */
bool fitm_prompt_template_raw(const fitm_chat_template *t);

/* How many tokens of a document's text to keep: max_tokens_per_doc, or all of them when a
 * longer document is refused instead (no_truncate, checked by fitm_prompt_doc_fits). */
int64_t fitm_prompt_doc_keep(const fitm_rerank_request *req);

/* FITM_ERR_LIMIT naming document k when the request refuses to cut it and its n tokens are
 * over max_tokens_per_doc. */
fitm_status fitm_prompt_doc_fits(const fitm_rerank_request *req, int32_t k, int64_t n,
                                 fitm_err *err);

/* Appends document k's body: " " + text, cut to max_tokens_per_doc (or refused past it:
 * fitm_prompt_doc_fits). */
fitm_status fitm_prompt_body(const fitm_session *r, const fitm_rerank_request *req, int32_t k,
                             fitm_ids *a, fitm_err *err);

/* The texts that replace {question}: in the frame's `before` and in its `after`. */
typedef struct {
    const char *head, *tail;
    size_t head_len, tail_len;
} fitm_prompt_queries;

/* The prompt of frame f (NULL: the default) for the n documents order[0..n) (NULL: request
 * order, n = K): ids, the body span of the document at each position, and the span of the
 * last {question} of f->after (question may be NULL). */
fitm_status fitm_prompt_build(const fitm_session *r, const fitm_rerank_request *req,
                              const fitm_rerank_frame *f, const int32_t *order, int32_t n,
                              const fitm_prompt_queries *q, fitm_ids *ids, fitm_span *spans,
                              fitm_span *question, fitm_err *err);

/* FITM_ERR_CONTEXT for a prompt of T tokens over the context. */
fitm_status fitm_prompt_too_long(int64_t T, const fitm_session *r, const fitm_rerank_request *req,
                                 fitm_err *err);

/* Bounds the prompts of frame f (NULL: the default) with the queries q (NULL: the request's)
 * over req's documents split into the G groups starts[0..G] (fitm_score_groups), in any order
 * within and across the groups: each group's prompt is at most *frame (the frame alone, exact)
 * plus its documents' part, and the documents' parts of all groups add up to at most *docs
 * (exact when every document has the same title). */
fitm_status fitm_prompt_bound(const fitm_session *r, const fitm_rerank_request *req,
                              const fitm_rerank_frame *f, const fitm_prompt_queries *q,
                              const int32_t *starts, int32_t G, int64_t *frame, int64_t *docs,
                              fitm_err *err);

/* ---- passes.c ------------------------------------------------------------------------------ */

typedef bool (*fitm_stop_fn)(const void *);

/* One forward pass of a rerank, as the method asks for it: ids at positions [pos0, pos0 + n)
 * on kv (a branch of prefix when non-NULL), capturing cap's rows, n_logits logit rows at the
 * end, each row's log-probabilities at its n_pick ids (pick, (n_logits, n_pick) host) into
 * logprob ((n_logits, n_pick) host, the method's; computed on the backend: no logit row
 * leaves it), on path, running layers [0, n_layers) (0: all) under method position. */
typedef struct {
    fitm_kv *kv;
    const fitm_kv *prefix;
    const int32_t *ids;
    int64_t n, pos0;
    const fitm_capture *cap;
    int64_t n_logits;
    int32_t n_pick;
    const int32_t *pick;
    double *logprob;
    int32_t n_layers;
    fitm_forward_path path;
    fitm_position_method position;
} fitm_pass;

/* A request's passes: where they run and how, built for each request (fitm_rerank_run, or a
 * sequence of the batch) and passed down to the method; nothing of it is written on the
 * session. A sequence's run may have several lanes, each with caches of its own, working
 * through its share of the request's windows or documents (fitm_passes_share) side by side;
 * a whole run has one. */
typedef struct {
    fitm_session *s;
    int32_t n_lanes; /* 1 .. FITM_SESSION_LANES_MAX */
    /* lane l's prompt cache and its one reference branch over it (NULL for a method without
     * reference passes); lane 0's are the whole run's */
    fitm_kv *kv[FITM_SESSION_LANES_MAX], *branch[FITM_SESSION_LANES_MAX];
    fitm_position_method position; /* the request's method (checked) */
    fitm_forward_path path;        /* rerank_path, or answer_path for an answer's scoring */
    /* > 0 while an attention method runs: the passes without logits stop after this many
     * layers (every layer it reads: fitm_layers_last); 0: every layer. */
    int32_t n_layers;
    bool all_layers;   /* an answer continues the rows: every pass runs every layer */
    fitm_stop_fn stop; /* polled between forward calls (NULL: never) */
    const void *stop_arg;
} fitm_passes;

/* ps for req on n_lanes lanes whose caches are kv[l] and branch[l] (the session's own for a
 * whole run, one lane; branch may be NULL, or hold NULLs, for a method without reference
 * passes): the request's position method (checked as fitm_session_position checks it), its
 * path and layers. */
fitm_status fitm_passes_init(fitm_passes *ps, fitm_session *s, const fitm_rerank_request *req,
                             int32_t n_lanes, fitm_kv *const *kv, fitm_kv *const *branch,
                             fitm_err *err);

/* Lane l's share of n units (windows or documents) among n_lanes lanes: the contiguous block
 * [*lo, *hi) = [l n / n_lanes, (l + 1) n / n_lanes). The blocks cover [0, n) in order, each
 * unit once; with n_lanes >= n each lane has at most one unit. */
void fitm_passes_share(int32_t n, int32_t n_lanes, int32_t l, int32_t *lo, int32_t *hi);

/* The pass of ids at positions [pos0, pos0 + n) on kv (a branch of prefix when non-NULL) for
 * ps: cap (may be NULL) lists rows in ascending order; n_logits (at most the session's
 * logit_rows) logit rows at the end, their log-probabilities at n_pick (at most
 * FITM_PICK_MAX) ids each, pick, into logprob; without logits, only layers [0, ps->n_layers)
 * when that is set. */
fitm_pass fitm_passes_pass(const fitm_passes *ps, fitm_kv *kv, const fitm_kv *prefix,
                           const int32_t *ids, int64_t n, int64_t pos0, const fitm_capture *cap,
                           int64_t n_logits, int32_t n_pick, const int32_t *pick,
                           double *logprob);

/* Runs pass p here, in chunks on the session's forward: each chunk captures the rows it holds
 * (span_mass and probs offset accordingly) and writes the log-probabilities of the logit rows
 * it holds into p->logprob. */
fitm_status fitm_passes_run_pass(fitm_passes *ps, const fitm_pass *p, fitm_err *err);

/* fitm_passes_run_pass of fitm_passes_pass(ps, kv, prefix, ids, n, pos0, cap, 0, 0, NULL,
 * NULL). */
fitm_status fitm_passes_run(fitm_passes *ps, fitm_kv *kv, const fitm_kv *prefix, const int32_t *ids,
                            int64_t n, int64_t pos0, const fitm_capture *cap, fitm_err *err);

/* A method's run as a state machine of passes, whatever the method (the attention methods,
 * query_likelihood, relevance, fused: rerank_methods.h), with a pass posted per lane of its
 * passes (fitm_passes.n_lanes): next readies lane's next pass (*pass, valid until ran on that
 * lane; NULL once the lane has no more work, and then on every later call for it), which its
 * owner runs -- here (fitm_machine_run, one lane), or chunk by chunk in the engine's batch
 * steps (rerank_seq.c), the lanes' passes side by side -- and reports with ran. The call of
 * next that finds the last lane drained makes the result (the steps over all K documents).
 * end (exactly once, also after a failed start) fills the result's usage and timings, frees,
 * and returns st. */
typedef struct {
    void *run;
    fitm_status (*next)(void *run, int32_t lane, const fitm_pass **pass, fitm_err *err);
    void (*ran)(void *run, int32_t lane);
    fitm_status (*end)(void *run, fitm_status st);
} fitm_machine;

/* A whole run (ps has one lane): m's passes run here one after another, then m ends with the
 * status. st: how m's start went. */
fitm_status fitm_machine_run(fitm_passes *ps, fitm_machine *m, fitm_status st, fitm_err *err);

/* The logit rows of pass p among its rows [from, from + n): how many (they end the part), and
 * which of p's logit rows the first one is (*at: its picks at p->pick + *at * p->n_pick). */
int64_t fitm_pass_logit_rows(const fitm_pass *p, int64_t from, int64_t n, int64_t *at);

/* Keeps the record of a cache's rows (ids[0..*n_ids): the ids of the rows [0, *n_ids) a later
 * /answer may continue, fitm_session_cached) true after p's rows [from, from + n) ran on that
 * cache: the rows from there on are p's, and they are recorded when p computes every layer on
 * the answer path without a prefix and continues the recorded rows. ids has room for p's. */
void fitm_pass_record(const fitm_session *s, const fitm_pass *p, int64_t from, int64_t n,
                      int32_t *ids, int64_t *n_ids);

/* The sub-capture of cap for the rows in [pos0, pos0 + n) (NULL when none are). */
const fitm_capture *fitm_passes_capture_part(const fitm_session *s, const fitm_capture *cap,
                                             int64_t pos0, int64_t n, fitm_capture *part);

/* Layer l of a request or config list (negative = from the end: -1 the last) as an index of
 * the session's model; outside [0, L) when the model has no such layer. */
static inline int32_t fitm_layer_index(const fitm_session *r, int32_t l)
{
    return l < 0 ? r->L + l : l;
}

/* The layers given (negative = from the end) into use (L flags), or, with n = 0, every layer
 * that sees the whole context (all layers for models without sliding windows). A layer the
 * model lacks is FITM_ERR_INVALID naming the request field `name` ("layers") and its index. */
fitm_status fitm_layers_choose(const fitm_session *r, const char *name, const int32_t *layers,
                               int32_t n, uint8_t *use, fitm_err *err);

/* 1 + the last of the L flags of use that is set (0 when none is): the layers a pass whose
 * capture is read only in those layers must run. */
int32_t fitm_layers_last(const fitm_session *r, const uint8_t *use);

/* Sorts results by relevance_score descending, ties by index. */
void fitm_results_sort(fitm_rerank_doc_result *res, int32_t K);

#endif
