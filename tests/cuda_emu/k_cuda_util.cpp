/* The real kernels/cuda_util.cu compiled by the host compiler against cuda_emu. */
#include "cuda_util.cu"
