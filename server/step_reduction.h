// StepReduction: the sum of one step's gradients, sum_i b_i * g_i. Each worker's gradient is held
// as it was received until its turn, then added window by window, in worker order (bit-identical
// sums whatever order the pushes arrive in) or on arrival. The sum lies in the buffer the store's
// next update writes the new parameters into (ParameterStore::ReserveNextBuffer), so the server
// holds no model-sized sum of its own. Not thread-safe: the StepAggregator guards it with a lock
// of its own, which it never takes while holding the store's.
#ifndef DBS_SERVER_STEP_REDUCTION_H_
#define DBS_SERVER_STEP_REDUCTION_H_

#include <cstddef>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/wire_values.h"
#include "server/gradient_sum.h"
#include "server/parameter_store.h"

namespace dbs {

class StepReduction {
 public:
  // `store` must outlive the reduction.
  StepReduction(ParameterStore* store, bool deterministic)
      : store_(store), deterministic_(deterministic) {}

  // The step's workers (id -> samples, ascending ids): the order of the sum, and whose
  // gradients it waits for. Set with the step's first gradient; an eviction shrinks it.
  void SetQuota(const std::map<int, int>& quota) { quota_ = quota; }
  bool has_quota() const { return !quota_.empty(); }
  // Worker `id`'s checked gradient of `samples` samples becomes the step's, to be summed in its
  // turn, with its blocks' squares when its sender can still write it (shared memory). INTERNAL
  // when the worker already has one this step.
  absl::Status Take(int id, int samples, std::shared_ptr<const WirePayload> gradient,
                    BlockSquares blocks);

  // Sums the gradients whose turn has come. Values of a sender's shared memory are checked
  // again as they are summed; a gradient whose values changed after its check is left out from
  // the changed block on, and kept with why for TakeChanged.
  void ReduceReady();
  // The step's gradients left out by ReduceReady, by worker, and why.
  std::map<int, absl::Status> TakeChanged() { return std::move(changed_); }

  // The whole sum (values no push reached are zeroed), to be handed to the store's update;
  // INTERNAL when the store has no model. The next step's sum starts anew.
  absl::StatusOr<absl::Span<float>> TakeSum();

  // Forgets the step's gradients and quota; the sum starts again (its buffer stays reserved).
  void Restart();
  // Forgets the sum's buffer too (the store's LoadState dropped its reservation).
  void Reset();

 private:
  struct Incoming {
    int samples = 0;
    std::shared_ptr<const WirePayload> gradient;  // until summed
    BlockSquares blocks;                          // when its sender can still write it
    size_t summed = 0;                            // a prefix of its values
  };
  // Values summed per window: the window's sum stays in the cache from the first worker's values
  // to the last's.
  static constexpr size_t kReduceWindow = 16384;

  size_t ModelSize() const { return static_cast<size_t>(store_->num_elements()); }
  // The sum with values [0, to) ready to be added to (reserving its buffer at the step's first
  // values, zeroing what was not yet); null when the store has no model.
  float* SumBuffer(size_t to);
  // Sums worker `id`'s gradient from where it stands up to value `hi`.
  absl::Status SumUpTo(int id, Incoming* in, size_t hi);

  ParameterStore* const store_;
  const bool deterministic_;
  std::map<int, int> quota_;
  std::map<int, Incoming> incoming_;
  std::map<int, absl::Status> changed_;
  // Values [0, zeroed_) of sum_ are zeroed or summed; the rest is stale.
  absl::Span<float> sum_;
  size_t zeroed_ = 0;
};

}  // namespace dbs

#endif  // DBS_SERVER_STEP_REDUCTION_H_
