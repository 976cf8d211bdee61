/* genmodel unit test: every architecture in every weight type is built in memory, read back
 * through the GGUF reader, and checked against the generator's own F32 source values
 * (fitm_gen_fill) within each format's error; plus determinism, vocabulary consistency and
 * config validation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "compute/quant.h"
#include "gguf/gguf.h"
#include "model/genmodel.h"

static const fitm_dtype TYPES[] = {FITM_DTYPE_F32,  FITM_DTYPE_F16,  FITM_DTYPE_BF16,
                                   FITM_DTYPE_Q8_0, FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0,
                                   FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K};

/* Relative RMS error bound (error RMS / source RMS) of each format on Gaussian data, 1.5-2.5x
 * what a correct quantizer reaches. */
static double rel_rmse_bound(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_F32:
        return 0.0;
    case FITM_DTYPE_F16:
        return 5e-4;
    case FITM_DTYPE_BF16:
        return 4e-3;
    case FITM_DTYPE_Q8_0:
        return 0.009;
    case FITM_DTYPE_Q6_K:
        return 0.027;
    case FITM_DTYPE_Q5_K:
        return 0.055;
    case FITM_DTYPE_Q5_0:
        return 0.065;
    case FITM_DTYPE_Q4_K:
        return 0.11;
    case FITM_DTYPE_Q4_0:
        return 0.13;
    default:
        return 0.0;
    }
}

static fitm_status build_memory(const fitm_gen_config *cfg, void **buf, size_t *n, fitm_err *err)
{
    fitm_gguf_writer *w = NULL;
    fitm_status st = fitm_gen_build(cfg, &w, err);
    if (st == FITM_OK)
        st = fitm_gguf_writer_write_memory(w, buf, n, err);
    fitm_gguf_writer_destroy(w);
    return st;
}

/* Compares a tensor read from the file with the generator's source values. */
static void check_tensor(const fitm_gen_config *cfg, const fitm_gguf_tensor *t)
{
    int64_t n = t->n_elems;
    float *src = calloc((size_t)n, sizeof *src), *got = calloc((size_t)n, sizeof *got);
    fitm_err err = {{0}};
    CHECK(src && got, "out of memory");
    if (!src || !got)
        goto done;
    fitm_status st = fitm_gen_fill(cfg, t->name, src, n, &err);
    CHECK(st == FITM_OK, "fill %s: %s", t->name, err.msg);
    if (st != FITM_OK)
        goto done;
    size_t rb = fitm_dtype_row_bytes(t->type, t->ne[0]);
    for (int64_t r = 0; r < n / t->ne[0]; r++)
        fitm_dequant_row(t->type, (const uint8_t *)t->data + r * rb, got + r * t->ne[0], t->ne[0]);
    double se = 0, ss = 0;
    for (int64_t i = 0; i < n; i++) {
        se += ((double)got[i] - src[i]) * ((double)got[i] - src[i]);
        ss += (double)src[i] * src[i];
    }
    double rel = sqrt(se / ss);
    CHECK(rel <= rel_rmse_bound(t->type), "%s (%s): relative RMS error %.5f > %.5f", t->name,
          fitm_dtype_info_of((int)t->type)->name, rel, rel_rmse_bound(t->type));
done:
    free(src);
    free(got);
}

static bool is_norm_or_bias(const char *name)
{
    return strstr(name, "norm") || strstr(name, ".bias");
}

static void check_model(fitm_gen_arch arch, fitm_dtype type)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    cfg.type = type;
    fitm_err err = {{0}};
    void *buf = NULL, *buf2 = NULL;
    size_t n = 0, n2 = 0;
    fitm_gguf *g = NULL;
    const char *an = fitm_gen_arch_name(arch), *tn = fitm_dtype_info_of((int)type)->name;

    CHECK(build_memory(&cfg, &buf, &n, &err) == FITM_OK, "%s %s: %s", an, tn, err.msg);
    if (!buf)
        goto done;
    /* Byte-identical rebuilds: once per arch here; tests/test_genmodel.py does every type. */
    if (type == FITM_DTYPE_Q8_0) {
        CHECK(build_memory(&cfg, &buf2, &n2, &err) == FITM_OK, "%s %s: %s", an, tn, err.msg);
        CHECK(buf2 && n == n2 && !memcmp(buf, buf2, n), "%s %s: two builds differ", an, tn);
    }
    CHECK(fitm_gguf_open_memory(&g, buf, n, &err) == FITM_OK, "%s %s: reader: %s", an, tn, err.msg);
    if (!g)
        goto done;

    fitm_gguf_str s;
    CHECK(fitm_gguf_get_str(g, "general.architecture", &s, &err) == FITM_OK &&
              s.len == strlen(an) && !memcmp(s.ptr, an, s.len),
          "%s: general.architecture", an);
    char key[96];
    uint32_t L = 0, V = 0;
    snprintf(key, sizeof key, "%s.block_count", an);
    CHECK(fitm_gguf_get_u32(g, key, &L, &err) == FITM_OK && L == (uint32_t)cfg.n_layer, "%s", key);
    const void *arr;
    uint64_t n_tok = 0;
    CHECK(fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, &arr, &n_tok, &err) ==
              FITM_OK,
          "%s: tokens: %s", an, err.msg);
    V = (uint32_t)n_tok;
    CHECK((int64_t)V == fitm_gen_n_vocab(&cfg), "%s: V %u vs %lld", an, V,
          (long long)fitm_gen_n_vocab(&cfg));

    const fitm_gguf_tensor *embd = fitm_gguf_find_tensor(g, "token_embd.weight");
    CHECK(embd && embd->ne[0] == cfg.n_embd && embd->ne[1] == V && embd->type == type,
          "%s %s: token_embd", an, tn);
    CHECK((fitm_gguf_find_tensor(g, "output.weight") == NULL) == (arch == FITM_GEN_ARCH_GEMMA3),
          "%s: output.weight present iff untied", an);

    for (int64_t i = 0; i < fitm_gguf_n_tensors(g); i++) {
        const fitm_gguf_tensor *t = fitm_gguf_tensor_at(g, i);
        fitm_dtype want = is_norm_or_bias(t->name) ? FITM_DTYPE_F32 : type;
        CHECK(t->type == want, "%s %s: %s stored as %d", an, tn, t->name, (int)t->type);
        /* Checking every tensor of every type is cheap enough for all but the largest. */
        check_tensor(&cfg, t);
    }
done:
    fitm_gguf_close(g);
    free(buf);
    free(buf2);
}

/* Every merge's halves and result are tokens; every special id is in range. */
static void check_vocab(fitm_gen_tok tok)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    cfg.tok = tok;
    cfg.n_vocab_extra = 7;
    fitm_err err = {{0}};
    void *buf = NULL;
    size_t n = 0;
    fitm_gguf *g = NULL;
    CHECK(build_memory(&cfg, &buf, &n, &err) == FITM_OK, "%s", err.msg);
    if (!buf || fitm_gguf_open_memory(&g, buf, n, &err) != FITM_OK) {
        CHECK(false, "tokenizer %s: %s", fitm_gen_tok_name(tok), err.msg);
        free(buf);
        return;
    }
    const fitm_gguf_kv *toks = fitm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const fitm_gguf_kv *merges = fitm_gguf_find_kv(g, "tokenizer.ggml.merges");
    CHECK(toks && (int64_t)toks->arr_n == fitm_gen_n_vocab(&cfg), "tokens");
    CHECK((merges != NULL) == (tok == FITM_GEN_TOK_QWEN2 || tok == FITM_GEN_TOK_LLAMA3),
          "merges present iff BPE");
    CHECK((fitm_gguf_find_kv(g, "tokenizer.ggml.scores") != NULL) == (merges == NULL),
          "scores present iff SentencePiece");
    const char *id_keys[] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    for (int k = 0; k < 2; k++) {
        uint32_t id = UINT32_MAX;
        CHECK(fitm_gguf_get_u32(g, id_keys[k], &id, &err) == FITM_OK && toks && id < toks->arr_n,
              "%s", id_keys[k]);
    }
    for (uint64_t m = 0; toks && merges && m < merges->arr_n; m++) {
        fitm_gguf_str ms = fitm_gguf_arr_str(g, merges, m);
        char a[128] = "", b[128] = "", ab[256];
        const char *sp = memchr(ms.ptr, ' ', ms.len);
        CHECK(sp && ms.len < sizeof a, "merge %llu has no space", (unsigned long long)m);
        if (!sp || ms.len >= sizeof a)
            continue;
        memcpy(a, ms.ptr, (size_t)(sp - ms.ptr));
        memcpy(b, sp + 1, ms.len - (size_t)(sp - ms.ptr) - 1);
        snprintf(ab, sizeof ab, "%s%s", a, b);
        int found = 0;
        for (uint64_t i = 0; i < toks->arr_n; i++) {
            fitm_gguf_str ts = fitm_gguf_arr_str(g, toks, i);
            found |= (ts.len == strlen(a) && !memcmp(ts.ptr, a, ts.len)) << 0;
            found |= (ts.len == strlen(b) && !memcmp(ts.ptr, b, ts.len)) << 1;
            found |= (ts.len == strlen(ab) && !memcmp(ts.ptr, ab, ts.len)) << 2;
        }
        CHECK(found == 7, "merge '%s %s': parts/result missing (%d)", a, b, found);
    }
    fitm_gguf_close(g);
    free(buf);
}

static void check_validation(void)
{
    fitm_gen_config cfg;
    fitm_err err = {{0}};
    float x[4];

    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_OK, "defaults: %s", err.msg);
    cfg.n_embd = 96;
    cfg.head_dim = 24;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_OK, "dim 96 F32: %s", err.msg);
    cfg.type = FITM_DTYPE_Q8_0;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_OK, "dim 96 Q8_0: %s", err.msg);
    cfg.type = FITM_DTYPE_Q4_K;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_ERR_INVALID && strstr(err.msg, "256"),
          "dim 96 Q4_K must fail naming 256: %s", err.msg);

    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    cfg.n_head_kv = 3;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_ERR_INVALID, "H %% Hkv");
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    cfg.type = FITM_DTYPE_Q8_K; /* activations only */
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_ERR_INVALID, "Q8_K is not a weight type");
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_GEMMA3);
    cfg.n_swa = 0;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_ERR_INVALID, "gemma3 needs a window");
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_QWEN2);
    cfg.n_layer = 0;
    CHECK(fitm_gen_validate(&cfg, &err) == FITM_ERR_INVALID && strstr(err.msg, "layers"),
          "layers 0: %s", err.msg);
    CHECK(fitm_gen_n_vocab(&cfg) == -1, "n_vocab of an invalid config");

    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_QWEN2);
    CHECK(fitm_gen_fill(&cfg, "blk.0.attn_q.bias", x, 4, &err) == FITM_ERR_INVALID, "fill n");
    CHECK(fitm_gen_fill(&cfg, "blk.9.attn_q.bias", x, 4, &err) == FITM_ERR_NOT_FOUND, "fill name");
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_LLAMA);
    CHECK(fitm_gen_fill(&cfg, "blk.0.attn_q.bias", x, 4, &err) == FITM_ERR_NOT_FOUND,
          "llama has no biases");

    fitm_gen_arch a;
    fitm_gen_tok t;
    CHECK(fitm_gen_parse_arch("gemma3", &a, &err) == FITM_OK && a == FITM_GEN_ARCH_GEMMA3, "arch");
    CHECK(fitm_gen_parse_arch("gpt2", &a, &err) == FITM_ERR_INVALID, "bad arch");
    CHECK(fitm_gen_parse_tok("llama3", &t, &err) == FITM_OK && t == FITM_GEN_TOK_LLAMA3, "tok");
    CHECK(!strcmp(fitm_gen_arch_name((fitm_gen_arch)99), "?"), "name of a bad arch");
}

/* A tensor's values depend on (seed, name) only: not on the type, nor on the layer count. */
static void check_streams(void)
{
    fitm_gen_config a, b;
    fitm_gen_defaults(&a, FITM_GEN_ARCH_LLAMA);
    b = a;
    b.n_layer = 5;
    b.type = FITM_DTYPE_Q6_K;
    enum { N = 256 * 512 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    fitm_err err = {{0}};
    if (!x || !y) {
        CHECK(false, "out of memory");
        goto done;
    }
    CHECK(fitm_gen_fill(&a, "blk.1.ffn_up.weight", x, N, &err) == FITM_OK, "%s", err.msg);
    CHECK(fitm_gen_fill(&b, "blk.1.ffn_up.weight", y, N, &err) == FITM_OK, "%s", err.msg);
    int n_diff = 0;
    for (int i = 0; i < N; i++)
        n_diff += x[i] != y[i];
    CHECK(n_diff == 0, "same (seed, name) must give the same values (%d differ)", n_diff);
    b.seed = 2;
    CHECK(fitm_gen_fill(&b, "blk.1.ffn_up.weight", y, N, &err) == FITM_OK, "%s", err.msg);
    n_diff = 0;
    for (int i = 0; i < N; i++)
        n_diff += x[i] != y[i];
    CHECK(n_diff > N / 2, "another seed must give other values (%d differ)", n_diff);
    double mean = 0, var = 0;
    for (int i = 0; i < N; i++)
        mean += x[i];
    mean /= N;
    for (int i = 0; i < N; i++)
        var += (x[i] - mean) * (x[i] - mean);
    double sd = sqrt(var / N);
    CHECK(fabs(mean) < 0.001 && fabs(sd - 1.0 / 16.0) < 0.001, "ffn_up ~ N(0, 1/C): %g %g", mean,
          sd);
done:
    free(x);
    free(y);
}

int main(void)
{
    check_validation();
    check_streams();
    for (int t = FITM_GEN_TOK_LLAMA; t < FITM_GEN_TOK_COUNT; t++)
        check_vocab((fitm_gen_tok)t);
    for (int a = 0; a < FITM_GEN_ARCH_COUNT; a++)
        for (size_t t = 0; t < sizeof TYPES / sizeof TYPES[0]; t++)
            check_model((fitm_gen_arch)a, TYPES[t]);
    if (failures) {
        fprintf(stderr, "test_genmodel: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_genmodel: ok\n");
    return 0;
}
