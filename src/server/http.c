#include "server/http.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/rng.h"
#include "server/api.h"
#include "server/gate.h"
#include "server/metrics.h"
#include "server/work.h"

#define MAX_KEYS FITM_CONFIG_MAX_API_KEYS
/* The code logged and counted for a request whose client left before its answer (the code
 * nginx uses for it); never sent. */
#define FITM_HTTP_CLIENT_LEFT 499
/* Request bodies held while they arrive, all connections together: at least this many bytes
 * (else 4 x max_body_bytes); past it a body is refused with 503 and Retry-After, so that many
 * connections each sending a large body slowly cannot take the process's memory. */
#define FITM_HTTP_BODY_BUDGET (64 << 20)

struct fitm_http {
    fitm_http_params p;
    struct MHD_Daemon *d;
    struct MHD_Daemon *probe_d; /* probe_port's listener (health and metrics only); NULL: none */
    fitm_gate *gate;            /* the main port's accept loop and relay, in front of d      */
    fitm_gate *probe_gate;      /* probe_port's, in front of probe_d (gate.h)               */
    fitm_api_limits limits;
    char keys[MAX_KEYS][FITM_CONFIG_STR_BYTES];
    int n_keys;
    atomic_bool draining;
    atomic_int_fast64_t body_bytes; /* request bodies held (request.body_held), in all */
    int64_t body_budget;            /* at most this many: FITM_HTTP_BODY_BUDGET           */
    atomic_uint_fast64_t next_id;
    uint64_t id_salt;
    pthread_mutex_t mu;
    pthread_cond_t idle;
    int64_t open_requests;
};

typedef enum { ST_BODY = 0, ST_DISCARD, ST_WAIT, ST_ANSWERED } req_state;

typedef struct route_def route_def;

/* One request's state (MHD's con_cls), created on its first callback. */
typedef struct {
    fitm_http *h;
    struct MHD_Connection *conn;
    char id[40];
    int64_t t0_ns;
    fitm_route route;
    const route_def *rd; /* NULL: no such route */
    bool probe;          /* arrived on probe_port: only /health and /metrics exist there */
    fitm_gate *gate;     /* the gate it came through (its listener's own, read once)   */
    char method[8];
    char path[128];
    req_state state;
    fitm_buf body;    /* the POST body so far, at most max_body_bytes */
    size_t body_held; /* of it, counted in h->body_bytes (body_free gives them back) */
    size_t discarded; /* ST_DISCARD: bytes received in all */
    bool body_refused; /* ST_DISCARD because the bodies held in all reached h->body_budget */
    int code; /* HTTP status sent; 0 while none */
    bool checks_later; /* a request without a body: first_call runs on its second callback */
    bool must_close; /* the answer ends the connection (a 408 while the body arrives: what
                      * follows cannot be trusted to be the next request) */
    fitm_job job;
    fitm_rerank_request req;
    fitm_answer_request areq; /* /answer's request */
    fitm_rerank_work rwork;   /* job.work of a /rerank job */
    fitm_answer_work awork;   /* job.work of an /answer job */
    bool score;               /* /v1/score: the rerank answered in vLLM's shape */
    fitm_api_tokens tokens;   /* /tokenize and /detokenize's request and result */
    fitm_tokens_work twork;   /* job.work of their job */
    atomic_bool done; /* the engine finished job */
    /* A streamed /answer: the SSE bytes not yet sent, shared by the engine's thread (which
     * appends) and MHD's (which sends); the request is freed by whichever of on_completed and
     * the job's on_done comes last (refs). Its head (200, text/event-stream) goes out with the
     * first event (s_headless until then), so that a job that fails before it (a prompt over
     * the context, a deadline while queued) is answered with its HTTP error (s_error). */
    bool streaming;
    pthread_mutex_t smu;
    fitm_buf sbuf; /* events not yet sent start at soff */
    size_t soff;
    bool s_done, s_suspended, s_closed, s_headless, s_error;
    atomic_bool s_cancel;
    atomic_int refs;
    atomic_bool client_left; /* the job was stopped because the client went away */
    /* An OpenAI route's request (/v1/chat/completions, /v1/completions): its answer is
     * written in OpenAI's shapes. */
    bool oai;
    fitm_api_openai_head oai_head; /* its strings point into r (oai_id) and the model info */
    char oai_id[56];
    bool oai_usage;     /* stream_options.include_usage */
    bool oai_role_sent; /* the first chat chunk (with the role) went out */
} request;

/* Frees r's body, giving its bytes back to the budget of bodies held. */
static void body_free(request *r)
{
    fitm_buf_free(&r->body);
    if (r->body_held)
        atomic_fetch_sub(&r->h->body_bytes, (int_fast64_t)r->body_held);
    r->body_held = 0;
}

/* ---- responses ---------------------------------------------------------------------- */

/* The value of Access-Control-Allow-Origin for r: "*" when cors_origins is "*", the request's
 * Origin when cors_origins lists it, NULL (no CORS headers) otherwise. */
static const char *cors_origin(const request *r)
{
    const char *list = r->h->p.cfg->cors_origins;
    const char *origin = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Origin");
    if (!list[0] || !origin)
        return NULL;
    if (!strcmp(list, "*"))
        return "*";
    size_t n = strlen(origin);
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *s = p;
        while (*p && *p != ',')
            p++;
        size_t m = (size_t)(p - s);
        while (m && s[m - 1] == ' ')
            m--;
        if (m && m == n && !memcmp(s, origin, n))
            return origin;
    }
    return NULL;
}

/* The CORS headers of an answer to an allowed origin: which origin may read it, and the
 * response headers a browser script may see. */
static void add_cors(const request *r, struct MHD_Response *resp)
{
    const char *o = cors_origin(r);
    if (!o)
        return;
    MHD_add_response_header(resp, "Access-Control-Allow-Origin", o);
    if (strcmp(o, "*") != 0)
        MHD_add_response_header(resp, "Vary", "Origin");
    MHD_add_response_header(resp, "Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
}

/* gate.h's security headers; an HTML page gets its own Content-Security-Policy. */
static void add_security_headers(struct MHD_Response *resp, bool page)
{
    MHD_add_response_header(resp, "X-Content-Type-Options", FITM_GATE_NOSNIFF);
    MHD_add_response_header(resp, "X-Frame-Options", FITM_GATE_FRAMES);
    MHD_add_response_header(resp, "Content-Security-Policy",
                            page ? FITM_GATE_CSP_PAGE : FITM_GATE_CSP_DATA);
}

/* Queues body (malloc'd; taken over, also on failure) with the common headers. */
static enum MHD_Result send_body(request *r, int code, char *body, size_t len,
                                 const char *content_type, const char *allow, bool retry)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        len, body ? body : (char *)"", body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    MHD_add_response_header(resp, "X-Request-Id", r->id);
    add_cors(r, resp);
    add_security_headers(resp, !strncmp(content_type, "text/html", 9));
    if (allow)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    if (retry)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    if (code == 401) /* RFC 6750: say which scheme to authenticate with */
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (r->must_close || atomic_load(&r->h->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(r->conn, (unsigned)code, resp);
    MHD_destroy_response(resp);
    r->code = code;
    r->state = ST_ANSWERED;
    return ok;
}

/* Every error response goes through here (and so through fitm_api_classify). */
static enum MHD_Result send_error(request *r, fitm_status s, fitm_api_cond cond,
                                  const char *allow, const char *msg)
{
    fitm_api_error_class c = fitm_api_classify(s, cond);
    /* OpenAI's answer to a prompt over the context, which its clients recognise (LangChain's
     * ContextOverflowError) */
    if (r->oai && s == FITM_ERR_CONTEXT)
        c = (fitm_api_error_class){400, "invalid_request_error", "context_length_exceeded", false};
    char *json = fitm_api_error_json(&c, msg);
    /* Why a request was refused is what an operator looks for: info, not debug. */
    FITM_LOG(c.http >= 500 ? FITM_LOG_WARN : FITM_LOG_INFO, r->id, "error %d %s: %s", c.http,
             c.code, msg ? msg : "");
    if (!json)
        return MHD_NO;
    return send_body(r, c.http, json, strlen(json), "application/json", allow, c.retry);
}

/* A JSON answer; a 503 (/health's loading, draining, broken) carries Retry-After, as every 503
 * does. */
static enum MHD_Result send_json(request *r, int code, char *json)
{
    if (!json) /* the JSON writers fail only when out of memory */
        return send_error(r, FITM_ERR_NOMEM, FITM_API_COND_NONE, NULL, "out of memory");
    return send_body(r, code, json, strlen(json), "application/json", NULL, code == 503);
}

/* ---- routing and checks --------------------------------------------------------------- */

/* Compares without an early exit, so timing does not reveal how much of a key matched. */
static bool same_secret(const char *a, size_t an, const char *b, size_t bn)
{
    unsigned char diff = an != bn;
    size_t n = an < bn ? an : bn;
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(a[i] ^ b[i]);
    return diff == 0;
}

static bool authorized(fitm_http *h, struct MHD_Connection *conn)
{
    if (h->n_keys == 0)
        return true;
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!v || strncasecmp(v, "Bearer ", 7) != 0)
        return false;
    v += 7;
    while (*v == ' ')
        v++;
    size_t n = strlen(v);
    while (n && v[n - 1] == ' ')
        n--;
    bool ok = false;
    for (int i = 0; i < h->n_keys; i++)
        ok |= same_secret(v, n, h->keys[i], strlen(h->keys[i]));
    return ok;
}

/* application/json or any +json type, parameters (charset) ignored; absent is accepted. */
static bool json_content_type(const char *ct)
{
    if (!ct)
        return true;
    while (*ct == ' ')
        ct++;
    size_t n = strcspn(ct, ";");
    while (n && ct[n - 1] == ' ')
        n--;
    if (n == 16 && !strncasecmp(ct, "application/json", 16))
        return true;
    return n > 5 && !strncasecmp(ct + n - 5, "+json", 5) && !strncasecmp(ct, "application/", 12);
}

/* A fresh request id: distinct counters give distinct, unguessable-looking ids (the server's
 * requests' and, through the gate's new_id, its refusals'). */
static void fresh_id(void *user, char *out, size_t cap)
{
    fitm_http *h = user;
    const uint64_t x = fitm_rng_mix(atomic_fetch_add(&h->next_id, 1) + h->id_salt);
    snprintf(out, cap, "%016llx", (unsigned long long)x);
}

/* A client's X-Request-Id is kept when short and plain; otherwise we make one. */
static void make_id(fitm_http *h, struct MHD_Connection *conn, char *out, size_t cap)
{
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    if (v) {
        size_t n = strlen(v);
        bool ok = n > 0 && n < cap && n <= 36;
        for (size_t i = 0; ok && i < n; i++)
            ok = (v[i] >= '0' && v[i] <= '9') || (v[i] >= 'a' && v[i] <= 'z') ||
                 (v[i] >= 'A' && v[i] <= 'Z') || v[i] == '-' || v[i] == '_' || v[i] == '.';
        if (ok) {
            memcpy(out, v, n + 1);
            return;
        }
    }
    fresh_id(h, out, cap);
}

/* ---- route handlers --------------------------------------------------------------------- */

bool fitm_file_id_of(const char *path, fitm_file_id *id)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return false;
    *id = (fitm_file_id){(uint64_t)sb.st_dev, (uint64_t)sb.st_ino, (uint64_t)sb.st_size,
                         (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec};
    return true;
}

/* True while the model file on disk is the one loaded (the weights are mapped from it: a
 * truncated file faults, a rewritten one silently changes answers). */
static bool model_file_unchanged(const fitm_http_model_info *m)
{
    fitm_file_id now;
    if (!m->path[0]) /* not mapped (model_load copy): nothing to watch */
        return true;
    return fitm_file_id_of(m->path, &now) && !memcmp(&now, &m->file, sizeof now);
}

static enum MHD_Result handle_health(request *r)
{
    fitm_err msg = {{0}};
    fitm_engine_state s = fitm_engine_get_state(r->h->p.engine, &msg);
    if (atomic_load(&r->h->draining))
        return send_json(r, 503,
                           fitm_api_write_health("draining", "the server is shutting down"));
    switch (s) {
    case FITM_ENGINE_READY:
        if (!model_file_unchanged(r->h->p.model))
            return send_json(r, 503, fitm_api_write_health(
                                         "error", "the model file changed on disk since it was "
                                                  "loaded (size, mtime or inode): restart fitmd"));
        return send_json(r, 200, fitm_api_write_health("ok", NULL));
    case FITM_ENGINE_LOADING: {
        int pct = atomic_load(&r->h->p.model->download_pct);
        char what[32];
        if (pct >= 0)
            snprintf(what, sizeof what, "downloading %d%%", pct);
        return send_json(r, 503, fitm_api_write_health("loading", pct >= 0
                                                                      ? what
                                                                      : "the model is loading"));
    }
    case FITM_ENGINE_FAILED:
    case FITM_ENGINE_BROKEN:
        break;
    }
    return send_json(r, 503, fitm_api_write_health("error", msg.msg));
}

static enum MHD_Result handle_metrics(request *r)
{
    fitm_metrics_gauges g = {0};
    fitm_engine_stats(r->h->p.engine, &g.queue_depth, &g.queue_capacity, &g.inflight);
    /* ready as /health's 200 is: loaded, healthy, and its file not changed under it */
    g.ready = fitm_engine_get_state(r->h->p.engine, NULL) == FITM_ENGINE_READY &&
              model_file_unchanged(r->h->p.model);
    fitm_engine_batch_stats bs;
    fitm_engine_batch_stats_get(r->h->p.engine, &bs);
    g.batch_running = bs.running;
    g.batch_size = bs.last_batch;
    g.batch_kv_bytes = bs.kv_bytes;
    g.batch_steps = bs.steps;
    g.batch_step_sequences = bs.step_jobs;
    g.batch_step_tokens = bs.step_tokens;
    g.batch_last_tokens = bs.last_tokens;
    g.batch_step_seconds = bs.step_ms_total / 1e3;
    g.batch_last_step_seconds = bs.last_step_ms / 1e3;
    size_t len = 0;
    char *text = fitm_metrics_render(&g, &len);
    if (!text)
        return send_error(r, FITM_ERR_NOMEM, FITM_API_COND_NONE, NULL, "out of memory");
    return send_body(r, 200, text, len, "text/plain; version=0.0.4; charset=utf-8", NULL, false);
}

/* The served model: the list (GET /v1/models) or its object alone (one). */
static enum MHD_Result send_models(request *r, bool one)
{
    const fitm_http_model_info *m = r->h->p.model;
    bool ready = fitm_engine_get_state(r->h->p.engine, NULL) == FITM_ENGINE_READY;
    return send_json(r, 200, fitm_api_write_models(m->name, m->created_s, ready ? m->n_ctx : 0,
                                                   ready ? m->arch : "", one));
}

static enum MHD_Result handle_models(request *r)
{
    return send_models(r, false);
}

#define MODEL_PREFIX "/v1/models/"

static const char *target_path(const char *url);

/* GET /v1/models/{id} (OpenAI's models.retrieve): the served model's object when id is its
 * name, else 404. */
static enum MHD_Result handle_model(request *r)
{
    const fitm_http_model_info *m = r->h->p.model;
    const char *id = target_path(r->path) + strlen(MODEL_PREFIX);
    if (strcmp(id, m->name) != 0) {
        char msg[FITM_CONFIG_STR_BYTES + 160];
        snprintf(msg, sizeof msg, "no model '%.100s' (this server serves '%s')", id, m->name);
        return send_error(r, FITM_ERR_NOT_FOUND, FITM_API_COND_NONE, NULL, msg);
    }
    return send_models(r, true);
}

static enum MHD_Result handle_openapi(request *r)
{
    char *copy = malloc(r->h->p.openapi_len + 1);
    if (!copy)
        return send_error(r, FITM_ERR_NOMEM, FITM_API_COND_NONE, NULL, "out of memory");
    memcpy(copy, r->h->p.openapi, r->h->p.openapi_len);
    return send_body(r, 200, copy, r->h->p.openapi_len, "application/yaml", NULL, false);
}

/* The playground page: public, like /health, because it holds no data; the calls it makes are
 * the API's own and carry the key the user types. Its own CSP keeps it to this origin. */
static enum MHD_Result handle_playground(request *r)
{
    char *copy = malloc(r->h->p.playground_len + 1);
    if (!copy)
        return send_error(r, FITM_ERR_NOMEM, FITM_API_COND_NONE, NULL, "out of memory");
    memcpy(copy, r->h->p.playground, r->h->p.playground_len);
    return send_body(r, 200, copy, r->h->p.playground_len, "text/html; charset=utf-8", NULL,
                     false);
}

static void job_done(fitm_job *job, void *user)
{
    request *r = user;
    (void)job;
    atomic_store(&r->done, true);
    MHD_resume_connection(r->conn); /* the handler runs again and answers */
}

/* The body is complete: parse it and hand the job to the engine (suspending the connection),
 * or answer at once with the error. */
/* fitm_job.client_gone: the peer closed (or reset) the connection of a waiting request. A
 * non-streamed request's connection is suspended for the whole job, and a stream's until its
 * head goes out, so its socket stays open and is peeked here without consuming pipelined
 * bytes; a stream with its head out learns of the close from on_completed. A client that
 * half-closes its sending side counts as gone. */
static bool client_gone(void *user)
{
    request *r = user;
    if (r->streaming) {
        pthread_mutex_lock(&r->smu);
        const bool headless = r->s_headless;
        pthread_mutex_unlock(&r->smu);
        if (!headless || atomic_load(&r->s_cancel))
            return atomic_load(&r->s_cancel);
    }
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return false;
    char c;
    ssize_t n = recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    bool gone = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    if (gone)
        atomic_store(&r->client_left, true);
    return gone;
}

/* Ties r->job to the request: its deadline (counted from arrival), its owner, its log id. */
static void job_bind(request *r)
{
    r->job.deadline_ns = r->t0_ns + r->h->p.cfg->request_timeout_ms * 1000000;
    r->job.user = r;
    r->job.client_gone = client_gone;
    snprintf(r->job.req_id, sizeof r->job.req_id, "%s", r->id);
}

/* Submits r->job (prepared by the caller) to the engine and parks the connection until the
 * job's on_done resumes it; the finish_* function of the route then answers. */
static enum MHD_Result submit_suspended(request *r)
{
    r->job.on_done = job_done;
    r->state = ST_WAIT;
    /* The job has its own deadline; the idle timeout must not cut a connection whose answer
     * is being computed (restored by the route's finish_* function). */
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    /* Suspend before submitting, so a job that finishes at once resumes a suspended
     * connection; a refused job resumes it right away. */
    MHD_suspend_connection(r->conn);
    fitm_status st = fitm_engine_submit(r->h->p.engine, &r->job, &r->job.err);
    if (st != FITM_OK) {
        r->job.status = st;
        atomic_store(&r->done, true);
        MHD_resume_connection(r->conn);
    }
    return MHD_YES;
}

static enum MHD_Result start_rerank(request *r)
{
    fitm_err err = {{0}};
    fitm_api_limits lim = r->h->limits;
    lim.default_method = r->h->p.model->rerank_method;
    fitm_status st = fitm_api_parse_rerank(r->body.p ? r->body.p : "", r->body.len, &lim, &r->req,
                                           &err);
    body_free(r);
    if (st != FITM_OK)
        return send_error(r, st, FITM_API_COND_NONE, NULL, err.msg);
    r->rwork.req = &r->req;
    r->job.kind = FITM_WORK_RERANK;
    r->job.work = &r->rwork;
    job_bind(r);
    return submit_suspended(r);
}

static enum MHD_Result finish_rerank(request *r)
{
    fitm_job *j = &r->job;
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)r->h->p.cfg->http_idle_timeout_s);
    if (j->status != FITM_OK) {
        FITM_LOG(FITM_LOG_INFO, r->id, "rerank failed (%s): %s", fitm_status_name(j->status),
                 j->err.msg);
        enum MHD_Result ok = send_error(r, j->status, FITM_API_COND_NONE, NULL, j->err.msg);
        fitm_rerank_result_free(&r->rwork.result);
        return ok;
    }
    fitm_metrics_tokens(r->rwork.result.usage.prompt_tokens, r->rwork.result.usage.forward_tokens);
    r->rwork.result.meta.queue_ms = j->queue_ms;
    r->rwork.result.meta.total_ms = (double)(fitm_clock_ns() - r->t0_ns) / 1e6;
    char *json = r->score ? fitm_api_write_score(&r->rwork.result, r->id, r->h->p.model->name,
                                                 (int64_t)time(NULL))
                          : fitm_api_write_rerank(&r->req, &r->rwork.result, r->id,
                                                  r->h->p.model->name);
    FITM_LOG(FITM_LOG_DEBUG, r->id, "rerank: K %d T %lld forward %lld", (int)r->req.n_docs,
             (long long)r->rwork.result.usage.prompt_tokens,
             (long long)r->rwork.result.usage.forward_tokens);
    fitm_rerank_result_free(&r->rwork.result);
    return send_json(r, 200, json);
}

/* POST /v1/score (vLLM's): text_1 against each text_2, a /rerank answered in vLLM's shape. */
static enum MHD_Result start_score(request *r)
{
    fitm_err err = {{0}};
    fitm_api_limits lim = r->h->limits;
    lim.default_method = r->h->p.model->rerank_method;
    fitm_status st = fitm_api_parse_score(r->body.p ? r->body.p : "", r->body.len, &lim, &r->req,
                                          &err);
    body_free(r);
    if (st != FITM_OK)
        return send_error(r, st, FITM_API_COND_NONE, NULL, err.msg);
    r->score = true;
    r->rwork.req = &r->req;
    r->job.kind = FITM_WORK_RERANK;
    r->job.work = &r->rwork;
    job_bind(r);
    return submit_suspended(r);
}

/* ---- POST /tokenize, /detokenize --------------------------------------------------------- */

/* The job runs at once on this thread (fitm_engine_run_now: the loaded model's tokenizer,
 * read-only), not on the worker between two steps, which it would hold for seconds on a body
 * of megabytes; the answer follows at once (answer_tokens is also the routes' finish, which
 * marks them as job routes: refused while draining, 413 for a body discarded as too large). */
static enum MHD_Result answer_tokens(request *r)
{
    fitm_job *j = &r->job;
    if (j->status != FITM_OK)
        return send_error(r, j->status, FITM_API_COND_NONE, NULL, j->err.msg);
    return send_json(r, 200, fitm_api_write_tokens(&r->tokens, r->twork.n_ctx));
}

static enum MHD_Result start_tokens(request *r, bool detokenize)
{
    fitm_err err = {{0}};
    fitm_status st = fitm_api_parse_tokens(r->body.p ? r->body.p : "", r->body.len,
                                           &r->h->limits, detokenize, &r->tokens, &err);
    body_free(r);
    if (st != FITM_OK)
        return send_error(r, st, FITM_API_COND_NONE, NULL, err.msg);
    r->twork.t = &r->tokens;
    r->job.kind = FITM_WORK_TOKENS;
    r->job.work = &r->twork;
    job_bind(r);
    r->job.status = fitm_engine_run_now(r->h->p.engine, &r->job, &r->job.err);
    return answer_tokens(r);
}

static enum MHD_Result start_tokenize(request *r)
{
    return start_tokens(r, false);
}

static enum MHD_Result start_detokenize(request *r)
{
    return start_tokens(r, true);
}

/* ---- POST /answer ------------------------------------------------------------------------ */

static void request_free(request *r)
{
    body_free(r);
    fitm_rerank_request_free(&r->req);
    fitm_answer_request_free(&r->areq);
    fitm_api_tokens_free(&r->tokens);
    if (r->streaming)
        pthread_mutex_destroy(&r->smu);
    fitm_buf_free(&r->sbuf);
    free(r);
}

/* Resumes a stream's connection parked for its head or its next event (smu held). */
static void sse_wake(request *r)
{
    if (r->s_suspended && !r->s_closed) {
        r->s_suspended = false;
        MHD_resume_connection(r->conn);
    }
}

/* Appends one SSE event ("data: json\n\n"; json NULL: nothing) and wakes the connection.
 * Returns false when out of memory. Called with smu not held. */
static bool sse_push(request *r, const char *json, bool last)
{
    bool ok = true;
    pthread_mutex_lock(&r->smu);
    if (json)
        ok = fitm_buf_printf(&r->sbuf, "data: %s\n\n", json);
    if (last)
        r->s_done = true;
    sse_wake(r);
    pthread_mutex_unlock(&r->smu);
    return ok;
}

/* fitm_answer_on_delta for a stream: one event per piece of text. */
static bool sse_delta(void *arg, const char *text, size_t len)
{
    request *r = arg;
    if (atomic_load(&r->s_cancel))
        return false;
    if (len == 0)
        return true;
    char *json;
    if (r->oai) {
        json = fitm_api_write_openai_chunk(&r->oai_head, text, len, !r->oai_role_sent, NULL,
                                           false);
        r->oai_role_sent = true;
    } else {
        json = fitm_api_write_answer_delta(text, len);
    }
    bool ok = json && sse_push(r, json, false);
    free(json);
    return ok;
}

static void release(request *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1)
        request_free(r);
}

/* A stream's job finished: the final event (or the error), then [DONE]. */
static void sse_job_done(fitm_job *job, void *user)
{
    request *r = user;
    char *json;
    pthread_mutex_lock(&r->smu);
    const bool early = r->s_headless && r->sbuf.len == 0 && job->status != FITM_OK;
    if (early) { /* nothing sent yet: the handler answers with the HTTP error (stream_head) */
        r->s_error = r->s_done = true;
        sse_wake(r);
    }
    pthread_mutex_unlock(&r->smu);
    if (early) {
        FITM_LOG(FITM_LOG_INFO, r->id, "answer stream failed before its first event (%s): %s",
                 fitm_status_name(job->status), job->err.msg);
        fitm_answer_result_free(&r->awork.result);
        release(r);
        return;
    }
    if (job->status == FITM_OK) {
        double total_ms = (double)(fitm_clock_ns() - r->t0_ns) / 1e6;
        fitm_metrics_tokens(r->awork.result.prompt_tokens, r->awork.result.forward_tokens);
        fitm_metrics_completion(r->awork.result.completion_tokens,
                                r->awork.result.completion_tokens
                                    ? (job->queue_ms + r->awork.result.first_token_ms) / 1e3
                                    : -1);
        if (r->oai) {
            json = fitm_api_write_openai_chunk(&r->oai_head, NULL, 0, !r->oai_role_sent,
                                               &r->awork.result, false);
            if (r->oai_usage) {
                sse_push(r, json, false);
                free(json);
                json = fitm_api_write_openai_chunk(&r->oai_head, NULL, 0, false,
                                                   &r->awork.result, true);
            }
        } else {
            json = fitm_api_write_answer(&r->areq, &r->awork.result, r->id,
                                         r->h->p.model->name, job->queue_ms, total_ms, false);
        }
    } else {
        FITM_LOG(FITM_LOG_INFO, r->id, "answer stream ended (%s) after %lld tokens: %s",
                 fitm_status_name(job->status),
                 (long long)r->awork.result.completion_tokens, job->err.msg);
        fitm_api_error_class c = fitm_api_classify(job->status, FITM_API_COND_NONE);
        json = fitm_api_error_json(&c, job->err.msg);
    }
    fitm_answer_result_free(&r->awork.result);
    sse_push(r, json, false);
    free(json);
    sse_push(r, "[DONE]", true);
    release(r);
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    request *r = cls;
    (void)pos;
    ssize_t n = 0;
    pthread_mutex_lock(&r->smu);
    if (r->soff < r->sbuf.len) {
        size_t k = r->sbuf.len - r->soff < max ? r->sbuf.len - r->soff : max;
        memcpy(buf, r->sbuf.p + r->soff, k);
        r->soff += k;
        if (r->soff == r->sbuf.len) {
            r->soff = 0;
            fitm_buf_clear(&r->sbuf);
        }
        n = (ssize_t)k;
    } else if (r->s_done) {
        n = MHD_CONTENT_READER_END_OF_STREAM;
        /* The stream had no idle timeout while it waited for tokens; a kept-alive connection
         * after it has the usual one. */
        MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                                  (unsigned)r->h->p.cfg->http_idle_timeout_s);
    } else {
        /* Nothing yet: park the connection until sse_push wakes it. */
        r->s_suspended = true;
        MHD_suspend_connection(r->conn);
    }
    pthread_mutex_unlock(&r->smu);
    return n;
}

/* The stream's head, once its first event (or its failure) is there: the 200 with the events
 * so far, or the job's HTTP error when it failed before any (the client never sees a 200 for
 * a request refused by the engine). Called when the connection is resumed. */
static enum MHD_Result stream_head(request *r)
{
    pthread_mutex_lock(&r->smu);
    if (!r->s_error && !r->s_done && r->sbuf.len == 0) { /* woken with nothing: wait again */
        r->s_suspended = true;
        MHD_suspend_connection(r->conn);
        pthread_mutex_unlock(&r->smu);
        return MHD_YES;
    }
    r->s_headless = false;
    const bool failed = r->s_error;
    pthread_mutex_unlock(&r->smu);
    if (failed) {
        MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                                  (unsigned)r->h->p.cfg->http_idle_timeout_s);
        return send_error(r, r->job.status, FITM_API_COND_NONE, NULL, r->job.err.msg);
    }
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, sse_read, r, NULL);
    if (!resp) {
        atomic_store(&r->s_cancel, true);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Request-Id", r->id);
    add_cors(r, resp);
    add_security_headers(resp, false);
    enum MHD_Result ok = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    r->code = 200;
    r->state = ST_ANSWERED;
    return ok;
}

static enum MHD_Result start_stream(request *r)
{
    pthread_mutex_init(&r->smu, NULL);
    r->streaming = true;
    atomic_init(&r->s_cancel, false);
    atomic_init(&r->refs, 2); /* on_completed's and the job's */
    r->awork.on_delta = sse_delta;
    r->awork.delta_arg = r;
    r->job.on_done = sse_job_done;
    r->state = ST_WAIT;
    r->s_headless = true;
    /* no idle timeout while the job runs (its deadline applies); the events wake the
     * connection (sse_push), the head goes out with the first (stream_head) */
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    pthread_mutex_lock(&r->smu);
    r->s_suspended = true;
    MHD_suspend_connection(r->conn); /* before submitting: the job may push at once */
    pthread_mutex_unlock(&r->smu);
    fitm_status st = fitm_engine_submit(r->h->p.engine, &r->job, &r->job.err);
    if (st != FITM_OK) { /* refused: no on_done will come; answered as a failure */
        atomic_store(&r->refs, 1);
        r->job.status = st;
        pthread_mutex_lock(&r->smu);
        r->s_error = r->s_done = true;
        sse_wake(r);
        pthread_mutex_unlock(&r->smu);
    }
    return MHD_YES;
}

static enum MHD_Result submit_answer(request *r);

static enum MHD_Result start_answer(request *r)
{
    fitm_err err = {{0}};
    fitm_status st = fitm_api_parse_answer(r->body.p ? r->body.p : "", r->body.len, &r->h->limits,
                                           &r->areq, &err);
    body_free(r);
    if (st != FITM_OK)
        return send_error(r, st, FITM_API_COND_NONE, NULL, err.msg);
    return submit_answer(r);
}

/* POST /v1/chat/completions and /v1/completions: the same job as /answer's (plain generation
 * without documents), answered in OpenAI's shapes. */
static enum MHD_Result start_openai(request *r, bool chat)
{
    fitm_err err = {{0}};
    fitm_status st = fitm_api_parse_openai(r->body.p ? r->body.p : "", r->body.len,
                                           &r->h->limits, chat, &r->areq, &r->oai_usage, &err);
    body_free(r);
    if (st != FITM_OK)
        return send_error(r, st, FITM_API_COND_NONE, NULL, err.msg);
    r->oai = true;
    snprintf(r->oai_id, sizeof r->oai_id, "%s-%s", chat ? "chatcmpl" : "cmpl", r->id);
    r->oai_head = (fitm_api_openai_head){.id = r->oai_id, .model = r->h->p.model->name,
                                         .created = (int64_t)time(NULL), .chat = chat};
    return submit_answer(r);
}

static enum MHD_Result start_chat(request *r)
{
    return start_openai(r, true);
}

static enum MHD_Result start_completion(request *r)
{
    return start_openai(r, false);
}

/* Submits the parsed r->areq (streamed or not). */
static enum MHD_Result submit_answer(request *r)
{
    if (!r->areq.has_seed) /* reported in meta.seed, so any answer can be reproduced */
        r->areq.seed =
            ((uint64_t)fitm_clock_ns() ^ r->h->id_salt) & ((UINT64_C(1) << 53) - 1);
    r->awork.req = &r->areq;
    r->job.kind = FITM_WORK_ANSWER;
    r->job.work = &r->awork;
    job_bind(r);
    if (r->areq.stream)
        return start_stream(r);
    return submit_suspended(r);
}

static enum MHD_Result finish_answer(request *r)
{
    fitm_job *j = &r->job;
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)r->h->p.cfg->http_idle_timeout_s);
    if (j->status != FITM_OK) {
        FITM_LOG(FITM_LOG_INFO, r->id, "answer failed (%s): %s", fitm_status_name(j->status),
                 j->err.msg);
        enum MHD_Result ok = send_error(r, j->status, FITM_API_COND_NONE, NULL, j->err.msg);
        fitm_answer_result_free(&r->awork.result);
        return ok;
    }
    const fitm_answer_result *res = &r->awork.result;
    fitm_metrics_tokens(res->prompt_tokens, res->forward_tokens);
    fitm_metrics_completion(res->completion_tokens,
                            res->completion_tokens ? (j->queue_ms + res->first_token_ms) / 1e3
                                                   : -1);
    double total_ms = (double)(fitm_clock_ns() - r->t0_ns) / 1e6;
    char *json = r->oai ? fitm_api_write_openai(&r->oai_head, res)
                        : fitm_api_write_answer(&r->areq, res, r->id, r->h->p.model->name,
                                                j->queue_ms, total_ms, true);
    FITM_LOG(FITM_LOG_DEBUG, r->id, "answer: K %d T %lld generated %lld",
             (int)r->areq.base.n_docs, (long long)res->prompt_tokens,
             (long long)res->completion_tokens);
    fitm_answer_result_free(&r->awork.result);
    return send_json(r, 200, json);
}

/* ---- the route table ------------------------------------------------------------------ */

/* A route: its path, its methods, whether it needs the API key, and how it answers. A GET
 * route answers with start once the request is complete; a POST route (finish set) parses its
 * body and submits a job in start, and answers in finish once the engine is done. */
struct route_def {
    const char *path;
    fitm_route route;
    const char *allow; /* methods */
    bool auth;
    enum MHD_Result (*start)(request *r);
    enum MHD_Result (*finish)(request *r); /* NULL: a GET route */
};

static const route_def routes[] = {
    {"/rerank", FITM_ROUTE_RERANK, "POST", true, start_rerank, finish_rerank},
    {"/v1/rerank", FITM_ROUTE_RERANK, "POST", true, start_rerank, finish_rerank},
    {"/v2/rerank", FITM_ROUTE_RERANK, "POST", true, start_rerank, finish_rerank},
    {"/v1/score", FITM_ROUTE_RERANK, "POST", true, start_score, finish_rerank},
    {"/score", FITM_ROUTE_RERANK, "POST", true, start_score, finish_rerank},
    {"/answer", FITM_ROUTE_ANSWER, "POST", true, start_answer, finish_answer},
    {"/v1/answer", FITM_ROUTE_ANSWER, "POST", true, start_answer, finish_answer},
    {"/v1/chat/completions", FITM_ROUTE_CHAT, "POST", true, start_chat, finish_answer},
    {"/v1/completions", FITM_ROUTE_COMPLETIONS, "POST", true, start_completion, finish_answer},
    {"/tokenize", FITM_ROUTE_TOKENIZE, "POST", true, start_tokenize, answer_tokens},
    {"/detokenize", FITM_ROUTE_TOKENIZE, "POST", true, start_detokenize, answer_tokens},
    {"/health", FITM_ROUTE_HEALTH, "GET, HEAD", false, handle_health, NULL},
    {"/metrics", FITM_ROUTE_METRICS, "GET, HEAD", false, handle_metrics, NULL},
    {"/v1/models", FITM_ROUTE_MODELS, "GET, HEAD", true, handle_models, NULL},
    {"/openapi.yaml", FITM_ROUTE_OPENAPI, "GET, HEAD", true, handle_openapi, NULL},
    {"/", FITM_ROUTE_PLAYGROUND, "GET, HEAD", false, handle_playground, NULL},
};

/* The path of a request target: an absolute-form target (`http://host/rerank`, which RFC 9112
 * 3.2.2 has servers accept) without its scheme and authority, "/" when it has no path. */
static const char *target_path(const char *url)
{
    const char *p = !strncasecmp(url, "http://", 7) ? url + 7
                    : !strncasecmp(url, "https://", 8) ? url + 8
                                                        : NULL;
    if (!p)
        return url;
    p += strcspn(p, "/");
    return *p ? p : "/";
}

/* Every /v1/models/{id}: one route, the id read by handle_model. */
static const route_def model_route = {MODEL_PREFIX, FITM_ROUTE_MODELS, "GET, HEAD", true,
                                      handle_model, NULL};

static const route_def *find_route(const char *path)
{
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(path, routes[i].path))
            return &routes[i];
    if (!strncmp(path, MODEL_PREFIX, strlen(MODEL_PREFIX)) && path[strlen(MODEL_PREFIX)])
        return &model_route;
    return NULL;
}

static bool method_allowed(const route_def *rd, const char *method)
{
    if (!strcmp(rd->allow, "POST"))
        return !strcmp(method, "POST");
    return !strcmp(method, "GET") || !strcmp(method, "HEAD");
}

/* ---- the MHD callbacks --------------------------------------------------------------------- */

/* The one 413: a body over max_body_bytes, announced (n_bytes from Content-Length) or found
 * while reading a chunked body (n_bytes 0: not known). */
static enum MHD_Result send_too_large(request *r, unsigned long long n_bytes)
{
    char msg[200];
    long long limit = (long long)r->h->p.cfg->max_body_bytes;
    if (n_bytes)
        snprintf(msg, sizeof msg, "body of %llu bytes is over the limit of %lld bytes", n_bytes,
                 limit);
    else
        snprintf(msg, sizeof msg, "body is over the limit of %lld bytes", limit);
    return send_error(r, FITM_ERR_LIMIT, FITM_API_COND_BODY_TOO_LARGE, NULL, msg);
}

/* A POST's headers: a JSON Content-Type and an announced length within the limit. */
static enum MHD_Result check_post_headers(request *r)
{
    const char *ct = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Content-Type");
    if (!json_content_type(ct)) {
        char msg[200];
        snprintf(msg, sizeof msg, "Content-Type '%.100s' is not JSON (send application/json)", ct);
        return send_error(r, FITM_ERR_INVALID, FITM_API_COND_MEDIA_TYPE, NULL, msg);
    }
    const char *ce = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Content-Encoding");
    if (ce && strcasecmp(ce, "identity")) { /* else the compressed bytes would parse as JSON */
        char msg[200];
        snprintf(msg, sizeof msg, "Content-Encoding '%.100s' is not supported: send the body "
                 "uncompressed", ce);
        return send_error(r, FITM_ERR_INVALID, FITM_API_COND_MEDIA_TYPE, NULL, msg);
    }
    const char *cl = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Content-Length");
    if (cl) {
        char *end = NULL;
        unsigned long long n = strtoull(cl, &end, 10);
        if (end != cl && n > (unsigned long long)r->h->p.cfg->max_body_bytes)
            return send_too_large(r, n);
    }
    return MHD_YES;
}

/* OPTIONS on a route: its methods (Allow) and, to an origin cors_origins allows, the CORS
 * preflight answer (the methods and request headers a browser script may use, for 10
 * minutes). No key is asked for: browsers send none with a preflight. */
static enum MHD_Result send_options(request *r)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(0, (char *)"", MHD_RESPMEM_PERSISTENT);
    if (!resp)
        return MHD_NO;
    char allow[64];
    snprintf(allow, sizeof allow, "%s, OPTIONS", r->rd->allow);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    MHD_add_response_header(resp, "X-Request-Id", r->id);
    add_cors(r, resp);
    if (cors_origin(r)) {
        MHD_add_response_header(resp, "Access-Control-Allow-Methods", allow);
        MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                                "Authorization, Content-Type, X-Request-Id");
        MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
    }
    if (atomic_load(&r->h->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(r->conn, MHD_HTTP_NO_CONTENT, resp);
    MHD_destroy_response(resp);
    r->code = MHD_HTTP_NO_CONTENT;
    r->state = ST_ANSWERED;
    return ok;
}

/* First callback of a request: everything decidable from the request line and headers. */
static enum MHD_Result first_call(request *r, const char *url, const char *method,
                                  const char *version)
{
    const route_def *rd = find_route(target_path(url));
    if (rd && r->probe && rd->route != FITM_ROUTE_HEALTH && rd->route != FITM_ROUTE_METRICS)
        rd = NULL;
    r->rd = rd;
    r->route = rd ? rd->route : FITM_ROUTE_OTHER;
    /* The request's framing (Content-Length, Transfer-Encoding, Host, a body on a GET) was
     * checked by the gate in front (gate.h, frame.h) before a byte of it got here. */
    (void)version;
    /* Draining: the listener stays open so probes see 503 "draining" (not a refused
     * connection) while the endpoint is taken out of rotation; new inference is refused with
     * Retry-After, for the client to retry elsewhere. */
    if (atomic_load(&r->h->draining) && rd && rd->finish)
        return send_error(r, FITM_ERR_CANCELLED, FITM_API_COND_NONE, NULL,
                          "the server is shutting down (draining): retry on another instance");
    if (!rd) {
        char msg[200];
        snprintf(msg, sizeof msg, "no route %.120s", url);
        return send_error(r, FITM_ERR_NOT_FOUND, FITM_API_COND_NONE, NULL, msg);
    }
    if (!strcmp(method, "OPTIONS"))
        return send_options(r);
    if (!method_allowed(rd, method)) {
        char msg[200], allow[64]; /* OPTIONS is answered on every route (send_options) */
        snprintf(allow, sizeof allow, "%s, OPTIONS", rd->allow);
        snprintf(msg, sizeof msg, "%.16s is not allowed on %s (allowed: %s)", method, rd->path,
                 allow);
        return send_error(r, FITM_ERR_INVALID, FITM_API_COND_METHOD, allow, msg);
    }
    if (rd->auth && !authorized(r->h, r->conn))
        return send_error(r, FITM_ERR_INVALID, FITM_API_COND_UNAUTHORIZED, NULL,
                          "missing or invalid API key (send Authorization: Bearer KEY)");
    if (strcmp(method, "POST") != 0)
        return MHD_YES; /* GETs answer on the next call */
    return check_post_headers(r);
}

/* A new request's state, counted as open. NULL when out of memory. */
static request *request_new(fitm_http *h, struct MHD_Connection *conn, const char *url,
                            const char *method)
{
    request *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->h = h;
    r->conn = conn;
    r->t0_ns = fitm_clock_ns();
    snprintf(r->method, sizeof r->method, "%s", method);
    snprintf(r->path, sizeof r->path, "%s", url);
    make_id(h, conn, r->id, sizeof r->id);
    atomic_init(&r->done, false);
    pthread_mutex_lock(&h->mu);
    h->open_requests++;
    pthread_mutex_unlock(&h->mu);
    return r;
}

/* A piece of the body: kept while the body stays within max_body_bytes; past it (only a
 * chunked body gets there: a too-long Content-Length was refused up front) nothing more is
 * kept and the request answers 413 once the client stops sending. */
static enum MHD_Result take_body(request *r, const char *data, size_t n)
{
    size_t limit = (size_t)r->h->p.cfg->max_body_bytes;
    if (r->state == ST_DISCARD) {
        r->discarded += n;
        /* A chunked body far past the cap: stop reading and close. */
        return r->discarded > 4 * limit ? MHD_NO : MHD_YES;
    }
    if (r->body.len + n > limit) {
        r->discarded = r->body.len + n;
        body_free(r);
        r->state = ST_DISCARD;
        return MHD_YES;
    }
    /* the bodies held in all stay within the budget: past it this one is read and dropped,
     * then answered 503 (while a body arrives no answer can be queued) */
    if (atomic_fetch_add(&r->h->body_bytes, (int_fast64_t)n) + (int64_t)n > r->h->body_budget) {
        atomic_fetch_sub(&r->h->body_bytes, (int_fast64_t)n);
        r->discarded = r->body.len + n;
        body_free(r);
        r->state = ST_DISCARD;
        r->body_refused = true;
        return MHD_YES;
    }
    r->body_held += n;
    return fitm_buf_append(&r->body, data, n) ? MHD_YES : MHD_NO;
}

/* The request is complete (or a suspended one was resumed): answer it, or start its job, or
 * answer the finished job. */
static enum MHD_Result on_complete(request *r)
{
    const route_def *rd = r->rd;
    if (!rd)
        return MHD_NO;
    if (r->streaming && r->state == ST_WAIT)
        return stream_head(r);
    if (rd->finish) {
        if (r->state == ST_DISCARD && r->body_refused)
            return send_error(r, FITM_ERR_BUSY, FITM_API_COND_NONE, NULL,
                              "the server holds as many request bodies as it may while they "
                              "arrive; retry");
        if (r->state == ST_DISCARD)
            return send_too_large(r, 0);
        if (r->state == ST_WAIT)
            return atomic_load(&r->done) ? rd->finish(r) : MHD_YES;
    }
    return rd->start(r);
}

/* A body still arriving http_receive_timeout_s after the request began: a trickling client
 * would otherwise hold its connection for as long as it keeps sending a byte per idle
 * timeout. */
static bool receive_overdue(const request *r)
{
    return fitm_clock_ns() - r->t0_ns > r->h->p.cfg->http_receive_timeout_s * 1000000000;
}

/* 408 and close. Once the body is complete it is an ordinary answer; while the body is half
 * read libmicrohttpd refuses any response, so the 408 is written straight to the socket
 * (nothing else is being sent on it then) and the connection is closed. */
static enum MHD_Result send_slow(request *r, bool body_complete)
{
    char msg[160];
    snprintf(msg, sizeof msg, "the request was not received within %lld s",
             (long long)r->h->p.cfg->http_receive_timeout_s);
    r->must_close = true;
    body_free(r);
    if (body_complete)
        return send_error(r, FITM_ERR_INVALID, FITM_API_COND_SLOW, NULL, msg);
    fitm_api_error_class c = fitm_api_classify(FITM_ERR_INVALID, FITM_API_COND_SLOW);
    char *json = fitm_api_error_json(&c, msg);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    fitm_buf out = {0};
    if (json && ci &&
        fitm_buf_printf(&out,
                        "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                        "Content-Type: application/json\r\nX-Request-Id: %s\r\n"
                        FITM_GATE_SECURITY_HEADERS "Content-Length: %zu\r\n\r\n%s",
                        r->id, strlen(json), json))
        (void)!send(ci->connect_fd, out.p, out.len, MSG_DONTWAIT | MSG_NOSIGNAL);
    fitm_buf_free(&out);
    free(json);
    r->code = c.http;
    r->state = ST_ANSWERED;
    return MHD_NO;
}

/* Whether the request announces no body (no Transfer-Encoding, no or a zero Content-Length;
 * the gate has checked the framing). */
static bool bodiless(struct MHD_Connection *conn)
{
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
    return !MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Transfer-Encoding") &&
           (!cl || !strcmp(cl, "0"));
}

/* A new request's first callback. An answer queued in it ends the connection (libmicrohttpd
 * cannot tell that no body is left unread), so a request without a body is checked and
 * answered on its second callback, which keeps the connection alive (an OPTIONS preflight, a
 * 404, a 401 on a GET); one with a body is refused at once (401, 413, 415: its body is not
 * read). */
static enum MHD_Result first_callback(request *r, struct MHD_Connection *conn, const char *url,
                                      const char *method, const char *version)
{
    if (bodiless(conn)) {
        r->checks_later = true;
        return MHD_YES;
    }
    return first_call(r, url, method, version);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    request *r = *con_cls;
    if (!r) {
        r = request_new(cls, conn, url, method);
        if (!r)
            return MHD_NO;
        *con_cls = r;
        r->probe = false;
        r->gate = r->h->gate;
        return first_callback(r, conn, url, method, version);
    }
    if (r->checks_later) {
        r->checks_later = false;
        enum MHD_Result ok = first_call(r, url, method, version);
        if (ok != MHD_YES || r->state == ST_ANSWERED)
            return ok;
    }
    if (r->state == ST_ANSWERED) {
        *upload_data_size = 0; /* an early answer (413, 401, ...): drop what still arrives */
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (receive_overdue(r))
            return send_slow(r, false);
        return take_body(r, upload_data, n);
    }
    if (r->state == ST_BODY && receive_overdue(r))
        return send_slow(r, true);
    return on_complete(r);
}

/* probe_port's requests: as on_request, with every route but /health and /metrics absent. */
static enum MHD_Result on_probe_request(void *cls, struct MHD_Connection *conn, const char *url,
                                        const char *method, const char *version,
                                        const char *upload_data, size_t *upload_data_size,
                                        void **con_cls)
{
    if (*con_cls)
        return on_request(cls, conn, url, method, version, upload_data, upload_data_size,
                          con_cls);
    request *r = request_new(cls, conn, url, method);
    if (!r)
        return MHD_NO;
    *con_cls = r;
    r->probe = true;
    r->gate = r->h->probe_gate;
    return first_callback(r, conn, url, method, version);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    fitm_http *h = cls;
    request *r = *con_cls;
    if (!r)
        return;
    /* The gate answers a head it refused only after the requests before it are done. */
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci)
        fitm_gate_done(r->gate, ci->connect_fd);
    double s = (double)(fitm_clock_ns() - r->t0_ns) / 1e9;
    bool closed = toe != MHD_REQUEST_TERMINATED_COMPLETED_OK;
    if (r->streaming && closed) {
        pthread_mutex_lock(&r->smu);
        if (!r->s_done || r->soff < r->sbuf.len)
            atomic_store(&r->client_left, true); /* the stream was cut before its end */
        pthread_mutex_unlock(&r->smu);
    }
    if (atomic_load(&r->client_left))
        r->code = FITM_HTTP_CLIENT_LEFT; /* counted as cancelled, whatever was sent */
    if (r->code)
        fitm_metrics_request(r->route, r->code, s);
    /* Probes and scrapes come every few seconds: at info they would drown the requests. */
    bool probe = r->route == FITM_ROUTE_HEALTH || r->route == FITM_ROUTE_METRICS;
    FITM_LOG(probe ? FITM_LOG_DEBUG : FITM_LOG_INFO, r->id, "%s %s -> %d in %.1f ms%s",
             r->method, r->path, r->code, s * 1e3, closed ? " (connection closed)" : "");
    *con_cls = NULL;
    if (r->streaming) {
        /* The job may still run: make it stop at its next token, and never wake a
         * connection that is gone. */
        atomic_store(&r->s_cancel, true);
        pthread_mutex_lock(&r->smu);
        r->s_closed = true;
        pthread_mutex_unlock(&r->smu);
        release(r);
    } else {
        request_free(r);
    }
    pthread_mutex_lock(&h->mu);
    if (--h->open_requests == 0)
        pthread_cond_broadcast(&h->idle);
    pthread_mutex_unlock(&h->mu);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    FITM_LOG(FITM_LOG_DEBUG, NULL, "libmicrohttpd: %s", msg);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

/* gate's hand: the server's end of a connection whose first request head passed the gate's
 * check (gate.h: the gate relays the connection from then on). */
static void hand_to(struct MHD_Daemon *d, int fd, const struct sockaddr *addr, socklen_t addr_len)
{
    if (MHD_add_connection(d, fd, addr, addr_len) != MHD_YES) /* it closed fd */
        FITM_LOG(FITM_LOG_DEBUG, NULL, "connection refused by the HTTP server (limits)");
}

static void hand_to_main(void *user, int fd, const struct sockaddr *addr, socklen_t addr_len)
{
    hand_to(((fitm_http *)user)->d, fd, addr, addr_len);
}

static void hand_to_probe(void *user, int fd, const struct sockaddr *addr, socklen_t addr_len)
{
    hand_to(((fitm_http *)user)->probe_d, fd, addr, addr_len);
}

/* A listening TCP socket on ai; -1 when the address cannot be had. */
static int listen_socket(const struct addrinfo *ai)
{
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0)
        return -1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 511) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A listening socket on cfg->host:port; -1 when the address cannot be had. */
static int bind_port(const fitm_config *cfg, int64_t port)
{
    char service[16];
    snprintf(service, sizeof service, "%lld", (long long)port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    if (getaddrinfo(cfg->host[0] ? cfg->host : NULL, service, &hints, &ai) != 0)
        return -1;
    int fd = listen_socket(ai);
    freeaddrinfo(ai);
    return fd;
}

fitm_status fitm_http_bind(const fitm_config *cfg, fitm_http_sockets *out, fitm_err *err)
{
    out->probe_fd = -1;
    int64_t port = cfg->port;
    if ((out->fd = bind_port(cfg, port)) >= 0 && cfg->probe_port &&
        (out->probe_fd = bind_port(cfg, port = cfg->probe_port)) < 0) {
        close(out->fd);
        out->fd = -1;
    }
    if (out->fd < 0)
        return fitm_err_set(err, FITM_ERR_IO,
                            "cannot listen on %s:%lld (bad host, address in use, or not "
                            "permitted)", cfg->host, (long long)port);
    return FITM_OK;
}

void fitm_http_sockets_close(const fitm_http_sockets *s)
{
    close(s->fd);
    if (s->probe_fd >= 0)
        close(s->probe_fd);
}

/* Serves on fd (a listening socket from fitm_http_bind, taken over: closed on failure). Every
 * connection comes through a gate (gate.h: a strict check of each request head, with a
 * deadline, before libmicrohttpd sees it). The probe listener serves only /health and
 * /metrics, with a gate, thread and connection budget of its own, so probes are answered
 * while the main port's connections are all taken or trickling. Sets h->d (h->probe_d) and
 * h->gate (h->probe_gate) before the gate's thread starts, which reads them, and writes
 * neither afterwards; false when it cannot serve. */
static bool listen_on(fitm_http *h, int fd, bool probe)
{
    const fitm_config *cfg = h->p.cfg;
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET;
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    if (getsockname(fd, (struct sockaddr *)&sa, &sl) == 0 && sa.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    unsigned max_conns = probe ? 64u : (unsigned)cfg->max_connections;
    unsigned per_client = probe ? 16u : (unsigned)cfg->max_connections_per_client;
    /* The logger first, so that libmicrohttpd's words about the options after it go to the
     * log, not to stderr. A pool of one thread is no pool (0: the daemon's own thread), which
     * libmicrohttpd would warn about. */
    const unsigned pool = probe ? 0u : (unsigned)cfg->http_threads > 1 ? (unsigned)cfg->http_threads
                                                                        : 0u;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, 0, NULL, NULL, probe ? on_probe_request : on_request, h,
        MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_THREAD_POOL_SIZE, pool,
        MHD_OPTION_CONNECTION_TIMEOUT, probe ? 10u : (unsigned)cfg->http_idle_timeout_s,
        MHD_OPTION_CONNECTION_LIMIT, max_conns, MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_client,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_END);
    if (!d) {
        close(fd);
        return false;
    }
    /* hand_to_*'s daemon, from the gate's first hand-off on */
    if (probe)
        h->probe_d = d;
    else
        h->d = d;
    fitm_err err = {{0}};
    fitm_gate_params gp = {.listen_fd = fd, .head_timeout_ms = cfg->http_header_timeout_s * 1000,
                           .idle_timeout_ms = (probe ? 10 : cfg->http_idle_timeout_s) * 1000,
                           .max_body_bytes = cfg->max_body_bytes,
                           .max_conns = max_conns, .max_per_client = per_client,
                           .hand = probe ? hand_to_probe : hand_to_main, .new_id = fresh_id,
                           .user = h};
    if (fitm_gate_start(probe ? &h->probe_gate : &h->gate, &gp, &err) != FITM_OK) {
        FITM_LOG(FITM_LOG_ERROR, NULL, "%s", err.msg);
        close(fd);
        MHD_stop_daemon(d);
        if (probe)
            h->probe_d = NULL;
        else
            h->d = NULL;
        return false;
    }
    return true;
}

fitm_status fitm_http_start(fitm_http **out, const fitm_http_params *p, fitm_err *err)
{
    *out = NULL;
    const fitm_config *cfg = p->cfg;
    fitm_http *h = calloc(1, sizeof *h);
    if (!h) {
        fitm_http_sockets_close(&p->sockets);
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    }
    h->p = *p;
    h->limits.max_documents = (int32_t)cfg->max_documents;
    h->limits.max_tokens_per_doc = (int32_t)cfg->max_tokens_per_doc;
    h->limits.model_name = p->model->name;
    h->limits.strict_model = !strcmp(cfg->strict_model, "true");
    h->limits.max_answer_tokens = (int32_t)cfg->max_answer_tokens;
    h->limits.max_json_members = cfg->max_json_members;
    atomic_init(&h->draining, false);
    atomic_init(&h->body_bytes, 0);
    h->body_budget = 4 * cfg->max_body_bytes > FITM_HTTP_BODY_BUDGET ? 4 * cfg->max_body_bytes
                                                                     : FITM_HTTP_BODY_BUDGET;
    atomic_init(&h->next_id, 1);
    if (getrandom(&h->id_salt, sizeof h->id_salt, 0) != (ssize_t)sizeof h->id_salt)
        h->id_salt = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid();
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->idle, NULL);
    /* the sockets are h's from here: listen_on takes them over, the failures below close them */
    int fds[2] = {p->sockets.fd, p->sockets.probe_fd};
    /* The configuration checked the count (config.c: 1 to MAX_KEYS keys when set, so that a
     * value of separators alone never serves openly); the check guards h->keys. */
    h->n_keys = fitm_config_api_keys(cfg->api_keys, h->keys, MAX_KEYS);
    if (h->n_keys > MAX_KEYS || (cfg->api_keys[0] && h->n_keys == 0)) {
        fitm_http_sockets_close(&p->sockets);
        fitm_http_stop(h);
        return fitm_err_set(err, FITM_ERR_INVALID, "api_keys: not 1 to %d keys", MAX_KEYS);
    }

    const bool main_up = listen_on(h, fds[0], false);
    if (!main_up && fds[1] >= 0)
        close(fds[1]);
    if (!main_up || (fds[1] >= 0 && !listen_on(h, fds[1], true))) {
        long long port = main_up ? cfg->probe_port : cfg->port;
        fitm_http_stop(h);
        return fitm_err_set(err, FITM_ERR_IO, "cannot serve on %s:%lld", cfg->host, port);
    }
    *out = h;
    return FITM_OK;
}

void fitm_http_quiesce(fitm_http *h)
{
    atomic_store(&h->draining, true);
}

bool fitm_http_wait_idle(fitm_http *h, int64_t timeout_ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&h->mu);
    int rc = 0;
    while (h->open_requests > 0 && rc == 0)
        rc = pthread_cond_timedwait(&h->idle, &h->mu, &until);
    bool idle = h->open_requests == 0;
    pthread_mutex_unlock(&h->mu);
    return idle;
}

void fitm_http_stop(fitm_http *h)
{
    if (!h)
        return;
    /* The gates first (no hand-off after), then the daemons, whose last on_completed calls
     * still tell the gates (freed last). */
    fitm_gate_stop(h->probe_gate);
    fitm_gate_stop(h->gate);
    if (h->probe_d)
        MHD_stop_daemon(h->probe_d);
    if (h->d)
        MHD_stop_daemon(h->d);
    fitm_gate_free(h->probe_gate);
    fitm_gate_free(h->gate);
    pthread_cond_destroy(&h->idle);
    pthread_mutex_destroy(&h->mu);
    free(h);
}
