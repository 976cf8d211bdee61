/* gate: fitmd's own accept loop in front of libmicrohttpd. It accepts the main port's
 * connections, peeks (MSG_PEEK: nothing is consumed) at each one's first request head until
 * it is complete, within a deadline, checks it strictly (frame.h) and either answers a bad one
 * itself, with the documented JSON error and Connection: close, or hands the untouched socket
 * to the HTTP server (hand). libmicrohttpd 0.9.75 answers these heads itself with HTML, twice,
 * or not at all, and has no deadline for receiving headers (docs/reliability.md).
 *
 * One thread; every function but the callbacks is called from one controlling thread. */
#ifndef FITM_GATE_H
#define FITM_GATE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/status.h"

typedef struct fitm_gate fitm_gate;

typedef struct {
    int listen_fd;           /* bound and listening; the gate closes it on stop            */
    int64_t head_timeout_ms; /* a head not complete this long after accept: 408, close    */
    int64_t max_pending;     /* connections waiting for their head, in all                */
    int64_t max_per_client;  /* ... from one address                                      */
    /* Takes over fd (a connection whose head passed) with its peer address; called on the
     * gate's thread. */
    void (*hand)(void *user, int fd, const struct sockaddr *addr, socklen_t addr_len);
    void *user;
} fitm_gate_params;

fitm_status fitm_gate_start(fitm_gate **out, const fitm_gate_params *p, fitm_err *err);

/* Stops the thread, closes the listening socket and every connection it still holds, frees.
 * NULL is a no-op. */
void fitm_gate_stop(fitm_gate *g);

#endif
