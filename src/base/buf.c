#include "base/buf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool fitm_buf_reserve(fitm_buf *b, size_t n_bytes)
{
    if (b->failed)
        return false;
    if (b->cap >= n_bytes)
        return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < n_bytes)
        cap = cap > SIZE_MAX / 2 ? n_bytes : cap * 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

bool fitm_buf_append(fitm_buf *b, const void *src, size_t n)
{
    if (b->failed || n > SIZE_MAX - 1 - b->len) {
        b->failed = true;
        return false;
    }
    if (!fitm_buf_reserve(b, b->len + n + 1))
        return false;
    if (src)
        memcpy(b->p + b->len, src, n);
    else
        memset(b->p + b->len, 0, n);
    b->len += n;
    b->p[b->len] = '\0';
    return true;
}

bool fitm_buf_printf(fitm_buf *b, const char *fmt, ...)
{
    for (;;) {
        if (!fitm_buf_reserve(b, b->len + 1))
            return false;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = true;
            return false;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return true;
        }
        if (!fitm_buf_reserve(b, b->len + (size_t)n + 1))
            return false;
    }
}

void fitm_buf_clear(fitm_buf *b)
{
    b->len = 0;
    b->failed = false;
    if (b->p)
        b->p[0] = '\0';
}

void fitm_buf_free(fitm_buf *b)
{
    free(b->p);
    *b = (fitm_buf){0};
}
