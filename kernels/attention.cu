/* attention: one layer's attention for T query rows, flash-style (no T x T matrix anywhere),
 * with the per-span mass capture and the Eq. 5 intervention of docs/design.md.
 * CPU reference: the CPU backend's attention (src/model/backend_cpu.c), which in turn follows
 * fitm_ops_softmax, fitm_ops_span_mass and fitm_ops_intervene (src/compute/ops.c).
 *
 * One block per (query row, head). The query vector sits in shared memory; keys are visited
 * in tiles of FITM_ATT_THREADS, one key per thread, the score a dot product in a fixed order.
 *   pass 1: the row's max and softmax denominator, online over the tiles;
 *   pass 2 (intervened rows): the mass of every intervention span, one thread per span, and
 *           from them the Eq. 5 factor of every span (in dynamic shared memory);
 *   pass 3 (captured rows): the captured spans' masses, one thread per span;
 *   pass 4: out = sum_j p_j v_j over the tiles in key order, each thread owning head dims.
 * Every sum has one fixed order (no atomics), so a row's result does not depend on T.
 * A mixture (the position methods, mix_n > 0): pass 1 runs once per expert the row weighs
 * (its own queries and keys), and p_j = sum_e w_e softmax_e(j) in expert order replaces the
 * plain probability in every later pass, as the CPU backend's attn_mix_probs.
 *
 * The tiled kernel (fitm_attention_tiles) computes plain rows (no capture, no intervention,
 * no mixture: a prompt's bulk) bit for bit as fitm_attention_rows does, with each key and
 * value read from global memory once per block of consecutive rows and the heads of one KV
 * group instead of once per (row, head): below, "Tiled rows".
 *
 * The tensor-core kernel (fitm_attention_bf16_tiles) computes plain rows in bfloat16 on the
 * tensor cores, row-invariant but with bits of its own: below, "Tensor-core rows". */
#include <cuda_bf16.h>
#include <mma.h>

#include "common.cuh"
#include "kernels.h"
#include "kvstore.cuh"

#define FITM_ATT_THREADS 128
#define FITM_ATT_MAX_D 256
#define FITM_ATT_MIN_MASS 1e-30 /* FITM_OPS_INTERVENE_MIN_MASS */

struct fitm_att_row {
    int64_t i, p, v0; /* row in the call, its position, first visible key */
    int h, g;
};

/* ---- The arithmetic both kernels apply, written once: a row's bits must not depend on
 * which kernel computed it. The roundings are explicit (__fmul_rn, __fsub_rn, __fadd_rn,
 * __fdiv_rn) where nvcc could otherwise contract a product and a sum into one fused
 * multiply-add in one kernel and not in the other; fmaf where the chain is fused on purpose.
 * A score: fitm_att_scaled of the chain s = fmaf(q[d], k[d], s) over d in order from 0. */

/* First key visible from position p (causal, and within a window > 0). */
__device__ __forceinline__ int64_t fitm_att_v0(const fitm_cuda_attn &a, int64_t p)
{
    return a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
}

__device__ __forceinline__ float fitm_att_scaled(float dot, float scale)
{
    return __fmul_rn(dot, scale);
}

/* exp(s - m): a score's weight against the running (or final) maximum m */
__device__ __forceinline__ float fitm_att_exp(float s, float m)
{
    return expf(__fsub_rn(s, m));
}

/* The online denominator after a 128-key tile: l rescaled from the old maximum mx to the new
 * m_new, plus the tile's sum of fitm_att_exp(s, m_new). */
__device__ __forceinline__ float fitm_att_rescale(float l, float mx, float m_new, float sum)
{
    return __fadd_rn(__fmul_rn(l, fitm_att_exp(mx, m_new)), sum);
}

__device__ __forceinline__ float fitm_att_inv(float l)
{
    return __fdiv_rn(1.0f, l);
}

/* A plain probability: exp(s - mx) / l */
__device__ __forceinline__ float fitm_att_p(float s, float mx, float inv_l)
{
    return __fmul_rn(fitm_att_exp(s, mx), inv_l);
}

/* The second level of fitm_block_reduce over a block of FITM_ATT_THREADS (4 warps): given the
 * warps' butterfly results w0..w3, lane 0's value of the butterfly over lanes holding w0..w3
 * and the identity (0 for a sum, -inf for a max) in the other 28 (every lane ends with the
 * same bits: each step combines the same two values, in either order). Step by step: at
 * offsets 16, 8 and 4 lane k < 4 meets the identity, at 2 lane k + 2, at 1 lane k + 1. */
__device__ __forceinline__ float fitm_att_reduce4(float w0, float w1, float w2, float w3,
                                                  bool is_max)
{
    const float id = is_max ? -INFINITY : 0.0f;
    float w[4] = {w0, w1, w2, w3};
    for (int k = 0; k < 4; k++)
        for (int o = 0; o < 3; o++)
            w[k] = is_max ? fmaxf(w[k], id) : __fadd_rn(w[k], id);
    const float a = is_max ? fmaxf(w[0], w[2]) : __fadd_rn(w[0], w[2]);
    const float b = is_max ? fmaxf(w[1], w[3]) : __fadd_rn(w[1], w[3]);
    return is_max ? fmaxf(a, b) : __fadd_rn(a, b);
}

/* Sum (or max) over the block of v, one value per thread, key j0 + threadIdx.x: each warp's
 * butterfly, then fitm_att_reduce4 of the four in every thread (red: 4 floats, reusable). */
__device__ __forceinline__ float fitm_att_block_reduce(float v, float *red, bool is_max)
{
    v = is_max ? fitm_warp_max(v) : fitm_warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (threadIdx.x % FITM_WARP == 0)
        red[threadIdx.x / FITM_WARP] = v;
    __syncthreads();
    return fitm_att_reduce4(red[0], red[1], red[2], red[3], is_max);
}

__device__ __forceinline__ const float *fitm_att_kv(const fitm_cuda_attn &a, const float *pre,
                                                    const float *own, int64_t j, int g)
{
    const int64_t HkvD = (int64_t)a.n_head_kv * a.head_dim;
    return (j < a.own_base ? pre + j * HkvD : own + (j - a.own_base) * HkvD) +
           (int64_t)g * a.head_dim;
}

/* Key j's K row (v false) or V row of group g for the one-row kernel: fitm_att_kv's, or the
 * call's new rows where they are read from the store's source (k_new). */
__device__ __forceinline__ const float *fitm_att_kv1(const fitm_cuda_attn &a, bool v, int64_t j,
                                                     int g)
{
    if (a.k_new && j >= a.new_base)
        return (v ? a.v_new : a.k_new) + (j - a.new_base) * ((int64_t)a.n_head_kv * a.head_dim) +
               (int64_t)g * a.head_dim;
    return v ? fitm_att_kv(a, a.v_pre, a.v_own, j, g) : fitm_att_kv(a, a.k_pre, a.k_own, j, g);
}

/* Key j's score against the query q: the chain s = fmaf(q[d], k[d], s) over d in order from
 * 0, eight key loads in flight (the chain still adds them one by one, in order). */
__device__ __forceinline__ float fitm_att_score(const fitm_cuda_attn &a, const float *q, int64_t j,
                                                int g)
{
    const float *k = fitm_att_kv1(a, false, j, g);
    const int D = a.head_dim;
    float s = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; d++)
        s = fmaf(q[d], __ldg(k + d), s);
    return fitm_att_scaled(s, a.scale);
}

/* Expert e's score of key j: its own query row and keys (position j at row j). */
__device__ __forceinline__ float fitm_att_score_mix(const fitm_cuda_attn &a, const fitm_att_row &r,
                                                    int e, int64_t j)
{
    const int64_t D = a.head_dim;
    const float *q = a.mix_q + (((int64_t)e * a.T + r.i) * a.n_head + r.h) * D;
    const int ge = r.h / (a.n_head / a.mix_k_heads);
    const float *k = a.mix_k + e * a.mix_k_stride + (j * a.mix_k_heads + ge) * D;
    float s = 0.0f;
    for (int d = 0; d < D; d++)
        s = fmaf(q[d], k[d], s);
    return fitm_att_scaled(s, a.scale);
}

/* A row's softmax: the plain one (q, mx, inv_l), or a mixture's per-expert maxima and inverse
 * denominators (shared) with the row's weights (global). */
struct fitm_att_soft {
    const float *q;
    float mx, inv_l;
    int n_mix; /* 0: plain */
    const float *w, *mmx, *minv;
    const float *kept; /* plain rows of few keys: key j's score at kept[j - v0] (shared), or NULL */
};

/* Index of the intervention span holding key j, or -1 (spans sorted and disjoint). */
__device__ __forceinline__ int fitm_att_span_of(const fitm_cuda_attn &a, int64_t j)
{
    int lo = 0, hi = a.iv_n_spans - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (j < a.iv_spans[2 * mid])
            hi = mid - 1;
        else if (j >= a.iv_spans[2 * mid + 1])
            lo = mid + 1;
        else
            return mid;
    }
    return -1;
}

/* Probability of key j (visible) in row r: before the intervention, or after it when
 * factor (the Eq. 5 factors by span, NULL: none) is given. */
__device__ __forceinline__ float fitm_att_prob(const fitm_cuda_attn &a, const fitm_att_row &r,
                                               const fitm_att_soft &s, int64_t j,
                                               const float *factor)
{
    float pj;
    if (s.n_mix == 0) {
        pj = fitm_att_p(s.kept ? s.kept[j - r.v0] : fitm_att_score(a, s.q, j, r.g), s.mx, s.inv_l);
    } else {
        pj = 0.0f;
        for (int e = 0; e < s.n_mix; e++)
            if (s.w[e] != 0.0f)
                pj += s.w[e] * fitm_att_p(fitm_att_score_mix(a, r, e, j), s.mmx[e], s.minv[e]);
    }
    if (factor) {
        const int k = fitm_att_span_of(a, j);
        if (k >= 0)
            pj *= factor[k];
    }
    return pj;
}

/* Sum of the probabilities over keys [lo, hi) clipped to the visible [v0, p], in key order. */
__device__ double fitm_att_mass(const fitm_cuda_attn &a, const fitm_att_row &r,
                                const fitm_att_soft &s, int64_t lo, int64_t hi,
                                const float *factor)
{
    lo = lo > r.v0 ? lo : r.v0;
    hi = hi < r.p + 1 ? hi : r.p + 1;
    double m = 0.0;
    for (int64_t j = lo; j < hi; j++)
        m += (double)fitm_att_prob(a, r, s, j, factor);
    return m;
}

/* A tile's step of the online softmax, thread key j with score s (-inf past the row): the
 * score kept (keep: key j at keep[j - v0]), the tile's maximum and sum of fitm_att_exp by the
 * block's reductions, the running maximum mx and denominator l updated. */
__device__ __forceinline__ void fitm_att_tile_done(const fitm_att_row &r, int64_t j, float s,
                                                   float *keep, float *red, float *mx, float *l)
{
    if (keep && j <= r.p)
        keep[j - r.v0] = s;
    const float tmx = fitm_att_block_reduce(s, red, true);
    const float m_new = fmaxf(*mx, tmx);
    const float ex = j <= r.p ? fitm_att_exp(s, m_new) : 0.0f;
    *l = fitm_att_rescale(*l, *mx, m_new, fitm_att_block_reduce(ex, red, false));
    *mx = m_new;
}

/* The row's softmax maximum and inverse denominator over its visible keys, online over
 * tiles: of the plain scores (e < 0) or of expert e's. keep (or NULL): the plain scores are
 * also written there, key j at keep[j - v0], for the later passes to read instead of
 * computing them again (the same values; the block reductions' barriers publish them). */
__device__ void fitm_att_stats(const fitm_cuda_attn &a, const fitm_att_row &r, const float *q,
                               int e, float *red, float *mx_out, float *inv_l_out, float *keep)
{
    float mx = -INFINITY, l = 0.0f;
    for (int64_t j0 = r.v0; j0 <= r.p; j0 += FITM_ATT_THREADS) {
        const int64_t j = j0 + threadIdx.x;
        const float s = j > r.p  ? -INFINITY
                        : e < 0 ? fitm_att_score(a, q, j, r.g)
                                 : fitm_att_score_mix(a, r, e, j);
        fitm_att_tile_done(r, j, s, keep, red, &mx, &l);
    }
    *mx_out = mx;
    *inv_l_out = fitm_att_inv(l);
}

/* ---- The one-row kernel's staging (plain scores, and every row's values) ----
 *
 * A thread's score reads its own key's row: from global memory, the 32 lanes of a warp touch
 * 32 different lines per load, and a row of the block costs D such loads. When the head dim
 * is whole float4s (and 128 is a multiple of D / 4) and the K and V rows are 16-byte aligned,
 * the block instead stages them through shared memory with coalesced 16-byte loads, each
 * thread holding its share of the next step in registers while the block computes on this
 * one:
 *   pass 1 (plain rows): a tile's keys a slice of head dims at a time, into rows padded to
 *          the slice's width plus 4 floats (8 consecutive keys' float4s hit distinct banks):
 *          64 dims for a tile of more than 64 keys, 128 for one of 33 to 64, 256 (a whole
 *          row of Gemma 3) for one of at most 32, the step always 16 float4s a thread; thread
 *          t's chain goes on over the slice's dims from its key's row, so a score is
 *          fitm_att_score's chain, in the same order on the same values;
 *   pass 4: the values of as many keys as 16 float4s a thread hold (fitm_att_vkeys: 32 of
 *          D 256, 64 of D 128, a whole tile of D 64), rows of D floats; out = fmaf(p_j, v_j,
 *          out) over them in key order, as the unstaged path sums them.
 * The first step's loads go out before the query is staged, and pass 4's first values load
 * during pass 1's last step. A plain row of at most keep_cap keys keeps its scores (in
 * dynamic shared memory) for the later passes, one score chain per key. */
/* float4s a thread holds of one step: a tile's slice (128 keys x 16, 64 x 32 or 32 x 64) or
 * a value step (at most 32 keys x 64) over 128 threads */
#define FITM_ATT_ROW_LOADS 16
#define FITM_ATT_ROW_STAGE (FITM_ATT_THREADS * (64 + 4)) /* floats: the largest slice step */
#define FITM_ATT_ROW_KEEP 8192 /* the most keys of a row whose scores a block keeps */

/* Whether the call a's key and value rows can be read as whole float4s: D a multiple of 4 and
 * every K and V array it names 16-byte aligned. */
__host__ __device__ __forceinline__ bool fitm_att_kv_float4(const fitm_cuda_attn &a)
{
    return a.head_dim % 4 == 0 &&
           (((uintptr_t)a.k_own | (uintptr_t)a.v_own | (uintptr_t)a.k_pre | (uintptr_t)a.v_pre |
             (uintptr_t)a.k_new | (uintptr_t)a.v_new) &
            15) == 0;
}

/* The staged path's condition: the launch's rows (of one call) can use it. */
__host__ __device__ __forceinline__ bool fitm_att_row_vec(const fitm_cuda_attn &a)
{
    return fitm_att_kv_float4(a) && FITM_ATT_THREADS % (a.head_dim / 4) == 0;
}

/* log2 of the float4s of a slice of the tile from j0: 4 (64 dims), 5 (128) or 6 (256), by the
 * tile's keys, so that a step is 16 float4s a thread. */
__device__ __forceinline__ int fitm_att_slice_l4(const fitm_att_row &r, int64_t j0)
{
    const int64_t n = r.p + 1 - j0;
    return n > 64 ? 4 : n > 32 ? 5 : 6;
}

/* Keys j0.. (those <= r.p) of the tile, slice sl of their head dims, into buf: float4 c =
 * tid % S4 of key tid / S4 + (128 / S4) i, S4 = 1 << fitm_att_slice_l4. */
__device__ __forceinline__ void fitm_att_slice_fetch(const fitm_cuda_attn &a,
                                                     const fitm_att_row &r, int64_t j0, int sl,
                                                     float4 (&buf)[FITM_ATT_ROW_LOADS])
{
    const int l4 = fitm_att_slice_l4(r, j0), S4 = 1 << l4;
    const int d = 4 * ((sl << l4) + (threadIdx.x & (S4 - 1)));
    if (d >= a.head_dim)
        return;
#pragma unroll
    for (int i = 0; i < FITM_ATT_ROW_LOADS; i++) {
        const int64_t j = j0 + (threadIdx.x >> l4) + (i << (7 - l4));
        if (j <= r.p)
            buf[i] = __ldg((const float4 *)(fitm_att_kv1(a, false, j, r.g) + d));
    }
}

__device__ __forceinline__ void fitm_att_slice_put(const fitm_cuda_attn &a, const fitm_att_row &r,
                                                   int64_t j0, int sl,
                                                   const float4 (&buf)[FITM_ATT_ROW_LOADS],
                                                   float4 *stg)
{
    const int l4 = fitm_att_slice_l4(r, j0), S4 = 1 << l4, LD4 = S4 + 1;
    const int c = threadIdx.x & (S4 - 1);
    if (4 * ((sl << l4) + c) >= a.head_dim)
        return;
#pragma unroll
    for (int i = 0; i < FITM_ATT_ROW_LOADS; i++) {
        const int kk = (threadIdx.x >> l4) + (i << (7 - l4));
        if (j0 + kk <= r.p)
            stg[kk * LD4 + c] = buf[i];
    }
}

__device__ __forceinline__ void fitm_att_vals_fetch(const fitm_cuda_attn &a, const fitm_att_row &r,
                                                    int64_t c0, float4 (&buf)[FITM_ATT_ROW_LOADS]);

/* fitm_att_stats for a plain row on the staged path: the same scores, maxima and sums in the
 * same order, each tile's keys read through shared memory (stg) a slice at a time. buf holds
 * the first slice's loads (fitm_att_slice_fetch of slice 0 of the tile from r.v0) and leaves
 * with pass 4's first values (fitm_att_vals_fetch from r.v0). */
__device__ void fitm_att_stats_staged(const fitm_cuda_attn &a, const fitm_att_row &r,
                                      const float *q, float *red, float4 *stg,
                                      float4 (&buf)[FITM_ATT_ROW_LOADS], float *mx_out,
                                      float *inv_l_out, float *keep)
{
    const int tid = threadIdx.x, D = a.head_dim;
    float mx = -INFINITY, l = 0.0f, s = 0.0f;
    int64_t j0 = r.v0;
    int sl = 0;
    for (;;) {
        const int l4 = fitm_att_slice_l4(r, j0), S4 = 1 << l4;
        const int nsl = (D / 4 + S4 - 1) >> l4;
        __syncthreads(); /* every thread is done reading the slice before */
        fitm_att_slice_put(a, r, j0, sl, buf, stg);
        __syncthreads();
        const int64_t nj0 = sl + 1 < nsl ? j0 : j0 + FITM_ATT_THREADS;
        const int nsl_next = sl + 1 < nsl ? sl + 1 : 0;
        /* the next slice loads while this one is summed; after the last, pass 4's values */
        if (nj0 <= r.p)
            fitm_att_slice_fetch(a, r, nj0, nsl_next, buf);
        else
            fitm_att_vals_fetch(a, r, r.v0, buf);
        const int64_t j = j0 + tid;
        if (j <= r.p) {
            const float4 *row = stg + tid * (S4 + 1);
            const float *qs = q + 4 * (sl << l4);
            const int nc = D / 4 - (sl << l4) < S4 ? D / 4 - (sl << l4) : S4;
#pragma unroll 16
            for (int c = 0; c < nc; c++) {
                const float4 k = row[c];
                s = fmaf(qs[4 * c], k.x, s);
                s = fmaf(qs[4 * c + 1], k.y, s);
                s = fmaf(qs[4 * c + 2], k.z, s);
                s = fmaf(qs[4 * c + 3], k.w, s);
            }
        }
        if (sl == nsl - 1) { /* the tile's scores are whole: fitm_att_stats's step */
            fitm_att_tile_done(r, j, j > r.p ? -INFINITY : fitm_att_scaled(s, a.scale), keep,
                               red, &mx, &l);
            s = 0.0f;
        }
        if (nj0 > r.p)
            break;
        j0 = nj0, sl = nsl_next;
    }
    *mx_out = mx;
    *inv_l_out = fitm_att_inv(l);
}

/* Keys whose values pass 4 stages a step: 16 float4s a thread, at most a tile. */
__device__ __forceinline__ int fitm_att_vkeys(const fitm_cuda_attn &a)
{
    const int n = FITM_ATT_ROW_LOADS * FITM_ATT_THREADS / (a.head_dim / 4);
    return n < FITM_ATT_THREADS ? n : FITM_ATT_THREADS;
}

/* Values of keys c0.. (at most fitm_att_vkeys, those <= r.p): loaded into buf (PUT false),
 * or from buf into the staging area stg (PUT true); float4 tid % (D / 4) of key tid / (D / 4)
 * + (128 / (D / 4)) i of them. */
template <bool PUT>
__device__ __forceinline__ void fitm_att_vals(const fitm_cuda_attn &a, const fitm_att_row &r,
                                              int64_t c0, float4 (&buf)[FITM_ATT_ROW_LOADS],
                                              float4 *stg)
{
    const int D4 = a.head_dim / 4, KS = FITM_ATT_THREADS / D4, vk = fitm_att_vkeys(a);
    const int c = threadIdx.x % D4;
#pragma unroll
    for (int i = 0; i < FITM_ATT_ROW_LOADS; i++) {
        const int kk = threadIdx.x / D4 + KS * i;
        if (kk >= vk || c0 + kk > r.p)
            continue;
        if (PUT)
            stg[kk * D4 + c] = buf[i];
        else
            buf[i] = __ldg((const float4 *)fitm_att_kv1(a, true, c0 + kk, r.g) + c);
    }
}

__device__ __forceinline__ void fitm_att_vals_fetch(const fitm_cuda_attn &a, const fitm_att_row &r,
                                                    int64_t c0, float4 (&buf)[FITM_ATT_ROW_LOADS])
{
    fitm_att_vals<false>(a, r, c0, buf, NULL);
}

/* Row i, head blockIdx.y of the call a. Dynamic shared memory: the staging area
 * (FITM_ATT_ROW_STAGE floats), then n_fac floats of span factors, then keep_cap floats of
 * kept scores. */
__device__ __forceinline__ void fitm_attention_row(const fitm_cuda_attn &a, int64_t i, int n_fac,
                                                   int keep_cap)
{
    __shared__ float q[FITM_ATT_MAX_D];
    __shared__ float tile[FITM_ATT_THREADS];
    __shared__ float red[32];
    __shared__ double redd[32];
    __shared__ float mmx[FITM_CUDA_ATTN_MAX_MIX], minv[FITM_CUDA_ATTN_MAX_MIX];
    FITM_DYNAMIC_SHARED(float4, dyn4);
    float4 *stg = dyn4;
    float *factor = (float *)dyn4 + FITM_ATT_ROW_STAGE; /* (iv_n_spans) */
    float *kept = factor + n_fac;
    const int tid = threadIdx.x, D = a.head_dim;
    const bool vec = fitm_att_row_vec(a);
    fitm_att_row r;
    r.i = i;
    r.h = blockIdx.y;
    r.g = r.h / (a.n_head / a.n_head_kv);
    r.p = a.pos0 + r.i;
    r.v0 = fitm_att_v0(a, r.p);
    /* the staged path's first loads: pass 1's first slice (plain rows), else pass 4's values */
    const bool staged1 = vec && a.mix_n == 0;
    float4 buf[FITM_ATT_ROW_LOADS];
    if (staged1)
        fitm_att_slice_fetch(a, r, r.v0, 0, buf);
    else if (vec)
        fitm_att_vals_fetch(a, r, r.v0, buf);
    const float *qg = a.q + (r.i * a.n_head + r.h) * D;
    for (int d = tid; d < D; d += FITM_ATT_THREADS)
        q[d] = qg[d];
    __syncthreads();

    /* pass 1: max and denominator, online over tiles (per weighed expert for a mixture) */
    fitm_att_soft sm = {q, 0.0f, 0.0f, a.mix_n, NULL, mmx, minv, NULL};
    if (a.mix_n == 0) {
        /* a row of at most keep_cap keys keeps its scores: the later passes read them, one
         * score chain per key instead of two */
        float *keep = r.p - r.v0 < keep_cap ? kept : NULL;
        if (staged1)
            fitm_att_stats_staged(a, r, q, red, stg, buf, &sm.mx, &sm.inv_l, keep);
        else
            fitm_att_stats(a, r, q, -1, red, &sm.mx, &sm.inv_l, keep);
        sm.kept = keep;
    } else {
        sm.w = a.mix_w + (r.i * a.n_head + r.h) * a.mix_n;
        for (int e = 0; e < a.mix_n; e++) {
            float m = 0.0f, il = 0.0f;
            if (sm.w[e] != 0.0f)
                fitm_att_stats(a, r, q, e, red, &m, &il, NULL);
            if (tid == 0) {
                mmx[e] = m;
                minv[e] = il;
            }
        }
        __syncthreads();
    }
    /* pass 2: Eq. 5 factors of the intervention spans */
    const bool intervene = a.iv_n_spans > 0 && r.p >= a.iv_from_pos;
    if (intervene) {
        double S = 0.0, Z = 0.0;
        for (int k = tid; k < a.iv_n_spans; k += FITM_ATT_THREADS) {
            const double m =
                fitm_att_mass(a, r, sm, a.iv_spans[2 * k], a.iv_spans[2 * k + 1], NULL);
            factor[k] = (float)m; /* the mass, for now */
            if (m > FITM_ATT_MIN_MASS) {
                S += m;
                Z += (double)(a.iv_spans[2 * k + 1] - a.iv_spans[2 * k]) * (double)a.iv_alpha[k];
            }
        }
        S = fitm_block_sum_d(S, redd, FITM_ATT_THREADS / FITM_WARP);
        Z = fitm_block_sum_d(Z, redd, FITM_ATT_THREADS / FITM_WARP);
        const double C = Z > 0.0 ? S / Z : 0.0;
        for (int k = tid; k < a.iv_n_spans; k += FITM_ATT_THREADS) {
            const double m = factor[k]; /* written by this thread above */
            factor[k] = Z > 0.0 && m > FITM_ATT_MIN_MASS
                            ? (float)((double)a.iv_alpha[k] *
                                      (double)(a.iv_spans[2 * k + 1] - a.iv_spans[2 * k]) * C / m)
                            : 1.0f;
        }
        __syncthreads();
    }
    const float *fac = intervene ? factor : NULL;

    /* pass 3: captured span masses */
    const int32_t cr = a.cap_index ? a.cap_index[r.i] : -1;
    const float *cap_fac = a.cap_after ? fac : NULL;
    if (cr >= 0 && a.cap_mass) {
        float *dst = a.cap_mass + ((int64_t)cr * a.n_head + r.h) * a.cap_n_spans;
        for (int k = tid; k < a.cap_n_spans; k += FITM_ATT_THREADS)
            dst[k] = (float)fitm_att_mass(a, r, sm, a.cap_spans[2 * k], a.cap_spans[2 * k + 1],
                                          cap_fac);
    }

    /* pass 4: the output, and the captured probabilities */
    float *cp = cr >= 0 && a.cap_probs
                    ? a.cap_probs + ((int64_t)cr * a.n_head + r.h) * a.cap_probs_stride
                    : NULL;
    constexpr int NC = FITM_ATT_MAX_D / FITM_ATT_THREADS;
    float acc[NC] = {0.0f, 0.0f};
    if (cp)
        for (int64_t j = tid; j < a.cap_probs_stride; j += FITM_ATT_THREADS)
            if (j < r.v0 || j > r.p)
                cp[j] = 0.0f;
    for (int64_t j0 = r.v0; j0 <= r.p; j0 += FITM_ATT_THREADS) {
        const int64_t j = j0 + tid;
        __syncthreads(); /* the tile before is summed */
        if (j <= r.p) {
            const float pj = fitm_att_prob(a, r, sm, j, fac);
            tile[tid] = pj;
            if (cp)
                cp[j] = cap_fac || !fac ? pj : fitm_att_prob(a, r, sm, j, NULL);
        }
        const int64_t n = r.p + 1 - j0 < FITM_ATT_THREADS ? r.p + 1 - j0 : FITM_ATT_THREADS;
        if (vec) {
            /* vk keys' values a step, the next step's loads in flight */
            const float *vs = (const float *)stg;
            const int vk = fitm_att_vkeys(a);
            for (int t0 = 0; t0 < (int)n; t0 += vk) {
                if (t0 > 0)
                    __syncthreads(); /* the step before is summed */
                fitm_att_vals<true>(a, r, j0 + t0, buf, stg);
                __syncthreads(); /* the values and the tile's probabilities are written */
                if (j0 + t0 + vk <= r.p)
                    fitm_att_vals_fetch(a, r, j0 + t0 + vk, buf);
                const int nk = (int)n - t0 < vk ? (int)n - t0 : vk;
#pragma unroll 8
                for (int kk = 0; kk < nk; kk++)
#pragma unroll
                    for (int c = 0; c < NC; c++)
                        if (tid + c * FITM_ATT_THREADS < D)
                            acc[c] = fmaf(tile[t0 + kk], vs[kk * D + tid + c * FITM_ATT_THREADS],
                                          acc[c]);
            }
            continue;
        }
        __syncthreads();
        /* four keys' values loaded before the four keys' adds, which keep key order */
        for (int t0 = 0; t0 < (int)n; t0 += 4) {
            float vv[4][NC];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t j = j0 + (t0 + u < n ? t0 + u : t0); /* past n: a key read twice */
                const float *v = fitm_att_kv1(a, true, j, r.g);
#pragma unroll
                for (int c = 0; c < NC; c++)
                    vv[u][c] = tid + c * FITM_ATT_THREADS < D && t0 + u < n
                                   ? __ldg(v + tid + c * FITM_ATT_THREADS)
                                   : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int c = 0; c < NC; c++)
                    if (t0 + u < n && tid + c * FITM_ATT_THREADS < D)
                        acc[c] = fmaf(tile[t0 + u], vv[u][c], acc[c]);
        }
    }
    float *o = a.out + (r.i * a.n_head + r.h) * D;
    for (int c = 0, d = tid; d < D; c++, d += FITM_ATT_THREADS)
        o[d] = acc[c];
}

/* Rows i0 + blockIdx.x of the call a. (Two blocks an SM: ptxas otherwise holds the kernel
 * to 168 registers and spills on sm_90.) */
__global__ void __launch_bounds__(FITM_ATT_THREADS, 2)
    fitm_attention_rows(fitm_cuda_attn a, int64_t i0, int n_fac, int keep_cap)
{
    fitm_grid_begin();
    fitm_attention_row(a, i0 + blockIdx.x, n_fac, keep_cap);
}

/* The KV stores kv[0..kv_n) (device memory) by every block of the launch: block b of nb
 * (flat) and its threads take elements b * 128 + tid, + nb * 128, .. of each store's K values
 * then V values. */
__device__ __forceinline__ void fitm_att_kv_store(const fitm_cuda_kv_rows *__restrict__ kv,
                                                  int kv_n)
{
    const int64_t nb = (int64_t)gridDim.x * gridDim.y * gridDim.z;
    const int64_t b =
        blockIdx.x + (int64_t)gridDim.x * (blockIdx.y + (int64_t)gridDim.y * blockIdx.z);
    for (int s = 0; s < kv_n; s++) {
        const fitm_cuda_kv_rows r = kv[s];
        for (int64_t i = b * FITM_ATT_THREADS + threadIdx.x; i < 2 * r.n;
             i += nb * FITM_ATT_THREADS)
            fitm_kv_put(r, i >= r.n, i >= r.n ? i - r.n : i);
    }
}

/* Call blockIdx.z of args (device memory); rows past that call's T have nothing to do. The
 * blocks first do the KV stores kv[0..kv_n) (none when kv_n is 0), which no row of the launch
 * reads. */
__global__ void __launch_bounds__(FITM_ATT_THREADS, 2)
    fitm_attention_rows_many(const fitm_cuda_attn *__restrict__ args, int n_fac, int keep_cap,
                             const fitm_cuda_kv_rows *__restrict__ kv, int kv_n)
{
    fitm_grid_begin();
    fitm_att_kv_store(kv, kv_n);
    const fitm_cuda_attn &a = args[blockIdx.z]; /* read where used: a copy would spill */
    if ((int64_t)blockIdx.x >= a.T)
        return; /* uniform per block, before any barrier */
    fitm_attention_row(a, blockIdx.x, n_fac, keep_cap);
}

/* ---- Tiled rows ----
 *
 * fitm_attention_tiles: one block of FITM_ATT_THREADS per tile of FITM_ATT_TILE_RH (row, head)
 * pairs: hb heads of one KV group (all G = H / Hkv of them, or FITM_ATT_TILE_RH at a time when
 * G is larger) times FITM_ATT_TILE_RH / hb consecutive rows, the tiles of the last rows (the
 * most keys under causal masking) launched first. Keys and values go through shared memory
 * FITM_ATT_TILE_KEYS at a time, each row of them loaded by one warp (coalesced; float4s through
 * registers, one step ahead of the step the block computes on, when D is a multiple of 4 and
 * the rows 16-byte aligned), into rows padded to fitm_att_tile_ld floats (a multiple of 32
 * plus 4, so the float4 reads of 8 consecutive keys hit distinct banks). For each pair the
 * kernel does what fitm_attention_row does for a plain row, in the same order on the same
 * values:
 *   pass 1: every score of the staged keys into the pair's scores in shared memory: all of
 *           the block's keys when they are at most FITM_ATT_KEEP, else a ring of
 *           FITM_ATT_RING; when a pair's current 128-key tile (from its own first visible key
 *           v0, which differs between rows under a window) is complete, one warp reduces it:
 *           lane l holds keys l, 32 + l, 64 + l, 96 + l of the tile, each group of 32 is
 *           reduced by the warp's butterfly (the old kernel's warp w holds keys 32w + l), and
 *           fitm_att_reduce4 gives the tile's max and sum as fitm_att_block_reduce gives
 *           them; the online update is fitm_att_rescale;
 *   pass 2: the scores (kept from pass 1, or computed again from the keys staged again),
 *           their probabilities fitm_att_p into shared memory, then
 *           out = fmaf(p_j, v_j, out) over the visible keys in order, each thread owning head
 *           dims tid and tid + 128 of every pair.
 * A score is the same fmaf chain over d in order (read four dims at a time, applied one by
 * one), so it has the bits of fitm_att_score; a kept score is that value, stored. */

#define FITM_ATT_TILE_RH 16   /* (row, head) pairs per block */
#define FITM_ATT_TILE_KEYS 32 /* keys staged per step: RH x KEYS scores = 4 per thread */
#define FITM_ATT_RING 256     /* scores kept per pair: a tile's 128 and a step's more fit */
#define FITM_ATT_KEEP 544 /* a block's keys whose scores pass 2 reuses: a 512-key window's, plus
                           * the block's rows (16 at most) */
#define FITM_ATT_SCORE_LD (FITM_ATT_KEEP + 4) /* a warp's 4 pairs (2 apart) 8 banks apart */

/* Floats per staged row of head_dim D: a multiple of 32, plus 4. */
__host__ __device__ __forceinline__ int fitm_att_tile_ld(int D)
{
    return (D + FITM_WARP - 1) / FITM_WARP * FITM_WARP + 4;
}

/* Floats of the larger of the pairs' scores (pass 1, and pass 2 when it reuses them) and the
 * staged values (pass 2 when it does not). */
__host__ __device__ __forceinline__ int fitm_att_tile_big(int D)
{
    const int ring = FITM_ATT_TILE_RH * FITM_ATT_SCORE_LD;
    const int vals = FITM_ATT_TILE_KEYS * fitm_att_tile_ld(D);
    return ring > vals ? ring : vals;
}

/* Dynamic shared memory of a tiled block: queries, keys, ring/values, probabilities, and
 * each pair's max and inverse denominator. */
static size_t fitm_att_tile_shm(int D)
{
    const int ld = fitm_att_tile_ld(D);
    return sizeof(float) * ((size_t)FITM_ATT_TILE_RH * ld + (size_t)FITM_ATT_TILE_KEYS * ld +
                            (size_t)fitm_att_tile_big(D) +
                            (size_t)FITM_ATT_TILE_KEYS * FITM_ATT_TILE_RH + 2 * FITM_ATT_TILE_RH);
}

/* Heads a block takes of one KV group: all G = H / Hkv of them, or 16 at a time; the block's
 * rows are then 16 / that many. */
__host__ __device__ __forceinline__ int fitm_att_tile_heads(const fitm_cuda_attn &a)
{
    const int G = a.n_head / a.n_head_kv;
    return G < FITM_ATT_TILE_RH ? G : FITM_ATT_TILE_RH;
}

/* dst[kk][d] = row c0 + kk of K (or V) of group g, for kk < nk: warp w takes rows w, w + 4..
 * (the scalar path, for head dims that are not a whole number of float4s) */
__device__ __forceinline__ void fitm_att_stage(const fitm_cuda_attn &a, const float *pre,
                                               const float *own, int g, int64_t c0, int nk,
                                               float *dst, int ld)
{
    const int lane = threadIdx.x % FITM_WARP;
    for (int kk = threadIdx.x / FITM_WARP; kk < nk; kk += FITM_ATT_THREADS / FITM_WARP) {
        const float *src = fitm_att_kv(a, pre, own, c0 + kk, g);
        for (int d = lane; d < a.head_dim; d += FITM_WARP)
            dst[kk * ld + d] = src[d];
    }
}

/* The vector path: a step's keys (or values) go through registers (U = 8 ND float4s), warp w
 * taking rows w, w + 4.. as fitm_att_stage does, lane l the float4s l and l + 32 (ND of them)
 * of each: loaded into r (PUT false: fitm_att_fetch issues every load of a step before any is
 * needed, so that one step's loads are in flight while the block computes on the step
 * before), or from r into the staged rows dst (PUT true) once they are. */
template <bool PUT, int U>
__device__ __forceinline__ void fitm_att_move(const fitm_cuda_attn &a, const float *pre,
                                              const float *own, int g, int64_t c0, int nk,
                                              float4 (&r)[U], float *dst, int ld)
{
    constexpr int ND = U / 8;
    constexpr int NW = FITM_ATT_THREADS / FITM_WARP;
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int D4 = a.head_dim / 4;
#pragma unroll
    for (int i = 0; i < FITM_ATT_TILE_KEYS / NW; i++) {
        const int kk = warp + NW * i;
        if (kk >= nk)
            continue;
#pragma unroll
        for (int c = 0; c < ND; c++) {
            const int f = lane + FITM_WARP * c;
            if (f >= D4)
                continue;
            if (PUT)
                ((float4 *)(dst + kk * ld))[f] = r[ND * i + c];
            else
                r[ND * i + c] = __ldg((const float4 *)fitm_att_kv(a, pre, own, c0 + kk, g) + f);
        }
    }
}

template <int U>
__device__ __forceinline__ void fitm_att_fetch(const fitm_cuda_attn &a, const float *pre,
                                               const float *own, int g, int64_t c0, int nk,
                                               float4 (&r)[U])
{
    fitm_att_move<false>(a, pre, own, g, c0, nk, r, NULL, 0);
}

/* Keys (or values) c0.. of a step into dst: from the registers fitm_att_fetch filled (vec), or
 * read now (the scalar path). */
template <int U>
__device__ __forceinline__ void fitm_att_land(const fitm_cuda_attn &a, bool vec, const float *pre,
                                              const float *own, int g, int64_t c0, int nk,
                                              float4 (&r)[U], float *dst, int ld)
{
    if (vec)
        fitm_att_move<true>(a, pre, own, g, c0, nk, r, dst, ld);
    else
        fitm_att_stage(a, pre, own, g, c0, nk, dst, ld);
}

/* The thread's four scores of the staged keys: pairs r0, r0 + 1 against keys kk0, kk0 + 16,
 * s[pair][key], each fitm_att_score's chain. */
__device__ __forceinline__ void fitm_att_tile_scores(const fitm_cuda_attn &a, const float *qs,
                                                     const float *ks, int ld, int r0, int kk0,
                                                     float s[2][2])
{
    const float *q0 = qs + r0 * ld, *q1 = q0 + ld;
    const float *k0 = ks + kk0 * ld, *k1 = k0 + 16 * ld;
    float s00 = 0.0f, s01 = 0.0f, s10 = 0.0f, s11 = 0.0f;
    const int D = a.head_dim;
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        const float4 x0 = *(const float4 *)(q0 + d), x1 = *(const float4 *)(q1 + d);
        const float4 y0 = *(const float4 *)(k0 + d), y1 = *(const float4 *)(k1 + d);
        s00 = fmaf(x0.x, y0.x, s00), s01 = fmaf(x0.x, y1.x, s01);
        s10 = fmaf(x1.x, y0.x, s10), s11 = fmaf(x1.x, y1.x, s11);
        s00 = fmaf(x0.y, y0.y, s00), s01 = fmaf(x0.y, y1.y, s01);
        s10 = fmaf(x1.y, y0.y, s10), s11 = fmaf(x1.y, y1.y, s11);
        s00 = fmaf(x0.z, y0.z, s00), s01 = fmaf(x0.z, y1.z, s01);
        s10 = fmaf(x1.z, y0.z, s10), s11 = fmaf(x1.z, y1.z, s11);
        s00 = fmaf(x0.w, y0.w, s00), s01 = fmaf(x0.w, y1.w, s01);
        s10 = fmaf(x1.w, y0.w, s10), s11 = fmaf(x1.w, y1.w, s11);
    }
    for (; d < D; d++) {
        s00 = fmaf(q0[d], k0[d], s00), s01 = fmaf(q0[d], k1[d], s01);
        s10 = fmaf(q1[d], k0[d], s10), s11 = fmaf(q1[d], k1[d], s11);
    }
    s[0][0] = fitm_att_scaled(s00, a.scale), s[0][1] = fitm_att_scaled(s01, a.scale);
    s[1][0] = fitm_att_scaled(s10, a.scale), s[1][1] = fitm_att_scaled(s11, a.scale);
}

/* Where a pair's scores keep key j (see keep in fitm_attention_tiles). */
__device__ __forceinline__ int fitm_att_slot(bool keep, int64_t j, int64_t k_lo)
{
    return keep ? (int)(j - k_lo) : (int)(j & (FITM_ATT_RING - 1));
}

/* Keys in the step from c0 of a tile whose last key is k_hi. */
__device__ __forceinline__ int fitm_att_nk(int64_t c0, int64_t k_hi)
{
    return k_hi + 1 - c0 < FITM_ATT_TILE_KEYS ? (int)(k_hi + 1 - c0) : FITM_ATT_TILE_KEYS;
}

/* Rows [i_begin, i_end) of the call a, every one plain; ND = head dims per thread in pass 2
 * (D <= 128: 1, else 2), PS = the parts the pairs are split into there (D <= 64: 2, the
 * threads of each half taking 8 pairs, else 1). The launch bounds ask for the blocks per SM
 * that the registers of a step in flight (buf) leave room for: without them ptxas holds
 * ND = 1 to 128 registers and spills. Block (x, y): rows i_begin + x * rows-per-tile..,
 * heads chunk y of the groups. */
template <int ND, int PS>
__global__ void __launch_bounds__(FITM_ATT_THREADS, ND > 1 ? 2 : 3)
    fitm_attention_tiles(fitm_cuda_attn a, int64_t i_begin, int64_t i_end)
{
    fitm_grid_begin();
    constexpr int RH = FITM_ATT_TILE_RH, KC = FITM_ATT_TILE_KEYS, NW = FITM_ATT_THREADS / FITM_WARP;
    FITM_DYNAMIC_SHARED(float4, shm4);
    const int tid = threadIdx.x, lane = tid % FITM_WARP, warp = tid / FITM_WARP;
    const int D = a.head_dim, ld = fitm_att_tile_ld(D);
    const int G = a.n_head / a.n_head_kv, hb = fitm_att_tile_heads(a), R = RH / hb;
    const int n_hc = (G + hb - 1) / hb;
    const int g = blockIdx.y / n_hc, hc = blockIdx.y % n_hc;
    const int h0 = g * G + hc * hb, nh = G - hc * hb < hb ? G - hc * hb : hb;
    /* the last tile first: a causal tile's work grows with its rows, and the longest tiles
     * starting first leave the short ones to fill the card at the end */
    const int64_t i0 = i_begin + (int64_t)(gridDim.x - 1 - blockIdx.x) * R;
    const int nr = i_end - i0 < R ? (int)(i_end - i0) : R;
    const int64_t P0 = a.pos0 + i0; /* the tile's first position; pair r is row r / hb */
    const int64_t k_lo = fitm_att_v0(a, P0), k_hi = P0 + nr - 1;
    const int64_t v0_last = fitm_att_v0(a, k_hi);
    /* the block's scores all fit: pass 1 keeps them (key j at j - k_lo) and pass 2 reads them
     * instead of computing them again; else pass 1 keeps a ring (key j at j % FITM_ATT_RING) */
    const bool keep = k_hi - k_lo < FITM_ATT_KEEP;
    float *qs = (float *)shm4, *ks = qs + RH * ld, *big = ks + KC * ld;
    float *ps = big + fitm_att_tile_big(D), *st_mx = ps + KC * RH, *st_inv = st_mx + RH;
    const bool vec = fitm_att_kv_float4(a); /* the vector path */
    float4 buf[8 * ND]; /* a step's keys or values on their way to shared memory */

    /* the pairs' queries; a pair past the tile's rows or the group's heads holds zeros */
    for (int r = warp; r < RH; r += NW) {
        const bool on = r / hb < nr && r % hb < nh;
        const float *qg = a.q + ((i0 + r / hb) * a.n_head + h0 + r % hb) * D;
        for (int d = lane; d < ld; d += FITM_WARP)
            qs[r * ld + d] = on && d < D ? qg[d] : 0.0f;
    }
    /* this thread's scores: pairs r0, r0 + 1, keys kk0, kk0 + 16 of each step; a warp's lanes
     * read 4 pairs' and 8 consecutive keys' float4s at a time, one shared-memory wavefront each
     * (16 keys would take two) */
    const int r0 = 2 * (4 * (warp % 2) + lane / 8), kk0 = 8 * (warp / 2) + lane % 8;

    /* pass 1: warp w keeps pairs w, w + 4, w + 8, w + 12 (the same value in every lane) */
    float mx[RH / NW], l[RH / NW];
    int64_t ts[RH / NW]; /* the pair's current tile's first key */
#pragma unroll
    for (int k = 0; k < RH / NW; k++) {
        mx[k] = -INFINITY, l[k] = 0.0f;
        ts[k] = fitm_att_v0(a, P0 + (warp + NW * k) / hb);
    }
    if (vec)
        fitm_att_fetch(a, a.k_pre, a.k_own, g, k_lo, fitm_att_nk(k_lo, k_hi), buf);
    for (int64_t c0 = k_lo; c0 <= k_hi; c0 += KC) {
        const int nk = fitm_att_nk(c0, k_hi);
        /* ks free: the step before read it before its second barrier */
        fitm_att_land(a, vec, a.k_pre, a.k_own, g, c0, nk, buf, ks, ld);
        __syncthreads(); /* ks written; the ring's reads of the step before done */
        if (vec && c0 + KC <= k_hi)
            fitm_att_fetch(a, a.k_pre, a.k_own, g, c0 + KC, fitm_att_nk(c0 + KC, k_hi), buf);
        float s[2][2];
        fitm_att_tile_scores(a, qs, ks, ld, r0, kk0, s);
#pragma unroll
        for (int x = 0; x < 2; x++)
#pragma unroll
            for (int y = 0; y < 2; y++)
                if (kk0 + 16 * y < nk)
                    big[(r0 + x) * FITM_ATT_SCORE_LD +
                        fitm_att_slot(keep, c0 + kk0 + 16 * y, k_lo)] = s[x][y];
        __syncthreads();
#pragma unroll
        for (int k = 0; k < RH / NW; k++) {
            const int r = warp + NW * k;
            const int64_t p = P0 + r / hb;
            if (r / hb >= nr || r % hb >= nh)
                continue;
            const float *ring = big + r * FITM_ATT_SCORE_LD;
            /* each tile of the pair's that this step completed (a full one and the short last
             * one may end in the same step); uniform per warp */
            for (;;) {
                const int64_t end =
                    ts[k] + FITM_ATT_THREADS - 1 < p ? ts[k] + FITM_ATT_THREADS - 1 : p;
                if (ts[k] > p || end >= c0 + nk)
                    break;
                float v[4], e[4];
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    const int64_t j = ts[k] + FITM_WARP * w + lane;
                    v[w] = j <= p ? ring[fitm_att_slot(keep, j, k_lo)] : -INFINITY;
                }
                const float tmx = fitm_att_reduce4(fitm_warp_max(v[0]), fitm_warp_max(v[1]),
                                                   fitm_warp_max(v[2]), fitm_warp_max(v[3]), true);
                const float m_new = fmaxf(mx[k], tmx);
#pragma unroll
                for (int w = 0; w < 4; w++)
                    e[w] = ts[k] + FITM_WARP * w + lane <= p ? fitm_att_exp(v[w], m_new) : 0.0f;
                const float sum = fitm_att_reduce4(fitm_warp_sum(e[0]), fitm_warp_sum(e[1]),
                                                   fitm_warp_sum(e[2]), fitm_warp_sum(e[3]), false);
                l[k] = fitm_att_rescale(l[k], mx[k], m_new, sum);
                mx[k] = m_new;
                ts[k] += FITM_ATT_THREADS;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RH / NW; k++)
        if (lane == 0) {
            st_mx[warp + NW * k] = mx[k];
            st_inv[warp + NW * k] = fitm_att_inv(l[k]);
        }

    /* pass 2: the output; thread tid owns dims dt (and dt + 128) of pairs rb to rb + RP - 1:
     * of every pair (PS = 1, dt = tid), or of half of them (PS = 2, dt = tid % 64), so that
     * no thread past D has only clamped dims to sum */
    constexpr int RP = RH / PS, TD = FITM_ATT_THREADS / PS;
    const int rb = PS > 1 ? tid / TD * RP : 0, dt = PS > 1 ? tid % TD : tid;
    float acc[RP][ND];
#pragma unroll
    for (int r = 0; r < RP; r++)
#pragma unroll
        for (int c = 0; c < ND; c++)
            acc[r][c] = 0.0f;
    /* the thread's dims, clamped into the row: a dim past D computes a value never written */
    const int d0 = dt < D ? dt : D - 1;
    const int d1 = dt + FITM_ATT_THREADS < D ? dt + FITM_ATT_THREADS : D - 1;
    /* the step's values: in ks when the scores are kept (no keys staged), else in big */
    float *vs = keep ? ks : big;
    /* what loads one step ahead: the values when the scores are kept, else the keys */
    const float *nx_pre = keep ? a.v_pre : a.k_pre, *nx_own = keep ? a.v_own : a.k_own;
    if (vec)
        fitm_att_fetch(a, nx_pre, nx_own, g, k_lo, fitm_att_nk(k_lo, k_hi), buf);
    for (int64_t c0 = k_lo; c0 <= k_hi; c0 += KC) {
        const int nk = fitm_att_nk(c0, k_hi);
        /* ks free: the step before (or pass 1) read it before its second barrier */
        if (!keep)
            fitm_att_land(a, vec, a.k_pre, a.k_own, g, c0, nk, buf, ks, ld);
        __syncthreads(); /* ks written; vs and ps read by the step before; st_mx, st_inv set */
        float s[2][2];
        if (keep) {
#pragma unroll
            for (int x = 0; x < 2; x++)
#pragma unroll
                for (int y = 0; y < 2; y++)
                    s[x][y] = kk0 + 16 * y < nk
                                  ? big[(r0 + x) * FITM_ATT_SCORE_LD + (int)(c0 - k_lo) + kk0 +
                                        16 * y]
                                  : 0.0f;
        } else {
            if (vec) /* the values load while the scores compute */
                fitm_att_fetch(a, a.v_pre, a.v_own, g, c0, nk, buf);
            fitm_att_tile_scores(a, qs, ks, ld, r0, kk0, s);
        }
#pragma unroll
        for (int x = 0; x < 2; x++)
#pragma unroll
            for (int y = 0; y < 2; y++) {
                const int r = r0 + x, kk = kk0 + 16 * y;
                const int64_t j = c0 + kk, p = P0 + r / hb;
                const bool vis =
                    r / hb < nr && r % hb < nh && kk < nk && j >= fitm_att_v0(a, p) && j <= p;
                ps[kk * RH + r] = vis ? fitm_att_p(s[x][y], st_mx[r], st_inv[r]) : 0.0f;
            }
        fitm_att_land(a, vec, a.v_pre, a.v_own, g, c0, nk, buf, vs, ld);
        if (vec && c0 + KC <= k_hi) /* the next step's loads while this step's values are summed */
            fitm_att_fetch(a, nx_pre, nx_own, g, c0 + KC, fitm_att_nk(c0 + KC, k_hi), buf);
        __syncthreads(); /* ps and vs written */
        /* every key of the step visible from every row: no test per key */
        const bool all = c0 >= v0_last && c0 + nk - 1 <= P0;
        for (int kk = 0; kk < nk; kk++) {
            const float4 *p4 = (const float4 *)(ps + kk * RH + rb);
            float pr[RP];
#pragma unroll
            for (int q = 0; q < RP / 4; q++) {
                const float4 t = p4[q];
                pr[4 * q] = t.x, pr[4 * q + 1] = t.y, pr[4 * q + 2] = t.z, pr[4 * q + 3] = t.w;
            }
            float v[ND];
            v[0] = vs[kk * ld + d0];
            if (ND > 1)
                v[ND - 1] = vs[kk * ld + d1];
            if (all) {
#pragma unroll
                for (int r = 0; r < RP; r++)
#pragma unroll
                    for (int c = 0; c < ND; c++)
                        acc[r][c] = fmaf(pr[r], v[c], acc[r][c]);
            } else {
                /* the pairs that see key j: rows from j - P0 (causal) to j + window - 1 - P0 */
                const int64_t j = c0 + kk;
                const int64_t lo = j - P0 > 0 ? j - P0 : 0;
                int64_t hi = nr - 1;
                if (a.window > 0 && j + a.window - 1 - P0 < hi)
                    hi = j + a.window - 1 - P0;
                const int64_t r_lo = lo * hb, r_hi = (hi + 1) * hb;
#pragma unroll
                for (int r = 0; r < RP; r++)
                    if (rb + r >= r_lo && rb + r < r_hi)
#pragma unroll
                        for (int c = 0; c < ND; c++)
                            acc[r][c] = fmaf(pr[r], v[c], acc[r][c]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RP; r++) {
        const int rr = rb + r;
        if (rr / hb >= nr || rr % hb >= nh)
            continue;
        float *o = a.out + ((i0 + rr / hb) * a.n_head + h0 + rr % hb) * D;
#pragma unroll
        for (int c = 0; c < ND; c++)
            if (dt + FITM_ATT_THREADS * c < D)
                o[dt + FITM_ATT_THREADS * c] = acc[r][c];
    }
}

/* Arguments a launch refuses (cudaErrorInvalidValue). */
static bool fitm_attn_args_bad(const fitm_cuda_attn *a)
{
    return !a || a->T < 0 || a->n_head < 1 || a->n_head_kv < 1 || a->n_head % a->n_head_kv != 0 ||
           a->head_dim < 1 || a->head_dim > FITM_ATT_MAX_D || a->T > INT32_MAX ||
           a->n_head > 65535 || a->iv_n_spans < 0 || a->iv_n_spans > FITM_CUDA_ATTN_MAX_SPANS ||
           a->cap_n_spans < 0 || !a->q || !a->out || !a->k_own || !a->v_own ||
           (a->own_base > 0 && (!a->k_pre || !a->v_pre)) || (a->iv_n_spans > 0 && !a->iv_spans) ||
           a->mix_n < 0 || a->mix_n > FITM_CUDA_ATTN_MAX_MIX ||
           (a->mix_n > 0 && (!a->mix_q || !a->mix_k || !a->mix_w || a->mix_k_heads < 1 ||
                             a->n_head % a->mix_k_heads != 0)) ||
           (a->k_new && (!a->v_new || a->new_base < a->own_base));
}

/* Arguments the kernels for plain rows refuse (cudaErrorInvalidValue): rows [i0, i1) of the
 * call a must lie in it and be plain (no capture, no mixture, none intervened), with no new
 * rows read from a store's source. */
static bool fitm_attn_plain_bad(const fitm_cuda_attn *a, int64_t i0, int64_t i1)
{
    return fitm_attn_args_bad(a) || i0 < 0 || i1 < i0 || i1 > a->T || a->mix_n > 0 ||
           a->cap_index || a->k_new || (a->iv_n_spans > 0 && a->pos0 + i1 > a->iv_from_pos);
}

/* Dynamic shared memory of a one-row launch whose rows have at most n_fac intervention spans
 * and keep up to keep_cap scores; kernel's opt-in raised to it where needed (its static
 * arrays take about 2.4 KiB of the 48: 4 KiB counted). */
template <typename K>
static int fitm_att_row_smem(K kernel, int n_fac, int keep_cap, size_t *shm)
{
    *shm = sizeof(float) * ((size_t)FITM_ATT_ROW_STAGE + (size_t)n_fac + (size_t)keep_cap);
    return fitm_smem_optin(kernel, *shm, 4 * 1024);
}

/* The scores a plain row of a call may keep: its rows up to position pos0 + i1 - 1 see at
 * most that many keys (fewer under a window), rounded up to a power of two from 512, at most
 * FITM_ATT_ROW_KEEP. The rounding keeps a decode step's launch the same from one position to
 * the next (a captured step replays) but at the powers of two. */
static int fitm_att_keep_cap(const fitm_cuda_attn *a, int64_t i1)
{
    if (a->mix_n > 0)
        return 0;
    int64_t keys = a->pos0 + i1;
    if (a->window > 0 && a->window < keys)
        keys = a->window;
    int cap = 512;
    while (cap < keys && cap < FITM_ATT_ROW_KEEP)
        cap *= 2;
    return cap;
}

extern "C" int fitm_cuda_attention_rows(const fitm_cuda_attn *a, int64_t i0, int64_t i1,
                                        void *stream)
{
    if (fitm_attn_args_bad(a) || i0 < 0 || i1 < i0 || i1 > a->T)
        return (int)cudaErrorInvalidValue;
    if (i1 == i0)
        return 0;
    const int keep_cap = fitm_att_keep_cap(a, i1);
    size_t shm;
    const int e = fitm_att_row_smem(fitm_attention_rows, a->iv_n_spans, keep_cap,
                                    &shm);
    if (e)
        return e;
    FITM_LAUNCH(dim3((unsigned)(i1 - i0), (unsigned)a->n_head), FITM_ATT_THREADS, shm,
                fitm_stream(stream), fitm_attention_rows)
    (*a, i0, a->iv_n_spans, keep_cap);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_attention(const fitm_cuda_attn *a, void *stream)
{
    return fitm_cuda_attention_rows(a, 0, a ? a->T : 0, stream);
}

extern "C" int fitm_cuda_attention_tile_rows(int32_t n_head, int32_t n_head_kv)
{
    if (n_head < 1 || n_head_kv < 1 || n_head % n_head_kv != 0)
        return 0;
    fitm_cuda_attn a = {};
    a.n_head = n_head;
    a.n_head_kv = n_head_kv;
    return FITM_ATT_TILE_RH / fitm_att_tile_heads(a);
}

template <int ND, int PS>
static int fitm_attention_tiles_launch(const fitm_cuda_attn *a, int64_t i0, int64_t i1,
                                       cudaStream_t stream)
{
    const size_t shm = fitm_att_tile_shm(a->head_dim);
    const int e = fitm_smem_optin(fitm_attention_tiles<ND, PS>, shm);
    if (e)
        return e;
    const int hb = fitm_att_tile_heads(*a), R = FITM_ATT_TILE_RH / hb;
    const int G = a->n_head / a->n_head_kv;
    const dim3 grid((unsigned)((i1 - i0 + R - 1) / R),
                    (unsigned)(a->n_head_kv * ((G + hb - 1) / hb)));
    FITM_LAUNCH(grid, FITM_ATT_THREADS, shm, stream, fitm_attention_tiles<ND, PS>)(*a, i0, i1);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_attention_tiled(const fitm_cuda_attn *a, int64_t i0, int64_t i1,
                                         void *stream)
{
    if (fitm_attn_plain_bad(a, i0, i1))
        return (int)cudaErrorInvalidValue;
    if (i1 == i0)
        return 0;
    return a->head_dim > FITM_ATT_THREADS
               ? fitm_attention_tiles_launch<2, 1>(a, i0, i1, fitm_stream(stream))
           : a->head_dim > FITM_ATT_THREADS / 2
               ? fitm_attention_tiles_launch<1, 1>(a, i0, i1, fitm_stream(stream))
               : fitm_attention_tiles_launch<1, 2>(a, i0, i1, fitm_stream(stream));
}

extern "C" int fitm_cuda_attention_many(const fitm_cuda_attn *a, const fitm_cuda_attn *a_dev,
                                        int n, const fitm_cuda_kv_rows *kv,
                                        const fitm_cuda_kv_rows *kv_dev, int kv_n, void *stream)
{
    int64_t kv_max = 0;
    if (n < 1 || n > 65535 || !a_dev || kv_n < 0 ||
        (kv_n > 0 && (!kv_dev || !fitm_kv_rows_ok(kv, kv_n, &kv_max))))
        return (int)cudaErrorInvalidValue;
    int64_t max_T = 0;
    int32_t max_spans = 0;
    int keep_cap = 0;
    for (int s = 0; s < n; s++) {
        if (fitm_attn_args_bad(&a[s]) || a[s].n_head != a[0].n_head)
            return (int)cudaErrorInvalidValue;
        max_T = a[s].T > max_T ? a[s].T : max_T;
        max_spans = a[s].iv_n_spans > max_spans ? a[s].iv_n_spans : max_spans;
        const int kc = fitm_att_keep_cap(&a[s], a[s].T);
        keep_cap = kc > keep_cap ? kc : keep_cap;
    }
    if (max_T == 0 && kv_max == 0)
        return 0;
    size_t shm;
    const int e = fitm_att_row_smem(fitm_attention_rows_many, max_spans, keep_cap, &shm);
    if (e)
        return e;
    FITM_LAUNCH(dim3((unsigned)(max_T > 0 ? max_T : 1), (unsigned)a[0].n_head, (unsigned)n),
                FITM_ATT_THREADS, shm, fitm_stream(stream), fitm_attention_rows_many)
    (a_dev, max_spans, keep_cap, kv_max > 0 ? kv_dev : NULL, kv_max > 0 ? kv_n : 0);
    return (int)cudaGetLastError();
}

/* ---- Tensor-core rows ----
 *
 * fitm_attention_bf16_tiles: the plain rows of a BATCH call with gpu_weights = bf16 (the
 * backend's dispatch, backend_cuda.c), with Q, K, V and the probabilities rounded to bfloat16
 * on the tensor cores (WMMA 16 x 16 x 16, F32 accumulators) and the softmax in F32. One block
 * of 4 warps per tile of FITM_ATB_PAIRS (row, head) pairs: hb heads of one KV group times
 * FITM_ATB_PAIRS / hb consecutive rows, the last rows' tiles first. Keys go by blocks of
 * FITM_ATB_KEYS anchored at absolute positions (key j in block j / 64), from the block of the
 * tile's first visible key to the block of its last row; for each key block:
 *   1. K staged (bfloat16) into shared memory, then S (pairs x 64) = Q K^T, each warp two
 *      16 x 16 fragments over D / 16 k steps, stored to shared memory;
 *   2. V staged into the same buffer while four threads a pair do the online softmax of
 *      their pair's 64 scores (scaled; masked keys -inf; thread t % 4 takes keys t % 4 + 4 k
 *      in order, the four partial sums combined by a butterfly): the new maximum, the factor
 *      alpha = exp(old max - new max) by which the pair's output row in shared memory is
 *      rescaled, and P = bfloat16(exp(s - new max)), whose rounded values the denominator
 *      sums;
 *   3. O += P V: the output (pairs x D, F32) lives in shared memory, so each fragment is
 *      loaded as an accumulator, given its four k16 steps and stored back (WMMA's fragment
 *      layout is unspecified, so the row rescale is done in shared memory, not in fragments).
 * The output is O / l. Head dims are padded to a multiple of 16 with zeros, and keys past the
 * tile's last row are zeros, which add exactly nothing.
 *
 * Row invariance: a row's result depends only on its query, the keys and values it sees and
 * its position, not on T, i0 / i1, where it falls in its tile or the rows beside it. Every
 * step a row takes is fixed by its position: the key blocks are anchored at absolute
 * positions, and a block that is wholly masked for a row leaves its state bit for bit as it
 * was (before the row's first visible key: maximum -inf, alpha 1, P 0 and the output rows
 * exact zeros; after its last: alpha exp(0) = 1, P 0, and the mma adds exact zeros), so the
 * extra blocks its tile visits for other rows never show. An element of an mma depends only
 * on its row of A and its column of B. The bits are not those of the F32 kernels above. */

#define FITM_ATB_PAIRS 32
#define FITM_ATB_KEYS 64
#define FITM_ATB_LS (FITM_ATB_KEYS + 4) /* floats per row of the scores         */
#define FITM_ATB_LP (FITM_ATB_KEYS + 8) /* bfloat16 per row of the probabilities */

/* Where each array of a tensor-core block lies in its dynamic shared memory (byte offsets,
 * each a multiple of 128), for head dim D padded to dp: queries (pairs, lq) and the staged K
 * or V (keys, lq) in bfloat16, scores (pairs, FITM_ATB_LS) F32, probabilities (pairs,
 * FITM_ATB_LP) bfloat16, output (pairs, lo) F32, and the pairs' denominators. */
struct fitm_atb_layout {
    int dp, lq, lo;
    unsigned q, kv, s, p, o, l, total;
};

__host__ __device__ __forceinline__ unsigned fitm_atb_up(unsigned n)
{
    return (n + 127u) / 128u * 128u;
}

__host__ __device__ __forceinline__ fitm_atb_layout fitm_atb_layout_of(int D)
{
    fitm_atb_layout L;
    L.dp = (D + 15) / 16 * 16;
    L.lq = L.dp + 8; /* rows 16 bytes apart in banks; every fragment 32-byte aligned */
    L.lo = L.dp + 4;
    L.q = 0;
    L.kv = L.q + fitm_atb_up(FITM_ATB_PAIRS * L.lq * 2);
    L.s = L.kv + fitm_atb_up(FITM_ATB_KEYS * L.lq * 2);
    L.p = L.s + fitm_atb_up(FITM_ATB_PAIRS * FITM_ATB_LS * 4);
    L.o = L.p + fitm_atb_up(FITM_ATB_PAIRS * FITM_ATB_LP * 2);
    L.l = L.o + fitm_atb_up(FITM_ATB_PAIRS * L.lo * 4);
    L.total = L.l + FITM_ATB_PAIRS * 4;
    return L;
}

__host__ __device__ __forceinline__ int fitm_atb_heads(const fitm_cuda_attn &a)
{
    const int G = a.n_head / a.n_head_kv;
    return G < FITM_ATB_PAIRS ? G : FITM_ATB_PAIRS;
}

/* dst (FITM_ATB_KEYS, lq) = keys kb.. of K (v false) or V of group g in bfloat16, zeros past
 * key last and in the padded dims. vec: D a multiple of 4 and the arrays 16-byte aligned:
 * float4 slots, slot e of the block being key e / (dp / 4), dims 4 (e % (dp / 4)).., thread
 * t taking slots t, t + 128, .. (a key's row coalesced), eight loads in flight before their
 * stores; else element by element. */
__device__ __forceinline__ void fitm_atb_stage(const fitm_cuda_attn &a, const fitm_atb_layout &L,
                                               __nv_bfloat16 *dst, int64_t kb, int64_t last,
                                               int g, bool v, bool vec)
{
    const int D = a.head_dim, tid = threadIdx.x;
    const float *pre = v ? a.v_pre : a.k_pre, *own = v ? a.v_own : a.k_own;
    if (vec) {
        constexpr int BATCH = 8;
        const int per_key = L.dp / 4, n = FITM_ATB_KEYS * per_key;
        for (int e0 = tid; e0 < n; e0 += BATCH * FITM_ATT_THREADS) {
            float4 x[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; u++) {
                const int e = e0 + u * FITM_ATT_THREADS, kk = e / per_key, d = 4 * (e % per_key);
                x[u] = float4{0.0f, 0.0f, 0.0f, 0.0f};
                if (e < n && kb + kk <= last && d < D)
                    x[u] = __ldg((const float4 *)(fitm_att_kv(a, pre, own, kb + kk, g) + d));
            }
#pragma unroll
            for (int u = 0; u < BATCH; u++) {
                const int e = e0 + u * FITM_ATT_THREADS, kk = e / per_key, d = 4 * (e % per_key);
                if (e < n) {
                    __nv_bfloat16 *o = dst + kk * L.lq + d;
                    o[0] = fitm_to_bf16(x[u].x), o[1] = fitm_to_bf16(x[u].y);
                    o[2] = fitm_to_bf16(x[u].z), o[3] = fitm_to_bf16(x[u].w);
                }
            }
        }
        return;
    }
    for (int e = tid; e < FITM_ATB_KEYS * L.dp; e += FITM_ATT_THREADS) {
        const int kk = e / L.dp, d = e % L.dp;
        const int64_t j = kb + kk;
        const float x = j <= last && d < D ? fitm_att_kv(a, pre, own, j, g)[d] : 0.0f;
        dst[kk * L.lq + d] = fitm_to_bf16(x);
    }
}

/* Rows [i_begin, i_end) of the call a, every one plain (see the section's header). Block (x,
 * y): a tile of rows from the end, heads chunk y of the groups. */
__global__ void __launch_bounds__(FITM_ATT_THREADS, 2)
    fitm_attention_bf16_tiles(fitm_cuda_attn a, int64_t i_begin, int64_t i_end)
{
    fitm_grid_begin();
    namespace wmma = nvcuda::wmma;
    FITM_DYNAMIC_SHARED(__align__(128) unsigned char, shm);
    const fitm_atb_layout L = fitm_atb_layout_of(a.head_dim);
    __nv_bfloat16 *qs = (__nv_bfloat16 *)(shm + L.q), *kvs = (__nv_bfloat16 *)(shm + L.kv);
    __nv_bfloat16 *ps = (__nv_bfloat16 *)(shm + L.p);
    float *ss = (float *)(shm + L.s), *os = (float *)(shm + L.o), *ls = (float *)(shm + L.l);
    const int tid = threadIdx.x, warp = tid / FITM_WARP, D = a.head_dim, H = a.n_head;
    const int G = H / a.n_head_kv, hb = fitm_atb_heads(a), R = FITM_ATB_PAIRS / hb;
    const int n_hc = (G + hb - 1) / hb;
    const int g = blockIdx.y / n_hc, hc = blockIdx.y % n_hc;
    const int h0 = g * G + hc * hb, nh = G - hc * hb < hb ? G - hc * hb : hb;
    const int64_t i0 = i_begin + (int64_t)(gridDim.x - 1 - blockIdx.x) * R;
    const int nr = i_end - i0 < R ? (int)(i_end - i0) : R;
    const int64_t P0 = a.pos0 + i0, last = P0 + nr - 1;
    const bool vec = fitm_att_kv_float4(a);

    /* pair m is row m / hb, head h0 + m % hb; pairs past the tile's rows or heads are zeros */
    for (int e = tid; e < FITM_ATB_PAIRS * L.dp; e += FITM_ATT_THREADS) {
        const int m = e / L.dp, d = e % L.dp, r = m / hb, hh = m % hb;
        const float x =
            r < nr && hh < nh && d < D ? a.q[((i0 + r) * H + h0 + hh) * D + d] : 0.0f;
        qs[m * L.lq + d] = fitm_to_bf16(x);
        os[m * L.lo + d] = 0.0f;
    }

    /* the softmax's pair: four threads each, the same values in all four */
    const int sm = tid / 4, sq = tid % 4, sr = sm / hb;
    const bool live = sr < nr && sm % hb < nh;
    const int64_t sp = P0 + sr;
    const int64_t s_lo = live ? fitm_att_v0(a, sp) : INT64_MAX, s_hi = live ? sp : -1;
    float mx = -INFINITY, l = 0.0f;

    for (int64_t kb = fitm_att_v0(a, P0) / FITM_ATB_KEYS * FITM_ATB_KEYS; kb <= last;
         kb += FITM_ATB_KEYS) {
        fitm_atb_stage(a, L, kvs, kb, last, g, false, vec);
        __syncthreads();
        { /* S = Q K^T: warp w the fragments (w % 2, 2 (w / 2) + j) */
            const int mt = warp % 2, nt = warp / 2 * 2;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
            wmma::fill_fragment(acc[0], 0.0f);
            wmma::fill_fragment(acc[1], 0.0f);
            for (int d = 0; d < L.dp; d += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                wmma::load_matrix_sync(fa, qs + mt * 16 * L.lq + d, L.lq);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    /* the staged key rows are S's columns: B (d, key) in column-major */
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
                    wmma::load_matrix_sync(fb, kvs + (nt + j) * 16 * L.lq + d, L.lq);
                    wmma::mma_sync(acc[j], fa, fb, acc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::store_matrix_sync(ss + mt * 16 * FITM_ATB_LS + (nt + j) * 16, acc[j],
                                        FITM_ATB_LS, wmma::mem_row_major);
        }
        __syncthreads();
        fitm_atb_stage(a, L, kvs, kb, last, g, true, vec);
        { /* the online softmax of pair sm's keys kb + sq + 4 k */
            float s[FITM_ATB_KEYS / 4], bmax = -INFINITY;
#pragma unroll
            for (int k = 0; k < FITM_ATB_KEYS / 4; k++) {
                const int64_t j = kb + sq + 4 * k;
                s[k] = j >= s_lo && j <= s_hi
                           ? fitm_att_scaled(ss[sm * FITM_ATB_LS + sq + 4 * k], a.scale)
                           : -INFINITY;
                bmax = fmaxf(bmax, s[k]);
            }
            bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 1));
            bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 2));
            const float m_new = fmaxf(mx, bmax);
            /* no key of the pair seen yet: nothing changes (exp(-inf - -inf) would be NaN) */
            const float alpha = m_new == -INFINITY ? 1.0f : fitm_att_exp(mx, m_new);
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < FITM_ATB_KEYS / 4; k++) {
                const __nv_bfloat16 p =
                    fitm_to_bf16(s[k] == -INFINITY ? 0.0f : fitm_att_exp(s[k], m_new));
                ps[sm * FITM_ATB_LP + sq + 4 * k] = p;
                sum = __fadd_rn(sum, __bfloat162float(p));
            }
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
            l = m_new == -INFINITY ? 0.0f : fitm_att_rescale(l, mx, m_new, sum);
            mx = m_new;
            if (alpha != 1.0f)
                for (int d = sq; d < L.dp; d += 4)
                    os[sm * L.lo + d] = __fmul_rn(os[sm * L.lo + d], alpha);
        }
        __syncthreads();
        { /* O += P V: warp w the fragments (w % 2, n) for n = w / 2, w / 2 + 2, .., its
           * rows of P loaded once for all of them */
            const int mt = warp % 2;
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>
                fa[FITM_ATB_KEYS / 16];
#pragma unroll
            for (int k = 0; k < FITM_ATB_KEYS / 16; k++)
                wmma::load_matrix_sync(fa[k], ps + mt * 16 * FITM_ATB_LP + 16 * k, FITM_ATB_LP);
            for (int nt = warp / 2; nt < L.dp / 16; nt += 2) {
                float *o = os + mt * 16 * L.lo + nt * 16;
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::load_matrix_sync(acc, o, L.lo, wmma::mem_row_major);
#pragma unroll
                for (int k = 0; k < FITM_ATB_KEYS / 16; k++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
                    wmma::load_matrix_sync(fb, kvs + 16 * k * L.lq + nt * 16, L.lq);
                    wmma::mma_sync(acc, fa[k], fb, acc);
                }
                wmma::store_matrix_sync(o, acc, L.lo, wmma::mem_row_major);
            }
        }
        __syncthreads(); /* K of the next block overwrites V, and S and P are written again */
    }
    if (sq == 0)
        ls[sm] = l;
    __syncthreads();
    for (int e = tid; e < FITM_ATB_PAIRS * D; e += FITM_ATT_THREADS) {
        const int m = e / D, d = e % D, r = m / hb, hh = m % hb;
        if (r < nr && hh < nh)
            a.out[((i0 + r) * H + h0 + hh) * D + d] = __fdiv_rn(os[m * L.lo + d], ls[m]);
    }
}

extern "C" int fitm_cuda_attention_bf16(const fitm_cuda_attn *a, int64_t i0, int64_t i1,
                                        void *stream)
{
    if (fitm_attn_plain_bad(a, i0, i1))
        return (int)cudaErrorInvalidValue;
    if (i1 == i0)
        return 0;
    const fitm_atb_layout L = fitm_atb_layout_of(a->head_dim);
    const int e = fitm_smem_optin(fitm_attention_bf16_tiles, L.total);
    if (e)
        return e;
    const int hb = fitm_atb_heads(*a), R = FITM_ATB_PAIRS / hb;
    const int G = a->n_head / a->n_head_kv;
    const dim3 grid((unsigned)((i1 - i0 + R - 1) / R),
                    (unsigned)(a->n_head_kv * ((G + hb - 1) / hb)));
    FITM_LAUNCH(grid, FITM_ATT_THREADS, L.total, fitm_stream(stream), fitm_attention_bf16_tiles)
    (*a, i0, i1);
    return (int)cudaGetLastError();
}
