/* The real kernels/attention.cu compiled by the host compiler against cuda_emu. */
#include "attention.cu"
