#include "server/gradient_screen.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dbs {

absl::StatusOr<FaultyGradients> ParseFaultyGradients(absl::string_view name) {
  if (name == "off") return FaultyGradients::kOff;
  if (name == "log") return FaultyGradients::kLog;
  if (name == "evict") return FaultyGradients::kEvict;
  return absl::InvalidArgumentError(
      absl::StrCat("--faulty_gradients=", name, ": expected 'evict', 'log' or 'off'"));
}

const char* FaultyGradientsName(FaultyGradients mode) {
  switch (mode) {
    case FaultyGradients::kOff:
      return "off";
    case FaultyGradients::kLog:
      return "log";
    case FaultyGradients::kEvict:
      return "evict";
  }
  return "?";
}

namespace {
// The median of `value` over `pushes`, each weighted by its samples (every push alike when none
// has any): the value of the push that the middle sample of all of them belongs to.
template <typename Value>
double SampleMedian(const std::vector<PushNorm>& pushes, Value value) {
  std::vector<std::pair<double, double>> v;  // (value, weight)
  double total = 0.0;
  for (const PushNorm& p : pushes) total += std::max(p.samples, 0);
  for (const PushNorm& p : pushes) {
    v.emplace_back(value(p), total > 0 ? std::max(p.samples, 0) : 1.0);
  }
  if (total <= 0) total = static_cast<double>(v.size());
  std::sort(v.begin(), v.end());
  double below = 0.0;
  for (const auto& [x, w] : v) {
    below += w;
    if (below > total / 2) return x;
  }
  return v.back().first;
}
}  // namespace

absl::Status JudgeNorm(const PushNorm& push, const std::vector<PushNorm>& reference, double ratio,
                       absl::string_view against) {
  if (std::isnan(push.norm)) return absl::InvalidArgumentError("the gradient's norm is NaN");
  const double median = SampleMedian(reference, [](const PushNorm& p) { return p.norm; });
  const double samples =
      SampleMedian(reference, [](const PushNorm& p) { return static_cast<double>(p.samples); });
  const double fewer = std::max(1.0, samples / std::max(push.samples, 1));
  const double allowed = ratio * median * fewer;
  if (push.norm <= allowed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "the gradient's L2 norm %.4g (over %d samples) is %.4g times the median %.4g of %s "
      "(allowed: %.4g times)",
      push.norm, push.samples, median > 0 ? push.norm / median : INFINITY, median, against,
      allowed / std::max(median, 1e-300)));
}

absl::Status GradientScreen::Judge(const PushNorm& push) const {
  if (config_.mode == FaultyGradients::kOff) return absl::OkStatus();
  if (static_cast<int>(recent_.size()) < config_.min_history) {
    return std::isfinite(push.norm)
               ? absl::OkStatus()
               : absl::InvalidArgumentError("the gradient's norm is not finite");
  }
  return JudgeNorm(push, recent_, config_.norm_ratio,
                   absl::StrCat("the last ", recent_.size(), " accepted pushes"));
}

void GradientScreen::Accepted(const PushNorm& push) {
  if (!std::isfinite(push.norm)) return;
  recent_.push_back(push);
  if (static_cast<int>(recent_.size()) > config_.history) recent_.erase(recent_.begin());
}

}  // namespace dbs
