// The share policies: the paper's proportional rule, the fixed split, smoothing, and the default
// dbs controller (BalancingPolicy) on hand-made histories.
#include "server/share_policy.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/balancing_policy.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;

// One measurement of `samples` samples in `seconds`, totals only.
WorkerObservation Obs(int64_t samples, double seconds) {
  WorkerObservation o;
  o.history.push_back(Measurement{samples, seconds, 1, {}});
  return o;
}

TEST(PolicyNamesTest, ParseAndPrint) {
  for (PolicyKind k : {PolicyKind::kDbs, PolicyKind::kProportional, PolicyKind::kFixed}) {
    EXPECT_EQ(*ParsePolicy(PolicyName(k)), k);
  }
  EXPECT_THAT(ParsePolicy("random"), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(ParsePolicy("cost").status().message()),
              ::testing::HasSubstr("part of 'dbs'"));
  EXPECT_EQ(ReplanWindowSteps(PolicyKind::kDbs, -1), kDbsReplanWindowSteps);
  EXPECT_EQ(ReplanWindowSteps(PolicyKind::kProportional, -1), 0);
  EXPECT_EQ(ReplanWindowSteps(PolicyKind::kProportional, 4), 4);
  EXPECT_EQ(ReplanWindowSteps(PolicyKind::kDbs, 0), 0);
  EXPECT_EQ(ReplanWindowSteps(PolicyKind::kFixed, 8), 0) << "the fixed split never moves";
}

TEST(ProportionalPolicyTest, SharesFollowComputeSpeed) {
  ProportionalPolicy p;
  // Equal shares, times 8:8:4:2 -> speeds 1:1:2:4.
  const std::vector<double> s = p.NextShares({Obs(100, 8), Obs(100, 8), Obs(100, 4), Obs(100, 2)});
  EXPECT_THAT(s, ElementsAre(DoubleNear(0.125, 1e-12), DoubleNear(0.125, 1e-12),
                             DoubleNear(0.25, 1e-12), DoubleNear(0.5, 1e-12)));
}

TEST(ProportionalPolicyTest, EqualSpeedsGiveEqualShares) {
  ProportionalPolicy p;
  const std::vector<double> s = p.NextShares({Obs(50, 1), Obs(100, 2), Obs(200, 4)});
  for (double v : s) EXPECT_NEAR(v, 1.0 / 3, 1e-12);
}

TEST(ProportionalPolicyTest, UnmeasuredWorkerGetsTheMeanSpeed) {
  ProportionalPolicy p;
  // Worker 1 processed nothing (zero batch), worker 2 reported zero time and worker 4 joined
  // since: they get the mean speed of workers 0 and 3 (100/s and 300/s -> 200/s).
  const std::vector<double> s =
      p.NextShares({Obs(100, 1), Obs(0, 0), Obs(10, 0), Obs(300, 1), WorkerObservation{}});
  EXPECT_NEAR(s[0], 100.0 / 1000, 1e-12);
  EXPECT_NEAR(s[1], 200.0 / 1000, 1e-12);
  EXPECT_NEAR(s[2], 200.0 / 1000, 1e-12);
  EXPECT_NEAR(s[3], 300.0 / 1000, 1e-12);
  EXPECT_NEAR(s[4], 200.0 / 1000, 1e-12);
}

TEST(ProportionalPolicyTest, NoMeasurementAtAllIsAnEqualSplit) {
  ProportionalPolicy p;
  EXPECT_THAT(p.NextShares({Obs(0, 0), Obs(0, 0)}), ElementsAre(0.5, 0.5));
}

TEST(ProportionalPolicyTest, HugeAndTinySpeeds) {
  ProportionalPolicy p;
  const std::vector<double> s = p.NextShares({Obs(1, 1e-9), Obs(1, 1e9)});
  EXPECT_NEAR(s[0], 1.0, 1e-12);
  EXPECT_GT(s[1], 0.0);
  EXPECT_NEAR(s[0] + s[1], 1.0, 1e-12);
}

TEST(ProportionalPolicyTest, SpeedWindowTakesTheRecentMinimum) {
  // Worker 0 looked fast last epoch (200/s) but managed only 100/s the epoch before (a throttled
  // worker that was idle last time); worker 1 is steady at 100/s.
  WorkerObservation w0 = Obs(200, 1);
  w0.history.insert(w0.history.begin(), Measurement{100, 1, 1, {}});
  WorkerObservation w1 = Obs(100, 1);
  w1.history.insert(w1.history.begin(), Measurement{100, 1, 1, {}});
  EXPECT_THAT(ProportionalPolicy(1).NextShares({w0, w1}),
              ElementsAre(DoubleNear(2.0 / 3, 1e-12), DoubleNear(1.0 / 3, 1e-12)));
  EXPECT_THAT(ProportionalPolicy(2).NextShares({w0, w1}), ElementsAre(0.5, 0.5));
  // A slowdown shows at once whatever the window.
  WorkerObservation slowed = Obs(50, 1);
  slowed.history.insert(slowed.history.begin(), Measurement{100, 1, 1, {}});
  EXPECT_NEAR(ProportionalPolicy(2).NextShares({slowed, w1})[0], 1.0 / 3, 1e-12);
  // Older epochs than the window are ignored; unusable ones are skipped.
  WorkerObservation old = Obs(100, 1);
  old.history.insert(old.history.begin(), {Measurement{10, 1, 1, {}}, Measurement{0, 0, 0, {}}});
  EXPECT_THAT(ProportionalPolicy(2).NextShares({old, w1}), ElementsAre(0.5, 0.5));
}

TEST(EqualSplitPolicyTest, IgnoresMeasurements) {
  EqualSplitPolicy p;
  EXPECT_THAT(p.NextShares({Obs(100, 1), Obs(100, 10)}), ElementsAre(0.5, 0.5));
}

WorkerObservation Named(const std::string& name, int64_t samples = 100, double seconds = 1) {
  WorkerObservation o = Obs(samples, seconds);
  o.name = name;
  return o;
}

TEST(WeightedSplitPolicyTest, SharesFollowTheWeightsByNameFromTheFirstEpoch) {
  WeightedSplitPolicy p({{"slow", 1}, {"mid", 3}, {"fast", 4}, {"idle", 0}});
  // Whatever they measured, and in whatever order the workers come.
  const std::vector<WorkerObservation> obs = {Named("fast", 10, 100), Named("slow", 1000, 1),
                                              Named("mid"), Named("idle")};
  EXPECT_THAT(p.NextShares(obs), ElementsAre(0.5, 0.125, 0.375, 0.0));
  EXPECT_THAT(p.FirstShares(obs), ElementsAre(0.5, 0.125, 0.375, 0.0));
  // A worker gone: the others' weights are split among them.
  EXPECT_THAT(p.NextShares({Named("mid"), Named("slow")}), ElementsAre(0.75, 0.25));
  // Only zero weights left: an equal split rather than nothing at all.
  EXPECT_THAT(p.NextShares({Named("idle")}), ElementsAre(1.0));
  EXPECT_THAT(p.Admits("mid"), IsOk());
  const absl::Status refused = p.Admits("stranger");
  EXPECT_THAT(refused, StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("'stranger' has no weight in this job's fixed split (fast, "
                                   "idle, mid, slow)"));
  // The other policies admit anyone and start equal.
  EXPECT_THAT(EqualSplitPolicy().Admits("stranger"), IsOk());
  EXPECT_THAT(ProportionalPolicy().FirstShares(obs), ElementsAre(0.25, 0.25, 0.25, 0.25));
}

TEST(WeightedSplitPolicyTest, ParsesAndValidatesTheSplit) {
  auto split = ParseFixedSplit("worker-0:1,host:4242:2.5,worker-2:0");
  ASSERT_THAT(split, IsOk());
  EXPECT_EQ(split->size(), 3u);
  EXPECT_EQ(split->at("host:4242"), 2.5) << "a name may hold ':' (the default host:pid)";
  EXPECT_EQ(split->at("worker-2"), 0.0);
  EXPECT_EQ(FixedSplitText(*split), "host:4242:2.5,worker-0:1,worker-2:0");
  EXPECT_TRUE(ParseFixedSplit("")->empty());
  for (const char* bad :
       {"worker-0", ":3", "a:", "a:x", "a:-1", "a:nan", "a:inf", "a:1,a:2", "a:1,,b:2"}) {
    EXPECT_THAT(ParseFixedSplit(bad), StatusCodeIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  PolicyConfig c;
  c.fixed_split = {{"a", 1}, {"b", 3}};
  EXPECT_THAT(MakeSharePolicy(c), StatusCodeIs(absl::StatusCode::kInvalidArgument))
      << "a fixed split needs the fixed policy";
  c.kind = PolicyKind::kFixed;
  auto made = MakeSharePolicy(c);
  ASSERT_THAT(made, IsOk());
  EXPECT_THAT((*made)->NextShares({Named("b"), Named("a")}), ElementsAre(0.75, 0.25));
  EXPECT_THAT((*made)->Admits("c"), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  c.smoothing = 0.5;  // a smoothed fixed split is still the split, and still refuses strangers
  made = MakeSharePolicy(c);
  ASSERT_THAT(made, IsOk());
  EXPECT_THAT((*made)->FirstShares({Named("b"), Named("a")}), ElementsAre(0.75, 0.25));
  EXPECT_THAT((*made)->Admits("c"), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  c.smoothing = 1.0;
  c.fixed_split = {{"a", 0}, {"b", 0}};
  EXPECT_THAT(MakeSharePolicy(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

TEST(SmoothedPolicyTest, EmaAndDeadband) {
  // The paper's rule would move to 0.75 / 0.25 (speeds 300 and 100).
  WorkerObservation fast = Obs(300, 1), slow = Obs(100, 1);
  fast.previous_share = slow.previous_share = 0.5;
  SmoothedPolicy ema(std::make_unique<ProportionalPolicy>(), 0.5, 0.0);
  EXPECT_THAT(ema.NextShares({fast, slow}),
              ElementsAre(DoubleNear(0.625, 1e-12), DoubleNear(0.375, 1e-12)));
  // The largest relative move is 0.5 (0.25 against 0.5): inside a 0.6 dead-band nothing moves.
  SmoothedPolicy band(std::make_unique<ProportionalPolicy>(), 1.0, 0.6);
  EXPECT_THAT(band.NextShares({fast, slow}), ElementsAre(0.5, 0.5));
  SmoothedPolicy narrow(std::make_unique<ProportionalPolicy>(), 1.0, 0.4);
  EXPECT_THAT(narrow.NextShares({fast, slow}),
              ElementsAre(DoubleNear(0.75, 1e-12), DoubleNear(0.25, 1e-12)));
  EXPECT_EQ(band.kind(), PolicyKind::kProportional);
}

TEST(MakeSharePolicyTest, ConfigValidation) {
  PolicyConfig c;
  EXPECT_EQ((*MakeSharePolicy(c))->name(), "dbs");
  c.kind = PolicyKind::kFixed;
  EXPECT_EQ((*MakeSharePolicy(c))->name(), "fixed");
  c.smoothing = 0.0;
  EXPECT_FALSE(MakeSharePolicy(c).ok());
  c.smoothing = 0.5;
  c.min_batch = 10;
  c.max_batch = 5;
  EXPECT_FALSE(MakeSharePolicy(c).ok());
  c.max_batch = 0;
  c.speed_window = 0;
  EXPECT_THAT(MakeSharePolicy(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c.speed_window = 1;
  c.deadband = 1.0;
  EXPECT_FALSE(MakeSharePolicy(c).ok());
}

// The dbs controller. A worker whose step takes `overhead` + batch / `speed` seconds, measured for
// 100 steps at each of `batches` (oldest first), now running the last of them.
WorkerObservation Ran(double overhead, double speed, std::vector<int> batches) {
  WorkerObservation o;
  for (int b : batches) {
    Measurement m;
    m.steps = 100;
    m.samples = 100 * b;
    m.compute_seconds = 100 * (overhead + b / speed);
    m.by_batch[b] = {100, m.compute_seconds};
    o.history.push_back(m);
  }
  o.current_batch = batches.back();
  return o;
}

BalancingPolicy Dbs(int global_batch, int min_batch = 0, int max_batch = 0) {
  BalancingOptions o;
  o.global_batch = global_batch;
  o.min_batch = min_batch;
  o.max_batch = max_batch;
  return BalancingPolicy(o);
}

TEST(BalancingPolicyTest, FromOnePointItIsTheProportionalRule) {
  const BalancingPlan p =
      Dbs(128).Plan({Ran(0, 100, {32}), Ran(0, 100, {32}), Ran(0, 200, {32}), Ran(0, 400, {32})});
  EXPECT_THAT(p.batches, ElementsAre(16, 16, 32, 64));
  EXPECT_FALSE(p.held);
}

TEST(BalancingPolicyTest, EqualisesStepTimesWhenOverheadsDiffer) {
  // Equal speeds, worker 1 pays 16 ms more per step; measured at 16 and then 32 samples. Equal
  // step times: 40 ms at b0 = 40, b1 = 24 (proportional batches would stay at 32 each and worker
  // 1 would be the laggard).
  const BalancingPlan p = Dbs(64).Plan({Ran(0.0, 1000, {16, 32}), Ran(0.016, 1000, {16, 32})});
  EXPECT_THAT(p.batches, ElementsAre(40, 24));
  EXPECT_NEAR(p.predicted_step_seconds, 0.040, 1e-9);
  EXPECT_NEAR(p.current_step_seconds, 0.048, 1e-9);
  EXPECT_THAT(p.gains, ElementsAre(1.0, 1.0));
}

TEST(BalancingPolicyTest, BoundsAndMemoryCapsAreKept) {
  const std::vector<WorkerObservation> w = {Ran(0.0, 1000, {16, 32}), Ran(0.016, 1000, {16, 32})};
  EXPECT_THAT(Dbs(64, 0, 35).Plan(w).batches, ElementsAre(35, 29));
  // A worker whose fixed per-step work (100 ms) outlasts the other's whole step at all 64 samples
  // (64 ms) is taken down to nothing by default, 4x at a time (the trust region): it still takes
  // part in every step, computing no gradient. A minimum keeps it computing.
  std::vector<WorkerObservation> overhead = {Ran(0, 1000, {32, 16}), Ran(0.1, 1000, {32, 16})};
  EXPECT_THAT(Dbs(64).Plan(overhead).batches, ElementsAre(60, 4));
  overhead = {Ran(0, 1000, {32, 48, 60, 63}), Ran(0.1, 1000, {32, 16, 4, 1})};
  EXPECT_THAT(Dbs(64).Plan(overhead).batches, ElementsAre(64, 0));
  EXPECT_THAT(Dbs(64, 1).Plan(overhead).batches, ElementsAre(63, 1));
  // A minimum keeps a very slow worker in the job.
  EXPECT_THAT(Dbs(64, 8).Plan({Ran(0, 10000, {16, 32}), Ran(0, 100, {16, 32})}).batches,
              ElementsAre(56, 8));
}

TEST(BalancingPolicyTest, HoldsABalancedSplit) {
  // 3% apart: kept as it is, however the curves would split it.
  const BalancingPlan p = Dbs(64).Plan({Ran(0, 1000, {32}), Ran(0, 1030, {32})});
  EXPECT_TRUE(p.held);
  EXPECT_THAT(p.batches, ElementsAre(32, 32));
  EXPECT_THAT(Dbs(64).NextShares({Ran(0, 1000, {32}), Ran(0, 1030, {32})}), ElementsAre(0.5, 0.5));
  // 10% apart: moved.
  EXPECT_FALSE(Dbs(64).Plan({Ran(0, 1000, {32}), Ran(0, 1100, {32})}).held);
}

TEST(BalancingPolicyTest, AWorkerNeverMeasuredIsProbedAtTheMeanSpeed) {
  WorkerObservation joined;  // no history
  const BalancingPlan p = Dbs(90).Plan({Ran(0, 100, {30}), Ran(0, 200, {60}), joined});
  // Speeds 100, 200 and the mean 150: 20, 40, 30.
  EXPECT_THAT(p.batches, ElementsAre(20, 40, 30));
}

TEST(BalancingPolicyTest, AnIdleWorkerIsProbedWithOneSampleWhenAProbeIsCheapBesideItsIdleTime) {
  // Worker 1 was last measured at 200 ms for one sample (a burst took it to no sample) and has
  // run none since; worker 0 runs 64 samples in 64 ms. A probe, one sample for a re-plan window
  // of 8 steps, is predicted to cost 8 x (200 - 64) / 64 = 17 of worker 0's steps: it is due
  // once a tenth of the worker's idle steps covers that, 170 steps.
  WorkerObservation idle;
  Measurement burst;
  burst.steps = 10;
  burst.samples = 10;
  burst.compute_seconds = 2.0;
  burst.by_batch[1] = {10, 2.0};
  idle.history = {burst};
  const std::vector<WorkerObservation> busy = {Ran(0, 1000, {32, 64})};
  auto plan = [&](int idle_steps, int out_steps) {
    std::vector<WorkerObservation> w = busy;
    w.push_back(idle);
    w.back().idle_steps = idle_steps;
    w.back().out_steps = out_steps;
    return Dbs(64).Plan(w);
  };
  BalancingPlan p = plan(160, 160);
  EXPECT_TRUE(p.held);
  EXPECT_THAT(p.batches, ElementsAre(64, 0));
  p = plan(180, 180);
  EXPECT_FALSE(p.held);
  EXPECT_THAT(p.batches, ElementsAre(63, 1));
  // After a probe that found it still slow, the next waits for a third of the time it was out
  // before: 180 idle steps after 900 out are too soon, 300 are not.
  EXPECT_THAT(plan(180, 1080).batches, ElementsAre(64, 0));
  EXPECT_THAT(plan(300, 1200).batches, ElementsAre(63, 1));
  // A worker the job keeps at a minimum batch is never idle; one measured fast again after a
  // probe gets its share back (the re-plan window's measurement, as the scheduler appends it).
  WorkerObservation back = idle;
  Measurement probe;
  probe.steps = 8;
  probe.samples = 8;
  probe.compute_seconds = 8 * 0.002;
  probe.by_batch[1] = {8, 8 * 0.002};
  back.history.push_back(probe);
  back.current_batch = 1;
  back.out_steps = 188;
  std::vector<WorkerObservation> w = busy;
  w.push_back(back);
  EXPECT_GT(Dbs(64).Plan(w).batches[1], 1);
}

TEST(BalancingPolicyTest, RepeatedReversalsHalveTheGain) {
  // Worker 0 went 32 -> 48 -> 24 -> 44 (a probe, then corrections of 24 and 20 samples that do
  // not shrink by half: one oscillation so far) and the plan would reverse it again.
  WorkerObservation w0 = Ran(0, 1000, {32, 48, 24, 44});
  WorkerObservation w1 = Ran(0, 1000, {32, 16, 40, 20});
  // The measurements say both run at 1000/s, so the balanced split is 32 / 32; worker 0 would
  // move by -12, a third reversal not halving the previous move: its gain is a quarter.
  const BalancingPlan p = Dbs(64).Plan({w0, w1});
  EXPECT_DOUBLE_EQ(p.gains[0], 0.25);
  EXPECT_DOUBLE_EQ(p.gains[1], 0.25);
  EXPECT_THAT(p.batches, ElementsAre(41, 23));
  // A converging sequence (each correction at most half the previous) is not damped.
  const BalancingPlan q =
      Dbs(64).Plan({Ran(0, 1000, {32, 48, 28, 35}), Ran(0, 1000, {32, 16, 36, 29})});
  EXPECT_THAT(q.gains, ElementsAre(1.0, 1.0));
  EXPECT_THAT(q.batches, ElementsAre(32, 32));
}

TEST(BalancingPolicyTest, ConvexKneeIsApproachedFromTheMeasuredSide) {
  // A CPU-quota worker: 1 ms per sample up to 20 samples, 8 ms per sample beyond. Measured at 32
  // (slow: 116 ms) and 16 (fast: 16 ms); its partner runs 2 ms per sample. The line between the
  // two measurements is above the true curve, so the worker is moved up no further than where
  // its step really takes the planned time, and never to 32, where it was measured too slow.
  auto quota = [](int b) { return b <= 20 ? 0.001 * b : 0.020 + 0.008 * (b - 20); };
  WorkerObservation w0;
  for (int b : {32, 16}) {
    Measurement m;
    m.steps = 10;
    m.samples = 10 * b;
    m.compute_seconds = 10 * quota(b);
    m.by_batch[b] = {10, m.compute_seconds};
    w0.history.push_back(m);
  }
  w0.current_batch = 16;
  const BalancingPlan p = Dbs(64).Plan({w0, Ran(0, 500, {32, 48})});
  EXPECT_GT(p.batches[0], 16);
  EXPECT_LT(p.batches[0], 32);
  EXPECT_LE(quota(p.batches[0]), p.predicted_step_seconds) << "not past the true root";
}

TEST(BalancingPolicyTest, AWorkerAtNoBatchIsMarginedWhereItLastWorked) {
  // Three workers measured with per-step noise (a relative standard deviation of about 0.3);
  // worker 2 was taken down to no batch. Its margin is the one it carried at its smallest
  // measured batch, not 0: a bare curve beside the others' raised ones would bring it back
  // with more samples than its step can take.
  auto noisy = [](double per_sample, std::vector<int> batches, int now) {
    WorkerObservation o;
    for (int b : batches) {
      Measurement m;
      const double mean = 0.002 + per_sample * b;
      m.steps = 20;
      m.samples = 20 * b;
      m.compute_seconds = 20 * mean;
      // 20 steps with a relative standard deviation of 0.3 around `mean`.
      m.by_batch[b] = {20, m.compute_seconds, 20 * mean * mean * (1 + 0.09 * 19.0 / 20)};
      o.history.push_back(m);
    }
    o.current_batch = now;
    return o;
  };
  const std::vector<WorkerObservation> w = {noisy(0.001, {20, 30}, 30), noisy(0.001, {20, 30}, 30),
                                            noisy(0.004, {4, 2}, 0)};
  const BalancingPolicy dbs = Dbs(60);
  const std::vector<StepTimeModel> models = dbs.Models(w);
  const std::vector<double> sd = dbs.RelativeNoise(w);
  const std::vector<double> margins = dbs.NoiseMargins(w, models);
  ASSERT_GT(sd[2], 0.2);
  EXPECT_NEAR(margins[2], sd[2] * models[2].Predict(2), 1e-12);
  EXPECT_NEAR(margins[0], sd[0] * models[0].Predict(30), 1e-12);
}

}  // namespace
}  // namespace dbs
