#include "worker/slowdown_schedule.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

TEST(SlowdownScheduleTest, BaseOnly) {
  auto s = SlowdownSchedule::Create(2.0, "");
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(s->FactorAt(0, 0), 2.0);
  EXPECT_EQ(s->FactorAt(9, 12345), 2.0);
}

TEST(SlowdownScheduleTest, EpochAndStepWindowsMultiply) {
  auto s = SlowdownSchedule::Create(2.0, "e2:4:3; s100:200:1.5");
  ASSERT_THAT(s, IsOk()) << s.status();
  EXPECT_EQ(s->FactorAt(1, 50), 2.0);
  EXPECT_EQ(s->FactorAt(2, 50), 6.0);
  EXPECT_EQ(s->FactorAt(3, 150), 9.0);
  EXPECT_EQ(s->FactorAt(4, 150), 3.0);
  EXPECT_EQ(s->FactorAt(4, 200), 2.0);
  EXPECT_EQ(s->windows().size(), 2u);
}

TEST(SlowdownScheduleTest, RejectsMalformedSpecs) {
  for (const char* bad : {"x1:2:3", "e1:2", "e3:2:2", "e1:2:0.5", "e-1:2:2", "e1:2:abc"}) {
    auto s = SlowdownSchedule::Create(1.0, bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.status().message()), ::testing::HasSubstr("e2:4:3")) << bad;
  }
  EXPECT_FALSE(SlowdownSchedule::Create(0.5, "").ok());
}

}  // namespace
}  // namespace dbs
