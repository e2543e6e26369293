// The ShardService adapter (dbs.v1.ShardService.Follow on the leader of a sharded job) and the
// follower's side of it. They carry ShardLog's events (server/shard_events.h) between processes;
// the logic is in ShardLog and ShardFollower.
#ifndef DBS_SERVER_SHARD_SERVICE_H_
#define DBS_SERVER_SHARD_SERVICE_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/dbs.grpc.pb.h"
#include "server/shard_events.h"

namespace dbs {

class ShardServiceImpl final : public v1::ShardService::CallbackService {
 public:
  // What the leader does with a follower's MissingPushes (TrainingJob::RemoveMissingAtShard).
  using OnMissing = std::function<absl::Status(int shard, const MissingPushes& missing)>;
  // `log` must outlive the service. With a `job_token`, every call requires it.
  ShardServiceImpl(ShardLog* log, std::string job_token, OnMissing on_missing)
      : log_(log), job_token_(std::move(job_token)), on_missing_(std::move(on_missing)) {}

  grpc::ServerWriteReactor<v1::ShardEvent>* Follow(grpc::CallbackServerContext* ctx,
                                                   const v1::FollowRequest* request) override;
  grpc::ServerUnaryReactor* ReportMissing(grpc::CallbackServerContext* ctx,
                                          const v1::MissingPushes* request,
                                          v1::MissingPushesReply* reply) override;

 private:
  ShardLog* const log_;
  const std::string job_token_;
  const OnMissing on_missing_;
};

struct FollowConfig {
  std::string leader;  // host:port of shard 0
  int shard = 1;
  int num_shards = 2;
  std::map<std::string, std::string> settings;  // this shard's TrainingSettings
  std::set<CheckpointAt> checkpoints;           // with --restore: the ones it holds
  std::string job_token;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Duration connect_timeout = absl::Minutes(2);  // for the leader to come up
  // For a stream that broke to be continued (the leader holds the place as long: the job's
  // worker timeout).
  absl::Duration rejoin_timeout = absl::Seconds(60);
  // How often the link pings the leader, and how long it waits for the answer before it takes
  // the connection for dead (at least 5 s: the leader refuses pings more frequent).
  absl::Duration keepalive = absl::Seconds(20);
};

// Follows the leader until the job ends, applying its events to `follower`; connects with
// retries for at most `connect_timeout`, and continues a stream that broke (retrying for at most
// `rejoin_timeout`). Returns how following ended (OK after the job's end);
// on any error `follower` has been told the leader is lost. Cancel() ends it early.
class LeaderLink {
 public:
  LeaderLink(FollowConfig config, ShardFollower* follower)
      : config_(std::move(config)), follower_(follower) {}
  absl::Status Run();
  void Cancel();
  // Tells the leader about `missing` (ShardService.ReportMissing), waiting at most `timeout`.
  absl::Status ReportMissing(const MissingPushes& missing, absl::Duration timeout);

 private:
  std::shared_ptr<grpc::Channel> Channel();
  // Keeps the key the leader gave this follower on its Follow stream (ShardLog::Join).
  void KeepShardKey(const grpc::ClientContext& ctx);
  // How one Follow stream went: the events it carried, whether the last ended the job (and
  // how), and how the stream finished.
  struct Followed {
    int64_t events = 0;
    bool ended = false;
    absl::Status result;
    grpc::Status finished;
  };
  // One Follow stream, its events applied to the follower as they come; false when cancelled.
  bool FollowOnce(v1::ShardService::Stub* stub, const v1::FollowRequest& req, Followed* out);

  const FollowConfig config_;
  ShardFollower* const follower_;
  absl::Mutex mu_;
  std::shared_ptr<grpc::Channel> channel_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* current_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string shard_key_ ABSL_GUARDED_BY(mu_);   // from the open Follow stream
  std::string resume_key_ ABSL_GUARDED_BY(mu_);  // from the last one
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace dbs

#endif  // DBS_SERVER_SHARD_SERVICE_H_
