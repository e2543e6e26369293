#include "server/ps_server.h"

#include <cmath>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/secrets.h"
#include "common/shard_range.h"
#include "common/status_macros.h"
#include "common/wire_values.h"
#include "glog/logging.h"
#include "server/checkpoint.h"
#include "server/run_summary.h"

namespace dbs {

absl::Status ValidateServerConfig(const ServerConfig& c) {
  if (c.port < 0 || c.port > 65535) return absl::InvalidArgumentError("port must be in [0, 65535]");
  if (c.max_message_mb < 1 || c.max_message_mb > 2047) {
    return absl::InvalidArgumentError("max_message_mb must be in [1, 2047]");
  }
  if (c.memory_quota_mb < 2 * c.max_message_mb || c.memory_quota_mb > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_quota_mb must be in [2 * max_message_mb = ", 2 * c.max_message_mb, ", 1048576]"));
  }
  if ((c.restore || c.restore_if_present) && c.job.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("restore needs a checkpoint_dir");
  }
  if (c.linger < absl::ZeroDuration()) return absl::InvalidArgumentError("linger must be >= 0");
  if (c.metrics_port < -1 || c.metrics_port > 65535) {
    return absl::InvalidArgumentError("metrics_port must be -1 (off) or in [0, 65535]");
  }
  if (c.tls_cert_pem.empty() != c.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and its key");
  }
  if (!c.tls_client_ca_pem.empty() && c.tls_cert_pem.empty()) {
    return absl::InvalidArgumentError("a client CA (mutual TLS) needs the server's certificate");
  }
  if (c.num_shards < 1 || c.num_shards > kMaxShards || c.shard < 0 || c.shard >= c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard must be i/k with 0 <= i < k <= ", kMaxShards));
  }
  if (c.shard > 0 && c.leader.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", c.shard, "/", c.num_shards,
                     " follows the leader (shard 0): give its address (--leader=host:port)"));
  }
  if (c.shard == 0 && !c.leader.empty()) {
    return absl::InvalidArgumentError("shard 0 is the leader: --leader is for shards 1..k-1");
  }
  if (c.supervise_every <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("supervise_every must be > 0");
  }
  return ValidateJobConfig(c.job);
}

absl::Status CheckServerFiles(const ServerConfig& config) {
  if (!config.job.checkpoint_dir.empty()) {
    DBS_RETURN_IF_ERROR(CheckWritableFolder(config.job.checkpoint_dir, "--checkpoint_dir"));
  }
  // A file in the checkpoint folder is covered by its check (the folder may not exist yet).
  const auto folder = [](std::string path) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    return path;
  };
  for (const auto& [path, flag] : {std::pair(config.summary_path, "--summary_path"),
                                   std::pair(config.step_trace_path, "--step_trace_path")}) {
    const size_t slash = path.rfind('/');
    const bool in_checkpoints = !config.job.checkpoint_dir.empty() && slash != std::string::npos &&
                                folder(path.substr(0, slash)) == folder(config.job.checkpoint_dir);
    if (!path.empty() && !in_checkpoints) DBS_RETURN_IF_ERROR(CheckWritable(path, flag));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FinishedJob(const ServerConfig& config) {
  const std::string& dir = config.job.checkpoint_dir;
  if (dir.empty() || !(config.restore || config.restore_if_present)) {
    return absl::NotFoundError("not restoring");
  }
  DBS_ASSIGN_OR_RETURN(const std::string record, ReadFinishedRecord(dir));
  std::string what;
  const nlohmann::json r = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
  if (r.is_object() && r.value("shard", "").empty()) {
    what = absl::StrFormat("%d epochs, final test accuracy %.2f%%, finished %s",
                           r.value("epochs_completed", 0),
                           100.0 * r.value("final_test_accuracy", 0.0), r.value("finished", "?"));
    if (!r.value("summary_path", "").empty()) {
      absl::StrAppend(&what, ", summary in ", r.value("summary_path", ""));
    }
  } else if (r.is_object()) {
    what = absl::StrCat("shard ", r.value("shard", ""), ", finished ", r.value("finished", "?"));
  } else {
    what = absl::StrCat("its record: ", record.substr(0, 200));
  }
  return absl::StrCat("the job in ", dir, " has finished (", what,
                      "): there is nothing left to train. To train a new job, remove ", dir, "/",
                      kFinishedRecord, " or give another --checkpoint_dir");
}

PsServer::PsServer(const ServerConfig& config, std::unique_ptr<TrainingJob> job, const Clock* clock)
    : config_(config),
      clock_(clock),
      job_(std::move(job)),
      scheduler_service_(job_->scheduler(), config.job_token, CallHooks{&metrics_, &serving_},
                         config.job.wire_dtype),
      parameter_service_(
          job_->store(), job_->aggregator(),
          [this](int id, absl::string_view token, absl::string_view identity) {
            return follower_ != nullptr ? follower_->Authenticate(id, token, identity)
                                        : job_->scheduler()->Authenticate(id, token, identity);
          },
          [job = job_.get()](int id, ParameterSnapshot* parameters) {
            return job->Resume(id, parameters);
          },
          CallHooks{&metrics_, &serving_}, config.job.wire_dtype, clock) {
  job_->AddObserver(&metrics_);
  // A shard of a sharded job may hold a push until its leader has done the step the worker
  // redoes, reading the worker's region only then: its shards share no memory.
  parameter_service_.ServeSharedMemory(config.shared_memory && config.num_shards <= 1);
  parameter_service_.SetFreedMemoryHook(config.release_freed_memory);
  if (!follower()) {
    // The job starts with workers that can train in it: a worker whose model is refused is
    // not one of the expected ones.
    job_->scheduler()->StartWithAcceptedModels();
    parameter_service_.SetModelAcceptedHook([job = job_.get()](int worker) {
      const absl::Status s = job->scheduler()->ModelAccepted(worker);
      if (!s.ok()) LOG(WARNING) << "worker " << worker << "'s model: " << s.message();
    });
  }
  job_->SetRemovedHook([service = &parameter_service_](const std::set<int>& workers) {
    service->DropSharedMemory(workers);
  });
  // With a job secret, worker tokens are signed with a key derived from it, so that every shard
  // can refuse a made-up token at once (common/secrets.h).
  const std::string token_key =
      config.job_token.empty() ? std::string() : TokenKeyFromSecret(config.job_token);
  job_->scheduler()->SetTokenKey(token_key);
  if (config.num_shards > 1 && config.shard == 0) {
    LeadShards();
  } else if (follower()) {
    FollowLeader(token_key);
  }
}

PsServer::~PsServer() {
  // The link's thread runs the follower's callbacks, which touch server_: it ends first.
  StopLink();
  if (server_ != nullptr) Shutdown(absl::CancelledError("the server object was destroyed"));
}

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Start(const ServerConfig& config,
                                                          const Clock* clock) {
  DBS_RETURN_IF_ERROR(ValidateServerConfig(config));
  if (absl::StatusOr<std::string> finished = FinishedJob(config); finished.ok()) {
    return absl::FailedPreconditionError(*finished);
  }
  if (!config.job.checkpoint_dir.empty() && !config.restore && !config.restore_if_present &&
      ReadFinishedRecord(config.job.checkpoint_dir).ok()) {
    // A new job in a finished job's directory: once it has checkpoints of its own, a restart
    // must restore them.
    DBS_RETURN_IF_ERROR(RemoveFinishedRecord(config.job.checkpoint_dir));
    LOG(INFO) << "a new job in " << config.job.checkpoint_dir << ", where one had finished";
  }
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<TrainingJob> job, TrainingJob::Create(config.job, clock));
  std::unique_ptr<PsServer> server(new PsServer(config, std::move(job), clock));
  DBS_ASSIGN_OR_RETURN(
      server->step_trace_,
      StepTrace::Open(config.step_trace_path, config.restore || config.restore_if_present, clock));
  if (server->step_trace_ != nullptr) server->job_->AddObserver(server->step_trace_.get());
  // The port opens first, NOT_SERVING (its calls answered UNAVAILABLE, which workers retry),
  // so an orchestrator sees a live process that is not ready while a checkpoint loads.
  DBS_RETURN_IF_ERROR(server->Listen());
  // A follower restores when its leader says from which step (ShardFollower, RESUME).
  if ((config.restore || config.restore_if_present) && config.shard == 0) {
    const absl::Status restored = server->RestoreNewestCheckpoint();
    if (absl::IsNotFound(restored) && config.restore_if_present && !config.restore) {
      LOG(INFO) << "no checkpoint in " << config.job.checkpoint_dir << ": starting a new job";
    } else if (!restored.ok()) {
      return restored;
    }
  }
  if (server->shard_log_ != nullptr) server->shard_log_->SeedFresh();
  DBS_RETURN_IF_ERROR(server->Open());
  if (server->follower()) DBS_RETURN_IF_ERROR(server->StartFollowing());
  DBS_RETURN_IF_ERROR(server->StartHttp());
  return server;
}

absl::Status PsServer::Open() {
  // A follower that may restore serves once the leader has said where the job stands (its
  // first event): until then its parameters may be about to be replaced.
  const bool wait_for_leader = follower() && (config_.restore || config_.restore_if_present);
  if (!wait_for_leader) {
    serving_.store(true);
    server_->GetHealthCheckService()->SetServingStatus(true);
  }
  if (!config_.port_file.empty()) {
    DBS_RETURN_IF_ERROR(WriteFileAtomic(config_.port_file, absl::StrCat(port_, "\n")));
  }
  const SchedulerConfig& s = config_.job.scheduler;
  if (follower()) {
    LOG(INFO) << "dbs_ps shard " << config_.shard << "/" << config_.num_shards << " listening on "
              << config_.host << ":" << port_ << ", following the leader at " << config_.leader;
    return absl::OkStatus();
  }
  LOG(INFO) << "dbs_ps listening on " << config_.host << ":" << port_
            << (config_.tls_cert_pem.empty()        ? " (plaintext)"
                : config_.tls_client_ca_pem.empty() ? " (TLS)"
                                                    : " (mutual TLS)")
            << (config_.job_token.empty() ? "" : ", job secret required") << ", waiting for "
            << s.expected_workers << " workers; " << s.epochs << " epochs, global batch "
            << s.global_batch << ", policy " << PolicyName(config_.job.policy);
  return absl::OkStatus();
}

absl::Status PsServer::StartHttp() {
  if (config_.metrics_port < 0) return absl::OkStatus();
  const std::string host = config_.metrics_host.empty() ? config_.host : config_.metrics_host;
  DBS_ASSIGN_OR_RETURN(
      http_, StatusHttpServer::Start(host, config_.metrics_port, job_.get(), &metrics_, clock_));
  if (!config_.metrics_port_file.empty()) {
    DBS_RETURN_IF_ERROR(
        WriteFileAtomic(config_.metrics_port_file, absl::StrCat(http_->port(), "\n")));
  }
  return absl::OkStatus();
}

namespace {

CheckpointAt PositionOf(const JobState& st) {
  return {st.aggregator.store.version, st.aggregator.epoch, st.aggregator.step};
}

std::string Describe(const std::set<CheckpointAt>& positions) {
  std::string out;
  for (const CheckpointAt& c : positions) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", "version ", c.version, " (epoch ", c.epoch + 1,
                    " step ", c.step + 1, ")");
  }
  return out.empty() ? "none" : out;
}

}  // namespace

std::set<CheckpointAt> PsServer::CheckpointsHeld() const {
  std::set<CheckpointAt> held;
  // Every checkpoint that decodes, newest first; none is kept in memory.
  (void)LoadNewestCheckpoint(config_.job.checkpoint_dir, nullptr, nullptr, [&](const JobState& st) {
    held.insert(PositionOf(st));
    return false;
  });
  return held;
}

absl::Status PsServer::RestoreNewestCheckpoint() {
  std::vector<std::string> refused;
  std::string path;
  std::function<bool(const JobState&)> wanted;
  std::map<int, std::set<CheckpointAt>> followers;
  if (shard_log_ != nullptr) {
    // A sharded job continues from the newest step every shard holds a checkpoint of.
    LOG(INFO) << "waiting for the other " << config_.num_shards - 1
              << " shard(s) to say which checkpoints they hold";
    DBS_ASSIGN_OR_RETURN(followers, shard_log_->AwaitFollowers(config_.job.stall_timeout));
    wanted = [&](const JobState& st) {
      for (const auto& [shard, held] : followers) {
        if (held.count(PositionOf(st)) == 0) return false;
      }
      return true;
    };
  }
  absl::StatusOr<JobState> state =
      LoadNewestCheckpoint(config_.job.checkpoint_dir, &refused, &path, wanted);
  if (!state.ok() && shard_log_ != nullptr && !CheckpointsHeld().empty()) {
    std::string held = absl::StrCat("this shard holds ", Describe(CheckpointsHeld()));
    for (const auto& [shard, positions] : followers) {
      absl::StrAppend(&held, "; shard ", shard, " holds ", Describe(positions));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("no checkpoint of the same step is held by every shard (", held,
                     "): restart every shard with its own --checkpoint_dir"));
  }
  for (const std::string& r : refused) LOG(ERROR) << "refusing checkpoint " << r;
  if (!state.ok()) return state.status();
  DBS_RETURN_IF_ERROR(job_->Restore(*state, config_.restore_override));
  LOG(INFO) << "restored " << path << ": epoch " << state->aggregator.epoch + 1 << ", step "
            << state->aggregator.step + 1 << ", parameter version "
            << state->aggregator.store.version;
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> PsServer::Credentials() const {
  if (config_.tls_cert_pem.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions tls(
      config_.tls_client_ca_pem.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  tls.pem_root_certs = config_.tls_client_ca_pem;
  tls.pem_key_cert_pairs.push_back({config_.tls_key_pem, config_.tls_cert_pem});
  return grpc::SslServerCredentials(tls);
}

std::optional<std::string> MemoryQuotaShortfall(const ServerConfig& config, int64_t model_values) {
  const double mib = 1024.0 * 1024.0;
  const double model_mib =
      static_cast<double>(model_values) * BytesPerValue(config.job.wire_dtype) / mib;
  const int workers = config.job.scheduler.expected_workers;
  const double needed = workers * model_mib + kQuotaHeadroomMb;
  if (config.memory_quota_mb >= needed) return std::nullopt;
  return absl::StrFormat(
      "--memory_quota_mb=%d is less than a step's pushes need: %d workers x %.1f MiB (%d values "
      "in %s) + %d MiB = %.0f MiB. Under that pressure gRPC can stop reading every push at once "
      "and the job stalls (docs/dataplane.md#grpcs-memory-quota): raise --memory_quota_mb to "
      "%.0f",
      config.memory_quota_mb, workers, model_mib, model_values,
      WireDtypeName(config.job.wire_dtype), kQuotaHeadroomMb, std::ceil(needed), std::ceil(needed));
}

void PsServer::CheckMemoryQuota() {
  if (quota_checked_ || !job_->store()->registered()) return;
  quota_checked_ = true;
  const std::optional<std::string> shortfall =
      MemoryQuotaShortfall(config_, job_->store()->num_elements());
  if (!shortfall.has_value()) return;
  quota_shortfall_ = *shortfall;
  LOG(WARNING) << quota_shortfall_;
}

absl::Status PsServer::Listen() {
  const std::string address = absl::StrCat(config_.host, ":", config_.port);
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second dbs_ps on the same port would then share it
  // and split the workers between two jobs. Refuse the port instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Workers ping every 20 s while they wait (keepalive); allow it.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // grpc.health.v1.Health: NOT_SERVING while starting or restoring, SERVING while the job
  // accepts workers and steps, NOT_SERVING once it is over.
  grpc::EnableDefaultHealthCheckService(true);
  builder.AddListeningPort(address, Credentials(), &port_);
  grpc::ResourceQuota quota("dbs_ps");
  quota.Resize(static_cast<size_t>(config_.memory_quota_mb) << 20);
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(config_.max_message_mb << 20);
  builder.SetMaxSendMessageSize(config_.max_message_mb << 20);
  if (!follower()) builder.RegisterService(&scheduler_service_);  // the leader's alone
  builder.RegisterService(&parameter_service_);
  if (shard_service_ != nullptr) builder.RegisterService(shard_service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (in use, or not a local address?)"));
  }
  server_->GetHealthCheckService()->SetServingStatus(false);
  return absl::OkStatus();
}

absl::Status PsServer::Run(std::ostream& out) {
  return follower() ? RunFollower(out) : RunLeader(out);
}

absl::Status PsServer::RunLeader(std::ostream& out) {
  while (!job_->WaitFor(config_.supervise_every)) {
    CheckMemoryQuota();
    job_->CheckDeadWorkers();
    if (shard_log_ != nullptr) shard_log_->CheckAway();
    if (job_->CheckStall() && !quota_shortfall_.empty()) {
      LOG(ERROR) << "the stall may be gRPC's memory quota: " << quota_shortfall_;
    }
  }
  const absl::Status result = job_->Wait();
  server_->GetHealthCheckService()->SetServingStatus(false);
  // (Not for a sharded job: the other shards could not write one of the same step.)
  if (stopped_.load() && !config_.job.checkpoint_dir.empty() && config_.num_shards == 1) {
    // Stopped from outside (SIGTERM from an orchestrator): keep everything done so far, so a
    // restart with --restore continues from here.
    const absl::Status saved = job_->SaveCheckpoint();
    if (saved.ok()) {
      LOG(INFO) << "final checkpoint written to " << config_.job.checkpoint_dir;
    } else {
      LOG(ERROR) << "final checkpoint failed: " << saved;
    }
  }
  const nlohmann::json summary = WriteSummary(out);
  if (result.ok()) {
    RecordFinished({{"status", "ok"},
                    {"epochs_completed", summary["epochs_completed"]},
                    {"final_test_accuracy", summary["final_test_accuracy"]},
                    {"summary_path", config_.summary_path}});
  }
  Shutdown(result);
  return result;
}

nlohmann::json PsServer::WriteSummary(std::ostream& out) {
  const RunInfo run = job_->Run();
  nlohmann::json summary = BuildSummary(run);
  if (!config_.summary_path.empty()) {
    const absl::Status written = WriteFileAtomic(config_.summary_path, summary.dump(2) + "\n");
    if (written.ok()) {
      LOG(INFO) << "summary written to " << config_.summary_path;
    } else {
      LOG(ERROR) << written.message();
    }
  }
  out << HumanSummary(run) << std::flush;
  return summary;
}

void PsServer::RecordFinished(const nlohmann::json& summary) {
  if (config_.job.checkpoint_dir.empty()) return;
  nlohmann::json record = summary;
  record["finished"] =
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", clock_->Now(), absl::UTCTimeZone());
  const absl::Status written =
      WriteFinishedRecord(config_.job.checkpoint_dir, record.dump(2) + "\n");
  if (!written.ok()) LOG(ERROR) << "the finished job's record: " << written.message();
}

void PsServer::Shutdown(const absl::Status& result) {
  // Let workers fetch their final plan and leave, and workers removed while cut off call once
  // more and hear that the job is done (rather than find no server, fail and be restarted by
  // their orchestrator); then release anything still waiting.
  const absl::Time linger_until = absl::Now() + config_.linger;
  const Scheduler* scheduler = job_->scheduler();
  while (result.ok() &&
         (scheduler->active_workers() > 0 || scheduler->removed_workers_not_back() > 0) &&
         absl::Now() < linger_until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  job_->Abort(absl::UnavailableError("dbs_ps is shutting down"));
  server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  server_.reset();
  // The status page and the metrics show the final state until the linger has passed; not
  // after a signal, whose sender waits for the exit.
  while (http_ != nullptr && !stopped_.load() && absl::Now() < linger_until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  http_.reset();
}

void PsServer::Stop(const absl::Status& why) {
  stopped_.store(true);
  if (follower_ != nullptr) follower_->Lost(why);
  job_->Abort(why);
}

}  // namespace dbs
