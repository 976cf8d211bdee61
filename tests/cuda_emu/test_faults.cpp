/* test_faults: the emulator fails where a device fails (contract in cuda_runtime_api.h).
 * Each class of fault is planted and must be refused with the device's error, while the same
 * call on valid arguments runs and computes the right values (so a refusal is not a refusal
 * of everything):
 *
 * - launch limits (cudaErrorInvalidConfiguration, not sticky): a block of 1025 threads, a grid
 *   with y or z over 65535, dynamic shared memory over 48 KiB without the kernel's opt-in, and
 *   over the device's per-block maximum with it;
 * - host memory where the device needs its own (cudaErrorIllegalAddress, sticky: the context
 *   is lost, later calls fail until fitm_emu_reset_device): a host pointer as a kernel's
 *   argument, inside a struct argument (fitm_cuda_attention's queries), inside the device array
 *   of structs of fitm_cuda_attention_many, as a cuBLAS operand, as the device side of an
 *   asynchronous copy and of a memset;
 * - warp matrix functions (mma.h), as a device faults (sticky): a load or store pointer not
 *   32-byte aligned or an ldm not a multiple of 8 bfloat16 or 4 floats
 *   (cudaErrorMisalignedAddress), a tile past its allocation's end or past the launch's
 *   dynamic shared memory (cudaErrorIllegalAddress), a lane skipping a collective
 *   (cudaErrorLaunchFailure); valid tiles from device and from dynamic shared memory multiply
 *   within the bound of a double reference;
 * - a 16-byte __ldg (float4) at an address not 16-byte aligned (cudaErrorMisalignedAddress,
 *   sticky), where the aligned one reads the right values;
 * - asynchronous copies (cuda_pipeline.h): a copy lands at its thread's wait for its group,
 *   not before (a read before the wait sees the old bytes), the zero fill zeroes, a wait that
 *   keeps the newest group in flight lands only the older; a copy from a misaligned source
 *   (cudaErrorMisalignedAddress), into global memory or from host memory
 *   (cudaErrorIllegalAddress), of 12 bytes, or a thread ending with a copy in flight
 *   (cudaErrorLaunchFailure) faults, sticky;
 * - graphs: a captured stream's launches, copies and cuBLAS calls run only at each replay, in
 *   order, on the values their memory holds then; a host wait during a capture is refused and
 *   breaks it; an instance whose copy's pinned memory was freed after the capture is refused
 *   at launch (cudaErrorInvalidValue, not sticky), as the H200 refused a9dc5ac's;
 * - programmatic launches (kernels/common.cuh; cudaErrorLaunchFailure, sticky): a kernel
 *   launched so whose threads do not all call fitm_grid_begin, or reach a barrier before it,
 *   faults (on a device its reads could race the kernel before it), where the same kernel
 *   runs as a plain launch and a kernel that calls it first runs either way, captured too;
 *   fitm_grid_begin_prefetch of device memory runs either way, and of host memory or past an
 *   allocation's end faults (cudaErrorIllegalAddress, sticky);
 * - the statistics (fitm_emu_get_stats) count submissions and waits as described;
 * - FITM_CUDA_EMU_HOST_ONLY: the checks and counts without the arithmetic. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "check.h"
#include "common.cuh"
#include "kernels.h"

/* y[i] = 2 x[i] + i over a grid-stride loop. */
__global__ void twice(float *y, const float *x, int n)
{
    const int stride = (int)(gridDim.x * blockDim.x);
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += stride)
        y[i] = 2.0f * x[i] + (float)i;
}

/* Every thread writes its index to the dynamic shared memory; thread 0 sums it into *out. */
__global__ void smem_sum(float *out, int n)
{
    FITM_DYNAMIC_SHARED(float, s);
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x)
        s[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0;
        for (int i = 0; i < n; i++)
            t += s[i];
        out[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)] = t;
    }
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
        exit(1);
    }
    return p;
}

/* After a planted illegal address: the error is sticky (read twice), nothing runs any more,
 * and fitm_emu_reset_device brings the device back. */
static void expect_lost(const char *what)
{
    CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress, "%s: sync", what);
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress, "%s: last error", what);
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress, "%s: still (sticky)", what);
    void *p = NULL;
    CHECK(cudaMalloc(&p, 64) == cudaErrorIllegalAddress && !p, "%s: malloc after", what);
    fitm_emu_reset_device();
    CHECK(cudaGetLastError() == cudaSuccess, "%s: reset", what);
}

/* As expect_lost, for a fault of error e. */
static void expect_lost_with(cudaError_t e, const char *what)
{
    CHECK(cudaDeviceSynchronize() == e, "%s: sync", what);
    CHECK(cudaGetLastError() == e, "%s: last error", what);
    CHECK(cudaGetLastError() == e, "%s: still (sticky)", what);
    fitm_emu_reset_device();
    CHECK(cudaGetLastError() == cudaSuccess, "%s: reset", what);
}

/* One warp: c (16 x 16, row-major, ldc) = a (16 x 16, row-major, lda) . b (16 x 16 stored as
 * its columns, ldb). stage: a is first copied (16 rows of lda) into dynamic shared memory and
 * loaded from there. Lane skip (>= 0) does not load b. */
__global__ void wmma_tile(float *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b, unsigned lda,
                          unsigned ldb, unsigned ldc, int stage, int skip)
{
    namespace wmma = nvcuda::wmma;
    FITM_DYNAMIC_SHARED(__align__(128) unsigned char, shared);
    const __nv_bfloat16 *as = a;
    if (stage) {
        __nv_bfloat16 *s = (__nv_bfloat16 *)shared;
        for (unsigned i = threadIdx.x; i < 16 * lda; i += 32)
            s[i] = a[i];
        __syncthreads();
        as = s;
    }
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::fill_fragment(fb, __float2bfloat16_rn(0.0f));
    wmma::load_matrix_sync(fa, as, lda);
    if ((int)threadIdx.x != skip)
        wmma::load_matrix_sync(fb, b, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, ldc, wmma::mem_row_major);
}

static float bf16_value(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

static void test_wmma(void)
{
    const unsigned ld = 24; /* elements: a multiple of 8, rows 48 bytes apart */
    __nv_bfloat16 ah[16 * ld], bh[16 * ld];
    for (unsigned i = 0; i < 16 * ld; i++) {
        ah[i] = __float2bfloat16_rn((float)(rand() % 2001 - 1000) / 256.0f);
        bh[i] = __float2bfloat16_rn((float)(rand() % 2001 - 1000) / 256.0f);
    }
    /* one spare row of slack: tiles at 16 bytes past the start still end inside */
    __nv_bfloat16 *a = (__nv_bfloat16 *)dev_alloc(17 * ld * 2),
                  *b = (__nv_bfloat16 *)dev_alloc(17 * ld * 2);
    float *c = (float *)dev_alloc(16 * 20 * 4);
    cudaMemcpy(a, ah, sizeof ah, cudaMemcpyHostToDevice);
    cudaMemcpy(b, bh, sizeof bh, cudaMemcpyHostToDevice);
    for (int stage = 0; stage < 2; stage++) {
        cudaMemset(c, 0xFF, 16 * 20 * 4);
        FITM_LAUNCH(dim3(1), dim3(32), stage ? 16 * ld * 2 : 0, NULL, wmma_tile)
        (c, a, b, ld, ld, 20, stage, -1);
        float ch[16 * 20];
        CHECK(cudaMemcpy(ch, c, sizeof ch, cudaMemcpyDeviceToHost) == cudaSuccess, "wmma run");
        int bad = 0;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 16; n++) {
                double ref = 0.0, mag = 0.0;
                for (int k = 0; k < 16; k++) {
                    const double p =
                        (double)bf16_value(ah[r * ld + k]) * bf16_value(bh[n * ld + k]);
                    ref += p, mag += fabs(p);
                }
                bad += fabs(ch[r * 20 + n] - ref) > (2 * 16 + 4) * ldexp(1.0, -24) * mag;
            }
        CHECK(bad == 0, "wmma tile (%s): %d of 256 elements off the reference",
              stage ? "from shared memory" : "from device memory", bad);
    }

    /* a tile 16 bytes past its allocation's start: not 32-byte aligned */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a + 8, b, ld, ld, 20, 0, -1);
    expect_lost_with(cudaErrorMisalignedAddress, "wmma load at 16 bytes");
    /* ldm 20 bfloat16 (40 bytes): not a multiple of 8 elements */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a, b, ld, 20, 20, 0, -1);
    expect_lost_with(cudaErrorMisalignedAddress, "wmma load with ldm 20");
    /* a float store with ldm 18: not a multiple of 4 */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a, b, ld, ld, 18, 0, -1);
    expect_lost_with(cudaErrorMisalignedAddress, "wmma store with ldm 18");
    /* ldm 40: the tile's 16th row ends past the allocation (17 rows of 24) */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a, b, ld, 40, 20, 0, -1);
    expect_lost_with(cudaErrorIllegalAddress, "wmma load past the allocation");
    /* staged a of 16 rows of 24, the dynamic shared memory one row short */
    FITM_LAUNCH(dim3(1), dim3(32), 15 * ld * 2, NULL, wmma_tile)(c, a, b, ld, ld, 20, 1, -1);
    expect_lost_with(cudaErrorIllegalAddress, "wmma load past the dynamic shared memory");
    /* lane 5 skips the load of b */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a, b, ld, ld, 20, 0, 5);
    expect_lost_with(cudaErrorLaunchFailure, "wmma load skipped by a lane");
    /* the device runs again afterwards */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, wmma_tile)(c, a, b, ld, ld, 20, 0, -1);
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "wmma after the faults");
    cudaFree(a), cudaFree(b), cudaFree(c);
}

static void test_limits(void)
{
    const int n = 5000;
    float *x = (float *)dev_alloc(n * sizeof(float)), *y = (float *)dev_alloc(n * sizeof(float));
    float xh[n], yh[n];
    for (int i = 0; i < n; i++)
        xh[i] = (float)(rand() % 1000) / 7.0f;
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);

    FITM_LAUNCH(dim3(3), dim3(1024), 0, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaSuccess, "1024 threads run");
    cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost);
    bool right = true;
    for (int i = 0; i < n; i++)
        right = right && yh[i] == 2.0f * xh[i] + (float)i;
    CHECK(right, "the valid launch computes y");

    cudaMemset(y, 0, sizeof yh);
    FITM_LAUNCH(dim3(1), dim3(1025), 0, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads refused");
    FITM_LAUNCH(dim3(1), dim3(32, 32, 2), 0, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "32x32x2 threads refused");
    FITM_LAUNCH(dim3(1, 65536), dim3(32), 0, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid y 65536 refused");
    FITM_LAUNCH(dim3(1, 1, 65536), dim3(32), 0, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid z 65536 refused");
    cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost);
    bool untouched = true;
    for (int i = 0; i < n; i++)
        untouched = untouched && yh[i] == 0.0f;
    CHECK(untouched, "refused launches ran nothing");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "invalid configurations are not sticky");

    /* dynamic shared memory: 48 KiB without opt-in, more only with it, never over the max */
    float *out = (float *)dev_alloc(4 * sizeof(float));
    const int n48 = 48 * 1024 / 4, n49 = n48 + 256;
    FITM_LAUNCH(dim3(2, 1, 2), dim3(256), (size_t)n48 * 4, NULL, smem_sum)(out, n48);
    CHECK(cudaGetLastError() == cudaSuccess, "48 KiB of dynamic shared memory run");
    float oh[4];
    cudaMemcpy(oh, out, sizeof oh, cudaMemcpyDeviceToHost);
    const float want48 = (float)((double)n48 * (n48 - 1) / 2);
    CHECK(fabsf(oh[0] - want48) <= 1e-3f * want48 && fabsf(oh[3] - want48) <= 1e-3f * want48,
          "smem sum %g, want %g", oh[0], want48);
    FITM_LAUNCH(dim3(1), dim3(256), (size_t)n49 * 4, NULL, smem_sum)(out, n49);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "49 KiB without opt-in refused");
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.sharedMemPerBlock == 48 * 1024 &&
          p.sharedMemPerBlockOptin > p.sharedMemPerBlock);
    int sms = 0, optin = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess &&
              sms == p.multiProcessorCount &&
              cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) ==
                  cudaSuccess &&
              (size_t)optin == p.sharedMemPerBlockOptin,
          "cudaDeviceGetAttribute gives cudaGetDeviceProperties's values");
    const int n_max = (int)(p.sharedMemPerBlockOptin / 4);
    CHECK(cudaFuncSetAttribute(smem_sum, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)p.sharedMemPerBlockOptin + 1) == cudaErrorInvalidValue,
          "an opt-in over the device's maximum refused");
    (void)cudaGetLastError();
    CHECK(cudaFuncSetAttribute(smem_sum, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)p.sharedMemPerBlockOptin) == cudaSuccess);
    FITM_LAUNCH(dim3(1), dim3(256), (size_t)n_max * 4, NULL, smem_sum)(out, n_max);
    CHECK(cudaGetLastError() == cudaSuccess, "the device's maximum with the opt-in runs");
    cudaMemcpy(oh, out, sizeof(float), cudaMemcpyDeviceToHost);
    const float want_max = (float)((double)n_max * (n_max - 1) / 2);
    CHECK(fabsf(oh[0] - want_max) <= 1e-3f * want_max, "smem sum %g, want %g", oh[0], want_max);
    FITM_LAUNCH(dim3(1), dim3(256), (size_t)n_max * 4 + 4, NULL, smem_sum)(out, n_max + 1);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "over the maximum refused");
    /* the opt-in is the kernel's own: another kernel keeps the 48 KiB limit */
    FITM_LAUNCH(dim3(1), dim3(256), (size_t)n49 * 4, NULL, twice)(y, x, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "another kernel: no opt-in");
    cudaFree(x), cudaFree(y), cudaFree(out);
}

static void test_host_pointers(void)
{
    const int n = 300;
    float *x = (float *)dev_alloc(n * sizeof(float)), *y = (float *)dev_alloc(n * sizeof(float));
    float *host = (float *)calloc(n, sizeof(float));

    /* a host pointer as a kernel's argument (as the rope test once handed its table) */
    FITM_LAUNCH(dim3(2), dim3(128), 0, NULL, twice)(y, host, n);
    expect_lost("kernel argument");
    CHECK(fitm_cuda_add(y, host, n, NULL) == cudaErrorIllegalAddress, "fitm_cuda_add");
    expect_lost("fitm_cuda_add");
    /* an interior pointer of a device allocation is fine; one past its end only for nothing */
    FITM_LAUNCH(dim3(1), dim3(32), 0, NULL, twice)(y + 10, x + 10, n - 10);
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "interior pointers");

    /* pinned host memory is mapped: kernels may read it */
    float *pin = NULL;
    CHECK(cudaMallocHost((void **)&pin, n * sizeof(float)) == cudaSuccess);
    for (int i = 0; i < n; i++)
        pin[i] = (float)i;
    FITM_LAUNCH(dim3(2), dim3(128), 0, NULL, twice)(y, pin, n);
    float yh[n];
    CHECK(cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(yh[7] == 21.0f && yh[n - 1] == 3.0f * (float)(n - 1), "from pinned: %g", yh[7]);

    /* a device pointer in a struct argument, and in the device array of attention_many */
    const int D = 8;
    float *q = (float *)dev_alloc(D * sizeof(float)), *o = (float *)dev_alloc(D * sizeof(float));
    float *kv = (float *)dev_alloc(D * sizeof(float));
    cudaMemset(q, 0, D * 4), cudaMemset(kv, 0, D * 4);
    fitm_cuda_attn a;
    memset(&a, 0, sizeof a);
    a.T = 1, a.n_head = 1, a.n_head_kv = 1, a.head_dim = D, a.scale = 1.0f;
    a.q = q, a.out = o, a.k_own = kv, a.v_own = kv;
    CHECK(fitm_cuda_attention(&a, NULL) == cudaSuccess, "attention on device memory");
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    fitm_cuda_attn *a_dev = (fitm_cuda_attn *)dev_alloc(2 * sizeof a);
    fitm_cuda_attn two[2] = {a, a};
    cudaMemcpy(a_dev, two, sizeof two, cudaMemcpyHostToDevice);
    CHECK(fitm_cuda_attention_many(two, a_dev, 2, NULL, NULL, 0, NULL) == cudaSuccess,
          "attention_many");
    a.q = host;
    CHECK(fitm_cuda_attention(&a, NULL) == cudaErrorIllegalAddress, "host queries in the struct");
    expect_lost("struct argument");
    two[1].v_own = host;
    cudaMemcpy(a_dev, two, sizeof two, cudaMemcpyHostToDevice);
    CHECK(fitm_cuda_attention_many(two, a_dev, 2, NULL, NULL, 0, NULL) == cudaErrorIllegalAddress,
          "host values in the second of the device structs");
    expect_lost("array of structs");
    CHECK(fitm_cuda_attention_many(two, two, 2, NULL, NULL, 0, NULL) == cudaErrorIllegalAddress,
          "the struct array itself in host memory");
    expect_lost("host struct array");

    /* cuBLAS operands */
    cublasHandle_t h;
    CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    const float one = 1.0f, zero = 0.0f;
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, x, 4, x + 16, 4, &zero, y, 4) ==
          CUBLAS_STATUS_SUCCESS);
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "gemm on device memory");
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, x, 4, host, 4, &zero, y, 4) ==
          CUBLAS_STATUS_EXECUTION_FAILED);
    expect_lost("cuBLAS B");
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, x, 4, x, 4, &zero, host, 4) ==
          CUBLAS_STATUS_EXECUTION_FAILED);
    expect_lost("cuBLAS C");
    /* 16BF operands (the BATCH class's tensor-core products): device memory passes, host
     * memory or an operand running past its allocation loses the context */
    CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 4, 4, 8, &one, x, CUDA_R_16BF, 8, x + 16,
                       CUDA_R_16BF, 8, &zero, y, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "16BF gemm on device memory");
    CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 4, 4, 8, &one, host, CUDA_R_16BF, 8, x,
                       CUDA_R_16BF, 8, &zero, y, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_EXECUTION_FAILED);
    expect_lost("cuBLAS 16BF A");
    /* B: 64 columns of 8 bfloat16 (1024 bytes) from 800 bytes into x's 1200 */
    CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 4, 64, 8, &one, x, CUDA_R_16BF, 8, x + 200,
                       CUDA_R_16BF, 8, &zero, y, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_EXECUTION_FAILED);
    expect_lost("cuBLAS 16BF B past its allocation");
    cublasDestroy(h);

    /* the device side of copies and memsets */
    float back[4];
    CHECK(cudaMemcpyAsync(host, pin, 16, cudaMemcpyHostToDevice, NULL) == cudaErrorIllegalAddress);
    expect_lost("copy to a host 'device' address");
    CHECK(cudaMemcpyAsync(back, host, 16, cudaMemcpyDeviceToHost, NULL) == cudaErrorIllegalAddress);
    expect_lost("copy from a host 'device' address");
    CHECK(cudaMemcpyAsync(y, host, 16, cudaMemcpyDeviceToDevice, NULL) == cudaErrorIllegalAddress);
    expect_lost("device-to-device from host memory");
    CHECK(cudaMemsetAsync(host, 0, 16, NULL) == cudaErrorIllegalAddress);
    expect_lost("memset of host memory");
    CHECK(cudaMemcpyAsync(y + n - 2, pin, 16, cudaMemcpyHostToDevice, NULL) ==
          cudaErrorIllegalAddress);
    expect_lost("copy past the allocation's end");
    CHECK(cudaFree(host) == cudaErrorInvalidValue, "cudaFree of host memory");
    (void)cudaGetLastError();

    cudaFreeHost(pin);
    cudaFree(x), cudaFree(y), cudaFree(q), cudaFree(o), cudaFree(kv), cudaFree(a_dev);
    free(host);
}

static void test_graphs(void)
{
    const int n = 1000;
    float *x = (float *)dev_alloc(n * sizeof(float)), *y = (float *)dev_alloc(n * sizeof(float));
    float *pin = NULL;
    cudaMallocHost((void **)&pin, n * sizeof(float));
    cudaStream_t s;
    cudaStreamCreate(&s);
    cublasHandle_t h;
    cublasCreate(&h);
    cublasSetStream(h, s);
    const float one = 1.0f, zero = 0.0f;

    fitm_emu_stats before, after;
    fitm_emu_get_stats(&before);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    /* pin -> x, y = 2x + i, x (10x10) = y (10x10) . y (10x10), all recorded */
    CHECK(cudaMemcpyAsync(x, pin, n * sizeof(float), cudaMemcpyHostToDevice, s) == cudaSuccess);
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(y, x, n);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 10, 10, 10, &one, y, 10, y, 10, &zero, x, 10) ==
          CUBLAS_STATUS_SUCCESS);
    fitm_emu_get_stats(&after);
    CHECK(after.kernels_run == before.kernels_run && after.launches == before.launches &&
              after.blas_calls == before.blas_calls && after.copies == before.copies,
          "nothing runs while captured");
    cudaGraph_t g;
    CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess && g);
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < n; i++)
            pin[i] = (float)(i % 17) * 0.25f + (float)round; /* new inputs before each replay */
        fitm_emu_get_stats(&before);
        CHECK(cudaGraphLaunch(ge, s) == cudaSuccess);
        CHECK(cudaStreamSynchronize(s) == cudaSuccess);
        fitm_emu_get_stats(&after);
        CHECK(after.graph_launches == before.graph_launches + 1 &&
                  after.kernels_run == before.kernels_run + 1 &&
                  after.launches == before.launches && after.host_waits == before.host_waits + 1,
              "one submission, one kernel, one wait");
        float xh[100];
        cudaMemcpy(xh, x, sizeof xh, cudaMemcpyDeviceToHost);
        double worst = 0;
        for (int r = 0; r < 10; r++)
            for (int c = 0; c < 10; c++) {
                double want = 0;
                for (int k = 0; k < 10; k++) {
                    const int ia = r + 10 * k, ib = k + 10 * c;
                    want += (2.0 * pin[ia] + ia) * (2.0 * pin[ib] + ib);
                }
                worst = fmax(worst, fabs(xh[r + 10 * c] - want) / fmax(1.0, fabs(want)));
            }
        CHECK(worst < 1e-5, "replay %d: relative error %g", round, worst);
    }
    /* an update gives the instance a new capture's arguments, if the operations are the same */
    float *z = (float *)dev_alloc(n * sizeof(float));
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK(cudaMemcpyAsync(x, pin, n * sizeof(float), cudaMemcpyHostToDevice, s) == cudaSuccess);
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(z, x, n); /* into z now */
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 10, 10, 10, &one, y, 10, y, 10, &zero, x, 10) ==
          CUBLAS_STATUS_SUCCESS);
    cudaGraph_t g_new;
    size_t nodes = 0;
    CHECK(cudaStreamEndCapture(s, &g_new) == cudaSuccess &&
          cudaGraphGetNodes(g_new, NULL, &nodes) == cudaSuccess && nodes == 3);
    cudaGraphExecUpdateResultInfo info;
    CHECK(cudaGraphExecUpdate(ge, g_new, &info) == cudaSuccess &&
          info.result == cudaGraphExecUpdateSuccess);
    for (int i = 0; i < n; i++)
        pin[i] = 1.0f;
    cudaMemset(z, 0, n * sizeof(float));
    CHECK(cudaGraphLaunch(ge, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
    float zh[3];
    cudaMemcpy(zh, z, sizeof zh, cudaMemcpyDeviceToHost);
    CHECK(zh[0] == 2.0f && zh[2] == 4.0f, "the updated launch wrote z: %g %g", zh[0], zh[2]);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(z, x, n);
    cudaGraph_t g_other;
    CHECK(cudaStreamEndCapture(s, &g_other) == cudaSuccess);
    CHECK(cudaGraphExecUpdate(ge, g_other, &info) == cudaErrorGraphExecUpdateFailure &&
          info.result == cudaGraphExecUpdateErrorTopologyChanged);
    (void)cudaGetLastError();
    cudaGraphDestroy(g_new), cudaGraphDestroy(g_other);
    cudaFree(z);

    /* a host wait while capturing is refused and breaks the capture */
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(y, x, n);
    CHECK(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported);
    cudaGraph_t bad;
    CHECK(cudaStreamEndCapture(s, &bad) == cudaErrorStreamCaptureInvalidated && !bad);
    (void)cudaGetLastError();
    /* so are an allocation and a copy from pageable memory */
    float *host_buf = (float *)calloc(n, sizeof(float));
    for (int what = 0; what < 2; what++) {
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        void *p = NULL;
        if (what == 0)
            CHECK(cudaMalloc(&p, 64) == cudaErrorStreamCaptureUnsupported && !p);
        else
            CHECK(cudaMemcpyAsync(y, host_buf, 64, cudaMemcpyHostToDevice, s) ==
                  cudaErrorStreamCaptureUnsupported);
        CHECK(cudaStreamEndCapture(s, &bad) == cudaErrorStreamCaptureInvalidated && !bad);
        (void)cudaGetLastError();
    }
    free(host_buf);
    /* a copy node's pinned memory freed after the capture: the launch is refused as a device
     * refuses it (cudaErrorInvalidValue, the context kept), where it ran before the free */
    float *pin2 = NULL;
    CHECK(cudaMallocHost((void **)&pin2, n * sizeof(float)) == cudaSuccess);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(cudaMemcpyAsync(pin2, y, n * sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
    cudaGraph_t g3;
    cudaGraphExec_t ge3;
    CHECK(cudaStreamEndCapture(s, &g3) == cudaSuccess && cudaGraphInstantiate(&ge3, g3, 0) == 0);
    memset(pin2, 0, n * sizeof(float));
    CHECK(cudaGraphLaunch(ge3, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
    float yh[2];
    cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost);
    CHECK(pin2[0] == yh[0] && pin2[1] == yh[1], "the copy ran: %g %g", pin2[1], yh[1]);
    CHECK(cudaFreeHost(pin2) == cudaSuccess);
    CHECK(cudaGraphLaunch(ge3, s) == cudaErrorInvalidValue, "freed pinned memory under a copy");
    CHECK(cudaGetLastError() == cudaErrorInvalidValue && cudaGetLastError() == cudaSuccess,
          "refused, not sticky");
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(y, x, n);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "the context is kept");
    cudaGraphExecDestroy(ge3), cudaGraphDestroy(g3);
    /* an illegal address inside a graph shows when it replays */
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    float *host = (float *)calloc(n, sizeof(float));
    FITM_LAUNCH(dim3(4), dim3(256), 0, s, twice)(y, host, n);
    CHECK(cudaGetLastError() == cudaSuccess, "recorded, not run");
    cudaGraph_t g2;
    cudaGraphExec_t ge2;
    CHECK(cudaStreamEndCapture(s, &g2) == cudaSuccess && cudaGraphInstantiate(&ge2, g2, 0) == 0);
    cudaGraphLaunch(ge2, s);
    expect_lost("graph replay");
    cudaGraphExecDestroy(ge2), cudaGraphDestroy(g2);
    free(host);

    cudaGraphExecDestroy(ge), cudaGraphDestroy(g);
    cublasDestroy(h);
    cudaStreamDestroy(s);
    cudaFreeHost(pin);
    cudaFree(x), cudaFree(y);
}

/* y[i] = the sum of the float4 at x + 4 i + off, read by __ldg. */
__global__ void ldg4(float *y, const float *x, int off)
{
    const float4 v = __ldg((const float4 *)(x + 4 * threadIdx.x + off));
    y[threadIdx.x] = v.x + v.y + v.z + v.w;
}

static void test_ldg(void)
{
    float xh[36], yh[8];
    for (int i = 0; i < 36; i++)
        xh[i] = (float)(rand() % 1000);
    float *x = (float *)dev_alloc(sizeof xh), *y = (float *)dev_alloc(sizeof yh);
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);
    FITM_LAUNCH(dim3(1), dim3(8), 0, NULL, ldg4)(y, x, 4);
    CHECK(cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost) == cudaSuccess, "ldg4 run");
    int bad = 0;
    for (int i = 0; i < 8; i++)
        bad += yh[i] != xh[4 * i + 4] + xh[4 * i + 5] + xh[4 * i + 6] + xh[4 * i + 7];
    CHECK(bad == 0, "ldg4: %d of 8 sums wrong", bad);
    /* one float past a 16-byte boundary */
    FITM_LAUNCH(dim3(1), dim3(8), 0, NULL, ldg4)(y, x, 1);
    expect_lost_with(cudaErrorMisalignedAddress, "float4 __ldg at 4 bytes");
    cudaFree(x), cudaFree(y);
}

/* Eight threads; thread i copies x[4 i ..] (16 bytes) to its shared slot a and x[32 + 4 i ..]
 * (8 bytes and 8 of zero fill) to its slot b, as two groups, and records in y[16 i ..]: slot
 * a before any wait (4 values), a and b after waiting for all but the newest group (8), b
 * after waiting for all (4). mode plants one fault: 1 a source one float off alignment, 2
 * a destination in global memory (y), 3 a source in host memory (host), 4 a copy of 12
 * bytes, 5 the thread ends before its last wait. */
__global__ void async_copies(float *y, const float *x, uintptr_t host, int mode)
{
    FITM_DYNAMIC_SHARED(__align__(16) float, s);
    const unsigned i = threadIdx.x;
    float *a = s + 4 * i, *b = s + 32 + 4 * i, *out = y + 16 * i;
    for (int j = 0; j < 4; j++)
        a[j] = b[j] = -1.0f;
    const float *src = mode == 1 ? x + 4 * i + 1 : mode == 3 ? (const float *)host : x + 4 * i;
    __pipeline_memcpy_async(mode == 2 ? out : a, src, mode == 4 ? 12 : 16);
    __pipeline_commit();
    __pipeline_memcpy_async(b, x + 32 + 4 * i, 16, 8);
    __pipeline_commit();
    for (int j = 0; j < 4; j++)
        out[j] = a[j];
    __pipeline_wait_prior(1);
    for (int j = 0; j < 4; j++)
        out[4 + j] = a[j], out[8 + j] = b[j];
    if (mode == 5)
        return;
    __pipeline_wait_prior(0);
    for (int j = 0; j < 4; j++)
        out[12 + j] = b[j];
}

static void test_async_copies(void)
{
    float xh[64], yh[128];
    for (int i = 0; i < 64; i++)
        xh[i] = (float)(1 + rand() % 1000);
    float *x = (float *)dev_alloc(sizeof xh), *y = (float *)dev_alloc(sizeof yh);
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);
    FITM_LAUNCH(dim3(1), dim3(8), 64 * sizeof(float), NULL, async_copies)(y, x, 0, 0);
    CHECK(cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost) == cudaSuccess, "async run");
    int bad = 0;
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) {
            const float *o = yh + 16 * i;
            bad += o[j] != -1.0f;                          /* not landed before the wait */
            bad += o[4 + j] != xh[4 * i + j];              /* the older group landed */
            bad += o[8 + j] != -1.0f;                      /* the newest still in flight */
            bad += o[12 + j] != (j < 2 ? xh[32 + 4 * i + j] : 0.0f); /* 8 bytes, 8 of zeros */
        }
    CHECK(bad == 0, "async copies: %d of 128 values wrong", bad);
    float host[8] = {0};
    const struct {
        int mode;
        cudaError_t e;
        const char *what;
    } faults[] = {{1, cudaErrorMisalignedAddress, "async copy from a misaligned source"},
                  {2, cudaErrorIllegalAddress, "async copy into global memory"},
                  {3, cudaErrorIllegalAddress, "async copy from host memory"},
                  {4, cudaErrorLaunchFailure, "async copy of 12 bytes"},
                  {5, cudaErrorLaunchFailure, "thread ending with a copy in flight"}};
    for (size_t f = 0; f < sizeof faults / sizeof faults[0]; f++) {
        FITM_LAUNCH(dim3(1), dim3(8), 64 * sizeof(float), NULL, async_copies)
        (y, x, (uintptr_t)host, faults[f].mode);
        expect_lost_with(faults[f].e, faults[f].what);
    }
    cudaFree(x), cudaFree(y);
}

/* y[i] = 2 x[i] + i, as twice, from a kernel that begins as the project's kernels do. */
__global__ void twice_begun(float *y, const float *x, int n)
{
    fitm_grid_begin();
    const int stride = (int)(gridDim.x * blockDim.x);
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += stride)
        y[i] = 2.0f * x[i] + (float)i;
}

/* twice_begun, beginning with fitm_grid_begin_prefetch of w's n bytes (and of v's m, when
 * v is not NULL): from a block's threads, before the wait, as the decode products do. */
__global__ void twice_prefetched(float *y, const float *x, int n, const void *w, long long wn,
                                 const void *v, long long vn)
{
    fitm_grid_begin_prefetch(fitm_span{w, wn}, fitm_span{v, v ? vn : 0});
    const int stride = (int)(gridDim.x * blockDim.x);
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += stride)
        y[i] = 2.0f * x[i] + (float)i;
}

/* A barrier before fitm_grid_begin. */
__global__ void barrier_first(float *y)
{
    __syncthreads();
    fitm_grid_begin();
    y[threadIdx.x] = 1.0f;
}

/* Threads but the first return before fitm_grid_begin. */
__global__ void begun_by_one(float *y)
{
    if (threadIdx.x != 0)
        return;
    fitm_grid_begin();
    y[0] = 1.0f;
}

static void test_programmatic(void)
{
    const int n = 300;
    float xh[n], yh[n];
    for (int i = 0; i < n; i++)
        xh[i] = (float)(rand() % 1000);
    float *x = (float *)dev_alloc(sizeof xh), *y = (float *)dev_alloc(sizeof yh);
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);
    /* the runs check that y holds twice's values, then clear it */
    auto twice_ok = [&](const char *what) {
        CHECK(cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost) == cudaSuccess, "%s", what);
        int bad = 0;
        for (int i = 0; i < n; i++)
            bad += yh[i] != 2.0f * xh[i] + (float)i;
        CHECK(bad == 0, "%s: %d of %d values wrong", what, bad, n);
        cudaMemset(y, 0, sizeof yh);
    };

    CHECK(fitm_cuda_pdl_probe() == 1, "the probe passes on the emulated sm_90");
    /* a launch the device refuses turns programmatic launches down; a fault says the device
     * is lost */
    fitm_emu_inject_error("launch", cudaErrorInvalidValue);
    CHECK(fitm_cuda_pdl_probe() == 0, "a refused launch: plain launches");
    fitm_emu_inject_error("launch", cudaErrorLaunchFailure);
    CHECK(fitm_cuda_pdl_probe() == -(int)cudaErrorLaunchFailure, "a failed launch: a lost device");
    CHECK(cudaGetLastError() == cudaSuccess && fitm_cuda_pdl_probe() == 1, "and the probe again");
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess);
    CHECK(!fitm_cuda_pdl(s), "launches are plain by default");
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice)(y, x, n);
    twice_ok("plain launch without fitm_grid_begin");
    CHECK(!fitm_cuda_set_pdl(NULL, true), "the legacy default stream stays plain");
    CHECK(fitm_cuda_set_pdl(s, true) && fitm_cuda_pdl(s), "programmatic launches on s");
    fitm_emu_stats a, z;
    fitm_emu_get_stats(&a);
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice_begun)(y, x, n);
    twice_ok("programmatic launch that begins with fitm_grid_begin");
    FITM_LAUNCH(dim3(2), dim3(128), 0, NULL, twice)(y, x, n);
    twice_ok("another stream's launch: plain");
    fitm_emu_get_stats(&z);
    CHECK(z.programmatic - a.programmatic == 1 && z.kernels_run - a.kernels_run == 2,
          "one counted as programmatic: %llu", z.programmatic - a.programmatic);

    /* a prefetch of device memory (unaligned, part of an allocation, two spans) before the
     * wait runs and computes; of host memory, or past an allocation's end, it faults */
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice_prefetched)(y, x, n, x + 3, 1000LL, x, 8LL);
    twice_ok("programmatic launch that prefetches device memory first");
    FITM_LAUNCH(dim3(2), dim3(128), 0, NULL, twice_prefetched)(y, x, n, x, 1200LL, nullptr, 0LL);
    twice_ok("plain launch that prefetches device memory first");
    static float host_w[256];
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice_prefetched)(y, x, n, host_w, 256LL, nullptr, 0LL);
    expect_lost_with(cudaErrorIllegalAddress, "a prefetch of host memory");
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice_prefetched)(y, x, n, x, 1200LL, x + 200, 404LL);
    expect_lost_with(cudaErrorIllegalAddress, "a prefetch past an allocation's end");

    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice)(y, x, n);
    expect_lost_with(cudaErrorLaunchFailure, "programmatic launch without fitm_grid_begin");
    FITM_LAUNCH(dim3(1), dim3(64), 0, s, barrier_first)(y);
    expect_lost_with(cudaErrorLaunchFailure, "a barrier before fitm_grid_begin");
    FITM_LAUNCH(dim3(3), dim3(64), 0, s, begun_by_one)(y);
    expect_lost_with(cudaErrorLaunchFailure, "threads that return before fitm_grid_begin");

    /* captured programmatic launches replay as such */
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    FITM_LAUNCH(dim3(2), dim3(128), 0, s, twice_begun)(y, x, n);
    CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess &&
          cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
    fitm_emu_get_stats(&a);
    CHECK(cudaGraphLaunch(ge, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
    fitm_emu_get_stats(&z);
    CHECK(z.programmatic - a.programmatic == 1, "replayed as programmatic");
    twice_ok("replay of a programmatic launch");
    cudaGraphExecDestroy(ge), cudaGraphDestroy(g);

    CHECK(!fitm_cuda_set_pdl(s, false) && !fitm_cuda_pdl(s), "plain again");
    FITM_LAUNCH(dim3(1), dim3(64), 0, s, barrier_first)(y);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "the same kernel as a plain launch runs");
    cudaStreamDestroy(s);
    cudaFree(x), cudaFree(y);
}

/* FITM_CUDA_EMU_HOST_ONLY: launches and cuBLAS calls are checked and counted but compute
 * nothing (a measurement of the host side), and a planted host pointer still loses the
 * context; without it the same calls compute. */
static void test_host_only(void)
{
    const int n = 256;
    float *x = (float *)dev_alloc(n * sizeof(float)), *y = (float *)dev_alloc(n * sizeof(float));
    float xh[256], yh[256];
    for (int i = 0; i < n; i++)
        xh[i] = (float)i;
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);
    cudaMemset(y, 0, sizeof yh);
    cublasHandle_t h;
    cublasCreate(&h);
    const float one = 1.0f, zero = 0.0f;
    for (int host_only = 1; host_only >= 0; host_only--) {
        if (host_only)
            setenv("FITM_CUDA_EMU_HOST_ONLY", "1", 1);
        else
            unsetenv("FITM_CUDA_EMU_HOST_ONLY");
        fitm_emu_stats before, after;
        fitm_emu_get_stats(&before);
        FITM_LAUNCH(dim3(1), dim3(256), 0, NULL, twice)(y, x, n);
        CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, x, 4, x, 4, &zero, y + 128,
                          4) == CUBLAS_STATUS_SUCCESS);
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        fitm_emu_get_stats(&after);
        CHECK(after.kernels_run == before.kernels_run + 1 && after.blas_calls == before.blas_calls + 1,
              "host only %d: counted", host_only);
        cudaMemcpy(yh, y, sizeof yh, cudaMemcpyDeviceToHost);
        /* y[1] = 2 x[1] + 1 = 3; y[128] = sum_k x[4k] x[k] = 0 + 4 + 16 + 36 = 56 */
        CHECK(host_only ? yh[1] == 0.0f && yh[128] == 0.0f : yh[1] == 3.0f && yh[128] == 56.0f,
              "host only %d: y[1] %g, y[128] %g", host_only, yh[1], yh[128]);
    }
    setenv("FITM_CUDA_EMU_HOST_ONLY", "1", 1);
    float *host = (float *)calloc(n, sizeof(float));
    FITM_LAUNCH(dim3(1), dim3(256), 0, NULL, twice)(y, host, n);
    expect_lost("a host pointer in host-only mode");
    unsetenv("FITM_CUDA_EMU_HOST_ONLY");
    free(host);
    cublasDestroy(h);
    cudaFree(x), cudaFree(y);
}

int main(void)
{
    srand(38);
    test_limits();
    test_host_pointers();
    test_wmma();
    test_ldg();
    test_async_copies();
    test_graphs();
    test_programmatic();
    test_host_only();
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures ? 1 : 0;
}
