#include "base/download.h"

#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/sha256.h"

#define PATH_BYTES 4096
#define VALIDATOR_BYTES 256

void fitm_download_opts_init(fitm_download_opts *o)
{
    memset(o, 0, sizeof *o);
    o->retries = 5;
    o->stall_s = 30;
    o->connect_timeout_s = 30;
    o->backoff_ms = 1000;
}

/* One download: the .part file and what the responses said. */
typedef struct {
    const char *url;
    const char *shown; /* url as logged and in errors: no user:password@, ?query or #fragment */
    char url_hex[65];  /* url's SHA-256: what the meta file keeps of it (url_digest) */
    const char *part;
    const fitm_download_opts *o;
    int fd;
    int64_t have;                    /* bytes in the .part file                          */
    char validator[VALIDATOR_BYTES]; /* what If-Range sends: strong ETag or Last-Modified */
    /* the current response, reset at each status line (redirects have several) */
    long status;
    int64_t content_length;          /* -1: none                                           */
    int64_t range_start, range_total; /* Content-Range; -1: none                           */
    char etag[VALIDATOR_BYTES], last_modified[VALIDATOR_BYTES];
    bool body_started;               /* the response's first body bytes were seen          */
    int64_t total;                   /* the whole file's size; -1 unknown                  */
    /* what went wrong inside a callback (curl only sees "write error") */
    fitm_status fail;
    fitm_err fail_err;
    /* progress */
    int64_t received;                /* bytes received since fitm_download began           */
    int64_t t_start_ns, t_report_ns;
} xfer;

/* url without what may be a secret (user:password@, a signed ?query, a #fragment), for the log
 * and error messages: "https://host/path/m.gguf?..." */
static void redact_url(const char *url, char *out, size_t n)
{
    const char *host = strstr(url, "://");
    host = host ? host + 3 : url;
    size_t auth_len = strcspn(host, "/?#");
    const char *at = memchr(host, '@', auth_len);
    const char *rest = at ? at + 1 : host;
    size_t keep = strcspn(rest, "?#");
    snprintf(out, n, "%.*s%s%.*s%s", (int)(host - url), url, at ? "***@" : "", (int)keep, rest,
             rest[keep] ? "?..." : "");
}

static void report(xfer *x, bool final)
{
    if (!x->o->progress)
        return;
    int64_t now = fitm_clock_ns();
    if (!final && now - x->t_report_ns < 100 * 1000 * 1000)
        return;
    x->t_report_ns = now;
    double secs = (double)(now - x->t_start_ns) / 1e9;
    fitm_download_progress p = {.done = x->have, .total = x->total, .final = final};
    p.rate = secs > 0 ? (double)x->received / secs : 0;
    p.eta_s = x->total >= 0 && p.rate > 0 ? (double)(x->total - x->have) / p.rate : -1;
    x->o->progress(&p, x->o->progress_arg);
}

/* "name: value" when the header line is name (case-insensitive): the value, trimmed into
 * out; false otherwise. */
static bool header_value(const char *line, size_t n, const char *name, char *out, size_t cap)
{
    size_t k = strlen(name);
    if (n <= k || strncasecmp(line, name, k) || line[k] != ':')
        return false;
    const char *v = line + k + 1, *end = line + n;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && isspace((unsigned char)end[-1]))
        end--;
    size_t len = (size_t)(end - v) < cap - 1 ? (size_t)(end - v) : cap - 1;
    memcpy(out, v, len);
    out[len] = '\0';
    return true;
}

static bool body_begins(xfer *x);

static size_t on_header(char *line, size_t size, size_t n, void *arg)
{
    xfer *x = arg;
    n *= size;
    char v[VALIDATOR_BYTES];
    if (n > 5 && !strncmp(line, "HTTP/", 5)) { /* a new response (after a redirect or 100) */
        const char *sp = memchr(line, ' ', n);
        x->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        x->content_length = x->range_start = x->range_total = -1;
        x->etag[0] = x->last_modified[0] = '\0';
    } else if (header_value(line, n, "content-length", v, sizeof v)) {
        x->content_length = strtoll(v, NULL, 10);
    } else if (header_value(line, n, "content-range", v, sizeof v)) {
        long long a, b, t;
        if (sscanf(v, "bytes %lld-%lld/%lld", &a, &b, &t) == 3) {
            x->range_start = a;
            x->range_total = t;
        } else if (sscanf(v, "bytes */%lld", &t) == 1) {
            x->range_total = t; /* 416's: the size the range did not fit */
        }
    } else if (header_value(line, n, "etag", x->etag, sizeof x->etag)) {
    } else if (header_value(line, n, "last-modified", x->last_modified,
                            sizeof x->last_modified)) {
    } else if ((n == 2 && line[0] == '\r') || (n == 1 && line[0] == '\n')) {
        /* the end of a response's headers: a 2xx's body follows; decide (and check the
         * room) before the first byte, so a file that cannot fit is refused at once */
        if (x->status >= 200 && x->status <= 299 && !x->body_started && !body_begins(x))
            return 0;
    }
    return n;
}

/* The SHA-256 of url in hex: what the meta file keeps of it, since a URL may carry a secret
 * (user:password@, a signed query). */
static void url_digest(const char *url, char hex[65])
{
    fitm_sha256 s;
    uint8_t d[32];
    fitm_sha256_init(&s);
    fitm_sha256_update(&s, url, strlen(url));
    fitm_sha256_final(&s, d);
    fitm_sha256_hex(d, hex);
}

/* Writes the meta file (the url's digest and the validator), so a later process can resume
 * with If-Range. */
static void meta_write(const xfer *x)
{
    char meta[PATH_BYTES + 8];
    snprintf(meta, sizeof meta, "%s.meta", x->part);
    FILE *f = fopen(meta, "w");
    if (!f)
        return; /* resuming across processes is an optimisation */
    fprintf(f, "%s\n%s\n", x->url_hex, x->validator);
    fclose(f);
}

/* The validator stored for url by an earlier run into x->validator; false when none. */
static bool meta_read(xfer *x)
{
    char meta[PATH_BYTES + 8], line[PATH_BYTES];
    snprintf(meta, sizeof meta, "%s.meta", x->part);
    FILE *f = fopen(meta, "r");
    if (!f)
        return false;
    bool ok = fgets(line, sizeof line, f) && (line[strcspn(line, "\n")] = '\0', 1) &&
              !strcmp(line, x->url_hex) && fgets(x->validator, sizeof x->validator, f);
    fclose(f);
    x->validator[strcspn(x->validator, "\n")] = '\0';
    if (!ok)
        x->validator[0] = '\0';
    return ok && x->validator[0];
}

/* The first body bytes of a response: decides where they go. A 206 continues the .part file
 * at its end; a 200 replaces it (the server ignored the range, or the file changed and
 * If-Range did not match). Checks the room on the file system for what is still to come. */
static bool body_begins(xfer *x)
{
    x->body_started = true;
    if (x->status == 206) {
        if (x->range_start != x->have) {
            x->validator[0] = '\0'; /* the next attempt starts over */
            x->fail = fitm_err_set(&x->fail_err, FITM_ERR_IO,
                                   "%s: the server resumed at byte %lld, not %lld", x->shown,
                                   (long long)x->range_start, (long long)x->have);
            return false;
        }
        x->total = x->range_total;
    } else {
        if (x->have > 0)
            FITM_LOG(FITM_LOG_INFO, NULL,
                     "download %s: the server sent the whole file (no range support, or the "
                     "file changed): starting over", x->shown);
        if (ftruncate(x->fd, 0) != 0 || lseek(x->fd, 0, SEEK_SET) != 0) {
            x->fail = fitm_err_set(&x->fail_err, FITM_ERR_IO, "cannot truncate %s: %s",
                                   x->part, strerror(errno));
            return false;
        }
        x->have = 0;
        x->total = x->content_length;
        /* the validator of this copy, for If-Range on a later attempt; a weak ETag may not
         * be used there (RFC 9110, 13.1.5) */
        const char *v = x->etag[0] && strncmp(x->etag, "W/", 2) ? x->etag : x->last_modified;
        snprintf(x->validator, sizeof x->validator, "%s", v);
        meta_write(x);
    }
    if (x->total >= 0) {
        char dir[PATH_BYTES];
        snprintf(dir, sizeof dir, "%s", x->part);
        struct statvfs vs;
        int64_t need = x->total - x->have;
        if (statvfs(dirname(dir), &vs) == 0 &&
            (int64_t)vs.f_bavail * (int64_t)vs.f_frsize < need) {
            x->fail = fitm_err_set(&x->fail_err, FITM_ERR_LIMIT,
                                   "%s: not enough disk space: %lld bytes to download, %lld "
                                   "free", x->part, (long long)need,
                                   (long long)vs.f_bavail * (long long)vs.f_frsize);
            return false;
        }
    }
    return true;
}

static size_t on_body(char *data, size_t size, size_t n, void *arg)
{
    xfer *x = arg;
    n *= size;
    if (x->status < 200 || x->status > 299)
        return n; /* an error page: read and dropped, the status tells */
    if (!x->body_started && !body_begins(x))
        return 0;
    for (size_t at = 0; at < n;) {
        ssize_t w = write(x->fd, data + at, n - at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            x->fail = fitm_err_set(&x->fail_err, errno == ENOSPC ? FITM_ERR_LIMIT : FITM_ERR_IO,
                                   "writing %s: %s", x->part, strerror(errno));
            return 0;
        }
        at += (size_t)w;
    }
    x->have += (int64_t)n;
    x->received += (int64_t)n;
    report(x, false);
    return n;
}

static int on_xferinfo(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    const xfer *x = arg;
    return x->o->cancel && x->o->cancel(x->o->cancel_arg);
}

/* One request. FITM_OK when the file is complete; *transient says whether another attempt may
 * do better. */
static fitm_status attempt(xfer *x, bool *transient, fitm_err *err)
{
    *transient = false;
    CURL *c = curl_easy_init();
    if (!c)
        return fitm_err_set(err, FITM_ERR_NOMEM, "cannot start libcurl");
    char cerr[CURL_ERROR_SIZE] = "", range[64], if_range[VALIDATOR_BYTES + 16];
    struct curl_slist *hdr = NULL;
    bool resume = x->have > 0 && x->validator[0];
    if (resume) {
        snprintf(range, sizeof range, "Range: bytes=%lld-", (long long)x->have);
        snprintf(if_range, sizeof if_range, "If-Range: %s", x->validator);
        hdr = curl_slist_append(hdr, range);
        hdr = curl_slist_append(hdr, if_range);
    }
    x->status = 0;
    x->body_started = false;
    x->fail = FITM_OK;
    curl_easy_setopt(c, CURLOPT_URL, x->url);
#if LIBCURL_VERSION_NUM >= 0x075500
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
#endif
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_xferinfo);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, x);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, (long)x->o->connect_timeout_s);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, (long)x->o->stall_s);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* threads: no SIGALRM for DNS timeouts */
    curl_easy_setopt(c, CURLOPT_USERAGENT, "fitm/download");
    CURLcode rc = curl_easy_perform(c);
    curl_easy_cleanup(c);
    curl_slist_free_all(hdr);

    if (x->fail != FITM_OK) { /* our own verdict from a callback (disk room, write error) */
        *err = x->fail_err;
        *transient = x->fail == FITM_ERR_IO;
        return x->fail;
    }
    if (rc == CURLE_ABORTED_BY_CALLBACK)
        return fitm_err_set(err, FITM_ERR_CANCELLED, "download %s cancelled", x->shown);
    if (rc == CURLE_UNSUPPORTED_PROTOCOL || rc == CURLE_URL_MALFORMAT)
        return fitm_err_set(err, FITM_ERR_INVALID, "download %s: %s", x->shown,
                            cerr[0] ? cerr : curl_easy_strerror(rc));
    if (x->status == 416 && x->range_total == x->have)
        return FITM_OK; /* the .part file already held every byte */
    if (x->status == 404 || x->status == 410)
        return fitm_err_set(err, FITM_ERR_NOT_FOUND, "download %s: HTTP %ld (not found)", x->shown,
                            x->status);
    if (x->status == 416) { /* our range does not fit the file (it shrank): start over */
        x->validator[0] = '\0';
        *transient = true;
        return fitm_err_set(err, FITM_ERR_IO, "download %s: HTTP 416 for bytes %lld-", x->shown,
                            (long long)x->have);
    }
    if (rc == CURLE_OK && (x->status < 200 || x->status > 299)) {
        /* 408, 429 and 5xx may pass; other 4xx are the request's fault */
        *transient = x->status == 408 || x->status == 429 || x->status >= 500;
        return fitm_err_set(err, x->status == 401 || x->status == 403 ? FITM_ERR_INVALID
                                                                      : FITM_ERR_IO,
                            "download %s: HTTP %ld", x->shown, x->status);
    }
    if (rc == CURLE_OK && x->total >= 0 && x->have != x->total)
        rc = CURLE_PARTIAL_FILE;
    if (rc != CURLE_OK) {
        *transient = true;
        return fitm_err_set(err, FITM_ERR_IO, "download %s: %s (%lld of %lld bytes)", x->shown,
                            rc == CURLE_OPERATION_TIMEDOUT ? "stalled" :
                            cerr[0] ? cerr : curl_easy_strerror(rc),
                            (long long)x->have, (long long)x->total);
    }
    if (!x->body_started && !body_begins(x)) { /* an empty 200 */
        *err = x->fail_err;
        return x->fail;
    }
    return FITM_OK;
}

/* Sleeps ms, polling the cancel callback. False when cancelled. */
static bool pause_ms(const fitm_download_opts *o, int64_t ms)
{
    for (int64_t left = ms; left > 0; left -= 50) {
        if (o->cancel && o->cancel(o->cancel_arg))
            return false;
        struct timespec ts = {0, (left < 50 ? left : 50) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return !(o->cancel && o->cancel(o->cancel_arg));
}

static fitm_status check_sha256(xfer *x, const char *want, fitm_err *err)
{
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = malloc(CHUNK);
    if (!buf)
        return fitm_err_set(err, FITM_ERR_NOMEM, "no memory to check %s", x->part);
    fitm_sha256 s;
    fitm_sha256_init(&s);
    for (off_t at = 0;;) {
        ssize_t r = pread(x->fd, buf, CHUNK, at);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(buf);
            return fitm_err_set(err, FITM_ERR_IO, "reading %s: %s", x->part, strerror(errno));
        }
        if (r == 0)
            break;
        fitm_sha256_update(&s, buf, (size_t)r);
        at += r;
    }
    free(buf);
    uint8_t d[32];
    char got[65];
    fitm_sha256_final(&s, d);
    fitm_sha256_hex(d, got);
    if (strcasecmp(got, want))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "download %s: sha256 mismatch: got %s, expected %s", x->shown, got,
                            want);
    return FITM_OK;
}

static void remove_part(const xfer *x)
{
    char meta[PATH_BYTES + 8];
    snprintf(meta, sizeof meta, "%s.meta", x->part);
    unlink(x->part);
    unlink(meta);
}

/* fsync of the directory holding path, so the rename survives a crash. */
static void sync_dir(const char *path)
{
    char dir[PATH_BYTES];
    snprintf(dir, sizeof dir, "%s", path);
    int fd = open(dirname(dir), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

fitm_status fitm_download(const char *url, const char *path, const fitm_download_opts *o,
                          fitm_err *err)
{
    if (o->sha256 && o->sha256[0]) {
        if (strlen(o->sha256) != 64 || strspn(o->sha256, "0123456789abcdefABCDEF") != 64)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "sha256 must be 64 hexadecimal digits, not '%s'", o->sha256);
    }
    char part[PATH_BYTES];
    if (snprintf(part, sizeof part, "%s.part", path) >= (int)sizeof part - 8)
        return fitm_err_set(err, FITM_ERR_INVALID, "download path too long");
    char shown[PATH_BYTES];
    redact_url(url, shown, sizeof shown);
    xfer x = {.url = url, .shown = shown, .part = part, .o = o, .total = -1,
              .t_start_ns = fitm_clock_ns()};
    url_digest(url, x.url_hex);
    x.fd = open(part, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (x.fd < 0)
        return fitm_err_set(err, FITM_ERR_IO, "cannot write %s: %s", part, strerror(errno));
    if (flock(x.fd, LOCK_EX | LOCK_NB) != 0) {
        close(x.fd);
        return fitm_err_set(err, FITM_ERR_BUSY, "%s is being written by another download",
                            part);
    }
    struct stat sb;
    x.have = fstat(x.fd, &sb) == 0 ? (int64_t)sb.st_size : 0;
    if (x.have > 0 && !meta_read(&x)) {
        FITM_LOG(FITM_LOG_INFO, NULL, "download %s: %s holds %lld bytes of unknown origin: "
                 "starting over", shown, part, (long long)x.have);
        x.have = 0;
    }
    if (x.have == 0 && ftruncate(x.fd, 0) != 0) {
        close(x.fd);
        return fitm_err_set(err, FITM_ERR_IO, "cannot truncate %s: %s", part, strerror(errno));
    }
    lseek(x.fd, x.have, SEEK_SET);
    if (x.have > 0)
        FITM_LOG(FITM_LOG_INFO, NULL, "download %s: resuming at byte %lld", shown,
                 (long long)x.have);
    else
        FITM_LOG(FITM_LOG_INFO, NULL, "downloading %s to %s", shown, path);

    fitm_status st = FITM_ERR_IO;
    int64_t backoff = o->backoff_ms;
    for (int i = 0;; i++) {
        bool transient;
        st = attempt(&x, &transient, err);
        if (st == FITM_OK || !transient || i >= o->retries)
            break;
        /* where the file really ends (a failed write may have left part of a chunk) */
        x.have = fstat(x.fd, &sb) == 0 ? (int64_t)sb.st_size : 0;
        lseek(x.fd, x.have, SEEK_SET);
        FITM_LOG(FITM_LOG_WARN, NULL, "%s; retry %d of %d in %.1f s", err->msg, i + 1,
                 o->retries, (double)backoff / 1000);
        if (!pause_ms(o, backoff)) {
            st = fitm_err_set(err, FITM_ERR_CANCELLED, "download %s cancelled", shown);
            break;
        }
        backoff = backoff * 2 > 60000 ? 60000 : backoff * 2;
    }
    report(&x, true);
    if (st == FITM_OK && fsync(x.fd) != 0)
        st = fitm_err_set(err, FITM_ERR_IO, "fsync %s: %s", part, strerror(errno));
    if (st == FITM_OK && o->sha256 && o->sha256[0] &&
        (st = check_sha256(&x, o->sha256, err)) != FITM_OK)
        remove_part(&x); /* wrong bytes: resuming from them could never succeed */
    if (st == FITM_OK) {
        if (rename(part, path) != 0) {
            st = fitm_err_set(err, FITM_ERR_IO, "cannot rename %s to %s: %s", part, path,
                              strerror(errno));
        } else {
            sync_dir(path);
            char meta[PATH_BYTES + 8];
            snprintf(meta, sizeof meta, "%s.meta", part);
            unlink(meta);
            FITM_LOG(FITM_LOG_INFO, NULL, "downloaded %s (%lld bytes%s)", path,
                     (long long)x.have, o->sha256 && o->sha256[0] ? ", sha256 verified" : "");
        }
    } else if (st != FITM_ERR_FORMAT && x.have == 0) {
        remove_part(&x); /* nothing worth resuming */
    }
    close(x.fd);
    return st;
}
