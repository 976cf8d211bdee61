/* test_cuda_blas: the cuBLAS calls the CUDA backend makes (cublasGemmEx, cublasSgemm), against
 * a naive double-precision product on fresh random inputs: odd shapes, all four transpose
 * combinations, leading dimensions above the minimum, alpha and beta, 32F and 16BF inputs.
 * Built twice: against tests/cuda_emu (cuda_blas_emu: checks the emulator's CPU stand-in, which
 * the emulated backend tests rely on) and, in the CUDA build, against the real cuBLAS on a
 * device (cuda_blas; exits 77 without one).
 *
 * Tolerance: any order of summing k float products with float (or fused) operations is within
 * gamma_k = k u / (1 - k u) of the exact sum, relative to sum |a_i b_i| (u = 2^-24); alpha,
 * beta and the final add add a few u more. The bound is (k + 4) u (|alpha| sum |a_i b_i| +
 * |beta c|) plus 1e-30, which a wrong transpose, leading dimension or element type exceeds by
 * orders of magnitude (it reads other elements). 16BF inputs are rounded on the host and the
 * reference uses the rounded values, so the bound is the same. A and B of different types are
 * refused (CUBLAS_STATUS_NOT_SUPPORTED), as a leading dimension below the minimum is
 * (CUBLAS_STATUS_INVALID_VALUE). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "check.h"

static uint64_t rng_state;

static double uniform(void) /* [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) * 0x1p-52 - 1.0;
}

static uint16_t to_bf16(float f) /* round to nearest even; inputs here are finite */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
}

static float from_bf16(uint16_t b)
{
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void *dev_copy(const void *host, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess ||
        cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        fprintf(stderr, "device memory: %s\n", cudaGetErrorString(cudaGetLastError()));
        exit(1);
    }
    return d;
}

/* One product C (m, n) = alpha op(A) op(B) + beta C, column-major, checked element by element. */
static void check_gemm(cublasHandle_t h, int m, int n, int k, bool ta, bool tb, int pad, bool bf16,
                       bool use_sgemm, float alpha, float beta)
{
    const int ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    const int lda = ar + pad, ldb = br + pad, ldc = m + pad;
    const size_t na = (size_t)lda * ac, nb = (size_t)ldb * bc, nc = (size_t)ldc * n;
    float *A = malloc(na * 4), *B = malloc(nb * 4), *C = malloc(nc * 4), *got = malloc(nc * 4);
    uint16_t *A16 = malloc(na * 2), *B16 = malloc(nb * 2);
    for (size_t i = 0; i < na; i++) {
        A16[i] = to_bf16((float)uniform());
        A[i] = bf16 ? from_bf16(A16[i]) : (float)uniform();
    }
    for (size_t i = 0; i < nb; i++) {
        B16[i] = to_bf16((float)uniform());
        B[i] = bf16 ? from_bf16(B16[i]) : (float)uniform();
    }
    for (size_t i = 0; i < nc; i++) /* beta 0 must not read C: NaN would show */
        C[i] = beta == 0.0f ? NAN : (float)uniform();
    void *dA = bf16 ? dev_copy(A16, na * 2) : dev_copy(A, na * 4);
    void *dB = bf16 ? dev_copy(B16, nb * 2) : dev_copy(B, nb * 4);
    float *dC = dev_copy(C, nc * 4);
    const cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                            ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t st;
    if (use_sgemm)
        st = cublasSgemm(h, oa, ob, m, n, k, &alpha, dA, lda, dB, ldb, &beta, dC, ldc);
    else
        st = cublasGemmEx(h, oa, ob, m, n, k, &alpha, dA, bf16 ? CUDA_R_16BF : CUDA_R_32F, lda, dB,
                          bf16 ? CUDA_R_16BF : CUDA_R_32F, ldb, &beta, dC, CUDA_R_32F, ldc,
                          (m + n) % 2 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT);
    CHECK(st == CUBLAS_STATUS_SUCCESS, "gemm: %s", cublasGetStatusName(st));
    CHECK(cudaMemcpy(got, dC, nc * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    double worst = 0;
    for (int c = 0; c < n; c++)
        for (int r = 0; r < ldc; r++) {
            const size_t i = (size_t)r + (size_t)c * ldc;
            if (r >= m) { /* padding rows of C: untouched */
                CHECK(memcmp(&got[i], &C[i], 4) == 0, "C[%d,%d] outside the product written", r, c);
                continue;
            }
            double s = 0, mag = 0;
            for (int p = 0; p < k; p++) {
                const double a = ta ? A[p + (size_t)r * lda] : A[r + (size_t)p * lda];
                const double b = tb ? B[c + (size_t)p * ldb] : B[p + (size_t)c * ldb];
                s += a * b;
                mag += fabs(a * b);
            }
            const double cold = beta == 0.0f ? 0.0 : C[i];
            const double want = alpha * s + beta * cold;
            const double tol = (k + 4) * 0x1p-24 * (fabs(alpha) * mag + fabs(beta * cold)) + 1e-30;
            const double e = fabs(got[i] - want);
            worst = fmax(worst, isfinite(e) ? e / tol : INFINITY);
        }
    CHECK(worst <= 1.0,
          "m %d n %d k %d op %c%c ld +%d %s%s alpha %g beta %g: error %.3g of the bound", m, n, k,
          ta ? 'T' : 'N', tb ? 'T' : 'N', pad, bf16 ? "16BF" : "32F", use_sgemm ? " (Sgemm)" : "",
          alpha, beta, worst);
    cudaFree(dA), cudaFree(dB), cudaFree(dC);
    free(A), free(B), free(C), free(got), free(A16), free(B16);
}

int main(void)
{
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    cublasHandle_t h = NULL;
    cublasStatus_t st = cublasCreate(&h);
    if (st != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate: %s\n", cublasGetStatusName(st));
        return 1;
    }
    rng_state = (uint64_t)time(NULL);
    printf("seed %llu\n", (unsigned long long)rng_state);
    static const int shapes[][3] = {{1, 1, 1},    {7, 5, 3},   {33, 17, 65}, {64, 1, 31},
                                    {5, 64, 128}, {127, 3, 9}, {2, 9, 257}};
    int n = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++, n++) {
            const int *sh = shapes[s];
            const float alpha = n % 3 ? 1.0f : -0.75f, beta = n % 4 == 1 ? 0.5f : 0.0f;
            check_gemm(h, sh[0], sh[1], sh[2], t & 1, t >> 1, n % 3, n % 2, false, alpha, beta);
            check_gemm(h, sh[0], sh[1], sh[2], t & 1, t >> 1, (n + 1) % 3, false, true, alpha,
                       beta);
        }
    for (int i = 0; i < 6; i++) { /* fresh shapes each run */
        const int m = 1 + (int)((uniform() + 1) * 40), nn = 1 + (int)((uniform() + 1) * 40),
                  k = 1 + (int)((uniform() + 1) * 150);
        check_gemm(h, m, nn, k, i & 1, i >> 1 & 1, i % 3, i % 2, false, 1.0f, 0.0f);
    }
    /* a leading dimension below the minimum is refused, nothing written */
    float one = 1.0f, zero = 0.0f;
    float *d = dev_copy((float[64]){0}, 256);
    st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 2, 3, &one, d, CUDA_R_32F, 3, d, CUDA_R_32F,
                      3, &zero, d, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CHECK(st == CUBLAS_STATUS_INVALID_VALUE, "lda 3 < m 4 accepted: %s", cublasGetStatusName(st));
    /* A and B of different types: a combination cuBLAS does not implement */
    st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 2, 3, &one, d, CUDA_R_16BF, 4, d, CUDA_R_32F,
                      3, &zero, d, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CHECK(st == CUBLAS_STATUS_NOT_SUPPORTED, "16BF times 32F accepted: %s",
          cublasGetStatusName(st));
    cudaFree(d);
    cublasDestroy(h);
    printf("%d checks, %d failed\n", n_checks, failures);
    return failures ? 1 : 0;
}
