#include "worker/grpc_ps_client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/secrets.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "grpcpp/grpcpp.h"

namespace dbs {

GrpcPsClient::GrpcPsClient(const GrpcClientConfig& config)
    : config_(config), incarnation_(RandomToken()) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(config.max_message_mb << 20);
  args.SetMaxSendMessageSize(config.max_message_mb << 20);
  // A connection of its own: gRPC otherwise shares one TCP connection among every channel of the
  // process with the same target and arguments, so several clients in one process (the data-plane
  // benchmark's fake workers, tests) would be served one after another through one HTTP/2
  // transport, where workers in processes of their own are served in parallel.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Our own backoff drives reconnection; keep gRPC's from adding long pauses of its own.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Not a pause: gRPC (1.51's subchannel) takes this as the least time one connection attempt
  // (TCP, TLS, HTTP/2 settings) gets before it is cut off. At 100 ms an attempt had 0.1-1.2 s, so
  // a TLS handshake on a loaded machine, or to a distant server, never finished ("tcp handshaker
  // shutdown") and the worker gave up. gRPC's own default, 20 s; a refused or reset connection
  // still fails at once, and each call's deadline still bounds how long a call waits.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
  // Keepalive pings notice a server that vanished (powered off, partitioned) while a call waits:
  // the call fails with UNAVAILABLE instead of hanging, and the retry logic takes over.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A push may wait minutes for a slow step with no data flowing: keep pinging all along (gRPC
  // stops after 2 data-less pings by default).
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!config.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = config.tls_ca_pem;
    tls.pem_private_key = config.tls_key_pem;
    tls.pem_cert_chain = config.tls_cert_pem;
    credentials = grpc::SslCredentials(tls);
  }
  channel_ = grpc::CreateCustomChannel(config.address, credentials, args);
  scheduler_ = v1::SchedulerService::NewStub(channel_);
  parameters_ = v1::ParameterService::NewStub(channel_);
}

GrpcPsClient::~GrpcPsClient() { CloseSession(nullptr); }

absl::Status GrpcPsClient::Annotate(const grpc::Status& s, const char* what) const {
  absl::Status st = FromGrpcStatus(s);
  if (st.ok()) return st;
  return absl::Status(st.code(),
                      absl::StrCat(what, " at dbs_ps ", config_.address, ": ", st.message()));
}

absl::StatusOr<RegistrationResult> GrpcPsClient::RegisterWorker(const WorkerRegistration& reg) {
  v1::RegisterWorkerRequest req;
  ToProto(reg, &req);
  if (req.incarnation().empty()) req.set_incarnation(incarnation_);
  Backoff backoff(config_.backoff, std::hash<std::string>()(reg.name));
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + config_.connect_timeout;
  grpc::Status last;
  int attempts = 0;
  while (true) {
    ++attempts;
    grpc::ClientContext ctx;
    if (!config_.job_token.empty()) ctx.AddMetadata(kJobTokenKey, config_.job_token);
    ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(10))));
    v1::RegisterWorkerReply reply;
    if (!Begin(&ctx)) return absl::CancelledError(StopReason());
    last = AsRetried(scheduler_->RegisterWorker(&ctx, req, &reply));
    if (End()) return absl::CancelledError(StopReason());
    if (last.ok()) {
      token_ = reply.token();
      if (!v1::WireDtype_IsValid(reply.wire_dtype())) {
        return absl::InvalidArgumentError(
            absl::StrCat("dbs_ps at ", config_.address, " asks for an unknown wire dtype ",
                         static_cast<int>(reply.wire_dtype()), " (a newer server?)"));
      }
      wire_dtype_ = static_cast<WireDtype>(reply.wire_dtype());
      return FromProto(reply);
    }
    const bool retryable = last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           last.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (last.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      return absl::FailedPreconditionError(absl::StrCat(
          "dbs_ps at ", config_.address,
          " does not serve the scheduler: it is a follower shard (dbs_ps --shard=i/k with "
          "i > 0). List shard 0, the leader, first in --server"));
    }
    if (!retryable) return Annotate(last, "registration refused");
    const absl::Duration delay = backoff.Next();
    if (absl::Now() + delay >= deadline) break;
    if (Pause(delay)) return absl::CancelledError(StopReason());
  }
  return absl::UnavailableError(absl::StrFormat(
      "could not reach dbs_ps at %s after %d attempts over %.1f s (last error: %s). Is dbs_ps "
      "running there, and are --server and the port right?",
      config_.address, attempts, absl::ToDoubleSeconds(absl::Now() - start), last.error_message()));
}

namespace {
// The registration carries the model's values in fp32 (with the layout), and so does a resume:
// both must fit in a message of `max_message_mb`.
absl::Status CheckModelFitsInMessage(const ModelLayout& layout, int max_message_mb) {
  const size_t model = static_cast<size_t>(TotalElements(layout));
  const size_t largest = model * sizeof(float) + (size_t{1} << 20);
  if (largest <= static_cast<size_t>(max_message_mb) << 20) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "the model (%zu values, %.0f MiB in fp32) does not fit in a message of --max_message_mb="
      "%d: raise it, on dbs_ps and on every worker, to at least %zu",
      model, static_cast<double>(model * sizeof(float)) / (1 << 20), max_message_mb,
      (largest >> 20) + 1));
}
}  // namespace

absl::Status GrpcPsClient::RegisterModel(int worker_id, const ModelLayout& layout,
                                         absl::Span<const float> initial,
                                         absl::Span<float> params) {
  // The layout alone first: usually another worker registered the model already, and the
  // stored values come back without this worker sending its own. While none is registered, the
  // server names one worker to send its values (FAILED_PRECONDITION) and tells the others to
  // ask again once it is done (ABORTED), so that it receives one copy of the model, not N.
  DBS_RETURN_IF_ERROR(CheckModelFitsInMessage(layout, config_.max_message_mb));
  v1::RegisterModelRequest req;
  v1::Parameters reply;
  // Idempotent (the first registration wins): safe to retry like the other calls.
  auto call = [&](grpc::ClientContext* ctx) {
    return parameters_->RegisterModel(ctx, req, &reply);
  };
  BackoffConfig again;
  again.initial = absl::Milliseconds(5);
  again.max = absl::Milliseconds(200);
  Backoff backoff(again);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + config_.connect_timeout + config_.call_timeout;
  grpc::Status status;
  while (true) {
    req.Clear();
    req.set_worker_id(worker_id);
    req.set_layout_only(true);
    EncodeLayout(layout, req.mutable_parameters());
    status = WithRetry(call);
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      req.Clear();
      req.set_worker_id(worker_id);
      EncodeTensors(layout, initial, req.mutable_parameters());
      status = WithRetry(call);
    }
    // ABORTED: another worker is sending its values (or took over from this one, whose turn
    // had lapsed). Ask again.
    if (status.error_code() != grpc::StatusCode::ABORTED) break;
    const absl::Duration delay = backoff.Next();
    if (absl::Now() + delay >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "RegisterModel at dbs_ps ", config_.address, ": waited ",
          absl::FormatDuration(absl::Now() - start),
          " for another worker to register the model (last answer: ", status.error_message(), ")"));
    }
    if (Pause(delay)) return absl::CancelledError(StopReason());
  }
  DBS_RETURN_IF_ERROR(Annotate(status, "RegisterModel"));
  DBS_RETURN_IF_ERROR(DecodeParameters(reply, layout, params));
  layout_ = layout;
  return absl::OkStatus();
}

namespace {
// The delay a server that is up asked for with an UNAVAILABLE answer (kRetryAfterMsKey), or 0.
int RetryAfterMs(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  const auto after = trailers.find(kRetryAfterMsKey);
  int ms = 0;
  if (after == trailers.end() ||
      !absl::SimpleAtoi(absl::string_view(after->second.data(), after->second.size()), &ms)) {
    return 0;
  }
  return std::clamp(ms, 0, 1000);
}
}  // namespace

template <typename Rpc>
grpc::Status GrpcPsClient::WithRetry(Rpc rpc, bool waits) {
  Backoff backoff(config_.backoff);
  // For a server that is up and asks to be called again shortly (kRetryAfterMsKey): from its
  // delay, growing while it keeps asking.
  std::optional<Backoff> soon;
  const absl::Time start = absl::Now();
  absl::Time deadline = start + config_.connect_timeout;
  while (true) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kWorkerTokenKey, token_);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + config_.call_timeout));
    if (!Begin(&ctx)) return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
    session_retry_after_ms_ = 0;
    grpc::Status s = AsRetried(rpc(&ctx));
    if (End()) return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
    // Not ours: a server shutting down cancels the calls in flight. It may come back.
    if (s.error_code() == grpc::StatusCode::CANCELLED) {
      s = grpc::Status(grpc::StatusCode::UNAVAILABLE, s.error_message());
    }
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && waits) {
      // Still waiting for the other workers: ask again, unless the wait is over.
      if (config_.max_wait > absl::ZeroDuration() && absl::Now() - start >= config_.max_wait) {
        return grpc::Status(
            grpc::StatusCode::DEADLINE_EXCEEDED,
            absl::StrCat("no answer after waiting ", absl::FormatDuration(absl::Now() - start),
                         " (--max_wait_s)"));
      }
      backoff = Backoff(config_.backoff);
      deadline = absl::Now() + config_.connect_timeout;
      continue;
    }
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
        s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return s;
    }
    const int after_ms = std::max(RetryAfterMs(ctx), session_retry_after_ms_);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE && after_ms > 0) {
      if (!soon.has_value()) {
        soon.emplace(BackoffConfig{absl::Milliseconds(after_ms), config_.backoff.max, 2.0, 0.2});
      }
      const absl::Duration delay = soon->Next();
      if (absl::Now() + delay >= deadline) return s;
      if (Pause(delay)) return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
      continue;
    }
    const absl::Duration delay = backoff.Next();
    if (absl::Now() + delay >= deadline) return s;
    if (!reconnected_) {
      std::fprintf(stderr, "dbs_ps at %s is unavailable (%s); retrying for up to %s\n",
                   config_.address.c_str(), s.error_message().c_str(),
                   absl::FormatDuration(config_.connect_timeout).c_str());
    }
    reconnected_ = true;
    if (Pause(delay)) return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
  }
}

bool GrpcPsClient::Begin(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&interrupt_mu_);
  // A refused call never started: it must not stay the call in progress, or a later Abandon
  // or Interrupt would cancel its context after WithRetry's frame has gone.
  if (interrupted_ || abandoned_) return false;
  current_ = ctx;
  return true;
}

bool GrpcPsClient::in_call() const {
  absl::MutexLock lock(&interrupt_mu_);
  return current_ != nullptr;
}

bool GrpcPsClient::Retarget(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&interrupt_mu_);
  current_ = ctx;
  return !interrupted_ && !abandoned_;
}

bool GrpcPsClient::End() {
  absl::MutexLock lock(&interrupt_mu_);
  current_ = nullptr;
  return interrupted_ || abandoned_;
}

bool GrpcPsClient::Pause(absl::Duration delay) {
  absl::MutexLock lock(&interrupt_mu_);
  auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(interrupt_mu_) {
    return interrupted_ || abandoned_;
  };
  return interrupt_mu_.AwaitWithTimeout(absl::Condition(&stopped), delay);
}

std::string GrpcPsClient::StopReason() {
  absl::MutexLock lock(&interrupt_mu_);
  return interrupted_ ? "interrupted" : "abandoned: another shard refused this call's step";
}

void GrpcPsClient::Abandon() {
  absl::MutexLock lock(&interrupt_mu_);
  abandoned_ = true;
  if (current_ != nullptr) current_->TryCancel();
}

void GrpcPsClient::ResumeCalls() {
  absl::MutexLock lock(&interrupt_mu_);
  abandoned_ = false;
}

void GrpcPsClient::Interrupt() {
  absl::MutexLock lock(&interrupt_mu_);
  interrupted_ = true;
  if (current_ != nullptr) current_->TryCancel();
}

bool GrpcPsClient::TakeReconnected() {
  const bool r = reconnected_;
  reconnected_ = false;
  return r;
}

absl::StatusOr<ResumePoint> GrpcPsClient::Resume(int worker_id, absl::Span<float> params) {
  v1::ResumeRequest req;
  req.set_worker_id(worker_id);
  v1::ResumeReply reply;
  DBS_RETURN_IF_ERROR(Annotate(
      WithRetry([&](grpc::ClientContext* ctx) { return parameters_->Resume(ctx, req, &reply); }),
      "Resume"));
  ResumePoint info;
  info.finished = reply.finished();
  info.epoch = reply.epoch();
  info.step = reply.step();
  info.has_plan = reply.plan_ready();
  if (info.has_plan) {
    info.plan = FromProto(reply.plan());
    info.schedule = FromProto(reply.schedule());
  }
  DBS_RETURN_IF_ERROR(DecodeParameters(reply.parameters(), layout_, params));
  return info;
}

absl::StatusOr<int64_t> GrpcPsClient::PullParameters(int worker_id, absl::Span<float> params) {
  if (layout_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  v1::PullParametersRequest req;
  req.set_worker_id(worker_id);
  v1::Parameters reply;
  DBS_RETURN_IF_ERROR(Annotate(WithRetry([&](grpc::ClientContext* ctx) {
                                 return parameters_->PullParameters(ctx, req, &reply);
                               }),
                               "PullParameters"));
  DBS_RETURN_IF_ERROR(DecodeParameters(reply, layout_, params));
  return reply.version();
}

absl::StatusOr<WorkerPlan> GrpcPsClient::GetEpochPlan(int worker_id, int epoch) {
  v1::GetEpochPlanRequest req;
  req.set_worker_id(worker_id);
  req.set_epoch(epoch);
  v1::EpochPlan reply;
  auto call = [&](grpc::ClientContext* ctx) { return scheduler_->GetEpochPlan(ctx, req, &reply); };
  DBS_RETURN_IF_ERROR(Annotate(WithRetry(call, /*waits=*/true), "GetEpochPlan"));
  return FromProto(reply);
}

absl::StatusOr<StepOutcome> GrpcPsClient::PushGradient(int worker_id, int epoch, int step,
                                                       int num_samples, double loss_sum,
                                                       double compute_seconds,
                                                       absl::Span<const float> gradient,
                                                       absl::Span<float> params) {
  if (layout_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  const size_t model = static_cast<size_t>(TotalElements(layout_));
  const bool send = num_samples > 0;
  if (params.size() != model || (send && gradient.size() != model)) {
    return absl::InternalError("gradient or parameter buffer does not match the model");
  }
  v1::PushGradientRequest head;
  head.set_worker_id(worker_id);
  head.set_epoch(epoch);
  head.set_step(step);
  head.set_num_samples(num_samples);
  head.set_loss_sum(loss_sum);
  head.set_compute_seconds(compute_seconds);
  MaybeAttach(worker_id);
  if (shm_.attached()) {
    absl::StatusOr<StepOutcome> shared = PushShared(head, gradient, params);
    if (shared.ok() || shm_.attached()) return shared;
    // The server forgot this worker's memory (a restart): the push goes over gRPC, and the
    // next one attaches again.
  }
  v1::PushGradientReply reply;
  int64_t version = 0;
  // A push with samples carries the gradient (GradientOnWire: its own memory, or encoded once
  // into a reused buffer); an empty one carries none.
  std::optional<GradientOnWire> bytes;
  std::optional<grpc::ByteBuffer> request;
  if (send) {
    head.set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    bytes.emplace(gradient, wire_dtype_, pool_.get());
    grpc::Slice slices[2] = {
        grpc::Slice(head.SerializeAsString() + GradientFieldPrefix(model, wire_dtype_)),
        bytes->Range(0, model)};
    request.emplace(slices, 2);
  } else {
    grpc::Slice header(head.SerializeAsString());
    request.emplace(&header, 1);
  }
  const grpc::Status status = WithRetry(
      [&](grpc::ClientContext* ctx) { return PushAttempt(ctx, *request); }, /*waits=*/true);
  request.reset();
  if (bytes.has_value()) DBS_RETURN_IF_ERROR(AwaitGradientReturned(*bytes, "PushGradient"));
  DBS_RETURN_IF_ERROR(Annotate(status, "PushGradient"));
  const absl::Status parsed =
      ParsePushReply(SegmentsOf(push_reply_, &reply_slices_), &reply, params, &version);
  reply_slices_.clear();
  push_reply_.Clear();
  if (!parsed.ok()) {
    return absl::Status(parsed.code(), absl::StrCat("PushGradient at dbs_ps ", config_.address,
                                                    ": ", parsed.message()));
  }
  return OutcomeOf(reply, version);
}

void GrpcPsClient::MaybeAttach(int worker_id) {
  if (!config_.shared_memory) return;
  const auto exchange = [&](const RegionLocation& mine) -> absl::StatusOr<RegionLocation> {
    v1::AttachSharedMemoryRequest req;
    req.set_worker_id(worker_id);
    req.mutable_gradient()->set_pid(mine.pid);
    req.mutable_gradient()->set_fd(mine.fd);
    req.mutable_gradient()->set_bytes(mine.bytes);
    v1::AttachSharedMemoryReply reply;
    DBS_RETURN_IF_ERROR(FromGrpcStatus(WithRetry([&](grpc::ClientContext* ctx) {
      return parameters_->AttachSharedMemory(ctx, req, &reply);
    })));
    RegionLocation theirs;
    theirs.pid = reply.parameters().pid();
    theirs.fd = reply.parameters().fd();
    theirs.bytes = reply.parameters().bytes();
    return theirs;
  };
  shm_.MaybeAttach(static_cast<size_t>(TotalElements(layout_)), wire_dtype_, exchange);
}

absl::StatusOr<StepOutcome> GrpcPsClient::PushShared(const v1::PushGradientRequest& head,
                                                     absl::Span<const float> gradient,
                                                     absl::Span<float> params) {
  v1::PushGradientRequest req = head;
  req.set_gradient_in_shared_memory(true);
  req.set_answer_in_shared_memory(true);
  if (req.num_samples() > 0) {
    // The server reads the region until it answers; a retry pushes the same bytes.
    req.set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    shm_.Write(gradient, wire_dtype_);
  }
  grpc::Slice header(req.SerializeAsString());
  const grpc::ByteBuffer request(&header, 1);
  const grpc::Status status = WithRetry(
      [&](grpc::ClientContext* ctx) { return PushAttempt(ctx, request); }, /*waits=*/true);
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
      absl::StrContains(status.error_message(), "no shared memory attached")) {
    shm_.Forget();
    return Annotate(status, "PushGradient");
  }
  DBS_RETURN_IF_ERROR(Annotate(status, "PushGradient"));
  v1::PushGradientReply reply;
  int64_t version = 0;
  bool shared = false;
  const absl::Status parsed =
      ParsePushReply(SegmentsOf(push_reply_, &reply_slices_), &reply, params, &version, &shared);
  reply_slices_.clear();
  push_reply_.Clear();
  if (!parsed.ok()) {
    return absl::Status(parsed.code(), absl::StrCat("PushGradient at dbs_ps ", config_.address,
                                                    ": ", parsed.message()));
  }
  // The slots hold fp32: rounded as the wire dtype's answers over gRPC are.
  if (shared && !shm_.Read(version, params, wire_dtype_)) {
    // The slot moved on or was never written: the values come over gRPC.
    DBS_ASSIGN_OR_RETURN(const int64_t pulled, PullParameters(head.worker_id(), params));
    version = pulled;
  }
  return OutcomeOf(reply, version);
}

grpc::Status GrpcPsClient::PushAttempt(grpc::ClientContext* ctx, const grpc::ByteBuffer& request) {
  // Raw bytes both ways, on this thread (ByteStream).
  const absl::Time now = absl::Now();
  if (session_ != nullptr &&
      (now - session_->opened > config_.call_timeout / 2 || session_->token != token_)) {
    CloseSession(ctx);
  }
  if (session_ == nullptr) {
    session_ = std::make_unique<PushSession>();
    session_->ctx.AddMetadata(kWorkerTokenKey, token_);
    session_->ctx.set_deadline(absl::ToChronoTime(now + config_.call_timeout));
    session_->opened = now;
    session_->token = token_;
    ++sessions_opened_;
    session_->stream = std::make_unique<ByteStream>(
        channel_, "/dbs.v1.ParameterService/PushGradientSession", &session_->ctx);
  }
  // Interrupt and Abandon cancel the session while it waits.
  if (!Retarget(&session_->ctx)) {
    CloseSession(ctx);
    return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
  }
  if (session_->stream->Write(request) && session_->stream->Read(&push_reply_)) {
    return grpc::Status::OK;
  }
  const grpc::Status ended = session_->stream->Finish();
  session_retry_after_ms_ = RetryAfterMs(session_->ctx);
  ForgetSession(ctx);
  if (!ended.ok()) return ended;
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "dbs_ps ended the push session");
}

void GrpcPsClient::CloseSession(grpc::ClientContext* attempt) {
  if (session_ == nullptr) return;
  // Between pushes, so nothing is lost; cancelling does not wait on the server (a clean close
  // would, for up to the session's deadline if the server stopped answering).
  session_->ctx.TryCancel();
  session_->stream->Finish();
  ForgetSession(attempt);
}

void GrpcPsClient::ForgetSession(grpc::ClientContext* attempt) {
  // Interrupt and Abandon, on other threads (a sharded worker abandons the other shards' calls
  // when one fails), cancel whatever current_ points at: point it back at the attempt's own
  // context, alive until the attempt returns, before the session's context is destroyed.
  {
    absl::MutexLock lock(&interrupt_mu_);
    if (current_ == &session_->ctx) current_ = attempt;
  }
  session_.reset();
}

absl::Status GrpcPsClient::AwaitGradientReturned(const GradientOnWire& bytes,
                                                 absl::string_view call) {
  // The caller may change the gradient once a push returns: gRPC must have let go of it. It
  // does once the call is over and its request is gone; the wait covers a late release.
  if (!bytes.AwaitReturned(absl::Seconds(60))) {
    return absl::InternalError(
        absl::StrCat(call, ": gRPC still held the gradient's memory 60 s after the call ended"));
  }
  return absl::OkStatus();
}

StepOutcome GrpcPsClient::OutcomeOf(const v1::PushGradientReply& reply, int64_t version) {
  StepOutcome out;
  out.global_loss = reply.global_loss();
  out.global_samples = reply.global_samples();
  out.version = version;
  if (reply.has_revision()) {
    out.revised = true;
    out.revision = FromProto(reply.revision());
  }
  return out;
}

absl::Status GrpcPsClient::ReportEpoch(const EpochTiming& timing) {
  v1::EpochReport req;
  ToProto(timing, &req);
  v1::EpochReportReply reply;
  return Annotate(WithRetry([&](grpc::ClientContext* ctx) {
                    return scheduler_->ReportEpoch(ctx, req, &reply);
                  }),
                  "ReportEpoch");
}

absl::Status GrpcPsClient::Leave(int worker_id) {
  v1::LeaveRequest req;
  req.set_worker_id(worker_id);
  v1::LeaveReply reply;
  grpc::ClientContext ctx;
  ctx.AddMetadata(kWorkerTokenKey, token_);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  return Annotate(scheduler_->Leave(&ctx, req, &reply), "Leave");
}

}  // namespace dbs
