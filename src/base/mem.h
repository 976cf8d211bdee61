/* mem: zeroed, aligned buffers for large working memory (KV caches, logits, scratch).
 *
 * Large buffers are mapped pages of their own: fresh pages read as zero without being written,
 * so a buffer costs resident memory only for the pages that have been used (a KV cache sized
 * for the whole context holds only the rows a request filled), and freeing one returns it to
 * the system at once. malloc would keep a freed large block in its heap once it raised its
 * mmap threshold, so a server's resident size would grow to the high-water mark of its
 * requests and stay there. Small buffers come from the C library.
 *
 * Thread-safe (as malloc is). */
#ifndef FITM_MEM_H
#define FITM_MEM_H

#include <stddef.h>

/* Buffers of at least this many bytes are mapped pages. */
#define FITM_MEM_MAP_MIN ((size_t)1 << 20)

/* n bytes (0 allowed) aligned to align (a power of two, at most 4096), all zero; NULL when
 * out of memory. Release with fitm_mem_free. */
void *fitm_mem_alloc_zeroed(size_t n, size_t align);

/* NULL is a no-op. */
void fitm_mem_free(void *p);

/* Asks the kernel to back a mapped buffer (one of at least FITM_MEM_MAP_MIN bytes) with huge
 * pages where it can (transparent huge pages in "madvise" mode; a no-op where they are off or
 * for a small buffer). For buffers read through from end to end, such as packed weights:
 * fewer TLB misses. Not for a KV cache, whose pages become resident as rows are written: with
 * 2 MiB pages a short request would hold far more memory than it used. */
void fitm_mem_hugepages(void *p);

#endif
