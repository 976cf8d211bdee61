/* Unit test for pipeline/sample.c: the cases of its contract whose answer is exact by the
 * definition alone (sample.h), with u computed here from the published splitmix64 outputs:
 *   - the PRNG is splitmix64 (its published first outputs from seed 0);
 *   - greedy (temperature <= 0) is the first candidate and leaves the PRNG alone; any other
 *     call advances it by exactly one step, whatever top_p keeps;
 *   - equal logits: every weight is 1, so the kept prefix for top_p = m/64 is exactly m
 *     candidates (their mass reaches top_p), one more for top_p a hair above, and the draw is
 *     candidate floor(u * m), the lowest ids first as the candidate order has them;
 *   - temperature -> 0+ with a unique maximum is greedy; with two tied maxima it is uniform
 *     over them; a huge temperature is uniform over all 64 (every weight rounds to 1);
 *   - top_p tiny (or 0) keeps one candidate; a single candidate is always drawn;
 *   - top_k = m on equal logits draws candidate floor(u * m), and top_p's mass is of those m;
 *   - min_p keeps the candidates whose weight is at least min_p of the first's: on a row of m
 *     equal maxima and lower logits, a min_p between the lower weight and 1 keeps the m.
 * The draws against an independent reference on random rows, and the distribution's
 * chi-square test, are tests/test_sample.py's. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "base/rng.h"
#include "check.h"
#include "pipeline/sample.h"

#define GOLDEN 0x9e3779b97f4a7c15ull

/* The u the next draw from state uses, without advancing it. */
static double next_u(uint64_t state)
{
    return (double)(fitm_rng_next(&state) >> 11) * 0x1.0p-53;
}

/* n candidates of distinct logits, descending, with ids that are not their positions. */
static void distinct_row(fitm_top *c, int32_t n, uint64_t *rng)
{
    float v = 3.0f;
    for (int32_t i = 0; i < n; i++) {
        c[i] = (fitm_top){v, (int32_t)(1000 + 7 * i)};
        v -= 0.05f + (float)(fitm_rng_next(rng) >> 40) * 0x1.0p-24f; /* gaps in [0.05, 1.05) */
    }
}

/* n candidates of one logit: in fitm_ops_topk's order, ids ascending. */
static void equal_row(fitm_top *c, int32_t n, float logit)
{
    for (int32_t i = 0; i < n; i++)
        c[i] = (fitm_top){logit, (int32_t)(5 + 3 * i)};
}

/* fitm_sample_draw with top_k and min_p off. */
static int32_t draw(const fitm_top *c, int32_t k, double temperature, double top_p,
                    uint64_t *rng)
{
    const fitm_sampling how = {.temperature = temperature, .top_p = top_p};
    return fitm_sample_draw(c, k, &how, rng);
}

static void test_prng_is_splitmix64(void)
{
    static const uint64_t published[] = {0xe220a8397b1dcdafull, 0x6e789e6aa1b965f4ull,
                                         0x06c45d188009454full};
    uint64_t s = 0;
    for (int i = 0; i < 3; i++)
        CHECK(fitm_rng_next(&s) == published[i], " output %d", i);
}

static void test_greedy_and_steps(void)
{
    fitm_top c[FITM_TOP_MAX];
    uint64_t rng = 11;
    distinct_row(c, FITM_TOP_MAX, &rng);
    const double temps[] = {1e-300, 0.05, 0.7, 1.0, 2.5, 1e300};
    const double tops[] = {0.0, 1e-12, 0.3, 0.9, 1.0};
    for (uint64_t seed = 0; seed < 200; seed++) {
        uint64_t s = seed * GOLDEN;
        CHECK(draw(c, FITM_TOP_MAX, 0.0, 0.9, &s) == c[0].id && s == seed * GOLDEN);
        CHECK(draw(c, FITM_TOP_MAX, -1.0, 1.0, &s) == c[0].id && s == seed * GOLDEN);
        for (size_t t = 0; t < sizeof temps / sizeof *temps; t++)
            for (size_t p = 0; p < sizeof tops / sizeof *tops; p++) {
                s = seed;
                int32_t id = draw(c, FITM_TOP_MAX, temps[t], tops[p], &s);
                CHECK(s == seed + GOLDEN, " temperature %g top_p %g seed %llu", temps[t], tops[p],
                      (unsigned long long)seed);
                CHECK(id >= c[0].id && id <= c[FITM_TOP_MAX - 1].id && (id - 1000) % 7 == 0);
            }
    }
}

static void test_equal_logits(void)
{
    fitm_top c[FITM_TOP_MAX];
    equal_row(c, FITM_TOP_MAX, -1.75f);
    for (int32_t m = 1; m <= FITM_TOP_MAX; m++) {
        const double at = m / 64.0, above = at + 1e-9;
        for (uint64_t seed = 0; seed < 300; seed++) {
            const uint64_t st = fitm_rng_mix(seed ^ ((uint64_t)m << 32));
            const double u = next_u(st);
            uint64_t s = st;
            int32_t got = draw(c, FITM_TOP_MAX, 0.8, at, &s);
            CHECK(got == c[(int32_t)(u * m)].id, " top_p %d/64, u %.17g: drew %d", m, u, got);
            if (m < FITM_TOP_MAX) {
                s = st;
                got = draw(c, FITM_TOP_MAX, 0.8, above, &s);
                CHECK(got == c[(int32_t)(u * (m + 1))].id, " top_p %d/64 + 1e-9, u %.17g: drew %d",
                      m, u, got);
            }
        }
    }
    for (int32_t k = 1; k <= 3; k++) /* a vocabulary smaller than 64: k candidates */
        for (uint64_t seed = 0; seed < 300; seed++) {
            uint64_t s = seed;
            CHECK(draw(c, k, 1.3, 1.0, &s) == c[(int32_t)(next_u(seed) * k)].id);
        }
}

static void test_temperature_limits(void)
{
    fitm_top c[FITM_TOP_MAX];
    uint64_t rng = 5;
    distinct_row(c, FITM_TOP_MAX, &rng);
    for (uint64_t seed = 0; seed < 2000; seed++) {
        const double u = next_u(seed);
        uint64_t s = seed;
        CHECK(draw(c, FITM_TOP_MAX, 1e-3, 1.0, &s) == c[0].id); /* gaps >= 50 t */
        s = seed;
        CHECK(draw(c, FITM_TOP_MAX, DBL_TRUE_MIN, 1.0, &s) == c[0].id);
        s = seed; /* |logit - max| / t < 2^-60: every weight rounds to 1 */
        CHECK(draw(c, FITM_TOP_MAX, 1e300, 1.0, &s) == c[(int32_t)(u * 64)].id,
              " u %.17g", u);
    }
    fitm_top tied[FITM_TOP_MAX];
    distinct_row(tied, FITM_TOP_MAX, &rng);
    tied[0].logit = tied[1].logit = 4.0f; /* two maxima, ids ascending */
    for (uint64_t seed = 0; seed < 2000; seed++) {
        uint64_t s = seed;
        CHECK(draw(tied, FITM_TOP_MAX, 1e-3, 1.0, &s) ==
              tied[(int32_t)(next_u(seed) * 2)].id);
    }
}

static void test_top_p_keeps_one(void)
{
    fitm_top c[FITM_TOP_MAX];
    uint64_t rng = 9;
    distinct_row(c, FITM_TOP_MAX, &rng);
    for (uint64_t seed = 0; seed < 2000; seed++) {
        uint64_t s = seed;
        CHECK(draw(c, FITM_TOP_MAX, 50.0, 1e-12, &s) == c[0].id);
        s = seed;
        CHECK(draw(c, FITM_TOP_MAX, 50.0, 0.0, &s) == c[0].id);
        s = seed;
        CHECK(draw(c, 1, 50.0, 1.0, &s) == c[0].id && s == seed + GOLDEN);
    }
}

static void test_top_k_and_min_p(void)
{
    fitm_top c[FITM_TOP_MAX];
    equal_row(c, FITM_TOP_MAX, 0.5f);
    for (int32_t m = 1; m <= FITM_TOP_MAX; m++)
        for (uint64_t seed = 0; seed < 200; seed++) {
            const uint64_t st = fitm_rng_mix(seed ^ ((uint64_t)m << 40));
            const double u = next_u(st);
            uint64_t s = st;
            fitm_sampling how = {.temperature = 0.9, .top_p = 1.0, .top_k = m};
            int32_t got = fitm_sample_draw(c, FITM_TOP_MAX, &how, &s);
            CHECK(got == c[(int32_t)(u * m)].id && s == st + GOLDEN, " top_k %d, u %.17g: drew %d",
                  m, u, got);
            if (m % 2 == 0) { /* top_p 1/2 of the top_k's mass: m / 2 of them */
                s = st;
                how.top_p = 0.5;
                got = fitm_sample_draw(c, FITM_TOP_MAX, &how, &s);
                CHECK(got == c[(int32_t)(u * (m / 2))].id, " top_k %d top_p 0.5: drew %d", m, got);
            }
            /* the m first at 0.5, the rest at 0.5 - 0.7: weights 1 and exp(-1) at t = 0.7 */
            fitm_top low[FITM_TOP_MAX];
            equal_row(low, FITM_TOP_MAX, 0.5f);
            for (int32_t i = m; i < FITM_TOP_MAX; i++)
                low[i].logit = 0.5f - 0.7f;
            const double minps[] = {0.37, 0.99, 1.0};
            for (int j = 0; j < 3; j++) {
                how = (fitm_sampling){.temperature = 0.7, .top_p = 1.0, .min_p = minps[j]};
                s = st;
                got = fitm_sample_draw(low, FITM_TOP_MAX, &how, &s);
                CHECK(got == low[(int32_t)(u * m)].id, " min_p %g, %d maxima: drew %d", minps[j],
                      m, got);
            }
        }
}

int main(void)
{
    test_prng_is_splitmix64();
    test_greedy_and_steps();
    test_equal_logits();
    test_top_k_and_min_p();
    test_temperature_limits();
    test_top_p_keeps_one();
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures ? 1 : 0;
}
