// ShardLog (the leader's side of a sharded job) and ShardFollower (a follower's), in process:
// the follower's step barrier expects what the leader's log says, when the log says it.
#include "server/shard_events.h"

#include <optional>
#include <thread>
#include <vector>

#include "common/status_matchers.h"
#include "tests/push_outcome.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

TEST(ShardLogTest, FollowersJoinOnceWithTheLeadersSettingsBeforeWorkersRegister) {
  ShardLog log(3, {{"lr", "0.05"}});
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("1, 2 of 3")));
  EXPECT_THAT(log.Join(1, 2, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs 3 shards")));
  EXPECT_THAT(log.Join(0, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot follow")));
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.1"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lr 0.1 (leader: 0.05)")));
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.05"}}), IsOk());
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("following already")));
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shard(s) 2 of")));
  EXPECT_THAT(log.Join(2, 3, {{"lr", "0.05"}}), IsOk());
  EXPECT_THAT(log.Admit(), IsOk());

  // Reading: an event that exists comes at once; otherwise the wake-up comes with the next.
  ShardEventData e;
  int woken = 0;
  EXPECT_FALSE(log.Next(1, 0, &e, [&] { ++woken; }));
  ShardEventData worker;
  worker.kind = ShardEventData::Kind::kWorker;
  worker.worker_id = 0;
  worker.token = "t0";
  log.Append(worker);
  EXPECT_EQ(woken, 1);
  ASSERT_TRUE(log.Next(1, 0, &e, [] {}));
  EXPECT_EQ(e.token, "t0");
  // Once workers have registered, a shard that left cannot come back.
  log.Part(2);
  EXPECT_THAT(log.Join(2, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("too late")));
}

class ShardFollowerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_unique<ParameterStore>(
        std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
    ASSERT_THAT(store_->Register({{"w", {2}}}, std::vector<float>{0.0f, 0.0f}), IsOk());
    agg_ = std::make_unique<StepAggregator>(store_.get());
    follower_ = std::make_unique<ShardFollower>(agg_.get(), absl::Milliseconds(200));
    for (int id = 0; id < 3; ++id) {
      ShardEventData w;
      w.kind = ShardEventData::Kind::kWorker;
      w.worker_id = id;
      w.token = "token" + std::to_string(id);
      follower_->Apply(w);
    }
    ShardEventData epoch;
    epoch.kind = ShardEventData::Kind::kEpoch;
    epoch.epoch = 0;
    epoch.quotas = {{{0, 2}, {1, 2}, {2, 2}}, {{0, 2}, {1, 2}, {2, 2}}, {{0, 2}, {1, 2}, {2, 2}}};
    follower_->Apply(epoch);
  }

  GradientPush Push(int worker, int step, int n) {
    GradientPush p;
    p.worker_id = worker;
    p.epoch = 0;
    p.step = step;
    p.num_samples = n;
    p.gradient = std::vector<float>{1.0f, 1.0f};
    return p;
  }

  static ShardEventData Step(int step) {
    ShardEventData e;
    e.kind = ShardEventData::Kind::kStep;
    e.epoch = 0;
    e.step = step;
    return e;
  }

  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<StepAggregator> agg_;
  std::unique_ptr<ShardFollower> follower_;
};

TEST_F(ShardFollowerTest, APushWaitsUntilTheLeaderHasCompletedThePreviousStep) {
  EXPECT_THAT(follower_->Gate(0, 0), IsOk());
  // Step 1 before the leader logged step 0: it waits, and without the log it gives up.
  EXPECT_THAT(follower_->Gate(0, 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("has not heard from the leader")));
  // The next epoch waits too; anything further ahead is left to the barrier to refuse.
  EXPECT_THAT(follower_->Gate(1, 0), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(follower_->Gate(0, 2), IsOk());
  EXPECT_THAT(follower_->Gate(5, 0), IsOk());
  absl::Status waited;
  std::thread pusher([&] { waited = follower_->Gate(0, 1); });
  absl::SleepFor(absl::Milliseconds(20));
  follower_->Apply(Step(0));
  pusher.join();
  EXPECT_THAT(waited, IsOk());
}

TEST_F(ShardFollowerTest, TheLeadersRePlanChangesTheNextStepsSamples) {
  std::vector<Outcome> out(3);
  for (int id = 0; id < 3; ++id) agg_->Push(Push(id, 0, 2), out[id].callback());
  ASSERT_TRUE(out[0].result.has_value());
  ShardEventData replan = Step(0);
  replan.changed = true;
  replan.quotas = {{{0, 4}, {1, 1}, {2, 1}}, {{0, 4}, {1, 1}, {2, 1}}};
  follower_->Apply(replan);
  Outcome stale;
  agg_->Push(Push(1, 1, 2), stale.callback());  // the old plan's batch
  ASSERT_TRUE(stale.result.has_value());
  EXPECT_THAT(stale.result->status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("its plan says 1")));
  std::vector<Outcome> next(3);
  agg_->Push(Push(0, 1, 4), next[0].callback());
  agg_->Push(Push(1, 1, 1), next[1].callback());
  agg_->Push(Push(2, 1, 1), next[2].callback());
  ASSERT_TRUE(next[2].result.has_value());
  ASSERT_THAT(next[2].result->status(), IsOk());
  EXPECT_EQ((*next[2].result)->global_samples, 6);
  EXPECT_EQ(agg_->Progress().num_steps, 3);
}

TEST_F(ShardFollowerTest, WorkersTheLeaderEvictedAreEvictedHereToo) {
  std::vector<Outcome> out(3);
  agg_->Push(Push(0, 0, 2), out[0].callback());
  agg_->Push(Push(1, 0, 2), out[1].callback());  // worker 2 never pushes: the leader evicts it
  ShardEventData evict = Step(0);
  evict.dead = {2};
  evict.changed = true;
  evict.quotas = {{{0, 3}, {1, 3}}, {{0, 3}, {1, 3}}};
  follower_->Apply(evict);
  ASSERT_TRUE(out[0].result.has_value());
  ASSERT_THAT(out[0].result->status(), IsOk());
  EXPECT_EQ((*out[0].result)->global_samples, 4);
  Outcome late;
  agg_->Push(Push(2, 1, 2), late.callback());
  ASSERT_TRUE(late.result.has_value());
  EXPECT_FALSE(late.result->ok());
  EXPECT_EQ(agg_->Progress().waiting_for, (std::vector<int>{0, 1}));
}

TEST_F(ShardFollowerTest, AnEvictedWorkerWhosePushArrivedHereStaysInThisStep) {
  std::vector<Outcome> out(3);
  agg_->Push(Push(0, 0, 2), out[0].callback());
  agg_->Push(Push(2, 0, 2), out[2].callback());  // reached this shard, not the leader
  ShardEventData evict = Step(0);
  evict.dead = {2};
  evict.changed = true;
  evict.quotas = {{{0, 3}, {1, 3}}, {{0, 3}, {1, 3}}};
  follower_->Apply(evict);
  EXPECT_FALSE(out[0].result.has_value());  // worker 1 has not pushed yet: the step waits
  agg_->Push(Push(1, 0, 2), out[1].callback());
  ASSERT_TRUE(out[1].result.has_value());
  EXPECT_EQ((*out[1].result)->global_samples, 6);
  EXPECT_EQ(agg_->Progress().waiting_for, (std::vector<int>{0, 1}));  // step 1: the survivors
}

TEST_F(ShardFollowerTest, TokensAreTheLeadersAndTheEndReleasesEveryone) {
  EXPECT_THAT(follower_->Authenticate(1, "token1"), IsOk());
  EXPECT_THAT(follower_->Authenticate(1, "token0"),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(follower_->Authenticate(1, ""),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  EXPECT_THAT(follower_->Authenticate(7, "token7"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_FALSE(follower_->WaitFor(absl::Milliseconds(1)));
  Outcome waiting;
  agg_->Push(Push(0, 0, 2), waiting.callback());
  ShardEventData end;
  end.kind = ShardEventData::Kind::kEnd;
  end.status = absl::DeadlineExceededError("stalled");
  follower_->Apply(end);
  ASSERT_TRUE(waiting.result.has_value());
  EXPECT_THAT(waiting.result->status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_THAT(follower_->Wait(), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
}

}  // namespace
}  // namespace dbs
