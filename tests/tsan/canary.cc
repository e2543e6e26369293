// Proves that the ThreadSanitizer build (--config=tsan) sees what it must and only that:
// run by tests/tsan/canary_test.sh, one scenario per process.
//   race                two threads write one int, no lock: TSan must report a data race.
//   other_mutex         each thread holds its own absl::Mutex: TSan must still report it (the
//                       annotations of tests/tsan must not make every absl lock a global one).
//   mutex               the same writes under one absl::Mutex (Lock, Await, LockWhen, a
//                       CondVar wait with a timeout, an absl::Notification read on its fast
//                       path, WaitForNotification and WaitForNotificationWithTimeout called
//                       after Notify already ran): nothing to report. Without tests/tsan each of
//                       these would be a false race, as Debian's Abseil is not instrumented.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace {

int shared_value = 0;

void Race() {
  std::thread a([] { shared_value = 1; });
  std::thread b([] { shared_value = 2; });
  a.join();
  b.join();
}

void OtherMutex() {
  absl::Mutex mu_a;
  absl::Mutex mu_b;
  std::thread a([&] {
    absl::MutexLock lock(&mu_a);
    shared_value = 1;
  });
  std::thread b([&] {
    absl::MutexLock lock(&mu_b);
    shared_value = 2;
  });
  a.join();
  b.join();
}

// Notify runs before the waiter calls: WaitForNotification returns without taking a lock, so
// only the notification itself orders the write before it. The relaxed flag tells the waiter
// when to call, and gives TSan no ordering.
int WaitAfterNotify() {
  int sum = 0;
  for (const bool with_timeout : {false, true}) {
    absl::Notification done;
    std::atomic<bool> notified{false};
    int published = 0;
    std::thread producer([&] {
      published = with_timeout ? 2 : 1;
      done.Notify();
      notified.store(true, std::memory_order_relaxed);
    });
    while (!notified.load(std::memory_order_relaxed)) absl::SleepFor(absl::Milliseconds(1));
    if (with_timeout) {
      if (!done.WaitForNotificationWithTimeout(absl::Seconds(10))) return -1;
    } else {
      done.WaitForNotification();
    }
    sum += published;
    producer.join();
  }
  return sum;
}

void Mutex() {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;
  int turn = 0;
  absl::Notification done;
  int published = 0;
  std::thread producer([&] {
    {
      absl::MutexLock lock(&mu);
      shared_value = 1;
      ready = true;
    }
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](int* t) { return *t == 1; }, &turn));
      shared_value = 3;
      turn = 2;
      cv.Signal();
    }
    published = 42;
    done.Notify();
  });
  std::thread consumer([&] {
    mu.LockWhen(absl::Condition(&ready));
    shared_value = 2;
    turn = 1;
    while (turn != 2) cv.WaitWithTimeout(&mu, absl::Seconds(1));
    shared_value = 4;
    mu.Unlock();
  });
  while (!done.HasBeenNotified()) absl::SleepFor(absl::Milliseconds(1));
  const int seen = published;  // ordered by the notification's fast path
  producer.join();
  consumer.join();
  std::printf("published %d, shared %d\n", seen, shared_value);
  std::printf("waited for %d\n", WaitAfterNotify());
}

}  // namespace

int main(int argc, char** argv) {
#if !defined(__SANITIZE_THREAD__)
  std::fprintf(stderr, "tests/tsan/canary: not built with --config=tsan\n");
  return 2;
#endif
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "race") == 0) {
    Race();
  } else if (std::strcmp(mode, "other_mutex") == 0) {
    OtherMutex();
  } else if (std::strcmp(mode, "mutex") == 0) {
    Mutex();
  } else {
    std::fprintf(stderr, "usage: canary race|other_mutex|mutex\n");
    return 2;
  }
  return 0;
}
