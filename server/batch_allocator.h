// BatchAllocator: the pure arithmetic of Dynamic Batch Size.
//
// From per-worker shares it derives integer batch sizes that sum exactly to the global batch
// (largest remainder), contiguous ranges of the epoch's permutation that cover it exactly once, the
// common number of steps, and each worker's slice of the test set. The shares come from a share
// policy (server/share_policy.h). No state, no I/O; thread-compatible.
#ifndef DBS_SERVER_BATCH_ALLOCATOR_H_
#define DBS_SERVER_BATCH_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/plan.h"

namespace dbs {

// Splits `total` into non-negative integers proportional to `shares` that sum exactly to `total`:
// each gets floor(total * share), and the leftover units go to the largest fractional parts (ties
// to the lower index). Shares must be non-negative with a positive sum; they need not be
// normalised.
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
  SampleRange test;  // indices of the test set to evaluate
};

struct EpochAllocation {
  int num_steps = 0;
  std::vector<WorkerAllocation> workers;  // in the order of the shares
};

// Lays out an epoch of `train_samples` samples with global batch `global_batch`:
// num_steps = ceil(D / B); full steps use the shares' split of B, the last step the shares' split
// of the remainder D mod B (or of B when it divides evenly). Step s always trains on the same block
// of the permutation, whatever the split, so the global batch of every step, and hence the training
// trajectory, is the same as single-process SGD with batch B over that permutation; only who
// computes which part of it changes. INVALID_ARGUMENT for empty data, a non-positive batch or bad
// shares.
absl::StatusOr<EpochAllocation> AllocateEpoch(int64_t train_samples, int64_t test_samples,
                                              int global_batch, absl::Span<const double> shares);

}  // namespace dbs

#endif  // DBS_SERVER_BATCH_ALLOCATOR_H_
