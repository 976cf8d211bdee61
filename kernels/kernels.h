/* kernels: the CUDA kernels of the forward pass behind a C ABI (defined in the .cu files here).
 *
 * Every launcher takes device pointers and a stream (a cudaStream_t passed as void *, so C
 * files need no CUDA headers; NULL is the legacy default stream), enqueues its work and
 * returns without synchronising. The int it returns is a cudaError_t value: 0 when the launch
 * was accepted; cudaErrorInvalidValue (1) for arguments that break the contract below, checked
 * before anything is launched; otherwise whatever cudaGetLastError reported after the launch
 * (which may be an earlier asynchronous error on the device). fitm_cuda_status turns it into a
 * fitm_status. Errors inside a kernel surface at the next synchronisation.
 *
 * Every CPU reference lives in src/: fitm_dequant_row (quant.h) for dequantization and the
 * matvec, fitm_ops_* (ops.h) for the rest; tests/test_cuda_kernels.c checks one against the
 * other.
 *
 * Alignment: W, src and x pointers must be 16-byte aligned (cudaMalloc gives 256; carve views
 * at multiples of 16 bytes). Zero-sized work is accepted and launches nothing.
 *
 * Legend: T tokens, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, V vocab;
 * N, K: rows and columns of a weight W (N, K) as stored in GGUF (K contiguous). */
#ifndef FITM_KERNELS_H
#define FITM_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* dtype.h and status.h are C headers without their own guard */
#endif

#include "base/dtype.h"
#include "base/status.h"

/* ---- host helpers (kernels/cuda_util.cu) ---- */

/* Maps a launcher's return code to a status: 0 -> FITM_OK, out of memory -> FITM_ERR_NOMEM,
 * invalid value -> FITM_ERR_INVALID, anything else -> FITM_ERR_BACKEND. For rc != 0 and a
 * non-NULL err, writes "what: cudaErrorName (description)" there. what may be NULL. */
fitm_status fitm_cuda_status(int rc, fitm_err *err, const char *what);

/* "cudaErrorName (description)" of a return code. Never NULL; thread-local storage that the
 * next call from the same thread overwrites. */
const char *fitm_cuda_error_string(int rc);

/* True for errors that leave the CUDA context unusable (illegal address, launch failure,
 * ...): the process must be restarted, so /health should fail from then on. */
bool fitm_cuda_error_is_sticky(int rc);

/* Number of usable CUDA devices; 0 when there is no driver, no device, or the query fails. */
int fitm_cuda_device_count(void);

/* Programmatic launches (common.cuh): 1 when the current device has compute capability 9.0 or
 * later and ran a probe of programmatic launches and device copies on a stream of its own
 * (launched; captured into a graph, instantiated and replayed; captured again, the instance
 * updated with it and replayed) and every read saw the write before it; 0 when it did not (a
 * refusal: errors cleared); minus the error when the probe hit one that loses the context
 * (fitm_cuda_error_is_sticky: the device is unusable, whatever the launches). Leaves nothing
 * behind. */
int fitm_cuda_pdl_probe(void);
/* Makes the launches on stream programmatic (on) or plain, from the next launch on: for the
 * streams of devices where fitm_cuda_pdl_probe returned 1, and taken off before the stream
 * is destroyed. A graph captured before keeps the launches it was captured with. Returns
 * whether they are programmatic now: false for NULL (the legacy default stream) and when the
 * table of such streams (64) is full. */
bool fitm_cuda_set_pdl(void *stream, bool on);
/* Whether the launches on stream are programmatic. */
bool fitm_cuda_pdl(void *stream);

/* ---- tapes: a stream's work kept to be matched and replayed (kernels/cuda_util.cu) ----
 *
 * The work is what the launchers enqueue (every kernel launch: common.cuh, FITM_LAUNCH) and
 * the copies and memsets of fitm_cuda_copy_async and fitm_cuda_memset_async: the CUDA
 * backend's graph replay (backend_cuda.c) records a captured graph's work on a tape, and
 * holds a later pass's work back while it equals a tape's, item for item. Two items are equal
 * when they are the same kernel with the same grid, block, dynamic shared memory and argument
 * bytes, or the same copy (destination, source, size, kind) or memset (destination, value,
 * size); the bytes a copy reads are not compared. A stream has at most one tape at a time, and
 * the thread that drives the stream is the one that starts and stops it. NULL (the legacy
 * default stream) cannot have a tape. */

typedef struct fitm_cuda_tape fitm_cuda_tape;

/* Candidates one fitm_cuda_tape_expect compares with, at most. */
#define FITM_CUDA_TAPE_CANDIDATES 32

/* An empty tape; NULL when out of memory. */
fitm_cuda_tape *fitm_cuda_tape_create(void);
void fitm_cuda_tape_destroy(fitm_cuda_tape *t); /* NULL: no-op */
/* Items on t; 0 when an append to t ran out of memory (t is incomplete then). */
size_t fitm_cuda_tape_length(const fitm_cuda_tape *t);
void fitm_cuda_tape_clear(fitm_cuda_tape *t);
void fitm_cuda_tape_swap(fitm_cuda_tape *a, fitm_cuda_tape *b);

/* From now on stream's work is enqueued as usual and appended to t. False (nothing changes)
 * when the table of streams with a tape is full. */
bool fitm_cuda_tape_record(fitm_cuda_tape *t, void *stream);

/* From now on stream's work is held back, not enqueued: t is cleared, and each item is
 * compared with the next item of every one of the n_cands candidates (1 to
 * FITM_CUDA_TAPE_CANDIDATES) that equalled all the items before it, so candidates that share
 * a beginning (a decode step with and without its logits downloaded) are told apart where
 * they differ. Once an item equals none of them, t holds the items that matched followed by
 * every item since. False (nothing changes) when the table of streams with a tape is full. */
bool fitm_cuda_tape_expect(fitm_cuda_tape *t, void *stream, fitm_cuda_tape *const *cands,
                           int n_cands);

/* While stream's work is held back: the index of the first candidate that every item so far
 * equalled, item for item and as many items, else -1. */
int fitm_cuda_tape_matched(void *stream);

/* Ends the holding back of stream's work, after which t (of fitm_cuda_tape_expect) holds all
 * of it, none of it enqueued (fitm_cuda_tape_run enqueues it). */
void fitm_cuda_tape_unwind(void *stream);

/* Ends whatever stream's tape did; held-back work is dropped. */
void fitm_cuda_tape_stop(void *stream);

/* Enqueues t's items on stream in order, past any tape; the first error (a launch's, or
 * cudaErrorMemoryAllocation for a tape that ran out of memory), after which it stops. */
int fitm_cuda_tape_run(const fitm_cuda_tape *t, void *stream);

/* cudaMemcpyAsync (kind: a cudaMemcpyKind) and cudaMemsetAsync through stream's tape. */
int fitm_cuda_copy_async(void *dst, const void *src, size_t n, int kind, void *stream);
int fitm_cuda_memset_async(void *dst, int value, size_t n, void *stream);

/* ---- dequantization (kernels/dequant.cu) ---- */

/* True for the weight types the dequant and matvec launchers take: F32, F16, BF16, Q4_0,
 * Q5_0, Q8_0, Q4_K, Q5_K, Q6_K. */
bool fitm_cuda_dequant_supported(fitm_dtype t);

/* dst (n) = dequant(src), where src holds n elements of type t stored contiguously (a whole
 * tensor of rows works, since rows are whole blocks). n must be a multiple of t's block size.
 * Matches fitm_dequant_row up to float rounding (the GPU may fuse multiply-adds). */
int fitm_cuda_dequant_f32(fitm_dtype t, const void *src, float *dst, int64_t n, void *stream);

/* As above, rounding each value to IEEE half (round to nearest even; bits in uint16_t) for
 * cuBLAS GemmEx. Values beyond the half range (possible from BF16/F32) become +-inf. */
int fitm_cuda_dequant_f16(fitm_dtype t, const void *src, uint16_t *dst, int64_t n, void *stream);

/* ---- matrix-vector product (kernels/matvec.cu) ---- */

/* y (N) = W (N, K) . x (K), W of type t kept as stored and decoded on the fly, one warp per
 * row, F32 accumulation. x is F32 (not quantized, unlike the CPU's fitm_matvec), so the
 * reference is the double-precision dot of fitm_dequant_row(W[n]) with x. K must be a multiple
 * of t's block size; rows are fitm_dtype_row_bytes(t, K) apart. y must not overlap x or W. */
int fitm_cuda_matvec(fitm_dtype t, const void *W, int64_t N, int64_t K, const float *x, float *y,
                     void *stream);

/* ---- norms and softmax (kernels/norm.cu) ---- */

/* y (T, C) = rmsnorm(x (T, C)) * (w (C) + w_offset), as fitm_ops_rmsnorm. y may equal x
 * (in place) but must not otherwise overlap it. */
int fitm_cuda_rmsnorm(float *y, const float *x, const float *w, float w_offset, int64_t T,
                      int64_t C, float eps, void *stream);

/* x (T, C) += r (T, C), then y = rmsnorm(x) * (w + w_offset): bit for bit fitm_cuda_add (x, r)
 * followed by fitm_cuda_rmsnorm (y, x), in one launch. y may equal x; r must not overlap
 * either. */
int fitm_cuda_add_rmsnorm(float *y, float *x, const float *r, const float *w, float w_offset,
                          int64_t T, int64_t C, float eps, void *stream);

/* A block's post-norm, the residual add and the next norm in one launch (Gemma 3): p (T, C)
 * = rmsnorm(o (T, C)) * (w_post (C) + w_offset), then x (T, C) += p, then y (ny, C) =
 * rmsnorm(x rows [y0, y0 + ny)) * (w (C) + w_offset): bit for bit fitm_cuda_rmsnorm (p, o)
 * followed by fitm_cuda_add (x, p) and fitm_cuda_rmsnorm (y, x + y0 * C) (that is,
 * fitm_cuda_add_rmsnorm (y, x, p) when the rows are all T). 0 <= y0 <= y0 + ny <= T; with ny
 * 0, y and w are not used. p may equal o and y may equal x + y0 * C; no other two of o, p, x
 * and y may overlap. */
int fitm_cuda_norm_add_rmsnorm(float *p, const float *o, const float *w_post, float *x, float *y,
                               const float *w, float w_offset, int64_t T, int64_t y0, int64_t ny,
                               int64_t C, float eps, void *stream);

/* Attention's heads before the scores, in place, in one launch: each head vector of q (T, H,
 * D) and of k (T, Hkv, D) normed as fitm_cuda_rmsnorm norms a row of D with q_w (D) and k_w
 * (D) (+ w_offset), where that weight is not NULL (Gemma 3's per-head norms; NULL: no norm),
 * then RoPE'd as fitm_cuda_rope_table with row t of cs (T, n_rot/2, {cos, sin}): bit for bit
 * those separate launches. n_rot even, in [2, D]; T * (H + Hkv) <= INT32_MAX. q and k must not
 * overlap. */
int fitm_cuda_qk_norm_rope(float *q, float *k, const float *q_w, const float *k_w, float w_offset,
                           int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t n_rot,
                           const float *cs, int neox, float eps, void *stream);

/* In place, each of n_rows rows of x: x[r*ld + 0 .. n) = softmax(that row), as
 * fitm_ops_softmax. ld >= n; elements [n, ld) of a row are not touched. -inf entries are
 * masked (probability 0); a row that is all -inf becomes NaN, as in the reference. */
int fitm_cuda_softmax_rows(float *x, int64_t n_rows, int64_t n, int64_t ld, void *stream);

/* ---- RoPE and gated activations (kernels/ops.cu) ---- */

/* In place RoPE on x viewed as (T, H, D) with row stride ld (>= H*D) between tokens: every
 * head vector x[t*ld + h*D .. + D) has its first n_rot dims rotated with the angles
 * theta_i = position * freq_scale * base^(-2i/n_rot), position = pos0 + (pos ? pos[t] : t),
 * exactly as fitm_ops_rope_table + fitm_ops_rope_apply (for freq_scale 1: fitm_ops_rope); pos
 * is a device array of T int32 or NULL. neox selects the pairing as in fitm_ops_rope. n_rot
 * must be even and in [2, D]. Elements between H*D and ld are not touched. Use H = Hkv for
 * keys. Angles are computed in double precision, as in the reference. */
int fitm_cuda_rope(float *x, int64_t T, int64_t H, int64_t D, int64_t ld, int64_t n_rot,
                   const int32_t *pos, int64_t pos0, float base, float freq_scale, int neox,
                   void *stream);

/* y (n) = silu(g) * u, as fitm_ops_swiglu. y may equal g or u. */
int fitm_cuda_swiglu(float *y, const float *g, const float *u, int64_t n, void *stream);

/* y (n) = gelu_tanh(g) * u, as fitm_ops_geglu. y may equal g or u. */
int fitm_cuda_geglu(float *y, const float *g, const float *u, int64_t n, void *stream);

/* ---- element-wise (kernels/ops.cu) ---- */

/* x (T, C) = rows ids[t] (device, T int32 in [0, rows of W)) of W (rows of C elements of type
 * t, row_bytes apart) times scale, as fitm_dequant_row. C must be a multiple of t's block. */
int fitm_cuda_embed(fitm_dtype t, const void *W, int64_t row_bytes, int64_t C, const int32_t *ids,
                    int64_t T, float scale, float *x, void *stream);

/* y (n) += x (n). */
int fitm_cuda_add(float *y, const float *x, int64_t n, void *stream);

/* y (rows, n) += b (n) on every row. */
int fitm_cuda_add_rows(float *y, const float *b, int64_t rows, int64_t n, void *stream);

/* x (n) = cap * tanh(x / cap). */
int fitm_cuda_softcap(float *x, int64_t n, float cap, void *stream);

/* In place RoPE on x (T, H, D) with the driver's table cs (T, n_rot/2, {cos, sin}) (device),
 * as fitm_ops_rope_apply on every head vector. n_rot even, in [2, D]. */
int fitm_cuda_rope_table(float *x, int64_t T, int64_t H, int64_t D, int64_t n_rot, const float *cs,
                         int neox, void *stream);

/* ---- KV cache rows (kernels/ops.cu) ---- */

/* One sequence's new K and V rows on their way into its KV cache (fitm_cuda_kv_store_many): n
 * values each (its rows times Hkv * D) of k and of v (F32) into k_dst and v_dst, copied
 * (half 0) or rounded to fp16 (half 1; bits as uint16_t) to nearest even as fitm_fp32_to_fp16
 * (compute/quant.h) rounds, NaN quieted with the top of its payload kept, bit for bit. */
typedef struct {
    void *k_dst, *v_dst;
    const float *k, *v;
    int64_t n;
    int32_t half;
} fitm_cuda_kv_rows;

#define FITM_CUDA_KV_ROWS_MAX 64

/* The n stores r[0..n) (1 <= n <= FITM_CUDA_KV_ROWS_MAX) as one launch: r (host) is checked
 * and sizes the grid, the kernel reads r_dev, the same descriptors in device memory (staged
 * by the caller in stream order), so the launch's arguments do not change from one decode
 * step to the next while the rows it writes do (a replayed graph: docs/cuda-backend.md). A
 * layer's K and V rows of every sequence of a step go into their caches with one launch
 * instead of two copies per sequence. No destination may overlap another destination or a
 * source. Pointers need only their elements' alignment (4 bytes, 2 for an fp16
 * destination): a row may start anywhere. */
int fitm_cuda_kv_store_many(const fitm_cuda_kv_rows *r, const fitm_cuda_kv_rows *r_dev, int n,
                            void *stream);

/* ---- selection (kernels/topk.cu) ---- */

#define FITM_CUDA_TOPK_MAX 64
/* Most candidates a row's sort takes (docs/cuda-backend.md, "Sampling": a row of real logits
 * has about a hundred); a row with more is selected by the slower exact fallback. */
#define FITM_CUDA_TOPK_CAP 4096
/* A row longer than that is cut in chunks of ceil(n / FITM_CUDA_TOPK_CHUNKS) entries. */
#define FITM_CUDA_TOPK_CHUNKS 256

/* Device scratch (bytes) fitm_cuda_topk needs for these sizes. */
size_t fitm_cuda_topk_scratch(int64_t rows, int64_t n, int32_t k);

/* val, id (rows, k) (device) = the k first entries of each row of x (rows, n; row stride ld)
 * in fitm_ops_topk's order (larger value first, equal values lower index first, NaN after
 * every number): the same list as the reference, ties included. 1 <= k <=
 * min(n, FITM_CUDA_TOPK_MAX), n < 2^31, rows <= 65535; scratch holds
 * fitm_cuda_topk_scratch(rows, n, k) bytes, and afterwards begins with rows int32: each row's
 * number of candidates (entries no later than the threshold, kernels/topk.cu; above
 * FITM_CUDA_TOPK_CAP the row took the fallback). Three launches whatever the data. */
int fitm_cuda_topk(const float *x, int64_t rows, int64_t n, int64_t ld, int32_t k, void *scratch,
                   float *val, int32_t *id, void *stream);

/* ---- log-probabilities (kernels/logprob.cu) ---- */

#define FITM_CUDA_PICK_MAX 16

/* lp (rows, n_pick) (device) = fitm_ops_logprob of each row of x (rows, n) at its ids pick
 * (rows, n_pick) (device, each in [0, n)): the same maximum, the sum of exponentials in
 * double in another order, so each value is within (2n + 8) 2^-53 + 2^-50 (|lp| + ln n) of
 * the host's (Gemma 3's n = 262144: about 6e-11). 1 <= n_pick <= FITM_CUDA_PICK_MAX,
 * 1 <= n < 2^31, rows < 2^31. */
int fitm_cuda_logprob(const float *x, int64_t rows, int64_t n, const int32_t *pick,
                      int32_t n_pick, double *lp, void *stream);

/* ---- matrix products (kernels/matvec.cu) ---- */

/* y (T, N) = x (T, K) . W^T, each row as fitm_cuda_matvec computes it (so a row's result does
 * not depend on T). Same conditions as fitm_cuda_matvec; T <= 65535. */
int fitm_cuda_matmul_rows(fitm_dtype t, const void *W, int64_t N, int64_t K, const float *x,
                          int64_t T, float *y, void *stream);

#define FITM_CUDA_MM_MAX_OUTS 3

/* n (1 to FITM_CUDA_MM_MAX_OUTS) products of one input in one launch: y[i] (T, N[i]) = x (T,
 * K) . W[i]^T, each as fitm_cuda_matmul_rows computes it (bit for bit those n launches): a
 * decode step's Q, K and V. Every W[i] of type t with K columns; the other conditions are
 * fitm_cuda_matmul_rows's, for each. */
int fitm_cuda_matmul_rows_n(fitm_dtype t, int n, const void *const *W, const int64_t *N, int64_t K,
                            const float *x, int64_t T, float *const *y, void *stream);

/* The feed-forward block's gate and up products and its gated activation in one launch: y (T,
 * N) = act(x . Wg^T) * (x . Wu^T), act gelu_tanh (gelu != 0) or silu, each product as
 * fitm_cuda_matmul_rows computes it and the activation as fitm_cuda_geglu / fitm_cuda_swiglu:
 * bit for bit those three launches. Wg and Wu have the same type and shape (N, K); the other
 * conditions are fitm_cuda_matmul_rows's. y must not overlap x, Wg or Wu. */
int fitm_cuda_matmul_glu(fitm_dtype t, const void *Wg, const void *Wu, int64_t N, int64_t K,
                         const float *x, int64_t T, int gelu, float *y, void *stream);

/* ---- attention (kernels/attention.cu) ---- */

#define FITM_CUDA_ATTN_MAX_SPANS 4096

/* One layer's attention for T query rows at positions pos0.., as the backend's attention op
 * (model/backend.h, fitm_attn_args) with every array on the device. Spans are
 * {start, end} int64 pairs. Capture outputs are per layer: cap_mass (n_cap_rows, H,
 * cap_n_spans), cap_probs (n_cap_rows, H, cap_probs_stride), indexed by cap_index (T; -1: row
 * not captured; NULL: no capture). iv_n_spans 0: no intervention. head_dim <= 256. */
typedef struct {
    int64_t T, pos0, own_base, window;
    int32_t n_head, n_head_kv, head_dim;
    float scale;
    const float *q;
    float *out;
    const float *k_pre, *v_pre, *k_own, *v_own;
    const int32_t *cap_index;
    const int64_t *cap_spans;
    int32_t cap_n_spans;
    int cap_after;
    float *cap_mass, *cap_probs;
    int64_t cap_probs_stride;
    const int64_t *iv_spans;
    const float *iv_alpha;
    int32_t iv_n_spans;
    int64_t iv_from_pos;
    /* A mixture of mix_n attentions (fitm_attn_mix of model/backend.h; 0: plain): expert e's
     * queries at mix_q + e * T * H * D as (T, H, D), its keys of positions [0, pos0 + T) at
     * mix_k + e * mix_k_stride as (pos0 + T, mix_k_heads, D), the weights mix_w (T, H,
     * mix_n). The mixed probabilities replace the plain ones everywhere. */
    int32_t mix_n, mix_k_heads;
    const float *mix_q, *mix_k, *mix_w;
    int64_t mix_k_stride;
    /* The call's new rows read from where they are on their way into the cache (NULL: none;
     * one-row kernels only): keys j >= new_base at k_new / v_new + (j - new_base) rows, the
     * rows a KV store of the same launch writes (fitm_cuda_attention_many). */
    int64_t new_base;
    const float *k_new, *v_new;
} fitm_cuda_attn;

#define FITM_CUDA_ATTN_MAX_MIX 64

/* Every row of the call: fitm_cuda_attention_rows(a, 0, a->T, stream). */
int fitm_cuda_attention(const fitm_cuda_attn *a, void *stream);

/* Rows [i0, i1) of the call a (0 <= i0 <= i1 <= T), one block of 128 threads per (row, head),
 * whatever the row asks (capture, intervention, mixture). The other rows are not touched. */
int fitm_cuda_attention_rows(const fitm_cuda_attn *a, int64_t i0, int64_t i1, void *stream);

/* Rows [i0, i1) of the call a, which must all be plain: no capture (cap_index NULL), no
 * mixture, and no intervened row (pos0 + i1 <= iv_from_pos when iv_n_spans > 0); anything else
 * is refused with cudaErrorInvalidValue. Each row's output is bit for bit the one
 * fitm_cuda_attention_rows gives it, computed by blocks of consecutive rows and the heads of
 * one KV group that read each key and value once per block (kernels/attention.cu, "Tiled
 * rows"); which of the two computed a row never shows. */
int fitm_cuda_attention_tiled(const fitm_cuda_attn *a, int64_t i0, int64_t i1, void *stream);

/* Rows [i0, i1) of the call a on the tensor cores (kernels/attention.cu, "Tensor-core rows"):
 * the BATCH class's plain rows with gpu_weights = bf16. Q, K, V and the probabilities are
 * rounded to bfloat16 (as fitm_cuda_to_bf16 rounds), products summed in F32, the softmax in
 * F32. The rows must be plain, as for fitm_cuda_attention_tiled (else cudaErrorInvalidValue).
 * A row's result depends only on its query, its visible keys and values and its position: not
 * on i0, i1, T or the rows beside it (so prefix reuse and split calls keep their bits); they
 * are not the bits the two F32 kernels give. Any head_dim up to 256. */
int fitm_cuda_attention_bf16(const fitm_cuda_attn *a, int64_t i0, int64_t i1, void *stream);

/* Rows per block of fitm_cuda_attention_tiled for a model of these head counts (16 (row,
 * head) pairs: 4 rows of Gemma 3's 4 query heads per KV head, 16 rows without GQA); a run of
 * plain rows shorter than this fills its block only partly. 0 for head counts a call refuses. */
int fitm_cuda_attention_tile_rows(int32_t n_head, int32_t n_head_kv);

/* The n calls a[0..n) (host copies, checked as fitm_cuda_attention checks one) as one launch,
 * each block reading its call from a_dev (the same n structs in device memory): the
 * sequences of a decode step side by side instead of one launch after another. Every call
 * has the same n_head; a row's result is the one fitm_cuda_attention gives. n <= 65535.
 * kv_n > 0: the launch also does the KV stores kv[0..kv_n) (host copies checked as
 * fitm_cuda_kv_store_many checks them; the kernel reads kv_dev), bit for bit that launch,
 * which saves a decode step's layer one launch. The launch's blocks run in no order, so no
 * call may read what a store writes: a call whose new rows are being stored reads them from
 * the store's source (k_new, v_new). kv_n 0: kv and kv_dev unused. */
int fitm_cuda_attention_many(const fitm_cuda_attn *a, const fitm_cuda_attn *a_dev, int n,
                             const fitm_cuda_kv_rows *kv, const fitm_cuda_kv_rows *kv_dev,
                             int kv_n, void *stream);

/* ---- bfloat16 operands (kernels/bf16.cu, kernels/gemm.cu) ---- */

/* dst (rows_out, n) = x (rows, n) rounded to bfloat16 (round to nearest even; bits in
 * uint16_t; overflow to +-inf, NaN stays NaN), rows [rows, rows_out) of dst set to 0: the BATCH
 * class's tensor-core operands: a weight, dequantized to F32 first, and the activations a
 * product multiplies (fitm_cuda_gemm_bf16). rows_out >= rows; x and dst must not overlap.
 * Unlike the other launchers, x and dst need only their elements' alignment (4 and 2 bytes):
 * a call's rows may start anywhere in the forward's activations. */
int fitm_cuda_to_bf16(const float *x, int64_t rows, int64_t n, int64_t rows_out, uint16_t *dst,
                      void *stream);

/* n (1 to FITM_CUDA_MM_MAX_OUTS) products of one input on the tensor cores, in one launch:
 * y[i] (T, N[i]) = x (T, K) . W[i]^T, x and W[i] (N[i], K) bfloat16 bits (as fitm_cuda_to_bf16
 * writes them), products summed in F32: the BATCH class with gpu_weights = bf16. An element's
 * arithmetic depends only on its row of x and its row of W[i] (fixed K order, no split-K), so a
 * row's result does not depend on T or on the rows beside it. Pointers need only their
 * elements' alignment (x and W[i] 2 bytes, y[i] 4); rows that start 16-byte aligned (K % 8 ==
 * 0, every base 16-byte aligned) are staged by 16-byte asynchronous copies, others element by
 * element (the same results). y[i] must not overlap x or another y. Any T; N[i] may differ. */
int fitm_cuda_gemm_bf16(int n, const uint16_t *const *W, const int64_t *N, int64_t K,
                        const uint16_t *x, int64_t T, float *const *y, void *stream);

/* The tile shapes of fitm_cuda_gemm_bf16 (kernels/gemm.cu): AUTO is its choice, the largest
 * whose launch fills the card. */
enum {
    FITM_CUDA_GEMM_AUTO = 0,
    FITM_CUDA_GEMM_64X32 = 1,
    FITM_CUDA_GEMM_64X64 = 2,
    FITM_CUDA_GEMM_128X128 = 3
};

/* fitm_cuda_gemm_bf16 in the tile shape named (a FITM_CUDA_GEMM_* value; anything else is
 * refused with cudaErrorInvalidValue): the same bits in every shape, which lets the tests
 * check each on calls small enough for the emulator and ThreadSanitizer. */
int fitm_cuda_gemm_bf16_shape(int shape, int n, const uint16_t *const *W, const int64_t *N,
                              int64_t K, const uint16_t *x, int64_t T, float *const *y,
                              void *stream);

#ifdef __cplusplus
}
#endif

#endif
