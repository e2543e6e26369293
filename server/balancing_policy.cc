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
    count +=
        (moves[k] > 0) != (moves[k - 1] > 0) && std::abs(moves[k]) > 0.5 * std::abs(moves[k - 1]);
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

// Step times this close (relative) count as the same step: a worker one more sample would take
// to within 1% of the slowest is as loaded as whole samples allow, not worth a re-plan on
// measurements that differ by less than their noise.
constexpr double kSameStep = 0.01;

// The time `model` holds for `batch` when it was measured there (to the sample); -1 when it was
// not. A worker is left faster than the others only when one more sample was seen to make it
// the slowest, never on a prediction between measured batches.
double MeasuredTime(const StepTimeModel& model, double batch) {
  for (const auto& [b, t] : model.knots()) {
    if (std::abs(b - batch) < 0.5) return t;
  }
  return -1.0;
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

StepTimeModel BalancingPolicy::ModelOf(const WorkerObservation& w, double relative_noise) const {
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
  StepTimeModelOptions o = options_.model;
  o.relative_noise = relative_noise;
  return StepTimeModel::Fit(points, o);
}

std::vector<StepTimeModel> BalancingPolicy::Models(
    absl::Span<const WorkerObservation> workers) const {
  const std::vector<double> noise = RelativeNoise(workers);
  std::vector<StepTimeModel> models;
  for (size_t i = 0; i < workers.size(); ++i) models.push_back(ModelOf(workers[i], noise[i]));
  return models;
}

BalancingPolicy::StepNoise BalancingPolicy::StepNoiseOf(const WorkerObservation& w) const {
  const size_t n = w.history.size();
  const size_t keep = static_cast<size_t>(std::max(0, options_.noise_measurements));
  StepNoise out;
  for (size_t k = n > keep ? n - keep : 0; k < n; ++k) {
    for (const auto& [batch, t] : w.history[k].by_batch) {
      if (t.steps < 2 || !(t.seconds > 0) || !std::isfinite(t.square_seconds)) continue;
      const double mean = t.seconds / t.steps;
      out.relative_squares += std::max(0.0, t.square_seconds - t.seconds * mean) / (mean * mean);
      out.dof += t.steps - 1;
    }
  }
  return out;
}

std::vector<double> BalancingPolicy::RelativeNoise(
    absl::Span<const WorkerObservation> workers) const {
  std::vector<double> sd(workers.size(), 0.0);
  std::vector<StepNoise> noise;
  StepNoise pooled;
  for (const WorkerObservation& w : workers) {
    noise.push_back(StepNoiseOf(w));
    pooled.relative_squares += noise.back().relative_squares;
    pooled.dof += noise.back().dof;
  }
  if (!(pooled.dof > 0)) return sd;
  // Each worker's relative variance, shrunk toward the cluster's: a few dozen steps estimate a
  // standard deviation only to 10-20%, and workers equally noisy must not get unequal margins.
  const double prior = pooled.relative_squares / pooled.dof;
  for (size_t i = 0; i < workers.size(); ++i) {
    sd[i] = std::sqrt((noise[i].relative_squares + options_.noise_prior_dof * prior) /
                      (noise[i].dof + options_.noise_prior_dof));
  }
  return sd;
}

std::vector<double> BalancingPolicy::NoiseMargins(absl::Span<const WorkerObservation> workers,
                                                  const std::vector<StepTimeModel>& models) const {
  std::vector<double> margins(workers.size(), 0.0);
  if (!(options_.noise_margin > 0)) return margins;
  const std::vector<double> sd = RelativeNoise(workers);
  for (size_t i = 0; i < workers.size(); ++i) {
    if (models[i].empty()) continue;
    // A worker at no batch now is margined where it was last measured working, the least it
    // would carry if given samples again: with no margin, its bare curve would look cheaper
    // than every other worker's raised one and it would come back with too many.
    const double at =
        workers[i].current_batch > 0 ? workers[i].current_batch : models[i].min_batch();
    margins[i] = options_.noise_margin * sd[i] * models[i].Predict(at);
  }
  return margins;
}

namespace {

// One planning pass over a set of observations; each step of BalancingPolicy::Plan is a method.
class Planner {
 public:
  // `models` judge the current split and the rounding; `movers` (the same curves with segments
  // flatter than noise pooled) choose where a worker moves.
  Planner(const BalancingOptions& o, absl::Span<const WorkerObservation> workers,
          std::vector<StepTimeModel> models, std::vector<StepTimeModel> movers)
      : o_(o),
        w_(workers),
        n_(workers.size()),
        B_(o.global_batch),
        models_(std::move(models)),
        movers_(std::move(movers)) {}

  // Gives a worker never measured the mean speed of the others; false when none was measured.
  bool ProbeUnmeasured() {
    double speed_sum = 0.0;
    int measured = 0;
    for (const StepTimeModel& m : models_) {
      if (m.empty()) continue;
      speed_sum += m.knots().back().first / m.knots().back().second;
      ++measured;
    }
    if (measured == 0) return false;
    bool all = true;
    for (size_t i = 0; i < n_; ++i) {
      if (!models_[i].empty()) continue;
      models_[i] = movers_[i] = StepTimeModel::FromKnots({{speed_sum / measured, 1.0}}, o_.model);
      all = false;
    }
    double sum = 0.0;
    cur_.resize(n_);
    for (size_t i = 0; i < n_; ++i) sum += cur_[i] = w_[i].current_batch;
    have_current_ = all && std::abs(sum - B_) < 0.5;
    return true;
  }

  // Marks the idle workers due a probe (BalancingOptions::probe_cost); whether there is one.
  // After Hold, which finds the step the current split runs.
  bool MarkProbes() {
    probe_.assign(n_, false);
    const double tau = current_step_;
    if (!have_current_ || !(tau > 0) || o_.min_batch > 0) return false;
    bool any = false;
    for (size_t i = 0; i < n_; ++i) {
      const WorkerObservation& w = w_[i];
      if (cur_[i] > 0 || models_[i].empty() || w.idle_steps <= 0) continue;
      // The probe's cost and the idle time, in steps of tau.
      const double cost = o_.probe_steps * std::max(0.0, models_[i].Predict(1) - tau) / tau;
      probe_[i] = o_.probe_cost * w.idle_steps >= cost && 4 * w.idle_steps >= w.out_steps;
      any = any || probe_[i];
    }
    return any;
  }

  // Whether the current split is balanced by the model: every worker within `hold_spread` of the
  // slowest, or measured to become the slowest with one more sample. Sets the plan's current
  // step time.
  bool Hold(BalancingPlan* plan) {
    if (!have_current_) return false;
    for (size_t i = 0; i < n_; ++i) {
      plan->current_step_seconds =
          std::max(plan->current_step_seconds, models_[i].Predict(cur_[i]));
    }
    current_step_ = plan->current_step_seconds;
    for (size_t i = 0; i < n_; ++i) {
      const bool within =
          models_[i].Predict(cur_[i]) * (1.0 + o_.hold_spread) >= plan->current_step_seconds;
      if (!within &&
          MeasuredTime(models_[i], cur_[i] + 1) * (1.0 + kSameStep) < plan->current_step_seconds) {
        return false;
      }
    }
    return true;
  }

  // Each worker's batches and moves since its last change of speed.
  void TrackMoves() {
    moves_.assign(n_, {});
    runs_.assign(n_, {});
    for (size_t i = 0; i < n_ && have_current_; ++i) {
      std::vector<double> batches;
      for (size_t k = static_cast<size_t>(std::max(0, models_[i].last_change()));
           k < w_[i].history.size(); ++k) {
        batches.push_back(w_[i].history[k].MainBatch());
      }
      if (batches.empty() || std::abs(batches.back() - cur_[i]) > 1e-9) batches.push_back(cur_[i]);
      moves_[i] = Moves(batches);
      runs_[i] = std::move(batches);
    }
  }

  // Hard bounds, then the trust region where a curve has been measured at two batches or more.
  void SetBounds() {
    lo_.resize(n_);
    hi_.resize(n_);
    tlo_.resize(n_);
    thi_.resize(n_);
    double sum_tlo = 0.0, sum_thi = 0.0;
    for (size_t i = 0; i < n_; ++i) {
      lo_[i] = std::max(probe_[i] ? 1 : 0, o_.min_batch);
      hi_[i] = o_.max_batch > 0 ? std::min<double>(B_, o_.max_batch) : B_;
      hi_[i] = std::max(hi_[i], lo_[i]);
      tlo_[i] = lo_[i];
      thi_[i] = hi_[i];
      if (models_[i].knots().size() >= 2) {
        const double f = o_.trust_factor;
        tlo_[i] = std::clamp(std::min(cur_[i], models_[i].min_batch()) / f, lo_[i], hi_[i]);
        thi_[i] = std::clamp(std::max(cur_[i], models_[i].max_batch()) * f, lo_[i], hi_[i]);
      }
      sum_tlo += tlo_[i];
      sum_thi += thi_[i];
    }
    if (sum_tlo > B_ || sum_thi < B_) {  // the trust region cannot hold B: hard bounds only
      tlo_ = lo_;
      thi_ = hi_;
    }
  }

  // Where worker i's step takes tau, within its bounds, and never where its own curve says it
  // would be slower than the slowest step now: the acceleration toward a bend (Root) gambles
  // within that, not beyond it.
  double Target(size_t i, double tau) const {
    double b = movers_[i].BatchFor(tau);
    if (have_current_) {
      b = Root(movers_[i], tau, cur_[i], Streak(runs_[i], true), Streak(runs_[i], false));
      if (current_step_ > 0) b = std::min(b, std::max(cur_[i], models_[i].BatchFor(current_step_)));
    }
    return std::clamp(b, tlo_[i], thi_[i]);
  }

  // Damping: each worker's planned correction comes from the undamped plan; every reversal that
  // does not halve the move (since the worker's last change of speed) halves its gain. The first
  // move after a change is a probe made from a single point; correcting it is not oscillation.
  std::vector<double> Gains() const {
    std::vector<double> gains(n_, 1.0);
    if (!have_current_) return gains;
    const double tau0 = Solve([this](size_t i, double tau) { return Target(i, tau); });
    for (size_t i = 0; i < n_; ++i) {
      std::vector<double> with_plan(moves_[i].begin() + std::min<size_t>(1, moves_[i].size()),
                                    moves_[i].end());
      const double planned = Target(i, tau0) - cur_[i];
      if (std::abs(planned) >= 0.5) with_plan.push_back(planned);
      gains[i] = std::max(o_.min_gain, std::ldexp(1.0, -Oscillations(with_plan)));
    }
    return gains;
  }

  // The damped batches summing to B (real-valued).
  std::vector<double> Damped(const std::vector<double>& gains) const {
    auto damped = [&](size_t i, double tau) {
      if (!have_current_) return Target(i, tau);
      return std::clamp(cur_[i] + gains[i] * (Target(i, tau) - cur_[i]), lo_[i], hi_[i]);
    };
    const double tau = Solve(damped);
    std::vector<double> batches(n_);
    double sum = 0.0;
    for (size_t i = 0; i < n_; ++i) sum += batches[i] = damped(i, tau);
    // The bisection leaves the sum a hair off B; bounds that cannot hold B are relaxed here.
    for (double& b : batches) b = sum > 0 ? b * B_ / sum : B_ / n_;
    return batches;
  }

  // Whole samples: round down, then hand the units left one at a time to the worker whose step
  // stays shortest with one more, so rounding never makes the slowest slower. Where one more
  // sample was never measured, the guess is optimistic (no dearer per sample than now): a worker
  // is not kept idle by a pessimistic line to a distant measurement, and if the sample is dear
  // after all, that is measured once and known from then on.
  void Round(std::vector<double>* batches) const {
    double units = B_;
    for (double& b : *batches) units -= b = std::floor(b + 1e-9);
    // A bound the scaling to B left a fraction below (a probe's one sample) is met first.
    for (size_t i = 0; i < n_; ++i) {
      const double short_of = std::clamp(lo_[i] - (*batches)[i], 0.0, std::max(0.0, units));
      (*batches)[i] += short_of;
      units -= short_of;
    }
    for (; units > 0.5; units -= 1.0) {
      size_t best = 0;
      double best_time = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < n_; ++i) {
        const double b = (*batches)[i];
        double t = models_[i].Predict(b + 1);
        if (b > 0 && MeasuredTime(models_[i], b + 1) < 0) {
          t = std::min(t, models_[i].Predict(b) * (b + 1) / b);
        }
        if (b + 1 <= hi_[i] && t < best_time) {
          best = i;
          best_time = t;
        }
      }
      (*batches)[best] += 1;
    }
  }

  const std::vector<double>& current() const { return cur_; }
  const StepTimeModel& model(size_t i) const { return models_[i]; }

 private:
  double Solve(const std::function<double(size_t, double)>& batch) const {
    return SolveTau(
        [&](double tau) {
          double s = 0.0;
          for (size_t i = 0; i < n_; ++i) s += batch(i, tau);
          return s;
        },
        B_);
  }

  const BalancingOptions& o_;
  const absl::Span<const WorkerObservation> w_;
  const size_t n_;
  const double B_;
  std::vector<StepTimeModel> models_, movers_;
  std::vector<double> cur_;
  bool have_current_ = false;
  std::vector<std::vector<double>> moves_, runs_;
  std::vector<double> lo_, hi_, tlo_, thi_;
  std::vector<bool> probe_;
  double current_step_ = 0.0;  // the slowest predicted step of the current split (Hold)
};

}  // namespace

BalancingPlan BalancingPolicy::Plan(absl::Span<const WorkerObservation> workers) const {
  const size_t n = workers.size();
  BalancingPlan plan;
  plan.gains.assign(n, 1.0);
  if (n == 0) return plan;
  std::vector<StepTimeModel> models, movers = Models(workers);
  for (const WorkerObservation& w : workers) models.push_back(ModelOf(w));
  const std::vector<double> margins = NoiseMargins(workers, models);
  for (size_t i = 0; i < n; ++i) {
    models[i] = models[i].WithMargin(margins[i]);
    movers[i] = movers[i].WithMargin(margins[i]);
  }
  Planner p(options_, workers, std::move(models), std::move(movers));
  if (!p.ProbeUnmeasured()) {
    plan.batches.assign(n, static_cast<double>(options_.global_batch) / n);
    return plan;
  }
  const bool held = p.Hold(&plan);
  const bool probing = p.MarkProbes();
  if (held && !probing) {
    plan.held = true;
    plan.batches = p.current();
    plan.predicted_step_seconds = plan.current_step_seconds;
    return plan;
  }
  p.TrackMoves();
  p.SetBounds();
  plan.gains = p.Gains();
  plan.batches = p.Damped(plan.gains);
  p.Round(&plan.batches);
  for (size_t i = 0; i < n; ++i) {
    plan.predicted_step_seconds =
        std::max(plan.predicted_step_seconds, p.model(i).Predict(plan.batches[i]));
  }
  return plan;
}

std::vector<double> BalancingPolicy::NextShares(absl::Span<const WorkerObservation> workers) const {
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
