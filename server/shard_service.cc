#include "server/shard_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/backoff.h"
#include "common/rpc/grpc_status.h"
#include "common/secrets.h"
#include "common/tsan.h"
#include "glog/logging.h"

namespace dbs {

namespace {

void ToProto(const ShardEventData& e, v1::ShardEvent* out) {
  out->set_kind(static_cast<v1::ShardEvent::Kind>(e.kind));
  out->set_worker_id(e.worker_id);
  out->set_token(e.token);
  out->set_identity(e.identity);
  out->set_epoch(e.epoch);
  out->set_step(e.step);
  for (const auto& q : e.quotas) {
    auto* sq = out->add_quotas()->mutable_samples();
    for (const auto& [id, n] : q) (*sq)[id] = n;
  }
  out->set_changed(e.changed);
  for (int id : e.dead) out->add_dead(id);
  out->set_checkpoint(e.checkpoint);
  out->set_version(e.version);
  out->set_code(static_cast<int>(e.status.code()));
  out->set_message(std::string(e.status.message()));
}

ShardEventData FromProto(const v1::ShardEvent& in) {
  ShardEventData e;
  if (!v1::ShardEvent::Kind_IsValid(in.kind())) {  // a newer leader
    e.kind = ShardEventData::Kind::kEnd;
    e.status = absl::FailedPreconditionError(
        absl::StrCat("the leader sent an event of unknown kind ", in.kind()));
    return e;
  }
  e.kind = static_cast<ShardEventData::Kind>(in.kind());
  e.worker_id = in.worker_id();
  e.token = in.token();
  e.identity = in.identity();
  e.epoch = in.epoch();
  e.step = in.step();
  for (const auto& q : in.quotas()) {
    e.quotas.emplace_back(q.samples().begin(), q.samples().end());
  }
  e.changed = in.changed();
  e.dead.insert(in.dead().begin(), in.dead().end());
  e.checkpoint = in.checkpoint();
  e.version = in.version();
  e.status = absl::Status(static_cast<absl::StatusCode>(in.code()), in.message());
  return e;
}

// Writes the log's events to one follower, one at a time, waiting on the log when it has read
// them all. The log's wake-ups reach it through `state`, which outlives the reactor.
class FollowReactor : public tsan::Reactor<grpc::ServerWriteReactor<v1::ShardEvent>> {
 public:
  struct State {
    absl::Mutex mu;
    FollowReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
  };

  FollowReactor(ShardLog* log, int shard, const ShardStream& stream)
      : log_(log),
        shard_(shard),
        stream_(stream.id),
        state_(std::make_shared<State>()),
        next_(stream.from) {
    absl::MutexLock lock(&state_->mu);
    state_->reactor = this;
    WriteNextLocked();
  }

  void OnWriteDone(bool ok) override {
    const auto reacting = Reacting();
    absl::MutexLock lock(&state_->mu);
    writing_ = false;
    if (!ok) return FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
    ++next_;
    if (ended_) return FinishLocked(grpc::Status::OK);
    WriteNextLocked();
  }

  void OnCancel() override {
    const auto reacting = Reacting();
    absl::MutexLock lock(&state_->mu);
    if (!writing_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "follower went away"));
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    {
      absl::MutexLock lock(&state_->mu);
      state_->reactor = nullptr;
    }
    if (!clean_) {
      LOG(WARNING) << "shard " << shard_ << " stopped following";
      log_->Part(shard_, stream_);
    }
    delete this;
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (finished_) return;
    ShardEventData e;
    std::weak_ptr<State> weak = state_;
    // `s` is the reactor's own state_ (the analysis cannot see that the two locks are one).
    const bool ready =
        log_->Next(shard_, stream_, next_, &e, [weak]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          std::shared_ptr<State> s = weak.lock();
          if (s == nullptr) return;
          absl::MutexLock lock(&s->mu);
          if (s->reactor != nullptr) s->reactor->WakeLocked();
        });
    if (!ready) return;
    ended_ = e.kind == ShardEventData::Kind::kEnd;
    event_.Clear();
    ToProto(e, &event_);
    writing_ = true;
    StartWrite(&event_);
  }
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (!writing_) WriteNextLocked();
  }
  void FinishLocked(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (finished_) return;
    finished_ = true;
    clean_ = s.ok();
    Finish(s);
  }

  ShardLog* const log_;
  const int shard_;
  const int64_t stream_;
  const std::shared_ptr<State> state_;
  v1::ShardEvent event_;
  int64_t next_;
  bool writing_ = false;
  bool ended_ = false;
  bool finished_ = false;
  bool clean_ = false;
};

class RefusedWrite : public tsan::Reactor<grpc::ServerWriteReactor<v1::ShardEvent>> {
 public:
  explicit RefusedWrite(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
  void OnDone() override {
    { const auto reacting = Reacting(); }
    delete this;
  }
};

}  // namespace

grpc::ServerWriteReactor<v1::ShardEvent>* ShardServiceImpl::Follow(
    grpc::CallbackServerContext* ctx, const v1::FollowRequest* request) {
  if (!job_token_.empty() && !ConstantTimeEquals(ClientMetadata(ctx, kJobTokenKey), job_token_)) {
    return new RefusedWrite(
        absl::UnauthenticatedError("Follow needs the job's secret (dbs_ps --job_token)"));
  }
  const std::map<std::string, std::string> settings(request->settings().begin(),
                                                    request->settings().end());
  std::set<CheckpointAt> checkpoints;
  for (const v1::CheckpointAt& c : request->checkpoints()) {
    checkpoints.insert({c.version(), c.epoch(), c.step()});
  }
  std::optional<ShardResume> resume;
  if (std::string key = ClientMetadata(ctx, kShardKeyKey); !key.empty()) {
    resume = ShardResume{std::move(key), request->resume_from()};
  }
  const absl::StatusOr<ShardStream> stream =
      log_->Join(request->shard(), request->num_shards(), settings, std::move(checkpoints), resume);
  if (!stream.ok()) return new RefusedWrite(stream.status());
  ctx->AddInitialMetadata(kShardKeyKey, stream->key);
  if (!resume.has_value()) {
    LOG(INFO) << "shard " << request->shard() << "/" << request->num_shards() << " follows";
  }
  return new FollowReactor(log_, request->shard(), *stream);
}

grpc::ServerUnaryReactor* ShardServiceImpl::ReportMissing(grpc::CallbackServerContext* ctx,
                                                          const v1::MissingPushes* request,
                                                          v1::MissingPushesReply*) {
  if (!job_token_.empty() && !ConstantTimeEquals(ClientMetadata(ctx, kJobTokenKey), job_token_)) {
    return FinishUnary(ctx, absl::UnauthenticatedError(
                                "ReportMissing needs the job's secret (dbs_ps --job_token)"));
  }
  // Workers hold the job's secret too: only the follower itself, with the key its Follow
  // stream carries, can tell the leader that pushes went missing (which removes workers).
  if (!log_->Vouches(request->shard(), ClientMetadata(ctx, kShardKeyKey))) {
    return FinishUnary(
        ctx, absl::PermissionDeniedError(absl::StrCat(
                 "ReportMissing comes only from shard ", request->shard(),
                 " itself, with the key its Follow stream carries; the shard does not follow "
                 "this leader, or the call is not the shard's")));
  }
  MissingPushes missing;
  missing.epoch = request->epoch();
  missing.step = request->step();
  missing.workers.insert(request->workers().begin(), request->workers().end());
  return FinishUnary(ctx, on_missing_(request->shard(), missing));
}

absl::Status LeaderLink::ReportMissing(const MissingPushes& missing, absl::Duration timeout) {
  auto stub = v1::ShardService::NewStub(Channel());
  v1::MissingPushes req;
  req.set_shard(config_.shard);
  req.set_epoch(missing.epoch);
  req.set_step(missing.step);
  for (int id : missing.workers) req.add_workers(id);
  grpc::ClientContext ctx;
  if (!config_.job_token.empty()) ctx.AddMetadata(kJobTokenKey, config_.job_token);
  {
    absl::MutexLock lock(&mu_);
    if (shard_key_.empty()) {
      return absl::UnavailableError("this shard does not follow the leader at the moment");
    }
    ctx.AddMetadata(kShardKeyKey, shard_key_);
  }
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::MissingPushesReply reply;
  return FromGrpcStatus(stub->ReportMissing(&ctx, req, &reply));
}

std::shared_ptr<grpc::Channel> LeaderLink::Channel() {
  absl::MutexLock lock(&mu_);
  if (channel_ == nullptr) {
    // Pings notice a leader that went silent (a partition, a connection a middlebox dropped):
    // the stream fails and is continued, instead of waiting on a dead connection.
    grpc::ChannelArguments args;
    const int ping_ms = static_cast<int>(absl::ToInt64Milliseconds(config_.keepalive));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ping_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ping_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    channel_ = grpc::CreateCustomChannel(config_.leader, config_.credentials, args);
  }
  return channel_;
}

void LeaderLink::KeepShardKey(const grpc::ClientContext& ctx) {
  // The leader's initial metadata has arrived with the stream's first event.
  const auto& meta = ctx.GetServerInitialMetadata();
  auto key = meta.find(kShardKeyKey);
  absl::MutexLock lock(&mu_);
  shard_key_ = key == meta.end() ? "" : std::string(key->second.data(), key->second.size());
  resume_key_ = shard_key_;
}

bool LeaderLink::FollowOnce(v1::ShardService::Stub* stub, const v1::FollowRequest& req,
                            Followed* out) {
  grpc::ClientContext ctx;
  if (!config_.job_token.empty()) ctx.AddMetadata(kJobTokenKey, config_.job_token);
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return false;
    if (req.resume_from() > 0) ctx.AddMetadata(kShardKeyKey, resume_key_);
    current_ = &ctx;
  }
  std::unique_ptr<grpc::ClientReader<v1::ShardEvent>> reader = stub->Follow(&ctx, req);
  v1::ShardEvent event;
  while (reader->Read(&event)) {
    if (++out->events == 1) KeepShardKey(ctx);
    ShardEventData e = FromProto(event);
    follower_->Apply(e);
    if (e.kind == ShardEventData::Kind::kEnd) {
      out->ended = true;
      out->result = e.status;
    }
  }
  out->finished = AsRetried(reader->Finish());
  absl::MutexLock lock(&mu_);
  current_ = nullptr;
  shard_key_.clear();
  return !cancelled_;
}

absl::Status LeaderLink::Run() {
  auto stub = v1::ShardService::NewStub(Channel());
  v1::FollowRequest req;
  req.set_shard(config_.shard);
  req.set_num_shards(config_.num_shards);
  for (const auto& [k, v] : config_.settings) (*req.mutable_settings())[k] = v;
  for (const CheckpointAt& c : config_.checkpoints) {
    v1::CheckpointAt* out = req.add_checkpoints();
    out->set_version(c.version);
    out->set_epoch(c.epoch);
    out->set_step(c.step);
  }
  Backoff backoff(BackoffConfig{});
  absl::Time deadline = absl::Now() + config_.connect_timeout;
  int64_t applied = 0;  // events, over every stream
  while (true) {
    Followed f;
    if (!FollowOnce(stub.get(), req, &f)) return absl::CancelledError("stopped");
    if (f.ended) return f.result;
    const grpc::Status& s = f.finished;
    if (f.events > 0) {
      // A stream that had begun broke (the network, or the leader's transport short of
      // memory): continue it from here while the leader holds this shard's place.
      applied += f.events;
      req.set_resume_from(applied);
      deadline = absl::Now() + config_.rejoin_timeout;
      backoff = Backoff(BackoffConfig{});
      LOG(WARNING) << "the stream from the leader at " << config_.leader << " broke after event "
                   << applied << " (" << s.error_message() << "); following again for up to "
                   << absl::FormatDuration(config_.rejoin_timeout);
    }
    // Not reachable (the leader starts later, or is back after a break): retry. Anything else
    // is the end of this shard's part in the job.
    const absl::Duration delay = backoff.Next();
    if ((f.events > 0 || s.error_code() == grpc::StatusCode::UNAVAILABLE) &&
        absl::Now() + delay < deadline) {
      absl::SleepFor(delay);
      continue;
    }
    absl::Status result = absl::UnavailableError(
        absl::StrCat(applied > 0 ? "lost the leader at " : "could not follow the leader at ",
                     config_.leader, ": ", s.error_message()));
    // Refused on joining: this shard's configuration (exit 2, not retried). Refused a stream
    // to continue (a leader restarted, the shard lost meanwhile), it stays UNAVAILABLE: every
    // shard restarts with --restore_if_present (exit 200).
    if (applied == 0 && (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                         s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                         s.error_code() == grpc::StatusCode::PERMISSION_DENIED)) {
      result = absl::FailedPreconditionError(
          absl::StrCat("the leader at ", config_.leader, " refused: ", s.error_message()));
    }
    follower_->Lost(result);
    return result;
  }
}

void LeaderLink::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (current_ != nullptr) current_->TryCancel();
}

}  // namespace dbs
