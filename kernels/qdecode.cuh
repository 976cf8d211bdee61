/* qdecode: device-side decoding of the GGML weight layouts, shared by dequant.cu and matvec.cu.
 *
 * The unit of work is a chunk: 8 consecutive elements of a row (or of a whole tensor, since
 * rows are whole blocks). Every block type here groups its elements so that 8 consecutive ones
 * share their scales and come from 8 consecutive bytes of the block, which keeps the decoders
 * branch-free. Block layouts (bytes; d, dmin are IEEE half, little endian):
 *
 *   Q4_0 (32 el, 18 B):  d | qs[16]            x[j] = d*((qs[j%16] >> 4*(j/16) & 15) - 8)
 *   Q5_0 (32 el, 22 B):  d | qh[4] | qs[16]    as Q4_0 with bit j of qh (u32) as bit 4, - 16
 *   Q8_0 (32 el, 34 B):  d | qs[32] (int8)     x[j] = d*qs[j]
 *   Q4_K (256 el, 144 B): d | dmin | scales[12] | qs[128]
 *       sub-block s = j/32 has 6-bit scale sc_s and min m_s packed in scales[12];
 *       4-bit q = qs[32*(j/64) + j%32] >> 4*(s%2) & 15;   x[j] = d*sc_s*q - dmin*m_s
 *   Q5_K (256 el, 176 B): d | dmin | scales[12] | qh[32] | qs[128]
 *       as Q4_K with bit s of qh[j%32] as bit 4 of q
 *   Q6_K (256 el, 210 B): ql[128] | qh[64] | scales[16] (int8) | d
 *       half h = j/128, r = j%128, l = r%32, quarter u = r/32:
 *       q = (ql[64h + 32*(u%2) + l] >> 4*(u/2) & 15) | (qh[32h + l] >> 2u & 3) << 4;
 *       x[j] = d*scales[8h + l/16 + 2u]*(q - 32)
 *
 * Alignment: the caller passes a 16-byte aligned base. Block sizes of the 32-element types
 * and of Q6_K are only even, so their fields are read with 16-bit loads; Q4_K/Q5_K blocks are
 * multiples of 16 bytes and read their quants 8 bytes at a time. */
#ifndef FITM_KERNELS_QDECODE_CUH
#define FITM_KERNELS_QDECODE_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#include "base/dtype.h"

__device__ __forceinline__ float fitm_h2f(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ float fitm_bf2f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/* 16-bit load from a 2-byte aligned address. */
__device__ __forceinline__ uint32_t fitm_ld16(const uint8_t *p)
{
    return *(const uint16_t *)p;
}

/* 8 bytes from a 2-byte aligned address, byte i of the result in bits 8*(i%4) of word i/4. */
__device__ __forceinline__ uint2 fitm_ld8_a2(const uint8_t *p)
{
    uint2 r;
    r.x = fitm_ld16(p) | fitm_ld16(p + 2) << 16;
    r.y = fitm_ld16(p + 4) | fitm_ld16(p + 6) << 16;
    return r;
}

/* 8 bytes from an 8-byte aligned address, same packing. */
__device__ __forceinline__ uint2 fitm_ld8_a8(const uint8_t *p)
{
    return *(const uint2 *)p;
}

__device__ __forceinline__ uint32_t fitm_byte(uint2 w, int i)
{
    return ((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xffu;
}

/* Bits 0..3 of h to bit 0 of bytes 0..3: the product adds copies of h & 15 shifted by 0, 7, 14
 * and 21 (apart, so without carries), which puts bit i of copy i at 8i; no other bit of a copy
 * lands on one of those positions. */
__device__ __forceinline__ uint32_t fitm_bits_to_bytes(uint32_t h)
{
    return (h & 15u) * 0x00204081u & 0x01010101u;
}

/* (float)((int)u - bias) for u and bias below 2^22, without a conversion instruction (a quarter
 * of the FP32 rate): u in the mantissa of 2^23 is the float 2^23 + u exactly, and subtracting
 * the float 2^23 + bias (exact too) leaves u - bias, which a float holds exactly, so the
 * result is the conversion's, bit for bit (+0 where u == bias). */
__device__ __forceinline__ float fitm_u2f_minus(uint32_t u, int bias)
{
    return __int_as_float((int)(0x4b000000u | u)) - (8388608.0f + (float)bias);
}

/* Block geometry per type; chunks per block = BE / 8. */
template <int T> struct fitm_qtraits;
// clang-format off
template <> struct fitm_qtraits<FITM_DTYPE_Q4_0> { static const int BE = 32, BB = 18; };
template <> struct fitm_qtraits<FITM_DTYPE_Q5_0> { static const int BE = 32, BB = 22; };
template <> struct fitm_qtraits<FITM_DTYPE_Q8_0> { static const int BE = 32, BB = 34; };
template <> struct fitm_qtraits<FITM_DTYPE_Q4_K> { static const int BE = 256, BB = 144; };
template <> struct fitm_qtraits<FITM_DTYPE_Q5_K> { static const int BE = 256, BB = 176; };
template <> struct fitm_qtraits<FITM_DTYPE_Q6_K> { static const int BE = 256, BB = 210; };
template <> struct fitm_qtraits<FITM_DTYPE_F32> { static const int BE = 1, BB = 4; };
template <> struct fitm_qtraits<FITM_DTYPE_F16> { static const int BE = 1, BB = 2; };
template <> struct fitm_qtraits<FITM_DTYPE_BF16> { static const int BE = 1, BB = 2; };
// clang-format on

/* Elements per block of a type the kernels take (1 for the float types). Kept here rather than
 * calling fitm_dtype_info_of so that the kernels library does not depend on fitm_core, which
 * links it. */
static inline int64_t fitm_qblock_elems(fitm_dtype t)
{
    switch (t) {
    case FITM_DTYPE_Q4_0:
    case FITM_DTYPE_Q5_0:
    case FITM_DTYPE_Q8_0:
        return 32;
    case FITM_DTYPE_Q4_K:
    case FITM_DTYPE_Q5_K:
    case FITM_DTYPE_Q6_K:
        return 256;
    default:
        return 1;
    }
}

/* Decoders of one chunk: blk is the block, e0 (a multiple of 8, < BE) the chunk's first
 * element within it. */
template <int T> __device__ void fitm_decode_block8(const uint8_t *blk, int e0, float v[8]);

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q4_0>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk));
    const uint2 q = fitm_ld8_a2(blk + 2 + (e0 & 15));
    const int sh = e0 & 16 ? 4 : 0;
    uint2 b; /* the eight nibbles as bytes, a word at a time */
    b.x = q.x >> sh & 0x0f0f0f0fu;
    b.y = q.y >> sh & 0x0f0f0f0fu;
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = fitm_u2f_minus(fitm_byte(b, i), 8) * d;
}

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q5_0>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk));
    const uint32_t qh = fitm_ld16(blk + 2) | fitm_ld16(blk + 4) << 16;
    const uint2 q = fitm_ld8_a2(blk + 6 + (e0 & 15));
    const int sh = e0 & 16 ? 4 : 0;
    /* the eight 5-bit values as bytes, four to a word: nibbles and high bits a word at a time */
    const uint32_t hb = qh >> e0;
    uint2 b;
    b.x = (q.x >> sh & 0x0f0f0f0fu) | fitm_bits_to_bytes(hb) << 4;
    b.y = (q.y >> sh & 0x0f0f0f0fu) | fitm_bits_to_bytes(hb >> 4) << 4;
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = fitm_u2f_minus(fitm_byte(b, i), 16) * d;
}

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q8_0>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk));
    const uint2 q = fitm_ld8_a2(blk + 2 + e0);
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = fitm_u2f_minus(fitm_byte(q, i) ^ 0x80u, 128) * d; /* the int8 value */
}

/* 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes of Q4_K/Q5_K: the first
 * four pairs sit in the low 6 bits of bytes 0..7; the last four take their low 4 bits from
 * bytes 8..11 and their top 2 bits from the spare top bits of bytes 0..7. */
__device__ __forceinline__ void fitm_k4_scale_min(const uint8_t *sc, int s, float *scale,
                                                  float *min)
{
    uint32_t a, b;
    if (s < 4) {
        a = sc[s] & 63u;
        b = sc[s + 4] & 63u;
    } else {
        a = (sc[s + 4] & 15u) | (uint32_t)(sc[s - 4] >> 6) << 4;
        b = (uint32_t)(sc[s + 4] >> 4) | (uint32_t)(sc[s] >> 6) << 4;
    }
    *scale = (float)a;
    *min = (float)b;
}

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q4_K>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk));
    const float dmin = fitm_h2f((uint16_t)fitm_ld16(blk + 2));
    const int s = e0 >> 5;
    float sc, mn;
    fitm_k4_scale_min(blk + 4, s, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    const uint2 q = fitm_ld8_a8(blk + 16 + 32 * (e0 >> 6) + (e0 & 31));
    const int sh = (s & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = d1 * fitm_u2f_minus(fitm_byte(q, i) >> sh & 15u, 0) - m1;
}

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q5_K>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk));
    const float dmin = fitm_h2f((uint16_t)fitm_ld16(blk + 2));
    const int s = e0 >> 5;
    float sc, mn;
    fitm_k4_scale_min(blk + 4, s, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    const uint2 h = fitm_ld8_a8(blk + 16 + (e0 & 31));
    const uint2 q = fitm_ld8_a8(blk + 48 + 32 * (e0 >> 6) + (e0 & 31));
    const int sh = (s & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t lo = fitm_byte(q, i) >> sh & 15u;
        const uint32_t hi = (fitm_byte(h, i) >> s & 1u) << 4;
        v[i] = d1 * fitm_u2f_minus(lo | hi, 0) - m1;
    }
}

template <>
__device__ __forceinline__ void fitm_decode_block8<FITM_DTYPE_Q6_K>(const uint8_t *blk, int e0,
                                                                    float v[8])
{
    const float d = fitm_h2f((uint16_t)fitm_ld16(blk + 208));
    const int half = e0 >> 7, l = e0 & 31, u = (e0 >> 5) & 3;
    const float ds = d * (float)(int8_t)blk[192 + 8 * half + (l >> 4) + 2 * u];
    const uint2 ql = fitm_ld8_a2(blk + 64 * half + 32 * (u & 1) + l);
    const uint2 qh = fitm_ld8_a2(blk + 128 + 32 * half + l);
    const int sh = (u >> 1) * 4, hs = 2 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t lo = fitm_byte(ql, i) >> sh & 15u;
        const uint32_t hi = (fitm_byte(qh, i) >> hs & 3u) << 4;
        v[i] = ds * fitm_u2f_minus(lo | hi, 32);
    }
}

/* One element i of a float-typed array (any alignment of i). */
template <int T> __device__ float fitm_load1(const uint8_t *base, int64_t i);
template <>
__device__ __forceinline__ float fitm_load1<FITM_DTYPE_F32>(const uint8_t *base, int64_t i)
{
    return ((const float *)base)[i];
}
template <>
__device__ __forceinline__ float fitm_load1<FITM_DTYPE_F16>(const uint8_t *base, int64_t i)
{
    return fitm_h2f(((const uint16_t *)base)[i]);
}
template <>
__device__ __forceinline__ float fitm_load1<FITM_DTYPE_BF16>(const uint8_t *base, int64_t i)
{
    return fitm_bf2f(((const uint16_t *)base)[i]);
}

/* Chunk c (elements 8c .. 8c+7) of an array of type T starting at the 16-byte aligned base.
 * For the float types this is one or two 16-byte loads. */
template <int T>
__device__ __forceinline__ void fitm_decode_chunk(const uint8_t *base, int64_t c, float v[8])
{
    if constexpr (T == FITM_DTYPE_F32) {
        const float4 *p = (const float4 *)base + 2 * c;
        const float4 a = p[0], b = p[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else if constexpr (T == FITM_DTYPE_F16 || T == FITM_DTYPE_BF16) {
        const uint4 w = ((const uint4 *)base)[c];
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint16_t lo = (uint16_t)(u[i] & 0xffffu), hi = (uint16_t)(u[i] >> 16);
            v[2 * i] = T == FITM_DTYPE_F16 ? fitm_h2f(lo) : fitm_bf2f(lo);
            v[2 * i + 1] = T == FITM_DTYPE_F16 ? fitm_h2f(hi) : fitm_bf2f(hi);
        }
    } else {
        constexpr int CPB = fitm_qtraits<T>::BE / 8; /* chunks per block */
        const int64_t b = c / CPB;
        const int e0 = (int)(c % CPB) * 8;
        fitm_decode_block8<T>(base + b * fitm_qtraits<T>::BB, e0, v);
    }
}

#endif
