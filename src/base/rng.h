/* rng: the one seeded random source, splitmix64 (Steele, Lea, Flood 2014): a 64-bit counter
 * stepped by the golden-ratio constant and mixed. Deterministic from the seed, fast, not
 * cryptographic. Used for reproducible sampling, random test models and request ids. */
#ifndef FITM_RNG_H
#define FITM_RNG_H

#include <stdint.h>

/* The next 64 bits; advances *state. Any state value, 0 included, is a valid seed. */
static inline uint64_t fitm_rng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Mixes x into 64 well-spread bits without a state: fitm_rng_next on a copy of x. */
static inline uint64_t fitm_rng_mix(uint64_t x)
{
    return fitm_rng_next(&x);
}

#endif
