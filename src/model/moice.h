/* moice: the MoICE router sidecar (docs/moice.md): a small GGUF file holding, for some layers,
 * the expert RoPE bases and one router per head, with the identity of the base model it was
 * trained on. Loaded once at start-up (fitmd --moice FILE), checked against the loaded model,
 * then read-only: the forward driver reads routers and bases from it (forward.c).
 *
 * Legend: L layers, H heads, N experts, D head dim. */
#ifndef FITM_MOICE_H
#define FITM_MOICE_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "gguf/gguf.h"
#include "model/model.h"

/* Most experts a sidecar may hold (the paper uses 7). */
#define FITM_MOICE_MAX_EXPERTS 32

typedef struct fitm_moice fitm_moice;

/* The base model a sidecar was made for. */
typedef struct {
    char architecture[32];
    uint32_t block_count, head_count, head_count_kv, key_length;
    char sha256[65]; /* 64 lowercase hex digits */
} fitm_moice_base;

/* Reads and validates a sidecar on its own (format, shapes, bases > 1, 1 <= top_k <= N):
 * the error names the key or tensor at fault. *out is NULL on failure. */
fitm_status fitm_moice_load(fitm_moice **out, const char *path, fitm_err *err);

/* NULL is a no-op. */
void fitm_moice_destroy(fitm_moice *mo);

/* The identity of model m, whose GGUF file is at model_path: architecture and shapes from m,
 * SHA-256 of the whole file (read once: about a second per GB). */
fitm_status fitm_moice_model_identity(const fitm_model *m, const char *model_path,
                                      fitm_moice_base *out, fitm_err *err);

/* FITM_OK when the sidecar was made for `base`; else FITM_ERR_INVALID naming the first field
 * that differs with both values ("MoICE sidecar base.sha256 is ..., the model's is ..."). */
fitm_status fitm_moice_check(const fitm_moice *mo, const fitm_moice_base *base, fitm_err *err);

const fitm_moice_base *fitm_moice_base_of(const fitm_moice *mo);
int32_t fitm_moice_n_experts(const fitm_moice *mo);
int32_t fitm_moice_top_k(const fitm_moice *mo);
/* Whether layer l has routers (false for l outside the base's layers). */
bool fitm_moice_routed(const fitm_moice *mo, int32_t l);
/* Layer l's (routed) bases (N) and routers: gate_a, gate_b (H, N, D), gate_out (H, N, N), F32
 * row-major, owned by the sidecar. */
const float *fitm_moice_bases(const fitm_moice *mo, int32_t l);
const float *fitm_moice_gate_a(const fitm_moice *mo, int32_t l);
const float *fitm_moice_gate_b(const fitm_moice *mo, int32_t l);
const float *fitm_moice_gate_out(const fitm_moice *mo, int32_t l);
/* The open file, for metadata (training keys) and `fitm inspect`. */
const fitm_gguf *fitm_moice_gguf(const fitm_moice *mo);

/* The router weights of one query head (docs/moice.md steps 2-3): w (N) from x (D), the
 * query rotated with the first expert's base; scratch holds 3 N floats. Lives here so the
 * driver and the tests share one definition. */
void fitm_moice_route(const fitm_moice *mo, int32_t l, int32_t h, const float *x, float *w,
                      float *scratch);

#endif
