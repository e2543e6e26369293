#include "server/checkpoint.h"

#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/training_job.h"
#include "tests/status_matchers.h"

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
  EXPECT_THAT(job->scheduler()->Register({"a", 16, 4, "cpu"}), IsOk());
  WorkerRegistration b{"b", 16, 4, "cpu"};
  b.cpu_limit_cores = 0.5;
  b.source = "10.0.0.2";
  b.identity = "cert-b";  // its token is bound to this certificate, across a restart too
  EXPECT_THAT(job->scheduler()->Register(b), IsOk());
  EXPECT_THAT(job->store()->Register({{"w", {2}}}, std::vector<float>{1.0f, -1.0f}), IsOk());
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
  st.settings = TrainingSettings(config);
  st.aggregator = job->aggregator()->SaveState();
  st.scheduler = job->scheduler()->SaveState();
  return st;
}

TEST(CheckpointTest, RoundTripRestoresEverything) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const JobConfig config = Config();
  JobState st = StateOf(job.get(), config);
  st.audits[0] = {16, 15, 1, 0};
  const std::string bytes = EncodeCheckpoint(st);
  absl::StatusOr<JobState> back = DecodeCheckpoint(bytes);
  ASSERT_THAT(back, IsOk()) << back.status();
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
  ASSERT_EQ(back->scheduler.workers.size(), 2u);
  EXPECT_EQ(back->scheduler.workers[1].name, "b");
  EXPECT_EQ(back->scheduler.workers[1].cpu_limit_cores, 0.5);
  EXPECT_EQ(back->scheduler.workers[1].source, "10.0.0.2");
  EXPECT_EQ(back->scheduler.workers[1].identity, "cert-b");
  EXPECT_EQ(back->scheduler.records[0].plans.at(1).train_ranges,
            st.scheduler.records[0].plans.at(1).train_ranges);
  EXPECT_EQ(back->scheduler.records[0].plans.at(1).share,
            st.scheduler.records[0].plans.at(1).share);
  EXPECT_EQ(back->scheduler.records[0].start, st.scheduler.records[0].start);
  EXPECT_EQ(back->audits.at(0).missing, 1);
  EXPECT_EQ(back->policy, "dbs");

  // A fresh job restored from it continues exactly like the original one.
  auto restored = *TrainingJob::Create(config, &clock);
  ASSERT_THAT(restored->Restore(*back), IsOk());
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
  EXPECT_THAT(wrong->Restore(*back), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

TEST(CheckpointTest, TruncatedOrAlteredFilesAreRefusedAndThePreviousOneIsUsed) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const JobConfig config = Config();
  const std::string dir = ::testing::TempDir() + "/ckpts";
  JobState first = StateOf(job.get(), config);
  auto p1 = WriteCheckpoint(dir, first);
  ASSERT_THAT(p1, IsOk()) << p1.status();
  JobState second = first;
  second.aggregator.step = 7;
  auto p2 = WriteCheckpoint(dir, second);
  ASSERT_THAT(p2, IsOk());
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
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->aggregator.step, 2);
  EXPECT_EQ(path, *p1);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_THAT(refused[0], ::testing::HasSubstr("corrupt checkpoint"));

  // One altered byte anywhere fails the checksum.
  std::string altered = bytes;
  altered[altered.size() / 3] ^= 0x01;
  EXPECT_THAT(DecodeCheckpoint(altered), StatusCodeIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeCheckpoint("DBSCKPT2"), StatusCodeIs(absl::StatusCode::kDataLoss));
  // Every truncation is refused (and none crashes the decoder).
  for (size_t n = 0; n < bytes.size(); ++n) {
    ASSERT_EQ(DecodeCheckpoint(bytes.substr(0, n)).status().code(), absl::StatusCode::kDataLoss)
        << n;
  }
  EXPECT_THAT(DecodeCheckpoint("something else entirely, long enough"),
              StatusCodeIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(LoadNewestCheckpoint(dir + "/none", nullptr),
              StatusCodeIs(absl::StatusCode::kNotFound));
}

TEST(CheckpointTest, TheNextWriteRemovesWhatAKilledWriterLeftHalfWritten) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const std::string dir = ::testing::TempDir() + "/leftovers";
  const JobState state = StateOf(job.get(), Config());
  ASSERT_THAT(WriteCheckpoint(dir, state), IsOk());
  // What a dbs_ps killed while writing its second checkpoint leaves (pid 1 is never ours).
  const std::string leftover = dir + "/ckpt-2.dbs.tmp.1.0";
  std::ofstream(leftover) << "half a checkpoint";
  const std::string other = dir + "/notes.txt";
  std::ofstream(other) << "the user's";
  std::string path;
  EXPECT_EQ(LoadNewestCheckpoint(dir, nullptr, &path)->aggregator.step, 2);
  EXPECT_EQ(path, dir + "/ckpt-1.dbs") << "a temporary is never read as a checkpoint";
  auto next = WriteCheckpoint(dir, state);
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(*next, dir + "/ckpt-2.dbs");
  EXPECT_FALSE(std::ifstream(leftover).good()) << "the killed writer's temporary is gone";
  EXPECT_TRUE(std::ifstream(other).good()) << "files that are not checkpoints are kept";
  EXPECT_TRUE(std::ifstream(dir + "/ckpt-1.dbs").good());
}

TEST(CheckpointTest, AnOlderFormatIsRefusedWithAClearMessage) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const std::string dir = ::testing::TempDir() + "/old_ckpts";
  auto p1 = WriteCheckpoint(dir, StateOf(job.get(), Config()));
  ASSERT_THAT(p1, IsOk()) << p1.status();
  // A newer file in the JSON format of dbs before the protobuf schema.
  std::ofstream(dir + "/ckpt-2.dbs", std::ios::binary) << "DBSCKPT1" << std::string(40, '\0');
  std::vector<std::string> refused;
  std::string path;
  ASSERT_THAT(LoadNewestCheckpoint(dir, &refused, &path), IsOk());
  EXPECT_EQ(path, *p1);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_THAT(refused[0], ::testing::HasSubstr("checkpoint format 1 was written by an older dbs"));
  EXPECT_THAT(DecodeCheckpoint("DBSCKPT1 and more"),
              StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

TEST(CheckpointTest, AValidFrameAroundGarbageIsRefused) {
  // Right magic, length and CRC, but the body is not a checkpoint message.
  std::string body = "\xff\xff\xff\xff not a protobuf";
  std::string bytes = "DBSCKPT2";
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(body.size() >> (8 * i)));
  bytes += body;
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>(crc >> (8 * i)));
  const absl::Status s = DecodeCheckpoint(bytes).status();
  EXPECT_THAT(s, StatusCodeIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("unreadable"));
}

// A restore compares every training setting, so the learning rate, momentum or the optimizer
// cannot change silently across a restart.
TEST(CheckpointTest, ARestoreWithOtherTrainingSettingsIsRefusedUnlessAllowed) {
  FakeClock clock;
  auto job = JobAtStep2(&clock);
  const absl::StatusOr<JobState> back =
      DecodeCheckpoint(EncodeCheckpoint(StateOf(job.get(), Config())));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->settings.at("lr"), "0.1");
  JobConfig other = Config();
  other.optimizer.sgd.lr = 0.2;
  other.optimizer.sgd.momentum = 0.5;
  auto refused = *TrainingJob::Create(other, &clock);
  EXPECT_THAT(refused->Restore(*back),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("lr 0.1 -> 0.2, momentum 0.9 -> 0.5")));
  auto allowed = *TrainingJob::Create(other, &clock);
  EXPECT_THAT(allowed->Restore(*back, /*allow_other_settings=*/true), IsOk());
  auto same = *TrainingJob::Create(Config(), &clock);
  EXPECT_THAT(same->Restore(*back), IsOk());
}

}  // namespace
}  // namespace dbs
