/* tok_load: building a tokenizer from GGUF metadata (fitm_tok_create / fitm_tok_destroy):
 * token texts, kinds and scores copied out of the file, the text -> id and merge tables, the
 * special-token trie, special ids and the end-of-generation set. Everything is sized from
 * counts checked first, so a hostile file gives an error, not a crash. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/unicode.h"
#include "tokenizer/tok_internal.h"

#define MAX_TOKENS ((uint64_t)1 << 30)
#define SPM_SPACE "\xE2\x96\x81" /* U+2581, SentencePiece's space */

/* ---------------------------------------------------------------------------------------- */
/* Tables. */

static uint32_t table_size(uint64_t n)
{
    uint64_t size = 16;
    while (size < 2 * n)
        size *= 2;
    return (uint32_t)size;
}

int32_t tok_lookup(const fitm_tokenizer *tok, const char *s, size_t n)
{
    if (n == 0 || n > UINT16_MAX)
        return -1;
    uint64_t h = tok_hash_bytes(TOK_HASH_SEED, s, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint32_t i = (uint32_t)h & tok->tok_mask;; i = (i + 1) & tok->tok_mask) {
        int32_t id = tok->tok_tab[i].id;
        if (id < 0)
            return -1;
        if (tok->tok_tab[i].tag == tag && tok->tok_len[id] == n &&
            !memcmp(tok->blob + tok->tok_off[id], s, n))
            return id;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Loading. */

static void tok_free(fitm_tokenizer *t)
{
    free(t->blob);
    free(t->tok_off);
    free(t->tok_len);
    free(t->score_key);
    free(t->kind);
    free(t->tok_tab);
    free(t->mrg_off);
    free(t->mrg_nl);
    free(t->mrg_nr);
    free(t->mrg_tab);
    free(t->node_tok);
    free(t->edge_key);
    free(t->edge_child);
    free(t);
}

void fitm_tok_destroy(fitm_tokenizer *tok)
{
    if (tok)
        tok_free(tok);
}

/* Reads an optional special-token id: absent, "none" (0xFFFFFFFF / negative) or out of range
 * keeps *id (llama.cpp keeps its default for out-of-range ids too). */
static fitm_status read_special_id(const fitm_gguf *g, const char *key, int32_t n_vocab,
                                   int32_t *id, fitm_err *err)
{
    int64_t v;
    fitm_status st = fitm_gguf_get_i64(g, key, &v, err);
    if (st == FITM_ERR_NOT_FOUND)
        return FITM_OK;
    if (st != FITM_OK)
        return st;
    if (v == 0xFFFFFFFFll || v < 0)
        *id = -1;
    else if (v < n_vocab)
        *id = (int32_t)v;
    return FITM_OK;
}

static fitm_status read_flag(const fitm_gguf *g, const char *key, bool *flag, fitm_err *err)
{
    fitm_status st = fitm_gguf_get_bool(g, key, flag, err);
    return st == FITM_ERR_NOT_FOUND ? FITM_OK : st;
}

static bool str_is(fitm_gguf_str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.len == n && !memcmp(s.ptr, lit, n);
}

/* tokenizer.ggml.pre -> pre-tokenizer. The names are llama.cpp's for these regexes. */
static fitm_status pick_pre(const fitm_gguf *g, fitm_tokenizer *t, fitm_err *err)
{
    fitm_gguf_str pre;
    fitm_status st = fitm_gguf_get_str(g, "tokenizer.ggml.pre", &pre, err);
    if (st == FITM_ERR_NOT_FOUND) {
        t->pre = FITM_TOK_PRE_GPT2;
        return FITM_OK;
    }
    if (st != FITM_OK)
        return st;
    static const char *const gpt2[] = {"gpt-2",        "phi-2",      "roberta-bpe", "jina-es",
                                       "jina-de",      "jina-v1-en", "jina-v2-es",  "jina-v2-de",
                                       "jina-v2-code", "gigachat",   "mpt",         "olmo",
                                       "jais"};
    static const char *const llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3"};
    static const char *const llama3_regex[] = {"dbrx", "smaug-bpe"};
    static const char *const qwen2[] = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"};
    for (size_t i = 0; i < sizeof gpt2 / sizeof gpt2[0]; i++)
        if (str_is(pre, gpt2[i])) {
            t->pre = FITM_TOK_PRE_GPT2;
            return FITM_OK;
        }
    for (size_t i = 0; i < sizeof llama3 / sizeof llama3[0]; i++)
        if (str_is(pre, llama3[i])) {
            t->pre = FITM_TOK_PRE_LLAMA3;
            t->ignore_merges = true; /* a word that is a token is taken whole */
            t->add_bos = true;
            return FITM_OK;
        }
    for (size_t i = 0; i < sizeof llama3_regex / sizeof llama3_regex[0]; i++)
        if (str_is(pre, llama3_regex[i])) {
            t->pre = FITM_TOK_PRE_LLAMA3;
            return FITM_OK;
        }
    for (size_t i = 0; i < sizeof qwen2 / sizeof qwen2[0]; i++)
        if (str_is(pre, qwen2[i])) {
            t->pre = FITM_TOK_PRE_QWEN2;
            return FITM_OK;
        }
    int shown = pre.len > 64 ? 64 : (int)pre.len;
    return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                        "tokenizer.ggml.pre '%.*s' is not supported (supported: gpt-2, llama-bpe, "
                        "qwen2 and their aliases)",
                        shown, pre.ptr);
}

/* Maps a score to a key whose unsigned order is the scores' order: flip all bits of negative
 * floats, the sign bit of the others. -0 is +0 (they compare equal), NaN is -inf. */
static uint32_t score_key(float sc)
{
    if (isnan(sc))
        sc = -INFINITY;
    if (sc == 0.0f)
        sc = 0.0f;
    uint32_t u;
    memcpy(&u, &sc, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Copies token texts, scores and kinds, and builds the text -> id table. */
static fitm_status load_tokens(const fitm_gguf *g, fitm_tokenizer *t, uint64_t *blob_used,
                               uint64_t merge_bytes, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    uint64_t n = (uint64_t)t->n_vocab;
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        fitm_gguf_str s = fitm_gguf_arr_str(g, kv, i);
        if (s.len > FITM_TOK_MAX_PIECE_BYTES)
            return fitm_err_set(
                err, FITM_ERR_FORMAT, "tokenizer.ggml.tokens[%llu] is %llu bytes long (limit %d)",
                (unsigned long long)i, (unsigned long long)s.len, FITM_TOK_MAX_PIECE_BYTES);
        total += s.len;
    }
    if (total + merge_bytes > UINT32_MAX)
        return fitm_err_set(err, FITM_ERR_LIMIT, "tokenizer texts take %llu bytes (limit 4 GiB)",
                            (unsigned long long)(total + merge_bytes));
    t->blob = malloc(total + merge_bytes + 1);
    t->tok_off = malloc(n * sizeof *t->tok_off);
    t->tok_len = malloc(n * sizeof *t->tok_len);
    t->score_key = malloc(n * sizeof *t->score_key);
    t->kind = malloc(n);
    t->tok_mask = table_size(n) - 1;
    t->tok_tab = malloc(((uint64_t)t->tok_mask + 1) * sizeof *t->tok_tab);
    if (!t->blob || !t->tok_off || !t->tok_len || !t->score_key || !t->kind || !t->tok_tab)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %llu tokens",
                            (unsigned long long)n);
    memset(t->tok_tab, 0xFF, ((uint64_t)t->tok_mask + 1) * sizeof *t->tok_tab);

    const void *scores = NULL, *types = NULL;
    uint64_t n_scores = 0, n_types = 0;
    fitm_status st =
        fitm_gguf_get_arr(g, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, &scores, &n_scores, err);
    if (st != FITM_OK && st != FITM_ERR_NOT_FOUND)
        return st;
    if (st == FITM_OK && n_scores != n)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tokenizer.ggml.scores has %llu entries for %llu tokens",
                            (unsigned long long)n_scores, (unsigned long long)n);
    st = fitm_gguf_get_arr(g, "tokenizer.ggml.token_type", FITM_GGUF_INT32, &types, &n_types, err);
    if (st != FITM_OK && st != FITM_ERR_NOT_FOUND)
        return st;
    if (st == FITM_OK && n_types != n)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tokenizer.ggml.token_type has %llu entries for %llu tokens",
                            (unsigned long long)n_types, (unsigned long long)n);

    uint64_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        fitm_gguf_str s = fitm_gguf_arr_str(g, kv, i);
        memcpy(t->blob + off, s.ptr, s.len);
        t->tok_off[i] = (uint32_t)off;
        t->tok_len[i] = (uint16_t)s.len;
        off += s.len;

        float sc = 0.0f;
        if (scores)
            memcpy(&sc, (const char *)scores + 4 * i, 4);
        t->score_key[i] = score_key(sc);
        int32_t ty = FITM_TOK_KIND_NORMAL;
        if (types)
            memcpy(&ty, (const char *)types + 4 * i, 4);
        t->kind[i] = (uint8_t)(ty >= 0 && ty <= FITM_TOK_KIND_BYTE ? ty : FITM_TOK_KIND_UNDEFINED);
    }

    /* The text -> id table. Slots are looked up TOK_AHEAD tokens in advance so that the cache
     * misses of a table larger than the cache overlap. Empty texts can never match; a repeated
     * text maps to its last id (as llama.cpp). */
    enum { TOK_AHEAD = 16 };
    uint64_t ring[TOK_AHEAD];
    for (uint64_t i = 0; i < n + TOK_AHEAD; i++) {
        uint64_t j = i - TOK_AHEAD; /* the token inserted now; its hash is in the ring */
        if (i >= TOK_AHEAD && t->tok_len[j] > 0) {
            uint64_t h = ring[j % TOK_AHEAD];
            const char *text = t->blob + t->tok_off[j];
            for (uint32_t k = (uint32_t)h & t->tok_mask;; k = (k + 1) & t->tok_mask) {
                int32_t other = t->tok_tab[k].id;
                if (other < 0 || (t->tok_tab[k].tag == (uint32_t)(h >> 32) &&
                                  t->tok_len[other] == t->tok_len[j] &&
                                  !memcmp(t->blob + t->tok_off[other], text, t->tok_len[j]))) {
                    t->tok_tab[k].id = (int32_t)j;
                    t->tok_tab[k].tag = (uint32_t)(h >> 32);
                    break;
                }
            }
        }
        if (i < n) {
            uint64_t h = tok_hash_bytes(TOK_HASH_SEED, t->blob + t->tok_off[i], t->tok_len[i]);
            ring[i % TOK_AHEAD] = h;
            __builtin_prefetch(&t->tok_tab[h & t->tok_mask], 1);
        }
    }
    *blob_used = off;
    return FITM_OK;
}

/* Hash of a merge pair: the hash of the two texts' concatenation h, mixed with where the
 * left one ends (so that "ab c" and "a bc" differ). */
static uint64_t merge_hash(uint64_t h, uint64_t nl)
{
    h ^= (nl + 1) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 29);
}

/* Copies merges "left right" after the token texts and builds (pair -> rank). */
static fitm_status load_merges(const fitm_gguf *g, fitm_tokenizer *t, uint64_t off, fitm_err *err)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "tokenizer.ggml.merges");
    uint64_t n = (uint64_t)t->n_merges;
    t->mrg_off = malloc((n ? n : 1) * sizeof *t->mrg_off);
    t->mrg_nl = malloc((n ? n : 1) * sizeof *t->mrg_nl);
    t->mrg_nr = malloc((n ? n : 1) * sizeof *t->mrg_nr);
    t->mrg_mask = table_size(n) - 1;
    t->mrg_tab = malloc(((uint64_t)t->mrg_mask + 1) * sizeof *t->mrg_tab);
    if (!t->mrg_off || !t->mrg_nl || !t->mrg_nr || !t->mrg_tab)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for %llu merges",
                            (unsigned long long)n);
    memset(t->mrg_tab, 0xFF, ((uint64_t)t->mrg_mask + 1) * sizeof *t->mrg_tab);
    for (uint64_t r = 0; r < n; r++) {
        fitm_gguf_str s = fitm_gguf_arr_str(g, kv, r);
        memcpy(t->blob + off, s.ptr, s.len);
        t->mrg_off[r] = (uint32_t)off;
        off += s.len;
        /* The separator is the first space after the first byte (llama.cpp's rule). */
        const char *sp = s.len > 1 ? memchr(s.ptr + 1, ' ', s.len - 1) : NULL;
        if (!sp) {
            t->mrg_nl[r] = t->mrg_nr[r] = 0; /* malformed: never matches */
            continue;
        }
        uint64_t nl = (uint64_t)(sp - s.ptr), nr = s.len - nl - 1;
        if (nr == 0 || nl > FITM_TOK_MAX_PIECE_BYTES || nr > FITM_TOK_MAX_PIECE_BYTES) {
            t->mrg_nl[r] = t->mrg_nr[r] = 0;
            continue;
        }
        t->mrg_nl[r] = (uint16_t)nl;
        t->mrg_nr[r] = (uint16_t)nr;
        const char *m = t->blob + t->mrg_off[r];
        uint64_t h =
            merge_hash(tok_hash_bytes(tok_hash_bytes(TOK_HASH_SEED, m, nl), m + nl + 1, nr), nl);
        for (uint32_t i = (uint32_t)h & t->mrg_mask;; i = (i + 1) & t->mrg_mask) {
            int32_t other = t->mrg_tab[i].id;
            if (other < 0) {
                t->mrg_tab[i].id = (int32_t)r;
                t->mrg_tab[i].tag = (uint32_t)(h >> 32);
                break;
            }
            const char *o = t->blob + t->mrg_off[other];
            if (t->mrg_nl[other] == nl && t->mrg_nr[other] == nr && !memcmp(o, m, nl) &&
                !memcmp(o + nl + 1, m + nl + 1, nr))
                break; /* repeated pair: the first (lowest) rank stays */
        }
    }
    return FITM_OK;
}

int32_t tok_bpe_rank(const fitm_tokenizer *tok, const char *s, uint32_t nl, uint32_t nr)
{
    if (tok->n_merges == 0)
        return -1;
    uint64_t h = merge_hash(tok_hash_bytes(TOK_HASH_SEED, s, (size_t)nl + nr), nl);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint32_t i = (uint32_t)h & tok->mrg_mask;; i = (i + 1) & tok->mrg_mask) {
        int32_t r = tok->mrg_tab[i].id;
        if (r < 0)
            return -1;
        const char *m = tok->blob + tok->mrg_off[r];
        if (tok->mrg_tab[i].tag == tag && tok->mrg_nl[r] == nl && tok->mrg_nr[r] == nr &&
            !memcmp(m, s, nl) && !memcmp(m + nl + 1, s + nl, nr))
            return r;
    }
}

static bool is_special_kind(uint8_t k)
{
    return k == FITM_TOK_KIND_CONTROL || k == FITM_TOK_KIND_USER_DEFINED ||
           k == FITM_TOK_KIND_UNKNOWN;
}

static uint32_t edge_slot(const fitm_tokenizer *t, uint64_t key)
{
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    uint32_t i = (uint32_t)(h >> 32) & t->edge_mask;
    while (t->edge_key[i] != 0 && t->edge_key[i] != key)
        i = (i + 1) & t->edge_mask;
    return i;
}

/* Child of node along byte b, or -1. */
int32_t tok_trie_child(const fitm_tokenizer *t, int32_t node, unsigned char b)
{
    uint64_t key = (((uint64_t)node << 8) | b) + 1;
    uint32_t i = edge_slot(t, key);
    return t->edge_key[i] ? t->edge_child[i] : -1;
}

static fitm_status build_special_trie(fitm_tokenizer *t, fitm_err *err)
{
    uint64_t n_bytes = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (is_special_kind(t->kind[id]))
            n_bytes += t->tok_len[id];
    t->node_tok = malloc((n_bytes + 1) * sizeof *t->node_tok);
    t->edge_mask = table_size(n_bytes) - 1;
    t->edge_key = calloc((uint64_t)t->edge_mask + 1, sizeof *t->edge_key);
    t->edge_child = malloc(((uint64_t)t->edge_mask + 1) * sizeof *t->edge_child);
    if (!t->node_tok || !t->edge_key || !t->edge_child)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the special-token trie");
    t->n_nodes = 1;
    t->node_tok[0] = -1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!is_special_kind(t->kind[id]) || t->tok_len[id] == 0)
            continue;
        const unsigned char *s = (const unsigned char *)t->blob + t->tok_off[id];
        t->special_first[s[0] >> 3] |= (uint8_t)(1u << (s[0] & 7));
        int32_t node = 0;
        for (uint32_t k = 0; k < t->tok_len[id]; k++) {
            uint64_t key = (((uint64_t)node << 8) | s[k]) + 1;
            uint32_t i = edge_slot(t, key);
            if (!t->edge_key[i]) {
                t->edge_key[i] = key;
                t->edge_child[i] = t->n_nodes;
                t->node_tok[t->n_nodes++] = -1;
            }
            node = t->edge_child[i];
        }
        t->node_tok[node] = id; /* a repeated text keeps the last id, as the text table */
    }
    return FITM_OK;
}

/* End-of-generation tokens. llama.cpp recognises them by their text and makes them CONTROL
 * (so that their exact text parses as the token); we do the same. */
static void find_eog(fitm_tokenizer *t, bool have_eot, bool have_eom)
{
    static const char *const eot_texts[] = {"<|eot_id|>",    "<|im_end|>",    "<|end|>",
                                            "<end_of_turn>", "<|endoftext|>", "<EOT>"};
    static const char *const eog_texts[] = {"<|eot_id|>",    "<|im_end|>",    "<|end|>",
                                            "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                                            "<EOT>"};
    if (!have_eot)
        for (size_t i = 0; i < sizeof eot_texts / sizeof eot_texts[0] && t->eot < 0; i++)
            t->eot = tok_lookup(t, eot_texts[i], strlen(eot_texts[i]));
    if (!have_eom)
        t->eom = tok_lookup(t, "<|eom_id|>", strlen("<|eom_id|>"));
    int32_t cand[TOK_MAX_EOG];
    int n = 0;
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++) {
        int32_t id = tok_lookup(t, eog_texts[i], strlen(eog_texts[i]));
        if (id >= 0) {
            t->kind[id] = FITM_TOK_KIND_CONTROL;
            cand[n++] = id;
        }
    }
    cand[n++] = t->eos;
    cand[n++] = t->eot;
    cand[n++] = t->eom;
    t->n_eog = 0;
    for (int i = 0; i < n; i++) {
        bool seen = cand[i] < 0;
        for (int j = 0; j < t->n_eog && !seen; j++)
            seen = t->eog[j] == cand[i];
        if (!seen)
            t->eog[t->n_eog++] = cand[i];
    }
}

/* The characters some token has right before a "▁" (see spm_cuts_before_space). With more
 * than TOK_MAX_GLUE of them, or an invalid byte there, SPM merges whole fragments. */
static void find_spm_glue(fitm_tokenizer *t)
{
    t->spm_segments = true;
    for (int32_t id = 0; id < t->n_vocab && t->spm_segments; id++) {
        const char *s = t->blob + t->tok_off[id], *end = s + t->tok_len[id];
        for (const char *p = s + 1; p < end; p++) {
            p = memmem(p, (size_t)(end - p), SPM_SPACE, 3);
            if (!p)
                break;
            /* the character that ends right before p: its lead byte is at most 3 bytes back */
            uint32_t prev = FITM_UNICODE_INVALID;
            for (size_t back = 1; back <= 4 && back <= (size_t)(p - s); back++) {
                uint32_t cp;
                if (fitm_unicode_utf8_decode(p - back, back, &cp) == back &&
                    cp != FITM_UNICODE_INVALID) {
                    prev = cp;
                    break;
                }
            }
            if (prev == 0x2581)
                continue;
            bool seen = false;
            for (int j = 0; j < t->n_spm_glue && !seen; j++)
                seen = t->spm_glue[j] == prev;
            if (prev == FITM_UNICODE_INVALID || (!seen && t->n_spm_glue == TOK_MAX_GLUE))
                t->spm_segments = false;
            else if (!seen)
                t->spm_glue[t->n_spm_glue++] = prev;
        }
    }
}

static void find_byte_tokens(fitm_tokenizer *t)
{
    for (int b = 0; b < 256; b++) {
        char s[8];
        t->byte_tok[b] = -1;
        if (t->type == FITM_TOK_SPM) {
            static const char hex[] = "0123456789ABCDEF";
            char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            t->byte_tok[b] = tok_lookup(t, name, 6);
            if (t->byte_tok[b] < 0) {
                s[0] = (char)b;
                t->byte_tok[b] = tok_lookup(t, s, 1);
            }
        } else {
            size_t n = fitm_unicode_utf8_encode(t->bpe_cp[b], s);
            t->byte_tok[b] = tok_lookup(t, s, n);
        }
    }
}

fitm_status fitm_tok_create(fitm_tokenizer **out, const fitm_gguf *g, fitm_err *err)
{
    *out = NULL;
    fitm_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the tokenizer");
    fitm_status st;
    fitm_gguf_str model;
    st = fitm_gguf_get_str(g, "tokenizer.ggml.model", &model, err);
    if (st == FITM_ERR_NOT_FOUND)
        st = fitm_err_set(err, st,
                          "no tokenizer in the model: key 'tokenizer.ggml.model' is absent");
    if (st != FITM_OK)
        goto fail;

    /* Per-type defaults, overridden by the metadata below (llama.cpp's defaults). */
    t->bos = t->eos = t->eot = t->eom = t->unk = t->pad = -1;
    int32_t def_bos = -1, def_eos = -1, def_unk = -1;
    if (str_is(model, "llama")) {
        t->type = FITM_TOK_SPM;
        t->pre = FITM_TOK_PRE_NONE;
        def_bos = 1;
        def_eos = 2;
        def_unk = 0;
        t->add_bos = true;
        t->add_space_prefix = true;
    } else if (str_is(model, "gpt2")) {
        t->type = FITM_TOK_BPE;
        if ((st = pick_pre(g, t, err)) != FITM_OK)
            goto fail;
    } else {
        st = fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                          "tokenizer.ggml.model '%.*s' is not supported (supported: llama, gpt2)",
                          model.len > 64 ? 64 : (int)model.len, model.ptr);
        goto fail;
    }

    uint64_t n_tok = 0, n_merges = 0;
    st = fitm_gguf_get_arr(g, "tokenizer.ggml.tokens", FITM_GGUF_STRING, NULL, &n_tok, err);
    if (st == FITM_ERR_NOT_FOUND)
        st = fitm_err_set(err, st, "key 'tokenizer.ggml.tokens' is absent");
    if (st != FITM_OK)
        goto fail;
    if (n_tok == 0 || n_tok > MAX_TOKENS) {
        st = fitm_err_set(err, n_tok ? FITM_ERR_LIMIT : FITM_ERR_FORMAT,
                          "tokenizer.ggml.tokens has %llu entries (1 to 2^30 supported)",
                          (unsigned long long)n_tok);
        goto fail;
    }
    t->n_vocab = (int32_t)n_tok;

    uint64_t merge_bytes = 0;
    if (t->type == FITM_TOK_BPE) {
        st = fitm_gguf_get_arr(g, "tokenizer.ggml.merges", FITM_GGUF_STRING, NULL, &n_merges, err);
        if (st == FITM_ERR_NOT_FOUND)
            st = fitm_err_set(err, st, "byte-level BPE tokenizer without 'tokenizer.ggml.merges'");
        if (st != FITM_OK)
            goto fail;
        if (n_merges > MAX_TOKENS) {
            st = fitm_err_set(err, FITM_ERR_LIMIT,
                              "tokenizer.ggml.merges has %llu entries (limit 2^30)",
                              (unsigned long long)n_merges);
            goto fail;
        }
        t->n_merges = (int32_t)n_merges;
        const fitm_gguf_kv *mkv = fitm_gguf_find_kv(g, "tokenizer.ggml.merges");
        for (uint64_t r = 0; r < n_merges; r++)
            merge_bytes += fitm_gguf_arr_str(g, mkv, r).len;
    }

    uint64_t blob_used = 0;
    if ((st = load_tokens(g, t, &blob_used, merge_bytes, err)) != FITM_OK)
        goto fail;
    if (t->type == FITM_TOK_BPE && (st = load_merges(g, t, blob_used, err)) != FITM_OK)
        goto fail;

    if (def_bos < t->n_vocab)
        t->bos = def_bos;
    if (def_eos < t->n_vocab)
        t->eos = def_eos;
    if (def_unk < t->n_vocab)
        t->unk = def_unk;
    bool have_eot = fitm_gguf_find_kv(g, "tokenizer.ggml.eot_token_id") != NULL;
    bool have_eom = fitm_gguf_find_kv(g, "tokenizer.ggml.eom_token_id") != NULL;
    if ((st = read_special_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err)) ||
        (st = read_special_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err)) ||
        (st = read_special_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot, err)) ||
        (st = read_special_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &t->eom, err)) ||
        (st = read_special_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk, err)) ||
        (st = read_special_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab, &t->pad, err)) ||
        (st = read_flag(g, "tokenizer.ggml.add_bos_token", &t->add_bos, err)) ||
        (st = read_flag(g, "tokenizer.ggml.add_eos_token", &t->add_eos, err)) ||
        (st = read_flag(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix, err)))
        goto fail;
    if (t->type == FITM_TOK_BPE)
        t->add_space_prefix = false; /* byte-level BPE writes spaces as they are */
    if (t->bos < 0)
        t->add_bos = false;
    if (t->eos < 0)
        t->add_eos = false;

    find_eog(t, have_eot, have_eom);
    tok_bpe_init_bytes(t);
    if (t->type == FITM_TOK_SPM)
        find_spm_glue(t);
    find_byte_tokens(t);
    if ((st = build_special_trie(t, err)) != FITM_OK)
        goto fail;
    *out = t;
    return FITM_OK;
fail:
    fitm_err_prefix(err, "tokenizer");
    tok_free(t);
    return st;
}
