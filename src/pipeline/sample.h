/* sample: the next token of an answer, drawn from one decoding step's candidates
 * (docs/design.md, "Decoding"). Pure: no allocation, no I/O, no model; the only state is the
 * caller's PRNG state (base/rng.h). Used by answer.c; the tests drive it directly against an
 * independent reference of the definition below (tests/test_sample.py). */
#ifndef FITM_SAMPLE_H
#define FITM_SAMPLE_H

#include <stdint.h>

#include "compute/ops.h"

/* A request's sampling options. */
typedef struct {
    double temperature; /* <= 0: greedy                                               */
    double top_p;       /* nucleus mass; >= 1: no cut                                 */
    double min_p;       /* keep weights >= min_p of the first candidate's; <= 0: no cut */
    int32_t top_k;      /* draw from the first top_k candidates; <= 0: from all k     */
} fitm_sampling;

/* Draws one token id from the k candidates c (1 <= k <= FITM_TOP_MAX): the k most likely
 * tokens of a logit row in fitm_ops_topk's order (logit descending, equal logits lower id
 * first; no NaN). Tokens outside the candidates are never drawn.
 *
 * temperature <= 0 (greedy): c[0].id, the row's first maximum; *rng is not advanced.
 * temperature > 0: the first m = min(top_k, k) candidates (m = k when top_k <= 0), with
 * weights w_i = exp((c[i].logit - c[0].logit) / temperature), i < m (softmax(logit /
 * temperature) over them, before normalising; w_0 = 1). The kept candidates are the shortest
 * of two prefixes of those m: the smallest prefix whose mass w_0 + ... + w_{n-1} reaches
 * top_p * (w_0 + ... + w_{m-1}) (all m when top_p >= 1; c[0] alone when top_p <= 0), and the
 * candidates whose weight is at least min_p (all m when min_p <= 0; c[0] always). One step of
 * the PRNG, u = (fitm_rng_next(rng) >> 11) * 2^-53 in [0, 1), picks the first kept c[i] whose
 * cumulative mass w_0 + ... + w_i exceeds u * (w_0 + ... + w_{n-1}). Every call with
 * temperature > 0 advances *rng by exactly one step, whatever the cuts keep. */
int32_t fitm_sample_draw(const fitm_top *c, int32_t k, const fitm_sampling *s, uint64_t *rng);

#endif
