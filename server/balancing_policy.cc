#include "server/balancing_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace dbs {
namespace {

// The smallest tau in [0, hi] with total(tau) >= target, for a non-decreasing total.
double SolveTau(const std::function<double(double)>& total, double target) {
  double hi = 1e-6;
  for (int i = 0; i < 200 && total(hi) < target; ++i) hi *= 2;
  double lo = 0.0;
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (total(mid) >= target) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

// The moves of at least one sample between consecutive batches, in order.
std::vector<double> Moves(const std::vector<double>& batches) {
  std::vector<double> moves;
  for (size_t k = 1; k < batches.size(); ++k) {
    const double m = batches[k] - batches[k - 1];
    if (std::abs(m) >= 1.0) moves.push_back(m);
  }
  return moves;
}

// Reversals that do not at least halve the move: the signature of oscillation (a converging
// bracket reverses too, but with moves that shrink).
int Oscillations(const std::vector<double>& moves) {
  int count = 0;
  for (size_t k = 1; k < moves.size(); ++k) {
    count += (moves[k] > 0) != (moves[k - 1] > 0) && std::abs(moves[k]) > 0.5 * std::abs(moves[k - 1]);
  }
  return count;
}

// How many of the last measurements each moved the batch by a sample or more in direction `up`,
// without a pause or a turn: an approach from one side (a pause means the worker was balanced
// and the world moved since, as under a slow drift).
int Streak(const std::vector<double>& batches, bool up) {
  int streak = 0;
  for (size_t k = batches.size(); k >= 2; --k) {
    const double d = batches[k - 1] - batches[k - 2];
    if (std::abs(d) < 1.0 || (d > 0) != up) break;
    ++streak;
  }
  return streak;
}

// Whether `model` was measured at `batch` (to the sample) taking `seconds` or more: a worker is
// left faster than the others only when one more sample was seen to make it the slowest, never
// on a prediction between measured batches.
bool Measured(const StepTimeModel& model, double batch) {
  for (const auto& knot : model.knots()) {
    if (std::abs(knot.first - batch) < 0.5) return true;
  }
  return false;
}

bool MeasuredAtLeast(const StepTimeModel& model, double batch, double seconds) {
  for (const auto& [b, t] : model.knots()) {
    if (std::abs(b - batch) < 0.5 && t >= seconds) return true;
  }
  return false;
}

// Where a step of `model` takes `tau`, found like the Illinois variant of regula falsi: between
// the nearest measured batches on either side of tau the curve is taken as the line through
// them, except that the far end's distance from tau is halved once per earlier move made from
// the same side (`streak`), so a worker approaching a bend (a quota's knee) speeds up instead of
// creeping. The result never passes a batch measured on the other side of tau. Beyond the
// measured range the model's own extrapolation is used.
double Root(const StepTimeModel& model, double tau, double current, int streak_up,
            int streak_down) {
  const auto& knots = model.knots();
  if (knots.size() < 2 || tau <= knots.front().second || tau >= knots.back().second) {
    return model.BatchFor(tau);
  }
  // knots[k - 1] is below tau, knots[k] at or above it.
  size_t k = 1;
  while (knots[k].second < tau) ++k;
  const auto [b_lo, t_lo] = knots[k - 1];
  const auto [b_hi, t_hi] = knots[k];
  const bool up = tau > model.Predict(current);
  const double h = std::ldexp(1.0, -std::clamp((up ? streak_up : streak_down) - 1, 0, 30));
  if (up) {  // approaching from below: the far end is the upper one
    const double far = tau + (t_hi - tau) * h;
    return b_lo + (tau - t_lo) * (b_hi - b_lo) / (far - t_lo);
  }
  const double far = tau - (tau - t_lo) * h;
  return b_hi - (t_hi - tau) * (b_hi - b_lo) / (t_hi - far);
}

}  // namespace

StepTimeModel BalancingPolicy::ModelOf(const WorkerObservation& w) const {
  std::vector<StepTimePoint> points;
  const size_t n = w.history.size();
  const size_t first = n > static_cast<size_t>(options_.history) ? n - options_.history : 0;
  for (size_t k = first; k < n; ++k) {
    const Measurement& m = w.history[k];
    if (!m.by_batch.empty()) {
      for (const auto& [batch, t] : m.by_batch) {
        points.push_back({static_cast<int>(k), static_cast<double>(batch), t.steps, t.seconds});
      }
    } else if (m.steps > 0) {
      points.push_back({static_cast<int>(k), static_cast<double>(m.samples) / m.steps, m.steps,
                        m.compute_seconds});
    }
  }
  return StepTimeModel::Fit(points, options_.model);
}

BalancingPlan BalancingPolicy::Plan(absl::Span<const WorkerObservation> workers) const {
  const size_t n = workers.size();
  const double B = options_.global_batch;
  BalancingPlan plan;
  plan.gains.assign(n, 1.0);
  if (n == 0) return plan;
  std::vector<StepTimeModel> models(n);
  double speed_sum = 0.0;
  int measured = 0;
  for (size_t i = 0; i < n; ++i) {
    models[i] = ModelOf(workers[i]);
    if (models[i].empty()) continue;
    const auto& knot = models[i].knots().back();
    speed_sum += knot.first / knot.second;
    ++measured;
  }
  if (measured == 0) {
    plan.batches.assign(n, B / n);
    return plan;
  }
  // A worker never measured is probed at the mean speed of the others.
  bool all_measured = true;
  for (size_t i = 0; i < n; ++i) {
    if (models[i].empty()) {
      models[i] = StepTimeModel::FromKnots({{speed_sum / measured, 1.0}}, options_.model);
      all_measured = false;
    }
  }
  std::vector<double> cur(n);
  double cur_sum = 0.0;
  for (size_t i = 0; i < n; ++i) cur_sum += cur[i] = workers[i].current_batch;
  const bool have_current = all_measured && std::abs(cur_sum - B) < 0.5;

  if (have_current) {
    // Hold when the current split is balanced by the model: every worker within `hold_spread`
    // of the slowest, or measured to become the slowest with one more sample.
    for (size_t i = 0; i < n; ++i) {
      plan.current_step_seconds = std::max(plan.current_step_seconds, models[i].Predict(cur[i]));
    }
    plan.held = true;
    for (size_t i = 0; i < n && plan.held; ++i) {
      plan.held = models[i].Predict(cur[i]) * (1.0 + options_.hold_spread) >=
                      plan.current_step_seconds ||
                  MeasuredAtLeast(models[i], cur[i] + 1, plan.current_step_seconds);
    }
    if (plan.held) {
      plan.batches = cur;
      plan.predicted_step_seconds = plan.current_step_seconds;
      return plan;
    }
  }

  // Each worker's batches and moves since its last change of speed.
  std::vector<std::vector<double>> moves(n), batches_run(n);
  for (size_t i = 0; i < n && have_current; ++i) {
    const WorkerObservation& w = workers[i];
    std::vector<double> batches;
    for (size_t k = static_cast<size_t>(std::max(0, models[i].last_change()));
         k < w.history.size(); ++k) {
      batches.push_back(w.history[k].MainBatch());
    }
    if (batches.empty() || std::abs(batches.back() - cur[i]) > 1e-9) batches.push_back(cur[i]);
    moves[i] = Moves(batches);
    batches_run[i] = std::move(batches);
  }

  // Hard bounds, then the trust region where a curve has been measured at two batches or more.
  std::vector<double> lo(n), hi(n), tlo(n), thi(n);
  double sum_tlo = 0.0, sum_thi = 0.0;
  for (size_t i = 0; i < n; ++i) {
    lo[i] = std::max(0, options_.min_batch);
    hi[i] = options_.max_batch > 0 ? std::min<double>(B, options_.max_batch) : B;
    if (workers[i].max_batch > 0) hi[i] = std::min<double>(hi[i], workers[i].max_batch);
    hi[i] = std::max(hi[i], lo[i]);
    tlo[i] = lo[i];
    thi[i] = hi[i];
    if (models[i].knots().size() >= 2) {
      const double f = options_.trust_factor;
      tlo[i] = std::clamp(std::min(cur[i], models[i].min_batch()) / f, lo[i], hi[i]);
      thi[i] = std::clamp(std::max(cur[i], models[i].max_batch()) * f, lo[i], hi[i]);
    }
    sum_tlo += tlo[i];
    sum_thi += thi[i];
  }
  if (sum_tlo > B || sum_thi < B) {  // the trust region cannot hold B: hard bounds only
    tlo = lo;
    thi = hi;
  }
  auto target = [&](size_t i, double tau) {
    const double b = have_current ? Root(models[i], tau, cur[i], Streak(batches_run[i], true),
                                         Streak(batches_run[i], false))
                                  : models[i].BatchFor(tau);
    return std::clamp(b, tlo[i], thi[i]);
  };
  auto total = [&](const std::function<double(size_t, double)>& batch) {
    return [&, batch](double tau) {
      double s = 0.0;
      for (size_t i = 0; i < n; ++i) s += batch(i, tau);
      return s;
    };
  };

  if (have_current) {
    // Damping: each worker's planned correction comes from the undamped plan; every reversal
    // that does not halve the move (since the worker's last change of speed) halves its gain.
    const double tau0 = SolveTau(total(target), B);
    for (size_t i = 0; i < n; ++i) {
      // The first move after a change is a probe made from a single point; correcting it is
      // not oscillation.
      std::vector<double> with_plan(moves[i].begin() + std::min<size_t>(1, moves[i].size()),
                                    moves[i].end());
      const double planned = target(i, tau0) - cur[i];
      if (std::abs(planned) >= 0.5) with_plan.push_back(planned);
      plan.gains[i] = std::max(options_.min_gain, std::ldexp(1.0, -Oscillations(with_plan)));
    }
  }
  auto damped = [&](size_t i, double tau) {
    if (!have_current) return target(i, tau);
    return std::clamp(cur[i] + plan.gains[i] * (target(i, tau) - cur[i]), lo[i], hi[i]);
  };
  const double tau = SolveTau(total(damped), B);
  plan.batches.resize(n);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += plan.batches[i] = damped(i, tau);
  // The bisection leaves the sum a hair off B; bounds that cannot hold B are relaxed here.
  for (double& b : plan.batches) b = sum > 0 ? b * B / sum : B / n;
  // Whole samples: round down, then hand the units left one at a time to the worker whose
  // step stays shortest with one more, so rounding never makes the slowest slower. Where one
  // more sample was never measured, the guess is optimistic (no dearer per sample than now):
  // a worker is not kept idle by a pessimistic line to a distant measurement, and if the sample
  // is dear after all, that is measured once and known from then on.
  double units = B;
  for (double& b : plan.batches) units -= b = std::floor(b + 1e-9);
  for (; units > 0.5; units -= 1.0) {
    size_t best = 0;
    double best_time = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      const double b = plan.batches[i];
      double t = models[i].Predict(b + 1);
      if (b > 0 && !Measured(models[i], b + 1)) t = std::min(t, models[i].Predict(b) * (b + 1) / b);
      if (plan.batches[i] + 1 <= hi[i] && t < best_time) {
        best = i;
        best_time = t;
      }
    }
    plan.batches[best] += 1;
  }
  for (size_t i = 0; i < n; ++i) {
    plan.predicted_step_seconds =
        std::max(plan.predicted_step_seconds, models[i].Predict(plan.batches[i]));
  }
  return plan;
}

std::vector<double> BalancingPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  BalancingPlan plan = Plan(workers);
  double total = 0.0;
  for (double b : plan.batches) total += b;
  std::vector<double> shares(plan.batches.size(), 0.0);
  for (size_t i = 0; i < shares.size(); ++i) {
    shares[i] = total > 0 ? plan.batches[i] / total : 1.0 / shares.size();
  }
  return shares;
}

}  // namespace dbs
