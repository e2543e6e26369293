#include "server/batch_allocator.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), 0LL); }

TEST(LargestRemainderTest, SplitsProportionallyAndSumsExactly) {
  EXPECT_THAT(LargestRemainder(128, {0.125, 0.125, 0.25, 0.5}), ElementsAre(16, 16, 32, 64));
  // 100 * (1/3, 1/3, 1/3) = 33.33 each: one leftover unit goes to the lowest index on a tie.
  EXPECT_THAT(LargestRemainder(100, {1.0, 1.0, 1.0}), ElementsAre(34, 33, 33));
  // 10 * (0.55, 0.45) = 5.5, 4.5: floors 5 + 4, the leftover to the first (tie on .5).
  EXPECT_THAT(LargestRemainder(10, {0.55, 0.45}), ElementsAre(6, 4));
  // The largest fraction wins the leftover: 7 * (0.3, 0.7) = 2.1, 4.9.
  EXPECT_THAT(LargestRemainder(7, {0.3, 0.7}), ElementsAre(2, 5));
}

TEST(LargestRemainderTest, UnnormalisedSharesAreScaled) {
  EXPECT_THAT(LargestRemainder(64, {1, 1, 2}), ElementsAre(16, 16, 32));
}

TEST(LargestRemainderTest, SumIsExactForManyAwkwardSplits) {
  for (int64_t total : {1, 2, 3, 7, 63, 64, 127, 256, 1000, 99991}) {
    for (int n : {1, 2, 3, 5, 7, 16, 64}) {
      std::vector<double> shares(n);
      for (int i = 0; i < n; ++i) shares[i] = 1.0 / (i + 1.7);
      const std::vector<int64_t> out = LargestRemainder(total, shares);
      EXPECT_EQ(Sum(out), total) << total << " over " << n;
      for (int64_t v : out) EXPECT_GE(v, 0);
    }
  }
}

TEST(LargestRemainderTest, ZeroShareGetsNothingAndTinyShareMayGetNothing) {
  EXPECT_THAT(LargestRemainder(10, {0.0, 1.0}), ElementsAre(0, 10));
  EXPECT_THAT(LargestRemainder(10, {1e-9, 1.0}), ElementsAre(0, 10));
}

TEST(LargestRemainderTest, HugeRatiosStayExact) {
  const std::vector<int64_t> out = LargestRemainder(256, {1e12, 1.0, 1e-12});
  EXPECT_THAT(out, ElementsAre(256, 0, 0));
}

TEST(AllocateEpochTest, OneWorkerGetsEverything) {
  auto a = AllocateEpoch(1000, 100, 64, {1.0});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->num_steps, 16);  // 15 full steps of 64 + one of 40
  ASSERT_EQ(a->workers.size(), 1u);
  EXPECT_EQ(a->workers[0].batch_size, 64);
  EXPECT_EQ(a->workers[0].final_batch_size, 1000 - 15 * 64);
  ASSERT_EQ(a->workers[0].train.size(), 16u);
  EXPECT_EQ(a->workers[0].train[0], (SampleRange{0, 64}));
  EXPECT_EQ(a->workers[0].train[15], (SampleRange{960, 1000}));
  EXPECT_EQ(a->workers[0].test, (SampleRange{0, 100}));
}

TEST(AllocateEpochTest, RangesCoverThePermutationExactlyOnce) {
  for (int64_t d : {64, 1000, 6000, 60000, 60001}) {
    for (int b : {1, 7, 64, 128, 256}) {
      const std::vector<double> shares = {0.1, 0.2, 0.3, 0.4, 1e-6};
      auto a = AllocateEpoch(d, 10000, b, shares);
      ASSERT_TRUE(a.ok()) << a.status();
      std::vector<int> hits(d, 0);
      int64_t batch_sum = 0, last_sum = 0, test_next = 0;
      for (const WorkerAllocation& w : a->workers) {
        for (const SampleRange& r : w.train) {
          for (int64_t i = r.begin; i < r.end; ++i) hits[i]++;
        }
        // The ranges hold exactly the worker's steps.
        EXPECT_EQ(w.train_samples(),
                  static_cast<int64_t>(a->num_steps - 1) * w.batch_size + w.final_batch_size);
        batch_sum += w.batch_size;
        last_sum += w.final_batch_size;
        EXPECT_EQ(w.test.begin, test_next);
        test_next = w.test.end;
      }
      EXPECT_EQ(test_next, 10000);
      EXPECT_EQ(batch_sum, b);
      EXPECT_EQ(last_sum, d % b == 0 ? b : d % b);
      EXPECT_EQ(a->num_steps, (d + b - 1) / b);
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(hits[i], 1) << "sample " << i << " d=" << d;
    }
  }
}

TEST(AllocateEpochTest, EveryStepUsesTheSameBlockWhateverTheSplit) {
  // 10 samples, B = 4: steps use positions [0,4), [4,8), [8,10) under any split.
  for (const std::vector<double>& shares :
       {std::vector<double>{1.0}, {0.5, 0.5}, {0.1, 0.2, 0.7}, {0.0, 1.0}}) {
    auto a = AllocateEpoch(10, 0, 4, shares);
    ASSERT_TRUE(a.ok());
    ASSERT_EQ(a->num_steps, 3);
    std::vector<std::vector<int64_t>> per_step(3);
    for (const WorkerAllocation& w : a->workers) {
      size_t k = 0;
      for (int step = 0; step < 3; ++step) {
        const int b = step == 2 ? w.final_batch_size : w.batch_size;
        if (b == 0) continue;
        ASSERT_LT(k, w.train.size());
        EXPECT_EQ(w.train[k].size(), b);
        for (int64_t i = w.train[k].begin; i < w.train[k].end; ++i) per_step[step].push_back(i);
        ++k;
      }
      EXPECT_EQ(k, w.train.size());
    }
    for (auto& v : per_step) std::sort(v.begin(), v.end());
    EXPECT_EQ(per_step[0], (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(per_step[1], (std::vector<int64_t>{4, 5, 6, 7}));
    EXPECT_EQ(per_step[2], (std::vector<int64_t>{8, 9}));
  }
}

TEST(AllocateEpochTest, DatasetSmallerThanBatchIsOnePartialStep) {
  auto a = AllocateEpoch(10, 0, 64, {0.5, 0.5});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->num_steps, 1);
  EXPECT_EQ(a->workers[0].final_batch_size + a->workers[1].final_batch_size, 10);
}

TEST(AllocateEpochTest, RejectsBadInput) {
  EXPECT_EQ(AllocateEpoch(0, 0, 64, {1.0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateEpoch(10, 0, 0, {1.0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateEpoch(10, 0, 8, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateEpoch(10, 0, 8, {0.0, 0.0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateEpoch(10, 0, 8, {-1.0, 2.0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateEpoch(10, 0, 8, {std::nan(""), 1.0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

WorkerObservation Obs(int64_t samples, double seconds) {
  WorkerObservation o;
  o.samples = samples;
  o.compute_seconds = seconds;
  return o;
}

TEST(ProportionalPolicyTest, SharesFollowComputeSpeed) {
  ProportionalPolicy p;
  // Equal shares, times 8:8:4:2 -> speeds 1:1:2:4.
  const std::vector<double> s = p.NextShares({Obs(100, 8), Obs(100, 8), Obs(100, 4), Obs(100, 2)});
  EXPECT_THAT(s, ElementsAre(::testing::DoubleNear(0.125, 1e-12), ::testing::DoubleNear(0.125, 1e-12),
                             ::testing::DoubleNear(0.25, 1e-12), ::testing::DoubleNear(0.5, 1e-12)));
}

TEST(ProportionalPolicyTest, EqualSpeedsGiveEqualShares) {
  ProportionalPolicy p;
  const std::vector<double> s = p.NextShares({Obs(50, 1), Obs(100, 2), Obs(200, 4)});
  for (double v : s) EXPECT_NEAR(v, 1.0 / 3, 1e-12);
}

TEST(ProportionalPolicyTest, UnmeasuredWorkerGetsTheMeanSpeed) {
  ProportionalPolicy p;
  // Worker 1 processed nothing (zero batch) and worker 2 reported zero time: both get the mean
  // speed of worker 0 and 3 (100/s and 300/s -> 200/s).
  const std::vector<double> s = p.NextShares({Obs(100, 1), Obs(0, 0), Obs(10, 0), Obs(300, 1)});
  EXPECT_NEAR(s[0], 100.0 / 800, 1e-12);
  EXPECT_NEAR(s[1], 200.0 / 800, 1e-12);
  EXPECT_NEAR(s[2], 200.0 / 800, 1e-12);
  EXPECT_NEAR(s[3], 300.0 / 800, 1e-12);
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
  w0.earlier = {{100, 1}};
  WorkerObservation w1 = Obs(100, 1);
  w1.earlier = {{100, 1}};
  EXPECT_THAT(ProportionalPolicy(1).NextShares({w0, w1}),
              ElementsAre(::testing::DoubleNear(2.0 / 3, 1e-12), ::testing::DoubleNear(1.0 / 3, 1e-12)));
  EXPECT_THAT(ProportionalPolicy(2).NextShares({w0, w1}), ElementsAre(0.5, 0.5));
  // A slowdown shows at once whatever the window.
  WorkerObservation slowed = Obs(50, 1);
  slowed.earlier = {{100, 1}};
  EXPECT_NEAR(ProportionalPolicy(2).NextShares({slowed, w1})[0], 1.0 / 3, 1e-12);
  // Older epochs than the window are ignored; unusable ones are skipped.
  WorkerObservation old = Obs(100, 1);
  old.earlier = {{0, 0}, {10, 1}};
  EXPECT_THAT(ProportionalPolicy(2).NextShares({old, w1}), ElementsAre(0.5, 0.5));
  EXPECT_EQ(MakeSharePolicy("dbs", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EqualSplitPolicyTest, IgnoresMeasurements) {
  EqualSplitPolicy p;
  EXPECT_THAT(p.NextShares({Obs(100, 1), Obs(100, 10)}), ElementsAre(0.5, 0.5));
}

TEST(MakeSharePolicyTest, KnowsBothNames) {
  EXPECT_EQ((*MakeSharePolicy("dbs"))->name(), "dbs");
  EXPECT_EQ((*MakeSharePolicy("fixed"))->name(), "fixed");
  EXPECT_EQ(MakeSharePolicy("random").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

// A worker whose step takes `overhead` s plus batch / speed s, observed at two batch sizes.
WorkerObservation Measured(double overhead, double speed, int b_last, int b_before) {
  WorkerObservation o;
  o.steps = 100;
  o.samples = 100 * b_last;
  o.compute_seconds = 100 * (overhead + b_last / speed);
  o.previous_share = 0.5;
  o.earlier = {{100 * b_before, 100 * (overhead + b_before / speed), 100}};
  return o;
}

TEST(CostModelPolicyTest, FitsOverheadAndSpeed) {
  const auto [a, v] = CostModelPolicy::Fit(Measured(0.01, 1000, 32, 16), 3);
  EXPECT_NEAR(a, 0.01, 1e-9);
  EXPECT_NEAR(v, 1000, 1e-6);
  // One batch size only: no separable overhead, speed = samples / compute (proportional rule).
  WorkerObservation once = Measured(0.01, 1000, 32, 32);
  const auto [a1, v1] = CostModelPolicy::Fit(once, 3);
  EXPECT_EQ(a1, 0.0);
  EXPECT_NEAR(v1, 3200 / (100 * (0.01 + 0.032)), 1e-6);
}

TEST(CostModelPolicyTest, BalancesStepTimesWhenOverheadsDiffer) {
  // Equal speeds, worker 1 pays 16 ms more per step: tau = (64 + 1000 * 0.016) / 2000 = 40 ms,
  // b0 = 40, b1 = 24 (proportional batches would give 32 each and worker 1 would be the laggard).
  CostModelPolicy p(64, 0, 0, 3);
  const std::vector<double> s = p.NextShares({Measured(0.0, 1000, 32, 16),
                                              Measured(0.016, 1000, 32, 16)});
  EXPECT_NEAR(s[0], 40.0 / 64, 1e-6);
  EXPECT_NEAR(s[1], 24.0 / 64, 1e-6);
  const double t0 = 0.0 + s[0] * 64 / 1000, t1 = 0.016 + s[1] * 64 / 1000;
  EXPECT_NEAR(t0, t1, 1e-9) << "equal step times";
  // With equal overheads it is the proportional rule.
  const std::vector<double> q = p.NextShares({Measured(0.01, 1000, 32, 16),
                                              Measured(0.01, 3000, 32, 16)});
  EXPECT_NEAR(q[0], 0.25, 1e-6);
}

TEST(CostModelPolicyTest, BoundsAreRespectedByWaterFilling) {
  CostModelPolicy capped(64, 0, 35, 3);
  const std::vector<double> s = capped.NextShares({Measured(0.0, 1000, 32, 16),
                                                   Measured(0.016, 1000, 32, 16)});
  EXPECT_NEAR(s[0] * 64, 35, 1e-6);
  EXPECT_NEAR(s[1] * 64, 29, 1e-6);
  // A minimum keeps a very slow worker in the job.
  CostModelPolicy floor(64, 8, 0, 3);
  const std::vector<double> f = floor.NextShares({Measured(0.0, 10000, 32, 16),
                                                  Measured(0.0, 100, 32, 16)});
  EXPECT_NEAR(f[1] * 64, 8, 1e-6);
  EXPECT_NEAR(f[0] * 64, 56, 1e-6);
}

TEST(SmoothedPolicyTest, EmaAndDeadband) {
  // The inner DBS rule would move to 0.75 / 0.25 (speeds 300 and 100).
  WorkerObservation fast = Obs(300, 1), slow = Obs(100, 1);
  fast.previous_share = slow.previous_share = 0.5;
  SmoothedPolicy ema(std::make_unique<ProportionalPolicy>(), 0.5, 0.0);
  EXPECT_THAT(ema.NextShares({fast, slow}),
              ElementsAre(::testing::DoubleNear(0.625, 1e-12), ::testing::DoubleNear(0.375, 1e-12)));
  // The largest relative move is 0.5 (0.25 against 0.5): inside a 0.6 dead-band nothing moves.
  SmoothedPolicy band(std::make_unique<ProportionalPolicy>(), 1.0, 0.6);
  EXPECT_THAT(band.NextShares({fast, slow}), ElementsAre(0.5, 0.5));
  SmoothedPolicy narrow(std::make_unique<ProportionalPolicy>(), 1.0, 0.4);
  EXPECT_THAT(narrow.NextShares({fast, slow}),
              ElementsAre(::testing::DoubleNear(0.75, 1e-12), ::testing::DoubleNear(0.25, 1e-12)));
}

TEST(MakeSharePolicyTest, ConfigValidation) {
  PolicyConfig c;
  c.name = "cost";
  EXPECT_EQ((*MakeSharePolicy(c))->name(), "cost");
  c.smoothing = 0.0;
  EXPECT_FALSE(MakeSharePolicy(c).ok());
  c.smoothing = 0.5;
  c.min_batch = 10;
  c.max_batch = 5;
  EXPECT_FALSE(MakeSharePolicy(c).ok());
  c.max_batch = 0;
  c.name = "greedy";
  EXPECT_EQ(MakeSharePolicy(c).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

TEST(CostModelPolicyTest, AWorkersOwnMemoryCapIsHonoured) {
  CostModelPolicy p(64, 0, 0, 3);
  WorkerObservation big = Measured(0.0, 3000, 32, 16), small = Measured(0.0, 1000, 32, 16);
  big.max_batch = 40;  // would get 48 of 64 by speed
  const std::vector<double> s = p.NextShares({big, small});
  EXPECT_NEAR(s[0] * 64, 40, 1e-6);
  EXPECT_NEAR(s[1] * 64, 24, 1e-6);
}

}  // namespace
}  // namespace dbs
