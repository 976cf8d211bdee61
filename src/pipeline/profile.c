/* profile: a model's scoring profile (see profile.h). */
#include "pipeline/profile.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fitm_profile_free(fitm_profile *p)
{
    if (!p)
        return;
    fitm_score_opts_free(&p->opts);
    memset(p, 0, sizeof *p);
    fitm_score_opts_init(&p->opts);
    fitm_answer_defaults_init(&p->answer);
}

/* The identity and provenance keys: where their value goes. */
typedef struct {
    const char *name;
    size_t offset; /* into fitm_profile                   */
    size_t bytes;  /* text: room of the array; 0: int64  */
} id_key;

#define TXT(f) offsetof(fitm_profile, f), sizeof(((fitm_profile *)0)->f)
#define NUM(f) offsetof(fitm_profile, f), 0
static const id_key id_keys[] = {
    {"profile_version", 0, 0}, /* checked, not stored */
    {"model_architecture", TXT(id.architecture)},
    {"model_name", TXT(id.name)},
    {"model_layers", NUM(id.layers)},
    {"model_embd", NUM(id.embd)},
    {"model_heads", NUM(id.heads)},
    {"model_vocab", NUM(id.vocab)},
    {"model_file_bytes", NUM(id.file_bytes)},
    {"fitted_on", TXT(fitted_on)},
    {"fitted_metrics", TXT(fitted_metrics)},
};
#define N_ID_KEYS (sizeof id_keys / sizeof id_keys[0])
#define N_REQUIRED 8 /* the first N_REQUIRED keys must be present */

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

/* One identity or provenance key's value into p. */
static fitm_status set_id_key(fitm_profile *p, const id_key *k, const char *value,
                              const char *at, fitm_err *err)
{
    if (k->bytes) {
        if (strlen(value) >= k->bytes)
            return fitm_err_set(err, FITM_ERR_FORMAT, "%s: %s is longer than %zu bytes", at,
                                k->name, k->bytes - 1);
        memcpy((char *)p + k->offset, value, strlen(value) + 1);
        return FITM_OK;
    }
    char *end = NULL;
    errno = 0;
    long long v = strtoll(value, &end, 10);
    if (errno || end == value || *end || v < 0)
        return fitm_err_set(err, FITM_ERR_FORMAT, "%s: %s = '%.100s': not a count", at, k->name,
                            value);
    if (k->offset == 0 && k->bytes == 0 && !strcmp(k->name, "profile_version")) {
        if (v != FITM_PROFILE_VERSION)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "%s: profile_version = %lld: this fitmd reads version %d", at, v,
                                FITM_PROFILE_VERSION);
        return FITM_OK;
    }
    *(int64_t *)(void *)((char *)p + k->offset) = v;
    return FITM_OK;
}

/* One non-empty, non-comment line `key = value`. seen has one flag per id key, then one per
 * scoring key (by name, through a small list). */
static fitm_status parse_line(fitm_profile *p, char *s, const char *at, uint8_t *seen,
                              char seen_opts[][32], int *n_seen_opts, fitm_err *err)
{
    char *eq = strchr(s, '=');
    if (!eq)
        return fitm_err_set(err, FITM_ERR_FORMAT, "%s: '%.100s': expected key = value", at, s);
    *eq = '\0';
    char *key = trim(s), *value = trim(eq + 1);
    size_t vl = strlen(value);
    if (vl >= 2 && value[0] == '"' && value[vl - 1] == '"') {
        value[vl - 1] = '\0';
        value++;
    }
    for (size_t i = 0; i < N_ID_KEYS; i++) {
        if (strcmp(key, id_keys[i].name) != 0)
            continue;
        if (seen[i]++)
            return fitm_err_set(err, FITM_ERR_FORMAT, "%s: '%.100s' is given twice", at, key);
        return set_id_key(p, &id_keys[i], value, at, err);
    }
    bool answer = fitm_answer_defaults_is_key(key);
    if (!answer && !fitm_score_is_key(key))
        return fitm_err_set(err, FITM_ERR_FORMAT, "%s: '%.100s = %.100s': unknown key", at, key,
                            value);
    for (int i = 0; i < *n_seen_opts; i++)
        if (!strcmp(seen_opts[i], key))
            return fitm_err_set(err, FITM_ERR_FORMAT, "%s: '%.100s' is given twice", at, key);
    snprintf(seen_opts[(*n_seen_opts)++], 32, "%s", key);
    fitm_status st = answer ? fitm_answer_defaults_set(&p->answer, key, value, err)
                            : fitm_score_opts_set(&p->opts, key, value, err);
    if (st != FITM_OK) {
        fitm_err_prefix(err, "%s", at);
        return FITM_ERR_FORMAT;
    }
    return FITM_OK;
}

fitm_status fitm_profile_parse(fitm_profile *p, const char *text, size_t len, const char *where,
                               fitm_err *err)
{
    memset(p, 0, sizeof *p);
    fitm_score_opts_init(&p->opts);
    fitm_answer_defaults_init(&p->answer);
    uint8_t seen[N_ID_KEYS] = {0};
    char seen_opts[32][32];
    int n_seen_opts = 0;
    char line[4096];
    size_t pos = 0;
    for (int lineno = 1; pos < len; lineno++) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - (text + pos)) : len - pos;
        char at[FITM_ERR_MSG_BYTES / 2];
        snprintf(at, sizeof at, "%.200s:%d", where, lineno);
        if (n >= sizeof line)
            return fitm_err_set(err, FITM_ERR_FORMAT, "%s: line too long", at);
        memcpy(line, text + pos, n);
        line[n] = '\0';
        pos += n + 1;
        char *s = trim(line);
        if (*s == '\0' || *s == '#')
            continue;
        fitm_status st = parse_line(p, s, at, seen, seen_opts, &n_seen_opts, err);
        if (st != FITM_OK)
            return st;
    }
    for (size_t i = 0; i < N_REQUIRED; i++)
        if (!seen[i])
            return fitm_err_set(err, FITM_ERR_FORMAT, "%.200s: '%s' is missing", where,
                                id_keys[i].name);
    return FITM_OK;
}

fitm_status fitm_profile_load(fitm_profile *p, const char *path, fitm_err *err)
{
    memset(p, 0, sizeof *p);
    fitm_score_opts_init(&p->opts);
    fitm_answer_defaults_init(&p->answer);
    FILE *f = fopen(path, "rb");
    if (!f)
        return fitm_err_set(err, FITM_ERR_IO, "profile %.200s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    fitm_status st = FITM_OK;
    for (;;) {
        if (n + 4096 > cap) {
            char *b = realloc(buf, cap = (cap + 4096) * 2);
            if (!b) {
                st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
                break;
            }
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
        if (n > (1u << 20)) {
            st = fitm_err_set(err, FITM_ERR_FORMAT, "profile %.200s: larger than 1 MiB", path);
            break;
        }
    }
    if (st == FITM_OK && ferror(f))
        st = fitm_err_set(err, FITM_ERR_IO, "profile %.200s: read error", path);
    fclose(f);
    if (st == FITM_OK)
        st = fitm_profile_parse(p, buf, n, path, err);
    free(buf);
    return st;
}

fitm_status fitm_profile_check(const fitm_profile *p, const fitm_profile_identity *model,
                               fitm_err *err)
{
    const fitm_profile_identity *a = &p->id;
    if (strcmp(a->architecture, model->architecture) != 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "model_architecture: the profile says '%.60s', the model is '%.60s'",
                            a->architecture, model->architecture);
    if (strcmp(a->name, model->name) != 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "model_name: the profile says '%.100s', the model is '%.100s'",
                            a->name, model->name);
    const struct {
        const char *key;
        int64_t want, have;
    } nums[] = {{"model_layers", a->layers, model->layers},
                {"model_embd", a->embd, model->embd},
                {"model_heads", a->heads, model->heads},
                {"model_vocab", a->vocab, model->vocab},
                {"model_file_bytes", a->file_bytes, model->file_bytes}};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
        if (nums[i].want != nums[i].have)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: the profile says %lld, the model has %lld",
                                nums[i].key, (long long)nums[i].want, (long long)nums[i].have);
    return FITM_OK;
}
