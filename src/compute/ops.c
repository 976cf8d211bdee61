#include "compute/ops.h"

#include <math.h>
#include <stdbool.h>

/* The sum of squares in double (a float's square is exact there), so the result does not
 * depend on the summation order beyond the double sum's last bits; in FITM_NORM_LANES
 * accumulators, element c into lane c % FITM_NORM_LANES, then the lanes in order and the tail:
 * one chain of adds was latency-bound, and a decode step's norms (six per layer on Gemma 3,
 * too small to share out, so they run on the engine thread while the pool's threads wait)
 * took about 3% of its time. On 262M random values the lanes changed no output against the
 * single chain. */
float fitm_ops_rmsnorm_scale(const double lanes[FITM_NORM_LANES], const float *x, int64_t C,
                             float eps)
{
    double ss = 0.0;
    for (int i = 0; i < FITM_NORM_LANES; i++)
        ss += lanes[i];
    for (int64_t c = C - C % FITM_NORM_LANES; c < C; c++)
        ss += (double)x[c] * x[c];
    return (float)(1.0 / sqrt(ss / (double)C + eps));
}

void fitm_ops_rmsnorm(float *y, const float *x, const float *w, float w_offset, int64_t T,
                      int64_t C, float eps)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * C;
        float *yr = y + t * C;
        double acc[FITM_NORM_LANES] = {0.0};
        for (int64_t c = 0; c + FITM_NORM_LANES <= C; c += FITM_NORM_LANES)
            for (int i = 0; i < FITM_NORM_LANES; i++)
                acc[i] += (double)xr[c + i] * xr[c + i];
        const float scale = fitm_ops_rmsnorm_scale(acc, xr, C, eps);
        for (int64_t c = 0; c < C; c++)
            yr[c] = xr[c] * scale * (w[c] + w_offset);
    }
}

void fitm_ops_softmax(float *x, int64_t n)
{
    if (n <= 0)
        return;
    float mx = x[0];
    for (int64_t i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++)
        x[i] *= inv;
}

void fitm_ops_rope(float *v, int64_t D, int64_t n_rot, int64_t pos, float base, int neox)
{
    (void)D;
    int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        double theta = (double)pos * pow((double)base, -2.0 * (double)i / (double)n_rot);
        float c = (float)cos(theta), s = (float)sin(theta);
        int64_t a = neox ? i : 2 * i;
        int64_t b = neox ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

void fitm_ops_swiglu(float *y, const float *g, const float *u, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void fitm_ops_geglu(float *y, const float *g, const float *u, int64_t n)
{
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    for (int64_t i = 0; i < n; i++) {
        float x = g[i];
        y[i] = 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x))) * u[i];
    }
}

/* base^(-2i/n_rot), the rotation's frequency of pair i. */
static double rope_freq(float base, int64_t i, int64_t n_rot)
{
    return pow((double)base, -2.0 * (double)i / (double)n_rot);
}

/* Pair i of a table row: theta = pos * freq_scale * w, w pair i's frequency. */
static void rope_pair(float *cs, int64_t pos, float freq_scale, double w)
{
    double theta = (double)pos * (double)freq_scale * w;
    cs[0] = (float)cos(theta);
    cs[1] = (float)sin(theta);
}

void fitm_ops_rope_table(float *cs, int64_t n_rot, int64_t pos, float base, float freq_scale)
{
    int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++)
        rope_pair(cs + 2 * i, pos, freq_scale, rope_freq(base, i, n_rot));
}

void fitm_ops_rope_freqs(double *w, int64_t n_rot, float base)
{
    for (int64_t i = 0; i < n_rot / 2; i++)
        w[i] = rope_freq(base, i, n_rot);
}

void fitm_ops_rope_table_at(float *cs, int64_t n_rot, int64_t pos, float freq_scale,
                            const double *w)
{
    for (int64_t i = 0; i < n_rot / 2; i++)
        rope_pair(cs + 2 * i, pos, freq_scale, w[i]);
}

void fitm_ops_rope_apply(float *v, const float *cs, int64_t n_rot, int neox)
{
    int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[2 * i], s = cs[2 * i + 1];
        int64_t a = neox ? i : 2 * i;
        int64_t b = neox ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

/* The part of span sp inside [key0, key0 + n_keys), as offsets into the row; empty when lo >= hi. */
static void clip_span(const fitm_span *sp, int64_t key0, int64_t n_keys, int64_t *lo, int64_t *hi)
{
    int64_t a = sp->start > key0 ? sp->start : key0;
    int64_t b = sp->end < key0 + n_keys ? sp->end : key0 + n_keys;
    *lo = a - key0;
    *hi = b - key0;
}

void fitm_ops_span_mass(float *mass, const float *p, int64_t key0, int64_t n_keys,
                        const fitm_span *spans, int32_t n_spans)
{
    for (int32_t k = 0; k < n_spans; k++) {
        int64_t lo, hi;
        clip_span(&spans[k], key0, n_keys, &lo, &hi);
        double m = 0.0;
        for (int64_t i = lo; i < hi; i++)
            m += p[i];
        mass[k] = (float)m;
    }
}

void fitm_ops_intervene(float *p, int64_t key0, int64_t n_keys, const fitm_span *spans,
                        const float *alpha, int32_t n_spans, double *mass)
{
    double S = 0.0, Z = 0.0;
    for (int32_t k = 0; k < n_spans; k++) {
        int64_t lo, hi;
        clip_span(&spans[k], key0, n_keys, &lo, &hi);
        double m = 0.0;
        for (int64_t i = lo; i < hi; i++)
            m += p[i];
        mass[k] = m;
        if (m > FITM_OPS_INTERVENE_MIN_MASS) {
            S += m;
            Z += (double)(spans[k].end - spans[k].start) * (double)alpha[k];
        }
    }
    if (!(Z > 0.0))
        return; /* nothing visible, or every visible document has weight 0: leave the row */
    double C = S / Z;
    for (int32_t k = 0; k < n_spans; k++) {
        if (!(mass[k] > FITM_OPS_INTERVENE_MIN_MASS))
            continue;
        int64_t lo, hi;
        clip_span(&spans[k], key0, n_keys, &lo, &hi);
        float f = (float)((double)alpha[k] * (double)(spans[k].end - spans[k].start) * C / mass[k]);
        for (int64_t i = lo; i < hi; i++)
            p[i] *= f;
    }
}

/* Whether (v, i) comes before t in fitm_ops_topk's order: a NaN comes after every number
 * (so that the order stays total on any row; comparisons with NaN alone would make the list
 * depend on where the NaN stands), NaNs among themselves by index. */
static bool top_before(float v, int32_t i, const fitm_top *t)
{
    if (t->logit != t->logit)
        return v == v || i < t->id;
    return v > t->logit || (v == t->logit && i < t->id);
}

void fitm_ops_logprob(const float *x, int64_t n, const int32_t *pick, int32_t n_pick, double *lp)
{
    float mx = x[0];
    for (int64_t v = 1; v < n; v++)
        mx = x[v] > mx ? x[v] : mx;
    double l[FITM_LOGPROB_LANES] = {0};
    for (int64_t v = 0; v < n; v++)
        l[v % FITM_LOGPROB_LANES] += fitm_ops_exp_le0((double)x[v] - (double)mx);
    fitm_ops_logprob_lanes(l, mx, x, pick, n_pick, lp);
}

void fitm_ops_logprob_lanes(const double *l, float mx, const float *x, const int32_t *pick,
                            int32_t n_pick, double *lp)
{
    const double z = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    const double lz = log(z);
    for (int32_t j = 0; j < n_pick; j++)
        lp[j] = (double)x[pick[j]] - (double)mx - lz;
}

void fitm_ops_topk(const float *x, int64_t n, int32_t k, fitm_top *top)
{
    int32_t have = 0;
    fitm_ops_topk_add(x, 0, n, k, top, &have);
}

void fitm_ops_topk_add(const float *x, int64_t i0, int64_t i1, int32_t k, fitm_top *top,
                       int32_t *have_io)
{
    /* Insertion into a sorted list of k: each entry is compared with the list's last first,
     * so a row costs about n comparisons once the list is full (k is at most 64). */
    int32_t have = *have_io;
    for (int64_t i = i0; i < i1; i++) {
        const float v = x[i];
        if (have == k && !top_before(v, (int32_t)i, &top[k - 1]))
            continue;
        int32_t j = have < k ? have++ : k - 1;
        for (; j > 0 && top_before(v, (int32_t)i, &top[j - 1]); j--)
            top[j] = top[j - 1];
        top[j] = (fitm_top){v, (int32_t)i};
    }
    *have_io = have;
}
