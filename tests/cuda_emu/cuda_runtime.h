/* cuda_emu: <cuda_runtime.h> of the emulator: the runtime API, and for C++ the device side. */
#ifndef FITM_CUDA_EMU_RUNTIME_H
#define FITM_CUDA_EMU_RUNTIME_H
#include "cuda_runtime_api.h"
#ifdef __cplusplus
#include "emu_device.h"
#endif
#endif
