/* The real kernels/ops.cu compiled by the host compiler against cuda_emu. */
#include "ops.cu"
