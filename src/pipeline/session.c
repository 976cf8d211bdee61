/* session: the long-lived state of fitmd's pipeline (see session.h): creation and the
 * options every request starts from, the position-method checks, the prompt cache's
 * bookkeeping, and the caches and batched calls of the sequences. */
#include "pipeline/session_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

void fitm_session_destroy(fitm_session *r)
{
    if (!r)
        return;
    fitm_kv_destroy(r->branch);
    fitm_kv_destroy(r->kv);
    fitm_forward_destroy(r->fwd);
    fitm_score_opts_free(&r->defaults);
    free(r->dummy);
    free(r->kv_ids);
    free(r->answer_text);
    free(r->answer_stop[0]);
    free(r);
}

const fitm_answer_defaults *fitm_session_answer_defaults(const fitm_session *r)
{
    return &r->answer;
}

const char *fitm_session_template(const fitm_session *r)
{
    return r->tmpl->name;
}

/* The default dummy's ids: " " + text. */
static fitm_status encode_dummy(fitm_session *r, const char *text, fitm_err *err)
{
    fitm_ids d = {0};
    size_t dl = strlen(text);
    char *t = malloc(dl + 2);
    if (!t)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    t[0] = ' ';
    memcpy(t + 1, text, dl + 1);
    fitm_status st = fitm_prompt_encode(r->tok, &d, t, dl + 1, FITM_TOK_CONTINUATION, -1, err);
    free(t);
    r->dummy = d.v;
    r->n_dummy = d.n;
    if (st == FITM_OK && r->n_dummy == 0)
        st = fitm_err_set(err, FITM_ERR_INVALID, "dummy_text gives no tokens");
    return st;
}

/* t with "\\n" and "\\\\" unescaped, malloc'd; NULL when out of memory. */
static char *unescape(const char *t)
{
    char *u = malloc(strlen(t) + 1), *o = u;
    if (!u)
        return NULL;
    for (; *t; t++) {
        bool esc = t[0] == '\\' && (t[1] == 'n' || t[1] == '\\');
        *o++ = esc ? (t[1] == 'n' ? '\n' : '\\') : *t;
        t += esc;
    }
    *o = '\0';
    return u;
}

/* The answer template, unescaped, cut at its one {documents}, and its stop string: the
 * configured one, else the built-in template's line break (its worked answers are one line
 * each), else none. */
static fitm_status parse_answer_template(fitm_session *r, const char *t, const char *stop,
                                         fitm_err *err)
{
    static const char DOCS[] = "{documents}";
    const bool builtin = !t || !*t;
    t = builtin ? fitm_rerank_answer_template : t;
    char *u = unescape(t);
    if (!u)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    r->answer_text = u;
    if (stop && *stop ? !(r->answer_stop[0] = unescape(stop))
                      : builtin && !(r->answer_stop[0] = unescape("\\n")))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    char *d = strstr(u, DOCS);
    if (!d || strstr(d + 1, DOCS) || !strstr(d, "{question}"))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "answer_template must hold {documents} once "
                            "and {question} after it");
    *d = '\0';
    r->answer_frame = (fitm_rerank_frame){.before = u, .after = d + sizeof DOCS - 1};
    return FITM_OK;
}

/* The n default layers of option `what` (negative from the end) lie in the model. */
static fitm_status check_default_layers(const fitm_session *r, const char *what,
                                        const int32_t *layers, int32_t n, fitm_err *err)
{
    for (int32_t i = 0; layers && i < n; i++) {
        const int32_t l = fitm_layer_index(r, layers[i]);
        if (l < 0 || l >= r->L)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "the default %s name layer %d: the model has %d layers", what,
                                (int)layers[i], (int)r->L);
    }
    return FITM_OK;
}

/* The default layers and (layer, head) pairs lie in the model: a server whose defaults named
 * others would start and then refuse every request that takes them with a 400 that blames the
 * client. */
static fitm_status check_default_pairs(const fitm_session *r, fitm_err *err)
{
    const fitm_score_opts *o = &r->defaults;
    fitm_status st = check_default_layers(r, "layers", o->layers, o->n_layers, err);
    if (st == FITM_OK)
        st = check_default_layers(r, "fuse_layers", o->fuse_layers, o->n_fuse_layers, err);
    if (st != FITM_OK)
        return st;
    for (int32_t i = 0; o->heads && i < o->n_heads; i++) {
        const int32_t l = fitm_layer_index(r, o->heads[2 * i]);
        if (l < 0 || l >= r->L || o->heads[2 * i + 1] >= r->H)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "the default heads name layer %d, head %d: the model has %d "
                                "layers of %d heads",
                                (int)o->heads[2 * i], (int)o->heads[2 * i + 1], (int)r->L,
                                (int)r->H);
    }
    return FITM_OK;
}

/* Built-in options under the server's. */
static fitm_status resolve_defaults(fitm_session *r, const fitm_session_params *p, fitm_err *err)
{
    fitm_status st = fitm_score_opts_builtin(&r->defaults, r->L, err);
    if (st == FITM_OK && p->defaults)
        st = fitm_score_opts_overlay(&r->defaults, p->defaults, err);
    if (st == FITM_OK && p->defaults && isnan(p->defaults->score_scale) &&
        !isnan(p->defaults->temperature))
        r->defaults.score_scale = 1.0 / r->defaults.temperature; /* still orders like weight */
    r->paper_temperature = p->paper_temperature > 0 ? p->paper_temperature : 5e-5;
    r->answer = (fitm_answer_defaults){.calibrate = 1, .reorder = -1, .reorder_last = 0,
                                       .top_n = 0};
    if (p->answer)
        fitm_answer_defaults_overlay(&r->answer, p->answer);
    return st == FITM_OK ? check_default_pairs(r, err) : st;
}

fitm_status fitm_session_create(fitm_session **out, const fitm_model *m, const fitm_tokenizer *tok,
                                fitm_backend *b, const fitm_session_params *p, fitm_err *err)
{
    *out = NULL;
    const fitm_model_config *c = fitm_model_config_of(m);
    if (p->n_ctx < 16 || p->chunk < 1)
        return fitm_err_set(err, FITM_ERR_INVALID, "session: context %lld or chunk %lld too small",
                            (long long)p->n_ctx, (long long)p->chunk);
    if (p->rerank_lanes < 0 || p->rerank_lanes > FITM_SESSION_LANES_MAX || p->logit_rows < 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "session: rerank_lanes %d (0 .. %d) or logit_rows %lld (>= 0)",
                            (int)p->rerank_lanes, FITM_SESSION_LANES_MAX, (long long)p->logit_rows);
    fitm_session *r = calloc(1, sizeof *r);
    if (!r)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_score_opts_init(&r->defaults);
    r->m = m;
    r->tok = tok;
    r->b = b;
    r->n_ctx = p->n_ctx;
    r->chunk = p->chunk < p->n_ctx ? p->chunk : p->n_ctx;
    r->L = c->n_layer;
    r->H = c->n_head;
    r->tmpl = fitm_prompt_template(m, tok, p->chat_template);
    r->V = c->n_vocab;
    const int64_t logit_rows = p->logit_rows > 0 ? p->logit_rows : FITM_SESSION_LOGIT_ROWS;
    r->logit_rows = r->chunk < logit_rows ? r->chunk : logit_rows;
    r->rerank_lanes = p->rerank_lanes > 0 ? p->rerank_lanes : 1;
    fitm_forward_params fp = {
        .max_tokens = r->chunk, .max_ctx = r->n_ctx, .max_logits = r->logit_rows};
    fitm_status st;
    r->kv_ids = malloc((size_t)r->n_ctx * sizeof *r->kv_ids);
    if (!r->kv_ids) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    r->moice = p->moice;
    r->position_default = p->position;
    r->answer_path = p->answer_prompt_step ? FITM_PATH_STEP : FITM_PATH_BATCH;
    r->rerank_path = p->rerank_step ? FITM_PATH_STEP : FITM_PATH_BATCH;
    if ((st = fitm_forward_create(&r->fwd, m, b, &fp, err)) != FITM_OK ||
        (st = fitm_forward_positions(r->fwd, p->moice, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->kv, b, c, r->n_ctx, err)) != FITM_OK ||
        (st = fitm_kv_create(&r->branch, b, c, r->n_ctx, err)) != FITM_OK ||
        (st = encode_dummy(r, p->dummy_text, err)) != FITM_OK ||
        (st = resolve_defaults(r, p, err)) != FITM_OK ||
        (st = parse_answer_template(r, p->answer_template, p->answer_stop, err)) != FITM_OK)
        goto fail;
    snprintf(r->profile, sizeof r->profile, "%s", p->profile ? p->profile : "");
    *out = r;
    return FITM_OK;
fail:
    fitm_err_prefix(err, "session");
    fitm_session_destroy(r);
    return st;
}

fitm_status fitm_session_position(const fitm_session *r, int32_t position,
                                  fitm_position_method *out, fitm_err *err)
{
    const fitm_position_method m =
        position < 0 ? r->position_default : (fitm_position_method)position;
    if ((unsigned)m >= FITM_POSITION_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "'position_method': unknown");
    if (m == FITM_POSITION_MOICE && !r->moice)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "'position_method' = 'moice' needs a MoICE router sidecar: this "
                            "server runs without one (start fitmd with --moice FILE)");
    if (m == FITM_POSITION_BUCKETS && !r->b->ops->capture_add)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "'position_method' = 'attention_buckets' does not run on the %s "
                            "backend: it cannot sum the passes' captures "
                            "(docs/position-methods.md)",
                            r->b->ops->name);
    *out = m;
    return FITM_OK;
}

fitm_status fitm_session_cache_method(fitm_session *r, fitm_position_method m, fitm_err *err)
{
    if (m != r->kv_position)
        r->kv_n = 0; /* rows computed under another method are not this one's */
    r->kv_position = m;
    /* The session's caches hold the bucket passes only while buckets run (fitm_passes_run
     * grows them to what a run needs). */
    fitm_status st = FITM_OK;
    if (m != FITM_POSITION_BUCKETS && fitm_kv_n_passes(r->kv) > 1 &&
        (st = fitm_kv_passes(r->kv, 1, 0, err)) == FITM_OK)
        st = fitm_kv_passes(r->branch, 1, 0, err);
    return st;
}

const fitm_model *fitm_session_model(const fitm_session *r)
{
    return r->m;
}
const fitm_tokenizer *fitm_session_tokenizer(const fitm_session *r)
{
    return r->tok;
}
int64_t fitm_session_n_ctx(const fitm_session *r)
{
    return r->n_ctx;
}
bool fitm_session_is_raw(const fitm_session *r)
{
    return fitm_prompt_template_raw(r->tmpl);
}

const fitm_rerank_frame *fitm_session_answer_frame(const fitm_session *r)
{
    return fitm_session_is_raw(r) ? &r->answer_frame : &fitm_rerank_default_frame;
}

int32_t fitm_session_answer_stop(const fitm_session *r, char *const **stop)
{
    *stop = r->answer_stop;
    return fitm_session_is_raw(r) && r->answer_stop[0] ? 1 : 0;
}

int64_t fitm_session_cached(const fitm_session *r, const int32_t *ids, int64_t n)
{
    int64_t i = 0;
    while (i < n && i < r->kv_n && r->kv_ids[i] == ids[i])
        i++;
    return i;
}

fitm_status fitm_session_kv_create(fitm_session *r, fitm_position_method m, int64_t n_rows,
                                   fitm_kv **out, fitm_err *err)
{
    fitm_status st = fitm_kv_create(out, r->b, fitm_model_config_of(r->m), n_rows, err);
    if (st == FITM_OK && m == FITM_POSITION_BUCKETS &&
        (st = fitm_kv_passes(*out, FITM_BUCKETS, 0, err)) != FITM_OK) {
        fitm_kv_destroy(*out);
        *out = NULL;
    }
    return st;
}

fitm_status fitm_session_copy_rows(fitm_session *r, fitm_kv *dst, int64_t n, fitm_err *err)
{
    if (n < 0 || n > r->kv_n || n > fitm_kv_n_rows(dst) || fitm_kv_pos_base(dst) != 0)
        return fitm_err_set(err, FITM_ERR_INTERNAL,
                            "copying %lld prompt rows: the cache holds %lld, the target %lld",
                            (long long)n, (long long)r->kv_n, (long long)fitm_kv_n_rows(dst));
    fitm_status st = fitm_kv_copy(dst, r->kv, n, err); /* every pass (attention_buckets) */
    if (st != FITM_OK) {
        fitm_err_prefix(err, "copying prompt rows");
        return FITM_ERR_INTERNAL;
    }
    if (r->b->ops->status)
        return r->b->ops->status(r->b, err);
    return FITM_OK;
}

bool fitm_session_answer_prompt_step(const fitm_session *r)
{
    return r->answer_path == FITM_PATH_STEP;
}

int64_t fitm_session_batch_tokens(const fitm_session *r)
{
    return r->chunk;
}

int64_t fitm_session_batch_logits(const fitm_session *r)
{
    return r->logit_rows;
}

/* Arguments were checked before any forward pass: its INVALID or LIMIT is a bug. */
static fitm_status forward_failed(fitm_status st, fitm_err *err)
{
    if (st != FITM_ERR_INVALID && st != FITM_ERR_LIMIT)
        return st;
    fitm_err_prefix(err, "forward pass");
    return FITM_ERR_INTERNAL;
}

fitm_status fitm_session_run_batch(fitm_session *r, const fitm_forward_seq *seqs, int32_t n_seqs,
                                   fitm_err *err)
{
    for (int32_t i = 0; i < n_seqs; i++)
        if (seqs[i].kv == r->kv || seqs[i].kv == r->branch)
            return fitm_err_set(err, FITM_ERR_INTERNAL,
                                "a batched sequence runs on the session's own cache");
    return forward_failed(fitm_forward_run_batch(r->fwd, seqs, n_seqs, err), err);
}
