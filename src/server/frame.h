/* frame: the strict check of an HTTP/1.x request head (request line and header fields) that
 * fitmd's gate runs on the bytes it peeks before libmicrohttpd sees the connection, so the
 * requests libmicrohttpd 0.9.75 would answer itself (with HTML, twice, or not at all) get the
 * documented JSON error instead (docs/reliability.md). Pure: no sockets, no allocation. */
#ifndef FITM_FRAME_H
#define FITM_FRAME_H

#include <stddef.h>
#include <stdint.h>

/* Largest request head (request line and header fields, with the blank line), and largest
 * request target, accepted. */
#define FITM_FRAME_MAX_HEAD 16384
#define FITM_FRAME_MAX_TARGET 8192

typedef enum {
    FITM_FRAME_OK = 0,     /* a complete, well-formed head: hand the connection on   */
    FITM_FRAME_INCOMPLETE, /* no end of head yet and nothing wrong so far: wait        */
    FITM_FRAME_BAD,        /* refuse with status and msg, then close                   */
} fitm_frame_verdict;

typedef struct {
    int status;    /* 400, 413, 414, 431 or 505 when BAD */
    char msg[160]; /* what is wrong, for the client      */
} fitm_frame_error;

/* Checks the head at the start of buf (n bytes peeked so far; what follows the head, a body
 * or a pipelined request, is not looked at). Leading empty lines are skipped (RFC 9112 2.2).
 * Lines end in CRLF or LF. BAD for: a request line other than `METHOD SP TARGET SP
 * HTTP/1.0|1.1` (400; 505 for another HTTP/d.d; 414 for a target over
 * FITM_FRAME_MAX_TARGET), a head over FITM_FRAME_MAX_HEAD (431), a header line that is folded,
 * has no colon, a name that is not a token or a control character in its value (400), a
 * Content-Length that is not digits (400) or beyond 2^62 (413). */
fitm_frame_verdict fitm_frame_check_head(const char *buf, size_t n, fitm_frame_error *e);

#endif
