#include "bench/simulation.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "server/scheduler.h"

namespace dbs {

double SimulationResult::SteadyEpochSeconds() const {
  if (epoch_seconds.size() < 2) return epoch_seconds.empty() ? 0.0 : epoch_seconds[0];
  double sum = 0.0;
  for (size_t e = 1; e < epoch_seconds.size(); ++e) sum += epoch_seconds[e];
  return sum / static_cast<double>(epoch_seconds.size() - 1);
}

absl::StatusOr<SimulationResult> Simulate(const SimulationConfig& config) {
  const int n = static_cast<int>(config.speeds.size());
  if (n == 0) return absl::InvalidArgumentError("no workers");
  for (double v : config.speeds) {
    if (!(v > 0)) return absl::InvalidArgumentError("speeds must be positive");
  }
  SchedulerConfig sc;
  sc.expected_workers = n;
  sc.epochs = config.epochs;
  sc.global_batch = config.global_batch;
  DBS_RETURN_IF_ERROR(Scheduler::ValidateConfig(sc));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharePolicy> policy, MakeSharePolicy(config.policy));
  FakeClock clock;
  Scheduler scheduler(sc, std::move(policy), &clock, nullptr);
  for (int i = 0; i < n; ++i) {
    DBS_RETURN_IF_ERROR(
        scheduler.Register({absl::StrCat("sim-", i), config.train_samples, 0, "sim"}).status());
  }
  SimulationResult result;
  double total_speed = 0.0;
  for (double v : config.speeds) total_speed += v;
  result.ideal_epoch_seconds = static_cast<double>(config.train_samples) / total_speed;
  result.step_comm_seconds = config.comm_base_seconds + config.comm_per_worker_seconds * n;

  for (int epoch = 0; epoch < config.epochs; ++epoch) {
    std::vector<WorkerPlan> plans(n);
    for (int i = 0; i < n; ++i) {
      std::optional<absl::StatusOr<WorkerPlan>> got;
      scheduler.AwaitPlan(i, epoch, [&got](const absl::StatusOr<WorkerPlan>& p) { got = p; });
      if (!got.has_value()) return absl::InternalError("plan not ready");
      DBS_RETURN_IF_ERROR(got->status());
      plans[i] = **got;
    }
    const int steps = plans[0].num_steps;
    result.steps = steps;
    double epoch_time = 0.0;
    std::vector<double> compute(n, 0.0);
    for (int s = 0; s < steps; ++s) {
      double slowest = 0.0;
      for (int i = 0; i < n; ++i) {
        const double t = plans[i].BatchAt(s) / config.speeds[i];
        compute[i] += t;
        slowest = std::max(slowest, t);
      }
      epoch_time += slowest + result.step_comm_seconds;
    }
    std::vector<int> batches;
    for (int i = 0; i < n; ++i) batches.push_back(plans[i].batch_size);
    result.batch_sizes.push_back(batches);
    result.epoch_seconds.push_back(epoch_time);
    clock.Advance(absl::Seconds(epoch_time));
    for (int i = 0; i < n; ++i) {
      EpochTiming t;
      t.worker_id = i;
      t.epoch = epoch;
      t.samples = plans[i].TrainSamples();
      t.compute_seconds = compute[i];
      DBS_RETURN_IF_ERROR(scheduler.Report(t));
    }
  }
  return result;
}

}  // namespace dbs
