// Exponential backoff with jitter for reconnecting to a peer. Not thread-safe (one per caller).
#ifndef DBS_COMMON_BACKOFF_H_
#define DBS_COMMON_BACKOFF_H_

#include <cstdint>

#include "absl/time/time.h"

namespace dbs {

struct BackoffConfig {
  absl::Duration initial = absl::Milliseconds(100);
  absl::Duration max = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;  // each delay is scaled by a factor in [1 - jitter, 1 + jitter]
};

class Backoff {
 public:
  explicit Backoff(BackoffConfig config, uint64_t seed = 1);
  // The delay before the next attempt; grows geometrically up to `max` (before jitter).
  absl::Duration Next();
  int attempts() const { return attempts_; }

 private:
  BackoffConfig config_;
  absl::Duration current_;
  uint64_t state_;
  int attempts_ = 0;
};

}  // namespace dbs

#endif  // DBS_COMMON_BACKOFF_H_
