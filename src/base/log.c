#include "base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

fitm_log_level fitm_log_threshold = FITM_LOG_INFO;

static const char *names[] = {"debug", "info", "warn", "error"};

int fitm_log_parse_level(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, names[i]))
            return i;
    return -1;
}

void fitm_log_write(fitm_log_level lvl, const char *req, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);

    char line[1400];
    size_t n = (size_t)snprintf(line, sizeof line,
                                "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s%s%s msg=\"",
                                tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                                tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                                names[lvl < 0 || lvl > 3 ? 3 : lvl], req ? " req=" : "",
                                req ? req : "");
    if (n > sizeof line - 8)
        n = sizeof line - 8;
    /* Escape the message so one event stays one line. */
    for (const char *p = msg; *p && n + 4 < sizeof line; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\') {
            line[n++] = '\\';
            line[n++] = (char)c;
        } else if (c == '\n') {
            line[n++] = '\\';
            line[n++] = 'n';
        } else if (c < 0x20) {
            line[n++] = ' ';
        } else {
            line[n++] = (char)c;
        }
    }
    line[n++] = '"';
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, n); /* one write: lines from threads never interleave */
    (void)w;
}
