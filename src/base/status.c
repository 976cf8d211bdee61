#include "base/status.h"

#include <stdio.h>
#include <string.h>

const char *fitm_status_name(fitm_status s)
{
    static const char *names[FITM_STATUS_COUNT] = {
        [FITM_OK] = "ok",
        [FITM_ERR_INVALID] = "invalid",
        [FITM_ERR_FORMAT] = "format",
        [FITM_ERR_UNSUPPORTED] = "unsupported",
        [FITM_ERR_NOT_FOUND] = "not_found",
        [FITM_ERR_LIMIT] = "limit",
        [FITM_ERR_NOMEM] = "nomem",
        [FITM_ERR_IO] = "io",
        [FITM_ERR_BUSY] = "busy",
        [FITM_ERR_TIMEOUT] = "timeout",
        [FITM_ERR_CANCELLED] = "cancelled",
        [FITM_ERR_BACKEND] = "backend",
        [FITM_ERR_INTERNAL] = "internal",
        [FITM_ERR_CONTEXT] = "context",
    };
    if ((unsigned)s >= FITM_STATUS_COUNT)
        return "unknown";
    return names[s];
}

fitm_status fitm_err_set(fitm_err *err, fitm_status s, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return s;
}

void fitm_err_prefix(fitm_err *err, const char *fmt, ...)
{
    if (!err)
        return;
    char old[FITM_ERR_MSG_BYTES];
    memcpy(old, err->msg, sizeof old);
    old[sizeof old - 1] = '\0';
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof err->msg - 1)
        return; /* the prefix alone fills the buffer */
    /* Truncation of the old message is acceptable: the prefix is the more specific part. */
    size_t used = (size_t)n, room = sizeof err->msg - used;
    size_t olen = strlen(old);
    if (room > 2) {
        memcpy(err->msg + used, ": ", 2);
        used += 2;
        room -= 2;
        size_t k = olen < room - 1 ? olen : room - 1;
        memcpy(err->msg + used, old, k);
        err->msg[used + k] = '\0';
    }
}
