/* kv: the KV cache. For every layer, K and V rows of (Hkv, D) values, one row per position,
 * in backend memory: F32, or fp16 in a cache created while its backend's kv_half was set
 * (fitm_backend_set_kv_half; a cache keeps its type, and so do its passes).
 *
 * A cache holds a contiguous run of positions [pos_base, pos_end): row r is position
 * pos_base + r. An ordinary sequence has pos_base 0. A branch (fitm_kv_rebase) starts at
 * pos_base > 0 and is used together with a base cache that holds positions [0, pos_base):
 * the forward pass reads the base's rows read-only and writes only into the branch, so any
 * number of branches can share one cached prefix without copying it (the calibration's
 * reference passes).
 *
 * Legend: L layers, Hkv KV heads, D head dim. */
#ifndef FITM_KV_H
#define FITM_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "model/backend.h"
#include "model/model.h"

typedef struct fitm_kv fitm_kv;

/* A cache of n_rows rows for the model described by c, empty at pos_base 0. The backend must
 * outlive the cache. *out is NULL on failure. */
fitm_status fitm_kv_create(fitm_kv **out, fitm_backend *b, const fitm_model_config *c,
                           int64_t n_rows, fitm_err *err);

/* NULL is a no-op. */
void fitm_kv_destroy(fitm_kv *kv);

/* Empties the cache and makes it start at pos_base (0 for an ordinary sequence). Fails when
 * pos_base is negative. */
fitm_status fitm_kv_rebase(fitm_kv *kv, int64_t pos_base, fitm_err *err);

/* Forgets positions >= pos_end (no-op when the cache ends before that; clamped to pos_base). */
void fitm_kv_truncate(fitm_kv *kv, int64_t pos_end);

int64_t fitm_kv_n_rows(const fitm_kv *kv);
int64_t fitm_kv_pos_base(const fitm_kv *kv);
int64_t fitm_kv_pos_end(const fitm_kv *kv);
size_t fitm_kv_bytes(const fitm_kv *kv);

/* Layer l's K and V rows, each (n_rows, Hkv, D), of fitm_kv_elem_bytes each. */
void *fitm_kv_k(const fitm_kv *kv, int32_t l);
void *fitm_kv_v(const fitm_kv *kv, int32_t l);

/* Whether the cache holds fp16 values (else F32), and so the bytes of one value. */
bool fitm_kv_half(const fitm_kv *kv);
size_t fitm_kv_elem_bytes(const fitm_kv *kv);

/* Layer l's K and V rows [row, row + n) = k and v (n rows of Hkv * D F32 values each, backend
 * memory), stored in the cache's type (rounded to nearest even when fp16). */
void fitm_kv_store(fitm_kv *kv, int32_t l, int64_t row, const float *k, const float *v,
                   int64_t n);

/* The store fitm_kv_store(kv, l, row, k, v, n) makes, as a descriptor for
 * ops->kv_store_many (several sequences' stores in one job). */
fitm_kv_rows fitm_kv_rows_of(const fitm_kv *kv, int32_t l, int64_t row, const float *k,
                             const float *v, int64_t n);

/* dst (n rows of Hkv * D F32 values, backend memory) = layer l's K rows [row, row + n),
 * exactly. */
void fitm_kv_load_k(const fitm_kv *kv, int32_t l, int64_t row, int64_t n, float *dst);

/* Whether the cache was made for c's shape (layers, KV heads, head size). */
int fitm_kv_fits(const fitm_kv *kv, const fitm_model_config *c);

/* Marks positions [pos_base, pos_end) as held; for the forward pass, which has written them.
 * This pass only (the forward pass sets each pass it writes). */
void fitm_kv_set_end(fitm_kv *kv, int64_t pos_end);

/* Layers [0, fitm_kv_layers) hold every held row; the layers from there on may hold rows of
 * other prompts (a forward call that stopped early, fitm_forward_opts.n_layers, wrote none
 * of them). The model's layer count for an empty cache. */
int32_t fitm_kv_layers(const fitm_kv *kv);

/* For the forward pass, after writing rows from pos0 on in layers [0, n_layers): the cache
 * holds n_layers when pos0 is its base, else the fewer of n_layers and what it held. */
void fitm_kv_set_layers(fitm_kv *kv, int64_t pos0, int32_t n_layers);

/* Passes (Attention Buckets, docs/position-methods.md): each pass rotates with bases of its
 * own, so its rows differ and it needs a cache of its own. Pass 0 is kv itself; passes 1..
 * are caches that follow kv's positions (rebase and truncate apply to every pass).
 * fitm_kv_bytes counts them all. */
#define FITM_KV_MAX_PASSES 8

/* Makes kv hold n_passes passes in [1, FITM_KV_MAX_PASSES] (passes beyond are freed), each
 * with at least min(n_rows, kv's rows) rows (n_rows < 1: kv's rows). A pass with fewer rows
 * is replaced by a larger one holding the same rows. On failure kv keeps the passes it had. */
fitm_status fitm_kv_passes(fitm_kv *kv, int32_t n_passes, int64_t n_rows, fitm_err *err);

int32_t fitm_kv_n_passes(const fitm_kv *kv);

/* Pass p (0: kv itself), p < fitm_kv_n_passes(kv). */
fitm_kv *fitm_kv_pass(const fitm_kv *kv, int32_t p);

/* Copies positions [0, n) of every pass of src into dst's passes (dst: base 0, at least as
 * many passes, each with room for n rows) and marks dst holding [0, n). */
fitm_status fitm_kv_copy(fitm_kv *dst, const fitm_kv *src, int64_t n, fitm_err *err);

#endif
