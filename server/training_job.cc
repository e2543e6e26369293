#include "server/training_job.h"

#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

absl::StatusOr<std::unique_ptr<TrainingJob>> TrainingJob::Create(const JobConfig& config,
                                                                 const Clock* clock) {
  DBS_RETURN_IF_ERROR(Scheduler::ValidateConfig(config.scheduler));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharePolicy> policy, MakeSharePolicy(config.policy));
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
