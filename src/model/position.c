/* position: the position methods inside the forward driver (docs/position-methods.md):
 * MoICE and Ms-PoE as a per-layer mixture of RoPE base changes (the rotation tables, the
 * experts' queries and keys, the weights), and Attention Buckets as one pass per bucket of
 * the sequence's cache whose outputs are merged (expansion, grouping, the logits'
 * accumulation, the captures' mean). forward.c runs the calls and calls in here; nothing
 * here calls forward.c. */
#include "model/forward_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const position_names[FITM_POSITION_COUNT] = {"none", "moice", "ms_poe",
                                                                 "attention_buckets"};

const char *fitm_position_method_name(fitm_position_method m)
{
    return (unsigned)m < FITM_POSITION_COUNT ? position_names[m] : "unknown";
}

int fitm_position_method_parse(const char *s)
{
    for (int i = 0; s && i < FITM_POSITION_COUNT; i++)
        if (!strcmp(s, position_names[i]))
            return i;
    return -1;
}

double fitm_forward_bucket_factor(int32_t b)
{
    static const double factors[FITM_BUCKETS] = {1.0, 1.75, 1.8, 1.9, 2.0, 2.25, 2.5};
    return b >= 0 && b < FITM_BUCKETS ? factors[b] : 0.0;
}

int32_t fitm_forward_ms_poe_calib_id(int64_t i, int32_t n_vocab)
{
    return (int32_t)((i * 7919 + 17) % n_vocab);
}

const int32_t *fitm_forward_ms_poe_ranks(const fitm_forward *f)
{
    return f->ms_poe_rank;
}

/* ---- the mixture (MoICE, Ms-PoE) ---------------------------------------------------- */

/* Makes rows [0, n) of table id valid (computing the missing ones on the host staging rows). */
static void table_fill(fitm_forward *f, int32_t id, int64_t n)
{
    const int64_t have = f->tab_filled[id];
    if (n <= have)
        return;
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot, half = n_rot / 2;
    const double *k = f->tab_keys[id];
    for (int64_t i = 0; i < half; i++) {
        const double ex = -2.0 * (double)i / (double)n_rot;
        f->tab_freq[i] = k[3] * pow(k[2], ex) - k[1] * pow(k[0], ex);
    }
    float *host = f->tab_host;
    for (int64_t pos = have; pos < n; pos++)
        for (int64_t i = 0; i < half; i++) {
            const double a = (double)pos * f->tab_freq[i];
            host[(pos - have) * n_rot + 2 * i] = (float)cos(a);
            host[(pos - have) * n_rot + 2 * i + 1] = (float)sin(a);
        }
    f->b->ops->upload(f->b, f->tabs[id] + have * n_rot, host,
                      (size_t)((n - have) * n_rot) * sizeof(float));
    f->tab_filled[id] = n;
}

/* Whether layer l runs method m as a mixture (the other layers are plain). */
bool fitm_position_layer(const fitm_forward *f, fitm_position_method m, int32_t l)
{
    if (m == FITM_POSITION_MOICE)
        return fitm_moice_routed(f->moice, l);
    return m == FITM_POSITION_MS_POE && l >= FITM_MS_POE_FIRST_LAYER;
}

/* The mixture of sequence q in layer l: per expert e, the call's queries and every visible
 * key (the prefix's below base) copied and turned on by the expert's base change (the cache
 * holds keys rotated with the layer's own base, and rotations compose); then the weights:
 * MoICE's routers on expert 0's queries, or Ms-PoE's one expert per head. */
void fitm_position_mix(const pass *p, const seq_part *q, int32_t l, fitm_attn_mix *mix)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    fitm_backend *b = f->b;
    const fitm_backend_ops *o = b->ops;
    const bool moice = q->opts->position == FITM_POSITION_MOICE;
    const int64_t H = c->n_head, D = c->head_dim, HD = H * D, KV = (int64_t)c->n_head_kv * D;
    const int64_t T = q->T, n_keys = q->pos0 + T, n_rot = c->n_rot;
    const int32_t E = moice ? fitm_moice_n_experts(f->moice) : (int32_t)H;
    const int64_t k_stride = f->p.max_ctx * KV;
    for (int32_t e = 0; e < E; e++) {
        const int32_t id = moice ? f->tab_moice[l * E + e] : f->tab_ms_poe[l * H + e];
        table_fill(f, id, n_keys);
        const float *tab = f->tabs[id];
        float *qe = f->q_mix + e * T * HD, *ke = f->k_mix + e * k_stride;
        o->copy(b, qe, f->q + q->row0 * HD, (size_t)(T * HD) * sizeof(float));
        o->rope(b, qe, T, H, D, n_rot, tab + q->pos0 * n_rot, c->rope_neox);
        int64_t own0 = 0;
        if (q->base > 0) {
            fitm_kv_load_k(q->opts->prefix, l, 0, q->base, ke);
            own0 = q->base;
        }
        fitm_kv_load_k(q->kv, l, 0, n_keys - own0, ke + own0 * KV);
        o->rope(b, ke, n_keys, c->n_head_kv, D, n_rot, tab, c->rope_neox);
    }
    float *w = f->w_host;
    if (moice) {
        o->download(b, f->x_host, f->q_mix, (size_t)(T * HD) * sizeof(float));
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                fitm_moice_route(f->moice, l, (int32_t)h, f->x_host + (t * H + h) * D,
                                 w + (t * H + h) * E, f->route_scratch);
    } else {
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int32_t e = 0; e < E; e++)
                    w[(t * H + h) * E + e] = e == h ? 1.0f : 0.0f;
    }
    o->upload(b, f->w_mix, w, (size_t)(T * H * E) * sizeof(float));
    *mix = (fitm_attn_mix){.n_mix = E, .q = f->q_mix, .k = f->k_mix, .k_stride = k_stride,
                           .k_heads = c->n_head_kv, .w = f->w_mix};
}

/* The Ms-PoE calibration pass (one sequence from position 0): for each head, the last row's
 * attention on the queries and keys before RoPE, p = softmax(scale q.k) over the visible keys,
 * and the fraction of the row's keys with p > 3 mean(p) (the authors' outlier statistic); the
 * heads are ranked by it, most outliers first, the lower head first on ties. */
void fitm_position_ms_poe_stats(const pass *p, int32_t l)
{
    fitm_forward *f = p->f;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t T = p->T, H = c->n_head, Hkv = c->n_head_kv, D = c->head_dim;
    float *qh = f->stat_host, *kh = f->stat_host + H * D; /* last query row; (T, Hkv, D) */
    f->b->ops->download(f->b, qh, f->q + (T - 1) * H * D, (size_t)(H * D) * sizeof(float));
    f->b->ops->download(f->b, kh, f->k, (size_t)(T * Hkv * D) * sizeof(float));
    double frac[4096];
    for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / (H / Hkv);
        double mx = -INFINITY, z = 0.0;
        double sc[FITM_MS_POE_CALIB_LEN];
        for (int64_t j = 0; j < T; j++) {
            double d = 0.0;
            for (int64_t i = 0; i < D; i++)
                d += (double)qh[h * D + i] * kh[(j * Hkv + g) * D + i];
            sc[j] = fitm_model_key_visible(f->m, l, T - 1, j) ? d * c->attn_scale : -INFINITY;
            mx = sc[j] > mx ? sc[j] : mx;
        }
        for (int64_t j = 0; j < T; j++)
            z += sc[j] == -INFINITY ? 0.0 : exp(sc[j] - mx);
        int64_t n = 0;
        for (int64_t j = 0; j < T; j++) /* mean(p) over the row's T keys is 1 / T */
            n += sc[j] != -INFINITY && exp(sc[j] - mx) / z > 3.0 / (double)T;
        frac[h] = (double)n / (double)T;
    }
    for (int64_t h = 0; h < H; h++) {
        int32_t rank = 0;
        for (int64_t o = 0; o < H; o++) {
            const double mine = frac[h], other = frac[o];
            rank += other > mine || (other == mine && o < h);
        }
        f->ms_poe_rank[l * H + h] = rank;
    }
}

/* ---- position methods: creation ------------------------------------------------------------ */

/* The index of the table turning keys rotated with (from_base, from_scale) into keys rotated
 * with (to_base, to_scale), one per distinct change: row p holds, for each pair i, the cos and
 * sin of p (to_scale to_base^(-2i/n_rot) - from_scale from_base^(-2i/n_rot)), in double. A
 * zero change gives cos 1, sin 0: the keys come through bit for bit. Rows are filled on first
 * use (table_fill), so memory is touched only up to the longest context served. */
static int32_t rotation_table(fitm_forward *f, double from_base, double from_scale,
                              double to_base, double to_scale, bool *ok)
{
    for (int32_t i = 0; i < f->n_tabs; i++)
        if (f->tab_keys[i][0] == from_base && f->tab_keys[i][1] == from_scale &&
            f->tab_keys[i][2] == to_base && f->tab_keys[i][3] == to_scale)
            return i;
    const int64_t n_rot = fitm_model_config_of(f->m)->n_rot;
    float *t = f->n_tabs < f->cap_tabs
                   ? f->b->ops->alloc(f->b, (size_t)(f->p.max_ctx * n_rot) * sizeof(float))
                   : NULL;
    if (!t) {
        *ok = false;
        return 0;
    }
    const int32_t id = f->n_tabs++;
    f->tabs[id] = t;
    f->tab_filled[id] = 0;
    f->tab_keys[id][0] = from_base;
    f->tab_keys[id][1] = from_scale;
    f->tab_keys[id][2] = to_base;
    f->tab_keys[id][3] = to_scale;
    return id;
}

/* ---- Attention Buckets ------------------------------------------------------------------ */

/* Checks BUCKETS sequence s (its cache's passes, its prefix's, its output and the
 * accumulator rows acc already taken). */
static fitm_status check_bucket_seq(const fitm_forward *f, const fitm_forward_seq *in, int32_t s,
                                    int64_t acc, fitm_err *err)
{
    const fitm_forward_opts *o = in->opts;
    if (!in->kv)
        return fitm_err_set(err, FITM_ERR_INVALID, "sequence %d has no KV cache", (int)s);
    const int32_t P = fitm_kv_n_passes(in->kv);
    if (P > FITM_BUCKETS)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "sequence %d: its cache holds %d passes, attention_buckets has %d",
                            (int)s, (int)P, FITM_BUCKETS);
    if (o->prefix && fitm_kv_n_passes(o->prefix) < P)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "sequence %d: its prefix cache holds %d passes, its cache %d",
                            (int)s, (int)fitm_kv_n_passes(o->prefix), (int)P);
    fitm_status st = check_output(f, in->T, o, err);
    if (st != FITM_OK)
        return st;
    if (o->n_logits > 0 && f->bk_acc && o->n_logits > f->p.max_logits - acc)
        return fitm_err_set(err, FITM_ERR_INVALID,
                            "%lld logit rows in one call (sequence %d), limit %lld",
                            (long long)(acc + o->n_logits), (int)s, (long long)f->p.max_logits);
    return FITM_OK;
}

/* Pass b of BUCKETS sequence in, as expanded sequence n: its cache's (and prefix's) pass b,
 * no output of its own (the accumulators take it), its capture added to pass 0's. */
static void expand_pass(fitm_forward *f, const fitm_forward_seq *in, int32_t b, int32_t P,
                        int64_t acc, int32_t n)
{
    const fitm_forward_opts *o = in->opts;
    f->bk_opts[n] = *o;
    f->bk_opts[n].logits = NULL;
    f->bk_opts[n].top_k = 0;
    f->bk_opts[n].top = NULL;
    f->bk_opts[n].n_pick = 0;
    f->bk_opts[n].pick = NULL;
    f->bk_opts[n].logprob = NULL;
    if (o->prefix)
        f->bk_opts[n].prefix = fitm_kv_pass(o->prefix, b);
    if (o->capture) {
        f->bk_cap[n] = *o->capture;
        f->bk_cap[n].add = b > 0;
        f->bk_opts[n].capture = &f->bk_cap[n];
    }
    f->bk_seq[n] = (fitm_forward_seq){fitm_kv_pass(in->kv, b), in->tokens, in->T, in->pos0,
                                      &f->bk_opts[n]};
    f->bk_role[n] = (seq_role){(float)fitm_forward_bucket_factor(b), P, b, acc};
}

fitm_status fitm_position_buckets_expand(fitm_forward *f, const fitm_forward_seq *seqs,
                                         int32_t n_seqs, int32_t *n_out, fitm_err *err)
{
    if (n_seqs < 1 || n_seqs > FITM_FORWARD_MAX_SEQS)
        return fitm_err_set(err, FITM_ERR_INVALID, "%d sequences in one call, limit %d",
                            (int)n_seqs, FITM_FORWARD_MAX_SEQS);
    int32_t n = 0;
    int64_t acc = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const fitm_forward_seq *in = &seqs[s];
        if (!in->opts || in->opts->position != FITM_POSITION_BUCKETS) {
            f->bk_seq[n] = *in;
            f->bk_role[n++] = plain_role;
            continue;
        }
        fitm_status st = check_bucket_seq(f, in, s, acc, err);
        if (st != FITM_OK)
            return st;
        const int32_t P = fitm_kv_n_passes(in->kv);
        for (int32_t b = 0; b < P; b++, n++)
            expand_pass(f, in, b, P, acc, n);
        acc += in->opts->n_logits;
    }
    *n_out = n;
    return FITM_OK;
}

int32_t fitm_position_buckets_groups(const fitm_forward *f, int32_t n, int32_t *starts)
{
    int32_t n_groups = 0;
    for (int32_t i = 0; i < n;) {
        int64_t rows = 0, logits = 0;
        int32_t j = i;
        for (; j < n && j - i < FITM_FORWARD_MAX_SEQS; j++) {
            const int64_t nl = f->bk_seq[j].opts ? f->bk_seq[j].opts->n_logits : 0;
            if (j > i && (rows + f->bk_seq[j].T > f->p.max_tokens ||
                          logits + nl > f->p.max_logits))
                break;
            rows += f->bk_seq[j].T;
            logits += nl;
        }
        starts[n_groups++] = i;
        i = j;
    }
    starts[n_groups] = n;
    return n_groups;
}

/* Attention Buckets' output, one pass's logit rows at a time: p = softmax(x) (in double),
 * a = max p = 1 / sum_v exp(x_v - max x); the sequence's accumulator rows get a p (pass 0
 * stores, the others add) and their sums a. With a single pass the rows get log p itself,
 * so one bucket of factor 1 is exactly the plain model's distribution. */
void fitm_position_bucket_add(const pass *p, const seq_part *q)
{
    fitm_forward *f = p->f;
    const int64_t V = fitm_model_config_of(f->m)->n_vocab;
    for (int64_t i = 0; i < q->opts->n_logits; i++) {
        f->b->ops->download(f->b, f->bk_row, f->logits + (q->lrow0 + i) * V,
                            (size_t)V * sizeof(float));
        const float *x = f->bk_row;
        double *e = f->bk_exp, mx = -INFINITY, z = 0.0;
        for (int64_t v = 0; v < V; v++)
            mx = x[v] > mx ? x[v] : mx;
        for (int64_t v = 0; v < V; v++)
            z += e[v] = exp((double)x[v] - mx);
        double *acc = f->bk_acc + (q->role.acc0 + i) * V;
        if (q->role.n_pass == 1) {
            const double lz = mx + log(z);
            for (int64_t v = 0; v < V; v++)
                acc[v] = (double)x[v] - lz;
            continue;
        }
        const double a = 1.0 / z, az = a / z; /* a p_v = exp(x_v - mx) / z^2 */
        if (q->role.pass == 0) {
            f->bk_sum[q->role.acc0 + i] = a;
            for (int64_t v = 0; v < V; v++)
                acc[v] = az * e[v];
        } else {
            f->bk_sum[q->role.acc0 + i] += a;
            for (int64_t v = 0; v < V; v++)
                acc[v] += az * e[v];
        }
    }
}

/* A bucket sequence's output after all its passes ran: logits log p^ (p^ = sum a_b p_b /
 * sum a_b) into opts->logits and/or their top entries into opts->top and/or their
 * log-probabilities at opts->pick into opts->logprob (on the host, from those float rows);
 * its captures divided by the number of passes (the mean of the passes' probabilities and
 * masses). */
static void bucket_finish(fitm_forward *f, const fitm_forward_seq *in, const seq_role *role)
{
    const fitm_forward_opts *o = in->opts;
    const int64_t V = fitm_model_config_of(f->m)->n_vocab;
    for (int64_t i = 0; i < o->n_logits; i++) {
        const double *acc = f->bk_acc + (role->acc0 + i) * V;
        const double sum = f->bk_sum[role->acc0 + i];
        float *row = o->logits ? o->logits + i * V : f->bk_row;
        for (int64_t v = 0; v < V; v++)
            row[v] = (float)(role->n_pass == 1 ? acc[v] : log(acc[v] / sum));
        if (o->top_k > 0)
            fitm_ops_topk(row, V, o->top_k, o->top + i * o->top_k);
        if (o->n_pick > 0)
            fitm_ops_logprob(row, V, o->pick + i * o->n_pick, o->n_pick,
                             o->logprob + i * o->n_pick);
    }
    const fitm_capture *cap = o->capture;
    if (!cap || role->n_pass < 2)
        return;
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t slots = (int64_t)cap->n_rows * c->n_layer * c->n_head;
    const float P = (float)role->n_pass;
    if (cap->span_mass)
        for (int64_t i = 0; i < slots * cap->n_spans; i++)
            cap->span_mass[i] /= P;
    if (cap->probs)
        for (int64_t i = 0; i < slots * cap->probs_stride; i++)
            cap->probs[i] /= P;
}

void fitm_position_buckets_finish(fitm_forward *f, const fitm_forward_seq *seqs, int32_t n_seqs)
{
    for (int32_t s = 0, i = 0; s < n_seqs; s++) {
        const int32_t P = f->bk_role[i].n_pass;
        if (P > 0)
            bucket_finish(f, &seqs[s], &f->bk_role[i]);
        i += P > 0 ? P : 1;
    }
}

/* ---- creation ---------------------------------------------------------------------------- */

/* The Attention Buckets output scratch, on a backend that sums captures. */
static fitm_status alloc_buckets(fitm_forward *f, fitm_err *err)
{
    const int64_t V = fitm_model_config_of(f->m)->n_vocab;
    const int64_t rows = f->p.max_logits > 0 ? f->p.max_logits : 1;
    f->bk_acc = calloc((size_t)(rows * V), sizeof *f->bk_acc);
    f->bk_sum = calloc((size_t)rows, sizeof *f->bk_sum);
    f->bk_row = malloc((size_t)V * sizeof *f->bk_row);
    f->bk_exp = malloc((size_t)V * sizeof *f->bk_exp);
    if (!f->bk_acc || !f->bk_sum || !f->bk_row || !f->bk_exp)
        return fitm_err_set(err, FITM_ERR_NOMEM,
                            "cannot allocate the Attention Buckets output scratch");
    return FITM_OK;
}

/* The mixture's scratch: the experts' queries, keys and weights, the tables' slots, the
 * host rows; false when any allocation failed. */
static bool alloc_mixture(fitm_forward *f, int32_t N)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const int64_t L = c->n_layer, H = c->n_head, D = c->head_dim, Tm = f->p.max_tokens;
    f->n_mix = (int32_t)(N > H ? N : H);
    bool ok = true;
    f->q_mix = alloc_floats(f->b, f->n_mix * Tm * H * D, &ok);
    f->k_mix = alloc_floats(f->b, f->n_mix * f->p.max_ctx * c->n_head_kv * D, &ok);
    f->w_mix = alloc_floats(f->b, Tm * H * f->n_mix, &ok);
    f->cap_tabs = (int32_t)(L * (N + H));
    f->tabs = calloc((size_t)f->cap_tabs, sizeof *f->tabs);
    f->tab_keys = calloc((size_t)f->cap_tabs, sizeof *f->tab_keys);
    f->tab_moice = N ? malloc((size_t)(L * N) * sizeof *f->tab_moice) : NULL;
    f->tab_ms_poe = malloc((size_t)(L * H) * sizeof *f->tab_ms_poe);
    f->ms_poe_rank = calloc((size_t)(L * H), sizeof *f->ms_poe_rank);
    f->w_host = malloc((size_t)(Tm * H * f->n_mix) * sizeof *f->w_host);
    f->x_host = malloc((size_t)(Tm * H * D) * sizeof *f->x_host);
    f->tab_filled = calloc((size_t)f->cap_tabs, sizeof *f->tab_filled);
    f->tab_freq = malloc((size_t)(c->n_rot / 2 + 1) * sizeof *f->tab_freq);
    f->tab_host = malloc((size_t)(f->p.max_ctx * c->n_rot) * sizeof *f->tab_host);
    return ok && f->tabs && f->tab_keys && (!N || f->tab_moice) && f->tab_ms_poe &&
           f->ms_poe_rank && f->w_host && f->x_host && f->tab_filled && f->tab_freq &&
           f->tab_host;
}

static fitm_status no_scratch(const fitm_forward *f, fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_NOMEM,
                        "cannot allocate the position methods' scratch (%d experts, %lld "
                        "positions)",
                        (int)f->n_mix, (long long)f->p.max_ctx);
}

fitm_status fitm_position_alloc(fitm_forward *f, const fitm_moice *mo, bool *mixing,
                                fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    *mixing = false;
    if (f->tabs)
        return fitm_err_set(err, FITM_ERR_INVALID, "position methods are already enabled");
    f->moice = mo;
    fitm_status s;
    if (f->b->ops->capture_add && (s = alloc_buckets(f, err)) != FITM_OK)
        return s;
    if (!f->backend_mix)
        return FITM_OK; /* its calls with a method fail UNSUPPORTED: reserve nothing for them */
    if (mo) {
        const fitm_moice_base *mb = fitm_moice_base_of(mo);
        if (mb->block_count != (uint32_t)c->n_layer || mb->head_count != (uint32_t)c->n_head ||
            mb->head_count_kv != (uint32_t)c->n_head_kv || mb->key_length != (uint32_t)c->head_dim)
            return fitm_err_set(err, FITM_ERR_INVALID,
                                "MoICE sidecar shapes do not match the model (fitm_moice_check)");
    }
    if (!alloc_mixture(f, mo ? fitm_moice_n_experts(mo) : 0))
        return no_scratch(f, err);
    *mixing = true;
    return FITM_OK;
}

fitm_status fitm_position_tables(fitm_forward *f, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(f->m);
    const fitm_moice *mo = f->moice;
    const int32_t L = c->n_layer, H = c->n_head, N = mo ? fitm_moice_n_experts(mo) : 0;
    bool ok = true;
    for (int32_t l = 0; l < L && ok; l++) {
        const fitm_layer *ly = fitm_model_layer(f->m, l);
        const double base = ly->rope_base, scale = ly->rope_freq_scale;
        for (int32_t e = 0; mo && e < N && fitm_moice_routed(mo, l); e++)
            f->tab_moice[l * N + e] = rotation_table(f, base, scale,
                                                     fitm_moice_bases(mo, l)[e], scale, &ok);
        for (int32_t h = 0; h < H && l >= FITM_MS_POE_FIRST_LAYER; h++) {
            const double r = FITM_MS_POE_MIN + (FITM_MS_POE_MAX - FITM_MS_POE_MIN) *
                                                   (double)f->ms_poe_rank[l * H + h] / (double)H;
            f->tab_ms_poe[l * H + h] = rotation_table(f, base, scale, base, scale / r, &ok);
        }
    }
    return ok ? FITM_OK : no_scratch(f, err);
}
