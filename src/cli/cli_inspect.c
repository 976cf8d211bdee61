/* cli_inspect: `fitm inspect -m MODEL [--kv] [--tensors]` — what a GGUF file holds, after the
 * reader's full validation: architecture, hyper-parameters, tokenizer, tensor types, sizes. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "model/moice.h"

#define ARR_PREVIEW 8   /* array elements shown per value */
#define STR_PREVIEW 160 /* string bytes shown per value in --kv */

static void usage(FILE *f)
{
    fprintf(f, "usage: fitm inspect [-m] FILE.gguf [--kv] [--tensors]\n"
               "  -m, --model PATH  the GGUF file to inspect: a model, or a MoICE router\n"
               "                    sidecar (docs/moice.md), which is validated in full\n"
               "  --kv              list every metadata key with its type and value\n"
               "  --tensors         list every tensor: name, type, shape, offset, bytes\n");
}

/* Prints a string from the file quoted, escaping control bytes, at most max bytes of it. */
static void print_str(FILE *f, fitm_gguf_str s, uint64_t max)
{
    uint64_t n = s.len < max ? s.len : max;
    fputc('"', f);
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c == '\n')
            fputs("\\n", f);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\x%02x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
    if (n < s.len)
        fprintf(f, "... (%" PRIu64 " bytes)", s.len);
}

/* Prints x with the fewest significant digits that read back as the same value. */
static void print_float(FILE *f, double x, int max_digits, bool is_f32)
{
    char buf[64];
    for (int digits = 6; digits <= max_digits; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, x);
        double back = strtod(buf, NULL);
        if (is_f32 ? (float)back == (float)x : back == x)
            break;
    }
    fputs(buf, f);
}

/* Prints one element of fixed-size type t at p (unaligned). */
static void print_scalar(FILE *f, fitm_gguf_type t, const uint8_t *p)
{
    union {
        uint8_t u8;
        int8_t i8;
        uint16_t u16;
        int16_t i16;
        uint32_t u32;
        int32_t i32;
        float f32;
        uint64_t u64;
        int64_t i64;
        double f64;
    } v;
    memcpy(&v, p, fitm_gguf_type_size(t));
    switch (t) {
    case FITM_GGUF_UINT8:
        fprintf(f, "%" PRIu8, v.u8);
        break;
    case FITM_GGUF_INT8:
        fprintf(f, "%" PRId8, v.i8);
        break;
    case FITM_GGUF_UINT16:
        fprintf(f, "%" PRIu16, v.u16);
        break;
    case FITM_GGUF_INT16:
        fprintf(f, "%" PRId16, v.i16);
        break;
    case FITM_GGUF_UINT32:
        fprintf(f, "%" PRIu32, v.u32);
        break;
    case FITM_GGUF_INT32:
        fprintf(f, "%" PRId32, v.i32);
        break;
    case FITM_GGUF_FLOAT32:
        print_float(f, v.f32, 9, true);
        break;
    case FITM_GGUF_BOOL:
        fputs(v.u8 ? "true" : "false", f);
        break;
    case FITM_GGUF_UINT64:
        fprintf(f, "%" PRIu64, v.u64);
        break;
    case FITM_GGUF_INT64:
        fprintf(f, "%" PRId64, v.i64);
        break;
    case FITM_GGUF_FLOAT64:
        print_float(f, v.f64, 17, false);
        break;
    default:
        fputs("?", f);
        break;
    }
}

/* Prints a key's value: scalars in full, strings up to str_max bytes, arrays as
 * [n x type: first elements ...]. */
static void print_value(FILE *f, const fitm_gguf *g, const fitm_gguf_kv *kv, uint64_t str_max)
{
    if (kv->type == FITM_GGUF_STRING) {
        fitm_gguf_str s;
        memcpy(&s.len, kv->value, 8);
        s.ptr = (const char *)kv->value + 8;
        print_str(f, s, str_max);
        return;
    }
    if (kv->type != FITM_GGUF_ARRAY) {
        print_scalar(f, kv->type, kv->value);
        return;
    }
    fprintf(f, "[%" PRIu64 " x %s", kv->arr_n, fitm_gguf_type_name(kv->arr_type));
    if (kv->arr_type == FITM_GGUF_ARRAY || kv->arr_n == 0) {
        fputc(']', f);
        return;
    }
    fputs(":", f);
    uint64_t n = kv->arr_n < ARR_PREVIEW ? kv->arr_n : ARR_PREVIEW;
    size_t sz = fitm_gguf_type_size(kv->arr_type);
    for (uint64_t i = 0; i < n; i++) {
        fputc(' ', f);
        if (kv->arr_type == FITM_GGUF_STRING)
            print_str(f, fitm_gguf_arr_str(g, kv, i), 40);
        else
            print_scalar(f, kv->arr_type, kv->value + i * sz);
    }
    fputs(n < kv->arr_n ? " ...]" : "]", f);
}

static void print_summary(const fitm_gguf *g, const char *path)
{
    uint64_t bytes = fitm_gguf_file_bytes(g);
    printf("file:           %s\n", path);
    printf("file size:      %" PRIu64 " bytes (%.2f MiB)\n", bytes,
           (double)bytes / (1024.0 * 1024.0));
    printf("GGUF version:   %" PRIu32 "\n", fitm_gguf_version(g));
    printf("alignment:      %" PRIu32 "\n", fitm_gguf_alignment(g));
    printf("metadata keys:  %" PRId64 "\n", fitm_gguf_n_kv(g));

    fitm_gguf_str arch = {"", 0}, s;
    fitm_err err;
    bool have_arch = fitm_gguf_get_str(g, "general.architecture", &arch, &err) == FITM_OK;
    printf("architecture:   ");
    if (have_arch)
        print_str(stdout, arch, 64);
    else
        fputs("(none)", stdout);
    printf("\nname:           ");
    if (fitm_gguf_get_str(g, "general.name", &s, &err) == FITM_OK)
        print_str(stdout, s, 128);
    else
        fputs("(none)", stdout);
    fputc('\n', stdout);

    /* Hyper-parameters: every "<arch>." key. */
    if (have_arch && arch.len > 0 && arch.len < 64) {
        char prefix[72];
        snprintf(prefix, sizeof prefix, "%.*s.", (int)arch.len, arch.ptr);
        size_t plen = strlen(prefix);
        printf("hyper-parameters:\n");
        for (int64_t i = 0; i < fitm_gguf_n_kv(g); i++) {
            const fitm_gguf_kv *kv = fitm_gguf_kv_at(g, i);
            if (strncmp(kv->key, prefix, plen) != 0)
                continue;
            printf("  %-44s = ", kv->key);
            print_value(stdout, g, kv, STR_PREVIEW);
            fputc('\n', stdout);
        }
    }

    printf("tokenizer:      model=");
    if (fitm_gguf_get_str(g, "tokenizer.ggml.model", &s, &err) == FITM_OK)
        print_str(stdout, s, 64);
    else
        fputs("(none)", stdout);
    printf(" pre=");
    if (fitm_gguf_get_str(g, "tokenizer.ggml.pre", &s, &err) == FITM_OK)
        print_str(stdout, s, 64);
    else
        fputs("(none)", stdout);
    uint64_t n_vocab = 0;
    if (fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, NULL, &n_vocab, &err) !=
        FITM_OK)
        n_vocab = 0;
    printf(" vocab=%" PRIu64 "\n", n_vocab);

    int64_t count[FITM_DTYPE_MAX] = {0};
    uint64_t type_bytes[FITM_DTYPE_MAX] = {0};
    uint64_t n_params = 0, n_data = 0;
    for (int64_t i = 0; i < fitm_gguf_n_tensors(g); i++) {
        const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
        count[t->type]++;
        type_bytes[t->type] += t->n_bytes;
        n_params += (uint64_t)t->n_elems;
        n_data += t->n_bytes;
    }
    printf("tensors:        %" PRId64 "\n", fitm_gguf_n_tensors(g));
    for (int t = 0; t < FITM_DTYPE_MAX; t++)
        if (count[t])
            printf("  %-6s %6" PRId64 " tensors %14" PRIu64 " bytes\n", fitm_dtype_info_of(t)->name,
                   count[t], type_bytes[t]);
    printf("parameters:     %" PRIu64 " (%.2f M)\n", n_params, (double)n_params / 1e6);
    printf("tensor data:    %" PRIu64 " bytes (%.2f MiB)\n", n_data,
           (double)n_data / (1024.0 * 1024.0));
}

/* A MoICE sidecar, after fitm_moice_load's checks: the base model it was made for, its
 * experts and routed layers, and how it was trained. 1 when it does not load. */
static int print_moice(const char *path)
{
    fitm_moice *mo = NULL;
    fitm_err err = {{0}};
    if (fitm_moice_load(&mo, path, &err) != FITM_OK) {
        fprintf(stderr, "fitm inspect: %s\n", err.msg);
        return 1;
    }
    const fitm_moice_base *b = fitm_moice_base_of(mo);
    const int32_t N = fitm_moice_n_experts(mo);
    printf("MoICE sidecar:  valid\n");
    printf("  base model:   %s, %u layers, %u heads (%u KV), head dim %u\n", b->architecture,
           b->block_count, b->head_count, b->head_count_kv, b->key_length);
    printf("  base sha256:  %s\n", b->sha256);
    printf("  experts:      %d per routed layer, top_k %d\n", (int)N, (int)fitm_moice_top_k(mo));
    int32_t n_routed = 0;
    for (uint32_t l = 0; l < b->block_count; l++)
        n_routed += fitm_moice_routed(mo, (int32_t)l);
    printf("  routed layers: %d of %u\n", (int)n_routed, b->block_count);
    for (uint32_t l = 0; l < b->block_count; l++) {
        if (!fitm_moice_routed(mo, (int32_t)l))
            continue;
        printf("    layer %3u bases:", l);
        for (int32_t e = 0; e < N; e++)
            printf(" %g", (double)fitm_moice_bases(mo, (int32_t)l)[e]);
        printf("\n");
    }
    const fitm_gguf *g = fitm_moice_gguf(mo);
    printf("  training:\n");
    const char *pre = "fitm-moice.train.";
    int n_train = 0;
    for (int64_t i = 0; i < fitm_gguf_n_kv(g); i++) {
        const fitm_gguf_kv *kv = fitm_gguf_kv_at(g, i);
        if (strncmp(kv->key, pre, strlen(pre)) != 0)
            continue;
        printf("    %-28s = ", kv->key + strlen(pre));
        print_value(stdout, g, kv, STR_PREVIEW);
        fputc('\n', stdout);
        n_train++;
    }
    if (!n_train)
        printf("    (none recorded)\n");
    fitm_moice_destroy(mo);
    return 0;
}

static void print_kvs(const fitm_gguf *g)
{
    printf("metadata:\n");
    for (int64_t i = 0; i < fitm_gguf_n_kv(g); i++) {
        const fitm_gguf_kv *kv = fitm_gguf_kv_at(g, i);
        printf("  %-44s %-7s = ", kv->key, fitm_gguf_type_name(kv->type));
        print_value(stdout, g, kv, STR_PREVIEW);
        fputc('\n', stdout);
    }
}

static void print_tensors(const fitm_gguf *g)
{
    printf("tensor list:    (offset from the data section at byte %" PRIu64 ")\n",
           fitm_gguf_data_offset(g));
    for (int64_t i = 0; i < fitm_gguf_n_tensors(g); i++) {
        const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
        char shape[128];
        int n = snprintf(shape, sizeof shape, "[%" PRId64, t->ne[0]);
        for (int d = 1; d < t->n_dims && n > 0 && (size_t)n < sizeof shape; d++)
            n += snprintf(shape + n, sizeof shape - (size_t)n, ", %" PRId64, t->ne[d]);
        if (n > 0 && (size_t)n < sizeof shape)
            snprintf(shape + n, sizeof shape - (size_t)n, "]");
        printf("  %-40s %-5s %-24s offset %12" PRIu64 " bytes %12" PRIu64 "\n", t->name,
               fitm_dtype_info_of((int)t->type)->name, shape, t->offset, t->n_bytes);
    }
}

int fitm_cli_inspect(int argc, char **argv)
{
    const char *path = NULL;
    bool kv = false, tensors = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--kv")) {
            kv = true;
        } else if (!strcmp(a, "--tensors")) {
            tensors = true;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && i + 1 < argc) {
            path = argv[++i];
        } else if (!strncmp(a, "--model=", 8)) {
            path = a + 8;
        } else if (a[0] != '-' && !path) {
            path = a;
        } else {
            fprintf(stderr, "fitm inspect: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "fitm inspect: no model given (-m MODEL.gguf)\n");
        usage(stderr);
        return 2;
    }
    fitm_gguf *g = NULL;
    fitm_err err = {{0}};
    fitm_status st = fitm_gguf_open(&g, path, &err);
    if (st != FITM_OK) {
        fprintf(stderr, "fitm inspect: %s\n", err.msg);
        return 1;
    }
    print_summary(g, path);
    fitm_gguf_str arch = {"", 0};
    int rc = 0;
    if (fitm_gguf_get_str(g, "general.architecture", &arch, &err) == FITM_OK &&
        arch.len == 10 && !memcmp(arch.ptr, "fitm-moice", 10))
        rc = print_moice(path);
    if (kv)
        print_kvs(g);
    if (tensors)
        print_tensors(g);
    fitm_gguf_close(g);
    return fflush(stdout) == 0 ? rc : 1;
}
