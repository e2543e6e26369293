// For tests of the step barrier: collects the result a push's callback receives, and makes a
// gradient that lies in its sender's shared memory.
#ifndef DBS_TESTS_PUSH_OUTCOME_H_
#define DBS_TESTS_PUSH_OUTCOME_H_

#include <memory>
#include <optional>
#include <vector>

#include "server/step_aggregator.h"

namespace dbs {

struct Outcome {
  std::optional<absl::StatusOr<StepResult>> result;
  StepAggregator::Done callback() {
    return [this](const absl::StatusOr<StepResult>& r) { result = r; };
  }
};

// A gradient read from `region`, which its sender can still write after the push (as a
// worker's shared memory): the test rewrites it while the push waits for its turn.
inline PushedGradient SharedRegion(std::vector<float>* region) {
  auto payload = std::make_shared<WirePayload>();
  payload->segments.emplace_back(reinterpret_cast<const uint8_t*>(region->data()),
                                 region->size() * sizeof(float));
  payload->bytes = region->size() * sizeof(float);
  payload->writable_by_sender = true;
  return std::shared_ptr<const WirePayload>(payload);
}

}  // namespace dbs

#endif  // DBS_TESTS_PUSH_OUTCOME_H_
