/* rerank_internal: what the reranker's own files share (rerank.c: the reranker, its prompt,
 * the per-document and attention_sort methods; rerank_attn.c: the attention methods with
 * their scoring options). Not for other modules: they use rerank.h. */
#ifndef FITM_RERANK_INTERNAL_H
#define FITM_RERANK_INTERNAL_H

#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "pipeline/rerank.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *name;
    const char *marker; /* in tokenizer.chat_template, and a token of the vocabulary */
    const char *head;   /* before the user's content (control tokens parsed)          */
    const char *tail;   /* after it, up to where the model's answer starts            */
} fitm_rr_template;

struct fitm_reranker {
    const fitm_model *m;
    const fitm_tokenizer *tok;
    fitm_backend *b;
    fitm_forward *fwd;
    fitm_kv *kv;     /* the prompt's cache, [0, T)            */
    fitm_kv *branch; /* one reference pass: [s_k, T) on kv    */
    int64_t n_ctx, chunk;
    fitm_forward_path answer_path, rerank_path; /* of /answer's prompts, of /rerank's passes */
    const fitm_rr_template *tmpl;
    int32_t *dummy;  /* default dummy ids (" " + dummy_text)  */
    int64_t n_dummy;
    int32_t L, H, V;
    int64_t logit_rows; /* min(LOGIT_ROWS, chunk)                                  */
    float *logits;   /* (logit_rows, V) host, for query_likelihood and relevance */
    fitm_score_opts defaults; /* every option set: built-in < params->defaults        */
    fitm_answer_defaults answer; /* every one set: built-in < params->answer           */
    double paper_temperature;
    int32_t *kv_ids; /* (n_ctx) the ids whose rows kv holds: [0, kv_n)            */
    int64_t kv_n;
    char *answer_text;   /* the answer template, unescaped and cut at {documents} */
    fitm_rerank_frame answer_frame;
    char *answer_stop[1]; /* the answer template's stop string; [0] NULL: none         */
    char profile[256];
    /* A sequence's view of the reranker (fitm_rerank_begin): the same model and options with
     * caches of its own; fitm_rr_run hands its passes to seq instead of running them. NULL
     * for the reranker itself. */
    struct fitm_rerank_seq *seq;
    const struct fitm_moice *moice;     /* NULL: none                                  */
    fitm_position_method position_default;
    fitm_position_method position;      /* of the current request's passes (and kv's)  */
    /* > 0 while an attention method runs: the passes without logits stop after this many
     * layers (every layer it reads: fitm_rr_last_layer); 0: every layer. */
    int32_t run_layers;
    /* The path of the current request's passes: rerank_path, or answer_path for an /answer's
     * scoring (fitm_rerank_request.answer_scoring); and whether they run every layer, so
     * that the answer may continue their rows (set by fitm_reranker_run). */
    fitm_forward_path run_path;
    bool run_all_layers;
};

typedef struct {
    int32_t *v;
    int64_t n, cap;
} fitm_rr_ids;

typedef bool (*fitm_rr_stop)(const void *);

/* Room for more ids. */
fitm_status fitm_rr_reserve(fitm_rr_ids *a, int64_t more, fitm_err *err);

/* Tokenizes text[0..len) and appends at most keep ids (keep < 0: all). */
fitm_status fitm_rr_encode(const fitm_tokenizer *tok, fitm_rr_ids *a, const char *text,
                           size_t len, uint32_t flags, int64_t keep, fitm_err *err);

/* Appends document k's body: " " + text, cut to max_tokens_per_doc. */
fitm_status fitm_rr_body(const fitm_reranker *r, const fitm_rerank_request *req, int32_t k,
                         fitm_rr_ids *a, fitm_err *err);

/* The texts that replace {question}: in the frame's `before` and in its `after`. */
typedef struct {
    const char *head, *tail;
    size_t head_len, tail_len;
} fitm_rr_queries;

/* The prompt of frame f (NULL: the default) for the n documents order[0..n) (NULL: request
 * order, n = K): ids, the body span of the document at each position, and the span of the
 * last {question} of f->after (question may be NULL). */
fitm_status fitm_rr_build_prompt(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const fitm_rerank_frame *f, const int32_t *order, int32_t n,
                                 const fitm_rr_queries *q, fitm_rr_ids *ids, fitm_span *spans,
                                 fitm_span *question, fitm_err *err);

/* Runs ids at positions [pos0, pos0 + n) on kv (a branch of prefix when non-NULL) in chunks
 * on r->run_path. cap (may be NULL) lists rows in ascending order; each chunk captures the
 * rows it holds (span_mass and probs offset accordingly). n_logits logit rows of the last
 * chunk go to r->logits. Without logits, only layers [0, r->run_layers) when that is set. */
fitm_status fitm_rr_run(fitm_reranker *r, fitm_kv *kv, const fitm_kv *prefix, const int32_t *ids,
                        int64_t n, int64_t pos0, const fitm_capture *cap, int64_t n_logits,
                        fitm_rr_stop stop, const void *stop_arg, fitm_err *err);

fitm_status fitm_rr_too_long(int64_t T, const fitm_reranker *r, const fitm_rerank_request *req,
                             fitm_err *err);

/* The layers given (negative = from the end) into use (L flags), or, with n = 0, every layer
 * that sees the whole context (all layers for models without sliding windows). */
fitm_status fitm_rr_layers(const fitm_reranker *r, const int32_t *layers, int32_t n, uint8_t *use,
                           fitm_err *err);

/* 1 + the last of the L flags of use that is set (0 when none is): the layers a pass whose
 * capture is read only in those layers must run. */
int32_t fitm_rr_last_layer(const fitm_reranker *r, const uint8_t *use);

/* Sorts results by relevance_score descending, ties by index. */
void fitm_rr_sort(fitm_rerank_doc_result *res, int32_t K);

double fitm_rr_now_ms(void);

/* The attention methods: calibrated, attention, paper (rerank_attn.c). */
fitm_status fitm_rr_run_attention(fitm_reranker *r, const fitm_rerank_request *req,
                                  fitm_rr_stop stop, const void *stop_arg,
                                  fitm_rerank_result *res, fitm_err *err);

/* The forward tokens fitm_rr_run_attention computes for req: exactly, or (any_order: the
 * documents in an order not known yet) at most this. Fails as the run would for options,
 * layers or heads the model does not have and for a prompt over the context (exact only). */
fitm_status fitm_rr_attention_cost(const fitm_reranker *r, const fitm_rerank_request *req,
                                   bool any_order, int64_t *tokens, fitm_err *err);

/* The most rows any prompt of fitm_rr_run_attention for req can have (its caches' size): the
 * prompt of all documents in any order with the request's query or (a null reference) the
 * content-free one, at most n_ctx. */
fitm_status fitm_rr_attention_rows(const fitm_reranker *r, const fitm_rerank_request *req,
                                   int64_t *rows, fitm_err *err);

/* Bounds the prompts of frame f (NULL: the default) with the queries q (NULL: the request's)
 * over req's documents split into the G groups starts[0..G] (fitm_score_groups), in any order
 * within and across the groups: each group's prompt is at most *frame (the frame alone, exact)
 * plus its documents' part, and the documents' parts of all groups add up to at most *docs
 * (exact when every document has the same title). */
fitm_status fitm_rr_prompt_bound(const fitm_reranker *r, const fitm_rerank_request *req,
                                 const fitm_rerank_frame *f, const fitm_rr_queries *q,
                                 const int32_t *starts, int32_t G, int64_t *frame,
                                 int64_t *docs, fitm_err *err);

#endif
