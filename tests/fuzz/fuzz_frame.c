/* fuzz_frame: libFuzzer target for frame.c, the gate's check of every request's head and
 * chunked body before libmicrohttpd sees a byte. Besides running the checks on any bytes, it
 * traps where the verdicts would contradict each other as bytes arrive (the gate judges what
 * it has peeked so far):
 * - a BAD verdict has a documented status and a message;
 * - a head OK at n bytes (head_len h) is OK, with the same request, at every length from h
 *   on, and INCOMPLETE at every length below h (a client sending slowly is not refused);
 * - a prefix judged BAD means the whole is BAD;
 * - a chunked body after an OK head gets the same verdict and the same body length whether
 *   its bytes come at once or one by one. */
#include <stdint.h>
#include <string.h>

#include "server/frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void require(int ok)
{
    if (!ok)
        __builtin_trap();
}

static void check_error(fitm_frame_verdict v, const fitm_frame_error *e)
{
    if (v != FITM_FRAME_BAD)
        return;
    static const int statuses[] = {400, 413, 414, 417, 431, 501, 505};
    int known = 0;
    for (size_t i = 0; i < sizeof statuses / sizeof *statuses; i++)
        known |= e->status == statuses[i];
    require(known && e->msg[0] && memchr(e->msg, '\0', sizeof e->msg));
}

static fitm_frame_verdict request_at(const char *p, size_t n, fitm_frame_request *r)
{
    fitm_frame_error e;
    memset(&e, 0, sizeof e);
    memset(r, 0, sizeof *r);
    const fitm_frame_verdict v = fitm_frame_check_request(p, n, r, &e);
    check_error(v, &e);
    return v;
}

/* The chunked body at p (n bytes) scanned in pieces of `step` bytes (0: at once): its verdict
 * and the body bytes used. */
static fitm_frame_verdict chunks(const char *p, size_t n, size_t step, size_t *used)
{
    fitm_frame_chunks c;
    memset(&c, 0, sizeof c);
    c.max_total = 1u << 20;
    size_t at = 0;
    for (;;) {
        const size_t k = step && n - at > step ? step : n - at;
        size_t u = 0;
        fitm_frame_error e;
        memset(&e, 0, sizeof e);
        const fitm_frame_verdict v = fitm_frame_chunks_scan(&c, p + at, k, &u, &e);
        check_error(v, &e);
        require(u <= k && (v != FITM_FRAME_INCOMPLETE || u == k));
        at += u;
        if (v != FITM_FRAME_INCOMPLETE || at == n) {
            *used = at;
            return v;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = (const char *)data;
    fitm_frame_request whole, r;
    const fitm_frame_verdict v = request_at(p, size, &whole);
    if (v == FITM_FRAME_OK)
        require(whole.head_len > 0 && whole.head_len <= size);

    /* every prefix (a stride through long inputs) against the whole's verdict */
    const size_t stride = size <= 256 ? 1 : size / 256;
    for (size_t k = 0; k < size; k += stride) {
        const fitm_frame_verdict pv = request_at(p, k, &r);
        if (v == FITM_FRAME_OK && k < whole.head_len)
            require(pv == FITM_FRAME_INCOMPLETE);
        if (v == FITM_FRAME_OK && k >= whole.head_len)
            require(pv == FITM_FRAME_OK && r.head_len == whole.head_len && r.body == whole.body &&
                    r.length == whole.length);
        if (pv == FITM_FRAME_BAD)
            require(v == FITM_FRAME_BAD);
    }

    if (v == FITM_FRAME_OK && whole.body == FITM_FRAME_BODY_CHUNKED) {
        const char *b = p + whole.head_len;
        const size_t n = size - whole.head_len;
        size_t u1 = 0, u2 = 0;
        const fitm_frame_verdict a = chunks(b, n, 0, &u1), c = chunks(b, n, 1, &u2);
        require(a == c && (a != FITM_FRAME_OK || u1 == u2));
    }
    return 0;
}
