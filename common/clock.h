// Clock: the source of time for domain code, injected so tests can use simulated time.
// Implementations are thread-safe.
#ifndef DBS_COMMON_CLOCK_H_
#define DBS_COMMON_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace dbs {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // Waits `d` (a fake clock moves on by `d` instead).
  virtual void SleepFor(absl::Duration d) const = 0;
};

// Wall-clock time.
class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepFor(absl::Duration d) const override { absl::SleepFor(d); }
};

// Simulated time for tests: starts at the Unix epoch and moves only when told to.
class FakeClock : public Clock {
 public:
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void SleepFor(absl::Duration d) const override {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  void Advance(absl::Duration d) { SleepFor(d); }

 private:
  mutable absl::Mutex mu_;
  mutable absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch();
};

}  // namespace dbs

#endif  // DBS_COMMON_CLOCK_H_
