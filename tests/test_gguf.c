/* test_gguf: the GGUF reader and writer.
 *
 * - round trip: a file with every value type and several tensor types, written by the writer,
 *   read back from memory and from disk, every value checked;
 * - the writer's bytes against a file assembled by hand from the spec (independent reference);
 * - a table of hand-assembled corrupt files, each rejected with its own message;
 * - every truncation (and every single-byte corruption) of a valid file fails cleanly;
 * - the GGUF files of the test data (FITM_TEST_DATA, see tests/testdata.py), with known values. */
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"

#define OK(expr)                                                                                   \
    do {                                                                                           \
        fitm_err e_ = {{0}};                                                                       \
        (void)e_;                                                                                  \
        fitm_status s_ = (expr);                                                                   \
        if (s_ != FITM_OK) {                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s -> %s\n", __FILE__, __LINE__, #expr,                   \
                    fitm_status_name(s_));                                                         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------------------------------- */
/* A byte builder for hand-assembled files. */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} bb;

static void put(bb *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) {
            perror("realloc");
            exit(1);
        }
    }
    if (src)
        memcpy(b->p + b->n, src, n);
    else
        memset(b->p + b->n, 0, n);
    b->n += n;
}
static void put_u8(bb *b, uint8_t v)
{
    put(b, &v, 1);
}
static void put_u32(bb *b, uint32_t v)
{
    put(b, &v, 4);
}
static void put_u64(bb *b, uint64_t v)
{
    put(b, &v, 8);
}
static void put_str(bb *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void header(bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    put(b, "GGUF", 4);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
}
static void kv_u32(bb *b, const char *key, uint32_t v)
{
    put_str(b, key);
    put_u32(b, FITM_GGUF_UINT32);
    put_u32(b, v);
}
/* Tensor info with n_dims dims from ne. */
static void tinfo(bb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                  uint64_t offset)
{
    put_str(b, name);
    put_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        put_u64(b, ne[i]);
    put_u32(b, type);
    put_u64(b, offset);
}
static void pad(bb *b, size_t a)
{
    while (b->n % a)
        put_u8(b, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* Round trip through the writer. */

static const char *const vocab[] = {"<unk>", "hello", "", "w\xc3\xb6rld", "\xe2\x96\x81the"};
#define N_VOCAB (sizeof vocab / sizeof vocab[0])

static fitm_gguf_writer *build_sample(uint32_t alignment)
{
    fitm_gguf_writer *w;
    OK(fitm_gguf_writer_create(&w, &e_));
    OK(fitm_gguf_writer_set_str(w, "general.architecture", "llama", &e_));
    OK(fitm_gguf_writer_set_u32(w, "general.alignment", alignment, &e_));
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    OK(fitm_gguf_writer_set_scalar(w, "t.u8", FITM_GGUF_UINT8, &u8, &e_));
    OK(fitm_gguf_writer_set_scalar(w, "t.i8", FITM_GGUF_INT8, &i8, &e_));
    OK(fitm_gguf_writer_set_scalar(w, "t.u16", FITM_GGUF_UINT16, &u16, &e_));
    OK(fitm_gguf_writer_set_scalar(w, "t.i16", FITM_GGUF_INT16, &i16, &e_));
    OK(fitm_gguf_writer_set_u32(w, "t.u32", 4000000000u, &e_));
    OK(fitm_gguf_writer_set_i32(w, "t.i32", -2000000000, &e_));
    OK(fitm_gguf_writer_set_u64(w, "t.u64", UINT64_MAX, &e_));
    OK(fitm_gguf_writer_set_i64(w, "t.i64", INT64_MIN, &e_));
    OK(fitm_gguf_writer_set_f32(w, "t.f32", 1e-5f, &e_));
    OK(fitm_gguf_writer_set_f64(w, "t.f64", 3.25, &e_));
    OK(fitm_gguf_writer_set_bool(w, "t.bool", true, &e_));
    OK(fitm_gguf_writer_set_strn(w, "t.strn", "a\0b", 3, &e_));
    OK(fitm_gguf_writer_set_str(w, "t.replaced", "first", &e_));
    OK(fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", vocab, N_VOCAB, &e_));
    float scores[N_VOCAB] = {0.f, -1.5f, 2.f, 3.5f, -0.25f};
    OK(fitm_gguf_writer_set_arr(w, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, scores, N_VOCAB,
                                &e_));
    int32_t ttype[N_VOCAB] = {2, 1, 1, 1, 3};
    OK(fitm_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", FITM_GGUF_INT32, ttype, N_VOCAB,
                                &e_));
    uint8_t flags[3] = {1, 0, 1};
    OK(fitm_gguf_writer_set_arr(w, "t.arr_bool", FITM_GGUF_BOOL, flags, 3, &e_));
    double d[2] = {-1.0, 1e300};
    OK(fitm_gguf_writer_set_arr(w, "t.arr_f64", FITM_GGUF_FLOAT64, d, 2, &e_));
    OK(fitm_gguf_writer_set_arr(w, "t.arr_empty", FITM_GGUF_UINT16, NULL, 0, &e_));
    OK(fitm_gguf_writer_set_arr_str(w, "t.arr_str_empty", NULL, 0, &e_));
    OK(fitm_gguf_writer_set_str(w, "t.replaced", "second", &e_));

    /* Tensors of several types; payload bytes are a pattern so misplaced data shows. */
    static uint8_t payload[4096];
    for (size_t i = 0; i < sizeof payload; i++)
        payload[i] = (uint8_t)(i * 7 + 3);
    int64_t ne_a[2] = {8, 3};       /* F32: 96 bytes */
    int64_t ne_b[1] = {64};         /* Q8_0: 2 blocks = 68 bytes */
    int64_t ne_c[3] = {256, 1, 2};  /* Q4_K: 2 blocks = 288 bytes */
    int64_t ne_d[4] = {2, 3, 4, 5}; /* F16: 240 bytes */
    int64_t ne_e[2] = {32, 2};      /* Q5_0: 2 blocks = 44 bytes */
    OK(fitm_gguf_writer_add_tensor(w, "a.weight", FITM_DTYPE_F32, 2, ne_a, payload, 96, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "b.weight", FITM_DTYPE_Q8_0, 1, ne_b, payload + 1, 68, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "c.weight", FITM_DTYPE_Q4_K, 3, ne_c, payload + 2, 288, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "d.weight", FITM_DTYPE_F16, 4, ne_d, payload + 3, 240, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "e.weight", FITM_DTYPE_Q5_0, 2, ne_e, payload + 4, 44, &e_));
    return w;
}

static bool str_eq(fitm_gguf_str s, const char *want, size_t len)
{
    return s.ptr && s.len == len && memcmp(s.ptr, want, len) == 0;
}

static void check_sample(const fitm_gguf *g, const uint8_t *file, uint32_t alignment)
{
    fitm_err err = {{0}};
    CHECK(fitm_gguf_version(g) == 3, "version %u", fitm_gguf_version(g));
    CHECK(fitm_gguf_alignment(g) == alignment, "alignment %u", fitm_gguf_alignment(g));
    CHECK(fitm_gguf_n_kv(g) == 22, "n_kv %" PRId64, fitm_gguf_n_kv(g));
    CHECK(fitm_gguf_n_tensors(g) == 5, "n_tensors %" PRId64, fitm_gguf_n_tensors(g));
    CHECK(fitm_gguf_data_offset(g) % alignment == 0, "data offset %" PRIu64,
          fitm_gguf_data_offset(g));
    /* Insertion order is file order; the replaced key kept its place. */
    CHECK(!strcmp(fitm_gguf_kv_at(g, 0)->key, "general.architecture"), "kv 0");
    CHECK(!strcmp(fitm_gguf_kv_at(g, 14)->key, "t.replaced"), "kv 14 %s",
          fitm_gguf_kv_at(g, 14)->key);
    CHECK(fitm_gguf_kv_at(g, 22) == NULL && fitm_gguf_kv_at(g, -1) == NULL, "kv_at out of range");

    fitm_gguf_str s;
    CHECK(fitm_gguf_get_str(g, "general.architecture", &s, &err) == FITM_OK &&
              str_eq(s, "llama", 5),
          "arch");
    CHECK(fitm_gguf_get_str(g, "t.strn", &s, &err) == FITM_OK && str_eq(s, "a\0b", 3), "strn");
    CHECK(fitm_gguf_get_str(g, "t.replaced", &s, &err) == FITM_OK && str_eq(s, "second", 6),
          "replaced");

    uint32_t u32 = 0;
    int64_t i64 = 0;
    CHECK(fitm_gguf_get_u32(g, "t.u8", &u32, &err) == FITM_OK && u32 == 200, "u8 %u", u32);
    CHECK(fitm_gguf_get_u32(g, "t.u16", &u32, &err) == FITM_OK && u32 == 60000, "u16 %u", u32);
    CHECK(fitm_gguf_get_u32(g, "t.u32", &u32, &err) == FITM_OK && u32 == 4000000000u, "u32 %u",
          u32);
    CHECK(fitm_gguf_get_i64(g, "t.i8", &i64, &err) == FITM_OK && i64 == -100, "i8");
    CHECK(fitm_gguf_get_i64(g, "t.i16", &i64, &err) == FITM_OK && i64 == -30000, "i16");
    CHECK(fitm_gguf_get_i64(g, "t.i32", &i64, &err) == FITM_OK && i64 == -2000000000, "i32");
    CHECK(fitm_gguf_get_i64(g, "t.i64", &i64, &err) == FITM_OK && i64 == INT64_MIN, "i64");
    CHECK(fitm_gguf_get_i64(g, "t.u32", &i64, &err) == FITM_OK && i64 == 4000000000, "u32 as i64");
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "t.u64");
    uint64_t u64 = 0;
    CHECK(kv && kv->type == FITM_GGUF_UINT64, "u64 type");
    if (kv)
        memcpy(&u64, kv->value, 8);
    CHECK(u64 == UINT64_MAX, "u64 raw");

    /* Values that do not fit, wrong types, absent keys. */
    strcpy(err.msg, "untouched");
    CHECK(fitm_gguf_get_u32(g, "no.such.key", &u32, &err) == FITM_ERR_NOT_FOUND, "absent");
    CHECK(!strcmp(err.msg, "untouched"), "absent key wrote err: %s", err.msg);
    CHECK(fitm_gguf_get_u32(g, "t.i8", &u32, &err) == FITM_ERR_FORMAT && strstr(err.msg, "t.i8"),
          "negative as u32: %s", err.msg);
    CHECK(fitm_gguf_get_u32(g, "t.u64", &u32, &err) == FITM_ERR_FORMAT && strstr(err.msg, "uint32"),
          "u64 as u32: %s", err.msg);
    CHECK(fitm_gguf_get_i64(g, "t.u64", &i64, &err) == FITM_ERR_FORMAT, "u64 max as i64");
    CHECK(fitm_gguf_get_u32(g, "t.f32", &u32, &err) == FITM_ERR_FORMAT &&
              strstr(err.msg, "float32"),
          "f32 as u32: %s", err.msg);
    CHECK(fitm_gguf_get_str(g, "t.u32", &s, &err) == FITM_ERR_FORMAT &&
              strstr(err.msg, "expected string"),
          "u32 as str: %s", err.msg);

    float f = 0;
    bool b = false;
    CHECK(fitm_gguf_get_f32(g, "t.f32", &f, &err) == FITM_OK && f == 1e-5f, "f32 %g", f);
    CHECK(fitm_gguf_get_f32(g, "t.f64", &f, &err) == FITM_OK && f == 3.25f, "f64 %g", f);
    CHECK(fitm_gguf_get_bool(g, "t.bool", &b, &err) == FITM_OK && b, "bool");
    CHECK(fitm_gguf_get_bool(g, "t.u8", &b, &err) == FITM_ERR_FORMAT, "u8 as bool");

    /* Arrays. */
    const void *data = NULL;
    uint64_t n = 0;
    CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, &data, &n, &err) ==
                  FITM_OK &&
              n == N_VOCAB,
          "tokens n=%" PRIu64, n);
    kv = fitm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    for (uint64_t i = 0; i < N_VOCAB; i++)
        CHECK(str_eq(fitm_gguf_arr_str(g, kv, i), vocab[i], strlen(vocab[i])), "token %" PRIu64, i);
    CHECK(fitm_gguf_arr_str(g, kv, N_VOCAB).ptr == NULL, "token past end");
    CHECK(fitm_gguf_arr_str(g, fitm_gguf_find_kv(g, "t.arr_f64"), 0).ptr == NULL,
          "arr_str on f64 array");
    CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_INT32, &data, &n, &err) ==
                  FITM_ERR_FORMAT &&
              strstr(err.msg, "array of string"),
          "tokens as int32: %s", err.msg);
    CHECK(fitm_gguf_get_arr(g, "t.u32", FITM_GGUF_UINT32, &data, &n, &err) == FITM_ERR_FORMAT,
          "scalar as arr");
    CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, &data, &n, &err) ==
                  FITM_OK &&
              n == N_VOCAB,
          "scores");
    float sc[N_VOCAB];
    memcpy(sc, data, sizeof sc);
    CHECK(sc[1] == -1.5f && sc[3] == 3.5f && sc[4] == -0.25f, "score values");
    CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.token_type", FITM_GGUF_INT32, &data, &n, &err) ==
              FITM_OK,
          "token_type");
    int32_t tt[N_VOCAB];
    memcpy(tt, data, sizeof tt);
    CHECK(tt[0] == 2 && tt[4] == 3, "token_type values");
    CHECK(fitm_gguf_get_arr(g, "t.arr_bool", FITM_GGUF_BOOL, &data, &n, &err) == FITM_OK &&
              n == 3 && !memcmp(data, "\1\0\1", 3),
          "bool array");
    double dd[2];
    CHECK(fitm_gguf_get_arr(g, "t.arr_f64", FITM_GGUF_FLOAT64, &data, &n, &err) == FITM_OK &&
              n == 2,
          "f64 arr");
    memcpy(dd, data, sizeof dd);
    CHECK(dd[0] == -1.0 && dd[1] == 1e300, "f64 values");
    CHECK(fitm_gguf_get_arr(g, "t.arr_empty", FITM_GGUF_UINT16, &data, &n, &err) == FITM_OK &&
              n == 0,
          "empty");
    CHECK(fitm_gguf_get_arr(g, "t.arr_str_empty", FITM_GGUF_STRING, NULL, &n, &err) == FITM_OK &&
              n == 0,
          "empty str arr");

    /* Tensors. */
    static const struct {
        const char *name;
        fitm_dtype type;
        int32_t n_dims;
        int64_t ne[4];
        uint64_t n_bytes;
        int shift;
    } want[] = {
        {"a.weight", FITM_DTYPE_F32, 2, {8, 3, 1, 1}, 96, 0},
        {"b.weight", FITM_DTYPE_Q8_0, 1, {64, 1, 1, 1}, 68, 1},
        {"c.weight", FITM_DTYPE_Q4_K, 3, {256, 1, 2, 1}, 288, 2},
        {"d.weight", FITM_DTYPE_F16, 4, {2, 3, 4, 5}, 240, 3},
        {"e.weight", FITM_DTYPE_Q5_0, 2, {32, 2, 1, 1}, 44, 4},
    };
    for (int i = 0; i < 5; i++) {
        const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
        CHECK(t && fitm_gguf_find_tensor(g, want[i].name) == t, "tensor %d lookup", i);
        if (!t)
            continue;
        CHECK(!strcmp(t->name, want[i].name), "name %s", t->name);
        CHECK(t->type == want[i].type && t->n_dims == want[i].n_dims, "%s type/dims", t->name);
        CHECK(!memcmp(t->ne, want[i].ne, sizeof t->ne), "%s ne", t->name);
        CHECK(t->n_elems == want[i].ne[0] * want[i].ne[1] * want[i].ne[2] * want[i].ne[3],
              "%s n_elems", t->name);
        CHECK(t->n_bytes == want[i].n_bytes, "%s n_bytes %" PRIu64, t->name, t->n_bytes);
        CHECK(t->offset % alignment == 0, "%s offset %" PRIu64, t->name, t->offset);
        CHECK((const uint8_t *)t->data == file + fitm_gguf_data_offset(g) + t->offset,
              "%s data ptr", t->name);
        int bad = 0;
        for (uint64_t k = 0; k < t->n_bytes; k++)
            bad +=
                ((const uint8_t *)t->data)[k] != (uint8_t)((k + (uint64_t)want[i].shift) * 7 + 3);
        CHECK(bad == 0, "%s payload differs in %d bytes", t->name, bad);
    }
    CHECK(fitm_gguf_find_tensor(g, "z.weight") == NULL && fitm_gguf_tensor_at(g, 5) == NULL,
          "absent tensor");
}

static void test_round_trip(void)
{
    uint32_t aligns[] = {32, 64, 1, 8};
    for (size_t a = 0; a < sizeof aligns / sizeof aligns[0]; a++) {
        fitm_gguf_writer *w = build_sample(aligns[a]);
        void *bytes = NULL;
        size_t n = 0;
        OK(fitm_gguf_writer_write_memory(w, &bytes, &n, &e_));
        fitm_gguf *g = NULL;
        fitm_err err = {{0}};
        fitm_status st = fitm_gguf_open_memory(&g, bytes, n, &err);
        CHECK(st == FITM_OK, "open sample (align %u): %s", aligns[a], err.msg);
        if (g)
            check_sample(g, bytes, aligns[a]);
        CHECK(fitm_gguf_file_bytes(g) == n, "file bytes");
        fitm_gguf_close(g);

        /* Through a file and mmap. */
        char path[] = "/tmp/fitm_test_gguf_XXXXXX";
        int fd = mkstemp(path);
        CHECK(fd >= 0, "mkstemp");
        if (fd >= 0) {
            fclose(fdopen(fd, "w"));
            OK(fitm_gguf_writer_write(w, path, &e_));
            g = NULL;
            st = fitm_gguf_open(&g, path, &err);
            CHECK(st == FITM_OK, "open file: %s", err.msg);
            if (g) {
                const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, 0);
                check_sample(g, (const uint8_t *)t->data - fitm_gguf_data_offset(g) - t->offset,
                             aligns[a]);
                /* The mapping is page-aligned, so data pointers honour the alignment. */
                for (int i = 0; i < 5; i++)
                    CHECK((uintptr_t)fitm_gguf_tensor_at(g, i)->data % aligns[a] == 0,
                          "mmap data alignment");
            }
            fitm_gguf_close(g);
            remove(path);
        }
        free(bytes);
        fitm_gguf_writer_destroy(w);
    }
}

/* The writer's output for a tiny file must equal the same file assembled from the spec. */
static void test_writer_bytes(void)
{
    bb want = {0};
    header(&want, 3, 2, 3);
    put_str(&want, "general.architecture");
    put_u32(&want, FITM_GGUF_STRING);
    put_str(&want, "llama");
    put_str(&want, "x.list");
    put_u32(&want, FITM_GGUF_ARRAY);
    put_u32(&want, FITM_GGUF_INT16);
    put_u64(&want, 3);
    int16_t vals[3] = {1, -2, 3};
    put(&want, vals, 6);
    put_str(&want, "x.names");
    put_u32(&want, FITM_GGUF_ARRAY);
    put_u32(&want, FITM_GGUF_STRING);
    put_u64(&want, 2);
    put_str(&want, "ab");
    put_str(&want, "");
    uint64_t ne1[2] = {4, 2}, ne2[1] = {32};
    tinfo(&want, "w1", 2, ne1, FITM_DTYPE_F32, 0);
    tinfo(&want, "w2", 1, ne2, FITM_DTYPE_Q8_0, 32);
    pad(&want, 32);
    float w1[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint8_t w2[34];
    for (int i = 0; i < 34; i++)
        w2[i] = (uint8_t)(0xA0 + i);
    put(&want, w1, 32);
    put(&want, w2, 34);
    pad(&want, 32);

    fitm_gguf_writer *w;
    OK(fitm_gguf_writer_create(&w, &e_));
    OK(fitm_gguf_writer_set_str(w, "general.architecture", "llama", &e_));
    OK(fitm_gguf_writer_set_arr(w, "x.list", FITM_GGUF_INT16, vals, 3, &e_));
    const char *names[2] = {"ab", ""};
    OK(fitm_gguf_writer_set_arr_str(w, "x.names", names, 2, &e_));
    int64_t n1[2] = {4, 2}, n2[1] = {32};
    OK(fitm_gguf_writer_add_tensor(w, "w1", FITM_DTYPE_F32, 2, n1, w1, 32, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "w2", FITM_DTYPE_Q8_0, 1, n2, w2, 34, &e_));
    void *got = NULL;
    size_t n = 0;
    OK(fitm_gguf_writer_write_memory(w, &got, &n, &e_));
    CHECK(n == want.n && !memcmp(got, want.p, n), "writer bytes differ (%zu vs %zu)", n, want.n);
    free(got);

    /* Version 2 writes the same layout with version 2, and the reader takes it. */
    OK(fitm_gguf_writer_set_version(w, 2, &e_));
    OK(fitm_gguf_writer_write_memory(w, &got, &n, &e_));
    uint32_t v = 0;
    memcpy(&v, (uint8_t *)got + 4, 4);
    CHECK(v == 2 && n == want.n && !memcmp((uint8_t *)got + 8, want.p + 8, n - 8), "v2 bytes");
    fitm_gguf *g = NULL;
    fitm_err err = {{0}};
    CHECK(fitm_gguf_open_memory(&g, got, n, &err) == FITM_OK && fitm_gguf_version(g) == 2,
          "open v2: %s", err.msg);
    fitm_gguf_close(g);
    free(got);

    /* Writer argument checks. */
    int64_t bad_ne[2] = {33, 1};
    CHECK(fitm_gguf_writer_add_tensor(w, "w3", FITM_DTYPE_Q8_0, 2, bad_ne, w2, 34, &err) ==
                  FITM_ERR_INVALID &&
              strstr(err.msg, "block size"),
          "writer block size: %s", err.msg);
    CHECK(fitm_gguf_writer_add_tensor(w, "w1", FITM_DTYPE_F32, 2, n1, w1, 32, &err) ==
                  FITM_ERR_INVALID &&
              strstr(err.msg, "already"),
          "writer dup tensor: %s", err.msg);
    CHECK(fitm_gguf_writer_add_tensor(w, "w4", FITM_DTYPE_F32, 2, n1, w1, 31, &err) ==
              FITM_ERR_INVALID,
          "writer size mismatch");
    CHECK(fitm_gguf_writer_set_u32(w, "general.alignment", 48, &err) == FITM_ERR_INVALID,
          "writer align 48");
    CHECK(fitm_gguf_writer_set_u64(w, "general.alignment", 64, &err) == FITM_ERR_INVALID,
          "writer align u64");
    CHECK(fitm_gguf_writer_set_version(w, 1, &err) == FITM_ERR_INVALID, "writer v1");
    uint8_t two = 2;
    CHECK(fitm_gguf_writer_set_scalar(w, "x.b", FITM_GGUF_BOOL, &two, &err) == FITM_ERR_INVALID,
          "writer bool 2");
    CHECK(fitm_gguf_writer_set_arr(w, "x.s", FITM_GGUF_STRING, names, 2, &err) == FITM_ERR_INVALID,
          "writer set_arr of strings");
    fitm_gguf_writer_destroy(w);
    fitm_gguf_writer_destroy(NULL);
    fitm_gguf_close(NULL);
    free(want.p);
}

/* Nested arrays (the writer does not make them): readable, and contents validated. */
static void test_nested_ok(void)
{
    bb b = {0};
    header(&b, 3, 0, 2);
    put_str(&b, "x.nested");
    put_u32(&b, FITM_GGUF_ARRAY);
    put_u32(&b, FITM_GGUF_ARRAY); /* array of 2 arrays */
    put_u64(&b, 2);
    put_u32(&b, FITM_GGUF_STRING);
    put_u64(&b, 1);
    put_str(&b, "in");
    put_u32(&b, FITM_GGUF_UINT8);
    put_u64(&b, 3);
    put(&b, "\1\2\3", 3);
    kv_u32(&b, "x.after", 7);
    fitm_gguf *g = NULL;
    fitm_err err = {{0}};
    CHECK(fitm_gguf_open_memory(&g, b.p, b.n, &err) == FITM_OK, "nested: %s", err.msg);
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "x.nested");
    CHECK(kv && kv->type == FITM_GGUF_ARRAY && kv->arr_type == FITM_GGUF_ARRAY && kv->arr_n == 2,
          "nested kv");
    uint32_t v = 0;
    CHECK(fitm_gguf_get_u32(g, "x.after", &v, &err) == FITM_OK && v == 7, "after nested");
    fitm_gguf_close(g);
    free(b.p);
}

/* ---------------------------------------------------------------------------------------- */
/* Corrupt files. Each builder writes one file; the reader must reject it with the status and
 * a message containing the substring. */

static void c_empty(bb *b)
{
    (void)b;
}
static void c_magic(bb *b)
{
    header(b, 3, 0, 0);
    b->p[3] = 'X';
}
static void c_v1(bb *b)
{
    header(b, 1, 0, 0);
}
static void c_v4(bb *b)
{
    header(b, 4, 0, 0);
}
static void c_big_endian(bb *b)
{
    header(b, 0x03000000u, 0, 0);
}
static void c_short_header(bb *b)
{
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, 0);
    put_u32(b, 0);
}
static void c_kv_count(bb *b)
{
    header(b, 3, 0, UINT64_MAX / 2);
    kv_u32(b, "a", 1);
}
static void c_tensor_count(bb *b)
{
    header(b, 3, (uint64_t)1 << 40, 1);
    kv_u32(b, "a", 1);
    put(b, NULL, 200);
}
static void c_key_len(bb *b)
{
    header(b, 3, 0, 1);
    put_u64(b, 1000);
    put(b, "abcdefghijklmnopqrstuvwxyz", 26);
}
static void c_key_empty(bb *b)
{
    header(b, 3, 0, 1);
    kv_u32(b, "", 1);
}
static void c_key_nul(bb *b)
{
    header(b, 3, 0, 1);
    put_u64(b, 3);
    put(b, "a\0b", 3);
    put_u32(b, FITM_GGUF_UINT32);
    put_u32(b, 1);
}
static void c_key_huge(bb *b)
{
    header(b, 3, 0, 1);
    put_u64(b, 70000);
    for (int i = 0; i < 70000; i++)
        put_u8(b, 'k');
    put_u32(b, FITM_GGUF_UINT8);
    put_u8(b, 0);
}
static void c_value_type(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.key");
    put_u32(b, 13);
    put_u64(b, 0);
}
static void c_str_len(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.str");
    put_u32(b, FITM_GGUF_STRING);
    put_u64(b, 1u << 20);
    put(b, "short", 5);
}
static void c_str_len_max(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.str");
    put_u32(b, FITM_GGUF_STRING);
    put_u64(b, UINT64_MAX);
    put(b, "short", 5);
}
static void c_arr_count(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.arr");
    put_u32(b, FITM_GGUF_ARRAY);
    put_u32(b, FITM_GGUF_UINT32);
    put_u64(b, UINT64_MAX / 2);
    put_u32(b, 1);
}
static void c_arr_str_count(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "tokenizer.ggml.tokens");
    put_u32(b, FITM_GGUF_ARRAY);
    put_u32(b, FITM_GGUF_STRING);
    put_u64(b, 1000000000000ull);
    put_str(b, "a");
}
static void c_arr_elem_str_len(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "tokenizer.ggml.tokens");
    put_u32(b, FITM_GGUF_ARRAY);
    put_u32(b, FITM_GGUF_STRING);
    put_u64(b, 2);
    put_str(b, "ok");
    put_u64(b, 99);
    put(b, "short", 5);
}
static void c_arr_elem_type(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.arr");
    put_u32(b, FITM_GGUF_ARRAY);
    put_u32(b, 77);
    put_u64(b, 1);
    put_u32(b, 0);
}
static void c_nested_deep(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.deep");
    put_u32(b, FITM_GGUF_ARRAY);
    for (int i = 0; i < 10; i++) {
        put_u32(b, FITM_GGUF_ARRAY);
        put_u64(b, 1);
    }
    put_u32(b, FITM_GGUF_UINT8);
    put_u64(b, 0);
}
static void c_dup_key(bb *b)
{
    header(b, 3, 0, 3);
    kv_u32(b, "a.b", 1);
    kv_u32(b, "c.d", 2);
    kv_u32(b, "a.b", 3);
}
static void c_bool(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "my.flag");
    put_u32(b, FITM_GGUF_BOOL);
    put_u8(b, 2);
}
static void c_align_zero(bb *b)
{
    header(b, 3, 0, 1);
    kv_u32(b, "general.alignment", 0);
}
static void c_align_npot(bb *b)
{
    header(b, 3, 0, 1);
    kv_u32(b, "general.alignment", 48);
}
static void c_align_type(bb *b)
{
    header(b, 3, 0, 1);
    put_str(b, "general.alignment");
    put_u32(b, FITM_GGUF_UINT64);
    put_u64(b, 32);
}
/* One-tensor file: kv count 0, tensor as given, data section of data_bytes. */
static void one_tensor(bb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                       uint64_t offset, size_t data_bytes)
{
    header(b, 3, 1, 0);
    tinfo(b, name, n_dims, ne, type, offset);
    pad(b, 32);
    put(b, NULL, data_bytes);
}
static void c_data_past_end(bb *b)
{
    uint64_t ne[2] = {8, 4}; /* 128 bytes of F32, only 100 present */
    one_tensor(b, "blk.0.attn_q.weight", 2, ne, FITM_DTYPE_F32, 0, 100);
}
static void c_offset_huge(bb *b)
{
    uint64_t ne[1] = {8};
    one_tensor(b, "t", 1, ne, FITM_DTYPE_F32, (uint64_t)1 << 63, 32);
}
static void c_overlap(bb *b)
{
    uint64_t ne[1] = {16}; /* 64 bytes each, second starts at 32 */
    header(b, 3, 2, 0);
    tinfo(b, "first", 1, ne, FITM_DTYPE_F32, 0);
    tinfo(b, "second", 1, ne, FITM_DTYPE_F32, 32);
    pad(b, 32);
    put(b, NULL, 128);
}
static void c_type_foreign(bb *b)
{
    uint64_t ne[1] = {32};
    one_tensor(b, "tok_embd", 1, ne, 3 /* Q4_1 */, 0, 64);
}
static void c_type_absurd(bb *b)
{
    uint64_t ne[1] = {32};
    one_tensor(b, "tok_embd", 1, ne, 0xFFFFFFF0u, 0, 64);
}
static void c_ndims0(bb *b)
{
    uint64_t ne[1] = {1};
    one_tensor(b, "scalar", 0, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_ndims5(bb *b)
{
    uint64_t ne[5] = {1, 1, 1, 1, 1};
    one_tensor(b, "five", 5, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_dim0(bb *b)
{
    uint64_t ne[2] = {4, 0};
    one_tensor(b, "empty", 2, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_elems_overflow(bb *b)
{
    uint64_t ne[3] = {(uint64_t)1 << 32, (uint64_t)1 << 31, 4};
    one_tensor(b, "huge", 3, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_bytes_overflow(bb *b)
{
    uint64_t ne[1] = {(uint64_t)1 << 62}; /* 2^62 F32 elements = 2^64 bytes */
    one_tensor(b, "huge", 1, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_misaligned(bb *b)
{
    uint64_t ne[1] = {4};
    one_tensor(b, "odd", 1, ne, FITM_DTYPE_F32, 16, 64);
}
static void c_misaligned_custom(bb *b)
{
    uint64_t ne[1] = {4};
    header(b, 3, 1, 1);
    kv_u32(b, "general.alignment", 64);
    tinfo(b, "odd64", 1, ne, FITM_DTYPE_F32, 32);
    pad(b, 64);
    put(b, NULL, 128);
}
static void c_dup_tensor(bb *b)
{
    uint64_t ne[1] = {8};
    header(b, 3, 2, 0);
    tinfo(b, "same", 1, ne, FITM_DTYPE_F32, 0);
    tinfo(b, "same", 1, ne, FITM_DTYPE_F32, 32);
    pad(b, 32);
    put(b, NULL, 64);
}
static void c_block_multiple(bb *b)
{
    uint64_t ne[2] = {48, 2};
    one_tensor(b, "blk.0.ffn_up.weight", 2, ne, FITM_DTYPE_Q8_0, 0, 256);
}
static void c_block_kquant(bb *b)
{
    uint64_t ne[1] = {128};
    one_tensor(b, "kq", 1, ne, FITM_DTYPE_Q4_K, 0, 256);
}
static void c_name_empty(bb *b)
{
    uint64_t ne[1] = {8};
    one_tensor(b, "", 1, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_name_long(bb *b)
{
    char name[80];
    memset(name, 'n', 65);
    name[65] = '\0';
    uint64_t ne[1] = {8};
    one_tensor(b, name, 1, ne, FITM_DTYPE_F32, 0, 32);
}
static void c_name_nul(bb *b)
{
    uint64_t ne[1] = {8};
    one_tensor(b, "ab", 1, ne, FITM_DTYPE_F32, 0, 32);
    b->p[33] = '\0'; /* the name's second byte (length at 24, bytes at 32) */
}
static void c_name_past_end(bb *b)
{
    header(b, 3, 1, 0);
    put_u64(b, 500);
    put(b, NULL, 40);
}
static void c_tensor_truncated(bb *b)
{
    uint64_t ne[2] = {8, 8};
    header(b, 3, 1, 0);
    tinfo(b, "cut", 2, ne, FITM_DTYPE_F32, 0);
    b->n -= 6; /* cut inside the offset field */
}

typedef struct {
    const char *what;
    void (*build)(bb *b);
    fitm_status status;
    const char *msg;
} corrupt_case;

static const corrupt_case cases[] = {
    {"empty file", c_empty, FITM_ERR_FORMAT, "bad magic"},
    {"bad magic", c_magic, FITM_ERR_FORMAT, "bad magic"},
    {"version 1", c_v1, FITM_ERR_UNSUPPORTED, "version 1 is not supported"},
    {"version 4", c_v4, FITM_ERR_UNSUPPORTED, "unsupported GGUF version 4 "},
    {"big-endian", c_big_endian, FITM_ERR_UNSUPPORTED, "big-endian"},
    {"short header", c_short_header, FITM_ERR_FORMAT, "reading the tensor and key/value counts"},
    {"absurd kv count", c_kv_count, FITM_ERR_FORMAT,
     "metadata key/value count 9223372036854775807"},
    {"absurd tensor count", c_tensor_count, FITM_ERR_FORMAT, "tensor count 1099511627776"},
    {"key past end", c_key_len, FITM_ERR_FORMAT, "key length 1000"},
    {"empty key", c_key_empty, FITM_ERR_FORMAT, "metadata entry 0 at byte 24 has an empty key"},
    {"NUL in key", c_key_nul, FITM_ERR_FORMAT, "key at byte 32 contains a NUL byte"},
    {"key too long", c_key_huge, FITM_ERR_FORMAT, "key is 70000 bytes long"},
    {"unknown value type", c_value_type, FITM_ERR_FORMAT,
     "key 'my.key': unknown value type 13 at byte 38"},
    {"string past end", c_str_len, FITM_ERR_FORMAT, "my.str: string length 1048576"},
    {"string length max", c_str_len_max, FITM_ERR_FORMAT,
     "my.str: string length 18446744073709551615"},
    {"array count", c_arr_count, FITM_ERR_FORMAT, "key 'my.arr': array count 9223372036854775807"},
    {"string array count", c_arr_str_count, FITM_ERR_FORMAT, "array count 1000000000000"},
    {"array string past end", c_arr_elem_str_len, FITM_ERR_FORMAT,
     "tokenizer.ggml.tokens: string length 99"},
    {"array element type", c_arr_elem_type, FITM_ERR_FORMAT,
     "key 'my.arr': unknown array element type 77"},
    {"nested too deep", c_nested_deep, FITM_ERR_FORMAT,
     "key 'my.deep': arrays nested more than 4 deep"},
    {"duplicate key", c_dup_key, FITM_ERR_FORMAT, "duplicate metadata key 'a.b'"},
    {"bool 2", c_bool, FITM_ERR_FORMAT, "key 'my.flag': bool value 2"},
    {"alignment 0", c_align_zero, FITM_ERR_FORMAT,
     "general.alignment 0 is not a nonzero power of two"},
    {"alignment 48", c_align_npot, FITM_ERR_FORMAT,
     "general.alignment 48 is not a nonzero power of two"},
    {"alignment u64", c_align_type, FITM_ERR_FORMAT,
     "general.alignment has type uint64, expected uint32"},
    {"data past end", c_data_past_end, FITM_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': data at offset 0 (+128 bytes) runs past the end"},
    {"offset 2^63", c_offset_huge, FITM_ERR_FORMAT,
     "tensor 't': data at offset 9223372036854775808"},
    {"overlap", c_overlap, FITM_ERR_FORMAT, "tensors 'first' and 'second' overlap"},
    {"foreign type", c_type_foreign, FITM_ERR_UNSUPPORTED,
     "tensor 'tok_embd': tensor type id 3 (Q4_1) is not one fitm reads"},
    {"absurd type", c_type_absurd, FITM_ERR_UNSUPPORTED, "tensor type id 4294967280 (unknown)"},
    {"n_dims 0", c_ndims0, FITM_ERR_FORMAT, "tensor 'scalar': n_dims 0 is outside 1..4"},
    {"n_dims 5", c_ndims5, FITM_ERR_FORMAT, "tensor 'five': n_dims 5 is outside 1..4"},
    {"dim 0", c_dim0, FITM_ERR_FORMAT, "tensor 'empty': dimension 1 is 0"},
    {"element overflow", c_elems_overflow, FITM_ERR_FORMAT,
     "tensor 'huge': element count overflows"},
    {"byte overflow", c_bytes_overflow, FITM_ERR_FORMAT, "tensor 'huge': byte size overflows"},
    {"misaligned offset", c_misaligned, FITM_ERR_FORMAT,
     "tensor 'odd': data offset 16 is not a multiple of the alignment 32"},
    {"misaligned custom", c_misaligned_custom, FITM_ERR_FORMAT,
     "data offset 32 is not a multiple of the alignment 64"},
    {"duplicate tensor", c_dup_tensor, FITM_ERR_FORMAT, "duplicate tensor name 'same'"},
    {"block multiple", c_block_multiple, FITM_ERR_FORMAT,
     "ne[0] = 48 is not a multiple of the Q8_0 block size 32"},
    {"k-quant block", c_block_kquant, FITM_ERR_FORMAT,
     "ne[0] = 128 is not a multiple of the Q4_K block size 256"},
    {"empty tensor name", c_name_empty, FITM_ERR_FORMAT, "tensor 0 at byte 24 has an empty name"},
    {"long tensor name", c_name_long, FITM_ERR_FORMAT, "is 65 bytes long (at most 64)"},
    {"NUL in tensor name", c_name_nul, FITM_ERR_FORMAT,
     "tensor 0 name at byte 32 contains a NUL byte"},
    {"tensor name past end", c_name_past_end, FITM_ERR_FORMAT, "tensor 0: name length 500"},
    {"tensor info truncated", c_tensor_truncated, FITM_ERR_FORMAT,
     "tensor 'cut': file truncated at byte"},
};

static void test_corrupt(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bb b = {0};
        cases[i].build(&b);
        /* An exact-size copy, so a read past the end is an ASan error, not a silent pass. */
        uint8_t *copy = malloc(b.n ? b.n : 1);
        if (b.n)
            memcpy(copy, b.p, b.n);
        fitm_gguf *g = (fitm_gguf *)1;
        fitm_err err = {{0}};
        fitm_status st = fitm_gguf_open_memory(&g, copy, b.n, &err);
        CHECK(st == cases[i].status && g == NULL && strstr(err.msg, cases[i].msg),
              "case '%s': got %s \"%s\", want %s \"%s\"", cases[i].what, fitm_status_name(st),
              err.msg, fitm_status_name(cases[i].status), cases[i].msg);
        free(copy);
        free(b.p);
    }
    printf("corrupt cases: %zu\n", sizeof cases / sizeof cases[0]);

    /* From disk: the message is prefixed with the path. */
    bb b = {0};
    c_dup_key(&b);
    char path[] = "/tmp/fitm_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    CHECK(f != NULL, "temp file");
    if (f) {
        fwrite(b.p, 1, b.n, f);
        fclose(f);
        fitm_gguf *g = NULL;
        fitm_err err = {{0}};
        CHECK(fitm_gguf_open(&g, path, &err) == FITM_ERR_FORMAT && strstr(err.msg, path) &&
                  strstr(err.msg, "duplicate metadata key 'a.b'"),
              "file message: %s", err.msg);
        remove(path);
        CHECK(fitm_gguf_open(&g, path, &err) == FITM_ERR_NOT_FOUND && g == NULL, "missing file: %s",
              err.msg);
        CHECK(fitm_gguf_open(&g, "/tmp", &err) == FITM_ERR_IO &&
                  strstr(err.msg, "not a regular file"),
              "directory: %s", err.msg);
    }
    free(b.p);
}

/* Every prefix of a valid file is invalid (the last tensor ends the file without padding),
 * and every single-byte change either fails cleanly or opens to a walkable result. */
static void test_truncation_and_flips(void)
{
    fitm_gguf_writer *w;
    OK(fitm_gguf_writer_create(&w, &e_));
    OK(fitm_gguf_writer_set_str(w, "general.architecture", "llama", &e_));
    OK(fitm_gguf_writer_set_u32(w, "llama.block_count", 2, &e_));
    OK(fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", vocab, N_VOCAB, &e_));
    float sc[3] = {1, 2, 3};
    OK(fitm_gguf_writer_set_arr(w, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, sc, 3, &e_));
    OK(fitm_gguf_writer_set_bool(w, "x.flag", false, &e_));
    uint8_t data[64] = {0};
    int64_t ne1[1] = {8}, ne2[2] = {8, 2};
    OK(fitm_gguf_writer_add_tensor(w, "a", FITM_DTYPE_F32, 1, ne1, data, 32, &e_));
    OK(fitm_gguf_writer_add_tensor(w, "b", FITM_DTYPE_F32, 2, ne2, data, 64, &e_));
    void *full = NULL;
    size_t n = 0;
    OK(fitm_gguf_writer_write_memory(w, &full, &n, &e_));
    fitm_gguf_writer_destroy(w);

    int bad = 0;
    for (size_t cut = 0; cut < n; cut++) {
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, full, cut);
        fitm_gguf *g = NULL;
        fitm_err err = {{0}};
        fitm_status st = fitm_gguf_open_memory(&g, copy, cut, &err);
        if (st == FITM_OK || g != NULL || err.msg[0] == '\0') {
            if (bad++ < 5)
                fprintf(stderr, "truncation at %zu: status %s msg '%s'\n", cut,
                        fitm_status_name(st), err.msg);
        }
        fitm_gguf_close(g);
        free(copy);
    }
    CHECK(bad == 0, "%d truncations were not rejected (file of %zu bytes)", bad, n);

    int opened = 0;
    uint8_t *copy = malloc(n);
    for (size_t pos = 0; pos < n; pos++) {
        static const uint8_t xors[] = {0x01, 0x80, 0xff};
        for (size_t x = 0; x < sizeof xors; x++) {
            memcpy(copy, full, n);
            copy[pos] ^= xors[x];
            fitm_gguf *g = NULL;
            fitm_err err = {{0}};
            fitm_status st = fitm_gguf_open_memory(&g, copy, n, &err);
            CHECK((st == FITM_OK) == (g != NULL) && (st == FITM_OK || err.msg[0]), "flip at %zu",
                  pos);
            if (g) {
                opened++;
                for (int64_t i = 0; i < fitm_gguf_n_kv(g); i++) {
                    const fitm_gguf_kv *kv = fitm_gguf_kv_at(g, i);
                    CHECK(fitm_gguf_find_kv(g, kv->key) == kv, "flip lookup");
                    if (kv->type == FITM_GGUF_ARRAY && kv->arr_type == FITM_GGUF_STRING)
                        for (uint64_t k = 0; k < kv->arr_n; k++)
                            CHECK(fitm_gguf_arr_str(g, kv, k).ptr != NULL, "flip arr_str");
                }
                for (int64_t i = 0; i < fitm_gguf_n_tensors(g); i++) {
                    const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
                    const uint8_t *p = t->data;
                    CHECK(p >= copy && p + t->n_bytes <= copy + n, "flip tensor in bounds");
                }
            }
            fitm_gguf_close(g);
        }
    }
    printf("truncations: %zu rejected; single-byte changes: %zu tried, %d still valid\n", n, n * 3,
           opened);
    free(copy);
    free(full);
}

/* ---------------------------------------------------------------------------------------- */
/* Real files. */

static void check_token(const fitm_gguf *g, uint64_t i, const char *want)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    fitm_gguf_str s = fitm_gguf_arr_str(g, kv, i);
    CHECK(str_eq(s, want, strlen(want)), "token %" PRIu64 " is '%.*s', want '%s'", i, (int)s.len,
          s.ptr ? s.ptr : "", want);
}

static void test_shared_data(void)
{
    /* A directory of links to the data files found (tests/testdata.py, run by meson). */
    const char *dir = getenv("FITM_TEST_DATA");
    if (!dir || !*dir) {
        printf("FITM_TEST_DATA not set: shared GGUF files not checked\n");
        return;
    }
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open test data dir %s", dir);
    if (!d)
        return;
    int n_files = 0, saw_stories = 0, saw_gpt2 = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 5 || strcmp(de->d_name + len - 5, ".gguf"))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        fitm_gguf *g = NULL;
        fitm_err err = {{0}};
        fitm_status st = fitm_gguf_open(&g, path, &err);
        CHECK(st == FITM_OK, "%s: %s", path, err.msg);
        if (!g)
            continue;
        n_files++;
        fitm_gguf_str s;
        uint32_t u = 0;
        uint64_t n = 0;
        const void *data;
        if (!strcmp(de->d_name, "stories260K.gguf")) {
            saw_stories = 1;
            CHECK(fitm_gguf_get_str(g, "general.architecture", &s, &err) == FITM_OK &&
                      str_eq(s, "llama", 5),
                  "stories arch");
            CHECK(fitm_gguf_n_tensors(g) == 48, "stories tensors %" PRId64, fitm_gguf_n_tensors(g));
            CHECK(fitm_gguf_get_u32(g, "llama.block_count", &u, &err) == FITM_OK && u == 5,
                  "block_count %u", u);
            CHECK(fitm_gguf_get_u32(g, "llama.embedding_length", &u, &err) == FITM_OK && u == 64,
                  "n_embd %u", u);
            CHECK(fitm_gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &u, &err) == FITM_OK &&
                      u == 4294967295u,
                  "padding id");
            float eps = 0;
            CHECK(fitm_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &eps, &err) ==
                          FITM_OK &&
                      eps == 1e-5f,
                  "eps %g", eps);
            CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, &data, &n,
                                    &err) == FITM_OK &&
                      n == 512,
                  "stories vocab %" PRIu64, n);
            check_token(g, 0, "<unk>");
            check_token(g, 511, "\xe2\x80\x8a");
            const fitm_gguf_tensor *t = fitm_gguf_find_tensor(g, "token_embd.weight");
            CHECK(t && t->type == FITM_DTYPE_F32 && t->n_dims == 2 && t->ne[0] == 64 &&
                      t->ne[1] == 512 && fitm_gguf_data_offset(g) + t->offset == 14176,
                  "token_embd");
            t = fitm_gguf_find_tensor(g, "output_norm.weight");
            CHECK(t && t->n_dims == 1 && t->ne[0] == 64 &&
                      fitm_gguf_data_offset(g) + t->offset == 145248,
                  "output_norm");
        } else if (!strcmp(de->d_name, "ggml-vocab-gpt-2.gguf")) {
            saw_gpt2 = 1;
            CHECK(fitm_gguf_n_tensors(g) == 0, "gpt2 tensors");
            CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, &data, &n,
                                    &err) == FITM_OK &&
                      n == 50257,
                  "gpt2 vocab %" PRIu64, n);
            check_token(g, 0, "!");
            check_token(g, 50256, "<|endoftext|>");
            CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.merges", FITM_GGUF_STRING, &data, &n,
                                    &err) == FITM_OK &&
                      n == 50000,
                  "gpt2 merges");
            const fitm_gguf_kv *m = fitm_gguf_find_kv(g, "tokenizer.ggml.merges");
            CHECK(str_eq(fitm_gguf_arr_str(g, m, 0), "\xc4\xa0 t", 4), "first merge");
            CHECK(fitm_gguf_get_str(g, "tokenizer.ggml.pre", &s, &err) == FITM_OK &&
                      str_eq(s, "gpt-2", 5),
                  "pre");
            CHECK(fitm_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &u, &err) == FITM_OK &&
                      u == 50256,
                  "eos");
        } else if (!strcmp(de->d_name, "ggml-vocab-llama-spm.gguf")) {
            CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, &data, &n,
                                    &err) == FITM_OK &&
                      n == 32000,
                  "spm vocab");
            bool b = false;
            CHECK(fitm_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b, &err) == FITM_OK && b,
                  "add_bos");
        }
        fitm_gguf_close(g);
    }
    closedir(d);
    CHECK(saw_stories && saw_gpt2, "stories260K.gguf and ggml-vocab-gpt-2.gguf expected in %s",
          dir);
    printf("shared data: %d GGUF files opened from %s\n", n_files, dir);
}

int main(void)
{
    test_round_trip();
    test_writer_bytes();
    test_nested_ok();
    test_corrupt();
    test_truncation_and_flips();
    test_shared_data();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all gguf checks passed\n");
    return 0;
}
