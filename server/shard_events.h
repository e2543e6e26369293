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
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/plan.h"
#include "server/liveness_monitor.h"
#include "server/step_aggregator.h"

namespace dbs {

struct ShardEventData {
  enum class Kind { kWorker, kEpoch, kStep, kEnd, kCheckpoint, kResume };
  Kind kind = Kind::kWorker;
  int worker_id = 0;     // kWorker
  std::string token;     // kWorker
  std::string identity;  // kWorker: the client certificate its token is bound to ("": none)
  int epoch = 0;         // kEpoch, kStep, kCheckpoint, kResume
  int step = 0;          // kStep, kResume
  // kEpoch, kResume: the epoch's quotas, one per step. kStep with `changed`: the quotas of the
  // steps after `step`, through the new last step.
  StepQuotas quotas;
  bool changed = false;
  std::set<int> dead;  // kStep: workers removed at this step
  // kStep: the leader checkpointed after this step. kEpoch: a kCheckpoint event (of the epoch
  // before) follows before this epoch's first step. kCheckpoint: the leader's checkpoint was
  // written.
  bool checkpoint = false;
  int64_t version = 0;  // kResume: the parameters' version (-1: a new job, nothing to restore)
  absl::Status status;  // kEnd
};

// A follower's step that has waited the worker timeout for pushes the leader had: (epoch,
// step) is complete on the leader, so `workers` pushed it there and died (or lost their link)
// before their push reached this shard. The leader removes them (TrainingJob::
// RemoveMissingAtShard), since its own barrier waits for nobody: every worker waits for this
// shard's answer.
struct MissingPushes {
  int epoch = 0;
  int step = 0;
  std::set<int> workers;
};

// Where a checkpoint stands (a follower's, as it tells the leader).
struct CheckpointAt {
  int64_t version = 0;
  int epoch = 0;
  int step = 0;
  bool operator<(const CheckpointAt& o) const {
    return std::tie(version, epoch, step) < std::tie(o.version, o.epoch, o.step);
  }
};

// A follower's stream as ShardLog::Join opened it.
struct ShardStream {
  // The key the follower proves itself with on its calls to the leader (Vouches), and on a
  // stream that continues this one: random, its own, for as long as it follows.
  std::string key;
  int64_t from = 0;  // the position of the first event the stream carries
  int64_t id = 0;    // this stream among the shard's (Part, Next)
};

// A follower whose stream broke continues from where it stands: it shows the key of its stream
// and the number of events it has applied.
struct ShardResume {
  std::string key;
  int64_t from = 0;
};

// The leader's log. Thread-safe.
class ShardLog {
 public:
  // `num_shards` > 1; `settings` are the leader's TrainingSettings. A follower whose stream
  // breaks once workers have registered has `rejoin_grace` by `clock` to continue it.
  ShardLog(int num_shards, std::map<std::string, std::string> settings, const Clock* clock,
           absl::Duration rejoin_grace);

  // Shard `shard` asks to follow (with the shard count and settings it was started with).
  // FAILED_PRECONDITION, naming the difference, for another shard count, an index out of
  // range, other settings, or a job that has gone on without it. UNAVAILABLE (the follower
  // retries) while its previous stream is still open, and while the job is ending because a
  // shard was lost: the leader is about to exit and be restarted.
  // A follower started with --restore names the checkpoints it holds.
  // With `resume`, the follower continues its broken stream (or one the leader has not seen
  // break, which it replaces) from `resume->from`; PERMISSION_DENIED for another key,
  // FAILED_PRECONDITION for a shard this leader does not hold a place for (it restarted) or for
  // events it no longer holds (the shard is lost). A shard away from its broken stream that
  // joins without one has been restarted: it takes its place afresh before workers have
  // registered, and is lost after.
  absl::StatusOr<ShardStream> Join(int shard, int num_shards,
                                   const std::map<std::string, std::string>& settings,
                                   std::set<CheckpointAt> checkpoints = {},
                                   const std::optional<ShardResume>& resume = std::nullopt);
  // Stream `stream` of `shard` ended (a stream that has been replaced changes nothing): the
  // shard is away until it continues its stream or, before any worker has registered, joins
  // afresh (a restarted follower). Away for longer than the grace (CheckAway), it is lost; once
  // workers have registered the job cannot go on without that shard's range of the model, and
  // `on_lost` (SetOnLost) runs, unless the job has ended.
  void Part(int shard, int64_t stream);
  // Loses every shard away for longer than the grace. Call periodically.
  void CheckAway();
  void SetOnLost(std::function<void(int shard)> on_lost);
  // True while shard `shard` follows (its stream is open) and `key` is its stream's.
  bool Vouches(int shard, absl::string_view key) const;
  // OK once every follower has joined and none is away (workers may register); UNAVAILABLE
  // naming the missing.
  absl::Status Admit() const;
  // Waits at most `timeout` for every follower to join; then the checkpoints each holds (by
  // shard), or what Admit says.
  absl::StatusOr<std::map<int, std::set<CheckpointAt>>> AwaitFollowers(absl::Duration timeout);

  void Append(ShardEventData event);
  // Where a restored leader stands (before any follower joins): what a follower needs to
  // continue from the same step. Does not count as workers having registered.
  void Seed(std::vector<ShardEventData> events);
  // A new job (nothing restored): a RESUME of version -1 first, when nothing was seeded, so
  // every follower's first event says whether there is anything to restore.
  void SeedFresh();

  // The event at position `next` (from 0) for stream `stream` of `shard` into `*out`: true
  // when it exists (for a replaced stream: an END that says so). Otherwise false, and `wake`
  // runs once (on the appending thread, outside the lock) when the next event arrives. Events
  // every follower has been sent, but the last kKeptForResume of them, may be dropped.
  bool Next(int shard, int64_t stream, int64_t next, ShardEventData* out,
            std::function<void()> wake);
  // Events kept below every follower's position, for a stream that broke with them in flight.
  static constexpr int64_t kKeptForResume = 4096;

 private:
  // Where a follower stands.
  struct Follower {
    int64_t next = 0;  // the next position its stream reads
    std::string key;
    int64_t stream = 0;
    std::optional<absl::Time> away_since;  // its stream broke
  };
  // Join without and with a stream to continue; each sets *lose when the shard is lost by it.
  absl::StatusOr<ShardStream> JoinLocked(int shard, bool* lose) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<ShardStream> ContinueLocked(int shard, const ShardResume& resume, bool* lose)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the job as having lost `shard`: the callback to run, outside the lock.
  std::function<void(int)> LoseLocked(int shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool GoneOnLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return workers_seen_ || appended_;
  }

  const int num_shards_;
  const std::map<std::string, std::string> settings_;
  const Clock* const clock_;
  const absl::Duration rejoin_grace_;
  mutable absl::Mutex mu_;
  std::map<int, Follower> joined_ ABSL_GUARDED_BY(mu_);                     // by shard
  std::map<int, std::set<CheckpointAt>> checkpoints_ ABSL_GUARDED_BY(mu_);  // by shard
  int64_t streams_ ABSL_GUARDED_BY(mu_) = 0;                                // streams opened
  std::deque<ShardEventData> events_ ABSL_GUARDED_BY(mu_);
  int64_t base_ ABSL_GUARDED_BY(mu_) = 0;  // position of events_.front()
  bool workers_seen_ ABSL_GUARDED_BY(mu_) = false;
  bool appended_ ABSL_GUARDED_BY(mu_) = false;  // the job has gone on (Append, not Seed)
  bool ended_ ABSL_GUARDED_BY(mu_) = false;     // an END was appended
  bool lost_ ABSL_GUARDED_BY(mu_) = false;      // a follower was lost after workers registered
  std::function<void(int shard)> on_lost_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> wakers_ ABSL_GUARDED_BY(mu_);
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// A follower's side: applies the leader's events to `aggregator`. Thread-safe.
class ShardFollower {
 public:
  // `aggregator` must outlive the follower. Its own waits on the leader's thread (an eviction,
  // a checkpoint after a step) last at most `wait`; the calls of workers (Gate, Authenticate)
  // never wait: they run on gRPC's callback threads.
  ShardFollower(StepAggregator* aggregator, absl::Duration wait);

  // How this shard checkpoints: `save` writes its state now; `restore` loads its own checkpoint
  // of `version` and puts the barrier at (epoch, step) with `quotas`. Without them, a leader's
  // checkpoint is not followed and a RESUME ends the follower.
  using Save = std::function<absl::Status()>;
  using Restore =
      std::function<absl::Status(int64_t version, int epoch, int step, const StepQuotas& quotas)>;
  void SetCheckpointing(Save save, Restore restore) {
    save_ = std::move(save);
    restore_ = std::move(restore);
  }

  // Runs once, after the first event from the leader has been applied.
  void SetOnFirstEvent(std::function<void()> first) { first_ = std::move(first); }

  // The leader's next event, in log order.
  void Apply(const ShardEventData& event);
  // The leader is gone before the job ended: every push fails with `why`.
  void Lost(const absl::Status& why);

  // Before a push of (epoch, step): OK once the leader has begun `epoch` and completed the step
  // before `step`, so the barrier expects what the leader's does; UNAVAILABLE before (the
  // worker retries). A push further ahead passes (the barrier refuses it). Never waits.
  absl::Status Gate(int epoch, int step);
  // OK when `token` is worker `worker_id`'s (as Scheduler::Authenticate). An id the leader may
  // be about to announce is answered UNAVAILABLE (the worker retries); NOT_FOUND for one far
  // beyond the known workers. With a token key (the leader's, SetTokenKey), a token the leader
  // did not sign for that id is refused (PERMISSION_DENIED), as is a call with no token
  // (UNAUTHENTICATED). Never waits.
  absl::Status Authenticate(int worker_id, absl::string_view token,
                            absl::string_view identity = "");
  // The key the leader signs worker tokens with (Scheduler::SetTokenKey). Call before serving.
  void SetTokenKey(std::string key);

  // Call periodically with this shard's own monitor (the job's worker timeout): the pushes to
  // tell the leader about, once this shard's step has waited for them for the worker timeout
  // since the leader completed that step. None while the leader has not (it removes a worker
  // that missed a step by itself).
  std::optional<MissingPushes> Missing(LivenessMonitor* liveness);

  // Blocks until the job has ended (or the leader was lost); returns how.
  absl::Status Wait();
  bool WaitFor(absl::Duration timeout);

 private:
  void ApplyStep(const ShardEventData& e);
  // Evicts here the workers the leader removed at `e`'s step (or at the step after this shard's
  // current one: see MissingPushes); true when it did.
  bool EvictDead(const ShardEventData& e);
  // Writes this shard's checkpoint once its barrier has completed `step` of `epoch` (its pushes
  // may still be arriving).
  void SaveAfter(int epoch, int step);
  void SaveNow(int epoch);
  void ApplyResume(const ShardEventData& e);
  void ApplyEvent(const ShardEventData& e);
  Save save_;
  Restore restore_;
  std::function<void()> first_;

  StepAggregator* const aggregator_;
  const absl::Duration wait_;
  mutable absl::Mutex mu_;
  std::map<int, std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> identities_ ABSL_GUARDED_BY(mu_);  // by id, "" : not bound
  std::string token_key_ ABSL_GUARDED_BY(mu_);  // '' : tokens cannot be checked before known
  int epoch_ ABSL_GUARDED_BY(mu_) = -1;         // the leader's latest epoch
  int done_ ABSL_GUARDED_BY(mu_) = 0;           // steps of it the leader completed
  // The leader's end-of-epoch checkpoint is still to come: the epoch's pushes wait for it.
  bool awaiting_checkpoint_ ABSL_GUARDED_BY(mu_) = false;
  // Calls waiting in Authenticate for the leader to announce their worker.
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_SHARD_EVENTS_H_
