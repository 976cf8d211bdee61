/* metrics: fitmd's counters and histograms, rendered as Prometheus text (version 0.0.4).
 * One process-wide set guarded by one mutex: every function may be called from any thread.
 *
 * Series:
 *   fitm_requests_total{route,code}             counter
 *   fitm_request_duration_seconds{route}        histogram (arrival to response queued)
 *   fitm_queue_depth, fitm_queue_capacity, fitm_inflight_requests   gauges (from the engine)
 *   fitm_prompt_tokens_total, fitm_forward_tokens_total              counters
 *   fitm_model_ready                                                 gauge (0/1)
 *   fitm_completion_tokens_total                                     counter (/answer)
 *   fitm_time_to_first_token_seconds                                 histogram (/answer)
 *   fitm_queue_wait_seconds                                          histogram (queue to start)
 *   fitm_batch_running, fitm_batch_size, fitm_batch_kv_bytes,
 *   fitm_batch_tokens_per_second                                     gauges (from the engine)
 *   fitm_batch_steps_total, fitm_batch_step_sequences_total, fitm_batch_step_tokens_total,
 *   fitm_batch_step_seconds_total                                    counters (from the engine) */
#ifndef FITM_METRICS_H
#define FITM_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    FITM_ROUTE_RERANK = 0,
    FITM_ROUTE_HEALTH,
    FITM_ROUTE_METRICS,
    FITM_ROUTE_MODELS,
    FITM_ROUTE_OPENAPI,
    FITM_ROUTE_ANSWER,
    FITM_ROUTE_CHAT,        /* /v1/chat/completions */
    FITM_ROUTE_COMPLETIONS, /* /v1/completions      */
    FITM_ROUTE_PLAYGROUND,  /* GET /                */
    FITM_ROUTE_TOKENIZE,    /* /tokenize, /detokenize */
    FITM_ROUTE_OTHER, /* unknown paths (404s), and heads the gate refused before a route */
    FITM_ROUTE_COUNT
} fitm_route;

/* The route's label value ("rerank", "health", ...). */
const char *fitm_route_name(fitm_route r);

/* Counts one finished request. */
void fitm_metrics_request(fitm_route r, int http_code, double seconds);

/* Adds one scored request's token counts. */
void fitm_metrics_tokens(int64_t prompt_tokens, int64_t forward_tokens);

/* Adds one answered request's generated tokens and its time to first token (arrival to the
 * first token chosen; negative: none was). */
void fitm_metrics_completion(int64_t completion_tokens, double first_token_s);

/* Counts one job's wait in the engine's queue (submit to start). */
void fitm_metrics_queue_wait(double seconds);

/* Gauges sampled at render time. */
typedef struct {
    int64_t queue_depth;
    int64_t queue_capacity;
    int64_t inflight;
    int ready;
    /* the running batch (continuous batching of /answer) */
    int64_t batch_running, batch_size, batch_kv_bytes;
    int64_t batch_steps, batch_step_sequences, batch_step_tokens, batch_last_tokens;
    double batch_step_seconds, batch_last_step_seconds;
} fitm_metrics_gauges;

/* Renders everything; returns malloc'd text (NULL when out of memory), *len its length. */
char *fitm_metrics_render(const fitm_metrics_gauges *g, size_t *len);

#endif
