#include "common/plan.h"

#include "absl/strings/str_cat.h"

namespace dbs {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("the server sent an invalid plan: ", what));
}

absl::Status CheckRanges(const std::vector<SampleRange>& ranges, int64_t size, const char* what) {
  for (const SampleRange& r : ranges) {
    if (r.begin < 0 || r.begin > r.end || r.end > size) {
      return Bad(absl::StrCat(what, " range [", r.begin, ", ", r.end,
                              ") is outside the data set [0, ", size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePlan(const WorkerPlan& plan, int64_t train_size, int64_t test_size) {
  if (plan.finished) return absl::OkStatus();
  if (plan.num_steps < 0 || plan.num_steps > kMaxStepsPerEpoch) {
    return Bad(absl::StrCat(plan.num_steps, " steps"));
  }
  if (plan.global_batch < 0 || plan.global_batch > kMaxGlobalBatch || plan.batch_size < 0 ||
      plan.final_batch_size < 0 || plan.batch_size > plan.global_batch ||
      plan.final_batch_size > plan.global_batch) {
    return Bad(absl::StrCat("batch ", plan.batch_size, " (last ", plan.final_batch_size,
                            ") of a global batch of ", plan.global_batch));
  }
  if (plan.train_ranges.size() > static_cast<size_t>(kMaxStepsPerEpoch) + 1) {
    return Bad(absl::StrCat(plan.train_ranges.size(), " training ranges"));
  }
  if (absl::Status s = CheckRanges(plan.train_ranges, train_size, "a training"); !s.ok()) return s;
  return CheckRanges({plan.test_range}, test_size, "the test");
}

absl::Status ValidateRevision(const PlanRevision& rev, int64_t train_size, int64_t test_size) {
  if (rev.num_steps < 0 || rev.num_steps > kMaxStepsPerEpoch || rev.from_step < 0 ||
      rev.from_step > rev.num_steps ||
      rev.num_steps - rev.from_step != static_cast<int>(rev.steps.size())) {
    return Bad(absl::StrCat("a revision of ", rev.num_steps, " steps from step ", rev.from_step,
                            " with ", rev.steps.size(), " steps of samples"));
  }
  for (const std::vector<SampleRange>& step : rev.steps) {
    if (absl::Status s = CheckRanges(step, train_size, "a training"); !s.ok()) return s;
  }
  return CheckRanges({rev.test_range}, test_size, "the test");
}

}  // namespace dbs
