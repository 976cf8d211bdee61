/* tokenizer: text <-> token ids for the vocabularies GGUF files carry in `tokenizer.ggml.*`.
 *
 * Two families:
 *  - SentencePiece-style (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, TinyLlama, Gemma 3):
 *    tokens with scores, spaces written as U+2581 "▁", pairs of adjacent pieces merged highest
 *    score first, characters outside the vocabulary written as byte tokens `<0xNN>` (or the
 *    unknown token when the vocabulary has none). A "▁" is put in front of the text when the
 *    model says so (`tokenizer.ggml.add_space_prefix`, default true).
 *  - Byte-level BPE (`tokenizer.ggml.model = "gpt2"`: GPT-2, Llama 3, Qwen2): text split by the
 *    model's pre-tokenizer (`tokenizer.ggml.pre`: "gpt-2" — also the default when the key is
 *    absent —, "llama-bpe"/"llama3", "qwen2", and the aliases llama.cpp gives these), each byte
 *    mapped to a printable character, then merged in the order of `tokenizer.ggml.merges`.
 *
 * The results match llama.cpp's `llama_tokenize` (and so the Hugging Face tokenizers the test
 * vectors in shared/data come from), with these deliberate differences, all on input llama.cpp
 * mishandles: invalid UTF-8 is tokenized byte by byte instead of failing; control and unknown
 * tokens are never produced from plain text (only from their exact text with
 * FITM_TOK_PARSE_SPECIAL), so document text cannot smuggle in `<start_of_turn>` or `<s>`;
 * special-token text is matched leftmost-longest (the Hugging Face rule) where llama.cpp tries
 * longer special tokens first everywhere; a byte-level BPE character missing from the
 * vocabulary becomes the unknown token (llama.cpp drops it); decoding never applies GPT-2's
 * "clean up spaces", so decoded text is exactly the bytes the tokens stand for.
 *
 * Ownership and threads: fitm_tok_create copies what it needs, so the fitm_gguf may be closed
 * afterwards. A tokenizer is immutable after creation: every function below may be called
 * from many threads at once. Encoding allocates its scratch per call (nothing is cached).
 *
 * Token ids are int32_t in [0, n_vocab); -1 means "no such token". */
#ifndef FITM_TOKENIZER_H
#define FITM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "gguf/gguf.h"

typedef struct fitm_tokenizer fitm_tokenizer;

typedef enum {
    FITM_TOK_SPM = 1, /* SentencePiece-style, tokenizer.ggml.model = "llama" */
    FITM_TOK_BPE = 2, /* byte-level BPE, tokenizer.ggml.model = "gpt2" */
} fitm_tok_type;

/* Byte-level BPE pre-tokenizers: how text is cut into words before merging. The regexes:
 *   GPT2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   LLAMA3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   QWEN2:  as LLAMA3 with \p{N} (one digit per word) for \p{N}{1,3}. */
typedef enum {
    FITM_TOK_PRE_NONE = 0, /* SPM vocabularies have none */
    FITM_TOK_PRE_GPT2,
    FITM_TOK_PRE_LLAMA3,
    FITM_TOK_PRE_QWEN2,
} fitm_tok_pre;

/* Token kinds, the values of `tokenizer.ggml.token_type` (absent array: all NORMAL). */
typedef enum {
    FITM_TOK_KIND_UNDEFINED = 0,
    FITM_TOK_KIND_NORMAL = 1,
    FITM_TOK_KIND_UNKNOWN = 2,
    FITM_TOK_KIND_CONTROL = 3,      /* <s>, <start_of_turn>, <|im_end|>, ... */
    FITM_TOK_KIND_USER_DEFINED = 4, /* matched in any text, e.g. Gemma's "\n", "<b>" */
    FITM_TOK_KIND_UNUSED = 5,
    FITM_TOK_KIND_BYTE = 6, /* <0x00> .. <0xFF> */
} fitm_tok_kind;

/* Encoding flags (combine with |). */
enum {
    /* Prepend BOS if the model asks for one (`tokenizer.ggml.add_bos_token`; default true for
     * SPM and for the llama3 pre-tokenizer, false otherwise). */
    FITM_TOK_ADD_BOS = 1u << 0,
    /* Append EOS if the model asks for one (`tokenizer.ggml.add_eos_token`, default false). */
    FITM_TOK_ADD_EOS = 1u << 1,
    /* Both: what llama.cpp calls add_special. */
    FITM_TOK_ADD_SPECIAL = FITM_TOK_ADD_BOS | FITM_TOK_ADD_EOS,
    /* The exact text of a control token (`<start_of_turn>`, `<|im_end|>`, `<s>`) becomes that
     * token. Without it control text is tokenized as ordinary text. User-defined tokens (kind
     * USER_DEFINED) are matched either way, as in the reference tokenizers. */
    FITM_TOK_PARSE_SPECIAL = 1u << 2,
    /* Piecewise tokenization: this text continues text that was tokenized before it (the
     * prompt is tokenized as prefix, each document, suffix, and the ids are concatenated).
     * For an SPM vocabulary that adds a space prefix, the leading "▁" that marks the start of
     * a text is then NOT put in front of this text's first fragment. It has no effect on
     * vocabularies without a space prefix (Gemma 3, all byte-level BPE). Text after a special
     * token (control or user-defined) inside this text still gets the prefix, as llama.cpp
     * does. Write the separating
     * space yourself where one belongs: with this flag "Document" and " Document" tokenize
     * differently, exactly as they would in the middle of a longer text. Pieces are tokenized
     * independently, so merges never cross a piece boundary: the concatenated ids can differ
     * from tokenizing the concatenated text at the boundaries, never elsewhere. */
    FITM_TOK_CONTINUATION = 1u << 3,
};

/* Decoding flags. */
enum {
    /* Render control and unknown tokens as their text (`<start_of_turn>`); without it they
     * produce no bytes. */
    FITM_TOK_DECODE_SPECIAL = 1u << 0,
    /* Undo the SentencePiece space prefix: drop one leading space from the first token's
     * piece, skipping a leading BOS (SentencePiece's own decode does this). No effect on
     * vocabularies without a space prefix. With it, decoding what encode produced (with or
     * without BOS, without CONTINUATION) gives the input text back. */
    FITM_TOK_DECODE_STRIP_PREFIX = 1u << 1,
};

/* Builds a tokenizer from g's tokenizer.ggml.* metadata. On failure *out is NULL and err says
 * which key is missing or malformed (FITM_ERR_NOT_FOUND: no tokenizer.ggml.model or tokens;
 * FITM_ERR_UNSUPPORTED: a model or pre-tokenizer we do not implement; FITM_ERR_FORMAT: counts
 * that disagree, special ids out of range; FITM_ERR_LIMIT: more than 2^30 tokens or merges;
 * FITM_ERR_NOMEM). g is only read during the call. Cost: hashing every token and merge once
 * (about 30 ms for Gemma 3's 262,144 tokens). */
fitm_status fitm_tok_create(fitm_tokenizer **out, const fitm_gguf *g, fitm_err *err);

/* Releases everything. NULL is a no-op. */
void fitm_tok_destroy(fitm_tokenizer *tok);

/* Tokenizes text[0..len) (any bytes; NUL is an ordinary byte). flags: FITM_TOK_* above.
 * Writes up to n_max ids to ids (ids may be NULL when n_max is 0) and the full count to
 * *n_out. Returns FITM_ERR_LIMIT when n_max is too small — *n_out is then the count needed and
 * the first n_max ids are written — and when len exceeds FITM_TOK_MAX_TEXT_BYTES. Empty text
 * gives no ids, except the BOS/EOS the flags ask for. */
#define FITM_TOK_MAX_TEXT_BYTES ((size_t)1 << 28)
fitm_status fitm_tok_encode(const fitm_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                            int32_t *ids, int64_t n_max, int64_t *n_out, fitm_err *err);

/* The bytes token id stands for: "▁" turned into spaces, byte tokens into their byte,
 * byte-level BPE characters into their bytes, control tokens into nothing (or their text with
 * FITM_TOK_DECODE_SPECIAL; FITM_TOK_DECODE_STRIP_PREFIX is ignored here). A piece may be part
 * of a UTF-8 character. Writes up to cap bytes (no NUL) and the piece's length to *n_out.
 * FITM_ERR_INVALID for an id out of range; FITM_ERR_LIMIT when cap is too small (*n_out then
 * holds the length needed; pieces are at most FITM_TOK_MAX_PIECE_BYTES long). */
#define FITM_TOK_MAX_PIECE_BYTES 4096
fitm_status fitm_tok_piece(const fitm_tokenizer *tok, int32_t id, uint32_t flags, char *out,
                           size_t cap, size_t *n_out, fitm_err *err);

/* Concatenated pieces of ids[0..n) (see fitm_tok_piece; flags FITM_TOK_DECODE_*). Writes
 * *n_out bytes to out and a NUL after them when cap > *n_out. The bytes are not necessarily
 * valid UTF-8 (a sequence can end inside a character, the model can emit any byte token): see
 * fitm_tok_utf8_complete. FITM_ERR_LIMIT when cap < *n_out (*n_out = bytes needed, out holds a
 * prefix); FITM_ERR_INVALID for an id out of range (err names its index). */
fitm_status fitm_tok_decode(const fitm_tokenizer *tok, const int32_t *ids, int64_t n,
                            uint32_t flags, char *out, size_t cap, size_t *n_out, fitm_err *err);

/* For streaming decoded text (SSE): of the n bytes decoded so far, how many can be sent now
 * without cutting a UTF-8 character in half. Keep the rest until more bytes arrive. Bytes that
 * can never become valid UTF-8 count as sendable (the caller decides how to escape them). */
size_t fitm_tok_utf8_complete(const char *buf, size_t n);

/* Facts about the vocabulary. All take a non-NULL tokenizer. */
fitm_tok_type fitm_tok_get_type(const fitm_tokenizer *tok);
fitm_tok_pre fitm_tok_get_pre(const fitm_tokenizer *tok);
int32_t fitm_tok_n_vocab(const fitm_tokenizer *tok);
int32_t fitm_tok_bos(const fitm_tokenizer *tok); /* -1 when the model has none */
int32_t fitm_tok_eos(const fitm_tokenizer *tok);
/* End of turn: <end_of_turn>, <|eot_id|>, <|im_end|>, ... (tokenizer.ggml.eot_token_id, or
 * found by its text). */
int32_t fitm_tok_eot(const fitm_tokenizer *tok);
int32_t fitm_tok_unk(const fitm_tokenizer *tok);
int32_t fitm_tok_pad(const fitm_tokenizer *tok);
/* What FITM_TOK_ADD_BOS / FITM_TOK_ADD_EOS will do, and whether SPM puts "▁" in front. */
bool fitm_tok_adds_bos(const fitm_tokenizer *tok);
bool fitm_tok_adds_eos(const fitm_tokenizer *tok);
bool fitm_tok_adds_space_prefix(const fitm_tokenizer *tok);

/* True when generating id should stop generation: EOS, EOT, and the end-of-generation tokens
 * llama.cpp recognises by their text (<|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>,
 * <|endoftext|>, <|eom_id|>, <EOT>). False for ids out of range. */
bool fitm_tok_is_eog(const fitm_tokenizer *tok, int32_t id);

/* Kind of a token; FITM_TOK_KIND_UNDEFINED for ids out of range. */
fitm_tok_kind fitm_tok_get_kind(const fitm_tokenizer *tok, int32_t id);

/* The vocabulary's own text of a token (with "▁" / byte-level characters, as stored), not
 * NUL-terminated: *len bytes. NULL (and *len = 0) for ids out of range. Lives as long as tok. */
const char *fitm_tok_text(const fitm_tokenizer *tok, int32_t id, size_t *len);

/* The id whose vocabulary text is exactly text (NUL-terminated), of any kind — e.g.
 * fitm_tok_find(tok, "<start_of_turn>") for a chat template. -1 when there is none. */
int32_t fitm_tok_find(const fitm_tokenizer *tok, const char *text);

/* The byte-level BPE pre-tokenizer alone (for tests and debugging; encode runs it itself):
 * cuts text[0..len) into words by pre's rules and writes the byte offset just past each word
 * to ends[0..n_max), the number of words to *n_out. Invalid UTF-8 bytes are single characters
 * of no category (like unassigned code points). FITM_ERR_INVALID for FITM_TOK_PRE_NONE or an
 * unknown pre; FITM_ERR_LIMIT when n_max is too small (*n_out = count needed) or len exceeds
 * FITM_TOK_MAX_TEXT_BYTES. */
fitm_status fitm_tok_pretokenize(fitm_tok_pre pre, const char *text, size_t len, int64_t *ends,
                                 int64_t n_max, int64_t *n_out, fitm_err *err);

#endif
