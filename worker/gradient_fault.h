// GradientFault: a faulty GPU, emulated (dbs_worker --corrupt_gradient), to test and measure
// how the job contains a worker whose gradients go bad.
//
// From the worker's `from_step`-th step on (counted over the whole job, from 0), every gradient
// it pushes is corrupted in one way:
//   nan@N       every value NaN, as after a driver fault;
//   scale:F@N   every value times F (an overflowing reduction, a broken loss scale);
//   sign@N      every value negated;
//   bitflip@N   one random bit flipped in about one value in a thousand (at least one), as
//               memory errors do; which bits, and so whether the result is caught, is chance.
// Pure value type.
#ifndef DBS_WORKER_GRADIENT_FAULT_H_
#define DBS_WORKER_GRADIENT_FAULT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dbs {

struct GradientFault {
  enum class Kind { kNone, kNaN, kScale, kSign, kBitFlip };
  Kind kind = Kind::kNone;
  double factor = 1.0;  // kScale
  int64_t from_step = 0;
  uint64_t seed = 0;  // with the step, which bits flip (kBitFlip)

  // "" or "none": no fault; otherwise one of the forms above.
  static absl::StatusOr<GradientFault> Parse(absl::string_view spec);

  // Corrupts `gradient` when `step` (the worker's own, over the job) is at or after from_step.
  // Returns whether it did. Bit flips are drawn from a generator seeded with `seed` and `step`.
  bool Apply(int64_t step, absl::Span<float> gradient) const;
};

}  // namespace dbs

#endif  // DBS_WORKER_GRADIENT_FAULT_H_
