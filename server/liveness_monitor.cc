#include "server/liveness_monitor.h"

namespace dbs {

LivenessMonitor::LivenessMonitor(LivenessConfig config, const Clock* clock)
    : config_(config), clock_(clock) {}

bool LivenessMonitor::Stalled(int64_t activity, bool started) {
  if (config_.stall_timeout <= absl::ZeroDuration()) return false;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  // Before training starts, the clock runs once someone registered: a job that never gets all
  // its workers must not wait forever.
  if (activity != last_activity_count_ || (!started && activity == 0)) {
    last_activity_count_ = activity;
    last_activity_ = now;
    return false;
  }
  return now - last_activity_ >= config_.stall_timeout;
}

std::set<int> LivenessMonitor::Overdue(const StepWait& wait) {
  if (config_.worker_timeout <= absl::ZeroDuration()) return {};
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  const std::pair<int, int> at = {wait.epoch, wait.step};
  if (wait.pushed == 0 || wait.waiting_for.empty()) {
    watched_step_ = {-1, -1};
    return {};
  }
  if (watched_step_ != at) {
    watched_step_ = at;
    watched_since_ = now;
    return {};
  }
  if (now - watched_since_ < config_.worker_timeout) return {};
  return std::set<int>(wait.waiting_for.begin(), wait.waiting_for.end());
}

}  // namespace dbs
