// StepStatistics: what the step barrier learns from the pushes it counts, apart from their
// gradients: the step's losses and samples, each worker's timing of its step as it reported it
// and as the server observed it, each epoch's loss totals, and the (worker, step) pushes counted,
// for the sample audit. Not thread-safe: the StepAggregator guards it with a lock of its own,
// so that status reports, the liveness monitor and the audit never wait for a step's sum.
#ifndef DBS_SERVER_STEP_STATISTICS_H_
#define DBS_SERVER_STEP_STATISTICS_H_

#include <cstdint>
#include <map>
#include <set>
#include <utility>

#include "absl/time/time.h"
#include "common/clock.h"

namespace dbs {

// Loss totals of an epoch.
struct EpochLoss {
  double loss_sum = 0.0;
  int64_t samples = 0;
  int steps_completed = 0;
  double mean() const { return samples > 0 ? loss_sum / samples : 0.0; }
};

// What each worker reported with its push of a completed step.
struct StepStats {
  int epoch = 0;
  int step = 0;
  bool last_of_epoch = false;  // nothing is left to re-plan
  // The step's losses summed in worker order (repeatable), and its samples.
  double loss_sum = 0.0;
  int64_t samples = 0;
  // id -> (samples, compute seconds as the worker reported them).
  std::map<int, std::pair<int64_t, double>> workers;
  // id -> the worker's step as the server observed it: from the previous step's answers (the
  // epoch's plans, for its first step) going out to this push arriving. It holds the worker's
  // compute, its decoding and encoding, both transfers and its share of the answers'
  // serialisation, none of the wait for other workers. Absent without a clock and for a step
  // the server did not see begin (the first after a restore).
  std::map<int, double> cycle;
};

class StepStatistics {
 public:
  // `clock` (null: no cycles are measured) must outlive the statistics.
  explicit StepStatistics(const Clock* clock) : clock_(clock) {}

  // `epoch`'s plans go out now: its first pushes are timed from here.
  void BeginEpoch(int epoch);
  // The answers of (epoch, step) go out now: each worker's next push is timed from here.
  void Released(int epoch, int step);
  // `worker`'s push of (epoch, step) was counted.
  void Accepted(int worker, int epoch, int step, int samples, double loss_sum,
                double compute_seconds);
  // The step's statistics; the next step's start empty. When the step `applied`, its losses
  // count toward its epoch's.
  StepStats EndStep(int epoch, int step, bool last_of_epoch, bool applied);
  // Forgets the step's pushes (it will not complete: the job aborted, or a new epoch began).
  void DropStep();

  EpochLoss LossOf(int epoch) const;
  // The (worker, step) pushes counted in `epoch`.
  std::set<std::pair<int, int>> AcceptedPushes(int epoch) const;
  // Pushes counted over the whole job.
  int64_t accepted_pushes() const { return accepted_pushes_; }
  const std::map<int, EpochLoss>& losses() const { return epoch_loss_; }
  // A restored checkpoint's: its epochs' losses and the pushes counted in `epoch`.
  void Restore(int epoch, std::map<int, EpochLoss> losses, std::set<std::pair<int, int>> accepted);

 private:
  const Clock* const clock_;
  // The step being collected: its pushes' loss sums (added in worker order when it ends), their
  // samples, and their timings.
  std::map<int, double> losses_;
  StepStats step_;
  std::map<int, EpochLoss> epoch_loss_;
  std::map<int, std::set<std::pair<int, int>>> accepted_;
  int64_t accepted_pushes_ = 0;
  // When the answers of (released_epoch_, released_step_) went out (step -1: the epoch's plans).
  absl::Time released_ = absl::InfinitePast();
  int released_epoch_ = -1;
  int released_step_ = -1;
};

}  // namespace dbs

#endif  // DBS_SERVER_STEP_STATISTICS_H_
