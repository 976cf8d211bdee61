#include "server/cpus.h"

#include <math.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A whole positive integer (trailing whitespace allowed) into *v. */
static bool parse_count(const char *s, long long *v)
{
    char *end = NULL;
    while (*s == ' ' || *s == '\t')
        s++;
    if (*s < '0' || *s > '9')
        return false;
    *v = strtoll(s, &end, 10);
    while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')
        end++;
    return *end == '\0' && *v > 0;
}

fitm_status fitm_cpus_parse_v2(const char *text, double *cpus, fitm_err *err)
{
    char quota[32], period[32], extra[2];
    int n = sscanf(text, "%31s %31s %1s", quota, period, extra);
    long long q = 0, p = 0;
    if (n != 2 || !parse_count(period, &p) || (strcmp(quota, "max") && !parse_count(quota, &q)))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "cpu.max: expected 'QUOTA PERIOD' or 'max PERIOD', got '%.40s'", text);
    *cpus = strcmp(quota, "max") ? (double)q / (double)p : 0;
    return FITM_OK;
}

fitm_status fitm_cpus_parse_v1(const char *quota, const char *period, double *cpus,
                               fitm_err *err)
{
    long long q = 0, p = 0;
    char *end = NULL;
    long long raw = strtoll(quota, &end, 10);
    while (end && (*end == '\n' || *end == ' '))
        end++;
    bool unlimited = end != quota && end && *end == '\0' && raw == -1;
    if (!parse_count(period, &p) || (!unlimited && !parse_count(quota, &q)))
        return fitm_err_set(err, FITM_ERR_FORMAT,
                            "cpu.cfs_quota_us / cpu.cfs_period_us: expected a count (or -1) and "
                            "a count, got '%.20s' / '%.20s'", quota, period);
    *cpus = unlimited ? 0 : (double)q / (double)p;
    return FITM_OK;
}

/* The first line of path (at most cap - 1 bytes); false when it cannot be read. */
static bool read_small(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    bool ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    return ok;
}

double fitm_cpus_cgroup_quota(const char *root, const char *self_path)
{
    char path[1024], a[128], b[128];
    double best = 0, v = 0;
    /* v2: the process's cgroup and its parents, each of which may limit it ("" = root). */
    char dir[768];
    snprintf(dir, sizeof dir, "%s", self_path ? self_path : "");
    for (;;) {
        size_t n = strlen(dir);
        while (n > 0 && dir[n - 1] == '/')
            dir[--n] = '\0';
        snprintf(path, sizeof path, "%s%s/cpu.max", root, dir);
        if (read_small(path, a, sizeof a) && fitm_cpus_parse_v2(a, &v, NULL) == FITM_OK &&
            v > 0 && (best == 0 || v < best))
            best = v;
        char *slash = strrchr(dir, '/');
        if (!slash)
            break;
        *slash = '\0';
    }
    if (best > 0)
        return best;
    /* v1: the cpu controller's own hierarchy (as a container sees it). */
    static const char *const v1[] = {"cpu", "cpu,cpuacct", "cpuacct,cpu"};
    for (size_t i = 0; i < sizeof v1 / sizeof v1[0]; i++) {
        snprintf(path, sizeof path, "%s/%s/cpu.cfs_quota_us", root, v1[i]);
        if (!read_small(path, a, sizeof a))
            continue;
        snprintf(path, sizeof path, "%s/%s/cpu.cfs_period_us", root, v1[i]);
        if (read_small(path, b, sizeof b) && fitm_cpus_parse_v1(a, b, &v, NULL) == FITM_OK)
            return v;
    }
    return 0;
}

/* The v2 path of this process's cgroup from /proc/self/cgroup ("0::/path"); "/" if none. */
static void self_cgroup(char *out, size_t cap)
{
    snprintf(out, cap, "/");
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f)
        return;
    char line[1024];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "0::", 3)) {
            line[strcspn(line, "\n")] = '\0';
            snprintf(out, cap, "%.700s", line + 3);
        }
    fclose(f);
}

int fitm_cpus_available(int *affinity, double *quota)
{
    cpu_set_t set;
    int n = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    char self[768];
    self_cgroup(self, sizeof self);
    double q = fitm_cpus_cgroup_quota("/sys/fs/cgroup", self);
    if (affinity)
        *affinity = n;
    if (quota)
        *quota = q;
    if (q > 0 && ceil(q) < n)
        n = (int)ceil(q);
    return n > 0 ? n : 1;
}
