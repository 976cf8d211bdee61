/* download: fetches a file over http(s) with libcurl so that a real network cannot leave a
 * broken model behind: fitmd's model_url and `fitm pull` both use it.
 *
 * The bytes go to PATH.part (with PATH.part.meta holding the URL and the server's validator,
 * so a later run resumes too); a dropped or stalled connection is retried with exponential
 * backoff and resumed with Range + If-Range (a server that ignores the range, or whose file
 * changed meanwhile, answers 200 and the download starts over); the finished file is checked
 * against the SHA-256 when one is given, fsync'ed and renamed to PATH atomically. PATH never
 * holds a partial or unverified file. */
#ifndef FITM_DOWNLOAD_H
#define FITM_DOWNLOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef struct {
    int64_t done;  /* bytes in PATH.part                             */
    int64_t total; /* the whole file's size; -1 while unknown        */
    double rate;   /* bytes/s received since this download started   */
    double eta_s;  /* seconds left at that rate; -1 when unknown     */
    bool final;    /* the last call: the transfer ended (well or not) */
} fitm_download_progress;

typedef struct {
    const char *sha256;        /* expected digest, 64 hex digits; NULL or "": not checked   */
    int retries;               /* further attempts after a transient failure                */
    int64_t stall_s;           /* an attempt below 1 KiB/s for this long is aborted         */
    int64_t connect_timeout_s;
    int64_t backoff_ms;        /* pause before the first retry; doubles, at most 60 s        */
    /* Called at most every 100 ms while bytes arrive, and once with final set. */
    void (*progress)(const fitm_download_progress *p, void *arg);
    void *progress_arg;
    /* Polled while waiting; true stops the download (FITM_ERR_CANCELLED, PATH.part kept). */
    bool (*cancel)(void *arg);
    void *cancel_arg;
} fitm_download_opts;

/* The defaults: no checksum, 5 retries, 30 s stall limit, 30 s connect timeout, 1 s backoff,
 * no callbacks. */
void fitm_download_opts_init(fitm_download_opts *o);

/* Downloads url to path as described above. Blocks until done. Errors name the URL and what
 * failed: FITM_ERR_NOT_FOUND for a 404/410 (not retried), FITM_ERR_FORMAT for a checksum
 * mismatch (PATH.part removed: its bytes are wrong), FITM_ERR_LIMIT when the file system lacks
 * room for the Content-Length (checked before writing), FITM_ERR_INVALID for a malformed
 * sha256 or URL, FITM_ERR_IO when the retries are spent (PATH.part kept for a later resume).
 * curl_global_init must have run before any thread started. */
fitm_status fitm_download(const char *url, const char *path, const fitm_download_opts *o,
                          fitm_err *err);

#endif
