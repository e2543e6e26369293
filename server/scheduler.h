// Scheduler: membership and the epoch plans of a job.
//
// Workers register (idempotent by name); when the expected number have joined, the scheduler lays
// out epoch 0 with equal shares. Each worker reports its epoch's compute-only time; when every
// worker of the epoch has reported, the share policy turns the reports into the next epoch's
// shares and the BatchAllocator into plans. After the last epoch every plan request is answered
// with `finished`. Plan requests do not block a thread: the callback runs when the plan exists.
//
// A listener (the parameter server's wiring) hears of each new epoch before any worker receives
// its plan, of each completed epoch, and of the end of the job. Callbacks run without the
// scheduler's lock held, except OnEpochPlanned, which runs under it so that no worker can see a
// plan the rest of the server does not yet know. Thread-safe.
#ifndef DBS_SERVER_SCHEDULER_H_
#define DBS_SERVER_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/cpu_limit.h"
#include "common/plan.h"
#include "server/batch_allocator.h"
#include "server/epoch_record.h"
#include "server/share_policy.h"
#include "server/worker_table.h"

namespace dbs {

struct SchedulerConfig {
  int expected_workers = 1;
  int epochs = 1;
  int global_batch = 64;
  uint64_t seed = 1;
  // Workers one source (WorkerRegistration::source) may have in the job at once; 0: no limit.
  int max_workers_per_source = 0;
  // A registration that has never been planned, has no plan request waiting and has made no
  // call for this long is dropped, and its slot freed; 0: never.
  absl::Duration registration_idle = absl::ZeroDuration();
};

// Plan requests waiting at once, per worker. A worker waits with one call; calls whose clients
// went away (a dropped connection) stay until the plan is answered, hence the margin.
inline constexpr int kMaxWaitersPerWorker = 16;

class SchedulerListener {
 public:
  virtual ~SchedulerListener() = default;
  // A new epoch has been planned (called under the scheduler's lock; must not call back).
  virtual void OnEpochPlanned(int epoch, int num_steps, const std::map<int, WorkerPlan>& plans) = 0;
  // Every worker has reported `record.epoch`.
  virtual void OnEpochCompleted(const EpochRecord& record) = 0;
  // The job ended: OK after the last epoch, an error when it was aborted.
  virtual void OnJobFinished(const absl::Status& status) = 0;
  // May `worker_id` report `epoch` now? (Called without the scheduler's lock.) A report is only
  // meaningful once every step of the epoch is done.
  virtual absl::Status CanReport(int worker_id, int epoch) { return absl::OkStatus(); }
  // `worker_id` left while training ran: it is to be removed like a dead worker.
  virtual void OnWorkerLeft(int worker_id) {}
  // May workers register now? An error (UNAVAILABLE: retry later) refuses the registration.
  virtual absl::Status CanRegister() { return absl::OkStatus(); }
  // A new worker joined with `token`, its calls bound to client certificate `identity` (""
  // for none). Called under the scheduler's lock, before the epoch it completes is planned; must
  // not call back.
  virtual void OnWorkerRegistered(int worker_id, const std::string& token,
                                  const std::string& identity) {}
  // The share policy decided about `epoch` (its plan, or a re-plan, kept or applied), with the
  // inputs a replay needs. Called under the scheduler's lock; must not call back.
  virtual void OnPlanDecision(int epoch, const PlanDecision& decision) {}
};

class Scheduler {
 public:
  using PlanCallback = std::function<void(const absl::StatusOr<WorkerPlan>&)>;

  using TokenSource = WorkerTable::TokenSource;

  // `config` must be valid (see ValidateJobConfig). `clock` and `listener` (may be null) must
  // outlive the scheduler.
  Scheduler(SchedulerConfig config, std::unique_ptr<SharePolicy> policy, const Clock* clock,
            SchedulerListener* listener, TokenSource token_source = nullptr);

  // From now on, tokens are signed with `key` (IssueWorkerToken, common/secrets.h), so that the
  // server's other shards can check them before they hear of the worker. Call before serving.
  void SetTokenKey(std::string key);

  // From now on the job starts (epoch 0 is planned) when its expected workers have each
  // registered and had their model accepted (ModelAccepted), not when they have registered: a
  // worker whose model is refused never counts. Call before serving.
  void StartWithAcceptedModels();
  // Worker `worker_id`'s model was accepted (the job's, or the first). NOT_FOUND for an unknown
  // id; OK and nothing more when the job has started or does not wait for models.
  absl::Status ModelAccepted(int worker_id);
  // How many of the expected workers the job has before it starts: registered, not gone, and
  // with their model accepted when it waits for models.
  int WorkersReady() const;

  // OK when `token` is worker `worker_id`'s: NOT_FOUND for an unknown id, UNAUTHENTICATED for no
  // token, PERMISSION_DENIED for another worker's or a wrong one, or when the worker registered
  // with a client certificate and `identity` (the call's, ClientIdentity) is not its: a
  // token works only over connections with the certificate it was issued to. A call that passes
  // keeps the worker's registration from expiring (SchedulerConfig::registration_idle).
  absl::Status Authenticate(int worker_id, absl::string_view token,
                            absl::string_view identity = "") const;

  // Joins the job. The same name gets the same id back. A new worker joining a running job is
  // planned from the next epoch (RegistrationResult::start_epoch). FAILED_PRECONDITION when the
  // job has finished or the worker's data set size differs from the first worker's;
  // PERMISSION_DENIED when the name's worker registered with another client certificate;
  // RESOURCE_EXHAUSTED when the job, or the registration's source, has as many workers as it
  // may (after idle registrations have been dropped).
  absl::StatusOr<RegistrationResult> Register(const WorkerRegistration& registration);

  // A worker leaves. It is not planned again; while training runs, the listener is told
  // (OnWorkerLeft) so the running epoch goes on without it.
  absl::Status Leave(int worker_id);

  // The workers of running `epoch` that have neither reported nor been removed; `reported`
  // receives how many have reported. Empty when the epoch is complete or unknown.
  std::vector<int> Unreported(int epoch, int* reported) const;
  // Removes `ids` from running `epoch` after its steps are done (they will never report): the
  // epoch completes with the others' reports. FAILED_PRECONDITION when it is not running.
  absl::Status DropUnreported(int epoch, const std::set<int>& ids);

  // Removes workers that died during step `step` of `epoch` (they did not push it): their part
  // of that step goes into an extra step at the end of the epoch, and every later step's block is
  // re-split among the survivors by their shares; the survivors' test slices are re-split too.
  // The dead workers are no longer members. FAILED_PRECONDITION when nobody would survive.
  absl::StatusOr<PlanChange> RemoveWorkers(const std::set<int>& dead, int epoch, int step);

  // Mid-epoch re-plan: the share policy plans the rest of the epoch from each worker's history
  // and `window` (its newest steps, by worker id), and the blocks of steps from `from_step` on
  // are re-split by the result, and so are the test slices. FAILED_PRECONDITION when the epoch
  // is not running, no step is left, or the policy keeps the current split.
  absl::StatusOr<PlanChange> Rebalance(int epoch, int from_step,
                                       const std::map<int, Measurement>& window);

  // Records the compute times of one completed step: worker id -> (samples, seconds). Ignored
  // for an epoch that is not running or a worker that is not part of it.
  void RecordStep(int epoch, const std::map<int, std::pair<int64_t, double>>& times);

  // Records a worker's epoch report; an identical repeat is accepted once.
  absl::Status Report(const EpochTiming& timing);

  // Calls `done` with the worker's plan for `epoch` once it exists (at once if it does).
  // Returns the wait's id, or 0 when `done` already ran.
  uint64_t AwaitPlan(int worker_id, int epoch, PlanCallback done);
  // Withdraws a wait (its caller went away): true when it was still waiting, and then `done`
  // will never run; false when `done` has run or is running.
  bool CancelAwait(uint64_t wait_id);

  // Aborts the job: fails every waiting and future plan request with `status`.
  void Abort(const absl::Status& status);

  // Everything the scheduler knows, for checkpoints.
  struct State {
    std::vector<WorkerRegistration> workers;
    std::vector<bool> left;
    std::vector<EpochRecord> records;
    bool finished = false;
    std::vector<std::string> tokens;  // by id
  };
  State SaveState() const;
  // Replaces membership and history with a restored checkpoint's (before any worker connects).
  void LoadState(State state);

  bool IsRegistered(int worker_id) const;
  std::vector<EpochRecord> History() const;
  std::vector<WorkerRegistration> Workers() const;  // by id
  // A count that grows with every new registration and accepted report (for liveness).
  int64_t events() const;
  // True once the first epoch has been planned.
  bool started() const;
  int active_workers() const;  // registered and not left
  // Workers removed for silence (not by their own Leave) that have not been heard from since:
  // they may still be running, cut off, and call again. One that registers again (or asks to
  // after the end) is back. By name.
  int removed_workers_not_back() const;
  const SchedulerConfig& config() const { return config_; }
  std::string policy_name() const { return policy_->name(); }
  PolicyKind policy_kind() const { return policy_->kind(); }

  // Epochs of history each observation carries, and windows of the running epoch's re-plans
  // (the newest; the dbs policy models from its newest 16 measurements).
  static constexpr int kHistoryEpochs = 16;
  static constexpr size_t kHistoryWindows = 16;

 private:
  struct Waiter {
    int worker_id;
    int epoch;
    PlanCallback done;
    uint64_t id;
  };
  using Calls = std::vector<std::function<void()>>;

  // Members that have not left or died, by id.
  std::vector<int> ActiveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the policy is told about worker `id`: its measurements in the complete epochs before
  // `upto`, oldest first, its share and batch in epoch `upto - 1` and its idle run at its end.
  WorkerObservation ObserveLocked(int id, int upto) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `id`'s name and the measurements of the epochs before `upto`.
  WorkerObservation HistoryLocked(int id, int upto) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a re-plan of `rec` from `from_step` tells the policy of worker `id`: its history, the
  // windows of the epoch's earlier re-plans and `window`, its batch now and its idle run.
  WorkerObservation ReplanObservationLocked(const EpochRecord& rec, int id, int from_step,
                                            const Measurement& window) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lays out epoch `records_.size()` from the latest reports and collects the waiters it answers.
  absl::Status PlanNextEpochLocked(Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans epoch 0 once the expected workers are present (see StartWithAcceptedModels).
  absl::Status StartIfReadyLocked(Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int WorkersReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AnswerWaitersLocked(Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int WaitersOfLocked(int worker_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a worker of a name not in the job; returns its id.
  absl::StatusOr<int> AddWorkerLocked(const WorkerRegistration& reg, Calls* calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first epoch planned with worker `id`: records_.size() when none is yet.
  int FirstPlannedEpochLocked(int id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops registrations idle for config_.registration_idle (see SchedulerConfig).
  void ExpireIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `rec` when every planned worker has reported or been removed: plans the next
  // epoch, or finishes the job.
  void MaybeCompleteEpochLocked(EpochRecord& rec, Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const absl::Status& status, Calls* calls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  WorkerPlan FinishedPlan(int epoch) const;
  // Splits each step's block from `from_step` on (and `extra`, as one more step, if not empty)
  // among `survivors` by `shares`, re-splits the test set, and builds the revisions and quotas.
  PlanChange ResplitLocked(EpochRecord& rec, const std::vector<int>& survivors,
                           const std::vector<double>& shares, int from_step,
                           std::vector<SampleRange> extra) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Run(Calls& calls);

  const SchedulerConfig config_;
  const std::unique_ptr<SharePolicy> policy_;
  const Clock* const clock_;
  SchedulerListener* const listener_;

  mutable absl::Mutex mu_;
  // Membership; mutable: an authenticated call (a const query) counts as the worker's last.
  mutable WorkerTable table_ ABSL_GUARDED_BY(mu_);
  bool start_with_models_ ABSL_GUARDED_BY(mu_) = false;
  std::set<int> models_accepted_ ABSL_GUARDED_BY(mu_);  // before the start
  std::vector<EpochRecord> records_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  uint64_t last_wait_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  int64_t events_ ABSL_GUARDED_BY(mu_) = 0;  // new registrations and accepted reports
};

}  // namespace dbs

#endif  // DBS_SERVER_SCHEDULER_H_
