/* cuda_emu: <mma.h>, the warp matrix functions (nvcuda::wmma) for the shapes and types the
 * kernels use: 16 x 16 x 16 fragments of __nv_bfloat16 (matrix_a, matrix_b, either layout)
 * and float accumulators.
 *
 * Layout (a device leaves it unspecified, so kernels may not rely on it): element (r, c) of a
 * 16 x 16 tile is e = 16 r + c, and lane l holds the elements with e % 32 == l, x[i] being
 * e = 32 i + l: row 2 i + l / 16, column l % 16 (num_elements 8, as on a device). Besides x, an
 * A fragment keeps the 8 full rows of A that its lane's accumulator elements need and a B
 * fragment the one full column, widened to float (exactly), so a lane's mma_sync computes its
 * own 8 outputs alone. Changing x of an A or B fragment does not change that hidden copy: the
 * kernels here only load, multiply and store.
 *
 * Arithmetic: d (r, c) = c (r, c) + sum over k = 0..15 in order of a (r, k) b (k, c), each
 * product of two bfloat16 values exact in float (8 significant bits times 8 fit in 24), each
 * addition rounded to float. A device's tensor cores sum in another order (and may keep more
 * bits within the k16 step), so tests bound the result against a reference instead of
 * comparing it with this order; what both share is that an element depends only on its row of
 * A and its column of B.
 *
 * Faults, as a device faults: a load or store whose pointer is not 32-byte (256-bit) aligned or
 * whose ldm is not a multiple of 8 elements (16-bit types) or 4 (float) loses the context with
 * cudaErrorMisalignedAddress; one whose tile (16 rows or columns of ldm elements) does not lie
 * in one device allocation, pinned host memory or the launch's dynamic shared memory loses it
 * with cudaErrorIllegalAddress (the emulator cannot see static __shared__ arrays, which are
 * host statics here: kernels stage WMMA tiles in dynamic shared memory). Load, store and mma
 * are warp collectives: every lane must call each one with the same pointer and ldm, else the
 * launch loses the context with cudaErrorLaunchFailure at the block's end. Faulting calls
 * touch no memory. */
#ifndef FITM_CUDA_EMU_MMA_H
#define FITM_CUDA_EMU_MMA_H

#include <stdio.h>

#include "cuda_runtime.h"

namespace nvcuda
{
namespace wmma
{

struct matrix_a {
};
struct matrix_b {
};
struct accumulator {
};
struct row_major {
};
struct col_major {
};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int m, int n, int k, typename T, typename Layout = void> struct fragment;

template <typename T, typename Layout> struct fragment<matrix_a, 16, 16, 16, T, Layout> {
    static_assert(std::is_same<T, __nv_bfloat16>::value, "the emulator's A fragments: bfloat16");
    enum { num_elements = 8 };
    T x[num_elements];
    float rows[8][16]; /* rows 2 i + lane / 16 of A */
};

template <typename T, typename Layout> struct fragment<matrix_b, 16, 16, 16, T, Layout> {
    static_assert(std::is_same<T, __nv_bfloat16>::value, "the emulator's B fragments: bfloat16");
    enum { num_elements = 8 };
    T x[num_elements];
    float col[16]; /* column lane % 16 of B */
};

template <> struct fragment<accumulator, 16, 16, 16, float, void> {
    enum { num_elements = 8 };
    float x[num_elements];
};

namespace emu
{

static inline float widen(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}
static inline float widen(float v)
{
    return v;
}

/* Checks one collective load or store of a 16 x 16 tile of T at p with leading dimension ldm
 * (see the header); false (the fault recorded) when it must not touch memory. */
template <typename T> static inline bool tile_ok(int op, const T *p, unsigned ldm)
{
    fitm_emu_warp_collective((uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull ^ (uint64_t)ldm << 8 ^
                             (uint64_t)op);
    const unsigned per_128_bits = 16 / sizeof(T);
    char what[128];
    if ((uintptr_t)p % 32 != 0 || ldm % per_128_bits != 0) {
        snprintf(what, sizeof what,
                 "a WMMA %s at %p with ldm %u (the pointer must be 32-byte aligned, ldm a "
                 "multiple of %u)",
                 op == 2 ? "store" : "load", (const void *)p, ldm, per_128_bits);
        fitm_emu_kernel_fault(cudaErrorMisalignedAddress, what);
        return false;
    }
    const size_t bytes = ((size_t)15 * ldm + 16) * sizeof(T);
    if (!fitm_emu_shared_range(p, bytes) && !fitm_emu_device_range(p, bytes)) {
        snprintf(what, sizeof what,
                 "a WMMA %s of %zu bytes at %p, outside device and dynamic shared memory",
                 op == 2 ? "store" : "load", bytes, (const void *)p);
        fitm_emu_kernel_fault(cudaErrorIllegalAddress, what);
        return false;
    }
    return true;
}

/* Element (r, c) of a tile at p: row-major p[r ldm + c], column-major p[r + c ldm]. */
template <typename T> static inline T at(const T *p, unsigned ldm, bool row_major, int r, int c)
{
    return row_major ? p[(size_t)r * ldm + c] : p[r + (size_t)c * ldm];
}

} // namespace emu

template <typename T, typename Layout>
static inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, Layout> &a, const T *p,
                                    unsigned ldm)
{
    const bool rm = std::is_same<Layout, row_major>::value;
    const int lane = fitm_emu_lane();
    const bool ok = emu::tile_ok(0, p, ldm);
    for (int i = 0; i < 8; i++) {
        const int r = 2 * i + lane / 16;
        a.x[i] = ok ? emu::at(p, ldm, rm, r, lane % 16) : T{};
        for (int k = 0; k < 16; k++)
            a.rows[i][k] = ok ? emu::widen(emu::at(p, ldm, rm, r, k)) : 0.0f;
    }
}

template <typename T, typename Layout>
static inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, Layout> &b, const T *p,
                                    unsigned ldm)
{
    const bool rm = std::is_same<Layout, row_major>::value;
    const int lane = fitm_emu_lane();
    const bool ok = emu::tile_ok(1, p, ldm);
    for (int i = 0; i < 8; i++)
        b.x[i] = ok ? emu::at(p, ldm, rm, 2 * i + lane / 16, lane % 16) : T{};
    for (int k = 0; k < 16; k++)
        b.col[k] = ok ? emu::widen(emu::at(p, ldm, rm, k, lane % 16)) : 0.0f;
}

static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &c, const float *p,
                                    unsigned ldm, layout_t layout)
{
    const int lane = fitm_emu_lane();
    const bool ok = emu::tile_ok(3, p, ldm);
    for (int i = 0; i < 8; i++)
        c.x[i] = ok ? emu::at(p, ldm, layout == mem_row_major, 2 * i + lane / 16, lane % 16) : 0.0f;
}

static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &c,
                                     unsigned ldm, layout_t layout)
{
    const int lane = fitm_emu_lane();
    if (!emu::tile_ok(2, (const float *)p, ldm))
        return;
    for (int i = 0; i < 8; i++) {
        const int r = 2 * i + lane / 16, col = lane % 16;
        if (layout == mem_row_major)
            p[(size_t)r * ldm + col] = c.x[i];
        else
            p[r + (size_t)col * ldm] = c.x[i];
    }
}

static inline void fill_fragment(fragment<accumulator, 16, 16, 16, float> &c, float v)
{
    for (int i = 0; i < 8; i++)
        c.x[i] = v;
}

template <typename T, typename Layout>
static inline void fill_fragment(fragment<matrix_a, 16, 16, 16, T, Layout> &a, T v)
{
    for (int i = 0; i < 8; i++) {
        a.x[i] = v;
        for (int k = 0; k < 16; k++)
            a.rows[i][k] = emu::widen(v);
    }
}

template <typename T, typename Layout>
static inline void fill_fragment(fragment<matrix_b, 16, 16, 16, T, Layout> &b, T v)
{
    for (int i = 0; i < 8; i++)
        b.x[i] = v;
    for (int k = 0; k < 16; k++)
        b.col[k] = emu::widen(v);
}

/* d = a . b + c; d may be c. */
template <typename T, typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, T, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c)
{
    fitm_emu_warp_collective(4);
    for (int i = 0; i < 8; i++) {
        float s = c.x[i];
        for (int k = 0; k < 16; k++)
            s += a.rows[i][k] * b.col[k];
        d.x[i] = s;
    }
}

} // namespace wmma
} // namespace nvcuda

#endif
