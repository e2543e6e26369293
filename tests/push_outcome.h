// For tests of the step barrier: collects the result a push's callback receives.
#ifndef DBS_TESTS_PUSH_OUTCOME_H_
#define DBS_TESTS_PUSH_OUTCOME_H_

#include <optional>

#include "server/step_aggregator.h"

namespace dbs {

struct Outcome {
  std::optional<absl::StatusOr<StepResult>> result;
  StepAggregator::Done callback() {
    return [this](const absl::StatusOr<StepResult>& r) { result = r; };
  }
};

}  // namespace dbs

#endif  // DBS_TESTS_PUSH_OUTCOME_H_
