#include "server/training_job.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

class TrainingJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    JobConfig config;
    config.scheduler.expected_workers = 2;
    config.scheduler.epochs = 1;
    config.scheduler.global_batch = 4;
    config.stall_timeout = absl::Minutes(5);
    job_ = *TrainingJob::Create(config, &clock_);
    for (const char* name : {"a", "b"}) {
      ASSERT_TRUE(job_->scheduler()->Register({name, 8, 2, "cpu"}).ok());
    }
    ASSERT_TRUE(job_->store()->Register({{"w", {1}}}, std::vector<float>{0.0f}).ok());
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
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("worker(s) 1 at epoch 0 step 0"));
  EXPECT_NE(job_->Run().status, "ok");
}

TEST_F(TrainingJobTest, ZeroTimeoutNeverAborts) {
  JobConfig config;
  config.scheduler.expected_workers = 1;
  config.stall_timeout = absl::ZeroDuration();
  auto job = *TrainingJob::Create(config, &clock_);
  ASSERT_TRUE(job->scheduler()->Register({"a", 8, 2, "cpu"}).ok());
  clock_.Advance(absl::Hours(10));
  EXPECT_FALSE(job->CheckStall());
  EXPECT_FALSE(job->WaitFor(absl::ZeroDuration()));
  job->Abort(absl::CancelledError("done"));
}

}  // namespace
}  // namespace dbs
