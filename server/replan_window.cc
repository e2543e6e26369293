#include "server/replan_window.h"

#include <algorithm>
#include <cmath>

namespace dbs {
namespace {

using Window = std::deque<std::pair<int64_t, double>>;  // (samples, seconds) per step

// One worker's window as the trigger judges it: its total step time (with the noise margin),
// the variance of that total, and as loaded as it could be: the total it would have with one
// more sample per step (batches are whole samples; a worker at 4 samples cannot take 5% more),
// 0 for a worker without samples (its time is communication alone, which no plan can give
// work to without its fixed cost per step; the controller took it to 0 for that).
struct Load {
  double seconds = 0.0;
  double var = 0.0;
  double loaded = 0.0;
  double loaded_var = 0.0;
};

Load LoadOf(const Window& w, double noise_margin) {
  Load l;
  double squares = 0.0, samples = 0.0;
  for (const auto& [n, t] : w) {
    l.seconds += t;
    squares += t * t;
    samples += static_cast<double>(n);
  }
  const double k = static_cast<double>(w.size());
  l.var = k > 1 ? std::max(0.0, squares - l.seconds * l.seconds / k) * k / (k - 1) : 0.0;
  // var is the variance of the total (k steps); a step's deviation is sqrt(var / k).
  l.seconds += noise_margin * std::sqrt(l.var * k);
  if (samples > 0 && l.seconds > 0) {
    const double per_step = samples / k;
    const double one_more = (per_step + 1.0) / per_step;
    l.loaded = l.seconds * one_more;
    l.loaded_var = l.var * one_more * one_more;
  }
  return l;
}

Measurement WindowMeasurement(const Window& w) {
  Measurement m;
  for (const auto& [n, t] : w) {
    m.samples += n;
    m.compute_seconds += t;
    m.steps += 1;
    if (n > 0) m.by_batch[static_cast<int>(n)].Add(t);
  }
  return m;
}

}  // namespace

std::optional<ReplanTrigger> ReplanWindow::Add(
    int epoch, const std::map<int, std::pair<int64_t, double>>& step) {
  if (steps_ <= 0) return std::nullopt;
  if (epoch != epoch_) {
    window_.clear();
    epoch_ = epoch;
  }
  for (const auto& [id, sample] : step) {
    Window& w = window_[id];
    w.push_back(sample);
    while (static_cast<int>(w.size()) > steps_) w.pop_front();
  }
  // The slowest worker's total against the fastest's as loaded as it could be.
  Load slowest, fastest;
  bool idle = false;
  for (const auto& [id, w] : window_) {
    if (static_cast<int>(w.size()) < steps_) return std::nullopt;
    const Load l = LoadOf(w, noise_margin_);
    if (l.seconds > slowest.seconds) slowest = l;
    if (l.loaded > 0 && (fastest.loaded <= 0 || l.loaded < fastest.loaded)) fastest = l;
    idle = idle || l.loaded <= 0;
  }
  if (fastest.loaded <= 0) return std::nullopt;
  const double imbalance = slowest.seconds / fastest.loaded;
  // Noise alone does not re-plan: the gap must be clear of two standard errors.
  const bool imbalanced =
      imbalance >= threshold_ &&
      slowest.seconds - fastest.loaded > 2.0 * std::sqrt(slowest.var + fastest.loaded_var);
  if (!imbalanced && !idle) return std::nullopt;
  ReplanTrigger out;
  out.imbalance = imbalance;
  out.idle = idle;
  for (const auto& [id, w] : window_) out.window[id] = WindowMeasurement(w);
  window_.clear();  // measure afresh under the new split
  return out;
}

}  // namespace dbs
