#include "server/step_time_model.h"

#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace dbs {
namespace {

TEST(StepTimeModelTest, EmptyAndInvalidPoints) {
  EXPECT_TRUE(StepTimeModel::Fit({}).empty());
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 0.0, 10, 1.0}, {0, 8.0, 0, 1.0}, {0, 8.0, 10, -1.0}});
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.Predict(8), 0.0);
  EXPECT_EQ(m.BatchFor(1.0), 0.0);
  EXPECT_EQ(m.last_change(), -1);
}

TEST(StepTimeModelTest, OnePointIsALineThroughTheOrigin) {
  // 10 steps of 32 samples in 0.64 s: 64 ms per step.
  const StepTimeModel m = StepTimeModel::Fit({{0, 32, 10, 0.64}});
  EXPECT_NEAR(m.Predict(32), 0.064, 1e-12);
  EXPECT_NEAR(m.Predict(16), 0.032, 1e-12);
  EXPECT_NEAR(m.Predict(64), 0.128, 1e-12);
  EXPECT_NEAR(m.BatchFor(0.016), 8, 1e-9);
  EXPECT_EQ(m.Predict(0), 0.0);
}

// The curve's slope just below and just above `b` (seconds per sample): it is linear between
// knots at least a sample apart, so a thousandth of a sample measures it.
double SlopeBelow(const StepTimeModel& m, double b) {
  return (m.Predict(b) - m.Predict(b - 1e-3)) / 1e-3;
}
double SlopeAbove(const StepTimeModel& m, double b) {
  return (m.Predict(b + 1e-3) - m.Predict(b)) / 1e-3;
}

TEST(StepTimeModelTest, InterpolatesAndExtrapolatesWithTheEndSlopes) {
  // 10 ms + 1 ms per sample, measured at 16 and 32.
  const StepTimeModel m = StepTimeModel::Fit({{0, 16, 10, 0.26}, {1, 32, 10, 0.42}});
  EXPECT_NEAR(m.Predict(24), 0.034, 1e-12);
  EXPECT_NEAR(m.Predict(40), 0.050, 1e-12);
  EXPECT_NEAR(m.Predict(8), 0.018, 1e-12);
  EXPECT_NEAR(m.BatchFor(0.050), 40, 1e-9);
  EXPECT_NEAR(m.BatchFor(0.018), 8, 1e-9);
  EXPECT_NEAR(SlopeBelow(m, 32), 0.001, 1e-12);
  EXPECT_NEAR(SlopeAbove(m, 32), 0.001, 1e-12);
  for (double b = 1; b < 100; b += 0.5) EXPECT_NEAR(m.BatchFor(m.Predict(b)), b, 1e-6);
}

TEST(StepTimeModelTest, TimeNeverFallsAsTheBatchGrows) {
  // A noisy point at 24 faster than the one at 16 is pooled with it.
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 16, 10, 0.30}, {1, 24, 10, 0.20}, {2, 32, 10, 0.50}});
  for (size_t k = 1; k < m.knots().size(); ++k) {
    EXPECT_GT(m.knots()[k].first, m.knots()[k - 1].first);
    EXPECT_GT(m.knots()[k].second, m.knots()[k - 1].second);
  }
  EXPECT_LE(m.Predict(16), m.Predict(24));
}

// From a real run (docs/controller.md, "Replaying its decisions"): a slow worker measured over
// windows of 8 steps at 10 and 12 samples (24.0 and 24.2 ms) and over an epoch at 32 (58 ms),
// its steps deviating by 17%. The rise from 10 to 12 is far within noise; read literally it says
// samples cost 0.18 ms there (the slope's floor) against 1.7 ms beyond.
TEST(StepTimeModelTest, ASegmentFlatterThanNoiseIsPooled) {
  const std::vector<StepTimePoint> points = {
      {0, 32, 32, 32 * 0.058}, {1, 10, 8, 8 * 0.0240}, {2, 12, 8, 8 * 0.0242}};
  const StepTimeModel literal = StepTimeModel::Fit(points);
  ASSERT_EQ(literal.knots().size(), 3u);
  // 0.1 ms a sample, raised to the floor: a tenth of the cheapest time per sample (at 32).
  EXPECT_NEAR(SlopeAbove(literal, 10), 0.1 * 0.058 / 32, 1e-12);

  StepTimeModelOptions noisy;
  noisy.relative_noise = 0.17;
  const StepTimeModel pooled = StepTimeModel::Fit(points, noisy);
  ASSERT_EQ(pooled.knots().size(), 2u);
  // Weighted by steps and recency (the window at 10 is one measurement older: half weight).
  const double b = (4 * 10 + 8 * 12) / 12.0, t = (4 * 0.0240 + 8 * 0.0242) / 12;
  EXPECT_NEAR(pooled.knots()[0].first, b, 1e-9);
  EXPECT_NEAR(pooled.knots()[0].second, t, 1e-12);
  EXPECT_NEAR(SlopeAbove(pooled, b), (0.058 - t) / (32 - b), 1e-9);
  // Below the pooled point the end slope continues: taking samples away saves what they cost.
  EXPECT_NEAR(SlopeBelow(pooled, b), SlopeAbove(pooled, b), 1e-12);
}

// A rise far beyond noise is the curve's shape (a quota's knee: one more sample doubles the
// step), never pooled.
TEST(StepTimeModelTest, ARiseBeyondNoiseIsKept) {
  StepTimeModelOptions noisy;
  noisy.relative_noise = 0.10;
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 20, 16, 16 * 0.010}, {1, 21, 16, 16 * 0.020}}, noisy);
  ASSERT_EQ(m.knots().size(), 2u);
  EXPECT_NEAR(m.Predict(20), 0.010, 1e-12);
  EXPECT_NEAR(m.Predict(21), 0.020, 1e-12);
  // 3% over 16 steps each (8 for the older) is within 2 standard errors of their difference
  // (8.7%): pooled.
  EXPECT_EQ(
      StepTimeModel::Fit({{0, 20, 16, 16 * 0.010}, {1, 21, 16, 16 * 0.0103}}, noisy).knots().size(),
      1u);
  // The same rise over 400 steps each is beyond them (1.75%): kept.
  EXPECT_EQ(StepTimeModel::Fit({{0, 20, 400, 400 * 0.010}, {1, 21, 400, 400 * 0.0103}}, noisy)
                .knots()
                .size(),
            2u);
}

TEST(StepTimeModelTest, AChangeOfSpeedMovesTheWholeCurve) {
  // A knee: 1 ms per sample to 20, then 8 ms per sample; then the worker is slowed 3x and
  // measured again at 16.
  const StepTimeModel before = StepTimeModel::Fit({{0, 32, 10, 1.16}, {1, 16, 10, 0.16}});
  const StepTimeModel after =
      StepTimeModel::Fit({{0, 32, 10, 1.16}, {1, 16, 10, 0.16}, {2, 16, 10, 0.48}});
  EXPECT_EQ(before.last_change(), 0);
  EXPECT_EQ(after.last_change(), 2);
  EXPECT_NEAR(after.Predict(16), 0.048, 1e-12);
  EXPECT_NEAR(after.Predict(32), 3 * 0.116, 1e-12) << "the shape is kept";
}

TEST(StepTimeModelTest, SlowerAtASmallerBatchIsAChangeOfSpeedNotAShape) {
  // 1 ms per sample at 32 and 16; then, at 12 (never measured), 36 ms a step: more than 16
  // samples took. No curve does that: the worker was slowed, here 3x.
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 32, 10, 0.32}, {1, 16, 10, 0.16}, {2, 12, 8, 8 * 0.036}});
  EXPECT_EQ(m.last_change(), 2);
  EXPECT_NEAR(m.Predict(12), 0.036, 1e-9);
  EXPECT_NEAR(m.Predict(32), 3 * 0.032, 1e-9) << "the whole curve moved";
  // Faster at a larger batch than at a smaller one: sped up.
  const StepTimeModel faster =
      StepTimeModel::Fit({{0, 16, 10, 0.16}, {1, 8, 10, 0.08}, {2, 24, 8, 8 * 0.006}});
  EXPECT_EQ(faster.last_change(), 2);
  EXPECT_NEAR(faster.Predict(8), 0.002, 1e-9);
}

TEST(StepTimeModelTest, AKneeAboveTheMeasuredRangeIsAShapeNotAChange) {
  // Full speed (1 ms per sample) at 16 and 20; at 32, beyond a quota's knee, 8 ms per sample
  // more: far above the extrapolation, yet no smaller batch was slower, and there was no change
  // before to revert to.
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 16, 10, 0.16}, {1, 20, 10, 0.20}, {2, 32, 10, 10 * 0.116}});
  EXPECT_EQ(m.last_change(), 0);
  EXPECT_NEAR(m.Predict(32), 0.116, 1e-9);
  EXPECT_NEAR(m.Predict(16), 0.016, 1e-9);
}

TEST(StepTimeModelTest, AChangeThatReversesAtANewBatchIsFollowedAtOnce) {
  // 1 ms per sample at 32; slowed 4x (measured at 32), moved to 8, where it is back to full
  // speed (the burst ended): the curve from before the change explains it, the slowed one does
  // not, so the whole curve moves back rather than keeping the slowed points.
  const StepTimeModel m =
      StepTimeModel::Fit({{0, 32, 40, 40 * 0.032}, {1, 32, 8, 8 * 0.128}, {2, 8, 8, 8 * 0.008}});
  EXPECT_EQ(m.last_change(), 2);
  EXPECT_NEAR(m.Predict(8), 0.008, 1e-9);
  EXPECT_NEAR(m.Predict(32), 0.032, 1e-9);
  // Without the change before, the same point at a new, smaller batch is only a shape.
  const StepTimeModel shape = StepTimeModel::Fit({{0, 32, 40, 40 * 0.128}, {1, 8, 8, 8 * 0.008}});
  EXPECT_EQ(shape.last_change(), 0);
  EXPECT_NEAR(shape.Predict(32), 0.128, 1e-9);
}

TEST(StepTimeModelTest, SmallDeviationsMoveTheLevelByTheirShareOfTheEvidence) {
  // 5% slower at 16 in a measurement as long as the first: the level moves about halfway
  // (the first counts half as much for being older).
  const StepTimeModel m = StepTimeModel::Fit({{0, 16, 10, 0.16}, {1, 16, 10, 0.168}});
  EXPECT_EQ(m.last_change(), 0) << "not a change of speed";
  EXPECT_GT(m.Predict(16), 0.0160);
  EXPECT_LT(m.Predict(16), 0.0168);
  // A short window of 2 steps moves it much less than a long one of 100.
  const double short_window =
      StepTimeModel::Fit({{0, 16, 100, 1.6}, {1, 16, 2, 0.0336}}).Predict(16);
  const double long_window =
      StepTimeModel::Fit({{0, 16, 100, 1.6}, {1, 16, 100, 1.68}}).Predict(16);
  EXPECT_LT(short_window - 0.016, 0.2 * (long_window - 0.016));
}

TEST(StepTimeModelTest, FromKnotsSortsAndKeepsTheCurveIncreasing) {
  const StepTimeModel m = StepTimeModel::FromKnots({{32, 0.032}, {16, 0.040}});
  ASSERT_EQ(m.knots().size(), 2u);
  EXPECT_EQ(m.knots()[0].first, 16);
  EXPECT_GT(m.knots()[1].second, m.knots()[0].second);
}

}  // namespace
}  // namespace dbs
