// StepAggregator: the synchronous step barrier of the parameter server.
//
// For each step of an epoch it collects one gradient from every worker in the epoch's plan, each
// the mean over that worker's b_i samples, and applies g = sum_i (b_i / B) g_i (B = sum b_i) once
// through the ParameterStore: exactly the mean gradient of the step's global batch. Pushers are not
// blocked: each push hands over a completion callback, and when the last gradient of the step
// arrives every callback runs (on the thread of that last push) with the same result.
//
// Everything a peer controls is checked before anything changes: an unknown worker, a push for a
// step that is not the current one, or a sample count that differs from the plan leaves the step
// as it was. A duplicate push of the pending step or of the step just completed is not counted
// again and gets the same result, so pushes may be retried. Thread-safe.
//
// Three locks, taken in this order and never the other way: the barrier's (who has pushed which
// step, the plan's quotas, the waiting answers), the reduction's (the step's sum; the store's
// update runs under it, so the store's lock comes after it) and the statistics' (losses,
// timings, the audit). The barrier's is held only for bookkeeping: a push's gradient is summed,
// and a complete step applied, with it released, so status reports, the liveness monitor and
// the next push's checks never wait for a model-sized pass. Callbacks and hooks run with no
// lock held.
#ifndef DBS_SERVER_STEP_AGGREGATOR_H_
#define DBS_SERVER_STEP_AGGREGATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/plan.h"
#include "common/wire_values.h"
#include "server/gradient_screen.h"
#include "server/gradient_sum.h"
#include "server/parameter_store.h"
#include "server/step_reduction.h"
#include "server/step_statistics.h"

namespace dbs {

// The outcome of one step, shared by every worker of the step.
struct StepResult {
  int epoch = 0;
  int step = 0;
  double global_loss = 0.0;  // mean loss over the step's samples
  int64_t global_samples = 0;
  ParameterSnapshot parameters;
  // Changes to the rest of the epoch decided at this step, by worker (usually none).
  std::shared_ptr<const std::map<int, PlanRevision>> revisions;
};

// Where the step barrier stands, for stall detection and status reports.
struct StepProgress {
  int epoch = -1;
  int step = 0;
  int num_steps = 0;
  int64_t accepted_pushes = 0;   // pushes counted so far, over the whole job
  std::vector<int> waiting_for;  // workers of the current step that have not pushed yet
  int pushed = 0;                // workers of the current step that have pushed
};

// A push's gradient: the received message's payload (held, not copied), or, for tests and
// in-process callers, a copy of plain floats in fp32.
class PushedGradient {
 public:
  PushedGradient() = default;
  PushedGradient(std::shared_ptr<const WirePayload> payload)  // NOLINT: implicit on purpose
      : payload_(std::move(payload)) {}
  PushedGradient(absl::Span<const float> values)  // NOLINT
      : payload_(values.empty() ? nullptr : WirePayload::FromFloats(values)) {}
  PushedGradient(const std::vector<float>& values)  // NOLINT
      : PushedGradient(absl::MakeConstSpan(values)) {}

  const WirePayload* get() const { return payload_.get(); }
  const std::shared_ptr<const WirePayload>& shared() const { return payload_; }
  bool operator==(std::nullptr_t) const { return payload_ == nullptr; }
  const WirePayload& operator*() const { return *payload_; }

 private:
  std::shared_ptr<const WirePayload> payload_;
};

struct GradientPush {
  int worker_id = 0;
  int epoch = 0;
  int step = 0;
  int num_samples = 0;
  double loss_sum = 0.0;
  // The worker's mean gradient (model size) as it arrived; may be null when num_samples is 0.
  // Held (not copied) until it is summed.
  PushedGradient gradient;
  double compute_seconds = 0.0;  // piggybacked timing of this step
};

struct AggregatorOptions {
  // Sum the pushes of a step in worker-id order whatever order they arrive in, so that the same
  // job gives bit-identical parameters run after run. A push that arrives before a lower id's
  // is held (the received message, not a copy) until its turn. Off: summed on arrival.
  bool deterministic = true;
  // What a faulty push meets (gradient_screen.h): a value that is not finite or beyond
  // kMaxAbsGradient, or an L2 norm far above the job's recent ones. Off here (a bad value
  // refuses the push); a job's default is kEvict (JobConfig::screen).
  ScreenConfig screen{FaultyGradients::kOff};
};

// A push found faulty (SetFaultyHook): refused and its worker to be quarantined
// (`quarantine`, FaultyGradients::kEvict), or only logged (kLog: it was summed).
struct FaultyPush {
  int worker_id = 0;
  int epoch = 0;
  int step = 0;
  absl::Status why;
  bool quarantine = false;
  // The push was counted at `step` and refused as it was summed (its values in shared memory
  // changed after their check): its worker is removed from the next step on, not at `step`.
  bool counted = false;
  // The step from which its worker is to be removed.
  int removal_step() const { return counted ? step + 1 : step; }
};

class StepAggregator {
 public:
  using Done = std::function<void(const absl::StatusOr<StepResult>&)>;

  // `store` must outlive the aggregator; so must `clock`, which times each worker's own
  // steps (StepStats::cycle; none without a clock).
  explicit StepAggregator(ParameterStore* store, const Clock* clock = nullptr,
                          AggregatorOptions options = {});

  // Starts `epoch` with one entry of `quotas` per step. Called by the scheduler's listener before
  // any worker sees the plan.
  void BeginEpoch(int epoch, StepQuotas quotas);

  // First half of removing workers that stopped pushing: if (epoch, step) is still the current
  // step and none of `dead` has pushed it, refuses their pushes from now on and returns true.
  bool Evict(int epoch, int step, const std::set<int>& dead);
  // Second half, after the scheduler re-planned: the current step completes with the gradients
  // received (their mean over the samples actually pushed), steps from step + 1 on use
  // `later_quotas` (quotas for steps step+1 ...), and every waiting worker gets `revisions`.
  void CompleteEviction(PlanChange change);

  // A re-plan decided elsewhere (a sharded job's leader, see ShardFollower) at step `step` of
  // `epoch`: the steps after it use `later_quotas`. Applied while `step` is being collected or
  // once it has completed (before anyone pushes the next); false otherwise.
  bool ReviseFrom(int epoch, int step, StepQuotas later_quotas);
  // The samples each worker contributes to step `step` of `epoch` as planned now; empty for a
  // step past the epoch's last or of another epoch.
  std::map<int, int> Quota(int epoch, int step) const;

  // Called after every completed step, before the workers are answered; a re-plan it returns
  // (ignored after the last step of an epoch) applies from the next step and travels with the
  // answers.
  // It must not call back into the aggregator. Set before training starts.
  using StepHook = std::function<std::optional<PlanChange>(const StepStats&)>;
  void SetStepHook(StepHook hook) { hook_ = std::move(hook); }
  // Called (outside the lock) when a complete step cannot be applied; the job cannot go on.
  using FailureHook = std::function<void(const absl::Status&)>;
  void SetFailureHook(FailureHook hook) { failure_hook_ = std::move(hook); }
  // Called (outside the lock, before the push is answered) for each faulty push of the
  // current step (AggregatorOptions::screen). With `quarantine` the push was refused (ABORTED)
  // and the worker is still one the step waits for (at `removal_step()`: a push refused as it
  // was summed is told once its step completed, before the next step's answers can arrive):
  // the hook removes it (TrainingJob). Set before training starts.
  using FaultyHook = std::function<void(const FaultyPush&)>;
  void SetFaultyHook(FaultyHook hook) { faulty_hook_ = std::move(hook); }

  // The (worker, step) pushes counted in `epoch`, for the sample audit.
  std::set<std::pair<int, int>> AcceptedPushes(int epoch) const;

  // The checks of Push that do not need the gradient (who, which step, how many samples), so
  // that a push the barrier would refuse is refused before its tensors are decoded. A retry of
  // a pending or just-completed push passes.
  absl::Status Precheck(const GradientPush& header) const;

  // Validates and records a push. On error `done` runs at once with the error and nothing changes;
  // otherwise it runs when the step completes (possibly at once, on this thread). A retry of a
  // pending push takes the earlier push's place in the wait: the earlier `done` runs at once
  // with ABORTED, so a worker never holds more than one waiting answer (and model copy).
  // Returns the wait's ticket, or 0 when `done` already ran.
  uint64_t Push(const GradientPush& push, Done done);

  // Withdraws a waiting push's answer (its caller went away); the push itself stays counted.
  // True when it was waiting (its `done` will never run); false when `done` has run or is running.
  bool CancelWait(uint64_t ticket);

  // Fails every pending and future push with `status` (job aborted or shutting down).
  void Abort(const absl::Status& status);
  // Loss totals of `epoch` so far.
  EpochLoss LossOf(int epoch) const;

  StepProgress Progress() const;

  // Where the barrier stands, for checkpoints: taken together with the parameters so that the
  // position and the values always agree.
  struct State {
    int epoch = -1;
    int step = 0;
    std::map<int, EpochLoss> losses;
    std::set<std::pair<int, int>> accepted;  // of `epoch`
    StoreState store;
  };
  State SaveState() const;
  // Resumes at `state.epoch`, step `state.step`, with `quotas` for that epoch's steps; the
  // store is restored by the caller.
  void LoadState(const State& state, StepQuotas quotas);

 private:
  struct Pending {
    Done done;  // empty once withdrawn
    uint64_t ticket = 0;
  };
  // What Push found before the lock: the gradient's check, whether a value (not its shape)
  // failed it, the sum of its squared values, and its blocks' when its sender can still
  // write them.
  struct CheckedGradient {
    absl::Status status;
    bool bad_values = false;
    double sum_squares = 0.0;
    BlockSquares blocks;
  };
  // An accepted push's gradient on its way to the reduction, handed over once the barrier's
  // lock is released; void once the reduction has begun another `round`.
  struct Handoff {
    uint64_t round = 0;
    int worker = 0;
    int samples = 0;
    std::shared_ptr<const WirePayload> gradient;
    BlockSquares blocks;
  };
  using Refusals = std::vector<std::pair<Done, absl::Status>>;
  // A complete step to apply, decided under the barrier's lock and applied outside it.
  struct Completion {
    uint64_t round = 0;
    int64_t gradients = 0;              // handed over this round: the sum waits for them all
    std::map<int, int> quota;           // the step's workers, for the sum's order
    std::vector<GradientScale> scales;  // empty: nothing to apply (no samples)
    bool last_of_epoch = false;
  };
  // What a push (or an eviction) leads to, acted on once the barrier's lock is released.
  struct PushOutcome {
    std::vector<Handoff> handoffs;
    std::map<int, int> quota;  // the step's, for the handoffs
    std::optional<Completion> completion;
    std::vector<FaultyPush> faulty;
    Refusals refusals;
    std::vector<Done> to_run;  // answered with `result`
    absl::StatusOr<StepResult> result;
    StepStats stats;       // of the completed step
    uint64_t waiting = 0;  // the push waits: its ticket
    // Pushes refused as the completed step summed them: told after AfterStep, so that their
    // workers' removal from the next step follows any re-plan of it.
    std::vector<FaultyPush> changed;
  };

  absl::Status Validate(const GradientPush& push) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Validate without the gradient's size.
  absl::Status ValidateHeader(const GradientPush& push) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsRetryLocked(const GradientPush& push) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks a push's gradient values (size, finite, at most kMaxAbsGradient) into `*checked`;
  // no lock needed.
  void CheckGradient(const GradientPush& push, CheckedGradient* checked) const;
  // Moves every waiting answer into `to_run` (answered with the refusal in `refused`, where one
  // is) and forgets the pending pushes.
  void TakePendingLocked(std::vector<Done>* to_run, const std::map<int, absl::Status>& refused = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a valid push: its place in the wait, its statistics, and its gradient into `out` to
  // be handed to the reduction.
  void AcceptLocked(const GradientPush& push, Pending pending, BlockSquares blocks,
                    PushOutcome* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pending (or held) push of `worker` at the current step, or null.
  Pending* PendingOfLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A push with a value no GPU computes under kEvict: its refusal, its worker into `faulty`.
  absl::Status ScreenLocked(const GradientPush& push, const CheckedGradient& checked,
                            std::vector<FaultyPush>* faulty) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A push that is neither a retry nor of the step just completed: refused, held as a suspect,
  // or accepted, and the step's completion begun when it was the last one.
  void TakeNewPushLocked(const GradientPush& push, CheckedGradient checked, Done done,
                         PushOutcome* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once every push of the step is in (pending or suspect): each suspect is accepted or
  // refused (into `out`'s refusals, its worker into `out->faulty` for the hook).
  void ResolveSuspectsLocked(PushOutcome* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every worker of the step has pushed (or was evicted): the step's completion into `out`.
  void BeginCompletionLocked(PushOutcome* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands `out`'s gradients to the reduction and sums what is ready; then, when the step is
  // complete, applies it and answers into `out`. Called with no lock held.
  void Settle(PushOutcome* out) ABSL_LOCKS_EXCLUDED(mu_, reduction_mu_, stats_mu_);
  // The step's sum applied to the store (or its parameters, with nothing to apply); the
  // pushes whose values changed as they were summed into `changed`.
  absl::StatusOr<ParameterSnapshot> ApplyStep(const Completion& c,
                                              std::map<int, absl::Status>* changed)
      ABSL_LOCKS_EXCLUDED(mu_, reduction_mu_);
  // The step's result and answers once it has been applied; the barrier moves to the next step.
  void FinishStepLocked(const Completion& c, absl::StatusOr<ParameterSnapshot> snap,
                        std::map<int, absl::Status> changed, PushOutcome* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until no step is being applied (a restore, a new epoch or an abort must not cut into
  // one).
  void AwaitNotCompletingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the reduction over (round_ + 1), forgetting what it held; with `drop_buffer` its sum's
  // buffer too (the store's LoadState dropped its reservation).
  void RestartReductionLocked(bool drop_buffer = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a step completed, before its answers go out: the failure hook, or the step hook (and
  // the re-plan it returns), then the answers' release time.
  void AfterStep(const StepStats& stats, absl::StatusOr<StepResult>* result)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The refusal of a quarantined worker's push.
  static absl::Status Quarantined(int worker, int epoch, int step, const absl::Status& why);
  // Logs each faulty push, tells the hook, then answers the refused pushes. Outside the locks.
  void TellFaulty(const std::vector<FaultyPush>& faulty, Refusals* refusals);
  // Answers what `out` holds once the step (if any) is settled: the faulty pushes, the step hook,
  // the refusals and the waiting pushes.
  void Answer(PushOutcome* out);
  size_t ModelSize() const;  // the registered model's values

  ParameterStore* const store_;
  const AggregatorOptions options_;
  StepHook hook_;
  FailureHook failure_hook_;
  FaultyHook faulty_hook_;

  // The barrier.
  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(reduction_mu_, stats_mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  int epoch_ ABSL_GUARDED_BY(mu_) = -1;
  int step_ ABSL_GUARDED_BY(mu_) = 0;
  StepQuotas quotas_ ABSL_GUARDED_BY(mu_);
  std::set<int> evicted_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::map<int, PlanRevision>> revisions_ ABSL_GUARDED_BY(mu_);
  std::map<int, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<StepResult> last_ ABSL_GUARDED_BY(mu_);
  std::set<int> last_participants_ ABSL_GUARDED_BY(mu_);  // of last_
  // The reduction's round that the current step's gradients go to, and how many went.
  uint64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t handed_ ABSL_GUARDED_BY(mu_) = 0;
  // Every push of the step is in and the step is being applied, outside this lock: the step
  // does not change until it is done.
  bool completing_ ABSL_GUARDED_BY(mu_) = false;
  GradientScreen screen_ ABSL_GUARDED_BY(mu_);
  // The screen's suspects of the step: pushes whose norm is far above the job's recent
  // ones, held (not summed, not pending) until every push of the step is in, then judged
  // against the other workers' norms at the step: a spike every worker shares (the loss
  // jumped) is summed, one worker's outlier is faulty.
  struct Suspect {
    GradientPush push;
    Pending pending;
    PushNorm norm;
    absl::Status verdict;  // against the history
    BlockSquares blocks;
  };
  std::map<int, Suspect> suspects_ ABSL_GUARDED_BY(mu_);
  std::map<int, PushNorm> step_norms_ ABSL_GUARDED_BY(mu_);  // the step's screened norms

  // The reduction: the step's sum, and each gradient until its turn to be added.
  absl::Mutex reduction_mu_ ABSL_ACQUIRED_AFTER(mu_) ABSL_ACQUIRED_BEFORE(stats_mu_);
  StepReduction reduction_ ABSL_GUARDED_BY(reduction_mu_);
  uint64_t reduction_round_ ABSL_GUARDED_BY(reduction_mu_) = 0;
  int64_t taken_ ABSL_GUARDED_BY(reduction_mu_) = 0;  // gradients handed over this round

  // The statistics.
  mutable absl::Mutex stats_mu_ ABSL_ACQUIRED_AFTER(mu_, reduction_mu_);
  StepStatistics stats_ ABSL_GUARDED_BY(stats_mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_STEP_AGGREGATOR_H_
