#include "model/kv.h"

#include <stdlib.h>

struct fitm_kv {
    fitm_backend *b;
    int32_t n_layer, n_head_kv, head_dim;
    int64_t n_rows;
    int64_t pos_base, pos_end;
    int32_t layers;      /* the layers every held row was computed in (n_layer: empty) */
    size_t row_floats;   /* Hkv * D values                                          */
    size_t elem;         /* bytes per value: 4 (F32) or 2 (fp16)                    */
    size_t n_bytes;
    unsigned char *mem;  /* L blocks of K (n_rows, Hkv, D) then V (n_rows, Hkv, D) */
    int32_t n_passes;    /* 1 + the passes below (only in pass 0)                   */
    struct fitm_kv *pass[FITM_KV_MAX_PASSES]; /* [1, n_passes): the other passes    */
};

/* fitm_kv_create with the value type given (passes keep their cache's type). */
static fitm_status kv_create(fitm_kv **out, fitm_backend *b, const fitm_model_config *c,
                             int64_t n_rows, bool half, fitm_err *err)
{
    *out = NULL;
    if (n_rows < 1 || n_rows > ((int64_t)1 << 31))
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache rows %lld out of range",
                            (long long)n_rows);
    size_t row_floats = (size_t)c->n_head_kv * (size_t)c->head_dim;
    /* Sizes are bounded by the loader (dims <= 2^20, L <= 512) and n_rows <= 2^31, but the
     * product can still exceed size_t on 32-bit hosts: check. */
    const size_t elem = half ? sizeof(uint16_t) : sizeof(float);
    double total = (double)row_floats * (double)n_rows * 2.0 * (double)c->n_layer * (double)elem;
    if (total > (double)SIZE_MAX / 2)
        return fitm_err_set(err, FITM_ERR_LIMIT, "KV cache of %lld rows is too large",
                            (long long)n_rows);
    fitm_kv *kv = calloc(1, sizeof *kv);
    if (!kv)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the KV cache");
    kv->b = b;
    kv->n_layer = c->n_layer;
    kv->layers = c->n_layer;
    kv->n_head_kv = c->n_head_kv;
    kv->head_dim = c->head_dim;
    kv->n_rows = n_rows;
    kv->row_floats = row_floats;
    kv->elem = elem;
    kv->n_bytes = (size_t)total;
    kv->n_passes = 1;
    kv->mem = b->ops->alloc(b, kv->n_bytes);
    if (!kv->mem) {
        free(kv);
        return fitm_err_set(err, FITM_ERR_NOMEM, "cannot allocate a KV cache of %.1f MiB",
                            total / (1024.0 * 1024.0));
    }
    *out = kv;
    return FITM_OK;
}

fitm_status fitm_kv_create(fitm_kv **out, fitm_backend *b, const fitm_model_config *c,
                           int64_t n_rows, fitm_err *err)
{
    return kv_create(out, b, c, n_rows, b->kv_half, err);
}

void fitm_kv_destroy(fitm_kv *kv)
{
    if (!kv)
        return;
    for (int32_t p = 1; p < kv->n_passes; p++)
        fitm_kv_destroy(kv->pass[p]);
    kv->b->ops->free(kv->b, kv->mem);
    free(kv);
}

fitm_status fitm_kv_rebase(fitm_kv *kv, int64_t pos_base, fitm_err *err)
{
    if (pos_base < 0)
        return fitm_err_set(err, FITM_ERR_INVALID, "KV cache base position %lld is negative",
                            (long long)pos_base);
    for (int32_t p = 0; p < kv->n_passes; p++) {
        fitm_kv *x = fitm_kv_pass(kv, p);
        x->pos_base = pos_base;
        x->pos_end = pos_base;
        x->layers = x->n_layer;
    }
    return FITM_OK;
}

void fitm_kv_truncate(fitm_kv *kv, int64_t pos_end)
{
    if (pos_end < kv->pos_base)
        pos_end = kv->pos_base;
    for (int32_t p = 0; p < kv->n_passes; p++) {
        fitm_kv *x = fitm_kv_pass(kv, p);
        if (pos_end < x->pos_end)
            x->pos_end = pos_end;
        if (x->pos_end == x->pos_base)
            x->layers = x->n_layer;
    }
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
    size_t n = kv->n_bytes;
    for (int32_t p = 1; p < kv->n_passes; p++)
        n += kv->pass[p]->n_bytes;
    return n;
}

void *fitm_kv_k(const fitm_kv *kv, int32_t l)
{
    return kv->mem + (size_t)l * 2 * (size_t)kv->n_rows * kv->row_floats * kv->elem;
}

void *fitm_kv_v(const fitm_kv *kv, int32_t l)
{
    return (unsigned char *)fitm_kv_k(kv, l) + (size_t)kv->n_rows * kv->row_floats * kv->elem;
}

bool fitm_kv_half(const fitm_kv *kv)
{
    return kv->elem == sizeof(uint16_t);
}

size_t fitm_kv_elem_bytes(const fitm_kv *kv)
{
    return kv->elem;
}

fitm_kv_rows fitm_kv_rows_of(const fitm_kv *kv, int32_t l, int64_t row, const float *k,
                             const float *v, int64_t n)
{
    const size_t at = (size_t)row * kv->row_floats * kv->elem;
    return (fitm_kv_rows){
        .k_dst = (unsigned char *)fitm_kv_k(kv, l) + at,
        .v_dst = (unsigned char *)fitm_kv_v(kv, l) + at,
        .k = k,
        .v = v,
        .n = n * (int64_t)kv->row_floats,
        .half = fitm_kv_half(kv),
    };
}

void fitm_kv_store(fitm_kv *kv, int32_t l, int64_t row, const float *k, const float *v,
                   int64_t n)
{
    const fitm_backend_ops *o = kv->b->ops;
    const fitm_kv_rows r = fitm_kv_rows_of(kv, l, row, k, v, n);
    if (r.half) {
        o->to_half(kv->b, r.k_dst, r.k, r.n);
        o->to_half(kv->b, r.v_dst, r.v, r.n);
    } else {
        o->copy(kv->b, r.k_dst, r.k, (size_t)r.n * sizeof(float));
        o->copy(kv->b, r.v_dst, r.v, (size_t)r.n * sizeof(float));
    }
}

void fitm_kv_load_k(const fitm_kv *kv, int32_t l, int64_t row, int64_t n, float *dst)
{
    const unsigned char *src =
        (const unsigned char *)fitm_kv_k(kv, l) + (size_t)row * kv->row_floats * kv->elem;
    const int64_t m = n * (int64_t)kv->row_floats;
    if (fitm_kv_half(kv))
        kv->b->ops->from_half(kv->b, dst, src, m);
    else
        kv->b->ops->copy(kv->b, dst, src, (size_t)m * sizeof(float));
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

int32_t fitm_kv_layers(const fitm_kv *kv)
{
    return kv->layers;
}

void fitm_kv_set_layers(fitm_kv *kv, int64_t pos0, int32_t n_layers)
{
    if (pos0 <= kv->pos_base || n_layers < kv->layers)
        kv->layers = n_layers;
}

int32_t fitm_kv_n_passes(const fitm_kv *kv)
{
    return kv->n_passes;
}

fitm_kv *fitm_kv_pass(const fitm_kv *kv, int32_t p)
{
    return p == 0 ? (fitm_kv *)kv : kv->pass[p];
}

/* Copies positions [0, n) of one pass's rows from src to dst (base 0 both). */
static void copy_rows(fitm_kv *dst, const fitm_kv *src, int64_t n)
{
    const size_t bytes = (size_t)n * src->row_floats * src->elem;
    for (int32_t l = 0; l < src->n_layer; l++) {
        src->b->ops->copy(src->b, fitm_kv_k(dst, l), fitm_kv_k(src, l), bytes);
        src->b->ops->copy(src->b, fitm_kv_v(dst, l), fitm_kv_v(src, l), bytes);
    }
}

fitm_status fitm_kv_passes(fitm_kv *kv, int32_t n_passes, int64_t n_rows, fitm_err *err)
{
    if (n_passes < 1 || n_passes > FITM_KV_MAX_PASSES)
        return fitm_err_set(err, FITM_ERR_INVALID, "%d KV cache passes, limit %d",
                            (int)n_passes, FITM_KV_MAX_PASSES);
    n_rows = n_rows < 1 || n_rows > kv->n_rows ? kv->n_rows : n_rows;
    for (int32_t p = 1; p < n_passes; p++) {
        fitm_kv *old = p < kv->n_passes ? kv->pass[p] : NULL;
        if (old && old->n_rows >= n_rows)
            continue;
        const fitm_model_config c = {.n_layer = kv->n_layer, .n_head_kv = kv->n_head_kv,
                                     .head_dim = kv->head_dim};
        fitm_kv *x = NULL;
        fitm_status s = kv_create(&x, kv->b, &c, n_rows, fitm_kv_half(kv), err);
        if (s != FITM_OK)
            return s;
        x->pos_base = kv->pos_base;
        x->pos_end = kv->pos_base;
        if (old) {
            /* the rows it held (a branch's rows start at its base: row r is pos_base + r) */
            copy_rows(x, old, old->pos_end - old->pos_base);
            x->pos_end = old->pos_end;
            x->layers = old->layers;
            fitm_kv_destroy(old);
        }
        kv->pass[p] = x;
        if (p >= kv->n_passes)
            kv->n_passes = p + 1;
    }
    for (int32_t p = n_passes; p < kv->n_passes; p++) {
        fitm_kv_destroy(kv->pass[p]);
        kv->pass[p] = NULL;
    }
    kv->n_passes = n_passes;
    return FITM_OK;
}

fitm_status fitm_kv_copy(fitm_kv *dst, const fitm_kv *src, int64_t n, fitm_err *err)
{
    if (n < 0 || dst->pos_base != 0 || src->pos_base != 0 || dst->n_passes < src->n_passes ||
        dst->n_layer != src->n_layer || dst->row_floats != src->row_floats ||
        dst->elem != src->elem)
        return fitm_err_set(err, FITM_ERR_INVALID, "KV copy of %lld rows between unlike caches",
                            (long long)n);
    for (int32_t p = 0; p < src->n_passes; p++) {
        fitm_kv *d = fitm_kv_pass(dst, p), *s = fitm_kv_pass(src, p);
        if (n > s->pos_end || n > d->n_rows)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "KV copy of %lld rows: pass %d holds %lld, the target %lld",
                                (long long)n, (int)p, (long long)s->pos_end,
                                (long long)d->n_rows);
    }
    for (int32_t p = 0; p < src->n_passes; p++) {
        copy_rows(fitm_kv_pass(dst, p), fitm_kv_pass(src, p), n);
        fitm_kv_pass(dst, p)->pos_end = n;
        fitm_kv_pass(dst, p)->layers = n > 0 ? fitm_kv_pass(src, p)->layers : src->n_layer;
    }
    return FITM_OK;
}
