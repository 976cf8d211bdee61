/* ops: CPU reference implementations of the element-wise and row-wise ops of the forward pass.
 * These are the readable references the CUDA kernels are checked against, and the CPU
 * backend's own ops. All are single-threaded over the rows given; callers split rows.
 *
 * Legend: T tokens, C model dim, H query heads, Hkv KV heads, D head dim, F FFN dim. */
#ifndef FITM_OPS_H
#define FITM_OPS_H

#include <stdint.h>
#include <string.h>

/* y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * (w[:] + w_offset)   x, y: (T, C); y may == x.
 * w_offset is 0 for Llama/Qwen2; Gemma stores (scale - 1) and its GGUF converter already adds
 * the 1, so pass 0 there too unless a file says otherwise. */
void fitm_ops_rmsnorm(float *y, const float *x, const float *w, float w_offset, int64_t T,
                      int64_t C, float eps);

/* The sum of squares above: in double, element c of the first C - C % FITM_NORM_LANES into lane
 * c % FITM_NORM_LANES, in order. fitm_ops_rmsnorm_scale takes those lane sums and the row x
 * (C values), adds the lanes in order and then the tail, and gives the row's scale, so a
 * vector path that fills the lanes alike computes fitm_ops_rmsnorm's bits. */
#define FITM_NORM_LANES 16
float fitm_ops_rmsnorm_scale(const double lanes[FITM_NORM_LANES], const float *x, int64_t C,
                             float eps);

/* In-place numerically stable softmax over n values. */
void fitm_ops_softmax(float *x, int64_t n);

/* RoPE on one head vector v (D values) at position pos, rotating the first n_rot dims.
 * neox = 0: adjacent pairs (0,1),(2,3)... (llama "normal"); neox = 1: halves (i, i+n_rot/2)
 * (qwen2, gemma3). theta_i = pos * base^(-2i/n_rot). */
void fitm_ops_rope(float *v, int64_t D, int64_t n_rot, int64_t pos, float base, int neox);

/* y = silu(g) * u, elementwise over n.      (SwiGLU: Llama, Qwen2) */
void fitm_ops_swiglu(float *y, const float *g, const float *u, int64_t n);

/* y = gelu_tanh(g) * u, elementwise over n. (GeGLU: Gemma) */
void fitm_ops_geglu(float *y, const float *g, const float *u, int64_t n);

/* RoPE through a table, so a forward pass computes the angles once per position instead of
 * once per head. fitm_ops_rope_table fills cs (n_rot/2 pairs {cos, sin}) for one position with
 * theta_i = pos * freq_scale * base^(-2i/n_rot), evaluated exactly as fitm_ops_rope does;
 * fitm_ops_rope_apply rotates one head vector v with it. With freq_scale 1 the pair computes
 * what fitm_ops_rope does (to float rounding: the compiler may fuse the multiply-adds). */
void fitm_ops_rope_table(float *cs, int64_t n_rot, int64_t pos, float base, float freq_scale);
void fitm_ops_rope_apply(float *v, const float *cs, int64_t n_rot, int neox);
/* The same rows for many positions of one base: fitm_ops_rope_freqs fills w (n_rot/2) with the
 * frequencies base^(-2i/n_rot) once (the pow that is most of a row's cost), and
 * fitm_ops_rope_table_at fills cs from them, bit for bit fitm_ops_rope_table's row. */
void fitm_ops_rope_freqs(double *w, int64_t n_rot, float base);
void fitm_ops_rope_table_at(float *cs, int64_t n_rot, int64_t pos, float freq_scale,
                            const double *w);

/* A half-open range [start, end) of key positions (a document's tokens). */
typedef struct {
    int64_t start, end;
} fitm_span;

/* Sum of p over the keys of each span: mass[k] = sum p[i - key0] for i in span k and in
 * [key0, key0 + n_keys). p holds one attention row over keys [key0, key0 + n_keys). */
void fitm_ops_span_mass(float *mass, const float *p, int64_t key0, int64_t n_keys,
                        const fitm_span *spans, int32_t n_spans);

/* Spans whose mass is at most this are left alone by the intervention (a document the row
 * cannot see, e.g. outside a sliding window: there is no attention to redistribute). */
#define FITM_OPS_INTERVENE_MIN_MASS 1e-30

/* The calibration intervention on one post-softmax row p over keys [key0, key0 + n_keys)
 * (docs/design.md, Method): with m_k the mass of span k, S = sum m_k and N_k its length,
 * every key of span k is scaled by alpha_k * N_k * C / m_k with C = S / sum_k N_k * alpha_k,
 * so the documents keep their total mass S and each document's per-token attention becomes
 * proportional to alpha_k. Keys outside the spans are untouched. Spans with
 * m_k <= FITM_OPS_INTERVENE_MIN_MASS take no part (they are neither scaled nor counted in S or
 * in the sum of N_k * alpha_k).
 * Spans must be disjoint; alpha_k >= 0. mass is scratch of n_spans floats. */
void fitm_ops_intervene(float *p, int64_t key0, int64_t n_keys, const fitm_span *spans,
                        const float *alpha, int32_t n_spans, double *mass);

/* One entry of a row's top list: a value (a logit) and its index in the row (a token id). */
typedef struct {
    float logit;
    int32_t id;
} fitm_top;

/* Most entries a top list holds: what the sampler keeps (src/pipeline/sample.c) and what the
 * device kernel selects in one pass (kernels/topk.cu). */
#define FITM_TOP_MAX 64

/* top (k) = the k first entries of x (n) in the order "larger value first, equal values lower
 * index first, NaN after every number (NaNs by index)". That order is total, so the list is
 * unique and every backend that selects it returns the same one; top[0] is the first maximum
 * (greedy decoding's token). 1 <= k <= min(n, FITM_TOP_MAX), n < 2^31. */
void fitm_ops_topk(const float *x, int64_t n, int32_t k, fitm_top *top);

/* Most ids fitm_ops_logprob's callers pick per row (the forward driver's opts.n_pick). */
#define FITM_PICK_MAX 16

/* lp (n_pick) = log softmax(x)[pick[j]] for the ids pick (n_pick, each in [0, n)) of one row
 * x (n): the maximum m in float, z = sum_v fitm_ops_exp_le0((double)x[v] - (double)m) in
 * double, summed in FITM_LOGPROB_LANES lanes (value v into lane v % 8, each lane in index
 * order) whose sums are then added in a fixed tree, (l0 + l4) + (l2 + l6) + ((l1 + l5) +
 * (l3 + l7)); then lp[j] = (double)x[pick[j]] - (double)m - log(z). z is NaN when a value
 * is NaN, m is +inf or every value is -inf. The one definition of a scored row's
 * log-probabilities (/rerank's query likelihood and relevance): the CPU backend (with vectors
 * of the 8 lanes) and the forward driver's host path compute exactly this; a device may sum z
 * in another order and with its own exp (backend.h, logprob). n >= 1. */
void fitm_ops_logprob(const float *x, int64_t n, const int32_t *pick, int32_t n_pick, double *lp);

#define FITM_LOGPROB_LANES 8

/* fitm_ops_logprob from its lane sums l (FITM_LOGPROB_LANES) and the row's maximum mx: z by the
 * fixed tree, then lp (n_pick) at the ids pick of x. For a caller that sums the lanes its own
 * way (the CPU backend's vectors). */
void fitm_ops_logprob_lanes(const double *l, float mx, const float *x, const int32_t *pick,
                            int32_t n_pick, double *lp);

/* fitm_ops_exp_le0's constants: below EXP_MIN the result is 0 (e^-708 is about 2^-1021, the
 * smallest power 2^k it builds as a normal number); ln 2 as LN2_HI (32 significant bits, so
 * k LN2_HI is exact for |k| < 2^21) + LN2_LO; SHIFT rounds a double in (-2^51, 2^51) to an
 * integer when added and subtracted again. */
#define FITM_EXP_MIN (-708.0)
#define FITM_EXP_INV_LN2 0x1.71547652b82fep+0
#define FITM_EXP_LN2_HI 0x1.62e42fee00000p-1
#define FITM_EXP_LN2_LO 0x1.a39ef35793c76p-33
#define FITM_EXP_SHIFT 0x1.8p52
/* e^f for |f| <= ln2 / 2 + 2^-30 by its Taylor polynomial of degree 13 (truncation below
 * 0.04 ulp), by Horner from the highest coefficient: 1/k! as the nearest doubles. */
#define FITM_EXP_POLY(f)                                                                          \
    (1.0 + (f) * (1.0 + (f) * (1.0 / 2 + (f) * (1.0 / 6 + (f) * (1.0 / 24 + (f) * (1.0 / 120 + \
     (f) * (1.0 / 720 + (f) * (1.0 / 5040 + (f) * (1.0 / 40320 + (f) * (1.0 / 362880 +        \
     (f) * (1.0 / 3628800 + (f) * (1.0 / 39916800 + (f) * (1.0 / 479001600 +                  \
     (f) * (1.0 / 6227020800.0))))))))))))))

/* e^d for d <= 0 in plain double multiplies and adds (no fused ones, no libm), so every
 * build and SIMD path computes the same bits: d = k ln2 + f with k = round(d / ln2), e^f by
 * FITM_EXP_POLY, times 2^k (exact). Within 1.5 ulp of e^d (tests/test_model_unit.c draws
 * millions of d against expl: about 1.1 at worst, the rounding of f and of the unfused
 * Horner steps); 0 for d < FITM_EXP_MIN or d = -inf, NaN for NaN. The CPU backend's vector
 * copy (backend_cpu.c, logprob) performs the same operations lane by lane. */
static inline double fitm_ops_exp_le0(double d)
{
    if (!(d >= FITM_EXP_MIN))
        return d != d ? d : 0.0;
    const double t = d * FITM_EXP_INV_LN2 + FITM_EXP_SHIFT;
    const double k = t - FITM_EXP_SHIFT;
    const double f = (d - k * FITM_EXP_LN2_HI) - k * FITM_EXP_LN2_LO;
    int64_t tb, sb;
    memcpy(&tb, &t, sizeof tb);
    const double shift = FITM_EXP_SHIFT;
    memcpy(&sb, &shift, sizeof sb);
    const uint64_t pb = (uint64_t)(tb - sb + 1023) << 52; /* 2^k */
    double p2;
    memcpy(&p2, &pb, sizeof p2);
    return FITM_EXP_POLY(f) * p2;
}

/* fitm_ops_topk in parts: adds x[i0, i1) to the list top of *have entries (0 to start with)
 * built from x[0, i0), updating *have (at most k). Once *have == k and top[k - 1].logit is a
 * number, x[i] enters only if it is greater than that (an equal value, or a NaN, comes after
 * the list's last), so a caller may skip a part whose values are all not greater, as if it had
 * been added; while the list's last is a NaN every number enters. */
void fitm_ops_topk_add(const float *x, int64_t i0, int64_t i1, int32_t k, fitm_top *top,
                       int32_t *have);

#endif
