#include "server/checkpoint.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/training_job.h"

namespace dbs {
namespace {

// Two workers, two epochs of 4 steps of 2 + 2 samples, SGD with momentum.
JobConfig Config() {
  JobConfig config;
  config.scheduler.expected_workers = 2;
  config.scheduler.epochs = 2;
  config.scheduler.global_batch = 4;
  config.optimizer.sgd = SgdConfig{0.1, 0.9, 0.0, false};
  return config;
}

// A job two steps into its first epoch, with momentum state.
std::unique_ptr<TrainingJob> JobAtStep2(FakeClock* clock) {
  auto job = *TrainingJob::Create(Config(), clock);
  EXPECT_TRUE(job->scheduler()->Register({"a", 16, 4, "cpu"}).ok());
  EXPECT_TRUE(job->scheduler()->Register({"b", 16, 4, "cpu"}).ok());
  EXPECT_TRUE(job->store()->Register({{"w", {2}}}, std::vector<float>{1.0f, -1.0f}).ok());
  std::vector<float> g = {0.5f, 0.25f};
  for (int step = 0; step < 2; ++step) {
    for (int w = 0; w < 2; ++w) {
      job->aggregator()->Push({w, 0, step, 2, 1.0, g}, [](const absl::StatusOr<StepResult>&) {});
    }
  }
  return job;
}

JobState StateOf(TrainingJob* job, const JobConfig& config) {
  JobState st;
  st.config = config.scheduler;
  st.policy = PolicyName(config.policy);
  st.aggregator = job->aggregator()->SaveState();
  st.scheduler = job->scheduler()->SaveState();
  return st;
}

TEST(CheckpointTest, RoundTripRestoresEverything) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const JobConfig config = Config();
  const JobState st = StateOf(job.get(), config);
  const std::string bytes = EncodeCheckpoint(st);
  absl::StatusOr<JobState> back = DecodeCheckpoint(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->aggregator.epoch, 0);
  EXPECT_EQ(back->aggregator.step, 2);
  EXPECT_EQ(back->aggregator.store.values, st.aggregator.store.values);
  EXPECT_EQ(back->aggregator.store.version, 2);
  EXPECT_EQ(back->aggregator.store.optimizer.buffers, st.aggregator.store.optimizer.buffers);
  EXPECT_EQ(back->scheduler.records.size(), 1u);
  EXPECT_EQ(back->scheduler.records[0].layout.at(1), st.scheduler.records[0].layout.at(1));
  EXPECT_EQ(back->aggregator.accepted.size(), 4u);
  // The per-step times the controller models speeds from (two steps of 2 samples per worker).
  ASSERT_EQ(st.scheduler.records[0].step_times.at(1).at(2).steps, 2);
  EXPECT_EQ(back->scheduler.records[0].step_times, st.scheduler.records[0].step_times);

  // A fresh job restored from it continues exactly like the original one.
  auto restored = *TrainingJob::Create(config, &clock);
  ASSERT_TRUE(restored->Restore(*back).ok());
  std::vector<float> g = {1.0f, 1.0f};
  for (TrainingJob* j : {job.get(), restored.get()}) {
    for (int w = 0; w < 2; ++w) {
      j->aggregator()->Push({w, 0, 2, 2, 1.0, g}, [](const absl::StatusOr<StepResult>&) {});
    }
  }
  EXPECT_EQ(*restored->store()->Snapshot()->values, *job->store()->Snapshot()->values)
      << "momentum, parameters and position all came back";
  EXPECT_EQ(restored->store()->Snapshot()->version, 3);
  // A restart with other flags is refused.
  JobConfig other = config;
  other.scheduler.epochs = 9;
  auto wrong = *TrainingJob::Create(other, &clock);
  EXPECT_EQ(wrong->Restore(*back).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CheckpointTest, TruncatedOrAlteredFilesAreRefusedAndThePreviousOneIsUsed) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const JobConfig config = Config();
  const std::string dir = ::testing::TempDir() + "/ckpts";
  JobState first = StateOf(job.get(), config);
  auto p1 = WriteCheckpoint(dir, first);
  ASSERT_TRUE(p1.ok()) << p1.status();
  JobState second = first;
  second.aggregator.step = 7;
  auto p2 = WriteCheckpoint(dir, second);
  ASSERT_TRUE(p2.ok());
  std::string path;
  std::vector<std::string> refused;
  EXPECT_EQ(LoadNewestCheckpoint(dir, &refused, &path)->aggregator.step, 7);
  EXPECT_EQ(path, *p2);
  EXPECT_TRUE(refused.empty());

  // Truncate the newest: refused with a reason, the previous one is used.
  std::string bytes;
  {
    std::ifstream f(*p2, std::ios::binary);
    std::stringstream b;
    b << f.rdbuf();
    bytes = b.str();
  }
  std::ofstream(*p2, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  auto loaded = LoadNewestCheckpoint(dir, &refused, &path);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->aggregator.step, 2);
  EXPECT_EQ(path, *p1);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_THAT(refused[0], ::testing::HasSubstr("corrupt checkpoint"));

  // One altered byte anywhere fails the checksum.
  std::string altered = bytes;
  altered[altered.size() / 3] ^= 0x01;
  EXPECT_EQ(DecodeCheckpoint(altered).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeCheckpoint("DBSCKPT1").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeCheckpoint("something else entirely, long enough").status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(LoadNewestCheckpoint(dir + "/none", nullptr).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dbs
