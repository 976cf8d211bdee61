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
 * plain probability in every later pass, as the CPU backend's attn_mix_probs. */
#include "common.cuh"
#include "kernels.h"

#define FITM_ATT_THREADS 128
#define FITM_ATT_MAX_D 256
#define FITM_ATT_MIN_MASS 1e-30 /* FITM_OPS_INTERVENE_MIN_MASS */

struct fitm_att_row {
    int64_t i, p, v0; /* row in the call, its position, first visible key */
    int h, g;
};

__device__ __forceinline__ const float *fitm_att_kv(const fitm_cuda_attn &a, const float *pre,
                                                    const float *own, int64_t j, int g)
{
    const int64_t HkvD = (int64_t)a.n_head_kv * a.head_dim;
    return (j < a.own_base ? pre + j * HkvD : own + (j - a.own_base) * HkvD) +
           (int64_t)g * a.head_dim;
}

__device__ __forceinline__ float fitm_att_score(const fitm_cuda_attn &a, const float *q, int64_t j,
                                                int g)
{
    const float *k = fitm_att_kv(a, a.k_pre, a.k_own, j, g);
    float s = 0.0f;
    for (int d = 0; d < a.head_dim; d++)
        s = fmaf(q[d], k[d], s);
    return s * a.scale;
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
    return s * a.scale;
}

/* A row's softmax: the plain one (q, mx, inv_l), or a mixture's per-expert maxima and inverse
 * denominators (shared) with the row's weights (global). */
struct fitm_att_soft {
    const float *q;
    float mx, inv_l;
    int n_mix; /* 0: plain */
    const float *w, *mmx, *minv;
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
        pj = expf(fitm_att_score(a, s.q, j, r.g) - s.mx) * s.inv_l;
    } else {
        pj = 0.0f;
        for (int e = 0; e < s.n_mix; e++)
            if (s.w[e] != 0.0f)
                pj += s.w[e] * (expf(fitm_att_score_mix(a, r, e, j) - s.mmx[e]) * s.minv[e]);
    }
    if (factor) {
        const int k = fitm_att_span_of(a, j);
        if (k >= 0)
            pj *= factor[k];
    }
    return pj;
}

/* Block-wide double sum, returned to every thread (FITM_ATT_THREADS threads). */
__device__ double fitm_att_sum_d(double v, double *shm)
{
    for (int o = FITM_WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (threadIdx.x % FITM_WARP == 0)
        shm[threadIdx.x / FITM_WARP] = v;
    __syncthreads();
    double r = 0.0;
    for (int w = 0; w < FITM_ATT_THREADS / FITM_WARP; w++)
        r += shm[w];
    return r;
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

/* The row's softmax maximum and inverse denominator over its visible keys, online over
 * tiles: of the plain scores (e < 0) or of expert e's. */
__device__ void fitm_att_stats(const fitm_cuda_attn &a, const fitm_att_row &r, const float *q,
                               int e, float *red, float *mx_out, float *inv_l_out)
{
    float mx = -INFINITY, l = 0.0f;
    for (int64_t j0 = r.v0; j0 <= r.p; j0 += FITM_ATT_THREADS) {
        const int64_t j = j0 + threadIdx.x;
        const float s = j > r.p  ? -INFINITY
                        : e < 0 ? fitm_att_score(a, q, j, r.g)
                                 : fitm_att_score_mix(a, r, e, j);
        const float tmx = fitm_block_reduce(s, red, true);
        const float m_new = fmaxf(mx, tmx);
        const float ex = j <= r.p ? expf(s - m_new) : 0.0f;
        l = l * expf(mx - m_new) + fitm_block_reduce(ex, red, false);
        mx = m_new;
    }
    *mx_out = mx;
    *inv_l_out = 1.0f / l;
}

/* Row blockIdx.x, head blockIdx.y of the call a. */
__device__ __forceinline__ void fitm_attention_row(const fitm_cuda_attn &a)
{
    __shared__ float q[FITM_ATT_MAX_D];
    __shared__ float tile[FITM_ATT_THREADS];
    __shared__ float red[32];
    __shared__ double redd[32];
    __shared__ float mmx[FITM_CUDA_ATTN_MAX_MIX], minv[FITM_CUDA_ATTN_MAX_MIX];
    FITM_DYNAMIC_SHARED(float, factor); /* (iv_n_spans) */
    const int tid = threadIdx.x, D = a.head_dim;
    fitm_att_row r;
    r.i = blockIdx.x;
    r.h = blockIdx.y;
    r.g = r.h / (a.n_head / a.n_head_kv);
    r.p = a.pos0 + r.i;
    r.v0 = a.window > 0 && r.p - a.window + 1 > 0 ? r.p - a.window + 1 : 0;
    const float *qg = a.q + (r.i * a.n_head + r.h) * D;
    for (int d = tid; d < D; d += FITM_ATT_THREADS)
        q[d] = qg[d];
    __syncthreads();

    /* pass 1: max and denominator, online over tiles (per weighed expert for a mixture) */
    fitm_att_soft sm = {q, 0.0f, 0.0f, a.mix_n, NULL, mmx, minv};
    if (a.mix_n == 0) {
        fitm_att_stats(a, r, q, -1, red, &sm.mx, &sm.inv_l);
    } else {
        sm.w = a.mix_w + (r.i * a.n_head + r.h) * a.mix_n;
        for (int e = 0; e < a.mix_n; e++) {
            float m = 0.0f, il = 0.0f;
            if (sm.w[e] != 0.0f)
                fitm_att_stats(a, r, q, e, red, &m, &il);
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
        S = fitm_att_sum_d(S, redd);
        Z = fitm_att_sum_d(Z, redd);
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
    float acc[FITM_ATT_MAX_D / FITM_ATT_THREADS] = {0.0f, 0.0f};
    if (cp)
        for (int64_t j = tid; j < a.cap_probs_stride; j += FITM_ATT_THREADS)
            if (j < r.v0 || j > r.p)
                cp[j] = 0.0f;
    for (int64_t j0 = r.v0; j0 <= r.p; j0 += FITM_ATT_THREADS) {
        const int64_t j = j0 + tid;
        if (j <= r.p) {
            const float pj = fitm_att_prob(a, r, sm, j, fac);
            tile[tid] = pj;
            if (cp)
                cp[j] = cap_fac || !fac ? pj : fitm_att_prob(a, r, sm, j, NULL);
        }
        __syncthreads();
        const int64_t n = r.p + 1 - j0 < FITM_ATT_THREADS ? r.p + 1 - j0 : FITM_ATT_THREADS;
        for (int64_t t = 0; t < n; t++) {
            const float *v = fitm_att_kv(a, a.v_pre, a.v_own, j0 + t, r.g);
            for (int c = 0, d = tid; d < D; c++, d += FITM_ATT_THREADS)
                acc[c] = fmaf(tile[t], v[d], acc[c]);
        }
        __syncthreads();
    }
    float *o = a.out + (r.i * a.n_head + r.h) * D;
    for (int c = 0, d = tid; d < D; c++, d += FITM_ATT_THREADS)
        o[d] = acc[c];
}

__global__ void __launch_bounds__(FITM_ATT_THREADS) fitm_attention_rows(fitm_cuda_attn a)
{
    fitm_attention_row(a);
}

/* Call blockIdx.z of args (device memory); rows past that call's T have nothing to do. */
__global__ void __launch_bounds__(FITM_ATT_THREADS)
    fitm_attention_rows_many(const fitm_cuda_attn *__restrict__ args)
{
    const fitm_cuda_attn &a = args[blockIdx.z]; /* read where used: a copy would spill */
    if ((int64_t)blockIdx.x >= a.T)
        return; /* uniform per block, before any barrier */
    fitm_attention_row(a);
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
                             a->n_head % a->mix_k_heads != 0));
}

extern "C" int fitm_cuda_attention(const fitm_cuda_attn *a, void *stream)
{
    if (fitm_attn_args_bad(a))
        return (int)cudaErrorInvalidValue;
    if (a->T == 0)
        return 0;
    const size_t shm = (size_t)a->iv_n_spans * sizeof(float);
    FITM_LAUNCH(dim3((unsigned)a->T, (unsigned)a->n_head), FITM_ATT_THREADS, shm,
                fitm_stream(stream), fitm_attention_rows)
    (*a);
    return (int)cudaGetLastError();
}

extern "C" int fitm_cuda_attention_many(const fitm_cuda_attn *a, const fitm_cuda_attn *a_dev,
                                        int n, void *stream)
{
    if (n < 1 || n > 65535 || !a_dev)
        return (int)cudaErrorInvalidValue;
    int64_t max_T = 0;
    int32_t max_spans = 0;
    for (int s = 0; s < n; s++) {
        if (fitm_attn_args_bad(&a[s]) || a[s].n_head != a[0].n_head)
            return (int)cudaErrorInvalidValue;
        max_T = a[s].T > max_T ? a[s].T : max_T;
        max_spans = a[s].iv_n_spans > max_spans ? a[s].iv_n_spans : max_spans;
    }
    if (max_T == 0)
        return 0;
    const size_t shm = (size_t)max_spans * sizeof(float);
    FITM_LAUNCH(dim3((unsigned)max_T, (unsigned)a[0].n_head, (unsigned)n), FITM_ATT_THREADS, shm,
                fitm_stream(stream), fitm_attention_rows_many)
    (a_dev);
    return (int)cudaGetLastError();
}
