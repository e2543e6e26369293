// Simulation of synchronous training with the real Scheduler (and so the real share policies and
// BatchAllocator) on a simulated clock.
//
// Each worker has a speed model: its compute time per step as a function of its batch.
//   linear  b / v (+ a fixed per-step overhead): the paper's assumption;
//   quota   a process under a CPU quota: full speed while a step's work fits the quota of one
//           scheduling period, throttled to the quota's fraction of a core beyond it (the curve
//           that makes the paper's rule oscillate);
//   gpu     a per-step overhead plus time growing sublinearly with the batch, a + c * b^e, e < 1;
//   cfs     the kernel's CFS bandwidth control itself, as `cpu.cfs_quota_us` / `cpu.max` apply
//           it: every period the worker may run quota * period seconds, then waits for the next
//           period, whatever its steps need. A step's time depends on where in its period it
//           starts and on what the steps before it used, so a small step often runs at full
//           speed and looks many times faster than the worker can sustain (quota of a core).
//           Its true step time (for the best split) is the sustainable one: work / quota.
// On top: per-step noise (lognormal, relative standard deviation `noise`), a slow drift of speed
// per epoch, disturbances (a worker slowed f-fold for a range of epochs) and bursts (a worker
// slowed f-fold for some seconds of the run, as when an unrelated task lands on its machine).
// A cfs worker reports what dbs_worker reports under a CPU limit (SimulationConfig::
// cpu_limit_aware): the larger of its step's time and its CPU time over the quota.
// Every step also costs a communication time c = c0 + c1 * n that every worker pays. A step takes
// max_i t_i + c; an epoch is the sum of its steps. Workers send each step's compute time (as
// dbs_worker does with its pushes) and report their epoch, and the scheduler's next plan is used;
// the rest of an epoch is re-planned like dbs_ps does (by default with the dbs policy only). The
// result also gives, per epoch, the best split the true (noise-free) curves allow, to judge the
// controller. Pure computation; thread-compatible.
#ifndef DBS_BENCH_SIMULATION_H_
#define DBS_BENCH_SIMULATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/share_policy.h"

namespace dbs {

struct SpeedModel {
  enum class Kind { kLinear, kQuota, kGpu, kCfs };
  Kind kind = Kind::kLinear;
  // linear and quota: samples per second at full speed; gpu: 1 / c in a + c * b^e.
  double speed = 1000.0;
  double overhead_seconds = 0.0;  // fixed per-step time a (any kind; counted as work under a quota)
  double exponent = 1.0;          // gpu: e
  double quota = 1.0;             // quota, cfs: fraction of a core
  double period_seconds = 0.1;    // quota, cfs: scheduling period; its quota = quota * period
  double phase_seconds = 0.0;     // cfs: where the worker's periods start
  double noise = 0.0;             // relative standard deviation of each step's time
  double drift_per_epoch = 0.0;   // the worker gets (1 + drift) times slower every epoch

  // Compute seconds of one step at `batch` in `epoch` (drift included, no noise); 0 for batch 0.
  // For cfs, the sustainable time: the step's work over the quota.
  double StepSeconds(int batch, int epoch) const;
  // The seconds of one full core that a step at `batch` needs (cfs, quota: before throttling).
  double WorkSeconds(int batch, int epoch) const;
  std::string Describe() const;
};

// Worker `worker` is `factor` times slower in epochs [first_epoch, end_epoch).
struct Disturbance {
  int worker = 0;
  int first_epoch = 0;
  int end_epoch = 0;
  double factor = 1.0;
};

// Worker `worker` is `factor` times slower for `seconds` from `start_seconds` of the run: every
// step that starts inside the burst is slowed. Bursts on one worker that overlap multiply.
struct Burst {
  int worker = 0;
  double start_seconds = 0.0;
  double seconds = 0.0;
  double factor = 1.0;
  double end_seconds() const { return start_seconds + seconds; }
};

struct SimulationConfig {
  std::vector<SpeedModel> workers;
  double comm_base_seconds = 0.0;        // c0
  double comm_per_worker_seconds = 0.0;  // c1
  int64_t train_samples = 60000;
  int global_batch = 128;
  int epochs = 5;
  PolicyKind policy = PolicyKind::kDbs;
  std::vector<Disturbance> disturbances;
  std::vector<Burst> bursts;
  bool trace_steps = false;      // keep every step (EpochResult::trace)
  int replan_window_steps = -1;  // mid-epoch re-planning: -1 the policy's default, 0 off
  double replan_threshold = kDefaultReplanThreshold;
  double noise_margin = kDefaultNoiseMargin;  // dbs: see BalancingOptions
  // cfs workers report a step's cost as dbs_worker does under a CPU limit (--cpu_limit=auto):
  // at least its CPU time over the quota. False: its elapsed time alone (--cpu_limit=none).
  bool cpu_limit_aware = true;
  uint64_t seed = 1;  // of the noise

  // Convenience: linear workers of these speeds (samples per second), no noise.
  static SimulationConfig Linear(const std::vector<double>& speeds);
};

// One step as it ran.
struct StepTrace {
  double start_seconds = 0.0;   // of the run
  std::vector<int> batches;     // each worker's
  std::vector<double> seconds;  // each worker's noise-free step time, disturbances and bursts in
};

struct EpochResult {
  double seconds = 0.0;              // wall time, noise and communication included
  std::vector<int> batches;          // each worker's batch (at most steps)
  std::vector<double> step_seconds;  // each worker's noise-free step time at that batch
  double best_step_seconds = 0.0;    // slowest step of the best integer split of B
  int replans = 0;                   // mid-epoch re-plans
  std::vector<StepTrace> trace;      // with SimulationConfig::trace_steps
  // Slowest over fastest step time among workers with a non-zero batch.
  double Spread() const;
  // Slowest step over the best split's slowest step (1: optimal).
  double OverBest() const;
  // Every worker's step within `tolerance` of the slowest, except a worker given at least its
  // batch in the best split (BestSplit): it is as loaded as whole samples allow.
  bool Balanced(const SimulationConfig& config, int epoch, double tolerance) const;
};

struct SimulationResult {
  std::vector<EpochResult> epochs;
  double ideal_epoch_seconds = 0.0;  // steps * best step time at epoch 0: compute only
  double step_comm_seconds = 0.0;
  int steps = 0;
  // Mean epoch time after the first (the first is always the equal split).
  double SteadyEpochSeconds() const;
};

absl::StatusOr<SimulationResult> Simulate(const SimulationConfig& config);

// How a run (simulated with trace_steps) took one of its bursts.
struct BurstOutcome {
  // Steps from the first step that starts inside the burst (after it: the first that starts
  // after its end) to the first step that is rebalanced: its slowest worker's step within
  // `tolerance` of the slowest of the best split for the speeds of that moment. 0: at once; -1:
  // not within the run.
  int steps_from_start = -1;
  int steps_from_end = -1;
  // The capacity the burst removed, in seconds of the whole cluster: its length times the
  // worker's share of the cluster's throughput at the best split (its share of the global
  // batch) times 1 - 1/factor. An ideal controller, re-balancing at once, loses about this.
  double capacity_seconds = 0.0;
};
BurstOutcome AnalyzeBurst(const SimulationConfig& config, const SimulationResult& result,
                          const Burst& burst, double tolerance = 0.10);
// The run's wall time (every epoch's, noise and communication included).
double RunSeconds(const SimulationResult& result);

// The best split of `global_batch` into integer batches for the true per-worker step-time
// functions in `epoch` (disturbances included): the one whose slowest step is fastest.
std::vector<int> BestSplit(const SimulationConfig& config, int epoch);
// The same with each worker's step time multiplied by its entry of `factors` (the bursts of a
// moment; empty: none).
std::vector<int> BestSplit(const SimulationConfig& config, int epoch,
                           const std::vector<double>& factors);
// The slowest step time of that split.
double BestStepSeconds(const SimulationConfig& config, int epoch);
double BestStepSeconds(const SimulationConfig& config, int epoch,
                       const std::vector<double>& factors);
// A random cluster for property tests: 4-64 workers, each linear, quota or GPU-like, with speeds
// at the equal split spread over up to 1:10, noise on half the clusters, drift on a third; the
// global batch is 32 per worker, doubled (up to 4 times) until every worker's best batch is 16 or
// more. Without `allow_drift` the same cluster is drawn, only without drift. `description` gets
// one line about it.
SimulationConfig RandomCluster(uint64_t seed, bool allow_drift, std::string* description);

// A random cluster of cfs workers (as `RandomCluster`, for CPU limits): 4-64 processes on the
// same CPU (a core's speed drawn once per cluster) under CPU limits 1:10 apart, each with a
// per-step overhead and a random phase. Their periods are the kernel's 100 ms default
// (`kernel_default_periods`, as Kubernetes and docker leave them) or the shortest the 1 ms
// minimum quota allows (1 ms / limit, as deploy/hetero.py sets them for the benchmarks).
SimulationConfig RandomCfsCluster(uint64_t seed, bool kernel_default_periods,
                                  std::string* description);

// The true step time of worker `i` at `batch` in `epoch`, disturbances included.
double TrueStepSeconds(const SimulationConfig& config, int i, int batch, int epoch);
// The factor by which the bursts slow worker `i` at `seconds` of the run (1: none).
double BurstFactor(const SimulationConfig& config, int i, double seconds);

}  // namespace dbs

#endif  // DBS_BENCH_SIMULATION_H_
