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
#include <time.h>
#include <unistd.h>

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
            "                     [--no-bos] [--ignore-eos] [--logits FILE] [--stats] [PROMPT]\n"
            "  -m MODEL          GGUF model file\n"
            "  -n N              tokens to generate (default 32)\n"
            "  -t THREADS        CPU threads (default: all online CPUs, at most 16)\n"
            "  --ids             print generated token ids instead of text\n"
            "  --prompt-ids IDS  use these ids as the prompt instead of tokenizing PROMPT\n"
            "  --no-bos          do not add the model's BOS token to PROMPT\n"
            "  --ignore-eos      keep generating past end-of-generation tokens\n"
            "  --logits FILE     write the first generated position's logits, one per line\n"
            "  --stats           print prefill/decode speed to stderr\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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

int fitm_cli_generate(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL, *prompt_ids = NULL, *logits_path = NULL;
    long n_gen = 32;
    long n_threads = sysconf(_SC_NPROCESSORS_ONLN);
    bool print_ids = false, no_bos = false, ignore_eos = false, stats = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "-m") && i + 1 < argc) {
            model_path = argv[++i];
        } else if (!strcmp(a, "-n") && i + 1 < argc) {
            n_gen = strtol(argv[++i], NULL, 10);
        } else if (!strcmp(a, "-t") && i + 1 < argc) {
            n_threads = strtol(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--ids")) {
            print_ids = true;
        } else if (!strcmp(a, "--prompt-ids") && i + 1 < argc) {
            prompt_ids = argv[++i];
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = true;
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = true;
        } else if (!strcmp(a, "--logits") && i + 1 < argc) {
            logits_path = argv[++i];
        } else if (!strcmp(a, "--stats")) {
            stats = true;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "fitm generate: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (!prompt) {
            prompt = a;
        } else {
            fprintf(stderr, "fitm generate: more than one PROMPT (quote it)\n");
            return 2;
        }
    }
    if (!model_path || (!prompt && !prompt_ids) || n_gen < 0 || n_gen > 1000000) {
        usage(stderr);
        return 2;
    }
    if (n_threads < 1)
        n_threads = 1;
    if (n_threads > 16)
        n_threads = 16;

    int rc = 1;
    fitm_err err = {{0}};
    fitm_status s;
    fitm_model *m = NULL;
    fitm_tokenizer *tok = NULL;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *kv = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    char *text = NULL;
    int64_t n_prompt = 0;

    double t_load = now_s();
    if ((s = fitm_model_open(&m, model_path, &err)))
        goto fail;
    const fitm_model_config *c = fitm_model_config_of(m);
    if ((s = fitm_tok_create(&tok, fitm_model_gguf(m), &err)))
        goto fail;
    if (prompt_ids) {
        if (parse_ids(prompt_ids, &ids, &n_prompt) != 0) {
            fprintf(stderr, "fitm generate: --prompt-ids must be non-negative integers\n");
            rc = 2;
            goto out;
        }
    } else {
        uint32_t flags = no_bos ? 0 : FITM_TOK_ADD_BOS;
        int64_t need = 0;
        s = fitm_tok_encode(tok, prompt, strlen(prompt), flags, NULL, 0, &need, &err);
        if (s && s != FITM_ERR_LIMIT)
            goto fail;
        ids = malloc((size_t)(need + 1) * sizeof *ids);
        if (!ids)
            goto nomem;
        if ((s = fitm_tok_encode(tok, prompt, strlen(prompt), flags, ids, need, &n_prompt, &err)))
            goto fail;
    }
    if (n_prompt < 1) {
        fprintf(stderr, "fitm generate: the prompt has no tokens\n");
        rc = 2;
        goto out;
    }
    int64_t n_ctx = n_prompt + (n_gen > 0 ? n_gen : 1);
    int32_t *grown = realloc(ids, (size_t)n_ctx * sizeof *ids);
    logits = malloc((size_t)c->n_vocab * sizeof *logits);
    if (!grown || !logits)
        goto nomem;
    ids = grown;
    fitm_forward_params fp = {.max_tokens = n_prompt, .max_ctx = n_ctx, .max_logits = 1};
    if ((s = fitm_backend_cpu_create(&b, (int)n_threads, &err)) ||
        (s = fitm_forward_create(&fw, m, b, &fp, &err)) ||
        (s = fitm_kv_create(&kv, b, c, n_ctx, &err)))
        goto fail;
    t_load = now_s() - t_load;

    fitm_forward_opts o = {.n_logits = 1, .logits = logits};
    double t0 = now_s();
    if ((s = fitm_forward_run(fw, kv, ids, n_prompt, 0, &o, &err)))
        goto fail;
    double t_prefill = now_s() - t0;
    if (logits_path) {
        FILE *f = fopen(logits_path, "w");
        if (!f) {
            fprintf(stderr, "fitm generate: cannot write %s: %s\n", logits_path, strerror(errno));
            goto out;
        }
        for (int32_t v = 0; v < c->n_vocab; v++)
            fprintf(f, "%.9g\n", logits[v]);
        if (fclose(f) != 0) {
            fprintf(stderr, "fitm generate: cannot write %s\n", logits_path);
            goto out;
        }
    }

    int64_t n_done = 0; /* tokens generated; each but the last needs one decode step */
    t0 = now_s();
    size_t text_cap = 0, text_len = 0, printed = 0;
    while (n_done < n_gen) {
        int32_t next = argmax(logits, c->n_vocab);
        ids[n_prompt + n_done] = next;
        if (print_ids) {
            printf("%s%d", n_done ? " " : "", (int)next);
            fflush(stdout);
        } else {
            /* Decode incrementally; print only whole UTF-8 characters. */
            char piece[FITM_TOK_MAX_PIECE_BYTES];
            size_t n_piece = 0;
            if ((s = fitm_tok_piece(tok, next, 0, piece, sizeof piece, &n_piece, &err)))
                goto fail;
            if (text_len + n_piece + 1 > text_cap) {
                size_t cap = (text_cap + n_piece + 1) * 2;
                char *p = realloc(text, cap);
                if (!p)
                    goto nomem;
                text = p;
                text_cap = cap;
            }
            memcpy(text + text_len, piece, n_piece);
            text_len += n_piece;
            size_t ok = fitm_tok_utf8_complete(text + printed, text_len - printed);
            fwrite(text + printed, 1, ok, stdout);
            printed += ok;
            fflush(stdout);
        }
        n_done++;
        if ((!ignore_eos && fitm_tok_is_eog(tok, next)) || n_done == n_gen)
            break;
        int64_t pos = n_prompt + n_done - 1;
        if ((s = fitm_forward_run(fw, kv, &ids[pos], 1, pos, &o, &err)))
            goto fail;
    }
    double t_decode = now_s() - t0;
    if (!print_ids && printed < text_len)
        fwrite(text + printed, 1, text_len - printed, stdout);
    printf("\n");
    if (stats) {
        int64_t steps = n_done > 1 ? n_done - 1 : 0;
        fprintf(stderr,
                "fitm generate: load %.3f s; prompt %lld tokens in %.3f s (%.1f tok/s); "
                "%lld decode steps in %.3f s (%.1f tok/s); %ld threads\n",
                t_load, (long long)n_prompt, t_prefill, n_prompt / (t_prefill > 0 ? t_prefill : 1e-9),
                (long long)steps, t_decode, steps / (t_decode > 0 ? t_decode : 1e-9), n_threads);
    }
    rc = 0;
    goto out;
nomem:
    s = fitm_err_set(&err, FITM_ERR_NOMEM, "out of memory");
fail:
    fprintf(stderr, "fitm generate: %s: %s\n", fitm_status_name(s), err.msg);
    rc = 1;
out:
    fitm_kv_destroy(kv);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
    fitm_tok_destroy(tok);
    fitm_model_close(m);
    free(ids);
    free(logits);
    free(text);
    return rc;
}
