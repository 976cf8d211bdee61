/* cuda_util: host helpers around launcher return codes and device discovery. */
#include <stdio.h>

#include <cuda_runtime.h>

#include "kernels.h"

extern "C" fitm_status fitm_cuda_status(int rc, fitm_err *err, const char *what)
{
    if (rc == (int)cudaSuccess)
        return FITM_OK;
    fitm_status s = FITM_ERR_BACKEND;
    if (rc == (int)cudaErrorMemoryAllocation)
        s = FITM_ERR_NOMEM;
    else if (rc == (int)cudaErrorInvalidValue)
        s = FITM_ERR_INVALID;
    /* snprintf rather than fitm_err_set: fitm_core links this library, not the reverse */
    if (err)
        snprintf(err->msg, sizeof err->msg, "%s%s%s", what ? what : "", what ? ": " : "",
                 fitm_cuda_error_string(rc));
    return s;
}

extern "C" const char *fitm_cuda_error_string(int rc)
{
    static thread_local char buf[256];
    const cudaError_t e = (cudaError_t)rc;
    snprintf(buf, sizeof buf, "%s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    return buf;
}

extern "C" bool fitm_cuda_error_is_sticky(int rc)
{
    switch ((cudaError_t)rc) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
        return true;
    default:
        return false;
    }
}

extern "C" int fitm_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear it so later calls do not see it */
        return 0;
    }
    return n;
}
