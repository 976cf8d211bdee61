/* check: the one assertion macro of the C tests. CHECK(cond) or CHECK(cond, fmt, ...) counts
 * the check and, when cond is false, counts a failure and prints where (the first 50 only, so
 * a broken loop does not flood the log). A test's main returns `failures ? 1 : 0` (or its own
 * summary) at the end; checks never abort, so one run shows every failure. With
 * FITM_CHECK_FIRST_FAIL set (tests/cuda_emu/expect_failure.py sets it: a run that must fail
 * needs one failure, not all), the first failure ends the process with status 1. */
#ifndef FITM_TEST_CHECK_H
#define FITM_TEST_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int failures; /* failed checks so far (a test may also add its own)      */
static int n_checks; /* checks run so far                                        */

__attribute__((format(printf, 4, 5), unused)) static void
check_failed(const char *file, int line, const char *cond, const char *fmt, ...)
{
    if (failures++ >= 50)
        return;
    fprintf(stderr, "FAIL %s:%d: CHECK(%s)", file, line, cond);
    if (fmt[1]) { /* fmt is " " followed by the caller's format, if any */
        va_list ap;
        va_start(ap, fmt);
        fputc(':', stderr);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
    if (getenv("FITM_CHECK_FIRST_FAIL")) {
        fflush(NULL);
        _exit(1);
    }
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        n_checks++;                                                                                \
        if (!(cond))                                                                               \
            check_failed(__FILE__, __LINE__, #cond, " " __VA_ARGS__);                              \
    } while (0)

#endif
