/* frame: the strict check of an HTTP/1.x request head (request line and header fields, and
 * what they say about where the request ends) and of a chunked body's framing, which fitmd's
 * gate runs on every request of a connection before libmicrohttpd sees a byte of it, so the
 * requests libmicrohttpd 0.9.75 would answer itself (with HTML, twice, or not at all) get the
 * documented JSON error instead and no request can hide inside another (docs/reliability.md).
 * Pure: no sockets, no allocation. */
#ifndef FITM_FRAME_H
#define FITM_FRAME_H

#include <stddef.h>
#include <stdint.h>

/* Largest request head (request line and header fields, with the blank line), largest
 * request target, and most header fields, accepted (libmicrohttpd's own limits lie beyond:
 * its per-connection memory holds every field as a structure besides its bytes). */
#define FITM_FRAME_MAX_HEAD 16384
#define FITM_FRAME_MAX_TARGET 8192
#define FITM_FRAME_MAX_FIELDS 100

typedef enum {
    FITM_FRAME_OK = 0,     /* a complete, well-formed head: hand the connection on   */
    FITM_FRAME_INCOMPLETE, /* no end of head yet and nothing wrong so far: wait        */
    FITM_FRAME_BAD,        /* refuse with status and msg, then close                   */
} fitm_frame_verdict;

typedef struct {
    int status;    /* 400, 413, 414, 417, 431, 501 or 505 when BAD */
    char msg[160]; /* what is wrong, for the client      */
} fitm_frame_error;

/* Checks the head at the start of buf (n bytes peeked so far; what follows the head, a body
 * or a pipelined request, is not looked at). Leading empty lines are skipped (RFC 9112 2.2).
 * Lines end in CRLF or LF. BAD for: a request line other than `METHOD SP TARGET SP
 * HTTP/1.0|1.1` (400; 505 for another HTTP/d.d; 414 for a target over
 * FITM_FRAME_MAX_TARGET), a target with an encoded NUL (%00: 400), a head over
 * FITM_FRAME_MAX_HEAD or with more than FITM_FRAME_MAX_FIELDS fields (431), a header line that
 * is folded, has no colon, a name that is not a token or a control character in its value
 * (400), a Content-Length that is not digits, optionally after whitespace (400), or of 10^18 or
 * more (413). */
fitm_frame_verdict fitm_frame_check_head(const char *buf, size_t n, fitm_frame_error *e);

/* How the body of a request whose head passed is framed. */
typedef enum {
    FITM_FRAME_BODY_NONE = 0, /* no body: the next request starts right after the head */
    FITM_FRAME_BODY_LENGTH,   /* Content-Length bytes                                    */
    FITM_FRAME_BODY_CHUNKED,  /* Transfer-Encoding: chunked (fitm_frame_chunks_scan)     */
} fitm_frame_body;

typedef struct {
    size_t head_len; /* bytes of the head, leading empty lines and the blank line included */
    fitm_frame_body body;
    uint64_t length; /* FITM_FRAME_BODY_LENGTH: the Content-Length */
} fitm_frame_request;

/* fitm_frame_check_head, then what the head says about where the request ends, so every
 * request on a connection is checked alike and a proxy in front of the HTTP server finds the
 * next request head exactly where the server will (no request smuggling). BAD, besides
 * fitm_frame_check_head's cases, for: Content-Length with Transfer-Encoding, more than one
 * Content-Length (400), a Transfer-Encoding other than one header with exactly `chunked`
 * (501) or in an HTTP/1.0 request (400), an HTTP/1.1 request without exactly one Host (400),
 * a body (Content-Length other than 0, or chunked) on a method other than POST (400), an
 * HTTP/1.1 Expect other than 100-continue (417, RFC 9110 10.1.1). OK fills *req. */
fitm_frame_verdict fitm_frame_check_request(const char *buf, size_t n, fitm_frame_request *req,
                                            fitm_frame_error *e);

/* The state of a chunked body being scanned; zero it before the body's first byte, then set
 * max_total if the body has a limit. */
typedef struct {
    int state;
    uint64_t left;      /* bytes of chunk data, or of the size digits' value so far */
    int digits;         /* hex digits of the size line */
    size_t line;        /* bytes of the current size, extension or trailer line */
    uint64_t total;     /* chunk data announced so far                             */
    uint64_t max_total; /* most chunk data the body may hold (413 beyond); 0: 2^60  */
} fitm_frame_chunks;

/* Scans the next n bytes of a chunked body (RFC 9112 7.1: size lines with optional
 * extensions, data each followed by CRLF, the last chunk, trailer fields, the final CRLF;
 * lines end in CRLF). *used: the bytes that belong to the body. OK when the body ended (*used
 * may be less than n: a next request follows), INCOMPLETE when all n bytes were body, BAD
 * (400; 413 for a chunk size beyond 2^60, or chunk sizes adding up past max_total, said as
 * soon as the size line ends) for anything else. */
fitm_frame_verdict fitm_frame_chunks_scan(fitm_frame_chunks *c, const char *p, size_t n,
                                          size_t *used, fitm_frame_error *e);

#endif
