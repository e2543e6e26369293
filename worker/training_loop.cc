#include "worker/training_loop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/permutation.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/micro_batch.h"

namespace dbs {
namespace {

std::string MinSec(double seconds) {
  const int s = static_cast<int>(seconds + 0.5);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

bool InRange(const SampleRange& r, int64_t size) {
  return r.begin >= 0 && r.end <= size && r.begin <= r.end;
}

}  // namespace

TrainingLoop::TrainingLoop(LoopConfig config, Learner* learner, PsClient* client,
                           const Clock* clock)
    : config_(std::move(config)), learner_(learner), client_(client), clock_(clock) {}

double TrainingLoop::Since(absl::Time t) const { return absl::ToDoubleSeconds(clock_->Now() - t); }

void TrainingLoop::Say(const std::string& line) const {
  absl::FPrintF(config_.out, "[%s] %s\n", config_.name, line);
  std::fflush(config_.out);
}

void TrainingLoop::RequestStop() {
  stop_.store(true);
  client_->Interrupt();
}

absl::Status TrainingLoop::StopIfAsked() const {
  if (!stop_.load()) return absl::OkStatus();
  return absl::CancelledError("stopped by a signal");
}

absl::Status TrainingLoop::Run() {
  const absl::Status result = RunUntilDone();
  if (!stop_.load()) return result;
  // Stopping: leave, so the job re-splits this worker's samples at once instead of waiting for
  // its timeout.
  if (id_ >= 0) {
    const absl::Status left = client_->Leave(id_);
    Say(left.ok() ? "stopped: left the job; the others go on"
                  : absl::StrCat("stopped; leaving the job failed: ", left.ToString()));
  }
  return absl::CancelledError("stopped by a signal");
}

absl::Status TrainingLoop::RunUntilDone() {
  job_start_ = clock_->Now();
  DBS_RETURN_IF_ERROR(Join());
  while (!finished_) {
    DBS_RETURN_IF_ERROR(StopIfAsked());
    if (need_plan_) {
      DBS_ASSIGN_OR_RETURN(Next next, FetchPlan());
      if (next == Next::kResynced || finished_) continue;
    }
    need_plan_ = true;
    DBS_ASSIGN_OR_RETURN(Next next, RunEpoch());
    if (next == Next::kGoOn) ++epoch_;
  }
  return Finish();
}

absl::Status TrainingLoop::Join() {
  const ModelLayout& layout = learner_->layout();
  const size_t model_size = static_cast<size_t>(TotalElements(layout));
  params_.assign(model_size, 0.0f);
  grad_.assign(model_size, 0.0f);
  learner_->GetParameters(absl::MakeSpan(params_));
  DBS_ASSIGN_OR_RETURN(RegistrationResult joined, client_->RegisterWorker(Registration()));
  if (joined.job_finished) {
    // Restarted after the end (a crash, an orchestrator's retry): done, successfully.
    Say(absl::StrFormat("the job has already finished (%d epochs): nothing to train",
                        joined.epochs));
    finished_ = true;
    missed_the_end_ = true;
    return absl::OkStatus();
  }
  id_ = joined.worker_id;
  Say(absl::StrFormat(
      "joined as worker %d on %s: %d train / %d test samples, model %s "
      "(%d parameters), policy %s, %d epochs, global batch %d",
      id_, learner_->device(), learner_->train_size(), learner_->test_size(), config_.model,
      model_size, joined.policy, joined.epochs, joined.global_batch));
  if (config_.cpu_limit_cores > 0) {
    Say(
        absl::StrFormat("running under a CPU limit of %.3g cores: a step costs at least its CPU "
                        "time / %.3g",
                        config_.cpu_limit_cores, config_.cpu_limit_cores));
  }
  if (absl::Status registered =
          client_->RegisterModel(id_, layout, params_, absl::MakeSpan(params_));
      !registered.ok()) {
    // Refused (a model other than the job's, ...): it leaves, so that the job does not count on
    // a worker that cannot train in it.
    (void)client_->Leave(id_);
    return registered;
  }
  learner_->SetParameters(params_);
  epoch_ = joined.start_epoch;
  pull_before_training_ = joined.start_epoch > 0;
  if (joined.start_epoch > 0) {
    Say(absl::StrCat("joining a running job: training from epoch ", joined.start_epoch + 1,
                     " on, from the current parameters"));
  }
  return absl::OkStatus();
}

WorkerRegistration TrainingLoop::Registration() const {
  WorkerRegistration reg;
  reg.name = config_.name;
  reg.train_samples = learner_->train_size();
  reg.test_samples = learner_->test_size();
  reg.device = learner_->device();
  reg.cpu_limit_cores = config_.cpu_limit_cores;
  return reg;
}

absl::StatusOr<TrainingLoop::Next> TrainingLoop::FetchPlan() {
  absl::StatusOr<WorkerPlan> next = client_->GetEpochPlan(id_, epoch_);
  if (!next.ok()) {
    if (absl::IsFailedPrecondition(next.status()) && Resync(next.status())) return Next::kResynced;
    // Removed while it waited (a restarted server that did not hear from it in time).
    if (absl::IsNotFound(next.status()) && Rejoin(next.status())) return Next::kResynced;
    return next.status();
  }
  DBS_RETURN_IF_ERROR(ValidatePlan(*next, learner_->train_size(), learner_->test_size()));
  plan_ = *std::move(next);
  if (plan_.finished) {
    finished_ = true;
    if (pull_before_training_) {
      // Rejoined with nothing left to train: the job's final parameters are still to be had.
      DBS_RETURN_IF_ERROR(client_->PullParameters(id_, absl::MakeSpan(params_)).status());
      learner_->SetParameters(params_);
      pull_before_training_ = false;
    }
    return Next::kGoOn;
  }
  schedule_ = ExpandSteps(plan_);
  num_steps_ = plan_.num_steps;
  test_range_ = plan_.test_range;
  first_step_ = 0;
  if (pull_before_training_) {
    // Joined a running job: the others trained between our registration and this epoch.
    DBS_RETURN_IF_ERROR(client_->PullParameters(id_, absl::MakeSpan(params_)).status());
    learner_->SetParameters(params_);
    pull_before_training_ = false;
  }
  return Next::kGoOn;
}

absl::StatusOr<TrainingLoop::Next> TrainingLoop::RunEpoch() {
  perm_ = EpochPermutation(learner_->train_size(), plan_.permutation_seed);
  EpochTiming timing;
  timing.worker_id = id_;
  timing.epoch = epoch_;
  // Steps done before a resume were counted by the server already.
  int64_t resumed_samples = 0;
  for (int s = 0; s < first_step_ && s < static_cast<int>(schedule_.size()); ++s) {
    resumed_samples += CountSamples(schedule_[s]);
  }
  epoch_start_ = clock_->Now();
  next_log_ = epoch_start_ + config_.log_every;
  outside_cpu_sum_ = 0.0;
  outside_cpu_steps_ = 0;
  step_losses_.clear();
  for (int step = first_step_; step < num_steps_; ++step) {
    DBS_RETURN_IF_ERROR(StopIfAsked());
    DBS_ASSIGN_OR_RETURN(Next next, TrainStep(step, &timing));
    if (next == Next::kResynced) return next;
  }
  // Before reporting: if the server went away meanwhile it may have restarted behind us.
  if (client_->TakeReconnected() &&
      Resync(absl::UnavailableError("the server restarted during the epoch"))) {
    return Next::kResynced;
  }
  if (resumed_samples > 0 && timing.samples > 0) {
    // Only part of the epoch was timed here: scale to the whole for the speed estimate.
    timing.compute_seconds *=
        static_cast<double>(timing.samples + resumed_samples) / static_cast<double>(timing.samples);
  }
  timing.samples += resumed_samples;
  return EvaluateAndReport(timing);
}

absl::StatusOr<double> TrainingLoop::ComputeStepGradient() {
  const int b = static_cast<int>(step_index_.size());
  const int k = MicroBatches(b, config_.max_batch);
  if (k > 1 && epoch_ != micro_batches_said_) {  // once an epoch
    micro_batches_said_ = epoch_;
    Say(
        absl::StrFormat("batch %d is over --max_batch=%d: computed as %d micro-batches, their "
                        "mean gradient pushed (so for every batch over it this epoch)",
                        b, config_.max_batch, k));
  }
  return ComputeInMicroBatches(
      learner_->layout(), step_index_, config_.max_batch,
      [this](absl::Span<const int64_t> indices, absl::Span<float> grad) {
        return learner_->ComputeGradient(indices, grad);
      },
      absl::MakeSpan(grad_), &micro_grad_);
}

absl::Status TrainingLoop::IndicesOf(const std::vector<SampleRange>& ranges) {
  step_index_.clear();
  for (const SampleRange& r : ranges) {
    if (!InRange(r, learner_->train_size())) {
      return absl::InvalidArgumentError("the plan's sample range is outside the data set");
    }
    step_index_.insert(step_index_.end(), perm_.begin() + r.begin, perm_.begin() + r.end);
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainingLoop::Next> TrainingLoop::TrainStep(int step, EpochTiming* timing) {
  if (step >= static_cast<int>(schedule_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", schedule_.size(),
                                                   " steps of samples but ", num_steps_, " steps"));
  }
  DBS_RETURN_IF_ERROR(IndicesOf(schedule_[step]));
  const int b = static_cast<int>(step_index_.size());
  const absl::Time t0 = clock_->Now();
  const absl::Duration cpu_start = clock_->ProcessCpuTime();
  double loss_sum = 0.0;
  if (b > 0) {
    if (config_.before_step) config_.before_step(epoch_, global_step_);
    absl::StatusOr<double> loss = ComputeStepGradient();
    if (!loss.ok()) {
      // This worker cannot go on; leaving lets the job re-split its samples at once.
      const absl::Status left = client_->Leave(id_);
      Say(absl::StrCat("cannot train: ", loss.status().message(),
                       left.ok() ? "; left the job" : "; leaving the job failed"));
      return loss.status();
    }
    loss_sum = *loss;
    if (config_.fault.Apply(global_step_, absl::MakeSpan(grad_)) &&
        global_step_ == config_.fault.from_step) {
      Say(absl::StrCat("from this step (", global_step_,
                       ") on, every pushed gradient is corrupted (--corrupt_gradient)"));
    }
  }
  ++global_step_;
  const double compute = Since(t0);
  const double cost = StepCost(step, compute, cpu_start);
  const absl::Time t1 = clock_->Now();
  absl::StatusOr<StepOutcome> pushed = client_->PushGradient(
      id_, epoch_, step, b, loss_sum, cost,
      b > 0 ? absl::Span<const float>(grad_) : absl::Span<const float>(), absl::MakeSpan(params_));
  if (!pushed.ok()) {
    // A restarted server may be behind this worker, or hold an older plan of this step (its
    // checkpoint predates a revision it sent): ask where to continue.
    const bool restarted_elsewhere =
        absl::IsInvalidArgument(pushed.status()) && client_->TakeReconnected();
    if ((absl::IsFailedPrecondition(pushed.status()) || restarted_elsewhere) &&
        Resync(pushed.status())) {
      return Next::kResynced;
    }
    // Removed from the job (declared dead while it was slow or cut off): join again.
    if (absl::IsNotFound(pushed.status()) && Rejoin(pushed.status())) return Next::kResynced;
    return pushed.status();
  }
  const absl::Time t2 = clock_->Now();
  learner_->SetParameters(params_);
  timing->compute_seconds += compute + Since(t2);
  timing->wait_seconds += absl::ToDoubleSeconds(t2 - t1);
  timing->samples += b;
  step_losses_.push_back(pushed->global_loss);
  if (pushed->revised) DBS_RETURN_IF_ERROR(ApplyRevision(pushed->revision, step));
  LogProgress(step, b, pushed->global_loss, *timing);
  return Next::kGoOn;
}

double TrainingLoop::StepCost(int step, double compute, absl::Duration cpu_start) {
  const absl::Duration now = clock_->ProcessCpuTime();
  const double compute_cpu = absl::ToDoubleSeconds(now - cpu_start);
  const bool whole = mark_epoch_ == epoch_ && mark_step_ == step - 1;
  const double cycle_cpu = whole ? absl::ToDoubleSeconds(now - cpu_mark_) : compute_cpu + comm_cpu_;
  if (whole) {
    comm_cpu_ = std::max(0.0, cycle_cpu - compute_cpu);
    outside_cpu_sum_ += comm_cpu_;
    ++outside_cpu_steps_;
  }
  cpu_mark_ = now;
  mark_epoch_ = epoch_;
  mark_step_ = step;
  if (!(config_.cpu_limit_cores > 0)) return compute;
  return std::max(compute, cycle_cpu / config_.cpu_limit_cores);
}

absl::Status TrainingLoop::ApplyRevision(const PlanRevision& rev, int step) {
  if (rev.epoch != epoch_ || rev.from_step != step + 1 ||
      rev.num_steps != rev.from_step + static_cast<int>(rev.steps.size())) {
    return absl::InvalidArgumentError("the server sent an inconsistent plan revision");
  }
  DBS_RETURN_IF_ERROR(ValidateRevision(rev, learner_->train_size(), learner_->test_size()));
  schedule_.resize(rev.num_steps);
  std::copy(rev.steps.begin(), rev.steps.end(), schedule_.begin() + rev.from_step);
  num_steps_ = rev.num_steps;
  test_range_ = rev.test_range;
  Say(absl::StrFormat("epoch %d re-planned at step %d (revision %d): %d steps, my next batch %d",
                      epoch_ + 1, step + 1, rev.revision, num_steps_,
                      rev.steps.empty() ? 0 : CountSamples(rev.steps[0])));
  return absl::OkStatus();
}

void TrainingLoop::LogProgress(int step, int batch, double loss, const EpochTiming& timing) {
  if (clock_->Now() < next_log_ && step != num_steps_ - 1) return;
  next_log_ = clock_->Now() + config_.log_every;
  const double elapsed = Since(epoch_start_);
  const double per_step = elapsed / (step - first_step_ + 1);
  const double epoch_eta = per_step * (num_steps_ - step - 1);
  const double job_eta = epoch_eta + per_step * num_steps_ * (plan_.total_epochs - epoch_ - 1);
  Say(absl::StrFormat(
      "epoch %d/%d step %d/%d | loss %.4f | batch %d | %.0f samples/s "
      "| epoch ETA %s | job ETA %s",
      epoch_ + 1, plan_.total_epochs, step + 1, num_steps_, loss, batch,
      timing.samples / std::max(elapsed, 1e-9), MinSec(epoch_eta), MinSec(job_eta)));
}

absl::StatusOr<TrainingLoop::Next> TrainingLoop::EvaluateAndReport(EpochTiming timing) {
  if (!InRange(test_range_, learner_->test_size())) {
    return absl::InvalidArgumentError("the plan's test range is outside the test set");
  }
  const absl::Time eval_start = clock_->Now();
  const EvalResult eval = learner_->Evaluate(test_range_.begin, test_range_.end);
  timing.eval_seconds = Since(eval_start);
  timing.test_samples = eval.samples;
  timing.test_correct = eval.correct;
  timing.test_loss_sum = eval.loss_sum;
  const absl::Status reported = client_->ReportEpoch(timing);
  if (!reported.ok()) {
    // A server that restarted meanwhile does not know this epoch's steps.
    if ((absl::IsFailedPrecondition(reported) || absl::IsInvalidArgument(reported)) &&
        client_->TakeReconnected() && Resync(reported)) {
      return Next::kResynced;
    }
    // Removed before its report arrived: the epoch completed without it.
    if (absl::IsNotFound(reported) && Rejoin(reported)) return Next::kResynced;
    return reported;
  }
  const double n = std::max<double>(eval.samples, 1);
  const std::string result =
      eval.samples == 0 ? "no test slice"
      : eval.classified
          ? absl::StrFormat("accuracy on its test slice %.2f%%", 100.0 * eval.correct / n)
          : absl::StrFormat("loss on its test slice %.6g", eval.loss_sum / n);
  const std::string outside = outside_cpu_steps_ == 0
                                  ? ""
                                  : absl::StrFormat(", CPU outside compute %.3f ms/step",
                                                    1e3 * outside_cpu_sum_ / outside_cpu_steps_);
  Say(absl::StrFormat(
      "epoch %d/%d done: %d samples, batch %d (share %.3f), compute %.2f s, "
      "wait %.2f s, eval %.2f s%s, %s",
      epoch_ + 1, plan_.total_epochs, timing.samples, plan_.batch_size, plan_.share,
      timing.compute_seconds, timing.wait_seconds, timing.eval_seconds, outside, result));
  // An epoch reported again (to a server restarted before it recorded the first report) is
  // one epoch: the newer report replaces the older.
  if (!epochs_.empty() && epochs_.back().timing.epoch == timing.epoch) epochs_.pop_back();
  epochs_.push_back(
      {plan_.batch_size, plan_.share, timing, outside_cpu_sum_, outside_cpu_steps_, step_losses_});
  if (!config_.export_path.empty() && config_.export_every_epochs > 0 &&
      (epoch_ + 1) % config_.export_every_epochs == 0) {
    // A periodic copy: a failure is reported and training goes on.
    const absl::Status exported = ExportModel(absl::StrCat("after epoch ", epoch_ + 1));
    if (!exported.ok()) Say(absl::StrCat("warning: ", exported.message()));
  }
  return Next::kGoOn;
}

bool TrainingLoop::Rejoin(const absl::Status& why) {
  if (rejoins_ >= kMaxRejoins) return false;
  absl::StatusOr<RegistrationResult> joined = client_->RegisterWorker(Registration());
  if (!joined.ok()) return false;
  ++rejoins_;
  if (joined->job_finished) {
    Say(
        absl::StrFormat("removed from the job (%s); it has finished meanwhile, so there is "
                        "nothing left to join",
                        why.message()));
    id_ = -1;
    finished_ = true;
    missed_the_end_ = true;
    return true;
  }
  id_ = joined->worker_id;
  epoch_ = joined->start_epoch;
  need_plan_ = true;
  pull_before_training_ = true;
  if (joined->start_epoch >= joined->epochs) {
    Say(
        absl::StrFormat("removed from the job (%s); its last epoch was already under way, so "
                        "there is nothing left to join",
                        why.message()));
  } else {
    Say(absl::StrFormat("removed from the job (%s); joined again as worker %d from epoch %d",
                        why.message(), id_, epoch_ + 1));
  }
  return true;
}

bool TrainingLoop::Resync(const absl::Status& why) {
  // On failure the caller reports the original error; the line says why no resume followed.
  absl::StatusOr<ResumePoint> r = client_->Resume(id_, absl::MakeSpan(params_));
  // Declared dead meanwhile (it was cut off longer than the worker timeout): join again.
  if (absl::IsNotFound(r.status()) && Rejoin(r.status())) return true;
  if (!r.ok()) {
    Say(absl::StrCat("cannot resume after '", why.message(), "': ", r.status().ToString()));
    return false;
  }
  if (r->has_plan) {
    absl::Status valid = ValidatePlan(r->plan, learner_->train_size(), learner_->test_size());
    if (valid.ok()) {
      valid = ValidateRevision(r->schedule, learner_->train_size(), learner_->test_size());
    }
    if (!valid.ok()) {
      Say(absl::StrCat("cannot resume after '", why.message(), "': ", valid.ToString()));
      return false;
    }
  }
  client_->TakeReconnected();  // this resume accounts for the outage
  learner_->SetParameters(params_);
  finished_ = r->finished;
  epoch_ = r->epoch;
  need_plan_ = !r->has_plan;
  if (r->has_plan) {
    plan_ = r->plan;
    schedule_ = r->schedule.steps;
    num_steps_ = r->schedule.num_steps;
    test_range_ = r->schedule.test_range;
    first_step_ = r->step;
  }
  Say(absl::StrFormat("resuming at epoch %d step %d from the server's state (%s)", epoch_ + 1,
                      r->step + 1, why.message()));
  return true;
}

absl::Status TrainingLoop::ExportModel(const std::string& when) {
  const absl::Status exported = learner_->Export(config_.export_path);
  if (exported.ok()) Say(absl::StrCat("model exported to ", config_.export_path, " (", when, ")"));
  return exported;
}

absl::Status TrainingLoop::Finish() {
  if (id_ >= 0) {
    const absl::Status left = client_->Leave(id_);
    if (!left.ok()) Say(absl::StrCat("warning: ", left.ToString()));
  }
  if (!config_.export_path.empty() && missed_the_end_) {
    Say(absl::StrCat("not exported to ", config_.export_path,
                     ": the job finished without this run, which does not hold its final "
                     "parameters"));
  } else if (!config_.export_path.empty()) {
    // The parameters are the job's final ones (the last step's answer).
    DBS_RETURN_IF_ERROR(ExportModel("end of the job"));
  }
  Say(absl::StrFormat("finished: %d epochs in %.1f s", epochs_.size(), Since(job_start_)));
  if (config_.record_path.empty()) return absl::OkStatus();
  nlohmann::json epochs = nlohmann::json::array();
  for (const EpochLog& e : epochs_) {
    epochs.push_back({{"epoch", e.timing.epoch},
                      {"batch_size", e.batch_size},
                      {"share", e.share},
                      {"samples", e.timing.samples},
                      {"compute_seconds", e.timing.compute_seconds},
                      {"wait_seconds", e.timing.wait_seconds},
                      {"eval_seconds", e.timing.eval_seconds},
                      {"outside_compute_cpu_seconds", e.outside_cpu_seconds},
                      {"outside_compute_cpu_steps", e.outside_cpu_steps},
                      {"test_samples", e.timing.test_samples},
                      {"test_correct", e.timing.test_correct},
                      {"step_losses", e.step_losses}});
  }
  const nlohmann::json record = {{"worker_id", id_}, {"name", config_.name}, {"epochs", epochs}};
  return WriteFileAtomic(config_.record_path, record.dump(2) + "\n");
}

}  // namespace dbs
