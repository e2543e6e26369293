// A batch larger than a worker can hold at once, computed as micro-batches: the gradient pushed is
// their exact mean, so the planner gives a worker the share its speed earns whatever its memory
// (`dbs_worker --max_batch`). No libtorch: the learner's computation is passed in.
#ifndef DBS_WORKER_MICRO_BATCH_H_
#define DBS_WORKER_MICRO_BATCH_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"

namespace dbs {

// Computes the mean gradient of `indices` on a model of `layout`.
using ComputeFn = std::function<absl::StatusOr<double>(absl::Span<const int64_t> indices,
                                                       absl::Span<float> grad)>;

// The number of micro-batches a batch of `batch` samples takes at `max_batch` (0: no limit).
int MicroBatches(int batch, int max_batch);

// Computes the mean gradient of `indices` (and returns their summed loss) with `compute` called on
// MicroBatches(indices.size(), max_batch) consecutive micro-batches of sizes differing by at most
// one. A trained tensor's entries in `grad` are the micro-batches' means weighted by their sizes
// (summed in double precision): the whole batch's mean gradient. A buffer's (BatchNorm's running
// statistics) are the last micro-batch's values, which have seen every micro-batch. `scratch`
// holds one micro-batch's gradient between calls (reused).
absl::StatusOr<double> ComputeInMicroBatches(const ModelLayout& layout,
                                             absl::Span<const int64_t> indices, int max_batch,
                                             const ComputeFn& compute, absl::Span<float> grad,
                                             std::vector<float>* scratch);

}  // namespace dbs

#endif  // DBS_WORKER_MICRO_BATCH_H_
