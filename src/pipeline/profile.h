/* profile: a model's scoring profile, the plain-text file that says which scoring options
 * work best on one model (config/profiles/). Syntax as config/fitmd.conf: `key = value` per
 * line, `#` comments, values optionally in double quotes. Keys: the identity of the model it
 * was fitted on (profile_version = 1, model_architecture, model_name, model_layers,
 * model_embd, model_heads, model_vocab, model_file_bytes), provenance (fitted_on,
 * fitted_metrics), any scoring option of score.h with the same name and syntax, and
 * /answer's defaults (answer_calibrate, answer_reorder, answer_reorder_placement; score.h). */
#ifndef FITM_PROFILE_H
#define FITM_PROFILE_H

#include <stdint.h>

#include "pipeline/score.h"
#include "base/status.h"

#define FITM_PROFILE_VERSION 1
#define FITM_PROFILE_TEXT_BYTES 512

/* A model's identity, as the profile states it and as the loaded model has it. */
typedef struct {
    char architecture[64];
    char name[FITM_PROFILE_TEXT_BYTES]; /* general.name, "" when none */
    int64_t layers, embd, heads, vocab, file_bytes;
} fitm_profile_identity;

typedef struct {
    fitm_profile_identity id;
    char fitted_on[FITM_PROFILE_TEXT_BYTES];
    char fitted_metrics[FITM_PROFILE_TEXT_BYTES];
    fitm_score_opts opts; /* the options the profile sets; the others unset */
    fitm_answer_defaults answer; /* likewise                                 */
} fitm_profile;

/* Parses a profile's text (len bytes; where names it in messages, e.g. the path) into *p,
 * which the caller frees with fitm_profile_free (also after a failure). Every identity key
 * is required, once each. Errors (FITM_ERR_FORMAT) quote the line and its number: a line
 * without '=', an unknown key, a repeated key, a bad value, a version other than 1. */
fitm_status fitm_profile_parse(fitm_profile *p, const char *text, size_t len, const char *where,
                               fitm_err *err);

/* fitm_profile_parse on the file at path (FITM_ERR_IO when it cannot be read). */
fitm_status fitm_profile_load(fitm_profile *p, const char *path, fitm_err *err);

/* FITM_OK when p was fitted on a model of identity *model; else FITM_ERR_INVALID naming the
 * first differing key with both values. */
fitm_status fitm_profile_check(const fitm_profile *p, const fitm_profile_identity *model,
                               fitm_err *err);

/* NULL is a no-op. */
void fitm_profile_free(fitm_profile *p);

#endif
