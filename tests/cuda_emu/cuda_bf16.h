/* cuda_emu: <cuda_bf16.h> of the emulator (the bfloat16 type lives in emu_device.h). */
#include "cuda_runtime.h"
