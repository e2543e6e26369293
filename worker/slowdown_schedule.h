// SlowdownSchedule: how much slower than its natural speed a worker computes at a given point of
// training, to emulate a heterogeneous or disturbed cluster on one machine.
//
// A base factor applies throughout; windows multiply it while active, like a background job that
// starts and stops. Windows are written "e<begin>:<end>:<factor>" (epochs begin..end-1) or
// "s<begin>:<end>:<factor>" (global steps begin..end-1, counted across epochs), separated by ';'.
// Example: "e2:4:3" slows epochs 2 and 3 three-fold. Pure; thread-compatible.
#ifndef DBS_WORKER_SLOWDOWN_SCHEDULE_H_
#define DBS_WORKER_SLOWDOWN_SCHEDULE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dbs {

struct SlowWindow {
  bool by_step = false;  // false: epochs; true: global steps
  int64_t begin = 0;     // inclusive
  int64_t end = 0;       // exclusive
  double factor = 1.0;
};

class SlowdownSchedule {
 public:
  SlowdownSchedule() = default;
  // INVALID_ARGUMENT for a base below 1, a malformed window, an empty range or a factor below 1.
  static absl::StatusOr<SlowdownSchedule> Create(double base, const std::string& windows);

  // The factor at `epoch` and `global_step` (>= 1).
  double FactorAt(int epoch, int64_t global_step) const;
  const std::vector<SlowWindow>& windows() const { return windows_; }
  double base() const { return base_; }

 private:
  double base_ = 1.0;
  std::vector<SlowWindow> windows_;
};

}  // namespace dbs

#endif  // DBS_WORKER_SLOWDOWN_SCHEDULE_H_
