#include "bench/simulation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "server/job_config.h"
#include "server/replan_window.h"
#include "server/scheduler.h"

namespace dbs {

double SpeedModel::WorkSeconds(int batch, int epoch) const {
  if (batch <= 0) return 0.0;
  const double b = batch;
  double t = 0.0;
  switch (kind) {
    case Kind::kLinear:
    case Kind::kQuota:
    case Kind::kCfs:
      t = overhead_seconds + b / speed;
      break;
    case Kind::kGpu:
      t = overhead_seconds + std::pow(b, exponent) / speed;
      break;
  }
  return t * std::pow(1.0 + drift_per_epoch, epoch);
}

double SpeedModel::StepSeconds(int batch, int epoch) const {
  const double work = WorkSeconds(batch, epoch);
  switch (kind) {
    case Kind::kQuota: {
      const double budget = quota * period_seconds * std::pow(1.0 + drift_per_epoch, epoch);
      return work <= budget ? work : budget + (work - budget) / quota;
    }
    case Kind::kCfs:
      return work / quota;
    default:
      return work;
  }
}

std::string SpeedModel::Describe() const {
  switch (kind) {
    case Kind::kLinear:
      return absl::StrFormat("linear(v=%.0f, a=%.2gms)", speed, 1e3 * overhead_seconds);
    case Kind::kGpu:
      return absl::StrFormat("gpu(a=%.2gms, c=1/%.0f, e=%.2f)", 1e3 * overhead_seconds, speed,
                             exponent);
    case Kind::kQuota:
      return absl::StrFormat("quota(v=%.0f, %.3g core, period %.3gms)", speed, quota,
                             1e3 * period_seconds);
    case Kind::kCfs:
      return absl::StrFormat("cfs(v=%.0f, a=%.2gms, %.3g core, period %.3gms)", speed,
                             1e3 * overhead_seconds, quota, 1e3 * period_seconds);
  }
  return "?";
}

SimulationConfig SimulationConfig::Linear(const std::vector<double>& speeds) {
  SimulationConfig c;
  for (double v : speeds) {
    SpeedModel m;
    m.speed = v;
    c.workers.push_back(m);
  }
  return c;
}

namespace {

double DisturbanceFactor(const SimulationConfig& config, int i, int epoch) {
  double f = 1.0;
  for (const Disturbance& d : config.disturbances) {
    if (d.worker == i && epoch >= d.first_epoch && epoch < d.end_epoch) f *= d.factor;
  }
  return f;
}

}  // namespace

double TrueStepSeconds(const SimulationConfig& config, int i, int batch, int epoch) {
  return config.workers[i].StepSeconds(batch, epoch) * DisturbanceFactor(config, i, epoch);
}

double BurstFactor(const SimulationConfig& config, int i, double seconds) {
  double f = 1.0;
  for (const Burst& b : config.bursts) {
    if (b.worker == i && seconds >= b.start_seconds && seconds < b.end_seconds()) f *= b.factor;
  }
  return f;
}

std::vector<int> BestSplit(const SimulationConfig& config, int epoch) {
  return BestSplit(config, epoch, {});
}

std::vector<int> BestSplit(const SimulationConfig& config, int epoch,
                           const std::vector<double>& factors) {
  const int n = static_cast<int>(config.workers.size());
  const int B = config.global_batch;
  // Worker i's step at `batch`, slowed by its factor.
  auto step_seconds = [&](int i, int batch) {
    return TrueStepSeconds(config, i, batch, epoch) * (factors.empty() ? 1.0 : factors[i]);
  };
  // The largest batch of worker i whose step fits in tau.
  auto cap = [&](int i, double tau) {
    int lo = 0, hi = B;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (step_seconds(i, mid) <= tau) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  };
  auto fits = [&](double tau) {
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += cap(i, tau);
    return total >= B;
  };
  double hi = 0.0;
  for (int i = 0; i < n; ++i) hi = std::max(hi, step_seconds(i, B));
  double lo = 0.0;
  for (int k = 0; k < 100; ++k) {
    const double mid = 0.5 * (lo + hi);
    if (fits(mid)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  std::vector<int> split(n);
  int total = 0;
  for (int i = 0; i < n; ++i) total += split[i] = cap(i, hi);
  // Give back the surplus from the workers with the slowest steps.
  while (total > B) {
    int k = -1;
    for (int i = 0; i < n; ++i) {
      if (split[i] > 0 && (k < 0 || step_seconds(i, split[i]) > step_seconds(k, split[k]))) {
        k = i;
      }
    }
    --split[k];
    --total;
  }
  return split;
}

double BestStepSeconds(const SimulationConfig& config, int epoch) {
  return BestStepSeconds(config, epoch, {});
}

double BestStepSeconds(const SimulationConfig& config, int epoch,
                       const std::vector<double>& factors) {
  const std::vector<int> split = BestSplit(config, epoch, factors);
  double slowest = 0.0;
  for (size_t i = 0; i < split.size(); ++i) {
    slowest = std::max(slowest, TrueStepSeconds(config, static_cast<int>(i), split[i], epoch) *
                                    (factors.empty() ? 1.0 : factors[i]));
  }
  return slowest;
}

namespace {

// Whether every worker's batch in the best split of epoch 0 is `min` or more.
bool BestBatchesAtLeast(const SimulationConfig& c, int min) {
  const std::vector<int> best = BestSplit(c, 0);
  return *std::min_element(best.begin(), best.end()) >= min;
}

// The run every random cluster gets: 40 steps per epoch, 12 epochs, noise seeded by `seed`.
void SetRandomClusterRun(uint64_t seed, SimulationConfig* c) {
  c->train_samples = static_cast<int64_t>(c->global_batch) * 40;
  c->epochs = 12;
  c->seed = seed;
}

}  // namespace

SimulationConfig RandomCluster(uint64_t seed, bool allow_drift, std::string* description) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  const int n = rng() % 2 == 0 ? 4 + static_cast<int>(rng() % 13)   // 4-16
                               : 4 + static_cast<int>(rng() % 61);  // 4-64
  const double noise = rng() % 2 == 0 ? uniform(0.01, 0.05) : 0.0;
  const bool drift = rng() % 3 == 0 && allow_drift;
  // Each worker's shape, relative to the equal split's batch: its speed there (up to 10x apart),
  // its kind, and the kind's parameters.
  struct Shape {
    int kind;
    double slowness, overhead, quota, knee, exponent, drift;
  };
  std::vector<Shape> shapes(n);
  for (Shape& s : shapes) {
    s.slowness = std::exp(uniform(0.0, std::log(10.0)));
    s.kind = static_cast<int>(rng() % 3);
    s.overhead = s.kind == 2 ? uniform(0.1, 0.8) : uniform(0.0, 0.5);
    s.quota = uniform(0.1, 0.5);
    s.knee = uniform(0.3, 2.0);
    s.exponent = uniform(0.5, 0.9);
    s.drift = uniform(-0.01, 0.01);  // drawn always, so clusters differ only by the drift
    if (!drift) s.drift = 0.0;
  }
  SimulationConfig c;
  // The global batch: 32 per worker, doubled (at most 4 times) until every worker's best batch is
  // 8 or more; the curves are laid out around the equal split of each candidate.
  for (int b = 32, k = 0; k < 5; ++k, b *= 2) {
    const double nominal = b;
    c.workers.clear();
    for (const Shape& s : shapes) {
      const double v = 1000.0 / s.slowness;  // samples per second at the nominal batch
      // Per-step overheads (launches, copies) are about the same on every device: a fraction of
      // the fastest possible step.
      const double t_fastest = nominal / 1000.0;
      SpeedModel m;
      m.noise = noise;
      m.drift_per_epoch = s.drift;
      switch (s.kind) {
        case 0:
          m.kind = SpeedModel::Kind::kLinear;
          m.overhead_seconds = s.overhead * t_fastest;
          m.speed = nominal / (nominal / v - m.overhead_seconds);
          break;
        case 1: {
          // Full speed up to knee * nominal samples per step, 1 / quota times slower beyond.
          m.kind = SpeedModel::Kind::kQuota;
          m.quota = s.quota;
          const double throttled = std::max(0.0, 1.0 - s.knee);
          m.speed = v * (std::min(1.0, s.knee) + throttled / s.quota);
          m.period_seconds = nominal * s.knee / m.speed / s.quota;
          break;
        }
        default: {
          m.kind = SpeedModel::Kind::kGpu;
          m.exponent = s.exponent;
          m.overhead_seconds = s.overhead * t_fastest;
          m.speed = std::pow(nominal, m.exponent) / (nominal / v - m.overhead_seconds);
          break;
        }
      }
      c.workers.push_back(m);
    }
    c.global_batch = b * n;
    if (BestBatchesAtLeast(c, 16)) break;
  }
  SetRandomClusterRun(seed, &c);
  if (description != nullptr) {
    *description = absl::StrCat(n, " workers, B=", c.global_batch, ", noise ", noise,
                                drift ? ", drifting" : "");
  }
  return c;
}

SimulationConfig RandomCfsCluster(uint64_t seed, bool kernel_default_periods,
                                  std::string* description) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  const int n = rng() % 2 == 0 ? 4 + static_cast<int>(rng() % 13)   // 4-16
                               : 4 + static_cast<int>(rng() % 61);  // 4-64
  const double noise = rng() % 2 == 0 ? uniform(0.01, 0.05) : 0.0;
  const double core_speed = uniform(1000.0, 6000.0);  // samples per second of one full core
  const double top = uniform(0.3, 1.0);               // the largest limit, in cores
  std::vector<SpeedModel> workers(n);
  for (SpeedModel& m : workers) {
    m.kind = SpeedModel::Kind::kCfs;
    m.speed = core_speed;
    m.quota = top / std::exp(uniform(0.0, std::log(10.0)));
    m.period_seconds = kernel_default_periods ? 0.1 : std::max(0.001, 0.001 / m.quota);
    m.phase_seconds = uniform(0.0, m.period_seconds);
    m.noise = noise;
    m.overhead_seconds = uniform(0.0, 0.3) * 32.0 / core_speed;  // CPU of a step's own work
  }
  SimulationConfig c;
  c.workers = workers;
  for (int b = 32, k = 0; k < 5; ++k, b *= 2) {
    c.global_batch = b * n;
    if (BestBatchesAtLeast(c, 16)) break;
  }
  SetRandomClusterRun(seed, &c);
  if (description != nullptr) {
    *description =
        absl::StrCat(n, " workers under CPU limits, B=", c.global_batch, ", periods ",
                     kernel_default_periods ? "100 ms" : "1 ms / limit", ", noise ", noise);
  }
  return c;
}

double EpochResult::Spread() const {
  double lo = 0.0, hi = 0.0;
  for (size_t i = 0; i < batches.size(); ++i) {
    if (batches[i] <= 0) continue;
    lo = lo == 0.0 ? step_seconds[i] : std::min(lo, step_seconds[i]);
    hi = std::max(hi, step_seconds[i]);
  }
  return lo > 0 ? hi / lo : 1.0;
}

double EpochResult::OverBest() const {
  double slowest = 0.0;
  for (double t : step_seconds) slowest = std::max(slowest, t);
  return best_step_seconds > 0 ? slowest / best_step_seconds : 1.0;
}

bool EpochResult::Balanced(const SimulationConfig& config, int epoch, double tolerance) const {
  double slowest = 0.0;
  for (double t : step_seconds) slowest = std::max(slowest, t);
  const std::vector<int> best = BestSplit(config, epoch);
  for (size_t i = 0; i < batches.size(); ++i) {
    if (step_seconds[i] * (1.0 + tolerance) >= slowest) continue;
    // Faster than the slowest by more than the tolerance, yet as loaded as the best split of
    // whole samples would have it: the granularity of the others' batches, not idleness.
    if (batches[i] >= best[i]) continue;
    return false;
  }
  return true;
}

double SimulationResult::SteadyEpochSeconds() const {
  if (epochs.size() < 2) return epochs.empty() ? 0.0 : epochs[0].seconds;
  double sum = 0.0;
  for (size_t e = 1; e < epochs.size(); ++e) sum += epochs[e].seconds;
  return sum / static_cast<double>(epochs.size() - 1);
}

namespace {

absl::Status ValidateSimulation(const SimulationConfig& config) {
  const int n = static_cast<int>(config.workers.size());
  if (n == 0) return absl::InvalidArgumentError("no workers");
  for (const SpeedModel& m : config.workers) {
    if (!(m.speed > 0) || !(m.quota > 0 && m.quota <= 1) || !(m.exponent > 0) ||
        !(m.period_seconds > 0) || m.noise < 0 || m.overhead_seconds < 0 ||
        !std::isfinite(m.phase_seconds)) {
      return absl::InvalidArgumentError(absl::StrCat("bad speed model ", m.Describe()));
    }
  }
  for (const Disturbance& d : config.disturbances) {
    if (d.worker < 0 || d.worker >= n || !(d.factor > 0)) {
      return absl::InvalidArgumentError("bad disturbance");
    }
  }
  for (const Burst& b : config.bursts) {
    if (b.worker < 0 || b.worker >= n || !(b.factor > 0) || !(b.seconds >= 0) ||
        !std::isfinite(b.start_seconds) || !std::isfinite(b.seconds)) {
      return absl::InvalidArgumentError("bad burst");
    }
  }
  return absl::OkStatus();
}

// Every worker's plan for `epoch` as a table of batches: quota[step][worker].
absl::StatusOr<std::vector<std::vector<int>>> PlannedBatches(Scheduler& scheduler, int n,
                                                             int epoch) {
  std::vector<std::vector<int>> quota;
  for (int i = 0; i < n; ++i) {
    std::optional<absl::StatusOr<WorkerPlan>> got;
    scheduler.AwaitPlan(i, epoch, [&got](const absl::StatusOr<WorkerPlan>& p) { got = p; });
    if (!got.has_value()) return absl::InternalError("plan not ready");
    DBS_RETURN_IF_ERROR(got->status());
    const WorkerPlan& plan = **got;
    quota.resize(plan.num_steps, std::vector<int>(n));
    for (int s = 0; s < plan.num_steps; ++s) quota[s][i] = plan.BatchAt(s);
  }
  return quota;
}

// The batch each worker trained on most often in an epoch.
std::vector<int> ModeBatches(const std::vector<std::map<int, int>>& batch_count) {
  std::vector<int> out;
  for (const auto& counts : batch_count) {
    int mode = 0, best = -1;
    for (const auto& [b, count] : counts) {
      if (count > best) {
        mode = b;
        best = count;
      }
    }
    out.push_back(mode);
  }
  return out;
}

// Where a cfs worker stands in its CFS period: which period, and how much of its quota the
// steps so far have used in it.
struct CfsState {
  int64_t period = std::numeric_limits<int64_t>::min();
  double used = 0.0;
};

// Runs `work` seconds of CPU under the worker's CFS quota from time `start`: each period allows
// quota * period seconds of running, then the worker waits for the next period. Returns the
// elapsed time.
double RunUnderQuota(const SpeedModel& m, CfsState* s, double start, double work) {
  if (!(work > 0)) return 0.0;
  const double period = m.period_seconds, budget = m.quota * m.period_seconds;
  int64_t k = static_cast<int64_t>(std::floor((start - m.phase_seconds) / period));
  double pos = std::clamp(start - m.phase_seconds - static_cast<double>(k) * period, 0.0, period);
  double left = work;
  for (;;) {
    if (k != s->period) {
      s->period = k;
      s->used = 0.0;
    }
    const double run = std::max(0.0, std::min({left, budget - s->used, period - pos}));
    left -= run;
    s->used += run;
    pos += run;
    if (left <= 1e-12) break;
    ++k;  // the quota or the period ran out: the next period
    pos = 0.0;
  }
  return std::max(0.0, m.phase_seconds + static_cast<double>(k) * period + pos - start);
}

// One simulated epoch: its steps (with mid-epoch re-planning), then every worker's report.
class EpochSimulation {
 public:
  // `rng` and `normal` carry on from epoch to epoch.
  // `cfs` (one per worker) carries on too; the epoch starts at `start` seconds.
  EpochSimulation(const SimulationConfig& config, Scheduler& scheduler, std::mt19937_64& rng,
                  std::normal_distribution<double>& normal, double comm_seconds,
                  std::vector<CfsState>* cfs, double start)
      : config_(config),
        scheduler_(scheduler),
        rng_(rng),
        normal_(normal),
        comm_seconds_(comm_seconds),
        cfs_(*cfs),
        start_(start),
        n_(static_cast<int>(config.workers.size())),
        compute_(n_, 0.0),
        samples_(n_, 0),
        batch_count_(n_) {}

  absl::StatusOr<EpochResult> Run(int epoch, std::vector<std::vector<int>> quota) {
    ReplanWindow window(ReplanWindowSteps(config_.policy, config_.replan_window_steps),
                        config_.replan_threshold,
                        config_.policy == PolicyKind::kDbs ? config_.noise_margin : 0.0);
    const int steps = static_cast<int>(quota.size());
    for (int s = 0; s < steps; ++s) {
      const std::map<int, std::pair<int64_t, double>> times = Step(epoch, quota[s]);
      scheduler_.RecordStep(epoch, times);
      if (s + 1 == steps) continue;
      std::optional<ReplanTrigger> trigger = window.Add(epoch, times);
      if (!trigger.has_value()) continue;
      absl::StatusOr<PlanChange> replan = scheduler_.Rebalance(epoch, s + 1, trigger->window);
      if (!replan.ok()) continue;
      ++result_.replans;
      for (size_t k = 0; k < replan->later_quotas.size(); ++k) {
        for (const auto& [id, b] : replan->later_quotas[k]) quota[s + 1 + k][id] = b;
      }
    }
    result_.batches = ModeBatches(batch_count_);
    for (int i = 0; i < n_; ++i) {
      result_.step_seconds.push_back(TrueStepSeconds(config_, i, result_.batches[i], epoch));
    }
    result_.best_step_seconds = BestStepSeconds(config_, epoch);
    return result_;
  }

  // Reports the epoch to the scheduler (after the clock has moved past it).
  absl::Status Report(int epoch) {
    for (int i = 0; i < n_; ++i) {
      EpochTiming t;
      t.worker_id = i;
      t.epoch = epoch;
      t.samples = samples_[i];
      t.compute_seconds = compute_[i];
      DBS_RETURN_IF_ERROR(scheduler_.Report(t));
    }
    return absl::OkStatus();
  }

 private:
  // Every worker's noisy compute time at one step; the step lasts as long as the slowest.
  std::map<int, std::pair<int64_t, double>> Step(int epoch, const std::vector<int>& batches) {
    double slowest = 0.0;
    std::map<int, std::pair<int64_t, double>> times;
    const double now = start_ + result_.seconds;
    StepTrace trace;
    if (config_.trace_steps) trace.start_seconds = now;
    for (int i = 0; i < n_; ++i) {
      const int b = batches[i];
      const SpeedModel& m = config_.workers[i];
      const bool cfs = m.kind == SpeedModel::Kind::kCfs;
      const double burst = BurstFactor(config_, i, now);
      double t = cfs ? m.WorkSeconds(b, epoch) * DisturbanceFactor(config_, i, epoch) * burst
                     : TrueStepSeconds(config_, i, b, epoch) * burst;
      if (config_.trace_steps) {
        trace.batches.push_back(b);
        trace.seconds.push_back(TrueStepSeconds(config_, i, b, epoch) * burst);
      }
      const double sigma = m.noise;
      if (sigma > 0 && t > 0) t *= std::exp(sigma * normal_(rng_) - 0.5 * sigma * sigma);
      double reported = t;
      if (cfs) {
        const double work = t;
        t = RunUnderQuota(m, &cfs_[i], start_ + result_.seconds, work);
        reported = config_.cpu_limit_aware ? std::max(t, work / m.quota) : t;
      }
      compute_[i] += t;
      samples_[i] += b;
      ++batch_count_[i][b];
      slowest = std::max(slowest, t);
      times[i] = {b, reported};
    }
    result_.seconds += slowest + comm_seconds_;
    if (config_.trace_steps) result_.trace.push_back(std::move(trace));
    return times;
  }

  const SimulationConfig& config_;
  Scheduler& scheduler_;
  std::mt19937_64& rng_;
  std::normal_distribution<double>& normal_;
  const double comm_seconds_;
  std::vector<CfsState>& cfs_;
  const double start_;
  const int n_;
  std::vector<double> compute_;
  std::vector<int64_t> samples_;
  std::vector<std::map<int, int>> batch_count_;
  EpochResult result_;
};

}  // namespace

absl::StatusOr<SimulationResult> Simulate(const SimulationConfig& config) {
  DBS_RETURN_IF_ERROR(ValidateSimulation(config));
  const int n = static_cast<int>(config.workers.size());
  JobConfig job;
  job.scheduler.expected_workers = n;
  job.scheduler.epochs = config.epochs;
  job.scheduler.global_batch = config.global_batch;
  job.policy = config.policy;
  job.noise_margin = config.noise_margin;
  DBS_RETURN_IF_ERROR(ValidateJobConfig(job));
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharePolicy> policy, MakeSharePolicy(PolicyConfigOf(job)));
  FakeClock clock;
  Scheduler scheduler(job.scheduler, std::move(policy), &clock, nullptr);
  for (int i = 0; i < n; ++i) {
    DBS_RETURN_IF_ERROR(
        scheduler.Register({absl::StrCat("sim-", i), config.train_samples, 0, "sim"}).status());
  }
  std::mt19937_64 rng(config.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  SimulationResult result;
  result.step_comm_seconds = config.comm_base_seconds + config.comm_per_worker_seconds * n;
  std::vector<CfsState> cfs(n);
  double now = 0.0;
  for (int epoch = 0; epoch < config.epochs; ++epoch) {
    DBS_ASSIGN_OR_RETURN(std::vector<std::vector<int>> quota, PlannedBatches(scheduler, n, epoch));
    result.steps = static_cast<int>(quota.size());
    EpochSimulation sim(config, scheduler, rng, normal, result.step_comm_seconds, &cfs, now);
    DBS_ASSIGN_OR_RETURN(EpochResult er, sim.Run(epoch, std::move(quota)));
    if (epoch == 0) result.ideal_epoch_seconds = result.steps * er.best_step_seconds;
    clock.Advance(absl::Seconds(er.seconds));
    now += er.seconds;
    result.epochs.push_back(er);
    DBS_RETURN_IF_ERROR(sim.Report(epoch));
  }
  return result;
}

double RunSeconds(const SimulationResult& result) {
  double seconds = 0.0;
  for (const EpochResult& e : result.epochs) seconds += e.seconds;
  return seconds;
}

namespace {

// Steps from the first that starts at or after `from` until the step is rebalanced (see
// BurstOutcome); -1 when it never is within the run.
int StepsToRebalance(const SimulationConfig& config, const SimulationResult& result, double from,
                     double tolerance) {
  const int n = static_cast<int>(config.workers.size());
  // The best split's slowest step, by epoch and the bursts' factors.
  std::map<std::pair<int, std::vector<double>>, double> best;
  int steps = -1;
  for (size_t e = 0; e < result.epochs.size(); ++e) {
    const int epoch = static_cast<int>(e);
    for (const StepTrace& t : result.epochs[e].trace) {
      if (t.start_seconds < from) continue;
      ++steps;
      std::vector<double> factors(n);
      for (int j = 0; j < n; ++j) factors[j] = BurstFactor(config, j, t.start_seconds);
      auto it = best.find({epoch, factors});
      if (it == best.end()) {
        it = best.emplace(std::make_pair(epoch, factors), BestStepSeconds(config, epoch, factors))
                 .first;
      }
      const double slowest = *std::max_element(t.seconds.begin(), t.seconds.end());
      if (slowest <= (1.0 + tolerance) * it->second) return steps;
    }
  }
  return -1;
}

}  // namespace

BurstOutcome AnalyzeBurst(const SimulationConfig& config, const SimulationResult& result,
                          const Burst& burst, double tolerance) {
  BurstOutcome out;
  out.steps_from_start = StepsToRebalance(config, result, burst.start_seconds, tolerance);
  out.steps_from_end = StepsToRebalance(config, result, burst.end_seconds(), tolerance);
  // The worker's share of the throughput where every step takes the same time: its share of the
  // best split's batch, in the epoch the burst starts in.
  int epoch = 0;
  for (double t = 0.0; epoch + 1 < static_cast<int>(result.epochs.size()); ++epoch) {
    t += result.epochs[epoch].seconds;
    if (t > burst.start_seconds) break;
  }
  const std::vector<int> split = BestSplit(config, epoch);
  const double share = static_cast<double>(split[burst.worker]) / config.global_batch;
  out.capacity_seconds = burst.seconds * share * (1.0 - 1.0 / burst.factor);
  return out;
}

}  // namespace dbs
