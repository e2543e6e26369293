#include "common/serial_queue.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

TEST(SerialQueueTest, RunsTasksInOrderOnItsOwnThread) {
  std::vector<int> ran;
  std::thread::id where;
  absl::Notification done;
  {
    SerialQueue queue;
    for (int i = 0; i < 100; ++i) {
      queue.Schedule([&ran, &where, i] {
        where = std::this_thread::get_id();
        ran.push_back(i);
      });
    }
    queue.Schedule([&done] { done.Notify(); });
    done.WaitForNotification();
  }
  ASSERT_EQ(ran.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(ran[i], i);
  EXPECT_NE(where, std::this_thread::get_id());
}

TEST(SerialQueueTest, TheDestructorRunsWhatIsStillQueued) {
  std::atomic<int> ran{0};
  absl::Notification release;
  {
    SerialQueue queue;
    queue.Schedule([&release] { release.WaitForNotification(); });
    for (int i = 0; i < 10; ++i) queue.Schedule([&ran] { ++ran; });
    // A task may schedule another: it runs too.
    queue.Schedule([&queue, &ran] { queue.Schedule([&ran] { ran += 100; }); });
    release.Notify();
  }
  EXPECT_EQ(ran.load(), 110);
}

}  // namespace
}  // namespace dbs
