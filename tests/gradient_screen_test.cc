#include "server/gradient_screen.h"

#include <cmath>
#include <limits>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  EXPECT_THAT(screen.Judge(1e6), IsOk());
  EXPECT_THAT(screen.Judge(std::numeric_limits<double>::infinity()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("infinite")));
  EXPECT_THAT(screen.Judge(std::nan("")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NaN")));
  // Honest norms spread by batch size and noise (a factor of 3 here).
  for (double n : {1.0, 2.0, 3.0, 1.5, 2.5, 1.2, 2.2, 2.8}) screen.Accepted(n);
  EXPECT_DOUBLE_EQ(screen.Median(), 2.2);
  EXPECT_THAT(screen.Judge(3.0 * 2.2), IsOk());
  EXPECT_THAT(screen.Judge(10.0 * 2.2), IsOk()) << "at the ratio: passes";
  EXPECT_THAT(screen.Judge(1000.0 * 2.2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1000 times the median")));
  EXPECT_THAT(screen.Judge(0.0), IsOk()) << "a small gradient is not screened";
}

TEST(GradientScreenTest, AFewOutliersInTheHistoryDoNotMoveTheMedianAndOldNormsAge) {
  ScreenConfig c;
  c.history = 10;
  c.min_history = 4;
  GradientScreen screen(c);
  for (int i = 0; i < 7; ++i) screen.Accepted(1.0);
  screen.Accepted(1e9);  // log-only mode sums an outlier; it stays a minority of the history
  screen.Accepted(1e9);
  EXPECT_DOUBLE_EQ(screen.Median(), 1.0);
  EXPECT_THAT(screen.Judge(50.0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  // The gradients shrink as the job trains: the median follows the last `history` norms.
  for (int i = 0; i < 10; ++i) screen.Accepted(0.01);
  EXPECT_DOUBLE_EQ(screen.Median(), 0.01);
  EXPECT_THAT(screen.Judge(1.0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  screen.Accepted(std::numeric_limits<double>::infinity());  // not kept
  EXPECT_DOUBLE_EQ(screen.Median(), 0.01);
}

TEST(GradientScreenTest, OffJudgesNothing) {
  ScreenConfig c;
  c.mode = FaultyGradients::kOff;
  GradientScreen screen(c);
  for (int i = 0; i < 10; ++i) screen.Accepted(1.0);
  EXPECT_THAT(screen.Judge(1e12), IsOk());
  EXPECT_THAT(screen.Judge(std::nan("")), IsOk());
}

}  // namespace
}  // namespace dbs
