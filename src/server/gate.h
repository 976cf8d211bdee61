/* gate: fitmd's own accept loop and relay in front of libmicrohttpd. It accepts a listener's
 * connections and stays in each one's path for its whole life: every request head that
 * arrives, the first or a later one on a kept-alive connection, is read within a deadline and
 * checked strictly (frame.h) before a byte of it is passed on, and the body is passed on only
 * as far as the head said it reaches, so the next head is found exactly where the HTTP server
 * will look for it. A bad head is answered by the gate itself, with the documented JSON error
 * and Connection: close, once the server has answered the requests before it; nothing after it
 * is passed on. libmicrohttpd 0.9.75 answers such heads itself with HTML, twice, or not at all,
 * and has no deadline for receiving headers (docs/reliability.md).
 *
 * The server gets one end of a socket pair per connection (hand) once its first head passed;
 * the gate copies bytes between the client's socket and the pair, both ways, and passes a
 * client's end of sending on (shutdown of the pair's write side), so the server sees a client
 * that left as before. One thread per gate; fitm_gate_done may be called from any thread,
 * everything else from one controlling thread. */
#ifndef FITM_GATE_H
#define FITM_GATE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/status.h"

typedef struct fitm_gate fitm_gate;

/* The security headers every response carries (the gate's own answers and the server's): no
 * MIME sniffing, no framing by other sites, and a policy that lets a JSON answer load nothing.
 * The playground's page gets FITM_GATE_CSP_PAGE instead, its own policy. */
#define FITM_GATE_NOSNIFF "nosniff"
#define FITM_GATE_FRAMES "DENY"
#define FITM_GATE_CSP_DATA "default-src 'none'; frame-ancestors 'none'"
#define FITM_GATE_CSP_PAGE                                                                     \
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src "  \
    "'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
#define FITM_GATE_SECURITY_HEADERS                                                             \
    "X-Content-Type-Options: " FITM_GATE_NOSNIFF "\r\nX-Frame-Options: " FITM_GATE_FRAMES      \
    "\r\nContent-Security-Policy: " FITM_GATE_CSP_DATA "\r\n"

typedef struct {
    int listen_fd;           /* bound and listening; the gate closes it on stop                */
    int64_t head_timeout_ms; /* a head not complete this long after accept (a first head) or
                              * after its first byte (a later one): 408, close                */
    int64_t idle_timeout_ms; /* a request body that stops arriving this long: 408, close; a
                              * client that takes none of an answer this long: closed        */
    int64_t max_body_bytes;  /* a chunked body announcing more: 413, close                     */
    int64_t max_conns;       /* connections held, in all (beyond: closed at accept)            */
    int64_t max_per_client;  /* ... from one address                                          */
    /* Takes over fd (the server's end of a connection's socket pair) with the client's
     * address; called on the gate's thread. */
    void (*hand)(void *user, int fd, const struct sockaddr *addr, socklen_t addr_len);
    /* Writes a fresh request id (a string of fewer than cap bytes) for a refusal's
     * X-Request-Id; called on the gate's thread. */
    void (*new_id)(void *user, char *out, size_t cap);
    void *user;
} fitm_gate_params;

fitm_status fitm_gate_start(fitm_gate **out, const fitm_gate_params *p, fitm_err *err);

/* The server finished a request (answered it, or gave it up) on the connection whose pair end
 * it holds as fd; called before the server closes fd. The gate answers a refused head only
 * after the requests before it are finished, so answers stay in order. */
void fitm_gate_done(fitm_gate *g, int fd);

/* Stops the thread (no hand-off after this) and closes the listening socket and every
 * connection it still holds; fitm_gate_done may still be called until fitm_gate_free. NULL is
 * a no-op. */
void fitm_gate_stop(fitm_gate *g);

/* Frees a stopped gate (stopping it first if need be). NULL is a no-op. */
void fitm_gate_free(fitm_gate *g);

#endif
