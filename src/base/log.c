#include "base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

fitm_log_level fitm_log_threshold = FITM_LOG_INFO;
bool fitm_log_json = false;

static const char *names[] = {"debug", "info", "warn", "error"};

int fitm_log_parse_level(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, names[i]))
            return i;
    return -1;
}

/* Appends msg to line[*n, cap - 2) escaped for a logfmt quoted value (json false: control
 * characters but \n become spaces) or a JSON string (json true: control characters as \u00XX,
 * bytes that are not UTF-8 as U+FFFD); stops at a character that does not fit. */
static void put_escaped(char *line, size_t *n, size_t cap, const char *msg, bool json)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = *n;
    for (const unsigned char *p = (const unsigned char *)msg; *p;) {
        char e[8];
        size_t k = 0, used = 1;
        unsigned c = *p;
        if (c == '"' || c == '\\') {
            e[k++] = '\\';
            e[k++] = (char)c;
        } else if (c == '\n') {
            e[k++] = '\\';
            e[k++] = 'n';
        } else if (c < 0x20) {
            if (json) {
                memcpy(e, "\\u00", 4);
                k = 4;
                e[k++] = hex[c >> 4];
                e[k++] = hex[c & 15];
            } else {
                e[k++] = ' ';
            }
        } else if (c < 0x80 || !json) {
            e[k++] = (char)c;
        } else {
            /* A UTF-8 sequence is copied whole; anything else becomes U+FFFD. */
            size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
                       : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
            size_t i = 1;
            while (i < len && (p[i] & 0xC0) == 0x80)
                i++;
            if (len && i == len) {
                memcpy(e, p, len);
                k = used = len;
            } else {
                memcpy(e, "\xef\xbf\xbd", 3);
                k = 3;
            }
        }
        if (o + k > cap - 2)
            break;
        memcpy(line + o, e, k);
        o += k;
        p += used;
    }
    *n = o;
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
    char when[64];
    snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
             ts.tv_nsec / 1000000);
    const char *level = names[lvl < 0 || lvl > 3 ? 3 : lvl];

    /* req is an id fitmd made or a client's plain one (letters, digits, - _ .): written as it
     * is in both formats. */
    char line[1400];
    int h = fitm_log_json
                ? snprintf(line, sizeof line, "{\"time\":\"%s\",\"level\":\"%s\"%s%.64s%s,\"msg\":\"",
                           when, level, req ? ",\"req\":\"" : "", req ? req : "", req ? "\"" : "")
                : snprintf(line, sizeof line, "%s level=%s%s%.64s msg=\"", when, level,
                           req ? " req=" : "", req ? req : "");
    size_t n = (size_t)h;
    put_escaped(line, &n, sizeof line - 2, msg, fitm_log_json);
    line[n++] = '"';
    if (fitm_log_json)
        line[n++] = '}';
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, n); /* one write: lines from threads never interleave */
    (void)w;
}
