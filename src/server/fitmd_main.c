/* fitmd: the daemon. Startup: config (flags > FITM_* env > file > defaults) -> engine thread
 * (loads the model, then owns it) -> HTTP. /health says 503 until the model is loaded.
 * SIGTERM/SIGINT: keep listening (/health says draining, new requests get 503), let
 * in-flight requests finish within drain_timeout_ms, exit 0. A model that fails to load exits 1 with the reason.
 * SIGHUP: logged and otherwise ignored (fitmd logs to stderr, so there is no file to reopen;
 * a changed config takes a restart). */
#include <errno.h>
#include <curl/curl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fitm_config.h"

#include "base/clock.h"
#include "base/cpu.h"
#include "base/download.h"
#include "base/log.h"
#include "base/notify.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/moice.h"
#include "pipeline/profile.h"
#include "pipeline/batch.h"
#include "pipeline/rerank.h"
#include "server/config.h"
#include "server/cpus.h"
#include "server/engine.h"
#include "server/http.h"
#include "server/work.h"
#include "tokenizer/tokenizer.h"

/* The CUDA backend is in this fitmd when the CUDA toolchain built it, or when the tests link
 * it against the CPU emulator of tests/cuda_emu (fitmd_cuda_emu). */
#if FITM_HAVE_CUDA || defined(FITMD_CUDA_EMU)
#define FITMD_CUDA 1
#include "model/backend_check.h"
#include "model/backend_cuda.h"
#else
#define FITMD_CUDA 0
#endif

/* The spec, embedded at build time from openapi/openapi.yaml (see src/embed_file.py). */
extern const char fitm_openapi_yaml[];
extern const size_t fitm_openapi_yaml_len;
/* The playground page, embedded from src/server/playground.html. */
extern const char fitm_playground_html[];
extern const size_t fitm_playground_html_len;
/* The default model's scoring profile, embedded from config/profiles/ (used when its identity
 * matches the loaded model and no profile file was named or found). */
extern const char fitm_profile_gemma3_270m[];
extern const size_t fitm_profile_gemma3_270m_len;

/* What the engine thread owns. */
typedef struct {
    const fitm_config *cfg;
    fitm_http_model_info *info;
    fitm_model *model;
    fitm_tokenizer *tok;
    fitm_backend *backend;
    fitm_session *session;
    fitm_moice *moice; /* NULL: no sidecar */
    /* The load failed on a configured value the model cannot take (a profile, a sidecar, a
     * default that names a layer or head it lacks): exit 2, which a restart cannot fix. */
    bool config_error;
} daemon_model;

/* Loads cfg->moice (if set) and checks it against the loaded model: the SHA-256 of the whole
 * model file is read once here (about a second per GB). */
static fitm_status load_moice(daemon_model *dm, fitm_err *err)
{
    const fitm_config *cfg = dm->cfg;
    if (!cfg->moice[0]) {
        if (!strcmp(cfg->position_method, "moice"))
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "position_method = moice needs a sidecar (moice = FILE)");
        return FITM_OK;
    }
    const double t0 = fitm_clock_ms();
    fitm_moice_base id;
    fitm_status st = fitm_moice_load(&dm->moice, cfg->moice, err);
    if (st == FITM_OK)
        st = fitm_moice_model_identity(dm->model, cfg->model, &id, err);
    if (st == FITM_OK && (st = fitm_moice_check(dm->moice, &id, err)) != FITM_OK)
        fitm_err_prefix(err, "%s", cfg->moice);
    if (st != FITM_OK)
        return st;
    FITM_LOG(FITM_LOG_INFO, NULL,
             "MoICE sidecar %s: %d experts, top-%d, checked against the model (SHA-256 %.12s...) "
             "in %.0f ms",
             cfg->moice, (int)fitm_moice_n_experts(dm->moice), (int)fitm_moice_top_k(dm->moice),
             id.sha256, fitm_clock_ms() - t0);
    return FITM_OK;
}

/* The loaded model's identity, as a profile states it. */
static void model_identity(const char *path, const fitm_model *m, fitm_profile_identity *id)
{
    const fitm_model_config *mc = fitm_model_config_of(m);
    memset(id, 0, sizeof *id);
    snprintf(id->architecture, sizeof id->architecture, "%s", fitm_arch_name(mc->arch));
    fitm_gguf_str name = {0};
    if (fitm_gguf_get_str(fitm_model_gguf(m), "general.name", &name, NULL) == FITM_OK)
        snprintf(id->name, sizeof id->name, "%.*s", (int)name.len, name.ptr);
    id->layers = mc->n_layer;
    id->embd = mc->n_embd;
    id->heads = mc->n_head;
    id->vocab = mc->n_vocab;
    struct stat sb;
    id->file_bytes = stat(path, &sb) == 0 ? (int64_t)sb.st_size : -1;
}

/* The scoring profile's path: the profile option ("none": no profile), else
 * <model path without .gguf>.profile when that file exists; "" for none. */
static void profile_path(const fitm_config *cfg, char *out, size_t n)
{
    out[0] = '\0';
    if (!strcmp(cfg->profile, "none"))
        return;
    if (cfg->profile[0]) {
        snprintf(out, n, "%s", cfg->profile);
        return;
    }
    size_t l = strlen(cfg->model);
    if (l > 5 && !strcmp(cfg->model + l - 5, ".gguf"))
        l -= 5;
    snprintf(out, n, "%.*s.profile", (int)l, cfg->model);
    if (access(out, R_OK) != 0)
        out[0] = '\0';
}

/* The server's scoring and /answer defaults into out and answer: the profile's (checked
 * against the model) under the config's non-empty ones; desc says which profile (for meta). */
static fitm_status scoring_defaults(const fitm_config *cfg, const fitm_model *m,
                                    fitm_score_opts *out, fitm_answer_defaults *answer,
                                    char *desc, size_t n, fitm_err *err)
{
    fitm_answer_defaults_init(answer);
    char path[FITM_CONFIG_STR_BYTES + 16];
    profile_path(cfg, path, sizeof path);
    desc[0] = '\0';
    fitm_status st = FITM_OK;
    fitm_profile_identity id;
    model_identity(cfg->model, m, &id);
    if (path[0]) {
        fitm_profile p;
        if ((st = fitm_profile_load(&p, path, err)) == FITM_OK &&
            (st = fitm_profile_check(&p, &id, err)) != FITM_OK)
            fitm_err_prefix(err, "profile %s does not fit model %s", path, cfg->model);
        if (st == FITM_OK)
            st = fitm_score_opts_overlay(out, &p.opts, err);
        fitm_answer_defaults_overlay(answer, &p.answer);
        snprintf(desc, n, "%s", path);
        fitm_profile_free(&p);
    } else if (strcmp(cfg->profile, "none")) {
        /* No file: the shipped profile, if it was fitted on exactly this model. */
        fitm_profile p;
        fitm_err quiet = {0};
        if (fitm_profile_parse(&p, fitm_profile_gemma3_270m, fitm_profile_gemma3_270m_len,
                               "built-in gemma3-270m-q4km.profile", &quiet) == FITM_OK &&
            fitm_profile_check(&p, &id, &quiet) == FITM_OK) {
            st = fitm_score_opts_overlay(out, &p.opts, err);
            fitm_answer_defaults_overlay(answer, &p.answer);
            snprintf(desc, n, "built-in gemma3-270m-q4km.profile");
        }
        fitm_profile_free(&p);
    }
    fitm_score_opts conf;
    fitm_score_opts_init(&conf);
    if (st == FITM_OK && (st = fitm_config_score_opts(cfg, &conf, err)) == FITM_OK)
        st = fitm_score_opts_overlay(out, &conf, err);
    fitm_score_opts_free(&conf);
    fitm_answer_defaults mine;
    if (st == FITM_OK && (st = fitm_config_answer_defaults(cfg, &mine, err)) == FITM_OK)
        fitm_answer_defaults_overlay(answer, &mine);
    return st;
}

/* Names what failed ("model PATH: ...") once: the loader's own message may already start
 * with the path ("PATH: bad magic"), which a plain prefix would repeat. */
static void prefix_once(fitm_err *err, const char *what, const char *path)
{
    size_t n = strlen(path);
    if (!strncmp(err->msg, path, n) && err->msg[n] == ':') {
        fitm_err rest;
        snprintf(rest.msg, sizeof rest.msg, "%s", err->msg + n + 1);
        while (rest.msg[0] == ' ')
            memmove(rest.msg, rest.msg + 1, strlen(rest.msg));
        *err = rest;
    }
    fitm_err_prefix(err, "%s %s", what, path);
}

/* Set on SIGTERM/SIGINT: a model download in progress stops (its .part file stays for the
 * next start to resume). */
static atomic_bool stopping;

static bool download_cancelled(void *arg)
{
    return atomic_load(&stopping);
}

/* Download progress: /health's "downloading 42%" and a log line every 5 s. */
static void download_progress(const fitm_download_progress *p, void *arg)
{
    daemon_model *dm = arg;
    static int64_t last_ns;
    int pct = p->total > 0 ? (int)(100 * (double)p->done / (double)p->total) : 0;
    atomic_store(&dm->info->download_pct, p->final ? -1 : pct);
    int64_t now = fitm_clock_ns();
    if (p->final || now - last_ns < 5000000000LL)
        return;
    last_ns = now;
    FITM_LOG(FITM_LOG_INFO, NULL, "downloading %s: %d%% (%lld of %lld bytes) at %.1f MB/s, "
             "%.0f s left", dm->cfg->model, pct, (long long)p->done, (long long)p->total,
             p->rate / 1e6, p->eta_s);
}

static fitm_status download_model(daemon_model *dm, fitm_err *err)
{
    fitm_download_opts o;
    fitm_download_opts_init(&o);
    o.sha256 = dm->cfg->model_sha256;
    o.progress = download_progress;
    o.progress_arg = dm;
    o.cancel = download_cancelled;
    atomic_store(&dm->info->download_pct, 0);
    fitm_status st = fitm_download(dm->cfg->model_url, dm->cfg->model, &o, err);
    atomic_store(&dm->info->download_pct, -1);
    return st;
}

/* backend=cuda needs a device: said before the model is read, not after. */
static fitm_status cuda_wanted_and_absent(const fitm_config *cfg, fitm_err *err)
{
    if (strcmp(cfg->backend, "cuda"))
        return FITM_OK;
#if FITMD_CUDA
    if (fitm_backend_cuda_device_count() < 1)
        return fitm_err_set(err, FITM_ERR_BACKEND,
                            "backend 'cuda': no CUDA device (no driver, no GPU, or none visible "
                            "in CUDA_VISIBLE_DEVICES); use backend auto or cpu");
    return FITM_OK;
#else
    return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                        "backend 'cuda' is not built into this fitmd (built without the CUDA "
                        "toolchain); use auto or cpu");
#endif
}

/* The backend the config asks for into dm->backend (the model loaded), described in desc.
 * cpu: the CPU. cuda: device 0, which must pass fitm_backend_check against the CPU on the
 * loaded model, else a start-up error. auto: the same device when it exists and passes, else
 * the CPU with one log line saying why. */
static fitm_status choose_backend(daemon_model *dm, int threads, char *desc, size_t n,
                                  fitm_err *err)
{
    const char *want = dm->cfg->backend;
    fitm_status st = fitm_backend_cpu_create(&dm->backend, threads, err);
    if (st != FITM_OK)
        return st;
    snprintf(desc, n, "cpu backend with %d threads", threads);
    if (!strcmp(want, "cpu"))
        return FITM_OK;
#if FITMD_CUDA
    fitm_backend *gpu = NULL;
    fitm_backend_check_report rep, rep16 = {0};
    fitm_err why = {{0}};
    bool checked = false;
    const bool bf16 = !strcmp(dm->cfg->gpu_weights, "bf16");
    st = fitm_backend_cuda_create(&gpu, 0, &why);
    if (st == FITM_OK) {
        checked = true;
        /* every kernel against the CPU within float rounding (F32 products), then, when the
         * prompts are to run in bfloat16, those products within their own bounds */
        fitm_backend_cuda_set_weights(gpu, FITM_CUDA_WEIGHTS_F32);
        st = fitm_backend_check(dm->model, dm->backend, gpu, FITM_CHECK_PRODUCTS_F32, &rep, &why);
        if (st == FITM_OK && bf16) {
            fitm_backend_cuda_set_weights(gpu, FITM_CUDA_WEIGHTS_BF16);
            st = fitm_backend_check(dm->model, dm->backend, gpu, FITM_CHECK_PRODUCTS_BF16, &rep16,
                                    &why);
            if (st != FITM_OK)
                fitm_err_prefix(&why, "with bfloat16 products (gpu_weights bf16)");
        }
    }
    if (st == FITM_OK) {
        char weights[160] = "prompt products in F32";
        if (bf16)
            snprintf(weights, sizeof weights,
                     "prompt products in bfloat16: weight copies %.1f MiB, logits within %.2g, "
                     "attention within %.2g",
                     (double)fitm_backend_cuda_bf16_bytes(gpu) / (1 << 20), rep16.logit_err,
                     rep16.prob_err);
        snprintf(desc, n,
                 "cuda backend on %s (start-up check against the CPU: logits within %.2g, "
                 "attention within %.2g; %s; %s launches)",
                 fitm_backend_cuda_device(gpu), rep.logit_err, rep.prob_err, weights,
                 fitm_backend_cuda_pdl(gpu) ? "programmatic" : "plain");
        fitm_backend_destroy(dm->backend);
        dm->backend = gpu;
        return FITM_OK;
    }
    fitm_backend_destroy(gpu);
    if (!strcmp(want, "cuda")) {
        *err = why;
        fitm_err_prefix(err, "backend 'cuda'%s", checked ? ": start-up check failed" : "");
        return st;
    }
    FITM_LOG(checked ? FITM_LOG_WARN : FITM_LOG_INFO, NULL, "backend auto: the CPU, since %s%s",
             checked ? "the CUDA start-up check failed: " : "", why.msg);
#else
    FITM_LOG(FITM_LOG_INFO, NULL, "backend auto: the CPU, since this fitmd was built without "
                                  "CUDA");
#endif
    return FITM_OK;
}

/* Opens the model file (downloading it first when it is absent and model_url is set) and its
 * tokenizer, and records the file /health watches. */
static fitm_status open_model(daemon_model *dm, fitm_err *err)
{
    const fitm_config *cfg = dm->cfg;
    fitm_status st;
    if ((st = cuda_wanted_and_absent(cfg, err)) != FITM_OK)
        return st;
    if (access(cfg->model, F_OK) != 0 && cfg->model_url[0] &&
        (st = download_model(dm, err)) != FITM_OK)
        return st;
    bool copy = !strcmp(cfg->model_load, "copy");
    if ((st = fitm_model_open_mode(&dm->model, cfg->model, copy, err)) != FITM_OK) {
        prefix_once(err, "model", cfg->model);
        return st;
    }
    if (!copy) /* a private copy does not depend on the file: /health need not watch it */
        snprintf(dm->info->path, sizeof dm->info->path, "%s", cfg->model);
    if (!fitm_file_id_of(cfg->model, &dm->info->file))
        return fitm_err_set(err, FITM_ERR_IO, "model %s: cannot stat it after opening",
                            cfg->model);
    if ((st = fitm_tok_create(&dm->tok, fitm_model_gguf(dm->model), err)) != FITM_OK) {
        prefix_once(err, "tokenizer of", cfg->model);
        return st;
    }
    return FITM_OK;
}

/* The compute threads: the config's, or (threads = 0) the CPUs this process may use, logged. */
static int thread_count(const fitm_config *cfg)
{
    int affinity = 0;
    double quota = 0;
    int threads = cfg->threads > 0 ? (int)cfg->threads : fitm_cpus_available(&affinity, &quota);
    if (cfg->threads == 0 && quota > 0)
        FITM_LOG(FITM_LOG_INFO, NULL,
                 "threads = 0: %d threads (%d CPUs in the affinity mask, cgroup CPU quota %.2f)",
                 threads, affinity, quota);
    else if (cfg->threads == 0)
        FITM_LOG(FITM_LOG_INFO, NULL,
                 "threads = 0: %d threads (%d CPUs in the affinity mask, no cgroup CPU quota)",
                 threads, affinity);
    return threads;
}

/* Sets the backend's KV cache type and chooses the /rerank path (*rerank_step), both appended
 * to the backend's description in desc (a string of n bytes). */
static fitm_status set_kv_and_path(daemon_model *dm, char *desc, size_t n, bool *rerank_step,
                                   fitm_err *err)
{
    const fitm_config *cfg = dm->cfg;
    fitm_status st;
    const char *kv = cfg->kv_cache_type;
    const bool half = !strcmp(kv, "f16") || (!strcmp(kv, "auto") && dm->backend->ops->kv_half);
    if ((st = fitm_backend_set_kv_half(dm->backend, half, err)) != FITM_OK) {
        fitm_err_prefix(err, "kv_cache_type %s", kv);
        return st;
    }
    *rerank_step = !strcmp(cfg->rerank_path, "step") ||
                   (!strcmp(cfg->rerank_path, "auto") && !strcmp(dm->backend->ops->name, "cpu"));
    size_t used = strlen(desc);
    snprintf(desc + used, n - used, ", %s KV cache, /rerank on the %s path",
             half ? "fp16" : "F32", *rerank_step ? "step" : "batch");
    return FITM_OK;
}

/* The lanes of a /rerank sequence and the tokens and logit rows of a forward call
 * (rerank_lanes, batch_tokens and logit_rows, 0 = by the backend: on the cuda backend a
 * call's cost is mostly its launches, and a 512-token call leaves much of a large card idle
 * in each of them, so more lanes, tokens and logit rows take fewer, fuller calls; on the CPU a
 * call costs mostly its rows, but a fuller call streams each weight block once for more of
 * them: 4 lanes, chosen by measurement in docs/load-benchmark.md), appended to the backend's
 * description in desc (a string of n bytes). */
static void batch_shape(const daemon_model *dm, char *desc, size_t n, int32_t *lanes,
                        int64_t *logit_rows, int64_t *tokens)
{
    const fitm_config *cfg = dm->cfg;
    const bool cpu = !strcmp(dm->backend->ops->name, "cpu");
    *lanes = cfg->rerank_lanes ? (int32_t)cfg->rerank_lanes : cpu ? 4 : 8;
    *logit_rows = cfg->logit_rows ? cfg->logit_rows : cpu ? 32 : 256;
    *tokens = cfg->batch_tokens ? cfg->batch_tokens : cpu ? 512 : 2048;
    size_t used = strlen(desc);
    snprintf(desc + used, n - used, ", %d /rerank lanes, %lld tokens and %lld logit rows a call",
             (int)*lanes, (long long)*tokens, (long long)*logit_rows);
}

/* Creates the scoring session over the loaded model, tokenizer and backend, with the
 * config's defaults and the model's profile (its name into profile, n bytes), and sets the
 * method of /rerank requests that name none. backend: its description, which gets the
 * batch's shape (batch_shape). */
static fitm_status create_session(daemon_model *dm, int64_t n_ctx, bool rerank_step,
                                  char *backend, size_t n_backend, char *profile, size_t n,
                                  fitm_err *err)
{
    const fitm_config *cfg = dm->cfg;
    fitm_status st;
    fitm_score_opts defaults;
    fitm_score_opts_init(&defaults);
    fitm_answer_defaults answer;
    if ((st = scoring_defaults(cfg, dm->model, &defaults, &answer, profile, n, err)) != FITM_OK ||
        (st = load_moice(dm, err)) != FITM_OK) {
        fitm_score_opts_free(&defaults);
        dm->config_error = st != FITM_ERR_NOMEM;
        return st;
    }
    int32_t lanes;
    int64_t logit_rows, tokens;
    batch_shape(dm, backend, n_backend, &lanes, &logit_rows, &tokens);
    fitm_session_params rp = {.n_ctx = n_ctx, .chunk = tokens, .dummy_text = cfg->dummy_text,
                               .chat_template = cfg->chat_template, .defaults = &defaults,
                               .paper_temperature = cfg->calib_temperature,
                               .answer_template = cfg->answer_template,
                               .answer_stop = cfg->answer_stop, .profile = profile,
                               .answer_prompt_step = strcmp(cfg->answer_prompt_path, "step") == 0,
                               .rerank_step = rerank_step,
                               .rerank_lanes = lanes,
                               .logit_rows = logit_rows,
                               .answer = &answer,
                               .moice = dm->moice,
                               .position = (fitm_position_method)fitm_position_method_parse(
                                   cfg->position_method)};
    st = fitm_session_create(&dm->session, dm->model, dm->tok, dm->backend, &rp, err);
    dm->config_error = st == FITM_ERR_INVALID; /* the defaults against the model */
    fitm_score_opts_free(&defaults);
    dm->info->rerank_method = answer.rerank_method >= 0 ? answer.rerank_method
                                                        : FITM_RERANK_CALIBRATED;
    return st;
}

static fitm_status model_load(void *ctx, fitm_err *err)
{
    daemon_model *dm = ctx;
    const fitm_config *cfg = dm->cfg;
    double t0 = fitm_clock_ms();
    fitm_status st;
    if ((st = open_model(dm, err)) != FITM_OK)
        return st;
    int threads = thread_count(cfg);
    char backend[768];
    if ((st = choose_backend(dm, threads, backend, sizeof backend, err)) != FITM_OK)
        return st;
    bool rerank_step;
    if ((st = set_kv_and_path(dm, backend, sizeof backend, &rerank_step, err)) != FITM_OK)
        return st;
    const fitm_model_config *mc = fitm_model_config_of(dm->model);
    int64_t n_ctx = cfg->ctx_size;
    if (mc->n_ctx_train > 0 && n_ctx > mc->n_ctx_train)
        FITM_LOG(FITM_LOG_WARN, NULL, "ctx_size %lld is over the model's trained context: %lld "
                 "used", (long long)n_ctx, (long long)mc->n_ctx_train);
    if (mc->n_ctx_train > 0 && (n_ctx == 0 || n_ctx > mc->n_ctx_train))
        n_ctx = mc->n_ctx_train; /* positions past the trained context are not meaningful */
    if (n_ctx == 0)
        n_ctx = 4096;
    char profile[256];
    if ((st = create_session(dm, n_ctx, rerank_step, backend, sizeof backend, profile,
                             sizeof profile, err)) != FITM_OK)
        return st;
    snprintf(dm->info->arch, sizeof dm->info->arch, "%s", fitm_arch_name(mc->arch));
    dm->info->n_ctx = n_ctx;
    FITM_LOG(FITM_LOG_INFO, NULL,
             "model loaded: %s (%s, L %d, C %d, V %d), context %lld, template %s, profile %s, "
             "%s, in %.0f ms",
             cfg->model, dm->info->arch, (int)mc->n_layer, (int)mc->n_embd, (int)mc->n_vocab,
             (long long)n_ctx, fitm_session_template(dm->session), profile[0] ? profile : "none",
             backend, fitm_clock_ms() - t0);
    return FITM_OK;
}

static bool job_stop(const void *arg)
{
    return fitm_job_should_stop(arg);
}

/* /tokenize: text to ids (with the BOS/EOS the model adds when asked); /detokenize: ids to
 * text, the SentencePiece space prefix undone so that what /tokenize gave decodes to its
 * text. Control-token text is tokenized as ordinary text. */
static fitm_status run_tokens(const daemon_model *dm, fitm_tokens_work *w, fitm_err *err)
{
    const fitm_tokenizer *tok = fitm_session_tokenizer(dm->session);
    fitm_api_tokens *t = w->t;
    fitm_status st;
    w->n_ctx = fitm_session_n_ctx(dm->session);
    if (t->detokenize) {
        size_t n = 0;
        st = fitm_tok_decode(tok, t->ids, t->n_ids, FITM_TOK_DECODE_STRIP_PREFIX, NULL, 0, &n,
                             err);
        if (st == FITM_ERR_LIMIT && !(t->text = malloc(n + 1)))
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        if (st == FITM_ERR_LIMIT)
            st = fitm_tok_decode(tok, t->ids, t->n_ids, FITM_TOK_DECODE_STRIP_PREFIX, t->text,
                                 n + 1, &t->text_len, err);
        if (st != FITM_OK)
            fitm_err_prefix(err, "'tokens'");
        return st;
    }
    /* One pass: a token takes at least one byte of the text, besides the space prefix and
     * the special tokens; a second only if that bound were wrong. */
    uint32_t flags = t->add_special ? FITM_TOK_ADD_SPECIAL : 0;
    int64_t cap = (int64_t)t->text_len + 8, n = 0;
    if (!(t->ids = malloc((size_t)cap * sizeof *t->ids)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    st = fitm_tok_encode(tok, t->text, t->text_len, flags, t->ids, cap, &n, err);
    if (st == FITM_ERR_LIMIT) {
        int32_t *more = realloc(t->ids, (size_t)n * sizeof *t->ids);
        if (!more)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        t->ids = more;
        st = fitm_tok_encode(tok, t->text, t->text_len, flags, t->ids, n, &n, err);
    }
    t->n_ids = st == FITM_OK ? n : 0;
    return st;
}

/* hooks.now: /tokenize and /detokenize, on the HTTP thread (the tokenizer is read-only once
 * loaded, as the estimates' tokenizing relies on), so a body of megabytes does not hold the
 * running batch. */
static fitm_status model_now(void *ctx, fitm_job *job, fitm_err *err)
{
    if ((fitm_work_kind)job->kind != FITM_WORK_TOKENS)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "job kind %d does not run at once",
                            job->kind);
    return run_tokens(ctx, job->work, err);
}

static fitm_status model_run(void *ctx, fitm_job *job, fitm_err *err)
{
    daemon_model *dm = ctx;
    switch ((fitm_work_kind)job->kind) {
    case FITM_WORK_RERANK: {
        fitm_rerank_work *w = job->work;
        return fitm_rerank_run(dm->session, w->req, job_stop, job, &w->result, err);
    }
    case FITM_WORK_ANSWER: {
        fitm_answer_work *w = job->work;
        return fitm_answer_run(dm->session, w->req, job_stop, job, w->on_delta, w->delta_arg,
                               &w->result, err);
    }
    case FITM_WORK_TOKENS: /* runs at once (model_now), never queued */
        break;
    }
    return fitm_err_set(err, FITM_ERR_INTERNAL, "job kind %d does not run on the worker",
                        job->kind);
}

/* hooks.cost: the job's forward tokens, from its tokenized prompts (pipeline's cost). */
static fitm_status model_cost(void *ctx, const fitm_job *job, int64_t *tokens, fitm_err *err)
{
    daemon_model *dm = ctx;
    switch ((fitm_work_kind)job->kind) {
    case FITM_WORK_RERANK:
        return fitm_rerank_cost(dm->session, ((const fitm_rerank_work *)job->work)->req,
                                  false, tokens, err);
    case FITM_WORK_ANSWER:
        return fitm_answer_cost(dm->session, ((const fitm_answer_work *)job->work)->req, tokens,
                                err);
    case FITM_WORK_TOKENS: /* runs at once (model_now), never queued */
        break;
    }
    return fitm_err_set(err, FITM_ERR_INTERNAL, "job kind %d is not queued", job->kind);
}

/* Continuous batching: an /answer joins the running batch with its ranking started
 * (fitm_answer_begin), a /rerank once its caches are made (fitm_rerank_begin); attention_sort
 * (a rerank's, or an /answer's reorder) runs whole between two steps. */
static fitm_status model_begin(void *ctx, fitm_job *job, bool *joined, fitm_err *err)
{
    daemon_model *dm = ctx;
    *joined = false;
    if ((fitm_work_kind)job->kind == FITM_WORK_TOKENS)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "a tokens job runs at once, never queued");
    if ((fitm_work_kind)job->kind == FITM_WORK_RERANK) {
        fitm_rerank_work *w = job->work;
        if (!fitm_rerank_batches(w->req))
            return model_run(ctx, job, err);
        fitm_status st = fitm_rerank_begin(dm->session, w->req, job_stop, job, &w->result,
                                           &w->seq, err);
        if (st != FITM_OK || !w->seq)
            return st;
        job->kv_bytes = (int64_t)fitm_rerank_seq_kv_bytes(w->seq);
        *joined = true;
        return FITM_OK;
    }
    fitm_answer_work *w = job->work;
    fitm_status st = fitm_answer_begin(dm->session, w->req, job_stop, job, w->on_delta,
                                       w->delta_arg, &w->result, &w->seq, err);
    if (st != FITM_OK) {
        st = fitm_answer_end(w->seq, st, err);
        w->seq = NULL;
        return st;
    }
    job->kv_bytes = (int64_t)fitm_answer_seq_kv_bytes(w->seq);
    *joined = true;
    return FITM_OK;
}

static int64_t model_step(void *ctx, fitm_job *const *jobs, int32_t n, fitm_status *st,
                          bool *done)
{
    daemon_model *dm = ctx;
    fitm_batch_seq seqs[FITM_ENGINE_MAX_RUNNING] = {0};
    fitm_err errs[FITM_ENGINE_MAX_RUNNING];
    for (int32_t i = 0; i < n; i++) {
        if ((fitm_work_kind)jobs[i]->kind == FITM_WORK_RERANK)
            seqs[i].rerank = ((fitm_rerank_work *)jobs[i]->work)->seq;
        else
            seqs[i].answer = ((fitm_answer_work *)jobs[i]->work)->seq;
        seqs[i].arrived_ns = jobs[i]->enqueued_ns;
    }
    /* The prompt budget bounds how long one step (and so the gap between two tokens of a
     * running stream) takes while new prompts are prefilled beside the running answers. */
    const int64_t tokens =
        fitm_batch_step(dm->session, seqs, n, dm->cfg->batch_prefill_tokens, st, done, errs);
    for (int32_t i = 0; i < n; i++) {
        if (!done[i] && seqs[i].answer) /* its ranking's caches, then its own */
            jobs[i]->kv_bytes = (int64_t)fitm_answer_seq_kv_bytes(seqs[i].answer);
        if (!done[i])
            continue;
        if (seqs[i].rerank) {
            fitm_rerank_work *w = jobs[i]->work;
            st[i] = fitm_rerank_end(w->seq, &jobs[i]->err);
            w->seq = NULL;
            continue;
        }
        fitm_answer_work *w = jobs[i]->work;
        jobs[i]->err = errs[i];
        st[i] = fitm_answer_end(w->seq, st[i], &jobs[i]->err);
        w->seq = NULL;
    }
    return tokens;
}

static void model_unload(void *ctx)
{
    daemon_model *dm = ctx;
    fitm_session_destroy(dm->session);
    fitm_moice_destroy(dm->moice);
    dm->moice = NULL;
    fitm_backend_destroy(dm->backend);
    fitm_tok_destroy(dm->tok);
    fitm_model_close(dm->model);
    dm->session = NULL;
    dm->backend = NULL;
    dm->tok = NULL;
    dm->model = NULL;
}

/* Tells the service manager (base/notify.h; nothing outside one); a failure is logged once. */
static void notify(const char *state)
{
    static bool warned;
    fitm_err err = {{0}};
    if (fitm_notify_send(state, &err) != FITM_OK && !warned) {
        warned = true;
        FITM_LOG(FITM_LOG_WARN, NULL, "%s", err.msg);
    }
}

/* SIGTERM/SIGINT/SIGHUP taken by a thread that does not block them (one a runtime started
 * before main, such as a sanitizer's): recorded here for wait_for_signal instead of killing
 * fitmd. */
static volatile sig_atomic_t stray_signal, stray_hangup;

static void on_stray_signal(int sig)
{
    stray_signal = sig;
}

static void on_stray_hangup(int sig)
{
    (void)sig;
    stray_hangup = 1;
}

/* SIGHUP (logrotate, `systemctl reload`): nothing to reopen or re-read, so one log line and
 * fitmd serves on. */
static void hangup(void)
{
    FITM_LOG(FITM_LOG_INFO, NULL, "SIGHUP: nothing to reload (the log is stderr; restart fitmd "
                                  "to apply a changed config); serving on");
}

/* Blocks until SIGTERM/SIGINT (returns it) or until the engine failed to load (returns 0).
 * Meanwhile: each SIGHUP is logged (hangup), READY=1 goes to the service manager once the
 * model is loaded, and WATCHDOG=1 at half the interval it asks for while the engine is not
 * broken (a broken backend stops the pings, so the manager restarts the daemon). */
static int wait_for_signal(const sigset_t *set, fitm_engine *e)
{
    const double watchdog_ms = (double)fitm_notify_watchdog_usec() / 2000.0;
    double last_ping = fitm_clock_ms();
    bool ready = false;
    for (;;) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        int sig = sigtimedwait(set, NULL, &ts);
        if (sig == SIGHUP || stray_hangup) {
            stray_hangup = 0;
            hangup();
            continue;
        }
        if (sig > 0)
            return sig;
        if (stray_signal)
            return stray_signal;
        fitm_engine_state st = fitm_engine_get_state(e, NULL);
        if (st == FITM_ENGINE_FAILED)
            return 0;
        if (!ready && st == FITM_ENGINE_READY) {
            ready = true;
            notify("READY=1\nSTATUS=ready");
        }
        if (watchdog_ms > 0 && st != FITM_ENGINE_BROKEN &&
            fitm_clock_ms() - last_ping >= watchdog_ms) {
            last_ping = fitm_clock_ms();
            notify("WATCHDOG=1");
        }
    }
}

/* Flags > environment > config file > defaults into cfg; --help/--print-config print. -1 to go
 * on, else the exit status. */
static int configure(int argc, char **argv, fitm_config *cfg)
{
    fitm_err err = {{0}};
    bool help = false;
    if (fitm_config_load(cfg, argc, argv, &help, &err) != FITM_OK) {
        fprintf(stderr, "fitmd: %s\n", err.msg);
        return 2;
    }
    if (help) {
        bool print_config = false;
        for (int i = 1; i < argc; i++)
            print_config |= !strcmp(argv[i], "--print-config");
        if (print_config)
            fitm_config_print_file(stdout, cfg);
        else
            fitm_config_print_help(stdout);
        return 0;
    }
    fitm_log_threshold = (fitm_log_level)fitm_log_parse_level(cfg->log_level);
    fitm_log_json = strcmp(cfg->log_format, "json") == 0;
    if (!cfg->model[0]) {
        fprintf(stderr, "fitmd: no model: set --model PATH (or FITM_MODEL, or model = in the "
                        "config file)\n");
        return 2;
    }
    return -1;
}

/* The served model's name (model_name, else the file's) and date; the file must exist unless
 * a model_url can download it. -1 to go on, else the exit status. */
static int describe_model(const fitm_config *cfg, fitm_http_model_info *info)
{
    struct stat sb;
    if (stat(cfg->model, &sb) != 0) {
        if (!cfg->model_url[0]) {
            fprintf(stderr, "fitmd: model %s: %s (set model_url to download it)\n", cfg->model,
                    strerror(errno));
            return 1;
        }
        sb.st_mtime = time(NULL); /* downloaded on the engine thread, /health 503 meanwhile */
    } else if (!S_ISREG(sb.st_mode)) {
        /* Said before listening: the loader refuses it too, but only once the engine runs. */
        fprintf(stderr, "fitmd: model %s: not a regular file (a model is read from a regular "
                        "file, mapped or copied)\n", cfg->model);
        return 1;
    }
    if (cfg->model_name[0]) {
        snprintf(info->name, sizeof info->name, "%s", cfg->model_name);
    } else {
        char path[FITM_CONFIG_STR_BYTES];
        snprintf(path, sizeof path, "%s", cfg->model);
        snprintf(info->name, sizeof info->name, "%s", basename(path));
    }
    info->created_s = (int64_t)sb.st_mtime;
    return -1;
}

/* The weights are mapped from the model file: when it is truncated under the mapping, the
 * next read of a page that is gone raises SIGBUS. Says so in the log (write(2) only: async-
 * signal-safe) and dies of the signal as before, rather than silently. */
static void on_sigbus(int sig)
{
    static const char msg[] =
        "level=error msg=\"fatal: SIGBUS reading mapped memory: the model file was truncated "
        "or replaced while fitmd served from it; restart fitmd (replace model files by rename, "
        "never in place)\"\n";
    (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Signals go to the main thread: blocked (into *set, for sigwait) before any thread of ours
 * starts; a handler catches the ones delivered to threads started before main. */
static void block_signals(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
    struct sigaction term = {.sa_handler = on_stray_signal};
    sigaction(SIGTERM, &term, NULL);
    sigaction(SIGINT, &term, NULL);
    struct sigaction hup = {.sa_handler = on_stray_hangup};
    sigaction(SIGHUP, &hup, NULL);
    pthread_sigmask(SIG_BLOCK, set, NULL);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_sigbus};
    sigaction(SIGBUS, &sa, NULL);
}

/* Waits until the engine is past its model load or the clock passes until_ms (fitm_clock_ms).
 * False when it is still loading then. */
static bool load_ends_by(fitm_engine *e, double until_ms)
{
    while (fitm_engine_get_state(e, NULL) == FITM_ENGINE_LOADING) {
        if (fitm_clock_ms() >= until_ms)
            return false;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return true;
}

/* After a signal (sig != 0: drain within the timeout) or a failed load (sig 0: exit status
 * load_rc), stops accepting, finishes or cancels every job and closes the server. The exit
 * status. */
static int shut_down(int sig, int load_rc, const fitm_config *cfg, fitm_engine *engine,
                     fitm_http *http)
{
    int rc = 0;
    if (sig == 0) {
        fitm_err err = {{0}};
        fitm_engine_get_state(engine, &err);
        FITM_LOG(FITM_LOG_ERROR, NULL, "cannot start: %s", err.msg);
        fprintf(stderr, "fitmd: %s\n", err.msg);
        rc = load_rc;
        fitm_http_quiesce(http);
    } else {
        atomic_store(&stopping, true);
        notify("STOPPING=1\nSTATUS=draining");
        FITM_LOG(FITM_LOG_INFO, NULL, "%s: draining (up to %lld ms)",
                 sig == SIGTERM ? "SIGTERM" : "SIGINT", (long long)cfg->drain_timeout_ms);
        fitm_http_quiesce(http);
        const double until = fitm_clock_ms() + (double)cfg->drain_timeout_ms;
        if (!fitm_engine_drain(engine, cfg->drain_timeout_ms))
            FITM_LOG(FITM_LOG_WARN, NULL, "drain timeout: cancelling what is left");
        if (!load_ends_by(engine, until)) {
            /* The engine thread is stuck in the load (a read that does not return): joining it
             * could take forever. No job ever ran, so nothing is lost by leaving it behind. */
            FITM_LOG(FITM_LOG_ERROR, NULL,
                     "drain timeout: the model is still loading after %lld ms; exiting without "
                     "waiting for it", (long long)cfg->drain_timeout_ms);
            fitm_http_stop(http);
            fflush(NULL);
            _exit(1);
        }
    }
    fitm_engine_shutdown(engine); /* every job answered from here on */
    if (!fitm_http_wait_idle(http, 2000))
        FITM_LOG(FITM_LOG_WARN, NULL, "closing connections that are still open");
    fitm_http_stop(http);
    fitm_engine_destroy(engine);
    FITM_LOG(FITM_LOG_INFO, NULL, "stopped");
    return rc;
}

/* configure -> describe the model -> engine (loads on its thread) -> HTTP -> wait for a
 * signal -> shut down. */
int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--version") || !strcmp(argv[i], "-V")) {
            printf("fitmd %s\n", FITM_VERSION);
            return 0;
        }
    curl_global_init(CURL_GLOBAL_DEFAULT); /* before any thread starts */
    static fitm_config cfg;
    static fitm_http_model_info info;
    atomic_init(&info.download_pct, -1);
    int rc = configure(argc, argv, &cfg);
    if (rc < 0)
        rc = describe_model(&cfg, &info);
    if (rc >= 0)
        return rc;
    sigset_t set;
    block_signals(&set);

    /* the ports first: one in use stops fitmd now, not after the model's load */
    fitm_http_sockets socks;
    fitm_err bind_err = {{0}};
    if (fitm_http_bind(&cfg, &socks, &bind_err) != FITM_OK) {
        fprintf(stderr, "fitmd: %s\n", bind_err.msg);
        return 1;
    }
    static daemon_model dm;
    dm.cfg = &cfg;
    dm.info = &info;
    fitm_engine_hooks hooks = {.ctx = &dm, .load = model_load, .run = model_run,
                               .cost = model_cost, .now = model_now, .unload = model_unload,
                               .begin = model_begin, .step = model_step,
                               .max_running = (int32_t)cfg.max_running,
                               .kv_budget = cfg.batch_kv_mb << 20};
    fitm_err err = {{0}};
    fitm_engine *engine = NULL;
    if (fitm_engine_create(&engine, &hooks, cfg.queue_depth, &err) != FITM_OK) {
        fprintf(stderr, "fitmd: %s\n", err.msg);
        fitm_http_sockets_close(&socks);
        return 1;
    }
    fitm_engine_set_budget(engine, cfg.max_request_forward_tokens, cfg.max_queued_forward_tokens);
    fitm_http_params hp = {.cfg = &cfg, .sockets = socks, .engine = engine, .model = &info,
                           .openapi = fitm_openapi_yaml, .openapi_len = fitm_openapi_yaml_len,
                           .playground = fitm_playground_html,
                           .playground_len = fitm_playground_html_len};
    fitm_http *http = NULL;
    if (fitm_http_start(&http, &hp, &err) != FITM_OK) {
        FITM_LOG(FITM_LOG_ERROR, NULL, "%s", err.msg);
        fitm_engine_destroy(engine);
        return 1;
    }
    FITM_LOG(FITM_LOG_INFO, NULL, "fitmd %s listening on %s:%lld, loading %s, cpu kernels %s",
             FITM_VERSION, cfg.host, (long long)cfg.port, cfg.model,
             fitm_cpu_path_name(fitm_cpu_path()));
    const char *unknown[8];
    const int n_unknown = fitm_config_unknown_env(unknown, 8);
    for (int i = 0; i < n_unknown && i < 8; i++)
        FITM_LOG(FITM_LOG_WARN, NULL, "environment %.*s: not a fitmd option, ignored",
                 (int)(strchr(unknown[i], '=') - unknown[i]), unknown[i]);
    const int sig = wait_for_signal(&set, engine);
    /* Read only after a failed load (sig 0): the engine thread set dm.config_error before it
     * stored the failed state under the engine's lock, which the wait took to see it; on a
     * signal the load may still be running and writing it. */
    const int load_rc = sig == 0 && dm.config_error ? 2 : 1;
    return shut_down(sig, load_rc, &cfg, engine, http);
}
