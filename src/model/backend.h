/* backend: the ops the forward driver (forward.c) runs, behind one small vtable, so the CPU
 * reference (backend_cpu.c) and a CUDA backend can run the same driver.
 *
 * Memory: every float pointer an op takes is backend memory from ops->alloc (host memory for
 * the CPU backend, device memory for CUDA), except where marked "host". Weights are passed as
 * fitm_weight views; a backend that keeps its own copies looks them up by the view's address
 * (stable for the model's life).
 *
 * Ops run in order on the calling thread's stream; results are visible to the next op and, for
 * download, on return. Every slot is required unless marked optional.
 *
 * Legend: T tokens, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, L layers. */
#ifndef FITM_BACKEND_H
#define FITM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "compute/ops.h"
#include "model/model.h"

typedef struct fitm_backend fitm_backend;
typedef struct fitm_capture fitm_capture;
typedef struct fitm_intervention fitm_intervention;

/* Most spans a capture or an intervention may carry (documents per request are capped far
 * lower by the API). */
#define FITM_FORWARD_MAX_SPANS 4096

/* Attention capture for chosen query rows: the post-softmax probabilities of every layer and
 * head, as full rows and/or as sums over key spans. Only the rows asked for are stored; no
 * T x T matrix is ever kept. */
struct fitm_capture {
    const int64_t *rows;     /* (n_rows) absolute query positions, each in [pos0, pos0 + T),
                                no duplicates                                              */
    int32_t n_rows;
    const fitm_span *spans;  /* (n_spans) key spans to sum over; may overlap; any range     */
    int32_t n_spans;
    float *span_mass;        /* (n_rows, L, H, n_spans) host, or NULL                      */
    float *probs;            /* (n_rows, L, H, probs_stride) host, or NULL: keys [0, row]
                                written (masked keys 0), keys after row set to 0           */
    int64_t probs_stride;    /* >= every row + 1 when probs is set                         */
    bool after_intervention; /* capture the probabilities that multiply V (true) or those
                                before the intervention (false); the same when none        */
    bool add;                /* add into span_mass and probs instead of storing (several
                                passes summed: Attention Buckets); only on a backend with
                                ops->capture_add                                           */
};

/* The intervention (docs/design.md, Method), applied in the chosen layers to every head of
 * every query row at a position >= from_pos: see fitm_ops_intervene. */
struct fitm_intervention {
    const fitm_span *spans;  /* (K) document spans: sorted, disjoint, non-empty           */
    int32_t n_spans;
    const float *alpha;      /* (K) weights, finite and >= 0, sum_k N_k * alpha_k > 0      */
    const uint8_t *layers;   /* (L) nonzero: intervene in that layer; NULL: every layer     */
    int64_t from_pos;
};

/* One output of a matrix product sharing its input with the others of the same call (Q, K, V
 * share the normed activations; gate and up share theirs): y (T, N) = x (T, K) . W^T + bias. */
typedef struct {
    const fitm_weight *w;    /* (N, K)                    */
    const fitm_weight *bias; /* (N) F32, or NULL          */
    float *y;                /* (T, N), row stride N      */
} fitm_mm_out;

/* A mixture of attentions (the position methods of docs/position-methods.md): E probability
 * maps, each from its own rotated queries and keys, mixed per (row, head) by weights:
 * A = sum_e w[t, h, e] softmax_j(scale q_e . k_e + mask). A replaces the plain probabilities
 * everywhere: capture, intervention and the product with V (the V rows are the plain ones). An
 * expert whose weight is 0 for a row adds nothing to it (a backend may skip it); weights of 1
 * and 0 reproduce that expert's attention exactly. */
typedef struct {
    int32_t n_mix;     /* E >= 1                                                          */
    const float *q;    /* (E, T, H, D) each expert's queries                             */
    const float *k;    /* (E, k_stride): expert e's keys of positions [0, pos0 + T) as
                          (pos0 + T, k_heads, D), position j at row j                     */
    int64_t k_stride;  /* floats from one expert's keys to the next                      */
    int32_t k_heads;   /* Hkv (query head h reads key head h / (H / Hkv)) or H (its own) */
    const float *w;    /* (T, H, E) weights, each row's summing to 1                      */
} fitm_attn_mix;

/* One layer's attention for T query rows at positions pos0 .. pos0+T-1.
 * Keys are the positions visible from each row (causal; and within `window` when window > 0:
 * key j is visible from query i iff j <= i and i - j < window). Key j's K/V row is in the
 * prefix arrays when j < own_base (row j), else in the own arrays (row j - own_base); the own
 * arrays already hold the rows of this call's tokens, as F32 or, where kv_half, as fp16 values
 * (fitm_backend_set_kv_half). */
typedef struct {
    int32_t layer;
    int64_t T, pos0;
    int32_t n_head, n_head_kv, head_dim;
    float scale;                 /* scores = q.k * scale                        */
    int64_t window;              /* 0: full causal                              */
    const float *q;              /* (T, H, D), RoPE applied                     */
    float *out;                  /* (T, H, D)                                   */
    const void *k_pre, *v_pre;   /* (own_base, Hkv, D); unused when own_base 0  */
    const void *k_own, *v_own;   /* (rows, Hkv, D)                              */
    int64_t own_base;
    bool kv_half;                /* the four arrays hold fp16 values, not F32   */
    /* Capture (NULL: none). cap_index (host, T entries) maps a row to its index in
     * capture->rows, or -1; n_layer is L, for the output layout. */
    const fitm_capture *capture;
    const int32_t *cap_index;
    int32_t n_layer;
    /* Intervention for this layer (NULL when this layer is not intervened). */
    const fitm_intervention *intervention;
    /* NULL: q and the cached keys as above. Else the mixture replaces q . k (only for a
     * backend with ops->attention_mix). */
    const fitm_attn_mix *mix;
    /* The call's numerics class (matmul's batched). A backend may compute the plain rows (not
     * captured, not intervened, no mixture) of a batched call in arithmetic of its own, as long
     * as a row's result depends only on its query, keys, values and position (the CUDA
     * backend's bfloat16 tensor-core attention); captured and intervened rows, and every row of
     * a call that is not batched, keep the exact one. */
    bool batched;
} fitm_attn_args;

/* One sequence's new K and V rows of one layer on their way into its KV cache
 * (fitm_kv_rows_of fills one): n values each (rows times Hkv * D) from k and v (F32) into the
 * cache's rows at k_dst and v_dst, as F32 or, where half, as fp16 rounded as to_half rounds. */
typedef struct {
    void *k_dst, *v_dst; /* (rows, Hkv, D) in the cache's type */
    const float *k, *v;  /* (rows, Hkv, D)                     */
    int64_t n;
    bool half;
} fitm_kv_rows;

typedef struct {
    const char *name;
    void (*destroy)(fitm_backend *b);
    /* Sizes every later call stays within: T rows per call, keys per attention row, and the
     * longest weight row (K). May be called again with larger values. */
    fitm_status (*reserve)(fitm_backend *b, int64_t max_tokens, int64_t max_keys, int64_t max_k,
                           fitm_err *err);
    void *(*alloc)(fitm_backend *b, size_t n_bytes); /* zeroed (for the ops that follow:
                                                        in stream order); NULL on failure */
    void (*free)(fitm_backend *b, void *p);          /* NULL is a no-op          */
    void (*upload)(fitm_backend *b, void *dst, const void *src_host, size_t n_bytes);
    void (*download)(fitm_backend *b, void *dst_host, const void *src, size_t n_bytes);
    /* dst = src, both backend memory, not overlapping (a batched call's K/V rows into each
     * sequence's cache). */
    void (*copy)(fitm_backend *b, void *dst, const void *src, size_t n_bytes);
    /* Optional, with kv_half: dst (n fp16 values) = src (n F32) rounded to nearest even, and
     * dst (n F32) = src (n fp16) exactly; both backend memory, not overlapping. */
    void (*to_half)(fitm_backend *b, void *dst, const float *src, int64_t n);
    void (*from_half)(fitm_backend *b, float *dst, const void *src, int64_t n);
    /* Optional: the n stores r[0..n) of one layer (a call's sequences), with the bits of
     * copy (F32) or to_half (half) of each r[i].k and r[i].v into its destination, as one job
     * (NULL: the driver stores each sequence's rows with fitm_kv_store). No destination
     * overlaps another or a source; half stores only on a backend with kv_half. */
    void (*kv_store_many)(fitm_backend *b, const fitm_kv_rows *r, int n);
    /* Optional: called by every fitm_forward_create, before the forward's first pass (e.g.
     * upload weights, or repack them); the backend may keep what it makes for one model at a
     * time, for as long as a forward that prepared it lives. */
    fitm_status (*prepare)(fitm_backend *b, const fitm_model *m, fitm_err *err);
    /* Optional: called by fitm_forward_destroy of a forward whose prepare succeeded. */
    void (*release)(fitm_backend *b, const fitm_model *m);
    /* Optional (backends whose ops can fail, e.g. on a device): waits for the ops so far and
     * reports the first failure among them since the last call (FITM_ERR_BACKEND, NOMEM, ...)
     * with a message, then forgets it unless the device is lost for good. */
    fitm_status (*status)(fitm_backend *b, fitm_err *err);

    /* x (T, C) = rows ids (host, T) of w, times scale. */
    void (*embed)(fitm_backend *b, const fitm_weight *w, const int32_t *ids, int64_t T,
                  float scale, float *x);
    /* batched: the driver's numerics class for this call (see fitm_forward_path). Within one
     * class a backend must compute each row identically whatever T is; the CPU backend runs
     * quantized weights through dequantized tiles when batched, through quantized dot
     * products with Q8 activations otherwise. */
    void (*matmul)(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out *outs,
                   int n_outs, bool batched);
    /* y (rows, n) = rmsnorm of each row of x, times w (n); y may equal x. */
    void (*rmsnorm)(fitm_backend *b, float *y, const float *x, const fitm_weight *w,
                    int64_t rows, int64_t n, float eps);
    /* RoPE on x (T, n_heads, D) in place; cs (T, n_rot/2, 2) from fitm_ops_rope_table. */
    void (*rope)(fitm_backend *b, float *x, int64_t T, int64_t n_heads, int64_t D, int64_t n_rot,
                 const float *cs, bool neox);
    /* y (n) = act(g) * u */
    void (*glu)(fitm_backend *b, float *y, const float *g, const float *u, int64_t n,
                fitm_act act);
    /* Optional: a layer's query and key heads before attention, in place: each head vector of
     * q (T, H, D) and k (T, Hkv, D) normed as rmsnorm(b, x, x, norm, rows, D, eps) where its
     * norm (D, F32) is not NULL (Gemma 3's per-head norms), then rotated as rope(b, x, T, heads,
     * D, n_rot, cs, neox): the values of those calls, as one op (a backend may fuse them). */
    void (*qk_rope)(fitm_backend *b, float *q, float *k, int64_t T, int64_t H, int64_t Hkv,
                    int64_t D, int64_t n_rot, const float *cs, bool neox, const fitm_weight *q_norm,
                    const fitm_weight *k_norm, float eps);
    /* Optional, the STEP class only: gu[0].y (T, F) = act(x . Wgate^T) * (x . Wup^T) for gate
     * gu[0] and up gu[1] (no biases): the values of matmul(b, x, T, gu, 2, false) followed by
     * glu(b, gu[0].y, gu[0].y, gu[1].y, T * F, act), as one op (a backend may fuse them);
     * gu[1].y is scratch it may or may not write. */
    void (*matmul_glu)(fitm_backend *b, const float *x, int64_t T, const fitm_mm_out gu[2],
                       fitm_act act);
    /* y (n) += x */
    void (*add)(fitm_backend *b, float *y, const float *x, int64_t n);
    /* x (n) = cap * tanh(x / cap) */
    void (*softcap)(fitm_backend *b, float *x, int64_t n, float cap);
    /* top (rows, k) host = fitm_ops_topk of each row of x (rows, n), 1 <= k <= FITM_TOP_MAX,
     * k <= n: a sampler's candidates, so decoding copies k entries of a row to the host
     * instead of n (Gemma 3: 64 of 262144). */
    void (*topk)(fitm_backend *b, const float *x, int64_t rows, int64_t n, int32_t k,
                 fitm_top *top);
    /* Optional: lp (rows, n_pick) host = fitm_ops_logprob of each row of x (rows, n) at its
     * n_pick ids, pick (rows, n_pick) host, each in [0, n), 1 <= n_pick <= FITM_PICK_MAX: a
     * scored row's log-probabilities, so rows * n_pick doubles leave the backend instead of
     * rows * n floats (Gemma 3: 8 bytes of a 1 MiB row for a query-likelihood token). The CPU
     * backend gives fitm_ops_logprob's values bit for bit; a device may sum exponentials of its own
     * in another order, within the bound its backend states. NULL: the forward driver
     * downloads the rows and runs fitm_ops_logprob on the host. */
    void (*logprob)(fitm_backend *b, const float *x, int64_t rows, int64_t n,
                    const int32_t *pick, int32_t n_pick, double *lp);
    void (*attention)(fitm_backend *b, const fitm_attn_args *a);
    /* The n calls attention(b, &a[i]) of one layer of a step of several sequences, with the
     * same results, as one job (optional: NULL, and the driver makes the n calls). No two
     * calls write the same memory: their outputs, captures and caches are disjoint, and none
     * has a mixture (built in shared scratch) or a capture that adds (capture->add). The CPU
     * backend runs the calls on its threads at once, each reading its K and V rows once. */
    void (*attention_many)(fitm_backend *b, const fitm_attn_args *a, int n);
    /* Whether attention takes a->mix (the position methods); a backend without it answers
     * those requests with FITM_ERR_UNSUPPORTED (forward.c). */
    bool attention_mix;
    /* Whether attention honors capture->add (Attention Buckets sums its passes' captures in
     * the caller's arrays); a backend without it answers attention_buckets with
     * FITM_ERR_UNSUPPORTED (forward.c). */
    bool capture_add;
    /* Whether attention reads fp16 K/V caches (fitm_attn_args.kv_half), with to_half and
     * from_half set. */
    bool kv_half;
} fitm_backend_ops;

struct fitm_backend {
    const fitm_backend_ops *ops;
    bool kv_half; /* KV caches created from now on hold fp16 values (fitm_backend_set_kv_half) */
};

/* Makes the KV caches created on b from now on hold K and V as fp16 (half) or F32 values:
 * half the memory and half the bytes a decode step's attention reads, for K and V rounded
 * to fp16 (as llama.cpp's default cache holds them). Fails with FITM_ERR_UNSUPPORTED when
 * half is asked of a backend without it (ops->kv_half). */
fitm_status fitm_backend_set_kv_half(fitm_backend *b, bool half, fitm_err *err);

/* The CPU backend: BLAS and quantized dot products over n_threads threads (the caller's
 * included). *out is NULL on failure. */
fitm_status fitm_backend_cpu_create(fitm_backend **out, int n_threads, fitm_err *err);

/* Destroys any backend. NULL is a no-op. */
void fitm_backend_destroy(fitm_backend *b);

#endif
