/* sample_tool: draws tokens from one logit row the way /answer's decode step does, so that
 * tests/test_sample.py can compare every draw with its independent reference
 * (tests/oracle/sample.py).
 *
 *   sample_tool seeds|stream SEED N TEMPERATURE TOP_P [TOP_K MIN_P] < ROW
 *
 * ROW: V >= 1 logits (float32, any strtof form: hex floats are exact), whitespace separated.
 * The candidates are selected as the forward pass selects them (fitm_ops_topk: the
 * min(FITM_TOP_MAX, V) most likely, 1 when greedy), then fitm_sample_draw draws:
 *   seeds   N requests, one draw each, the j-th seeded with SEED + j (mod 2^64);
 *   stream  one request seeded with SEED, N draws in a row from the same candidates.
 * Prints N token ids, one a line, then "state X": the PRNG state after the last draw (hex).
 * SEED is an unsigned 64-bit integer, TEMPERATURE, TOP_P and MIN_P any strtod form, TOP_K an
 * integer (0, the default, and MIN_P 0: no cut; fitm_sampling). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute/ops.h"
#include "pipeline/sample.h"

static int usage(void)
{
    fprintf(stderr, "usage: sample_tool seeds|stream SEED N TEMPERATURE TOP_P [TOP_K MIN_P] < ROW\n");
    return 2;
}

/* The row on stdin; NULL (with a message) when it is empty, unreadable or holds a NaN. */
static float *read_row(int64_t *n)
{
    size_t cap = 1024, len = 0;
    float *x = malloc(cap * sizeof *x);
    char word[128];
    while (x && scanf("%127s", word) == 1) {
        char *end;
        float v = strtof(word, &end);
        if (*end || end == word || v != v) {
            fprintf(stderr, "sample_tool: bad logit '%s'\n", word);
            free(x);
            return NULL;
        }
        if (len == cap) {
            float *y = realloc(x, (cap *= 2) * sizeof *x);
            if (!y)
                free(x);
            x = y;
        }
        if (x)
            x[len++] = v;
    }
    if (!x || len == 0 || len >= INT32_MAX) {
        fprintf(stderr, "sample_tool: %s\n",
                x ? "want 1 to 2^31 - 1 logits on stdin" : "out of memory");
        free(x);
        return NULL;
    }
    *n = (int64_t)len;
    return x;
}

int main(int argc, char **argv)
{
    if ((argc != 6 && argc != 8) || (strcmp(argv[1], "seeds") && strcmp(argv[1], "stream")))
        return usage();
    const int per_seed = !strcmp(argv[1], "seeds");
    char *e1, *e2, *e3, *e4, *e5 = "", *e6 = "";
    errno = 0;
    const uint64_t seed = strtoull(argv[2], &e1, 0);
    const long long n_draws = strtoll(argv[3], &e2, 10);
    const double temperature = strtod(argv[4], &e3), top_p = strtod(argv[5], &e4);
    const long top_k = argc == 8 ? strtol(argv[6], &e5, 10) : 0;
    const double min_p = argc == 8 ? strtod(argv[7], &e6) : 0.0;
    if (errno || *e1 || *e2 || *e3 || *e4 || *e5 || *e6 || n_draws < 0 || argv[2][0] == '-' ||
        top_k < 0 || top_k > FITM_TOP_MAX)
        return usage();
    const fitm_sampling how = {.temperature = temperature, .top_p = top_p, .min_p = min_p,
                               .top_k = (int32_t)top_k};

    int64_t V;
    float *row = read_row(&V);
    if (!row)
        return 1;
    const int32_t k = temperature > 0 ? (V < FITM_TOP_MAX ? (int32_t)V : FITM_TOP_MAX) : 1;
    fitm_top top[FITM_TOP_MAX];
    fitm_ops_topk(row, V, k, top);
    free(row);

    uint64_t state = seed;
    for (long long j = 0; j < n_draws; j++) {
        if (per_seed)
            state = seed + (uint64_t)j;
        printf("%" PRId32 "\n", fitm_sample_draw(top, k, &how, &state));
    }
    printf("state %" PRIx64 "\n", state);
    return fflush(stdout) ? 1 : 0;
}
