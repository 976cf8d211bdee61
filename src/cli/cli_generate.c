/* fitm generate: greedy continuation of a prompt on the CPU backend.
 *
 *   fitm generate -m MODEL [-n N] [-t THREADS] [--ids] [--prompt-ids "1 2 3"] [--no-bos]
 *                 [--ignore-eos] [--logits FILE] [--stats] [PROMPT]
 *
 * Prints the generated text (without the prompt), or with --ids the generated ids separated
 * by spaces. --logits writes the logits of the first generated position (the ones computed
 * after the last prompt token), one per line. --stats prints timings to stderr. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/clock.h"
#include "cli/cli.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: fitm generate -m MODEL [-n N] [-t THREADS] [--ids] [--prompt-ids \"1 2 3\"]\n"
            "                     [--no-bos] [--ignore-eos] [--kv f16|f32] [--logits FILE] [--stats]\n"
            "                     [PROMPT]\n"
            "  -m MODEL          GGUF model file\n"
            "  -n N              tokens to generate (default 32)\n"
            "  -t THREADS        CPU threads (default: all online CPUs, at most 16)\n"
            "  --ids             print generated token ids instead of text\n"
            "  --prompt-ids IDS  use these ids as the prompt instead of tokenizing PROMPT\n"
            "  --no-bos          do not add the model's BOS token to PROMPT\n"
            "  --ignore-eos      keep generating past end-of-generation tokens\n"
            "  --kv f16|f32      KV cache values (default f16, as fitmd's kv_cache_type on the CPU)\n"
            "  --logits FILE     write the first generated position's logits, one per line\n"
            "  --stats           print prefill/decode speed to stderr\n");
}

static double now_s(void)
{
    return (double)fitm_clock_ns() * 1e-9;
}

static int32_t argmax(const float *v, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return (int32_t)best;
}

static int parse_ids(const char *s, int32_t **out, int64_t *n)
{
    int64_t cap = 16, k = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids)
        return -1;
    for (;;) {
        while (*s == ' ' || *s == ',' || *s == '\t' || *s == '\n')
            s++;
        if (!*s)
            break;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return -1;
        }
        if (k == cap) {
            int32_t *p = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!p) {
                free(ids);
                return -1;
            }
            ids = p;
        }
        ids[k++] = (int32_t)v;
        s = end;
    }
    *out = ids;
    *n = k;
    return 0;
}

typedef struct {
    const char *model_path, *prompt, *prompt_ids, *logits_path;
    long n_gen, n_threads;
    bool print_ids, no_bos, ignore_eos, stats, kv_f32;
} gen_args;

/* Fills a from argv. -1 to go on, else the exit status (help printed, or a usage error). */
static int parse_args(int argc, char **argv, gen_args *a)
{
    *a = (gen_args){.n_gen = 32, .n_threads = sysconf(_SC_NPROCESSORS_ONLN)};
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(s, "-h") || !strcmp(s, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(s, "-m") && has_value) {
            a->model_path = argv[++i];
        } else if (!strcmp(s, "-n") && has_value) {
            a->n_gen = strtol(argv[++i], NULL, 10);
        } else if (!strcmp(s, "-t") && has_value) {
            a->n_threads = strtol(argv[++i], NULL, 10);
        } else if (!strcmp(s, "--ids")) {
            a->print_ids = true;
        } else if (!strcmp(s, "--prompt-ids") && has_value) {
            a->prompt_ids = argv[++i];
        } else if (!strcmp(s, "--no-bos")) {
            a->no_bos = true;
        } else if (!strcmp(s, "--ignore-eos")) {
            a->ignore_eos = true;
        } else if (!strcmp(s, "--kv") && has_value &&
                   (!strcmp(argv[i + 1], "f16") || !strcmp(argv[i + 1], "f32"))) {
            a->kv_f32 = !strcmp(argv[++i], "f32");
        } else if (!strcmp(s, "--logits") && has_value) {
            a->logits_path = argv[++i];
        } else if (!strcmp(s, "--stats")) {
            a->stats = true;
        } else if (s[0] == '-' && s[1]) {
            fprintf(stderr, "fitm generate: unknown option '%s'\n", s);
            usage(stderr);
            return 2;
        } else if (!a->prompt) {
            a->prompt = s;
        } else {
            fprintf(stderr, "fitm generate: more than one PROMPT (quote it)\n");
            return 2;
        }
    }
    if (!a->model_path || (!a->prompt && !a->prompt_ids) || a->n_gen < 0 || a->n_gen > 1000000) {
        usage(stderr);
        return 2;
    }
    a->n_threads = a->n_threads < 1 ? 1 : a->n_threads > 16 ? 16 : a->n_threads;
    return -1;
}

/* Everything a run holds; gen_free releases it. */
typedef struct {
    fitm_model *m;
    fitm_tokenizer *tok;
    fitm_backend *b;
    fitm_forward *fw;
    fitm_kv *kv;
    int32_t *ids; /* (n_ctx): the prompt, then the generated tokens */
    int64_t n_prompt, n_ctx;
    float *logits;  /* (V) the latest position's */
    fitm_buf text;  /* the generated text so far */
    size_t printed; /* bytes of text already written */
    double t_load, t_prefill, t_decode;
} gen_state;

static void gen_free(gen_state *g)
{
    fitm_kv_destroy(g->kv);
    fitm_forward_destroy(g->fw);
    fitm_backend_destroy(g->b);
    fitm_tok_destroy(g->tok);
    fitm_model_close(g->m);
    free(g->ids);
    free(g->logits);
    fitm_buf_free(&g->text);
}

/* The prompt's ids into g->ids: --prompt-ids, or PROMPT tokenized. *usage_error is set for
 * the user's mistakes (bad ids, no tokens), which exit with status 2. */
static fitm_status prompt_ids(gen_state *g, const gen_args *a, bool *usage_error, fitm_err *err)
{
    if (a->prompt_ids) {
        if (parse_ids(a->prompt_ids, &g->ids, &g->n_prompt) != 0) {
            *usage_error = true;
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "--prompt-ids must be non-negative integers");
        }
    } else {
        uint32_t flags = a->no_bos ? 0 : FITM_TOK_ADD_BOS;
        size_t len = strlen(a->prompt);
        int64_t need = 0;
        fitm_status s = fitm_tok_encode(g->tok, a->prompt, len, flags, NULL, 0, &need, err);
        if (s && s != FITM_ERR_LIMIT)
            return s;
        if (!(g->ids = malloc((size_t)(need + 1) * sizeof *g->ids)))
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
        if ((s = fitm_tok_encode(g->tok, a->prompt, len, flags, g->ids, need, &g->n_prompt, err)))
            return s;
    }
    if (g->n_prompt < 1) {
        *usage_error = true;
        return fitm_err_set(err, FITM_ERR_INVALID, "the prompt has no tokens");
    }
    return FITM_OK;
}

/* The model, tokenizer, prompt, backend, forward scratch and KV cache. *usage_error tells a
 * bad prompt (exit status 2) from a failure. */
static fitm_status gen_load(gen_state *g, const gen_args *a, bool *usage_error, fitm_err *err)
{
    fitm_status s;
    g->t_load = now_s();
    if ((s = fitm_model_open(&g->m, a->model_path, err)) ||
        (s = fitm_tok_create(&g->tok, fitm_model_gguf(g->m), err)) ||
        (s = prompt_ids(g, a, usage_error, err)))
        return s;
    const fitm_model_config *c = fitm_model_config_of(g->m);
    g->n_ctx = g->n_prompt + (a->n_gen > 0 ? a->n_gen : 1);
    int32_t *grown = realloc(g->ids, (size_t)g->n_ctx * sizeof *g->ids);
    if (grown)
        g->ids = grown;
    g->logits = malloc((size_t)c->n_vocab * sizeof *g->logits);
    if (!grown || !g->logits)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_forward_params fp = {.max_tokens = g->n_prompt, .max_ctx = g->n_ctx, .max_logits = 1};
    if ((s = fitm_backend_cpu_create(&g->b, (int)a->n_threads, err)) ||
        (s = fitm_backend_set_kv_half(g->b, !a->kv_f32, err)) ||
        (s = fitm_forward_create(&g->fw, g->m, g->b, &fp, err)) ||
        (s = fitm_kv_create(&g->kv, g->b, c, g->n_ctx, err)))
        return s;
    g->t_load = now_s() - g->t_load;
    return FITM_OK;
}

/* The first generated position's logits, one per line. False (reported) on a write error. */
static bool write_logits(const char *path, const float *logits, int32_t V)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "fitm generate: cannot write %s: %s\n", path, strerror(errno));
        return false;
    }
    for (int32_t v = 0; v < V; v++)
        fprintf(f, "%.9g\n", logits[v]);
    if (fclose(f) != 0) {
        fprintf(stderr, "fitm generate: cannot write %s\n", path);
        return false;
    }
    return true;
}

/* Prints the n-th generated token: its id, or its text up to the last whole UTF-8 character. */
static fitm_status emit(gen_state *g, const gen_args *a, int32_t id, int64_t n, fitm_err *err)
{
    if (a->print_ids) {
        printf("%s%d", n ? " " : "", (int)id);
        fflush(stdout);
        return FITM_OK;
    }
    char piece[FITM_TOK_MAX_PIECE_BYTES];
    size_t n_piece = 0;
    fitm_status s = fitm_tok_piece(g->tok, id, 0, piece, sizeof piece, &n_piece, err);
    if (s)
        return s;
    if (!fitm_buf_append(&g->text, piece, n_piece))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    size_t ok = fitm_tok_utf8_complete(g->text.p + g->printed, g->text.len - g->printed);
    fwrite(g->text.p + g->printed, 1, ok, stdout);
    g->printed += ok;
    fflush(stdout);
    return FITM_OK;
}

/* Greedy decoding from the prompt's logits: up to n_gen tokens, stopping after an
 * end-of-generation token unless --ignore-eos. *n_done counts the tokens generated. */
static fitm_status decode(gen_state *g, const gen_args *a, int64_t *n_done, fitm_err *err)
{
    const int32_t V = fitm_model_config_of(g->m)->n_vocab;
    fitm_forward_opts o = {.n_logits = 1, .logits = g->logits};
    fitm_status s;
    double t0 = now_s();
    while (*n_done < a->n_gen) {
        int32_t next = argmax(g->logits, V);
        g->ids[g->n_prompt + *n_done] = next;
        if ((s = emit(g, a, next, *n_done, err)))
            return s;
        ++*n_done;
        if ((!a->ignore_eos && fitm_tok_is_eog(g->tok, next)) || *n_done == a->n_gen)
            break;
        int64_t pos = g->n_prompt + *n_done - 1;
        if ((s = fitm_forward_run(g->fw, g->kv, &g->ids[pos], 1, pos, &o, err)))
            return s;
    }
    g->t_decode = now_s() - t0;
    return FITM_OK;
}

static void print_stats(const gen_state *g, long n_threads, int64_t n_done)
{
    int64_t steps = n_done > 1 ? n_done - 1 : 0;
    double tp = g->t_prefill, td = g->t_decode;
    fprintf(stderr,
            "fitm generate: load %.3f s; prompt %lld tokens in %.3f s (%.1f tok/s); "
            "%lld decode steps in %.3f s (%.1f tok/s); %ld threads\n",
            g->t_load, (long long)g->n_prompt, tp, g->n_prompt / (tp > 0 ? tp : 1e-9),
            (long long)steps, td, steps / (td > 0 ? td : 1e-9), n_threads);
}

/* load -> prefill (-> --logits) -> decode -> print. Exit status 0, 1 (failure), 2 (usage). */
int fitm_cli_generate(int argc, char **argv)
{
    gen_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0)
        return rc;
    gen_state g = {0};
    fitm_err err = {{0}};
    bool usage_error = false;
    int64_t n_done = 0; /* tokens generated; each but the last needs one decode step */
    fitm_forward_opts o = {.n_logits = 1, .logits = NULL};
    fitm_status s = gen_load(&g, &a, &usage_error, &err);
    if (s == FITM_OK) {
        o.logits = g.logits;
        double t0 = now_s();
        s = fitm_forward_run(g.fw, g.kv, g.ids, g.n_prompt, 0, &o, &err);
        g.t_prefill = now_s() - t0;
    }
    if (s == FITM_OK && a.logits_path &&
        !write_logits(a.logits_path, g.logits, fitm_model_config_of(g.m)->n_vocab)) {
        gen_free(&g);
        return 1;
    }
    if (s == FITM_OK)
        s = decode(&g, &a, &n_done, &err);
    if (s != FITM_OK) {
        if (usage_error)
            fprintf(stderr, "fitm generate: %s\n", err.msg);
        else
            fprintf(stderr, "fitm generate: %s: %s\n", fitm_status_name(s), err.msg);
        gen_free(&g);
        return usage_error ? 2 : 1;
    }
    if (!a.print_ids && g.printed < g.text.len)
        fwrite(g.text.p + g.printed, 1, g.text.len - g.printed, stdout);
    printf("\n");
    if (a.stats)
        print_stats(&g, a.n_threads, n_done);
    gen_free(&g);
    return 0;
}
