/* clock: the one clock. CLOCK_MONOTONIC, for deadlines and the timings a response reports;
 * never wall time. Thread-safe. */
#ifndef FITM_CLOCK_H
#define FITM_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Now, in nanoseconds since an arbitrary fixed point. */
static inline int64_t fitm_clock_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Now, in milliseconds (fractional), on the same scale. */
static inline double fitm_clock_ms(void)
{
    return (double)fitm_clock_ns() / 1e6;
}

#endif
