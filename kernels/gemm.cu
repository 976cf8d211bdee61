/* gemm: the BATCH class's products on the tensor cores (backend_cuda.c, gpu_weights = bf16):
 * y (T, N) = x (T, K) . W^T with x and W bfloat16 (x rounded by fitm_cuda_to_bf16, W the
 * weight's copy from prepare), F32 accumulation; all T rows in one launch.
 *
 * Tiles (fitm_gemm_tile): a block computes a BM x BN tile of y, each of its warps a WM x WN
 * part of it as WMMA fragments of 16 x 16 (bfloat16 in, F32 accumulators). Three shapes, the
 * largest whose launch has enough blocks to fill the card (GEMM_FILL_BLOCKS): 128 x 128 (8
 * warps of 64 x 32: half the bytes a 64 x 64 tile reads per product, for calls of thousands
 * of rows), 64 x 64 (4 warps of 32 x 32), 64 x 32 (4 warps of 32 x 16: twice the blocks, for
 * the narrow products of short calls). K is walked in steps of 32 through a ring of stages of
 * shared memory filled by asynchronous copies (cp.async, 16 bytes each): while the warps
 * multiply one step, the copies of the next STAGES - 1 are in flight, and no register holds
 * them on the way. One wait and one barrier a step: after them, the step's stage has landed
 * for every thread and the stage last multiplied is free for the copies of the step
 * STAGES - 1 ahead. Staged rows are padded by 8 elements (80 bytes: every fragment starts
 * 32-byte aligned, and the 8 rows of a fragment's row group fall on different banks). The
 * accumulators leave through shared memory (the same bytes, rows of BN + 4 floats), so the
 * write to y is coalesced and the tails of T and N are cut there.
 *
 * Row invariance, by construction: an output element is its accumulator's sum over the k16
 * steps in order, each the mma of its row of the staged x and its column of the staged W;
 * tails of T, N and K are zeros in shared memory (a zero term adds exactly nothing), there is
 * no split-K, and nothing else enters it. So a row's result does not depend on T, on where
 * the row falls in the call or its tile, on the tile's shape or the depth of the ring, or on
 * the rows beside it (the prefix-reuse promise of backend.h). Several outputs of one input (a
 * layer's Q, K, V; gate and up) run side by side in one launch, output z in grid.z, each as its
 * own launch would compute it. */
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <mma.h>

#include "common.cuh"
#include "kernels.h"

#define GEMM_BK 32             /* K per stage */
#define GEMM_LDS (GEMM_BK + 8) /* bfloat16 elements per staged row */
/* A launch of a tile shape with fewer blocks than this leaves SMs idle or alone on a 132-SM
 * card (about two blocks an SM): it takes the next smaller shape. */
#define GEMM_FILL_BLOCKS 264

/* A tile shape: BM x BN of y per block, WM x WN per warp, a ring of STAGES stages, at least
 * MIN_BLOCKS blocks resident an SM (registers capped to allow it). */
template <int BM_, int BN_, int WM_, int WN_, int STAGES_, int MIN_BLOCKS_> struct fitm_gemm_tile {
    static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr int MIN_BLOCKS = MIN_BLOCKS_;
    static constexpr int WARPS_N = BN / WN, THREADS = FITM_WARP * (BM / WM) * WARPS_N;
    static constexpr int FM = WM / 16, FN = WN / 16;
    static constexpr int STAGE = (BM + BN) * GEMM_LDS; /* bfloat16 elements: x rows, W rows */
    static constexpr int RING = STAGES * STAGE * 2, OUT = BM * (BN + 4) * 4;
    static constexpr int SHARED = RING > OUT ? RING : OUT;          /* bytes */
    static constexpr int64_t ROWS_PER_LAUNCH = (int64_t)65535 * BM; /* grid.y's limit */
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "fragments");
    static_assert(BM * 4 % THREADS == 0 && BN * 4 % THREADS == 0, "whole chunks a thread");
};
/* 128 x 128: 80 KiB (opt-in), one block of 8 warps an SM. 64 x 64: 40 KiB. 64 x 32: 45 KiB, a
 * deeper ring for the launches of about one block an SM (o and down at 512 rows), whose copies in
 * flight are what hides the memory's latency. */
typedef fitm_gemm_tile<128, 128, 64, 32, 4, 1> fitm_gemm_wide;
typedef fitm_gemm_tile<64, 64, 32, 32, 4, 1> fitm_gemm_square;
typedef fitm_gemm_tile<64, 32, 32, 16, 6, 1> fitm_gemm_narrow;

/* The outputs of one launch: output z multiplies W[z] (N[z], K) into y[z] (T, N[z]). */
struct fitm_gemm_outs {
    const __nv_bfloat16 *W[FITM_CUDA_MM_MAX_OUTS];
    float *y[FITM_CUDA_MM_MAX_OUTS];
    int64_t N[FITM_CUDA_MM_MAX_OUTS];
};

/* a[z] for the launch's output z, without indexing the parameter struct at run time (which
 * would copy it to local memory) */
template <typename V> __device__ __forceinline__ V fitm_gemm_pick(const V *a, unsigned z)
{
    static_assert(FITM_CUDA_MM_MAX_OUTS == 3, "one case per output");
    return z == 0 ? a[0] : z == 1 ? a[1] : a[2];
}

/* Stages the 8 elements of a row from column col (of K) at dst: one asynchronous 16-byte
 * copy when vec (rows 16-byte aligned, K % 8 == 0) and they lie inside the row; else element
 * by element, zeros outside the matrix (row_in false: the row is past T or N), stored now. A
 * zero adds exactly nothing to a sum, so how a value was staged never changes a result. */
__device__ __forceinline__ void fitm_gemm_chunk(__nv_bfloat16 *dst, const __nv_bfloat16 *row,
                                                bool row_in, int64_t col, int64_t K, bool vec)
{
    if (vec && row_in && col < K) {
        __pipeline_memcpy_async(dst, row + col, 16);
        return;
    }
    unsigned short h[8];
#pragma unroll
    for (int e = 0; e < 8; e++)
        h[e] = row_in && col + e < K ? ((const unsigned short *)row)[col + e] : (unsigned short)0;
    uint4 v;
    v.x = h[0] | (unsigned)h[1] << 16, v.y = h[2] | (unsigned)h[3] << 16;
    v.z = h[4] | (unsigned)h[5] << 16, v.w = h[6] | (unsigned)h[7] << 16;
    *(uint4 *)dst = v;
}

/* Issues the staging of the step at k0 into the stage xs (BM rows of x), ws (BN rows of W):
 * rows of 4 chunks of 8 elements, chunk c of a tile taken by thread c % THREADS. */
template <class C>
__device__ __forceinline__ void
fitm_gemm_stage(__nv_bfloat16 *xs, __nv_bfloat16 *ws, const __nv_bfloat16 *__restrict__ x,
                const __nv_bfloat16 *__restrict__ W, int64_t T, int64_t N, int64_t K, int64_t m0,
                int64_t n0, int64_t k0, bool vec)
{
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < C::BM * 4 / C::THREADS; i++) {
        const int c = tid + C::THREADS * i, r = c / 4, q = 8 * (c % 4);
        fitm_gemm_chunk(xs + r * GEMM_LDS + q, x + (m0 + r) * K, m0 + r < T, k0 + q, K, vec);
    }
#pragma unroll
    for (int i = 0; i < C::BN * 4 / C::THREADS; i++) {
        const int c = tid + C::THREADS * i, r = c / 4, q = 8 * (c % 4);
        fitm_gemm_chunk(ws + r * GEMM_LDS + q, W + (n0 + r) * K, n0 + r < N, k0 + q, K, vec);
    }
}

/* Block (n tile, row tile, output z) of y[z] rows t0 + blockIdx.y * BM .., columns
 * blockIdx.x * BN ..: see the header. */
template <class C>
__global__ void __launch_bounds__(C::THREADS, C::MIN_BLOCKS)
    fitm_gemm_bf16_tiles(const __nv_bfloat16 *__restrict__ x, int64_t T, int64_t K, int64_t t0,
                         fitm_gemm_outs o, int vec)
{
    fitm_grid_begin();
    namespace wmma = nvcuda::wmma;
    constexpr int BM = C::BM, BN = C::BN, FM = C::FM, FN = C::FN, LDC = BN + 4;
    constexpr int STAGES = C::STAGES, STAGE = C::STAGE;
    const int64_t N = fitm_gemm_pick(o.N, blockIdx.z);
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    if (n0 >= N) /* a narrower output of the launch: the whole block leaves, before a barrier */
        return;
    const int64_t m0 = t0 + (int64_t)blockIdx.y * BM;
    const __nv_bfloat16 *__restrict__ W = fitm_gemm_pick(o.W, blockIdx.z);
    FITM_DYNAMIC_SHARED(__align__(128) unsigned char, shared);
    __nv_bfloat16 *ring = (__nv_bfloat16 *)shared; /* STAGES x ((BM + BN), GEMM_LDS) */
    float *ys = (float *)shared;                   /* (BM, LDC), after the K loop */
    const int tid = threadIdx.x, warp = tid / FITM_WARP;
    const int wm = warp / C::WARPS_N * C::WM, wn = warp % C::WARPS_N * C::WN; /* the warp's part */

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    /* The ring: step s lives in stage s % STAGES. Before the loop the first STAGES - 1 steps
     * are issued, one commit each; step s's turn waits until at most STAGES - 2 groups (the
     * steps after s) are in flight, then a barrier makes every thread's copies of s visible
     * and frees the stage of s - 1 (every warp has multiplied it), where step s + STAGES - 1
     * goes. A commit every step, empty past K's end, keeps the count of groups exact. */
    const int64_t steps = (K + GEMM_BK - 1) / GEMM_BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < steps) {
            __nv_bfloat16 *xs = ring + s * STAGE;
            fitm_gemm_stage<C>(xs, xs + BM * GEMM_LDS, x, W, T, N, K, m0, n0, (int64_t)s * GEMM_BK,
                               vec != 0);
        }
        __pipeline_commit();
    }
    for (int64_t s = 0; s < steps; s++) {
        __pipeline_wait_prior(STAGES - 2);
        __syncthreads();
        const int64_t ahead = s + STAGES - 1;
        if (ahead < steps) {
            __nv_bfloat16 *xs = ring + (int)(ahead % STAGES) * STAGE;
            fitm_gemm_stage<C>(xs, xs + BM * GEMM_LDS, x, W, T, N, K, m0, n0, ahead * GEMM_BK,
                               vec != 0);
        }
        __pipeline_commit();
        const __nv_bfloat16 *xs = ring + (int)(s % STAGES) * STAGE, *ws = xs + BM * GEMM_LDS;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; i++)
                wmma::load_matrix_sync(a[i], xs + (wm + 16 * i) * GEMM_LDS + kk, GEMM_LDS);
                /* W's rows are y's columns: the staged (n, k) tile is B (k, n) in column-major */
#pragma unroll
            for (int j = 0; j < FN; j++)
                wmma::load_matrix_sync(b[j], ws + (wn + 16 * j) * GEMM_LDS + kk, GEMM_LDS);
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++)
                    wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
    }
    __pipeline_wait_prior(0); /* only empty groups are left; none may outlive the thread */
    __syncthreads();          /* every warp done with the ring before it holds the output */

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::store_matrix_sync(ys + (wm + 16 * i) * LDC + wn + 16 * j, acc[i][j], LDC,
                                    wmma::mem_row_major);
    __syncthreads();
    float *__restrict__ y = fitm_gemm_pick(o.y, blockIdx.z);
    for (int i = tid; i < BM * BN; i += C::THREADS) {
        const int rr = i / BN, c = i % BN;
        if (m0 + rr < T && n0 + c < N)
            y[(m0 + rr) * N + n0 + c] = ys[rr * LDC + c];
    }
}

/* Blocks of the tile shape C for a call of T rows and n outputs of up to n_max columns. */
template <class C> static int64_t fitm_gemm_blocks(int64_t T, int64_t n_max, int n)
{
    return (T + C::BM - 1) / C::BM * ((n_max + C::BN - 1) / C::BN) * n;
}

/* The call in launches of the tile shape C (grid.y's limit: rows in pieces of 65535 tiles). */
template <class C>
static int fitm_gemm_run(const __nv_bfloat16 *x, int64_t T, int64_t K, const fitm_gemm_outs &o,
                         int64_t n_max, int n, int vec, cudaStream_t stream)
{
    int rc = fitm_smem_optin(fitm_gemm_bf16_tiles<C>, C::SHARED);
    for (int64_t t0 = 0; t0 < T && !rc; t0 += C::ROWS_PER_LAUNCH) {
        const int64_t rows = T - t0 < C::ROWS_PER_LAUNCH ? T - t0 : C::ROWS_PER_LAUNCH;
        const dim3 grid((unsigned)((n_max + C::BN - 1) / C::BN),
                        (unsigned)((rows + C::BM - 1) / C::BM), (unsigned)n);
        FITM_LAUNCH(grid, C::THREADS, C::SHARED, stream, fitm_gemm_bf16_tiles<C>)
        (x, T, K, t0, o, vec);
        rc = (int)cudaGetLastError();
    }
    return rc;
}

extern "C" int fitm_cuda_gemm_bf16(int n, const uint16_t *const *W, const int64_t *N, int64_t K,
                                   const uint16_t *x, int64_t T, float *const *y, void *stream)
{
    return fitm_cuda_gemm_bf16_shape(FITM_CUDA_GEMM_AUTO, n, W, N, K, x, T, y, stream);
}

extern "C" int fitm_cuda_gemm_bf16_shape(int shape, int n, const uint16_t *const *W,
                                         const int64_t *N, int64_t K, const uint16_t *x, int64_t T,
                                         float *const *y, void *stream)
{
    if (shape < FITM_CUDA_GEMM_AUTO || shape > FITM_CUDA_GEMM_128X128 || n < 1 ||
        n > FITM_CUDA_MM_MAX_OUTS || !W || !N || !y || K < 0 || T < 0 || ((uintptr_t)x & 1u))
        return (int)cudaErrorInvalidValue;
    fitm_gemm_outs o = {};
    int64_t n_max = 0;
    for (int i = 0; i < n; i++) {
        if (N[i] < 0 || (N[i] > 0 && K > 0 && !W[i]) || (N[i] > 0 && T > 0 && !y[i]) ||
            ((uintptr_t)W[i] & 1u) || ((uintptr_t)y[i] & 3u))
            return (int)cudaErrorInvalidValue;
        o.W[i] = (const __nv_bfloat16 *)W[i], o.y[i] = y[i], o.N[i] = N[i];
        n_max = N[i] > n_max ? N[i] : n_max;
    }
    if ((T > 0 && K > 0 && !x) || n_max > (int64_t)32 * 0x7fffffff)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || n_max == 0)
        return 0;
    /* 16-byte copies where every row of x and W starts 16-byte aligned */
    int vec = fitm_aligned16(x) && K % 8 == 0;
    for (int i = 0; i < n; i++)
        vec = vec && fitm_aligned16(W[i]);
    const __nv_bfloat16 *xb = (const __nv_bfloat16 *)x;
    cudaStream_t st = fitm_stream(stream);
    if (shape == FITM_CUDA_GEMM_AUTO)
        shape = fitm_gemm_blocks<fitm_gemm_wide>(T, n_max, n) >= GEMM_FILL_BLOCKS
                    ? FITM_CUDA_GEMM_128X128
                : fitm_gemm_blocks<fitm_gemm_square>(T, n_max, n) >= GEMM_FILL_BLOCKS
                    ? FITM_CUDA_GEMM_64X64
                    : FITM_CUDA_GEMM_64X32;
    switch (shape) {
    case FITM_CUDA_GEMM_128X128:
        return fitm_gemm_run<fitm_gemm_wide>(xb, T, K, o, n_max, n, vec, st);
    case FITM_CUDA_GEMM_64X64:
        return fitm_gemm_run<fitm_gemm_square>(xb, T, K, o, n_max, n, vec, st);
    default:
        return fitm_gemm_run<fitm_gemm_narrow>(xb, T, K, o, n_max, n, vec, st);
    }
}
