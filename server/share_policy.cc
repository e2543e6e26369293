#include "server/share_policy.h"

#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/balancing_policy.h"

namespace dbs {

std::string PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kDbs:
      return "dbs";
    case PolicyKind::kProportional:
      return "proportional";
    case PolicyKind::kFixed:
      return "fixed";
  }
  return "unknown";
}

absl::StatusOr<PolicyKind> ParsePolicy(const std::string& name) {
  for (PolicyKind k : {PolicyKind::kDbs, PolicyKind::kProportional, PolicyKind::kFixed}) {
    if (name == PolicyName(k)) return k;
  }
  std::string hint;
  if (name == "cost") hint = " ('cost' is now part of 'dbs', which models per-step overheads)";
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name, "'; use 'dbs', 'proportional' or 'fixed'", hint));
}

int ReplanWindowSteps(PolicyKind kind, int configured) {
  if (kind == PolicyKind::kFixed) return 0;  // nothing to re-plan: the split never moves
  if (configured >= 0) return configured;
  return kind == PolicyKind::kDbs ? kDbsReplanWindowSteps : 0;
}

double Measurement::MainBatch() const {
  int best = -1, best_steps = -1;
  for (const auto& [batch, t] : by_batch) {
    if (t.steps > best_steps) {
      best = batch;
      best_steps = t.steps;
    }
  }
  if (best >= 0) return best;
  return steps > 0 ? static_cast<double>(samples) / steps : 0.0;
}

std::vector<double> EqualSplitPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  return std::vector<double>(workers.size(), workers.empty() ? 0.0 : 1.0 / workers.size());
}

std::vector<double> SharePolicy::FirstShares(absl::Span<const WorkerObservation> workers) const {
  return EqualSplitPolicy().NextShares(workers);
}

absl::Status SharePolicy::Admits(const std::string& /*name*/) const { return absl::OkStatus(); }

std::vector<double> WeightedSplitPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  std::vector<double> shares(workers.size(), 0.0);
  double total = 0.0;
  for (size_t i = 0; i < workers.size(); ++i) {
    auto w = weights_.find(workers[i].name);
    shares[i] = w == weights_.end() ? 0.0 : w->second;
    total += shares[i];
  }
  if (!(total > 0.0)) return EqualSplitPolicy().NextShares(workers);
  for (double& s : shares) s /= total;
  return shares;
}

absl::Status WeightedSplitPolicy::Admits(const std::string& name) const {
  if (weights_.count(name) > 0) return absl::OkStatus();
  std::vector<std::string> names;
  for (const auto& [n, unused] : weights_) names.push_back(n);
  return absl::FailedPreconditionError(absl::StrCat(
      "worker '", name, "' has no weight in this job's fixed split (", absl::StrJoin(names, ", "),
      "); start it with one of those names (--name) or "
      "give it a weight in dbs_ps --fixed_split"));
}

absl::StatusOr<std::map<std::string, double>> ParseFixedSplit(const std::string& text) {
  std::map<std::string, double> split;
  if (text.empty()) return split;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    const size_t colon = item.rfind(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fixed_split: '", item, "' is not NAME:WEIGHT (e.g. worker-0:1,worker-1:3)"));
    }
    const std::string name(item.substr(0, colon));
    double weight = 0.0;
    if (!absl::SimpleAtod(item.substr(colon + 1), &weight) || !std::isfinite(weight) ||
        weight < 0.0) {
      return absl::InvalidArgumentError(absl::StrCat("fixed_split: the weight of '", name,
                                                     "' must be a number >= 0, not '",
                                                     item.substr(colon + 1), "'"));
    }
    if (!split.emplace(name, weight).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("fixed_split: worker '", name, "' is named twice"));
    }
  }
  return split;
}

std::string FixedSplitText(const std::map<std::string, double>& split) {
  return absl::StrJoin(split, ",", [](std::string* out, const auto& kv) {
    absl::StrAppend(out, kv.first, ":", kv.second);
  });
}

std::vector<double> ProportionalPolicy::NextShares(
    absl::Span<const WorkerObservation> workers) const {
  const size_t n = workers.size();
  std::vector<double> speed(n, -1.0);
  double known_sum = 0.0;
  int known = 0;
  auto speed_of = [](const Measurement& m) {
    if (m.samples <= 0 || !(m.compute_seconds > 0.0) || !std::isfinite(m.compute_seconds)) {
      return -1.0;
    }
    const double v = static_cast<double>(m.samples) / m.compute_seconds;
    return std::isfinite(v) ? v : -1.0;
  };
  for (size_t i = 0; i < n; ++i) {
    const std::vector<Measurement>& h = workers[i].history;
    for (size_t k = 0; k < static_cast<size_t>(speed_window_) && k < h.size(); ++k) {
      const double v = speed_of(h[h.size() - 1 - k]);
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

std::vector<double> SmoothedPolicy::NextShares(absl::Span<const WorkerObservation> workers) const {
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

absl::Status ValidatePolicyConfig(const PolicyConfig& c) {
  if (!(c.smoothing > 0.0 && c.smoothing <= 1.0)) {
    return absl::InvalidArgumentError("smoothing must be in (0, 1]");
  }
  if (!(c.deadband >= 0.0 && c.deadband < 1.0)) {
    return absl::InvalidArgumentError("deadband must be in [0, 1)");
  }
  if (c.speed_window < 1) return absl::InvalidArgumentError("speed_window must be >= 1");
  if (!(c.noise_margin >= 0.0 && c.noise_margin <= 4.0)) {
    return absl::InvalidArgumentError("noise_margin must be in [0, 4] standard deviations");
  }
  if (c.global_batch < 1) return absl::InvalidArgumentError("global_batch must be >= 1");
  if (!c.fixed_split.empty()) {
    if (c.kind != PolicyKind::kFixed) {
      return absl::InvalidArgumentError(
          absl::StrCat("fixed_split needs policy 'fixed', not '", PolicyName(c.kind), "'"));
    }
    double total = 0.0;
    for (const auto& [name, weight] : c.fixed_split) {
      if (name.empty()) return absl::InvalidArgumentError("fixed_split: a worker name is empty");
      if (!std::isfinite(weight) || weight < 0.0) {
        return absl::InvalidArgumentError(
            absl::StrCat("fixed_split: the weight of '", name, "' must be >= 0"));
      }
      total += weight;
    }
    if (!(total > 0.0)) {
      return absl::InvalidArgumentError("fixed_split: at least one weight must be above 0");
    }
  }
  if (c.min_batch < 0 || c.max_batch < 0 || (c.max_batch > 0 && c.max_batch < c.min_batch)) {
    return absl::InvalidArgumentError("batch bounds need 0 <= min_batch <= max_batch (0: none)");
  }
  return absl::OkStatus();
}

BalancingOptions BalancingOptionsOf(const PolicyConfig& c) {
  BalancingOptions o;
  o.global_batch = c.global_batch;
  o.min_batch = c.min_batch;
  o.max_batch = c.max_batch;
  o.noise_margin = c.noise_margin;
  return o;
}

absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const PolicyConfig& c) {
  if (absl::Status valid = ValidatePolicyConfig(c); !valid.ok()) return valid;
  std::unique_ptr<SharePolicy> inner;
  switch (c.kind) {
    case PolicyKind::kDbs:
      inner = std::make_unique<BalancingPolicy>(BalancingOptionsOf(c));
      break;
    case PolicyKind::kProportional:
      inner = std::make_unique<ProportionalPolicy>(c.speed_window);
      break;
    case PolicyKind::kFixed:
      if (c.fixed_split.empty()) {
        inner = std::make_unique<EqualSplitPolicy>();
      } else {
        inner = std::make_unique<WeightedSplitPolicy>(c.fixed_split);
      }
      break;
  }
  if (c.smoothing == 1.0 && c.deadband == 0.0) return inner;
  return std::unique_ptr<SharePolicy>(
      new SmoothedPolicy(std::move(inner), c.smoothing, c.deadband));
}

}  // namespace dbs
