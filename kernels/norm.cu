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
