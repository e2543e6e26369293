#include "server/optimizer.h"

#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;

TEST(SgdTest, PlainStep) {
  SgdOptimizer opt({/*lr=*/0.1, /*momentum=*/0.0, /*weight_decay=*/0.0, false});
  std::vector<float> p = {1.0f, -2.0f};
  opt.Step(absl::MakeSpan(p), std::vector<float>{0.5f, -1.0f});
  EXPECT_THAT(p, ElementsAre(FloatNear(0.95f, 1e-7), FloatNear(-1.9f, 1e-7)));
}

TEST(SgdTest, MomentumAndWeightDecayByHand) {
  // p0 = 1, lr 0.1, mu 0.9, wd 0.01, g = 0.5 at both steps.
  // step 1: d = 0.5 + 0.01 * 1 = 0.51; buf = 0.51; p = 1 - 0.051 = 0.949
  // step 2: d = 0.5 + 0.00949 = 0.50949; buf = 0.9 * 0.51 + 0.50949 = 0.96849;
  //         p = 0.949 - 0.096849 = 0.852151
  SgdOptimizer opt({0.1, 0.9, 0.01, false});
  std::vector<float> p = {1.0f};
  opt.Step(absl::MakeSpan(p), std::vector<float>{0.5f});
  EXPECT_NEAR(p[0], 0.949f, 1e-6);
  opt.Step(absl::MakeSpan(p), std::vector<float>{0.5f});
  EXPECT_NEAR(p[0], 0.852151f, 1e-6);
}

TEST(SgdTest, NesterovByHand) {
  // step 1: buf = g = 1; update = g + mu * buf = 1.9; p = 0 - 0.19
  SgdOptimizer opt({0.1, 0.9, 0.0, true});
  std::vector<float> p = {0.0f};
  opt.Step(absl::MakeSpan(p), std::vector<float>{1.0f});
  EXPECT_NEAR(p[0], -0.19f, 1e-7);
}

TEST(AdamTest, FirstTwoStepsByHand) {
  // With bias correction the first step moves each parameter by lr * sign(g) (up to eps).
  AdamOptimizer opt({/*lr=*/0.01, 0.9, 0.999, 1e-8, 0.0});
  std::vector<float> p = {1.0f, 1.0f};
  opt.Step(absl::MakeSpan(p), std::vector<float>{0.3f, -2.0f});
  EXPECT_NEAR(p[0], 0.99f, 1e-6);
  EXPECT_NEAR(p[1], 1.01f, 1e-6);
  // step 2 with g = 0.1 on parameter 0: m = 0.9*0.03 + 0.1*0.1 = 0.037; v = 0.999*0.00009 +
  // 0.001*0.01 = 0.00009991; m_hat = 0.037/0.19 = 0.194737; v_hat = 0.00009991/0.001999 =
  // 0.04998; update = 0.01 * 0.194737 / 0.223562 = 0.0087106
  opt.Step(absl::MakeSpan(p), std::vector<float>{0.1f, 0.0f});
  EXPECT_NEAR(p[0], 0.99f - 0.0087106f, 2e-6);
}

TEST(MakeOptimizerTest, ValidatesNamesAndRanges) {
  OptimizerConfig c;
  EXPECT_THAT(MakeOptimizer(c), IsOk());
  c.name = "adam";
  EXPECT_THAT(MakeOptimizer(c), IsOk());
  c.name = "lamb";
  EXPECT_THAT(MakeOptimizer(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c.name = "sgd";
  c.sgd.lr = -1;
  EXPECT_THAT(MakeOptimizer(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c.sgd.lr = 0.1;
  c.sgd.momentum = 1.0;
  EXPECT_THAT(MakeOptimizer(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c.sgd.momentum = 0.0;
  c.sgd.nesterov = true;
  EXPECT_THAT(MakeOptimizer(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dbs
