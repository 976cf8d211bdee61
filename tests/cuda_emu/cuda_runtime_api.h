/* cuda_emu: the part of the CUDA runtime API that fitm uses, implemented on the CPU
 * (tests/cuda_emu/emu_runtime.cpp) so the kernels and the CUDA backend run without a GPU.
 *
 * "Device" memory is host memory (256-byte aligned), copies are memcpy, and every launch runs
 * to completion on the calling thread before the launcher returns, so streams and events are
 * bookkeeping only. Error codes carry the real runtime's numbers, so code that compares them
 * or prints their names behaves as against libcudart. C and C++ both include this header.
 *
 * It fails where a device fails. Device allocations (cudaMalloc) are registered apart from
 * host memory: every pointer argument of a launch, every cuBLAS operand and the device side of
 * every copy or memset must lie in one, or in pinned host memory (cudaMallocHost, which a
 * device maps), else the call fails with cudaErrorIllegalAddress, and that error is sticky as
 * on a device whose context is lost: every later call returns it and nothing runs any more. A
 * launch beyond a device's limits fails with cudaErrorInvalidConfiguration (not sticky): more
 * than 1024 threads a block, a grid's y or z over 65535, more than 48 KiB of dynamic shared
 * memory without the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize opt-in (set with
 * cudaFuncSetAttribute), or more than the device's per-block maximum even with it. */
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
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureWrongThread = 908,
    cudaErrorGraphExecUpdateFailure = 910,
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
typedef struct fitm_emu_graph *cudaGraph_t;
typedef struct fitm_emu_graph_exec *cudaGraphExec_t;
typedef struct fitm_emu_graph_node *cudaGraphNode_t;

typedef enum cudaGraphExecUpdateResult {
    cudaGraphExecUpdateSuccess = 0,
    cudaGraphExecUpdateError = 1,
    cudaGraphExecUpdateErrorTopologyChanged = 2
} cudaGraphExecUpdateResult;

typedef struct cudaGraphExecUpdateResultInfo {
    cudaGraphExecUpdateResult result;
    cudaGraphNode_t errorNode, errorFromNode;
} cudaGraphExecUpdateResultInfo;

typedef enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8
} cudaFuncAttribute;

/* The device attributes the kernels' launchers read (cudaDeviceGetAttribute), with the
 * runtime's numbers. */
typedef enum cudaDeviceAttr {
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
} cudaDeviceAttr;

typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;

typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;

#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
    int memoryClockRate;           /* kHz */
    int memoryBusWidth;            /* bits */
    int clockRate;                 /* kHz */
    size_t sharedMemPerBlock;      /* without an opt-in */
    size_t sharedMemPerBlockOptin; /* the most one block may have */
    int maxThreadsPerBlock;
    int maxGridSize[3];
};

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev);
/* One value of cudaGetDeviceProperties's (the SM count, the opt-in shared memory a block). */
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev);
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

/* Graphs: between cudaStreamBeginCapture and cudaStreamEndCapture, the launches, cuBLAS calls,
 * copies and memsets enqueued on the stream are recorded, not run (their arguments copied as a
 * launch copies them); cudaGraphLaunch replays them in order. A call that waits for the device
 * (a synchronization, a synchronous copy), allocates or frees during a capture, and a copy
 * between the captured stream and pageable host memory, fail with
 * cudaErrorStreamCaptureUnsupported and invalidate the capture, as on a device (a wait,
 * allocation or free only from the capturing thread in the thread-local mode, from any thread
 * in the global mode). */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
/* The number of nodes of graph (nodes must be NULL: the nodes themselves are not emulated). */
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *n);
/* Gives exec the arguments of graph when both hold the same operations in the same order (the
 * same kernels); else cudaErrorGraphExecUpdateFailure, info->result
 * cudaGraphExecUpdateErrorTopologyChanged, exec unchanged. */
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* ---- emulator controls (not CUDA) ---- */

/* Devices the emulated runtime reports: 1, or the value of FITM_CUDA_EMU_DEVICES when set
 * (0 emulates a machine without a GPU). */
int fitm_emu_device_count(void);

/* Makes the next call of the named kind fail once with e (for error-path tests): kind is
 * "malloc" or "launch". */
void fitm_emu_inject_error(const char *kind, cudaError_t e);

/* Clears a sticky error (a lost context), for tests that plant one and go on; device memory
 * stays allocated. A device process would have to restart instead. */
void fitm_emu_reset_device(void);

/* What the emulated device has been asked to do since the process started, for benchmarks of
 * the overhead a real device pays per submission and per wait. Submissions by the host:
 * kernel launches, cuBLAS calls, copies and memsets (those recorded into a graph are not
 * submitted then), graph launches (one submission each, however many operations the graph
 * holds). kernels_run: kernels that ran, alone or in a graph's replay (programmatic: those
 * of them launched with cudaLaunchAttributeProgrammaticStreamSerialization). host_waits: stream,
 * event and device synchronizations and synchronous copies. mallocs, frees: device
 * allocations made and released (cudaMalloc, cudaFree). */
typedef struct {
    unsigned long long launches, blas_calls, copies, graph_launches, kernels_run, host_waits;
    unsigned long long programmatic; /* kernels run that were launched programmatically */
    unsigned long long mallocs, frees;
} fitm_emu_stats;
void fitm_emu_get_stats(fitm_emu_stats *s);

/* Environment: FITM_CUDA_EMU_DEVICES (above); FITM_CUDA_EMU_FAIL_LAUNCH_IF=PATH: while PATH
 * exists, the next launch fails with cudaErrorLaunchFailure and removes PATH (one failure per
 * file created, for tests that drive a whole process). */

#ifdef __cplusplus
}
#endif

#endif
