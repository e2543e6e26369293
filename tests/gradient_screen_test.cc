#include "server/gradient_screen.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

TEST(GradientScreenTest, ModesParseAndUnknownOnesAreRefused) {
  EXPECT_EQ(*ParseFaultyGradients("evict"), FaultyGradients::kEvict);
  EXPECT_EQ(*ParseFaultyGradients("log"), FaultyGradients::kLog);
  EXPECT_EQ(*ParseFaultyGradients("off"), FaultyGradients::kOff);
  EXPECT_THAT(ParseFaultyGradients("quarantine"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'evict', 'log' or 'off'")));
  EXPECT_STREQ(FaultyGradientsName(FaultyGradients::kLog), "log");
}

TEST(GradientScreenTest, ANormFarAboveTheRecentMedianIsAnOutlier) {
  GradientScreen screen;  // ratio 10, at least 8 norms
  // The job's first pushes pass whatever their norm, but for a NaN or infinite one.
  EXPECT_THAT(screen.Judge({1e6, 8}), IsOk());
  EXPECT_THAT(screen.Judge({std::numeric_limits<double>::infinity(), 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  EXPECT_THAT(screen.Judge({std::nan(""), 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  // Honest norms spread by noise (a factor of 3 here), all over 8 samples: median 2.2.
  for (double n : {1.0, 2.0, 3.0, 1.5, 2.5, 1.2, 2.2, 2.8}) screen.Accepted({n, 8});
  EXPECT_THAT(screen.Judge({3.0 * 2.2, 8}), IsOk());
  EXPECT_THAT(screen.Judge({10.0 * 2.2, 8}), IsOk()) << "at the ratio: passes";
  EXPECT_THAT(screen.Judge({1000.0 * 2.2, 8}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("1000 times the median 2.2 of the last 8 accepted pushes")));
  EXPECT_THAT(screen.Judge({0.0, 8}), IsOk()) << "a small gradient is not screened";
  EXPECT_THAT(screen.Judge({std::nan(""), 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NaN")));
}

TEST(GradientScreenTest, AMeanOverFewerSamplesMayBeLarger) {
  // The median push is over 64 samples; one over 1 sample may be 64 times larger (one hard
  // sample's gradient against a mean it dominated), over 16 samples 4 times.
  const std::vector<PushNorm> reference = {{1.0, 64}, {1.0, 64}, {1.0, 32}};
  EXPECT_THAT(JudgeNorm({600.0, 1}, reference, 10.0, "x"), IsOk());
  EXPECT_THAT(JudgeNorm({700.0, 1}, reference, 10.0, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allowed: 640 times")));
  EXPECT_THAT(JudgeNorm({39.0, 16}, reference, 10.0, "x"), IsOk());
  EXPECT_THAT(JudgeNorm({41.0, 16}, reference, 10.0, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allowed: 40 times")));
  // A push over more samples than the median gets no more room than the ratio.
  EXPECT_THAT(JudgeNorm({11.0, 256}, reference, 10.0, "the others"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of the others")));
}

// The grid's B64 1:1:1:8 cell: DBS gives the fast worker 59 of 64 samples and the three others
// 1-3 (or none). Most pushes are single samples, mostly easy ones (norm near 0); a hard sample's
// gradient alone is 15 times their median. The reference is the pushes that hold most of the
// samples: the hard sample passes, and a corrupted push of either size does not. (Judged by the
// median of the pushes, unweighted, the hard sample was quarantined, then every worker that its
// re-planned samples went to, until no worker was left.)
TEST(GradientScreenTest, TheMediansWeighEachPushByItsSamples) {
  std::vector<PushNorm> reference;
  for (int step = 0; step < 16; ++step) {
    reference.push_back({0.2, 1});
    reference.push_back({0.4, 1});
    reference.push_back({2.0, 1});
    reference.push_back({1.679, 59});
  }
  EXPECT_THAT(JudgeNorm({26.14, 1}, reference, 10.0, "x"), IsOk());
  EXPECT_THAT(JudgeNorm({1000.0 * 26.14, 1}, reference, 10.0, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the median 1.679 of x")));
  EXPECT_THAT(JudgeNorm({1000.0 * 1.679, 59}, reference, 10.0, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(allowed: 10 times)")));
  // Pushes without samples (a worker the controller took to none) weigh nothing.
  reference.assign(40, {0.0, 0});
  reference.push_back({2.0, 8});
  EXPECT_THAT(JudgeNorm({19.0, 8}, reference, 10.0, "x"), IsOk());
  EXPECT_THAT(JudgeNorm({21.0, 8}, reference, 10.0, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the median 2 of x")));
}

TEST(GradientScreenTest, AFewOutliersInTheHistoryDoNotMoveTheMedianAndOldNormsAge) {
  ScreenConfig c;
  c.history = 10;
  c.min_history = 4;
  GradientScreen screen(c);
  for (int i = 0; i < 7; ++i) screen.Accepted({1.0, 4});
  screen.Accepted({1e9, 4});  // log-only mode sums an outlier; it stays a minority of the history
  screen.Accepted({1e9, 4});
  EXPECT_THAT(screen.Judge({50.0, 4}), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("the median 1 of the last 9")));
  // The gradients shrink as the job trains: the median follows the last `history` norms.
  for (int i = 0; i < 10; ++i) screen.Accepted({0.01, 4});
  EXPECT_THAT(screen.Judge({1.0, 4}), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("the median 0.01 of the last 10")));
  screen.Accepted({std::numeric_limits<double>::infinity(), 4});  // not kept
  EXPECT_THAT(screen.Judge({0.05, 4}), IsOk());
}

TEST(GradientScreenTest, OffJudgesNothing) {
  ScreenConfig c;
  c.mode = FaultyGradients::kOff;
  GradientScreen screen(c);
  for (int i = 0; i < 10; ++i) screen.Accepted({1.0, 1});
  EXPECT_THAT(screen.Judge({1e12, 1}), IsOk());
  EXPECT_THAT(screen.Judge({std::nan(""), 1}), IsOk());
}

}  // namespace
}  // namespace dbs
