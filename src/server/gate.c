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
#include "server/metrics.h"

/* How long a closing connection is kept after its last answer, reading and dropping what the
 * client still sends, so closing it does not reset the answer away (a close with unread bytes
 * sends RST). */
#define LINGER_MS 2000
/* How long accepting pauses when the process is out of descriptors. */
#define ACCEPT_PAUSE_MS 100
/* How long a stopping gate keeps relaying the answers the server already wrote. */
#define FLUSH_MS 1000
/* A connection's buffers: from the client (room for a whole head past what is still to be
 * passed on) and to it. */
#define IN_CAP (FITM_FRAME_MAX_HEAD + 1 + 16384)
#define OUT_CAP 32768

typedef enum {
    S_HEAD = 0, /* the next bytes are a request head                                      */
    S_BODY,     /* body_left bytes of a Content-Length body                              */
    S_CHUNKS,   /* a chunked body (ch)                                                   */
    S_REFUSING, /* a head was refused: its answer waits for the server's answers before it */
    S_CLOSING,  /* the last answer is out: dropping what arrives until EOF or deadline   */
} cstate;

typedef struct {
    int cfd;    /* the client's socket                                                  */
    int mfd;    /* the gate's end of the pair (-1: none yet, or the server closed)      */
    int mhd_fd; /* the number of the server's end, to match fitm_gate_done (-1: none)    */
    cstate st;
    int64_t deadline_ns; /* S_HEAD: the head's; S_BODY, S_CHUNKS: the next body byte's;
                          * S_CLOSING: the linger's; 0: none                               */
    int64_t stall_ns;    /* out holds bytes: when the client last took some (0: out empty)  */
    uint64_t body_left;
    fitm_frame_chunks ch;
    int64_t forwarded, completed; /* heads passed on; requests the server finished           */
    /* From the client: [0, in_sent) passed on, [in_sent, in_ok) checked and to be passed
     * on, [in_ok, in_len) not checked yet. */
    char *in;
    size_t in_len, in_ok, in_sent;
    char *out; /* to the client: [out_sent, out_len) */
    size_t out_len, out_sent;
    bool c_eof;    /* the client ended its sending                                  */
    bool m_shut;   /* the pair's write side is shut (the server sees the client go) */
    bool m_eof;    /* the server closed its end                                     */
    bool m_quiet;  /* the last read from the server found nothing                   */
    bool mid_body; /* refused inside a body the server has part of                  */
    bool emitted;  /* the refusal's answer is in out                                */
    bool dirty;    /* the server finished a request: look again                     */
    fitm_api_cond cond;
    char msg[160];
    int64_t head_ns; /* when the current head began: accept, or its first byte */
    struct sockaddr_storage addr;
    socklen_t addr_len;
} conn;

struct fitm_gate {
    fitm_gate_params p;
    pthread_t thread;
    int wake[2]; /* a byte on wake[1]: re-read `stop` and the done queue */
    _Atomic bool stop;
    bool stopped; /* the thread was joined */
    conn **conns;
    int64_t n, cap;
    int64_t accept_after_ns; /* accepting paused until then (out of descriptors) */
    pthread_mutex_t mu;      /* guards done */
    int *done;               /* server ends with a finished request, not yet taken */
    int64_t n_done, done_cap;
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
    conn *c = g->conns[i];
    close(c->cfd);
    if (c->mfd >= 0)
        close(c->mfd);
    free(c->in);
    free(c->out);
    free(c);
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
    case 417:
        return "Expectation Failed";
    case 431:
        return "Request Header Fields Too Large";
    case 501:
        return "Not Implemented";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Error";
    }
}

static fitm_api_cond cond_of(int status)
{
    switch (status) {
    case 413:
        return FITM_API_COND_BODY_TOO_LARGE;
    case 414:
        return FITM_API_COND_TARGET_TOO_LONG;
    case 417:
        return FITM_API_COND_EXPECTATION;
    case 431:
        return FITM_API_COND_HEAD_TOO_LARGE;
    case 501:
        return FITM_API_COND_CODING;
    case 505:
        return FITM_API_COND_VERSION;
    default:
        return FITM_API_COND_FRAMING;
    }
}

/* Refuses what the client sends from in_ok on: nothing more is passed on; the answer goes out
 * once the server has answered what it has (emit). */
static void refuse(conn *c, fitm_api_cond cond, const char *msg)
{
    c->mid_body = c->st == S_BODY || c->st == S_CHUNKS;
    c->st = S_REFUSING;
    c->cond = cond;
    snprintf(c->msg, sizeof c->msg, "%s", msg);
    c->in_len = c->in_ok;
    c->deadline_ns = 0;
}

/* Puts the refusal's JSON error (Connection: close) in out and closes the pair. It carries an
 * X-Request-Id, as every answer does (the log line has it), and is counted in /metrics
 * (route "other": the head was not read as far as a route). */
static void emit(fitm_gate *g, conn *c)
{
    fitm_api_error_class k = fitm_api_classify(FITM_ERR_INVALID, c->cond);
    char *json = fitm_api_error_json(&k, c->msg);
    size_t jn = json ? strlen(json) : 0;
    char id[40];
    g->p.new_id(g->p.user, id, sizeof id);
    int hn = snprintf(c->out, OUT_CAP,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: "
                      "%zu\r\nConnection: close\r\nX-Request-Id: %s\r\n"
                      FITM_GATE_SECURITY_HEADERS "\r\n%s",
                      k.http, reason(k.http), jn, id, json ? json : "");
    c->out_len = hn > 0 && hn < OUT_CAP ? (size_t)hn : 0;
    c->out_sent = 0;
    free(json);
    FITM_LOG(FITM_LOG_INFO, id, "refused a request head: %d %s", k.http, c->msg);
    fitm_metrics_request(FITM_ROUTE_OTHER, k.http,
                         (double)(fitm_clock_ns() - c->head_ns) / 1e9);
    c->emitted = true;
    if (c->mfd >= 0)
        close(c->mfd);
    c->mfd = c->mhd_fd = -1;
    c->m_eof = true;
}

/* Bytes from p on hold something other than the CR LF a client may send between requests. */
static bool holds_request(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != '\r' && p[i] != '\n')
            return true;
    return false;
}

static void take_done(fitm_gate *g);

/* The first head of c passed: a socket pair, one end to the server. False when out of
 * descriptors (the connection is then dropped by the caller). */
static bool hand_over(fitm_gate *g, conn *c)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) {
        FITM_LOG(FITM_LOG_WARN, NULL, "cannot relay a connection: %s", strerror(errno));
        g->accept_after_ns = fitm_clock_ns() + ACCEPT_PAUSE_MS * 1000000;
        return false;
    }
    /* The server's end may reuse the number of one it closed: its last fitm_gate_done calls
     * (made before that close) are taken first, and a connection still naming it is told. */
    take_done(g);
    for (int64_t i = 0; i < g->n; i++)
        if (g->conns[i]->mhd_fd == sv[1])
            g->conns[i]->mhd_fd = -1;
    c->mfd = sv[0];
    c->mhd_fd = sv[1];
    g->p.hand(g->p.user, sv[1], (const struct sockaddr *)&c->addr, c->addr_len);
    return true;
}

/* A request body stopped arriving (nothing for idle_timeout_ms while the server waited for
 * it): 408 once the requests before it are answered, and close. */
static void refuse_silent_body(fitm_gate *g, conn *c)
{
    char msg[128];
    snprintf(msg, sizeof msg, "the request body stopped arriving: nothing for %lld ms",
             (long long)g->p.idle_timeout_ms);
    refuse(c, FITM_API_COND_SLOW, msg);
    c->dirty = true;
}

/* Checks what arrived from in_ok on, request by request. False when c must be dropped. */
static bool check(fitm_gate *g, conn *c, int64_t now)
{
    while (c->in_ok < c->in_len) {
        char *p = c->in + c->in_ok;
        size_t n = c->in_len - c->in_ok;
        fitm_frame_error e = {0};
        if (c->st == S_BODY) {
            size_t k = n < c->body_left ? n : (size_t)c->body_left;
            c->in_ok += k;
            c->body_left -= k;
            c->deadline_ns = now + g->p.idle_timeout_ms * 1000000;
            if (!c->body_left) {
                c->st = S_HEAD;
                c->deadline_ns = 0;
            }
            continue;
        }
        if (c->st == S_CHUNKS) {
            size_t used = 0;
            fitm_frame_verdict v = fitm_frame_chunks_scan(&c->ch, p, n, &used, &e);
            c->in_ok += used;
            c->deadline_ns = now + g->p.idle_timeout_ms * 1000000;
            if (v == FITM_FRAME_BAD) {
                refuse(c, cond_of(e.status), e.msg);
            } else if (v == FITM_FRAME_OK) {
                c->st = S_HEAD;
                c->deadline_ns = 0;
            }
            continue;
        }
        if (c->st != S_HEAD)
            return true;
        /* A later head's deadline runs from its first byte (a first head's from accept). */
        if (!c->deadline_ns && holds_request(p, n)) {
            c->deadline_ns = now + g->p.head_timeout_ms * 1000000;
            c->head_ns = now;
        }
        fitm_frame_request req;
        switch (fitm_frame_check_request(p, n, &req, &e)) {
        case FITM_FRAME_INCOMPLETE:
            return true;
        case FITM_FRAME_BAD:
            refuse(c, cond_of(e.status), e.msg);
            return true;
        case FITM_FRAME_OK:
            if (c->mfd < 0 && !c->m_eof && !hand_over(g, c))
                return false;
            c->in_ok += req.head_len;
            c->forwarded++;
            c->body_left = req.length;
            c->st = req.body == FITM_FRAME_BODY_LENGTH    ? S_BODY
                    : req.body == FITM_FRAME_BODY_CHUNKED ? S_CHUNKS
                                                          : S_HEAD;
            c->deadline_ns = c->st == S_HEAD ? 0 : now + g->p.idle_timeout_ms * 1000000;
            memset(&c->ch, 0, sizeof c->ch);
            c->ch.max_total = (uint64_t)g->p.max_body_bytes;
            break;
        }
    }
    return true;
}

static bool soft_error(void)
{
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

/* Reads what the client sent into c->in, or (closing, refusing) reads and discards it.
 * False when connection i was dropped. */
static bool from_client(fitm_gate *g, int64_t i)
{
    conn *c = g->conns[i];
    if (c->st == S_CLOSING || c->st == S_REFUSING) {
        char sink[4096];
        ssize_t r = c->c_eof ? 0 : recv(c->cfd, sink, sizeof sink, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && !soft_error())) {
            if (c->st == S_CLOSING) {
                drop(g, i);
                return false;
            }
            c->c_eof = true;
        }
    } else if (!c->c_eof && c->in_len < IN_CAP) {
        ssize_t r = recv(c->cfd, c->in + c->in_len, IN_CAP - c->in_len, MSG_DONTWAIT);
        if (r == 0) {
            c->c_eof = true;
        } else if (r < 0 && !soft_error()) {
            drop(g, i); /* reset: the server's end is closed too, so it sees the client go */
            return false;
        } else if (r > 0) {
            c->in_len += (size_t)r;
        }
    }
    return true;
}

/* Checks what the client sent; a client gone before sending a request is dropped, one gone
 * inside a request head refused. False when connection i was dropped. */
static bool check_client(fitm_gate *g, int64_t i, int64_t now)
{
    conn *c = g->conns[i];
    if (!check(g, c, now)) {
        drop(g, i);
        return false;
    }
    if (c->c_eof && c->st == S_HEAD && c->in_ok == c->in_len && c->mfd < 0 && !c->m_eof) {
        drop(g, i); /* gone before sending a request */
        return false;
    }
    if (c->c_eof && c->st == S_HEAD && holds_request(c->in + c->in_ok, c->in_len - c->in_ok))
        refuse(c, FITM_API_COND_FRAMING, "the connection ended inside the request head");
    return true;
}

/* Sends the checked bytes on to the server, drops what it took from c->in, and shuts the
 * server's request side once the client's request ends. */
static void to_server(conn *c)
{
    if (c->mfd >= 0 && c->in_sent < c->in_ok) {
        ssize_t r =
            send(c->mfd, c->in + c->in_sent, c->in_ok - c->in_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0)
            c->in_sent += (size_t)r;
        else if (r < 0 && !soft_error())
            c->in_sent = c->in_ok; /* the server closed: its EOF is read below */
    }
    if (c->mfd < 0)
        c->in_sent = c->in_ok;
    if (c->in_sent > 0) {
        memmove(c->in, c->in + c->in_sent, c->in_len - c->in_sent);
        c->in_len -= c->in_sent;
        c->in_ok -= c->in_sent;
        c->in_sent = 0;
    }
    /* The client's end of sending, or a refusal inside a body, ends the server's request: it
     * sees its client go (and stops the request's job). */
    if (c->mfd >= 0 && !c->m_shut && c->in_sent == c->in_ok &&
        (c->c_eof || (c->st == S_REFUSING && c->mid_body))) {
        shutdown(c->mfd, SHUT_WR);
        c->m_shut = true;
    }
}

/* Reads what the server answered into c->out; closes the server's end at its EOF. */
static void from_server(fitm_gate *g, conn *c, int64_t now)
{
    c->m_quiet = false;
    if (c->mfd >= 0 && !c->m_eof && c->out_len < OUT_CAP) {
        ssize_t r = recv(c->mfd, c->out + c->out_len, OUT_CAP - c->out_len, MSG_DONTWAIT);
        if (r > 0)
            c->out_len += (size_t)r;
        else if (r == 0 || !soft_error())
            c->m_eof = true;
        else
            c->m_quiet = true;
    }
    if (c->m_eof && c->mfd >= 0) {
        /* The server calls fitm_gate_done before it closes: take its last calls now, or this
         * connection would look as if the server left requests unanswered. */
        take_done(g);
        close(c->mfd);
        c->mfd = c->mhd_fd = -1;
        /* The server gave up on a body that stopped arriving (its idle timeout, the same as
         * the gate's body deadline): the client is told as if the gate's deadline passed. */
        if ((c->st == S_BODY || c->st == S_CHUNKS) && c->deadline_ns &&
            now >= c->deadline_ns - 1000000000)
            refuse_silent_body(g, c);
    }
}

/* Sends what c->out holds on to the client, noting since when it takes none. False when
 * connection i was dropped. */
static bool to_client(fitm_gate *g, int64_t i, int64_t now)
{
    conn *c = g->conns[i];
    if (c->out_sent < c->out_len) {
        ssize_t r = send(c->cfd, c->out + c->out_sent, c->out_len - c->out_sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0 && !soft_error()) {
            drop(g, i);
            return false;
        }
        if (r > 0 || !c->stall_ns)
            c->stall_ns = now;
        if (r > 0)
            c->out_sent += (size_t)r;
        if (c->out_sent == c->out_len)
            c->out_len = c->out_sent = 0;
        else if (c->out_sent > OUT_CAP / 2) {
            memmove(c->out, c->out + c->out_sent, c->out_len - c->out_sent);
            c->out_len -= c->out_sent;
            c->out_sent = 0;
        }
    }
    return true;
}

/* The server closed (after Connection: close, an idle timeout, or the refusal) and everything
 * it said is out: ends connection i (before: the requests a refusal waits on). */
static void close_when_answered(fitm_gate *g, int64_t i, int64_t now, int64_t before)
{
    conn *c = g->conns[i];
    if (c->mfd < 0 && c->m_eof && c->out_len == 0 && c->st != S_CLOSING &&
        (c->st != S_REFUSING || c->emitted || c->completed < before)) {
        if (c->c_eof) {
            drop(g, i);
            return;
        }
        shutdown(c->cfd, SHUT_WR);
        int one = 1;
        setsockopt(c->cfd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
        c->st = S_CLOSING;
        c->deadline_ns = now + (int64_t)LINGER_MS * 1000000;
    }
}

/* Moves what can move on connection i, both ways, and advances its state. */
static void pump(fitm_gate *g, int64_t i, int64_t now)
{
    conn *c = g->conns[i];
    c->dirty = false;
    if (!from_client(g, i) || !check_client(g, i, now))
        return;
    to_server(c);
    from_server(g, c, now);
    /* A refusal's answer, once the server answered every request before it. A refusal inside a
     * body leaves its own request unanswered by the server (the body never completes), so only
     * those before it count. */
    const int64_t before = c->forwarded - (c->st == S_REFUSING && c->mid_body);
    if (c->st == S_REFUSING && !c->emitted && c->completed >= before &&
        c->out_sent == c->out_len && (c->m_quiet || c->mfd < 0))
        emit(g, c);
    if (!to_client(g, i, now))
        return;
    /* A refusal waiting only for the server's last bytes to be read: look again at once (the
     * read finds more, or nothing and the answer goes out). */
    if (c->out_len == 0)
        c->stall_ns = 0;
    c->dirty = c->st == S_REFUSING && !c->emitted && c->completed >= before && c->out_len == 0;
    close_when_answered(g, i, now, before);
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
            same += same_addr(&g->conns[i]->addr, &a);
        conn *c = NULL;
        if (g->n < g->p.max_conns && same < g->p.max_per_client)
            c = calloc(1, sizeof *c);
        if (c) {
            c->in = malloc(IN_CAP);
            c->out = malloc(OUT_CAP);
        }
        if (!c || !c->in || !c->out) {
            if (c) {
                free(c->in);
                free(c->out);
                free(c);
            }
            close(fd); /* refused at accept, as libmicrohttpd's own limits do */
            continue;
        }
        c->cfd = fd;
        c->mfd = c->mhd_fd = -1;
        c->addr = a;
        c->addr_len = al;
        c->head_ns = fitm_clock_ns();
        c->deadline_ns = c->head_ns + g->p.head_timeout_ms * 1000000;
        g->conns[g->n++] = c;
    }
}

/* Takes the requests the server finished (fitm_gate_done) into their connections' counts. */
static void take_done(fitm_gate *g)
{
    pthread_mutex_lock(&g->mu);
    for (int64_t k = 0; k < g->n_done; k++)
        for (int64_t i = 0; i < g->n; i++)
            if (g->conns[i]->mhd_fd == g->done[k]) {
                g->conns[i]->completed++;
                g->conns[i]->dirty = true;
                break;
            }
    g->n_done = 0;
    pthread_mutex_unlock(&g->mu);
}

void fitm_gate_done(fitm_gate *g, int fd)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    if (g->n_done == g->done_cap) {
        /* Out of memory, the call is lost: a refusal waiting on it then ends with the
         * connection, unanswered, when the server closes it. */
        int64_t cap = 2 * g->done_cap;
        int *grown = realloc(g->done, (size_t)cap * sizeof *grown);
        if (grown) {
            g->done = grown;
            g->done_cap = cap;
        }
    }
    if (g->n_done < g->done_cap)
        g->done[g->n_done++] = fd;
    pthread_mutex_unlock(&g->mu);
    char b = 1;
    (void)!write(g->wake[1], &b, 1);
}

/* A head's deadline passed: 408, or for a connection that never sent a request byte, a
 * silent close. False when c was dropped. */
static bool head_overdue(fitm_gate *g, int64_t i)
{
    conn *c = g->conns[i];
    if (c->forwarded == 0 && !holds_request(c->in + c->in_ok, c->in_len - c->in_ok)) {
        drop(g, i); /* an unused connection (bytes are read as they come: none came) */
        return false;
    }
    char msg[128];
    snprintf(msg, sizeof msg, "the request head did not arrive within %lld ms",
             (long long)g->p.head_timeout_ms);
    refuse(c, FITM_API_COND_SLOW, msg);
    c->dirty = true;
    return true;
}

/* One pass of a stopping gate: the server answered every request before the stop, and what
 * it wrote is relayed for up to FLUSH_MS, dropping each connection once nothing of it is
 * left. True when the gate is done. */
static bool flush_pass(fitm_gate *g, int64_t now, int64_t *flush_until)
{
    if (!*flush_until)
        *flush_until = now + (int64_t)FLUSH_MS * 1000000;
    for (int64_t i = g->n - 1; i >= 0; i--) {
        pump(g, i, now);
        if (i < g->n && g->conns[i]->out_len == 0 &&
            (g->conns[i]->mfd < 0 || g->conns[i]->m_quiet))
            drop(g, i);
    }
    return g->n == 0 || now >= *flush_until;
}

/* Acts on the connections whose client stalled an answer or whose deadline passed. */
static void enforce_deadlines(fitm_gate *g, int64_t now)
{
    for (int64_t i = g->n - 1; i >= 0; i--) {
        conn *c = g->conns[i];
        if (c->stall_ns && now - c->stall_ns >= g->p.idle_timeout_ms * 1000000) {
            FITM_LOG(FITM_LOG_INFO, NULL,
                     "closing a connection whose client took none of its answer for %lld ms",
                     (long long)g->p.idle_timeout_ms);
            drop(g, i); /* the server's end closes too: a job still streaming stops */
            continue;
        }
        if (c->deadline_ns && c->deadline_ns <= now) {
            if (c->st == S_CLOSING) {
                drop(g, i);
                continue;
            }
            if (c->st == S_HEAD && !head_overdue(g, i))
                continue;
            if (c->st == S_BODY || c->st == S_CHUNKS) {
                /* Silent because the server has not read what came (it is still busy with
                 * an earlier request, or the buffer is full): not the client's delay. */
                if (c->completed < c->forwarded - 1 || c->in_ok > c->in_sent ||
                    c->in_len == IN_CAP)
                    c->deadline_ns = now + g->p.idle_timeout_ms * 1000000;
                else
                    refuse_silent_body(g, c);
            }
        }
    }
}

/* Fills pf with what to wait for: the wake pipe, the listening socket (when listening), and
 * each connection's two ends (their slots in at[2i], at[2i + 1], -1 for none). Lowers *next
 * to the nearest deadline and sets *any_dirty when a connection must be pumped at once.
 * Returns the number of pollfds. */
static nfds_t poll_set(fitm_gate *g, struct pollfd *pf, int64_t *at, bool listening,
                       int64_t *next, bool *any_dirty)
{
    nfds_t k = 0;
    pf[k++] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
    if (listening)
        pf[k++] = (struct pollfd){.fd = g->p.listen_fd, .events = POLLIN};
    for (int64_t i = 0; i < g->n; i++) {
        conn *c = g->conns[i];
        if (c->deadline_ns && c->deadline_ns < *next)
            *next = c->deadline_ns;
        if (c->stall_ns && c->stall_ns + g->p.idle_timeout_ms * 1000000 < *next)
            *next = c->stall_ns + g->p.idle_timeout_ms * 1000000;
        *any_dirty |= c->dirty;
        short ce = 0, me = 0;
        if (c->st == S_CLOSING || (!c->c_eof && (c->st == S_REFUSING || c->in_len < IN_CAP)))
            ce |= POLLIN;
        if (c->out_sent < c->out_len)
            ce |= POLLOUT;
        if (c->mfd >= 0 && !c->m_eof && c->out_len < OUT_CAP)
            me |= POLLIN;
        if (c->mfd >= 0 && c->in_sent < c->in_ok)
            me |= POLLOUT;
        at[2 * i] = at[2 * i + 1] = -1;
        if (ce) {
            at[2 * i] = (int64_t)k;
            pf[k++] = (struct pollfd){.fd = c->cfd, .events = ce};
        }
        if (me) {
            at[2 * i + 1] = (int64_t)k;
            pf[k++] = (struct pollfd){.fd = c->mfd, .events = me};
        }
    }
    return k;
}

static void *gate_main(void *arg)
{
    fitm_gate *g = arg;
    struct pollfd *pf = malloc((size_t)(2 * g->cap + 2) * sizeof *pf);
    int64_t *at = malloc((size_t)(2 * g->cap) * sizeof *at); /* conn i's pollfds: at[2i], +1 */
    if (!pf || !at) {
        FITM_LOG(FITM_LOG_ERROR, NULL, "gate: out of memory: no connections are accepted");
        free(pf);
        free(at);
        return NULL;
    }
    int64_t flush_until = 0; /* stopping: answers still relayed until then */
    for (;;) {
        take_done(g);
        int64_t now = fitm_clock_ns(), next = now + 1000000000;
        if (g->stop) {
            if (flush_pass(g, now, &flush_until))
                break;
            next = now + 10000000;
        }
        enforce_deadlines(g, now);
        bool any_dirty = false;
        bool listening =
            !g->stop && g->p.listen_fd >= 0 && g->n < g->p.max_conns && now >= g->accept_after_ns;
        if (now < g->accept_after_ns && g->accept_after_ns < next)
            next = g->accept_after_ns;
        nfds_t k = poll_set(g, pf, at, listening, &next, &any_dirty);
        int64_t wait_ms = any_dirty ? 0 : (next - now) / 1000000 + 1;
        int rc = poll(pf, k, (int)(wait_ms > 1000 ? 1000 : wait_ms));
        if (rc < 0)
            continue;
        if (pf[0].revents) {
            char sink[64];
            while (read(g->wake[0], sink, sizeof sink) > 0)
                ;
        }
        /* Connections first, from the end, so dropping one (moving the last into its slot)
         * never moves one not yet looked at. */
        now = fitm_clock_ns();
        for (int64_t i = g->n - 1; i >= 0; i--)
            if (g->conns[i]->dirty || (at[2 * i] >= 0 && pf[at[2 * i]].revents) ||
                (at[2 * i + 1] >= 0 && pf[at[2 * i + 1]].revents))
                pump(g, i, now);
        if (listening && rc > 0 && pf[1].revents)
            accept_all(g);
    }
    while (g->n > 0)
        drop(g, g->n - 1);
    free(pf);
    free(at);
    return NULL;
}

/* What a gate holds besides its thread and connections: the wake pipe, the lists, the lock. */
static void gate_release(fitm_gate *g)
{
    if (g->wake[0] >= 0) {
        close(g->wake[0]);
        close(g->wake[1]);
    }
    free(g->conns);
    free(g->done);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

fitm_status fitm_gate_start(fitm_gate **out, const fitm_gate_params *p, fitm_err *err)
{
    *out = NULL;
    fitm_gate *g = calloc(1, sizeof *g);
    if (!g)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    g->p = *p;
    g->cap = p->max_conns;
    g->conns = calloc((size_t)g->cap, sizeof *g->conns);
    g->done_cap = 256;
    g->done = malloc((size_t)g->done_cap * sizeof *g->done);
    pthread_mutex_init(&g->mu, NULL);
    g->wake[0] = g->wake[1] = -1;
    fcntl(p->listen_fd, F_SETFL, fcntl(p->listen_fd, F_GETFL) | O_NONBLOCK);
    /* *out is set before the thread starts: the connections it hands over may complete, and
     * read *out (fitm_gate_done), before pthread_create returns here */
    *out = g;
    if (!g->conns || !g->done || pipe2(g->wake, O_NONBLOCK | O_CLOEXEC) != 0 ||
        pthread_create(&g->thread, NULL, gate_main, g) != 0) {
        *out = NULL;
        g->p.listen_fd = -1; /* the caller's still */
        gate_release(g);
        return fitm_err_set(err, FITM_ERR_INTERNAL, "cannot start the connection gate");
    }
    return FITM_OK;
}

void fitm_gate_stop(fitm_gate *g)
{
    if (!g || g->stopped)
        return;
    g->stop = true;
    char b = 1;
    (void)!write(g->wake[1], &b, 1);
    pthread_join(g->thread, NULL);
    if (g->p.listen_fd >= 0)
        close(g->p.listen_fd);
    g->stopped = true;
}

void fitm_gate_free(fitm_gate *g)
{
    if (!g)
        return;
    fitm_gate_stop(g);
    gate_release(g);
}
