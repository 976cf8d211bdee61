/* status: the one status enum every fitm function returns, and the error detail that goes with it.
 *
 * Convention: a function that can fail returns fitm_status and, when given a non-NULL
 * fitm_err *, writes one human-readable sentence there naming what was wrong (the key, the
 * tensor, the field, the value). FITM_OK leaves the fitm_err untouched. */
#ifndef FITM_STATUS_H
#define FITM_STATUS_H

#include <stdarg.h>

typedef enum {
    FITM_OK = 0,
    FITM_ERR_INVALID,     /* bad argument or request (caller's fault)             */
    FITM_ERR_FORMAT,      /* malformed input file or data                         */
    FITM_ERR_UNSUPPORTED, /* well-formed, but a feature/type we do not implement  */
    FITM_ERR_NOT_FOUND,   /* a key, tensor, route or file that is not there       */
    FITM_ERR_LIMIT,       /* over a configured or published limit                 */
    FITM_ERR_NOMEM,       /* allocation failed                                    */
    FITM_ERR_IO,          /* open/read/mmap/network failure                       */
    FITM_ERR_BUSY,        /* queue full; try again later                          */
    FITM_ERR_TIMEOUT,     /* deadline passed                                      */
    FITM_ERR_CANCELLED,   /* the client went away                                 */
    FITM_ERR_BACKEND,     /* device/library failure (CUDA, BLAS)                  */
    FITM_ERR_INTERNAL,    /* a bug: should never happen                           */
    FITM_ERR_CONTEXT,     /* a request's prompt is longer than the context window */
    FITM_STATUS_COUNT
} fitm_status;

#define FITM_ERR_MSG_BYTES 512

typedef struct {
    char msg[FITM_ERR_MSG_BYTES];
} fitm_err;

/* Short stable name of a status ("ok", "invalid", "format", ...). Never NULL. */
const char *fitm_status_name(fitm_status s);

/* Formats a message into err (if err is non-NULL) and returns s, so callers can write
 *     return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s': ...", name);           */
fitm_status fitm_err_set(fitm_err *err, fitm_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends "prefix: " to the message already in err (no-op for NULL err). */
void fitm_err_prefix(fitm_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
