/* tok_bpe: byte-level BPE (GPT-2, Llama 3, Qwen2).
 *
 * A plain-text fragment is cut into words by the pre-tokenizer regex (implemented by hand
 * below, one function per alternative list), each word's bytes are replaced by GPT-2's
 * printable stand-ins (bytes_to_unicode), and within a word the adjacent pair with the lowest
 * merge rank (leftmost on ties) is merged until no listed pair is left. Each final symbol is a
 * token. This is llama.cpp's llm_tokenizer_bpe_session. */
#include <stdlib.h>
#include <string.h>

#include "base/unicode.h"
#include "tokenizer/tok_internal.h"

/* ---------------------------------------------------------------------------------------- */
/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * (controls, space, DEL, NBSP, soft hyphen, ...) for U+0100.. in byte order. */

static bool byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

void tok_bpe_init_bytes(fitm_tokenizer *tok)
{
    uint16_t next = 256;
    for (int i = 0; i < 324; i++)
        tok->bpe_byte[i] = -1;
    for (unsigned b = 0; b < 256; b++) {
        tok->bpe_cp[b] = byte_is_printable(b) ? (uint16_t)b : next++;
        tok->bpe_byte[tok->bpe_cp[b]] = (int16_t)b;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Pre-tokenizers. Each character gets class bits; a word starts at i and word_end returns
 * where the regex's match starting at i ends (always > i: every character is a letter, a
 * number, whitespace, or "other", and each of those matches some alternative). */

enum { CL_L = 1, CL_N = 2, CL_WS = 4 };

/* [^\s\p{L}\p{N}] */
static bool is_other(uint8_t c)
{
    return !(c & (CL_L | CL_N | CL_WS));
}

static bool is_crlf(uint32_t cp)
{
    return cp == '\r' || cp == '\n';
}

static uint32_t ascii_lower(uint32_t cp)
{
    return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}

static size_t run_of(const uint8_t *cl, size_t n, size_t i, uint8_t bit)
{
    while (i < n && (cl[i] & bit))
        i++;
    return i;
}

static size_t run_of_other(const uint8_t *cl, size_t n, size_t i)
{
    while (i < n && is_other(cl[i]))
        i++;
    return i;
}

/* 's|'t|'re|'ve|'m|'ll|'d, ASCII-case-insensitive when fold. Returns the end or 0. */
static size_t contraction(const uint32_t *cp, size_t n, size_t i, bool fold)
{
    if (cp[i] != '\'' || i + 1 >= n)
        return 0;
    uint32_t a = cp[i + 1], b = i + 2 < n ? cp[i + 2] : 0;
    if (fold) {
        a = ascii_lower(a);
        b = ascii_lower(b);
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
        return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        return i + 3;
    return 0;
}

/* \s+(?!\S)|\s+ at a whitespace character: the run, less its last character when a
 * non-space follows and the run is longer than one. */
static size_t space_run(const uint8_t *cl, size_t n, size_t i)
{
    size_t e = run_of(cl, n, i, CL_WS);
    if (e < n && e - i >= 2)
        return e - 1;
    return e;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t word_end_gpt2(const uint32_t *cp, const uint8_t *cl, size_t n, size_t i)
{
    size_t e = contraction(cp, n, i, false);
    if (e)
        return e;
    size_t j = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i; /* the optional leading space */
    if (cl[j] & CL_L)
        return run_of(cl, n, j, CL_L);
    if (cl[j] & CL_N)
        return run_of(cl, n, j, CL_N);
    if (is_other(cl[j]))
        return run_of_other(cl, n, j);
    return space_run(cl, n, i);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+        (Llama 3: 3 digits, Qwen2: 1) */
static size_t word_end_llama3(const uint32_t *cp, const uint8_t *cl, size_t n, size_t i,
                              size_t max_digits)
{
    size_t e = contraction(cp, n, i, true);
    if (e)
        return e;
    if (!is_crlf(cp[i]) && !(cl[i] & CL_N) && ((cl[i] & CL_L) || (i + 1 < n && (cl[i + 1] & CL_L))))
        return run_of(cl, n, i + 1, CL_L);
    if (cl[i] & CL_N) {
        e = run_of(cl, n, i, CL_N);
        return e - i > max_digits ? i + max_digits : e;
    }
    size_t j = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (is_other(cl[j])) {
        e = run_of_other(cl, n, j);
        while (e < n && is_crlf(cp[e]))
            e++;
        return e;
    }
    /* whitespace: up to the last \r or \n of the run if it has one */
    e = run_of(cl, n, i, CL_WS);
    for (size_t k = e; k > i; k--)
        if (is_crlf(cp[k - 1]))
            return k;
    return space_run(cl, n, i);
}

static size_t word_end(fitm_tok_pre pre, const uint32_t *cp, const uint8_t *cl, size_t n, size_t i)
{
    switch (pre) {
    case FITM_TOK_PRE_LLAMA3:
        return word_end_llama3(cp, cl, n, i, 3);
    case FITM_TOK_PRE_QWEN2:
        return word_end_llama3(cp, cl, n, i, 1);
    default:
        return word_end_gpt2(cp, cl, n, i);
    }
}

/* Cuts text[0..len) into words. On return scratch[0] holds *n_words uint32 byte offsets, each
 * just past a word. Uses scratch[0..2]. */
static fitm_status split_words(fitm_tok_pre pre, const char *text, size_t len, fitm_buf scratch[4],
                               size_t *n_words, fitm_err *err)
{
    *n_words = 0;
    if (!fitm_buf_reserve(&scratch[0], (len + 1) * sizeof(uint32_t)) ||
        !fitm_buf_reserve(&scratch[1], (len + 1) * sizeof(uint32_t)) ||
        !fitm_buf_reserve(&scratch[2], len + 1))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory tokenizing %zu bytes", len);
    uint32_t *off = (void *)scratch[0].p; /* byte offset of character k; reused for the word ends */
    uint32_t *cp = (void *)scratch[1].p;
    uint8_t *cl = (void *)scratch[2].p;
    size_t n = 0;
    for (size_t b = 0; b < len; n++) {
        off[n] = (uint32_t)b;
        b += fitm_unicode_utf8_decode(text + b, len - b, &cp[n]);
        fitm_ucat cat = fitm_unicode_category(cp[n]);
        cl[n] =
            (uint8_t)((cat == FITM_UCAT_LETTER ? CL_L : 0) | (cat == FITM_UCAT_NUMBER ? CL_N : 0) |
                      (fitm_unicode_is_whitespace(cp[n]) ? CL_WS : 0));
    }
    off[n] = (uint32_t)len;
    /* Word ends overwrite off[] from the front: the w-th end is written after off[w] is read. */
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        size_t e = word_end(pre, cp, cl, n, i);
        off[w++] = off[e];
        i = e;
    }
    *n_words = w;
    return FITM_OK;
}

fitm_status fitm_tok_pretokenize(fitm_tok_pre pre, const char *text, size_t len, int64_t *ends,
                                 int64_t n_max, int64_t *n_out, fitm_err *err)
{
    *n_out = 0;
    if (pre != FITM_TOK_PRE_GPT2 && pre != FITM_TOK_PRE_LLAMA3 && pre != FITM_TOK_PRE_QWEN2)
        return fitm_err_set(err, FITM_ERR_INVALID, "pre-tokenizer %d is not a byte-level BPE one",
                            (int)pre);
    if (len > FITM_TOK_MAX_TEXT_BYTES)
        return fitm_err_set(err, FITM_ERR_LIMIT, "text of %zu bytes is over the limit", len);
    if (n_max < 0 || (n_max > 0 && !ends) || (len > 0 && !text))
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_tok_pretokenize: bad arguments");
    fitm_buf scratch[4] = {{0}};
    size_t n_words = 0;
    fitm_status st = split_words(pre, text, len, scratch, &n_words, err);
    if (st == FITM_OK) {
        const uint32_t *e = (void *)scratch[0].p;
        for (size_t i = 0; i < n_words && (int64_t)i < n_max; i++)
            ends[i] = e[i];
        *n_out = (int64_t)n_words;
        if ((int64_t)n_words > n_max)
            st = fitm_err_set(err, FITM_ERR_LIMIT, "text has %zu words, room for %lld", n_words,
                              (long long)n_max);
    }
    for (int i = 0; i < 4; i++)
        fitm_buf_free(&scratch[i]);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Merging. */

static void bpe_add_bigram(const fitm_tokenizer *tok, const char *s, const tok_sym *sym, int32_t l,
                           int32_t r, tok_bigram *heap, size_t *n_heap)
{
    if (l < 0 || r < 0)
        return;
    int32_t rank = tok_bpe_rank(tok, s + sym[l].off, sym[l].n, sym[r].n);
    if (rank < 0)
        return;
    tok_heap_push(heap, n_heap,
                  tok_bigram_make(UINT32_MAX - (uint32_t)rank, l, r, sym[l].n + sym[r].n));
}

/* A final symbol that is not a token: its characters one by one (llama.cpp drops those that
 * are not tokens either; we write the unknown token when the vocabulary has one). */
static void bpe_emit_chars(const fitm_tokenizer *tok, const char *s, uint32_t n, tok_out *out)
{
    for (uint32_t k = 0; k < n;) {
        uint32_t cp;
        size_t c = fitm_unicode_utf8_decode(s + k, n - k, &cp);
        int32_t id = tok_lookup_plain(tok, s + k, c);
        if (id < 0)
            id = tok->unk;
        if (id >= 0)
            tok_emit(out, id);
        k += (uint32_t)c;
    }
}

/* Merges one byte-encoded word s[0..m) and emits its tokens. sym and heap have room for m
 * symbols and 3m bigrams. */
static void bpe_word(const fitm_tokenizer *tok, const char *s, size_t m, tok_sym *sym,
                     tok_bigram *heap, tok_out *out)
{
    if (tok->ignore_merges) {
        int32_t id = tok_lookup_plain(tok, s, m);
        if (id >= 0) {
            tok_emit(out, id);
            return;
        }
    }
    int32_t n_sym = 0;
    for (size_t off = 0; off < m;) {
        size_t n = ((unsigned char)s[off] < 0x80) ? 1 : 2; /* stand-ins are below U+0800 */
        sym[n_sym] =
            (tok_sym){n_sym - 1, off + n >= m ? -1 : n_sym + 1, (uint32_t)off, (uint32_t)n};
        n_sym++;
        off += n;
    }
    tok_merge(tok, s, sym, 0, n_sym, heap, bpe_add_bigram);
    for (int32_t i = 0; i != -1; i = sym[i].next) {
        int32_t id = tok_lookup_plain(tok, s + sym[i].off, sym[i].n);
        if (id >= 0)
            tok_emit(out, id);
        else
            bpe_emit_chars(tok, s + sym[i].off, sym[i].n, out);
    }
}

fitm_status tok_bpe_encode(const fitm_tokenizer *tok, const char *text, size_t len, tok_out *out,
                           fitm_buf scratch[4], fitm_err *err)
{
    size_t n_words = 0;
    fitm_status st = split_words(tok->pre, text, len, scratch, &n_words, err);
    if (st != FITM_OK)
        return st;
    /* The longest word bounds the per-word buffers (scratch[1] and [2] are free again). */
    const uint32_t *ends = (void *)scratch[0].p;
    size_t longest = 0;
    for (size_t w = 0, start = 0; w < n_words; start = ends[w++])
        if (ends[w] - start > longest)
            longest = ends[w] - start;
    if (!fitm_buf_reserve(&scratch[1], 2 * longest + 1) ||
        !fitm_buf_reserve(&scratch[2], (2 * longest + 1) * sizeof(tok_sym)) ||
        !fitm_buf_reserve(&scratch[3], (6 * longest + 1) * sizeof(tok_bigram)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory tokenizing %zu bytes", len);
    ends = (void *)scratch[0].p;
    char *enc = scratch[1].p;
    for (size_t w = 0, start = 0; w < n_words; start = ends[w++]) {
        size_t m = 0;
        for (size_t b = start; b < ends[w]; b++)
            m += fitm_unicode_utf8_encode(tok->bpe_cp[(unsigned char)text[b]], enc + m);
        bpe_word(tok, enc, m, (void *)scratch[2].p, (void *)scratch[3].p, out);
    }
    return FITM_OK;
}
