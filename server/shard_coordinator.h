// ShardCoordinator: a sharded job's leader side of TrainingJob. It turns what shapes the step
// barrier (registrations, epoch plans, completed steps, removals, checkpoints, the end) into
// ShardLog events for the followers, and after a restore holds the workers' pushes back until
// each has resumed. Without a log (an unsharded job, or a follower) every call does nothing and
// everything is admitted. Free of gRPC. Thread-safe.
#ifndef DBS_SERVER_SHARD_COORDINATOR_H_
#define DBS_SERVER_SHARD_COORDINATOR_H_

#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint.h"
#include "server/scheduler.h"
#include "server/shard_events.h"
#include "server/step_aggregator.h"

namespace dbs {

class ShardCoordinator {
 public:
  // Makes this the leader of a sharded job; `log` must outlive it. Set before workers connect.
  void Lead(ShardLog* log) { log_ = log; }
  bool leads() const { return log_ != nullptr; }

  // Workers may register once every follower follows (ShardLog::Admit).
  absl::Status Admit() const;
  void Registered(int worker_id, const std::string& token, const std::string& identity);
  // `checkpoint_follows`: a kCheckpoint event of the epoch before comes before its first step.
  void EpochPlanned(int epoch, const StepQuotas& quotas, bool checkpoint_follows);
  void Checkpointed(int epoch, bool written);
  // A completed step, with the re-plan made at it (as the aggregator applies it).
  void StepCompleted(const StepStats& stats, const std::optional<PlanChange>& change,
                     bool checkpointed);
  // `dead` removed at (epoch, step); `later`: the quotas of the steps after it, when re-planned.
  void Removed(int epoch, int step, const std::set<int>& dead, const StepQuotas* later);
  void Ended(const absl::Status& status);

  // After the leader's restore from `state` (the barrier at `quotas`): where it stands and the
  // workers (`now`: the scheduler as restored), for followers; the pushes of `registered`
  // workers are refused until each resumes.
  void Restored(const JobState& state, const StepQuotas& quotas, const Scheduler::State& now,
                const std::set<int>& registered);
  // FAILED_PRECONDITION for a restored worker that has not resumed yet.
  absl::Status AdmitPush(int worker_id) const;
  void Resumed(int worker_id);

 private:
  void Append(ShardEventData event);

  ShardLog* log_ = nullptr;
  mutable absl::Mutex mu_;
  std::set<int> to_resume_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_SHARD_COORDINATOR_H_
