#include "server/frame.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

static fitm_frame_verdict bad(fitm_frame_error *e, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->status = status;
    return FITM_FRAME_BAD;
}

/* RFC 9110 tchar. */
static bool is_tchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* The line at p (up to end): its length without the CR LF or LF, and where the next starts;
 * false when no LF is there yet. A CR not before the LF is left in the line. */
static bool next_line(const char *p, const char *end, size_t *len, const char **next)
{
    const char *lf = memchr(p, '\n', (size_t)(end - p));
    if (!lf)
        return false;
    *len = (size_t)(lf - p) - (lf > p && lf[-1] == '\r');
    *next = lf + 1;
    return true;
}

static fitm_frame_verdict check_request_line(const char *p, size_t len, fitm_frame_error *e)
{
    size_t m = 0;
    while (m < len && is_tchar((unsigned char)p[m]))
        m++;
    const char *sp2 = m > 0 && m < len && p[m] == ' ' ? memchr(p + m + 1, ' ', len - m - 1) : NULL;
    if (!sp2)
        return bad(e, 400, "the request line is not METHOD SP TARGET SP HTTP-version");
    size_t t0 = m + 1, tn = (size_t)(sp2 - p) - t0;
    for (size_t i = t0; i < t0 + tn; i++)
        if ((unsigned char)p[i] <= 0x20 || (unsigned char)p[i] == 0x7f)
            return bad(e, 400, "the request target has a control character at byte %zu", i);
    if (tn == 0)
        return bad(e, 400, "the request line is not METHOD SP TARGET SP HTTP-version");
    if (tn > FITM_FRAME_MAX_TARGET)
        return bad(e, 414, "the request target is %zu bytes, over the limit of %d", tn,
                   FITM_FRAME_MAX_TARGET);
    const char *v = sp2 + 1;
    size_t vn = len - (size_t)(v - p);
    bool shaped = vn == 8 && !memcmp(v, "HTTP/", 5) && v[5] >= '0' && v[5] <= '9' && v[6] == '.' &&
                  v[7] >= '0' && v[7] <= '9';
    if (!shaped)
        return bad(e, 400, "the request line is not METHOD SP TARGET SP HTTP-version");
    if (memcmp(v, "HTTP/1.1", 8) && memcmp(v, "HTTP/1.0", 8))
        return bad(e, 505, "HTTP version %.8s is not supported: use HTTP/1.1", v);
    return FITM_FRAME_OK;
}

static fitm_frame_verdict check_field(const char *p, size_t len, fitm_frame_error *e)
{
    if (p[0] == ' ' || p[0] == '\t')
        return bad(e, 400, "a folded header line (obsolete line folding is not accepted)");
    size_t m = 0;
    while (m < len && is_tchar((unsigned char)p[m]))
        m++;
    if (m == 0 || m == len || p[m] != ':')
        return bad(e, 400, "the header line '%.*s' is not a token name followed by a colon",
                   (int)(len < 40 ? len : 40), p);
    for (size_t i = m + 1; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        if ((c < 0x20 && c != '\t') || c == 0x7f)
            return bad(e, 400, "header '%.*s' has a control character in its value", (int)m, p);
    }
    if (m == 14 && !strncasecmp(p, "Content-Length", 14)) {
        size_t a = m + 1, b = len;
        while (a < b && (p[a] == ' ' || p[a] == '\t'))
            a++;
        while (b > a && (p[b - 1] == ' ' || p[b - 1] == '\t'))
            b--;
        if (a == b)
            return bad(e, 400, "Content-Length is empty");
        for (size_t i = a; i < b; i++)
            if (p[i] < '0' || p[i] > '9')
                return bad(e, 400, "Content-Length '%.*s' is not a decimal number",
                           (int)(b - a < 40 ? b - a : 40), p + a);
        while (a + 1 < b && p[a] == '0')
            a++;
        if (b - a > 18)
            return bad(e, 413, "Content-Length %.*s%s is over any body this server accepts",
                       (int)(b - a < 40 ? b - a : 40), p + a, b - a > 40 ? "..." : "");
    }
    return FITM_FRAME_OK;
}

fitm_frame_verdict fitm_frame_check_head(const char *buf, size_t n, fitm_frame_error *e)
{
    const char *p = buf, *end = buf + n, *next;
    size_t len;
    e->status = 0;
    e->msg[0] = '\0';
    /* Leading empty lines (a client's CRLF after a previous body) are skipped. */
    while (p < end && (*p == '\n' || (*p == '\r' && p + 1 < end && p[1] == '\n')))
        p += *p == '\r' ? 2 : 1;
    if (!next_line(p, end, &len, &next)) {
        /* Bytes that cannot start a request line are refused at once. */
        size_t k = 0;
        while (k < (size_t)(end - p) && is_tchar((unsigned char)p[k]))
            k++;
        if (k < (size_t)(end - p) && (p[k] != ' ' || k == 0))
            return bad(e, 400, "the request line is not METHOD SP TARGET SP HTTP-version");
        if ((size_t)(end - p) > FITM_FRAME_MAX_TARGET + 64)
            return bad(e, 414,
                       "the request line is over %d bytes (the request target's limit "
                       "is %d)",
                       FITM_FRAME_MAX_TARGET + 64, FITM_FRAME_MAX_TARGET);
        return FITM_FRAME_INCOMPLETE;
    }
    fitm_frame_verdict v = check_request_line(p, len, e);
    if (v != FITM_FRAME_OK)
        return v;
    for (p = next;;) {
        if (!next_line(p, end, &len, &next)) {
            if (n > FITM_FRAME_MAX_HEAD)
                return bad(e, 431, "the request head is over %d bytes", FITM_FRAME_MAX_HEAD);
            return FITM_FRAME_INCOMPLETE;
        }
        if ((size_t)(next - buf) > FITM_FRAME_MAX_HEAD)
            return bad(e, 431, "the request head is over %d bytes", FITM_FRAME_MAX_HEAD);
        if (len == 0)
            return FITM_FRAME_OK;
        if ((v = check_field(p, len, e)) != FITM_FRAME_OK)
            return v;
        p = next;
    }
}
