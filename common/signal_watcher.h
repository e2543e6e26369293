// SignalWatcher: receives SIGINT and SIGTERM on its own thread and calls `on_signal` with the
// signal; joined on destruction. Call SignalWatcher::Block() in main before any thread starts,
// so that no other thread receives them.
#ifndef DBS_COMMON_SIGNAL_WATCHER_H_
#define DBS_COMMON_SIGNAL_WATCHER_H_

#include <signal.h>
#include <time.h>

#include <atomic>
#include <functional>
#include <thread>
#include <utility>

namespace dbs {

class SignalWatcher {
 public:
  explicit SignalWatcher(std::function<void(int)> on_signal)
      : set_(Block()), thread_([this, on_signal = std::move(on_signal)] {
          const timespec tick = {0, 200 * 1000 * 1000};
          while (!done_.load()) {
            const int sig = sigtimedwait(&set_, nullptr, &tick);
            if (sig == SIGINT || sig == SIGTERM) {
              received_.store(sig);
              on_signal(sig);
            }
          }
        }) {}
  ~SignalWatcher() {
    done_.store(true);
    thread_.join();
  }

  // The last signal received (0: none).
  int received() const { return received_.load(); }

  // Blocks SIGINT and SIGTERM in the calling thread and every thread it starts later.
  static sigset_t Block() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    return set;
  }

 private:
  const sigset_t set_;
  std::atomic<bool> done_{false};
  std::atomic<int> received_{0};
  std::thread thread_;
};

}  // namespace dbs

#endif  // DBS_COMMON_SIGNAL_WATCHER_H_
