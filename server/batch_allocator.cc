#include "server/batch_allocator.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace dbs {

std::vector<int64_t> LargestRemainder(int64_t total, absl::Span<const double> shares) {
  const size_t n = shares.size();
  std::vector<int64_t> out(n, 0);
  if (n == 0 || total <= 0) return out;
  double sum = 0.0;
  for (double s : shares) sum += s;
  std::vector<double> frac(n, 0.0);
  int64_t assigned = 0;
  for (size_t i = 0; i < n; ++i) {
    const double exact = static_cast<double>(total) * (shares[i] / sum);
    out[i] = std::min<int64_t>(total, static_cast<int64_t>(std::floor(exact)));
    frac[i] = exact - static_cast<double>(out[i]);
    assigned += out[i];
  }
  // Floating-point rounding can in principle overshoot; take units back from the smallest parts.
  while (assigned > total) {
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (out[i] > 0 && (out[k] == 0 || frac[i] < frac[k])) k = i;
    }
    --out[k];
    frac[k] += 1.0;
    --assigned;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  for (size_t k = 0; assigned < total; k = (k + 1) % n) {
    ++out[order[k]];
    ++assigned;
  }
  return out;
}

absl::StatusOr<EpochAllocation> AllocateEpoch(int64_t train_samples, int64_t test_samples,
                                              int global_batch, absl::Span<const double> shares) {
  if (train_samples <= 0) return absl::InvalidArgumentError("the training set is empty");
  if (test_samples < 0) return absl::InvalidArgumentError("negative test set size");
  if (global_batch <= 0) return absl::InvalidArgumentError("global batch must be positive");
  if (shares.empty()) return absl::InvalidArgumentError("no workers to allocate to");
  double sum = 0.0;
  for (double s : shares) {
    if (!std::isfinite(s) || s < 0.0) {
      return absl::InvalidArgumentError(absl::StrCat("invalid share ", s));
    }
    sum += s;
  }
  if (sum <= 0.0) return absl::InvalidArgumentError("shares sum to zero");

  const int64_t full_steps = train_samples / global_batch;
  const int64_t remainder = train_samples % global_batch;
  const std::vector<int64_t> batch = LargestRemainder(global_batch, shares);
  const std::vector<int64_t> last =
      remainder > 0 ? LargestRemainder(remainder, shares) : batch;
  const std::vector<int64_t> test = LargestRemainder(test_samples, shares);

  EpochAllocation out;
  out.num_steps = static_cast<int>(full_steps + (remainder > 0 ? 1 : 0));
  out.workers.resize(shares.size());
  int64_t test_offset = 0;
  for (size_t i = 0; i < shares.size(); ++i) {
    WorkerAllocation& w = out.workers[i];
    w.share = shares[i] / sum;
    w.batch_size = static_cast<int>(batch[i]);
    w.final_batch_size = static_cast<int>(last[i]);
    w.test = {test_offset, test_offset + test[i]};
    test_offset += test[i];
  }
  for (int step = 0; step < out.num_steps; ++step) {
    const bool final_step = step == out.num_steps - 1;
    int64_t offset = static_cast<int64_t>(step) * global_batch;
    for (size_t i = 0; i < shares.size(); ++i) {
      const int64_t b = final_step ? last[i] : batch[i];
      if (b > 0) out.workers[i].train.push_back({offset, offset + b});
      offset += b;
    }
  }
  return out;
}

int64_t WorkerAllocation::train_samples() const {
  int64_t n = 0;
  for (const SampleRange& r : train) n += r.size();
  return n;
}

std::vector<double> EqualSplitPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  return std::vector<double>(workers.size(), workers.empty() ? 0.0 : 1.0 / workers.size());
}

std::vector<double> ProportionalPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  const size_t n = workers.size();
  std::vector<double> speed(n, -1.0);
  double known_sum = 0.0;
  int known = 0;
  auto speed_of = [](int64_t samples, double seconds) {
    if (samples <= 0 || !(seconds > 0.0) || !std::isfinite(seconds)) return -1.0;
    const double v = static_cast<double>(samples) / seconds;
    return std::isfinite(v) ? v : -1.0;
  };
  for (size_t i = 0; i < n; ++i) {
    const WorkerObservation& w = workers[i];
    speed[i] = speed_of(w.samples, w.compute_seconds);
    for (size_t k = 0; k + 1 < static_cast<size_t>(speed_window_) && k < w.earlier.size(); ++k) {
      const double v = speed_of(w.earlier[k].samples, w.earlier[k].compute_seconds);
      if (v > 0.0 && (speed[i] <= 0.0 || v < speed[i])) speed[i] = v;
    }
    if (speed[i] > 0.0) {
      known_sum += speed[i];
      ++known;
    }
  }
  if (known == 0) return EqualSplitPolicy().NextShares(workers);
  const double mean = known_sum / known;
  double total = 0.0;
  for (double& v : speed) {
    if (v <= 0.0) v = mean;
    total += v;
  }
  for (double& v : speed) v /= total;
  return speed;
}

absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const std::string& name,
                                                             int speed_window) {
  if (speed_window < 1) return absl::InvalidArgumentError("speed window must be >= 1 epoch");
  if (name == "dbs") return std::unique_ptr<SharePolicy>(new ProportionalPolicy(speed_window));
  if (name == "fixed") return std::unique_ptr<SharePolicy>(new EqualSplitPolicy());
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name, "'; use 'dbs' or 'fixed'"));
}

}  // namespace dbs

namespace dbs {

std::pair<double, double> CostModelPolicy::Fit(const WorkerObservation& w, int history) {
  // Points (steps, samples, seconds): seconds = a * steps + samples / v.
  struct Point {
    double steps, samples, seconds;
  };
  std::vector<Point> pts;
  auto add = [&](int64_t samples, double seconds, int steps) {
    if (samples > 0 && seconds > 0 && std::isfinite(seconds) && steps > 0) {
      pts.push_back({static_cast<double>(steps), static_cast<double>(samples), seconds});
    }
  };
  add(w.samples, w.compute_seconds, w.steps);
  for (size_t k = 0; k < w.earlier.size() && static_cast<int>(pts.size()) < history; ++k) {
    add(w.earlier[k].samples, w.earlier[k].compute_seconds, w.earlier[k].steps);
  }
  if (pts.empty()) return {0.0, -1.0};
  // Least squares on per-step quantities: t = seconds/steps = a + x / v with x = samples/steps.
  double sx = 0, st = 0, sxx = 0, sxt = 0;
  const double n = static_cast<double>(pts.size());
  for (const Point& p : pts) {
    const double x = p.samples / p.steps, t = p.seconds / p.steps;
    sx += x;
    st += t;
    sxx += x * x;
    sxt += x * t;
  }
  const double var = sxx - sx * sx / n;
  if (pts.size() >= 2 && var > 1e-9 * std::max(1.0, sxx)) {
    const double slope = (sxt - sx * st / n) / var;  // seconds per sample
    const double a = (st - slope * sx) / n;
    if (slope > 0 && a >= 0) return {a, 1.0 / slope};
  }
  // One batch size only (or a fit that makes no sense): no separable overhead.
  return {0.0, sx > 0 ? sx / st : -1.0};
}

std::vector<double> CostModelPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  const size_t n = workers.size();
  std::vector<double> a(n, 0.0), v(n, -1.0);
  double known = 0.0;
  int count = 0;
  for (size_t i = 0; i < n; ++i) {
    std::tie(a[i], v[i]) = Fit(workers[i], history_);
    if (v[i] > 0) {
      known += v[i];
      ++count;
    }
  }
  if (count == 0) return EqualSplitPolicy().NextShares(workers);
  for (size_t i = 0; i < n; ++i) {
    if (v[i] <= 0) {
      v[i] = known / count;  // unmeasured: the mean speed, no overhead
      a[i] = 0.0;
    }
  }
  // Water-filling within [lo, hi]: fix workers that hit a bound, balance the rest.
  const double B = global_batch_;
  const double lo = std::max(0, min_batch_);
  std::vector<double> hi(n, max_batch_ > 0 ? max_batch_ : B);
  for (size_t i = 0; i < n; ++i) {
    if (workers[i].max_batch > 0) hi[i] = std::min<double>(hi[i], workers[i].max_batch);
  }
  std::vector<double> b(n, 0.0);
  std::vector<bool> fixed(n, false);
  for (size_t round = 0; round <= n; ++round) {
    double budget = B, sv = 0.0, sva = 0.0;
    for (size_t i = 0; i < n; ++i) {
      if (fixed[i]) {
        budget -= b[i];
      } else {
        sv += v[i];
        sva += v[i] * a[i];
      }
    }
    if (sv <= 0) break;
    const double tau = (budget + sva) / sv;
    bool changed = false;
    for (size_t i = 0; i < n; ++i) {
      if (fixed[i]) continue;
      b[i] = v[i] * (tau - a[i]);
    }
    for (size_t i = 0; i < n; ++i) {
      if (fixed[i]) continue;
      if (b[i] < lo) {
        b[i] = lo;
        fixed[i] = changed = true;
      } else if (b[i] > hi[i]) {
        b[i] = hi[i];
        fixed[i] = changed = true;
      }
    }
    if (!changed) break;
  }
  double total = 0.0;
  for (double x : b) total += std::max(0.0, x);
  std::vector<double> shares(n);
  for (size_t i = 0; i < n; ++i) shares[i] = total > 0 ? std::max(0.0, b[i]) / total : 1.0 / n;
  return shares;
}

std::vector<double> SmoothedPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  std::vector<double> next = inner_->NextShares(workers);
  bool have_previous = true;
  double moved = 0.0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const double prev = workers[i].previous_share;
    if (!(prev > 0)) {
      have_previous = false;
      break;
    }
    moved = std::max(moved, std::abs(next[i] - prev) / prev);
  }
  if (!have_previous) return next;
  std::vector<double> out(workers.size());
  if (moved < deadband_) {
    for (size_t i = 0; i < workers.size(); ++i) out[i] = workers[i].previous_share;
  } else {
    for (size_t i = 0; i < workers.size(); ++i) {
      out[i] = alpha_ * next[i] + (1.0 - alpha_) * workers[i].previous_share;
    }
  }
  double total = 0.0;
  for (double x : out) total += x;
  for (double& x : out) x /= total;
  return out;
}

absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const PolicyConfig& c) {
  if (!(c.smoothing > 0.0 && c.smoothing <= 1.0)) {
    return absl::InvalidArgumentError("smoothing (alpha) must be in (0, 1]");
  }
  if (c.deadband < 0.0 || c.deadband >= 1.0) {
    return absl::InvalidArgumentError("deadband must be in [0, 1)");
  }
  std::unique_ptr<SharePolicy> inner;
  if (c.name == "cost") {
    if (c.min_batch < 0 || (c.max_batch > 0 && c.max_batch < c.min_batch) || c.history < 1) {
      return absl::InvalidArgumentError("cost policy needs 0 <= min_batch <= max_batch, history >= 1");
    }
    inner = std::make_unique<CostModelPolicy>(c.global_batch, c.min_batch, c.max_batch, c.history);
  } else {
    absl::StatusOr<std::unique_ptr<SharePolicy>> p = MakeSharePolicy(c.name, c.speed_window);
    if (!p.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown policy '", c.name, "'; use 'dbs', 'fixed' or 'cost'"));
    }
    inner = std::move(*p);
  }
  if (c.smoothing == 1.0 && c.deadband == 0.0) return inner;
  return std::unique_ptr<SharePolicy>(new SmoothedPolicy(std::move(inner), c.smoothing, c.deadband));
}

}  // namespace dbs
