#include "server/checkpoint_writer.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;

JobState StateOfEpoch(int epoch) {
  JobState st;
  st.aggregator.epoch = epoch;
  return st;
}

// Records each write: the state's epoch and the thread it ran on; the first write waits for
// `release` (when given).
struct Disk {
  absl::Mutex mu;
  std::vector<int> epochs;
  std::vector<std::thread::id> threads;
  std::vector<std::string> told;
  absl::Notification* release = nullptr;
  bool fail = false;

  CheckpointWriter::WriteFn Writer() {
    return [this](const JobState& st) -> absl::StatusOr<std::string> {
      if (release != nullptr) release->WaitForNotification();
      absl::MutexLock lock(&mu);
      epochs.push_back(st.aggregator.epoch);
      threads.push_back(std::this_thread::get_id());
      if (fail) return absl::DataLossError("disk full");
      return absl::StrCat("ckpt-", st.aggregator.epoch);
    };
  }
  CheckpointWriter::Written Told() {
    return [this](const absl::StatusOr<std::string>& path, absl::Duration) {
      absl::MutexLock lock(&mu);
      told.push_back(path.ok() ? *path : std::string(path.status().message()));
    };
  }
};

TEST(CheckpointWriterTest, QueuedStatesAreWrittenInOrderOnTheWritersThread) {
  Disk disk;
  absl::Notification release;
  disk.release = &release;
  FakeClock clock;
  CheckpointWriter writer(disk.Writer(), disk.Told(), &clock);
  // The first write is held: queueing returns all the same, and what follows waits its turn.
  writer.Queue(StateOfEpoch(0));
  writer.Queue(StateOfEpoch(1));
  EXPECT_TRUE(writer.Busy());
  writer.Queue(StateOfEpoch(2));
  release.Notify();
  writer.Flush();
  EXPECT_FALSE(writer.Busy());
  absl::MutexLock lock(&disk.mu);
  EXPECT_THAT(disk.epochs, ElementsAre(0, 1, 2));
  EXPECT_THAT(disk.told, ElementsAre("ckpt-0", "ckpt-1", "ckpt-2"));
  for (const std::thread::id& t : disk.threads) EXPECT_NE(t, std::this_thread::get_id());
}

TEST(CheckpointWriterTest, AStateWrittenNowComesAfterThoseQueuedAndSaysWhyItFailed) {
  Disk disk;
  FakeClock clock;
  CheckpointWriter writer(disk.Writer(), disk.Told(), &clock);
  writer.Queue(StateOfEpoch(0));
  writer.Queue(StateOfEpoch(1));
  const absl::StatusOr<std::string> now = writer.WriteNow(StateOfEpoch(2));
  ASSERT_THAT(now, IsOk());
  EXPECT_EQ(*now, "ckpt-2");
  {
    absl::MutexLock lock(&disk.mu);
    EXPECT_THAT(disk.epochs, ElementsAre(0, 1, 2));
    EXPECT_EQ(disk.threads.back(), std::this_thread::get_id());
    disk.fail = true;
  }
  EXPECT_THAT(writer.WriteNow(StateOfEpoch(3)), StatusCodeIs(absl::StatusCode::kDataLoss));
  absl::MutexLock lock(&disk.mu);
  EXPECT_EQ(disk.told.back(), "disk full");
}

TEST(CheckpointWriterTest, WhatIsQueuedIsWrittenBeforeTheWriterGoes) {
  Disk disk;
  FakeClock clock;
  {
    CheckpointWriter writer(disk.Writer(), disk.Told(), &clock);
    for (int e = 0; e < 5; ++e) writer.Queue(StateOfEpoch(e));
  }
  absl::MutexLock lock(&disk.mu);
  EXPECT_THAT(disk.epochs, ElementsAre(0, 1, 2, 3, 4));
}

}  // namespace
}  // namespace dbs
