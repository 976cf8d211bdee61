#include "base/dtype.h"

static const fitm_dtype_info infos[FITM_DTYPE_MAX] = {
    [FITM_DTYPE_F32] = {"F32", 1, 4},
    [FITM_DTYPE_F16] = {"F16", 1, 2},
    [FITM_DTYPE_Q4_0] = {"Q4_0", 32, 18},
    [FITM_DTYPE_Q5_0] = {"Q5_0", 32, 22},
    [FITM_DTYPE_Q8_0] = {"Q8_0", 32, 34},
    [FITM_DTYPE_Q4_K] = {"Q4_K", 256, 144},
    [FITM_DTYPE_Q5_K] = {"Q5_K", 256, 176},
    [FITM_DTYPE_Q6_K] = {"Q6_K", 256, 210},
    [FITM_DTYPE_Q8_K] = {"Q8_K", 256, 292},
    [FITM_DTYPE_BF16] = {"BF16", 1, 2},
};

const fitm_dtype_info *fitm_dtype_info_of(int type_id)
{
    if (type_id < 0 || type_id >= FITM_DTYPE_MAX || !infos[type_id].name)
        return NULL;
    return &infos[type_id];
}

size_t fitm_dtype_row_bytes(fitm_dtype t, int64_t n)
{
    const fitm_dtype_info *info = fitm_dtype_info_of((int)t);
    if (!info || n < 0 || n % info->block_elems != 0)
        return 0;
    uint64_t blocks = (uint64_t)(n / info->block_elems);
    if (blocks > SIZE_MAX / (uint64_t)info->block_bytes)
        return 0;
    return (size_t)(blocks * (uint64_t)info->block_bytes);
}
