/* ops: element-wise kernels — RoPE and the gated FFN activations, and the KV cache's stores.
 * CPU references (src/ops.c): fitm_ops_rope, or fitm_ops_rope_table + fitm_ops_rope_apply where
 * freq_scale != 1; fitm_ops_swiglu, fitm_ops_geglu; fitm_fp32_to_fp16 (compute/quant.h) for
 * the fp16 stores. */
#include "common.cuh"
#include "kvstore.cuh"
#include "kernels.h"
#include "qdecode.cuh"

#define FITM_EW_THREADS 256

/* One thread per rotated pair (t, h, i), i < n_rot/2.     x (T, ld) viewed as (T, H, D).
 * theta = position * freq_scale * base^(-2i/n_rot) in double, as in the reference: positions
 * reach 1e5 and more, where a float angle would be off by several milliradians. */
__global__ void fitm_rope_pairs(float *x, int64_t T, int64_t H, int64_t D, int64_t ld,
                                int64_t n_rot, const int32_t *__restrict__ pos, int64_t pos0,
                                float base, float freq_scale, int neox)
{
    fitm_grid_begin();
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
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = fitm_swiglu1(g[i], u[i]);
}

/* y = gelu_tanh(g) * u.   (n) */
__global__ void fitm_geglu_elems(float *y, const float *g, const float *u, int64_t n)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = fitm_geglu1(g[i], u[i]);
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
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_rope_pairs)
    (x, T, H, D, ld, n_rot, pos, pos0, base, freq_scale, neox);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_swiglu(float *y, const float *g, const float *u, int64_t n, void *stream)
{
    if (n < 0 || !y || !g || !u)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_swiglu_elems)
    (y, g, u, n);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_geglu(float *y, const float *g, const float *u, int64_t n, void *stream)
{
    if (n < 0 || !y || !g || !u)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_geglu_elems)
    (y, g, u, n);
    return (int)cudaGetLastError();
}

/* ---- the backend's element-wise ops ---- */

/* Row t of x = row ids[t] of W, one thread per chunk of 8 (block types) or element. */
template <int T>
__global__ void fitm_embed_rows(const uint8_t *__restrict__ W, int64_t row_bytes, int64_t C,
                                const int32_t *__restrict__ ids, int64_t n_rows, float scale,
                                float *__restrict__ x)
{
    fitm_grid_begin();
    const bool chunked = fitm_qtraits<T>::BE > 1;
    const int64_t per_row = chunked ? C / 8 : C, n = n_rows * per_row;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        const int64_t t = idx / per_row, c = idx % per_row;
        const uint8_t *w = W + (int64_t)ids[t] * row_bytes;
        if (chunked) {
            float v[8];
            fitm_decode_chunk<T>(w, c, v);
            for (int i = 0; i < 8; i++)
                x[t * C + 8 * c + i] = v[i] * scale;
        } else {
            x[t * C + c] = fitm_load1<T>(w, c) * scale;
        }
    }
}

template <int T>
static int fitm_embed_launch(const void *W, int64_t row_bytes, int64_t C, const int32_t *ids,
                             int64_t n_rows, float scale, float *x, cudaStream_t st)
{
    const int64_t n = n_rows * (fitm_qtraits<T>::BE > 1 ? C / 8 : C);
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, st, fitm_embed_rows<T>)
    ((const uint8_t *)W, row_bytes, C, ids, n_rows, scale, x);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_embed(fitm_dtype t, const void *W, int64_t row_bytes, int64_t C,
                               const int32_t *ids, int64_t T, float scale, float *x, void *stream)
{
    if (!fitm_cuda_dequant_supported(t) || !W || !ids || !x || T < 0 || C < 0 || row_bytes < 0 ||
        C % fitm_qblock_elems(t) != 0 || !fitm_aligned16(W) || row_bytes % 2 != 0)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || C == 0)
        return 0;
    cudaStream_t st = fitm_stream(stream);
    // clang-format off
    switch (t) {
    case FITM_DTYPE_F32: return fitm_embed_launch<FITM_DTYPE_F32>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_F16: return fitm_embed_launch<FITM_DTYPE_F16>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_BF16: return fitm_embed_launch<FITM_DTYPE_BF16>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q4_0: return fitm_embed_launch<FITM_DTYPE_Q4_0>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q5_0: return fitm_embed_launch<FITM_DTYPE_Q5_0>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q8_0: return fitm_embed_launch<FITM_DTYPE_Q8_0>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q4_K: return fitm_embed_launch<FITM_DTYPE_Q4_K>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q5_K: return fitm_embed_launch<FITM_DTYPE_Q5_K>(W, row_bytes, C, ids, T, scale, x, st);
    case FITM_DTYPE_Q6_K: return fitm_embed_launch<FITM_DTYPE_Q6_K>(W, row_bytes, C, ids, T, scale, x, st);
    default: return (int)cudaErrorInvalidValue;
    }
    // clang-format on
}

/* y += x;  or with n_cols > 0, y[i] += x[i % n_cols] (a bias on every row). */
__global__ void fitm_add_elems(float *y, const float *x, int64_t n, int64_t n_cols)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] += x[n_cols > 0 ? i % n_cols : i];
}

extern "C" int fitm_cuda_add(float *y, const float *x, int64_t n, void *stream)
{
    if (n < 0 || !y || !x)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_add_elems)
    (y, x, n, (int64_t)0);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_add_rows(float *y, const float *b, int64_t rows, int64_t n, void *stream)
{
    if (rows < 0 || n < 0 || !y || !b || (n > 0 && rows > INT64_MAX / n))
        return (int)cudaErrorInvalidValue;
    if (rows == 0 || n == 0)
        return 0;
    FITM_LAUNCH(fitm_grid_for(rows * n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_add_elems)
    (y, b, rows * n, n);
    return (int)cudaGetLastError();
}

__global__ void fitm_softcap_elems(float *x, int64_t n, float cap)
{
    fitm_grid_begin();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = cap * tanhf(x[i] / cap);
}

extern "C" int fitm_cuda_softcap(float *x, int64_t n, float cap, void *stream)
{
    if (n < 0 || !x || !(cap > 0.0f))
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_softcap_elems)
    (x, n, cap);
    return (int)cudaGetLastError();
}

/* One thread per rotated pair (t, h, i), the angle's cos/sin from the table. */
__global__ void fitm_rope_table_pairs(float *x, int64_t T, int64_t H, int64_t D, int64_t n_rot,
                                      const float *__restrict__ cs, int neox)
{
    fitm_grid_begin();
    const int64_t half = n_rot / 2, n = T * H * half;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        const int64_t i = idx % half, th = idx / half, t = th / H;
        const float c = cs[t * n_rot + 2 * i], s = cs[t * n_rot + 2 * i + 1];
        fitm_rope_pair(x + th * D, neox ? i : 2 * i, neox ? i + half : 2 * i + 1, c, s);
    }
}

extern "C" int fitm_cuda_rope_table(float *x, int64_t T, int64_t H, int64_t D, int64_t n_rot,
                                    const float *cs, int neox, void *stream)
{
    if (T < 0 || H < 0 || D < 0 || n_rot < 2 || n_rot > D || n_rot % 2 != 0 || !x || !cs)
        return (int)cudaErrorInvalidValue;
    if (T == 0 || H == 0)
        return 0;
    const int64_t n = T * H * (n_rot / 2);
    FITM_LAUNCH(fitm_grid_for(n, FITM_EW_THREADS), FITM_EW_THREADS, 0, fitm_stream(stream),
                fitm_rope_table_pairs)
    (x, T, H, D, n_rot, cs, neox);
    return (int)cudaGetLastError();
}

/* Block (x, s, z): store s's K (z 0) or V (z 1) values, grid-stride over x. rs: the stores in
 * device memory. */
__global__ void fitm_kv_store_rows(const fitm_cuda_kv_rows *__restrict__ rs)
{
    fitm_grid_begin();
    const fitm_cuda_kv_rows r = rs[blockIdx.y];
    const float *__restrict__ src = blockIdx.z ? r.v : r.k;
    void *dst = blockIdx.z ? r.v_dst : r.k_dst;
    const int64_t n = r.n, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r.half)
        for (int64_t i = i0; i < n; i += stride)
            ((uint16_t *)dst)[i] = fitm_fp16_bits(src[i]);
    else
        for (int64_t i = i0; i < n; i += stride)
            ((float *)dst)[i] = src[i];
}

extern "C" int fitm_cuda_kv_store_many(const fitm_cuda_kv_rows *r, const fitm_cuda_kv_rows *r_dev,
                                       int n, void *stream)
{
    int64_t n_max = 0;
    if (!r_dev || !fitm_kv_rows_ok(r, n, &n_max))
        return (int)cudaErrorInvalidValue;
    if (n_max == 0)
        return 0;
    FITM_LAUNCH(dim3(fitm_grid_for(n_max, FITM_EW_THREADS), (unsigned)n, 2), FITM_EW_THREADS, 0,
                fitm_stream(stream), fitm_kv_store_rows)
    (r_dev);
    return (int)cudaGetLastError();
}
