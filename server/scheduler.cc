#include "server/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/permutation.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

Scheduler::Scheduler(SchedulerConfig config, std::unique_ptr<SharePolicy> policy,
                     const Clock* clock, SchedulerListener* listener, TokenSource token_source)
    : config_(config),
      policy_(std::move(policy)),
      clock_(clock),
      listener_(listener),
      table_(std::move(token_source)) {}

void Scheduler::Run(Calls& calls) {
  for (auto& c : calls) c();
  calls.clear();
}

absl::StatusOr<RegistrationResult> Scheduler::Register(const WorkerRegistration& reg) {
  DBS_RETURN_IF_ERROR(WorkerTable::Validate(reg, config_.global_batch));
  DBS_RETURN_IF_ERROR(policy_->Admits(reg.name));
  if (listener_ != nullptr) DBS_RETURN_IF_ERROR(listener_->CanRegister());
  Calls calls;
  RegistrationResult result;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    int id = table_.Find(reg.name);
    if (id >= 0) {  // the name's worker again: a retry of the same process, or an impostor
      DBS_RETURN_IF_ERROR(table_.Reclaim(id, reg.identity, clock_->Now()));
      if (table_.at(id).incarnation != reg.incarnation) {
        return absl::AlreadyExistsError(absl::StrCat(
            "a worker named '", reg.name, "' is already in the job (worker ", id,
            "); give each worker process its own name. A restarted worker can rejoin under its "
            "name once the old one has been removed (after the worker timeout)"));
      }
    } else if (finished_) {
      // Nothing to join, and nothing wrong with asking: a worker restarted after the job ended
      // (by compose or Kubernetes) learns it is done and exits successfully. No id, no token.
      table_.NoteAskedAfterEnd(reg.name);
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
    result.token = table_.token(id);
  }
  Run(calls);
  return result;
}

absl::StatusOr<int> Scheduler::AddWorkerLocked(const WorkerRegistration& reg, Calls* calls) {
  if (table_.size() > 0 && (reg.train_samples != table_.at(0).train_samples ||
                            reg.test_samples != table_.at(0).test_samples)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", reg.name, "' has ", reg.train_samples, " training and ", reg.test_samples,
        " test samples; the job's first worker has ", table_.at(0).train_samples, " and ",
        table_.at(0).test_samples, ": every worker must load the same data set"));
  }
  ExpireIdleLocked();
  DBS_RETURN_IF_ERROR(table_.RoomFor(reg.source, config_.max_workers_per_source));
  const int id = table_.Add(reg, clock_->Now());
  if (listener_ != nullptr) listener_->OnWorkerRegistered(id, table_.token(id), reg.identity);
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
  // A member (planned in an epoch) is the liveness monitor's to judge, and one waiting for its
  // plan is not idle.
  auto keep = [this](int id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return WaitersOfLocked(id) > 0 ||
           FirstPlannedEpochLocked(id) < static_cast<int>(records_.size());
  };
  for (const auto& [id, idle] : table_.ExpireIdle(now, config_.registration_idle, keep)) {
    ++events_;
    const WorkerRegistration& w = table_.at(id);
    LOG(WARNING) << "worker " << id << " ('" << w.name << "', from "
                 << (w.source.empty() ? "?" : w.source) << ") registered and then made no call for "
                 << absl::FormatDuration(idle)
                 << "; its registration is dropped (--registration_idle_s)";
  }
}

WorkerObservation Scheduler::HistoryLocked(int id, int upto) const {
  WorkerObservation o;
  o.name = table_.at(id).name;
  for (int e = std::max(0, upto - kHistoryEpochs); e < upto; ++e) {
    if (std::optional<Measurement> m = MeasurementOf(records_[e], id)) {
      o.history.push_back(*std::move(m));
    }
  }
  return o;
}

WorkerObservation Scheduler::ObserveLocked(int id, int upto) const {
  WorkerObservation o = HistoryLocked(id, upto);
  if (upto > 0) {
    const EpochRecord& last = records_[upto - 1];
    auto plan = last.plans.find(id);
    auto layout = last.layout.find(id);
    if (plan != last.plans.end() && layout != last.layout.end() && last.dead.count(id) == 0) {
      o.previous_share = plan->second.share;
      o.current_batch = MostFrequentBatch(layout->second);
    }
    const IdleRun run =
        IdleRunOf(records_, id, upto - 1, std::numeric_limits<int>::max(), kHistoryEpochs);
    o.idle_steps = run.idle_steps;
    o.out_steps = run.out_steps;
  }
  return o;
}

std::vector<int> Scheduler::ActiveLocked() const {
  std::vector<int> ids;
  for (int i = 0; i < table_.size(); ++i) {
    if (table_.InJob(i)) ids.push_back(i);
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
                       AllocateEpoch(table_.at(0).train_samples, table_.at(0).test_samples,
                                     config_.global_batch, shares));
  EpochRecord record;
  record.epoch = epoch;
  record.start = clock_->Now();
  record.num_steps = alloc.num_steps;
  PlanDecision decision;
  for (int k = 0; k < n; ++k) {
    decision.workers.push_back({active[k],
                                obs[k].current_batch,
                                obs[k].previous_share,
                                false,
                                {},
                                k < static_cast<int>(shares.size()) ? shares[k] : 0.0});
    decision.workers.back().idle_steps = obs[k].idle_steps;
    decision.workers.back().out_steps = obs[k].out_steps;
  }
  if (listener_ != nullptr) listener_->OnPlanDecision(epoch, decision);
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
      if (plan == records_[w.epoch].plans.end() || !table_.InJob(w.worker_id)) {
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
    } else if (!table_.Known(worker_id)) {
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
  table_.Touch(it->worker_id, clock_->Now());  // idle from here
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
    if (!table_.Known(t.worker_id)) {
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
      table_.MarkRemoved(id);
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

absl::Status Scheduler::Leave(int worker_id) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (!table_.Known(worker_id)) {
      return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
    }
    if (!table_.Leave(worker_id)) return absl::OkStatus();
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
  return State{table_.all(), table_.left(), records_, finished_, table_.tokens()};
}

void Scheduler::LoadState(State state) {
  absl::MutexLock lock(&mu_);
  table_.Load(std::move(state.workers), std::move(state.left), std::move(state.tokens),
              clock_->Now());
  records_ = std::move(state.records);
  finished_ = state.finished;
}

void Scheduler::StartWithAcceptedModels() {
  absl::MutexLock lock(&mu_);
  start_with_models_ = true;
}

absl::Status Scheduler::ModelAccepted(int worker_id) {
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    if (!table_.Known(worker_id)) {
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
  for (int i = 0; i < table_.size(); ++i) {
    if (!table_.InJob(i)) continue;
    if (start_with_models_ && models_accepted_.count(i) == 0) continue;
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
  table_.SetTokenKey(std::move(key));
}

absl::Status Scheduler::Authenticate(int worker_id, absl::string_view token,
                                     absl::string_view identity) const {
  absl::MutexLock lock(&mu_);
  return table_.Authenticate(worker_id, token, identity, clock_->Now());
}

bool Scheduler::IsRegistered(int worker_id) const {
  absl::MutexLock lock(&mu_);
  return table_.InJob(worker_id);
}

std::vector<EpochRecord> Scheduler::History() const {
  absl::MutexLock lock(&mu_);
  return records_;
}

std::vector<WorkerRegistration> Scheduler::Workers() const {
  absl::MutexLock lock(&mu_);
  return table_.all();
}

int64_t Scheduler::events() const {
  absl::MutexLock lock(&mu_);
  return events_;
}

bool Scheduler::started() const {
  absl::MutexLock lock(&mu_);
  return !records_.empty();
}

int Scheduler::removed_workers_not_back() const {
  absl::MutexLock lock(&mu_);
  return table_.RemovedNotBack();
}

int Scheduler::active_workers() const {
  absl::MutexLock lock(&mu_);
  return table_.Active();
}

}  // namespace dbs
