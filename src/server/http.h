/* http: fitmd's HTTP server (the only libmicrohttpd user): limits, auth, routing, request
 * ids, per-request logs and metrics. Route handlers turn requests into api.c calls and engine
 * jobs; a /rerank connection is suspended while its job waits and runs, so HTTP threads never
 * block on the model and /health answers at any time.
 *
 * Routes: POST /rerank, /v1/rerank, /v2/rerank, /v1/score, /score, /answer, /v1/answer,
 * /v1/chat/completions, /v1/completions, /tokenize, /detokenize; GET /health, /metrics,
 * /v1/models, /openapi.yaml, / (the playground); OPTIONS on each (CORS preflight when
 * cors_origins allows the request's Origin). Bearer keys (when configured) guard all but
 * /health, /metrics, the playground page (which holds no data; its requests carry the key
 * the user types) and OPTIONS. */
#ifndef FITM_HTTP_H
#define FITM_HTTP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "server/config.h"
#include "server/engine.h"

/* What identifies a file's content without reading it: replaced, truncated or rewritten in
 * place, one of these changes. */
typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_ns;
} fitm_file_id;

/* Fills *id from path; false when it cannot be stat'ed. */
bool fitm_file_id_of(const char *path, fitm_file_id *id);

/* Model facts for /v1/models and responses. name is fixed at start; arch and n_ctx are
 * (and rerank_method) written by the loader before the engine becomes READY and read only after. */
typedef struct {
    char name[128];
    char arch[32];
    int64_t n_ctx;
    int32_t rerank_method; /* a fitm_rerank_method: /rerank's and /v1/score's when a request
                              names none (the profile's under the config's), written like arch */
    int64_t created_s; /* file mtime */
    /* The model file as loaded (written by the loader, like arch): /health compares the file
     * on disk with it and reports the server unhealthy once it differs ("": not watched). */
    char path[1024];
    fitm_file_id file;
    /* While model_url downloads: percent done (0-100), for /health's "downloading 42%";
     * -1 otherwise. Written by the loader while /health reads it. */
    _Atomic int download_pct;
} fitm_http_model_info;

/* The listening sockets (probe_fd -1: no probe_port), from fitm_http_bind. */
typedef struct {
    int fd, probe_fd;
} fitm_http_sockets;

/* Binds cfg->host:cfg->port (and probe_port) before anything slow starts, so that an address
 * in use, or a probe_port equal to port, stops fitmd at once rather than after the model's
 * load (or download). FITM_ERR_IO naming the port that could not be had. */
fitm_status fitm_http_bind(const fitm_config *cfg, fitm_http_sockets *out, fitm_err *err);

/* Closes the sockets of fitm_http_bind (for a caller that will not start the server). */
void fitm_http_sockets_close(const fitm_http_sockets *s);

typedef struct {
    const fitm_config *cfg;          /* borrowed for the server's life            */
    fitm_http_sockets sockets;       /* from fitm_http_bind; taken over by start  */
    fitm_engine *engine;             /* borrowed                                  */
    const fitm_http_model_info *model; /* borrowed                                */
    const char *openapi;             /* the spec served at /openapi.yaml          */
    size_t openapi_len;
    const char *playground;          /* the HTML page served at /                 */
    size_t playground_len;
} fitm_http_params;

typedef struct fitm_http fitm_http;

/* Serves on p->sockets (closed on failure) with the thread pool (cfg->http_threads). */
fitm_status fitm_http_start(fitm_http **out, const fitm_http_params *p, fitm_err *err);

/* Starts draining: the server keeps listening (Kubernetes probes /health until the endpoint
 * is gone); /health answers 503 "draining", new inference requests 503 with Retry-After, every
 * answer closes its connection. In-flight requests carry on. */
void fitm_http_quiesce(fitm_http *h);

/* Waits up to timeout_ms until no request is open. True when none is. */
bool fitm_http_wait_idle(fitm_http *h, int64_t timeout_ms);

/* Closes everything and frees h. Call only when no job of h's is in the engine (after
 * fitm_engine_shutdown). NULL is a no-op. */
void fitm_http_stop(fitm_http *h);

#endif
