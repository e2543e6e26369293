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
      clock_(clock),
      options_(options),
      screen_(options.screen),
      reduction_(store, options.deterministic) {}

void StepAggregator::BeginEpoch(int epoch, StepQuotas quotas) {
  std::vector<Done> orphans;
  {
    absl::MutexLock lock(&mu_);
    // Cannot happen while reports wait for the steps (TrainingJob::CanReport); if it did, the
    // pushes still waiting are answered with an error rather than crashing the server.
    if (!pending_.empty()) {
      LOG(ERROR) << "epoch " << epoch << " begun while step " << step_ << " of epoch " << epoch_
                 << " had " << pending_.size() << " pushes waiting; they are refused";
      TakePendingLocked(&orphans);
      stats_ = StepStats();
    }
    reduction_.Restart();
    losses_.clear();
    BeginEpochLocked(epoch, std::move(quotas));
    // The plans go out now: each worker's first push of the epoch is timed from here.
    if (clock_ != nullptr) {
      released_ = clock_->Now();
      released_epoch_ = epoch;
      released_step_ = -1;
    }
  }
  for (Done& d : orphans) {
    d(absl::FailedPreconditionError("the epoch ended while this push waited for its step"));
  }
}

void StepAggregator::BeginEpochLocked(int epoch, StepQuotas quotas) {
  epoch_ = epoch;
  step_ = 0;
  quotas_ = std::move(quotas);
  samples_ = 0;
  epoch_loss_[epoch];
}

void StepAggregator::TakePendingLocked(std::vector<Done>* to_run) {
  for (auto& [id, p] : pending_) {
    if (!p.done) continue;
    auto refused = refused_.find(id);
    if (refused == refused_.end()) {
      to_run->push_back(std::move(p.done));
    } else {
      to_run->push_back([done = std::move(p.done), why = refused->second.answer](
                            const absl::StatusOr<StepResult>&) { done(why); });
    }
  }
  pending_.clear();
  refused_.clear();
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

absl::Status StepAggregator::TakeGradientLocked(const GradientPush& push, BlockSquares blocks) {
  if (push.num_samples <= 0) return absl::OkStatus();
  return reduction_.Take(push.worker_id, push.num_samples, push.gradient.shared(),
                         std::move(blocks));
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
  TellFaulty(out.faulty, &out.refusals);
  if (out.waiting != 0) return out.waiting;
  if (retry_ticket != 0) {
    if (superseded) {
      superseded(
          absl::AbortedError(absl::StrCat("a retry of worker ", push.worker_id, "'s push of step ",
                                          push.step, " took this call's place")));
    }
    return retry_ticket;
  }
  if (out.completed) AfterStep(out.stats, &out.result);
  TellFaulty(out.changed, &out.refusals);
  for (Done& d : out.to_run) d(out.result);
  return 0;
}

StepAggregator::Pending* StepAggregator::PendingOfLocked(int worker) {
  if (auto p = pending_.find(worker); p != pending_.end()) return &p->second;
  if (auto s = suspects_.find(worker); s != suspects_.end()) return &s->second.pending;
  return nullptr;
}

absl::Status StepAggregator::ScreenLocked(const GradientPush& push, const CheckedGradient& checked,
                                          std::vector<FaultyPush>* faulty) const {
  if (push.num_samples <= 0 || options_.screen.mode == FaultyGradients::kOff) {
    return absl::OkStatus();
  }
  if (checked.bad_values && options_.screen.mode == FaultyGradients::kEvict) {
    // A value no GPU computes: its worker is removed as a dead one is.
    faulty->push_back(FaultyPush{push.worker_id, push.epoch, push.step, checked.status, true});
    return Quarantined(push.worker_id, push.epoch, push.step, checked.status);
  }
  return absl::OkStatus();
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
  if (valid.ok() && suspicion.ok()) valid = TakeGradientLocked(push, std::move(checked.blocks));
  if (!valid.ok()) {
    out->result = valid;
    out->to_run.push_back(std::move(done));
    return;
  }
  uint64_t mine = 0;
  if (!suspicion.ok()) {
    suspects_[push.worker_id] = Suspect{push, Pending{std::move(done), ++last_ticket_}, norm,
                                        suspicion, std::move(checked.blocks)};
    mine = last_ticket_;
  } else {
    // A push summed (a log-only outlier too) is part of what the job's gradients have been.
    if (screened) screen_.Accepted(norm);
    AcceptLocked(push, std::move(done));
    mine = last_ticket_;
    ReduceReadyLocked();
  }
  if (screened) step_norms_[push.worker_id] = norm;
  ResolveSuspectsLocked(&out->faulty, &out->refusals);
  if (!pending_.empty() && pending_.size() == quotas_[step_].size()) {
    out->stats = TakeStepStatsLocked();
    out->completed = true;
    CompleteStepLocked(&out->to_run, &out->result, &out->changed);
    return;
  }
  out->waiting = mine;
}

absl::Status StepAggregator::Quarantined(int worker, int epoch, int step, const absl::Status& why) {
  return absl::AbortedError(absl::StrCat(
      "worker ", worker, " is quarantined: its gradient of epoch ", epoch + 1, " step ", step + 1,
      " is faulty (", why.message(), "); the job goes on without it"));
}

void StepAggregator::ResolveSuspectsLocked(std::vector<FaultyPush>* faulty, Refusals* refusals) {
  if (suspects_.empty() || step_ >= static_cast<int>(quotas_.size()) ||
      pending_.size() + suspects_.size() < quotas_[step_].size()) {
    return;
  }
  const bool evict = options_.screen.mode == FaultyGradients::kEvict;
  for (auto& [id, s] : suspects_) {
    std::vector<PushNorm> others;
    for (const auto& [w, n] : step_norms_) {
      if (w != id) others.push_back(n);
    }
    // Alone at its step, the job's history is all there is to judge it by.
    absl::Status verdict = s.verdict;
    if (!others.empty()) {
      verdict = JudgeNorm(s.norm, others, options_.screen.norm_ratio,
                          absl::StrCat("the other ", others.size(), " workers' at this step"));
      if (!verdict.ok()) {
        verdict = absl::InvalidArgumentError(absl::StrCat(
            verdict.message(), "; against the job's recent pushes: ", s.verdict.message()));
      }
    }
    if (verdict.ok() || !evict) {
      if (!verdict.ok()) faulty->push_back(FaultyPush{id, epoch_, step_, verdict, false});
      const uint64_t ticket = s.pending.ticket;
      AcceptLocked(s.push, std::move(s.pending.done));
      pending_[id].ticket = ticket;
      screen_.Accepted(s.norm);
      const absl::Status taken = TakeGradientLocked(s.push, std::move(s.blocks));
      if (!taken.ok()) LOG(ERROR) << "worker " << id << "'s held push: " << taken;
    } else {
      faulty->push_back(FaultyPush{id, epoch_, step_, verdict, true});
      step_norms_.erase(id);
      refusals->emplace_back(std::move(s.pending.done), Quarantined(id, epoch_, step_, verdict));
    }
  }
  suspects_.clear();
  ReduceReadyLocked();
}

void StepAggregator::TellFaulty(const std::vector<FaultyPush>& faulty, Refusals* refusals) {
  for (const FaultyPush& f : faulty) {
    LOG(WARNING) << "worker " << f.worker_id << "'s gradient of epoch " << f.epoch + 1 << " step "
                 << f.step + 1 << " is faulty: " << f.why.message()
                 << (f.counted      ? "; summed only up to there, the worker is quarantined"
                     : f.quarantine ? "; not summed, the worker is quarantined"
                                    : "; summed (--faulty_gradients=log)");
    if (faulty_hook_) faulty_hook_(f);
  }
  for (auto& [done, why] : *refusals) {
    if (done) done(why);
  }
  refusals->clear();
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
  MarkReleased(stats.epoch, stats.step);
}

void StepAggregator::AcceptLocked(const GradientPush& push, Done done) {
  samples_ += push.num_samples;
  losses_[push.worker_id] = push.loss_sum;
  ++accepted_pushes_;
  pending_[push.worker_id] = Pending{std::move(done), ++last_ticket_};
  accepted_[epoch_].insert({push.worker_id, step_});
  stats_.workers[push.worker_id] = {push.num_samples, push.compute_seconds};
  if (clock_ != nullptr && released_epoch_ == epoch_ && released_step_ == step_ - 1) {
    const double cycle = absl::ToDoubleSeconds(clock_->Now() - released_);
    stats_.cycle[push.worker_id] = cycle;
  }
}

StepStats StepAggregator::TakeStepStatsLocked() {
  StepStats stats;
  stats.epoch = epoch_;
  stats.step = step_;
  stats.workers = std::move(stats_.workers);
  stats_.workers.clear();
  stats.cycle = std::move(stats_.cycle);
  stats_.cycle.clear();
  stats.last_of_epoch = step_ + 1 >= static_cast<int>(quotas_.size());
  return stats;
}

void StepAggregator::MarkReleased(int epoch, int step) {
  if (clock_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  released_ = clock_->Now();
  released_epoch_ = epoch;
  released_step_ = step;
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

void StepAggregator::ReduceReadyLocked() {
  if (step_ >= static_cast<int>(quotas_.size())) return;
  for (auto& [id, added] : reduction_.ReduceReady(quotas_[step_])) {
    // A push checked before the lock whose values then changed (its sender's shared memory):
    // the step completes with every other worker's values, and the push is refused when it
    // does; under kEvict its worker is quarantined from the next step on.
    const absl::Status why = absl::InvalidArgumentError(absl::StrCat(
        "the gradient in shared memory changed after it was checked: ", added.message()));
    const bool evict = options_.screen.mode == FaultyGradients::kEvict;
    if (!evict) {
      LOG(WARNING) << "worker " << id << "'s push of epoch " << epoch_ + 1 << " step " << step_ + 1
                   << " is refused: " << why.message();
    }
    refused_.emplace(id, Refused{evict ? Quarantined(id, epoch_, step_, why) : why, why, evict});
  }
}

bool StepAggregator::MeanScalesLocked(std::vector<GradientScale>* scales) {
  // The step's workers' samples (each push's samples are its quota; once the step completes,
  // they are the samples pushed).
  int64_t samples = 0;
  for (const auto& [id, q] : quotas_[step_]) samples += q;
  if (samples == 0) return false;
  scales->push_back({ModelSize(), 1.0f / static_cast<float>(samples)});
  return true;
}

size_t StepAggregator::ModelSize() const { return static_cast<size_t>(store_->num_elements()); }

void StepAggregator::CompleteStepLocked(std::vector<Done>* to_run,
                                        absl::StatusOr<StepResult>* result,
                                        std::vector<FaultyPush>* changed) {
  // Every worker of the step has pushed (or was evicted): apply the sample-weighted mean.
  ReduceReadyLocked();
  double loss_sum = 0.0;
  for (const auto& [id, loss] : losses_) loss_sum += loss;  // in worker order: repeatable
  StepResult r;
  r.epoch = epoch_;
  r.step = step_;
  r.global_samples = samples_;
  r.global_loss = samples_ > 0 ? loss_sum / samples_ : 0.0;
  r.revisions = std::move(revisions_);
  revisions_.reset();
  // The mean and the update in one pass, which leaves the sum cleared for the next step.
  std::vector<GradientScale> scales;
  const bool update = MeanScalesLocked(&scales);
  absl::StatusOr<ParameterSnapshot> snap;
  if (!update) {
    snap = store_->Snapshot();
  } else {
    absl::StatusOr<absl::Span<float>> sum = reduction_.TakeSum();
    snap = sum.ok() ? store_->ApplyGradient(*sum, scales) : sum.status();
  }
  if (snap.ok()) {
    r.parameters = *snap;
    *result = r;
    EpochLoss& el = epoch_loss_[epoch_];
    el.loss_sum += loss_sum;
    el.samples += samples_;
    el.steps_completed += 1;
    last_ = r;
    last_participants_.clear();
    for (const auto& [id, unused] : pending_) {
      if (refused_.count(id) == 0) last_participants_[id] = 1;
    }
  } else {
    *result = snap.status();
  }
  for (const auto& [id, r] : refused_) {
    if (r.quarantine) changed->push_back(FaultyPush{id, epoch_, step_, r.why, true, true});
  }
  TakePendingLocked(to_run);
  reduction_.Restart();  // without an update nothing was summed: the buffer stays reserved
  losses_.clear();
  samples_ = 0;
  ++step_;
}

bool StepAggregator::Evict(int epoch, int step, const std::set<int>& dead) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok() || epoch != epoch_ || step != step_ ||
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
  std::vector<FaultyPush> faulty, changed;
  Refusals refusals;
  std::vector<Done> to_run;
  absl::StatusOr<StepResult> result;
  bool completed = false;
  {
    absl::MutexLock lock(&mu_);
    // An evicted worker had not pushed the step (Evict): nothing of it was summed.
    for (int id : evicted_) quotas_[step_].erase(id);
    quotas_.resize(static_cast<size_t>(step_) + 1);
    for (auto& q : change.later_quotas) quotas_.push_back(std::move(q));
    revisions_ = std::make_shared<const std::map<int, PlanRevision>>(std::move(change.revisions));
    ReduceReadyLocked();  // an evicted worker may have been the one the sum waited for
    ResolveSuspectsLocked(&faulty, &refusals);
    if (pending_.size() >= quotas_[step_].size()) {  // else the survivors are still pushing
      CompleteStepLocked(&to_run, &result, &changed);
      completed = true;
    }
  }
  TellFaulty(faulty, &refusals);
  if (!completed) return;
  TellFaulty(changed, &refusals);
  for (Done& d : to_run) d(result);
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
  absl::MutexLock lock(&mu_);
  auto it = accepted_.find(epoch);
  return it == accepted_.end() ? std::set<std::pair<int, int>>{} : it->second;
}

void StepAggregator::Abort(const absl::Status& status) {
  std::vector<Done> to_run;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = status;
    TakePendingLocked(&to_run);
    reduction_.Restart();
    losses_.clear();
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
  p.accepted_pushes = accepted_pushes_;
  p.pushed = static_cast<int>(pending_.size());
  if (step_ < p.num_steps) {
    for (const auto& [id, quota] : quotas_[step_]) {
      if (pending_.count(id) == 0) p.waiting_for.push_back(id);
    }
  }
  return p;
}

StepAggregator::State StepAggregator::SaveState() const {
  absl::MutexLock lock(&mu_);
  State s;
  s.epoch = epoch_;
  s.step = step_;
  s.losses = epoch_loss_;
  auto it = accepted_.find(epoch_);
  if (it != accepted_.end()) s.accepted = it->second;
  s.store = store_->SaveState();  // under our lock: no step can complete meanwhile
  return s;
}

void StepAggregator::LoadState(const State& s, StepQuotas quotas) {
  absl::MutexLock lock(&mu_);
  epoch_ = s.epoch;
  step_ = s.step;
  quotas_ = std::move(quotas);
  epoch_loss_ = s.losses;
  accepted_.clear();
  accepted_[s.epoch] = s.accepted;
  pending_.clear();
  reduction_.Reset();  // the store's LoadState dropped its reservation
  losses_.clear();
  samples_ = 0;
  last_.reset();
  evicted_.clear();
}

EpochLoss StepAggregator::LossOf(int epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = epoch_loss_.find(epoch);
  return it == epoch_loss_.end() ? EpochLoss{} : it->second;
}

}  // namespace dbs
