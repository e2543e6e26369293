#include "common/backoff.h"

#include <algorithm>

namespace dbs {

Backoff::Backoff(BackoffConfig config, uint64_t seed)
    : config_(config), current_(config.initial), state_(seed | 1) {}

absl::Duration Backoff::Next() {
  ++attempts_;
  // xorshift64 for jitter: cheap and deterministic given the seed.
  state_ ^= state_ << 13;
  state_ ^= state_ >> 7;
  state_ ^= state_ << 17;
  const double unit = static_cast<double>(state_ >> 11) / static_cast<double>(1ULL << 53);
  const double scale = 1.0 + config_.jitter * (2.0 * unit - 1.0);
  const absl::Duration delay = current_ * scale;
  current_ = std::min(config_.max, current_ * config_.multiplier);
  return delay;
}

}  // namespace dbs
