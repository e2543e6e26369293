#include "worker/grpc_ps_client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

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
#include "grpcpp/support/sync_stream.h"

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
  push_method_ = std::make_unique<grpc::internal::RpcMethod>(
      "/dbs.v1.ParameterService/PushGradient", grpc::internal::RpcMethod::NORMAL_RPC, channel_);
  stream_method_ = std::make_unique<grpc::internal::RpcMethod>(
      "/dbs.v1.ParameterService/PushGradientStream", grpc::internal::RpcMethod::BIDI_STREAMING,
      channel_);
  session_method_ = std::make_unique<grpc::internal::RpcMethod>(
      "/dbs.v1.ParameterService/PushGradientSession", grpc::internal::RpcMethod::BIDI_STREAMING,
      channel_);
  sessions_ = config.push_sessions;
  pull_stream_method_ = std::make_unique<grpc::internal::RpcMethod>(
      "/dbs.v1.ParameterService/PullParametersStream", grpc::internal::RpcMethod::SERVER_STREAMING,
      channel_);
  register_stream_method_ = std::make_unique<grpc::internal::RpcMethod>(
      "/dbs.v1.ParameterService/RegisterModelStream", grpc::internal::RpcMethod::CLIENT_STREAMING,
      channel_);
}

GrpcPsClient::~GrpcPsClient() { CloseSession(nullptr); }

bool GrpcPsClient::Streams(size_t bytes) const {
  return config_.stream_chunk_bytes > 0 && bytes > config_.stream_chunk_bytes;
}

absl::Status GrpcPsClient::ReadValueChunks(const std::function<bool(grpc::ByteBuffer*)>& read,
                                           grpc::ClientContext* ctx,
                                           google::protobuf::MessageLite* head,
                                           absl::Span<float> params, int64_t* version,
                                           grpc::Status* finished,
                                           const std::function<grpc::Status()>& finish) {
  absl::Status parsed;
  size_t covered = 0;
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  // The answer: consecutive ranges of the parameters, all of one version, and the head in one
  // of the messages (a push's answer: the last, an empty range at the model's end; a pull's:
  // every one).
  while (parsed.ok() && read(&message)) {
    int64_t v = 0;
    size_t offset = 0, count = 0;
    std::unique_ptr<google::protobuf::MessageLite> piece(head->New());
    parsed =
        ParsePushReplyPiece(SegmentsOf(message, &slices), piece.get(), params, &v, &offset, &count);
    if (parsed.ok() && offset != covered) {
      parsed = absl::InvalidArgumentError(
          absl::StrCat("the answer's parameters jump from value ", covered, " to ", offset));
    } else if (parsed.ok() && covered > 0 && v != *version) {
      parsed = absl::InvalidArgumentError("the answer's chunks are of different versions");
    }
    if (parsed.ok()) head->CheckTypeAndMergeFrom(*piece);
    if (parsed.ok() && covered == 0) *version = v;
    covered += count;
    message.Clear();
  }
  if (!parsed.ok()) ctx->TryCancel();
  *finished = finish();
  if (finished->ok() && parsed.ok() && covered != params.size()) {
    parsed = absl::InvalidArgumentError(
        absl::StrCat("the answer carried ", covered, " of the model's ", params.size(), " values"));
  }
  return parsed;
}

absl::StatusOr<int64_t> GrpcPsClient::PullStreamed(int worker_id, absl::Span<float> params) {
  v1::PullParametersRequest req;
  req.set_worker_id(worker_id);
  absl::Status parsed;
  int64_t version = 0;
  auto call = [&](grpc::ClientContext* ctx) {
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
            channel_.get(), *pull_stream_method_, ctx, req));
    v1::Parameters head;
    grpc::Status status;
    parsed = ReadValueChunks([&](grpc::ByteBuffer* m) { return reader->Read(m); }, ctx, &head,
                             params, &version, &status, [&] { return reader->Finish(); });
    return parsed.ok() ? status : grpc::Status(grpc::StatusCode::DATA_LOSS, "");
  };
  grpc::Status status = WithRetry(call);
  if (!parsed.ok()) {
    return absl::Status(parsed.code(), absl::StrCat("PullParametersStream at dbs_ps ",
                                                    config_.address, ": ", parsed.message()));
  }
  DBS_RETURN_IF_ERROR(Annotate(status, "PullParametersStream"));
  return version;
}

grpc::Status GrpcPsClient::RegisterStreamed(int worker_id, const ModelLayout& layout,
                                            absl::Span<const float> initial) {
  // The layout, then the initial values in fp32 ranges of the chunk size.
  std::vector<grpc::ByteBuffer> messages;
  auto add = [&messages](const v1::RegisterModelRequest& m) {
    grpc::Slice slice(m.SerializeAsString());
    messages.emplace_back(&slice, 1);
  };
  v1::RegisterModelRequest head;
  head.set_worker_id(worker_id);
  head.set_omit_values(true);
  EncodeLayout(layout, head.mutable_parameters());
  add(head);
  const size_t model = initial.size();
  const size_t per_chunk = std::max({size_t{1}, config_.stream_chunk_bytes / sizeof(float),
                                     (model + kMaxStreamChunks - 1) / kMaxStreamChunks});
  for (size_t from = 0; from < model; from += per_chunk) {
    const size_t count = std::min(per_chunk, model - from);
    v1::RegisterModelRequest chunk;
    chunk.set_worker_id(worker_id);
    v1::FlatParameters* values = chunk.mutable_initial();
    values->set_offset(static_cast<int64_t>(from));
    values->set_values(
        std::string(reinterpret_cast<const char*>(initial.data() + from), count * sizeof(float)));
    add(chunk);
  }
  auto call = [&](grpc::ClientContext* ctx) {
    v1::Parameters reply;
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
            channel_.get(), *register_stream_method_, ctx, &reply));
    for (const grpc::ByteBuffer& m : messages) {
      if (!writer->Write(m)) break;  // refused: Finish says why
    }
    writer->WritesDone();
    return writer->Finish();
  };
  return WithRetry(call);
}

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
    last = scheduler_->RegisterWorker(&ctx, req, &reply);
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

absl::Status GrpcPsClient::RegisterModel(int worker_id, const ModelLayout& layout,
                                         absl::Span<const float> initial,
                                         absl::Span<float> params) {
  // The layout alone first: usually another worker registered the model already, and the
  // stored values come back without this worker sending its own. While none is registered, the
  // server names one worker to send its values (FAILED_PRECONDITION) and tells the others to
  // ask again once it is done (ABORTED), so that it receives one copy of the model, not N.
  const size_t model = static_cast<size_t>(TotalElements(layout));
  // A model larger than a chunk: the values go up and come back as streams.
  const bool streams = Streams(model * sizeof(float));
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
    req.set_omit_values(streams);
    EncodeLayout(layout, req.mutable_parameters());
    status = WithRetry(call);
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION && streams) {
      status = RegisterStreamed(worker_id, layout, initial);
    } else if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
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
  if (streams) {
    DBS_RETURN_IF_ERROR(PullStreamed(worker_id, params).status());
  } else {
    DBS_RETURN_IF_ERROR(DecodeParameters(reply, layout, params));
  }
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
    grpc::Status s = rpc(&ctx);
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
  const bool streams = Streams(params.size() * BytesPerValue(wire_dtype_));
  req.set_omit_parameters(streams);
  v1::ResumeReply reply;
  // Streamed, the parameters come from a pull after the answer: it must find the version the
  // answer names (a step cannot complete meanwhile without this worker, unless it was evicted).
  for (int attempt = 0;; ++attempt) {
    DBS_RETURN_IF_ERROR(Annotate(
        WithRetry([&](grpc::ClientContext* ctx) { return parameters_->Resume(ctx, req, &reply); }),
        "Resume"));
    if (!streams || reply.finished()) break;
    DBS_ASSIGN_OR_RETURN(int64_t pulled, PullStreamed(worker_id, params));
    if (pulled == reply.parameters().version()) break;
    if (attempt >= 4) {
      return absl::AbortedError(absl::StrCat("Resume at dbs_ps ", config_.address,
                                             ": the parameters kept moving (version ", pulled,
                                             " against ", reply.parameters().version(), ")"));
    }
  }
  ResumePoint info;
  info.finished = reply.finished();
  info.epoch = reply.epoch();
  info.step = reply.step();
  info.has_plan = reply.plan_ready();
  if (info.has_plan) {
    info.plan = FromProto(reply.plan());
    info.schedule = FromProto(reply.schedule());
  }
  if (!streams) DBS_RETURN_IF_ERROR(DecodeParameters(reply.parameters(), layout_, params));
  return info;
}

absl::StatusOr<int64_t> GrpcPsClient::PullParameters(int worker_id, absl::Span<float> params) {
  if (layout_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  if (Streams(params.size() * BytesPerValue(wire_dtype_))) return PullStreamed(worker_id, params);
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
  if (shm_slots_ != nullptr) {
    absl::StatusOr<StepOutcome> shared = PushShared(head, gradient, params);
    if (shared.ok() || shm_slots_ != nullptr) return shared;
    // The server forgot this worker's memory (a restart): the push goes over gRPC, and the
    // next one attaches again.
  }
  v1::PushGradientReply reply;
  int64_t version = 0;
  const size_t width = BytesPerValue(wire_dtype_);
  if (send && config_.stream_chunk_bytes > 0 && model * width > config_.stream_chunk_bytes) {
    head.set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    DBS_RETURN_IF_ERROR(PushStreamed(head, gradient, params, &reply, &version));
    return OutcomeOf(reply, version);
  }
  // A push with samples carries the gradient (GradientOnWire: its own memory, or encoded once
  // into a reused buffer); an empty one carries none.
  std::optional<GradientOnWire> bytes;
  std::optional<grpc::ByteBuffer> request;
  if (send) {
    head.set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    bytes.emplace(gradient, wire_dtype_, pool_.get());
    grpc::Slice slices[2] = {
        grpc::Slice(head.SerializeAsString() + GradientPiecePrefix(model, wire_dtype_)),
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

namespace {
// The memory files' names, which the opening side checks (SharedRegion::Open).
constexpr char kGradientRegion[] = "dbs-gradient";
constexpr char kParameterRegion[] = "dbs-parameters";
}  // namespace

void GrpcPsClient::MaybeAttach(int worker_id) {
  if (!config_.shared_memory || shm_tried_) return;
  shm_tried_ = true;
  const size_t model = static_cast<size_t>(TotalElements(layout_));
  const auto refused = [&](const std::string& why) {
    Detach();
    std::fprintf(stderr, "dbs_ps at %s shares no memory with this worker (%s): pushing over gRPC\n",
                 config_.address.c_str(), why.c_str());
  };
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(kGradientRegion, model * BytesPerValue(wire_dtype_));
  if (!region.ok()) return refused(std::string(region.status().message()));
  shm_gradient_ = std::move(*region);
  v1::AttachSharedMemoryRequest req;
  req.set_worker_id(worker_id);
  const RegionLocation mine = shm_gradient_->location();
  req.mutable_gradient()->set_pid(mine.pid);
  req.mutable_gradient()->set_fd(mine.fd);
  req.mutable_gradient()->set_bytes(mine.bytes);
  v1::AttachSharedMemoryReply reply;
  const grpc::Status status = WithRetry(
      [&](grpc::ClientContext* ctx) { return parameters_->AttachSharedMemory(ctx, req, &reply); });
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
      status.error_code() == grpc::StatusCode::CANCELLED) {
    // Not a refusal: the push that follows meets the same trouble and reports it, and the next
    // one tries again.
    Detach();
    shm_tried_ = false;
    return;
  }
  if (!status.ok()) return refused(status.error_message());
  RegionLocation theirs;
  theirs.pid = reply.parameters().pid();
  theirs.fd = reply.parameters().fd();
  theirs.bytes = reply.parameters().bytes();
  if (theirs.bytes != ParameterSlots::RegionBytes(model)) {
    return refused(absl::StrCat("its parameter slots are ", theirs.bytes, " bytes, not ",
                                ParameterSlots::RegionBytes(model)));
  }
  region = SharedRegion::Open(theirs, kParameterRegion);
  if (!region.ok()) return refused(std::string(region.status().message()));
  shm_params_ = std::move(*region);
  shm_slots_ = std::make_unique<ParameterSlots>(shm_params_.get(), model);
  if (!shm_told_) {
    shm_told_ = true;
    std::fprintf(stderr,
                 "dbs_ps at %s shares memory with this worker: each step's gradient and "
                 "parameters pass through it, not the socket (--shared_memory)\n",
                 config_.address.c_str());
  }
}

void GrpcPsClient::Detach() {
  shm_slots_.reset();
  shm_params_.reset();
  shm_gradient_.reset();
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
    EncodeValues(gradient, wire_dtype_, shm_gradient_->data());
  }
  grpc::Slice header(req.SerializeAsString());
  const grpc::ByteBuffer request(&header, 1);
  const grpc::Status status = WithRetry(
      [&](grpc::ClientContext* ctx) { return PushAttempt(ctx, request); }, /*waits=*/true);
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
      absl::StrContains(status.error_message(), "no shared memory attached")) {
    Detach();
    shm_tried_ = false;
    std::fprintf(stderr,
                 "dbs_ps at %s no longer shares memory with this worker (restarted?): this push "
                 "goes over gRPC, the next attaches again\n",
                 config_.address.c_str());
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
  if (shared && !shm_slots_->Read(version, params, wire_dtype_)) {
    // The slot moved on or was never written: the values come over gRPC.
    DBS_ASSIGN_OR_RETURN(const int64_t pulled, PullParameters(head.worker_id(), params));
    version = pulled;
  }
  return OutcomeOf(reply, version);
}

grpc::Status GrpcPsClient::PushAttempt(grpc::ClientContext* ctx, const grpc::ByteBuffer& request) {
  // Raw bytes both ways, on this thread, as the generated blocking stubs call (a callback call
  // would hand the answer over from one of gRPC's threads: two more wake-ups per step, which a
  // worker held to a CPU quota pays in throttled time).
  if (sessions_) {
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
      session_->stream.reset(
          grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
              channel_.get(), *session_method_, &session_->ctx));
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
    if (ended.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
      if (!ended.ok()) return ended;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "dbs_ps ended the push session");
    }
    sessions_ = false;  // an older dbs_ps: one call per push
    if (!Retarget(ctx)) return grpc::Status(grpc::StatusCode::CANCELLED, StopReason());
  }
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), *push_method_, ctx, request, &push_reply_);
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

absl::Status GrpcPsClient::PushStreamed(v1::PushGradientRequest head,
                                        absl::Span<const float> gradient, absl::Span<float> params,
                                        v1::PushGradientReply* reply, int64_t* version) {
  const WireDtype dtype = wire_dtype_;
  const size_t width = BytesPerValue(dtype);
  const size_t model = gradient.size();
  // At most kMaxStreamChunks chunks (the server's limit), however small --stream_chunk_kb.
  const size_t per_chunk = std::max({size_t{1}, config_.stream_chunk_bytes / width,
                                     (model + kMaxStreamChunks - 1) / kMaxStreamChunks});
  if (!streaming_told_) {
    streaming_told_ = true;
    std::fprintf(stderr,
                 "the gradient (%zu values, %s) is pushed as a stream of %zu chunks of at most "
                 "%zu KiB (--stream_chunk_kb)\n",
                 model, WireDtypeName(dtype), (model + per_chunk - 1) / per_chunk,
                 per_chunk * width >> 10);
  }
  GradientOnWire bytes(gradient, dtype, pool_.get());
  std::vector<grpc::ByteBuffer> chunks;
  for (size_t from = 0; from < model; from += per_chunk) {
    const size_t count = std::min(per_chunk, model - from);
    head.set_gradient_offset(static_cast<int64_t>(from));
    grpc::Slice slices[2] = {
        grpc::Slice(head.SerializeAsString() + GradientPiecePrefix(count, dtype)),
        bytes.Range(from, count)};
    chunks.emplace_back(slices, 2);
  }
  absl::Status parsed;
  auto call = [&](grpc::ClientContext* ctx) {
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel_.get(), *stream_method_, ctx));
    // The answer's first ranges come back while the last chunks still go out (the server
    // updates and sends each range once every worker's values for it are in), so the chunks
    // are written from a second thread while this one reads. A refused chunk ends the call:
    // Write fails, and Finish says why.
    std::thread writer([&] {
      for (size_t i = 0; i < chunks.size(); ++i) {
        grpc::WriteOptions options;
        if (i + 1 == chunks.size()) options.set_last_message();
        if (!stream->Write(chunks[i], options)) break;
      }
    });
    grpc::Status status;
    parsed = ReadValueChunks([&](grpc::ByteBuffer* m) { return stream->Read(m); }, ctx, reply,
                             params, version, &status,
                             [&] {
                               writer.join();
                               return stream->Finish();
                             });
    return parsed.ok() ? status : grpc::Status(grpc::StatusCode::DATA_LOSS, "");
  };
  grpc::Status status = WithRetry(call, /*waits=*/true);
  chunks.clear();
  DBS_RETURN_IF_ERROR(AwaitGradientReturned(bytes, "PushGradientStream"));
  if (!parsed.ok()) {
    return absl::Status(parsed.code(), absl::StrCat("PushGradientStream at dbs_ps ",
                                                    config_.address, ": ", parsed.message()));
  }
  return Annotate(status, "PushGradientStream");
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
