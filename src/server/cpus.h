/* cpus: how many CPUs this process may really use, for threads = 0: the CPU affinity mask
 * (taskset, cpuset, Kubernetes' static CPU manager) and the cgroup CPU quota (a container's
 * `cpus` / a pod's CPU limit), cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us and
 * cpu.cfs_period_us). More threads than that only time-slice against each other.
 *
 * Everything here is pure but for the reads named: callable from any thread. */
#ifndef FITM_CPUS_H
#define FITM_CPUS_H

#include <stddef.h>

#include "base/status.h"

/* cgroup v2's cpu.max text ("QUOTA PERIOD" or "max PERIOD", a newline allowed) into *cpus
 * (quota / period; 0 = no limit). FITM_ERR_FORMAT for anything else. */
fitm_status fitm_cpus_parse_v2(const char *text, double *cpus, fitm_err *err);

/* cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us texts into *cpus (quota / period; a
 * quota of -1 is no limit: 0). FITM_ERR_FORMAT for anything else. */
fitm_status fitm_cpus_parse_v1(const char *quota, const char *period, double *cpus,
                               fitm_err *err);

/* The CPU quota of the cgroup this process is in, under the cgroup mount root (normally
 * "/sys/fs/cgroup"): v2's cpu.max of the process's cgroup (self_path, as /proc/self/cgroup
 * names it, "/" in a container's own namespace) and of each parent up to root, the smallest;
 * else v1's files under root/cpu (or root/cpu,cpuacct). 0 when there is no limit or no file
 * to read. */
double fitm_cpus_cgroup_quota(const char *root, const char *self_path);

/* The threads to use when the operator gave none: the CPUs in this process's affinity mask,
 * lowered to the cgroup quota rounded up, at least 1. *affinity and *quota (may be NULL)
 * receive the two inputs, for the log. */
int fitm_cpus_available(int *affinity, double *quota);

#endif
