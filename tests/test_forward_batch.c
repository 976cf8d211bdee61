/* Batched forward calls (fitm_forward_run_batch) against the same sequences run one call at a
 * time, on generated models of every architecture and weight type: every sequence's logits
 * and top-k lists (k drawn per sequence, so runs of equal k share one top-k call), attention
 * captures (span masses and full rows, before and after the intervention) and KV
 * rows must be bit-identical (memcmp), whatever else shares the call -- decode steps packed
 * with other decode steps, prefill chunks, branches over a shared prefix, intervened rows,
 * sequences with Ms-PoE's per-head positions beside sequences without; with F32 caches and
 * with fp16 ones (fitm_backend_set_kv_half).
 *
 * Calls that stop after n_layers layers (fitm_forward_opts.n_layers): the layers they run give
 * the rows, captures and cache rows of a whole pass, alone and packed beside whole passes and
 * decode steps; the later layers' capture slots are 0; a cache remembers how many layers its
 * rows hold, and calls that would read rows missing there fail.
 *
 * Inputs are fresh random each run (the seed is printed; FITM_TEST_SEED=<n> repeats a run). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/rng.h"
#include "check.h"
#include "gen_model.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/genmodel.h"
#include "model/kv.h"
#include "model/model.h"

enum {
    MAX_T = 96,   /* tokens per call                 */
    CTX = 64,     /* positions per sequence          */
    N_SEQ = 6,    /* sequences per batched call      */
    N_ROUNDS = 4, /* batched calls per model         */
};

static uint64_t rng;

static int64_t uniform(int64_t lo, int64_t hi) /* [lo, hi] */
{
    return lo + (int64_t)(fitm_rng_next(&rng) % (uint64_t)(hi - lo + 1));
}

/* The test model of arch with weights of type, or NULL (a failed check; *buf freed). */
static fitm_model *gen_model(fitm_gen_arch arch, fitm_dtype type, void **buf)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, arch);
    cfg.type = type;
    cfg.n_layer = arch == FITM_GEN_ARCH_GEMMA3 ? 7 : 2;
    fitm_model *m = gen_model_load(&cfg, buf);
    CHECK(m != NULL, " %s %s", fitm_gen_arch_name(arch), fitm_dtype_info_of(type)->name);
    if (!m) {
        free(*buf);
        *buf = NULL;
    }
    return m;
}

/* One sequence twice over: `bat` runs inside batched calls, `solo` alone; both start from
 * the same history. A branch sequence reads the shared prefix cache below its base. */
typedef struct {
    fitm_kv *bat, *solo;
    const fitm_kv *prefix;
    int32_t ids[CTX];
    int64_t pos;        /* positions held so far                         */
    /* this round's part */
    int64_t T, n_logits;
    fitm_capture cap;
    int64_t cap_rows[2];
    fitm_span spans[3];
    float alpha[3];
    fitm_intervention iv;
    bool use_cap, use_iv;
    fitm_position_method position; /* Ms-PoE now and then; branches never (their prefix has none) */
    int32_t top_k;                 /* 0 (none), 1 (greedy), 3 or FITM_TOP_MAX               */
    bool no_logits;                /* the batched call asks for top lists or picks only (the
                                      solo one always for logits too: its lists and picks
                                      come from them)                                       */
    int32_t n_pick;                /* 0 (none), 1 (query likelihood), 2, FITM_PICK_MAX       */
    int32_t pick[MAX_T * FITM_PICK_MAX]; /* ids with 0 and V - 1 among them                 */
    float *logits[2], *mass[2], *probs[2]; /* [0] batched, [1] solo */
    fitm_top *top[2];
    double *lp[2];
} seq;

static void fill_part(seq *s, const fitm_model_config *c, bool decode)
{
    s->T = decode ? 1 : uniform(2, 12);
    if (s->pos + s->T > CTX)
        s->T = CTX - s->pos;
    for (int64_t t = 0; t < s->T; t++)
        s->ids[s->pos + t] = (int32_t)uniform(0, c->n_vocab - 1);
    s->n_logits = uniform(s->T > 1 ? 0 : 1, s->T);
    static const int32_t ks[] = {0, 1, 1, 3, FITM_TOP_MAX};
    s->top_k = ks[uniform(0, 4)];
    s->top_k = s->top_k > c->n_vocab ? c->n_vocab : s->top_k;
    static const int32_t picks[] = {0, 1, 2, FITM_PICK_MAX};
    s->n_pick = picks[uniform(0, 3)];
    for (int64_t i = 0; i < s->n_logits * s->n_pick; i++) {
        const int64_t u = uniform(0, 5);
        s->pick[i] = u == 0 ? 0 : u == 1 ? c->n_vocab - 1 : (int32_t)uniform(0, c->n_vocab - 1);
    }
    s->use_cap = uniform(0, 1);
    s->use_iv = s->pos >= 4 && uniform(0, 1);
    s->position = !s->prefix && uniform(0, 2) == 0 ? FITM_POSITION_MS_POE : FITM_POSITION_NONE;
    /* documents among the first positions; a span reaching past the sequence is fine */
    int64_t a = uniform(0, 1), b = a + uniform(1, 2), d = b + uniform(0, 1);
    s->spans[0] = (fitm_span){a, b};
    s->spans[1] = (fitm_span){d, d + uniform(1, 3)};
    s->spans[2] = (fitm_span){0, s->pos + s->T};
    for (int k = 0; k < 3; k++)
        s->alpha[k] = (float)uniform(1, 8) / 4.0f;
    s->iv = (fitm_intervention){.spans = s->spans, .n_spans = 2, .alpha = s->alpha,
                                .from_pos = s->pos + uniform(0, s->T - 1)};
    int n_rows = s->T > 1 ? 2 : 1;
    s->cap_rows[0] = s->pos + s->T - 1;
    s->cap_rows[1] = s->pos;
    s->cap = (fitm_capture){.rows = s->cap_rows, .n_rows = n_rows, .spans = s->spans,
                            .n_spans = 3, .probs_stride = CTX,
                            .after_intervention = uniform(0, 1)};
}

static fitm_forward_opts opts_of(seq *s, int which, fitm_capture *cap)
{
    *cap = s->cap;
    cap->span_mass = s->mass[which];
    cap->probs = s->probs[which];
    return (fitm_forward_opts){
        .prefix = s->prefix,
        .n_logits = s->n_logits,
        .logits = which == 0 && s->no_logits ? NULL : s->logits[which],
        .top_k = s->top_k,
        .top = s->top[which],
        .n_pick = s->n_pick,
        .pick = s->pick,
        .logprob = s->lp[which],
        .capture = s->use_cap ? cap : NULL,
        .intervention = s->use_iv ? &s->iv : NULL,
        .position = s->position,
    };
}

/* Whether lp (rows, n_pick) is fitm_ops_logprob of each row of logits (rows, V) at its picks,
 * bit for bit: the values /rerank's scores on the CPU were computed from before the
 * backends computed them. */
static bool picks_of_rows(const float *logits, int64_t rows, int64_t V, const int32_t *pick,
                          int32_t n_pick, const double *lp)
{
    double want[FITM_PICK_MAX];
    for (int64_t i = 0; i < rows; i++) {
        fitm_ops_logprob(logits + i * V, V, pick + i * n_pick, n_pick, want);
        if (memcmp(want, lp + i * n_pick, sizeof(double) * (size_t)n_pick))
            return false;
    }
    return true;
}

static bool same_rows(const seq *s, const fitm_model_config *c)
{
    const int64_t n = (fitm_kv_pos_end(s->bat) - fitm_kv_pos_base(s->bat)) * c->n_head_kv *
                      c->head_dim;
    if (fitm_kv_pos_end(s->bat) != fitm_kv_pos_end(s->solo))
        return false;
    const size_t bytes = (size_t)n * fitm_kv_elem_bytes(s->bat);
    for (int32_t l = 0; l < c->n_layer; l++)
        if (memcmp(fitm_kv_k(s->bat, l), fitm_kv_k(s->solo, l), bytes) ||
            memcmp(fitm_kv_v(s->bat, l), fitm_kv_v(s->solo, l), bytes))
            return false;
    return true;
}

static void test_model(fitm_model *m, fitm_gen_arch arch, fitm_dtype type, bool kv_half)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab, L = c->n_layer, H = c->n_head;
    fitm_err err;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *prefix = NULL;
    seq S[N_SEQ];
    memset(S, 0, sizeof S);
    fitm_forward_params fp = {MAX_T, CTX, MAX_T};
    CHECK(fitm_backend_cpu_create(&b, 2, &err) == FITM_OK);
    CHECK(!b || fitm_backend_set_kv_half(b, kv_half, &err) == FITM_OK, " %s", err.msg);
    CHECK(fitm_forward_create(&fw, m, b, &fp, &err) == FITM_OK, " %s", err.msg);
    CHECK(!fw || fitm_forward_positions(fw, NULL, &err) == FITM_OK, " %s", err.msg);
    CHECK(fitm_kv_create(&prefix, b, c, CTX, &err) == FITM_OK);
    bool ok = fw && prefix;
    for (int i = 0; i < N_SEQ && ok; i++) {
        ok = !fitm_kv_create(&S[i].bat, b, c, CTX, &err) &&
             !fitm_kv_create(&S[i].solo, b, c, CTX, &err);
        for (int w = 0; w < 2 && ok; w++) {
            S[i].logits[w] = malloc(sizeof(float) * (size_t)(MAX_T * V));
            S[i].mass[w] = malloc(sizeof(float) * (size_t)(2 * L * H * 3));
            S[i].probs[w] = malloc(sizeof(float) * (size_t)(2 * L * H * CTX));
            S[i].top[w] = malloc(sizeof(fitm_top) * (size_t)(MAX_T * FITM_TOP_MAX));
            S[i].lp[w] = malloc(sizeof(double) * (size_t)(MAX_T * FITM_PICK_MAX));
            ok = S[i].logits[w] && S[i].mass[w] && S[i].probs[w] && S[i].top[w] && S[i].lp[w];
        }
    }
    CHECK(ok);
    if (!ok)
        goto out;

    /* The shared prefix for the branches: 20 random tokens. */
    int32_t pre_ids[20];
    for (int t = 0; t < 20; t++)
        pre_ids[t] = (int32_t)uniform(0, V - 1);
    CHECK(fitm_forward_run(fw, prefix, pre_ids, 20, 0, NULL, &err) == FITM_OK);
    /* Histories: sequences 0-3 ordinary (some empty, some long enough to overrun gemma3's
     * window), 4 and 5 branches over the prefix at different bases. */
    for (int i = 0; i < N_SEQ; i++) {
        seq *s = &S[i];
        int64_t base = 0;
        if (i >= 4) {
            base = i == 4 ? 8 : 15;
            s->prefix = prefix;
            CHECK(fitm_kv_rebase(s->bat, base, &err) == FITM_OK);
            CHECK(fitm_kv_rebase(s->solo, base, &err) == FITM_OK);
            memcpy(s->ids, pre_ids, sizeof(int32_t) * (size_t)base);
        }
        s->pos = base;
        int64_t hist = i == 0 ? 0 : uniform(1, 30);
        for (int64_t t = 0; t < hist; t++)
            s->ids[base + t] = (int32_t)uniform(0, V - 1);
        if (hist > 0) {
            fitm_forward_opts o = {.prefix = s->prefix};
            CHECK(fitm_forward_run(fw, s->bat, s->ids + base, hist, base, &o, &err) == FITM_OK);
            CHECK(fitm_forward_run(fw, s->solo, s->ids + base, hist, base, &o, &err) == FITM_OK);
        }
        s->pos = base + hist;
    }

    for (int round = 0; round < N_ROUNDS; round++) {
        /* Round 0 and 2: decode steps only (all on the STEP path, packed); others mixed. */
        fitm_forward_seq in[N_SEQ];
        fitm_capture caps[N_SEQ][2];
        fitm_forward_opts opts[N_SEQ][2];
        int32_t n = 0, idx[N_SEQ];
        int64_t total = 0;
        /* Some decode rounds ask every sequence for the same k lists and no logits, as /answer's
         * decode steps do; others mix. */
        static const int32_t shared_ks[] = {1, 3, FITM_TOP_MAX};
        const int32_t shared_k = round % 2 == 0 && uniform(0, 1) ? shared_ks[uniform(0, 2)] : 0;
        for (int i = 0; i < N_SEQ; i++) {
            seq *s = &S[i];
            if (s->pos >= CTX - 1 || uniform(0, 5) == 0)
                continue; /* sits this call out */
            fill_part(s, c, round % 2 == 0 || uniform(0, 1));
            if (shared_k)
                s->top_k = shared_k > c->n_vocab ? (int32_t)c->n_vocab : shared_k;
            s->no_logits = (s->top_k > 0 || s->n_pick > 0) && (shared_k || uniform(0, 1));
            if (total + s->T > MAX_T)
                continue;
            total += s->T;
            opts[i][0] = opts_of(s, 0, &caps[i][0]);
            opts[i][1] = opts_of(s, 1, &caps[i][1]);
            in[n] = (fitm_forward_seq){s->bat, s->ids + s->pos, s->T, s->pos, &opts[i][0]};
            idx[n++] = i;
        }
        if (n == 0)
            continue;
        /* log-probabilities from the backend's logprob and from the driver's host path (a
         * backend without the slot: the rows the call downloads, or its own download when it
         * asked for none) must both be fitm_ops_logprob of the rows: rounds 0 and 2 run the
         * slot in both calls, round 1 the slot batched and the host path solo, round 3 the
         * host path in both */
        const fitm_backend_ops *own = b->ops;
        fitm_backend_ops host_lp = *own;
        host_lp.logprob = NULL;
        b->ops = round == 3 ? &host_lp : own;
        CHECK(fitm_forward_run_batch(fw, in, n, &err) == FITM_OK, " %s", err.msg);
        b->ops = round % 2 ? &host_lp : own;
        for (int32_t k = 0; k < n; k++) {
            seq *s = &S[idx[k]];
            CHECK(fitm_forward_run(fw, s->solo, s->ids + s->pos, s->T, s->pos, &opts[idx[k]][1],
                                   &err) == FITM_OK,
                  " %s", err.msg);
            const char *what = "";
            if (!s->no_logits &&
                memcmp(s->logits[0], s->logits[1], sizeof(float) * (size_t)(s->n_logits * V)))
                what = "logits";
            else if (memcmp(s->top[0], s->top[1],
                            sizeof(fitm_top) * (size_t)(s->n_logits * s->top_k)))
                what = "top-k lists";
            else if (memcmp(s->lp[0], s->lp[1],
                            sizeof(double) * (size_t)(s->n_logits * s->n_pick)))
                what = "log-probabilities";
            else if (!picks_of_rows(s->logits[1], s->n_logits, V, s->pick, s->n_pick, s->lp[1]))
                what = "log-probabilities of the downloaded rows";
            else if (s->use_cap &&
                     memcmp(s->mass[0], s->mass[1],
                            sizeof(float) * (size_t)(s->cap.n_rows * L * H * 3)))
                what = "span masses";
            else if (s->use_cap &&
                     memcmp(s->probs[0], s->probs[1],
                            sizeof(float) * (size_t)(s->cap.n_rows * L * H * CTX)))
                what = "attention rows";
            else if (!same_rows(s, c))
                what = "KV rows";
            CHECK(!*what,
                  " %s %s, %s KV, round %d seq %d (T %lld at %lld, %d in the call): %s differ",
                  fitm_gen_arch_name(arch), fitm_dtype_info_of(type)->name,
                  kv_half ? "fp16" : "F32", round, idx[k],
                  (long long)s->T, (long long)s->pos, (int)n, what);
            s->pos += s->T;
        }
        b->ops = own;
    }

    /* Bad calls fail whole and leave every cache as it was. */
    int64_t end0 = fitm_kv_pos_end(S[0].bat), end1 = fitm_kv_pos_end(S[1].bat);
    int32_t tok[2] = {1, 2}, bad = (int32_t)V;
    fitm_forward_seq dup[2] = {{S[0].bat, tok, 1, end0, NULL}, {S[0].bat, tok, 1, end0, NULL}};
    CHECK(fitm_forward_run_batch(fw, dup, 2, &err) == FITM_ERR_INVALID);
    fitm_forward_opts over = {.prefix = S[0].bat};
    fitm_forward_seq reads[2] = {{S[0].bat, tok, 1, end0, NULL}, {S[4].bat, tok, 1, 30, &over}};
    CHECK(fitm_forward_run_batch(fw, reads, 2, &err) == FITM_ERR_INVALID);
    fitm_forward_seq badtok[2] = {{S[0].bat, tok, 1, end0, NULL}, {S[1].bat, &bad, 1, end1, NULL}};
    CHECK(fitm_forward_run_batch(fw, badtok, 2, &err) == FITM_ERR_INVALID);
    CHECK(strstr(err.msg, "sequence 1") != NULL, " %s", err.msg);
    int32_t many[MAX_T] = {0};
    fitm_forward_seq big[2] = {{S[0].bat, many, MAX_T / 2 + 1, 0, NULL},
                               {S[1].bat, many, MAX_T / 2, 0, NULL}};
    CHECK(fitm_forward_run_batch(fw, big, 2, &err) == FITM_ERR_LIMIT);
    CHECK(fitm_forward_run_batch(fw, big, 0, &err) == FITM_ERR_INVALID);
    CHECK(fitm_kv_pos_end(S[0].bat) == end0 && fitm_kv_pos_end(S[1].bat) == end1);
out:
    for (int i = 0; i < N_SEQ; i++) {
        fitm_kv_destroy(S[i].bat);
        fitm_kv_destroy(S[i].solo);
        for (int w = 0; w < 2; w++) {
            free(S[i].logits[w]);
            free(S[i].mass[w]);
            free(S[i].probs[w]);
            free(S[i].top[w]);
            free(S[i].lp[w]);
        }
    }
    fitm_kv_destroy(prefix);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
}

/* Picked log-probabilities where the rows are not the output head's plain product: a gemma3
 * model without a sliding window whose file sets a final softcap (the logits are capped on the
 * backend before anything is picked), and Attention Buckets (the rows are log p^, made on the
 * host from every pass). Each call asks for the rows and the picks; the picks must be
 * fitm_ops_logprob of those rows, bit for bit, and a call asking for the picks alone must give
 * the same. */
static void test_picks(void)
{
    fitm_gen_config cfg;
    fitm_gen_defaults(&cfg, FITM_GEN_ARCH_GEMMA3);
    cfg.type = FITM_DTYPE_Q8_0;
    cfg.n_layer = 2;
    const float cap = 0.75f; /* below the model's largest logits: the cap must bite */
    fitm_gguf_writer *w = NULL;
    fitm_err err = {{0}};
    void *buf = NULL;
    size_t nb = 0;
    fitm_gguf *g = NULL;
    fitm_model *m = NULL;
    CHECK(fitm_gen_build(&cfg, &w, &err) == FITM_OK &&
              fitm_gguf_writer_set_u32(w, "gemma3.attention.sliding_window", 0, &err) == FITM_OK &&
              fitm_gguf_writer_set_f32(w, "gemma3.final_logit_softcapping", cap, &err) == FITM_OK &&
              fitm_gguf_writer_write_memory(w, &buf, &nb, &err) == FITM_OK &&
              fitm_gguf_open_memory(&g, buf, nb, &err) == FITM_OK &&
              fitm_model_from_gguf(&m, g, &err) == FITM_OK,
          " softcapped model: %s", err.msg);
    fitm_gguf_writer_destroy(w);
    if (!m) {
        free(buf);
        return;
    }
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab, T = 12, NL = 5, NP = 3;
    CHECK(c->final_softcap == cap, " the file's softcap was not read (%g)", c->final_softcap);
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_kv *kv = NULL;
    fitm_forward_params fp = {MAX_T, CTX, MAX_T};
    float *logits = malloc(sizeof(float) * (size_t)(NL * V));
    double *lp = malloc(sizeof(double) * (size_t)(NL * NP)), *lp2 = malloc(sizeof *lp2 * NL * NP);
    int32_t ids[12], pick[5 * 3];
    for (int64_t t = 0; t < T; t++)
        ids[t] = (int32_t)uniform(0, V - 1);
    for (int64_t i = 0; i < NL * NP; i++)
        pick[i] = i == 0 ? 0 : i == 1 ? (int32_t)(V - 1) : (int32_t)uniform(0, V - 1);
    bool ok = logits && lp && lp2 && fitm_backend_cpu_create(&b, 2, &err) == FITM_OK &&
              fitm_forward_create(&fw, m, b, &fp, &err) == FITM_OK &&
              fitm_forward_positions(fw, NULL, &err) == FITM_OK &&
              fitm_kv_create(&kv, b, c, CTX, &err) == FITM_OK;
    CHECK(ok, " %s", err.msg);
    for (int method = 0; ok && method < 2; method++) {
        const fitm_position_method pm = method ? FITM_POSITION_BUCKETS : FITM_POSITION_NONE;
        CHECK(fitm_kv_passes(kv, method ? FITM_BUCKETS : 1, 0, &err) == FITM_OK, " %s", err.msg);
        fitm_forward_opts o = {.n_logits = NL, .logits = logits, .n_pick = (int32_t)NP,
                               .pick = pick, .logprob = lp, .position = pm};
        CHECK(fitm_forward_run(fw, kv, ids, T, 0, &o, &err) == FITM_OK, " %s", err.msg);
        float most = 0.0f;
        for (int64_t i = 0; i < NL * V; i++)
            most = fabsf(logits[i]) > most ? fabsf(logits[i]) : most;
        CHECK(method || (most <= cap && most > 0.5f * cap),
              " softcap %g: largest logit %g (the cap does not bite)", cap, most);
        CHECK(picks_of_rows(logits, NL, V, pick, (int32_t)NP, lp),
              " %s: picks are not the log-probabilities of the rows",
              fitm_position_method_name(pm));
        o.logits = NULL;
        o.logprob = lp2;
        CHECK(fitm_forward_run(fw, kv, ids, T, 0, &o, &err) == FITM_OK, " %s", err.msg);
        CHECK(!memcmp(lp, lp2, sizeof(double) * (size_t)(NL * NP)),
              " %s: picks without the rows differ", fitm_position_method_name(pm));
    }
    /* bad picks fail the call and leave the cache */
    const int64_t end = fitm_kv_pos_end(kv);
    int32_t bad = (int32_t)V;
    fitm_forward_opts o = {.n_logits = 1, .n_pick = 1, .pick = &bad, .logprob = lp};
    CHECK(!ok || fitm_forward_run(fw, kv, ids, 1, end, &o, &err) == FITM_ERR_INVALID);
    o.pick = pick, o.n_pick = FITM_PICK_MAX + 1;
    CHECK(!ok || fitm_forward_run(fw, kv, ids, 1, end, &o, &err) == FITM_ERR_INVALID);
    o.n_pick = 1, o.logprob = NULL;
    CHECK(!ok || fitm_forward_run(fw, kv, ids, 1, end, &o, &err) == FITM_ERR_INVALID);
    CHECK(!ok || fitm_kv_pos_end(kv) == end);
    fitm_kv_destroy(kv);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
    fitm_model_close(m);
    free(buf);
    free(logits), free(lp), free(lp2);
}

/* One sequence of test_layers: a cache, its capture and logits. */
typedef struct {
    fitm_kv *kv;
    float *mass, *probs, *logits;
    fitm_capture cap;
    fitm_forward_opts o;
} lseq;

enum { L_T = 10, L_SPANS = 2 };

static const int64_t l_rows[2] = {L_T - 1, 4}, l_row0[1] = {0};
static const fitm_span l_spans[L_SPANS] = {{1, 4}, {5, 8}};

/* A sequence whose calls run n_layers (0: all), with n_logits, over L_T tokens or (one_row)
 * one. */
static bool lseq_init(lseq *q, fitm_backend *b, const fitm_model_config *c, int32_t n_layers,
                      int64_t n_logits, bool one_row)
{
    const size_t slots = (size_t)(2 * c->n_layer * c->n_head);
    fitm_err err;
    memset(q, 0, sizeof *q);
    if (fitm_kv_create(&q->kv, b, c, CTX, &err) != FITM_OK)
        return false;
    q->mass = malloc(sizeof(float) * slots * L_SPANS);
    q->probs = malloc(sizeof(float) * slots * CTX);
    q->logits = malloc(sizeof(float) * (size_t)(2 * c->n_vocab));
    if (!q->mass || !q->probs || !q->logits)
        return false;
    memset(q->mass, 0x7f, sizeof(float) * slots * L_SPANS); /* not zeros: must be set */
    memset(q->probs, 0x7f, sizeof(float) * slots * CTX);
    q->cap = (fitm_capture){.rows = one_row ? l_row0 : l_rows, .n_rows = one_row ? 1 : 2,
                            .spans = l_spans, .n_spans = L_SPANS,
                            .span_mass = q->mass, .probs = q->probs, .probs_stride = CTX};
    q->o = (fitm_forward_opts){.capture = &q->cap, .n_layers = n_layers, .n_logits = n_logits,
                               .logits = n_logits ? q->logits : NULL};
    return true;
}

static void lseq_free(lseq *q)
{
    fitm_kv_destroy(q->kv);
    free(q->mass);
    free(q->probs);
    free(q->logits);
}

/* Whether q's capture and cache match whole's in layers [0, n) and q's capture is 0 after. */
static const char *layers_differ(const lseq *q, const lseq *whole, const fitm_model_config *c,
                                 int32_t n)
{
    const int64_t L = c->n_layer, H = c->n_head;
    for (int r = 0; r < q->cap.n_rows; r++)
        for (int64_t l = 0; l < L; l++) {
            const int64_t slot = (r * L + l) * H;
            const float *m = q->mass + slot * L_SPANS, *p = q->probs + slot * CTX;
            if (l < n) {
                if (memcmp(m, whole->mass + slot * L_SPANS, sizeof(float) * (size_t)(H * L_SPANS)))
                    return "span masses";
                if (memcmp(p, whole->probs + slot * CTX, sizeof(float) * (size_t)(H * CTX)))
                    return "attention rows";
                continue;
            }
            for (int64_t i = 0; i < H * L_SPANS; i++)
                if (m[i] != 0.0f)
                    return "span masses past the last layer run";
            for (int64_t i = 0; i < H * CTX; i++)
                if (p[i] != 0.0f)
                    return "attention rows past the last layer run";
        }
    const size_t bytes = (size_t)(fitm_kv_pos_end(q->kv) * c->n_head_kv * c->head_dim) *
                         fitm_kv_elem_bytes(q->kv);
    if (fitm_kv_pos_end(q->kv) != fitm_kv_pos_end(whole->kv))
        return "cache ends";
    for (int32_t l = 0; l < n; l++)
        if (memcmp(fitm_kv_k(q->kv, l), fitm_kv_k(whole->kv, l), bytes) ||
            memcmp(fitm_kv_v(q->kv, l), fitm_kv_v(whole->kv, l), bytes))
            return "KV rows";
    return NULL;
}

/* Calls that run only their first layers, alone and packed with whole ones. */
static void test_layers(fitm_model *m, fitm_gen_arch arch, fitm_dtype type, bool kv_half)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    const int32_t L = c->n_layer, k = (int32_t)uniform(1, L - 1);
    const char *name = fitm_gen_arch_name(arch), *tname = fitm_dtype_info_of(type)->name;
    fitm_err err;
    fitm_backend *b = NULL;
    fitm_forward *fw = NULL;
    fitm_forward_params fp = {MAX_T, CTX, MAX_T};
    enum { WHOLE, PART, WHOLE_B, PART_B, STEP_B, DEC_B, STEP_S, DEC_S, N_L };
    lseq q[N_L];
    memset(q, 0, sizeof q);
    CHECK(fitm_backend_cpu_create(&b, 2, &err) == FITM_OK);
    CHECK(!b || fitm_backend_set_kv_half(b, kv_half, &err) == FITM_OK, " %s", err.msg);
    CHECK(b && fitm_forward_create(&fw, m, b, &fp, &err) == FITM_OK, " %s", err.msg);
    bool ok = fw != NULL;
    for (int i = 0; i < N_L && ok; i++)
        ok = lseq_init(&q[i], b, c, i == PART || i == PART_B || i == STEP_B || i == STEP_S ? k : 0,
                       i == DEC_B || i == DEC_S ? 1 : 0, i >= STEP_B);
    CHECK(ok);
    int32_t ids[L_T + 1];
    for (int t = 0; t <= L_T; t++)
        ids[t] = (int32_t)uniform(0, c->n_vocab - 1);
    if (!ok)
        goto out;

    /* Alone: the first k layers of a whole pass. */
    CHECK(fitm_forward_run(fw, q[WHOLE].kv, ids, L_T, 0, &q[WHOLE].o, &err) == FITM_OK, " %s",
          err.msg);
    CHECK(fitm_forward_run(fw, q[PART].kv, ids, L_T, 0, &q[PART].o, &err) == FITM_OK, " %s",
          err.msg);
    const char *what = layers_differ(&q[PART], &q[WHOLE], c, k);
    CHECK(!what, " %s %s, %s KV, %d of %d layers: %s differ", name, tname,
          kv_half ? "fp16" : "F32", (int)k, (int)L, what);
    CHECK(fitm_kv_layers(q[PART].kv) == k && fitm_kv_layers(q[WHOLE].kv) == L);

    /* Packed: a part and a whole prefill (BATCH), a part and a whole decode step (STEP), each
     * against the same call alone; the part's rows lie between the whole ones' in each path. */
    fitm_forward_seq in[4] = {
        {q[DEC_B].kv, ids, 1, 0, &q[DEC_B].o},
        {q[PART_B].kv, ids, L_T, 0, &q[PART_B].o},
        {q[STEP_B].kv, ids, 1, 0, &q[STEP_B].o},
        {q[WHOLE_B].kv, ids, L_T, 0, &q[WHOLE_B].o},
    };
    q[STEP_B].o.path = q[STEP_S].o.path = FITM_PATH_STEP;
    CHECK(fitm_forward_run_batch(fw, in, 4, &err) == FITM_OK, " %s", err.msg);
    CHECK(fitm_forward_run(fw, q[STEP_S].kv, ids, 1, 0, &q[STEP_S].o, &err) == FITM_OK);
    CHECK(fitm_forward_run(fw, q[DEC_S].kv, ids, 1, 0, &q[DEC_S].o, &err) == FITM_OK);
    const struct {
        int a, b;
        int32_t n;
    } pairs[] = {{PART_B, WHOLE, k}, {WHOLE_B, WHOLE, L}, {STEP_B, STEP_S, k}, {DEC_B, DEC_S, L}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        const lseq *x = &q[pairs[i].a], *y = &q[pairs[i].b];
        what = layers_differ(x, y, c, pairs[i].n);
        CHECK(!what, " %s %s, packed call, sequence %d: %s differ", name, tname, pairs[i].a,
              what);
    }
    CHECK(!memcmp(q[DEC_B].logits, q[DEC_S].logits, sizeof(float) * (size_t)c->n_vocab),
          " %s %s: a decode step's logits beside a part pass differ", name, tname);

    /* Rows the cache holds in fewer layers than a call runs cannot be read. */
    fitm_forward_opts whole = {0}, part = {.n_layers = k}, logits = {.n_layers = k, .n_logits = 1,
                                                                      .logits = q[PART].logits};
    CHECK(fitm_forward_run(fw, q[PART].kv, ids + L_T, 1, L_T, &whole, &err) == FITM_ERR_INVALID);
    CHECK(strstr(err.msg, "layers") != NULL, " %s", err.msg);
    CHECK(fitm_forward_run(fw, q[PART].kv, ids + L_T, 1, L_T, &logits, &err) == FITM_ERR_INVALID);
    CHECK(fitm_forward_run(fw, q[PART].kv, ids + L_T, 1, L_T, &part, &err) == FITM_OK, " %s",
          err.msg);
    fitm_forward_opts too_many = {.n_layers = L + 1};
    CHECK(fitm_forward_run(fw, q[WHOLE].kv, ids + L_T, 1, L_T, &too_many, &err) ==
          FITM_ERR_INVALID);
    /* a branch over a part prefix: as many layers or fewer only */
    fitm_forward_opts over = {.prefix = q[PART].kv}, over_part = {.prefix = q[PART].kv,
                                                                   .n_layers = k};
    CHECK(fitm_kv_rebase(q[PART_B].kv, 6, &err) == FITM_OK);
    CHECK(fitm_kv_layers(q[PART_B].kv) == L);
    CHECK(fitm_forward_run(fw, q[PART_B].kv, ids + 6, 2, 6, &over, &err) == FITM_ERR_INVALID);
    CHECK(fitm_forward_run(fw, q[PART_B].kv, ids + 6, 2, 6, &over_part, &err) == FITM_OK, " %s",
          err.msg);
    /* a whole call from the base again, then continuing it */
    CHECK(fitm_forward_run(fw, q[PART].kv, ids, 4, 0, &whole, &err) == FITM_OK, " %s", err.msg);
    CHECK(fitm_kv_layers(q[PART].kv) == L);
    CHECK(fitm_forward_run(fw, q[PART].kv, ids + 4, 2, 4, &whole, &err) == FITM_OK, " %s",
          err.msg);
    fitm_kv_truncate(q[WHOLE].kv, 3);
    CHECK(fitm_forward_run(fw, q[WHOLE].kv, ids + 3, 1, 3, &part, &err) == FITM_OK);
    CHECK(fitm_kv_layers(q[WHOLE].kv) == k);
    fitm_kv_truncate(q[WHOLE].kv, 0);
    CHECK(fitm_kv_layers(q[WHOLE].kv) == L);
out:
    for (int i = 0; i < N_L; i++)
        lseq_free(&q[i]);
    fitm_forward_destroy(fw);
    fitm_backend_destroy(b);
}

/* Usage: test_forward_batch [f32 | f16]: the models with F32 caches (and the picks), with fp16
 * ones, or (no argument) both; meson runs the two halves as two tests, side by side. */
int main(int argc, char **argv)
{
    const char *env = getenv("FITM_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    printf("test_forward_batch: seed %" PRIu64 " (FITM_TEST_SEED repeats it)\n", seed);
    const bool only = argc > 1;
    if (only && strcmp(argv[1], "f32") != 0 && strcmp(argv[1], "f16") != 0) {
        fprintf(stderr, "usage: test_forward_batch [f32 | f16]\n");
        return 2;
    }
    const int half_from = only && !strcmp(argv[1], "f16") ? 1 : 0;
    const int half_to = only && !strcmp(argv[1], "f32") ? 0 : 1;
    const fitm_dtype types[] = {FITM_DTYPE_F32,  FITM_DTYPE_F16,  FITM_DTYPE_BF16,
                                FITM_DTYPE_Q4_0, FITM_DTYPE_Q5_0, FITM_DTYPE_Q8_0,
                                FITM_DTYPE_Q4_K, FITM_DTYPE_Q5_K, FITM_DTYPE_Q6_K};
    /* a model is generated once for all that runs on it: generation (the K types' quantizer
     * above all) costs more than the calls */
    for (int a = 0; a < FITM_GEN_ARCH_COUNT; a++)
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            void *buf;
            fitm_model *m = gen_model((fitm_gen_arch)a, types[t], &buf);
            for (int half = half_from; half <= half_to && m; half++) {
                rng = fitm_rng_mix(seed ^ ((uint64_t)a << 32) ^ t ^ ((uint64_t)half << 40));
                test_model(m, (fitm_gen_arch)a, types[t], half);
                test_layers(m, (fitm_gen_arch)a, types[t], half);
            }
            if (m)
                fitm_model_close(m);
            free(buf);
        }
    rng = fitm_rng_mix(seed ^ 0x9c);
    if (half_from == 0)
        test_picks();
    if (failures) {
        fprintf(stderr, "test_forward_batch: %d of %d checks failed\n", failures, n_checks);
        return 1;
    }
    printf("test_forward_batch: ok (%d checks)\n", n_checks);
    return 0;
}
