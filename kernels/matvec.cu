/* matvec: y = W x with W kept in its stored type, the single-token (decode) step's core.
 * CPU reference: fitm_dequant_row of each row of W, dotted with x in double. */
#include "common.cuh"
#include "kernels.h"
#include "qdecode.cuh"

#define FITM_MV_WARPS 4 /* rows per block, one warp each */
#define FITM_MV_THREADS (FITM_MV_WARPS * FITM_WARP)
/* batch rows per block of a float-typed weight (the block types take fitm_matvec_tiles): a
 * weight chunk is loaded once for all of them */
#define FITM_MV_BATCH 8
/* Blocks per SM the batch kernels (R > 1) are compiled for: up to 128 registers a thread, which
 * their accumulators need (ptxas picks a tighter limit of its own otherwise, and spills). The
 * one-row kernels (R = 1) ask for twice as many blocks, at most 64 registers a thread: 8 blocks
 * (32 warps) resident per SM, each warp with a stage of weight bytes in flight. */
#define FITM_MV_MIN_BLOCKS 4
/* The one-row kernels of a wide product (G > 1 rows a warp, below) hold G rows' sums and
 * their K-quant scales: 6 blocks per SM (up to 80 registers), where 64 spill on sm_80. */
#define FITM_MV_WIDE_BLOCKS 6

#define FITM_MV_STAGE 2048 /* weight bytes a warp stages in shared memory per pass */
#define FITM_MV_SEGS (FITM_MV_STAGE / 16 + 1) /* 16-byte pieces: one more for an unaligned start */
#define FITM_MV_WIDE_ROWS 4 /* rows per warp of a wide product (an LM head) */
#define FITM_MV_WIDE_N 16384 /* a product of at least this many rows is wide */

/* s + v . (a, b), the eight products fed in element order: every path's step of a sum. */
__device__ __forceinline__ float fitm_mv_fma8(const float v[8], float4 a, float4 b, float s)
{
    s = fmaf(v[0], a.x, s);
    s = fmaf(v[1], a.y, s);
    s = fmaf(v[2], a.z, s);
    s = fmaf(v[3], a.w, s);
    s = fmaf(v[4], b.x, s);
    s = fmaf(v[5], b.y, s);
    s = fmaf(v[6], b.z, s);
    return fmaf(v[7], b.w, s);
}

/* One chunk v (elements 8c .. 8c+7 of a weight row) applied to the nt batch rows of x (R, K):
 * acc[r] = fitm_mv_fma8 of it and x[r, 8c .. 8c+7]. */
template <int R>
__device__ __forceinline__ void fitm_mv_dot8(const float v[8], const float *x, int64_t K, int64_t c,
                                             int nt, float acc[R])
{
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= nt)
            break;
        const float4 *x4 = (const float4 *)(x + r * K);
        const float4 a = __ldg(x4 + 2 * c), b = __ldg(x4 + 2 * c + 1);
        acc[r] = fitm_mv_fma8(v, a, b, acc[r]);
    }
}

/* One warp's dot products of float-typed weight row w (K elements of type T) with the nt batch
 * rows of x (R, K) into acc[0..nt), not yet reduced across the warp's lanes.
 * CHUNKED: lanes take chunks of 8 elements in turn (chunk c to lane c % 32), each one or two
 * 16-byte loads, and x as float4 pairs. Needs K % 8 == 0. Otherwise (odd K) lanes take single
 * elements. Each batch row has its own accumulator, fed in the same order (lane, chunk,
 * element) whatever R and nt are. */
template <int T, bool CHUNKED, int R>
__device__ __forceinline__ void fitm_matvec_acc(const uint8_t *w, int64_t K, const float *x, int nt,
                                                int lane, float acc[R])
{
#pragma unroll
    for (int r = 0; r < R; r++)
        acc[r] = 0.0f;
    if constexpr (CHUNKED) {
        const int64_t n_chunks = K / 8;
        for (int64_t c = lane; c < n_chunks; c += FITM_WARP) {
            float v[8];
            fitm_decode_chunk<T>(w, c, v);
            fitm_mv_dot8<R>(v, x, K, c, nt, acc);
        }
    } else {
        for (int64_t k = lane; k < K; k += FITM_WARP) {
            const float v = fitm_load1<T>(w, k);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nt)
                    break;
                acc[r] = fmaf(v, __ldg(x + r * K + k), acc[r]);
            }
        }
    }
}

/* The 16 bytes at p (16-byte aligned) of an array that ends at end, the bytes from end on read
 * as zeros: the last piece of a weight whose size is not a multiple of 16 (block sizes are
 * even, so 16-bit loads reach its end exactly). */
__device__ __forceinline__ uint4 fitm_mv_load_tail(const uint8_t *p, const uint8_t *end)
{
    const int64_t n = end - p;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t lo = 4 * i < n ? fitm_ld16(p + 4 * i) : 0u;
        const uint32_t hi = 4 * i + 2 < n ? fitm_ld16(p + 4 * i + 2) : 0u;
        w[i] = lo | hi << 16;
    }
    uint4 r;
    r.x = w[0], r.y = w[1], r.z = w[2], r.w = w[3];
    return r;
}

/* The warp copies bytes [lo, hi) of a weight ending at end (lo 2-byte aligned, hi - lo at
 * most FITM_MV_STAGE) into sm, whole 16-byte aligned pieces from the one holding lo: every
 * lane issues all of its loads (up to five, 16 bytes each) before it stores any, so the whole
 * stage is in flight at once. Returns lo's offset in sm. The caller syncs the warp after. */
__device__ __forceinline__ int fitm_mv_stage(uint4 *sm, const uint8_t *lo, const uint8_t *hi,
                                             const uint8_t *end, int lane)
{
    constexpr int PER = (FITM_MV_SEGS + FITM_WARP - 1) / FITM_WARP;
    const uint8_t *a0 = (const uint8_t *)((uintptr_t)lo & ~(uintptr_t)15);
    const int nseg = (int)((hi - a0 + 15) >> 4);
    uint4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int s = lane + i * FITM_WARP;
        if (s < nseg) {
            const uint8_t *p = a0 + 16 * s;
            v[i] = p + 16 <= end ? __ldg((const uint4 *)p) : fitm_mv_load_tail(p, end);
        }
    }
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int s = lane + i * FITM_WARP;
        if (s < nseg)
            sm[s] = v[i];
    }
    return (int)(lo - a0);
}

/* One warp's dot products of gn (<= G) consecutive rows of a block-typed weight, the first at
 * w (rows of rb bytes, the weight ending at end), with the one row x: acc[g][0] as
 * fitm_matvec_acc's CHUNKED path sums row g (chunk c to lane c % 32, a lane's chunks in order,
 * each through fitm_mv_fma8), so a row's sums do not depend on G, gn or the rows beside it.
 * The rows' bytes are contiguous: the warp stages them through sm in passes of whole blocks,
 * each pass wide loads all in flight together, and decodes its chunks from shared memory; each
 * (row, chunk) falls in one pass, and passes go in order. (Several rows of x take the tiles,
 * fitm_matvec_tiles.) */
template <int T, int R, int G>
__device__ __forceinline__ void fitm_matvec_acc_staged(const uint8_t *w, int64_t rb,
                                                       const uint8_t *end, int gn, int64_t K,
                                                       const float *x, int nt, int lane, uint4 *sm,
                                                       float acc[G][R])
{
    static_assert(R == 1, "several rows of x take fitm_matvec_tiles");
    (void)K, (void)nt;
    constexpr int BB = fitm_qtraits<T>::BB, CPB = fitm_qtraits<T>::BE / 8;
    constexpr int64_t PASS = FITM_MV_STAGE / BB; /* blocks per pass */
    const int64_t nb = rb / BB, total = gn * nb;
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[g][r] = 0.0f;
    const uint8_t *smb = (const uint8_t *)sm;
    for (int64_t f0 = 0; f0 < total; f0 += PASS) {
        const int64_t f1 = f0 + PASS < total ? f0 + PASS : total;
        __syncwarp(); /* every lane is done reading the previous pass */
        const int off = fitm_mv_stage(sm, w + f0 * BB, w + f1 * BB, end, lane);
        __syncwarp(); /* the stage is whole before any lane decodes */
        /* a lane loads each x chunk it needs once in the pass and applies it to the chunks of
         * that index in every row the pass holds */
        const int64_t ga = f0 / nb, gz = (f1 - 1) / nb; /* the pass's first and last row */
        const int64_t clo = ga == gz ? (f0 - ga * nb) * CPB : 0;
        const int64_t chi = ga == gz ? (f1 - ga * nb) * CPB : nb * CPB;
        for (int64_t c = clo + ((lane - clo) & (FITM_WARP - 1)); c < chi; c += FITM_WARP) {
            const float4 *x4 = (const float4 *)x;
            const float4 a = __ldg(x4 + 2 * c), b = __ldg(x4 + 2 * c + 1);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t f = g * nb + c / CPB; /* the chunk's block among the warp's */
                if (g >= gn || f < f0 || f >= f1)
                    continue;
                float v[8];
                fitm_decode_block8<T>(smb + off + (f - f0) * BB, (int)(c % CPB) * 8, v);
                acc[g][0] = fitm_mv_fma8(v, a, b, acc[g][0]);
            }
        }
    }
}

/* acc[g] for the gn (<= G) rows of weight W from row0 on: the staged path for the block
 * types, fitm_matvec_acc for the float types (G = 1 only). */
template <int T, bool CHUNKED, int R, int G>
__device__ __forceinline__ void fitm_matvec_acc_rows(const uint8_t *W, int64_t row_bytes, int64_t N,
                                                     int64_t row0, int gn, int64_t K,
                                                     const float *x, int nt, int lane, uint4 *sm,
                                                     float acc[G][R])
{
    if constexpr (fitm_qtraits<T>::BE > 1) {
        fitm_matvec_acc_staged<T, R, G>(W + row0 * row_bytes, row_bytes, W + N * row_bytes, gn, K,
                                        x, nt, lane, sm, acc);
    } else {
        static_assert(G == 1, "float-typed weights take one row per warp");
        (void)N, (void)gn, (void)sm;
        fitm_matvec_acc<T, CHUNKED, R>(W + row0 * row_bytes, K, x, nt, lane, acc[0]);
    }
}

/* The warp's sums acc[0..nt) reduced by the one shuffle tree every product uses, lane 0
 * writing row r's at y[r * ld]. */
template <int R>
__device__ __forceinline__ void fitm_matvec_put(const float acc[R], int nt, int lane, float *y,
                                                int64_t ld)
{
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= nt)
            break;
        const float s = fitm_warp_sum(acc[r]);
        if (lane == 0)
            y[r * ld] = s;
    }
}

/* act(g) * u of the fused gate/up product: gelu_tanh (gelu != 0) or silu, the expression of
 * fitm_cuda_geglu / fitm_cuda_swiglu, written once for every kernel that fuses it. */
__device__ __forceinline__ float fitm_mv_glu(int gelu, float g, float u)
{
    return gelu ? fitm_geglu1(g, u) : fitm_swiglu1(g, u);
}

/* The bytes of the rows block b of a launch computes, per rows a block, of a weight W of N
 * rows of rb bytes (clamped to N; none past it or for a NULL W): what its blocks prefetch
 * (fitm_grid_begin_prefetch). */
__device__ __forceinline__ fitm_span fitm_mv_span(const uint8_t *W, int64_t rb, int64_t N,
                                                  int64_t b, int per)
{
    const int64_t r0 = b * per;
    if (!W || r0 >= N)
        return fitm_span{nullptr, 0};
    return fitm_span{W + r0 * rb, (N - r0 < per ? N - r0 : per) * rb};
}

/* Shared memory of a block's warps for staging block-typed weights (none for float types). */
template <int T> struct fitm_mv_smem {
    static const int SEGS = fitm_qtraits<T>::BE > 1 ? FITM_MV_SEGS : 1;
};

/* One warp per G consecutive rows n: y[t, n] = sum_k W[n, k] * x[t, k] for the batch rows t of
 * blockIdx.y's group of R (fitm_cuda_matmul_rows: one row, or several of a float-typed weight;
 * several rows of a block type take fitm_matvec_tiles). W (N, K) stored, x (n_x, K), y (n_x,
 * N). The warp decodes each piece of W once and applies it
 * to every row of its group, so a step of R rows reads the weights once, as one row does. Each
 * row's sum is fitm_matvec_acc's order, reduced by the same shuffle tree whatever R, n_x and G
 * are: a row's result does not depend on the rows beside it (test_cuda_kernels: matmul_rows).
 * GLU: Wu (same type and shape as W) is the up projection and W the gate: the warp computes
 * both sums of its row, each exactly as above, and writes act(gate) * up (gelu: gelu_tanh,
 * else silu) with the element-wise expression of fitm_cuda_swiglu / fitm_cuda_geglu, so the
 * fused launch gives the bits of the three it replaces (test_cuda_kernels: matmul_glu). */
template <int T, bool CHUNKED, int R, int G, bool GLU>
__global__ void __launch_bounds__(FITM_MV_THREADS, R == 1 ? (G == 1 ? 2 * FITM_MV_MIN_BLOCKS
                                                                      : FITM_MV_WIDE_BLOCKS)
                                                         : FITM_MV_MIN_BLOCKS)
    fitm_matvec_rows(const uint8_t *__restrict__ W, const uint8_t *__restrict__ Wu,
                     int64_t row_bytes, int64_t N, int64_t K, const float *__restrict__ x,
                     int64_t n_x, float *__restrict__ y, int gelu)
{
    fitm_grid_begin_prefetch(fitm_mv_span(W, row_bytes, N, blockIdx.x, FITM_MV_WARPS * G),
                             fitm_mv_span(GLU ? Wu : nullptr, row_bytes, N, blockIdx.x,
                                          FITM_MV_WARPS * G));
    __shared__ uint4 stage[FITM_MV_WARPS][fitm_mv_smem<T>::SEGS];
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int64_t row0 = ((int64_t)blockIdx.x * FITM_MV_WARPS + warp) * G;
    if (row0 >= N)
        return; /* uniform per warp: the shuffles below see whole warps */
    const int gn = N - row0 < G ? (int)(N - row0) : G;
    const int64_t t0 = (int64_t)blockIdx.y * R;
    const int nt = n_x - t0 < R ? (int)(n_x - t0) : R; /* uniform per block */
    x += t0 * K;
    y += t0 * N;
    float acc[G][R];
    fitm_matvec_acc_rows<T, CHUNKED, R, G>(W, row_bytes, N, row0, gn, K, x, nt, lane, stage[warp],
                                           acc);
    if constexpr (!GLU) {
#pragma unroll
        for (int i = 0; i < G; i++) {
            if (i >= gn)
                break;
            fitm_matvec_put<R>(acc[i], nt, lane, y + row0 + i, N);
        }
    } else {
        float up[G][R];
        fitm_matvec_acc_rows<T, CHUNKED, R, G>(Wu, row_bytes, N, row0, gn, K, x, nt, lane,
                                               stage[warp], up);
#pragma unroll
        for (int i = 0; i < G; i++) {
            if (i >= gn)
                break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nt)
                    break;
                const float g = fitm_warp_sum(acc[i][r]), u = fitm_warp_sum(up[i][r]);
                if (lane == 0)
                    y[r * N + row0 + i] = fitm_mv_glu(gelu, g, u);
            }
        }
    }
}

/* Up to three products of one input in one launch (a layer's Q, K and V): the blocks of
 * blockIdx.x below b1 compute rows of W0 into y0, those below b2 rows of W1 into y1, the rest
 * rows of W2 into y2, each row exactly as fitm_matvec_rows computes it alone, so the launch
 * gives the bits of one launch per weight. Weights of one type and K; Wi NULL past the
 * last. */
template <int T, bool CHUNKED, int R>
__global__ void __launch_bounds__(FITM_MV_THREADS, R == 1 ? 2 * FITM_MV_MIN_BLOCKS : FITM_MV_MIN_BLOCKS)
    fitm_matvec_rows3(const uint8_t *__restrict__ W0, const uint8_t *__restrict__ W1,
                      const uint8_t *__restrict__ W2, int64_t row_bytes, int64_t N0, int64_t N1,
                      int64_t N2, unsigned b1, unsigned b2, int64_t K, const float *__restrict__ x,
                      int64_t n_x, float *__restrict__ y0, float *__restrict__ y1,
                      float *__restrict__ y2)
{
    fitm_grid_begin_prefetch(
        blockIdx.x < b1   ? fitm_mv_span(W0, row_bytes, N0, blockIdx.x, FITM_MV_WARPS)
        : blockIdx.x < b2 ? fitm_mv_span(W1, row_bytes, N1, blockIdx.x - b1, FITM_MV_WARPS)
                          : fitm_mv_span(W2, row_bytes, N2, blockIdx.x - b2, FITM_MV_WARPS),
        fitm_span());
    __shared__ uint4 stage[FITM_MV_WARPS][fitm_mv_smem<T>::SEGS];
    const int which = blockIdx.x < b1 ? 0 : blockIdx.x < b2 ? 1 : 2; /* uniform per block */
    const unsigned bx = blockIdx.x - (which == 0 ? 0 : which == 1 ? b1 : b2);
    const uint8_t *W = which == 0 ? W0 : which == 1 ? W1 : W2;
    const int64_t N = which == 0 ? N0 : which == 1 ? N1 : N2;
    float *y = which == 0 ? y0 : which == 1 ? y1 : y2;
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int64_t row = (int64_t)bx * FITM_MV_WARPS + warp;
    if (row >= N)
        return; /* uniform per warp */
    const int64_t t0 = (int64_t)blockIdx.y * R;
    const int nt = n_x - t0 < R ? (int)(n_x - t0) : R;
    x += t0 * K;
    y += t0 * N + row;
    float acc[1][R];
    fitm_matvec_acc_rows<T, CHUNKED, R, 1>(W, row_bytes, N, row, 1, K, x, nt, lane, stage[warp],
                                           acc);
    fitm_matvec_put<R>(acc[0], nt, lane, y, N);
}

/* ---- The batched kernel of the block types (fitm_matvec_tiles: n_x > 1) ----
 *
 * A block takes M rows of x (a tile: grid y = ceil(n_x / M)) and groups of consecutive weight
 * rows, FITM_MV_TILE_RUNS a warp: four rows of W, or with GLU two rows of the gate and the same
 * two of up. x's tile sits in shared memory, staged once per block when it fits (else in
 * slices of 256-element multiples, once per group); each warp stages its rows' bytes in passes
 * of whole blocks, FITM_MV_TILE_RUN bytes a row. Lane l takes the chunks c = l (mod 32) of
 * its rows in increasing order, decodes each once for the tile's M rows, and keeps M x 4 sums
 * in registers: one x chunk read from shared memory feeds four weight rows, one decoded chunk
 * M rows of x. Every sum is the one-row kernels' (fitm_mv_fma8 of chunk c into the sum of lane
 * class c % 32, chunks in order), reduced by fitm_mv_reduce, which forms fitm_warp_sum's tree:
 * a row's result has the bits the one-row kernel gives that row of x alone
 * (test_cuda_kernels: matmul_rows, matmul_rows_n, matmul_glu). */
#define FITM_MV_TILE_RUNS 4  /* weight rows a warp holds */
#define FITM_MV_TILE_RUN 512 /* bytes a warp stages of each of its rows per pass */
/* 16-byte pieces of a row's pass: a pass is at most FITM_MV_TILE_RUN - 15 bytes from a 2-byte
 * aligned start, so 32 pieces hold it, one a lane */
#define FITM_MV_TILE_SEGS (FITM_MV_TILE_RUN / 16)

/* Warps a block, and blocks an SM its registers are budgeted for: with 32 rows of x a lane
 * holds 128 sums (up to 255 registers: one block of 8 warps an SM, all sharing one x tile);
 * with 16 or 8 rows, 64 or 32 sums, blocks of 4 warps, 3 of them an SM (168 registers; the
 * decoded chunks of four rows, their x halves and the loop's state take about 100 beside the
 * sums, so at 128, 4 blocks an SM, both spill). */
template <int M> struct fitm_mv_tile {
    static const int WARPS = M == 32 ? 8 : 4;
    static const int THREADS = WARPS * FITM_WARP;
    static const int BLOCKS = M == 32 ? 1 : 3;
};

/* The warp copies bytes [lo[r], lo[r] + n) of each of its rows r < rn (n <= FITM_MV_TILE_RUN -
 * 15, lo[r] 2-byte aligned, the row's weight ending at end[r]) into sm, row r's at sm + r *
 * FITM_MV_TILE_SEGS: whole 16-byte aligned pieces from the one holding lo[r], lane j loading
 * piece j of every row before it stores any, so a pass is one memory round trip. off[r]:
 * lo[r]'s offset in its first piece. The caller syncs the warp after. */
__device__ __forceinline__ void fitm_mv_tile_stage(uint4 *sm, const uint8_t *const *lo, int n,
                                                   const uint8_t *const *end, int rn, int lane,
                                                   int *off)
{
    uint4 v[FITM_MV_TILE_RUNS];
#pragma unroll
    for (int r = 0; r < FITM_MV_TILE_RUNS; r++) {
        const uint8_t *a0 = (const uint8_t *)((uintptr_t)lo[r] & ~(uintptr_t)15);
        const uint8_t *p = a0 + 16 * lane;
        off[r] = (int)(lo[r] - a0);
        if (r < rn && p < lo[r] + n)
            v[r] = p + 16 <= end[r] ? __ldg((const uint4 *)p) : fitm_mv_load_tail(p, end[r]);
    }
#pragma unroll
    for (int r = 0; r < FITM_MV_TILE_RUNS; r++)
        if (r < rn && 16 * lane < off[r] + n)
            sm[r * FITM_MV_TILE_SEGS + lane] = v[r];
}

/* The block copies elements [s0, s0 + sn) of x's rows m < nt (K apart) into xs, row m as two
 * planes of sc float4 (sc >= sn / 8): xs[2 m sc + j] holds the slice's elements 8j .. 8j+3,
 * xs[(2m + 1) sc + j] elements 8j+4 .. 8j+7, so the lanes of a warp, reading consecutive
 * chunks' halves, read consecutive 16-byte words (no bank conflicts). A thread issues up to U
 * loads before it stores them (fewer registers where the sums are live beside them). */
template <int THREADS, int U>
__device__ __forceinline__ void fitm_mv_tile_x(float4 *xs, const float *x, int64_t K, int64_t s0,
                                               int sn, int sc, int nt)
{
    const int q = sn / 4, total = nt * q; /* float4 a row, in all */
    for (int i0 = threadIdx.x; i0 < total; i0 += U * THREADS) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * THREADS;
            if (i < total)
                v[u] = __ldg((const float4 *)(x + (i / q) * K + s0) + i % q);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * THREADS, m = i / q, f = i % q;
            if (i < total)
                xs[(2 * m + (f & 1)) * sc + f / 2] = v[u];
        }
    }
}

/* One pass of the warp: blocks [p0, p1) of its rows' slice (counted from the slice's first)
 * staged at ws (row r's at ws + r * FITM_MV_TILE_SEGS, off[r] bytes in; rows r >= rn absent),
 * the slice of x at xs. A slice starts at a multiple of 256 elements, so its chunk c is chunk
 * c (mod 32) of the row: lane l takes the pass's chunks c = l (mod 32) in increasing order,
 * decodes chunk c of each row once and applies it to every row m < nt of the tile:
 * acc[4m + r] = fitm_mv_fma8(v[r], a, b, acc[4m + r]), a and b the halves of x row m's chunk c,
 * read once for the four rows. */
template <int T, int M>
__device__ __forceinline__ void fitm_mv_tile_pass(const uint4 *ws, const int *off, int p0, int p1,
                                                  int rn, const float4 *xs, int sc, int nt,
                                                  int lane, float *acc)
{
    constexpr int BB = fitm_qtraits<T>::BB, CPB = fitm_qtraits<T>::BE / 8;
    const uint8_t *wb = (const uint8_t *)ws;
    const int c0 = p0 * CPB, c1 = p1 * CPB;
    for (int c = c0 + ((lane - c0) & (FITM_WARP - 1)); c < c1; c += FITM_WARP) {
        const int b = c / CPB - p0, e0 = c % CPB * 8, j = c;
        float v[FITM_MV_TILE_RUNS][8];
#pragma unroll
        for (int r = 0; r < FITM_MV_TILE_RUNS; r++) {
            if (r < rn) {
                fitm_decode_block8<T>(wb + r * FITM_MV_TILE_SEGS * 16 + off[r] + b * BB, e0, v[r]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    v[r][i] = 0.0f;
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (m >= nt)
                break;
            const float4 a = xs[2 * m * sc + j], bh = xs[(2 * m + 1) * sc + j];
#pragma unroll
            for (int r = 0; r < FITM_MV_TILE_RUNS; r++)
                acc[FITM_MV_TILE_RUNS * m + r] =
                    fitm_mv_fma8(v[r], a, bh, acc[FITM_MV_TILE_RUNS * m + r]);
        }
    }
}

/* The warp's sums reduced across its lanes, scattered: v[0 .. N) of every lane are its lane
 * class's partial sums of N outputs. At each level O (16, 8, 4, 2, 1) lanes l and l ^ O split
 * the values they hold, the lane with bit O clear keeping the lower half and its partner the
 * upper, each adding the partner's values of its half: the lower lane's value plus the upper
 * one's, which is what fitm_warp_sum's butterfly adds at that level in its lane 0 (the lower
 * lane at every level, and the lane that writes the one-row kernels' results), so each total
 * has the bits of the butterfly, at about one shuffle an output instead of five. Once a lane
 * holds F values the levels left run the butterfly on them all. At the end lane l holds the
 * totals of outputs [b F, b F + F), b = l >> (the levels left), in v[0 .. F). */
template <int N, int F, int O>
__device__ __forceinline__ void fitm_mv_reduce(float *v, int lane)
{
    if constexpr (O > 0) {
        if constexpr (N > F) {
            constexpr int H = N / 2;
            const bool up = (lane & O) != 0;
#pragma unroll
            for (int i = 0; i < H; i++) {
                const float keep = up ? v[H + i] : v[i], give = up ? v[i] : v[H + i];
                const float got = __shfl_xor_sync(0xffffffffu, give, O);
                v[i] = up ? got + keep : keep + got;
            }
            fitm_mv_reduce<H, F, O / 2>(v, lane);
        } else {
#pragma unroll
            for (int i = 0; i < N; i++)
                v[i] += __shfl_xor_sync(0xffffffffu, v[i], O);
            fitm_mv_reduce<N, F, O / 2>(v, lane);
        }
    }
}

/* y_i[t, n] = sum_k W_i[n, k] x[t, k] for the M rows t of blockIdx.y's tile and the rows of
 * groups [blockIdx.x, blockIdx.x + gridDim.x, ...) (a block keeps its x tile for all its
 * groups): groups below g1 are rows of W0, those below g2 of W1, the rest of W2 (Q, K and V in
 * one launch; one weight: g1 = g2 = groups), WARPS x 4 rows a group. GLU: one weight, W0 the
 * gate and Wu the up projection, WARPS x 2 rows a group, y0 = fitm_mv_glu of both sums.
 * slice: x elements staged at a time (K: all of them, once per block). */
template <int T, int M, bool GLU>
__global__ void __launch_bounds__(fitm_mv_tile<M>::THREADS, fitm_mv_tile<M>::BLOCKS)
    fitm_matvec_tiles(const uint8_t *__restrict__ W0, const uint8_t *__restrict__ W1,
                      const uint8_t *__restrict__ W2, const uint8_t *__restrict__ Wu,
                      int64_t row_bytes, int64_t N0, int64_t N1, int64_t N2, int64_t g1,
                      int64_t g2, int64_t groups, int64_t K, int slice,
                      const float *__restrict__ x, int64_t n_x, float *__restrict__ y0,
                      float *__restrict__ y1, float *__restrict__ y2, int gelu)
{
    fitm_grid_begin();
    constexpr int BE = fitm_qtraits<T>::BE, BB = fitm_qtraits<T>::BB;
    constexpr int NR = FITM_MV_TILE_RUNS, G = GLU ? NR / 2 : NR; /* rows of a warp's outputs */
    constexpr int NW = fitm_mv_tile<M>::WARPS, P = M * NR;
    constexpr int64_t PB = (FITM_MV_TILE_RUN - 15) / BB; /* blocks of a row a pass */
    /* totals a lane keeps: GLU keeps a row's gate and up sums in one lane */
    constexpr int F = P / FITM_WARP > (GLU ? 2 : 1) ? P / FITM_WARP : (GLU ? 2 : 1);
    constexpr int SHARE = FITM_WARP * F / P; /* lanes that end with the same totals */
    FITM_DYNAMIC_SHARED(float4, fitm_mv_smem);
    const int lane = threadIdx.x % FITM_WARP, warp = threadIdx.x / FITM_WARP;
    const int64_t t0 = (int64_t)blockIdx.y * M;
    const int nt = n_x - t0 < M ? (int)(n_x - t0) : M; /* uniform per block */
    const int sc = slice / 8;
    float4 *xs = fitm_mv_smem;
    uint4 *ws = (uint4 *)(fitm_mv_smem + 2 * M * sc) + warp * NR * FITM_MV_TILE_SEGS;
    const bool whole = slice >= K;
    x += t0 * K;
    if (whole) {
        fitm_mv_tile_x<fitm_mv_tile<M>::THREADS, 8>(xs, x, K, 0, (int)K, sc, nt);
        __syncthreads(); /* the tile is whole before any warp reads it */
    }
    for (int64_t gi = blockIdx.x; gi < groups; gi += gridDim.x) {
        const int which = gi < g1 ? 0 : gi < g2 ? 1 : 2; /* uniform per block */
        const uint8_t *W = which == 0 ? W0 : which == 1 ? W1 : W2;
        const int64_t N = which == 0 ? N0 : which == 1 ? N1 : N2;
        float *y = which == 0 ? y0 : which == 1 ? y1 : y2;
        const int64_t n0 = ((gi - (which == 0 ? 0 : which == 1 ? g1 : g2)) * NW + warp) * G;
        const int gn = n0 >= N ? 0 : N - n0 < G ? (int)(N - n0) : G; /* uniform per warp */
        const int rn = GLU ? 2 * gn : gn;
        float acc[P];
#pragma unroll
        for (int i = 0; i < P; i++)
            acc[i] = 0.0f;
        for (int64_t s0 = 0; s0 < K; s0 += slice) {
            const int sn = K - s0 < slice ? (int)(K - s0) : slice;
            if (!whole) {
                __syncthreads(); /* every warp is done with the previous slice */
                fitm_mv_tile_x<fitm_mv_tile<M>::THREADS, 4>(xs, x, K, s0, sn, sc, nt);
                __syncthreads(); /* the slice is whole before any warp reads it */
            }
            if (gn == 0)
                continue;
            for (int p0 = 0; p0 < sn / BE; p0 += (int)PB) {
                const int p1 = sn / BE - p0 < PB ? sn / BE : p0 + (int)PB;
                const uint8_t *lo[NR], *end[NR];
                int off[NR];
#pragma unroll
                for (int r = 0; r < NR; r++) { /* GLU: gate and up of a row side by side */
                    const uint8_t *base = GLU && (r & 1) ? Wu : W;
                    const int g = GLU ? r / 2 : r;
                    lo[r] = base + (n0 + (g < gn ? g : 0)) * row_bytes + (s0 / BE + p0) * BB;
                    end[r] = base + N * row_bytes;
                }
                __syncwarp(); /* every lane is done decoding the warp's previous pass */
                fitm_mv_tile_stage(ws, lo, (p1 - p0) * BB, end, rn, lane, off);
                __syncwarp(); /* the pass is whole before a lane decodes it */
                fitm_mv_tile_pass<T, M>(ws, off, p0, p1, rn, xs, sc, nt, lane, acc);
            }
        }
        if (gn == 0)
            continue;
        fitm_mv_reduce<P, F, FITM_WARP / 2>(acc, lane);
        if (lane % SHARE != 0)
            continue;
        const int b = lane / SHARE; /* this lane's totals: outputs [b F, b F + F) */
#pragma unroll
        for (int f = 0; f < F; f += GLU ? 2 : 1) {
            const int p = b * F + f, m = p / NR, g = (p % NR) / (GLU ? 2 : 1);
            if (m < nt && g < gn)
                y[(t0 + m) * N + n0 + g] = GLU ? fitm_mv_glu(gelu, acc[f], acc[f + 1]) : acc[f];
        }
    }
}

/* x's elements a tile launch stages at a time: all K when M rows of them and the warps'
 * stages fit the block's shared memory (optin bytes), else the most whole 256-element pieces
 * that do. And the launch's dynamic shared memory for it. */
template <int M> static size_t fitm_mv_tile_shm(int64_t slice)
{
    return (size_t)M * (size_t)slice * sizeof(float) +
           (size_t)fitm_mv_tile<M>::WARPS * FITM_MV_TILE_RUNS * FITM_MV_TILE_SEGS * 16;
}

template <int M> static int64_t fitm_mv_tile_slice(int64_t K, size_t optin)
{
    if (fitm_mv_tile_shm<M>(K) <= optin)
        return K;
    const int64_t piece = (int64_t)M * 256 * (int64_t)sizeof(float);
    const int64_t n = ((int64_t)optin - (int64_t)fitm_mv_tile_shm<M>(0)) / piece;
    return n < 1 ? 256 : 256 * n;
}

/* The device's SM count and the shared memory a block may opt in to (at least the 48 KiB
 * every block has), asked once per thread and device: a decode step's launches are on the
 * host's critical path. */
static int fitm_mv_device(int *sms, size_t *optin)
{
    static thread_local int known_dev = -1, known_sms = 1;
    static thread_local size_t known_optin = 48 * 1024;
    int dev = 0, n = 0, b = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev == known_dev) {
        *sms = known_sms, *optin = known_optin;
        return 0;
    }
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&b, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    *sms = n > 1 ? n : 1;
    *optin = b > 48 * 1024 ? (size_t)b : 48 * 1024;
    if (e == cudaSuccess)
        known_dev = dev, known_sms = *sms, known_optin = *optin;
    return (int)e;
}

/* Weight rows of a tile launch's group: WARPS of 4 rows (GLU: 2). */
static int64_t fitm_mv_tile_rows(int M, bool glu)
{
    return (int64_t)(M == 32 ? fitm_mv_tile<32>::WARPS : fitm_mv_tile<8>::WARPS) *
           (glu ? FITM_MV_TILE_RUNS / 2 : FITM_MV_TILE_RUNS);
}

/* The x rows of a tile (M): the fewest tiles of 8, 16 or 32 rows that hold n_x, then halved
 * while the launch would have fewer blocks than half the device's SMs (a product of a few
 * hundred rows: smaller tiles give it more blocks, each decoding its chunks for fewer rows;
 * by the design arithmetic in docs/cuda-backend.md a tile of twice the rows on half as many
 * SMs is still the faster down to about one block for two SMs). N: the n weights' rows. */
static int fitm_mv_tile_m(int64_t n_x, const int64_t *N, int n, bool glu, int sms)
{
    int M = n_x <= 8 ? 8 : n_x <= 16 ? 16 : 32;
    for (; M > 8; M /= 2) {
        const int64_t rows = fitm_mv_tile_rows(M, glu);
        int64_t groups = 0;
        for (int i = 0; i < n; i++)
            groups += (N[i] + rows - 1) / rows;
        if (2 * groups * ((n_x + M - 1) / M) >= sms)
            break;
    }
    return M;
}

/* Launches fitm_matvec_tiles<T, M, GLU> over `groups` groups (g1, g2: the kernel's): its x in
 * slices that fit the block's shared memory (opted in above the default 48 KiB), a block a
 * group up to as many blocks as the SMs hold at once, beyond that each block taking every
 * gridDim.x-th group, the same number of them (or one fewer) in every block. */
template <int T, int M, bool GLU>
static int fitm_mv_tiles_go(const uint8_t *const *w, const uint8_t *wu, int64_t row_bytes,
                            const int64_t *N, int64_t g1, int64_t g2, int64_t groups, int64_t K,
                            const float *x, int64_t n_x, float *const *y, int gelu, int sms,
                            size_t optin, cudaStream_t st)
{
    const int64_t slice = fitm_mv_tile_slice<M>(K, optin);
    const size_t shm = fitm_mv_tile_shm<M>(slice);
    const int e = fitm_smem_optin(fitm_matvec_tiles<T, M, GLU>, shm);
    if (e)
        return e;
    const int64_t tiles = (n_x + M - 1) / M;
    int64_t cap = (int64_t)sms * fitm_mv_tile<M>::BLOCKS / tiles; /* resident blocks a tile */
    cap = cap < 1 ? 1 : cap;
    const int64_t rounds = (groups + cap - 1) / cap, gx = (groups + rounds - 1) / rounds;
    FITM_LAUNCH(dim3((unsigned)gx, (unsigned)tiles), fitm_mv_tile<M>::THREADS, shm, st,
                fitm_matvec_tiles<T, M, GLU>)
    (w[0], w[1], w[2], wu, row_bytes, N[0], N[1], N[2], g1, g2, groups, K, (int)slice, x, n_x,
     y[0], y[1], y[2], gelu);
    return (int)cudaGetLastError();
}

template <int T, bool GLU>
static int fitm_mv_tiles_pick(int M, const uint8_t *const *w, const uint8_t *wu,
                              int64_t row_bytes, const int64_t *N, int64_t g1, int64_t g2,
                              int64_t groups, int64_t K, const float *x, int64_t n_x,
                              float *const *y, int gelu, int sms, size_t optin, cudaStream_t st)
{
    if (M == 8)
        return fitm_mv_tiles_go<T, 8, GLU>(w, wu, row_bytes, N, g1, g2, groups, K, x, n_x, y,
                                           gelu, sms, optin, st);
    if (M == 16)
        return fitm_mv_tiles_go<T, 16, GLU>(w, wu, row_bytes, N, g1, g2, groups, K, x, n_x, y,
                                            gelu, sms, optin, st);
    return fitm_mv_tiles_go<T, 32, GLU>(w, wu, row_bytes, N, g1, g2, groups, K, x, n_x, y, gelu,
                                        sms, optin, st);
}

/* fitm_matvec_rows's batched product (and with wu its GLU) for a block type: the tiles. */
template <int T>
static int fitm_mv_tiles_launch(const uint8_t *w, const uint8_t *wu, int64_t row_bytes,
                                int64_t N, int64_t K, const float *x, int64_t n_x, float *y,
                                int gelu, cudaStream_t st)
{
    int sms;
    size_t optin;
    const int e = fitm_mv_device(&sms, &optin);
    if (e != 0)
        return e;
    const int M = fitm_mv_tile_m(n_x, &N, 1, wu != NULL, sms);
    const int64_t rows = fitm_mv_tile_rows(M, wu != NULL), groups = (N + rows - 1) / rows;
    const uint8_t *ws[3] = {w, NULL, NULL};
    const int64_t Ns[3] = {N, 0, 0};
    float *ys[3] = {y, NULL, NULL};
    if (wu)
        return fitm_mv_tiles_pick<T, true>(M, ws, wu, row_bytes, Ns, groups, groups, groups, K,
                                           x, n_x, ys, gelu, sms, optin, st);
    return fitm_mv_tiles_pick<T, false>(M, ws, NULL, row_bytes, Ns, groups, groups, groups, K, x,
                                        n_x, ys, 0, sms, optin, st);
}

/* R = 1 for a single row (no registers held for rows that are not there), else (float types:
 * the block types take the tiles above) groups of FITM_MV_BATCH rows; both sum every row
 * alike. G rows per warp (grid of N / (4 G) blocks). wu NULL: the plain product. */
template <int T, bool CHUNKED, int G, bool GLU>
static void fitm_matvec_go(const uint8_t *w, const uint8_t *wu, int64_t row_bytes, int64_t N,
                           int64_t K, const float *x, int64_t n_x, float *y, int gelu,
                           cudaStream_t st)
{
    const unsigned gx = (unsigned)((N + FITM_MV_WARPS * G - 1) / (FITM_MV_WARPS * G));
    if (n_x == 1) {
        FITM_LAUNCH(dim3(gx, 1), FITM_MV_THREADS, 0, st, fitm_matvec_rows<T, CHUNKED, 1, G, GLU>)
        (w, wu, row_bytes, N, K, x, n_x, y, gelu);
    } else if constexpr (fitm_qtraits<T>::BE == 1) {
        FITM_LAUNCH(dim3(gx, (unsigned)((n_x + FITM_MV_BATCH - 1) / FITM_MV_BATCH)),
                    FITM_MV_THREADS, 0, st, fitm_matvec_rows<T, CHUNKED, FITM_MV_BATCH, G, GLU>)
        (w, wu, row_bytes, N, K, x, n_x, y, gelu);
    }
}

/* A wide product of a block type (an LM head: many rows, each a few hundred bytes) takes
 * FITM_MV_WIDE_ROWS rows per warp, so each warp has that many rows' bytes in flight per pass
 * and a warp's start and reductions are shared by more bytes; the others one row per warp,
 * which gives a product of a few hundred rows enough blocks to spread over the GPU. */
template <int T, bool CHUNKED>
static void fitm_matvec_pick(const uint8_t *w, const uint8_t *wu, int64_t row_bytes, int64_t N,
                             int64_t K, const float *x, int64_t n_x, float *y, int gelu,
                             cudaStream_t st)
{
    if (wu)
        fitm_matvec_go<T, CHUNKED, 1, true>(w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
    else if (fitm_qtraits<T>::BE > 1 && N >= FITM_MV_WIDE_N)
        fitm_matvec_go<T, CHUNKED, (fitm_qtraits<T>::BE > 1 ? FITM_MV_WIDE_ROWS : 1), false>(
            w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
    else
        fitm_matvec_go<T, CHUNKED, 1, false>(w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
}

template <int T>
static int fitm_matvec_launch(const void *W, const void *Wu, int64_t N, int64_t K, const float *x,
                              int64_t n_x, float *y, int gelu, cudaStream_t st)
{
    const int64_t row_bytes = K / fitm_qtraits<T>::BE * fitm_qtraits<T>::BB;
    const uint8_t *w = (const uint8_t *)W, *wu = (const uint8_t *)Wu;
    if constexpr (fitm_qtraits<T>::BE > 1) {
        if (n_x > 1)
            return fitm_mv_tiles_launch<T>(w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
    }
    if (K % 8 == 0)
        fitm_matvec_pick<T, true>(w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
    else if constexpr (fitm_qtraits<T>::BE == 1)
        fitm_matvec_pick<T, false>(w, wu, row_bytes, N, K, x, n_x, y, gelu, st);
    else
        return (int)cudaErrorInvalidValue; /* unreachable: K is a multiple of the block */
    return (int)cudaGetLastError();
}

/* y (n_x, N) = x (n_x, K) . W^T after the checks of fitm_cuda_matvec; with Wu, y = act(that)
 * * x . Wu^T (fitm_cuda_matmul_glu). */
static int fitm_matvec_any(fitm_dtype t, const void *W, const void *Wu, int64_t N, int64_t K,
                           const float *x, int64_t n_x, float *y, int gelu, void *stream)
{
    if (!fitm_cuda_dequant_supported(t) || N < 0 || K < 0 || K % fitm_qblock_elems(t) != 0 || !W ||
        !x || !y || !fitm_aligned16(W) || (Wu && !fitm_aligned16(Wu)) || !fitm_aligned16(x) ||
        n_x < 0 || n_x > 65535)
        return (int)cudaErrorInvalidValue;
    if ((N + FITM_MV_WARPS - 1) / FITM_MV_WARPS > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || n_x == 0)
        return 0;
    cudaStream_t st = fitm_stream(stream);
    // clang-format off
    switch (t) {
    case FITM_DTYPE_F32: return fitm_matvec_launch<FITM_DTYPE_F32>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_F16: return fitm_matvec_launch<FITM_DTYPE_F16>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_BF16: return fitm_matvec_launch<FITM_DTYPE_BF16>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q4_0: return fitm_matvec_launch<FITM_DTYPE_Q4_0>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q5_0: return fitm_matvec_launch<FITM_DTYPE_Q5_0>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q8_0: return fitm_matvec_launch<FITM_DTYPE_Q8_0>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q4_K: return fitm_matvec_launch<FITM_DTYPE_Q4_K>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q5_K: return fitm_matvec_launch<FITM_DTYPE_Q5_K>(W, Wu, N, K, x, n_x, y, gelu, st);
    case FITM_DTYPE_Q6_K: return fitm_matvec_launch<FITM_DTYPE_Q6_K>(W, Wu, N, K, x, n_x, y, gelu, st);
    default: return (int)cudaErrorInvalidValue;
    }
    // clang-format on
}

/* The blocks of the three weights side by side: b[i] blocks (tiles: groups) of rows of W[i],
 * FITM_MV_WARPS rows a block for one row of x, a tile group's rows for more of a block type. */
template <int T, bool CHUNKED>
static int fitm_matvec3_go(const uint8_t *const *w, int64_t row_bytes, const int64_t *N, int64_t K,
                           const float *x, int64_t n_x, float *const *y, cudaStream_t st)
{
    const bool tiles = fitm_qtraits<T>::BE > 1 && n_x > 1;
    int sms = 1, M = 0;
    size_t optin = 0;
    if (tiles) {
        const int e = fitm_mv_device(&sms, &optin);
        if (e != 0)
            return e;
        M = fitm_mv_tile_m(n_x, N, 3, false, sms);
    }
    const int64_t rows = tiles ? fitm_mv_tile_rows(M, false) : FITM_MV_WARPS;
    unsigned b[3];
    for (int i = 0; i < 3; i++)
        b[i] = (unsigned)((N[i] + rows - 1) / rows);
    const unsigned gx = b[0] + b[1] + b[2], b1 = b[0], b2 = b[0] + b[1];
    if constexpr (fitm_qtraits<T>::BE > 1) {
        if (tiles)
            return fitm_mv_tiles_pick<T, false>(M, w, NULL, row_bytes, N, b1, b2, gx, K, x, n_x,
                                                y, 0, sms, optin, st);
    }
    if (n_x == 1) {
        FITM_LAUNCH(dim3(gx, 1), FITM_MV_THREADS, 0, st, fitm_matvec_rows3<T, CHUNKED, 1>)
        (w[0], w[1], w[2], row_bytes, N[0], N[1], N[2], b1, b2, K, x, n_x, y[0], y[1], y[2]);
    } else if constexpr (fitm_qtraits<T>::BE == 1) {
        FITM_LAUNCH(dim3(gx, (unsigned)((n_x + FITM_MV_BATCH - 1) / FITM_MV_BATCH)),
                    FITM_MV_THREADS, 0, st, fitm_matvec_rows3<T, CHUNKED, FITM_MV_BATCH>)
        (w[0], w[1], w[2], row_bytes, N[0], N[1], N[2], b1, b2, K, x, n_x, y[0], y[1], y[2]);
    }
    return (int)cudaGetLastError();
}

template <int T>
static int fitm_matvec3_launch(const uint8_t *const *w, const int64_t *N, int64_t K, const float *x,
                               int64_t n_x, float *const *y, cudaStream_t st)
{
    const int64_t row_bytes = K / fitm_qtraits<T>::BE * fitm_qtraits<T>::BB;
    if (K % 8 == 0)
        return fitm_matvec3_go<T, true>(w, row_bytes, N, K, x, n_x, y, st);
    else if constexpr (fitm_qtraits<T>::BE == 1)
        return fitm_matvec3_go<T, false>(w, row_bytes, N, K, x, n_x, y, st);
    else
        return (int)cudaErrorInvalidValue; /* unreachable: K is a multiple of the block */
}

extern "C" int fitm_cuda_matmul_rows_n(fitm_dtype t, int n, const void *const *W, const int64_t *N,
                                       int64_t K, const float *x, int64_t T, float *const *y,
                                       void *stream)
{
    if (n < 1 || n > FITM_CUDA_MM_MAX_OUTS || !W || !N || !y || !fitm_cuda_dequant_supported(t) ||
        K < 0 || K % fitm_qblock_elems(t) != 0 || !x || !fitm_aligned16(x) || T < 0 || T > 65535)
        return (int)cudaErrorInvalidValue;
    const uint8_t *w[3] = {NULL, NULL, NULL};
    int64_t nn[3] = {0, 0, 0}, blocks = 0;
    float *yy[3] = {NULL, NULL, NULL};
    for (int i = 0; i < n; i++) {
        if (!W[i] || !y[i] || N[i] < 0 || !fitm_aligned16(W[i]))
            return (int)cudaErrorInvalidValue;
        w[i] = (const uint8_t *)W[i], nn[i] = N[i], yy[i] = y[i];
        blocks += (N[i] + FITM_MV_WARPS - 1) / FITM_MV_WARPS;
    }
    if (blocks > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    if (blocks == 0 || T == 0)
        return 0;
    cudaStream_t st = fitm_stream(stream);
    // clang-format off
    switch (t) {
    case FITM_DTYPE_F32: return fitm_matvec3_launch<FITM_DTYPE_F32>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_F16: return fitm_matvec3_launch<FITM_DTYPE_F16>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_BF16: return fitm_matvec3_launch<FITM_DTYPE_BF16>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q4_0: return fitm_matvec3_launch<FITM_DTYPE_Q4_0>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q5_0: return fitm_matvec3_launch<FITM_DTYPE_Q5_0>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q8_0: return fitm_matvec3_launch<FITM_DTYPE_Q8_0>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q4_K: return fitm_matvec3_launch<FITM_DTYPE_Q4_K>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q5_K: return fitm_matvec3_launch<FITM_DTYPE_Q5_K>(w, nn, K, x, T, yy, st);
    case FITM_DTYPE_Q6_K: return fitm_matvec3_launch<FITM_DTYPE_Q6_K>(w, nn, K, x, T, yy, st);
    default: return (int)cudaErrorInvalidValue;
    }
    // clang-format on
}

extern "C" int fitm_cuda_matvec(fitm_dtype t, const void *W, int64_t N, int64_t K, const float *x,
                                float *y, void *stream)
{
    return fitm_matvec_any(t, W, NULL, N, K, x, 1, y, 0, stream);
}

extern "C" int fitm_cuda_matmul_rows(fitm_dtype t, const void *W, int64_t N, int64_t K,
                                     const float *x, int64_t T, float *y, void *stream)
{
    return fitm_matvec_any(t, W, NULL, N, K, x, T, y, 0, stream);
}

extern "C" int fitm_cuda_matmul_glu(fitm_dtype t, const void *Wg, const void *Wu, int64_t N,
                                    int64_t K, const float *x, int64_t T, int gelu, float *y,
                                    void *stream)
{
    if (!Wu)
        return (int)cudaErrorInvalidValue;
    return fitm_matvec_any(t, Wg, Wu, N, K, x, T, y, gelu ? 1 : 0, stream);
}
