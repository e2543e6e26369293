#include "server/replan_window.h"

#include <cmath>
#include <map>
#include <utility>

#include "gtest/gtest.h"

namespace dbs {
namespace {

using Step = std::map<int, std::pair<int64_t, double>>;

TEST(ReplanWindowTest, FiresWhenTheWindowIsFullAndOffBalance) {
  ReplanWindow w(3, 1.5);
  EXPECT_FALSE(w.Add(0, {{0, {10, 0.010}}, {1, {10, 0.020}}}).has_value());
  EXPECT_FALSE(w.Add(0, {{0, {10, 0.010}}, {1, {10, 0.020}}}).has_value()) << "not full yet";
  std::optional<ReplanTrigger> t = w.Add(0, {{0, {10, 0.010}}, {1, {10, 0.020}}});
  ASSERT_TRUE(t.has_value());
  // The fastest counts with one more sample per step: 0.030 x 11/10.
  EXPECT_NEAR(t->imbalance, 0.060 / 0.033, 1e-12);
  const Measurement& slow = t->window.at(1);
  EXPECT_EQ(slow.samples, 30);
  EXPECT_EQ(slow.steps, 3);
  EXPECT_NEAR(slow.compute_seconds, 0.060, 1e-12);
  ASSERT_EQ(slow.by_batch.count(10), 1u);
  EXPECT_EQ(slow.by_batch.at(10).steps, 3);
  // It starts afresh after firing.
  EXPECT_FALSE(w.Add(0, {{0, {10, 0.010}}, {1, {10, 0.020}}}).has_value());
}

TEST(ReplanWindowTest, BalancedStepsAndNewEpochsDoNotFire) {
  ReplanWindow w(2, 1.5);
  EXPECT_FALSE(w.Add(0, {{0, {10, 0.010}}, {1, {20, 0.014}}}).has_value());
  EXPECT_FALSE(w.Add(0, {{0, {10, 0.010}}, {1, {20, 0.014}}}).has_value());
  EXPECT_FALSE(w.Add(1, {{0, {10, 0.010}}, {1, {10, 0.030}}}).has_value()) << "new epoch";
  EXPECT_TRUE(w.Add(1, {{0, {10, 0.010}}, {1, {10, 0.030}}}).has_value());
  ReplanWindow off(0, 1.5);
  EXPECT_FALSE(off.Add(0, {{0, {10, 0.010}}, {1, {10, 1.0}}}).has_value());
}

TEST(ReplanWindowTest, NoiseAloneDoesNotFire) {
  // Worker 1 is 1.4x slower on average over the window (1.27x against worker 0 with one more
  // sample), but its steps scatter so widely that the gap is within two standard errors.
  ReplanWindow w(4, 1.2);
  const double noisy[] = {0.002, 0.032, 0.004, 0.018};
  std::optional<ReplanTrigger> t;
  for (double s : noisy) t = w.Add(0, {{0, {10, 0.010}}, {1, {10, s}}});
  EXPECT_FALSE(t.has_value());
  // The same mean gap, steadily: fires.
  ReplanWindow steady(4, 1.2);
  for (int k = 0; k < 4; ++k) t = steady.Add(0, {{0, {10, 0.010}}, {1, {10, 0.014}}});
  EXPECT_TRUE(t.has_value());
}

TEST(ReplanWindowTest, WorkersWithoutSamplesAreNotTheFastest) {
  // Worker 2 has batch 0: the imbalance is 0.02 / (0.01 x 11/10), not against zero, nor
  // against worker 2's own communication time (which the server's step time holds).
  for (double idle : {0.0, 0.001}) {
    ReplanWindow w(1, 1.5);
    std::optional<ReplanTrigger> t = w.Add(0, {{0, {10, 0.010}}, {1, {10, 0.020}}, {2, {0, idle}}});
    ASSERT_TRUE(t.has_value()) << idle;
    EXPECT_NEAR(t->imbalance, 0.020 / 0.011, 1e-12) << idle;
    EXPECT_TRUE(t->window.at(2).by_batch.empty());
    EXPECT_TRUE(t->idle);
  }
  // Only workers without samples besides the slowest: nothing to re-plan toward, but the
  // window still goes to the policy, which may probe the worker without samples.
  ReplanWindow alone(1, 1.5);
  std::optional<ReplanTrigger> t = alone.Add(0, {{0, {10, 0.010}}, {1, {0, 0.001}}});
  ASSERT_TRUE(t.has_value());
  EXPECT_TRUE(t->idle);
  EXPECT_LT(t->imbalance, 1.5);
  // Every worker with samples and none apart: nothing.
  ReplanWindow busy(1, 1.5);
  EXPECT_FALSE(busy.Add(0, {{0, {10, 0.010}}, {1, {10, 0.011}}}).has_value());
}

TEST(ReplanWindowTest, AWorkerThatOneMoreSampleWouldMakeTheSlowestIsLoaded) {
  // Worker 0 runs 2 samples in 6 ms, worker 1 in 8 ms: 1.33x apart, but a third sample would
  // take worker 0 to 9 ms. Whole samples cannot do better: no re-plan.
  ReplanWindow w(2, 1.15);
  std::optional<ReplanTrigger> t;
  for (int k = 0; k < 2; ++k) t = w.Add(0, {{0, {2, 0.006}}, {1, {20, 0.008}}});
  EXPECT_FALSE(t.has_value());
  // The same times at 20 samples each are a real imbalance (0.008 / 0.0063).
  ReplanWindow big(2, 1.15);
  for (int k = 0; k < 2; ++k) t = big.Add(0, {{0, {20, 0.006}}, {1, {20, 0.008}}});
  ASSERT_TRUE(t.has_value());
  EXPECT_NEAR(t->imbalance, 0.016 / (0.012 * 21 / 20), 1e-12);
}

TEST(ReplanWindowTest, WithANoiseMarginANoisyWorkerCountsAsMoreLoaded) {
  // Worker 0 steady at 1 s; worker 1 alternates 0.8 and 1.6 s (mean 1.2, deviation 0.43).
  // Means alone: 9.6 against 8 s, a gap within two standard errors: no re-plan. With one
  // deviation per step added, worker 1 weighs 9.6 + 3.4 s: re-planned.
  auto run = [](double margin) {
    ReplanWindow w(8, 1.15, margin);
    std::optional<ReplanTrigger> t;
    for (int s = 0; s < 8; ++s) {
      t = w.Add(0, {{0, {10, 1.0}}, {1, {10, s % 2 == 0 ? 0.8 : 1.6}}});
    }
    return t;
  };
  EXPECT_FALSE(run(0.0).has_value());
  std::optional<ReplanTrigger> t = run(1.0);
  ASSERT_TRUE(t.has_value());
  EXPECT_NEAR(t->imbalance, (9.6 + 8 * std::sqrt(1.28 / 7)) / 8.8, 1e-9);
  EXPECT_GT(t->window.at(1).by_batch.at(10).square_seconds, 0.0);
}

}  // namespace
}  // namespace dbs
