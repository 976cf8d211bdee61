/* mem: see mem.h. Every buffer is preceded by one alignment unit whose last bytes are a header:
 * how the buffer was obtained and, for mapped pages, the mapping's base and length, so
 * fitm_mem_free needs only the pointer. */
#include "base/mem.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define PAGE 4096
#define MAGIC_HEAP 0x6669746d68656170ull /* "fitmheap" */
#define MAGIC_MAP 0x6669746d6d617070ull  /* "fitmmapp" */

typedef struct {
    uint64_t magic;
    size_t map_bytes; /* the mapping's length (MAGIC_MAP)        */
    void *base;       /* what malloc or mmap returned             */
} header;

static header *header_of(void *p)
{
    return (header *)((char *)p - sizeof(header));
}

void *fitm_mem_alloc_zeroed(size_t n, size_t align)
{
    if (align < 32) /* room for the header */
        align = 32;
    if (align > PAGE || (align & (align - 1)) != 0 || n > SIZE_MAX - 2 * PAGE)
        return NULL;
    if (n >= FITM_MEM_MAP_MIN) {
        const size_t len = (n + align + PAGE - 1) / PAGE * PAGE;
        void *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED)
            return NULL;
        char *p = (char *)base + align; /* base is page-aligned, so p is align-aligned */
        *header_of(p) = (header){MAGIC_MAP, len, base};
        return p;
    }
    char *base = aligned_alloc(align, (n + 2 * align - 1) / align * align);
    if (!base)
        return NULL;
    char *p = base + align;
    memset(p, 0, n);
    *header_of(p) = (header){MAGIC_HEAP, 0, base};
    return p;
}

void fitm_mem_hugepages(void *p)
{
    if (!p)
        return;
    const header h = *header_of(p);
    if (h.magic == MAGIC_MAP)
        (void)madvise(h.base, h.map_bytes, MADV_HUGEPAGE);
}

void fitm_mem_free(void *p)
{
    if (!p)
        return;
    const header h = *header_of(p);
    if (h.magic == MAGIC_MAP) {
        munmap(h.base, h.map_bytes);
    } else if (h.magic == MAGIC_HEAP) {
        header_of(p)->magic = 0; /* a second free aborts below instead of corrupting the heap */
        free(h.base);
    } else {
        abort(); /* not a fitm_mem buffer, or one freed twice: memory is corrupt */
    }
}
