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

double GradientScreen::Median() const {
  if (recent_.empty()) return 0.0;
  std::vector<double> v(recent_.begin(), recent_.end());
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

absl::Status GradientScreen::Judge(double norm) const {
  if (config_.mode == FaultyGradients::kOff) return absl::OkStatus();
  if (std::isnan(norm)) return absl::InvalidArgumentError("the gradient's norm is NaN");
  if (static_cast<int>(recent_.size()) < config_.min_history) {
    return std::isfinite(norm) ? absl::OkStatus()
                               : absl::InvalidArgumentError("the gradient's norm is infinite");
  }
  const double median = Median();
  if (norm <= config_.norm_ratio * median) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "the gradient's L2 norm %.4g is %.4g times the median %.4g of the last %d accepted pushes "
      "(--faulty_norm_ratio=%g)",
      norm, median > 0 ? norm / median : INFINITY, median, recent_.size(), config_.norm_ratio));
}

void GradientScreen::Accepted(double norm) {
  if (!std::isfinite(norm)) return;
  recent_.push_back(norm);
  while (static_cast<int>(recent_.size()) > config_.history) recent_.pop_front();
}

}  // namespace dbs
