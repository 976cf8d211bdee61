/* common: small device and launch helpers shared by the kernel files (not part of the C ABI). */
#ifndef FITM_KERNELS_COMMON_CUH
#define FITM_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <tuple>
#include <type_traits>
#include <utility>

#define FITM_WARP 32

/* ---- launches ----
 *
 * FITM_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...) launches kernel as
 * kernel<<<grid, block, shared_bytes, stream>>>(args...) does, through fitm_launcher: while no
 * stream has a tape (kernels.h, fitm_cuda_tape_record and fitm_cuda_tape_expect) that is one
 * branch more than the bare launch; while one has, the launch is offered to the tape of its
 * stream (cuda_util.cu), which records it (and lets it go on), or compares it with a recorded
 * one and holds it back. Under the CPU emulator of tests/cuda_emu the bare launch is the
 * emulator's own (fitm_emu_launch, a call into its fiber scheduler). */

/* One piece of a stream's work as a tape keeps it: a kernel launch (fn, its configuration and
 * the bytes of its arguments, arg_bytes of them at arg_at in the tape's byte store), a copy
 * (dst, src, bytes, value: the cudaMemcpyKind) or a memset (dst, bytes, value). again enqueues
 * it once more from those (args: its argument bytes) and returns the launch's error. */
enum { FITM_TAPE_KERNEL, FITM_TAPE_COPY, FITM_TAPE_MEMSET };
struct fitm_tape_item {
    int kind;
    void (*fn)(void);
    dim3 grid, block;
    size_t shm;
    void *dst;
    const void *src;
    size_t bytes;
    int value;
    size_t arg_at, arg_bytes;
    int (*again)(const fitm_tape_item &it, const unsigned char *args, cudaStream_t stream);
};

/* Streams that have a tape now (cuda_util.cu): 0 is the launcher's fast path. */
extern std::atomic<int> fitm_tapes_on;

/* ---- programmatic launches ----
 *
 * A launch on a stream of the programmatic table (fitm_cuda_set_pdl: the CUDA backend's stream
 * on a device of compute capability 9.0 or later where fitm_cuda_pdl_probe passed) asks that
 * its grid may start while the kernel before it in the stream is still running
 * (cudaLaunchAttributeProgrammaticStreamSerialization): its blocks are made resident and wait
 * at their first statement, fitm_grid_begin, which returns once the grids before it have
 * completed and their writes are visible, then lets the next launch do the same. The device's
 * work and order are those of plain launches; what is saved is the gap between two kernels
 * (the next grid's launch and its blocks' start), paid once a kernel. The launcher looks its
 * stream up only while fitm_pdl_on (streams in the table) is not 0. */
extern std::atomic<int> fitm_pdl_on;
bool fitm_pdl_stream(cudaStream_t stream); /* cuda_util.cu: in the table (never NULL) */

static inline bool fitm_pdl_here(cudaStream_t stream)
{
    return fitm_pdl_on.load(std::memory_order_relaxed) != 0 && fitm_pdl_stream(stream);
}

/* Every kernel's first statement, executed by every thread (nothing of the kernel before it,
 * no early return): waits until the grids before this one in the stream have completed and
 * their memory is visible (a no-op for a plain launch), then lets the next grid in the stream
 * launch (its blocks wait in their own fitm_grid_begin until this grid has completed, so at
 * most two grids are resident at once). Under the emulator (tests/cuda_emu) a programmatic
 * launch fails where a thread of it did not call this before its first barrier, shuffle or
 * use of the dynamic shared memory, or did not call it at all. */
static __device__ __forceinline__ void fitm_grid_begin(void)
{
#ifdef FITM_CUDA_EMU
    fitm_emu_grid_begin();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* n bytes from p of memory no kernel writes while the backend runs (a weight); n 0: none. */
struct fitm_span {
    const void *p;
    int64_t n;
};

/* fitm_grid_begin after the block has asked L2 for the bytes of a and b, one 128-byte line a
 * thread (threads [0, blockDim.x / 2) a's lines, the rest b's; all of them a's when b is
 * empty; lines past those threads are not asked for). Only memory no kernel writes may be
 * named: it is read before the wait, which on a programmatic launch is while the grid before
 * this one still runs, so the loads after the wait find it in L2 instead of paying a memory
 * round trip there. The prefetch returns nothing, so the kernel's values are those of a plain
 * fitm_grid_begin. Under the emulator a span outside device memory faults the launch
 * (cudaErrorIllegalAddress), as a load of it would. */
static __device__ __forceinline__ void fitm_grid_begin_prefetch(fitm_span a, fitm_span b)
{
    const int half = b.n > 0 ? (int)blockDim.x / 2 : (int)blockDim.x;
    const int t = (int)threadIdx.x;
    const fitm_span s = t < half ? a : b;
    const int line = t < half ? t : t - half;
    if (s.n > 0) {
        const uintptr_t lo = (uintptr_t)s.p & ~(uintptr_t)127;
        const uintptr_t at = lo + (uintptr_t)line * 128;
#ifdef FITM_CUDA_EMU
        if (line == 0 && !fitm_emu_device_range(s.p, (size_t)s.n))
            fitm_emu_kernel_fault(cudaErrorIllegalAddress, "a prefetch outside device memory");
        (void)at;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (at < (uintptr_t)s.p + (uintptr_t)s.n)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
#else
        (void)at;
#endif
    }
    fitm_grid_begin();
}

/* Offers the work it (argument bytes args) to stream's tape: true when the tape held it back
 * (the caller enqueues nothing), false when the caller must enqueue it (no tape on stream, or
 * a tape that records). */
bool fitm_tape_offer(cudaStream_t stream, const fitm_tape_item &it, const unsigned char *args);

template <typename... P> struct fitm_launcher {
    void (*kernel)(P...);
    dim3 grid, block;
    size_t shm;
    cudaStream_t stream;

    /* the launch itself, as the CUDA toolchain (or the emulator) makes it: programmatic on
     * a stream of the programmatic table */
    void now(P... v) const
    {
#ifdef FITM_CUDA_EMU
        fitm_emu_launch(grid, block, shm, stream, kernel, fitm_pdl_here(stream))(v...);
#else
        if (fitm_pdl_here(stream)) {
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = grid;
            cfg.blockDim = block;
            cfg.dynamicSmemBytes = shm;
            cfg.stream = stream;
            cfg.attrs = at;
            cfg.numAttrs = 1;
            (void)cudaLaunchKernelEx(&cfg, kernel, v...); /* its error: cudaGetLastError */
        } else {
            kernel<<<grid, block, shm, stream>>>(v...);
        }
#endif
    }

    template <size_t... I>
    static int again_at(const fitm_tape_item &it, const unsigned char *args, cudaStream_t st,
                        std::index_sequence<I...>)
    {
        std::tuple<P...> v;
        size_t at = 0;
        ((memcpy((void *)&std::get<I>(v), args + at, sizeof(P)), at += sizeof(P)), ...);
        const fitm_launcher l{reinterpret_cast<void (*)(P...)>(it.fn), it.grid, it.block, it.shm,
                              st};
        l.now(std::get<I>(v)...);
        return (int)cudaGetLastError();
    }

    static int again(const fitm_tape_item &it, const unsigned char *args, cudaStream_t st)
    {
        return again_at(it, args, st, std::index_sequence_for<P...>{});
    }

    /* the launch, or its offer to the stream's tape */
    void go(P... v) const
    {
        if (fitm_tapes_on.load(std::memory_order_relaxed) == 0) {
            now(v...);
            return;
        }
        static_assert((std::is_trivially_copyable<P>::value && ...), "kernel arguments");
        unsigned char args[(sizeof(P) + ... + 1)]; /* packed one after the other */
        size_t at = 0;
        ((void)(memcpy(args + at, &v, sizeof(P)), at += sizeof(P)), ...);
        fitm_tape_item it = {};
        it.kind = FITM_TAPE_KERNEL;
        it.fn = reinterpret_cast<void (*)(void)>(kernel);
        it.grid = grid, it.block = block, it.shm = shm;
        it.arg_bytes = at;
        it.again = again;
        if (!fitm_tape_offer(stream, it, args))
            now(v...);
    }

    /* the arguments converted to the kernel's parameter types, as a launch converts them */
    template <typename... A> void operator()(A... a) const
    {
        static_assert(sizeof...(A) == sizeof...(P), "a kernel's arguments, one for each");
        go(static_cast<P>(a)...);
    }
};

template <typename... P>
static inline fitm_launcher<P...> fitm_launch(dim3 grid, dim3 block, size_t shm,
                                              cudaStream_t stream, void (*kernel)(P...))
{
    return fitm_launcher<P...>{kernel, grid, block, shm, stream};
}

#undef FITM_LAUNCH
#define FITM_LAUNCH(grid, block, shm, stream, ...)                                                 \
    fitm_launch(grid, block, shm, stream, __VA_ARGS__)

/* Lets kernel launch with shm bytes of dynamic shared memory: where that and its static_bytes
 * of static shared memory pass the 48 KiB every block may have, the kernel's opt-in
 * (cudaFuncAttributeMaxDynamicSharedMemorySize) is raised to shm, once per thread, device and
 * size (the runtime call would otherwise run at every launch of a decode step; a device reset
 * would clear the opt-in, and nothing in the project resets one). 0 or the runtime's error. */
template <typename K>
static inline int fitm_smem_optin(K kernel, size_t shm, size_t static_bytes = 0)
{
    if (shm + static_bytes <= 48 * 1024)
        return 0;
    struct seen_t {
        const void *kernel;
        int dev;
        size_t shm;
    };
    static thread_local seen_t seen[8];
    static thread_local int next;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return (int)e;
    const void *k = (const void *)kernel;
    for (const seen_t &s : seen)
        if (s.kernel == k && s.dev == dev && s.shm >= shm)
            return 0;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm);
    if (e == cudaSuccess) {
        seen[next] = {k, dev, shm};
        next = (next + 1) % 8;
    }
    return (int)e;
}

/* The launch's dynamic shared memory as an array `name` of `type`. */
#ifndef FITM_DYNAMIC_SHARED
#define FITM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

/* Launchers receive the stream as void * (see kernels.h). */
static inline cudaStream_t fitm_stream(void *s)
{
    return (cudaStream_t)s;
}

static inline bool fitm_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* Blocks for a grid-stride loop over n items with `threads` per block: enough to fill any
 * current GPU many times over, capped so the grid size always fits. */
static inline unsigned fitm_grid_for(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    const int64_t cap = 1 << 20;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

__device__ __forceinline__ float fitm_warp_sum(float v)
{
    for (int o = FITM_WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fitm_warp_max(float v)
{
    for (int o = FITM_WARP / 2; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The element-wise expressions that more than one kernel applies, written once so that a
 * fused kernel computes the very same bits as the separate kernels it replaces. */

/* RoPE of one pair (v[a], v[b]) of a head vector by the angle whose cosine is c, sine s. */
__device__ __forceinline__ void fitm_rope_pair(float *v, int64_t a, int64_t b, float c, float s)
{
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
}

/* v rounded to bfloat16, to nearest even (overflow to +-inf, NaN stays NaN): the one rounding
 * of the BATCH class's tensor-core operands, whether a weight's copy (fitm_cuda_to_bf16) or
 * activations staged by the GEMM (kernels/gemm.cu). */
__device__ __forceinline__ __nv_bfloat16 fitm_to_bf16(float v)
{
    return __float2bfloat16_rn(v);
}

/* silu(g) * u */
__device__ __forceinline__ float fitm_swiglu1(float g, float u)
{
    return g / (1.0f + expf(-g)) * u;
}

/* gelu_tanh(g) * u */
__device__ __forceinline__ float fitm_geglu1(float g, float u)
{
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))) * u;
}

/* Sum (or max) of v over the whole block, returned to every thread. blockDim.x must be a
 * multiple of 32 (at most 1024); shm holds 32 floats. Contains __syncthreads, so every thread
 * of the block must call it, and it may be called repeatedly with the same shm. */
__device__ __forceinline__ float fitm_block_reduce(float v, float *shm, bool is_max)
{
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int n_warps = blockDim.x / FITM_WARP;
    v = is_max ? fitm_warp_max(v) : fitm_warp_sum(v);
    __syncthreads(); /* shm may still be read by a previous call */
    if (lane == 0)
        shm[warp] = v;
    __syncthreads();
    float r = lane < n_warps ? shm[lane] : (is_max ? -INFINITY : 0.0f);
    return is_max ? fitm_warp_max(r) : fitm_warp_sum(r);
}

/* Sum of v over the whole block of n_warps warps (the launch's block size over 32, a constant
 * of the caller's kernel) in double, returned to every thread: each warp's butterfly, then the
 * warps' sums added in warp order. shm holds n_warps doubles. Contains __syncthreads, so every
 * thread of the block must call it, and it may be called repeatedly with the same shm. */
__device__ __forceinline__ double fitm_block_sum_d(double v, double *shm, int n_warps)
{
    for (int o = FITM_WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* shm may still hold what an earlier call reads */
    if (threadIdx.x % FITM_WARP == 0)
        shm[threadIdx.x / FITM_WARP] = v;
    __syncthreads();
    double r = 0.0;
    for (int w = 0; w < n_warps; w++)
        r += shm[w];
    return r;
}

#endif
