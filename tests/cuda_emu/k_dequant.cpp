/* The real kernels/dequant.cu compiled by the host compiler against cuda_emu. */
#include "dequant.cu"
