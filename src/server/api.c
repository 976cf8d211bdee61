#include "server/api.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fitm_api_error_class fitm_api_classify(fitm_status s, fitm_api_cond cond)
{
    switch (cond) {
    case FITM_API_COND_UNAUTHORIZED:
        return (fitm_api_error_class){401, "authentication_error", "unauthorized", false};
    case FITM_API_COND_METHOD:
        return (fitm_api_error_class){405, "invalid_request_error", "method_not_allowed", false};
    case FITM_API_COND_BODY_TOO_LARGE:
        return (fitm_api_error_class){413, "invalid_request_error", "body_too_large", false};
    case FITM_API_COND_MEDIA_TYPE:
        return (fitm_api_error_class){415, "invalid_request_error", "unsupported_media_type",
                                      false};
    case FITM_API_COND_FRAMING:
        return (fitm_api_error_class){400, "invalid_request_error", "bad_framing", false};
    case FITM_API_COND_CODING:
        return (fitm_api_error_class){501, "invalid_request_error", "not_implemented", false};
    case FITM_API_COND_SLOW:
        return (fitm_api_error_class){408, "invalid_request_error", "request_timeout", false};
    case FITM_API_COND_TARGET_TOO_LONG:
        return (fitm_api_error_class){414, "invalid_request_error", "uri_too_long", false};
    case FITM_API_COND_HEAD_TOO_LARGE:
        return (fitm_api_error_class){431, "invalid_request_error", "headers_too_large", false};
    case FITM_API_COND_VERSION:
        return (fitm_api_error_class){505, "invalid_request_error", "http_version_not_supported",
                                      false};
    case FITM_API_COND_EXPECTATION:
        return (fitm_api_error_class){417, "invalid_request_error", "expectation_failed", false};
    case FITM_API_COND_NONE:
        break;
    }
    switch (s) {
    case FITM_ERR_INVALID:
        return (fitm_api_error_class){400, "invalid_request_error", "invalid_value", false};
    case FITM_ERR_FORMAT:
        return (fitm_api_error_class){400, "invalid_request_error", "invalid_json", false};
    case FITM_ERR_UNSUPPORTED:
        return (fitm_api_error_class){422, "invalid_request_error", "unsupported", false};
    case FITM_ERR_NOT_FOUND:
        return (fitm_api_error_class){404, "not_found_error", "not_found", false};
    case FITM_ERR_LIMIT:
    case FITM_ERR_CONTEXT: /* the OpenAI routes answer it as OpenAI does (http.c) */
        return (fitm_api_error_class){422, "invalid_request_error", "limit_exceeded", false};
    case FITM_ERR_BUSY:
        return (fitm_api_error_class){503, "overloaded_error", "unavailable", true};
    case FITM_ERR_TIMEOUT:
        return (fitm_api_error_class){503, "overloaded_error", "deadline_exceeded", true};
    case FITM_ERR_CANCELLED:
        return (fitm_api_error_class){503, "overloaded_error", "cancelled", true};
    case FITM_ERR_NOMEM:
        return (fitm_api_error_class){503, "server_error", "out_of_memory", true};
    case FITM_ERR_IO:
    case FITM_ERR_BACKEND:
    case FITM_ERR_INTERNAL:
    case FITM_OK:
    case FITM_STATUS_COUNT:
        break;
    }
    return (fitm_api_error_class){500, "server_error", "internal_error", false};
}

/* s[0..n) as a JSON string item, each byte that does not start a valid UTF-8 character
 * replaced by U+FFFD (a model can emit any byte token). */
static cJSON *text_item(const char *s, size_t n)
{
    char *buf = malloc(n * 3 + 1);
    if (!buf)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char b = (unsigned char)s[i];
        size_t len = b < 0x80           ? 1
                     : (b >> 5) == 6    ? 2
                     : (b >> 4) == 14   ? 3
                     : (b >> 3) == 30   ? 4
                                        : 0;
        if (len && i + len <= n && fitm_api_utf8_valid(s + i, len) && b != 0) {
            memcpy(buf + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    buf[o] = '\0';
    cJSON *item = cJSON_CreateString(buf);
    free(buf);
    return item;
}

char *fitm_api_error_json(const fitm_api_error_class *c, const char *message)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    /* A message may quote the client's bytes (a path, a field's value), cut to a length
     * anywhere in a character: the JSON carries U+FFFD for what is not UTF-8. */
    cJSON *m = text_item(message ? message : "", message ? strlen(message) : 0);
    char *out = NULL;
    if (e && m && cJSON_AddItemToObject(e, "message", m)) {
        m = NULL;
        if (cJSON_AddStringToObject(e, "type", c->type) &&
            cJSON_AddStringToObject(e, "code", c->code))
            out = cJSON_PrintUnformatted(root);
    }
    cJSON_Delete(m);
    cJSON_Delete(root);
    return out;
}

bool fitm_api_utf8_valid(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned cp, min;
        if ((c & 0xE0) == 0xC0) {
            len = 2, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, cp = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        if (n - i < len)
            return false;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += len;
    }
    return true;
}

/* Copies a JSON string item into *dst (malloc'd) after checking it is UTF-8. field names the
 * item for messages. */
static fitm_status take_string(const cJSON *item, const char *field, char **dst, size_t *len,
                               fitm_err *err)
{
    if (!cJSON_IsString(item) || !item->valuestring)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be a string", field);
    size_t n = strlen(item->valuestring);
    if (!fitm_api_utf8_valid(item->valuestring, n))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' is not valid UTF-8", field);
    char *copy = malloc(n + 1);
    if (!copy)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory copying '%s'", field);
    memcpy(copy, item->valuestring, n + 1);
    *dst = copy;
    if (len)
        *len = n;
    return FITM_OK;
}

/* An integer-valued JSON number in [lo, hi] into *v. */
static fitm_status take_int(const cJSON *item, const char *field, int64_t lo, int64_t hi,
                            int64_t *v, fitm_err *err)
{
    if (!cJSON_IsNumber(item))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be an integer", field);
    double d = item->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be an integer, got %g", field, d);
    if (fabs(d) >= 9007199254740992.0) /* from 2^53 on, the text may not be the value read */
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'%s' = %.0f is not below 2^53 (not exactly representable)", field, d);
    if (d < (double)lo || d > (double)hi)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' = %.0f is out of range [%lld, %lld]",
                            field, d, (long long)lo, (long long)hi);
    *v = (int64_t)d;
    return FITM_OK;
}

/* max_tokens (field: or an OpenAI name of it) into *v: 1 to the server's max_answer_tokens,
 * refused beyond rather than lowered, so a client never gets fewer tokens than it asked for
 * without being told. */
static fitm_status take_max_tokens(const cJSON *item, const char *field,
                                   const fitm_api_limits *lim, int64_t *v, fitm_err *err)
{
    fitm_status st = take_int(item, field, 1, INT32_MAX, v, err);
    if (st == FITM_OK && *v > lim->max_answer_tokens)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'%s' = %lld is over this server's limit of %d tokens "
                            "(max_answer_tokens): ask for 1 to %d",
                            field, (long long)*v, (int)lim->max_answer_tokens,
                            (int)lim->max_answer_tokens);
    if (st != FITM_OK && cJSON_IsNumber(item) && item->valuedouble < 1)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' = %g: ask for 1 to %d tokens", field,
                            item->valuedouble, (int)lim->max_answer_tokens);
    return st;
}

static fitm_status take_bool(const cJSON *item, const char *field, bool *v, fitm_err *err)
{
    if (!cJSON_IsBool(item))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be true or false", field);
    *v = cJSON_IsTrue(item);
    return FITM_OK;
}

static fitm_status parse_documents(const cJSON *arr, const char *field,
                                   const fitm_api_limits *lim, fitm_rerank_request *out,
                                   fitm_err *err)
{
    if (!cJSON_IsArray(arr))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be an array", field);
    int n = cJSON_GetArraySize(arr);
    if (n == 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' is empty: give at least one document",
                            field);
    if (n > lim->max_documents)
        return fitm_err_set(err, FITM_ERR_LIMIT, "'%s' has %d documents, more than the limit %d",
                            field, n, (int)lim->max_documents);
    out->docs = calloc((size_t)n, sizeof *out->docs);
    if (!out->docs)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %d documents", n);
    out->n_docs = n;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, arr)
    {
        char name[96];
        fitm_rerank_doc *doc = &out->docs[i];
        fitm_status st;
        if (cJSON_IsString(d)) {
            snprintf(name, sizeof name, "%s[%d]", field, i);
            if ((st = take_string(d, name, &doc->text, &doc->text_len, err)) != FITM_OK)
                return st;
        } else if (cJSON_IsObject(d)) {
            snprintf(name, sizeof name, "%s[%d].text", field, i);
            const cJSON *text = cJSON_GetObjectItemCaseSensitive(d, "text");
            if (!text)
                return fitm_err_set(err, FITM_ERR_INVALID, "'%s' is missing", name);
            if ((st = take_string(text, name, &doc->text, &doc->text_len, err)) != FITM_OK)
                return st;
            const cJSON *title = cJSON_GetObjectItemCaseSensitive(d, "title");
            if (title && !cJSON_IsNull(title)) {
                snprintf(name, sizeof name, "%s[%d].title", field, i);
                if ((st = take_string(title, name, &doc->title, &doc->title_len, err)) != FITM_OK)
                    return st;
            }
        } else {
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'%s[%d]' must be a string or an object {text, title}", field, i);
        }
        if (!doc->title) {
            doc->title = calloc(1, 1);
            if (!doc->title)
                return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        }
        i++;
    }
    return FITM_OK;
}

/* The scoring option `name` given as JSON, in its text form for fitm_score_opts_set: enum
 * names as strings, counts and reals as numbers, heads as [[layer, head], ...]. */
static fitm_status option_text(const cJSON *it, const char *pre, const char *name, char *buf,
                               size_t cap, fitm_err *err)
{
    bool list = !strcmp(name, "heads");
    if (*fitm_score_enum_choices(name)) {
        if (!cJSON_IsString(it))
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s' must be one of %s", pre, name,
                                fitm_score_enum_choices(name));
        snprintf(buf, cap, "%s", it->valuestring);
        return FITM_OK;
    }
    if (!list) {
        if (!cJSON_IsNumber(it))
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s' must be a number", pre, name);
        snprintf(buf, cap, "%.17g", it->valuedouble);
        return FITM_OK;
    }
    int n = cJSON_IsArray(it) ? cJSON_GetArraySize(it) : 0;
    if (n < 1 || n > FITM_SCORE_MAX_LIST)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'%s%s' must be an array of 1 to %d [layer, head] pairs", pre, name,
                            FITM_SCORE_MAX_LIST);
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        const cJSON *pr = cJSON_GetArrayItem(it, i);
        int64_t l, h; /* take_int checks the range before it converts */
        if (!cJSON_IsArray(pr) || cJSON_GetArraySize(pr) != 2 ||
            take_int(cJSON_GetArrayItem(pr, 0), name, INT_MIN, INT_MAX, &l, err) != FITM_OK ||
            take_int(cJSON_GetArrayItem(pr, 1), name, INT_MIN, INT_MAX, &h, err) != FITM_OK)
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s[%d]' must be [layer, head]", pre,
                                name, i);
        used += (size_t)snprintf(buf + used, cap - used, "%s%lld:%lld", i ? "," : "",
                                 (long long)l, (long long)h);
        if (used >= cap)
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s' is too long", pre, name);
    }
    return FITM_OK;
}

/* The scoring options of obj other than layers and temperature (score.h's names); pre
 * prefixes field names in messages. */
static fitm_status parse_score_options(const cJSON *root, const char *pre, fitm_score_opts *o,
                                       fitm_err *err)
{
    static const char *const names[] = {"rows",         "heads",      "aggregate",
                                        "skip_first",   "reference",  "dummy_source",
                                        "form",         "head_query", "sink_factor",
                                        "window",       "score_scale", "score_bias",
                                        "fuse_weight",  "fuse_scale", "fuse_bias",
                                        "passages"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, names[i]);
        if (!it || cJSON_IsNull(it))
            continue;
        char text[8 * FITM_SCORE_MAX_LIST + 64];
        fitm_status st = option_text(it, pre, names[i], text, sizeof text, err);
        if (st == FITM_OK && (st = fitm_score_opts_set(o, names[i], text, err)) != FITM_OK)
            fitm_err_prefix(err, "'%s%s'", pre, names[i]);
        if (st != FITM_OK)
            return FITM_ERR_INVALID;
    }
    return FITM_OK;
}

/* A list of layers, field `name` of obj (absent or null: left unset); negative layers count
 * from the end (-1 = the last), resolved by the pipeline, which knows L. */
static fitm_status parse_layer_list(const cJSON *root, const char *pre, const char *name,
                                    int32_t **list, int32_t *n_list, fitm_err *err)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!it || cJSON_IsNull(it))
        return FITM_OK;
    if (!cJSON_IsArray(it))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s' must be an array of integers", pre,
                            name);
    int n = cJSON_GetArraySize(it);
    if (n == 0 || n > FITM_RERANK_MAX_LAYERS)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s%s' must list 1 to %d layers", pre, name,
                            FITM_RERANK_MAX_LAYERS);
    if (!(*list = calloc((size_t)n, sizeof **list)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    *n_list = n;
    int i = 0;
    const cJSON *l;
    cJSON_ArrayForEach(l, it)
    {
        char field[64];
        int64_t v = 0;
        snprintf(field, sizeof field, "%s%s[%d]", pre, name, i);
        fitm_status st =
            take_int(l, field, -FITM_RERANK_MAX_LAYERS, FITM_RERANK_MAX_LAYERS - 1, &v, err);
        if (st != FITM_OK)
            return st;
        (*list)[i++] = (int32_t)v;
    }
    return FITM_OK;
}

/* The calibration options (temperature, layers, dummy and the scoring options) of obj; pre
 * prefixes field names in messages ("" for /rerank's top level, "calibration." for
 * /answer's). Options the request leaves out stay unset (the server's defaults). */
static fitm_status parse_calibration(const cJSON *root, const char *pre,
                                     fitm_rerank_request *out, fitm_err *err)
{
    fitm_status st;
    const cJSON *it;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "temperature")) && !cJSON_IsNull(it)) {
        if (!cJSON_IsNumber(it))
            return fitm_err_set(err, FITM_ERR_INVALID, "'%stemperature' must be a number", pre);
        double t = it->valuedouble;
        if (!isfinite(t) || t < 1e-12 || t > 1e6)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'%stemperature' = %g is out of range [1e-12, 1e6]", pre, t);
        out->opt.temperature = t;
    }
    if ((st = parse_layer_list(root, pre, "layers", &out->opt.layers, &out->opt.n_layers,
                               err)) != FITM_OK ||
        (st = parse_layer_list(root, pre, "fuse_layers", &out->opt.fuse_layers,
                               &out->opt.n_fuse_layers, err)) != FITM_OK)
        return st;
    char dname[48];
    snprintf(dname, sizeof dname, "%sdummy", pre);
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "dummy")) && !cJSON_IsNull(it)) {
        if ((st = take_string(it, dname, &out->dummy, &out->dummy_len, err)) != FITM_OK)
            return st;
        if (out->dummy_len == 0)
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s' is empty", dname);
    }
    return parse_score_options(root, pre, &out->opt, err);
}

/* Whether s holds nothing but spaces, tabs and line breaks (a question that asks nothing). */
static bool blank_text(const char *s)
{
    return s[strspn(s, " \t\r\n")] == '\0';
}

/* The query of a rerank body: present, a string, and not only whitespace. */
static fitm_status parse_rerank_query(const cJSON *root, fitm_rerank_request *out, fitm_err *err)
{
    fitm_status st;
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "query");
    if (!q)
        return fitm_err_set(err, FITM_ERR_INVALID, "'query' is missing");
    if ((st = take_string(q, "query", &out->query, &out->query_len, err)) != FITM_OK)
        return st;
    if (blank_text(out->query))
        return fitm_err_set(err, FITM_ERR_INVALID, "'query' is empty");
    return FITM_OK;
}

/* The documents of a rerank body, under Cohere's 'documents' or TEI's 'texts' (one of them). */
static fitm_status parse_rerank_documents(const cJSON *root, const fitm_api_limits *lim,
                                          fitm_rerank_request *out, fitm_err *err)
{
    const cJSON *docs = cJSON_GetObjectItemCaseSensitive(root, "documents");
    const cJSON *texts = cJSON_GetObjectItemCaseSensitive(root, "texts");
    if (docs && texts)
        return fitm_err_set(err, FITM_ERR_INVALID, "give either 'documents' or 'texts', not both");
    if (!docs && !texts)
        return fitm_err_set(err, FITM_ERR_INVALID, "'documents' is missing");
    out->tei = texts != NULL;
    return parse_documents(docs ? docs : texts, docs ? "documents" : "texts", lim, out, err);
}

/* What a rerank answers and how it reads the documents: top_n, return_documents (or TEI's
 * return_text), return_tokens, truncate, raw_scores and prefix_reuse. */
static fitm_status parse_rerank_flags(const cJSON *root, fitm_rerank_request *out, fitm_err *err)
{
    fitm_status st;
    int64_t v;
    const cJSON *it;
    out->top_n = out->n_docs;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "top_n")) && !cJSON_IsNull(it)) {
        /* More than there are documents means all of them (as Cohere and vLLM answer). */
        if ((st = take_int(it, "top_n", 1, INT32_MAX, &v, err)) != FITM_OK)
            return st;
        out->top_n = v < out->n_docs ? (int32_t)v : out->n_docs;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "return_documents")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "return_documents", &out->return_documents, err)) != FITM_OK)
        return st;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "return_text")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "return_text", &out->return_documents, err)) != FITM_OK)
        return st;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "return_tokens")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "return_tokens", &out->return_tokens, err)) != FITM_OK)
        return st;
    /* TEI's truncate: false refuses a document over max_tokens_per_doc instead of cutting it
     * (left out or true: cut, as fitm always did); raw_scores: TEI's answer gives each
     * score before the method's sigmoid. */
    bool truncate = true;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "truncate")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "truncate", &truncate, err)) != FITM_OK)
        return st;
    out->no_truncate = !truncate;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "raw_scores")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "raw_scores", &out->raw_scores, err)) != FITM_OK)
        return st;
    out->prefix_reuse = true;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "prefix_reuse")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "prefix_reuse", &out->prefix_reuse, err)) != FITM_OK)
        return st;
    return FITM_OK;
}

/* How a rerank runs: position_method, max_tokens_per_doc (capped by the server's), the model's
 * name (checked when the operator asked for strict checking) and the scoring method. */
static fitm_status parse_rerank_run(const cJSON *root, const fitm_api_limits *lim,
                                    fitm_rerank_request *out, fitm_err *err)
{
    fitm_status st;
    int64_t v;
    const cJSON *it;
    out->position = -1; /* the server's position_method */
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "position_method")) && !cJSON_IsNull(it)) {
        int m = cJSON_IsString(it) ? fitm_position_method_parse(it->valuestring) : -1;
        if (m < 0)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'position_method' must be one of none, moice, ms_poe, "
                                "attention_buckets");
        out->position = m;
    }
    out->max_tokens_per_doc = lim->max_tokens_per_doc;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "max_tokens_per_doc")) && !cJSON_IsNull(it)) {
        if ((st = take_int(it, "max_tokens_per_doc", 1, INT32_MAX, &v, err)) != FITM_OK)
            return st;
        if (v < lim->max_tokens_per_doc)
            out->max_tokens_per_doc = (int32_t)v;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "model")) && !cJSON_IsNull(it)) {
        if ((st = take_string(it, "model", &out->model, NULL, err)) != FITM_OK)
            return st;
        /* Clients send their own default name (rerank-english-v3.0, ...): any name is
         * answered by the served model unless the operator asked for strict checking. */
        if (lim->strict_model && lim->model_name && strcmp(out->model, lim->model_name) != 0)
            return fitm_err_set(err, FITM_ERR_NOT_FOUND,
                                "'model' = '%.100s': this server serves '%.100s'", out->model,
                                lim->model_name);
    }
    out->method = (fitm_rerank_method)lim->default_method;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "method")) && !cJSON_IsNull(it)) {
        if (!cJSON_IsString(it))
            return fitm_err_set(err, FITM_ERR_INVALID, "'method' must be a string");
        int m = fitm_rerank_method_parse(it->valuestring);
        if (m < 0)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'method' = '%.100s': must be one of calibrated, attention, "
                                "attention_sort, query_likelihood, relevance, paper, fused",
                                it->valuestring);
        out->method = (fitm_rerank_method)m;
    }
    return FITM_OK;
}

static fitm_status parse_rerank_object(const cJSON *root, const fitm_api_limits *lim,
                                       fitm_rerank_request *out, fitm_err *err)
{
    fitm_status st;
    if (!cJSON_IsObject(root))
        return fitm_err_set(err, FITM_ERR_INVALID, "the request body must be a JSON object");
    if ((st = parse_rerank_query(root, out, err)) != FITM_OK ||
        (st = parse_rerank_documents(root, lim, out, err)) != FITM_OK ||
        (st = parse_rerank_flags(root, out, err)) != FITM_OK ||
        (st = parse_rerank_run(root, lim, out, err)) != FITM_OK)
        return st;
    return parse_calibration(root, "", out, err);
}

/* ---- strict JSON: what cJSON would silently accept -------------------------------------- */

/* Where a JSON scan stands: the path of the value being read, as a client would write it
 * (`documents[3].text`), one level per open object or array. Deeper levels than FITM_JSON_DEPTH
 * are counted but not named. */
#define FITM_JSON_DEPTH 16
typedef struct {
    bool array;
    int64_t index;   /* array: the element being read         */
    const char *key; /* object: the last key (not terminated) */
    size_t key_n;
} json_level;

typedef struct {
    json_level level[FITM_JSON_DEPTH];
    int depth;
} json_path;

/* path as text into out (cap bytes, always terminated): "" at the top level. */
static void json_path_text(const json_path *p, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = '\0';
    int shown = p->depth < FITM_JSON_DEPTH ? p->depth : FITM_JSON_DEPTH;
    for (int d = 0; d < shown && n + 1 < cap; d++) {
        int w = p->level[d].array
                    ? snprintf(out + n, cap - n, "[%lld]", (long long)p->level[d].index)
                    : snprintf(out + n, cap - n, "%s%.*s", d ? "." : "",
                               (int)(p->level[d].key_n < 64 ? p->level[d].key_n : 64),
                               p->level[d].key ? p->level[d].key : "");
        n = w > 0 && (size_t)w < cap - n ? n + (size_t)w : cap - 1;
    }
    if (p->depth > shown && n + 4 < cap)
        snprintf(out + n, cap - n, "...");
}

/* Follows c, a character outside any string, in p: an object or array opens or closes, or a
 * comma moves to an array's next element. */
static void json_path_step(json_path *p, char c)
{
    int d = p->depth - 1;
    bool named = d >= 0 && d < FITM_JSON_DEPTH;
    if (c == '{' || c == '[') {
        if (p->depth < FITM_JSON_DEPTH)
            p->level[p->depth] = (json_level){.array = c == '['};
        p->depth++;
    } else if ((c == '}' || c == ']') && p->depth > 0) {
        p->depth--;
    } else if (c == ',' && named && p->level[d].array) {
        p->level[d].index++;
    }
}

/* The error for a NUL found at byte at of a string that just ended at p (is_key: an object
 * key; raw: a NUL byte rather than a \u0000 escape). A raw NUL is a control character the
 * JSON grammar refuses in a string (FITM_ERR_FORMAT, as the others); the escape is JSON this
 * server does not take (FITM_ERR_INVALID). */
static fitm_status nul_error(json_path *p, bool is_key, bool raw, size_t at, fitm_err *err)
{
    const fitm_status s = raw ? FITM_ERR_FORMAT : FITM_ERR_INVALID;
    char where[256];
    const char *what = raw ? "a NUL byte" : "a NUL character (\\u0000)";
    if (is_key)
        p->depth--; /* name the object, not the broken key */
    json_path_text(p, where, sizeof where);
    if (is_key)
        return fitm_err_set(err, s, "an object key contains %s (at byte %zu)%s%s%s", what, at,
                            where[0] ? " in '" : "", where, where[0] ? "'" : "");
    return where[0] ? fitm_err_set(err, s, "'%s' contains %s (at byte %zu)", where, what, at)
                    : fitm_err_set(err, s, "the body's string contains %s (at byte %zu)", what,
                                   at);
}

/* The first NUL character in the text of body (valid JSON): a raw NUL byte anywhere, or a
 * \u0000 escape in a string (cJSON would cut the string there and drop the rest). Names the
 * field by its full path (`documents[3].text`), or says an object key holds it. */
static fitm_status reject_nul(const char *body, size_t len, fitm_err *err)
{
    json_path p = {.depth = 0};
    const char *str = NULL; /* the string being read */
    bool nul = false, raw = false;
    size_t at = 0;
    for (size_t i = 0; i < len; i++) {
        char c = body[i];
        if (c == '\0' && !str)
            return fitm_err_set(err, FITM_ERR_FORMAT, "a NUL byte at byte %zu of the body", i);
        if (!str) {
            if (c == '"')
                str = body + i + 1;
            else
                json_path_step(&p, c);
            continue;
        }
        if (c == '\0' && !nul) {
            nul = raw = true;
            at = i;
        }
        if (c == '\\' && i + 1 < len) {
            if (!nul && i + 5 < len && !strncmp(body + i + 1, "u0000", 5)) {
                nul = true;
                at = i;
            }
            i++;
            continue;
        }
        if (c != '"')
            continue;
        size_t j = i + 1; /* the string ended: a key if a colon follows */
        while (j < len && body[j] && strchr(" \t\r\n", body[j]))
            j++;
        bool is_key = j < len && body[j] == ':';
        int d = p.depth - 1;
        if (is_key && d >= 0 && d < FITM_JSON_DEPTH) {
            p.level[d].key = str;
            p.level[d].key_n = (size_t)(body + i - str);
        }
        if (nul)
            return nul_error(&p, is_key, raw, at, err);
        str = NULL;
    }
    return FITM_OK;
}

/* Length of the RFC 8259 number at p (n bytes: the run of number characters cJSON read as
 * one), or 0 when the run is not one: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?. */
static size_t json_number_len(const char *p, size_t n)
{
    size_t i = 0;
    i += i < n && p[i] == '-';
    if (i < n && p[i] == '0')
        i++;
    else if (i < n && p[i] >= '1' && p[i] <= '9')
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    else
        return 0;
    if (i < n && p[i] == '.') {
        size_t d = ++i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == d)
            return 0;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        i += i < n && (p[i] == '+' || p[i] == '-');
        size_t d = i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == d)
            return 0;
    }
    return i == n ? n : 0;
}

/* What cJSON parses but RFC 8259 does not, in body (which cJSON parsed): a control character
 * (below U+0020) unescaped inside a string, and numbers such as 01, 1. or -.5. */
static fitm_status reject_lenient_json(const char *body, size_t len, fitm_err *err)
{
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        const unsigned char c = (unsigned char)body[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            else if (c < 0x20 && c != 0) /* NUL: reject_nul names the field */
                return fitm_err_set(err, FITM_ERR_FORMAT,
                                    "invalid JSON at byte %zu: a control character (0x%02x) in a "
                                    "string must be escaped",
                                    i, c);
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t n = 0; /* the run of number characters cJSON read as one */
            while (i + n < len && body[i + n] && strchr("0123456789+-.eE", body[i + n]))
                n++;
            if (!json_number_len(body + i, n))
                return fitm_err_set(err, FITM_ERR_FORMAT,
                                    "invalid JSON at byte %zu: '%.*s' is not a JSON number", i,
                                    (int)(n < 40 ? n : 40), body + i);
            i += n - 1;
        }
    }
    return FITM_OK;
}

/* The object members and array elements of body (JSON text not yet parsed), counted outside
 * strings in one pass: what cJSON would allocate an item for, besides the root. Counting stops
 * once it passes limit, so a body of millions of keys costs no more than limit of them. */
static int64_t count_members(const char *body, size_t len, int64_t limit)
{
    int64_t n = 0;
    bool in_str = false, opened = false; /* opened: a { or [ whose first member is next */
    for (size_t i = 0; i < len && n <= limit; i++) {
        char c = body[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
            continue;
        if (opened && c != '}' && c != ']')
            n++;
        opened = c == '{' || c == '[';
        if (c == ',')
            n++;
        else if (c == '"')
            in_str = true;
    }
    return n;
}

static uint64_t key_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* The first key of obj that an earlier member of obj already has, or NULL (also in *dup on
 * success). Linear: small objects compare pairwise, larger ones through a hash set. */
static fitm_status find_duplicate_key(const cJSON *obj, const char **dup, fitm_err *err)
{
    *dup = NULL;
    size_t m = 0;
    for (const cJSON *a = obj->child; a; a = a->next)
        m++;
    if (m <= 8) {
        for (const cJSON *a = obj->child; a && !*dup; a = a->next)
            for (const cJSON *b = a->next; b && a->string; b = b->next)
                if (b->string && !strcmp(a->string, b->string)) {
                    *dup = a->string;
                    break;
                }
        return FITM_OK;
    }
    size_t cap = 16;
    while (cap < 2 * m)
        cap *= 2;
    const char **set = calloc(cap, sizeof *set);
    if (!set)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory checking %zu keys", m);
    for (const cJSON *a = obj->child; a && !*dup; a = a->next) {
        if (!a->string)
            continue;
        size_t i = (size_t)key_hash(a->string) & (cap - 1);
        while (set[i] && strcmp(set[i], a->string))
            i = (i + 1) & (cap - 1);
        if (set[i])
            *dup = a->string;
        set[i] = a->string;
    }
    free(set);
    return FITM_OK;
}

/* A key given twice in one object, anywhere in the tree (cJSON would keep the first); path
 * (n bytes used of cap) is the node's, and names where. */
static fitm_status reject_duplicate_keys(const cJSON *node, char *path, size_t n, size_t cap,
                                         fitm_err *err)
{
    if (cJSON_IsObject(node)) {
        const char *dup = NULL;
        fitm_status st = find_duplicate_key(node, &dup, err);
        if (st != FITM_OK)
            return st;
        if (dup)
            return fitm_err_set(err, FITM_ERR_INVALID, "duplicate key '%.64s'%s%s%s", dup,
                                n ? " in '" : "", path, n ? "'" : "");
    }
    int64_t index = 0;
    for (const cJSON *a = node ? node->child : NULL; a; a = a->next, index++) {
        int w = cJSON_IsArray(node) ? snprintf(path + n, cap - n, "[%lld]", (long long)index)
                                    : snprintf(path + n, cap - n, "%s%.64s", n ? "." : "",
                                               a->string ? a->string : "");
        size_t m = w > 0 && (size_t)w < cap - n ? n + (size_t)w : n;
        fitm_status st = reject_duplicate_keys(a, path, m, cap, err);
        path[n] = '\0';
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

/* Parses a whole request body as one JSON value (nothing but whitespace after it) of at most
 * lim->max_json_members members. On success *root is the caller's to cJSON_Delete. */
static fitm_status parse_body(const char *body, size_t len, const fitm_api_limits *lim,
                              cJSON **root, fitm_err *err)
{
    *root = NULL;
    if (len == 0)
        return fitm_err_set(err, FITM_ERR_FORMAT, "invalid JSON: the request body is empty");
    if (lim->max_json_members > 0 && count_members(body, len, lim->max_json_members) >
                                         lim->max_json_members)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "the body has more than %lld object keys and array elements in all "
                            "(the server's max_json_members)",
                            (long long)lim->max_json_members);
    const char *end = NULL;
    cJSON *r = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!r) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        return fitm_err_set(err, FITM_ERR_FORMAT, "invalid JSON at byte %zu", at);
    }
    for (const char *p = end; p && p < body + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(r);
            return fitm_err_set(err, FITM_ERR_FORMAT, "invalid JSON: trailing data at byte %zu",
                                (size_t)(p - body));
        }
    }
    fitm_status st = reject_nul(body, len, err);
    if (st == FITM_OK)
        st = reject_lenient_json(body, len, err);
    char path[256] = "";
    if (st == FITM_OK)
        st = reject_duplicate_keys(r, path, 0, sizeof path, err);
    if (st != FITM_OK) {
        cJSON_Delete(r);
        return st;
    }
    *root = r;
    return FITM_OK;
}

fitm_status fitm_api_parse_rerank(const char *body, size_t len, const fitm_api_limits *lim,
                                  fitm_rerank_request *out, fitm_err *err)
{
    memset(out, 0, sizeof *out);
    fitm_score_opts_init(&out->opt);
    cJSON *root = NULL;
    fitm_status st = parse_body(body, len, lim, &root, err);
    if (st != FITM_OK)
        return st;
    st = parse_rerank_object(root, lim, out, err);
    cJSON_Delete(root);
    return st;
}

static cJSON *document_json(const fitm_rerank_doc *d)
{
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "text", d->text) ||
        (d->title_len && !cJSON_AddStringToObject(o, "title", d->title))) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static cJSON *tei_json(const fitm_rerank_request *req, const fitm_rerank_result *res)
{
    cJSON *arr = cJSON_CreateArray();
    int32_t n = res->n_results < req->top_n ? res->n_results : req->top_n;
    for (int32_t i = 0; arr && i < n; i++) {
        const fitm_rerank_doc_result *r = &res->results[i];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(arr, o) || !cJSON_AddNumberToObject(o, "index", r->index) ||
            !cJSON_AddNumberToObject(o, "score",
                                     req->raw_scores ? r->raw_score : r->relevance_score) ||
            (req->return_documents &&
             !cJSON_AddStringToObject(o, "text", req->docs[r->index].text))) {
            cJSON_Delete(arr);
            return NULL;
        }
    }
    return arr;
}

static cJSON *int_array(const int32_t *v, int64_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (int64_t i = 0; a && i < n; i++) {
        cJSON *x = cJSON_CreateNumber(v[i]);
        if (!x || !cJSON_AddItemToArray(a, x)) {
            cJSON_Delete(x);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

static bool add_span(cJSON *obj, const char *name, fitm_span s)
{
    int32_t se[2] = {(int32_t)s.start, (int32_t)s.end};
    cJSON *sp = int_array(se, 2);
    if (sp && cJSON_AddItemToObject(obj, name, sp))
        return true;
    cJSON_Delete(sp);
    return false;
}

static bool add_spans(cJSON *obj, const char *name, const fitm_span *s, int32_t n)
{
    cJSON *arr = cJSON_AddArrayToObject(obj, name);
    for (int32_t k = 0; arr && k < n; k++) {
        int32_t se[2] = {(int32_t)s[k].start, (int32_t)s[k].end};
        cJSON *sp = int_array(se, 2);
        if (!sp || !cJSON_AddItemToArray(arr, sp)) {
            cJSON_Delete(sp);
            return false;
        }
    }
    return arr != NULL;
}

/* One scored prompt's tokens into obj: prompt, spans, question, dummies (per document, in
 * request order), and null_prompt, null_spans, null_question with a null reference. */
static bool add_group_tokens(cJSON *obj, const fitm_rerank_tokens *g)
{
    cJSON *prompt = int_array(g->ids, g->n_ids);
    if (!prompt || !cJSON_AddItemToObject(obj, "prompt", prompt) ||
        !cJSON_AddNumberToObject(obj, "first_document", g->first_doc) ||
        !add_spans(obj, "spans", g->spans, g->n_docs) || !add_span(obj, "question", g->question))
        return false;
    cJSON *dums = cJSON_AddArrayToObject(obj, "dummies");
    if (!dums)
        return false;
    for (int32_t k = 0; g->dummy_tokens && k < g->n_docs; k++) {
        cJSON *d = int_array(g->dummy_tokens + g->dummy_offsets[k],
                             g->spans[k].end - g->spans[k].start);
        if (!d || !cJSON_AddItemToArray(dums, d))
            return false;
    }
    if (!g->null_ids)
        return true;
    cJSON *np = int_array(g->null_ids, g->n_null_ids);
    return np && cJSON_AddItemToObject(obj, "null_prompt", np) &&
           add_spans(obj, "null_spans", g->null_spans, g->n_docs) &&
           add_span(obj, "null_question", g->null_question);
}

/* `tokens`: the first scored prompt's fields, and `groups` with every prompt's (windows). */
static bool add_tokens(cJSON *root, const fitm_rerank_result *res)
{
    cJSON *t = cJSON_AddObjectToObject(root, "tokens");
    cJSON *groups = t ? cJSON_AddArrayToObject(t, "groups") : NULL;
    if (!groups || !add_group_tokens(t, &res->groups[0]))
        return false;
    for (int32_t g = 0; g < res->n_groups; g++) {
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(groups, o) || !add_group_tokens(o, &res->groups[g]))
            return false;
    }
    return true;
}

/* meta's scoring options (the attention methods). */
static bool add_options(cJSON *meta, const fitm_score_opts *o, int32_t n_groups)
{
    if (!cJSON_AddStringToObject(meta, "rows", fitm_score_rows_name(o->rows)) ||
        !cJSON_AddStringToObject(meta, "aggregate", fitm_score_aggregate_name(o->aggregate)) ||
        !cJSON_AddNumberToObject(meta, "skip_first", o->skip_first) ||
        !cJSON_AddStringToObject(meta, "reference", fitm_score_reference_name(o->reference)) ||
        !cJSON_AddStringToObject(meta, "dummy_source",
                                 fitm_score_dummy_source_name(o->dummy_source)) ||
        !cJSON_AddStringToObject(meta, "form", fitm_score_form_name(o->form)) ||
        !cJSON_AddStringToObject(meta, "head_query",
                                 fitm_score_head_query_name(o->head_query)) ||
        !cJSON_AddNumberToObject(meta, "sink_factor", o->sink_factor) ||
        !cJSON_AddNumberToObject(meta, "window", o->window) ||
        !cJSON_AddNumberToObject(meta, "groups", n_groups) ||
        !cJSON_AddNumberToObject(meta, "score_scale", o->score_scale) ||
        !cJSON_AddNumberToObject(meta, "score_bias", o->score_bias))
        return false;
    if (!o->heads)
        return true;
    cJSON *heads = cJSON_AddArrayToObject(meta, "heads");
    for (int32_t i = 0; heads && i < o->n_heads; i++) {
        cJSON *pr = int_array(o->heads + 2 * i, 2);
        if (!pr || !cJSON_AddItemToArray(heads, pr)) {
            cJSON_Delete(pr);
            return false;
        }
    }
    return heads != NULL;
}

/* The "results" array of a Cohere-form rerank answer, the top_n best first; false when out of
 * memory. */
static bool add_rerank_results(cJSON *root, const fitm_rerank_request *req,
                               const fitm_rerank_result *res)
{
    cJSON *results = cJSON_AddArrayToObject(root, "results");
    if (!results)
        return false;
    int32_t n = res->n_results < req->top_n ? res->n_results : req->top_n;
    for (int32_t i = 0; i < n; i++) {
        const fitm_rerank_doc_result *r = &res->results[i];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(results, o))
            return false;
        if (!cJSON_AddNumberToObject(o, "index", r->index) ||
            !cJSON_AddNumberToObject(o, "relevance_score", r->relevance_score))
            return false;
        if (req->return_documents) {
            cJSON *d = document_json(&req->docs[r->index]);
            if (!d || !cJSON_AddItemToObject(o, "document", d))
                return false;
        }
        if (!cJSON_AddNumberToObject(o, "position", r->position) ||
            !cJSON_AddNumberToObject(o, "calibrated_attention", r->calibrated_attention) ||
            !cJSON_AddNumberToObject(o, "attention", r->attention) ||
            !cJSON_AddNumberToObject(o, "dummy_attention", r->dummy_attention) ||
            (res->meta.has_opts && !cJSON_AddNumberToObject(o, "weight", r->weight)))
            return false;
    }
    return true;
}

/* The "meta" object of a Cohere-form rerank answer: method, timings, layers and the options
 * that scored it; false when out of memory. */
static bool add_rerank_meta(cJSON *root, const fitm_rerank_result *res)
{
    cJSON *meta = cJSON_AddObjectToObject(root, "meta");
    if (!meta || !cJSON_AddStringToObject(meta, "method", fitm_rerank_method_name(res->meta.method)) ||
        !cJSON_AddStringToObject(meta, "position_method",
                                 fitm_position_method_name(res->meta.position)))
        return false;
    cJSON *tm = cJSON_AddObjectToObject(meta, "timings_ms");
    if (!tm || !cJSON_AddNumberToObject(tm, "queue", res->meta.queue_ms) ||
        !cJSON_AddNumberToObject(tm, "tokenize", res->meta.tokenize_ms) ||
        !cJSON_AddNumberToObject(tm, "forward", res->meta.forward_ms) ||
        !cJSON_AddNumberToObject(tm, "total", res->meta.total_ms))
        return false;
    cJSON *layers = int_array(res->meta.layers, res->meta.n_layers);
    if (!layers || !cJSON_AddItemToObject(meta, "layers", layers))
        return false;
    if (res->meta.has_opts &&
        (!cJSON_AddNumberToObject(meta, "temperature", res->meta.temperature) ||
         !add_options(meta, &res->meta.opts, res->meta.n_groups)))
        return false;
    if (res->meta.profile[0] && !cJSON_AddStringToObject(meta, "profile", res->meta.profile))
        return false;
    if (res->meta.method == FITM_RERANK_FUSED &&
        (!cJSON_AddNumberToObject(meta, "fuse_weight", res->meta.opts.fuse_weight) ||
         !cJSON_AddNumberToObject(meta, "fuse_scale", res->meta.opts.fuse_scale) ||
         !cJSON_AddNumberToObject(meta, "fuse_bias", res->meta.opts.fuse_bias)))
        return false;
    if ((res->meta.method == FITM_RERANK_FUSED ||
         res->meta.method == FITM_RERANK_QUERY_LIKELIHOOD) &&
        !cJSON_AddStringToObject(meta, "passages",
                                 fitm_score_passages_name(res->meta.opts.passages)))
        return false;
    return true;
}

char *fitm_api_write_rerank(const fitm_rerank_request *req, const fitm_rerank_result *res,
                            const char *id, const char *model)
{
    char *out = NULL;
    if (req->tei) {
        cJSON *arr = tei_json(req, res);
        if (arr)
            out = cJSON_PrintUnformatted(arr);
        cJSON_Delete(arr);
        return out;
    }
    cJSON *root = cJSON_CreateObject();
    if (!root || !cJSON_AddStringToObject(root, "id", id) ||
        !cJSON_AddStringToObject(root, "model", model))
        goto done;
    if (!add_rerank_results(root, req, res))
        goto done;
    cJSON *usage = cJSON_AddObjectToObject(root, "usage");
    if (!usage || !cJSON_AddNumberToObject(usage, "prompt_tokens", (double)res->usage.prompt_tokens) ||
        !cJSON_AddNumberToObject(usage, "forward_tokens", (double)res->usage.forward_tokens) ||
        !cJSON_AddNumberToObject(usage, "total_tokens", (double)res->usage.total_tokens))
        goto done;
    if (!add_rerank_meta(root, res))
        goto done;
    if (req->return_tokens && res->n_groups > 0 && !add_tokens(root, res))
        goto done;
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

char *fitm_api_write_models(const char *model, int64_t created_s, int64_t n_ctx,
                            const char *arch, bool one)
{
    cJSON *m = cJSON_CreateObject();
    bool ok = m && cJSON_AddStringToObject(m, "id", model) &&
              cJSON_AddStringToObject(m, "object", "model") &&
              cJSON_AddNumberToObject(m, "created", (double)created_s) &&
              cJSON_AddStringToObject(m, "owned_by", "fitm") &&
              cJSON_AddNumberToObject(m, "context_length", (double)n_ctx) &&
              cJSON_AddStringToObject(m, "architecture", arch ? arch : "");
    cJSON *root = m;
    if (ok && !one) { /* the list holds the one model */
        cJSON *data = NULL;
        root = cJSON_CreateObject();
        const bool held = root && (data = cJSON_AddArrayToObject(root, "data")) &&
                          cJSON_AddItemToArray(data, m);
        if (!held) /* m is not in root: freed on its own */
            cJSON_Delete(m);
        ok = held && cJSON_AddStringToObject(root, "object", "list");
    }
    char *out = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return out;
}

char *fitm_api_write_health(const char *status, const char *message)
{
    char *out = NULL;
    cJSON *root = cJSON_CreateObject();
    if (root && cJSON_AddStringToObject(root, "status", status) &&
        (!message || cJSON_AddStringToObject(root, "message", message)))
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* ---- POST /answer ---------------------------------------------------------------------- */

static fitm_status parse_stop(const cJSON *it, fitm_answer_request *out, fitm_err *err)
{
    bool one = cJSON_IsString(it);
    if (!one && !cJSON_IsArray(it))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'stop' must be a string or an array of strings");
    int n = one ? 1 : cJSON_GetArraySize(it);
    if (n > FITM_ANSWER_MAX_STOP)
        return fitm_err_set(err, FITM_ERR_INVALID, "'stop' has %d strings, more than %d", n,
                            FITM_ANSWER_MAX_STOP);
    if (n == 0)
        return FITM_OK;
    out->stop = calloc((size_t)n, sizeof *out->stop);
    if (!out->stop)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, one ? "stop" : "stop[%d]", i);
        size_t len = 0;
        fitm_status st = take_string(one ? it : cJSON_GetArrayItem(it, i), name, &out->stop[i],
                                     &len, err);
        if (st != FITM_OK)
            return st;
        out->n_stop = i + 1;
        size_t chars = 0; /* code points: what the spec's maxLength counts */
        for (size_t j = 0; j < len; j++)
            chars += ((unsigned char)out->stop[i][j] & 0xC0) != 0x80;
        if (len == 0 || chars > FITM_ANSWER_MAX_STOP_CHARS)
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must have 1 to %d characters",
                                name, FITM_ANSWER_MAX_STOP_CHARS);
    }
    return FITM_OK;
}

static fitm_status take_number(const cJSON *it, const char *field, double lo, double hi,
                               double *v, fitm_err *err)
{
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' must be a number", field);
    if (it->valuedouble < lo || it->valuedouble > hi)
        return fitm_err_set(err, FITM_ERR_INVALID, "'%s' = %g is out of range [%g, %g]", field,
                            it->valuedouble, lo, hi);
    *v = it->valuedouble;
    return FITM_OK;
}

static fitm_status parse_answer_options(const cJSON *root, fitm_answer_request *out,
                                        fitm_err *err);

/* The sampling fields /answer and the OpenAI routes share: stop, temperature (in [0,
 * temperature_max]; absent keeps out's default), top_p (default 1, > 0), top_k (an integer
 * in [-1, 64]; -1, vLLM's "off", and 0 mean all 64 candidates), min_p (in [0, 1], default 0)
 * and seed (an exact integer in [0, 2^53 - 1]). */
static fitm_status parse_sampling(const cJSON *root, double temperature_max,
                                  fitm_answer_request *out, fitm_err *err)
{
    const cJSON *it;
    fitm_status st;
    int64_t v;
    /* Given (even as []), stop replaces the answer template's stop string. */
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "stop")) && !cJSON_IsNull(it)) {
        out->has_stop = true;
        if ((st = parse_stop(it, out, err)) != FITM_OK)
            return st;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "temperature")) && !cJSON_IsNull(it) &&
        (st = take_number(it, "temperature", 0, temperature_max, &out->temperature, err)) !=
            FITM_OK)
        return st;
    out->top_p = 1.0;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "top_p")) && !cJSON_IsNull(it)) {
        if ((st = take_number(it, "top_p", 0, 1, &out->top_p, err)) != FITM_OK)
            return st;
        if (out->top_p <= 0)
            return fitm_err_set(err, FITM_ERR_INVALID, "'top_p' must be > 0");
    }
    out->top_k = 0;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "top_k")) && !cJSON_IsNull(it)) {
        if ((st = take_int(it, "top_k", -1, INT32_MAX, &v, err)) != FITM_OK)
            return st;
        if (v > FITM_TOP_MAX)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'top_k' = %lld: this server draws from the %d most likely "
                                "tokens at most (send 1 to %d, or 0 for all %d)",
                                (long long)v, FITM_TOP_MAX, FITM_TOP_MAX, FITM_TOP_MAX);
        out->top_k = v < 0 ? 0 : (int32_t)v;
    }
    out->min_p = 0.0;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "min_p")) && !cJSON_IsNull(it) &&
        (st = take_number(it, "min_p", 0, 1, &out->min_p, err)) != FITM_OK)
        return st;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "seed")) && !cJSON_IsNull(it)) {
        if ((st = take_int(it, "seed", 0, INT64_C(9007199254740991), &v, err)) != FITM_OK)
            return st;
        out->seed = (uint64_t)v;
        out->has_seed = true;
    }
    return FITM_OK;
}

static fitm_status parse_answer_object(const cJSON *root, const fitm_api_limits *lim,
                                       fitm_answer_request *out, fitm_err *err)
{
    if (!cJSON_IsObject(root))
        return fitm_err_set(err, FITM_ERR_INVALID, "the request body must be a JSON object");
    /* The fields /answer shares with /rerank, parsed by /rerank's parser from a view of
     * just those (so /answer's own `temperature` is not taken for the calibration's). */
    static const char *const shared[] = {"query",        "documents",    "max_tokens_per_doc",
                                         "model",        "return_tokens", "position_method"};
    cJSON *view = cJSON_CreateObject();
    if (!view)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < sizeof shared / sizeof shared[0]; i++) {
        cJSON *it = cJSON_GetObjectItemCaseSensitive(root, shared[i]);
        if (it && !cJSON_AddItemReferenceToObject(view, shared[i], it)) {
            cJSON_Delete(view);
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        }
    }
    fitm_status st = parse_rerank_object(view, lim, &out->base, err);
    cJSON_Delete(view);
    if (st != FITM_OK)
        return st;

    const cJSON *it;
    int64_t v;
    out->max_tokens = lim->max_answer_tokens < 256 ? lim->max_answer_tokens : 256;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "max_tokens")) && !cJSON_IsNull(it)) {
        if ((st = take_max_tokens(it, "max_tokens", lim, &v, err)) != FITM_OK)
            return st;
        out->max_tokens = (int32_t)v;
    }
    if ((st = parse_sampling(root, 100, out, err)) != FITM_OK)
        return st;
    return parse_answer_options(root, out, err);
}

/* The reorder of an answer's documents: 'reorder' (a rerank method or none),
 * 'reorder_placement' (first or last) and 'top_n' (how many of them the prompt keeps). */
static fitm_status parse_reorder(const cJSON *root, fitm_answer_request *out, fitm_err *err)
{
    const cJSON *it;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "reorder")) && !cJSON_IsNull(it)) {
        int m = cJSON_IsString(it) ? fitm_rerank_method_parse(it->valuestring) : -1;
        if (cJSON_IsString(it) && !strcmp(it->valuestring, "none"))
            m = -2;
        if (m == -1)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'reorder' must be one of none, calibrated, attention, "
                                "attention_sort, query_likelihood, relevance, paper, fused");
        out->reorder = m < 0 ? -1 : m;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "top_n")) && !cJSON_IsNull(it)) {
        int64_t v = 0;
        fitm_status st = take_int(it, "top_n", 0, FITM_ANSWER_MAX_TOP_N, &v, err);
        if (st != FITM_OK)
            return st;
        out->top_n = (int32_t)v;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "reorder_placement")) && !cJSON_IsNull(it)) {
        bool first = cJSON_IsString(it) && !strcmp(it->valuestring, "first");
        out->reorder_last = cJSON_IsString(it) && !strcmp(it->valuestring, "last");
        if (!first && out->reorder_last != 1)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'reorder_placement' must be \"first\" or \"last\"");
    }
    return FITM_OK;
}

/* 'intervention_layers' when given: 1 to FITM_RERANK_MAX_LAYERS layer indices. */
static fitm_status parse_intervention_layers(const cJSON *root, fitm_answer_request *out,
                                             fitm_err *err)
{
    fitm_status st;
    const cJSON *it;
    int64_t v;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "intervention_layers")) &&
        !cJSON_IsNull(it)) {
        int n = cJSON_IsArray(it) ? cJSON_GetArraySize(it) : 0;
        if (n == 0 || n > FITM_RERANK_MAX_LAYERS)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'intervention_layers' must be an array of 1 to %d integers",
                                FITM_RERANK_MAX_LAYERS);
        out->intervene_layers = calloc((size_t)n, sizeof *out->intervene_layers);
        if (!out->intervene_layers)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        out->n_intervene_layers = n;
        for (int i = 0; i < n; i++) {
            char name[48];
            snprintf(name, sizeof name, "intervention_layers[%d]", i);
            if ((st = take_int(cJSON_GetArrayItem(it, i), name, -FITM_RERANK_MAX_LAYERS,
                               FITM_RERANK_MAX_LAYERS - 1, &v, err)) != FITM_OK)
                return st;
            out->intervene_layers[i] = (int32_t)v;
        }
    }
    return FITM_OK;
}

/* The options of the calibrated answer that /answer and the OpenAI routes share: calibrate,
 * calibration, reorder, intervention_layers and stream. */
static fitm_status parse_answer_options(const cJSON *root, fitm_answer_request *out,
                                        fitm_err *err)
{
    fitm_status st;
    const cJSON *it;
    /* calibrate, reorder and reorder_placement left out: the server's defaults (the model's
     * profile, the config), filled in by the pipeline. */
    out->calibrate = out->reorder = out->reorder_last = out->top_n = FITM_ANSWER_UNSET;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "calibrate")) && !cJSON_IsNull(it)) {
        bool b = false;
        if ((st = take_bool(it, "calibrate", &b, err)) != FITM_OK)
            return st;
        out->calibrate = b;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "ignore_eos")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "ignore_eos", &out->ignore_eos, err)) != FITM_OK)
        return st;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "calibration")) && !cJSON_IsNull(it)) {
        if (!cJSON_IsObject(it))
            return fitm_err_set(err, FITM_ERR_INVALID, "'calibration' must be an object");
        if ((st = parse_calibration(it, "calibration.", &out->base, err)) != FITM_OK)
            return st;
    }
    if ((st = parse_reorder(root, out, err)) != FITM_OK ||
        (st = parse_intervention_layers(root, out, err)) != FITM_OK)
        return st;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "stream")) && !cJSON_IsNull(it) &&
        (st = take_bool(it, "stream", &out->stream, err)) != FITM_OK)
        return st;
    return FITM_OK;
}

fitm_status fitm_api_parse_answer(const char *body, size_t len, const fitm_api_limits *lim,
                                  fitm_answer_request *out, fitm_err *err)
{
    memset(out, 0, sizeof *out);
    fitm_score_opts_init(&out->base.opt);
    cJSON *root = NULL;
    fitm_status st = parse_body(body, len, lim, &root, err);
    if (st != FITM_OK)
        return st;
    st = parse_answer_object(root, lim, out, err);
    cJSON_Delete(root);
    return st;
}

/* An integer written as one (cJSON's doubles print large ones in exponent form). */
static bool add_uint(cJSON *obj, const char *name, uint64_t v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
    return cJSON_AddRawToObject(obj, name, buf) != NULL;
}

/* The "meta" object of an /answer answer: the options it ran with and its timings; false when
 * out of memory. */
static bool add_answer_meta(cJSON *root, const fitm_answer_request *req,
                            const fitm_answer_result *res, double queue_ms, double total_ms)
{
    cJSON *meta = cJSON_AddObjectToObject(root, "meta");
    if (!meta || !cJSON_AddBoolToObject(meta, "calibrate", res->calibrate == 1) ||
        !cJSON_AddStringToObject(meta, "reorder",
                                 res->reorder < 0 ? "none"
                                                  : fitm_rerank_method_name(
                                                        (fitm_rerank_method)res->reorder)) ||
        !cJSON_AddStringToObject(meta, "reorder_placement",
                                 res->reorder_last == 1 ? "last" : "first") ||
        !cJSON_AddNumberToObject(meta, "top_n", res->top_n) ||
        !cJSON_AddStringToObject(
            meta, "position_method",
            fitm_position_method_name((fitm_position_method)res->position_method)) ||
        !add_uint(meta, "seed", req->seed))
        return false;
    cJSON *tm = cJSON_AddObjectToObject(meta, "timings_ms");
    if (!tm || !cJSON_AddNumberToObject(tm, "queue", queue_ms) ||
        !cJSON_AddNumberToObject(tm, "rank", res->rank_ms) ||
        !cJSON_AddNumberToObject(tm, "prefill", res->prefill_ms) ||
        !cJSON_AddNumberToObject(tm, "decode", res->decode_ms) ||
        !cJSON_AddNumberToObject(tm, "first_token", res->first_token_ms) ||
        !cJSON_AddNumberToObject(tm, "total", total_ms))
        return false;
    return true;
}

/* The "tokens" object of an /answer answer: prompt and completion ids and each document's
 * span; false when out of memory. */
static bool add_answer_tokens(cJSON *root, const fitm_answer_result *res)
{
    cJSON *t = cJSON_AddObjectToObject(root, "tokens");
    cJSON *p = int_array(res->tokens, res->prompt_tokens);
    if (!t || !p || !cJSON_AddItemToObject(t, "prompt", p))
        return false;
    cJSON *c = int_array(res->tokens + res->prompt_tokens, res->completion_tokens);
    if (!c || !cJSON_AddItemToObject(t, "completion", c))
        return false;
    cJSON *spans = cJSON_AddArrayToObject(t, "spans");
    for (int32_t k = 0; spans && res->spans && k < res->n_docs; k++) {
        int32_t se[2] = {(int32_t)res->spans[k].start, (int32_t)res->spans[k].end};
        cJSON *sp = res->docs[k].position >= 0 ? int_array(se, 2) : cJSON_CreateNull();
        if (!sp || !cJSON_AddItemToArray(spans, sp))
            return false;
    }
    return spans != NULL;
}

/* The field `documents` of /answer's answer and the OpenAI routes' extension: each document's
 * index, position (null when top_n left it out), weight and calibrated attention. */
static bool add_answer_docs(cJSON *root, const fitm_answer_result *res)
{
    cJSON *docs = cJSON_AddArrayToObject(root, "documents");
    for (int32_t k = 0; docs && k < res->n_docs; k++) {
        const fitm_answer_doc *d = &res->docs[k];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(docs, o)) {
            cJSON_Delete(o);
            return false;
        }
        if (!cJSON_AddNumberToObject(o, "index", d->index) ||
            !(d->position >= 0 ? cJSON_AddNumberToObject(o, "position", d->position)
                               : cJSON_AddNullToObject(o, "position")) ||
            !cJSON_AddNumberToObject(o, "weight", d->weight) ||
            !cJSON_AddNumberToObject(o, "calibrated_attention", d->calibrated_attention))
            return false;
    }
    return docs != NULL;
}

char *fitm_api_write_answer(const fitm_answer_request *req, const fitm_answer_result *res,
                            const char *id, const char *model, double queue_ms, double total_ms,
                            bool with_answer)
{
    char *out = NULL;
    cJSON *root = cJSON_CreateObject();
    if (!root || !cJSON_AddStringToObject(root, "id", id) ||
        !cJSON_AddStringToObject(root, "object", "answer") ||
        !cJSON_AddStringToObject(root, "model", model))
        goto done;
    if (with_answer) {
        cJSON *a = text_item(res->answer ? res->answer : "", res->answer_len);
        if (!a || !cJSON_AddItemToObject(root, "answer", a))
            goto done;
    }
    if (!cJSON_AddStringToObject(root, "finish_reason", fitm_answer_finish_name(res->finish)))
        goto done;
    if (!add_answer_docs(root, res))
        goto done;
    cJSON *usage = cJSON_AddObjectToObject(root, "usage");
    if (!usage || !cJSON_AddNumberToObject(usage, "prompt_tokens", (double)res->prompt_tokens) ||
        !cJSON_AddNumberToObject(usage, "completion_tokens", (double)res->completion_tokens) ||
        !cJSON_AddNumberToObject(usage, "total_tokens",
                                 (double)(res->prompt_tokens + res->completion_tokens)) ||
        !cJSON_AddNumberToObject(usage, "forward_tokens", (double)res->forward_tokens))
        goto done;
    if (!add_answer_meta(root, req, res, queue_ms, total_ms))
        goto done;
    if (req->base.return_tokens && res->tokens && !add_answer_tokens(root, res))
        goto done;
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

char *fitm_api_write_answer_delta(const char *text, size_t len)
{
    char *out = NULL;
    cJSON *root = cJSON_CreateObject();
    cJSON *t = text_item(text, len);
    if (root && t && cJSON_AddItemToObject(root, "delta", t))
        out = cJSON_PrintUnformatted(root);
    else
        cJSON_Delete(t);
    cJSON_Delete(root);
    return out;
}

/* ---- the OpenAI routes: POST /v1/chat/completions and /v1/completions ------------------ */

/* A message's content: a string, null (an assistant turn that only called tools: ""), or an
 * array of parts of which the {type: "text", text} ones are joined. */
static fitm_status take_content(const cJSON *it, const char *field, char **dst, fitm_err *err)
{
    if (!it || cJSON_IsNull(it)) {
        *dst = calloc(1, 1);
        return *dst ? FITM_OK : fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    if (cJSON_IsString(it))
        return take_string(it, field, dst, NULL, err);
    if (!cJSON_IsArray(it))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'%s' must be a string or an array of {type: text, text} parts",
                            field);
    size_t total = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, it)
    {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 ||
            !cJSON_IsString(text))
            return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                                "'%s': only text parts ({type: text, text}) are supported", field);
        if (!fitm_api_utf8_valid(text->valuestring, strlen(text->valuestring)))
            return fitm_err_set(err, FITM_ERR_INVALID, "'%s' is not valid UTF-8", field);
        total += strlen(text->valuestring);
    }
    char *s = malloc(total + 1);
    if (!s)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    size_t o = 0;
    cJSON_ArrayForEach(part, it)
    {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        memcpy(s + o, t, strlen(t));
        o += strlen(t);
    }
    s[o] = '\0';
    *dst = s;
    return FITM_OK;
}

static fitm_status parse_messages(const cJSON *arr, fitm_answer_request *out, fitm_err *err)
{
    int n = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : 0;
    if (n < 1)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'messages' must be a non-empty array of {role, content}");
    if (n > 4096)
        return fitm_err_set(err, FITM_ERR_LIMIT, "'messages' has %d entries, more than 4096", n);
    out->messages = calloc((size_t)n, sizeof *out->messages);
    if (!out->messages)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        const cJSON *m = cJSON_GetArrayItem(arr, i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        char name[48];
        snprintf(name, sizeof name, "messages[%d].role", i);
        static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
        size_t r = 0;
        while (cJSON_IsString(role) && r < 5 && strcmp(role->valuestring, roles[r]) != 0)
            r++;
        if (!cJSON_IsObject(m) || !cJSON_IsString(role) || r == 5)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'%s' must be one of system, developer, user, assistant, tool",
                                name);
        /* developer is OpenAI's newer name for system */
        out->messages[i].role = strdup(r == 1 ? "system" : roles[r]);
        out->n_messages = i + 1;
        if (!out->messages[i].role)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        snprintf(name, sizeof name, "messages[%d].content", i);
        fitm_status st = take_content(cJSON_GetObjectItemCaseSensitive(m, "content"), name,
                                      &out->messages[i].content, err);
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

/* The retrieved documents of the extension field: the calibrated answer's query is the last
 * user message (chat) or the prompt (completions). */
static fitm_status parse_openai_documents(const cJSON *root, const fitm_api_limits *lim,
                                          bool chat, fitm_answer_request *out, fitm_err *err)
{
    fitm_rerank_request *b = &out->base;
    fitm_status st = parse_documents(cJSON_GetObjectItemCaseSensitive(root, "documents"),
                                     "documents", lim, b, err);
    if (st != FITM_OK)
        return st;
    const char *q = NULL;
    for (int32_t i = out->n_messages - 1; i >= 0 && !q; i--)
        if (!chat || !strcmp(out->messages[i].role, "user"))
            q = out->messages[i].content;
    if (!q)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'documents' need a user message (the question)");
    if (blank_text(q)) /* as /answer's 'query' */
        return fitm_err_set(err, FITM_ERR_INVALID,
                            chat ? "'documents' need a question: the last user message is empty"
                                 : "'documents' need a question: 'prompt' is empty");
    b->query = strdup(q);
    if (!b->query)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    b->query_len = strlen(q);
    b->top_n = b->n_docs;
    b->method = FITM_RERANK_CALIBRATED;
    b->prefix_reuse = true;
    b->position = -1; /* the server's position_method */
    b->max_tokens_per_doc = lim->max_tokens_per_doc;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, "max_tokens_per_doc");
    int64_t v;
    if (it && !cJSON_IsNull(it)) {
        if ((st = take_int(it, "max_tokens_per_doc", 1, INT32_MAX, &v, err)) != FITM_OK)
            return st;
        if (v < lim->max_tokens_per_doc)
            b->max_tokens_per_doc = (int32_t)v;
    }
    return parse_answer_options(root, out, err);
}

/* How an OpenAI field this server cannot honour says "nothing": the one value, besides null,
 * that it accepts. */
typedef enum {
    OFF_FALSE,
    OFF_ZERO,
    OFF_ONE,
    OFF_EMPTY_OBJECT,
    OFF_EMPTY_ARRAY,
    OFF_EMPTY_TEXT
} off_form;

static const struct {
    const char *name;
    off_form off;
    const char *why;
} unsupported_openai[] = {
    {"logit_bias", OFF_EMPTY_OBJECT, "this server cannot bias tokens"},
    {"logprobs", OFF_FALSE, "this server does not return token log-probabilities"},
    {"top_logprobs", OFF_ZERO, "this server does not return token log-probabilities"},
    {"best_of", OFF_ONE, "this server generates one completion"},
    {"presence_penalty", OFF_ZERO, "this server does not penalise tokens"},
    {"frequency_penalty", OFF_ZERO, "this server does not penalise tokens"},
    {"repetition_penalty", OFF_ONE, "this server does not penalise tokens"},
    {"echo", OFF_FALSE, "the completion does not repeat the prompt"},
    {"suffix", OFF_EMPTY_TEXT, "this server does not insert text"},
    {"tools", OFF_EMPTY_ARRAY, "this server does not call tools"},
    {"functions", OFF_EMPTY_ARRAY, "this server does not call tools"},
};

static bool asks_nothing(const cJSON *it, off_form off)
{
    switch (off) {
    case OFF_FALSE:
        return cJSON_IsFalse(it);
    case OFF_ZERO:
    case OFF_ONE:
        return cJSON_IsNumber(it) && it->valuedouble == (off == OFF_ONE);
    case OFF_EMPTY_OBJECT:
        return cJSON_IsObject(it) && !it->child;
    case OFF_EMPTY_ARRAY:
        return cJSON_IsArray(it) && !it->child;
    case OFF_EMPTY_TEXT:
        return cJSON_IsString(it) && !it->valuestring[0];
    }
    return false;
}

/* OpenAI fields this server cannot honour: refused (400, naming the field) unless null or in
 * the form that asks for nothing (false, 0 or 1 as each means "off", {}, [] or "" for none,
 * tool_choice none or auto, response_format {type: text}), so a client that asked for JSON
 * mode, logprobs, penalties or tools knows it did not get them. */
static fitm_status refuse_unsupported_openai(const cJSON *root, fitm_err *err)
{
    static const char *const off_text[] = {"false", "0", "1", "{}", "[]", "\"\""};
    const cJSON *it;
    for (size_t i = 0; i < sizeof unsupported_openai / sizeof unsupported_openai[0]; i++)
        if ((it = cJSON_GetObjectItemCaseSensitive(root, unsupported_openai[i].name)) &&
            !cJSON_IsNull(it) && !asks_nothing(it, unsupported_openai[i].off))
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'%s' is not supported: %s (leave it out, or send %s)",
                                unsupported_openai[i].name, unsupported_openai[i].why,
                                off_text[unsupported_openai[i].off]);
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "tool_choice")) && !cJSON_IsNull(it) &&
        !(cJSON_IsString(it) && (!strcmp(it->valuestring, "none") ||
                                 !strcmp(it->valuestring, "auto"))))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'tool_choice' is not supported: this server does not call tools "
                            "(leave it out, or send \"none\")");
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "response_format")) && !cJSON_IsNull(it)) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(it, "type");
        if (!cJSON_IsObject(it) || !cJSON_IsString(type))
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'response_format' must be an object with a string 'type'");
        if (strcmp(type->valuestring, "text"))
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "'response_format' type '%.40s' is not supported: this server "
                                "cannot constrain its output (only {\"type\": \"text\"})",
                                type->valuestring);
    }
    return FITM_OK;
}

/* A completion's 'prompt' (a string, or an array of one string), as the one raw message. */
static fitm_status parse_openai_prompt(const cJSON *root, fitm_answer_request *out,
                                       fitm_err *err)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 1)
        it = cJSON_GetArrayItem(it, 0);
    if (!cJSON_IsString(it))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'prompt' must be a string (or an array of one string)");
    out->messages = calloc(1, sizeof *out->messages);
    if (!out->messages)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    out->n_messages = 1;
    out->raw_prompt = true;
    out->messages[0].role = strdup("prompt");
    if (!out->messages[0].role)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    return take_string(it, "prompt", &out->messages[0].content, NULL, err);
}

/* The answer's options of an OpenAI body without documents. They have no effect, but a
 * malformed one is refused as it would be with documents: a field means one thing whatever
 * else is sent. They are parsed into a scratch request (stream included) and only `stream`
 * and `ignore_eos` are kept. */
static fitm_status parse_openai_plain_options(const cJSON *root, fitm_answer_request *out,
                                              fitm_err *err)
{
    fitm_status st;
    int64_t v;
    fitm_answer_request scratch = {0};
    fitm_score_opts_init(&scratch.base.opt);
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, "max_tokens_per_doc");
    if (it && !cJSON_IsNull(it))
        st = take_int(it, "max_tokens_per_doc", 1, INT32_MAX, &v, err);
    else
        st = FITM_OK;
    if (st == FITM_OK)
        st = parse_answer_options(root, &scratch, err);
    out->stream = scratch.stream;
    out->ignore_eos = scratch.ignore_eos;
    fitm_answer_request_free(&scratch);
    return st;
}

static fitm_status parse_openai_object(const cJSON *root, const fitm_api_limits *lim, bool chat,
                                       fitm_answer_request *out, bool *include_usage,
                                       fitm_err *err)
{
    if (!cJSON_IsObject(root))
        return fitm_err_set(err, FITM_ERR_INVALID, "the request body must be a JSON object");
    fitm_status st;
    if ((st = refuse_unsupported_openai(root, err)) != FITM_OK)
        return st;
    const cJSON *it;
    int64_t v;
    if (chat) {
        if ((st = parse_messages(cJSON_GetObjectItemCaseSensitive(root, "messages"), out, err)) !=
            FITM_OK)
            return st;
    } else if ((st = parse_openai_prompt(root, out, err)) != FITM_OK) {
        return st;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "model")) && !cJSON_IsNull(it)) {
        if ((st = take_string(it, "model", &out->base.model, NULL, err)) != FITM_OK)
            return st;
        if (lim->strict_model && lim->model_name && strcmp(out->base.model, lim->model_name))
            return fitm_err_set(err, FITM_ERR_NOT_FOUND,
                                "'model' = '%.100s': this server serves '%.100s'",
                                out->base.model, lim->model_name);
    }
    out->max_tokens = lim->max_answer_tokens < 256 ? lim->max_answer_tokens : 256;
    static const char *const max_names[] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++)
        if ((it = cJSON_GetObjectItemCaseSensitive(root, max_names[i])) && !cJSON_IsNull(it)) {
            if ((st = take_max_tokens(it, max_names[i], lim, &v, err)) != FITM_OK)
                return st;
            out->max_tokens = (int32_t)v;
        }
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "n")) && !cJSON_IsNull(it) &&
        (st = take_int(it, "n", 1, 1, &v, err)) != FITM_OK)
        return st;
    out->temperature = 1.0; /* OpenAI's default: sampling */
    if ((st = parse_sampling(root, 2, out, err)) != FITM_OK)
        return st;
    *include_usage = false;
    if ((it = cJSON_GetObjectItemCaseSensitive(root, "stream_options")) && !cJSON_IsNull(it)) {
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(it, "include_usage");
        if (!cJSON_IsObject(it) ||
            (u && !cJSON_IsNull(u) &&
             (st = take_bool(u, "stream_options.include_usage", include_usage, err)) != FITM_OK))
            return cJSON_IsObject(it) ? st
                                      : fitm_err_set(err, FITM_ERR_INVALID,
                                                     "'stream_options' must be an object");
    }
    it = cJSON_GetObjectItemCaseSensitive(root, "documents");
    if (it && !cJSON_IsNull(it))
        return parse_openai_documents(root, lim, chat, out, err);
    return parse_openai_plain_options(root, out, err);
}

fitm_status fitm_api_parse_openai(const char *body, size_t len, const fitm_api_limits *lim,
                                  bool chat, fitm_answer_request *out, bool *include_usage,
                                  fitm_err *err)
{
    memset(out, 0, sizeof *out);
    fitm_score_opts_init(&out->base.opt);
    *include_usage = false;
    cJSON *root = NULL;
    fitm_status st = parse_body(body, len, lim, &root, err);
    if (st != FITM_OK)
        return st;
    st = parse_openai_object(root, lim, chat, out, include_usage, err);
    cJSON_Delete(root);
    return st;
}

static bool add_openai_usage(cJSON *root, const fitm_answer_result *res)
{
    cJSON *u = cJSON_AddObjectToObject(root, "usage");
    return u && cJSON_AddNumberToObject(u, "prompt_tokens", (double)res->prompt_tokens) &&
           cJSON_AddNumberToObject(u, "completion_tokens", (double)res->completion_tokens) &&
           cJSON_AddNumberToObject(u, "total_tokens",
                                   (double)(res->prompt_tokens + res->completion_tokens));
}

/* The envelope every OpenAI response and chunk shares. */
static cJSON *openai_envelope(const fitm_api_openai_head *h, bool chunk)
{
    cJSON *root = cJSON_CreateObject();
    const char *object = h->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                 : "text_completion";
    if (!root || !cJSON_AddStringToObject(root, "id", h->id) ||
        !cJSON_AddStringToObject(root, "object", object) ||
        !cJSON_AddNumberToObject(root, "created", (double)h->created) ||
        !cJSON_AddStringToObject(root, "model", h->model) ||
        !cJSON_AddStringToObject(root, "system_fingerprint", "fitm")) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* One choice: chat's {index, message|delta: {role?, content?}, finish_reason, logprobs},
 * completions' {index, text, finish_reason, logprobs}. text NULL: no content. */
static bool add_choice(cJSON *choices, bool chat, bool chunk, bool role, const char *text,
                       size_t len, const char *finish)
{
    cJSON *c = cJSON_CreateObject();
    if (!c || !cJSON_AddItemToArray(choices, c)) {
        cJSON_Delete(c);
        return false;
    }
    if (!cJSON_AddNumberToObject(c, "index", 0))
        return false;
    if (chat) {
        cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
        if (!m || (role && !cJSON_AddStringToObject(m, "role", "assistant")))
            return false;
        cJSON *t = text ? text_item(text, len) : NULL;
        if (text && (!t || !cJSON_AddItemToObject(m, "content", t))) {
            cJSON_Delete(t);
            return false;
        }
    } else {
        cJSON *t = text_item(text ? text : "", text ? len : 0);
        if (!t || !cJSON_AddItemToObject(c, "text", t)) {
            cJSON_Delete(t);
            return false;
        }
    }
    return cJSON_AddNullToObject(c, "logprobs") &&
           (finish ? cJSON_AddStringToObject(c, "finish_reason", finish) != NULL
                   : cJSON_AddNullToObject(c, "finish_reason") != NULL);
}

char *fitm_api_write_openai(const fitm_api_openai_head *h, const fitm_answer_result *res)
{
    char *out = NULL;
    cJSON *root = openai_envelope(h, false);
    cJSON *choices = root ? cJSON_AddArrayToObject(root, "choices") : NULL;
    if (choices &&
        add_choice(choices, h->chat, false, true, res->answer ? res->answer : "",
                   res->answer_len, fitm_answer_finish_name(res->finish)) &&
        add_openai_usage(root, res) && (res->n_docs == 0 || add_answer_docs(root, res)))
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

char *fitm_api_write_openai_chunk(const fitm_api_openai_head *h, const char *text, size_t len,
                                  bool role, const fitm_answer_result *final,
                                  bool usage_only)
{
    char *out = NULL;
    cJSON *root = openai_envelope(h, true);
    cJSON *choices = root ? cJSON_AddArrayToObject(root, "choices") : NULL;
    bool ok = choices != NULL;
    if (ok && usage_only)
        ok = add_openai_usage(root, final);
    else if (ok) /* a final chat chunk that is also the first (no token came) says content ""
                    beside the role, as the whole response's message would */
        ok = add_choice(choices, h->chat, true, role,
                        final ? (h->chat && !role ? NULL : "") : text,
                        final ? 0 : len, final ? fitm_answer_finish_name(final->finish) : NULL) &&
             (!final || final->n_docs == 0 || add_answer_docs(root, final));
    if (ok)
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* ---- POST /v1/score ---------------------------------------------------------------------- */

/* An error of /rerank's parser about query or documents, renamed to the score route's
 * fields. */
static void rename_field(fitm_err *err, const char *from, const char *to)
{
    size_t n = strlen(from);
    if (strncmp(err->msg, from, n) != 0)
        return;
    char tail[sizeof err->msg];
    snprintf(tail, sizeof tail, "%s", err->msg + n);
    snprintf(err->msg, sizeof err->msg, "%s%s", to, tail);
}

fitm_status fitm_api_parse_score(const char *body, size_t len, const fitm_api_limits *lim,
                                 fitm_rerank_request *out, fitm_err *err)
{
    memset(out, 0, sizeof *out);
    fitm_score_opts_init(&out->opt);
    cJSON *root = NULL, *view = NULL;
    fitm_status st = parse_body(body, len, lim, &root, err);
    if (st != FITM_OK)
        return st;
    if (!cJSON_IsObject(root)) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "the request body must be a JSON object");
        goto done;
    }
    /* text_1 is the query: one string (an array of one, as vLLM also takes); text_2 the
     * documents, one string or an array of them. */
    cJSON *t1 = cJSON_GetObjectItemCaseSensitive(root, "text_1");
    cJSON *t2 = cJSON_GetObjectItemCaseSensitive(root, "text_2");
    cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (cJSON_IsArray(t1) && cJSON_GetArraySize(t1) == 1)
        t1 = cJSON_GetArrayItem(t1, 0);
    if (!t1 || !t2) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "'%s' is missing", t1 ? "text_2" : "text_1");
        goto done;
    }
    if (!cJSON_IsString(t1)) {
        st = fitm_err_set(err, FITM_ERR_INVALID,
                          "'text_1' must be a string (the query; an array of one is taken too)");
        goto done;
    }
    view = cJSON_CreateObject();
    bool ok = view != NULL;
    if (ok && cJSON_IsString(t2)) {
        cJSON *docs = cJSON_CreateArray();
        if (!docs || !cJSON_AddItemToObject(view, "documents", docs)) {
            cJSON_Delete(docs);
            ok = false;
        } else {
            ok = cJSON_AddItemReferenceToArray(docs, t2);
        }
    } else if (ok) {
        ok = cJSON_AddItemReferenceToObject(view, "documents", t2);
    }
    ok = ok && cJSON_AddItemReferenceToObject(view, "query", t1) &&
         (!model || cJSON_AddItemReferenceToObject(view, "model", model));
    if (!ok) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto done;
    }
    st = parse_rerank_object(view, lim, out, err);
    if (st != FITM_OK) {
        rename_field(err, "'documents", "'text_2");
        rename_field(err, "'query'", "'text_1'");
    }
done:
    cJSON_Delete(view);
    cJSON_Delete(root);
    return st;
}

char *fitm_api_write_score(const fitm_rerank_result *res, const char *id, const char *model,
                           int64_t created)
{
    char *out = NULL;
    char sid[64];
    snprintf(sid, sizeof sid, "score-%s", id);
    cJSON *root = cJSON_CreateObject();
    cJSON *data = NULL, *usage = NULL;
    bool ok = root && cJSON_AddStringToObject(root, "id", sid) &&
              cJSON_AddStringToObject(root, "object", "list") &&
              cJSON_AddNumberToObject(root, "created", (double)created) &&
              cJSON_AddStringToObject(root, "model", model) &&
              (data = cJSON_AddArrayToObject(root, "data")) != NULL;
    /* In text_2's order, as vLLM answers (the results are sorted by score). */
    for (int32_t k = 0; ok && k < res->n_results; k++) {
        const fitm_rerank_doc_result *r = NULL;
        for (int32_t i = 0; i < res->n_results && !r; i++)
            r = res->results[i].index == k ? &res->results[i] : NULL;
        cJSON *o = r ? cJSON_CreateObject() : NULL;
        if (!o || !cJSON_AddItemToArray(data, o)) {
            cJSON_Delete(o);
            ok = false;
            break;
        }
        ok = cJSON_AddNumberToObject(o, "index", k) &&
             cJSON_AddStringToObject(o, "object", "score") &&
             cJSON_AddNumberToObject(o, "score", r->relevance_score);
    }
    ok = ok && (usage = cJSON_AddObjectToObject(root, "usage")) != NULL &&
         cJSON_AddNumberToObject(usage, "prompt_tokens", (double)res->usage.prompt_tokens) &&
         cJSON_AddNumberToObject(usage, "total_tokens", (double)res->usage.prompt_tokens);
    if (ok)
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* ---- POST /tokenize, /detokenize --------------------------------------------------------- */

void fitm_api_tokens_free(fitm_api_tokens *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->ids);
    memset(t, 0, sizeof *t);
}

/* The one of two names (llama.cpp's a, vLLM's b) obj gives a value to (null counts as
 * absent) into *it, or NULL when neither; FITM_ERR_INVALID when both are given. */
static fitm_status either(const cJSON *obj, const char *a, const char *b, const cJSON **it,
                          const char **name, fitm_err *err)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(obj, a);
    const cJSON *y = cJSON_GetObjectItemCaseSensitive(obj, b);
    x = x && !cJSON_IsNull(x) ? x : NULL;
    y = y && !cJSON_IsNull(y) ? y : NULL;
    if (x && y)
        return fitm_err_set(err, FITM_ERR_INVALID, "give either '%s' or '%s', not both", a, b);
    *it = x ? x : y;
    *name = x ? a : b;
    return FITM_OK;
}

fitm_status fitm_api_parse_tokens(const char *body, size_t len, const fitm_api_limits *lim,
                                  bool detokenize, fitm_api_tokens *out, fitm_err *err)
{
    memset(out, 0, sizeof *out);
    out->detokenize = detokenize;
    cJSON *root = NULL;
    fitm_status st = parse_body(body, len, lim, &root, err);
    if (st != FITM_OK)
        return st;
    const char *name;
    const cJSON *it;
    if (!cJSON_IsObject(root)) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "the request body must be a JSON object");
    } else if (detokenize) {
        it = cJSON_GetObjectItemCaseSensitive(root, "tokens");
        int n = cJSON_IsArray(it) ? cJSON_GetArraySize(it) : -1;
        if (n < 0)
            st = fitm_err_set(err, FITM_ERR_INVALID,
                              it ? "'tokens' must be an array of token ids" : "'tokens' is missing");
        else if (n > 0 && !(out->ids = calloc((size_t)n, sizeof *out->ids)))
            st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        const cJSON *ids = n > 0 ? it : NULL, *id;
        cJSON_ArrayForEach(id, ids)
        {
            char field[32];
            int64_t v = 0;
            snprintf(field, sizeof field, "tokens[%lld]", (long long)out->n_ids);
            if ((st = take_int(id, field, 0, INT32_MAX, &v, err)) != FITM_OK)
                break;
            out->ids[out->n_ids++] = (int32_t)v;
        }
    } else {
        st = either(root, "content", "prompt", &it, &name, err);
        if (st == FITM_OK && !it)
            st = fitm_err_set(err, FITM_ERR_INVALID, "'content' (or 'prompt') is missing");
        if (st == FITM_OK)
            st = take_string(it, name, &out->text, &out->text_len, err);
        if (st == FITM_OK)
            st = either(root, "add_special", "add_special_tokens", &it, &name, err);
        if (st == FITM_OK && it)
            st = take_bool(it, name, &out->add_special, err);
    }
    cJSON_Delete(root);
    return st;
}

char *fitm_api_write_tokens(const fitm_api_tokens *t, int64_t max_model_len)
{
    if (!t->detokenize) {
        /* Written directly: a body of megabytes tokenizes to millions of ids, which as cJSON
         * items would take about 70 bytes each on the HTTP thread. */
        const size_t cap = (size_t)t->n_ids * 12 + 96; /* ",-2147483648" at most per id */
        char *buf = malloc(cap);
        if (!buf)
            return NULL;
        size_t n = (size_t)snprintf(buf, cap, "{\"tokens\":[");
        for (int64_t i = 0; i < t->n_ids; i++)
            n += (size_t)snprintf(buf + n, cap - n, i ? ",%d" : "%d", (int)t->ids[i]);
        snprintf(buf + n, cap - n, "],\"count\":%lld,\"max_model_len\":%lld}",
                 (long long)t->n_ids, (long long)max_model_len);
        return buf;
    }
    char *out = NULL;
    cJSON *root = cJSON_CreateObject();
    bool ok = root != NULL;
    /* The same text under llama.cpp's name and vLLM's. */
    const char *names[] = {"content", "prompt"};
    for (int i = 0; ok && i < 2; i++) {
        cJSON *s = text_item(t->text ? t->text : "", t->text_len);
        if (!s || !cJSON_AddItemToObject(root, names[i], s)) {
            cJSON_Delete(s);
            ok = false;
        }
    }
    if (ok)
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}
