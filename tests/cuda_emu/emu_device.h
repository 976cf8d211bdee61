/* cuda_emu: the CUDA device built-ins for kernels compiled as C++ by the host compiler.
 *
 * A launch runs its blocks one after another; inside a block every CUDA thread is a fiber
 * (ucontext) with its own stack, so __syncthreads is a real barrier and a warp shuffle waits
 * for every lane named in its mask. The scheduler always resumes the lowest-numbered fiber
 * that can run, so one warp races as far ahead of the others as the synchronisation allows:
 * a missing barrier lets it overwrite shared memory that a later warp has not read yet, which
 * is the order that exposes such bugs. A barrier or shuffle that some thread never reaches is
 * a deadlock: the launch is abandoned and reported as cudaErrorLaunchFailure.
 *
 * __shared__ variables are function-local statics: one copy, used by one block at a time
 * (launches from several host threads are serialised).
 *
 * Built with FITM_CUDA_EMU_THREADS, every CUDA thread is instead an OS thread (emu_runtime.cpp)
 * and the barriers and shuffles are synchronisation ThreadSanitizer understands: in a
 * -fsanitize=thread build, two threads touching the same memory with no barrier between them
 * are reported, whether or not the run happened to compute the right numbers. */
#ifndef FITM_CUDA_EMU_DEVICE_H
#define FITM_CUDA_EMU_DEVICE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
    unsigned x, y, z;
    /* constexpr: the thread-locals of this type are constant-initialized, which the build's
     * -fno-extern-tls-init relies on (tests/meson.build) */
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_)
    {
    }
};
struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

/* ---- per-fiber state (emu_runtime.cpp) ---- */

/* An asynchronous copy (cuda_pipeline.h) issued and not yet landed: n bytes from src, then
 * zfill zero bytes, to dst; group is the number of commits its thread had made when it was
 * issued (it belongs to the group the next commit closes). */
struct fitm_emu_async_copy {
    void *dst;
    const void *src;
    unsigned n, zfill;
    unsigned long group;
};
enum { FITM_EMU_ASYNC_MAX = 256 }; /* copies one thread may have in flight */

struct fitm_emu_thread {
    uint3 tid;
    bool grid_begun; /* called fitm_grid_begin (common.cuh) in this block */
    /* cuda_pipeline.h: this thread's copies in flight and the groups it has committed */
    int n_async;
    unsigned long commits;
    fitm_emu_async_copy *async; /* FITM_EMU_ASYNC_MAX of them from the thread's first copy on
                                   (kept for its life), apart so the threads' state stays small */
};
extern thread_local fitm_emu_thread *fitm_emu_cur;
extern thread_local uint3 fitm_emu_block_idx;
extern thread_local dim3 fitm_emu_block_dim, fitm_emu_grid_dim;

#define threadIdx (fitm_emu_cur->tid)
#define blockIdx (fitm_emu_block_idx)
#define blockDim (fitm_emu_block_dim)
#define gridDim (fitm_emu_grid_dim)
#define warpSize 32

void fitm_emu_syncthreads(void);
/* fitm_grid_begin (kernels/common.cuh) of the calling thread: the emulator runs launches one
 * after another, so it only notes the call; in a programmatic launch, a thread that reaches a
 * barrier, a shuffle or the dynamic shared memory first, or ends without the call, faults the
 * launch (cudaErrorLaunchFailure), as its reads could have raced the kernel before it. */
void fitm_emu_grid_begin(void);
/* Deposits bits as this lane's value of the current shuffle and returns the value lane src
 * deposited (src < 0: this lane's own), after every lane in mask has deposited. */
uint64_t fitm_emu_shfl(unsigned mask, uint64_t bits, int src);
void *fitm_emu_dynamic_shared(void);
/* For stand-ins of device libraries (emu_cublas.cpp): the error a launch would fail with now
 * (an injected one, consumed), or cudaSuccess; and the runtime's sticky-until-read error. */
cudaError_t fitm_emu_take_launch_failure(void);
cudaError_t fitm_emu_set_error(cudaError_t e);
/* FITM_CUDA_EMU_HOST_ONLY=1 in the environment: launches and cuBLAS calls are checked and
 * counted as always but compute nothing (device memory keeps what it held), so a program's
 * wall time is its host work plus the emulated runtime's own: what a benchmark of the
 * backend's host side measures on a machine without a GPU. Results are meaningless. */
bool fitm_emu_host_only(void);
/* Loses the context: e, sticky, is what every later call returns. */
cudaError_t fitm_emu_lose_context(cudaError_t e);
/* For stand-ins of device features that run inside a kernel (mma.h): records a fault of the
 * running launch (the first one, described by what); when its blocks have run, the launch
 * loses the context with e, as a device's faulting kernel does. */
void fitm_emu_kernel_fault(cudaError_t e, const char *what);
/* True when the n bytes from p lie in the running launch's dynamic shared memory. */
bool fitm_emu_shared_range(const void *p, size_t n);
/* Notes that the calling thread made a warp collective call whose arguments hash to sig:
 * when its block ends, a thread whose calls differ from lane 0's of its warp in number or
 * arguments faults the launch with cudaErrorLaunchFailure. */
void fitm_emu_warp_collective(uint64_t sig);

#define __syncthreads() fitm_emu_syncthreads()

/* __syncwarp(mask): a barrier of the warp's lanes in mask (all 32 when none is given), made of
 * the shuffle's rendezvous, so a lane that reads what others of its warp wrote before it runs
 * after their writes (and ThreadSanitizer sees the order). */
static inline void fitm_emu_syncwarp(unsigned mask = 0xffffffffu)
{
    (void)fitm_emu_shfl(mask, 0, -1);
}
#define __syncwarp(...) fitm_emu_syncwarp(__VA_ARGS__)

/* Source lane of a shuffle, or -1 for "own value" (target outside the caller's segment). */
static inline int fitm_emu_lane(void)
{
    return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32;
}

template <typename T> static inline T fitm_emu_shfl_t(unsigned mask, T v, int src)
{
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    b = fitm_emu_shfl(mask, b, src);
    T r;
    memcpy(&r, &b, sizeof r);
    return r;
}

template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    const int lane = fitm_emu_lane();
    return fitm_emu_shfl_t(mask, v, lane / width * width + ((src % width) + width) % width);
}

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32)
{
    const int lane = fitm_emu_lane(), s = lane ^ lane_mask;
    return fitm_emu_shfl_t(mask, v, s >= (lane / width + 1) * width ? -1 : s);
}

template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    const int lane = fitm_emu_lane(), s = lane + (int)delta;
    return fitm_emu_shfl_t(mask, v, s >= (lane / width + 1) * width ? -1 : s);
}

template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    const int lane = fitm_emu_lane(), s = lane - (int)delta;
    return fitm_emu_shfl_t(mask, v, s < lane / width * width ? -1 : s);
}

/* The intrinsics that round each operation on its own (no contraction into a fused
 * multiply-add; the emulator's sources are built with -ffp-contract=off besides). */
static inline float __fadd_rn(float a, float b)
{
    return a + b;
}
static inline float __fsub_rn(float a, float b)
{
    return a - b;
}
static inline float __fmul_rn(float a, float b)
{
    return a * b;
}
static inline float __fdiv_rn(float a, float b)
{
    return a / b;
}

/* A read through the read-only cache: a T at an address not aligned to its size (a float4
 * or uint4 off 16 bytes) faults the launch, as on a device. (Whether p is device memory the
 * launch's argument check sees: a lookup per load would slow every kernel.) */
template <typename T> static inline T __ldg(const T *p)
{
    if ((uintptr_t)p % alignof(T) != 0) {
        fitm_emu_kernel_fault(cudaErrorMisalignedAddress, "a misaligned __ldg");
        return T{};
    }
    return *p;
}

/* ---- bit casts and 16-bit floats ---- */

static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __int_as_float(int i)
{
    return __uint_as_float((unsigned)i);
}
static inline int __float_as_int(float f)
{
    return (int)__float_as_uint(f);
}

struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};

static inline __half __ushort_as_half(unsigned short b)
{
    __half h;
    h.bits = b;
    return h;
}
static inline unsigned short __half_as_ushort(__half h)
{
    return h.bits;
}

/* IEEE half -> float, exact (subnormals, inf and NaN included). */
static inline float __half2float(__half h)
{
    const uint32_t s = (uint32_t)(h.bits >> 15) << 31, e = h.bits >> 10 & 31u, m = h.bits & 1023u;
    if (e == 31)
        return __uint_as_float(s | 0x7f800000u | m << 13);
    if (e == 0)
        return s ? -ldexpf((float)m, -24) : ldexpf((float)m, -24);
    return __uint_as_float(s | (e + 112u) << 23 | m << 13);
}

/* float -> IEEE half, round to nearest even; overflow to +-inf, NaN stays NaN. */
static inline __half __float2half_rn(float f)
{
    const uint32_t u = __float_as_uint(f), s = u >> 16 & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)
        return __ushort_as_half((unsigned short)(s | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0)));
    if (a >= 0x477ff000u) /* rounds to 65520 or more */
        return __ushort_as_half((unsigned short)(s | 0x7c00u));
    if (a < 0x38800000u) { /* below the smallest normal half: a multiple of 2^-24 */
        const float q = rintf(__uint_as_float(a) * 16777216.0f); /* exact scaling, RNE */
        return __ushort_as_half((unsigned short)(s | (uint32_t)q));
    }
    const uint32_t r = a + 0xfffu + (a >> 13 & 1u); /* round the 13 dropped bits to even */
    return __ushort_as_half((unsigned short)(s | ((r >> 13) - (112u << 10))));
}
static inline __half __float2half(float f)
{
    return __float2half_rn(f);
}

static inline float __bfloat162float(__nv_bfloat16 b)
{
    return __uint_as_float((uint32_t)b.bits << 16);
}
/* float -> bfloat16, round to nearest even; NaN stays NaN. */
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    const uint32_t u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        b.bits = (uint16_t)(u >> 16 | 0x40u);
    else
        b.bits = (uint16_t)((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
    return b;
}
/* float -> bfloat16, rounded toward zero (the low 16 bits dropped); NaN stays NaN. */
static inline __nv_bfloat16 __float2bfloat16_rz(float f)
{
    const uint32_t u = __float_as_uint(f);
    __nv_bfloat16 b;
    b.bits = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? u >> 16 | 0x40u : u >> 16);
    return b;
}
static inline __nv_bfloat16 __float2bfloat16(float f)
{
    return __float2bfloat16_rn(f);
}

/* ---- atomics (blocks run one at a time; fibers switch only at barriers and shuffles, so
 * there a plain read-modify-write is atomic; OS threads take the engine's lock) ---- */

#ifdef FITM_CUDA_EMU_THREADS
void fitm_emu_atomic_lock(void);
void fitm_emu_atomic_unlock(void);
#else
static inline void fitm_emu_atomic_lock(void)
{
}
static inline void fitm_emu_atomic_unlock(void)
{
}
#endif

template <typename T> static inline T atomicAdd(T *p, T v)
{
    fitm_emu_atomic_lock();
    const T old = *p;
    *p = old + v;
    fitm_emu_atomic_unlock();
    return old;
}
template <typename T> static inline T atomicMax(T *p, T v)
{
    fitm_emu_atomic_lock();
    const T old = *p;
    *p = old > v ? old : v;
    fitm_emu_atomic_unlock();
    return old;
}

/* ---- launches: FITM_LAUNCH(grid, block, shm, stream, kernel)(args...) ---- */

/* The pointer arguments of one launch, checked before it runs: every non-NULL pointer must
 * lie in a device allocation (cudaMalloc) or in pinned host memory (cudaMallocHost), else the
 * launch fails with cudaErrorIllegalAddress, as the device would when the kernel dereferences
 * it. A kernel argument that is a struct holding device pointers, or a pointer to an array of
 * such structs in device memory, declares them with an overload of fitm_emu_arg_pointers
 * (or fitm_emu_pointee_pointers), found by argument-dependent lookup (k_attention.cpp). */
struct fitm_emu_args_check {
    dim3 grid;
    int arg = 0; /* the argument being checked (0-based) */
    const void *bad = nullptr;
    int bad_arg = -1;
    void ptr(const void *p); /* emu_runtime.cpp */
};

template <typename T> static inline void fitm_emu_arg_pointers(const T &, fitm_emu_args_check &)
{
}
template <typename T> static inline void fitm_emu_pointee_pointers(const T *, fitm_emu_args_check &)
{
}

template <typename T> static inline void fitm_emu_check_arg(const T &v, fitm_emu_args_check &c)
{
    if constexpr (std::is_pointer<T>::value) {
        c.ptr((const void *)v);
        if (v && c.bad_arg < 0)
            fitm_emu_pointee_pointers(v, c);
    } else {
        fitm_emu_arg_pointers(v, c);
    }
    c.arg++;
}

/* Runs a launch, or records it while the stream is captured into a graph (then it runs at
 * each replay): checks the configuration against the device's limits and the arguments
 * (check), then runs body for every block. kernel identifies the kernel for
 * cudaFuncSetAttribute. */
void fitm_emu_launch_body(dim3 grid, dim3 block, size_t dyn_shared, cudaStream_t st,
                          const void *kernel, std::function<void(fitm_emu_args_check &)> check,
                          std::function<void()> body, bool programmatic = false);

/* For the stand-in of cuBLAS (emu_cublas.cpp; counted as a cuBLAS call): runs op on the
 * stream, or records it while the stream is captured; op returns the error the work failed with
 * (cudaSuccess: none), which the runtime records. The return value: the error now (a sticky one, or
 * op's when it ran now). */
cudaError_t fitm_emu_enqueue(cudaStream_t st, std::function<cudaError_t()> op);

/* True when p is NULL or lies in a device allocation or pinned host memory. */
bool fitm_emu_device_accessible(const void *p);

/* True when the n bytes from p (n >= 1) lie in one device allocation or in pinned host memory. */
bool fitm_emu_device_range(const void *p, size_t n);

template <typename... P> struct fitm_emu_launcher {
    void (*kernel)(P...);
    dim3 grid, block;
    size_t shm;
    cudaStream_t stream;
    bool programmatic; /* cudaLaunchAttributeProgrammaticStreamSerialization */

    template <typename... A> void operator()(A... a) const
    {
        /* the arguments are copied, as a launch copies them: a graph may replay it later */
        const std::tuple<P...> args(static_cast<P>(a)...);
        const auto k = kernel;
        fitm_emu_launch_body(
            grid, block, shm, stream, (const void *)kernel,
            [args](fitm_emu_args_check &c) {
                std::apply([&c](const P &...v) { (fitm_emu_check_arg(v, c), ...); }, args);
            },
            [args, k]() { std::apply(k, args); }, programmatic);
    }
};

template <typename... P>
static inline fitm_emu_launcher<P...> fitm_emu_launch(dim3 g, dim3 b, size_t shm, cudaStream_t st,
                                                      void (*k)(P...), bool programmatic = false)
{
    return fitm_emu_launcher<P...>{k, g, b, shm, st, programmatic};
}

/* cudaFuncSetAttribute for a kernel of the C++ side (the runtime's template overload). */
cudaError_t fitm_emu_func_set_attribute(const void *kernel, int attr, int value);
template <typename... P>
static inline cudaError_t cudaFuncSetAttribute(void (*k)(P...), cudaFuncAttribute attr, int value)
{
    return fitm_emu_func_set_attribute((const void *)k, (int)attr, value);
}

#define FITM_DYNAMIC_SHARED(type, name) type *name = (type *)fitm_emu_dynamic_shared()

#define FITM_LAUNCH(grid, block, shm, stream, ...)                                                 \
    fitm_emu_launch(grid, block, shm, stream, __VA_ARGS__)

#endif
