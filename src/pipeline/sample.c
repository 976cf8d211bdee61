/* sample: one draw from a step's candidates (see sample.h). */
#include "pipeline/sample.h"

#include <math.h>

#include "base/rng.h"

/* Everything here is computed from the candidates alone, in their order, so every backend
 * that selects the same list (on a GPU, on the device: k (logit, id) pairs leave it per step,
 * not the whole row) draws the same token from the same seed. Tokens outside the 64 most
 * likely are never drawn: a top-k of 64 at most, as llama.cpp's default top-k of 40. */
int32_t fitm_sample_draw(const fitm_top *c, int32_t k, const fitm_sampling *s, uint64_t *rng)
{
    const double t = s->temperature;
    if (t <= 0)
        return c[0].id;
    const int32_t m = s->top_k > 0 && s->top_k < k ? s->top_k : k;
    /* Unnormalised probabilities, in candidate order, in double from the logits on: a float
     * weight would move a boundary between two candidates by up to 1e-7 of the mass, and the
     * draws that fall in between would differ from the definition's. */
    double p[FITM_TOP_MAX] = {0};
    double total = 0;
    for (int32_t i = 0; i < m; i++) {
        p[i] = exp(((double)c[i].logit - c[0].logit) / t);
        total += p[i];
    }
    const double u = (double)(fitm_rng_next(rng) >> 11) * 0x1.0p-53;
    int32_t n = m;
    if (s->top_p < 1.0) {
        double mass = 0;
        n = 0;
        while (n < m && mass < s->top_p * total)
            mass += p[n++];
    }
    /* weights decrease along the candidates, so those of at least min_p are a prefix; the
     * first is always kept (also when top_p kept none) */
    int32_t n_min = 1;
    while (n_min < n && p[n_min] >= s->min_p)
        n_min++;
    n = n_min;
    double keep = 0;
    for (int32_t i = 0; i < n; i++)
        keep += p[i];
    double acc = 0, target = u * keep;
    for (int32_t i = 0; i < n; i++) {
        acc += p[i];
        if (acc > target)
            return c[i].id;
    }
    return c[n - 1].id;
}
