// Simulation of synchronous training on many workers with the real Scheduler (and so the real
// share policy and BatchAllocator) on a simulated clock.
//
// Worker i computes at v_i samples per second; each step also costs a communication time c that
// every worker pays (a parameter server receives n gradients and sends n parameter copies, so
// c = c0 + c1 * n). A step takes max_i(b_i / v_i) + c; an epoch is the sum of its steps. Each
// epoch the workers report their compute-only time to the scheduler, exactly as dbs_worker does,
// and the scheduler's plan for the next epoch is used. Pure computation; thread-compatible.
#ifndef DBS_BENCH_SIMULATION_H_
#define DBS_BENCH_SIMULATION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dbs {

struct SimulationConfig {
  std::vector<double> speeds;  // samples per second, one per worker
  double comm_base_seconds = 0.0;        // c0
  double comm_per_worker_seconds = 0.0;  // c1
  int64_t train_samples = 60000;
  int global_batch = 128;
  int epochs = 5;
  std::string policy = "dbs";  // or "fixed"
};

struct SimulationResult {
  std::vector<double> epoch_seconds;
  std::vector<std::vector<int>> batch_sizes;  // per epoch, per worker
  double ideal_epoch_seconds = 0.0;  // D / sum(v): compute only, perfectly balanced
  double step_comm_seconds = 0.0;
  int steps = 0;
  // Mean epoch time after the first (the first is always the equal split).
  double SteadyEpochSeconds() const;
};

absl::StatusOr<SimulationResult> Simulate(const SimulationConfig& config);

}  // namespace dbs

#endif  // DBS_BENCH_SIMULATION_H_
