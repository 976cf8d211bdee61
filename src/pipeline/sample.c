/* sample: one draw from a step's candidates (see sample.h). */
#include "pipeline/sample.h"

#include <math.h>

#include "base/rng.h"

/* Everything here is computed from the candidates alone, in their order, so every backend
 * that selects the same list (on a GPU, on the device: k (logit, id) pairs leave it per step,
 * not the whole row) draws the same token from the same seed. Tokens outside the 64 most
 * likely are never drawn: a top-k of 64 before top_p, as llama.cpp's default top-k of 40. */
int32_t fitm_sample_draw(const fitm_top *c, int32_t k, double temperature, double top_p,
                         uint64_t *rng)
{
    const double t = temperature;
    if (t <= 0)
        return c[0].id;
    /* Unnormalised probabilities, in candidate order, in double from the logits on: a float
     * weight would move a boundary between two candidates by up to 1e-7 of the mass, and the
     * draws that fall in between would differ from the definition's. */
    double p[FITM_TOP_MAX] = {0};
    double total = 0;
    for (int32_t i = 0; i < k; i++) {
        p[i] = exp(((double)c[i].logit - c[0].logit) / t);
        total += p[i];
    }
    const double u = (double)(fitm_rng_next(rng) >> 11) * 0x1.0p-53;
    int32_t n = k;
    double keep = total;
    if (top_p < 1.0) {
        keep = 0;
        n = 0;
        while (n < k && keep < top_p * total)
            keep += p[n++];
    }
    double acc = 0, target = u * keep;
    for (int32_t i = 0; i < n; i++) {
        acc += p[i];
        if (acc > target)
            return c[i].id;
    }
    return c[n > 0 ? n - 1 : 0].id;
}
