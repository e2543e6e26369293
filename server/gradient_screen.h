// GradientScreen: tells a faulty worker's gradient from the others' before it is summed.
//
// Fleets see GPUs that silently corrupt results, drivers that produce NaN after a fault and
// hosts whose memory flips bits. A gradient with a value that is not finite or beyond
// kMaxAbsGradient is refused by the aggregator's check; one whose values are plausible one by
// one but whose L2 norm is far above what the job's gradients have been (a scaled-up gradient,
// a flipped exponent bit) is what this screen catches: its norm against the median of the last
// accepted pushes' norms (every worker's, so a minority of faulty pushes does not move it), at
// most `norm_ratio` times larger. A mean gradient over fewer samples may be larger: a batch's
// gradient is mostly its few hard samples' (a classifier's loss is near 0 on most of the
// others), so one hard sample alone can be m times the mean of m. A push of b samples against
// pushes of a median of m may be m / b times larger still (a worker that DBS gives a small
// batch, or probes with one sample, is not an outlier for that). Both medians weigh each push by
// its samples: where DBS gives one worker most of the batch and the others a sample or two, the
// reference is the pushes that hold most of the samples, not the many single samples, whose
// norms are mostly an easy sample's (near 0) and now and then a hard one's. A gradient whose norm
// is plausible (a sign flip, a small scale) is not told apart: see docs/fault_tolerance.md for what
// that costs.
//
// Pure value type; thread-compatible.
#ifndef DBS_SERVER_GRADIENT_SCREEN_H_
#define DBS_SERVER_GRADIENT_SCREEN_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dbs {

// What the server does with a faulty push (dbs_ps --faulty_gradients).
enum class FaultyGradients {
  kOff,    // no norm screen; a bad value refuses the push, as any malformed one
  kLog,    // a norm outlier is logged and counted, and summed; a bad value refuses the push
  kEvict,  // either quarantines the worker: not summed, removed, its samples re-planned
};

absl::StatusOr<FaultyGradients> ParseFaultyGradients(absl::string_view name);
const char* FaultyGradientsName(FaultyGradients mode);

// A push's gradient norm and the samples it is the mean over.
struct PushNorm {
  double norm = 0.0;
  int samples = 1;
};

// OK, or (INVALID_ARGUMENT, naming `against`) why `push` is an outlier against `reference`
// (not empty): more than `ratio` times their median norm, times their median samples / its
// samples when it is over fewer samples (both medians over the reference's samples).
absl::Status JudgeNorm(const PushNorm& push, const std::vector<PushNorm>& reference, double ratio,
                       absl::string_view against);

struct ScreenConfig {
  FaultyGradients mode = FaultyGradients::kEvict;
  double norm_ratio = 10.0;  // > 1
  int history = 64;          // accepted norms the median is taken over
  int min_history = 8;       // fewer: every norm passes (the job's first steps)
};

class GradientScreen {
 public:
  explicit GradientScreen(ScreenConfig config = {}) : config_(config) {}

  // OK, or (INVALID_ARGUMENT) why `push` is an outlier against the last accepted pushes.
  absl::Status Judge(const PushNorm& push) const;
  // An accepted push's norm joins the history.
  void Accepted(const PushNorm& push);

  const ScreenConfig& config() const { return config_; }

 private:
  ScreenConfig config_;
  std::vector<PushNorm> recent_;  // oldest first
};

}  // namespace dbs

#endif  // DBS_SERVER_GRADIENT_SCREEN_H_
