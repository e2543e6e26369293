#include "server/replan_window.h"

#include <algorithm>
#include <cmath>

namespace dbs {

std::optional<ReplanTrigger> ReplanWindow::Add(
    int epoch, const std::map<int, std::pair<int64_t, double>>& step) {
  if (steps_ <= 0) return std::nullopt;
  if (epoch != epoch_) {
    window_.clear();
    epoch_ = epoch;
  }
  for (const auto& [id, sample] : step) {
    auto& w = window_[id];
    w.push_back(sample);
    while (static_cast<int>(w.size()) > steps_) w.pop_front();
  }
  // Each worker's total over the window and the variance of that total (from the spread of
  // its per-step times), for the slowest and the fastest worker. A worker is judged as loaded
  // as it could be: at the total it would have with one more sample per step (batches are
  // whole samples; a worker at 4 samples cannot take 5% more), and a worker without samples
  // is never the fastest (its time is communication alone, which no plan can give work to
  // without its fixed cost per step; the controller took it to 0 for that).
  double slowest = 0.0, fastest = 0.0, slowest_var = 0.0, fastest_var = 0.0;
  for (const auto& [id, w] : window_) {
    if (static_cast<int>(w.size()) < steps_) return std::nullopt;
    double seconds = 0.0, squares = 0.0, samples = 0.0;
    for (const auto& [n, t] : w) {
      seconds += t;
      squares += t * t;
      samples += static_cast<double>(n);
    }
    const double k = static_cast<double>(w.size());
    const double var = k > 1 ? std::max(0.0, squares - seconds * seconds / k) * k / (k - 1) : 0.0;
    // var is the variance of the total (k steps); a step's deviation is sqrt(var / k).
    seconds += noise_margin_ * std::sqrt(var * k);
    if (seconds > slowest) {
      slowest = seconds;
      slowest_var = var;
    }
    if (samples <= 0 || seconds <= 0) continue;
    const double per_step = samples / k;
    const double one_more = (per_step + 1.0) / per_step;
    const double loaded = seconds * one_more;
    if (fastest <= 0 || loaded < fastest) {
      fastest = loaded;
      fastest_var = var * one_more * one_more;
    }
  }
  if (fastest <= 0) return std::nullopt;
  const double imbalance = slowest / fastest;
  if (imbalance < threshold_) return std::nullopt;
  // Noise alone does not re-plan: the gap must be clear of two standard errors.
  if (slowest - fastest <= 2.0 * std::sqrt(slowest_var + fastest_var)) return std::nullopt;
  ReplanTrigger out;
  out.imbalance = imbalance;
  for (const auto& [id, w] : window_) {
    Measurement& m = out.window[id];
    for (const auto& [n, t] : w) {
      m.samples += n;
      m.compute_seconds += t;
      m.steps += 1;
      if (n > 0) m.by_batch[static_cast<int>(n)].Add(t);
    }
  }
  window_.clear();  // measure afresh under the new split
  return out;
}

}  // namespace dbs
