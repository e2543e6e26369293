// StepTrace: a JSON line per completed step (dbs_ps --step_trace_path), for seeing the balance
// step by step: each worker's samples, the compute it reported, and its step as the server timed
// it (StepStats::cycle, what DBS balances). It lines up a slowdown on one node with the plan's
// answer to it (bench/disturbance.py). A line is appended as the step completes, buffered, and
// the file flushed at each epoch's end and when the trace closes. Free of gRPC. Thread-safe.
#ifndef DBS_SERVER_STEP_TRACE_H_
#define DBS_SERVER_STEP_TRACE_H_

#include <cstdio>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "server/job_observer.h"

namespace dbs {

class StepTrace : public JobObserver {
 public:
  // The trace at `path` (null for an empty path), truncated, or appended to where `append` (a
  // restored job goes on with its trace). `clock` must outlive the trace.
  static absl::StatusOr<std::unique_ptr<StepTrace>> Open(const std::string& path, bool append,
                                                         const Clock* clock);
  ~StepTrace() override;
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // One line: {"epoch", "step" (both from 0), "time" (Unix seconds), "wall_seconds", "samples",
  // "loss" (the step's mean), "workers": [{"id", "samples", "compute_seconds", "step_seconds"
  // (absent where the server did not see the step begin)}]}.
  void OnStep(absl::Duration wall, const StepStats& stats) override;
  void OnCheckpoint(absl::Duration, bool) override {}

 private:
  StepTrace(std::FILE* file, const Clock* clock) : file_(file), clock_(clock) {}

  absl::Mutex mu_;
  std::FILE* const file_ ABSL_PT_GUARDED_BY(mu_);
  const Clock* const clock_;
};

}  // namespace dbs

#endif  // DBS_SERVER_STEP_TRACE_H_
