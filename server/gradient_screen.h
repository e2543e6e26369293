// GradientScreen: tells a faulty worker's gradient from the others' before it is summed.
//
// Fleets see GPUs that silently corrupt results, drivers that produce NaN after a fault and
// hosts whose memory flips bits. A gradient with a value that is not finite or beyond
// kMaxAbsGradient is refused by the aggregator's check; one whose values are plausible one by
// one but whose L2 norm is far above what the job's gradients have been (a scaled-up gradient,
// a flipped exponent bit) is what this screen catches: its norm against the median of the last
// accepted pushes' norms (every worker's, so a minority of faulty pushes does not move it), at
// most `norm_ratio` times larger. A gradient whose norm is plausible (a sign flip, a small
// scale) is not told apart: see docs/security.md for what that costs.
//
// Pure value type; thread-compatible.
#ifndef DBS_SERVER_GRADIENT_SCREEN_H_
#define DBS_SERVER_GRADIENT_SCREEN_H_

#include <deque>

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

struct ScreenConfig {
  FaultyGradients mode = FaultyGradients::kEvict;
  double norm_ratio = 10.0;  // > 1
  int history = 64;          // accepted norms the median is taken over
  int min_history = 8;       // fewer: every norm passes (the job's first steps)
};

class GradientScreen {
 public:
  explicit GradientScreen(ScreenConfig config = {}) : config_(config) {}

  // OK, or (INVALID_ARGUMENT) why a push whose gradient has L2 norm `norm` is an outlier.
  absl::Status Judge(double norm) const;
  // An accepted push's norm joins the history.
  void Accepted(double norm);

  const ScreenConfig& config() const { return config_; }
  // The median of the history (0 while it is empty).
  double Median() const;

 private:
  ScreenConfig config_;
  std::deque<double> recent_;
};

}  // namespace dbs

#endif  // DBS_SERVER_GRADIENT_SCREEN_H_
