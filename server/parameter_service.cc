#include "server/parameter_service.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/raw_call.h"
#include "common/status_macros.h"
#include "common/step_wire.h"
#include "common/tensor_codec.h"

namespace dbs {
namespace {

void FillParameters(const ModelLayout& layout, const ParameterSnapshot& snap, v1::Parameters* out) {
  out->set_version(snap.version);
  EncodeTensors(layout, *snap.values, out->mutable_parameters());
}

}  // namespace

grpc::ServerUnaryReactor* ParameterServiceImpl::RegisterModel(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* in,
                                                              grpc::ByteBuffer* out) {
  return ServeRaw<v1::RegisterModelRequest, ParametersAnswer>(
      ctx, in, out, "RegisterModel", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoRegisterModel(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::PullParameters(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* in,
                                                               grpc::ByteBuffer* out) {
  return ServeRaw<v1::PullParametersRequest, ParametersAnswer>(
      ctx, in, out, "PullParameters", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoPullParameters(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Resume(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* in,
                                                       grpc::ByteBuffer* out) {
  return ServeRaw<v1::ResumeRequest, v1::ResumeReply>(
      ctx, in, out, "Resume", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoResume(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::AttachSharedMemory(grpc::CallbackServerContext* ctx,
                                                                   const grpc::ByteBuffer* in,
                                                                   grpc::ByteBuffer* out) {
  return ServeRaw<v1::AttachSharedMemoryRequest, v1::AttachSharedMemoryReply>(
      ctx, in, out, "AttachSharedMemory", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        Answer(r, DoAttachSharedMemory(c, req, reply));
      });
}

absl::Status ParameterServiceImpl::DoAttachSharedMemory(grpc::CallbackServerContext* ctx,
                                                        const v1::AttachSharedMemoryRequest& req,
                                                        v1::AttachSharedMemoryReply* reply) {
  DBS_RETURN_IF_ERROR(Allowed(ctx, req.worker_id()));
  if (!shared_memory_) {
    return absl::FailedPreconditionError(
        "this dbs_ps shares no memory (--shared_memory=false, or a shard of a sharded job): push "
        "over gRPC");
  }
  if (!store_->registered()) return absl::FailedPreconditionError("register the model first");
  RegionLocation where;
  where.pid = req.gradient().pid();
  where.fd = req.gradient().fd();
  where.bytes = req.gradient().bytes();
  DBS_ASSIGN_OR_RETURN(
      const RegionLocation slots,
      shm_.Attach(req.worker_id(), where, static_cast<size_t>(TotalElements(store_->layout()))));
  reply->mutable_parameters()->set_pid(slots.pid);
  reply->mutable_parameters()->set_fd(slots.fd);
  reply->mutable_parameters()->set_bytes(slots.bytes);
  return absl::OkStatus();
}

void ParameterServiceImpl::Registered() {
  if (freed_memory_hook_ && !registered_told_.exchange(true)) freed_memory_hook_();
}

void ParameterServiceImpl::ServeSharedMemory(bool on) {
  shared_memory_ = on;
  store_->SetSnapshotMemory(on ? &shm_ : nullptr);
}

ValuesField ParameterServiceImpl::AnswerValues(const ParameterSnapshot& snap, int worker,
                                               bool shared) {
  if (shared && shm_.SharesSlotOf(snap.version, worker)) {
    v1::PushGradientReply field;
    v1::FlatParameters* values = field.mutable_values();
    values->set_version(snap.version);
    values->set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    values->set_in_shared_memory(true);
    return ValuesField{grpc::Slice(field.SerializeAsString()), grpc::Slice()};
  }
  // A version that is not in its slot lies elsewhere (the slot was held when its update began)
  // and goes over gRPC.
  if (shared && hooks_.observer != nullptr) hooks_.observer->OnSharedAnswerOverGrpc();
  answers_.AnsweredOverSocket();
  return FieldOf(answers_.ValuesOf(snap));
}

namespace {
// A follower shard answers calls ahead of its leader UNAVAILABLE at once (it never waits on a
// callback thread); the worker comes back in a few ms, which is when the leader's word arrives.
absl::Status PushBackIfUnavailable(grpc::CallbackServerContext* ctx, absl::Status s) {
  if (absl::IsUnavailable(s)) ctx->AddTrailingMetadata(kRetryAfterMsKey, "2");
  return s;
}
}  // namespace

absl::Status ParameterServiceImpl::Allowed(grpc::CallbackServerContext* ctx, int worker_id) const {
  return PushBackIfUnavailable(
      ctx, authenticate_(worker_id, ClientMetadata(ctx, kWorkerTokenKey), ClientIdentity(ctx)));
}

namespace {

// The answer to a worker that may not send the model's initial values now (RegistrationClaim).
absl::Status ClaimedBy(int holder) {
  return absl::AbortedError(
      holder >= 0 ? absl::StrCat("worker ", holder,
                                 " is sending the model's initial values; ask again once the "
                                 "model is registered")
                  : "this worker's turn to send the model's initial values ran out; ask again "
                    "(another worker may send them first)");
}

}  // namespace

void ParameterServiceImpl::DoRegisterModel(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterModelRequest& request,
                                           ParametersAnswer* reply, WaitingReactor* reactor) {
  const v1::RegisterModelRequest* req = &request;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  absl::StatusOr<ModelLayout> layout = LayoutOf(req->parameters(), !req->layout_only());
  if (!layout.ok()) return Answer(reactor, layout.status());
  if (req->layout_only() && !store_->registered()) {
    // One worker sends its values, the others wait for them (RegistrationClaim).
    int holder = -1;
    if (!claim_.Take(req->worker_id(), &holder)) return Answer(reactor, ClaimedBy(holder));
    // The holder registers before it lets the claim go, so a claim taken just after it did
    // finds the model here: the stored values go back below and nobody sends a second copy.
    if (!store_->registered()) {
      return Answer(reactor, absl::FailedPreconditionError(
                                 "no model is registered yet: send the initial values"));
    }
    claim_.Release(req->worker_id());
  }
  // Only the first registration's values are kept; later ones are checked against its layout
  // and get the stored values, so their (possibly large) values are not decoded. Values sent
  // while another worker holds the turn to send them are refused (RegistrationClaim).
  std::vector<float> initial;
  if (!req->layout_only() && !store_->registered()) {
    int holder = -1;
    if (!claim_.Take(req->worker_id(), &holder)) return Answer(reactor, ClaimedBy(holder));
  }
  if (!store_->registered()) {
    initial.resize(static_cast<size_t>(TotalElements(*layout)));
    absl::Status decoded = DecodeTensors(req->parameters(), *layout, true, absl::MakeSpan(initial));
    if (!decoded.ok()) {
      claim_.Release(req->worker_id());
      return Answer(reactor, decoded);
    }
  }
  const bool first = !initial.empty();
  absl::StatusOr<ParameterSnapshot> snap = store_->Register(*layout, initial);
  claim_.Release(req->worker_id());
  if (first && snap.ok()) {
    std::vector<float>().swap(initial);
    Registered();
  }
  if (snap.ok()) {
    reply->head.set_version(snap->version);
    reply->values = FieldOf(answers_.ValuesOf(*snap));
    if (model_accepted_hook_) model_accepted_hook_(req->worker_id());
  }
  return Answer(reactor, snap.status());
}

void ParameterServiceImpl::DoPullParameters(grpc::CallbackServerContext* ctx,
                                            const v1::PullParametersRequest& request,
                                            ParametersAnswer* reply, WaitingReactor* reactor) {
  const v1::PullParametersRequest* req = &request;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  absl::StatusOr<ParameterSnapshot> snap = store_->Snapshot();
  if (snap.ok()) {
    reply->head.set_version(snap->version);
    reply->values = FieldOf(answers_.ValuesOf(*snap));
  }
  return Answer(reactor, snap.status());
}

absl::Status ParameterServiceImpl::CheckPushHeader(grpc::CallbackServerContext* ctx,
                                                   const PushRequest& request, GradientPush* push) {
  const v1::PushGradientRequest* req = &request.header;
  DBS_RETURN_IF_ERROR(Allowed(ctx, req->worker_id()));
  if (req->num_samples() < 0) return absl::InvalidArgumentError("num_samples is negative");
  // A loss steers nothing, but a step's and an epoch's sums of them must stay finite.
  if (!std::isfinite(req->loss_sum()) ||
      std::abs(req->loss_sum()) > kMaxLossPerSample * std::max<int64_t>(1, req->num_samples())) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_sum ", req->loss_sum(), " over ", req->num_samples(),
                     " samples is not finite or beyond ", kMaxLossPerSample, " a sample"));
  }
  if (request.gradient->bytes > 0 && static_cast<WireDtype>(req->wire_dtype()) != wire_dtype_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the gradient travels in ", WireDtypeName(static_cast<WireDtype>(req->wire_dtype())),
        "; this job's wire dtype is ", WireDtypeName(wire_dtype_)));
  }
  push->worker_id = req->worker_id();
  push->epoch = req->epoch();
  push->step = req->step();
  push->num_samples = req->num_samples();
  push->loss_sum = req->loss_sum();
  push->compute_seconds = std::isfinite(req->compute_seconds()) ? req->compute_seconds() : 0.0;
  if (gate_) {
    DBS_RETURN_IF_ERROR(
        PushBackIfUnavailable(ctx, gate_(push->worker_id, push->epoch, push->step)));
  }
  // Who, which step and how many samples are checked before the values are read: a push the
  // barrier would refuse costs no pass over its (possibly 512 MiB) payload.
  DBS_RETURN_IF_ERROR(aggregator_->Precheck(*push));
  if (req->num_samples() > 0 && !store_->registered()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return absl::OkStatus();
}

absl::StatusOr<GradientPush> ParameterServiceImpl::AcceptPush(grpc::CallbackServerContext* ctx,
                                                              const PushRequest& request) {
  GradientPush push;
  DBS_RETURN_IF_ERROR(CheckPushHeader(ctx, request, &push));
  std::shared_ptr<const WirePayload> gradient = request.gradient;
  if (request.header.gradient_in_shared_memory()) {
    DBS_ASSIGN_OR_RETURN(gradient,
                         shm_.Gradient(request.header.worker_id(), request.header.num_samples(),
                                       static_cast<WireDtype>(request.header.wire_dtype()),
                                       request.gradient->bytes));
  }
  if (gradient->bytes > 0 || push.num_samples > 0) push.gradient = std::move(gradient);
  return push;
}

void ParameterServiceImpl::DoResume(grpc::CallbackServerContext* ctx,
                                    const v1::ResumeRequest& request, v1::ResumeReply* reply,
                                    WaitingReactor* reactor) {
  const v1::ResumeRequest* req = &request;
  if (!resume_) return Answer(reactor, absl::UnimplementedError("resume is not wired"));
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  ParameterSnapshot parameters;
  absl::StatusOr<ResumePoint> rp = resume_(req->worker_id(), &parameters);
  if (rp.ok()) {
    reply->set_finished(rp->finished);
    reply->set_epoch(rp->epoch);
    reply->set_step(rp->step);
    reply->set_plan_ready(rp->has_plan);
    if (rp->has_plan) {
      ToProto(rp->plan, reply->mutable_plan());
      ToProto(rp->schedule, reply->mutable_schedule());
    }
    FillParameters(store_->layout(), parameters, reply->mutable_parameters());
  }
  return Answer(reactor, rp.status());
}

}  // namespace dbs
