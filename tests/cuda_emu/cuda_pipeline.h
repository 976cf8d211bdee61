/* cuda_emu: <cuda_pipeline.h>, the asynchronous copies from global to shared memory
 * (cp.async): __pipeline_memcpy_async, __pipeline_commit, __pipeline_wait_prior.
 *
 * A copy lands as late as a device may land it: not when it is issued but when its thread
 * waits for its group (__pipeline_wait_prior(n) lands every group committed before the newest
 * n; copies issued after the last commit belong to the next group and stay in flight). So a
 * kernel that reads a stage before its own wait, or another thread's copies without that
 * thread's wait and a barrier after it, reads what the shared memory held before, as a device
 * can. Under ThreadSanitizer (FITM_CUDA_EMU_THREADS) the landing is the issuing thread's write
 * at its wait, so a read not ordered after that wait by a barrier is reported.
 *
 * Faults, as a device faults (the launch loses the context): a size other than 4, 8 or 16
 * bytes or a zfill past it (cudaErrorLaunchFailure); a destination or source not aligned to
 * the size (cudaErrorMisalignedAddress); a destination outside the launch's dynamic shared
 * memory or a source (the bytes it reads) outside one device allocation or pinned host memory
 * (cudaErrorIllegalAddress). Faulting copies touch no memory. Stricter than a device: a thread
 * that ends with copies not waited for faults its launch (emu_runtime.cpp). */
#ifndef FITM_CUDA_EMU_PIPELINE_H
#define FITM_CUDA_EMU_PIPELINE_H

#include <stdio.h>
#include <stdlib.h>

#include "cuda_runtime.h"

static inline void __pipeline_memcpy_async(void *__restrict__ dst_shared,
                                           const void *__restrict__ src_global,
                                           size_t size_and_align, size_t zfill = 0)
{
    const size_t n = size_and_align;
    if ((n != 4 && n != 8 && n != 16) || zfill > n) {
        fitm_emu_kernel_fault(cudaErrorLaunchFailure, "an asynchronous copy of a wrong size");
        return;
    }
    if ((uintptr_t)dst_shared % n || (uintptr_t)src_global % n) {
        fitm_emu_kernel_fault(cudaErrorMisalignedAddress, "a misaligned asynchronous copy");
        return;
    }
    if (!fitm_emu_shared_range(dst_shared, n) ||
        (n > zfill && !fitm_emu_device_range(src_global, n - zfill))) {
        fitm_emu_kernel_fault(cudaErrorIllegalAddress,
                              "an asynchronous copy outside shared or device memory");
        return;
    }
    fitm_emu_thread *t = fitm_emu_cur;
    if (!t->async &&
        !(t->async = (fitm_emu_async_copy *)malloc(FITM_EMU_ASYNC_MAX * sizeof *t->async))) {
        fprintf(stderr, "cuda_emu: out of memory for asynchronous copies\n");
        abort();
    }
    if (t->n_async == FITM_EMU_ASYNC_MAX) {
        fprintf(stderr, "cuda_emu: more than %d asynchronous copies in flight in one thread\n",
                (int)FITM_EMU_ASYNC_MAX);
        abort();
    }
    t->async[t->n_async++] = {dst_shared, src_global, (unsigned)(n - zfill), (unsigned)zfill,
                              t->commits};
}

static inline void __pipeline_commit(void)
{
    fitm_emu_cur->commits++;
}

static inline void __pipeline_wait_prior(size_t prior)
{
    fitm_emu_thread *t = fitm_emu_cur;
    int kept = 0;
    for (int i = 0; i < t->n_async; i++) {
        const fitm_emu_async_copy &c = t->async[i];
        if (c.group + prior < t->commits) { /* its group is older than the newest prior */
            memcpy(c.dst, c.src, c.n);
            memset((char *)c.dst + c.n, 0, c.zfill);
        } else {
            t->async[kept++] = c;
        }
    }
    t->n_async = kept;
}

#endif
