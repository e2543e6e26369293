#include "server/optimizer.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

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

// The vectorized loops against torch.optim's formulas written out element by element, and a step
// in uneven ranges against one step: the same bits, over steps with momentum started and not.
std::vector<float> RandomValues(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(*rng);
  v[0] = -0.0f;  // signs of zero must come out the same too
  v[1] = 0.0f;
  return v;
}

TEST(OptimizerBitsTest, SgdMatchesTheFormulaElementByElementAndInRanges) {
  for (const SgdConfig& c : {SgdConfig{0.1, 0.0, 0.01, false}, SgdConfig{0.05, 0.9, 0.001, false},
                             SgdConfig{0.05, 0.9, 0.0, true}}) {
    std::mt19937 rng(7);
    const size_t n = 1003;
    std::vector<float> whole = RandomValues(n, &rng), ranged = whole, reference = whole;
    std::vector<float> momentum(n, 0.0f);
    SgdOptimizer one(c), pieces(c);
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> g = RandomValues(n, &rng);
      one.Step(absl::MakeSpan(whole), g);
      pieces.Begin(n);
      for (size_t a = 0, len = 1; a < n; a += len, len = len * 3 + 1) {
        len = std::min(len, n - a);
        pieces.StepRange(ranged.data() + a, g.data() + a, a, len);
      }
      pieces.End();
      const float lr = c.lr, mu = c.momentum, wd = c.weight_decay;
      for (size_t i = 0; i < n; ++i) {
        const float d = g[i] + wd * reference[i];
        if (mu == 0.0f) {
          reference[i] -= lr * d;
          continue;
        }
        momentum[i] = step == 0 ? d : mu * momentum[i] + d;
        reference[i] -= lr * (c.nesterov ? d + mu * momentum[i] : momentum[i]);
      }
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::signbit(whole[i]), std::signbit(reference[i])) << i;
        ASSERT_EQ(whole[i], reference[i]) << "step " << step << " value " << i;
        ASSERT_EQ(std::signbit(ranged[i]), std::signbit(whole[i])) << i;
        ASSERT_EQ(ranged[i], whole[i]) << "step " << step << " value " << i;
      }
    }
  }
}

TEST(OptimizerBitsTest, AdamInRangesEqualsOneStep) {
  std::mt19937 rng(3);
  const size_t n = 517;
  std::vector<float> whole = RandomValues(n, &rng), ranged = whole;
  AdamOptimizer one({0.01, 0.9, 0.999, 1e-8, 0.01}), pieces({0.01, 0.9, 0.999, 1e-8, 0.01});
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = RandomValues(n, &rng);
    one.Step(absl::MakeSpan(whole), g);
    pieces.Begin(n);
    pieces.StepRange(ranged.data(), g.data(), 0, 100);
    pieces.StepRange(ranged.data() + 100, g.data() + 100, 100, n - 100);
    pieces.End();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(ranged[i], whole[i]) << i;
  }
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
