/* cuda_emu: the cuBLAS calls fitm uses, on the CPU (contract in cublas_v2.h). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "cublas_v2.h"
#include "cuda_runtime.h"

struct fitm_emu_cublas {
    cudaStream_t stream;
    cublasMath_t math;
};

namespace
{

/* Element (r, c) of op(X), X column-major with leading dimension ld, stored as type t. */
float elem(const void *X, cudaDataType t, int ld, bool trans, int r, int c)
{
    const int64_t i = trans ? (int64_t)c + (int64_t)r * ld : (int64_t)r + (int64_t)c * ld;
    if (t == CUDA_R_16BF) {
        __nv_bfloat16 b;
        memcpy(&b.bits, (const uint16_t *)X + i, 2);
        return __bfloat162float(b);
    }
    return ((const float *)X)[i];
}

/* sum_i a[i * sa] * b[i * sb] for i = 0..k-1 in order, one fused multiply-add per term, as
 * the GPU's FMA chain: the same values with or without the instruction (fmaf is exact), the
 * instruction only saving a libm call per term. */
__attribute__((target("fma"))) float dot_fma(const float *a, int64_t sa, const float *b, int64_t sb,
                                             int k)
{
    float acc = 0.0f;
    for (int i = 0; i < k; i++)
        acc = __builtin_fmaf(a[i * sa], b[i * sb], acc);
    return acc;
}

/* Rows r..r+7 of op(A) (a: row r's first element) times a column b: 8 dot_fma chains side by
 * side, each still summed over i in order, so the same values as 8 dot_fma calls. */
template <bool TA>
__attribute__((target("fma"))) void dot8_fma(const float *a, int64_t lda, const float *b,
                                             int64_t sb, int k, float out[8])
{
    float acc[8] = {0};
    for (int i = 0; i < k; i++) {
        const float bv = b[i * sb];
        for (int j = 0; j < 8; j++)
            acc[j] = __builtin_fmaf(TA ? a[j * lda + i] : a[i * lda + j], bv, acc[j]);
    }
    memcpy(out, acc, sizeof acc);
}

/* X (rows, cols) column-major with leading dimension ld, stored as 16BF, widened to F32 in the
 * same layout (exact: every bfloat16 is a float). */
std::vector<float> widen(const void *X, int rows, int cols, int ld)
{
    const size_t n = cols > 0 ? (size_t)(cols - 1) * ld + rows : 0;
    std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) {
        __nv_bfloat16 b;
        memcpy(&b.bits, (const uint16_t *)X + i, 2);
        f[i] = __bfloat162float(b);
    }
    return f;
}

/* The product itself (the call's checks done). */
void run_gemm(bool tA, bool tB, int m, int n, int k, float a, const void *A, cudaDataType at,
              int lda, const void *B, cudaDataType bt, int ldb, float b, float *C, int ldc)
{
    auto put = [&](int r, int c, float acc) {
        float *dst = C + (int64_t)r + (int64_t)c * ldc;
        *dst = b == 0.0f ? a * acc : fmaf(b, *dst, a * acc);
    };
    /* F32 operands on a CPU with the FMA instruction: op(A)[r, i] and op(B)[i, c] as strided
     * vectors, 8 rows at a time; otherwise element by element through libm's fmaf */
    static const bool hw_fma = __builtin_cpu_supports("fma");
    if (hw_fma && at == CUDA_R_16BF && bt == CUDA_R_16BF) {
        /* the same products and the same chains on the widened operands */
        const std::vector<float> Af = widen(A, tA ? k : m, tA ? m : k, lda),
                                 Bf = widen(B, tB ? n : k, tB ? k : n, ldb);
        run_gemm(tA, tB, m, n, k, a, Af.data(), CUDA_R_32F, lda, Bf.data(), CUDA_R_32F, ldb, b, C,
                 ldc);
        return;
    }
    const bool fast = hw_fma && at == CUDA_R_32F && bt == CUDA_R_32F;
    const int64_t sa = tA ? 1 : lda, sb = tB ? ldb : 1;
    for (int c = 0; c < n; c++) {
        const float *pb = fast ? (const float *)B + (tB ? c : (int64_t)c * ldb) : nullptr;
        int r = 0;
        for (; fast && r + 8 <= m; r += 8) {
            float acc8[8];
            const float *pa = (const float *)A + (tA ? (int64_t)r * lda : r);
            if (tA)
                dot8_fma<true>(pa, lda, pb, sb, k, acc8);
            else
                dot8_fma<false>(pa, lda, pb, sb, k, acc8);
            for (int j = 0; j < 8; j++)
                put(r + j, c, acc8[j]);
        }
        for (; r < m; r++) {
            float acc = 0.0f;
            if (fast) {
                acc = dot_fma((const float *)A + (tA ? (int64_t)r * lda : r), sa, pb, sb, k);
            } else {
                for (int i = 0; i < k; i++)
                    acc = fmaf(elem(A, at, lda, tA, r, i), elem(B, bt, ldb, tB, i, c), acc);
            }
            put(r, c, acc);
        }
    }
}

cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                    int k, const float *alpha, const void *A, cudaDataType at, int lda,
                    const void *B, cudaDataType bt, int ldb, const float *beta, float *C, int ldc)
{
    const bool tA = ta == CUBLAS_OP_T, tB = tb == CUBLAS_OP_T;
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((ta != CUBLAS_OP_N && !tA) || (tb != CUBLAS_OP_N && !tB) || m < 0 || n < 0 || k < 0 ||
        lda < (tA ? (k > 1 ? k : 1) : (m > 1 ? m : 1)) ||
        ldb < (tB ? (n > 1 ? n : 1) : (k > 1 ? k : 1)) || ldc < (m > 1 ? m : 1) || !alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0)
        return CUBLAS_STATUS_SUCCESS;
    const float a = *alpha, b = *beta;
    /* every element an operand spans (from its first to its last, with the leading
     * dimension's gaps) must be device memory of one allocation, as the GEMM kernel reads or
     * writes them all */
    const size_t ea = at == CUDA_R_16BF ? 2 : 4, eb = bt == CUDA_R_16BF ? 2 : 4;
    auto span = [](int rows, int cols, int ld, size_t e) {
        return ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * e;
    };
    auto dev = [](const void *p, size_t bytes) { return p && fitm_emu_device_range(p, bytes); };
    const bool a_ok = k == 0 || dev(A, span(tA ? k : m, tA ? m : k, lda, ea)),
               b_ok = k == 0 || dev(B, span(tB ? n : k, tB ? k : n, ldb, eb)),
               c_ok = dev(C, span(m, n, ldc, 4));
    if (!a_ok || !b_ok || !c_ok) {
        const void *bad = !c_ok ? (const void *)C : !a_ok ? A : B;
        return fitm_emu_enqueue(
                   h->stream,
                   [bad]() {
                       fprintf(stderr,
                               "cuda_emu: illegal address: a cuBLAS operand (%p) is not device "
                               "memory (or runs past its allocation); the context is lost\n",
                               bad);
                       return fitm_emu_lose_context(cudaErrorIllegalAddress);
                   }) == cudaSuccess
                   ? CUBLAS_STATUS_SUCCESS
                   : CUBLAS_STATUS_EXECUTION_FAILED;
    }
    const cudaError_t e = fitm_emu_enqueue(h->stream, [=]() {
        const cudaError_t f = fitm_emu_take_launch_failure();
        if (f == cudaSuccess && !fitm_emu_host_only())
            run_gemm(tA, tB, m, n, k, a, A, at, lda, B, bt, ldb, b, C, ldc);
        return f;
    });
    if (e != cudaSuccess) {
        fitm_emu_set_error(e);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *handle)
{
    if (fitm_emu_device_count() < 1)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    *handle = new fitm_emu_cublas{nullptr, CUBLAS_DEFAULT_MATH};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle)
{
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream)
{
    if (!handle)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode)
{
    if (!handle)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t status)
{
    switch (status) {
    case CUBLAS_STATUS_SUCCESS:
        return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc)
{
    return gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb,
                beta, C, ldc);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo)
{
    (void)algo; /* one algorithm here: the fixed-order sum */
    if (Atype != Btype || (Atype != CUDA_R_32F && Atype != CUDA_R_16BF) || Ctype != CUDA_R_32F ||
        (computeType != CUBLAS_COMPUTE_32F && computeType != CUBLAS_COMPUTE_32F_PEDANTIC))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return gemm(handle, transa, transb, m, n, k, (const float *)alpha, A, Atype, lda, B, Btype, ldb,
                (const float *)beta, (float *)C, ldc);
}

} // extern "C"
