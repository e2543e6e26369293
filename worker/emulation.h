// Emulating a slower worker on a faster machine, for benchmarks and tests on one host
// (`dbs_worker --slowdown`, `--slow_windows`, `--slowdown_of`, `--measure_speed_samples`): the
// pause after each computation that makes it appear slower, and a standalone speed measurement.
#ifndef DBS_WORKER_EMULATION_H_
#define DBS_WORKER_EMULATION_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "worker/learner.h"
#include "worker/slowdown_schedule.h"

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

// A learner whose computations take the schedule's factor times longer, in the sense of `of`: a
// slower worker emulated on one host. The factor follows the training position, which the
// training loop announces before each step (LoopConfig::before_step -> At). Everything else is
// the wrapped learner's.
class SlowedLearner : public Learner {
 public:
  // `inner` and `clock` must outlive it.
  SlowedLearner(Learner* inner, SlowdownSchedule schedule, SlowdownOf of, const Clock* clock)
      : inner_(inner), schedule_(std::move(schedule)), of_(of), clock_(clock) {}

  // The epoch and the global step (counted across epochs) the next computations belong to.
  void At(int epoch, int64_t global_step) {
    epoch_ = epoch;
    step_ = global_step;
  }
  const SlowdownSchedule& schedule() const { return schedule_; }
  SlowdownOf of() const { return of_; }

  int64_t train_size() const override { return inner_->train_size(); }
  int64_t test_size() const override { return inner_->test_size(); }
  std::string device() const override { return inner_->device(); }
  std::string DescribeData() const override { return inner_->DescribeData(); }
  const ModelLayout& layout() const override { return inner_->layout(); }
  void GetParameters(absl::Span<float> out) override { inner_->GetParameters(out); }
  void SetParameters(absl::Span<const float> values) override { inner_->SetParameters(values); }
  absl::StatusOr<double> ComputeGradient(absl::Span<const int64_t> indices,
                                         absl::Span<float> grad) override;
  EvalResult Evaluate(int64_t begin, int64_t end) override { return inner_->Evaluate(begin, end); }
  absl::Status Export(const std::string& path) override { return inner_->Export(path); }

 private:
  Learner* const inner_;
  const SlowdownSchedule schedule_;
  const SlowdownOf of_;
  const Clock* const clock_;
  int epoch_ = 0;
  int64_t step_ = 0;
};

// Standalone compute speed, without a server: forward/backward over `samples` training samples
// in batches of `batch` (after one warm-up batch) through `learner` (a SlowedLearner for an
// emulated slowdown). Samples per second.
absl::StatusOr<double> MeasureSpeed(Learner* learner, const Clock* clock, int64_t samples,
                                    int batch);

}  // namespace dbs

#endif  // DBS_WORKER_EMULATION_H_
