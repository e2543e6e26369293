// TrainingLoop: a worker's part of a dbs job, free of libtorch and gRPC.
//
// Run() joins the job and registers the model (so every worker starts from the first worker's
// initial values), then for each epoch: fetches the plan, trains its share of the epoch's
// permutation step by step (gradient of the step's samples, push, load the aggregated
// parameters), follows plan revisions sent with a step's result, evaluates its slice of the test
// set and reports compute-only time. When the server restarted from a checkpoint behind the
// worker, the loop asks where the job stands and continues from there (resync). It ends by
// leaving the job and writing its record.
//
// Compute time covers the gradient and the parameter copies; time inside server calls is
// reported separately as waiting. When an epoch was resumed part-way, the compute time of the
// steps trained here is scaled to the whole epoch for the speed estimate. A progress line goes to
// `LoopConfig::out` every `log_every`. The model side is a Learner, the server a PsClient, time an
// injected Clock; all three must outlive the loop. Not thread-safe.
#ifndef DBS_WORKER_TRAINING_LOOP_H_
#define DBS_WORKER_TRAINING_LOOP_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/plan.h"
#include "worker/gradient_fault.h"
#include "worker/learner.h"
#include "worker/ps_client.h"

namespace dbs {

struct LoopConfig {
  std::string name;   // worker name (unique in the job)
  std::string model;  // the model's name, for the log
  // The largest batch this worker computes at once (its memory); a larger one is computed as
  // micro-batches whose mean gradient is pushed (worker/micro_batch.h). 0: no limit.
  int max_batch = 0;
  // Called before each step's computation with the epoch and the global step (counted across
  // epochs): an emulated slowdown follows the position with it (SlowedLearner::At).
  std::function<void(int epoch, int64_t global_step)> before_step;
  absl::Duration log_every = absl::Seconds(5);
  std::string record_path;  // optional JSON record of this worker's epochs
  std::FILE* out = stdout;  // progress lines
  // Where to write the trained model (Learner::Export) at the end of the job, and every
  // `export_every_epochs` epochs when > 0 ('' : never).
  std::string export_path;
  int export_every_epochs = 0;
  // The CPU limit this worker runs under, in cores (common/cpu_limit.h; 0: none).
  double cpu_limit_cores = 0.0;
  // A faulty GPU, emulated: corrupts the gradients it pushes from a step on (testing).
  GradientFault fault;
};

// One reported epoch of this worker.
struct EpochLog {
  int batch_size = 0;
  double share = 0.0;
  EpochTiming timing;
  // The process's CPU seconds outside the computation over `outside_cpu_steps` whole steps
  // (push, answer, loading the parameters, the loop's own work, gRPC's threads): what
  // communication costs this worker's CPU.
  double outside_cpu_seconds = 0.0;
  int outside_cpu_steps = 0;
  // The job's mean training loss of each step this worker took part in, in order (the loss
  // curve, step by step).
  std::vector<double> step_losses;
};

class TrainingLoop {
 public:
  TrainingLoop(LoopConfig config, Learner* learner, PsClient* client, const Clock* clock);

  // Runs until the job ends. Errors say what failed and what to do about it.
  absl::Status Run();

  // Asks the loop to stop (SIGTERM): the call in progress is interrupted, the worker leaves the
  // job (the others go on without it) and Run returns CANCELLED. Thread-safe.
  void RequestStop();

  int worker_id() const { return id_; }
  // The epochs reported so far, in order.
  const std::vector<EpochLog>& epochs() const { return epochs_; }

 private:
  enum class Next { kGoOn, kResynced };

  absl::Status RunUntilDone();
  absl::Status StopIfAsked() const;

  absl::Status Join();
  // What this worker tells the scheduler when it (re)joins.
  WorkerRegistration Registration() const;
  absl::StatusOr<Next> FetchPlan();
  absl::StatusOr<Next> RunEpoch();
  absl::StatusOr<Next> TrainStep(int step, EpochTiming* timing);
  absl::Status ApplyRevision(const PlanRevision& rev, int step);
  // The seconds a step costs this worker: its computation's wall time, or under a CPU limit at
  // least the whole step's CPU time (since the previous push) divided by the limit.
  double StepCost(int step, double compute, absl::Duration cpu_start);
  absl::StatusOr<Next> EvaluateAndReport(EpochTiming timing);
  // Continues where the server says the job stands; false when the server cannot tell.
  bool Resync(const absl::Status& why);
  // Registers again after the server removed this worker, to rejoin at the next epoch (or to
  // learn that the job has finished); false when it cannot (then the loop ends with the
  // removal's error).
  bool Rejoin(const absl::Status& why);
  static constexpr int kMaxRejoins = 10;
  // The mean gradient of step_index_ into grad_ (in micro-batches above config_.max_batch);
  // the summed loss.
  absl::StatusOr<double> ComputeStepGradient();
  // The dataset indices of one step's permutation positions, checked against the data set.
  absl::Status IndicesOf(const std::vector<SampleRange>& ranges);
  void LogProgress(int step, int batch, double loss, const EpochTiming& timing);
  absl::Status Finish();
  // Writes the model to config_.export_path; says where.
  absl::Status ExportModel(const std::string& when);
  double Since(absl::Time t) const;
  void Say(const std::string& line) const;

  const LoopConfig config_;
  Learner* const learner_;
  PsClient* const client_;
  const Clock* const clock_;

  int id_ = -1;
  std::vector<float> params_, grad_;
  std::vector<float> micro_grad_;  // one micro-batch's gradient
  int micro_batches_said_ = -1;    // the epoch whose first micro-batched step was said
  // Where the loop stands; a resync may set any of it.
  int epoch_ = 0;
  bool need_plan_ = true;
  bool finished_ = false;
  int first_step_ = 0;
  bool pull_before_training_ = false;  // joined a running job: fetch its parameters first
  // The job had finished before this run could take part again: its parameters are not the
  // job's final ones, so nothing is exported.
  bool missed_the_end_ = false;
  int rejoins_ = 0;
  WorkerPlan plan_;
  StepRanges schedule_;
  int num_steps_ = 0;
  SampleRange test_range_;

  std::vector<int64_t> perm_, step_index_;
  int64_t global_step_ = 0;
  // CPU time when the previous step's push began (for a step's whole CPU cost under a limit).
  absl::Duration cpu_mark_;
  int mark_epoch_ = -1, mark_step_ = -1;
  double comm_cpu_ = 0.0;         // the newest whole step's CPU seconds outside its computation
  double outside_cpu_sum_ = 0.0;  // this epoch's comm_cpu_ of every whole step
  int outside_cpu_steps_ = 0;
  std::vector<double> step_losses_;  // this epoch's
  absl::Time job_start_, epoch_start_, next_log_;
  std::vector<EpochLog> epochs_;
  std::atomic<bool> stop_{false};
};

}  // namespace dbs

#endif  // DBS_WORKER_TRAINING_LOOP_H_
