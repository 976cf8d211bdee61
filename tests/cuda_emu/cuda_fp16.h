/* cuda_emu: <cuda_fp16.h> of the emulator (the half type lives in emu_device.h). */
#include "cuda_runtime.h"
