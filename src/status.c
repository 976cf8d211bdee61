#include "status.h"

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
    char prefix[FITM_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    char old[FITM_ERR_MSG_BYTES];
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", prefix, old);
}
