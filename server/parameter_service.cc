#include "server/parameter_service.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/plan_codec.h"
#include "common/tensor_codec.h"

namespace dbs {
namespace {

void FillParameters(const ModelLayout& layout, const ParameterSnapshot& snap, v1::Parameters* out) {
  out->set_version(snap.version);
  EncodeTensors(layout, *snap.values, out->mutable_parameters());
}

}  // namespace

absl::Status ParameterServiceImpl::Allowed(grpc::CallbackServerContext* ctx, int worker_id) const {
  return authenticate_(worker_id, ClientMetadata(ctx, kWorkerTokenKey));
}

grpc::ServerUnaryReactor* ParameterServiceImpl::RegisterModel(grpc::CallbackServerContext* ctx,
                                                              const v1::RegisterModelRequest* req,
                                                              v1::Parameters* reply) {
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return FinishUnary(ctx, a);
  absl::StatusOr<ModelLayout> layout = LayoutOf(req->parameters());
  if (!layout.ok()) return FinishUnary(ctx, layout.status());
  std::vector<float> initial(static_cast<size_t>(TotalElements(*layout)));
  absl::Status decoded = DecodeTensors(req->parameters(), *layout, true, absl::MakeSpan(initial));
  if (!decoded.ok()) return FinishUnary(ctx, decoded);
  absl::StatusOr<ParameterSnapshot> snap = store_->Register(*layout, initial);
  if (snap.ok()) FillParameters(*layout, *snap, reply);
  return FinishUnary(ctx, snap.status());
}

grpc::ServerUnaryReactor* ParameterServiceImpl::PullParameters(grpc::CallbackServerContext* ctx,
                                                               const v1::PullParametersRequest* req,
                                                               v1::Parameters* reply) {
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return FinishUnary(ctx, a);
  absl::StatusOr<ParameterSnapshot> snap = store_->Snapshot();
  if (snap.ok()) FillParameters(store_->layout(), *snap, reply);
  return FinishUnary(ctx, snap.status());
}

grpc::ServerUnaryReactor* ParameterServiceImpl::PushGradient(grpc::CallbackServerContext* ctx,
                                                             const v1::PushGradientRequest* req,
                                                             v1::PushGradientReply* reply) {
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return FinishUnary(ctx, a);
  if (req->num_samples() < 0) {
    return FinishUnary(ctx, absl::InvalidArgumentError("num_samples is negative"));
  }
  if (!std::isfinite(req->loss_sum())) {
    return FinishUnary(ctx, absl::InvalidArgumentError("loss_sum is not finite"));
  }
  // Callback threads are pooled, so a per-thread scratch buffer is reused across steps.
  thread_local std::vector<float> scratch;
  const ModelLayout layout = store_->layout();
  GradientPush push;
  push.worker_id = req->worker_id();
  push.epoch = req->epoch();
  push.step = req->step();
  push.num_samples = req->num_samples();
  push.loss_sum = req->loss_sum();
  push.compute_seconds = std::isfinite(req->compute_seconds()) ? req->compute_seconds() : 0.0;
  if (req->num_samples() > 0 || req->gradients_size() > 0) {
    if (layout.empty()) {
      return FinishUnary(ctx, absl::FailedPreconditionError("no model registered yet"));
    }
    scratch.resize(static_cast<size_t>(TotalElements(layout)));
    absl::Status decoded =
        DecodeTensors(req->gradients(), layout, /*require_finite=*/true, absl::MakeSpan(scratch));
    if (!decoded.ok()) {
      return FinishUnary(
          ctx, absl::InvalidArgumentError(absl::StrCat("gradient rejected: ", decoded.message())));
    }
    push.gradient = scratch;
  }
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const int worker = req->worker_id();
  aggregator_->Push(push, [reactor, reply, layout, worker](const absl::StatusOr<StepResult>& r) {
    if (r.ok()) {
      if (r->revisions != nullptr) {
        auto rev = r->revisions->find(worker);
        if (rev != r->revisions->end()) ToProto(rev->second, reply->mutable_revision());
      }
      reply->set_epoch(r->epoch);
      reply->set_step(r->step);
      reply->set_global_loss(r->global_loss);
      reply->set_global_samples(r->global_samples);
      FillParameters(layout, r->parameters, reply->mutable_parameters());
    }
    reactor->Finish(ToGrpcStatus(r.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Resume(grpc::CallbackServerContext* ctx,
                                                       const v1::ResumeRequest* req,
                                                       v1::ResumeReply* reply) {
  if (!resume_) return FinishUnary(ctx, absl::UnimplementedError("resume is not wired"));
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return FinishUnary(ctx, a);
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
  return FinishUnary(ctx, rp.status());
}

}  // namespace dbs
