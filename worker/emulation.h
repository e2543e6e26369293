// Emulating a slower worker on a faster machine, for benchmarks and tests on one host
// (`dbs_worker --slowdown`, `--slow_windows`, `--slowdown_of`, `--measure_speed_samples`): the
// pause after each computation that makes it appear slower, and a standalone speed measurement.
#ifndef DBS_WORKER_EMULATION_H_
#define DBS_WORKER_EMULATION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "worker/learner.h"

namespace dbs {

// What an emulated slowdown f multiplies (`dbs_worker --slowdown_of`).
enum class SlowdownOf {
  // The computation ends f x its CPU time after it began, like the same work on a core of its
  // own f times slower: time spent waiting for a core that emulated neighbours on the same
  // machine hold is part of that, unless it is longer than the slowdown's share.
  kCpu,
  // f x its elapsed time: a worker held to a CPU quota, whose time off the CPU is its own
  // throttling (slowing only its CPU time would let the quota refill while it sleeps).
  kWall,
};

// Parses `cpu` or `wall`.
absl::StatusOr<SlowdownOf> ParseSlowdownOf(absl::string_view name);

// After a computation that began at `began` and used `cpu` of CPU time, sleeps so that it
// appears `factor` times slower in the sense of `of`.
void EmulateSlowdown(const Clock* clock, absl::Time began, absl::Duration cpu, double factor,
                     SlowdownOf of);

// Standalone compute speed, without a server: forward/backward over `samples` training samples
// in batches of `batch` (after one warm-up batch), slowed `slowdown` times (in the sense of
// `of`). Samples per second.
absl::StatusOr<double> MeasureSpeed(Learner* learner, const Clock* clock, double slowdown,
                                    int64_t samples, int batch, SlowdownOf of = SlowdownOf::kCpu);

}  // namespace dbs

#endif  // DBS_WORKER_EMULATION_H_
