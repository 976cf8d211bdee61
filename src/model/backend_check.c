/* backend_check: one short prompt through the model on two backends, compared.
 *
 * Tolerances. Two correct backends multiply by the same decoded weight values and differ only in
 * the order of float sums and in fused multiply-adds: about sqrt(K) * 6e-8 relative per dot
 * product of length K (1e-6 for K = 256, 6e-6 for K = 11008), grown by each layer's norms and
 * residual sums. tests/test_backend_cuda.c measures about 5e-6 of the largest logit on 2-6 layer
 * models; a 32-layer model multiplies the number of roundings by about 10, so 1e-3 keeps a
 * factor of about 20 over the worst expected. The CPU backend computes the output head on its
 * STEP path, which for a quantized head rounds the head's input to Q8 (1/254 of each block's
 * largest magnitude): over K terms of random sign about sqrt(K)/254 of a typical term, measured
 * up to 1.5e-2 of the largest logit, hence 5e-2 there. Attention probabilities lie in [0, 1]; a
 * score error e moves a probability by at most about p e, and scores carry the same relative
 * error as the hidden states, so 1e-3 absolute leaves the same margin. What a broken kernel
 * gives is far larger: a missing barrier, a wrong mask or a wrong weight decode moves
 * probabilities by 1e-2 and more and logits by tens of percent.
 * BF16 products (the CUDA backend's gpu_weights = bf16) round both operands of every weight
 * product to bfloat16 (8 significant bits, unit roundoff u = 2^-8) and sum in float. Each term
 * moves by up to 2u of itself, about sqrt(2/3) u = 3e-3 rms, independently, so a dot product of
 * random-sign terms carries about 3e-3 of its own size, whatever K: 2000 times the float
 * rounding above (tests/test_backend_cuda.c sees up to 2e-2 of the largest logit and 3e-2 on
 * probabilities on its 2-6 layer models, docs/cuda-backend.md the real Gemma 3 270M's). The
 * errors of the layers add up at random, growing about as the square root of the depth, so a
 * 32-layer model stays within about 2.5 times a 6-layer one: 1e-1 of the largest logit and
 * 1e-1 absolute on probabilities. That bound catches what goes wrong in the bfloat16 products
 * themselves (a weight converted in the wrong layout or type, operands swapped, unrounded
 * garbage: logits off by their own size), not a subtle kernel bug; fitmd runs the F32 check
 * first, which holds every kernel to the float bounds above. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/backend_check.h"
#include "model/forward.h"
#include "model/kv.h"

#define CHECK_T FITM_BACKEND_CHECK_TOKENS
#define LOGIT_TOL 1e-3
#define LOGIT_TOL_Q8 5e-2
#define PROB_TOL 1e-3
#define LOGIT_TOL_BF16 1e-1
#define PROB_TOL_BF16 1e-1

/* One pass over ids on b: the last row's logits (V) and probabilities (L, H, CHECK_T). */
static fitm_status run_one(const fitm_model *m, fitm_backend *b, const int32_t *ids,
                           float *logits, float *probs, fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    const fitm_forward_params fp = {CHECK_T, CHECK_T, 1};
    fitm_forward *f = NULL;
    fitm_kv *kv = NULL;
    fitm_status s = fitm_forward_create(&f, m, b, &fp, err);
    if (s == FITM_OK)
        s = fitm_kv_create(&kv, b, c, CHECK_T, err);
    if (s == FITM_OK) {
        const int64_t row = CHECK_T - 1;
        const fitm_capture cap = {.rows = &row, .n_rows = 1, .probs = probs,
                                  .probs_stride = CHECK_T, .after_intervention = true};
        const fitm_forward_opts o = {.n_logits = 1, .logits = logits, .capture = &cap,
                                     .path = FITM_PATH_BATCH};
        s = fitm_forward_run(f, kv, ids, CHECK_T, 0, &o, err);
    }
    fitm_kv_destroy(kv);
    fitm_forward_destroy(f);
    if (s != FITM_OK)
        fitm_err_prefix(err, "%s backend", b->ops->name);
    return s;
}

fitm_status fitm_backend_check(const fitm_model *m, fitm_backend *ref, fitm_backend *test,
                               fitm_check_products products, fitm_backend_check_report *rep,
                               fitm_err *err)
{
    const fitm_model_config *c = fitm_model_config_of(m);
    const int64_t V = c->n_vocab, np = (int64_t)c->n_layer * c->n_head * CHECK_T;
    fitm_backend_check_report r = {INFINITY, INFINITY, LOGIT_TOL, PROB_TOL};
    if (fitm_dtype_info_of(fitm_model_output(m)->type)->block_elems > 1)
        r.logit_tol = LOGIT_TOL_Q8;
    if (products == FITM_CHECK_PRODUCTS_BF16)
        r.logit_tol = fmax(r.logit_tol, LOGIT_TOL_BF16), r.prob_tol = PROB_TOL_BF16;
    /* ids spread over the vocabulary by a prime stride: many embedding rows, no special care */
    int32_t ids[CHECK_T];
    for (int i = 0; i < CHECK_T; i++)
        ids[i] = (int32_t)(((int64_t)i * 7919 + 17) % V);
    float *buf = malloc(sizeof(float) * (size_t)(2 * (V + np)));
    if (!buf) {
        if (rep)
            *rep = r;
        return fitm_err_set(err, FITM_ERR_NOMEM, "backend check: out of memory");
    }
    float *l_ref = buf, *l_test = buf + V, *p_ref = buf + 2 * V, *p_test = p_ref + np;
    fitm_status s = run_one(m, ref, ids, l_ref, p_ref, err);
    if (s == FITM_OK)
        s = run_one(m, test, ids, l_test, p_test, err);
    if (s == FITM_OK) {
        double mx = 1e-30, e = 0, pe = 0;
        for (int64_t v = 0; v < V; v++) {
            mx = fmax(mx, fabs(l_ref[v]));
            const double d = fabs((double)l_test[v] - l_ref[v]);
            if (!(d <= e)) /* NaN counts as infinitely far */
                e = isnan(d) ? INFINITY : d;
        }
        for (int64_t i = 0; i < np; i++) {
            const double d = fabs((double)p_test[i] - p_ref[i]);
            if (!(d <= pe))
                pe = isnan(d) ? INFINITY : d;
        }
        r.logit_err = e / mx;
        r.prob_err = pe;
        if (!(r.logit_err <= r.logit_tol && r.prob_err <= r.prob_tol))
            s = fitm_err_set(err, FITM_ERR_BACKEND,
                             "%s backend differs from %s: logits by %.3g of the largest "
                             "(tolerance %.3g), attention probabilities by %.3g (tolerance %.3g)",
                             test->ops->name, ref->ops->name, r.logit_err, r.logit_tol,
                             r.prob_err, r.prob_tol);
    }
    free(buf);
    if (rep)
        *rep = r;
    return s;
}
