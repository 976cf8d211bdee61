/* Unit test for base/sha256.c: the FIPS 180-4 example vectors (one block, two blocks, a
 * million 'a'), the empty message, and every way of splitting random messages over update
 * calls giving the one-shot digest (the block buffering is where an implementation breaks). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "base/sha256.h"
#include "check.h"

static void digest_hex(const void *p, size_t n, char hex[65])
{
    fitm_sha256 s;
    uint8_t d[32];
    fitm_sha256_init(&s);
    fitm_sha256_update(&s, p, n);
    fitm_sha256_final(&s, d);
    fitm_sha256_hex(d, hex);
}

int main(void)
{
    static const struct {
        const char *msg, *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    char hex[65];
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        digest_hex(v[i].msg, strlen(v[i].msg), hex);
        CHECK(!strcmp(hex, v[i].hex), " vector %zu: %s", i, hex);
    }
    size_t mn = 1000000;
    char *m = malloc(mn);
    memset(m, 'a', mn);
    digest_hex(m, mn, hex);
    CHECK(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), " %s",
          hex);

    /* random messages around the block and padding boundaries, fed in random pieces */
    uint64_t rng = 14;
    for (int trial = 0; trial < 300; trial++) {
        size_t n = trial < 200 ? (size_t)trial : (size_t)(fitm_rng_next(&rng) % 5000);
        for (size_t i = 0; i < n; i++)
            m[i] = (char)fitm_rng_next(&rng);
        char want[65];
        digest_hex(m, n, want);
        fitm_sha256 s;
        uint8_t d[32];
        fitm_sha256_init(&s);
        for (size_t at = 0; at < n;) {
            size_t take = (size_t)(fitm_rng_next(&rng) % 130);
            if (take > n - at)
                take = n - at;
            fitm_sha256_update(&s, m + at, take);
            at += take;
        }
        fitm_sha256_final(&s, d);
        fitm_sha256_hex(d, hex);
        CHECK(!strcmp(hex, want), " n=%zu split differs", n);
    }
    free(m);
    if (failures)
        return 1;
    printf("test_sha256: ok (%d checks)\n", n_checks);
    return 0;
}
