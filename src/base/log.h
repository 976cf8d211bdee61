/* log: one greppable line per event on stderr, logfmt
 *   2026-11-22T05:40:01.123Z level=info req=7f3a... msg="..."
 * or, with fitm_log_json, one JSON object per line (for log collectors)
 *   {"time":"2026-11-22T05:40:01.123Z","level":"info","req":"7f3a...","msg":"..."}
 * FITM_LOG checks the level before evaluating its arguments. Thread-safe (one write per line). */
#ifndef FITM_LOG_H
#define FITM_LOG_H

#include <stdbool.h>

typedef enum { FITM_LOG_DEBUG = 0, FITM_LOG_INFO, FITM_LOG_WARN, FITM_LOG_ERROR } fitm_log_level;

extern fitm_log_level fitm_log_threshold;
extern bool fitm_log_json; /* set once at start, before any thread logs */

/* Parses "debug|info|warn|error"; returns -1 when unknown. */
int fitm_log_parse_level(const char *s);

/* Writes one line; req may be NULL. fmt is the message (quoted and escaped in the output);
 * use fitm_logf for free-form key=value tails. */
void fitm_log_write(fitm_log_level lvl, const char *req, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FITM_LOG(lvl, req, ...)                                                                    \
    do {                                                                                           \
        if ((lvl) >= fitm_log_threshold)                                                           \
            fitm_log_write((lvl), (req), __VA_ARGS__);                                             \
    } while (0)

#endif
