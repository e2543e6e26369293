// ShardLog (the leader's side of a sharded job) and ShardFollower (a follower's), in process:
// the follower's step barrier expects what the leader's log says, when the log says it.
#include "server/shard_events.h"

#include <atomic>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/secrets.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/push_outcome.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

ShardEventData WorkerEvent(int id) {
  ShardEventData worker;
  worker.kind = ShardEventData::Kind::kWorker;
  worker.worker_id = id;
  worker.token = absl::StrCat("t", id);
  return worker;
}

TEST(ShardLogTest, FollowersJoinOnceWithTheLeadersSettingsBeforeWorkersRegister) {
  FakeClock clock;
  ShardLog log(3, {{"lr", "0.05"}}, &clock, absl::Seconds(60));
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("1, 2 of 3")));
  EXPECT_THAT(log.Join(1, 2, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs 3 shards")));
  EXPECT_THAT(log.Join(0, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot follow")));
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.1"}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lr 0.1 (leader: 0.05)")));
  const absl::StatusOr<ShardStream> s1 = log.Join(1, 3, {{"lr", "0.05"}});
  ASSERT_THAT(s1, IsOk());
  EXPECT_EQ(s1->from, 0);
  // Retried by the follower: a restarted one may come before its old stream has ended.
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("following already")));
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shard(s) 2 of")));
  const absl::StatusOr<ShardStream> s2 = log.Join(2, 3, {{"lr", "0.05"}});
  ASSERT_THAT(s2, IsOk());
  EXPECT_THAT(log.Admit(), IsOk());
  // Each follower has a key of its own, which vouches for it and for nobody else.
  EXPECT_EQ(s1->key.size(), 32u);
  EXPECT_NE(s1->key, s2->key);
  EXPECT_TRUE(log.Vouches(1, s1->key));
  EXPECT_TRUE(log.Vouches(2, s2->key));
  EXPECT_FALSE(log.Vouches(1, s2->key));
  EXPECT_FALSE(log.Vouches(1, ""));
  EXPECT_FALSE(log.Vouches(3, s1->key));

  // Reading: an event that exists comes at once; otherwise the wake-up comes with the next.
  ShardEventData e;
  int woken = 0;
  EXPECT_FALSE(log.Next(1, s1->id, 0, &e, [&] { ++woken; }));
  log.Append(WorkerEvent(0));
  EXPECT_EQ(woken, 1);
  ASSERT_TRUE(log.Next(1, s1->id, 0, &e, [] {}));
  EXPECT_EQ(e.token, "t0");
  // Once workers have registered, a shard whose stream ends is away: its key no longer
  // vouches for it. Back without its stream, it is a restarted process: it is lost, the leader
  // is told once, and the shard is asked to retry until the leader itself has been restarted.
  std::vector<int> lost;
  log.SetOnLost([&](int shard) { lost.push_back(shard); });
  log.Part(2, s2->id);
  EXPECT_TRUE(lost.empty());
  EXPECT_FALSE(log.Vouches(2, s2->key)) << "a key vouches only while its stream is open";
  EXPECT_THAT(log.Join(2, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("lost a shard")));
  EXPECT_EQ(lost, std::vector<int>{2});
  EXPECT_THAT(log.Join(2, 3, {{"lr", "0.05"}}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("lost a shard")));
  EXPECT_THAT(log.Join(1, 3, {{"lr", "0.05"}}, {}, ShardResume{s1->key, 1}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("lost a shard")));
  log.Part(1, s1->id);
  clock.Advance(absl::Hours(1));
  log.CheckAway();
  EXPECT_EQ(lost, std::vector<int>{2});
}

// A two-shard job with three workers whose follower had been sent the first four events
// (the fresh RESUME and the workers) when its stream broke.
class ShardLogResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_.SetOnLost([this](int) { ++lost_; });
    log_.SeedFresh();
    const absl::StatusOr<ShardStream> first = log_.Join(1, 2, {});
    ASSERT_THAT(first, IsOk());
    first_ = *first;
    for (int id = 0; id < 3; ++id) log_.Append(WorkerEvent(id));
    ShardEventData e;
    for (int64_t i = 0; i < 4; ++i) ASSERT_TRUE(log_.Next(1, first_.id, i, &e, [] {}));
    log_.Part(1, first_.id);
  }

  FakeClock clock_;
  ShardLog log_{2, {}, &clock_, absl::Seconds(60)};
  int lost_ = 0;
  ShardStream first_;
};

TEST_F(ShardLogResumeTest, OnlyTheFollowerContinuesItsStreamAndOnlyFromEventsStillHeld) {
  clock_.Advance(absl::Seconds(30));
  log_.CheckAway();
  EXPECT_EQ(lost_, 0) << "within the grace";
  EXPECT_THAT(log_.Join(1, 2, {}, {}, ShardResume{"not its key", 2}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("only shard 1/2 itself")));
  EXPECT_THAT(
      log_.Join(1, 2, {}, {}, ShardResume{first_.key, 9}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no longer holds event 9")));
  EXPECT_EQ(lost_, 1) << "a shard that cannot continue is lost at once";
}

TEST_F(ShardLogResumeTest, AResumedStreamReadsOnAndReplacesOneStillOpen) {
  // The follower applied two of the four events before the stream broke.
  ShardEventData e;
  const absl::StatusOr<ShardStream> second = log_.Join(1, 2, {}, {}, ShardResume{first_.key, 2});
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->from, 2);
  EXPECT_EQ(second->key, first_.key);
  EXPECT_TRUE(log_.Vouches(1, first_.key));
  ASSERT_TRUE(log_.Next(1, second->id, 2, &e, [] {}));
  EXPECT_EQ(e.token, "t1");
  // The old stream, should its end come late, changes nothing; nor does it read on.
  log_.Part(1, first_.id);
  EXPECT_TRUE(log_.Vouches(1, first_.key));
  ASSERT_TRUE(log_.Next(1, first_.id, 4, &e, [] {}));
  EXPECT_EQ(e.kind, ShardEventData::Kind::kEnd);
  EXPECT_THAT(e.status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("newer stream")));
  // A follower whose stream broke without the leader seeing it continues on a new one at once.
  const absl::StatusOr<ShardStream> third = log_.Join(1, 2, {}, {}, ShardResume{first_.key, 3});
  ASSERT_THAT(third, IsOk());
  ASSERT_TRUE(log_.Next(1, third->id, 3, &e, [] {}));
  EXPECT_EQ(e.token, "t2");
  EXPECT_EQ(lost_, 0);
  // Away for longer than the grace, it is lost, once.
  log_.Part(1, third->id);
  clock_.Advance(absl::Seconds(60));
  log_.CheckAway();
  log_.CheckAway();
  EXPECT_EQ(lost_, 1);
  EXPECT_THAT(log_.Join(1, 2, {}, {}, ShardResume{first_.key, 4}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("lost a shard")));
}

TEST(ShardLogTest, AStreamThatBrokeBeforeAnyWorkerRegisteredContinuesToo) {
  FakeClock clock;
  ShardLog log(2, {}, &clock, absl::Seconds(60));
  int lost = 0;
  log.SetOnLost([&](int) { ++lost; });
  log.SeedFresh();
  const absl::StatusOr<ShardStream> first = log.Join(1, 2, {});
  ASSERT_THAT(first, IsOk());
  ShardEventData e;
  ASSERT_TRUE(log.Next(1, first->id, 0, &e, [] {}));
  log.Part(1, first->id);
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shard(s) 1 of")));
  const absl::StatusOr<ShardStream> second = log.Join(1, 2, {}, {}, ShardResume{first->key, 1});
  ASSERT_THAT(second, IsOk());
  EXPECT_THAT(log.Admit(), IsOk());
  // Away for longer than the grace before the job went on: gone, but nothing is lost.
  log.Part(1, second->id);
  clock.Advance(absl::Seconds(61));
  log.CheckAway();
  EXPECT_EQ(lost, 0);
  EXPECT_THAT(log.Join(1, 2, {}, {}, ShardResume{first->key, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds no place")));
  EXPECT_THAT(log.Join(1, 2, {}), IsOk());
}

TEST(ShardLogTest, ALeaderThatRestartedHoldsNoPlaceForAStreamToContinue) {
  FakeClock clock;
  ShardLog log(2, {}, &clock, absl::Seconds(60));
  log.SeedFresh();
  EXPECT_THAT(log.Join(1, 2, {}, {}, ShardResume{"a key of the leader before", 7}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds no place")));
}

TEST(ShardLogTest, EventsInFlightWhenAStreamBrokeAreKept) {
  FakeClock clock;
  ShardLog log(2, {}, &clock, absl::Seconds(60));
  const absl::StatusOr<ShardStream> s = log.Join(1, 2, {});
  ASSERT_THAT(s, IsOk());
  const int64_t n = ShardLog::kKeptForResume + 100;
  for (int64_t i = 0; i < n; ++i) log.Append(WorkerEvent(static_cast<int>(i)));
  ShardEventData e;
  for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(log.Next(1, s->id, i, &e, [] {}));
  EXPECT_FALSE(log.Next(1, s->id, n, &e, [] {}));
  log.Part(1, s->id);
  // Sent, but the last kKeptForResume events may not have arrived: those are still held.
  EXPECT_THAT(log.Join(1, 2, {}, {}, ShardResume{s->key, 99}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds 100 ...")));
}

TEST(ShardLogTest, AShardLeavingAnEndedJobIsNotLostAndCannotComeBack) {
  FakeClock clock;
  ShardLog log(2, {}, &clock, absl::Seconds(60));
  int lost = 0;
  log.SetOnLost([&](int) { ++lost; });
  log.SeedFresh();
  absl::StatusOr<ShardStream> s = log.Join(1, 2, {});
  ASSERT_THAT(s, IsOk());
  ShardEventData e;
  ASSERT_TRUE(log.Next(1, s->id, 0, &e, [] {}));
  EXPECT_FALSE(log.Next(1, s->id, 1, &e, [] {}));  // read: nothing new yet
  log.Part(1, s->id);                              // before any worker: away, and not let in
  EXPECT_THAT(log.Admit(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shard(s) 1 of")));
  s = log.Join(1, 2, {});  // restarted: it takes its place afresh, from the start
  EXPECT_THAT(log.Admit(), IsOk());
  ASSERT_THAT(s, IsOk());
  ASSERT_TRUE(log.Next(1, s->id, 0, &e, [] {}));
  EXPECT_EQ(e.kind, ShardEventData::Kind::kResume);
  log.Append(WorkerEvent(0));
  ShardEventData end;
  end.kind = ShardEventData::Kind::kEnd;
  log.Append(end);
  log.Part(1, s->id);
  EXPECT_EQ(lost, 0);
  EXPECT_THAT(log.Join(1, 2, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("too late")));
}

TEST(ShardLogTest, EveryFollowerReadsTheLogFromItsStartWhateverOrderTheyJoinIn) {
  FakeClock clock;
  ShardLog log(3, {}, &clock, absl::Seconds(60));
  log.SeedFresh();
  log.SeedFresh();  // once only
  const absl::StatusOr<ShardStream> s1 = log.Join(1, 3, {}, {{5, 0, 3}});
  ASSERT_THAT(s1, IsOk());
  ShardEventData e;
  ASSERT_TRUE(log.Next(1, s1->id, 0, &e, [] {}));
  EXPECT_EQ(e.kind, ShardEventData::Kind::kResume);
  EXPECT_EQ(e.version, -1);
  EXPECT_FALSE(log.Next(1, s1->id, 1, &e, [] {}));
  // Shard 1 has read the first event; shard 2 joins later and still gets it.
  const absl::StatusOr<ShardStream> s2 = log.Join(2, 3, {}, {});
  ASSERT_THAT(s2, IsOk());
  ASSERT_TRUE(log.Next(2, s2->id, 0, &e, [] {}));
  EXPECT_EQ(e.version, -1);
  auto held = log.AwaitFollowers(absl::ZeroDuration());
  ASSERT_THAT(held.status(), IsOk());
  EXPECT_EQ(held->at(1).size(), 1u);
  EXPECT_TRUE(held->at(2).empty());
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

  GradientPush Push(int worker, int step, int n, int epoch = 0) {
    GradientPush p;
    p.worker_id = worker;
    p.epoch = epoch;
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

// The follower's answers to workers come at once: Gate and Authenticate run on gRPC's callback
// threads, where a wait would hold every other call.
TEST_F(ShardFollowerTest, APushIsRetriedUntilTheLeaderHasCompletedThePreviousStep) {
  EXPECT_THAT(follower_->Gate(0, 0), IsOk());
  // A push for a step this shard has not reached (a worker ahead of a restored job) is left
  // to the barrier to refuse, at once.
  EXPECT_THAT(follower_->Gate(0, 1), IsOk());
  std::vector<Outcome> out(3);
  for (int id = 0; id < 3; ++id) agg_->Push(Push(id, 0, 2), out[id].callback());
  ASSERT_TRUE(out[0].result.has_value());
  // This shard completed step 0 before the leader's log said so: a push of step 1 is told to
  // come again.
  EXPECT_THAT(follower_->Gate(0, 1), StatusIs(absl::StatusCode::kUnavailable,
                                              HasSubstr("has not yet heard from the leader")));
  // Anything further ahead is left to the barrier to refuse.
  EXPECT_THAT(follower_->Gate(0, 2), IsOk());
  EXPECT_THAT(follower_->Gate(5, 0), IsOk());
  follower_->Apply(Step(0));
  EXPECT_THAT(follower_->Gate(0, 1), IsOk()) << "the retry after the leader's word passes";
}

TEST_F(ShardFollowerTest, TheNextEpochsPushesWaitForItsPlan) {
  std::vector<Outcome> out(3);
  for (int step = 0; step < 3; ++step) {
    for (int id = 0; id < 3; ++id) agg_->Push(Push(id, step, 2), out[id].callback());
    follower_->Apply(Step(step));
  }
  EXPECT_THAT(follower_->Gate(1, 0), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  ShardEventData next;
  next.kind = ShardEventData::Kind::kEpoch;
  next.epoch = 1;
  next.quotas = {{{0, 2}, {1, 2}, {2, 2}}};
  follower_->Apply(next);
  EXPECT_THAT(follower_->Gate(1, 0), IsOk());
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

// Worker 2 pushed step 0 to the leader and died before its push reached this shard: the leader
// completed the step and waits for nobody (everyone waits for this shard's answer).
TEST_F(ShardFollowerTest, PushesOnlyTheLeaderGotAreReportedAfterTheWorkerTimeout) {
  FakeClock clock;
  LivenessMonitor liveness({absl::ZeroDuration(), absl::Seconds(5)}, &clock);
  std::vector<Outcome> out(3);
  agg_->Push(Push(0, 0, 2), out[0].callback());
  agg_->Push(Push(1, 0, 2), out[1].callback());
  EXPECT_EQ(follower_->Missing(&liveness), std::nullopt);
  clock.Advance(absl::Seconds(60));
  // The leader has not completed the step: it removes worker 2 itself (it missed the step).
  EXPECT_EQ(follower_->Missing(&liveness), std::nullopt);
  follower_->Apply(Step(0));
  EXPECT_EQ(follower_->Missing(&liveness), std::nullopt) << "the clock starts now";
  clock.Advance(absl::Seconds(4));
  EXPECT_EQ(follower_->Missing(&liveness), std::nullopt);
  clock.Advance(absl::Seconds(1));
  const std::optional<MissingPushes> missing = follower_->Missing(&liveness);
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->epoch, 0);
  EXPECT_EQ(missing->step, 0);
  EXPECT_EQ(missing->workers, (std::set<int>{2}));
  // Its push arrives after all: the step completes and nothing is missing.
  agg_->Push(Push(2, 0, 2), out[2].callback());
  ASSERT_TRUE(out[0].result.has_value());
  EXPECT_EQ(follower_->Missing(&liveness), std::nullopt);
}

TEST_F(ShardFollowerTest, TheLeadersRemovalAtTheNextStepCompletesThisShardsStepWithoutThem) {
  std::vector<Outcome> out(3);
  agg_->Push(Push(0, 0, 2), out[0].callback());
  agg_->Push(Push(1, 0, 2), out[1].callback());
  follower_->Apply(Step(0));  // worker 2's push of step 0 reached the leader only
  // Told, the leader removed worker 2 at its step 1, which nobody had pushed: step 1 without
  // it, its samples in the steps after.
  ShardEventData evict = Step(1);
  evict.dead = {2};
  evict.changed = true;
  evict.quotas = {{{0, 3}, {1, 3}}, {{0, 1}, {1, 1}}};
  follower_->Apply(evict);
  ASSERT_TRUE(out[0].result.has_value());
  ASSERT_THAT(out[0].result->status(), IsOk());
  EXPECT_EQ((*out[0].result)->global_samples, 4) << "this shard's step 0 without worker 2";
  StepProgress p = agg_->Progress();
  EXPECT_EQ(p.step, 1);
  EXPECT_EQ(p.num_steps, 4);
  EXPECT_EQ(p.waiting_for, (std::vector<int>{0, 1}));
  EXPECT_EQ(agg_->Quota(0, 1), (std::map<int, int>{{0, 2}, {1, 2}}));
  EXPECT_EQ(agg_->Quota(0, 2), (std::map<int, int>{{0, 3}, {1, 3}}));
  Outcome late;
  agg_->Push(Push(2, 1, 2), late.callback());
  ASSERT_TRUE(late.result.has_value());
  EXPECT_FALSE(late.result->ok());
  // The survivors' step 1 completes here; step 2 still waits for the leader to complete step 1
  // (the removal did not say it had).
  std::vector<Outcome> next(2);
  agg_->Push(Push(0, 1, 2), next[0].callback());
  agg_->Push(Push(1, 1, 2), next[1].callback());
  ASSERT_TRUE(next[1].result.has_value());
  EXPECT_EQ((*next[1].result)->global_samples, 4);
  EXPECT_THAT(follower_->Gate(0, 2), StatusIs(absl::StatusCode::kUnavailable,
                                              HasSubstr("has not yet heard from the leader")));
  follower_->Apply(Step(1));
  EXPECT_THAT(follower_->Gate(0, 2), IsOk());
}

TEST_F(ShardFollowerTest, AtTheEpochsEndTheLastStepCompletesWithoutThem) {
  std::vector<Outcome> out(3);
  for (int step = 0; step < 2; ++step) {
    for (int id = 0; id < 3; ++id) agg_->Push(Push(id, step, 2), out[id].callback());
    follower_->Apply(Step(step));
  }
  agg_->Push(Push(0, 2, 2), out[0].callback());
  agg_->Push(Push(1, 2, 2), out[1].callback());
  follower_->Apply(Step(2));
  ShardEventData evict = Step(3);  // the leader waits for reports: it drops worker 2's
  evict.dead = {2};
  follower_->Apply(evict);
  ASSERT_TRUE(out[0].result.has_value());
  EXPECT_EQ((*out[0].result)->global_samples, 4);
  EXPECT_EQ(agg_->Progress().step, 3);
  EXPECT_EQ(agg_->Progress().num_steps, 3);
}

TEST_F(ShardFollowerTest, WithTheLeadersKeyOnlyATokenItSignedIsAskedToComeAgain) {
  // Waits would last minutes: a call answered here was answered without one.
  ShardFollower patient(agg_.get(), absl::Minutes(5));
  const std::string key = TokenKeyFromSecret("the-job-secret");
  patient.SetTokenKey(key);
  EXPECT_THAT(patient.Authenticate(0, "made-up"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not issued to worker 0")));
  EXPECT_THAT(patient.Authenticate(0, IssueWorkerToken(TokenKeyFromSecret("another"), 0)),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  const std::string token = IssueWorkerToken(key, 0);
  EXPECT_THAT(patient.Authenticate(1, token),  // signed for worker 0, not 1
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(patient.Authenticate(0, ""),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  // A token signed for the id is told to come again until the leader announces it.
  EXPECT_THAT(patient.Authenticate(0, token),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("not known to this shard yet")));
  ShardEventData w;
  w.kind = ShardEventData::Kind::kWorker;
  w.worker_id = 0;
  w.token = token;
  patient.Apply(w);
  EXPECT_THAT(patient.Authenticate(0, token), IsOk());
}

// Under mutual TLS a worker's token is bound to the certificate it registered with, on every
// shard: the leader's event says which.
TEST_F(ShardFollowerTest, ABoundTokenWorksOnlyWithItsCertificate) {
  ShardEventData w;
  w.kind = ShardEventData::Kind::kWorker;
  w.worker_id = 4;
  w.token = "token4";
  w.identity = "cert-a";
  follower_->Apply(w);
  EXPECT_THAT(follower_->Authenticate(4, "token4", "cert-a"), IsOk());
  EXPECT_THAT(follower_->Authenticate(4, "token4", "cert-b"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("issued to another client certificate")));
  EXPECT_THAT(follower_->Authenticate(4, "token4", ""),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(follower_->Authenticate(1, "token1", "cert-b"), IsOk()) << "worker 1 is not bound";
}

TEST_F(ShardFollowerTest, TokensAreTheLeadersAndTheEndReleasesEveryone) {
  EXPECT_THAT(follower_->Authenticate(1, "token1"), IsOk());
  EXPECT_THAT(follower_->Authenticate(1, "token0"),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(follower_->Authenticate(1, ""),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  // An id the leader may be about to announce: answered at once, retried by the client, and
  // let through once announced.
  ShardFollower patient(agg_.get(), absl::Minutes(5));
  for (int i = 0; i < 12; ++i) {
    EXPECT_THAT(patient.Authenticate(3, "token3"),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("not known to this shard yet")));
  }
  ShardEventData w;
  w.kind = ShardEventData::Kind::kWorker;
  w.worker_id = 3;
  w.token = "token3";
  patient.Apply(w);
  EXPECT_THAT(patient.Authenticate(3, "token3"), IsOk());
  // Far beyond the known workers: unknown.
  EXPECT_THAT(follower_->Authenticate(1000, "x"),
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

TEST_F(ShardFollowerTest, AfterAnEpochThePushesWaitForTheLeadersCheckpoint) {
  int saved = 0;
  follower_->SetCheckpointing(
      [&] {
        ++saved;
        return absl::OkStatus();
      },
      nullptr);
  ShardEventData next;
  next.kind = ShardEventData::Kind::kEpoch;
  next.epoch = 1;
  next.quotas = {{{0, 2}, {1, 2}, {2, 2}}};
  next.checkpoint = true;  // epoch 0's checkpoint follows
  follower_->Apply(next);
  EXPECT_THAT(follower_->Gate(1, 0), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  ShardEventData ckpt;
  ckpt.kind = ShardEventData::Kind::kCheckpoint;
  ckpt.epoch = 0;
  ckpt.checkpoint = true;
  follower_->Apply(ckpt);
  EXPECT_EQ(saved, 1);
  EXPECT_THAT(follower_->Gate(1, 0), IsOk());
  // A step the leader checkpointed after: saved once this shard has completed it too (its
  // last pushes arrive after the leader's word).
  std::vector<Outcome> out(3);
  std::thread pushers([&] {
    absl::SleepFor(absl::Milliseconds(30));
    for (int id = 0; id < 3; ++id) agg_->Push(Push(id, 0, 2, 1), out[id].callback());
  });
  ShardEventData step = Step(0);
  step.epoch = 1;
  step.checkpoint = true;
  follower_->Apply(step);
  EXPECT_EQ(saved, 2);
  EXPECT_EQ(agg_->Progress().step, 1);
  pushers.join();
  ASSERT_TRUE(out[2].result.has_value());
  EXPECT_THAT(out[2].result->status(), IsOk());
}

TEST_F(ShardFollowerTest, ANewJobHasNothingToRestoreAndARestoredOneNeedsTheSameStep) {
  ShardEventData fresh;
  fresh.kind = ShardEventData::Kind::kResume;
  fresh.version = -1;
  follower_->Apply(fresh);  // no restore function needed
  EXPECT_FALSE(follower_->WaitFor(absl::ZeroDuration()));
  ShardEventData resume;
  resume.kind = ShardEventData::Kind::kResume;
  resume.version = 7;
  resume.epoch = 0;
  resume.step = 1;
  follower_->Apply(resume);  // without --restore
  EXPECT_THAT(follower_->Wait(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("start this shard with --restore")));
}

}  // namespace
}  // namespace dbs
