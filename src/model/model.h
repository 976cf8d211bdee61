/* model: a transformer's architecture and weights, read from a GGUF file (llama.cpp's key and
 * tensor names).
 *
 * Architectures: `llama` (GQA, "normal" RoPE on adjacent pairs, optional tied output),
 * `qwen2` (q/k/v biases, neox RoPE), `gemma3` (embedding x sqrt(C), per-head q/k RMSNorm,
 * post-attention and post-FFN norms, GeGLU, tied output, sliding-window local layers: layer l
 * is local when l % 6 < 5, as llama.cpp's set_swa_pattern(6), unless the file carries
 * gemma3.attention.sliding_window_pattern (a period P, or one flag per layer); local layers
 * use RoPE base 10000 (or gemma3.rope.freq_base_swa) and see the last
 * gemma3.attention.sliding_window positions, global layers use gemma3.rope.freq_base and its
 * linear scaling and see everything).
 *
 * Weights stay as stored: every matrix is a view into the mmapped file in its own type (F32,
 * F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K). Only vectors (norm weights, biases) are
 * converted to F32 copies the model owns. Anything the forward pass cannot run (an unknown
 * architecture, a missing tensor, a wrong shape, an unsupported type, inconsistent sizes) is a
 * load error that names the key or tensor.
 *
 * Legend: T tokens, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, V vocab,
 * L layers. */
#ifndef FITM_MODEL_H
#define FITM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"
#include "gguf/gguf.h"

typedef enum {
    FITM_ARCH_LLAMA,
    FITM_ARCH_QWEN2,
    FITM_ARCH_GEMMA3,
    FITM_ARCH_COUNT
} fitm_arch;

typedef enum {
    FITM_ACT_SILU, /* SwiGLU: silu(gate) * up      */
    FITM_ACT_GELU, /* GeGLU: gelu_tanh(gate) * up  */
} fitm_act;

/* Upper bounds the loader enforces, so sizes multiply without overflow. */
#define FITM_MODEL_MAX_LAYERS 512
#define FITM_MODEL_MAX_DIM (1 << 20)

typedef struct {
    fitm_arch arch;
    int32_t n_layer;        /* L                                                        */
    int32_t n_embd;         /* C                                                        */
    int32_t n_head;         /* H                                                        */
    int32_t n_head_kv;      /* Hkv (H % Hkv == 0)                                       */
    int32_t head_dim;       /* D                                                        */
    int32_t n_ff;           /* F                                                        */
    int32_t n_vocab;        /* V (rows of token_embd)                                   */
    int32_t n_rot;          /* RoPE dims of each head (even, <= D)                      */
    int64_t n_ctx_train;    /* context_length from the file (0 if absent)               */
    float norm_eps;         /* RMSNorm epsilon                                          */
    float rope_base;        /* RoPE base of global layers                               */
    float rope_freq_scale;  /* position multiplier of global layers (1/linear factor)   */
    float rope_base_local;  /* RoPE base of sliding-window layers                       */
    int32_t n_swa;          /* sliding window in positions; 0 = no local layers         */
    bool rope_neox;         /* rotate (i, i + n_rot/2) instead of (2i, 2i+1)            */
    bool qk_norm;           /* gemma3: RMSNorm over each q and k head                   */
    bool post_norms;        /* gemma3: norms after attention and after the FFN          */
    fitm_act act;
    float embd_scale;       /* token embeddings are multiplied by this (gemma3 sqrt(C))  */
    float attn_scale;       /* scores = q.k * attn_scale                                */
    float final_softcap;    /* logits = c * tanh(logits / c) when > 0                   */
} fitm_model_config;

/* A weight tensor: rows of n_cols elements (n_cols contiguous, as GGUF's ne[0]). Matrices
 * point into the mapping; vectors point at F32 copies owned by the model. Its address is
 * stable for the model's life, so a backend may key its own copies on it. */
typedef struct {
    const char *name;
    fitm_dtype type;
    int64_t n_rows;     /* N: outputs (1 for vectors) */
    int64_t n_cols;     /* K: inputs                  */
    size_t row_bytes;
    const void *data;
} fitm_weight;

typedef struct {
    fitm_weight attn_norm;      /* (C)                              */
    fitm_weight wq, wk, wv;     /* (H*D, C), (Hkv*D, C), (Hkv*D, C) */
    fitm_weight bq, bk, bv;     /* (H*D), (Hkv*D) x2: required for
                                   qwen2, optional for llama; data
                                   NULL if absent                   */
    fitm_weight q_norm, k_norm; /* gemma3 only: (D)                 */
    fitm_weight wo;             /* (C, H*D)                         */
    fitm_weight bo;             /* optional (C); data NULL if absent */
    fitm_weight post_attn_norm; /* gemma3 only: (C)                 */
    fitm_weight ffn_norm;       /* (C)                              */
    fitm_weight w_gate, w_up;   /* (F, C)                           */
    fitm_weight w_down;         /* (C, F)                           */
    fitm_weight post_ffn_norm;  /* gemma3 only: (C)                 */
    bool local;                 /* sliding-window layer             */
    float rope_base;
    float rope_freq_scale;
} fitm_layer;

typedef struct fitm_model fitm_model;

/* Opens path (mmapped) and loads the model. On failure *out is NULL and err names the problem,
 * e.g. "tensor 'blk.3.attn_k.weight': shape [64, 48], expected [64, 32]". */
fitm_status fitm_model_open(fitm_model **out, const char *path, fitm_err *err);

/* fitm_model_open with copy true reads the weights into private memory instead of mapping
 * the file (fitm_gguf_open_copy): slower to start, immune to the file changing. */
fitm_status fitm_model_open_mode(fitm_model **out, const char *path, bool copy, fitm_err *err);

/* Loads from an already open file. The model takes ownership of g (closing it with the model,
 * or at once on failure). */
fitm_status fitm_model_from_gguf(fitm_model **out, fitm_gguf *g, fitm_err *err);

/* Releases the model and its file. NULL is a no-op. */
void fitm_model_close(fitm_model *m);

const fitm_model_config *fitm_model_config_of(const fitm_model *m);
const fitm_layer *fitm_model_layer(const fitm_model *m, int32_t l); /* l in [0, L) */
const fitm_weight *fitm_model_tok_embd(const fitm_model *m);        /* (V, C)       */
const fitm_weight *fitm_model_output_norm(const fitm_model *m);     /* (C)          */
const fitm_weight *fitm_model_output(const fitm_model *m);          /* (V, C); may be tok_embd */

/* Every weight view of m, for a backend that copies or repacks them: tok_embd, output_norm,
 * output, then each layer's views in field order (17 per layer), i in [0, n). Absent optional
 * ones have data NULL; a tied output is a second view of tok_embd's data. */
int64_t fitm_model_n_weights(const fitm_model *m);
const fitm_weight *fitm_model_weight_at(const fitm_model *m, int64_t i);

/* A backend that keeps its own copy of w's data tells the model so: the pages of a mapped file
 * that hold only w are dropped from memory (w->data stays valid: touching it reads the file
 * again). A model read into memory keeps them. */
void fitm_model_release(const fitm_model *m, const fitm_weight *w);

/* The file, for the tokenizer and metadata; owned by the model. */
const fitm_gguf *fitm_model_gguf(const fitm_model *m);

/* Bytes of all weight tensors as stored. */
uint64_t fitm_model_weight_bytes(const fitm_model *m);

const char *fitm_arch_name(fitm_arch a);

/* Whether key position `key` is visible from query position `query` in layer l (causal, and
 * within the sliding window for local layers). */
bool fitm_model_key_visible(const fitm_model *m, int32_t l, int64_t query, int64_t key);

#endif
