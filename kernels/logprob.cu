/* logprob: each logit row's log-probabilities at a few ids, for /rerank's scored rows (the
 * query-likelihood token, relevance's yes/no ids), so n_pick doubles of a row leave the
 * device instead of the row. CPU reference (src/compute/ops.c): fitm_ops_logprob. The
 * maximum is the same float; the sum of exponentials is of the same values in double, added
 * in another order (each thread its strided entries, then fitm_block_sum_d), each term the
 * device's exp (within 1 ulp of e^d) where the host's is fitm_ops_exp_le0 (within 1.5): two
 * sums of n positive terms agree to a relative (2n + 3) 2^-53 (recursive summation bounds
 * (n - 1) 2^-53 for any order, plus the terms' own 2 and 3 2^-53), and with log's and the
 * subtractions' roundings a log-probability is within
 * (2n + 8) 2^-53 + 2^-50 (|lp| + ln n) of the host's (kernels.h). */
#include "common.cuh"
#include "kernels.h"

#define FITM_LOGPROB_THREADS 256

/* One block per row (blockIdx.x) of x (rows, n): the row's maximum m (float), z = sum of
 * exp((double)x - m) in double, then lp[row, j] = (double)x[pick[row, j]] - m - log(z). */
__global__ void fitm_logprob_rows(const float *__restrict__ x, int64_t n,
                                  const int32_t *__restrict__ pick, int32_t n_pick,
                                  double *__restrict__ lp)
{
    fitm_grid_begin();
    __shared__ float sm[FITM_WARP];
    __shared__ double sz[FITM_WARP];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * n;
    float m = -INFINITY;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
        m = xr[e] > m ? xr[e] : m;
    m = fitm_block_reduce(m, sm, true);
    double z = 0.0;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
        z += exp((double)xr[e] - (double)m);
    const double lz = log(fitm_block_sum_d(z, sz, FITM_LOGPROB_THREADS / FITM_WARP));
    for (int32_t j = threadIdx.x; j < n_pick; j += blockDim.x)
        lp[row * n_pick + j] = (double)xr[pick[row * n_pick + j]] - (double)m - lz;
}

extern "C" int fitm_cuda_logprob(const float *x, int64_t rows, int64_t n, const int32_t *pick,
                                 int32_t n_pick, double *lp, void *stream)
{
    if (rows < 0 || rows > INT32_MAX || n < 1 || n > INT32_MAX || n_pick < 1 ||
        n_pick > FITM_CUDA_PICK_MAX || !x || !pick || !lp)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    FITM_LAUNCH((unsigned)rows, FITM_LOGPROB_THREADS, 0, fitm_stream(stream), fitm_logprob_rows)
    (x, n, pick, n_pick, lp);
    return (int)cudaGetLastError();
}
