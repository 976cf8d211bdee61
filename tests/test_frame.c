/* Unit test for frame.c, the gate's check of a request head: fixed cases for every verdict,
 * then random heads built from the grammar the check accepts. A valid head must be OK whatever
 * follows it, and each of its proper prefixes INCOMPLETE (the gate peeks a head as it arrives,
 * so a prefix judged BAD would refuse a good client); the same head with one defect of a known
 * kind planted must be BAD with that defect's status, and none of its prefixes OK. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "check.h"
#include "server/frame.h"

static fitm_frame_verdict check(const char *s, size_t n, int *status)
{
    fitm_frame_error e;
    fitm_frame_verdict v = fitm_frame_check_head(s, n, &e);
    *status = v == FITM_FRAME_BAD ? e.status : 0;
    if (v == FITM_FRAME_BAD && (!e.msg[0] || strlen(e.msg) >= sizeof e.msg))
        failures++;
    return v;
}

static void expect(const char *s, fitm_frame_verdict want, int want_status)
{
    int st;
    fitm_frame_verdict v = check(s, strlen(s), &st);
    CHECK(v == want && st == want_status, "%.60s: got %d/%d, want %d/%d", s, v, st, want,
          want_status);
}

static void test_fixed(void)
{
    const fitm_frame_verdict OK = FITM_FRAME_OK, INC = FITM_FRAME_INCOMPLETE, BAD = FITM_FRAME_BAD;
    expect("GET / HTTP/1.1\r\nHost: x\r\n\r\n", OK, 0);
    expect("GET / HTTP/1.0\n\n", OK, 0);
    expect("\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\nbody", OK, 0);
    expect("POST /rerank HTTP/1.1\r\nContent-Length:  42 \r\n\r\n", OK, 0);
    expect("POST /rerank HTTP/1.1\r\nContent-Length: 00000000000000000000000042\r\n\r\n", OK, 0);
    expect("", INC, 0);
    expect("GE", INC, 0);
    expect("GET /a", INC, 0);
    expect("GET / HTTP/1.1\r\nHost: x\r\n", INC, 0);
    /* Request line. */
    expect("\x16\x03\x01\x02", BAD, 400);        /* a TLS hello: refused at its first byte */
    static char blob[3 * FITM_FRAME_MAX_TARGET]; /* no line end, not a request line: 400 */
    memset(blob, 0xff, sizeof blob - 1);
    expect(blob, BAD, 400);
    memset(blob, 'a', sizeof blob - 1); /* a token too long for any method: 414 */
    expect(blob, BAD, 414);
    expect("GET  / HTTP/1.1\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1 \r\n\r\n", BAD, 400);
    expect("GET /\r\n\r\n", BAD, 400);
    expect("GET / http/1.1\r\n\r\n", BAD, 400);
    expect("G(T / HTTP/1.1\r\n\r\n", BAD, 400);
    expect("GET /a\tb HTTP/1.1\r\n\r\n", BAD, 400);
    expect("GET / HTTP/2.0\r\n\r\n", BAD, 505);
    expect("GET / HTTP/1.2\r\n\r\n", BAD, 505);
    expect("GET / HTTP/0.9\r\n\r\n", BAD, 505);
    /* Header fields. */
    expect("GET / HTTP/1.1\r\nHost x\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length : 5\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\n: v\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nA: b\x01\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nA: b\rc\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length:\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\ncontent-length: 0x10\r\n\r\n", BAD, 400);
    expect("GET / HTTP/1.1\r\nContent-Length: 18446744073709551617\r\n\r\n", BAD, 413);
    expect("GET / HTTP/1.1\r\nContent-Length: 999999999999999999\r\n\r\n", OK, 0);
}

/* Appends a random run of n bytes drawn from set. */
static size_t put_from(char *p, uint64_t *rng, const char *set, size_t n)
{
    size_t k = strlen(set);
    for (size_t i = 0; i < n; i++)
        p[i] = set[fitm_rng_next(rng) % k];
    return n;
}

#define TCHARS "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"
#define VCHARS TCHARS "\"(),/:;<=>?@[\\]{}"

enum {
    DEFECT_NONE,
    DEFECT_VERSION,
    DEFECT_SPACES,
    DEFECT_NO_COLON,
    DEFECT_CTL,
    DEFECT_CL,
    DEFECT_FOLD,
    DEFECT_TARGET,
    DEFECT_HEAD,
    N_DEFECTS
};
static const int defect_status[N_DEFECTS] = {0, 505, 400, 400, 400, 400, 400, 414, 431};

/* A random head into buf with one defect planted (DEFECT_NONE: a valid head); its length. */
static size_t random_head(char *buf, uint64_t *rng, int defect)
{
    const char *eol = fitm_rng_next(rng) % 4 ? "\r\n" : "\n";
    char *p = buf;
    p += put_from(p, rng, TCHARS, 1 + fitm_rng_next(rng) % 8);
    *p++ = ' ';
    if (defect == DEFECT_SPACES)
        *p++ = ' ';
    *p++ = '/';
    size_t tn = defect == DEFECT_TARGET ? FITM_FRAME_MAX_TARGET + 1 : fitm_rng_next(rng) % 60;
    p += put_from(p, rng, VCHARS, tn);
    p += sprintf(p, " HTTP/%s%s",
                 defect == DEFECT_VERSION ? "2.0"
                 : fitm_rng_next(rng) % 2 ? "1.1"
                                          : "1.0",
                 eol);
    int fields = (int)(fitm_rng_next(rng) % 8), bad_at = (int)(fitm_rng_next(rng) % 8);
    if (defect == DEFECT_HEAD)
        fields = FITM_FRAME_MAX_HEAD; /* as many as it takes to pass the limit */
    for (int f = 0; f < fields; f++) {
        if (defect == DEFECT_HEAD && p - buf > FITM_FRAME_MAX_HEAD)
            break;
        if (f == bad_at % fields && defect == DEFECT_CL) {
            p += sprintf(p, "Content-Length: %d%c%s", (int)(fitm_rng_next(rng) % 1000),
                         "-+ax"[fitm_rng_next(rng) % 4], eol);
            continue;
        }
        if (f % 3 == 1 && f != bad_at % fields) {
            p += sprintf(p, "content-length:%s%llu%s", fitm_rng_next(rng) % 2 ? " " : "",
                         (unsigned long long)(fitm_rng_next(rng) % 100000), eol);
            continue;
        }
        p += put_from(p, rng, TCHARS, 1 + fitm_rng_next(rng) % 20);
        if (!(f == bad_at % fields && defect == DEFECT_NO_COLON))
            *p++ = ':';
        *p++ = ' ';
        size_t vn = 1 + fitm_rng_next(rng) % 20, cut = fitm_rng_next(rng) % vn;
        p += put_from(p, rng, VCHARS, cut);
        *p++ = fitm_rng_next(rng) % 2 ? ' ' : '\t';
        p += put_from(p, rng, VCHARS, vn - cut);
        if (f == bad_at % fields && defect == DEFECT_CTL)
            p[-1] = (char)(1 + fitm_rng_next(rng) % 8);
        p += sprintf(p, "%s", eol);
        if (f == bad_at % fields && defect == DEFECT_FOLD)
            p += sprintf(p, " folded%s", eol);
    }
    if (!fields && defect >= DEFECT_NO_COLON && defect <= DEFECT_FOLD) /* none to plant in */
        p += sprintf(p, "%s",
                     defect == DEFECT_NO_COLON ? "Host x"
                     : defect == DEFECT_CTL    ? "Host: \x7f"
                     : defect == DEFECT_CL     ? "Content-Length: 1e3"
                                               : "Host: x\r\n\tfolded");
    if (!fields && defect >= DEFECT_NO_COLON && defect <= DEFECT_FOLD)
        p += sprintf(p, "%s", eol);
    p += sprintf(p, "%s", eol);
    return (size_t)(p - buf);
}

static void test_random(void)
{
    enum { ROUNDS = 300 };
    size_t cap = 2 * FITM_FRAME_MAX_HEAD + 1024;
    char *buf = malloc(cap + 64);
    if (!buf) {
        failures++;
        return;
    }
    uint64_t rng = 0x5eed0f4a11ull;
    int seen_bad[N_DEFECTS] = {0};
    for (int r = 0; r < ROUNDS; r++) {
        for (int defect = 0; defect < N_DEFECTS; defect++) {
            size_t n = random_head(buf, &rng, defect);
            CHECK(n <= cap, "head too long for the buffer");
            memcpy(buf + n, "{\"x\":\x01\r\n\r\n", 11); /* a body after the head is not read */
            int st;
            fitm_frame_verdict v = check(buf, n + 11, &st);
            if (defect == DEFECT_NONE) {
                CHECK(v == FITM_FRAME_OK, "valid head refused (%d): %.*s", st, (int)n, buf);
                /* Every prefix (the gate's view while it arrives) waits for more. */
                for (size_t k = 0; k < n; k += 1 + k / 16) {
                    fitm_frame_verdict pv = check(buf, k, &st);
                    CHECK(pv == FITM_FRAME_INCOMPLETE, "prefix %zu of a valid head: %d/%d", k, pv,
                          st);
                }
                continue;
            }
            CHECK(v == FITM_FRAME_BAD && st == defect_status[defect], "defect %d: got %d/%d: %.*s",
                  defect, v, st, n > 200 ? 200 : (int)n, buf);
            seen_bad[defect] += v == FITM_FRAME_BAD;
            for (size_t k = 0; k < n; k += 1 + k / 8)
                CHECK(check(buf, k, &st) != FITM_FRAME_OK, "prefix %zu of a bad head is OK", k);
        }
    }
    for (int d = 1; d < N_DEFECTS; d++)
        CHECK(seen_bad[d] == ROUNDS, "defect %d refused %d of %d times", d, seen_bad[d], ROUNDS);
    free(buf);
}

int main(void)
{
    test_fixed();
    test_random();
    printf("frame: %d checks, %d failures\n", n_checks, failures);
    return failures ? 1 : 0;
}
