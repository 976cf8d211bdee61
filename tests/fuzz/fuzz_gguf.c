/* fuzz_gguf: libFuzzer target for the GGUF reader. Opens the input as a GGUF file and, when it
 * opens, walks every key/value and tensor through the public accessors, touching every byte the
 * reader hands out, so a pointer past what was validated shows up under ASan. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Folds bytes into a sum the compiler cannot drop. */
static volatile uint64_t sink;

static void touch(const void *p, uint64_t n)
{
    const uint8_t *b = p;
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++)
        s += b[i];
    sink += s;
}

static void walk_kv(const fitm_gguf *g, const fitm_gguf_kv *kv)
{
    fitm_err err;
    uint32_t u32;
    int64_t i64;
    float f;
    bool b;
    fitm_gguf_str s;
    const void *arr;
    uint64_t n;

    touch(kv->key, strlen(kv->key));
    if (fitm_gguf_find_kv(g, kv->key) != kv)
        __builtin_trap(); /* keys are unique after a successful open */
    (void)fitm_gguf_get_u32(g, kv->key, &u32, &err);
    (void)fitm_gguf_get_i64(g, kv->key, &i64, &err);
    (void)fitm_gguf_get_f32(g, kv->key, &f, &err);
    (void)fitm_gguf_get_bool(g, kv->key, &b, &err);
    if (fitm_gguf_get_str(g, kv->key, &s, &err) == FITM_OK)
        touch(s.ptr, s.len);
    if (kv->type != FITM_GGUF_ARRAY) {
        touch(kv->value, fitm_gguf_type_size(kv->type));
        return;
    }
    if (fitm_gguf_get_arr(g, kv->key, kv->arr_type, &arr, &n, &err) != FITM_OK || n != kv->arr_n)
        __builtin_trap();
    if (kv->arr_type == FITM_GGUF_STRING) {
        for (uint64_t i = 0; i < n; i++) {
            s = fitm_gguf_arr_str(g, kv, i);
            if (!s.ptr)
                __builtin_trap();
            touch(s.ptr, s.len);
        }
        if (fitm_gguf_arr_str(g, kv, n).ptr)
            __builtin_trap();
    } else if (kv->arr_type != FITM_GGUF_ARRAY) {
        touch(arr, n * fitm_gguf_type_size(kv->arr_type));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fitm_gguf *g = NULL;
    fitm_err err;
    if (fitm_gguf_open_memory(&g, data, size, &err) != FITM_OK) {
        if (g || !memchr(err.msg, '\0', sizeof err.msg) || err.msg[0] == '\0')
            __builtin_trap(); /* a failure always comes with a message and no handle */
        return 0;
    }
    sink += fitm_gguf_version(g) + fitm_gguf_alignment(g) + fitm_gguf_file_bytes(g) +
            fitm_gguf_data_offset(g);
    for (int64_t i = 0; i < fitm_gguf_n_kv(g); i++)
        walk_kv(g, fitm_gguf_kv_at(g, i));
    for (int64_t i = 0; i < fitm_gguf_n_tensors(g); i++) {
        const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
        if (fitm_gguf_find_tensor(g, t->name) != t)
            __builtin_trap();
        const uint8_t *p = t->data;
        if (p < data || t->n_bytes > size || p + t->n_bytes > data + size)
            __builtin_trap();
        touch(t->name, strlen(t->name));
        touch(t->data, t->n_bytes);
    }
    fitm_gguf_close(g);
    return 0;
}
