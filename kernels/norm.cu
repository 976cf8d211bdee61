/* norm: row-wise reductions — RMSNorm and softmax. One block per row.
 * CPU references: fitm_ops_rmsnorm, fitm_ops_softmax (src/ops.c). */
#include "common.cuh"
#include "kernels.h"

#define FITM_ROW_THREADS 256

/* y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * (w + w_offset).   x, y (T, C); block t.
 * The reference sums in double; float here, reduced as a tree, is well within 1e-6 relative
 * for model dims. y == x is safe: every x[t,c] is read (pass 1) before the block-wide barrier
 * inside the reduction, and pass 2 reads and writes the same element from the same thread. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_rmsnorm_rows(float *y, const float *x, const float *__restrict__ w, float w_offset,
                      int64_t C, float eps)
{
    __shared__ float shm[32];
    const float *xr = x + (int64_t)blockIdx.x * C;
    float *yr = y + (int64_t)blockIdx.x * C;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        ss = fmaf(xr[c], xr[c], ss);
    ss = fitm_block_reduce(ss, shm, false);
    const float scale = 1.0f / sqrtf(ss / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = xr[c] * scale * (w[c] + w_offset);
}

/* The residual add and the next RMSNorm in one pass: x[t,:] += r[t,:], then y[t,:] =
 * rmsnorm(x[t,:]) as fitm_rmsnorm_rows computes it. Each thread adds the elements it then
 * squares, in the same order, so both results are bit for bit those of fitm_add_elems followed
 * by fitm_rmsnorm_rows. y may equal x. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_add_rmsnorm_rows(float *y, float *x, const float *__restrict__ r,
                          const float *__restrict__ w, float w_offset, int64_t C, float eps)
{
    __shared__ float shm[32];
    float *xr = x + (int64_t)blockIdx.x * C;
    const float *rr = r + (int64_t)blockIdx.x * C;
    float *yr = y + (int64_t)blockIdx.x * C;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = xr[c] + rr[c];
        xr[c] = v;
        ss = fmaf(v, v, ss);
    }
    ss = fitm_block_reduce(ss, shm, false);
    const float scale = 1.0f / sqrtf(ss / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = xr[c] * scale * (w[c] + w_offset);
}

/* Attention's query and key heads before the scores, one block per head vector (block
 * t * (H + Hkv) + h: query head h of row t for h < H, else key head h - H): the vector normed
 * in place as fitm_rmsnorm_rows norms a row of D (same block size, same reduction, same
 * expressions) where its weight is given, then RoPE'd as fitm_rope_table_pairs does it with
 * row t of the table cs (T, n_rot/2, {cos, sin}). The normed values go through memory and a
 * barrier to the pair's threads, as they went through memory between the two kernels, so
 * both results are bit for bit those of the separate launches. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_qk_norm_rope_heads(float *q, float *k, const float *__restrict__ q_w,
                            const float *__restrict__ k_w, float w_offset, int64_t H, int64_t Hkv,
                            int64_t D, int64_t n_rot, const float *__restrict__ cs, int neox,
                            float eps)
{
    __shared__ float shm[32];
    const int64_t t = blockIdx.x / (H + Hkv), h = blockIdx.x % (H + Hkv);
    const bool is_q = h < H; /* uniform per block, as w below */
    float *v = is_q ? q + (t * H + h) * D : k + (t * Hkv + h - H) * D;
    const float *w = is_q ? q_w : k_w;
    if (w) {
        float ss = 0.0f;
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
            ss = fmaf(v[c], v[c], ss);
        ss = fitm_block_reduce(ss, shm, false);
        const float scale = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
            v[c] = v[c] * scale * (w[c] + w_offset);
        __syncthreads(); /* a pair's elements were normed by other threads */
    }
    const int64_t half = n_rot / 2;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x)
        fitm_rope_pair(v, neox ? i : 2 * i, neox ? i + half : 2 * i + 1, cs[t * n_rot + 2 * i],
                       cs[t * n_rot + 2 * i + 1]);
}

/* Row r of x (n_rows, ld): x[r, 0..n) = softmax(x[r, 0..n)), in place; block r. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_softmax_rows(float *x, int64_t n, int64_t ld)
{
    __shared__ float shm[32];
    float *xr = x + (int64_t)blockIdx.x * ld;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        mx = fmaxf(mx, xr[i]);
    mx = fitm_block_reduce(mx, shm, true);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(xr[i] - mx);
        xr[i] = e;
        sum += e;
    }
    sum = fitm_block_reduce(sum, shm, false);
    const float inv = 1.0f / sum;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        xr[i] *= inv;
}

extern "C" int fitm_cuda_rmsnorm(float *y, const float *x, const float *w, float w_offset,
                                 int64_t T, int64_t C, float eps, void *stream)
{
    if (T < 0 || C < 0 || T > INT32_MAX || !y || !x || !w)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || C == 0)
        return 0;
    FITM_LAUNCH((unsigned)T, FITM_ROW_THREADS, 0, fitm_stream(stream), fitm_rmsnorm_rows)
    (y, x, w, w_offset, C, eps);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_add_rmsnorm(float *y, float *x, const float *r, const float *w,
                                     float w_offset, int64_t T, int64_t C, float eps, void *stream)
{
    if (T < 0 || C < 0 || T > INT32_MAX || !y || !x || !r || !w)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || C == 0)
        return 0;
    FITM_LAUNCH((unsigned)T, FITM_ROW_THREADS, 0, fitm_stream(stream), fitm_add_rmsnorm_rows)
    (y, x, r, w, w_offset, C, eps);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_qk_norm_rope(float *q, float *k, const float *q_w, const float *k_w,
                                      float w_offset, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                      int64_t n_rot, const float *cs, int neox, float eps,
                                      void *stream)
{
    if (T < 0 || H < 0 || Hkv < 0 || D < 0 || n_rot < 2 || n_rot > D || n_rot % 2 != 0 ||
        (H > 0 && !q) || (Hkv > 0 && !k) || !cs)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || H + Hkv == 0)
        return 0;
    if (T > INT32_MAX / (H + Hkv))
        return (int)cudaErrorInvalidValue;
    FITM_LAUNCH((unsigned)(T * (H + Hkv)), FITM_ROW_THREADS, 0, fitm_stream(stream),
                fitm_qk_norm_rope_heads)
    (q, k, q_w, k_w, w_offset, H, Hkv, D, n_rot, cs, neox, eps);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_softmax_rows(float *x, int64_t n_rows, int64_t n, int64_t ld, void *stream)
{
    if (n_rows < 0 || n < 0 || ld < n || n_rows > INT32_MAX || !x)
        return (int)cudaErrorInvalidValue;
    if (n_rows == 0 || n == 0)
        return 0;
    FITM_LAUNCH((unsigned)n_rows, FITM_ROW_THREADS, 0, fitm_stream(stream), fitm_softmax_rows)
    (x, n, ld);
    return (int)cudaGetLastError();
}
