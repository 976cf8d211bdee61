/* gguf_writer: builds small GGUF v3 files (test models, fixtures, fuzz seeds).
 *
 * Usage: create a writer, set metadata and add tensors in the order they should appear, then
 * write to a path or to a malloc'd buffer. Keys keep their insertion order; setting a key that
 * is already present replaces its value in place. Tensors are written in insertion order,
 * each at the next offset aligned to general.alignment (32 unless that key was set with
 * fitm_gguf_writer_set_u32; it must be a nonzero power of two).
 *
 * Ownership: the writer copies every key, string, array and tensor payload it is given, so
 * callers may free or reuse their buffers as soon as a call returns. Everything the writer
 * holds is released by fitm_gguf_writer_destroy.
 *
 * Errors: every function returns FITM_OK or a status with one sentence in err (if non-NULL):
 * FITM_ERR_INVALID for bad arguments (NULL where a value is required, a duplicate tensor name,
 * bad dims, a payload size that does not match type and dims), FITM_ERR_NOMEM, FITM_ERR_IO. */
#ifndef FITM_GGUF_WRITER_H
#define FITM_GGUF_WRITER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"
#include "gguf/gguf.h"

typedef struct fitm_gguf_writer fitm_gguf_writer;

/* Creates an empty writer (version 3, no keys, no tensors). *out is NULL on failure. */
fitm_status fitm_gguf_writer_create(fitm_gguf_writer **out, fitm_err *err);

/* Releases the writer and all copies it holds. NULL is a no-op. */
void fitm_gguf_writer_destroy(fitm_gguf_writer *w);

/* Header version to write: 2 or 3 (the layouts are identical; 3 is the default). */
fitm_status fitm_gguf_writer_set_version(fitm_gguf_writer *w, uint32_t version, fitm_err *err);

/* Scalar of any non-string, non-array type: value points at one element of that type in host
 * byte order (little-endian hosts only, as the rest of fitm). BOOL is one byte, 0 or 1. */
fitm_status fitm_gguf_writer_set_scalar(fitm_gguf_writer *w, const char *key, fitm_gguf_type type,
                                        const void *value, fitm_err *err);

/* Typed conveniences over fitm_gguf_writer_set_scalar. Setting "general.alignment" (uint32
 * only; rejected unless a nonzero power of two) also sets the data alignment. */
fitm_status fitm_gguf_writer_set_u32(fitm_gguf_writer *w, const char *key, uint32_t v,
                                     fitm_err *err);
fitm_status fitm_gguf_writer_set_i32(fitm_gguf_writer *w, const char *key, int32_t v,
                                     fitm_err *err);
fitm_status fitm_gguf_writer_set_u64(fitm_gguf_writer *w, const char *key, uint64_t v,
                                     fitm_err *err);
fitm_status fitm_gguf_writer_set_i64(fitm_gguf_writer *w, const char *key, int64_t v,
                                     fitm_err *err);
fitm_status fitm_gguf_writer_set_f32(fitm_gguf_writer *w, const char *key, float v, fitm_err *err);
fitm_status fitm_gguf_writer_set_f64(fitm_gguf_writer *w, const char *key, double v, fitm_err *err);
fitm_status fitm_gguf_writer_set_bool(fitm_gguf_writer *w, const char *key, bool v, fitm_err *err);

/* NUL-terminated string value. */
fitm_status fitm_gguf_writer_set_str(fitm_gguf_writer *w, const char *key, const char *s,
                                     fitm_err *err);

/* String value of len bytes (may contain NUL bytes; s may be NULL when len is 0). */
fitm_status fitm_gguf_writer_set_strn(fitm_gguf_writer *w, const char *key, const char *s,
                                      uint64_t len, fitm_err *err);

/* Array of n NUL-terminated strings (strs may be NULL when n is 0). */
fitm_status fitm_gguf_writer_set_arr_str(fitm_gguf_writer *w, const char *key,
                                         const char *const *strs, uint64_t n, fitm_err *err);

/* Array of n strings of strs[i].len bytes each (may contain NUL bytes; ptr may be NULL when
 * len is 0): a string array read from a file (fitm_gguf_arr_str) copied as it is. */
fitm_status fitm_gguf_writer_set_arr_strn(fitm_gguf_writer *w, const char *key,
                                          const fitm_gguf_str *strs, uint64_t n, fitm_err *err);

/* Array of n numeric/bool elements of elem_type (not STRING or ARRAY), packed in host byte
 * order at data (bools one byte each). data may be NULL when n is 0. */
fitm_status fitm_gguf_writer_set_arr(fitm_gguf_writer *w, const char *key, fitm_gguf_type elem_type,
                                     const void *data, uint64_t n, fitm_err *err);

/* Adds a tensor: type any type fitm_dtype_info_of knows, 1 <= n_dims <= 4, every ne[i] >= 1,
 * ne[0] a multiple of the type's block size, and n_bytes exactly the tensor's size
 * (fitm_dtype_row_bytes(type, ne[0]) * ne[1] * ne[2] * ne[3]). The payload is copied. */
fitm_status fitm_gguf_writer_add_tensor(fitm_gguf_writer *w, const char *name, fitm_dtype type,
                                        int32_t n_dims, const int64_t *ne, const void *data,
                                        size_t n_bytes, fitm_err *err);

/* Serialises into a new malloc'd buffer: *out and *n_bytes are set on success and the caller
 * free()s *out; on failure *out is NULL. The writer is unchanged and may be written again. */
fitm_status fitm_gguf_writer_write_memory(const fitm_gguf_writer *w, void **out, size_t *n_bytes,
                                          fitm_err *err);

/* Writes the file at path (created or truncated). On failure the path may hold a partial file. */
fitm_status fitm_gguf_writer_write(const fitm_gguf_writer *w, const char *path, fitm_err *err);

#endif
