// The CPU limit this process runs under: the CFS quota of its cgroup (what Kubernetes' CPU limits,
// `docker run --cpus` and systemd's CPUQuota set), in cores.
//
// A process held to f cores cannot use more than f CPU-seconds per second, however fast it runs
// while its quota for the current period lasts. A step that needs c CPU-seconds therefore costs
// it at least c / f seconds in the long run, and a worker that measured only its wall time at a
// small batch would look many times faster than it can sustain (docs/controller.md, "CPU
// limits"). The worker reads its limit once at start and reports its steps' cost with it.
//
// Both cgroup versions are read: v2's `cpu.max` ("max 100000" or "QUOTA PERIOD") and v1's
// `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1: none), in the process's own cgroup and
// every ancestor up to the hierarchy's mount (a parent's limit applies to its children too); the
// tightest wins. The cgroup is found from /proc/self/cgroup and its mount from
// /proc/self/mountinfo. Pure file reading, no state; thread-compatible.
#ifndef DBS_COMMON_CPU_LIMIT_H_
#define DBS_COMMON_CPU_LIMIT_H_

#include <string>

#include "absl/status/statusor.h"

namespace dbs {

// The largest CPU limit a worker may declare (a sanity bound on what a peer sends).
inline constexpr double kMaxCpuLimitCores = 1e6;

// The CPU limit, in cores, as the files under `root` ("/" on a real machine; a test's own tree
// otherwise) say; 0 when there is none (or no cgroup file system is mounted). An error only when
// a file that names a limit cannot be parsed.
absl::StatusOr<double> CgroupCpuLimitCores(const std::string& root = "/");

// The limit as it applies to the work: `limit` (0: none) unless it is at least the `cpus` the
// process may run on, in which case there is no limit in effect (0).
double EffectiveCpuLimit(double limit, int cpus);

}  // namespace dbs

#endif  // DBS_COMMON_CPU_LIMIT_H_
