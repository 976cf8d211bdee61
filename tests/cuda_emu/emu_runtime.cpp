/* cuda_emu runtime: memory, streams, events, errors, and the engine behind launches
 * (contract in cuda_runtime_api.h and emu_device.h). Two engines, chosen when this file is
 * compiled:
 *
 * - fibers (the default): fibers are started once with makecontext and live across blocks and
 *   launches (each runs the launch's entry, reports done, and waits for the next block);
 *   switches between a fiber and the scheduler are _setjmp/_longjmp, which unlike swapcontext
 *   make no system call. The fortified longjmp would take a jump to another stack for stack
 *   smashing, hence the #undef.
 * - threads (FITM_CUDA_EMU_THREADS): every CUDA thread of a block is an OS thread of a pool,
 *   __syncthreads a barrier and a shuffle a per-warp rendezvous, all under one mutex, so a
 *   ThreadSanitizer build sees exactly the happens-before edges CUDA promises and reports
 *   the accesses to shared or global memory that no barrier orders (tests/meson.build builds
 *   the kernel tests this way with -fsanitize=thread). */
#ifdef _FORTIFY_SOURCE
#undef _FORTIFY_SOURCE
#endif
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucontext.h>

#include <vector>

#include "cuda_runtime.h"

thread_local fitm_emu_thread *fitm_emu_cur;
thread_local uint3 fitm_emu_block_idx;
thread_local dim3 fitm_emu_block_dim, fitm_emu_grid_dim;

namespace
{

pthread_mutex_t launch_lock = PTHREAD_MUTEX_INITIALIZER; /* __shared__ statics: one block */
pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
cudaError_t last_error = cudaSuccess;
cudaError_t injected_malloc = cudaSuccess, injected_launch = cudaSuccess;

cudaError_t set_error(cudaError_t e)
{
    pthread_mutex_lock(&state_lock);
    if (e != cudaSuccess)
        last_error = e;
    pthread_mutex_unlock(&state_lock);
    return e;
}

/* Pinned host memory (cudaMallocHost) and the copies from it that have not run yet. A device
 * runs a cudaMemcpyAsync from pinned memory when its stream reaches the copy, so a host write
 * to the source before then changes what arrives. The emulator runs such copies as late as
 * it can: just before the next operation that touches device memory (a launch, cuBLAS,
 * another copy, a memset) or waits for the device (a synchronization, a free). Code that
 * rewrites a staged source too early thus sends the later bytes, as a device could. */
struct pinned_block {
    const char *p;
    size_t n;
};
struct pending_copy {
    void *dst;
    const void *src;
    size_t n;
};
pthread_mutex_t copy_lock = PTHREAD_MUTEX_INITIALIZER;
std::vector<pinned_block> pinned;
std::vector<pending_copy> pending;

bool in_pinned(const void *src, size_t n)
{
    const char *q = (const char *)src;
    for (const pinned_block &b : pinned)
        if (q >= b.p && q + n <= b.p + b.n)
            return true;
    return false;
}

void run_pending_copies(void)
{
    pthread_mutex_lock(&copy_lock);
    for (const pending_copy &c : pending)
        memmove(c.dst, c.src, c.n);
    pending.clear();
    pthread_mutex_unlock(&copy_lock);
}

cudaError_t take_injected(cudaError_t *slot)
{
    pthread_mutex_lock(&state_lock);
    const cudaError_t e = *slot;
    *slot = cudaSuccess;
    pthread_mutex_unlock(&state_lock);
    return e;
}

const int MAX_THREADS = 1024;

} // namespace

#ifndef FITM_CUDA_EMU_THREADS

namespace
{

const size_t FIBER_STACK = 64 * 1024;

enum fiber_state { RUNNABLE, WAIT_SYNC, WAIT_SHFL, DONE };

struct fiber {
    fitm_emu_thread t;
    jmp_buf env;   /* where it yielded */
    ucontext_t uc; /* its first start */
    char *stack;   /* FIBER_STACK bytes, kept for the life of the process */
    bool started;  /* false: the next resume starts it afresh */
    fiber_state state;
    unsigned wait_gen; /* generation of the barrier or shuffle it waits on */
};

struct warp_state {
    unsigned gen;         /* completed shuffles */
    unsigned arrived;     /* lanes deposited in the current one */
    uint64_t slot[2][32]; /* values by shuffle parity: a lane two shuffles ahead is impossible */
};

/* Everything one launch's blocks share; one per host thread, reused across launches. */
struct block_runner {
    fiber fibers[MAX_THREADS]; /* never moves: started fibers point into their stacks */
    warp_state warps[MAX_THREADS / 32];
    std::vector<char> dyn_shared;
    jmp_buf sched;
    int n, live;
    unsigned sync_gen, sync_arrived;
    unsigned long progress; /* barriers and shuffles completed: waits that may have ended */
    void (*entry)(void *);
    void *entry_ctx;
};

thread_local block_runner *runner;

fiber *current(void)
{
    return (fiber *)fitm_emu_cur; /* t is the first member */
}

void yield_to_scheduler(void)
{
    if (!_setjmp(current()->env))
        _longjmp(runner->sched, 1);
}

/* A fiber's whole life: run the current launch's kernel for the current block, report done,
 * wait to be resumed for another block. */
void fiber_main(void)
{
    for (;;) {
        runner->entry(runner->entry_ctx);
        block_runner *r = runner;
        current()->state = DONE;
        r->live--;
        /* threads that have exited count as arrived at a barrier the others wait on */
        if (r->sync_arrived > 0 && r->sync_arrived == (unsigned)r->live) {
            r->sync_gen++;
            r->sync_arrived = 0;
            r->progress++;
        }
        yield_to_scheduler();
    }
}

void resume(block_runner *r, fiber *f)
{
    fitm_emu_cur = &f->t;
    if (_setjmp(r->sched))
        return; /* the fiber yielded */
    if (f->started)
        _longjmp(f->env, 1);
    f->started = true;
    if (!f->stack)
        f->stack = (char *)malloc(FIBER_STACK);
    if (!f->stack) {
        fprintf(stderr, "cuda_emu: out of memory for fiber stacks\n");
        abort();
    }
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = FIBER_STACK;
    f->uc.uc_link = NULL; /* fiber_main never returns */
    makecontext(&f->uc, fiber_main, 0);
    setcontext(&f->uc);
}

bool ready(const block_runner *r, const fiber *f, int i)
{
    switch (f->state) {
    case RUNNABLE:
        return true;
    case WAIT_SYNC:
        return r->sync_gen != f->wait_gen;
    case WAIT_SHFL:
        return r->warps[i / 32].gen != f->wait_gen;
    default:
        return false;
    }
}

/* Runs one block to completion; false on a deadlock. */
bool run_block(block_runner *r)
{
    for (int i = 0; i < r->n; i++) {
        fiber *f = &r->fibers[i];
        const unsigned bx = fitm_emu_block_dim.x, by = fitm_emu_block_dim.y;
        f->t.tid = {(unsigned)i % bx, (unsigned)i / bx % by, (unsigned)i / (bx * by)};
        f->state = RUNNABLE;
    }
    for (int w = 0; w < (r->n + 31) / 32; w++)
        r->warps[w].gen = r->warps[w].arrived = 0;
    r->live = r->n;
    r->sync_gen = r->sync_arrived = 0;
    /* The lowest-numbered ready fiber runs next. A fiber's readiness changes only when a barrier
     * or a shuffle completes (progress), so while none does, every fiber below the last one
     * picked stays unready and the search resumes where it stopped: one pass per barrier
     * instead of one per yield. */
    int first = 0, from = 0;
    while (r->live > 0) {
        while (r->fibers[first].state == DONE)
            first++;
        if (from < first)
            from = first;
        int pick = -1;
        for (int i = from; i < r->n && pick < 0; i++)
            if (ready(r, &r->fibers[i], i))
                pick = i;
        if (pick < 0) {
            for (int i = 0; i < r->n; i++) /* stuck mid-kernel: start afresh next time */
                r->fibers[i].started = r->fibers[i].started && r->fibers[i].state == DONE;
            return false;
        }
        fiber *f = &r->fibers[pick];
        f->state = RUNNABLE;
        const unsigned long before = r->progress;
        resume(r, f);
        from = r->progress == before ? pick : first;
    }
    return true;
}

/* Runs every block of a launch, one after another; false on a deadlock (*at: the block). */
bool run_grid(dim3 grid, dim3 block, size_t dyn_shared, void (*entry)(void *), void *ctx,
              uint3 *at)
{
    if (!runner)
        runner = new block_runner();
    block_runner *r = runner;
    r->n = (int)(block.x * block.y * block.z);
    r->dyn_shared.assign(dyn_shared, (char)0xA5);
    r->entry = entry;
    r->entry_ctx = ctx;
    fitm_emu_block_dim = block;
    fitm_emu_grid_dim = grid;
    bool ok = true;
    for (unsigned z = 0; z < grid.z && ok; z++)
        for (unsigned y = 0; y < grid.y && ok; y++)
            for (unsigned x = 0; x < grid.x && ok; x++) {
                fitm_emu_block_idx = *at = {x, y, z};
                ok = run_block(r);
            }
    fitm_emu_cur = nullptr;
    return ok;
}

} // namespace

void fitm_emu_syncthreads(void)
{
    block_runner *r = runner;
    fiber *f = current();
    f->wait_gen = r->sync_gen;
    if (++r->sync_arrived == (unsigned)r->live) {
        r->sync_gen++;
        r->sync_arrived = 0;
        r->progress++;
        return;
    }
    f->state = WAIT_SYNC;
    yield_to_scheduler();
}

uint64_t fitm_emu_shfl(unsigned mask, uint64_t bits, int src)
{
    block_runner *r = runner;
    fiber *f = current();
    const int i = (int)(f - r->fibers);
    warp_state *w = &r->warps[i / 32];
    const unsigned gen = w->gen, par = gen & 1u;
    w->slot[par][i % 32] = bits;
    if (++w->arrived == (unsigned)__builtin_popcount(mask)) {
        w->gen++;
        w->arrived = 0;
        r->progress++;
    } else {
        f->state = WAIT_SHFL;
        f->wait_gen = gen;
        yield_to_scheduler();
    }
    if (src < 0)
        return bits;
    if (!(mask >> src & 1u) || i / 32 * 32 + src >= r->n) {
        fprintf(stderr, "cuda_emu: shuffle from lane %d outside mask %08x\n", src, mask);
        abort();
    }
    return w->slot[par][src];
}

void *fitm_emu_dynamic_shared(void)
{
    return runner->dyn_shared.data();
}

#else /* FITM_CUDA_EMU_THREADS: one OS thread per CUDA thread */

namespace
{

/* A wait that ends in no progress for this long is a barrier or shuffle that some thread
 * never reaches: the fiber engine reports those as launch failures; here the process aborts. */
const int STALL_SECONDS = 300;

/* ThreadSanitizer orders two accesses when a thread releases a lock that the other thread
 * acquires later. So each kind of CUDA synchronisation has its own lock, taken only by the
 * threads CUDA synchronises there: a block's barrier (bar_mu: every thread of the block), a
 * warp's shuffle (its warp's mu: the lanes of that warp), atomics (atomic_mu). One lock for
 * everything would order, by the accident of who took it first, accesses that CUDA leaves
 * unordered, and hide the races this engine exists to show. pool.mu only starts and ends
 * blocks, outside the kernel's code. */
struct warp_sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned gen;         /* completed shuffles */
    unsigned arrived;     /* lanes deposited in the current one */
    uint64_t slot[2][32]; /* values by shuffle parity: a lane two shuffles ahead is impossible */
};

struct thread_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a block started or a thread finished */
    int n_workers;
    unsigned long block_gen; /* blocks started */
    int n, done;             /* the block's threads, those finished */
    unsigned long start_gen[MAX_THREADS]; /* block_gen when each worker was created */
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    std::vector<char> dyn_shared;
    void (*entry)(void *);
    void *ctx;
    pthread_mutex_t bar_mu;
    pthread_cond_t bar_cv;
    int live; /* threads of the block not finished (bar_mu) */
    unsigned sync_gen, sync_arrived;
    warp_sync warps[MAX_THREADS / 32];
    pthread_mutex_t atomic_mu;
};

thread_pool pool;
pthread_once_t pool_once = PTHREAD_ONCE_INIT;
thread_local fitm_emu_thread worker_self;
thread_local int worker_index;
thread_local void *worker_dyn_shared;
thread_local int worker_block_n;

void pool_init(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pthread_mutex_init(&pool.bar_mu, NULL);
    pthread_cond_init(&pool.bar_cv, NULL);
    pthread_mutex_init(&pool.atomic_mu, NULL);
    for (int w = 0; w < MAX_THREADS / 32; w++) {
        pthread_mutex_init(&pool.warps[w].mu, NULL);
        pthread_cond_init(&pool.warps[w].cv, NULL);
    }
}

/* Waits on cv with mu held; aborts after STALL_SECONDS without a wake-up. */
void wait_on(pthread_cond_t *cv, pthread_mutex_t *mu)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += STALL_SECONDS;
    if (pthread_cond_timedwait(cv, mu, &t) != 0) {
        fprintf(stderr, "cuda_emu (threads): no progress for %d s: a barrier or shuffle not "
                        "reached by every thread of a block\n", STALL_SECONDS);
        abort();
    }
}

/* A barrier every live thread has reached (or exited before) completes. bar_mu held. */
void sync_maybe_complete(void)
{
    if (pool.sync_arrived > 0 && pool.sync_arrived == (unsigned)pool.live) {
        pool.sync_gen++;
        pool.sync_arrived = 0;
        pthread_cond_broadcast(&pool.bar_cv);
    }
}

void *worker_main(void *arg)
{
    const int i = (int)(intptr_t)arg;
    worker_index = i;
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = pool.start_gen[i]; /* it runs every block started after that */
    for (;;) {
        while (pool.block_gen == seen || i >= pool.n)
            pthread_cond_wait(&pool.cv, &pool.mu);
        seen = pool.block_gen;
        const unsigned bx = pool.block_dim.x, by = pool.block_dim.y;
        worker_self.tid = {(unsigned)i % bx, (unsigned)i / bx % by, (unsigned)i / (bx * by)};
        fitm_emu_cur = &worker_self;
        fitm_emu_block_idx = pool.block_idx;
        fitm_emu_block_dim = pool.block_dim;
        fitm_emu_grid_dim = pool.grid_dim;
        worker_dyn_shared = pool.dyn_shared.data();
        worker_block_n = pool.n;
        void (*entry)(void *) = pool.entry;
        void *ctx = pool.ctx;
        pthread_mutex_unlock(&pool.mu);
        entry(ctx);
        pthread_mutex_lock(&pool.bar_mu);
        pool.live--;
        sync_maybe_complete(); /* exited threads count as arrived */
        pthread_mutex_unlock(&pool.bar_mu);
        pthread_mutex_lock(&pool.mu);
        pool.done++;
        pthread_cond_broadcast(&pool.cv);
    }
    return NULL;
}

bool run_grid(dim3 grid, dim3 block, size_t dyn_shared, void (*entry)(void *), void *ctx,
              uint3 *at)
{
    pthread_once(&pool_once, pool_init);
    const int n = (int)(block.x * block.y * block.z);
    pthread_mutex_lock(&pool.mu);
    pool.dyn_shared.assign(dyn_shared, (char)0xA5);
    pool.entry = entry;
    pool.ctx = ctx;
    pool.block_dim = block;
    pool.grid_dim = grid;
    while (pool.n_workers < n) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 1 << 20);
        pool.start_gen[pool.n_workers] = pool.block_gen;
        if (pthread_create(&t, &a, worker_main, (void *)(intptr_t)pool.n_workers) != 0) {
            fprintf(stderr, "cuda_emu (threads): cannot start thread %d\n", pool.n_workers);
            abort();
        }
        pthread_attr_destroy(&a);
        pool.n_workers++;
    }
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                pool.block_idx = *at = {x, y, z};
                pool.n = n;
                pool.done = 0;
                pthread_mutex_lock(&pool.bar_mu);
                pool.live = n;
                pool.sync_gen = pool.sync_arrived = 0;
                pthread_mutex_unlock(&pool.bar_mu);
                for (int w = 0; w < (n + 31) / 32; w++) {
                    pthread_mutex_lock(&pool.warps[w].mu);
                    pool.warps[w].gen = pool.warps[w].arrived = 0;
                    pthread_mutex_unlock(&pool.warps[w].mu);
                }
                pool.block_gen++;
                pthread_cond_broadcast(&pool.cv);
                while (pool.done < n)
                    wait_on(&pool.cv, &pool.mu);
            }
    pool.n = 0;
    pthread_mutex_unlock(&pool.mu);
    return true;
}

} // namespace

void fitm_emu_syncthreads(void)
{
    pthread_mutex_lock(&pool.bar_mu);
    const unsigned gen = pool.sync_gen;
    pool.sync_arrived++;
    sync_maybe_complete();
    while (pool.sync_gen == gen)
        wait_on(&pool.bar_cv, &pool.bar_mu);
    pthread_mutex_unlock(&pool.bar_mu);
}

uint64_t fitm_emu_shfl(unsigned mask, uint64_t bits, int src)
{
    const int i = worker_index;
    warp_sync *w = &pool.warps[i / 32];
    if (src >= 0 && (!(mask >> src & 1u) || i / 32 * 32 + src >= worker_block_n)) {
        fprintf(stderr, "cuda_emu: shuffle from lane %d outside mask %08x\n", src, mask);
        abort();
    }
    pthread_mutex_lock(&w->mu);
    const unsigned gen = w->gen, par = gen & 1u;
    w->slot[par][i % 32] = bits;
    if (++w->arrived == (unsigned)__builtin_popcount(mask)) {
        w->gen++;
        w->arrived = 0;
        pthread_cond_broadcast(&w->cv);
    } else {
        while (w->gen == gen)
            wait_on(&w->cv, &w->mu);
    }
    const uint64_t r = src < 0 ? bits : w->slot[par][src];
    pthread_mutex_unlock(&w->mu);
    return r;
}

void *fitm_emu_dynamic_shared(void)
{
    return worker_dyn_shared;
}

void fitm_emu_atomic_lock(void)
{
    pthread_mutex_lock(&pool.atomic_mu);
}

void fitm_emu_atomic_unlock(void)
{
    pthread_mutex_unlock(&pool.atomic_mu);
}

#endif

/* For tests of a whole process (fitmd_cuda_emu): while the file named by
 * FITM_CUDA_EMU_FAIL_LAUNCH_IF exists, the next launch fails with cudaErrorLaunchFailure (which
 * loses the context on a real device) and removes it, so a test can fail one launch of a running
 * daemon at a moment of its choosing. */
bool launch_fails_by_file(void)
{
    static const char *path = getenv("FITM_CUDA_EMU_FAIL_LAUNCH_IF");
    return path && *path && unlink(path) == 0;
}

cudaError_t fitm_emu_set_error(cudaError_t e)
{
    return set_error(e);
}

cudaError_t fitm_emu_take_launch_failure(void)
{
    run_pending_copies(); /* every launch and cuBLAS call starts here */
    const cudaError_t inj = take_injected(&injected_launch);
    return inj == cudaSuccess && launch_fails_by_file() ? cudaErrorLaunchFailure : inj;
}

void fitm_emu_run(dim3 grid, dim3 block, size_t dyn_shared, cudaStream_t, void (*entry)(void *),
                  void *ctx)
{
    const cudaError_t inj = fitm_emu_take_launch_failure();
    if (inj != cudaSuccess) {
        set_error(inj);
        return;
    }
    const long long n = (long long)block.x * block.y * block.z;
    if (n < 1 || n > MAX_THREADS || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        dyn_shared > 228 * 1024) {
        set_error(cudaErrorInvalidConfiguration);
        return;
    }
    pthread_mutex_lock(&launch_lock);
    uint3 at = {0, 0, 0};
    const bool ok = run_grid(grid, block, dyn_shared, entry, ctx, &at);
    pthread_mutex_unlock(&launch_lock);
    if (!ok) {
        fprintf(stderr,
                "cuda_emu: deadlock in block (%u,%u,%u): a barrier or shuffle not "
                "reached by every thread\n",
                at.x, at.y, at.z);
        set_error(cudaErrorLaunchFailure);
    }
}

/* ---- runtime API ---- */

extern "C" {

int fitm_emu_device_count(void)
{
    const char *v = getenv("FITM_CUDA_EMU_DEVICES");
    return v && *v ? atoi(v) : 1;
}

void fitm_emu_inject_error(const char *kind, cudaError_t e)
{
    pthread_mutex_lock(&state_lock);
    if (strcmp(kind, "malloc") == 0)
        injected_malloc = e;
    else if (strcmp(kind, "launch") == 0)
        injected_launch = e;
    pthread_mutex_unlock(&state_lock);
}

cudaError_t cudaGetDeviceCount(int *n)
{
    *n = fitm_emu_device_count();
    return *n > 0 ? cudaSuccess : set_error(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int dev)
{
    return dev >= 0 && dev < fitm_emu_device_count() ? cudaSuccess
                                                     : set_error(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int *dev)
{
    *dev = 0;
    return fitm_emu_device_count() > 0 ? cudaSuccess : set_error(cudaErrorNoDevice);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev)
{
    if (dev < 0 || dev >= fitm_emu_device_count())
        return set_error(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "fitm CUDA emulator (CPU)");
    p->totalGlobalMem = (size_t)4 << 30;
    p->major = 8;
    p->minor = 0;
    p->multiProcessorCount = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    run_pending_copies();
    return cudaPeekAtLastError();
}

cudaError_t cudaGetLastError(void)
{
    pthread_mutex_lock(&state_lock);
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    pthread_mutex_unlock(&state_lock);
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    pthread_mutex_lock(&state_lock);
    const cudaError_t e = last_error;
    pthread_mutex_unlock(&state_lock);
    return e;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define NAME(x)                                                                                    \
    case x:                                                                                        \
        return #x;
        NAME(cudaSuccess)
        NAME(cudaErrorInvalidValue)
        NAME(cudaErrorMemoryAllocation)
        NAME(cudaErrorInvalidConfiguration)
        NAME(cudaErrorNoDevice)
        NAME(cudaErrorInvalidDevice)
        NAME(cudaErrorECCUncorrectable)
        NAME(cudaErrorInvalidResourceHandle)
        NAME(cudaErrorNotReady)
        NAME(cudaErrorIllegalAddress)
        NAME(cudaErrorLaunchTimeout)
        NAME(cudaErrorContextIsDestroyed)
        NAME(cudaErrorAssert)
        NAME(cudaErrorHardwareStackError)
        NAME(cudaErrorIllegalInstruction)
        NAME(cudaErrorMisalignedAddress)
        NAME(cudaErrorInvalidAddressSpace)
        NAME(cudaErrorInvalidPc)
        NAME(cudaErrorLaunchFailure)
        NAME(cudaErrorUnknown)
#undef NAME
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    default:
        return cudaGetErrorName(e);
    }
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    *p = NULL;
    const cudaError_t inj = take_injected(&injected_malloc);
    if (inj != cudaSuccess)
        return set_error(inj);
    const size_t rounded = (bytes + 255) / 256 * 256;
    *p = aligned_alloc(256, rounded ? rounded : 256);
    return *p ? cudaSuccess : set_error(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void *p)
{
    run_pending_copies();
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) {
        pthread_mutex_lock(&copy_lock);
        pinned.push_back({(const char *)*p, bytes});
        pthread_mutex_unlock(&copy_lock);
    }
    return e;
}

cudaError_t cudaFreeHost(void *p)
{
    run_pending_copies();
    pthread_mutex_lock(&copy_lock);
    for (size_t i = 0; i < pinned.size(); i++)
        if (pinned[i].p == (const char *)p) {
            pinned.erase(pinned.begin() + (long)i);
            break;
        }
    pthread_mutex_unlock(&copy_lock);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = (size_t)4 << 30;
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind)
{
    run_pending_copies();
    if (bytes && (!dst || !src))
        return set_error(cudaErrorInvalidValue);
    if (bytes)
        memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t)
{
    if (bytes && dst && src && kind == cudaMemcpyHostToDevice) {
        pthread_mutex_lock(&copy_lock);
        const bool later = in_pinned(src, bytes);
        if (later)
            pending.push_back({dst, src, bytes});
        pthread_mutex_unlock(&copy_lock);
        if (later)
            return cudaSuccess;
    }
    return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void *dst, int value, size_t bytes)
{
    run_pending_copies();
    if (bytes && !dst)
        return set_error(cudaErrorInvalidValue);
    if (bytes)
        memset(dst, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t)
{
    return cudaMemset(dst, value, bytes);
}

struct fitm_emu_stream {
    unsigned flags;
};
struct fitm_emu_event {
    double t_ms;
};

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    *s = new fitm_emu_stream{flags};
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t)
{
    run_pending_copies();
    return cudaPeekAtLastError();
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new fitm_emu_event{0.0};
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    e->t_ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t)
{
    run_pending_copies();
    return cudaPeekAtLastError();
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    *ms = (float)(end->t_ms - start->t_ms);
    return cudaSuccess;
}

} // extern "C"
