#include "server/worker_table.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

WorkerRegistration From(const std::string& name, const std::string& source) {
  WorkerRegistration r{name, 100, 10, "cpu"};
  r.source = source;
  return r;
}

TEST(WorkerTableTest, IdsTokensAndCallsFollowTheTable) {
  int next = 0;
  WorkerTable table([&next] { return "t" + std::to_string(next++); });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(table.Add(From("a", "h1"), t0), 0);
  EXPECT_EQ(table.Add(From("b", "h1"), t0), 1);
  EXPECT_EQ(table.Find("b"), 1);
  EXPECT_EQ(table.Find("c"), -1);
  EXPECT_THAT(table.Authenticate(1, "t1", "", t0), IsOk());
  EXPECT_THAT(table.Authenticate(1, "t0", "", t0),
              StatusCodeIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(table.Authenticate(1, "", "", t0), StatusCodeIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(table.Authenticate(2, "t1", "", t0), StatusCodeIs(absl::StatusCode::kNotFound));

  // One source holds at most its limit; a worker that leaves gives its place back.
  EXPECT_THAT(table.RoomFor("h1", 2), StatusCodeIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(table.RoomFor("h2", 2), IsOk());
  EXPECT_TRUE(table.Leave(0));
  EXPECT_FALSE(table.Leave(0)) << "once";
  EXPECT_THAT(table.RoomFor("h1", 2), IsOk());
  EXPECT_EQ(table.Find("a"), -1);
  EXPECT_EQ(table.Active(), 1);
}

TEST(WorkerTableTest, IdleRegistrationsExpireUnlessKept) {
  WorkerTable table;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  table.Add(From("idle", "h"), t0);
  table.Add(From("kept", "h"), t0);
  table.Add(From("calling", "h"), t0);
  table.Touch(2, t0 + absl::Seconds(50));
  auto keep = [](int id) { return id == 1; };
  EXPECT_TRUE(table.ExpireIdle(t0 + absl::Seconds(59), absl::Seconds(60), keep).empty());
  EXPECT_THAT(table.ExpireIdle(t0 + absl::Seconds(61), absl::Seconds(60), keep),
              ElementsAre(Pair(0, absl::Seconds(61))));
  EXPECT_FALSE(table.InJob(0));
  EXPECT_TRUE(table.InJob(1));
  EXPECT_TRUE(table.InJob(2));
}

// Removed for silence (not by its own Leave): away until it asks again, by name.
TEST(WorkerTableTest, RemovedWorkersCountUntilTheyAskAgain) {
  WorkerTable table;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  table.Add(From("a", "h"), t0);
  table.Add(From("b", "h"), t0);
  table.Leave(1);
  table.MarkRemoved(0);
  table.MarkRemoved(1);
  EXPECT_EQ(table.RemovedNotBack(), 1) << "b left by its own call";
  table.NoteAskedAfterEnd("b");
  EXPECT_EQ(table.RemovedNotBack(), 1);
  table.NoteAskedAfterEnd("a");
  EXPECT_EQ(table.RemovedNotBack(), 0);
}

TEST(WorkerTableTest, ARestoredTableKeepsItsTokensAndGivesMissingOnesNew) {
  WorkerTable table([] { return std::string("fresh"); });
  table.Load({From("a", "h"), From("b", "h")}, {false, true}, {"kept"}, absl::UnixEpoch());
  EXPECT_EQ(table.token(0), "kept");
  EXPECT_EQ(table.token(1), "fresh");
  EXPECT_TRUE(table.InJob(0));
  EXPECT_FALSE(table.InJob(1));
}

}  // namespace
}  // namespace dbs
