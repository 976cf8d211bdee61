/* `fitm mkmodel`: writes a tiny random GGUF model (genmodel.h) for tests and experiments. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "compute/quant.h"
#include "gguf/gguf.h"
#include "model/genmodel.h"

static void usage(FILE *f)
{
    fitm_gen_config d[FITM_GEN_ARCH_COUNT];
    for (int a = 0; a < FITM_GEN_ARCH_COUNT; a++)
        fitm_gen_defaults(&d[a], (fitm_gen_arch)a);
    fprintf(
        f,
        "usage: fitm mkmodel --arch ARCH -o FILE [options]\n"
        "\n"
        "Writes a small GGUF model with random weights (deterministic from --seed) and a\n"
        "built-in tokenizer, in llama.cpp's key and tensor layout.\n"
        "\n"
        "  --arch ARCH        llama | qwen2 | gemma3 (required)\n"
        "  -o, --output FILE  where to write (required)\n"
        "  --type T           weight type of matrices and token_embd: F32 F16 BF16 Q8_0 Q4_0\n"
        "                     Q5_0 Q4_K Q5_K Q6_K (default F32); norms and biases stay F32.\n"
        "                     Q*_0 need dim, heads*head-dim and ff multiples of 32, the K-quants\n"
        "                     multiples of 256 (the defaults are, for every type)\n"
        "  --seed N           random seed, 64-bit (default 1)\n"
        "  --tokenizer T      default | llama | gemma | qwen2 | llama3 (default: the arch's own:\n"
        "                     llama -> llama, qwen2 -> qwen2, gemma3 -> gemma)\n"
        "  --tokenizer-from F every tokenizer.* key of the GGUF file F instead (V = its\n"
        "                     tokens): a real model's tokenizer on random weights of any\n"
        "                     shape, so prompts have that model's lengths\n"
        "  --layers N         blocks            (default llama %d, qwen2 %d, gemma3 %d)\n"
        "  --dim N            embedding length  (default %d, %d, %d)\n"
        "  --heads N          query heads       (default %d, %d, %d)\n"
        "  --kv-heads N       KV heads          (default %d, %d, %d; or heads when that does not\n"
        "                     divide them)\n"
        "  --head-dim N       head dim          (default dim/heads for llama and qwen2, %d for\n"
        "                     gemma3)\n"
        "  --ff N             FFN length        (default %d, %d, %d)\n"
        "  --ctx N            context_length    (default %d)\n"
        "  --vocab-extra N    unused tokens appended to the vocabulary (default 0)\n"
        "  --swa N            gemma3 sliding window, tokens (default %d; every 6th layer,\n"
        "                     5, 11, ..., is global)\n"
        "  --tied             llama/qwen2: no output.weight, the head reuses token_embd\n"
        "                     (gemma3 is always tied)\n"
        "  --rope-base F      rope.freq_base (default llama %g, qwen2 %g, gemma3 %g)\n"
        "  --eps F            RMSNorm epsilon (default llama %g, qwen2 and gemma3 %g)\n"
        "  -q, --quiet        print nothing on success\n",
        d[0].n_layer, d[1].n_layer, d[2].n_layer, d[0].n_embd, d[1].n_embd, d[2].n_embd,
        d[0].n_head, d[1].n_head, d[2].n_head, d[0].n_head_kv, d[1].n_head_kv, d[2].n_head_kv,
        d[2].head_dim, d[0].n_ff, d[1].n_ff, d[2].n_ff, d[0].n_ctx, d[2].n_swa,
        (double)d[0].rope_base, (double)d[1].rope_base, (double)d[2].rope_base,
        (double)d[0].norm_eps, (double)d[1].norm_eps);
}

/* Prints a usage error and returns the usage exit code. */
__attribute__((format(printf, 1, 2))) static int bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fitm mkmodel: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see fitm mkmodel --help)\n");
    va_end(ap);
    return 2;
}

static bool parse_i32(const char *s, int32_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < INT32_MIN || v > INT32_MAX)
        return false;
    *out = (int32_t)v;
    return true;
}

static bool parse_f32(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end)
        return false;
    *out = v;
    return true;
}

static bool parse_type(const char *s, fitm_dtype *out)
{
    for (int id = 0; id < FITM_DTYPE_MAX; id++) {
        const fitm_dtype_info *ti = fitm_dtype_info_of(id);
        if (ti && !strcasecmp(s, ti->name) && fitm_quant_supported((fitm_dtype)id)) {
            *out = (fitm_dtype)id;
            return true;
        }
    }
    return false;
}

int fitm_cli_mkmodel(int argc, char **argv)
{
    /* Options are read twice: --arch first (it picks the defaults), then everything else. */
    enum {
        O_ARCH,
        O_OUT,
        O_TYPE,
        O_SEED,
        O_TOK,
        O_TOK_FROM,
        O_LAYERS,
        O_DIM,
        O_HEADS,
        O_KV,
        O_HDIM,
        O_FF,
        O_CTX,
        O_EXTRA,
        O_SWA,
        O_TIED,
        O_ROPE,
        O_EPS,
        O_QUIET,
        O_HELP,
        O_COUNT
    };
    static const struct {
        const char *name, *alias;
        bool arg;
    } opts[O_COUNT] = {
        /* clang-format off */
        [O_ARCH] = {"--arch", NULL, true},
        [O_OUT] = {"--output", "-o", true},
        [O_TYPE] = {"--type", NULL, true},
        [O_SEED] = {"--seed", NULL, true},
        [O_TOK] = {"--tokenizer", NULL, true},
        [O_TOK_FROM] = {"--tokenizer-from", NULL, true},
        [O_LAYERS] = {"--layers", NULL, true},
        [O_DIM] = {"--dim", NULL, true},
        [O_HEADS] = {"--heads", NULL, true},
        [O_KV] = {"--kv-heads", NULL, true},
        [O_HDIM] = {"--head-dim", NULL, true},
        [O_FF] = {"--ff", NULL, true},
        [O_CTX] = {"--ctx", NULL, true},
        [O_EXTRA] = {"--vocab-extra", NULL, true},
        [O_SWA] = {"--swa", NULL, true},
        [O_TIED] = {"--tied", NULL, false},
        [O_ROPE] = {"--rope-base", NULL, true},
        [O_EPS] = {"--eps", NULL, true},
        [O_QUIET] = {"--quiet", "-q", false},
        [O_HELP] = {"--help", "-h", false},
        /* clang-format on */
    };
    const char *val[O_COUNT] = {0};
    bool seen[O_COUNT] = {0};

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '=');
        size_t n = eq && a[0] == '-' && a[1] == '-' ? (size_t)(eq - a) : strlen(a);
        int o = 0;
        while (o < O_COUNT && !((strlen(opts[o].name) == n && !strncmp(a, opts[o].name, n)) ||
                                (opts[o].alias && !strcmp(a, opts[o].alias))))
            o++;
        if (o == O_COUNT)
            return bad("unknown option '%s'", a);
        seen[o] = true;
        if (!opts[o].arg) {
            if (n != strlen(a))
                return bad("option '%s' takes no value", opts[o].name);
            continue;
        }
        if (n != strlen(a))
            val[o] = a + n + 1;
        else if (i + 1 < argc)
            val[o] = argv[++i];
        else
            return bad("option '%s' needs a value", opts[o].name);
    }
    if (seen[O_HELP]) {
        usage(stdout);
        return 0;
    }
    if (!val[O_ARCH] || !val[O_OUT])
        return bad("--arch and -o are required");

    fitm_err err = {{0}};
    fitm_gen_arch arch;
    if (fitm_gen_parse_arch(val[O_ARCH], &arch, &err) != FITM_OK)
        return bad("%s", err.msg);
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    const int32_t default_kv = cfg.n_head_kv;

    if (val[O_TYPE] && !parse_type(val[O_TYPE], &cfg.type))
        return bad("unknown --type '%s' (F32 F16 BF16 Q8_0 Q4_0 Q5_0 Q4_K Q5_K Q6_K)", val[O_TYPE]);
    if (val[O_SEED]) {
        char *end;
        errno = 0;
        cfg.seed = strtoull(val[O_SEED], &end, 0);
        if (errno || end == val[O_SEED] || *end || val[O_SEED][0] == '-')
            return bad("bad --seed '%s'", val[O_SEED]);
    }
    if (val[O_TOK] && fitm_gen_parse_tok(val[O_TOK], &cfg.tok, &err) != FITM_OK)
        return bad("%s", err.msg);
    const struct {
        int o;
        int32_t *dst;
    } ints[] = {
        {O_LAYERS, &cfg.n_layer}, {O_DIM, &cfg.n_embd},          {O_HEADS, &cfg.n_head},
        {O_KV, &cfg.n_head_kv},   {O_HDIM, &cfg.head_dim},       {O_FF, &cfg.n_ff},
        {O_CTX, &cfg.n_ctx},      {O_EXTRA, &cfg.n_vocab_extra}, {O_SWA, &cfg.n_swa},
    };
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
        if (val[ints[k].o] && !parse_i32(val[ints[k].o], ints[k].dst))
            return bad("bad integer for %s: '%s'", opts[ints[k].o].name, val[ints[k].o]);
    if ((val[O_ROPE] && !parse_f32(val[O_ROPE], &cfg.rope_base)) ||
        (val[O_EPS] && !parse_f32(val[O_EPS], &cfg.norm_eps)))
        return bad("bad number for --rope-base or --eps");
    if (val[O_SWA] && arch != FITM_GEN_ARCH_GEMMA3)
        return bad("--swa applies to gemma3 only");
    if (seen[O_TIED])
        cfg.tied = true;

    /* Derived defaults: llama/qwen2 heads split the model dim; kv-heads fall back to MHA. */
    if (!val[O_HDIM] && arch != FITM_GEN_ARCH_GEMMA3 && (val[O_DIM] || val[O_HEADS])) {
        if (cfg.n_head <= 0 || cfg.n_embd % cfg.n_head != 0)
            return bad("--dim must be a multiple of --heads unless --head-dim is given");
        cfg.head_dim = cfg.n_embd / cfg.n_head;
    }
    if (!val[O_KV] && cfg.n_head > 0 && cfg.n_head % default_kv != 0)
        cfg.n_head_kv = cfg.n_head;

    if (val[O_TOK_FROM] && (val[O_TOK] || val[O_EXTRA]))
        return bad("--tokenizer-from takes the place of --tokenizer and --vocab-extra");
    fitm_gguf *tok_file = NULL;
    if (val[O_TOK_FROM] && fitm_gguf_open(&tok_file, val[O_TOK_FROM], &err) != FITM_OK) {
        fprintf(stderr, "fitm mkmodel: %s: %s\n", val[O_TOK_FROM], err.msg);
        return 1;
    }
    cfg.tokenizer = tok_file;
    fitm_status st = fitm_gen_write(&cfg, val[O_OUT], &err);
    if (st != FITM_OK) {
        fitm_gguf_close(tok_file);
        fprintf(stderr, "fitm mkmodel: %s\n", err.msg);
        return 1;
    }
    if (!seen[O_QUIET]) {
        struct stat sb;
        long long bytes = stat(val[O_OUT], &sb) == 0 ? (long long)sb.st_size : -1;
        char swa[32] = "";
        if (arch == FITM_GEN_ARCH_GEMMA3)
            snprintf(swa, sizeof swa, " swa %d", (int)cfg.n_swa);
        printf("wrote %s: %s %s seed %llu, L %d C %d H %d Hkv %d D %d F %d V %lld ctx %d%s%s, "
               "%lld bytes\n",
               val[O_OUT], fitm_gen_arch_name(arch), fitm_dtype_info_of((int)cfg.type)->name,
               (unsigned long long)cfg.seed, (int)cfg.n_layer, (int)cfg.n_embd, (int)cfg.n_head,
               (int)cfg.n_head_kv, (int)cfg.head_dim, (int)cfg.n_ff,
               (long long)fitm_gen_n_vocab(&cfg), (int)cfg.n_ctx, swa,
               cfg.tied || arch == FITM_GEN_ARCH_GEMMA3 ? " tied" : "", bytes);
    }
    fitm_gguf_close(tok_file);
    return 0;
}
