// SerialQueue: one thread that runs the tasks handed to it, one at a time, in order.
//
// For work that must not run on the thread that hands it over: gRPC 1.51's callback server runs
// every reaction of every call on one thread, which also polls the connections, so a reaction
// that sums 4 MiB of gradient there keeps every other stream's bytes waiting. Thread-safe.
#ifndef DBS_COMMON_SERIAL_QUEUE_H_
#define DBS_COMMON_SERIAL_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dbs {

class SerialQueue {
 public:
  SerialQueue();
  // Runs the tasks still queued, then joins the thread.
  ~SerialQueue();
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  // Runs `task` on the queue's thread after every task scheduled before it.
  void Schedule(std::function<void()> task);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace dbs

#endif  // DBS_COMMON_SERIAL_QUEUE_H_
