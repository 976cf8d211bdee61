/* matvec: y = W x with W kept in its stored type, the single-token (decode) step's core.
 * CPU reference: fitm_dequant_row of each row of W, dotted with x in double. */
#include "common.cuh"
#include "kernels.h"
#include "qdecode.cuh"

#define FITM_MV_WARPS 4 /* rows per block, one warp each */
#define FITM_MV_THREADS (FITM_MV_WARPS * FITM_WARP)

/* One warp per row n: y[n] = sum_k W[n, k] * x[k].        W (N, K) stored, x (K), y (N);
 * blockIdx.y selects the row of a batch x (T, K), y (T, N).
 * CHUNKED: lanes take chunks of 8 elements in turn, so a warp reads 256 consecutive elements
 * per step (one K-quant super-block, eight 32-blocks, or 512 B of F16) and x as float4 pairs.
 * Needs K % 8 == 0 (always true for the block types). Otherwise (float types with odd K) lanes
 * take single elements. */
template <int T, bool CHUNKED>
__global__ void __launch_bounds__(FITM_MV_THREADS)
    fitm_matvec_rows(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t N, int64_t K,
                     const float *__restrict__ x, float *__restrict__ y)
{
    const int lane = threadIdx.x % FITM_WARP;
    const int64_t row = (int64_t)blockIdx.x * FITM_MV_WARPS + threadIdx.x / FITM_WARP;
    if (row >= N)
        return;                   /* uniform per warp: the shuffles below see whole warps */
    x += (int64_t)blockIdx.y * K; /* row blockIdx.y of a batch (fitm_cuda_matmul_rows) */
    y += (int64_t)blockIdx.y * N;
    const uint8_t *w = W + row * row_bytes;
    float acc = 0.0f;
    if constexpr (CHUNKED) {
        const float4 *x4 = (const float4 *)x;
        const int64_t n_chunks = K / 8;
        for (int64_t c = lane; c < n_chunks; c += FITM_WARP) {
            float v[8];
            fitm_decode_chunk<T>(w, c, v);
            const float4 a = __ldg(x4 + 2 * c), b = __ldg(x4 + 2 * c + 1);
            acc = fmaf(v[0], a.x, acc);
            acc = fmaf(v[1], a.y, acc);
            acc = fmaf(v[2], a.z, acc);
            acc = fmaf(v[3], a.w, acc);
            acc = fmaf(v[4], b.x, acc);
            acc = fmaf(v[5], b.y, acc);
            acc = fmaf(v[6], b.z, acc);
            acc = fmaf(v[7], b.w, acc);
        }
    } else {
        for (int64_t k = lane; k < K; k += FITM_WARP)
            acc = fmaf(fitm_load1<T>(w, k), __ldg(x + k), acc);
    }
    acc = fitm_warp_sum(acc);
    if (lane == 0)
        y[row] = acc;
}

template <int T>
static int fitm_matvec_launch(const void *W, int64_t N, int64_t K, const float *x, int64_t n_x,
                              float *y, cudaStream_t st)
{
    const int64_t row_bytes = K / fitm_qtraits<T>::BE * fitm_qtraits<T>::BB;
    const dim3 blocks((unsigned)((N + FITM_MV_WARPS - 1) / FITM_MV_WARPS), (unsigned)n_x);
    const uint8_t *w = (const uint8_t *)W;
    if (K % 8 == 0)
        FITM_LAUNCH(blocks, FITM_MV_THREADS, 0, st, fitm_matvec_rows<T, true>)
    (w, row_bytes, N, K, x, y);
    else if constexpr (fitm_qtraits<T>::BE == 1) FITM_LAUNCH(
        blocks, FITM_MV_THREADS, 0, st, fitm_matvec_rows<T, false>)(w, row_bytes, N, K, x, y);
    else return (int)cudaErrorInvalidValue; /* unreachable: K is a multiple of the block */
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
