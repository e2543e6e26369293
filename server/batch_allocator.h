// BatchAllocator: the pure arithmetic of Dynamic Batch Size.
//
// From per-worker shares it derives integer batch sizes that sum exactly to the global batch
// (largest remainder), contiguous ranges of the epoch's permutation that cover it exactly once, the
// common number of steps, and each worker's slice of the test set. Share policies turn the previous
// epoch's measurements into new shares: DBS (proportional to compute-only speed, as in the paper)
// or a fixed equal split (plain S-SGD). No state, no I/O; thread-compatible.
#ifndef DBS_SERVER_BATCH_ALLOCATOR_H_
#define DBS_SERVER_BATCH_ALLOCATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/plan.h"

namespace dbs {

// Splits `total` into non-negative integers proportional to `shares` that sum exactly to `total`:
// each gets floor(total * share), and the leftover units go to the largest fractional parts (ties
// to the lower index). Shares must be non-negative with a positive sum; they need not be normalised.
std::vector<int64_t> LargestRemainder(int64_t total, absl::Span<const double> shares);

// One worker's part of an epoch.
struct WorkerAllocation {
  double share = 0.0;
  int batch_size = 0;        // at every step but the last
  int final_batch_size = 0;  // at the last step
  int64_t train_samples() const;
  // Positions in the epoch's permutation, one range per step in step order (steps where the
  // worker's batch is 0 have none). Step s uses the block [s * B, s * B + B_s) of the
  // permutation, and each worker its slice of that block.
  std::vector<SampleRange> train;
  SampleRange test;          // indices of the test set to evaluate
};

struct EpochAllocation {
  int num_steps = 0;
  std::vector<WorkerAllocation> workers;  // in the order of the shares
};

// Lays out an epoch of `train_samples` samples with global batch `global_batch`:
// num_steps = ceil(D / B); full steps use the shares' split of B, the last step the shares' split of
// the remainder D mod B (or of B when it divides evenly). Step s always trains on the same block of
// the permutation, whatever the split, so the global batch of every step, and hence the training
// trajectory, is the same as single-process SGD with batch B over that permutation; only who
// computes which part of it changes. INVALID_ARGUMENT for empty data, a non-positive batch or bad
// shares.
absl::StatusOr<EpochAllocation> AllocateEpoch(int64_t train_samples, int64_t test_samples,
                                              int global_batch, absl::Span<const double> shares);

// One epoch's measurement of one worker.
struct SpeedSample {
  int64_t samples = 0;
  double compute_seconds = 0.0;
  int steps = 0;  // steps of that epoch (for the cost model's per-step term)
};

// What the scheduler knows about a worker when it re-plans.
struct WorkerObservation {
  double previous_share = 0.0;
  int64_t samples = 0;           // samples processed in the last epoch
  double compute_seconds = 0.0;  // compute-only time of the last epoch
  int steps = 0;                 // steps of the last epoch
  int max_batch = 0;             // the worker's own cap (memory); 0: none
  // Earlier epochs, most recent first (the last epoch is the fields above).
  std::vector<SpeedSample> earlier;
};

// Turns observations into the next epoch's shares (same order, summing to 1).
class SharePolicy {
 public:
  virtual ~SharePolicy() = default;
  virtual std::string name() const = 0;
  virtual std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const = 0;
};

// Plain S-SGD: every worker gets 1/n, whatever it measured.
class EqualSplitPolicy : public SharePolicy {
 public:
  std::string name() const override { return "fixed"; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;
};

// DBS: speed v_i = samples_i / compute_seconds_i, share_i = v_i / sum_j v_j. A worker without a
// usable measurement (no samples, zero or non-finite time) is given the mean speed of the others,
// so it is probed again rather than starved; with no measurement at all the split is equal.
//
// With `speed_window` > 1 a worker's speed is the lowest it showed over its last `speed_window`
// epochs. A worker throttled by a CPU quota (a shared node) runs at full speed while it is mostly
// idle and only shows its real capacity once it is loaded, so the single last epoch overrates it
// and the plan oscillates; the recent minimum does not. A slowdown is still acted on at once; a
// recovery is trusted after `speed_window` epochs. speed_window = 1 is the paper's rule.
class ProportionalPolicy : public SharePolicy {
 public:
  explicit ProportionalPolicy(int speed_window = 1) : speed_window_(speed_window) {}
  std::string name() const override { return "dbs"; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;

 private:
  int speed_window_;
};

// Beyond the paper: a cost model per worker, step time = a_i + b_i / v_i, with a fixed per-step
// overhead a_i (parameter copies, launch, anything not proportional to the batch) and a per-sample
// time 1 / v_i, fitted by least squares over the worker's recent epochs (compute_i = S a_i +
// n_i / v_i). The balanced allocation gives every worker the same step time tau:
// b_i = v_i (tau - a_i) with tau = (B + sum v_i a_i) / sum v_i, so a worker with a larger overhead
// gets less than its speed alone would give it (proportional batches are optimal only when the
// a_i are equal). Batches are kept within [min_batch, max_batch] by water-filling: a worker that
// hits a bound is fixed there and the rest is re-balanced among the others. A worker with fewer
// than two distinct batch sizes in its history has no separable overhead: a_i = 0, its speed is
// samples / compute, i.e. the proportional rule. Shares are b_i / B.
class CostModelPolicy : public SharePolicy {
 public:
  CostModelPolicy(int global_batch, int min_batch, int max_batch, int history)
      : global_batch_(global_batch), min_batch_(min_batch), max_batch_(max_batch),
        history_(history) {}
  std::string name() const override { return "cost"; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;

  // The fitted (overhead seconds per step, samples per second) of one worker; speed <= 0 when
  // nothing usable was measured.
  static std::pair<double, double> Fit(const WorkerObservation& w, int history);

 private:
  int global_batch_, min_batch_, max_batch_, history_;
};

// Smooths another policy: shares = alpha * new + (1 - alpha) * previous, and keeps the previous
// shares when no worker's share would move by more than `deadband` (relative), so measurement
// noise does not reshuffle shards every epoch. alpha = 1 and deadband = 0 change nothing.
class SmoothedPolicy : public SharePolicy {
 public:
  SmoothedPolicy(std::unique_ptr<SharePolicy> inner, double alpha, double deadband)
      : inner_(std::move(inner)), alpha_(alpha), deadband_(deadband) {}
  std::string name() const override { return inner_->name(); }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;

 private:
  std::unique_ptr<SharePolicy> inner_;
  double alpha_, deadband_;
};

struct PolicyConfig {
  std::string name = "dbs";  // "dbs", "fixed" or "cost"
  int speed_window = 1;      // dbs: lowest speed over this many epochs
  int global_batch = 128;    // cost: B
  int min_batch = 0;         // cost: per-worker bounds
  int max_batch = 0;         // cost: 0 = no upper bound
  int history = 3;           // cost: epochs used for the fit
  double smoothing = 1.0;    // alpha of SmoothedPolicy (1: none)
  double deadband = 0.0;     // relative share change below which nothing moves
};

// INVALID_ARGUMENT for an unknown name or out-of-range settings.
absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const PolicyConfig& config);

// "dbs" or "fixed"; INVALID_ARGUMENT otherwise (or for speed_window < 1).
absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const std::string& name,
                                                             int speed_window = 1);

}  // namespace dbs

#endif  // DBS_SERVER_BATCH_ALLOCATOR_H_
