/* Unit test for score.c and profile.c: option text parsing and overlay, the window groups,
 * the reduce step (skip_first, sinks, sum/mean), softmax and sigmoid; the profile parser
 * (identity keys required, bad lines and unknown keys rejected quoting the line, repeated
 * keys) and the identity check naming the differing key; /answer's defaults (text form, overlay,
 * their profile keys). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/profile.h"
#include "pipeline/score.h"

static int failures;
#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #c);                         \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static const char GOOD[] = "# fitted by tools/fit_profile.py\n"
                           "profile_version = 1\n"
                           "model_architecture = gemma3\n"
                           "model_name = \"Gemma 3 270m\"\n"
                           "model_layers = 18\n"
                           "model_embd = 640\n"
                           "model_heads = 4\n"
                           "model_vocab = 262144\n"
                           "model_file_bytes = 253113024\n"
                           "fitted_on = \"set dev n=48\"\n"
                           "\n"
                           "rows = question\n"
                           "layers = 5, 6,-1\n"
                           "heads = 5:1,11:0\n"
                           "reference = null_query\n"
                           "window = 5\n"
                           "temperature = 0.1\n"
                           "score_scale = 12.5\n"
                           "answer_reorder = query_likelihood\n"
                           "answer_calibrate = false\n";

static void test_options(void)
{
    fitm_score_opts o, b;
    fitm_score_opts_init(&o);
    fitm_err err = {{0}};
    CHECK(fitm_score_opts_set(&o, "rows", "suffix", &err) == FITM_OK && o.rows == FITM_ROWS_SUFFIX);
    CHECK(fitm_score_opts_set(&o, "rows", "middle", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "rows = 'middle'") && strstr(err.msg, "last|question|suffix"));
    CHECK(fitm_score_opts_set(&o, "layers", "3,4,-1", &err) == FITM_OK && o.n_layers == 3 &&
          o.layers[2] == -1);
    CHECK(fitm_score_opts_set(&o, "layers", "3,,4", &err) == FITM_ERR_INVALID);
    CHECK(fitm_score_opts_set(&o, "layers", "3 4", &err) == FITM_ERR_INVALID);
    CHECK(fitm_score_opts_set(&o, "heads", "5:1,11:0", &err) == FITM_OK && o.n_heads == 2 &&
          o.heads[2] == 11 && o.heads[3] == 0);
    CHECK(fitm_score_opts_set(&o, "heads", "5", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "layer:head"));
    CHECK(fitm_score_opts_set(&o, "heads", "5:-1", &err) == FITM_ERR_INVALID);
    CHECK(fitm_score_opts_set(&o, "window", "-2", &err) == FITM_ERR_INVALID);
    CHECK(fitm_score_opts_set(&o, "head_query", "null", &err) == FITM_OK &&
          o.head_query == FITM_HEAD_NULL);
    CHECK(fitm_score_opts_set(&o, "head_query", "none", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "query|null"));
    CHECK(fitm_score_opts_set(&o, "sink_factor", "2.5", &err) == FITM_OK && o.sink_factor == 2.5);
    CHECK(fitm_score_opts_set(&o, "temperature", "0", &err) == FITM_ERR_INVALID);
    CHECK(fitm_score_opts_set(&o, "bogus", "1", &err) == FITM_ERR_NOT_FOUND);
    CHECK(fitm_score_opts_set(&o, "sink_factor", "", &err) == FITM_OK && isnan(o.sink_factor));
    CHECK(fitm_score_opts_set(&o, "layers", "", &err) == FITM_OK && !o.layers);
    /* fuse_layers: a layer list of its own, beside layers */
    CHECK(fitm_score_opts_set(&o, "fuse_layers", "1,-2", &err) == FITM_OK &&
          o.n_fuse_layers == 2 && o.fuse_layers[1] == -2 && !o.layers);
    CHECK(fitm_score_opts_set(&o, "fuse_layers", "1;2", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "fuse_layers"));
    CHECK(fitm_score_opts_set(&o, "fuse_weight", "0.3", &err) == FITM_OK && o.fuse_weight == 0.3);
    /* fuse_scale > 0 keeps fused's order; fuse_bias any real */
    CHECK(fitm_score_opts_set(&o, "fuse_scale", "0", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "fuse_scale"));
    CHECK(fitm_score_opts_set(&o, "fuse_scale", "2.5", &err) == FITM_OK && o.fuse_scale == 2.5);
    CHECK(fitm_score_opts_set(&o, "fuse_bias", "-1.5", &err) == FITM_OK && o.fuse_bias == -1.5);

    /* Overlay: set options win, unset ones keep the layer below. */
    CHECK(fitm_score_opts_builtin(&b, 18, &err) == FITM_OK);
    CHECK(b.n_layers == 3 && b.layers[0] == 5 && b.layers[2] == 7);
    CHECK(b.n_fuse_layers == 1 && b.fuse_layers[0] == 0 && b.fuse_weight == FITM_FUSE_WEIGHT);
    CHECK(b.fuse_scale == FITM_FUSE_SCALE && b.fuse_bias == FITM_FUSE_BIAS);
    CHECK(b.rows == FITM_ROWS_QUESTION && b.reference == FITM_REF_NULL_SUFFIX &&
          b.aggregate == FITM_AGG_SUM && b.window == 0 && b.score_scale == 1 / b.temperature);
    CHECK(fitm_score_opts_overlay(&b, &o, &err) == FITM_OK);
    CHECK(b.rows == FITM_ROWS_SUFFIX && b.n_heads == 2 && b.n_layers == 3 && b.window == 0);
    CHECK(b.n_fuse_layers == 2 && b.fuse_layers[0] == 1 && b.fuse_layers[1] == -2 &&
          b.fuse_weight == 0.3 && b.fuse_scale == 2.5 && b.fuse_bias == -1.5);
    CHECK(fitm_score_opts_set(&o, "fuse_layers", "", &err) == FITM_OK && !o.fuse_layers &&
          !o.n_fuse_layers);
    fitm_score_opts_free(&b);
    CHECK(fitm_score_opts_builtin(&b, 2, &err) == FITM_OK && b.n_layers == 1 && b.layers[0] == 0);
    fitm_score_opts_free(&b);
    fitm_score_opts_free(&o);
    fitm_score_opts_free(NULL);
}

static void test_math(void)
{
    int32_t st[12];
    CHECK(fitm_score_groups(10, 0, st) == 1 && st[1] == 10);
    CHECK(fitm_score_groups(10, 5, st) == 2 && st[1] == 5 && st[2] == 10);
    CHECK(fitm_score_groups(11, 5, st) == 3 && st[1] == 4 && st[2] == 8 && st[3] == 11);
    CHECK(fitm_score_groups(7, 3, st) == 3 && st[1] == 3 && st[2] == 5 && st[3] == 7);
    CHECK(fitm_score_groups(3, 5, st) == 1 && st[1] == 3);

    CHECK(fitm_score_rel(FITM_FORM_DIFFERENCE, 0.5, 0.2) == 0.5 - 0.2);
    CHECK(fabs(fitm_score_rel(FITM_FORM_LOG_RATIO, 0.5, 0.25) - log(2.0)) < 1e-8);

    double x[3] = {1, 2, 3}, w[3];
    fitm_score_softmax(x, 3, 0.5, w);
    double z = exp(2) + exp(4) + exp(6);
    CHECK(fabs(w[2] - exp(6) / z) < 1e-12 && fabs(w[0] + w[1] + w[2] - 1) < 1e-12);
    CHECK(fabs(fitm_score_sigmoid(1, 2, -1) - 1 / (1 + exp(-1))) < 1e-12);
    CHECK(fitm_score_sigmoid(-1e6, 1, 0) == 0 && fitm_score_sigmoid(1e6, 1, 0) == 1);

    /* reduce: token 0 skipped; reference mean over tokens 1..4 = 0.25, f = 2: token 2
     * (ref 0.7 > 0.5) is a sink, left out of both. */
    double a[5] = {9, 1, 5, 2, 3}, r[5] = {9, 0.1, 0.7, 0.1, 0.1}, A, Ar;
    fitm_score_reduce(a, r, 5, 1, 2.0, FITM_AGG_SUM, &A, &Ar);
    CHECK(A == 6 && fabs(Ar - 0.3) < 1e-12);
    fitm_score_reduce(a, r, 5, 1, 2.0, FITM_AGG_MEAN, &A, &Ar);
    CHECK(A == 2 && fabs(Ar - 0.1) < 1e-12);
    fitm_score_reduce(a, r, 5, 1, 0, FITM_AGG_SUM, &A, &Ar);
    CHECK(A == 11 && fabs(Ar - 1.0) < 1e-12);
    fitm_score_reduce(a, NULL, 5, 9, 2.0, FITM_AGG_MEAN, &A, &Ar);
    CHECK(A == 0 && Ar == 0);
}

static fitm_status parse(const char *text, fitm_profile *p, fitm_err *err)
{
    err->msg[0] = '\0';
    return fitm_profile_parse(p, text, strlen(text), "t.profile", err);
}

/* GOOD with line `from` replaced by `to` (or with `to` appended when from is NULL). */
static fitm_status parse_edit(const char *from, const char *to, fitm_profile *p, fitm_err *err)
{
    static char buf[4096];
    if (!from) {
        snprintf(buf, sizeof buf, "%s%s\n", GOOD, to);
    } else {
        const char *at = strstr(GOOD, from);
        snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - GOOD), GOOD, to, at + strlen(from));
    }
    return parse(buf, p, err);
}

static void test_profile(void)
{
    fitm_profile p;
    fitm_err err = {{0}};
    CHECK(parse(GOOD, &p, &err) == FITM_OK);
    CHECK(!strcmp(p.id.architecture, "gemma3") && !strcmp(p.id.name, "Gemma 3 270m"));
    CHECK(p.id.layers == 18 && p.id.vocab == 262144 && p.id.file_bytes == 253113024);
    CHECK(!strcmp(p.fitted_on, "set dev n=48") && p.fitted_metrics[0] == '\0');
    CHECK(p.opts.rows == FITM_ROWS_QUESTION && p.opts.n_layers == 3 && p.opts.layers[1] == 6);
    CHECK(p.opts.n_heads == 2 && p.opts.window == 5 && p.opts.temperature == 0.1);
    CHECK(p.opts.score_scale == 12.5 && isnan(p.opts.score_bias) && p.opts.aggregate == -1);
    CHECK(p.answer.reorder == FITM_RERANK_QUERY_LIKELIHOOD && p.answer.calibrate == 0 &&
          p.answer.reorder_last == FITM_ANSWER_UNSET);

    fitm_profile_identity id = p.id;
    CHECK(fitm_profile_check(&p, &id, &err) == FITM_OK);
    id.layers = 26;
    CHECK(fitm_profile_check(&p, &id, &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "model_layers") && strstr(err.msg, "18") && strstr(err.msg, "26"));
    id = p.id;
    snprintf(id.name, sizeof id.name, "Other");
    CHECK(fitm_profile_check(&p, &id, &err) == FITM_ERR_INVALID && strstr(err.msg, "model_name"));
    id = p.id;
    id.file_bytes++;
    CHECK(fitm_profile_check(&p, &id, &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "model_file_bytes"));
    fitm_profile_free(&p);

    /* Bad lines: the error names the file and line and quotes it. */
    CHECK(parse_edit(NULL, "colour = blue", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "t.profile:21") && strstr(err.msg, "'colour = blue'") &&
          strstr(err.msg, "unknown key"));
    fitm_profile_free(&p);
    CHECK(parse_edit(NULL, "just words", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "'just words'") && strstr(err.msg, "key = value"));
    fitm_profile_free(&p);
    CHECK(parse_edit(NULL, "form = diagonal", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "t.profile:21") && strstr(err.msg, "'diagonal'"));
    fitm_profile_free(&p);
    CHECK(parse_edit(NULL, "window = 3", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "given twice"));
    fitm_profile_free(&p);
    CHECK(parse_edit(NULL, "answer_calibrate = true", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "given twice"));
    fitm_profile_free(&p);
    CHECK(parse_edit(NULL, "answer_reorder_placement = middle", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "t.profile:21") && strstr(err.msg, "first, last"));
    fitm_profile_free(&p);
    CHECK(parse_edit("model_vocab = 262144\n", "", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "'model_vocab' is missing"));
    fitm_profile_free(&p);
    CHECK(parse_edit("profile_version = 1", "profile_version = 2", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "profile_version"));
    fitm_profile_free(&p);
    CHECK(parse_edit("model_layers = 18", "model_layers = many", &p, &err) == FITM_ERR_FORMAT &&
          strstr(err.msg, "'many'"));
    fitm_profile_free(&p);

    /* The file loader: a missing file is an I/O error naming it. */
    CHECK(fitm_profile_load(&p, "/nonexistent/x.profile", &err) == FITM_ERR_IO &&
          strstr(err.msg, "/nonexistent/x.profile"));
    fitm_profile_free(&p);
    fitm_profile_free(NULL);
}

/* /answer's defaults: their text form (names, choices, the empty text unsets) and overlay. */
static void test_answer_defaults(void)
{
    fitm_answer_defaults d, top;
    fitm_err err = {{0}};
    fitm_answer_defaults_init(&d);
    CHECK(d.calibrate == FITM_ANSWER_UNSET && d.reorder == FITM_ANSWER_UNSET &&
          d.reorder_last == FITM_ANSWER_UNSET);
    CHECK(fitm_answer_defaults_is_key("answer_reorder") && !fitm_answer_defaults_is_key("reorder"));
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder", "calibrated", &err) == FITM_OK &&
          d.reorder == FITM_RERANK_CALIBRATED);
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder", "none", &err) == FITM_OK &&
          d.reorder == -1);
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder", "paper", &err) == FITM_OK &&
          d.reorder == FITM_RERANK_PAPER);
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder", "bm25", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "answer_reorder = 'bm25'") && strstr(err.msg, "query_likelihood"));
    CHECK(d.reorder == FITM_RERANK_PAPER); /* a bad value changes nothing */
    CHECK(fitm_answer_defaults_set(&d, "answer_calibrate", "false", &err) == FITM_OK &&
          d.calibrate == 0);
    CHECK(fitm_answer_defaults_set(&d, "answer_calibrate", "yes", &err) == FITM_ERR_INVALID &&
          strstr(err.msg, "true, false"));
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder_placement", "last", &err) == FITM_OK &&
          d.reorder_last == 1);
    CHECK(fitm_answer_defaults_set(&d, "answer_stream", "true", &err) == FITM_ERR_NOT_FOUND);

    fitm_answer_defaults_init(&top);
    CHECK(fitm_answer_defaults_set(&top, "answer_calibrate", "true", &err) == FITM_OK);
    fitm_answer_defaults_overlay(&d, &top); /* only what top sets */
    CHECK(d.calibrate == 1 && d.reorder == FITM_RERANK_PAPER && d.reorder_last == 1);
    CHECK(fitm_answer_defaults_set(&d, "answer_reorder_placement", "", &err) == FITM_OK &&
          d.reorder_last == FITM_ANSWER_UNSET);
    CHECK(!strcmp(fitm_rerank_method_name(FITM_RERANK_QUERY_LIKELIHOOD), "query_likelihood") &&
          fitm_rerank_method_parse("attention_sort") == FITM_RERANK_ATTENTION_SORT &&
          fitm_rerank_method_parse("bogus") == -1);
}

int main(void)
{
    test_options();
    test_answer_defaults();
    test_math();
    test_profile();
    if (failures)
        fprintf(stderr, "%d failures\n", failures);
    return failures ? 1 : 0;
}
