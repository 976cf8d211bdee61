/* backend_cuda: the CUDA backend (backend_cuda.c), the model resident on one GPU.
 * Built into fitm_core when the CUDA toolchain is there (FITM_HAVE_CUDA); the tests also build
 * it against the CPU emulator of tests/cuda_emu. */
#ifndef FITM_BACKEND_CUDA_H
#define FITM_BACKEND_CUDA_H

#include "model/backend.h"

/* A backend on CUDA device `device`. FITM_ERR_BACKEND (with the runtime's words) when there is
 * no such device or its context cannot be set up. *out is NULL on failure. */
fitm_status fitm_backend_cuda_create(fitm_backend **out, int device, fitm_err *err);

/* Whether b (from fitm_backend_cuda_create) captures the work between two waits as a CUDA
 * graph and replays it (on by default; backend_cuda.c): the results are the same bit for bit,
 * only the number of submissions changes. For tests and benchmarks that compare the two. */
void fitm_backend_cuda_set_graphs(fitm_backend *b, bool on);

/* Whether b's kernels launch programmatically (kernels/common.cuh: a kernel's grid may launch
 * while the kernel before it runs and waits for it at its first statement, which hides the
 * gap between two kernels): on by default where the device passed fitm_cuda_pdl_probe when b
 * was created (compute capability 9.0 or later), never elsewhere. The results are the same
 * bit for bit. Returns whether they are on after the call. For tests and benchmarks that
 * compare the two. */
bool fitm_backend_cuda_set_pdl(fitm_backend *b, bool on);
bool fitm_backend_cuda_pdl(const fitm_backend *b);

/* Whether b submits the work between two waits as one graph (ops 0, the default) or in
 * pieces: once ops ops are in a capture, it is submitted and the next op begins the next
 * piece, so the device runs a piece while the host captures the one after it (at most 8
 * pieces between two waits; the last takes the rest). The results are the same bit for bit,
 * only when the device starts changes. For tests and benchmarks that compare the two. */
void fitm_backend_cuda_set_pieces(fitm_backend *b, int ops);

/* What the BATCH class (prefill, reference passes) multiplies in. BF16: bfloat16 weights and
 * activations, F32 accumulation (the tensor cores), each layer matrix converted once when a
 * forward prepares the model; F32: weights dequantized to F32 per call, F32 products, as
 * the CPU backend's BATCH path (within float rounding of it). Each computes every row
 * bit-identically whatever T and the row's place in the call. */
typedef enum { FITM_CUDA_WEIGHTS_BF16, FITM_CUDA_WEIGHTS_F32 } fitm_cuda_weights;

/* Sets what b's BATCH products multiply in (FITM_CUDA_WEIGHTS_BF16 by default), from the next
 * product on. The bfloat16 copies are made by a prepare (fitm_forward_create) under BF16: set
 * it before creating the forwards, else each product converts its weight into scratch. */
void fitm_backend_cuda_set_weights(fitm_backend *b, fitm_cuda_weights w);

/* Device bytes of the bfloat16 weight copies the last prepare made (0 under F32). */
size_t fitm_backend_cuda_bf16_bytes(const fitm_backend *b);

/* Whether b runs neighbouring ops of a step as one kernel (on by default): the residual add
 * with the next rmsnorm (and with the post-norm before it, Gemma 3's), a decode step's products of one input (Q, K, V) as one launch, a
 * bfloat16 prompt's products of one input (Q, K, V; gate and up) as one launch, the query and
 * key heads' norms with their RoPE (ops->qk_rope), a decode step's gate and up products with
 * the GLU (ops->matmul_glu). The results are the same
 * bit for bit, only the number of launches changes. For tests and benchmarks that compare
 * the two. */
void fitm_backend_cuda_set_fusion(fitm_backend *b, bool on);

/* Where b's host time goes, counted since it was created: for benchmarks that split a decode
 * step's wall time into the host's and the device's parts. A wait is a cudaStreamSynchronize
 * (the host idle while the device finishes the work before it); a submission ends a capture
 * and runs it: cudaStreamEndCapture, then the instance of that shape updated with the new
 * capture's arguments (cudaGraphExecUpdate) or a new one instantiated, then cudaGraphLaunch;
 * or it is a replay: work equal to an instance's last capture, item for item, is that
 * instance launched again with no capture and no update (counted in graph_launches too). */
typedef struct {
    uint64_t waits, wait_ns;
    uint64_t graph_launches, submit_ns;
    uint64_t graph_updates, graph_instantiations;
    uint64_t graph_replays;
} fitm_backend_cuda_stats;

void fitm_backend_cuda_get_stats(const fitm_backend *b, fitm_backend_cuda_stats *out);

/* Usable CUDA devices: 0 without a driver or a device. */
int fitm_backend_cuda_device_count(void);

/* "NAME (sm_XY, N MiB)" of the device b runs on (b from fitm_backend_cuda_create). */
const char *fitm_backend_cuda_device(const fitm_backend *b);

#endif
