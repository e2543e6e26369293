#include "server/training_job.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

absl::StatusOr<std::unique_ptr<TrainingJob>> TrainingJob::Create(const JobConfig& config,
                                                                 const Clock* clock) {
  DBS_RETURN_IF_ERROR(ValidateJobConfig(config));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharePolicy> policy,
                       MakeSharePolicy(PolicyConfigOf(config)));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer, MakeOptimizer(config.optimizer));
  const std::string description = optimizer->Describe();
  std::unique_ptr<TrainingJob> job(new TrainingJob(config, clock, description));
  job->store_ = std::make_unique<ParameterStore>(std::move(optimizer));
  job->aggregator_ = std::make_unique<StepAggregator>(
      job->store_.get(), clock, AggregatorOptions{config.deterministic, config.screen});
  job->scheduler_ =
      std::make_unique<Scheduler>(config.scheduler, std::move(policy), clock, job.get());
  TrainingJob* raw = job.get();
  job->aggregator_->SetStepHook([raw](const StepStats& s) {
    bool checkpointed = false;
    std::optional<PlanChange> change = raw->OnStep(s, &checkpointed);
    raw->shards_.StepCompleted(s, change, checkpointed);
    return change;
  });
  job->aggregator_->SetFailureHook([raw](const absl::Status& s) { raw->Abort(s); });
  job->aggregator_->SetFaultyHook([raw](const FaultyPush& f) { raw->OnFaultyPush(f); });
  if (!config.checkpoint_dir.empty()) {
    job->writer_ = std::make_unique<CheckpointWriter>(
        [dir = config.checkpoint_dir](const JobState& st) { return WriteCheckpoint(dir, st); },
        [raw](const absl::StatusOr<std::string>& path, absl::Duration took) {
          raw->OnCheckpointWritten(path, took);
        },
        clock);
  }
  return job;
}

TrainingJob::TrainingJob(const JobConfig& config, const Clock* clock,
                         std::string optimizer_description)
    : config_(config),
      clock_(clock),
      optimizer_description_(std::move(optimizer_description)),
      start_(clock->Now()),
      liveness_({config.stall_timeout, config.worker_timeout}, clock),
      replan_(ReplanWindowSteps(config.policy, config.replan_window_steps), config.replan_threshold,
              config.policy == PolicyKind::kDbs ? config.noise_margin : 0.0) {}

void TrainingJob::OnEpochPlanned(int epoch, int num_steps, const std::map<int, WorkerPlan>& plans) {
  StepQuotas quotas(static_cast<size_t>(num_steps));
  std::string shares;
  for (const auto& [id, p] : plans) {
    for (int s = 0; s < num_steps; ++s) quotas[s][id] = p.BatchAt(s);
    shares += " " + std::to_string(id) + ":" + std::to_string(p.batch_size);
  }
  // Planned because the epoch before completed: its checkpoint (OnEpochCompleted) comes next.
  shards_.EpochPlanned(epoch, quotas, epoch > 0 && !config_.checkpoint_dir.empty());
  aggregator_->BeginEpoch(epoch, std::move(quotas));
  LOG(INFO) << "epoch " << epoch + 1 << "/" << config_.scheduler.epochs << " planned ("
            << PolicyName(config_.policy) << "): " << num_steps << " steps, batch per worker"
            << shares;
}

void TrainingJob::OnEpochCompleted(const EpochRecord& record) {
  const std::vector<WorkerRegistration> workers = scheduler_->Workers();
  const SampleAudit audit = AuditEpoch(record, aggregator_->AcceptedPushes(record.epoch),
                                       workers.empty() ? 0 : workers[0].train_samples);
  {
    absl::MutexLock lock(&mu_);
    audits_[record.epoch] = audit;
  }
  LOG(INFO) << EpochLine(Run(), record);
  if (!config_.checkpoint_dir.empty()) {
    shards_.Checkpointed(record.epoch, TakeCheckpoint(/*may_skip=*/false));  // followers wait
  }
  if (!audit.ok()) {
    LOG(ERROR) << "sample audit of epoch " << record.epoch + 1 << " failed: " << audit.missing
               << " missing, " << audit.duplicated << " duplicated";
  } else if (!record.dead.empty()) {
    LOG(INFO) << "sample audit of epoch " << record.epoch + 1 << ": all " << audit.samples
              << " samples used exactly once despite " << record.dead.size() << " dead worker(s)";
  }
}

std::set<int> TrainingJob::CheckDeadWorkers() {
  std::set<int> removed = RemoveDeadWorkers();
  if (!removed.empty() && removed_hook_) removed_hook_(removed);
  return removed;
}

std::set<int> TrainingJob::RemoveDeadWorkers() {
  if (finished_.HasBeenNotified()) return {};
  const StepProgress p = aggregator_->Progress();
  if (p.epoch < 0) return {};
  std::set<int> leavers;
  {
    absl::MutexLock lock(&mu_);
    leavers = leavers_;
  }
  if (p.step >= p.num_steps) return DropMissingReports(p.epoch, p.num_steps, leavers);
  std::set<int> dead = liveness_.Overdue({p.epoch, p.step, p.pushed, p.waiting_for});
  for (int id : p.waiting_for) {
    if (leavers.count(id) > 0) dead.insert(id);  // left: no need to wait for it
  }
  if (dead.empty()) return {};
  if (!RemoveAtStep(p, dead,
                    absl::StrCat("worker(s) ", absl::StrJoin(dead, ", "), " left or missed step ",
                                 p.step + 1, " of epoch ", p.epoch + 1, " by ",
                                 absl::FormatDuration(liveness_.worker_timeout())))) {
    return {};  // it moved on meanwhile
  }
  return dead;
}

bool TrainingJob::RemoveAtStep(const StepProgress& p, const std::set<int>& dead,
                               absl::string_view why) {
  if (!aggregator_->Evict(p.epoch, p.step, dead)) return false;
  absl::StatusOr<PlanChange> removal = scheduler_->RemoveWorkers(dead, p.epoch, p.step);
  if (!removal.ok()) {
    Abort(absl::UnavailableError(absl::StrCat("cannot continue without worker(s) ",
                                              absl::StrJoin(dead, ", "), ": ",
                                              removal.status().message())));
    return true;
  }
  LOG(WARNING) << why
               << ": removed; the step completes with the other gradients and their samples "
                  "go to the survivors";
  shards_.Removed(p.epoch, p.step, dead, &removal->later_quotas);
  aggregator_->CompleteEviction(*std::move(removal));
  {
    absl::MutexLock lock(&step_mu_);
    replan_.Reset();
  }
  return true;
}

absl::Status TrainingJob::RemoveMissingAtShard(int shard, int epoch, int step,
                                               const std::set<int>& workers) {
  if (!shards_.leads()) {
    return absl::FailedPreconditionError("this server is not the leader of a sharded job");
  }
  if (workers.empty()) return absl::InvalidArgumentError("no worker named");
  const StepProgress p = aggregator_->Progress();
  const std::string who = absl::StrJoin(workers, ", ");
  if (p.epoch != epoch || p.step != step + 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the leader is at step ", p.step, " of epoch ", p.epoch,
                     ", not at the step after step ", step, " of epoch ", epoch));
  }
  const std::string why =
      absl::StrCat("worker(s) ", who, " pushed step ", step + 1, " of epoch ", epoch + 1,
                   " here but not to shard ", shard, " within ",
                   absl::FormatDuration(liveness_.worker_timeout()),
                   " (it died between its pushes: that shard's step waits for it, and step ",
                   step + 2, " here for nobody)");
  if (p.step < p.num_steps) {
    // Nobody can have pushed this step: every worker waits for that shard's answer to the last.
    if (p.pushed > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(p.pushed, " worker(s) pushed step ", p.step, " already"));
    }
    for (int id : workers) {
      if (std::find(p.waiting_for.begin(), p.waiting_for.end(), id) == p.waiting_for.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("worker ", id, " is not one the step waits for"));
      }
    }
    if (!RemoveAtStep(p, workers, why)) {
      return absl::FailedPreconditionError("the step moved on meanwhile");
    }
    return absl::OkStatus();
  }
  // The epoch's steps are done here; it waits for reports, which nobody can send yet.
  int reported = 0;
  const std::vector<int> unreported = scheduler_->Unreported(epoch, &reported);
  for (int id : workers) {
    if (reported > 0 || std::find(unreported.begin(), unreported.end(), id) == unreported.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", id, " is not one the epoch's reports wait for"));
    }
  }
  LOG(WARNING) << why << ": removed; the epoch completes with the others' reports";
  shards_.Removed(epoch, p.step, workers, nullptr);
  return scheduler_->DropUnreported(epoch, workers);
}

std::set<int> TrainingJob::DropMissingReports(int epoch, int num_steps,
                                              const std::set<int>& leavers) {
  // Every step is done; the epoch waits for reports. A worker that left will never report; one
  // that has not reported a worker timeout after the first report did probably died.
  int reported = 0;
  const std::vector<int> missing = scheduler_->Unreported(epoch, &reported);
  std::set<int> gone = liveness_.Overdue({epoch, num_steps, reported, missing});
  for (int id : missing) {
    if (leavers.count(id) > 0) gone.insert(id);
  }
  if (gone.empty()) return {};
  LOG(WARNING) << "worker(s) " << absl::StrJoin(gone, ", ") << " left or did not report epoch "
               << epoch + 1 << ": the epoch completes with the others' reports";
  const absl::Status dropped = scheduler_->DropUnreported(epoch, gone);
  if (!dropped.ok()) LOG(WARNING) << "could not drop them: " << dropped;
  return gone;
}

absl::Status TrainingJob::CanRegister() { return shards_.Admit(); }

void TrainingJob::OnWorkerRegistered(int worker_id, const std::string& token,
                                     const std::string& identity) {
  shards_.Registered(worker_id, token, identity);
}

void TrainingJob::OnPlanDecision(int epoch, const PlanDecision& decision) {
  absl::MutexLock lock(&decisions_mu_);
  decisions_[epoch].Add(decision);
}

void TrainingJob::OnWorkerLeft(int worker_id) {
  absl::MutexLock lock(&mu_);
  leavers_.insert(worker_id);
}

absl::Status TrainingJob::CanReport(int worker_id, int epoch) {
  const StepProgress p = aggregator_->Progress();
  if (p.epoch > epoch || (p.epoch == epoch && p.step >= p.num_steps)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " reported epoch ", epoch,
                                                    " before its steps were done (the job is "
                                                    "at epoch ",
                                                    p.epoch, " step ", p.step, " of ", p.num_steps,
                                                    ")"));
}

void TrainingJob::OnJobFinished(const absl::Status& status) {
  absl::Status final_status = status;
  {
    absl::MutexLock lock(&mu_);
    if (finish_claimed_) return;  // only the first ending counts, and notifies once
    finish_claimed_ = true;
    if (final_status.ok()) {
      // A job whose audit failed did not train on what it says: it must not end as ok.
      for (const auto& [epoch, audit] : audits_) {
        if (audit.ok()) continue;
        final_status = absl::DataLossError(absl::StrCat(
            "the sample audit of epoch ", epoch + 1, " failed: ", audit.missing,
            " samples never trained on, ", audit.duplicated, " trained on more than once"));
        break;
      }
    }
    final_status_ = final_status;
    end_ = clock_->Now();
  }
  if (!final_status.ok()) aggregator_->Abort(final_status);
  shards_.Ended(final_status);
  finished_.Notify();
}

absl::Status TrainingJob::Wait() {
  finished_.WaitForNotification();
  if (writer_ != nullptr) writer_->Flush();
  absl::MutexLock lock(&mu_);
  return final_status_;
}

std::optional<PlanChange> TrainingJob::OnStep(const StepStats& stats, bool* checkpointed) {
  if (!observers_.empty()) {
    const absl::Time now = clock_->Now();
    absl::Duration wall;
    {
      absl::MutexLock lock(&step_mu_);
      wall = last_step_end_ == absl::InfinitePast() ? absl::ZeroDuration() : now - last_step_end_;
      last_step_end_ = stats.last_of_epoch ? absl::InfinitePast() : now;
    }
    for (JobObserver* observer : observers_) observer->OnStep(wall, stats);
  }
  std::optional<PlanChange> change = Replan(stats);
  // After the re-plan: the workers receive it with this step's answers, so a checkpoint of this
  // step must hold it. One written before it would restore the old plan of the next step while
  // the workers follow the new one, and refuse their pushes as not matching it.
  if (!config_.checkpoint_dir.empty()) {
    bool due = false;
    {
      absl::MutexLock lock(&step_mu_);
      due = ++steps_since_checkpoint_ >= config_.checkpoint_every_steps;
    }
    // One the writer is not ready for is taken at the next step.
    if (due && TakeCheckpoint(/*may_skip=*/true)) {
      *checkpointed = true;
      absl::MutexLock lock(&step_mu_);
      steps_since_checkpoint_ = 0;
    }
  }
  return change;
}

std::optional<PlanChange> TrainingJob::Replan(const StepStats& stats) {
  // What the controller balances: each worker's step as the server observed it, whatever the
  // worker says it computed. Its own figure counts only where the server saw no beginning (the
  // first step after a restore).
  std::map<int, std::pair<int64_t, double>> step_times = stats.workers;
  for (auto& [id, t] : step_times) {
    if (auto c = stats.cycle.find(id); c != stats.cycle.end()) t.second = c->second;
  }
  scheduler_->RecordStep(stats.epoch, step_times);
  if (stats.last_of_epoch) return std::nullopt;
  std::optional<ReplanTrigger> trigger;
  {
    absl::MutexLock lock(&step_mu_);
    trigger = replan_.Add(stats.epoch, step_times);
  }
  if (!trigger.has_value()) return std::nullopt;
  absl::StatusOr<PlanChange> replan =
      scheduler_->Rebalance(stats.epoch, stats.step + 1, trigger->window);
  if (!replan.ok()) return std::nullopt;
  LOG(INFO) << "epoch " << stats.epoch + 1 << " re-planned after step " << stats.step + 1
            << ": slowest worker's step time over the last "
            << ReplanWindowSteps(config_.policy, config_.replan_window_steps) << " steps was "
            << trigger->imbalance << "x the fastest's (compute and own communication)"
            << (trigger->idle ? "; a worker ran no sample in them (the controller may probe it)"
                              : "");
  return *std::move(replan);
}

bool TrainingJob::WaitFor(absl::Duration timeout) {
  return finished_.WaitForNotificationWithTimeout(timeout);
}

bool TrainingJob::CheckStall() {
  if (finished_.HasBeenNotified()) return false;
  const StepProgress progress = aggregator_->Progress();
  if (!liveness_.Stalled(progress.accepted_pushes + scheduler_->events(), scheduler_->started())) {
    return false;
  }
  // Stalled: name what the job waits for.
  const std::vector<EpochRecord> history = scheduler_->History();
  std::string waiting;
  if (history.empty()) {
    waiting = absl::StrCat("workers to register with the job's model: ", scheduler_->WorkersReady(),
                           " of ", config_.scheduler.expected_workers, " did");
  } else if (!progress.waiting_for.empty()) {
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
  const absl::Status stalled = absl::DeadlineExceededError(
      absl::StrCat("no progress for ", absl::FormatDuration(liveness_.stall_timeout()),
                   " while waiting for ", waiting,
                   history.empty() ? "; start the missing workers, or fewer --workers"
                                   : "; the worker probably died (restart the job from its "
                                     "checkpoint)"));
  LOG(ERROR) << stalled.message();
  Abort(stalled);
  return true;
}

void TrainingJob::Abort(const absl::Status& status) {
  scheduler_->Abort(status);   // notifies OnJobFinished unless the job already ended
  aggregator_->Abort(status);  // releases pushes even when the job had ended
  OnJobFinished(status);
}

std::optional<JobState> TrainingJob::CaptureState() {
  JobState st;
  st.config = config_.scheduler;
  st.policy = PolicyName(config_.policy);
  st.settings = TrainingSettings(config_);
  // The barrier and the parameters first, in one piece; the scheduler's history is at least as
  // new, which a restart tolerates (its extra plans are simply used).
  st.aggregator = aggregator_->SaveState();
  st.scheduler = scheduler_->SaveState();
  {
    absl::MutexLock lock(&mu_);
    st.audits = audits_;
  }
  if (st.aggregator.epoch < 0 || st.aggregator.store.layout.empty()) return std::nullopt;
  return st;
}

absl::Status TrainingJob::SaveCheckpoint() {
  if (writer_ == nullptr) return absl::OkStatus();
  const std::optional<JobState> st = CaptureState();
  if (!st.has_value()) return absl::OkStatus();
  return writer_->WriteNow(*st).status();
}

bool TrainingJob::TakeCheckpoint(bool may_skip) {
  if (may_skip && writer_->Busy()) return false;
  std::optional<JobState> st = CaptureState();
  if (!st.has_value()) return false;
  writer_->Queue(*std::move(st));
  return true;
}

void TrainingJob::OnCheckpointWritten(const absl::StatusOr<std::string>& path,
                                      absl::Duration took) {
  for (JobObserver* observer : observers_) observer->OnCheckpoint(took, path.ok());
  if (!path.ok()) {
    LOG(ERROR) << "checkpoint failed: " << path.status();
  } else {
    VLOG(1) << "checkpoint " << *path;
  }
}

absl::Status TrainingJob::CheckRestorable(const JobState& st, bool allow_other_settings) const {
  const SchedulerConfig& c = config_.scheduler;
  if (st.config.expected_workers != c.expected_workers || st.config.epochs != c.epochs ||
      st.config.global_batch != c.global_batch || st.config.seed != c.seed ||
      st.policy != PolicyName(config_.policy)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint is of a job with workers=", st.config.expected_workers,
        " epochs=", st.config.epochs, " global_batch=", st.config.global_batch,
        " seed=", st.config.seed, " policy=", st.policy, "; restart with the same settings"));
  }
  std::vector<std::string> changed;
  for (const auto& [name, now] : TrainingSettings(config_)) {
    auto then = st.settings.find(name);
    if (then != st.settings.end() && then->second != now) {
      changed.push_back(absl::StrCat(name, " ", then->second, " -> ", now));
    }
  }
  if (!changed.empty()) {
    const std::string list = absl::StrJoin(changed, ", ");
    if (!allow_other_settings) {
      return absl::FailedPreconditionError(
          absl::StrCat("the checkpoint was written with other settings (", list,
                       "); restart with the same settings, or allow the change explicitly"));
    }
    LOG(WARNING) << "restoring with changed settings: " << list;
  }
  return absl::OkStatus();
}

absl::Status TrainingJob::Restore(const JobState& st, bool allow_other_settings) {
  DBS_RETURN_IF_ERROR(CheckRestorable(st, allow_other_settings));
  DBS_RETURN_IF_ERROR(store_->LoadState(st.aggregator.store));
  scheduler_->LoadState(st.scheduler);
  StepQuotas quotas;
  if (st.aggregator.epoch >= 0 &&
      st.aggregator.epoch < static_cast<int>(st.scheduler.records.size())) {
    const EpochRecord& rec = st.scheduler.records[st.aggregator.epoch];
    quotas.resize(static_cast<size_t>(rec.num_steps));
    for (const auto& [id, steps] : rec.layout) {
      if (rec.dead.count(id) > 0) continue;
      for (int s = 0; s < rec.num_steps && s < static_cast<int>(steps.size()); ++s) {
        quotas[s][id] = static_cast<int>(CountSamples(steps[s]));
      }
    }
  }
  if (shards_.leads()) {
    std::set<int> registered;
    for (size_t id = 0; id < st.scheduler.tokens.size(); ++id) {
      if (scheduler_->IsRegistered(static_cast<int>(id))) registered.insert(static_cast<int>(id));
    }
    // The tokens as restored (or made afresh).
    shards_.Restored(st, quotas, scheduler_->SaveState(), registered);
  }
  aggregator_->LoadState(st.aggregator, std::move(quotas));
  absl::MutexLock lock(&mu_);
  audits_ = st.audits;
  return absl::OkStatus();
}

absl::Status TrainingJob::RestoreShard(const JobState& st, StepQuotas quotas,
                                       bool allow_other_settings) {
  DBS_RETURN_IF_ERROR(CheckRestorable(st, allow_other_settings));
  DBS_RETURN_IF_ERROR(store_->LoadState(st.aggregator.store));
  aggregator_->LoadState(st.aggregator, std::move(quotas));
  return absl::OkStatus();
}

absl::StatusOr<ResumePoint> TrainingJob::Resume(int worker_id, ParameterSnapshot* parameters) {
  if (!scheduler_->IsRegistered(worker_id)) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
  }
  shards_.Resumed(worker_id);
  ResumePoint rp;
  DBS_ASSIGN_OR_RETURN(*parameters, store_->Snapshot());
  const StepProgress p = aggregator_->Progress();
  const std::vector<EpochRecord> history = scheduler_->History();
  if (finished_.HasBeenNotified() || history.empty()) {
    rp.finished = finished_.HasBeenNotified();
    return rp;
  }
  rp.epoch = std::max(p.epoch, 0);
  rp.step = p.step;
  if (rp.epoch >= static_cast<int>(history.size())) return rp;
  const EpochRecord& rec = history[rp.epoch];
  if (rec.plans.count(worker_id) == 0 || rec.dead.count(worker_id) > 0) {
    rp.epoch += 1;  // joined later: start with the next epoch's plan
    rp.step = 0;
    return rp;
  }
  auto describe = [&](const EpochRecord& r) {
    rp.has_plan = true;
    rp.plan = r.plans.at(worker_id);
    rp.schedule.epoch = r.epoch;
    rp.schedule.revision = r.revision;
    rp.schedule.from_step = 0;
    rp.schedule.num_steps = r.num_steps;
    rp.schedule.steps = r.layout.at(worker_id);
    rp.schedule.steps.resize(static_cast<size_t>(r.num_steps));
    rp.schedule.test_range = rp.plan.test_range;
  };
  if (rec.reports.count(worker_id) > 0) {  // done with this epoch: go on with the next plan
    rp.epoch += 1;
    rp.step = 0;
    if (rp.epoch < static_cast<int>(history.size()) &&
        history[rp.epoch].plans.count(worker_id) > 0) {
      describe(history[rp.epoch]);
    }
    return rp;
  }
  describe(rec);
  return rp;
}

void TrainingJob::OnFaultyPush(const FaultyPush& f) {
  {
    absl::MutexLock lock(&mu_);
    ++faulty_pushes_;
  }
  if (!f.quarantine) return;
  // Its push was refused: the step waits for it, as for a worker that died before pushing (the
  // step after it, for a push refused as it was summed).
  const int at = f.removal_step();
  const StepProgress p = aggregator_->Progress();
  if (p.epoch != f.epoch || p.step != at ||
      std::find(p.waiting_for.begin(), p.waiting_for.end(), f.worker_id) == p.waiting_for.end()) {
    return;  // removed meanwhile (its deadline, or the epoch's end)
  }
  Quarantine q;
  q.worker_id = f.worker_id;
  q.epoch = f.epoch;
  q.step = f.step;
  q.reason = std::string(f.why.message());
  for (const EpochRecord& r : scheduler_->History()) {
    if (r.epoch != f.epoch) continue;
    auto steps = r.layout.find(f.worker_id);
    if (steps == r.layout.end()) break;
    for (size_t s = static_cast<size_t>(at); s < steps->second.size(); ++s) {
      q.samples_reassigned += CountSamples(steps->second[s]);
    }
  }
  if (!RemoveAtStep(p, {f.worker_id},
                    absl::StrCat("worker ", f.worker_id, " quarantined at step ", at + 1,
                                 " of epoch ", f.epoch + 1, " (", q.reason, "); its ",
                                 q.samples_reassigned, " samples left in the epoch"))) {
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    quarantined_.push_back(q);
  }
  if (removed_hook_) removed_hook_({f.worker_id});
}

RunInfo TrainingJob::Run() const {
  RunInfo run;
  run.policy = PolicyName(config_.policy);
  run.controller = PolicyConfigOf(config_);
  run.optimizer = optimizer_description_;
  run.scheduler = config_.scheduler;
  run.workers = scheduler_->Workers();
  run.epochs = scheduler_->History();
  for (const EpochRecord& r : run.epochs) run.losses[r.epoch] = aggregator_->LossOf(r.epoch);
  {
    absl::MutexLock lock(&decisions_mu_);
    run.decisions = decisions_;
  }
  run.start = start_;
  absl::MutexLock lock(&mu_);
  run.audits = audits_;
  run.quarantined = quarantined_;
  run.faulty_pushes = faulty_pushes_;
  run.finished = finished_.HasBeenNotified();
  run.end = run.finished ? end_ : clock_->Now();
  if (finished_.HasBeenNotified() && !final_status_.ok()) run.status = final_status_.ToString();
  return run;
}

}  // namespace dbs
