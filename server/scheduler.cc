#include "server/scheduler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/permutation.h"
#include "common/secrets.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

Scheduler::Scheduler(SchedulerConfig config, std::unique_ptr<SharePolicy> policy,
                     const Clock* clock, SchedulerListener* listener, TokenSource token_source)
    : config_(config),
      policy_(std::move(policy)),
      clock_(clock),
      listener_(listener),
      token_source_(token_source ? std::move(token_source) : TokenSource(RandomToken)) {}

void Scheduler::Run(Calls& calls) {
  for (auto& c : calls) c();
  calls.clear();
}

absl::Status Scheduler::ValidateRegistration(const WorkerRegistration& reg) const {
  if (reg.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (reg.name.size() > kMaxNameLength || reg.device.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker name and device must be at most ", kMaxNameLength, " bytes"));
  }
  if (reg.train_samples <= 0) {
    return absl::InvalidArgumentError("worker reports an empty training set");
  }
  if (reg.train_samples > kMaxSamples || reg.test_samples > kMaxSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat("a data set of more than ", kMaxSamples, " samples is not supported"));
  }
  // ceil(D / B) steps per epoch, each with a layout per worker: bounded.
  const int64_t steps = (reg.train_samples + config_.global_batch - 1) / config_.global_batch;
  if (steps > kMaxStepsPerEpoch) {
    return absl::InvalidArgumentError(absl::StrCat(
        reg.train_samples, " training samples in global batches of ", config_.global_batch,
        " make ", steps, " steps per epoch; at most ", kMaxStepsPerEpoch, " (raise the batch)"));
  }
  if (reg.test_samples < 0) return absl::InvalidArgumentError("negative test set size");
  if (!std::isfinite(reg.cpu_limit_cores) || reg.cpu_limit_cores < 0 ||
      reg.cpu_limit_cores > kMaxCpuLimitCores) {
    return absl::InvalidArgumentError(absl::StrCat("a CPU limit must be in [0, ", kMaxCpuLimitCores,
                                                   "] cores, not ", reg.cpu_limit_cores));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegistrationResult> Scheduler::Register(const WorkerRegistration& reg) {
  DBS_RETURN_IF_ERROR(ValidateRegistration(reg));
  DBS_RETURN_IF_ERROR(policy_->Admits(reg.name));
  if (listener_ != nullptr) DBS_RETURN_IF_ERROR(listener_->CanRegister());
  Calls calls;
  RegistrationResult result;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    int id = -1;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i].name == reg.name && !left_[i]) id = static_cast<int>(i);
    }
    if (id >= 0) {  // the name's worker again: a retry of the same process, or an impostor
      DBS_RETURN_IF_ERROR(CheckIdentity(id, workers_[id].identity, reg.identity));
      last_call_[id] = clock_->Now();
      if (workers_[id].incarnation != reg.incarnation) {
        return absl::AlreadyExistsError(absl::StrCat(
            "a worker named '", reg.name, "' is already in the job (worker ", id,
            "); give each worker process its own name. A restarted worker can rejoin under its "
            "name once the old one has been removed (after the worker timeout)"));
      }
    } else if (finished_) {
      // Nothing to join, and nothing wrong with asking: a worker restarted after the job ended
      // (by compose or Kubernetes) learns it is done and exits successfully. No id, no token.
      for (int removed : removed_) {  // remembered for removed workers only (bounded)
        if (workers_[removed].name == reg.name) back_after_end_.insert(reg.name);
      }
      result.job_finished = true;
      result.worker_id = -1;
      result.start_epoch = config_.epochs;
      result.epochs = config_.epochs;
      result.global_batch = config_.global_batch;
      result.policy = policy_->name();
      return result;
    } else {
      DBS_ASSIGN_OR_RETURN(id, AddWorkerLocked(reg, &calls));
    }
    result.worker_id = id;
    // A worker joining a running job starts with the next epoch to be planned.
    result.start_epoch = FirstPlannedEpochLocked(id);
    result.expected_workers = config_.expected_workers;
    result.epochs = config_.epochs;
    result.global_batch = config_.global_batch;
    result.policy = policy_->name();
    result.token = tokens_[id];
  }
  Run(calls);
  return result;
}

absl::StatusOr<int> Scheduler::AddWorkerLocked(const WorkerRegistration& reg, Calls* calls) {
  if (!workers_.empty() && (reg.train_samples != workers_[0].train_samples ||
                            reg.test_samples != workers_[0].test_samples)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", reg.name, "' has ", reg.train_samples, " training and ", reg.test_samples,
        " test samples; the job's first worker has ", workers_[0].train_samples, " and ",
        workers_[0].test_samples, ": every worker must load the same data set"));
  }
  ExpireIdleLocked();
  DBS_RETURN_IF_ERROR(RoomForLocked(reg.source));
  const int id = static_cast<int>(workers_.size());
  workers_.push_back(reg);
  left_.push_back(false);
  last_call_.push_back(clock_->Now());
  tokens_.push_back(NewTokenLocked());
  if (listener_ != nullptr) listener_->OnWorkerRegistered(id, tokens_.back(), reg.identity);
  ++events_;
  if (!start_with_models_) DBS_RETURN_IF_ERROR(StartIfReadyLocked(calls));
  return id;
}

int Scheduler::FirstPlannedEpochLocked(int id) const {
  for (size_t e = 0; e < records_.size(); ++e) {
    if (records_[e].plans.count(id) > 0) return static_cast<int>(e);
  }
  return static_cast<int>(records_.size());
}

void Scheduler::ExpireIdleLocked() {
  if (config_.registration_idle <= absl::ZeroDuration()) return;
  const absl::Time now = clock_->Now();
  for (size_t i = 0; i < workers_.size(); ++i) {
    const int id = static_cast<int>(i);
    if (left_[i] || now - last_call_[i] < config_.registration_idle || WaitersOfLocked(id) > 0) {
      continue;
    }
    // A member (planned in an epoch): the liveness monitor judges it.
    if (FirstPlannedEpochLocked(id) < static_cast<int>(records_.size())) continue;
    left_[i] = true;
    ++events_;
    LOG(WARNING) << "worker " << id << " ('" << workers_[i].name << "', from "
                 << (workers_[i].source.empty() ? "?" : workers_[i].source)
                 << ") registered and then made no call for "
                 << absl::FormatDuration(now - last_call_[i])
                 << "; its registration is dropped (--registration_idle_s)";
  }
}

absl::Status Scheduler::RoomForLocked(const std::string& source) const {
  size_t active = 0, from_source = 0;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (left_[i]) continue;
    ++active;
    from_source += workers_[i].source == source ? 1 : 0;
  }
  if (active >= kMaxWorkers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the job already has ", active, " workers; at most ", kMaxWorkers));
  }
  if (config_.max_workers_per_source > 0 &&
      from_source >= static_cast<size_t>(config_.max_workers_per_source)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the job already has ", from_source, " workers from ", source, "; at most ",
                     config_.max_workers_per_source, " (dbs_ps --max_workers_per_host)"));
  }
  if (workers_.size() >= kMaxWorkerIds) {
    return absl::ResourceExhaustedError(absl::StrCat("the job has handed out ", workers_.size(),
                                                     " worker ids; at most ", kMaxWorkerIds,
                                                     ": start a new job"));
  }
  return absl::OkStatus();
}

int64_t EpochRecord::SamplesOf(int worker_id) const {
  auto it = layout.find(worker_id);
  if (it == layout.end()) return 0;
  int64_t n = 0;
  for (const auto& step : it->second) n += CountSamples(step);
  return n;
}

namespace {

// The batch a worker ran most often in `steps`.
int MostFrequentBatch(const StepRanges& steps) {
  std::map<int64_t, int> count;
  for (const auto& ranges : steps) ++count[CountSamples(ranges)];
  int64_t best = 0;
  int best_count = 0;
  for (const auto& [batch, c] : count) {
    if (c > best_count) {
      best = batch;
      best_count = c;
    }
  }
  return static_cast<int>(best);
}

}  // namespace

std::optional<Measurement> MeasurementOf(const EpochRecord& r, int id) {
  auto report = r.reports.find(id);
  if (report == r.reports.end()) return std::nullopt;
  Measurement m;
  m.samples = report->second.samples;
  m.compute_seconds = report->second.compute_seconds;
  auto layout = r.layout.find(id);
  if (layout != r.layout.end()) {
    for (const auto& ranges : layout->second) m.steps += CountSamples(ranges) > 0 ? 1 : 0;
  }
  auto times = r.step_times.find(id);
  if (times != r.step_times.end()) m.by_batch = times->second;
  // The server's own timing of its steps, where it has it, rather than the worker's word.
  if (!m.by_batch.empty()) {
    m.compute_seconds = 0.0;
    for (const auto& [batch, t] : m.by_batch) m.compute_seconds += t.seconds;
  }
  return m;
}

WorkerObservation Scheduler::ObserveLocked(int id, int upto) const {
  WorkerObservation o;
  o.name = workers_[id].name;
  for (int e = std::max(0, upto - kHistoryEpochs); e < upto; ++e) {
    if (std::optional<Measurement> m = MeasurementOf(records_[e], id)) {
      o.history.push_back(*std::move(m));
    }
  }
  if (upto > 0) {
    const EpochRecord& last = records_[upto - 1];
    auto plan = last.plans.find(id);
    auto layout = last.layout.find(id);
    if (plan != last.plans.end() && layout != last.layout.end() && last.dead.count(id) == 0) {
      o.previous_share = plan->second.share;
      o.current_batch = MostFrequentBatch(layout->second);
    }
  }
  return o;
}

std::vector<int> Scheduler::ActiveLocked() const {
  std::vector<int> ids;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!left_[i]) ids.push_back(static_cast<int>(i));
  }
  return ids;
}

absl::Status Scheduler::PlanNextEpochLocked(Calls* calls) {
  // A registration gone idle is not planned, so it cannot hold a step for the worker timeout.
  // (Before the start, the registrations counted as the expected workers are planned as they are.)
  if (!records_.empty()) ExpireIdleLocked();
  const int epoch = static_cast<int>(records_.size());
  const std::vector<int> active = ActiveLocked();
  const int n = static_cast<int>(active.size());
  if (n == 0) return absl::FailedPreconditionError("no workers left");
  std::vector<WorkerObservation> obs;
  for (int id : active) obs.push_back(ObserveLocked(id, epoch));
  const std::vector<double> shares =
      epoch == 0 ? policy_->FirstShares(obs) : policy_->NextShares(obs);
  DBS_ASSIGN_OR_RETURN(EpochAllocation alloc,
                       AllocateEpoch(workers_[0].train_samples, workers_[0].test_samples,
                                     config_.global_batch, shares));
  EpochRecord record;
  record.epoch = epoch;
  record.start = clock_->Now();
  record.num_steps = alloc.num_steps;
  PlanDecision& decision = record.decisions.emplace_back();
  for (int k = 0; k < n; ++k) {
    decision.workers.push_back({active[k],
                                obs[k].current_batch,
                                obs[k].previous_share,
                                false,
                                {},
                                k < static_cast<int>(shares.size()) ? shares[k] : 0.0});
  }
  const uint64_t seed = EpochSeed(config_.seed, epoch);
  for (int k = 0; k < n; ++k) {
    const int id = active[k];
    const WorkerAllocation& a = alloc.workers[k];
    WorkerPlan p;
    p.epoch = epoch;
    p.batch_size = a.batch_size;
    p.final_batch_size = a.final_batch_size;
    p.num_steps = alloc.num_steps;
    p.global_batch = config_.global_batch;
    p.permutation_seed = seed;
    p.train_ranges = a.train;
    p.test_range = a.test;
    p.share = a.share;
    p.total_epochs = config_.epochs;
    record.layout[id] = ExpandSteps(p);
    record.plans[id] = p;
  }
  records_.push_back(record);
  if (listener_ != nullptr) {
    listener_->OnEpochPlanned(epoch, alloc.num_steps, records_.back().plans);
  }
  AnswerWaitersLocked(calls);
  return absl::OkStatus();
}

WorkerPlan Scheduler::FinishedPlan(int epoch) const {
  WorkerPlan p;
  p.epoch = epoch;
  p.finished = true;
  p.total_epochs = config_.epochs;
  p.global_batch = config_.global_batch;
  return p;
}

void Scheduler::AnswerWaitersLocked(Calls* calls) {
  std::vector<Waiter> still;
  for (Waiter& w : waiters_) {
    absl::StatusOr<WorkerPlan> answer;
    if (!aborted_.ok()) {
      answer = aborted_;
    } else if (w.epoch < static_cast<int>(records_.size())) {
      auto plan = records_[w.epoch].plans.find(w.worker_id);
      if (plan == records_[w.epoch].plans.end() || left_[w.worker_id]) {
        answer = absl::NotFoundError(
            absl::StrCat("worker ", w.worker_id, " is not part of epoch ", w.epoch));
      } else {
        answer = plan->second;
      }
    } else if (finished_) {
      answer = FinishedPlan(w.epoch);
    } else {
      still.push_back(std::move(w));
      continue;
    }
    calls->push_back([done = std::move(w.done), answer]() { done(answer); });
  }
  waiters_ = std::move(still);
}

uint64_t Scheduler::AwaitPlan(int worker_id, int epoch, PlanCallback done) {
  absl::StatusOr<WorkerPlan> answer;
  {
    absl::MutexLock lock(&mu_);
    const int planned = static_cast<int>(records_.size());
    if (!aborted_.ok()) {
      answer = aborted_;
    } else if (worker_id < 0 || worker_id >= static_cast<int>(workers_.size())) {
      answer = absl::NotFoundError(
          absl::StrCat("unknown worker ", worker_id, "; call RegisterWorker first"));
    } else if (epoch < 0) {
      answer = absl::InvalidArgumentError("negative epoch");
    } else if (epoch < planned && records_[epoch].plans.count(worker_id) == 0) {
      answer =
          absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not part of epoch ", epoch));
    } else if (epoch < planned) {
      answer = records_[epoch].plans.at(worker_id);  // a repeated request gets the same plan
    } else if (epoch > planned || (epoch > config_.epochs)) {
      answer = absl::FailedPreconditionError(absl::StrCat(
          "plan for epoch ", epoch, " requested, but the job is at epoch ", planned - 1));
    } else if (finished_) {
      answer = FinishedPlan(epoch);
    } else if (planned > 0 && records_.back().plans.count(worker_id) > 0 &&
               records_.back().reports.count(worker_id) == 0) {
      answer = absl::FailedPreconditionError(absl::StrCat("worker ", worker_id,
                                                          " must report epoch ", planned - 1,
                                                          " before asking for the next plan"));
    } else if (WaitersOfLocked(worker_id) >= kMaxWaitersPerWorker) {
      // A worker waits with one call (a few more after dropped connections); more are a flood.
      answer = absl::ResourceExhaustedError(absl::StrCat(
          "worker ", worker_id, " already has ", kMaxWaitersPerWorker, " plan requests waiting"));
    } else {
      waiters_.push_back(Waiter{worker_id, epoch, std::move(done), ++last_wait_id_});
      return last_wait_id_;
    }
  }
  done(answer);
  return 0;
}

bool Scheduler::CancelAwait(uint64_t wait_id) {
  absl::MutexLock lock(&mu_);
  auto it = std::find_if(waiters_.begin(), waiters_.end(),
                         [wait_id](const Waiter& w) { return w.id == wait_id; });
  if (it == waiters_.end()) return false;
  last_call_[it->worker_id] = clock_->Now();  // idle from here
  waiters_.erase(it);
  return true;
}

int Scheduler::WaitersOfLocked(int worker_id) const {
  int n = 0;
  for (const Waiter& w : waiters_) n += w.worker_id == worker_id ? 1 : 0;
  return n;
}

absl::Status Scheduler::Report(const EpochTiming& t) {
  if (listener_ != nullptr) {
    absl::Status allowed = listener_->CanReport(t.worker_id, t.epoch);
    if (!allowed.ok()) return allowed;
  }
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    if (t.worker_id < 0 || t.worker_id >= static_cast<int>(workers_.size())) {
      return absl::NotFoundError(absl::StrCat("unknown worker ", t.worker_id));
    }
    if (t.epoch < 0 || t.epoch >= static_cast<int>(records_.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("report for epoch ", t.epoch, ", which has not been planned"));
    }
    EpochRecord& rec = records_[t.epoch];
    auto existing = rec.reports.find(t.worker_id);
    if (existing != rec.reports.end()) {
      if (existing->second == t) return absl::OkStatus();  // a retried report
      return absl::AlreadyExistsError(
          absl::StrCat("worker ", t.worker_id, " already reported epoch ", t.epoch));
    }
    auto planned = rec.plans.find(t.worker_id);
    if (planned == rec.plans.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", t.worker_id, " was not in epoch ", t.epoch,
                       "'s plan (it joined later): it has nothing to report for that epoch"));
    }
    const WorkerPlan& plan = planned->second;
    if (rec.dead.count(t.worker_id) > 0) {
      return absl::NotFoundError(
          absl::StrCat("worker ", t.worker_id, " was removed from epoch ", t.epoch, " as dead"));
    }
    if (t.samples != rec.SamplesOf(t.worker_id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "report says ", t.samples, " samples; the plan gave ", rec.SamplesOf(t.worker_id)));
    }
    if (!std::isfinite(t.compute_seconds) || t.compute_seconds < 0 ||
        !std::isfinite(t.wait_seconds) || t.wait_seconds < 0 || !std::isfinite(t.eval_seconds) ||
        t.eval_seconds < 0) {
      return absl::InvalidArgumentError("timings must be finite and non-negative");
    }
    if (t.test_samples != plan.test_range.size() || t.test_correct < 0 ||
        t.test_correct > t.test_samples) {
      return absl::InvalidArgumentError(absl::StrCat("test result ", t.test_correct, "/",
                                                     t.test_samples, " does not fit the plan's ",
                                                     plan.test_range.size(), " test samples"));
    }
    rec.reports[t.worker_id] = t;
    ++events_;
    MaybeCompleteEpochLocked(rec, &calls);
  }
  Run(calls);
  return absl::OkStatus();
}

void Scheduler::MaybeCompleteEpochLocked(EpochRecord& rec, Calls* calls) {
  // Reported or removed (a worker may be both): the union must cover every planned worker.
  size_t accounted = rec.reports.size();
  for (int id : rec.dead) accounted += rec.reports.count(id) == 0 ? 1 : 0;
  if (rec.complete || accounted < rec.plans.size()) return;
  rec.end = clock_->Now();
  rec.complete = true;
  if (listener_ != nullptr) {
    calls->push_back([this, rec]() { listener_->OnEpochCompleted(rec); });
  }
  if (static_cast<int>(records_.size()) < config_.epochs) {
    absl::Status planned = PlanNextEpochLocked(calls);
    if (!planned.ok()) AbortLocked(planned, calls);
  } else {
    finished_ = true;
    AnswerWaitersLocked(calls);
    if (listener_ != nullptr) {
      calls->push_back([this]() { listener_->OnJobFinished(absl::OkStatus()); });
    }
  }
}

std::vector<int> Scheduler::Unreported(int epoch, int* reported) const {
  absl::MutexLock lock(&mu_);
  std::vector<int> missing;
  *reported = 0;
  if (epoch < 0 || epoch >= static_cast<int>(records_.size())) return missing;
  const EpochRecord& rec = records_[epoch];
  if (rec.complete) return missing;
  *reported = static_cast<int>(rec.reports.size());
  for (const auto& [id, plan] : rec.plans) {
    if (rec.reports.count(id) == 0 && rec.dead.count(id) == 0) missing.push_back(id);
  }
  return missing;
}

absl::Status Scheduler::DropUnreported(int epoch, const std::set<int>& ids) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) {
      return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is not running"));
    }
    EpochRecord& rec = records_[epoch];
    for (int id : ids) {
      if (rec.plans.count(id) == 0 || rec.reports.count(id) > 0) continue;
      rec.dead.insert(id);
      MarkRemovedLocked(id);
    }
    if (rec.reports.empty() && rec.dead.size() >= rec.plans.size()) {
      // Every worker of the epoch is gone and none reported.
      AbortLocked(absl::UnavailableError(absl::StrCat("every worker of epoch ", epoch,
                                                      " is gone before reporting it")),
                  &calls);
    } else {
      MaybeCompleteEpochLocked(rec, &calls);
    }
  }
  Run(calls);
  return absl::OkStatus();
}

absl::StatusOr<PlanChange> Scheduler::RemoveWorkers(const std::set<int>& dead, int epoch,
                                                    int step) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) {
    return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is not running"));
  }
  EpochRecord& rec = records_[epoch];
  std::vector<int> survivors;
  std::vector<double> shares;
  for (const auto& [id, plan] : rec.plans) {
    if (rec.dead.count(id) == 0 && dead.count(id) == 0) {
      survivors.push_back(id);
      shares.push_back(plan.share > 0 ? plan.share : 1e-9);
    }
  }
  if (survivors.empty()) {
    return absl::FailedPreconditionError("every worker of the epoch is gone");
  }
  // The dead workers' part of the current step was never trained on: it becomes an extra step.
  std::vector<SampleRange> orphaned;
  for (int id : dead) {
    auto it = rec.layout.find(id);
    if (it != rec.layout.end() && step < static_cast<int>(it->second.size())) {
      orphaned.insert(orphaned.end(), it->second[step].begin(), it->second[step].end());
    }
  }
  PlanChange out = ResplitLocked(rec, survivors, shares, step + 1, std::move(orphaned));
  for (int id : dead) {
    auto it = rec.layout.find(id);
    if (it != rec.layout.end()) {
      for (size_t s = static_cast<size_t>(step); s < it->second.size(); ++s) it->second[s].clear();
    }
    rec.dead.insert(id);
    MarkRemovedLocked(id);
  }
  return out;
}

absl::StatusOr<PlanChange> Scheduler::Rebalance(int epoch, int from_step,
                                                const std::map<int, Measurement>& window) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) {
    return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is not running"));
  }
  EpochRecord& rec = records_[epoch];
  if (from_step < 1 || from_step >= rec.num_steps) {
    return absl::FailedPreconditionError("no step left to re-plan");
  }
  std::vector<int> workers;
  std::vector<WorkerObservation> obs;
  std::vector<int> current;
  for (const auto& [id, plan] : rec.plans) {
    if (rec.dead.count(id) > 0) continue;
    auto w = window.find(id);
    if (w == window.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no measurement of worker ", id));
    }
    WorkerObservation o = ObserveLocked(id, epoch);
    o.previous_share = plan.share;
    const StepRanges& steps = rec.layout.at(id);
    o.current_batch = from_step - 1 < static_cast<int>(steps.size())
                          ? static_cast<int>(CountSamples(steps[from_step - 1]))
                          : 0;
    o.history.push_back(w->second);
    workers.push_back(id);
    current.push_back(o.current_batch);
    obs.push_back(std::move(o));
  }
  const std::vector<double> shares = policy_->NextShares(obs);
  const bool keep = LargestRemainder(config_.global_batch, shares) ==
                    std::vector<int64_t>(current.begin(), current.end());
  if (static_cast<int>(rec.decisions.size()) < kMaxDecisionsPerEpoch) {
    PlanDecision& decision = rec.decisions.emplace_back();
    decision.from_step = from_step;
    decision.applied = !keep;
    for (size_t k = 0; k < workers.size(); ++k) {
      decision.workers.push_back({workers[k], obs[k].current_batch, obs[k].previous_share, true,
                                  obs[k].history.back(), k < shares.size() ? shares[k] : 0.0});
    }
  } else {
    ++rec.decisions_left_out;
  }
  if (keep) return absl::FailedPreconditionError("the policy keeps the current split");
  for (size_t k = 0; k < workers.size(); ++k) rec.plans[workers[k]].share = shares[k];
  return ResplitLocked(rec, workers, shares, from_step, {});
}

void Scheduler::RecordStep(int epoch, const std::map<int, std::pair<int64_t, double>>& times) {
  absl::MutexLock lock(&mu_);
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) return;
  EpochRecord& rec = records_[epoch];
  rec.steps_end = clock_->Now();
  for (const auto& [id, t] : times) {
    if (rec.plans.count(id) == 0 || rec.dead.count(id) > 0 || t.first <= 0 ||
        !std::isfinite(t.second) || t.second < 0) {
      continue;
    }
    rec.step_times[id][static_cast<int>(t.first)].Add(t.second);
  }
}

PlanChange Scheduler::ResplitLocked(EpochRecord& rec, const std::vector<int>& survivors,
                                    const std::vector<double>& shares, int from_step,
                                    std::vector<SampleRange> extra) {
  // Each step's block: every worker's slices of it together, whoever computed them so far.
  const int old_steps = rec.num_steps;
  std::vector<std::vector<SampleRange>> blocks(old_steps);
  for (const auto& [id, steps] : rec.layout) {
    for (int s = from_step; s < old_steps && s < static_cast<int>(steps.size()); ++s) {
      blocks[s].insert(blocks[s].end(), steps[s].begin(), steps[s].end());
    }
  }
  for (auto& [id, steps] : rec.layout) {
    for (int s = from_step; s < static_cast<int>(steps.size()); ++s) steps[s].clear();
  }
  const bool extra_step = CountSamples(extra) > 0;
  rec.num_steps = old_steps + (extra_step ? 1 : 0);
  for (int id : survivors) rec.layout[id].resize(rec.num_steps);
  auto split = [&](std::vector<SampleRange> block, int s) {
    std::sort(block.begin(), block.end(),
              [](const SampleRange& a, const SampleRange& b) { return a.begin < b.begin; });
    const std::vector<int64_t> counts = LargestRemainder(CountSamples(block), shares);
    RangeCursor cursor(block);
    for (size_t k = 0; k < survivors.size(); ++k) {
      rec.layout[survivors[k]][s] = cursor.Take(counts[k]);
    }
  };
  for (int s = from_step; s < old_steps; ++s) split(std::move(blocks[s]), s);
  if (extra_step) split(std::move(extra), old_steps);

  const std::vector<int64_t> test = LargestRemainder(workers_[0].test_samples, shares);
  int64_t test_offset = 0;
  PlanChange out;
  ++rec.revision;
  for (size_t k = 0; k < survivors.size(); ++k) {
    const int id = survivors[k];
    rec.plans[id].test_range = {test_offset, test_offset + test[k]};
    test_offset += test[k];
    PlanRevision rev;
    rev.epoch = rec.epoch;
    rev.revision = rec.revision;
    rev.from_step = from_step;
    rev.num_steps = rec.num_steps;
    rev.steps.assign(rec.layout[id].begin() + from_step, rec.layout[id].end());
    rev.test_range = rec.plans[id].test_range;
    out.revisions[id] = std::move(rev);
  }
  for (int s = from_step; s < rec.num_steps; ++s) {
    std::map<int, int> q;
    for (int id : survivors) q[id] = static_cast<int>(CountSamples(rec.layout[id][s]));
    out.later_quotas.push_back(std::move(q));
  }
  return out;
}

absl::Status Scheduler::Leave(int worker_id) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (worker_id < 0 || worker_id >= static_cast<int>(workers_.size())) {
      return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
    }
    if (left_[worker_id]) return absl::OkStatus();
    left_[worker_id] = true;
    ++events_;
    if (!finished_ && aborted_.ok() && listener_ != nullptr) {
      // Not planned again; removed from the running epoch like a dead worker, without waiting.
      calls.push_back([this, worker_id]() { listener_->OnWorkerLeft(worker_id); });
    }
  }
  Run(calls);
  return absl::OkStatus();
}

void Scheduler::AbortLocked(const absl::Status& status, Calls* calls) {
  if (!aborted_.ok() || finished_) return;
  aborted_ = status;
  AnswerWaitersLocked(calls);
  if (listener_ != nullptr) {
    calls->push_back([this, status]() { listener_->OnJobFinished(status); });
  }
}

void Scheduler::Abort(const absl::Status& status) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) {
      // The job is over; still release anyone waiting so the server can shut down.
      AnswerWaitersLocked(&calls);
    } else {
      AbortLocked(status, &calls);
    }
  }
  Run(calls);
}

Scheduler::State Scheduler::SaveState() const {
  absl::MutexLock lock(&mu_);
  return State{workers_, left_, records_, finished_, tokens_};
}

void Scheduler::LoadState(State state) {
  absl::MutexLock lock(&mu_);
  workers_ = std::move(state.workers);
  left_ = std::move(state.left);
  records_ = std::move(state.records);
  finished_ = state.finished;
  tokens_ = std::move(state.tokens);
  last_call_.assign(workers_.size(), clock_->Now());
  // A checkpoint without tokens (none are written empty) gets fresh ones: its workers register
  // again under their names.
  while (tokens_.size() < workers_.size()) tokens_.push_back(NewTokenLocked());
}

void Scheduler::StartWithAcceptedModels() {
  absl::MutexLock lock(&mu_);
  start_with_models_ = true;
}

absl::Status Scheduler::ModelAccepted(int worker_id) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (worker_id < 0 || worker_id >= static_cast<int>(workers_.size())) {
      return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
    }
    if (!start_with_models_ || !records_.empty()) return absl::OkStatus();
    models_accepted_.insert(worker_id);
    DBS_RETURN_IF_ERROR(StartIfReadyLocked(&calls));
  }
  Run(calls);
  return absl::OkStatus();
}

int Scheduler::WorkersReadyLocked() const {
  // One that registered and left (its model refused, say) is not ready, nor, when the job waits
  // for models, one whose model was not accepted.
  int ready = 0;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (left_[i]) continue;
    if (start_with_models_ && models_accepted_.count(static_cast<int>(i)) == 0) continue;
    ++ready;
  }
  return ready;
}

int Scheduler::WorkersReady() const {
  absl::MutexLock lock(&mu_);
  return WorkersReadyLocked();
}

absl::Status Scheduler::StartIfReadyLocked(Calls* calls) {
  if (!records_.empty() || !aborted_.ok()) return absl::OkStatus();
  if (WorkersReadyLocked() < config_.expected_workers) return absl::OkStatus();
  return PlanNextEpochLocked(calls);
}

void Scheduler::SetTokenKey(std::string key) {
  absl::MutexLock lock(&mu_);
  token_key_ = std::move(key);
}

std::string Scheduler::NewTokenLocked() {
  if (token_key_.empty()) return token_source_();
  return IssueWorkerToken(token_key_, static_cast<int>(tokens_.size()));
}

absl::Status Scheduler::Authenticate(int worker_id, absl::string_view token,
                                     absl::string_view identity) const {
  absl::MutexLock lock(&mu_);
  if (worker_id < 0 || worker_id >= static_cast<int>(workers_.size())) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker ", worker_id, "; call SchedulerService.RegisterWorker first"));
  }
  if (token.empty()) {
    return absl::UnauthenticatedError("the call carries no worker token (x-dbs-token)");
  }
  if (!ConstantTimeEquals(token, tokens_[worker_id])) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token does not belong to worker ", worker_id));
  }
  DBS_RETURN_IF_ERROR(CheckIdentity(worker_id, workers_[worker_id].identity, identity));
  last_call_[worker_id] = clock_->Now();
  return absl::OkStatus();
}

bool Scheduler::IsRegistered(int worker_id) const {
  absl::MutexLock lock(&mu_);
  return worker_id >= 0 && worker_id < static_cast<int>(workers_.size()) && !left_[worker_id];
}

std::vector<EpochRecord> Scheduler::History() const {
  absl::MutexLock lock(&mu_);
  return records_;
}

std::vector<WorkerRegistration> Scheduler::Workers() const {
  absl::MutexLock lock(&mu_);
  return workers_;
}

int64_t Scheduler::events() const {
  absl::MutexLock lock(&mu_);
  return events_;
}

bool Scheduler::started() const {
  absl::MutexLock lock(&mu_);
  return !records_.empty();
}

void Scheduler::MarkRemovedLocked(int id) {
  if (id < 0 || id >= static_cast<int>(left_.size())) return;
  if (!left_[id]) removed_.insert(id);  // a worker that called Leave is not coming back
  left_[id] = true;
}

int Scheduler::removed_workers_not_back() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, bool> away;  // by name: its newest registration was removed
  for (size_t i = 0; i < workers_.size(); ++i) {
    away[workers_[i].name] = removed_.count(static_cast<int>(i)) > 0;
  }
  int n = 0;
  for (const auto& [name, removed] : away) n += removed && back_after_end_.count(name) == 0;
  return n;
}

int Scheduler::active_workers() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (bool l : left_) n += l ? 0 : 1;
  return n;
}

}  // namespace dbs
