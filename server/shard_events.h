// ShardLog and ShardFollower: how the shards of a sharded job (dbs_ps --shard=i/k) keep one step
// barrier. Free of gRPC; server/shard_service.h carries the events between the processes.
//
// Shard 0, the leader, hosts the scheduler. Everything that shapes its step barrier is appended
// to its ShardLog as it happens: each worker's registration (with its token), each epoch's
// per-step sample counts, each completed step (with the re-plan or the evictions it brought)
// and the end of the job. A follower (shards 1..k-1) reads the log in order and applies it to its
// own StepAggregator through a ShardFollower, so it expects the same workers with the same
// samples at every step. A worker pushes each step to every shard at once and goes on when all
// have answered; since the leader logs a step before answering it, a follower needs to wait for
// the leader only when a worker's push overtakes the log (ShardFollower::Gate).
#ifndef DBS_SERVER_SHARD_EVENTS_H_
#define DBS_SERVER_SHARD_EVENTS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "server/step_aggregator.h"

namespace dbs {

struct ShardEventData {
  enum class Kind { kWorker, kEpoch, kStep, kEnd };
  Kind kind = Kind::kWorker;
  int worker_id = 0;  // kWorker
  std::string token;  // kWorker
  int epoch = 0;      // kEpoch, kStep
  int step = 0;       // kStep
  // kEpoch: the epoch's quotas, one per step. kStep with `changed`: the quotas of the steps
  // after `step`, through the new last step.
  StepQuotas quotas;
  bool changed = false;
  std::set<int> dead;   // kStep: workers removed at this step
  absl::Status status;  // kEnd
};

// The leader's log. Thread-safe.
class ShardLog {
 public:
  // `num_shards` > 1; `settings` are the leader's TrainingSettings.
  ShardLog(int num_shards, std::map<std::string, std::string> settings);

  // Shard `shard` asks to follow (with the shard count and settings it was started with).
  // FAILED_PRECONDITION, naming the difference, for another shard count, an index out of
  // range, other settings, or a shard that is following already.
  absl::Status Join(int shard, int num_shards, const std::map<std::string, std::string>& settings);
  // Its stream ended: it may join again (a restarted follower) while no worker has registered.
  void Part(int shard);
  // OK once every follower has joined (workers may register); UNAVAILABLE naming the missing.
  absl::Status Admit() const;

  void Append(ShardEventData event);

  // The event at position `next` (from 0) into `*out`: true when it exists. Otherwise false,
  // and `wake` runs once (on the appending thread, outside the lock) when the next event
  // arrives. Events every joined follower has read may be dropped from memory.
  bool Next(int shard, int64_t next, ShardEventData* out, std::function<void()> wake);

 private:
  const int num_shards_;
  const std::map<std::string, std::string> settings_;
  mutable absl::Mutex mu_;
  std::map<int, int64_t> joined_ ABSL_GUARDED_BY(mu_);  // shard -> next position it reads
  std::deque<ShardEventData> events_ ABSL_GUARDED_BY(mu_);
  int64_t base_ ABSL_GUARDED_BY(mu_) = 0;  // position of events_.front()
  bool workers_seen_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> wakers_ ABSL_GUARDED_BY(mu_);
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// A follower's side: applies the leader's events to `aggregator`. Thread-safe.
class ShardFollower {
 public:
  // `aggregator` must outlive the follower. Calls that wait for the leader (Gate, Authenticate)
  // wait at most `wait`.
  ShardFollower(StepAggregator* aggregator, absl::Duration wait);

  // The leader's next event, in log order.
  void Apply(const ShardEventData& event);
  // The leader is gone before the job ended: every push fails with `why`.
  void Lost(const absl::Status& why);

  // Before a push of (epoch, step): waits until the leader has begun `epoch` and completed the
  // step before `step`, so the barrier expects what the leader's does. UNAVAILABLE when that
  // does not happen within the wait. A push further ahead is not waited for (the barrier
  // refuses it).
  absl::Status Gate(int epoch, int step);
  // OK when `token` is worker `worker_id`'s (as Scheduler::Authenticate); an id the leader has
  // not announced yet is waited for.
  absl::Status Authenticate(int worker_id, absl::string_view token);

  // Blocks until the job has ended (or the leader was lost); returns how.
  absl::Status Wait();
  bool WaitFor(absl::Duration timeout);

 private:
  void ApplyStep(const ShardEventData& e);

  StepAggregator* const aggregator_;
  const absl::Duration wait_;
  mutable absl::Mutex mu_;
  std::map<int, std::string> tokens_ ABSL_GUARDED_BY(mu_);
  int epoch_ ABSL_GUARDED_BY(mu_) = -1;  // the leader's latest epoch
  int done_ ABSL_GUARDED_BY(mu_) = 0;    // steps of it the leader completed
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_SHARD_EVENTS_H_
