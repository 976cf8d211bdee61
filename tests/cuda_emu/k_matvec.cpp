/* The real kernels/matvec.cu compiled by the host compiler against cuda_emu. */
#include "matvec.cu"
