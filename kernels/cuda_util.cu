/* cuda_util: host helpers around launcher return codes and device discovery. */
#include <stdio.h>

#include <mutex>
#include <new>
#include <vector>

#include <cuda_runtime.h>

#include "common.cuh"
#include "kernels.h"

extern "C" fitm_status fitm_cuda_status(int rc, fitm_err *err, const char *what)
{
    if (rc == (int)cudaSuccess)
        return FITM_OK;
    fitm_status s = FITM_ERR_BACKEND;
    if (rc == (int)cudaErrorMemoryAllocation)
        s = FITM_ERR_NOMEM;
    else if (rc == (int)cudaErrorInvalidValue)
        s = FITM_ERR_INVALID;
    /* snprintf rather than fitm_err_set: fitm_core links this library, not the reverse */
    if (err)
        snprintf(err->msg, sizeof err->msg, "%s%s%s", what ? what : "", what ? ": " : "",
                 fitm_cuda_error_string(rc));
    return s;
}

extern "C" const char *fitm_cuda_error_string(int rc)
{
    static thread_local char buf[256];
    const cudaError_t e = (cudaError_t)rc;
    snprintf(buf, sizeof buf, "%s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    return buf;
}

extern "C" bool fitm_cuda_error_is_sticky(int rc)
{
    switch ((cudaError_t)rc) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
        return true;
    default:
        return false;
    }
}

extern "C" int fitm_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear it so later calls do not see it */
        return 0;
    }
    return n;
}

/* ---- tapes ----
 *
 * A tape is a list of tape items with their argument bytes. A stream has at most one tape at
 * a time, found through a table of streams (sessions): a launcher looks its stream up only
 * while fitm_tapes_on is not 0. The table changes under a lock, and a session's stream is
 * published last, so a launcher of another stream (another thread's backend) reads a whole
 * entry or none; a session's other fields are read and written by the thread that drives its
 * stream only (kernels.h). */

struct fitm_cuda_tape {
    std::vector<fitm_tape_item> items;
    std::vector<unsigned char> bytes;
    bool lost = false; /* an append ran out of memory: the tape is incomplete */

    void append(const fitm_tape_item &it, const unsigned char *args)
    {
        if (lost)
            return;
        try {
            fitm_tape_item c = it;
            c.arg_at = bytes.size();
            if (it.arg_bytes)
                bytes.insert(bytes.end(), args, args + it.arg_bytes);
            items.push_back(c);
        } catch (const std::bad_alloc &) {
            lost = true;
        }
    }

    /* items [0, n) of t, after this tape's */
    void append_from(const fitm_cuda_tape &t, size_t n)
    {
        for (size_t i = 0; i < n && i < t.items.size(); i++)
            append(t.items[i], t.bytes.data() + t.items[i].arg_at);
    }

    /* whether item i is the work b with argument bytes args: the same kernel, configuration
     * and arguments, or the same copy or memset (a staged copy's source bytes are not
     * compared: the copy reads them when it runs) */
    bool same(size_t i, const fitm_tape_item &b, const unsigned char *args) const
    {
        if (lost || i >= items.size())
            return false;
        const fitm_tape_item &a = items[i];
        return a.kind == b.kind && a.fn == b.fn && a.grid.x == b.grid.x && a.grid.y == b.grid.y &&
               a.grid.z == b.grid.z && a.block.x == b.block.x && a.block.y == b.block.y &&
               a.block.z == b.block.z && a.shm == b.shm && a.dst == b.dst && a.src == b.src &&
               a.bytes == b.bytes && a.value == b.value && a.arg_bytes == b.arg_bytes &&
               (a.arg_bytes == 0 || memcmp(bytes.data() + a.arg_at, args, a.arg_bytes) == 0);
    }

    void clear()
    {
        items.clear();
        bytes.clear();
        lost = false;
    }
};

std::atomic<int> fitm_tapes_on{0};

namespace
{

/* N entries E, each with a member `stream` (nullptr: a free entry), changed under the owner's
 * lock; find scans the entries ever used (top) without it, so an entry's stream is published
 * last (release) and a lookup of another stream reads a whole entry or none. The tapes'
 * sessions and the programmatic streams are such tables. */
template <typename E, int N> struct stream_table {
    E e[N];
    std::atomic<int> top{0};

    E *find(cudaStream_t st)
    {
        const int n = top.load(std::memory_order_acquire);
        for (int i = 0; i < n; i++)
            if (e[i].stream.load(std::memory_order_acquire) == st)
                return &e[i];
        return nullptr;
    }

    /* st's entry, else the lowest free one (the lock held); nullptr when the table is full */
    E *claim(cudaStream_t st)
    {
        if (E *f = find(st))
            return f;
        for (int i = 0; i < N; i++)
            if (e[i].stream.load(std::memory_order_relaxed) == nullptr) {
                if (i >= top.load(std::memory_order_relaxed))
                    top.store(i + 1, std::memory_order_release);
                return &e[i];
            }
        return nullptr;
    }
};

enum { TAPE_RECORD = 1, TAPE_EXPECT };

struct tape_session {
    std::atomic<cudaStream_t> stream{nullptr}; /* nullptr: a free entry */
    int mode;
    fitm_cuda_tape *tape;
    /* TAPE_EXPECT: the candidates, those whose first `matched` items all equalled the work so
     * far (bit k: cands[k]), and whether some work differed from every one of them (then tape
     * holds the matched items and every piece of work since) */
    fitm_cuda_tape *cands[FITM_CUDA_TAPE_CANDIDATES];
    int n_cands;
    uint32_t alive;
    size_t matched;
    bool missed;
};

stream_table<tape_session, 64> tape_sessions;
std::mutex tape_lock;

tape_session *tape_find(cudaStream_t st)
{
    return tape_sessions.find(st);
}

void tape_publish(tape_session *s, cudaStream_t st)
{
    if (s->stream.load(std::memory_order_relaxed) != st) {
        s->stream.store(st, std::memory_order_release);
        fitm_tapes_on.fetch_add(1, std::memory_order_relaxed);
    }
}

/* The first of the candidates still alive. */
int tape_first_alive(const tape_session *s)
{
    for (int k = 0; k < s->n_cands; k++)
        if ((s->alive >> k) & 1u)
            return k;
    return -1;
}

/* The work differs from every candidate: the tape gets the items that matched (the same in
 * every candidate still alive). */
void tape_miss(tape_session *s)
{
    s->missed = true;
    s->tape->clear();
    s->tape->append_from(*s->cands[tape_first_alive(s)], s->matched);
}

int copy_again(const fitm_tape_item &it, const unsigned char *, cudaStream_t st)
{
    return (int)cudaMemcpyAsync(it.dst, it.src, it.bytes, (cudaMemcpyKind)it.value, st);
}

int memset_again(const fitm_tape_item &it, const unsigned char *, cudaStream_t st)
{
    return (int)cudaMemsetAsync(it.dst, it.value, it.bytes, st);
}

} // namespace

bool fitm_tape_offer(cudaStream_t st, const fitm_tape_item &it, const unsigned char *args)
{
    tape_session *s = tape_find(st);
    if (!s)
        return false;
    if (s->mode == TAPE_RECORD) {
        s->tape->append(it, args);
        return false;
    }
    if (!s->missed) {
        uint32_t alive = 0;
        for (int k = 0; k < s->n_cands; k++)
            if (((s->alive >> k) & 1u) && s->cands[k]->same(s->matched, it, args))
                alive |= 1u << k;
        if (alive) {
            s->alive = alive;
            s->matched++;
            return true;
        }
        tape_miss(s);
    }
    s->tape->append(it, args);
    return true;
}

extern "C" fitm_cuda_tape *fitm_cuda_tape_create(void)
{
    return new (std::nothrow) fitm_cuda_tape();
}

extern "C" void fitm_cuda_tape_destroy(fitm_cuda_tape *t)
{
    delete t;
}

extern "C" size_t fitm_cuda_tape_length(const fitm_cuda_tape *t)
{
    return t->lost ? 0 : t->items.size();
}

extern "C" void fitm_cuda_tape_clear(fitm_cuda_tape *t)
{
    t->clear();
}

extern "C" void fitm_cuda_tape_swap(fitm_cuda_tape *a, fitm_cuda_tape *b)
{
    std::swap(*a, *b);
}

extern "C" bool fitm_cuda_tape_record(fitm_cuda_tape *t, void *stream)
{
    const cudaStream_t st = fitm_stream(stream);
    std::lock_guard<std::mutex> g(tape_lock);
    tape_session *s = st ? tape_sessions.claim(st) : nullptr;
    if (!s)
        return false;
    s->mode = TAPE_RECORD;
    s->tape = t;
    tape_publish(s, st);
    return true;
}

extern "C" bool fitm_cuda_tape_expect(fitm_cuda_tape *t, void *stream, fitm_cuda_tape *const *cands,
                                      int n_cands)
{
    const cudaStream_t st = fitm_stream(stream);
    if (n_cands < 1 || n_cands > FITM_CUDA_TAPE_CANDIDATES)
        return false;
    std::lock_guard<std::mutex> g(tape_lock);
    tape_session *s = st ? tape_sessions.claim(st) : nullptr;
    if (!s)
        return false;
    t->clear();
    s->mode = TAPE_EXPECT;
    s->tape = t;
    for (int k = 0; k < n_cands; k++)
        s->cands[k] = cands[k];
    s->n_cands = n_cands;
    s->alive = n_cands == 32 ? ~0u : (1u << n_cands) - 1u;
    s->matched = 0;
    s->missed = false;
    tape_publish(s, st);
    return true;
}

extern "C" int fitm_cuda_tape_matched(void *stream)
{
    const tape_session *s = tape_find(fitm_stream(stream));
    if (!s || s->mode != TAPE_EXPECT || s->missed)
        return -1;
    for (int k = 0; k < s->n_cands; k++) {
        const fitm_cuda_tape *c = s->cands[k];
        if (((s->alive >> k) & 1u) && !c->lost && s->matched == c->items.size())
            return k;
    }
    return -1;
}

extern "C" void fitm_cuda_tape_stop(void *stream)
{
    const cudaStream_t st = fitm_stream(stream);
    std::lock_guard<std::mutex> g(tape_lock);
    tape_session *s = st ? tape_find(st) : nullptr;
    if (!s)
        return;
    s->stream.store(nullptr, std::memory_order_release);
    fitm_tapes_on.fetch_sub(1, std::memory_order_relaxed);
}

extern "C" void fitm_cuda_tape_unwind(void *stream)
{
    tape_session *s = tape_find(fitm_stream(stream));
    if (s && s->mode == TAPE_EXPECT && !s->missed)
        tape_miss(s);
    fitm_cuda_tape_stop(stream);
}

extern "C" int fitm_cuda_tape_run(const fitm_cuda_tape *t, void *stream)
{
    if (t->lost)
        return (int)cudaErrorMemoryAllocation;
    for (const fitm_tape_item &it : t->items) {
        const int rc = it.again(it, t->bytes.data() + it.arg_at, fitm_stream(stream));
        if (rc)
            return rc;
    }
    return 0;
}

/* Whether stream's tape held the copy or memset `it` back (the caller then enqueues nothing). */
static bool tape_holds_back(cudaStream_t st, const fitm_tape_item &it)
{
    return fitm_tapes_on.load(std::memory_order_relaxed) != 0 && fitm_tape_offer(st, it, nullptr);
}

extern "C" int fitm_cuda_copy_async(void *dst, const void *src, size_t n, int kind, void *stream)
{
    const cudaStream_t st = fitm_stream(stream);
    fitm_tape_item it = {};
    it.kind = FITM_TAPE_COPY;
    it.dst = dst, it.src = src, it.bytes = n, it.value = kind;
    it.again = copy_again;
    return tape_holds_back(st, it) ? 0
                                   : (int)cudaMemcpyAsync(dst, src, n, (cudaMemcpyKind)kind, st);
}

extern "C" int fitm_cuda_memset_async(void *dst, int value, size_t n, void *stream)
{
    const cudaStream_t st = fitm_stream(stream);
    fitm_tape_item it = {};
    it.kind = FITM_TAPE_MEMSET;
    it.dst = dst, it.bytes = n, it.value = value;
    it.again = memset_again;
    return tape_holds_back(st, it) ? 0 : (int)cudaMemsetAsync(dst, value, n, st);
}

/* ---- programmatic launches (common.cuh) ---- */

std::atomic<int> fitm_pdl_on{0};

namespace
{
struct pdl_entry {
    std::atomic<cudaStream_t> stream{nullptr};
};
stream_table<pdl_entry, 64> pdl_streams; /* the programmatic table, changed under pdl_lock */
std::mutex pdl_lock;
} // namespace

bool fitm_pdl_stream(cudaStream_t stream)
{
    return stream && pdl_streams.find(stream);
}

extern "C" bool fitm_cuda_set_pdl(void *stream, bool on)
{
    const cudaStream_t st = fitm_stream(stream);
    if (!st)
        return false;
    std::lock_guard<std::mutex> hold(pdl_lock);
    pdl_entry *e = on ? pdl_streams.claim(st) : pdl_streams.find(st);
    if (!e) /* off and not in the table, or on and the table full: plain launches */
        return false;
    if (on == (e->stream.load(std::memory_order_relaxed) == st))
        return on; /* already so */
    e->stream.store(on ? st : nullptr, std::memory_order_release);
    fitm_pdl_on.fetch_add(on ? 1 : -1, std::memory_order_relaxed);
    return on;
}

extern "C" bool fitm_cuda_pdl(void *stream)
{
    return fitm_pdl_stream(fitm_stream(stream));
}

namespace
{
__device__ __forceinline__ unsigned fitm_pdl_value(int64_t i, unsigned salt)
{
    return (unsigned)i * 2654435761u ^ salt;
}

__global__ void fitm_pdl_fill(unsigned *x, int64_t n, unsigned salt)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = fitm_pdl_value(i, salt);
}

/* Counts into *bad the elements of x that are not fill's with salt. */
__global__ void fitm_pdl_check(const unsigned *x, int64_t n, unsigned salt, unsigned *bad)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    unsigned wrong = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        wrong += x[i] != fitm_pdl_value(i, salt);
    if (wrong)
        atomicAdd(bad, wrong);
}

/* The probe's work on s: fill, check, a device copy, check the copy, fill again, check, with
 * salts from salt: each check reads what the launch or copy just before it wrote. */
void pdl_work(cudaStream_t s, unsigned *x, unsigned *y, int64_t n, unsigned salt, unsigned *bad)
{
#ifdef FITM_CUDA_EMU
    const unsigned blocks = 4, threads = 64; /* launches run one after another there */
#else
    const unsigned blocks = 264, threads = 256; /* two blocks an SM of an H100 or H200 */
#endif
    FITM_LAUNCH(blocks, threads, 0, s, fitm_pdl_fill)(x, n, salt);
    FITM_LAUNCH(blocks, threads, 0, s, fitm_pdl_check)(x, n, salt, bad);
    (void)cudaMemcpyAsync(y, x, (size_t)n * sizeof *x, cudaMemcpyDeviceToDevice, s);
    FITM_LAUNCH(blocks, threads, 0, s, fitm_pdl_check)(y, n, salt, bad);
    FITM_LAUNCH(blocks, threads, 0, s, fitm_pdl_fill)(x, n, salt + 1);
    FITM_LAUNCH(blocks, threads, 0, s, fitm_pdl_check)(x, n, salt + 1, bad);
}
} // namespace

extern "C" int fitm_cuda_pdl_probe(void)
{
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        major < 9) {
        (void)cudaGetLastError();
        return 0;
    }
#ifdef FITM_CUDA_EMU
    const int64_t n = 4096;
#else
    const int64_t n = (int64_t)1 << 20; /* 4 MiB: every check's blocks start before the fill ends */
#endif
    cudaError_t first = cudaSuccess; /* the first error, which says whether the device is lost */
    auto fine = [&first](cudaError_t e) {
        if (e != cudaSuccess && first == cudaSuccess)
            first = e;
        return e == cudaSuccess;
    };
    unsigned *x = NULL, *y = NULL, *bad = NULL, found = 1;
    cudaStream_t s = NULL;
    cudaGraphExec_t ge = NULL;
    bool ok = fine(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) &&
              fitm_cuda_set_pdl(s, true) &&
              fine(cudaMalloc((void **)&x, (size_t)n * sizeof *x)) &&
              fine(cudaMalloc((void **)&y, (size_t)n * sizeof *y)) &&
              fine(cudaMalloc((void **)&bad, sizeof *bad)) &&
              fine(cudaMemsetAsync(bad, 0, sizeof *bad, s));
    /* launched; captured, instantiated and replayed twice; captured again with other
     * arguments, the instance updated with them (as the backend's steps are) and replayed */
    for (int round = 0; round < 3 && ok; round++) {
        const unsigned salt = 0x5bd1e995u + 0x27d4eb2du * (unsigned)round;
        if (round == 0) {
            pdl_work(s, x, y, n, salt, bad);
            ok = fine(cudaGetLastError());
            continue;
        }
        cudaGraph_t gr = NULL;
        ok = fine(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        if (ok) {
            pdl_work(s, x, y, n, salt, bad);
            const cudaError_t launched = cudaGetLastError();
            ok = fine(cudaStreamEndCapture(s, &gr)) && fine(launched);
        }
        cudaGraphExecUpdateResultInfo info;
        ok = ok &&
             (round == 1 ? fine(cudaGraphInstantiate(&ge, gr, 0))
                         : fine(cudaGraphExecUpdate(ge, gr, &info))) &&
             fine(cudaGraphLaunch(ge, s)) && fine(cudaGraphLaunch(ge, s));
        if (gr)
            cudaGraphDestroy(gr);
    }
    ok = ok && fine(cudaMemcpyAsync(&found, bad, sizeof found, cudaMemcpyDeviceToHost, s)) &&
         fine(cudaStreamSynchronize(s)) && found == 0;
    if (ge)
        cudaGraphExecDestroy(ge);
    if (s) {
        cudaStreamSynchronize(s);
        fitm_cuda_set_pdl(s, false);
        cudaStreamDestroy(s);
    }
    cudaFree(x);
    cudaFree(y);
    cudaFree(bad);
    (void)cudaGetLastError();
    if (fitm_cuda_error_is_sticky((int)first))
        return -(int)first; /* a fault, not a refusal: the device is lost */
    return ok ? 1 : 0;
}
