#include "server/gradient_screen.h"

#include <algorithm>
#include <cmath>
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
double MedianOf(std::vector<double> v) {
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}
}  // namespace

absl::Status JudgeNorm(const PushNorm& push, const std::vector<PushNorm>& reference, double ratio,
                       absl::string_view against) {
  if (std::isnan(push.norm)) return absl::InvalidArgumentError("the gradient's norm is NaN");
  std::vector<double> norms, samples;
  for (const PushNorm& r : reference) {
    norms.push_back(r.norm);
    samples.push_back(r.samples);
  }
  const double median = MedianOf(norms);
  const double fewer = std::max(1.0, MedianOf(samples) / std::max(push.samples, 1));
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
