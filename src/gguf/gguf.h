/* gguf: a reader for GGUF v2/v3 model files that treats the file as hostile input.
 *
 * The file is mmapped read-only. fitm_gguf_open validates everything up front: header, every
 * metadata key/value (nested arrays included), every tensor info (name, dims, type, offset,
 * size, overlap, alignment), with overflow-safe arithmetic and without allocating more than a
 * small multiple of the file size. After a successful open, every accessor below is safe and
 * O(1) or O(log n); nothing touches bytes that were not checked.
 *
 * Ownership: the fitm_gguf owns the mapping. Strings and pointers it hands out point into the
 * mapping or into memory it owns, and live until fitm_gguf_close. */
#ifndef FITM_GGUF_H
#define FITM_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"

#define FITM_GGUF_MAX_DIMS 4
#define FITM_GGUF_MAX_NESTING 4 /* arrays inside arrays: at most this many levels in all */
#define FITM_GGUF_MAX_KEY 65535 /* bytes in a metadata key (the GGUF spec's limit)       */
#define FITM_GGUF_MAX_NAME 64   /* bytes in a tensor name (the GGUF spec's limit)        */

typedef enum {
    FITM_GGUF_UINT8 = 0,
    FITM_GGUF_INT8 = 1,
    FITM_GGUF_UINT16 = 2,
    FITM_GGUF_INT16 = 3,
    FITM_GGUF_UINT32 = 4,
    FITM_GGUF_INT32 = 5,
    FITM_GGUF_FLOAT32 = 6,
    FITM_GGUF_BOOL = 7,
    FITM_GGUF_STRING = 8,
    FITM_GGUF_ARRAY = 9,
    FITM_GGUF_UINT64 = 10,
    FITM_GGUF_INT64 = 11,
    FITM_GGUF_FLOAT64 = 12,
    FITM_GGUF_TYPE_COUNT
} fitm_gguf_type;

typedef struct fitm_gguf fitm_gguf;

/* A string inside the file: NOT NUL-terminated; len bytes at ptr. */
typedef struct {
    const char *ptr;
    uint64_t len;
} fitm_gguf_str;

/* One metadata entry. For arrays, type == FITM_GGUF_ARRAY and arr_type/arr_n describe the
 * elements (arr_type may itself be ARRAY for nested arrays; their contents are validated but
 * only reachable through fitm_gguf_kv_at's raw view). */
typedef struct {
    const char *key; /* NUL-terminated copy owned by the fitm_gguf */
    fitm_gguf_type type;
    fitm_gguf_type arr_type; /* valid when type == ARRAY */
    uint64_t arr_n;          /* valid when type == ARRAY */
    const uint8_t *value;    /* raw little-endian bytes of the value in the mapping: for
                                scalars the value itself (bool: one byte, 0 or 1); for
                                STRING the u64 length then the bytes; for ARRAY the first
                                element (after the element type and count) */
} fitm_gguf_kv;

typedef struct {
    const char *name; /* NUL-terminated copy owned by the fitm_gguf */
    fitm_dtype type;
    int32_t n_dims;
    int64_t ne[FITM_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension; unused dims are 1 */
    int64_t n_elems;
    uint64_t offset; /* from the start of the data section */
    uint64_t n_bytes;
    const void *data; /* in the mapping; its file offset is a multiple of general.alignment */
} fitm_gguf_tensor;

/* Opens and validates a file. On failure *out is NULL and err names the problem (with the
 * key or tensor involved and the byte offset where useful). */
fitm_status fitm_gguf_open(fitm_gguf **out, const char *path, fitm_err *err);

/* As fitm_gguf_open, but the file is read into private memory instead of mapped: a file
 * changed or truncated afterwards no longer affects (or faults) the opened model. */
fitm_status fitm_gguf_open_copy(fitm_gguf **out, const char *path, fitm_err *err);

/* Same checks on a caller-owned buffer (tests, fuzzing). The buffer must outlive the result. */
fitm_status fitm_gguf_open_memory(fitm_gguf **out, const void *data, size_t n_bytes, fitm_err *err);

/* Releases everything. NULL is a no-op. */
void fitm_gguf_close(fitm_gguf *g);

/* The caller keeps its own copy of [p, p + n), bytes of g: a mapped file drops the whole pages
 * inside the range from the process's memory (read from the file again if touched later); a
 * copy in memory or a caller's buffer keeps them (a no-op). */
void fitm_gguf_release(const fitm_gguf *g, const void *p, size_t n);

/* File-level facts; each returns 0 for a NULL g. */
uint32_t fitm_gguf_version(const fitm_gguf *g);
uint64_t fitm_gguf_file_bytes(const fitm_gguf *g);
uint32_t fitm_gguf_alignment(const fitm_gguf *g);   /* general.alignment, 32 when absent */
uint64_t fitm_gguf_data_offset(const fitm_gguf *g); /* byte offset of the data section */

/* Metadata, in file order. kv_at returns NULL when i is out of range or g is NULL; find_kv
 * (binary search, O(log n)) returns NULL when the key is absent or g/key is NULL. */
int64_t fitm_gguf_n_kv(const fitm_gguf *g);
const fitm_gguf_kv *fitm_gguf_kv_at(const fitm_gguf *g, int64_t i);
const fitm_gguf_kv *fitm_gguf_find_kv(const fitm_gguf *g, const char *key); /* NULL if absent */

/* "uint8", "string", "array", ...; "unknown" for an out-of-range value. Never NULL. */
const char *fitm_gguf_type_name(fitm_gguf_type t);

/* Bytes of one element of a fixed-size type; 0 for STRING, ARRAY and unknown values. */
size_t fitm_gguf_type_size(fitm_gguf_type t);

/* Typed getters. They return FITM_ERR_NOT_FOUND when the key is absent (err untouched, so
 * callers can apply defaults), FITM_ERR_FORMAT with a message when it has the wrong type or
 * its value does not fit. Integer getters accept any integer type whose value fits. */
fitm_status fitm_gguf_get_u32(const fitm_gguf *g, const char *key, uint32_t *out, fitm_err *err);
fitm_status fitm_gguf_get_i64(const fitm_gguf *g, const char *key, int64_t *out, fitm_err *err);
fitm_status fitm_gguf_get_f32(const fitm_gguf *g, const char *key, float *out, fitm_err *err);
fitm_status fitm_gguf_get_bool(const fitm_gguf *g, const char *key, bool *out, fitm_err *err);
fitm_status fitm_gguf_get_str(const fitm_gguf *g, const char *key, fitm_gguf_str *out,
                              fitm_err *err);

/* Arrays. get_arr checks the element type (want) and returns a pointer to the raw packed
 * little-endian elements in the mapping (possibly unaligned: read with memcpy) and the count.
 * String arrays: get_arr with want == STRING gives the count; fitm_gguf_arr_str returns
 * element i (the reader keeps an offset table, so this is O(1)); it returns {NULL, 0} when kv
 * is not a top-level string array of g or i >= kv->arr_n. data and n may be NULL. */
fitm_status fitm_gguf_get_arr(const fitm_gguf *g, const char *key, fitm_gguf_type want,
                              const void **data, uint64_t *n, fitm_err *err);
fitm_gguf_str fitm_gguf_arr_str(const fitm_gguf *g, const fitm_gguf_kv *kv, uint64_t i);

/* Tensors, in file order. tensor_at returns NULL when i is out of range or g is NULL;
 * find_tensor (O(log n)) returns NULL when the name is absent or g/name is NULL. */
int64_t fitm_gguf_n_tensors(const fitm_gguf *g);
const fitm_gguf_tensor *fitm_gguf_tensor_at(const fitm_gguf *g, int64_t i);
const fitm_gguf_tensor *fitm_gguf_find_tensor(const fitm_gguf *g, const char *name);

#endif
