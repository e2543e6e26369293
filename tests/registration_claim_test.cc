// RegistrationClaim: one worker at a time sends the model's initial values; a holder that
// shows no sign of life for the lease loses its turn.
#include "server/registration_claim.h"

#include "common/clock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

TEST(RegistrationClaimTest, TheFirstToAskSendsAndTheOthersAreToldWho) {
  FakeClock clock;
  RegistrationClaim claim(&clock, absl::Seconds(10));
  int holder = -1;
  EXPECT_TRUE(claim.Take(3, &holder));
  EXPECT_EQ(holder, 3);
  EXPECT_FALSE(claim.Take(1, &holder));
  EXPECT_EQ(holder, 3);
  EXPECT_TRUE(claim.Take(3, &holder)) << "asking again keeps the turn";
  claim.Release(1);  // not the holder: nothing
  EXPECT_FALSE(claim.Take(1, &holder));
  claim.Release(3);
  EXPECT_TRUE(claim.Take(1, &holder));
  EXPECT_EQ(holder, 1);
}

TEST(RegistrationClaimTest, AHolderThatShowsNoSignOfLifeLosesItsTurn) {
  FakeClock clock;
  RegistrationClaim claim(&clock, absl::Seconds(10));
  int holder = -1;
  ASSERT_TRUE(claim.Take(0, &holder));
  // Chunks of its values keep arriving: the lease runs anew with each.
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Seconds(8));
    claim.Renew(0);
    claim.Renew(2);  // not the holder: renews nothing
    EXPECT_FALSE(claim.Take(2, &holder)) << "after " << 8 * (i + 1) << " s";
    EXPECT_EQ(holder, 0);
  }
  // Then silence for a whole lease: the next to ask takes over.
  clock.Advance(absl::Seconds(9));
  EXPECT_FALSE(claim.Take(2, &holder));
  clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(claim.Take(2, &holder));
  EXPECT_EQ(holder, 2);
  EXPECT_FALSE(claim.Take(0, &holder)) << "the old holder waits like anyone else";
  EXPECT_EQ(holder, 2);
  claim.Release(0);  // its stream ends late: the new holder keeps the turn
  EXPECT_FALSE(claim.Take(1, &holder));
  EXPECT_EQ(holder, 2);
}

// A holder that only asks again (sending nothing) cannot keep the others waiting: its lease
// runs from when it took the claim, and once it ran out it sits a lease out.
TEST(RegistrationClaimTest, AskingAgainDoesNotHoldTheClaim) {
  FakeClock clock;
  RegistrationClaim claim(&clock, absl::Seconds(10));
  int holder = -1;
  ASSERT_TRUE(claim.Take(0, &holder));
  for (int i = 0; i < 9; ++i) {
    clock.Advance(absl::Seconds(1));
    EXPECT_TRUE(claim.Take(0, &holder)) << "it still holds it";
    EXPECT_FALSE(claim.Take(1, &holder));
  }
  clock.Advance(absl::Seconds(1));
  EXPECT_FALSE(claim.Take(0, &holder)) << "its lease ran out; it may not take it back at once";
  EXPECT_EQ(holder, -1);
  EXPECT_TRUE(claim.Take(1, &holder)) << "10 s after the first take, not later";
  claim.Release(1);
  EXPECT_FALSE(claim.Take(0, &holder)) << "still sitting its lease out";
  clock.Advance(absl::Seconds(10));
  EXPECT_TRUE(claim.Take(0, &holder)) << "alone, it may try again after a lease";
}

}  // namespace
}  // namespace dbs
