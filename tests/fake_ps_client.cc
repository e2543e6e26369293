#include "tests/fake_ps_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dbs {

FakePsClient::FakePsClient(FakeJobConfig config, FakeClock* clock)
    : config_(config), clock_(clock) {}

void FakePsClient::RestartAt(int epoch, int step, int resume_step) {
  restarts_at_[{epoch, step}] = resume_step;
}

void FakePsClient::ReviseAfter(int epoch, int step, PlanRevision revision) {
  revisions_at_[{epoch, step}] = std::move(revision);
}

void FakePsClient::EvictAt(int epoch, int step) { evict_at_ = {epoch, step}; }

absl::Status FakePsClient::CheckWorker(int worker_id) const {
  if (!registered_ || worker_id != id_) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
  }
  if (evicted_) {
    return absl::NotFoundError(
        "the worker was declared dead after missing a step deadline; its samples went to the "
        "other workers");
  }
  return absl::OkStatus();
}

WorkerPlan FakePsClient::PlanOf(int epoch) const {
  WorkerPlan plan;
  plan.epoch = epoch;
  plan.total_epochs = config_.epochs;
  if (epoch >= config_.epochs) {
    plan.finished = true;
    return plan;
  }
  const int64_t n = reg_.train_samples;
  plan.global_batch = config_.global_batch;
  plan.batch_size = config_.global_batch;
  plan.num_steps = static_cast<int>((n + config_.global_batch - 1) / config_.global_batch);
  plan.final_batch_size = static_cast<int>(n - int64_t{plan.num_steps - 1} * config_.global_batch);
  plan.permutation_seed = 1000 + static_cast<uint64_t>(epoch);
  plan.train_ranges = {{0, n}};
  plan.test_range = {0, reg_.test_samples};
  plan.share = 1.0;
  return plan;
}

void FakePsClient::StartEpoch(int epoch) {
  epoch_ = epoch;
  step_ = 0;
  const WorkerPlan plan = PlanOf(epoch);
  schedule_ = ExpandSteps(plan);
  test_range_ = plan.test_range;
  checkpoints_.clear();
  checkpoints_[0] = params_;
}

absl::StatusOr<RegistrationResult> FakePsClient::RegisterWorker(const WorkerRegistration& reg) {
  if (reg.train_samples < 1) return absl::InvalidArgumentError("no training samples");
  int start_epoch = config_.start_epoch;
  if (config_.finished || (registered_ && evicted_ && finish_while_evicted_)) {
    RegistrationResult done;
    done.job_finished = true;
    done.worker_id = -1;
    done.start_epoch = config_.epochs;
    done.epochs = config_.epochs;
    done.global_batch = config_.global_batch;
    done.policy = "fake";
    ++rejoins_;
    return done;
  }
  if (registered_ && evicted_) {
    // Registering again after eviction: a new id, from the next epoch (the others finished the
    // current one without this worker).
    ++id_;
    evicted_ = false;
    evict_at_ = {-1, -1};
    ++rejoins_;
    StartEpoch(epoch_ + 1);
    start_epoch = epoch_;
  }
  reg_ = reg;
  registered_ = true;
  RegistrationResult r;
  r.worker_id = id_;
  r.start_epoch = start_epoch;
  r.expected_workers = 1;
  r.epochs = config_.epochs;
  r.global_batch = config_.global_batch;
  r.policy = "fake";
  return r;
}

absl::Status FakePsClient::RegisterModel(int worker_id, const ModelLayout& layout,
                                         absl::Span<const float> initial,
                                         absl::Span<float> params) {
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  if (initial.size() != static_cast<size_t>(TotalElements(layout)) ||
      params.size() != initial.size()) {
    return absl::InvalidArgumentError("parameters do not match the layout");
  }
  if (params_.empty()) params_.assign(initial.begin(), initial.end());
  std::copy(params_.begin(), params_.end(), params.begin());
  if (!moved_after_registration_.empty()) {
    params_ = moved_after_registration_;
    ++version_;
  }
  StartEpoch(config_.start_epoch);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FakePsClient::PullParameters(int worker_id, absl::Span<float> params) {
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  if (params.size() != params_.size()) {
    return absl::InvalidArgumentError("the parameter buffer does not match the model");
  }
  std::copy(params_.begin(), params_.end(), params.begin());
  return version_;
}

absl::StatusOr<WorkerPlan> FakePsClient::GetEpochPlan(int worker_id, int epoch) {
  if (std::make_pair(epoch - 1, static_cast<int>(schedule_.size()) + 1) == evict_at_) {
    evicted_ = true;
  }
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  if (epoch - 1 == lose_report_of_ && epoch == epoch_ && !reports_.empty()) {
    lose_report_of_ = -1;
    reconnected_ = true;
    ++restarts_;
    reports_.pop_back();
    epoch_ = epoch - 1;
    const WorkerPlan before = PlanOf(epoch_);
    schedule_ = ExpandSteps(before);
    test_range_ = before.test_range;
    step_ = static_cast<int>(schedule_.size());
    return absl::FailedPreconditionError(absl::StrCat("report epoch ", epoch_, " first"));
  }
  if (epoch >= config_.epochs) return PlanOf(epoch);
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(
        absl::StrCat("epoch ", epoch, " is not running (the job is at epoch ", epoch_, ")"));
  }
  return PlanOf(epoch);
}

bool FakePsClient::MaybeRestart(int epoch, int step) {
  auto it = restarts_at_.find({epoch, step});
  if (it == restarts_at_.end() || epoch != epoch_) return false;
  const int resume_step = it->second;
  restarts_at_.erase(it);
  reconnected_ = true;  // the call had to wait for the server to come back
  ++restarts_;
  auto checkpoint = checkpoints_.find(resume_step);
  if (checkpoint != checkpoints_.end()) {
    params_ = checkpoint->second;
    step_ = resume_step;
  }
  return true;
}

absl::Status FakePsClient::CheckPush(int epoch, int step, int num_samples,
                                     absl::Span<const float> gradient,
                                     absl::Span<float> params) const {
  const int num_steps = static_cast<int>(schedule_.size());
  if (epoch != epoch_ || step != step_ || step_ >= num_steps) {
    return absl::FailedPreconditionError(absl::StrCat("push for epoch ", epoch, " step ", step,
                                                      " does not match the current step (epoch ",
                                                      epoch_, " step ", step_, ")"));
  }
  if (num_samples != CountSamples(schedule_[step])) {
    return absl::InvalidArgumentError(absl::StrCat("pushed ", num_samples, " samples at step ",
                                                   step, "; the plan says ",
                                                   CountSamples(schedule_[step])));
  }
  if (num_samples > 0 && gradient.size() != params_.size()) {
    return absl::InvalidArgumentError("the gradient does not match the model");
  }
  if (params.size() != params_.size()) {
    return absl::InvalidArgumentError("the parameter buffer does not match the model");
  }
  return absl::OkStatus();
}

void FakePsClient::ReviseAt(int epoch, int step, StepOutcome* out) {
  auto rev = revisions_at_.find({epoch, step});
  if (rev == revisions_at_.end()) return;
  out->revised = true;
  out->revision = rev->second;
  out->revision.revision = ++revision_;
  // The server follows its own revision (when it is well-formed).
  if (rev->second.from_step == step + 1 &&
      rev->second.num_steps == rev->second.from_step + static_cast<int>(rev->second.steps.size())) {
    before_revision_ = schedule_;
    test_before_revision_ = test_range_;
    schedule_.resize(rev->second.num_steps);
    std::copy(rev->second.steps.begin(), rev->second.steps.end(),
              schedule_.begin() + rev->second.from_step);
    test_range_ = rev->second.test_range;
  }
  revisions_at_.erase(rev);
}

absl::StatusOr<StepOutcome> FakePsClient::PushGradient(int worker_id, int epoch, int step,
                                                       int num_samples, double loss_sum,
                                                       double compute_seconds,
                                                       absl::Span<const float> gradient,
                                                       absl::Span<float> params) {
  if (clock_ != nullptr) clock_->Advance(config_.push_time);
  if (epoch == evict_at_.first && step == evict_at_.second) evicted_ = true;
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  MaybeRestart(epoch, step);
  if (std::make_pair(epoch, step) == forget_revision_at_ && epoch == epoch_) {
    forget_revision_at_ = {-1, -1};
    reconnected_ = true;
    ++restarts_;
    schedule_ = before_revision_;
    test_range_ = test_before_revision_;
  }
  if (absl::Status s = CheckPush(epoch, step, num_samples, gradient, params); !s.ok()) return s;
  for (size_t i = 0; num_samples > 0 && i < params_.size(); ++i) {
    params_[i] -= config_.learning_rate * gradient[i];
  }
  ++version_;
  pushes_.push_back({epoch, step, num_samples, compute_seconds});
  std::copy(params_.begin(), params_.end(), params.begin());
  StepOutcome out;
  out.global_loss = num_samples > 0 ? loss_sum / num_samples : 0.0;
  out.global_samples = num_samples;
  out.version = version_;
  ReviseAt(epoch, step, &out);
  ++step_;
  checkpoints_[step_] = params_;
  return out;
}

absl::Status FakePsClient::ReportEpoch(const EpochTiming& timing) {
  if (std::make_pair(timing.epoch, static_cast<int>(schedule_.size())) == evict_at_) {
    evicted_ = true;
  }
  if (absl::Status s = CheckWorker(timing.worker_id); !s.ok()) return s;
  MaybeRestart(timing.epoch, static_cast<int>(schedule_.size()));
  if (timing.epoch != epoch_ || step_ != static_cast<int>(schedule_.size())) {
    return absl::FailedPreconditionError(absl::StrCat("report for epoch ", timing.epoch,
                                                      " before its steps are done (epoch ", epoch_,
                                                      " step ", step_, ")"));
  }
  int64_t samples = 0;
  for (const auto& step : schedule_) samples += CountSamples(step);
  if (timing.samples != samples) {
    return absl::InvalidArgumentError(
        absl::StrCat("report of ", timing.samples, " samples; the epoch had ", samples));
  }
  reports_.push_back(timing);
  StartEpoch(epoch_ + 1);
  return absl::OkStatus();
}

absl::Status FakePsClient::Leave(int worker_id) {
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  left_ = true;
  return absl::OkStatus();
}

absl::StatusOr<ResumePoint> FakePsClient::Resume(int worker_id, absl::Span<float> params) {
  if (!resume_failure_.ok()) return resume_failure_;
  if (evict_before_resume_) {
    evict_before_resume_ = false;
    evicted_ = true;
  }
  if (absl::Status s = CheckWorker(worker_id); !s.ok()) return s;
  if (params.size() != params_.size()) {
    return absl::InvalidArgumentError("the parameter buffer does not match the model");
  }
  std::copy(params_.begin(), params_.end(), params.begin());
  ResumePoint info;
  info.finished = epoch_ >= config_.epochs;
  info.epoch = epoch_;
  info.step = step_;
  info.has_plan = !info.finished;
  if (info.has_plan) {
    info.plan = PlanOf(epoch_);
    info.schedule.epoch = epoch_;
    info.schedule.revision = revision_;
    info.schedule.from_step = 0;
    info.schedule.num_steps = static_cast<int>(schedule_.size());
    info.schedule.steps = schedule_;
    info.schedule.test_range = test_range_;
  }
  return info;
}

bool FakePsClient::TakeReconnected() {
  const bool r = reconnected_;
  reconnected_ = false;
  return r;
}

}  // namespace dbs
