/* The real kernels/norm.cu compiled by the host compiler against cuda_emu. */
#include "norm.cu"
