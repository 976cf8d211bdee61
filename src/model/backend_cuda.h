/* backend_cuda: the CUDA backend (backend_cuda.c), the model resident on one GPU.
 * Built into fitm_core when the CUDA toolchain is there (FITM_HAVE_CUDA); the tests also build
 * it against the CPU emulator of tests/cuda_emu. */
#ifndef FITM_BACKEND_CUDA_H
#define FITM_BACKEND_CUDA_H

#include "model/backend.h"

/* A backend on CUDA device `device`. FITM_ERR_BACKEND (with the runtime's words) when there is
 * no such device or its context cannot be set up. *out is NULL on failure. */
fitm_status fitm_backend_cuda_create(fitm_backend **out, int device, fitm_err *err);

#endif
