/* The real kernels/topk.cu compiled by the host compiler against cuda_emu. */
#include "topk.cu"
