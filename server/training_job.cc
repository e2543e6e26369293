#include "server/training_job.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

absl::StatusOr<std::unique_ptr<TrainingJob>> TrainingJob::Create(const JobConfig& config,
                                                                 const Clock* clock) {
  DBS_RETURN_IF_ERROR(Scheduler::ValidateConfig(config.scheduler));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharePolicy> policy, MakeSharePolicy(config.policy,
                                                                      config.speed_window));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer, MakeOptimizer(config.optimizer));
  const std::string description = optimizer->Describe();
  std::unique_ptr<TrainingJob> job(new TrainingJob(config, clock, description));
  job->store_ = std::make_unique<ParameterStore>(std::move(optimizer));
  job->aggregator_ = std::make_unique<StepAggregator>(job->store_.get());
  job->scheduler_ =
      std::make_unique<Scheduler>(config.scheduler, std::move(policy), clock, job.get());
  return job;
}

TrainingJob::TrainingJob(const JobConfig& config, const Clock* clock,
                         std::string optimizer_description)
    : config_(config),
      clock_(clock),
      optimizer_description_(std::move(optimizer_description)),
      start_(clock->Now()) {}

void TrainingJob::OnEpochPlanned(int epoch, int num_steps,
                                 const std::map<int, WorkerPlan>& plans) {
  std::map<int, StepQuota> quotas;
  std::string shares;
  for (const auto& [id, p] : plans) {
    quotas[id] = StepQuota{p.batch_size, p.final_batch_size};
    shares += " " + std::to_string(id) + ":" + std::to_string(p.batch_size);
  }
  aggregator_->BeginEpoch(epoch, num_steps, std::move(quotas));
  LOG(INFO) << "epoch " << epoch + 1 << "/" << config_.scheduler.epochs << " planned ("
            << config_.policy << "): " << num_steps << " steps, batch per worker" << shares;
}

void TrainingJob::OnEpochCompleted(const EpochRecord& record) {
  LOG(INFO) << EpochLine(Run(), record);
}

void TrainingJob::OnJobFinished(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_.HasBeenNotified()) return;
    final_status_ = status;
    end_ = clock_->Now();
  }
  if (!status.ok()) aggregator_->Abort(status);
  finished_.Notify();
}

absl::Status TrainingJob::Wait() {
  finished_.WaitForNotification();
  absl::MutexLock lock(&mu_);
  return final_status_;
}

bool TrainingJob::WaitFor(absl::Duration timeout) {
  return finished_.WaitForNotificationWithTimeout(timeout);
}

bool TrainingJob::CheckStall() {
  if (config_.stall_timeout <= absl::ZeroDuration() || finished_.HasBeenNotified()) return false;
  const StepProgress progress = aggregator_->Progress();
  const std::vector<EpochRecord> history = scheduler_->History();
  int64_t activity = progress.accepted_pushes + static_cast<int64_t>(scheduler_->Workers().size());
  for (const EpochRecord& r : history) activity += static_cast<int64_t>(r.reports.size());
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    if (activity != last_activity_count_ || history.empty()) {
      last_activity_count_ = activity;
      last_activity_ = now;
      return false;
    }
    if (now - last_activity_ < config_.stall_timeout) return false;
  }
  std::string waiting;
  if (!progress.waiting_for.empty()) {
    waiting = absl::StrCat("a push from worker(s) ", absl::StrJoin(progress.waiting_for, ", "),
                           " at epoch ", progress.epoch, " step ", progress.step);
  } else {
    std::vector<int> missing;
    for (const auto& [id, plan] : history.back().plans) {
      if (history.back().reports.count(id) == 0) missing.push_back(id);
    }
    waiting = absl::StrCat("the epoch ", history.back().epoch, " report of worker(s) ",
                           absl::StrJoin(missing, ", "));
  }
  const absl::Status stalled = absl::DeadlineExceededError(absl::StrCat(
      "no progress for ", absl::FormatDuration(config_.stall_timeout), " while waiting for ",
      waiting, "; the worker probably died (restart the job; recovery without restart is not "
      "part of this version)"));
  LOG(ERROR) << stalled.message();
  Abort(stalled);
  return true;
}

void TrainingJob::Abort(const absl::Status& status) {
  scheduler_->Abort(status);   // notifies OnJobFinished unless the job already ended
  aggregator_->Abort(status);  // releases pushes even when the job had ended
  OnJobFinished(status);
}

RunInfo TrainingJob::Run() const {
  RunInfo run;
  run.policy = config_.policy;
  run.optimizer = optimizer_description_;
  run.scheduler = config_.scheduler;
  run.workers = scheduler_->Workers();
  run.epochs = scheduler_->History();
  for (const EpochRecord& r : run.epochs) run.losses[r.epoch] = aggregator_->LossOf(r.epoch);
  run.start = start_;
  absl::MutexLock lock(&mu_);
  run.end = finished_.HasBeenNotified() ? end_ : clock_->Now();
  if (finished_.HasBeenNotified() && !final_status_.ok()) run.status = final_status_.ToString();
  return run;
}

}  // namespace dbs
