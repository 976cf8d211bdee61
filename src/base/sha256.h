/* sha256: SHA-256 (FIPS 180-4), to check a downloaded model against its published digest.
 * Our own few lines because no library already linked exports one (OpenSSL is not a
 * dependency; libcurl's is internal). Not constant-time: it hashes public files, not secrets. */
#ifndef FITM_SHA256_H
#define FITM_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint64_t bytes;      /* message length so far */
    uint8_t block[64];   /* the partial block      */
    size_t fill;         /* bytes in block         */
} fitm_sha256;

void fitm_sha256_init(fitm_sha256 *s);
void fitm_sha256_update(fitm_sha256 *s, const void *data, size_t n);
/* Pads, writes the 32-byte digest to out. s must be initialised again before reuse. */
void fitm_sha256_final(fitm_sha256 *s, uint8_t out[32]);
/* The digest as 64 lowercase hex digits and a NUL into hex. */
void fitm_sha256_hex(const uint8_t digest[32], char hex[65]);

#endif
