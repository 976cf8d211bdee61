/* cli_tokenize: `fitm tokenize -m MODEL [--no-bos] [--special] TEXT` — the ids a model's
 * tokenizer gives TEXT, space-separated on one line (what llama.cpp's llama-tokenize gives with
 * --ids); with --decode, the text a list of ids stands for. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: fitm tokenize -m MODEL.gguf [options] TEXT\n"
            "       fitm tokenize -m MODEL.gguf --decode ID...\n"
            "  -m, --model PATH  the GGUF file whose tokenizer to use\n"
            "  --no-bos          add neither BOS nor EOS (by default they are added when the\n"
            "                    model asks for them, as llama.cpp's add_special)\n"
            "  --special         the exact text of control tokens (<start_of_turn>, <|im_end|>)\n"
            "                    becomes those tokens; with --decode, control tokens are printed\n"
            "  --continuation    TEXT continues earlier text: no SentencePiece space prefix\n"
            "  --pieces          one token per line: id, tab, its piece quoted\n"
            "  -f, --file PATH   read TEXT from a file ('-': standard input)\n"
            "  --decode          turn the ids given (space-separated, one or more arguments)\n"
            "                    back into text; printed exactly, without a newline added\n");
}

/* Reads all of f into a malloc'd buffer. */
static char *slurp(FILE *f, size_t *n)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        len += fread(buf + len, 1, cap - len, f);
        if (len < cap)
            break;
        char *bigger = cap > FITM_TOK_MAX_TEXT_BYTES ? NULL : realloc(buf, cap * 2);
        if (!bigger) {
            free(buf);
            return NULL;
        }
        buf = bigger;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        free(buf);
        return NULL;
    }
    *n = len;
    return buf;
}

static void print_piece(const char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static int encode_and_print(const fitm_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                            bool pieces)
{
    fitm_err err = {{0}};
    int64_t n = 0;
    fitm_status st = fitm_tok_encode(tok, text, len, flags, NULL, 0, &n, &err);
    if (st != FITM_OK && st != FITM_ERR_LIMIT) {
        fprintf(stderr, "fitm tokenize: %s\n", err.msg);
        return 1;
    }
    int32_t *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (!ids) {
        fprintf(stderr, "fitm tokenize: out of memory for %lld ids\n", (long long)n);
        return 1;
    }
    st = fitm_tok_encode(tok, text, len, flags, ids, n, &n, &err);
    if (st != FITM_OK) {
        fprintf(stderr, "fitm tokenize: %s\n", err.msg);
        free(ids);
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (pieces) {
            char buf[FITM_TOK_MAX_PIECE_BYTES];
            size_t len_piece = 0;
            fitm_tok_piece(tok, ids[i], FITM_TOK_DECODE_SPECIAL, buf, sizeof buf, &len_piece, &err);
            printf("%d\t", ids[i]);
            print_piece(buf, len_piece);
            putchar('\n');
        } else {
            printf(i ? " %d" : "%d", ids[i]);
        }
    }
    if (!pieces)
        putchar('\n');
    free(ids);
    return 0;
}

/* Parses the ids in args (each may hold several, separated by spaces or commas). */
static int decode_and_print(const fitm_tokenizer *tok, char **args, int n_args, uint32_t flags)
{
    int64_t cap = 64, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    int rc = 1;
    for (int a = 0; ids && a < n_args; a++) {
        for (char *p = args[a]; *p;) {
            if (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') {
                p++;
                continue;
            }
            char *end;
            errno = 0;
            long v = strtol(p, &end, 10);
            if (end == p || errno || v < 0 || v >= fitm_tok_n_vocab(tok)) {
                fprintf(stderr, "fitm tokenize: '%s' is not a token id of this model (0..%d)\n", p,
                        fitm_tok_n_vocab(tok) - 1);
                rc = 2;
                goto done;
            }
            if (n == cap) {
                int32_t *bigger = realloc(ids, (size_t)cap * 2 * sizeof *ids);
                if (!bigger)
                    goto done;
                ids = bigger;
                cap *= 2;
            }
            ids[n++] = (int32_t)v;
            p = end;
        }
    }
    if (!ids)
        goto done;
    fitm_err err = {{0}};
    size_t len = 0;
    fitm_tok_decode(tok, ids, n, flags, NULL, 0, &len, &err);
    char *text = malloc(len + 1);
    if (!text)
        goto done;
    if (fitm_tok_decode(tok, ids, n, flags, text, len + 1, &len, &err) == FITM_OK &&
        fwrite(text, 1, len, stdout) == len)
        rc = 0;
    else
        fprintf(stderr, "fitm tokenize: %s\n", err.msg[0] ? err.msg : "write failed");
    free(text);
done:
    if (rc == 1 && !ids)
        fprintf(stderr, "fitm tokenize: out of memory\n");
    free(ids);
    return rc;
}

int fitm_cli_tokenize(int argc, char **argv)
{
    const char *path = NULL, *file = NULL;
    bool no_bos = false, special = false, continuation = false, pieces = false, decode = false;
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0;
    if (!pos) {
        fprintf(stderr, "fitm tokenize: out of memory\n");
        return 1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            free(pos);
            return 0;
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = true;
        } else if (!strcmp(a, "--special")) {
            special = true;
        } else if (!strcmp(a, "--continuation")) {
            continuation = true;
        } else if (!strcmp(a, "--pieces")) {
            pieces = true;
        } else if (!strcmp(a, "--decode")) {
            decode = true;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && i + 1 < argc) {
            path = argv[++i];
        } else if (!strncmp(a, "--model=", 8)) {
            path = a + 8;
        } else if ((!strcmp(a, "-f") || !strcmp(a, "--file")) && i + 1 < argc) {
            file = argv[++i];
        } else if (!strcmp(a, "--")) {
            while (++i < argc)
                pos[n_pos++] = argv[i];
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "fitm tokenize: unexpected option '%s'\n", a);
            usage(stderr);
            free(pos);
            return 2;
        } else {
            pos[n_pos++] = argv[i];
        }
    }
    const char *problem = NULL;
    if (!path)
        problem = "no model given (-m MODEL.gguf)";
    else if (decode && (file || n_pos == 0))
        problem = "--decode takes the ids as arguments";
    else if (!decode && file && n_pos > 0)
        problem = "give TEXT or --file, not both";
    else if (!decode && !file && n_pos != 1)
        problem = "give the text as one argument (quote it), or use --file";
    if (problem) {
        fprintf(stderr, "fitm tokenize: %s\n", problem);
        usage(stderr);
        free(pos);
        return 2;
    }

    char *text = NULL;
    size_t len = 0;
    if (!decode && file) {
        FILE *f = strcmp(file, "-") ? fopen(file, "rb") : stdin;
        if (!f || !(text = slurp(f, &len))) {
            fprintf(stderr, "fitm tokenize: cannot read '%s': %s\n", file, strerror(errno));
            if (f && f != stdin)
                fclose(f);
            free(pos);
            return 1;
        }
        if (f != stdin)
            fclose(f);
    }

    int rc = 1;
    fitm_err err = {{0}};
    fitm_gguf *g = NULL;
    fitm_tokenizer *tok = NULL;
    fitm_status st = fitm_gguf_open(&g, path, &err);
    if (st == FITM_OK)
        st = fitm_tok_create(&tok, g, &err);
    if (st != FITM_OK) {
        fprintf(stderr, "fitm tokenize: %s\n", err.msg);
    } else if (decode) {
        rc = decode_and_print(tok, pos, n_pos,
                              FITM_TOK_DECODE_STRIP_PREFIX |
                                  (special ? FITM_TOK_DECODE_SPECIAL : 0));
    } else {
        uint32_t flags = (no_bos ? 0 : FITM_TOK_ADD_SPECIAL) |
                         (special ? FITM_TOK_PARSE_SPECIAL : 0) |
                         (continuation ? FITM_TOK_CONTINUATION : 0);
        rc = text ? encode_and_print(tok, text, len, flags, pieces)
                  : encode_and_print(tok, pos[0], strlen(pos[0]), flags, pieces);
    }
    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
    free(text);
    free(pos);
    if (rc == 0 && fflush(stdout) != 0)
        rc = 1;
    return rc;
}
