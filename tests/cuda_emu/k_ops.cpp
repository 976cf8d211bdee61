/* The real kernels/ops.cu compiled by the host compiler against cuda_emu, with the device
 * pointers of a KV store launch's descriptors (an array of gridDim.y fitm_cuda_kv_rows in
 * device memory: the stores' sources and destinations) declared to the emulator's checks. */
#include "cuda_runtime.h"
#include "kernels.h"

void fitm_emu_pointee_pointers(const fitm_cuda_kv_rows *r, fitm_emu_args_check &c)
{
    for (unsigned s = 0; s < c.grid.y && c.bad_arg < 0; s++) {
        const void *ptrs[] = {r[s].k_dst, r[s].v_dst, r[s].k, r[s].v};
        for (const void *p : ptrs)
            c.ptr(p);
    }
}

#include "ops.cu"
