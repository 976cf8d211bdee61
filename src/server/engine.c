#include "server/engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/log.h"
#include "server/metrics.h"

struct fitm_engine {
    fitm_engine_hooks hooks;
    pthread_mutex_t mu;
    pthread_cond_t work;    /* queue non-empty, or stopping                */
    pthread_cond_t idle;    /* state changes, job finished, queue emptied   */
    pthread_cond_t timer;   /* queue changed (timer thread re-evaluates)    */
    fitm_job *head, *tail;  /* FIFO of waiting jobs                          */
    int64_t n_queued, capacity;
    int64_t running;        /* jobs started and not finished                 */
    int64_t queued_cost;    /* sum of the queued jobs' cost                  */
    int64_t max_job_cost, max_queued_cost; /* 0: no bound                  */
    int64_t costing;        /* submits inside hooks.cost, callers inside hooks.now (unload
                               waits for them)                                  */
    fitm_engine_state state;
    fitm_err state_err;
    bool draining;          /* submit refuses                                */
    bool stopping;          /* threads exit                                  */
    atomic_bool abort_flag; /* the running job should stop                   */
    pthread_t worker, timer_thread;
    bool worker_started, timer_started;
    fitm_engine_batch_stats batch; /* under mu */
};

/* Absolute CLOCK_MONOTONIC time ns from now, for pthread_cond_timedwait. */
static struct timespec abs_after_ns(int64_t ns)
{
    int64_t t = fitm_clock_ns() + (ns > 0 ? ns : 0);
    return (struct timespec){.tv_sec = t / 1000000000, .tv_nsec = t % 1000000000};
}

static void finish(fitm_job *job, fitm_status st)
{
    job->status = st;
    job->on_done(job, job->user); /* the job is the submitter's again from here on */
}

static fitm_job *pop_locked(fitm_engine *e)
{
    fitm_job *j = e->head;
    if (j) {
        e->head = j->next;
        if (!e->head)
            e->tail = NULL;
        j->next = NULL;
        e->n_queued--;
        e->queued_cost -= j->cost;
    }
    return j;
}

static bool client_gone(const fitm_job *job)
{
    return job->client_gone && job->client_gone(job->user);
}

/* The status of a job that run (or the check before it) ended with st: a stop asked for by
 * shutdown or by a vanished client is reported as such, not as the deadline it looks like
 * to the pipeline. */
static fitm_status stop_reason(fitm_job *job, fitm_status st)
{
    if (st != FITM_ERR_TIMEOUT && st != FITM_ERR_CANCELLED)
        return st;
    if (job->abort_flag && atomic_load(job->abort_flag))
        return fitm_err_set(&job->err, FITM_ERR_CANCELLED, "the server is shutting down");
    if (client_gone(job))
        return fitm_err_set(&job->err, FITM_ERR_CANCELLED, "the client disconnected");
    return st;
}

/* Ends a job that ran (or was refused before running) with js: logs, marks the engine broken
 * on a backend failure, hands the job back. */
static void end_job(fitm_engine *e, fitm_job *job, fitm_status js)
{
    if (js == FITM_ERR_CANCELLED)
        FITM_LOG(FITM_LOG_INFO, job->req_id, "job cancelled: %s", job->err.msg);
    if (js == FITM_ERR_BACKEND) {
        pthread_mutex_lock(&e->mu);
        e->state = FITM_ENGINE_BROKEN;
        e->state_err = job->err;
        pthread_mutex_unlock(&e->mu);
        FITM_LOG(FITM_LOG_ERROR, job->req_id, "backend failure, now unhealthy: %s",
                 job->err.msg);
    }
    finish(job, js);
}

/* Starts a job taken off the queue: runs it whole (hooks.run, or hooks.begin when it does not
 * join), or returns true when it joined the running batch. */
static bool start_job(fitm_engine *e, fitm_job *job)
{
    int64_t now = fitm_clock_ns();
    job->queue_ms = (double)(now - job->enqueued_ns) / 1e6;
    fitm_metrics_queue_wait(job->queue_ms / 1e3);
    job->kv_bytes = 0;
    fitm_status js;
    if (now >= job->deadline_ns) {
        js = fitm_err_set(&job->err, FITM_ERR_TIMEOUT,
                          "the request's deadline passed while it waited in the queue");
    } else if (client_gone(job)) {
        js = fitm_err_set(&job->err, FITM_ERR_CANCELLED, "the client disconnected");
    } else if (e->hooks.begin) {
        bool joined = false;
        js = e->hooks.begin(e->hooks.ctx, job, &joined, &job->err);
        if (joined && js == FITM_OK)
            return true;
        js = stop_reason(job, js);
    } else {
        js = stop_reason(job, e->hooks.run(e->hooks.ctx, job, &job->err));
    }
    end_job(e, job, js);
    return false;
}

/* The running batch (worker-private). */
typedef struct {
    fitm_job *jobs[FITM_ENGINE_MAX_RUNNING];
    int32_t n;
    int64_t kv_bytes;
} running_set;

/* Whether a waiting job may start now (mu held). */
static bool may_start(const fitm_engine *e, const running_set *rs)
{
    if (!e->hooks.step)
        return true; /* one at a time: nothing else runs between jobs */
    int32_t cap = e->hooks.max_running;
    cap = cap < 1 ? 1 : cap > FITM_ENGINE_MAX_RUNNING ? FITM_ENGINE_MAX_RUNNING : cap;
    return rs->n < cap && (rs->n == 0 || rs->kv_bytes < e->hooks.kv_budget);
}

/* One batched step over the running jobs; ends those that finished. */
static void step_running(fitm_engine *e, running_set *rs)
{
    fitm_status st[FITM_ENGINE_MAX_RUNNING];
    bool done[FITM_ENGINE_MAX_RUNNING];
    const int64_t t0 = fitm_clock_ns();
    const int64_t tokens = e->hooks.step(e->hooks.ctx, rs->jobs, rs->n, st, done);
    const double ms = (double)(fitm_clock_ns() - t0) / 1e6;
    pthread_mutex_lock(&e->mu);
    e->batch.steps++;
    e->batch.step_jobs += rs->n;
    e->batch.last_batch = rs->n;
    e->batch.step_tokens += tokens;
    e->batch.last_tokens = tokens;
    e->batch.step_ms_total += ms;
    e->batch.last_step_ms = ms;
    pthread_mutex_unlock(&e->mu);
    int32_t kept = 0;
    rs->kv_bytes = 0; /* the step may have changed what a job holds (hooks.step) */
    for (int32_t i = 0; i < rs->n; i++) {
        fitm_job *job = rs->jobs[i];
        if (!done[i]) {
            rs->jobs[kept++] = job;
            rs->kv_bytes += job->kv_bytes;
            continue;
        }
        end_job(e, job, stop_reason(job, st[i]));
    }
    rs->n = kept;
}

static void *worker_main(void *arg)
{
    fitm_engine *e = arg;
    fitm_err err = {{0}};
    fitm_status st = e->hooks.load(e->hooks.ctx, &err);
    running_set rs = {.n = 0};
    pthread_mutex_lock(&e->mu);
    if (st != FITM_OK) {
        e->state = FITM_ENGINE_FAILED;
        e->state_err = err;
    } else if (e->state == FITM_ENGINE_LOADING) {
        e->state = FITM_ENGINE_READY;
    }
    pthread_cond_broadcast(&e->idle);
    for (;;) {
        while (!e->stopping && !e->head && rs.n == 0)
            pthread_cond_wait(&e->work, &e->mu);
        /* On shutdown the running jobs still step: each sees the abort flag and ends. */
        if (e->stopping && rs.n == 0)
            break;
        fitm_job *job = !e->stopping && e->head && may_start(e, &rs) ? pop_locked(e) : NULL;
        e->running = rs.n + (job != NULL);
        pthread_cond_broadcast(&e->timer);
        pthread_mutex_unlock(&e->mu);

        if (job && start_job(e, job)) {
            rs.jobs[rs.n++] = job;
            rs.kv_bytes += job->kv_bytes;
        }
        if (rs.n > 0)
            step_running(e, &rs);

        pthread_mutex_lock(&e->mu);
        e->running = rs.n;
        e->batch.running = rs.n;
        e->batch.kv_bytes = rs.kv_bytes;
        pthread_cond_broadcast(&e->idle);
    }
    while (e->costing) /* a submit or run_now still reading the model */
        pthread_cond_wait(&e->idle, &e->mu);
    pthread_mutex_unlock(&e->mu);
    e->hooks.unload(e->hooks.ctx);
    return NULL;
}

/* Fails queued jobs whose deadline passed, so a client waiting behind a long job gets its 503
 * on time. Touches no model state. */
static void *timer_main(void *arg)
{
    fitm_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    while (!e->stopping) {
        int64_t now = fitm_clock_ns(), next = now + 1000000000;
        fitm_job *expired = NULL, **pp = &e->head, *prev = NULL;
        while (*pp) {
            fitm_job *j = *pp;
            if (j->deadline_ns <= now) {
                *pp = j->next;
                if (e->tail == j)
                    e->tail = prev;
                e->n_queued--;
                e->queued_cost -= j->cost;
                j->next = expired;
                expired = j;
            } else {
                if (j->deadline_ns < next)
                    next = j->deadline_ns;
                prev = j;
                pp = &j->next;
            }
        }
        if (expired) {
            pthread_cond_broadcast(&e->idle);
            pthread_mutex_unlock(&e->mu);
            while (expired) {
                fitm_job *j = expired;
                expired = j->next;
                j->queue_ms = (double)(now - j->enqueued_ns) / 1e6;
                fitm_err_set(&j->err, FITM_ERR_TIMEOUT,
                             "the request's deadline passed while it waited in the queue");
                finish(j, FITM_ERR_TIMEOUT);
            }
            pthread_mutex_lock(&e->mu);
            continue;
        }
        struct timespec ts = abs_after_ns(next - now);
        pthread_cond_timedwait(&e->timer, &e->mu, &ts);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

static bool init_cond(pthread_cond_t *c)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a))
        return false;
    bool ok = !pthread_condattr_setclock(&a, CLOCK_MONOTONIC) && !pthread_cond_init(c, &a);
    pthread_condattr_destroy(&a);
    return ok;
}

fitm_status fitm_engine_create(fitm_engine **out, const fitm_engine_hooks *hooks,
                               int64_t queue_depth, fitm_err *err)
{
    *out = NULL;
    if (queue_depth < 1)
        return fitm_err_set(err, FITM_ERR_INVALID, "queue depth %lld < 1",
                            (long long)queue_depth);
    fitm_engine *e = calloc(1, sizeof *e);
    if (!e)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    if (!hooks->begin != !hooks->step || (hooks->step && (hooks->max_running < 1 ||
                                                          hooks->max_running >
                                                              FITM_ENGINE_MAX_RUNNING ||
                                                          hooks->kv_budget < 0))) {
        free(e);
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "engine hooks: begin and step go together, with max_running in "
                            "[1, %d] and a kv_budget >= 0",
                            FITM_ENGINE_MAX_RUNNING);
    }
    e->hooks = *hooks;
    e->capacity = queue_depth;
    e->state = FITM_ENGINE_LOADING;
    atomic_init(&e->abort_flag, false);
    if (pthread_mutex_init(&e->mu, NULL) || !init_cond(&e->work) || !init_cond(&e->idle) ||
        !init_cond(&e->timer)) {
        free(e);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot create engine locks");
    }
    if (pthread_create(&e->worker, NULL, worker_main, e)) {
        fitm_engine_destroy(e);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start the engine thread");
    }
    e->worker_started = true;
    if (pthread_create(&e->timer_thread, NULL, timer_main, e)) {
        fitm_engine_destroy(e);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start the engine timer thread");
    }
    e->timer_started = true;
    *out = e;
    return FITM_OK;
}

void fitm_engine_shutdown(fitm_engine *e)
{
    pthread_mutex_lock(&e->mu);
    e->draining = true;
    e->stopping = true;
    atomic_store(&e->abort_flag, true);
    fitm_job *waiting = e->head;
    e->head = e->tail = NULL;
    e->n_queued = 0;
    e->queued_cost = 0;
    pthread_cond_broadcast(&e->work);
    pthread_cond_broadcast(&e->timer);
    pthread_mutex_unlock(&e->mu);
    while (waiting) {
        fitm_job *j = waiting;
        waiting = j->next;
        fitm_err_set(&j->err, FITM_ERR_CANCELLED, "the server is shutting down");
        finish(j, FITM_ERR_CANCELLED);
    }
    if (e->worker_started)
        pthread_join(e->worker, NULL); /* a load in progress finishes first */
    if (e->timer_started)
        pthread_join(e->timer_thread, NULL);
    e->worker_started = e->timer_started = false;
}

void fitm_engine_destroy(fitm_engine *e)
{
    if (!e)
        return;
    fitm_engine_shutdown(e);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->idle);
    pthread_cond_destroy(&e->timer);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

void fitm_engine_set_budget(fitm_engine *e, int64_t max_job_cost, int64_t max_queued_cost)
{
    pthread_mutex_lock(&e->mu);
    e->max_job_cost = max_job_cost > 0 ? max_job_cost : 0;
    e->max_queued_cost = max_queued_cost > 0 ? max_queued_cost : 0;
    pthread_mutex_unlock(&e->mu);
}

/* Why the engine takes no job now (FITM_OK: it does), under e->mu. */
static fitm_status refusal_locked(const fitm_engine *e, fitm_err *err)
{
    if (e->draining)
        return fitm_err_set(err, FITM_ERR_CANCELLED, "the server is shutting down");
    if (e->state == FITM_ENGINE_LOADING)
        return fitm_err_set(err, FITM_ERR_BUSY, "the model is still loading");
    if (e->state != FITM_ENGINE_READY)
        return fitm_err_set(err, FITM_ERR_BUSY, "the engine is unhealthy: %s", e->state_err.msg);
    return FITM_OK;
}

/* Whether job fits the budgets and the queue, under e->mu. */
static fitm_status admit_locked(const fitm_engine *e, const fitm_job *job, fitm_err *err)
{
    if (e->max_job_cost && job->cost > e->max_job_cost)
        return fitm_err_set(err, FITM_ERR_LIMIT,
                            "the request would compute an estimated %lld forward tokens, over "
                            "the limit of %lld per request (max_request_forward_tokens): send "
                            "fewer or shorter documents, a smaller max_tokens or a cheaper "
                            "method or reference",
                            (long long)job->cost, (long long)e->max_job_cost);
    if (e->n_queued >= e->capacity)
        return fitm_err_set(err, FITM_ERR_BUSY, "the queue is full (%lld requests waiting)",
                            (long long)e->n_queued);
    if (e->max_queued_cost && e->n_queued > 0 &&
        e->queued_cost + job->cost > e->max_queued_cost)
        return fitm_err_set(err, FITM_ERR_BUSY,
                            "the queue is full: %lld waiting requests hold an estimated %lld "
                            "forward tokens, and this one's %lld more would pass the limit of "
                            "%lld (max_queued_forward_tokens)",
                            (long long)e->n_queued, (long long)e->queued_cost,
                            (long long)job->cost, (long long)e->max_queued_cost);
    return FITM_OK;
}

fitm_status fitm_engine_submit(fitm_engine *e, fitm_job *job, fitm_err *err)
{
    job->cost = 0;
    pthread_mutex_lock(&e->mu);
    fitm_status st = refusal_locked(e, err);
    /* The estimate tokenizes the request: outside the lock, but counted, so the worker does
     * not unload the model under it. */
    bool costing = st == FITM_OK && e->hooks.cost;
    e->costing += costing;
    pthread_mutex_unlock(&e->mu);
    if (costing) {
        st = e->hooks.cost(e->hooks.ctx, job, &job->cost, err);
        pthread_mutex_lock(&e->mu);
        e->costing--;
        pthread_cond_broadcast(&e->idle);
        pthread_mutex_unlock(&e->mu);
    }
    if (st != FITM_OK)
        return st;
    pthread_mutex_lock(&e->mu);
    if ((st = refusal_locked(e, err)) == FITM_OK && (st = admit_locked(e, job, err)) == FITM_OK) {
        job->next = NULL;
        job->enqueued_ns = fitm_clock_ns();
        job->abort_flag = &e->abort_flag;
        job->status = FITM_OK;
        if (e->tail)
            e->tail->next = job;
        else
            e->head = job;
        e->tail = job;
        e->n_queued++;
        e->queued_cost += job->cost;
        pthread_cond_signal(&e->work);
        pthread_cond_broadcast(&e->timer);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

fitm_status fitm_engine_run_now(fitm_engine *e, fitm_job *job, fitm_err *err)
{
    if (!e->hooks.now)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED, "the engine runs no job at once");
    pthread_mutex_lock(&e->mu);
    fitm_status st = refusal_locked(e, err);
    e->costing += st == FITM_OK;
    pthread_mutex_unlock(&e->mu);
    if (st != FITM_OK)
        return st;
    st = e->hooks.now(e->hooks.ctx, job, err);
    pthread_mutex_lock(&e->mu);
    e->costing--;
    pthread_cond_broadcast(&e->idle);
    pthread_mutex_unlock(&e->mu);
    return st;
}

int64_t fitm_engine_queued_cost(const fitm_engine *e)
{
    fitm_engine *m = (fitm_engine *)e;
    pthread_mutex_lock(&m->mu);
    int64_t c = m->queued_cost;
    pthread_mutex_unlock(&m->mu);
    return c;
}

bool fitm_job_should_stop(const fitm_job *job)
{
    if (job->abort_flag && atomic_load(job->abort_flag))
        return true;
    return fitm_clock_ns() >= job->deadline_ns || client_gone(job);
}

fitm_engine_state fitm_engine_get_state(const fitm_engine *e, fitm_err *msg)
{
    fitm_engine *m = (fitm_engine *)e; /* locking does not change the observable state */
    pthread_mutex_lock(&m->mu);
    fitm_engine_state s = m->state;
    if (msg)
        *msg = m->state_err;
    pthread_mutex_unlock(&m->mu);
    return s;
}

void fitm_engine_stats(const fitm_engine *e, int64_t *depth, int64_t *capacity,
                       int64_t *inflight)
{
    fitm_engine *m = (fitm_engine *)e;
    pthread_mutex_lock(&m->mu);
    *depth = m->n_queued;
    *capacity = m->capacity;
    *inflight = m->running;
    pthread_mutex_unlock(&m->mu);
}

bool fitm_engine_drain(fitm_engine *e, int64_t timeout_ms)
{
    struct timespec until = abs_after_ns(timeout_ms * 1000000);
    pthread_mutex_lock(&e->mu);
    e->draining = true;
    int rc = 0;
    while ((e->head || e->running) && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&e->idle, &e->mu, &until);
    bool done = !e->head && !e->running;
    pthread_mutex_unlock(&e->mu);
    return done;
}

void fitm_engine_batch_stats_get(const fitm_engine *e, fitm_engine_batch_stats *out)
{
    fitm_engine *m = (fitm_engine *)e;
    pthread_mutex_lock(&m->mu);
    *out = m->batch;
    pthread_mutex_unlock(&m->mu);
}
