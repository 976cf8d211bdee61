/* engine: the bounded queue between HTTP threads and the ONE worker thread that owns the model.
 *
 * The worker first loads the model (hooks.load, on the worker, so the HTTP server can answer
 * /health with 503 meanwhile), then runs jobs in arrival order: one at a time (hooks.run),
 * or with hooks.begin/step as a running batch that new jobs join between steps.
 * A second, model-free thread fails queued jobs whose deadline passes while they wait.
 *
 * The engine knows nothing of what a job computes: it queues jobs and hands each, with its
 * kind and its opaque work pointer, to hooks.run (fitmd's kinds are in server/work.h).
 *
 * A job belongs to its submitter. Once fitm_engine_submit accepted it, the engine holds it
 * until it calls job->on_done exactly once (from the worker or the timer thread, with no
 * engine lock held); after on_done returns the engine never touches the job again. on_done
 * must not block.
 *
 * Thread-safety: every function may be called from any thread, except destroy (one thread,
 * once, when no submit can race with it). */
#ifndef FITM_ENGINE_H
#define FITM_ENGINE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef struct fitm_engine fitm_engine;
typedef struct fitm_job fitm_job;

struct fitm_job {
    /* Set by the submitter. */
    int kind;            /* what hooks.run should do with work; the engine never reads it  */
    void *work;          /* the submitter's request and result, for hooks.run               */
    int64_t deadline_ns; /* fitm_clock_ns time; the job fails with FITM_ERR_TIMEOUT after it */
    void (*on_done)(fitm_job *job, void *user);
    void *user;
    /* May be NULL. True once the client that waits for this job is gone; polled (with user)
     * before the job runs and wherever it may stop, on the worker thread. A gone client's
     * job stops at the next forward-call boundary with FITM_ERR_CANCELLED. */
    bool (*client_gone)(void *user);
    char req_id[40]; /* for logs */
    /* Set by the engine at submit: the job's estimated cost (hooks.cost; 0 without one). */
    int64_t cost;
    /* Set by hooks.begin when the job joins the running batch: the memory it holds while it
     * runs (its KV caches), counted against hooks.kv_budget; hooks.step updates it when what
     * the job holds changes (an /answer's ranking caches, then its own). */
    int64_t kv_bytes;
    /* Set by the engine before on_done. */
    fitm_status status;
    fitm_err err;
    double queue_ms;
    /* Engine-private. */
    int64_t enqueued_ns;
    const atomic_bool *abort_flag;
    fitm_job *next;
};

/* The model side, called only on the worker thread. */
typedef struct {
    void *ctx;
    /* Loads the model. A failure is fatal: the engine's state becomes FAILED. */
    fitm_status (*load)(void *ctx, fitm_err *err);
    /* Runs one job: does what job->kind says with job->work. Long runs poll
     * fitm_job_should_stop between steps. */
    fitm_status (*run)(void *ctx, fitm_job *job, fitm_err *err);
    /* May be NULL. The job's cost in forward tokens (at least what run will compute),
     * estimated at submit on the submitting thread while run may be running on the worker
     * (so it reads only what load made). A failure refuses the job with its status. */
    fitm_status (*cost)(void *ctx, const fitm_job *job, int64_t *tokens, fitm_err *err);
    /* May be NULL. Runs a job that needs what load made but no forward pass, on the thread of
     * fitm_engine_run_now, while run may be running on the worker (as cost does). */
    fitm_status (*now)(void *ctx, fitm_job *job, fitm_err *err);
    /* Releases what load made (also after a failed load). */
    void (*unload)(void *ctx);
    /* Optional, continuous batching (both or neither). begin starts a job in place of run:
     * *joined true puts it in the running batch, where it advances only through step; false
     * means it is complete with the returned status, as from run. step advances every running
     * job by one batched forward call (returning its forward tokens, for /metrics) and sets,
     * for each i, done[i] when jobs[i] finished,
     * with st[i] (and jobs[i]->err), and updates jobs[i]->kv_bytes of a job still running
     * whose memory changed. Between two steps the engine starts at most one waiting
     * job, while fewer than max_running run and (unless none runs) the running ones hold
     * less than kv_budget bytes; beyond that, requests wait in the queue. */
    fitm_status (*begin)(void *ctx, fitm_job *job, bool *joined, fitm_err *err);
    int64_t (*step)(void *ctx, fitm_job *const *jobs, int32_t n, fitm_status *st, bool *done);
    int32_t max_running; /* 1 .. FITM_ENGINE_MAX_RUNNING when step is set */
    int64_t kv_budget;   /* bytes                                        */
} fitm_engine_hooks;

/* Most jobs in the running batch. */
#define FITM_ENGINE_MAX_RUNNING 32

/* What the batching worker has done so far, for /metrics. */
typedef struct {
    int64_t steps;          /* batched steps run                                  */
    int64_t step_jobs;      /* sum over steps of the jobs in the step             */
    int64_t running;        /* jobs in the running batch now                      */
    int64_t last_batch;     /* jobs in the last step                              */
    int64_t step_tokens;    /* sum over steps of their forward tokens             */
    int64_t last_tokens;    /* forward tokens of the last step                    */
    int64_t kv_bytes;       /* memory the running jobs hold now                   */
    double step_ms_total;   /* time spent in steps                                */
    double last_step_ms;
} fitm_engine_batch_stats;

void fitm_engine_batch_stats_get(const fitm_engine *e, fitm_engine_batch_stats *out);

typedef enum {
    FITM_ENGINE_LOADING = 0,
    FITM_ENGINE_READY,
    FITM_ENGINE_FAILED,  /* load failed: the daemon exits                        */
    FITM_ENGINE_BROKEN,  /* a job hit FITM_ERR_BACKEND: sticky, /health says 503  */
} fitm_engine_state;

/* Starts the worker (which loads) and the timer thread. queue_depth >= 1. */
fitm_status fitm_engine_create(fitm_engine **out, const fitm_engine_hooks *hooks,
                               int64_t queue_depth, fitm_err *err);

/* Fails waiting jobs with FITM_ERR_CANCELLED, asks the running job to stop, joins both
 * threads and unloads. Every accepted job has had its on_done when this returns; submit
 * fails with FITM_ERR_CANCELLED afterwards. Idempotent. */
void fitm_engine_shutdown(fitm_engine *e);

/* Shuts down (if not yet) and frees. NULL is a no-op. */
void fitm_engine_destroy(fitm_engine *e);

/* Admission by cost (hooks.cost): a job estimated over max_job_cost is refused with
 * FITM_ERR_LIMIT; one that would bring the queued jobs' total cost over max_queued_cost with
 * FITM_ERR_BUSY (an empty queue takes any job within max_job_cost). 0 = no bound. Both are 0
 * until this is called. */
void fitm_engine_set_budget(fitm_engine *e, int64_t max_job_cost, int64_t max_queued_cost);

/* Queues job. FITM_ERR_BUSY when the queue is full (by count or by cost), the model is still
 * loading or the engine is broken, FITM_ERR_LIMIT when the job's cost is over the budget (see
 * fitm_engine_set_budget), the cost hook's status when it fails, FITM_ERR_CANCELLED once
 * draining began; err says which. On failure the engine does not keep the job and never
 * calls on_done. */
fitm_status fitm_engine_submit(fitm_engine *e, fitm_job *job, fitm_err *err);

/* Runs job through hooks.now on the calling thread, at once, without queueing it: for work
 * that would otherwise hold the worker, and so every running job, while it reads the model
 * (fitmd: /tokenize of a 4 MB body, seconds). Refused as fitm_engine_submit refuses while the
 * model loads, after a backend failure or once draining began (no queue or cost check); the
 * worker does not unload the model under it. on_done is not called: the job's result is the
 * returned status (FITM_ERR_UNSUPPORTED without hooks.now). */
fitm_status fitm_engine_run_now(fitm_engine *e, fitm_job *job, fitm_err *err);

/* For hooks.run: true when the job's deadline passed, its client is gone or the engine is
 * shutting down. Whatever hooks.run then returns, the job ends with the reason that holds:
 * FITM_ERR_CANCELLED "the server is shutting down", FITM_ERR_CANCELLED "the client
 * disconnected", else what hooks.run said (FITM_ERR_TIMEOUT for the deadline). */
bool fitm_job_should_stop(const fitm_job *job);

/* The state, and (when msg is non-NULL) the load or backend error message. */
fitm_engine_state fitm_engine_get_state(const fitm_engine *e, fitm_err *msg);

/* The queued jobs' total estimated cost now (forward tokens). */
int64_t fitm_engine_queued_cost(const fitm_engine *e);

/* Queue depth now, capacity, and jobs running (started, not yet finished). */
void fitm_engine_stats(const fitm_engine *e, int64_t *depth, int64_t *capacity,
                       int64_t *inflight);

/* Stops accepting (submit then fails with CANCELLED) and waits up to timeout_ms for the
 * queue to empty and the running job to finish. True when everything finished. */
bool fitm_engine_drain(fitm_engine *e, int64_t timeout_ms);

#endif
