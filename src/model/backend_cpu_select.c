/* backend_cpu_select: fitm_backend_cpu_create picks the CPU backend object built for the SIMD
 * path this process runs (base/cpu.h); backend_cpu.c is compiled once per path. Also the
 * backend-independent entry points of backend.h. */
#include "base/cpu.h"
#include "model/backend.h"

fitm_status fitm_backend_cpu_create_baseline(fitm_backend **out, int n_threads, fitm_err *err);
#if defined(__x86_64__)
fitm_status fitm_backend_cpu_create_avx2(fitm_backend **out, int n_threads, fitm_err *err);
fitm_status fitm_backend_cpu_create_avx512(fitm_backend **out, int n_threads, fitm_err *err);
#endif

fitm_status fitm_backend_cpu_create(fitm_backend **out, int n_threads, fitm_err *err)
{
    switch (fitm_cpu_path()) {
#if defined(__x86_64__)
    case FITM_CPU_AVX512:
        return fitm_backend_cpu_create_avx512(out, n_threads, err);
    case FITM_CPU_AVX2:
        return fitm_backend_cpu_create_avx2(out, n_threads, err);
#endif
    default:
        return fitm_backend_cpu_create_baseline(out, n_threads, err);
    }
}

void fitm_backend_destroy(fitm_backend *b)
{
    if (b)
        b->ops->destroy(b);
}

fitm_status fitm_backend_set_kv_half(fitm_backend *b, bool half, fitm_err *err)
{
    if (half && !b->ops->kv_half)
        return fitm_err_set(err, FITM_ERR_UNSUPPORTED,
                            "the %s backend keeps its KV cache as F32 only", b->ops->name);
    b->kv_half = half;
    return FITM_OK;
}
