/* buf: the one growable byte buffer. Text builders (metrics, SSE events, generated text),
 * binary writers (GGUF) and typed scratch arrays all grow through it.
 *
 * Zero-initialize to start ({0}); fitm_buf_free releases. Growth doubles the capacity (at
 * least 256 bytes), so n appends cost O(n) copies. After an allocation failure the buffer is
 * "failed": it keeps what it had, later appends do nothing and return false, so a writer can
 * append freely and check once at the end. Appends keep p NUL-terminated (p[len] == 0) for
 * text; the terminator is not counted in len. Not thread-safe. */
#ifndef FITM_BUF_H
#define FITM_BUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    char *p; /* len bytes of content, then a NUL (once anything was appended) */
    size_t len;
    size_t cap;  /* bytes allocated at p                                        */
    bool failed; /* an allocation failed                                        */
} fitm_buf;

/* Makes cap >= n_bytes without changing the content. False (and failed) when out of memory. */
bool fitm_buf_reserve(fitm_buf *b, size_t n_bytes);

/* Appends n bytes from src (src NULL: n zero bytes). False when failed. */
bool fitm_buf_append(fitm_buf *b, const void *src, size_t n);

/* Appends printf-formatted text. False when failed or on a formatting error. */
bool fitm_buf_printf(fitm_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Forgets the content, keeps the memory (and clears failed). */
void fitm_buf_clear(fitm_buf *b);

/* Releases the memory and zeroes b. */
void fitm_buf_free(fitm_buf *b);

#endif
