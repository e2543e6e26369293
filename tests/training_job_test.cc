#include "server/training_job.h"

#include <sys/stat.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

// Two workers, one epoch of B = 4: two steps of 2 + 2 samples.
JobConfig TwoWorkerConfig() {
  JobConfig config;
  config.scheduler.expected_workers = 2;
  config.scheduler.epochs = 1;
  config.scheduler.global_batch = 4;
  config.stall_timeout = absl::Minutes(5);
  return config;
}

class TrainingJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = *TrainingJob::Create(TwoWorkerConfig(), &clock_);
    for (const char* name : {"a", "b"}) {
      ASSERT_THAT(job_->scheduler()->Register({name, 8, 2, "cpu"}), IsOk());
    }
    ASSERT_THAT(job_->store()->Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  }

  void PushFromWorker0() {
    GradientPush p{0, 0, 0, 2, 0.0, grad_};
    job_->aggregator()->Push(p, [](const absl::StatusOr<StepResult>&) {});
  }

  FakeClock clock_;
  std::unique_ptr<TrainingJob> job_;
  std::vector<float> grad_ = {1.0f};
};

TEST_F(TrainingJobTest, EpochPlanStartsTheAggregator) {
  const StepProgress p = job_->aggregator()->Progress();
  EXPECT_EQ(p.epoch, 0);
  EXPECT_EQ(p.num_steps, 2);
  EXPECT_THAT(p.waiting_for, ::testing::ElementsAre(0, 1));
}

TEST_F(TrainingJobTest, StallAbortsNamingTheMissingWorker) {
  EXPECT_FALSE(job_->CheckStall());
  PushFromWorker0();
  clock_.Advance(absl::Minutes(4));
  EXPECT_FALSE(job_->CheckStall()) << "the push counts as progress";
  clock_.Advance(absl::Minutes(4));
  EXPECT_FALSE(job_->CheckStall()) << "4 minutes since the push: not yet";
  clock_.Advance(absl::Minutes(2));
  ASSERT_TRUE(job_->CheckStall());
  ASSERT_TRUE(job_->WaitFor(absl::ZeroDuration()));
  const absl::Status s = job_->Wait();
  EXPECT_THAT(s, StatusCodeIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("worker(s) 1 at epoch 0 step 0"));
  EXPECT_NE(job_->Run().status, "ok");
}

TEST(TrainingJobRegistrationTest, AJobMissingWorkersEndsAfterTheStallTimeout) {
  FakeClock clock;
  JobConfig config;
  config.scheduler.expected_workers = 3;
  config.stall_timeout = absl::Minutes(5);
  auto job = *TrainingJob::Create(config, &clock);
  EXPECT_FALSE(job->CheckStall()) << "nobody registered yet: a server may wait for its first";
  clock.Advance(absl::Hours(1));
  EXPECT_FALSE(job->CheckStall());
  ASSERT_THAT(job->scheduler()->Register({"a", 8, 2, "cpu"}), IsOk());
  EXPECT_FALSE(job->CheckStall());
  clock.Advance(absl::Minutes(5));
  ASSERT_TRUE(job->CheckStall());
  EXPECT_THAT(
      job->Wait(),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               ::testing::HasSubstr("workers to register with the job's model: 1 of 3 did")));
}

TEST_F(TrainingJobTest, ZeroTimeoutNeverAborts) {
  JobConfig config;
  config.scheduler.expected_workers = 1;
  config.stall_timeout = absl::ZeroDuration();
  auto job = *TrainingJob::Create(config, &clock_);
  ASSERT_THAT(job->scheduler()->Register({"a", 8, 2, "cpu"}), IsOk());
  clock_.Advance(absl::Hours(10));
  EXPECT_FALSE(job->CheckStall());
  EXPECT_FALSE(job->WaitFor(absl::ZeroDuration()));
  job->Abort(absl::CancelledError("done"));
}

// The leader of a two-shard job of two workers (TwoWorkerConfig), whose follower reports
// pushes it never got (a worker died between its pushes to the shards).
class ShardLeaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const JobConfig config = TwoWorkerConfig();
    job_ = *TrainingJob::Create(config, &clock_);
    log_ = std::make_unique<ShardLog>(2, TrainingSettings(config), &clock_, absl::Seconds(60));
    job_->SetShardLog(log_.get());
    const absl::StatusOr<ShardStream> stream = log_->Join(1, 2, TrainingSettings(config));
    ASSERT_THAT(stream, IsOk());
    stream_ = stream->id;
    for (const char* name : {"a", "b"}) {
      ASSERT_THAT(job_->scheduler()->Register({name, 8, 2, "cpu"}), IsOk());
    }
    ASSERT_THAT(job_->store()->Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  }

  void Push(int worker, int step) {
    GradientPush p{worker, 0, step, 2, 0.0, grad_};
    job_->aggregator()->Push(p, [](const absl::StatusOr<StepResult>&) {});
  }

  ShardEventData LastEvent() {
    ShardEventData e;
    for (int64_t i = 0; log_->Next(1, stream_, i, &e, [] {}); ++i) {
    }
    return e;
  }

  FakeClock clock_;
  std::unique_ptr<TrainingJob> job_;
  std::unique_ptr<ShardLog> log_;
  int64_t stream_ = 0;
  std::vector<float> grad_ = {1.0f};
};

TEST_F(ShardLeaderTest, PushesAFollowerNeverGotAreRemovedAtTheNextStep) {
  Push(0, 0);
  Push(1, 0);
  ASSERT_EQ(job_->aggregator()->Progress().step, 1);
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 1, {1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not at the step after step 1 of epoch 0")));
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {7}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("worker 7 is not one the step waits for")));
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no worker")));
  EXPECT_EQ(job_->aggregator()->Progress().waiting_for, (std::vector<int>{0, 1}))
      << "a refused report changes nothing";
  ASSERT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {1}), IsOk());
  const ShardEventData e = LastEvent();
  EXPECT_EQ(e.kind, ShardEventData::Kind::kStep);
  EXPECT_EQ(e.step, 1);
  EXPECT_EQ(e.dead, (std::set<int>{1}));
  EXPECT_TRUE(e.changed);
  // Worker 1's 2 samples of step 1 go to an extra step for worker 0.
  ASSERT_EQ(e.quotas.size(), 1u);
  EXPECT_EQ(e.quotas[0], (std::map<int, int>{{0, 2}}));
  const StepProgress p = job_->aggregator()->Progress();
  EXPECT_EQ(p.waiting_for, (std::vector<int>{0}));
  EXPECT_EQ(p.num_steps, 3);
  // Reported again (the follower repeats while its step waits): nothing more to do.
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  Push(0, 1);
  Push(0, 2);
  EXPECT_EQ(job_->aggregator()->Progress().step, 3);
  EXPECT_EQ(job_->scheduler()->History().back().dead, (std::set<int>{1}));
}

TEST_F(ShardLeaderTest, AReportIsRefusedOnceTheNextStepHasAPush) {
  Push(0, 0);
  Push(1, 0);
  Push(0, 1);  // worker 0 had every shard's answer: the follower's step is not waiting
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pushed step 1 already")));
  EXPECT_EQ(job_->aggregator()->Progress().waiting_for, (std::vector<int>{1}));
}

TEST_F(ShardLeaderTest, AfterTheLastStepTheyAreDroppedFromTheReports) {
  for (int step = 0; step < 2; ++step) {
    Push(0, step);
    Push(1, step);
  }
  ASSERT_THAT(job_->RemoveMissingAtShard(1, 0, 1, {1}), IsOk());
  const ShardEventData e = LastEvent();
  EXPECT_EQ(e.kind, ShardEventData::Kind::kStep);
  EXPECT_EQ(e.step, 2);
  EXPECT_EQ(e.dead, (std::set<int>{1}));
  EXPECT_FALSE(job_->scheduler()->History().back().complete);
  EpochTiming t;
  t.worker_id = 0;
  t.epoch = 0;
  t.samples = 4;
  t.test_samples = 1;
  ASSERT_THAT(job_->scheduler()->Report(t), IsOk());
  EXPECT_TRUE(job_->scheduler()->History().back().complete) << "worker 1's report is not awaited";
  EXPECT_EQ(job_->scheduler()->History().back().dead, (std::set<int>{1}));
}

TEST_F(TrainingJobTest, OnlyAShardedJobsLeaderHearsOfMissingPushes) {
  EXPECT_THAT(job_->RemoveMissingAtShard(1, 0, 0, {1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not the leader")));
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

// Two registered workers, one epoch of B = 4 and a one-float model; re-planned over a window of
// 3 steps at a ratio of 1.5.
JobConfig ReplanConfig() {
  JobConfig config;
  config.scheduler.expected_workers = 2;
  config.scheduler.epochs = 1;
  config.scheduler.global_batch = 4;
  config.replan_window_steps = 3;
  config.replan_threshold = 1.5;
  return config;
}

std::unique_ptr<TrainingJob> TwoWorkerJob(const JobConfig& config, const Clock* clock) {
  auto job = *TrainingJob::Create(config, clock);
  for (const char* name : {"a", "b"}) {
    EXPECT_THAT(job->scheduler()->Register({name, 64, 8, "cpu"}), IsOk());
  }
  EXPECT_THAT(job->store()->Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  return job;
}

// Worker 0's and worker 1's pushes of `step`, each `seconds` after the step began (the clock
// advances to each in turn): the server times a worker's step from the answers to its push.
void PushTimed(TrainingJob* job, FakeClock* clock, int step, std::map<int, int> batch,
               std::map<int, double> seconds, std::optional<absl::StatusOr<StepResult>>* r0,
               std::optional<absl::StatusOr<StepResult>>* r1) {
  static const std::vector<float> g = {1.0f};
  const int first = seconds[0] <= seconds[1] ? 0 : 1;
  double now = 0.0;
  for (int id : {first, 1 - first}) {
    clock->Advance(absl::Seconds(seconds[id] - now));
    now = seconds[id];
    auto* r = id == 0 ? r0 : r1;
    job->aggregator()->Push({id, 0, step, batch[id], 0.0, g, seconds[id]},
                            [r](const absl::StatusOr<StepResult>& s) { *r = s; });
  }
}

TEST(MidEpochReplanTest, ASlowedWorkerIsReplannedWithinTheWindow) {
  FakeClock clock;
  JobConfig config = ReplanConfig();
  config.noise_margin = 0.0;  // the window's means alone, for the arithmetic below
  auto job = TwoWorkerJob(config, &clock);
  std::vector<float> g = {1.0f};
  std::map<int, int> batch = {{0, 2}, {1, 2}};
  int replanned_after = -1;
  for (int step = 0; step < 16 && replanned_after < 0; ++step) {
    std::optional<absl::StatusOr<StepResult>> r0, r1;
    // Worker 1 is slowed 3x from step 2 on: 3 s per sample instead of 1.
    const double slow = step >= 2 ? 3.0 : 1.0;
    PushTimed(job.get(), &clock, step, batch, {{0, 1.0 * batch[0]}, {1, slow * batch[1]}}, &r0,
              &r1);
    ASSERT_TRUE(r0.has_value() && r0->ok()) << "step " << step;
    if ((*r0)->revisions != nullptr) {
      replanned_after = step;
      const PlanRevision& rev0 = (*r0)->revisions->at(0);
      const PlanRevision& rev1 = (*r1)->revisions->at(1);
      EXPECT_EQ(rev0.from_step, step + 1);
      batch[0] = static_cast<int>(CountSamples(rev0.steps[0]));
      batch[1] = static_cast<int>(CountSamples(rev1.steps[0]));
    }
  }
  // The window (3 steps) holds 2 slowed steps after step 3: 2 + 6 + 6 = 14 s against 6 s, a
  // ratio of 1.4 to the mean; after step 4 it is 18 / 12 = 1.5: re-planned.
  EXPECT_EQ(replanned_after, 4);
  EXPECT_EQ(batch[0] + batch[1], 4);
  EXPECT_EQ(batch[1], 1) << "a third of worker 0's speed: 1 of 4 samples";
  // The next step runs on the new split.
  std::optional<absl::StatusOr<StepResult>> a, b;
  job->aggregator()->Push({0, 0, 5, batch[0], 0.0, g, 3.0},
                          [&](const absl::StatusOr<StepResult>& r) { a = r; });
  job->aggregator()->Push({1, 0, 5, batch[1], 0.0, g, 3.0},
                          [&](const absl::StatusOr<StepResult>& r) { b = r; });
  ASSERT_TRUE(b.has_value() && b->ok()) << b->status();
  EXPECT_EQ((*b)->global_samples, 4);
  job->Abort(absl::CancelledError("done"));
}

// A checkpoint due at the step a re-plan is decided at holds the re-plan: the workers follow it
// from the next step on, and a server restored from that checkpoint must expect what they push.
// (CI saw the other order: a restored shard expected the old batch of the next step, and a
// worker's push was refused as not matching it.)
TEST(MidEpochReplanTest, ACheckpointOfTheReplanningStepHoldsTheNewPlan) {
  FakeClock clock;
  JobConfig config = ReplanConfig();
  config.noise_margin = 0.0;
  config.checkpoint_dir = ::testing::TempDir() + "/replan_checkpoint";
  config.checkpoint_every_steps = 5;  // after step 4: the step the window re-plans at
  mkdir(config.checkpoint_dir.c_str(), 0755);
  auto job = TwoWorkerJob(config, &clock);
  std::vector<float> g = {1.0f};
  std::optional<PlanRevision> revision;
  for (int step = 0; step < 5; ++step) {
    std::optional<absl::StatusOr<StepResult>> r0, r1;
    const double slow = step >= 2 ? 3.0 : 1.0;  // as in the test above: re-planned after step 4
    PushTimed(job.get(), &clock, step, {{0, 2}, {1, 2}}, {{0, 2.0}, {1, slow * 2}}, &r0, &r1);
    ASSERT_TRUE(r1.has_value() && r1->ok()) << "step " << step;
    if ((*r1)->revisions != nullptr) revision = (*r1)->revisions->at(1);
  }
  ASSERT_TRUE(revision.has_value()) << "re-planned after step 4";
  ASSERT_EQ(revision->from_step, 5);
  job->Abort(absl::CancelledError("done"));
  EXPECT_THAT(job->Wait(), StatusCodeIs(absl::StatusCode::kCancelled));  // checkpoints written
  std::vector<std::string> refused;
  absl::StatusOr<JobState> saved = LoadNewestCheckpoint(config.checkpoint_dir, &refused);
  ASSERT_THAT(saved, IsOk()) << saved.status();
  EXPECT_EQ(saved->aggregator.step, 5);
  const EpochRecord& rec = saved->scheduler.records.at(0);
  EXPECT_EQ(rec.revision, revision->revision);
  EXPECT_EQ(rec.layout.at(1)[5], revision->steps[0]) << "worker 1's next step, as it was told";
}

// Both workers compute 1 s per step at batch 2; worker 1's answers and pushes take another
// second (a throttled CPU decoding, a slow link). The server times each worker's step from its
// answers to the push, so it sees worker 1's steps take twice as long and moves samples off it,
// whatever compute worker 1 reports: `reported` is the compute it says it spent.
int ReplannedBatchOfTheSlowCommunicator(double reported) {
  FakeClock clock;
  JobConfig config = ReplanConfig();
  // 2 s against 1 s at 2 samples each: worker 0 with a third sample would take 1.5 s, so the
  // window sees 2 / 1.5 = 1.33x, which must be enough to re-plan here.
  config.replan_threshold = 1.2;
  auto job = TwoWorkerJob(config, &clock);
  std::vector<float> g = {1.0f};
  std::map<int, int> batch = {{0, 2}, {1, 2}};
  for (int step = 0; step < 12; ++step) {
    std::optional<absl::StatusOr<StepResult>> r0, r1;
    clock.Advance(absl::Seconds(1));
    job->aggregator()->Push({0, 0, step, batch[0], 0.0, g, 0.5 * batch[0]},
                            [&](const absl::StatusOr<StepResult>& r) { r0 = r; });
    clock.Advance(absl::Seconds(1));
    job->aggregator()->Push({1, 0, step, batch[1], 0.0, g, reported},
                            [&](const absl::StatusOr<StepResult>& r) { r1 = r; });
    EXPECT_TRUE(r0.has_value() && r0->ok()) << "step " << step;
    if (r0.has_value() && r0->ok() && (*r0)->revisions != nullptr) {
      batch[0] = static_cast<int>(CountSamples((*r0)->revisions->at(0).steps[0]));
      batch[1] = static_cast<int>(CountSamples((*r1)->revisions->at(1).steps[0]));
      break;
    }
  }
  EXPECT_EQ(batch[0] + batch[1], 4);
  job->Abort(absl::CancelledError("done"));
  return batch[1];
}

TEST(MidEpochReplanTest, AWorkerWithSlowCommunicationGetsFewerSamples) {
  EXPECT_LT(ReplannedBatchOfTheSlowCommunicator(1.0), 2);
}

// A worker that says it computes in no time (a lying or broken clock) earns no more samples
// than the speed the server observes: its steps still take 2 s from the answers to its push.
TEST(MidEpochReplanTest, AWorkerThatUnderReportsItsComputeGetsNoMoreSamples) {
  EXPECT_LT(ReplannedBatchOfTheSlowCommunicator(1e-6), 2);
  EXPECT_LT(ReplannedBatchOfTheSlowCommunicator(0.0), 2);
}

// Both shards of a two-shard job were killed after step 0, whose checkpoint they restore. A
// worker's push of step 1 had reached the old follower, which answered, but not the old leader:
// retried into the restored leader, taking it would complete a step 1 the restored follower
// waits for in vain (it lost that push). The restored leader refuses the restored workers'
// pushes until each has resumed and redoes the step on every shard.
TEST(ShardRestoreTest, TheRestoredLeaderTakesAWorkersPushesOnlyOnceItResumed) {
  FakeClock clock;
  JobConfig config = TwoWorkerConfig();
  config.checkpoint_dir = ::testing::TempDir() + "/shard_restore";
  mkdir(config.checkpoint_dir.c_str(), 0755);
  auto before = TwoWorkerJob(config, &clock);
  std::vector<float> g = {1.0f};
  for (int worker : {0, 1}) {
    before->aggregator()->Push({worker, 0, 0, 2, 0.0, g}, [](const absl::StatusOr<StepResult>&) {});
  }
  ASSERT_THAT(before->SaveCheckpoint(), IsOk());
  before->Abort(absl::CancelledError("killed"));
  std::vector<std::string> refused;
  absl::StatusOr<JobState> saved = LoadNewestCheckpoint(config.checkpoint_dir, &refused);
  ASSERT_THAT(saved, IsOk());

  auto leader = *TrainingJob::Create(config, &clock);
  ShardLog log(2, TrainingSettings(config), &clock, absl::Seconds(60));
  leader->SetShardLog(&log);
  ASSERT_THAT(leader->Restore(*saved), IsOk());
  for (int worker : {0, 1}) {
    EXPECT_THAT(leader->AdmitPush(worker),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("must resume")))
        << "worker " << worker;
  }
  ParameterSnapshot parameters;
  absl::StatusOr<ResumePoint> resumed = leader->Resume(0, &parameters);
  ASSERT_THAT(resumed, IsOk());
  EXPECT_EQ(resumed->step, 1) << "worker 0 redoes step 1";
  EXPECT_THAT(leader->AdmitPush(0), IsOk());
  EXPECT_THAT(leader->AdmitPush(1), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_))
      << "worker 1 has not resumed yet";
  EXPECT_THAT(leader->Resume(7, &parameters), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  leader->Abort(absl::CancelledError("done"));

  // One server restored takes a retried push at once: no other shard can be behind it.
  auto alone = *TrainingJob::Create(config, &clock);
  ASSERT_THAT(alone->Restore(*saved), IsOk());
  EXPECT_THAT(alone->AdmitPush(0), IsOk());
  EXPECT_THAT(alone->AdmitPush(1), IsOk());
  alone->Abort(absl::CancelledError("done"));
}

}  // namespace
}  // namespace dbs
