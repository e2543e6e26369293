#include "server/liveness_monitor.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class LivenessMonitorTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  LivenessMonitor monitor_{{absl::Seconds(30), absl::Seconds(10)}, &clock_};
};

TEST_F(LivenessMonitorTest, WaitingForTheFirstWorkerIsNotAStall) {
  EXPECT_FALSE(monitor_.Stalled(0, false));
  clock_.Advance(absl::Hours(1));
  EXPECT_FALSE(monitor_.Stalled(0, false));
}

// Fewer than --workers registrations are a stall, not a wait forever.
TEST_F(LivenessMonitorTest, WaitingForTheRestOfTheWorkersIsAStall) {
  EXPECT_FALSE(monitor_.Stalled(1, false));
  clock_.Advance(absl::Seconds(20));
  EXPECT_FALSE(monitor_.Stalled(2, false)) << "a second worker registered";
  clock_.Advance(absl::Seconds(29));
  EXPECT_FALSE(monitor_.Stalled(2, false));
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(monitor_.Stalled(2, false));
}

TEST_F(LivenessMonitorTest, NoActivityForTheStallTimeoutIsAStall) {
  EXPECT_FALSE(monitor_.Stalled(5, true));
  clock_.Advance(absl::Seconds(29));
  EXPECT_FALSE(monitor_.Stalled(5, true));
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(monitor_.Stalled(5, true));
}

TEST_F(LivenessMonitorTest, ActivityRestartsTheStallClock) {
  EXPECT_FALSE(monitor_.Stalled(5, true));
  clock_.Advance(absl::Seconds(25));
  EXPECT_FALSE(monitor_.Stalled(6, true));
  clock_.Advance(absl::Seconds(25));
  EXPECT_FALSE(monitor_.Stalled(6, true));  // 25 s since the last activity
  clock_.Advance(absl::Seconds(5));
  EXPECT_TRUE(monitor_.Stalled(6, true));
}

TEST_F(LivenessMonitorTest, WorkersAStepWaitsOnPastTheTimeoutAreOverdue) {
  const StepWait wait{0, 3, 2, {1, 3}};
  EXPECT_THAT(monitor_.Overdue(wait), IsEmpty());  // first seen now
  clock_.Advance(absl::Seconds(9));
  EXPECT_THAT(monitor_.Overdue(wait), IsEmpty());
  clock_.Advance(absl::Seconds(1));
  EXPECT_THAT(monitor_.Overdue(wait), ElementsAre(1, 3));
}

TEST_F(LivenessMonitorTest, ANewStepRestartsTheWorkerClock) {
  EXPECT_THAT(monitor_.Overdue({0, 3, 1, {2}}), IsEmpty());
  clock_.Advance(absl::Seconds(8));
  EXPECT_THAT(monitor_.Overdue({0, 4, 1, {2}}), IsEmpty());  // step 3 completed meanwhile
  clock_.Advance(absl::Seconds(8));
  EXPECT_THAT(monitor_.Overdue({0, 4, 1, {2}}), IsEmpty());
  clock_.Advance(absl::Seconds(2));
  EXPECT_THAT(monitor_.Overdue({0, 4, 1, {2}}), ElementsAre(2));
}

TEST_F(LivenessMonitorTest, AStepNobodyPushedYetWaitsOnNobody) {
  // Before the first push of a step every worker may still be computing its gradient.
  EXPECT_THAT(monitor_.Overdue({0, 3, 0, {0, 1}}), IsEmpty());
  clock_.Advance(absl::Minutes(5));
  EXPECT_THAT(monitor_.Overdue({0, 3, 0, {0, 1}}), IsEmpty());
  // The first push starts the clock.
  EXPECT_THAT(monitor_.Overdue({0, 3, 1, {1}}), IsEmpty());
  clock_.Advance(absl::Seconds(10));
  EXPECT_THAT(monitor_.Overdue({0, 3, 1, {1}}), ElementsAre(1));
}

TEST(LivenessMonitorDisabledTest, ZeroTimeoutsNeverFire) {
  FakeClock clock;
  LivenessMonitor monitor({absl::ZeroDuration(), absl::ZeroDuration()}, &clock);
  EXPECT_FALSE(monitor.Stalled(1, true));
  EXPECT_THAT(monitor.Overdue({0, 0, 1, {1}}), IsEmpty());
  clock.Advance(absl::Hours(10));
  EXPECT_FALSE(monitor.Stalled(1, true));
  EXPECT_THAT(monitor.Overdue({0, 0, 1, {1}}), IsEmpty());
}

}  // namespace
}  // namespace dbs
