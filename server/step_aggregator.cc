#include "server/step_aggregator.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

StepAggregator::StepAggregator(ParameterStore* store, const Clock* clock, AggregatorOptions options)
    : store_(store),
      options_(options),
      screen_(options.screen),
      reduction_(store, options.deterministic),
      stats_(clock) {}

void StepAggregator::AwaitNotCompletingLocked() const {
  mu_.Await(absl::Condition(
      +[](const bool* completing) { return !*completing; }, &completing_));
}

void StepAggregator::RestartReductionLocked(bool drop_buffer) {
  ++round_;
  handed_ = 0;
  absl::MutexLock lock(&reduction_mu_);
  if (drop_buffer) {
    reduction_.Reset();
  } else {
    reduction_.Restart();
  }
  reduction_round_ = round_;
  taken_ = 0;
}

void StepAggregator::BeginEpoch(int epoch, StepQuotas quotas) {
  std::vector<Done> orphans;
  {
    absl::MutexLock lock(&mu_);
    AwaitNotCompletingLocked();
    // Cannot happen while reports wait for the steps (TrainingJob::CanReport); if it did, the
    // pushes still waiting are answered with an error rather than crashing the server.
    if (!pending_.empty()) {
      LOG(ERROR) << "epoch " << epoch << " begun while step " << step_ << " of epoch " << epoch_
                 << " had " << pending_.size() << " pushes waiting; they are refused";
      TakePendingLocked(&orphans);
    }
    RestartReductionLocked();
    epoch_ = epoch;
    step_ = 0;
    quotas_ = std::move(quotas);
    // The plans go out now: each worker's first push of the epoch is timed from here.
    absl::MutexLock stats(&stats_mu_);
    stats_.BeginEpoch(epoch);
  }
  for (Done& d : orphans) {
    d(absl::FailedPreconditionError("the epoch ended while this push waited for its step"));
  }
}

void StepAggregator::TakePendingLocked(std::vector<Done>* to_run,
                                       const std::map<int, absl::Status>& refused) {
  for (auto& [id, p] : pending_) {
    if (!p.done) continue;
    auto why = refused.find(id);
    if (why == refused.end()) {
      to_run->push_back(std::move(p.done));
    } else {
      to_run->push_back([done = std::move(p.done), answer = why->second](
                            const absl::StatusOr<StepResult>&) { done(answer); });
    }
  }
  pending_.clear();
  for (auto& [id, s] : suspects_) {
    if (s.pending.done) to_run->push_back(std::move(s.pending.done));
  }
  suspects_.clear();
  step_norms_.clear();
}

bool StepAggregator::IsRetryLocked(const GradientPush& push) const {
  if (!aborted_.ok()) return false;
  if (last_.has_value() && push.epoch == last_->epoch && push.step == last_->step &&
      last_participants_.count(push.worker_id) > 0) {
    return true;
  }
  return push.epoch == epoch_ && push.step == step_ && pending_.count(push.worker_id) > 0;
}

absl::Status StepAggregator::Precheck(const GradientPush& header) const {
  absl::MutexLock lock(&mu_);
  if (IsRetryLocked(header)) return absl::OkStatus();
  return ValidateHeader(header);
}

absl::Status StepAggregator::Validate(const GradientPush& push) const {
  DBS_RETURN_IF_ERROR(ValidateHeader(push));
  if (push.num_samples > 0 && !store_->registered()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return absl::OkStatus();
}

void StepAggregator::CheckGradient(const GradientPush& push, CheckedGradient* checked) const {
  if (push.num_samples <= 0) return;  // nothing of it is summed
  if (push.gradient == nullptr) {
    checked->status = absl::InvalidArgumentError(
        absl::StrCat("a push of ", push.num_samples, " samples carries no gradient"));
    return;
  }
  const size_t model = static_cast<size_t>(store_->num_elements());
  if (absl::Status count = push.gradient.get()->CheckCount(model); !count.ok()) {
    checked->status =
        absl::InvalidArgumentError(absl::StrCat("gradient rejected: ", count.message()));
    return;
  }
  checked->status = CheckAndSum(
      push.worker_id, 0, *push.gradient, nullptr, 0.0f, /*check=*/true, &checked->sum_squares,
      push.gradient.get()->writable_by_sender ? &checked->blocks : nullptr);
  checked->bad_values = !checked->status.ok();
}

absl::Status StepAggregator::ValidateHeader(const GradientPush& push) const {
  if (!aborted_.ok()) return aborted_;
  const int num_steps = static_cast<int>(quotas_.size());
  if (evicted_.count(push.worker_id) > 0) {
    return absl::NotFoundError(absl::StrCat("worker ", push.worker_id,
                                            " was declared dead after missing a step deadline; "
                                            "its samples went to the other workers"));
  }
  const std::map<int, int>* step_quota =
      step_ < num_steps ? &quotas_[step_] : (quotas_.empty() ? nullptr : &quotas_.back());
  if (step_quota == nullptr || step_quota->count(push.worker_id) == 0) {
    return absl::NotFoundError(absl::StrCat("worker ", push.worker_id, " is not part of epoch ",
                                            epoch_, "; register with the scheduler first"));
  }
  if (push.epoch != epoch_ || push.step != step_ || step_ >= num_steps) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push for epoch ", push.epoch, " step ", push.step, " does not match the current step (",
        step_ >= num_steps ? absl::StrCat("epoch ", epoch_, " has ended")
                           : absl::StrCat("epoch ", epoch_, " step ", step_),
        ")"));
  }
  const int want = step_quota->at(push.worker_id);
  if (push.num_samples != want) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", push.worker_id, " pushed ",
                                                   push.num_samples, " samples at step ", step_,
                                                   "; its plan says ", want));
  }
  return absl::OkStatus();
}

uint64_t StepAggregator::Push(const GradientPush& push, Done done) {
  // The values are checked before the lock, so pushes arriving together check in parallel. A
  // retry's gradient is not used (the first push's was counted), whatever it holds.
  CheckedGradient checked;
  CheckGradient(push, &checked);
  PushOutcome out;
  Done superseded;
  uint64_t retry_ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    Pending* earlier = aborted_.ok() && push.epoch == epoch_ && push.step == step_
                           ? PendingOfLocked(push.worker_id)
                           : nullptr;
    if (last_.has_value() && push.epoch == last_->epoch && push.step == last_->step &&
        last_participants_.count(push.worker_id) > 0 && aborted_.ok()) {
      // A retry of the step that just completed: answer with its result.
      out.result = *last_;
      out.to_run.push_back(std::move(done));
    } else if (earlier != nullptr) {
      // A retry of a pending push: it waits for the same result in the earlier call's place;
      // the gradient is not added again.
      superseded = std::move(earlier->done);
      earlier->done = std::move(done);
      earlier->ticket = retry_ticket = ++last_ticket_;
    } else {
      TakeNewPushLocked(push, std::move(checked), std::move(done), &out);
    }
  }
  if (retry_ticket != 0) {
    if (superseded) {
      superseded(
          absl::AbortedError(absl::StrCat("a retry of worker ", push.worker_id, "'s push of step ",
                                          push.step, " took this call's place")));
    }
    return retry_ticket;
  }
  Settle(&out);
  const uint64_t waiting = out.waiting;
  Answer(&out);
  return waiting;
}

void StepAggregator::Answer(PushOutcome* out) {
  TellFaulty(out->faulty, &out->refusals);
  if (out->completion.has_value()) AfterStep(out->stats, &out->result);
  TellFaulty(out->changed, &out->refusals);
  for (Done& d : out->to_run) d(out->result);
}

StepAggregator::Pending* StepAggregator::PendingOfLocked(int worker) {
  if (auto p = pending_.find(worker); p != pending_.end()) return &p->second;
  if (auto s = suspects_.find(worker); s != suspects_.end()) return &s->second.pending;
  return nullptr;
}

void StepAggregator::TakeNewPushLocked(const GradientPush& push, CheckedGradient checked, Done done,
                                       PushOutcome* out) {
  const bool screened = push.num_samples > 0 && options_.screen.mode != FaultyGradients::kOff;
  const PushNorm norm{std::sqrt(checked.sum_squares), push.num_samples};
  absl::Status valid = Validate(push);
  if (valid.ok()) valid = ScreenLocked(push, checked, &out->faulty);
  // A norm far above the job's recent ones: held until the step's other pushes tell a spike
  // they share from this one's outlier.
  const absl::Status suspicion =
      valid.ok() && screened && checked.status.ok() ? screen_.Judge(norm) : absl::OkStatus();
  if (valid.ok()) valid = checked.status;
  if (!valid.ok()) {
    out->result = valid;
    out->to_run.push_back(std::move(done));
    return;
  }
  const uint64_t mine = ++last_ticket_;
  if (!suspicion.ok()) {
    suspects_[push.worker_id] =
        Suspect{push, Pending{std::move(done), mine}, norm, suspicion, std::move(checked.blocks)};
  } else {
    // A push summed (a log-only outlier too) is part of what the job's gradients have been.
    if (screened) screen_.Accepted(norm);
    AcceptLocked(push, Pending{std::move(done), mine}, std::move(checked.blocks), out);
  }
  if (screened) step_norms_[push.worker_id] = norm;
  ResolveSuspectsLocked(out);
  if (!pending_.empty() && pending_.size() == quotas_[step_].size()) {
    BeginCompletionLocked(out);
    return;
  }
  out->waiting = mine;
}

void StepAggregator::AfterStep(const StepStats& stats, absl::StatusOr<StepResult>* result) {
  if (!result->ok()) {
    if (failure_hook_) failure_hook_(result->status());
    return;
  }
  // Nobody can push the next step before these answers go out, so a re-plan made here is in
  // place for it.
  if (hook_) {
    std::optional<PlanChange> replan = hook_(stats);
    if (replan.has_value() && !stats.last_of_epoch) {
      auto revisions =
          std::make_shared<const std::map<int, PlanRevision>>(std::move(replan->revisions));
      absl::MutexLock lock(&mu_);
      quotas_.resize(static_cast<size_t>(step_));
      for (auto& q : replan->later_quotas) quotas_.push_back(std::move(q));
      (*result)->revisions = revisions;
      if (last_.has_value()) last_->revisions = revisions;
    }
  }
  // The answers go out now: each worker's next push measures its cycle from here (the hook's
  // checkpoints and re-plans above are the server's time, not the workers').
  absl::MutexLock lock(&stats_mu_);
  stats_.Released(stats.epoch, stats.step);
}

void StepAggregator::AcceptLocked(const GradientPush& push, Pending pending, BlockSquares blocks,
                                  PushOutcome* out) {
  pending_[push.worker_id] = std::move(pending);
  if (push.num_samples > 0) {
    out->handoffs.push_back(Handoff{round_, push.worker_id, push.num_samples,
                                    push.gradient.shared(), std::move(blocks)});
    out->quota = quotas_[step_];
    ++handed_;
  }
  absl::MutexLock lock(&stats_mu_);
  stats_.Accepted(push.worker_id, epoch_, step_, push.num_samples, push.loss_sum,
                  push.compute_seconds);
}

bool StepAggregator::CancelWait(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, p] : pending_) {
    if (p.ticket == ticket && p.done) {
      p.done = nullptr;
      return true;
    }
  }
  for (auto& [id, s] : suspects_) {
    if (s.pending.ticket == ticket && s.pending.done) {
      s.pending.done = nullptr;
      return true;
    }
  }
  return false;
}

size_t StepAggregator::ModelSize() const { return static_cast<size_t>(store_->num_elements()); }

void StepAggregator::BeginCompletionLocked(PushOutcome* out) {
  completing_ = true;
  Completion c;
  c.round = round_;
  c.gradients = handed_;
  c.quota = quotas_[step_];
  c.last_of_epoch = step_ + 1 >= static_cast<int>(quotas_.size());
  // The step's workers' samples (each push's samples are its quota; once the step completes,
  // they are the samples pushed): the sum over them is the step's sample-weighted mean.
  int64_t samples = 0;
  for (const auto& [id, q] : c.quota) samples += q;
  if (samples > 0) c.scales.push_back({ModelSize(), 1.0f / static_cast<float>(samples)});
  out->completion = std::move(c);
}

void StepAggregator::Settle(PushOutcome* out) {
  if (!out->handoffs.empty()) {
    absl::MutexLock lock(&reduction_mu_);
    for (Handoff& h : out->handoffs) {
      if (h.round != reduction_round_) continue;  // the step was abandoned meanwhile
      if (!reduction_.has_quota()) reduction_.SetQuota(out->quota);
      const absl::Status taken =
          reduction_.Take(h.worker, h.samples, std::move(h.gradient), std::move(h.blocks));
      if (!taken.ok()) LOG(ERROR) << "worker " << h.worker << "'s push: " << taken;
      ++taken_;
    }
    reduction_.ReduceReady();
  }
  if (!out->completion.has_value()) return;
  std::map<int, absl::Status> changed;
  absl::StatusOr<ParameterSnapshot> snap = ApplyStep(*out->completion, &changed);
  absl::MutexLock lock(&mu_);
  FinishStepLocked(*out->completion, std::move(snap), std::move(changed), out);
}

absl::StatusOr<ParameterSnapshot> StepAggregator::ApplyStep(const Completion& c,
                                                            std::map<int, absl::Status>* changed) {
  absl::MutexLock lock(&reduction_mu_);
  // Another push of the step may still be handing its gradient over.
  auto all_taken = [this, &c]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reduction_mu_) {
    return reduction_round_ != c.round || taken_ >= c.gradients;
  };
  reduction_mu_.Await(absl::Condition(&all_taken));
  if (reduction_round_ != c.round) return absl::AbortedError("the step was abandoned");
  // An eviction may have shrunk the step since its gradients' quota was set.
  reduction_.SetQuota(c.quota);
  reduction_.ReduceReady();
  *changed = reduction_.TakeChanged();
  absl::StatusOr<ParameterSnapshot> snap;
  if (c.scales.empty()) {
    snap = store_->Snapshot();
  } else {
    // The mean and the update in one pass, which leaves the sum cleared for the next step.
    absl::StatusOr<absl::Span<float>> sum = reduction_.TakeSum();
    snap = sum.ok() ? store_->ApplyGradient(*sum, c.scales) : sum.status();
  }
  reduction_.Restart();  // without an update nothing was summed: the buffer stays reserved
  reduction_round_ = c.round + 1;
  taken_ = 0;
  return snap;
}

void StepAggregator::FinishStepLocked(const Completion& c, absl::StatusOr<ParameterSnapshot> snap,
                                      std::map<int, absl::Status> changed, PushOutcome* out) {
  ++round_;  // the reduction's, which ApplyStep began
  handed_ = 0;
  completing_ = false;
  // A push checked on arrival whose values then changed (its sender's shared memory): the step
  // completed with every other worker's values, and the push is refused now; under kEvict its
  // worker is quarantined from the next step on.
  const bool evict = options_.screen.mode == FaultyGradients::kEvict;
  std::map<int, absl::Status> refused;
  for (const auto& [id, added] : changed) {
    const absl::Status why = absl::InvalidArgumentError(absl::StrCat(
        "the gradient in shared memory changed after it was checked: ", added.message()));
    if (evict) {
      refused[id] = Quarantined(id, epoch_, step_, why);
      out->changed.push_back(FaultyPush{id, epoch_, step_, why, true, true});
    } else {
      LOG(WARNING) << "worker " << id << "'s push of epoch " << epoch_ + 1 << " step " << step_ + 1
                   << " is refused: " << why.message();
      refused[id] = why;
    }
  }
  {
    absl::MutexLock lock(&stats_mu_);
    out->stats = stats_.EndStep(epoch_, step_, c.last_of_epoch, snap.ok());
  }
  if (snap.ok()) {
    StepResult r;
    r.epoch = epoch_;
    r.step = step_;
    r.global_samples = out->stats.samples;
    r.global_loss = r.global_samples > 0 ? out->stats.loss_sum / r.global_samples : 0.0;
    r.revisions = std::move(revisions_);
    r.parameters = *std::move(snap);
    out->result = r;
    last_ = std::move(r);
    last_participants_.clear();
    for (const auto& [id, unused] : pending_) {
      if (refused.count(id) == 0) last_participants_.insert(id);
    }
  } else {
    out->result = snap.status();
  }
  revisions_.reset();
  TakePendingLocked(&out->to_run, refused);
  ++step_;
}

bool StepAggregator::Evict(int epoch, int step, const std::set<int>& dead) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok() || completing_ || epoch != epoch_ || step != step_ ||
      step_ >= static_cast<int>(quotas_.size()) || dead.empty()) {
    return false;
  }
  for (int id : dead) {
    if (pending_.count(id) > 0 || quotas_[step_].count(id) == 0) return false;
  }
  evicted_.insert(dead.begin(), dead.end());
  return true;
}

void StepAggregator::CompleteEviction(PlanChange change) {
  PushOutcome out;
  {
    absl::MutexLock lock(&mu_);
    if (completing_ || step_ >= static_cast<int>(quotas_.size())) {
      LOG(ERROR) << "an eviction's re-plan arrived with no step to complete; ignored";
      return;
    }
    // An evicted worker had not pushed the step (Evict): nothing of it was summed.
    for (int id : evicted_) quotas_[step_].erase(id);
    quotas_.resize(static_cast<size_t>(step_) + 1);
    for (auto& q : change.later_quotas) quotas_.push_back(std::move(q));
    revisions_ = std::make_shared<const std::map<int, PlanRevision>>(std::move(change.revisions));
    {
      // An evicted worker may have been the one the sum waited for.
      absl::MutexLock reduction(&reduction_mu_);
      if (reduction_.has_quota()) reduction_.SetQuota(quotas_[step_]);
    }
    out.quota = quotas_[step_];
    ResolveSuspectsLocked(&out);
    // Otherwise the survivors are still pushing.
    if (pending_.size() >= quotas_[step_].size()) BeginCompletionLocked(&out);
  }
  Settle(&out);
  Answer(&out);
}

bool StepAggregator::ReviseFrom(int epoch, int step, StepQuotas later_quotas) {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || step < 0 || step_ < step || step_ > step + 1 ||
      step >= static_cast<int>(quotas_.size())) {
    return false;
  }
  if (step_ == step + 1 && !pending_.empty()) return false;  // the next step has begun
  quotas_.resize(static_cast<size_t>(step) + 1);
  for (auto& q : later_quotas) quotas_.push_back(std::move(q));
  return true;
}

std::set<std::pair<int, int>> StepAggregator::AcceptedPushes(int epoch) const {
  absl::MutexLock lock(&stats_mu_);
  return stats_.AcceptedPushes(epoch);
}

void StepAggregator::Abort(const absl::Status& status) {
  std::vector<Done> to_run;
  {
    absl::MutexLock lock(&mu_);
    AwaitNotCompletingLocked();
    if (aborted_.ok()) aborted_ = status;
    TakePendingLocked(&to_run);
    RestartReductionLocked();
    absl::MutexLock stats(&stats_mu_);
    stats_.DropStep();
  }
  for (Done& d : to_run) d(status);
}

std::map<int, int> StepAggregator::Quota(int epoch, int step) const {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || step < 0 || step >= static_cast<int>(quotas_.size())) return {};
  return quotas_[step];
}

StepProgress StepAggregator::Progress() const {
  absl::MutexLock lock(&mu_);
  StepProgress p;
  p.epoch = epoch_;
  p.step = step_;
  p.num_steps = static_cast<int>(quotas_.size());
  p.pushed = static_cast<int>(pending_.size());
  if (step_ < p.num_steps) {
    for (const auto& [id, quota] : quotas_[step_]) {
      if (pending_.count(id) == 0) p.waiting_for.push_back(id);
    }
  }
  absl::MutexLock stats(&stats_mu_);
  p.accepted_pushes = stats_.accepted_pushes();
  return p;
}

StepAggregator::State StepAggregator::SaveState() const {
  absl::MutexLock lock(&mu_);
  // A step being applied is taken whole: the position and the values always agree.
  AwaitNotCompletingLocked();
  State s;
  s.epoch = epoch_;
  s.step = step_;
  {
    absl::MutexLock stats(&stats_mu_);
    s.losses = stats_.losses();
    s.accepted = stats_.AcceptedPushes(epoch_);
  }
  s.store = store_->SaveState();  // under the barrier's lock: no step can complete meanwhile
  return s;
}

void StepAggregator::LoadState(const State& s, StepQuotas quotas) {
  absl::MutexLock lock(&mu_);
  AwaitNotCompletingLocked();
  epoch_ = s.epoch;
  step_ = s.step;
  quotas_ = std::move(quotas);
  pending_.clear();
  last_.reset();
  evicted_.clear();
  RestartReductionLocked(/*drop_buffer=*/true);  // the store's LoadState dropped its reservation
  absl::MutexLock stats(&stats_mu_);
  stats_.Restore(s.epoch, s.losses, s.accepted);
}

EpochLoss StepAggregator::LossOf(int epoch) const {
  absl::MutexLock lock(&stats_mu_);
  return stats_.LossOf(epoch);
}

}  // namespace dbs
