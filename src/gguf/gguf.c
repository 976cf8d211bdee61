/* gguf: validating GGUF v2/v3 reader. Every length and count read from the file is checked
 * against the bytes that remain before it is used, so a hostile file can only ever produce an
 * error message. Layout (all little-endian):
 *
 *   header   "GGUF" u32 version, u64 n_tensors, u64 n_kv
 *   n_kv  x  string key, u32 value type, value
 *   n_tensors x string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset
 *   padding  to general.alignment, then the data section (offsets are relative to it)
 *
 * where string = u64 length + bytes and an array value = u32 element type, u64 count, elements. */
#include "gguf/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32u
/* Smallest encodings, used to bound counts by the bytes left before allocating for them. */
#define MIN_KV_BYTES 14u /* u64 key length, >= 1 key byte, u32 type, >= 1 value byte */
#define MIN_TENSOR_BYTES                                                                           \
    33u /* u64 name length, >= 1 name byte, u32 n_dims, one u64 dim, u32 type, u64 offset */

struct fitm_gguf {
    const uint8_t *base; /* the file's bytes (mapping or caller buffer) */
    size_t size;
    bool mapped;
    bool owned; /* base is a private malloc'd copy of the file (fitm_gguf_open_copy) */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_start; /* byte offset of the data section */

    int64_t n_kv;
    fitm_gguf_kv *kvs;
    uint64_t **str_offs;            /* per kv: for string arrays, file offset of each element */
    const fitm_gguf_kv **kv_sorted; /* by key, for binary search */

    int64_t n_tensors;
    fitm_gguf_tensor *tensors;
    const fitm_gguf_tensor **t_sorted; /* by name */
};

/* ---------------------------------------------------------------------------------------- */
/* Bounds-checked cursor. */

typedef struct {
    const uint8_t *p;
    size_t size;
    size_t pos;
} cursor;

static size_t cur_left(const cursor *c)
{
    return c->size - c->pos;
}

static bool cur_u32(cursor *c, uint32_t *v)
{
    if (cur_left(c) < 4)
        return false;
    memcpy(v, c->p + c->pos, 4);
    c->pos += 4;
    return true;
}

static bool cur_u64(cursor *c, uint64_t *v)
{
    if (cur_left(c) < 8)
        return false;
    memcpy(v, c->p + c->pos, 8);
    c->pos += 8;
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Type tables. */

static const char *const type_names[FITM_GGUF_TYPE_COUNT] = {
    [FITM_GGUF_UINT8] = "uint8",     [FITM_GGUF_INT8] = "int8",     [FITM_GGUF_UINT16] = "uint16",
    [FITM_GGUF_INT16] = "int16",     [FITM_GGUF_UINT32] = "uint32", [FITM_GGUF_INT32] = "int32",
    [FITM_GGUF_FLOAT32] = "float32", [FITM_GGUF_BOOL] = "bool",     [FITM_GGUF_STRING] = "string",
    [FITM_GGUF_ARRAY] = "array",     [FITM_GGUF_UINT64] = "uint64", [FITM_GGUF_INT64] = "int64",
    [FITM_GGUF_FLOAT64] = "float64",
};

static const uint8_t type_sizes[FITM_GGUF_TYPE_COUNT] = {
    [FITM_GGUF_UINT8] = 1,   [FITM_GGUF_INT8] = 1,  [FITM_GGUF_UINT16] = 2,  [FITM_GGUF_INT16] = 2,
    [FITM_GGUF_UINT32] = 4,  [FITM_GGUF_INT32] = 4, [FITM_GGUF_FLOAT32] = 4, [FITM_GGUF_BOOL] = 1,
    [FITM_GGUF_STRING] = 0,  [FITM_GGUF_ARRAY] = 0, [FITM_GGUF_UINT64] = 8,  [FITM_GGUF_INT64] = 8,
    [FITM_GGUF_FLOAT64] = 8,
};

const char *fitm_gguf_type_name(fitm_gguf_type t)
{
    if ((unsigned)t >= FITM_GGUF_TYPE_COUNT)
        return "unknown";
    return type_names[t];
}

size_t fitm_gguf_type_size(fitm_gguf_type t)
{
    if ((unsigned)t >= FITM_GGUF_TYPE_COUNT)
        return 0;
    return type_sizes[t];
}

/* Smallest encoding of one element of type t (t already validated). */
static uint64_t min_elem_bytes(fitm_gguf_type t)
{
    if (t == FITM_GGUF_STRING)
        return 8;
    if (t == FITM_GGUF_ARRAY)
        return 12;
    return type_sizes[t];
}

/* GGML tensor type names fitm does not read, so a rejection can say what the file holds. */
static const char *foreign_tensor_type_name(uint32_t id)
{
    static const char *const names[] = {
        [3] = "Q4_1",     [7] = "Q5_1",    [9] = "Q8_1",     [10] = "Q2_K",  [11] = "Q3_K",
        [16] = "IQ2_XXS", [17] = "IQ2_XS", [18] = "IQ3_XXS", [19] = "IQ1_S", [20] = "IQ4_NL",
        [21] = "IQ3_S",   [22] = "IQ2_S",  [23] = "IQ4_XS",  [24] = "I8",    [25] = "I16",
        [26] = "I32",     [27] = "I64",    [28] = "F64",     [29] = "IQ1_M", [34] = "TQ1_0",
        [35] = "TQ2_0",   [39] = "MXFP4",
    };
    if (id < sizeof names / sizeof names[0] && names[id])
        return names[id];
    return "unknown";
}

/* ---------------------------------------------------------------------------------------- */
/* Parsing. */

/* Copies len bytes at p into a new NUL-terminated string; NULL on allocation failure. */
static char *copy_name(const uint8_t *p, uint64_t len)
{
    char *s = malloc((size_t)len + 1);
    if (s) {
        memcpy(s, p, (size_t)len);
        s[len] = '\0';
    }
    return s;
}

/* Reads a u64 length and checks that many bytes follow. what/who describe it for messages. */
static fitm_status read_len(cursor *c, uint64_t *len, fitm_err *err, const char *what,
                            const char *who)
{
    size_t at = c->pos;
    if (!cur_u64(c, len))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "%s: file truncated at byte %zu reading the %s length", who, at, what);
    if (*len > cur_left(c))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "%s: %s length %" PRIu64
                            " at byte %zu runs past the end of the file (%zu bytes left)",
                            who, what, *len, at, cur_left(c));
    return FITM_OK;
}

/* Validates the value of type t at the cursor and moves past it. depth counts the arrays
 * enclosing this value. When offs is non-NULL and the value is an array of strings, the file
 * offset of each element is stored there (the caller allocated arr_n entries). */
static fitm_status skip_value(cursor *c, fitm_gguf_type t, int depth, const char *key,
                              uint64_t *offs, fitm_err *err)
{
    if (t == FITM_GGUF_STRING) {
        uint64_t len = 0;
        fitm_status st = read_len(c, &len, err, "string", key);
        if (st != FITM_OK)
            return st;
        c->pos += (size_t)len;
        return FITM_OK;
    }
    if (t != FITM_GGUF_ARRAY) {
        size_t sz = type_sizes[t];
        if (cur_left(c) < sz)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "key '%s': file truncated at byte %zu reading a %s value", key,
                                c->pos, type_names[t]);
        if (t == FITM_GGUF_BOOL && c->p[c->pos] > 1)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "key '%s': bool value %u at byte %zu is neither 0 nor 1", key,
                                c->p[c->pos], c->pos);
        c->pos += sz;
        return FITM_OK;
    }

    if (depth >= FITM_GGUF_MAX_NESTING)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s': arrays nested more than %d deep at byte %zu", key,
                            FITM_GGUF_MAX_NESTING, c->pos);
    size_t at = c->pos;
    uint32_t et;
    uint64_t n;
    if (!cur_u32(c, &et) || !cur_u64(c, &n))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s': file truncated at byte %zu reading an array header", key,
                            at);
    if (et >= FITM_GGUF_TYPE_COUNT)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s': unknown array element type %" PRIu32 " at byte %zu", key, et,
                            at);
    uint64_t min = min_elem_bytes((fitm_gguf_type)et);
    if (n > cur_left(c) / min)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s': array count %" PRIu64
                            " at byte %zu needs more than the %zu bytes left",
                            key, n, at + 4, cur_left(c));
    if (et != FITM_GGUF_STRING && et != FITM_GGUF_ARRAY && et != FITM_GGUF_BOOL) {
        c->pos += (size_t)(n * min);
        return FITM_OK;
    }
    for (uint64_t i = 0; i < n; i++) {
        if (offs && et == FITM_GGUF_STRING)
            offs[i] = c->pos;
        fitm_status st = skip_value(c, (fitm_gguf_type)et, depth + 1, key, NULL, err);
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

static int cmp_kv(const void *a, const void *b)
{
    const fitm_gguf_kv *x = *(const fitm_gguf_kv *const *)a, *y = *(const fitm_gguf_kv *const *)b;
    return strcmp(x->key, y->key);
}

static int cmp_tensor_name(const void *a, const void *b)
{
    const fitm_gguf_tensor *x = *(const fitm_gguf_tensor *const *)a;
    const fitm_gguf_tensor *y = *(const fitm_gguf_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    const fitm_gguf_tensor *x = *(const fitm_gguf_tensor *const *)a;
    const fitm_gguf_tensor *y = *(const fitm_gguf_tensor *const *)b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

static fitm_status parse_header(fitm_gguf *g, cursor *c, uint64_t *n_tensors, uint64_t *n_kv,
                                fitm_err *err)
{
    if (c->size < 4 || memcmp(c->p, GGUF_MAGIC, 4) != 0)
        return fitm_err_set(err, FITM_ERR_FORMAT, "bad magic: not a GGUF file");
    c->pos = 4;
    if (!cur_u32(c, &g->version))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "file truncated at byte 4 reading the GGUF version");
    if (g->version == 1)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "GGUF version 1 is not supported (only versions 2 and 3)");
    if (g->version != 2 && g->version != 3)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "unsupported GGUF version %" PRIu32 "%s (only versions 2 and 3)",
                            g->version, (g->version & 0xffffu) == 0 ? ", a big-endian file?" : "");
    if (!cur_u64(c, n_tensors) || !cur_u64(c, n_kv))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "file truncated at byte %zu reading the tensor and key/value counts",
                            c->pos);
    size_t left = cur_left(c);
    if (*n_kv > left / MIN_KV_BYTES)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "metadata key/value count %" PRIu64
                            " is impossible in the %zu bytes after the header",
                            *n_kv, left);
    left -= (size_t)(*n_kv * MIN_KV_BYTES);
    if (*n_tensors > left / MIN_TENSOR_BYTES)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor count %" PRIu64
                            " is impossible in the %zu bytes after the header and metadata",
                            *n_tensors, cur_left(c));
    return FITM_OK;
}

static fitm_status parse_kvs(fitm_gguf *g, cursor *c, fitm_err *err)
{
    for (int64_t i = 0; i < g->n_kv; i++) {
        fitm_gguf_kv *kv = &g->kvs[i];
        char who[64];
        snprintf(who, sizeof who, "metadata entry %" PRId64, i);
        uint64_t len = 0;
        fitm_status st = read_len(c, &len, err, "key", who);
        if (st != FITM_OK)
            return st;
        if (len == 0)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "metadata entry %" PRId64 " at byte %zu has an empty key", i,
                                c->pos - 8);
        if (len > FITM_GGUF_MAX_KEY)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "metadata entry %" PRId64 " key is %" PRIu64
                                " bytes long (at most %d)",
                                i, len, FITM_GGUF_MAX_KEY);
        if (memchr(c->p + c->pos, '\0', (size_t)len))
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "metadata entry %" PRId64 " key at byte %zu contains a NUL byte", i,
                                c->pos);
        char *key = copy_name(c->p + c->pos, len);
        if (!key)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory copying a metadata key");
        kv->key = key;
        c->pos += (size_t)len;

        size_t at = c->pos;
        uint32_t t;
        if (!cur_u32(c, &t))
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "key '%s': file truncated at byte %zu reading the value type", key,
                                at);
        if (t >= FITM_GGUF_TYPE_COUNT)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "key '%s': unknown value type %" PRIu32 " at byte %zu", key, t, at);
        kv->type = (fitm_gguf_type)t;
        uint64_t *offs = NULL;
        if (kv->type == FITM_GGUF_ARRAY) {
            /* Peek at the array header so the value pointer can skip it and a string array
             * gets its offset table; skip_value re-reads and validates the header. */
            uint32_t et = 0;
            uint64_t n = 0;
            cursor peek = *c;
            if (cur_u32(&peek, &et) && cur_u64(&peek, &n) && et < FITM_GGUF_TYPE_COUNT) {
                kv->arr_type = (fitm_gguf_type)et;
                kv->arr_n = n;
                kv->value = c->p + peek.pos;
                if (et == FITM_GGUF_STRING && n <= cur_left(&peek) / 8 && n > 0) {
                    offs = malloc((size_t)n * sizeof *offs);
                    if (!offs)
                        return fitm_err_set(
                            err, FITM_ERR_NOMEM,
                            "key '%s': out of memory for %" PRIu64 " string offsets", key, n);
                    g->str_offs[i] = offs;
                }
            }
        } else {
            kv->value = c->p + c->pos;
        }
        st = skip_value(c, kv->type, 0, key, offs, err);
        if (st != FITM_OK)
            return st;
    }
    return FITM_OK;
}

static fitm_status check_alignment(fitm_gguf *g, fitm_err *err)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "general.alignment");
    if (!kv)
        return FITM_OK;
    if (kv->type != FITM_GGUF_UINT32)
        return fitm_err_set(err, FITM_ERR_FORMAT, "general.alignment has type %s, expected uint32",
                            fitm_gguf_type_name(kv->type));
    uint32_t a;
    memcpy(&a, kv->value, 4);
    if (a == 0 || (a & (a - 1)) != 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "general.alignment %" PRIu32 " is not a nonzero power of two", a);
    g->alignment = a;
    return FITM_OK;
}

static fitm_status parse_tensor_info(fitm_gguf *g, cursor *c, int64_t i, fitm_err *err)
{
    fitm_gguf_tensor *t = &g->tensors[i];
    char who[64];
    snprintf(who, sizeof who, "tensor %" PRId64, i);
    uint64_t len = 0;
    fitm_status st = read_len(c, &len, err, "name", who);
    if (st != FITM_OK)
        return st;
    if (len == 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor %" PRId64 " at byte %zu has an empty name", i, c->pos - 8);
    if (len > FITM_GGUF_MAX_NAME)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor %" PRId64 " name at byte %zu is %" PRIu64
                            " bytes long (at most %d)",
                            i, c->pos, len, FITM_GGUF_MAX_NAME);
    if (memchr(c->p + c->pos, '\0', (size_t)len))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor %" PRId64 " name at byte %zu contains a NUL byte", i, c->pos);
    char *name = copy_name(c->p + c->pos, len);
    if (!name)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory copying a tensor name");
    t->name = name;
    c->pos += (size_t)len;

    uint32_t n_dims;
    size_t at = c->pos;
    if (!cur_u32(c, &n_dims))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': file truncated at byte %zu reading n_dims", name, at);
    if (n_dims < 1 || n_dims > FITM_GGUF_MAX_DIMS)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': n_dims %" PRIu32 " is outside 1..%d", name, n_dims,
                            FITM_GGUF_MAX_DIMS);
    t->n_dims = (int32_t)n_dims;
    uint64_t n_elems = 1;
    for (int d = 0; d < FITM_GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        at = c->pos;
        if (d < (int)n_dims && !cur_u64(c, &ne))
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "tensor '%s': file truncated at byte %zu reading dimension %d",
                                name, at, d);
        if (ne == 0)
            return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s': dimension %d is 0", name, d);
        if (ne > (uint64_t)INT64_MAX / n_elems)
            return fitm_err_set(
                err, FITM_ERR_FORMAT,
                "tensor '%s': element count overflows at dimension %d (%" PRIu64 ")", name, d, ne);
        n_elems *= ne;
        t->ne[d] = (int64_t)ne;
    }
    t->n_elems = (int64_t)n_elems;

    uint32_t type;
    at = c->pos;
    if (!cur_u32(c, &type))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': file truncated at byte %zu reading its type", name, at);
    const fitm_dtype_info *info = type < FITM_DTYPE_MAX ? fitm_dtype_info_of((int)type) : NULL;
    if (!info)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "tensor '%s': tensor type id %" PRIu32 " (%s) is not one fitm reads",
                            name, type, foreign_tensor_type_name(type));
    t->type = (fitm_dtype)type;
    if (t->ne[0] % info->block_elems != 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': ne[0] = %" PRId64
                            " is not a multiple of the %s block size %d",
                            name, t->ne[0], info->name, (int)info->block_elems);
    /* blocks * block bytes, overflow-checked by division (n_elems >= 1). */
    uint64_t blocks = n_elems / (uint64_t)info->block_elems;
    if (blocks > UINT64_MAX / (uint64_t)info->block_bytes)
        return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s': byte size overflows", name);
    t->n_bytes = blocks * (uint64_t)info->block_bytes;

    at = c->pos;
    if (!cur_u64(c, &t->offset))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': file truncated at byte %zu reading its data offset", name,
                            at);
    if (t->offset % g->alignment != 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': data offset %" PRIu64
                            " is not a multiple of the alignment %" PRIu32,
                            name, t->offset, g->alignment);
    return FITM_OK;
}

static fitm_status parse_tensors(fitm_gguf *g, cursor *c, fitm_err *err)
{
    for (int64_t i = 0; i < g->n_tensors; i++) {
        fitm_status st = parse_tensor_info(g, c, i, err);
        if (st != FITM_OK)
            return st;
    }
    /* The data section starts at the next multiple of the alignment; pos <= size < 2^63. */
    uint64_t pos = c->pos;
    g->data_start = (pos + g->alignment - 1) / g->alignment * g->alignment;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        fitm_gguf_tensor *t = &g->tensors[i];
        if (g->data_start > g->size || t->offset > g->size - g->data_start ||
            t->n_bytes > g->size - g->data_start - t->offset)
            return fitm_err_set(
                err, FITM_ERR_FORMAT,
                "tensor '%s': data at offset %" PRIu64 " (+%" PRIu64
                " bytes) runs past the end of the file (%zu bytes, data section at byte %" PRIu64
                ")",
                t->name, t->offset, t->n_bytes, g->size, g->data_start);
        t->data = g->base + g->data_start + t->offset;
    }
    return FITM_OK;
}

/* Sorted key index for lookups; sorting also makes the duplicate check cheap. */
static fitm_status build_kv_index(fitm_gguf *g, fitm_err *err)
{
    size_t n_kv = (size_t)g->n_kv;
    g->kv_sorted = malloc((n_kv ? n_kv : 1) * sizeof *g->kv_sorted);
    if (!g->kv_sorted)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory indexing %zu keys", n_kv);
    for (size_t i = 0; i < n_kv; i++)
        g->kv_sorted[i] = &g->kvs[i];
    qsort(g->kv_sorted, n_kv, sizeof *g->kv_sorted, cmp_kv);
    for (size_t i = 1; i < n_kv; i++)
        if (strcmp(g->kv_sorted[i - 1]->key, g->kv_sorted[i]->key) == 0)
            return fitm_err_set(err, FITM_ERR_FORMAT, "duplicate metadata key '%s'",
                                g->kv_sorted[i]->key);
    return FITM_OK;
}

/* Sorted name index (duplicates) and a by-offset order (overlaps). */
static fitm_status build_tensor_indexes(fitm_gguf *g, fitm_err *err)
{
    fitm_status st = FITM_OK;
    size_t n_t = (size_t)g->n_tensors;
    const fitm_gguf_tensor **by_off = malloc((n_t ? n_t : 1) * sizeof *by_off);
    g->t_sorted = malloc((n_t ? n_t : 1) * sizeof *g->t_sorted);
    if (!by_off || !g->t_sorted) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory indexing %zu tensors", n_t);
        goto done;
    }
    for (size_t i = 0; i < n_t; i++)
        g->t_sorted[i] = by_off[i] = &g->tensors[i];
    qsort(g->t_sorted, n_t, sizeof *g->t_sorted, cmp_tensor_name);
    for (size_t i = 1; i < n_t; i++)
        if (strcmp(g->t_sorted[i - 1]->name, g->t_sorted[i]->name) == 0) {
            st = fitm_err_set(err, FITM_ERR_FORMAT, "duplicate tensor name '%s'",
                              g->t_sorted[i]->name);
            goto done;
        }
    qsort(by_off, n_t, sizeof *by_off, cmp_tensor_offset);
    for (size_t i = 1; i < n_t; i++) {
        const fitm_gguf_tensor *a = by_off[i - 1], *b = by_off[i];
        if (b->offset - a->offset < a->n_bytes) {
            st = fitm_err_set(err, FITM_ERR_FORMAT,
                              "tensors '%s' and '%s' overlap (data offsets %" PRIu64 " +%" PRIu64
                              " and %" PRIu64 ")",
                              a->name, b->name, a->offset, a->n_bytes, b->offset);
            goto done;
        }
    }
done:
    free(by_off);
    return st;
}

static fitm_status parse(fitm_gguf *g, fitm_err *err)
{
    cursor c = {g->base, g->size, 0};
    uint64_t n_tensors = 0, n_kv = 0;
    fitm_status st = parse_header(g, &c, &n_tensors, &n_kv, err);
    if (st != FITM_OK)
        return st;
    /* Both counts are bounded by the file size here, so these allocations are too. */
    g->n_kv = (int64_t)n_kv;
    g->n_tensors = (int64_t)n_tensors;
    g->kvs = calloc(n_kv ? n_kv : 1, sizeof *g->kvs);
    g->str_offs = calloc(n_kv ? n_kv : 1, sizeof *g->str_offs);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->kvs || !g->str_offs || !g->tensors)
        return fitm_err_set(err, FITM_ERR_NOMEM,
                            "out of memory for %" PRIu64 " keys and %" PRIu64 " tensors", n_kv,
                            n_tensors);
    st = parse_kvs(g, &c, err);
    if (st == FITM_OK)
        st = build_kv_index(g, err);
    if (st == FITM_OK)
        st = check_alignment(g, err);
    if (st == FITM_OK)
        st = parse_tensors(g, &c, err);
    if (st == FITM_OK)
        st = build_tensor_indexes(g, err);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Open / close. */

static void release(fitm_gguf *g)
{
    if (g->kvs)
        for (int64_t i = 0; i < g->n_kv; i++)
            free((char *)g->kvs[i].key);
    if (g->str_offs)
        for (int64_t i = 0; i < g->n_kv; i++)
            free(g->str_offs[i]);
    if (g->tensors)
        for (int64_t i = 0; i < g->n_tensors; i++)
            free((char *)g->tensors[i].name);
    free(g->kvs);
    free(g->str_offs);
    free(g->kv_sorted);
    free(g->tensors);
    free(g->t_sorted);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    if (g->owned)
        free((void *)g->base);
    free(g);
}

void fitm_gguf_release(const fitm_gguf *g, const void *p, size_t n)
{
    if (!g || !g->mapped || (const uint8_t *)p < g->base || n > g->size ||
        (size_t)((const uint8_t *)p - g->base) > g->size - n)
        return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p,
                    lo = (a + page - 1) / page * page, hi = (a + n) / page * page;
    if (hi > lo) /* the mapping is read-only and private: dropped pages come back from the file */
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void fitm_gguf_close(fitm_gguf *g)
{
    if (g)
        release(g);
}

fitm_status fitm_gguf_open_memory(fitm_gguf **out, const void *data, size_t n_bytes, fitm_err *err)
{
    if (!out)
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_open_memory: out is NULL");
    *out = NULL;
    if (!data && n_bytes)
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_open_memory: data is NULL");
    fitm_gguf *g = calloc(1, sizeof *g);
    if (!g)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory opening a GGUF buffer");
    g->base = data;
    g->size = n_bytes;
    fitm_status st = parse(g, err);
    if (st != FITM_OK)
        release(g);
    else
        *out = g;
    return st;
}

/* Reads the whole of fd (size bytes) into a new buffer *out (the caller's to free); fails when
 * the file is shorter than size. */
static fitm_status read_all(int fd, size_t size, const char *path, uint8_t **out, fitm_err *err)
{
    *out = NULL;
    uint8_t *buf = malloc(size);
    if (!buf)
        return fitm_err_set(err, FITM_ERR_NOMEM, "%s: out of memory copying %zu bytes", path,
                            size);
    size_t got = 0;
    while (got < size) {
        ssize_t n = read(fd, buf + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            free(buf);
            return fitm_err_set(err, FITM_ERR_IO, "%s: cannot read (%s)", path,
                                n < 0 ? strerror(errno) : "shorter than its size");
        }
        got += (size_t)n;
    }
    *out = buf;
    return FITM_OK;
}

static fitm_status open_file(fitm_gguf **out, const char *path, bool copy, fitm_err *err);

fitm_status fitm_gguf_open(fitm_gguf **out, const char *path, fitm_err *err)
{
    return open_file(out, path, false, err);
}

fitm_status fitm_gguf_open_copy(fitm_gguf **out, const char *path, fitm_err *err)
{
    return open_file(out, path, true, err);
}

static fitm_status open_file(fitm_gguf **out, const char *path, bool copy, fitm_err *err)
{
    fitm_status st = FITM_OK;
    int fd = -1;
    void *map = MAP_FAILED;
    size_t size = 0;
    fitm_gguf *g = NULL;

    if (!out || !path)
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_open: out or path is NULL");
    *out = NULL;
    /* O_NONBLOCK: opening a FIFO (or a device) without a writer would block; such a file is
     * refused below as not regular, and a regular file ignores the flag. */
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        st = fitm_err_set(err, errno == ENOENT ? FITM_ERR_NOT_FOUND : FITM_ERR_IO,
                          "%s: cannot open: %s", path, strerror(errno));
        goto done;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = fitm_err_set(err, FITM_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto done;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = fitm_err_set(err, FITM_ERR_IO, "%s: not a regular file (%s)", path,
                          S_ISDIR(sb.st_mode)    ? "a directory"
                          : S_ISFIFO(sb.st_mode) ? "a FIFO"
                          : S_ISSOCK(sb.st_mode) ? "a socket"
                          : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device"
                                                                         : "not a file");
        goto done;
    }
    if (sb.st_size == 0) {
        st = fitm_err_set(err, FITM_ERR_FORMAT, "%s: file is empty, not a GGUF file", path);
        goto done;
    }
    size = (size_t)sb.st_size;
    uint8_t *buf = NULL;
    if (copy && (st = read_all(fd, size, path, &buf, err)) != FITM_OK)
        goto done;
    if (!copy)
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (!copy && map == MAP_FAILED) {
        st = fitm_err_set(err, FITM_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, size,
                          strerror(errno));
        goto done;
    }
    g = calloc(1, sizeof *g);
    if (!g) {
        free(buf);
        st = fitm_err_set(err, FITM_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    g->base = copy ? buf : map;
    g->size = size;
    g->mapped = !copy;
    g->owned = copy;
    map = MAP_FAILED; /* owned by g now */
    st = parse(g, err);
    if (st != FITM_OK) {
        fitm_err_prefix(err, "%s", path);
        release(g);
        g = NULL;
    }
done:
    if (map != MAP_FAILED)
        munmap(map, size);
    if (fd >= 0)
        close(fd);
    *out = g;
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Accessors. */

uint32_t fitm_gguf_version(const fitm_gguf *g)
{
    return g ? g->version : 0;
}
uint64_t fitm_gguf_file_bytes(const fitm_gguf *g)
{
    return g ? g->size : 0;
}
uint32_t fitm_gguf_alignment(const fitm_gguf *g)
{
    return g ? g->alignment : 0;
}
uint64_t fitm_gguf_data_offset(const fitm_gguf *g)
{
    return g ? g->data_start : 0;
}
int64_t fitm_gguf_n_kv(const fitm_gguf *g)
{
    return g ? g->n_kv : 0;
}
int64_t fitm_gguf_n_tensors(const fitm_gguf *g)
{
    return g ? g->n_tensors : 0;
}

const fitm_gguf_kv *fitm_gguf_kv_at(const fitm_gguf *g, int64_t i)
{
    if (!g || i < 0 || i >= g->n_kv)
        return NULL;
    return &g->kvs[i];
}

const fitm_gguf_kv *fitm_gguf_find_kv(const fitm_gguf *g, const char *key)
{
    if (!g || !key || !g->kv_sorted)
        return NULL;
    fitm_gguf_kv probe = {.key = key};
    const fitm_gguf_kv *pp = &probe;
    const fitm_gguf_kv **hit =
        bsearch(&pp, g->kv_sorted, (size_t)g->n_kv, sizeof *g->kv_sorted, cmp_kv);
    return hit ? *hit : NULL;
}

const fitm_gguf_tensor *fitm_gguf_tensor_at(const fitm_gguf *g, int64_t i)
{
    if (!g || i < 0 || i >= g->n_tensors)
        return NULL;
    return &g->tensors[i];
}

const fitm_gguf_tensor *fitm_gguf_find_tensor(const fitm_gguf *g, const char *name)
{
    if (!g || !name || !g->t_sorted)
        return NULL;
    fitm_gguf_tensor probe = {.name = name};
    const fitm_gguf_tensor *pp = &probe;
    const fitm_gguf_tensor **hit =
        bsearch(&pp, g->t_sorted, (size_t)g->n_tensors, sizeof *g->t_sorted, cmp_tensor_name);
    return hit ? *hit : NULL;
}

/* Reads an integer-typed scalar as a sign flag and magnitude-preserving pair. Returns false
 * for non-integer types. */
static bool kv_int(const fitm_gguf_kv *kv, bool *neg, uint64_t *u, int64_t *s)
{
    uint8_t u8;
    int8_t i8;
    uint16_t u16;
    int16_t i16;
    uint32_t u32;
    int32_t i32;
    int64_t i64;
    *neg = false;
    switch (kv->type) {
    case FITM_GGUF_UINT8:
        memcpy(&u8, kv->value, 1);
        *u = u8;
        break;
    case FITM_GGUF_UINT16:
        memcpy(&u16, kv->value, 2);
        *u = u16;
        break;
    case FITM_GGUF_UINT32:
        memcpy(&u32, kv->value, 4);
        *u = u32;
        break;
    case FITM_GGUF_UINT64:
        memcpy(u, kv->value, 8);
        break;
    case FITM_GGUF_INT8:
        memcpy(&i8, kv->value, 1);
        *s = i8;
        goto sgn;
    case FITM_GGUF_INT16:
        memcpy(&i16, kv->value, 2);
        *s = i16;
        goto sgn;
    case FITM_GGUF_INT32:
        memcpy(&i32, kv->value, 4);
        *s = i32;
        goto sgn;
    case FITM_GGUF_INT64:
        memcpy(&i64, kv->value, 8);
        *s = i64;
        goto sgn;
    default:
        return false;
    }
    *s = *u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)*u;
    return true;
sgn:
    *neg = *s < 0;
    *u = *neg ? 0 : (uint64_t)*s;
    return true;
}

fitm_status fitm_gguf_get_u32(const fitm_gguf *g, const char *key, uint32_t *out, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    bool neg;
    uint64_t u;
    int64_t s;
    if (!kv_int(kv, &neg, &u, &s))
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' has type %s, expected an integer", key,
                            fitm_gguf_type_name(kv->type));
    if (neg || u > UINT32_MAX)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s' value %s%" PRIu64 " does not fit in uint32", key,
                            neg ? "-" : "", neg ? (uint64_t)0 - (uint64_t)s : u);
    *out = (uint32_t)u;
    return FITM_OK;
}

fitm_status fitm_gguf_get_i64(const fitm_gguf *g, const char *key, int64_t *out, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    bool neg;
    uint64_t u;
    int64_t s;
    if (!kv_int(kv, &neg, &u, &s))
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' has type %s, expected an integer", key,
                            fitm_gguf_type_name(kv->type));
    if (!neg && u > (uint64_t)INT64_MAX)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "key '%s' value %" PRIu64 " does not fit in int64", key, u);
    *out = s;
    return FITM_OK;
}

fitm_status fitm_gguf_get_f32(const fitm_gguf *g, const char *key, float *out, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    if (kv->type == FITM_GGUF_FLOAT32) {
        memcpy(out, kv->value, 4);
        return FITM_OK;
    }
    if (kv->type == FITM_GGUF_FLOAT64) {
        double d;
        memcpy(&d, kv->value, 8);
        *out = (float)d;
        return FITM_OK;
    }
    return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' has type %s, expected float32", key,
                        fitm_gguf_type_name(kv->type));
}

fitm_status fitm_gguf_get_bool(const fitm_gguf *g, const char *key, bool *out, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    if (kv->type != FITM_GGUF_BOOL)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' has type %s, expected bool", key,
                            fitm_gguf_type_name(kv->type));
    *out = kv->value[0] != 0;
    return FITM_OK;
}

fitm_status fitm_gguf_get_str(const fitm_gguf *g, const char *key, fitm_gguf_str *out,
                              fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    if (kv->type != FITM_GGUF_STRING)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' has type %s, expected string", key,
                            fitm_gguf_type_name(kv->type));
    memcpy(&out->len, kv->value, 8);
    out->ptr = (const char *)kv->value + 8;
    return FITM_OK;
}

fitm_status fitm_gguf_get_arr(const fitm_gguf *g, const char *key, fitm_gguf_type want,
                              const void **data, uint64_t *n, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    if (!kv)
        return FITM_ERR_NOT_FOUND;
    if (kv->type != FITM_GGUF_ARRAY || kv->arr_type != want)
        return fitm_err_set(
            err, FITM_ERR_FORMAT, "key '%s' is %s%s%s, expected an array of %s", key,
            kv->type == FITM_GGUF_ARRAY ? "an array of " : "a ",
            fitm_gguf_type_name(kv->type == FITM_GGUF_ARRAY ? kv->arr_type : kv->type),
            kv->type == FITM_GGUF_ARRAY ? "" : " value", fitm_gguf_type_name(want));
    if (data)
        *data = kv->value;
    if (n)
        *n = kv->arr_n;
    return FITM_OK;
}

fitm_gguf_str fitm_gguf_arr_str(const fitm_gguf *g, const fitm_gguf_kv *kv, uint64_t i)
{
    fitm_gguf_str s = {NULL, 0};
    if (!g || !kv)
        return s;
    /* Compare addresses as integers: kv may point anywhere, not only into g->kvs. */
    uintptr_t at = (uintptr_t)kv, first = (uintptr_t)g->kvs;
    if (at < first || (at - first) % sizeof *kv != 0 ||
        (at - first) / sizeof *kv >= (uint64_t)g->n_kv)
        return s;
    const uint64_t *offs = g->str_offs[(at - first) / sizeof *kv];
    if (!offs || i >= kv->arr_n)
        return s;
    memcpy(&s.len, g->base + offs[i], 8);
    s.ptr = (const char *)g->base + offs[i] + 8;
    return s;
}
