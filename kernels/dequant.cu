/* dequant: weight tensors of any stored type to F32 or F16 on the device.
 * CPU reference: fitm_dequant_row (src/quant.c). */
#include <cuda_fp16.h>

#include "common.cuh"
#include "kernels.h"
#include "qdecode.cuh"

__device__ __forceinline__ void fitm_store(float *dst, int64_t i, float v)
{
    dst[i] = v;
}

__device__ __forceinline__ void fitm_store(__half *dst, int64_t i, float v)
{
    dst[i] = __float2half_rn(v);
}

/* Block types: one thread per chunk of 8 elements.   src: n_chunks*8 elements -> dst (same) */
template <int T, typename OUT>
__global__ void fitm_dequant_blocks(const uint8_t *__restrict__ src, OUT *__restrict__ dst,
                                    int64_t n_chunks)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < n_chunks; c += stride) {
        float v[8];
        fitm_decode_chunk<T>(src, c, v);
#pragma unroll
        for (int i = 0; i < 8; i++)
            fitm_store(dst, 8 * c + i, v[i]);
    }
}

/* Float types: one thread per element (n need not be a multiple of anything). */
template <int T, typename OUT>
__global__ void fitm_dequant_elems(const uint8_t *__restrict__ src, OUT *__restrict__ dst,
                                   int64_t n)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        fitm_store(dst, i, fitm_load1<T>(src, i));
}

template <int T, typename OUT>
static int fitm_dequant_launch(const void *src, OUT *dst, int64_t n, cudaStream_t st)
{
    const int threads = 256;
    const uint8_t *s = (const uint8_t *)src;
    if constexpr (fitm_qtraits<T>::BE == 1) {
        FITM_LAUNCH(fitm_grid_for(n, threads), threads, 0, st, fitm_dequant_elems<T, OUT>)
        (s, dst, n);
    } else {
        const int64_t n_chunks = n / 8;
        FITM_LAUNCH(fitm_grid_for(n_chunks, threads), threads, 0, st, fitm_dequant_blocks<T, OUT>)
        (s, dst, n_chunks);
    }
    return (int)cudaGetLastError();
}

template <typename OUT>
static int fitm_dequant_any(fitm_dtype t, const void *src, OUT *dst, int64_t n, void *stream)
{
    if (!fitm_cuda_dequant_supported(t) || n < 0 || !src || !dst || !fitm_aligned16(src))
        return (int)cudaErrorInvalidValue;
    if (n % fitm_qblock_elems(t) != 0)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    cudaStream_t st = fitm_stream(stream);
    // clang-format off
    switch (t) {
    case FITM_DTYPE_F32: return fitm_dequant_launch<FITM_DTYPE_F32>(src, dst, n, st);
    case FITM_DTYPE_F16: return fitm_dequant_launch<FITM_DTYPE_F16>(src, dst, n, st);
    case FITM_DTYPE_BF16: return fitm_dequant_launch<FITM_DTYPE_BF16>(src, dst, n, st);
    case FITM_DTYPE_Q4_0: return fitm_dequant_launch<FITM_DTYPE_Q4_0>(src, dst, n, st);
    case FITM_DTYPE_Q5_0: return fitm_dequant_launch<FITM_DTYPE_Q5_0>(src, dst, n, st);
    case FITM_DTYPE_Q8_0: return fitm_dequant_launch<FITM_DTYPE_Q8_0>(src, dst, n, st);
    case FITM_DTYPE_Q4_K: return fitm_dequant_launch<FITM_DTYPE_Q4_K>(src, dst, n, st);
    case FITM_DTYPE_Q5_K: return fitm_dequant_launch<FITM_DTYPE_Q5_K>(src, dst, n, st);
    case FITM_DTYPE_Q6_K: return fitm_dequant_launch<FITM_DTYPE_Q6_K>(src, dst, n, st);
    default: return (int)cudaErrorInvalidValue;
    }
    // clang-format on
}

extern "C" bool fitm_cuda_dequant_supported(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_F32:
    case FITM_DTYPE_F16:
    case FITM_DTYPE_BF16:
    case FITM_DTYPE_Q4_0:
    case FITM_DTYPE_Q5_0:
    case FITM_DTYPE_Q8_0:
    case FITM_DTYPE_Q4_K:
    case FITM_DTYPE_Q5_K:
    case FITM_DTYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

extern "C" int fitm_cuda_dequant_f32(fitm_dtype t, const void *src, float *dst, int64_t n,
                                     void *stream)
{
    return fitm_dequant_any(t, src, dst, n, stream);
}

extern "C" int fitm_cuda_dequant_f16(fitm_dtype t, const void *src, uint16_t *dst, int64_t n,
                                     void *stream)
{
    return fitm_dequant_any(t, src, (__half *)dst, n, stream);
}
