// PsServer's part in a sharded job (--shard=i/k): the leader's log and service, a follower's
// link to its leader, its barrier that follows the leader's, and its restore.
#include <algorithm>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "server/checkpoint.h"
#include "server/liveness_monitor.h"
#include "server/ps_server.h"

namespace dbs {

namespace {

// The store's parameter version, 0 before any model is registered.
int64_t ParameterVersion(const ParameterStore* store) {
  const absl::StatusOr<ParameterSnapshot> snap = store->Snapshot();
  return snap.ok() ? snap->version : 0;
}

}  // namespace

void PsServer::LeadShards() {
  // A follower whose stream breaks may continue it for as long as a worker may be away.
  shard_log_ = std::make_unique<ShardLog>(config_.num_shards, TrainingSettings(config_.job), clock_,
                                          config_.job.worker_timeout);
  shard_service_ = std::make_unique<ShardServiceImpl>(
      shard_log_.get(), config_.job_token, [job = job_.get()](int shard, const MissingPushes& m) {
        return job->RemoveMissingAtShard(shard, m.epoch, m.step, m.workers);
      });
  job_->SetShardLog(shard_log_.get());
  parameter_service_.SetGate(
      [job = job_.get()](int worker, int, int) { return job->AdmitPush(worker); });
  // A follower lost mid-job takes its range of the model with it: stop as if told to, so that
  // the workers wait and retry, and every shard can be restarted from their newest common
  // checkpoint (an orchestrator restarts on this exit code: docs/deploying.md#exit-codes).
  shard_log_->SetOnLost([this](int shard) {
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "shard ", shard, "/", config_.num_shards,
        " stopped following: the job cannot go on without its part of the model; restart every "
        "shard with --restore (or --restore_if_present) to continue from the newest "
        "checkpoint they all hold"));
    LOG(ERROR) << why.message();
    Stop(why);
  });
}

void PsServer::FollowLeader(const std::string& token_key) {
  // The leader decides every step's workers and samples; this shard's barrier follows it.
  follower_ = std::make_unique<ShardFollower>(job_->aggregator(), absl::Seconds(10));
  follower_->SetTokenKey(token_key);
  job_->aggregator()->SetStepHook([](const StepStats&) { return std::nullopt; });
  // Only the leader removes workers: a faulty push here is refused, and the worker, which stops,
  // is removed by the leader (its own screen, or this shard's report of its missing push).
  job_->aggregator()->SetFaultyHook(nullptr);
  parameter_service_.SetGate(
      [f = follower_.get()](int, int epoch, int step) { return f->Gate(epoch, step); });
  follower_->SetOnFirstEvent([this] {
    serving_.store(true);
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(true);
  });
  if (!config_.job.checkpoint_dir.empty()) {
    follower_->SetCheckpointing(
        [job = job_.get()] { return job->SaveCheckpoint(); },
        [this](int64_t version, int epoch, int step, const StepQuotas& quotas) {
          return RestoreShard(version, epoch, step, quotas);
        });
  }
}

void PsServer::StopLink() {
  if (link_ != nullptr) link_->Cancel();
  if (link_thread_.joinable()) link_thread_.join();
}

absl::Status PsServer::StartFollowing() {
  FollowConfig f;
  f.leader = config_.leader;
  f.shard = config_.shard;
  f.num_shards = config_.num_shards;
  f.settings = TrainingSettings(config_.job);
  f.job_token = config_.job_token;
  f.rejoin_timeout = config_.job.worker_timeout;
  // A dead connection is noticed (ping, then its timeout) within half the worker timeout, which
  // leaves the other half to continue the stream before the leader gives up this shard (from a
  // 24 s worker timeout on: the leader refuses pings more often than every 5 s).
  f.keepalive = std::clamp(config_.job.worker_timeout / 4, absl::Seconds(6), absl::Seconds(20));
  if (config_.tls_cert_pem.empty()) {
    f.credentials = grpc::InsecureChannelCredentials();
  } else {
    // The shards of a job share one CA: it signed the leader's certificate, and this shard
    // presents its own (mutual TLS).
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = config_.tls_client_ca_pem;
    tls.pem_private_key = config_.tls_key_pem;
    tls.pem_cert_chain = config_.tls_cert_pem;
    f.credentials = grpc::SslCredentials(tls);
  }
  if (config_.restore || config_.restore_if_present) f.checkpoints = CheckpointsHeld();
  link_ = std::make_unique<LeaderLink>(std::move(f), follower_.get());
  link_thread_ = std::thread([this] {
    const absl::Status s = link_->Run();
    if (!s.ok() && !absl::IsCancelled(s)) LOG(ERROR) << s.message();
  });
  return absl::OkStatus();
}

absl::Status PsServer::RestoreShard(int64_t version, int epoch, int step,
                                    const StepQuotas& quotas) {
  if (!config_.restore && !config_.restore_if_present) {
    return absl::FailedPreconditionError("start this shard with --restore");
  }
  std::vector<std::string> refused;
  std::string path;
  absl::StatusOr<JobState> state =
      LoadNewestCheckpoint(config_.job.checkpoint_dir, &refused, &path, [&](const JobState& st) {
        return st.aggregator.store.version == version && st.aggregator.epoch == epoch &&
               st.aggregator.step == step;
      });
  for (const std::string& r : refused) LOG(ERROR) << "refusing checkpoint " << r;
  if (!state.ok()) return state.status();
  DBS_RETURN_IF_ERROR(job_->RestoreShard(*state, quotas, config_.restore_override));
  LOG(INFO) << "shard " << config_.shard << "/" << config_.num_shards << " restored " << path
            << ": epoch " << epoch + 1 << ", step " << step + 1 << ", parameter version "
            << version;
  return absl::OkStatus();
}

absl::Status PsServer::RunFollower(std::ostream& out) {
  // A worker that died between its pushes to the shards leaves this shard's step waiting
  // while the leader's waits for nobody: tell the leader (ShardFollower::Missing).
  LivenessMonitor liveness({absl::ZeroDuration(), config_.job.worker_timeout}, clock_);
  std::string last_told;  // logged when the answer changes: reports repeat while it waits
  while (!follower_->WaitFor(config_.supervise_every)) {
    CheckMemoryQuota();
    const std::optional<MissingPushes> missing = follower_->Missing(&liveness);
    if (!missing.has_value() || link_ == nullptr) continue;
    const absl::Status told = link_->ReportMissing(*missing, absl::Seconds(10));
    std::string said =
        absl::StrCat("step ", missing->step + 1, " of epoch ", missing->epoch + 1, " has waited ",
                     absl::FormatDuration(config_.job.worker_timeout), " here for worker(s) ",
                     absl::StrJoin(missing->workers, ", "),
                     ", whose pushes the leader had; told the leader: ", told.ToString());
    if (said != last_told) LOG(WARNING) << said;
    last_told = std::move(said);
  }
  const absl::Status result = follower_->Wait();
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (result.ok()) {
    RecordFinished(
        {{"status", "ok"}, {"shard", absl::StrCat(config_.shard, "/", config_.num_shards)}});
  }
  out << "dbs_ps shard " << config_.shard << "/" << config_.num_shards << ": "
      << (result.ok() ? "the job finished" : absl::StrCat("the job ended: ", result.message()))
      << "; parameter version " << ParameterVersion(job_->store()) << "\n"
      << std::flush;
  // The workers have their last answers: the leader ends the job only after every report.
  job_->Abort(absl::UnavailableError("dbs_ps is shutting down"));
  StopLink();  // before server_ goes: the link's callbacks use it
  server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  server_.reset();
  http_.reset();
  return result;
}

}  // namespace dbs
