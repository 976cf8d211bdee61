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
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucontext.h>

#include <atomic>
#include <map>
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

cudaError_t sticky_error = cudaSuccess; /* the context is lost: every call returns it */

cudaError_t set_error(cudaError_t e)
{
    pthread_mutex_lock(&state_lock);
    if (e != cudaSuccess)
        last_error = e;
    pthread_mutex_unlock(&state_lock);
    return e;
}

/* Loses the context: e is returned by every later call. */
cudaError_t lose_context(cudaError_t e)
{
    pthread_mutex_lock(&state_lock);
    if (sticky_error == cudaSuccess)
        sticky_error = e;
    last_error = e;
    pthread_mutex_unlock(&state_lock);
    return e;
}

cudaError_t sticky(void)
{
    pthread_mutex_lock(&state_lock);
    const cudaError_t e = sticky_error;
    pthread_mutex_unlock(&state_lock);
    return e;
}

/* What the emulated device was asked to do (fitm_emu_get_stats). */
fitm_emu_stats stats;

void count(unsigned long long fitm_emu_stats::*field)
{
    pthread_mutex_lock(&state_lock);
    stats.*field += 1;
    pthread_mutex_unlock(&state_lock);
}

/* The running launch (launches run one at a time): whether it is programmatic, and how many
 * of its threads have called fitm_grid_begin. */
bool launch_programmatic = false;
std::atomic<long long> launch_grid_begins{0};

/* A programmatic launch's thread that reaches `what` before fitm_grid_begin faults it. */
void grid_begun_before(const char *what)
{
    if (launch_programmatic && fitm_emu_cur && !fitm_emu_cur->grid_begun) {
        char m[160];
        snprintf(m, sizeof m,
                 "programmatic launch: thread (%u,%u,%u) reached %s before fitm_grid_begin",
                 fitm_emu_cur->tid.x, fitm_emu_cur->tid.y, fitm_emu_cur->tid.z, what);
        fitm_emu_kernel_fault(cudaErrorLaunchFailure, m);
    }
}

/* A thread that ends with asynchronous copies (cuda_pipeline.h) it never waited for faults its
 * launch: nothing orders what they write with any later read, so such a copy is either
 * wasted or a race. (A device does not fault it; the emulator is stricter here.) */
void async_end_check(void)
{
    if (fitm_emu_cur && fitm_emu_cur->n_async > 0) {
        char m[160];
        snprintf(m, sizeof m, "thread (%u,%u,%u) ended with %d asynchronous copies not waited for",
                 fitm_emu_cur->tid.x, fitm_emu_cur->tid.y, fitm_emu_cur->tid.z,
                 fitm_emu_cur->n_async);
        fitm_emu_kernel_fault(cudaErrorLaunchFailure, m);
        fitm_emu_cur->n_async = 0;
    }
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

/* Device allocations by start address: what a device pointer may point into. */
pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
std::map<uintptr_t, size_t> device_blocks;

/* Frees of device allocations so far: a thread's last allocation found (below) is still one
 * while this has not changed. */
std::atomic<unsigned long> device_frees{0};
struct found_block {
    uintptr_t p, n;
    unsigned long frees;
};
thread_local found_block last_found = {0, 0, ~0ul};

/* True when [p, p + n) lies in one device allocation or one pinned block; a pointer just past
 * an allocation's end is accepted for n 0 (an empty view). */
bool accessible(const void *p, size_t n)
{
    const uintptr_t a = (uintptr_t)p;
    /* a kernel's asynchronous copies ask about one allocation many times in a row */
    const found_block &l = last_found;
    if (a >= l.p && n <= l.n && a - l.p <= l.n - n && l.frees == device_frees.load())
        return true;
    pthread_mutex_lock(&mem_lock);
    auto it = device_blocks.upper_bound(a);
    bool in = it != device_blocks.begin() && (--it, a + n <= it->first + it->second);
    if (in)
        last_found = {it->first, it->second, device_frees.load()};
    pthread_mutex_unlock(&mem_lock);
    if (!in) {
        pthread_mutex_lock(&copy_lock);
        in = in_pinned(p, n);
        pthread_mutex_unlock(&copy_lock);
    }
    return in;
}

/* Kernels' opt-in dynamic shared memory (cudaFuncSetAttribute), by kernel. */
std::map<const void *, size_t> smem_optin;

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

/* A launch's dynamic shared memory, 128-byte aligned as a device's shared window is (WMMA
 * loads and stores need 32 bytes): filled with 0xA5 so reads of unwritten bytes show. */
struct dyn_shared_buf {
    std::vector<char> bytes;
    char *p = nullptr;
    size_t n = 0;
    void assign(size_t size)
    {
        bytes.assign(size + 128, (char)0xA5);
        p = bytes.data() + (128 - (uintptr_t)bytes.data() % 128) % 128;
        n = size;
    }
};

/* What the threads of the running block asked of warp collectives (WMMA's load, store and
 * mma): per thread a count and a running signature of the calls' arguments. At the block's
 * end every lane of a warp must have made the same calls (collective_check). */
struct collective_log {
    unsigned n[MAX_THREADS];
    uint64_t sig[MAX_THREADS];
    void reset(int threads)
    {
        memset(n, 0, sizeof n[0] * (size_t)threads);
        memset(sig, 0, sizeof sig[0] * (size_t)threads);
    }
    void add(int i, uint64_t s)
    {
        n[i]++;
        sig[i] = sig[i] * 0x100000001b3ull ^ s;
    }
};

void kernel_fault(cudaError_t e, const char *what);

/* Faults the launch when some lane of a warp of this block (threads, uint3 at: its index)
 * made other collective calls than lane 0 of its warp. */
void collective_check(const collective_log &log, int threads, uint3 at)
{
    for (int i = 0; i < threads; i++) {
        const int first = i / 32 * 32;
        if (log.n[i] != log.n[first] || log.sig[i] != log.sig[first]) {
            char what[256];
            snprintf(what, sizeof what,
                     "block (%u,%u,%u): thread %d made %u warp collective calls, lane 0 of its "
                     "warp %u or with other arguments (every lane must call each one alike)",
                     at.x, at.y, at.z, i, log.n[i], log.n[first]);
            kernel_fault(cudaErrorLaunchFailure, what);
            return;
        }
    }
}

} // namespace

#ifndef FITM_CUDA_EMU_THREADS

namespace
{

const size_t FIBER_STACK = 64 * 1024;
/* Fiber i's stack ends (i % 128) * 64 bytes below the end of its allocation: stacks of one size
 * at one stride would put every fiber's top frames in the same few cache sets, and a block's
 * fibers resume one after another. */
const size_t FIBER_STAGGER = 128 * 64;

enum fiber_state { RUNNABLE, WAIT_SYNC, WAIT_SHFL, DONE };

struct fiber {
    fitm_emu_thread t;
    jmp_buf env;  /* where it yielded */
    char *stack;  /* FIBER_STACK + FIBER_STAGGER bytes, kept for the life of the process */
    bool started; /* false: the next resume starts it afresh */
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
    dyn_shared_buf dyn_shared;
    collective_log collectives;
    jmp_buf sched;
    int n, live;
    unsigned sync_gen, sync_arrived;
    int wake; /* the lowest fiber a completed barrier or shuffle may have made ready since the
                 last pick (INT_MAX: none completed) */
    void (*entry)(void *);
    void *entry_ctx;
};

thread_local block_runner *runner;

fiber *current(void)
{
    return (fiber *)fitm_emu_cur; /* t is the first member */
}

bool ready(const block_runner *r, const fiber *f, int i);

/* Parks the current fiber (its state set by the caller) and runs the next. When nothing
 * completed since the scheduler picked, every fiber below this one is still not ready (the
 * pick was the lowest ready one, and only a completed barrier or shuffle readies a fiber), so
 * the scheduler would pick the first ready fiber above it: when that is the next one and it
 * has run before, the switch goes straight to it, one jump instead of two. */
void yield_to_scheduler(void)
{
    fiber *f = current();
    if (_setjmp(f->env))
        return;
    block_runner *r = runner;
    const int next = (int)(f - r->fibers) + 1;
    if (r->wake == INT_MAX && next < r->n) {
        fiber *g = &r->fibers[next];
        if (g->started && ready(r, g, next)) {
            g->state = RUNNABLE;
            fitm_emu_cur = &g->t;
            _longjmp(g->env, 1);
        }
    }
    _longjmp(r->sched, 1);
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
            r->wake = 0;
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
        f->stack = (char *)malloc(FIBER_STACK + FIBER_STAGGER);
    if (!f->stack) {
        fprintf(stderr, "cuda_emu: out of memory for fiber stacks\n");
        abort();
    }
    ucontext_t uc; /* read only by setcontext */
    getcontext(&uc);
    uc.uc_stack.ss_sp = f->stack;
    uc.uc_stack.ss_size = FIBER_STACK + FIBER_STAGGER - (size_t)(f - r->fibers) % 128 * 64;
    uc.uc_link = NULL; /* fiber_main never returns */
    makecontext(&uc, fiber_main, 0);
    setcontext(&uc);
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
        f->t.grid_begun = false;
        f->t.n_async = 0;
        f->t.commits = 0;
        f->state = RUNNABLE;
    }
    for (int w = 0; w < (r->n + 31) / 32; w++)
        r->warps[w].gen = r->warps[w].arrived = 0;
    r->live = r->n;
    r->sync_gen = r->sync_arrived = 0;
    r->collectives.reset(r->n);
    /* The lowest-numbered ready fiber runs next. A fiber's readiness changes only when a barrier
     * or a shuffle completes, so every fiber below the last one picked stays unready unless
     * one did: a barrier may wake any fiber, a shuffle only its warp's lanes (wake), and the
     * search resumes at the lowest of those or where it stopped: one pass per barrier instead
     * of one per yield, and a warp's shuffles do not rescan the warps blocked below it. */
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
        r->wake = INT_MAX;
        resume(r, f);
        from = r->wake < pick ? r->wake : pick;
    }
    collective_check(r->collectives, r->n, fitm_emu_block_idx);
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
    r->dyn_shared.assign(dyn_shared);
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
    grid_begun_before("a barrier");
    block_runner *r = runner;
    fiber *f = current();
    f->wait_gen = r->sync_gen;
    if (++r->sync_arrived == (unsigned)r->live) {
        r->sync_gen++;
        r->sync_arrived = 0;
        r->wake = 0;
        return;
    }
    f->state = WAIT_SYNC;
    yield_to_scheduler();
}

uint64_t fitm_emu_shfl(unsigned mask, uint64_t bits, int src)
{
    grid_begun_before("a shuffle");
    block_runner *r = runner;
    fiber *f = current();
    const int i = (int)(f - r->fibers);
    warp_state *w = &r->warps[i / 32];
    const unsigned gen = w->gen, par = gen & 1u;
    w->slot[par][i % 32] = bits;
    if (++w->arrived == (unsigned)__builtin_popcount(mask)) {
        w->gen++;
        w->arrived = 0;
        if (i / 32 * 32 < r->wake) /* only this warp's lanes wait on it */
            r->wake = i / 32 * 32;
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
    grid_begun_before("its dynamic shared memory");
    return runner->dyn_shared.p;
}

bool fitm_emu_shared_range(const void *p, size_t n)
{
    const char *a = (const char *)p, *base = runner->dyn_shared.p;
    const size_t size = runner->dyn_shared.n;
    return a >= base && n <= size && (size_t)(a - base) <= size - n;
}

void fitm_emu_warp_collective(uint64_t sig)
{
    grid_begun_before("a warp collective");
    runner->collectives.add((int)(current() - runner->fibers), sig);
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
    dyn_shared_buf dyn_shared;
    collective_log collectives; /* each thread writes its own entry; read after the block */
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
        worker_self.grid_begun = false;
        worker_self.n_async = 0;
        worker_self.commits = 0;
        fitm_emu_cur = &worker_self;
        fitm_emu_block_idx = pool.block_idx;
        fitm_emu_block_dim = pool.block_dim;
        fitm_emu_grid_dim = pool.grid_dim;
        worker_dyn_shared = pool.dyn_shared.p;
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
    pool.dyn_shared.assign(dyn_shared);
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
                pool.collectives.reset(n);
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
                collective_check(pool.collectives, n, *at);
            }
    pool.n = 0;
    pthread_mutex_unlock(&pool.mu);
    return true;
}

} // namespace

void fitm_emu_syncthreads(void)
{
    grid_begun_before("a barrier");
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
    grid_begun_before("a shuffle");
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
    grid_begun_before("its dynamic shared memory");
    return worker_dyn_shared;
}

bool fitm_emu_shared_range(const void *p, size_t n)
{
    const char *a = (const char *)p, *base = (const char *)worker_dyn_shared;
    const size_t size = pool.dyn_shared.n; /* not written while the block runs */
    return a >= base && n <= size && (size_t)(a - base) <= size - n;
}

void fitm_emu_warp_collective(uint64_t sig)
{
    grid_begun_before("a warp collective");
    pool.collectives.add(worker_index, sig);
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

namespace
{
cudaError_t launch_fault = cudaSuccess; /* the running launch's first fault (state_lock) */

void kernel_fault(cudaError_t e, const char *what)
{
    pthread_mutex_lock(&state_lock);
    const bool first = launch_fault == cudaSuccess;
    if (first)
        launch_fault = e;
    pthread_mutex_unlock(&state_lock);
    if (first)
        fprintf(stderr, "cuda_emu: %s: %s; the context is lost\n", cudaGetErrorName(e), what);
}
} // namespace

void fitm_emu_kernel_fault(cudaError_t e, const char *what)
{
    kernel_fault(e, what);
}

cudaError_t fitm_emu_lose_context(cudaError_t e)
{
    return lose_context(e);
}

cudaError_t fitm_emu_take_launch_failure(void)
{
    run_pending_copies(); /* every launch and cuBLAS call starts here */
    const cudaError_t st = sticky();
    if (st != cudaSuccess)
        return st;
    const cudaError_t inj = take_injected(&injected_launch);
    return inj == cudaSuccess && launch_fails_by_file() ? cudaErrorLaunchFailure : inj;
}

bool fitm_emu_device_accessible(const void *p)
{
    return !p || accessible(p, 0);
}

bool fitm_emu_device_range(const void *p, size_t n)
{
    return p && accessible(p, n);
}

void fitm_emu_args_check::ptr(const void *p)
{
    if (p && bad_arg < 0 && !accessible(p, 0)) {
        bad = p;
        bad_arg = arg;
    }
}

namespace
{

/* The device's limits: those of an sm_80 part, the smallest shared-memory opt-in of the parts
 * the backend is tuned for. The emulator reports compute capability 9.0 (an H100's or H200's),
 * so the backend's programmatic launches (kernels/common.cuh) run, and are checked, here. */
const size_t SMEM_DEFAULT = 48 * 1024, SMEM_OPTIN_MAX = 163 * 1024;
const unsigned GRID_YZ_MAX = 65535;

/* A graph's operation: what kind (for cudaGraphExecUpdate's topology check), the kernel of a
 * launch, the work with its arguments, and a copy's host side (pinned when it was captured;
 * a launch whose copy's pinned memory has been freed since is refused, as a device refuses
 * it). */
enum op_kind { OP_KERNEL, OP_COPY, OP_MEMSET, OP_BLAS, OP_GRAPH };
struct graph_op {
    op_kind kind;
    const void *kernel;
    std::function<void()> run;
    const void *host;
    size_t host_bytes;
};

/* Records run into st's graph while st is captured (true), else false (run it now); host and
 * host_bytes: a copy's host side. */
bool record(cudaStream_t st, op_kind kind, const void *kernel, std::function<void()> run,
            const void *host = nullptr, size_t host_bytes = 0);
/* A host wait for the device (defined with the streams). */
cudaError_t host_wait(cudaStream_t st);
/* True (and the captures concerned invalidated) when a capture under way forbids this thread
 * a call that is unsafe during a capture: a wait, an allocation or a free. */
bool capture_forbids(void);

/* Runs one launch now: the checks, then every block. */
void run_launch(dim3 grid, dim3 block, size_t dyn_shared, const void *kernel,
                const std::function<void(fitm_emu_args_check &)> &check,
                const std::function<void()> &body, bool programmatic)
{
    const cudaError_t inj = fitm_emu_take_launch_failure();
    if (inj != cudaSuccess) {
        set_error(inj);
        return;
    }
    size_t smem_max = SMEM_DEFAULT;
    pthread_mutex_lock(&state_lock);
    auto opt = smem_optin.find(kernel);
    if (opt != smem_optin.end() && opt->second > smem_max)
        smem_max = opt->second;
    pthread_mutex_unlock(&state_lock);
    const long long n = (long long)block.x * block.y * block.z;
    if (n < 1 || n > MAX_THREADS || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.y > GRID_YZ_MAX || grid.z > GRID_YZ_MAX || dyn_shared > smem_max) {
        fprintf(stderr,
                "cuda_emu: launch refused: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of "
                "dynamic shared memory (this kernel's limit %zu)\n",
                grid.x, grid.y, grid.z, block.x, block.y, block.z, dyn_shared, smem_max);
        set_error(cudaErrorInvalidConfiguration);
        return;
    }
    fitm_emu_args_check c;
    c.grid = grid;
    check(c);
    if (c.bad_arg >= 0) {
        fprintf(stderr,
                "cuda_emu: illegal address: launch argument %d (%p) is not device memory; "
                "the context is lost\n",
                c.bad_arg, c.bad);
        lose_context(cudaErrorIllegalAddress);
        return;
    }
    count(&fitm_emu_stats::kernels_run);
    if (programmatic)
        count(&fitm_emu_stats::programmatic);
    if (fitm_emu_host_only())
        return;
    pthread_mutex_lock(&launch_lock);
    pthread_mutex_lock(&state_lock);
    launch_fault = cudaSuccess;
    pthread_mutex_unlock(&state_lock);
    launch_programmatic = programmatic;
    launch_grid_begins = 0;
    uint3 at = {0, 0, 0};
    const bool ok = run_grid(
        grid, block, dyn_shared,
        [](void *p) {
            (*(const std::function<void()> *)p)();
            async_end_check();
        },
        (void *)&body, &at);
    const long long threads = n * grid.x * grid.y * grid.z;
    if (ok && programmatic && launch_grid_begins != threads) {
        char m[160];
        snprintf(m, sizeof m, "programmatic launch: %lld of its %lld threads ended without "
                 "fitm_grid_begin", threads - launch_grid_begins.load(), threads);
        kernel_fault(cudaErrorLaunchFailure, m);
    }
    launch_programmatic = false;
    pthread_mutex_lock(&state_lock);
    const cudaError_t fault = launch_fault;
    pthread_mutex_unlock(&state_lock);
    pthread_mutex_unlock(&launch_lock);
    if (fault != cudaSuccess) {
        lose_context(fault);
        return;
    }
    if (!ok) {
        fprintf(stderr,
                "cuda_emu: deadlock in block (%u,%u,%u): a barrier or shuffle not "
                "reached by every thread\n",
                at.x, at.y, at.z);
        set_error(cudaErrorLaunchFailure);
    }
}

} // namespace

void fitm_emu_launch_body(dim3 grid, dim3 block, size_t dyn_shared, cudaStream_t st,
                          const void *kernel, std::function<void(fitm_emu_args_check &)> check,
                          std::function<void()> body, bool programmatic)
{
    if (record(st, OP_KERNEL, kernel, [=]() {
            run_launch(grid, block, dyn_shared, kernel, check, body, programmatic);
        }))
        return;
    count(&fitm_emu_stats::launches);
    run_launch(grid, block, dyn_shared, kernel, check, body, programmatic);
}

void fitm_emu_grid_begin(void)
{
    if (fitm_emu_cur && !fitm_emu_cur->grid_begun) {
        fitm_emu_cur->grid_begun = true;
        launch_grid_begins++;
    }
}

cudaError_t fitm_emu_enqueue(cudaStream_t st, std::function<cudaError_t()> op)
{
    if (record(st, OP_BLAS, nullptr, [op]() {
            const cudaError_t e = op();
            if (e != cudaSuccess)
                set_error(e);
        }))
        return sticky();
    count(&fitm_emu_stats::blas_calls);
    return op();
}

cudaError_t fitm_emu_func_set_attribute(const void *kernel, int attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
        (size_t)value > SMEM_OPTIN_MAX)
        return set_error(cudaErrorInvalidValue);
    pthread_mutex_lock(&state_lock);
    smem_optin[kernel] = (size_t)value;
    pthread_mutex_unlock(&state_lock);
    return cudaSuccess;
}

bool fitm_emu_host_only(void)
{
    const char *v = getenv("FITM_CUDA_EMU_HOST_ONLY");
    return v && *v && strcmp(v, "0") != 0;
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
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 1;
    p->sharedMemPerBlock = SMEM_DEFAULT;
    p->sharedMemPerBlockOptin = SMEM_OPTIN_MAX;
    p->maxThreadsPerBlock = MAX_THREADS;
    p->maxGridSize[0] = 0x7fffffff;
    p->maxGridSize[1] = p->maxGridSize[2] = (int)GRID_YZ_MAX;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev)
{
    if (dev < 0 || dev >= fitm_emu_device_count())
        return set_error(cudaErrorInvalidDevice);
    struct cudaDeviceProp p;
    cudaGetDeviceProperties(&p, dev);
    switch (attr) {
    case cudaDevAttrMultiProcessorCount:
        *value = p.multiProcessorCount;
        return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
        *value = (int)p.sharedMemPerBlockOptin;
        return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
        *value = p.major;
        return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
        *value = p.minor;
        return cudaSuccess;
    }
    return set_error(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceSynchronize(void)
{
    return host_wait(nullptr);
}

cudaError_t cudaGetLastError(void)
{
    pthread_mutex_lock(&state_lock);
    const cudaError_t e = last_error;
    if (sticky_error == cudaSuccess)
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
        NAME(cudaErrorStreamCaptureUnsupported)
        NAME(cudaErrorStreamCaptureInvalidated)
        NAME(cudaErrorStreamCaptureWrongThread)
        NAME(cudaErrorGraphExecUpdateFailure)
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
    if (sticky())
        return sticky();
    if (capture_forbids())
        return set_error(cudaErrorStreamCaptureUnsupported);
    const cudaError_t inj = take_injected(&injected_malloc);
    if (inj != cudaSuccess)
        return set_error(inj);
    const size_t rounded = (bytes + 255) / 256 * 256;
    *p = aligned_alloc(256, rounded ? rounded : 256);
    if (!*p)
        return set_error(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&mem_lock);
    device_blocks[(uintptr_t)*p] = bytes;
    pthread_mutex_unlock(&mem_lock);
    count(&fitm_emu_stats::mallocs);
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (capture_forbids())
        return set_error(cudaErrorStreamCaptureUnsupported);
    run_pending_copies();
    if (!p)
        return sticky();
    pthread_mutex_lock(&mem_lock);
    const bool known = device_blocks.erase((uintptr_t)p) == 1;
    device_frees++;
    pthread_mutex_unlock(&mem_lock);
    if (!known)
        return set_error(cudaErrorInvalidValue);
    free(p);
    count(&fitm_emu_stats::frees);
    return sticky();
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    *p = NULL;
    if (sticky())
        return sticky();
    if (capture_forbids())
        return set_error(cudaErrorStreamCaptureUnsupported);
    const size_t rounded = (bytes + 255) / 256 * 256;
    *p = aligned_alloc(256, rounded ? rounded : 256);
    if (!*p)
        return set_error(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&copy_lock);
    pinned.push_back({(const char *)*p, bytes});
    pthread_mutex_unlock(&copy_lock);
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    if (capture_forbids())
        return set_error(cudaErrorStreamCaptureUnsupported);
    run_pending_copies();
    if (!p)
        return sticky();
    bool known = false;
    pthread_mutex_lock(&copy_lock);
    for (size_t i = 0; i < pinned.size(); i++)
        if (pinned[i].p == (const char *)p) {
            pinned.erase(pinned.begin() + (long)i);
            known = true;
            break;
        }
    pthread_mutex_unlock(&copy_lock);
    if (!known)
        return set_error(cudaErrorInvalidValue);
    free(p);
    return sticky();
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = (size_t)4 << 30;
    return sticky();
}

} // extern "C"

/* ---- streams and graphs ---- */

struct fitm_emu_stream {
    unsigned flags;
    bool capturing, invalidated;
    cudaStreamCaptureMode mode;
    pthread_t thread;           /* that began the capture */
    std::vector<graph_op> ops; /* of the capture under way */
};
struct fitm_emu_event {
    double t_ms;
};
struct fitm_emu_graph {
    std::vector<graph_op> ops;
};
struct fitm_emu_graph_exec {
    std::vector<graph_op> ops;
};

namespace
{

/* Streams being captured (capture is per stream; the legacy stream NULL is never captured). */
pthread_mutex_t capture_lock = PTHREAD_MUTEX_INITIALIZER;
int n_capturing;
std::vector<cudaStream_t> capturing_streams;

bool record(cudaStream_t st, op_kind kind, const void *kernel, std::function<void()> run,
            const void *host, size_t host_bytes)
{
    if (!st)
        return false;
    pthread_mutex_lock(&capture_lock);
    const bool rec = st->capturing;
    if (rec)
        st->ops.push_back({kind, kernel, std::move(run), host, host_bytes});
    pthread_mutex_unlock(&capture_lock);
    return rec;
}

/* A call that waits for the device, refused as a device refuses it during a capture: from
 * any thread while a capture in the global mode is under way, from the capturing thread in
 * the thread-local mode (the relaxed mode allows it); the captures it concerns are
 * invalidated. Otherwise the pending copies run and the error so far is returned. */
bool capture_forbids(void)
{
    bool refused = false;
    pthread_mutex_lock(&capture_lock);
    for (cudaStream_t s : capturing_streams)
        if (s->mode == cudaStreamCaptureModeGlobal ||
            (s->mode == cudaStreamCaptureModeThreadLocal &&
             pthread_equal(s->thread, pthread_self()))) {
            s->invalidated = true;
            refused = true;
        }
    pthread_mutex_unlock(&capture_lock);
    return refused;
}

cudaError_t host_wait(cudaStream_t)
{
    if (capture_forbids())
        return set_error(cudaErrorStreamCaptureUnsupported);
    count(&fitm_emu_stats::host_waits);
    run_pending_copies();
    return cudaPeekAtLastError();
}

/* The device side of a copy of n bytes (kind) must be device memory; cudaMemcpyDefault lets
 * the pointers say, as unified addressing does. */
bool copy_sides_ok(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    const bool d_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool s_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    return (!d_dev || accessible(dst, n)) && (!s_dev || accessible(src, n));
}

cudaError_t illegal_copy(const char *what, void *dst, const void *src, size_t n)
{
    fprintf(stderr,
            "cuda_emu: illegal address: %s of %zu bytes from %p to %p touches memory that is "
            "not the device's; the context is lost\n",
            what, n, src, dst);
    return lose_context(cudaErrorIllegalAddress);
}

cudaError_t copy_now(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    run_pending_copies();
    if (sticky())
        return sticky();
    if (bytes && (!dst || !src))
        return set_error(cudaErrorInvalidValue);
    if (!copy_sides_ok(dst, src, bytes, kind))
        return illegal_copy("a copy", dst, src, bytes);
    if (bytes)
        memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t memset_now(void *dst, int value, size_t bytes)
{
    run_pending_copies();
    if (sticky())
        return sticky();
    if (bytes && !dst)
        return set_error(cudaErrorInvalidValue);
    if (bytes && !accessible(dst, bytes))
        return illegal_copy("a memset", dst, nullptr, bytes);
    if (bytes)
        memset(dst, value, bytes);
    return cudaSuccess;
}

} // namespace

extern "C" {

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    const cudaError_t w = host_wait(nullptr);
    if (w == cudaErrorStreamCaptureUnsupported)
        return w;
    count(&fitm_emu_stats::copies);
    return copy_now(dst, src, bytes, kind);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s)
{
    /* a graph copies from or to host memory only where it is pinned (a pageable buffer may be
     * gone by the replay): such a copy breaks the capture */
    const void *host_side = kind == cudaMemcpyHostToDevice   ? src
                            : kind == cudaMemcpyDeviceToHost ? (const void *)dst
                                                             : nullptr;
    if (s && s->capturing && host_side && bytes) {
        pthread_mutex_lock(&copy_lock);
        const bool pin = in_pinned(host_side, bytes);
        pthread_mutex_unlock(&copy_lock);
        if (!pin) {
            pthread_mutex_lock(&capture_lock);
            s->invalidated = true;
            pthread_mutex_unlock(&capture_lock);
            return set_error(cudaErrorStreamCaptureUnsupported);
        }
    }
    if (record(
            s, OP_COPY, nullptr,
            [=]() {
                const cudaError_t e = copy_now(dst, src, bytes, kind);
                (void)e; /* recorded by copy_now */
            },
            host_side, host_side ? bytes : 0))
        return sticky();
    count(&fitm_emu_stats::copies);
    if (sticky())
        return sticky();
    if (bytes && dst && src && kind == cudaMemcpyHostToDevice) {
        if (!accessible(dst, bytes))
            return illegal_copy("an asynchronous copy", dst, src, bytes);
        pthread_mutex_lock(&copy_lock);
        const bool later = in_pinned(src, bytes);
        if (later)
            pending.push_back({dst, src, bytes});
        pthread_mutex_unlock(&copy_lock);
        if (later)
            return cudaSuccess;
    }
    return copy_now(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void *dst, int value, size_t bytes)
{
    const cudaError_t w = host_wait(nullptr);
    if (w == cudaErrorStreamCaptureUnsupported)
        return w;
    count(&fitm_emu_stats::copies);
    return memset_now(dst, value, bytes);
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s)
{
    if (record(s, OP_MEMSET, nullptr, [=]() { (void)memset_now(dst, value, bytes); }))
        return sticky();
    count(&fitm_emu_stats::copies);
    return memset_now(dst, value, bytes);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    *s = new fitm_emu_stream{flags, false, false, cudaStreamCaptureModeGlobal, pthread_self(), {}};
    return sticky();
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (s && s->capturing) {
        pthread_mutex_lock(&capture_lock);
        n_capturing--;
        for (size_t i = 0; i < capturing_streams.size(); i++)
            if (capturing_streams[i] == s)
                capturing_streams.erase(capturing_streams.begin() + (long)i);
        pthread_mutex_unlock(&capture_lock);
    }
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    return host_wait(s);
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new fitm_emu_event{0.0};
    return sticky();
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
    return sticky();
}

cudaError_t cudaEventSynchronize(cudaEvent_t)
{
    return host_wait(nullptr);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    *ms = (float)(end->t_ms - start->t_ms);
    return sticky();
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode)
{
    if (!s)
        return set_error(cudaErrorStreamCaptureUnsupported); /* the legacy stream */
    if (sticky())
        return sticky();
    pthread_mutex_lock(&capture_lock);
    const bool already = s->capturing;
    if (!already) {
        s->capturing = true;
        s->invalidated = false;
        s->mode = mode;
        s->thread = pthread_self();
        s->ops.clear();
        n_capturing++;
        capturing_streams.push_back(s);
    }
    pthread_mutex_unlock(&capture_lock);
    return already ? set_error(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph)
{
    *graph = NULL;
    if (!s)
        return set_error(cudaErrorInvalidValue);
    pthread_mutex_lock(&capture_lock);
    const bool was = s->capturing, broken = s->invalidated;
    std::vector<graph_op> ops;
    if (was) {
        s->capturing = false;
        ops.swap(s->ops);
        n_capturing--;
        for (size_t i = 0; i < capturing_streams.size(); i++)
            if (capturing_streams[i] == s)
                capturing_streams.erase(capturing_streams.begin() + (long)i);
    }
    pthread_mutex_unlock(&capture_lock);
    if (!was)
        return set_error(cudaErrorInvalidValue);
    if (broken)
        return set_error(cudaErrorStreamCaptureInvalidated);
    *graph = new fitm_emu_graph{std::move(ops)};
    return sticky();
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status)
{
    pthread_mutex_lock(&capture_lock);
    *status = !s || !s->capturing ? cudaStreamCaptureStatusNone
              : s->invalidated    ? cudaStreamCaptureStatusInvalidated
                                  : cudaStreamCaptureStatusActive;
    pthread_mutex_unlock(&capture_lock);
    return sticky();
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long)
{
    *exec = NULL;
    if (!graph)
        return set_error(cudaErrorInvalidValue);
    if (sticky())
        return sticky();
    *exec = new fitm_emu_graph_exec{graph->ops};
    return cudaSuccess;
}

/* Runs the instance's operations in order, unless one of its copies' pinned host memory was
 * freed since the capture: a device refuses such a launch (cudaErrorInvalidValue, the context
 * kept), and so does this. */
static cudaError_t run_instance(const fitm_emu_graph_exec *exec)
{
    pthread_mutex_lock(&copy_lock);
    const graph_op *gone = nullptr;
    for (const graph_op &op : exec->ops)
        if (!gone && op.kind == OP_COPY && op.host_bytes && !in_pinned(op.host, op.host_bytes))
            gone = &op;
    pthread_mutex_unlock(&copy_lock);
    if (gone) {
        fprintf(stderr,
                "cuda_emu: graph launch refused: a copy of %zu bytes to or from %p, pinned memory "
                "when the graph was captured, is no longer pinned memory\n",
                gone->host_bytes, gone->host);
        return set_error(cudaErrorInvalidValue);
    }
    for (const graph_op &op : exec->ops)
        op.run();
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s)
{
    if (!exec)
        return set_error(cudaErrorInvalidValue);
    if (record(s, OP_GRAPH, exec, [exec]() { (void)run_instance(exec); }))
        return sticky();
    if (sticky())
        return sticky();
    const cudaError_t e = run_instance(exec);
    if (e != cudaSuccess)
        return e;
    count(&fitm_emu_stats::graph_launches);
    return sticky();
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *n)
{
    if (!graph || !n || nodes)
        return set_error(cudaErrorInvalidValue); /* only the count is emulated */
    *n = graph->ops.size();
    return cudaSuccess;
}

cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info)
{
    if (info)
        memset(info, 0, sizeof *info);
    if (!exec || !graph)
        return set_error(cudaErrorInvalidValue);
    bool same = exec->ops.size() == graph->ops.size();
    for (size_t i = 0; same && i < graph->ops.size(); i++)
        same = exec->ops[i].kind == graph->ops[i].kind &&
               exec->ops[i].kernel == graph->ops[i].kernel;
    if (!same) {
        if (info)
            info->result = cudaGraphExecUpdateErrorTopologyChanged;
        return set_error(cudaErrorGraphExecUpdateFailure);
    }
    exec->ops = graph->ops; /* the same operations with this graph's arguments */
    if (info)
        info->result = cudaGraphExecUpdateSuccess;
    return sticky();
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    delete graph;
    return cudaSuccess;
}

void fitm_emu_reset_device(void)
{
    run_pending_copies();
    pthread_mutex_lock(&state_lock);
    sticky_error = last_error = cudaSuccess;
    pthread_mutex_unlock(&state_lock);
}

void fitm_emu_get_stats(fitm_emu_stats *out)
{
    pthread_mutex_lock(&state_lock);
    *out = stats;
    pthread_mutex_unlock(&state_lock);
}

} // extern "C"
