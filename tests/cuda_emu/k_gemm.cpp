/* The real kernels/gemm.cu compiled by the host compiler against cuda_emu, with the device
 * pointers of a launch's fitm_gemm_outs (its weights and outputs) declared to the emulator's
 * checks. */
#include "cuda_runtime.h"

struct fitm_gemm_outs;
void fitm_emu_arg_pointers(const fitm_gemm_outs &o, fitm_emu_args_check &c);

#include "gemm.cu"

void fitm_emu_arg_pointers(const fitm_gemm_outs &o, fitm_emu_args_check &c)
{
    for (unsigned z = 0; z < c.grid.z; z++) {
        c.ptr(o.W[z]);
        c.ptr(o.y[z]);
    }
}
