/* backend_check: a backend checked against another on the loaded model (fitmd's start-up
 * self-test before it serves from a GPU). */
#ifndef FITM_BACKEND_CHECK_H
#define FITM_BACKEND_CHECK_H

#include <stdint.h>

#include "base/status.h"
#include "model/backend.h"
#include "model/model.h"

/* Prompt length of the check: long enough that every layer's attention mixes several keys
 * (and a sliding window of 4 or more is crossed), short enough to cost a CPU pass of a 7B
 * model about a second. */
#define FITM_BACKEND_CHECK_TOKENS 8

typedef struct {
    double logit_err; /* worst |test - ref| over the last row's logits, / its largest |ref| */
    double prob_err;  /* worst |test - ref| over the last row's attention probabilities,
                         every layer and head                                              */
    double logit_tol, prob_tol; /* the bounds they were held to                            */
} fitm_backend_check_report;

/* What test's BATCH products multiply in: float operands (as the CPU backend), or bfloat16
 * operands with float sums (the CUDA backend's gpu_weights = bf16), which the bounds allow for. */
typedef enum { FITM_CHECK_PRODUCTS_F32, FITM_CHECK_PRODUCTS_BF16 } fitm_check_products;

/* Runs one short prompt (FITM_BACKEND_CHECK_TOKENS fixed token ids spread over the vocabulary)
 * through m on ref and on test, and compares the last row's logits and its attention
 * probabilities in every layer and head. Tolerances (derived in backend_check.c): with F32
 * products 1e-3 of the largest logit (5e-2 when the output head is quantized: the CPU backend
 * rounds the head's input to Q8) and 1e-3 absolute for probabilities; with BF16 products
 * 1e-1 of the largest logit and 1e-1 absolute for probabilities. rep (may be NULL) gets the
 * figures whatever the outcome. FITM_ERR_BACKEND with both figures when a bound is broken; a
 * failure to run on either backend is returned as it came, prefixed with the backend's
 * name. */
fitm_status fitm_backend_check(const fitm_model *m, fitm_backend *ref, fitm_backend *test,
                               fitm_check_products products, fitm_backend_check_report *rep,
                               fitm_err *err);

#endif
