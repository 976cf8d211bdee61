/* ops: CPU reference implementations of the element-wise and row-wise ops of the forward pass.
 * These are the readable references the CUDA kernels are checked against, and the CPU
 * backend's own ops. All are single-threaded over the rows given; callers split rows.
 *
 * Legend: T tokens, C model dim, H query heads, Hkv KV heads, D head dim, F FFN dim. */
#ifndef FITM_OPS_H
#define FITM_OPS_H

#include <stdint.h>

/* y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * (w[:] + w_offset)   x, y: (T, C); y may == x.
 * w_offset is 0 for Llama/Qwen2; Gemma stores (scale - 1) and its GGUF converter already adds
 * the 1, so pass 0 there too unless a file says otherwise. */
void fitm_ops_rmsnorm(float *y, const float *x, const float *w, float w_offset, int64_t T,
                      int64_t C, float eps);

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
 * x (n): the maximum m in float, z = sum_v exp((double)x[v] - (double)m) in index order in
 * double, then lp[j] = (double)x[pick[j]] - (double)m - log(z). The one definition of a
 * scored row's log-probabilities (/rerank's query likelihood and relevance): the CPU backend
 * and the forward driver's host path compute exactly this; a device may sum z in another
 * order (backend.h, logprob). n >= 1. */
void fitm_ops_logprob(const float *x, int64_t n, const int32_t *pick, int32_t n_pick, double *lp);

/* fitm_ops_topk in parts: adds x[i0, i1) to the list top of *have entries (0 to start with)
 * built from x[0, i0), updating *have (at most k). Once *have == k and top[k - 1].logit is a
 * number, x[i] enters only if it is greater than that (an equal value, or a NaN, comes after
 * the list's last), so a caller may skip a part whose values are all not greater, as if it had
 * been added; while the list's last is a NaN every number enters. */
void fitm_ops_topk_add(const float *x, int64_t i0, int64_t i1, int32_t k, fitm_top *top,
                       int32_t *have);

#endif
