/* The real kernels/ops.cu compiled by the host compiler against cuda_emu, with the device
 * pointers of a launch's fitm_kv_rows_arg (the KV stores' sources and destinations, gridDim.y
 * stores) declared to the emulator's checks. */
#include "cuda_runtime.h"

struct fitm_kv_rows_arg;
void fitm_emu_arg_pointers(const fitm_kv_rows_arg &a, fitm_emu_args_check &c);

#include "ops.cu"

void fitm_emu_arg_pointers(const fitm_kv_rows_arg &a, fitm_emu_args_check &c)
{
    for (unsigned s = 0; s < c.grid.y && s < FITM_CUDA_KV_ROWS_MAX; s++) {
        const void *ptrs[] = {a.r[s].k_dst, a.r[s].v_dst, a.r[s].k, a.r[s].v};
        for (const void *p : ptrs)
            c.ptr(p);
    }
}
