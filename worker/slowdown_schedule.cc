#include "worker/slowdown_schedule.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace dbs {

absl::StatusOr<SlowdownSchedule> SlowdownSchedule::Create(double base, const std::string& windows) {
  if (!(base >= 1.0) || !std::isfinite(base)) {
    return absl::InvalidArgumentError("slowdown must be >= 1");
  }
  SlowdownSchedule s;
  s.base_ = base;
  for (absl::string_view part : absl::StrSplit(windows, ';', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    const auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad slowdown window '", part, "': ", why,
          " (expected e<begin>:<end>:<factor> or s<begin>:<end>:<factor>, e.g. e2:4:3)"));
    };
    SlowWindow w;
    if (absl::ConsumePrefix(&part, "e")) {
      w.by_step = false;
    } else if (absl::ConsumePrefix(&part, "s")) {
      w.by_step = true;
    } else {
      return bad("it must start with 'e' (epochs) or 's' (steps)");
    }
    std::vector<absl::string_view> fields = absl::StrSplit(part, ':');
    if (fields.size() != 3 || !absl::SimpleAtoi(fields[0], &w.begin) ||
        !absl::SimpleAtoi(fields[1], &w.end) || !absl::SimpleAtod(fields[2], &w.factor)) {
      return bad("three numbers separated by ':' are needed");
    }
    if (w.begin < 0 || w.end <= w.begin) return bad("the range is empty or negative");
    if (!(w.factor >= 1.0) || !std::isfinite(w.factor)) return bad("the factor must be >= 1");
    s.windows_.push_back(w);
  }
  return s;
}

double SlowdownSchedule::FactorAt(int epoch, int64_t global_step) const {
  double f = base_;
  for (const SlowWindow& w : windows_) {
    const int64_t at = w.by_step ? global_step : epoch;
    if (at >= w.begin && at < w.end) f *= w.factor;
  }
  return f;
}

}  // namespace dbs
