#include "base/cpu.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "base/log.h"

static const char *const names[FITM_CPU_PATHS] = {"baseline", "avx2", "avx512"};

const char *fitm_cpu_path_name(fitm_cpu_path_id p)
{
    return p >= 0 && p < FITM_CPU_PATHS ? names[p] : "unknown";
}

int fitm_cpu_parse_path(const char *s)
{
    for (int i = 0; i < FITM_CPU_PATHS; i++)
        if (!strcmp(s, names[i]))
            return i;
    return -1;
}

#if defined(__x86_64__) || defined(__i386__)
/* Bit `bit` of register reg (0 EAX, 1 EBX, 2 ECX, 3 EDX) of CPUID leaf (leaf, sub): for the
 * features that clang before 16 does not name in __builtin_cpu_supports (F16C, BMI1, BMI2). */
static bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit)
{
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]))
        return false;
    return (r[reg] >> bit) & 1u;
}
#endif

bool fitm_cpu_supports(fitm_cpu_path_id p)
{
#if defined(__x86_64__) || defined(__i386__)
    /* __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state (XGETBV). The
     * avx2 objects are built with -march=x86-64-v3, whose LZCNT and MOVBE every CPU with
     * AVX2 and BMI2 has. F16C is CPUID.1:ECX[29], BMI1 and BMI2 CPUID.(7,0):EBX[3] and [8]. */
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                cpuid_bit(1, 0, 2, 29) && cpuid_bit(7, 0, 1, 3) && cpuid_bit(7, 0, 1, 8);
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    switch (p) {
    case FITM_CPU_BASELINE:
        return true;
    case FITM_CPU_AVX2:
        return avx2;
    case FITM_CPU_AVX512:
        return avx512;
    default:
        return false;
    }
#else
    return p == FITM_CPU_BASELINE;
#endif
}

static fitm_cpu_path_id chosen;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    chosen = FITM_CPU_BASELINE;
    for (int p = FITM_CPU_PATHS - 1; p > 0; p--)
        if (fitm_cpu_supports((fitm_cpu_path_id)p)) {
            chosen = (fitm_cpu_path_id)p;
            break;
        }
    const char *env = getenv("FITM_CPU");
    if (!env || !env[0])
        return;
    int want = fitm_cpu_parse_path(env);
    if (want < 0)
        FITM_LOG(FITM_LOG_WARN, NULL, "FITM_CPU=%s is not baseline, avx2 or avx512: using %s",
                 env, names[chosen]);
    else if (!fitm_cpu_supports((fitm_cpu_path_id)want))
        FITM_LOG(FITM_LOG_WARN, NULL, "FITM_CPU=%s: this CPU lacks it: using %s", env,
                 names[chosen]);
    else
        chosen = (fitm_cpu_path_id)want;
}

fitm_cpu_path_id fitm_cpu_path(void)
{
    pthread_once(&once, choose);
    return chosen;
}
