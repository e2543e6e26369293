// JobObserver: what a training job reports as it happens, for metrics (server/metrics.h) and the
// step trace (server/step_trace.h).
// Everything else a monitor needs (plans, reports, losses, accuracy) it reads from the run
// record at scrape time. Called from the job's threads; implementations must be thread-safe
// and must not call back into the job.
#ifndef DBS_SERVER_JOB_OBSERVER_H_
#define DBS_SERVER_JOB_OBSERVER_H_

#include <map>
#include <utility>

#include "absl/time/time.h"
#include "server/step_statistics.h"

namespace dbs {

class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // A step completed, `wall` after the previous one (zero for an epoch's first step), with what
  // its workers reported and how long the server saw each of them take.
  virtual void OnStep(absl::Duration wall, const StepStats& stats) = 0;
  // A checkpoint was written (or failed to be) in `took`.
  virtual void OnCheckpoint(absl::Duration took, bool ok) = 0;
};

}  // namespace dbs

#endif  // DBS_SERVER_JOB_OBSERVER_H_
