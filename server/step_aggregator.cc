#include "server/step_aggregator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace dbs {

StepAggregator::StepAggregator(ParameterStore* store) : store_(store) {}

void StepAggregator::BeginEpoch(int epoch, int num_steps, std::map<int, StepQuota> quotas) {
  absl::MutexLock lock(&mu_);
  CHECK(pending_.empty()) << "epoch " << epoch << " begun while step " << step_ << " is pending";
  epoch_ = epoch;
  num_steps_ = num_steps;
  step_ = 0;
  quotas_ = std::move(quotas);
  loss_sum_ = 0.0;
  samples_ = 0;
  epoch_loss_[epoch];
}

absl::Status StepAggregator::Validate(const GradientPush& push) const {
  if (!aborted_.ok()) return aborted_;
  auto quota = quotas_.find(push.worker_id);
  if (quota == quotas_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", push.worker_id,
                                            " is not part of epoch ", epoch_,
                                            "; register with the scheduler first"));
  }
  if (push.epoch != epoch_ || push.step != step_ || step_ >= num_steps_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push for epoch ", push.epoch, " step ", push.step, " does not match the current step (",
        step_ >= num_steps_ ? absl::StrCat("epoch ", epoch_, " has ended")
                            : absl::StrCat("epoch ", epoch_, " step ", step_),
        ")"));
  }
  const int want = step_ == num_steps_ - 1 ? quota->second.final_batch_size
                                           : quota->second.batch_size;
  if (push.num_samples != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", push.worker_id, " pushed ", push.num_samples,
                     " samples at step ", step_, "; its plan says ", want));
  }
  const size_t model = sum_.size();
  if (push.num_samples > 0 && push.gradient.size() != model) {
    return absl::InvalidArgumentError(absl::StrCat("gradient holds ", push.gradient.size(),
                                                   " floats; the model has ", model));
  }
  return absl::OkStatus();
}

void StepAggregator::Push(const GradientPush& push, Done done) {
  std::vector<Done> to_run;
  absl::StatusOr<StepResult> result;
  {
    absl::MutexLock lock(&mu_);
    // A retry of the step that just completed: answer with its result.
    if (last_.has_value() && push.epoch == last_->epoch && push.step == last_->step &&
        last_participants_.count(push.worker_id) > 0 && aborted_.ok()) {
      result = *last_;
      to_run.push_back(std::move(done));
    } else if (aborted_.ok() && push.epoch == epoch_ && push.step == step_ &&
               pending_.count(push.worker_id) > 0) {
      // A retry of a pending push: wait for the same result; the gradient is not added again.
      pending_[push.worker_id].callbacks.push_back(std::move(done));
      return;
    } else {
      if (sum_.empty()) sum_.assign(static_cast<size_t>(store_->num_elements()), 0.0f);
      absl::Status valid = Validate(push);
      if (!valid.ok()) {
        result = valid;
        to_run.push_back(std::move(done));
      } else {
        if (push.num_samples > 0) {
          const float w = static_cast<float>(push.num_samples);
          for (size_t i = 0; i < sum_.size(); ++i) sum_[i] += w * push.gradient[i];
        }
        loss_sum_ += push.loss_sum;
        samples_ += push.num_samples;
        ++accepted_pushes_;
        pending_[push.worker_id].callbacks.push_back(std::move(done));
        if (pending_.size() < quotas_.size()) return;

        // Every worker of the step has pushed: apply the sample-weighted mean.
        StepResult r;
        r.epoch = epoch_;
        r.step = step_;
        r.global_samples = samples_;
        r.global_loss = samples_ > 0 ? loss_sum_ / samples_ : 0.0;
        absl::StatusOr<ParameterSnapshot> snap;
        if (samples_ > 0) {
          mean_.resize(sum_.size());
          const float inv = 1.0f / static_cast<float>(samples_);
          for (size_t i = 0; i < sum_.size(); ++i) mean_[i] = sum_[i] * inv;
          snap = store_->ApplyGradient(mean_);
        } else {
          snap = store_->Snapshot();
        }
        if (snap.ok()) {
          r.parameters = *snap;
          result = r;
          EpochLoss& el = epoch_loss_[epoch_];
          el.loss_sum += loss_sum_;
          el.samples += samples_;
          el.steps_completed += 1;
          last_ = r;
          last_participants_.clear();
          for (const auto& [id, unused] : quotas_) last_participants_[id] = 1;
        } else {
          result = snap.status();
        }
        for (auto& [id, p] : pending_) {
          for (Done& d : p.callbacks) to_run.push_back(std::move(d));
        }
        pending_.clear();
        std::fill(sum_.begin(), sum_.end(), 0.0f);
        loss_sum_ = 0.0;
        samples_ = 0;
        ++step_;
      }
    }
  }
  for (Done& d : to_run) d(result);
}

void StepAggregator::Abort(const absl::Status& status) {
  std::vector<Done> to_run;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = status;
    for (auto& [id, p] : pending_) {
      for (Done& d : p.callbacks) to_run.push_back(std::move(d));
    }
    pending_.clear();
  }
  for (Done& d : to_run) d(status);
}

StepProgress StepAggregator::Progress() const {
  absl::MutexLock lock(&mu_);
  StepProgress p;
  p.epoch = epoch_;
  p.step = step_;
  p.num_steps = num_steps_;
  p.accepted_pushes = accepted_pushes_;
  if (step_ < num_steps_) {
    for (const auto& [id, quota] : quotas_) {
      if (pending_.count(id) == 0) p.waiting_for.push_back(id);
    }
  }
  return p;
}

EpochLoss StepAggregator::LossOf(int epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = epoch_loss_.find(epoch);
  return it == epoch_loss_.end() ? EpochLoss{} : it->second;
}

}  // namespace dbs
