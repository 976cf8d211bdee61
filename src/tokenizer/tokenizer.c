/* tokenizer: the public API's encoding and decoding — special-token matching, the
 * SentencePiece-style merge, pieces — and the queries. Loading lives in tok_load.c, byte-level
 * BPE in tok_bpe.c.
 *
 * SPM encoding, as llama.cpp's llm_tokenizer_spm does it: spaces become "▁" (with one "▁" in
 * front when the model adds a space prefix), the text is cut into UTF-8 characters, and while
 * some adjacent pair of symbols spells a vocabulary token, the pair whose token has the highest
 * score (leftmost on ties) is merged. Symbols left over that are not tokens are written as
 * byte tokens. */
#include "tokenizer/tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "base/unicode.h"
#include "tokenizer/tok_internal.h"

#define SPM_SPACE "\xE2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's space */

/* ---------------------------------------------------------------------------------------- */
/* Small helpers shared with tok_bpe.c. */

void tok_heap_push(tok_bigram *h, size_t *n, tok_bigram b)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (b.key <= h[parent].key)
            break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = b;
}

/* Floyd's bottom-up pop: move the hole down along the larger children to a leaf (one
 * comparison per level, no early exit to mispredict), then sift the last element up from there
 * (it is small, so it rarely moves far). */
tok_bigram tok_heap_pop(tok_bigram *h, size_t *n)
{
    tok_bigram top = h[0];
    size_t m = --(*n);
    if (m == 0)
        return top;
    size_t i = 0;
    for (size_t c = 1; c < m; c = 2 * i + 1) {
        c += c + 1 < m && h[c + 1].key > h[c].key;
        h[i] = h[c];
        i = c;
    }
    tok_bigram last = h[m];
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h[parent].key >= last.key)
            break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = last;
    return top;
}

/* ---------------------------------------------------------------------------------------- */
/* Queries. */

fitm_tok_type fitm_tok_get_type(const fitm_tokenizer *tok)
{
    return tok->type;
}
fitm_tok_pre fitm_tok_get_pre(const fitm_tokenizer *tok)
{
    return tok->pre;
}
int32_t fitm_tok_n_vocab(const fitm_tokenizer *tok)
{
    return tok->n_vocab;
}
int32_t fitm_tok_bos(const fitm_tokenizer *tok)
{
    return tok->bos;
}
int32_t fitm_tok_eos(const fitm_tokenizer *tok)
{
    return tok->eos;
}
int32_t fitm_tok_eot(const fitm_tokenizer *tok)
{
    return tok->eot;
}
int32_t fitm_tok_unk(const fitm_tokenizer *tok)
{
    return tok->unk;
}
int32_t fitm_tok_pad(const fitm_tokenizer *tok)
{
    return tok->pad;
}
bool fitm_tok_adds_bos(const fitm_tokenizer *tok)
{
    return tok->add_bos;
}
bool fitm_tok_adds_eos(const fitm_tokenizer *tok)
{
    return tok->add_eos;
}
bool fitm_tok_adds_space_prefix(const fitm_tokenizer *tok)
{
    return tok->add_space_prefix;
}

bool fitm_tok_is_eog(const fitm_tokenizer *tok, int32_t id)
{
    if (id < 0 || id >= tok->n_vocab)
        return false;
    for (int i = 0; i < tok->n_eog; i++)
        if (tok->eog[i] == id)
            return true;
    return false;
}

fitm_tok_kind fitm_tok_get_kind(const fitm_tokenizer *tok, int32_t id)
{
    if (id < 0 || id >= tok->n_vocab)
        return FITM_TOK_KIND_UNDEFINED;
    return (fitm_tok_kind)tok->kind[id];
}

const char *fitm_tok_text(const fitm_tokenizer *tok, int32_t id, size_t *len)
{
    if (id < 0 || id >= tok->n_vocab) {
        *len = 0;
        return NULL;
    }
    *len = tok->tok_len[id];
    return tok->blob + tok->tok_off[id];
}

int32_t fitm_tok_find(const fitm_tokenizer *tok, const char *text)
{
    return tok_lookup(tok, text, strlen(text));
}

/* ---------------------------------------------------------------------------------------- */
/* SPM encoding of one fragment without special tokens. */

static void spm_add_bigram(const fitm_tokenizer *tok, const char *s, const tok_sym *sym, int32_t l,
                           int32_t r, tok_bigram *heap, size_t *n_heap)
{
    if (l < 0 || r < 0)
        return;
    int32_t id = tok_lookup_plain(tok, s + sym[l].off, (size_t)sym[l].n + sym[r].n);
    if (id < 0)
        return;
    tok_heap_push(heap, n_heap, tok_bigram_make(tok->score_key[id], l, r, sym[l].n + sym[r].n));
}

/* Bytes of sym that are no token: byte tokens, or one unknown token when the vocabulary
 * lacks a byte token for one of them. */
static void spm_emit_bytes(const fitm_tokenizer *tok, const unsigned char *s, uint32_t n,
                           tok_out *out)
{
    for (uint32_t k = 0; k < n; k++)
        if (tok->byte_tok[s[k]] < 0) {
            if (tok->unk >= 0)
                tok_emit(out, tok->unk);
            return;
        }
    for (uint32_t k = 0; k < n; k++)
        tok_emit(out, tok->byte_tok[s[k]]);
}

/* Whether no merge can join a character c to a "▁" right after it: true unless some token
 * contains c followed by "▁" (Gemma 3 has one, ">▁</"). Then the text can be merged in
 * segments that each start at such a "▁": the result is the same as merging it whole (a merge
 * across the cut would be a token containing c "▁"), and the heaps stay small. */
static bool spm_cuts_before_space(const fitm_tokenizer *tok, uint32_t c)
{
    if (!tok->spm_segments || c == 0x2581 || c == FITM_UNICODE_INVALID)
        return false;
    for (int i = 0; i < tok->n_spm_glue; i++)
        if (tok->spm_glue[i] == c)
            return false;
    return true;
}

void tok_merge(const fitm_tokenizer *tok, const char *s, tok_sym *sym, int32_t a, int32_t b,
               tok_bigram *heap, tok_add_bigram_fn add)
{
    size_t n_heap = 0;
    for (int32_t i = a + 1; i < b; i++)
        add(tok, s, sym, i - 1, i, heap, &n_heap);
    while (n_heap > 0) {
        tok_bigram bg = tok_heap_pop(heap, &n_heap);
        int32_t left = tok_bigram_left(bg);
        tok_sym *l = &sym[left], *r = &sym[bg.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != bg.size)
            continue; /* stale: one side was merged since */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            sym[r->next].prev = left;
        add(tok, s, sym, l->prev, left, heap, &n_heap);
        add(tok, s, sym, left, l->next, heap, &n_heap);
    }
}

/* Merges symbols [a, b) — highest score first, leftmost on ties — and emits their tokens. */
static void spm_merge(const fitm_tokenizer *tok, const char *s, tok_sym *sym, int32_t a, int32_t b,
                      tok_bigram *heap, tok_out *out)
{
    sym[a].prev = -1;
    sym[b - 1].next = -1;
    tok_merge(tok, s, sym, a, b, heap, spm_add_bigram);
    for (int32_t i = a; i != -1; i = sym[i].next) {
        int32_t id = tok_lookup_plain(tok, s + sym[i].off, sym[i].n);
        if (id >= 0)
            tok_emit(out, id);
        else
            spm_emit_bytes(tok, (const unsigned char *)s + sym[i].off, sym[i].n, out);
    }
}

static fitm_status spm_encode(const fitm_tokenizer *tok, const char *text, size_t len, bool prefix,
                              tok_out *out, fitm_buf scratch[4], fitm_err *err)
{
    /* Escape: optional leading "▁", every ' ' -> "▁". */
    size_t m = 0;
    if (!fitm_buf_reserve(&scratch[0], 3 * len + 3))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory tokenizing %zu bytes", len);
    char *s = scratch[0].p;
    if (prefix) {
        memcpy(s, SPM_SPACE, 3);
        m = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + m, SPM_SPACE, 3);
            m += 3;
        } else {
            s[m++] = text[i];
        }
    }
    if (m == 0)
        return FITM_OK;

    /* Symbols: one per UTF-8 character (an invalid byte is a character of its own). */
    if (!fitm_buf_reserve(&scratch[1], m * sizeof(tok_sym)) ||
        !fitm_buf_reserve(&scratch[2], (3 * m + 1) * sizeof(tok_bigram)))
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory tokenizing %zu bytes", len);
    tok_sym *sym = (void *)scratch[1].p;
    tok_bigram *heap = (void *)scratch[2].p;
    int32_t n_sym = 0, seg = 0;
    uint32_t prev_cp = FITM_UNICODE_INVALID;
    for (size_t off = 0; off < m;) {
        uint32_t cp;
        size_t n = fitm_unicode_utf8_decode(s + off, m - off, &cp);
        /* A "▁" after a character no token joins to a following "▁" starts a new segment. */
        if (cp == 0x2581 && n_sym > seg && spm_cuts_before_space(tok, prev_cp)) {
            spm_merge(tok, s, sym, seg, n_sym, heap, out);
            seg = n_sym;
        }
        sym[n_sym] = (tok_sym){n_sym - 1, n_sym + 1, (uint32_t)off, (uint32_t)n};
        n_sym++;
        off += n;
        prev_cp = cp;
    }
    spm_merge(tok, s, sym, seg, n_sym, heap, out);
    return FITM_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding: special tokens first, then each plain fragment. */

/* Longest special token (allowed by parse_special) starting at text[pos]; its length in
 * *n_match, or -1. */
static int32_t match_special(const fitm_tokenizer *tok, const char *text, size_t len, size_t pos,
                             bool parse_special, size_t *n_match)
{
    int32_t best = -1, node = 0;
    for (size_t q = pos; q < len; q++) {
        node = tok_trie_child(tok, node, (unsigned char)text[q]);
        if (node < 0)
            break;
        int32_t id = tok->node_tok[node];
        if (id >= 0 && (parse_special || tok->kind[id] == FITM_TOK_KIND_USER_DEFINED)) {
            best = id;
            *n_match = q + 1 - pos;
        }
    }
    return best;
}

static fitm_status encode_fragment(const fitm_tokenizer *tok, const char *text, size_t len,
                                   bool prev_special, tok_out *out, fitm_buf scratch[4],
                                   fitm_err *err)
{
    if (tok->type == FITM_TOK_SPM)
        return spm_encode(tok, text, len, tok->add_space_prefix && prev_special, out, scratch, err);
    return tok_bpe_encode(tok, text, len, out, scratch, err);
}

fitm_status fitm_tok_encode(const fitm_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                            int32_t *ids, int64_t n_max, int64_t *n_out, fitm_err *err)
{
    *n_out = 0;
    if (len > FITM_TOK_MAX_TEXT_BYTES)
        return fitm_err_set(err, FITM_ERR_LIMIT,
                            "text of %zu bytes is over the tokenizer's limit of %zu", len,
                            FITM_TOK_MAX_TEXT_BYTES);
    if (n_max < 0 || (n_max > 0 && !ids) || (len > 0 && !text))
        return fitm_err_set(err, FITM_ERR_INVALID, "fitm_tok_encode: bad arguments");
    tok_out out = {ids, n_max, 0};
    fitm_buf scratch[4] = {{0}};
    fitm_status st = FITM_OK;
    bool parse_special = (flags & FITM_TOK_PARSE_SPECIAL) != 0;
    /* llama.cpp: the space prefix goes before the first fragment and after every special. */
    bool prev_special = !(flags & FITM_TOK_CONTINUATION);

    if ((flags & FITM_TOK_ADD_BOS) && tok->add_bos)
        tok_emit(&out, tok->bos);
    size_t frag = 0;
    for (size_t pos = 0; pos < len;) {
        unsigned char c = (unsigned char)text[pos];
        size_t n_match = 0;
        int32_t id = -1;
        if (tok->special_first[c >> 3] & (1u << (c & 7)))
            id = match_special(tok, text, len, pos, parse_special, &n_match);
        if (id < 0) {
            pos++;
            continue;
        }
        if (pos > frag) {
            st = encode_fragment(tok, text + frag, pos - frag, prev_special, &out, scratch, err);
            if (st != FITM_OK)
                goto done;
        }
        tok_emit(&out, id);
        prev_special = true;
        pos += n_match;
        frag = pos;
    }
    if (len > frag) {
        st = encode_fragment(tok, text + frag, len - frag, prev_special, &out, scratch, err);
        if (st != FITM_OK)
            goto done;
    }
    if ((flags & FITM_TOK_ADD_EOS) && tok->add_eos)
        tok_emit(&out, tok->eos);
    *n_out = out.n;
    if (out.n > n_max)
        st = fitm_err_set(err, FITM_ERR_LIMIT, "text needs %lld tokens, room for %lld",
                          (long long)out.n, (long long)n_max);
done:
    for (int i = 0; i < 4; i++)
        fitm_buf_free(&scratch[i]);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Decoding. */

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Where a piece goes: out[0..cap) gets what fits, w counts every byte. strip drops the first
 * byte if it is a space (and is cleared by the first byte either way). */
typedef struct {
    char *out;
    size_t cap, w;
    bool strip;
} piece_sink;

static void put(piece_sink *ps, char c)
{
    if (ps->strip) {
        ps->strip = false;
        if (c == ' ')
            return;
    }
    if (ps->w < ps->cap)
        ps->out[ps->w] = c;
    ps->w++;
}

static void put_n(piece_sink *ps, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        put(ps, s[i]);
}

/* Writes the piece of id into out[0..cap) (as much as fits) and returns its full length. */
static size_t piece(const fitm_tokenizer *tok, int32_t id, uint32_t flags, bool strip_space,
                    char *out, size_t cap)
{
    const char *s = tok->blob + tok->tok_off[id];
    size_t n = tok->tok_len[id];
    piece_sink ps = {out, cap, 0, strip_space};
    switch ((fitm_tok_kind)tok->kind[id]) {
    case FITM_TOK_KIND_CONTROL:
    case FITM_TOK_KIND_UNKNOWN:
        if (!(flags & FITM_TOK_DECODE_SPECIAL))
            return 0;
        put_n(&ps, s, n);
        return ps.w;
    case FITM_TOK_KIND_USER_DEFINED: /* the text as it is */
        put_n(&ps, s, n);
        return ps.w;
    case FITM_TOK_KIND_UNUSED:
    case FITM_TOK_KIND_UNDEFINED:
        return 0;
    case FITM_TOK_KIND_BYTE:
        if (tok->type == FITM_TOK_SPM) {
            int hi = n == 6 ? hex_digit(s[3]) : -1, lo = n == 6 ? hex_digit(s[4]) : -1;
            if (hi < 0 || lo < 0 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
                return 0;
            put(&ps, (char)(hi * 16 + lo));
            return ps.w;
        }
        break; /* byte-level BPE: decode like a normal token */
    case FITM_TOK_KIND_NORMAL:
        break;
    }
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = fitm_unicode_utf8_decode(s + i, n - i, &cp);
        int b = -1;
        if (tok->type == FITM_TOK_SPM)
            b = cp == 0x2581 ? ' ' : -1;
        else if (cp < 324)
            b = tok->bpe_byte[cp];
        if (b >= 0)
            put(&ps, (char)b);
        else
            put_n(&ps, s + i, k); /* as it is: not "▁" / not a byte stand-in */
        i += k;
    }
    return ps.w;
}

fitm_status fitm_tok_piece(const fitm_tokenizer *tok, int32_t id, uint32_t flags, char *out,
                           size_t cap, size_t *n_out, fitm_err *err)
{
    *n_out = 0;
    if (id < 0 || id >= tok->n_vocab)
        return fitm_err_set(err, FITM_ERR_INVALID, "token id %d is out of range [0, %d)", id,
                            tok->n_vocab);
    *n_out = piece(tok, id, flags, false, out, cap);
    if (*n_out > cap)
        return fitm_err_set(err, FITM_ERR_LIMIT, "piece of token %d needs %zu bytes, room for %zu",
                            id, *n_out, cap);
    return FITM_OK;
}

fitm_status fitm_tok_decode(const fitm_tokenizer *tok, const int32_t *ids, int64_t n,
                            uint32_t flags, char *out, size_t cap, size_t *n_out, fitm_err *err)
{
    *n_out = 0;
    size_t w = 0;
    int64_t strip_at = -1;
    if ((flags & FITM_TOK_DECODE_STRIP_PREFIX) && tok->add_space_prefix && n > 0)
        strip_at = (ids[0] == tok->bos && tok->bos >= 0) ? 1 : 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_vocab)
            return fitm_err_set(err, FITM_ERR_INVALID, "ids[%lld] = %d is out of range [0, %d)",
                                (long long)i, ids[i], tok->n_vocab);
        w += piece(tok, ids[i], flags, i == strip_at, w < cap ? out + w : NULL,
                   w < cap ? cap - w : 0);
    }
    *n_out = w;
    if (w > cap)
        return fitm_err_set(err, FITM_ERR_LIMIT, "decoded text needs %zu bytes, room for %zu", w,
                            cap);
    if (w < cap)
        out[w] = '\0';
    return FITM_OK;
}

size_t fitm_tok_utf8_complete(const char *buf, size_t n)
{
    return fitm_unicode_utf8_complete(buf, n);
}
