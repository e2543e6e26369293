#include "server/scheduler.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/permutation.h"
#include "common/status_macros.h"

namespace dbs {

Scheduler::Scheduler(SchedulerConfig config, std::unique_ptr<SharePolicy> policy,
                     const Clock* clock, SchedulerListener* listener)
    : config_(config), policy_(std::move(policy)), clock_(clock), listener_(listener) {}

absl::Status Scheduler::ValidateConfig(const SchedulerConfig& c) {
  if (c.expected_workers < 1) return absl::InvalidArgumentError("need at least one worker");
  if (c.epochs < 1) return absl::InvalidArgumentError("need at least one epoch");
  if (c.global_batch < 1) return absl::InvalidArgumentError("global batch must be positive");
  return absl::OkStatus();
}

void Scheduler::Run(Calls& calls) {
  for (auto& c : calls) c();
  calls.clear();
}

absl::StatusOr<RegistrationResult> Scheduler::Register(const WorkerRegistration& reg) {
  if (reg.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (reg.train_samples <= 0) {
    return absl::InvalidArgumentError("worker reports an empty training set");
  }
  if (reg.test_samples < 0) return absl::InvalidArgumentError("negative test set size");
  Calls calls;
  RegistrationResult result;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    int id = -1;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i].name == reg.name && !left_[i]) id = static_cast<int>(i);
    }
    if (id < 0) {
      if (static_cast<int>(workers_.size()) >= config_.expected_workers) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the job already has its ", config_.expected_workers,
            " workers; joining a running job is not supported in this version"));
      }
      if (!workers_.empty() && (reg.train_samples != workers_[0].train_samples ||
                                reg.test_samples != workers_[0].test_samples)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "worker '", reg.name, "' has ", reg.train_samples, " training and ",
            reg.test_samples, " test samples; the job's first worker has ",
            workers_[0].train_samples, " and ", workers_[0].test_samples,
            ": every worker must load the same data set"));
      }
      id = static_cast<int>(workers_.size());
      workers_.push_back(reg);
      left_.push_back(false);
      if (static_cast<int>(workers_.size()) == config_.expected_workers) {
        DBS_RETURN_IF_ERROR(PlanNextEpochLocked(&calls));
      }
    }
    result.worker_id = id;
    result.expected_workers = config_.expected_workers;
    result.epochs = config_.epochs;
    result.global_batch = config_.global_batch;
    result.policy = policy_->name();
  }
  Run(calls);
  return result;
}

absl::Status Scheduler::PlanNextEpochLocked(Calls* calls) {
  const int epoch = static_cast<int>(records_.size());
  const int n = static_cast<int>(workers_.size());
  std::vector<double> shares;
  if (epoch == 0) {
    shares.assign(n, 1.0 / n);
  } else {
    const EpochRecord& prev = records_.back();
    std::vector<WorkerObservation> obs;
    for (int id = 0; id < n; ++id) {
      WorkerObservation o;
      o.previous_share = prev.plans.at(id).share;
      const EpochTiming& t = prev.reports.at(id);
      o.samples = t.samples;
      o.compute_seconds = t.compute_seconds;
      for (int e = epoch - 2; e >= 0 && e >= epoch - 8; --e) {
        auto r = records_[e].reports.find(id);
        if (r != records_[e].reports.end()) {
          o.earlier.push_back({r->second.samples, r->second.compute_seconds});
        }
      }
      obs.push_back(o);
    }
    shares = policy_->NextShares(obs);
  }
  DBS_ASSIGN_OR_RETURN(EpochAllocation alloc,
                       AllocateEpoch(workers_[0].train_samples, workers_[0].test_samples,
                                     config_.global_batch, shares));
  EpochRecord record;
  record.epoch = epoch;
  record.start = clock_->Now();
  const uint64_t seed = EpochSeed(config_.seed, epoch);
  for (int id = 0; id < n; ++id) {
    const WorkerAllocation& a = alloc.workers[id];
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
      answer = records_[w.epoch].plans.at(w.worker_id);
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

void Scheduler::AwaitPlan(int worker_id, int epoch, PlanCallback done) {
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
    } else if (epoch < planned) {
      answer = records_[epoch].plans.at(worker_id);  // a repeated request gets the same plan
    } else if (epoch > planned || (epoch > config_.epochs)) {
      answer = absl::FailedPreconditionError(absl::StrCat(
          "plan for epoch ", epoch, " requested, but the job is at epoch ", planned - 1));
    } else if (finished_) {
      answer = FinishedPlan(epoch);
    } else if (planned > 0 && records_.back().reports.count(worker_id) == 0) {
      answer = absl::FailedPreconditionError(absl::StrCat(
          "worker ", worker_id, " must report epoch ", planned - 1,
          " before asking for the next plan"));
    } else {
      waiters_.push_back(Waiter{worker_id, epoch, std::move(done)});
      return;
    }
  }
  done(answer);
}

absl::Status Scheduler::Report(const EpochTiming& t) {
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
      return absl::AlreadyExistsError(absl::StrCat("worker ", t.worker_id,
                                                   " already reported epoch ", t.epoch));
    }
    const WorkerPlan& plan = rec.plans.at(t.worker_id);
    if (t.samples != plan.TrainSamples()) {
      return absl::InvalidArgumentError(absl::StrCat("report says ", t.samples,
                                                     " samples; the plan gave ",
                                                     plan.TrainSamples()));
    }
    if (!std::isfinite(t.compute_seconds) || t.compute_seconds < 0 ||
        !std::isfinite(t.wait_seconds) || t.wait_seconds < 0 || !std::isfinite(t.eval_seconds) ||
        t.eval_seconds < 0) {
      return absl::InvalidArgumentError("timings must be finite and non-negative");
    }
    if (t.test_samples != plan.test_range.size() || t.test_correct < 0 ||
        t.test_correct > t.test_samples) {
      return absl::InvalidArgumentError(absl::StrCat(
          "test result ", t.test_correct, "/", t.test_samples, " does not fit the plan's ",
          plan.test_range.size(), " test samples"));
    }
    rec.reports[t.worker_id] = t;
    if (rec.reports.size() < rec.plans.size()) return absl::OkStatus();

    rec.end = clock_->Now();
    rec.complete = true;
    if (listener_ != nullptr) {
      calls.push_back([this, rec]() { listener_->OnEpochCompleted(rec); });
    }
    if (static_cast<int>(records_.size()) < config_.epochs) {
      absl::Status planned = PlanNextEpochLocked(&calls);
      if (!planned.ok()) AbortLocked(planned, &calls);
    } else {
      finished_ = true;
      AnswerWaitersLocked(&calls);
      if (listener_ != nullptr) {
        calls.push_back([this]() { listener_->OnJobFinished(absl::OkStatus()); });
      }
    }
  }
  Run(calls);
  return absl::OkStatus();
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
    if (!finished_ && aborted_.ok()) {
      AbortLocked(absl::AbortedError(absl::StrCat(
                      "worker ", worker_id, " ('", workers_[worker_id].name,
                      "') left before training finished; this version does not re-plan "
                      "without it")),
                  &calls);
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

int Scheduler::active_workers() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (bool l : left_) n += l ? 0 : 1;
  return n;
}

}  // namespace dbs
