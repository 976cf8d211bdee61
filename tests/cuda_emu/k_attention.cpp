/* The real kernels/attention.cu compiled by the host compiler against cuda_emu, with the
 * device pointers a launch's fitm_cuda_attn holds declared to the emulator's checks (the
 * launch by value, and attention_many's array of them in device memory: gridDim.z calls). */
#include "cuda_runtime.h"
#include "kernels.h"

static void fitm_emu_attn_pointers(const fitm_cuda_attn &a, fitm_emu_args_check &c)
{
    const void *ptrs[] = {a.q,        a.out,       a.k_pre,     a.v_pre,    a.k_own,
                          a.v_own,    a.cap_index, a.cap_spans, a.cap_mass, a.cap_probs,
                          a.iv_spans, a.iv_alpha,  a.mix_q,     a.mix_k,    a.mix_w};
    for (const void *p : ptrs)
        c.ptr(p);
}

void fitm_emu_arg_pointers(const fitm_cuda_attn &a, fitm_emu_args_check &c)
{
    fitm_emu_attn_pointers(a, c);
}

void fitm_emu_pointee_pointers(const fitm_cuda_attn *a, fitm_emu_args_check &c)
{
    for (unsigned z = 0; z < c.grid.z && c.bad_arg < 0; z++)
        fitm_emu_attn_pointers(a[z], c);
}

#include "attention.cu"
