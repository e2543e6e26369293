// TrainingJob: one training job on the parameter server, wiring the domain objects together.
//
// It owns the ParameterStore (with its optimizer), the StepAggregator and the Scheduler, listens to
// the scheduler to start each epoch's steps in the aggregator, logs a line per epoch, and keeps the
// run record for the summary. Free of gRPC; ps_main puts services in front of it. Thread-safe.
#ifndef DBS_SERVER_TRAINING_JOB_H_
#define DBS_SERVER_TRAINING_JOB_H_

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "server/checkpoint.h"
#include "server/checkpoint_writer.h"
#include "server/job_config.h"
#include "server/job_observer.h"
#include "server/liveness_monitor.h"
#include "server/optimizer.h"
#include "server/parameter_store.h"
#include "server/replan_window.h"
#include "server/run_summary.h"
#include "server/scheduler.h"
#include "server/shard_coordinator.h"
#include "server/shard_events.h"
#include "server/share_policy.h"
#include "server/step_aggregator.h"

namespace dbs {

class TrainingJob : public SchedulerListener {
 public:
  // INVALID_ARGUMENT for a bad configuration. `clock` must outlive the job.
  static absl::StatusOr<std::unique_ptr<TrainingJob>> Create(const JobConfig& config,
                                                             const Clock* clock);

  Scheduler* scheduler() { return scheduler_.get(); }
  ParameterStore* store() { return store_.get(); }
  StepAggregator* aggregator() { return aggregator_.get(); }

  // Blocks until the job has finished or been aborted, and its checkpoints are written; returns
  // how it ended.
  absl::Status Wait();
  // Waits at most `timeout`; true when the job has ended.
  bool WaitFor(absl::Duration timeout);

  // Aborts the job, naming the workers it waits for, when nothing has happened for the stall
  // timeout. Call periodically; returns true when it aborted.
  bool CheckStall();

  // Removes the workers a step has waited on for longer than the worker timeout (see
  // JobConfig::worker_timeout). Call periodically; returns the ids removed.
  std::set<int> CheckDeadWorkers();
  // A sharded job's leader: follower `shard` says its step (`epoch`, `step`) has waited the
  // worker timeout for `workers`, whose pushes of it reached this shard (see MissingPushes).
  // They are removed at the step after it, which none of them can have pushed (nor anyone
  // else: every worker waits for that shard's answer), or from the epoch's reports after its
  // last step, and the followers are told. FAILED_PRECONDITION, changing nothing, unless this
  // shard is at that next step with no push of it and waits for each of `workers` there.
  absl::Status RemoveMissingAtShard(int shard, int epoch, int step, const std::set<int>& workers);
  // Ends the job early (a signal, a fatal error): releases every waiting worker.
  void Abort(const absl::Status& status);

  // The run record so far.
  RunInfo Run() const;

  // Reports steps and checkpoints to `observer` as well (metrics, the step trace). Add before
  // workers connect; it must outlive the job.
  void AddObserver(JobObserver* observer) { observers_.push_back(observer); }

  // A sharded job's leader: everything that shapes the step barrier is appended to `log` for
  // the other shards (see shard_events.h), and workers may register only once they all follow.
  // Set before workers connect; it must outlive the job.
  void SetShardLog(ShardLog* log) { shards_.Lead(log); }

  // Called with the workers removed from the job (dead or gone) once they are, so that what
  // the server holds for them can go (their shared memory). It must not call back into the
  // job. Set before workers connect.
  using RemovedHook = std::function<void(const std::set<int>& workers)>;
  void SetRemovedHook(RemovedHook hook) { removed_hook_ = std::move(hook); }

  // Continues from a checkpoint (before any worker connects). FAILED_PRECONDITION when the
  // checkpoint is of a job with another configuration.
  // Settings that shape training (TrainingSettings) must match too, unless
  // `allow_other_settings`.
  absl::Status Restore(const JobState& state, bool allow_other_settings = false);
  // A sharded job's follower: continues from its own checkpoint `state` with the leader's
  // `quotas` for the checkpoint's epoch (the scheduler stays idle).
  absl::Status RestoreShard(const JobState& state, StepQuotas quotas, bool allow_other_settings);
  // Writes a checkpoint now, after those taken before it (no-op without a checkpoint
  // directory). The job's own checkpoints, at its steps and epochs, are written on a thread of
  // their own (CheckpointWriter).
  absl::Status SaveCheckpoint();
  // Where `worker_id` should continue, and the parameters to continue from. After a sharded
  // job's restore it also readmits the worker's pushes (AdmitPush).
  absl::StatusOr<ResumePoint> Resume(int worker_id, ParameterSnapshot* parameters);
  // Whether the barrier may take a push from `worker_id`. The leader of a sharded job restored
  // from a checkpoint refuses (FAILED_PRECONDITION) the pushes of the workers it restored until
  // each has resumed: a push retried across the restart may follow another shard's answer from
  // before it (whose step this shard's checkpoint does not hold), and taking it would let the
  // leader complete a step the other shards wait for in vain. Resuming, the worker redoes the
  // restored step on every shard.
  absl::Status AdmitPush(int worker_id) const { return shards_.AdmitPush(worker_id); }

  // A faulty push (StepAggregator::SetFaultyHook): counted; with `quarantine`, its worker is
  // removed at that step as a dead worker is (its samples go to the others) and recorded.
  void OnFaultyPush(const FaultyPush& f);

  void OnEpochPlanned(int epoch, int num_steps, const std::map<int, WorkerPlan>& plans) override;
  void OnEpochCompleted(const EpochRecord& record) override;
  void OnJobFinished(const absl::Status& status) override;
  absl::Status CanReport(int worker_id, int epoch) override;
  void OnWorkerLeft(int worker_id) override;
  absl::Status CanRegister() override;
  void OnWorkerRegistered(int worker_id, const std::string& token,
                          const std::string& identity) override;
  void OnPlanDecision(int epoch, const PlanDecision& decision) override;

 private:
  TrainingJob(const JobConfig& config, const Clock* clock, std::string optimizer_description);

  const JobConfig config_;
  const Clock* const clock_;
  const std::string optimizer_description_;
  const absl::Time start_;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<StepAggregator> aggregator_;
  std::unique_ptr<Scheduler> scheduler_;

  // The job's record (how it ended, audits, quarantines, leavers).
  mutable absl::Mutex mu_;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
  std::map<int, SampleAudit> audits_ ABSL_GUARDED_BY(mu_);
  std::vector<Quarantine> quarantined_ ABSL_GUARDED_BY(mu_);
  int64_t faulty_pushes_ ABSL_GUARDED_BY(mu_) = 0;
  // What the step hook keeps between steps (the re-plan window, the checkpoint counter, the
  // last step's end); a leaf lock.
  absl::Mutex step_mu_;
  // After every step: record its times, re-plan the rest of the epoch when the window says so,
  // then checkpoint when due (so that the checkpoint holds the re-plan).
  std::optional<PlanChange> OnStep(const StepStats& stats, bool* checkpointed);
  // Records the step's times and re-plans the rest of the epoch when the window says so.
  std::optional<PlanChange> Replan(const StepStats& stats);
  // The checks of Restore that do not depend on the job's role.
  absl::Status CheckRestorable(const JobState& state, bool allow_other_settings) const;
  LivenessMonitor liveness_;  // thread-safe itself
  ReplanWindow replan_ ABSL_GUARDED_BY(step_mu_);
  int steps_since_checkpoint_ ABSL_GUARDED_BY(step_mu_) = 0;
  // The job's state now for a checkpoint; nullopt before there is anything to keep.
  std::optional<JobState> CaptureState();
  // Takes a checkpoint now and queues it for the writer; whether it did. With `may_skip`, not
  // while the one before waits to be written.
  bool TakeCheckpoint(bool may_skip);
  void OnCheckpointWritten(const absl::StatusOr<std::string>& path, absl::Duration took);
  absl::Time end_ ABSL_GUARDED_BY(mu_);
  bool finish_claimed_ ABSL_GUARDED_BY(mu_) = false;
  std::set<int> leavers_ ABSL_GUARDED_BY(mu_);  // left while training ran
  std::set<int> DropMissingReports(int epoch, int num_steps, const std::set<int>& leavers);
  // CheckDeadWorkers without telling the removed hook.
  std::set<int> RemoveDeadWorkers();
  // Removes `dead` at the current step `p` (none of them pushed it), logging `why`, and tells the
  // followers; false when the step moved on meanwhile.
  bool RemoveAtStep(const StepProgress& p, const std::set<int>& dead, absl::string_view why);
  absl::Notification finished_;
  std::vector<JobObserver*> observers_;
  ShardCoordinator shards_;  // thread-safe itself
  // The share policy's decisions, for the run's summary (told under the scheduler's lock).
  mutable absl::Mutex decisions_mu_;
  std::map<int, EpochDecisions> decisions_ ABSL_GUARDED_BY(decisions_mu_);
  RemovedHook removed_hook_;
  // When the previous step of the epoch completed (InfinitePast at an epoch's start).
  absl::Time last_step_end_ ABSL_GUARDED_BY(step_mu_) = absl::InfinitePast();
  // Last: destroyed first, writing what is queued while the rest of the job is still there.
  std::unique_ptr<CheckpointWriter> writer_;  // with a checkpoint directory
};

}  // namespace dbs

#endif  // DBS_SERVER_TRAINING_JOB_H_
