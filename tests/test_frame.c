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
    fitm_frame_error e = {0};
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
    expect("POST /rerank HTTP/1.1\r\nContent-Length:  42\r\n\r\n", OK, 0);
    /* whitespace after the number: libmicrohttpd would answer it itself */
    expect("POST /rerank HTTP/1.1\r\nContent-Length: 42 \r\n\r\n", BAD, 400);
    expect("POST /rerank HTTP/1.1\r\nContent-Length: 42\t\r\n\r\n", BAD, 400);
    /* an encoded NUL would cut the decoded path short */
    expect("GET /metrics%00x HTTP/1.1\r\nHost: x\r\n\r\n", BAD, 400);
    expect("GET /a?b=%00 HTTP/1.1\r\nHost: x\r\n\r\n", BAD, 400);
    expect("GET /a%0 HTTP/1.1\r\nHost: x\r\n\r\n", OK, 0);
    expect("GET /a%2500%010 HTTP/1.1\r\nHost: x\r\n\r\n", OK, 0);
    /* FITM_FRAME_MAX_FIELDS fields, then one more */
    char many[64 + 8 * (FITM_FRAME_MAX_FIELDS + 1)];
    size_t m = (size_t)sprintf(many, "GET / HTTP/1.1\r\n");
    for (int f = 0; f < FITM_FRAME_MAX_FIELDS; f++)
        m += (size_t)sprintf(many + m, "X%03d:\r\n", f);
    strcpy(many + m, "\r\n");
    expect(many, OK, 0);
    strcpy(many + m, "Y:\r\n\r\n");
    expect(many, BAD, 431);
    expect("POST /rerank HTTP/1.1\r\nContent-Length: 00000000000000000000000042\r\n\r\n", OK, 0);
    expect("", INC, 0);
    expect("GE", INC, 0);
    expect("GET /a", INC, 0);
    expect("GET / HTTP/1.1\r\nHost: x\r\n", INC, 0);
    /* a leading empty line whose LF has not come yet (found by fuzz/fuzz_frame.c) */
    expect("\r", INC, 0);
    expect("\r\n\r", INC, 0);
    expect("\rG", BAD, 400);
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
    DEFECT_FIELDS,
    N_DEFECTS
};
static const int defect_status[N_DEFECTS] = {0, 505, 400, 400, 400, 400, 400, 414, 431, 431};

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
    for (char *q = p - tn; q + 2 < p; q++) /* no encoded NUL, a defect of its own */
        if (q[0] == '%' && q[1] == '0' && q[2] == '0')
            q[2] = '1';
    p += sprintf(p, " HTTP/%s%s",
                 defect == DEFECT_VERSION ? "2.0"
                 : fitm_rng_next(rng) % 2 ? "1.1"
                                          : "1.0",
                 eol);
    int fields = (int)(fitm_rng_next(rng) % 8), bad_at = (int)(fitm_rng_next(rng) % 8);
    if (defect == DEFECT_HEAD)
        fields = FITM_FRAME_MAX_HEAD; /* as many long fields as it takes to pass the limit */
    if (defect == DEFECT_FIELDS)
        fields = FITM_FRAME_MAX_FIELDS + 1 + (int)(fitm_rng_next(rng) % 8);
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
        size_t vn = defect == DEFECT_HEAD ? 200 + fitm_rng_next(rng) % 100
                                          : 1 + fitm_rng_next(rng) % 20;
        size_t cut = fitm_rng_next(rng) % vn;
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

static void expect_request(const char *s, int want_status, fitm_frame_body body, uint64_t length)
{
    fitm_frame_request req = {0};
    fitm_frame_error e = {0};
    size_t n = strlen(s);
    fitm_frame_verdict v = fitm_frame_check_request(s, n, &req, &e);
    if (want_status) {
        CHECK(v == FITM_FRAME_BAD && e.status == want_status, "%.70s: got %d/%d, want BAD/%d", s, v,
              v == FITM_FRAME_BAD ? e.status : 0, want_status);
        return;
    }
    const char *end = strstr(s, "\r\n\r\n");
    CHECK(v == FITM_FRAME_OK && req.body == body && req.length == length && end &&
              req.head_len == (size_t)(end + 4 - s),
          "%.70s: got %d body %d length %llu head %zu", s, v, req.body,
          (unsigned long long)req.length, req.head_len);
}

/* What a head says about where its request ends: the checks a proxy in front of the server
 * needs to find the next head where the server will. */
static void test_request(void)
{
    const fitm_frame_body NONE = FITM_FRAME_BODY_NONE, LEN = FITM_FRAME_BODY_LENGTH,
                          CHUNKED = FITM_FRAME_BODY_CHUNKED;
    expect_request("GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /next", 0, NONE, 0);
    expect_request("\r\nGET / HTTP/1.0\r\n\r\n", 0, NONE, 0);
    expect_request("GET / HTTP/1.1\r\nhost: x\r\nContent-Length: 0\r\n\r\n", 0, NONE, 0);
    expect_request("POST /r HTTP/1.1\r\nHOST: x\r\ncontent-length: 0042\r\n\r\n{", 0, LEN, 42);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\tchunked \r\n\r\n", 0,
                   CHUNKED, 0);
    expect_request("POST /r HTTP/1.0\r\n\r\n", 0, NONE, 0);
    /* a body is refused on GET and HEAD only: another method's is framed and passed on, for
     * the router's 405 */
    expect_request("PUT /r HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n", 0, LEN, 7);
    expect_request("DELETE /r HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 0,
                   CHUNKED, 0);
    expect_request("HEAD /r HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n", 400, NONE, 0);
    expect_request("GETS /r HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n", 0, LEN, 7);
    /* RFC 9112 6.1: chunked framing in an HTTP/1.0 request is faulty */
    expect_request("POST /r HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, NONE, 0);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n",
                   400, NONE, 0);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
                   400, NONE, 0);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n", 501, NONE,
                   0);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501,
                   NONE, 0);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n",
                   501, NONE, 0);
    expect_request("GET / HTTP/1.1\r\n\r\n", 400, NONE, 0);
    expect_request("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, NONE, 0);
    expect_request("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n", 400, NONE, 0);
    expect_request("HEAD / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 400, NONE,
                   0);
    /* Expect: 100-continue (any case) is met; another expectation fails on HTTP/1.1 only. */
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n"
                   "\r\n",
                   0, LEN, 2);
    expect_request("POST /r HTTP/1.1\r\nHost: x\r\nExpect: 100-continue, x\r\n\r\n", 417, NONE,
                   0);
    expect_request("GET / HTTP/1.1\r\nHost: x\r\nExpect:\r\n\r\n", 417, NONE, 0);
    expect_request("GET / HTTP/1.0\r\nExpect: 200-ok\r\n\r\n", 0, NONE, 0);
}

/* A body limit (max_total): the size line that brings the announced chunk data past it is
 * refused with 413 as it ends, before its data; data up to the limit is accepted. */
static void test_chunk_limit(void)
{
    static const struct {
        const char *body;
        int status;
    } cases[] = {
        {"10\r\n0123456789abcdef\r\n0\r\n\r\n", 0},
        {"11\r\n", 413},
        {"8\r\n01234567\r\n8\r\n01234567\r\n1\r\n", 413},
        {"8;ext=1\r\n01234567\r\n8\r\n01234567\r\n0\r\n\r\n", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fitm_frame_chunks c = {.max_total = 16};
        fitm_frame_error e = {0};
        size_t used = 0, n = strlen(cases[i].body);
        fitm_frame_verdict v = fitm_frame_chunks_scan(&c, cases[i].body, n, &used, &e);
        CHECK(cases[i].status ? v == FITM_FRAME_BAD && e.status == 413
                              : v == FITM_FRAME_OK && used == n,
              "chunk limit case %zu: %d/%d", i, v, e.status);
    }
}

/* Scans s in pieces of `step` bytes; the verdict, and in *used the bytes of s that were body. */
static fitm_frame_verdict scan_in_steps(const char *s, size_t n, size_t step, size_t *used,
                                        int *status)
{
    fitm_frame_chunks c = {0};
    fitm_frame_error e = {0};
    *used = 0;
    for (size_t at = 0; at < n || n == 0;) {
        size_t k = n - at < step ? n - at : step, u = 0;
        fitm_frame_verdict v = fitm_frame_chunks_scan(&c, s + at, k, &u, &e);
        *used += u;
        if (v != FITM_FRAME_INCOMPLETE) {
            *status = v == FITM_FRAME_BAD ? e.status : 0;
            return v;
        }
        at += k;
        if (!n)
            break;
    }
    *status = 0;
    return FITM_FRAME_INCOMPLETE;
}

/* Chunked bodies: random valid ones end exactly at their last CRLF however they are cut into
 * pieces; each planted defect is BAD; every proper prefix waits. */
static void test_chunks(void)
{
    static const char *bad[] = {
        "x\r\n",
        "5\r\nhello0\r\n\r\n",
        "5\nhello\r\n0\r\n\r\n",
        "5\r\nhelloXY",
        "0\r\nNoColon\r\n\r\n",
        "0\r\n\r\r",
        "-1\r\n",
        "\r\n",
        "0;a\x01\r\n\r\n",
        "00000000000000001\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t used;
        int st;
        CHECK(scan_in_steps(bad[i], strlen(bad[i]), 3, &used, &st) == FITM_FRAME_BAD && st == 400,
              "bad chunked body %zu accepted", i);
    }
    size_t used;
    int st;
    const char *huge = "FFFFFFFFFFFFFFFF\r\n";
    CHECK(scan_in_steps(huge, strlen(huge), 64, &used, &st) == FITM_FRAME_BAD && st == 413,
          "a huge chunk size: %d", st);
    uint64_t rng = 0xc4a4b5ull;
    char *buf = malloc(1 << 16);
    if (!buf) {
        failures++;
        return;
    }
    for (int r = 0; r < 500; r++) {
        char *p = buf;
        int chunks = (int)(fitm_rng_next(&rng) % 5);
        for (int k = 0; k < chunks; k++) {
            size_t len = 1 + fitm_rng_next(&rng) % 300;
            p += sprintf(p, fitm_rng_next(&rng) % 2 ? "%zx" : "%zX", len);
            if (fitm_rng_next(&rng) % 3 == 0)
                p += sprintf(p, ";name=\"v\"");
            p += sprintf(p, "\r\n");
            p += put_from(p, &rng, VCHARS "\r\n", len);
            p += sprintf(p, "\r\n");
        }
        p += sprintf(p, "0\r\n");
        if (fitm_rng_next(&rng) % 2)
            p += sprintf(p, "X-Sum: %llu\r\n", (unsigned long long)(fitm_rng_next(&rng) % 1000));
        p += sprintf(p, "\r\n");
        size_t n = (size_t)(p - buf);
        memcpy(p, "GET / HTTP/1.1\r\n", 16); /* what follows is the next request */
        size_t step = 1 + fitm_rng_next(&rng) % 64;
        fitm_frame_verdict v = scan_in_steps(buf, n + 16, step, &used, &st);
        CHECK(v == FITM_FRAME_OK && used == n, "round %d: %d/%d used %zu of %zu", r, v, st, used,
              n);
        size_t cut = fitm_rng_next(&rng) % n;
        CHECK(scan_in_steps(buf, cut, step, &used, &st) == FITM_FRAME_INCOMPLETE && used == cut,
              "round %d: prefix %zu of %zu not INCOMPLETE", r, cut, n);
    }
    free(buf);
}

int main(void)
{
    test_fixed();
    test_random();
    test_request();
    test_chunks();
    test_chunk_limit();
    printf("frame: %d checks, %d failures\n", n_checks, failures);
    return failures ? 1 : 0;
}
