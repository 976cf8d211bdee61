/* matvec: y = W x with W kept in its stored type, the single-token (decode) step's core.
 * CPU reference: fitm_dequant_row of each row of W, dotted with x in double. */
#include "common.cuh"
#include "kernels.h"
#include "qdecode.cuh"

#define FITM_MV_WARPS 4 /* rows per block, one warp each */
#define FITM_MV_THREADS (FITM_MV_WARPS * FITM_WARP)
#define FITM_MV_BATCH 8 /* batch rows per block: a weight chunk is decoded once for all of them */

/* One warp per row n: y[t, n] = sum_k W[n, k] * x[t, k] for the batch rows t of blockIdx.y's
 * group of R (fitm_cuda_matmul_rows: a decode step of several sequences). W (N, K) stored,
 * x (n_x, K), y (n_x, N). The warp decodes each piece of W once and applies it to every row
 * of its group, so a step of R rows reads the weights once, as one row does.
 * CHUNKED: lanes take chunks of 8 elements in turn, so a warp reads 256 consecutive elements
 * per step (one K-quant super-block, eight 32-blocks, or 512 B of F16) and x as float4 pairs.
 * Needs K % 8 == 0 (always true for the block types). Otherwise (float types with odd K) lanes
 * take single elements.
 * Each batch row has its own accumulator, fed in the same order (lane, chunk, element) and
 * reduced by the same shuffle tree whatever R and n_x are: a row's result does not depend on
 * the rows beside it (test_cuda_kernels: matmul_rows). */
template <int T, bool CHUNKED, int R>
__global__ void __launch_bounds__(FITM_MV_THREADS)
    fitm_matvec_rows(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t N, int64_t K,
                     const float *__restrict__ x, int64_t n_x, float *__restrict__ y)
{
    const int lane = threadIdx.x % FITM_WARP;
    const int64_t row = (int64_t)blockIdx.x * FITM_MV_WARPS + threadIdx.x / FITM_WARP;
    if (row >= N)
        return; /* uniform per warp: the shuffles below see whole warps */
    const int64_t t0 = (int64_t)blockIdx.y * R;
    const int nt = n_x - t0 < R ? (int)(n_x - t0) : R; /* uniform per block */
    x += t0 * K;
    y += t0 * N;
    const uint8_t *w = W + row * row_bytes;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        acc[r] = 0.0f;
    if constexpr (CHUNKED) {
        const int64_t n_chunks = K / 8;
        for (int64_t c = lane; c < n_chunks; c += FITM_WARP) {
            float v[8];
            fitm_decode_chunk<T>(w, c, v);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nt)
                    break;
                const float4 *x4 = (const float4 *)(x + r * K);
                const float4 a = __ldg(x4 + 2 * c), b = __ldg(x4 + 2 * c + 1);
                float s = acc[r];
                s = fmaf(v[0], a.x, s);
                s = fmaf(v[1], a.y, s);
                s = fmaf(v[2], a.z, s);
                s = fmaf(v[3], a.w, s);
                s = fmaf(v[4], b.x, s);
                s = fmaf(v[5], b.y, s);
                s = fmaf(v[6], b.z, s);
                acc[r] = fmaf(v[7], b.w, s);
            }
        }
    } else {
        for (int64_t k = lane; k < K; k += FITM_WARP) {
            const float v = fitm_load1<T>(w, k);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nt)
                    break;
                acc[r] = fmaf(v, __ldg(x + r * K + k), acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= nt)
            break;
        const float s = fitm_warp_sum(acc[r]);
        if (lane == 0)
            y[r * N + row] = s;
    }
}

/* R = 1 for a single row (no registers held for rows that are not there), else groups of
 * FITM_MV_BATCH rows; both sum every row alike. */
template <int T, bool CHUNKED>
static void fitm_matvec_go(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                           const float *x, int64_t n_x, float *y, cudaStream_t st)
{
    const unsigned gx = (unsigned)((N + FITM_MV_WARPS - 1) / FITM_MV_WARPS);
    if (n_x == 1)
        FITM_LAUNCH(dim3(gx, 1), FITM_MV_THREADS, 0, st, fitm_matvec_rows<T, CHUNKED, 1>)
    (w, row_bytes, N, K, x, n_x, y);
    else FITM_LAUNCH(dim3(gx, (unsigned)((n_x + FITM_MV_BATCH - 1) / FITM_MV_BATCH)),
                     FITM_MV_THREADS, 0, st,
                     fitm_matvec_rows<T, CHUNKED, FITM_MV_BATCH>)(w, row_bytes, N, K, x, n_x, y);
}

template <int T>
static int fitm_matvec_launch(const void *W, int64_t N, int64_t K, const float *x, int64_t n_x,
                              float *y, cudaStream_t st)
{
    const int64_t row_bytes = K / fitm_qtraits<T>::BE * fitm_qtraits<T>::BB;
    const uint8_t *w = (const uint8_t *)W;
    if (K % 8 == 0)
        fitm_matvec_go<T, true>(w, row_bytes, N, K, x, n_x, y, st);
    else if constexpr (fitm_qtraits<T>::BE == 1)
        fitm_matvec_go<T, false>(w, row_bytes, N, K, x, n_x, y, st);
    else
        return (int)cudaErrorInvalidValue; /* unreachable: K is a multiple of the block */
    return (int)cudaGetLastError();
}

/* y (n_x, N) = x (n_x, K) . W^T after the checks of fitm_cuda_matvec. */
static int fitm_matvec_any(fitm_dtype t, const void *W, int64_t N, int64_t K, const float *x,
                           int64_t n_x, float *y, void *stream)
{
    if (!fitm_cuda_dequant_supported(t) || N < 0 || K < 0 || K % fitm_qblock_elems(t) != 0 || !W ||
        !x || !y || !fitm_aligned16(W) || !fitm_aligned16(x) || n_x < 0 || n_x > 65535)
        return (int)cudaErrorInvalidValue;
    if ((N + FITM_MV_WARPS - 1) / FITM_MV_WARPS > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || n_x == 0)
        return 0;
    cudaStream_t st = fitm_stream(stream);
    // clang-format off
    switch (t) {
    case FITM_DTYPE_F32: return fitm_matvec_launch<FITM_DTYPE_F32>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_F16: return fitm_matvec_launch<FITM_DTYPE_F16>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_BF16: return fitm_matvec_launch<FITM_DTYPE_BF16>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q4_0: return fitm_matvec_launch<FITM_DTYPE_Q4_0>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q5_0: return fitm_matvec_launch<FITM_DTYPE_Q5_0>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q8_0: return fitm_matvec_launch<FITM_DTYPE_Q8_0>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q4_K: return fitm_matvec_launch<FITM_DTYPE_Q4_K>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q5_K: return fitm_matvec_launch<FITM_DTYPE_Q5_K>(W, N, K, x, n_x, y, st);
    case FITM_DTYPE_Q6_K: return fitm_matvec_launch<FITM_DTYPE_Q6_K>(W, N, K, x, n_x, y, st);
    default: return (int)cudaErrorInvalidValue;
    }
    // clang-format on
}

extern "C" int fitm_cuda_matvec(fitm_dtype t, const void *W, int64_t N, int64_t K, const float *x,
                                float *y, void *stream)
{
    return fitm_matvec_any(t, W, N, K, x, 1, y, stream);
}

extern "C" int fitm_cuda_matmul_rows(fitm_dtype t, const void *W, int64_t N, int64_t K,
                                     const float *x, int64_t T, float *y, void *stream)
{
    return fitm_matvec_any(t, W, N, K, x, T, y, stream);
}
