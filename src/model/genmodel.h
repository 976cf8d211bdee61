/* genmodel: tiny GGUF models with random weights and a small built-in tokenizer, for tests and
 * the numpy oracle, so the project never needs a downloaded model.
 *
 * A model is a pure function of its fitm_gen_config: the same config (seed included) gives a
 * byte-identical file. Each tensor's values come from its own random stream, seeded by the
 * config's seed and the tensor's name, so a tensor's F32 values do not depend on the weight
 * type it is stored in, on the tensor order, or on how many layers follow it.
 *
 * Layout follows llama.cpp's GGUF conventions (key names, tensor names, shapes with ne[0]
 * first, token types). Weight matrices and token_embd are stored in cfg.type; norm weights and
 * biases stay F32 as in real files. The tokenizer does not depend on the seed.
 *
 * Dimensions: L layers, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, V vocab. */
#ifndef FITM_GENMODEL_H
#define FITM_GENMODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"

typedef enum {
    FITM_GEN_ARCH_LLAMA,  /* llama: RMSNorm, SwiGLU, normal RoPE, optional GQA / tied output   */
    FITM_GEN_ARCH_QWEN2,  /* qwen2: as llama plus q/k/v biases; neox RoPE (known by the arch)  */
    FITM_GEN_ARCH_GEMMA3, /* gemma3: q/k norms, post-norms, tied output, 5 local : 1 global    */
    FITM_GEN_ARCH_COUNT
} fitm_gen_arch;

typedef enum {
    FITM_GEN_TOK_DEFAULT, /* the arch's own: llama -> LLAMA, qwen2 -> QWEN2, gemma3 -> GEMMA  */
    FITM_GEN_TOK_LLAMA,   /* SentencePiece-style ("llama"): <unk> <s> </s>, bytes, pieces      */
    FITM_GEN_TOK_GEMMA,   /* SentencePiece-style with Gemma's special ids and turn tokens      */
    FITM_GEN_TOK_QWEN2,   /* byte-level BPE ("gpt2", pre "qwen2"), ChatML specials             */
    FITM_GEN_TOK_LLAMA3,  /* byte-level BPE ("gpt2", pre "llama-bpe"), Llama 3 specials        */
    FITM_GEN_TOK_COUNT
} fitm_gen_tok;

typedef struct {
    fitm_gen_arch arch;
    fitm_gen_tok tok;
    fitm_dtype type; /* storage type of weight matrices and token_embd                 */
    uint64_t seed;
    int32_t n_layer;       /* L                                                              */
    int32_t n_embd;        /* C                                                              */
    int32_t n_head;        /* H                                                              */
    int32_t n_head_kv;     /* Hkv; H % Hkv == 0                                              */
    int32_t head_dim;      /* D; even (RoPE)                                                 */
    int32_t n_ff;          /* F                                                              */
    int32_t n_ctx;         /* context_length written to the file                            */
    int32_t n_vocab_extra; /* unused-type tokens appended to the vocabulary (V grows)        */
    int32_t n_swa;         /* gemma3: sliding window of the local layers, in tokens          */
    bool tied;             /* omit output.weight (the head reuses token_embd); gemma3: always */
    float rope_base;       /* rope.freq_base (gemma3: of the global layers)                 */
    float norm_eps;        /* attention.layer_norm_rms_epsilon                               */
    /* NULL: the built-in tokenizer `tok`. Else every tokenizer.* key of this file, as it has
     * them, and V its tokens: the model tokenizes exactly as that file's model does (a real
     * model's prompts at its length, with random weights of another shape); tok must be
     * DEFAULT and n_vocab_extra 0. The file must outlive the build. */
    const fitm_gguf *tokenizer;
} fitm_gen_config;

/* Fills cfg with the defaults of arch (see fitm_gen_defaults' table in genmodel.c and
 * `fitm mkmodel --help`): type F32, seed 1, sizes where every supported type is valid
 * (C, H*D and F multiples of 256). */
void fitm_gen_defaults(fitm_gen_config *cfg, fitm_gen_arch arch);

/* Names <-> enums ("llama", "qwen2", "gemma3"; "llama", "gemma", "qwen2", "llama3").
 * Parsing returns FITM_ERR_INVALID with the accepted names in err for anything else. Name
 * functions never return NULL ("?" for out-of-range values). */
fitm_status fitm_gen_parse_arch(const char *name, fitm_gen_arch *out, fitm_err *err);
fitm_status fitm_gen_parse_tok(const char *name, fitm_gen_tok *out, fitm_err *err);
const char *fitm_gen_arch_name(fitm_gen_arch arch);
const char *fitm_gen_tok_name(fitm_gen_tok tok);

/* Checks a config: known arch/tokenizer, a weight type fitm stores, positive sizes within
 * small-model bounds, H % Hkv == 0, D even, and C, H*D and F multiples of the type's block
 * size (256 for the K-quants, 32 for Q4_0/Q5_0/Q8_0). FITM_ERR_INVALID names the field. */
fitm_status fitm_gen_validate(const fitm_gen_config *cfg, fitm_err *err);

/* Vocabulary size V the config produces (built-in tokenizer + n_vocab_extra, or the tokenizer
 * file's tokens), or -1 when the config does not validate. */
int64_t fitm_gen_n_vocab(const fitm_gen_config *cfg);

/* Builds the whole model (metadata, tokenizer, tensors) into a new writer. *out is NULL on
 * failure; on success the caller owns it and releases it with fitm_gguf_writer_destroy. */
fitm_status fitm_gen_build(const fitm_gen_config *cfg, fitm_gguf_writer **out, fitm_err *err);

/* fitm_gen_build, then writes the file at path (created or truncated). */
fitm_status fitm_gen_write(const fitm_gen_config *cfg, const char *path, fitm_err *err);

/* The F32 values the generator draws for tensor `name` of this config, before conversion to
 * its storage type: n must equal the tensor's element count (ne[0] * ne[1]). Lets tests
 * compare what a reader dequantizes with what was quantized. FITM_ERR_NOT_FOUND if the config
 * has no such tensor, FITM_ERR_INVALID if n is wrong or the config does not validate. */
fitm_status fitm_gen_fill(const fitm_gen_config *cfg, const char *name, float *dst, int64_t n,
                          fitm_err *err);

#endif
