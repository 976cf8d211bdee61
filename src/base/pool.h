/* pool: a small fixed thread pool for the CPU forward pass.
 *
 * fitm_pool_run hands out task indices [0, n_tasks) one at a time (an atomic counter, so
 * uneven tasks balance themselves) to the calling thread and to the pool's workers, and
 * returns when every task has finished. Workers spin briefly between runs, since a forward
 * pass issues many short runs back to back, then sleep on a condition variable.
 *
 * One thread at a time may call fitm_pool_run on a given pool (the engine's worker thread
 * owns the model, its backend and this pool). */
#ifndef FITM_POOL_H
#define FITM_POOL_H

#include <stdint.h>

#include "base/status.h"

typedef struct fitm_pool fitm_pool;

/* A task: ctx is the caller's, task in [0, n_tasks), thread in [0, n_threads) identifies the
 * executing thread (0 is the caller) so tasks can use per-thread scratch. */
typedef void (*fitm_pool_fn)(void *ctx, int64_t task, int thread);

/* Creates a pool of n_threads threads in all, counting the caller (so n_threads - 1 workers
 * are started). n_threads must be in [1, 256]. *out is NULL on failure. */
fitm_status fitm_pool_create(fitm_pool **out, int n_threads, fitm_err *err);

/* Stops and joins the workers. NULL is a no-op. */
void fitm_pool_destroy(fitm_pool *p);

int fitm_pool_n_threads(const fitm_pool *p);

/* Runs fn(ctx, t, thread) for every t in [0, n_tasks) and waits for all of them. Runs inline
 * when n_tasks <= 1 or the pool has one thread. */
void fitm_pool_run(fitm_pool *p, int64_t n_tasks, fitm_pool_fn fn, void *ctx);

#endif
