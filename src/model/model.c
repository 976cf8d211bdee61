#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute/quant.h"

struct fitm_model {
    fitm_gguf *gguf;
    fitm_model_config cfg;
    bool local_flags[FITM_MODEL_MAX_LAYERS]; /* sliding-window layers */
    fitm_layer *layers;     /* (L) */
    fitm_weight tok_embd;
    fitm_weight output_norm;
    fitm_weight output;     /* a copy of tok_embd's view when the file ties them */
    float **owned;          /* F32 copies of vectors */
    int64_t n_owned, cap_owned;
    uint64_t weight_bytes;
};

static const char *const arch_names[FITM_ARCH_COUNT] = {
    [FITM_ARCH_LLAMA] = "llama",
    [FITM_ARCH_QWEN2] = "qwen2",
    [FITM_ARCH_GEMMA3] = "gemma3",
};

const char *fitm_arch_name(fitm_arch a)
{
    return (unsigned)a < FITM_ARCH_COUNT ? arch_names[a] : "?";
}

/* ---- metadata ---------------------------------------------------------------------------- */

/* "<arch>.<suffix>" into buf. */
static const char *arch_key(char *buf, size_t n, fitm_arch a, const char *suffix)
{
    snprintf(buf, n, "%s.%s", arch_names[a], suffix);
    return buf;
}

/* A positive integer key in [1, max]; def < 0 means required. */
static fitm_status get_dim(const fitm_gguf *g, fitm_arch a, const char *suffix, int64_t def,
                           int64_t max, int32_t *out, fitm_err *err)
{
    char key[128];
    arch_key(key, sizeof key, a, suffix);
    int64_t v;
    fitm_status s = fitm_gguf_get_i64(g, key, &v, err);
    if (s == FITM_ERR_NOT_FOUND) {
        if (def < 0)
            return fitm_err_set(err, FITM_ERR_FORMAT, "missing metadata key '%s'", key);
        v = def;
    } else if (s != FITM_OK) {
        return s;
    }
    if (v < 1 || v > max)
        return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' = %lld is out of range [1, %lld]",
                            key, (long long)v, (long long)max);
    *out = (int32_t)v;
    return FITM_OK;
}

static fitm_status get_float(const fitm_gguf *g, const char *key, float def, float *out,
                             fitm_err *err)
{
    fitm_status s = fitm_gguf_get_f32(g, key, out, err);
    if (s == FITM_ERR_NOT_FOUND) {
        *out = def;
        return FITM_OK;
    }
    if (s != FITM_OK)
        return s;
    if (!isfinite(*out))
        return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' is not finite", key);
    return FITM_OK;
}

static bool str_is(fitm_gguf_str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.len == n && memcmp(s.ptr, lit, n) == 0;
}

/* Which layers are local (sliding-window): gemma3.attention.sliding_window_pattern as a
 * period P (layer l is local iff l % P < P - 1; P = 0: all local) or as one flag per layer;
 * without the key Gemma 3's own pattern, P = 6 (llama.cpp's set_swa_pattern(6)). */
static fitm_status read_swa_layers(const fitm_gguf *g, const fitm_model_config *c, bool *local,
                                   fitm_err *err)
{
    for (int32_t l = 0; l < c->n_layer; l++)
        local[l] = false;
    if (c->arch != FITM_ARCH_GEMMA3 || c->n_swa == 0)
        return FITM_OK;
    const char *key = "gemma3.attention.sliding_window_pattern";
    const fitm_gguf_kv *kv = fitm_gguf_find_kv(g, key);
    int64_t period = 6;
    if (kv && kv->type == FITM_GGUF_ARRAY) {
        if (kv->arr_n != (uint64_t)c->n_layer ||
            (kv->arr_type != FITM_GGUF_BOOL && kv->arr_type != FITM_GGUF_UINT8 &&
             kv->arr_type != FITM_GGUF_INT8))
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "metadata '%s' must be %d bool flags", key, (int)c->n_layer);
        for (int32_t l = 0; l < c->n_layer; l++)
            local[l] = kv->value[l] != 0;
        return FITM_OK;
    }
    if (kv) {
        fitm_status s = fitm_gguf_get_i64(g, key, &period, err);
        if (s)
            return s;
        if (period < 0 || period > FITM_MODEL_MAX_LAYERS)
            return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' = %lld is out of range", key,
                                (long long)period);
    }
    for (int32_t l = 0; l < c->n_layer; l++)
        local[l] = period == 0 || l % period < period - 1;
    return FITM_OK;
}

static fitm_status read_config(const fitm_gguf *g, fitm_model_config *c, fitm_err *err)
{
    memset(c, 0, sizeof *c);
    fitm_gguf_str arch;
    fitm_status s = fitm_gguf_get_str(g, "general.architecture", &arch, err);
    if (s == FITM_ERR_NOT_FOUND)
        return fitm_err_set(err, FITM_ERR_FORMAT, "missing metadata key 'general.architecture'");
    if (s != FITM_OK)
        return s;
    c->arch = FITM_ARCH_COUNT;
    for (int a = 0; a < FITM_ARCH_COUNT; a++)
        if (str_is(arch, arch_names[a]))
            c->arch = (fitm_arch)a;
    if (c->arch == FITM_ARCH_COUNT)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "unsupported architecture '%.*s' (supported: llama, qwen2, gemma3)",
                            (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
    fitm_arch a = c->arch;
    const int64_t MD = FITM_MODEL_MAX_DIM;
    if ((s = get_dim(g, a, "block_count", -1, FITM_MODEL_MAX_LAYERS, &c->n_layer, err)) ||
        (s = get_dim(g, a, "embedding_length", -1, MD, &c->n_embd, err)) ||
        (s = get_dim(g, a, "feed_forward_length", -1, MD, &c->n_ff, err)) ||
        (s = get_dim(g, a, "attention.head_count", -1, 4096, &c->n_head, err)) ||
        (s = get_dim(g, a, "attention.head_count_kv", c->n_head, 4096, &c->n_head_kv, err)))
        return s;
    if (c->n_head % c->n_head_kv != 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "%s.attention.head_count %d is not a multiple of head_count_kv %d",
                            arch_names[a], c->n_head, c->n_head_kv);
    int64_t def_d = c->n_embd % c->n_head == 0 ? c->n_embd / c->n_head : -1;
    int32_t d_v;
    if ((s = get_dim(g, a, "attention.key_length", def_d, 65536, &c->head_dim, err)) ||
        (s = get_dim(g, a, "attention.value_length", c->head_dim, 65536, &d_v, err)) ||
        (s = get_dim(g, a, "rope.dimension_count", c->head_dim, 65536, &c->n_rot, err)))
        return s;
    if (d_v != c->head_dim)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "%s.attention.value_length %d differs from key_length %d",
                            arch_names[a], d_v, c->head_dim);
    if (c->n_rot % 2 != 0 || c->n_rot > c->head_dim)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "%s.rope.dimension_count %d must be even and at most the head size %d",
                            arch_names[a], c->n_rot, c->head_dim);
    if ((int64_t)c->n_head * c->head_dim > MD)
        return fitm_err_set(err, FITM_ERR_FORMAT, "head_count x key_length is too large");

    char key[128];
    int64_t ctx = 0;
    s = fitm_gguf_get_i64(g, arch_key(key, sizeof key, a, "context_length"), &ctx, err);
    if (s != FITM_OK && s != FITM_ERR_NOT_FOUND)
        return s;
    c->n_ctx_train = ctx > 0 ? ctx : 0;

    if ((s = get_float(g, arch_key(key, sizeof key, a, "attention.layer_norm_rms_epsilon"),
                       1e-5f, &c->norm_eps, err)))
        return s;
    if (!(c->norm_eps >= 0.0f))
        return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' is negative", key);
    if ((s = get_float(g, arch_key(key, sizeof key, a, "rope.freq_base"), 10000.0f,
                       &c->rope_base, err)))
        return s;
    if (!(c->rope_base > 1.0f))
        return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' must be > 1", key);

    /* RoPE scaling: none or linear (a position multiplier); others change the frequencies in
     * ways the forward pass does not implement, so they are refused rather than ignored. */
    c->rope_freq_scale = 1.0f;
    fitm_gguf_str st;
    s = fitm_gguf_get_str(g, arch_key(key, sizeof key, a, "rope.scaling.type"), &st, err);
    if (s != FITM_OK && s != FITM_ERR_NOT_FOUND)
        return s;
    bool linear = s == FITM_ERR_NOT_FOUND || str_is(st, "linear");
    if (s == FITM_OK && !str_is(st, "none") && !str_is(st, "linear"))
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED, "unsupported RoPE scaling '%.*s' in '%s'",
                            (int)(st.len > 32 ? 32 : st.len), st.ptr, key);
    if (linear) {
        float factor = 0.0f;
        if ((s = get_float(g, arch_key(key, sizeof key, a, "rope.scaling.factor"), 0.0f, &factor,
                           err)))
            return s;
        if (factor == 0.0f &&
            (s = get_float(g, arch_key(key, sizeof key, a, "rope.scale_linear"), 0.0f, &factor,
                           err)))
            return s;
        if (factor < 0.0f)
            return fitm_err_set(err, FITM_ERR_FORMAT, "negative RoPE scaling factor");
        if (factor > 0.0f)
            c->rope_freq_scale = 1.0f / factor;
    }
    c->rope_base_local = c->rope_base;
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    c->embd_scale = 1.0f;
    c->act = FITM_ACT_SILU;

    switch (a) {
    case FITM_ARCH_LLAMA:
        break;
    case FITM_ARCH_QWEN2:
        c->rope_neox = true;
        break;
    case FITM_ARCH_GEMMA3: {
        c->rope_neox = true;
        c->qk_norm = true;
        c->post_norms = true;
        c->act = FITM_ACT_GELU;
        c->embd_scale = sqrtf((float)c->n_embd);
        if ((s = get_float(g, arch_key(key, sizeof key, a, "rope.freq_base_swa"), 10000.0f,
                           &c->rope_base_local, err)))
            return s;
        if (!(c->rope_base_local > 1.0f))
            return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' must be > 1", key);
        /* Gemma 3 27B scales by 1/sqrt(C/H) (query_pre_attn_scalar); the others by 1/sqrt(D). */
        if (c->n_layer == 62)
            c->attn_scale = 1.0f / sqrtf((float)(c->n_embd / c->n_head));
        int64_t swa = 0;
        s = fitm_gguf_get_i64(g, arch_key(key, sizeof key, a, "attention.sliding_window"), &swa,
                              err);
        if (s != FITM_OK && s != FITM_ERR_NOT_FOUND)
            return s;
        if (swa < 0 || swa > (int64_t)1 << 30)
            return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' = %lld is out of range", key,
                                (long long)swa);
        c->n_swa = (int32_t)swa;
        /* llama.cpp's graph with sliding-window layers has no final softcap; its graph for a
         * gemma3 file without a window applies the file's one. */
        if (c->n_swa == 0) {
            if ((s = get_float(g, arch_key(key, sizeof key, a, "final_logit_softcapping"), 0.0f,
                               &c->final_softcap, err)))
                return s;
            if (c->final_softcap < 0.0f)
                return fitm_err_set(err, FITM_ERR_FORMAT, "metadata '%s' is negative", key);
        }
        break;
    }
    default:
        break;
    }
    return FITM_OK;
}

/* ---- tensors ----------------------------------------------------------------------------- */

static fitm_status own_floats(fitm_model *m, int64_t n, float **out, fitm_err *err)
{
    if (m->n_owned == m->cap_owned) {
        int64_t cap = m->cap_owned ? 2 * m->cap_owned : 64;
        float **p = realloc(m->owned, (size_t)cap * sizeof *p);
        if (!p)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory loading the model");
        m->owned = p;
        m->cap_owned = cap;
    }
    float *v = malloc((size_t)n * sizeof *v);
    if (!v)
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory loading the model");
    m->owned[m->n_owned++] = v;
    *out = v;
    return FITM_OK;
}

/* Looks a tensor up and checks it. A matrix must be [cols, rows] (GGUF order) in a type the
 * forward pass reads; a vector (rows == 0) must be [cols] and is converted to F32. A missing
 * optional tensor leaves w zeroed (data NULL) and returns FITM_OK. */
static fitm_status load_tensor(fitm_model *m, const char *name, int64_t cols, int64_t rows,
                               bool required, fitm_weight *w, fitm_err *err)
{
    memset(w, 0, sizeof *w);
    const fitm_gguf_tensor *t = fitm_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (required)
            return fitm_err_set(err, FITM_ERR_FORMAT, "missing tensor '%s'", name);
        return FITM_OK;
    }
    bool vec = rows == 0;
    int64_t want_rows = vec ? 1 : rows;
    bool shape_ok = t->ne[0] == cols && t->ne[1] == want_rows && t->ne[2] == 1 && t->ne[3] == 1;
    if (!shape_ok) {
        if (vec)
            return fitm_err_set(err, FITM_ERR_FORMAT,
                                "tensor '%s': shape [%lld, %lld, %lld, %lld], expected [%lld]",
                                name, (long long)t->ne[0], (long long)t->ne[1],
                                (long long)t->ne[2], (long long)t->ne[3], (long long)cols);
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                            name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                            (long long)t->ne[3], (long long)cols, (long long)rows);
    }
    const fitm_dtype_info *info = fitm_dtype_info_of((int)t->type);
    if (!info || !fitm_quant_supported(t->type))
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED, "tensor '%s': unsupported type %s (id %d)",
                            name, info ? info->name : "unknown", (int)t->type);
    size_t row_bytes = fitm_dtype_row_bytes(t->type, cols);
    if (row_bytes == 0)
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "tensor '%s': row length %lld is not a multiple of the %s block (%d)",
                            name, (long long)cols, info->name, (int)info->block_elems);
    w->name = t->name;
    w->type = t->type;
    w->n_rows = want_rows;
    w->n_cols = cols;
    w->row_bytes = row_bytes;
    w->data = t->data;
    m->weight_bytes += t->n_bytes;
    if (vec) {
        float *v = NULL;
        fitm_status s = own_floats(m, cols, &v, err);
        if (s)
            return s;
        fitm_dequant_row(t->type, t->data, v, cols);
        for (int64_t i = 0; i < cols; i++)
            if (!isfinite(v[i]))
                return fitm_err_set(err, FITM_ERR_FORMAT, "tensor '%s': element %lld is not finite",
                                    name, (long long)i);
        w->type = FITM_DTYPE_F32;
        w->row_bytes = (size_t)cols * sizeof(float);
        w->data = v;
    }
    return FITM_OK;
}

static fitm_status load_layer(fitm_model *m, int32_t l, fitm_err *err)
{
    const fitm_model_config *c = &m->cfg;
    fitm_layer *ly = &m->layers[l];
    const int64_t C = c->n_embd, F = c->n_ff, D = c->head_dim;
    const int64_t HD = (int64_t)c->n_head * D, HkvD = (int64_t)c->n_head_kv * D;
    char n[FITM_GGUF_MAX_NAME + 64];
#define T_(field, suffix, cols, rows, req)                                                     \
    do {                                                                                       \
        snprintf(n, sizeof n, "blk.%d." suffix, (int)l);                                       \
        fitm_status s_ = load_tensor(m, n, (cols), (rows), (req), &ly->field, err);            \
        if (s_)                                                                                \
            return s_;                                                                         \
    } while (0)
    T_(attn_norm, "attn_norm.weight", C, 0, true);
    T_(wq, "attn_q.weight", C, HD, true);
    T_(wk, "attn_k.weight", C, HkvD, true);
    T_(wv, "attn_v.weight", C, HkvD, true);
    T_(wo, "attn_output.weight", HD, C, true);
    T_(ffn_norm, "ffn_norm.weight", C, 0, true);
    T_(w_gate, "ffn_gate.weight", C, F, true);
    T_(w_up, "ffn_up.weight", C, F, true);
    T_(w_down, "ffn_down.weight", F, C, true);
    /* Biases: qwen2 has q/k/v biases; a llama file may carry any of them. */
    bool need_bias = c->arch == FITM_ARCH_QWEN2;
    if (c->arch != FITM_ARCH_GEMMA3) {
        T_(bq, "attn_q.bias", HD, 0, need_bias);
        T_(bk, "attn_k.bias", HkvD, 0, need_bias);
        T_(bv, "attn_v.bias", HkvD, 0, need_bias);
        T_(bo, "attn_output.bias", C, 0, false);
    }
    if (c->qk_norm) {
        T_(q_norm, "attn_q_norm.weight", D, 0, true);
        T_(k_norm, "attn_k_norm.weight", D, 0, true);
    }
    if (c->post_norms) {
        T_(post_attn_norm, "post_attention_norm.weight", C, 0, true);
        T_(post_ffn_norm, "post_ffw_norm.weight", C, 0, true);
    }
#undef T_
    ly->local = m->local_flags[l];
    ly->rope_base = ly->local ? c->rope_base_local : c->rope_base;
    ly->rope_freq_scale = ly->local ? 1.0f : c->rope_freq_scale;
    return FITM_OK;
}

fitm_status fitm_model_from_gguf(fitm_model **out, fitm_gguf *g, fitm_err *err)
{
    *out = NULL;
    fitm_model *m = calloc(1, sizeof *m);
    if (!m) {
        fitm_gguf_close(g);
        return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory loading the model");
    }
    m->gguf = g;
    fitm_status s = read_config(g, &m->cfg, err);
    if (!s)
        s = read_swa_layers(g, &m->cfg, m->local_flags, err);
    if (s)
        goto fail;
    fitm_model_config *c = &m->cfg;
    const fitm_gguf_tensor *te = fitm_gguf_find_tensor(g, "token_embd.weight");
    if (!te) {
        s = fitm_err_set(err, FITM_ERR_FORMAT, "missing tensor 'token_embd.weight'");
        goto fail;
    }
    if (te->ne[1] < 1 || te->ne[1] > INT32_MAX) {
        s = fitm_err_set(err, FITM_ERR_FORMAT, "tensor 'token_embd.weight': bad vocabulary size");
        goto fail;
    }
    c->n_vocab = (int32_t)te->ne[1];
    if ((s = load_tensor(m, "token_embd.weight", c->n_embd, c->n_vocab, true, &m->tok_embd, err)) ||
        (s = load_tensor(m, "output_norm.weight", c->n_embd, 0, true, &m->output_norm, err)) ||
        (s = load_tensor(m, "output.weight", c->n_embd, c->n_vocab, false, &m->output, err)))
        goto fail;
    if (!m->output.data)
        m->output = m->tok_embd; /* tied */
    if (fitm_gguf_find_tensor(g, "rope_freqs.weight")) {
        /* Llama 3.1-style per-dimension RoPE factors: refused rather than silently ignored. */
        s = fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                         "tensor 'rope_freqs.weight': per-dimension RoPE factors are not supported");
        goto fail;
    }
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    if (!m->layers) {
        s = fitm_err_set(err, FITM_ERR_NOMEM, "out of memory loading the model");
        goto fail;
    }
    for (int32_t l = 0; l < c->n_layer; l++)
        if ((s = load_layer(m, l, err)))
            goto fail;
    *out = m;
    return FITM_OK;
fail:
    fitm_model_close(m);
    return s;
}

fitm_status fitm_model_open(fitm_model **out, const char *path, fitm_err *err)
{
    return fitm_model_open_mode(out, path, false, err);
}

fitm_status fitm_model_open_mode(fitm_model **out, const char *path, bool copy, fitm_err *err)
{
    *out = NULL;
    fitm_gguf *g;
    fitm_status s = copy ? fitm_gguf_open_copy(&g, path, err) : fitm_gguf_open(&g, path, err);
    if (s)
        return s;
    s = fitm_model_from_gguf(out, g, err);
    if (s)
        fitm_err_prefix(err, "%s", path);
    return s;
}

void fitm_model_close(fitm_model *m)
{
    if (!m)
        return;
    for (int64_t i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    fitm_gguf_close(m->gguf);
    free(m);
}

const fitm_model_config *fitm_model_config_of(const fitm_model *m)
{
    return &m->cfg;
}

const fitm_layer *fitm_model_layer(const fitm_model *m, int32_t l)
{
    return &m->layers[l];
}

static const size_t layer_views[] = {
    offsetof(fitm_layer, attn_norm), offsetof(fitm_layer, wq),       offsetof(fitm_layer, wk),
    offsetof(fitm_layer, wv),        offsetof(fitm_layer, bq),       offsetof(fitm_layer, bk),
    offsetof(fitm_layer, bv),        offsetof(fitm_layer, q_norm),   offsetof(fitm_layer, k_norm),
    offsetof(fitm_layer, wo),        offsetof(fitm_layer, bo),
    offsetof(fitm_layer, post_attn_norm), offsetof(fitm_layer, ffn_norm),
    offsetof(fitm_layer, w_gate),    offsetof(fitm_layer, w_up),     offsetof(fitm_layer, w_down),
    offsetof(fitm_layer, post_ffn_norm)};
#define LAYER_VIEWS ((int64_t)(sizeof layer_views / sizeof layer_views[0]))

int64_t fitm_model_n_weights(const fitm_model *m)
{
    return 3 + (int64_t)m->cfg.n_layer * LAYER_VIEWS;
}

const fitm_weight *fitm_model_weight_at(const fitm_model *m, int64_t i)
{
    if (i < 3)
        return i == 0 ? &m->tok_embd : i == 1 ? &m->output_norm : &m->output;
    const fitm_layer *ly = &m->layers[(i - 3) / LAYER_VIEWS];
    return (const fitm_weight *)((const char *)ly + layer_views[(i - 3) % LAYER_VIEWS]);
}

void fitm_model_release(const fitm_model *m, const fitm_weight *w)
{
    fitm_gguf_release(m->gguf, w->data, (size_t)w->n_rows * w->row_bytes);
}

const fitm_weight *fitm_model_tok_embd(const fitm_model *m)
{
    return &m->tok_embd;
}

const fitm_weight *fitm_model_output_norm(const fitm_model *m)
{
    return &m->output_norm;
}

const fitm_weight *fitm_model_output(const fitm_model *m)
{
    return &m->output;
}

const fitm_gguf *fitm_model_gguf(const fitm_model *m)
{
    return m->gguf;
}

uint64_t fitm_model_weight_bytes(const fitm_model *m)
{
    return m->weight_bytes;
}

bool fitm_model_key_visible(const fitm_model *m, int32_t l, int64_t query, int64_t key)
{
    if (key < 0 || key > query)
        return false;
    return !m->layers[l].local || query - key < m->cfg.n_swa;
}
