/* tok_internal: what tokenizer.c (encoding, SPM, decoding), tok_load.c (building the tables)
 * and tok_bpe.c (byte-level BPE) share. Not part of the tokenizer's API. */
#ifndef FITM_TOK_INTERNAL_H
#define FITM_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"
#include "tokenizer/tokenizer.h"

#define TOK_MAX_EOG 16
#define TOK_MAX_GLUE 32

struct fitm_tokenizer {
    fitm_tok_type type;
    fitm_tok_pre pre;
    int32_t n_vocab;

    /* Token i's text is blob[tok_off[i] .. + tok_len[i]); merges' texts follow the tokens'. */
    char *blob;
    uint32_t *tok_off;
    uint16_t *tok_len;
    uint32_t *score_key; /* SPM merge priority: the score, mapped so that integer order is float
                            order (NaN in the file counts as -inf, -0 as +0) */
    uint8_t *kind;       /* fitm_tok_kind */

    /* text -> id, open addressing; id -1 = empty slot; tag = the hash's high 32 bits, so that
     * a probe rarely touches a token that does not match */
    struct {
        int32_t id;
        uint32_t tag;
    } * tok_tab;
    uint32_t tok_mask;

    /* BPE merges: merge r joins blob[mrg_off[r] .. + mrg_nl[r]) and the mrg_nr[r] bytes after
     * the separating space. Table keyed on (concatenation, left length) -> r. */
    int32_t n_merges;
    uint32_t *mrg_off;
    uint16_t *mrg_nl, *mrg_nr;
    struct {
        int32_t id; /* rank, -1 = empty slot */
        uint32_t tag;
    } * mrg_tab;
    uint32_t mrg_mask;

    /* SPM: id of "<0xNN>" (or of the one-byte text) for byte fallback; BPE: id of the byte's
     * byte-level character. -1 when missing. */
    int32_t byte_tok[256];

    /* Byte-level BPE stand-ins: byte -> code point, and code point (< 324) -> byte or -1. */
    uint16_t bpe_cp[256];
    int16_t bpe_byte[324];

    /* Special-token trie over CONTROL, USER_DEFINED and UNKNOWN tokens. Node 0 is the root;
     * edges (node << 8 | byte) -> child in an open-addressing table. */
    int32_t n_nodes;
    int32_t *node_tok;  /* token ending at this node, -1 none */
    uint64_t *edge_key; /* (node << 8 | byte) + 1; 0 = empty slot */
    int32_t *edge_child;
    uint32_t edge_mask;
    uint8_t special_first[32]; /* bitmap: bytes that start some special token */

    /* SPM: characters that some token joins to a following "▁" (see tokenizer.c). */
    bool spm_segments;
    int n_spm_glue;
    uint32_t spm_glue[TOK_MAX_GLUE];

    int32_t bos, eos, eot, eom, unk, pad;
    int32_t eog[TOK_MAX_EOG];
    int n_eog;
    bool add_bos, add_eos, add_space_prefix, ignore_merges;
};

/* Output sink of an encode call: ids land in ids[0..n_max), *n counts them all. */
typedef struct {
    int32_t *ids;
    int64_t n_max;
    int64_t n;
} tok_out;

static inline void tok_emit(tok_out *o, int32_t id)
{
    if (o->n < o->n_max)
        o->ids[o->n] = id;
    o->n++;
}

/* A symbol during merging: bytes [off, off + n) of the text being merged; n == 0 once merged
 * into its left neighbour. prev/next link the live symbols (-1 at the ends). */
typedef struct {
    int32_t prev, next;
    uint32_t off, n;
} tok_sym;

/* A candidate merge of symbol `left` with the symbol `right` after it, valid while both are
 * live and their lengths still add up to size. key = priority << 32 | ~left: the heap pops
 * the largest key, i.e. the highest priority, then the lowest left (llama.cpp's order), with
 * one integer comparison. */
typedef struct {
    uint64_t key;
    int32_t right;
    uint32_t size;
} tok_bigram;

static inline tok_bigram tok_bigram_make(uint32_t priority, int32_t left, int32_t right,
                                         uint32_t size)
{
    tok_bigram b = {((uint64_t)priority << 32) | (UINT32_MAX - (uint32_t)left), right, size};
    return b;
}

static inline int32_t tok_bigram_left(tok_bigram b)
{
    return (int32_t)(UINT32_MAX - (uint32_t)b.key);
}

void tok_heap_push(tok_bigram *h, size_t *n, tok_bigram b);
tok_bigram tok_heap_pop(tok_bigram *h, size_t *n);

/* Pushes the candidate merge of symbols l and r (either may be -1: nothing) onto the heap if
 * the model has one; the priority is the model's (SPM score, BPE rank). */
typedef void (*tok_add_bigram_fn)(const fitm_tokenizer *tok, const char *s, const tok_sym *sym,
                                  int32_t l, int32_t r, tok_bigram *heap, size_t *n_heap);

/* Merges the linked symbols [a, b) of s in priority order (leftmost on ties) until no
 * candidate is left; merged-away symbols keep n == 0 and drop out of the next/prev links.
 * heap has room for 3 * (b - a) bigrams: b - a - 1 to start, at most two more per merge. */
void tok_merge(const fitm_tokenizer *tok, const char *s, tok_sym *sym, int32_t a, int32_t b,
               tok_bigram *heap, tok_add_bigram_fn add);

/* 64-bit FNV-1a, continued from h (start with TOK_HASH_SEED). */
#define TOK_HASH_SEED 0xcbf29ce484222325ull
static inline uint64_t tok_hash_bytes(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* tok_load.c (tables built there, read everywhere) */

/* Child of a special-token trie node along byte b, or -1 (node 0 is the root). */
int32_t tok_trie_child(const fitm_tokenizer *tok, int32_t node, unsigned char b);

/* Id of the token whose text is exactly s[0..n), or -1. */
int32_t tok_lookup(const fitm_tokenizer *tok, const char *s, size_t n);

/* Rank of merging the symbol s[0..nl) with the symbol s[nl..nl+nr), or -1. */
int32_t tok_bpe_rank(const fitm_tokenizer *tok, const char *s, uint32_t nl, uint32_t nr);

/* Same as tok_lookup, but only tokens that ordinary text may produce (not CONTROL, UNKNOWN or
 * BYTE). */
static inline int32_t tok_lookup_plain(const fitm_tokenizer *tok, const char *s, size_t n)
{
    int32_t id = tok_lookup(tok, s, n);
    if (id >= 0) {
        uint8_t k = tok->kind[id];
        if (k == FITM_TOK_KIND_CONTROL || k == FITM_TOK_KIND_UNKNOWN || k == FITM_TOK_KIND_BYTE)
            return -1;
    }
    return id;
}

/* tok_bpe.c */

/* Fills tok->bpe_cp and tok->bpe_byte: GPT-2's bytes_to_unicode and its inverse. */
void tok_bpe_init_bytes(fitm_tokenizer *tok);

/* Tokenizes one fragment of plain text (no special tokens in it) with byte-level BPE. */
fitm_status tok_bpe_encode(const fitm_tokenizer *tok, const char *text, size_t len, tok_out *out,
                           fitm_buf scratch[4], fitm_err *err);

#endif
