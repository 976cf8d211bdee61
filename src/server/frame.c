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
    /* decoded, %00 would end the path early: /metrics%00x would be /metrics */
    for (size_t i = t0; i + 2 < t0 + tn; i++)
        if (p[i] == '%' && p[i + 1] == '0' && p[i + 2] == '0')
            return bad(e, 400, "the request target has an encoded NUL (%%00) at byte %zu", i);
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
        if (a == b)
            return bad(e, 400, "Content-Length is empty");
        /* RFC 9110 allows it, but libmicrohttpd answers whitespace after the number with a
         * 400 of its own (HTML, its status line twice): refused here, in JSON */
        if (p[b - 1] == ' ' || p[b - 1] == '\t')
            return bad(e, 400, "Content-Length has whitespace after its number");
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
    if (end - p == 1 && *p == '\r')
        return FITM_FRAME_INCOMPLETE; /* an empty line's CR, its LF still to come */
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
    for (int fields = 0;; fields++) {
        p = next;
        if (!next_line(p, end, &len, &next)) {
            if (n > FITM_FRAME_MAX_HEAD)
                return bad(e, 431, "the request head is over %d bytes", FITM_FRAME_MAX_HEAD);
            return FITM_FRAME_INCOMPLETE;
        }
        if ((size_t)(next - buf) > FITM_FRAME_MAX_HEAD)
            return bad(e, 431, "the request head is over %d bytes", FITM_FRAME_MAX_HEAD);
        if (len == 0)
            return FITM_FRAME_OK;
        if (fields == FITM_FRAME_MAX_FIELDS)
            return bad(e, 431, "the request head has more than %d header fields",
                       FITM_FRAME_MAX_FIELDS);
        if ((v = check_field(p, len, e)) != FITM_FRAME_OK)
            return v;
    }
}

/* A header value without its surrounding optional whitespace. */
static void field_value(const char *p, size_t len, size_t name_len, const char **v, size_t *vn)
{
    size_t a = name_len + 1, b = len;
    while (a < b && (p[a] == ' ' || p[a] == '\t'))
        a++;
    while (b > a && (p[b - 1] == ' ' || p[b - 1] == '\t'))
        b--;
    *v = p + a;
    *vn = b - a;
}

fitm_frame_verdict fitm_frame_check_request(const char *buf, size_t n, fitm_frame_request *req,
                                            fitm_frame_error *e)
{
    fitm_frame_verdict v = fitm_frame_check_head(buf, n, e);
    if (v != FITM_FRAME_OK)
        return v;
    /* The head is well formed and complete: walk it again for its framing. */
    const char *p = buf, *end = buf + n, *next = NULL;
    size_t len = 0;
    while (*p == '\n' || (*p == '\r' && p[1] == '\n'))
        p += *p == '\r' ? 2 : 1;
    next_line(p, end, &len, &next);
    size_t mn = strcspn(p, " ");
    /* GET and HEAD carry no content (RFC 9110 9.3.1, 9.3.2): a body on them is refused here;
     * a body on any other method is framed and passed on, so a method a route does not take
     * gets its 405 with Allow from the router. */
    bool bodyless = (mn == 3 && !memcmp(p, "GET", 3)) || (mn == 4 && !memcmp(p, "HEAD", 4));
    bool http11 = !memcmp(p + len - 8, "HTTP/1.1", 8);
    int n_cl = 0, n_te = 0, n_host = 0;
    uint64_t cl = 0;
    bool te_chunked = false, expect_other = false;
    for (p = next;; p = next) {
        next_line(p, end, &len, &next);
        if (len == 0)
            break;
        size_t m = (size_t)((const char *)memchr(p, ':', len) - p);
        const char *val;
        size_t vn;
        field_value(p, len, m, &val, &vn);
        if (m == 14 && !strncasecmp(p, "Content-Length", 14)) {
            n_cl++;
            cl = 0;
            for (size_t i = 0; i < vn; i++) /* digits only, below 10^18 (check_field) */
                cl = cl * 10 + (uint64_t)(val[i] - '0');
        } else if (m == 17 && !strncasecmp(p, "Transfer-Encoding", 17)) {
            n_te++;
            te_chunked = vn == 7 && !memcmp(val, "chunked", 7);
        } else if (m == 4 && !strncasecmp(p, "Host", 4)) {
            n_host++;
        } else if (m == 6 && !strncasecmp(p, "Expect", 6)) {
            expect_other |= !(vn == 12 && !strncasecmp(val, "100-continue", 12));
        }
    }
    if (n_cl && n_te)
        return bad(e, 400, "Content-Length and Transfer-Encoding together: send one of them");
    if (n_cl > 1)
        return bad(e, 400, "more than one Content-Length header");
    if (n_te > 1 || (n_te && !te_chunked))
        return bad(e, 501, "Transfer-Encoding: only 'chunked' (alone, lower case) is supported");
    if (n_te && !http11) /* RFC 9112 6.1: such framing is faulty */
        return bad(e, 400, "Transfer-Encoding in an HTTP/1.0 request: send Content-Length");
    if (http11 && n_host != 1)
        return bad(e, 400,
                   n_host ? "more than one Host header" : "HTTP/1.1 request without a Host header");
    if (bodyless && (n_te || cl))
        return bad(e, 400, "this method takes no request body");
    if (http11 && expect_other) /* an HTTP/1.0 server ignores Expect (RFC 9110 10.1.1) */
        return bad(e, 417, "Expect: only '100-continue' is supported");
    req->head_len = (size_t)(next - buf);
    req->body = n_te ? FITM_FRAME_BODY_CHUNKED : cl ? FITM_FRAME_BODY_LENGTH : FITM_FRAME_BODY_NONE;
    req->length = cl;
    return FITM_FRAME_OK;
}

/* fitm_frame_chunks.state */
enum {
    CH_SIZE = 0, /* hex digits of a chunk size               */
    CH_EXT,      /* a chunk extension, up to its CR          */
    CH_SIZE_LF,  /* the LF after a size line's CR            */
    CH_DATA,     /* chunk data (left bytes)                  */
    CH_DATA_CR,  /* the CR after chunk data                  */
    CH_DATA_LF,  /* ... its LF                               */
    CH_TRAILER,  /* the start of a trailer line or the end   */
    CH_NAME,     /* a trailer field's name, up to its colon  */
    CH_FIELD,    /* a trailer field's value, up to its CR    */
    CH_FIELD_LF, /* the LF after a trailer line's CR         */
    CH_END_LF,   /* the LF of the final empty line           */
};

/* Longest chunk size line (with extensions) and trailer line accepted. */
#define CH_MAX_LINE 4096

/* The state handlers below take one byte b of the body in c->state: they return
 * FITM_FRAME_INCOMPLETE when b is taken (the state moved on or not), FITM_FRAME_BAD to refuse. */

/* A byte of a chunk size line: its hex digits, an extension, the CRLF that ends it. */
static fitm_frame_verdict chunk_size_byte(fitm_frame_chunks *c, unsigned char b,
                                          fitm_frame_error *e)
{
    switch (c->state) {
    case CH_SIZE: {
        int d = b >= '0' && b <= '9'   ? b - '0'
                : b >= 'a' && b <= 'f' ? b - 'a' + 10
                : b >= 'A' && b <= 'F' ? b - 'A' + 10
                                       : -1;
        if (d >= 0) {
            if (++c->digits > 16)
                return bad(e, 400, "a chunk size has over 16 hex digits");
            c->left = c->left * 16 + (uint64_t)d;
            if (c->left > (UINT64_C(1) << 60))
                return bad(e, 413, "a chunk size is over any body this server accepts");
        } else if (c->digits && (b == ';' || b == '\r')) {
            c->state = b == ';' ? CH_EXT : CH_SIZE_LF;
        } else {
            return bad(e, 400, "a chunk size line is not hex digits ending in CRLF");
        }
        break;
    }
    case CH_EXT:
        if (++c->line > CH_MAX_LINE)
            return bad(e, 400, "a chunk extension is over %d bytes", CH_MAX_LINE);
        if (b == '\r')
            c->state = CH_SIZE_LF;
        else if ((b < 0x20 && b != '\t') || b == 0x7f)
            return bad(e, 400, "a chunk extension has a control character");
        break;
    default: /* CH_SIZE_LF */
        if (b != '\n')
            return bad(e, 400, "a chunk size line does not end in CRLF");
        c->line = 0;
        c->digits = 0;
        c->total += c->max_total ? c->left : 0; /* total <= max_total, left <= 2^60 */
        if (c->max_total && c->total > c->max_total)
            return bad(e, 413, "the chunked body is over the limit of %llu bytes",
                       (unsigned long long)c->max_total);
        c->state = c->left ? CH_DATA : CH_TRAILER;
        break;
    }
    return FITM_FRAME_INCOMPLETE;
}

/* A byte of the trailer: a field's name, its value, the CRLF of its line, or the start of the
 * next line. */
static fitm_frame_verdict trailer_byte(fitm_frame_chunks *c, unsigned char b, fitm_frame_error *e)
{
    switch (c->state) {
    case CH_TRAILER:
        c->line = 0;
        if (b == '\r')
            c->state = CH_END_LF;
        else if (is_tchar(b))
            c->state = CH_NAME;
        else
            return bad(e, 400, "a trailer line is not a header field");
        break;
    case CH_NAME:
        if (++c->line > CH_MAX_LINE)
            return bad(e, 400, "a trailer line is over %d bytes", CH_MAX_LINE);
        if (b == ':')
            c->state = CH_FIELD;
        else if (!is_tchar(b))
            return bad(e, 400, "a trailer line is not a token name followed by a colon");
        break;
    case CH_FIELD:
        if (++c->line > CH_MAX_LINE)
            return bad(e, 400, "a trailer line is over %d bytes", CH_MAX_LINE);
        if (b == '\r')
            c->state = CH_FIELD_LF;
        else if ((b < 0x20 && b != '\t') || b == 0x7f)
            return bad(e, 400, "a trailer line has a control character");
        break;
    default: /* CH_FIELD_LF */
        if (b != '\n')
            return bad(e, 400, "a trailer line does not end in CRLF");
        c->state = CH_TRAILER;
        break;
    }
    return FITM_FRAME_INCOMPLETE;
}

fitm_frame_verdict fitm_frame_chunks_scan(fitm_frame_chunks *c, const char *p, size_t n,
                                          size_t *used, fitm_frame_error *e)
{
    size_t i = 0;
    while (i < n) {
        unsigned char b = (unsigned char)p[i];
        fitm_frame_verdict v = FITM_FRAME_INCOMPLETE;
        switch (c->state) {
        case CH_SIZE:
        case CH_EXT:
        case CH_SIZE_LF:
            v = chunk_size_byte(c, b, e);
            break;
        case CH_DATA: {
            size_t k = n - i < c->left ? n - i : (size_t)c->left;
            c->left -= k;
            i += k;
            if (!c->left)
                c->state = CH_DATA_CR;
            continue;
        }
        case CH_DATA_CR:
        case CH_DATA_LF:
            if (b != (c->state == CH_DATA_CR ? '\r' : '\n'))
                return bad(e, 400, "chunk data is not followed by CRLF");
            c->state = c->state == CH_DATA_CR ? CH_DATA_LF : CH_SIZE;
            break;
        case CH_TRAILER:
        case CH_NAME:
        case CH_FIELD:
        case CH_FIELD_LF:
            v = trailer_byte(c, b, e);
            break;
        case CH_END_LF:
            if (b != '\n')
                return bad(e, 400, "a chunked body does not end in CRLF");
            *used = i + 1;
            return FITM_FRAME_OK;
        }
        if (v == FITM_FRAME_BAD)
            return v;
        i++;
    }
    *used = n;
    return FITM_FRAME_INCOMPLETE;
}
