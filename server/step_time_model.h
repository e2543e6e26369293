// StepTimeModel: one worker's compute time per step as a function of its batch size, fitted to
// what the worker was actually measured doing.
//
// Real step times are not proportional to the batch: a GPU pays a per-step overhead and gets
// cheaper per sample as the batch grows; a process under a CPU quota runs at full speed while a
// step's work fits its quota and is throttled beyond it; neighbours and clocks change speeds
// while a job runs. The model makes no assumption about the shape beyond monotonicity: it is the
// piecewise-linear curve through the measured (batch, seconds per step) points after
//   1. level: measurements are replayed oldest first, and when a newer one repeats a batch
//      already measured, every older point is rescaled toward the new level there, so the curve
//      keeps its shape and follows the worker's speed. A deviation beyond `change_threshold` is a
//      change of speed (a background job, a throttled clock): the whole curve moves to the new
//      level at once and the change is recorded (last_change()). A smaller one moves the level by
//      the new measurement's share of the evidence (its steps against the recency-weighted steps
//      measured there before), so a slow drift is followed and a short, noisy window moves it
//      little. At batches not measured before the curve is unknown and may bend (a quota's knee
//      can double the time in one sample), so a deviation there is a change of speed only where
//      no shape explains it: time falling as the batch grows (slower than at a larger measured
//      batch, or faster than at a smaller one, by more than `change_threshold`), or a change
//      that reverses (the curve as it was before the last change explains the measurement
//      within `change_threshold` and the current one does not: a burst of contention ended);
//   2. pooling: points at the same batch are averaged, weighted by their step counts and by
//      recency (each older measurement counts half as much as the next);
//   3. isotonic regression (pool adjacent violators), so time never falls as the batch grows,
//      where, given the per-step noise, a rise within noise counts as a violation too (a flat
//      segment between noisy neighbours is not evidence of a cheap stretch); then a minimum
//      slope so the inverse is unique.
// Outside the measured range the curve continues with the slope of its end segment (never less
// than `min_relative_slope` of the end point's time per sample); with a single point it is the
// line through the origin, i.e. the paper's proportional rule.
//
// Pure value type; thread-compatible.
#ifndef DBS_SERVER_STEP_TIME_MODEL_H_
#define DBS_SERVER_STEP_TIME_MODEL_H_

#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace dbs {

// `steps` steps at batch `batch` took `seconds` of compute in all, in measurement `sequence`
// (higher is newer; one sequence number per epoch or per mid-epoch window).
struct StepTimePoint {
  int sequence = 0;
  double batch = 0.0;
  int steps = 0;
  double seconds = 0.0;
};

struct StepTimeModelOptions {
  // Relative deviation at an already measured batch that is read as a change of speed.
  double change_threshold = 0.2;
  // Floor of every segment's slope and of the extrapolation slopes, relative to the time per
  // sample at the nearest end of the measured range.
  double min_relative_slope = 0.1;
  // The relative standard deviation of one step's time (0: unknown). With it, adjacent batches
  // whose mean times rise by less than `significance` standard errors of their difference are
  // pooled like violators: a segment that flat says nothing about the slope (its points, a
  // sample or two apart, differ by less than their noise), and a planner that read it as a
  // cheap stretch would move many samples for a small gain.
  double relative_noise = 0.0;
  double significance = 2.0;
};

class StepTimeModel {
 public:
  // Fits the points (any order). Points without samples, steps or a positive finite time are
  // ignored; the model is empty when none is left.
  static StepTimeModel Fit(absl::Span<const StepTimePoint> points,
                           const StepTimeModelOptions& options = {});

  // A model from known knots (batch, seconds), for tests and for probing unmeasured workers.
  static StepTimeModel FromKnots(std::vector<std::pair<double, double>> knots,
                                 const StepTimeModelOptions& options = {});

  // The same curve `seconds` later at every batch above 0, with the same slopes: a worker's
  // predicted step plus a safety margin for its noise.
  StepTimeModel WithMargin(double seconds) const;

  bool empty() const { return knots_.empty(); }
  // Predicted compute seconds of one step at `batch` (>= 0).
  double Predict(double batch) const;
  // The batch whose predicted step time is `seconds` (the inverse of Predict; >= 0).
  double BatchFor(double seconds) const;
  // The measured range of batches (after pooling); both 0 when empty.
  double min_batch() const { return knots_.empty() ? 0.0 : knots_.front().first; }
  double max_batch() const { return knots_.empty() ? 0.0 : knots_.back().first; }
  // The sequence number of the newest measurement that was read as a change of speed (the
  // oldest sequence when there was none); -1 when empty.
  int last_change() const { return last_change_; }
  // The knots after pooling and isotonic regression, by increasing batch.
  const std::vector<std::pair<double, double>>& knots() const { return knots_; }

 private:
  void SetExtrapolation(double min_relative_slope);

  std::vector<std::pair<double, double>> knots_;
  double slope_below_ = 0.0;
  double slope_above_ = 0.0;
  int last_change_ = -1;
};

}  // namespace dbs

#endif  // DBS_SERVER_STEP_TIME_MODEL_H_
