// The simulator, and the default controller's promise proven on it: on hundreds of random
// clusters (4-64 workers, speed ratios up to 1:10, linear, CPU-quota and GPU-like step-time
// curves, noise, drift) the dbs policy balances every worker's step time within 10% by epoch 3,
// stays there, and is within 10% of the best split the true curves allow.
#include "bench/simulation.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/clusters_to_check.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

SimulationConfig Config(double c0, double c1) {
  SimulationConfig c = SimulationConfig::Linear({100, 100, 200, 400});
  c.comm_base_seconds = c0;
  c.comm_per_worker_seconds = c1;
  c.train_samples = 12800;
  c.global_batch = 128;
  c.epochs = 3;
  return c;
}

TEST(SimulationTest, WithoutCommunicationDbsReachesTheIdealAndSsgdWaitsForTheSlowest) {
  SimulationConfig c = Config(0, 0);
  c.policy = PolicyKind::kFixed;
  auto sgd = Simulate(c);
  ASSERT_THAT(sgd, IsOk()) << sgd.status();
  // 100 steps of 32 samples at the slowest 100/s: 32 s; ideal 12800 / 800 = 16 s.
  EXPECT_NEAR(sgd->SteadyEpochSeconds(), 32.0, 1e-9);
  EXPECT_NEAR(sgd->ideal_epoch_seconds, 16.0, 1e-9);
  // The paper's rule: epoch 0 is the equal split, epoch 1 proportional to the measured speeds.
  c.policy = PolicyKind::kProportional;
  auto paper = Simulate(c);
  ASSERT_THAT(paper, IsOk());
  EXPECT_NEAR(paper->epochs[0].seconds, 32.0, 1e-9) << "epoch 0 is the equal split";
  EXPECT_EQ(paper->epochs[1].batches, (std::vector<int>{16, 16, 32, 64}));
  EXPECT_NEAR(paper->SteadyEpochSeconds(), 16.0, 1e-9);
  // dbs re-plans epoch 0 after its first 8 steps, and has the ideal split from then on.
  c.policy = PolicyKind::kDbs;
  auto dbs_run = Simulate(c);
  ASSERT_THAT(dbs_run, IsOk());
  EXPECT_EQ(dbs_run->epochs[0].replans, 1);
  EXPECT_NEAR(dbs_run->epochs[0].seconds, 8 * 0.32 + 92 * 0.16, 1e-9);
  EXPECT_EQ(dbs_run->epochs[1].batches, (std::vector<int>{16, 16, 32, 64}));
  EXPECT_EQ(dbs_run->epochs[1].replans, 0);
  EXPECT_NEAR(dbs_run->SteadyEpochSeconds(), 16.0, 1e-9);
}

TEST(SimulationTest, CommunicationShrinksTheGain) {
  double previous_ratio = 0.0;
  for (double c1 : {0.0, 0.01, 0.05, 0.2}) {
    SimulationConfig c = Config(0.0, c1);
    c.policy = PolicyKind::kFixed;
    const double sgd = Simulate(c)->SteadyEpochSeconds();
    c.policy = PolicyKind::kDbs;
    const double dbs_time = Simulate(c)->SteadyEpochSeconds();
    const double ratio = dbs_time / sgd;
    EXPECT_GT(ratio, previous_ratio) << "c1 = " << c1;
    EXPECT_LE(ratio, 1.0 + 1e-9);
    previous_ratio = ratio;
  }
}

TEST(SimulationTest, RejectsBadInput) {
  SimulationConfig c = Config(0, 0);
  c.workers = {};
  EXPECT_FALSE(Simulate(c).ok());
  c = SimulationConfig::Linear({1.0, 0.0});
  EXPECT_FALSE(Simulate(c).ok());
  c = SimulationConfig::Linear({1.0, 1.0});
  c.workers[0].kind = SpeedModel::Kind::kQuota;
  c.workers[0].quota = 1.5;
  EXPECT_FALSE(Simulate(c).ok());
}

TEST(SpeedModelTest, CurvesHaveTheirShapes) {
  SpeedModel quota;
  quota.kind = SpeedModel::Kind::kQuota;
  quota.speed = 1000;  // 1 ms per sample on a full core
  quota.quota = 0.25;
  quota.period_seconds = 0.040;  // 10 ms of quota per period: 10 samples at full speed
  EXPECT_NEAR(quota.StepSeconds(8, 0), 0.008, 1e-12);
  EXPECT_NEAR(quota.StepSeconds(10, 0), 0.010, 1e-12);
  EXPECT_NEAR(quota.StepSeconds(14, 0), 0.010 + 0.004 * 4, 1e-12) << "throttled to 1/4 beyond";
  SpeedModel gpu;
  gpu.kind = SpeedModel::Kind::kGpu;
  gpu.overhead_seconds = 0.005;
  gpu.speed = 100;
  gpu.exponent = 0.5;
  EXPECT_NEAR(gpu.StepSeconds(16, 0), 0.005 + 0.04, 1e-12);
  EXPECT_NEAR(gpu.StepSeconds(64, 0), 0.005 + 0.08, 1e-12) << "4x the batch, 2x the time";
  SpeedModel drifting;
  drifting.drift_per_epoch = 0.1;
  EXPECT_NEAR(drifting.StepSeconds(100, 2), 0.1 * 1.21, 1e-12);
  EXPECT_EQ(drifting.StepSeconds(0, 0), 0.0);
}

TEST(BestSplitTest, IsTheMinMaxIntegerSplit) {
  SimulationConfig c = SimulationConfig::Linear({100, 300});
  c.global_batch = 8;
  EXPECT_EQ(BestSplit(c, 0), (std::vector<int>{2, 6}));
  EXPECT_NEAR(BestStepSeconds(c, 0), 0.02, 1e-12);
  c.disturbances = {{1, 1, 2, 3.0}};  // worker 1 as slow as worker 0 in epoch 1
  EXPECT_EQ(BestSplit(c, 1), (std::vector<int>{4, 4}));
}

// The oscillating cluster as quota models: two 1/8-core workers, one 1/4 and one 1/2
// with the same quota per scheduling period (as deploy/hetero.py sets them), on a CPU fast enough
// that 20 samples fit a period's quota and run at full speed while more are throttled 2- to
// 8-fold. The paper's rule gives the 1/8-core workers a small batch, sees them fast, gives them a
// big one, sees them slow, and so on.
SimulationConfig OscillatingQuotaCluster() {
  SimulationConfig c;
  for (double fraction : {0.125, 0.125, 0.25, 0.5}) {
    SpeedModel m;
    m.kind = SpeedModel::Kind::kQuota;
    m.speed = 2000;
    m.quota = fraction;
    m.period_seconds = 0.010 / fraction;
    m.noise = 0.03;
    c.workers.push_back(m);
  }
  c.global_batch = 128;
  c.train_samples = 12000;
  c.epochs = 10;
  return c;
}

TEST(ControllerRegressionTest, TheQuotaClusterThatMadeTheProportionalRuleOscillate) {
  SimulationConfig c = OscillatingQuotaCluster();
  c.policy = PolicyKind::kProportional;
  auto paper = Simulate(c);
  ASSERT_THAT(paper, IsOk());
  c.policy = PolicyKind::kDbs;
  auto dbs_run = Simulate(c);
  ASSERT_THAT(dbs_run, IsOk());
  c.policy = PolicyKind::kFixed;
  auto fixed = Simulate(c);
  ASSERT_THAT(fixed, IsOk());
  int paper_unbalanced = 0;
  for (int e = 0; e < c.epochs; ++e) {
    const EpochResult& p = paper->epochs[e];
    const EpochResult& d = dbs_run->epochs[e];
    std::printf("epoch %d  proportional [%s] spread %.2f | dbs [%s] spread %.2f, %.3fx best\n", e,
                absl::StrJoin(p.batches, " ").c_str(), p.Spread(),
                absl::StrJoin(d.batches, " ").c_str(), d.Spread(), d.OverBest());
    if (e >= 2) {
      paper_unbalanced += p.Spread() > 1.3 ? 1 : 0;
      EXPECT_TRUE(d.Balanced(c, e, 0.10)) << "epoch " << e;
      EXPECT_LE(d.OverBest(), 1.10) << "epoch " << e;
    }
  }
  // The regression model reproduces the problem: the paper's rule does not settle.
  EXPECT_GE(paper_unbalanced, 6);
  std::printf("steady epoch s: fixed %.2f, proportional %.2f, dbs %.2f\n",
              fixed->SteadyEpochSeconds(), paper->SteadyEpochSeconds(),
              dbs_run->SteadyEpochSeconds());
  EXPECT_LT(dbs_run->SteadyEpochSeconds(), 0.8 * paper->SteadyEpochSeconds());
  EXPECT_LT(dbs_run->SteadyEpochSeconds(), 0.8 * fixed->SteadyEpochSeconds());
}

// The grid's worst cell (B64 1:1:1:8 under CPU quotas, docs/benchmark.md) as the kernel runs
// it: three workers limited to 1/11 of a core (1 ms every 11 ms) and one to 8/11 (1 ms every
// 1.375 ms), on a core that computes 5,500 samples/s, each step also needing 0.3 ms of CPU for
// its communication. A 1/11-core worker given a few samples often finishes them in one burst of
// its quota and looks 11 times faster than it can sustain. Judged by elapsed times alone, dbs
// chases that (as on real processes: [10 0 9 45] -> [5 0 4 55] -> [21 0 3 40]); with each
// step's cost counted as dbs_worker counts it under a CPU limit, it settles at once.
SimulationConfig GridWorstQuotaCell() {
  SimulationConfig c;
  const double fractions[] = {1.0 / 11, 1.0 / 11, 1.0 / 11, 8.0 / 11};
  for (int i = 0; i < 4; ++i) {
    SpeedModel m;
    m.kind = SpeedModel::Kind::kCfs;
    m.speed = 5500;
    m.overhead_seconds = 0.0003;
    m.quota = fractions[i];
    m.period_seconds = std::max(0.001, 0.001 / fractions[i]);
    m.phase_seconds = 0.0037 * i;
    m.noise = 0.05;
    c.workers.push_back(m);
  }
  c.global_batch = 64;
  c.train_samples = 64 * 32;
  c.epochs = 8;
  c.comm_base_seconds = 0.001;
  return c;
}

TEST(ControllerRegressionTest, UnderCpuLimitsTheStepCostSettlesWhereElapsedTimesOscillate) {
  SimulationConfig c = GridWorstQuotaCell();
  c.policy = PolicyKind::kDbs;
  auto aware = Simulate(c);
  ASSERT_THAT(aware, IsOk());
  c.cpu_limit_aware = false;
  auto wall = Simulate(c);
  ASSERT_THAT(wall, IsOk());
  c.policy = PolicyKind::kFixed;
  auto fixed = Simulate(c);
  ASSERT_THAT(fixed, IsOk());
  int wall_off = 0;
  for (int e = 0; e < c.epochs; ++e) {
    const EpochResult& a = aware->epochs[e];
    const EpochResult& w = wall->epochs[e];
    std::printf("epoch %d  dbs [%s] %.3f s, %.3fx best | by elapsed time [%s] %.3f s, %.3fx best\n",
                e, absl::StrJoin(a.batches, " ").c_str(), a.seconds, a.OverBest(),
                absl::StrJoin(w.batches, " ").c_str(), w.seconds, w.OverBest());
    if (e >= 1) {
      EXPECT_LE(a.OverBest(), 1.10) << "epoch " << e;
      wall_off += w.OverBest() > 1.10 ? 1 : 0;
    }
    if (e >= 2) {  // settled: a worker moves by a sample or 5% at most (the noise is 5%)
      for (size_t i = 0; i < a.batches.size(); ++i) {
        EXPECT_LE(std::abs(a.batches[i] - aware->epochs[e - 1].batches[i]),
                  std::max(1.0, 0.05 * a.batches[i]))
            << "epoch " << e << " worker " << i;
      }
    }
  }
  std::printf("steady epoch s: fixed %.3f, dbs by elapsed time %.3f, dbs %.3f\n",
              fixed->SteadyEpochSeconds(), wall->SteadyEpochSeconds(), aware->SteadyEpochSeconds());
  // The model reproduces the problem: judged by elapsed times the split keeps missing the best,
  // and the epochs are longer.
  EXPECT_GE(wall_off, 4);
  EXPECT_LT(aware->SteadyEpochSeconds(), 0.85 * wall->SteadyEpochSeconds());
  EXPECT_LT(aware->SteadyEpochSeconds(), 0.6 * fixed->SteadyEpochSeconds());
}

// From epoch `from` on, every epoch balanced within `tolerance` and within it of the best split.
bool Converged(const SimulationConfig& c, const SimulationResult& r, int from, double tolerance,
               std::string* why) {
  for (int e = from; e < c.epochs; ++e) {
    const EpochResult& er = r.epochs[e];
    if (!er.Balanced(c, e, tolerance) || er.OverBest() > 1.0 + tolerance) {
      *why = absl::StrCat("epoch ", e, ": batches [", absl::StrJoin(er.batches, " "), "], spread ",
                          er.Spread(), ", ", er.OverBest(), "x the best");
      return false;
    }
  }
  return true;
}

// 300 random clusters per property. SIMULATION_TEST_CLUSTERS=N checks the first N seeds instead:
// deploy/run_sanitizers.sh runs 60 under AddressSanitizer, which looks for memory errors in the
// same code paths at a fifth of the cost (the arithmetic, and so every result, is the same).
const int kClusters = ClustersToCheck("SIMULATION_TEST_CLUSTERS", 300, 10);

// The property: within 3 epochs every worker's step time within 10% of the others' (or
// as loaded as the best split of whole samples allows) and the slowest within 10% of the best
// split's, and it stays there. With the default controller, mid-epoch re-planning included.
TEST(ControllerPropertyTest, ConvergesWithinThreeEpochsAndStaysOnRandomClusters) {
  int dbs_ok = 0, paper_ok = 0, epoch_only_ok = 0;
  double worst_over_best = 0.0;
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(kClusters); ++seed) {
    std::string what, why;
    SimulationConfig c = RandomCluster(seed, /*allow_drift=*/false, &what);
    c.policy = PolicyKind::kDbs;
    auto dbs_run = Simulate(c);
    ASSERT_THAT(dbs_run, IsOk()) << dbs_run.status();
    const bool ok = Converged(c, *dbs_run, 3, 0.10, &why);
    dbs_ok += ok ? 1 : 0;
    EXPECT_TRUE(ok) << "seed " << seed << " (" << what << "): " << why
                    << " (dbs_simulator --trace_cluster=" << seed
                    << " --trace_drift=false shows every epoch)";
    for (int e = 3; e < c.epochs; ++e) {
      worst_over_best = std::max(worst_over_best, dbs_run->epochs[e].OverBest());
    }
    c.policy = PolicyKind::kProportional;
    auto paper = Simulate(c);
    ASSERT_THAT(paper, IsOk());
    paper_ok += Converged(c, *paper, 3, 0.10, &why) ? 1 : 0;
    c.policy = PolicyKind::kDbs;
    c.replan_window_steps = 0;
    auto epoch_only = Simulate(c);
    ASSERT_THAT(epoch_only, IsOk());
    epoch_only_ok += Converged(c, *epoch_only, 3, 0.10, &why) ? 1 : 0;
  }
  std::printf(
      "clusters within 10%% from epoch 3 on: dbs %d/%d (worst epoch %.3fx the best "
      "split); without mid-epoch re-planning %d/%d; the paper's rule %d/%d\n",
      dbs_ok, kClusters, worst_over_best, epoch_only_ok, kClusters, paper_ok, kClusters);
}

// The same property for processes under CPU limits, as the kernel's CFS bandwidth control runs
// them (RandomCfsCluster), with the limit-aware step cost dbs_worker reports by default:
//   - periods of 1 ms / limit (the benchmarks' emulation): a step needs many periods' quota and
//     is throttled evenly, so its elapsed time is already about its cost; all but one or two
//     clusters converge (and those are within 10% of the best split: a worker's step shifts by
//     up to a period, up to 22% of it, as its phase drifts, and a re-plan follows);
//   - the kernel's 100 ms periods (Kubernetes, docker): a small step runs at full speed while the
//     period's quota lasts. Judged by elapsed times, almost no cluster converges; with the step
//     cost every epoch from the third is within 10% of the best split, and most clusters are
//     balanced within 10%. A worker whose two steps' CPU does not fit one period's quota stalls
//     for up to a period: noise of tens of ms that no split removes, around which its batch
//     jitters by a few samples.
TEST(ControllerPropertyTest, ConvergesWithinThreeEpochsUnderCpuLimits) {
  for (bool kernel_periods : {false, true}) {
    int dbs_ok = 0, wall_ok = 0, paper_ok = 0;
    double worst_over_best = 0.0, log_time_ratio = 0.0;
    for (uint64_t seed = 1; seed <= static_cast<uint64_t>(kClusters); ++seed) {
      std::string what, why;
      SimulationConfig c = RandomCfsCluster(seed, kernel_periods, &what);
      c.policy = PolicyKind::kDbs;
      auto dbs_run = Simulate(c);
      ASSERT_THAT(dbs_run, IsOk()) << dbs_run.status();
      dbs_ok += Converged(c, *dbs_run, 3, 0.10, &why) ? 1 : 0;
      for (int e = 3; e < c.epochs; ++e) {
        worst_over_best = std::max(worst_over_best, dbs_run->epochs[e].OverBest());
        EXPECT_LE(dbs_run->epochs[e].OverBest(), 1.10)
            << "seed " << seed << " (" << what << ") epoch " << e
            << " (dbs_simulator --trace_cluster=" << seed
            << " --trace_cfs=" << (kernel_periods ? "kernel" : "short") << " shows every epoch)";
      }
      c.cpu_limit_aware = false;
      auto wall = Simulate(c);
      ASSERT_THAT(wall, IsOk()) << wall.status() << " seed " << seed;
      wall_ok += Converged(c, *wall, 3, 0.10, &why) ? 1 : 0;
      log_time_ratio += std::log(dbs_run->SteadyEpochSeconds() / wall->SteadyEpochSeconds());
      c.policy = PolicyKind::kProportional;
      auto paper = Simulate(c);
      ASSERT_THAT(paper, IsOk());
      paper_ok += Converged(c, *paper, 3, 0.10, &why) ? 1 : 0;
    }
    const double time_ratio = std::exp(log_time_ratio / kClusters);
    std::printf(
        "CPU-limited clusters, %s periods, within 10%% from epoch 3 on: dbs %d/%d (worst epoch "
        "%.3fx the best split); dbs judging elapsed times alone %d/%d; the paper's rule %d/%d; "
        "epoch time with the step cost / by elapsed times: %.3f (geometric mean)\n",
        kernel_periods ? "100 ms" : "1 ms / limit", dbs_ok, kClusters, worst_over_best, wall_ok,
        kClusters, paper_ok, kClusters, time_ratio);
    if (kernel_periods) {
      EXPECT_GE(dbs_ok, kClusters * 8 / 10);
      EXPECT_LT(wall_ok, kClusters / 10) << "the model must reproduce what elapsed times do";
      EXPECT_LT(time_ratio, 1.0);
    } else {
      EXPECT_GE(dbs_ok, kClusters - 3);
    }
  }
}

// No oscillation even without mid-epoch re-planning: the epoch-boundary controller alone settles
// on every cluster, and stays.
TEST(ControllerPropertyTest, EpochBoundaryControllerSettlesOnRandomClusters) {
  int latest = 0;
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(kClusters); ++seed) {
    std::string what, why;
    SimulationConfig c = RandomCluster(seed, /*allow_drift=*/false, &what);
    c.epochs = 16;
    c.replan_window_steps = 0;
    auto r = Simulate(c);
    ASSERT_THAT(r, IsOk());
    int settled = c.epochs;
    while (settled > 0 && Converged(c, *r, settled - 1, 0.10, &why)) --settled;
    latest = std::max(latest, settled);
    EXPECT_LE(settled, 10) << "seed " << seed << " (" << what << ") has not settled by epoch 10";
  }
  std::printf("epoch-boundary controller: every cluster settled by epoch %d\n", latest);
}

// Under slow drifts (each worker up to 1% faster or slower every epoch) the split follows: the
// slowest step stays close to the best split's.
TEST(ControllerPropertyTest, FollowsSlowDrifts) {
  int drifting = 0;
  double worst_over_best = 0.0, worst_spread = 0.0;
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(kClusters); ++seed) {
    std::string what;
    SimulationConfig c = RandomCluster(seed, /*allow_drift=*/true, &what);
    if (what.find("drifting") == std::string::npos) continue;
    ++drifting;
    c.epochs = 16;
    auto r = Simulate(c);
    ASSERT_THAT(r, IsOk());
    for (int e = 3; e < c.epochs; ++e) {
      worst_over_best = std::max(worst_over_best, r->epochs[e].OverBest());
      worst_spread = std::max(worst_spread, r->epochs[e].Spread());
      EXPECT_LE(r->epochs[e].OverBest(), 1.15) << "seed " << seed << " epoch " << e;
    }
  }
  std::printf("%d drifting clusters, epochs 3-15: worst %.3fx the best split, worst spread %.3f\n",
              drifting, worst_over_best, worst_spread);
}

TEST(ControllerPropertyTest, FollowsADisturbanceAndRecovers) {
  SimulationConfig c = SimulationConfig::Linear({400, 400, 800, 1600});
  c.workers[1].kind = SpeedModel::Kind::kQuota;
  c.workers[1].quota = 0.25;
  c.workers[1].speed = 1600;
  c.workers[1].period_seconds = 0.05;
  c.global_batch = 256;
  c.train_samples = 256 * 40;
  c.epochs = 12;
  c.disturbances = {{2, 4, 7, 3.0}};
  c.policy = PolicyKind::kDbs;
  auto r = Simulate(c);
  ASSERT_THAT(r, IsOk());
  for (int e = 0; e < c.epochs; ++e) {
    std::printf("epoch %d [%s] spread %.2f, %.3fx best\n", e,
                absl::StrJoin(r->epochs[e].batches, " ").c_str(), r->epochs[e].Spread(),
                r->epochs[e].OverBest());
    // The epoch a change starts (4) or ends (7) runs on the old split; the next is balanced.
    if (e >= 2 && e != 4 && e != 7) {
      EXPECT_LE(r->epochs[e].OverBest(), 1.10) << "epoch " << e;
    }
  }
}

TEST(ControllerPropertyTest, MidEpochReplanningUsesTheModel) {
  SimulationConfig c = OscillatingQuotaCluster();
  for (SpeedModel& m : c.workers) m.noise = 0.0;
  c.disturbances = {{3, 4, 100, 3.0}};  // the fastest worker slowed 3x from epoch 4 on
  c.replan_window_steps = 4;
  c.policy = PolicyKind::kDbs;
  auto r = Simulate(c);
  ASSERT_THAT(r, IsOk());
  EXPECT_GE(r->epochs[4].replans, 1) << "the slowdown is noticed within the epoch";
  for (int e = 5; e < c.epochs; ++e) {
    EXPECT_LE(r->epochs[e].OverBest(), 1.10) << "epoch " << e;
    EXPECT_EQ(r->epochs[e].replans, 0) << "no re-plan once balanced, epoch " << e;
  }
}

// A step waits for its slowest worker, so a worker whose step times scatter delays the others
// more than its mean says. Half the workers here are noisy (30% per step), half steady (2%);
// the noise margin gives the noisy ones a little less, and the epoch (the sum over steps of the
// slowest noisy step) is shorter than when the means are balanced.
TEST(NoiseMarginTest, NoisyWorkersGetLessAndTheEpochIsShorter) {
  for (int n : {4, 16}) {
    SimulationConfig c;
    for (int i = 0; i < n; ++i) {
      SpeedModel m;
      m.speed = 500.0 * (1 + i % 4);
      m.noise = i % 2 == 0 ? 0.3 : 0.02;
      c.workers.push_back(m);
    }
    c.global_batch = 64 * n;
    c.epochs = 8;
    c.train_samples = 64 * n * 32;
    c.noise_margin = 0.0;
    absl::StatusOr<SimulationResult> means = Simulate(c);
    c.noise_margin = kDefaultNoiseMargin;
    absl::StatusOr<SimulationResult> margins = Simulate(c);
    ASSERT_THAT(means, IsOk());
    ASSERT_THAT(margins, IsOk());
    std::printf(
        "%d workers, half 30%% noisy: steady epoch %.3f s balancing means, %.3f s with "
        "margins\n",
        n, means->SteadyEpochSeconds(), margins->SteadyEpochSeconds());
    EXPECT_LT(margins->SteadyEpochSeconds(), 0.975 * means->SteadyEpochSeconds()) << n;
    // The noisy workers (even ids) together got less than when the means are balanced.
    auto noisy_share = [](const EpochResult& e) {
      int64_t sum = 0;
      for (size_t i = 0; i < e.batches.size(); i += 2) sum += e.batches[i];
      return sum;
    };
    EXPECT_LT(noisy_share(margins->epochs.back()), noisy_share(means->epochs.back())) << n;
  }
}

}  // namespace
}  // namespace dbs
