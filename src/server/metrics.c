#include "server/metrics.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

static const char *route_names[FITM_ROUTE_COUNT] = {
    [FITM_ROUTE_RERANK] = "rerank",   [FITM_ROUTE_HEALTH] = "health",
    [FITM_ROUTE_METRICS] = "metrics", [FITM_ROUTE_MODELS] = "models",
    [FITM_ROUTE_OPENAPI] = "openapi", [FITM_ROUTE_ANSWER] = "answer",
    [FITM_ROUTE_CHAT] = "chat_completions", [FITM_ROUTE_COMPLETIONS] = "completions",
    [FITM_ROUTE_PLAYGROUND] = "playground", [FITM_ROUTE_TOKENIZE] = "tokenize",
    [FITM_ROUTE_OTHER] = "other",
};

/* HTTP codes fitmd sends (499: only counted, for a client that left); any other is counted
 * as code "other". */
static const int codes[] = {200, 204, 400, 401, 404, 405, 408, 413, 414, 415, 417,
                            422, 429, 431, 499, 500, 501, 503, 505};
#define N_CODES (sizeof codes / sizeof codes[0])

static const double buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                 1,     2.5,  5,     10,   30,  60,  120};
#define N_BUCKETS (sizeof buckets / sizeof buckets[0])

/* A Prometheus histogram of seconds over `buckets`; callers hold M.mu. */
typedef struct {
    uint64_t bucket[N_BUCKETS]; /* non-cumulative; summed at render */
    uint64_t count;
    double sum;
} histogram;

static void observe(histogram *h, double seconds)
{
    size_t b = 0;
    while (b < N_BUCKETS && seconds > buckets[b])
        b++;
    if (b < N_BUCKETS)
        h->bucket[b]++;
    h->count++;
    h->sum += seconds;
}

/* The _bucket, _sum and _count lines of h; label is `key="value"` or "". */
static void render(fitm_buf *s, const char *name, const char *label, const histogram *h)
{
    const char *sep = label[0] ? "," : "";
    uint64_t cum = 0;
    for (size_t b = 0; b < N_BUCKETS; b++) {
        cum += h->bucket[b];
        fitm_buf_printf(s, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, label, sep, buckets[b],
                        (unsigned long long)cum);
    }
    fitm_buf_printf(s, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, label, sep,
                    (unsigned long long)h->count);
    const char *open = label[0] ? "{" : "", *close = label[0] ? "}" : "";
    fitm_buf_printf(s, "%s_sum%s%s%s %.6f\n%s_count%s%s%s %llu\n", name, open, label, close,
                    h->sum, name, open, label, close, (unsigned long long)h->count);
}

static struct {
    pthread_mutex_t mu;
    uint64_t requests[FITM_ROUTE_COUNT][N_CODES + 1];
    histogram duration[FITM_ROUTE_COUNT];
    int64_t prompt_tokens, forward_tokens;
    int64_t completion_tokens;
    histogram ttft, wait;
} M = {.mu = PTHREAD_MUTEX_INITIALIZER};

const char *fitm_route_name(fitm_route r)
{
    return (unsigned)r < FITM_ROUTE_COUNT ? route_names[r] : "other";
}

void fitm_metrics_request(fitm_route r, int http_code, double seconds)
{
    if ((unsigned)r >= FITM_ROUTE_COUNT)
        r = FITM_ROUTE_OTHER;
    size_t ci = N_CODES;
    for (size_t i = 0; i < N_CODES; i++)
        if (codes[i] == http_code)
            ci = i;
    pthread_mutex_lock(&M.mu);
    M.requests[r][ci]++;
    observe(&M.duration[r], seconds);
    pthread_mutex_unlock(&M.mu);
}

void fitm_metrics_tokens(int64_t prompt_tokens, int64_t forward_tokens)
{
    pthread_mutex_lock(&M.mu);
    M.prompt_tokens += prompt_tokens;
    M.forward_tokens += forward_tokens;
    pthread_mutex_unlock(&M.mu);
}

void fitm_metrics_completion(int64_t completion_tokens, double first_token_s)
{
    pthread_mutex_lock(&M.mu);
    M.completion_tokens += completion_tokens;
    if (first_token_s >= 0)
        observe(&M.ttft, first_token_s);
    pthread_mutex_unlock(&M.mu);
}

void fitm_metrics_queue_wait(double seconds)
{
    pthread_mutex_lock(&M.mu);
    observe(&M.wait, seconds);
    pthread_mutex_unlock(&M.mu);
}

/* The batch series: what the engine's running batch did (see metrics.h). */
static void render_batch(fitm_buf *s, const fitm_metrics_gauges *g)
{
    fitm_buf_printf(s, "# HELP fitm_batch_running Sequences (/answer generations, /rerank "
                       "requests) in the running batch.\n"
                       "# TYPE fitm_batch_running gauge\nfitm_batch_running %lld\n",
                    (long long)g->batch_running);
    fitm_buf_printf(s, "# HELP fitm_batch_size Sequences in the last batched forward step.\n"
                       "# TYPE fitm_batch_size gauge\nfitm_batch_size %lld\n",
                    (long long)g->batch_size);
    fitm_buf_printf(s, "# HELP fitm_batch_kv_bytes KV cache bytes the running batch holds.\n"
                       "# TYPE fitm_batch_kv_bytes gauge\nfitm_batch_kv_bytes %lld\n",
                    (long long)g->batch_kv_bytes);
    fitm_buf_printf(s,
                    "# HELP fitm_batch_tokens_per_second Forward tokens per second of the last "
                    "step (its decode tokens and prompt rows; over time: "
                    "rate(fitm_batch_step_tokens_total)).\n"
                    "# TYPE fitm_batch_tokens_per_second gauge\nfitm_batch_tokens_per_second "
                    "%.3f\n",
                    g->batch_last_step_seconds > 0
                        ? (double)g->batch_last_tokens / g->batch_last_step_seconds
                        : 0.0);
    fitm_buf_printf(s, "# HELP fitm_batch_steps_total Batched forward steps run.\n"
                       "# TYPE fitm_batch_steps_total counter\nfitm_batch_steps_total %lld\n",
                    (long long)g->batch_steps);
    fitm_buf_printf(s,
                    "# HELP fitm_batch_step_sequences_total Sum over steps of the sequences "
                    "in the step (divided by fitm_batch_steps_total: the mean batch size).\n"
                    "# TYPE fitm_batch_step_sequences_total counter\n"
                    "fitm_batch_step_sequences_total %lld\n",
                    (long long)g->batch_step_sequences);
    fitm_buf_printf(s,
                    "# HELP fitm_batch_step_tokens_total Forward tokens of the batched steps "
                    "(decode tokens and prompt rows).\n"
                    "# TYPE fitm_batch_step_tokens_total counter\n"
                    "fitm_batch_step_tokens_total %lld\n",
                    (long long)g->batch_step_tokens);
    fitm_buf_printf(s, "# HELP fitm_batch_step_seconds_total Time spent in batched steps.\n"
                       "# TYPE fitm_batch_step_seconds_total counter\n"
                       "fitm_batch_step_seconds_total %.6f\n",
                    g->batch_step_seconds);
}

/* The request counters and histograms (M.mu held): requests by route and status, durations,
 * tokens, time to first token and queue wait. */
static void render_requests(fitm_buf *s)
{
    fitm_buf_printf(s,
                    "# HELP fitm_requests_total HTTP requests answered, by route and status code.\n"
                    "# TYPE fitm_requests_total counter\n");
    for (int r = 0; r < FITM_ROUTE_COUNT; r++) {
        for (size_t c = 0; c < N_CODES; c++)
            if (M.requests[r][c])
                fitm_buf_printf(s, "fitm_requests_total{route=\"%s\",code=\"%d\"} %llu\n",
                                route_names[r], codes[c], (unsigned long long)M.requests[r][c]);
        if (M.requests[r][N_CODES])
            fitm_buf_printf(s, "fitm_requests_total{route=\"%s\",code=\"other\"} %llu\n",
                            route_names[r], (unsigned long long)M.requests[r][N_CODES]);
    }
    fitm_buf_printf(s, "# HELP fitm_request_duration_seconds Time from a request's arrival to its "
            "response.\n# TYPE fitm_request_duration_seconds histogram\n");
    for (int r = 0; r < FITM_ROUTE_COUNT; r++) {
        char label[64];
        snprintf(label, sizeof label, "route=\"%s\"", route_names[r]);
        render(s, "fitm_request_duration_seconds", label, &M.duration[r]);
    }
    fitm_buf_printf(s, "# HELP fitm_prompt_tokens_total Prompt tokens of scored requests.\n"
            "# TYPE fitm_prompt_tokens_total counter\nfitm_prompt_tokens_total %lld\n",
        (long long)M.prompt_tokens);
    fitm_buf_printf(
        s,
        "# HELP fitm_forward_tokens_total Tokens computed by forward passes (prefix reuse "
        "makes this less than passes x prompt).\n"
        "# TYPE fitm_forward_tokens_total counter\nfitm_forward_tokens_total %lld\n",
        (long long)M.forward_tokens);
    fitm_buf_printf(s, "# HELP fitm_completion_tokens_total Tokens generated by /answer.\n"
            "# TYPE fitm_completion_tokens_total counter\nfitm_completion_tokens_total %lld\n",
        (long long)M.completion_tokens);
    fitm_buf_printf(
        s, "# HELP fitm_time_to_first_token_seconds Time from an /answer request's arrival to "
            "its first generated token.\n# TYPE fitm_time_to_first_token_seconds histogram\n");
    render(s, "fitm_time_to_first_token_seconds", "", &M.ttft);
    fitm_buf_printf(s, "# HELP fitm_queue_wait_seconds Time a request waited in the engine's "
                        "queue before it started.\n# TYPE fitm_queue_wait_seconds histogram\n");
    render(s, "fitm_queue_wait_seconds", "", &M.wait);
}

/* The engine's gauges: queue depth and capacity, requests in flight, model readiness. */
static void render_gauges(fitm_buf *s, const fitm_metrics_gauges *g)
{
    fitm_buf_printf(s, "# HELP fitm_queue_depth Requests waiting for the engine.\n"
            "# TYPE fitm_queue_depth gauge\nfitm_queue_depth %lld\n",
        (long long)g->queue_depth);
    fitm_buf_printf(s, "# HELP fitm_queue_capacity Most requests that may wait (queue_depth).\n"
            "# TYPE fitm_queue_capacity gauge\nfitm_queue_capacity %lld\n",
        (long long)g->queue_capacity);
    fitm_buf_printf(s, "# HELP fitm_inflight_requests Requests the engine is running now.\n"
            "# TYPE fitm_inflight_requests gauge\nfitm_inflight_requests %lld\n",
        (long long)g->inflight);
    fitm_buf_printf(s,
                    "# HELP fitm_model_ready 1 once the model is loaded and the backend healthy, "
                    "while its file is unchanged (as /health's 200).\n"
                    "# TYPE fitm_model_ready gauge\nfitm_model_ready %d\n",
                    g->ready);
}

char *fitm_metrics_render(const fitm_metrics_gauges *g, size_t *len)
{
    fitm_buf s = {0};
    if (!fitm_buf_reserve(&s, 8192))
        return NULL;
    pthread_mutex_lock(&M.mu);
    render_requests(&s);
    pthread_mutex_unlock(&M.mu);
    render_batch(&s, g);
    render_gauges(&s, g);
    if (s.failed) {
        fitm_buf_free(&s);
        return NULL;
    }
    *len = s.len;
    return s.p;
}
