#include "base/pool.h"

#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How long an idle worker polls for the next run before it sleeps, in relax iterations
 * (a pause is ~10-40 ns, so this is tens of microseconds: the gap between two ops of one
 * forward pass, but not the gap between two requests). */
#define SPIN_ITERS 20000

/* A run is published as two 64-bit words, each tagged with the run's generation in its high
 * 32 bits: `job` = (gen, n_tasks) and `claim` = (gen, next task). A thread takes task i of run
 * g by a compare-and-swap of claim from (g, i) to (g, i + 1) after checking i < n_tasks(g); a
 * successful swap proves run g is still current (it cannot end while task i is untaken), so
 * fn/ctx are g's. The caller waits only for the tasks it handed out to finish (`done`), never
 * for workers to wake up: on two shared cores a sleeping or descheduled worker would
 * otherwise cost the caller a scheduler time slice per op. */
struct fitm_pool {
    int n_threads;
    pthread_t *workers;          /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t job;        /* gen << 32 | n_tasks */
    _Atomic uint64_t claim;      /* gen << 32 | next task */
    _Atomic int64_t done;        /* tasks of the current run finished */
    _Atomic int sleepers;        /* workers blocked on cv */
    _Atomic bool stop;
    uint32_t gen;                /* caller's copy of the current generation */
    fitm_pool_fn fn;             /* the current run; written before it is published */
    void *ctx;
};

typedef struct {
    fitm_pool *pool;
    int thread;
} worker_arg;

#define GEN(w) ((uint32_t)((w) >> 32))
#define LOW(w) ((int64_t)((w)&0xffffffffu))

/* Takes and runs tasks of run `gen` until none is left. */
static void run_tasks(fitm_pool *p, uint32_t gen, int thread)
{
    for (;;) {
        uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
        uint64_t j = atomic_load_explicit(&p->job, memory_order_acquire);
        if (GEN(c) != gen || GEN(j) != gen || LOW(c) >= LOW(j))
            return;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        p->fn(p->ctx, LOW(c), thread);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg_)
{
    worker_arg *arg = arg_;
    fitm_pool *p = arg->pool;
    int thread = arg->thread;
    free(arg);
    uint32_t seen = 0; /* generation 0 is never a run */
    for (;;) {
        uint32_t g = seen;
        for (int i = 0; i < SPIN_ITERS; i++) {
            g = GEN(atomic_load(&p->claim));
            if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
                break;
            cpu_relax();
        }
        if (g == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((g = GEN(atomic_load(&p->claim))) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = g;
        run_tasks(p, g, thread);
    }
}

fitm_status fitm_pool_create(fitm_pool **out, int n_threads, fitm_err *err)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > 256)
        return fitm_err_set(err, FITM_ERR_INVALID, "thread count %d is not in [1, 256]", n_threads);
    fitm_pool *p = calloc(1, sizeof *p);
    if (!p)
        return fitm_err_set(err, FITM_ERR_NOMEM, "thread pool: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            p->n_threads = 1;
            fitm_pool_destroy(p);
            return fitm_err_set(err, FITM_ERR_NOMEM, "thread pool: out of memory");
        }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (arg) {
            arg->pool = p;
            arg->thread = i;
        }
        if (!arg || pthread_create(&p->workers[i - 1], NULL, worker_main, arg) != 0) {
            free(arg);
            p->n_threads = i; /* destroy joins the i - 1 started so far */
            fitm_pool_destroy(p);
            return fitm_err_set(err, FITM_ERR_NOMEM, "thread pool: cannot start thread %d", i);
        }
    }
    *out = p;
    return FITM_OK;
}

void fitm_pool_destroy(fitm_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->workers[i - 1], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

int fitm_pool_n_threads(const fitm_pool *p)
{
    return p->n_threads;
}

void fitm_pool_run(fitm_pool *p, int64_t n_tasks, fitm_pool_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (n_tasks == 1 || p->n_threads == 1) {
        for (int64_t t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    assert(n_tasks < ((int64_t)1 << 32));
    uint32_t gen = ++p->gen;
    if (gen == 0)
        gen = ++p->gen; /* 0 means "no run" to a fresh worker */
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->job, (uint64_t)gen << 32 | (uint64_t)n_tasks, memory_order_release);
    atomic_store(&p->claim, (uint64_t)gen << 32); /* seq_cst: pairs with the sleepers check */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_tasks(p, gen, 0);
    for (long i = 0; atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks; i++) {
        if (i < SPIN_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
}
