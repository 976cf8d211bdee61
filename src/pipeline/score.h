/* score: the scoring options of calibrated attention (one struct, shared by requests, the
 * config defaults and the model's profile, all spelling each option the same way), their
 * text form, and the pure math that turns document attention into scores: the calibration
 * form, the window groups, the weights (alpha) and relevance_score. Also the methods' wire
 * names and /answer's server defaults, which the config and the profile carry too. No model,
 * no I/O.
 *
 * An option is "unset" (-1 for enums and counts, NAN for reals, NULL for lists) until a layer
 * sets it; fitm_score_opts_overlay stacks layers (built-in < profile < config < request).
 *
 * Legend: K documents, L layers, H heads. */
#ifndef FITM_SCORE_H
#define FITM_SCORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef enum { FITM_ROWS_LAST = 0, FITM_ROWS_QUESTION, FITM_ROWS_SUFFIX } fitm_score_rows;
typedef enum { FITM_AGG_SUM = 0, FITM_AGG_MEAN } fitm_score_aggregate;
typedef enum {
    FITM_REF_NONE = 0,
    FITM_REF_DUMMY,       /* one length-matched dummy pass per document (the paper's)      */
    FITM_REF_NULL_QUERY,  /* one pass with the query replaced by "N/A" in both places      */
    FITM_REF_NULL_SUFFIX, /* one pass with only the trailing query replaced, from the cache */
    FITM_REF_BOTH         /* dummy and null_query, averaged                                */
} fitm_score_reference;
typedef enum { FITM_DUMMY_FIXED = 0, FITM_DUMMY_DOCUMENTS } fitm_score_dummy_source;
typedef enum { FITM_FORM_DIFFERENCE = 0, FITM_FORM_LOG_RATIO } fitm_score_form;
/* The question before the documents in the scored prompts: the request's query (the paper's
 * prompt) or "N/A", so that the trailing question's rows find it only in the documents. */
typedef enum { FITM_HEAD_QUERY = 0, FITM_HEAD_NULL } fitm_score_head_query;
/* What query likelihood (and fused) scores of a document: its whole text, or the best of the
 * whole text and of its first sentence joined to each later one (rerank_per_doc.c). */
typedef enum { FITM_PASSAGES_WHOLE = 0, FITM_PASSAGES_SENTENCES } fitm_score_passages;

/* Method fused's built-in w (docs/scoring.md, chosen on the dev split), and its
 * relevance_score = sigmoid(FITM_FUSE_SCALE x score + FITM_FUSE_BIAS): a logistic regression
 * of "is the gold" on the default model's fused scores of the dev splits
 * (tests/quality/fuse_sweep.py --fit). */
#define FITM_FUSE_WEIGHT 0.02
#define FITM_FUSE_SCALE 3.06908
#define FITM_FUSE_BIAS 6.35162

/* Longest `layers` or `heads` list. */
#define FITM_SCORE_MAX_LIST 512
/* eps of the log_ratio form. */
#define FITM_SCORE_LOG_EPS 1e-9

typedef struct {
    int32_t rows;         /* fitm_score_rows                                               */
    int32_t *layers;      /* (n_layers) owned; negative = from the end                     */
    int32_t n_layers;
    int32_t *heads;       /* (2 * n_heads) owned: layer, head pairs; overrides layers      */
    int32_t n_heads;
    int32_t aggregate;    /* fitm_score_aggregate                                          */
    int32_t skip_first;   /* >= 0 tokens at the start of each document not counted         */
    int32_t reference;    /* fitm_score_reference                                          */
    int32_t dummy_source; /* fitm_score_dummy_source                                       */
    int32_t form;         /* fitm_score_form                                               */
    int32_t head_query;   /* fitm_score_head_query                                         */
    double sink_factor;   /* 0 = off; f > 0: tokens over f x the span's mean reference
                             attention are left out                                         */
    int32_t window;       /* 0 = off; W > 0: groups of about W documents                   */
    double temperature;   /* > 0: weight = softmax(rel_scaled / temperature)               */
    double score_scale;   /* relevance_score = sigmoid(score_scale * rel_scaled + bias)   */
    double score_bias;
    double fuse_weight;   /* >= 0: method fused's w (rerank_per_doc.c)                    */
    double fuse_scale;    /* > 0: fused's relevance_score = sigmoid(fuse_scale * score    */
    double fuse_bias;     /*      + fuse_bias), score its raw_score                         */
    int32_t *fuse_layers; /* (n_fuse_layers) owned: method fused's attention layers;
                             negative = from the end                                        */
    int32_t n_fuse_layers;
    int32_t passages;     /* fitm_score_passages: query likelihood's and fused's passages  */
} fitm_score_opts;

/* Every option unset. */
void fitm_score_opts_init(fitm_score_opts *o);

/* Releases the lists and leaves o unset. NULL is a no-op. */
void fitm_score_opts_free(fitm_score_opts *o);

/* Copies every option set in src over dst (lists deep-copied). FITM_ERR_NOMEM only. */
fitm_status fitm_score_opts_overlay(fitm_score_opts *dst, const fitm_score_opts *src,
                                    fitm_err *err);

/* The built-in defaults for a model of L layers into *o (overwritten, not freed; every option
 * set): rows question, the
 * layers at 28-44% of the depth (5, 6, 7 of 18), sum, skip_first 0, null_suffix, fixed
 * dummy, difference, the query as the head's question, no sinks, no windows, temperature
 * 0.05, and score_scale = 1 /
 * temperature, score_bias 0 (so relevance_score orders exactly like weight), fuse_weight
 * FITM_FUSE_WEIGHT, fuse_scale FITM_FUSE_SCALE, fuse_bias FITM_FUSE_BIAS, fuse_layers the
 * first layer (0). */
fitm_status fitm_score_opts_builtin(fitm_score_opts *o, int32_t L, fitm_err *err);

/* Whether name is one of the option keys ("rows", "layers", ...). */
bool fitm_score_is_key(const char *name);

/* Sets option `name` from its text form (the config/profile syntax): enum names, integers,
 * reals, `layers = 3,4,-1`, `heads = 5:1,11:0`. The empty text unsets it. Errors
 * (FITM_ERR_INVALID) name the option and the value; FITM_ERR_NOT_FOUND for an unknown key. */
fitm_status fitm_score_opts_set(fitm_score_opts *o, const char *name, const char *text,
                                fitm_err *err);

/* Wire names of the enum values; "unknown" out of range. */
const char *fitm_score_rows_name(int32_t v);
const char *fitm_score_aggregate_name(int32_t v);
const char *fitm_score_reference_name(int32_t v);
const char *fitm_score_dummy_source_name(int32_t v);
const char *fitm_score_form_name(int32_t v);
const char *fitm_score_head_query_name(int32_t v);
const char *fitm_score_passages_name(int32_t v);

/* Parses an enum option's value by option name ("rows", "aggregate", "reference",
 * "dummy_source", "form"); -1 when the name or the value is unknown. */
int32_t fitm_score_enum_parse(const char *option, const char *value);

/* The '|'-separated choices of an enum option ("" for other names). */
const char *fitm_score_enum_choices(const char *option);

/* ---- the methods and /answer's defaults ------------------------------------------------ */

typedef enum {
    FITM_RERANK_CALIBRATED = 0, /* attention scored with the scoring options (default)     */
    FITM_RERANK_ATTENTION,      /* the same options with no reference: uncalibrated A      */
    FITM_RERANK_ATTENTION_SORT, /* Peysakhovich & Lerer: attention mass, sort, repeat      */
    FITM_RERANK_QUERY_LIKELIHOOD, /* LongLLMLingua r_k                                     */
    FITM_RERANK_RELEVANCE,      /* yes/no prompting                                        */
    FITM_RERANK_PAPER,          /* the paper's recipe: last row, K dummy passes, mean,
                                   difference, alpha = softmax(rel / t)                    */
    FITM_RERANK_FUSED,          /* query likelihood + fuse_weight x z(the question's
                                   attention to the document in the same pass)             */
    FITM_RERANK_METHOD_COUNT
} fitm_rerank_method;

/* The method's wire name ("calibrated", ...); "unknown" out of range. */
const char *fitm_rerank_method_name(fitm_rerank_method m);

/* Parses a wire name; -1 when unknown. */
int fitm_rerank_method_parse(const char *s);

/* /answer's server defaults for the options a request leaves out (answer.h's calibrate,
 * reorder, reorder_placement, top_n), and /rerank's method for a request that names none: the
 * profile's under the config's, FITM_ANSWER_UNSET where neither says; the session fills what
 * is still unset with the built-in ones (calibrate, no reorder, first, every document; the
 * server: method calibrated). */
#define FITM_ANSWER_UNSET (-2)
typedef struct {
    int32_t calibrate;    /* 1 | 0                                           */
    int32_t reorder;      /* -1: none; else a fitm_rerank_method             */
    int32_t reorder_last; /* 1: the most relevant last; 0: first             */
    int32_t rerank_method; /* a fitm_rerank_method                            */
    int32_t top_n;        /* >= 1: answer from the top_n best documents; 0: all */
} fitm_answer_defaults;

/* Every default unset. */
void fitm_answer_defaults_init(fitm_answer_defaults *d);

/* Whether name is one of their config and profile keys: answer_calibrate (true | false),
 * answer_reorder (none | a /rerank method), answer_reorder_placement (first | last),
 * answer_top_n (0 = every document, else 1 .. FITM_ANSWER_MAX_TOP_N), rerank_method (a /rerank
 * method). */
#define FITM_ANSWER_MAX_TOP_N 100000
bool fitm_answer_defaults_is_key(const char *name);

/* Sets key `name` from its text; the empty text unsets it. FITM_ERR_INVALID names the key,
 * the value and the choices; FITM_ERR_NOT_FOUND for another name. */
fitm_status fitm_answer_defaults_set(fitm_answer_defaults *d, const char *name, const char *text,
                                     fitm_err *err);

/* Copies every default set in src over dst. */
void fitm_answer_defaults_overlay(fitm_answer_defaults *dst, const fitm_answer_defaults *src);

/* ---- the math ---------------------------------------------------------------------------- */

/* rel of one document: A - A_ref (difference) or ln(A + eps) - ln(A_ref + eps). */
double fitm_score_rel(int32_t form, double A, double A_ref);

/* Splits K documents (request order) into ceil(K / W) consecutive groups whose sizes differ
 * by at most one (one group when W <= 0 or W >= K); writes n_groups + 1 boundaries into
 * starts (room for K + 1) and returns n_groups. */
int32_t fitm_score_groups(int32_t K, int32_t W, int32_t *starts);

/* weight[k] = softmax(x / t) over K values (t > 0). */
void fitm_score_softmax(const double *x, int32_t K, double t, double *weight);

/* sigmoid(scale * x + bias), in [0, 1]. */
double fitm_score_sigmoid(double x, double scale, double bias);

/* One document's A and A_ref from per-token attention a (N) and a_ref (N, may be NULL: no
 * reference, A_ref = 0): tokens i < skip_first are not counted, nor (sink_factor > 0 and
 * a_ref) tokens with a_ref[i] > sink_factor x the mean of a_ref over the counted tokens.
 * sum or mean over what is counted (mean 0 when nothing is). */
void fitm_score_reduce(const double *a, const double *a_ref, int64_t N, int32_t skip_first,
                       double sink_factor, int32_t aggregate, double *A, double *A_ref);

#endif
