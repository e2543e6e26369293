// Clock: the source of time for domain code, injected so tests can use simulated time.
// Implementations are thread-safe.
#ifndef DBS_COMMON_CLOCK_H_
#define DBS_COMMON_CLOCK_H_

#include <time.h>

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
  // CPU time this process has used, all threads together (a fake clock: the simulated time, as
  // if the process had computed all along). The measure of work done, whatever the contention.
  virtual absl::Duration ProcessCpuTime() const = 0;
};

// Wall-clock time.
class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepFor(absl::Duration d) const override { absl::SleepFor(d); }
  absl::Duration ProcessCpuTime() const override {
    timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return absl::ZeroDuration();
    return absl::DurationFromTimespec(ts);
  }
};

// Simulated time for tests: starts at the Unix epoch and moves only when told to. Advance() is
// computing (wall and CPU time move), SleepFor() is waiting (only wall time moves).
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
  absl::Duration ProcessCpuTime() const override {
    absl::MutexLock lock(&mu_);
    return cpu_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
    cpu_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  mutable absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch();
  absl::Duration cpu_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_COMMON_CLOCK_H_
