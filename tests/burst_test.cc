// Bursts on the simulator's random clusters: a worker slowed 2-5x for 5-30 s of the run (an
// unrelated task landing on its machine), on the fastest, the slowest or a middle worker, or
// two overlapping bursts on two workers. What the default controller does after a burst starts
// and after it ends, in steps, and what the burst costs against the capacity it removed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/simulation.h"
#include "gtest/gtest.h"
#include "tests/clusters_to_check.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

enum class Target { kFastest, kSlowest, kMiddle, kOverlapping };

const char* Name(Target t) {
  switch (t) {
    case Target::kFastest:
      return "fastest";
    case Target::kSlowest:
      return "slowest";
    case Target::kMiddle:
      return "middle";
    default:
      return "two overlapping";
  }
}

// Cluster `seed` under `policy` with a burst on `target` that starts mid-epoch once the
// controller has converged (in epoch 4), and enough epochs to run 3 more after it ends; without
// its bursts (`undisturbed`) otherwise the same. Empty when the cluster cannot be simulated.
struct Case {
  SimulationConfig disturbed, undisturbed;
  std::string what;
};
Case MakeCase(uint64_t seed, Target target, PolicyKind policy) {
  Case c;
  SimulationConfig config = RandomCluster(seed, /*allow_drift=*/false, &c.what);
  config.policy = policy;
  config.trace_steps = true;
  std::mt19937_64 rng(seed * 4 + static_cast<int>(target));
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  // Workers by their share of the best split: the fastest carries the most.
  const std::vector<int> best = BestSplit(config, 0);
  std::vector<int> order(best.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return best[a] > best[b]; });
  const int middle = order[order.size() / 2];
  absl::StatusOr<SimulationResult> base = Simulate(config);
  if (!base.ok()) return c;
  const double epoch_seconds = base->epochs.back().seconds;
  double before_epoch_4 = 0.0;
  for (int e = 0; e < 4; ++e) before_epoch_4 += base->epochs[e].seconds;
  auto burst = [&](int worker) {
    return Burst{worker, before_epoch_4 + uniform(0.1, 0.9) * epoch_seconds, uniform(5.0, 30.0),
                 uniform(2.0, 5.0)};
  };
  switch (target) {
    case Target::kFastest:
      config.bursts = {burst(order.front())};
      break;
    case Target::kSlowest:
      config.bursts = {burst(order.back())};
      break;
    case Target::kMiddle:
      config.bursts = {burst(middle)};
      break;
    case Target::kOverlapping: {
      Burst first = burst(order.front()), second = burst(middle);
      // The second starts while the first runs.
      second.start_seconds = first.start_seconds + uniform(0.2, 0.8) * first.seconds;
      config.bursts = {first, second};
      break;
    }
  }
  double end = 0.0;
  for (const Burst& b : config.bursts) end = std::max(end, b.end_seconds());
  config.epochs = std::max(config.epochs, static_cast<int>(std::ceil(end / epoch_seconds)) + 3);
  c.disturbed = config;
  c.undisturbed = config;
  c.undisturbed.bursts.clear();
  return c;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

struct Figures {
  std::vector<double> from_start, from_end, cost_over_capacity;
  int never = 0;  // bursts after which the worker was not rebalanced within the run
};

// Every case of `target` under `policy`.
Figures RunCases(Target target, PolicyKind policy, int clusters) {
  Figures f;
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(clusters); ++seed) {
    const Case c = MakeCase(seed, target, policy);
    if (c.disturbed.bursts.empty()) continue;
    absl::StatusOr<SimulationResult> disturbed = Simulate(c.disturbed);
    absl::StatusOr<SimulationResult> undisturbed = Simulate(c.undisturbed);
    EXPECT_THAT(disturbed, IsOk());
    EXPECT_THAT(undisturbed, IsOk());
    if (!disturbed.ok() || !undisturbed.ok()) continue;
    double capacity = 0.0;
    for (const Burst& b : c.disturbed.bursts) {
      const BurstOutcome o = AnalyzeBurst(c.disturbed, *disturbed, b);
      capacity += o.capacity_seconds;
      if (o.steps_from_start < 0 || o.steps_from_end < 0) {
        ++f.never;
        continue;
      }
      f.from_start.push_back(o.steps_from_start);
      f.from_end.push_back(o.steps_from_end);
    }
    const double cost = RunSeconds(*disturbed) - RunSeconds(*undisturbed);
    if (capacity > 0) f.cost_over_capacity.push_back(cost / capacity);
  }
  return f;
}

// A burst slows the steps that start inside it, and only those; the analysis finds the step
// that is rebalanced and the capacity the burst removed.
TEST(BurstTest, ABurstSlowsItsStepsAndTheReplanRebalancesThem) {
  SimulationConfig c = SimulationConfig::Linear({400, 400, 800, 1600});
  c.global_batch = 256;
  c.train_samples = 256 * 40;
  c.epochs = 8;
  c.trace_steps = true;
  // An epoch of 40 steps takes about 40 * 256 / 3200 = 3.2 s once balanced.
  const Burst burst{3, 12.0, 4.0, 4.0};
  c.bursts = {burst};
  absl::StatusOr<SimulationResult> r = Simulate(c);
  ASSERT_THAT(r, IsOk());
  int inside = 0;
  for (const EpochResult& e : r->epochs) {
    for (const StepTrace& t : e.trace) {
      const double alone = TrueStepSeconds(c, 3, t.batches[3], 0);
      const bool in = t.start_seconds >= 12.0 && t.start_seconds < 16.0;
      inside += in ? 1 : 0;
      EXPECT_DOUBLE_EQ(t.seconds[3], in ? 4.0 * alone : alone) << "at " << t.start_seconds;
    }
  }
  EXPECT_GT(inside, 8);
  const BurstOutcome o = AnalyzeBurst(c, *r, burst);
  // The fastest worker carries half the global batch at the best split.
  EXPECT_NEAR(o.capacity_seconds, 4.0 * 0.5 * 0.75, 0.05);
  // Mid-epoch re-planning notices the burst after a window of steps and balances the step within
  // two; the split comes back within the run once the burst has passed.
  EXPECT_GT(o.steps_from_start, 0);
  EXPECT_LE(o.steps_from_start, 2 * kDbsReplanWindowSteps);
  EXPECT_GE(o.steps_from_end, 0);
  std::printf(
      "4 linear workers, the fastest 4x slower for 4 s: rebalanced %d steps after the "
      "burst starts, %d after it ends\n",
      o.steps_from_start, o.steps_from_end);
}

// A burst strong enough that the controller takes the worker to no sample: nothing measures it
// while it computes nothing, so without probes its curve stays as slow as the burst left it and
// it never comes back. Six workers under CPU quotas (0.1-0.35 of a core, as bench/disturbance.py
// runs them), global batch 96, a 5 s burst from epoch 3 on the fastest or the slowest worker,
// 10x and 30x: the worker is out of the split while the burst lasts, is probed with one sample
// at intervals that grow while it stays slow, and is back at half the batch it ran before or
// more within half as many steps as it was out.
TEST(BurstTest, AWorkerABurstTookToNoSampleIsProbedAndComesBack) {
  SimulationConfig c;
  for (double quota : {0.1, 0.1, 0.15, 0.15, 0.25, 0.35}) {
    SpeedModel m;
    m.kind = SpeedModel::Kind::kQuota;
    m.speed = 6000;  // a full core; 0.35 of one runs the default batch's share in ~15 ms
    m.quota = quota;
    m.overhead_seconds = 0.001;
    m.noise = 0.05;
    c.workers.push_back(m);
  }
  c.global_batch = 96;
  c.train_samples = 15000;
  c.epochs = 12;
  c.trace_steps = true;
  absl::StatusOr<SimulationResult> base = Simulate(c);
  ASSERT_THAT(base, IsOk());
  double start = 0.0;
  for (int e = 0; e < 3; ++e) start += base->epochs[e].seconds;
  for (int worker : {0, 5}) {
    for (double factor : {10.0, 30.0}) {
      SimulationConfig d = c;
      const Burst burst{worker, start + 0.3, 5.0, factor};
      d.bursts = {burst};
      absl::StatusOr<SimulationResult> r = Simulate(d);
      ASSERT_THAT(r, IsOk());
      const std::string what = absl::StrCat("worker ", worker, ", ", factor, "x");
      const int before = base->epochs[2].batches[worker];
      int idle_inside = 0, after = 0, back = -1;
      for (const EpochResult& e : r->epochs) {
        for (const StepTrace& t : e.trace) {
          const int b = t.batches[worker];
          if (t.start_seconds >= burst.start_seconds && t.start_seconds < burst.end_seconds()) {
            idle_inside += b == 0 ? 1 : 0;
          } else if (t.start_seconds >= burst.end_seconds()) {
            if (back < 0 && 2 * b >= before) back = after;
            ++after;
          }
        }
      }
      EXPECT_GT(idle_inside, 0) << what << ": the burst took the worker out of the split";
      EXPECT_GE(back, 0) << what << ": never back";
      // Probes back off to a third of the time out, and each costs at most a tenth of the idle
      // time before it: the worker is back within half the steps it was out.
      EXPECT_LE(back, idle_inside / 2) << what;
      const BurstOutcome o = AnalyzeBurst(d, *r, burst);
      std::printf(
          "6 quota workers, %s for 5 s: %d steps out of the split inside the burst, back at "
          "half its batch or more %d steps after it ends; cost %.2f s for %.2f s of capacity "
          "removed\n",
          what.c_str(), idle_inside, back, RunSeconds(*r) - RunSeconds(*base), o.capacity_seconds);
    }
  }
}

// The figures of the disturbance suite (docs/controller.md#bursts): every burst is rebalanced
// within the run, after it starts and after it ends; a single burst within two re-plan windows
// at the median; and where it hits the slowest worker it costs DBS less than it costs the fixed
// split, whose pace that worker sets.
TEST(BurstTest, RandomClustersRebalanceAfterEveryBurst) {
  // BURST_TEST_CLUSTERS=N checks the first N seeds instead of 50.
  const int clusters = ClustersToCheck("BURST_TEST_CLUSTERS", 50, 5);
  for (Target target :
       {Target::kFastest, Target::kSlowest, Target::kMiddle, Target::kOverlapping}) {
    const Figures dbs = RunCases(target, PolicyKind::kDbs, clusters);
    const Figures fixed = RunCases(target, PolicyKind::kFixed, clusters);
    std::printf(
        "burst on the %s worker, %d clusters: steps to rebalance after it starts median %.0f, "
        "90%% %.0f, max %.0f; after it ends median %.0f, 90%% %.0f, max %.0f; cost / capacity "
        "removed: dbs median %.2f, 90%% %.2f; the fixed split median %.2f\n",
        Name(target), clusters, Quantile(dbs.from_start, 0.5), Quantile(dbs.from_start, 0.9),
        Quantile(dbs.from_start, 1.0), Quantile(dbs.from_end, 0.5), Quantile(dbs.from_end, 0.9),
        Quantile(dbs.from_end, 1.0), Quantile(dbs.cost_over_capacity, 0.5),
        Quantile(dbs.cost_over_capacity, 0.9), Quantile(fixed.cost_over_capacity, 0.5));
    EXPECT_EQ(dbs.never, 0) << Name(target);
    if (target != Target::kOverlapping) {
      EXPECT_LE(Quantile(dbs.from_start, 0.5), 2 * kDbsReplanWindowSteps) << Name(target);
    }
    if (target == Target::kSlowest) {
      EXPECT_LT(Quantile(dbs.cost_over_capacity, 0.5), Quantile(fixed.cost_over_capacity, 0.5));
    }
  }
}

}  // namespace
}  // namespace dbs
