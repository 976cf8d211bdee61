/* score: scoring options and math (see score.h). */
#include "pipeline/score.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const rows_names[] = {"last", "question", "suffix", NULL};
static const char *const aggregate_names[] = {"sum", "mean", NULL};
static const char *const reference_names[] = {"none", "dummy", "null_query", "null_suffix",
                                              "both", NULL};
static const char *const dummy_source_names[] = {"fixed", "documents", NULL};
static const char *const form_names[] = {"difference", "log_ratio", NULL};
static const char *const head_query_names[] = {"query", "null", NULL};
static const char *const passages_names[] = {"whole", "sentences", NULL};

typedef enum { KEY_ENUM, KEY_INT, KEY_REAL, KEY_LAYERS, KEY_HEADS } key_kind;

typedef struct {
    const char *name;
    key_kind kind;
    size_t offset;
    const char *const *names; /* KEY_ENUM                           */
    const char *choices;      /* KEY_ENUM, '|'-separated            */
    double min, max;          /* KEY_INT / KEY_REAL, inclusive      */
} key_def;

#define OFF(f) offsetof(fitm_score_opts, f)
static const key_def keys[] = {
    {"rows", KEY_ENUM, OFF(rows), rows_names, "last|question|suffix", 0, 0},
    {"layers", KEY_LAYERS, OFF(layers), NULL, NULL, 0, 0},
    {"heads", KEY_HEADS, OFF(heads), NULL, NULL, 0, 0},
    {"aggregate", KEY_ENUM, OFF(aggregate), aggregate_names, "sum|mean", 0, 0},
    {"skip_first", KEY_INT, OFF(skip_first), NULL, NULL, 0, 1000000},
    {"reference", KEY_ENUM, OFF(reference), reference_names,
     "none|dummy|null_query|null_suffix|both", 0, 0},
    {"dummy_source", KEY_ENUM, OFF(dummy_source), dummy_source_names, "fixed|documents", 0, 0},
    {"form", KEY_ENUM, OFF(form), form_names, "difference|log_ratio", 0, 0},
    {"head_query", KEY_ENUM, OFF(head_query), head_query_names, "query|null", 0, 0},
    {"sink_factor", KEY_REAL, OFF(sink_factor), NULL, NULL, 0, 1e6},
    {"window", KEY_INT, OFF(window), NULL, NULL, 0, 4096},
    {"temperature", KEY_REAL, OFF(temperature), NULL, NULL, 1e-12, 1e6},
    {"score_scale", KEY_REAL, OFF(score_scale), NULL, NULL, -1e12, 1e12},
    {"score_bias", KEY_REAL, OFF(score_bias), NULL, NULL, -1e12, 1e12},
    {"fuse_weight", KEY_REAL, OFF(fuse_weight), NULL, NULL, 0, 1e6},
    {"fuse_scale", KEY_REAL, OFF(fuse_scale), NULL, NULL, 1e-12, 1e12},
    {"fuse_bias", KEY_REAL, OFF(fuse_bias), NULL, NULL, -1e12, 1e12},
    {"fuse_layers", KEY_LAYERS, OFF(fuse_layers), NULL, NULL, 0, 0},
    {"passages", KEY_ENUM, OFF(passages), passages_names, "whole|sentences", 0, 0},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].name, name))
            return &keys[i];
    return NULL;
}

static const char *name_of(const char *const *names, int32_t v)
{
    for (int32_t i = 0; names[i]; i++)
        if (i == v)
            return names[i];
    return "unknown";
}

const char *fitm_score_rows_name(int32_t v) { return name_of(rows_names, v); }
const char *fitm_score_aggregate_name(int32_t v) { return name_of(aggregate_names, v); }
const char *fitm_score_reference_name(int32_t v) { return name_of(reference_names, v); }
const char *fitm_score_dummy_source_name(int32_t v) { return name_of(dummy_source_names, v); }
const char *fitm_score_form_name(int32_t v) { return name_of(form_names, v); }
const char *fitm_score_head_query_name(int32_t v) { return name_of(head_query_names, v); }
const char *fitm_score_passages_name(int32_t v) { return name_of(passages_names, v); }

int32_t fitm_score_enum_parse(const char *option, const char *value)
{
    const key_def *k = find_key(option);
    if (!k || k->kind != KEY_ENUM)
        return -1;
    for (int32_t i = 0; k->names[i]; i++)
        if (!strcmp(k->names[i], value))
            return i;
    return -1;
}

const char *fitm_score_enum_choices(const char *option)
{
    const key_def *k = find_key(option);
    return k && k->kind == KEY_ENUM ? k->choices : "";
}

static const char *method_names[FITM_RERANK_METHOD_COUNT] = {
    [FITM_RERANK_CALIBRATED] = "calibrated",
    [FITM_RERANK_ATTENTION] = "attention",
    [FITM_RERANK_ATTENTION_SORT] = "attention_sort",
    [FITM_RERANK_QUERY_LIKELIHOOD] = "query_likelihood",
    [FITM_RERANK_RELEVANCE] = "relevance",
    [FITM_RERANK_PAPER] = "paper",
    [FITM_RERANK_FUSED] = "fused",
};

const char *fitm_rerank_method_name(fitm_rerank_method m)
{
    if ((unsigned)m >= FITM_RERANK_METHOD_COUNT)
        return "unknown";
    return method_names[m];
}

int fitm_rerank_method_parse(const char *s)
{
    for (int i = 0; i < FITM_RERANK_METHOD_COUNT; i++)
        if (!strcmp(s, method_names[i]))
            return i;
    return -1;
}

void fitm_answer_defaults_init(fitm_answer_defaults *d)
{
    *d = (fitm_answer_defaults){FITM_ANSWER_UNSET, FITM_ANSWER_UNSET, FITM_ANSWER_UNSET,
                                FITM_ANSWER_UNSET, FITM_ANSWER_UNSET};
}

bool fitm_answer_defaults_is_key(const char *name)
{
    return !strcmp(name, "answer_calibrate") || !strcmp(name, "answer_reorder") ||
           !strcmp(name, "answer_reorder_placement") || !strcmp(name, "answer_top_n") ||
           !strcmp(name, "rerank_method");
}

/* answer_top_n's text: 0 (every document) or a count of documents. */
static fitm_status top_n_set(int32_t *field, const char *name, const char *text, fitm_err *err)
{
    char *end = NULL;
    errno = 0;
    long n = strtol(text, &end, 10);
    if (errno || end == text || *end || n < 0 || n > FITM_ANSWER_MAX_TOP_N)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "%s = '%.100s': must be 0 (every document) or a count of documents, "
                            "1 to %d",
                            name, text, FITM_ANSWER_MAX_TOP_N);
    *field = (int32_t)n;
    return FITM_OK;
}

fitm_status fitm_answer_defaults_set(fitm_answer_defaults *d, const char *name, const char *text,
                                     fitm_err *err)
{
    int32_t *field = !strcmp(name, "answer_calibrate")           ? &d->calibrate
                     : !strcmp(name, "answer_reorder")           ? &d->reorder
                     : !strcmp(name, "answer_reorder_placement") ? &d->reorder_last
                     : !strcmp(name, "answer_top_n")             ? &d->top_n
                     : !strcmp(name, "rerank_method")            ? &d->rerank_method
                                                                 : NULL;
    if (!field)
        return fitm_err_set(err, FITM_ERR_NOT_FOUND, "'%.100s' is not an /answer default", name);
    if (!*text) {
        *field = FITM_ANSWER_UNSET;
        return FITM_OK;
    }
    const int BAD = -3;
    int v;
    const char *choices;
    if (field == &d->top_n)
        return top_n_set(field, name, text, err);
    if (field == &d->calibrate) {
        v = !strcmp(text, "true") ? 1 : !strcmp(text, "false") ? 0 : BAD;
        choices = "true, false";
    } else if (field == &d->rerank_method) {
        int m = fitm_rerank_method_parse(text);
        v = m >= 0 ? m : BAD;
        choices = "calibrated, attention, attention_sort, query_likelihood, relevance, paper, "
                  "fused";
    } else if (field == &d->reorder) {
        int m = fitm_rerank_method_parse(text);
        v = !strcmp(text, "none") ? -1 : m >= 0 ? m : BAD;
        choices = "none, calibrated, attention, attention_sort, query_likelihood, relevance, "
                  "paper, fused";
    } else {
        v = !strcmp(text, "last") ? 1 : !strcmp(text, "first") ? 0 : BAD;
        choices = "first, last";
    }
    if (v == BAD)
        return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': must be one of %s", name, text,
                            choices);
    *field = v;
    return FITM_OK;
}

void fitm_answer_defaults_overlay(fitm_answer_defaults *dst, const fitm_answer_defaults *src)
{
    if (src->calibrate != FITM_ANSWER_UNSET)
        dst->calibrate = src->calibrate;
    if (src->reorder != FITM_ANSWER_UNSET)
        dst->reorder = src->reorder;
    if (src->reorder_last != FITM_ANSWER_UNSET)
        dst->reorder_last = src->reorder_last;
    if (src->rerank_method != FITM_ANSWER_UNSET)
        dst->rerank_method = src->rerank_method;
    if (src->top_n != FITM_ANSWER_UNSET)
        dst->top_n = src->top_n;
}

bool fitm_score_is_key(const char *name)
{
    return find_key(name) != NULL;
}

void fitm_score_opts_init(fitm_score_opts *o)
{
    *o = (fitm_score_opts){.rows = -1, .aggregate = -1, .skip_first = -1, .reference = -1,
                           .dummy_source = -1, .form = -1, .head_query = -1, .passages = -1,
                           .sink_factor = NAN, .window = -1,
                           .temperature = NAN, .score_scale = NAN, .score_bias = NAN,
                           .fuse_weight = NAN, .fuse_scale = NAN, .fuse_bias = NAN};
}

void fitm_score_opts_free(fitm_score_opts *o)
{
    if (!o)
        return;
    free(o->layers);
    free(o->heads);
    free(o->fuse_layers);
    fitm_score_opts_init(o);
}

static fitm_status copy_list(int32_t **dst, int32_t *n_dst, const int32_t *src, int32_t n,
                             int32_t per, fitm_err *err)
{
    int32_t *v = malloc((size_t)(n > 0 ? n : 1) * (size_t)per * sizeof *v);
    if (!v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    memcpy(v, src, (size_t)n * (size_t)per * sizeof *v);
    free(*dst);
    *dst = v;
    *n_dst = n;
    return FITM_OK;
}

fitm_status fitm_score_opts_overlay(fitm_score_opts *dst, const fitm_score_opts *src,
                                    fitm_err *err)
{
    fitm_status st;
    if (src->layers && (st = copy_list(&dst->layers, &dst->n_layers, src->layers, src->n_layers,
                                       1, err)) != FITM_OK)
        return st;
    if (src->heads && (st = copy_list(&dst->heads, &dst->n_heads, src->heads, src->n_heads, 2,
                                      err)) != FITM_OK)
        return st;
    if (src->fuse_layers &&
        (st = copy_list(&dst->fuse_layers, &dst->n_fuse_layers, src->fuse_layers,
                        src->n_fuse_layers, 1, err)) != FITM_OK)
        return st;
#define OVER_INT(f)                                                                               \
    if (src->f >= 0)                                                                              \
        dst->f = src->f;
#define OVER_REAL(f)                                                                              \
    if (!isnan(src->f))                                                                           \
        dst->f = src->f;
    OVER_INT(rows) OVER_INT(aggregate) OVER_INT(skip_first) OVER_INT(reference)
    OVER_INT(dummy_source) OVER_INT(form) OVER_INT(head_query) OVER_INT(window)
    OVER_INT(passages)
    OVER_REAL(sink_factor) OVER_REAL(temperature) OVER_REAL(score_scale) OVER_REAL(score_bias)
    OVER_REAL(fuse_weight) OVER_REAL(fuse_scale) OVER_REAL(fuse_bias)
#undef OVER_INT
#undef OVER_REAL
    return FITM_OK;
}

fitm_status fitm_score_opts_builtin(fitm_score_opts *o, int32_t L, fitm_err *err)
{
    fitm_score_opts_init(o);
    int32_t first = (int32_t)floor((double)L * 5.0 / 18.0);
    int32_t n = (int32_t)lround((double)L * 3.0 / 18.0);
    n = n < 1 ? 1 : n;
    o->layers = malloc((size_t)n * sizeof *o->layers);
    o->fuse_layers = malloc(sizeof *o->fuse_layers);
    if (!o->layers || !o->fuse_layers) {
        fitm_score_opts_free(o);
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    for (int32_t i = 0; i < n; i++)
        o->layers[i] = first + i < L ? first + i : L - 1;
    o->n_layers = n;
    o->fuse_layers[0] = 0;
    o->n_fuse_layers = 1;
    o->rows = FITM_ROWS_QUESTION;
    o->aggregate = FITM_AGG_SUM;
    o->skip_first = 0;
    o->reference = FITM_REF_NULL_SUFFIX;
    o->dummy_source = FITM_DUMMY_FIXED;
    o->form = FITM_FORM_DIFFERENCE;
    o->head_query = FITM_HEAD_QUERY;
    o->sink_factor = 0;
    o->window = 0;
    o->passages = FITM_PASSAGES_WHOLE;
    o->temperature = 0.05;
    o->score_scale = 1.0 / o->temperature;
    o->score_bias = 0;
    o->fuse_weight = FITM_FUSE_WEIGHT;
    o->fuse_scale = FITM_FUSE_SCALE;
    o->fuse_bias = FITM_FUSE_BIAS;
    return FITM_OK;
}

/* A comma-separated list of integers (per = 1) or layer:head pairs (per = 2). */
static fitm_status parse_list(const char *name, const char *text, int32_t per, int32_t **out,
                              int32_t *n_out, fitm_err *err)
{
    int32_t v[2 * FITM_SCORE_MAX_LIST], n = 0;
    const char *p = text;
    while (*p) {
        if (n == FITM_SCORE_MAX_LIST)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: more than %d entries", name,
                                FITM_SCORE_MAX_LIST);
        for (int32_t j = 0; j < per; j++) {
            char *end = NULL;
            errno = 0;
            long x = strtol(p, &end, 10);
            if (end == p || errno || x < -FITM_SCORE_MAX_LIST || x >= FITM_SCORE_MAX_LIST)
                return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': expected %s", name,
                                    text, per == 1 ? "integers like 3,4,-1"
                                                   : "layer:head pairs like 5:1,11:0");
            v[n * per + j] = (int32_t)x;
            p = end;
            while (*p == ' ')
                p++;
            if (j + 1 < per && *p++ != ':')
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "%s = '%.100s': expected layer:head pairs like 5:1,11:0",
                                    name, text);
        }
        n++;
        if (*p == ',')
            p++;
        else if (*p)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': expected a comma at '%.20s'",
                                name, text, p);
        while (*p == ' ')
            p++;
    }
    if (n == 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "%s is an empty list", name);
    if (per == 2)
        for (int32_t i = 0; i < n; i++)
            if (v[2 * i + 1] < 0)
                return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': head %d is negative",
                                    name, text, (int)v[2 * i + 1]);
    return copy_list(out, n_out, v, n, per, err);
}

/* The count of list option k (KEY_LAYERS or KEY_HEADS) in o. */
static int32_t *list_count(fitm_score_opts *o, const key_def *k)
{
    if (k->offset == OFF(fuse_layers))
        return &o->n_fuse_layers;
    return k->kind == KEY_LAYERS ? &o->n_layers : &o->n_heads;
}

fitm_status fitm_score_opts_set(fitm_score_opts *o, const char *name, const char *text,
                                fitm_err *err)
{
    const key_def *k = find_key(name);
    if (!k)
        return fitm_err_set(err, FITM_ERR_NOT_FOUND, "'%.100s' is not a scoring option", name);
    char *field = (char *)o + k->offset;
    if (!*text) { /* unset */
        fitm_score_opts unset;
        fitm_score_opts_init(&unset);
        if (k->kind == KEY_LAYERS || k->kind == KEY_HEADS) {
            free(*(int32_t **)(void *)field);
            *(int32_t **)(void *)field = NULL;
            *list_count(o, k) = 0;
        } else {
            memcpy(field, (char *)&unset + k->offset, k->kind == KEY_REAL ? sizeof(double)
                                                                          : sizeof(int32_t));
        }
        return FITM_OK;
    }
    char *end = NULL;
    errno = 0;
    switch (k->kind) {
    case KEY_ENUM: {
        int32_t v = fitm_score_enum_parse(name, text);
        if (v < 0)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': must be one of %s", name,
                                text, k->choices);
        *(int32_t *)(void *)field = v;
        return FITM_OK;
    }
    case KEY_INT: {
        long long v = strtoll(text, &end, 10);
        if (errno || end == text || *end || v < k->min || v > k->max)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%s = '%.100s': must be an integer in [%.0f, %.0f]", name, text,
                                k->min, k->max);
        *(int32_t *)(void *)field = (int32_t)v;
        return FITM_OK;
    }
    case KEY_REAL: {
        double v = strtod(text, &end);
        if (errno || end == text || *end || !isfinite(v) || v < k->min || v > k->max)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s = '%.100s': must be a number in [%g, %g]",
                                name, text, k->min, k->max);
        *(double *)(void *)field = v;
        return FITM_OK;
    }
    case KEY_LAYERS:
    case KEY_HEADS:
        return parse_list(name, text, k->kind == KEY_LAYERS ? 1 : 2, (int32_t **)(void *)field,
                          list_count(o, k), err);
    }
    return fitm_err_set(err, FITM_ERR_INTERNAL, "bad option kind");
}

/* ---- the math ---------------------------------------------------------------------------- */

double fitm_score_rel(int32_t form, double A, double A_ref)
{
    if (form == FITM_FORM_LOG_RATIO)
        return log(A + FITM_SCORE_LOG_EPS) - log(A_ref + FITM_SCORE_LOG_EPS);
    return A - A_ref;
}

int32_t fitm_score_groups(int32_t K, int32_t W, int32_t *starts)
{
    int32_t G = W <= 0 || W >= K ? 1 : (K + W - 1) / W;
    /* The first K % G groups take one document more. */
    int32_t base = K / G, extra = K % G;
    starts[0] = 0;
    for (int32_t g = 0; g < G; g++)
        starts[g + 1] = starts[g] + base + (g < extra ? 1 : 0);
    return G;
}

void fitm_score_softmax(const double *x, int32_t K, double t, double *weight)
{
    double mx = -INFINITY, z = 0;
    for (int32_t k = 0; k < K; k++)
        mx = x[k] / t > mx ? x[k] / t : mx;
    for (int32_t k = 0; k < K; k++)
        z += (weight[k] = exp(x[k] / t - mx));
    for (int32_t k = 0; k < K; k++)
        weight[k] /= z;
}

double fitm_score_sigmoid(double x, double scale, double bias)
{
    double z = scale * x + bias;
    return z >= 0 ? 1.0 / (1.0 + exp(-z)) : exp(z) / (1.0 + exp(z));
}

void fitm_score_reduce(const double *a, const double *a_ref, int64_t N, int32_t skip_first,
                       double sink_factor, int32_t aggregate, double *A, double *A_ref)
{
    int64_t from = skip_first < N ? skip_first : N;
    double limit = INFINITY;
    if (sink_factor > 0 && a_ref && N > from) {
        double m = 0;
        for (int64_t i = from; i < N; i++)
            m += a_ref[i];
        limit = sink_factor * m / (double)(N - from);
    }
    double s = 0, s_ref = 0;
    int64_t n = 0;
    for (int64_t i = from; i < N; i++) {
        if (a_ref && a_ref[i] > limit)
            continue;
        s += a[i];
        s_ref += a_ref ? a_ref[i] : 0;
        n++;
    }
    if (aggregate == FITM_AGG_MEAN) {
        s = n ? s / (double)n : 0;
        s_ref = n ? s_ref / (double)n : 0;
    }
    *A = s;
    *A_ref = s_ref;
}
