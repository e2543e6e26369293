// PsServer: the dbs_ps process as an object (flags -> ServerConfig -> PsServer, as Ray's
// GcsServer). It owns the training job, the two gRPC services in front of it, supervision
// (dead workers, stalls) and shutdown; dbs_ps's main only parses flags and handles signals.
#ifndef DBS_SERVER_PS_SERVER_H_
#define DBS_SERVER_PS_SERVER_H_

#include <atomic>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "server/job_config.h"
#include "server/metrics.h"
#include "server/parameter_service.h"
#include "server/scheduler_service.h"
#include "server/shard_events.h"
#include "server/shard_service.h"
#include "server/status_http.h"
#include "server/step_trace.h"
#include "server/training_job.h"

namespace dbs {

struct ServerConfig {
  JobConfig job;
  std::string host = "0.0.0.0";
  int port = 50051;          // 0: any free port (see port())
  std::string port_file;     // where the bound port is written once serving ('' : nowhere)
  int max_message_mb = 512;  // largest gRPC message sent or accepted
  // gRPC's memory for calls in flight (a ResourceQuota): past it new calls and reads wait or
  // fail instead of growing the process without limit.
  int memory_quota_mb = 4096;
  // Serve AttachSharedMemory: workers on this host push through shared memory.
  bool shared_memory = true;
  std::string summary_path;     // the JSON run summary ('' : none)
  std::string step_trace_path;  // a JSON line per completed step (StepTrace; '' : none)
  bool restore = false;         // continue from the newest valid checkpoint in job.checkpoint_dir
  // Restore when job.checkpoint_dir holds a valid checkpoint, start fresh when it holds none
  // (for orchestrators that restart the same command).
  bool restore_if_present = false;
  bool restore_override = false;  // accept a checkpoint written with other training settings
  std::string job_token;          // the secret RegisterWorker must carry ('' : none)
  // TLS (PEM contents): a certificate and key turn TLS on; a client CA makes it mutual (every
  // worker must present a certificate that CA signed).
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_client_ca_pem;
  // The HTTP endpoint (/metrics, /status.json, /): -1 off, 0 any free port.
  int metrics_port = -1;
  std::string metrics_host;       // '' : the same as `host`
  std::string metrics_port_file;  // where its bound port is written ('' : nowhere)
  // After training: time for workers to leave, and for the status page to show the end.
  absl::Duration linger = absl::Seconds(10);
  absl::Duration supervise_every = absl::Milliseconds(250);
  // A sharded job (docs/dataplane.md#shards): this process keeps shard `shard` of `num_shards`
  // of the model's values. Shard 0 (the leader) hosts the scheduler; the others follow the
  // leader at `leader` (host:port) and serve the ParameterService only.
  int shard = 0;
  int num_shards = 1;
  std::string leader;
  // Called when the model's first registration has stored its values, and when an update lets
  // go of the buffers kept for encoding answers over gRPC that no answer needs any more (the
  // workers share memory): main hands the memory the allocator holds free back to the kernel
  // (ReleaseFreedMemory), which is then mostly what the registration used for a moment (the
  // values as received and encoded, gRPC's buffers for them) and the steps do not reuse where
  // workers share memory. Null: nothing.
  std::function<void()> release_freed_memory;
};

// gRPC's memory quota against the registered model (docs/dataplane.md#grpcs-memory-quota):
// a quota must hold one step's pushes, every worker's whole gradient on the wire at once, and
// kQuotaHeadroomMb more. Below that, gRPC's flow control can stop reading every push at once
// and the job stalls: measured at 1M, 10M and 25M parameters with 4 workers, where every
// stall came below this bound and no run at or above it stalled. Returns the warning to log
// (naming the flag, the figure and what to do), or nothing when the quota is enough.
inline constexpr int kQuotaHeadroomMb = 16;
std::optional<std::string> MemoryQuotaShortfall(const ServerConfig& config, int64_t model_values);

// INVALID_ARGUMENT, naming the setting, for any bad part (the job's included).
absl::Status ValidateServerConfig(const ServerConfig& config);

// The files the server will write: the checkpoint folder and the summary (CheckWritable*).
// INVALID_ARGUMENT naming the flag, the path and the reason.
absl::Status CheckServerFiles(const ServerConfig& config);

// When `config` restores (restore, restore_if_present) from a checkpoint directory whose job
// ended ok (its kFinishedRecord): the line that says what it trained and how to train a new
// job, for a dbs_ps that then exits 0 without serving or touching the summary. NOT_FOUND
// otherwise.
absl::StatusOr<std::string> FinishedJob(const ServerConfig& config);

class PsServer {
 public:
  // Validates the configuration, creates the job (restoring the newest valid checkpoint when
  // asked), starts serving and writes the port file. `clock` must outlive the server.
  static absl::StatusOr<std::unique_ptr<PsServer>> Start(const ServerConfig& config,
                                                         const Clock* clock);
  ~PsServer();

  int port() const { return port_; }
  // The HTTP endpoint's port (0 when off).
  int metrics_port() const { return http_ == nullptr ? 0 : http_->port(); }
  TrainingJob* job() { return job_.get(); }
  ShardLog* shard_log() { return shard_log_.get(); }  // null but on a sharded job's leader

  // Supervises the job until it ends, writes the summary, prints the human summary to `out`,
  // lets the workers leave (at most `linger`), stops serving gRPC, keeps the status page up
  // with the final state for the rest of `linger` and stops. Returns how training ended.
  absl::Status Run(std::ostream& out);

  // Ends the job early (a signal): every waiting worker is released and, with a checkpoint
  // directory, Run writes a final checkpoint. Thread-safe.
  void Stop(const absl::Status& why);

 private:
  PsServer(const ServerConfig& config, std::unique_ptr<TrainingJob> job, const Clock* clock);
  // The newest valid checkpoint; a sharded job's leader waits for its followers first and takes
  // the newest that every shard holds.
  absl::Status RestoreNewestCheckpoint();
  // Where each valid checkpoint in the checkpoint directory stands.
  std::set<CheckpointAt> CheckpointsHeld() const;
  // The constructor's part for a sharded job: the leader's shard log and service, and what it
  // does when a follower is lost; a follower's link to the leader, its gate and checkpoints.
  void LeadShards();
  void FollowLeader(const std::string& token_key);
  // A follower: its own checkpoint of the leader's restored step (see ShardFollower).
  absl::Status RestoreShard(int64_t version, int epoch, int step, const StepQuotas& quotas);
  // Binds the port and starts the services, NOT_SERVING.
  absl::Status Listen();
  // Serves: health SERVING, calls accepted, the port file written.
  absl::Status Open();
  std::shared_ptr<grpc::ServerCredentials> Credentials() const;
  // Run's two cases. A follower shard: tells the leader of workers whose pushes it still waits
  // for, until the leader ends the job. Otherwise: supervises the job (dead workers, stalls),
  // then writes the final checkpoint after a stop, the summary and the record.
  absl::Status RunFollower(std::ostream& out);
  absl::Status RunLeader(std::ostream& out);
  // Writes the JSON summary (when configured) and prints the human one; returns the JSON.
  nlohmann::json WriteSummary(std::ostream& out);
  // A job that ended ok: its record in the checkpoint directory (FinishedJob).
  void RecordFinished(const nlohmann::json& summary);
  void Shutdown(const absl::Status& result);
  // Cancels the link to the leader and joins its thread (a follower; nothing otherwise).
  void StopLink();

  absl::Status StartHttp();

  // A follower's part: follows the leader until the job ends.
  absl::Status StartFollowing();
  // Once the model is registered: warns when the memory quota cannot hold a step's pushes
  // (MemoryQuotaShortfall). Called from Run's thread.
  void CheckMemoryQuota();
  bool follower() const { return config_.shard > 0; }

  const ServerConfig config_;
  const Clock* const clock_;
  std::unique_ptr<TrainingJob> job_;
  std::unique_ptr<ShardLog> shard_log_;              // the leader of a sharded job
  std::unique_ptr<ShardServiceImpl> shard_service_;  // the leader of a sharded job
  std::unique_ptr<ShardFollower> follower_;          // a follower
  std::unique_ptr<LeaderLink> link_;                 // a follower
  std::thread link_thread_;
  Metrics metrics_;
  std::unique_ptr<StepTrace> step_trace_;
  SchedulerServiceImpl scheduler_service_;
  ParameterServiceImpl parameter_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<StatusHttpServer> http_;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> serving_{false};  // false until Open
  bool quota_checked_ = false;        // Run's thread only
  std::string quota_shortfall_;       // the warning, once checked ('' : none)
};

}  // namespace dbs

#endif  // DBS_SERVER_PS_SERVER_H_
