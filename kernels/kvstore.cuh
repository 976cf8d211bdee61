/* kvstore: KV cache rows' stores (fitm_cuda_kv_rows), shared by the store's own kernel
 * (ops.cu) and the attention launch that does a decode step's stores beside its rows
 * (attention.cu). */
#ifndef FITM_KERNELS_KVSTORE_CUH
#define FITM_KERNELS_KVSTORE_CUH

#include <stdint.h>

#include "kernels.h"

/* f rounded to fp16 bits, nearest even: fitm_fp32_to_fp16's arithmetic, so fp16 cache rows
 * are the CPU backend's bits, NaN payloads included. */
__device__ __forceinline__ uint16_t fitm_fp16_bits(float f)
{
    const uint32_t u = __float_as_uint(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet it, keep the top of the payload */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* from halfway above the largest half, and inf: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* a normal half: rebias the exponent, round at bit 13 */
        a += 0xc8000fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    const uint32_t e = a >> 23; /* a subnormal half (k * 2^-24) or zero */
    if (e < 102)
        return (uint16_t)sign;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t k = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (k & 1u)))
        k++; /* may carry into the smallest normal, which is its encoding */
    return (uint16_t)(sign | k);
}

/* Element e of store r's K (v false) or V values into its destination: copied, or rounded to
 * fp16 bits when the cache holds halves. */
__device__ __forceinline__ void fitm_kv_put(const fitm_cuda_kv_rows &r, bool v, int64_t e)
{
    const float x = v ? r.v[e] : r.k[e];
    void *dst = v ? r.v_dst : r.k_dst;
    if (r.half)
        ((uint16_t *)dst)[e] = fitm_fp16_bits(x);
    else
        ((float *)dst)[e] = x;
}

/* Host checks of the stores r[0..n) (1 <= n <= FITM_CUDA_KV_ROWS_MAX): sizes not negative,
 * pointers set and aligned to their elements. Their largest n into *n_max. */
static inline bool fitm_kv_rows_ok(const fitm_cuda_kv_rows *r, int n, int64_t *n_max)
{
    if (n < 1 || n > FITM_CUDA_KV_ROWS_MAX || !r)
        return false;
    *n_max = 0;
    for (int s = 0; s < n; s++) {
        const fitm_cuda_kv_rows *q = &r[s];
        const uintptr_t dst_align = q->half ? 1u : 3u;
        if (q->n < 0 || (q->n > 0 && (!q->k_dst || !q->v_dst || !q->k || !q->v)) ||
            (((uintptr_t)q->k | (uintptr_t)q->v) & 3u) ||
            (((uintptr_t)q->k_dst | (uintptr_t)q->v_dst) & dst_align))
            return false;
        *n_max = q->n > *n_max ? q->n : *n_max;
    }
    return true;
}

#endif
