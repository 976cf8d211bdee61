/* gemm: the BATCH class's products on the tensor cores (backend_cuda.c, gpu_weights = bf16):
 * y (T, N) = x (T, K) . W^T with x in F32, rounded to bfloat16 while it is staged, W the
 * weight's bfloat16 copy (N, K) from prepare, F32 accumulation; all T rows in one launch.
 *
 * Tiles: a block of 128 threads (4 warps) computes a 64 x BN tile of y (BN 64, or 32 when a
 * launch of 64-column tiles would have too few blocks to fill the card: GEMM_FILL_BLOCKS);
 * each warp a 32 x BN / 2 quarter of it as 2 x BN / 32 WMMA fragments of 16 x 16 (bfloat16
 * in, F32 accumulators). K is walked in steps of 64 through two stages of shared memory:
 * while the warps multiply one step (four k16 steps), each thread's loads of the next are in
 * flight in registers (16-byte loads: 8 float4 of x, BN / 16 groups of 8 bfloat16 of W), and
 * then go to the other stage, x rounded by fitm_to_bf16 (the rounding of fitm_cuda_to_bf16);
 * one barrier a step. Staged rows are padded by 8 elements (144 bytes: every fragment starts
 * 32-byte aligned, and a warp's 16 rows do not all fall on the same banks). The accumulators
 * leave through shared memory (the same bytes, rows of BN + 4 floats), so the write to y is
 * coalesced and the tails of T and N are cut there.
 *
 * Row invariance, by construction: an output element is its accumulator's sum over the k16
 * steps in order, each the mma of its row of the staged x and its column of the staged W;
 * tails of T, N and K are zeros in shared memory (a zero term adds exactly nothing), there is
 * no split-K, and nothing else enters it. So a row's result does not depend on T, on where
 * the row falls in the call or its tile, on the tile's width, or on the rows beside it (the
 * prefix-reuse promise of backend.h). Several outputs of one input (a layer's Q, K, V; gate and up) run side by side
 * in one launch, output z in grid.z, each as its own launch would compute it. */
#include <cuda_bf16.h>
#include <mma.h>

#include "common.cuh"
#include "kernels.h"

#define GEMM_BM 64             /* rows of x (and y) per block */
#define GEMM_BK 64             /* K per staging step */
#define GEMM_LDS (GEMM_BK + 8) /* bfloat16 elements per staged row */
#define GEMM_THREADS 128
#define GEMM_ROWS_PER_LAUNCH ((int64_t)65535 * GEMM_BM) /* grid.y's limit */
/* Below this many blocks a launch of 64-column tiles leaves SMs idle or alone on a 132-SM
 * card (about two blocks an SM): it takes 32-column tiles, twice the blocks. */
#define GEMM_FILL_BLOCKS 264

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

/* Shared memory of a block with BN-column tiles: two stages of the staged x and W tiles during
 * the K loop, then the output tile (rows of BN + 4 floats). */
__host__ __device__ constexpr int fitm_gemm_shared(int bn)
{
    return 2 * (GEMM_BM + bn) * GEMM_LDS * 2 > GEMM_BM * (bn + 4) * 4
               ? 2 * (GEMM_BM + bn) * GEMM_LDS * 2
               : GEMM_BM * (bn + 4) * 4;
}

/* One K step's tiles in a thread's registers, on their way from global to shared memory:
 * x as 8 float4 (rows tid / 16 + 8 i, columns 4 (tid % 16)..), W as BN / 16 groups of 8
 * bfloat16 (rows tid / 8 + 16 i, columns 8 (tid % 8)..). */
template <int BN> struct fitm_gemm_regs {
    float4 x[GEMM_BM * GEMM_BK / 4 / GEMM_THREADS];
    uint4 w[BN * GEMM_BK / 8 / GEMM_THREADS];
};

/* Loads the step at k0 into r. vec: x and W rows are 16-byte aligned (x 16-byte aligned,
 * K % 8 == 0, every W 16-byte aligned); then a step that lies inside K loads whole float4 and
 * uint4, and only a step past K's end (or a call without alignment) loads element by element,
 * zeros outside T, N and K. A zero adds exactly nothing to a sum, so how a value was loaded
 * never changes a result. */
template <int BN>
__device__ __forceinline__ void fitm_gemm_load(fitm_gemm_regs<BN> &r, const float *__restrict__ x,
                                               const __nv_bfloat16 *__restrict__ W, int64_t T,
                                               int64_t N, int64_t K, int64_t m0, int64_t n0,
                                               int64_t k0, bool vec)
{
    const int tid = threadIdx.x;
    const bool whole = vec && k0 + GEMM_BK <= K;
#pragma unroll
    for (int i = 0; i < GEMM_BM * GEMM_BK / 4 / GEMM_THREADS; i++) {
        const int64_t row = m0 + tid / 16 + 8 * i, col = k0 + 4 * (tid % 16);
        float4 v = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row < T) {
            const float *p = x + row * K + col;
            if (whole) {
                v = __ldg((const float4 *)p);
            } else {
                v.x = col < K ? p[0] : 0.0f;
                v.y = col + 1 < K ? p[1] : 0.0f;
                v.z = col + 2 < K ? p[2] : 0.0f;
                v.w = col + 3 < K ? p[3] : 0.0f;
            }
        }
        r.x[i] = v;
    }
#pragma unroll
    for (int i = 0; i < BN * GEMM_BK / 8 / GEMM_THREADS; i++) {
        const int64_t n = n0 + tid / 8 + 16 * i, col = k0 + 8 * (tid % 8);
        uint4 v = {0u, 0u, 0u, 0u};
        if (n < N) {
            const __nv_bfloat16 *p = W + n * K + col;
            if (whole) {
                v = __ldg((const uint4 *)p);
            } else {
                unsigned short h[8];
#pragma unroll
                for (int e = 0; e < 8; e++)
                    h[e] = col + e < K ? ((const unsigned short *)p)[e] : (unsigned short)0;
                v.x = h[0] | (unsigned)h[1] << 16, v.y = h[2] | (unsigned)h[3] << 16;
                v.z = h[4] | (unsigned)h[5] << 16, v.w = h[6] | (unsigned)h[7] << 16;
            }
        }
        r.w[i] = v;
    }
}

/* Stores the registers' step into one stage of shared memory, x rounded to bfloat16 (the
 * rounding of fitm_cuda_to_bf16). */
template <int BN>
__device__ __forceinline__ void fitm_gemm_store(const fitm_gemm_regs<BN> &r, __nv_bfloat16 *xs,
                                                __nv_bfloat16 *ws)
{
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < GEMM_BM * GEMM_BK / 4 / GEMM_THREADS; i++) {
        __nv_bfloat16 *d = xs + (tid / 16 + 8 * i) * GEMM_LDS + 4 * (tid % 16);
        d[0] = fitm_to_bf16(r.x[i].x), d[1] = fitm_to_bf16(r.x[i].y);
        d[2] = fitm_to_bf16(r.x[i].z), d[3] = fitm_to_bf16(r.x[i].w);
    }
#pragma unroll
    for (int i = 0; i < BN * GEMM_BK / 8 / GEMM_THREADS; i++)
        *(uint4 *)(ws + (tid / 8 + 16 * i) * GEMM_LDS + 8 * (tid % 8)) = r.w[i];
}

/* Block (n tile, row tile, output z) of y[z] rows t0 + blockIdx.y * 64 .., columns
 * blockIdx.x * BN ..: see the header. BN is 64 or 32: each of the 4 warps computes a
 * 32 x BN / 2 quarter of the tile as 2 x BN / 32 fragments. */
template <int BN>
__global__ void __launch_bounds__(GEMM_THREADS)
    fitm_gemm_bf16_tiles(const float *__restrict__ x, int64_t T, int64_t K, int64_t t0,
                         fitm_gemm_outs o, int vec)
{
    fitm_grid_begin();
    namespace wmma = nvcuda::wmma;
    constexpr int FN = BN / 32, LDC = BN + 4, STAGE = (GEMM_BM + BN) * GEMM_LDS;
    const int64_t N = fitm_gemm_pick(o.N, blockIdx.z);
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    if (n0 >= N) /* a narrower output of the launch: the whole block leaves, before a barrier */
        return;
    const int64_t m0 = t0 + (int64_t)blockIdx.y * GEMM_BM;
    const __nv_bfloat16 *__restrict__ W = fitm_gemm_pick(o.W, blockIdx.z);
    FITM_DYNAMIC_SHARED(__align__(128) unsigned char, shared);
    __nv_bfloat16 *stage = (__nv_bfloat16 *)shared; /* 2 x ((64 + BN), GEMM_LDS): x rows, W rows */
    float *ys = (float *)shared;                    /* (64, LDC), after the K loop */
    const int tid = threadIdx.x, warp = tid / FITM_WARP;
    const int wm = warp / 2 * 32, wn = warp % 2 * (BN / 2); /* the warp's quarter of the tile */

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][FN];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    /* Two stages: while the warps multiply the step in one, the next step's loads are in
     * flight in registers and then go to the other; one barrier a step (the stage written
     * was last read before the previous step's barrier). */
    fitm_gemm_regs<BN> r;
    fitm_gemm_load<BN>(r, x, W, T, N, K, m0, n0, 0, vec != 0);
    fitm_gemm_store<BN>(r, stage, stage + GEMM_BM * GEMM_LDS);
    __syncthreads();
    int cur = 0;
    for (int64_t k0 = 0; k0 < K; k0 += GEMM_BK) {
        const bool more = k0 + GEMM_BK < K;
        if (more)
            fitm_gemm_load<BN>(r, x, W, T, N, K, m0, n0, k0 + GEMM_BK, vec != 0);
        const __nv_bfloat16 *xs = stage + cur * STAGE, *ws = xs + GEMM_BM * GEMM_LDS;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(a[i], xs + (wm + 16 * i) * GEMM_LDS + kk, GEMM_LDS);
            /* W's rows are y's columns: the staged (n, k) tile is B (k, n) in column-major */
#pragma unroll
            for (int j = 0; j < FN; j++)
                wmma::load_matrix_sync(b[j], ws + (wn + 16 * j) * GEMM_LDS + kk, GEMM_LDS);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < FN; j++)
                    wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        if (more) {
            __nv_bfloat16 *nx = stage + (cur ^ 1) * STAGE;
            fitm_gemm_store<BN>(r, nx, nx + GEMM_BM * GEMM_LDS);
        }
        __syncthreads();
        cur ^= 1;
    }

#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::store_matrix_sync(ys + (wm + 16 * i) * LDC + wn + 16 * j, acc[i][j], LDC,
                                    wmma::mem_row_major);
    __syncthreads();
    float *__restrict__ y = fitm_gemm_pick(o.y, blockIdx.z);
    for (int i = tid; i < GEMM_BM * BN; i += GEMM_THREADS) {
        const int rr = i / BN, c = i % BN;
        if (m0 + rr < T && n0 + c < N)
            y[(m0 + rr) * N + n0 + c] = ys[rr * LDC + c];
    }
}

extern "C" int fitm_cuda_gemm_bf16(int n, const uint16_t *const *W, const int64_t *N, int64_t K,
                                   const float *x, int64_t T, float *const *y, void *stream)
{
    if (n < 1 || n > FITM_CUDA_MM_MAX_OUTS || !W || !N || !y || K < 0 || T < 0 ||
        ((uintptr_t)x & 3u))
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
    /* 16-byte loads where every row of x and W starts 16-byte aligned */
    int vec = fitm_aligned16(x) && K % 8 == 0;
    for (int i = 0; i < n; i++)
        vec = vec && fitm_aligned16(W[i]);
    for (int64_t t0 = 0; t0 < T; t0 += GEMM_ROWS_PER_LAUNCH) {
        const int64_t rows = T - t0 < GEMM_ROWS_PER_LAUNCH ? T - t0 : GEMM_ROWS_PER_LAUNCH;
        const unsigned row_tiles = (unsigned)((rows + GEMM_BM - 1) / GEMM_BM);
        const int64_t wide = (n_max + 63) / 64 * row_tiles * n;
        if (wide >= GEMM_FILL_BLOCKS) {
            const dim3 grid((unsigned)((n_max + 63) / 64), row_tiles, (unsigned)n);
            FITM_LAUNCH(grid, GEMM_THREADS, fitm_gemm_shared(64), fitm_stream(stream),
                        fitm_gemm_bf16_tiles<64>)
            (x, T, K, t0, o, vec);
        } else {
            const dim3 grid((unsigned)((n_max + 31) / 32), row_tiles, (unsigned)n);
            FITM_LAUNCH(grid, GEMM_THREADS, fitm_gemm_shared(32), fitm_stream(stream),
                        fitm_gemm_bf16_tiles<32>)
            (x, T, K, t0, o, vec);
        }
        const int rc = (int)cudaGetLastError();
        if (rc)
            return rc;
    }
    return 0;
}
