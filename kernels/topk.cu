/* topk: each row's k first entries, for sampling on the device (only k entries of a logit row
 * leave it). CPU reference (src/compute/ops.c): fitm_ops_topk, whose order "larger value
 * first, equal values lower index first, NaN after every number (NaNs by index)" is total, so
 * the selection is exact: the same list as the reference, ties included, whatever the launch
 * shape.
 *
 * A row of at most FITM_CUDA_TOPK_CAP entries is one launch of stage 3 below, its entries all
 * candidates. A longer one takes three launches, the same for every row and every k, none of
 * them in rounds over k:
 *  1. fitm_topk_chunk_first: the row cut in C <= 256 chunks (C >= k, below), one block each
 *     writes its chunk's first entry;
 *  2. fitm_topk_collect: T = the k-th of those C chunk firsts. They are k distinct entries of
 *     the row that come no later than T, so the row's first k all come no later than T: each
 *     block appends the entries of its chunk that are T or before it to the row's candidate
 *     list (an atomic counter: the set is fixed, its order is not);
 *  3. fitm_topk_sort: one block per row sorts its candidates (bitonic, in shared memory, the
 *     next power of two of their number) and writes the first k. A row with more candidates
 *     than the list holds (huge ties, a few chunks holding every high value) takes k rounds of a
 *     block reduction over the whole row instead: slower, as exact, and decided inside the
 *     kernel, so the launches never depend on the data (a decode step is a CUDA graph). */
#include "common.cuh"
#include "kernels.h"

#define FITM_TOPK_THREADS 256
#define FITM_TOPK_WARPS (FITM_TOPK_THREADS / FITM_WARP)
/* Stage 2's blocks find T among all of a row's chunk firsts, one per thread. */
static_assert(FITM_CUDA_TOPK_CHUNKS <= FITM_TOPK_THREADS, "a thread per chunk");

typedef unsigned long long fitm_topkey;
#define FITM_TOPK_NONE (~0ull) /* after every entry's key: an empty slot */

/* An entry's place in the order as one integer, smaller first: the high word is the value's
 * rank descending (floats' bits made monotone, -0 as +0, NaN after -inf), the low word the
 * index. Distinct indices make distinct keys, so comparing keys is the total order. */
__device__ __forceinline__ fitm_topkey fitm_topk_key(float v, int64_t i)
{
    const unsigned u = v == 0.0f ? 0u : __float_as_uint(v);
    unsigned up = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with v */
    if (v != v)
        up = 0u;
    return ((fitm_topkey)~up << 32) | (fitm_topkey)(unsigned)i;
}

__device__ __forceinline__ fitm_topkey fitm_topk_min(fitm_topkey a, fitm_topkey b)
{
    return b < a ? b : a;
}

/* The smallest key of the block, returned to every thread; shm holds FITM_TOPK_WARPS keys.
 * Every thread must call it; it may be called again with the same shm. */
__device__ __forceinline__ fitm_topkey fitm_topk_block_min(fitm_topkey v, fitm_topkey *shm)
{
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    for (int o = FITM_WARP / 2; o > 0; o >>= 1)
        v = fitm_topk_min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads(); /* every thread has read shm's previous contents */
    if (lane == 0)
        shm[warp] = v;
    __syncthreads();
    v = shm[0];
    for (int w = 1; w < FITM_TOPK_WARPS; w++)
        v = fitm_topk_min(v, shm[w]);
    return v;
}

/* Writes the entry of key t of row xr as out slot r, its value read back from the row, so
 * every bit of it (-0, a NaN's payload) is the row's; an empty slot as (-inf, -1). */
__device__ __forceinline__ void fitm_topk_put(const float *xr, fitm_topkey t, float *val,
                                              int32_t *id, int64_t r)
{
    const int32_t i = t == FITM_TOPK_NONE ? -1 : (int32_t)(unsigned)(t & 0xffffffffu);
    val[r] = i < 0 ? -INFINITY : xr[i], id[r] = i;
}

/* Stage 1: cmax[row * gridDim.x + blockIdx.x] = the first key of chunk blockIdx.x of row
 * blockIdx.y, entries [blockIdx.x * chunk, min(n, ... + chunk)); block 0 also zeroes the
 * row's candidate count for stage 2. */
__global__ void __launch_bounds__(FITM_TOPK_THREADS)
    fitm_topk_chunk_first(const float *__restrict__ x, int64_t n, int64_t ld, int64_t chunk,
                          fitm_topkey *cmax, int32_t *cnt)
{
    fitm_grid_begin();
    __shared__ fitm_topkey shm[FITM_TOPK_WARPS];
    const int64_t row = blockIdx.y, lo = (int64_t)blockIdx.x * chunk;
    const int64_t hi = lo + chunk < n ? lo + chunk : n;
    const float *xr = x + row * ld;
    fitm_topkey m = FITM_TOPK_NONE;
    for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x)
        m = fitm_topk_min(m, fitm_topk_key(xr[e], e));
    m = fitm_topk_block_min(m, shm);
    if (threadIdx.x == 0) {
        cmax[row * gridDim.x + blockIdx.x] = m;
        if (blockIdx.x == 0)
            cnt[row] = 0;
    }
}

/* Stage 2: T = the k-th smallest of the row's gridDim.x chunk firsts (each thread ranks one:
 * the keys are distinct, so exactly one has k - 1 before it); then the chunk's keys <= T go to
 * list[row * FITM_CUDA_TOPK_CAP + ...], counted in cnt[row], which keeps counting past the
 * list's end: stage 3 sees the overflow. A chunk whose first key is after T holds none and stops there. */
__global__ void __launch_bounds__(FITM_TOPK_THREADS)
    fitm_topk_collect(const float *__restrict__ x, int64_t n, int64_t ld, int64_t chunk,
                      int32_t k, const fitm_topkey *cmax, int32_t *cnt, fitm_topkey *list)
{
    fitm_grid_begin();
    __shared__ fitm_topkey firsts[FITM_CUDA_TOPK_CHUNKS];
    __shared__ fitm_topkey thr;
    const int64_t row = blockIdx.y, lo = (int64_t)blockIdx.x * chunk;
    const int64_t hi = lo + chunk < n ? lo + chunk : n;
    const int c = (int)gridDim.x;
    const fitm_topkey mine = threadIdx.x < (unsigned)c ? cmax[row * c + threadIdx.x] : 0;
    if (threadIdx.x < (unsigned)c)
        firsts[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x < (unsigned)c) {
        int before = 0;
        for (int j = 0; j < c; j++)
            before += firsts[j] < mine;
        if (before == k - 1)
            thr = mine;
    }
    __syncthreads();
    const fitm_topkey t = thr;
    if (firsts[blockIdx.x] > t)
        return;
    const float *xr = x + row * ld;
    for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const fitm_topkey key = fitm_topk_key(xr[e], e);
        if (key <= t) {
            const int32_t at = atomicAdd(&cnt[row], 1);
            if (at < FITM_CUDA_TOPK_CAP)
                list[row * FITM_CUDA_TOPK_CAP + at] = key;
        }
    }
}

/* Stage 3: the first k of row blockIdx.y's candidates, in order, to val/id (row * k). Without
 * a list (rows of n <= FITM_CUDA_TOPK_CAP, this launch alone) every entry of the row is one. */
__global__ void __launch_bounds__(FITM_TOPK_THREADS)
    fitm_topk_sort(const float *__restrict__ x, int64_t n, int64_t ld, int32_t k,
                   const int32_t *cnt, const fitm_topkey *list, float *val, int32_t *id)
{
    fitm_grid_begin();
    __shared__ fitm_topkey s[FITM_CUDA_TOPK_CAP];
    __shared__ fitm_topkey shm[FITM_TOPK_WARPS];
    const int64_t row = blockIdx.y;
    const float *xr = x + row * ld;
    const int32_t m = list ? cnt[row] : (int32_t)n;
    float *vr = val + row * k;
    int32_t *ir = id + row * k;
    if (m > FITM_CUDA_TOPK_CAP) {
        /* the fallback: round r takes the smallest key after round r - 1's */
        fitm_topkey prev = 0;
        for (int32_t r = 0; r < k; r++) {
            fitm_topkey b = FITM_TOPK_NONE;
            for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
                const fitm_topkey key = fitm_topk_key(xr[e], e);
                if (r == 0 || key > prev)
                    b = fitm_topk_min(b, key);
            }
            prev = fitm_topk_block_min(b, shm);
            if (threadIdx.x == 0)
                fitm_topk_put(xr, prev, vr, ir, r);
        }
        return;
    }
    int p = 1;
    while (p < m)
        p <<= 1;
    const fitm_topkey *lr = list ? list + row * FITM_CUDA_TOPK_CAP : nullptr;
    for (int i = threadIdx.x; i < p; i += blockDim.x)
        s[i] = i >= m ? FITM_TOPK_NONE : lr ? lr[i] : fitm_topk_key(xr[i], i);
    __syncthreads();
    /* bitonic: runs of `size` sorted alternately up and down, merged pairwise at strides
     * size / 2, ..., 1; the last size (p) sorts the whole array ascending */
    for (int size = 2; size <= p; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < p / 2; i += blockDim.x) {
                const int a = 2 * i - (i & (stride - 1)), b = a + stride;
                const bool up = (a & size) == 0;
                const fitm_topkey ka = s[a], kb = s[b];
                if ((ka > kb) == up)
                    s[a] = kb, s[b] = ka;
            }
            __syncthreads();
        }
    for (int r = threadIdx.x; r < k; r += blockDim.x)
        fitm_topk_put(xr, s[r], vr, ir, r);
}

/* Chunk length: ceil(n / 256), so C = ceil(n / chunk) <= 256 chunks, and since the rows cut
 * in chunks are longer than FITM_CUDA_TOPK_CAP, C > 256 n / (n + 256) > 128 >= k. */
static int64_t fitm_topk_chunk(int64_t n)
{
    return (n + FITM_CUDA_TOPK_CHUNKS - 1) / FITM_CUDA_TOPK_CHUNKS;
}

/* Scratch layout: rows counts (int32, padded to 8 bytes), rows * C chunk firsts, rows * cap
 * candidates (keys). */
static size_t fitm_topk_counts_bytes(int64_t rows)
{
    return (size_t)((rows * (int64_t)sizeof(int32_t) + 7) / 8 * 8);
}

extern "C" size_t fitm_cuda_topk_scratch(int64_t rows, int64_t n, int32_t k)
{
    (void)k;
    if (rows < 1 || n <= FITM_CUDA_TOPK_CAP)
        return 0;
    const int64_t chunk = fitm_topk_chunk(n), chunks = (n + chunk - 1) / chunk;
    return fitm_topk_counts_bytes(rows) +
           (size_t)(rows * (chunks + FITM_CUDA_TOPK_CAP)) * sizeof(fitm_topkey);
}

extern "C" int fitm_cuda_topk(const float *x, int64_t rows, int64_t n, int64_t ld, int32_t k,
                              void *scratch, float *val, int32_t *id, void *stream)
{
    if (rows < 0 || rows > 65535 || n < 1 || n > INT32_MAX || ld < n || k < 1 ||
        k > FITM_CUDA_TOPK_MAX || k > n || !x || !val || !id)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    if (n <= FITM_CUDA_TOPK_CAP) {
        FITM_LAUNCH(dim3(1, (unsigned)rows), FITM_TOPK_THREADS, 0, fitm_stream(stream),
                    fitm_topk_sort)
        (x, n, ld, k, (const int32_t *)nullptr, (const fitm_topkey *)nullptr, val, id);
        return (int)cudaGetLastError();
    }
    if (!scratch)
        return (int)cudaErrorInvalidValue;
    const int64_t chunk = fitm_topk_chunk(n), chunks = (n + chunk - 1) / chunk;
    int32_t *cnt = (int32_t *)scratch;
    fitm_topkey *cmax = (fitm_topkey *)((char *)scratch + fitm_topk_counts_bytes(rows));
    fitm_topkey *list = cmax + rows * chunks;
    const dim3 grid((unsigned)chunks, (unsigned)rows);
    FITM_LAUNCH(grid, FITM_TOPK_THREADS, 0, fitm_stream(stream), fitm_topk_chunk_first)
    (x, n, ld, chunk, cmax, cnt);
    FITM_LAUNCH(grid, FITM_TOPK_THREADS, 0, fitm_stream(stream), fitm_topk_collect)
    (x, n, ld, chunk, k, cmax, cnt, list);
    FITM_LAUNCH(dim3(1, (unsigned)rows), FITM_TOPK_THREADS, 0, fitm_stream(stream),
                fitm_topk_sort)
    (x, n, ld, k, cnt, list, val, id);
    return (int)cudaGetLastError();
}
