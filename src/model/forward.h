/* forward: the one forward driver. Runs T tokens (a batched prefill, or T = 1 for a decode
 * step) through the model on a backend, appending their K/V rows to a KV cache, producing
 * logits for the trailing rows, and optionally capturing attention and intervening on it.
 *
 * Prefix reuse: computing tokens [s, e) at positions s.. on top of a cache that holds [0, s)
 * gives the same result as one pass over [0, e). Branches: a cache rebased at s
 * (fitm_kv_rebase) plus opts.prefix = a base cache holding [0, s) reads the base's rows
 * read-only and writes only its own, so K reference passes (suffix k replaces [s_k, e_k) and
 * recomputes [s_k, T)) share the original pass's cache without copying it.
 *
 * Numerics: a call runs its layers on one of two paths (fitm_forward_path): BATCH (weights
 * converted to F32 in tiles, shared by all rows: fast for prefill) or STEP (quantized dot
 * products with Q8 activations: fast for a few rows). Two calls on the same path compute
 * every row bit-identically, whatever their T and however the sequence was split, so a
 * reference pass's rows are exactly the original pass's (a row captured or intervened in one
 * call and plain in the other aside: a backend may run a BATCH call's plain rows' attention
 * in arithmetic of its own, fitm_attn_args.batched). AUTO picks BATCH for
 * T >= FITM_FORWARD_BATCH_MIN (every multi-token call), STEP for decode steps. Float weights
 * (F32/F16/BF16) compute the same on both. The output head always uses STEP's products, so
 * logits do not depend on n_logits or T.
 *
 * Ownership: the fitm_forward holds all scratch (allocated once at creation; a run allocates
 * nothing). It borrows the model and backend, which must outlive it. Not thread-safe: one
 * thread runs a given fitm_forward (and its backend) at a time.
 *
 * Legend: T tokens, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, V vocab,
 * L layers, K documents (spans). */
#ifndef FITM_FORWARD_H
#define FITM_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "compute/ops.h"
#include "model/backend.h"
#include "model/kv.h"
#include "model/model.h"
#include "model/moice.h"

/* Position methods (docs/position-methods.md): how a call's attention uses positions. */
typedef enum {
    FITM_POSITION_NONE = 0,  /* the model's own RoPE                                      */
    FITM_POSITION_MOICE,     /* MoICE: routed mixture of RoPE bases (needs params.moice) */
    FITM_POSITION_MS_POE,    /* Ms-PoE: per-head position ratios in [1.2, 1.8]           */
    FITM_POSITION_BUCKETS,   /* Attention Buckets: one pass per bucket with scaled bases,
                                each in its own cache pass, aggregated at the output      */
    FITM_POSITION_COUNT
} fitm_position_method;

/* Wire names: "none", "moice", "ms_poe", "attention_buckets"; "unknown" out of range. */
const char *fitm_position_method_name(fitm_position_method m);
/* -1 when s is not a wire name. */
int fitm_position_method_parse(const char *s);

/* Ms-PoE (Zhang et al. 2024): head ratios from MIN to MAX by position-awareness rank, in the
 * layers from FIRST_LAYER on; ranks from a plain pass over FITM_MS_POE_CALIB_LEN fixed ids
 * (fitm_forward_ms_poe_calib_id). */
#define FITM_MS_POE_MIN 1.2
#define FITM_MS_POE_MAX 1.8
#define FITM_MS_POE_FIRST_LAYER 2
#define FITM_MS_POE_CALIB_LEN 64

/* Attention Buckets (Chen et al. 2023): pass b rotates every layer with the layer's own base
 * times fitm_forward_bucket_factor(b): {1, 1.75, 1.8, 1.9, 2, 2.25, 2.5}, the MoICE paper's
 * Llama-2 bucket set over Llama-2's base. A sequence runs as many passes as its cache holds
 * (fitm_kv_passes; the pipeline gives it FITM_BUCKETS): the first factors of the set. */
#define FITM_BUCKETS 7
double fitm_forward_bucket_factor(int32_t b);

/* The i-th calibration id for a vocabulary of n_vocab: (7919 i + 17) mod V. */
int32_t fitm_forward_ms_poe_calib_id(int64_t i, int32_t n_vocab);

/* Below this many tokens, AUTO runs a call on the STEP path: only single-token decode steps,
 * so any two multi-token calls (prefill chunks, reference passes) share numerics. */
#define FITM_FORWARD_BATCH_MIN 2

typedef enum {
    FITM_PATH_AUTO = 0, /* BATCH when T >= FITM_FORWARD_BATCH_MIN, else STEP */
    FITM_PATH_BATCH,
    FITM_PATH_STEP,
} fitm_forward_path;

typedef struct {
    /* Base cache holding positions [0, kv.pos_base), read-only, when kv is a branch
     * (pos_base > 0). NULL when kv starts at 0. */
    const fitm_kv *prefix;
    int64_t n_logits;        /* logits for the last n_logits rows of this call, in [0, T]  */
    float *logits;           /* (n_logits, V) host; may be NULL when n_logits is 0 or top_k
                                or n_pick is set                                           */
    int32_t top_k;           /* > 0: each of those rows' top_k largest logits into top, in
                                fitm_ops_topk's order (at most FITM_TOP_MAX, at most V);
                                only top_k entries per row leave the backend, not V        */
    fitm_top *top;           /* (n_logits, top_k) host, when top_k > 0                     */
    int32_t n_pick;          /* > 0: each of those rows' log-probabilities at n_pick ids
                                (at most FITM_PICK_MAX) into logprob: fitm_ops_logprob of
                                the row the logits would hold (after the softcap; BUCKETS:
                                of log p^), computed on the backend where it has
                                ops->logprob, so only n_pick doubles per row leave it; the
                                CUDA backend's differ from the host's by its sum's order
                                (docs/cuda-backend.md)                                     */
    const int32_t *pick;     /* (n_logits, n_pick) host ids, each in [0, V)                */
    double *logprob;         /* (n_logits, n_pick) host, when n_pick > 0                   */
    const fitm_capture *capture;           /* NULL: none */
    const fitm_intervention *intervention; /* NULL: none */
    fitm_forward_path path;                /* numerics class; AUTO unless a caller needs
                                              rows to match a call of another size */
    int32_t n_layers;                      /* > 0: run layers [0, n_layers) only (at most
                                              the model's L; no logits): for a capture that
                                              reads no later layer. The cache gets no rows in
                                              the later layers (fitm_kv_layers), the capture's
                                              slots of the later layers are set to 0, and the
                                              rows of the layers run are those of a whole
                                              pass. 0: every layer                         */
    fitm_position_method position;         /* NONE unless fitm_forward_positions was called
                                              (MOICE: with a sidecar); a branch and its
                                              prefix must use the same. BUCKETS: one pass
                                              per pass of kv (and of prefix), each with its
                                              factor; the logits are log p^ with
                                              p^ = sum_b a_b p_b / sum_b a_b, p_b the pass's
                                              softmax, a_b = max p_b (one pass: log p_0);
                                              the captures are the passes' mean            */
} fitm_forward_opts;

typedef struct {
    int64_t max_tokens;  /* most tokens per call (T)                                       */
    int64_t max_ctx;     /* positions a call may reach: pos0 + T <= max_ctx                */
    int64_t max_logits;  /* most logit rows per call                                       */
} fitm_forward_params;

typedef struct fitm_forward fitm_forward;

/* Allocates the scratch for p's limits on backend b. *out is NULL on failure. */
fitm_status fitm_forward_create(fitm_forward **out, const fitm_model *m, fitm_backend *b,
                                const fitm_forward_params *p, fitm_err *err);

/* NULL is a no-op. */
void fitm_forward_destroy(fitm_forward *f);

const fitm_forward_params *fitm_forward_params_of(const fitm_forward *f);

/* Enables the position methods on f (once, before its first call): allocates their scratch
 * (per expert slot, max(H, MoICE's N) of them: queries (max_tokens, H, D) and keys
 * (max_ctx, Hkv, D); a RoPE table (max_ctx, n_rot) per distinct base change) and ranks the
 * heads for Ms-PoE with one plain pass over FITM_MS_POE_CALIB_LEN fixed ids (fewer when
 * max_tokens or max_ctx is smaller). moice (borrowed, outliving f; NULL: no MoICE) must have
 * been checked against the model (fitm_moice_check). The KV cache is unchanged: keys stay
 * rotated with the layer's own base, and each expert's keys are turned on from them per call,
 * so prefix reuse and branches work as for plain calls. On a backend without
 * ops->attention_mix it reserves nothing (calls with a method fail FITM_ERR_UNSUPPORTED).
 * On a backend with ops->capture_add it also reserves the buckets' output scratch: a host
 * row of V floats, one of V doubles and (max_logits, V) doubles (touched only as far as rows
 * are used). */
fitm_status fitm_forward_positions(fitm_forward *f, const fitm_moice *moice, fitm_err *err);

/* Ms-PoE's head ranks (L, H), 0 = most position-aware; NULL before fitm_forward_positions. */
const int32_t *fitm_forward_ms_poe_ranks(const fitm_forward *f);

/* Most sequences one batched call may carry. */
#define FITM_FORWARD_MAX_SEQS 64

/* One sequence's part of a batched call: tokens (T ids, host) at positions [pos0, pos0 + T)
 * on top of kv, with opts (NULL: no logits, no capture) as for fitm_forward_run. */
typedef struct {
    fitm_kv *kv;
    const int32_t *tokens;
    int64_t T, pos0;
    const fitm_forward_opts *opts;
} fitm_forward_seq;

/* Runs several sequences in one call: the weight products run once over the rows of all of
 * them (a BUCKETS sequence counts one sequence per pass: when the passes do not fit the
 * limits below, the call runs them in several groups, in order), attention, captures and the
 * intervention run per sequence (each against its own cache, or its branch over
 * opts->prefix).
 *
 * Batching rule (numerics): each sequence's path is resolved from its own opts->path and its
 * own T exactly as fitm_forward_run would resolve it (AUTO: STEP for one token, BATCH for
 * more). The call runs every weight product twice at most -- once over the rows of its STEP
 * sequences, once over the rows of its BATCH sequences -- and both paths compute each row
 * independently of the other rows. So every sequence's logits, captures and cache rows are
 * bit-identical to a fitm_forward_run of that sequence alone, whatever else shares the call:
 * decode steps of many sequences packed together all run on the STEP path, like a lone
 * decode step, and prefill chunks on the BATCH path, like a lone prefill.
 *
 * Limits: 1 <= n_seqs <= FITM_FORWARD_MAX_SEQS; the sum of T is at most max_tokens and the
 * sum of n_logits at most max_logits; each sequence's positions obey fitm_forward_run's
 * limits. No two sequences share a kv, and no sequence's prefix is another's kv (a prefix is
 * read-only; several branches may share one). Bad arguments fail the whole call (the message
 * names the sequence) and leave every cache unchanged. */
fitm_status fitm_forward_run_batch(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs,
                                   fitm_err *err);

/* Runs tokens (T ids, host) at positions [pos0, pos0 + T). kv must hold [kv.pos_base, pos0)
 * (pos_base <= pos0 <= pos_end: a pos0 below pos_end rewinds) and have room for pos0 + T;
 * afterwards it holds [pos_base, pos0 + T). opts may be NULL (no logits, no capture). The rows
 * it reads (kv's before pos0, the prefix's) must be held in every layer it runs
 * (fitm_kv_layers); afterwards kv holds its rows in the layers it ran.
 * Bad arguments give FITM_ERR_INVALID (or FITM_ERR_LIMIT past the created limits) with a
 * message, and leave kv unchanged. */
fitm_status fitm_forward_run(fitm_forward *f, fitm_kv *kv, const int32_t *tokens, int64_t T,
                             int64_t pos0, const fitm_forward_opts *opts, fitm_err *err);

#endif
