/* norm: row-wise reductions — RMSNorm and softmax. One block per row.
 * CPU references: fitm_ops_rmsnorm, fitm_ops_softmax (src/ops.c). */
#include "common.cuh"
#include "kernels.h"

#define FITM_ROW_THREADS 256

/* 1 / sqrt(mean of squares + eps) from a row's sum of squares ss over C elements. */
__device__ __forceinline__ float fitm_rms_scale(float ss, int64_t C, float eps)
{
    return 1.0f / sqrtf(ss / (float)C + eps);
}

/* A normed element, x * scale * (w + w_offset), with both products rounded on their own: a
 * kernel that adds the result to something (fitm_norm_add_rmsnorm_rows) must not let nvcc
 * contract the last product and that sum into one fused multiply-add, or its values would
 * differ from the norm kernel's followed by the add kernel's. Every norm kernel here calls it,
 * so all of them round alike whatever the compiler does with the code around. */
__device__ __forceinline__ float fitm_norm_elem(float x, float scale, float w, float w_offset)
{
    return __fmul_rn(__fmul_rn(x, scale), w + w_offset);
}

/* y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * (w + w_offset).   x, y (T, C); block t.
 * The reference sums in double; float here, reduced as a tree, is well within 1e-6 relative
 * for model dims. y == x is safe: every x[t,c] is read (pass 1) before the block-wide barrier
 * inside the reduction, and pass 2 reads and writes the same element from the same thread. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_rmsnorm_rows(float *y, const float *x, const float *__restrict__ w, float w_offset,
                      int64_t C, float eps)
{
    fitm_grid_begin();
    __shared__ float shm[32];
    const float *xr = x + (int64_t)blockIdx.x * C;
    float *yr = y + (int64_t)blockIdx.x * C;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        ss = fmaf(xr[c], xr[c], ss);
    ss = fitm_block_reduce(ss, shm, false);
    const float scale = fitm_rms_scale(ss, C, eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = fitm_norm_elem(xr[c], scale, w[c], w_offset);
}

/* The residual add and the next RMSNorm in one pass: x[t,:] += r[t,:], then y[t,:] =
 * rmsnorm(x[t,:]) as fitm_rmsnorm_rows computes it. Each thread adds the elements it then
 * squares, in the same order, so both results are bit for bit those of fitm_add_elems followed
 * by fitm_rmsnorm_rows. y may equal x. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_add_rmsnorm_rows(float *y, float *x, const float *__restrict__ r,
                          const float *__restrict__ w, float w_offset, int64_t C, float eps)
{
    fitm_grid_begin();
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
    const float scale = fitm_rms_scale(ss, C, eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = fitm_norm_elem(xr[c], scale, w[c], w_offset);
}

/* A post-norm, the residual add and the next RMSNorm in one pass (Gemma 3's norm after each
 * block): p[t,:] = rmsnorm(o[t,:]) * (w_post + w_offset), x[t,:] += p[t,:], and for the rows
 * t in [y0, y0 + ny) y[t - y0,:] = rmsnorm(x[t,:]) * (w + w_offset) (all of them between
 * layers; the last row alone where the final norm takes a prompt's last token); block t.
 * Bit for bit fitm_rmsnorm_rows (p, o) followed by fitm_add_rmsnorm_rows (y, x, p) (or, on a
 * part of the rows, fitm_add_elems and fitm_rmsnorm_rows): the same block size, so each
 * thread holds the same elements (c = threadIdx.x + 256 j) in both norms and sums their
 * squares in the same order, the same reduction, and each normed element through
 * fitm_norm_elem; p is written and x updated as those kernels write them.
 * NE > 0 (C <= 256 NE): a thread loads all it reads (its o, x, w_post and w elements) into
 * registers before the first reduction, so the row costs one memory round trip, and
 * computes from them (a value it wrote to x is the value it holds). NE = 0: any C, each pass
 * a loop over the thread's elements in memory.
 * Aliasing: p may equal o (the post-norm in place, as the forward driver runs it): every o[c]
 * is read in the first pass before the reduction's barriers, and the second pass reads o[c]
 * and writes p[c] in the same thread. y may be row y0 of x (the norm in place): the third
 * pass reads x[c] and writes y's element over it in the thread that wrote x[c] in the second.
 * Any other overlap is not safe (a write of x or y could reach an element of o or p that
 * another thread reads): the caller keeps x and y apart from o and p. The rows outside
 * [y0, y0 + ny) leave after the second pass, the whole block at once, so no thread misses
 * the barriers of the second reduction. */
template <int NE>
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_norm_add_rmsnorm_rows(float *p, const float *o, const float *__restrict__ w_post,
                               float *x, float *y, const float *__restrict__ w, float w_offset,
                               int64_t C, float eps, int64_t y0, int64_t ny)
{
    fitm_grid_begin();
    __shared__ float shm[32];
    const int64_t t = blockIdx.x, r = t * C;
    const bool norm_y = t >= y0 && t < y0 + ny; /* uniform per block */
    if constexpr (NE > 0) {
        float ov[NE] = {}, xv[NE] = {}, wpv[NE] = {}, wv[NE] = {};
#pragma unroll
        for (int j = 0; j < NE; j++) {
            const int64_t c = threadIdx.x + (int64_t)j * FITM_ROW_THREADS;
            if (c < C) {
                ov[j] = o[r + c];
                xv[j] = x[r + c];
                wpv[j] = w_post[c];
                wv[j] = norm_y ? w[c] : 0.0f;
            }
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NE; j++)
            if (threadIdx.x + (int64_t)j * FITM_ROW_THREADS < C)
                ss = fmaf(ov[j], ov[j], ss);
        ss = fitm_block_reduce(ss, shm, false);
        const float scale_post = fitm_rms_scale(ss, C, eps);
        ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NE; j++) {
            const int64_t c = threadIdx.x + (int64_t)j * FITM_ROW_THREADS;
            if (c < C) {
                const float pc = fitm_norm_elem(ov[j], scale_post, wpv[j], w_offset);
                p[r + c] = pc;
                xv[j] = xv[j] + pc;
                x[r + c] = xv[j];
                ss = fmaf(xv[j], xv[j], ss);
            }
        }
        if (!norm_y)
            return;
        ss = fitm_block_reduce(ss, shm, false);
        const float scale = fitm_rms_scale(ss, C, eps);
        float *yr = y + (t - y0) * C;
#pragma unroll
        for (int j = 0; j < NE; j++) {
            const int64_t c = threadIdx.x + (int64_t)j * FITM_ROW_THREADS;
            if (c < C)
                yr[c] = fitm_norm_elem(xv[j], scale, wv[j], w_offset);
        }
    } else {
        float ss = 0.0f;
        for (int64_t c = threadIdx.x; c < C; c += FITM_ROW_THREADS)
            ss = fmaf(o[r + c], o[r + c], ss);
        ss = fitm_block_reduce(ss, shm, false);
        const float scale_post = fitm_rms_scale(ss, C, eps);
        ss = 0.0f;
        for (int64_t c = threadIdx.x; c < C; c += FITM_ROW_THREADS) {
            const float pc = fitm_norm_elem(o[r + c], scale_post, w_post[c], w_offset);
            p[r + c] = pc;
            const float v = x[r + c] + pc;
            x[r + c] = v;
            ss = fmaf(v, v, ss);
        }
        if (!norm_y)
            return;
        ss = fitm_block_reduce(ss, shm, false);
        const float scale = fitm_rms_scale(ss, C, eps);
        float *yr = y + (t - y0) * C;
        for (int64_t c = threadIdx.x; c < C; c += FITM_ROW_THREADS)
            yr[c] = fitm_norm_elem(x[r + c], scale, w[c], w_offset);
    }
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
    fitm_grid_begin();
    __shared__ float shm[32];
    const int64_t t = blockIdx.x / (H + Hkv), h = blockIdx.x % (H + Hkv);
    const bool is_q = h < H; /* uniform per block, as w below */
    float *v = is_q ? q + (t * H + h) * D : k + (t * Hkv + h - H) * D;
    const float *w = is_q ? q_w : k_w;
    /* The thread's first weight and first angle are loaded before the reduction, so that
     * their memory round trips overlap the first load of v (the same values as loading them
     * where they are used). */
    const int64_t half = n_rot / 2;
    const float *cst = cs + t * n_rot;
    const float w0 = w && threadIdx.x < D ? w[threadIdx.x] : 0.0f;
    const float c0 = threadIdx.x < half ? cst[2 * threadIdx.x] : 0.0f;
    const float s0 = threadIdx.x < half ? cst[2 * threadIdx.x + 1] : 0.0f;
    if (w) {
        float ss = 0.0f;
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
            ss = fmaf(v[c], v[c], ss);
        ss = fitm_block_reduce(ss, shm, false);
        const float scale = fitm_rms_scale(ss, D, eps);
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
            v[c] = fitm_norm_elem(v[c], scale, c == threadIdx.x ? w0 : w[c], w_offset);
        __syncthreads(); /* a pair's elements were normed by other threads */
    }
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x)
        fitm_rope_pair(v, neox ? i : 2 * i, neox ? i + half : 2 * i + 1,
                       i == threadIdx.x ? c0 : cst[2 * i], i == threadIdx.x ? s0 : cst[2 * i + 1]);
}

/* Row r of x (n_rows, ld): x[r, 0..n) = softmax(x[r, 0..n)), in place; block r. */
__global__ void __launch_bounds__(FITM_ROW_THREADS)
    fitm_softmax_rows(float *x, int64_t n, int64_t ld)
{
    fitm_grid_begin();
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

extern "C" int fitm_cuda_norm_add_rmsnorm(float *p, const float *o, const float *w_post, float *x,
                                          float *y, const float *w, float w_offset, int64_t T,
                                          int64_t y0, int64_t ny, int64_t C, float eps,
                                          void *stream)
{
    if (T < 0 || C < 0 || T > INT32_MAX || y0 < 0 || ny < 0 || y0 > T - ny || !p || !o ||
        !w_post || !x || (ny > 0 && (!y || !w)))
        return (int)cudaErrorInvalidValue;
    if (T == 0 || C == 0)
        return 0;
    /* registers for up to four elements a thread: a model dimension up to 1024 */
    if (C <= 4 * FITM_ROW_THREADS)
        FITM_LAUNCH((unsigned)T, FITM_ROW_THREADS, 0, fitm_stream(stream),
                    fitm_norm_add_rmsnorm_rows<4>)
    (p, o, w_post, x, y, w, w_offset, C, eps, y0, ny);
    else FITM_LAUNCH((unsigned)T, FITM_ROW_THREADS, 0, fitm_stream(stream),
                     fitm_norm_add_rmsnorm_rows<0>)(p, o, w_post, x, y, w, w_offset, C, eps, y0,
                                                    ny);
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
