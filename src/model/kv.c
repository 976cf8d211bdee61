#include "model/kv.h"

#include <stdlib.h>

struct fitm_kv {
    fitm_backend *b;
    int32_t n_layer, n_head_kv, head_dim;
    int64_t n_rows;
    int64_t pos_base, pos_end;
    size_t row_floats;   /* Hkv * D */
    size_t n_bytes;
    float *mem;          /* L blocks of K (n_rows, Hkv, D) then V (n_rows, Hkv, D) */
};

fitm_status fitm_kv_create(fitm_kv **out, fitm_backend *b, const fitm_model_config *c,
                           int64_t n_rows, fitm_err *err)
{
    *out = NULL;
    if (n_rows < 1 || n_rows > ((int64_t)1 << 31))
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache rows %lld out of range",
                            (long long)n_rows);
    size_t row_floats = (size_t)c->n_head_kv * (size_t)c->head_dim;
    /* Sizes are bounded by the loader (dims <= 2^20, L <= 512) and n_rows <= 2^31, but the
     * product can still exceed size_t on 32-bit hosts: check. */
    double total = (double)row_floats * (double)n_rows * 2.0 * (double)c->n_layer * sizeof(float);
    if (total > (double)SIZE_MAX / 2)
        return fitm_err_set(err, FITM_ERR_LIMIT, "KV cache of %lld rows is too large",
                            (long long)n_rows);
    fitm_kv *kv = calloc(1, sizeof *kv);
    if (!kv)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the KV cache");
    kv->b = b;
    kv->n_layer = c->n_layer;
    kv->n_head_kv = c->n_head_kv;
    kv->head_dim = c->head_dim;
    kv->n_rows = n_rows;
    kv->row_floats = row_floats;
    kv->n_bytes = (size_t)total;
    kv->mem = b->ops->alloc(b, kv->n_bytes);
    if (!kv->mem) {
        free(kv);
        return fitm_err_set(err, FITM_ERR_NOMEM, "cannot allocate a KV cache of %.1f MiB",
                            total / (1024.0 * 1024.0));
    }
    *out = kv;
    return FITM_OK;
}

void fitm_kv_destroy(fitm_kv *kv)
{
    if (!kv)
        return;
    kv->b->ops->free(kv->b, kv->mem);
    free(kv);
}

fitm_status fitm_kv_rebase(fitm_kv *kv, int64_t pos_base, fitm_err *err)
{
    if (pos_base < 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache base position %lld is negative",
                            (long long)pos_base);
    kv->pos_base = pos_base;
    kv->pos_end = pos_base;
    return FITM_OK;
}

void fitm_kv_truncate(fitm_kv *kv, int64_t pos_end)
{
    if (pos_end < kv->pos_base)
        pos_end = kv->pos_base;
    if (pos_end < kv->pos_end)
        kv->pos_end = pos_end;
}

int64_t fitm_kv_n_rows(const fitm_kv *kv)
{
    return kv->n_rows;
}

int64_t fitm_kv_pos_base(const fitm_kv *kv)
{
    return kv->pos_base;
}

int64_t fitm_kv_pos_end(const fitm_kv *kv)
{
    return kv->pos_end;
}

size_t fitm_kv_bytes(const fitm_kv *kv)
{
    return kv->n_bytes;
}

float *fitm_kv_k(const fitm_kv *kv, int32_t l)
{
    return kv->mem + (size_t)l * 2 * (size_t)kv->n_rows * kv->row_floats;
}

float *fitm_kv_v(const fitm_kv *kv, int32_t l)
{
    return fitm_kv_k(kv, l) + (size_t)kv->n_rows * kv->row_floats;
}

int fitm_kv_fits(const fitm_kv *kv, const fitm_model_config *c)
{
    return kv->n_layer == c->n_layer && kv->n_head_kv == c->n_head_kv &&
           kv->head_dim == c->head_dim;
}

void fitm_kv_set_end(fitm_kv *kv, int64_t pos_end)
{
    kv->pos_end = pos_end;
}
