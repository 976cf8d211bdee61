/* dtype: element/block types of weight tensors. Numbering follows the GGUF tensor type ids,
 * so a type read from a file maps onto this enum directly (after fitm_dtype_info says it is
 * one we know). */
#ifndef FITM_DTYPE_H
#define FITM_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    FITM_DTYPE_F32 = 0,
    FITM_DTYPE_F16 = 1,
    FITM_DTYPE_Q4_0 = 2,
    FITM_DTYPE_Q5_0 = 6,
    FITM_DTYPE_Q8_0 = 8,
    FITM_DTYPE_Q4_K = 12,
    FITM_DTYPE_Q5_K = 13,
    FITM_DTYPE_Q6_K = 14,
    FITM_DTYPE_Q8_K = 15, /* activations only: the partner of K-quant dot products */
    FITM_DTYPE_BF16 = 30,
    FITM_DTYPE_MAX = 40   /* ids at or above this are never valid */
} fitm_dtype;

typedef struct {
    const char *name;      /* "F32", "Q4_K", ... as GGUF tools print it */
    int32_t block_elems;   /* elements per block (1 for F32/F16/BF16)   */
    int32_t block_bytes;   /* bytes per block                           */
} fitm_dtype_info;

/* Layout of a type id, or NULL when the id is not one fitm reads. Any int is safe to pass. */
const fitm_dtype_info *fitm_dtype_info_of(int type_id);

/* Bytes of a row of n elements; 0 if n is not a multiple of the block size, the type is
 * unknown, or the size would overflow. */
size_t fitm_dtype_row_bytes(fitm_dtype t, int64_t n);

#endif
