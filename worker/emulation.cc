#include "worker/emulation.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor.h"

namespace dbs {

absl::StatusOr<SlowdownOf> ParseSlowdownOf(absl::string_view name) {
  if (name == "cpu") return SlowdownOf::kCpu;
  if (name == "wall") return SlowdownOf::kWall;
  return absl::InvalidArgumentError(
      absl::StrCat("--slowdown_of must be 'cpu' or 'wall', not '", name, "'"));
}

// On a machine shared by several emulated workers, the time a computation waited for a core is
// contention among them, which separate slow machines would not have. kCpu hides it inside the
// slowdown: a core f times slower would have taken f x the CPU time whether or not a neighbour
// held this one meanwhile.
void EmulateSlowdown(const Clock* clock, absl::Time began, absl::Duration cpu, double factor,
                     SlowdownOf of) {
  if (factor <= 1.0) return;
  const absl::Duration elapsed = clock->Now() - began;
  switch (of) {
    case SlowdownOf::kCpu:
      if (cpu * factor > elapsed) clock->SleepFor(cpu * factor - elapsed);
      return;
    case SlowdownOf::kWall:
      clock->SleepFor(elapsed * (factor - 1.0));
      return;
  }
}

absl::StatusOr<double> SlowedLearner::ComputeGradient(absl::Span<const int64_t> indices,
                                                      absl::Span<float> grad) {
  const absl::Time began = clock_->Now();
  const absl::Duration cpu = clock_->ProcessCpuTime();
  absl::StatusOr<double> loss = inner_->ComputeGradient(indices, grad);
  if (loss.ok()) {
    EmulateSlowdown(clock_, began, clock_->ProcessCpuTime() - cpu,
                    schedule_.FactorAt(epoch_, step_), of_);
  }
  return loss;
}

absl::StatusOr<double> MeasureSpeed(Learner* learner, const Clock* clock, int64_t samples,
                                    int batch) {
  if (samples < 1 || batch < 1) return absl::InvalidArgumentError("samples and batch must be >= 1");
  const int64_t n = learner->train_size();
  if (n < 1) return absl::FailedPreconditionError("the training set is empty");
  std::vector<float> grad(static_cast<size_t>(TotalElements(learner->layout())));
  std::vector<int64_t> index;
  auto batch_at = [&](int64_t begin) {
    index.clear();
    for (int64_t i = begin; i < std::min<int64_t>(n, begin + batch); ++i) index.push_back(i);
  };
  batch_at(0);
  DBS_RETURN_IF_ERROR(learner->ComputeGradient(index, absl::MakeSpan(grad)).status());  // warm-up
  double seconds = 0.0;
  int64_t done = 0;
  while (done < samples) {
    batch_at(done % n);
    const absl::Time t0 = clock->Now();
    DBS_RETURN_IF_ERROR(learner->ComputeGradient(index, absl::MakeSpan(grad)).status());
    seconds += absl::ToDoubleSeconds(clock->Now() - t0);
    done += static_cast<int64_t>(index.size());
  }
  return done / std::max(seconds, 1e-12);
}

}  // namespace dbs
