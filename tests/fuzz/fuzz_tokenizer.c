/* fuzz_tokenizer: libFuzzer target for the tokenizers. Two kinds of input:
 *
 *  - a GGUF file (starts with "GGUF"): the tokenizer is built from its metadata, which must
 *    either fail with a status or give a tokenizer that encodes and decodes a few fixed texts
 *    with every id in range;
 *  - anything else is text: byte 0 picks the vocabulary (a small SentencePiece one with byte
 *    fallback, or a small byte-level BPE one with each pre-tokenizer, both built here once with
 *    gguf_writer) and the encode flags; the rest is tokenized. Every id must be in range, the
 *    decode must succeed, and without special-token parsing the decode must give the text back
 *    (byte fallback and byte-level BPE lose nothing), except where SentencePiece's space
 *    handling changes it (see below). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_IDS (1 << 16)
static int32_t ids[MAX_IDS];
static char text_back[1 << 18];

static void check(bool ok)
{
    if (!ok)
        __builtin_trap();
}

/* Encodes and decodes text with tok; returns the decoded length, or SIZE_MAX on limits. */
static size_t round_trip(const fitm_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                         uint32_t dflags)
{
    fitm_err err;
    int64_t n = 0;
    fitm_status st = fitm_tok_encode(tok, text, len, flags, ids, MAX_IDS, &n, &err);
    if (st == FITM_ERR_LIMIT)
        return SIZE_MAX;
    check(st == FITM_OK && n >= 0 && n <= MAX_IDS);
    for (int64_t i = 0; i < n; i++)
        check(ids[i] >= 0 && ids[i] < fitm_tok_n_vocab(tok));
    size_t n_text = 0;
    st = fitm_tok_decode(tok, ids, n, dflags, text_back, sizeof text_back, &n_text, &err);
    if (st == FITM_ERR_LIMIT)
        return SIZE_MAX;
    check(st == FITM_OK && n_text <= sizeof text_back);
    size_t c = fitm_tok_utf8_complete(text_back, n_text);
    check(c <= n_text && n_text - c <= 3);
    for (int64_t i = 0; i < n && i < 64; i++) {
        char piece[FITM_TOK_MAX_PIECE_BYTES];
        size_t np = 0;
        check(fitm_tok_piece(tok, ids[i], FITM_TOK_DECODE_SPECIAL, piece, sizeof piece, &np,
                             &err) == FITM_OK);
    }
    return n_text;
}

static void from_gguf(const uint8_t *data, size_t size)
{
    fitm_err err;
    fitm_gguf *g = NULL;
    if (fitm_gguf_open_memory(&g, data, size, &err) != FITM_OK)
        return;
    fitm_tokenizer *tok = NULL;
    if (fitm_tok_create(&tok, g, &err) == FITM_OK) {
        static const char *const texts[] = {"", "Hello world", " <s>x</s>\n\n  \t",
                                            "\xF0\x9F\xA6\x99 \xE6\x9D\xB1 \xFF\xC3", "'s 123456"};
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
            for (uint32_t flags = 0; flags < 16; flags += 5)
                round_trip(tok, texts[i], strlen(texts[i]), flags, FITM_TOK_DECODE_SPECIAL);
        check(fitm_tok_n_vocab(tok) > 0);
        (void)fitm_tok_find(tok, "<s>");
        (void)fitm_tok_is_eog(tok, fitm_tok_eos(tok));
    } else {
        check(tok == NULL);
    }
    fitm_tok_destroy(tok);
    fitm_gguf_close(g);
}

/* ---------------------------------------------------------------------------------------- */
/* Built-in vocabularies for text inputs. */

static fitm_tokenizer *vocab[4]; /* SPM, BPE gpt-2, BPE llama-bpe, BPE qwen2 */
static void *vocab_buf[4];
static fitm_gguf *vocab_gguf[4];

static fitm_tokenizer *build(fitm_gguf_writer *w, int slot)
{
    fitm_err err;
    size_t n = 0;
    if (fitm_gguf_writer_write_memory(w, &vocab_buf[slot], &n, &err) != FITM_OK ||
        fitm_gguf_open_memory(&vocab_gguf[slot], vocab_buf[slot], n, &err) != FITM_OK ||
        fitm_tok_create(&vocab[slot], vocab_gguf[slot], &err) != FITM_OK)
        __builtin_trap();
    return vocab[slot];
}

static void build_vocabs(void)
{
    static const char *const words[] = {"\xE2\x96\x81",
                                        "e",
                                        "t",
                                        "a",
                                        "o",
                                        "\xE2\x96\x81t",
                                        "he",
                                        "\xE2\x96\x81the",
                                        "in",
                                        "\xE2\x96\201a",
                                        "er",
                                        "on",
                                        "\xE2\x96\x81\xE2\x96\x81",
                                        "\xE6\x9D\xB1",
                                        "<b>",
                                        "\n"};
    static const char *const merges[] = {"\xC4\xA0 t", "h e",        "i n", "\xC4\xA0t he", "e r",
                                         "o n",        "\xC4\xA0 a", "1 2", "12 3",         "' s"};
    enum { N_WORDS = sizeof words / sizeof words[0] };
    static char names[512][8];
    const char *tokens[3 + 256 + N_WORDS + 2];
    float scores[3 + 256 + N_WORDS + 2];
    int32_t types[3 + 256 + N_WORDS + 2];
    fitm_err err;

    /* SPM: <unk> <s> </s>, 256 byte tokens, words (user-defined <b> and \n), one control. */
    int n = 0;
    tokens[n] = "<unk>", types[n] = 2, scores[n++] = 0;
    tokens[n] = "<s>", types[n] = 3, scores[n++] = 0;
    tokens[n] = "</s>", types[n] = 3, scores[n++] = 0;
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        names[b][0] = '<', names[b][1] = '0', names[b][2] = 'x', names[b][3] = hex[b >> 4];
        names[b][4] = hex[b & 15], names[b][5] = '>', names[b][6] = 0;
        tokens[n] = names[b], types[n] = 6, scores[n++] = 0;
    }
    for (int i = 0; i < N_WORDS; i++) {
        bool user = !strcmp(words[i], "<b>") || !strcmp(words[i], "\n");
        tokens[n] = words[i], types[n] = user ? 4 : 1, scores[n++] = -(float)i;
    }
    tokens[n] = "<start_of_turn>", types[n] = 3, scores[n++] = 0;
    fitm_gguf_writer *w = NULL;
    if (fitm_gguf_writer_create(&w, &err) != FITM_OK)
        __builtin_trap();
    fitm_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama", &err);
    fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", tokens, (uint64_t)n, &err);
    fitm_gguf_writer_set_arr(w, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32, scores, (uint64_t)n,
                             &err);
    fitm_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", FITM_GGUF_INT32, types, (uint64_t)n,
                             &err);
    build(w, 0);
    fitm_gguf_writer_destroy(w);

    /* Byte-level BPE: the 256 stand-ins, some merged words, <|endoftext|>. */
    static char standin[256][4];
    static const char *const bpe_words[] = {"\xC4\xA0t", "he", "in",           "\xC4\xA0the",
                                            "er",        "on", "\xC4\240a",    "12",
                                            "123",       "'s", "<|endoftext|>"};
    const char *btok[256 + 16];
    n = 0;
    for (unsigned b = 0, next = 256; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        unsigned cp = printable ? b : next++;
        char *s = standin[b];
        if (cp < 0x80) {
            s[0] = (char)cp, s[1] = 0;
        } else {
            s[0] = (char)(0xC0 | (cp >> 6)), s[1] = (char)(0x80 | (cp & 0x3F)), s[2] = 0;
        }
        btok[n++] = s;
    }
    for (size_t i = 0; i < sizeof bpe_words / sizeof bpe_words[0]; i++)
        btok[n++] = bpe_words[i];
    static const char *const pres[] = {"gpt-2", "llama-bpe", "qwen2"};
    for (int p = 0; p < 3; p++) {
        if (fitm_gguf_writer_create(&w, &err) != FITM_OK)
            __builtin_trap();
        fitm_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2", &err);
        fitm_gguf_writer_set_str(w, "tokenizer.ggml.pre", pres[p], &err);
        fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", btok, (uint64_t)n, &err);
        fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges,
                                     sizeof merges / sizeof merges[0], &err);
        fitm_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)(n - 1), &err);
        build(w, 1 + p);
        fitm_gguf_writer_destroy(w);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 4 && !memcmp(data, "GGUF", 4)) {
        from_gguf(data, size);
        return 0;
    }
    if (!vocab[0])
        build_vocabs();
    if (size == 0)
        return 0;
    const fitm_tokenizer *tok = vocab[data[0] & 3];
    uint32_t flags = (data[0] >> 2) & 15; /* ADD_BOS, ADD_EOS, PARSE_SPECIAL, CONTINUATION */
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    uint32_t dflags = FITM_TOK_DECODE_STRIP_PREFIX |
                      ((flags & FITM_TOK_PARSE_SPECIAL) ? FITM_TOK_DECODE_SPECIAL : 0);
    size_t n = round_trip(tok, text, len, flags, dflags);
    /* SentencePiece gives back neither a literal "▁" (it reads as a space) nor the text after
     * a user-defined token exactly (that text gets a space prefix, as in llama.cpp). */
    bool spm = fitm_tok_get_type(tok) == FITM_TOK_SPM;
    bool lossless = !(flags & (FITM_TOK_PARSE_SPECIAL | FITM_TOK_CONTINUATION)) &&
                    !(spm && (memmem(text, len, "\xE2\x96\x81", 3) || memchr(text, '\n', len) ||
                              memmem(text, len, "<b>", 3)));
    if (n != SIZE_MAX && lossless)
        check(n == len && !memcmp(text_back, text, len));
    return 0;
}
