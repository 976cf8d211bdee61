/* The real kernels/bf16.cu compiled by the host compiler against cuda_emu. */
#include "bf16.cu"
