/* Unit test for base/mem.c: buffers on both sides of FITM_MEM_MAP_MIN are aligned, zero and
 * writable end to end; a mapped buffer is resident only in the pages written (mincore), and
 * freeing it unmaps them (the reason the module exists: a KV cache sized for the whole
 * context used to be resident in full from its creation); bad alignments are refused; asking
 * for huge pages changes none of that for any size. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "base/mem.h"
#include "base/rng.h"
#include "check.h"

/* Resident pages of [p, p + n) (mincore on the pages the range touches); -1 when a page of
 * it is not mapped. */
static long resident_pages(const void *p, size_t n)
{
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = (uintptr_t)p / pg * pg, hi = ((uintptr_t)p + n + pg - 1) / pg * pg;
    const size_t pages = (hi - lo) / pg;
    unsigned char *vec = malloc(pages);
    long r = -1;
    if (vec && mincore((void *)lo, hi - lo, vec) == 0) {
        r = 0;
        for (size_t i = 0; i < pages; i++)
            r += vec[i] & 1;
    }
    free(vec);
    return r;
}

static void one(size_t n, size_t align, uint64_t *rng)
{
    unsigned char *p = fitm_mem_alloc_zeroed(n, align);
    CHECK(p != NULL, "%zu bytes", n);
    if (!p)
        return;
    CHECK((uintptr_t)p % align == 0, "%zu bytes at %p, align %zu", n, (void *)p, align);
    if (fitm_rng_next(rng) & 1) /* huge pages asked for (a no-op below the map threshold) */
        fitm_mem_hugepages(p);
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++)
        nonzero += p[i] != 0;
    CHECK(nonzero == 0, "%zu of %zu bytes not zero", nonzero, n);
    const unsigned char v = (unsigned char)(1 + fitm_rng_next(rng) % 255);
    memset(p, v, n);
    CHECK(n == 0 || (p[0] == v && p[n - 1] == v));
    fitm_mem_free(p);
}

int main(void)
{
    const char *env = getenv("FITM_TEST_SEED");
    uint64_t rng = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    printf("test_mem: seed %" PRIu64 " (FITM_TEST_SEED repeats it)\n", rng);
    rng = fitm_rng_mix(rng);
    const size_t sizes[] = {0, 1, 63, 64, 4095, 4096, 100000, FITM_MEM_MAP_MIN - 1,
                            FITM_MEM_MAP_MIN, FITM_MEM_MAP_MIN + 1, 3 * FITM_MEM_MAP_MIN + 17};
    const size_t aligns[] = {1, 16, 32, 64, 256, 4096};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        for (size_t j = 0; j < sizeof aligns / sizeof *aligns; j++)
            one(sizes[i], aligns[j], &rng);
    for (int k = 0; k < 50; k++) /* fresh random sizes, either side of the threshold */
        one((size_t)(fitm_rng_next(&rng) % (4 * FITM_MEM_MAP_MIN)), 64, &rng);

    CHECK(fitm_mem_alloc_zeroed(100, 48) == NULL, "an alignment that is not a power of two");
    CHECK(fitm_mem_alloc_zeroed(100, 8192) == NULL, "an alignment past a page");
    CHECK(fitm_mem_alloc_zeroed(SIZE_MAX - 10, 64) == NULL, "a size that cannot exist");
    fitm_mem_free(NULL);
    fitm_mem_hugepages(NULL);

    /* 256 MiB that are not written are not resident; writing 16 MiB of them makes exactly
     * those pages resident; freeing unmaps them. */
    const size_t big = (size_t)256 << 20, used = (size_t)16 << 20;
    unsigned char *p = fitm_mem_alloc_zeroed(big, 64);
    CHECK(p != NULL);
    if (p) {
        const long r1 = resident_pages(p, big);
        CHECK(r1 >= 0 && r1 <= 1, "untouched 256 MiB: %ld pages resident", r1);
        memset(p + big / 2, 7, used);
        const long r2 = resident_pages(p, big);
        const uintptr_t w0 = (uintptr_t)(p + big / 2), w1 = w0 + used;
        const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        const long spanned = (long)((w1 + pg - 1) / pg - w0 / pg);
        CHECK(r2 - r1 == spanned, "16 MiB written over %ld pages: %ld more resident", spanned,
              r2 - r1);
        fitm_mem_free(p);
        CHECK(resident_pages(p, big) == -1, "the freed buffer is still mapped");
    }
    printf("test_mem: %s (%d checks)\n", failures ? "FAILED" : "ok", n_checks);
    return failures ? 1 : 0;
}
