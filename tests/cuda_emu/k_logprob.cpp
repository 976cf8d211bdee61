/* The real kernels/logprob.cu compiled by the host compiler against cuda_emu. */
#include "logprob.cu"
