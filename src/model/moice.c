#include "model/moice.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/sha256.h"

#define PREFIX "fitm-moice."

typedef struct {
    const float *bases, *gate_a, *gate_b, *gate_out; /* into the file's data, F32 */
} moice_layer;

struct fitm_moice {
    fitm_gguf *g;
    fitm_moice_base base;
    int32_t n_expert, top_k;
    moice_layer *layers; /* (base.block_count); bases NULL where a layer has no routers */
};

void fitm_moice_destroy(fitm_moice *mo)
{
    if (!mo)
        return;
    fitm_gguf_close(mo->g);
    free(mo->layers);
    free(mo);
}

static fitm_status get_str(const fitm_gguf *g, const char *key, char *out, size_t cap,
                           fitm_err *err)
{
    fitm_gguf_str s;
    fitm_status st = fitm_gguf_get_str(g, key, &s, err);
    if (st == FITM_ERR_NOT_FOUND)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' is missing", key);
    if (st)
        return st;
    if (s.len >= cap || memchr(s.ptr, 0, s.len))
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' is not a short string", key);
    memcpy(out, s.ptr, s.len);
    out[s.len] = 0;
    return FITM_OK;
}

static fitm_status get_u32(const fitm_gguf *g, const char *key, uint32_t *out, fitm_err *err)
{
    fitm_status st = fitm_gguf_get_u32(g, key, out, err);
    if (st == FITM_ERR_NOT_FOUND)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '%s' is missing", key);
    return st;
}

/* Tensor name of layer l, checked F32 with the C-order shape d0 x d1 x d2 (d0 = 0: 1-D d2). */
static fitm_status get_tensor(const fitm_gguf *g, int32_t l, const char *what, int64_t d0,
                              int64_t d1, int64_t d2, const float **out, fitm_err *err)
{
    char name[96];
    snprintf(name, sizeof name, "moice.blk.%d.%s", (int)l, what);
    const fitm_gguf_tensor *t = fitm_gguf_find_tensor(g, name);
    if (!t)
        return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s' is missing", name);
    const int32_t nd = d0 ? 3 : 1;
    const bool ok = t->type == FITM_DTYPE_F32 && t->n_dims == nd &&
                    (nd == 1 ? t->ne[0] == d2
                             : t->ne[0] == d2 && t->ne[1] == d1 && t->ne[2] == d0);
    if (!ok)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': want F32 of shape (%lld, %lld, %lld) in C order", name,
                            (long long)d0, (long long)d1, (long long)d2);
    if ((uintptr_t)t->data % sizeof(float))
        return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s' is not 4-byte aligned", name);
    *out = t->data;
    for (int64_t i = 0; i < t->n_elems; i++)
        if (!isfinite((*out)[i]))
            return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s' holds a non-finite value",
                                name);
    return FITM_OK;
}

static fitm_status load(fitm_moice *mo, fitm_err *err)
{
    const fitm_gguf *g = mo->g;
    char arch[32];
    fitm_status st = get_str(g, "general.architecture", arch, sizeof arch, err);
    if (st)
        return st;
    if (strcmp(arch, "fitm-moice"))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "not a MoICE sidecar (general.architecture is '%s', want fitm-moice)",
                            arch);
    fitm_moice_base *b = &mo->base;
    uint32_t n, k;
    if ((st = get_str(g, PREFIX "base.architecture", b->architecture, sizeof b->architecture,
                      err)) ||
        (st = get_str(g, PREFIX "base.sha256", b->sha256, sizeof b->sha256, err)) ||
        (st = get_u32(g, PREFIX "base.block_count", &b->block_count, err)) ||
        (st = get_u32(g, PREFIX "base.head_count", &b->head_count, err)) ||
        (st = get_u32(g, PREFIX "base.head_count_kv", &b->head_count_kv, err)) ||
        (st = get_u32(g, PREFIX "base.key_length", &b->key_length, err)) ||
        (st = get_u32(g, PREFIX "expert_count", &n, err)) ||
        (st = get_u32(g, PREFIX "top_k", &k, err)))
        return st;
    if (strlen(b->sha256) != 64 || strspn(b->sha256, "0123456789abcdef") != 64)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '" PREFIX "base.sha256' is not 64 "
                                                  "lowercase hex digits");
    if (b->block_count < 1 || b->block_count > FITM_MODEL_MAX_LAYERS || b->head_count < 1 ||
        b->head_count > 4096 || b->key_length < 2 || b->key_length > 65536 ||
        b->head_count_kv < 1 || b->head_count % b->head_count_kv)
        return fitm_err_set(err, FITM_ERR_FORMAT, "base shape out of range (layers %u, heads "
                                                  "%u/%u, head dim %u)",
                            b->block_count, b->head_count, b->head_count_kv, b->key_length);
    if (n < 1 || n > FITM_MOICE_MAX_EXPERTS)
        return fitm_err_set(err, FITM_ERR_FORMAT, "expert_count %u outside 1..%d", n,
                            FITM_MOICE_MAX_EXPERTS);
    if (k < 1 || k > n)
        return fitm_err_set(err, FITM_ERR_FORMAT, "top_k %u outside 1..%u", k, n);
    mo->n_expert = (int32_t)n;
    mo->top_k = (int32_t)k;
    const void *data;
    uint64_t n_layers;
    st = fitm_gguf_get_arr(g, PREFIX "layers", FITM_GGUF_UINT32, &data, &n_layers, err);
    if (st == FITM_ERR_NOT_FOUND)
        return fitm_err_set(err, FITM_ERR_FORMAT, "key '" PREFIX "layers' is missing");
    if (st)
        return st;
    if (n_layers < 1)
        return fitm_err_set(err, FITM_ERR_FORMAT, "no routed layers");
    mo->layers = calloc(b->block_count, sizeof *mo->layers);
    if (!mo->layers)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    const int64_t H = b->head_count, D = b->key_length;
    int64_t prev = -1;
    for (uint64_t i = 0; i < n_layers; i++) {
        uint32_t l;
        memcpy(&l, (const uint8_t *)data + 4 * i, 4);
        if ((int64_t)l <= prev || l >= b->block_count)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "layers: %u is not ascending or not below block_count %u", l,
                                b->block_count);
        prev = l;
        moice_layer *ml = &mo->layers[l];
        if ((st = get_tensor(g, (int32_t)l, "bases", 0, 0, n, &ml->bases, err)) ||
            (st = get_tensor(g, (int32_t)l, "gate_a", H, n, D, &ml->gate_a, err)) ||
            (st = get_tensor(g, (int32_t)l, "gate_b", H, n, D, &ml->gate_b, err)) ||
            (st = get_tensor(g, (int32_t)l, "gate_out", H, n, n, &ml->gate_out, err)))
            return st;
        for (uint32_t e = 0; e < n; e++)
            if (!(ml->bases[e] > 1.0f))
                return fitm_err_set(err, FITM_ERR_FORMAT, "moice.blk.%u.bases[%u] = %g is not > 1",
                                    l, e, (double)ml->bases[e]);
    }
    return FITM_OK;
}

fitm_status fitm_moice_load(fitm_moice **out, const char *path, fitm_err *err)
{
    *out = NULL;
    fitm_moice *mo = calloc(1, sizeof *mo);
    if (!mo)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory");
    fitm_status st = fitm_gguf_open_copy(&mo->g, path, err);
    if (st == FITM_OK)
        st = load(mo, err);
    if (st) {
        fitm_err_prefix(err, "MoICE sidecar %s", path);
        fitm_moice_destroy(mo);
        return st;
    }
    *out = mo;
    return FITM_OK;
}

fitm_status fitm_moice_model_identity(const fitm_model *m, const char *model_path,
                                      fitm_moice_base *out, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    memset(out, 0, sizeof *out);
    snprintf(out->architecture, sizeof out->architecture, "%s", fitm_arch_name(c->arch));
    out->block_count = (uint32_t)c->n_layer;
    out->head_count = (uint32_t)c->n_head;
    out->head_count_kv = (uint32_t)c->n_head_kv;
    out->key_length = (uint32_t)c->head_dim;
    FILE *f = fopen(model_path, "rb");
    if (!f)
        return fitm_err_set(err, FITM_ERR_IO, "cannot open %s: %s", model_path, strerror(errno));
    static _Thread_local uint8_t buf[1 << 16];
    fitm_sha256 s;
    fitm_sha256_init(&s);
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        fitm_sha256_update(&s, buf, n);
    const bool bad = ferror(f);
    fclose(f);
    if (bad)
        return fitm_err_set(err, FITM_ERR_IO, "cannot read %s", model_path);
    uint8_t digest[32];
    fitm_sha256_final(&s, digest);
    fitm_sha256_hex(digest, out->sha256);
    return FITM_OK;
}

fitm_status fitm_moice_check(const fitm_moice *mo, const fitm_moice_base *base, fitm_err *err)
{
    const fitm_moice_base *b = &mo->base;
    if (strcmp(b->architecture, base->architecture))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "MoICE sidecar base.architecture is '%s', the model's is '%s'",
                            b->architecture, base->architecture);
    const struct {
        const char *name;
        uint32_t have, want;
    } shapes[] = {
        {"block_count", b->block_count, base->block_count},
        {"head_count", b->head_count, base->head_count},
        {"head_count_kv", b->head_count_kv, base->head_count_kv},
        {"key_length", b->key_length, base->key_length},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (shapes[i].have != shapes[i].want)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "MoICE sidecar base.%s is %u, the model's is %u", shapes[i].name,
                                shapes[i].have, shapes[i].want);
    if (strcmp(b->sha256, base->sha256))
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "MoICE sidecar base.sha256 is %s, the model file's is %s (trained "
                            "for another file)",
                            b->sha256, base->sha256);
    return FITM_OK;
}

const fitm_moice_base *fitm_moice_base_of(const fitm_moice *mo) { return &mo->base; }
int32_t fitm_moice_n_experts(const fitm_moice *mo) { return mo->n_expert; }
int32_t fitm_moice_top_k(const fitm_moice *mo) { return mo->top_k; }
const fitm_gguf *fitm_moice_gguf(const fitm_moice *mo) { return mo->g; }

bool fitm_moice_routed(const fitm_moice *mo, int32_t l)
{
    return l >= 0 && (uint32_t)l < mo->base.block_count && mo->layers[l].bases;
}

const float *fitm_moice_bases(const fitm_moice *mo, int32_t l) { return mo->layers[l].bases; }
const float *fitm_moice_gate_a(const fitm_moice *mo, int32_t l) { return mo->layers[l].gate_a; }
const float *fitm_moice_gate_b(const fitm_moice *mo, int32_t l) { return mo->layers[l].gate_b; }
const float *fitm_moice_gate_out(const fitm_moice *mo, int32_t l)
{
    return mo->layers[l].gate_out;
}

void fitm_moice_route(const fitm_moice *mo, int32_t l, int32_t h, const float *x, float *w,
                      float *scratch)
{
    const int32_t N = mo->n_expert, D = (int32_t)mo->base.key_length;
    const float *ga = mo->layers[l].gate_a + (int64_t)h * N * D;
    const float *gb = mo->layers[l].gate_b + (int64_t)h * N * D;
    const float *go = mo->layers[l].gate_out + (int64_t)h * N * N;
    float *u = scratch, *r = scratch + N;
    for (int32_t n = 0; n < N; n++) {
        double a = 0.0, b = 0.0;
        for (int32_t d = 0; d < D; d++) {
            a += (double)ga[n * D + d] * x[d];
            b += (double)gb[n * D + d] * x[d];
        }
        u[n] = (float)(a / (1.0 + exp(-a)) * b); /* SiLU(a) * b */
    }
    float mx = -INFINITY;
    for (int32_t m = 0; m < N; m++) {
        double s = 0.0;
        for (int32_t n = 0; n < N; n++)
            s += (double)go[m * N + n] * u[n];
        r[m] = (float)s;
        mx = r[m] > mx ? r[m] : mx;
    }
    /* top-k by logit, the lower index first on ties; softmax's shared denominator cancels in
     * the renormalisation, so w_e = exp(r_e - max) / sum over the chosen */
    float *chosen = scratch + 2 * N;
    for (int32_t e = 0; e < N; e++)
        chosen[e] = 0.0f;
    double z = 0.0;
    for (int32_t k = 0; k < mo->top_k; k++) {
        int32_t best = -1;
        for (int32_t e = 0; e < N; e++)
            if (chosen[e] == 0.0f && (best < 0 || r[e] > r[best]))
                best = e;
        chosen[best] = 1.0f;
        z += exp((double)r[best] - mx);
    }
    for (int32_t e = 0; e < N; e++)
        w[e] = chosen[e] != 0.0f ? (float)(exp((double)r[e] - mx) / z) : 0.0f;
}
