/* gguf_writer: keeps each key's value already serialised (the bytes after the value type), so
 * writing is concatenation plus tensor infos, padding and payloads. */
#include "gguf/gguf_writer.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

#define DEFAULT_ALIGNMENT 32u

typedef struct {
    char *key;
    fitm_gguf_type type;
    uint8_t *bytes; /* serialised value */
    size_t n_bytes;
} wkv;

typedef struct {
    char *name;
    fitm_dtype type;
    int32_t n_dims;
    int64_t ne[FITM_GGUF_MAX_DIMS];
    uint8_t *data;
    size_t n_bytes;
} wtensor;

struct fitm_gguf_writer {
    uint32_t version;
    uint32_t alignment;
    wkv *kvs;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
};

static void buf_u32(fitm_buf *b, uint32_t v)
{
    fitm_buf_append(b, &v, 4);
}
static void buf_u64(fitm_buf *b, uint64_t v)
{
    fitm_buf_append(b, &v, 8);
}

static void buf_str(fitm_buf *b, const char *s, uint64_t len)
{
    buf_u64(b, len);
    fitm_buf_append(b, s, (size_t)len);
}

fitm_status fitm_gguf_writer_create(fitm_gguf_writer **out, fitm_err *err)
{
    if (!out)
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_writer_create: out is NULL");
    *out = calloc(1, sizeof **out);
    if (!*out)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory creating a GGUF writer");
    (*out)->version = 3;
    (*out)->alignment = DEFAULT_ALIGNMENT;
    return FITM_OK;
}

void fitm_gguf_writer_destroy(fitm_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].bytes);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

fitm_status fitm_gguf_writer_set_version(fitm_gguf_writer *w, uint32_t version, fitm_err *err)
{
    if (!w)
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_writer_set_version: writer is NULL");
    if (version != 2 && version != 3)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "GGUF version %" PRIu32 " cannot be written (2 or 3)", version);
    w->version = version;
    return FITM_OK;
}

/* Stores key -> (type, serialised bytes); takes ownership of b's buffer in every case. */
static fitm_status set_kv(fitm_gguf_writer *w, const char *key, fitm_gguf_type type, fitm_buf *b,
                          fitm_err *err)
{
    fitm_status st = FITM_OK;
    if (!w || !key || !*key) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "GGUF writer: NULL writer or empty key");
        goto done;
    }
    if (b->failed) {
        st =
            fitm_err_set(err, FITM_ERR_NOMEM, "key '%s': out of memory serialising the value", key);
        goto done;
    }
    if (!strcmp(key, "general.alignment") && type != FITM_GGUF_UINT32) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "general.alignment must be a uint32, not %s",
                          fitm_gguf_type_name(type));
        goto done;
    }
    if (strlen(key) > FITM_GGUF_MAX_KEY) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "key of %zu bytes is longer than %d", strlen(key),
                          FITM_GGUF_MAX_KEY);
        goto done;
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kvs[i].key, key)) {
            free(w->kvs[i].bytes);
            w->kvs[i].type = type;
            w->kvs[i].bytes = (uint8_t *)b->p;
            w->kvs[i].n_bytes = b->len;
            b->p = NULL;
            goto done;
        }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        wkv *p = realloc(w->kvs, cap * sizeof *p);
        if (!p) {
            st = fitm_err_set(err, FITM_ERR_NOMEM, "key '%s': out of memory", key);
            goto done;
        }
        w->kvs = p;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "key '%s': out of memory", key);
        goto done;
    }
    w->kvs[w->n_kv++] = (wkv){k, type, (uint8_t *)b->p, b->len};
    b->p = NULL;
done:
    free(b->p);
    b->p = NULL;
    return st;
}

fitm_status fitm_gguf_writer_set_scalar(fitm_gguf_writer *w, const char *key, fitm_gguf_type type,
                                        const void *value, fitm_err *err)
{
    fitm_buf b = {0};
    const char *k = key ? key : "(null)";
    if (fitm_gguf_type_size(type) == 0 || !value)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "key '%s': %s is not a scalar type or value is NULL", k,
                            fitm_gguf_type_name(type));
    if (type == FITM_GGUF_BOOL && *(const uint8_t *)value > 1)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': bool value must be 0 or 1", k);
    uint32_t align = 0;
    if (type == FITM_GGUF_UINT32 && key && !strcmp(key, "general.alignment")) {
        memcpy(&align, value, 4);
        if (align == 0 || (align & (align - 1)) != 0)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "general.alignment %" PRIu32 " is not a nonzero power of two",
                                align);
    }
    fitm_buf_append(&b, value, fitm_gguf_type_size(type));
    fitm_status st = set_kv(w, key, type, &b, err);
    if (st == FITM_OK && align)
        w->alignment = align;
    return st;
}

fitm_status fitm_gguf_writer_set_u32(fitm_gguf_writer *w, const char *key, uint32_t v,
                                     fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_UINT32, &v, err);
}

fitm_status fitm_gguf_writer_set_i32(fitm_gguf_writer *w, const char *key, int32_t v, fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_INT32, &v, err);
}

fitm_status fitm_gguf_writer_set_u64(fitm_gguf_writer *w, const char *key, uint64_t v,
                                     fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_UINT64, &v, err);
}

fitm_status fitm_gguf_writer_set_i64(fitm_gguf_writer *w, const char *key, int64_t v, fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_INT64, &v, err);
}

fitm_status fitm_gguf_writer_set_f32(fitm_gguf_writer *w, const char *key, float v, fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_FLOAT32, &v, err);
}

fitm_status fitm_gguf_writer_set_f64(fitm_gguf_writer *w, const char *key, double v, fitm_err *err)
{
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_FLOAT64, &v, err);
}

fitm_status fitm_gguf_writer_set_bool(fitm_gguf_writer *w, const char *key, bool v, fitm_err *err)
{
    uint8_t b = v ? 1 : 0;
    return fitm_gguf_writer_set_scalar(w, key, FITM_GGUF_BOOL, &b, err);
}

fitm_status fitm_gguf_writer_set_strn(fitm_gguf_writer *w, const char *key, const char *s,
                                      uint64_t len, fitm_err *err)
{
    fitm_buf b = {0};
    if (!s && len)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': string is NULL",
                            key ? key : "(null)");
    buf_str(&b, s, len);
    return set_kv(w, key, FITM_GGUF_STRING, &b, err);
}

fitm_status fitm_gguf_writer_set_str(fitm_gguf_writer *w, const char *key, const char *s,
                                     fitm_err *err)
{
    if (!s)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': string is NULL",
                            key ? key : "(null)");
    return fitm_gguf_writer_set_strn(w, key, s, strlen(s), err);
}

/* An array of n strings, element i from cstrs[i] (NUL-terminated) or else strs[i]. */
static fitm_status set_strings(fitm_gguf_writer *w, const char *key, const char *const *cstrs,
                               const fitm_gguf_str *strs, uint64_t n, fitm_err *err)
{
    fitm_buf b = {0};
    if (!cstrs && !strs && n)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': string array is NULL",
                            key ? key : "(null)");
    for (uint64_t i = 0; i < n; i++)
        if (cstrs ? !cstrs[i] : !strs[i].ptr && strs[i].len)
            return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': string %" PRIu64 " is NULL",
                                key ? key : "(null)", i);
    buf_u32(&b, FITM_GGUF_STRING);
    buf_u64(&b, n);
    for (uint64_t i = 0; i < n; i++)
        if (cstrs)
            buf_str(&b, cstrs[i], strlen(cstrs[i]));
        else
            buf_str(&b, strs[i].ptr, strs[i].len);
    return set_kv(w, key, FITM_GGUF_ARRAY, &b, err);
}

fitm_status fitm_gguf_writer_set_arr_str(fitm_gguf_writer *w, const char *key,
                                         const char *const *strs, uint64_t n, fitm_err *err)
{
    return set_strings(w, key, strs, NULL, n, err);
}

fitm_status fitm_gguf_writer_set_arr_strn(fitm_gguf_writer *w, const char *key,
                                          const fitm_gguf_str *strs, uint64_t n, fitm_err *err)
{
    return set_strings(w, key, NULL, strs, n, err);
}

fitm_status fitm_gguf_writer_set_arr(fitm_gguf_writer *w, const char *key, fitm_gguf_type elem_type,
                                     const void *data, uint64_t n, fitm_err *err)
{
    fitm_buf b = {0};
    size_t sz = fitm_gguf_type_size(elem_type);
    if (sz == 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': %s arrays need their own setter",
                            key ? key : "(null)", fitm_gguf_type_name(elem_type));
    if (!data && n)
        return fitm_err_set(err, FITM_ERR_INVALID, "key '%s': array data is NULL",
                            key ? key : "(null)");
    if (n > SIZE_MAX / sz)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "key '%s': array of %" PRIu64 " elements is too large",
                            key ? key : "(null)", n);
    if (elem_type == FITM_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return fitm_err_set(err, FITM_ERR_INVALID,
                                    "key '%s': bool element %" PRIu64 " is not 0 or 1",
                                    key ? key : "(null)", i);
    buf_u32(&b, elem_type);
    buf_u64(&b, n);
    fitm_buf_append(&b, data, (size_t)(n * sz));
    return set_kv(w, key, FITM_GGUF_ARRAY, &b, err);
}

fitm_status fitm_gguf_writer_add_tensor(fitm_gguf_writer *w, const char *name, fitm_dtype type,
                                        int32_t n_dims, const int64_t *ne, const void *data,
                                        size_t n_bytes, fitm_err *err)
{
    if (!w || !name || !ne || (!data && n_bytes))
        return fitm_err_set(err, FITM_ERR_INVALID, "GGUF writer: NULL writer, name, dims or data");
    size_t len = strlen(name);
    if (len == 0 || len > FITM_GGUF_MAX_NAME)
        return fitm_err_set(err, FITM_ERR_INVALID, "tensor name '%s' must be 1..%d bytes", name,
                            FITM_GGUF_MAX_NAME);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return fitm_err_set(err, FITM_ERR_INVALID, "tensor '%s' was already added", name);
    const fitm_dtype_info *info = fitm_dtype_info_of((int)type);
    if (!info)
        return fitm_err_set(err, FITM_ERR_INVALID, "tensor '%s': unknown type %d", name, (int)type);
    if (n_dims < 1 || n_dims > FITM_GGUF_MAX_DIMS)
        return fitm_err_set(err, FITM_ERR_INVALID, "tensor '%s': n_dims %d is outside 1..%d", name,
                            (int)n_dims, FITM_GGUF_MAX_DIMS);
    wtensor t = {.type = type, .n_dims = n_dims, .ne = {1, 1, 1, 1}};
    uint64_t rows = 1;
    for (int32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "tensor '%s': ne[%d] = %" PRId64 " is not >= 1", name, (int)d,
                                ne[d]);
        t.ne[d] = ne[d];
        if (d > 0) {
            if ((uint64_t)ne[d] > UINT64_MAX / rows)
                return fitm_err_set(err, FITM_ERR_INVALID, "tensor '%s': too many elements", name);
            rows *= (uint64_t)ne[d];
        }
    }
    size_t row = fitm_dtype_row_bytes(type, ne[0]);
    if (row == 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "tensor '%s': ne[0] = %" PRId64
                            " is not a multiple of the %s block size %d",
                            name, ne[0], info->name, (int)info->block_elems);
    if (rows > SIZE_MAX / row || rows * row != n_bytes)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "tensor '%s': %zu data bytes given, its type and dims need %" PRIu64,
                            name, n_bytes, rows > SIZE_MAX / row ? UINT64_MAX : rows * row);
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 16;
        wtensor *p = realloc(w->tensors, cap * sizeof *p);
        if (!p)
            return fitm_err_set(err, FITM_ERR_NOMEM, "tensor '%s': out of memory", name);
        w->tensors = p;
        w->cap_tensors = cap;
    }
    t.name = strdup(name);
    t.data = malloc(n_bytes ? n_bytes : 1);
    if (!t.name || !t.data) {
        free(t.name);
        free(t.data);
        return fitm_err_set(err, FITM_ERR_NOMEM, "tensor '%s': out of memory copying %zu bytes",
                            name, n_bytes);
    }
    memcpy(t.data, data, n_bytes);
    t.n_bytes = n_bytes;
    w->tensors[w->n_tensors++] = t;
    return FITM_OK;
}

static size_t pad_to(size_t n, uint32_t a)
{
    return (a - n % a) % a;
}

fitm_status fitm_gguf_writer_write_memory(const fitm_gguf_writer *w, void **out, size_t *n_bytes,
                                          fitm_err *err)
{
    fitm_buf b = {0};
    fitm_status st = FITM_OK;
    if (!out || !n_bytes || !w) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_writer_write_memory: NULL argument");
        goto done;
    }
    *out = NULL;
    fitm_buf_append(&b, "GGUF", 4);
    buf_u32(&b, w->version);
    buf_u64(&b, w->n_tensors);
    buf_u64(&b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        buf_str(&b, w->kvs[i].key, strlen(w->kvs[i].key));
        buf_u32(&b, w->kvs[i].type);
        fitm_buf_append(&b, w->kvs[i].bytes, w->kvs[i].n_bytes);
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        buf_str(&b, t->name, strlen(t->name));
        buf_u32(&b, (uint32_t)t->n_dims);
        for (int32_t d = 0; d < t->n_dims; d++)
            buf_u64(&b, (uint64_t)t->ne[d]);
        buf_u32(&b, (uint32_t)t->type);
        buf_u64(&b, offset);
        offset += t->n_bytes + pad_to(t->n_bytes, w->alignment);
    }
    if (w->n_tensors > 0) {
        fitm_buf_append(&b, NULL, pad_to(b.len, w->alignment));
        for (size_t i = 0; i < w->n_tensors; i++) {
            fitm_buf_append(&b, w->tensors[i].data, w->tensors[i].n_bytes);
            fitm_buf_append(&b, NULL, pad_to(w->tensors[i].n_bytes, w->alignment));
        }
    }
    if (b.failed) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory serialising a GGUF file");
        goto done;
    }
    *out = b.p;
    *n_bytes = b.len;
    b.p = NULL;
done:
    free(b.p);
    return st;
}

fitm_status fitm_gguf_writer_write(const fitm_gguf_writer *w, const char *path, fitm_err *err)
{
    void *bytes = NULL;
    size_t n = 0;
    FILE *f = NULL;
    fitm_status st = FITM_OK;
    if (!path) {
        st = fitm_err_set(err, FITM_ERR_INVALID, "fitm_gguf_writer_write: path is NULL");
        goto done;
    }
    st = fitm_gguf_writer_write_memory(w, &bytes, &n, err);
    if (st != FITM_OK)
        goto done;
    f = fopen(path, "wb");
    if (!f) {
        st = fitm_err_set(err, FITM_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    if (fwrite(bytes, 1, n, f) != n) {
        st = fitm_err_set(err, FITM_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        goto done;
    }
    int rc = fclose(f);
    f = NULL;
    if (rc != 0)
        st = fitm_err_set(err, FITM_ERR_IO, "%s: close failed: %s", path, strerror(errno));
done:
    if (f)
        fclose(f);
    free(bytes);
    return st;
}
