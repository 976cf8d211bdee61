/* cuda_emu: the part of cuBLAS that fitm uses (<cublas_v2.h>), on the CPU
 * (tests/cuda_emu/emu_cublas.cpp), with the real library's names and numbers.
 *
 * Matrices are column-major as in cuBLAS: C (m, n) = alpha op(A) (m, k) op(B) (k, n) + beta C,
 * op(X) = X or X^T, leading dimensions as in BLAS. Inputs are 32F or 16BF (A and B of one
 * type), the output and the scalars 32F, computed in 32F (CUBLAS_COMPUTE_32F, which lets a
 * device use its tensor cores for 16BF, or CUBLAS_COMPUTE_32F_PEDANTIC): every element is one
 * float sum over k in increasing order (fused multiply-adds; a product of two 16BF values is
 * exact in float), so an element's value depends on its own row of op(A) and column of op(B)
 * alone, never on m or n. Combinations outside this subset (A and B of different types, a C
 * that is not 32F, another compute type) are refused with CUBLAS_STATUS_NOT_SUPPORTED, the
 * status cuBLAS gives a combination it does not implement (it does not implement mixed A and
 * B types); argument values out of range (a leading dimension below the minimum) with
 * CUBLAS_STATUS_INVALID_VALUE. beta 0 does not read C (NaN stays out). A
 * launch failure injected into the emulated runtime (fitm_emu_inject_error "launch", or
 * FITM_CUDA_EMU_FAIL_LAUNCH_IF) fails the call with CUBLAS_STATUS_EXECUTION_FAILED and sets
 * the runtime's error, as a kernel failing inside a real cuBLAS call would. An operand (A, B
 * or C) that is not device memory (cuda_runtime_api.h), or runs past the end of its allocation
 * (its last element, by m, n, k and the leading dimension), loses the context with
 * cudaErrorIllegalAddress. On a stream being captured into a graph, the product is recorded
 * and runs at each replay. */
#ifndef FITM_CUDA_EMU_CUBLAS_V2_H
#define FITM_CUDA_EMU_CUBLAS_V2_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_PEDANTIC = 69 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_PEDANTIC_MATH = 2 } cublasMath_t;

typedef struct fitm_emu_cublas *cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t *handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
const char *cublasGetStatusName(cublasStatus_t status);

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc);

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);

#ifdef __cplusplus
}
#endif

#endif
