#include "server/gate.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "server/api.h"
#include "server/frame.h"

/* How long a refused connection is kept after its answer, reading and dropping what the client
 * still sends, so closing it does not reset the answer away (a close with unread bytes sends
 * RST). */
#define LINGER_MS 2000
/* How long accepting pauses when the process is out of descriptors. */
#define ACCEPT_PAUSE_MS 100

typedef struct {
    int fd;
    bool closing; /* answered: draining until EOF or the deadline */
    int64_t deadline_ns;
    struct sockaddr_storage addr;
    socklen_t addr_len;
} pending;

struct fitm_gate {
    fitm_gate_params p;
    pthread_t thread;
    int wake[2]; /* a byte on wake[1]: re-read `stop` */
    _Atomic bool stop;
    pending *conns;
    int64_t n, cap;
    char *peek;              /* FITM_FRAME_MAX_HEAD + 1 bytes */
    int64_t accept_after_ns; /* accepting paused until then (out of descriptors) */
};

static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return !memcmp(&((const struct sockaddr_in *)a)->sin_addr,
                       &((const struct sockaddr_in *)b)->sin_addr, sizeof(struct in_addr));
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                       &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
    return false;
}

static void drop(fitm_gate *g, int64_t i)
{
    close(g->conns[i].fd);
    g->conns[i] = g->conns[--g->n];
}

static const char *reason(int status)
{
    switch (status) {
    case 400:
        return "Bad Request";
    case 408:
        return "Request Timeout";
    case 413:
        return "Content Too Large";
    case 414:
        return "URI Too Long";
    case 431:
        return "Request Header Fields Too Large";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Error";
    }
}

/* Sends the JSON error of cond with msg and Connection: close, then half-closes and lingers. */
static void refuse(fitm_gate *g, int64_t i, fitm_api_cond cond, const char *msg)
{
    pending *c = &g->conns[i];
    fitm_api_error_class k = fitm_api_classify(FITM_ERR_INVALID, cond);
    char *json = fitm_api_error_json(&k, msg);
    char head[256];
    size_t jn = json ? strlen(json) : 0;
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: "
                      "%zu\r\nConnection: close\r\n\r\n",
                      k.http, reason(k.http), jn);
    /* Small enough for an empty socket buffer: one non-blocking send each, no waiting. */
    if (send(c->fd, head, (size_t)hn, MSG_NOSIGNAL | MSG_DONTWAIT) == hn && json)
        (void)send(c->fd, json, jn, MSG_NOSIGNAL | MSG_DONTWAIT);
    free(json);
    FITM_LOG(FITM_LOG_INFO, NULL, "refused a request head: %d %s", k.http, msg);
    shutdown(c->fd, SHUT_WR);
    int one = 1;
    setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    c->closing = true;
    c->deadline_ns = fitm_clock_ns() + (int64_t)LINGER_MS * 1000000;
}

static fitm_api_cond cond_of(int status)
{
    switch (status) {
    case 413:
        return FITM_API_COND_BODY_TOO_LARGE;
    case 414:
        return FITM_API_COND_TARGET_TOO_LONG;
    case 431:
        return FITM_API_COND_HEAD_TOO_LARGE;
    case 505:
        return FITM_API_COND_VERSION;
    default:
        return FITM_API_COND_FRAMING;
    }
}

/* Connection i is readable (or closed: revents): look at its head again. */
static void on_readable(fitm_gate *g, int64_t i, short revents)
{
    pending *c = &g->conns[i];
    if (c->closing) {
        char sink[4096];
        ssize_t n = recv(c->fd, sink, sizeof sink, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            drop(g, i);
        return;
    }
    ssize_t n = recv(c->fd, g->peek, FITM_FRAME_MAX_HEAD + 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        drop(g, i);
        return;
    }
    if (n < 0)
        return;
    fitm_frame_error e;
    switch (fitm_frame_check_head(g->peek, (size_t)n, &e)) {
    case FITM_FRAME_INCOMPLETE: {
        if (revents & (POLLRDHUP | POLLHUP | POLLERR)) {
            refuse(g, i, FITM_API_COND_FRAMING, "the connection ended inside the request head");
            return;
        }
        /* Wake only when more than what is there has arrived (the peeked bytes stay). */
        int low = (int)n + 1;
        setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &low, sizeof low);
        return;
    }
    case FITM_FRAME_BAD:
        refuse(g, i, cond_of(e.status), e.msg);
        return;
    case FITM_FRAME_OK: {
        int one = 1;
        setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
        pending taken = *c;
        g->conns[i] = g->conns[--g->n];
        g->p.hand(g->p.user, taken.fd, (const struct sockaddr *)&taken.addr, taken.addr_len);
        return;
    }
    }
}

static void accept_all(fitm_gate *g)
{
    for (;;) {
        struct sockaddr_storage a;
        socklen_t al = sizeof a;
        int fd = accept4(g->p.listen_fd, (struct sockaddr *)&a, &al, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            /* Out of descriptors or memory: the listening socket stays readable, so pause
             * accepting a while rather than spin on it (the backlog holds the newcomers). */
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                FITM_LOG(FITM_LOG_WARN, NULL, "cannot accept a connection: %s", strerror(errno));
                g->accept_after_ns = fitm_clock_ns() + ACCEPT_PAUSE_MS * 1000000;
            }
            return; /* EAGAIN, or an error the next poll reports again */
        }
        int64_t same = 0;
        for (int64_t i = 0; i < g->n; i++)
            same += same_addr(&g->conns[i].addr, &a);
        if (g->n >= g->p.max_pending || same >= g->p.max_per_client) {
            close(fd); /* refused at accept, as libmicrohttpd's own limits do */
            continue;
        }
        g->conns[g->n++] =
            (pending){.fd = fd,
                      .addr = a,
                      .addr_len = al,
                      .deadline_ns = fitm_clock_ns() + g->p.head_timeout_ms * 1000000};
    }
}

static void *gate_main(void *arg)
{
    fitm_gate *g = arg;
    struct pollfd *pf = malloc((size_t)(g->cap + 2) * sizeof *pf);
    int64_t *idx = malloc((size_t)(g->cap + 2) * sizeof *idx);
    if (!pf || !idx) {
        FITM_LOG(FITM_LOG_ERROR, NULL, "gate: out of memory: no connections are accepted");
        free(pf);
        free(idx);
        return NULL;
    }
    while (!g->stop) {
        int64_t now = fitm_clock_ns(), next = now + 1000000000;
        for (int64_t i = g->n - 1; i >= 0; i--) {
            if (g->conns[i].deadline_ns > now) {
                if (g->conns[i].deadline_ns < next)
                    next = g->conns[i].deadline_ns;
                continue;
            }
            if (g->conns[i].closing) {
                drop(g, i);
                continue;
            }
            /* Nothing at all sent: an unused connection, closed without a word. */
            char b;
            if (recv(g->conns[i].fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) <= 0) {
                drop(g, i);
                continue;
            }
            char msg[128];
            snprintf(msg, sizeof msg, "the request head did not arrive within %lld ms",
                     (long long)g->p.head_timeout_ms);
            refuse(g, i, FITM_API_COND_SLOW, msg);
            if (g->conns[i].deadline_ns < next)
                next = g->conns[i].deadline_ns;
        }
        nfds_t k = 0;
        pf[k++] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
        bool listening =
            g->p.listen_fd >= 0 && g->n < g->p.max_pending && now >= g->accept_after_ns;
        if (now < g->accept_after_ns && g->accept_after_ns < next)
            next = g->accept_after_ns;
        if (listening)
            pf[k++] = (struct pollfd){.fd = g->p.listen_fd, .events = POLLIN};
        nfds_t first = k;
        for (int64_t i = 0; i < g->n; i++) {
            idx[k] = i;
            pf[k++] = (struct pollfd){.fd = g->conns[i].fd, .events = POLLIN | POLLRDHUP};
        }
        int64_t wait_ms = (next - now) / 1000000 + 1;
        int rc = poll(pf, k, (int)(wait_ms > 1000 ? 1000 : wait_ms));
        if (rc <= 0)
            continue;
        if (pf[0].revents) {
            char sink[64];
            while (read(g->wake[0], sink, sizeof sink) > 0)
                ;
        }
        /* Connections first, from the end, so dropping one (moving the last into its slot)
         * never moves one not yet looked at. */
        for (nfds_t j = k; j-- > first;)
            if (pf[j].revents)
                on_readable(g, idx[j], pf[j].revents);
        if (listening && pf[1].revents)
            accept_all(g);
    }
    while (g->n > 0)
        drop(g, g->n - 1);
    free(pf);
    free(idx);
    return NULL;
}

fitm_status fitm_gate_start(fitm_gate **out, const fitm_gate_params *p, fitm_err *err)
{
    *out = NULL;
    fitm_gate *g = calloc(1, sizeof *g);
    if (!g)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    g->p = *p;
    g->cap = p->max_pending;
    g->conns = calloc((size_t)g->cap, sizeof *g->conns);
    g->peek = malloc(FITM_FRAME_MAX_HEAD + 1);
    g->wake[0] = g->wake[1] = -1;
    fcntl(p->listen_fd, F_SETFL, fcntl(p->listen_fd, F_GETFL) | O_NONBLOCK);
    if (!g->conns || !g->peek || pipe2(g->wake, O_NONBLOCK | O_CLOEXEC) != 0 ||
        pthread_create(&g->thread, NULL, gate_main, g) != 0) {
        g->p.listen_fd = -1; /* the caller's still */
        if (g->wake[0] >= 0) {
            close(g->wake[0]);
            close(g->wake[1]);
        }
        free(g->conns);
        free(g->peek);
        free(g);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start the connection gate");
    }
    *out = g;
    return FITM_OK;
}

static void poke(fitm_gate *g)
{
    char b = 1;
    (void)!write(g->wake[1], &b, 1);
}

void fitm_gate_stop(fitm_gate *g)
{
    if (!g)
        return;
    g->stop = true;
    poke(g);
    pthread_join(g->thread, NULL);
    if (g->p.listen_fd >= 0)
        close(g->p.listen_fd);
    close(g->wake[0]);
    close(g->wake[1]);
    free(g->conns);
    free(g->peek);
    free(g);
}
