/* gemm: the BATCH class's products on the tensor cores (backend_cuda.c, gpu_weights = bf16):
 * y (T, N) = x (T, K) . W^T with x in F32, rounded to bfloat16 while it is staged, W the
 * weight's bfloat16 copy (N, K) from prepare, F32 accumulation; all T rows in one launch.
 *
 * Tiles: a block of 128 threads (4 warps) computes a 64 x 64 tile of y; each warp a 32 x 32
 * quarter of it as 2 x 2 WMMA fragments of 16 x 16 (bfloat16 in, F32 accumulators). K is
 * walked in steps of 32: the block stages 64 rows of x (rounded by fitm_to_bf16, the rounding
 * of fitm_cuda_to_bf16) and 64 rows of W into shared memory, rows padded by 8 elements (80
 * bytes: every fragment starts 32-byte aligned, and a warp's 16 rows do not all fall on the
 * same banks), then each warp runs two k16 steps of 2 x 2 mma. The accumulators leave through
 * shared memory (the same bytes, rows of 64 + 4 floats), so the write to y is coalesced and
 * the tails of T and N are cut there. 64 x 64 tiles give Gemma 3 270M's products (N 256 to
 * 2048) 4 to 32 column tiles times T / 64 row tiles: a 512-token prompt fills a 132-SM card
 * with 32 to 256 blocks per product, 20 KiB of shared memory each, several per SM.
 *
 * Row invariance, by construction: an output element is its accumulator's sum over the K
 * steps in order, each step the mma of its row of the staged x and its column of the staged W;
 * tails of T, N and K are zeros in shared memory (a zero term adds exactly nothing), there is
 * no split-K, and nothing else enters it. So a row's result does not depend on T, on where
 * the row falls in the call or its tile, or on the rows beside it (the prefix-reuse promise of
 * backend.h). Several outputs of one input (a layer's Q, K, V; gate and up) run side by side
 * in one launch, output z in grid.z, each as its own launch would compute it. */
#include <cuda_bf16.h>
#include <mma.h>

#include "common.cuh"
#include "kernels.h"

#define GEMM_BM 64             /* rows of x (and y) per block */
#define GEMM_BN 64             /* rows of W (columns of y) per block */
#define GEMM_BK 32             /* K per staging step */
#define GEMM_LDS (GEMM_BK + 8) /* bfloat16 elements per staged row */
#define GEMM_LDC (GEMM_BN + 4) /* floats per row of the staged output tile */
#define GEMM_THREADS 128
#define GEMM_ROWS_PER_LAUNCH ((int64_t)65535 * GEMM_BM) /* grid.y's limit */

/* Shared memory: the staged x and W tiles during the K loop, then the output tile. */
#define GEMM_SHARED_STAGE (2 * GEMM_BM * GEMM_LDS * 2)
#define GEMM_SHARED_OUT (GEMM_BM * GEMM_LDC * 4)
#define GEMM_SHARED (GEMM_SHARED_STAGE > GEMM_SHARED_OUT ? GEMM_SHARED_STAGE : GEMM_SHARED_OUT)

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

/* Block (n tile, row tile, output z) of y[z] rows t0 + blockIdx.y * 64 .. : see the header. */
__global__ void __launch_bounds__(GEMM_THREADS)
    fitm_gemm_bf16_tiles(const float *__restrict__ x, int64_t T, int64_t K, int64_t t0,
                         fitm_gemm_outs o)
{
    namespace wmma = nvcuda::wmma;
    const int64_t N = fitm_gemm_pick(o.N, blockIdx.z);
    const int64_t n0 = (int64_t)blockIdx.x * GEMM_BN;
    if (n0 >= N) /* a narrower output of the launch: the whole block leaves, before a barrier */
        return;
    const int64_t m0 = t0 + (int64_t)blockIdx.y * GEMM_BM;
    const __nv_bfloat16 *__restrict__ W = fitm_gemm_pick(o.W, blockIdx.z);
    FITM_DYNAMIC_SHARED(__align__(128) unsigned char, shared);
    __nv_bfloat16 *xs = (__nv_bfloat16 *)shared; /* (64, GEMM_LDS) */
    __nv_bfloat16 *ws = xs + GEMM_BM * GEMM_LDS; /* (64, GEMM_LDS) */
    float *ys = (float *)shared;                 /* (64, GEMM_LDC), after the K loop */
    const int tid = threadIdx.x, warp = tid / FITM_WARP;
    const int wm = warp / 2 * 32, wn = warp % 2 * 32; /* the warp's quarter of the tile */
    const __nv_bfloat16 zero = fitm_to_bf16(0.0f);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    for (int64_t k0 = 0; k0 < K; k0 += GEMM_BK) {
        /* a warp stages one row's 32 consecutive values of x, and of W: coalesced reads */
        for (int i = tid; i < GEMM_BM * GEMM_BK; i += GEMM_THREADS) {
            const int r = i / GEMM_BK, k = i % GEMM_BK;
            const int64_t col = k0 + k, row = m0 + r, n = n0 + r;
            xs[r * GEMM_LDS + k] = fitm_to_bf16(row < T && col < K ? x[row * K + col] : 0.0f);
            ws[r * GEMM_LDS + k] = n < N && col < K ? W[n * K + col] : zero;
        }
        __syncthreads();
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(a[i], xs + (wm + 16 * i) * GEMM_LDS + kk, GEMM_LDS);
            /* W's rows are y's columns: the staged (n, k) tile is B (k, n) in column-major */
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(b[j], ws + (wn + 16 * j) * GEMM_LDS + kk, GEMM_LDS);
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++)
                    wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads(); /* the tiles are read before the next step overwrites them */
    }

    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(ys + (wm + 16 * i) * GEMM_LDC + wn + 16 * j, acc[i][j],
                                    GEMM_LDC, wmma::mem_row_major);
    __syncthreads();
    float *__restrict__ y = fitm_gemm_pick(o.y, blockIdx.z);
    for (int i = tid; i < GEMM_BM * GEMM_BN; i += GEMM_THREADS) {
        const int r = i / GEMM_BN, c = i % GEMM_BN;
        if (m0 + r < T && n0 + c < N)
            y[(m0 + r) * N + n0 + c] = ys[r * GEMM_LDC + c];
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
    if ((T > 0 && K > 0 && !x) || n_max > (int64_t)GEMM_BN * 0x7fffffff)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || n_max == 0)
        return 0;
    for (int64_t t0 = 0; t0 < T; t0 += GEMM_ROWS_PER_LAUNCH) {
        const int64_t rows = T - t0 < GEMM_ROWS_PER_LAUNCH ? T - t0 : GEMM_ROWS_PER_LAUNCH;
        const dim3 grid((unsigned)((n_max + GEMM_BN - 1) / GEMM_BN),
                        (unsigned)((rows + GEMM_BM - 1) / GEMM_BM), (unsigned)n);
        FITM_LAUNCH(grid, GEMM_THREADS, GEMM_SHARED, fitm_stream(stream), fitm_gemm_bf16_tiles)
        (x, T, K, t0, o);
        const int rc = (int)cudaGetLastError();
        if (rc)
            return rc;
    }
    return 0;
}
