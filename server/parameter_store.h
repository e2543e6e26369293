// ParameterStore: the job's model parameters and the optimizer that updates them.
//
// The first Register fixes the layout and initial values; later ones must match and receive the
// stored values. ApplyGradient runs the optimizer once and bumps the version. Snapshots are
// immutable and shared, so replies can be built without holding the lock. Thread-safe.
#ifndef DBS_SERVER_PARAMETER_STORE_H_
#define DBS_SERVER_PARAMETER_STORE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "common/value_buffer.h"
#include "server/optimizer.h"

namespace dbs {

// Values [previous entry's end, end) of a step's summed gradient are multiplied by `factor`.
struct GradientScale {
  size_t end = 0;
  float factor = 1.0f;
};

struct ParameterSnapshot {
  int64_t version = 0;
  std::shared_ptr<const ValueBuffer> values;
};

// Everything the store holds, for checkpoints.
struct StoreState {
  ModelLayout layout;
  std::vector<float> values;
  int64_t version = 0;
  OptimizerState optimizer;
};

// Receives each update's new values as ApplyGradient produces them, block by block and in
// order, while they are still in the cache: the service serializes them for the answers there,
// rather than reading the whole model from memory again afterwards. Called under the store's
// lock, from one update at a time.
class UpdateSink {
 public:
  virtual ~UpdateSink() = default;
  // `after` is the buffer the update writes the new values into (the snapshot EndUpdate
  // publishes): a sink may hold it, and read a range of it once WriteUpdate has been called for
  // that range. The store does not reuse a buffer anyone else holds.
  virtual void BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) = 0;
  // Values [offset, offset + values.size()), which lie in `after` at `offset`.
  virtual void WriteUpdate(size_t offset, absl::Span<const float> values) = 0;
  // `ok`: the update stands and `snapshot` holds the values written; otherwise they are void.
  virtual void EndUpdate(bool ok, const ParameterSnapshot& snapshot) = 0;
};

// Where the store keeps its snapshots, given: two buffers of the model's size, the version v
// in buffer v % 2 whenever that one is free (nobody but the store holds it), on the heap
// otherwise. dbs_ps's shared-memory slots are these buffers in fp32, so that the workers on its
// host read the parameters where the update wrote them (docs/dataplane.md#shared-memory). Called
// under the store's lock.
class SnapshotMemory {
 public:
  virtual ~SnapshotMemory() = default;
  // Two buffers of `count` values (null: the heap instead, for this model size).
  virtual std::array<std::shared_ptr<ValueBuffer>, 2> CreateSnapshotBuffers(size_t count) = 0;
  // Buffer `index` is about to be written: what it held is void from now on.
  virtual void SnapshotWriting(int index) = 0;
  // Buffer `index` holds the parameters of `version` from now on, never written again while
  // they are the store's (until SnapshotWriting).
  virtual void SnapshotPublished(int index, int64_t version) = 0;
};

class ParameterStore {
 public:
  explicit ParameterStore(std::unique_ptr<Optimizer> optimizer);

  // First call: validates and stores `layout` and `initial`. Later calls: INVALID_ARGUMENT unless
  // the layout is identical. Returns the current parameters either way.
  absl::StatusOr<ParameterSnapshot> Register(const ModelLayout& layout,
                                             absl::Span<const float> initial);

  // FAILED_PRECONDITION before Register.
  absl::StatusOr<ParameterSnapshot> Snapshot() const;

  // Applies one optimizer step and returns the new parameters. The gradient is `sum` (the
  // model's size) scaled piecewise by `scales` (see GradientScale; the last entry's `end` is the
  // model's size): the step's sum of gradients and, per range, one over the samples summed. It
  // runs as one pass over the model, block by block: scale, optimizer, check, snapshot. `sum` is
  // left zeroed, ready for the next step, whatever the outcome (unless it is the reserved next
  // buffer, see ReserveNextBuffer, which the new values overwrite). DATA_LOSS, with the parameters
  // unchanged, when the update would make one of them non-finite.
  absl::StatusOr<ParameterSnapshot> ApplyGradient(absl::Span<float> sum,
                                                  absl::Span<const GradientScale> scales);

  // The buffer the next update will write its new values into, reserved for it from now on,
  // so that a step's running sum can lie there rather than in a model-sized buffer of its own
  // (one model's size less memory): the caller sums into it and passes it to ApplyGradient as
  // `sum`. Its contents are stale (the caller zeroes what it sums into). The same buffer until
  // the update that takes it ends, or LoadState; the span is void after any of
  // those. FAILED_PRECONDITION before Register or while an update is open (the open update has
  // taken it already).
  absl::StatusOr<absl::Span<float>> ReserveNextBuffer();

  // A consistent copy of the parameters, their version and the optimizer's state.
  StoreState SaveState() const;
  // Replaces everything with `state` (a restored checkpoint).
  absl::Status LoadState(const StoreState& state);

  // Every later update goes through `sink` too (see UpdateSink); it must stay alive until it
  // is removed with RemoveUpdateSink (which does nothing when another sink has replaced it).
  void SetUpdateSink(UpdateSink* sink);
  void RemoveUpdateSink(UpdateSink* sink);
  // From now on the snapshots lie in `memory`'s buffers where they can (see SnapshotMemory),
  // which must outlive the store. Before any update is open.
  void SetSnapshotMemory(SnapshotMemory* memory);

  bool registered() const;
  // The layout; empty before Register.
  ModelLayout layout() const;
  int64_t num_elements() const;

 private:
  ParameterSnapshot SnapshotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The update's pass over the model from `before` into `after`: the values before it copied
  // into the new snapshot, the optimizer step there with the scaled `sum` (left zeroed, unless
  // it is the new snapshot itself, which the new values overwrite), the new values handed to the
  // sink. Returns the first value that became non-finite, or the model's size.
  size_t UpdatePassLocked(absl::Span<float> sum, absl::Span<const GradientScale> scales,
                          const ValueBuffer& before, ValueBuffer* after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A snapshot buffer of `size` values for `version` that nobody else holds (its contents are
  // stale): the snapshot memory's buffer for it if free, a pooled one otherwise.
  std::shared_ptr<ValueBuffer> FreeBufferLocked(size_t size, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `values` the parameters of `version_` (telling the snapshot memory).
  void PublishLocked(std::shared_ptr<const ValueBuffer> values) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  UpdateSink* sink_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::unique_ptr<Optimizer> optimizer_ ABSL_GUARDED_BY(mu_);
  ModelLayout layout_ ABSL_GUARDED_BY(mu_);
  // The parameters: the snapshot every reader shares, never written again. An update writes
  // the next version into another buffer and publishes that, so the store keeps no copy of
  // its own besides (null before Register).
  std::shared_ptr<const ValueBuffer> values_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  // Snapshot buffers, reused once nobody else holds them (the step before last's, usually).
  static constexpr size_t kSnapshotPool = 3;
  std::vector<std::shared_ptr<ValueBuffer>> pool_ ABSL_GUARDED_BY(mu_);
  // SetSnapshotMemory's, and its buffers for a model of `fixed_size_` values (none if it gave
  // none for that size).
  SnapshotMemory* memory_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::array<std::shared_ptr<ValueBuffer>, 2> fixed_ ABSL_GUARDED_BY(mu_);
  size_t fixed_size_ ABSL_GUARDED_BY(mu_) = 0;
  // The buffer reserved for the next update (ReserveNextBuffer); ApplyGradient takes it.
  std::shared_ptr<ValueBuffer> next_ ABSL_GUARDED_BY(mu_);
  std::vector<float> block_ ABSL_GUARDED_BY(mu_);  // UpdatePassLocked's scaled gradient
};

}  // namespace dbs

#endif  // DBS_SERVER_PARAMETER_STORE_H_
