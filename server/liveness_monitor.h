// LivenessMonitor: decides when a job has stalled and which workers are dead, from cheap counters
// the job hands it on every check (as Ray's health-check manager decides from probe results).
//
// Stall: once training has started, no new activity (accepted pushes, registrations, reports:
// any growing count) for `stall_timeout`. Dead workers: the workers a step still waits for,
// once that same step has waited `worker_timeout` since the check first saw it with a push.
// Zero timeouts disable either check. Free of gRPC; injected clock; thread-safe.
#ifndef DBS_SERVER_LIVENESS_MONITOR_H_
#define DBS_SERVER_LIVENESS_MONITOR_H_

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace dbs {

struct LivenessConfig {
  absl::Duration stall_timeout = absl::Minutes(5);
  absl::Duration worker_timeout = absl::Seconds(60);
};

// The step in progress, as far as liveness is concerned.
struct StepWait {
  int epoch = -1;
  int step = 0;
  int pushed = 0;                // workers that have pushed it
  std::vector<int> waiting_for;  // workers that have not
};

class LivenessMonitor {
 public:
  // `clock` must outlive the monitor.
  LivenessMonitor(LivenessConfig config, const Clock* clock);

  // True when the job has stalled: `activity` (a count that grows with every accepted push,
  // registration and report) unchanged for the stall timeout, once training has `started` or
  // anyone has registered (activity > 0).
  bool Stalled(int64_t activity, bool started);

  // The workers to declare dead now: those `wait` still waits for, when the same step has been
  // waiting with at least one push for the worker timeout. Empty otherwise.
  std::set<int> Overdue(const StepWait& wait);

  absl::Duration stall_timeout() const { return config_.stall_timeout; }
  absl::Duration worker_timeout() const { return config_.worker_timeout; }

 private:
  const LivenessConfig config_;
  const Clock* const clock_;
  absl::Mutex mu_;
  int64_t last_activity_count_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time last_activity_ ABSL_GUARDED_BY(mu_);
  std::pair<int, int> watched_step_ ABSL_GUARDED_BY(mu_) = {-1, -1};
  absl::Time watched_since_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_LIVENESS_MONITOR_H_
