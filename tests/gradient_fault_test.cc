#include "worker/gradient_fault.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

TEST(GradientFaultTest, SpecsParseAndBadOnesSayWhatIsExpected) {
  EXPECT_EQ(GradientFault::Parse("")->kind, GradientFault::Kind::kNone);
  EXPECT_EQ(GradientFault::Parse("none")->kind, GradientFault::Kind::kNone);
  absl::StatusOr<GradientFault> scale = GradientFault::Parse("scale:-1000@50");
  ASSERT_THAT(scale, IsOk());
  EXPECT_EQ(scale->kind, GradientFault::Kind::kScale);
  EXPECT_EQ(scale->factor, -1000.0);
  EXPECT_EQ(scale->from_step, 50);
  EXPECT_EQ(GradientFault::Parse("nan@0")->kind, GradientFault::Kind::kNaN);
  EXPECT_EQ(GradientFault::Parse("sign@3")->kind, GradientFault::Kind::kSign);
  EXPECT_EQ(GradientFault::Parse("bitflip@3")->kind, GradientFault::Kind::kBitFlip);
  for (const char* bad : {"nan", "nan@", "nan@-1", "scale@5", "scale:x@5", "rot@5", "sign:2@5"}) {
    EXPECT_THAT(GradientFault::Parse(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 'nan@N'")))
        << bad;
  }
}

TEST(GradientFaultTest, EachKindCorruptsFromItsStepOn) {
  const std::vector<float> clean = {1.0f, -2.0f, 0.5f, 0.0f};
  auto applied = [&](const char* spec, int64_t step) {
    std::vector<float> g = clean;
    GradientFault::Parse(spec)->Apply(step, absl::MakeSpan(g));
    return g;
  };
  EXPECT_EQ(applied("scale:10@5", 4), clean) << "before its step: untouched";
  EXPECT_EQ(applied("scale:10@5", 5), (std::vector<float>{10.0f, -20.0f, 5.0f, 0.0f}));
  EXPECT_EQ(applied("sign@0", 9), (std::vector<float>{-1.0f, 2.0f, -0.5f, -0.0f}));
  for (float v : applied("nan@0", 0)) EXPECT_TRUE(std::isnan(v));
  // One bit of one value here (at least one flip), the same for the same step.
  const std::vector<float> flipped = applied("bitflip@0", 7);
  EXPECT_EQ(flipped, applied("bitflip@0", 7));
  int differing_bits = 0;
  for (size_t i = 0; i < clean.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &clean[i], 4);
    std::memcpy(&b, &flipped[i], 4);
    differing_bits += __builtin_popcount(a ^ b);
  }
  EXPECT_EQ(differing_bits, 1);
  // About one value in a thousand of a larger gradient.
  std::vector<float> big(100000, 1.0f);
  GradientFault::Parse("bitflip@0")->Apply(1, absl::MakeSpan(big));
  int changed = 0;
  for (float v : big) changed += v == 1.0f ? 0 : 1;
  EXPECT_GE(changed, 90);
  EXPECT_LE(changed, 100);
}

}  // namespace
}  // namespace dbs
