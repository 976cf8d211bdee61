/* ops: CPU reference implementations of the element-wise and row-wise ops of the forward pass.
 * These are the readable references the CUDA kernels are checked against, and the CPU
 * backend's own ops. All are single-threaded over the rows given; callers split rows.
 *
 * Legend: T tokens, C model dim, H query heads, Hkv KV heads, D head dim, F FFN dim. */
#ifndef FITM_OPS_H
#define FITM_OPS_H

#include <stdint.h>

/* y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * (w[:] + w_offset)   x, y: (T, C); y may == x.
 * w_offset is 0 for Llama/Qwen2; Gemma stores (scale - 1) and its GGUF converter already adds
 * the 1, so pass 0 there too unless a file says otherwise. */
void fitm_ops_rmsnorm(float *y, const float *x, const float *w, float w_offset, int64_t T,
                      int64_t C, float eps);

/* In-place numerically stable softmax over n values. */
void fitm_ops_softmax(float *x, int64_t n);

/* RoPE on one head vector v (D values) at position pos, rotating the first n_rot dims.
 * neox = 0: adjacent pairs (0,1),(2,3)... (llama "normal"); neox = 1: halves (i, i+n_rot/2)
 * (qwen2, gemma3). theta_i = pos * base^(-2i/n_rot). */
void fitm_ops_rope(float *v, int64_t D, int64_t n_rot, int64_t pos, float base, int neox);

/* y = silu(g) * u, elementwise over n.      (SwiGLU: Llama, Qwen2) */
void fitm_ops_swiglu(float *y, const float *g, const float *u, int64_t n);

/* y = gelu_tanh(g) * u, elementwise over n. (GeGLU: Gemma) */
void fitm_ops_geglu(float *y, const float *g, const float *u, int64_t n);

#endif
