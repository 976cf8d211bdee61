/* cuda_emu: the part of the CUDA runtime API that fitm uses, implemented on the CPU
 * (tests/cuda_emu/emu_runtime.cpp) so the kernels and the CUDA backend run without a GPU.
 *
 * "Device" memory is host memory (256-byte aligned), copies are memcpy, and every launch runs
 * to completion on the calling thread before the launcher returns, so streams and events are
 * bookkeeping only. Error codes carry the real runtime's numbers, so code that compares them
 * or prints their names behaves as against libcudart. C and C++ both include this header. */
#ifndef FITM_CUDA_EMU_RUNTIME_API_H
#define FITM_CUDA_EMU_RUNTIME_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FITM_CUDA_EMU 1

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorECCUncorrectable = 214,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchTimeout = 702,
    cudaErrorContextIsDestroyed = 709,
    cudaErrorAssert = 710,
    cudaErrorHardwareStackError = 714,
    cudaErrorIllegalInstruction = 715,
    cudaErrorMisalignedAddress = 716,
    cudaErrorInvalidAddressSpace = 717,
    cudaErrorInvalidPc = 718,
    cudaErrorLaunchFailure = 719,
    cudaErrorUnknown = 999
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
} cudaMemcpyKind;

typedef struct fitm_emu_stream *cudaStream_t;
typedef struct fitm_emu_event *cudaEvent_t;

#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
    int memoryClockRate; /* kHz */
    int memoryBusWidth;  /* bits */
    int clockRate;       /* kHz */
};

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemset(void *dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---- emulator controls (not CUDA) ---- */

/* Devices the emulated runtime reports: 1, or the value of FITM_CUDA_EMU_DEVICES when set
 * (0 emulates a machine without a GPU). */
int fitm_emu_device_count(void);

/* Makes the next call of the named kind fail once with e (for error-path tests): kind is
 * "malloc" or "launch". */
void fitm_emu_inject_error(const char *kind, cudaError_t e);

/* Environment: FITM_CUDA_EMU_DEVICES (above); FITM_CUDA_EMU_FAIL_LAUNCH_IF=PATH: while PATH
 * exists, the next launch fails with cudaErrorLaunchFailure and removes PATH (one failure per
 * file created, for tests that drive a whole process). */

#ifdef __cplusplus
}
#endif

#endif
