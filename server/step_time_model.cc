#include "server/step_time_model.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <optional>

namespace dbs {
namespace {

struct Weighted {
  double batch;
  double seconds;  // per step
  double weight;
};

// Pools points at the same batch, then makes the curve non-decreasing (pool adjacent
// violators, a rise of less than `z` standard errors counting as a violation when the per-step
// relative deviation `noise` is known); returns the knots by increasing batch.
std::vector<std::pair<double, double>> Isotonic(std::vector<Weighted> pts, double noise, double z) {
  std::sort(pts.begin(), pts.end(),
            [](const Weighted& a, const Weighted& b) { return a.batch < b.batch; });
  struct Block {
    double w, wb, wt;
  };
  std::vector<Block> blocks;
  for (const Weighted& p : pts) {
    Block b{p.weight, p.weight * p.batch, p.weight * p.seconds};
    if (!blocks.empty() && std::abs(blocks.back().wb / blocks.back().w - p.batch) < 1e-9) {
      blocks.back().w += b.w;
      blocks.back().wb += b.wb;
      blocks.back().wt += b.wt;
    } else {
      blocks.push_back(b);
    }
    while (blocks.size() >= 2) {
      const Block& last = blocks.back();
      const Block& prev = blocks[blocks.size() - 2];
      const double t_last = last.wt / last.w, t_prev = prev.wt / prev.w;
      // The standard error of the difference of the two means (each step's time deviates by
      // `noise` of the mean; a block's weight counts its steps, older ones less).
      const double error = noise * std::sqrt(t_last * t_last / last.w + t_prev * t_prev / prev.w);
      if (t_last >= t_prev + z * error) break;
      Block merged{prev.w + last.w, prev.wb + last.wb, prev.wt + last.wt};
      blocks.pop_back();
      blocks.back() = merged;
    }
  }
  std::vector<std::pair<double, double>> knots;
  for (const Block& b : blocks) knots.push_back({b.wb / b.w, b.wt / b.w});
  return knots;
}

// The valid measurements, as (batch, seconds per step, steps), by their sequence number.
std::map<int, std::vector<Weighted>> BySequence(absl::Span<const StepTimePoint> points) {
  std::map<int, std::vector<Weighted>> by_sequence;
  for (const StepTimePoint& p : points) {
    if (!(p.batch > 0) || p.steps <= 0 || !(p.seconds > 0) || !std::isfinite(p.seconds) ||
        !std::isfinite(p.batch)) {
      continue;
    }
    by_sequence[p.sequence].push_back({p.batch, p.seconds / p.steps, static_cast<double>(p.steps)});
  }
  return by_sequence;
}

// A new measurement (`group`, sequence `seq`) against the curve so far (`before`, fitted to
// `kept`), at the batches measured before only: between measured batches the curve is unknown
// and may bend (a quota's knee can double the time in one sample).
struct Level {
  double measured = 0.0;    // its steps' time, weighted
  double predicted = 0.0;   // what `before` predicts for them
  double new_weight = 0.0;  // its steps there
  double old_weight = 0.0;  // the recency-weighted steps measured there before
};
Level LevelAgainst(const std::vector<std::pair<int, Weighted>>& kept,
                   const std::vector<Weighted>& group, int seq, const StepTimeModel& before) {
  Level level;
  for (const Weighted& p : group) {
    double weight_there = 0.0;
    for (const auto& [k_seq, k] : kept) {
      if (std::abs(k.batch - p.batch) < 0.5) {
        weight_there += k.weight * std::ldexp(1.0, -std::min(60, seq - k_seq));
      }
    }
    if (weight_there > 0) {
      level.measured += p.weight * p.seconds;
      level.predicted += p.weight * before.Predict(p.batch);
      level.new_weight += p.weight;
      level.old_weight += weight_there;
    }
  }
  return level;
}

// The curve through `points` as of measurement `now`: each point weighing half as much per
// measurement it is older, pooled and made non-decreasing.
StepTimeModel CurveAt(const std::vector<std::pair<int, Weighted>>& points, int now,
                      const StepTimeModelOptions& options) {
  std::vector<Weighted> pts;
  for (const auto& [seq, p] : points) {
    pts.push_back(p);
    pts.back().weight *= std::ldexp(1.0, -std::min(60, now - seq));
  }
  return StepTimeModel::FromKnots(
      Isotonic(std::move(pts), options.relative_noise, options.significance), options);
}

// A measurement (`group`) at batches none measured before, against the curve `now`: the ratio
// of its time to the curve's when that is a change of speed, which it is when
//   - time falls as the batch grows: it is slower by more than `threshold` than the curve at
//     the next batch measured above it, or faster than at the next one below (no shape does
//     that, so the worker's speed moved: a task landed on its machine, or left it);
//   - or the curve as it was before the last change (`before`, empty when there was none)
//     explains it within `threshold` while `now` does not: the change reversed (a burst ended).
std::optional<double> ShiftAtNewBatches(const std::vector<Weighted>& group,
                                        const StepTimeModel& now, const StepTimeModel& before,
                                        double threshold) {
  if (now.empty()) return std::nullopt;
  double measured = 0.0, predicted = 0.0, predicted_before = 0.0;
  bool against_shape = false;
  const auto& knots = now.knots();
  for (const Weighted& p : group) {
    measured += p.weight * p.seconds;
    predicted += p.weight * now.Predict(p.batch);
    if (!before.empty()) predicted_before += p.weight * before.Predict(p.batch);
    auto above = std::lower_bound(knots.begin(), knots.end(), std::make_pair(p.batch, 0.0));
    if (above != knots.end() && p.seconds > (1.0 + threshold) * above->second) {
      against_shape = true;
    }
    if (above != knots.begin() && p.seconds * (1.0 + threshold) < std::prev(above)->second) {
      against_shape = true;
    }
  }
  if (!(measured > 0) || !(predicted > 0)) return std::nullopt;
  const double ratio = measured / predicted;
  const double limit = std::log1p(threshold);
  if (std::abs(std::log(ratio)) <= limit) return std::nullopt;
  if (against_shape) return ratio;
  if (predicted_before > 0 && std::abs(std::log(measured / predicted_before)) <= limit) {
    return ratio;
  }
  return std::nullopt;
}

// How measurement `group` (sequence `seq`) moves the points kept so far (`kept`; `before_change`:
// as they stood before the last change of speed): the factor to scale them by, and whether it is
// a change of speed.
struct Move {
  double scale = 1.0;
  bool change = false;
};
Move MoveOf(const std::vector<std::pair<int, Weighted>>& kept,
            const std::vector<std::pair<int, Weighted>>& before_change,
            const std::vector<Weighted>& group, int seq, const StepTimeModelOptions& options) {
  const StepTimeModel now = CurveAt(kept, seq, options);
  // Where this measurement repeats batches already measured, a large deviation is a change of
  // speed, not of shape: the whole curve moves to the new level at once. Short of that, the
  // level moves by the new measurement's share of the evidence (its steps against the
  // recency-weighted steps measured there before), so slow drifts are followed and a short,
  // noisy window does not move the curve by its noise.
  const Level level = LevelAgainst(kept, group, seq, now);
  if (level.measured > 0 && level.predicted > 0) {
    const double ratio = level.measured / level.predicted;
    if (std::abs(std::log(ratio)) > std::log1p(options.change_threshold)) return {ratio, true};
    return {(level.old_weight + level.new_weight * ratio) / (level.old_weight + level.new_weight),
            false};
  }
  // Only batches not measured before: the curve may bend there, so a deviation is read as a
  // change of speed only where the shape cannot explain it.
  const std::optional<double> ratio = ShiftAtNewBatches(
      group, now, before_change.empty() ? StepTimeModel() : CurveAt(before_change, seq, options),
      options.change_threshold);
  if (ratio.has_value()) return {*ratio, true};
  return {};
}

}  // namespace

StepTimeModel StepTimeModel::Fit(absl::Span<const StepTimePoint> points,
                                 const StepTimeModelOptions& options) {
  // Measurements oldest first.
  const std::map<int, std::vector<Weighted>> by_sequence = BySequence(points);
  if (by_sequence.empty()) return StepTimeModel();
  int last_change = by_sequence.begin()->first;
  std::vector<std::pair<int, Weighted>> kept;  // (sequence, point)
  // The points as they stood before the last change of speed, to tell when it reverses.
  std::vector<std::pair<int, Weighted>> before_change;
  for (const auto& [seq, group] : by_sequence) {
    if (!kept.empty()) {
      const Move move = MoveOf(kept, before_change, group, seq, options);
      if (move.change) {
        last_change = seq;
        before_change = kept;
      }
      for (auto& [unused, p] : kept) p.seconds *= move.scale;
    }
    for (const Weighted& p : group) kept.push_back({seq, p});
  }
  StepTimeModel model = CurveAt(kept, by_sequence.rbegin()->first, options);
  model.last_change_ = last_change;
  return model;
}

StepTimeModel StepTimeModel::FromKnots(std::vector<std::pair<double, double>> knots,
                                       const StepTimeModelOptions& options) {
  StepTimeModel m;
  for (const auto& [b, t] : knots) {
    if (b > 0 && t > 0 && std::isfinite(b) && std::isfinite(t)) m.knots_.push_back({b, t});
  }
  std::sort(m.knots_.begin(), m.knots_.end());
  if (m.knots_.empty()) return m;
  // Strictly increasing, with a floor on every segment's slope.
  double per_sample = m.knots_[0].second / m.knots_[0].first;
  for (const auto& [b, t] : m.knots_) per_sample = std::min(per_sample, t / b);
  const double min_slope = options.min_relative_slope * per_sample;
  std::vector<std::pair<double, double>> strict = {m.knots_[0]};
  for (size_t k = 1; k < m.knots_.size(); ++k) {
    auto [b, t] = m.knots_[k];
    if (b - strict.back().first < 1e-9) {  // same batch: keep the larger time
      strict.back().second = std::max(strict.back().second, t);
      continue;
    }
    t = std::max(t, strict.back().second + min_slope * (b - strict.back().first));
    strict.push_back({b, t});
  }
  m.knots_ = std::move(strict);
  m.last_change_ = 0;
  m.SetExtrapolation(options.min_relative_slope);
  return m;
}

StepTimeModel StepTimeModel::WithMargin(double seconds) const {
  StepTimeModel m = *this;
  if (!(seconds > 0) || !std::isfinite(seconds)) return m;
  for (auto& [b, t] : m.knots_) t += seconds;
  return m;  // the slopes, set from the unshifted knots, stay
}

void StepTimeModel::SetExtrapolation(double min_relative_slope) {
  const auto& first = knots_.front();
  const auto& last = knots_.back();
  if (knots_.size() == 1) {
    slope_below_ = slope_above_ = first.second / first.first;  // through the origin
    return;
  }
  const auto& second = knots_[1];
  const auto& before_last = knots_[knots_.size() - 2];
  slope_below_ = std::max((second.second - first.second) / (second.first - first.first),
                          min_relative_slope * first.second / first.first);
  slope_above_ = std::max((last.second - before_last.second) / (last.first - before_last.first),
                          min_relative_slope * last.second / last.first);
}

double StepTimeModel::Predict(double batch) const {
  if (knots_.empty() || batch <= 0) return 0.0;
  const auto& first = knots_.front();
  const auto& last = knots_.back();
  if (batch <= first.first)
    return std::max(0.0, first.second - slope_below_ * (first.first - batch));
  if (batch >= last.first) return last.second + slope_above_ * (batch - last.first);
  auto hi = std::lower_bound(knots_.begin(), knots_.end(), std::make_pair(batch, 0.0));
  auto lo = hi - 1;
  const double f = (batch - lo->first) / (hi->first - lo->first);
  return lo->second + f * (hi->second - lo->second);
}

double StepTimeModel::BatchFor(double seconds) const {
  if (knots_.empty() || seconds <= 0) return 0.0;
  const auto& first = knots_.front();
  const auto& last = knots_.back();
  if (seconds <= first.second) {
    return std::max(0.0, first.first - (first.second - seconds) / slope_below_);
  }
  if (seconds >= last.second) return last.first + (seconds - last.second) / slope_above_;
  auto hi =
      std::lower_bound(knots_.begin(), knots_.end(), seconds,
                       [](const std::pair<double, double>& k, double t) { return k.second < t; });
  auto lo = hi - 1;
  const double f = (seconds - lo->second) / (hi->second - lo->second);
  return lo->first + f * (hi->first - lo->first);
}

}  // namespace dbs
