#include "server/config.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef enum { OPT_STR, OPT_INT, OPT_REAL, OPT_ENUM } opt_kind;

typedef struct {
    const char *name;
    opt_kind kind;
    size_t offset;
    size_t str_bytes;    /* OPT_STR / OPT_ENUM: size of the char array     */
    const char *def;     /* default, as text                               */
    double min, max;     /* OPT_INT / OPT_REAL bounds (inclusive)          */
    const char *choices; /* OPT_ENUM: '|'-separated                        */
    const char *help;
} opt;

#define STR(f) OPT_STR, offsetof(fitm_config, f), sizeof(((fitm_config *)0)->f)
#define ENUM(f) OPT_ENUM, offsetof(fitm_config, f), sizeof(((fitm_config *)0)->f)
#define INT(f) OPT_INT, offsetof(fitm_config, f), 0
#define REAL(f) OPT_REAL, offsetof(fitm_config, f), 0

static const opt opts[] = {
    {"model", STR(model), "", 0, 0, NULL,
     "path of the GGUF model file to serve (required; model_url downloads to it)"},
    {"model_url", STR(model_url), "", 0, 0, NULL,
     "http(s) URL to download the model from when the model path does not exist yet "
     "(on the engine thread: /health is 503, \"downloading N%\", until it is done; resumes "
     "and retries after network faults)"},
    {"model_sha256", STR(model_sha256), "", 0, 0, NULL,
     "SHA-256 of the file model_url serves (64 hex digits), checked before the download "
     "becomes the model file; empty = not checked"},
    {"model_load", ENUM(model_load), "mmap", 0, 0, "mmap|copy",
     "mmap: map the weights from the file (it must not change while served); copy: read them "
     "into private memory (llama.cpp's --no-mmap), for files replaced in place"},
    {"model_name", STR(model_name), "", 0, 0, NULL,
     "model id reported by /v1/models and in every response; empty = file name"},
    {"strict_model", ENUM(strict_model), "false", 0, 0, "false|true",
     "true: a request whose 'model' is not model_name gets 404; false: it is answered by the "
     "served model (clients send their own default names)"},
    {"moice", STR(moice), "", 0, 0, NULL,
     "MoICE router sidecar (GGUF, docs/moice.md) for position_method moice; checked against the "
     "model at start (architecture, shapes, SHA-256 of the whole model file) and refused when "
     "it was made for another; empty = none (requests for moice get 400)"},
    {"position_method", ENUM(position_method), "none", 0, 0,
     "none|moice|ms_poe|attention_buckets",
     "position method of /rerank and /answer requests that name none (docs/"
     "position-methods.md); moice needs the moice sidecar; attention_buckets holds 7 KV "
     "caches per sequence"},
    {"host", STR(host), "127.0.0.1", 0, 0, NULL, "address to listen on (0.0.0.0 in containers)"},
    {"port", INT(port), "8080", 1, 65535, NULL, "TCP port"},
    {"probe_port", INT(probe_port), "0", 0, 65535, NULL,
     "second TCP port serving only GET /health and /metrics, with connections of its own (64, 16 "
     "per address, the same header checks and deadline; probes stay answerable while the main "
     "port is saturated); 0 = none"},
    {"backend", ENUM(backend), "auto", 0, 0, "auto|cpu|cuda",
     "compute backend, chosen once at start; cuda = GPU 0 (a fitmd built with nvcc), holding "
     "the whole model, KV cache and sampling's top-64 selection on the device, which must pass a "
     "start-up check against the CPU on the loaded model (else fitmd exits); auto = cuda when a "
     "device is there and passes, else the CPU with one log line saying why "
     "(docs/cuda-backend.md)"},
    {"gpu_weights", ENUM(gpu_weights), "bf16", 0, 0, "bf16|f32",
     "what the cuda backend's prompt products (prefill, /rerank passes) multiply in: bf16 = "
     "weights and activations rounded to bfloat16, float sums, on the tensor cores (each layer "
     "matrix converted once at start: 2 bytes per weight on the device beside the stored "
     "model, logged at start); f32 = weights dequantized to F32 per product, F32 sums, within "
     "float rounding of the CPU (docs/cuda-backend.md); decode steps multiply the stored "
     "weights either way"},
    {"threads", INT(threads), "0", 0, 1024, NULL,
     "CPU compute threads; 0 = the CPUs this process may use (affinity mask, cgroup CPU quota)"},
    {"http_threads", INT(http_threads), "4", 1, 256, NULL, "HTTP connection threads"},
    {"http_idle_timeout_s", INT(http_idle_timeout_s), "30", 1, 3600, NULL,
     "seconds a connection may stay silent (slow or idle clients) before it is closed; a "
     "request body that stops arriving this long gets 408 first, and a client that takes "
     "none of an answer (or a stream) this long is closed"},
    {"max_connections", INT(max_connections), "512", 4, 100000, NULL,
     "open client connections at once; more are refused at accept"},
    {"max_connections_per_client", INT(max_connections_per_client), "64", 1, 100000, NULL,
     "open connections from one client address; more are refused at accept"},
    {"http_header_timeout_s", INT(http_header_timeout_s), "10", 1, 3600, NULL,
     "seconds a request line and headers may take to arrive (a connection's first from its "
     "start, a later one from its first byte), however steadily they trickle (408 and close "
     "beyond; a new connection that sent nothing is closed)"},
    {"http_receive_timeout_s", INT(http_receive_timeout_s), "60", 1, 3600, NULL,
     "seconds a request's body may take to arrive, however steadily it trickles (408 and "
     "close beyond)"},
    {"api_keys", STR(api_keys), "", 0, 0, NULL,
     "comma-separated bearer keys guarding inference routes; empty = no auth"},
    {"cors_origins", STR(cors_origins), "", 0, 0, NULL,
     "browser origins allowed to call the API (CORS): * for any, or a comma-separated list "
     "such as https://app.example.org; empty = no CORS headers (browsers block cross-origin "
     "calls)"},
    {"max_body_bytes", INT(max_body_bytes), "4194304", 1024, 1073741824, NULL,
     "largest request body accepted (413 beyond, enforced while reading); the bodies of all "
     "connections held while they arrive are at most 64 MiB or 4 x this, the larger (503 "
     "with Retry-After beyond)"},
    {"max_json_members", INT(max_json_members), "65536", 16, 16777216, NULL,
     "most object keys and array elements in a request body, counted before it is parsed "
     "(400 beyond)"},
    {"max_documents", INT(max_documents), "256", 1, 4096, NULL,
     "documents per request (more: 422)"},
    {"max_tokens_per_doc", INT(max_tokens_per_doc), "512", 8, 1000000, NULL,
     "tokens kept per document (longer documents are truncated)"},
    {"ctx_size", INT(ctx_size), "8192", 0, 1048576, NULL,
     "context length in tokens (prompt + answer); 0 = the model's trained context"},
    {"queue_depth", INT(queue_depth), "64", 1, 100000, NULL,
     "requests waiting for the engine; beyond it 503 with Retry-After"},
    {"max_running", INT(max_running), "8", 1, 32, NULL,
     "sequences running together in one batch (/answer generations and batched /rerank "
     "requests); more wait in the queue"},
    {"batch_kv_mb", INT(batch_kv_mb), "1024", 1, 1048576, NULL,
     "KV cache memory (MiB) the running sequences (/answer generations, /rerank lanes) may "
     "hold before new ones wait"},
    {"batch_prefill_tokens", INT(batch_prefill_tokens), "128", 1, 65536, NULL,
     "prompt tokens per batched step while streams decode, over the prompts and /rerank passes "
     "of requests that arrived after those streams' first token (requests that arrive together "
     "are prefilled in whole calls before any of them streams on): lower keeps running "
     "streams' token gaps short, higher gives new requests their first token sooner"},
    {"kv_cache_type", ENUM(kv_cache_type), "auto", 0, 0, "auto|f32|f16",
     "values of the KV cache: f16 = half the memory per sequence (more generations fit "
     "batch_kv_mb) and half the bytes a decode step's attention reads, K and V rounded to fp16 "
     "as llama.cpp's default cache holds them; f32 = exact; auto = f16 on the CPU, f32 on the "
     "cuda backend (which keeps F32 only)"},
    {"answer_prompt_path", ENUM(answer_prompt_path), "batch", 0, 0, "batch|step",
     "how /answer and the OpenAI routes compute their prompts: batch = weights converted to "
     "F32 in tiles shared by the chunk's rows; step = the decode steps' quantized products "
     "(activations rounded to Q8, as llama.cpp computes prompts), faster on an AVX-512 CPU "
     "and for short chunks (docs/load-benchmark.md); an /answer's own scoring passes too "
     "(its answers were measured with them there)"},
    {"rerank_path", ENUM(rerank_path), "auto", 0, 0, "auto|batch|step",
     "how /rerank computes its passes (an /answer's scoring follows answer_prompt_path): "
     "batch = weights converted to F32 in tiles shared by a call's rows; step = the decode "
     "steps' quantized products (activations rounded to Q8), 2.7x faster on an AVX-512 CPU, "
     "recall within one question of 50 of batch's "
     "(docs/rerank-results.md); auto = step on the CPU, batch on the cuda backend"},
    {"rerank_lanes", INT(rerank_lanes), "0", 0, 16, NULL,
     "lanes of a /rerank (every method but attention_sort): each lane has KV caches of its "
     "own and a contiguous block of the request's windows or documents, and each batched "
     "forward call carries a part of every lane's pass, so a request takes fewer calls; "
     "scores are the same with any number (a lane's first window computes the prompt's "
     "shared head afresh: usage.forward_tokens grows by it per extra lane); a request uses "
     "at most one lane per window or document, an /answer's ranking one; 0 = 8 on the cuda "
     "backend, 4 on the CPU (docs/load-benchmark.md)"},
    {"logit_rows", INT(logit_rows), "0", 0, 1024, NULL,
     "most logit rows one batched forward call computes (query_likelihood's question rows, "
     "the answers' next tokens): the forward's logits scratch holds this many rows of the "
     "vocabulary's floats (256 x Gemma 3's 262,144 = 256 MiB); 0 = 256 on the cuda backend, "
     "32 on the CPU"},
    {"batch_tokens", INT(batch_tokens), "0", 0, 65536, NULL,
     "most tokens one batched forward call carries (a longer prompt or pass goes over several; "
     "while streams decode, batch_prefill_tokens bounds a step's prompt tokens instead): the "
     "forward's activations scratch holds this many rows, and on the cuda backend a larger "
     "call fills more of the card per launch; results do not depend on it; 0 = 2048 on the "
     "cuda backend, 512 on the CPU"},
    {"request_timeout_ms", INT(request_timeout_ms), "120000", 100, 86400000, NULL,
     "deadline of one request, queueing included"},
    {"max_request_forward_tokens", INT(max_request_forward_tokens), "32768", 0, 1e12, NULL,
     "most forward tokens one request may cost, estimated from its tokenized prompt before it "
     "queues (reference passes, windows, max_tokens counted): 422 beyond; 0 = no limit"},
    {"max_queued_forward_tokens", INT(max_queued_forward_tokens), "262144", 0, 1e12, NULL,
     "most estimated forward tokens the waiting requests may hold together: 503 with "
     "Retry-After beyond (an empty queue takes any request); 0 = no limit"},
    {"drain_timeout_ms", INT(drain_timeout_ms), "30000", 0, 3600000, NULL,
     "on SIGTERM: /health says draining, new requests get 503, in-flight ones have this long "
     "to finish; then exit 0 (a model load still running then: exit 1 without it)"},
    {"max_answer_tokens", INT(max_answer_tokens), "512", 1, 65536, NULL,
     "most max_tokens (max_completion_tokens) /answer and the OpenAI routes accept (400 "
     "beyond)"},
    {"chat_template", ENUM(chat_template), "auto", 0, 0, "auto|raw|chatml|gemma|llama2|llama3",
     "prompt wrapping; auto = recognise tokenizer.chat_template, raw when unknown"},
    {"dummy_text", STR(dummy_text),
     "The quick brown fox jumps over the lazy dog while the sun sets behind the hills.", 0, 0,
     NULL, "neutral text of the dummy documents of the reference passes"},
    {"calib_temperature", REAL(calib_temperature), "5e-5", 1e-12, 1e6, NULL,
     "default temperature t of method paper's alpha = softmax(rel / t)"},
    {"profile", STR(profile), "", 0, 0, NULL,
     "scoring profile file (config/profiles/); empty = <model path without .gguf>.profile "
     "when that exists, else none; 'none' = no profile"},
    {"rows", STR(rows), "", 0, 0, NULL,
     "scoring default: attention rows last|question|suffix; empty = the profile's, else "
     "question"},
    {"layers", STR(layers), "", 0, 0, NULL,
     "scoring default: layers to average, comma-separated (negative from the end); empty = "
     "the profile's, else the three at 28-44% of the depth (5,6,7 of 18)"},
    {"heads", STR(heads), "", 0, 0, NULL,
     "scoring default: layer:head pairs (overrides layers); empty = the profile's, else all "
     "heads of the layers"},
    {"aggregate", STR(aggregate), "", 0, 0, NULL,
     "scoring default: sum|mean over a document's tokens; empty = the profile's, else sum"},
    {"skip_first", STR(skip_first), "", 0, 0, NULL,
     "scoring default: tokens at the start of each document not counted; empty = the "
     "profile's, else 0"},
    {"reference", STR(reference), "", 0, 0, NULL,
     "scoring default: none|dummy|null_query|null_suffix|both; empty = the profile's, else "
     "null_suffix"},
    {"dummy_source", STR(dummy_source), "", 0, 0, NULL,
     "scoring default: fixed|documents text of the dummy passes; empty = the profile's, else "
     "fixed"},
    {"form", STR(form), "", 0, 0, NULL,
     "scoring default: difference|log_ratio calibration; empty = the profile's, else "
     "difference"},
    {"head_query", STR(head_query), "", 0, 0, NULL,
     "scoring default: query|null, the question before the documents (null: \"N/A\", so the "
     "trailing question finds it only in the documents); empty = the profile's, else query"},
    {"sink_factor", STR(sink_factor), "", 0, 0, NULL,
     "scoring default: leave out tokens over f x the mean reference attention (0 = off); "
     "empty = the profile's, else 0"},
    {"window", STR(window), "", 0, 0, NULL,
     "scoring default: documents per window (0 = one prompt); empty = the profile's, else 0"},
    {"temperature", STR(temperature), "", 0, 0, NULL,
     "scoring default: t of weight = softmax(rel_scaled / t); empty = the profile's, else 0.05"},
    {"score_scale", STR(score_scale), "", 0, 0, NULL,
     "scoring default: relevance_score = sigmoid(score_scale x rel_scaled + score_bias); "
     "empty = the profile's, else 1 / temperature"},
    {"score_bias", STR(score_bias), "", 0, 0, NULL,
     "scoring default: see score_scale; empty = the profile's, else 0"},
    {"fuse_weight", STR(fuse_weight), "", 0, 0, NULL,
     "scoring default: method fused's w >= 0, score = ln(query likelihood) + w x z-scored "
     "attention of the question to the document (docs/scoring.md); empty = the profile's, "
     "else 0.02"},
    {"fuse_scale", STR(fuse_scale), "", 0, 0, NULL,
     "scoring default: method fused's relevance_score = sigmoid(fuse_scale x score + "
     "fuse_bias), fuse_scale > 0; empty = the profile's, else 3.06908"},
    {"fuse_bias", STR(fuse_bias), "", 0, 0, NULL,
     "scoring default: see fuse_scale; empty = the profile's, else 6.35162"},
    {"fuse_layers", STR(fuse_layers), "", 0, 0, NULL,
     "scoring default: method fused's attention layers, comma-separated (negative from the "
     "end); empty = the profile's, else 0 (the first layer)"},
    {"passages", STR(passages), "", 0, 0, NULL,
     "scoring default: whole|sentences, what query_likelihood and fused score of a document: "
     "its whole text, or the best of that and of its first sentence joined to each later one "
     "(one more pass a sentence, docs/scoring.md); empty = the profile's, else whole"},
    {"rerank_method", STR(rerank_method), "", 0, 0, NULL,
     "method of /rerank and /v1/score requests that name none: calibrated, attention, "
     "attention_sort, query_likelihood, relevance, paper or fused (docs/scoring.md); empty = "
     "the profile's, else calibrated"},
    {"answer_calibrate", STR(answer_calibrate), "", 0, 0, NULL,
     "/answer default: true|false, intervene with the calibrated weights; empty = the "
     "profile's, else true"},
    {"answer_reorder", STR(answer_reorder), "", 0, 0, NULL,
     "/answer default: none or a /rerank method to order the documents by; empty = the "
     "profile's, else none"},
    {"answer_reorder_placement", STR(answer_reorder_placement), "", 0, 0, NULL,
     "/answer default: first|last, where the reorder puts the most relevant document; empty = "
     "the profile's, else first"},
    {"answer_top_n", STR(answer_top_n), "", 0, 0, NULL,
     "/answer default: how many of the documents the prompt keeps, the most relevant by the "
     "reorder (without one: the first as sent); 0 = every document; empty = the profile's, "
     "else 0"},
    {"answer_template", STR(answer_template), "", 0, 0, NULL,
     "/answer's prompt for models without a chat template: text with {documents} once and "
     "{question} after it, \\n for newlines; empty = the built-in template (two "
     "worked examples before the documents)"},
    {"answer_stop", STR(answer_stop), "", 0, 0, NULL,
     "the text that ends an answer in answer_template's format (\\n for a newline): /answer's "
     "stop string when a request with documents sends no 'stop' (a request's 'stop' replaces "
     "it); empty = \\n with the built-in template, none with another"},
    {"log_level", ENUM(log_level), "info", 0, 0, "debug|info|warn|error", "log threshold"},
    {"log_format", ENUM(log_format), "logfmt", 0, 0, "logfmt|json",
     "log lines on stderr: logfmt (time level=... req=... msg=\"...\") or json (one object "
     "per line with time, level, req, msg)"},
};
#define N_OPTS (sizeof opts / sizeof opts[0])

static const opt *find_opt(const char *name, size_t len)
{
    for (size_t i = 0; i < N_OPTS; i++) {
        const char *o = opts[i].name;
        if (strlen(o) != len)
            continue;
        size_t j = 0;
        for (; j < len; j++) {
            char c = name[j] == '-' ? '_' : (char)tolower((unsigned char)name[j]);
            if (c != o[j])
                break;
        }
        if (j == len)
            return &opts[i];
    }
    return NULL;
}

static bool enum_has(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n))
            return true;
        if (!bar)
            break;
        p = bar + 1;
    }
    return false;
}

/* Parses text into the option's field; where says where the text came from (for messages). */
static fitm_status set_opt(fitm_config *cfg, const opt *o, const char *text, const char *where,
                           fitm_err *err)
{
    char *field = (char *)cfg + o->offset;
    switch (o->kind) {
    case OPT_STR:
    case OPT_ENUM:
        if (strlen(text) >= o->str_bytes)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: %s is too long (at most %zu bytes)",
                                where, o->name, o->str_bytes - 1);
        if (o->kind == OPT_ENUM && !enum_has(o->choices, text))
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: %s = '%s': must be one of %s", where,
                                o->name, text, o->choices);
        memcpy(field, text, strlen(text) + 1);
        return FITM_OK;
    case OPT_INT: {
        errno = 0;
        char *end = NULL;
        long long v = strtoll(text, &end, 10);
        if (errno || end == text || *end != '\0')
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: %s = '%s': not an integer", where,
                                o->name, text);
        if ((double)v < o->min || (double)v > o->max)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%s: %s = '%s': must be between %.0f and %.0f", where, o->name,
                                text, o->min, o->max);
        *(int64_t *)(void *)field = v;
        return FITM_OK;
    }
    case OPT_REAL: {
        errno = 0;
        char *end = NULL;
        double v = strtod(text, &end);
        if (errno || end == text || *end != '\0' || !isfinite(v))
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: %s = '%s': not a number", where,
                                o->name, text);
        if (v < o->min || v > o->max)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: %s = '%s': must be between %g and %g",
                                where, o->name, text, o->min, o->max);
        *(double *)(void *)field = v;
        return FITM_OK;
    }
    }
    return fitm_err_set(err, FITM_ERR_INTERNAL, "bad option kind");
}

void fitm_config_defaults(fitm_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_OPTS; i++) {
        fitm_status s = set_opt(cfg, &opts[i], opts[i].def, "default", NULL);
        (void)s; /* defaults are valid by construction; test_config checks it */
    }
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

int fitm_config_api_keys(const char *list, char (*keys)[FITM_CONFIG_STR_BYTES], int max)
{
    int n = 0;
    for (const char *p = list; *p;) {
        const size_t len = strcspn(p, ",");
        const char *s = p, *e = p + len;
        while (s < e && *s == ' ')
            s++;
        while (e > s && e[-1] == ' ')
            e--;
        if (e > s && keys && n < max) {
            const size_t k = (size_t)(e - s) < FITM_CONFIG_STR_BYTES ? (size_t)(e - s)
                                                                     : FITM_CONFIG_STR_BYTES - 1;
            memcpy(keys[n], s, k);
            keys[n][k] = '\0';
        }
        n += e > s;
        p += len + (p[len] == ',');
    }
    return n;
}

/* A scoring option's or an /answer default's text must parse (their meaning is score.h's),
 * model_sha256 must be a digest and api_keys must hold 1 to FITM_CONFIG_MAX_API_KEYS keys when
 * set, so that a misspelt value is a configuration error (exit 2, and --print-config says so),
 * not a failed start once the model has loaded (or downloaded). */
static fitm_status check_value(const opt *o, const char *text, const char *where,
                               fitm_err *err)
{
    fitm_status st = FITM_OK;
    if (!strcmp(o->name, "api_keys") && *text) {
        const int n = fitm_config_api_keys(text, NULL, 0);
        if (n == 0) /* a template's "${K1},${K2}" with both unset must not serve openly */
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%s: api_keys holds no key (only commas and spaces); leave it "
                                "empty to serve without authentication", where);
        if (n > FITM_CONFIG_MAX_API_KEYS)
            return fitm_err_set(err, FITM_ERR_INVALID, "%s: api_keys lists more than %d keys",
                                where, FITM_CONFIG_MAX_API_KEYS);
    }
    if (!strcmp(o->name, "model_sha256") && *text) {
        size_t n = 0;
        while (isxdigit((unsigned char)text[n]))
            n++;
        if (n != 64 || text[n])
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "%s: model_sha256 = '%.100s': must be 64 hex digits", where, text);
    }
    if (fitm_score_is_key(o->name)) {
        fitm_score_opts scratch;
        fitm_score_opts_init(&scratch);
        st = fitm_score_opts_set(&scratch, o->name, text, err);
        fitm_score_opts_free(&scratch);
    } else if (fitm_answer_defaults_is_key(o->name)) {
        fitm_answer_defaults scratch;
        fitm_answer_defaults_init(&scratch);
        st = fitm_answer_defaults_set(&scratch, o->name, text, err);
    }
    if (st != FITM_OK)
        fitm_err_prefix(err, "%s", where);
    return st == FITM_OK ? FITM_OK : FITM_ERR_INVALID;
}

/* The value of a config file's line (the text after "=", trimmed): a quoted text (the quotes
 * removed; a '"' inside it stays) or the text up to a '#' that follows a blank (the value's
 * first character follows the blank after "="), either followed by an optional comment. NULL
 * when a quoted text is followed by anything but a comment. */
static char *line_value(char *v)
{
    if (*v == '"') {
        for (char *q = strchr(v + 1, '"'); q; q = strchr(q + 1, '"')) {
            const char *rest = q + 1;
            while (isspace((unsigned char)*rest))
                rest++;
            if (*rest == '\0' || *rest == '#') {
                *q = '\0';
                return v + 1;
            }
        }
        return NULL;
    }
    for (char *c = strchr(v, '#'); c; c = strchr(c + 1, '#'))
        if (c == v || isspace((unsigned char)c[-1])) { /* v follows "= " */
            *c = '\0';
            break;
        }
    return trim(v);
}

fitm_status fitm_config_score_opts(const fitm_config *cfg, fitm_score_opts *o, fitm_err *err)
{
    for (size_t i = 0; i < N_OPTS; i++) {
        if (!fitm_score_is_key(opts[i].name))
            continue;
        fitm_status st = fitm_score_opts_set(o, opts[i].name, (const char *)cfg + opts[i].offset,
                                             err);
        if (st != FITM_OK)
            return FITM_ERR_INVALID;
    }
    return FITM_OK;
}

fitm_status fitm_config_answer_defaults(const fitm_config *cfg, fitm_answer_defaults *d,
                                        fitm_err *err)
{
    fitm_answer_defaults_init(d);
    for (size_t i = 0; i < N_OPTS; i++)
        if (fitm_answer_defaults_is_key(opts[i].name) &&
            fitm_answer_defaults_set(d, opts[i].name, (const char *)cfg + opts[i].offset, err) !=
                FITM_OK)
            return FITM_ERR_INVALID;
    return FITM_OK;
}

static fitm_status load_file(fitm_config *cfg, const char *path, fitm_err *err)
{
    /* O_NONBLOCK: a FIFO with no writer must not block the open; a directory opens fine
     * but every read fails (EISDIR), which fgets would take for an empty file */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "config file %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return fitm_err_set(err, FITM_ERR_INVALID, "config file %s: not a regular file", path);
    }
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return fitm_err_set(err, FITM_ERR_INVALID, "config file %s: %s", path, strerror(errno));
    }
    fitm_status st = FITM_OK;
    char line[4096];
    int lineno = 0;
    while (st == FITM_OK && fgets(line, sizeof line, f)) {
        lineno++;
        char where[FITM_ERR_MSG_BYTES / 2];
        snprintf(where, sizeof where, "%.200s:%d", path, lineno);
        if (!strchr(line, '\n') && !feof(f)) {
            st = fitm_err_set(err, FITM_ERR_INVALID, "%s: line too long", where);
            break;
        }
        char *s = trim(line);
        if (*s == '\0' || *s == '#')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            st = fitm_err_set(err, FITM_ERR_INVALID, "%s: '%.100s': expected name = value", where,
                              s);
            break;
        }
        *eq = '\0';
        char *name = trim(s), *value = line_value(trim(eq + 1));
        if (!value) {
            st = fitm_err_set(err, FITM_ERR_INVALID,
                              "%s: %.100s: a quoted value may be followed only by a comment", where,
                              name);
            break;
        }
        const opt *o = find_opt(name, strlen(name));
        if (!o) {
            st = fitm_err_set(err, FITM_ERR_INVALID, "%s: unknown option '%.100s'", where, name);
            break;
        }
        st = set_opt(cfg, o, value, where, err);
        if (st == FITM_OK)
            st = check_value(o, (const char *)cfg + o->offset, where, err);
    }
    if (st == FITM_OK && ferror(f))
        st = fitm_err_set(err, FITM_ERR_INVALID, "config file %s: read error", path);
    fclose(f);
    return st;
}

static void env_name(const opt *o, char *buf, size_t n)
{
    size_t j = (size_t)snprintf(buf, n, "FITM_");
    for (size_t i = 0; o->name[i] && j + 1 < n; i++)
        buf[j++] = (char)toupper((unsigned char)o->name[i]);
    buf[j] = '\0';
}

int fitm_config_unknown_env(const char **vars, int max)
{
    extern char **environ;
    int n = 0;
    for (char **e = environ; e && *e; e++) {
        const char *v = *e, *eq = strchr(v, '=');
        if (strncmp(v, "FITM_", 5) != 0 || !eq || !strncmp(v, "FITM_CONFIG=", 12) ||
            !strncmp(v, "FITM_CPU=", 9) || !strncmp(v, "FITM_CUDA_EMU_", 14))
            continue;
        bool known = false;
        for (size_t i = 0; i < N_OPTS && !known; i++) {
            char name[64];
            env_name(&opts[i], name, sizeof name);
            known = strlen(name) == (size_t)(eq - v) && !strncmp(name, v, (size_t)(eq - v));
        }
        if (!known && n++ < max)
            vars[n - 1] = v;
    }
    return n;
}

/* Pass 1: finds --config (over FITM_CONFIG) and --help without applying anything else. */
static fitm_status find_config_file(int argc, char **argv, const char **file, bool *help_out,
                                    fitm_err *err)
{
    *file = getenv("FITM_CONFIG");
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help_out = true;
            return FITM_OK;
        }
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc)
                return fitm_err_set(err, FITM_ERR_INVALID, "--config needs a file name");
            *file = argv[++i];
        } else if (!strncmp(argv[i], "--config=", 9)) {
            *file = argv[i] + 9;
        }
    }
    return FITM_OK;
}

/* Applies the FITM_<NAME> environment variables, over the file's values. */
static fitm_status apply_env(fitm_config *cfg, fitm_err *err)
{
    fitm_status st;
    for (size_t i = 0; i < N_OPTS; i++) {
        char name[64], where[96];
        env_name(&opts[i], name, sizeof name);
        const char *v = getenv(name);
        snprintf(where, sizeof where, "environment %s", name);
        if (v && (st = set_opt(cfg, &opts[i], v, where, err)) != FITM_OK)
            return st;
        if (v && (st = check_value(&opts[i], v, where, err)) != FITM_OK)
            return st;
    }
    return FITM_OK;
}

/* Applies the command line's --name=value and --name value flags, over the environment's;
 * --print-config sets *help_out. */
static fitm_status apply_flags(fitm_config *cfg, int argc, char **argv, bool *help_out,
                               fitm_err *err)
{
    fitm_status st;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--config")) {
            i++;
            continue;
        }
        if (!strncmp(a, "--config=", 9))
            continue;
        if (!strcmp(a, "--print-config")) {
            *help_out = true;
            continue;
        }
        if (strncmp(a, "--", 2) != 0)
            return fitm_err_set(err, FITM_ERR_INVALID, "unexpected argument '%.200s'", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const opt *o = find_opt(name, len);
        if (!o)
            return fitm_err_set(err, FITM_ERR_INVALID, "unknown option '--%.*s'", (int)len, name);
        const char *value = eq ? eq + 1 : NULL;
        if (!value) {
            if (i + 1 >= argc)
                return fitm_err_set(err, FITM_ERR_INVALID, "option '--%s' needs a value", o->name);
            value = argv[++i];
        }
        char where[96];
        snprintf(where, sizeof where, "flag --%s", o->name);
        if ((st = set_opt(cfg, o, value, where, err)) != FITM_OK)
            return st;
        if ((st = check_value(o, value, where, err)) != FITM_OK)
            return st;
    }
    return FITM_OK;
}

fitm_status fitm_config_load(fitm_config *cfg, int argc, char **argv, bool *help_out,
                             fitm_err *err)
{
    fitm_config_defaults(cfg);
    *help_out = false;

    const char *file;
    fitm_status st = find_config_file(argc, argv, &file, help_out, err);
    if (st != FITM_OK || *help_out)
        return st;
    if (file && *file && (st = load_file(cfg, file, err)) != FITM_OK)
        return st;
    if ((st = apply_env(cfg, err)) != FITM_OK)
        return st;
    return apply_flags(cfg, argc, argv, help_out, err);
}

static void print_bounds(FILE *f, const opt *o)
{
    if (o->kind == OPT_INT)
        fprintf(f, "%.0f..%.0f", o->min, o->max);
    else if (o->kind == OPT_REAL)
        fprintf(f, "%g..%g", o->min, o->max);
    else if (o->kind == OPT_ENUM)
        fprintf(f, "%s", o->choices);
    else
        fprintf(f, "text");
}

void fitm_config_print_help(FILE *f)
{
    fprintf(f, "usage: fitmd [--config FILE] [--NAME VALUE ...] [--print-config] [--version]\n\n"
               "Precedence: flags > FITM_* environment > config file > defaults. The config "
               "file: --config FILE, else the environment's FITM_CONFIG.\n\noptions:\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt *o = &opts[i];
        char env[64];
        env_name(o, env, sizeof env);
        fprintf(f, "  --%-20s %s\n      env %s; default '%s'; ", o->name, o->help, env, o->def);
        print_bounds(f, o);
        fputc('\n', f);
    }
}

void fitm_config_print_file(FILE *f, const fitm_config *cfg)
{
    fprintf(f, "# fitmd configuration. Precedence: flags > FITM_* environment > this file > "
               "defaults.\n# Format: name = value; '#' at the start of a line or after a blank "
               "starts a comment (quote a value that holds one).\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt *o = &opts[i];
        const char *field = (const char *)cfg + o->offset;
        char env[64];
        env_name(o, env, sizeof env);
        fprintf(f, "\n# %s\n# env %s; default '%s'; ", o->help, env, o->def);
        print_bounds(f, o);
        fprintf(f, "\n%s = ", o->name);
        switch (o->kind) {
        case OPT_STR:
        case OPT_ENUM:
            /* Secrets never reach a printed config (it ends up in logs and tickets); the
             * placeholder is one key no client has, so a file reused as is fails closed. */
            if (!strcmp(o->name, "api_keys") && field[0])
                fprintf(f, "\"<redacted>\"\n");
            else
                fprintf(f, "\"%s\"\n", field);
            break;
        case OPT_INT:
            fprintf(f, "%lld\n", (long long)*(const int64_t *)(const void *)field);
            break;
        case OPT_REAL:
            fprintf(f, "%g\n", *(const double *)(const void *)field);
            break;
        }
    }
}
