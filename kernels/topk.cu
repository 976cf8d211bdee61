/* topk: each row's k largest entries, for sampling on the device (only k entries of a logit
 * row leave it). CPU reference (src/compute/ops.c): fitm_ops_topk, whose order "larger value
 * first, equal values lower index first" is total, so the selection is exact: the same list
 * as the reference, ties included, whatever the launch shape. */
#include "common.cuh"
#include "kernels.h"

#define FITM_TOPK_THREADS 256
/* Stage 1 cuts a row into chunks of at least this many entries, at most FITM_TOPK_CHUNKS of
 * them, so a Gemma row (262144) spreads over 64 blocks and a small one stays in one. */
#define FITM_TOPK_MIN_CHUNK 2048
#define FITM_TOPK_CHUNKS 64

/* Whether (v, i) comes before (w, j). Entries with a negative index are empty: never first. */
__device__ __forceinline__ bool fitm_top_before(float v, int32_t i, float w, int32_t j)
{
    return i >= 0 && (j < 0 || v > w || (v == w && i < j));
}

/* The first k entries, in order, of entries [lo, hi) of each row (blockIdx.y) of x (row stride
 * ld), an entry's index being ids[e] when ids is set, else e; into ov/oi at
 * ((row * gridDim.x + blockIdx.x) * k), padded with empty entries (index -1) past hi - lo.
 * Chunk blockIdx.x covers [blockIdx.x * chunk, min(n, ... + chunk)).
 * Selection by k rounds: round r takes, among the entries after round r-1's pick, the first;
 * each round is a scan of the chunk and a block reduction over (value, index) pairs. */
__global__ void fitm_topk_rounds(const float *__restrict__ x, const int32_t *__restrict__ ids,
                                 int64_t n, int64_t ld, int64_t chunk, int32_t k, float *ov,
                                 int32_t *oi)
{
    __shared__ float sv[FITM_TOPK_THREADS / FITM_WARP];
    __shared__ int32_t si[FITM_TOPK_THREADS / FITM_WARP];
    const int64_t row = blockIdx.y;
    const int64_t lo = (int64_t)blockIdx.x * chunk;
    const int64_t hi = lo + chunk < n ? lo + chunk : n;
    const float *xr = x + row * ld;
    const int32_t *ir = ids ? ids + row * ld : NULL;
    const int64_t out = (row * gridDim.x + blockIdx.x) * k;
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int n_warps = blockDim.x / FITM_WARP;
    float pv = 0.0f;
    int32_t pi = -1; /* the previous round's pick; -1: none yet */
    for (int32_t r = 0; r < k; r++) {
        float bv = 0.0f;
        int32_t bi = -1;
        for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
            const float v = xr[e];
            const int32_t i = ir ? ir[e] : (int32_t)e;
            if ((pi < 0 || fitm_top_before(pv, pi, v, i)) && fitm_top_before(v, i, bv, bi))
                bv = v, bi = i;
        }
        for (int o = FITM_WARP / 2; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int32_t i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (fitm_top_before(v, i, bv, bi))
                bv = v, bi = i;
        }
        if (lane == 0)
            sv[warp] = bv, si[warp] = bi;
        __syncthreads();
        bv = sv[0], bi = si[0];
        for (int w = 1; w < n_warps; w++)
            if (fitm_top_before(sv[w], si[w], bv, bi))
                bv = sv[w], bi = si[w];
        __syncthreads(); /* every thread has read sv/si before the next round writes them */
        if (threadIdx.x == 0)
            ov[out + r] = bv, oi[out + r] = bi;
        pv = bv, pi = bi;
        if (bi < 0)
            pi = INT32_MAX, pv = -INFINITY; /* chunk exhausted: later rounds find nothing */
    }
}

static int64_t fitm_topk_chunk(int64_t n)
{
    int64_t c = (n + FITM_TOPK_CHUNKS - 1) / FITM_TOPK_CHUNKS;
    return c < FITM_TOPK_MIN_CHUNK ? FITM_TOPK_MIN_CHUNK : c;
}

extern "C" size_t fitm_cuda_topk_scratch(int64_t rows, int64_t n, int32_t k)
{
    const int64_t chunks = (n + fitm_topk_chunk(n) - 1) / fitm_topk_chunk(n);
    return chunks > 1 ? (size_t)(rows * chunks * k) * (sizeof(float) + sizeof(int32_t)) : 0;
}

extern "C" int fitm_cuda_topk(const float *x, int64_t rows, int64_t n, int64_t ld, int32_t k,
                              void *scratch, float *val, int32_t *id, void *stream)
{
    if (rows < 0 || rows > 65535 || n < 1 || n > INT32_MAX || ld < n || k < 1 ||
        k > FITM_CUDA_TOPK_MAX || k > n || !x || !val || !id)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    const int64_t chunk = fitm_topk_chunk(n), chunks = (n + chunk - 1) / chunk;
    if (chunks == 1) {
        FITM_LAUNCH(dim3(1, (unsigned)rows), FITM_TOPK_THREADS, 0, fitm_stream(stream),
                    fitm_topk_rounds)
        (x, (const int32_t *)nullptr, n, ld, chunk, k, val, id);
        return (int)cudaGetLastError();
    }
    if (!scratch)
        return (int)cudaErrorInvalidValue;
    /* Stage 1: each chunk's first k (a row's first k are among them); stage 2: the first k
     * of those chunks * k candidates, which carry their row indices. */
    float *cv = (float *)scratch;
    int32_t *ci = (int32_t *)(cv + rows * chunks * k);
    FITM_LAUNCH(dim3((unsigned)chunks, (unsigned)rows), FITM_TOPK_THREADS, 0, fitm_stream(stream),
                fitm_topk_rounds)
    (x, (const int32_t *)nullptr, n, ld, chunk, k, cv, ci);
    const int64_t m = chunks * k;
    FITM_LAUNCH(dim3(1, (unsigned)rows), FITM_TOPK_THREADS, 0, fitm_stream(stream),
                fitm_topk_rounds)
    (cv, ci, m, m, m, k, val, id);
    return (int)cudaGetLastError();
}
