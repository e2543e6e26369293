#include "server/parameter_service.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/plan_codec.h"
#include "common/raw_call.h"
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

grpc::ServerUnaryReactor* ParameterServiceImpl::PushGradient(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* in,
                                                             grpc::ByteBuffer* out) {
  return ServeRaw<PushRequest, PushAnswer>(
      ctx, in, out, "PushGradient", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoPushGradient(c, req, reply, r);
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

absl::Status ParameterServiceImpl::Allowed(grpc::CallbackServerContext* ctx, int worker_id) const {
  return authenticate_(worker_id, ClientMetadata(ctx, kWorkerTokenKey));
}

void ParameterServiceImpl::DoRegisterModel(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterModelRequest& request,
                                           ParametersAnswer* reply, WaitingReactor* reactor) {
  const v1::RegisterModelRequest* req = &request;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  absl::StatusOr<ModelLayout> layout = LayoutOf(req->parameters(), !req->layout_only());
  if (!layout.ok()) return Answer(reactor, layout.status());
  if (req->layout_only() && !store_->registered()) {
    return Answer(reactor, absl::FailedPreconditionError(
                               "no model is registered yet: send the initial values"));
  }
  // Only the first registration's values are kept; later ones are checked against its layout
  // and get the stored values, so their (possibly large) values are not decoded.
  std::vector<float> initial;
  if (!store_->registered()) {
    initial.resize(static_cast<size_t>(TotalElements(*layout)));
    absl::Status decoded = DecodeTensors(req->parameters(), *layout, true, absl::MakeSpan(initial));
    if (!decoded.ok()) return Answer(reactor, decoded);
  }
  absl::StatusOr<ParameterSnapshot> snap = store_->Register(*layout, initial);
  if (snap.ok()) {
    reply->head.set_version(snap->version);
    reply->values = ValuesOf(*snap);
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
    reply->values = ValuesOf(*snap);
  }
  return Answer(reactor, snap.status());
}

grpc::Slice ParameterServiceImpl::ValuesOf(const ParameterSnapshot& snap) {
  absl::MutexLock lock(&values_mu_);
  if (values_of_.values != snap.values || values_of_.version != snap.version) {
    const size_t count = snap.values->size();
    uint8_t* data = nullptr;
    values_ = pool_->Acquire(ValuesFieldSize(snap.version, count, wire_dtype_), &data);
    WriteValuesField(snap.version, wire_dtype_, *snap.values, data);
    values_of_ = snap;  // holds the snapshot: its buffer is not reused while cached
  }
  return values_;
}

void ParameterServiceImpl::DoPushGradient(grpc::CallbackServerContext* ctx,
                                          const PushRequest& request, PushAnswer* reply,
                                          WaitingReactor* reactor) {
  const v1::PushGradientRequest* req = &request.header;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  if (req->num_samples() < 0) {
    return Answer(reactor, absl::InvalidArgumentError("num_samples is negative"));
  }
  if (!std::isfinite(req->loss_sum())) {
    return Answer(reactor, absl::InvalidArgumentError("loss_sum is not finite"));
  }
  if (request.gradient->bytes > 0 && static_cast<WireDtype>(req->wire_dtype()) != wire_dtype_) {
    return Answer(reactor, absl::InvalidArgumentError(absl::StrCat(
                               "the gradient travels in ",
                               WireDtypeName(static_cast<WireDtype>(req->wire_dtype())),
                               "; this job's wire dtype is ", WireDtypeName(wire_dtype_))));
  }
  GradientPush push;
  push.worker_id = req->worker_id();
  push.epoch = req->epoch();
  push.step = req->step();
  push.num_samples = req->num_samples();
  push.loss_sum = req->loss_sum();
  push.compute_seconds = std::isfinite(req->compute_seconds()) ? req->compute_seconds() : 0.0;
  // Who, which step and how many samples are checked before the values are read: a push the
  // barrier would refuse costs no pass over its (possibly 512 MiB) payload.
  if (absl::Status pre = aggregator_->Precheck(push); !pre.ok()) return Answer(reactor, pre);
  if (req->num_samples() > 0 && !store_->registered()) {
    return Answer(reactor, absl::FailedPreconditionError("no model registered yet"));
  }
  // The gradient stays in the received message (no copy) until the aggregator has summed it.
  if (request.gradient->bytes > 0 || req->num_samples() > 0) push.gradient = request.gradient;
  const int worker = req->worker_id();
  const uint64_t ticket =
      aggregator_->Push(push, [this, reactor, reply, worker](const absl::StatusOr<StepResult>& r) {
        if (r.ok()) {
          v1::PushGradientReply* head = &reply->head;
          if (r->revisions != nullptr) {
            auto rev = r->revisions->find(worker);
            if (rev != r->revisions->end()) ToProto(rev->second, head->mutable_revision());
          }
          head->set_epoch(r->epoch);
          head->set_step(r->step);
          head->set_global_loss(r->global_loss);
          head->set_global_samples(r->global_samples);
          reply->values = ValuesOf(r->parameters);
        }
        Answer(reactor, r.status());
      });
  if (ticket != 0) {
    reactor->SetWithdraw([agg = aggregator_, ticket] { return agg->CancelWait(ticket); });
  }
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
