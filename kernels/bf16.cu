/* bf16: F32 rows rounded to bfloat16 for the tensor-core products of the BATCH class
 * (backend_cuda.c): a weight once at load, a product's activations before each launch of the
 * GEMM (kernels/gemm.cu), whose ring of asynchronous copies cannot round what it copies.
 * CPU reference: round to nearest even on the top 16 bits of the float (tests/test_cuda_kernels.c
 * has its own, written from the definition). */
#include <cuda_bf16.h>

#include "common.cuh"
#include "kernels.h"

/* dst (rows_out, n) = bf16(x (rows, n)) for the first rows, 0 for the rest: one thread per
 * element, grid-stride. */
__global__ void fitm_to_bf16_rows(const float *__restrict__ x, __nv_bfloat16 *__restrict__ dst,
                                  int64_t n_in, int64_t n_out)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_out; i += stride)
        dst[i] = fitm_to_bf16(i < n_in ? x[i] : 0.0f);
}

extern "C" int fitm_cuda_to_bf16(const float *x, int64_t rows, int64_t n, int64_t rows_out,
                                 uint16_t *dst, void *stream)
{
    if (rows < 0 || n < 0 || rows_out < rows || (rows > 0 && n > 0 && !x) ||
        (rows_out > 0 && n > 0 && !dst) || ((uintptr_t)x & 3u) || ((uintptr_t)dst & 1u))
        return (int)cudaErrorInvalidValue;
    const int64_t n_out = rows_out * n;
    if (n_out == 0)
        return 0;
    const int threads = 256;
    FITM_LAUNCH(fitm_grid_for(n_out, threads), threads, 0, fitm_stream(stream), fitm_to_bf16_rows)
    (x, (__nv_bfloat16 *)dst, rows * n, n_out);
    return (int)cudaGetLastError();
}
