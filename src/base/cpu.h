/* cpu: which SIMD code path this process runs, chosen once from the CPU's features, so one
 * binary (and one image) runs on any x86-64 and still uses the fastest path there.
 *
 * Paths: baseline (x86-64, SSE2: the portable C), avx2 (x86-64-v3: AVX2, FMA, F16C, BMI1/2)
 * and avx512 (x86-64-v4 + VNNI: AVX512F/BW/DQ/VL/VNNI). The kernels of compute/quant_x86.c and
 * of the CPU backend are compiled once per path (src/compute/meson.build,
 * src/model/meson.build) and picked through fitm_cpu_path(). Float sums are fixed per path,
 * so a binary on one machine always sums the same way; different paths round differently
 * (FMA or not, 8 or 16 lanes), which is why the choice is made once per process.
 *
 * FITM_CPU=baseline|avx2|avx512 forces a path (tests, benchmarks, bug reports); a path the
 * CPU lacks is refused with a warning and the detected one is used instead. */
#ifndef FITM_CPU_H
#define FITM_CPU_H

#include <stdbool.h>

typedef enum { FITM_CPU_BASELINE = 0, FITM_CPU_AVX2, FITM_CPU_AVX512, FITM_CPU_PATHS } fitm_cpu_path_id;

/* The path of this process: FITM_CPU when set and supported, else the best the CPU has.
 * Decided on the first call (thread-safe), the same for the process's life. */
fitm_cpu_path_id fitm_cpu_path(void);

/* Whether the CPU (and the OS: the vector registers' state is saved) can run path p. */
bool fitm_cpu_supports(fitm_cpu_path_id p);

/* "baseline", "avx2", "avx512". */
const char *fitm_cpu_path_name(fitm_cpu_path_id p);

/* Parses a path name; -1 when unknown. */
int fitm_cpu_parse_path(const char *s);

#endif
