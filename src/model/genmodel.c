/* genmodel: tiny random GGUF models. See genmodel.h for the contract.
 *
 * Three parts: a seeded random source (base/rng.h seeds xoshiro256**, Box-Muller for normals),
 * the built-in tokenizer (a BPE trained at run time on a fixed English word list, rendered as a
 * SentencePiece-style or a byte-level BPE vocabulary), and the model layout per architecture. */
#include "model/genmodel.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "compute/quant.h"

/* ------------------------------------------------------------------------------------------
 * Random numbers: one independent stream per tensor, keyed by (seed, tensor name). */

typedef struct {
    uint64_t s[4];
    bool has_spare;
    double spare;
} gen_rng;

static uint64_t fnv1a64(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

static void rng_seed(gen_rng *r, uint64_t seed, const char *name)
{
    uint64_t x = seed ^ fnv1a64(name);
    for (int i = 0; i < 4; i++)
        r->s[i] = fitm_rng_next(&x);
    r->has_spare = false;
}

static uint64_t rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(gen_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return out;
}

/* Uniform in (0, 1]: never 0, so log() below is finite. */
static double rng_uniform(gen_rng *r)
{
    return ((double)(rng_next(r) >> 11) + 1.0) * 0x1p-53;
}

/* Standard normal by Box-Muller; the second value of each pair is kept for the next call. */
static double rng_gauss(gen_rng *r)
{
    if (r->has_spare) {
        r->has_spare = false;
        return r->spare;
    }
    double rad = sqrt(-2.0 * log(rng_uniform(r)));
    double ang = 6.283185307179586 * rng_uniform(r);
    r->spare = rad * sin(ang);
    r->has_spare = true;
    return rad * cos(ang);
}

/* ------------------------------------------------------------------------------------------
 * Architectures and their defaults. */

typedef struct {
    const char *name;
    fitm_gen_tok tok;
    int32_t L, C, H, Hkv, D, F, ctx, swa;
    float rope_base, eps;
    bool tied;
} arch_info;

/* C, H*D and F are multiples of 256 so every weight type (K-quants included) works with the
 * defaults, and one seed gives the same F32 weights in every type. gemma3 mirrors Gemma 3
 * 270M scaled down: MQA (Hkv 1), D != C/H, 8 layers so layer 5 is global and the layers on
 * both sides of it are local, and a 16-token window that 64-token prompts overrun. */
static const arch_info arch_infos[FITM_GEN_ARCH_COUNT] = {
    [FITM_GEN_ARCH_LLAMA] = {"llama", FITM_GEN_TOK_LLAMA, 2, 256, 4, 2, 64, 512, 1024, 0, 10000.0f,
                             1e-5f, false},
    [FITM_GEN_ARCH_QWEN2] = {"qwen2", FITM_GEN_TOK_QWEN2, 2, 256, 4, 2, 64, 512, 1024, 0,
                             1000000.0f, 1e-6f, false},
    [FITM_GEN_ARCH_GEMMA3] = {"gemma3", FITM_GEN_TOK_GEMMA, 8, 256, 4, 1, 128, 512, 1024, 16,
                              1000000.0f, 1e-6f, true},
};

static const char *const tok_names[FITM_GEN_TOK_COUNT] = {
    [FITM_GEN_TOK_DEFAULT] = "default", [FITM_GEN_TOK_LLAMA] = "llama",
    [FITM_GEN_TOK_GEMMA] = "gemma",     [FITM_GEN_TOK_QWEN2] = "qwen2",
    [FITM_GEN_TOK_LLAMA3] = "llama3",
};

void fitm_gen_defaults(fitm_gen_config *cfg, fitm_gen_arch arch)
{
    const arch_info *a = &arch_infos[(unsigned)arch < FITM_GEN_ARCH_COUNT ? arch : 0];
    *cfg = (fitm_gen_config){
        .arch = (unsigned)arch < FITM_GEN_ARCH_COUNT ? arch : FITM_GEN_ARCH_LLAMA,
        .tok = FITM_GEN_TOK_DEFAULT,
        .type = FITM_DTYPE_F32,
        .seed = 1,
        .n_layer = a->L,
        .n_embd = a->C,
        .n_head = a->H,
        .n_head_kv = a->Hkv,
        .head_dim = a->D,
        .n_ff = a->F,
        .n_ctx = a->ctx,
        .n_vocab_extra = 0,
        .n_swa = a->swa,
        .tied = a->tied,
        .rope_base = a->rope_base,
        .norm_eps = a->eps,
    };
}

const char *fitm_gen_arch_name(fitm_gen_arch arch)
{
    return (unsigned)arch < FITM_GEN_ARCH_COUNT ? arch_infos[arch].name : "?";
}

const char *fitm_gen_tok_name(fitm_gen_tok tok)
{
    return (unsigned)tok < FITM_GEN_TOK_COUNT ? tok_names[tok] : "?";
}

fitm_status fitm_gen_parse_arch(const char *name, fitm_gen_arch *out, fitm_err *err)
{
    for (int i = 0; name && i < FITM_GEN_ARCH_COUNT; i++)
        if (!strcmp(name, arch_infos[i].name)) {
            *out = (fitm_gen_arch)i;
            return FITM_OK;
        }
    return fitm_err_set(err, FITM_ERR_INVALID, "unknown architecture '%s' (llama, qwen2, gemma3)",
                        name ? name : "(null)");
}

fitm_status fitm_gen_parse_tok(const char *name, fitm_gen_tok *out, fitm_err *err)
{
    for (int i = 0; name && i < FITM_GEN_TOK_COUNT; i++)
        if (!strcmp(name, tok_names[i])) {
            *out = (fitm_gen_tok)i;
            return FITM_OK;
        }
    return fitm_err_set(err, FITM_ERR_INVALID,
                        "unknown tokenizer '%s' (default, llama, gemma, qwen2, llama3)",
                        name ? name : "(null)");
}

static fitm_gen_tok effective_tok(const fitm_gen_config *cfg)
{
    return cfg->tok == FITM_GEN_TOK_DEFAULT ? arch_infos[cfg->arch].tok : cfg->tok;
}

/* ------------------------------------------------------------------------------------------
 * Built-in tokenizer.
 *
 * A byte-pair-encoding is trained here on WORDS, each as " word" (the space marks a word
 * start and becomes "▁" or "Ġ"), weighted by a Zipf law over the list order, until every word
 * is one piece. The alphabet is the space plus printable ASCII, so any ASCII text tokenizes
 * without byte fallback and real merges happen on English text. Training is deterministic
 * (ties go to the pair of lowest piece ids), so the vocabulary is fixed per flavour. */

/* clang-format off */
static const char *const WORDS[] = {
    "the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "was", "on", "with", "as",
    "be", "by", "at", "this", "are", "from", "or", "an", "which", "not", "have", "has", "but",
    "one", "all", "were", "they", "their", "there", "been", "more", "can", "also", "its", "his",
    "her", "he", "she", "we", "you", "what", "who", "when", "where", "how", "why", "than",
    "first", "new", "other", "some", "only", "into", "time", "after", "most", "many", "two",
    "year", "years", "used", "use", "using", "about", "made", "such", "would", "could", "like",
    "these", "then", "world", "city", "state", "part", "known", "name", "people", "during",
    "between", "over", "under", "each", "while", "both", "three", "since", "before", "here",
    "water", "river", "country", "capital", "population", "history", "music", "science",
    "language", "model", "models", "document", "documents", "search", "results", "result",
    "question", "answer", "given", "provided", "write", "high", "quality", "might", "irrelevant",
    "relevant", "title", "text", "found", "middle", "attention", "position", "context",
    "long", "large", "small", "number", "called", "second", "following", "including", "until",
    "university", "school", "company", "government", "war", "game", "team", "season", "film",
    "book", "series", "family", "life", "work", "house", "church", "area", "south", "north",
    "east", "west", "day", "way", "end", "king", "law", "power", "system", "data", "computer",
    "information", "paper", "method", "study", "research", "english", "french", "france",
    "paris", "london", "germany", "europe", "america", "american", "national", "international",
    "century", "million", "percent", "mountain", "island", "sea", "ocean", "lake", "forest",
    "animal", "plant", "energy", "light", "sun", "moon", "earth", "space", "star", "planet",
    "born", "died", "became", "began", "still", "however", "because", "although", "several",
    "every", "another", "around", "against", "through", "within", "without", "again", "never",
    "always", "often", "well", "very", "much", "same", "different", "important", "best",
    "good", "great", "old", "young", "early", "later", "late", "last", "next", "left", "right",
    "home", "place", "town", "village", "road", "building", "president", "minister", "party",
    "member", "members", "group", "form", "open", "public", "general", "center", "true",
    "false", "yes", "no", "said", "says", "see", "make", "take", "get", "find", "give",
    "think", "know", "come", "go", "look", "want", "need", "help", "tell", "ask",
    "The", "In", "It", "This", "He", "She", "They", "A", "Question", "Document", "Title",
    "Answer", "Write", "Paris", "France", "London",
};
/* clang-format on */
#define N_WORDS ((int)(sizeof WORDS / sizeof WORDS[0]))

#define MAX_PIECES 4096
#define MAX_PIECE_BYTES 40
#define MAX_WORD_SYMS 40

typedef struct {
    int32_t n_pieces; /* alphabet first, then merge results            */
    int32_t n_alpha;
    char piece[MAX_PIECES][MAX_PIECE_BYTES];
    int32_t n_merges;
    int32_t merge_l[MAX_PIECES], merge_r[MAX_PIECES]; /* merge m joins these two pieces */
} bpe_table;

typedef struct {
    uint64_t key; /* left id << 32 | right id */
    uint64_t weight;
} pair_count;

static int cmp_pair_key(const void *a, const void *b)
{
    uint64_t x = ((const pair_count *)a)->key, y = ((const pair_count *)b)->key;
    return x < y ? -1 : x > y;
}

static int32_t find_piece(const bpe_table *t, const char *s)
{
    for (int32_t i = 0; i < t->n_pieces; i++)
        if (!strcmp(t->piece[i], s))
            return i;
    return -1;
}

/* Trains the table. Fails only when out of memory or on a programming error (a word list
 * that does not fit the fixed sizes). */
static fitm_status bpe_train(bpe_table *t, fitm_err *err)
{
    int32_t(*syms)[MAX_WORD_SYMS] = malloc((size_t)N_WORDS * sizeof *syms);
    int32_t n_syms[N_WORDS];
    uint64_t weight[N_WORDS];
    pair_count *pairs = NULL;
    fitm_status st = FITM_OK;

    memset(t, 0, sizeof *t);
    if (!syms)
        return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory training the vocab");

    t->piece[t->n_pieces++][0] = ' ';
    for (int c = 0x21; c <= 0x7e; c++)
        t->piece[t->n_pieces++][0] = (char)c;
    t->n_alpha = t->n_pieces;

    int64_t total_syms = 0;
    for (int w = 0; w < N_WORDS; w++) {
        size_t len = strlen(WORDS[w]);
        if (len + 1 > MAX_WORD_SYMS || len + 1 >= MAX_PIECE_BYTES) {
            free(syms);
            return fitm_err_set(err, FITM_ERR_INTERNAL, "genmodel: word '%s' too long", WORDS[w]);
        }
        syms[w][0] = 0; /* the space */
        for (size_t i = 0; i < len; i++)
            syms[w][i + 1] = (uint8_t)WORDS[w][i] - 0x21 + 1; /* printable ASCII only */
        n_syms[w] = (int32_t)len + 1;
        weight[w] = 1000000u / (uint64_t)(w + 1) + 1;
        total_syms += n_syms[w];
    }
    pairs = malloc((size_t)total_syms * sizeof *pairs);
    if (!pairs) {
        free(syms);
        return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory training the vocab");
    }

    for (;;) {
        int64_t n = 0;
        for (int w = 0; w < N_WORDS; w++)
            for (int i = 0; i + 1 < n_syms[w]; i++)
                pairs[n++] = (pair_count){((uint64_t)syms[w][i] << 32) | (uint32_t)syms[w][i + 1],
                                          weight[w]};
        if (n == 0)
            break; /* every word is one piece */
        qsort(pairs, (size_t)n, sizeof *pairs, cmp_pair_key);
        uint64_t best_key = 0, best_w = 0;
        for (int64_t i = 0; i < n;) {
            uint64_t key = pairs[i].key, sum = 0;
            for (; i < n && pairs[i].key == key; i++)
                sum += pairs[i].weight;
            if (sum > best_w) { /* strict: ties keep the lowest key */
                best_w = sum;
                best_key = key;
            }
        }
        int32_t l = (int32_t)(best_key >> 32), r = (int32_t)(uint32_t)best_key;
        char joined[2 * MAX_PIECE_BYTES];
        snprintf(joined, sizeof joined, "%s%s", t->piece[l], t->piece[r]);
        if (strlen(joined) >= MAX_PIECE_BYTES || t->n_merges >= MAX_PIECES) {
            st = fitm_err_set(err, FITM_ERR_INTERNAL, "genmodel: vocab training overflow");
            break;
        }
        int32_t out = find_piece(t, joined);
        if (out < 0) {
            if (t->n_pieces >= MAX_PIECES) {
                st = fitm_err_set(err, FITM_ERR_INTERNAL, "genmodel: too many pieces");
                break;
            }
            out = t->n_pieces++;
            memcpy(t->piece[out], joined, strlen(joined) + 1);
        }
        t->merge_l[t->n_merges] = l;
        t->merge_r[t->n_merges] = r;
        t->n_merges++;
        for (int w = 0; w < N_WORDS; w++) {
            int32_t k = 0;
            for (int32_t i = 0; i < n_syms[w]; i++) {
                if (i + 1 < n_syms[w] && syms[w][i] == l && syms[w][i + 1] == r) {
                    syms[w][k++] = out;
                    i++;
                } else {
                    syms[w][k++] = syms[w][i];
                }
            }
            n_syms[w] = k;
        }
    }
    free(pairs);
    free(syms);
    return st;
}

/* The vocabulary as written: tokens, scores (SentencePiece flavours), types, merges (BPE). */
typedef struct {
    int32_t n, cap;
    char **text;
    float *score;
    int32_t *type;
    int32_t n_merges;
    char **merges;
    bool spm;
    bool oom; /* an allocation failed while building */
    const char *model, *pre, *chat_template;
    int32_t bos, eos, unk, pad, eot; /* -1: not written */
    bool add_bos, no_space_prefix;   /* no_space_prefix: write add_space_prefix = false */
} vocab;

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

static void vocab_free(vocab *v)
{
    for (int32_t i = 0; i < v->n; i++)
        free(v->text[i]);
    for (int32_t i = 0; i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->text);
    free(v->score);
    free(v->type);
    free(v->merges);
    memset(v, 0, sizeof *v);
}

/* Appends a token (copying text). Returns its id, or -1 and sets v->oom when out of memory. */
static int32_t vocab_add(vocab *v, const char *text, float score, int32_t type)
{
    if (v->n == v->cap) {
        int32_t cap = v->cap ? v->cap * 2 : 1024;
        char **nt = realloc(v->text, (size_t)cap * sizeof *nt);
        if (nt)
            v->text = nt;
        float *ns = nt ? realloc(v->score, (size_t)cap * sizeof *ns) : NULL;
        if (ns)
            v->score = ns;
        int32_t *ny = ns ? realloc(v->type, (size_t)cap * sizeof *ny) : NULL;
        if (ny)
            v->type = ny;
        if (!ny) {
            v->oom = true;
            return -1;
        }
        v->cap = cap;
    }
    char *copy = strdup(text);
    if (!copy) {
        v->oom = true;
        return -1;
    }
    v->text[v->n] = copy;
    v->score[v->n] = score;
    v->type[v->n] = type;
    return v->n++;
}

/* Renders an abstract piece: ' ' becomes `space` (UTF-8), other ASCII stays as is (both in
 * SentencePiece pieces and in GPT-2's byte-to-unicode map, printable ASCII maps to itself). */
static void render(char *dst, size_t cap, const char *piece, const char *space)
{
    size_t k = 0, sl = strlen(space);
    for (; *piece; piece++) {
        const char *s = *piece == ' ' ? space : piece;
        size_t n = *piece == ' ' ? sl : 1;
        if (k + n + 1 > cap)
            break;
        memcpy(dst + k, s, n);
        k += n;
    }
    dst[k] = '\0';
}

/* GPT-2's byte-to-unicode map: printable bytes map to themselves, the other 68 bytes to
 * U+0100 + n in byte order. Writes the UTF-8 of byte b's character. */
static void byte_char_utf8(int b, char out[3])
{
    bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    int cp = b;
    if (!printable) {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae)))
                n++;
        cp = 0x100 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = '\0';
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = '\0';
    }
}

/* GPT-2's vocabulary order of the 256 byte characters: the printable ones in byte order,
 * then the remapped ones in byte order. */
static int gpt2_byte_at(int i)
{
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 256; b++) {
            bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
            if (printable == (pass == 0) && k++ == i)
                return b;
        }
    return -1;
}

/* Chat templates (Jinja), written for this generator in the common shapes that template
 * detectors recognise: ChatML, Gemma turns, Llama 3 headers. */
static const char TEMPLATE_CHATML[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

static const char TEMPLATE_GEMMA[] =
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{%- set role = 'model' %}"
    "{%- else %}{%- set role = message['role'] %}{%- endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}";

static const char TEMPLATE_LLAMA3[] =
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

#define SPACE_SPM "\xe2\x96\x81" /* U+2581 ▁ */

/* SentencePiece pieces: merge results by rank (score -rank, so the tokenizer's best-score-first
 * merging follows the training order), then the single characters, scored below them. */
static void spm_pieces(vocab *v, const bpe_table *t)
{
    char buf[3 * MAX_PIECE_BYTES + 1];
    int32_t n_new = t->n_pieces - t->n_alpha;
    for (int32_t i = t->n_alpha; i < t->n_pieces; i++) {
        render(buf, sizeof buf, t->piece[i], SPACE_SPM);
        vocab_add(v, buf, -(float)(i - t->n_alpha), TT_NORMAL);
    }
    for (int32_t i = 0; i < t->n_alpha; i++) {
        render(buf, sizeof buf, t->piece[i], SPACE_SPM);
        vocab_add(v, buf, -(float)(n_new + i), TT_NORMAL);
    }
}

static void spm_bytes(vocab *v)
{
    for (int b = 0; b < 256; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", b);
        vocab_add(v, buf, 0.0f, TT_BYTE);
    }
}

#define SPACE_BPE "\xc4\xa0" /* U+0120 Ġ: GPT-2's character for the byte 0x20 */

/* Byte-level BPE: the 256 byte characters, the merge results, and the merges "left right". */
static void bpe_tokens(vocab *v, const bpe_table *t)
{
    char buf[3 * MAX_PIECE_BYTES + 1];
    for (int i = 0; i < 256; i++) {
        char ch[3];
        byte_char_utf8(gpt2_byte_at(i), ch);
        vocab_add(v, ch, 0.0f, TT_NORMAL);
    }
    for (int32_t i = t->n_alpha; i < t->n_pieces; i++) {
        render(buf, sizeof buf, t->piece[i], SPACE_BPE);
        vocab_add(v, buf, 0.0f, TT_NORMAL);
    }
    v->merges = calloc((size_t)t->n_merges, sizeof *v->merges);
    if (!v->merges) {
        v->oom = true;
        return;
    }
    for (int32_t m = 0; m < t->n_merges; m++) {
        char l[3 * MAX_PIECE_BYTES + 1], r[3 * MAX_PIECE_BYTES + 1];
        render(l, sizeof l, t->piece[t->merge_l[m]], SPACE_BPE);
        render(r, sizeof r, t->piece[t->merge_r[m]], SPACE_BPE);
        size_t n = strlen(l) + 1 + strlen(r) + 1;
        v->merges[m] = malloc(n);
        if (!v->merges[m]) {
            v->oom = true;
            return;
        }
        snprintf(v->merges[m], n, "%s %s", l, r);
        v->n_merges = m + 1;
    }
}

/* Builds the vocabulary of a flavour. Ids of special tokens follow the real files where that
 * is practical: Llama 2 (<unk> 0, <s> 1, </s> 2), Gemma 3 (<pad> 0, <eos> 1, <bos> 2, <unk> 3,
 * <start_of_turn> 105, <end_of_turn> 106, "\n" 107); the BPE specials follow the merges as in
 * Qwen2 and Llama 3. On failure v is empty. */
static fitm_status vocab_build(vocab *v, fitm_gen_tok tok, int32_t n_extra, fitm_err *err)
{
    memset(v, 0, sizeof *v);
    v->bos = v->eos = v->unk = v->pad = v->eot = -1;
    if (tok <= FITM_GEN_TOK_DEFAULT || tok >= FITM_GEN_TOK_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: unknown tokenizer %d", (int)tok);
    bpe_table *table = malloc(sizeof *table);
    if (!table)
        return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory building the vocab");
    fitm_status st = bpe_train(table, err);
    if (st != FITM_OK) {
        free(table);
        return st;
    }
    const char *extra_fmt = "<|extra_%d|>";

    switch (tok) {
    case FITM_GEN_TOK_LLAMA:
        v->spm = true;
        v->model = "llama";
        v->pre = "default";
        v->add_bos = true;
        v->unk = vocab_add(v, "<unk>", 0.0f, TT_UNKNOWN);
        v->bos = vocab_add(v, "<s>", 0.0f, TT_CONTROL);
        v->eos = vocab_add(v, "</s>", 0.0f, TT_CONTROL);
        spm_bytes(v);
        spm_pieces(v, table);
        extra_fmt = "<extra_%d>";
        break;
    case FITM_GEN_TOK_GEMMA:
        v->spm = true;
        v->model = "llama";
        v->pre = "default";
        v->add_bos = true;
        v->no_space_prefix = true;
        v->chat_template = TEMPLATE_GEMMA;
        v->pad = vocab_add(v, "<pad>", -1000.0f, TT_CONTROL);
        v->eos = vocab_add(v, "<eos>", -1000.0f, TT_CONTROL);
        v->bos = vocab_add(v, "<bos>", -1000.0f, TT_CONTROL);
        v->unk = vocab_add(v, "<unk>", -1000.0f, TT_CONTROL);
        vocab_add(v, "<mask>", -1000.0f, TT_CONTROL);
        vocab_add(v, "[multimodal]", -1000.0f, TT_USER);
        for (int i = 0; i < 99; i++) {
            char buf[32];
            snprintf(buf, sizeof buf, "<unused%d>", i);
            vocab_add(v, buf, -1000.0f, TT_CONTROL);
        }
        vocab_add(v, "<start_of_turn>", -1000.0f, TT_CONTROL);
        v->eot = vocab_add(v, "<end_of_turn>", -1000.0f, TT_CONTROL);
        vocab_add(v, "\n", -1000.0f, TT_USER);
        spm_bytes(v);
        spm_pieces(v, table);
        extra_fmt = "<extra_%d>";
        break;
    case FITM_GEN_TOK_QWEN2:
        v->model = "gpt2";
        v->pre = "qwen2";
        v->chat_template = TEMPLATE_CHATML;
        bpe_tokens(v, table);
        v->bos = v->pad = vocab_add(v, "<|endoftext|>", 0.0f, TT_CONTROL);
        vocab_add(v, "<|im_start|>", 0.0f, TT_CONTROL);
        v->eos = v->eot = vocab_add(v, "<|im_end|>", 0.0f, TT_CONTROL);
        break;
    default: /* FITM_GEN_TOK_LLAMA3 */
        v->model = "gpt2";
        v->pre = "llama-bpe";
        v->add_bos = true;
        v->chat_template = TEMPLATE_LLAMA3;
        bpe_tokens(v, table);
        v->bos = vocab_add(v, "<|begin_of_text|>", 0.0f, TT_CONTROL);
        v->eos = vocab_add(v, "<|end_of_text|>", 0.0f, TT_CONTROL);
        vocab_add(v, "<|start_header_id|>", 0.0f, TT_CONTROL);
        vocab_add(v, "<|end_header_id|>", 0.0f, TT_CONTROL);
        v->eot = vocab_add(v, "<|eot_id|>", 0.0f, TT_CONTROL);
        break;
    }
    free(table);
    for (int32_t i = 0; !v->oom && i < n_extra; i++) {
        char buf[32];
        snprintf(buf, sizeof buf, extra_fmt, i);
        vocab_add(v, buf, v->spm ? -1000.0f : 0.0f, TT_UNUSED);
    }
    if (v->oom) {
        vocab_free(v);
        return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory building the vocab");
    }
    return FITM_OK;
}

/* Vocabulary size of a flavour (without extras), or -1. Building the vocabulary trains the BPE
 * (tens of ms), so the size is cached; the cache is atomic so concurrent callers are safe (at
 * worst two of them compute the same value). */
static int64_t base_vocab_size(fitm_gen_tok tok)
{
    static _Atomic int64_t cached[FITM_GEN_TOK_COUNT];
    if ((unsigned)tok >= FITM_GEN_TOK_COUNT)
        return -1;
    int64_t n = atomic_load_explicit(&cached[tok], memory_order_relaxed);
    if (!n) {
        vocab v;
        if (vocab_build(&v, tok, 0, NULL) != FITM_OK)
            return -1;
        n = v.n;
        vocab_free(&v);
        atomic_store_explicit(&cached[tok], n, memory_order_relaxed);
    }
    return n;
}

/* The tokens of a tokenizer file's tokenizer.ggml.tokens, or -1 without a string array. */
static int64_t file_vocab_size(const fitm_gguf *g)
{
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    return kv && kv->type == FITM_GGUF_ARRAY && kv->arr_type == FITM_GGUF_STRING
               ? (int64_t)kv->arr_n
               : -1;
}

/* V of a config whose fields are in range: the built-in vocabulary and its extras, or the
 * tokenizer file's tokens; -1 when it cannot be built or read. */
static int64_t config_vocab_size(const fitm_gen_config *cfg)
{
    if (cfg->tokenizer)
        return file_vocab_size(cfg->tokenizer);
    int64_t V = base_vocab_size(effective_tok(cfg));
    return V < 0 ? -1 : V + cfg->n_vocab_extra;
}

/* ------------------------------------------------------------------------------------------
 * Model layout. */

/* A tensor and the distribution of its values: N(mean, std^2), i.i.d. */
typedef struct {
    char name[48];
    int32_t n_dims;
    int64_t ne[2];
    fitm_dtype type;
    float mean, std;
} tensor_spec;

/* Weight scales, chosen so a random model behaves like a model: logits spread over a few units
 * with a clear but not overwhelming top token, attention of the last token far from uniform
 * (normalised entropy about 0.3-0.7), and no layer's output drowning the others.
 *
 * Matrices are N(0, 1/K) (K = ne[0], the input dim), so projections keep unit-scale
 * activations; q and k get GAIN_QK; the LM head GAIN_OUT. Norm weights are 1 + 10% noise.
 * Untied llama/qwen2 embeddings are N(0, 1) so token identity is strong in the residual.
 * Tied heads reuse token_embd, and a token's own embedding then votes for itself; Gemma 3
 * scales its input embedding by sqrt(C), so there the embedding stays small next to
 * post-norm weights of ~4 (the real 270M's grow from ~1 to hundreds with depth), which keeps
 * the input token from winning every argmax. Gemma's q/k norm weights are ~1.5 (the real
 * file's are ~2): with weights of 1, scores of unit-RMS q and k give near-uniform attention,
 * with 2 the last token puts 50-90% of its attention on one key. */
#define GAIN_QK 1.5f
#define GAIN_OUT 2.5f
#define NORM_NOISE 0.1f /* relative */
#define STD_BIAS 0.2f
#define STD_EMBD_UNTIED 1.0f
#define GEMMA_EMBD_GAIN 2.0f
#define GEMMA_QK_NORM 1.5f
#define GEMMA_POST_NORM 4.0f

#define MAX_TENSORS_PER_LAYER 16

static void spec_set(tensor_spec *t, const char *name, int layer, int32_t n_dims, int64_t ne0,
                     int64_t ne1, fitm_dtype type, float mean, float std)
{
    if (layer >= 0)
        snprintf(t->name, sizeof t->name, "blk.%d.%s", layer, name);
    else
        snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0;
    t->ne[1] = n_dims > 1 ? ne1 : 1;
    t->type = type;
    t->mean = mean;
    t->std = std;
}

/* Lists the tensors of a (validated) config in file order into out, which must hold
 * 3 + L * MAX_TENSORS_PER_LAYER entries. Returns the count. */
static int32_t list_tensors(const fitm_gen_config *cfg, int64_t V, tensor_spec *out)
{
    const int64_t C = cfg->n_embd, H = cfg->n_head, Hkv = cfg->n_head_kv, D = cfg->head_dim,
                  F = cfg->n_ff;
    const fitm_dtype W = cfg->type, N = FITM_DTYPE_F32;
    const bool gemma = cfg->arch == FITM_GEN_ARCH_GEMMA3, qwen = cfg->arch == FITM_GEN_ARCH_QWEN2;
    const bool tied = cfg->tied || gemma;
    const float s_c = 1.0f / sqrtf((float)C);
    int32_t n = 0;

    /* (mean, std) pairs */
#define MATRIX(k) 0.0f, 1.0f / sqrtf((float)(k))
#define NORM(m) (m), (m)*NORM_NOISE
    const float embd_std = gemma ? GEMMA_EMBD_GAIN * s_c : tied ? GAIN_OUT * s_c : STD_EMBD_UNTIED;
    spec_set(&out[n++], "token_embd.weight", -1, 2, C, V, W, 0.0f, embd_std);
    spec_set(&out[n++], "output_norm.weight", -1, 1, C, 1, N, NORM(1.0f));
    if (!tied)
        spec_set(&out[n++], "output.weight", -1, 2, C, V, W, 0.0f, GAIN_OUT * s_c);

    for (int il = 0; il < cfg->n_layer; il++) {
        spec_set(&out[n++], "attn_norm.weight", il, 1, C, 1, N, NORM(1.0f));
        spec_set(&out[n++], "attn_q.weight", il, 2, C, H * D, W, 0.0f, GAIN_QK * s_c);
        if (qwen)
            spec_set(&out[n++], "attn_q.bias", il, 1, H * D, 1, N, 0.0f, STD_BIAS);
        if (gemma)
            spec_set(&out[n++], "attn_q_norm.weight", il, 1, D, 1, N, NORM(GEMMA_QK_NORM));
        spec_set(&out[n++], "attn_k.weight", il, 2, C, Hkv * D, W, 0.0f, GAIN_QK * s_c);
        if (qwen)
            spec_set(&out[n++], "attn_k.bias", il, 1, Hkv * D, 1, N, 0.0f, STD_BIAS);
        if (gemma)
            spec_set(&out[n++], "attn_k_norm.weight", il, 1, D, 1, N, NORM(GEMMA_QK_NORM));
        spec_set(&out[n++], "attn_v.weight", il, 2, C, Hkv * D, W, MATRIX(C));
        if (qwen)
            spec_set(&out[n++], "attn_v.bias", il, 1, Hkv * D, 1, N, 0.0f, STD_BIAS);
        spec_set(&out[n++], "attn_output.weight", il, 2, H * D, C, W, MATRIX(H * D));
        if (gemma)
            spec_set(&out[n++], "post_attention_norm.weight", il, 1, C, 1, N,
                     NORM(GEMMA_POST_NORM));
        spec_set(&out[n++], "ffn_norm.weight", il, 1, C, 1, N, NORM(1.0f));
        spec_set(&out[n++], "ffn_gate.weight", il, 2, C, F, W, MATRIX(C));
        spec_set(&out[n++], "ffn_up.weight", il, 2, C, F, W, MATRIX(C));
        spec_set(&out[n++], "ffn_down.weight", il, 2, F, C, W, MATRIX(F));
        if (gemma)
            spec_set(&out[n++], "post_ffw_norm.weight", il, 1, C, 1, N, NORM(GEMMA_POST_NORM));
    }
#undef MATRIX
#undef NORM
    return n;
}

static void fill_values(const fitm_gen_config *cfg, const tensor_spec *t, float *dst)
{
    gen_rng r;
    rng_seed(&r, cfg->seed, t->name);
    int64_t n = t->ne[0] * t->ne[1];
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)(t->mean + t->std * rng_gauss(&r));
}

/* ------------------------------------------------------------------------------------------
 * Validation. */

#define MAX_TENSOR_ELEMS (1ll << 28) /* 1 GiB of F32: far beyond any test model */

fitm_status fitm_gen_validate(const fitm_gen_config *cfg, fitm_err *err)
{
    if (!cfg)
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: no config");
    if ((unsigned)cfg->arch >= FITM_GEN_ARCH_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: unknown arch %d", (int)cfg->arch);
    if ((unsigned)cfg->tok >= FITM_GEN_TOK_COUNT)
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: unknown tokenizer %d", (int)cfg->tok);
    if (!fitm_quant_supported(cfg->type))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: type %d is not a weight type fitm stores", (int)cfg->type);
    const struct {
        const char *name;
        int64_t v, lo, hi;
    } bounds[] = {
        {"layers", cfg->n_layer, 1, 256},
        {"dim", cfg->n_embd, 1, 16384},
        {"heads", cfg->n_head, 1, 256},
        {"kv-heads", cfg->n_head_kv, 1, 256},
        {"head-dim", cfg->head_dim, 2, 1024},
        {"ff", cfg->n_ff, 1, 65536},
        {"ctx", cfg->n_ctx, 1, 1 << 24},
        {"vocab-extra", cfg->n_vocab_extra, 0, 1 << 22},
        {"swa", cfg->n_swa, cfg->arch == FITM_GEN_ARCH_GEMMA3 ? 1 : 0, 1 << 24},
    };
    for (size_t i = 0; i < sizeof bounds / sizeof bounds[0]; i++)
        if (bounds[i].v < bounds[i].lo || bounds[i].v > bounds[i].hi)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "genmodel: %s = %lld is outside [%lld, %lld]", bounds[i].name,
                                (long long)bounds[i].v, (long long)bounds[i].lo,
                                (long long)bounds[i].hi);
    if (cfg->n_head % cfg->n_head_kv != 0)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: heads (%d) must be a multiple of kv-heads (%d)",
                            (int)cfg->n_head, (int)cfg->n_head_kv);
    if (cfg->head_dim % 2 != 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: head-dim (%d) must be even (RoPE)",
                            (int)cfg->head_dim);
    if (!(cfg->rope_base > 0.0f && isfinite(cfg->rope_base)))
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: rope base must be positive");
    if (!(cfg->norm_eps > 0.0f && isfinite(cfg->norm_eps)))
        return fitm_err_set(err, FITM_ERR_INVALID, "genmodel: norm epsilon must be positive");

    const fitm_dtype_info *ti = fitm_dtype_info_of((int)cfg->type);
    const int64_t be = ti->block_elems, qd = (int64_t)cfg->n_head * cfg->head_dim;
    if (cfg->n_embd % be || qd % be || cfg->n_ff % be)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: type %s needs dim (%d), heads*head-dim (%lld) and ff (%d) "
                            "to be multiples of %lld",
                            ti->name, (int)cfg->n_embd, (long long)qd, (int)cfg->n_ff,
                            (long long)be);
    if (cfg->tokenizer && (cfg->tok != FITM_GEN_TOK_DEFAULT || cfg->n_vocab_extra))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: a tokenizer file takes the place of the built-in "
                            "tokenizer and its extra tokens");
    const int64_t V = config_vocab_size(cfg);
    if (cfg->tokenizer && V < 1)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: the tokenizer file has no tokenizer.ggml.tokens");
    if (V < 0)
        return fitm_err_set(err, FITM_ERR_INTERNAL, "genmodel: cannot build the vocabulary");
    if (V * cfg->n_embd > MAX_TENSOR_ELEMS || qd * cfg->n_embd > MAX_TENSOR_ELEMS ||
        (int64_t)cfg->n_ff * cfg->n_embd > MAX_TENSOR_ELEMS)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "genmodel: a tensor would exceed %lld elements; this is a generator "
                            "for small test models",
                            MAX_TENSOR_ELEMS);
    return FITM_OK;
}

int64_t fitm_gen_n_vocab(const fitm_gen_config *cfg)
{
    if (fitm_gen_validate(cfg, NULL) != FITM_OK)
        return -1;
    return config_vocab_size(cfg);
}

/* ------------------------------------------------------------------------------------------
 * Writing. */

/* llama.cpp's general.file_type for a file whose matrices are all of one type. */
static uint32_t file_type_of(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_F32:
        return 0;
    case FITM_DTYPE_F16:
        return 1;
    case FITM_DTYPE_Q4_0:
        return 2;
    case FITM_DTYPE_Q8_0:
        return 7;
    case FITM_DTYPE_Q5_0:
        return 8;
    case FITM_DTYPE_Q4_K:
        return 14; /* Q4_K_S: Q4_K throughout */
    case FITM_DTYPE_Q5_K:
        return 16; /* Q5_K_S */
    case FITM_DTYPE_Q6_K:
        return 18;
    case FITM_DTYPE_BF16:
        return 32;
    default:
        return 0;
    }
}

static bool is_quantized(fitm_dtype t)
{
    return t != FITM_DTYPE_F32 && t != FITM_DTYPE_F16 && t != FITM_DTYPE_BF16;
}

/* Sets "<arch>.<suffix>" = v. */
static fitm_status set_arch_u32(fitm_gguf_writer *w, const char *arch, const char *suffix,
                                uint32_t v, fitm_err *err)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return fitm_gguf_writer_set_u32(w, key, v, err);
}

static fitm_status set_arch_f32(fitm_gguf_writer *w, const char *arch, const char *suffix, float v,
                                fitm_err *err)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return fitm_gguf_writer_set_f32(w, key, v, err);
}

static fitm_status write_hparams(fitm_gguf_writer *w, const fitm_gen_config *cfg, fitm_err *err)
{
    const char *a = arch_infos[cfg->arch].name;
    const bool gemma = cfg->arch == FITM_GEN_ARCH_GEMMA3;
    const bool own_head_dim = gemma || cfg->head_dim * cfg->n_head != cfg->n_embd;
    char name[96];
    fitm_status st;
    snprintf(name, sizeof name, "fitm-gen %s %s seed %llu", a,
             fitm_dtype_info_of((int)cfg->type)->name, (unsigned long long)cfg->seed);

    if ((st = fitm_gguf_writer_set_str(w, "general.architecture", a, err)) ||
        (st = fitm_gguf_writer_set_str(w, "general.type", "model", err)) ||
        (st = fitm_gguf_writer_set_str(w, "general.name", name, err)) ||
        (st = fitm_gguf_writer_set_u32(w, "general.file_type", file_type_of(cfg->type), err)))
        return st;
    if (is_quantized(cfg->type) &&
        (st = fitm_gguf_writer_set_u32(w, "general.quantization_version", 2, err)))
        return st;
    if ((st = set_arch_u32(w, a, "context_length", (uint32_t)cfg->n_ctx, err)) ||
        (st = set_arch_u32(w, a, "embedding_length", (uint32_t)cfg->n_embd, err)) ||
        (st = set_arch_u32(w, a, "block_count", (uint32_t)cfg->n_layer, err)) ||
        (st = set_arch_u32(w, a, "feed_forward_length", (uint32_t)cfg->n_ff, err)) ||
        (st = set_arch_u32(w, a, "attention.head_count", (uint32_t)cfg->n_head, err)) ||
        (st = set_arch_u32(w, a, "attention.head_count_kv", (uint32_t)cfg->n_head_kv, err)) ||
        (st = set_arch_f32(w, a, "attention.layer_norm_rms_epsilon", cfg->norm_eps, err)) ||
        (st = set_arch_f32(w, a, "rope.freq_base", cfg->rope_base, err)))
        return st;
    if (own_head_dim &&
        ((st = set_arch_u32(w, a, "attention.key_length", (uint32_t)cfg->head_dim, err)) ||
         (st = set_arch_u32(w, a, "attention.value_length", (uint32_t)cfg->head_dim, err))))
        return st;
    if (cfg->arch == FITM_GEN_ARCH_LLAMA &&
        (st = set_arch_u32(w, a, "rope.dimension_count", (uint32_t)cfg->head_dim, err)))
        return st;
    if (gemma && (st = set_arch_u32(w, a, "attention.sliding_window", (uint32_t)cfg->n_swa, err)))
        return st;
    return FITM_OK;
}

static fitm_status write_vocab(fitm_gguf_writer *w, const vocab *v, fitm_err *err)
{
    fitm_status st;
    if ((st = fitm_gguf_writer_set_str(w, "tokenizer.ggml.model", v->model, err)) ||
        (st = fitm_gguf_writer_set_str(w, "tokenizer.ggml.pre", v->pre, err)) ||
        (st = fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->text,
                                           (uint64_t)v->n, err)))
        return st;
    if (v->spm && (st = fitm_gguf_writer_set_arr(w, "tokenizer.ggml.scores", FITM_GGUF_FLOAT32,
                                                 v->score, (uint64_t)v->n, err)))
        return st;
    if ((st = fitm_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", FITM_GGUF_INT32, v->type,
                                       (uint64_t)v->n, err)))
        return st;
    if (!v->spm && (st = fitm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges",
                                                      (const char *const *)v->merges,
                                                      (uint64_t)v->n_merges, err)))
        return st;
    const struct {
        const char *key;
        int32_t id;
    } ids[] = {
        {"tokenizer.ggml.bos_token_id", v->bos},     {"tokenizer.ggml.eos_token_id", v->eos},
        {"tokenizer.ggml.unknown_token_id", v->unk}, {"tokenizer.ggml.padding_token_id", v->pad},
        {"tokenizer.ggml.eot_token_id", v->eot},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i].id >= 0 &&
            (st = fitm_gguf_writer_set_u32(w, ids[i].key, (uint32_t)ids[i].id, err)))
            return st;
    if ((st = fitm_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", v->add_bos, err)) ||
        (st = fitm_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false, err)))
        return st;
    if (v->no_space_prefix &&
        (st = fitm_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false, err)))
        return st;
    if (v->chat_template &&
        (st = fitm_gguf_writer_set_str(w, "tokenizer.chat_template", v->chat_template, err)))
        return st;
    return FITM_OK;
}

/* Every tokenizer.* key of g with its type and value, in g's order. */
static fitm_status copy_tokenizer(fitm_gguf_writer *w, const fitm_gguf *g, fitm_err *err)
{
    fitm_status st = FITM_OK;
    for (int64_t i = 0; st == FITM_OK && i < fitm_gguf_n_kv(g); i++) {
        const fitm_gguf_kv *kv = fitm_gguf_kv_at(g, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0)
            continue;
        if (kv->type == FITM_GGUF_STRING) {
            uint64_t len;
            memcpy(&len, kv->value, sizeof len);
            st = fitm_gguf_writer_set_strn(w, kv->key, (const char *)kv->value + sizeof len, len,
                                           err);
        } else if (kv->type != FITM_GGUF_ARRAY) {
            st = fitm_gguf_writer_set_scalar(w, kv->key, kv->type, kv->value, err);
        } else if (kv->arr_type == FITM_GGUF_STRING) {
            fitm_gguf_str *strs = malloc((size_t)(kv->arr_n ? kv->arr_n : 1) * sizeof *strs);
            if (!strs)
                return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory");
            for (uint64_t j = 0; j < kv->arr_n; j++)
                strs[j] = fitm_gguf_arr_str(g, kv, j);
            st = fitm_gguf_writer_set_arr_strn(w, kv->key, strs, kv->arr_n, err);
            free(strs);
        } else if (kv->arr_type == FITM_GGUF_ARRAY) {
            st = fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                              "genmodel: the tokenizer file's '%s' is an array of arrays", kv->key);
        } else {
            st = fitm_gguf_writer_set_arr(w, kv->key, kv->arr_type, kv->value, kv->arr_n, err);
        }
    }
    return st;
}

/* Draws one tensor and adds it in its storage type. */
static fitm_status add_tensor(fitm_gguf_writer *w, const fitm_gen_config *cfg, const tensor_spec *t,
                              fitm_err *err)
{
    const int64_t K = t->ne[0], rows = t->ne[1];
    const size_t row_bytes = fitm_dtype_row_bytes(t->type, K);
    float *src = malloc((size_t)(K * rows) * sizeof *src);
    void *dst = t->type == FITM_DTYPE_F32 ? (void *)src : malloc(row_bytes * (size_t)rows);
    fitm_status st = FITM_OK;
    if (!src || !dst) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory for tensor '%s'", t->name);
        goto done;
    }
    fill_values(cfg, t, src);
    if (t->type != FITM_DTYPE_F32)
        for (int64_t r = 0; r < rows; r++)
            fitm_quant_row(t->type, src + r * K, (uint8_t *)dst + (size_t)r * row_bytes, K);
    st = fitm_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, dst,
                                     row_bytes * (size_t)rows, err);
done:
    if (dst != src)
        free(dst);
    free(src);
    return st;
}

fitm_status fitm_gen_build(const fitm_gen_config *cfg, fitm_gguf_writer **out, fitm_err *err)
{
    fitm_gguf_writer *w = NULL;
    tensor_spec *specs = NULL;
    vocab v = {0};
    fitm_status st;

    *out = NULL;
    if ((st = fitm_gen_validate(cfg, err)) != FITM_OK)
        return st;
    if (!cfg->tokenizer &&
        (st = vocab_build(&v, effective_tok(cfg), cfg->n_vocab_extra, err)) != FITM_OK)
        return st;
    specs = malloc((size_t)(3 + cfg->n_layer * MAX_TENSORS_PER_LAYER) * sizeof *specs);
    if (!specs) {
        st = fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory");
        goto fail;
    }
    if ((st = fitm_gguf_writer_create(&w, err)) != FITM_OK ||
        (st = write_hparams(w, cfg, err)) != FITM_OK ||
        (st = cfg->tokenizer ? copy_tokenizer(w, cfg->tokenizer, err) : write_vocab(w, &v, err)) !=
            FITM_OK)
        goto fail;
    int32_t n = list_tensors(cfg, config_vocab_size(cfg), specs);
    for (int32_t i = 0; i < n; i++)
        if ((st = add_tensor(w, cfg, &specs[i], err)) != FITM_OK)
            goto fail;
    free(specs);
    vocab_free(&v);
    *out = w;
    return FITM_OK;
fail:
    fitm_gguf_writer_destroy(w);
    free(specs);
    vocab_free(&v);
    return st;
}

fitm_status fitm_gen_write(const fitm_gen_config *cfg, const char *path, fitm_err *err)
{
    fitm_gguf_writer *w = NULL;
    fitm_status st = fitm_gen_build(cfg, &w, err);
    if (st == FITM_OK)
        st = fitm_gguf_writer_write(w, path, err);
    fitm_gguf_writer_destroy(w);
    return st;
}

fitm_status fitm_gen_fill(const fitm_gen_config *cfg, const char *name, float *dst, int64_t n,
                          fitm_err *err)
{
    fitm_status st = fitm_gen_validate(cfg, err);
    if (st != FITM_OK)
        return st;
    tensor_spec *specs = malloc((size_t)(3 + cfg->n_layer * MAX_TENSORS_PER_LAYER) * sizeof *specs);
    if (!specs)
        return fitm_err_set(err, FITM_ERR_NOMEM, "genmodel: out of memory");
    int32_t count = list_tensors(cfg, fitm_gen_n_vocab(cfg), specs);
    int32_t i = 0;
    while (name && i < count && strcmp(specs[i].name, name) != 0)
        i++;
    if (!name || i == count)
        st = fitm_err_set(err, FITM_ERR_NOT_FOUND, "genmodel: no tensor '%s' in this model",
                          name ? name : "(null)");
    else if (n != specs[i].ne[0] * specs[i].ne[1])
        st =
            fitm_err_set(err, FITM_ERR_INVALID, "genmodel: tensor '%s' has %lld elements, not %lld",
                         name, (long long)specs[i].ne[0] * specs[i].ne[1], (long long)n);
    else
        fill_values(cfg, &specs[i], dst);
    free(specs);
    return st;
}
