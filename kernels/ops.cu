/* ops: element-wise kernels — RoPE and the gated FFN activations.
 * CPU references (src/ops.c): fitm_ops_rope, or fitm_ops_rope_table + fitm_ops_rope_apply where
 * freq_scale != 1; fitm_ops_swiglu, fitm_ops_geglu. */
#include "common.cuh"
#include "kernels.h"

#define FITM_EW_THREADS 256

/* One thread per rotated pair (t, h, i), i < n_rot/2.     x (T, ld) viewed as (T, H, D).
 * theta = position * freq_scale * base^(-2i/n_rot) in double, as in the reference: positions
 * reach 1e5 and more, where a float angle would be off by several milliradians. */
__global__ void fitm_rope_pairs(float *x, int64_t T, int64_t H, int64_t D, int64_t ld,
                                int64_t n_rot, const int32_t *__restrict__ pos, int64_t pos0,
                                float base, float freq_scale, int neox)
{
    const int64_t half = n_rot / 2, n = T * H * half;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        const int64_t i = idx % half, th = idx / half;
        const int64_t h = th % H, t = th / H;
        const int64_t p = pos0 + (pos ? (int64_t)pos[t] : t);
        const double theta =
            (double)p * (double)freq_scale * pow((double)base, -2.0 * (double)i / (double)n_rot);
        double sd, cd;
        sincos(theta, &sd, &cd);
        const float c = (float)cd, s = (float)sd;
        float *v = x + t * ld + h * D;
        const int64_t a = neox ? i : 2 * i;
        const int64_t b = neox ? i + half : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

/* y = silu(g) * u.   (n) */
__global__ void fitm_swiglu_elems(float *y, const float *g, const float *u, int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gi = g[i];
        y[i] = gi / (1.0f + expf(-gi)) * u[i];
    }
}

/* y = gelu_tanh(g) * u.   (n) */
__global__ void fitm_geglu_elems(float *y, const float *g, const float *u, int64_t n)
{
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float xg = g[i];
        y[i] = 0.5f * xg * (1.0f + tanhf(k * (xg + 0.044715f * xg * xg * xg))) * u[i];
    }
}

extern "C" int fitm_cuda_rope(float *x, int64_t T, int64_t H, int64_t D, int64_t ld, int64_t n_rot,
                              const int32_t *pos, int64_t pos0, float base, float freq_scale,
                              int neox, void *stream)
{
    if (T < 0 || H < 0 || D < 0 || n_rot < 2 || n_rot > D || n_rot % 2 != 0 || !x)
        return (int)cudaErrorInvalidValue;
    if (H > 0 && (D > INT64_MAX / H || ld < H * D))
        return (int)cudaErrorInvalidValue;
    if (T == 0 || H == 0)
        return 0;
    if (T > INT64_MAX / H / (n_rot / 2))
        return (int)cudaErrorInvalidValue;
    const int64_t n = T * H * (n_rot / 2);
    fitm_rope_pairs<<<fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream)>>>(
        x, T, H, D, ld, n_rot, pos, pos0, base, freq_scale, neox);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_swiglu(float *y, const float *g, const float *u, int64_t n, void *stream)
{
    if (n < 0 || !y || !g || !u)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    fitm_swiglu_elems<<<fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0,
                        fitm_stream(stream)>>>(y, g, u, n);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_geglu(float *y, const float *g, const float *u, int64_t n, void *stream)
{
    if (n < 0 || !y || !g || !u)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    fitm_geglu_elems<<<fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0,
                       fitm_stream(stream)>>>(y, g, u, n);
    return (int)cudaGetLastError();
}
